"""in_order: exact batch-to-step matching (sync mode and legacy-async semantics).

Gate: dispatch may lead the trainer by up to ``max_lookahead_versions`` batches. The i-th
admitted prompt (its dispatch index, 0, 1, 2 …) is stamped ``target_step = i // N``: the train
step (trainer version) whose batch it belongs to. It is admitted while
``target_step <= trainer_version + lookahead``. Select: the ready groups whose
``target_step == current_train_weight``, in dispatch order.

``max_lookahead_versions: 0`` is sync mode: step s's prompts are dispatched only once the
trainer reached version s. During PPO critic warm-up — trainer versions below
``ppo.policy_training_start_step`` — the lookahead is ``warmup_lookahead_versions`` when it
is set; from that version on it is ``max_lookahead_versions`` again. The rule is a function
of the trainer version alone (``lookahead_at``), so a resumed run applies it unchanged; the
buffer is sized for the wider of the two.
"""

from __future__ import annotations

from tandemrl.buffer import ReplayBuffer
from tandemrl.samplers.base import GatedSampler, SamplerError, Selection


class InOrderSampler(GatedSampler):
    name = "in_order"

    def __init__(
        self,
        buffer: ReplayBuffer,
        *,
        groups_per_step: int,
        max_lookahead_versions: int = 0,
        warmup_lookahead_versions: int | None = None,
        policy_training_start_step: int = 0,
    ) -> None:
        super().__init__(buffer, groups_per_step=groups_per_step)
        if max_lookahead_versions < 0 or (warmup_lookahead_versions or 0) < 0:
            raise SamplerError(
                f"lookahead versions must be >= 0, got {max_lookahead_versions} and "
                f"{warmup_lookahead_versions}"
            )
        self.max_lookahead_versions = max_lookahead_versions
        self.warmup_lookahead_versions = warmup_lookahead_versions
        # Trainer versions below this are PPO critic warm-up (0: no warm-up).
        self.policy_training_start_step = policy_training_start_step

    @property
    def widest_lookahead_versions(self) -> int:
        return max(self.max_lookahead_versions, self.warmup_lookahead_versions or 0)

    def lookahead_at(self, trainer_version: int) -> int:
        """``warmup_lookahead_versions`` during critic warm-up when set, else the steady one."""
        warmup = self.warmup_lookahead_versions
        if warmup is not None and trainer_version < self.policy_training_start_step:
            return warmup
        return self.max_lookahead_versions

    def off_policy_reason(self) -> str | None:
        if self.widest_lookahead_versions > 0:
            return "async_rl.sampler.max_lookahead_versions"
        return None

    def _record_admission(self) -> int:
        dispatch_index = self.num_admitted
        self.num_admitted += 1
        return self.target_step_of(dispatch_index)

    def target_step_of(self, dispatch_index: int) -> int:
        """The train step the ``dispatch_index``-th admitted prompt belongs to."""
        return dispatch_index // self.groups_per_step

    def admit_replacement(self, target_step: int | None = None) -> int:
        if target_step is None:
            raise SamplerError(
                "in_order sampler: a replacement needs the dropped group's target_step"
            )
        super().admit_replacement(target_step)
        return target_step

    def readmit(self, target_step: int | None = None) -> int:
        last_step = self.target_step_of(self.num_admitted - 1) if self.num_admitted else -1
        if target_step is None or not 0 <= target_step <= last_step:
            raise SamplerError(
                f"in_order sampler: cannot readmit target_step {target_step!r}; the restored "
                f"dispatch state admitted steps 0..{last_step}"
            )
        return target_step

    def pending_for_step(self, step: int) -> int:
        """Groups of ``step`` still in flight (reserved, not yet committed)."""
        return sum(1 for slot in self.buffer.reserved_groups() if slot.target_step == step)

    async def select(
        self, *, current_train_weight: int, min_prompt_groups: int, max_prompt_groups: int
    ) -> Selection:
        eligible = [
            slot for slot in self.buffer.ready_groups() if slot.target_step == current_train_weight
        ]
        return self._claim(eligible, min_prompt_groups, max_prompt_groups)
