"""A heap probe for ``benchmarks/soak.py --heap-probe``: imported by every Python process of
the run (this folder leads ``PYTHONPATH``), it watches only Ray workers that become the
controller or the trainer actor and samples, every ``TANDEMRL_HEAP_PROBE_S`` seconds, what
the RSS is made of: glibc's heap in use and free (``mallinfo2``), the interpreter's allocated
blocks, and the count of each type of object the collector tracks (objects frozen by
``gc.freeze`` excluded, so: what the run made). One JSON line per sample in
``$TANDEMRL_HEAP_PROBE_DIR/<role>-<pid>.jsonl``. With ``TANDEMRL_HEAP_PROBE_TRACEMALLOC=1`` the
controller also runs ``tracemalloc`` and each sample lists the allocation sites that grew most
since a snapshot taken ``TANDEMRL_HEAP_PROBE_BASELINE_S`` seconds in. With
``TANDEMRL_HEAP_PROBE_LARGEST=1`` (``soak.py --largest``) each sample also lists the largest
objects, frozen ones included: to see those it unfreezes and freezes again, which freezes
whatever garbage cycles exist at that moment (the collector never frees them), so a run that
lists them grows by that garbage and its slopes are not the run's."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import sys
import threading
import time
import tracemalloc
from collections import Counter

WATCHED = (("ray::SingleControllerActor", "controller"), ("ray::PolicyWorker", "trainer"))


class MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _role() -> str | None:
    try:
        with open("/proc/self/cmdline", "rb") as handle:
            title = handle.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return None
    for prefix, role in WATCHED:
        if title.startswith(prefix):
            return role
    return None


def _anon_mb() -> float:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _largest(tracked: list, keep: int = 8) -> list:
    """The biggest objects (``sys.getsizeof``) among the tracked ones and what they refer to
    directly (dicts of numbers and strings, arrays and bytes are not tracked themselves), as
    type, size in KiB and, for containers, length."""
    # What gc.freeze() moved out of the collector's generations counts too: a container built
    # before the run froze its startup heap may be what grows.
    frozen = gc.get_freeze_count() > 0
    if frozen:
        gc.unfreeze()
        tracked = gc.get_objects()
        gc.freeze()
    seen: dict[int, object] = {}
    for obj in tracked:
        seen[id(obj)] = obj
        for ref in gc.get_referents(obj):
            seen.setdefault(id(ref), ref)
    sized = []
    for obj in seen.values():
        try:
            sized.append((sys.getsizeof(obj), obj))
        except TypeError:
            continue
    sized.sort(key=lambda pair: -pair[0])
    out = []
    for size, obj in sized[:keep]:
        length = len(obj) if hasattr(obj, "__len__") and not isinstance(obj, type) else None
        out.append([type(obj).__qualname__, round(size / 1024, 1), length])
    return out


def _probe(folder: str, interval_s: float) -> None:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = MallInfo2
    started = time.time()
    role = None
    while role is None:  # a Ray worker takes its actor's title after it starts
        time.sleep(2.0)
        role = _role()
    path = os.path.join(folder, f"{role}-{os.getpid()}.jsonl")
    traced = role == "controller" and os.environ.get("TANDEMRL_HEAP_PROBE_TRACEMALLOC") == "1"
    baseline = None
    if traced:
        tracemalloc.start(6)
    with open(path, "a") as out:
        while True:
            info = libc.mallinfo2()
            tracked = gc.get_objects()
            types = Counter(type(obj).__qualname__ for obj in tracked)
            sample = {
                "t": round(time.time(), 1),
                "anon_mb": round(_anon_mb(), 2),
                "malloc_in_use_mb": round((info.uordblks + info.hblkhd) / 2**20, 2),
                "malloc_free_mb": round(info.fordblks / 2**20, 2),
                "malloc_arena_mb": round(info.arena / 2**20, 2),
                "py_blocks": sys.getallocatedblocks(),
                "gc_objects": sum(types.values()),
                "frozen": gc.get_freeze_count(),
                "threads": threading.active_count(),
                "types": dict(types.most_common(60)),
            }
            if os.environ.get("TANDEMRL_HEAP_PROBE_LARGEST") == "1":
                sample["largest"] = _largest(tracked)
            del tracked
            if traced:
                # Python's allocations (small and large) that grew since the first snapshot
                # taken after TANDEMRL_HEAP_PROBE_BASELINE_S, by the line that made them.
                if baseline is None:
                    if time.time() - started >= float(
                        os.environ.get("TANDEMRL_HEAP_PROBE_BASELINE_S", "240")
                    ):
                        baseline = tracemalloc.take_snapshot()
                else:
                    diff = tracemalloc.take_snapshot().compare_to(baseline, "traceback")
                    sample["traced_growth"] = [
                        {
                            "kib": round(stat.size_diff / 1024, 1),
                            "count": stat.count_diff,
                            "where": [f"{f.filename}:{f.lineno}" for f in stat.traceback][-4:],
                        }
                        for stat in sorted(diff, key=lambda d: -d.size_diff)[:12]
                    ]
            out.write(json.dumps(sample) + "\n")
            out.flush()
            time.sleep(interval_s)


_folder = os.environ.get("TANDEMRL_HEAP_PROBE_DIR")
if _folder and sys.argv and "default_worker.py" in sys.argv[0]:
    threading.Thread(
        target=_probe,
        args=(_folder, float(os.environ.get("TANDEMRL_HEAP_PROBE_S", "30"))),
        name="heap-probe",
        daemon=True,
    ).start()
