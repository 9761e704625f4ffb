"""Decode attention kernel launch shapes (tandemrl/generation/decode_attention.py), timed.

One decode step's attention on a 0.5B-shaped Qwen2 (14 query heads, 2 KV heads, head size 64):
24 calls, each over its own layer's cache (no L2 reuse between calls, as in a real step),
replayed as one CUDA graph; rows at random positions in [64, 192). Every (splits, BLOCK_N,
warps, stages) combination against the torch reference; microseconds per layer and the largest
absolute difference from the reference (bf16).

    python benchmarks/gpu_decode_attention.py --out $OUT    # GPU only
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_common import write_result

from tandemrl.generation import decode_attention as attention

LAYERS = 24


def time_step(step: Any, replays: int = 20) -> float:
    """Microseconds per layer of ``step`` (all layers), replayed as one CUDA graph."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / replays / LAYERS


def all_layers(attend: Any, q: torch.Tensor, cache: torch.Tensor, call: tuple) -> None:
    """One step's attention: ``attend`` once per layer, each over that layer's cache."""
    for layer in range(LAYERS):
        attend(q, cache[layer, 0], cache[layer, 1], *call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--length", type=int, default=200, help="attended-length bucket")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.manual_seed(0)
    kv_heads, heads, head_dim, max_len = 2, 14, 64, 256
    result: dict[str, Any] = {}
    for rows in args.rows:
        q = torch.randn(rows, heads, head_dim, device="cuda", dtype=torch.bfloat16)
        shape = (LAYERS, 2, rows, kv_heads, max_len, head_dim)
        cache = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
        positions = torch.randint(64, 192, (rows,), device="cuda")
        call = (positions, args.length, head_dim**-0.5)
        expected = attention.reference_decode_attention(q, cache[0, 0], cache[0, 1], *call)

        kernel_step = functools.partial(all_layers, attention.decode_attention, q, cache, call)
        reference_step = functools.partial(
            all_layers, attention.reference_decode_attention, q, cache, call
        )
        rows_out = [{"config": "torch_reference", "us_per_layer": time_step(reference_step)}]
        defaults = (attention.SPLITS, attention.BLOCK_N, attention.NUM_WARPS, attention.NUM_STAGES)
        for splits, block_n, warps, stages in itertools.product(
            (1, 2, 4, 8), (32, 64, 128), (1, 2, 4), (2, 3)
        ):
            attention.SPLITS, attention.BLOCK_N = splits, block_n
            attention.NUM_WARPS, attention.NUM_STAGES = warps, stages
            name = f"splits{splits}_block{block_n}_warps{warps}_stages{stages}"
            try:
                got = attention.decode_attention(q, cache[0, 0], cache[0, 1], *call)
                error = float((got.float() - expected.float()).abs().max())
                rows_out.append(
                    {"config": name, "us_per_layer": time_step(kernel_step), "max_abs_err": error}
                )
            except Exception as exc:  # report the combination and keep timing the others
                rows_out.append({"config": name, "error": repr(exc)[:300]})
        attention.SPLITS, attention.BLOCK_N, attention.NUM_WARPS, attention.NUM_STAGES = defaults
        rows_out.sort(key=lambda row: row.get("us_per_layer", float("inf")))
        result[str(rows)] = rows_out
        print(rows, "rows, fastest:", json.dumps(rows_out[:5]), flush=True)
    write_result(args.out, "decode_attention", result)


if __name__ == "__main__":
    main()
