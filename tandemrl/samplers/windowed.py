"""windowed: over-sampled streaming with a staleness window and eviction.

Gate: none; rollout keeps producing until the buffer fills (the pump enforces capacity). With
``over_sampling_ratio`` = r, dispatch is capped at ``ceil(r x N)`` groups beyond what the window
can still train. A group dispatched now (start_weight = trainer version v) can be trained by
the steps v .. v + L (L = ``max_staleness_versions``), which train (L + 1) x N groups, those
of step v already claimed included, so

    in_window < (L + 1) x N + ceil(r x N)           N = groups per step

where ``in_window`` counts the buffer's groups (in flight, ready or claimed by the step being
assembled) with start_weight >= v - L. Groups already older than the window are not counted:
they are being evicted or aborted anyway. Without the cap, over-produced groups are generated
only to age out of the window and be evicted. Select:
any ready group with ``start_weight`` in ``[train - max_staleness_versions, train]``, oldest
dispatch first, or newest ``start_weight`` first with ``sample_freshest_first`` (ties in
dispatch order). Evict: ready groups older than the window are removed (wasted compute), and
an in-flight group older than the window should be aborted, since it can never be trained.
"""

from __future__ import annotations

import math

from tandemrl.buffer import ReplayBuffer, Slot
from tandemrl.samplers.base import PromptGroupSampler, SamplerError, Selection


class WindowedSampler(PromptGroupSampler):
    name = "windowed"
    supports_buffer_checkpoint = True
    supports_training_claims = True

    def __init__(
        self,
        buffer: ReplayBuffer,
        *,
        groups_per_step: int,
        max_staleness_versions: int = 1,
        sample_freshest_first: bool = False,
        over_sampling_ratio: float | None = None,
    ) -> None:
        super().__init__(buffer, groups_per_step=groups_per_step)
        if over_sampling_ratio is not None and over_sampling_ratio < 0:
            raise SamplerError(f"over_sampling_ratio must be >= 0, got {over_sampling_ratio}")
        self.max_staleness_versions = max_staleness_versions
        self.sample_freshest_first = sample_freshest_first
        self.over_sampling_ratio = over_sampling_ratio

    def oldest_trainable_weight(self, current_train_weight: int) -> int:
        return current_train_weight - self.max_staleness_versions

    def dispatch_limit(self) -> int | None:
        """The most in-window groups the cap allows (module docstring); None: no cap."""
        if self.over_sampling_ratio is None:
            return None
        n = self.groups_per_step
        return (self.max_staleness_versions + 1) * n + math.ceil(self.over_sampling_ratio * n)

    def gate_open(self, trainer_version: int) -> bool:
        limit = self.dispatch_limit()
        if limit is None:
            return True
        oldest = self.oldest_trainable_weight(trainer_version)
        buffer = self.buffer
        in_window = sum(
            1
            for slots in (buffer.live_groups(), buffer.claimed_groups())
            for slot in slots
            if slot.start_weight >= oldest
        )
        return in_window < limit

    async def select(
        self, *, current_train_weight: int, min_prompt_groups: int, max_prompt_groups: int
    ) -> Selection:
        oldest = self.oldest_trainable_weight(current_train_weight)
        eligible = [
            slot
            for slot in self.buffer.ready_groups()
            if oldest <= slot.start_weight <= current_train_weight
        ]
        if self.sample_freshest_first:
            eligible.sort(key=lambda slot: (-slot.start_weight, slot.dispatch_index))
        return self._claim(eligible, min_prompt_groups, max_prompt_groups)

    async def evict(self, *, current_train_weight: int) -> list[Slot]:
        oldest = self.oldest_trainable_weight(current_train_weight)
        aged = [slot for slot in self.buffer.ready_groups() if slot.start_weight < oldest]
        return [self.buffer.remove(slot.group_id) for slot in aged]

    def should_abort_inflight(self, *, start_weight: int, current_train_weight: int) -> bool:
        return start_weight < self.oldest_trainable_weight(current_train_weight)

    def required_buffer_capacity(self, groups_per_step: int) -> int:
        """One full step: dispatch is not gated, anything above is over-sampling headroom."""
        return groups_per_step

    def off_policy_reason(self) -> str | None:
        if self.max_staleness_versions > 0:
            return "async_rl.sampler.max_staleness_versions"
        return None
