"""What the commit log costs the control plane: the same in-process run with it on and off.

A run over fakes (fake generation engine and trainer, the default tiny config with trainer
checkpoints every step and periodic snapshots) is timed with
``rollout_checkpointing.commit_log`` true and false, alternating, ``--repeats`` times each. It
reports the median wall time and process CPU time per run, and for the log: records, bytes
and fsyncs written per committed group. Ends with one line ``RESULT {json}``.

    python benchmarks/commit_log_overhead.py [--prompts 256] [--repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from tandemrl.checkpoint.restore import plan_restore
from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.training.fake import FakeTrainer


def config(checkpoint_dir: Path, *, commit_log: bool):
    return load_config(
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        [
            "grpo.num_prompts_per_step=8",
            "grpo.num_generations_per_prompt=8",
            "policy.train_global_batch_size=64",
            "policy.train_micro_batch_size=64",
            "grpo.max_num_steps=100000",
            "grpo.max_num_epochs=1",
            "async_rl.min_groups_for_streaming_train=8",
            "async_rl.max_buffered_rollouts=16",
            "async_rl.max_inflight_prompts=16",
            f"checkpointing.checkpoint_dir={checkpoint_dir}",
            "checkpointing.save_period=1",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.5",
            f"rollout_checkpointing.commit_log={str(commit_log).lower()}",
            "logger.progress=false",
        ],
    )


async def one_run(prompts: int, *, commit_log: bool) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="tandemrl-commit-log-") as workdir:
        cfg = config(Path(workdir) / "ckpt", commit_log=commit_log)
        records = [PromptRecord(prompt=f"{i:04d}=", answer="123") for i in range(prompts)]
        controller = build_fake_controller(
            cfg,
            trainer=FakeTrainer(record_tensors=False),
            engines=[FakeGenerationBackend(latency=LatencyModel("fixed", seconds=0.002), seed=0)],
            dataloader=PromptDataLoader(records, max_num_epochs=1, seed=0),
        )
        await controller.resume(plan_restore(cfg))
        log = controller.commit_log
        wall, cpu = time.perf_counter(), time.process_time()
        await controller.run()
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        controller.journal.close()
        result = {"wall_s": wall, "cpu_s": cpu, "steps": controller.state.step}
        if log is not None:
            result.update(records=log.records_written, bytes=log.bytes_written, fsyncs=log.fsyncs)
        return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    runs: dict[bool, list[dict[str, float]]] = {True: [], False: []}
    for _ in range(args.repeats):
        for commit_log in (False, True):
            runs[commit_log].append(asyncio.run(one_run(args.prompts, commit_log=commit_log)))

    def median(flag: bool, key: str) -> float:
        return statistics.median(run[key] for run in runs[flag])

    with_log = runs[True][-1]
    result = {
        "prompts": args.prompts,
        "repeats": args.repeats,
        "steps": with_log["steps"],
        "wall_s_off": round(median(False, "wall_s"), 3),
        "wall_s_on": round(median(True, "wall_s"), 3),
        "cpu_s_off": round(median(False, "cpu_s"), 3),
        "cpu_s_on": round(median(True, "cpu_s"), 3),
        "cpu_overhead_pct": round(100 * (median(True, "cpu_s") / median(False, "cpu_s") - 1), 1),
        "log_records_per_group": round(with_log["records"] / args.prompts, 2),
        "log_bytes_per_group": round(with_log["bytes"] / args.prompts),
        "fsyncs_per_group": round(with_log["fsyncs"] / args.prompts, 2),
    }
    print(json.dumps({"runs": {str(k): v for k, v in runs.items()}}))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
