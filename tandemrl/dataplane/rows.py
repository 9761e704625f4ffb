"""The training-row format: what a rollout writes into the data plane and training reads.

A *row* is one generation of a prompt group (see ``make_training_row``). The rollout manager
builds a whole group at once as a ``RowBlock`` (``make_group_block``: every field stacked over
the group, a handful of tensor constructions per group instead of five per row); training
collates rows into batches (``tandemrl.training.batch``). It lives with the data plane, below
both its writer (``rollout/``) and its reader (``training/``).

Row fields (one sequence of ``P`` prompt and ``C`` completion tokens, ``T = P + C``):

- ``input_ids`` [T] int64: prompt then completion
- ``token_mask`` [T] float32: 1 at the ``C`` completion positions, 0 on the prompt
- ``generation_logprobs`` [T] float32: the generator's logprob of each completion token at
  its position (entry t is log p(input_ids[t] | input_ids[:t])), 0 on the prompt
- ``reward`` [] float32 and ``sample_mask`` [] float32 (0 excludes the row from the loss)
- optional, added by the advantage / value stages: ``advantages`` ([T], or [] for one value
  per sequence, broadcast over the completion), ``values`` [T], ``returns`` [T],
  ``prev_logprobs`` [T]
- a vision-language prompt's processed images (``policy.is_vlm``): one field per processor
  output, named ``mm.<name>`` (``mm.pixel_values`` [patches, D] float32,
  ``mm.image_grid_thw`` [images, 3] int64), each of the prompt's own first dimension. A
  group's rows share its prompt, so a ``RowBlock`` holds them once, as shared fields; the
  data plane stores and snapshots them with the row like any other field, and collation
  pads them per row (``training.batch``).
"""

from __future__ import annotations

import struct
from array import array
from collections.abc import Mapping, Sequence
from functools import lru_cache

import torch

from tandemrl.dataplane.base import BUFFER_DTYPES, RowBlock

# Fields every row must hold.
REQUIRED_ROW_KEYS = ("input_ids", "token_mask", "generation_logprobs", "reward", "sample_mask")
# Prefix of the fields holding a prompt's processed images (``mm.pixel_values``, ...).
MULTIMODAL_PREFIX = "mm."


