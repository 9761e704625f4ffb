"""The two pumps driven end to end with fakes: what is trained, how stale, and how runs end."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import pytest

from tandemrl.config.loader import load_config
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel, fake_codec
from tandemrl.training.fake import FakeTrainer

BASE = "examples/configs/grpo_tiny_cpu.yaml"


def make_cfg(*overrides: str):
    defaults = (
        "grpo.num_prompts_per_step=4",
        "grpo.num_generations_per_prompt=2",
        "policy.train_global_batch_size=8",
        "policy.train_micro_batch_size=8",
        "grpo.max_num_steps=6",
        "logger.progress=false",
    )
    return load_config(BASE, (*defaults, *overrides))


def run_controller(cfg, *, latency=None, trainer=None, dataloader=None, engines=None):
    trainer = trainer or FakeTrainer()
    engines = engines or [FakeGenerationBackend(latency=latency, seed=1)]
    parts = ControllerParts(
        trainer=trainer,
        engines=engines,
        env=CountingEnv(),
        codec=fake_codec(),
        dataloader=dataloader,
    )

    async def go():
        controller = build_controller(cfg, parts)
        history = await asyncio.wait_for(controller.run(), timeout=60)
        return controller, history

    controller, history = asyncio.run(go())
    return controller, history, trainer, engines


# Sync mode with room for exactly one step's 4 groups: dispatch waits for every sync.
SYNC_ONE_STEP_AT_A_TIME = (
    "async_rl.sampler.max_lookahead_versions=0",
    "loss_fn.use_importance_sampling_correction=false",
    "async_rl.max_buffered_rollouts=4",
    "async_rl.max_inflight_prompts=4",
    "async_rl.min_groups_for_streaming_train=4",
)


def trained_group_ids(controller) -> list[str]:
    return [group.group_id for _, group in controller.trained_groups]


def test_sync_in_order_trains_fresh_full_steps():
    cfg = make_cfg(
        *SYNC_ONE_STEP_AT_A_TIME,
    )
    controller, history, trainer, engines = run_controller(
        cfg, latency=LatencyModel("uniform", low=0.0, high=0.01)
    )
    assert len(history) == 6
    assert trainer.optimizer_steps == 6
    assert all(row["groups_trained"] == 4 for row in history)
    assert all(row["staleness_max"] == 0 for row in history)
    # the engine saw every new version
    assert engines[0].weight_updates == [1, 2, 3, 4, 5, 6]
    assert controller.state.consumed_groups == 24


@pytest.mark.parametrize(
    ("sampler", "knob", "allowed"),
    [
        ("in_order", "max_lookahead_versions=2", 2),
        ("weight_fifo", "max_staleness_versions=1", 1),
        # ready_first trains late stragglers by design (spec: "including late stragglers"),
        # so its staleness has no bound; it never evicts instead.
        ("ready_first", "max_staleness_versions=2", None),
        ("windowed", "max_staleness_versions=1", 1),
    ],
)
def test_async_samplers_respect_staleness_and_train_each_group_once(sampler, knob, allowed):
    cfg = make_cfg(
        f"async_rl.sampler={{name: {sampler}, {knob.replace('=', ': ')}}}",
        "loss_fn.use_importance_sampling_correction=true",
        "async_rl.max_buffered_rollouts=16",
        "async_rl.max_inflight_prompts=12",
        "async_rl.min_groups_for_streaming_train=2",
        "grpo.max_num_steps=8",
    )
    trainer = FakeTrainer(train_seconds_per_step=0.01)
    controller, history, trainer, _ = run_controller(
        cfg, latency=LatencyModel("lognormal", seconds=0.004, sigma=1.0), trainer=trainer
    )
    assert len(history) == 8
    if allowed is not None:
        assert all(row["staleness_max"] <= allowed for row in history)
    else:
        assert all(row["evicted_groups"] == 0 for row in history)
    assert all(group.staleness >= 0 for _, group in controller.trained_groups)
    ids = trained_group_ids(controller)
    assert len(ids) == len(set(ids)) == 8 * 4
    assert all(step.num_sequences == 8 for step in trainer.steps)


def test_streaming_chunks_make_one_optimizer_step():
    cfg = make_cfg("async_rl.min_groups_for_streaming_train=1", "grpo.max_num_steps=3")
    trainer = FakeTrainer()
    _, _, trainer, _ = run_controller(
        cfg, latency=LatencyModel("uniform", low=0.0, high=0.02), trainer=trainer
    )
    assert trainer.optimizer_steps == 3
    assert all(step.num_sequences == 8 for step in trainer.steps)
    assert any(len(step.chunks) > 1 for step in trainer.steps)


def test_data_exhaustion_trains_last_complete_step_and_ends():
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(10)]
    loader = PromptDataLoader(records, max_num_epochs=1, seed=0)
    cfg = make_cfg("grpo.max_num_steps=100")
    _, history, trainer, _ = run_controller(cfg, dataloader=loader)
    assert len(history) == 2  # 10 prompts, 4 per step: two complete steps, the rest untrained
    assert trainer.optimizer_steps == 2


def test_pump_crash_reaches_caller_with_original_exception():
    class Boom(RuntimeError):
        pass

    class CrashingTrainer(FakeTrainer):
        async def train_microbatches(self, batch, **kwargs):
            if self.optimizer_steps == 1:
                raise Boom("trainer exploded")
            return await super().train_microbatches(batch, **kwargs)

    cfg = make_cfg()
    with pytest.raises(Boom, match="trainer exploded"):
        run_controller(cfg, trainer=CrashingTrainer())


def test_colocated_engine_stands_down_for_each_train_step():
    events: list[str] = []

    class RecordingEngine(FakeGenerationBackend):
        async def sleep(self):
            events.append("sleep")
            await super().sleep()

        async def wake(self):
            events.append("wake")
            await super().wake()

    class RecordingTrainer(FakeTrainer):
        async def begin_train_step(self):
            events.append("train")
            await super().begin_train_step()

    cfg = make_cfg(
        "policy.generation.colocated.enabled=true",
        "async_rl.min_groups_for_streaming_train=4",
        "grpo.max_num_steps=3",
    )
    run_controller(cfg, trainer=RecordingTrainer(), engines=[RecordingEngine(seed=0)])
    assert events == ["sleep", "train", "wake"] * 3


@pytest.mark.parametrize("stand_down", [True, False])
def test_colocated_engine_decodes_through_train_steps_only_without_stand_down(stand_down):
    """colocated.stand_down: false keeps generation going while the trainer runs on the same
    devices (and lets a step train in chunks); with the stand-down nothing finishes meanwhile."""
    finished: list[float] = []
    training: list[tuple[float, float]] = []
    sleeps: list[float] = []

    class TimedEngine(FakeGenerationBackend):
        async def _one(self, request):
            result = await super()._one(request)
            finished.append(time.monotonic())
            return result

        async def sleep(self):
            sleeps.append(time.monotonic())
            await super().sleep()

    class TimedTrainer(FakeTrainer):
        async def begin_train_step(self):
            self.began = time.monotonic()
            await super().begin_train_step()

        async def finish_train_step(self):
            training.append((self.began, time.monotonic()))
            return await super().finish_train_step()

    cfg = make_cfg(
        "policy.generation.colocated.enabled=true",
        f"policy.generation.colocated.stand_down={str(stand_down).lower()}",
        f"async_rl.min_groups_for_streaming_train={4 if stand_down else 2}",
        "grpo.max_num_steps=4",
    )
    engine = TimedEngine(latency=LatencyModel("uniform", low=0.002, high=0.01), seed=0)
    _, history, _, _ = run_controller(
        cfg, trainer=TimedTrainer(train_seconds_per_step=0.05), engines=[engine]
    )
    assert len(history) == 4
    # Inside a train step, away from its edges (a request whose wait ended just before the
    # stand-down may still return in the same loop turn as the step's start).
    margin = 0.005
    during_training = [t for t in finished if any(a + margin < t < b - margin for a, b in training)]
    if stand_down:
        assert len(sleeps) == 4
        assert during_training == []
    else:
        assert sleeps == []
        assert len(during_training) > 0


def test_every_row_records_the_versions_that_produced_it():
    cfg = make_cfg("async_rl.sampler.max_lookahead_versions=1", "grpo.max_num_steps=5")
    trainer = FakeTrainer()
    controller, _, _, _ = run_controller(
        cfg, latency=LatencyModel("uniform", low=0.0, high=0.01), trainer=trainer
    )
    for step_index, step in enumerate(trainer.steps):
        for chunk in step.chunks:
            staleness = step_index - chunk["start_weight"]
            assert ((staleness >= 0) & (staleness <= 1)).all()
    counts = Counter(trained_group_ids(controller))
    assert max(counts.values()) == 1


class SlowLoadingEngine(FakeGenerationBackend):
    """Weights take ``load_s`` to load; records what each update carried and when it ended."""

    def __init__(self, events: list[tuple], load_s: float, **kwargs) -> None:
        super().__init__(**kwargs)
        self.events = events
        self.load_s = load_s

    async def update_weights(self, version, weights):
        await asyncio.sleep(self.load_s)
        self.events.append(("loaded", version, weights["fake_weights_version"]))
        await super().update_weights(version, weights)


class RecordingTrainer(FakeTrainer):
    def __init__(self, events: list[tuple], **kwargs) -> None:
        super().__init__(**kwargs)
        self.events = events

    async def begin_train_step(self):
        self.events.append(("begin", self.optimizer_steps))
        await super().begin_train_step()

    async def finish_train_step(self):
        self.events.append(("finish", self.optimizer_steps))
        return await super().finish_train_step()


def test_next_step_trains_while_generation_loads_the_weights():
    """With lookahead 1 the trainer starts step n+1 before generation holds weights n+1 (the
    sync runs in the step's tail), yet every sync carries exactly the weights of its version,
    each step's optimizer step waits for the previous sync, and the metrics are complete."""
    events: list[tuple] = []
    cfg = make_cfg(
        "async_rl.sampler.max_lookahead_versions=1",
        "async_rl.min_groups_for_streaming_train=4",
        "grpo.max_num_steps=5",
    )
    engine = SlowLoadingEngine(events, load_s=0.05, seed=0)
    _, history, _, _ = run_controller(cfg, trainer=RecordingTrainer(events), engines=[engine])
    loads = [event for event in events if event[0] == "loaded"]
    assert [(version, weights) for _, version, weights in loads] == [(v, v) for v in range(1, 6)]
    overlapped = [
        version
        for version in range(1, 5)
        if events.index(("begin", version)) < events.index(("loaded", version, version))
    ]
    assert overlapped, events  # at least one step began before its weights were loaded
    for version in range(1, 5):  # the optimizer step of n+1 only after sync n landed
        assert events.index(("loaded", version, version)) < events.index(("finish", version))
    assert [row["trainer_version"] for row in history] == [1, 2, 3, 4, 5]
    assert all(row["weight_sync_s"] >= 0.05 for row in history)
    assert engine.weight_updates == [1, 2, 3, 4, 5]


def test_sync_mode_never_trains_ahead_of_the_weights():
    """Lookahead 0: the next step's data needs the new weights, so no step begins before the
    previous sync has landed."""
    events: list[tuple] = []
    cfg = make_cfg(
        *SYNC_ONE_STEP_AT_A_TIME,
        "grpo.max_num_steps=4",
    )
    run_controller(
        cfg, trainer=RecordingTrainer(events), engines=[SlowLoadingEngine(events, 0.02, seed=0)]
    )
    for version in range(1, 4):
        assert events.index(("loaded", version, version)) < events.index(("begin", version))


def test_a_failed_sync_in_the_tail_ends_the_run_with_its_error():
    class SyncBroke(RuntimeError):
        """The generation engine failed to load the new weights."""

    class BreakingEngine(FakeGenerationBackend):
        async def update_weights(self, version, weights):
            if version == 2:
                raise SyncBroke("engine lost its weights")
            await super().update_weights(version, weights)

    cfg = make_cfg("async_rl.sampler.max_lookahead_versions=1", "grpo.max_num_steps=6")
    with pytest.raises(SyncBroke, match="engine lost its weights"):
        run_controller(cfg, engines=[BreakingEngine(seed=0)])


class RecordingSink:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.samples: dict[int, list[dict]] = {}

    def log_step(self, metrics: dict) -> None:
        self.rows.append(dict(metrics))

    def log_samples(self, step: int, samples: list[dict]) -> None:
        self.samples[step] = samples


def test_each_step_reaches_the_metrics_sink_with_env_metrics_and_samples_every_period() -> None:
    cfg = make_cfg("logger.sample_log_period=2")
    sink = RecordingSink()
    parts = ControllerParts(
        trainer=FakeTrainer(),
        engines=[FakeGenerationBackend(seed=1)],
        env=CountingEnv(),
        codec=fake_codec(),
        metrics_sink=sink,
    )

    async def go():
        controller = build_controller(cfg, parts)
        return controller, await asyncio.wait_for(controller.run(), timeout=60)

    controller, history = asyncio.run(go())
    assert [row["step"] for row in sink.rows] == [1, 2, 3, 4, 5, 6]
    assert sink.rows == history
    # The counting task reports exact_match and truncated per completion: averaged per step.
    assert all(0.0 <= row["env/exact_match"] <= 1.0 for row in sink.rows)
    assert all("env/truncated" in row for row in sink.rows)
    assert sorted(sink.samples) == [2, 4, 6]
    for samples in sink.samples.values():
        assert samples and all(sample["prompt"].endswith("=") for sample in samples)
        assert all(isinstance(sample["reward"], float) for sample in samples)
    # The driver's polls: rows it has seen are forgotten, so history stays short.
    assert [row["step"] for row in controller.take_progress(4)] == [5, 6]
    assert len(controller.history) == 2
    assert controller.take_progress(6) == [] and controller.history == []


def test_a_stop_request_ends_the_run_at_a_step_boundary_with_nothing_lost() -> None:
    """request_stop (SIGTERM at the driver): no new step starts, the run returns normally, and
    every admitted group is either trained, buffered or in flight (kept for a restart)."""
    cfg = make_cfg("grpo.max_num_steps=1000")
    trainer = FakeTrainer()
    parts = ControllerParts(
        trainer=trainer,
        engines=[FakeGenerationBackend(latency=LatencyModel(seconds=0.002), seed=1)],
        env=CountingEnv(),
        codec=fake_codec(),
    )

    async def go():
        controller = build_controller(cfg, parts)

        async def stop_after_three_steps(ctrl, row):
            if row["step"] == 3:
                ctrl.request_stop()

        controller.step_hooks.append(stop_after_three_steps)
        history = await asyncio.wait_for(controller.run(), timeout=60)
        return controller, history

    controller, history = asyncio.run(go())
    # The hook of step 3 may run while step 4 trains (the step tail overlaps the next step):
    # that step finishes, no other starts.
    steps = [row["step"] for row in history]
    assert steps in ([1, 2, 3], [1, 2, 3, 4])
    assert controller.state.step == steps[-1]
    assert controller.state.consumed_groups == 4 * steps[-1]
    assert controller.buffer.num_claimed == 0  # an open step's claims were given back


def test_a_kl_penalty_gives_every_chunk_reference_logprobs():
    """loss_fn.reference_policy_kl_penalty > 0: the step runner asks the trainer's reference
    policy for every trained chunk's logprobs and hands them to the loss; off, never."""
    streaming = ("async_rl.min_groups_for_streaming_train=2", "grpo.max_num_steps=3")
    _, _, with_kl, _ = run_controller(
        make_cfg(*streaming, "loss_fn.reference_policy_kl_penalty=0.01")
    )
    chunks = [chunk for step in with_kl.steps for chunk in step.chunks]
    assert len(chunks) >= 3 and with_kl.reference_calls == len(chunks)
    assert all("reference_logprobs" in chunk for chunk in chunks)
    _, _, without, _ = run_controller(make_cfg(*streaming))
    assert without.reference_calls == 0
    assert not any("reference_logprobs" in c for step in without.steps for c in step.chunks)
