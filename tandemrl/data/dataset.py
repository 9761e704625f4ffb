"""Prompt datasets: JSONL files mapped through ``data:`` and the built-in datasets.

``load_prompt_records(cfg)`` returns the dataset as an ordered list of ``PromptRecord``.
Sources (``data.dataset``):

- a JSONL file: one JSON object per line; ``data.prompt_key`` and ``data.answer_key`` are
  required, ``data.task_source_key`` and ``data.agent_ref_key`` optional; any other field is
  kept in the record's metadata. With ``data.prompt_format: chat`` a row may give a whole
  conversation in ``data.messages_key`` instead of a prompt (kept in the metadata; the record's
  prompt is then its last user message). Blank lines are skipped; any bad line is an error that
  names the file, the line number and the field.
- ``builtin://counting``: ``data.num_prompts`` prompts of three random digits and ``=``
  (``583=`` → ``456``), drawn from ``random.Random(data.seed)`` so every run gets the same list.
- ``builtin://math``: the bundled ``math_small.jsonl`` (arithmetic such as ``12+7=``); its
  size is fixed, so ``data.num_prompts`` does not apply to it.
- ``builtin://math-heldout``: 200 more problems of the same kinds, none of them in
  ``builtin://math`` (``math_heldout.jsonl``), for measuring accuracy on problems a run did
  not train on.
- ``builtin://shape-colour`` and ``builtin://count-squares``: ``data.num_prompts`` images of
  a coloured shape (the answer its colour's letter) or of 1-4 squares (the answer their
  count), for a vision-language model (``shapes.py``).

With ``images=True`` (``policy.is_vlm``) every row must hold ``data.image_key``; a row without
it is an error naming the file and line. The field's value stays in the record's metadata,
undecoded: the rollout decodes it (``images.py``) when the prompt is generated, so a bad image
is a data failure of that one prompt, not of the whole dataset.

``load_validation_records(cfg, max_samples=...)`` reads ``data.validation`` the same way, with
the same field mapping; ``builtin://counting`` there draws from ``random.Random(data.seed +
VALIDATION_SEED_OFFSET)``, so its prompts are not the training list's order (the task has only
1000 distinct prompts, so they are not disjoint from it either). ``max_samples`` keeps the first
prompts in stored order.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from tandemrl.config.models import DataConfig
from tandemrl.data.prompt_format import check_messages, last_user_content
from tandemrl.data.shapes import count_squares_rows, shape_colour_rows
from tandemrl.envs.counting import continue_count

BUILTIN_PREFIX = "builtin://"
# What data.dataset: null reads (validation allows it only with a tiny:// model).
DEFAULT_DATASET = "builtin://counting"
COUNTING_PROMPT_DIGITS = 3
MATH_SMALL_FILE = "math_small.jsonl"
MATH_HELDOUT_FILE = "math_heldout.jsonl"
# builtin://counting as data.validation draws its prompts with data.seed + this.
VALIDATION_SEED_OFFSET = 1_000_003


class DatasetError(ValueError):
    """A dataset that cannot be loaded; the message names the file, line and field."""


@dataclass(frozen=True)
class PromptRecord:
    """One dataset entry, before the dataloader places it in an epoch."""

    prompt: str
    answer: Any = None
    task_source: str | None = None
    agent_ref: str | None = None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_json_dict(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "task_source": self.task_source,
            "agent_ref": self.agent_ref,
            "metadata": self.metadata,
        }


def dataset_fingerprint(records: list[PromptRecord]) -> str:
    """sha256 over the records in order (prompt, answer, task_source, agent_ref, metadata)."""
    digest = hashlib.sha256()
    for record in records:
        line = json.dumps(record.to_json_dict(), sort_keys=True, separators=(",", ":"), default=str)
        digest.update(line.encode("utf-8"))
        digest.update(b"\n")
    return digest.hexdigest()


def generate_counting_records(num_prompts: int, seed: int) -> list[PromptRecord]:
    """``num_prompts`` counting prompts from a private ``random.Random(seed)``."""
    rng = random.Random(seed)
    records = []
    for _ in range(num_prompts):
        digits = [rng.randrange(10) for _ in range(COUNTING_PROMPT_DIGITS)]
        prompt = "".join(str(digit) for digit in digits) + "="
        records.append(PromptRecord(prompt=prompt, answer=continue_count(digits[-1])))
    return records


def _optional_string(row: dict[str, Any], key: str, where: str, dotpath: str) -> str | None:
    value = row.get(key)
    if value is None or isinstance(value, str):
        return value
    raise DatasetError(
        f"{where}: field {key!r} ({dotpath}) must be a string, got {type(value).__name__}"
    )


def parse_jsonl_line(
    line: str, cfg: DataConfig, where: str, *, images: bool = False
) -> PromptRecord:
    """One JSONL line → record; ``where`` is ``"<file>:<line>"`` for error messages;
    ``images``: the row must hold ``data.image_key``."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as error:
        raise DatasetError(f"{where}: invalid JSON: {error.msg} (column {error.colno})") from error
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    conversation = _conversation(row, cfg, where)
    required = [(cfg.answer_key, "data.answer_key")]
    if images:
        required.append((cfg.image_key, "data.image_key"))
    if conversation is None:
        required.insert(0, (cfg.prompt_key, "data.prompt_key"))
    for key, dotpath in required:
        if key not in row:
            raise DatasetError(
                f"{where}: missing field {key!r} ({dotpath}); fields present: {sorted(row)}"
            )
    if conversation is not None and cfg.prompt_key not in row:
        prompt = last_user_content(conversation)
    else:
        prompt = row[cfg.prompt_key]
    if not isinstance(prompt, str) or not prompt:
        raise DatasetError(
            f"{where}: field {cfg.prompt_key!r} (data.prompt_key) must be a non-empty string, "
            f"got {prompt!r}"
        )
    mapped = {cfg.prompt_key, cfg.answer_key, cfg.task_source_key, cfg.agent_ref_key}
    return PromptRecord(
        prompt=prompt,
        answer=row[cfg.answer_key],
        task_source=_optional_string(row, cfg.task_source_key, where, "data.task_source_key"),
        agent_ref=_optional_string(row, cfg.agent_ref_key, where, "data.agent_ref_key"),
        metadata={key: value for key, value in row.items() if key not in mapped},
    )


