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
from array import array
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path

import torch

Row = dict[str, torch.Tensor]
# What ``get`` hands out per sample id: a plain row or a read-only view (``BlockRow``).
RowView = Mapping[str, torch.Tensor]


_STR_ONLY = {str}

# Flat buffers a RowBlock may be built from, by ``array.array`` typecode.
BUFFER_DTYPES: dict[str, torch.dtype] = {
    "b": torch.int8,
    "B": torch.uint8,
    "h": torch.int16,
    "i": torch.int32,
    "q": torch.int64,
    "f": torch.float32,
    "d": torch.float64,
}


class RowBlock:
    """The rows of one prompt group, each field stacked along dimension 0.

    Row ``i`` is ``sample_ids[i]``, ``lengths[i]`` tokens long. A field of shape ``[N]`` is one
    value per row (a 0-d tensor in the row); a field of shape ``[N, L]`` is per token, right
    padded to ``L = max(lengths)`` (the row holds ``field[i, :lengths[i]]``). Padding positions
    hold 0 in every field. A *shared* field is one tensor of any shape that every row of the
    block holds as it is (a prompt group's processed images: its rows share the prompt).
    Blocks are immutable: nobody writes to a stored block's tensors.

    ``from_buffers`` builds a block from flat ``array.array`` buffers (row-major, typecodes of
    ``BUFFER_DTYPES``) without making tensors: ``fields`` turns them into tensors on first
    use, and collation concatenates the buffers of many blocks into one tensor per field, so
    a group that goes from the rollout straight into a batch costs no tensor of its own.
    """

    __slots__ = (
        "_fields",
        "lengths",
        "per_row_buffers",
        "per_token_buffers",
        "sample_ids",
        "shared",
        "uniform",
        "width",
    )

    def __init__(
        self,
        sample_ids: Sequence[str],
        fields: Mapping[str, torch.Tensor],
        lengths: Sequence[int],
        *,
        shared: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self._set_rows(sample_ids, lengths)
        self._set_shared(shared, set(fields))
        self._fields: dict[str, torch.Tensor] | None = dict(fields)
        self.per_token_buffers: dict[str, array] | None = None
        self.per_row_buffers: dict[str, array] | None = None
        count = len(self.sample_ids)
        per_row, per_token = (count,), (count, self.width)
        for name, tensor in self._fields.items():
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

    @classmethod
    def from_buffers(
        cls,
        sample_ids: Sequence[str],
        lengths: Sequence[int],
        *,
        per_token: Mapping[str, array],
        per_row: Mapping[str, array],
        shared: Mapping[str, torch.Tensor] | None = None,
    ) -> RowBlock:
        """A block from ``per_token`` buffers of ``N * L`` values and ``per_row`` ones of ``N``,
        and ``shared`` tensors every row holds as they are."""
        block = cls.__new__(cls)
        block._set_rows(sample_ids, lengths)
        block._set_shared(shared, set(per_token) | set(per_row))
        block._fields = None
        block.per_token_buffers = dict(per_token)
        block.per_row_buffers = dict(per_row)
        count = len(block.sample_ids)
        if block.per_token_buffers.keys() & block.per_row_buffers.keys():
            raise DataPlaneError(
                f"row block {block.sample_ids[0]!r}...: a field is both per token and per row"
            )
        for buffers, size in (
            (block.per_token_buffers, count * block.width),
            (block.per_row_buffers, count),
        ):
            for name, buffer in buffers.items():
                if (
                    not isinstance(name, str)
                    or not name
                    or not isinstance(buffer, array)
                    or buffer.typecode not in BUFFER_DTYPES
                ):
                    raise DataPlaneError(
                        f"row block {block.sample_ids[0]!r}...: field {name!r} must be a named "
                        f"array.array with a typecode in {sorted(BUFFER_DTYPES)}"
                    )
                if len(buffer) != size:
                    raise DataPlaneError(
                        f"row block {block.sample_ids[0]!r}...: field {name!r} holds "
                        f"{len(buffer)} values, expected {size}"
                    )
        return block

    def _set_shared(
        self, shared: Mapping[str, torch.Tensor] | None, stacked_names: set[str]
    ) -> None:
        self.shared = dict(shared) if shared else {}
        for name, tensor in self.shared.items():
            if not isinstance(name, str) or not name or not isinstance(tensor, torch.Tensor):
                raise DataPlaneError(
                    f"row block {self.sample_ids[0]!r}...: shared field {name!r} must be a "
                    f"named torch.Tensor, got {type(tensor).__name__}"
                )
            if name in stacked_names:
                raise DataPlaneError(
                    f"row block {self.sample_ids[0]!r}...: field {name!r} is both shared and "
                    "stacked"
                )

    def _set_rows(self, sample_ids: Sequence[str], lengths: Sequence[int]) -> None:
        self.sample_ids = tuple(sample_ids)
        self.lengths = tuple(lengths)
        count = len(self.sample_ids)
        if count == 0 or len(self.lengths) != count:
            raise DataPlaneError(
                f"row block: {count} sample id(s) but {len(self.lengths)} length(s); a block "
                "holds at least one row and one length per row"
            )
        # Plain str ids (the usual case) are checked without a Python loop; anything else
        # (str subclasses, or the non-str that is about to be refused) takes the loop.
        if set(map(type, self.sample_ids)) != _STR_ONLY:
            for sample_id in self.sample_ids:
                if not isinstance(sample_id, str):
                    raise DataPlaneError(
                        f"row block: sample ids must be distinct non-empty strings, got "
                        f"{self.sample_ids}"
                    )
        distinct = set(self.sample_ids)
        if len(distinct) != count or "" in distinct:
            raise DataPlaneError(
                f"row block: sample ids must be distinct non-empty strings, got {self.sample_ids}"
            )
        shortest = min(self.lengths)
        if shortest < 1:
            raise DataPlaneError(f"row block {self.sample_ids[0]!r}...: a row length is < 1")
        self.width = max(self.lengths)
        self.uniform = shortest == self.width

    @property
    def fields(self) -> dict[str, torch.Tensor]:
        """Every field as a tensor ([N] or [N, L]); built from the buffers on first use."""
        if self._fields is None:
            assert self.per_token_buffers is not None and self.per_row_buffers is not None
            count, width = len(self.sample_ids), self.width
            fields = {
                name: torch.frombuffer(buffer, dtype=BUFFER_DTYPES[buffer.typecode]).view(
                    count, width
                )
                for name, buffer in self.per_token_buffers.items()
            }
            for name, buffer in self.per_row_buffers.items():
                fields[name] = torch.frombuffer(buffer, dtype=BUFFER_DTYPES[buffer.typecode])
            self._fields = fields
        return self._fields

    @property
    def field_names(self) -> list[str]:
        """Every field a row holds: the stacked ones, then the shared ones."""
        if self._fields is not None:
            return [*self._fields, *self.shared]
        assert self.per_token_buffers is not None and self.per_row_buffers is not None
        return [*self.per_token_buffers, *self.per_row_buffers, *self.shared]

    def __len__(self) -> int:
        return len(self.sample_ids)

    def field_of_row(self, name: str, index: int) -> torch.Tensor:
        if self.shared and name in self.shared:
            return self.shared[name]
        tensor = self.fields[name]
        if tensor.dim() == 1 or self.uniform:
            return tensor[index]
        return tensor[index, : self.lengths[index]]

    def row_views(self) -> list[BlockRow]:
        """One read-only row view per sample id, in block order."""
        return [BlockRow(self, index) for index in range(len(self.sample_ids))]

    def rows(self) -> dict[str, Row]:
        """The block as plain rows ``{sample_id: {field: tensor}}`` (views of the block)."""
        names = self.field_names
        return {
            sample_id: {name: self.field_of_row(name, index) for name in names}
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
        return iter(self.block.field_names)

    def __len__(self) -> int:
        return len(self.block.field_names)

    def __contains__(self, name: object) -> bool:
        return name in self.block.field_names

    def __repr__(self) -> str:
        return f"BlockRow({self.block.sample_ids[self.index]!r}, fields={self.block.field_names})"


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
