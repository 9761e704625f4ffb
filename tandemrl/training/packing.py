"""Padding-free training micro-batches: the rows of a micro-batch packed into one sequence.

A right-padded micro-batch [b, l] wastes b * l - Σ len tokens of every matrix product (on the
H200 benchmark 32-row micro-batches ran 48 k padded tokens for 35 k real ones). Packed, the
micro-batch becomes one row of T = Σ len tokens::

    input_ids     [1, T]   the rows' real tokens, one after the other
    position_ids  [1, T]   0, 1, ..., len_0 - 1, 0, 1, ..., len_1 - 1, ...   (restart per row)
    cu_seqlens    [b + 1]  0, len_0, len_0 + len_1, ...   (int32, where each row starts)

and attention must not cross rows: a token attends causally within its own row only. That is
the ``tandemrl_packed`` attention function registered here with transformers'
``AttentionInterface``; a model switched to it (``use_packed_attention``) gets it in every
attention layer:

- called with ``packed_cu_seqlens`` (forwarded by the model's ``**kwargs`` from its forward
  call): variable-length causal attention. On CUDA this is torch's
  ``torch.nn.attention.varlen.varlen_attn`` (the flash kernel, one launch for all rows);
  elsewhere (CPU, or float32 on CUDA: the flash kernel takes half types only) a reference
  computation, scaled-dot-product attention under a block-diagonal causal mask, so that CPU
  tests check the packing logic against the padded forward;
- called without it (unpacked batches, e.g. left-padded rows): transformers' own SDPA path,
  unchanged, and its SDPA mask function builds the mask.

The mask function registered with it (``packed_or_sdpa_mask``) builds no mask when the caller
gives no padding mask: a packed call attends within rows through ``packed_cu_seqlens``, and a
model that takes no per-layer mask mapping (``causal_mask.py``) would otherwise have
transformers detect the restarting positions and build a [T, T] block mask that nothing reads.

Position ids restart per row, so the rotary embedding of every token equals the padded
forward's (where a right-padded row's token t sits at position t). Packing therefore needs
right-padded rows; ``pack_rows`` refuses others.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F

PACKED_ATTENTION = "tandemrl_packed"

# Model types whose attention layers take the attention function from transformers'
# AttentionInterface and their positions from position_ids, with full attention in every
# layer (Gemma's sliding-window layers are not). Packing also needs the chunked logprob head
# (logprob_head.SUPPORTED_MODEL_TYPES).
PACKABLE_MODEL_TYPES = frozenset({"qwen2", "qwen3", "llama", "mistral", "phi3", "qwen3_moe"})


def varlen_attention_available() -> bool:
    """True when this torch has ``torch.nn.attention.varlen.varlen_attn`` and a CUDA device."""
    if not torch.cuda.is_available():
        return False
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def packing_blocker(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot be trained on packed rows, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in PACKABLE_MODEL_TYPES:
        return f"model type {model_type!r} is not one of {sorted(PACKABLE_MODEL_TYPES)}"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        return (
            f"the model has {sorted(set(layer_types))} layers; packing supports full attention only"
        )
    # Models without per-layer types apply config.sliding_window in every layer.
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        return f"sliding-window attention (sliding_window={config.sliding_window})"
    if getattr(config, "attention_dropout", 0.0):
        return "the model uses attention dropout"
    return None


@dataclasses.dataclass
class PackedRows:
    """One micro-batch's rows as a single sequence (see the module docstring).

    ``offsets[r]``: where row r starts in the packed sequence, so the padded position (r, t)
    is packed position ``offsets[r] + t``.
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int
    offsets: torch.Tensor

    def packed_index(self, padded_index: torch.Tensor, padded_length: int) -> torch.Tensor:
        """Packed positions of flat indices ``r * padded_length + t`` into the padded [b, l]."""
        rows = torch.div(padded_index, padded_length, rounding_mode="floor")
        return self.offsets.index_select(0, rows) + (padded_index - rows * padded_length)

    def model_kwargs(self) -> dict[str, Any]:
        """What the model's forward takes besides ``input_ids`` to attend within rows."""
        return {
            "position_ids": self.position_ids,
            "packed_cu_seqlens": self.cu_seqlens,
            "packed_max_length": self.max_length,
        }

    def to(self, device: torch.device) -> PackedRows:
        return PackedRows(
            input_ids=self.input_ids.to(device, non_blocking=True),
            position_ids=self.position_ids.to(device, non_blocking=True),
            cu_seqlens=self.cu_seqlens.to(device, non_blocking=True),
            max_length=self.max_length,
            offsets=self.offsets.to(device, non_blocking=True),
        )


