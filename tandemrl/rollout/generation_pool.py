"""Routes generation calls over the generation workers and enforces per-request deadlines.

Each call goes to the healthy worker with the fewest outstanding requests. A deadline
(``generation_timeout_s``) counts only time the engine was awake: the pool reads the engine's
``frozen_time`` (seconds spent stood down) at the start and whenever the budget runs out, and
extends the deadline by the stand-down time in between. A worker whose process died is taken
out of rotation; its requests fail as infrastructure failures and are retried elsewhere by the
rollout manager. When no worker is left the pool raises ``NoGenerationWorkers``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from tandemrl.generation.base import GenerationError
from tandemrl.records import GenerationRequest, GenerationResult

log = logging.getLogger(__name__)


class NoGenerationWorkers(RuntimeError):
    """Every generation worker died; the run cannot continue."""


@dataclass
class _Worker:
    index: int
    engine: Any  # GenerationBackend, or an async proxy of a Ray actor with the same methods
    outstanding: int = 0
    alive: bool = True


def _is_worker_death(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:
        return False
    return isinstance(exc, RayActorError)


class GenerationPool:
    def __init__(self, engines: list[Any], *, generation_timeout_s: float | None = None) -> None:
        if not engines:
            raise ValueError("GenerationPool needs at least one engine")
        self._workers = [_Worker(i, engine) for i, engine in enumerate(engines)]
        self.generation_timeout_s = generation_timeout_s
        self.timeouts = 0
        self.dead_workers: list[int] = []

    @property
    def engines(self) -> list[Any]:
        return [w.engine for w in self._workers if w.alive]

    @property
    def num_alive(self) -> int:
        return sum(w.alive for w in self._workers)

    def _pick(self) -> _Worker:
        alive = [w for w in self._workers if w.alive]
        if not alive:
            raise NoGenerationWorkers(
                f"all {len(self._workers)} generation worker(s) died (workers {self.dead_workers}); "
                "check the worker logs, then resume from the last checkpoint"
            )
        return min(alive, key=lambda w: (w.outstanding, w.index))

    def mark_dead(self, worker: _Worker, exc: BaseException) -> None:
        if worker.alive:
            worker.alive = False
            self.dead_workers.append(worker.index)
            log.error(
                "generation worker %d died: %s; %d worker(s) left",
                worker.index,
                exc,
                self.num_alive,
            )

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        worker = self._pick()
        worker.outstanding += len(requests)
        try:
            if self.generation_timeout_s is None:
                return await worker.engine.generate(requests)
            return await self._generate_with_deadline(worker, requests)
        except Exception as exc:
            if _is_worker_death(exc):
                self.mark_dead(worker, exc)
                raise GenerationError(f"generation worker {worker.index} died: {exc}") from exc
            raise
        finally:
            worker.outstanding -= len(requests)

    async def _generate_with_deadline(
        self, worker: _Worker, requests: list[GenerationRequest]
    ) -> list[GenerationResult]:
        assert self.generation_timeout_s is not None
        timeout = self.generation_timeout_s
        call = asyncio.ensure_future(worker.engine.generate(requests))
        started = time.monotonic()
        frozen_at_start = await worker.engine.frozen_time()
        remaining = timeout
        while True:
            done, _ = await asyncio.wait({call}, timeout=remaining)
            if done:
                return call.result()
            frozen = await worker.engine.frozen_time() - frozen_at_start
            awake_elapsed = time.monotonic() - started - frozen
            if awake_elapsed >= timeout:
                call.cancel()
                self.timeouts += 1
                await worker.engine.abort([r.request_id for r in requests])
                raise TimeoutError(
                    f"generation of {[r.request_id for r in requests]} exceeded "
                    f"async_rl.rollout_failure.generation_timeout_s={timeout} (awake time)"
                )
            remaining = timeout - awake_elapsed

    async def broadcast(self, method: str, *args: Any) -> list[Any]:
        """Call ``method`` on every live engine; a worker found dead is taken out of rotation."""
        workers = [w for w in self._workers if w.alive]
        results = await asyncio.gather(
            *(getattr(w.engine, method)(*args) for w in workers), return_exceptions=True
        )
        values = []
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException):
                if _is_worker_death(result):
                    self.mark_dead(worker, result)
                    continue
                raise result
            values.append(result)
        if self.num_alive == 0:
            self._pick()  # raises NoGenerationWorkers with the full story
        return values

    async def abort(self, request_ids: list[str]) -> None:
        """Abort requests on every live engine (ids unknown to an engine are ignored there)."""
        await self.broadcast("abort", request_ids)

    async def frozen_time(self) -> float:
        """Seconds the engines stood down so far (the longest of them; they sleep together)."""
        return max(await self.broadcast("frozen_time"), default=0.0)

    async def update_weights(self, version: int, weights: Any) -> None:
        await self.broadcast("update_weights", version, weights)

    async def sleep(self) -> None:
        await self.broadcast("sleep")

    async def wake(self) -> None:
        await self.broadcast("wake")
