"""Fault injection: each failure class, each budget, replacement, deadlines, the watchdog."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections import Counter

import pytest
from ray.exceptions import RayActorError

from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.controller.single_controller import StepShrunkTooFar
from tandemrl.controller.watchdog import StallDetected
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.base import GenerationError
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel, fake_codec
from tandemrl.rollout.failures import FailureBudgetExceeded, FailureKind
from tandemrl.training.fake import FakeTrainer

N, G = 4, 2


def make_cfg(*overrides: str):
    return load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"grpo.num_prompts_per_step={N}",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={N * G}",
            f"policy.train_micro_batch_size={N * G}",
            "grpo.max_num_steps=100",
            "grpo.max_num_epochs=1",
            f"async_rl.min_groups_for_streaming_train={N}",
            "async_rl.rollout_failure.backoff_initial_s=0.001",
            "async_rl.rollout_failure.backoff_max_s=0.002",
            "logger.progress=false",
            *overrides,
        ),
    )


def loader(num_prompts: int = 16) -> PromptDataLoader:
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(num_prompts)]
    return PromptDataLoader(records, max_num_epochs=1, seed=0, shuffle=False)


class FlakyEnv(CountingEnv):
    """Raises on chosen calls: ``fail[prompt_id]`` lists the 1-based call numbers that fail."""

    def __init__(self, fail: dict[str, set[int]]) -> None:
        super().__init__()
        self.fail = fail
        self.calls: Counter[str] = Counter()

    def score(self, item, completion, *, truncated):
        self.calls[item.prompt_id] += 1
        if self.calls[item.prompt_id] in self.fail.get(item.prompt_id, set()):
            raise ValueError(f"reward function broke on {item.prompt_id}")
        return super().score(item, completion, truncated=truncated)


def run(cfg, *, env=None, engines=None, trainer=None, num_prompts=16, timeout=30, codec=None):
    engines = engines or [FakeGenerationBackend(seed=0)]
    trainer = trainer or FakeTrainer()

    async def go():
        controller = build_fake_controller(
            cfg, trainer=trainer, engines=engines, dataloader=loader(num_prompts)
        )
        if env is not None:
            controller.rollout_manager.env = env
        if codec is not None:
            controller.rollout_manager.codec = codec
        try:
            await asyncio.wait_for(controller.run(), timeout=timeout)
        finally:
            run.last = controller
        return controller

    return asyncio.run(go())


def trained_ids(controller) -> list[str]:
    return [group.group_id for _, group in controller.trained_groups]


# ---------------------------------------------------------------- data failures, granularity


def test_data_failure_under_sibling_regenerates_only_the_failed_sibling():
    cfg = make_cfg("async_rl.rollout_failure.max_data_retries=2")
    env = FlakyEnv({"e0-i0": {2}})  # second scoring call of e0-i0 = sibling 1, first attempt
    controller = run(cfg, env=env)
    assert sorted(trained_ids(controller)) == sorted(f"e0-i{i}" for i in range(16))
    assert controller.rollout_manager.generated_siblings == 16 * G + 1
    failures = controller.rollout_manager.budgets.failures
    assert [(f.prompt_id, f.sibling_index, f.kind) for f in failures] == [
        ("e0-i0", 1, FailureKind.DATA)
    ]
    assert "reward function broke" in failures[0].cause


class GroupScorerThatBreaksOnce(CountingEnv):
    """Its own ``score_group`` raises on the first call for ``prompt_id``."""

    def __init__(self, prompt_id: str) -> None:
        super().__init__()
        self.prompt_id = prompt_id
        self.broke = False

    def score_group(self, item, completions, *, truncated):
        if item.prompt_id == self.prompt_id and not self.broke:
            self.broke = True
            raise RuntimeError("grader unavailable")
        return super().score_group(item, completions, truncated=truncated)


def test_a_raising_score_group_fails_every_sibling_of_that_round():
    cfg = make_cfg("async_rl.rollout_failure.max_data_retries=1")
    controller = run(cfg, env=GroupScorerThatBreaksOnce("e0-i3"))
    assert len(trained_ids(controller)) == 16
    assert controller.rollout_manager.generated_siblings == 16 * G + G
    failures = controller.rollout_manager.budgets.failures
    assert [(f.prompt_id, f.sibling_index) for f in failures] == [("e0-i3", 0), ("e0-i3", 1)]
    assert all("RuntimeError: grader unavailable" in f.cause for f in failures)


def test_a_completion_the_codec_cannot_decode_fails_only_its_sibling():
    base = fake_codec()
    calls = Counter()

    def decode(ids):
        calls["decode"] += 1
        if calls["decode"] == 3:  # the first group's first sibling (G=2: calls 1-2 are e0-i0)
            raise UnicodeDecodeError("utf-8", b"", 0, 1, "broken bytes")
        return base.decode(ids)

    codec = dataclasses.replace(base, decode=decode)
    controller = run(make_cfg("async_rl.rollout_failure.max_data_retries=1"), codec=codec)
    assert len(trained_ids(controller)) == 16
    assert controller.rollout_manager.generated_siblings == 16 * G + 1
    failures = controller.rollout_manager.budgets.failures
    assert [(f.kind, f.sibling_index) for f in failures] == [(FailureKind.DATA, 0)]
    assert "UnicodeDecodeError" in failures[0].cause


def test_data_failure_under_prompt_group_regenerates_the_whole_group():
    cfg = make_cfg(
        "async_rl.rollout_failure.max_data_retries=2",
        "rollout_recovery.default_granularity=prompt_group",
        "token_capture.enabled=true",
    )
    env = FlakyEnv({"e0-i0": {2}})
    controller = run(cfg, env=env)
    assert controller.rollout_manager.generated_siblings == 16 * G + G
    assert len(trained_ids(controller)) == 16


def test_task_source_override_picks_the_granularity():
    cfg = make_cfg(
        "token_capture.enabled=true",
        "rollout_recovery.task_source_granularity_overrides={math: prompt_group}",
    )
    from tandemrl.records import PromptItem
    from tandemrl.rollout.ledger import resolve_granularity

    item = PromptItem("p", 0, 0, "1=", task_source="math", agent_ref="agent-a")
    assert resolve_granularity(item, cfg.rollout_recovery) == "prompt_group"
    cfg2 = make_cfg(
        "token_capture.enabled=true",
        "rollout_recovery.task_source_granularity_overrides={math: prompt_group}",
        "rollout_recovery.agent_granularity_overrides={agent-a: sibling}",
    )
    assert (
        resolve_granularity(item, cfg2.rollout_recovery) == "sibling"
    )  # agent wins over task source


# ---------------------------------------------------------------- budgets


def test_drop_with_zero_budget_ends_the_run_naming_the_budget():
    cfg = make_cfg("async_rl.rollout_failure.max_data_retries=0")
    env = FlakyEnv({"e0-i3": {1}})
    with pytest.raises(FailureBudgetExceeded, match="max_skipped_prompts=0"):
        run(cfg, env=env)


def test_consecutive_drop_budget_is_reset_by_commits_and_enforced():
    cfg = make_cfg(
        "async_rl.rollout_failure.max_data_retries=0",
        "async_rl.rollout_failure.max_skipped_prompts=10",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=1",
        "async_rl.rollout_failure.min_step_batch_fraction=0.25",
        "async_rl.max_inflight_prompts=1",
    )
    # inflight 1: prompts run one after another, so e0-i1 and e0-i2 drop back to back
    env = FlakyEnv({"e0-i1": {1}, "e0-i2": {1}})
    with pytest.raises(FailureBudgetExceeded, match="max_consecutive_dropped_prompts=1"):
        run(cfg, env=env)


def test_shrink_trains_the_step_short_and_never_below_the_floor():
    cfg = make_cfg(
        "async_rl.rollout_failure.max_data_retries=0",
        "async_rl.rollout_failure.max_skipped_prompts=5",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=5",
        "async_rl.rollout_failure.min_step_batch_fraction=0.5",
    )
    controller = run(cfg, env=FlakyEnv({"e0-i0": {1}}))
    assert [row["groups_trained"] for row in controller.history] == [3, 4, 4, 4]
    assert "e0-i0" not in trained_ids(controller)

    env = FlakyEnv({"e0-i0": {1}, "e0-i1": {1}, "e0-i2": {1}})
    with pytest.raises(StepShrunkTooFar, match="min_step_batch_fraction"):
        run(cfg, env=env)


class TrainCallLog(FakeTrainer):
    """A FakeTrainer that logs each call of the split step and what it raised."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    async def begin_train_step(self) -> None:
        self.calls.append("begin")
        await super().begin_train_step()

    async def finish_train_step(self):
        try:
            return await super().finish_train_step()
        except Exception as exc:
            self.calls.append(f"finish raised {type(exc).__name__}")
            raise
        finally:
            self.calls.append("finish")


