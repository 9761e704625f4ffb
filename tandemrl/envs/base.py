"""The environment contract: score one completion of one prompt, or a prompt group at once.

``score`` may raise: the rollout manager records that as a data failure of the prompt (with
the prompt id and the error) and applies the retry/drop budgets; it never crashes the
controller.

``score_group`` scores every completion of one prompt group in one call. It returns one
entry per completion, in order: the ``EnvResult``, or the exception scoring that completion
raised, so a failure is charged to the sibling that caused it. The default calls ``score``
once per completion; an environment that can do better (one target per prompt, one pass over
the group) overrides it and returns exactly what ``score`` would per completion. An override
that raises instead fails every completion of the call.

``score_group_async`` is what the rollout manager awaits, once per generation round of a
group, on the controller's event loop — the loop that also runs both pumps and every other
group. Scoring must therefore never block it:

- a fast, CPU-only scorer (string comparison, a regex, a small parser) runs inline: the
  default ``score_group_async`` calls ``score_group`` directly (``scoring_threads = 0``);
- a scorer that blocks (an HTTP verifier called with a blocking client, a subprocess, a
  sandbox) sets ``scoring_threads = N``: ``score_group`` then runs in a pool of N worker
  threads, so up to N groups are scored at once while the loop keeps generating and training;
- a scorer written with ``async`` I/O (an LLM judge through an async client) subclasses
  ``AsyncEnvironment`` and implements ``score_async``; the siblings of a group are scored
  concurrently, and ``max_concurrent_scores`` caps the calls in flight across all groups.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from tandemrl.records import EnvResult, PromptItem

ScoreOutcomes = list[EnvResult | Exception]


class Environment(ABC):
    # Worker threads that run score_group off the event loop; 0 runs it inline (fast scorers).
    # A class attribute, or an instance attribute set in __init__ (from env.kwargs, say).
    scoring_threads: int = 0

    @abstractmethod
    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        """Reward (and keep flag, metadata) for ``completion`` of ``item``."""

    def score_group(
        self, item: PromptItem, completions: Sequence[str], *, truncated: Sequence[bool]
    ) -> ScoreOutcomes:
        """Per completion of ``item``'s group, in order: its result or its scoring exception."""
        outcomes: ScoreOutcomes = []
        for completion, was_truncated in zip(completions, truncated, strict=True):
            try:
                outcomes.append(self.score(item, completion, truncated=was_truncated))
            except Exception as exc:  # reward code of any kind: a data failure of this sibling
                outcomes.append(exc)
        return outcomes

    async def score_group_async(
        self, item: PromptItem, completions: Sequence[str], *, truncated: Sequence[bool]
    ) -> ScoreOutcomes:
        """What the rollout manager awaits: ``score_group``, in a worker thread when
        ``scoring_threads`` > 0. Same return value and failure rules as ``score_group``."""
        if not self.scoring_threads:
            return self.score_group(item, completions, truncated=truncated)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(
            self._scoring_executor(), self._score_group_call, item, completions, truncated
        )

    def _score_group_call(
        self, item: PromptItem, completions: Sequence[str], truncated: Sequence[bool]
    ) -> ScoreOutcomes:
        return self.score_group(item, completions, truncated=truncated)

    def _scoring_executor(self) -> ThreadPoolExecutor:
        # Made on first use and kept for the environment's life: subclasses need not call an
        # __init__ of ours. Its threads exit with the process (the controller actor's).
        executor = self.__dict__.get("_scoring_pool")
        if executor is None:
            executor = ThreadPoolExecutor(
                max_workers=self.scoring_threads,
                thread_name_prefix=f"{type(self).__name__}-scoring",
            )
            self.__dict__["_scoring_pool"] = executor
        return executor

    def check_scoring_settings(self) -> None:
        """Refuse settings that would stall scoring (``create_environment`` calls this)."""
        threads = self.scoring_threads
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 0:
            raise ValueError(
                f"{type(self).__name__}.scoring_threads must be an integer >= 0 "
                f"(0 scores on the event loop), got {threads!r}"
            )

    def item_metadata(self, item: PromptItem) -> dict[str, object]:
        """Metadata every environment attaches: the prompt's ``task_source`` when it has one."""
        if item.task_source is None:
            return {}
        return {"task_source": item.task_source}


class AsyncEnvironment(Environment):
    """An environment whose scoring awaits I/O: implement ``score_async``.

    The completions of a group are scored concurrently (one ``score_async`` call each); a call
    that raises fails only its own sibling. ``max_concurrent_scores`` (None: no cap) bounds
    the calls in flight across every group of the run, so a judge endpoint sees at most that
    many requests at once whatever ``async_rl.max_inflight_prompts`` is.
    """

    max_concurrent_scores: int | None = None

    @abstractmethod
    async def score_async(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        """Reward (and keep flag, metadata) for ``completion`` of ``item``, awaiting I/O."""

    def check_scoring_settings(self) -> None:
        super().check_scoring_settings()
        limit = self.max_concurrent_scores
        if limit is not None and (
            isinstance(limit, bool) or not isinstance(limit, int) or limit < 1
        ):
            raise ValueError(
                f"{type(self).__name__}.max_concurrent_scores must be None (no cap) or an "
                f"integer >= 1, got {limit!r}"
            )

    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        """``score_async`` run to completion on a fresh event loop: for scripts and tests. The
        rollout manager never calls it (it awaits ``score_group_async``); inside a running
        event loop it raises RuntimeError."""
        return asyncio.run(self.score_async(item, completion, truncated=truncated))

    async def score_group_async(
        self, item: PromptItem, completions: Sequence[str], *, truncated: Sequence[bool]
    ) -> ScoreOutcomes:
        calls = [
            self._bounded_score(item, completion, was_truncated)
            for completion, was_truncated in zip(completions, truncated, strict=True)
        ]
        # A cancellation of this group (an abort, the run ending) cancels every call and
        # propagates; an exception of one call is that sibling's outcome.
        gathered = await asyncio.gather(*calls, return_exceptions=True)
        outcomes: ScoreOutcomes = []
        for outcome in gathered:
            if isinstance(outcome, asyncio.CancelledError):
                # A call cancelled from inside (its own timeout, a client shutting down), not
                # the group: a failure of that sibling, not a cancellation of the rollout.
                outcomes.append(RuntimeError(f"score_async was cancelled: {outcome!r}"))
            elif isinstance(outcome, BaseException) and not isinstance(outcome, Exception):
                raise outcome  # KeyboardInterrupt, SystemExit: never a scoring result
            else:
                outcomes.append(outcome)
        return outcomes

    async def _bounded_score(self, item: PromptItem, completion: str, truncated: bool) -> EnvResult:
        limit = self._concurrency_limit()
        if limit is None:
            return await self.score_async(item, completion, truncated=truncated)
        async with limit:
            return await self.score_async(item, completion, truncated=truncated)

    def _concurrency_limit(self) -> asyncio.Semaphore | None:
        if self.max_concurrent_scores is None:
            return None
        # One semaphore per event loop: a semaphore is bound to the loop that first waits on it,
        # and scripts or tests may score on several loops one after another.
        loop = asyncio.get_running_loop()
        held = self.__dict__.get("_score_limit")
        if held is None or held[0] is not loop:
            held = (loop, asyncio.Semaphore(self.max_concurrent_scores))
            self.__dict__["_score_limit"] = held
        return held[1]
