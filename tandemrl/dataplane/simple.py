"""``data_plane.backend: simple``: rows held by TransferQueue (0.1.11) storage actors.

What runs where:

    caller's event loop ── SimpleDataPlane.put/get/clear/keys ──┐   (any loop; each call is
                                                                 │    bounded by call_timeout_s)
    "tq-io" thread: private asyncio loop + AsyncTransferQueueClient (ZMQ DEALER sockets)
          │ metadata (keys, tags)              │ row payloads
          ▼                                    ▼
    TransferQueueController actor        SimpleStorageUnit actors (num_storage_units)

Each plane starts its own, unnamed controller and storage units (so several planes can live in
one Ray cluster or namespace, unlike ``transfer_queue.init()``, which keeps one named instance
and process-global clients) and its own client; nothing goes through TransferQueue's
module-level state.

Small-machine start-up, from what we measured on 2-core machines (docs/dataplane.md):

- The actors reserve no Ray CPUs (TransferQueue's default of 1 each made its default start
  need 3 CPUs and hang silently under ``num_cpus=2``). They are I/O servers; the cores they
  actually use are shared with everything else anyway.
- The controller runs in polling mode (a blocking fetch would freeze its single request
  thread); this plane only uses key lookups (``force_fetch``), which never block.
- TransferQueue sets torch's thread count to ``TQ_NUM_THREADS`` (default 8) around every put
  and get, and its ZMQ context starts 8 I/O threads. Both come from the core count here (see
  ``tq_thread_count``). torch's thread count is per OS thread, and every client call runs on
  the private "tq-io" thread, so the caller's own torch thread count is never touched.
- Sockets: TransferQueue binds its servers to the Ray node's IP address
  (``ray.util.get_node_ip_address()``) and exposes no option for it. A local run binds them to
  loopback only when Ray itself was started with ``_node_ip_address="127.0.0.1"``.
  ``bind_address`` reports what the servers bound.

Errors and timeouts: TransferQueue clients wait forever for a controller or storage unit that
died. Every call here is bounded by ``data_plane.call_timeout_s``; on expiry the request is
cancelled (TransferQueue then discards the socket) and a ``DataPlaneError`` names the backend
and the call. Start-up (actor creation, handshakes) is bounded by ``STARTUP_TIMEOUT_S``.

Snapshots (``save``/``load``) are ours, not TransferQueue's pickle checkpoint: rows are fetched
in chunks and written as safetensors files with a JSON manifest holding each file's sha256 and
each row's digest (the same ``row_digest`` as the local backend), published atomically.
There is no consumption state to save: this plane reads by key (``force_fetch``), and the
controller decides what is consumed and clears it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hashlib
import importlib.util
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors.torch import save as safetensors_save

from tandemrl.config.models import DataPlaneConfig
from tandemrl.dataplane import tq_rows
from tandemrl.dataplane.atomic import atomic_directory, write_file_synced
from tandemrl.dataplane.base import DataPlane, DataPlaneError, Row
from tandemrl.dataplane.local import SNAPSHOT_FORMAT as LOCAL_SNAPSHOT_FORMAT
from tandemrl.dataplane.local import read_snapshot as read_local_snapshot
from tandemrl.dataplane.local import row_digest
from tandemrl.dataplane.manifest import (
    MANIFEST_NAME,
    read_snapshot_manifest,
    read_verified_tensors,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

BACKEND = "simple"
# One partition per plane: each plane has its own controller, so a fixed name is unambiguous.
PARTITION_ID = "rows"
# Creating the actors and the client's handshake with the controller took about 5.5 s on the
# 2-core machines; allow for a loaded cluster.
STARTUP_TIMEOUT_S = 120.0
# Closing: time to let storage units stop their threads before they are killed.
SHUTDOWN_TIMEOUT_S = 10.0
# save() fetches and writes rows in chunks of this many, so memory stays bounded by a chunk.
SAVE_CHUNK_ROWS = 256

SNAPSHOT_FORMAT = "tandemrl.simple_data_plane"
SNAPSHOT_VERSION = 1


_MISSING_TQ = (
    "simple data plane: data_plane.backend 'simple' needs TransferQueue; install it with "
    "`pip install -e .[tq]` (transferqueue==0.1.11), or use data_plane.backend: local"
)


def tq_thread_count(cpu_count: int | None = None) -> int:
    """Threads TransferQueue may use per process (torch ops in put/get, ZMQ I/O).

    One per four cores, at least 1 and at most 8 (TransferQueue's own default): a 2-core
    machine gets 1, a 64-core GPU node gets 8.
    """
    cores = cpu_count if cpu_count is not None else (os.cpu_count() or 1)
    return max(1, min(8, cores // 4))


def _import_transfer_queue() -> Any:
    """Import TransferQueue, with its import-time thread settings taken from the core count."""
    threads = str(tq_thread_count())
    os.environ.setdefault("TQ_NUM_THREADS", threads)
    os.environ.setdefault("TQ_CLIENT_ZMQ_IO_THREADS", threads)
    try:
        import transfer_queue
        import transfer_queue.client
    except ImportError as exc:
        raise DataPlaneError(_MISSING_TQ) from exc
    # The client reads TQ_NUM_THREADS once, at import; when something imported TransferQueue
    # before us, the default (8) stuck, and every put/get on a machine with fewer cores logs a
    # warning while clamping it. Set the value the environment variable would have set.
    transfer_queue.client.TQ_NUM_THREADS = int(os.environ["TQ_NUM_THREADS"])
    return transfer_queue


class _IoThread:
    """A daemon thread running one asyncio loop, where every TransferQueue coroutine runs."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        torch.set_num_threads(1)
        self.loop.run_forever()

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)  # type: ignore[arg-type]

    def stop(self, timeout_s: float) -> bool:
        """Cancel what still runs, stop the loop, join the thread; False on a timeout."""

        async def drain() -> None:
            # Calls that timed out may still be cancelling; let them finish before the loop
            # closes, so no task is destroyed while pending.
            pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=min(1.0, timeout_s))
            asyncio.get_running_loop().stop()

        self.submit(drain())
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            return False
        self.loop.close()
        return True


