"""RolloutManager: one prompt group from dispatch to a committed, training-ready buffer slot.

``reserve`` appends the group's slot (stamped with ``start_weight`` and the sampler's
``target_step``) and opens it in the ownership ledger; ``generate_and_push`` then drives the
rollout:

1. generate every unfinished sibling (one generation call for the group's pending siblings);
2. score the completions with the environment (one awaited ``score_group_async`` call per
   round, which returns each sibling's result or exception, so a failure is charged to its
   sibling; a slow scorer runs in threads or as coroutines and never blocks the loop);
   finished siblings are staged in the ledger (token capture), so ``sibling`` recovery never
   regenerates them;
3. retry failures by class (infrastructure with capped backoff, data without), at the
   group's recovery granularity: ``sibling`` regenerates only the failed siblings,
   ``prompt_group`` regenerates all of them;
4. on-policy distillation with ``teacher_scoring: rollout``: once every sibling finished, the
   prompt's teacher scores the group's completions (``tandemrl.rollout.teachers``; a dead
   teacher worker is retried like a generation failure), and the logprobs become the rows'
   ``teacher_logprobs`` field and part of the commit log record;
5. once every sibling finished, turn each environment reward into the reward the rows carry
   (``reward_scaling``, then ``reward_shaping``: ``tandemrl.training.rewards``), and write the
   group's rows to the data plane as one ``RowBlock``
   (``put_block``), then commit the slot with the observed ``end_weight`` — both under the
   checkpoint barrier, so a snapshot never sees rows without their index entry or the
   reverse.

It reports ``staged`` (after each generation round that finished siblings) and ``committed``
(between the rows and the ready slot) to the ``OwnershipEvents`` it was built with
(``tandemrl.rollout.events``); the controller reports the rest.

A group whose retries run out is dropped: its slot and any rows are removed, the ledger
forgets it and the drop budgets are charged (``RolloutDropped`` is raised to the pump, which
decides between shrink and replace).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import zlib
from collections import deque
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NoReturn, Protocol

from tandemrl.barrier import CheckpointBarrier
from tandemrl.buffer import ReplayBuffer, Slot
from tandemrl.codec import TextCodec
from tandemrl.config.models import RolloutFailureConfig
from tandemrl.dataplane.base import DataPlane, RowBlock
from tandemrl.dataplane.rows import make_group_block, make_sequence_block
from tandemrl.envs.base import Environment
from tandemrl.records import (
    EnvResult,
    GenerationRequest,
    GenerationResult,
    PromptItem,
    RowMeta,
    TeacherRequest,
)
from tandemrl.rollout.events import OwnershipEvents
from tandemrl.rollout.failures import (
    DataFailure,
    FailureBudgets,
    FailureKind,
    FailureRecord,
    RolloutDropped,
    backoff_delay,
    classify,
)
from tandemrl.rollout.generation_pool import (
    GenerationPool,
    NoGenerationWorkers,
    within_awake_time,
)
from tandemrl.rollout.ledger import OwnershipLedger, StagedSibling, UnfinishedGroup
from tandemrl.rollout.teachers import NoTeacherWorkers, TeacherScorer
from tandemrl.rollout.token_capture import OnPrefixMismatch, merge_turns
from tandemrl.training.rewards import RewardTransform

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: tuple[int, ...] = ()
    # policy.max_total_sequence_length: a completion stops where prompt + completion reach it
    # (None: no limit beyond max_new_tokens).
    max_total_tokens: int | None = None


class GroupAborted(Exception):
    """The group's in-flight generation was aborted as stale (windowed sampler)."""


class EpisodeRunner(Protocol):
    """Plays agent episodes (``tandemrl.agents.runner.AgentRollouts``, built by the controller)."""

    on_prefix_mismatch: OnPrefixMismatch

    async def run_siblings(
        self, group: UnfinishedGroup, siblings: list[int], attempt: int
    ) -> list[StagedSibling | BaseException]:
        """One episode per sibling: its staged sibling, or the exception that failed it
        (``DataFailure``, an infrastructure error, ``GroupAborted``)."""
        ...


