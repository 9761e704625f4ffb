"""Weight sync between processes without a host round trip: CUDA IPC and NCCL.

All transports share one layout. The trainer packs its parameters — cast to the generation
dtype, each tied parameter once — into one flat buffer (``FlatWeightSender``); the generation
side holds views of a buffer with the same ``WeightLayout`` and hands them to
``update_weights(version, views)`` as a state dict, so the engine's own loader does the final
on-device copy. Per sync the trainer writes ``layout.nbytes`` once and every engine reads it
once; nothing touches host memory.

Three roles, each usable in-process or behind a Ray actor (whose proxy has the same async
methods):

- trainer side, ``WeightSenderHost`` (a mixin of ``PolicyWorker``; ``LocalWeightSender`` wraps
  a model in the controller's process): owns the sender, stages into it, exports an IPC
  handle of it, and is rank 0 of the broadcast group;
- generation side, ``WeightReceiverHost`` (a mixin of ``GenerationWorker``): maps the
  trainer's buffer (``attach_weight_buffer`` / ``load_weight_buffer``) or joins the group and
  receives into its own buffer (``join_weight_group`` / ``receive_weight_broadcast``);
- the controller's synchroniser, one per transport, which only calls the two others:
  ``DeviceWeightSync`` (engines in the trainer's process), ``CudaIpcWeightSync`` (engines in
  other processes on the trainer's GPU: they map the buffer once, every later sync sends only
  the version) and ``NcclWeightSync`` (engines on other GPUs: rank 0 broadcasts the buffer;
  with gloo the same code runs on CPU).

A sync is: the trainer stages → every live engine loads → each engine reports the version.
The controller calls ``sync`` only between train steps, and ``sync`` returns after every
engine has loaded, so the trainer never rewrites the buffer while a reader copies it.

Failures. Engines are reached through the ``GenerationPool``: an engine whose process died is
taken out of rotation exactly as on the object-store path, and the sync carries on with the
rest. A broadcast group is formed over the live engines (the trainer opens a TCP store on a
free port of its node; each engine joins with its rank); when the live set changes — an engine
died mid-generation or mid-broadcast — the survivors and the trainer leave the group and form a
new one before the broadcast is retried. Every wait is bounded by
``policy.generation.weight_sync_timeout_s``: each rank polls its collective and aborts it at
the deadline, and the controller gives up on an answer that never comes, with an error that
names the setting.
"""

from __future__ import annotations

import asyncio
import datetime
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

from tandemrl.rollout.generation_pool import GenerationPool, is_worker_death

# Default for policy.generation.weight_sync_timeout_s (seconds one sync may wait on a peer).
DEFAULT_TIMEOUT_S = 120.0
# How often a rank checks whether its broadcast finished (seconds).
POLL_INTERVAL_S = 0.0005
# The controller waits this much longer than the ranks themselves, so a rank's own timeout
# (which names what it waited for) normally arrives first.
CONTROLLER_SLACK_S = 30.0
# NCCL's own timeout (its watchdog) is longer still: a rank aborts its collective itself
# before the watchdog would tear the process down.
GROUP_SLACK_S = 60.0


class WeightSyncError(RuntimeError):
    """A weight sync failed for a reason other than a generation worker's death."""


# Slot offsets are rounded up to this many elements (256 bytes in bf16) so every view starts
# on an aligned address and copies use wide loads.
ALIGN_ELEMENTS = 128

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass(frozen=True)
class TensorSlot:
    name: str
    shape: tuple[int, ...]
    offset: int  # in elements of the layout's dtype
    numel: int


