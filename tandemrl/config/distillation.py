"""The teachers of an on-policy distillation run: their names, routes and config rules.

Routing (``TeacherRoutes.route``) sends each prompt to one teacher, by the first rule that
matches its row:

1. a teacher whose ``task_sources`` lists the row's ``task_source``;
2. a teacher whose ``agent_refs`` lists the row's ``agent_ref``;
3. the one teacher with ``default: true``.

A row no rule matches has no teacher: validation refuses a config where that can happen for
a built-in dataset (whose rows carry neither field), and the runtime checks
(``tandemrl.preflight``) read a JSONL dataset's rows. ``distillation_problems`` holds the
rules ``tandemrl validate`` reports for the ``on_policy_distillation`` block, each naming its
dotpath.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandemrl.config.models import MasterConfig, OnPolicyDistillationConfig, TeacherConfig

BLOCK = "on_policy_distillation"


def teacher_name(teacher: TeacherConfig, index: int) -> str:
    return teacher.name if teacher.name is not None else f"teacher{index}"


@dataclass(frozen=True)
class TeacherRoutes:
    """Which teacher (its index in ``on_policy_distillation.teachers``) serves a row."""

    by_task_source: dict[str, int]
    by_agent_ref: dict[str, int]
    default: int | None

    @classmethod
    def from_config(cls, block: OnPolicyDistillationConfig) -> TeacherRoutes:
        by_task_source: dict[str, int] = {}
        by_agent_ref: dict[str, int] = {}
        default = None
        for index, teacher in enumerate(block.teachers):
            for source in teacher.task_sources:
                by_task_source.setdefault(source, index)
            for ref in teacher.agent_refs:
                by_agent_ref.setdefault(ref, index)
            if teacher.default and default is None:
                default = index
        return cls(by_task_source, by_agent_ref, default)

    def route(self, task_source: str | None, agent_ref: str | None) -> int | None:
        """The serving teacher's index, or None when no rule matches."""
        if task_source is not None and task_source in self.by_task_source:
            return self.by_task_source[task_source]
        if agent_ref is not None and agent_ref in self.by_agent_ref:
            return self.by_agent_ref[agent_ref]
        return self.default


def unrouted_row_message(task_source: str | None, agent_ref: str | None, where: str) -> str:
    return (
        f"{BLOCK}.teachers: {where} (task_source {task_source!r}, agent_ref {agent_ref!r}) has no "
        "teacher — list its task_source in a teacher's task_sources, its agent_ref in "
        "agent_refs, or set default: true on one teacher"
    )


def distillation_problems(cfg: MasterConfig) -> list[str]:
    """Every violation of the distillation rules, one message each (see the module docstring)."""
    block = cfg.on_policy_distillation
    if block is None:
        return []
    problems: list[str] = []
    teachers = block.teachers
    if not teachers:
        problems.append(
            f"{BLOCK}.teachers: empty — give at least one teacher (model_name and which rows it "
            "serves: task_sources, agent_refs or default: true)"
        )
    problems += _route_problems(block)
    dataset = cfg.data.dataset
    routes = TeacherRoutes.from_config(block)
    builtin = dataset is None or dataset.startswith("builtin://")
    if teachers and builtin and routes.route(None, None) is None:
        problems.append(
            unrouted_row_message(None, None, f"every row of {dataset or 'the counting task'}")
        )
    problems += _device_problems(cfg)
    problems += _preset_tokenizer_problems(cfg)
    if block.kl_coef == 0 and block.reward_coef == 0:
        problems.append(
            f"{BLOCK}.kl_coef, {BLOCK}.reward_coef: both 0, so the loss has no advantage to "
            "train toward; set kl_coef > 0 (distillation) and/or reward_coef > 0"
        )
    if cfg.loss_fn.reuse_training_logprobs:
        problems.append(
            "loss_fn.reuse_training_logprobs: must be false on an on_policy_distillation run — "
            "the distillation advantage needs the student's logprobs before the loss (the "
            "trainer's get_logprobs pass); set it to false"
        )
    return problems


def _route_problems(block: OnPolicyDistillationConfig) -> list[str]:
    problems: list[str] = []
    names: dict[str, int] = {}
    owners: dict[tuple[str, str], int] = {}
    defaults: list[int] = []
    for index, teacher in enumerate(block.teachers):
        where = f"{BLOCK}.teachers.{index}"
        name = teacher_name(teacher, index)
        if name in names:
            problems.append(
                f"{where}.name: {name!r} is also the name of {BLOCK}.teachers.{names[name]}; "
                "give each teacher its own name"
            )
        names.setdefault(name, index)
        for field in ("task_sources", "agent_refs"):
            for value in getattr(teacher, field):
                key = (field, value)
                if key in owners:
                    first = owners[key]
                    other = "" if first == index else f" and {BLOCK}.teachers.{first}.{field}"
                    problems.append(
                        f"{where}.{field}: {value!r} is routed twice ({where}.{field}{other}); a "
                        "row goes to one teacher — list it once"
                    )
                else:
                    owners[key] = index
        if teacher.default:
            defaults.append(index)
        if not (teacher.default or teacher.task_sources or teacher.agent_refs):
            problems.append(
                f"{where}: serves no rows — give it task_sources, agent_refs or default: true, "
                "or remove it"
            )
    if len(defaults) > 1:
        paths = ", ".join(f"{BLOCK}.teachers.{index}.default" for index in defaults)
        problems.append(f"{paths}: more than one default teacher; set default: true on one only")
    return problems


def _device_problems(cfg: MasterConfig) -> list[str]:
    block = cfg.on_policy_distillation
    assert block is not None
    problems = []
    cpu_run = cfg.policy.device == "cpu"
    for index, teacher in enumerate(block.teachers):
        where = f"{BLOCK}.teachers.{index}"
        if cpu_run and teacher.device == "cuda":
            problems.append(
                f"{where}.device: cuda on a CPU run (policy.device: cpu); set it to cpu or "
                "auto, or policy.device: cuda"
            )
        if cpu_run or teacher.device == "cpu":
            for key, default in (("colocated_with_trainer", False), ("gpus_per_worker", 1.0)):
                if getattr(teacher, key) != default:
                    problems.append(
                        f"{where}.{key}: places the teacher on GPUs, but it runs on the CPU "
                        f"({'policy' if cpu_run else where}.device: cpu); remove it"
                    )
    return problems


def _preset_tokenizer_problems(cfg: MasterConfig) -> list[str]:
    """Teachers whose ``tiny://`` tokenizer differs from a ``tiny://`` student's; folders are
    compared before the run (``tandemrl.preflight``), where their files can be read."""
    block = cfg.on_policy_distillation
    assert block is not None
    # Imported here: the models package pulls in transformers.
    from tandemrl.models import preset_tokenizer_signature

    student_source = cfg.policy.tokenizer.name or cfg.policy.model_name
    student = preset_tokenizer_signature(student_source)
    if student is None:
        return []
    problems = []
    for index, teacher in enumerate(block.teachers):
        signature = preset_tokenizer_signature(teacher.model_name)
        if signature is not None and signature != student:
            problems.append(
                f"{BLOCK}.teachers.{index}.model_name: {teacher.model_name!r} has another "
                f"tokenizer than the student ({student_source!r}); a teacher scores the student's "
                "own token ids, so both must share one vocabulary — pick a teacher with the "
                "student's tokenizer"
            )
    return problems
