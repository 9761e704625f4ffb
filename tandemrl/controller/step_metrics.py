"""Per-step accounting for the pumps: what was trained, how stale, and how long each pump idled.

The pumps report events (``rollout_blocked``, ``train_waiting``, groups trained, evictions);
``close_step`` turns the interval since the previous step into the metrics row the logger
writes (see DESIGN §1 for the required fields).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandemrl.records import RowMeta
from tandemrl.training.advantages import has_zero_advantage


@dataclass
class TrainedGroup:
    group_id: str
    start_weight: int
    end_weight: int | None
    target_step: int | None
    staleness: int
    rewards: list[float]
    completion_tokens: int
    # Per row, the environment's numeric metadata (None where it reported none).
    env_metrics: list[dict[str, float] | None] = field(default_factory=list)


@dataclass
class StepAccumulator:
    started_at: float = field(default_factory=time.monotonic)
    # When the step closed (its trainer version bumped); None: when close_step is called. The
    # next step's interval starts here, so step times add up to the run's wall time.
    ended_at: float | None = None
    rollout_blocked_s: float = 0.0
    train_waiting_s: float = 0.0
    evicted_groups: int = 0
    aborted_groups: int = 0
    dropped_prompts: int = 0
    replaced_prompts: int = 0
    # Dynamic sampling: zero-advantage groups dropped from this step, and whether the step's
    # cap on them was reached (zero-advantage groups were then trained).
    filtered_groups: int = 0
    filter_cap_reached: bool = False
    # Their rewards (for a reward mean unbiased by the filtering).
    filtered_rewards: list[float] = field(default_factory=list)
    # Drain gate: seconds the weight sync waited for in-flight groups, and groups cut off at
    # its deadline and generated again on the new weights.
    drain_s: float = 0.0
    redispatched_groups: int = 0
    groups: list[TrainedGroup] = field(default_factory=list)

    def close_step(
        self,
        *,
        step: int,
        trainer_version: int,
        weight_sync_s: float,
        extra: dict[str, float],
    ) -> dict[str, float]:
        end = time.monotonic() if self.ended_at is None else self.ended_at
        step_time = max(end - self.started_at, 1e-9)
        rewards = [r for g in self.groups for r in g.rewards]
        staleness = [g.staleness for g in self.groups]
        tokens = sum(g.completion_tokens for g in self.groups)
        row = {
            "step": step,
            "trainer_version": trainer_version,
            "reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "staleness_max": max(staleness) if staleness else 0,
            "groups_trained": len(self.groups),
            "tokens_per_s": tokens / step_time,
            "step_time_s": step_time,
            "weight_sync_s": weight_sync_s,
            "train_idle_frac": min(self.train_waiting_s / step_time, 1.0),
            "rollout_idle_frac": min(self.rollout_blocked_s / step_time, 1.0),
            "evicted_groups": self.evicted_groups,
            "aborted_groups": self.aborted_groups,
            "dropped_prompts": self.dropped_prompts,
            "replaced_prompts": self.replaced_prompts,
            # Trained groups whose rewards were all equal: no policy-gradient signal.
            "zero_advantage_groups": sum(has_zero_advantage(g.rewards) for g in self.groups),
            "dynamic_sampling/filtered_groups": self.filtered_groups,
            "dynamic_sampling/cap_reached": float(self.filter_cap_reached),
            # The mean over trained and filtered groups: what reward_mean is without the filter
            # (which leaves out groups whose rewards are all equal, often all 0).
            "dynamic_sampling/reward_mean_with_filtered": (
                (sum(rewards) + sum(self.filtered_rewards))
                / (len(rewards) + len(self.filtered_rewards))
                if rewards or self.filtered_rewards
                else 0.0
            ),
            "drain/drain_s": self.drain_s,
            "drain/redispatched_groups": self.redispatched_groups,
        }
        row.update(env_metric_means(self.groups))
        row.update(extra)
        return row


def episode_rewards(metas: list[RowMeta]) -> list[float]:
    """One reward per sibling of a group whose agent episodes may span several rows."""
    seen: set[int] = set()
    rewards = []
    for meta in metas:
        if meta.sibling_index not in seen:
            seen.add(meta.sibling_index)
            rewards.append(meta.reward)
    return rewards


# Metadata keys written under their own name (the agent runner's per-episode counters, e.g.
# agent/prefix_split_frac), not as env/<key>.
OWN_NAME_PREFIX = "agent/"


def env_metric_means(groups: list[TrainedGroup]) -> dict[str, float]:
    """``env/<key>``: the mean over the step's rows of each numeric metadata value the
    environment reported (rows that did not report a key do not count toward its mean).
    Keys starting with ``agent/`` keep their name: the agent runner reports them once per
    episode, so their mean is over the step's episodes."""
    sums: dict[str, float] = {}
    counts: dict[str, int] = {}
    for group in groups:
        for metrics in group.env_metrics:
            if not metrics:
                continue
            for key, value in metrics.items():
                sums[key] = sums.get(key, 0.0) + value
                counts[key] = counts.get(key, 0) + 1
    return {
        (key if key.startswith(OWN_NAME_PREFIX) else f"env/{key}"): sums[key] / counts[key]
        for key in sorted(sums)
    }
