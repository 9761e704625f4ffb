"""The third producer: validation passes on the generation workers, beside the two pumps.

A pass (``tandemrl.rollout.validation_state``) opens when generation holds a due version
(``on_weights``, called after each weight sync) and is pinned to it. Its prompts go to the
same generation pool as training rollouts, one generation call per prompt for its
``val_num_generations`` completions, and are scored by the run's environment (the rollout
manager's ``score_results``). They are *evaluation* requests, told apart by their ids
(``eval/v{version}/{prompt}/{completion}/a{attempt}``), and they never touch what the pumps
share: no buffer slot, no ledger entry, no data-plane row, no sampler admission — so the
staleness gate never holds them back, eviction and stale aborts never see them, and no
evaluation row can reach the trainer.

The in-flight budget is shared: at most ``val_batch_size`` validation prompts are in flight,
inside ``async_rl.max_inflight_prompts`` (validation waits for a free slot; while a pass has
prompts left the rollout pump keeps ``slots_held`` of them free), so training rollouts keep
flowing beside it. Validation dispatches only while rollout permission is open (not during a
weight sync). When generation stands down for each train step (colocated), the train pump
waits for open passes to end before it sleeps: a pass runs while the engine is awake, never
across a stand-down.

A finished pass is reported once (``report``: the controller writes it to the metrics sink,
the run journal and the checkpoint writer). Failures: an infrastructure failure of a
generation call is retried like a rollout's (``async_rl.rollout_failure``); a prompt that
still fails, cannot be encoded, or whose completion cannot be scored counts as failed
completions (``val/failed_completions``) and is left out of the means; every worker dead ends
the run.
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from tandemrl.config.models import RolloutFailureConfig
from tandemrl.records import EnvResult, GenerationRequest, GenerationResult, PromptItem
from tandemrl.rollout.failures import FailureKind, backoff_delay, classify
from tandemrl.rollout.generation_pool import GenerationPool, NoGenerationWorkers
from tandemrl.rollout.manager import RolloutManager, SamplingParams
from tandemrl.rollout.validation_state import (
    OpenPass,
    PromptOutcome,
    ValidationSchedule,
    ValidationState,
    is_solved,
    pass_metrics,
)

log = logging.getLogger(__name__)

EVAL_REQUEST_PREFIX = "eval/"


@dataclass(frozen=True)
class ValidationSetup:
    """What ``build_controller`` hands the controller for validation."""

    prompts: list[PromptItem]
    schedule: ValidationSchedule
    num_generations: int  # k of pass@k
    inflight_share: int  # val_batch_size (resolved)
    # val_temperature / val_top_p (temperature 0: greedy), and the run's lengths and stops.
    sampling: SamplingParams
    seed: int
    fingerprint: str  # of the held-out records, in order


# (finished pass, its metrics) -> None: report them once (the controller).
Report = Callable[[OpenPass, dict[str, float]], None]


class ValidationRunner:
    def __init__(
        self,
        setup: ValidationSetup,
        *,
        state: ValidationState,
        generation: GenerationPool,
        scorer: RolloutManager,
        failure_cfg: RolloutFailureConfig,
        max_inflight_prompts: int,
        training_inflight: Callable[[], int],
        dispatch_allowed: Callable[[], bool],
        wait_change: Callable[[], Awaitable[None]],
        notify: Callable[[], None],
        report: Report,
        opened: Callable[[OpenPass], None] | None = None,
        progressed: Callable[[], None] | None = None,
    ) -> None:
        self.setup = setup
        self.state = state
        self.generation = generation
        self.scorer = scorer
        self.failure_cfg = failure_cfg
        self.max_inflight_prompts = max_inflight_prompts
        self._training_inflight = training_inflight
        self._dispatch_allowed = dispatch_allowed
        self._wait_change = wait_change
        self._notify = notify
        self._report = report
        self._opened = opened
        self._progressed = progressed
        # Set when a pass opens: with none open the producer sleeps on it, not on every change.
        self._work = asyncio.Event()
        # (version, prompt index) -> its task, for the prompts in flight.
        self._inflight: dict[tuple[int, int], asyncio.Task[None]] = {}
        self._failure: BaseException | None = None
        self._opened_at: dict[int, float] = {}
        self.passes_reported = 0
        self.requests_sent = 0

    # ------------------------------------------------------------------ the pumps ask

    @property
    def slots_held(self) -> int:
        """In-flight slots kept for validation while a pass has prompts left."""
        if not self.state.open:
            return 0
        return min(self.setup.inflight_share, self.state.unfinished_prompts())

    @property
    def idle(self) -> bool:
        return self.state.idle

    def on_weights(self, version: int, *, final: bool = False) -> None:
        """Generation holds ``version`` now: open its pass if it is due (``final``: the run's
        last version, for val_at_end)."""
        opened = [self.state.open_if_due(version)]
        if final:
            opened.append(self.state.open_final(version))
        for new in opened:
            if new is not None:
                self._announce(new)

    def resume_open_passes(self) -> None:
        """After a restore: announce the passes the checkpoint held open (they continue)."""
        for opened in self.state.open:
            self._announce(opened)

    def _announce(self, opened: OpenPass) -> None:
        self._opened_at[opened.version] = time.monotonic()
        self._work.set()
        if self._opened is not None:
            self._opened(opened)
        log.info(
            "validation pass of version %d: %d prompt(s) to evaluate%s",
            opened.version,
            len(opened.pending),
            f" (re-opened after a restart, {len(opened.results)} kept)" if opened.restarts else "",
        )
        self._notify()

    async def wait_idle(self, give_up: Callable[[], bool]) -> None:
        """Until no pass is open, or ``give_up()`` (a stop request)."""
        while not self.state.idle and not give_up():
            await self._wait_change()

    async def finish(self, version: int, give_up: Callable[[], bool]) -> None:
        """The run ended at ``version``: its val_at_end pass, then every open pass, done (or
        ``give_up()``: a stop request leaves them open for a restart)."""
        self.on_weights(version, final=True)
        await self.wait_idle(give_up)

    # ------------------------------------------------------------------ the producer

    async def run(self) -> None:
        """Dispatch the open passes' prompts within the share; report each finished pass."""
        try:
            while True:
                if self._failure is not None:
                    raise self._failure
                self._dispatch()
                for opened in list(self.state.open):
                    if opened.finished and not self._has_inflight(opened.version):
                        self._close(opened)
                if self.state.idle:
                    self._work.clear()
                    await self._work.wait()
                else:
                    await self._wait_change()
        finally:
            tasks = list(self._inflight.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    def _has_inflight(self, version: int) -> bool:
        return any(key[0] == version for key in self._inflight)

    def _room(self) -> bool:
        held = len(self._inflight)
        return (
            held < self.setup.inflight_share
            and self._training_inflight() + held < self.max_inflight_prompts
        )

    def _dispatch(self) -> None:
        if not self._dispatch_allowed():
            return
        for opened in self.state.open:  # oldest pass first
            for index in opened.pending:
                if not self._room():
                    return
                key = (opened.version, index)
                if key in self._inflight:
                    continue
                self._inflight[key] = asyncio.create_task(
                    self._evaluate(opened.version, index), name=f"eval:v{opened.version}/{index}"
                )

    def _close(self, opened: OpenPass) -> None:
        self.state.close(opened.version)
        metrics = pass_metrics(opened, self.setup.num_generations)
        started = self._opened_at.pop(opened.version, None)
        if started is not None:
            metrics["val/duration_s"] = time.monotonic() - started
        self.passes_reported += 1
        self._report(opened, metrics)
        self._notify()  # its held slots are free, and a stand-down may wait for it

    # ------------------------------------------------------------------ one prompt

    async def _evaluate(self, version: int, index: int) -> None:
        try:
            outcome = await self._outcome(version, index)
            self.state.record(version, outcome)
            if self._progressed is not None:
                self._progressed()
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # every worker dead, or a bug: the run must end
            self._failure = exc
        finally:
            self._inflight.pop((version, index), None)
            self._notify()

    async def _outcome(self, version: int, index: int) -> PromptOutcome:
        item = self.setup.prompts[index]
        k = self.setup.num_generations
        outcome = PromptOutcome(index=index, task_source=item.task_source)
        try:
            prompt_ids = self.scorer.codec.encode_prompt(item)
        except Exception as exc:  # a chat template refusing the conversation is data too
            return _failed(outcome, k, f"prompt {item.prompt_id}: {type(exc).__name__}: {exc}")
        sampling = self.setup.sampling
        budget = sampling.max_new_tokens
        if sampling.max_total_tokens is not None:
            budget = min(budget, sampling.max_total_tokens - len(prompt_ids))
        if budget < 1:
            return _failed(
                outcome,
                k,
                f"prompt {item.prompt_id} is {len(prompt_ids)} tokens, which leaves no room "
                "within policy.max_total_sequence_length",
            )
        results = await self._generate(version, index, prompt_ids, budget, outcome)
        if results is None:
            return outcome
        scored = await self.scorer.score_results(item, results, log_sample=False)
        for result, score in zip(results, scored, strict=True):
            outcome.add_weight_versions(
                result.token_weight_versions or [result.start_weight_version]
            )
            if result.finish_reason == "aborted":
                _failed(outcome, 1, f"{result.request_id}: aborted")
            elif isinstance(score, EnvResult):
                reward = float(score.reward)
                outcome.rewards.append(reward)
                outcome.lengths.append(len(result.token_ids))
                outcome.truncated.append(result.finish_reason == "length")
                outcome.solved.append(is_solved(reward, score.metadata))
            else:
                _failed(outcome, 1, f"{result.request_id}: {score}")
        return outcome

    async def _generate(
        self,
        version: int,
        index: int,
        prompt_ids: list[int],
        budget: int,
        outcome: PromptOutcome,
    ) -> list[GenerationResult] | None:
        """The completions, after retrying infrastructure failures; None when they ran out."""
        attempt = 0
        while True:
            attempt += 1
            requests = self._requests(version, index, prompt_ids, budget, attempt)
            self.requests_sent += len(requests)
            try:
                return await self.generation.generate(requests)
            except NoGenerationWorkers:
                raise
            except Exception as exc:
                if classify(exc) is not FailureKind.INFRA:
                    raise
                if attempt > self.failure_cfg.max_infra_retries:
                    _failed(outcome, self.setup.num_generations, f"{type(exc).__name__}: {exc}")
                    log.warning(
                        "validation prompt %d of version %d failed after %d attempt(s): %s",
                        index,
                        version,
                        attempt,
                        exc,
                    )
                    return None
                await asyncio.sleep(backoff_delay(attempt - 1, self.failure_cfg))

    def _requests(
        self, version: int, index: int, prompt_ids: list[int], budget: int, attempt: int
    ) -> list[GenerationRequest]:
        sampling = self.setup.sampling
        requests = []
        for sibling in range(self.setup.num_generations):
            key = f"{self.setup.seed}|eval|{version}|{index}|{sibling}|{attempt}"
            requests.append(
                GenerationRequest(
                    request_id=f"{EVAL_REQUEST_PREFIX}v{version}/{index}/{sibling}/a{attempt}",
                    prompt_token_ids=prompt_ids,
                    max_new_tokens=budget,
                    temperature=sampling.temperature,
                    top_p=sampling.top_p,
                    stop_token_ids=sampling.stop_token_ids,
                    seed=zlib.crc32(key.encode()) & 0x7FFFFFFF,
                )
            )
        return requests


def _failed(outcome: PromptOutcome, count: int, cause: str) -> PromptOutcome:
    outcome.failed += count
    if outcome.failure is None:
        outcome.failure = cause
    return outcome


def describe_pass(version: int, metrics: dict[str, Any], k: int) -> str:
    """One log line for a reported pass."""
    return (
        f"validation at version {version}: reward_mean {metrics['val/reward_mean']:.4f}, "
        f"pass@{k} {metrics[f'val/pass@{k}']:.4f}, mean_length {metrics['val/mean_length']:.2f}, "
        f"truncated {metrics['val/truncated_frac']:.3f}, version span "
        f"{int(metrics['val/version_span'])}, {int(metrics['val/num_prompts'])} prompt(s)"
    )