@lru_cache(maxsize=8)
def _sample_id_suffixes(group_size: int) -> tuple[str, ...]:
    """``"/{sibling}"`` per sibling: a row's sample id is its group id and this suffix."""
    return tuple(f"/{sibling}" for sibling in range(group_size))


@lru_cache(maxsize=64)
def _sibling_keys(group_size: int, attempt: int) -> tuple[tuple[str, bytes], ...]:
    """Per sibling of one attempt: its request id suffix and the tail of its seed's key."""
    return tuple(
        (f"/{sibling}/a{attempt}", f"{sibling}|{attempt}".encode()) for sibling in range(group_size)
    )


_ENV_RESULTS_ONLY = {EnvResult}

# Completions kept for the metrics' sample log (``logger.sample_log_period``): the latest few.
RECENT_SAMPLES = 8


def numeric_metadata(metadata: dict[str, object]) -> dict[str, float] | None:
    """The numbers (and booleans) of an environment result's metadata, e.g. ``correct``: they
    are averaged into the step's metrics as ``env/<key>``. None when there are none."""
    numbers = {
        key: float(value)
        for key, value in metadata.items()
        if isinstance(value, int | float) and math.isfinite(value)
    }
    return numbers or None


def _as_data_failure(outcome: EnvResult | BaseException | None) -> EnvResult | DataFailure:
    """A scoring outcome: the result, or the exception it raised as a ``DataFailure``."""
    if isinstance(outcome, EnvResult):
        return outcome
    if isinstance(outcome, DataFailure):
        return outcome
    if isinstance(outcome, BaseException):
        failure = DataFailure(f"{type(outcome).__name__}: {outcome}")
        failure.__cause__ = outcome
        return failure
    return DataFailure(f"score_group_async returned {outcome!r}, not an EnvResult or an exception")


