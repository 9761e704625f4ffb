"""Data-plane throughput: ``local`` vs ``simple`` (TransferQueue) vs Ray's object store.

One run measures all three on the same batches, so the ratios hold even on a noisy machine:
for each batch size (0.1, 1, 10, 100 MB by default) it builds 64 rows shaped like rollout
rows (``input_ids`` int64, ``logprobs`` float32, a 0-d ``reward``), then repeats
put -> get -> clear and reports the median latency of each call and the throughput
(batch bytes / median latency). The Ray baseline is ``ray.put(rows)`` / ``ray.get(ref)`` in
the driver (the object store, no actor in between).

    python benchmarks/data_plane.py [--sizes-mb 0.1 1 10 100] [--rows 64] [--storage-units 1]

Starts a local Ray instance with loopback-only sockets (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, see
docs/dataplane.md). Ends with one line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
# Ray then takes 127.0.0.1 as the node address, and TransferQueue binds its servers there.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tandemrl.config.models import DataPlaneConfig
from tandemrl.dataplane.base import DataPlane, Row
from tandemrl.dataplane.local import LocalDataPlane

# Bytes per token of one row: int64 input id + float32 logprob.
BYTES_PER_TOKEN = 12


def make_rows(batch_bytes: float, num_rows: int, prefix: str) -> dict[str, Row]:
    tokens = max(1, int(batch_bytes / num_rows / BYTES_PER_TOKEN))
    generator = torch.Generator().manual_seed(0)
    return {
        f"{prefix}/{i}": {
            "input_ids": torch.randint(0, 50_000, (tokens,), generator=generator),
            "logprobs": torch.randn(tokens, generator=generator),
            "reward": torch.tensor(float(i)),
        }
        for i in range(num_rows)
    }


def rows_nbytes(rows: dict[str, Row]) -> int:
    return sum(t.nbytes for row in rows.values() for t in row.values())


def repetitions(batch_mb: float) -> int:
    return 20 if batch_mb <= 1 else 8 if batch_mb <= 10 else 4


async def timed(fn: Callable[[], Awaitable[object]]) -> float:
    started = time.perf_counter()
    await fn()
    return time.perf_counter() - started


async def bench_plane(plane: DataPlane, rows: dict[str, Row], reps: int) -> dict[str, float]:
    keys = list(rows)
    puts, gets = [], []
    for _ in range(reps):
        puts.append(await timed(lambda: plane.put(rows)))
        gets.append(await timed(lambda: plane.get(keys)))
        await plane.clear(keys)
    return {"put_s": statistics.median(puts), "get_s": statistics.median(gets)}


async def bench_ray(ray, rows: dict[str, Row], reps: int) -> dict[str, float]:
    puts, gets = [], []
    for _ in range(reps):
        started = time.perf_counter()
        ref = ray.put(rows)
        puts.append(time.perf_counter() - started)
        started = time.perf_counter()
        ray.get(ref)
        gets.append(time.perf_counter() - started)
        del ref
    return {"put_s": statistics.median(puts), "get_s": statistics.median(gets)}


async def main(args: argparse.Namespace) -> dict:
    import ray

    from tandemrl.dataplane.simple import SimpleDataPlane

    torch.set_num_threads(1)
    started = time.perf_counter()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    ray_init_s = time.perf_counter() - started

    simple = SimpleDataPlane(
        DataPlaneConfig(backend="simple", num_storage_units=args.storage_units, call_timeout_s=300)
    )
    started = time.perf_counter()
    await simple.start()
    simple_start_s = time.perf_counter() - started
    local = LocalDataPlane()

    results: dict[str, dict] = {}
    try:
        for size_mb in args.sizes_mb:
            rows = make_rows(size_mb * 1e6, args.rows, prefix=f"b{size_mb}")
            nbytes = rows_nbytes(rows)
            reps = repetitions(size_mb)
            # One warm-up round each (sockets, allocator), not timed.
            await bench_plane(simple, rows, 1)
            await bench_ray(ray, rows, 1)
            figures = {
                "local": await bench_plane(local, rows, reps),
                "simple": await bench_plane(simple, rows, reps),
                "ray": await bench_ray(ray, rows, reps),
            }
            entry: dict[str, float] = {"bytes": nbytes, "reps": reps}
            for backend, timing in figures.items():
                for call in ("put", "get"):
                    seconds = timing[f"{call}_s"]
                    entry[f"{backend}_{call}_ms"] = round(seconds * 1e3, 3)
                    entry[f"{backend}_{call}_MBps"] = round(nbytes / seconds / 1e6, 1)
            for call in ("put", "get"):
                entry[f"simple_over_ray_{call}_latency"] = round(
                    figures["simple"][f"{call}_s"] / figures["ray"][f"{call}_s"], 2
                )
                entry[f"simple_over_local_{call}_latency"] = round(
                    figures["simple"][f"{call}_s"] / figures["local"][f"{call}_s"], 1
                )
            results[f"{size_mb:g}MB"] = entry
            print(
                f"{size_mb:>6g} MB  "
                + "  ".join(
                    f"{backend} put {entry[f'{backend}_put_ms']:>9.3f} ms "
                    f"({entry[f'{backend}_put_MBps']:>8.1f} MB/s) "
                    f"get {entry[f'{backend}_get_ms']:>9.3f} ms "
                    f"({entry[f'{backend}_get_MBps']:>8.1f} MB/s)"
                    for backend in ("local", "simple", "ray")
                ),
                flush=True,
            )
            print(
                f"{'':>9}simple/ray latency: put x{entry['simple_over_ray_put_latency']}, "
                f"get x{entry['simple_over_ray_get_latency']}; "
                f"simple/local: put x{entry['simple_over_local_put_latency']}, "
                f"get x{entry['simple_over_local_get_latency']}",
                flush=True,
            )
        actor_rss_mb = actor_memory_mb(ray, simple)
    finally:
        await simple.close()
        ray.shutdown()
    return {
        "rows_per_batch": args.rows,
        "storage_units": args.storage_units,
        "ray_init_s": round(ray_init_s, 2),
        "simple_start_s": round(simple_start_s, 2),
        "simple_bind_address": simple.bind_address,
        "simple_actor_rss_mb": actor_rss_mb,
        "cpu_count": os.cpu_count(),
        "sizes": results,
    }


def actor_memory_mb(ray, plane) -> dict[str, float]:
    """Resident memory of the plane's actors after the run (same machine: read by pid)."""
    import psutil

    rss = {}
    for name, handle in plane.actors().items():
        pid = ray.get(handle.__ray_call__.remote(lambda _self: os.getpid()), timeout=60)
        rss[name] = round(psutil.Process(pid).memory_info().rss / 2**20, 1)
    return rss


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", type=float, nargs="+", default=[0.1, 1, 10, 100])
    parser.add_argument("--rows", type=int, default=64, help="rows per batch")
    parser.add_argument("--storage-units", type=int, default=1)
    return parser.parse_args()


if __name__ == "__main__":
    result = asyncio.run(main(parse_args()))
    print("RESULT " + json.dumps(result, sort_keys=True))
