"""Runs a prompt group's agent episodes and hands each back as a staged sibling or a failure.

``AgentRollouts`` is what the rollout manager calls for a group on an agent run
(``RolloutManager``'s ``agents``): ``run_siblings(group, siblings, attempt)`` plays one
episode per sibling, all at once, and returns per sibling either a ``StagedSibling`` holding
the episode's captured turns and the agent's result, or the exception that failed it,
already sorted into the manager's two failure classes:

- data (``DataFailure``): the agent raised, returned something that is not a well-formed
  ``AgentResult``, made no call to the policy, ran past ``env.agent.episode_timeout_s`` of
  awake time (a hanging tool), or broke the prefix under ``on_prefix_mismatch: error``;
- infrastructure (a ``ConnectionError`` or the engine's own error): the endpoint met an
  engine failure or a call deadline while serving the episode (recorded on the episode,
  whatever the agent did with the error it got), the endpoint was unreachable
  (``openai.APIConnectionError``), or the agent raised ``AgentInfraFailure``;
- ``GroupAborted``: the group's generation was aborted as stale under a call.

An episode that a limit ended (max_turns, tokens, the context) is never a failure: if the
agent returns, its result is used; if it lets the endpoint's refusal propagate, the episode
is kept with reward 0. Either way it counts as truncated.

It is also a run service: ``start`` serves the HTTP endpoint (``client: http``) before the
pumps start, ``stop`` shuts it down after them. With ``env.agent.workers`` the episodes play in
worker processes (``workers.py``); the endpoint, the capture and the deadlines stay here.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from tandemrl.agents.api import Agent, AgentInfraFailure, check_agent_result
from tandemrl.agents.episodes import Episode, EpisodeRegistry
from tandemrl.agents.inprocess import InProcessClient
from tandemrl.agents.server import PolicyEndpoint
from tandemrl.agents.service import PolicyService
from tandemrl.agents.workers import AgentRaised, AgentWorkerPool
from tandemrl.records import EnvResult, PromptItem
from tandemrl.rollout.failures import DataFailure
from tandemrl.rollout.generation_pool import within_awake_time
from tandemrl.rollout.ledger import StagedSibling, UnfinishedGroup
from tandemrl.rollout.manager import GroupAborted
from tandemrl.rollout.token_capture import OnPrefixMismatch, PrefixMismatch, merge_turns

log = logging.getLogger(__name__)

# The shared client's connection pool: at most this many calls in flight at once (more wait
# for a connection), each connection kept open while idle for CLIENT_KEEPALIVE_S.
MAX_CONNECTIONS = 1024
CLIENT_KEEPALIVE_S = 60.0


def shared_openai_client(base_url: str) -> Any:
    """The one ``openai.AsyncOpenAI`` every episode's client is a copy of (``with_options``
    with the episode's key shares its connection pool). It speaks HTTP through the client's
    own aiohttp transport (``openai.DefaultAioHttpClient``) where aiohttp is installed: with
    hundreds of episodes in flight, the default httpx pool rescans every connection per
    request and cost twice the CPU per call here (docs/benchmarks.md). No retries: a failed
    call is the episode's to handle, and the runner classifies it."""
    import openai

    try:  # openai 3 speaks through httpx2, openai 2 through httpx
        import httpx2 as httpx
    except ImportError:
        import httpx  # type: ignore[no-redef]

    # The HTTP layer logs every request at INFO ("HTTP Request: POST ... 200 OK"): thousands
    # of lines a step in a run whose logger.level is INFO, each one CPU on the controller.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
    # Every episode in flight may hold a connection: keep them all open between calls (the
    # default keeps 100 and closes and reopens the rest around every call), and drop idle
    # ones well before the endpoint does (server.SERVER_KEEPALIVE_S).
    limits = httpx.Limits(
        max_connections=MAX_CONNECTIONS,
        max_keepalive_connections=MAX_CONNECTIONS,
        keepalive_expiry=CLIENT_KEEPALIVE_S,
    )
    http_client = None
    try:
        http_client = openai.DefaultAioHttpClient(limits=limits)
    except RuntimeError:  # aiohttp is missing: the default httpx transport
        http_client = None
    # No read deadline here: a call's deadline is env.agent.call_timeout_s at the server and
    # the episode's is env.agent.episode_timeout_s (awake time, frozen while the engine stands
    # down, which a client clock is not). Connecting may take a while when hundreds of
    # episodes open their connections at once on a busy machine.
    return openai.AsyncOpenAI(
        base_url=base_url,
        api_key="-",
        max_retries=0,
        timeout=openai.Timeout(None, connect=60.0),
        http_client=http_client,
    )


