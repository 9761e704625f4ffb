"""Runtime checks of a valid config: what the config's rules cannot see, checked before Ray starts.

``validate_single_controller_config`` checks the config against itself. These checks look at
the machine the run would start on: that the model folder exists and holds a model and a
tokenizer (a hub id cannot be downloaded: TandemRL loads local folders), that the dataset file
exists and every line parses, that each distillation teacher's folder holds a model with the
student's tokenizer and that every dataset row has a teacher, that ``env.target`` imports (a custom sampler's ``target`` is
checked by the config rules),
and that ``policy.device: cuda`` has a GPU to run on. ``tandemrl validate`` runs them unless
``--no-runtime-checks`` (a login node without the data or the GPUs); ``tandemrl train`` runs
them before anything starts, so a broken path is one line after a second, not a Ray traceback
after half a minute.

``runtime_problems(cfg)`` returns one message per problem, each naming its dotpath.
"""

from __future__ import annotations

import re
from pathlib import Path

from tandemrl.config.models import MasterConfig


class RunRefused(Exception):
    """The run cannot start as asked; nothing was started or changed. One line per problem."""

    def __init__(self, problems: list[str]) -> None:
        super().__init__("; ".join(problems))
        self.problems = problems


# "org/name" or "name" that is not a folder here: what a user copies from a model hub.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def runtime_problems(cfg: MasterConfig) -> list[str]:
    """Every runtime problem of ``cfg`` on this machine, one message each."""
    problems: list[str] = []
    problems += _model_problems("policy.model_name", cfg.policy.model_name, needs_tokenizer=True)
    if cfg.policy.tokenizer.name is not None:
        problems += _model_problems(
            "policy.tokenizer.name", cfg.policy.tokenizer.name, needs_tokenizer=True, tokenizer=True
        )
    if cfg.value is not None and cfg.value.model_name is not None:
        problems += _model_problems("value.model_name", cfg.value.model_name, needs_tokenizer=False)
    problems += _vision_model_problems(cfg)
    problems += _dataset_problems(cfg)
    problems += _teacher_problems(cfg)
    problems += _import_problems(cfg)
    problems += _nemo_gym_problems(cfg)
    problems += _device_problems(cfg)
    problems += installed_version_problems()
    return problems


def installed_version_problems(distribution: str = "tandemrl") -> list[str]:
    """Each dependency of ``distribution`` that is missing or installed at a version outside
    the range its metadata asks for (``pyproject.toml``; exact versions live in
    ``constraints.txt``). A GPU machine's own torch and transformers are fine when in range."""
    from importlib import metadata

    from packaging.requirements import Requirement

    try:
        requirements = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return []  # running from a source tree that was not installed: nothing to compare
    problems = []
    for text in requirements:
        requirement = Requirement(text)
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue  # an optional extra's dependency
        try:
            installed = metadata.version(requirement.name)
        except metadata.PackageNotFoundError:
            problems.append(
                f"{requirement.name} is not installed ({distribution} needs {requirement}); "
                f"pip install '{requirement}'"
            )
            continue
        if requirement.specifier and not requirement.specifier.contains(
            installed, prereleases=True
        ):
            problems.append(
                f"{requirement.name} {installed} is installed, but {distribution} needs "
                f"{requirement.name}{requirement.specifier}; install a version in that range"
            )
    return problems


