"""Routes generation calls over the generation workers and enforces per-request deadlines.

Each call goes to the healthy worker with the fewest outstanding requests. A deadline
(``generation_timeout_s``) counts only time the engine was awake: the pool reads the engine's
``frozen_time`` (seconds spent stood down) at the start and whenever the budget runs out, and
extends the deadline by the stand-down time in between. A worker whose process died is taken
out of rotation; its requests fail as infrastructure failures and are retried elsewhere by the
rollout manager. When no worker is left the pool raises ``NoGenerationWorkers``.

Coalescing (``coalesce_calls=True``, used for Ray workers, where each remote call costs about
a millisecond of CPU on each side): the calls routed to one worker during one turn of the event
loop travel as one ``generate_groups`` call. When a step's capacity frees, the rollout pump
starts every admitted group in the same turn, so a whole step's groups (16 of 8 requests on the
default job) become a few remote calls instead of 16 (measured with Ray 2.60 on this job's
requests: 16 calls cost 10-13 ms of CPU per step on each side, one call about 2 ms). Each caller
still gets only its own results or its own exception (``generate_groups`` returns one outcome
per call); a worker death fails every call of the batch, as it would have failed each of them.

The price: a call's results arrive when its whole batch is done. ``max_requests_per_call``
(the engine's decode batch, ``policy.generation.max_batch_size``) bounds that wait: a batch
holds at most that many requests (a larger call travels alone), so the engine admits a batch
about when it admits its first request, and a caller waits for at most one engine batch's
worth of its batchmates; early groups still come back early (the streaming sampler trains on
them while the rest generate). A fast call would also share a slow batchmate's clock, so with
``generation_timeout_s`` set the pool does not coalesce (and ``build_controller`` does not ask
for it when ``rollout_timeout_s`` is set): every deadline keeps timing its own call. A Ray
streaming generator that yields each call's results as they finish costs as much CPU as
separate calls, so it is not used.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

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
    # Coalescing: calls waiting for this turn of the event loop to end, with their futures.
    pending: list[tuple[list[GenerationRequest], asyncio.Future[list[GenerationResult]]]] = field(
        default_factory=list
    )
    pending_requests: int = 0


def is_worker_death(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:
        return False
    return isinstance(exc, RayActorError)


T = TypeVar("T")


async def within_awake_time(
    call: Awaitable[T],
    *,
    timeout_s: float,
    frozen_time: Callable[[], Awaitable[float]],
    timed_out: Callable[[], Awaitable[BaseException]],
    started: float | None = None,
) -> T:
    """``call``'s result, if it comes within ``timeout_s`` seconds of awake time.

    Awake time is wall time since ``started`` (default: now) less the seconds the engines
    stood down meanwhile (``frozen_time`` is their running total): the budget is re-read
    whenever it runs out, and extended by the stand-down time in between. Past it, ``call``
    is cancelled and the exception ``timed_out`` returns (after aborting what it must) is
    raised.
    """
    future = asyncio.ensure_future(call)
    try:
        if started is None:
            started = time.monotonic()
        frozen_at_start = await frozen_time()
        remaining = timeout_s
        while True:
            done, _ = await asyncio.wait({future}, timeout=remaining)
            if done:
                return future.result()
            frozen = await frozen_time() - frozen_at_start
            awake_elapsed = time.monotonic() - started - frozen
            if awake_elapsed >= timeout_s:
                future.cancel()
                raise await timed_out()
            remaining = timeout_s - awake_elapsed
    finally:
        # The caller was cancelled (or failed) while it waited: so is the call it waits for.
        if not future.done():
            future.cancel()


class GenerationPool:
    def __init__(
        self,
        engines: list[Any],
        *,
        generation_timeout_s: float | None = None,
        coalesce_calls: bool = False,
        max_requests_per_call: int | None = None,
    ) -> None:
        if not engines:
            raise ValueError("GenerationPool needs at least one engine")
        self._workers = [_Worker(i, engine) for i, engine in enumerate(engines)]
        self.generation_timeout_s = generation_timeout_s
        # A deadline times one call; in a batch it would time its batchmates too (see above).
        self.coalesce_calls = coalesce_calls and generation_timeout_s is None
        if max_requests_per_call is not None and max_requests_per_call < 1:
            raise ValueError(f"max_requests_per_call must be >= 1, got {max_requests_per_call}")
        self.max_requests_per_call = max_requests_per_call  # None: one batch per turn
        self.timeouts = 0
        self.dead_workers: list[int] = []
        # Calls made to the engines' generate methods (a coalesced batch counts once).
        self.engine_calls = 0
        self._batches: set[asyncio.Task[None]] = set()

    @property
    def engines(self) -> list[Any]:
        return [w.engine for w in self._workers if w.alive]

    @property
    def open_batches(self) -> int:
        """Coalesced generate calls sent and not answered yet."""
        return len(self._batches)

    @property
    def num_alive(self) -> int:
        return sum(w.alive for w in self._workers)

    def _pick(self) -> _Worker:
        """The live worker with the fewest outstanding requests (the lowest index on ties)."""
        best = None
        for worker in self._workers:  # in index order, so only a strictly smaller count wins
            if worker.alive and (best is None or worker.outstanding < best.outstanding):
                best = worker
        if best is None:
            raise NoGenerationWorkers(
                f"all {len(self._workers)} generation worker(s) died (workers {self.dead_workers}); "
                "check the worker logs, then resume from the last checkpoint"
            )
        return best

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
                return await self._call(worker, requests)
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

        async def timed_out() -> TimeoutError:
            self.timeouts += 1
            await worker.engine.abort([r.request_id for r in requests])
            return TimeoutError(
                f"generation of {[r.request_id for r in requests]} exceeded "
                f"async_rl.rollout_failure.generation_timeout_s={timeout} (awake time)"
            )

        return await within_awake_time(
            self._call(worker, requests),
            timeout_s=timeout,
            frozen_time=worker.engine.frozen_time,
            timed_out=timed_out,
        )

    def _call(
        self, worker: _Worker, requests: list[GenerationRequest]
    ) -> Awaitable[list[GenerationResult]]:
        """The engine's results for ``requests``: its own call, or a share of this turn's batch."""
        if not self.coalesce_calls:
            self.engine_calls += 1
            return worker.engine.generate(requests)
        future: asyncio.Future[list[GenerationResult]] = asyncio.get_running_loop().create_future()
        cap = self.max_requests_per_call
        if worker.pending and cap is not None and worker.pending_requests + len(requests) > cap:
            self._send_pending(worker)  # full: send it now, start the next batch
        if not worker.pending:
            asyncio.get_running_loop().call_soon(self._send_pending, worker)
        worker.pending.append((requests, future))
        worker.pending_requests += len(requests)
        return future

    def _send_pending(self, worker: _Worker) -> None:
        batch, worker.pending, worker.pending_requests = worker.pending, [], 0
        if not batch:  # sent early because it filled up
            return
        task = asyncio.get_running_loop().create_task(self._send_batch(worker, batch))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)

    async def _send_batch(
        self,
        worker: _Worker,
        batch: list[tuple[list[GenerationRequest], asyncio.Future[list[GenerationResult]]]],
    ) -> None:
        """One ``generate_groups`` call for ``batch``; each future gets its own outcome."""
        self.engine_calls += 1
        try:
            outcomes = await worker.engine.generate_groups([requests for requests, _ in batch])
        except asyncio.CancelledError:  # the pool's loop is shutting down
            for _, future in batch:
                future.cancel()
            raise
        except Exception as exc:  # the whole call failed (worker death, transport)
            for _, future in batch:
                if not future.done():
                    future.set_exception(exc)
            return
        for (_, future), outcome in zip(batch, outcomes, strict=True):
            if future.done():  # its caller gave up (deadline, cancellation)
                continue
            if isinstance(outcome, BaseException):
                future.set_exception(outcome)
            else:
                future.set_result(outcome)

    @property
    def live_indices(self) -> tuple[int, ...]:
        """Indices (fixed at construction) of the workers still in rotation."""
        return tuple(w.index for w in self._workers if w.alive)

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
