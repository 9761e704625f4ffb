"""Token logprobs (and entropy) straight from the last hidden states, without full logits.

The plain path — ``model(...).logits`` then ``log_softmax(logits.float())`` — materialises a
float32 [tokens, vocab] tensor (vocab 151,936 for Qwen2: 10 GB for 16 k tokens) and walks it
in a dozen elementwise passes forward and backward. ``head_logprobs`` computes the same

    logprob_t = z_t[target_t] - logsumexp(z_t),   z_t = (h_t · Wᵀ) / temperature
    entropy_t = logsumexp(z_t) - Σ_v softmax(z_t)_v · z_t,v

for the selected positions only (the loss positions: prompt and padding rows never reach the
vocabulary matrix), in chunks of ``chunk_tokens`` rows:

- the product h · Wᵀ runs in the compute dtype (bf16 under autocast) and is the only
  [tokens, vocab] tensor kept for backward (in that dtype: the same bytes as the bf16 logits
  the model itself would return);
- the reductions (logsumexp, gather, Σ p·z) read it once and accumulate in float32;
- backward forms dL/dz = g_lp · (onehot - p) - g_H · p · (log p + H) (times 1/temperature)
  in one pass and feeds the two products dh = dz · W and dW = dzᵀ · h.

On CUDA the two elementwise passes are compiled with ``torch.compile`` (each becomes one
fused reduction / pointwise kernel); elsewhere they run eagerly, as the same Python
functions, so CPU tests check exactly the math the GPU runs.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)

# Rows per chunk: bounds the float32 temporaries of the eager path ([chunk, vocab] each).
DEFAULT_CHUNK_TOKENS = 4096

# Causal-LM classes whose logits are exactly lm_head(final hidden states): no bias, soft-cap
# or logit scale (Gemma 3's soft-cap is checked below; Gemma 2's is on by default). Other
# models keep the plain logits path. tests/unit/test_model_matrix.py checks each against it.
SUPPORTED_MODEL_TYPES = frozenset(
    {"qwen2", "qwen3", "llama", "mistral", "phi3", "qwen3_moe", "gemma3_text"}
    # Qwen2-VL / Qwen2.5-VL: lm_head of the language model's last hidden state, which their
    # base model (vision tower + language model) returns (tests/unit/test_vlm.py).
    | {"qwen2_vl", "qwen2_5_vl"}
)


def supports_head_logprobs(model: torch.nn.Module) -> bool:
    """True when ``model``'s logits are ``lm_head(base_model(...).last_hidden_state)``."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in SUPPORTED_MODEL_TYPES:
        return False
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear) or head.bias is not None:
        return False
    for attribute in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attribute, None) is not None:
            return False
    return True


def _head_reduce(
    logits: torch.Tensor, targets: torch.Tensor, inv_temperature: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logsumexp, logprob of target, entropy), each [rows] float32, of ``logits`` / T."""
    scaled = logits.float() * inv_temperature
    lse = torch.logsumexp(scaled, dim=-1)
    picked = scaled.gather(1, targets.unsqueeze(1)).squeeze(1)
    probs = torch.exp(scaled - lse.unsqueeze(1))
    entropy = lse - (probs * scaled).sum(dim=-1)
    return lse, picked - lse, entropy


def _head_grad(
    logits: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor,
    grad_entropy: torch.Tensor,
    inv_temperature: float,
) -> torch.Tensor:
    """dL/dlogits [rows, vocab] in ``logits.dtype`` (see the module docstring)."""
    scaled = logits.float() * inv_temperature
    log_probs = scaled - lse.unsqueeze(1)
    probs = torch.exp(log_probs)
    columns = torch.arange(logits.shape[1], device=logits.device)
    onehot = (columns.unsqueeze(0) == targets.unsqueeze(1)).float()
    grad = grad_logprobs.unsqueeze(1) * (onehot - probs) - grad_entropy.unsqueeze(1) * probs * (
        log_probs + entropy.unsqueeze(1)
    )
    return (grad * inv_temperature).to(logits.dtype)


_KERNELS: dict[str, Callable[..., Any]] = {}
# Set to False to run the eager passes on CUDA too (benchmarks compare both; a platform whose
# compiler stack is broken can fall back).
COMPILE_ON_CUDA = True
# Compile the passes for the model's vocabulary size (only the row count is symbolic), so
# inductor knows every row's length and alignment; False: every size symbolic (one kernel for
# any vocabulary, as before; benchmarks compare both).
STATIC_VOCAB = True


def _kernels(device: torch.device) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The reduce / grad passes: compiled once per process on CUDA, eager elsewhere."""
    if device.type != "cuda" or not COMPILE_ON_CUDA:
        return _head_reduce, _head_grad
    if not _KERNELS:
        dynamic = None if STATIC_VOCAB else True
        _KERNELS["reduce"] = torch.compile(_head_reduce, dynamic=dynamic)
        _KERNELS["grad"] = torch.compile(_head_grad, dynamic=dynamic)
    return _KERNELS["reduce"], _KERNELS["grad"]


