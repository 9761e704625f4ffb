"""One-kernel decode attention over the static KV cache (Triton, CUDA only).

The static decode step (``static_decode.py``) attends, for each busy slot, its one new query
per head over that slot's cached keys/values at positions ``0..position``. Written with torch
ops this is two batched products around a float32 softmax with a mask, over the whole
attended-length bucket of every row: four or five kernels a layer, each reading or writing a
[rows, heads, length] score tensor. ``decode_attention`` is one Triton kernel instead:

- one program per (slot, KV head): it loads the ``group`` query heads that share the KV head
  (padded to 16 rows, the smallest ``tl.dot`` tile) and walks that slot's keys and values in
  blocks of ``BLOCK_N`` positions with an online softmax (running max and sum in float32);
- it stops at ``min(position + 1, length)``: a row reads only the cache it attends, not the
  bucket's padding (free slots of the bucket are capped by ``length`` too);
- the cache is read in place through its strides (``[slots, kv_heads, max_len, head_dim]``),
  nothing is copied or repeated for the grouped heads;
- with ``cos``/``sin`` given, the query is rotated (rotary embedding, the rotate-half form)
  as it is loaded, in float32 and rounded once to the query's dtype, so the decode step needs
  no separate kernel for it;
- with ``new_k``/``new_v`` given (the step's own key, unrotated, and value of each row and KV
  head), the program first writes them into the cache at the row's position (the key rotated
  like the query) and then attends over them with the rest: the step needs no kernel of its
  own for the cache write either. The program that reads that position writes it (the split
  holding it), and a barrier orders the write before its reads.

float32 inputs take IEEE products (no TF32), so a float32 engine stays exact enough for the
CPU-vs-GPU greedy comparisons of the tests; bf16 inputs take the tensor cores. On CPU, or when
Triton is missing, the torch reference (``reference_decode_attention``) runs: it is the path
the CPU tests check, and the CUDA test checks the kernel against it.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None
    tl = None

# Launch shape: cache positions per loop iteration, warps and software-pipeline stages of a
# program (benchmarks/gpu_decode_attention.py times the alternatives; on the H200 these were
# the fastest at 64 rows, 5.2 us a layer, and 10% behind the fastest at 256 rows, 9.1 vs 8.3).
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 3
# Programs per (row, KV head), each over its share of the positions (flash-decoding split);
# a second small kernel combines their partial softmax sums. At most one per BLOCK_N positions.
# 1: on the H200 at 64 and 256 rows and ~130 attended positions, 2 to 8 splits were slower
# (best 6.6 vs 5.2 us a layer at 64 rows, 11.9 vs 8.3 at 256); more may pay for few rows of
# long contexts.
SPLITS = 1
MIN_BLOCK_H = 16
# Set to False to run the torch reference on CUDA too (benchmarks compare both).
USE_KERNEL = True


def kernel_supports(heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether the Triton kernel runs for this attention shape (with Triton and CUDA):
    a power-of-two head size of at least 16 (``tl.dot``'s smallest inner size)."""
    return (
        triton is not None
        and torch.cuda.is_available()
        and heads % kv_heads == 0
        and head_dim >= 16
        and head_dim & (head_dim - 1) == 0
    )


def rotate_half(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of ``x`` [..., D] (the rotate-half form): x cos + [-x2, x1] sin."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def _check_new_kv(
    q: torch.Tensor,
    keys: torch.Tensor,
    cos: torch.Tensor | None,
    new_k: torch.Tensor | None,
    new_v: torch.Tensor | None,
) -> None:
    if (new_k is None) != (new_v is None):
        raise ValueError("decode attention: new_k and new_v are given together or not at all")
    if new_k is None or new_v is None:
        return
    if cos is None:
        raise ValueError("decode attention: new_k needs cos/sin (the new keys are rotated here)")
    expected = (q.shape[0], keys.shape[1], q.shape[2])
    if tuple(new_k.shape) != expected or tuple(new_v.shape) != expected:
        raise ValueError(
            f"decode attention: new_k/new_v must be [rows, kv_heads, head_dim] = {list(expected)},"
            f" got {list(new_k.shape)} and {list(new_v.shape)}"
        )


