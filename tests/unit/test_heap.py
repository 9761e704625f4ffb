"""tandemrl.heap: freed heap handed back to the OS, periodically, until cancelled."""

from __future__ import annotations

import asyncio
import ctypes.util
import sys

import pytest

from tandemrl import heap

GLIBC = sys.platform.startswith("linux") and heap._libc() is not None


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_trimming_after_freeing_many_blocks_gives_memory_back() -> None:
    # 200,000 blocks of 2 KiB (over pymalloc's 512-byte limit: glibc's heap), all freed but
    # the last, so the arena's top stays in use and only malloc_trim can release the rest.
    blocks = [bytearray(2048) for _ in range(200_000)]
    keep = blocks[-1]
    del blocks
    assert heap.trim_heap() is True
    assert keep  # held across the trim


def test_without_malloc_trim_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    heap._libc.cache_clear()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    try:
        assert heap.trim_heap() is None
        asyncio.run(asyncio.wait_for(heap.trim_periodically(0.01), timeout=1.0))  # returns
    finally:
        heap._libc.cache_clear()


@pytest.mark.skipif(not GLIBC, reason="malloc_trim is glibc's")
def test_the_periodic_trim_runs_until_cancelled(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)

    async def scenario() -> None:
        task = asyncio.create_task(heap.trim_periodically(0.01))
        while len(calls) < 3:
            await asyncio.sleep(0.005)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(asyncio.wait_for(scenario(), timeout=5.0))
    assert len(calls) >= 3


# A fresh interpreter (what a long run's processes are, with more imports): trace from before
# the settling, then 5,000 steps' worth of path names that never repeat (four a step, as the
# controller makes), each interned by pathlib and dropped with its path. Prints what the
# names left allocated: a larger interned-string table when the churn made it rebuild itself.
CHURN = """
import sys, tracemalloc
from pathlib import Path
from tandemrl import heap
tracemalloc.start()
settled = heap.settle_interned_strings() if sys.argv[1] == "settle" else False
before, _ = tracemalloc.get_traced_memory()
root = Path("/checkpoints")
for step in range(5_000):
    for name in (f"step_{step}", f".step_{step}.tmp-{step:x}", f"segment_{step:012d}.log",
                 f".data_plane.tmp-{step * 7919:012x}"):
        assert (root / name).name == name
after, _ = tracemalloc.get_traced_memory()
print(settled, after - before)
"""


def churn_in_fresh_interpreter(mode: str) -> tuple[bool, int]:
    import subprocess

    out = subprocess.run(
        [sys.executable, "-c", CHURN, mode], capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(
    not heap.interned_strings_are_mortal(),
    reason="interned strings are immortal on this Python (CPython 3.12): nothing to settle",
)
def test_settled_interned_strings_take_a_long_run_of_new_path_names_without_growing() -> None:
    settled, grown = churn_in_fresh_interpreter("settle")
    assert settled
    assert grown < 100_000  # the names themselves are gone; no table rebuilt
    # Unsettled, the same names make the table rebuild itself larger (961,216 bytes here).
    settled, grown = churn_in_fresh_interpreter("plain")
    assert not settled and grown > 400_000


def test_the_trainer_trimmer_trims_once_per_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []
    monkeypatch.setattr(heap, "trim_heap", lambda: calls.append(1) or True)
    now = [100.0]
    trimmer = heap.HeapTrimmer(30.0, clock=lambda: now[0])
    for when in (101.0, 129.9, 130.0, 131.0, 159.0, 161.0):
        now[0] = when
        trimmer.maybe_trim()
    assert len(calls) == trimmer.trims == 2  # at 130 and at 161, never twice in 30 s
    assert trimmer.settled  # the interned strings were settled at the first trim
