"""How one PPO step trains: critic forward, GAE, critic epochs, policy epochs.

``PPOStepRunner`` implements the ``StepRunner`` protocol (``tandemrl.controller.step_runner``).
The pump calls ``begin(version)`` → ``train_chunk`` per selected chunk → ``finish()``. A step
may come in any number of chunks (``min_groups_for_streaming_train`` below
``num_prompts_per_step``, the streaming samplers): what needs only the chunk runs as the chunk
arrives, what needs the whole step runs in ``finish`` (reference spec, "Implementation
Structure"):

    per chunk (train_chunk):
      offload the policy optimizer          policy.offload_optimizer_for_logprob
      value stage       critic.get_values(chunk)               ─┐ concurrently: two workers
      prev_logprobs     policy.get_logprobs(chunk)  (policy)   ─┘ computed once, all epochs
                        (skipped with loss_fn.reuse_training_logprobs, which validation
                        allows only with ppo_epochs 1: the training forward supplies them)
      reference         policy.get_reference_logprobs(chunk)  (policy, with a KL penalty)
      advantage stage   GAE per token (per sequence: exact on a chunk), reward on the last
                        generated token; returns = advantages + values
      critic epoch 1    critic.begin (first chunk) → critic.train_microbatches(chunk)
    finish:
      critic epoch 1    critic.finish: its one optimizer step
      critic epochs     ppo.critic_ppo_epochs - 1 more x (begin → every chunk → finish)
      whitening         advantages over the valid tokens of the whole step
      policy epochs     ppo.ppo_epochs x (begin → every chunk → finish)   (policy)

Every epoch is exactly one optimizer step of its model whatever the chunking, and normalised by
the rows the step actually holds (its valid tokens; its sequences for a sequence-mean loss),
not by the configured batch: a step shortened by a dropped prompt trains as a step of that
many rows. The critic's first epoch runs before the step's size is known, so it defers its
token normalisation (``step_num_tokens=None``: the value worker rescales the gradient in its
``finish_train_step``); the later epochs and the policy's pass the step's counts. Critic and
policy weights change only in their ``finish_train_step``, so every chunk's values and logprobs
come from the same pre-step weights, as they would from one whole-step batch.

"(policy)" stages run only once the critic warm-up is over: at trainer versions below
``ppo.policy_training_start_step`` only the critic trains, ``refit_after_step()`` is False
(the controller skips the weight sync) and the trainer version still advances.

Dispatch lookahead during the warm-up is the sampler's rule, not the runner's: in_order
knows ``ppo.policy_training_start_step`` and answers ``lookahead_at(version)`` itself.

Warm start: ``warm_start_critic`` seeds the critic from ``ppo.warm_start_value_checkpoint``
(a ``step_N`` folder or its ``value/`` subfolder) on a fresh run, and does nothing on a
resumed one: the critic then comes from the run's own checkpoint. The runner calls it once, in
its first ``begin``, with ``resuming = version > 0``: a trainer version above 0 can only come
from a restored trainer checkpoint, which holds ``step_N/value/``.

``value_trainer`` is public: checkpoint code saves and loads the critic through it
(``save_checkpoint(dir, save_optimizer=...)`` / ``load_checkpoint``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tandemrl.buffer import Slot
from tandemrl.config.models import MasterConfig
from tandemrl.config.validate import ppo_epoch_problems
from tandemrl.controller.step_runner import StepRows, collate_step_rows, reference_logprobs
from tandemrl.training.advantages import gae, sequence_rewards_to_tokens, whiten_together
from tandemrl.training.api import TrainBatch, Trainer, ValueTrainer
from tandemrl.training.batch import count_loss_tokens, loss_mask
from tandemrl.training.losses import AllMaskedStepError
from tandemrl.training.worker_common import WORKER_STATE_FILE

log = logging.getLogger(__name__)


class OffloadingTrainer(Trainer, Protocol):
    """The policy trainer of a PPO run: it can move its optimizer off the device."""

    async def offload_optimizer(self) -> None: ...


class WarmStartError(ValueError):
    """ppo.warm_start_value_checkpoint does not name a value checkpoint."""


@dataclass(frozen=True)
class PPOSettings:
    ppo_epochs: int
    critic_ppo_epochs: int
    policy_training_start_step: int
    gamma: float
    lam: float
    normalize_advantages: bool
    offload_optimizer: bool
    warm_start_value_checkpoint: str | None
    reuse_training_logprobs: bool = False
    # loss_fn.reference_policy_kl_penalty > 0: the policy epochs need reference logprobs.
    reference_kl: bool = False

    @classmethod
    def from_config(cls, cfg: MasterConfig) -> PPOSettings:
        ppo = cfg.ppo
        if ppo is None:
            raise ValueError("PPOSettings.from_config needs a config with a ppo: block")
        return cls(
            ppo_epochs=ppo.ppo_epochs,
            critic_ppo_epochs=ppo.critic_ppo_epochs,
            policy_training_start_step=ppo.policy_training_start_step,
            gamma=ppo.adv_estimator.gamma,
            lam=ppo.adv_estimator.lambda_,
            normalize_advantages=ppo.adv_estimator.normalize_advantages,
            offload_optimizer=cfg.policy.offload_optimizer_for_logprob,
            warm_start_value_checkpoint=ppo.warm_start_value_checkpoint,
            reuse_training_logprobs=cfg.loss_fn.reuse_training_logprobs,
            reference_kl=cfg.loss_fn.reference_policy_kl_penalty > 0,
        )

    def policy_trains_at(self, version: int) -> bool:
        return version >= self.policy_training_start_step


def resolve_value_checkpoint(path: str | Path) -> Path:
    """The ``value/`` folder of a ``step_N`` folder, or ``path`` itself if it is one."""
    folder = Path(path).expanduser()
    if (folder / WORKER_STATE_FILE).is_file():
        return folder
    nested = folder / "value"
    if (nested / WORKER_STATE_FILE).is_file():
        return nested
    raise WarmStartError(
        f"ppo.warm_start_value_checkpoint: {str(path)!r} is neither a critic checkpoint folder "
        f"(with {WORKER_STATE_FILE}) nor a step_N folder holding one under value/; point it at "
        "<checkpoint_dir>/step_N of the run whose critic you want, or set it to null"
    )


async def warm_start_critic(value_trainer: Any, cfg: MasterConfig, *, resuming: bool) -> bool:
    """Seed the critic's weights from ``ppo.warm_start_value_checkpoint``; True if it did.

    Ignored (False) without the key, and on a resumed run, whose own checkpoint holds the
    critic. Only the weights are read: the critic's optimizer starts fresh.
    """
    source = cfg.ppo.warm_start_value_checkpoint if cfg.ppo is not None else None
    if source is None:
        return False
    if resuming:
        log.info(
            "resuming: ppo.warm_start_value_checkpoint=%s ignored (the critic comes from the "
            "run's own checkpoint)",
            source,
        )
        return False
    folder = resolve_value_checkpoint(source)
    await value_trainer.load_warm_start(folder)
    log.info("critic warm-started from %s", folder)
    return True


def advantage_stage(
    batch: TrainBatch, values: torch.Tensor, *, gamma: float, lam: float, normalize: bool
) -> TrainBatch:
    """Set ``values``, ``advantages`` and ``returns`` on ``batch`` (GAE; see module docstring).

    The sequence reward sits on the last generated token; ``returns`` are computed from the
    raw advantages, whitening (over token_mask x sample_mask) only rescales what the policy
    sees. ``batch`` is the whole step here; a streamed step runs ``gae_stage`` per chunk and
    ``whiten_step`` over all of them.
    """
    gae_stage(batch, values, gamma=gamma, lam=lam)
    if normalize:
        whiten_step([batch])
    return batch


def gae_stage(batch: TrainBatch, values: torch.Tensor, *, gamma: float, lam: float) -> None:
    """``values``, raw ``advantages`` and ``returns`` of one chunk (GAE is per sequence)."""
    token_mask = batch["token_mask"]
    values = values.to(torch.float32) * token_mask.to(torch.float32)
    rewards = sequence_rewards_to_tokens(batch["reward"], token_mask)
    advantages, returns = gae(rewards, values, token_mask, gamma, lam)
    batch["values"] = values
    batch["advantages"] = advantages
    batch["returns"] = returns


def whiten_step(chunks: list[TrainBatch]) -> None:
    """Whiten the advantages of a step's chunks with the whole step's mean and variance."""
    valid = [loss_mask(chunk) for chunk in chunks]
    if sum(float(mask.sum()) for mask in valid) == 0:
        raise AllMaskedStepError(
            "every completion of this PPO step is masked out (token_mask x sample_mask "
            "sums to 0): there are no advantages to whiten and nothing to train on"
        )
    whitened = whiten_together([chunk["advantages"] for chunk in chunks], valid)
    for chunk, advantages in zip(chunks, whitened, strict=True):
        chunk["advantages"] = advantages


# async (value_trainer, resuming) -> whether the critic was seeded
WarmStart = Callable[[Any, bool], Awaitable[bool]]


class PPOStepRunner:
    """Trains one PPO step over the critic and the policy (see the module docstring)."""

    def __init__(
        self,
        trainer: OffloadingTrainer,
        value_trainer: ValueTrainer,
        *,
        settings: PPOSettings,
        pad_token_id: int,
        warm_start: WarmStart | None = None,
    ) -> None:
        """``warm_start``: ``async (value_trainer, resuming) -> bool``; default does nothing."""
        problems = ppo_epoch_problems(
            ppo_epochs=settings.ppo_epochs,
            critic_ppo_epochs=settings.critic_ppo_epochs,
            reuse_training_logprobs=settings.reuse_training_logprobs,
        )
        if problems:
            raise ValueError("; ".join(problems))
        self.trainer = trainer
        self.value_trainer = value_trainer
        self.settings = settings
        self.pad_token_id = pad_token_id
        self._warm_start = warm_start
        self._warm_start_checked = False
        self._version: int | None = None
        self._policy_trains = False
        # The step's chunks so far, each with its values, advantages, returns and logprobs.
        self._chunks: list[TrainBatch] = []
        # The critic's first epoch is open (streamed over the chunks as they come).
        self._critic_open = False
        # The critic's provisional sequence count for the deferred first epoch (any constant
        # shared by all of the step's chunks: see the module docstring).
        self._critic_provisional = 0
        self._value_stage_s = 0.0
        self._critic_s = 0.0
        self._policy_trained = False

    @classmethod
    def from_config(
        cls,
        cfg: MasterConfig,
        trainer: OffloadingTrainer,
        value_trainer: ValueTrainer,
        *,
        pad_token_id: int,
    ) -> PPOStepRunner:
        async def warm_start(critic: Any, resuming: bool) -> bool:
            return await warm_start_critic(critic, cfg, resuming=resuming)

        return cls(
            trainer,
            value_trainer,
            settings=PPOSettings.from_config(cfg),
            pad_token_id=pad_token_id,
            warm_start=warm_start,
        )

    # ------------------------------------------------------------------ StepRunner protocol

    async def begin(self, *, version: int) -> None:
        if not self._warm_start_checked:
            self._warm_start_checked = True
            if self._warm_start is not None:
                await self._warm_start(self.value_trainer, version > 0)
        self._version = version
        self._policy_trains = self.settings.policy_trains_at(version)
        self._chunks = []
        self._critic_open = False
        self._value_stage_s = self._critic_s = 0.0
        self._policy_trained = False

    async def train_chunk(
        self, slots: list[Slot], rows: StepRows, *, step_num_sequences: int
    ) -> None:
        if self._version is None:
            raise RuntimeError("train_chunk called before begin")
        batch = collate_step_rows(slots, rows, pad_token_id=self.pad_token_id)
        started = time.perf_counter()
        if self.settings.offload_optimizer and not self._chunks:
            # Keeps the policy optimizer off the device while the critic runs; the policy's
            # finish_train_step moves it back just before its optimizer step.
            await self.trainer.offload_optimizer()
        if self._policy_trains and not self.settings.reuse_training_logprobs:
            values, prev_logprobs = await asyncio.gather(
                self.value_trainer.get_values(batch), self.trainer.get_logprobs(batch)
            )
            batch["prev_logprobs"] = prev_logprobs
        else:
            values = await self.value_trainer.get_values(batch)
        if self._policy_trains and self.settings.reference_kl:
            batch["reference_logprobs"] = await reference_logprobs(self.trainer, batch)
        gae_stage(batch, values, gamma=self.settings.gamma, lam=self.settings.lam)
        self._value_stage_s += time.perf_counter() - started

        started = time.perf_counter()
        if not self._critic_open:
            await self.value_trainer.begin_train_step()
            self._critic_open = True
            self._critic_provisional = step_num_sequences
        await self.value_trainer.train_microbatches(
            batch, step_num_sequences=self._critic_provisional, step_num_tokens=None
        )
        self._critic_s += time.perf_counter() - started
        self._chunks.append(batch)

    async def finish(self) -> dict[str, float]:
        if self._version is None or not self._chunks:
            raise RuntimeError("finish called without begin and at least one train_chunk")
        self._version = None
        chunks, self._chunks = self._chunks, []
        policy_trains = self._policy_trains
        # The step as it is: the rows it holds, not the configured batch (a drop shortens it).
        step_sequences = sum(int(chunk["input_ids"].shape[0]) for chunk in chunks)
        step_tokens = sum(count_loss_tokens(chunk) for chunk in chunks)
        if step_tokens == 0:
            await self._close_empty_critic_step()
            raise AllMaskedStepError(
                "every completion of this PPO step is masked out (token_mask x sample_mask sums "
                "to 0): there is nothing to train on"
            )
        metrics: dict[str, float] = {
            "policy_trained": float(policy_trains),
            "step_rows": float(step_sequences),
            "num_chunks": float(len(chunks)),
        }
        metrics.update(self._batch_metrics(chunks))
        metrics["value_stage_s"] = self._value_stage_s

        started = time.perf_counter()
        critic = await self.value_trainer.finish_train_step()
        self._critic_open = False
        metrics["critic_value_loss_first_epoch"] = critic.get("value_loss", 0.0)
        for _ in range(self.settings.critic_ppo_epochs - 1):
            critic = await self._epoch(self.value_trainer, chunks, step_sequences, step_tokens)
        metrics.update({f"critic_{key}": value for key, value in critic.items()})
        metrics["critic_s"] = self._critic_s + time.perf_counter() - started

        if policy_trains:
            started = time.perf_counter()
            if self.settings.normalize_advantages:
                whiten_step(chunks)
            policy: dict[str, float] = {}
            for _ in range(self.settings.ppo_epochs):
                policy = await self._epoch(self.trainer, chunks, step_sequences, step_tokens)
            metrics.update(policy)
            metrics["policy_s"] = time.perf_counter() - started
        self._policy_trained = policy_trains
        return metrics

    @staticmethod
    async def _epoch(
        model: Trainer | ValueTrainer, chunks: list[TrainBatch], sequences: int, tokens: int
    ) -> dict[str, float]:
        """One optimizer step of ``model`` over every chunk of the step."""
        await model.begin_train_step()
        for chunk in chunks:
            await model.train_microbatches(
                chunk, step_num_sequences=sequences, step_num_tokens=tokens
            )
        return await model.finish_train_step()

    async def _close_empty_critic_step(self) -> None:
        """The critic's streamed first epoch saw no valid token: its finish refuses the empty
        step (and resets it), as this step is refused."""
        if not self._critic_open:
            return
        self._critic_open = False
        try:
            await self.value_trainer.finish_train_step()
        except AllMaskedStepError:
            return  # expected: the same refusal the caller raises next
        raise RuntimeError("the critic applied an optimizer step to a step without valid tokens")

    def refit_after_step(self) -> bool:
        return self._policy_trained

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _batch_metrics(chunks: list[TrainBatch]) -> dict[str, float]:
        """Means over the step's valid tokens (raw advantages: before whitening)."""
        masks = [loss_mask(chunk) for chunk in chunks]
        count = max(sum(float(mask.sum()) for mask in masks), 1.0)
        return {
            f"{key}_mean": sum(
                float((chunk[key] * mask).sum()) for chunk, mask in zip(chunks, masks, strict=True)
            )
            / count
            for key in ("values", "returns", "advantages")
        }