def _conversation(row: dict[str, Any], cfg: DataConfig, where: str) -> list[Any] | None:
    """The row's ``data.messages_key`` conversation, checked; None when it has none."""
    if cfg.messages_key not in row:
        return None
    if cfg.prompt_format != "chat":
        if cfg.prompt_key in row:
            return None  # a raw run reads the prompt; the field stays in the metadata
        raise DatasetError(
            f"{where}: field {cfg.messages_key!r} (data.messages_key) holds a conversation, "
            f"which only data.prompt_format: chat renders, and the row has no "
            f"{cfg.prompt_key!r} (data.prompt_key); set data.prompt_format: chat"
        )
    try:
        return check_messages(row[cfg.messages_key])
    except ValueError as error:
        raise DatasetError(
            f"{where}: field {cfg.messages_key!r} (data.messages_key) {error}"
        ) from error


def parse_jsonl_text(
    text: str,
    cfg: DataConfig,
    source: str,
    *,
    dotpath: str = "data.dataset",
    images: bool = False,
) -> list[PromptRecord]:
    records = []
    for line_number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            records.append(parse_jsonl_line(line, cfg, f"{source}:{line_number}", images=images))
    if not records:
        raise DatasetError(f"{source}: the dataset holds no prompts ({dotpath})")
    return records


def load_jsonl(
    path: str | Path, cfg: DataConfig, *, dotpath: str = "data.dataset", images: bool = False
) -> list[PromptRecord]:
    path = Path(path)
    if not path.is_file():
        raise DatasetError(f"{dotpath}={str(path)!r}: no such file")
    text = path.read_text(encoding="utf-8")
    return parse_jsonl_text(text, cfg, str(path), dotpath=dotpath, images=images)


