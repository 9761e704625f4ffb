"""Giving freed heap back to the operating system in long-running processes.

glibc keeps memory that a process has freed in its arenas, for reuse, and returns it only
when the top of an arena is free. In a process that runs for days and allocates from several
threads (the controller actor: its event loop, Ray's core worker threads, the metrics writer),
that retained memory grows the RSS slowly even when nothing is alive that did not exist
before. ``malloc_trim(0)`` hands every free page of every arena back. It takes milliseconds
and holds each arena's lock while it walks it, so it runs rarely: ``trim_periodically``, every
``interval_s`` seconds, from an asyncio task.

Only glibc has ``malloc_trim``; elsewhere (musl, macOS) ``trim_heap`` does nothing and says so.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import logging
import time
from functools import cache
from typing import Any

log = logging.getLogger(__name__)
NO_TRIM = "this C library has no malloc_trim: freed heap stays with the process"


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


async def trim_periodically(interval_s: float) -> None:
    """``trim_heap`` every ``interval_s`` seconds until cancelled."""
    if _libc() is None:
        log.info(NO_TRIM)
        return
    while True:
        await asyncio.sleep(interval_s)
        trim_heap()


class HeapTrimmer:
    """``trim_heap`` at most every ``interval_s`` seconds, for a worker that calls
    ``maybe_trim`` after each unit of its work (the trainer: after each optimizer step)."""

    def __init__(self, interval_s: float, clock: Any = time.monotonic) -> None:
        self.interval_s = interval_s
        self._clock = clock
        self._last = clock()
        self.trims = 0
        if _libc() is None:
            log.info(NO_TRIM)

    def maybe_trim(self) -> None:
        now = self._clock()
        if now - self._last < self.interval_s:
            return
        self._last = now
        if trim_heap() is not None:
            self.trims += 1
