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
    rotate_half,
    write_new_kv,
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


def rotary(rows, head_dim, device, dtype, seed=1):
    """cos/sin [rows, 1, head_dim] of random positions (the static step's layout)."""
    generator = torch.Generator().manual_seed(seed)
    positions = torch.randint(0, 4096, (rows,), generator=generator).double()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    angles = positions[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], dim=-1)[:, None, :]
    return angles.cos().to(device, dtype), angles.sin().to(device, dtype)


def test_rotate_half_is_the_pairwise_rotation() -> None:
    # Element d and d + D/2 form one rotated pair: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s).
    x = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    cos, sin = rotary(3, 8, "cpu", torch.float64)
    got = rotate_half(x, cos, sin)
    x1, x2, c, s = x[..., :4], x[..., 4:], cos[..., :4], sin[..., :4]
    torch.testing.assert_close(got, torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1))


def test_reference_rotates_the_query_when_given_cos_sin() -> None:
    q, keys, values, positions = make_inputs("cpu", torch.float32)
    cos, sin = rotary(q.shape[0], q.shape[-1], "cpu", torch.float32)
    got = reference_decode_attention(q, keys, values, positions, 128, 0.125, cos, sin)
    expected = naive(rotate_half(q, cos, sin), keys, values, positions, 128, 0.125)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_cos_without_sin_is_refused() -> None:
    q, keys, values, positions = make_inputs("cpu", torch.float32)
    cos, _ = rotary(q.shape[0], q.shape[-1], "cpu", torch.float32)
    for attention in (reference_decode_attention, decode_attention):
        with pytest.raises(ValueError, match="cos and sin"):
            attention(q, keys, values, positions, 128, 0.125, cos, None)


def test_reference_matches_per_row_softmax() -> None:
    q, keys, values, positions = make_inputs("cpu", torch.float32)
    length = 128  # row 4 (position 190) is capped at the attended length
    got = reference_decode_attention(q, keys, values, positions, length, 0.125)
    torch.testing.assert_close(
        got.double(), naive(q, keys, values, positions, length, 0.125), rtol=1e-5, atol=1e-5
    )


def new_kv(rows, kv_heads, head_dim, device, dtype, seed=3):
    """The step's new keys and values as the static step hands them over: strided views of
    one wider (fused projection) output, [rows, kv_heads, head_dim] each."""
    generator = torch.Generator().manual_seed(seed)
    fused = torch.randn(rows, 2 * kv_heads + 3, head_dim, generator=generator).to(device, dtype)
    return fused[:, 1 : 1 + kv_heads], fused[:, 1 + kv_heads : 1 + 2 * kv_heads]


def test_reference_writes_the_new_keys_and_values_first() -> None:
    # Every row is written, row 4 (position 190) too, past the attended length of 128.
    q, keys, values, positions = make_inputs("cpu", torch.float32)
    cos, sin = rotary(q.shape[0], q.shape[-1], "cpu", torch.float32)
    new_k, new_v = new_kv(q.shape[0], keys.shape[1], q.shape[-1], "cpu", torch.float32)
    expected_keys, expected_values = keys.clone(), values.clone()
    for row in range(q.shape[0]):
        at = int(positions[row])
        expected_keys[row, :, at] = rotate_half(new_k[row], cos[row], sin[row])
        expected_values[row, :, at] = new_v[row]
    got = reference_decode_attention(
        q, keys, values, positions, 128, 0.125, cos, sin, new_k=new_k, new_v=new_v
    )
    torch.testing.assert_close(keys, expected_keys, rtol=0, atol=0)
    torch.testing.assert_close(values, expected_values, rtol=0, atol=0)
    expected = naive(rotate_half(q, cos, sin), keys, values, positions, 128, 0.125)
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)


