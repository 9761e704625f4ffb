"""load_config: YAML, overrides, ${...} interpolation, unknown keys, pydantic errors, round trip."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tandemrl.config import ConfigError, config_to_dict, load_config
from tandemrl.config.models import CustomSamplerConfig, WindowedSamplerConfig


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.messages


def test_whole_value_reference_keeps_the_type(tmp_path):
    path = write(
        tmp_path,
        """
        grpo:
          num_prompts_per_step: 12
        async_rl:
          min_groups_for_streaming_train: ${grpo.num_prompts_per_step}
        """,
    )
    cfg = load_config(path)
    assert cfg.async_rl.min_groups_for_streaming_train == 12
    assert isinstance(cfg.async_rl.min_groups_for_streaming_train, int)


def test_reference_to_a_list_keeps_the_list(tmp_path):
    path = write(
        tmp_path,
        """
        policy:
          optimizer: {betas: [0.8, 0.95]}
        value:
          optimizer:
            betas: ${policy.optimizer.betas}
        """,
    )
    assert load_config(path).value.optimizer.betas == (0.8, 0.95)


def test_embedded_reference_is_substituted_as_text(tmp_path):
    path = write(
        tmp_path,
        """
        grpo:
          num_prompts_per_step: 12
          seed: 7
        logger:
          log_dir: runs/n${grpo.num_prompts_per_step}-seed${grpo.seed}
        """,
    )
    assert load_config(path).logger.log_dir == "runs/n12-seed7"


def test_reference_to_an_unwritten_key_takes_the_model_default(tmp_path):
    path = write(
        tmp_path,
        """
        grpo: {}
        async_rl:
          min_groups_for_streaming_train: ${grpo.num_prompts_per_step}
          max_inflight_prompts: ${async_rl.max_buffered_rollouts}
        """,
    )
    cfg = load_config(path)
    assert cfg.async_rl.min_groups_for_streaming_train == cfg.grpo.num_prompts_per_step == 16
    assert cfg.async_rl.max_inflight_prompts == cfg.async_rl.max_buffered_rollouts


def test_chained_references_resolve(tmp_path):
    path = write(
        tmp_path,
        """
        ppo:
          ppo_epochs: 3
          critic_ppo_epochs: ${ppo.ppo_epochs}
        grpo: null
        data:
          seed: ${ppo.critic_ppo_epochs}
        """,
    )
    cfg = load_config(path)
    assert cfg.ppo.critic_ppo_epochs == 3
    assert cfg.data.seed == 3


def test_reference_through_a_referenced_block(tmp_path):
    path = write(
        tmp_path,
        """
        policy:
          optimizer: {lr: 0.01}
        value:
          optimizer: ${policy.optimizer}
        loss_fn:
          entropy_coef: ${value.optimizer.lr}
        """,
    )
    cfg = load_config(path)
    assert cfg.value.optimizer.lr == 0.01
    assert cfg.loss_fn.entropy_coef == 0.01


def test_missing_reference_names_both_dotpaths(tmp_path):
    path = write(
        tmp_path,
        """
        grpo: {}
        async_rl:
          min_groups_for_streaming_train: ${grpo.num_prompts_per_stp}
        """,
    )
    (message,) = problems(path)
    assert message.startswith("async_rl.min_groups_for_streaming_train:")
    assert "grpo.num_prompts_per_stp" in message
    assert "did you mean grpo.num_prompts_per_step?" in message


def test_reference_into_an_absent_optional_block_is_missing(tmp_path):
    path = write(tmp_path, "async_rl:\n  max_buffered_rollouts: ${ppo.num_prompts_per_step}\n")
    (message,) = problems(path)
    assert message.startswith("async_rl.max_buffered_rollouts:")
    assert "ppo.num_prompts_per_step" in message
    assert "ppo is not set" in message and "did you mean" not in message


def test_reference_cycle_is_an_error_naming_the_cycle(tmp_path):
    path = write(
        tmp_path,
        """
        grpo:
          num_prompts_per_step: ${grpo.seed}
          seed: ${grpo.num_prompts_per_step}
        """,
    )
    messages = problems(path)
    assert any(
        "reference cycle" in m and "grpo.seed" in m and "grpo.num_prompts_per_step" in m
        for m in messages
    ), messages


def test_self_reference_is_a_cycle(tmp_path):
    path = write(tmp_path, "logger:\n  log_dir: runs/${logger.log_dir}\n")
    (message,) = problems(path)
    assert "reference cycle logger.log_dir -> logger.log_dir" in message


def test_escaped_reference_is_literal(tmp_path):
    path = write(tmp_path, "logger:\n  log_dir: runs/\\${not.a.ref}\n")
    assert load_config(path).logger.log_dir == "runs/${not.a.ref}"


def test_overrides_are_yaml_scalars(tmp_path):
    path = write(tmp_path, "grpo: {}\n")
    cfg = load_config(
        path,
        [
            "grpo.max_num_steps=40",
            "grpo.overlong_filtering=true",
            "loss_fn.entropy_coef=0.01",
            "policy.max_grad_norm=null",
            "logger.log_dir=runs/x",
        ],
    )
    assert cfg.grpo.max_num_steps == 40
    assert cfg.grpo.overlong_filtering is True
    assert cfg.loss_fn.entropy_coef == 0.01
    assert cfg.policy.max_grad_norm is None
    assert cfg.logger.log_dir == "runs/x"


def test_override_is_applied_before_interpolation(tmp_path):
    path = write(
        tmp_path,
        """
        grpo:
          num_prompts_per_step: 16
        async_rl:
          min_groups_for_streaming_train: ${grpo.num_prompts_per_step}
        """,
    )
    cfg = load_config(path, ["grpo.num_prompts_per_step=4"])
    assert cfg.async_rl.min_groups_for_streaming_train == 4


def test_override_creates_intermediate_mappings(tmp_path):
    path = write(tmp_path, "grpo: {}\n")
    cfg = load_config(
        path, ["async_rl.sampler.name=windowed", "async_rl.sampler.sample_freshest_first=true"]
    )
    assert isinstance(cfg.async_rl.sampler, WindowedSamplerConfig)
    assert cfg.async_rl.sampler.sample_freshest_first is True


def test_override_fills_a_null_block(tmp_path):
    path = write(tmp_path, "grpo: null\n")
    assert load_config(path, ["grpo.seed=3"]).grpo.seed == 3


def test_malformed_overrides_are_all_reported(tmp_path):
    path = write(tmp_path, "grpo:\n  seed: 1\n")
    messages = problems(path, ("grpo.seed", "=3", "grpo..seed=1", "grpo.seed.x=1"))
    assert len(messages) == 4
    assert messages[0].startswith("'grpo.seed': not a valid override")
    assert messages[1].startswith("'=3':")
    assert messages[2].startswith("'grpo..seed=1':")
    assert messages[3].startswith("grpo.seed.x:") and "not a mapping" in messages[3]


def test_unknown_key_suggests_the_closest_valid_key(tmp_path):
    path = write(
        tmp_path,
        """
        async_rl:
          sampler:
            name: in_order
            max_lookahed_versions: 1
        """,
    )
    assert problems(path) == [
        "async_rl.sampler.max_lookahed_versions: unknown key; did you mean max_lookahead_versions?"
    ]


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path):
    path = write(tmp_path, "logger:\n  zzz: 1\n")
    (message,) = problems(path)
    assert message.startswith("logger.zzz: unknown key; valid keys here:")
    assert "log_dir" in message


def test_knob_of_another_sampler_mode_gets_a_specific_message(tmp_path):
    path = write(
        tmp_path,
        """
        async_rl:
          sampler:
            name: in_order
            max_staleness_versions: 1
        """,
    )
    assert problems(path) == [
        "async_rl.sampler.max_staleness_versions: belongs to sampler mode(s) weight_fifo, "
        "ready_first, windowed; it has no effect under in_order — remove it (or set it to "
        "null) or change async_rl.sampler.name"
    ]


def test_in_order_knob_under_windowed(tmp_path):
    path = write(
        tmp_path,
        "async_rl:\n  sampler: {name: windowed, max_lookahead_versions: 1}\n",
    )
    (message,) = problems(path)
    assert message.startswith(
        "async_rl.sampler.max_lookahead_versions: belongs to sampler mode(s) in_order;"
    )


def test_custom_sampler_extra_keys_are_constructor_arguments(tmp_path):
    path = write(
        tmp_path,
        "async_rl:\n  sampler: {name: custom, target: 'pkg.mod:Cls', window: 3, max_staleness_versions: 2}\n",
    )
    sampler = load_config(path).async_rl.sampler
    assert isinstance(sampler, CustomSamplerConfig)
    assert sampler.constructor_kwargs() == {"window": 3, "max_staleness_versions": 2}


def test_sampler_name_missing_or_invalid(tmp_path):
    missing = write(tmp_path, "async_rl:\n  sampler: {max_lookahead_versions: 1}\n")
    (message,) = problems(missing)
    assert message.startswith("async_rl.sampler.name: required; one of in_order")
    invalid = write(tmp_path, "async_rl:\n  sampler: {name: fifo}\n")
    (message,) = problems(invalid)
    assert message.startswith("async_rl.sampler.name: 'fifo' is not a sampler mode")


def test_type_errors_are_all_listed_with_dotpaths(tmp_path):
    path = write(
        tmp_path,
        """
        grpo:
          num_prompts_per_step: 0
          seed: abc
        async_rl:
          sampler: {name: in_order, max_lookahead_versions: -1}
        policy:
          optimizer: {betas: [0.9, high]}
          bogus: 1
        """,
    )
    messages = problems(path)
    paths = [m.split(":", 1)[0] for m in messages]
    assert paths == [
        "policy.bogus",
        "policy.optimizer.betas[1]",
        "grpo.num_prompts_per_step",
        "grpo.seed",
        "async_rl.sampler.max_lookahead_versions",
    ]


def test_file_problems_are_config_errors(tmp_path):
    assert "not found" in problems(tmp_path / "nope.yaml")[0]
    assert "top level must be a mapping" in problems(write(tmp_path, "- a\n- b\n"))[0]
    assert "not valid YAML" in problems(write(tmp_path, "a: [1\n"))[0]


def test_empty_file_loads_defaults(tmp_path):
    cfg = load_config(write(tmp_path, ""))
    assert cfg.grpo is None and cfg.async_rl.sampler.name == "in_order"


def test_config_to_dict_round_trips_through_load(tmp_path):
    path = write(
        tmp_path,
        r"""
        ppo:
          num_prompts_per_step: 4
          adv_estimator: {name: gae, lambda: 0.9}
        value: {}
        value_loss_fn: {}
        async_rl:
          sampler: {name: custom, target: 'pkg.mod:Cls', window: 3}
        logger:
          log_dir: runs/\${literal}
        """,
    )
    cfg = load_config(path)
    dumped = config_to_dict(cfg)
    assert dumped["ppo"]["adv_estimator"]["lambda"] == 0.9
    again = write(tmp_path, yaml.safe_dump(dumped, sort_keys=False))
    reloaded = load_config(again)
    assert reloaded == cfg
    assert reloaded.logger.log_dir == "runs/${literal}"
