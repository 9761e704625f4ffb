"""The rollout-compatibility identity of a config: fail-closed, with dotpath diffs.

Every config value is part of the identity unless ``BUILTIN_EXCLUDED_PATHS`` says it is
*operational*: it cannot change prompts, generation, rewards, lineage or the meaning of
persisted rollouts (logging, cluster placement, checkpoint location and cadence, run-length
bounds, runtime knobs of the transports and engines, and anything that looks like a
credential). ``ROLLOUT_SEMANTIC_PATHS`` names, next to it, everything else the schema holds.
The identity itself never reads that second list — a key in neither list is part of the
identity, so a block added later is safe by default — but
``tests/unit/test_fingerprint_classification.py`` walks the whole schema and fails on a key
in neither list, in both, or on an entry that matches no key: whoever adds a config key
decides, here, which list it belongs to.

``rollout_checkpointing.extra_fingerprint_excluded_paths`` adds dotpath patterns: ``*`` matches
one mapping key or list index, ``**`` any number of levels. The identity stored in a manifest
has credential-like values redacted, so a refused restart can list each changed dotpath with
its old and new value without leaking secrets.

A stored identity is compared with ``identity_changes``, after the *current* exclusions are
taken out of it: a checkpoint written before a key was listed as operational (or before a
restart added an extra exclusion) still restores when only that key differs.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

from tandemrl.config.models import MasterConfig
from tandemrl.config.redact import REDACTED, redact_value

__all__ = [
    "BUILTIN_EXCLUDED_PATHS",
    "REDACTED",
    "ROLLOUT_SEMANTIC_PATHS",
    "TEACHER_SET_PREFIX",
    "compatibility_identity",
    "diff_identities",
    "excluded_patterns",
    "fingerprint_digest",
    "identity_changes",
    "is_excluded",
]

# Operational dotpaths: they do not affect what a rollout is or how it is interpreted. A
# restart with only these changed resumes silently.
BUILTIN_EXCLUDED_PATHS: tuple[str, ...] = (
    "logger.**",
    "cluster.**",
    "checkpointing.checkpoint_dir",
    "checkpointing.save_period",
    "checkpointing.keep_top_k",
    "checkpointing.save_optimizer",
    "checkpointing.preemption_grace_s",
    "rollout_checkpointing.**",
    "data_plane.call_timeout_s",
    "data_plane.num_storage_units",
    "data_plane.actor_resources",
    # A sharded step is the one-process step (tests/unit/test_sharded_training.py), and a
    # sharded checkpoint restores at any size: the layout may change across restarts.
    "policy.dtensor_cfg.data_parallel_size",
    "policy.dtensor_cfg.timeout_s",
    "policy.dtensor_cfg.reshard_after_forward",
    "async_rl.stall_watchdog.**",
    "async_rl.rollout_failure.backoff_initial_s",
    "async_rl.rollout_failure.backoff_max_s",
    # run-length bounds
    "grpo.max_num_steps",
    "ppo.max_num_steps",
    "grpo.max_num_epochs",
    "ppo.max_num_epochs",
    # placement and engine/trainer performance knobs: the same rollouts, made elsewhere or
    # faster
    "policy.device",
    "policy.generation.num_workers",
    "policy.generation.max_batch_size",
    "policy.generation.colocated.**",
    "policy.generation.weight_sync",
    "policy.generation.weight_sync_timeout_s",
    "policy.generation.fake_latency",
    "policy.generation.torch.cuda_graphs",
    "policy.generation.torch.compile",
    "policy.generation.torch.kv_cache_memory_fraction",
    "policy.generation.torch.admission_batch",
    "policy.generation.torch.steps_per_launch",
    "policy.generation.vllm_cfg.async_engine",
    "policy.generation.vllm_cfg.enforce_eager",
    "policy.generation.vllm_cfg.gpu_memory_utilization",
    "policy.train_micro_batch_size",
    "policy.train_micro_batch_tokens",
    "policy.sequence_packing",
    "policy.compile_layers",
    "policy.offload_optimizer_for_logprob",
    "policy.dtensor_cfg.activation_checkpointing",
    "value.train_micro_batch_size",
    "env.python_path",  # where env.target is imported from, not what it computes
    # Where and how agents reach the policy, not what it generates or how it is trained.
    "policy.generation.http_server.enabled",
    "policy.generation.http_server.host",
    "policy.generation.http_server.port",
    "policy.generation.http_server.served_model_name",
    "policy.generation.http_server.max_request_bytes",
    "env.agent.client",
    # Which processes play the episodes (the agent is the same class with the same kwargs).
    "env.agent.workers",
    "env.agent.worker_num_cpus",
    # distillation: where and how fast teachers score, not what (the teacher set itself, its
    # models, precision and routes, stays in the identity)
    "on_policy_distillation.max_num_steps",
    "on_policy_distillation.max_num_epochs",
    "on_policy_distillation.teacher_scoring",
    "on_policy_distillation.teachers.*.num_workers",
    "on_policy_distillation.teachers.*.micro_batch_size",
    "on_policy_distillation.teachers.*.device",
    "on_policy_distillation.teachers.*.gpus_per_worker",
    "on_policy_distillation.teachers.*.colocated_with_trainer",
    # Validation passes never touch a rollout (no buffer slot, no ledger entry, no row): what
    # they evaluate and how often is operational. Their own checkpointed progress carries the
    # held-out prompts' fingerprint and k, and starts over when those change.
    "grpo.val_period",
    "grpo.val_at_start",
    "grpo.val_at_end",
    "grpo.max_val_samples",
    "grpo.val_batch_size",
    "grpo.val_num_generations",
    "ppo.val_period",
    "ppo.val_at_start",
    "ppo.val_at_end",
    "ppo.max_val_samples",
    "ppo.val_batch_size",
    "ppo.val_num_generations",
    "on_policy_distillation.val_period",
    "on_policy_distillation.val_at_start",
    "on_policy_distillation.val_at_end",
    "on_policy_distillation.max_val_samples",
    "on_policy_distillation.val_batch_size",
    "on_policy_distillation.val_num_generations",
    "data.validation",
    "policy.generation.val_temperature",
    "policy.generation.val_top_p",
    "policy.generation.val_top_k",
    "checkpointing.metric_name",
    "checkpointing.higher_is_better",
    # Where the NeMo-Gym venv and servers are and how long to wait for them to come up, not
    # which servers play an episode (env.nemo_gym.config_paths, overrides, routes do).
    "env.nemo_gym.venv",
    "env.nemo_gym.head_server",
    "env.nemo_gym.working_dir",
    "env.nemo_gym.startup_timeout_s",
    "env.nemo_gym.max_server_restarts",
)

# Everything else: what a prompt is, how it is generated and scored, and what the trainer
# does with a rollout. A change to one of these follows rollout_checkpointing.on_config_change
# at a restart. (Not read at run time: the identity is everything not operational.)
ROLLOUT_SEMANTIC_PATHS: tuple[str, ...] = (
    "policy.model_name",
    "policy.is_vlm",
    "policy.tokenizer.**",
    "policy.train_global_batch_size",
    "policy.max_total_sequence_length",
    "policy.precision",
    "policy.max_grad_norm",
    "policy.dtensor_cfg.enabled",
    "policy.megatron_cfg.**",
    "policy.optimizer.**",
    "policy.scheduler.**",
    "policy.generation.backend",
    "policy.generation.temperature",
    "policy.generation.top_p",
    "policy.generation.max_new_tokens",
    "policy.generation.stop_token_ids",
    "policy.generation.stop_strings",
    "policy.generation.torch.max_seq_len",
    "policy.generation.vllm_cfg.max_model_len",
    # grpo / ppo: the algorithm (both blocks share AlgorithmCommon's keys)
    "grpo.num_prompts_per_step",
    "grpo.num_generations_per_prompt",
    "grpo.seed",
    "grpo.reward_shaping",
    "grpo.reward_scaling",
    "grpo.use_dynamic_sampling",
    "grpo.dynamic_sampling_max_gen_batches",
    "grpo.overlong_filtering",
    "grpo.normalize_rewards",
    "grpo.use_leave_one_out_baseline",
    "grpo.async_grpo",
    "ppo.num_prompts_per_step",
    "ppo.num_generations_per_prompt",
    "ppo.seed",
    "ppo.reward_shaping",
    "ppo.reward_scaling",
    "ppo.use_dynamic_sampling",
    "ppo.dynamic_sampling_max_gen_batches",
    "ppo.overlong_filtering",
    "ppo.ppo_epochs",
    "ppo.critic_ppo_epochs",
    "ppo.policy_training_start_step",
    "ppo.warm_start_value_checkpoint",
    "ppo.adv_estimator.**",
    "ppo.async_ppo",
    # on_policy_distillation: the step keys (AlgorithmCommon), the loss and the teacher set
    "on_policy_distillation.num_prompts_per_step",
    "on_policy_distillation.num_generations_per_prompt",
    "on_policy_distillation.seed",
    "on_policy_distillation.reward_shaping",
    "on_policy_distillation.reward_scaling",
    "on_policy_distillation.use_dynamic_sampling",
    "on_policy_distillation.dynamic_sampling_max_gen_batches",
    "on_policy_distillation.overlong_filtering",
    "on_policy_distillation.kl_coef",
    "on_policy_distillation.reward_coef",
    "on_policy_distillation.log_ratio_clamp",
    "on_policy_distillation.normalize_rewards",
    "on_policy_distillation.use_leave_one_out_baseline",
    "on_policy_distillation.teachers.*.name",
    "on_policy_distillation.teachers.*.model_name",
    "on_policy_distillation.teachers.*.precision",
    "on_policy_distillation.teachers.*.task_sources",
    "on_policy_distillation.teachers.*.agent_refs",
    "on_policy_distillation.teachers.*.default",
    "value.model_name",
    "value.train_global_batch_size",
    "value.max_grad_norm",
    "value.optimizer.**",
    "value_loss_fn.**",
    "loss_fn.**",
    "async_rl.sampler.**",
    "async_rl.min_groups_for_streaming_train",
    "async_rl.max_buffered_rollouts",
    "async_rl.max_inflight_prompts",
    "async_rl.recompute_kv_cache_after_weight_updates",
    # the drain gate decides whether a completion may mix weight versions, and its deadline
    # which groups are generated again (like the per-request deadlines below)
    "async_rl.in_flight_weight_updates",
    "async_rl.drain_timeout_s",
    "async_rl.rollout_failure.max_infra_retries",
    "async_rl.rollout_failure.max_data_retries",
    "async_rl.rollout_failure.max_skipped_prompts",
    "async_rl.rollout_failure.max_consecutive_dropped_prompts",
    "async_rl.rollout_failure.on_dropped_prompt",
    "async_rl.rollout_failure.min_step_batch_fraction",
    "async_rl.rollout_failure.replacement_reserve_size",
    "async_rl.rollout_failure.generation_timeout_s",
    "async_rl.rollout_failure.rollout_timeout_s",
    "data_plane.enabled",
    "data_plane.backend",
    "checkpointing.enabled",
    "checkpointing.save_data_plane",
    "token_capture.**",
    "rollout_recovery.**",
    # data.validation is operational (above): held-out prompts never become rollouts.
    "data.dataset",
    "data.prompt_key",
    "data.answer_key",
    "data.task_source_key",
    "data.agent_ref_key",
    "data.num_prompts",
    "data.shuffle",
    "data.seed",
    "data.prompt_format",
    "data.system_prompt",
    "data.messages_key",
    "data.image_key",
    "data.max_image_pixels",
    "env.name",
    "env.target",
    "env.kwargs",
    # agents: the sampling a request may ask for, and the episodes' limits and deadlines
    "policy.generation.http_server.allow_sampling_overrides",
    "env.agent.max_turns",
    "env.agent.max_tokens_per_turn",
    "env.agent.max_tokens_per_episode",
    "env.agent.call_timeout_s",
    "env.agent.episode_timeout_s",
    # Which Gym servers play an episode and how long one may take.
    "env.nemo_gym.config_paths",
    "env.nemo_gym.overrides",
    "env.nemo_gym.model_server",
    "env.nemo_gym.default_agent",
    "env.nemo_gym.agent_routes",
    "env.nemo_gym.run_timeout_s",
)


# The dotpaths of the distillation teacher set: a restart whose teachers differ from the
# checkpoint's is refused whatever rollout_checkpointing.on_config_change says (the
# checkpoint's rows hold the old teachers' logprobs and teacher indices).
TEACHER_SET_PREFIX = "on_policy_distillation.teachers"


def _segments(pattern: str) -> list[str]:
    return pattern.split(".")


def _match(pattern: list[str], path: list[str]) -> bool:
    """Does ``pattern`` match ``path`` or a prefix of it (a match removes the whole subtree)?"""
    if not pattern:
        return True  # matched a prefix: the subtree below goes with it
    head, rest = pattern[0], pattern[1:]
    if head == "**":
        return any(_match(rest, path[i:]) for i in range(len(path) + 1))
    if not path:
        return False
    if head == "*" or head == path[0]:
        return _match(rest, path[1:])
    return False


def is_excluded(path: list[str], patterns: list[list[str]]) -> bool:
    return any(_match(pattern, path) for pattern in patterns)


def _flatten(value: Any, prefix: list[str], out: dict[str, Any], patterns: list[list[str]]) -> None:
    if is_excluded(prefix, patterns) and prefix:
        return
    if isinstance(value, dict):
        if not value and prefix:
            out[".".join(prefix)] = {}
        for key in sorted(value):
            _flatten(value[key], [*prefix, str(key)], out, patterns)
    elif isinstance(value, list | tuple):
        if not value and prefix:
            out[".".join(prefix)] = []
        for index, item in enumerate(value):
            _flatten(item, [*prefix, str(index)], out, patterns)
    else:
        out[".".join(prefix)] = value


def excluded_patterns(cfg: MasterConfig) -> list[str]:
    """The built-in operational dotpaths plus the config's extra exclusions."""
    return [*BUILTIN_EXCLUDED_PATHS, *cfg.rollout_checkpointing.extra_fingerprint_excluded_paths]