def _model_problems(
    key: str, name: str, *, needs_tokenizer: bool, tokenizer: bool = False
) -> list[str]:
    from tandemrl.models import TINY_PRESETS, TINY_SCHEME

    if name.startswith(TINY_SCHEME):
        preset = name[len(TINY_SCHEME) :]
        if preset in TINY_PRESETS:
            return []
        choices = sorted(TINY_SCHEME + known for known in TINY_PRESETS)
        return [f"{key}={name!r}: unknown tiny preset {preset!r}; choose one of {choices}"]
    path = Path(name).expanduser()
    if not path.exists():
        if _HUB_ID.match(name):
            return [
                f"{key}={name!r}: no such folder. TandemRL loads local model folders and "
                f"downloads nothing; fetch it first (e.g. `hf download {name} --local-dir "
                f"models/{name.split('/')[-1]}`) and set {key} to that folder"
            ]
        return [f"{key}={name!r}: no such folder"]
    if not path.is_dir():
        return [f"{key}={name!r}: {path} is a file; give the model's folder"]
    problems = []
    if not tokenizer and not (path / "config.json").is_file():
        problems.append(
            f"{key}={name!r}: {path} has no config.json; point it at a folder written by "
            "save_pretrained (config.json, *.safetensors, tokenizer files)"
        )
    elif not tokenizer and not any(path.glob("*.safetensors")) and not any(path.glob("*.bin")):
        problems.append(f"{key}={name!r}: {path} holds no weights (*.safetensors)")
    if needs_tokenizer and not any((path / file).is_file() for file in _TOKENIZER_FILES):
        problems.append(
            f"{key}={name!r}: {path} holds no tokenizer ({', '.join(_TOKENIZER_FILES)}); "
            "save the tokenizer beside the model or set policy.tokenizer.name"
        )
    return problems


def _vision_model_problems(cfg: MasterConfig) -> list[str]:
    """A model folder that does not fit ``policy.is_vlm`` (a tiny preset is checked by the
    config rules, from its definition)."""
    name = cfg.policy.model_name
    path = Path(name).expanduser()
    if name.startswith("tiny://") or not (path / "config.json").is_file():
        return []  # a missing folder is reported by _model_problems
    from tandemrl.models.vision import VisionModelError, vlm_folder_problem

    try:
        problem = vlm_folder_problem(path, is_vlm=cfg.policy.is_vlm, name=name)
    except VisionModelError as error:
        return [str(error)]
    return [] if problem is None else [problem]


def _dataset_problems(cfg: MasterConfig) -> list[str]:
    from tandemrl.data.dataset import DatasetError, load_prompt_records, load_validation_records

    problems = []
    try:
        load_prompt_records(cfg.data, gym_rows=cfg.env.name == "nemo_gym", images=cfg.policy.is_vlm)
    except DatasetError as error:
        problems.append(str(error))
    except (OSError, UnicodeDecodeError) as error:
        problems.append(f"data.dataset={cfg.data.dataset!r}: cannot read it ({error})")
    if cfg.data.validation is not None and cfg.validates:
        try:
            load_validation_records(cfg.data, max_samples=cfg.algorithm.max_val_samples)
        except DatasetError as error:
            problems.append(str(error))
        except (OSError, UnicodeDecodeError) as error:
            problems.append(f"data.validation={cfg.data.validation!r}: cannot read it ({error})")
    return problems


def _teacher_problems(cfg: MasterConfig) -> list[str]:
    """On-policy distillation: each teacher's folder holds a model and the student's tokenizer,
    and every row of the dataset has a teacher (``tandemrl.config.distillation``)."""
    block = cfg.on_policy_distillation
    if block is None:
        return []
    problems: list[str] = []
    usable = []
    for index, teacher in enumerate(block.teachers):
        key = f"on_policy_distillation.teachers.{index}.model_name"
        found = _model_problems(key, teacher.model_name, needs_tokenizer=True)
        problems += found
        if not found:
            usable.append((key, teacher.model_name))
    problems += _teacher_tokenizer_problems(cfg, usable)
    problems += _unrouted_rows(cfg)
    return problems


