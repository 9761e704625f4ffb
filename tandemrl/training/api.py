"""The trainer contract the train pump drives (policy and value workers, and their fakes).

A train batch is ``dict[str, torch.Tensor]`` built by ``tandemrl.training.batch.collate_rows``
from data-plane rows, right-padded to the longest sequence:

- ``input_ids`` [B, L] long; ``attention_mask`` [B, L] (1 = real token)
- ``token_mask`` [B, L] float: 1 at positions holding a generated token (the loss positions)
- ``generation_logprobs`` [B, L]: log p of ``input_ids[:, t]`` under the generating weights
  at generated positions, 0 elsewhere
- ``sample_mask`` [B] float: 0 excludes the whole sequence from the loss
- ``advantages`` [B, L]: set by the advantage stage (GRPO broadcasts one value per sequence)
- ``prev_logprobs`` [B, L]: the trainer's own logprobs before the update (from
  ``get_logprobs``), the denominator of the PPO ratio and numerator of the IS weight
- PPO only: ``values`` [B, L], ``returns`` [B, L]
- with a KL penalty: ``reference_logprobs`` [B, L], from ``get_reference_logprobs``

Logprob tensors are aligned with ``input_ids``: entry t is log p(input_ids[t] | input_ids[:t]).

One RL step is ``begin_train_step`` → ``train_microbatches`` once per streamed chunk →
``finish_train_step``, which applies exactly one optimizer step (PPO: one per epoch, the pump
calls the sequence ``ppo_epochs`` times).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

TrainBatch = dict[str, torch.Tensor]


@runtime_checkable
class Trainer(Protocol):
    async def get_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] logprobs of input_ids under the current weights (no grad)."""

    async def begin_train_step(self) -> None:
        """Zero gradients; the chunks that follow accumulate into one optimizer step."""

    async def train_microbatches(
        self, batch: TrainBatch, *, step_num_sequences: int, step_num_tokens: int | None = None
    ) -> dict[str, float]:
        """Forward/backward over ``batch`` in micro-batches, accumulating gradients.

        ``step_num_sequences`` is the size of the whole RL step, so that a step split across
        chunks weighs every sequence exactly as the unsplit step would. ``step_num_tokens`` is
        the whole step's valid-token count, sum(token_mask x sample_mask) over every chunk
        (``tandemrl.training.batch.count_loss_tokens``), when the caller knows it up front:
        the token-mean loss divides by it, and ``finish_train_step`` checks that the chunks
        held that many tokens in ``step_num_sequences`` rows. None (streaming: the step's size
        is not known yet) defers the normalization: ``step_num_sequences`` is then a
        provisional constant, the same for every chunk of the step (the step as planned; a
        dropped prompt may leave it fewer rows), and ``finish_train_step`` rescales the
        accumulated gradient by the token count (token mean) or the row count (sequence mean)
        it saw. Either way the step's gradient equals the unsplit step's over the rows it
        trained. Pass it to every chunk of a step or to none; 0 raises ``AllMaskedStepError``;
        a ``step_num_sequences`` that changes within a step raises ``TrainStepError``.
        """

    async def finish_train_step(self) -> dict[str, float]:
        """Clip gradients, apply one optimizer step, return metrics (grad_norm, lr, ...)."""

    async def export_weights(self) -> Any:
        """Current weights for generation workers (a CPU state dict, or a device handle)."""

    async def save_checkpoint(self, directory: Path, *, save_optimizer: bool) -> None: ...

    async def load_checkpoint(self, directory: Path, *, load_optimizer: bool) -> None: ...


@runtime_checkable
class ReferencePolicy(Protocol):
    """A trainer that also holds a frozen reference policy (loss_fn.reference_policy_kl_penalty)."""

    async def get_reference_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] logprobs of input_ids under the reference policy (no grad)."""


@runtime_checkable
class ValueTrainer(Protocol):
    async def get_values(self, batch: TrainBatch) -> torch.Tensor:
        """[B, L] value estimates (no grad)."""

    async def begin_train_step(self) -> None: ...

    async def train_microbatches(
        self, batch: TrainBatch, *, step_num_sequences: int, step_num_tokens: int | None = None
    ) -> dict[str, float]: ...

    async def finish_train_step(self) -> dict[str, float]: ...

    async def save_checkpoint(self, directory: Path, *, save_optimizer: bool) -> None: ...

    async def load_checkpoint(self, directory: Path, *, load_optimizer: bool) -> None: ...
