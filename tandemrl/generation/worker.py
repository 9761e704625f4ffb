"""The generation worker: a Ray actor process that owns one generation engine.

The engine is the in-process ``TorchGenerationEngine`` by default, or ``VllmGenerationEngine``
when the worker is created with ``backend="vllm"`` (and the policy config it needs).

The actor is asynchronous (its methods are coroutines on the actor's event loop), so many
``generate`` calls are in flight at once and the engine batches them together; weight updates,
aborts and stand-downs arrive between decode steps. ``make_generation_worker_class`` applies
``ray.remote`` with the resources the placement needs::

    Worker = make_generation_worker_class(num_cpus=1, num_gpus=0)
    worker = Worker.remote(str(model_path), max_batch_size=64)
    results = await worker.generate.remote(requests)
    await worker.update_weights.remote(version, ray.put(state_dict))  # resolved by Ray

The class itself is plain Python (no Ray needed to construct it), so its wrapping logic is
testable in-process.

Weights arrive in one of three ways, chosen by ``policy.generation.weight_sync``:
``update_weights`` (a state dict through Ray's object store), or the flat-buffer transports of
``WeightReceiverHost`` (``tandemrl.transport.receiver``): ``attach_weight_buffer`` /
``load_weight_buffer`` map the trainer's buffer over CUDA IPC, ``join_weight_group`` /
``receive_weight_broadcast`` / ``leave_weight_group`` take part in the trainer's broadcast
(NCCL on GPUs, gloo on CPU). All three end in the engine's ``update_weights``.
"""

from __future__ import annotations

import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from tandemrl.generation.torch_engine import TorchGenerationEngine
from tandemrl.records import GenerationRequest, GenerationResult
from tandemrl.transport.object_store import FlatWeights
from tandemrl.transport.receiver import WeightReceiverHost

# Concurrent calls one actor accepts: every in-flight generate call holds one slot.
DEFAULT_MAX_CONCURRENCY = 1000


class GenerationWorker(WeightReceiverHost):
    """Actor body: every method forwards to the engine (see ``TorchGenerationEngine``)."""

    def __init__(
        self,
        model_path: str | Path,
        *,
        backend: str = "torch",
        policy_cfg: Any = None,
        **engine_options: Any,
    ) -> None:
        # One intra-op thread per process: on shared cores more threads spin and slow all.
        torch.set_num_threads(1)
        if backend == "vllm":
            from tandemrl.generation.vllm_engine import VllmGenerationEngine

            self.engine = VllmGenerationEngine(
                policy_cfg,
                model_path,
                seed=engine_options.get("seed", 0),
                recompute_kv_cache_after_weight_updates=engine_options.get(
                    "recompute_kv_cache_after_weight_updates", False
                ),
            )
        elif backend == "torch":
            self.engine = TorchGenerationEngine(model_path, **engine_options)
        else:
            raise ValueError(f"policy.generation.backend={backend!r} has no Ray generation worker")

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return await self.engine.generate(requests)

    async def generate_groups(
        self, groups: list[list[GenerationRequest]]
    ) -> list[list[GenerationResult] | BaseException]:
        """Many ``generate`` calls in one remote call (see ``GenerationPool``'s coalescing)."""
        return await self.engine.generate_groups(groups)

    async def update_weights(self, version: int, weights: Any) -> None:
        # A top-level ObjectRef argument arrives resolved; one nested in a container does not.
        import ray

        if isinstance(weights, ray.ObjectRef):
            weights = await weights
        if isinstance(weights, FlatWeights):  # RayObjectStoreWeightSync's packed payload
            weights = weights.to_state_dict()
        await self.engine.update_weights(version, weights)

    async def weight_version(self) -> int:
        return await self.engine.weight_version()

    async def abort(self, request_ids: list[str]) -> None:
        await self.engine.abort(request_ids)

    async def sleep(self) -> None:
        await self.engine.sleep()

    async def wake(self) -> None:
        await self.engine.wake()

    async def frozen_time(self) -> float:
        return await self.engine.frozen_time()

    async def stats(self) -> dict[str, int]:
        return asdict(self.engine.stats)

    async def ping(self) -> dict[str, Any]:
        """Liveness plus a small status: process id, device, version, stand-down state."""
        return {
            "pid": os.getpid(),
            "device": str(self.engine.device),
            "weight_version": self.engine.current_weight_version,
            "asleep": self.engine.asleep,
            "torch_threads": torch.get_num_threads(),
        }

    async def shutdown(self) -> None:
        await self.engine.shutdown()


def make_generation_worker_class(
    num_cpus: float = 1,
    num_gpus: float = 0,
    max_concurrency: int = DEFAULT_MAX_CONCURRENCY,
) -> Any:
    """``GenerationWorker`` as a Ray actor class reserving ``num_cpus``/``num_gpus``."""
    import ray

    return ray.remote(num_cpus=num_cpus, num_gpus=num_gpus, max_concurrency=max_concurrency)(
        GenerationWorker
    )
