"""The data-plane contract: rows of named tensors keyed by sample id.

A row is ``dict[str, torch.Tensor]``. The controller keeps only metadata (keys); the rows live
here until the train step that consumed them closes and clears them. ``save`` / ``load`` are
native snapshots used by checkpoints: published atomically (tmp dir, fsync, rename), so a
crash mid-save leaves no directory that ``load`` would accept.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from pathlib import Path

import torch

Row = dict[str, torch.Tensor]


class DataPlaneError(RuntimeError):
    """A data-plane call failed; the message names the backend and the call."""


class DataPlane(ABC):
    backend_name: str = "abstract"
    # True when save()/load() are implemented natively (required for save_data_plane).
    supports_native_save: bool = False

    @abstractmethod
    async def put(self, rows: Mapping[str, Row]) -> None:
        """Store rows by sample id. Overwriting an existing key is an error."""

    @abstractmethod
    async def get(self, keys: Iterable[str]) -> dict[str, Row]:
        """Return the rows for ``keys``; a missing key raises DataPlaneError naming it."""

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