def compatibility_identity(
    cfg: MasterConfig, extra_excluded: list[str] | None = None
) -> dict[str, Any]:
    """Flat {dotpath: value} of everything that defines rollout compatibility (redacted)."""
    extra = (
        extra_excluded
        if extra_excluded is not None
        else cfg.rollout_checkpointing.extra_fingerprint_excluded_paths
    )
    patterns = [_segments(p) for p in (*BUILTIN_EXCLUDED_PATHS, *extra)]
    flat: dict[str, Any] = {}
    _flatten(cfg.model_dump(mode="json", by_alias=True), [], flat, patterns)
    return {path: redact_value(path, value) for path, value in flat.items()}


def fingerprint_digest(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def diff_identities(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """One line per changed dotpath: ``path: old -> new`` (``<absent>`` for added/removed)."""
    lines = []
    for path in sorted(set(old) | set(new)):
        before, after = old.get(path, "<absent>"), new.get(path, "<absent>")
        if before != after:
            lines.append(
                f"{path}: {json.dumps(before, default=str)} -> {json.dumps(after, default=str)}"
            )
    return lines


def identity_changes(
    stored: dict[str, Any], current: dict[str, Any], excluded: Iterable[str]
) -> list[str]:
    """``diff_identities`` of a stored identity against the current one, after the current
    exclusions (``excluded_patterns``) are taken out of the stored one too."""
    patterns = [_segments(pattern) for pattern in excluded]
    kept = {
        path: value for path, value in stored.items() if not is_excluded(path.split("."), patterns)
    }
    return diff_identities(kept, current)
