"""The generation side of weight sync: views of a flat buffer, and the host mixin.

``FlatWeightReceiver`` holds views of a buffer with the trainer's layout — mapped from the
trainer's (CUDA IPC) or its own (NCCL broadcast) — and loads them into the engine as a state
dict, so the engine's own loader does the final on-device copy. ``WeightReceiverHost`` is the
mixin a generation process (``GenerationWorker``) gets its transport methods from.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from typing import Any, Protocol

import torch

from tandemrl.transport.ipc import IpcBuffer
from tandemrl.transport.layout import WeightLayout, WeightSyncError, dtype_name
from tandemrl.transport.process_group import (
    WeightGroupAddress,
    bounded_broadcast,
    connect_group_store,
    join_process_group,
    leave_process_group,
)


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
