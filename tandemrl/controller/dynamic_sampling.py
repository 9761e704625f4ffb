"""DAPO dynamic sampling: the train pump drops zero-advantage groups and keeps filling the step.

With ``grpo.use_dynamic_sampling``, each chunk the sampler selects is split before it is
trained (``DynamicSampling.split``): a group whose rewards are all equal gets advantage 0 for
every member (``training.advantages.has_zero_advantage``) and carries no policy-gradient
signal, so it is dropped — its claim consumed, its rows cleared — and the step waits for other
groups instead. Under a gated sampler each dropped group is owed a replacement
(``sampler.on_group_filtered``): the rollout pump's next ``admit`` hands it out before it asks
the gate, so one fresh prompt takes the dropped group's place (for ``in_order``: the same
``target_step``) and the step can fill. ``windowed`` is not gated and owes nothing.

The cap: a step drops at most ``(dynamic_sampling_max_gen_batches - 1) x num_prompts_per_step``
groups, i.e. it draws at most ``dynamic_sampling_max_gen_batches`` steps' worth of groups in
all. Past the cap, zero-advantage groups are trained as they come (NeMo-RL raises at its
cap instead; here a run that generates mostly equal rewards slows down but goes on) and the
step's ``dynamic_sampling/cap_reached`` metric is 1. ``dynamic_sampling/filtered_groups``
counts the drops, ``zero_advantage_groups`` the zero-advantage groups trained.

Pure state: the pump owns the buffer, the data plane and the events; it asks this object which
groups to drop and tells it when a step begins.
"""

from __future__ import annotations

from tandemrl.buffer import Slot
from tandemrl.training.advantages import has_zero_advantage


class DynamicSampling:
    def __init__(self, *, num_prompts_per_step: int, max_gen_batches: int) -> None:
        if max_gen_batches < 1:
            raise ValueError(f"max_gen_batches must be >= 1, got {max_gen_batches}")
        # The most zero-advantage groups one step may drop.
        self.max_filtered_per_step = (max_gen_batches - 1) * num_prompts_per_step
        self.filtered_this_step = 0
        self.cap_reached = False

    def begin_step(self) -> None:
        self.filtered_this_step = 0
        self.cap_reached = False

    def split(self, slots: list[Slot]) -> tuple[list[Slot], list[Slot]]:
        """(groups to train, zero-advantage groups to drop), in selection order."""
        keep: list[Slot] = []
        drop: list[Slot] = []
        for slot in slots:
            if not has_zero_advantage([meta.reward for meta in slot.rows_meta]):
                keep.append(slot)
            elif self.filtered_this_step < self.max_filtered_per_step:
                drop.append(slot)
                self.filtered_this_step += 1
            else:
                self.cap_reached = True
                keep.append(slot)
        return keep, drop
