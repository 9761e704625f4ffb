"""Giving freed heap back to the operating system in long-running processes.

glibc keeps memory that a process has freed in its arenas, for reuse, and returns it only
when the top of an arena is free. In a process that runs for days and allocates from several
threads (the controller actor: its event loop, Ray's core worker threads, the metrics writer),
that retained memory grows the RSS slowly even when nothing is alive that did not exist
before. ``malloc_trim(0)`` hands every free page of every arena back. It takes milliseconds
and holds each arena's lock while it walks it, so it runs rarely: ``trim_periodically``, every
``interval_s`` seconds, from an asyncio task.

Only glibc has ``malloc_trim``; elsewhere (musl, macOS) ``trim_heap`` does nothing and says so.

CPython's table of interned strings grows once in a long run unless rebuilt at the start.
``pathlib`` interns every part of every path it parses, and a run makes a few names a step
that never repeat (``step_<N>``, ``segment_<lsn>.log``, ``.<name>.tmp-<hex>`` siblings). Each
is dropped from the table when its last path dies, but the table never reuses the slot: it
rebuilds itself when its slots run out, at the size its live strings call for. After the
imports of a controller or trainer (torch, transformers, Ray) that size is often the next
power of two, so the first rebuild, thousands of steps in, adds 4 MB (measured: the
controller's only jump in 3,800 steps, docs/benchmarks.md) and later ones add nothing.
``settle_interned_strings`` makes that first rebuild happen now: it interns and drops enough
throwaway strings to use up the slots (about 50 ms), so the table has its lasting size before
the steps that are measured against it. The periodic trims call it once, at their first trim.
On CPython 3.12 interned strings are immortal, so there is nothing to settle (and the names
stay): ``settle_interned_strings`` does nothing there.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import os
import sys
import time
from functools import cache
from typing import Any

log = logging.getLogger(__name__)
NO_TRIM = "this C library has no malloc_trim: freed heap stays with the process"
# Throwaway strings ``settle_interned_strings`` interns: more than the free slots of any
# interned-string table up to 2**18 entries (2/3 of which are usable), so at least one rebuild.
SETTLE_INSERTIONS = 200_000


@cache
def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name)
    if not hasattr(libc, "malloc_trim"):
        return None
    libc.malloc_trim.argtypes = [ctypes.c_size_t]
    libc.malloc_trim.restype = ctypes.c_int
    return libc


def trim_heap() -> bool | None:
    """Return the free heap to the OS. True: some memory was released; False: none could be;
    None: this C library has no ``malloc_trim``."""
    libc = _libc()
    if libc is None:
        return None
    return bool(libc.malloc_trim(0))


@cache
def interned_strings_are_mortal() -> bool:
    """Whether a string ``sys.intern`` returns dies with its last reference. Not on CPython
    3.12, where every interned string is immortal (PEP 683): there each new path name a run
    makes stays for good (about 0.4 MB per 1,000 steps at four names a step, measured on
    3.12.1 with the test's loop), and settling would keep its throwaway strings (21 MB)."""
    probe = sys.intern(f"tandemrl-mortality-probe-{os.getpid()}")
    return sys.getrefcount(probe) < 1 << 20  # immortal objects carry a huge refcount


def settle_interned_strings(insertions: int = SETTLE_INSERTIONS) -> bool:
    """Use up the free slots of CPython's interned-string table so that it rebuilds itself,
    at the size its live strings need, now rather than mid-run (module docstring). Each
    string is interned and dropped at once: the live strings, and so the size, do not change.
    False (and nothing done) where interned strings are immortal."""
    if not interned_strings_are_mortal():
        return False
    prefix = f"tandemrl-settle-{os.getpid()}-"
    for index in range(insertions):
        sys.intern(prefix + str(index))
    return True


async def trim_periodically(interval_s: float) -> None:
    """``trim_heap`` every ``interval_s`` seconds until cancelled; at the first, the interned
    strings are settled too (the run's imports are done by then)."""
    await asyncio.sleep(interval_s)
    settle_interned_strings()
    if _libc() is None:
        log.info(NO_TRIM)
        return
    while True:
        trim_heap()
        await asyncio.sleep(interval_s)


class HeapTrimmer:
    """``trim_heap`` at most every ``interval_s`` seconds, for a worker that calls
    ``maybe_trim`` after each unit of its work (the trainer: after each optimizer step)."""

    def __init__(self, interval_s: float, clock: Any = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self.trims = 0
        self.settled = False
        if _libc() is None:
            log.info(NO_TRIM)

    def maybe_trim(self) -> None:
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        if not self.settled:
            settle_interned_strings()
            self.settled = True
        if trim_heap() is not None:
            self.trims += 1
