"""Distillation teachers with fakes: routing, both scoring placements, dead workers, config
refusals, and what checkpoints keep of the teachers (logprobs, the teacher set)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import torch
from ray.exceptions import RayActorError

from tandemrl.checkpoint.commit_log import fold, read_log
from tandemrl.checkpoint.commit_replay import commit_log_dir
from tandemrl.checkpoint.fingerprint import compatibility_identity
from tandemrl.checkpoint.journal import read_journal
from tandemrl.checkpoint.layout import JOURNAL
from tandemrl.checkpoint.restore import RestoreRefused, plan_restore
from tandemrl.config.errors import ConfigError
from tandemrl.config.loader import load_config
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.controller.setup import PlacementError, plan_placement
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.fake import FakeGenerationBackend, fake_codec
from tandemrl.models import resolve_model_path
from tandemrl.preflight import runtime_problems
from tandemrl.records import TeacherRequest
from tandemrl.rollout.ledger import OwnershipLedger, group_entry
from tandemrl.rollout.teachers import NoTeacherWorkers, TeacherPool
from tandemrl.training.fake import FakeTeacher, FakeTrainer

EXEMPLAR = "examples/configs/distill_tiny_cpu.yaml"
SMALL = (
    "on_policy_distillation.num_prompts_per_step=4",
    "on_policy_distillation.num_generations_per_prompt=2",
    "policy.train_global_batch_size=8",
    "policy.train_micro_batch_size=8",
    "on_policy_distillation.max_num_steps=4",
    "logger.progress=false",
)
# Two teachers: "math" serves task_source math and agent_ref helper; "code" serves task_source
# code and every row no rule matches.
TWO_TEACHERS = (
    "on_policy_distillation.teachers=[{name: math, model_name: tiny://qwen2-counting, "
    "task_sources: [math], agent_refs: [helper]}, {name: code, model_name: tiny://qwen2-counting,"
    " task_sources: [code], default: true}]"
)
# (task_source, agent_ref) -> the teacher that must serve it: task_source wins over agent_ref,
# agent_ref over the default.
ROUTES = {
    ("math", None): "math",
    ("code", "helper"): "code",
    (None, "helper"): "math",
    ("other", None): "code",
    (None, None): "code",
}


def cfg_of(*overrides: str):
    return load_config(EXEMPLAR, (*SMALL, *overrides))


def routed_loader() -> PromptDataLoader:
    records = [
        PromptRecord(prompt=f"{index:03d}=", answer="123", task_source=source, agent_ref=ref)
        for index, (source, ref) in enumerate(list(ROUTES) * 4)
    ]
    return PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False)


def run(cfg, teacher_engines, *, dataloader=None, trainer=None):
    trainer = trainer or FakeTrainer()
    parts = ControllerParts(
        trainer=trainer,
        engines=[FakeGenerationBackend(seed=1)],
        env=CountingEnv(),
        codec=fake_codec(),
        dataloader=dataloader,
        teacher_engines=teacher_engines,
    )

    async def go():
        controller = build_controller(cfg, parts)
        return controller, await asyncio.wait_for(controller.run(), timeout=60)

    controller, history = asyncio.run(go())
    return controller, history, trainer


@pytest.mark.parametrize("placement", ["rollout", "train"])
def test_rows_are_scored_by_the_teacher_their_route_names(placement):
    math, code = FakeTeacher(offset=0.5), FakeTeacher(offset=3.0)
    cfg = cfg_of(TWO_TEACHERS, f"on_policy_distillation.teacher_scoring={placement}")
    validate_single_controller_config(cfg)
    loader = routed_loader()
    controller, history, trainer = run(cfg, [[math], [code]], dataloader=loader)
    assert len(history) == 4
    by_prompt = {f"e0-i{index}": key for index, key in enumerate(list(ROUTES) * 4)}
    teachers = {"math": math, "code": code}
    checked = 0
    for step in trainer.steps:
        for batch in step.chunks:
            for row in range(batch["input_ids"].shape[0]):
                completion = batch["token_mask"][row] > 0
                tokens = batch["input_ids"][row][completion].tolist()
                name = ["math", "code"][int(batch["teacher_index"][row])]
                values = batch["teacher_logprobs"][row][completion].tolist()
                assert values == pytest.approx([teachers[name].logprob(t) for t in tokens])
                checked += 1
    assert checked == 4 * 8
    for name, teacher in teachers.items():
        scored_prompts = {request.request_id.split("/")[0] for request in teacher.scored}
        assert scored_prompts, name
        assert {ROUTES[by_prompt[prompt]] for prompt in scored_prompts} == {name}
    # per-teacher reverse-KL metrics, and where the scoring happened
    assert {"train/reverse_kl/math", "train/reverse_kl/code"} <= set(history[-1])
    in_train = sum(row["train/teacher_groups_scored_in_train_pump"] for row in history)
    assert in_train == (16 if placement == "train" else 0)
    if placement == "rollout":
        assert controller.rollout_manager.teacher_passes >= 16


@pytest.mark.parametrize(
    "sampler",
    [
        "{name: in_order, max_lookahead_versions: 0}",
        "{name: in_order, max_lookahead_versions: 2}",
        "{name: weight_fifo, max_staleness_versions: 1}",
        "{name: ready_first, max_staleness_versions: 1}",
        "{name: windowed, max_staleness_versions: 1}",
    ],
    ids=["sync", "in_order2", "weight_fifo", "ready_first", "windowed"],
)
def test_every_sampler_trains_toward_the_teacher_with_stale_samples_reweighted(sampler):
    cfg = cfg_of(
        f"async_rl.sampler={sampler}",
        "async_rl.min_groups_for_streaming_train=2",
        "async_rl.max_buffered_rollouts=16",
        "async_rl.max_inflight_prompts=16",
        "on_policy_distillation.max_num_steps=5",
    )
    validate_single_controller_config(cfg)
    on_policy = "max_lookahead_versions: 0" in sampler
    if not on_policy:  # off-policy data needs the correction: validation insists on it
        uncorrected = cfg.model_copy(deep=True)
        uncorrected.loss_fn.use_importance_sampling_correction = False
        with pytest.raises(ConfigError, match="use_importance_sampling_correction"):
            validate_single_controller_config(uncorrected)
    teacher = FakeTeacher()
    _, history, trainer = run(cfg, [[teacher]])
    assert len(history) == 5
    for step in trainer.steps:
        for batch in step.chunks:
            mask = batch["token_mask"] > 0
            expected = -(batch["prev_logprobs"] - batch["teacher_logprobs"]) * mask
            assert torch.allclose(batch["advantages"], expected)
    if not on_policy:
        assert max(row["staleness_max"] for row in history) >= 1


def test_a_prompt_without_a_teacher_is_dropped_as_a_data_failure():
    cfg = cfg_of(
        "on_policy_distillation.teachers=[{model_name: tiny://qwen2-counting, "
        "task_sources: [math]}]",
        "async_rl.rollout_failure.max_skipped_prompts=100",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=100",
        "async_rl.rollout_failure.min_step_batch_fraction=0.25",
    )
    records = [
        PromptRecord(prompt=f"{i:03d}=", answer="1", task_source="math" if i % 4 else None)
        for i in range(16)
    ]
    loader = PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False)
    controller, _, _ = run(cfg, [[FakeTeacher()]], dataloader=loader)
    dropped = controller.run_state.budgets.dropped
    assert {record.prompt_id for record in dropped} == {"e0-i0", "e0-i4", "e0-i8", "e0-i12"}
    assert all("has no teacher" in record.cause for record in dropped)


def test_a_dead_teacher_worker_leaves_the_rotation_and_its_call_is_retried():
    dying, healthy = FakeTeacher(), FakeTeacher()
    dying.fail_next = [RayActorError()]
    cfg = cfg_of("async_rl.rollout_failure.backoff_initial_s=0")
    controller, history, _ = run(cfg, [[dying, healthy]])
    assert len(history) == 4  # nothing lost: every step trained its whole batch
    assert all(row["groups_trained"] == 4 for row in history)
    pool = controller.rollout_manager.teachers.pools[0]
    assert pool.dead_workers == [0] and pool.num_alive == 1
    # the calls of the batch the dead worker held failed once each, as infrastructure
    failures = controller.run_state.budgets.failures
    assert failures and all(record.kind.value == "infrastructure" for record in failures)
    assert all("worker 0 of teacher 'counting' died" in record.cause for record in failures)
    assert dying.scored == [] and healthy.scored
    assert controller.run_state.budgets.dropped == []


def test_calls_waiting_for_a_busy_worker_go_together_in_one_batch():
    teacher = FakeTeacher(seconds_per_sequence=0.01)
    pool = TeacherPool("counting", [teacher], max_batch_sequences=6)
    calls = [
        [TeacherRequest(f"g{i}/{s}", [1, 2], [3 + i, 4, 5 + s]) for s in range(2)] for i in range(5)
    ]

    async def go():
        return await asyncio.gather(*(pool.score(requests) for requests in calls))

    answers = asyncio.run(go())
    # the first call finds the worker free; the next three (6 sequences) wait and go as one
    # batch, the last one after them
    assert teacher.calls == pool.calls == 3
    for requests, answer in zip(calls, answers, strict=True):
        assert answer == [[teacher.logprob(t) for t in r.completion_token_ids] for r in requests]


def test_a_teacher_whose_every_worker_died_ends_the_run():
    dying = FakeTeacher()
    dying.fail_next = [RayActorError()] * 100
    cfg = cfg_of("async_rl.rollout_failure.backoff_initial_s=0")
    with pytest.raises(NoTeacherWorkers, match="all 1 worker"):
        run(cfg, [[dying]])


def test_validation_refuses_what_cannot_route_or_score():
    cfg = cfg_of(
        "on_policy_distillation.teachers=[{name: a, model_name: tiny://qwen2-counting, "
        "task_sources: [math]}, {name: a, model_name: tiny://qwen2.5, task_sources: [math], "
        "default: true}, {model_name: tiny://llama-small, default: true}, "
        "{model_name: tiny://qwen2-counting}]",
    )
    with pytest.raises(ConfigError) as caught:
        validate_single_controller_config(cfg)
    text = str(caught.value)
    for expected in (
        "on_policy_distillation.teachers.1.name: 'a' is also the name of "
        "on_policy_distillation.teachers.0",
        "on_policy_distillation.teachers.1.task_sources: 'math' is routed twice",
        "on_policy_distillation.teachers.1.default, on_policy_distillation.teachers.2.default: "
        "more than one default teacher",
        "on_policy_distillation.teachers.3: serves no rows",
        # the chat preset's alphabet differs from the student's
        "on_policy_distillation.teachers.1.model_name: 'tiny://qwen2.5' has another tokenizer",
    ):
        assert expected in text, (expected, text)
    # llama-small shares the student's character tokenizer: not refused
    assert "teachers.2.model_name" not in text
    with pytest.raises(ConfigError, match="grpo, on_policy_distillation: 2 algorithm blocks"):
        validate_single_controller_config(cfg_of("+grpo={num_prompts_per_step: 4}"))


def test_dynamic_sampling_is_refused_on_distillation():
    with pytest.raises(
        ConfigError, match=r"on_policy_distillation\.use_dynamic_sampling: GRPO only"
    ):
        validate_single_controller_config(
            cfg_of("on_policy_distillation.use_dynamic_sampling=true")
        )


def test_validation_refuses_rows_no_teacher_serves():
    cfg = cfg_of(
        "on_policy_distillation.teachers=[{model_name: tiny://qwen2-counting, "
        "task_sources: [math]}]"
    )
    with pytest.raises(ConfigError, match="every row of builtin://counting"):
        validate_single_controller_config(cfg)


def test_runtime_checks_find_a_missing_folder_a_foreign_tokenizer_and_unrouted_rows(tmp_path):
    # validate --no-runtime-checks accepts the exemplar without its teacher folder
    cfg = cfg_of("on_policy_distillation.teachers.0.model_name=" + str(tmp_path / "nothing"))
    validate_single_controller_config(cfg)
    assert any(
        "on_policy_distillation.teachers.0.model_name=" in p and "no such folder" in p
        for p in runtime_problems(cfg)
    )
    # a folder with another tokenizer (a chat preset's) than the student's
    chat_folder = resolve_model_path("tiny://qwen2.5")
    same_folder = resolve_model_path("tiny://llama-small")
    dataset = tmp_path / "rows.jsonl"
    dataset.write_text(
        "\n".join(
            json.dumps({"prompt": "1=", "answer": "2", "task_source": source})
            for source in ("math", "math", "poetry")
        )
    )
    cfg = cfg_of(
        f"on_policy_distillation.teachers=[{{model_name: {chat_folder}, task_sources: [math]}}, "
        f"{{model_name: {same_folder}, task_sources: [code]}}]",
        f"data.dataset={dataset}",
    )
    problems = runtime_problems(cfg)
    assert any(
        p.startswith("on_policy_distillation.teachers.0.model_name=")
        and "tokenizer differs from the student's" in p
        for p in problems
    ), problems
    assert not any(p.startswith("on_policy_distillation.teachers.1.model_name=") for p in problems)
    assert any("row 3 (task_source 'poetry'" in p and "has no teacher" in p for p in problems)


def test_teachers_get_their_own_processes_and_gpus():
    cfg = cfg_of("on_policy_distillation.teachers.0.num_workers=2")
    cpu = plan_placement(cfg, cluster_cpus=2, cluster_gpus=0)
    assert cpu.teachers == ((0.5, 0.0), (0.5, 0.0)) and cpu.trainer_cpus == 0.5
    gpu_overrides = (
        "policy.device=cuda",
        "on_policy_distillation.teachers.0.device=auto",
        "policy.generation.colocated.resources.gpus_per_node=1",
    )
    own = plan_placement(cfg_of(*gpu_overrides), cluster_cpus=8, cluster_gpus=3)
    assert own.teachers == ((1.0, 1.0),) and own.trainer_gpus == 1.0
    with pytest.raises(PlacementError, match="gpus_per_worker"):
        plan_placement(cfg_of(*gpu_overrides), cluster_cpus=8, cluster_gpus=2)
    beside = plan_placement(
        cfg_of(*gpu_overrides, "on_policy_distillation.teachers.0.colocated_with_trainer=true"),
        cluster_cpus=8,
        cluster_gpus=2,
    )
    assert beside.teachers == ((1.0, 0.5),) and beside.trainer_gpus == 0.5


# ------------------------------------------------------------------ checkpoints and restarts

CHECKPOINTED = (
    "checkpointing.enabled=true",
    "checkpointing.save_data_plane=true",
    "checkpointing.save_period=1",
    "token_capture.enabled=true",
    "rollout_checkpointing.snapshot_attempt_interval_s=0.01",
)


def test_committed_groups_keep_their_teacher_logprobs_in_the_commit_log_and_snapshots(tmp_path):
    cfg = cfg_of(*CHECKPOINTED, f"checkpointing.checkpoint_dir={tmp_path}")
    teacher = FakeTeacher()
    run(cfg, [[teacher]])
    committed = fold(read_log(commit_log_dir(tmp_path)).records).committed
    assert committed
    for group_id, entry in committed.items():
        group = OwnershipLedger.groups_from_state({"groups": [entry]})[0]
        assert group.teacher_logprobs == [
            [teacher.logprob(t) for t in group.staged[s].result.token_ids] for s in range(2)
        ], group_id
        assert group_entry(group, with_staged=True)["teacher_logprobs"] == entry["teacher_logprobs"]
    # every commit recorded one teacher pass of this attempt
    generated = [e for e in read_journal(tmp_path / JOURNAL) if e["event"] == "generated"]
    assert generated and all(e["teacher_passes"] == 1 for e in generated)


def test_a_restart_resumes_without_scoring_committed_groups_again(tmp_path):
    cfg = cfg_of(*CHECKPOINTED, f"checkpointing.checkpoint_dir={tmp_path}")
    first = FakeTeacher()

    async def attempt(teacher, steps):
        parts = ControllerParts(
            trainer=FakeTrainer(),
            engines=[FakeGenerationBackend(seed=1)],
            env=CountingEnv(),
            codec=fake_codec(),
            teacher_engines=[[teacher]],
        )
        controller = build_controller(cfg.model_copy(deep=True), parts)
        await controller.resume(plan_restore(cfg))
        task = asyncio.create_task(controller.run())
        while (controller.checkpointer.last_saved_step or 0) < steps and not task.done():
            await asyncio.sleep(0.001)
        while controller.buffer.num_ready < 2 and not task.done():
            await asyncio.sleep(0.001)
        if task.done():
            return task.result()
        controller.commit_log.abandon()
        controller.journal.record = lambda *args, **kwargs: None
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return None

    assert asyncio.run(attempt(first, 1)) is None
    second = FakeTeacher()
    history = asyncio.run(attempt(second, 10))
    restored = [e for e in read_journal(tmp_path / JOURNAL) if e["event"] == "start"][1]
    assert restored["resumed_step"] >= 1
    assert history is not None and len(history) == 4 - restored["resumed_step"]
    scored_first = {request.request_id.split("/")[0] for request in first.scored}
    scored_second = {request.request_id.split("/")[0] for request in second.scored}
    kept = set(restored["restored_committed"])
    assert kept, restored  # committed groups came back with the restart ...
    assert kept <= scored_first and not (kept & scored_second)  # ... and were not scored again
    assert all(row["train/teacher_groups_scored_in_train_pump"] == 0 for row in history)


def test_the_teacher_set_is_part_of_the_restart_identity(tmp_path):
    cfg = cfg_of(*CHECKPOINTED, f"checkpointing.checkpoint_dir={tmp_path}")
    run(cfg, [[FakeTeacher()]])
    identity = compatibility_identity(cfg)
    assert identity["on_policy_distillation.teachers.0.model_name"] == (
        "runs/distill_teacher/final_model"
    )
    assert "on_policy_distillation.teachers.0.num_workers" not in identity  # operational
    # more workers, or the other scoring placement: the same run
    same = cfg_of(
        *CHECKPOINTED,
        f"checkpointing.checkpoint_dir={tmp_path}",
        "on_policy_distillation.teachers.0.num_workers=2",
        "on_policy_distillation.teacher_scoring=train",
    )
    assert plan_restore(same).step == 4
    other = cfg_of(
        *CHECKPOINTED,
        f"checkpointing.checkpoint_dir={tmp_path}",
        "on_policy_distillation.teachers.0.model_name=runs/another_teacher",
    )
    with pytest.raises(RestoreRefused) as caught:
        plan_restore(other)
    message = str(caught.value)
    assert (
        'on_policy_distillation.teachers.0.model_name: "runs/distill_teacher/final_model" -> '
        '"runs/another_teacher"' in message
    ), message
    assert Path(tmp_path, "step_4").is_dir()  # nothing was modified
    # keep would train toward the old teachers' logprobs: refused too; drop_rollouts scores
    # the groups again, so it may go on
    keep = other.model_copy(deep=True)
    keep.rollout_checkpointing.on_config_change = "keep"
    with pytest.raises(RestoreRefused, match="scored by other distillation teachers"):
        plan_restore(keep)
    drop = other.model_copy(deep=True)
    drop.rollout_checkpointing.on_config_change = "drop_rollouts"
    assert plan_restore(drop).config_change is not None


def test_a_distillation_run_schedules_validation_passes_like_grpo():
    cfg = cfg_of(
        "on_policy_distillation.val_period=2",
        "data.validation=builtin://counting",
        "on_policy_distillation.max_val_samples=8",
    )
    validate_single_controller_config(cfg)
    assert cfg.validates
    with pytest.raises(ConfigError, match=r"data\.validation: required by"):
        validate_single_controller_config(cfg_of("on_policy_distillation.val_period=2"))
