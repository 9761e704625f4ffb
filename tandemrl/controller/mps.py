"""A private CUDA MPS daemon for one ``tandemrl train`` on one GPU, when it helps.

With ``policy.generation.colocated.stand_down: false`` the generation engine keeps decoding
while the trainer runs on the same GPU. They are two processes; without MPS the GPU
time-slices between their contexts, so their kernels never run at once and the overlap the
config asks for mostly does not happen (measured in docs/benchmarks.md: async 1.15-1.36x sync
without MPS, 1.37-1.62x with it). Under MPS both processes' kernels share the GPU's SMs.

``policy.generation.colocated.mps``:

- ``auto`` (default): start a daemon of our own when it helps and can be done here (a local
  run on GPUs, colocated, without the stand-down, ``nvidia-cuda-mps-control`` on PATH, no MPS
  daemon already serving this user); otherwise log why not and run without.
- ``on``: the same, but a run that cannot get MPS stops before it starts.
- ``off``: never.

The daemon is private: its pipe and log folders are a temporary directory named in
``CUDA_MPS_PIPE_DIRECTORY`` / ``CUDA_MPS_LOG_DIRECTORY``, set in this process before Ray
starts, so Ray's workers (children of the driver) connect to it and nothing else does. It is
stopped when the run ends, whatever the exit (``stop`` in a ``finally``, and at interpreter
exit). What it does not change: memory is not partitioned between the two processes, a run
with the stand-down (the engine sleeps for each train step) gains nothing, and a cluster's
other nodes are not touched (``cluster.address`` runs are left alone, with a log line).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from tandemrl.config.models import MasterConfig

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"


class MpsUnavailable(RuntimeError):
    """``colocated.mps: on`` and MPS cannot be started here (the message says why)."""


@dataclass
class MpsDaemon:
    """A daemon this run started; ``stop`` ends it and restores the environment."""

    pipe_dir: str
    log_dir: str
    previous_env: dict[str, str | None]
    stopped: bool = False

    def stop(self, timeout_s: float = 60.0) -> None:
        if self.stopped:
            return
        self.stopped = True
        env = {**os.environ, PIPE_ENV: self.pipe_dir, LOG_ENV: self.log_dir}
        stopped = False
        try:
            # "quit" waits for the daemon's GPU clients (Ray's workers) to exit first.
            subprocess.run(
                [CONTROL], input="quit\n", text=True, env=env, timeout=timeout_s, check=False
            )
            stopped = True
        except subprocess.TimeoutExpired:
            log.warning(
                "the MPS daemon in %s still serves GPU processes after %.0f s; it exits once "
                "the last of them does",
                self.pipe_dir,
                timeout_s,
            )
        except OSError as error:
            log.warning("could not stop the MPS daemon in %s: %s", self.pipe_dir, error)
        for key, value in self.previous_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if stopped:
            shutil.rmtree(os.path.dirname(self.pipe_dir), ignore_errors=True)
            log.info("MPS daemon stopped")


def why_not(cfg: MasterConfig, *, gpus_visible: int) -> str | None:
    """None when a private MPS daemon would help this run and can be started here; otherwise
    the reason, in words a user can act on."""
    generation = cfg.policy.generation
    if cfg.policy.device == "cpu" or gpus_visible == 0:
        return "the run does not use a GPU"
    if not generation.colocated.enabled:
        return "generation has GPUs of its own (colocated.enabled: false)"
    if generation.colocated.stand_down:
        return (
            "the engine stands down for every train step (colocated.stand_down: true), so "
            "decode and training never run at once"
        )
    if cfg.cluster.address is not None:
        return (
            "the run joins an existing Ray cluster (cluster.address); start MPS on its GPU "
            "nodes before Ray (nvidia-cuda-mps-control -d)"
        )
    if shutil.which(CONTROL) is None:
        return f"{CONTROL} is not on PATH (it ships with the NVIDIA driver utilities)"
    if system_daemon_running():
        return "an MPS daemon is already running for this user; the run uses it"
    return None


def system_daemon_running() -> bool:
    """An MPS daemon serves this user already (a pipe folder named in the environment, or the
    default one)."""
    return bool(os.environ.get(PIPE_ENV)) or os.path.exists("/tmp/nvidia-mps/control")


def start_if_useful(cfg: MasterConfig, *, gpus_visible: int) -> MpsDaemon | None:
    """Start a private MPS daemon per ``policy.generation.colocated.mps``; None when not."""
    mode = cfg.policy.generation.colocated.mps
    if mode == "off":
        return None
    reason = why_not(cfg, gpus_visible=gpus_visible)
    if reason is not None:
        if mode == "on" and not reason.startswith("an MPS daemon is already running"):
            raise MpsUnavailable(f"policy.generation.colocated.mps: on, but {reason}")
        if (
            cfg.policy.generation.colocated.enabled
            and not cfg.policy.generation.colocated.stand_down
        ):
            log.info("no private MPS daemon: %s", reason)
        return None
    root = tempfile.mkdtemp(prefix="tandemrl-mps-")
    pipe_dir, log_dir = os.path.join(root, "pipe"), os.path.join(root, "log")
    os.makedirs(pipe_dir)
    os.makedirs(log_dir)
    previous = {key: os.environ.get(key) for key in (PIPE_ENV, LOG_ENV)}
    env = {**os.environ, PIPE_ENV: pipe_dir, LOG_ENV: log_dir}
    result = subprocess.run([CONTROL, "-d"], env=env, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        message = (result.stderr or result.stdout).strip() or f"exit code {result.returncode}"
        if mode == "on":
            raise MpsUnavailable(
                f"policy.generation.colocated.mps: on, but {CONTROL} -d failed: {message}"
            )
        log.warning("could not start an MPS daemon (%s); running without it", message)
        return None
    os.environ[PIPE_ENV], os.environ[LOG_ENV] = pipe_dir, log_dir
    daemon = MpsDaemon(pipe_dir, log_dir, previous)
    atexit.register(daemon.stop)
    log.info(
        "started a private MPS daemon (%s): the engine's and the trainer's kernels share the GPU",
        pipe_dir,
    )
    return daemon
