"""Agents in worker processes (``env.agent.workers: N``): the episodes' own CPU off the controller.

With ``workers: 0`` (the default) every episode's ``Agent.run`` and its ``openai`` client run
on the controller's event loop, beside the endpoint that serves them. The official client
costs about 2 ms of CPU per chat call (docs/benchmarks.md); at hundreds of calls a step that
is the controller's whole budget. With ``workers: N`` the run starts N Ray actors
(``AgentWorker``), each with its own instance of the user's agent (``env.target`` built with
``env.kwargs``) and its own ``openai.AsyncOpenAI`` pointed at the endpoint, and the
controller sends each prompt group's episodes to the worker with the fewest in flight. The
endpoint, the capture of every turn and the episode's deadline stay in the controller; a worker
only plays.

The siblings of a group travel together: the episodes handed to the pool in one turn of the
event loop (``run_siblings`` starts a group's episodes at once) are sent as one Ray call per
prompt group (``AgentWorker.run_group``), which answers when all of them have finished, as the
group itself does. A Ray actor call costs the controller about 0.4 ms of CPU however little it
carries (measured on the 2-core machine; a call of 8 episodes costs about what one does), so
one call a group instead of one an episode takes most of that off the controller. An episode
cancelled on the controller (its deadline, its group aborted) is cancelled in the worker by
key (``AgentWorker.cancel``); its group's call answers without it.

What crosses back is the agent's ``AgentResult``, or a ``WorkerFailure`` describing what the
agent raised: its class name, message, and the kind the runner sorts it by (a ``DataFailure``
or ``AgentInfraFailure`` it raised, the endpoint unreachable, an HTTP refusal with its status,
anything else). ``AgentWorkerPool.run`` raises it again on the controller as the matching
exception, so ``AgentRollouts`` classifies an episode the same way wherever it ran. A worker
that dies is an infrastructure failure of its episodes in flight; Ray starts it again, and
the new process starts its agent before its first episode.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

from tandemrl.agents.api import Agent, AgentInfraFailure, AgentResult, check_agent_result
from tandemrl.config.models import EnvConfig
from tandemrl.records import PromptItem
from tandemrl.rollout.failures import DataFailure

log = logging.getLogger(__name__)

# Episodes one worker may play at once (its asyncio tasks): every episode of the run in
# flight may be on one worker.
WORKER_MAX_CONCURRENCY = 4096
# How long stop() waits for a worker's agent to stop before the worker is killed.
STOP_TIMEOUT_S = 30.0
# How long a worker remembers a cancel for an episode it has not seen (yet): one whose
# group's call is still on its way.
EARLY_CANCEL_TTL_S = 600.0


@dataclass(frozen=True)
class WorkerFailure:
    """What an agent raised in a worker, in a form that crosses processes. ``kind``:
    ``data`` (a ``DataFailure``), ``infra`` (an ``AgentInfraFailure``), ``unreachable``
    (``openai.APIConnectionError``), ``status`` (``openai.APIStatusError``, with
    ``status_code``), ``raised`` (anything else)."""

    kind: str
    type_name: str
    message: str
    status_code: int | None = None


CANCELLED = WorkerFailure("cancelled", "CancelledError", "cancelled by the controller")


class AgentRaised(Exception):
    """On the controller: what an agent in a worker raised (``WorkerFailure``), for the runner
    to classify like the exception itself."""

    def __init__(self, failure: WorkerFailure, worker: int) -> None:
        super().__init__(failure.message)
        self.failure = failure
        self.worker = worker

    @property
    def type_name(self) -> str:
        return self.failure.type_name

    @property
    def status_code(self) -> int | None:
        return self.failure.status_code


def describe_failure(exc: BaseException) -> WorkerFailure:
    import openai

    name, message = type(exc).__name__, str(exc)
    if isinstance(exc, DataFailure):
        return WorkerFailure("data", name, message)
    if isinstance(exc, AgentInfraFailure):
        return WorkerFailure("infra", name, message)
    if isinstance(exc, openai.APIConnectionError):
        return WorkerFailure("unreachable", name, message)
    if isinstance(exc, openai.APIStatusError):
        return WorkerFailure("status", name, message, exc.status_code)
    return WorkerFailure("raised", name, message)


def raised_again(failure: WorkerFailure, worker: int) -> Exception:
    """The controller-side exception for ``failure``: ``DataFailure`` and
    ``AgentInfraFailure`` as themselves, the rest as ``AgentRaised``."""
    where = f" (agent worker {worker})"
    if failure.kind == "data":
        return DataFailure(failure.message + where)
    if failure.kind == "infra":
        return AgentInfraFailure(failure.message + where)
    if failure.kind == "unreachable":
        return AgentInfraFailure(
            f"the policy endpoint is unreachable from agent worker {worker}: {failure.message}"
        )
    return AgentRaised(failure, worker)


class AgentWorker:
    """One worker process (a Ray actor): the user's agent and an ``openai`` client on the
    endpoint. Episodes run concurrently on its event loop."""

    def __init__(self, env: EnvConfig, base_url: str, index: int) -> None:
        from tandemrl.agents import create_agent

        logging.basicConfig(level=logging.INFO)
        self.index = index
        self.base_url = base_url
        self.agent: Agent = create_agent(env)
        self._client: Any = None
        self._start_lock = asyncio.Lock()
        self._playing: dict[str, asyncio.Task[Any]] = {}  # episode key -> its task
        self._cancel_early: dict[str, float] = {}  # key -> when its cancel came, unseen

    async def start(self) -> None:
        """Start the agent (``Agent.start`` with the endpoint's URL) once per process."""
        async with self._start_lock:
            if self._client is not None:
                return
            from tandemrl.agents.runner import shared_openai_client

            client = shared_openai_client(self.base_url)
            try:
                await self.agent.start(self.base_url)
            except BaseException:
                await client.close()
                raise
            self._client = client

    async def run(self, item: PromptItem, key: str) -> AgentResult | WorkerFailure:
        """Play one episode with ``key`` as the client's api_key: the agent's result, checked
        here (a malformed one may not even cross processes), or what went wrong."""
        await self.start()
        try:
            result = await self.agent.run(item, self._client.with_options(api_key=key))
        except Exception as exc:
            return describe_failure(exc)
        try:
            return check_agent_result(result)
        except ValueError as exc:
            return WorkerFailure("data", "ValueError", str(exc))

    async def run_group(
        self, entries: list[tuple[PromptItem, str]]
    ) -> list[AgentResult | WorkerFailure]:
        """Play ``(item, key)`` episodes concurrently (a prompt group's siblings); per episode
        what ``run`` gives, or ``CANCELLED`` for one the controller cancelled."""
        await self.start()
        return list(await asyncio.gather(*(self._play(item, key) for item, key in entries)))

    async def _play(self, item: PromptItem, key: str) -> AgentResult | WorkerFailure:
        if self._cancel_early.pop(key, None) is not None:
            return CANCELLED
        task = asyncio.current_task()
        assert task is not None
        self._playing[key] = task
        try:
            return await self.run(item, key)
        except asyncio.CancelledError:
            if task.cancelling() and key not in self._playing:  # cancel(): the episode only
                task.uncancel()
                return CANCELLED
            raise
        finally:
            self._playing.pop(key, None)

    def cancel(self, keys: list[str]) -> None:
        """Cancel the episodes of ``keys``; a key not playing (its call is still on its way)
        is cancelled when it arrives. One that has finished is nothing to cancel."""
        now = time.monotonic()
        self._cancel_early = {
            key: at for key, at in self._cancel_early.items() if now - at < EARLY_CANCEL_TTL_S
        }
        for key in keys:
            task = self._playing.pop(key, None)
            if task is not None:
                task.cancel()
            else:
                self._cancel_early[key] = now

    async def health(self) -> str | None:
        if self._client is None:
            return None
        return await self.agent.health()

    async def stop(self) -> None:
        if self._client is None:
            return
        client, self._client = self._client, None
        try:
            await self.agent.stop()
        finally:
            await client.close()


@dataclass
class _Pending:
    """An episode handed to ``AgentWorkerPool.run``: what it plays, and where its outcome goes."""

    item: PromptItem
    key: str
    future: asyncio.Future[Any] = field(repr=False)
    worker: int | None = None  # the worker its group's call went to, while it is there


class AgentWorkerPool:
    """The controller's side: ``count`` ``AgentWorker`` actors, started against the endpoint's
    URL, and ``run`` sending an episode to the least busy one."""

    def __init__(
        self,
        env: EnvConfig,
        count: int,
        *,
        num_cpus: float,
        same_node: bool,
        actor_options: dict[str, Any] | None = None,
    ) -> None:
        if count < 1:
            raise ValueError(f"env.agent.workers={count}: an agent worker pool needs at least 1")
        self.env = env
        self.count = count
        self.num_cpus = num_cpus
        # A loopback endpoint is reachable only from this node: the workers are placed here.
        self.same_node = same_node
        self.actor_options = dict(actor_options or {})
        self.handles: list[Any] = []
        self.in_flight: list[int] = []  # episodes per worker
        # Handed to run() in this turn of the loop; a flush is scheduled while it is not empty.
        self._pending: list[_Pending] = []
        self._tasks: set[asyncio.Task[None]] = set()  # group calls and cancels in flight

    async def start(self, base_url: str) -> None:
        import ray

        options: dict[str, Any] = {
            "num_cpus": self.num_cpus,
            "max_concurrency": WORKER_MAX_CONCURRENCY,
            # A worker that dies comes back (its episodes in flight fail as infrastructure).
            "max_restarts": -1,
            "max_task_retries": 0,
            **self.actor_options,
        }
        if self.same_node:
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
                node_id=ray.get_runtime_context().get_node_id(), soft=False
            )
        remote = ray.remote(AgentWorker)
        self.handles = [
            remote.options(**options).remote(self.env, base_url, index)
            for index in range(self.count)
        ]
        self.in_flight = [0] * self.count
        try:
            await asyncio.gather(*(handle.start.remote() for handle in self.handles))
        except BaseException as exc:
            await self.stop()
            raise RuntimeError(
                f"env.agent.workers: an agent worker failed to start its agent "
                f"(env.target={self.env.target!r}): {exc}"
            ) from exc

    async def run(self, item: PromptItem, key: str) -> object:
        """The episode's result, played in a worker with its group's siblings (the module
        docstring); what the agent raised, raised again here (``raised_again``); a worker that
        died, an ``AgentInfraFailure``. Cancelled (the episode's deadline, its group aborted),
        the episode is cancelled in the worker too."""
        loop = asyncio.get_running_loop()
        entry = _Pending(item, key, loop.create_future())
        if not self._pending:
            loop.call_soon(self._flush)
        self._pending.append(entry)
        try:
            return await entry.future
        except asyncio.CancelledError:
            if entry.worker is not None:  # on its way or playing: the worker lets it go
                self._spawn(self._cancel_in(entry.worker, [key]))
            raise

    def _flush(self) -> None:
        """Send what ``run`` collected in this turn of the loop: one call per prompt group,
        each to the worker with the fewest episodes in flight."""
        pending, self._pending = self._pending, []
        groups: dict[int, list[_Pending]] = {}
        for entry in pending:
            if not entry.future.done():  # cancelled before it was sent
                groups.setdefault(id(entry.item), []).append(entry)
        for entries in groups.values():
            index = min(range(self.count), key=lambda i: self.in_flight[i])
            self.in_flight[index] += len(entries)
            for entry in entries:
                entry.worker = index
            self._spawn(self._send(index, entries))

    async def _send(self, index: int, entries: list[_Pending]) -> None:
        import ray

        try:
            ref = self.handles[index].run_group.remote([(e.item, e.key) for e in entries])
            outcomes = await ref
        except ray.exceptions.RayActorError as exc:
            self._fail(entries, f"agent worker {index} died under the episode: {exc}")
            return
        except ray.exceptions.RayError as exc:
            # The worker catches what the agent raises: this is the worker's own error (an
            # item or a result could not cross processes, its object was lost).
            self._fail(entries, f"agent worker {index} failed: {exc}")
            return
        except asyncio.CancelledError:  # the pool is stopping: its episodes fail, none hangs
            self._fail(entries, f"agent worker {index}: the pool stopped")
            raise
        except Exception as exc:  # a fault of the pool itself: logged, its episodes fail
            log.exception("agent worker %d: sending a group's episodes failed", index)
            self._fail(entries, f"agent worker {index}: the call failed: {exc!r}")
            return
        finally:
            self.in_flight[index] -= len(entries)
            for entry in entries:
                entry.worker = None
        for entry, outcome in zip(entries, outcomes, strict=True):
            if entry.future.done():  # cancelled here while it played
                continue
            if isinstance(outcome, WorkerFailure):
                entry.future.set_exception(raised_again(outcome, index))
            else:
                entry.future.set_result(outcome)

    @staticmethod
    def _fail(entries: list[_Pending], message: str) -> None:
        """Each episode of ``entries`` not yet answered: an infrastructure failure."""
        for entry in entries:
            if not entry.future.done():
                entry.future.set_exception(AgentInfraFailure(message))

    async def _cancel_in(self, index: int, keys: list[str]) -> None:
        import ray

        try:
            await self.handles[index].cancel.remote(keys)
        except ray.exceptions.RayError as exc:  # a dead worker plays nothing: logged only
            log.warning(
                "agent worker %d: cancelling %d episode(s) failed: %s", index, len(keys), exc
            )

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def health(self) -> str | None:
        reports = await asyncio.gather(
            *(handle.health.remote() for handle in self.handles), return_exceptions=True
        )
        problems = [
            f"agent worker {index}: {report}"
            for index, report in enumerate(reports)
            if report is not None
        ]
        return "; ".join(problems) or None

    async def stop(self) -> None:
        import ray

        handles, self.handles = self.handles, []
        if not handles:
            return
        stops = [handle.stop.remote() for handle in handles]
        try:
            await asyncio.wait_for(asyncio.gather(*stops), timeout=STOP_TIMEOUT_S)
        except Exception as exc:  # the workers are killed below either way
            log.warning("agent workers: stopping an agent failed: %s", exc)
        for handle in handles:
            ray.kill(handle, no_restart=True)
        # Group calls still in flight (their episodes fail as infrastructure) and cancels.
        tasks, self._tasks = set(self._tasks), set()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