def multimodal_fields(image_inputs: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """A prompt's processor outputs as row fields (``mm.<name>``); {} for a text prompt."""
    if not image_inputs:
        return {}
    return {MULTIMODAL_PREFIX + name: tensor for name, tensor in image_inputs.items()}


class RowError(ValueError):
    """A row or batch does not have the shape the training contract requires."""


def make_training_row(
    prompt_ids: Sequence[int] | torch.Tensor,
    completion_ids: Sequence[int] | torch.Tensor,
    completion_logprobs: Sequence[float] | torch.Tensor,
    reward: float,
    sample_mask: float,
) -> dict[str, torch.Tensor]:
    """One training row from a prompt and its completion (see the module docstring for shapes).

    ``completion_logprobs`` holds one logprob per completion token, as ``GenerationResult``
    reports them; they are placed at the completion positions of ``generation_logprobs``.
    """
    # Plain lists in, one tensor constructor per field: this runs once per generated sequence
    # on the controller's event loop, so it stays lean.
    prompt = prompt_ids.tolist() if isinstance(prompt_ids, torch.Tensor) else list(prompt_ids)
    completion = (
        completion_ids.tolist()
        if isinstance(completion_ids, torch.Tensor)
        else list(completion_ids)
    )
    logprobs = (
        completion_logprobs.tolist()
        if isinstance(completion_logprobs, torch.Tensor)
        else list(completion_logprobs)
    )
    if len(logprobs) != len(completion):
        raise RowError(
            f"completion has {len(completion)} tokens but {len(logprobs)} logprobs; "
            "the generator must report one logprob per generated token"
        )
    if not prompt:
        raise RowError("a training row needs at least one prompt token")
    num_prompt, num_completion = len(prompt), len(completion)
    return {
        "input_ids": torch.tensor(prompt + completion, dtype=torch.long),
        "token_mask": torch.tensor(
            [0.0] * num_prompt + [1.0] * num_completion, dtype=torch.float32
        ),
        "generation_logprobs": torch.tensor([0.0] * num_prompt + logprobs, dtype=torch.float32),
        "reward": torch.tensor(float(reward), dtype=torch.float32),
        "sample_mask": torch.tensor(float(sample_mask), dtype=torch.float32),
    }


@lru_cache(maxsize=512)
def _group_token_mask(num_prompt: int, completion_lengths: tuple[int, ...]) -> array:
    """A group's flat [N * L] float32 token mask; shared by every block of that shape (read-only)."""
    width = num_prompt + max(completion_lengths)
    mask = array("f")
    for length in completion_lengths:
        mask.extend([0.0] * num_prompt + [1.0] * length + [0.0] * (width - num_prompt - length))
    return mask


@lru_cache(maxsize=256)
def _packer(typecode: str, count: int) -> struct.Struct:
    return struct.Struct(f"{count}{typecode}")


def _flat_buffer(typecode: str, values: Sequence[float]) -> array:
    """``array(typecode, values)``, converted by ``struct`` (about twice as fast as ``array``,
    which parses item by item); ``typecode`` is one of ``q`` and ``f``."""
    try:
        packed = _packer(typecode, len(values)).pack(*values)
    except struct.error as exc:
        raise RowError(
            f"a row value does not fit a {BUFFER_DTYPES[typecode]} buffer: {exc}"
        ) from exc
    return array(typecode, packed)


def make_group_block(
    sample_ids: Sequence[str],
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    completion_logprobs: Sequence[Sequence[float]],
    rewards: Sequence[float],
    sample_masks: Sequence[float],
    image_inputs: Mapping[str, torch.Tensor] | None = None,
) -> RowBlock:
    """One prompt group's rows as a ``RowBlock``; row ``i`` equals ``make_training_row``'s.

    Per-token fields are [N, P + longest completion] (right padded with 0), ``reward`` and
    ``sample_mask`` are [N]. The block holds flat buffers; no tensor is made until someone
    reads a field (collation concatenates the buffers of a whole chunk instead).
    ``image_inputs``: the prompt's processed images, shared by every row (``mm.<name>``).
    """
    count = len(sample_ids)
    if not (len(completions) == len(completion_logprobs) == len(rewards) == len(sample_masks)):
        raise RowError(
            f"group of {count} sample ids has {len(completions)} completions, "
            f"{len(completion_logprobs)} logprob lists, {len(rewards)} rewards and "
            f"{len(sample_masks)} sample masks; all must match"
        )
    if len(completions) != count:
        raise RowError(f"{count} sample ids for {len(completions)} completions")
    prompt = list(prompt_ids)
    if not prompt:
        raise RowError("a training row needs at least one prompt token")
    num_prompt = len(prompt)
    completion_lengths = tuple(map(len, completions))
    if tuple(map(len, completion_logprobs)) != completion_lengths:
        for length, completion_lp in zip(completion_lengths, completion_logprobs, strict=True):
            if len(completion_lp) != length:
                raise RowError(
                    f"completion has {length} tokens but {len(completion_lp)} logprobs; "
                    "the generator must report one logprob per generated token"
                )
    longest = max(completion_lengths)
    token_ids: list[int] = []
    logprobs: list[float] = []
    prompt_zeros = [0.0] * num_prompt
    for completion, completion_lp, length in zip(
        completions, completion_logprobs, completion_lengths, strict=True
    ):
        token_ids += prompt
        token_ids += completion
        logprobs += prompt_zeros
        logprobs += completion_lp
        if length < longest:
            token_ids += [0] * (longest - length)
            logprobs += [0.0] * (longest - length)
    return RowBlock.from_buffers(
        sample_ids,
        [num_prompt + length for length in completion_lengths],
        per_token={
            "input_ids": _flat_buffer("q", token_ids),
            "token_mask": _group_token_mask(num_prompt, completion_lengths),
            "generation_logprobs": _flat_buffer("f", logprobs),
        },
        per_row={
            "reward": _flat_buffer("f", rewards),
            "sample_mask": _flat_buffer("f", sample_masks),
        },
        shared=multimodal_fields(image_inputs),
    )