class RolloutManager:
    def __init__(
        self,
        *,
        buffer: ReplayBuffer,
        data_plane: DataPlane,
        generation: GenerationPool,
        env: Environment | None,
        codec: TextCodec,
        sampling: SamplingParams,
        group_size: int,
        failure_cfg: RolloutFailureConfig,
        ledger: OwnershipLedger,
        budgets: FailureBudgets,
        barrier: CheckpointBarrier,
        overlong_filtering: bool = False,
        seed: int = 0,
        events: OwnershipEvents | None = None,
        agents: EpisodeRunner | None = None,
        reward_transform: RewardTransform | None = None,
        teachers: TeacherScorer | None = None,
        teacher_stage: bool = False,
    ) -> None:
        self.buffer = buffer
        self.data_plane = data_plane
        self.generation = generation
        self.env = env
        self.codec = codec
        self.sampling = sampling
        # A completion's text leaves out the stop token that ended it.
        eos = () if codec.eos_token_id is None else (codec.eos_token_id,)
        self._stop_ids = frozenset((*sampling.stop_token_ids, *codec.stop_token_ids, *eos))
        self.group_size = group_size
        self.failure_cfg = failure_cfg
        self.ledger = ledger
        self.budgets = budgets
        self.barrier = barrier
        self.overlong_filtering = overlong_filtering
        # reward_scaling / reward_shaping (None or inactive: the environment's reward as is).
        self.reward_transform = (
            reward_transform if reward_transform is not None and reward_transform.active else None
        )
        self.seed = seed
        # The journal and/or the commit log; None when neither is on.
        self.events = events
        # On-policy distillation: the teachers (each row records its teacher's index) and
        # whether they score each group here, before its commit (teacher_scoring: rollout).
        self.teachers = teachers
        self.teacher_stage = teacher_stage and teachers is not None
        self.teacher_passes = 0  # groups scored by the teacher stage (metrics, chaos proofs)
        # The latest completions with their rewards, for the metrics' sample log.
        self.recent_samples: deque[dict[str, object]] = deque(maxlen=RECENT_SAMPLES)
        self.generated_siblings = 0  # completions produced by the engines (metrics, chaos proofs)
        self.reused_siblings = 0  # staged completions reused after a failure or restart
        # Requests of each group's generation call in flight (to abort them on the engine).
        self.active_requests: dict[str, list[GenerationRequest]] = {}
        # Agent runs (env.name: agent): the siblings are episodes played by this runner.
        self.agents = agents

    # ------------------------------------------------------------------ dispatch

    def reserve(
        self, item: PromptItem, *, start_weight: int, target_step: int | None
    ) -> UnfinishedGroup:
        """Append the group's buffer slot and open it in the ledger (synchronous, no await)."""
        group_id = item.prompt_id
        self.buffer.reserve(group_id, start_weight, target_step, item)
        return self.ledger.open(
            item, group_id=group_id, target_step=target_step, start_weight=start_weight
        )

    def reserve_recovered(self, group: UnfinishedGroup, *, current_weight: int) -> UnfinishedGroup:
        """Re-reserve a group restored from the ownership ledger after a restart.

        The group is in the ledger already (``adopt`` at restore). Its target step is kept; its
        start weight is the oldest weight any of its surviving siblings saw, or the current
        weight when nothing survived.
        """
        if not group.staged:
            group.start_weight = current_weight
        self.buffer.reserve(
            group.group_id,
            start_weight=group.start_weight,
            target_step=group.target_step,
            item=group.item,
        )
        return group

    async def generate_and_push(self, group: UnfinishedGroup) -> None:
        """Drive ``group`` to a committed slot; raise RolloutDropped when it is dropped."""
        reused = set(group.staged)
        try:
            if self.teachers is not None:
                self._check_teacher(group, self.teachers)
            if self.agents is None:
                await self._generate_all_siblings(group)
            else:
                await self._run_all_episodes(group, self.agents)
            if self.teacher_stage and group.teacher_logprobs is None:
                assert self.teachers is not None
                await self._teacher_pass(group, self.teachers)
            await self._push_and_commit(group, reused)
        except RolloutDropped as dropped:
            dropped.slot = await self._drop(group)
            self.budgets.record_drop(dropped.record)
            raise
        except GroupAborted:
            await self._drop(group)
            raise
        self.budgets.record_commit()

    # ------------------------------------------------------------------ generation

    def _prompt_ids(self, group: UnfinishedGroup) -> list[int]:
        """The group's prompt as token ids (``data.prompt_format``), its processed images kept
        on the group (a vision-language run); a prompt that cannot be rendered (a chat
        template refusing its conversation, an image that is missing, corrupt or too large)
        drops the group, no retry."""
        try:
            prompt_ids, group.image_inputs = self.codec.encode_prompt_inputs(group.item)
        except Exception as exc:  # the template, codec and images are user data too
            self._drop_unretryable(group, DataFailure(f"prompt {group.item.prompt_id}: {exc}"))
        return prompt_ids

    def _image_inputs(self, group: UnfinishedGroup) -> dict[str, Any] | None:
        """The group's processed images for its rows: those its generation used, or (a group
        replayed from the commit log after a restart) its prompt encoded again, which must
        give the very prompt its siblings were generated from."""
        if group.image_inputs is not None or self.codec.encode_with_images is None:
            return group.image_inputs
        prompt_ids, group.image_inputs = self.codec.encode_prompt_inputs(group.item)
        first = group.staged[0].result
        assert first is not None  # an agent episode is refused with policy.is_vlm
        staged_prompt = first.prompt_token_ids
        if list(staged_prompt) != list(prompt_ids):
            raise DataFailure(
                f"prompt {group.item.prompt_id}: encoding its images again gave another prompt "
                f"({len(prompt_ids)} tokens) than its committed siblings' "
                f"({len(staged_prompt)} tokens); its image source changed since"
            )
        return group.image_inputs

    def _completion_budget(self, group: UnfinishedGroup, prompt_ids: list[int]) -> int:
        """``max_new_tokens``, cut so that prompt + completion fit the trainer's
        ``policy.max_total_sequence_length``; a prompt that leaves no room drops the group."""
        limit = self.sampling.max_total_tokens
        if limit is None:
            return self.sampling.max_new_tokens
        room = limit - len(prompt_ids)
        if room < 1:
            self._drop_unretryable(
                group,
                DataFailure(
                    f"prompt {group.item.prompt_id} is {len(prompt_ids)} tokens as the model "
                    "sees it (data.prompt_format, chat template included), which leaves no room "
                    f"for a completion within policy.max_total_sequence_length={limit}; raise it "
                    "or shorten the prompt"
                ),
            )
        return min(self.sampling.max_new_tokens, room)

    def _drop_unretryable(self, group: UnfinishedGroup, failure: DataFailure) -> NoReturn:
        """Charge ``failure`` to the group and drop it: trying again would fail the same way."""
        record = self._record(group, None, 1, FailureKind.DATA, failure)
        raise RolloutDropped(group.group_id, record) from failure

    def _requests(
        self,
        group: UnfinishedGroup,
        siblings: list[int],
        attempt: int,
        prompt_ids: list[int],
        max_new_tokens: int,
    ) -> list[GenerationRequest]:
        """One request per sibling; its seed is crc32("{seed}|{group_id}|{sibling}|{attempt}")."""
        group_id = group.group_id
        sampling = self.sampling
        temperature = sampling.temperature
        top_p, stop_token_ids = sampling.top_p, sampling.stop_token_ids
        # crc32 continues from a running value, so the shared prefix is hashed once per call.
        prefix_crc = zlib.crc32(f"{self.seed}|{group_id}|".encode())
        crc32 = zlib.crc32
        keys = _sibling_keys(self.group_size, attempt)
        image_inputs = group.image_inputs
        requests = []
        for sibling in siblings:
            id_suffix, seed_suffix = keys[sibling]
            # Positional, in GenerationRequest's field order (keywords cost a third more per
            # call on this path; test_rollout_manager checks every field by name).
            requests.append(
                GenerationRequest(
                    group_id + id_suffix,  # request_id: "{group_id}/{sibling}/a{attempt}"
                    prompt_ids,
                    max_new_tokens,
                    temperature,
                    top_p,
                    stop_token_ids,
                    crc32(seed_suffix, prefix_crc) & 0x7FFFFFFF,  # seed
                    image_inputs,
                )
            )
        return requests

    async def _generate_all_siblings(self, group: UnfinishedGroup) -> None:
        prompt_ids = self._prompt_ids(group)
        max_new_tokens = self._completion_budget(group, prompt_ids)
        infra_retries = 0
        data_retries: dict[int, int] = {}
        attempt = 0
        self.reused_siblings += len(group.staged)
        while len(group.staged) < self.group_size:
            pending = [i for i in range(self.group_size) if i not in group.staged]
            attempt += 1
            requests = self._requests(group, pending, attempt, prompt_ids, max_new_tokens)
            self.active_requests[group.group_id] = requests
            try:
                if self.failure_cfg.rollout_timeout_s is None:  # one coroutine level less
                    results = await self.generation.generate(requests)
                else:
                    results = await self._generate_within_rollout_deadline(
                        group, requests, attempt_started=time.monotonic()
                    )
            except NoGenerationWorkers:
                raise
            except Exception as exc:
                if classify(exc) is not FailureKind.INFRA:
                    raise
                record = self._record(group, None, infra_retries + 1, FailureKind.INFRA, exc)
                if infra_retries >= self.failure_cfg.max_infra_retries:
                    raise RolloutDropped(group.group_id, record) from exc
                await asyncio.sleep(backoff_delay(infra_retries, self.failure_cfg))
                infra_retries += 1
                if group.granularity == "prompt_group":
                    group.discard_staged()
                continue
            self.active_requests.pop(group.group_id, None)
            self.generated_siblings += len(results)
            for result in results:
                if result.finish_reason == "aborted":
                    raise GroupAborted(group.group_id)
            failed_any = False
            finished = []
            scored = await self._score_all(group, results)
            for sibling, result, outcome in zip(pending, results, scored, strict=True):
                if isinstance(outcome, DataFailure):
                    retries = data_retries.get(sibling, 0)
                    record = self._record(group, sibling, retries + 1, FailureKind.DATA, outcome)
                    if retries >= self.failure_cfg.max_data_retries:
                        raise RolloutDropped(group.group_id, record) from outcome
                    data_retries[sibling] = retries + 1
                    failed_any = True
                    continue
                group.staged[sibling] = StagedSibling(result, outcome)
                finished.append(sibling)
            if finished and self.events is not None:
                self.events.staged(group, finished)
            if failed_any and group.granularity == "prompt_group":
                group.discard_staged()

    async def _run_all_episodes(self, group: UnfinishedGroup, agents: EpisodeRunner) -> None:
        """``_generate_all_siblings`` for agent runs: one episode per unfinished sibling, all at
        once; staged, retried and dropped by the same rules (data failures per sibling,
        infrastructure failures per round with backoff)."""
        infra_retries = 0
        data_retries: dict[int, int] = {}
        attempt = 0
        self.reused_siblings += len(group.staged)
        while len(group.staged) < self.group_size:
            pending = [i for i in range(self.group_size) if i not in group.staged]
            attempt += 1
            outcomes = await agents.run_siblings(group, pending, attempt)
            self.generated_siblings += len(pending)
            infra: BaseException | None = None
            failed_any = False
            finished = []
            for sibling, outcome in zip(pending, outcomes, strict=True):
                if isinstance(outcome, StagedSibling):
                    group.staged[sibling] = outcome
                    finished.append(sibling)
                    continue
                if isinstance(outcome, NoGenerationWorkers | GroupAborted):
                    raise outcome
                if classify(outcome) is FailureKind.INFRA:
                    infra = infra or outcome
                    continue
                retries = data_retries.get(sibling, 0)
                record = self._record(group, sibling, retries + 1, FailureKind.DATA, outcome)
                if retries >= self.failure_cfg.max_data_retries:
                    raise RolloutDropped(group.group_id, record) from outcome
                data_retries[sibling] = retries + 1
                failed_any = True
            if finished and self.events is not None:
                self.events.staged(group, finished)
            if infra is not None:
                record = self._record(group, None, infra_retries + 1, FailureKind.INFRA, infra)
                if infra_retries >= self.failure_cfg.max_infra_retries:
                    raise RolloutDropped(group.group_id, record) from infra
                await asyncio.sleep(backoff_delay(infra_retries, self.failure_cfg))
                infra_retries += 1
            if (failed_any or infra is not None) and group.granularity == "prompt_group":
                group.discard_staged()

    def _check_teacher(self, group: UnfinishedGroup, teachers: TeacherScorer) -> None:
        """A prompt no teacher serves is dropped before anything is generated for it."""
        try:
            teachers.index_for(group.item)
        except DataFailure as failure:
            self._drop_unretryable(group, failure)

    async def _teacher_pass(self, group: UnfinishedGroup, teachers: TeacherScorer) -> None:
        """The group's teacher logprobs (every sibling finished); a dead teacher worker is an
        infrastructure failure, retried with backoff like a generation worker's."""
        staged = group.staged
        prompt_ids = staged[0].result.prompt_token_ids
        requests = [
            TeacherRequest(
                f"{group.group_id}/{sibling}", prompt_ids, staged[sibling].result.token_ids
            )
            for sibling in range(self.group_size)
        ]
        infra_retries = 0
        while True:
            try:
                group.teacher_logprobs = await teachers.score_group(group.item, requests)
                group.teacher_passes += 1
                self.teacher_passes += 1
                return
            except NoTeacherWorkers:
                raise
            except Exception as exc:
                kind = classify(exc)
                if kind is not FailureKind.INFRA:
                    failure = exc if isinstance(exc, DataFailure) else DataFailure(str(exc))
                    self._drop_unretryable(group, failure)
                record = self._record(group, None, infra_retries + 1, kind, exc)
                if infra_retries >= self.failure_cfg.max_infra_retries:
                    raise RolloutDropped(group.group_id, record) from exc
                await asyncio.sleep(backoff_delay(infra_retries, self.failure_cfg))
                infra_retries += 1

    async def _generate_within_rollout_deadline(
        self, group: UnfinishedGroup, requests: list[GenerationRequest], *, attempt_started: float
    ) -> list[GenerationResult]:
        """One generation call, bounded by rollout_timeout_s of awake time."""
        timeout = self.failure_cfg.rollout_timeout_s
        assert timeout is not None  # without one, _generate_all_siblings calls the pool itself

        async def timed_out() -> TimeoutError:
            await self.generation.abort([r.request_id for r in requests])
            return TimeoutError(
                f"rollout of prompt group {group.group_id} exceeded "
                f"async_rl.rollout_failure.rollout_timeout_s={timeout} (awake time)"
            )

        return await within_awake_time(
            self.generation.generate(requests),
            timeout_s=timeout,
            frozen_time=self.generation.frozen_time,
            timed_out=timed_out,
            started=attempt_started,
        )

    async def _score_all(
        self, group: UnfinishedGroup, results: list[GenerationResult]
    ) -> list[EnvResult | DataFailure]:
        return await self.score_results(group.item, results)

    async def score_results(
        self, item: PromptItem, results: list[GenerationResult], *, log_sample: bool = True
    ) -> list[EnvResult | DataFailure]:
        """Score a round's completions of ``item`` with one ``score_group_async`` call (the
        environment keeps the event loop free: see ``tandemrl.envs.base``); failures per
        completion. ``log_sample``: the first completion joins the training sample log (not
        for validation passes)."""
        texts: list[str] = []
        undecodable: dict[int, DataFailure] = {}
        decode, stops = self.codec.decode, self._stop_ids
        for index, result in enumerate(results):
            # The completion's text: its tokens without the stop token that ended it.
            completion = result.token_ids
            if completion and completion[-1] in stops:
                completion = completion[:-1]
            try:
                texts.append(decode(completion))
            except Exception as exc:  # the codec is user code too: this sibling's data failure
                undecodable[index] = _as_data_failure(exc)
        if not undecodable:
            return await self._score_texts(item, results, texts, log_sample)
        decoded = [result for index, result in enumerate(results) if index not in undecodable]
        scored = iter(await self._score_texts(item, decoded, texts, log_sample) if texts else [])
        return [undecodable.get(index) or next(scored) for index in range(len(results))]

    async def _score_texts(
        self,
        item: PromptItem,
        results: list[GenerationResult],
        texts: list[str],
        log_sample: bool,
    ) -> list[EnvResult | DataFailure]:
        truncated = [result.finish_reason == "length" for result in results]
        assert self.env is not None  # an agent run (no env) plays episodes instead
        try:
            scored = await self.env.score_group_async(item, texts, truncated=truncated)
            if len(scored) != len(texts):
                raise ValueError(
                    f"{type(self.env).__name__}.score_group_async returned {len(scored)} "
                    f"entries for {len(texts)} completions"
                )
        except Exception as exc:  # any exception from user reward code is a data failure
            scored = [exc] * len(texts)
        if log_sample and texts and type(scored[0]) is EnvResult:
            self.recent_samples.append(
                {
                    "prompt_id": item.prompt_id,
                    "prompt": item.prompt,
                    "completion": texts[0],
                    "reward": float(scored[0].reward),
                    "finish_reason": results[0].finish_reason,
                }
            )
        if set(map(type, scored)) == _ENV_RESULTS_ONLY:  # the usual case: nothing failed
            return scored
        return [
            outcome if type(outcome) is EnvResult else _as_data_failure(outcome)
            for outcome in scored
        ]

    def _record(
        self,
        group: UnfinishedGroup,
        sibling: int | None,
        attempt: int,
        kind: FailureKind,
        exc: BaseException,
    ) -> FailureRecord:
        record = FailureRecord(
            prompt_id=group.item.prompt_id,
            group_id=group.group_id,
            sibling_index=sibling,
            attempt=attempt,
            kind=kind,
            cause=f"{type(exc).__name__}: {exc}",
        )
        self.budgets.record_failure(record)
        log.warning(
            "rollout failure (%s) prompt=%s sibling=%s attempt=%d: %s",
            kind.value,
            record.prompt_id,
            sibling,
            attempt,
            record.cause,
        )
        return record

    # ------------------------------------------------------------------ commit / drop

    def _rows(self, group: UnfinishedGroup) -> tuple[RowBlock, list[RowMeta]]:
        """The group's rows as one block, and their metadata for the replay buffer."""
        if self.agents is not None:
            return self._episode_rows(group, self.agents.on_prefix_mismatch)
        group_id = group.group_id
        staged = group.staged
        filter_overlong = self.overlong_filtering
        sample_ids, rewards, keeps, metas = [], [], [], []
        completions, logprobs = [], []
        for sibling, suffix in enumerate(_sample_id_suffixes(self.group_size)):
            entry = staged[sibling]
            result, env_result = entry.result, entry.env_result
            assert result is not None  # only an agent episode has none (_episode_rows)
            truncated = result.finish_reason == "length"
            keep = 1.0 if env_result.keep and not (filter_overlong and truncated) else 0.0
            reward = float(env_result.reward)
            env_metrics = numeric_metadata(env_result.metadata) if env_result.metadata else None
            if self.reward_transform is not None:
                env_metrics = {**(env_metrics or {}), "reward_before_shaping": reward}
                reward = self.reward_transform(
                    reward, completion_tokens=len(result.token_ids), truncated=truncated
                )
            sample_id = group_id + suffix  # f"{group_id}/{sibling}"
            sample_ids.append(sample_id)
            rewards.append(reward)
            keeps.append(keep)
            completions.append(result.token_ids)
            logprobs.append(result.logprobs)
            metas.append(
                RowMeta(  # positional, in field order (see _requests; tested by name)
                    sample_id,
                    group_id,
                    sibling,
                    reward,
                    keep,  # sample_mask
                    len(result.prompt_token_ids),
                    len(result.token_ids),
                    truncated,
                    result.start_weight_version,
                    result.end_weight_version,
                    env_metrics,
                )
            )
        first = staged[0].result
        assert first is not None
        block = make_group_block(
            sample_ids,
            first.prompt_token_ids,
            completions,
            logprobs,
            rewards,
            keeps,
            None if self.teachers is None else self.teachers.index_for(group.item),
            group.teacher_logprobs,
            image_inputs=self._image_inputs(group),
        )
        return block, metas

    def _episode_rows(
        self, group: UnfinishedGroup, on_prefix_mismatch: OnPrefixMismatch
    ) -> tuple[RowBlock, list[RowMeta]]:
        """An agent group's rows: each episode's turns merged by prefix into one row, or one
        row per run of turns that extend each other (``on_prefix_mismatch: split``). Every row
        of an episode carries its reward; the first also its counters (``agent/...``)."""
        group_id = group.group_id
        filter_overlong = self.overlong_filtering
        sample_ids, rewards, keeps, metas = [], [], [], []
        input_ids, token_masks, logprobs = [], [], []
        for sibling in range(self.group_size):
            entry = group.staged[sibling]
            episode, env_result = entry.episode, entry.env_result
            if episode is None:
                raise ValueError(f"group {group_id} sibling {sibling} holds no agent episode")
            sequences = merge_turns(episode.turns, on_prefix_mismatch=on_prefix_mismatch)
            truncated = episode.truncated
            keep = 1.0 if env_result.keep and not (filter_overlong and truncated) else 0.0
            reward = float(env_result.reward)
            counters = numeric_metadata(env_result.metadata) or {}
            if self.reward_transform is not None:  # over the whole episode's sampled tokens
                counters["reward_before_shaping"] = reward
                reward = self.reward_transform(
                    reward,
                    completion_tokens=sum(len(turn.token_ids) for turn in episode.turns),
                    truncated=truncated,
                )
            counters.update(
                {
                    "agent/turns_mean": float(len(episode.turns)),
                    "agent/prefix_split_frac": float(len(sequences) > 1),
                    "agent/truncated_frac": float(truncated),
                }
            )
            for index, sequence in enumerate(sequences):
                suffix = "" if len(sequences) == 1 else f"/r{index}"
                sample_id = f"{group_id}/{sibling}{suffix}"
                sample_ids.append(sample_id)
                rewards.append(reward)
                keeps.append(keep)
                input_ids.append(sequence.input_ids)
                token_masks.append(sequence.token_mask)
                logprobs.append(sequence.logprobs)
                first_turn = episode.turns[sequence.turns[0]]
                metas.append(
                    RowMeta(
                        sample_id,
                        group_id,
                        sibling,
                        reward,
                        keep,
                        len(first_turn.prompt_token_ids),
                        sequence.num_sampled_tokens,
                        truncated,
                        sequence.start_weight_version,
                        sequence.end_weight_version,
                        counters if index == 0 else None,
                    )
                )
            if sibling == 0:
                first = sequences[0]
                prompt_length = len(episode.turns[0].prompt_token_ids)
                self.recent_samples.append(
                    {
                        "prompt_id": group.item.prompt_id,
                        "prompt": group.item.prompt,
                        "completion": self.codec.decode(first.input_ids[prompt_length:]),
                        "reward": reward,
                        "finish_reason": episode.turns[-1].finish_reason,
                    }
                )
        block = make_sequence_block(sample_ids, input_ids, token_masks, logprobs, rewards, keeps)
        return block, metas

    async def _push_and_commit(self, group: UnfinishedGroup, reused: set[int]) -> None:
        """``reused``: siblings staged before this attempt (not generated fresh by it)."""
        block, metas = self._rows(group)
        end_weight = max([meta.end_weight_version for meta in metas])
        async with self.barrier.mutation():
            # Rows first, then the slot flips ready: a ready slot always has its rows.
            await self.data_plane.put_block(block)
            if self.events is not None:
                # The commit log returns once durable: a trainable group survives any crash.
                fresh = [i for i in range(self.group_size) if i not in reused]
                slot = self.buffer.slot(group.group_id)
                await self.events.committed(
                    group, slot, end_weight=end_weight, fresh_siblings=fresh
                )
            self.buffer.commit(group.group_id, metas, end_weight=end_weight)
            self.ledger.close(group.group_id)

    def take_recent_samples(self) -> list[dict[str, object]]:
        """The latest completions (prompt, completion, reward), oldest first; then forgets them."""
        samples = list(self.recent_samples)
        self.recent_samples.clear()
        return samples

    async def write_replayed_rows(self, group: UnfinishedGroup) -> list[RowMeta]:
        """Commit-log replay: write a committed group's rows again (the rows
        ``_push_and_commit`` wrote) from its logged siblings; the caller restores the slot."""
        block, metas = self._rows(group)
        await self.data_plane.put_block(block)
        return metas

    async def clear_replayed_rows(self, sample_ids: list[str]) -> None:
        """Commit-log replay: clear the rows of a restored group the log says was removed."""
        await self.data_plane.clear(sample_ids)

    async def drop_aborted(self, group: UnfinishedGroup) -> None:
        """Remove a group whose generation the controller aborted as stale."""
        requests = self.active_requests.get(group.group_id)
        if requests:
            await self.generation.abort([request.request_id for request in requests])
        await self._drop(group)

    async def _drop(self, group: UnfinishedGroup) -> Slot:
        async with self.barrier.mutation():
            slot = self.buffer.remove(group.group_id)
            await self.data_plane.clear(slot.sample_ids)
            self.ledger.close(group.group_id)
            self.active_requests.pop(group.group_id, None)
        return slot
