"""Weight synchronisation from the policy trainer to every generation engine.

The controller only calls ``await sync(version)`` after each optimizer step and logs the
seconds it took; how weights travel is the synchroniser's business. One synchroniser per
transport; each only calls the trainer's and the engines' transport methods
(``tandemrl.transport``: the trainer side is ``WeightSenderHost``, the generation side
``WeightReceiverHost``):

- ``DirectWeightSync``: trainer and engines are in-process objects (tests, fakes).
- ``RayObjectStoreWeightSync``: the trainer actor exports its weights into Ray's object
  store once, packed in one flat buffer (``tandemrl.transport.object_store.FlatWeights``: one
  out-of-band copy instead of one pickled storage per tensor); each generation actor receives
  the same object reference and Ray resolves it in the worker, so weights never pass through
  the controller process. A sharded trainer's ranks gather the full tensors one at a time
  into rank 0's buffer (``tandemrl.training.fsdp.gather_flat_weights``); the reference is
  rank 0's.
- ``DeviceWeightSync``: engines in the trainer's own process load views of its flat buffer.
- ``CudaIpcWeightSync``: engines in other processes on the trainer's GPU map the trainer's
  buffer once; every later sync sends only the version.
- ``NcclWeightSync``: engines on other GPUs; the trainer (rank 0) broadcasts the buffer (with
  gloo the same code runs on CPU).

A sync of the flat-buffer transports is: the trainer stages → every live engine loads → each
engine reports the version. The controller calls ``sync`` only between train steps, and
``sync`` returns after every engine has loaded, so the trainer never rewrites the buffer while
a reader copies it.

Failures. Engines are reached through the ``GenerationPool``: an engine whose process died is
taken out of rotation exactly as on the object-store path, and the sync carries on with the
rest. A broadcast group is formed over the live engines; when the live set changes — an engine
died mid-generation or mid-broadcast — the survivors and the trainer leave the group and form a
new one before the broadcast is retried. Every wait is bounded by
``policy.generation.weight_sync_timeout_s``: each rank aborts its collective at the deadline
(``tandemrl.transport.process_group``), and the controller gives up on an answer that never
comes, with an error that names the setting.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Mapping, Sequence
from typing import Any, Protocol

from tandemrl.rollout.generation_pool import GenerationPool, is_worker_death
from tandemrl.training.trainer_group import ShardedTrainer
from tandemrl.transport.layout import WeightLayout, WeightSyncError
from tandemrl.transport.process_group import WeightGroupAddress
from tandemrl.transport.receiver import WeightLoader
from tandemrl.transport.sender import FlatWeightSender, LocalWeightSender

# Default for policy.generation.weight_sync_timeout_s (seconds one sync may wait on a peer).
DEFAULT_TIMEOUT_S = 120.0
# The controller waits this much longer than the ranks themselves, so a rank's own timeout
# (which names what it waited for) normally arrives first.
CONTROLLER_SLACK_S = 30.0


class WeightSynchronizer(Protocol):
    # True when a sync only reads the trainer's weights (one export call) and the trainer may
    # run the next step's forward/backward passes meanwhile; the controller then does not wait
    # for it before training on (``SingleController._tail_may_overlap``). Absent: False.
    overlaps_training: bool

    async def sync(self, version: int) -> float:
        """Push the trainer's current weights to every engine as ``version``; return seconds."""


class DirectWeightSync:
    overlaps_training = True

    def __init__(self, trainer: Any, pool: GenerationPool) -> None:
        self.trainer = trainer
        self.pool = pool

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        weights = await self.trainer.export_weights()
        await self.pool.update_weights(version, weights)
        return time.perf_counter() - started


class RayObjectStoreWeightSync:
    overlaps_training = True

    def __init__(self, trainer_handle: Any, pool: GenerationPool) -> None:
        self.trainer_handle = trainer_handle
        self.pool = pool

    async def sync(self, version: int) -> float:
        started = time.perf_counter()
        # The reference is passed on as a top-level argument: Ray resolves it in each worker.
        if isinstance(self.trainer_handle, ShardedTrainer):
            # Every rank takes part in gathering the full tensors; rank 0 holds the result.
            # Its failure is the trainer's (named rank), not the generation workers'.
            weights_ref, statuses = self.trainer_handle.export_weights_flat_refs()
            await self.trainer_handle.wait_exported(statuses)
        else:
            weights_ref = self.trainer_handle.export_weights_flat.remote()
        await self.pool.update_weights(version, weights_ref)
        return time.perf_counter() - started


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

            # This round's address and ranks, bound now (the loop may form a new group).
            def join(
                index: int,
                engine: Any,
                address: WeightGroupAddress = address,
                ranks: dict[int, int] = ranks,
            ) -> Any:
                return engine.join_weight_group(address, rank=ranks[index], layout=layout)

            trainer_result, outcomes = await self._bounded(
                asyncio.gather(
                    self.trainer.join_weight_group_as_sender(address),
                    self.pool.call_each(join, indices=members),
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
