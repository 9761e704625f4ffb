"""How one on-policy distillation step trains (the ``on_policy_distillation`` block).

Per chunk of selected groups, the same order as GRPO's runner with the teacher in it:

    collate the rows → the student's logprobs (trainer.get_logprobs) and, for rows that carry
    no teacher logprobs (teacher_scoring: train, or rows restored from such a run), the
    teachers' scoring at the same time → advantages A_t = -kl_coef * clamp(s_t - q_t)
    (+ reward_coef * GRPO advantage; ``tandemrl.training.distillation``) → gradient
    accumulation through the clipped policy loss

and ``finish`` applies exactly one optimizer step. The importance-sampling correction of the
policy loss handles samples from older weights under every sampler, as in GRPO. The step's
metrics add ``reverse_kl`` (mean over valid tokens of s_t - q_t, an estimate of KL(student ||
teacher) per token), one ``reverse_kl/<teacher>`` per teacher, and
``teacher_groups_scored_in_train_pump`` (0 with ``teacher_scoring: rollout`` unless a restart
brought rows without teacher logprobs).
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import torch

from tandemrl.buffer import Slot
from tandemrl.controller.step_runner import StepRows, collate_step_rows
from tandemrl.dataplane.rows import TEACHER_INDEX, TEACHER_LOGPROBS
from tandemrl.records import TeacherRequest
from tandemrl.rollout.teachers import TeacherScorer
from tandemrl.training.advantages import broadcast_sequence_values, grpo_advantages_grouped
from tandemrl.training.api import TrainBatch, Trainer
from tandemrl.training.batch import loss_mask
from tandemrl.training.distillation import distillation_advantages, reverse_kl_sums


class DistillationStepRunner:
    def __init__(
        self,
        trainer: Trainer,
        teachers: TeacherScorer,
        *,
        group_size: int,
        kl_coef: float,
        reward_coef: float,
        log_ratio_clamp: float | None,
        leave_one_out_baseline: bool,
        normalize_rewards: bool,
        pad_token_id: int,
    ) -> None:
        self.trainer = trainer
        self.teachers = teachers
        self.group_size = group_size
        self.kl_coef = kl_coef
        self.reward_coef = reward_coef
        self.log_ratio_clamp = log_ratio_clamp
        self.leave_one_out_baseline = leave_one_out_baseline
        self.normalize_rewards = normalize_rewards
        self.pad_token_id = pad_token_id
        self._gap: dict[str, float] = defaultdict(float)
        self._tokens: dict[str, float] = defaultdict(float)
        self._scored_here = 0

    async def begin(self, *, version: int) -> None:
        self._gap.clear()
        self._tokens.clear()
        self._scored_here = 0
        await self.trainer.begin_train_step()

    async def train_chunk(
        self, slots: list[Slot], rows: StepRows, *, step_num_sequences: int
    ) -> None:
        # Rows of one chunk either all carry teacher logprobs or none do, except after a
        # restart mixed the two placements: each kind is collated and trained on its own
        # (gradients accumulate, so the step is the same).
        scored = [slot for slot in slots if TEACHER_LOGPROBS in rows[slot.sample_ids[0]]]
        unscored = [slot for slot in slots if TEACHER_LOGPROBS not in rows[slot.sample_ids[0]]]
        for part in (scored, unscored):
            if part:
                batch = await self.advantage_stage(part, rows)
                # Deferred normalisation, as GRPO's (``step_runner``): exact over the rows
                # the step trains, also when a drop shrank it after its first chunk.
                await self.trainer.train_microbatches(
                    batch, step_num_sequences=step_num_sequences, step_num_tokens=None
                )

    async def advantage_stage(self, slots: list[Slot], rows: StepRows) -> TrainBatch:
        """The chunk's batch with ``prev_logprobs``, ``teacher_logprobs`` and ``advantages``."""
        batch = collate_step_rows(slots, rows, pad_token_id=self.pad_token_id)
        if TEACHER_LOGPROBS in batch:
            batch["prev_logprobs"] = await self.trainer.get_logprobs(batch)
        else:
            teacher, prev = await asyncio.gather(
                self._score_in_train_pump(slots, batch), self.trainer.get_logprobs(batch)
            )
            batch[TEACHER_LOGPROBS], batch["prev_logprobs"] = teacher, prev
        mask = batch["token_mask"]
        reward_advantages = None
        if self.reward_coef > 0:
            per_row = grpo_advantages_grouped(
                batch["reward"].reshape(len(slots), self.group_size),
                leave_one_out=self.leave_one_out_baseline,
                normalize=self.normalize_rewards,
            ).reshape(-1)
            reward_advantages = broadcast_sequence_values(per_row, mask)
        batch["advantages"] = distillation_advantages(
            batch["prev_logprobs"],
            batch[TEACHER_LOGPROBS],
            mask,
            kl_coef=self.kl_coef,
            log_ratio_clamp=self.log_ratio_clamp,
            reward_advantages=reward_advantages,
            reward_coef=self.reward_coef,
        )
        self._add_metrics(batch)
        return batch

    async def _score_in_train_pump(self, slots: list[Slot], batch: TrainBatch) -> torch.Tensor:
        """[B, L] teacher logprobs of the chunk's completions, placed like the rows' tokens."""
        input_ids = batch["input_ids"]
        teacher_index = batch[TEACHER_INDEX].long().tolist()
        groups = []
        for group_index, slot in enumerate(slots):
            requests = []
            for meta in slot.rows_meta:
                row = input_ids[group_index * self.group_size + meta.sibling_index]
                start, end = (
                    meta.num_prompt_tokens,
                    meta.num_prompt_tokens + meta.num_completion_tokens,
                )
                requests.append(
                    TeacherRequest(meta.sample_id, row[:start].tolist(), row[start:end].tolist())
                )
            groups.append((teacher_index[group_index * self.group_size], requests))
        answers = await self.teachers.score_groups(groups)
        self._scored_here += len(slots)
        teacher = torch.zeros(input_ids.shape, dtype=torch.float32)
        for group_index, (slot, scored) in enumerate(zip(slots, answers, strict=True)):
            for meta, values in zip(slot.rows_meta, scored, strict=True):
                row_index = group_index * self.group_size + meta.sibling_index
                start = meta.num_prompt_tokens
                teacher[row_index, start : start + len(values)] = torch.tensor(values)
        return teacher

    def _add_metrics(self, batch: TrainBatch) -> None:
        gaps, tokens = reverse_kl_sums(
            batch["prev_logprobs"], batch[TEACHER_LOGPROBS], loss_mask(batch)
        )
        names = [self.teachers.pools[index].name for index in batch[TEACHER_INDEX].long().tolist()]
        for name, gap, count in zip(names, gaps.tolist(), tokens.tolist(), strict=True):
            self._gap[name] += gap
            self._tokens[name] += count

    async def finish(self) -> dict[str, float]:
        metrics = await self.trainer.finish_train_step()
        tokens = sum(self._tokens.values())
        if tokens > 0:
            metrics["reverse_kl"] = sum(self._gap.values()) / tokens
        for name, count in self._tokens.items():
            if count > 0:
                metrics[f"reverse_kl/{name}"] = self._gap[name] / count
        metrics["teacher_groups_scored_in_train_pump"] = float(self._scored_here)
        return metrics

    def refit_after_step(self) -> bool:
        return True
