"""SIGTERM and the processes of a run: which of them a stop signal reaches.

A SIGTERM sent to the run's process group (``timeout``, a terminal, a batch scheduler that
signals the job's group) reaches every process started from the driver, Ray's own servers
included: gcs_server, the raylet and their agents. Ray starts those with SIGINT blocked, so a
Ctrl-C reaches only the driver; SIGTERM was not, and it stopped the GCS in the middle of the
graceful stop that the same signal had asked the driver for. So:

- ``sigterm_blocked()`` wraps the start of the run's embedded Ray instance: the servers it
  starts inherit a blocked SIGTERM (a signal mask survives ``fork`` and ``exec``) and, as
  with SIGINT, only the driver acts on the signal. ``ray.shutdown`` stops them with SIGKILL
  after its one-second grace each, as it would any server that does not exit on SIGTERM.
- the raylet starts the run's workers with its own mask, so they too ignore a stray SIGTERM
  (as they ignore SIGINT) while the graceful stop needs them; Ray stops them with its own
  kill. A process that must stop on SIGTERM calls ``unblock_sigterm()`` in the thread that
  starts it: vLLM's engine core, which vLLM stops with SIGTERM and kills only after a
  timeout (``tandemrl.generation.vllm_engine``).

The mask is per thread: ``sigterm_blocked`` changes only the calling thread's (the servers are
started from it), and ``unblock_sigterm`` the calling thread's, which is what the processes it
starts from then on inherit.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def sigterm_blocked() -> Iterator[None]:
    """SIGTERM is blocked in the calling thread (and whatever it starts) inside the block; a
    SIGTERM that arrives meanwhile is delivered when the block ends."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def unblock_sigterm() -> None:
    """Let SIGTERM reach the calling thread and the processes it starts from now on."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def blocked_signals(pid: int | str = "self") -> set[signal.Signals]:
    """The signals a process blocks (Linux ``/proc``; its main thread's mask)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigBlk:"):
            mask = int(line.split()[1], 16)
            return {sig for sig in signal.Signals if mask & (1 << (sig - 1))}
    raise ValueError(f"/proc/{pid}/status has no SigBlk line")
