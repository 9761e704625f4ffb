"""A config written for NeMo-RL: one line per blocker, harmless keys accepted, names carried over.

The configs here are written for these tests in NeMo-RL's shape (blocks and key names of its
single-controller exemplars); none is a copy of NeMo-RL's files.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from tandemrl.cli import main
from tandemrl.config import check_config, load_config
from tandemrl.config.port import port_config

# A NeMo-RL-shaped base: the PyTorch trainer, disabled Megatron, disabled extras, logger
# switches, a scheduler list and optimizer kwargs, NeMo-RL's async_rl names.
BASE = """
grpo:
  num_prompts_per_step: 4
  num_generations_per_prompt: 2
  max_rollout_turns: 1
  max_num_epochs: 1
  max_num_steps: 3
  normalize_rewards: true
  use_leave_one_out_baseline: true
  val_period: 0
  val_at_start: false
  val_at_end: false
  max_val_samples: 256
  val_batch_size: 256
  seed: 42
  use_dynamic_sampling: false
  batch_multiplier: 1
  reward_shaping:
    enabled: false
    overlong_buffer_length: 128
    max_response_length: ${policy.max_total_sequence_length}
  reward_scaling: {enabled: false, source_min: 0.0}
  adv_estimator:
    name: grpo
    normalize_rewards: ${grpo.normalize_rewards}
    use_leave_one_out_baseline: ${grpo.use_leave_one_out_baseline}
    minus_baseline: true
  advantage_clip_low: null
  async_grpo: {enabled: false, max_trajectory_age_steps: 1}
reward_penalties: {penalize_empty_final_answer: false, token_ids: null}
loss_fn:
  reference_policy_kl_penalty: 0.0
  reference_policy_kl_type: k3
  ratio_clip_min: 0.2
  ratio_clip_max: 0.2
  ratio_clip_c: null
  use_importance_sampling_correction: true
  truncated_importance_sampling_type: tis
  truncated_importance_sampling_ratio: 2.0
  token_level_loss: true
  force_on_policy_ratio: false
  use_cispo: false
checkpointing:
  enabled: false
  checkpoint_dir: results/test
  metric_name: null
  save_period: 10
  model_save_format: safetensors
policy:
  model_name: tiny://qwen2-counting
  tokenizer: {name: "${policy.model_name}", chat_template_kwargs: null}
  train_global_batch_size: ${mul:${grpo.num_prompts_per_step}, ${grpo.num_generations_per_prompt}}
  train_micro_batch_size: 4
  logprob_batch_size: ${policy.train_micro_batch_size}
  max_total_sequence_length: 64
  precision: float32
  dtensor_cfg:
    _v2: true
    enabled: true
    cpu_offload: false
    tensor_parallel_size: 1
    context_parallel_size: 1
    lora_cfg: {enabled: false, dim: 8}
  megatron_cfg:
    enabled: false
    tensor_model_parallel_size: 1
    optimizer: {lr: 5.0e-6}
  dynamic_batching: {enabled: false, train_mb_tokens: 256}
  sequence_packing: {enabled: false, train_mb_tokens: 256}
  make_sequence_length_divisible_by: ${policy.dtensor_cfg.tensor_parallel_size}
  max_grad_norm: 1.0
  optimizer:
    name: torch.optim.AdamW
    kwargs: {lr: 1.0e-4, weight_decay: 0.01, betas: [0.9, 0.999], eps: 1e-8, foreach: false}
  scheduler:
    - name: torch.optim.lr_scheduler.LinearLR
      kwargs: {start_factor: 0.1, end_factor: 1.0, total_iters: 5}
    - name: torch.optim.lr_scheduler.ConstantLR
      kwargs: {factor: 1.0, total_iters: 1000}
    - milestones: [5]
  generation:
    backend: torch
    max_new_tokens: 4
    temperature: 1.0
    top_p: 1.0
    top_k: null
    val_temperature: ${.temperature}
    stop_token_ids: null
    stop_strings: null
    vllm_cfg: {async_engine: true, precision: "${policy.precision}", tensor_parallel_size: 1}
    vllm_kwargs: {}
    colocated:
      enabled: false
      resources: {gpus_per_node: null, num_nodes: null}