def _teacher_tokenizer_problems(cfg: MasterConfig, teachers: list[tuple[str, str]]) -> list[str]:
    """Teachers whose tokenizer maps text to other ids than the student's (folders loaded;
    two tiny:// presets were compared by validation already)."""
    from tandemrl.models import (
        TINY_SCHEME,
        load_tokenizer,
        resolve_model_path,
        resolve_tokenizer_path,
        tokenizer_signature,
    )

    if _model_problems("policy.model_name", cfg.policy.model_name, needs_tokenizer=True):
        return []  # reported already
    student_name = cfg.policy.tokenizer.name or cfg.policy.model_name
    folders = [name for _, name in teachers if not name.startswith(TINY_SCHEME)]
    if not folders and student_name.startswith(TINY_SCHEME):
        return []
    signatures: dict[str, str] = {}

    def signature(model_name: str, tokenizer_name: str | None = None) -> str:
        if model_name not in signatures or tokenizer_name is not None:
            folder = resolve_model_path(model_name)
            path = resolve_tokenizer_path(tokenizer_name, folder)
            signatures[model_name] = tokenizer_signature(load_tokenizer(path))
        return signatures[model_name]

    student = signature(cfg.policy.model_name, cfg.policy.tokenizer.name)
    return [
        f"{key}={name!r}: its tokenizer differs from the student's ({student_name!r}: another "
        "vocabulary or other special token ids); a teacher scores the student's own token ids, "
        "so both must share one tokenizer — pick a teacher trained with the student's tokenizer"
        for key, name in teachers
        if signature(name) != student
    ]


def _unrouted_rows(cfg: MasterConfig, shown: int = 3) -> list[str]:
    """Dataset rows no teacher serves (a JSONL dataset; built-in ones are checked by
    validation)."""
    from tandemrl.config.distillation import TeacherRoutes, unrouted_row_message
    from tandemrl.data.dataset import DatasetError, load_prompt_records

    block = cfg.on_policy_distillation
    assert block is not None
    if cfg.data.dataset is None or cfg.data.dataset.startswith("builtin://"):
        return []
    try:
        records = load_prompt_records(cfg.data)
    except (DatasetError, OSError, UnicodeDecodeError):
        return []  # reported by _dataset_problems
    routes = TeacherRoutes.from_config(block)
    unrouted = [
        (number, record)
        for number, record in enumerate(records, start=1)
        if routes.route(record.task_source, record.agent_ref) is None
    ]
    problems = [
        unrouted_row_message(
            record.task_source, record.agent_ref, f"data.dataset={cfg.data.dataset!r} row {number}"
        )
        for number, record in unrouted[:shown]
    ]
    if len(unrouted) > shown:
        problems.append(
            f"on_policy_distillation.teachers: {len(unrouted) - shown} more row(s) of "
            f"{cfg.data.dataset!r} have no teacher"
        )
    return problems


def _import_problems(cfg: MasterConfig) -> list[str]:
    problems = []
    if cfg.env.name in ("custom", "agent") and cfg.env.target:
        from tandemrl.agents import agent_class
        from tandemrl.envs import environment_class

        try:
            # Imports through env.python_path, as the run will.
            if cfg.env.name == "agent":
                agent_class(cfg.env)
            else:
                environment_class(cfg.env)
        except (ImportError, TypeError, ValueError) as error:
            problems.append(
                f"{error} (the module must be importable by `tandemrl train`: installed, or on "
                "PYTHONPATH; see docs/environments.md)"
            )
        except Exception as error:  # user code failing at import time
            problems.append(
                f"env.target={cfg.env.target!r}: importing it raised {type(error).__name__}: "
                f"{error}"
            )
    return problems


def _nemo_gym_problems(cfg: MasterConfig) -> list[str]:
    """env.name: nemo_gym: the Gym venv exists and imports Gym (else: how to build it)."""
    if cfg.env.name != "nemo_gym":
        return []
    from tandemrl.nemo_gym.venv import GymVenvMissing, check_gym_venv

    try:
        check_gym_venv(cfg.env.nemo_gym.venv)
    except GymVenvMissing as error:
        return [str(error)]
    return []


def _device_problems(cfg: MasterConfig) -> list[str]:
    if cfg.policy.device != "cuda" or cfg.cluster.address is not None:
        return []  # on a cluster of its own, the GPUs are the cluster's, not this machine's
    import torch

    if torch.cuda.is_available():
        return []
    return [
        "policy.device: cuda, but torch sees no CUDA device on this machine "
        f"(torch {torch.__version__}); set policy.device: cpu (or auto), or run on a machine "
        "with a GPU and a CUDA build of torch"
    ]
