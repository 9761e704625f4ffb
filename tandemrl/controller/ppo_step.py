"""How one PPO step trains: critic forward, GAE, critic epochs, policy epochs.

``PPOStepRunner`` implements the ``StepRunner`` protocol (``tandemrl.controller.step_runner``).
The pump calls ``begin(version)`` → ``train_chunk`` per selected chunk → ``finish()``; on PPO
validation makes ``min_groups_for_streaming_train == num_prompts_per_step``, so the step comes
as one chunk. ``train_chunk`` only collects the chunk's rows; ``finish`` trains the whole step
(reference spec, "Implementation Structure"):

    offload the policy optimizer          policy.offload_optimizer_for_logprob
    value stage       critic.get_values(batch)               ─┐ concurrently: two workers
    prev_logprobs     policy.get_logprobs(batch)  (policy)   ─┘ computed once, all epochs
                      (skipped with loss_fn.reuse_training_logprobs, which validation
                      allows only with ppo_epochs 1: the training forward supplies them)
    advantage stage   GAE per token, reward on the last generated token;
                      returns = advantages + values; whiten advantages over valid tokens
    critic epochs     ppo.critic_ppo_epochs x (begin → train_microbatches → finish)
    policy epochs     ppo.ppo_epochs x (begin → train_microbatches → finish)   (policy)

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
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from tandemrl.buffer import Slot
from tandemrl.config.models import MasterConfig
from tandemrl.config.validate import ppo_epoch_problems
from tandemrl.controller.step_runner import StepRows, collate_step_rows, reference_logprobs
from tandemrl.training.advantages import gae, sequence_rewards_to_tokens, whiten
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
    sees.
    """
    token_mask = batch["token_mask"]
    values = values.to(torch.float32) * token_mask.to(torch.float32)
    rewards = sequence_rewards_to_tokens(batch["reward"], token_mask)
    advantages, returns = gae(rewards, values, token_mask, gamma, lam)
    if normalize:
        valid = loss_mask(batch)
        if valid.sum().item() == 0:
            raise AllMaskedStepError(
                "every completion of this PPO step is masked out (token_mask x sample_mask "
                "sums to 0): there are no advantages to whiten and nothing to train on"
            )
        advantages = whiten(advantages, valid)
    batch["values"] = values
    batch["advantages"] = advantages
    batch["returns"] = returns
    return batch


# async (value_trainer, resuming) -> whether the critic was seeded
WarmStart = Callable[[Any, bool], Awaitable[bool]]


def _mean_over(x: torch.Tensor, mask: torch.Tensor) -> float:
    count = mask.sum().clamp(min=1.0)
    return float(((x * mask).sum() / count).item())


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
        self._slots: list[Slot] = []
        self._rows: dict[str, Mapping[str, torch.Tensor]] = {}
        self._step_num_sequences = 0
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
        self._slots = []
        self._rows = {}
        self._step_num_sequences = 0
        self._policy_trained = False

    async def train_chunk(
        self, slots: list[Slot], rows: StepRows, *, step_num_sequences: int
    ) -> None:
        if self._version is None:
            raise RuntimeError("train_chunk called before begin")
        # The critic and the policy epochs need the whole step: collect, train in finish.
        self._slots.extend(slots)
        self._rows.update(rows)
        self._step_num_sequences = step_num_sequences

    async def finish(self) -> dict[str, float]:
        if self._version is None or not self._slots:
            raise RuntimeError("finish called without begin and at least one train_chunk")
        version = self._version
        self._version = None
        policy_trains = self.settings.policy_trains_at(version)
        batch = collate_step_rows(self._slots, self._rows, pad_token_id=self.pad_token_id)
        self._slots, self._rows = [], {}
        step_sequences = self._step_num_sequences
        step_tokens = count_loss_tokens(batch)
        if step_tokens == 0:
            raise AllMaskedStepError(
                "every completion of this PPO step is masked out (token_mask x sample_mask sums "
                "to 0): there is nothing to train on"
            )
        metrics: dict[str, float] = {"policy_trained": float(policy_trains)}

        started = time.perf_counter()
        if self.settings.offload_optimizer:
            # Keeps the policy optimizer off the device while the critic runs; the policy's
            # finish_train_step moves it back just before its optimizer step.
            await self.trainer.offload_optimizer()
        if policy_trains and self.settings.reuse_training_logprobs:
            values = await self.value_trainer.get_values(batch)
        elif policy_trains:
            values, prev_logprobs = await asyncio.gather(
                self.value_trainer.get_values(batch), self.trainer.get_logprobs(batch)
            )
            batch["prev_logprobs"] = prev_logprobs
        else:
            values = await self.value_trainer.get_values(batch)
        if policy_trains and self.settings.reference_kl:
            batch["reference_logprobs"] = await reference_logprobs(self.trainer, batch)
        advantage_stage(
            batch,
            values,
            gamma=self.settings.gamma,
            lam=self.settings.lam,
            normalize=self.settings.normalize_advantages,
        )
        metrics.update(self._batch_metrics(batch))
        metrics["value_stage_s"] = time.perf_counter() - started

        started = time.perf_counter()
        critic: dict[str, float] = {}
        for epoch in range(self.settings.critic_ppo_epochs):
            await self.value_trainer.begin_train_step()
            await self.value_trainer.train_microbatches(
                batch, step_num_sequences=step_sequences, step_num_tokens=step_tokens
            )
            critic = await self.value_trainer.finish_train_step()
            if epoch == 0:
                metrics["critic_value_loss_first_epoch"] = critic.get("value_loss", 0.0)
        metrics.update({f"critic_{key}": value for key, value in critic.items()})
        metrics["critic_s"] = time.perf_counter() - started

        if policy_trains:
            started = time.perf_counter()
            policy: dict[str, float] = {}
            for _ in range(self.settings.ppo_epochs):
                await self.trainer.begin_train_step()
                await self.trainer.train_microbatches(
                    batch, step_num_sequences=step_sequences, step_num_tokens=step_tokens
                )
                policy = await self.trainer.finish_train_step()
            metrics.update(policy)
            metrics["policy_s"] = time.perf_counter() - started
        self._policy_trained = policy_trains
        return metrics

    def refit_after_step(self) -> bool:
        return self._policy_trained

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _batch_metrics(batch: TrainBatch) -> dict[str, float]:
        valid = loss_mask(batch)
        return {
            "values_mean": _mean_over(batch["values"], valid),
            "returns_mean": _mean_over(batch["returns"], valid),
            "advantages_mean": _mean_over(batch["advantages"], valid),
        }