def test_a_step_whose_every_group_is_dropped_ends_the_run_and_never_reaches_the_trainer():
    """The last of step 0's four groups drops while the train pump waits for them: the run
    ends with StepShrunkTooFar, and the train pump never asks the trainer to finish a step
    it did not begin (it used to: it woke on the drop, sized the step at 0 groups and called
    finish_train_step, racing the drop's own StepShrunkTooFar for which error ended the run)."""
    cfg = make_cfg(
        "async_rl.rollout_failure.max_data_retries=0",
        "async_rl.rollout_failure.max_skipped_prompts=8",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=8",
        "async_rl.rollout_failure.min_step_batch_fraction=0.25",  # floor: 1 group
    )
    trainer = TrainCallLog()
    env = FlakyEnv({f"e0-i{i}": {1} for i in range(N)})  # every group of step 0
    with pytest.raises(StepShrunkTooFar, match="step 0 lost 4 prompt group"):
        run(cfg, env=env, trainer=trainer)
    assert trainer.calls == [] and trainer.optimizer_steps == 0


def test_replace_fills_the_dropped_place_and_saves_the_reserve():
    cfg = make_cfg(
        "async_rl.rollout_failure.max_data_retries=0",
        "async_rl.rollout_failure.max_skipped_prompts=5",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=5",
        "async_rl.rollout_failure.on_dropped_prompt=replace",
        "async_rl.rollout_failure.replacement_reserve_size=2",
    )
    controller = run(cfg, env=FlakyEnv({"e0-i0": {1}, "e0-i5": {1}}), num_prompts=18)
    # 18 prompts, 2 dropped and replaced: four full steps, every other prompt trained once
    assert [row["groups_trained"] for row in controller.history] == [4, 4, 4, 4]
    ids = trained_ids(controller)
    assert len(ids) == len(set(ids))
    assert set(ids) == {f"e0-i{i}" for i in range(18)} - {"e0-i0", "e0-i5"}
    assert sum(row["replaced_prompts"] for row in controller.history) == 2


