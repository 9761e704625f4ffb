"""A config written the NeMo-RL way trains: inherited through defaults:, with W&B (offline) and
MLflow (local store) receiving the same per-step metrics as metrics.jsonl."""

from __future__ import annotations

import json
import textwrap

import pytest
from mlflow.tracking import MlflowClient

from tandemrl.config import check_config
from tandemrl.controller.run import run_training
from tandemrl.metrics.trackers import MLFLOW_DEFAULT_DB, MLFLOW_RUN_ID_FILE, WANDB_RUN_ID_FILE

pytestmark = pytest.mark.integration

# NeMo-RL's shape (written for this test): the exemplar a recipe inherits from.
PARENT = """
grpo:
  num_prompts_per_step: 4
  num_generations_per_prompt: 4
  max_num_epochs: 1
  max_num_steps: 1000
  val_period: 0
  reward_shaping: {enabled: false, overlong_buffer_length: 128}
  async_grpo: {enabled: false, max_trajectory_age_steps: 1}
loss_fn:
  reference_policy_kl_penalty: 0.0
  ratio_clip_c: null
  use_importance_sampling_correction: true
  truncated_importance_sampling_type: tis
  truncated_importance_sampling_ratio: 2.0
policy:
  model_name: tiny://qwen2-counting
  train_global_batch_size: ${mul:${grpo.num_prompts_per_step}, ${grpo.num_generations_per_prompt}}
  train_micro_batch_size: 8
  logprob_batch_size: ${.train_micro_batch_size}
  max_total_sequence_length: 32
  precision: float32
  dtensor_cfg: {enabled: true, tensor_parallel_size: 1, lora_cfg: {enabled: false}}
  megatron_cfg: {enabled: false, pipeline_model_parallel_size: 1}
  make_sequence_length_divisible_by: ${policy.dtensor_cfg.tensor_parallel_size}
  optimizer:
    name: torch.optim.AdamW
    kwargs: {lr: 3.0e-4, betas: [0.9, 0.99], weight_decay: 0.0, foreach: false}
  scheduler:
    - name: torch.optim.lr_scheduler.ConstantLR
      kwargs: {factor: 1.0, total_iters: 1000}
  generation:
    backend: torch
    max_new_tokens: 4
    temperature: 1.0
    top_k: null
    stop_token_ids: null
    vllm_cfg: {async_engine: true, precision: "${policy.precision}"}
    colocated: {enabled: false, resources: {gpus_per_node: null, num_nodes: null}}
data:
  dataset: builtin://counting
  num_prompts: 64
env:
  should_use_nemo_gym: false
logger:
  wandb_enabled: true
  mlflow_enabled: true
  tensorboard_enabled: false
  # offline in the config: the trackers run in the controller actor, whose Ray worker
  # process does not see an environment variable set after Ray started
  wandb: {project: nemo-shaped, name: run, mode: offline}
  mlflow: {experiment_name: nemo-shaped, run_name: run}
cluster: {gpus_per_node: 0, num_nodes: 1}
data_plane: {enabled: true, impl: transfer_queue, backend: local}
async_rl:
  sampler: {name: in_order, max_lookahead_versions: 1}
  rollout_failure: {max_infra_attempts_per_prompt: 3, backoff_base_s: 0.1, max_backoff_s: 1.0}
  stall_watchdog: {stall_timeout_s: 120.0, stall_action: warn}
"""


def test_a_nemo_rl_shaped_recipe_trains_and_reaches_the_trackers(ray_session, tmp_path):
    (tmp_path / "base").mkdir()
    (tmp_path / "base" / "exemplar.yaml").write_text(PARENT)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(
        textwrap.dedent(
            f"""
            defaults: base/exemplar.yaml
            grpo:
              max_num_steps: 3
            logger:
              log_dir: {tmp_path / "logs"}
              progress: false
              plot: false
            """
        )
    )
    report = check_config(recipe, ["policy.device=cpu"])
    assert report.errors == [], report.errors
    assert run_training(report.config) == 0

    log_dir = tmp_path / "logs"
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    assert (log_dir / WANDB_RUN_ID_FILE).is_file()
    assert list((log_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    client = MlflowClient(tracking_uri=f"sqlite:///{log_dir / MLFLOW_DEFAULT_DB}")
    run_id = (log_dir / MLFLOW_RUN_ID_FILE).read_text()
    history = client.get_metric_history(run_id, "reward_mean")
    assert sorted((m.step, m.value) for m in history) == [
        (row["step"], pytest.approx(row["reward_mean"])) for row in rows
    ]
    assert client.get_run(run_id).data.params["policy.optimizer.lr"] == "0.0003"
