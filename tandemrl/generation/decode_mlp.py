"""The MLP's SiLU·up and split down projection as one Triton kernel (CUDA only).

The static decode step (``static_decode.py``) ends each layer's MLP with ``act = silu(gate) *
up`` (one elementwise kernel, writing ``act``) and the down projection as ``splits`` partial
products over slices of the intermediate size (one batched product, reading ``act`` back),
returned as ``[splits, rows, hidden]`` for the next residual add to sum in float32.
``silu_down_partials`` is that pair as one kernel reading the gate/up product directly:

    partials[s] = (silu(gate) * up)[:, K_s] @ down_weight[:, K_s].T,
    gate = gate_up[:, :I], up = gate_up[:, I:], K_s = [s I / splits, (s + 1) I / splits)

- one program per (row tile, hidden tile, split): it walks its split's ``I / splits`` columns
  in blocks of ``BLOCK_K``, loads the gate and up tiles, computes ``silu(gate) * up`` in
  float32, rounds it once to the weight's dtype and multiplies it with the down weight's tile
  (``tl.dot``, float32 accumulator); the tile is stored in the weight's dtype;
- rows below ``BLOCK_M`` (at least 16, ``tl.dot``'s smallest tile) are masked, so every rows
  bucket from 8 up runs; the hidden and intermediate sizes need not divide the blocks either
  (masked edges; ``EVEN_N``/``EVEN_K`` drop the masks when they do);
- the launch shape comes from ``LAUNCH_TABLE`` by rows (``LAUNCH_OVERRIDE`` replaces it, for
  benchmarks). Under ``torch.compile`` a symbolic row count (dynamic shapes) is guarded by
  the table's ranges: at most one compiled variant per entry (and one above the last).

Rounding: the eager path rounds twice in bf16 (``F.silu(gate)`` to bf16, then the product to
bf16); the kernel rounds ``act`` once, as inductor's compiled form of the same expression does.
The two ``act`` differ by at most one bf16 rounding of ``silu(gate)`` (2^-8 relative, per
element, before the product's own rounding); the products then differ by that plus the
summation order of the float32 accumulators (the tests bound both). float32 inputs take IEEE
products (no TF32). On CPU, or when Triton is missing, the torch reference
(``reference_silu_down_partials``, the eager computation) runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the reference path runs
    triton = None
    tl = None


class MlpLaunch(NamedTuple):
    """Block sizes (rows, hidden outputs, intermediate columns per step) and launch knobs."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


# (largest rows, launch shape), by rows bucket; rows above the last entry take the last one.
# Not timed yet (written without a GPU): chosen so that the grid for Qwen2-0.5B (hidden 896,
# intermediate 4864, 4 splits of 1216 = 19 x 64 columns) has 112 programs on the H200's 132
# SMs at every bucket, the down weight (8.7 MB, the bulk of the bytes) is read by as few row
# tiles as that allows (1 up to 64 rows, 2 at 128, 4 at 256), and BLOCK_K divides 1216.
LAUNCH_TABLE: tuple[tuple[int, MlpLaunch], ...] = (
    (16, MlpLaunch(16, 32, 64, 4, 4)),
    (32, MlpLaunch(32, 32, 64, 4, 4)),
    (64, MlpLaunch(64, 32, 64, 4, 3)),
    (128, MlpLaunch(64, 64, 64, 4, 3)),
    (256, MlpLaunch(64, 128, 64, 4, 3)),
)
# Set to an MlpLaunch to use it for every rows bucket (benchmarks/gpu_decode.py --mlp-configs).
LAUNCH_OVERRIDE: MlpLaunch | None = None
# tl.dot's smallest tile: the block sizes are raised to it (and capped to the problem's size).
MIN_BLOCK = 16
# float32 tiles take twice the shared memory of bf16 ones: their pipeline stages are capped so
# that stages x (gate, up and weight tiles) stays within this (the H200 allows 227 KiB a block;
# the table's bf16 shapes use at most 96 KiB). Half types run the launch shape as given.
FLOAT32_SHARED_BYTES = 160 * 1024
# Set to False to run the torch reference on CUDA too (benchmarks compare both).
USE_KERNEL = True


