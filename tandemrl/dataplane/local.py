"""In-process data plane: rows of tensors in a dict, with native snapshots on disk.

The default backend (``data_plane.backend: local``). Rows are stored by reference (the tensors
are not copied on put or get); the controller only ever reads a row after its group committed
and only clears it after the step that consumed it closed, so nobody mutates a stored row.
A group written with ``put_block`` stays one block: each of its sample ids maps to a
``BlockRow`` view of it, handed out as is by ``get`` (collation then concatenates whole
blocks), and the block is freed when the last of its rows is cleared.

Snapshot layout (a directory published atomically by ``atomic.atomic_directory``)::

    <dir>/rows.safetensors   every tensor, named "{sample_id}/{field}"
    <dir>/manifest.json      format, version, the file's size and sha256, and per sample id
                             its fields (in order) and the sha256 digest of the row

A row digest covers each field's name, dtype, shape and bytes, so a restored row is verified
independently of the file encoding. ``load`` checks the manifest, the file's size and digest
(truncation and corruption are named with the file), then every row digest, and only then
inserts the rows: a bad snapshot never leaves a partial restore behind.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save as safetensors_save

from tandemrl.dataplane.atomic import atomic_directory, write_file_synced
from tandemrl.dataplane.base import BlockRow, DataPlane, DataPlaneError, Row, RowBlock, RowView
from tandemrl.dataplane.manifest import (
    MANIFEST_NAME,
    read_snapshot_manifest,
    read_verified_tensors,
)

SNAPSHOT_FORMAT = "tandemrl.local_data_plane"
SNAPSHOT_VERSION = 1
ROWS_FILE_NAME = "rows.safetensors"


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The raw little-endian bytes of a tensor (any dtype, including bfloat16 and bool)."""
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def row_digest(row: RowView) -> str:
    """sha256 over each field's name, dtype, shape and bytes, fields in sorted order."""
    digest = hashlib.sha256()
    for field in sorted(row):
        tensor = row[field]
        header = f"{field}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode()
        digest.update(len(header).to_bytes(8, "little"))
        digest.update(header)
        payload = tensor_bytes(tensor)
        digest.update(len(payload).to_bytes(8, "little"))
        digest.update(payload)
    return digest.hexdigest()


def _check_row(sample_id: Any, row: Any) -> None:
    if not isinstance(sample_id, str) or not sample_id:
        raise DataPlaneError(
            f"local data plane put: sample id must be a non-empty str, got {sample_id!r}"
        )
    if not isinstance(row, Mapping):
        raise DataPlaneError(
            f"local data plane put: row {sample_id!r} must be a mapping of field -> tensor, "
            f"got {type(row).__name__}"
        )
    for field, value in row.items():
        if not isinstance(field, str) or not field:
            raise DataPlaneError(
                f"local data plane put: row {sample_id!r} has field name {field!r}"
            )
        if not isinstance(value, torch.Tensor):
            raise DataPlaneError(
                f"local data plane put: row {sample_id!r} field {field!r} is "
                f"{type(value).__name__}, expected torch.Tensor"
            )


