"""Where distillation teachers should score: a rollout-pump stage, or the train pump.

``on_policy_distillation.teacher_scoring`` places the teacher pass either before each group
commits (``rollout``: it runs while the trainer trains the previous step) or in the train
pump beside the trainer's own logprob pass (``train``: the step waits for it). Two parts:

- ``pipeline``: fake generation, trainer and teacher whose costs are sleeps (a teacher worker
  scores one call at a time), so the numbers show the pumps' scheduling alone, whatever else
  the machine runs. Per step: generation G, training T, teacher K seconds. Ideal:
  max(G, T, K) when the teacher overlaps both pumps; max(G, T + K) when it adds to training.
- ``real`` (``--real``): ``tandemrl train`` on Ray with the tiny CPU models (student, teacher
  and generation in processes of their own), median step time of each placement, runs in ABBA
  order; on a 2-core machine the processes share the cores, so this measures contention too.

    python benchmarks/distill_placement.py [--steps 14] [--real --real-steps 30 --real-repeats 2]

Prints one ``RESULT {json}`` line: step times and their ratios (train / rollout > 1: the
rollout-pump stage overlaps better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.training.fake import FakeTeacher, FakeTrainer

EXEMPLAR = "examples/configs/distill_tiny_cpu.yaml"
PROMPTS_PER_STEP = 8
GROUP_SIZE = 4
CONCURRENCY = 8  # requests the fake engine decodes at once
WARMUP_STEPS = 3


def step_overrides(steps: int, placement: str) -> tuple[str, ...]:
    n, g = PROMPTS_PER_STEP, GROUP_SIZE
    return (
        f"on_policy_distillation.num_prompts_per_step={n}",
        f"on_policy_distillation.num_generations_per_prompt={g}",
        f"policy.train_global_batch_size={n * g}",
        f"policy.train_micro_batch_size={n * g}",
        f"on_policy_distillation.max_num_steps={steps}",
        f"on_policy_distillation.teacher_scoring={placement}",
        f"async_rl.max_buffered_rollouts={2 * n}",
        f"async_rl.max_inflight_prompts={2 * n}",
        "logger.progress=false",
    )


def pipeline_step_time(
    placement: str, *, generation_s: float, train_s: float, teacher_s: float, steps: int
) -> float:
    """Mean step time (after warm-up) with sleeps for G, T and K seconds per step."""
    cfg = load_config(EXEMPLAR, step_overrides(steps, placement))
    rows = PROMPTS_PER_STEP * GROUP_SIZE
    latency = LatencyModel("fixed", seconds=generation_s * CONCURRENCY / rows)

    async def go() -> list[dict[str, float]]:
        controller = build_fake_controller(
            cfg,
            trainer=FakeTrainer(train_seconds_per_step=train_s, record_tensors=False),
            engines=[FakeGenerationBackend(latency=latency, seed=7, max_concurrency=CONCURRENCY)],
            teacher_engines=[[FakeTeacher(seconds_per_sequence=teacher_s / rows)]],
        )
        return await controller.run()

    history = asyncio.run(go())
    return statistics.mean(row["step_time_s"] for row in history[WARMUP_STEPS:])


def real_step_time(placement: str, steps: int, workdir: Path) -> float:
    """Median step time of a real ``tandemrl train`` run (its own process: Ray, tiny CPU
    models)."""
    log_dir = workdir / placement
    overrides = [
        f"on_policy_distillation.max_num_steps={steps}",
        f"on_policy_distillation.teacher_scoring={placement}",
        # the teacher: any model with the student's tokenizer costs the same per token
        "on_policy_distillation.teachers.0.model_name=tiny://qwen2-counting",
        f"logger.log_dir={log_dir}",
        "logger.progress=false",
        "logger.tensorboard=false",
        "logger.plot=false",
        "logger.save_final_model=false",
    ]
    command = [sys.executable, "-m", "tandemrl.cli", "train", "--config", EXEMPLAR, *overrides]
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    # On a loaded machine Ray's start-up can time out; such a run is started again (up to
    # three attempts), any other failure ends the benchmark.
    for attempt in range(3):
        log_path = workdir / f"{placement}.{attempt}.log"
        with open(log_path, "wb") as output:
            code = subprocess.run(
                command, env=env, stdout=output, stderr=subprocess.STDOUT
            ).returncode
        if code == 0:
            break
        if "timed out during startup" not in log_path.read_text(errors="replace"):
            raise RuntimeError(f"the {placement} run failed ({code}); see {log_path}")
        print(f"{placement}: Ray's start-up timed out, starting the run again", flush=True)
    else:
        raise RuntimeError(f"the {placement} run could not start Ray three times; see {workdir}")
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    return statistics.median(row["step_time_s"] for row in rows[WARMUP_STEPS:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.2, help="G = T per step")
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--real", action="store_true", help="also time real tandemrl train runs")
    parser.add_argument("--real-steps", type=int, default=30)
    parser.add_argument(
        "--real-repeats", type=int, choices=(1, 2), default=2, help="1: A B; 2: A B B A"
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    seconds = args.seconds
    result: dict[str, Any] = {"G_s": seconds, "T_s": seconds}
    # Teacher cost per step, as a fraction of the train time.
    for fraction in (0.5, 1.0):
        teacher_s = fraction * seconds
        times = {
            placement: pipeline_step_time(
                placement,
                generation_s=seconds,
                train_s=seconds,
                teacher_s=teacher_s,
                steps=args.steps,
            )
            for placement in ("rollout", "train")
        }
        key = f"K{fraction:g}T"
        result[f"pipeline_{key}_rollout_s"] = round(times["rollout"], 3)
        result[f"pipeline_{key}_train_s"] = round(times["train"], 3)
        result[f"pipeline_{key}_train_over_rollout"] = round(times["train"] / times["rollout"], 3)
        result[f"pipeline_{key}_ideal_rollout_s"] = round(max(seconds, seconds, teacher_s), 3)
        result[f"pipeline_{key}_ideal_train_s"] = round(max(seconds, seconds + teacher_s), 3)
        print(
            f"teacher K = {fraction:g} T: rollout stage {times['rollout']:.3f} s/step, train pump "
            f"{times['train']:.3f} s/step"
        )
    if args.real:
        # ABBA order, so a load that drifts while the runs go on favours neither placement.
        order = ["rollout", "train", "train", "rollout"][: 2 * args.real_repeats]
        measured: dict[str, list[float]] = {"rollout": [], "train": []}
        workdir = Path(tempfile.mkdtemp(prefix="distill_placement_"))
        for index, placement in enumerate(order):
            (workdir / str(index)).mkdir()
            step_s = real_step_time(placement, args.real_steps, workdir / str(index))
            measured[placement].append(step_s)
            print(f"real run {index} ({placement}): median step {step_s:.3f} s", flush=True)
        print(f"the runs' metrics are in {workdir}")
        real = {placement: statistics.mean(times) for placement, times in measured.items()}
        result["real_runs"] = json.dumps(
            {p: [round(t, 3) for t in ts] for p, ts in measured.items()}
        )
        result["real_rollout_s"] = round(real["rollout"], 3)
        result["real_train_s"] = round(real["train"], 3)
        result["real_train_over_rollout"] = round(real["train"] / real["rollout"], 3)
        print(f"real runs: rollout {real['rollout']:.3f} s/step, train {real['train']:.3f} s/step")
    result["load_1min"] = round(os.getloadavg()[0], 2)
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
