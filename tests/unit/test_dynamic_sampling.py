"""DAPO dynamic sampling and the reward pipeline (scaling, then shaping), with fakes."""

from __future__ import annotations

import asyncio

import pytest

from tandemrl.config.loader import load_config
from tandemrl.config.models import RewardScalingConfig, RewardShapingConfig
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.envs.base import Environment
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel, fake_codec
from tandemrl.records import EnvResult, PromptItem
from tandemrl.training.advantages import has_zero_advantage
from tandemrl.training.fake import FakeTrainer
from tandemrl.training.rewards import RewardTransform

BASE = "examples/configs/grpo_tiny_cpu.yaml"
N, G = 4, 4


class HalfFlatEnv(Environment):
    """Even prompts: the same reward for every completion (advantage 0); odd prompts: a
    reward that follows the completion's digits."""

    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        if item.index % 2 == 0:
            return EnvResult(reward=0.5)
        return EnvResult(reward=sum(int(ch) for ch in completion) / 36)


SAMPLERS = {
    "in_order": ("{name: in_order, max_lookahead_versions: 1}", N),
    "weight_fifo": ("{name: weight_fifo, max_staleness_versions: 1}", 2),
    "ready_first": ("{name: ready_first, max_staleness_versions: 1}", 2),
    "windowed": ("{name: windowed, max_staleness_versions: 2}", 2),
}


def make_cfg(sampler: str, min_groups: int, *overrides: str):
    cfg = load_config(
        BASE,
        (
            f"grpo.num_prompts_per_step={N}",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={N * G}",
            f"policy.train_micro_batch_size={N * G}",
            "grpo.max_num_steps=5",
            f"async_rl.sampler={sampler}",
            f"async_rl.min_groups_for_streaming_train={min_groups}",
            f"async_rl.max_buffered_rollouts={3 * N}",
            f"async_rl.max_inflight_prompts={2 * N}",
            "logger.progress=false",
            "grpo.use_dynamic_sampling=true",
            *overrides,
        ),
    )
    validate_single_controller_config(cfg)
    return cfg


def run(cfg):
    trainer = FakeTrainer()
    parts = ControllerParts(
        trainer=trainer,
        engines=[FakeGenerationBackend(latency=LatencyModel("uniform", high=0.003), seed=3)],
        env=HalfFlatEnv(),
        codec=fake_codec(),
    )

    async def go():
        controller = build_controller(cfg, parts)
        history = await asyncio.wait_for(controller.run(), timeout=60)
        return controller, history

    return asyncio.run(go())


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_zero_advantage_groups_are_dropped_and_steps_still_fill(name):
    sampler, min_groups = SAMPLERS[name]
    controller, history = run(make_cfg(sampler, min_groups))
    assert len(history) == 5
    assert all(row["groups_trained"] == N for row in history)
    trained = [group for _, group in controller.trained_groups]
    assert not any(has_zero_advantage(group.rewards) for group in trained)
    assert sum(row["zero_advantage_groups"] for row in history) == 0
    # About half of the prompts are flat; each of them was dropped, not trained.
    filtered = sum(row["dynamic_sampling/filtered_groups"] for row in history)
    assert filtered >= 5
    assert all(row["dynamic_sampling/cap_reached"] == 0.0 for row in history)
    # Nothing is left owing: every replacement was dispatched.
    assert controller.sampler.owed_replacements == []


def test_past_the_cap_zero_advantage_groups_are_trained_and_reported():
    # max_gen_batches 1: a step may drop (1 - 1) x N = 0 groups.
    _, history = run(make_cfg(*SAMPLERS["in_order"], "grpo.dynamic_sampling_max_gen_batches=1"))
    assert sum(row["dynamic_sampling/filtered_groups"] for row in history) == 0
    zero = sum(row["zero_advantage_groups"] for row in history)
    assert zero >= 5
    capped = [row for row in history if row["dynamic_sampling/cap_reached"] == 1.0]
    assert capped and all(row["zero_advantage_groups"] > 0 for row in capped)


def test_without_dynamic_sampling_flat_groups_are_trained():
    cfg = load_config(
        BASE,
        (
            f"grpo.num_prompts_per_step={N}",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={N * G}",
            f"policy.train_micro_batch_size={N * G}",
            "grpo.max_num_steps=3",
            "logger.progress=false",
        ),
    )
    _, history = run(cfg)
    assert sum(row["zero_advantage_groups"] for row in history) >= 3
    assert sum(row["dynamic_sampling/filtered_groups"] for row in history) == 0


def test_reward_scaling_then_overlong_shaping_on_the_stored_rows():
    """The fake engine writes 4 tokens (max_new_tokens 4): scaled from [0, 1] to [-1, 1], then
    the overlong penalty of max_response_length 4, buffer 2: 2 tokens over, -0.5 x 2 / 2."""
    controller, history = run(
        make_cfg(
            *SAMPLERS["in_order"],
            "grpo.use_dynamic_sampling=false",
            "grpo.max_num_steps=2",
            "grpo.reward_scaling={enabled: true, target_min: -1.0, target_max: 1.0}",
            "grpo.reward_shaping={enabled: true, overlong_buffer_length: 2, "
            "overlong_buffer_penalty: 0.5, max_response_length: 4}",
        )
    )
    trained = [group for _, group in controller.trained_groups]
    for group in trained:
        for reward, metrics in zip(group.rewards, group.env_metrics, strict=True):
            raw = metrics["reward_before_shaping"]
            assert reward == pytest.approx(-1.0 + 2.0 * raw - 0.5)
    assert history[-1]["env/reward_before_shaping"] > history[-1]["reward_mean"]


def test_reward_transform_by_hand():
    scaling = RewardScalingConfig(
        enabled=True, source_min=0.0, source_max=2.0, target_min=-1.0, target_max=1.0
    )
    shaping = RewardShapingConfig(
        enabled=True, overlong_buffer_length=4, overlong_buffer_penalty=1.0, max_response_length=10
    )
    transform = RewardTransform(scaling=scaling, shaping=shaping)
    # 3.0 clamps to 2.0 -> 1.0; 7 tokens: 1 over the expected 6 -> -1/4.
    assert transform(3.0, completion_tokens=7, truncated=False) == pytest.approx(0.75)
    assert transform(1.0, completion_tokens=6, truncated=False) == pytest.approx(0.0)
    assert transform(0.0, completion_tokens=10, truncated=True) == pytest.approx(-2.0)
    stop = RewardTransform(
        shaping=RewardShapingConfig(enabled=True, stop_properly_penalty_coef=0.2)
    )
    assert stop(1.0, completion_tokens=99, truncated=True) == pytest.approx(0.2)
    assert stop(1.0, completion_tokens=99, truncated=False) == pytest.approx(1.0)
    assert not RewardTransform(scaling=RewardScalingConfig()).active