def kernel_supports(gate_up: torch.Tensor, down_weight: torch.Tensor) -> bool:
    """Whether the Triton kernel runs for these tensors: Triton, CUDA tensors, a float dtype
    shared by both (bf16, fp16 or float32)."""
    return (
        triton is not None
        and gate_up.is_cuda
        and down_weight.is_cuda
        and gate_up.dtype == down_weight.dtype
        and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


def _check_shapes(gate_up: torch.Tensor, down_weight: torch.Tensor, splits: int) -> None:
    intermediate = down_weight.shape[1]
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * intermediate:
        raise ValueError(
            f"silu_down_partials: gate_up must be [rows, 2 x intermediate] = [rows, "
            f"{2 * intermediate}] for down_weight {tuple(down_weight.shape)}, got "
            f"{tuple(gate_up.shape)}"
        )
    if splits < 1 or intermediate % splits:
        raise ValueError(
            f"silu_down_partials: the intermediate size {intermediate} must divide into "
            f"splits={splits} equal slices (use a divisor of it, e.g. 1)"
        )


def reference_silu_down_partials(
    gate_up: torch.Tensor, down_weight: torch.Tensor, splits: int
) -> torch.Tensor:
    """[splits, rows, hidden]: ``act = F.silu(gate) * up`` (gate, up: the halves of
    ``gate_up``), then ``F.linear(act, down_weight)`` as partial products over ``splits``
    slices of the intermediate size: the static step's eager computation (the same batched
    product as ``StaticDecoder._split_linear``)."""
    _check_shapes(gate_up, down_weight, splits)
    gate, up = gate_up.chunk(2, dim=-1)
    act = F.silu(gate) * up
    rows, intermediate = act.shape
    part = intermediate // splits
    sliced = act.view(rows, splits, part).transpose(0, 1)
    return torch.bmm(sliced, down_weight.view(down_weight.shape[0], splits, part).permute(1, 2, 0))


def launch_config(rows: int | torch.SymInt) -> MlpLaunch:
    """The launch shape for ``rows`` (``LAUNCH_OVERRIDE``, else ``LAUNCH_TABLE``'s entry)."""
    if LAUNCH_OVERRIDE is not None:
        return LAUNCH_OVERRIDE
    for largest, launch in LAUNCH_TABLE:
        # A symbolic count (torch.compile's dynamic shapes: the decode step's rows buckets
        # after the first, prefill's token counts) is guarded here: one compiled variant per
        # range of the table, so each bucket keeps its own launch shape.
        if rows <= largest:
            return launch
    return LAUNCH_TABLE[-1][1]


def _block(size: int, wanted: int) -> int:
    """``wanted`` capped to ``size``'s next power of two, at least MIN_BLOCK."""
    return max(MIN_BLOCK, min(wanted, triton.next_power_of_2(size)))


if triton is not None:

    @triton.jit
    def _silu_down_kernel(
        gate_up_ptr,
        w_ptr,
        out_ptr,
        rows,
        hidden,
        stride_gu_row,
        stride_w_out,
        stride_o_split,
        stride_o_row,
        INTERMEDIATE: tl.constexpr,
        PART: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        EVEN_N: tl.constexpr,
        EVEN_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):
        row_tile = tl.program_id(0)
        hidden_tile = tl.program_id(1)
        split = tl.program_id(2)
        m = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        n = hidden_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        k = tl.arange(0, BLOCK_K)
        m_mask = m < rows
        n_mask = n < hidden
        first = split * PART
        # Gate columns at first + k of each row; up columns INTERMEDIATE further on.
        gate_ptrs = gate_up_ptr + m[:, None] * stride_gu_row + (first + k)[None, :]
        # Down weight [hidden, INTERMEDIATE]: a [BLOCK_N, BLOCK_K] tile, transposed for the dot.
        w_ptrs = w_ptr + n[:, None] * stride_w_out + (first + k)[None, :]
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for start in range(0, PART, BLOCK_K):
            if EVEN_K:
                gate_mask = m_mask[:, None]
                w_mask = n_mask[:, None]
            else:
                k_mask = (start + k) < PART
                gate_mask = m_mask[:, None] & k_mask[None, :]
                w_mask = n_mask[:, None] & k_mask[None, :]
            gate = tl.load(gate_ptrs + start, mask=gate_mask, other=0.0).to(tl.float32)
            up = tl.load(gate_ptrs + start + INTERMEDIATE, mask=gate_mask, other=0.0)
            # silu(g) * up in float32, rounded once to the weight's dtype (bf16: tensor cores).
            act = (gate * tl.sigmoid(gate) * up.to(tl.float32)).to(w_ptr.dtype.element_ty)
            if EVEN_N and EVEN_K:
                w = tl.load(w_ptrs + start)
            else:
                w = tl.load(w_ptrs + start, mask=w_mask, other=0.0)
            acc = tl.dot(act, tl.trans(w), acc, input_precision=PRECISION)
        out_ptrs = out_ptr + split * stride_o_split + m[:, None] * stride_o_row + n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def launch_silu_down(
    gate_up: torch.Tensor, down_weight: torch.Tensor, splits: int, launch: MlpLaunch
) -> torch.Tensor:
    """The kernel itself (no fallback): [splits, rows, hidden] in the weight's dtype.

    ``gate_up`` [rows, 2 x intermediate] and ``down_weight`` [hidden, intermediate], each with
    unit stride along the last dimension (copied when not).
    """
    _check_shapes(gate_up, down_weight, splits)
    if gate_up.stride(-1) != 1:
        gate_up = gate_up.contiguous()
    if down_weight.stride(-1) != 1:
        down_weight = down_weight.contiguous()
    rows = gate_up.shape[0]
    hidden, intermediate = down_weight.shape
    part = intermediate // splits
    out = torch.empty((splits, rows, hidden), dtype=down_weight.dtype, device=down_weight.device)
    block_m = max(MIN_BLOCK, launch.block_m)  # rows are masked, never fewer than tl.dot's 16
    block_n = _block(hidden, launch.block_n)
    block_k = _block(part, launch.block_k)
    num_stages = launch.num_stages
    if down_weight.dtype == torch.float32:
        stage_bytes = 4 * block_k * (2 * block_m + block_n)
        num_stages = max(1, min(num_stages, FLOAT32_SHARED_BYTES // stage_bytes))
    grid = (triton.cdiv(rows, block_m), triton.cdiv(hidden, block_n), splits)
    _silu_down_kernel[grid](
        gate_up,
        down_weight,
        out,
        rows,
        hidden,
        gate_up.stride(0),
        down_weight.stride(0),
        out.stride(0),
        out.stride(1),
        INTERMEDIATE=intermediate,
        PART=part,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        EVEN_N=hidden % block_n == 0,
        EVEN_K=part % block_k == 0,
        # float32: IEEE products (no TF32); half types ignore the setting.
        PRECISION="ieee" if down_weight.dtype == torch.float32 else "tf32",
        num_warps=launch.num_warps,
        num_stages=num_stages,
    )
    return out


def silu_down_partials(
    gate_up: torch.Tensor, down_weight: torch.Tensor, splits: int
) -> torch.Tensor:
    """``reference_silu_down_partials``'s [splits, rows, hidden]; one Triton kernel on CUDA
    (``USE_KERNEL`` and ``kernel_supports``), the torch reference elsewhere."""
    if not (USE_KERNEL and kernel_supports(gate_up, down_weight)):
        return reference_silu_down_partials(gate_up, down_weight, splits)
    return launch_silu_down(gate_up, down_weight, splits, launch_config(gate_up.shape[0]))
