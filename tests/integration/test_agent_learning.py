"""The agent exemplar learns: the two-turn counting game, played over the HTTP endpoint with
the official openai client, on local Ray with the real tiny model and trainer."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandemrl.config.loader import load_config
from tandemrl.controller.run import run_training

pytestmark = pytest.mark.integration

STEPS = 70


def test_reward_rises_on_the_two_turn_counting_game(ray_session, tmp_path: Path):
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu_agent.yaml",
        (
            f"grpo.max_num_steps={STEPS}",
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard=false",
            "logger.progress=false",
            "logger.plot=false",
            "logger.save_final_model=false",
        ),
    )
    assert cfg.policy.generation.http_server.enabled and cfg.env.name == "agent"
    assert run_training(cfg) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    first = sum(row["reward_mean"] for row in rows[:10]) / 10
    last = sum(row["reward_mean"] for row in rows[-10:]) / 10
    # Measured in four runs of this test (docs/benchmarks.md): 0.022-0.026 over the first 10
    # steps, 0.125 / 0.20 / 0.26 / 0.30 over steps 61-70 (the reward jumps once the policy
    # learns to end its turns, 10-15 steps earlier or later from run to run: the slowest run,
    # beside a vLLM test suite, was still climbing steadily, 0.03 / 0.06 / 0.07 / 0.125 over
    # steps 21-70); a 10-step mean scatters by about 0.02. The exemplar's +0.3 is measured by
    # benchmarks/agent_endpoint.py, not here.
    assert last > first + 0.06 and last > 3 * first, (first, last)
    # Both turns were played and trained (the reply between them masked), every step, and
    # both turns learned: the second is scored on the environment's own digit.
    assert all(row["agent/turns_mean"] == 2.0 for row in rows)
    for turn in ("env/turn1_reward", "env/turn2_reward"):
        assert sum(row[turn] for row in rows[-10:]) / 10 > first + 0.04, turn
    assert all(0.0 <= row["agent/prefix_split_frac"] <= 1.0 for row in rows)
    assert all(row["staleness_max"] <= 1 for row in rows)
