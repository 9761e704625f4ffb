"""Where checkpoint bundles live on disk, and the manifest that proves a bundle is whole.

    <checkpoint_dir>/step_N/                      trainer checkpoint after N steps
        policy/  value/ (PPO)  train_state.json  dataloader.pt  replay_index.pt
        rollout_recovery.pt  replacement_reserve.pt  data_plane/  manifest.json
        rollout_snapshots/snapshot_000001/ ...    periodic snapshots anchored on step_N
    <checkpoint_dir>/bootstrap/manifest.json      anchor before the first step
    <checkpoint_dir>/bootstrap/rollout_snapshots/snapshot_000001/ ...

Every bundle (trainer checkpoint or snapshot) is written into a temporary sibling and published
by one atomic rename, with ``manifest.json`` written last inside it: it lists the sha256 of every
file of the bundle. A directory without a manifest, with a temporary name, or whose files do
not match their digests is never selected for recovery.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandemrl.dataplane.atomic import is_temporary_name

MANIFEST = "manifest.json"
TRAIN_STATE = "train_state.json"
DATALOADER = "dataloader.pt"
REPLAY_INDEX = "replay_index.pt"
ROLLOUT_RECOVERY = "rollout_recovery.pt"
REPLACEMENT_RESERVE = "replacement_reserve.pt"
ROLLOUT_STATE = "rollout_state.pt"
DATA_PLANE_DIR = "data_plane"
POLICY_DIR = "policy"
VALUE_DIR = "value"
SNAPSHOTS_DIR = "rollout_snapshots"
BOOTSTRAP_DIR = "bootstrap"
JOURNAL = "journal.jsonl"
FORMAT_VERSION = 1

_STEP_RE = re.compile(r"^step_(\d+)$")
_SNAPSHOT_RE = re.compile(r"^snapshot_(\d{6})$")


class CheckpointCorrupt(RuntimeError):
    """A bundle is damaged: a file is missing, truncated or does not match its digest."""


def step_dir(checkpoint_dir: Path, step: int) -> Path:
    return checkpoint_dir / f"step_{step}"


def bootstrap_dir(checkpoint_dir: Path) -> Path:
    return checkpoint_dir / BOOTSTRAP_DIR


def snapshot_dir(anchor: Path, sequence: int) -> Path:
    return anchor / SNAPSHOTS_DIR / f"snapshot_{sequence:06d}"


def list_step_dirs(checkpoint_dir: Path) -> list[tuple[int, Path]]:
    """Published trainer checkpoints, oldest first (temporary names are not listed)."""
    if not checkpoint_dir.is_dir():
        return []
    found = []
    for child in checkpoint_dir.iterdir():
        match = _STEP_RE.match(child.name)
        if match and child.is_dir() and not is_temporary_name(child.name):
            found.append((int(match.group(1)), child))
    return sorted(found)


def list_snapshot_dirs(anchor: Path) -> list[tuple[int, Path]]:
    """Published snapshots under an anchor, oldest first."""
    root = anchor / SNAPSHOTS_DIR
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        match = _SNAPSHOT_RE.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def bundle_files(root: Path) -> list[Path]:
    """Every file of a bundle except its own manifest and nested snapshots (they have their own).

    Nested manifests (``data_plane/manifest.json``) are digested like any other file.
    """
    files = []
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if relative.parts[0] == SNAPSHOTS_DIR or relative == Path(MANIFEST) or not path.is_file():
            continue
        files.append(path)
    return files


def write_manifest(root: Path, payload: dict[str, Any]) -> dict[str, Any]:
    """Digest every file of the bundle and write ``manifest.json`` (the last file written)."""
    manifest = {
        "format": FORMAT_VERSION,
        **payload,
        "files": {str(path.relative_to(root)): sha256_file(path) for path in bundle_files(root)},
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


@dataclass(frozen=True)
class VerifiedBundle:
    path: Path
    manifest: dict[str, Any]


def read_manifest(root: Path) -> dict[str, Any]:
    path = root / MANIFEST
    if not path.is_file():
        raise CheckpointCorrupt(f"{path}: missing manifest (the bundle was never completed)")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as exc:  # ValueError: bad JSON or bytes that are not UTF-8
        raise CheckpointCorrupt(f"{path}: unreadable manifest: {exc}") from exc
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT_VERSION
        or "files" not in manifest
    ):
        raise CheckpointCorrupt(f"{path}: not a TandemRL manifest of format {FORMAT_VERSION}")
    return manifest


def verify_bundle(root: Path) -> VerifiedBundle:
    """Check every file listed in the manifest against its digest; raise CheckpointCorrupt."""
    manifest = read_manifest(root)
    for relative, expected in manifest["files"].items():
        path = root / relative
        if not path.is_file():
            raise CheckpointCorrupt(f"{path}: listed in {root / MANIFEST} but missing")
        actual = sha256_file(path)
        if actual != expected:
            raise CheckpointCorrupt(
                f"{path}: sha256 {actual[:12]}… does not match the manifest ({expected[:12]}…)"
            )
    return VerifiedBundle(root, manifest)