def write_new_kv(
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    new_k: torch.Tensor,
    new_v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
) -> None:
    """Slot r's key ``new_k[r]`` rotated by ``cos[r]``/``sin[r]``, and its value ``new_v[r]``,
    into ``keys``/``values`` [slots, kv_heads, max_len, D] at position ``positions[r]``."""
    rows = new_k.shape[0]
    slots = torch.arange(rows, device=keys.device)
    at = positions[:rows]
    keys[slots, :, at] = rotate_half(new_k, cos, sin).to(keys.dtype)
    values[slots, :, at] = new_v.to(values.dtype)


def reference_decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    length: int,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """[rows, heads, D] attention of ``q`` over ``keys``/``values`` [slots, kv_heads, max_len, D]
    (the first ``rows`` slots), positions ``0..positions[r]`` within the first ``length``.
    ``cos``/``sin`` ([rows, 1, D]): rotate ``q`` by them first. ``new_k``/``new_v`` ([rows,
    kv_heads, D]): write them first (``write_new_kv``; needs ``cos``/``sin``).

    The query heads that share a KV head are that head's "query positions" (no repeat). Two
    batched products around a float32 softmax; torch's fused attention with this mask ran
    slower on the H200 (cuDNN: 1.55 vs 1.49 ms a step at 64 rows).
    """
    if (cos is None) != (sin is None):
        raise ValueError("decode attention: cos and sin are given together or not at all")
    _check_new_kv(q, keys, cos, new_k, new_v)
    if new_k is not None and new_v is not None and cos is not None and sin is not None:
        write_new_kv(keys, values, positions, new_k, new_v, cos, sin)
    if cos is not None:
        q = rotate_half(q, cos, sin)
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    grouped = q.reshape(rows, kv_heads, heads // kv_heads, head_dim)
    keys, values = keys[:rows, :, :length], values[:rows, :, :length]
    visible = torch.arange(length, device=q.device)[None, :] <= positions[:rows, None]
    scores = torch.matmul(grouped, keys.transpose(-1, -2)).float() * scale
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.softmax(scores, dim=-1).to(values.dtype)
    return torch.matmul(weights, values).reshape(rows, heads, head_dim)


if triton is not None:

    @triton.jit
    def _attend_block(
        q,
        k_base,
        v_base,
        start,
        last,
        running_max,
        running_sum,
        acc,
        d,
        stride_k_pos,
        stride_v_pos,
        SCALE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        """Online-softmax update with positions ``start..start+BLOCK_N`` below ``last``."""
        t = start + tl.arange(0, BLOCK_N)
        t_mask = t < last
        k = tl.load(
            k_base + t[:, None] * stride_k_pos + d[None, :], mask=t_mask[:, None], other=0.0
        )
        scores = tl.dot(q, tl.trans(k), input_precision=PRECISION)
        scores = tl.where(t_mask[None, :], scores * SCALE, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        correction = tl.exp(running_max - new_max)
        p = tl.exp(scores - new_max[:, None])
        running_sum = running_sum * correction + tl.sum(p, 1)
        v = tl.load(
            v_base + t[:, None] * stride_v_pos + d[None, :], mask=t_mask[:, None], other=0.0
        )
        # p.to(v.dtype): bf16 for the tensor cores; a no-op for float32 (IEEE products).
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        return new_max, running_sum, acc

    @triton.jit
    def _decode_attention_kernel(
        q_ptr,
        k_ptr,
        v_ptr,
        pos_ptr,
        out_ptr,
        cos_ptr,
        sin_ptr,
        new_k_ptr,
        new_v_ptr,
        stride_new_row,
        stride_new_head,
        stride_cs_row,
        stride_q_row,
        stride_q_head,
        stride_k_slot,
        stride_k_head,
        stride_k_pos,
        stride_v_slot,
        stride_v_head,
        stride_v_pos,
        stride_o_row,
        stride_o_head,
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        heads,
        length,
        SCALE: tl.constexpr,
        GROUP: tl.constexpr,
        BLOCK_H: tl.constexpr,
        BLOCK_N: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PRECISION: tl.constexpr,
        SPLITS: tl.constexpr,
        SPLIT_LEN: tl.constexpr,
        ROTARY: tl.constexpr,
        WRITE_KV: tl.constexpr,
    ):
        row = tl.program_id(0)
        kv_head = tl.program_id(1)
        split = tl.program_id(2)
        position = tl.load(pos_ptr + row)
        attended = tl.minimum(position + 1, length)
        first = split * SPLIT_LEN
        last = tl.minimum(attended, first + SPLIT_LEN)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, HEAD_DIM)
        head_mask = h < GROUP
        head = kv_head * GROUP + h
        q_rows = q_ptr + row * stride_q_row + head[:, None] * stride_q_head
        q = tl.load(q_rows + d[None, :], mask=head_mask[:, None], other=0.0)
        if ROTARY:
            # x cos + rotate_half(x) sin, rotate_half(x)[d] = -x[d + D/2] (d < D/2), x[d - D/2].
            partner = (d + HEAD_DIM // 2) % HEAD_DIM
            other = tl.load(q_rows + partner[None, :], mask=head_mask[:, None], other=0.0)
            sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
            cos = tl.load(cos_ptr + row * stride_cs_row + d).to(tl.float32)
            sin = tl.load(sin_ptr + row * stride_cs_row + d).to(tl.float32)
            q = q.to(tl.float32) * cos[None, :] + other.to(tl.float32) * (sign * sin)[None, :]
            q = q.to(q_ptr.dtype.element_ty)
        k_base = k_ptr + row * stride_k_slot + kv_head * stride_k_head
        v_base = v_ptr + row * stride_v_slot + kv_head * stride_v_head
        if WRITE_KV:
            # The split that reads this position writes it (the last one when the position is
            # past the attended length: written, not read, as the torch reference does).
            if split == tl.minimum(position // SPLIT_LEN, SPLITS - 1):
                new_row = row * stride_new_row + kv_head * stride_new_head
                partner = (d + HEAD_DIM // 2) % HEAD_DIM
                sign = tl.where(d < HEAD_DIM // 2, -1.0, 1.0)
                cos = tl.load(cos_ptr + row * stride_cs_row + d).to(tl.float32)
                sin = tl.load(sin_ptr + row * stride_cs_row + d).to(tl.float32)
                key = tl.load(new_k_ptr + new_row + d).to(tl.float32)
                key_partner = tl.load(new_k_ptr + new_row + partner).to(tl.float32)
                key = key * cos + key_partner * (sign * sin)
                tl.store(k_base + position * stride_k_pos + d, key.to(k_ptr.dtype.element_ty))
                value = tl.load(new_v_ptr + new_row + d)
                tl.store(v_base + position * stride_v_pos + d, value.to(v_ptr.dtype.element_ty))
            # Every thread of the program sees those stores before the loop reads them.
            tl.debug_barrier()
        running_max = tl.full([BLOCK_H], float("-inf"), tl.float32)
        running_sum = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, HEAD_DIM], tl.float32)
        for start in range(first, last, BLOCK_N):
            running_max, running_sum, acc = _attend_block(
                q, k_base, v_base, start, last, running_max, running_sum, acc, d,
                stride_k_pos, stride_v_pos, SCALE, BLOCK_N, PRECISION,
            )  # fmt: skip
        if SPLITS == 1:
            out = acc / running_sum[:, None]
            tl.store(
                out_ptr + row * stride_o_row + head[:, None] * stride_o_head + d[None, :],
                out.to(out_ptr.dtype.element_ty),
                mask=head_mask[:, None],
            )
        else:
            # This split's unnormalised partial (an empty split leaves max -inf, sum 0).
            part = (row * heads + head) * SPLITS + split
            tl.store(part_max_ptr + part, running_max, mask=head_mask)
            tl.store(part_sum_ptr + part, running_sum, mask=head_mask)
            tl.store(
                part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=head_mask[:, None]
            )

    @triton.jit
    def _combine_splits_kernel(
        part_max_ptr,
        part_sum_ptr,
        part_acc_ptr,
        out_ptr,
        stride_o_row,
        stride_o_head,
        heads,
        SPLITS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        part = (row * heads + head) * SPLITS + tl.arange(0, SPLITS)
        d = tl.arange(0, HEAD_DIM)
        part_max = tl.load(part_max_ptr + part)
        # Split 0 always holds position 0, so the overall max is finite.
        weights = tl.exp(part_max - tl.max(part_max, 0))
        total = tl.sum(tl.load(part_sum_ptr + part) * weights, 0)
        acc = tl.load(part_acc_ptr + part[:, None] * HEAD_DIM + d[None, :])
        out = tl.sum(acc * weights[:, None], 0) / total
        tl.store(
            out_ptr + row * stride_o_row + head * stride_o_head + d,
            out.to(out_ptr.dtype.element_ty),
        )


def decode_attention(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    positions: torch.Tensor,
    length: int,
    scale: float,
    cos: torch.Tensor | None = None,
    sin: torch.Tensor | None = None,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
) -> torch.Tensor:
    """``reference_decode_attention``'s result (and cache writes); one Triton kernel on CUDA
    (shapes that ``kernel_supports``). ``cos``/``sin`` [rows, 1, D]: rotate ``q`` by them
    first; ``new_k``/``new_v`` [rows, kv_heads, D]: write them into the cache first."""
    rows, heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    if not (USE_KERNEL and q.is_cuda and kernel_supports(heads, kv_heads, head_dim)):
        return reference_decode_attention(
            q, keys, values, positions, length, scale, cos, sin, new_k, new_v
        )
    if q.stride(-1) != 1:
        q = q.contiguous()
    # q may be a view of the fused QKV output (rows strided): the kernel reads it in place.
    if (cos is None) != (sin is None):
        raise ValueError("decode attention: cos and sin are given together or not at all")
    rotary = cos is not None
    if rotary:
        if cos.shape != (rows, 1, head_dim) or sin.shape != cos.shape:
            raise ValueError(
                f"decode_attention: cos/sin must be [rows, 1, head_dim] = [{rows}, 1, "
                f"{head_dim}], got {tuple(cos.shape)} and {tuple(sin.shape)}"
            )
        cos, sin = cos.contiguous(), sin.contiguous()
    else:
        cos = sin = q  # unused (ROTARY=False)
    _check_new_kv(q, keys, cos if rotary else None, new_k, new_v)
    write_kv = new_k is not None and new_v is not None
    if write_kv:
        # Both are views of one fused projection output: rows and heads strided alike.
        if new_k.stride() != new_v.stride() or new_k.stride(-1) != 1:
            new_k, new_v = new_k.contiguous(), new_v.contiguous()
    else:
        new_k = new_v = q  # unused (WRITE_KV=False)
    group = heads // kv_heads
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    block_h = max(MIN_BLOCK_H, triton.next_power_of_2(group))
    splits = min(SPLITS, triton.next_power_of_2(triton.cdiv(length, BLOCK_N)))
    split_len = triton.cdiv(triton.cdiv(length, splits), BLOCK_N) * BLOCK_N
    partial = (rows, heads, splits) if splits > 1 else (1,)
    part_max = torch.empty(partial, device=q.device, dtype=torch.float32)
    part_sum = torch.empty(partial, device=q.device, dtype=torch.float32)
    part_acc = torch.empty((*partial, head_dim), device=q.device, dtype=torch.float32)
    _decode_attention_kernel[(rows, kv_heads, splits)](
        q,
        keys,
        values,
        positions,
        out,
        cos,
        sin,
        new_k,
        new_v,
        new_k.stride(0) if write_kv else 0,
        new_k.stride(1) if write_kv else 0,
        cos.stride(0) if rotary else 0,
        q.stride(0),
        q.stride(1),
        keys.stride(0),
        keys.stride(1),
        keys.stride(2),
        values.stride(0),
        values.stride(1),
        values.stride(2),
        out.stride(0),
        out.stride(1),
        part_max,
        part_sum,
        part_acc,
        heads,
        length,
        # A compile-time constant: inductor hands Python floats to Triton as float64, which
        # would turn the float32 running max into a float64 loop variable.
        SCALE=scale,
        GROUP=group,
        BLOCK_H=block_h,
        BLOCK_N=BLOCK_N,
        HEAD_DIM=head_dim,
        # float32: IEEE products (no TF32); half types ignore the setting.
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        SPLITS=splits,
        SPLIT_LEN=split_len,
        ROTARY=rotary,
        WRITE_KV=write_kv,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )
    if splits > 1:
        _combine_splits_kernel[(rows, heads)](
            part_max,
            part_sum,
            part_acc,
            out,
            out.stride(0),
            out.stride(1),
            heads,
            SPLITS=splits,
            HEAD_DIM=head_dim,
        )
    return out
