"""CUDA IPC handles of the trainer's flat buffer (shared memory on CPU, for the tests)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.multiprocessing.reductions import reduce_tensor

from tandemrl.transport.layout import WeightSyncError


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
