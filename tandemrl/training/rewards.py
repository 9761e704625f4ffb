"""The reward a completion trains on: the environment's reward, scaled, then shaped.

``RewardTransform`` applies, in this order (``grpo.*`` / ``ppo.*`` keys, NeMo-RL's names):

1. ``reward_scaling`` (``enabled``): the reward is clamped to [source_min, source_max] and
   mapped linearly onto [target_min, target_max];
2. ``reward_shaping`` (``enabled``), one of
   - DAPO's overlong penalty: with ``expected = max_response_length - overlong_buffer_length``,
     a completion of ``n`` tokens gets ``min(0, -(n - expected) / overlong_buffer_length x
     overlong_buffer_penalty)`` added (0 up to ``expected`` tokens, growing linearly to
     ``-overlong_buffer_penalty`` at ``max_response_length``);
   - the stop-properly penalty: a truncated completion's reward is multiplied by
     ``stop_properly_penalty_coef``.

The rollout manager calls it once per completion, before the reward is stored with the rows;
advantages, dynamic sampling and the metrics see the transformed reward (the environment's own
value is kept as ``env/reward_before_shaping``).
"""

from __future__ import annotations

from tandemrl.config.models import RewardScalingConfig, RewardShapingConfig


class RewardTransform:
    def __init__(
        self,
        *,
        scaling: RewardScalingConfig | None = None,
        shaping: RewardShapingConfig | None = None,
    ) -> None:
        self.scaling = scaling if scaling is not None and scaling.enabled else None
        self.shaping = shaping if shaping is not None and shaping.enabled else None

    @property
    def active(self) -> bool:
        return self.scaling is not None or self.shaping is not None

    def __call__(self, reward: float, *, completion_tokens: int, truncated: bool) -> float:
        if self.scaling is not None:
            reward = scale_reward(reward, self.scaling)
        if self.shaping is not None:
            reward = shape_reward(
                reward, self.shaping, completion_tokens=completion_tokens, truncated=truncated
            )
        return reward


def scale_reward(reward: float, cfg: RewardScalingConfig) -> float:
    clamped = min(max(reward, cfg.source_min), cfg.source_max)
    fraction = (clamped - cfg.source_min) / (cfg.source_max - cfg.source_min)
    return cfg.target_min + fraction * (cfg.target_max - cfg.target_min)


def shape_reward(
    reward: float, cfg: RewardShapingConfig, *, completion_tokens: int, truncated: bool
) -> float:
    if cfg.stop_properly_penalty_coef is not None:
        return reward * cfg.stop_properly_penalty_coef if truncated else reward
    buffer, penalty, longest = (
        cfg.overlong_buffer_length,
        cfg.overlong_buffer_penalty,
        cfg.max_response_length,
    )
    if buffer is None or penalty is None or longest is None:  # validation requires all three
        raise ValueError(
            "reward_shaping: the overlong penalty needs overlong_buffer_length, "
            "overlong_buffer_penalty and max_response_length"
        )
    excess = completion_tokens - (longest - buffer)
    return reward + min(0.0, -excess / buffer * penalty)
