"""Train batches: collate training rows into a batch, split a batch, count its loss tokens.

Rows have the format ``tandemrl.dataplane.rows`` defines (one generation of a prompt group).
``collate_rows`` turns rows into the ``TrainBatch`` that ``tandemrl.training.api`` documents:
every per-token field right-padded to the longest row, per-sequence scalars stacked to ``[B]``,
plus an ``attention_mask``. When the rows are whole blocks in order (what the local data plane
hands out for committed groups), it concatenates the blocks instead of padding row by row; the
batch is the same either way. ``split_microbatches`` cuts a batch along the sequence axis.

Any field beyond the required ones is carried along when every row has it: 0-d fields are
stacked to [B], fields of length T are right-padded with 0.

A vision-language row's image fields (``mm.<name>``, each of its prompt's own first
dimension: patches, images) become ``mm.<name>`` [B, longest, ...] padded with 0 plus
``mm_count.<name>`` [B] int64, each row's own count, so that every batch field keeps the batch
as its first dimension (micro-batches, sorting and slicing cut them like any other field);
``multimodal_inputs`` joins a micro-batch's rows back into the processor's layout (the rows'
tensors one after the other), which is what the model's forward takes.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from tandemrl.dataplane.base import BUFFER_DTYPES, BlockRow, RowBlock
from tandemrl.dataplane.rows import MULTIMODAL_PREFIX, REQUIRED_ROW_KEYS, RowError
from tandemrl.training.api import TrainBatch

# Fields a row holds one value of (stacked to [B]).
SEQUENCE_KEYS = ("reward", "sample_mask")
# Per-sequence advantages may come as one scalar per row; it is broadcast over the completion.
BROADCASTABLE_KEYS = ("advantages",)

# A bad batch breaks the same contract as a bad row: one error for both.
BatchError = RowError
# Batch fields holding each row's count of a multimodal field (module docstring).
MULTIMODAL_COUNT_PREFIX = "mm_count."


def is_multimodal_key(key: str) -> bool:
    return key.startswith((MULTIMODAL_PREFIX, MULTIMODAL_COUNT_PREFIX))


def _collate_multimodal(
    rows: Sequence[Mapping[str, torch.Tensor]], keys: list[str]
) -> dict[str, torch.Tensor]:
    """``mm.<name>`` [B, longest, ...] (0-padded) and ``mm_count.<name>`` [B] per key."""
    batch: dict[str, torch.Tensor] = {}
    for key in keys:
        for index, row in enumerate(rows):
            if key not in row:
                raise BatchError(f"rows disagree on their fields: row {index} lacks {key!r}")
        values = [row[key] for row in rows]
        trailing = values[0].shape[1:]
        for index, value in enumerate(values):
            if value.dim() == 0 or value.shape[1:] != trailing or value.dtype != values[0].dtype:
                raise BatchError(
                    f"row {index}: field {key!r} has shape {tuple(value.shape)} "
                    f"({value.dtype}); every row's must be [count, {', '.join(map(str, trailing))}]"
                    f" ({values[0].dtype})"
                )
        counts = [value.shape[0] for value in values]
        padded = values[0].new_zeros((len(values), max(counts), *trailing))
        for index, value in enumerate(values):
            padded[index, : counts[index]] = value
        batch[key] = padded
        batch[MULTIMODAL_COUNT_PREFIX + key.removeprefix(MULTIMODAL_PREFIX)] = torch.tensor(
            counts, dtype=torch.long
        )
    return batch


def multimodal_inputs(batch: TrainBatch) -> dict[str, torch.Tensor]:
    """The model's image inputs of a (micro-)batch: each ``mm.<name>`` with every row's own
    entries joined in row order (``pixel_values`` [patches, D], ``image_grid_thw`` [images,
    3]); {} for a text batch."""
    inputs = {}
    for key, padded in batch.items():
        if not key.startswith(MULTIMODAL_PREFIX):
            continue
        name = key.removeprefix(MULTIMODAL_PREFIX)
        counts = batch[MULTIMODAL_COUNT_PREFIX + name].tolist()
        inputs[name] = torch.cat([padded[row, :count] for row, count in enumerate(counts)])
    return inputs


def _whole_blocks(rows: Sequence[Mapping[str, torch.Tensor]]) -> list[RowBlock] | None:
    """The blocks ``rows`` consist of, when they are whole blocks in block order; else None."""
    blocks: list[RowBlock] = []
    block: RowBlock | None = None
    next_index = size = 0
    for row in rows:
        if type(row) is not BlockRow:
            return None
        if next_index == 0:  # a block must start here
            if row.index != 0:
                return None
            block = row.block
            blocks.append(block)
            size = len(block.sample_ids)
        elif row.block is not block or row.index != next_index:
            return None
        next_index = 0 if next_index + 1 == size else next_index + 1
    return blocks if next_index == 0 else None


def _collate_blocks(blocks: list[RowBlock], pad_token_id: int) -> TrainBatch:
    """``collate_rows`` for rows that are whole blocks: concatenate instead of padding rows."""
    first_names = [name for name in blocks[0].field_names if not is_multimodal_key(name)]
    keys = set(first_names)
    missing = [key for key in REQUIRED_ROW_KEYS if key not in keys]
    if missing:
        raise BatchError(f"row 0 lacks required field(s) {missing}")
    for block in blocks[1:]:
        names = [name for name in block.field_names if not is_multimodal_key(name)]
        if names != first_names and set(names) != keys:
            raise BatchError(
                f"rows disagree on their fields: row 0 has {sorted(keys)}, "
                f"row {block.sample_ids[0]!r} has {sorted(block.field_names)}"
            )
    lengths = [length for block in blocks for length in block.lengths]
    max_len = max([block.width for block in blocks])
    columns = _joined_buffers(blocks, max_len) or _joined_tensors(blocks, max_len)
    token_mask = columns["token_mask"]
    batch: TrainBatch = {}
    for key in sorted(keys):
        value = columns[key]
        if value.dim() == 1:
            if key in BROADCASTABLE_KEYS:
                value = value.to(torch.float32)[:, None] * token_mask.to(torch.float32)
        elif key in SEQUENCE_KEYS:
            raise BatchError(f"field {key!r} must hold one value per row")
        if key == "input_ids":
            batch[key] = value if value.dtype == torch.long else value.long()
        else:
            batch[key] = value if value.dtype == torch.float32 else value.to(torch.float32)
    if min(lengths) == max_len:  # no padding anywhere (one tensor instead of three)
        attention_mask = torch.ones((len(lengths), max_len), dtype=torch.long)
    else:
        attention_mask = (torch.arange(max_len)[None, :] < torch.tensor(lengths)[:, None]).long()
        if pad_token_id != 0:
            batch["input_ids"] = batch["input_ids"].masked_fill(attention_mask == 0, pad_token_id)
    batch["attention_mask"] = attention_mask
    return batch


def _joined_tensors(blocks: list[RowBlock], max_len: int) -> dict[str, torch.Tensor]:
    """Each field of the blocks concatenated along rows (per-token fields padded to max_len)."""
    joined = {}
    for key in blocks[0].fields:
        parts = [block.fields[key] for block in blocks]
        if parts[0].dim() == 2:
            parts = [
                part if part.shape[1] == max_len else F.pad(part, (0, max_len - part.shape[1]))
                for part in parts
            ]
        joined[key] = torch.cat(parts)  # a fresh tensor even for one block: never aliases rows
    return joined


def _joined_buffers(blocks: list[RowBlock], max_len: int) -> dict[str, torch.Tensor] | None:
    """``_joined_tensors`` for blocks built from buffers, with one tensor per field; None when
    a block holds tensors or the blocks disagree on a field's kind or type."""
    first = blocks[0]
    if first.per_token_buffers is None or first.per_row_buffers is None:
        return None
    layout = _buffer_layout(first)
    for block in blocks[1:]:
        if block.per_token_buffers is None or _buffer_layout(block) != layout:
            return None
    count = sum(len(block.sample_ids) for block in blocks)
    joined = {}
    for key, buffer in first.per_row_buffers.items():
        column = array(buffer.typecode)
        for block in blocks:
            column += block.per_row_buffers[key]  # type: ignore[index]
        joined[key] = torch.frombuffer(column, dtype=BUFFER_DTYPES[buffer.typecode])
    for key, buffer in first.per_token_buffers.items():
        column = array(buffer.typecode)
        for block in blocks:
            part, width = block.per_token_buffers[key], block.width
            if width == max_len:
                column += part
                continue
            padding = array(buffer.typecode, [0]) * (max_len - width)
            for start in range(0, len(part), width):
                column += part[start : start + width]
                column += padding
        joined[key] = torch.frombuffer(column, dtype=BUFFER_DTYPES[buffer.typecode]).view(
            count, max_len
        )
    return joined


