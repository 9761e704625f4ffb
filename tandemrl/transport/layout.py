"""The flat weight buffer's layout: where each parameter lives in one contiguous tensor.

Every transport shares it. The trainer packs its parameters — cast to the generation dtype,
each tied parameter once — into one flat buffer; the generation side holds views of a buffer
with the same ``WeightLayout`` and hands them to its engine as a state dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


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


def dtype_name(dtype: torch.dtype) -> str:
    name = next((name for name, value in _DTYPES.items() if value == dtype), None)
    if name is None:
        raise ValueError(f"weight sync dtype must be one of {sorted(_DTYPES)}, got {dtype}")
    return name
