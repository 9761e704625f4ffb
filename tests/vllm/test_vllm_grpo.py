"""A full tiny GRPO run whose rollouts come from the vLLM backend: the reward must rise."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

from tandemrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 100
WINDOW = 20
# Mean reward of the last WINDOW steps must beat the first WINDOW steps' by this much.
# Measured on the 2-core machines with this config: reward starts near 0.05 and roughly
# doubles within 100 steps, with the torch and the vLLM backend alike (the fast rise to 0.6
# comes later); the noise of a 20-step mean is about 0.005.
MIN_REWARD_GAIN = 0.02


def test_grpo_tiny_run_with_vllm_generation_learns(tmp_path: Path) -> None:
    from tandemrl.controller.run import run_training

    log_dir = tmp_path / "run"
    cfg = load_config(
        REPO / "examples/configs/grpo_tiny_cpu.yaml",
        (
            "policy.generation.backend=vllm",
            "policy.generation.vllm_cfg.async_engine=true",
            f"grpo.max_num_steps={STEPS}",
            f"logger.log_dir={log_dir}",
            "logger.tensorboard=false",
            "logger.plot=false",
            "logger.progress=false",
        ),
    )
    assert run_training(cfg) == 0

    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == STEPS
    rewards = [row["reward_mean"] for row in rows]
    first, last = mean(rewards[:WINDOW]), mean(rewards[-WINDOW:])
    assert last >= first + MIN_REWARD_GAIN, f"reward {first:.3f} -> {last:.3f}: {rewards}"
