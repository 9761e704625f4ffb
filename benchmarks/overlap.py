"""Step time of each sampler mode against the ideal max(G, T), with fake generation and training.

The fake engine is throughput-bound (a fixed number of requests decode at once), so one step's
worth of rollouts takes G seconds of generation; the fake trainer takes T seconds per step.
A synchronous loop pays G + T per step; perfect overlap pays max(G, T).

Scenario ``equal``: G = T, fixed per-request latency. Goal: every async mode <= 1.05 x max(G, T).
Scenario ``longtail``: lognormal per-request latency (same mean), where a few stragglers hold
up an exact-batch sampler while the streaming samplers train whatever is ready.

Two more comparisons (issue 33), each from this one run:

- ``windowed`` with ``over_sampling_ratio`` (``windowed_capped``) against plain ``windowed``
  on the long tail: wasted groups (evicted from the buffer or aborted in flight, both
  generated for nothing) per trained group, ``windowed_evicted_per_trained`` and
  ``windowed_capped_evicted_per_trained``, their ratio ``windowed_waste_reduction`` (goal
  >= 2) and ``windowed_capped_steps_per_s_ratio`` (goal 1 +- 0.05);
- the drain gate (``async_rl.in_flight_weight_updates: false``) against in-flight weight
  updates, both ``in_order`` lookahead 1: ``drain_cost`` (equal latencies) and
  ``longtail_drain_cost``, step time with the gate over step time without.

    python benchmarks/overlap.py [--seconds 0.2] [--steps 16] [--over-sampling-ratio 0.5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics

import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.training.fake import FakeTrainer

PROMPTS_PER_STEP = 8
GROUP_SIZE = 4
CONCURRENCY = 8  # requests the fake engine decodes at once
WARMUP_STEPS = 3

MODES: dict[str, tuple[str, int]] = {
    # name: (sampler block, min_groups_for_streaming_train)
    "sync": ("{name: in_order, max_lookahead_versions: 0}", PROMPTS_PER_STEP),
    "in_order": ("{name: in_order, max_lookahead_versions: 1}", PROMPTS_PER_STEP),
    "weight_fifo": ("{name: weight_fifo, max_staleness_versions: 1}", PROMPTS_PER_STEP // 4),
    "ready_first": ("{name: ready_first, max_staleness_versions: 1}", PROMPTS_PER_STEP // 4),
    "windowed": ("{name: windowed, max_staleness_versions: 1}", PROMPTS_PER_STEP // 4),
}


def run_mode(
    mode: str,
    latency: LatencyModel,
    train_seconds: float,
    steps: int,
    extra: tuple[str, ...] = (),
) -> dict[str, float]:
    """Mean step time after warm-up, and the groups trained and wasted over the same steps."""
    sampler, min_groups = MODES[mode]
    n, g = PROMPTS_PER_STEP, GROUP_SIZE
    capacity = n * 2 if mode != "windowed" else n * 3
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"grpo.num_prompts_per_step={n}",
            f"grpo.num_generations_per_prompt={g}",
            f"policy.train_global_batch_size={n * g}",
            f"policy.train_micro_batch_size={n * g}",
            f"grpo.max_num_steps={steps}",
            f"async_rl.sampler={sampler}",
            f"loss_fn.use_importance_sampling_correction={mode != 'sync'}",
            f"async_rl.min_groups_for_streaming_train={min_groups}",
            f"async_rl.max_buffered_rollouts={n if mode == 'sync' else capacity}",
            f"async_rl.max_inflight_prompts={n if mode == 'sync' else capacity}",
            *extra,
        ),
    )

    async def go() -> list[dict[str, float]]:
        engine = FakeGenerationBackend(latency=latency, seed=7, max_concurrency=CONCURRENCY)
        controller = build_fake_controller(
            cfg,
            trainer=FakeTrainer(train_seconds_per_step=train_seconds, record_tensors=False),
            engines=[engine],
        )
        return await controller.run()

    measured = asyncio.run(go())[WARMUP_STEPS:]
    return {
        "step_time_s": statistics.mean(row["step_time_s"] for row in measured),
        "trained": sum(row["groups_trained"] for row in measured),
        "wasted": sum(row["evicted_groups"] + row["aborted_groups"] for row in measured),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=0.2, help="G = T per step")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--over-sampling-ratio", type=float, default=0.5)
    args = parser.parse_args()
    torch.set_num_threads(1)
    requests_per_step = PROMPTS_PER_STEP * GROUP_SIZE
    mean_latency = args.seconds * CONCURRENCY / requests_per_step
    scenarios = {
        "equal": LatencyModel("fixed", seconds=mean_latency),
        # lognormal with the same mean: median = mean / exp(sigma^2 / 2)
        "longtail": LatencyModel("lognormal", seconds=mean_latency / math.exp(0.5), sigma=1.0),
    }
    ideal = args.seconds
    result: dict[str, float] = {"G_s": args.seconds, "T_s": args.seconds}
    for scenario, latency in scenarios.items():
        print(
            f"\nscenario {scenario}: G = T = {args.seconds:.3f} s, ideal max(G, T) = {ideal:.3f} s"
        )
        prefix = "" if scenario == "equal" else "longtail_"
        runs: dict[str, dict[str, float]] = {}
        for mode in MODES:
            runs[mode] = run_mode(mode, latency, args.seconds, args.steps)
            ratio = runs[mode]["step_time_s"] / ideal
            print(f"  {mode:12s} step {runs[mode]['step_time_s']:.3f} s  = {ratio:.2f} x ideal")
            result[f"{prefix}{mode}_vs_ideal"] = round(ratio, 3)
        drained = run_mode(
            "in_order",
            latency,
            args.seconds,
            args.steps,
            ("async_rl.in_flight_weight_updates=false",),
        )
        drain_cost = drained["step_time_s"] / runs["in_order"]["step_time_s"]
        print(f"  in_order, drain gate: step {drained['step_time_s']:.3f} s = {drain_cost:.3f} x")
        result[f"{prefix}drain_cost"] = round(drain_cost, 3)
        if scenario == "longtail":
            plain = runs["windowed"]
            capped = run_mode(
                "windowed",
                latency,
                args.seconds,
                args.steps,
                (f"async_rl.sampler.over_sampling_ratio={args.over_sampling_ratio}",),
            )
            waste = plain["wasted"] / plain["trained"]
            capped_waste = capped["wasted"] / capped["trained"]
            print(
                f"  windowed wasted/trained {waste:.3f}; with over_sampling_ratio "
                f"{args.over_sampling_ratio}: {capped_waste:.3f}, step {capped['step_time_s']:.3f} s"
            )
            result["windowed_evicted_per_trained"] = round(waste, 3)
            result["windowed_capped_evicted_per_trained"] = round(capped_waste, 3)
            result["windowed_waste_reduction"] = (
                round(waste / capped_waste, 3) if capped_waste > 0 else None
            )
            result["windowed_capped_steps_per_s_ratio"] = round(
                plain["step_time_s"] / capped["step_time_s"], 3
            )
            result["over_sampling_ratio"] = args.over_sampling_ratio
    result["goal_async_vs_ideal"] = 1.05
    result["goal_windowed_waste_reduction"] = 2.0
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