def pack_rows(input_ids: torch.Tensor, attention_mask: torch.Tensor) -> PackedRows:
    """Pack right-padded rows [b, l] (real tokens first) into one sequence; host tensors."""
    if input_ids.dim() != 2 or input_ids.shape != attention_mask.shape:
        raise ValueError(
            f"pack_rows takes input_ids and attention_mask of one [b, l] shape; got "
            f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
        )
    real = attention_mask != 0
    lengths = real.sum(dim=1)
    columns = torch.arange(input_ids.shape[1])
    if not torch.equal(real, columns.unsqueeze(0) < lengths.unsqueeze(1)):
        raise ValueError("pack_rows needs right-padded rows (every row's real tokens first)")
    if int(lengths.min()) <= 0:
        raise ValueError("pack_rows got a row without any real token")
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return PackedRows(
        input_ids=input_ids[real].unsqueeze(0),
        position_ids=columns.expand_as(input_ids)[real].unsqueeze(0),
        cu_seqlens=cu_seqlens,
        max_length=int(lengths.max()),
        offsets=cu_seqlens[:-1].long(),
    )


def split_packed(
    lengths: list[int], max_rows: int, max_tokens: int | None
) -> list[tuple[int, int]]:
    """(start, end) row ranges of consecutive micro-batches with at most ``max_rows`` rows and,
    when ``max_tokens`` is set, at most ``max_tokens`` real tokens (a longer row goes alone).
    Packed rows cost their real tokens, so the budget counts those, not rows x longest row."""
    bounds, start, tokens = [], 0, 0
    for index, length in enumerate(lengths):
        rows = index - start + 1
        over = max_tokens is not None and tokens + length > max_tokens
        if index > start and (rows > max_rows or over):
            bounds.append((start, index))
            start, tokens = index, 0
        tokens += length
    bounds.append((start, len(lengths)))
    return bounds


def _reference_varlen(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """[T, H, D] causal attention within each row, through a block-diagonal mask (any device)."""
    total = query.shape[0]
    positions = torch.arange(total, device=query.device)
    row_of = torch.searchsorted(cu_seqlens[1:].to(positions.dtype), positions, right=True)
    mask = (row_of.unsqueeze(1) == row_of.unsqueeze(0)) & (
        positions.unsqueeze(1) >= positions.unsqueeze(0)
    )
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key = key.repeat_interleave(groups, dim=1)
        value = value.repeat_interleave(groups, dim=1)
    out = F.scaled_dot_product_attention(
        query.transpose(0, 1),
        key.transpose(0, 1),
        value.transpose(0, 1),
        attn_mask=mask,
        scale=scale,
    )
    return out.transpose(0, 1)


def packed_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: [1, H, T, D] inputs, [1, T, H, D] output."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cu_seqlens = kwargs.pop("packed_cu_seqlens", None)
    max_length = kwargs.pop("packed_max_length", None)
    if cu_seqlens is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if query.shape[0] != 1 or sliding_window is not None or dropout:
        raise ValueError(
            "packed attention takes one packed row, no sliding window and no dropout; got "
            f"batch {query.shape[0]}, sliding_window {sliding_window}, dropout {dropout}"
        )
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [T, heads, D]
    dtype = q.dtype
    if q.is_cuda and torch.is_autocast_enabled("cuda"):
        # Under autocast the rotary embedding hands back float32 queries and keys (its
        # cos/sin follow the float32 residual stream); SDPA would cast them, a custom op
        # is not cast by autocast.
        dtype = torch.get_autocast_dtype("cuda")
    if q.is_cuda and dtype in (torch.float16, torch.bfloat16):
        from torch.nn.attention.varlen import varlen_attn  # the flash kernel: half types only

        q, k, v = (t.to(dtype) for t in (q, k, v))
        out = varlen_attn(
            q,
            k,
            v,
            cu_seqlens,
            cu_seqlens,
            max_length,
            max_length,
            scale=scale,
            window_size=(-1, 0),
        )
    else:
        out = _reference_varlen(q, k, v, cu_seqlens, scale)
    return out.unsqueeze(0), None


def packed_or_sdpa_mask(*, attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
    """transformers mask function of ``tandemrl_packed``: no mask without a padding mask
    (packed rows attend within rows by ``packed_cu_seqlens``; right-padded rows are plain
    causal), SDPA's mask for a padded batch (which attention then runs through SDPA)."""
    if attention_mask is None:
        return None
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(attention_mask=attention_mask, **kwargs)


def use_packed_attention(model: torch.nn.Module) -> None:
    """Register ``tandemrl_packed`` with transformers and switch ``model`` to it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    AttentionInterface.register(PACKED_ATTENTION, packed_attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_ATTENTION, packed_or_sdpa_mask)
    model.set_attn_implementation(PACKED_ATTENTION)