data:
  max_input_seq_length: ${policy.max_total_sequence_length}
  shuffle: true
  dataset: builtin://counting
env:
  should_use_nemo_gym: false
logger:
  log_dir: runs/test
  wandb_enabled: false
  tensorboard_enabled: false
  mlflow_enabled: false
  swanlab_enabled: false
  monitor_gpus: true
  wandb: {project: p, name: n}
  tensorboard: {}
  mlflow: {experiment_name: e, run_name: r, tracking_uri: "http://localhost:5000"}
  gpu_monitoring: {collection_interval: 10}
cluster: {gpus_per_node: 1, num_nodes: 1, master_port_range_low: 1400}
data_plane:
  enabled: true
  impl: transfer_queue
  backend: local
  storage_capacity: 1000
async_rl:
  sampler: {name: in_order, max_lookahead_versions: 1}
  min_groups_for_streaming_train: ${grpo.num_prompts_per_step}
  max_inflight_prompts: ${mul:${grpo.num_prompts_per_step}, 2}
  max_buffered_rollouts: 8
  diagnostics: false
  rollout_failure:
    max_infra_attempts_per_prompt: 5
    max_data_attempts_per_prompt: 2
    backoff_base_s: 1.0
    max_backoff_s: 30.0
    max_skipped_prompts: 0
    min_step_batch_fraction: 0.9
    on_dropped_prompt: shrink
    replacement_reserve_prompts: 1
    native: {generation_timeout_s: null, env_timeout_s: null}
    nemo_gym: {rollout_timeout_s: null, max_row_attempts: 3}
  stall_watchdog: {interval_s: 30.0, stall_timeout_s: 600.0, stall_action: warn}
  generation_fleet_health: {enabled: false, probe_interval_s: 5.0}
  generation_router: {enabled: false}
