"""The process group of a sharded trainer's ranks: rendezvous, bounded waits, and the few
reductions one sharded step needs.

Rendezvous: rank 0 opens a TCP store on a free port of its node (port 0: the OS picks, so
nothing needs to be free in advance) and hands out a ``RankGroupAddress``; every rank, rank 0
included, then joins with ``join_rank_group``. The group is the process's default
``torch.distributed`` group (NCCL on GPUs, gloo on CPU), because FSDP2 and DTensor work on it.
Every wait is bounded by ``policy.dtensor_cfg.timeout_s``: the store's connect and
``init_process_group`` wait at most that long for the other ranks, and it is the group's
collective timeout (gloo fails the collective; NCCL's watchdog ends the process).

``Replicas`` is what a worker asks when its step depends on the other ranks:

- ``max_int``: the number of forward (and backward) passes every rank runs, so that the
  collectives FSDP2 issues in each pass line up on every rank (a rank with fewer micro-batches
  takes idle passes);
- ``sum_int``: the step's valid-token count, the normaliser of the token-mean loss;
- ``sum_tensor_``: the squared gradient norm over every rank's shards, summed on the device
  (clipping uses the global norm).

``LocalReplicas`` (one process, the unsharded workers) answers with its own numbers; the
sharded workers use ``GroupReplicas``. Reductions run with ``ReduceOp.SUM`` / ``MAX`` only:
gradient averaging over gloo can be silently wrong (pytorch #162338), so nothing here relies on
``AVG`` or a pre-multiplied sum.
"""

from __future__ import annotations

import datetime
import logging
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tandemrl.transport.process_group import node_address

log = logging.getLogger(__name__)


class RankGroupError(RuntimeError):
    """A rank could not join its trainer group, or the group broke."""


@dataclass(frozen=True)
class RankGroupAddress:
    """Where rank 0's store listens, and the group that meets there."""

    host: str
    port: int
    backend: str  # "nccl" on GPUs, "gloo" on CPU
    world_size: int
    timeout_s: float


def backend_for(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def open_rank_rendezvous(
    world_size: int, timeout_s: float, backend: str
) -> tuple[dist.TCPStore, RankGroupAddress]:
    """Rank 0: a TCP store on a free port of this node; keep the store alive until joined."""
    host = node_address()
    store = dist.TCPStore(
        host,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )
    return store, RankGroupAddress(host, int(store.port), backend, world_size, timeout_s)


def join_rank_group(
    address: RankGroupAddress,
    rank: int,
    *,
    store: dist.TCPStore | None = None,
    device: torch.device | None = None,
) -> None:
    """Join the trainer group as ``rank`` (rank 0 passes the store it opened); returns once
    every rank has joined, or raises ``RankGroupError`` after ``address.timeout_s``."""
    if dist.is_initialized():
        raise RankGroupError(
            "this process already belongs to a torch.distributed group; a trainer rank needs a "
            "process of its own"
        )
    timeout = datetime.timedelta(seconds=address.timeout_s)
    try:
        if store is None:
            store = dist.TCPStore(
                address.host, address.port, address.world_size, is_master=False, timeout=timeout
            )
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(
            backend=address.backend,
            store=store,
            rank=rank,
            world_size=address.world_size,
            timeout=timeout,
        )
        # A first collective while every rank is known to be present: a later death cannot
        # leave a rank stuck in communicator set-up, and a rank that never came fails here.
        probe = torch.ones(1, device=device if address.backend == "nccl" else "cpu")
        dist.all_reduce(probe)
        if int(probe.item()) != address.world_size:
            raise RankGroupError(f"rendezvous probe summed to {probe.item()}")
    except RankGroupError:
        raise
    except Exception as exc:  # a timeout, a refused connection: say which group and which key
        raise RankGroupError(
            f"trainer rank {rank} of {address.world_size} could not join the group at "
            f"{address.host}:{address.port} ({address.backend}) within {address.timeout_s:g} s "
            f"(policy.dtensor_cfg.timeout_s): {exc}"
        ) from exc
    log.info(
        "trainer rank %d of %d joined %s:%d (%s, pid %d)",
        rank,
        address.world_size,
        address.host,
        address.port,
        address.backend,
        os.getpid(),
    )


def leave_rank_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


class Replicas:
    """What one rank's step needs from the other ranks (see the module docstring)."""

    rank: int = 0
    world_size: int = 1
    device: torch.device = torch.device("cpu")  # where reductions of tensors run

    def max_int(self, value: int) -> int:
        return value

    def sum_int(self, value: int) -> int:
        return value

    def sum_tensor_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum ``tensor`` over the ranks in place (on ``device`` when a group is joined)."""
        return tensor


LocalReplicas = Replicas


class GroupReplicas(Replicas):
    """Reductions over the default process group (joined with ``join_rank_group``)."""

    def __init__(self, device: torch.device) -> None:
        if not dist.is_initialized():
            raise RankGroupError("GroupReplicas needs a joined rank group (join_rank_group)")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # NCCL reduces device tensors only; gloo host tensors.
        self.device = device if dist.get_backend() == "nccl" else torch.device("cpu")

    def _all_reduce_(self, tensor: torch.Tensor, op: dist.ReduceOp.RedOpType) -> torch.Tensor:
        if self.world_size > 1:  # one rank: the value is its own reduction, no collective
            dist.all_reduce(tensor, op=op)
        return tensor

    def _reduce(self, value: int, op: dist.ReduceOp.RedOpType) -> int:
        tensor = torch.tensor([value], dtype=torch.int64, device=self.device)
        return int(self._all_reduce_(tensor, op).item())

    def sum_tensor_(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._all_reduce_(tensor, dist.ReduceOp.SUM)

    def max_int(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.MAX)

    def sum_int(self, value: int) -> int:
        return self._reduce(value, dist.ReduceOp.SUM)