class LocalDataPlane(DataPlane):
    """Rows in a dict of ``{sample_id: {field: tensor}}`` inside the controller's process."""

    backend_name = "local"
    supports_native_save = True

    def __init__(self) -> None:
        self._rows: dict[str, Row | BlockRow] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def __contains__(self, sample_id: object) -> bool:
        return sample_id in self._rows

    async def put(self, rows: Mapping[str, Row]) -> None:
        # Check everything first so that a bad batch stores nothing.
        for sample_id, row in rows.items():
            _check_row(sample_id, row)
        duplicates = sorted(key for key in rows if key in self._rows)
        if duplicates:
            raise DataPlaneError(
                f"local data plane put: sample id(s) already stored: {', '.join(duplicates)} "
                "(a sample id is written once; clear it before reusing it)"
            )
        for sample_id, row in rows.items():
            self._rows[sample_id] = dict(row)

    async def put_block(self, block: RowBlock) -> None:
        # The block validated its ids and fields when it was built: only duplicates remain.
        stored = self._rows
        if not stored.keys().isdisjoint(block.sample_ids):
            duplicates = sorted(key for key in block.sample_ids if key in stored)
            raise DataPlaneError(
                f"local data plane put: sample id(s) already stored: {', '.join(duplicates)} "
                "(a sample id is written once; clear it before reusing it)"
            )
        stored.update(zip(block.sample_ids, block.row_views(), strict=True))

    async def get(self, keys: Iterable[str]) -> dict[str, RowView]:
        keys = list(keys)
        stored = self._rows
        missing = [key for key in keys if key not in stored]
        if missing:
            raise DataPlaneError(
                f"local data plane get: sample id(s) not stored: {', '.join(map(str, missing))}"
            )
        # Block rows are immutable views and go out as they are; plain rows as copies.
        return {
            key: row if type(row) is BlockRow else dict(row)
            for key in keys
            for row in (stored[key],)
        }

    async def clear(self, keys: Iterable[str]) -> None:
        pop = self._rows.pop
        for key in keys:
            pop(key, None)

    async def keys(self) -> list[str]:
        return list(self._rows)

    # ------------------------------------------------------------------ snapshots

    async def save(self, directory: Path, keys: Iterable[str] | None = None) -> dict[str, str]:
        directory = Path(directory)
        sample_ids = list(self._rows) if keys is None else list(dict.fromkeys(keys))
        missing = [key for key in sample_ids if key not in self._rows]
        if missing:
            raise DataPlaneError(
                f"local data plane save to {directory}: sample id(s) not stored: "
                f"{', '.join(map(str, missing))}"
            )
        rows = {sample_id: self._rows[sample_id] for sample_id in sample_ids}
        # Serialising and fsyncing run in a thread so the controller's event loop (both pumps)
        # keeps going; the rows cannot change meanwhile (the checkpoint barrier holds commits
        # and clears, and rows are never mutated in place).
        return await asyncio.to_thread(_write_snapshot, directory, rows)

    async def load(self, directory: Path) -> dict[str, str]:
        rows, digests = read_snapshot(Path(directory))
        duplicates = sorted(key for key in rows if key in self._rows)
        if duplicates:
            raise DataPlaneError(
                f"local data plane load from {directory}: sample id(s) already stored: "
                f"{', '.join(duplicates)}"
            )
        self._rows.update(rows)
        return digests


def _write_snapshot(directory: Path, rows: dict[str, RowView]) -> dict[str, str]:
    tensors: dict[str, torch.Tensor] = {}
    manifest_rows: dict[str, dict[str, Any]] = {}
    digests: dict[str, str] = {}
    for sample_id, row in rows.items():
        fields = list(row)
        for field in fields:
            name = f"{sample_id}/{field}"
            if name in tensors:
                raise DataPlaneError(
                    f"local data plane save to {directory}: tensor name {name!r} is ambiguous "
                    f"(sample id {sample_id!r} collides with another row's id and field)"
                )
            # safetensors refuses tensors that share storage; clone to own the bytes.
            tensors[name] = row[field].detach().to("cpu").contiguous().clone()
        digests[sample_id] = row_digest(row)
        manifest_rows[sample_id] = {"fields": fields, "digest": digests[sample_id]}
    payload = safetensors_save(tensors)
    manifest = {
        "format": SNAPSHOT_FORMAT,
        "version": SNAPSHOT_VERSION,
        "files": {
            ROWS_FILE_NAME: {"bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
        },
        "rows": manifest_rows,
    }
    with atomic_directory(directory) as tmp_dir:
        write_file_synced(tmp_dir / ROWS_FILE_NAME, payload)
        write_file_synced(
            tmp_dir / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode()
        )
    return digests


def read_snapshot(directory: Path) -> tuple[dict[str, Row], dict[str, str]]:
    """Read and fully verify a snapshot written by ``LocalDataPlane.save``; mutate nothing."""
    manifest_path, manifest = read_snapshot_manifest(
        directory, backend="local", snapshot_format=SNAPSHOT_FORMAT, version=SNAPSHOT_VERSION
    )
    try:
        file_info = manifest["files"][ROWS_FILE_NAME]
        expected_size = int(file_info["bytes"])
        expected_sha = str(file_info["sha256"])
        manifest_rows = {
            str(sample_id): ([str(f) for f in entry["fields"]], str(entry["digest"]))
            for sample_id, entry in manifest["rows"].items()
        }
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataPlaneError(
            f"local data plane load: {manifest_path} is malformed (missing or bad entry {exc})"
        ) from exc

    rows_path = directory / ROWS_FILE_NAME
    tensors = read_verified_tensors(
        rows_path, backend="local", expected_bytes=expected_size, expected_sha256=expected_sha
    )

    rows: dict[str, Row] = {}
    digests: dict[str, str] = {}
    for sample_id, (fields, digest) in manifest_rows.items():
        try:
            row = {field: tensors[f"{sample_id}/{field}"] for field in fields}
        except KeyError as exc:
            raise DataPlaneError(
                f"local data plane load: {rows_path} lacks tensor {exc} listed in {manifest_path}"
            ) from exc
        if row_digest(row) != digest:
            raise DataPlaneError(
                f"local data plane load: row {sample_id!r} in {rows_path} does not match its "
                f"digest in {manifest_path}"
            )
        rows[sample_id] = row
        digests[sample_id] = digest
    return rows, digests
