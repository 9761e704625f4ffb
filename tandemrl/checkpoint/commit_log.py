"""The commit log: a write-ahead record of every rollout-state change between snapshots.

A rollout snapshot is taken every ``snapshot_attempt_interval_s``; without a log, every group
that committed after the newest durable snapshot is generated again after a crash. The log
closes that gap. Every change of ownership is appended here as it happens, and a restart
replays the records written after the bundle it restores:

- ``admitted``: a prompt was drawn and its group opened (the ledger entry), with the
  *cursor* — dataloader position, sampler dispatch state, drops per step, replacement
  reserve — as it stands after the draw;
- ``staged``: siblings of a group finished (``sibling`` recovery with token capture);
- ``committed``: a group's siblings, stamps and dispatch position. Appended and **fsynced
  before the slot turns ready**, inside the same barrier mutation, so a group a trainer can
  see is always durable;
- ``dropped`` / ``promoted`` / ``reserve``: a group left without training, a ready group
  moved to an earlier step, spare prompts drawn (each with the cursor after it);
- ``open``: an attempt started; ``parent`` is the last record its state contains, and
  ``fingerprint``/``identity`` the config identity it runs under (what a later restart
  compares its config with: the groups it commits were generated under that config).

Every record has a log sequence number (LSN). A bundle records the next LSN at its capture
(``RolloutState.commit_log_next_lsn``): its state holds exactly the records below it, because
records are applied in the same synchronous section (or barrier mutation) in which their LSN
is assigned, and the capture runs under the barrier. The writer waits until the log is durable
up to that LSN before it publishes the bundle's manifest.

Histories branch: an attempt that restores an older bundle, or one written without the log,
abandons the records after that point. ``branch_records`` follows one branch: from the
bundle's LSN, records of the attempt that wrote it, then the records of each later attempt
whose ``open`` names the current tip as its parent; other attempts are skipped whole.

On disk: ``<checkpoint_dir>/commit_log/segment_<first LSN>.log``; each attempt appends to a
segment of its own. A record is ``MAGIC | length | payload crc32 | header crc32`` followed by
a JSON payload. A record cut off at the end of a segment (a kill mid-append) is ignored with a
warning; a damaged record with more data after it is a ``CheckpointCorrupt`` naming the file
and the offset — a restart never restores part of the history silently. A dedicated thread
writes and fsyncs (batched group commit), so the event loop never blocks on the disk.
Segments are removed once every selectable bundle on disk was captured after them.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandemrl.checkpoint.layout import CheckpointCorrupt
from tandemrl.dataplane.atomic import fsync_dir

log = logging.getLogger(__name__)

COMMIT_LOG_DIR = "commit_log"
MAGIC = b"TRCL"
_HEADER = struct.Struct("<4sIII")  # magic, payload length, payload crc32, header crc32
HEADER_SIZE = _HEADER.size
# A new segment is started past this size (and at every trainer checkpoint), so trimming can
# release disk space as snapshots move on.
SEGMENT_BYTES = 64 << 20
_SEGMENT_RE = re.compile(r"^segment_(\d{12})\.log$")
RECORD_KINDS = (
    "open",
    "admitted",
    "staged",
    "committed",
    "dropped",
    "promoted",
    "reserve",
    "filtered",
)


def segment_name(first_lsn: int) -> str:
    return f"segment_{first_lsn:012d}.log"


def list_segments(directory: Path) -> list[tuple[int, Path]]:
    """Segments in LSN order (a segment's name is the LSN of its first record)."""
    if not directory.is_dir():
        return []
    found = []
    for child in directory.iterdir():
        match = _SEGMENT_RE.match(child.name)
        if match and child.is_file():
            found.append((int(match.group(1)), child))
    return sorted(found)


# ---------------------------------------------------------------------------- format


def encode_record(record: dict[str, Any]) -> bytes:
    payload = json.dumps(record, separators=(",", ":"), sort_keys=True).encode()
    payload_crc = zlib.crc32(payload)
    header_crc = zlib.crc32(struct.pack("<II", len(payload), payload_crc))
    return _HEADER.pack(MAGIC, len(payload), payload_crc, header_crc) + payload


@dataclass
class SegmentRead:
    path: Path
    records: list[dict[str, Any]]
    torn_at: int | None = None  # offset of an ignored record cut off at the end


def read_segment(path: Path) -> SegmentRead:
    """Every whole record of a segment; a cut-off last record is reported, not returned."""
    data = path.read_bytes()
    result = SegmentRead(path, [])
    offset = 0
    while offset < len(data):
        rest = len(data) - offset
        if rest < HEADER_SIZE or not any(data[offset:]):
            # A header cut off by a kill, or space the filesystem allocated but never wrote.
            result.torn_at = offset
            break
        magic, length, payload_crc, header_crc = _HEADER.unpack_from(data, offset)
        if magic != MAGIC or zlib.crc32(struct.pack("<II", length, payload_crc)) != header_crc:
            raise CheckpointCorrupt(
                f"{path}: damaged commit log record header at byte offset {offset} "
                f"({len(data) - offset} byte(s) follow); refusing a partial restore. Move the "
                "commit_log folder aside (or set rollout_checkpointing.commit_log=false) to "
                "restart from the snapshot alone."
            )
        end = offset + HEADER_SIZE + length
        if end > len(data):
            result.torn_at = offset  # the payload was being written when the process died
            break
        payload = data[offset + HEADER_SIZE : end]
        if zlib.crc32(payload) != payload_crc:
            if end == len(data):
                result.torn_at = offset  # the last record's data never reached the disk
                break
            raise CheckpointCorrupt(
                f"{path}: commit log record at byte offset {offset} fails its checksum and "
                f"{len(data) - end} byte(s) follow it; refusing a partial restore. Move the "
                "commit_log folder aside (or set rollout_checkpointing.commit_log=false) to "
                "restart from the snapshot alone."
            )
        try:
            record = json.loads(payload)
            int(record["lsn"]), str(record["kind"])
        except (ValueError, KeyError, TypeError) as exc:
            raise CheckpointCorrupt(
                f"{path}: commit log record at byte offset {offset} has a valid checksum but "
                f"is not a log record ({exc})"
            ) from exc
        result.records.append(record)
        offset = end
    if result.torn_at is not None:
        log.warning(
            "%s: ignoring a commit log record cut off at byte offset %d (written when the "
            "process was killed)",
            path,
            result.torn_at,
        )
    return result


@dataclass
class LogContents:
    records: list[dict[str, Any]]  # every whole record, in LSN order
    segments: list[SegmentRead]

    @property
    def last_lsn(self) -> int:
        return self.records[-1]["lsn"] if self.records else -1

    @property
    def torn(self) -> list[tuple[str, int]]:
        return [(str(s.path), s.torn_at) for s in self.segments if s.torn_at is not None]


def read_log(directory: Path) -> LogContents:
    segments = [read_segment(path) for _, path in list_segments(directory)]
    records = [record for segment in segments for record in segment.records]
    for before, after in itertools.pairwise(records):
        if after["lsn"] <= before["lsn"]:
            raise CheckpointCorrupt(
                f"{directory}: commit log sequence numbers go backwards ({before['lsn']} then "
                f"{after['lsn']}); the segments do not belong to one run"
            )
    return LogContents(records, segments)


def branch_records(records: list[dict[str, Any]], from_lsn: int) -> list[dict[str, Any]]:
    """The records a bundle captured at ``from_lsn`` must replay (module docstring)."""
    return _branch(records, from_lsn)[0]


def branch_opens(records: list[dict[str, Any]], from_lsn: int) -> list[dict[str, Any]]:
    """The ``open`` records of the later attempts whose records that replay follows (each
    names the config identity its attempt ran under, when it was written with one)."""
    return _branch(records, from_lsn)[1]


def _branch(
    records: list[dict[str, Any]], from_lsn: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    tip = from_lsn - 1
    following = True
    chosen, opens = [], []
    for record in records:
        if record["lsn"] < from_lsn:
            continue
        if record["kind"] == "open":
            following = record.get("parent") == tip
            if following:
                tip = record["lsn"]
                opens.append(record)
            continue
        if following:
            chosen.append(record)
            tip = record["lsn"]
    return chosen, opens


# ---------------------------------------------------------------------------- replay fold


@dataclass
class LogReplay:
    """What a list of records changes, folded (pure: no controller, no I/O)."""

    committed: dict[str, dict[str, Any]] = field(default_factory=dict)
    admitted: dict[str, dict[str, Any]] = field(default_factory=dict)
    # group -> sibling -> staged entry, for groups admitted before the snapshot or after
    staged: dict[str, dict[int, dict[str, Any]]] = field(default_factory=dict)
    dropped: set[str] = field(default_factory=set)
    promoted: dict[str, int | None] = field(default_factory=dict)
    # Ready groups removed by dynamic sampling (after the bundle or in it).
    filtered: set[str] = field(default_factory=set)
    cursor: dict[str, Any] | None = None
    budgets: dict[str, Any] | None = None
    records: int = 0
    last_lsn: int | None = None

    def apply(self, record: dict[str, Any]) -> None:
        kind = record["kind"]
        if kind not in RECORD_KINDS:
            raise CheckpointCorrupt(f"commit log record {record['lsn']}: unknown kind {kind!r}")
        self.records += 1
        self.last_lsn = record["lsn"]
        if "cursor" in record:
            self.cursor = record["cursor"]
        if "budgets" in record:
            self.budgets = record["budgets"]
        # Every kind below names its group ("open", "reserve" and "filtered" records name
        # none; "filtered" lists several).
        group_id: str = record.get("group_id", "")
        if kind == "admitted":
            self.admitted[group_id] = record["group"]
            self.dropped.discard(group_id)
        elif kind == "staged":
            self.staged.setdefault(group_id, {}).update(
                {int(index): entry for index, entry in record["siblings"].items()}
            )
        elif kind == "committed":
            self.committed[group_id] = record["group"]
            self.admitted.pop(group_id, None)
            self.staged.pop(group_id, None)
        elif kind == "dropped":
            self.admitted.pop(group_id, None)
            self.staged.pop(group_id, None)
            self.dropped.add(group_id)
        elif kind == "filtered":
            for filtered_id in record["group_ids"]:
                self.committed.pop(filtered_id, None)
                self.filtered.add(filtered_id)
        elif kind == "promoted":
            if group_id in self.committed:
                self.committed[group_id]["target_step"] = record["target_step"]
            else:
                self.promoted[group_id] = record["target_step"]


def fold(records: Iterable[dict[str, Any]]) -> LogReplay:
    replay = LogReplay()
    for record in records:
        replay.apply(record)
    return replay


# ---------------------------------------------------------------------------- writer


class CommitLog:
    """Append-only writer of one attempt's segments (see the module docstring).

    ``append`` assigns the LSN and queues the record (it is on disk within a batch, fsynced
    with the next durable record); ``append_durable`` returns once the record is fsynced.
    Both are called from the event loop; the writer thread does the encoding and the I/O.
    """

    def __init__(self, directory: Path, *, segment_bytes: int = SEGMENT_BYTES) -> None:
        self.directory = Path(directory)
        self.segment_bytes = segment_bytes
        self._lock = threading.Condition()
        self._queue: list[dict[str, Any]] = []
        self._after_write: dict[int, Callable[[], None]] = {}
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        self._next_lsn = 0
        self._durable_lsn = -1  # every record <= this is fsynced
        self._written_lsn = -1  # every record <= this is written (survives a process kill)
        self._thread: threading.Thread | None = None
        self._closing = False
        self._abandoned = False
        self._rotate = False
        self._error: BaseException | None = None
        self._segment_fd: int | None = None
        self._segment_path: Path | None = None
        self._segment_size = 0
        self.records_written = 0
        self.bytes_written = 0
        self.fsyncs = 0

    @property
    def opened(self) -> bool:
        return self._thread is not None

    @property
    def next_lsn(self) -> int:
        return self._next_lsn

    def open(self, *, parent: int | None, **info: Any) -> int:
        """Start the attempt's segment after every record on disk; return the ``open`` LSN.

        ``parent``: the LSN of the last record the attempt's restored state contains (None
        when that state is not on the log: a fresh start, or a bundle written without it).
        """
        if self.opened:
            raise RuntimeError("the commit log is already open")
        self.directory.mkdir(parents=True, exist_ok=True)
        segments = list_segments(self.directory)
        last = read_log(self.directory).last_lsn
        # Past every record and every segment name: a killed attempt's segment may hold only a
        # torn record, and its name must not be reused.
        self._next_lsn = max([last, *(first for first, _ in segments)]) + 1
        self._durable_lsn = self._written_lsn = self._next_lsn - 1
        # Created here, not by the thread: a second writer on the same folder fails at once.
        self._new_segment(self._next_lsn)
        self._thread = threading.Thread(target=self._run, name="commit-log", daemon=True)
        self._thread.start()
        return self.append("open", parent=parent, **info)

    def append(self, kind: str, **body: Any) -> int:
        return self.append_then(kind, None, **body)

    def append_then(self, kind: str, after_write: Callable[[], None] | None, **body: Any) -> int:
        """``append``; ``after_write`` runs on the writer thread once the record is written
        (a process kill no longer loses it; not yet fsynced)."""
        with self._lock:
            self._check()
            lsn = self._next_lsn
            self._next_lsn += 1
            self._queue.append({"lsn": lsn, "kind": kind, **body})
            if after_write is not None:
                self._after_write[lsn] = after_write
            self._lock.notify_all()
        return lsn

    async def append_durable(self, kind: str, **body: Any) -> int:
        lsn = self.append(kind, **body)
        await self.wait_durable(lsn + 1)
        return lsn

    async def wait_durable(self, next_lsn: int) -> None:
        """Return once every record below ``next_lsn`` is fsynced."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._lock:
            self._check()
            if self._durable_lsn >= next_lsn - 1:
                return
            self._waiters.append((next_lsn - 1, loop, future))
            self._lock.notify_all()
        await future

    def rotate(self) -> None:
        """Start a new segment with the next record (so older ones can be trimmed)."""
        with self._lock:
            self._rotate = True

    def trim(self, keep_from_lsn: int) -> list[Path]:
        """Delete segments all of whose records are below ``keep_from_lsn``; never the
        segment being written nor the newest one."""
        segments = list_segments(self.directory)
        removed = []
        with self._lock:
            active = self._segment_path
        for (_, path), (next_first, _) in itertools.pairwise(segments):
            if next_first <= keep_from_lsn and path != active:
                path.unlink(missing_ok=True)
                removed.append(path)
        if removed:
            fsync_dir(self.directory)
        return removed

    def close(self) -> None:
        """Write and fsync everything queued, then stop the writer."""
        self._stop(abandon=False)

    def abandon(self) -> None:
        """Stop without writing what is still queued (tests: what a SIGKILL leaves)."""
        self._stop(abandon=True)

    def _stop(self, *, abandon: bool) -> None:
        if self._thread is None:
            return
        with self._lock:
            self._closing = True
            self._abandoned = abandon
            self._lock.notify_all()
        self._thread.join()
        self._thread = None
        if self._error is not None and not abandon:
            raise RuntimeError(f"commit log writer failed: {self._error}") from self._error

    def _check(self) -> None:
        if self._error is not None:
            raise RuntimeError(
                f"commit log writer for {self.directory} failed: {self._error}"
            ) from self._error

    # -- writer thread --------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                with self._lock:
                    while not self._queue and not self._closing and not self._unsatisfied():
                        self._lock.wait()
                    if self._closing and self._abandoned:
                        return
                    batch, self._queue = self._queue, []
                    rotate, self._rotate = self._rotate, False
                    closing = self._closing
                if batch:
                    self._write(batch, rotate=rotate)
                with self._lock:
                    sync = self._unsatisfied() or closing
                if sync and self._segment_fd is not None and self._written_lsn > self._durable_lsn:
                    os.fsync(self._segment_fd)
                    self.fsyncs += 1
                with self._lock:
                    if sync:
                        self._durable_lsn = max(self._durable_lsn, self._written_lsn)
                        self._resolve_waiters()
                    if closing and not self._queue:
                        return
        except BaseException as exc:  # disk full, I/O error: every waiter gets it
            with self._lock:
                self._error = exc
                for _, loop, future in self._waiters:
                    loop.call_soon_threadsafe(_fail, future, exc)
                self._waiters.clear()
            log.error("commit log writer for %s failed: %s", self.directory, exc)
        finally:
            if self._segment_fd is not None:
                os.close(self._segment_fd)
                self._segment_fd = None

    def _unsatisfied(self) -> bool:
        return any(target > self._durable_lsn for target, _, _ in self._waiters)

    def _resolve_waiters(self) -> None:
        keep = []
        for target, loop, future in self._waiters:
            if target <= self._durable_lsn:
                loop.call_soon_threadsafe(_done, future)
            else:
                keep.append((target, loop, future))
        self._waiters = keep

    def _write(self, batch: list[dict[str, Any]], *, rotate: bool) -> None:
        if rotate or self._segment_size >= self.segment_bytes:
            self._new_segment(batch[0]["lsn"])
        data = b"".join(encode_record(record) for record in batch)
        view = memoryview(data)
        assert self._segment_fd is not None
        while view:
            written = os.write(self._segment_fd, view)
            view = view[written:]
        self._segment_size += len(data)
        self._written_lsn = batch[-1]["lsn"]
        for record in batch:
            with self._lock:
                callback = self._after_write.pop(record["lsn"], None)
            if callback is not None:
                callback()
        self.records_written += len(batch)
        self.bytes_written += len(data)

    def _new_segment(self, first_lsn: int) -> None:
        if self._segment_fd is not None:
            os.fsync(self._segment_fd)
            os.close(self._segment_fd)
        path = self.directory / segment_name(first_lsn)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, 0o644)
        fsync_dir(self.directory)
        with self._lock:
            self._segment_fd, self._segment_path = fd, path
        self._segment_size = 0


def _done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


def _fail(future: asyncio.Future[None], exc: BaseException) -> None:
    if not future.done():
        future.set_exception(RuntimeError(f"commit log writer failed: {exc}"))


def needed_from_lsn(bundle_lsns: Iterable[int | None]) -> int | None:
    """The oldest LSN a selectable bundle replays from (None: no bundle uses the log)."""
    values = [lsn for lsn in bundle_lsns if lsn is not None]
    return min(values) if values else None
