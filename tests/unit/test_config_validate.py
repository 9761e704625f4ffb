"""validate_single_controller_config: one test per rule, plus all violations reported together."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from tandemrl.config import (
    ConfigError,
    MasterConfig,
    validate_single_controller_config,
)
from tandemrl.config.loader import apply_overrides, config_from_dict, resolve_references
from tandemrl.config.models import (
    InOrderSamplerConfig,
    ReadyFirstSamplerConfig,
    WeightFifoSamplerConfig,
    WindowedSamplerConfig,
)
from tandemrl.controller.build import build_fake_controller
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.samplers import required_buffer_capacity
from tandemrl.training.fake import FakeTrainer

GRPO_BASE: dict[str, Any] = {
    "policy": {"train_global_batch_size": 8, "train_micro_batch_size": 4},
    "grpo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2},
    "loss_fn": {"use_importance_sampling_correction": True},
    "async_rl": {
        "sampler": {"name": "in_order", "max_lookahead_versions": 1},
        "min_groups_for_streaming_train": "${grpo.num_prompts_per_step}",
        "max_buffered_rollouts": 8,
        "max_inflight_prompts": 8,
    },
}

PPO_BASE: dict[str, Any] = {
    "policy": {
        "train_global_batch_size": 8,
        "train_micro_batch_size": 4,
        "offload_optimizer_for_logprob": True,
    },
    "ppo": {"num_prompts_per_step": 4, "num_generations_per_prompt": 2},
    "value": {"train_global_batch_size": 8, "train_micro_batch_size": 4},
    "value_loss_fn": {},
    "loss_fn": {"use_importance_sampling_correction": True},
    "async_rl": {
        "sampler": {"name": "in_order", "max_lookahead_versions": 1},
        "min_groups_for_streaming_train": "${ppo.num_prompts_per_step}",
        "max_buffered_rollouts": 8,
        "max_inflight_prompts": 8,
    },
}

CHECKPOINTED = (
    "checkpointing.enabled=true",
    "checkpointing.save_data_plane=true",
    "checkpointing.save_period=1",
    "token_capture.enabled=true",
    "rollout_checkpointing.snapshot_attempt_interval_s=30",
)


# Custom sampler classes, imported by target "<this module>:<ClassName>".
class PlainSampler:
    """Structurally a PromptGroupSampler; declares no capabilities."""

    async def admit(self, *, trainer_version_fn):
        return None

    async def select(self, *, current_train_weight, min_prompt_groups, max_prompt_groups):
        return None, 0

    async def evict(self, *, current_train_weight):
        return []

    def should_abort_inflight(self, *, start_weight, current_train_weight):
        return False

    def required_buffer_capacity(self, groups_per_step):
        return groups_per_step


class CheckpointableSampler(PlainSampler):
    supports_buffer_checkpoint = True


class ClaimingSampler(PlainSampler):
    supports_buffer_checkpoint = True
    supports_training_claims = True


class BuildableSampler(PlainSampler):
    """What setup can build; it needs the buffer to hold two steps."""

    def __init__(self, buffer, groups_per_step):
        self.buffer = buffer

    def required_buffer_capacity(self, groups_per_step):
        return 2 * groups_per_step


class NotASampler:
    """Has none of the sampler methods."""

    supports_buffer_checkpoint = True


def custom(class_name: str) -> str:
    return f"async_rl.sampler={{name: custom, target: '{__name__}:{class_name}'}}"


def make(*overrides: str, base: dict[str, Any] = GRPO_BASE) -> MasterConfig:
    raw = copy.deepcopy(base)
    apply_overrides(raw, overrides)
    return config_from_dict(resolve_references(raw))


def errors(*overrides: str, base: dict[str, Any] = GRPO_BASE) -> list[str]:
    with pytest.raises(ConfigError) as info:
        validate_single_controller_config(make(*overrides, base=base))
    return info.value.messages


def warnings(*overrides: str, base: dict[str, Any] = GRPO_BASE) -> list[str]:
    return validate_single_controller_config(make(*overrides, base=base))


def find(messages: list[str], *needles: str) -> str:
    """The one message that contains every needle (dotpaths, values)."""
    matching = [m for m in messages if all(needle in m for needle in needles)]
    assert len(matching) == 1, f"expected one message with {needles}, got {messages}"
    return matching[0]


# --------------------------------------------------------------------------- baselines


@pytest.mark.parametrize("base", [GRPO_BASE, PPO_BASE], ids=["grpo", "ppo"])
def test_base_configs_are_valid(base):
    assert warnings(base=base) == []


def test_all_violations_are_reported_together():
    messages = errors(
        "data_plane.enabled=false",
        "grpo.max_num_epochs=-1",
        "policy.train_global_batch_size=16",
        "loss_fn.use_importance_sampling_correction=false",
        "grpo.val_period=10",
    )
    assert len(messages) == 5
    for dotpath in (
        "data_plane.enabled",
        "grpo.max_num_epochs",
        "policy.train_global_batch_size",
        "loss_fn.use_importance_sampling_correction",
        "data.validation",  # val_period needs held-out prompts
    ):
        find(messages, dotpath)


# --------------------------------------------------------------------------- data plane, blocks


def test_data_plane_must_be_enabled():
    find(errors("data_plane.enabled=false"), "data_plane.enabled", "must be true")


def test_legacy_async_grpo_block_is_refused():
    message = find(errors("grpo.async_grpo={enabled: true}"), "grpo.async_grpo")
    assert "async_rl" in message and "null" in message


def test_legacy_async_ppo_block_is_refused():
    find(errors("ppo.async_ppo={enabled: true}", base=PPO_BASE), "ppo.async_ppo", "null")


def test_both_algorithm_blocks_are_refused():
    find(errors("ppo={}"), "grpo, ppo", "mutually exclusive")


def test_an_algorithm_block_is_required():
    messages = errors("grpo=null", "async_rl.min_groups_for_streaming_train=4")
    find(messages, "grpo, ppo", "neither")


@pytest.mark.parametrize("epochs", [-1, 0])
def test_max_num_epochs_must_be_positive(epochs):
    message = find(errors(f"grpo.max_num_epochs={epochs}"), "grpo.max_num_epochs")
    assert "grpo.max_num_steps" in message and "-1" in message


# --------------------------------------------------------------------------- batch sizes


def test_policy_global_batch_must_equal_one_step():
    message = find(
        errors("policy.train_global_batch_size=16"),
        "policy.train_global_batch_size",
        "grpo.num_prompts_per_step",
        "grpo.num_generations_per_prompt",
    )
    assert "= 8" in message


def test_value_global_batch_must_equal_one_step_on_ppo():
    messages = errors("value.train_global_batch_size=16", base=PPO_BASE)
    find(messages, "value.train_global_batch_size", "ppo.num_prompts_per_step")


def test_micro_batch_larger_than_global_is_refused():
    find(
        errors("policy.train_micro_batch_size=16"),
        "policy.train_micro_batch_size",
        "policy.train_global_batch_size",
        "larger",
    )


def test_micro_batch_must_divide_global():
    find(errors("policy.train_micro_batch_size=3"), "policy.train_micro_batch_size", "divide")


def test_value_micro_batch_larger_than_global_is_refused():
    messages = errors("value.train_micro_batch_size=32", base=PPO_BASE)
    find(messages, "value.train_micro_batch_size", "value.train_global_batch_size")


# --------------------------------------------------------------------------- streaming, buffer


def test_min_groups_cannot_exceed_num_prompts():
    find(
        errors("async_rl.min_groups_for_streaming_train=5"),
        "async_rl.min_groups_for_streaming_train",
        "grpo.num_prompts_per_step",
    )


def test_colocated_needs_whole_step_batches():
    messages = errors(
        "policy.generation.colocated.enabled=true", "async_rl.min_groups_for_streaming_train=2"
    )
    find(
        messages,
        "async_rl.min_groups_for_streaming_train",
        "policy.generation.colocated.enabled",
        "grpo.num_prompts_per_step",
    )
    assert warnings("policy.generation.colocated.enabled=true") == []


@pytest.mark.parametrize(
    ("sampler", "capacity"),
    [
        ("{name: in_order, max_lookahead_versions: 0}", 4),
        ("{name: in_order, max_lookahead_versions: 2}", 12),
        ("{name: weight_fifo, max_staleness_versions: 1}", 8),
        ("{name: ready_first, max_staleness_versions: 2}", 12),
        ("{name: windowed, max_staleness_versions: 3}", 4),
    ],
)
def test_buffer_must_hold_the_samplers_required_capacity(sampler, capacity):
    common = ("loss_fn.use_importance_sampling_correction=true", f"async_rl.sampler={sampler}")
    assert warnings(*common, f"async_rl.max_buffered_rollouts={capacity}") == []
    message = find(
        errors(*common, f"async_rl.max_buffered_rollouts={capacity - 1}"),
        "async_rl.max_buffered_rollouts",
        f"at least {capacity}",
    )
    assert "grpo.num_prompts_per_step" in message


def test_buffer_is_sized_from_the_warmup_lookahead():
    warmup = (
        "ppo.policy_training_start_step=5",
        "async_rl.sampler.warmup_lookahead_versions=2",
    )
    find(errors(*warmup, base=PPO_BASE), "async_rl.max_buffered_rollouts", "at least 12")
    assert warnings(*warmup, "async_rl.max_buffered_rollouts=12", base=PPO_BASE) == []


def test_custom_sampler_buffer_is_not_checked_here():
    assert warnings(custom("PlainSampler"), "async_rl.max_buffered_rollouts=1") == []


def test_setup_refuses_a_buffer_below_a_custom_samplers_capacity():
    """Setup builds the custom class and asks it: a too-small buffer is refused, not deadlocked."""
    # Two steps of num_prompts_per_step 4; validation leaves it to setup.
    assert warnings(custom("BuildableSampler"), "async_rl.max_buffered_rollouts=7") == []
    with pytest.raises(ConfigError) as info:
        build_fake_controller(
            make(custom("BuildableSampler"), "async_rl.max_buffered_rollouts=7"),
            trainer=FakeTrainer(),
            engines=[FakeGenerationBackend()],
        )
    find(info.value.messages, "async_rl.max_buffered_rollouts", "BuildableSampler", "at least 8")
    controller = build_fake_controller(
        make(custom("BuildableSampler"), "async_rl.max_buffered_rollouts=8"),
        trainer=FakeTrainer(),
        engines=[FakeGenerationBackend()],
    )
    assert controller.buffer.capacity == 8


def test_required_buffer_capacity_formula():
    in_order = InOrderSamplerConfig(name="in_order", max_lookahead_versions=2)
    assert required_buffer_capacity(in_order, 16) == 48
    warm = InOrderSamplerConfig(
        name="in_order", max_lookahead_versions=1, warmup_lookahead_versions=3
    )
    assert required_buffer_capacity(warm, 16) == 64
    fifo = WeightFifoSamplerConfig(name="weight_fifo", max_staleness_versions=1)
    assert required_buffer_capacity(fifo, 16) == 32
    ready = ReadyFirstSamplerConfig(name="ready_first", max_staleness_versions=0)
    assert required_buffer_capacity(ready, 16) == 16
    windowed = WindowedSamplerConfig(name="windowed", max_staleness_versions=5)
    assert required_buffer_capacity(windowed, 16) == 16
    custom_cfg = make(custom("PlainSampler")).async_rl.sampler
    with pytest.raises(ValueError, match="declared by the sampler class"):
        required_buffer_capacity(custom_cfg, 16)


@pytest.mark.parametrize(
    "sampler",
    [
        "{name: in_order, max_lookahead_versions: 1}",
        "{name: weight_fifo, max_staleness_versions: 1}",
        "{name: ready_first, max_staleness_versions: 1}",
    ],
)
def test_gated_samplers_refuse_fewer_inflight_than_a_chunk(sampler):
    messages = errors(f"async_rl.sampler={sampler}", "async_rl.max_inflight_prompts=3")
    find(messages, "async_rl.max_inflight_prompts", "async_rl.min_groups_for_streaming_train")


def test_windowed_sampler_allows_fewer_inflight_than_a_chunk():
    sampler = "async_rl.sampler={name: windowed, max_staleness_versions: 1}"
    assert warnings(sampler, "async_rl.max_inflight_prompts=3") == []


def test_max_inflight_prompts_must_be_positive():
    cfg = make()
    cfg.async_rl.__dict__["max_inflight_prompts"] = 0  # bypass the model's own ge=1 check
    with pytest.raises(ConfigError) as info:
        validate_single_controller_config(cfg)
    find(info.value.messages, "async_rl.max_inflight_prompts", "at least 1")


# --------------------------------------------------------------------------- importance sampling


@pytest.mark.parametrize(
    ("sampler", "knob"),
    [
        ("{name: in_order, max_lookahead_versions: 1}", "max_lookahead_versions"),
        ("{name: weight_fifo, max_staleness_versions: 1}", "max_staleness_versions"),
        ("{name: windowed, max_staleness_versions: 1}", "max_staleness_versions"),
        ("{name: ready_first, max_staleness_versions: 0}", "ready_first"),
    ],
)
def test_off_policy_samplers_need_importance_sampling(sampler, knob):
    messages = errors(
        f"async_rl.sampler={sampler}", "loss_fn.use_importance_sampling_correction=false"
    )
    find(messages, "loss_fn.use_importance_sampling_correction", knob)


@pytest.mark.parametrize(
    "sampler",
    [
        "{name: in_order, max_lookahead_versions: 0}",
        "{name: weight_fifo, max_staleness_versions: 0}",
        "{name: windowed, max_staleness_versions: 0}",
    ],
)
def test_on_policy_samplers_do_not_need_importance_sampling(sampler):
    overrides = (f"async_rl.sampler={sampler}", "loss_fn.use_importance_sampling_correction=false")
    assert warnings(*overrides) == []


# --------------------------------------------------------------------------- PPO


@pytest.mark.parametrize("block", ["value", "value_loss_fn"])
def test_ppo_needs_the_critic_blocks(block):
    find(errors(f"{block}=null", base=PPO_BASE), f"{block}:", "required")


@pytest.mark.parametrize("block", ["value", "value_loss_fn"])
def test_grpo_refuses_the_critic_blocks(block):
    find(errors(f"{block}={{}}"), f"{block}:", "only used by PPO")


def test_ppo_needs_gae():
    find(errors("ppo.adv_estimator.name=grpo", base=PPO_BASE), "ppo.adv_estimator.name", "gae")


def test_ppo_needs_optimizer_offload_for_logprob():
    messages = errors("policy.offload_optimizer_for_logprob=false", base=PPO_BASE)
    find(messages, "policy.offload_optimizer_for_logprob")


@pytest.mark.parametrize(
    "sampler",
    [
        "{name: weight_fifo, max_staleness_versions: 1}",
        "{name: ready_first, max_staleness_versions: 1}",
        "{name: windowed, max_staleness_versions: 1}",
    ],
)
def test_ppo_streams_under_every_sampler(sampler):
    overrides = (f"async_rl.sampler={sampler}", "async_rl.min_groups_for_streaming_train=2")
    assert warnings(*overrides, base=PPO_BASE) == []


@pytest.mark.parametrize("key", ["max_skipped_prompts", "max_consecutive_dropped_prompts"])
def test_ppo_accepts_drop_budgets(key):
    assert warnings(f"async_rl.rollout_failure.{key}=2", base=PPO_BASE) == []


def test_ppo_colocated_with_stand_down_still_needs_whole_steps():
    messages = errors(
        "policy.generation.colocated.enabled=true",
        "async_rl.min_groups_for_streaming_train=2",
        base=PPO_BASE,
    )
    find(messages, "async_rl.min_groups_for_streaming_train", "colocated")


@pytest.mark.parametrize("key", ["ppo_epochs", "critic_ppo_epochs"])
def test_ppo_epoch_counts_must_be_positive(key):
    find(errors(f"ppo.{key}=0", base=PPO_BASE), f"ppo.{key}", "at least 1")


def test_critic_epochs_can_follow_policy_epochs_by_reference():
    cfg = make("ppo.ppo_epochs=3", "ppo.critic_ppo_epochs=${ppo.ppo_epochs}", base=PPO_BASE)
    assert cfg.ppo.critic_ppo_epochs == 3
    assert validate_single_controller_config(cfg) == []


# --------------------------------------------------------------------------- warm-up lookahead


def test_warmup_lookahead_is_refused_on_grpo():
    messages = errors(
        "async_rl.sampler.warmup_lookahead_versions=2", "async_rl.max_buffered_rollouts=12"
    )
    find(messages, "async_rl.sampler.warmup_lookahead_versions", "ppo.policy_training_start_step")


def test_warmup_lookahead_needs_a_critic_warmup():
    messages = errors(
        "async_rl.sampler.warmup_lookahead_versions=2",
        "async_rl.max_buffered_rollouts=12",
        base=PPO_BASE,
    )
    find(messages, "async_rl.sampler.warmup_lookahead_versions", "ppo.policy_training_start_step")


def test_warmup_lookahead_cannot_be_narrower_than_the_lookahead():
    messages = errors(
        "ppo.policy_training_start_step=5",
        "async_rl.sampler.warmup_lookahead_versions=0",
        base=PPO_BASE,
    )
    find(
        messages,
        "async_rl.sampler.warmup_lookahead_versions",
        "async_rl.sampler.max_lookahead_versions",
    )


# --------------------------------------------------------------------------- failure budgets


@pytest.mark.parametrize("key", ["max_skipped_prompts", "max_consecutive_dropped_prompts"])
def test_drop_budgets_need_in_order_or_custom(key):
    sampler = "async_rl.sampler={name: weight_fifo, max_staleness_versions: 1}"
    messages = errors(sampler, f"async_rl.rollout_failure.{key}=3")
    find(messages, f"async_rl.rollout_failure.{key}", "async_rl.sampler.name")
    assert warnings(f"async_rl.rollout_failure.{key}=3") == []
    assert warnings(custom("PlainSampler"), f"async_rl.rollout_failure.{key}=3") == []


def test_replace_needs_a_replacement_reserve():
    messages = errors("async_rl.rollout_failure.on_dropped_prompt=replace")
    find(
        messages,
        "async_rl.rollout_failure.replacement_reserve_size",
        "async_rl.rollout_failure.on_dropped_prompt",
    )
    overrides = (
        "async_rl.rollout_failure.on_dropped_prompt=replace",
        "async_rl.rollout_failure.replacement_reserve_size=4",
    )
    assert warnings(*overrides) == []


# --------------------------------------------------------------------------- checkpointing


def test_checkpointing_with_built_in_sampler_needs_the_data_plane_saved():
    messages = errors("checkpointing.enabled=true")
    find(messages, "checkpointing.save_data_plane", "checkpointing.enabled")
    assert warnings("checkpointing.enabled=true", "checkpointing.save_data_plane=true") == []


def test_data_plane_save_needs_a_native_backend():
    messages = errors(
        "checkpointing.enabled=true",
        "checkpointing.save_data_plane=true",
        "data_plane.backend=mooncake",
    )
    find(messages, "checkpointing.save_data_plane", "data_plane.backend")


def test_data_plane_save_without_checkpointing_warns():
    (warning,) = warnings("checkpointing.save_data_plane=true")
    assert "checkpointing.save_data_plane" in warning and "checkpointing.enabled" in warning


def test_custom_sampler_without_buffer_checkpoint_warns_shadow_mode():
    (warning,) = warnings(custom("PlainSampler"), "checkpointing.enabled=true")
    assert "async_rl.sampler.target" in warning and "shadow mode" in warning
    assert warnings(custom("CheckpointableSampler"), "checkpointing.enabled=true") == []


def test_custom_sampler_that_cannot_be_imported_is_an_error():
    message = find(
        errors("async_rl.sampler={name: custom, target: 'no_such_module_xyz:Sampler'}"),
        "async_rl.sampler.target",
    )
    assert "no_such_module_xyz" in message
    find(
        errors(f"async_rl.sampler={{name: custom, target: '{__name__}:Missing'}}"),
        "async_rl.sampler.target",
    )
    find(errors("async_rl.sampler={name: custom, target: 'no_colon'}"), "async_rl.sampler.target")


def test_custom_sampler_that_is_not_a_sampler_is_an_error():
    message = find(errors(custom("NotASampler")), "async_rl.sampler.target")
    assert "PromptGroupSampler" in message


# --------------------------------------------------------------------------- rollout snapshots


def test_checkpointed_base_is_valid():
    assert warnings(*CHECKPOINTED) == []
    assert warnings(*CHECKPOINTED, custom("ClaimingSampler")) == []


@pytest.mark.parametrize(
    ("override", "dotpath"),
    [
        ("checkpointing.enabled=false", "checkpointing.enabled"),
        ("checkpointing.save_data_plane=false", "checkpointing.save_data_plane"),
        ("token_capture.enabled=false", "token_capture.enabled"),
        ("data_plane.backend=mooncake", "data_plane.backend"),
    ],
)
def test_periodic_snapshots_requirements(override, dotpath):
    messages = errors(*CHECKPOINTED, override)
    find(messages, dotpath, "rollout_checkpointing.snapshot_attempt_interval_s")


@pytest.mark.parametrize(
    ("sampler_class", "missing"),
    [
        ("PlainSampler", "supports_buffer_checkpoint = True and supports_training_claims"),
        ("CheckpointableSampler", "supports_training_claims = True"),
    ],
)
def test_periodic_snapshots_need_a_claiming_sampler(sampler_class, missing):
    messages = errors(*CHECKPOINTED, custom(sampler_class))
    find(messages, "async_rl.sampler.target", "snapshot_attempt_interval_s", missing)


def test_periodic_snapshots_warn_when_save_period_is_not_one():
    (warning,) = warnings(*CHECKPOINTED, "checkpointing.save_period=5")
    assert "checkpointing.save_period" in warning


def test_restore_mode_must_be_known():
    messages = errors("rollout_checkpointing.restore_mode=newest")
    find(messages, "rollout_checkpointing.restore_mode", "trainer_checkpoint")
    assert warnings("rollout_checkpointing.restore_mode=trainer_checkpoint") == []


def test_keep_latest_k_must_be_positive():
    find(errors("rollout_checkpointing.keep_latest_k=0"), "rollout_checkpointing.keep_latest_k")


@pytest.mark.parametrize("path", ["*", "**", "a..b", ".a", "a.", "", "a.b*", "*.**"])
def test_malformed_fingerprint_exclusions_are_refused(path):
    messages = errors(f"rollout_checkpointing.extra_fingerprint_excluded_paths=['{path}']")
    find(messages, "rollout_checkpointing.extra_fingerprint_excluded_paths[0]")


def test_well_formed_fingerprint_exclusions_are_accepted():
    paths = "['custom_algo.observability', 'env.private.workers.*.log_dir', 'env.**.port']"
    assert warnings(f"rollout_checkpointing.extra_fingerprint_excluded_paths={paths}") == []


# --------------------------------------------------------------------------- rollout recovery


@pytest.mark.parametrize(
    ("override", "dotpath"),
    [
        ("rollout_recovery.default_granularity=prompt_group", "default_granularity"),
        (
            "rollout_recovery.task_source_granularity_overrides={math: prompt_group}",
            "task_source_granularity_overrides",
        ),
        (
            "rollout_recovery.agent_granularity_overrides={agent1: sibling}",
            "agent_granularity_overrides",
        ),
    ],
)
def test_non_default_recovery_policies_need_token_capture(override, dotpath):
    find(errors(override), "token_capture.enabled", f"rollout_recovery.{dotpath}")
    assert warnings(override, "token_capture.enabled=true") == []


# --------------------------------------------------------------------------- backends


def test_megatron_generation_backend_is_refused():
    message = find(errors("policy.generation.backend=megatron"), "policy.generation.backend")
    assert "policy.dtensor_cfg" in message and "torch" in message


def test_megatron_trainer_is_refused():
    message = find(errors("policy.megatron_cfg.enabled=true"), "policy.megatron_cfg.enabled")
    assert "policy.dtensor_cfg" in message


def test_dtensor_trainer_must_stay_enabled():
    find(errors("policy.dtensor_cfg.enabled=false"), "policy.dtensor_cfg.enabled")


def test_vllm_needs_the_async_engine():
    messages = errors("policy.generation.backend=vllm")
    find(messages, "policy.generation.vllm_cfg.async_engine")
    assert (
        warnings("policy.generation.backend=vllm", "policy.generation.vllm_cfg.async_engine=true")
        == []
    )


def test_colocated_without_stand_down_may_train_in_chunks():
    assert (
        warnings(
            "policy.generation.colocated.enabled=true",
            "policy.generation.colocated.stand_down=false",
            "async_rl.min_groups_for_streaming_train=2",
        )
        == []
    )
    message = find(
        errors(
            "policy.generation.colocated.enabled=true", "async_rl.min_groups_for_streaming_train=2"
        ),
        "async_rl.min_groups_for_streaming_train",
    )
    assert "policy.generation.colocated.stand_down: false" in message


def test_stand_down_off_needs_colocated():
    find(
        errors("policy.generation.colocated.stand_down=false"),
        "policy.generation.colocated.stand_down",
        "policy.generation.colocated.enabled: true",
    )


def test_vllm_refuses_colocated():
    messages = errors(
        "policy.generation.backend=vllm",
        "policy.generation.vllm_cfg.async_engine=true",
        "policy.generation.colocated.enabled=true",
    )
    find(messages, "policy.generation.colocated.enabled", "vllm")


def test_torch_engine_keys_need_backend_torch():
    messages = errors(
        "policy.generation.backend=vllm",
        "policy.generation.vllm_cfg.async_engine=true",
        "policy.generation.torch.cuda_graphs=off",
    )
    find(messages, "policy.generation.torch", "vllm")
    assert warnings("policy.generation.torch.cuda_graphs=off") == []
    assert warnings("policy.generation.torch.max_seq_len=512") == []


def test_several_steps_per_launch_need_the_static_path():
    messages = errors(
        "policy.generation.torch.cuda_graphs=off", "policy.generation.torch.steps_per_launch=4"
    )
    find(messages, "policy.generation.torch.steps_per_launch=4", "cuda_graphs=off")
    assert warnings("policy.generation.torch.steps_per_launch=4") == []
    find(errors("policy.generation.torch.steps_per_launch=0"), "steps_per_launch")


def test_torch_colocated_and_fake_backends_are_allowed():
    assert warnings("policy.generation.colocated.enabled=true") == []
    assert warnings("policy.generation.backend=fake") == []


def test_mooncake_data_plane_is_refused():
    message = find(errors("data_plane.backend=mooncake"), "data_plane.backend")
    assert "local" in message and "simple" in message


def test_custom_env_needs_a_target_and_only_it_takes_one():
    find(errors("env.name=custom", "data.dataset=d.jsonl"), "env.target", "required")
    find(errors("env.target=pkg.mod:Env"), "env.target", "only used")
    assert warnings("env.name=custom", "env.target=pkg.mod:Env", "data.dataset=d.jsonl") == []


def test_env_python_path_is_only_for_a_custom_env():
    find(errors("env.python_path=[examples/custom_env]"), "env.python_path", "only used")
    find(
        errors("env.name=custom", "env.target=m:E", "env.python_path=['  ']"),
        "env.python_path[0]",
        "empty",
    )
    custom = (
        "env.name=custom",
        "env.target=m:E",
        "env.python_path=[examples/custom_env]",
        "data.dataset=builtin://counting",
    )
    assert warnings(*custom) == []


def test_config_error_lists_every_message_in_its_text():
    error = ConfigError(["a.b: first", "c.d: second"])
    assert error.messages == ["a.b: first", "c.d: second"]
    assert "2 problems" in str(error)
    assert "a.b: first" in str(error) and "c.d: second" in str(error)
    assert isinstance(error, ValueError)


# --------------------------------------------------------------------------- agents


AGENT = ("env.name=agent", "env.target=tandemrl.agents.counting_game:CountingGameAgent")


def test_agent_runs_and_the_endpoint_refuse_keys_that_would_do_nothing():
    assert warnings(*AGENT, "data.dataset=builtin://counting") == []
    find(
        errors("policy.generation.http_server.enabled=true"),
        "http_server.enabled",
        "env.name: agent",
    )
    find(errors("env.agent.max_turns=3"), "env.agent", "env.name: agent")
    find(errors("token_capture.on_prefix_mismatch=error"), "token_capture.on_prefix_mismatch")
    find(errors("env.name=agent", "data.dataset=builtin://counting"), "env.target", "required")
    messages = errors(
        *AGENT,
        "data.dataset=builtin://counting",
        "env.agent.client=http",
        "loss_fn.token_level_loss=false",
        "data.prompt_format=chat",
        "env.agent.max_tokens_per_turn=64",
    )
    find(messages, "env.agent.client: http", "http_server.enabled: true")
    find(messages, "loss_fn.token_level_loss", "split")
    find(messages, "data.prompt_format", "agent")
    find(messages, "env.agent.max_tokens_per_turn", "max_total_sequence_length")


# --------------------------------------------------------------------------- loss: clips and KL


def test_asymmetric_clip_is_accepted_and_a_lower_bound_at_zero_is_refused():
    assert warnings("loss_fn.ratio_clip_min=0.2", "loss_fn.ratio_clip_max=0.28") == []
    find(errors("loss_fn.ratio_clip_min=1.0"), "loss_fn.ratio_clip_min", "below 1")


def test_dual_clip_needs_c_above_one():
    assert make("loss_fn.ratio_clip_c=3.0").loss_fn.ratio_clip_c == 3.0
    with pytest.raises(ValueError, match="ratio_clip_c"):
        make("loss_fn.ratio_clip_c=1.0")


@pytest.mark.parametrize(
    "override",
    [
        "loss_fn.reference_policy_kl_type=k1",
        "loss_fn.kl_input_clamp_value=null",
        "loss_fn.kl_output_clamp_value=5.0",
    ],
)
def test_kl_settings_without_a_kl_penalty_are_refused(override):
    key = override.split("=")[0]
    find(errors(override), key, "reference_policy_kl_penalty")
    assert warnings(override, "loss_fn.reference_policy_kl_penalty=0.01") == []


# --------------------------------------------------------------------------- rewards, dynamic sampling


def test_dynamic_sampling_is_grpo_only_and_needs_groups():
    assert warnings("grpo.use_dynamic_sampling=true") == []
    find(errors("ppo.use_dynamic_sampling=true", base=PPO_BASE), "ppo.use_dynamic_sampling")
    messages = errors(
        "grpo.use_dynamic_sampling=true",
        "grpo.num_generations_per_prompt=1",
        "policy.train_global_batch_size=4",
    )
    find(messages, "grpo.use_dynamic_sampling", "num_generations_per_prompt >= 2")
    find(errors(custom("BuildableSampler"), "grpo.use_dynamic_sampling=true"), "built-in sampler")
    find(errors("grpo.dynamic_sampling_max_gen_batches=3"), "use_dynamic_sampling is false")


def test_reward_shaping_needs_its_three_lengths_or_the_stop_penalty():
    shaping = "grpo.reward_shaping={enabled: true, overlong_buffer_length: 4}"
    messages = errors(shaping)
    find(messages, "grpo.reward_shaping.overlong_buffer_penalty", "required")
    find(messages, "grpo.reward_shaping.max_response_length", "required")
    full = (
        "grpo.reward_shaping={enabled: true, overlong_buffer_length: 4, "
        "overlong_buffer_penalty: 1.0, max_response_length: 16}"
    )
    assert warnings(full, "policy.generation.max_new_tokens=16") == []
    assert "never applies" in warnings(full, "policy.generation.max_new_tokens=8")[0]
    both = (
        "grpo.reward_shaping={enabled: true, overlong_buffer_length: 4, "
        "stop_properly_penalty_coef: 0.5}"
    )
    find(errors(both), "grpo.reward_shaping.overlong_buffer_length", "exclude each other")
    too_long = (
        "grpo.reward_shaping={enabled: true, overlong_buffer_length: 20, "
        "overlong_buffer_penalty: 1.0, max_response_length: 16}"
    )
    find(errors(too_long), "grpo.reward_shaping.overlong_buffer_length", "longer than")


def test_reward_scaling_ranges_must_be_increasing():
    assert warnings("grpo.reward_scaling={enabled: true, target_min: -1.0}") == []
    messages = errors("grpo.reward_scaling={enabled: true, source_min: 1.0}")
    find(messages, "grpo.reward_scaling.source_min", "below")


# --------------------------------------------------------------------------- over-sampling, drain gate


def test_over_sampling_ratio_sizes_the_defaults_and_warns_when_the_buffer_caps_first():
    windowed = "{name: windowed, max_staleness_versions: 1, over_sampling_ratio: 0.5}"
    raw = copy.deepcopy(GRPO_BASE)
    del raw["async_rl"]["max_buffered_rollouts"], raw["async_rl"]["max_inflight_prompts"]
    apply_overrides(raw, (f"async_rl.sampler={windowed}",))
    cfg = config_from_dict(resolve_references(raw))
    # (1 + 1) x 4 + ceil(0.5 x 4) = 10
    assert (cfg.async_rl.max_buffered_rollouts, cfg.async_rl.max_inflight_prompts) == (10, 10)
    assert validate_single_controller_config(cfg) == []
    found = warnings(f"async_rl.sampler={windowed}", "async_rl.max_buffered_rollouts=8")
    assert len(found) == 1 and "async_rl.sampler.over_sampling_ratio" in found[0]
    with pytest.raises(ValueError, match="over_sampling_ratio"):
        make("async_rl.sampler={name: windowed, over_sampling_ratio: -1}")


def test_drain_timeout_only_with_the_drain_gate():
    find(errors("async_rl.drain_timeout_s=5"), "async_rl.drain_timeout_s", "drain gate")
    assert warnings("async_rl.in_flight_weight_updates=false", "async_rl.drain_timeout_s=5") == []