def _buffer_layout(block: RowBlock) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    assert block.per_token_buffers is not None and block.per_row_buffers is not None
    return (
        [(key, buffer.typecode) for key, buffer in block.per_token_buffers.items()],
        [(key, buffer.typecode) for key, buffer in block.per_row_buffers.items()],
    )


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


def collate_rows(rows: Sequence[Mapping[str, torch.Tensor]], pad_token_id: int) -> TrainBatch:
    """Right-pad rows to the longest and stack them into a ``TrainBatch``.

    Produces ``attention_mask`` [B, L] int64 (1 on real tokens). ``input_ids`` is padded with
    ``pad_token_id``; every other per-token field with 0 (so padding is never a loss position).
    A scalar ``advantages`` is broadcast over the row's ``token_mask`` positions.
    """
    if not rows:
        raise BatchError("collate_rows needs at least one row")
    multimodal_keys = sorted(key for key in rows[0] if key.startswith(MULTIMODAL_PREFIX))
    multimodal = _collate_multimodal(rows, multimodal_keys) if multimodal_keys else {}
    blocks = _whole_blocks(rows)
    if blocks is not None:
        batch = _collate_blocks(blocks, pad_token_id)
        batch.update(multimodal)
        return batch
    lengths = [_check_row(i, row) for i, row in enumerate(rows)]
    max_len = max(lengths)
    keys = set(rows[0])
    for i, row in enumerate(rows[1:], start=1):
        if set(row) != keys:
            raise BatchError(
                f"rows disagree on their fields: row 0 has {sorted(keys)}, "
                f"row {i} has {sorted(row)}"
            )

    batch: TrainBatch = dict(multimodal)
    for key in sorted(keys - set(multimodal_keys)):
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
        key: value[:, :length]
        if value.dim() >= 2 and value.shape[1] == full and not is_multimodal_key(key)
        else value
        for key, value in batch.items()
    }


def loss_mask(batch: TrainBatch) -> torch.Tensor:
    """[B, L] float: ``token_mask`` x ``sample_mask`` — the positions the losses train on."""
    return batch["token_mask"].to(torch.float32) * batch["sample_mask"].to(torch.float32)[:, None]


def count_loss_tokens(batch: TrainBatch) -> int:
    """Valid loss tokens of a batch: pass the sum over a whole step as ``step_num_tokens``."""
    return int(loss_mask(batch).sum().item())
