"""What the controller keeps per step: its Python heap over a long in-process run over fakes.

The controller of the checkpointed main job (trainer checkpoints every step, rollout
snapshots, commit log, journal, metrics files), built over the fake engine and trainer, runs
``--steps`` steps in this process, as ``tandemrl train`` builds it in its controller actor
(``SingleControllerActor``: no per-group record, metrics rows handed to the driver and
forgotten). ``tracemalloc`` snapshots are taken at ``--warmup-steps`` and at the end; the
report gives the heap growth per 1,000 steps, the allocation sites that grew most, and the
sizes of the controller's containers at both points (records, not bytes).

    python benchmarks/controller_heap.py --steps 600 --warmup-steps 100

Ends with one line ``RESULT {json}``. The whole run's memory, Ray's processes included, is
``benchmarks/soak.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from tandemrl.checkpoint.restore import plan_restore
from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.controller.single_controller import SingleController
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.metrics.logger import MetricsLogger
from tandemrl.training.fake import FakeTrainer


def container_sizes(controller: SingleController) -> dict[str, int]:
    """Records held by the controller's growable containers."""
    return controller.retained_records()


async def run(steps: int, warmup: int, workdir: Path) -> dict[str, Any]:
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        [
            f"grpo.max_num_steps={steps}",
            "grpo.num_prompts_per_step=8",
            "policy.train_global_batch_size=64",
            "policy.train_micro_batch_size=64",
            "async_rl.min_groups_for_streaming_train=8",
            "async_rl.max_buffered_rollouts=16",
            "async_rl.max_inflight_prompts=16",
            f"checkpointing.checkpoint_dir={workdir / 'ckpt'}",
            f"logger.log_dir={workdir / 'logs'}",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.2",
            "logger.progress=false",
            "logger.tensorboard=false",
        ],
    )
    trainer = FakeTrainer(record_tensors=False)
    marks: dict[str, Any] = {}

    async def observe(controller: SingleController, row: dict[str, float]) -> None:
        # The fake trainer's own record of steps is test bookkeeping, not the controller's.
        trainer.steps.clear()
        # What the driver does every poll: take the new rows (the controller forgets them).
        controller.take_progress(int(row["step"]))
        if controller.state.step in (warmup, steps):
            gc.collect()
            marks[str(controller.state.step)] = {
                "snapshot": tracemalloc.take_snapshot(),
                "sizes": container_sizes(controller),
                "at": time.perf_counter(),
            }

    metrics = MetricsLogger(cfg.logger, resume_step=0, display=False)
    controller = build_fake_controller(
        cfg,
        trainer=trainer,
        engines=[FakeGenerationBackend(latency=LatencyModel("fixed", seconds=0.0), seed=0)],
        step_hooks=[observe],
        metrics_sink=metrics,
        keep_trained_groups=False,
    )
    tracemalloc.start(8)
    await controller.resume(plan_restore(cfg))
    try:
        await controller.run()
    finally:
        metrics.close()
        if controller.journal is not None:
            controller.journal.close()
    tracemalloc.stop()
    first, last = marks[str(warmup)], marks[str(steps)]
    growth = last["snapshot"].compare_to(first["snapshot"], "lineno")
    grown_bytes = sum(stat.size_diff for stat in growth)
    per_1k = 1000 / (steps - warmup)
    top = [
        {
            "site": str(stat.traceback[0]),
            "kib_per_1k_steps": round(stat.size_diff / 1024 * per_1k, 1),
        }
        for stat in growth[:8]
    ]
    return {
        "steps": steps,
        "warmup_steps": warmup,
        "heap_mib_per_1k_steps": round(grown_bytes / 2**20 * per_1k, 4),
        "top_growth": top,
        "records_at_warmup": first["sizes"],
        "records_at_end": last["sizes"],
        "steps_per_s": round((steps - warmup) / (last["at"] - first["at"]), 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup-steps", type=int, default=100)
    args = parser.parse_args()
    if not 0 < args.warmup_steps < args.steps:
        parser.error("--warmup-steps must be between 0 and --steps")
    with tempfile.TemporaryDirectory(prefix="tandemrl-heap-") as workdir:
        result = asyncio.run(run(args.steps, args.warmup_steps, Path(workdir)))
    print("RESULT " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