def test_replacement_reserve_is_part_of_the_checkpointed_state():
    cfg = make_cfg(
        "async_rl.rollout_failure.max_skipped_prompts=1",
        "async_rl.rollout_failure.max_consecutive_dropped_prompts=1",
        "async_rl.rollout_failure.on_dropped_prompt=replace",
        "async_rl.rollout_failure.replacement_reserve_size=2",
        "grpo.max_num_steps=1",
    )
    controller = run(cfg)
    state = controller.run_state.capture(authoritative=True)
    assert len(state.replacement_reserve) == 2


# ---------------------------------------------------------------- infrastructure failures


class FailingFirstCalls(FakeGenerationBackend):
    def __init__(self, failures: int, **kwargs):
        super().__init__(**kwargs)
        self.failures_left = failures

    async def generate(self, requests):
        if self.failures_left > 0:
            self.failures_left -= 1
            raise GenerationError("transport broke")
        return await super().generate(requests)


def test_infrastructure_failures_are_retried_with_backoff():
    cfg = make_cfg("async_rl.rollout_failure.max_infra_retries=3")
    controller = run(cfg, engines=[FailingFirstCalls(2, seed=0)])
    assert len(trained_ids(controller)) == 16
    kinds = [f.kind for f in controller.rollout_manager.budgets.failures]
    assert kinds == [FailureKind.INFRA, FailureKind.INFRA]


