"""``policy.generation.colocated.mps``: when a private MPS daemon is started, why not when
not, and that it is stopped and the environment restored (a stand-in control binary)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tandemrl.config.loader import load_config
from tandemrl.controller import mps
from tandemrl.controller.mps import LOG_ENV, PIPE_ENV, MpsUnavailable, start_if_useful, why_not

DEFAULT = "examples/configs/grpo_tiny_cpu.yaml"
OVERLAPPING = (
    "policy.device=cuda",
    "policy.generation.colocated.enabled=true",
    "policy.generation.colocated.stand_down=false",
)


def cfg(*overrides: str):
    return load_config(DEFAULT, overrides)


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``nvidia-cuda-mps-control`` on PATH that records its calls and environment."""
    calls = tmp_path / "calls.txt"
    script = tmp_path / "bin" / mps.CONTROL
    script.parent.mkdir()
    script.write_text(
        "#!/bin/sh\n"
        f'echo "$* pipe=${PIPE_ENV} log=${LOG_ENV} stdin=$(cat -)" >> {calls}\n'
        'if [ "$FAKE_MPS_FAIL" = 1 ]; then echo "no GPU" >&2; exit 1; fi\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{script.parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_ENV, raising=False)
    monkeypatch.delenv(LOG_ENV, raising=False)
    monkeypatch.setattr(mps, "system_daemon_running", lambda: False)
    return calls


def test_reasons_not_to_start_one() -> None:
    assert why_not(cfg(), gpus_visible=1) == "the run does not use a GPU"
    stands_down = cfg("policy.device=cuda", "policy.generation.colocated.enabled=true")
    assert "stands down for every train step" in why_not(stands_down, gpus_visible=1)
    cluster = cfg(*OVERLAPPING, "cluster.address=ray://head:10001")
    assert "cluster.address" in why_not(cluster, gpus_visible=1)


def test_a_private_daemon_serves_the_run_and_is_stopped(fake_control: Path) -> None:
    daemon = start_if_useful(cfg(*OVERLAPPING), gpus_visible=1)
    assert daemon is not None
    pipe = os.environ[PIPE_ENV]
    assert pipe == daemon.pipe_dir and os.environ[LOG_ENV] == daemon.log_dir
    daemon.stop()
    start, stop = fake_control.read_text().splitlines()
    assert start.startswith(f"-d pipe={pipe}")
    assert stop.startswith(f" pipe={pipe}") and stop.endswith("stdin=quit")
    assert PIPE_ENV not in os.environ and LOG_ENV not in os.environ
    assert not Path(pipe).exists()
    daemon.stop()  # a second stop (atexit after finally) does nothing
    assert len(fake_control.read_text().splitlines()) == 2


def test_off_never_starts_and_on_refuses_what_cannot_run(fake_control: Path, monkeypatch) -> None:
    assert (
        start_if_useful(cfg(*OVERLAPPING, "policy.generation.colocated.mps=off"), gpus_visible=1)
        is None
    )
    assert not fake_control.exists()
    monkeypatch.setenv("FAKE_MPS_FAIL", "1")
    assert start_if_useful(cfg(*OVERLAPPING), gpus_visible=1) is None  # auto: runs without
    with pytest.raises(
        MpsUnavailable, match="mps: on, but nvidia-cuda-mps-control -d failed: no GPU"
    ):
        start_if_useful(cfg(*OVERLAPPING, "policy.generation.colocated.mps=on"), gpus_visible=1)
    assert PIPE_ENV not in os.environ


def test_mps_on_without_an_overlapping_engine_is_refused_by_validation() -> None:
    from tandemrl.config import ConfigError, validate_single_controller_config

    with pytest.raises(ConfigError, match=r"colocated\.mps: on helps only"):
        validate_single_controller_config(cfg("policy.generation.colocated.mps=on"))
