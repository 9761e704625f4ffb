"""Say so when the sampler throws away much of what generation produces.

A sampler that evicts (``windowed``, or a custom one) removes ready prompt groups that can no
longer be trained; each one was generated and scored for nothing. Some eviction is the price
of over-sampling, but a run that evicts more than it trains is misconfigured, and nothing else
tells the user (the per-step ``evicted_groups`` metric is easy to miss).

``EvictionWatch`` is pure state, driven by the train pump once per eviction pass. It counts
the groups evicted and trained since this process's first pass and warns when

    evicted > EVICTED_SHARE_WARNING * trained      and      evicted >= next_warning_at

``next_warning_at`` starts at one step's worth of groups (nothing is judged on less) and
doubles past the evicted count at every warning, so a run that keeps wasting logs a handful
of warnings, each with the current totals, not one per step. The message names the knobs
that decide how much is generated ahead of the trainer.
"""

from __future__ import annotations

import logging

from tandemrl.samplers.windowed import WindowedSampler

log = logging.getLogger(__name__)

# Evicted groups above this share of trained groups get a warning: at 0.5, a third of the
# generated groups that reached the buffer were thrown away.
EVICTED_SHARE_WARNING = 0.5


def eviction_advice(sampler: object, *, max_inflight_prompts: int, buffer_capacity: int) -> str:
    """What to change, in the config's words, for the sampler the run uses."""
    ahead = (
        f"lower async_rl.max_buffered_rollouts (now {buffer_capacity}) and "
        f"async_rl.max_inflight_prompts (now {max_inflight_prompts}) so that less is generated "
        "ahead of the trainer"
    )
    if isinstance(sampler, WindowedSampler):
        advice = (
            "The windowed sampler evicts ready groups more than "
            f"async_rl.sampler.max_staleness_versions={sampler.max_staleness_versions} versions "
            "older than the trainer: generation runs further ahead than training can use. Raise "
            f"max_staleness_versions so that older groups are still trained, set "
            "async_rl.sampler.over_sampling_ratio to cap dispatch at that many steps' worth "
            f"of groups beyond the window, or {ahead}"
        )
        if sampler.sample_freshest_first:
            advice += (
                "; async_rl.sampler.sample_freshest_first: true trains the newest groups first "
                "and leaves the older ones to age out (false trains the oldest first)"
            )
        return advice + ". A gated sampler (ready_first, weight_fifo) never evicts."
    name = getattr(sampler, "name", type(sampler).__name__)
    return f"The sampler ({name}) evicts groups it can no longer train: {ahead}."


class EvictionWatch:
    """Counts evicted and trained groups; warns as the module docstring says."""

    def __init__(
        self, *, advice: str, groups_per_step: int, share: float = EVICTED_SHARE_WARNING
    ) -> None:
        self.advice = advice
        self.share = share
        self.evicted = 0
        self.warnings: list[str] = []
        self._next_warning_at = max(1, groups_per_step)
        self._trained_at_start: int | None = None

    @classmethod
    def for_sampler(
        cls,
        sampler: object,
        *,
        groups_per_step: int,
        max_inflight_prompts: int,
        buffer_capacity: int,
    ) -> EvictionWatch:
        advice = eviction_advice(
            sampler, max_inflight_prompts=max_inflight_prompts, buffer_capacity=buffer_capacity
        )
        return cls(advice=advice, groups_per_step=groups_per_step)

    def observe(self, *, evicted: int, trained_groups: int) -> str | None:
        """One eviction pass removed ``evicted`` groups; ``trained_groups`` is the run's count
        of trained groups (a resumed run's includes earlier attempts: only the growth since
        this watch's first pass is compared). Returns the warning when one is logged."""
        if self._trained_at_start is None:
            self._trained_at_start = trained_groups
        self.evicted += evicted
        trained = trained_groups - self._trained_at_start
        if self.evicted < self._next_warning_at or self.evicted <= self.share * trained:
            return None
        message = (
            f"{self.evicted} prompt groups evicted against {trained} trained so far "
            f"({self.evicted / max(trained, 1):.0%} of trained): their generation was wasted. "
            f"{self.advice}"
        )
        log.warning("%s", message)
        self.warnings.append(message)
        self._next_warning_at = 2 * self.evicted
        return message
