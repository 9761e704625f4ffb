"""A full tiny GRPO run whose rollouts come from the vLLM backend: the reward must rise."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

from tandemrl.config import load_config

REPO = Path(__file__).resolve().parents[2]
STEPS = 60
# Mean reward of the last steps must beat the first steps' by this much (the counting task
# starts near 0.06 and passes 0.3 within the first hundred steps with the torch backend).
MIN_REWARD_GAIN = 0.1


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
    first, last = mean(rewards[:10]), mean(rewards[-10:])
    assert last >= first + MIN_REWARD_GAIN, f"reward {first:.3f} -> {last:.3f}: {rewards}"