def test_new_keys_and_values_are_checked() -> None:
    q, keys, values, positions = make_inputs("cpu", torch.float32)
    cos, sin = rotary(q.shape[0], q.shape[-1], "cpu", torch.float32)
    new_k, new_v = new_kv(q.shape[0], keys.shape[1], q.shape[-1], "cpu", torch.float32)
    for attention in (reference_decode_attention, decode_attention):
        with pytest.raises(ValueError, match="new_k and new_v"):
            attention(q, keys, values, positions, 64, 0.125, cos, sin, new_k=new_k)
        with pytest.raises(ValueError, match="needs cos/sin"):
            attention(q, keys, values, positions, 64, 0.125, new_k=new_k, new_v=new_v)
        with pytest.raises(ValueError, match=r"\[rows, kv_heads, head_dim\]"):
            attention(q, keys, values, positions, 64, 0.125, cos, sin, new_k[:2], new_v[:2])


@pytest.mark.skipif(not kernel_supports(14, 2, 64), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_kernel_matches_reference(
    dtype: torch.dtype, compiled: bool, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_attention_module, "SPLITS", splits)
    # Every parametrization recompiles decode_attention (one code object): start from an
    # empty dynamo cache so the tests never reach its recompile limit.
    torch._dynamo.reset()
    # The static step calls the kernel inside torch.compile(fullgraph=True): check that too.
    attend = torch.compile(decode_attention, fullgraph=True) if compiled else decode_attention
    q, keys, values, positions = make_inputs("cuda", dtype, rows=37, slots=40)
    for length in (64, 192):
        got = attend(q, keys, values, positions, length, 0.125)
        expected = naive(q, keys, values, positions, length, 0.125)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(not kernel_supports(14, 2, 64), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("compiled", [False, True])
def test_triton_kernel_rotates_the_query(dtype: torch.dtype, compiled: bool) -> None:
    # The query rotated inside the kernel = rotated in float64 first, then attended; q is a
    # strided view (rows of a wider tensor), as the static step hands it over.
    torch._dynamo.reset()
    attend = torch.compile(decode_attention, fullgraph=True) if compiled else decode_attention
    q, keys, values, positions = make_inputs("cuda", dtype, rows=37, slots=40)
    wide = torch.randn(37, q.shape[1] + 4, q.shape[2], device="cuda").to(dtype)
    wide[:, 2 : 2 + q.shape[1]] = q
    q = wide[:, 2 : 2 + q.shape[1]]
    assert not q.is_contiguous()
    cos, sin = rotary(37, q.shape[-1], "cuda", dtype)
    for length in (64, 192):
        got = attend(q, keys, values, positions, length, 0.125, cos, sin)
        assert got.shape == q.shape and bool(torch.isfinite(got).all())
        rotated = rotate_half(q.double(), cos.double(), sin.double())
        expected = naive(rotated, keys, values, positions, length, 0.125)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
    with pytest.raises(ValueError, match="cos/sin must be"):
        decode_attention(q, keys, values, positions, 64, 0.125, cos[:5], sin[:5])


@pytest.mark.skipif(not kernel_supports(14, 2, 64), reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("splits", [1, 4])
def test_triton_kernel_writes_the_new_keys_and_values_first(
    dtype: torch.dtype, splits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The kernel writes each row's rotated key and value at its position, then attends over
    # them with the rest (the split that reads the position writes it); rows past the length
    # (row 4, position 190, with length 64 or 128) are written and not attended.
    monkeypatch.setattr(decode_attention_module, "SPLITS", splits)
    for length in (64, 192):
        q, keys, values, positions = make_inputs("cuda", dtype, rows=37, slots=40)
        cos, sin = rotary(37, q.shape[-1], "cuda", dtype)
        new_k, new_v = new_kv(37, keys.shape[1], q.shape[-1], "cuda", dtype)
        expected_keys, expected_values = keys.double(), values.double()
        write_new_kv(
            expected_keys, expected_values, positions, new_k.double(), new_v.double(),
            cos.double(), sin.double(),
        )  # fmt: skip
        got = decode_attention(
            q, keys, values, positions, length, 0.125, cos, sin, new_k=new_k, new_v=new_v
        )
        tolerance = 1e-5 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(keys.double(), expected_keys, rtol=tolerance, atol=tolerance)
        torch.testing.assert_close(values.double(), expected_values, rtol=0, atol=0)
        rotated = rotate_half(q.double(), cos.double(), sin.double())
        expected = naive(rotated, expected_keys, expected_values, positions, length, 0.125)
        tolerance = 1e-4 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.double(), expected, rtol=tolerance, atol=tolerance)