rollout_checkpointing: {interval_s: null, keep_latest_k: 2, restore_mode: latest}
token_capture: {enabled: false, staging_partition: rollout_staging}
rollout_recovery: {default_granularity: sibling, task_granularity_overrides: {}}
on_policy_distillation: null
"""


@pytest.fixture
def base(tmp_path: Path) -> Path:
    path = tmp_path / "nemo_base.yaml"
    path.write_text(BASE)
    return path


def child(tmp_path: Path, base: Path, text: str, name: str = "child.yaml") -> Path:
    path = tmp_path / name
    path.write_text(f"defaults: {base.name}\n" + textwrap.dedent(text))
    return path


def test_a_nemo_rl_shaped_config_with_harmless_keys_is_accepted(base):
    report = check_config(base)
    assert report.errors == [], report.errors
    cfg = report.config
    assert cfg.grpo.reward_shaping is None and cfg.grpo.reward_scaling is None
    assert cfg.grpo.async_grpo is None
    assert cfg.policy.generation.stop_token_ids == [] and cfg.policy.generation.stop_strings == []
    assert cfg.policy.train_global_batch_size == 8
    # Same-meaning keys are carried over, under TandemRL's names.
    assert cfg.policy.optimizer.model_dump() == {
        "name": "adamw",
        "lr": 1e-4,
        "betas": (0.9, 0.999),
        "eps": 1e-8,
        "weight_decay": 0.01,
    }
    scheduler = cfg.policy.scheduler
    assert (scheduler.name, scheduler.warmup_steps, scheduler.start_factor) == (
        "linear_warmup",
        5,
        0.1,
    )
    assert cfg.policy.sequence_packing == "off"
    assert cfg.loss_fn.importance_sampling.mode == "tis"
    assert cfg.loss_fn.importance_sampling.truncation == 2.0
    assert cfg.loss_fn.reuse_training_logprobs is False
    failure = cfg.async_rl.rollout_failure
    assert (failure.max_infra_retries, failure.max_data_retries) == (4, 1)
    assert (failure.backoff_initial_s, failure.backoff_max_s) == (1.0, 30.0)
    assert failure.replacement_reserve_size == 1
    assert (cfg.async_rl.stall_watchdog.timeout_s, cfg.async_rl.stall_watchdog.action) == (
        600.0,
        "warn",
    )
    assert cfg.logger.tensorboard is False
    assert (cfg.logger.wandb.enabled, cfg.logger.wandb.project, cfg.logger.wandb.name) == (
        False,
        "p",
        "n",
    )
    assert cfg.logger.mlflow.experiment_name == "e"
    # Each rename is said once.
    assert any(
        n.startswith("async_rl.rollout_failure.backoff_base_s: renamed to")
        for n in (report.notices)
    )
    assert any(
        n.startswith("logger.wandb_enabled: renamed to logger.wandb.enabled")
        for n in (report.notices)
    )


def test_megatron_is_one_line(tmp_path, base):
    path = child(
        tmp_path,
        base,
        "policy:\n  dtensor_cfg: {enabled: false}\n  megatron_cfg:\n"
        "    enabled: true\n    pipeline_model_parallel_size: 2\n    bogus_key: 1\n",
    )
    errors = check_config(path).errors
    assert errors == [
        "policy.megatron_cfg: not supported by TandemRL: the Megatron trainer; train with the "
        "PyTorch trainer: set policy.megatron_cfg.enabled: false and "
        "policy.dtensor_cfg.enabled: true"
    ]


@pytest.mark.parametrize(
    ("text", "dotpath", "what"),
    [
        (
            "policy:\n  dtensor_cfg: {tensor_parallel_size: 2}\n",
            "policy.dtensor_cfg.tensor_parallel_size",
            "tensor parallel size > 1",
        ),
        (
            "policy:\n  dtensor_cfg: {lora_cfg: {enabled: true, dim: 16}}\n",
            "policy.dtensor_cfg.lora_cfg",
            "LoRA",
        ),
        (
            "loss_fn:\n  reference_policy_kl_penalty: 0.01\n  use_kl_in_reward: true\n",
            "loss_fn.use_kl_in_reward",
            "folded into the reward",
        ),
        ("policy:\n  generation: {top_k: 50}\n", "policy.generation.top_k", "top-k"),
        (
            "grpo:\n  reward_shaping:\n    {enabled: true, alp_coef: 0.1, overlong_buffer_penalty: 1, overlong_buffer_length: 8}\n",
            "grpo.reward_shaping.alp_coef",
            "adaptive length penalty",
        ),
        ("data_plane:\n  backend: mooncake_cpu\n", "data_plane.backend", "mooncake_cpu"),
        (
            "policy:\n  scheduler:\n    - name: torch.optim.lr_scheduler.CosineAnnealingLR\n"
            "      kwargs: {T_max: 10}\n",
            "policy.scheduler",
            "CosineAnnealingLR",
        ),
    ],
)
def test_a_key_that_changes_training_and_cannot_be_honoured_is_refused(
    tmp_path, base, text, dotpath, what
):
    errors = check_config(child(tmp_path, base, text)).errors
    assert len(errors) == 1, errors
    assert errors[0].startswith(f"{dotpath}:") and what in errors[0]


def test_a_gym_config_ports_but_gym_sharded_across_nodes_is_refused(tmp_path, base):
    # NeMo-Gym itself carries over (docs/nemo_gym.md; tests/unit/test_nemo_gym_config.py);
    # its shards across nodes do not.
    text = (
        "env:\n  should_use_nemo_gym: true\n"
        "  nemo_gym: {config_paths: [a.yaml], shards: {math: {num_nodes: 2}}}\n"
    )
    errors = check_config(child(tmp_path, base, text)).errors
    assert (
        "env.nemo_gym.shards: not supported by TandemRL: NeMo-Gym sharded across nodes; run "
        "one Gym (no shards)"
    ) in errors, errors


def test_unknown_keys_and_cross_field_problems_come_in_one_pass(tmp_path, base):
    path = child(
        tmp_path,
        base,
        """
        policy:
          train_global_batch_size: 12
          not_a_key: 1
        loss_fn:
          use_importance_sampling_correction: false
        """,
    )
    errors = check_config(path).errors
    assert [e.split(":", 1)[0] for e in errors] == [
        "policy.not_a_key",
        "policy.train_global_batch_size",
        "loss_fn.use_importance_sampling_correction",
    ], errors


def test_a_cross_field_rule_about_a_value_left_out_is_not_shown(tmp_path, base):
    # grpo.num_prompts_per_step has the wrong type; the batch-size rule would judge its
    # default (16) instead, so only the type error is shown.
    path = child(tmp_path, base, "grpo:\n  num_prompts_per_step: many\n")
    errors = check_config(path).errors
    assert any(e.startswith("grpo.num_prompts_per_step:") for e in errors), errors
    assert all("grpo.num_prompts_per_step x" not in e for e in errors), errors


def test_a_real_model_with_the_counting_task_left_in_place_is_refused(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("grpo: {}\npolicy:\n  model_name: /models/Llama-3.1-8B-Instruct\n")
    (message,) = check_config(path).errors
    assert message.startswith("data.dataset: not set, so policy.model_name")
    assert "builtin://counting" in message
    # Written on purpose, the toy task is accepted.
    report = check_config(path, ["data.dataset=builtin://counting"])
    assert report.errors == []


def test_the_math_environment_needs_its_dataset_named(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("grpo: {}\nenv: {name: math}\n")
    (message,) = check_config(path).errors
    assert message.startswith("data.dataset: not set while env.name is 'math'")


def test_port_prints_a_config_that_loads_as_the_same_run_and_lists_what_it_left(tmp_path, base):
    path = child(
        tmp_path,
        base,
        """
        policy:
          megatron_cfg: {enabled: true, tensor_model_parallel_size: 2}
          frobnicate: 3
        grpo:
          max_num_epochs: -1
        logger:
          wandb_enabled: true
        """,
    )
    report = port_config(path)
    assert [r.split(":", 1)[0] for r in report.refused] == ["policy.megatron_cfg"]
    assert any(r.startswith("policy.frobnicate: unknown key") for r in report.remaining)
    assert any(r.startswith("grpo.max_num_epochs:") for r in report.remaining)
    assert any(c.startswith("logger.wandb_enabled: renamed") for c in report.changed)
    dropped = {entry.split(":", 1)[0] for entry in report.dropped}
    assert {"policy.dtensor_cfg._v2", "logger.gpu_monitoring", "grpo.max_val_samples"} <= dropped
    printed = yaml.safe_load(report.yaml_text)
    assert "defaults" not in printed and "megatron_cfg" not in printed["policy"]
    assert printed["logger"]["wandb"]["enabled"] is True
    # The printed config, once its refused and invalid parts are fixed, is the same run.
    fixed = tmp_path / "ported.yaml"
    printed["grpo"]["max_num_epochs"] = 1
    fixed.write_text(yaml.safe_dump(printed))
    original = load_config(
        path, ["~policy.megatron_cfg", "~policy.frobnicate", "grpo.max_num_epochs=1"]
    )
    assert load_config(fixed) == original


def test_port_command_writes_the_yaml_and_says_what_was_not_carried(tmp_path, base, capsys):
    assert main(["port", str(base)]) == 0
    out, err = capsys.readouterr()
    assert load_config(base) == load_config(_written(tmp_path, out))
    assert "the ported config is valid" in err
    assert "renamed or changed:" in err and "not carried over (harmless):" in err
    megatron = child(tmp_path, base, "policy:\n  megatron_cfg: {enabled: true}\n")
    target = tmp_path / "out.yaml"
    assert main(["port", str(megatron), "-o", str(target)]) == 2
    err = capsys.readouterr().err
    assert "refused (not supported by TandemRL; the run needs a change):" in err
    assert "policy.megatron_cfg" in err and target.is_file()


def _written(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "written.yaml"
    path.write_text(text)
    return path