class AgentRollouts:
    """See the module docstring."""

    def __init__(
        self,
        agent: Agent,
        service: PolicyService,
        *,
        episode_timeout_s: float,
        on_prefix_mismatch: OnPrefixMismatch,
        frozen_time: Callable[[], Awaitable[float]],
        endpoint: PolicyEndpoint | None = None,
        workers: AgentWorkerPool | None = None,
    ) -> None:
        self.agent = agent
        self.service = service
        self.registry: EpisodeRegistry = service.registry
        self.episode_timeout_s = episode_timeout_s
        self.on_prefix_mismatch = on_prefix_mismatch
        self.frozen_time = frozen_time
        # None: agents get the in-process client; else the HTTP endpoint and openai's client.
        self.endpoint = endpoint
        # Set: episodes play in worker processes (env.agent.workers), each with its own agent
        # and client on the endpoint; ``agent`` itself is then never started here.
        self.workers = workers
        if workers is not None and endpoint is None:
            raise ValueError("agent workers reach the policy over HTTP: they need the endpoint")
        self._http_client: Any = None
        self._agent_started = False
        self.episodes_run = 0

    # ------------------------------------------------------------------ run service

    async def start(self) -> None:
        if self.endpoint is not None and not self.endpoint.running:
            url = await self.endpoint.start()
            if self.workers is None:
                self._http_client = shared_openai_client(url)
        if not self._agent_started:
            try:
                if self.workers is not None:
                    await self.workers.start(self.endpoint.url)  # type: ignore[union-attr]
                else:
                    await self.agent.start(None if self.endpoint is None else self.endpoint.url)
            except BaseException:
                # Not started as a service: the controller will not call stop; clean up here.
                await self.agent.stop()
                await self.stop()
                raise
            self._agent_started = True

    async def health(self) -> str | None:
        """The agent's own report on what it depends on (the stall watchdog quotes it)."""
        if self.workers is not None:
            return await self.workers.health()
        return await self.agent.health()

    async def stop(self) -> None:
        if self._agent_started:
            self._agent_started = False
            if self.workers is not None:
                await self.workers.stop()
            else:
                await self.agent.stop()
        if self._http_client is not None:
            await self._http_client.close()
            self._http_client = None
        if self.endpoint is not None:
            await self.endpoint.stop()

    def client_for(self, episode: Episode) -> Any:
        """The client an agent gets for ``episode``: its key as the api_key."""
        if self.endpoint is None:
            return InProcessClient(self.service, episode.key)
        if self._http_client is None:
            raise RuntimeError("the policy endpoint is not started (AgentRollouts.start)")
        return self._http_client.with_options(api_key=episode.key)

    # ------------------------------------------------------------------ episodes

    async def run_siblings(
        self, group: UnfinishedGroup, siblings: list[int], attempt: int
    ) -> list[StagedSibling | BaseException]:
        """One episode per sibling, concurrently; per sibling its outcome (module docstring)."""
        return list(
            await asyncio.gather(*(self._episode(group, sibling, attempt) for sibling in siblings))
        )

    async def _episode(
        self, group: UnfinishedGroup, sibling: int, attempt: int
    ) -> StagedSibling | BaseException:
        episode = self.registry.open(group.group_id, sibling, attempt)
        self.episodes_run += 1
        closed_as = "finished"
        try:
            try:
                result = await within_awake_time(
                    self._play(group.item, episode),
                    timeout_s=self.episode_timeout_s,
                    frozen_time=self.frozen_time,
                    timed_out=lambda: self._timed_out(episode),
                )
            except asyncio.CancelledError:
                closed_as = "cancelled (its group was aborted or the run is ending)"
                raise
            except Exception as exc:
                closed_as = "failed"
                return self._failed(episode, exc)
            return self._finished(episode, result)
        finally:
            self.registry.close(episode, closed_as)
            if episode.in_flight:  # calls the agent left running (it raised, or timed out)
                await self.service.pool.abort(sorted(episode.in_flight))

    def _play(self, item: PromptItem, episode: Episode) -> Awaitable[object]:
        """The agent's run of ``episode``: in a worker process, or on this event loop."""
        if self.workers is not None:
            return self.workers.run(item, episode.key)
        return self.agent.run(item, self.client_for(episode))

    async def _timed_out(self, episode: Episode) -> BaseException:
        self.registry.close(episode, "timed out")
        return DataFailure(
            f"agent episode {episode.request_prefix} ran past env.agent.episode_timeout_s="
            f"{self.episode_timeout_s} (awake time)"
        )

    def _finished(self, episode: Episode, result: object) -> StagedSibling | BaseException:
        if episode.aborted:
            return GroupAborted(episode.group_id)
        if episode.infra_failure is not None:
            return episode.infra_failure
        try:
            checked = check_agent_result(result)
        except ValueError as exc:
            return DataFailure(f"episode {episode.request_prefix}: {exc}")
        metadata = dict(checked.metadata)
        return self._staged(episode, EnvResult(float(checked.reward), checked.keep, metadata))

    def _failed(self, episode: Episode, exc: Exception) -> StagedSibling | BaseException:
        import openai

        if episode.aborted:
            return GroupAborted(episode.group_id)
        if episode.infra_failure is not None:
            return episode.infra_failure  # what the endpoint met, whatever the agent raised
        if isinstance(exc, DataFailure | AgentInfraFailure):
            return exc
        if isinstance(exc, openai.APIConnectionError):
            failure = ConnectionError(f"the policy endpoint is unreachable: {exc}")
            failure.__cause__ = exc
            return failure
        if (
            episode.ended_by is not None
            and isinstance(exc, openai.APIStatusError | AgentRaised)
            and exc.status_code in (400, 409)
        ):
            # A limit ended the episode and the agent let the refusal propagate: truncated.
            return self._staged(episode, EnvResult(0.0, True, {}))
        if isinstance(exc, AgentRaised):  # in a worker: its class by name
            raised = DataFailure(f"agent raised {exc.type_name}: {exc} (agent worker {exc.worker})")
        else:
            raised = DataFailure(f"agent raised {type(exc).__name__}: {exc}")
        raised.__cause__ = exc
        return raised

    def _staged(self, episode: Episode, env_result: EnvResult) -> StagedSibling | BaseException:
        captured = episode.captured()
        if not captured.turns:
            return DataFailure(
                f"episode {episode.request_prefix} made no call to the policy"
                + (f" (it ended at its {captured.ended_by} limit)" if captured.ended_by else "")
                + ": there is nothing to train on"
            )
        try:
            merge_turns(captured.turns, on_prefix_mismatch=self.on_prefix_mismatch)
        except PrefixMismatch as exc:
            return DataFailure(f"episode {episode.request_prefix}: {exc}")
        return StagedSibling(None, env_result, captured)
