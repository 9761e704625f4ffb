"""``tandemrl train`` as a user runs it: a subprocess with its own embedded Ray instance."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAIN_JOB = "examples/configs/grpo_tiny_cpu.yaml"


def train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``tandemrl train`` in a fresh process (its own Ray), as the README runs it."""
    env = {**os.environ, "RAY_AUTH_MODE": "disabled"}
    return subprocess.run(
        [sys.executable, "-m", "tandemrl.cli", "train", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def quiet(log_dir: Path, *overrides: str) -> list[str]:
    return [
        f"logger.log_dir={log_dir}",
        "logger.tensorboard=false",
        "logger.progress=false",
        "logger.plot=false",
        *overrides,
    ]


def metrics_steps(log_dir: Path) -> list[int]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


@pytest.mark.parametrize("logical_gpus", [2])
def test_the_main_job_runs_on_a_cluster_with_gpus(tmp_path: Path, logical_gpus: int) -> None:
    """The README's CPU job on a machine whose Ray cluster counts GPUs (here logical ones): it
    takes none of them and trains."""
    result = train(
        "--config",
        MAIN_JOB,
        *quiet(tmp_path, f"cluster.num_gpus={logical_gpus}", "grpo.max_num_steps=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics_steps(tmp_path) == [1, 2]
