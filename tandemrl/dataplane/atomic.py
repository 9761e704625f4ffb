"""Atomic publication of files and directories on a POSIX filesystem.

A snapshot is built in a temporary sibling directory (same parent, so the final rename never
crosses a filesystem), every file and the directory itself are fsynced, and only then is it
renamed onto its final name with ``os.replace``. A reader therefore sees either no directory,
the previous complete one, or the new complete one; never a partial one. A crash mid-write
leaves a ``.<name>.tmp-<hex>`` sibling behind, which ``is_temporary_name`` recognises so that
loaders refuse it and ``remove_stale_temporaries`` can sweep it.

Replacing an existing directory takes two renames (``os.replace`` cannot overwrite a non-empty
directory): the old one is first renamed aside to ``.<name>.old-<hex>``, the new one renamed
into place, then the old one removed. A crash between the two renames leaves no directory at
the target but both siblings intact; ``recover_directory`` puts the old one back.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

_TMP_MARK = ".tmp-"
_OLD_MARK = ".old-"


def fsync_file(path: Path) -> None:
    """Flush a file's data and metadata to stable storage."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: Path) -> None:
    """Flush a directory's entries (names created, renamed or removed in it)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file and directory under ``root`` (deepest first), then ``root`` itself."""
    for dirpath, _dirnames, filenames in os.walk(root, topdown=False):
        for filename in filenames:
            fsync_file(Path(dirpath) / filename)
        fsync_dir(Path(dirpath))


def is_temporary_name(name: str) -> bool:
    """True for the names of unpublished (in-progress or interrupted) or set-aside siblings."""
    return name.startswith(".") and (_TMP_MARK in name or _OLD_MARK in name)


def _sibling(target: Path, mark: str) -> Path:
    return target.parent / f".{target.name}{mark}{uuid.uuid4().hex[:12]}"


def publish_directory(tmp_dir: Path, target: Path) -> None:
    """Rename a fully written ``tmp_dir`` onto ``target``, replacing any directory there."""
    parent = target.parent
    aside: Path | None = None
    if target.exists():
        aside = _sibling(target, _OLD_MARK)
        os.replace(target, aside)
    try:
        os.replace(tmp_dir, target)
    except BaseException:
        if aside is not None:
            os.replace(aside, target)  # put the previous snapshot back
        raise
    fsync_dir(parent)
    if aside is not None:
        shutil.rmtree(aside)
        fsync_dir(parent)


@contextmanager
def atomic_directory(target: Path) -> Iterator[Path]:
    """Yield an empty temporary directory; publish it at ``target`` when the block succeeds.

    On an exception the temporary directory is removed and ``target`` is left untouched.
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = _sibling(target, _TMP_MARK)
    tmp_dir.mkdir()
    try:
        yield tmp_dir
        fsync_tree(tmp_dir)
        publish_directory(tmp_dir, target)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a fsynced temporary sibling and ``os.replace``."""
    path = Path(path)
    tmp = _sibling(path, _TMP_MARK)
    try:
        with open(tmp, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_json_atomic(path: Path, payload: Any) -> None:
    """Write ``payload`` as indented JSON, atomically (see ``write_bytes_atomic``)."""
    write_bytes_atomic(path, json.dumps(payload, indent=2, sort_keys=True).encode("utf-8"))


def write_file_synced(path: Path, data: bytes) -> None:
    """Write ``data`` to a new file and fsync it (inside a directory published atomically)."""
    with open(path, "xb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Remove interrupted ``.<name>.tmp-*`` siblings under ``parent``; return what was removed.

    Set-aside ``.old-*`` directories are left alone: they may be the only copy of a target
    whose replacement was interrupted (see ``recover_directory``).
    """
    removed: list[Path] = []
    parent = Path(parent)
    if not parent.is_dir():
        return removed
    for entry in sorted(parent.iterdir()):
        if entry.name.startswith(".") and _TMP_MARK in entry.name:
            if entry.is_dir():
                shutil.rmtree(entry)
            else:
                entry.unlink()
            removed.append(entry)
    return removed


def recover_directory(target: Path) -> bool:
    """Restore ``target`` from its set-aside copy after an interrupted replacement.

    Returns True when a set-aside copy was renamed back into place. Does nothing (False) when
    ``target`` exists or no set-aside copy is found.
    """
    target = Path(target)
    if target.exists():
        return False
    prefix = f".{target.name}{_OLD_MARK}"
    candidates = sorted(p for p in target.parent.glob(f"{prefix}*") if p.is_dir())
    if not candidates:
        return False
    if len(candidates) > 1:
        raise RuntimeError(
            f"{target}: {len(candidates)} set-aside copies ({', '.join(map(str, candidates))}); "
            "cannot tell which one to restore"
        )
    os.replace(candidates[0], target)
    fsync_dir(target.parent)
    return True
