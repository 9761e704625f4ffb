"""The trainer's side of weight sync: the flat buffer it stages into, and the host mixin.

``FlatWeightSender`` owns the buffer on the trainer's device and copies (and casts) the live
parameters into it. ``WeightSenderHost`` is the mixin a trainer process (``PolicyWorker``)
gets its transport methods from: create the buffer, stage, export an IPC handle of it, and be
rank 0 of the broadcast group. ``LocalWeightSender`` wraps a model in the caller's own
process (benchmarks, tests).
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import torch

from tandemrl.transport.ipc import IpcBuffer
from tandemrl.transport.layout import _DTYPES, WeightLayout, WeightSyncError
from tandemrl.transport.process_group import (
    WeightGroupAddress,
    bounded_broadcast,
    join_process_group,
    leave_process_group,
    open_group_store,
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
