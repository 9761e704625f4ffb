"""The custom-environment example end to end: ``tandemrl train`` on local Ray imports the
environment module from ``env.python_path`` inside the controller actor and trains."""

from __future__ import annotations

import json

import pytest
import ray

from tandemrl.cli import main
from tandemrl.config import load_config
from tandemrl.envs import create_environment

pytestmark = pytest.mark.integration

CONFIG = "examples/custom_env/config.yaml"


def test_tandemrl_train_runs_the_custom_environment_example(ray_session, tmp_path):
    steps = 3
    code = main(
        [
            "train",
            "--config",
            CONFIG,
            f"grpo.max_num_steps={steps}",
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard=false",
            "logger.plot=false",
            "logger.progress=false",
        ]
    )
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    assert all(row["groups_trained"] == 16 for row in rows)
    # ReverseDigitsEnv's range: partial credit in [0, 1], plus exact_bonus 0.5 when exact
    assert all(0.0 <= row["reward_mean"] <= 1.5 for row in rows)


# max_calls=1: every call gets a fresh worker process (imports and sys.path start clean).
@ray.remote(num_cpus=0, max_calls=1)
def _build_environment_in_a_worker(env_cfg) -> str:
    """What the controller actor does first: create_environment(cfg.env) in a Ray worker."""
    try:
        env = create_environment(env_cfg)
    except ImportError as error:
        return f"ImportError: {error}"
    return f"{type(env).__module__}.{type(env).__name__}"


def test_a_ray_worker_imports_the_example_only_through_env_python_path(ray_session):
    env_cfg = load_config(CONFIG).env
    without = env_cfg.model_copy(update={"python_path": []})
    refused = ray.get(_build_environment_in_a_worker.remote(without))
    assert refused.startswith("ImportError: env.target='reverse_env:ReverseDigitsEnv'"), refused
    assert "env.python_path" in refused
    built = ray.get(_build_environment_in_a_worker.remote(env_cfg))
    assert built == "reverse_env.ReverseDigitsEnv"
