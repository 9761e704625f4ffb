"""The manifest of a published data-plane snapshot: found, parsed and its format checked.

Both backends that save snapshots (``local``, ``simple``) publish a directory atomically with
a ``manifest.json`` naming its format and version, and safetensors files whose size and sha256
the manifest records; what else it lists (rows, digests) is each backend's own. The two steps
they share: ``read_snapshot_manifest`` refuses an unpublished directory, a missing or corrupt
manifest, or one of another format; ``read_verified_tensors`` refuses a missing, truncated,
altered or unparsable file. Every message names the backend and the file.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load as safetensors_load

from tandemrl.dataplane.atomic import is_temporary_name
from tandemrl.dataplane.base import DataPlaneError

MANIFEST_NAME = "manifest.json"


def read_snapshot_manifest(
    directory: Path, *, backend: str, snapshot_format: str, version: int
) -> tuple[Path, dict[str, Any]]:
    """The manifest's path and contents, once its ``format`` and ``version`` are the expected
    ones; ``backend`` names the data plane in the messages (``local``, ``simple``)."""
    where = f"{backend} data plane load"
    if is_temporary_name(directory.name):
        raise DataPlaneError(
            f"{where}: {directory} is an unpublished (interrupted) snapshot directory; only "
            "published snapshots can be loaded"
        )
    manifest_path = directory / MANIFEST_NAME
    if not manifest_path.is_file():
        raise DataPlaneError(f"{where}: {manifest_path} is missing (not a published snapshot)")
    try:
        manifest = json.loads(manifest_path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise DataPlaneError(f"{where}: {manifest_path} is corrupt ({exc})") from exc
    try:
        if manifest["format"] != snapshot_format or manifest["version"] != version:
            raise DataPlaneError(
                f"{where}: {manifest_path} has format {manifest['format']!r} "
                f"v{manifest['version']}, expected {snapshot_format!r} v{version}"
            )
    except (KeyError, TypeError) as exc:
        raise DataPlaneError(
            f"{where}: {manifest_path} is malformed (missing or bad entry {exc})"
        ) from exc
    return manifest_path, manifest


def read_verified_tensors(
    path: Path, *, backend: str, expected_bytes: int, expected_sha256: str
) -> dict[str, torch.Tensor]:
    """The tensors of a snapshot file, once its size and sha256 match the manifest's."""
    where = f"{backend} data plane load"
    if not path.is_file():
        raise DataPlaneError(f"{where}: {path} is missing")
    payload = path.read_bytes()
    if len(payload) != expected_bytes:
        raise DataPlaneError(
            f"{where}: {path} is truncated or padded: {len(payload)} bytes, manifest says "
            f"{expected_bytes}"
        )
    if hashlib.sha256(payload).hexdigest() != expected_sha256:
        raise DataPlaneError(f"{where}: {path} is corrupt (sha256 does not match the manifest)")
    try:
        return safetensors_load(payload)
    except Exception as exc:  # safetensors raises its own error types
        raise DataPlaneError(f"{where}: {path} cannot be parsed ({exc})") from exc
