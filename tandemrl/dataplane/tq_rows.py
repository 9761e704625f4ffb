"""Rows <-> TransferQueue batches: the encoding the ``simple`` data plane puts on the wire.

TransferQueue stores one value per (sample, field) and hands a batch back as a ``TensorDict``
whose columns it re-packs on every get: 0-d values are stacked, everything else becomes a
jagged (or strided) nested tensor, whatever shape the rows were put with. So the shapes and
dtypes a row was put with cannot be read back from the batch; they travel as the row's tag
(TransferQueue's per-sample ``custom_meta``), and ``unpack_rows`` rebuilds each row from it:

    tag = {"tandemrl_row": {"key": sample_id, "fields": {field: [dtype, [dim, ...]]}}}

Encoding a batch (``pack_rows``): rows are grouped so that one group has the same fields with
the same dtypes (a nested tensor holds one dtype). In a group, a field whose rows all have one
shape is stacked into a dense ``[B, *shape]`` column; a field whose shapes differ is flattened
per row and sent as a jagged nested tensor of 1-D rows. Decoding reshapes to the tagged shape,
checks the dtype, and copies a row out when it is only a view into a larger received buffer,
so that a row never keeps a whole batch's memory alive (or drags it into a ``torch.save``).

Pure functions; no Ray, no sockets (unit-tested without either).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandemrl.dataplane.base import DataPlaneError, Row

if TYPE_CHECKING:  # tensordict comes with TransferQueue, an optional extra
    from tensordict import TensorDict

TAG_NAME = "tandemrl_row"

# torch dtypes a row may carry, by the name written into tags (and snapshot manifests).
_DTYPES: dict[str, torch.dtype] = {
    str(dtype).removeprefix("torch."): dtype
    for dtype in (
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.complex64,
        torch.complex128,
    )
}


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise DataPlaneError(
            f"simple data plane: dtype {dtype} is not supported "
            f"(supported: {', '.join(sorted(_DTYPES))})"
        )
    return name


def dtype_from_name(name: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise DataPlaneError(f"simple data plane: unknown dtype name {name!r}") from None


@dataclass(frozen=True)
class PackedGroup:
    """One TransferQueue put: sample ids, their tags, and the batch of columns."""

    keys: list[str]
    tags: list[dict[str, Any]]
    batch: TensorDict


def check_row(call: str, sample_id: Any, row: Any) -> None:
    """Refuse a row the plane cannot store, naming the sample id and field."""
    if not isinstance(sample_id, str) or not sample_id:
        raise DataPlaneError(
            f"simple data plane {call}: sample id must be a non-empty str, got {sample_id!r}"
        )
    if not isinstance(row, Mapping) or not row:
        raise DataPlaneError(
            f"simple data plane {call}: row {sample_id!r} must be a non-empty mapping of "
            f"field -> tensor, got {row!r:.80}"
        )
    for field, value in row.items():
        if not isinstance(field, str) or not field:
            raise DataPlaneError(
                f"simple data plane {call}: row {sample_id!r} has field name {field!r}"
            )
        if not isinstance(value, torch.Tensor) or value.is_nested or value.layout != torch.strided:
            raise DataPlaneError(
                f"simple data plane {call}: row {sample_id!r} field {field!r} must be a dense "
                f"torch.Tensor, got {type(value).__name__}"
            )
        dtype_name(value.dtype)


def row_tag(sample_id: str, row: Row) -> dict[str, Any]:
    fields = {field: [dtype_name(t.dtype), list(t.shape)] for field, t in row.items()}
    return {TAG_NAME: {"key": sample_id, "fields": fields}}


def tag_fields(
    tag: Mapping[str, Any] | None,
) -> dict[str, tuple[torch.dtype, tuple[int, ...]]] | None:
    """The ``{field: (dtype, shape)}`` a tag records, or None when it is not one of ours."""
    if not tag or TAG_NAME not in tag:
        return None
    entry = tag[TAG_NAME]
    return {
        field: (dtype_from_name(spec[0]), tuple(int(d) for d in spec[1]))
        for field, spec in entry["fields"].items()
    }


def tag_key(tag: Mapping[str, Any] | None) -> str | None:
    if not tag or TAG_NAME not in tag:
        return None
    return str(tag[TAG_NAME]["key"])


def pack_rows(rows: Mapping[str, Row]) -> list[PackedGroup]:
    """Group rows by (field, dtype) signature and build one TransferQueue batch per group."""
    from tensordict import TensorDict

    groups: dict[tuple[tuple[str, str], ...], list[str]] = {}
    for sample_id, row in rows.items():
        signature = tuple(sorted((field, dtype_name(t.dtype)) for field, t in row.items()))
        groups.setdefault(signature, []).append(sample_id)

    packed: list[PackedGroup] = []
    for signature, keys in groups.items():
        columns: dict[str, torch.Tensor] = {}
        for field, _ in signature:
            values = [rows[key][field].detach().to("cpu") for key in keys]
            first_shape = values[0].shape
            if all(v.shape == first_shape for v in values):
                columns[field] = torch.stack(values)
            else:
                columns[field] = torch.nested.as_nested_tensor(
                    [v.contiguous().reshape(-1) for v in values], layout=torch.jagged
                )
        batch = TensorDict(columns, batch_size=[len(keys)])
        tags = [row_tag(key, rows[key]) for key in keys]
        packed.append(PackedGroup(keys=keys, tags=tags, batch=batch))
    return packed


def _column_rows(column: Any, count: int) -> list[Any]:
    if isinstance(column, torch.Tensor):
        rows = list(column.unbind()) if column.is_nested else list(column.unbind(0))
    elif hasattr(column, "tolist"):  # tensordict NonTensorStack: a list of per-row objects
        rows = list(column.tolist())
    else:
        rows = list(column)
    if len(rows) != count:
        raise DataPlaneError(
            f"simple data plane get: column holds {len(rows)} rows, expected {count}"
        )
    return rows


def _own(tensor: torch.Tensor) -> torch.Tensor:
    """A dense tensor that owns exactly its bytes (not a view into a received batch buffer)."""
    if tensor.is_contiguous() and tensor.untyped_storage().nbytes() == tensor.nbytes:
        return tensor
    return tensor.clone(memory_format=torch.contiguous_format)


def unpack_rows(
    keys: list[str],
    specs: list[dict[str, tuple[torch.dtype, tuple[int, ...]]]],
    batch: TensorDict,
) -> dict[str, Row]:
    """Rebuild dense rows (tagged dtypes and shapes, 0-d included) from a fetched batch."""
    # A TensorDict iterates over its batch dimension, not its keys.
    columns = {field: _column_rows(batch[field], len(keys)) for field in batch.keys()}  # noqa: SIM118
    rows: dict[str, Row] = {}
    for position, (key, spec) in enumerate(zip(keys, specs, strict=True)):
        row: Row = {}
        for field, (dtype, shape) in spec.items():
            if field not in columns:
                raise DataPlaneError(
                    f"simple data plane get: row {key!r} came back without field {field!r}"
                )
            value = columns[field][position]
            if not isinstance(value, torch.Tensor):
                raise DataPlaneError(
                    f"simple data plane get: row {key!r} field {field!r} came back as "
                    f"{type(value).__name__}, not a tensor"
                )
            if value.dtype != dtype:
                raise DataPlaneError(
                    f"simple data plane get: row {key!r} field {field!r} came back as "
                    f"{value.dtype}, stored as {dtype}"
                )
            if tuple(value.shape) != shape:
                if value.numel() != math.prod(shape):
                    raise DataPlaneError(
                        f"simple data plane get: row {key!r} field {field!r} came back with "
                        f"{value.numel()} elements, stored with shape {list(shape)}"
                    )
                value = value.reshape(shape)
            row[field] = _own(value)
        rows[key] = row
    return rows
