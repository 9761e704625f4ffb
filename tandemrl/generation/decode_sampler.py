"""Two-kernel sampler for the static decode step (Triton, CUDA only).

The static step (``static_decode.py``) draws one token per row by the inverse CDF of the
tempered distribution ``softmax(logits / temperature)`` at a host-drawn uniform ``u`` (greedy
rows take the argmax) and reports the token's logprob under that distribution. With torch ops
this is a compiled pass over the vocabulary (log-normaliser, per-block masses, argmax) and a
dozen small kernels around a two-level search. ``sample_rows`` is two kernels instead:

- ``_chunk_kernel``, one program per (row, chunk of ``CHUNK`` columns), reads the logits once:
  the chunk's largest tempered logit ``m``, its mass ``sum exp(logit / T - m)``, and its first
  largest raw logit and column;
- ``_pick_kernel``, one program per row, combines the chunks: the log-normaliser
  ``M + log S`` and the argmax (lowest column on ties, as ``torch.argmax``); the chunk whose
  cumulative mass first exceeds ``u x S``; then, inside that chunk only, the first column whose
  cumulative mass exceeds the target (a right-sided ``searchsorted``; rounding that leaves no
  such column takes the chunk's last column).

Same law as the torch sampler; tokens can differ from it only where ``u x S`` falls within
float32 rounding of a CDF step (another summation order). On CPU, or without Triton, the
caller keeps the torch path.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch sampler runs
    triton = None
    tl = None

# Columns per program of the first kernel (and warps of both kernels).
CHUNK = 4096
NUM_WARPS = 8
# Set to False to keep the torch sampler on CUDA too (benchmarks compare both).
USE_KERNEL = True


def kernel_available(logits: torch.Tensor) -> bool:
    return USE_KERNEL and triton is not None and logits.is_cuda and logits.shape[1] >= CHUNK


if triton is not None:

    @triton.jit
    def _chunk_kernel(
        logits_ptr,
        stride_row,
        temperature_ptr,
        chunk_max_ptr,
        chunk_mass_ptr,
        chunk_best_ptr,
        chunk_best_at_ptr,
        vocab,
        chunks,
        CHUNK: tl.constexpr,
    ):
        row = tl.program_id(0)
        chunk = tl.program_id(1)
        columns = chunk * CHUNK + tl.arange(0, CHUNK)
        inside = columns < vocab
        raw = tl.load(
            logits_ptr + row.to(tl.int64) * stride_row + columns, mask=inside, other=float("-inf")
        ).to(tl.float32)
        tempered = raw / tl.load(temperature_ptr + row)
        top = tl.max(tempered, 0)  # finite: every chunk holds at least one column
        best = tl.max(raw, 0)
        out = row * chunks + chunk
        tl.store(chunk_max_ptr + out, top)
        tl.store(chunk_mass_ptr + out, tl.sum(tl.exp(tempered - top), 0))
        tl.store(chunk_best_ptr + out, best)
        tl.store(chunk_best_at_ptr + out, tl.min(tl.where(raw == best, columns, vocab), 0))

    @triton.jit
    def _pick_kernel(
        logits_ptr,
        stride_row,
        temperature_ptr,
        greedy_ptr,
        uniform_ptr,
        chunk_max_ptr,
        chunk_mass_ptr,
        chunk_best_ptr,
        chunk_best_at_ptr,
        token_ptr,
        logprob_ptr,
        vocab,
        chunks,
        CHUNK: tl.constexpr,
        CHUNKS_POW2: tl.constexpr,
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        temperature = tl.load(temperature_ptr + row)
        lanes = tl.arange(0, CHUNKS_POW2)
        valid = lanes < chunks
        parts = row * chunks + lanes
        part_max = tl.load(chunk_max_ptr + parts, mask=valid, other=float("-inf"))
        row_max = tl.max(part_max, 0)
        masses = tl.load(chunk_mass_ptr + parts, mask=valid, other=0.0)
        masses = tl.where(valid, masses * tl.exp(part_max - row_max), 0.0)
        total = tl.sum(masses, 0)
        log_norm = row_max + tl.log(total)
        best = tl.load(chunk_best_ptr + parts, mask=valid, other=float("-inf"))
        best_at = tl.load(chunk_best_at_ptr + parts, mask=valid, other=vocab)
        argmax = tl.min(tl.where(best == tl.max(best, 0), best_at, vocab), 0)

        target = tl.load(uniform_ptr + row) * total
        cumulative = tl.cumsum(masses, 0)
        chosen = tl.min(tl.where((cumulative > target) & valid, lanes, chunks - 1), 0)
        below = tl.sum(tl.where(lanes < chosen, masses, 0.0), 0)
        columns = chosen * CHUNK + tl.arange(0, CHUNK)
        inside = columns < vocab
        raw = tl.load(base + columns, mask=inside, other=float("-inf")).to(tl.float32)
        running = below + tl.cumsum(tl.exp(raw / temperature - row_max), 0)
        last = tl.minimum(chosen * CHUNK + CHUNK, vocab) - 1
        pick = tl.min(tl.where((running > target) & inside, columns, last), 0)
        token = tl.where(tl.load(greedy_ptr + row) != 0, argmax, pick)
        logprob = tl.load(base + token).to(tl.float32) / temperature - log_norm
        tl.store(token_ptr + row, token.to(tl.int64))
        tl.store(logprob_ptr + row, logprob)


def sample_rows(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    greedy: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokens [rows] (int64) and their tempered logprobs [rows] (float32) for ``logits``
    [rows, vocab] (CUDA, ``kernel_available``): the module docstring's two kernels."""
    rows, vocab = logits.shape
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    chunks = triton.cdiv(vocab, CHUNK)
    on = {"device": logits.device}
    chunk_max = torch.empty(rows, chunks, dtype=torch.float32, **on)
    chunk_mass = torch.empty(rows, chunks, dtype=torch.float32, **on)
    chunk_best = torch.empty(rows, chunks, dtype=torch.float32, **on)
    chunk_best_at = torch.empty(rows, chunks, dtype=torch.int32, **on)
    tokens = torch.empty(rows, dtype=torch.int64, **on)
    logprobs = torch.empty(rows, dtype=torch.float32, **on)
    partials = (chunk_max, chunk_mass, chunk_best, chunk_best_at)
    _chunk_kernel[(rows, chunks)](
        logits,
        logits.stride(0),
        temperatures,
        *partials,
        vocab,
        chunks,
        CHUNK=CHUNK,
        num_warps=NUM_WARPS,
    )
    _pick_kernel[(rows,)](
        logits,
        logits.stride(0),
        temperatures,
        greedy,
        uniforms,
        *partials,
        tokens,
        logprobs,
        vocab,
        chunks,
        CHUNK=CHUNK,
        CHUNKS_POW2=triton.next_power_of_2(chunks),
        num_warps=NUM_WARPS,
    )
    return tokens, logprobs
