"""Sync vs async on the real tiny task: generation and training in separate Ray processes.

Runs the default job three times for the same number of steps — sync (in_order, lookahead 0),
async (in_order, lookahead 1) and streaming (weight_fifo, staleness 1, half-step chunks) — and
prints throughput (steps/s and trained tokens/s, from the steady-state step times) and the
reward reached at equal steps. Goal: async >= 1.6x sync throughput when generation and
training take about the same time, with learning curves equal within noise.

    python benchmarks/async_vs_sync.py [--steps 200] [--generation-batch 32] [--seed 42]
        [--modes sync async streaming] [--no-reuse-logprobs]

Every mode runs with ``loss_fn.reuse_training_logprobs=true`` (the trainer's ``prev_logprobs``
come from the training forward, one forward pass per step fewer) unless
``--no-reuse-logprobs``.

On the default job generation is the lighter side (a sync run's trainer waits ~35% of each
step), so perfect overlap could only give ~1.5x. ``--generation-batch 32`` (the engine decodes
at most 32 sequences at once; ``policy.generation.max_batch_size``) makes generation about as
long as training (the trainer then waits ~47% of a sync step), the premise of the goal.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from tandemrl.config.loader import load_config
from tandemrl.controller.run import run_training

GOAL = 1.6
WARMUP_STEPS = 5

MODES = {
    "sync": ("examples/configs/grpo_tiny_cpu_sync.yaml", ()),
    "async": ("examples/configs/grpo_tiny_cpu.yaml", ()),
    "streaming": ("examples/configs/grpo_tiny_cpu_weight_fifo.yaml", ()),
}


def run_mode(
    config: str,
    overrides: tuple[str, ...],
    steps: int,
    log_dir: Path,
    generation_batch: int,
    reuse_logprobs: bool = True,
    seed: int = 42,
) -> list[dict]:
    cfg = load_config(
        config,
        (
            *overrides,
            f"loss_fn.reuse_training_logprobs={str(reuse_logprobs).lower()}",
            f"grpo.seed={seed}",
            f"policy.generation.max_batch_size={generation_batch}",
            f"grpo.max_num_steps={steps}",
            f"logger.log_dir={log_dir}",
            "logger.progress=false",
            "logger.tensorboard=false",
            "logger.plot=false",
        ),
    )
    run_training(cfg)
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


def summarize(rows: list[dict]) -> dict[str, Any]:
    steady = rows[WARMUP_STEPS:]
    step_time = statistics.mean(row["step_time_s"] for row in steady)
    tail = rows[-20:]
    return {
        "steps_per_s": 1.0 / step_time,
        "tokens_per_s": statistics.mean(row["tokens_per_s"] for row in steady),
        "reward_last20": statistics.mean(row["reward_mean"] for row in tail),
        "train_idle": statistics.mean(row["train_idle_frac"] for row in steady),
        "rollout_idle": statistics.mean(row["rollout_idle_frac"] for row in steady),
        "weight_sync_s": statistics.mean(row["weight_sync_s"] for row in steady),
        # CPU seconds of the trainer process per step (all its work: train, export): a
        # load-independent measure of the trainer side.
        "trainer_cpu_s": statistics.mean(row.get("train/process_cpu_s", 0.0) for row in steady),
        # The learning curve at equal steps: mean reward of each quarter of the run.
        "reward_quarters": [
            round(statistics.mean(row["reward_mean"] for row in part), 3)
            for part in (rows[i * len(rows) // 4 : (i + 1) * len(rows) // 4] for i in range(4))
            if part
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--generation-batch", type=int, default=32)
    parser.add_argument(
        "--no-reuse-logprobs",
        dest="reuse_logprobs",
        action="store_false",
        help="compute prev_logprobs with a separate get_logprobs pass (the old trainer path)",
    )
    parser.add_argument("--seed", type=int, default=42, help="grpo.seed of every mode")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=list(MODES))
    args = parser.parse_args()
    results: dict[str, dict[str, Any]] = {}
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        for mode in args.modes:
            config, overrides = MODES[mode]
            log_dir = Path(tmp) / mode
            results[mode] = summarize(
                run_mode(
                    config,
                    overrides,
                    args.steps,
                    log_dir,
                    args.generation_batch,
                    args.reuse_logprobs,
                    args.seed,
                )
            )
    print(
        f"\n{'mode':10s} {'steps/s':>8s} {'tok/s':>8s} {'reward@end':>10s} {'train idle':>10s} {'roll idle':>9s} {'trainer cpu/step':>16s}"
    )
    for mode, r in results.items():
        print(
            f"{mode:10s} {r['steps_per_s']:8.2f} {r['tokens_per_s']:8.0f} {r['reward_last20']:10.3f} "
            f"{r['train_idle']:10.2f} {r['rollout_idle']:9.2f} {r['trainer_cpu_s']:15.3f}s"
        )
    result: dict[str, object] = {
        "steps": args.steps,
        "generation_batch": args.generation_batch,
        "reuse_training_logprobs": args.reuse_logprobs,
        "seed": args.seed,
        "load_avg_1m_before_after": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "goal_async_over_sync": GOAL,
    }
    for mode, r in results.items():
        result[f"reward_{mode}"] = round(r["reward_last20"], 3)
        result[f"reward_quarters_{mode}"] = r["reward_quarters"]
        result[f"steps_per_s_{mode}"] = round(r["steps_per_s"], 3)
        result[f"weight_sync_s_{mode}"] = round(r["weight_sync_s"], 4)
        result[f"trainer_cpu_s_per_step_{mode}"] = round(r["trainer_cpu_s"], 4)
    if "sync" in results:
        sync = results["sync"]["steps_per_s"]
        result["sync_train_idle"] = round(results["sync"]["train_idle"], 3)
        for mode in ("async", "streaming"):
            if mode in results:
                result[f"{mode}_over_sync"] = round(results[mode]["steps_per_s"] / sync, 3)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
