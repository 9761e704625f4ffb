"""How one RL step trains, once the train pump has selected its groups.

The train pump owns *which* groups a step trains (evict, select, claim, close, version bump,
weight sync); a ``StepRunner`` owns *how* they are trained. The pump calls

    begin() → train_chunk(slots, rows, ...) once per selected chunk → finish()

and after ``finish`` asks ``refit_after_step()`` whether the policy changed (PPO critic
warm-up trains only the critic, so there is nothing to sync).

``step_num_sequences`` is the step's size as the pump planned it when the step's first chunk
trained, the same for every chunk of the step. A prompt dropped after that (drop budgets,
``on_dropped_prompt: shrink``) leaves the step fewer rows: a runner normalises the loss by the
rows the step actually trains, with one optimizer step per RL step whatever the chunking.

``GRPOStepRunner``: per chunk, group advantages (leave-one-out baseline, std normalisation),
the trainer's own logprobs as ``prev_logprobs``, then gradient accumulation; ``finish`` applies
exactly one optimizer step. Chunks are trained as they come, before the step's size is known,
so they defer the normalisation to the trainer (``step_num_tokens=None``): its
``finish_train_step`` rescales the accumulated gradient by the valid tokens (token mean) or
the rows (sequence mean) its chunks held. With ``loss_fn.reuse_training_logprobs`` the chunk
goes to the trainer without ``prev_logprobs`` and the training forward supplies them (one
forward pass per step fewer; exact because the weights change only in ``finish``). With a KL
penalty (``loss_fn.reference_policy_kl_penalty > 0``) each chunk also gets the frozen
reference policy's logprobs (``reference_logprobs``, from the trainer's
``get_reference_logprobs``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch

from tandemrl.buffer import Slot
from tandemrl.training.advantages import broadcast_sequence_values, grpo_advantages_grouped
from tandemrl.training.api import ReferencePolicy, TrainBatch, Trainer
from tandemrl.training.batch import collate_rows

# A step's rows, by sample id (as the data plane hands them out).
StepRows = Mapping[str, Mapping[str, torch.Tensor]]


class StepRunner(Protocol):
    async def begin(self, *, version: int) -> None: ...

    async def train_chunk(
        self, slots: list[Slot], rows: StepRows, *, step_num_sequences: int
    ) -> None: ...

    async def finish(self) -> dict[str, float]: ...

    def refit_after_step(self) -> bool: ...


def collate_step_rows(slots: list[Slot], rows: StepRows, *, pad_token_id: int) -> TrainBatch:
    """Collate the groups' rows in slot order and stamp each row's version fields."""
    batch = collate_rows([rows[sid] for slot in slots for sid in slot.sample_ids], pad_token_id)
    rows_per_slot = torch.tensor([len(slot.sample_ids) for slot in slots])
    batch["start_weight"] = torch.tensor([slot.start_weight for slot in slots]).repeat_interleave(
        rows_per_slot
    )
    batch["target_step"] = torch.tensor(
        [-1 if slot.target_step is None else slot.target_step for slot in slots]
    ).repeat_interleave(rows_per_slot)
    return batch


def sibling_rows(slots: list[Slot], group_size: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For groups with more rows than siblings (agent episodes split into several rows): the
    [K, G] rewards, one per sibling (its rows share the episode's reward), and each row's flat
    index ``k * G + sibling`` into them. None when every group has one row per sibling."""
    if all(len(slot.rows_meta) == group_size for slot in slots):
        return None
    rewards = torch.zeros(len(slots), group_size)
    row_index: list[int] = []
    for k, slot in enumerate(slots):
        for meta in slot.rows_meta:
            rewards[k, meta.sibling_index] = meta.reward
            row_index.append(k * group_size + meta.sibling_index)
    return rewards, torch.tensor(row_index)


async def reference_logprobs(trainer: Trainer, batch: TrainBatch) -> torch.Tensor:
    """The reference policy's logprobs of ``batch`` from a trainer that keeps one."""
    if not isinstance(trainer, ReferencePolicy):
        raise TypeError(
            f"loss_fn.reference_policy_kl_penalty > 0 needs a trainer with "
            f"get_reference_logprobs; {type(trainer).__name__} has none"
        )
    return await trainer.get_reference_logprobs(batch)


class GRPOStepRunner:
    def __init__(
        self,
        trainer: Trainer,
        *,
        group_size: int,
        leave_one_out_baseline: bool,
        normalize_rewards: bool,
        pad_token_id: int,
        reuse_training_logprobs: bool = False,
        reference_kl: bool = False,
    ) -> None:
        self.trainer = trainer
        self.reuse_training_logprobs = reuse_training_logprobs
        self.reference_kl = reference_kl
        self.group_size = group_size
        self.leave_one_out_baseline = leave_one_out_baseline
        self.normalize_rewards = normalize_rewards
        self.pad_token_id = pad_token_id

    async def begin(self, *, version: int) -> None:
        await self.trainer.begin_train_step()

    def advantage_stage(self, slots: list[Slot], rows: StepRows) -> TrainBatch:
        batch = collate_step_rows(slots, rows, pad_token_id=self.pad_token_id)
        # One advantage per sibling (episode), from the group's G rewards; a sibling's rows
        # all get its advantage.
        split = sibling_rows(slots, self.group_size)
        per_sibling = batch["reward"] if split is None else split[0].reshape(-1)
        advantages = grpo_advantages_grouped(
            per_sibling.reshape(len(slots), self.group_size),
            leave_one_out=self.leave_one_out_baseline,
            normalize=self.normalize_rewards,
        ).reshape(-1)
        if split is not None:
            advantages = advantages.index_select(0, split[1])
        batch["advantages"] = broadcast_sequence_values(advantages, batch["token_mask"])
        return batch

    async def train_chunk(
        self, slots: list[Slot], rows: StepRows, *, step_num_sequences: int
    ) -> None:
        batch = self.advantage_stage(slots, rows)
        if not self.reuse_training_logprobs:
            batch["prev_logprobs"] = await self.trainer.get_logprobs(batch)
        if self.reference_kl:
            batch["reference_logprobs"] = await reference_logprobs(self.trainer, batch)
        # step_num_tokens=None: normalised in finish_train_step by what the chunks held.
        await self.trainer.train_microbatches(
            batch, step_num_sequences=step_num_sequences, step_num_tokens=None
        )

    async def finish(self) -> dict[str, float]:
        return await self.trainer.finish_train_step()

    def refit_after_step(self) -> bool:
        return True