class SimpleDataPlane(DataPlane):
    """Rows in TransferQueue storage units; metadata (keys, row tags) in its controller."""

    backend_name = BACKEND
    supports_native_save = True

    def __init__(self, cfg: DataPlaneConfig) -> None:
        if importlib.util.find_spec("transfer_queue") is None:
            raise DataPlaneError(_MISSING_TQ)
        self.cfg = cfg
        self._start_lock = threading.Lock()
        self._io: _IoThread | None = None
        self._client: Any = None
        self._controller: Any = None
        self._storage_units: dict[str, Any] = {}
        self._bind_address: str | None = None
        self._closed = False

    def __reduce__(self) -> tuple[Any, tuple[DataPlaneConfig]]:
        # An unstarted plane is just its config (the driver may build it and hand it to the
        # controller actor); a started one owns a thread, sockets and actor handles.
        if self._client is not None or self._closed:
            raise DataPlaneError(
                "simple data plane: a started or closed plane cannot be pickled; build the "
                "plane in the process that uses it (or pass it on before its first call)"
            )
        return (SimpleDataPlane, (self.cfg,))

    # ------------------------------------------------------------------ lifecycle

    @property
    def started(self) -> bool:
        return self._client is not None

    @property
    def bind_address(self) -> str | None:
        """The IP address TransferQueue's servers bound to (None before start)."""
        return self._bind_address

    @property
    def storage_unit_names(self) -> list[str]:
        return list(self._storage_units)

    def actors(self) -> dict[str, Any]:
        """Ray handles of this plane's actors: ``"controller"`` and each storage unit by name."""
        handles = {"controller": self._controller} if self._controller is not None else {}
        return handles | self._storage_units

    async def start(self) -> None:
        """Create the controller, storage units and client; idempotent, run by every call."""
        if self._closed:
            raise DataPlaneError("simple data plane: the plane was closed")
        if self._client is not None:
            return
        try:
            await asyncio.wait_for(asyncio.to_thread(self._start_blocking), STARTUP_TIMEOUT_S + 5.0)
        except TimeoutError as exc:
            raise DataPlaneError(
                f"simple data plane start: TransferQueue did not come up within {STARTUP_TIMEOUT_S}s"
            ) from exc

    def _start_blocking(self) -> None:
        with self._start_lock:
            if self._client is not None:
                return
            deadline = time.monotonic() + STARTUP_TIMEOUT_S
            try:
                self._start_actors_and_client(deadline)
            except DataPlaneError:
                self._teardown(raise_errors=False)
                raise
            except Exception as exc:
                self._teardown(raise_errors=False)
                raise DataPlaneError(
                    f"simple data plane start: TransferQueue failed to start: {type(exc).__name__}: {exc}"
                ) from exc

    def _start_actors_and_client(self, deadline: float) -> None:
        import ray

        if not ray.is_initialized():
            raise DataPlaneError(
                "simple data plane start: data_plane.backend 'simple' needs a running Ray "
                "session (tandemrl train starts one; in your own script call ray.init() first)"
            )
        tq = _import_transfer_queue()
        from transfer_queue.controller import TransferQueueController
        from transfer_queue.storage.simple_storage import SimpleStorageUnit

        threads = str(tq_thread_count())
        run_id = uuid.uuid4().hex[:12]
        num_units = self.cfg.num_storage_units
        # The unit reads TQ_NUM_THREADS at import, in its own process.
        unit_env = {"env_vars": {"TQ_NUM_THREADS": threads, "OMP_NUM_THREADS": "1"}}
        # Every put first looks its ids up (they must be new); the controller logs each miss as a
        # warning, so its log level is ERROR unless TQ_LOGGING_LEVEL says otherwise.
        controller_env = {
            "env_vars": {"TQ_LOGGING_LEVEL": os.environ.get("TQ_LOGGING_LEVEL", "ERROR")}
        }
        self._controller = TransferQueueController.options(
            num_cpus=0, runtime_env=controller_env
        ).remote(sampler=tq.SequentialSampler(), polling_mode=True)
        unit_config = {
            "total_storage_size": None,
            "num_data_storage_units": num_units,
            "_run_id": run_id,
            "ssd_offload": {"enabled": False},
        }
        for rank in range(num_units):
            name = f"tandemrl-{run_id}-unit{rank}"
            self._storage_units[name] = SimpleStorageUnit.options(
                num_cpus=0, runtime_env=unit_env
            ).remote(config=unit_config)

        def remaining() -> float:
            left = deadline - time.monotonic()
            if left <= 0:
                raise DataPlaneError(
                    f"simple data plane start: TransferQueue actors were not ready within "
                    f"{STARTUP_TIMEOUT_S}s (see `ray status` for pending actors)"
                )
            return left

        try:
            controller_info = ray.get(
                self._controller.get_zmq_server_info.remote(), timeout=remaining()
            )
            unit_infos = {
                name: ray.get(handle.get_zmq_server_info.remote(), timeout=remaining())
                for name, handle in self._storage_units.items()
            }
        except ray.exceptions.GetTimeoutError as exc:
            raise DataPlaneError(
                f"simple data plane start: TransferQueue actors were not ready within "
                f"{STARTUP_TIMEOUT_S}s (see `ray status` for pending actors)"
            ) from exc
        self._bind_address = controller_info.ip

        from transfer_queue.client import AsyncTransferQueueClient

        client = AsyncTransferQueueClient(
            client_id=f"tandemrl-{run_id}-{os.getpid()}",
            controller_info=controller_info,
            zmq_io_threads=int(threads),
        )
        # Handshakes with the controller (bounded by TQ_STORAGE_HANDSHAKE_TIMEOUT, 30 s).
        client.initialize_storage_manager(
            manager_type="SimpleStorage", config={"zmq_info": unit_infos}
        )
        self._io = _IoThread(name=f"tq-io-{run_id}")
        self._client = client
        logger.info(
            "simple data plane: TransferQueue controller and %d storage unit(s) bound to %s",
            num_units,
            self._bind_address,
        )

    async def close(self) -> None:
        """Stop the client, then the storage units and the controller (bounded, idempotent)."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._teardown, True)

    def _teardown(self, raise_errors: bool) -> None:
        import ray

        problems: list[str] = []
        if self._io is not None and not self._io.stop(SHUTDOWN_TIMEOUT_S):
            problems.append(f"the tq-io thread did not stop within {SHUTDOWN_TIMEOUT_S}s")
        self._io = None
        if self._client is not None:
            try:
                self._client.close()
            except Exception as exc:
                problems.append(f"client close: {type(exc).__name__}: {exc}")
            self._client = None
        units = list(self._storage_units.values())
        if units:
            try:
                ray.get([unit.shutdown.remote() for unit in units], timeout=SHUTDOWN_TIMEOUT_S)
            except Exception as exc:
                # A unit that is already dead or hung is killed below either way.
                logger.info(
                    "simple data plane close: storage unit shutdown: %s: %s",
                    type(exc).__name__,
                    exc,
                )
        for handle in [*units, self._controller]:
            if handle is None:
                continue
            try:
                ray.kill(handle)
            except Exception as exc:
                problems.append(f"ray.kill: {type(exc).__name__}: {exc}")
        self._storage_units = {}
        self._controller = None
        if problems and raise_errors:
            raise DataPlaneError(f"simple data plane close: {'; '.join(problems)}")
        for problem in problems:
            logger.warning("simple data plane close: %s", problem)

    # ------------------------------------------------------------------ bounded calls

    async def _call(self, call: str, make_coro: Callable[[Any], Awaitable[T]]) -> T:
        """Run ``make_coro(client)`` on the tq-io loop, bounded by ``call_timeout_s``."""
        await self.start()
        assert self._io is not None
        timeout_s = self.cfg.call_timeout_s
        future = self._io.submit(make_coro(self._client))
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError as exc:
            future.cancel()
            raise DataPlaneError(
                f"simple data plane {call}: no answer from TransferQueue within "
                f"data_plane.call_timeout_s={timeout_s}s (controller or a storage unit is "
                "dead or overloaded)"
            ) from exc
        except DataPlaneError:
            raise
        except Exception as exc:
            raise DataPlaneError(f"simple data plane {call}: {type(exc).__name__}: {exc}") from exc

    # ------------------------------------------------------------------ DataPlane
    # Each method is one bounded call: everything it asks TransferQueue runs in one coroutine
    # on the tq-io loop, under one call_timeout_s.

    async def put(self, rows: Mapping[str, Row]) -> None:
        for sample_id, row in rows.items():
            tq_rows.check_row("put", sample_id, row)
        if not rows:
            return
        keys = list(rows)
        groups = tq_rows.pack_rows(rows)

        async def put_all(client: Any) -> None:
            found = await client.async_kv_retrieve_meta(
                keys=keys, partition_id=PARTITION_ID, create=False
            )
            duplicates = [key for key in map(tq_rows.tag_key, found.custom_meta) if key is not None]
            if duplicates:
                raise DataPlaneError(
                    f"simple data plane put: sample id(s) already stored: "
                    f"{_show(sorted(duplicates))} (a sample id is written once; clear it before "
                    "reusing it)"
                )
            for group in groups:
                await self._put_group(client, group)

        await self._call("put", put_all)

    async def _put_group(self, client: Any, group: tq_rows.PackedGroup) -> None:
        meta = await client.async_kv_retrieve_meta(
            keys=group.keys, partition_id=PARTITION_ID, create=True
        )
        if meta.size != len(group.keys):
            raise RuntimeError(f"controller registered {meta.size} of {len(group.keys)} sample ids")
        meta.update_custom_meta(group.tags)
        try:
            # Writes the storage units, then the tags: a row is visible (tagged) only once whole.
            await client.async_put(group.batch, meta)
        except Exception as put_error:
            # Release the ids registered above. An id left behind untagged is invisible to
            # get/keys and a later put of it overwrites it, so a failed clean-up only leaks.
            try:
                await asyncio.wait_for(client.async_clear_samples(meta), self.cfg.call_timeout_s)
            except Exception as clear_error:
                raise RuntimeError(
                    f"{put_error}; releasing the registered ids also failed: "
                    f"{type(clear_error).__name__}: {clear_error}"
                ) from put_error
            raise

    async def get(self, keys: Iterable[str]) -> dict[str, Row]:
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return {}
        return await self._call("get", lambda client: self._get_all(client, wanted))

    @staticmethod
    async def _get_all(client: Any, wanted: list[str]) -> dict[str, Row]:
        found = await client.async_kv_retrieve_meta(
            keys=wanted, partition_id=PARTITION_ID, create=False
        )
        specs: dict[str, dict[str, tuple[torch.dtype, tuple[int, ...]]]] = {}
        for tag in found.custom_meta:
            key, spec = tq_rows.tag_key(tag), tq_rows.tag_fields(tag)
            if key is not None and spec is not None:
                specs[key] = spec
        missing = [key for key in wanted if key not in specs]
        if missing:
            raise DataPlaneError(
                f"simple data plane get: sample id(s) not stored: {_show(missing)}"
            )

        # TransferQueue fetches the fields that every requested sample has, so rows with
        # different field sets are fetched group by group (usually there is one group, and the
        # lookup above already is its metadata).
        groups: dict[tuple[str, ...], list[str]] = {}
        for key in wanted:
            groups.setdefault(tuple(sorted(specs[key])), []).append(key)
        rows: dict[str, Row] = {}
        for fields, group_keys in groups.items():
            if len(groups) == 1 and found.size == len(wanted):
                meta = found
            else:
                meta = await client.async_kv_retrieve_meta(
                    keys=group_keys, partition_id=PARTITION_ID, create=False
                )
            if sorted(meta.field_names) != list(fields) or meta.size != len(group_keys):
                raise RuntimeError(
                    f"stored rows changed while being read (fields {meta.field_names}, "
                    f"{meta.size} rows; expected fields {list(fields)}, {len(group_keys)} rows)"
                )
            batch = await client.async_get_data(meta)
            rows.update(tq_rows.unpack_rows(group_keys, [specs[key] for key in group_keys], batch))
        return {key: rows[key] for key in wanted}

    async def clear(self, keys: Iterable[str]) -> None:
        wanted = list(dict.fromkeys(keys))
        if not wanted:
            return

        async def clear_found(client: Any) -> None:
            meta = await client.async_kv_retrieve_meta(
                keys=wanted, partition_id=PARTITION_ID, create=False
            )
            if meta.size > 0:
                await client.async_clear_samples(meta)

        await self._call("clear", clear_found)

    async def keys(self) -> list[str]:
        listing = await self._call("keys", lambda client: client.async_kv_list(PARTITION_ID))
        tags = listing.get(PARTITION_ID, {})
        # Only tagged ids: a put registers the id first and tags it once the row is stored.
        return [key for key, tag in tags.items() if tq_rows.tag_key(tag) is not None]

    # ------------------------------------------------------------------ snapshots

    async def save(self, directory: Path, keys: Iterable[str] | None = None) -> dict[str, str]:
        directory = Path(directory)
        sample_ids = await self.keys() if keys is None else list(dict.fromkeys(keys))
        digests: dict[str, str] = {}
        manifest_rows: dict[str, dict[str, Any]] = {}
        files: dict[str, dict[str, Any]] = {}
        try:
            with atomic_directory(directory) as tmp_dir:
                for chunk_index, start in enumerate(range(0, len(sample_ids), SAVE_CHUNK_ROWS)):
                    chunk_ids = sample_ids[start : start + SAVE_CHUNK_ROWS]
                    try:
                        rows = await self.get(chunk_ids)
                    except DataPlaneError as exc:
                        raise DataPlaneError(
                            f"simple data plane save to {directory}: {exc}"
                        ) from exc
                    file_name = f"rows-{chunk_index:05d}.safetensors"
                    tensors: dict[str, torch.Tensor] = {}
                    for position, sample_id in enumerate(chunk_ids):
                        row = rows[sample_id]
                        fields = sorted(row)
                        for field_index, field in enumerate(fields):
                            tensors[f"{position}.{field_index}"] = row[field].contiguous()
                        digests[sample_id] = row_digest(row)
                        manifest_rows[sample_id] = {
                            "file": file_name,
                            "position": position,
                            "fields": fields,
                            "digest": digests[sample_id],
                        }
                    payload = safetensors_save(tensors)
                    await asyncio.to_thread(write_file_synced, tmp_dir / file_name, payload)
                    files[file_name] = {
                        "bytes": len(payload),
                        "sha256": hashlib.sha256(payload).hexdigest(),
                    }
                manifest = {
                    "format": SNAPSHOT_FORMAT,
                    "version": SNAPSHOT_VERSION,
                    "files": files,
                    "rows": manifest_rows,
                }
                write_file_synced(
                    tmp_dir / MANIFEST_NAME, json.dumps(manifest, indent=1, sort_keys=True).encode()
                )
        except DataPlaneError:
            raise
        except OSError as exc:
            raise DataPlaneError(f"simple data plane save to {directory}: {exc}") from exc
        return digests

    async def load(self, directory: Path) -> dict[str, str]:
        """Load a snapshot of this backend, or of the local backend (switching backends)."""
        directory = Path(directory)
        # Verify every file before storing anything: a bad snapshot leaves no partial restore.
        if _snapshot_format(directory) == LOCAL_SNAPSHOT_FORMAT:
            rows, digests = await asyncio.to_thread(read_local_snapshot, directory)
            rows_by_file = [rows]
        else:
            manifest = _read_manifest(directory)
            rows_by_file = await asyncio.to_thread(_read_verified_rows, directory, manifest)
            digests = {key: str(entry["digest"]) for key, entry in manifest["rows"].items()}
        loaded: list[str] = []
        try:
            for rows in rows_by_file:
                await self.put(rows)
                loaded.extend(rows)
        except DataPlaneError as exc:
            if loaded:
                await self.clear(loaded)
            raise DataPlaneError(f"simple data plane load from {directory}: {exc}") from exc
        return digests


def _snapshot_format(directory: Path) -> str | None:
    """The manifest's ``format`` when it can be read; None otherwise (load then says why)."""
    try:
        manifest = json.loads((directory / MANIFEST_NAME).read_bytes())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return None
    return manifest.get("format") if isinstance(manifest, dict) else None