def _rows_dynamic(*tensors: torch.Tensor) -> None:
    """Mark the row dimension symbolic, so chunks of any row count share one compiled kernel
    (the vocabulary size stays a constant when STATIC_VOCAB)."""
    for tensor in tensors:
        torch._dynamo.maybe_mark_dynamic(tensor, 0)


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        inv_temperature: float,
        chunk_tokens: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reduce, _ = _kernels(hidden.device)
        weight_c = weight.to(hidden.dtype)
        rows = hidden.shape[0]
        logits = hidden.new_empty(rows, weight.shape[0])
        lse = torch.empty(rows, device=hidden.device, dtype=torch.float32)
        logprobs = torch.empty_like(lse)
        entropy = torch.empty_like(lse)
        for start in range(0, rows, chunk_tokens):
            end = min(rows, start + chunk_tokens)
            torch.mm(hidden[start:end], weight_c.t(), out=logits[start:end])
            chunk_logits, chunk_targets = logits[start:end], targets[start:end]
            _rows_dynamic(chunk_logits, chunk_targets)
            lse[start:end], logprobs[start:end], entropy[start:end] = reduce(
                chunk_logits, chunk_targets, inv_temperature
            )
        ctx.save_for_backward(hidden, weight, targets, logits, lse, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.chunk_tokens = chunk_tokens
        return logprobs, entropy

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, logits, lse, entropy = ctx.saved_tensors
        _, grad_kernel = _kernels(hidden.device)
        if grad_logprobs is None:
            grad_logprobs = torch.zeros_like(lse)
        if grad_entropy is None:
            grad_entropy = torch.zeros_like(lse)
        weight_c = weight.to(hidden.dtype)
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = (
            torch.zeros(weight.shape, device=weight.device, dtype=torch.float32)
            if ctx.needs_input_grad[1]
            else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = min(hidden.shape[0], start + ctx.chunk_tokens)
            chunk = (
                logits[start:end],
                targets[start:end],
                lse[start:end],
                entropy[start:end],
                grad_logprobs[start:end].float(),
                grad_entropy[start:end].float(),
            )
            _rows_dynamic(*chunk)
            grad_logits = grad_kernel(*chunk, ctx.inv_temperature)
            if grad_hidden is not None:
                torch.mm(grad_logits, weight_c, out=grad_hidden[start:end])
            if grad_weight is not None:
                grad_weight += (grad_logits.t() @ hidden[start:end]).float()
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def head_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    temperature: float,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [rows], entropy [rows]) float32 of ``targets`` under ``hidden`` · ``weight``ᵀ.

    ``hidden`` [rows, H] in the compute dtype (bf16 under mixed precision, else float32);
    ``weight`` [V, H] the output embedding (any dtype; cast once to ``hidden``'s);
    ``temperature`` > 0 divides the logits (0 or 1: raw logits). Both outputs are
    differentiable with respect to ``hidden`` and ``weight``.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"head_logprobs takes hidden [rows, H] and targets [rows]; got {tuple(hidden.shape)} "
            f"and {tuple(targets.shape)}"
        )
    if chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be positive, got {chunk_tokens}")
    inv_temperature = 1.0 / temperature if temperature > 0 else 1.0
    with torch.autocast(device_type=hidden.device.type, enabled=False):
        return _HeadLogprobs.apply(hidden, weight, targets, inv_temperature, chunk_tokens)
