"""Weight synchronisation from the policy trainer to every generation engine.

The controller only calls ``await sync(version)`` after each optimizer step and logs the
seconds it took; how weights travel is the synchroniser's business, so CUDA IPC or NCCL
transports plug in here without touching the pumps.

- ``DirectWeightSync``: trainer and engines are in-process objects (tests, fakes).
- ``RayObjectStoreWeightSync``: the trainer actor exports its weights into Ray's object
  store once, packed in one flat buffer (``tandemrl.weight_payload.FlatWeights``: one
  out-of-band copy instead of one pickled storage per tensor); each generation actor receives
  the same object reference and Ray resolves it in the worker, so weights never pass through
  the controller process.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from tandemrl.rollout.generation_pool import GenerationPool


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
        weights_ref = self.trainer_handle.export_weights_flat.remote()
        await self.pool.update_weights(version, weights_ref)
        return time.perf_counter() - started
