"""Training rows and train batches: build one row, collate rows into a batch, split a batch.

A *row* is one generation of a prompt group as the rollout manager writes it into the data
plane (see ``make_training_row``). ``collate_rows`` turns rows into the ``TrainBatch`` that
``tandemrl.training.api`` documents: every per-token field right-padded to the longest row,
per-sequence scalars stacked to ``[B]``, plus an ``attention_mask``. ``split_microbatches``
cuts a batch along the sequence axis.

Row fields (one sequence of ``P`` prompt and ``C`` completion tokens, ``T = P + C``):

- ``input_ids`` [T] int64: prompt then completion
- ``token_mask`` [T] float32: 1 at the ``C`` completion positions, 0 on the prompt
- ``generation_logprobs`` [T] float32: the generator's logprob of each completion token at
  its position (entry t is log p(input_ids[t] | input_ids[:t])), 0 on the prompt
- ``reward`` [] float32 and ``sample_mask`` [] float32 (0 excludes the row from the loss)
- optional, added by the advantage / value stages: ``advantages`` ([T], or [] for one value
  per sequence, broadcast over the completion), ``values`` [T], ``returns`` [T],
  ``prev_logprobs`` [T]

Any other field is carried along when every row has it: 0-d fields are stacked to [B], fields
of length T are right-padded with 0.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch.nn.utils.rnn import pad_sequence

from tandemrl.training.api import TrainBatch

# Fields every row must hold.
REQUIRED_ROW_KEYS = ("input_ids", "token_mask", "generation_logprobs", "reward", "sample_mask")
# Fields a row holds one value of (stacked to [B]).
SEQUENCE_KEYS = ("reward", "sample_mask")
# Per-sequence advantages may come as one scalar per row; it is broadcast over the completion.
BROADCASTABLE_KEYS = ("advantages",)


class BatchError(ValueError):
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
        raise BatchError(
            f"completion has {len(completion)} tokens but {len(logprobs)} logprobs; "
            "the generator must report one logprob per generated token"
        )
    if not prompt:
        raise BatchError("a training row needs at least one prompt token")
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


def make_group_rows(
    prompt_ids: Sequence[int],
    completions: Sequence[Sequence[int]],
    completion_logprobs: Sequence[Sequence[float]],
    rewards: Sequence[float],
    sample_masks: Sequence[float],
) -> list[dict[str, torch.Tensor]]:
    """The rows of one prompt group (same prompt), equal to ``make_training_row`` per sibling.

    When every completion has the same length — the common case, e.g. all hit
    ``max_new_tokens`` — each field is built once for the whole group and split into per-row
    views, a quarter of the tensor constructions of building the rows one by one.
    """
    lengths = {len(c) for c in completions}
    if len(lengths) != 1 or any(
        len(lp) != len(c) for lp, c in zip(completion_logprobs, completions, strict=True)
    ):
        return [
            make_training_row(prompt_ids, c, lp, reward=r, sample_mask=m)
            for c, lp, r, m in zip(
                completions, completion_logprobs, rewards, sample_masks, strict=True
            )
        ]
    prompt = list(prompt_ids)
    if not prompt:
        raise BatchError("a training row needs at least one prompt token")
    num_prompt, num_completion = len(prompt), lengths.pop()
    input_ids = torch.tensor([prompt + list(c) for c in completions], dtype=torch.long).unbind(0)
    padding = [0.0] * num_prompt
    logprobs = torch.tensor(
        [padding + list(lp) for lp in completion_logprobs], dtype=torch.float32
    ).unbind(0)
    token_mask = torch.tensor(padding + [1.0] * num_completion, dtype=torch.float32)
    reward = torch.tensor(list(rewards), dtype=torch.float32).unbind(0)
    sample_mask = torch.tensor(list(sample_masks), dtype=torch.float32).unbind(0)
    return [
        {
            "input_ids": input_ids[i],
            "token_mask": token_mask,  # identical for every sibling; rows never mutate it
            "generation_logprobs": logprobs[i],
            "reward": reward[i],
            "sample_mask": sample_mask[i],
        }
        for i in range(len(completions))
    ]


def _check_row(index: int, row: Mapping[str, torch.Tensor]) -> int:
    missing = [key for key in REQUIRED_ROW_KEYS if key not in row]
    if missing:
        raise BatchError(f"row {index} lacks required field(s) {missing}")
    input_ids = row["input_ids"]
    if input_ids.dim() != 1 or input_ids.numel() == 0:
        raise BatchError(
            f"row {index}: input_ids must be a non-empty 1-D tensor, got {tuple(input_ids.shape)}"
        )
    return input_ids.numel()


def collate_rows(rows: list[dict[str, torch.Tensor]], pad_token_id: int) -> TrainBatch:
    """Right-pad rows to the longest and stack them into a ``TrainBatch``.

    Produces ``attention_mask`` [B, L] int64 (1 on real tokens). ``input_ids`` is padded with
    ``pad_token_id``; every other per-token field with 0 (so padding is never a loss position).
    A scalar ``advantages`` is broadcast over the row's ``token_mask`` positions.
    """
    if not rows:
        raise BatchError("collate_rows needs at least one row")
    lengths = [_check_row(i, row) for i, row in enumerate(rows)]
    max_len = max(lengths)
    keys = set(rows[0])
    for i, row in enumerate(rows[1:], start=1):
        if set(row) != keys:
            raise BatchError(
                f"rows disagree on their fields: row 0 has {sorted(keys)}, "
                f"row {i} has {sorted(row)}"
            )

    batch: TrainBatch = {}
    for key in sorted(keys):
        values = [row[key] for row in rows]
        if key in SEQUENCE_KEYS or (
            key not in BROADCASTABLE_KEYS and all(v.dim() == 0 for v in values)
        ):
            if any(v.numel() != 1 for v in values):
                raise BatchError(f"field {key!r} must hold one value per row")
            scalars = (
                values if all(v.dim() == 0 for v in values) else [v.reshape(()) for v in values]
            )
            stacked = torch.stack(scalars)
            batch[key] = stacked if stacked.dtype == torch.float32 else stacked.to(torch.float32)
            continue
        if key in BROADCASTABLE_KEYS:
            values = [
                value.to(torch.float32) * rows[i]["token_mask"].to(torch.float32)
                if value.dim() == 0
                else value
                for i, value in enumerate(values)
            ]
        for i, (value, length) in enumerate(zip(values, lengths, strict=True)):
            if value.dim() != 1 or value.numel() != length:
                raise BatchError(
                    f"row {i}: field {key!r} has shape {tuple(value.shape)}, expected "
                    f"({length},) like its input_ids"
                )
        if key == "input_ids":
            batch[key] = pad_sequence(values, batch_first=True, padding_value=pad_token_id).long()
        else:
            batch[key] = pad_sequence(
                [v if v.dtype == torch.float32 else v.to(torch.float32) for v in values],
                batch_first=True,
                padding_value=0.0,
            )
    positions = torch.arange(max_len)
    batch["attention_mask"] = (positions[None, :] < torch.tensor(lengths)[:, None]).long()
    return batch


def batch_size(batch: TrainBatch) -> int:
    """Number of sequences (from ``input_ids``, or ``token_mask`` in loss-only batches)."""
    key = "input_ids" if "input_ids" in batch else "token_mask"
    return int(batch[key].shape[0])


def split_microbatches(batch: TrainBatch, micro_batch_size: int) -> list[TrainBatch]:
    """Cut ``batch`` into consecutive micro-batches of at most ``micro_batch_size`` sequences.

    Every tensor whose first dimension is the batch size is sliced; the slices are views.
    """
    if micro_batch_size < 1:
        raise BatchError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    size = batch_size(batch)
    for key, value in batch.items():
        if value.dim() == 0 or value.shape[0] != size:
            raise BatchError(
                f"field {key!r} has shape {tuple(value.shape)}; every batch field must have "
                f"the batch size {size} as its first dimension"
            )
    return [
        {key: value[start : start + micro_batch_size] for key, value in batch.items()}
        for start in range(0, size, micro_batch_size)
    ]


def trim_padding(batch: TrainBatch) -> TrainBatch:
    """Drop the trailing columns that are padding in every row (saves compute per micro-batch)."""
    length = int(batch["attention_mask"].sum(dim=1).max().item())
    full = batch["input_ids"].shape[1]
    if length == full:
        return batch
    return {
        key: value[:, :length] if value.dim() >= 2 and value.shape[1] == full else value
        for key, value in batch.items()
    }


def loss_mask(batch: TrainBatch) -> torch.Tensor:
    """[B, L] float: ``token_mask`` x ``sample_mask`` — the positions the losses train on."""
    return batch["token_mask"].to(torch.float32) * batch["sample_mask"].to(torch.float32)[:, None]


def count_loss_tokens(batch: TrainBatch) -> int:
    """Valid loss tokens of a batch: pass the sum over a whole step as ``step_num_tokens``."""
    return int(loss_mask(batch).sum().item())
