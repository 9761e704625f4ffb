"""The exemplar configs in examples/configs: each validates, and each shows what it claims."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandemrl.config import (
    MasterConfig,
    load_config,
    validate_single_controller_config,
)
from tandemrl.controller.actor import run_text_codec
from tandemrl.models import load_tokenizer, resolve_model_path
from tandemrl.records import PromptItem
from tandemrl.samplers import required_buffer_capacity

CONFIGS = Path(__file__).resolve().parents[2] / "examples" / "configs"
EXEMPLARS = sorted(CONFIGS.glob("*.yaml"))


# Exemplars whose model folder exists only on the GPU box: validated with a tiny chat preset
# of the same chat format (SmolLM2's is ChatML) in its place.
MODEL_STAND_INS = {
    "grpo_smollm2_math_gpu": ("policy.model_name=tiny://qwen2.5",),
    "grpo_gpu_1x": ("policy.model_name=tiny://qwen2.5",),
}


def exemplar(name: str) -> MasterConfig:
    return load_config(CONFIGS / f"{name}.yaml", MODEL_STAND_INS.get(name, ()))


def test_the_expected_exemplars_exist():
    assert {path.stem for path in EXEMPLARS} >= {
        "grpo_tiny_cpu",
        "grpo_tiny_cpu_sync",
        "grpo_tiny_cpu_weight_fifo",
        "grpo_tiny_cpu_ready_first",
        "grpo_tiny_cpu_windowed",
        "grpo_tiny_cpu_colocated",
        "grpo_tiny_cpu_checkpointed",
        "ppo_tiny_cpu",
        "grpo_smollm2_math_gpu",
        "grpo_gpu_1x",
        "grpo_tiny_cpu_agent",
        "distill_tiny_cpu",
    }


@pytest.mark.parametrize("path", EXEMPLARS, ids=lambda path: path.stem)
def test_every_exemplar_validates_without_warnings(path):
    cfg = exemplar(path.stem)
    assert validate_single_controller_config(cfg) == []
    assert cfg.logger.log_dir == f"runs/{path.stem}"


def test_default_job_settings():
    cfg = exemplar("grpo_tiny_cpu")
    assert cfg.policy.model_name == "tiny://qwen2-counting"
    assert (cfg.data.dataset, cfg.env.name) == ("builtin://counting", "counting")
    generation = cfg.policy.generation
    assert (generation.backend, generation.colocated.enabled) == ("torch", False)
    assert (generation.max_new_tokens, generation.temperature) == (4, 1.0)
    assert (cfg.grpo.num_prompts_per_step, cfg.grpo.num_generations_per_prompt) == (16, 8)
    assert cfg.policy.train_global_batch_size == 128
    assert cfg.policy.train_micro_batch_size == 64
    assert cfg.policy.optimizer.lr == 3e-4
    assert cfg.policy.optimizer.betas == (0.9, 0.99)
    assert cfg.policy.max_grad_norm == 1.0
    assert cfg.loss_fn.entropy_coef == 0.005
    assert cfg.async_rl.sampler.name == "in_order"
    assert cfg.async_rl.sampler.max_lookahead_versions == 1
    assert cfg.loss_fn.use_importance_sampling_correction is True
    assert cfg.grpo.max_num_steps == 300
    assert cfg.checkpointing.enabled is False


def test_sync_exemplar_is_on_policy():
    sampler = exemplar("grpo_tiny_cpu_sync").async_rl.sampler
    assert (sampler.name, sampler.max_lookahead_versions) == ("in_order", 0)


@pytest.mark.parametrize("name", ["weight_fifo", "ready_first", "windowed"])
def test_streaming_exemplars_train_in_chunks(name):
    cfg = exemplar(f"grpo_tiny_cpu_{name}")
    assert cfg.async_rl.sampler.name == name
    assert cfg.async_rl.sampler.max_staleness_versions >= 1
    assert cfg.async_rl.min_groups_for_streaming_train < cfg.grpo.num_prompts_per_step


def test_windowed_exemplar_over_samples():
    cfg = exemplar("grpo_tiny_cpu_windowed")
    sampler = cfg.async_rl.sampler
    gated_capacity = cfg.grpo.num_prompts_per_step * (sampler.max_staleness_versions + 1)
    assert cfg.async_rl.max_buffered_rollouts > gated_capacity
    assert sampler.sample_freshest_first is True
    assert required_buffer_capacity(sampler, cfg.grpo.num_prompts_per_step) <= gated_capacity


def test_colocated_exemplar_trains_whole_steps():
    cfg = exemplar("grpo_tiny_cpu_colocated")
    assert cfg.policy.generation.colocated.enabled is True
    assert cfg.policy.generation.backend == "torch"
    assert cfg.async_rl.min_groups_for_streaming_train == cfg.grpo.num_prompts_per_step


def test_checkpointed_exemplar_takes_periodic_snapshots():
    cfg = exemplar("grpo_tiny_cpu_checkpointed")
    assert cfg.checkpointing.enabled and cfg.checkpointing.save_data_plane
    assert cfg.checkpointing.save_period == 1
    assert cfg.token_capture.enabled
    assert cfg.rollout_checkpointing.snapshot_attempt_interval_s is not None


def test_ppo_exemplar():
    cfg = exemplar("ppo_tiny_cpu")
    assert cfg.is_ppo and cfg.grpo is None
    assert cfg.value is not None and cfg.value_loss_fn is not None
    assert cfg.ppo.adv_estimator.name == "gae"
    assert cfg.policy.offload_optimizer_for_logprob is True
    assert cfg.async_rl.sampler.name == "in_order"
    assert cfg.async_rl.min_groups_for_streaming_train == cfg.ppo.num_prompts_per_step
    # critic_ppo_epochs: ${ppo.ppo_epochs} follows an override of ppo_epochs.
    overridden = load_config(CONFIGS / "ppo_tiny_cpu.yaml", ["ppo.ppo_epochs=3"])
    assert overridden.ppo.critic_ppo_epochs == 3


def test_smollm2_exemplar_trains_a_chat_model_on_one_gpu():
    cfg = load_config(CONFIGS / "grpo_smollm2_math_gpu.yaml")
    assert cfg.policy.model_name == "/tmp/smollm2"  # where smollm2_to_hf.py writes it
    assert (cfg.policy.device, cfg.policy.precision) == ("cuda", "auto")
    assert cfg.policy.generation.colocated.enabled and cfg.policy.generation.colocated.stand_down
    assert (cfg.data.dataset, cfg.data.prompt_format, cfg.env.name) == (
        "builtin://math",
        "chat",
        "math",
    )
    assert cfg.policy.generation.stop_strings == ["<|im_end|>"]
    assert cfg.checkpointing.enabled and cfg.checkpointing.checkpoint_dir.endswith(
        "grpo_smollm2_math_gpu"
    )
    # With a chat model in place the run stops at the end of the assistant's turn.
    stand_in = exemplar("grpo_smollm2_math_gpu")
    folder = resolve_model_path(stand_in.policy.model_name)
    codec = run_text_codec(stand_in, str(folder))
    assert load_tokenizer(folder).convert_tokens_to_ids("<|im_end|>") in codec.stop_token_ids
    assert codec.render_prompt is not None
    assert codec.render_prompt(PromptItem("p", 0, 0, "7*6=")).endswith("<|im_start|>assistant\n")


def test_the_one_gpu_exemplar_runs_the_measured_fastest_settings():
    cfg = exemplar("grpo_gpu_1x")
    colocated = cfg.policy.generation.colocated
    assert cfg.policy.device == "cuda" and cfg.policy.compile_layers
    assert (colocated.enabled, colocated.stand_down, colocated.mps) == (True, False, "auto")
    assert cfg.async_rl.sampler.name == "ready_first"
    assert cfg.loss_fn.use_importance_sampling_correction
    assert (cfg.data.prompt_format, cfg.env.name) == ("chat", "math")


def test_agent_exemplar_plays_the_counting_game_through_the_http_endpoint():
    cfg = exemplar("grpo_tiny_cpu_agent")
    from tandemrl.agents import agent_class
    from tandemrl.agents.counting_game import CountingGameAgent
    from tandemrl.agents.setup import uses_http

    assert cfg.env.name == "agent" and agent_class(cfg.env) is CountingGameAgent
    server = cfg.policy.generation.http_server
    assert server.enabled and (server.host, server.port) == ("127.0.0.1", 0) and uses_http(cfg)
    assert cfg.token_capture.enabled and cfg.token_capture.on_prefix_mismatch == "split"
    tokenizer = load_tokenizer(resolve_model_path(cfg.policy.model_name))
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": "583="}], add_generation_prompt=True, tokenize=False
    )
    assert len(tokenizer.encode(rendered, add_special_tokens=False)) == 7


def test_the_distillation_exemplar_says_how_to_train_its_teacher():
    cfg = exemplar("distill_tiny_cpu")
    assert cfg.on_policy_distillation is not None
    text = (CONFIGS / "distill_tiny_cpu.yaml").read_text()
    command = next(line for line in text.splitlines() if "grpo_tiny_cpu.yaml" in line)
    log_dir = command.split("logger.log_dir=")[1].split()[0]
    # the one command writes the teacher folder the exemplar reads (its final model)
    (teacher,) = cfg.on_policy_distillation.teachers
    assert teacher.model_name == f"{log_dir}/final_model" and teacher.default
    assert cfg.policy.model_name == "tiny://qwen2-counting"
