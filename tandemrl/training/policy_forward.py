"""The policy's forward pass as one module: a prepared micro-batch in, logprobs (and entropy) out.

``PolicyForward`` wraps the causal LM. For Qwen2/Qwen3/Llama/Mistral models (logits = a
bias-free lm_head of the last hidden state) it runs the base model and takes logprobs from the
hidden states through the chunked head (``logprob_head.head_logprobs``), only at the positions
``Micro.needed`` lists; other models take the full-logits path. Logprobs come from
``logits / temperature`` when the temperature is > 0 and not 1.

Why a module of its own: the LM head reads the tied embedding weight outside the base model's
forward. Under FSDP2 the unit that owns the embeddings, the final norm and the head must
gather them around everything that reads them, and that is one ``forward`` call of the root
unit. So the sharded worker makes this module its root unit; the unsharded worker calls it
the same way, and both compute the very same thing.

A vision-language model's micro-batch (``is_vlm``) carries its images in
``Micro.model_inputs`` (``pixel_values``, ``image_grid_thw``, the prompt mask and the 3-D
positions, prepared by the worker); the forward turns the token ids and the images' features
into the input embeddings with the wrapped model's own vision tower (``image_embeddings``),
inside the forward, so that the vision tower trains with the rest.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandemrl.models.vision import image_embeddings
from tandemrl.training.api import TrainBatch
from tandemrl.training.logprob_head import head_logprobs
from tandemrl.training.losses import token_entropy
from tandemrl.training.worker_common import autocast


@dataclasses.dataclass
class Micro:
    """One micro-batch on the device, with what the logprob head needs.

    ``needed``: the flat indices (into [b, l]) of the positions whose logprob is computed;
    ``targets``: the token at each; ``hidden_index``: the row of the model's flattened last
    hidden states that predicts each (one position earlier, in the packed sequence when the
    rows are packed). ``model_inputs``: what the model's forward takes: the padded
    ``input_ids`` with their attention mask (for right-padded rows the value that means plain
    causal attention, ``causal_mask.no_mask_argument``), or the packed sequence with its
    position ids and row boundaries.
    """

    batch: TrainBatch
    needed: torch.Tensor
    targets: torch.Tensor
    hidden_index: torch.Tensor
    model_inputs: dict[str, Any]


def sequence_logprobs(
    logits: torch.Tensor, input_ids: torch.Tensor, temperature: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(logprobs [B, L], scaled logits [B, L-1, V]) aligned with ``input_ids`` (entry 0 is 0).

    ``logits`` [B, L, V] are the model's raw outputs; position t-1 predicts token t.
    """
    scaled = logits[:, :-1].float()
    if temperature > 0 and temperature != 1.0:
        scaled = scaled / temperature
    targets = input_ids[:, 1:]
    picked = scaled.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(scaled, dim=-1)
    return F.pad(logprobs, (1, 0)), scaled


class PolicyForward(nn.Module):
    def __init__(
        self,
        lm: nn.Module,
        *,
        use_head_logprobs: bool,
        temperature: float,
        device: torch.device,
        autocast_dtype: torch.dtype | None,
        is_vlm: bool = False,
    ) -> None:
        super().__init__()
        self.lm = lm
        self.is_vlm = is_vlm
        self.use_head_logprobs = use_head_logprobs
        self.temperature = temperature
        self.device = device
        self.autocast_dtype = autocast_dtype

    def forward(self, micro: Micro, *, entropy: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(logprobs [b, l], entropy [b, l] or None); ``entropy``: "none", "metric" or "grad".

        Entries outside ``micro.needed`` are 0 on the head path (they are never a loss
        position); the full-logits path fills every position.
        """
        if not self.use_head_logprobs:
            return self._forward_logits(micro, entropy=entropy)
        input_ids = micro.batch["input_ids"]
        rows, length = input_ids.shape
        lm: Any = self.lm
        with autocast(self.device, self.autocast_dtype):
            hidden = lm.base_model(**self._call_inputs(micro), use_cache=False).last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, micro.hidden_index)
        compute_dtype = self.autocast_dtype or torch.float32
        logprobs, token_entropy_ = head_logprobs(
            hidden.to(compute_dtype),
            lm.get_output_embeddings().weight,
            micro.targets,
            temperature=self.temperature,
        )
        # Scattered into fresh [rows, length] tensors (index_put, not views of a flat one: a
        # view returned from an FSDP2 unit loses its backward hook to any in-place op).
        zeros = torch.zeros((rows, length), device=hidden.device, dtype=torch.float32)
        where = (micro.needed // length, micro.needed % length)
        logprobs = zeros.index_put(where, logprobs)
        if entropy == "none":
            return logprobs, None
        if entropy == "metric":
            token_entropy_ = token_entropy_.detach()
        return logprobs, zeros.index_put(where, token_entropy_)

    def _forward_logits(
        self, micro: Micro, *, entropy: str
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        with autocast(self.device, self.autocast_dtype):
            if self.is_vlm:
                inputs = self._call_inputs(micro)
            else:
                inputs = {
                    "input_ids": micro.batch["input_ids"],
                    "attention_mask": micro.batch["attention_mask"],
                }
            logits = self.lm(**inputs, use_cache=False).logits
        logprobs, scaled = sequence_logprobs(logits, micro.batch["input_ids"], self.temperature)
        if entropy == "none":
            return logprobs, None
        if entropy == "grad":
            return logprobs, F.pad(token_entropy(scaled), (1, 0))
        with torch.no_grad():
            return logprobs, F.pad(token_entropy(scaled.detach()), (1, 0))

    def _call_inputs(self, micro: Micro) -> dict[str, Any]:
        """What the wrapped model's forward takes: ``micro.model_inputs``; for a
        vision-language micro-batch, its token embeddings with the images' features."""
        if not self.is_vlm:
            return micro.model_inputs
        inputs = dict(micro.model_inputs)
        input_ids = inputs.pop("input_ids")
        inputs["inputs_embeds"] = image_embeddings(
            self.lm,
            input_ids,
            inputs.pop("image_prompt_mask"),
            inputs.pop("pixel_values"),
            inputs.pop("image_grid_thw"),
        )
        return inputs
