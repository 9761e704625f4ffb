"""What the trainer passes as ``attention_mask`` for rows that need plain causal attention.

Right-padded rows (real tokens first) and packed rows (``packing.py``) need no padding mask:
causal attention already keeps every real token away from the padding after it. Two ways to
say "no mask" to a transformers model, and which one a model takes:

- ``None`` works for every causal LM. transformers then checks ``position_ids`` for packed
  sequences (``find_packed_sequence_indices``), which reads a flag back from the device: one
  wait for the device at every forward.
- A per-layer-type mapping with ``None`` values (``{"full_attention": None}``) skips mask
  creation and that check altogether, but only models with hybrid-attention support take a
  mapping (Qwen2, Qwen3, Gemma, ...: their config lists ``layer_types``); Llama, Mistral,
  Phi-3 and the MoE models fail on it (``'dict' object has no attribute 'ndim'``), and a
  model with sliding-window layers needs a real mask for those.

``no_mask_argument`` picks the mapping only for a model whose config lists full-attention
layers only, and only after checking once, on a few tokens, that the model accepts it and
computes exactly what it computes with ``None``; every other model gets ``None``.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

FULL_ATTENTION_MAPPING = {"full_attention": None}
# Tokens of the one-off check (any ids inside the vocabulary will do).
_CHECK_TOKENS = 5


def no_mask_argument(model: torch.nn.Module) -> dict[str, None] | None:
    """The ``attention_mask`` value that means plain causal attention for ``model``."""
    layer_types = getattr(model.config, "layer_types", None)
    if not layer_types or set(layer_types) != {"full_attention"}:
        return None
    if not _mapping_matches_none(model):
        log.info(
            "%s takes no per-layer attention-mask mapping; right-padded rows run with "
            "attention_mask=None",
            type(model).__name__,
        )
        return None
    return FULL_ATTENTION_MAPPING


def _mapping_matches_none(model: torch.nn.Module) -> bool:
    parameter = next(model.parameters())
    vocab = int(model.get_input_embeddings().num_embeddings)
    input_ids = (torch.arange(_CHECK_TOKENS, device=parameter.device) % vocab).unsqueeze(0)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            plain = _last_hidden(model, input_ids, None)
            try:
                mapped = _last_hidden(model, input_ids, FULL_ATTENTION_MAPPING)
            except (AttributeError, KeyError, TypeError, ValueError) as exc:
                log.debug("attention-mask mapping refused by %s: %r", type(model).__name__, exc)
                return False
    finally:
        model.train(was_training)
    return mapped.shape == plain.shape and bool(torch.equal(mapped, plain))


def _last_hidden(model: torch.nn.Module, input_ids: torch.Tensor, mask: Any) -> torch.Tensor:
    return model.base_model(input_ids=input_ids, attention_mask=mask, use_cache=False)[0]
