"""Validation passes beside the two pumps, driven with a fake engine and a recording trainer."""

from __future__ import annotations

import asyncio
import json
from collections import Counter

import pytest

from tandemrl.checkpoint.inspect import describe_checkpoint_dir, render_text
from tandemrl.checkpoint.journal import read_journal, reported_validations
from tandemrl.checkpoint.layout import JOURNAL, list_step_dirs
from tandemrl.checkpoint.restore import plan_restore
from tandemrl.config.loader import load_config
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.controller.validation import EVAL_REQUEST_PREFIX
from tandemrl.dataplane.local import LocalDataPlane
from tandemrl.envs.counting import CountingEnv
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel, fake_codec
from tandemrl.metrics.logger import MetricsLogger
from tandemrl.records import GenerationRequest, GenerationResult, PromptItem
from tandemrl.training.fake import FakeTrainer

# fake_codec: each character is one token (ord % 16); training prompts "ddd=" are 4 tokens,
# these held-out prompts 8, so a trained row of more than 4 + 4 tokens would be one of them.
VAL_PROMPTS = [
    PromptItem(f"val-i{i}", 0, i, f"9999{i % 10}{i % 7}{i % 3}=", "123", task_source=src)
    for i, src in enumerate(["a", "b", "a", "b", "a", "b"])
]
TRAIN_ROW_MAX_TOKENS = 4 + 4


def make_cfg(*overrides: str, base: str = "examples/configs/grpo_tiny_cpu.yaml"):
    return load_config(
        base,
        (
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
            "grpo.max_num_steps=6",
            "logger.progress=false",
            "data.validation=builtin://counting",
            *overrides,
        ),
    )


