"""A trainer for tests and benchmarks: records every batch, sleeps a configurable train time.

It implements the ``Trainer`` contract without a model. ``train_seconds_per_step`` is spread
over the step's chunks in proportion to their sequences, so a streamed step costs the same
as an unstreamed one. The sleep is ``asyncio.sleep``: in a real run the trainer is another
process, so the controller's event loop stays free while it trains.

It drives the split step through the workers' own bookkeeping (``worker_common.StepTracker``),
so it refuses what the policy worker refuses, with the same errors: a begin while a step is
open, a chunk or a finish outside a step, a ``step_num_sequences`` that changes within a step,
declared counts the chunks do not hold, a step without a valid token. A controller bug that a
real run would hit then fails the tests that use this fake.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandemrl.training.api import TrainBatch
from tandemrl.training.batch import count_loss_tokens
from tandemrl.training.worker_common import StepTracker


@dataclass
class RecordedStep:
    optimizer_step: int
    chunks: list[TrainBatch] = field(default_factory=list)

    # The step_num_sequences its chunks declared (one value: the tracker refuses a change).
    declared_sequences: int | None = None

    @property
    def num_sequences(self) -> int:
        return sum(int(chunk["input_ids"].shape[0]) for chunk in self.chunks)


class FakeTrainer:
    def __init__(self, *, train_seconds_per_step: float = 0.0, record_tensors: bool = True) -> None:
        self.train_seconds_per_step = train_seconds_per_step
        self.record_tensors = record_tensors
        self.steps: list[RecordedStep] = []
        self.optimizer_steps = 0
        self._open: RecordedStep | None = None
        self._step = StepTracker()
        self.weights_version = 0  # bumped per optimizer step; what export_weights hands out
        self.reference_calls = 0

    async def get_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        return batch["generation_logprobs"].clone()

    async def get_reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        # A reference policy that agrees with the generator: KL 0 wherever it is computed.
        self.reference_calls += 1
        return batch["generation_logprobs"].clone()

    async def begin_train_step(self) -> None:
        self._step.begin()
        self._open = RecordedStep(optimizer_step=self.optimizer_steps)

    async def train_microbatches(
        self, batch: TrainBatch, *, step_num_sequences: int, step_num_tokens: int | None = None
    ) -> dict[str, float]:
        num_sequences = int(batch["input_ids"].shape[0])
        self._step.declare(
            step_num_sequences=step_num_sequences,
            step_num_tokens=step_num_tokens,
            num_sequences=num_sequences,
        )
        self._step.add({"num_tokens": float(count_loss_tokens(batch))})
        assert self._open is not None  # the tracker refused a chunk outside a step
        self._open.declared_sequences = step_num_sequences
        if self.train_seconds_per_step > 0:
            await asyncio.sleep(self.train_seconds_per_step * num_sequences / step_num_sequences)
        self._open.chunks.append(
            batch if self.record_tensors else {"input_ids": batch["input_ids"]}
        )
        return {"loss": 0.0}

    async def finish_train_step(self) -> dict[str, float]:
        try:
            self._step.check_finish()
        except Exception:
            self._open = None  # refused: the step is discarded, as the worker discards it
            self._step.end()
            raise
        self._step.end()
        assert self._open is not None
        self.steps.append(self._open)
        self._open = None
        self.optimizer_steps += 1
        self.weights_version += 1
        return {"grad_norm": 0.0, "lr": 0.0}

    async def export_weights(self) -> Any:
        return {"fake_weights_version": self.weights_version}

    async def save_checkpoint(self, directory: Path, *, save_optimizer: bool) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        state = {"optimizer_steps": self.optimizer_steps, "weights_version": self.weights_version}
        (directory / "fake_trainer.json").write_text(json.dumps(state))

    async def load_checkpoint(self, directory: Path, *, load_optimizer: bool) -> None:
        state = json.loads((directory / "fake_trainer.json").read_text())
        self.optimizer_steps = state["optimizer_steps"]
        self.weights_version = state["weights_version"]


class FakeTeacher:
    """A teacher without a model (tests and benchmarks): token ``t`` gets the logprob
    ``-(offset + t % 7 / 10)``, after ``seconds_per_sequence`` of ``asyncio.sleep`` per
    sequence (one call at a time, as one worker's model scores). Records every request it
    scored; ``fail_next`` makes the next calls raise."""

    def __init__(self, *, offset: float = 0.5, seconds_per_sequence: float = 0.0) -> None:
        self.offset = offset
        self.seconds_per_sequence = seconds_per_sequence
        self.scored: list[Any] = []  # every TeacherRequest answered, in order
        self.calls = 0
        self.fail_next: list[BaseException] = []
        # One call at a time, like a worker's one model: concurrent calls queue.
        self._busy = asyncio.Lock()

    def logprob(self, token: int) -> float:
        return -(self.offset + (token % 7) / 10)

    async def score(self, requests: list[Any]) -> list[list[float]]:
        self.calls += 1
        if self.fail_next:
            raise self.fail_next.pop(0)
        if self.seconds_per_sequence > 0:
            async with self._busy:
                await asyncio.sleep(self.seconds_per_sequence * len(requests))
        self.scored.extend(requests)
        return [[self.logprob(t) for t in r.completion_token_ids] for r in requests]

    async def ping(self) -> dict[str, Any]:
        return {"scored": len(self.scored)}
