"""Prompt groups per second through the controller with zero-latency fakes (one core).

Everything real except the model: buffer, sampler, data plane, rollout manager, rows,
advantages, collation. Generation and training are fakes that take no time, so the figure is
the controller's own ceiling. Goal: >= 5,000 groups/s at group size 8.

    python benchmarks/control_plane.py [--steps 60] [--prompts-per-step 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.training.fake import FakeTrainer

GOAL_GROUPS_PER_S = 5000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--prompts-per-step", type=int, default=64)
    parser.add_argument("--group-size", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n, g = args.prompts_per_step, args.group_size
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"grpo.num_prompts_per_step={n}",
            f"grpo.num_generations_per_prompt={g}",
            f"policy.train_global_batch_size={n * g}",
            f"policy.train_micro_batch_size={n * g}",
            f"grpo.max_num_steps={args.steps}",
            "async_rl.sampler.max_lookahead_versions=1",
            f"async_rl.min_groups_for_streaming_train={n}",
            f"async_rl.max_buffered_rollouts={2 * n}",
            f"async_rl.max_inflight_prompts={2 * n}",
            f"data.num_prompts={n * args.steps * 2}",
        ),
    )

    async def go() -> tuple[float, float, int]:
        controller = build_fake_controller(
            cfg, trainer=FakeTrainer(record_tensors=False), engines=[FakeGenerationBackend(seed=0)]
        )
        controller.dataloader.peek()  # build the epoch order before timing
        started, cpu_started = time.perf_counter(), time.process_time()
        await controller.run()
        return (
            time.perf_counter() - started,
            time.process_time() - cpu_started,
            controller.state.consumed_groups,
        )

    seconds, cpu_seconds, groups = asyncio.run(go())
    groups_per_s = groups / seconds
    groups_per_cpu_s = groups / cpu_seconds
    print(
        f"{groups} groups of {g} in {seconds:.2f} s wall ({groups_per_s:,.0f} groups/s), "
        f"{cpu_seconds:.2f} s CPU ({groups_per_cpu_s:,.0f} groups per CPU-second)"
    )
    result = {
        "groups_per_s": round(groups_per_s),
        # CPU time of this process: the same figure on a busy machine (wall time is not).
        "groups_per_cpu_s": round(groups_per_cpu_s),
        "goal": GOAL_GROUPS_PER_S,
        "ratio_to_goal": round(groups_per_s / GOAL_GROUPS_PER_S, 3),
        "group_size": g,
        "groups": groups,
    }
    print("RESULT " + json.dumps(result))


if __name__ == "__main__":
    main()
