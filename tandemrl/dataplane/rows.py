"""The training-row format: what a rollout writes into the data plane and training reads.

A *row* is one training sequence of a prompt group: one generation (see
``make_training_row``), or, for an agent episode, its turns merged into one sequence. The
rollout manager builds a whole group at once as a ``RowBlock``: ``make_group_block`` for
single-turn groups (every row the shared prompt plus its completion; a handful of tensor
constructions per group instead of five per row), ``make_sequence_block`` for rows of any
shape (agent episodes: each row its own tokens and its own loss mask, rows of one group of
different lengths and prompts). Training collates rows into batches
(``tandemrl.training.batch``), reading the loss positions from ``token_mask`` alone. It lives
with the data plane, below both its writer (``rollout/``) and its reader (``training/``).

Row fields (one sequence of ``T`` tokens; a single-turn row is ``P`` prompt then ``C``
completion tokens, ``T = P + C``):

- ``input_ids`` [T] int64: the sequence (prompt then completion)
- ``token_mask`` [T] float32: 1 at the positions of tokens the engine sampled (the loss
  positions), 0 elsewhere: the prompt, and in an agent row the tokens between turns (tool
  and environment messages, template markers); a single-turn row is 0 on its ``P`` prompt
  positions and 1 on its ``C`` completion positions
- ``generation_logprobs`` [T] float32: the generator's logprob of each sampled token at its
  position (entry t is log p(input_ids[t] | input_ids[:t])), 0 where ``token_mask`` is 0
- ``reward`` [] float32 and ``sample_mask`` [] float32 (0 excludes the row from the loss)
- on-policy distillation: ``teacher_index`` [] int16, which teacher serves the row (its index
  in ``on_policy_distillation.teachers``); when the teachers score in the rollout pump also
  ``teacher_logprobs`` [T] float32, that teacher's logprob of each completion token at its
  position (as ``generation_logprobs``), 0 on the prompt
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


# On-policy distillation: the per-token field of the teacher's logprobs, and the per-row
# field of the serving teacher's index.
TEACHER_LOGPROBS = "teacher_logprobs"
TEACHER_INDEX = "teacher_index"


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
    teacher_index: int | None = None,
    teacher_logprobs: Sequence[Sequence[float]] | None = None,
    image_inputs: Mapping[str, torch.Tensor] | None = None,
) -> RowBlock:
    """One prompt group's rows as a ``RowBlock``; row ``i`` equals ``make_training_row``'s
    (plus, when given, ``teacher_index`` on every row and ``teacher_logprobs``: one list per
    completion, as its logprobs).

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
    per_token = {
        "input_ids": _flat_buffer("q", token_ids),
        "token_mask": _group_token_mask(num_prompt, completion_lengths),
        "generation_logprobs": _flat_buffer("f", logprobs),
    }
    if teacher_logprobs is not None:
        per_token[TEACHER_LOGPROBS] = _flat_buffer(
            "f",
            _padded_completion_values(num_prompt, longest, completion_lengths, teacher_logprobs),
        )
    per_row = {
        "reward": _flat_buffer("f", rewards),
        "sample_mask": _flat_buffer("f", sample_masks),
    }
    if teacher_index is not None:
        per_row[TEACHER_INDEX] = array("h", [teacher_index] * count)
    return RowBlock.from_buffers(
        sample_ids,
        [num_prompt + length for length in completion_lengths],
        per_token=per_token,
        per_row=per_row,
        shared=multimodal_fields(image_inputs),
    )


def make_sequence_block(
    sample_ids: Sequence[str],
    input_ids: Sequence[Sequence[int]],
    token_masks: Sequence[Sequence[float]],
    logprobs: Sequence[Sequence[float]],
    rewards: Sequence[float],
    sample_masks: Sequence[float],
) -> RowBlock:
    """Rows of any shape as one ``RowBlock``: row ``i`` is ``input_ids[i]`` with its own
    ``token_masks[i]`` and ``logprobs[i]`` (one entry per token; a logprob where the mask is 0
    must be 0). Per-token fields are [N, longest row] (right padded with 0)."""
    count = len(sample_ids)
    if not (
        len(input_ids)
        == len(token_masks)
        == len(logprobs)
        == len(rewards)
        == len(sample_masks)
        == count
    ):
        raise RowError(
            f"{count} sample ids for {len(input_ids)} token lists, {len(token_masks)} masks, "
            f"{len(logprobs)} logprob lists, {len(rewards)} rewards and {len(sample_masks)} "
            "sample masks; all must match"
        )
    lengths = [len(ids) for ids in input_ids]
    for sample_id, length, mask, row_logprobs in zip(
        sample_ids, lengths, token_masks, logprobs, strict=True
    ):
        if length == 0:
            raise RowError(f"row {sample_id!r} has no tokens")
        if len(mask) != length or len(row_logprobs) != length:
            raise RowError(
                f"row {sample_id!r} has {length} tokens, {len(mask)} mask entries and "
                f"{len(row_logprobs)} logprobs; every per-token field needs one per token"
            )
        if mask[0]:
            raise RowError(f"row {sample_id!r}: its first token cannot be a loss position")
        if any(lp != 0.0 for lp, m in zip(row_logprobs, mask, strict=True) if not m):
            raise RowError(f"row {sample_id!r} has a logprob where its token_mask is 0")
    width = max(lengths)
    flat_ids: list[int] = []
    flat_mask: list[float] = []
    flat_logprobs: list[float] = []
    for ids, mask, row_logprobs, length in zip(
        input_ids, token_masks, logprobs, lengths, strict=True
    ):
        flat_ids += ids
        flat_mask += mask
        flat_logprobs += row_logprobs
        if length < width:
            flat_ids += [0] * (width - length)
            flat_mask += [0.0] * (width - length)
            flat_logprobs += [0.0] * (width - length)
    return RowBlock.from_buffers(
        sample_ids,
        lengths,
        per_token={
            "input_ids": _flat_buffer("q", flat_ids),
            "token_mask": _flat_buffer("f", flat_mask),
            "generation_logprobs": _flat_buffer("f", flat_logprobs),
        },
        per_row={
            "reward": _flat_buffer("f", rewards),
            "sample_mask": _flat_buffer("f", sample_masks),
        },
    )


def _padded_completion_values(
    num_prompt: int,
    longest: int,
    completion_lengths: Sequence[int],
    values: Sequence[Sequence[float]],
) -> list[float]:
    """Per-completion-token values laid out like ``generation_logprobs`` (0 on the prompt and
    the padding), flat over the group."""
    if len(values) != len(completion_lengths):
        raise RowError(
            f"{len(values)} teacher logprob lists for {len(completion_lengths)} completions"
        )
    flat: list[float] = []
    prompt_zeros = [0.0] * num_prompt
    for length, row_values in zip(completion_lengths, values, strict=True):
        if len(row_values) != length:
            raise RowError(
                f"completion has {length} tokens but {len(row_values)} teacher logprobs; a "
                "teacher must score every completion token"
            )
        flat += prompt_zeros
        flat += row_values
        flat += [0.0] * (longest - length)
    return flat
