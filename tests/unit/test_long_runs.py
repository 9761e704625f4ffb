"""A long run keeps nothing per step or per group in memory, and its teardown cannot hang.

Records are counted, not bytes: a run over fakes, built as ``tandemrl train`` builds it in
its controller actor (no per-group record, metrics rows taken by the driver and forgotten,
journal and commit log on), is sampled every step; no container grows with the steps run.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from tandemrl.checkpoint.restore import plan_restore
from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.controller.setup import Launched, call_with_deadline
from tandemrl.controller.single_controller import SingleController
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.metrics.logger import MetricsLogger
from tandemrl.rollout.manager import RECENT_SAMPLES
from tandemrl.run_state import ControllerState
from tandemrl.training.fake import FakeTrainer

STEPS = 240
PER_STEP = 2  # prompt groups per step
IN_FLIGHT = 4
BUFFERED = 4


def long_run_cfg(tmp_path: Path):
    return load_config(
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        (
            f"grpo.num_prompts_per_step={PER_STEP}",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=4",
            "policy.train_micro_batch_size=4",
            f"grpo.max_num_steps={STEPS}",
            f"async_rl.min_groups_for_streaming_train={PER_STEP}",
            f"async_rl.max_buffered_rollouts={BUFFERED}",
            f"async_rl.max_inflight_prompts={IN_FLIGHT}",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            # Trainer checkpoints at the end only: the journal and commit log run all along.
            f"checkpointing.save_period={STEPS}",
            "rollout_checkpointing.snapshot_attempt_interval_s=null",
            f"logger.log_dir={tmp_path / 'logs'}",
            "logger.tensorboard=false",
            "logger.plot=false",
            "logger.progress=false",
        ),
    )


def test_a_long_run_under_the_driver_keeps_nothing_per_step_or_group(tmp_path: Path) -> None:
    cfg = long_run_cfg(tmp_path)
    samples: list[dict[str, int]] = []

    async def driver_poll(controller: SingleController, row: dict[str, Any]) -> None:
        # What the driver does every poll: take the rows it has not shown (then forgotten).
        controller.take_progress(int(row["step"]))
        samples.append(controller.retained_records())

    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(64)]

    async def go() -> SingleController:
        metrics = MetricsLogger(cfg.logger, resume_step=0, display=False)
        controller = build_fake_controller(
            cfg,
            trainer=FakeTrainer(record_tensors=False),
            engines=[FakeGenerationBackend(seed=0)],
            dataloader=PromptDataLoader(records, max_num_epochs=1000, seed=0),
            step_hooks=[driver_poll],
            metrics_sink=metrics,
            keep_trained_groups=False,
        )
        await controller.resume(plan_restore(cfg))
        try:
            await asyncio.wait_for(controller.run(), timeout=120)
        finally:
            metrics.close()
            assert controller.journal is not None
            controller.journal.close()
        return controller

    controller = asyncio.run(go())
    assert controller.state.step == STEPS and len(samples) == STEPS
    # Every container is bounded by the config, never by the number of steps run (a container
    # added to retained_records needs its bound here).
    bounds = {
        "history": 1,  # the row of the step just closed, until the driver takes it
        "trained_groups": 0,  # no per-group record under the driver
        "inflight": IN_FLIGHT,
        "inflight_started_at": IN_FLIGHT,
        "abort_requested": IN_FLIGHT,
        "ledger_groups": IN_FLIGHT,
        "active_requests": IN_FLIGHT,
        "generation_batches": IN_FLIGHT,
        "buffer_slots": BUFFERED,
        "step_groups": PER_STEP,
        "recent_samples": RECENT_SAMPLES,
        "dropped_for_step": 0,
        "replacement_credits": 0,
        "replacement_reserve": 0,
        "recovered_groups": 0,
        "eviction_warnings": 0,
    }
    assert set(samples[0]) == set(bounds)
    for step, sample in enumerate(samples, start=1):
        over = {key: count for key, count in sample.items() if count > bounds[key]}
        assert not over, f"step {step}: {over}"
    # The journal on disk does hold every trained step: it is the run's record.
    journal = (tmp_path / "ckpt" / "journal.jsonl").read_text().splitlines()
    assert sum('"event": "trained"' in line for line in journal) == STEPS


def test_drop_counts_of_steps_already_trained_are_forgotten() -> None:
    state = ControllerState(trainer_version=4, dropped_for_step=Counter({1: 2, 3: 1, 4: 1, 6: 2}))
    state.forget_closed_steps()
    assert state.dropped_for_step == Counter({4: 1, 6: 2})  # the open step and later ones


def test_a_call_that_never_answers_is_given_up_at_its_deadline(
    caplog: pytest.LogCaptureFixture,
) -> None:
    never = threading.Event()
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        finished = call_with_deadline(never.wait, deadline_s=0.2, what="removing the group")
    assert not finished
    assert time.monotonic() - started < 5
    assert "removing the group did not finish within 0.2 s" in caplog.text
    assert call_with_deadline(lambda: None, deadline_s=5, what="a quick call")


def test_killing_the_actors_gives_up_when_ray_does_not_answer(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import ray

    killed: list[str] = []
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: killed.append(handle))
    launched = Launched(controller="controller", trainer="trainer", engines=["g0", "g1"])
    assert launched.shutdown(deadline_s=5)
    # the controller first (nothing then drives the others), then every other actor once
    assert killed[0] == "controller"
    assert sorted(killed[1:]) == ["g0", "g1", "trainer"]

    hang = threading.Event()
    monkeypatch.setattr(ray, "kill", lambda handle, no_restart: hang.wait())
    started = time.monotonic()
    assert not launched.shutdown(deadline_s=0.2)  # the GCS is gone: ray.kill never returns
    assert time.monotonic() - started < 5

    def refuse(handle: str, no_restart: bool) -> None:
        raise RuntimeError("the GCS is unreachable")

    monkeypatch.setattr(ray, "kill", refuse)
    with caplog.at_level(logging.WARNING):
        assert not launched.shutdown(deadline_s=5)
    assert "the GCS is unreachable" in caplog.text