@dataclass(frozen=True)
class WeightLayout:
    """Where each parameter lives in the flat buffer; ``aliases`` map tied names to a slot."""

    slots: tuple[TensorSlot, ...]
    aliases: tuple[tuple[str, str], ...]  # (tied name, name of the slot it shares)
    dtype: str
    numel: int

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize

    @property
    def names(self) -> list[str]:
        return [slot.name for slot in self.slots] + [alias for alias, _ in self.aliases]

    @classmethod
    def from_state_dict(
        cls, state_dict: Mapping[str, torch.Tensor], dtype: torch.dtype
    ) -> WeightLayout:
        """One slot per distinct storage; a name sharing storage with an earlier one aliases it."""
        dtype_name = next((name for name, value in _DTYPES.items() if value == dtype), None)
        if dtype_name is None:
            raise ValueError(f"weight sync dtype must be one of {sorted(_DTYPES)}, got {dtype}")
        slots: list[TensorSlot] = []
        aliases: list[tuple[str, str]] = []
        seen: dict[tuple[int, tuple[int, ...], tuple[int, ...]], str] = {}
        offset = 0
        for name, tensor in state_dict.items():
            if not tensor.is_floating_point():
                raise ValueError(
                    f"weight sync packs floating-point tensors only; {name!r} is {tensor.dtype}"
                )
            key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
            if tensor.numel() > 0 and key in seen:
                aliases.append((name, seen[key]))
                continue
            seen[key] = name
            slots.append(TensorSlot(name, tuple(tensor.shape), offset, tensor.numel()))
            offset += -(-tensor.numel() // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        return cls(tuple(slots), tuple(aliases), dtype_name, offset)

    def allocate(self, device: torch.device | str) -> torch.Tensor:
        return torch.empty(self.numel, dtype=self.torch_dtype, device=device)

    def views(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """A state dict of views into ``flat`` (tied names share their slot's view)."""
        self.check_buffer(flat)
        views = {
            slot.name: flat[slot.offset : slot.offset + slot.numel].view(slot.shape)
            for slot in self.slots
        }
        for alias, target in self.aliases:
            views[alias] = views[target]
        return views

    def check_buffer(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.numel or flat.dtype != self.torch_dtype:
            raise ValueError(
                f"weight buffer of shape {tuple(flat.shape)} and dtype {flat.dtype} does not "
                f"match the layout ({self.numel} elements of {self.dtype})"
            )


class FlatWeightSender:
    """Trainer side: the flat buffer on the trainer's device and the packing into it."""

    def __init__(self, model: torch.nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        self.model = model
        self.layout = WeightLayout.from_state_dict(model.state_dict(), dtype)
        self.device = next(model.parameters()).device
        self.buffer = self.layout.allocate(self.device)
        self._views = self.layout.views(self.buffer)
        self.stages = 0

    @torch.no_grad()
    def stage(self) -> None:
        """Copy (and cast) the live parameters into the buffer; returns when it is written.

        The state dict is read afresh each time: a checkpoint load may have replaced tensors.
        """
        state = self.model.state_dict()
        names = [slot.name for slot in self.layout.slots]
        missing = [name for name in names if name not in state]
        if missing:
            raise KeyError(f"weight sync: the model no longer has parameters {missing[:5]}")
        torch._foreach_copy_([self._views[name] for name in names], [state[n] for n in names])
        if self.device.type == "cuda":
            # This stream only: an engine sharing the process decodes on its own stream, and a
            # device-wide wait would also wait for its step in flight.
            torch.cuda.current_stream(self.device).synchronize()
        self.stages += 1

    def ipc_handle(self) -> IpcBuffer:
        return IpcBuffer.export(self.buffer)


def dtype_name(dtype: torch.dtype) -> str:
    name = next((name for name, value in _DTYPES.items() if value == dtype), None)
    if name is None:
        raise ValueError(f"weight sync dtype must be one of {sorted(_DTYPES)}, got {dtype}")
    return name


# ---------------------------------------------------------------------- CUDA IPC handles


def export_ipc_handle(tensor: torch.Tensor) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
    """A picklable (rebuild, args) pair; ``open_ipc_handle`` maps it in another process.

    For a CUDA tensor this is a CUDA IPC memory handle (the exporting process must keep the
    tensor alive while others map it); for a CPU tensor it is shared memory, which is what
    the CPU tests exercise.
    """
    if tensor.device.type == "cpu":
        tensor.share_memory_()
    return reduce_tensor(tensor)


def open_ipc_handle(handle: tuple[Callable[..., torch.Tensor], tuple[Any, ...]]) -> torch.Tensor:
    rebuild, args = handle
    return rebuild(*args)


def device_uuid(device: torch.device) -> str | None:
    """The physical GPU's UUID (None on CPU): device indices differ between processes that
    see different ``CUDA_VISIBLE_DEVICES`` (Ray sets it per actor), UUIDs do not."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass(frozen=True)
class IpcBuffer:
    """The trainer's flat buffer as an IPC handle plus the GPU it lives on."""

    handle: tuple[Callable[..., torch.Tensor], tuple[Any, ...]]
    gpu_uuid: str | None

    @classmethod
    def export(cls, buffer: torch.Tensor) -> IpcBuffer:
        return cls(export_ipc_handle(buffer), device_uuid(buffer.device))

    def open(self, local_device: torch.device) -> torch.Tensor:
        local = device_uuid(local_device)
        if self.gpu_uuid != local:
            raise WeightSyncError(
                f"CUDA IPC needs the trainer and the generation worker on one GPU, but the "
                f"trainer's buffer is on {self.gpu_uuid or 'the CPU'} and this worker runs on "
                f"{local or 'the CPU'}; use policy.generation.weight_sync: nccl (or "
                "colocated.enabled: true)"
            )
        return open_ipc_handle(self.handle)


# ---------------------------------------------------------------------- generation side


class WeightLoader(Protocol):
    async def update_weights(self, version: int, weights: Any) -> None: ...


class FlatWeightReceiver:
    """Generation side: views of a flat buffer (mapped from the trainer, or its own for NCCL)."""

    def __init__(self, engine: WeightLoader, layout: WeightLayout, buffer: torch.Tensor) -> None:
        layout.check_buffer(buffer)
        self.engine = engine
        self.layout = layout
        self.buffer = buffer
        self.views = layout.views(buffer)
        self.loads = 0

    @classmethod
    def with_own_buffer(
        cls, engine: WeightLoader, layout: WeightLayout, device: torch.device | str
    ) -> FlatWeightReceiver:
        return cls(engine, layout, layout.allocate(device))

    async def load(self, version: int) -> None:
        await self.engine.update_weights(version, self.views)
        self.loads += 1

    async def receive_broadcast(self, version: int, timeout_s: float) -> None:
        """Take part in rank 0's broadcast of the buffer, then load it as ``version``."""
        await asyncio.to_thread(bounded_broadcast, self.buffer, timeout_s)
        await self.load(version)


# ---------------------------------------------------------------------- the broadcast group


@dataclass(frozen=True)
class WeightGroupAddress:
    """Where the trainer's TCP store listens, and what the group it rendezvouses is."""

    host: str
    port: int
    backend: str  # "nccl" on GPUs, "gloo" on CPU
    world_size: int  # the trainer (rank 0) + one rank per generation worker
    timeout_s: float


def node_address() -> str:
    """This node's address as Ray knows it; loopback outside Ray (benchmarks, unit tests)."""
    try:
        import ray
    except ImportError:
        return "127.0.0.1"
    if not ray.is_initialized():
        return "127.0.0.1"
    return str(ray.util.get_node_ip_address())


def open_group_store(world_size: int, timeout_s: float) -> tuple[Any, str, int]:
    """A TCP store on a free port of this node (port 0: the OS picks; nothing fixed)."""
    host = node_address()
    store = dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, host, int(store.port)


def connect_group_store(address: WeightGroupAddress) -> Any:
    return dist.TCPStore(
        address.host,
        address.port,
        address.world_size,
        is_master=False,
        timeout=datetime.timedelta(seconds=address.timeout_s),
    )


def join_process_group(
    store: Any, address: WeightGroupAddress, *, rank: int, device: torch.device
) -> None:
    """Join the weight group as ``rank``; returns once every rank has joined.

    The group is the process's default group: in trainer and generation processes nothing
    else uses ``torch.distributed``. One tiny broadcast right after joining creates the NCCL
    communicator while every rank is known to be present, so a later death cannot leave a
    rank stuck inside communicator set-up.
    """
    if dist.is_initialized():
        leave_process_group()
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # NCCL: the watchdog must not fire before this rank aborts at its own deadline. gloo: the
    # operation itself fails at the deadline (destroying a gloo group waits for its pending
    # operations, so it must not outlive the deadline by much).
    slack = GROUP_SLACK_S if address.backend == "nccl" else 1.0
    dist.init_process_group(
        backend=address.backend,
        store=store,
        rank=rank,
        world_size=address.world_size,
        timeout=datetime.timedelta(seconds=address.timeout_s + slack),
    )
    bounded_broadcast(torch.zeros(1, device=device), address.timeout_s)


def bounded_broadcast(buffer: torch.Tensor, timeout_s: float) -> None:
    """Rank 0 sends ``buffer``, the others receive into theirs; at most ``timeout_s`` seconds.

    The collective is polled (``is_completed`` queries an event, it does not block), so a peer
    that died or hangs costs a timeout and an aborted group, never a thread stuck forever.
    """
    work = dist.broadcast(buffer, src=0, async_op=True)
    assert work is not None
    deadline = time.monotonic() + timeout_s
    error: Exception | None = None
    while not work.is_completed():
        if time.monotonic() > deadline:
            error = TimeoutError(
                f"weight broadcast did not complete within {timeout_s:g} s "
                "(policy.generation.weight_sync_timeout_s); a peer is dead or stuck"
            )
            break
        time.sleep(POLL_INTERVAL_S)
    else:
        try:
            work.wait()  # raises the collective's error (gloo: a peer closed its connection)
        except Exception as exc:
            error = exc
    if error is not None:
        # The group is broken. Tearing down this rank's side closes its connections, so peers
        # still waiting on it fail now instead of at their deadline; the work holds the group
        # (and its connections) too, so it goes first. A gloo operation still pending cannot
        # be cancelled (destroying its group waits for it): it ends at the group's own
        # timeout, just past this deadline, while this thread returns now.
        del work
        if not isinstance(error, TimeoutError) or dist.get_backend() == "nccl":
            _abort_process_group()
        raise error
    if buffer.device.type == "cuda":
        torch.cuda.synchronize(buffer.device)


def _abort_process_group() -> None:
    """Abort the default group (NCCL: ends the hung kernel); gloo groups are destroyed."""
    if not dist.is_initialized():
        return
    if dist.get_backend() == "nccl":
        from torch.distributed.distributed_c10d import _abort_process_group as abort

        abort()
    else:
        dist.destroy_process_group()


def leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class WeightSenderHost(ABC):
    """Trainer-side methods of the remote transports (a mixin; see the module docstring).

    A host class provides ``_weight_sync_model()`` and may override ``_weight_sync_run`` to
    serialise staging with its other uses of the model (``PolicyWorker`` runs it on its
    serial executor).
    """

    _weight_sender: FlatWeightSender | None = None
    _weight_store: Any = None

    @abstractmethod
    def _weight_sync_model(self) -> torch.nn.Module:
        """The model whose parameters the flat buffer carries."""

    async def _weight_sync_run(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.to_thread(fn, *args)

    def _sender(self) -> FlatWeightSender:
        if self._weight_sender is None:
            raise WeightSyncError("weight sync: create_weight_sender was not called first")
        return self._weight_sender

    async def create_weight_sender(self, dtype: str) -> WeightLayout:
        """Allocate the flat buffer (in the engines' ``dtype``) on the trainer's device."""
        if dtype not in _DTYPES:
            raise ValueError(f"weight sync dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        current = self._weight_sender
        if current is None or current.layout.dtype != dtype:
            self._weight_sender = await self._weight_sync_run(
                FlatWeightSender, self._weight_sync_model(), _DTYPES[dtype]
            )
        return self._sender().layout

    async def stage_weights(self) -> None:
        await self._weight_sync_run(self._sender().stage)

    async def weight_buffer_handle(self) -> IpcBuffer:
        return IpcBuffer.export(self._sender().buffer)

    async def open_weight_group(self, *, world_size: int, timeout_s: float) -> WeightGroupAddress:
        """Leave any earlier group and open the store the next one meets at."""
        await asyncio.to_thread(leave_process_group)
        store, host, port = open_group_store(world_size, timeout_s)
        self._weight_store = store
        backend = "nccl" if self._sender().device.type == "cuda" else "gloo"
        return WeightGroupAddress(host, port, backend, world_size, timeout_s)

    async def join_weight_group_as_sender(self, address: WeightGroupAddress) -> None:
        if self._weight_store is None:
            raise WeightSyncError("weight sync: open_weight_group was not called first")
        await asyncio.to_thread(
            join_process_group,
            self._weight_store,
            address,
            rank=0,
            device=self._sender().device,
        )

    async def broadcast_weights(self, timeout_s: float) -> None:
        await asyncio.to_thread(bounded_broadcast, self._sender().buffer, timeout_s)

    async def leave_weight_group(self) -> None:
        await asyncio.to_thread(leave_process_group)
        self._weight_store = None


class LocalWeightSender(WeightSenderHost):
    """The trainer side for a model in the controller's own process (benchmarks, tests)."""

    def __init__(self, sender: FlatWeightSender) -> None:
        self._weight_sender = sender

    def _weight_sync_model(self) -> torch.nn.Module:
        return self._sender().model


class WeightReceiverHost(ABC):
    """Generation-side methods of the remote transports (a mixin; see the module docstring).

    A host class has ``update_weights(version, weights)`` and an ``engine`` with ``device``
    and ``model`` (the torch engine); weights are loaded through the host's own
    ``update_weights`` so whatever it does around the engine (locks, counters) applies.
    """

    _weight_receiver: FlatWeightReceiver | None = None
    engine: Any

    @abstractmethod
    async def update_weights(self, version: int, weights: Any) -> None:
        """Load ``weights`` (a state dict of views) into the engine as ``version``."""

    def _weight_sync_device(self) -> torch.device:
        device = torch.device(self.engine.device)
        if device.type == "cuda" and device.index is None:  # "cuda": the current device
            device = torch.device("cuda", torch.cuda.current_device())
        return device

    async def weight_sync_dtype(self) -> str:
        """The dtype the engine's parameters hold: the buffer's dtype."""
        return dtype_name(next(self.engine.model.parameters()).dtype)

    def _receiver(self) -> FlatWeightReceiver:
        if self._weight_receiver is None:
            raise WeightSyncError(
                "weight sync: this worker has no weight buffer (attach_weight_buffer or "
                "join_weight_group first)"
            )
        return self._weight_receiver

    async def attach_weight_buffer(self, buffer: IpcBuffer, layout: WeightLayout) -> None:
        tensor = buffer.open(self._weight_sync_device())
        self._weight_receiver = FlatWeightReceiver(self, layout, tensor)

    async def load_weight_buffer(self, version: int) -> None:
        await self._receiver().load(version)

    async def join_weight_group(
        self, address: WeightGroupAddress, *, rank: int, layout: WeightLayout
    ) -> None:
        device = self._weight_sync_device()

        def join() -> None:
            store = connect_group_store(address)
            join_process_group(store, address, rank=rank, device=device)

        await asyncio.to_thread(join)
        current = self._weight_receiver
        if current is None or current.layout != layout or current.buffer.device != device:
            self._weight_receiver = FlatWeightReceiver.with_own_buffer(self, layout, device)

    async def receive_weight_broadcast(self, version: int, timeout_s: float) -> None:
        await self._receiver().receive_broadcast(version, timeout_s)

    async def leave_weight_group(self) -> None:
        await asyncio.to_thread(leave_process_group)


# ---------------------------------------------------------------------- the controller side


class DeviceWeightSync:
    """Engines in the trainer's process: each loads views of the trainer's buffer."""

    overlaps_training = False  # the engines read the trainer's live buffer

    def __init__(self, sender: FlatWeightSender, engines: Sequence[WeightLoader]) -> None:
        self.sender = sender
        self.engines = list(engines)

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        await asyncio.to_thread(self.sender.stage)
        views = self.sender.layout.views(self.sender.buffer)
        await asyncio.gather(*(engine.update_weights(version, views) for engine in self.engines))
        return time.perf_counter() - started


def _as_sender_host(sender: FlatWeightSender | Any) -> Any:
    return LocalWeightSender(sender) if isinstance(sender, FlatWeightSender) else sender


def _as_pool(engines: Sequence[Any] | GenerationPool) -> GenerationPool:
    return engines if isinstance(engines, GenerationPool) else GenerationPool(list(engines))


def _first_error(outcomes: Mapping[int, Any]) -> tuple[int, BaseException] | None:
    for index, result in outcomes.items():
        if isinstance(result, BaseException) and not is_worker_death(result):
            return index, result
    return None


class _RemoteWeightSync:
    """What both remote transports share: the trainer host, the pool, bounded waits."""

    overlaps_training = False  # the trainer process takes part in every transfer
    transport = ""

    def __init__(
        self,
        sender: FlatWeightSender | Any,
        engines: Sequence[Any] | GenerationPool,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.trainer = _as_sender_host(sender)
        self.pool = _as_pool(engines)
        self.timeout_s = timeout_s
        self.layout: WeightLayout | None = None

    async def _bounded(self, awaitable: Awaitable[Any], what: str) -> Any:
        limit = self.timeout_s + CONTROLLER_SLACK_S
        try:
            return await asyncio.wait_for(awaitable, limit)
        except TimeoutError as exc:
            raise WeightSyncError(
                f"weight sync over {self.transport}: {what} gave no answer within {limit:g} s "
                f"(policy.generation.weight_sync_timeout_s={self.timeout_s:g} plus "
                f"{CONTROLLER_SLACK_S:g} s)"
            ) from exc

    def _raise_first(self, outcomes: Mapping[int, Any], what: str) -> None:
        failed = _first_error(outcomes)
        if failed is not None:
            index, error = failed
            raise WeightSyncError(
                f"weight sync over {self.transport}: {what} failed on generation worker "
                f"{index}: {error}"
            ) from error

    async def _prepare(self) -> WeightLayout:
        """First sync: the trainer allocates its buffer in the dtype the engines hold."""
        if self.layout is None:
            dtypes = set(await self._bounded(self.pool.broadcast("weight_sync_dtype"), "dtype"))
            if len(dtypes) != 1:
                raise WeightSyncError(f"generation workers disagree on their dtype: {dtypes}")
            self.layout = await self._bounded(
                self.trainer.create_weight_sender(dtypes.pop()), "the trainer's buffer"
            )
        return self.layout

    async def _stage(self) -> WeightLayout:
        layout = await self._prepare()
        await self._bounded(self.trainer.stage_weights(), "staging on the trainer")
        return layout


class CudaIpcWeightSync(_RemoteWeightSync):
    """Engines in other processes on the trainer's GPU: they map the trainer's buffer once."""

    transport = "CUDA IPC"

    def __init__(
        self,
        sender: FlatWeightSender | Any,
        engines: Sequence[Any] | GenerationPool,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(sender, engines, timeout_s=timeout_s)
        self._attached: set[int] = set()

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        layout = await self._stage()
        new = [index for index in self.pool.live_indices if index not in self._attached]
        if new:
            buffer = await self._bounded(self.trainer.weight_buffer_handle(), "the IPC handle")
            outcomes = await self._bounded(
                self.pool.call_each(
                    lambda _index, engine: engine.attach_weight_buffer(buffer, layout),
                    indices=new,
                ),
                "mapping the buffer",
            )
            self._raise_first(outcomes, "mapping the buffer")
            self._attached.update(
                i for i, r in outcomes.items() if not isinstance(r, BaseException)
            )
        await self._bounded(self.pool.broadcast("load_weight_buffer", version), "loading")
        return time.perf_counter() - started


class NcclWeightSync(_RemoteWeightSync):
    """Engines on other GPUs: rank 0 (the trainer) broadcasts the buffer to ranks 1..n."""

    transport = "NCCL"

    def __init__(
        self,
        sender: FlatWeightSender | Any,
        engines: Sequence[Any] | GenerationPool,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(sender, engines, timeout_s=timeout_s)
        self.members: tuple[int, ...] | None = None  # pool indices of ranks 1..n
        self.groups_formed = 0

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        layout = await self._stage()
        # Each round either succeeds or loses at least one worker, so this ends.
        while True:
            self.pool.check_alive()
            if self.members != self.pool.live_indices:
                await self._form_group(layout)
            members = self.members
            trainer_result, outcomes = await self._bounded(
                asyncio.gather(
                    self.trainer.broadcast_weights(self.timeout_s),
                    self.pool.call_each(
                        lambda _index, engine: engine.receive_weight_broadcast(
                            version, self.timeout_s
                        ),
                        indices=members,
                    ),
                    return_exceptions=True,
                ),
                "the broadcast",
            )
            if isinstance(outcomes, BaseException):
                raise outcomes
            if members != self.pool.live_indices:
                continue  # a worker died during the broadcast: re-form among the survivors
            if isinstance(trainer_result, BaseException):
                raise WeightSyncError(
                    f"weight sync over {self.transport}: the trainer's broadcast failed: "
                    f"{trainer_result}"
                ) from trainer_result
            self._raise_first(outcomes, "receiving the broadcast")
            return time.perf_counter() - started

    async def _form_group(self, layout: WeightLayout) -> None:
        """Trainer (rank 0) and every live worker (ranks 1..n) meet in a new group."""
        while True:
            if self.members is not None:  # leave the old group (survivors only)
                await self._bounded(self.trainer.leave_weight_group(), "leaving the group")
                outcomes = await self._bounded(
                    self.pool.call_each(
                        lambda _index, engine: engine.leave_weight_group(), indices=self.members
                    ),
                    "leaving the group",
                )
                self._raise_first(outcomes, "leaving the group")
                self.members = None
            self.pool.check_alive()
            members = self.pool.live_indices
            ranks = {index: rank for rank, index in enumerate(members, start=1)}
            address = await self._bounded(
                self.trainer.open_weight_group(
                    world_size=1 + len(members), timeout_s=self.timeout_s
                ),
                "opening the group",
            )
            trainer_result, outcomes = await self._bounded(
                asyncio.gather(
                    self.trainer.join_weight_group_as_sender(address),
                    self.pool.call_each(
                        lambda index, engine, address=address, ranks=ranks: (
                            engine.join_weight_group(address, rank=ranks[index], layout=layout)
                        ),
                        indices=members,
                    ),
                    return_exceptions=True,
                ),
                "joining the group",
            )
            if isinstance(outcomes, BaseException):
                raise outcomes
            self.members = members
            if members != self.pool.live_indices:
                continue  # a worker died while joining: leave, and form it again
            if isinstance(trainer_result, BaseException):
                raise WeightSyncError(
                    f"weight sync over {self.transport}: the trainer could not form the group "
                    f"at {address.host}:{address.port}: {trainer_result}"
                ) from trainer_result
            self._raise_first(outcomes, "joining the group")
            self.groups_formed += 1
            return
