"""NeMo-RL-style config files: defaults: chains, relative references, resolvers, Hydra overrides."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tandemrl.config import ConfigError, load_config
from tandemrl.config.keys import is_typo_of
from tandemrl.config.models import InOrderSamplerConfig, WindowedSamplerConfig


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def problems(path: Path, overrides: tuple[str, ...] = ()) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.messages


@pytest.fixture
def chain(tmp_path: Path) -> Path:
    """base/common.yaml <- recipes/parent.yaml <- recipes/llm/child.yaml, NeMo-RL style."""
    write(
        tmp_path / "base" / "common.yaml",
        """
        grpo:
          num_prompts_per_step: 32
          num_generations_per_prompt: 4
          seed: 7
        policy:
          train_micro_batch_size: 4
          max_total_sequence_length: 48
          train_global_batch_size: ${mul:${grpo.num_prompts_per_step}, ${grpo.num_generations_per_prompt}}
          train_micro_batch_tokens: ${mul:${.max_total_sequence_length}, ${.train_micro_batch_size}}
          generation:
            temperature: 0.7
            top_p: 1.0
            stop_strings: [a, b]
            max_new_tokens: ${div:${..max_total_sequence_length}, 4}
        async_rl:
          min_groups_for_streaming_train: ${grpo.num_prompts_per_step}
        logger:
          log_dir: runs/seed${grpo.seed}
        """,
    )
    write(
        tmp_path / "recipes" / "parent.yaml",
        """
        defaults: ../base/common.yaml
        grpo:
          num_prompts_per_step: 8
        policy:
          generation:
            stop_strings: [c]
        """,
    )
    return write(
        tmp_path / "recipes" / "llm" / "child.yaml",
        """
        defaults:
          - ../parent.yaml
        grpo:
          num_generations_per_prompt: 2
        data:
          dataset: builtin://counting
        """,
    )


def test_a_two_level_chain_merges_child_over_parents_and_resolves_late(chain):
    cfg = load_config(chain)
    # The child's and parent's values flow into the grandparent's references.
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (8, 2)
    assert cfg.grpo.seed == 7
    assert cfg.policy.train_global_batch_size == 16  # ${mul:...} of the merged values
    assert isinstance(cfg.policy.train_global_batch_size, int)
    assert cfg.policy.train_micro_batch_tokens == 48 * 4  # relative ${.key}
    assert cfg.policy.generation.max_new_tokens == 12  # ${div:${..key}, 4} into an int field
    assert cfg.policy.generation.stop_strings == ["c"]  # lists are replaced, not merged
    assert cfg.policy.generation.temperature == 0.7  # untouched parent keys survive
    assert cfg.async_rl.min_groups_for_streaming_train == 8
    assert cfg.logger.log_dir == "runs/seed7"


def test_overrides_reach_every_file_of_the_chain(chain):
    cfg = load_config(chain, ["grpo.num_prompts_per_step=4", "++grpo.seed=3"])
    assert cfg.policy.train_global_batch_size == 8
    assert cfg.logger.log_dir == "runs/seed3"


def test_override_marker_replaces_a_block_instead_of_merging(tmp_path):
    write(tmp_path / "parent.yaml", "policy:\n  optimizer: {lr: 0.1, weight_decay: 0.5}\n")
    child = write(
        tmp_path / "child.yaml",
        "defaults: parent.yaml\npolicy:\n  optimizer:\n    _override_: true\n    lr: 0.2\n",
    )
    optimizer = load_config(child).policy.optimizer
    assert (optimizer.lr, optimizer.weight_decay) == (0.2, 0.0)


def test_a_missing_parent_names_both_files(tmp_path):
    child = write(tmp_path / "child.yaml", "defaults: nope/parent.yaml\n")
    (message,) = problems(child)
    assert message.startswith(f"{child}: defaults: {tmp_path / 'nope' / 'parent.yaml'} not found")


def test_an_inheritance_cycle_prints_the_chain(tmp_path):
    write(tmp_path / "a.yaml", "defaults: b.yaml\n")
    write(tmp_path / "b.yaml", "defaults: [a.yaml]\n")
    (message,) = problems(tmp_path / "a.yaml")
    assert "inheritance cycle" in message
    assert str(tmp_path / "a.yaml") in message and str(tmp_path / "b.yaml") in message


def test_defaults_must_name_files(tmp_path):
    (message,) = problems(write(tmp_path / "c.yaml", "defaults: {a: 1}\n"))
    assert "defaults: must be a file name or a list of file names" in message


def test_an_unresolvable_resolver_is_an_error_never_a_literal(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        """
        grpo: {}
        policy:
          train_global_batch_size: ${mul:${grpo.num_prompts_per_stp}, 8}
          model_name: ${concat:a,b}
        logger:
          log_dir: runs/${div:1,0}
        """,
    )
    messages = problems(path)
    assert len(messages) == 3, messages
    by_path = {m.split(":", 1)[0]: m for m in messages}
    assert "grpo.num_prompts_per_stp" in by_path["policy.train_global_batch_size"]
    assert "did you mean grpo.num_prompts_per_step?" in by_path["policy.train_global_batch_size"]
    assert "unknown resolver 'concat'" in by_path["policy.model_name"]
    assert "division by zero" in by_path["logger.log_dir"]


def test_a_syntax_error_in_a_reference_names_its_dotpath(tmp_path):
    (message,) = problems(write(tmp_path / "c.yaml", "logger:\n  log_dir: runs/${oops\n"))
    assert message.startswith("logger.log_dir:") and "not a valid ${...} expression" in message


def test_a_mandatory_value_left_unset_is_reported(tmp_path):
    (message,) = problems(write(tmp_path / "c.yaml", "policy:\n  model_name: ???\n"))
    assert message.startswith("policy.model_name: mandatory value (???) not set")


def test_resolvers_take_several_arguments(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        """
        grpo: {num_prompts_per_step: 4}
        async_rl:
          max_buffered_rollouts: ${max:${grpo.num_prompts_per_step}, 9, 2}
          max_inflight_prompts: ${min:${add:1, 2, 3}, 10}
        """,
    )
    cfg = load_config(path)
    assert (cfg.async_rl.max_buffered_rollouts, cfg.async_rl.max_inflight_prompts) == (9, 6)


# --------------------------------------------------------------------------- overrides


def test_hydra_override_forms(tmp_path):
    path = write(tmp_path / "c.yaml", "grpo:\n  seed: 1\npolicy:\n  max_grad_norm: 0.5\n")
    cfg = load_config(
        path,
        [
            "+grpo.max_num_steps=7",  # add a key the file does not set
            "++grpo.seed=2",  # set whether or not it is there
            "~policy.max_grad_norm",  # delete: the default (1.0) applies again
            "loss_fn.entropy_coef=1e-3",  # Hydra reads 1e-3 as a float
        ],
    )
    assert (cfg.grpo.max_num_steps, cfg.grpo.seed) == (7, 2)
    assert cfg.policy.max_grad_norm == 1.0
    assert cfg.loss_fn.entropy_coef == 0.001


def test_inapplicable_overrides_are_all_refused(tmp_path):
    path = write(tmp_path / "c.yaml", "grpo:\n  seed: 1\n")
    messages = problems(path, ("+grpo.seed=2", "~grpo.max_num_steps", "~grpo.seed=5"))
    assert len(messages) == 3, messages
    assert messages[0].startswith("grpo.seed: already set to 1; +grpo.seed=2 only adds")
    assert "++grpo.seed=2" in messages[0]
    assert messages[1].startswith("grpo.max_num_steps: ~grpo.max_num_steps deletes nothing")
    assert messages[2].startswith("grpo.seed: ~grpo.seed=5 deletes only when the value is 5")


def test_the_sampler_can_be_switched_from_the_command_line(tmp_path):
    path = write(
        tmp_path / "c.yaml",
        "async_rl:\n  sampler:\n    name: in_order\n    max_lookahead_versions: 2\n",
    )
    # Clearing the old mode's knob with null ...
    cfg = load_config(
        path,
        [
            "async_rl.sampler.name=windowed",
            "async_rl.sampler.max_lookahead_versions=null",
            "+async_rl.sampler.max_staleness_versions=1",
        ],
    )
    assert isinstance(cfg.async_rl.sampler, WindowedSamplerConfig)
    assert cfg.async_rl.sampler.max_staleness_versions == 1
    # ... or deleting it.
    cfg = load_config(
        path, ["async_rl.sampler.name=windowed", "~async_rl.sampler.max_lookahead_versions"]
    )
    assert isinstance(cfg.async_rl.sampler, WindowedSamplerConfig)
    # Without either, the old knob is still refused: it would do nothing under windowed.
    (message,) = problems(path, ("async_rl.sampler.name=windowed",))
    assert message.startswith("async_rl.sampler.max_lookahead_versions: belongs to sampler")
    # And back: a bare in_order block means what no block means (lookahead 1).
    assert load_config(path, ["~async_rl.sampler.max_lookahead_versions"]).async_rl.sampler == (
        InOrderSamplerConfig(name="in_order", max_lookahead_versions=1)
    )


# --------------------------------------------------------------------------- suggestions


@pytest.mark.parametrize(
    ("key", "candidate", "typo"),
    [
        ("max_lookahed_versions", "max_lookahead_versions", True),
        ("num_prompts_per_stp", "num_prompts_per_step", True),
        ("maxlookahead_versions", "max_lookahead_versions", True),
        ("tensorbord", "tensorboard", True),
        # Real words that look alike are not typos of each other.
        ("top_k", "top_p", False),
        ("backoff_base_s", "backoff_max_s", False),
        ("logprob_batch_size", "train_global_batch_size", False),
    ],
)
def test_suggestions_are_for_typos_only(key, candidate, typo):
    assert is_typo_of(key, candidate) is typo


def test_an_unknown_key_that_is_no_typo_lists_the_valid_keys(tmp_path):
    path = write(tmp_path / "c.yaml", "policy:\n  generation:\n    top_q: 0.5\n")
    (message,) = problems(path)
    assert message.startswith("policy.generation.top_q: unknown key; valid keys here:")
    assert "did you mean" not in message
