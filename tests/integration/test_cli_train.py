"""``tandemrl train`` as a user runs it: a subprocess with its own embedded Ray instance.

Covers the front door: the CPU job on a machine whose cluster counts GPUs, the files a run
leaves (metrics, samples, the final model), a setup failure that must not touch an earlier
run's files, Ctrl-C and SIGTERM (graceful stop, resume, exit codes, no process left), and a
re-run of a finished checkpointed job.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tandemrl.sigterm import blocked_signals

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
MAIN_JOB = "examples/configs/grpo_tiny_cpu.yaml"
CHECKPOINTED = "examples/configs/grpo_tiny_cpu_checkpointed.yaml"


def command(*args: str) -> list[str]:
    return [sys.executable, "-m", "tandemrl.cli", "train", *args]


def environment() -> dict[str, str]:
    return {**os.environ, "RAY_AUTH_MODE": "disabled"}


def train(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """``tandemrl train`` in a fresh process (its own Ray), as the README runs it."""
    return subprocess.run(
        command(*args),
        cwd=REPO,
        env=environment(),
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
        *overrides,
    ]


def metrics_steps(log_dir: Path) -> list[int]:
    lines = (log_dir / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines]


def files_of(folder: Path) -> dict[Path, bytes]:
    return {path: path.read_bytes() for path in folder.rglob("*") if path.is_file()}


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def sigterm_blocked_in_ray_servers(pgid: int) -> dict[str, bool]:
    """For Ray's gcs_server and raylet in process group ``pgid``: whether each blocks SIGTERM."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name = (entry / "comm").read_text().strip()
            if name in ("gcs_server", "raylet") and os.getpgid(int(entry.name)) == pgid:
                found[name] = signal.SIGTERM in blocked_signals(entry.name)
        except (OSError, ValueError):
            continue  # exited meanwhile
    return found


def stop_with_signal(
    args: list[str], log_dir: Path, sig: signal.Signals, *, after_steps: int
) -> tuple[int, str, dict[str, bool]]:
    """Start a run in a process group of its own (as a terminal does), send ``sig`` to the
    group once ``after_steps`` rows are logged; (exit code, stderr, whether Ray's servers block
    SIGTERM)."""
    process = subprocess.Popen(
        command(*args),
        cwd=REPO,
        env=environment(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and process.poll() is None:
            path = log_dir / "metrics.jsonl"
            if path.exists() and len(path.read_text().splitlines()) >= after_steps:
                break
            time.sleep(0.2)
        assert process.poll() is None, "the run ended before the signal"
        servers = sigterm_blocked_in_ray_servers(process.pid)
        os.killpg(process.pid, sig)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    # Ray's daemons and workers were started in the run's group: none may outlive it.
    deadline = time.monotonic() + 20
    while group_alive(process.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not group_alive(process.pid), "processes of the run outlived it"
    return process.returncode, stderr, servers


def test_the_main_job_runs_on_a_cluster_with_gpus_and_leaves_its_model(tmp_path: Path) -> None:
    """The README's CPU job on a machine whose Ray cluster counts GPUs (here logical ones): it
    takes none of them and trains; the run leaves metrics, samples and a loadable model; a
    later run that fails at setup in the same folder leaves all of that as it was."""
    log_dir = tmp_path / "run"
    result = train(
        "--config",
        MAIN_JOB,
        *quiet(log_dir, "cluster.num_gpus=2", "grpo.max_num_steps=4", "logger.sample_log_period=2"),
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert metrics_steps(log_dir) == [1, 2, 3, 4]
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= row["env/exact_match"] <= 1.0 for row in rows)
    samples = [json.loads(line) for line in (log_dir / "samples.jsonl").read_text().splitlines()]
    assert {sample["step"] for sample in samples} == {2, 4}
    assert all({"prompt", "completion", "reward"} <= sample.keys() for sample in samples)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    final = log_dir / "final_model"
    model = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert model.num_parameters() > 0 and tokenizer("12=")["input_ids"]
    assert f"final model (a transformers folder) saved to {final}" in result.stderr

    before = files_of(log_dir)
    started = time.monotonic()
    failed = train(
        "--config", MAIN_JOB, *quiet(log_dir, "data.dataset=missing.jsonl"), "--overwrite"
    )
    assert failed.returncode == 2
    assert "data.dataset='missing.jsonl': no such file" in failed.stderr
    assert "Traceback" not in failed.stderr
    assert time.monotonic() - started < 60  # refused before Ray starts
    assert files_of(log_dir) == before

    again = train("--config", MAIN_JOB, *quiet(log_dir))
    assert again.returncode == 2 and "already holds another run" in again.stderr
    assert files_of(log_dir) == before


def test_ctrl_c_stops_at_a_step_with_exit_130_and_leaves_no_process(tmp_path: Path) -> None:
    log_dir = tmp_path / "run"
    code, stderr, _ = stop_with_signal(
        ["--config", MAIN_JOB, *quiet(log_dir, "logger.save_final_model=false")],
        log_dir,
        signal.SIGINT,
        after_steps=3,
    )
    assert code == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr
    steps = metrics_steps(log_dir)
    assert steps == list(range(1, len(steps) + 1)) and len(steps) >= 3
    assert f"stopped at step {steps[-1]}" in stderr


def test_sigterm_checkpoints_then_the_same_command_resumes_and_then_says_complete(
    tmp_path: Path,
) -> None:
    """Preemption: SIGTERM writes a last checkpoint and exits 143; the same command resumes
    and logs every step exactly once; once more, it says the run is complete."""
    log_dir = tmp_path / "run"

    def args(max_steps: int) -> list[str]:
        return [
            "--config",
            CHECKPOINTED,
            *quiet(
                log_dir,
                f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
                "checkpointing.save_period=100",
                f"grpo.max_num_steps={max_steps}",  # operational: a restart may change it
                "logger.save_final_model=false",
            ),
        ]

    # Long enough that the signal always lands mid-run, however fast the machine.
    code, stderr, servers = stop_with_signal(args(1000), log_dir, signal.SIGTERM, after_steps=3)
    assert code == 143, stderr[-3000:]
    # The group-wide signal reached the driver only: Ray's servers block it.
    assert servers == {"gcs_server": True, "raylet": True}
    stopped_at = metrics_steps(log_dir)[-1]
    assert stopped_at < 1000
    assert (tmp_path / "ckpt" / f"step_{stopped_at}").is_dir()  # written at the stop
    assert f"stopped at step {stopped_at}; run the same command to resume" in stderr
    assert "Traceback" not in stderr

    finish = stopped_at + 3
    resumed = train(*args(finish))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume after step {stopped_at}" in resumed.stderr
    assert metrics_steps(log_dir) == list(range(1, finish + 1))

    complete = train(*args(finish))
    assert complete.returncode == 0
    assert "this run is already complete" in complete.stderr
    assert "Started a local Ray instance" not in complete.stderr
