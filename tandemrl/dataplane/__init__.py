"""Data plane: where rows of tensors live between a group's commit and its step's clear.

``create_data_plane`` builds the backend named by ``data_plane.backend``: ``local`` (in-process
dict, the default) or ``simple`` (TransferQueue storage units; imported only when asked for,
since it pulls in TransferQueue).
"""

from __future__ import annotations

from tandemrl.config.models import DataPlaneConfig
from tandemrl.dataplane.base import DataPlane, DataPlaneError, Row
from tandemrl.dataplane.local import LocalDataPlane

__all__ = ["DataPlane", "DataPlaneError", "LocalDataPlane", "Row", "create_data_plane"]


def create_data_plane(cfg: DataPlaneConfig) -> DataPlane:
    """The data-plane backend ``cfg.backend`` names."""
    if cfg.backend == "local":
        return LocalDataPlane()
    if cfg.backend == "simple":
        from tandemrl.dataplane.simple import SimpleDataPlane

        return SimpleDataPlane(cfg)
    raise DataPlaneError(
        f"data_plane.backend: {cfg.backend!r} is not supported by this build; "
        "use 'local' (in-process) or 'simple' (TransferQueue storage)"
    )