def _load_bundled(name: str, file_name: str) -> list[PromptRecord]:
    # The bundled files use the default field names whatever data.*_key say.
    text = resources.files("tandemrl.data").joinpath(file_name).read_text(encoding="utf-8")
    return parse_jsonl_text(text, DataConfig(), f"{BUILTIN_PREFIX}{name} ({file_name})")


def generate_image_records(name: str, cfg: DataConfig, seed: int) -> list[PromptRecord]:
    """A built-in image dataset (``IMAGE_DATASETS``), each image under ``data.image_key``."""
    rows = IMAGE_DATASETS[name](cfg.num_prompts, seed)
    return [
        PromptRecord(
            prompt=row["prompt"], answer=row["answer"], metadata={cfg.image_key: row["image"]}
        )
        for row in rows
    ]


# Built-in datasets whose rows hold images (under data.image_key).
IMAGE_DATASETS = {"shape-colour": shape_colour_rows, "count-squares": count_squares_rows}


def _load_source(
    source: str, cfg: DataConfig, *, dotpath: str, seed: int, images: bool = False
) -> list[PromptRecord]:
    if source.startswith(BUILTIN_PREFIX):
        name = source.removeprefix(BUILTIN_PREFIX)
        if images and name not in IMAGE_DATASETS:
            raise DatasetError(
                f"{dotpath}={source!r} holds no images, and policy.is_vlm is true; use a "
                "JSONL file with a data.image_key field or builtin://shape-colour"
            )
        if name == "counting":
            return generate_counting_records(cfg.num_prompts, seed)
        if name == "math":
            return _load_bundled(name, MATH_SMALL_FILE)
        if name == "math-heldout":
            return _load_bundled(name, MATH_HELDOUT_FILE)
        if name in IMAGE_DATASETS:
            return generate_image_records(name, cfg, seed)
        raise DatasetError(
            f"{dotpath}={source!r}: unknown built-in dataset; use builtin://counting, "
            "builtin://math, builtin://math-heldout, builtin://shape-colour, "
            "builtin://count-squares or a JSONL file path"
        )
    return load_jsonl(source, cfg, dotpath=dotpath, images=images)


def load_prompt_records(
    cfg: DataConfig, *, gym_rows: bool = False, images: bool = False
) -> list[PromptRecord]:
    """The dataset ``data.dataset`` names, in its stored (unshuffled) order; ``gym_rows``
    (``env.name: nemo_gym``): a JSONL file of NeMo-Gym rows (``tandemrl.data.gym_rows``);
    ``images`` (``policy.is_vlm``): every row must hold ``data.image_key``."""
    source = cfg.dataset or DEFAULT_DATASET
    if gym_rows:
        from tandemrl.data.gym_rows import parse_gym_jsonl

        path = Path(source)
        if source.startswith(BUILTIN_PREFIX) or not path.is_file():
            raise DatasetError(
                f"data.dataset={source!r}: env.name: nemo_gym reads a JSONL file of NeMo-Gym "
                "rows (responses_create_params, agent_ref, ...); no such file"
            )
        return parse_gym_jsonl(path.read_text(encoding="utf-8"), str(path))
    return _load_source(source, cfg, dotpath="data.dataset", seed=cfg.seed, images=images)


def load_validation_records(
    cfg: DataConfig, *, max_samples: int | None, images: bool = False
) -> list[PromptRecord]:
    """The held-out prompts ``data.validation`` names (its first ``max_samples``)."""
    if cfg.validation is None:
        raise DatasetError("data.validation: not set; a validation pass needs held-out prompts")
    records = _load_source(
        cfg.validation,
        cfg,
        dotpath="data.validation",
        seed=cfg.seed + VALIDATION_SEED_OFFSET,
        images=images,
    )
    return records if max_samples is None else records[:max_samples]