class RecordingEngine(FakeGenerationBackend):
    """Records every call: evaluation or training, how many of each were in flight at once,
    which requests were aborted, what was in flight when it was told to stand down. Evaluation
    requests take ``eval_latency_s`` (and wait for ``gates`` of their version)."""

    def __init__(self, *, eval_latency_s: float = 0.0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.eval_latency_s = eval_latency_s
        self.inflight = Counter()
        self.most_inflight = Counter()
        self.most_total = 0
        self.eval_requests: list[str] = []
        self.aborted_ids: list[str] = []
        self.eval_inflight_at_sleep: list[int] = []
        # version -> (event, first prompt index it holds): prompts of the version from that
        # index on wait for the event.
        self.gates: dict[int, tuple[asyncio.Event, int]] = {}

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        kind = "eval" if requests[0].request_id.startswith(EVAL_REQUEST_PREFIX) else "train"
        self.inflight[kind] += 1
        self.most_inflight[kind] = max(self.most_inflight[kind], self.inflight[kind])
        self.most_total = max(self.most_total, sum(self.inflight.values()))
        try:
            if kind == "eval":
                self.eval_requests.extend(r.request_id for r in requests)
                version, index = _version_and_index(requests[0].request_id)
                gate = self.gates.get(version)
                if gate is not None and index >= gate[1]:
                    await gate[0].wait()
                if self.eval_latency_s:
                    await self._wait_latency(self.eval_latency_s)
            return await super().generate(requests)
        finally:
            self.inflight[kind] -= 1

    async def abort(self, request_ids: list[str]) -> None:
        self.aborted_ids.extend(request_ids)
        await super().abort(request_ids)

    async def sleep(self) -> None:
        self.eval_inflight_at_sleep.append(self.inflight["eval"])
        await super().sleep()


def _version_and_index(request_id: str) -> tuple[int, int]:
    version, index = request_id.removeprefix(EVAL_REQUEST_PREFIX).split("/")[:2]
    return int(version.removeprefix("v")), int(index)


class RecordingSink:
    def __init__(self) -> None:
        self.rows: list[dict] = []
        self.validation: list[dict] = []

    def log_step(self, metrics: dict) -> None:
        self.rows.append(dict(metrics))

    def log_samples(self, step: int, samples: list[dict]) -> None:
        pass

    def log_validation(self, metrics: dict) -> None:
        self.validation.append(dict(metrics))


class RecordingDataPlane(LocalDataPlane):
    def __init__(self) -> None:
        super().__init__()
        self.sample_ids: list[str] = []

    async def put_block(self, block) -> None:
        self.sample_ids.extend(block.sample_ids)
        await super().put_block(block)


def run(cfg, engine, *, sink=None, trainer=None, data_plane=None, step_hooks=None):
    trainer = trainer or FakeTrainer(train_seconds_per_step=0.004)
    parts = ControllerParts(
        trainer=trainer,
        engines=[engine],
        env=CountingEnv(),
        codec=fake_codec(),
        metrics_sink=sink,
        data_plane=data_plane,
        validation_prompts=VAL_PROMPTS,
    )

    async def go():
        controller = build_controller(cfg, parts, step_hooks=step_hooks)
        history = await asyncio.wait_for(controller.run(), timeout=60)
        return controller, history

    controller, history = asyncio.run(go())
    return controller, history, trainer


def test_evaluation_requests_share_the_workers_but_never_reach_the_buffer_or_the_trainer():
    cfg = make_cfg(
        "grpo.val_period=2",
        "grpo.val_at_start=true",
        "grpo.val_num_generations=2",
        "policy.generation.val_temperature=1.0",
    )
    engine = RecordingEngine(latency=LatencyModel("uniform", low=0.0, high=0.003), seed=1)
    data_plane = RecordingDataPlane()
    controller, history, trainer = run(cfg, engine, data_plane=data_plane)

    # The same worker generated both kinds: 4 passes x 6 prompts x 2 completions.
    assert len(engine.eval_requests) == 4 * len(VAL_PROMPTS) * 2
    assert engine.most_inflight["train"] > 0
    # None of them became a row, a slot or a trained sequence.
    assert data_plane.sample_ids and not any(s.startswith("val") for s in data_plane.sample_ids)
    assert all(g.group_id.startswith("e") for _, g in controller.trained_groups)
    assert sum(step.num_sequences for step in trainer.steps) == 6 * 4 * 2
    for step in trainer.steps:
        for chunk in step.chunks:
            assert int(chunk["attention_mask"].sum(dim=1).max()) <= TRAIN_ROW_MAX_TOKENS
    assert len(history) == 6


def test_every_scheduled_version_is_reported_exactly_once_with_its_metrics():
    # Slow passes overlap (a pass outlives val_period steps): each keeps its own version.
    cfg = make_cfg(
        "grpo.val_period=3",
        "grpo.val_at_start=true",
        "grpo.val_at_end=true",
        "grpo.max_num_steps=10",
    )
    engine = RecordingEngine(eval_latency_s=0.02, seed=1)
    sink = RecordingSink()
    controller, history, _ = run(cfg, engine, sink=sink)

    versions = [row["trainer_version"] for row in sink.validation]
    assert sorted(versions) == [0, 3, 6, 9, 10], versions  # 10: val_at_end
    assert sink.validation == controller.validation_history
    for row in sink.validation:
        assert row["val/num_prompts"] == len(VAL_PROMPTS)
        assert row["val/num_completions"] == len(VAL_PROMPTS)  # k = 1, greedy
        assert row["val/failed_completions"] == 0
        for name in ("reward_mean", "pass@1", "mean_length", "truncated_frac"):
            assert 0.0 <= row[f"val/{name}"] <= 4.0
            for source in ("a", "b"):
                assert f"val/{source}/{name}" in row
        assert row["val/version_span"] >= 0
    # Evaluation requests are greedy: temperature 0 unless val_temperature says otherwise.
    assert len(history) == 10
    # Training kept going while passes ran: some pass was reported steps after its version.
    assert any(row["reported_at_step"] > row["trainer_version"] for row in sink.validation)


def test_validation_keeps_to_its_share_of_the_inflight_budget_and_is_never_aborted():
    # windowed, staleness 0: stale training rollouts are aborted at every sync; evaluation
    # requests in flight at the same moments are exempt.
    cfg = make_cfg(
        "async_rl.sampler={name: windowed, max_staleness_versions: 0}",
        "async_rl.max_inflight_prompts=8",
        "async_rl.max_buffered_rollouts=8",
        "async_rl.min_groups_for_streaming_train=4",
        "loss_fn.use_importance_sampling_correction=false",
        "grpo.val_period=1",
        "grpo.val_batch_size=3",
        "grpo.max_num_steps=5",
    )
    engine = RecordingEngine(
        latency=LatencyModel("uniform", low=0.0, high=0.01), eval_latency_s=0.01, seed=2
    )
    sink = RecordingSink()
    run(cfg, engine, sink=sink)

    assert engine.most_inflight["eval"] == 3  # val_batch_size prompts at most
    assert engine.most_total <= 8  # async_rl.max_inflight_prompts, both kinds together
    assert engine.aborted_ids, "the windowed sampler aborted no stale rollout"
    assert not [i for i in engine.aborted_ids if i.startswith(EVAL_REQUEST_PREFIX)]
    assert [row["trainer_version"] for row in sink.validation] == [1, 2, 3, 4, 5]
    assert all(row["val/failed_completions"] == 0 for row in sink.validation)


def test_colocated_runs_evaluate_while_awake_never_across_a_stand_down():
    cfg = make_cfg(
        "policy.generation.colocated.enabled=true",
        "async_rl.min_groups_for_streaming_train=4",
        "grpo.val_period=2",
        "grpo.val_at_start=true",
    )
    engine = RecordingEngine(eval_latency_s=0.01, seed=3)
    sink = RecordingSink()
    run(cfg, engine, sink=sink)

    assert len(engine.eval_inflight_at_sleep) == 6  # one stand-down per step
    assert set(engine.eval_inflight_at_sleep) == {0}
    assert [row["trainer_version"] for row in sink.validation] == [0, 2, 4, 6]
    assert all(row["val/version_span"] == 0 for row in sink.validation)


CKPT = "examples/configs/grpo_tiny_cpu_checkpointed.yaml"


class Crash(RuntimeError):
    """Stands in for a SIGKILL: the run ends without its final checkpoint."""


def test_a_pass_open_at_a_crash_is_redone_once_at_its_version_and_none_is_reported_twice(
    tmp_path,
):
    cfg = make_cfg(
        "grpo.val_period=1",
        "grpo.max_num_steps=8",
        "checkpointing.save_period=1",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        f"logger.log_dir={tmp_path / 'logs'}",
        "logger.tensorboard=false",
        "logger.plot=false",
        base=CKPT,
    )

    async def attempt(engine, step_hooks, resume_step):
        parts = ControllerParts(
            trainer=FakeTrainer(train_seconds_per_step=0.004),
            engines=[engine],
            env=CountingEnv(),
            codec=fake_codec(),
            metrics_sink=MetricsLogger(cfg.logger, resume_step=resume_step, display=False),
            validation_prompts=VAL_PROMPTS,
        )
        controller = build_controller(cfg, parts, step_hooks=step_hooks)
        plan = plan_restore(cfg)
        await controller.resume(plan)
        try:
            await asyncio.wait_for(controller.run(), timeout=60)
        finally:
            controller.journal.close()
            parts.metrics_sink.close()
        return controller, plan

    # Attempt 1: the passes of versions 4 and 5 wait (from their third prompt on) until the
    # hook after step 5's checkpoint lets version 4 finish; a rollout snapshot then holds
    # version 5's pass open with its first two prompts finished, and the process "dies".
    first = RecordingEngine(seed=1)
    first.gates = {4: (asyncio.Event(), 2), 5: (asyncio.Event(), 2)}

    async def crash_after_step_5(controller, row):
        if row["step"] != 5:
            return
        first.gates[4][0].set()
        while 4 not in [r["trainer_version"] for r in controller.validation_history]:
            await asyncio.sleep(0.001)
        opened = controller.run_state.validation.pass_at(5)
        while len(opened.results) < 2:  # the ungated prompts of version 5 finish
            await asyncio.sleep(0.001)
        assert await controller.checkpointer.attempt_snapshot() is not None  # keeps them
        raise Crash("killed")

    with pytest.raises(Crash):
        asyncio.run(attempt(first, [crash_after_step_5], 0))

    second = RecordingEngine(seed=2)
    _, plan = asyncio.run(attempt(second, [], None))
    assert plan.step == 5  # attempt 2 resumed from step 5's checkpoint

    # Version 4 was reported before the crash (after the checkpoint that held it open): not
    # redone. Version 5 was open: re-opened once, only its unfinished prompts evaluated.
    redone = {_version_and_index(rid) for rid in second.eval_requests}
    assert {version for version, _ in redone} == {5, 6, 7, 8}
    assert sorted(index for version, index in redone if version == 5) == [2, 3, 4, 5]
    events = read_journal(tmp_path / "ckpt" / JOURNAL)
    validated = Counter(e["version"] for e in events if e["event"] == "validated")
    assert validated == Counter({v: 1 for v in range(1, 9)}), validated
    reopened = [e for e in events if e["event"] == "validation_opened" and e["restarts"]]
    assert [(e["version"], e["kept"]) for e in reopened] == [(5, 2)]
    assert sorted(reported_validations(events)) == list(range(1, 9))
    # validation.jsonl holds each version once, after the restart's rewrite.
    lines = (tmp_path / "logs" / "validation.jsonl").read_text().splitlines()
    assert sorted(json.loads(line)["trainer_version"] for line in lines) == list(range(1, 9))


def test_the_best_checkpoint_is_kept_besides_the_latest_and_inspect_says_why(tmp_path):
    cfg = make_cfg(
        "grpo.val_period=1",
        "grpo.max_num_steps=8",
        "grpo.val_num_generations=2",
        "policy.generation.val_temperature=1.0",
        "checkpointing.save_period=1",
        "checkpointing.keep_top_k=1",
        "checkpointing.metric_name=val/reward_mean",
        f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
        base=CKPT,
    )
    parts = ControllerParts(
        trainer=FakeTrainer(train_seconds_per_step=0.004),
        # The fake engine's tokens follow the request id, which holds the version: each
        # version scores differently.
        engines=[RecordingEngine(eval_latency_s=0.01, seed=4)],
        env=CountingEnv(),
        codec=fake_codec(),
        validation_prompts=VAL_PROMPTS,
    )

    async def go():
        controller = build_controller(cfg, parts)
        await controller.resume(plan_restore(cfg))
        await asyncio.wait_for(controller.run(), timeout=60)
        controller.journal.close()
        return controller

    controller = asyncio.run(go())
    scores = {r["trainer_version"]: r["val/reward_mean"] for r in controller.validation_history}
    assert sorted(scores) == list(range(1, 9))
    best = max(scores, key=lambda version: (scores[version], version))
    on_disk = [step for step, _ in list_step_dirs(tmp_path / "ckpt")]
    assert on_disk == sorted({8, best}), (on_disk, scores)

    info = describe_checkpoint_dir(tmp_path / "ckpt")
    assert info["best_checkpoint"]["best"]["step"] == best
    text = render_text(info)
    assert f"best checkpoint: step_{best}" in text and "val/reward_mean" in text


def test_a_stop_while_the_stand_down_waits_for_a_pass_ends_the_run_without_that_step():
    cfg = make_cfg(
        "policy.generation.colocated.enabled=true",
        "async_rl.min_groups_for_streaming_train=4",
        "grpo.val_period=2",
    )
    engine = RecordingEngine(seed=5)
    engine.gates = {2: (asyncio.Event(), 0)}  # the pass of version 2 never finishes

    async def stop_soon(controller, row):
        if row["step"] == 2:
            asyncio.get_running_loop().call_later(0.2, controller.request_stop)

    sink = RecordingSink()
    controller, history, trainer = run(cfg, engine, sink=sink, step_hooks=[stop_soon])
    assert [row["step"] for row in history] == [1, 2]
    assert trainer.optimizer_steps == 2
    assert engine.eval_inflight_at_sleep == [0, 0]  # step 3 never stood down
    assert sink.validation == []  # the open pass is not reported (a restart re-opens it)
    assert controller.run_state.validation.open_versions() == [2]


def test_a_run_whose_last_pass_a_kill_left_open_is_not_complete(tmp_path):
    from tandemrl.checkpoint.restore import RestorePlan
    from tandemrl.controller.run import run_already_complete

    cfg = make_cfg("grpo.val_period=2", "grpo.max_num_steps=4")
    bundle = tmp_path / "step_4"
    bundle.mkdir()
    plan = RestorePlan(tmp_path, "latest", trainer_dir=bundle, rollout_dir=bundle, step=4)
    (bundle / "train_state.json").write_text(json.dumps({"validation": {"open": []}}))
    assert run_already_complete(cfg, plan)
    (bundle / "train_state.json").write_text(
        json.dumps({"validation": {"open": [{"version": 4, "pending": [0], "results": []}]}})
    )
    assert not run_already_complete(cfg, plan)


def test_the_journal_voids_reports_of_versions_a_restart_trains_again():
    events = [
        {"event": "start", "resumed_step": 0, "source": None},
        {"event": "validated", "version": 0, "metrics": {"val/reward_mean": 0.1}},
        {"event": "start", "resumed_step": 0, "source": None},  # killed before a bundle
        {"event": "validated", "version": 0, "metrics": {"val/reward_mean": 0.2}},
        {"event": "validated", "version": 2, "metrics": {"val/reward_mean": 0.3}},
        {"event": "validated", "version": 4, "metrics": {"val/reward_mean": 0.4}},
        {"event": "start", "resumed_step": 3, "source": "ckpt/step_3"},
    ]
    reported = reported_validations(events)
    assert {v: row["val/reward_mean"] for v, row in reported.items()} == {0: 0.2, 2: 0.3}


def test_validation_runs_beside_dynamic_sampling_and_reward_shaping():
    cfg = make_cfg(
        "grpo.use_dynamic_sampling=true",
        "grpo.reward_scaling={enabled: true, source_min: 0.0, source_max: 1.0, target_min: -1.0,"
        " target_max: 1.0}",
        "grpo.val_period=2",
        "grpo.val_at_start=true",
    )
    engine = RecordingEngine(latency=LatencyModel("uniform", low=0.0, high=0.003), seed=6)
    sink = RecordingSink()
    controller, history, _ = run(cfg, engine, sink=sink)
    assert len(history) == 6
    assert [row["trainer_version"] for row in sink.validation] == [0, 2, 4, 6]
    # Held-out rewards are the environment's own: validation is scored, not shaped or scaled.
    assert all(0.0 <= row["val/reward_mean"] <= 1.0 for row in sink.validation)
    assert all(g.group_id.startswith("e") for _, g in controller.trained_groups)
