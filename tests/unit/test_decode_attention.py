"""Decode attention over the static cache: the torch reference (CPU) and the Triton kernel
(CUDA) against a plain per-row softmax attention."""

from __future__ import annotations

import pytest
import torch

from tandemrl.generation import decode_attention as decode_attention_module
from tandemrl.generation.decode_attention import (
    decode_attention,
    kernel_supports,
    reference_decode_attention,
)


def naive(q, keys, values, positions, length, scale):
    rows, heads, _ = q.shape
    group = heads // keys.shape[1]
    out = torch.empty(q.shape, dtype=torch.float64, device=q.device)
    for row in range(rows):
        seen = min(int(positions[row]) + 1, length)
        for head in range(heads):
            k = keys[row, head // group, :seen].double()
            v = values[row, head // group, :seen].double()
            weights = torch.softmax(k @ q[row, head].double() * scale, dim=0)
            out[row, head] = weights @ v
    return out


def make_inputs(device, dtype, rows=5, slots=7, heads=14, kv_heads=2, head_dim=64, max_len=200):
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(rows, heads, head_dim, generator=generator)
    cache = torch.randn(2, slots, kv_heads, max_len, head_dim, generator=generator)
    positions = torch.tensor([0, 3, 63, 64, 190][:rows] + [5] * max(0, rows - 5))
    to = {"device": device, "dtype": dtype}
    return q.to(**to), cache[0].to(**to), cache[1].to(**to), positions.to(device)


def test_reference_matches_per_row_softmax() -> None:
    q, keys, values, positions = make_inputs("cpu", torch.float32)
    length = 128  # row 4 (position 190) is capped at the attended length
    got = reference_decode_attention(q, keys, values, positions, length, 0.125)
    torch.testing.assert_close(
        got.double(), naive(q, keys, values, positions, length, 0.125), rtol=1e-5, atol=1e-5
    )


@pytest.mark.skipif(not kernel_supports(14, 2, 64), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_kernel_matches_reference(
    dtype: torch.dtype, compiled: bool, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_attention_module, "SPLITS", splits)
    # The static step calls the kernel inside torch.compile(fullgraph=True): check that too.
    attend = torch.compile(decode_attention, fullgraph=True) if compiled else decode_attention
    q, keys, values, positions = make_inputs("cuda", dtype, rows=37, slots=40)
    for length in (64, 192):
        got = attend(q, keys, values, positions, length, 0.125)
        expected = naive(q, keys, values, positions, length, 0.125)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
