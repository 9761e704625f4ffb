"""Split one GPU's SMs between two sides of a process (CUDA green contexts).

An engine that decodes beside a trainer in one process runs its decode steps on a stream of
its own, but its many small kernels still wait for SMs behind the trainer's blocks (on the
H200 a 0.5B decode step took 1.8 ms beside training against 1.0 ms alone). A green context
owns a fixed set of SMs: work queued on a stream created from it runs on those SMs only. Two
green contexts made from one split of the device (a group of ``n`` SMs and the rest) never
share an SM, so each side keeps its SMs whatever the other runs.

PyTorch's ``torch.cuda.green_contexts.GreenContext.create(num_sms=...)`` takes a group of
``num_sms`` SMs and drops the rest, so two of them may overlap; this module makes one split
and keeps both parts, through the CUDA driver API (ctypes over ``libcuda``; CUDA 12.4 or
later).

    engine_share, trainer_share = split_sms(torch.device("cuda:0"), engine_sms=40)
    engine_share.enter()     # in the engine's step thread
    trainer_share.enter()    # in each thread that runs the trainer's kernels

``enter`` makes the share's stream the calling thread's current stream (kernels of the
caching allocator's memory, cuBLAS and compiled code then run on the share's SMs). Work
queued on other streams (the default stream, a thread that never entered) may still run on
any SM.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass

import torch

# From cuda.h.
_CU_DEV_RESOURCE_TYPE_SM = 1
_CU_GREEN_CTX_DEFAULT_STREAM = 0x1
_CU_STREAM_NON_BLOCKING = 0x1


class SmPartitionError(RuntimeError):
    """The device's SMs cannot be split as asked (no CUDA, an old driver, a bad count)."""


class _DevResource(ctypes.Structure):
    """``CUdevResource``: 144 bytes in CUDA 12 and 13, the SM count at byte 96."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("_padding", ctypes.c_ubyte * 92),
        ("sm_count", ctypes.c_uint),
        ("_rest", ctypes.c_ubyte * 44),
    ]


assert ctypes.sizeof(_DevResource) == 144


@dataclass(frozen=True)
class SmShare:
    """One side of a split: its SM count and a stream whose kernels run on those SMs only."""

    name: str
    sm_count: int
    stream: torch.cuda.ExternalStream
    # A second stream of the share, for CUDA graph capture (which needs a stream to itself).
    capture_stream: torch.cuda.ExternalStream
    green_context: int  # CUgreenCtx handle, kept alive for the process's life

    def enter(self) -> torch.cuda.Stream:
        """Make this share's stream the calling thread's current stream (on its device),
        after the work queued so far on the thread's stream; returns that stream."""
        torch.cuda.set_device(self.stream.device)
        previous = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(previous)
        torch.cuda.set_stream(self.stream)
        return previous


_driver_lock = threading.Lock()
_driver: ctypes.CDLL | None = None


def _libcuda() -> ctypes.CDLL:
    global _driver
    with _driver_lock:
        if _driver is None:
            try:
                _driver = ctypes.CDLL("libcuda.so.1")
            except OSError as error:
                message = f"cannot load the CUDA driver (libcuda.so.1): {error}"
                raise SmPartitionError(message) from error
        return _driver


def _call(name: str, *args: object) -> None:
    driver = _libcuda()
    function = getattr(driver, name, None)
    if function is None:
        raise SmPartitionError(
            f"the CUDA driver has no {name}: green contexts need a CUDA 12.4+ driver"
        )
    result = function(*args)
    if result != 0:
        text = ctypes.c_char_p()
        driver.cuGetErrorString(result, ctypes.byref(text))
        message = text.value.decode() if text.value else "unknown error"
        raise SmPartitionError(f"{name} failed with CUDA error {result}: {message}")


