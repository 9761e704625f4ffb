"""Stop signals: the first asks for a graceful stop, the second ends the driver at once; Ray's
servers start with SIGTERM blocked, and a process that must stop on SIGTERM gets it back."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tandemrl.config.loader import load_config
from tandemrl.controller import run as run_module
from tandemrl.controller.run import StopSignals, newest_trainer_checkpoint
from tandemrl.sigterm import ProcessTree, blocked_signals, sigterm_blocked, unblock_sigterm

pytestmark = pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="Linux /proc")


def child_blocks(sig: signal.Signals) -> bool:
    """Whether a process started now, from the calling thread, blocks ``sig``."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        return sig in blocked_signals(child.pid)
    finally:
        child.kill()
        child.wait()


def deliver(sig: signal.Signals) -> None:
    """Send ``sig`` to the main thread and give Python a moment to run its handler."""
    signal.pthread_kill(threading.main_thread().ident or 0, sig)
    time.sleep(0.05)


def test_the_first_signal_asks_for_a_stop_and_the_second_exits_at_once() -> None:
    exits: list[int] = []
    cleanups: list[str] = []
    signals = StopSignals(exit_now=exits.append, on_exit_now=[lambda: cleanups.append("mps")])
    before = signal.getsignal(signal.SIGTERM)
    signals.install()
    try:
        deliver(signal.SIGTERM)
        assert signals.signum == signal.SIGTERM and signals.exit_code == 143
        assert exits == [] and cleanups == []
        deliver(signal.SIGINT)
        assert cleanups == ["mps"] and exits == [130]  # 128 + the second signal's number
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_processes_started_inside_the_block_ignore_sigterm_and_a_signal_waits_for_its_end() -> None:
    received: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: received.append(signum))
    try:
        with sigterm_blocked():
            assert child_blocks(signal.SIGTERM)  # what Ray's gcs_server and raylet inherit
            deliver(signal.SIGTERM)
            assert received == []  # pending while blocked
        time.sleep(0.05)
        assert received == [signal.SIGTERM]  # delivered as the block ends
        assert not child_blocks(signal.SIGTERM)
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_thread_that_unblocks_sigterm_starts_processes_that_stop_on_it() -> None:
    """A Ray worker inherits the raylet's blocked SIGTERM; vLLM's engine core is started from
    a thread that unblocks it first."""
    seen: dict[str, bool] = {}

    def worker_thread() -> None:
        seen["inherited"] = child_blocks(signal.SIGTERM)
        unblock_sigterm()
        seen["after_unblock"] = child_blocks(signal.SIGTERM)

    with sigterm_blocked():
        thread = threading.Thread(target=worker_thread)  # started inside: inherits the mask
        thread.start()
        thread.join()
    assert seen == {"inherited": True, "after_unblock": False}


def test_the_embedded_cluster_bounds_the_task_events_its_gcs_keeps(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import ray

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append(kwargs))
    monkeypatch.delenv(run_module.GCS_TASK_EVENTS_ENV, raising=False)
    cfg = load_config("examples/configs/grpo_tiny_cpu.yaml", ["cluster.num_cpus=2"])
    run_module.init_ray(cfg)
    assert os.environ[run_module.GCS_TASK_EVENTS_ENV] == "10000"
    assert calls and calls[0]["num_cpus"] == 2

    monkeypatch.setenv(run_module.GCS_TASK_EVENTS_ENV, "500")  # the user's setting wins
    run_module.init_ray(cfg)
    assert os.environ[run_module.GCS_TASK_EVENTS_ENV] == "500"


def test_the_stop_message_names_the_checkpoint_the_restart_resumes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for step in (3, 4):
        (tmp_path / f"step_{step}").mkdir()
        (tmp_path / f"step_{step}" / "manifest.json").write_text("{}")
    (tmp_path / "step_5").mkdir()  # no manifest: not a published checkpoint
    assert newest_trainer_checkpoint(tmp_path) == 4
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        [f"checkpointing.checkpoint_dir={tmp_path}"],
    )
    run_module._say_stopped(cfg, 4)
    assert (
        f"stopped at step 4; run the same command to resume (the last checkpoint is in {tmp_path})"
        in (caplog.text)
    )
    run_module._say_stopped(cfg, 6)  # the grace ran out before step 6's checkpoint
    assert (
        "stopped at step 6; run the same command to resume (it resumes from the checkpoint of step 4"
        in (caplog.text)
    )


def test_the_children_a_killed_server_leaves_behind_are_killed_and_nothing_else() -> None:
    """A Ray server's own children (the raylet's agents) outlive its SIGKILL; ProcessTree notes
    them beforehand and kills exactly those still alive, not the server's siblings."""
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time\n"
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            "print(child.pid, flush=True)\n"
            "time.sleep(60)\n",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert server.stdout is not None
        agent = int(server.stdout.readline())
        tree = ProcessTree([server.pid])
        assert set(tree.descendants) == {agent}
        server.kill()
        server.wait()
        assert Path(f"/proc/{agent}").exists()  # the orphan lives on, as Ray's agents do
        assert tree.kill_survivors() == [agent]
        deadline = time.monotonic() + 10
        while tree.kill_survivors() and time.monotonic() < deadline:
            time.sleep(0.05)  # SIGKILL is delivered asynchronously
        assert tree.kill_survivors() == []  # dead (a zombie at most): never killed twice
        assert bystander.poll() is None  # a process outside the tree is untouched
    finally:
        for process in (server, bystander):
            process.kill()
            process.wait()
