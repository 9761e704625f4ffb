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
from collections.abc import Awaitable, Callable, Sequence
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


def is_worker_death(exc: BaseException) -> bool:
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
            if is_worker_death(exc):
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

    @property
    def live_indices(self) -> tuple[int, ...]:
        """Indices (fixed at construction) of the workers still in rotation."""
        return tuple(w.index for w in self._workers if w.alive)

    def engine_at(self, index: int) -> Any:
        return self._workers[index].engine

    def check_alive(self) -> None:
        """Raise ``NoGenerationWorkers`` when every worker has died."""
        if self.num_alive == 0:
            self._pick()  # raises with the full story

    async def call_each(
        self,
        call: Callable[[int, Any], Awaitable[Any]],
        *,
        indices: Sequence[int] | None = None,
    ) -> dict[int, Any]:
        """Run ``call(index, engine)`` on each live worker (or the live ones of ``indices``).

        Returns index -> result, or the exception the call raised. A worker whose process died
        is taken out of rotation (its entry holds the death); other exceptions are returned
        for the caller to judge. Transports that give each worker different arguments (a
        process-group rank) or must see every outcome (a collective) use this.
        """
        wanted = None if indices is None else set(indices)
        workers = [w for w in self._workers if w.alive and (wanted is None or w.index in wanted)]
        results = await asyncio.gather(
            *(call(w.index, w.engine) for w in workers), return_exceptions=True
        )
        for worker, result in zip(workers, results, strict=True):
            if isinstance(result, BaseException) and is_worker_death(result):
                self.mark_dead(worker, result)
        return {worker.index: result for worker, result in zip(workers, results, strict=True)}

    async def broadcast(self, method: str, *args: Any, **kwargs: Any) -> list[Any]:
        """Call ``method`` on every live engine; a worker found dead is taken out of rotation."""
        outcomes = await self.call_each(
            lambda _index, engine: getattr(engine, method)(*args, **kwargs)
        )
        values = []
        for result in outcomes.values():
            if isinstance(result, BaseException):
                if is_worker_death(result):
                    continue
                raise result
            values.append(result)
        self.check_alive()
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