def _green_share(
    name: str, resource: _DevResource, device: torch.device, cu_device: int, priority: int
) -> SmShare:
    descriptor = ctypes.c_void_p()
    _call("cuDevResourceGenerateDesc", ctypes.byref(descriptor), ctypes.byref(resource), 1)
    green = ctypes.c_void_p()
    _call(
        "cuGreenCtxCreate",
        ctypes.byref(green),
        descriptor,
        ctypes.c_int(cu_device),
        ctypes.c_uint(_CU_GREEN_CTX_DEFAULT_STREAM),
    )
    streams = []
    for _ in range(2):
        stream = ctypes.c_void_p()
        _call(
            "cuGreenCtxStreamCreate",
            ctypes.byref(stream),
            green,
            ctypes.c_uint(_CU_STREAM_NON_BLOCKING),
            ctypes.c_int(priority),
        )
        streams.append(torch.cuda.ExternalStream(stream.value, device=device))
    return SmShare(
        name=name,
        sm_count=int(resource.sm_count),
        stream=streams[0],
        capture_stream=streams[1],
        green_context=int(green.value),
    )


def sms_used(programs: int = 4096) -> set[int]:
    """The SMs that ``programs`` Triton programs ran on (each reads ``%smid``), queued on the
    calling thread's current stream: a check of which SMs a share's work may take."""
    import triton
    import triton.language as tl

    @triton.jit
    def smid(out_ptr):
        sm = tl.inline_asm_elementwise(
            "mov.u32 $0, %smid;", "=r", [], dtype=tl.int32, is_pure=False, pack=1
        )
        spin = tl.program_id(0).to(tl.float32)
        for _ in range(1000):  # long enough that the programs spread over every SM they may use
            spin = spin * 1.0001 + 0.5
        tl.store(out_ptr + tl.program_id(0), sm + (spin * 0).to(tl.int32))

    out = torch.empty(programs, dtype=torch.int32, device="cuda")
    smid[(programs,)](out)
    torch.cuda.current_stream().synchronize()
    return set(out.tolist())


def split_sms(
    device: torch.device, engine_sms: int, *, engine_priority: int = -1
) -> tuple[SmShare, SmShare]:
    """Split ``device``'s SMs into an engine share of at least ``engine_sms`` SMs and a
    trainer share of the rest.

    The driver rounds the engine's count up to its SM group size (8 on Hopper), so the
    engine share may hold a few SMs more than asked; ``SmShare.sm_count`` says how many.
    The engine's stream gets ``engine_priority`` (lower runs first), the trainer's 0.
    """
    if device.type != "cuda":
        raise SmPartitionError(f"SM partitions need a CUDA device, got {device}")
    torch.cuda.init()
    index = device.index if device.index is not None else torch.cuda.current_device()
    device = torch.device("cuda", index)
    total = torch.cuda.get_device_properties(index).multi_processor_count
    if not 0 < engine_sms < total:
        raise SmPartitionError(
            f"engine_sms must be between 1 and {total - 1} on {device} ({total} SMs), "
            f"got {engine_sms}"
        )
    torch.zeros(1, device=device)  # the primary context exists before the green ones
    cu_device = ctypes.c_int()
    _call("cuDeviceGet", ctypes.byref(cu_device), ctypes.c_int(index))
    whole = _DevResource()
    _call(
        "cuDeviceGetDevResource",
        cu_device,
        ctypes.byref(whole),
        ctypes.c_int(_CU_DEV_RESOURCE_TYPE_SM),
    )
    group = _DevResource()
    rest = _DevResource()
    groups = ctypes.c_uint(1)
    _call(
        "cuDevSmResourceSplitByCount",
        ctypes.byref(group),
        ctypes.byref(groups),
        ctypes.byref(whole),
        ctypes.byref(rest),
        ctypes.c_uint(0),
        ctypes.c_uint(engine_sms),
    )
    if groups.value != 1 or group.sm_count < engine_sms or rest.sm_count == 0:
        raise SmPartitionError(
            f"cannot split {whole.sm_count} SMs of {device} into {engine_sms} for the engine "
            f"and the rest for the trainer (the driver gave {groups.value} group(s) of "
            f"{group.sm_count} SMs, {rest.sm_count} left)"
        )
    engine = _green_share("engine", group, device, cu_device.value, engine_priority)
    trainer = _green_share("trainer", rest, device, cu_device.value, 0)
    return engine, trainer
