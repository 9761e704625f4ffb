"""SM partitions on one GPU (``tandemrl.sm_partition``): checks and a decode-beside-training
measure.

Checks (each prints ok or the error): products, compiled (Triton) code first compiled on the
default stream and then run on a share's stream, code compiled inside a share's thread, a CUDA
graph captured and replayed on a share, and which SMs each share's programs ran on (a Triton
kernel reads ``%smid``): the two shares must not meet.

Measure: a decode-like CUDA graph (0.5B-shaped products at ``--rows`` rows, 24 layers and the
head) replayed while a trainer-like loop of large products runs in another thread, without a
split (decode on a high-priority stream, trainer on the default stream) and with the engine
on ``n`` SMs of a split for each ``--engine-sms``. Prints decode ms per replay alone and beside
the loop, and the loop's TFLOP/s alone and beside the decode.

    python benchmarks/gpu_sm_split.py --engine-sms 32 48 64 --out runs/sm_split
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

import torch

from tandemrl.sm_partition import SmShare, sms_used, split_sms

HIDDEN, INTERMEDIATE, QKV, VOCAB, LAYERS = 896, 4864, 1152, 151936, 24


def in_thread(share: SmShare | None, fn: Any) -> Any:
    box: dict[str, Any] = {}

    def body() -> None:
        try:
            if share is not None:
                share.enter()
            box["value"] = fn()
            torch.cuda.current_stream().synchronize()
        except Exception as error:  # reported, not hidden: the check prints it
            box["error"] = f"{type(error).__name__}: {error}"

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    if "error" in box:
        raise RuntimeError(box["error"])
    return box["value"]


def checks(device: torch.device, engine: SmShare, trainer: SmShare) -> dict[str, Any]:
    results: dict[str, Any] = {}

    def check(name: str, fn: Any) -> None:
        try:
            results[name] = fn()
        except Exception as error:
            results[name] = f"FAILED {type(error).__name__}: {error}"[:500]

    torch.manual_seed(0)
    a = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    b = torch.randn(1024, 1024, device=device, dtype=torch.bfloat16)
    reference = (a @ b).float()

    def same(x: torch.Tensor, y: torch.Tensor) -> str:
        return "ok" if torch.allclose(x.float(), y.float(), rtol=1e-2, atol=1e-2) else "MISMATCH"

    check("matmul_trainer", lambda: same(in_thread(trainer, lambda: a @ b), reference))
    check("matmul_engine", lambda: same(in_thread(engine, lambda: a @ b), reference))

    def f(x: torch.Tensor) -> torch.Tensor:
        return (x.float().sin() * 2).sum(-1)

    compiled = torch.compile(f)
    first = compiled(a)
    check(
        "compiled_on_default_then_share",
        lambda: same(in_thread(trainer, lambda: compiled(a)), first),
    )

    def g(x: torch.Tensor) -> torch.Tensor:
        return (x.float().cos() * 3).mean(-1)

    check("compiled_in_share", lambda: same(in_thread(engine, lambda: torch.compile(g)(a)), g(a)))

    def graph_on_engine() -> str:
        x = a.clone()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=engine.capture_stream):
            y = x @ b
        x.copy_(b)
        graph.replay()
        return same(y, (b @ b).float())

    check("graph_on_engine_share", lambda: in_thread(engine, graph_on_engine))

    def disjoint() -> dict[str, Any]:
        engine_sms = in_thread(engine, sms_used)
        trainer_sms = in_thread(trainer, sms_used)
        whole = sms_used()
        return {
            "engine_sms_used": len(engine_sms),
            "trainer_sms_used": len(trainer_sms),
            "default_stream_sms_used": len(whole),
            "shared": len(engine_sms & trainer_sms),
        }

    check("sm_ids", disjoint)
    return results


class DecodeGraph:
    """A 0.5B-shaped decode step (the products and a few elementwise kernels), as one graph."""

    def __init__(self, device: torch.device, rows: int, capture_stream: Any) -> None:
        dt = torch.bfloat16
        self.h = torch.randn(rows, HIDDEN, device=device, dtype=dt)
        self.weights = [
            (
                torch.randn(HIDDEN, QKV, device=device, dtype=dt) * 0.02,
                torch.randn(HIDDEN, HIDDEN, device=device, dtype=dt) * 0.02,
                torch.randn(HIDDEN, 2 * INTERMEDIATE, device=device, dtype=dt) * 0.02,
                torch.randn(INTERMEDIATE, HIDDEN, device=device, dtype=dt) * 0.02,
            )
            for _ in range(LAYERS)
        ]
        self.head = torch.randn(HIDDEN, VOCAB, device=device, dtype=dt) * 0.02
        for _ in range(2):
            self.step()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=capture_stream):
            self.out = self.step()

    def step(self) -> torch.Tensor:
        h = self.h
        for wqkv, wo, wup, wdown in self.weights:
            qkv = h @ wqkv
            h = h + (qkv[:, :HIDDEN] * 0.5) @ wo
            gate, up = (h @ wup).chunk(2, dim=-1)
            h = h + (torch.nn.functional.silu(gate) * up) @ wdown
            h = h * torch.rsqrt(h.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(h.dtype)
        return (h @ self.head).argmax(-1)


def trainer_loop(device: torch.device, stop: threading.Event, box: dict[str, Any]) -> None:
    x = torch.randn(8192, HIDDEN, device=device, dtype=torch.bfloat16)
    w1 = torch.randn(HIDDEN, INTERMEDIATE, device=device, dtype=torch.bfloat16)
    w2 = torch.randn(INTERMEDIATE, HIDDEN, device=device, dtype=torch.bfloat16)
    flops_per_iter = 2 * 2 * 8192 * HIDDEN * INTERMEDIATE
    for _ in range(3):
        (x @ w1) @ w2
    torch.cuda.current_stream().synchronize()
    box["ready"].set()
    iters = 0
    started = time.perf_counter()
    while not stop.is_set():
        for _ in range(20):
            (x @ w1) @ w2
        iters += 20
        torch.cuda.current_stream().synchronize()
    box["tflops"] = iters * flops_per_iter / (time.perf_counter() - started) / 1e12


def time_replays(graph: DecodeGraph, stream: Any, replays: int) -> float:
    with torch.cuda.stream(stream):
        graph.graph.replay()
        stream.synchronize()
        started = time.perf_counter()
        for _ in range(replays):
            graph.graph.replay()
            stream.synchronize()  # one step at a time, as the engine's results need
        return (time.perf_counter() - started) / replays * 1e3


def measure(
    device: torch.device, rows: int, engine: SmShare | None, trainer: SmShare | None, seconds: float
) -> dict[str, float]:
    """Decode graph on ``engine``'s share (None: the whole GPU, a high-priority stream) beside a
    product loop on ``trainer``'s share (None: the default stream)."""
    if engine is None:
        decode_stream: Any = torch.cuda.Stream(device, priority=-1)
        capture: Any = None
    else:
        decode_stream, capture = engine.stream, engine.capture_stream
    graph = DecodeGraph(device, rows, capture)
    replays = 200
    alone_ms = time_replays(graph, decode_stream, replays)

    def run_loop(box: dict[str, Any], stop: threading.Event) -> threading.Thread:
        def body() -> None:
            if trainer is not None:
                trainer.enter()
            trainer_loop(device, stop, box)

        thread = threading.Thread(target=body)
        thread.start()
        return thread

    alone: dict[str, Any] = {"ready": threading.Event()}
    stop = threading.Event()
    thread = run_loop(alone, stop)
    alone["ready"].wait()
    time.sleep(seconds)
    stop.set()
    thread.join()

    beside: dict[str, Any] = {"ready": threading.Event()}
    stop = threading.Event()
    thread = run_loop(beside, stop)
    beside["ready"].wait()
    beside_ms = time_replays(graph, decode_stream, replays)
    stop.set()
    thread.join()
    return {
        "decode_ms_alone": round(alone_ms, 4),
        "decode_ms_beside_trainer": round(beside_ms, 4),
        "trainer_tflops_alone": round(alone["tflops"], 1),
        "trainer_tflops_beside_decode": round(beside["tflops"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engine-sms", type=int, nargs="+", default=[32, 48, 64])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=1.0)
    parser.add_argument("--out", type=Path, default=Path("runs/sm_split"))
    args = parser.parse_args()
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(device)}
    engine, trainer = split_sms(device, args.engine_sms[0])
    report["split"] = {"engine": engine.sm_count, "trainer": trainer.sm_count}
    report["checks"] = checks(device, engine, trainer)
    print("RESULT", json.dumps(report), flush=True)
    rows = [{"engine_sms": 0, **measure(device, args.rows, None, None, args.seconds)}]
    print("RESULT", json.dumps(rows[-1]), flush=True)
    for n in args.engine_sms:
        engine, trainer = split_sms(device, n)
        row = {"engine_sms": engine.sm_count, "trainer_sms": trainer.sm_count}
        row.update(measure(device, args.rows, engine, trainer, args.seconds))
        rows.append(row)
        print("RESULT", json.dumps(row), flush=True)
        row = {"engine_sms": "whole", "trainer_sms": trainer.sm_count}
        row.update(measure(device, args.rows, None, trainer, args.seconds))
        rows.append(row)
        print("RESULT", json.dumps(row), flush=True)
    report["rows"] = rows
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "sm_split.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