def test_generation_timeout_is_an_infrastructure_failure():
    cfg = make_cfg(
        "async_rl.rollout_failure.generation_timeout_s=0.05",
        "async_rl.rollout_failure.max_infra_retries=0",
    )
    slow = FakeGenerationBackend(latency=LatencyModel("fixed", seconds=1.0), seed=0)
    with pytest.raises(FailureBudgetExceeded, match=r"generation_timeout_s=0\.05"):
        run(cfg, engines=[slow])


class DyingEngine(FakeGenerationBackend):
    def __init__(self, die_after: int, **kwargs):
        super().__init__(**kwargs)
        self.die_after = die_after
        self.calls = 0

    async def generate(self, requests):
        self.calls += 1
        if self.calls > self.die_after:
            raise RayActorError()
        return await super().generate(requests)


def test_dead_generation_worker_is_taken_out_and_its_prompts_finish_elsewhere():
    cfg = make_cfg("policy.generation.num_workers=2")
    dying, healthy = DyingEngine(3, seed=0), FakeGenerationBackend(seed=1)
    controller = run(cfg, engines=[dying, healthy])
    ids = trained_ids(controller)
    assert sorted(ids) == sorted(f"e0-i{i}" for i in range(16))
    assert controller.generation.dead_workers == [0]


def test_all_generation_workers_dead_ends_the_run_clearly():
    from tandemrl.rollout.generation_pool import NoGenerationWorkers

    cfg = make_cfg()
    with pytest.raises(NoGenerationWorkers, match="generation worker"):
        run(cfg, engines=[DyingEngine(1, seed=0)])


# ---------------------------------------------------------------- deadlines during stand-down


def test_colocated_deadlines_do_not_expire_during_a_long_train_step():
    cfg = make_cfg(
        "policy.generation.colocated.enabled=true",
        "async_rl.rollout_failure.generation_timeout_s=0.3",
        "async_rl.rollout_failure.rollout_timeout_s=0.3",
        "async_rl.rollout_failure.max_infra_retries=0",
    )
    engine = FakeGenerationBackend(latency=LatencyModel("fixed", seconds=0.1), seed=0)
    # each train step stands the engine down for 0.6 s, twice the deadline
    controller = run(cfg, engines=[engine], trainer=FakeTrainer(train_seconds_per_step=0.6))
    assert len(trained_ids(controller)) == 16
    assert controller.rollout_manager.budgets.failures == []
    assert controller.generation.timeouts == 0


# ---------------------------------------------------------------- stale in-flight abort (windowed)


def test_windowed_aborts_in_flight_groups_that_can_never_train():
    cfg = make_cfg(
        "async_rl.sampler={name: windowed, max_staleness_versions: 0}",
        "loss_fn.use_importance_sampling_correction=false",
        "async_rl.max_buffered_rollouts=12",
        "async_rl.max_inflight_prompts=12",
        "async_rl.min_groups_for_streaming_train=1",
        "grpo.max_num_epochs=1",
    )
    engine = FakeGenerationBackend(
        latency=LatencyModel("lognormal", seconds=0.01, sigma=1.5), seed=3
    )
    controller = run(cfg, engines=[engine], num_prompts=64)
    assert sum(row["aborted_groups"] for row in controller.history) > 0
    assert all(row["staleness_max"] == 0 for row in controller.history)


# ---------------------------------------------------------------- stall watchdog


def test_watchdog_aborts_a_stalled_run_saying_what_each_pump_waits_on():
    cfg = make_cfg("async_rl.stall_watchdog.timeout_s=0.2", "async_rl.stall_watchdog.action=abort")
    hung = FakeGenerationBackend(latency=LatencyModel("fixed", seconds=60), seed=0)
    with pytest.raises(StallDetected, match=r"train pump waiting on \[data"):
        run(cfg, engines=[hung])


def test_watchdog_warns_and_lets_a_slow_run_finish(caplog):
    cfg = make_cfg("async_rl.stall_watchdog.timeout_s=0.1", "async_rl.stall_watchdog.action=warn")
    slow = FakeGenerationBackend(latency=LatencyModel("fixed", seconds=0.3), seed=0)
    with caplog.at_level(logging.WARNING):
        controller = run(cfg, engines=[slow], num_prompts=8)
    assert len(trained_ids(controller)) == 8
    assert controller.stall_warnings >= 1
    assert "no progress" in caplog.text
