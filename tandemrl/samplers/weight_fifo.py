"""weight_fifo: strict weight-version FIFO under a bounded lookahead.

Gate: the in_order gate with ``L = max_staleness_versions`` (see ``base``). Select: drain the
oldest in-window ``start_weight`` first, waiting for that weight's batch to fill. Concretely,
over the live groups whose start_weight lies in the window ``[train - L, train]``, weight by
weight from the oldest: take that weight's ready groups (dispatch order); if the weight still
has groups in flight, stop there (wait for them rather than skip ahead to a newer weight);
otherwise move on to the next weight. The first ``max_prompt_groups`` taken are claimed.
"""

from __future__ import annotations

from tandemrl.buffer import Slot
from tandemrl.samplers.base import Selection, StalenessGatedSampler


class WeightFifoSampler(StalenessGatedSampler):
    name = "weight_fifo"

    def eligible_groups(self, current_train_weight: int) -> list[Slot]:
        """Ready groups in FIFO-by-weight order, up to the oldest weight still in flight."""
        oldest_allowed = current_train_weight - self.max_staleness_versions
        by_weight: dict[int, list[Slot]] = {}
        for slot in self.buffer.live_groups():
            if oldest_allowed <= slot.start_weight <= current_train_weight:
                by_weight.setdefault(slot.start_weight, []).append(slot)
        eligible: list[Slot] = []
        for weight in sorted(by_weight):
            groups = by_weight[weight]
            eligible.extend(slot for slot in groups if slot.ready)
            if any(not slot.ready for slot in groups):
                break  # this weight's batch is still filling
        return eligible

    async def select(
        self, *, current_train_weight: int, min_prompt_groups: int, max_prompt_groups: int
    ) -> Selection:
        eligible = self.eligible_groups(current_train_weight)
        return self._claim(eligible, min_prompt_groups, max_prompt_groups)
