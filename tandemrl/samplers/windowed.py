"""windowed: over-sampled streaming with a staleness window and eviction.

Gate: none; rollout keeps producing until the buffer fills (the pump enforces capacity). Select:
any ready group with ``start_weight`` in ``[train - max_staleness_versions, train]``, oldest
dispatch first, or newest ``start_weight`` first with ``sample_freshest_first`` (ties in
dispatch order). Evict: ready groups older than the window are removed (wasted compute), and
an in-flight group older than the window should be aborted, since it can never be trained.
"""

from __future__ import annotations

from tandemrl.buffer import ReplayBuffer, Slot
from tandemrl.samplers.base import PromptGroupSampler, Selection


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
    ) -> None:
        super().__init__(buffer, groups_per_step=groups_per_step)
        self.max_staleness_versions = max_staleness_versions
        self.sample_freshest_first = sample_freshest_first

    def oldest_trainable_weight(self, current_train_weight: int) -> int:
        return current_train_weight - self.max_staleness_versions

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
