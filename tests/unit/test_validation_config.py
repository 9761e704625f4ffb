"""Validation keys: refused combinations name their dotpath; NeMo-RL's keys carry over."""

from __future__ import annotations

import textwrap

import pytest

from tandemrl.config import ConfigError, check_config, load_config
from tandemrl.config.models import MasterConfig
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.data.dataset import DatasetError, load_validation_records

BASE = "examples/configs/grpo_tiny_cpu.yaml"
ON = ("grpo.val_period=10", "data.validation=builtin://math-heldout")


def problems(*overrides: str) -> list[str]:
    try:
        validate_single_controller_config(load_config(BASE, overrides))
    except ConfigError as exc:
        return exc.messages
    return []


def one(messages: list[str], *needles: str) -> str:
    found = [m for m in messages if all(n in m for n in needles)]
    assert len(found) == 1, (needles, messages)
    return found[0]


def test_validation_on_with_held_out_data_is_valid():
    cfg = load_config(BASE, (*ON, "grpo.val_at_start=true", "grpo.val_at_end=true"))
    assert validate_single_controller_config(cfg) == []
    assert cfg.validates and cfg.val_inflight_share == 8  # a quarter of 32


@pytest.mark.parametrize(
    ("overrides", "dotpath", "needle"),
    [
        (("grpo.val_period=5",), "data.validation:", "required by grpo.val_period"),
        (("grpo.val_at_end=true",), "data.validation:", "held-out prompts"),
        (("data.validation=builtin://math-heldout",), "data.validation:", "no validation pass"),
        ((*ON, "grpo.val_batch_size=32"), "grpo.val_batch_size:", "leave training no slot"),
        ((*ON, "grpo.val_num_generations=4"), "grpo.val_num_generations:", "pass@4"),
        (
            (*ON, "policy.generation.val_top_k=20", "policy.generation.val_temperature=0.7"),
            "policy.generation.val_top_k:",
            "top-k",
        ),
        (
            (*ON, "checkpointing.metric_name=val/reward_mean"),
            "checkpointing.metric_name:",
            "enabled",
        ),
        (
            (
                "checkpointing.enabled=true",
                "checkpointing.save_data_plane=true",
                "checkpointing.metric_name=val/reward_mean",
            ),
            "checkpointing.metric_name:",
            "no validation pass",
        ),
        (
            (
                *ON,
                "checkpointing.enabled=true",
                "checkpointing.save_data_plane=true",
                "checkpointing.metric_name=val/accuracy",
            ),
            "checkpointing.metric_name:",
            "not a validation metric",
        ),
    ],
)
def test_invalid_combinations_are_refused_with_their_dotpath(overrides, dotpath, needle):
    message = one(problems(*overrides), needle)
    assert message.startswith(dotpath), message


def test_k_below_one_is_refused_by_the_schema_with_its_dotpath():
    with pytest.raises(ConfigError) as info:
        load_config(BASE, (*ON, "grpo.val_num_generations=0"))
    assert any(m.startswith("grpo.val_num_generations:") for m in info.value.messages)


def test_settings_that_need_no_top_k_are_accepted():
    for extra in (
        ("policy.generation.val_top_k=-1", "policy.generation.val_temperature=0.7"),
        ("policy.generation.val_top_k=1", "policy.generation.val_temperature=0.7"),
        ("policy.generation.val_top_k=50",),  # greedy: top-k changes nothing
        (
            "checkpointing.enabled=true",
            "checkpointing.save_data_plane=true",
            "checkpointing.metric_name=val/pass@1",
        ),
        (
            "checkpointing.enabled=true",
            "checkpointing.save_data_plane=true",
            "checkpointing.metric_name=val/arithmetic/reward_mean",
        ),
    ):
        assert problems(*ON, *extra) == [], extra


def test_the_validation_file_is_read_with_the_datasets_field_mapping(tmp_path):
    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text('{"q": "1+1=", "a": "2", "src": "add"}\n{"q": "2+2=", "a": "4"}\n')
    cfg = load_config(
        BASE,
        (
            "data.prompt_key=q",
            "data.answer_key=a",
            "data.task_source_key=src",
            f"data.validation={held_out}",
        ),
    ).data
    records = load_validation_records(cfg, max_samples=None)
    assert [(r.prompt, r.answer, r.task_source) for r in records] == [
        ("1+1=", "2", "add"),
        ("2+2=", "4", None),
    ]
    assert len(load_validation_records(cfg, max_samples=1)) == 1
    missing = cfg.model_copy(update={"validation": str(tmp_path / "nope.jsonl")})
    with pytest.raises(DatasetError, match=r"data\.validation="):
        load_validation_records(missing, max_samples=None)


NEMO_RL = """
grpo:
  num_prompts_per_step: 4
  num_generations_per_prompt: 2
  max_num_steps: 20
  val_period: 10
  val_at_start: true
  max_val_samples: 64
  num_val_samples_to_print: 4
policy:
  model_name: tiny://qwen2-counting
  train_global_batch_size: 8
  train_micro_batch_size: 8
  max_total_sequence_length: 64
  generation:
    backend: torch
    max_new_tokens: 4
    temperature: 1.0
    val_temperature: 0.0
data:
  train: {data_path: TRAIN, input_key: question, output_key: answer}
  validation: {data_path: VALID, input_key: question, output_key: answer}
env:
  math: {num_workers: 1}
checkpointing:
  enabled: true
  save_data_plane: true
  metric_name: "val:accuracy"
  higher_is_better: true
"""


def test_nemo_rl_validation_keys_carry_over(tmp_path):
    train, valid = tmp_path / "train.jsonl", tmp_path / "valid.jsonl"
    for path in (train, valid):
        path.write_text('{"question": "1+1=", "answer": "2"}\n')
    config = tmp_path / "nemo.yaml"
    config.write_text(
        textwrap.dedent(NEMO_RL).replace("TRAIN", str(train)).replace("VALID", str(valid))
    )
    report = check_config(config)
    assert report.valid, report.errors
    cfg: MasterConfig = report.config
    assert (cfg.grpo.val_period, cfg.grpo.val_at_start, cfg.grpo.max_val_samples) == (10, True, 64)
    assert cfg.data.validation == str(valid)
    assert cfg.policy.generation.val_temperature == 0.0
    assert cfg.checkpointing.metric_name == "val/reward_mean"
    assert any(
        n.startswith("checkpointing.metric_name: 'val:accuracy' carried over")
        for n in report.notices
    )
