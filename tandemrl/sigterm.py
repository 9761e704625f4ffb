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

Servers that ignore SIGTERM also take their children down less gracefully: the raylet's
agents (dashboard agent, runtime-env agent) outlive a raylet that was SIGKILLed, waiting on a
GCS that is gone, for half a minute and more. ``ProcessTree`` notes the servers' children
before Ray stops and kills those still alive after it (each identified by its start time too,
so a reused pid is never touched).

The mask is per thread: ``sigterm_blocked`` changes only the calling thread's (the servers are
started from it), and ``unblock_sigterm`` the calling thread's, which is what the processes it
starts from then on inherit.
"""

from __future__ import annotations

import os
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


def _parent_and_start(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a running process, from ``/proc/PID/stat``;
    None when there is none (or only a zombie waiting to be reaped)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] in ("Z", "X"):
        return None
    return int(fields[1]), int(fields[19])


class ProcessTree:
    """The descendants of some processes, noted now, to be killed later if still alive."""

    def __init__(self, roots: list[int]) -> None:
        known: dict[int, tuple[int, int]] = {}
        proc = Path("/proc")
        if proc.is_dir():
            for entry in proc.iterdir():
                if entry.name.isdigit() and (info := _parent_and_start(int(entry.name))):
                    known[int(entry.name)] = info
        found: dict[int, int] = {}
        frontier = set(roots)
        while frontier:
            children = {
                pid for pid, (parent, _) in known.items() if parent in frontier and pid not in found
            }
            found.update({pid: known[pid][1] for pid in children})
            frontier = children
        self.descendants = found  # pid -> start time

    def kill_survivors(self) -> list[int]:
        """SIGKILL every noted descendant that is still the same process; the pids killed."""
        killed = []
        for pid, started in self.descendants.items():
            info = _parent_and_start(pid)
            if info is None or info[1] != started:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                continue
            killed.append(pid)
        return killed
