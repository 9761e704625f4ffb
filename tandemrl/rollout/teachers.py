"""Teacher scoring for on-policy distillation: the worker pools and the row-to-teacher routing.

``TeacherScorer`` is what both placements call (``on_policy_distillation.teacher_scoring``):

- ``rollout``: the rollout manager scores each group once all its siblings finished, just
  before the commit (``RolloutManager``), so the logprobs go into the group's rows, its commit
  log record and every snapshot that holds it;
- ``train``: the distillation step runner scores the rows of a chunk that carry none, beside
  the trainer's own logprob pass (``controller/distill_step.py``).

Each teacher has a ``TeacherPool`` of workers (``tandemrl.training.teacher_worker``, Ray
actors in a run). A worker scores one batch at a time; calls that wait for a free worker are
sent together, up to the teacher's ``micro_batch_size`` sequences (batches grow with the
load). A worker whose process died leaves the rotation and its batch's calls fail with
``TeacherWorkerDied``,
an infrastructure failure: the rollout manager retries it with backoff on the next live
worker, exactly as it retries a dead generation worker's requests, and drops the group once
``max_infra_retries`` ran out. When a teacher has no live worker left, ``NoTeacherWorkers``
ends the run (like ``NoGenerationWorkers``).

Routing is ``TeacherRoutes`` (``tandemrl.config.distillation``): task_source, then agent_ref,
then the default teacher. A row with no teacher is a data failure of its group (validation and
the runtime checks refuse configs and datasets where that can happen).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandemrl.config.distillation import TeacherRoutes, unrouted_row_message
from tandemrl.records import PromptItem, TeacherRequest
from tandemrl.rollout.failures import DataFailure, InfraFailure
from tandemrl.rollout.generation_pool import is_worker_death

log = logging.getLogger(__name__)


class NoTeacherWorkers(RuntimeError):
    """Every worker of a teacher died; the run cannot continue."""


class TeacherWorkerDied(InfraFailure):
    """A teacher worker's process died under a call (retried like a generation worker's)."""


@dataclass
class _Worker:
    index: int
    engine: Any  # a TeacherWorker, or an async proxy of its Ray actor
    busy: bool = False
    alive: bool = True


@dataclass
class _Call:
    requests: list[TeacherRequest]
    answer: asyncio.Future[list[list[float]]]


class TeacherPool:
    """The workers of one teacher, and the calls waiting for them.

    Batching: a worker scores one batch at a time; calls that arrive while every worker is
    busy wait, and the next free worker takes as many of them as fit in
    ``max_batch_sequences`` (at least one call) as one batch. Under load the batches grow
    toward a full micro-batch; a lone call goes at once.
    """

    def __init__(
        self, name: str, engines: Sequence[Any], *, max_batch_sequences: int | None = None
    ) -> None:
        if not engines:
            raise ValueError(f"teacher {name!r} needs at least one worker")
        self.name = name
        self.max_batch_sequences = max_batch_sequences
        self._workers = [_Worker(index, engine) for index, engine in enumerate(engines)]
        self._waiting: deque[_Call] = deque()
        self._batches: set[asyncio.Task[None]] = set()
        self.dead_workers: list[int] = []
        self.calls = 0  # batches sent to the workers
        self.sequences = 0

    @property
    def num_alive(self) -> int:
        return sum(worker.alive for worker in self._workers)

    def _no_workers(self) -> NoTeacherWorkers:
        return NoTeacherWorkers(
            f"all {len(self._workers)} worker(s) of teacher {self.name!r} died (workers "
            f"{self.dead_workers}); check the worker logs, then resume from the last checkpoint"
        )

    async def score(self, requests: list[TeacherRequest]) -> list[list[float]]:
        if self.num_alive == 0:
            raise self._no_workers()
        call = _Call(requests, asyncio.get_running_loop().create_future())
        self._waiting.append(call)
        self._dispatch()
        return await call.answer

    def _dispatch(self) -> None:
        """Hand waiting calls to free workers, as large batches as fit."""
        while self._waiting:
            if self.num_alive == 0:
                failure = self._no_workers()
                while self._waiting:
                    call = self._waiting.popleft()
                    if not call.answer.done():
                        call.answer.set_exception(failure)
                return
            worker = next((w for w in self._workers if w.alive and not w.busy), None)
            if worker is None:
                return
            batch = [self._waiting.popleft()]
            size = len(batch[0].requests)
            cap = self.max_batch_sequences
            while self._waiting and (cap is None or size + len(self._waiting[0].requests) <= cap):
                call = self._waiting.popleft()
                batch.append(call)
                size += len(call.requests)
            batch = [call for call in batch if not call.answer.done()]  # callers that gave up
            if not batch:
                continue
            worker.busy = True
            task = asyncio.get_running_loop().create_task(self._run(worker, batch))
            self._batches.add(task)
            task.add_done_callback(self._batches.discard)

    async def _run(self, worker: _Worker, batch: list[_Call]) -> None:
        requests = [request for call in batch for request in call.requests]
        try:
            scored: list[list[float]] = await worker.engine.score(requests)
            _check_answer(self.name, requests, scored)
        except Exception as exc:
            failure: BaseException = exc
            if is_worker_death(exc):
                self._mark_dead(worker, exc)
                failure = TeacherWorkerDied(
                    f"worker {worker.index} of teacher {self.name!r} died: {exc}"
                )
                failure.__cause__ = exc
            for call in batch:
                if not call.answer.done():
                    call.answer.set_exception(failure)
        else:
            self.calls += 1
            self.sequences += len(requests)
            values = iter(scored)
            for call in batch:
                answer = [next(values) for _ in call.requests]
                if not call.answer.done():
                    call.answer.set_result(answer)
        finally:
            worker.busy = False
            self._dispatch()

    def _mark_dead(self, worker: _Worker, exc: BaseException) -> None:
        if worker.alive:
            worker.alive = False
            self.dead_workers.append(worker.index)
            log.error(
                "worker %d of teacher %r died: %s; %d worker(s) left",
                worker.index,
                self.name,
                exc,
                self.num_alive,
            )


def _check_answer(name: str, requests: list[TeacherRequest], scored: list[list[float]]) -> None:
    if len(scored) != len(requests):
        raise ValueError(f"teacher {name!r} answered {len(scored)} of {len(requests)} requests")
    for request, values in zip(requests, scored, strict=True):
        if len(values) != len(request.completion_token_ids):
            raise ValueError(
                f"teacher {name!r} gave {len(values)} logprobs for the "
                f"{len(request.completion_token_ids)} completion tokens of {request.request_id}"
            )


class TeacherScorer:
    """The run's teachers: which one serves a prompt, and scoring through its pool."""

    def __init__(self, routes: TeacherRoutes, pools: Sequence[TeacherPool]) -> None:
        self.routes = routes
        self.pools = list(pools)

    def index_for(self, item: PromptItem) -> int:
        """The index of the teacher serving ``item`` (a data failure when none does)."""
        index = self.routes.route(item.task_source, item.agent_ref)
        if index is None:
            raise DataFailure(
                unrouted_row_message(item.task_source, item.agent_ref, f"prompt {item.prompt_id}")
            )
        return index

    def teacher_for(self, item: PromptItem) -> TeacherPool:
        return self.pools[self.index_for(item)]

    async def score_group(
        self, item: PromptItem, requests: list[TeacherRequest]
    ) -> list[list[float]]:
        """The logprobs of one prompt group's completions, from the prompt's teacher."""
        return await self.teacher_for(item).score(requests)

    async def score_groups(
        self, groups: Sequence[tuple[int, list[TeacherRequest]]]
    ) -> list[list[list[float]]]:
        """Many groups' logprobs, each ``(teacher index, requests)``: one call per teacher,
        the teachers at once."""
        by_teacher: dict[int, list[int]] = {}
        for position, (teacher, _) in enumerate(groups):
            by_teacher.setdefault(teacher, []).append(position)

        async def one_teacher(teacher: int, positions: list[int]) -> list[list[float]]:
            requests = [request for p in positions for request in groups[p][1]]
            return await self.pools[teacher].score(requests)

        answers = await asyncio.gather(
            *(one_teacher(teacher, positions) for teacher, positions in by_teacher.items())
        )
        out: list[list[list[float]]] = [[] for _ in groups]
        for positions, scored in zip(by_teacher.values(), answers, strict=True):
            values = iter(scored)
            for position in positions:
                out[position] = [next(values) for _ in groups[position][1]]
        return out
