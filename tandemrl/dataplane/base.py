"""The data-plane contract: rows of named tensors keyed by sample id.

A row is a mapping of field name to tensor. The controller keeps only metadata (keys); the
rows live here until the train step that consumed them closes and clears them. Rows handed
out by ``get`` are read-only: a backend may return the stored row itself.

A prompt group's rows can also be written as one ``RowBlock`` (``put_block``): each field
stacked over the group's rows, the way the rollout manager builds them. A backend may keep
the block whole; ``get`` still answers per sample id (a ``BlockRow``: row ``i`` of the block,
read lazily), and collation recognises consecutive rows of whole blocks and concatenates the
blocks instead of padding row by row. The default ``put_block`` splits the block into plain
rows and calls ``put``.

``save`` / ``load`` are native snapshots used by checkpoints: published atomically (tmp dir,
fsync, rename), so a crash mid-save leaves no directory that ``load`` would accept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

Row = dict[str, torch.Tensor]
# What ``get`` hands out per sample id: a plain row or a read-only view (``BlockRow``).
RowView = Mapping[str, torch.Tensor]


class RowBlock:
    """The rows of one prompt group, each field stacked along dimension 0.

    Row ``i`` is ``sample_ids[i]``, ``lengths[i]`` tokens long. A field of shape ``[N]`` is one
    value per row (a 0-d tensor in the row); a field of shape ``[N, L]`` is per token, right
    padded to ``L = max(lengths)`` (the row holds ``field[i, :lengths[i]]``). Padding positions
    hold 0 in every field. Blocks are immutable: nobody writes to a stored block's tensors.
    """

    __slots__ = ("fields", "lengths", "sample_ids", "uniform", "width")

    def __init__(
        self, sample_ids: Sequence[str], fields: Mapping[str, torch.Tensor], lengths: Sequence[int]
    ) -> None:
        self.sample_ids = tuple(sample_ids)
        self.fields = dict(fields)
        self.lengths = tuple(lengths)
        count = len(self.sample_ids)
        if count == 0 or len(self.lengths) != count:
            raise DataPlaneError(
                f"row block: {count} sample id(s) but {len(self.lengths)} length(s); a block "
                "holds at least one row and one length per row"
            )
        for sample_id in self.sample_ids:
            if not isinstance(sample_id, str) or not sample_id:
                raise DataPlaneError(
                    f"row block: sample ids must be distinct non-empty strings, got "
                    f"{self.sample_ids}"
                )
        if len(set(self.sample_ids)) != count:
            raise DataPlaneError(
                f"row block: sample ids must be distinct non-empty strings, got {self.sample_ids}"
            )
        shortest = min(self.lengths)
        if shortest < 1:
            raise DataPlaneError(f"row block {self.sample_ids[0]!r}...: a row length is < 1")
        self.width = max(self.lengths)
        self.uniform = shortest == self.width
        per_row, per_token = (count,), (count, self.width)
        for name, tensor in self.fields.items():
            if not isinstance(name, str) or not name or not isinstance(tensor, torch.Tensor):
                raise DataPlaneError(
                    f"row block {self.sample_ids[0]!r}...: field {name!r} must be a named "
                    f"torch.Tensor, got {type(tensor).__name__}"
                )
            shape = tensor.shape
            if shape != per_token and shape != per_row:
                raise DataPlaneError(
                    f"row block {self.sample_ids[0]!r}...: field {name!r} has shape "
                    f"{tuple(tensor.shape)}, expected ({count},) or ({count}, {self.width})"
                )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def field_of_row(self, name: str, index: int) -> torch.Tensor:
        tensor = self.fields[name]
        if tensor.dim() == 1 or self.uniform:
            return tensor[index]
        return tensor[index, : self.lengths[index]]

    def row_views(self) -> list[BlockRow]:
        """One read-only row view per sample id, in block order."""
        return [BlockRow(self, index) for index in range(len(self.sample_ids))]

    def rows(self) -> dict[str, Row]:
        """The block as plain rows ``{sample_id: {field: tensor}}`` (views of the block)."""
        return {
            sample_id: {name: self.field_of_row(name, index) for name in self.fields}
            for index, sample_id in enumerate(self.sample_ids)
        }


class BlockRow(Mapping[str, torch.Tensor]):
    """Row ``index`` of a ``RowBlock`` as a read-only mapping; fields are sliced on access."""

    __slots__ = ("block", "index")

    def __init__(self, block: RowBlock, index: int) -> None:
        self.block = block
        self.index = index

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.block.field_of_row(name, self.index)

    def __iter__(self) -> Iterator[str]:
        return iter(self.block.fields)

    def __len__(self) -> int:
        return len(self.block.fields)

    def __contains__(self, name: object) -> bool:
        return name in self.block.fields

    def __repr__(self) -> str:
        return f"BlockRow({self.block.sample_ids[self.index]!r}, fields={list(self.block.fields)})"


class DataPlaneError(RuntimeError):
    """A data-plane call failed; the message names the backend and the call."""


class DataPlane(ABC):
    backend_name: str = "abstract"
    # True when save()/load() are implemented natively (required for save_data_plane).
    supports_native_save: bool = False

    @abstractmethod
    async def put(self, rows: Mapping[str, Row]) -> None:
        """Store rows by sample id. Overwriting an existing key is an error."""

    async def put_block(self, block: RowBlock) -> None:
        """Store a group's rows written as one block (same rules as ``put``).

        The default splits the block into plain rows; backends that can keep blocks whole
        override it.
        """
        await self.put(block.rows())

    @abstractmethod
    async def get(self, keys: Iterable[str]) -> dict[str, RowView]:
        """Return the (read-only) rows for ``keys``; a missing key raises DataPlaneError."""

    @abstractmethod
    async def clear(self, keys: Iterable[str]) -> None:
        """Delete rows; missing keys are ignored (clear is idempotent)."""

    @abstractmethod
    async def keys(self) -> list[str]:
        """All stored sample ids."""

    @abstractmethod
    async def save(self, directory: Path, keys: Iterable[str] | None = None) -> dict[str, str]:
        """Snapshot ``keys`` (all when None) into ``directory``; return {sample_id: digest}."""

    @abstractmethod
    async def load(self, directory: Path) -> dict[str, str]:
        """Load a snapshot written by ``save``; return {sample_id: digest}."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release backend resources."""
