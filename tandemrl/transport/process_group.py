"""The broadcast group of the NCCL transport (gloo on CPU): rendezvous, bounded broadcast.

The trainer (rank 0) opens a TCP store on a free port of its node; each generation worker
joins with its rank. Every wait is bounded by ``policy.generation.weight_sync_timeout_s``:
each rank polls its collective and aborts it at the deadline, so a dead or stuck peer costs a
timeout and an aborted group, never a thread stuck forever.
"""

from __future__ import annotations

import datetime
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

# How often a rank checks whether its broadcast finished (seconds).
POLL_INTERVAL_S = 0.0005
# NCCL's own timeout (its watchdog) is longer than a rank's deadline: a rank aborts its
# collective itself before the watchdog would tear the process down.
GROUP_SLACK_S = 60.0


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
