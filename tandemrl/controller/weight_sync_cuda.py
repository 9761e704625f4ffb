"""Weight sync between GPU processes without a host round trip: CUDA IPC and NCCL.

All transports share one layout. The trainer packs its parameters — cast to the generation
dtype, each tied parameter once — into one flat device buffer (``FlatWeightSender``); the
generation side holds views of a buffer with the same ``WeightLayout`` and hands them to
``engine.update_weights(version, views)`` as a state dict, so the engine's own loader does
the final on-device copy. Per sync the trainer writes ``layout.nbytes`` once and every engine
reads it once; nothing touches host memory.

- ``DeviceWeightSync``: engines in the trainer's process (one GPU, or peer copies between
  GPUs): engines load views of the trainer's buffer directly.
- ``CudaIpcWeightSync``: engines in other processes that can map the trainer's memory (the
  same GPU, or peer GPUs of one host). The first sync sends each engine an IPC handle of the
  buffer (``torch.multiprocessing.reductions.reduce_tensor``: a picklable (rebuild, args)
  pair that any transport can carry, Ray's included); the engine process maps it once and
  keeps the mapping, so every later sync sends only the version number.
- ``NcclWeightSync``: engines on other GPUs (or hosts). The trainer is rank 0 of a small
  process group whose other ranks are the generation processes; each sync broadcasts the
  buffer from rank 0 into every engine's own buffer of the same layout. With gloo the same
  code runs on CPU (the unit tests do that).

The generation process side of both remote transports is ``FlatWeightReceiver``; an engine
host exposes ``attach_weight_buffer(handle, layout)`` and ``load_weight_buffer(version)`` (IPC)
or ``receive_weight_broadcast(version)`` (NCCL) by delegating to it.

Ordering: the controller calls ``sync`` only between train steps, and ``sync`` returns after
every engine has loaded, so the trainer never rewrites the buffer while a reader copies it
(stage → device synchronise → loads → return).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch.multiprocessing.reductions import reduce_tensor

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
            torch.cuda.synchronize(self.device)
        self.stages += 1

    def ipc_handle(self) -> tuple[Callable[..., torch.Tensor], tuple[Any, ...]]:
        return export_ipc_handle(self.buffer)


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
    def from_ipc_handle(
        cls, engine: WeightLoader, layout: WeightLayout, handle: Any
    ) -> FlatWeightReceiver:
        return cls(engine, layout, open_ipc_handle(handle))

    @classmethod
    def with_own_buffer(
        cls, engine: WeightLoader, layout: WeightLayout, device: torch.device | str
    ) -> FlatWeightReceiver:
        return cls(engine, layout, layout.allocate(device))

    async def load(self, version: int) -> None:
        await self.engine.update_weights(version, self.views)
        self.loads += 1

    async def receive_broadcast(self, version: int, *, group: Any = None) -> None:
        """Take part in rank 0's broadcast of the buffer, then load it as ``version``."""
        await asyncio.to_thread(_broadcast, self.buffer, group)
        await self.load(version)


def _broadcast(buffer: torch.Tensor, group: Any) -> None:
    dist.broadcast(buffer, src=0, group=group)
    if buffer.device.type == "cuda":
        torch.cuda.synchronize(buffer.device)


def init_weight_group(
    *, rank: int, world_size: int, init_method: str, backend: str, device: torch.device
) -> Any:
    """Join the trainer (rank 0) and generation processes (ranks 1..) in one process group.

    The group is the process's default group: in these processes nothing else uses
    ``torch.distributed``.
    """
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend=backend, init_method=init_method, world_size=world_size, rank=rank
    )
    return dist.group.WORLD


class DeviceWeightSync:
    """Engines in the trainer's process: each loads views of the trainer's buffer."""

    def __init__(self, sender: FlatWeightSender, engines: Sequence[WeightLoader]) -> None:
        self.sender = sender
        self.engines = list(engines)

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        await asyncio.to_thread(self.sender.stage)
        views = self.sender.layout.views(self.sender.buffer)
        await asyncio.gather(*(engine.update_weights(version, views) for engine in self.engines))
        return time.perf_counter() - started


class IpcWeightHost(Protocol):
    async def attach_weight_buffer(self, handle: Any, layout: WeightLayout) -> None: ...

    async def load_weight_buffer(self, version: int) -> None: ...


class CudaIpcWeightSync:
    """Engines in other processes of this host: they map the trainer's buffer once."""

    def __init__(self, sender: FlatWeightSender, engines: Sequence[IpcWeightHost]) -> None:
        self.sender = sender
        self.engines = list(engines)
        self._attached: set[int] = set()

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        # Staging runs off the event loop; the train pump is parked in this call meanwhile,
        # so nothing else touches the trainer's parameters.
        await asyncio.to_thread(self.sender.stage)
        new = [engine for engine in self.engines if id(engine) not in self._attached]
        if new:
            handle = self.sender.ipc_handle()
            await asyncio.gather(
                *(engine.attach_weight_buffer(handle, self.sender.layout) for engine in new)
            )
            self._attached.update(id(engine) for engine in new)
        await asyncio.gather(*(engine.load_weight_buffer(version) for engine in self.engines))
        return time.perf_counter() - started


class NcclWeightHost(Protocol):
    async def receive_weight_broadcast(self, version: int) -> None: ...


class NcclWeightSync:
    """Engines on other GPUs: rank 0 (the trainer) broadcasts the buffer to ranks 1..n."""

    def __init__(
        self, sender: FlatWeightSender, engines: Sequence[NcclWeightHost], *, group: Any = None
    ) -> None:
        self.sender = sender
        self.engines = list(engines)
        self.group = group

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        await asyncio.to_thread(self.sender.stage)
        await asyncio.gather(
            asyncio.to_thread(_broadcast, self.sender.buffer, self.group),
            *(engine.receive_weight_broadcast(version) for engine in self.engines),
        )
        return time.perf_counter() - started
