"""Rollout failures: classification, retry schedule and the run-wide drop budgets.

Two classes of failure (reference spec, resiliency layer):

- infrastructure: a generation or teacher worker died, a request timed out, a transport error. Retried
  up to ``max_infra_retries`` times with capped exponential backoff
  (``min(backoff_initial_s * 2**k, backoff_max_s)``).
- data: the reward function or environment raised, or the output was malformed. Retried up to
  ``max_data_retries`` times, without backoff (the engine is healthy).

A prompt whose retries run out is *dropped*. ``max_skipped_prompts`` bounds drops over the whole
run and ``max_consecutive_dropped_prompts`` bounds drops in a row (any commit resets it);
exceeding either ends the run with ``FailureBudgetExceeded`` naming the budget.
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from tandemrl.buffer import Slot
from tandemrl.config.models import RolloutFailureConfig
from tandemrl.generation.base import GenerationError


class FailureKind(enum.StrEnum):
    INFRA = "infrastructure"
    DATA = "data"


class DataFailure(Exception):
    """The environment or reward function failed on one completion."""


class InfraFailure(Exception):
    """A worker of the run (a distillation teacher) died or could not be reached."""


class RolloutDropped(Exception):
    """A prompt group's retries ran out; the group is dropped."""

    def __init__(self, group_id: str, record: FailureRecord) -> None:
        super().__init__(
            f"prompt group {group_id} dropped after {record.attempt} attempt(s): {record.cause}"
        )
        self.group_id = group_id
        self.record = record
        self.slot: Slot | None = None  # the removed buffer slot, set once the group is dropped


class FailureBudgetExceeded(RuntimeError):
    """A drop budget of async_rl.rollout_failure was exceeded; the run must end."""


@dataclass(frozen=True)
class FailureRecord:
    prompt_id: str
    group_id: str
    sibling_index: int | None
    attempt: int
    kind: FailureKind
    cause: str


def _ray_worker_errors() -> tuple[type[BaseException], ...]:
    """Ray's worker-death errors. A process without Ray has none to classify: the GPU
    benchmarks run the controller in-process on a machine where Ray is not installed."""
    try:
        from ray.exceptions import RayActorError, RaySystemError, WorkerCrashedError
    except ImportError:
        return ()
    return (RayActorError, RaySystemError, WorkerCrashedError)


def classify(exc: BaseException) -> FailureKind:
    """Infrastructure for engine/transport/timeouts, data for everything the environment raised."""
    if isinstance(exc, DataFailure):
        return FailureKind.DATA
    if isinstance(
        exc,
        GenerationError
        | InfraFailure
        | TimeoutError
        | asyncio.TimeoutError
        | ConnectionError
        | OSError,
    ):
        return FailureKind.INFRA
    if isinstance(exc, _ray_worker_errors()):
        return FailureKind.INFRA  # a Ray worker process died under the call
    return FailureKind.DATA


def backoff_delay(retry_index: int, cfg: RolloutFailureConfig) -> float:
    return min(cfg.backoff_initial_s * (2**retry_index), cfg.backoff_max_s)


@dataclass
class FailureBudgets:
    cfg: RolloutFailureConfig
    skipped_prompts: int = 0
    consecutive_dropped: int = 0
    failures: list[FailureRecord] = field(default_factory=list)
    dropped: list[FailureRecord] = field(default_factory=list)

    def record_failure(self, record: FailureRecord) -> None:
        self.failures.append(record)

    def record_commit(self) -> None:
        self.consecutive_dropped = 0

    def record_drop(self, record: FailureRecord) -> None:
        """Count a dropped prompt; raise when a budget is exceeded."""
        self.dropped.append(record)
        self.skipped_prompts += 1
        self.consecutive_dropped += 1
        if self.skipped_prompts > self.cfg.max_skipped_prompts:
            raise FailureBudgetExceeded(
                f"async_rl.rollout_failure.max_skipped_prompts={self.cfg.max_skipped_prompts} exceeded: "
                f"{self.skipped_prompts} prompt(s) dropped; last: {record.prompt_id} "
                f"({record.kind.value} failure: {record.cause})"
            )
        if self.consecutive_dropped > self.cfg.max_consecutive_dropped_prompts:
            raise FailureBudgetExceeded(
                "async_rl.rollout_failure.max_consecutive_dropped_prompts="
                f"{self.cfg.max_consecutive_dropped_prompts} exceeded: {self.consecutive_dropped} "
                f"drops in a row; last: {record.prompt_id} ({record.kind.value} failure: {record.cause})"
            )

    def state_dict(self) -> dict[str, int]:
        return {
            "skipped_prompts": self.skipped_prompts,
            "consecutive_dropped": self.consecutive_dropped,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.skipped_prompts = int(state["skipped_prompts"])
        self.consecutive_dropped = int(state["consecutive_dropped"])
