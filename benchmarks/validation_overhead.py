"""What validation costs the train pump: the CPU main job with and without validation passes.

The default job (``examples/configs/grpo_tiny_cpu.yaml``: tiny Qwen2, torch generation worker,
policy worker, object-store weight sync, on local Ray) runs ``--steps`` steps without
validation and with ``grpo.val_period: 10`` (greedy passes over ``--val-samples`` held-out
counting prompts on the same generation worker), interleaved in ``--repeats`` pairs within one
Ray session, the order alternating (without-with, with-without, ...) so that a drift of the
machine's load favours neither, after one short discarded run that pays the cold start.
Steps/s of a run: the steps after ``--warmup`` divided by the sum of their ``step_time_s`` (the
wall time between step closes). Ends with one line ``RESULT {json}``;
``with_over_without_steps_per_s`` is the median of the per-pair ratios (goal: at least 0.95).

    python benchmarks/validation_overhead.py [--steps 80] [--repeats 3] [--val-samples 128]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.run import run_training

CONFIG = Path(__file__).resolve().parents[1] / "examples" / "configs" / "grpo_tiny_cpu.yaml"


def one_run(
    workdir: Path, *, steps: int, warmup: int, validation: bool, val_samples: int
) -> dict[str, float]:
    log_dir = workdir / ("with" if validation else "without")
    overrides = [
        f"grpo.max_num_steps={steps}",
        f"logger.log_dir={log_dir}",
        "logger.tensorboard=false",
        "logger.plot=false",
        "logger.progress=false",
        "logger.save_final_model=false",
        "logger.level=WARNING",
    ]
    if validation:
        overrides += [
            "grpo.val_period=10",
            f"grpo.max_val_samples={val_samples}",
            "data.validation=builtin://counting",
        ]
    cfg = load_config(CONFIG, overrides)
    started = time.perf_counter()
    assert run_training(cfg, overwrite_logs=True) == 0
    wall = time.perf_counter() - started
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    measured = rows[warmup:]
    result = {
        "steps_per_s": len(measured) / sum(row["step_time_s"] for row in measured),
        "wall_s": wall,
        "train_idle_frac": statistics.mean(row["train_idle_frac"] for row in measured),
    }
    passes_file = log_dir / "validation.jsonl"
    if validation:
        passes = [json.loads(line) for line in passes_file.read_text().splitlines()]
        result["passes"] = len(passes)
        result["val_duration_s"] = statistics.mean(p["val/duration_s"] for p in passes)
        result["val_reward_last"] = passes[-1]["val/reward_mean"]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--val-samples", type=int, default=128)
    args = parser.parse_args()

    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    torch.set_num_threads(1)
    ray.init(num_cpus=os.cpu_count() or 1, include_dashboard=False, log_to_driver=False)
    runs: dict[str, list[dict[str, float]]] = {"without": [], "with": []}
    try:
        with tempfile.TemporaryDirectory(prefix="tandemrl-val-overhead-") as workdir:
            one_run(  # discarded: builds the tiny model, warms caches
                Path(workdir),
                steps=args.warmup + 5,
                warmup=args.warmup,
                validation=False,
                val_samples=args.val_samples,
            )
            for pair in range(args.repeats):
                for validation in (False, True) if pair % 2 == 0 else (True, False):
                    runs["with" if validation else "without"].append(
                        one_run(
                            Path(workdir),
                            steps=args.steps,
                            warmup=args.warmup,
                            validation=validation,
                            val_samples=args.val_samples,
                        )
                    )
    finally:
        ray.shutdown()

    ratios = [
        pair_with["steps_per_s"] / pair_without["steps_per_s"]
        for pair_without, pair_with in zip(runs["without"], runs["with"], strict=True)
    ]
    result = {
        "steps": args.steps,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "val_period": 10,
        "val_samples": args.val_samples,
        "steps_per_s_without": round(
            statistics.median(r["steps_per_s"] for r in runs["without"]), 3
        ),
        "steps_per_s_with": round(statistics.median(r["steps_per_s"] for r in runs["with"]), 3),
        "pair_ratios": [round(ratio, 3) for ratio in ratios],
        "with_over_without_steps_per_s": round(statistics.median(ratios), 3),
        "passes_per_run": runs["with"][0]["passes"],
        "val_pass_duration_s": round(
            statistics.median(r["val_duration_s"] for r in runs["with"]), 3
        ),
        "load_1min": round(os.getloadavg()[0], 1),
    }
    print(json.dumps({"runs": runs}))
    print("RESULT " + json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