def _show(keys: list[str], limit: int = 20) -> str:
    shown = ", ".join(keys[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _read_manifest(directory: Path) -> dict[str, Any]:
    manifest_path, manifest = read_snapshot_manifest(
        directory, backend="simple", snapshot_format=SNAPSHOT_FORMAT, version=SNAPSHOT_VERSION
    )
    try:
        for entry in manifest["rows"].values():
            if entry["file"] not in manifest["files"]:
                raise DataPlaneError(
                    f"simple data plane load: {manifest_path} names file {entry['file']!r} "
                    "without its size and digest"
                )
            int(entry["position"])
            list(entry["fields"])
            str(entry["digest"])
        for info in manifest["files"].values():
            int(info["bytes"])
            str(info["sha256"])
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise DataPlaneError(
            f"simple data plane load: {manifest_path} is malformed (missing or bad entry {exc})"
        ) from exc
    return manifest


def _read_verified_rows(directory: Path, manifest: dict[str, Any]) -> list[dict[str, Row]]:
    """Every file's rows, after checking each file's size and sha256 and each row's digest."""
    by_file: dict[str, list[tuple[str, dict[str, Any]]]] = {}
    for sample_id, entry in manifest["rows"].items():
        by_file.setdefault(entry["file"], []).append((sample_id, entry))
    result: list[dict[str, Row]] = []
    for file_name, info in sorted(manifest["files"].items()):
        path = directory / file_name
        tensors = read_verified_tensors(
            path,
            backend="simple",
            expected_bytes=int(info["bytes"]),
            expected_sha256=str(info["sha256"]),
        )
        rows: dict[str, Row] = {}
        for sample_id, entry in by_file.get(file_name, []):
            try:
                row = {
                    field: tensors[f"{entry['position']}.{index}"]
                    for index, field in enumerate(entry["fields"])
                }
            except KeyError as exc:
                raise DataPlaneError(
                    f"simple data plane load: {path} lacks tensor {exc} of row {sample_id!r}"
                ) from exc
            if row_digest(row) != entry["digest"]:
                raise DataPlaneError(
                    f"simple data plane load: row {sample_id!r} in {path} does not match its digest "
                    f"in {directory / MANIFEST_NAME}"
                )
            rows[sample_id] = row
        result.append(rows)
    return result
