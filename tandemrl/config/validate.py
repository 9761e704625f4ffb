"""Cross-field rules of the single-controller config, checked before anything starts.

``validate_single_controller_config(cfg)`` runs every rule, collects every violation and
raises one ``ConfigError`` listing them all; each message names the dotpaths involved and
says what to change. Conditions that are legal but probably not what the user wants come
back as warnings. Types, ranges and unknown keys are checked by the pydantic models and the
loader; this module holds the rules that relate several fields (and the few value checks
the models leave open, such as rollout_checkpointing.restore_mode).

The rules follow the reference spec's "mandatory settings" and "known missing features"
sections, plus the limits of this project's backends (no Megatron, no Mooncake).
"""

from __future__ import annotations

from typing import Any

from tandemrl.config.errors import ConfigError
from tandemrl.config.models import CustomSamplerConfig, MasterConfig, TorchGenerationConfig
from tandemrl.config.weight_sync import facts_from_config, weight_sync_problems

# Data-plane backends whose rows can be saved to and loaded from a checkpoint directory.
NATIVE_SAVE_BACKENDS = ("local", "simple")
RESTORE_MODES = ("latest", "trainer_checkpoint")
SUPPORTED_GENERATION_BACKENDS = ("torch", "vllm", "fake")


def validate_single_controller_config(cfg: MasterConfig) -> list[str]:
    """Check every cross-field rule; return warnings, raise ConfigError listing all errors."""
    check = _Checker(cfg)
    check.run()
    if check.errors:
        raise ConfigError(check.errors)
    return check.warnings


class _Checker:
    """Runs the rule groups in order; each appends to ``errors`` / ``warnings``."""

    def __init__(self, cfg: MasterConfig) -> None:
        self.cfg = cfg
        self.errors: list[str] = []
        self.warnings: list[str] = []
        self.sampler = cfg.async_rl.sampler
        # The imported class of a custom sampler (None when it failed to import).
        self._custom_class: type | None = None
        # The built-in sampler the config describes (None: custom, or not built yet), asked
        # for its rules: capacity, gate, off-policy data.
        self._builtin: Any = None

    def error(self, message: str) -> None:
        self.errors.append(message)

    def warn(self, message: str) -> None:
        self.warnings.append(message)

    def run(self) -> None:
        self.check_custom_sampler_import()
        self.check_backends()
        self.check_sharded_trainer()
        self.check_actor_resources()
        self.check_data_plane()
        algo_name = self.check_algorithm_blocks()
        if algo_name is not None:
            self.check_algorithm(algo_name)
        self.check_failure_budgets()
        self.check_checkpointing()
        self.check_rollout_checkpointing()
        self.check_rollout_recovery()
        self.check_task()
        self.check_env()
        self.check_prompt_format()

    # ------------------------------------------------------------------ sampler class

    def check_custom_sampler_import(self) -> None:
        if not isinstance(self.sampler, CustomSamplerConfig):
            return
        # Imported lazily: the samplers package imports this config package.
        from tandemrl.samplers import SamplerConfigError, load_sampler_class

        try:
            self._custom_class = load_sampler_class(self.sampler.target)
        except SamplerConfigError as exc:
            message = str(exc)
            if not message.startswith("async_rl.sampler.target"):
                message = f"async_rl.sampler.target: {message}"
            self.error(message)

    def builtin_sampler(self, algo: str) -> Any:
        """The built-in sampler the config describes, to ask for its rules; None for custom."""
        if isinstance(self.sampler, CustomSamplerConfig):
            return None
        if self._builtin is None:
            from tandemrl.samplers import builtin_sampler

            ppo = self.cfg.ppo if algo == "ppo" else None
            self._builtin = builtin_sampler(
                self.sampler,
                groups_per_step=self.cfg.algorithm.num_prompts_per_step,
                policy_training_start_step=0 if ppo is None else ppo.policy_training_start_step,
            )
        return self._builtin

    @staticmethod
    def sampler_is_gated(builtin: Any) -> bool:
        """Whether a built-in sampler gates dispatch on the trainer version."""
        from tandemrl.samplers import GatedSampler

        return isinstance(builtin, GatedSampler)

    def sampler_declares(self, attribute: str) -> bool:
        """Whether the sampler class declares a capability (True); a custom class must set it."""
        if isinstance(self.sampler, CustomSamplerConfig):
            sampler_class = self._custom_class
        else:
            from tandemrl.samplers import BUILTIN_SAMPLERS

            sampler_class = BUILTIN_SAMPLERS[self.sampler.name]
        return sampler_class is not None and bool(getattr(sampler_class, attribute, False))

    # ------------------------------------------------------------------ backends

    def check_backends(self) -> None:
        policy = self.cfg.policy
        generation = policy.generation
        megatron_hint = (
            "Megatron is not available in TandemRL; use policy.dtensor_cfg (the PyTorch "
            "trainer) with policy.generation.backend: torch"
        )
        if generation.backend == "megatron":
            self.error(f"policy.generation.backend: 'megatron' is refused — {megatron_hint}")
        elif generation.backend not in SUPPORTED_GENERATION_BACKENDS:
            self.error(
                f"policy.generation.backend: {generation.backend!r} is not supported; use one "
                f"of {', '.join(SUPPORTED_GENERATION_BACKENDS)}"
            )
        if policy.megatron_cfg.enabled:
            self.error(f"policy.megatron_cfg.enabled: must be false — {megatron_hint}")
        if not policy.dtensor_cfg.enabled:
            self.error(
                "policy.dtensor_cfg.enabled: must be true — the PyTorch trainer is the only "
                "trainer TandemRL has"
            )
        self.errors.extend(weight_sync_problems(self.cfg, facts_from_config(self.cfg)))
        if generation.backend == "vllm":
            if not generation.vllm_cfg.async_engine:
                self.error(
                    "policy.generation.vllm_cfg.async_engine: must be true with backend vllm — "
                    "the rollout pump drives per-prompt requests through the async engine"
                )
            if generation.colocated.enabled:
                self.error(
                    "policy.generation.colocated.enabled: must be false with backend vllm — "
                    "colocated generation is only available with backend torch"
                )
        if generation.colocated.mps == "on" and (
            not generation.colocated.enabled or generation.colocated.stand_down
        ):
            self.error(
                "policy.generation.colocated.mps: on helps only an engine that decodes while "
                "the trainer runs on the same GPU; set policy.generation.colocated.enabled: "
                "true and stand_down: false, or mps: auto/off"
            )
        if not generation.colocated.stand_down and not generation.colocated.enabled:
            self.error(
                "policy.generation.colocated.stand_down: false applies to colocated generation "
                "only; set policy.generation.colocated.enabled: true (generation shares the "
                "trainer's devices) or leave stand_down at true"
            )
        if generation.backend != "torch" and generation.torch != TorchGenerationConfig():
            self.error(
                f"policy.generation.torch: set, but backend is {generation.backend!r} — these "
                "keys configure the torch engine only; remove them or use backend torch"
            )
        torch_cfg = generation.torch
        if torch_cfg.steps_per_launch > 1 and torch_cfg.cuda_graphs == "off":
            self.error(
                f"policy.generation.torch.steps_per_launch={torch_cfg.steps_per_launch}: only "
                "the static decode path launches several steps, and "
                "policy.generation.torch.cuda_graphs=off turns it off; set steps_per_launch: 1 "
                "or cuda_graphs: auto"
            )

    def check_sharded_trainer(self) -> None:
        """What a trainer of several ranks (FSDP2) cannot do yet; each names the key."""
        policy = self.cfg.policy
        ranks = policy.dtensor_cfg.data_parallel_size
        if ranks is None or ranks == 1:
            return
        where = f"with policy.dtensor_cfg.data_parallel_size={ranks}"
        if policy.generation.colocated.enabled:
            self.error(
                f"policy.generation.colocated.enabled: true is not supported {where} (the "
                "ranks' GPUs cannot all host the generation engine); set it to false, or "
                "data_parallel_size: 1"
            )
        if policy.compile_layers:
            self.error(
                f"policy.compile_layers: true is not supported {where} (FSDP2 wraps each "
                "layer itself); set it to false, or data_parallel_size: 1"
            )

    def check_actor_resources(self) -> None:
        roles = self.cfg.cluster.actor_resources.model_dump()
        roles["data_plane"] = self.cfg.data_plane.actor_resources
        for role, resources in roles.items():
            key = (
                "data_plane.actor_resources"
                if role == "data_plane"
                else f"cluster.actor_resources.{role}"
            )
            for name, amount in resources.items():
                if name in ("CPU", "GPU", "memory", "object_store_memory"):
                    self.error(
                        f"{key}.{name}: CPUs, GPUs and memory come from the placement "
                        "(tandemrl/controller/setup.py); list only custom resources here"
                    )
                elif amount <= 0:
                    self.error(f"{key}.{name}: {amount} must be positive")
        if self.cfg.data_plane.actor_resources and self.cfg.data_plane.backend != "simple":
            self.error(
                f"data_plane.actor_resources: applies to backend simple only (got "
                f"{self.cfg.data_plane.backend!r}); remove it or use backend simple"
            )

    def check_data_plane(self) -> None:
        data_plane = self.cfg.data_plane
        if not data_plane.enabled:
            self.error(
                "data_plane.enabled: must be true — the single-controller path moves every "
                "rollout through the data plane; set data_plane.enabled: true"
            )
        if data_plane.backend == "mooncake":
            self.error(
                "data_plane.backend: 'mooncake' is not available in TandemRL; use local "
                "(in-process, the default) or simple (TransferQueue storage)"
            )

    # ------------------------------------------------------------------ algorithm blocks

    def check_algorithm_blocks(self) -> str | None:
        """Exactly one of grpo:/ppo:; returns its name, or None when that rule failed."""
        cfg = self.cfg
        if cfg.grpo is not None and cfg.ppo is not None:
            self.error(
                "grpo, ppo: both blocks are present; they are mutually exclusive — keep grpo: "
                "for a GRPO run or ppo: for a PPO run and delete the other"
            )
            return None
        if cfg.grpo is None and cfg.ppo is None:
            self.error("grpo, ppo: neither block is present; add grpo: (GRPO) or ppo: (PPO)")
            return None
        return "ppo" if cfg.ppo is not None else "grpo"

    def check_algorithm(self, algo: str) -> None:
        """Rules that read the step settings of the one algorithm block."""
        self.check_legacy_and_epochs(algo)
        self.check_unsupported_features(algo)
        self.check_batch_sizes(algo)
        self.check_sequence_length()
        self.check_streaming(algo)
        self.check_buffer_and_inflight(algo)
        self.check_importance_sampling(algo)
        if algo == "ppo":
            self.check_ppo()
        else:
            for key in ("value", "value_loss_fn"):
                if getattr(self.cfg, key) is not None:
                    self.error(
                        f"{key}: only used by PPO; remove it from a GRPO config (or switch "
                        "grpo: to ppo:)"
                    )
        self.check_warmup_lookahead(algo)

    def check_legacy_and_epochs(self, algo: str) -> None:
        block = self.cfg.algorithm
        legacy_key = "async_ppo" if algo == "ppo" else "async_grpo"
        if getattr(block, legacy_key) is not None:
            self.error(
                f"{algo}.{legacy_key}: the legacy async block must be null — move its knobs to "
                f"async_rl.* (see docs/configuration.md, 'Porting a legacy async config') and "
                f"set {algo}.{legacy_key}: null"
            )
        if block.max_num_epochs <= 0:
            self.error(
                f"{algo}.max_num_epochs: must be positive (got {block.max_num_epochs}); there is "
                "no -1 'unbounded' convention here — a non-positive value would train zero "
                f"steps. Set a positive value and bound the run with {algo}.max_num_steps"
            )

    def check_unsupported_features(self, algo: str) -> None:
        block = self.cfg.algorithm
        for key in ("val_period", "val_at_start", "val_at_end"):
            value = getattr(block, key)
            if value if isinstance(value, bool) else value > 0:
                self.error(
                    f"{algo}.{key}: validation is not supported on the single-controller path; "
                    f"remove it (set {algo}.val_period: 0, val_at_start/val_at_end: false)"
                )
        for key in ("reward_shaping", "reward_scaling"):
            if getattr(block, key) is not None:
                self.error(
                    f"{algo}.{key}: not implemented on the single-controller path; remove it "
                    "(it would otherwise be silently skipped)"
                )
        if block.use_dynamic_sampling:
            self.error(
                f"{algo}.use_dynamic_sampling: not implemented on the single-controller path; "
                "set it to false"
            )

    def check_batch_sizes(self, algo: str) -> None:
        """One RL step trains on exactly one step's rollouts, in whole micro batches."""
        cfg = self.cfg
        n_prompts = cfg.algorithm.num_prompts_per_step
        n_generations = cfg.algorithm.num_generations_per_prompt
        step_rows = n_prompts * n_generations
        trainers: list[tuple[str, Any]] = [("policy", cfg.policy)]
        if cfg.value is not None:
            trainers.append(("value", cfg.value))
        for owner, trainer in trainers:
            global_batch = trainer.train_global_batch_size
            micro = trainer.train_micro_batch_size
            # A GRPO config's value block is refused on its own; its sizes do not matter.
            if (algo == "ppo" or owner == "policy") and global_batch != step_rows:
                self.error(
                    f"{owner}.train_global_batch_size: must equal {algo}.num_prompts_per_step x "
                    f"{algo}.num_generations_per_prompt = {n_prompts} x {n_generations} = "
                    f"{step_rows} (got {global_batch}); one RL step trains on one step's rollouts"
                )
            if micro > global_batch:
                self.error(
                    f"{owner}.train_micro_batch_size: {micro} is larger than "
                    f"{owner}.train_global_batch_size ({global_batch}); lower it"
                )
            elif global_batch % micro != 0:
                self.error(
                    f"{owner}.train_micro_batch_size: {micro} does not divide "
                    f"{owner}.train_global_batch_size ({global_batch}); pick a divisor"
                )

    def check_sequence_length(self) -> None:
        policy = self.cfg.policy
        new_tokens = policy.generation.max_new_tokens
        if new_tokens >= policy.max_total_sequence_length:
            self.error(
                f"policy.generation.max_new_tokens: {new_tokens} leaves no room for the prompt "
                f"in policy.max_total_sequence_length ({policy.max_total_sequence_length}); the "
                "trainer refuses a sequence longer than that (NeMo-RL's engines cut completions "
                "at the context length instead) — set max_new_tokens to "
                "max_total_sequence_length minus your longest prompt"
            )

    def check_streaming(self, algo: str) -> None:
        n_prompts = self.cfg.algorithm.num_prompts_per_step
        min_groups = self.cfg.async_rl.min_groups_for_streaming_train
        colocated = self.cfg.policy.generation.colocated
        if min_groups > n_prompts:
            self.error(
                f"async_rl.min_groups_for_streaming_train: {min_groups} is larger than "
                f"{algo}.num_prompts_per_step ({n_prompts}); a train chunk can never exceed a "
                f"step — set it to at most ${{{algo}.num_prompts_per_step}}"
            )
        elif colocated.enabled and colocated.stand_down and min_groups != n_prompts:
            self.error(
                f"async_rl.min_groups_for_streaming_train: must equal {algo}.num_prompts_per_step "
                f"({n_prompts}) when policy.generation.colocated.enabled is true (got "
                f"{min_groups}); the engine stands down for the whole train step, so the step "
                f"must be one full batch — set it to ${{{algo}.num_prompts_per_step}}, or let "
                "the engine decode through train steps with "
                "policy.generation.colocated.stand_down: false"
            )

    def check_buffer_and_inflight(self, algo: str) -> None:
        async_rl = self.cfg.async_rl
        sampler = self.sampler
        n_prompts = self.cfg.algorithm.num_prompts_per_step
        min_groups = async_rl.min_groups_for_streaming_train
        # A custom sampler is built, and asked, at setup (tandemrl.controller.build).
        builtin = self.builtin_sampler(algo)
        if builtin is not None:
            required = builtin.required_buffer_capacity(n_prompts)
            if async_rl.max_buffered_rollouts < required:
                self.error(
                    f"async_rl.max_buffered_rollouts: {async_rl.max_buffered_rollouts} is below "
                    f"the {sampler.name} sampler's required capacity {required} (from "
                    f"{algo}.num_prompts_per_step and async_rl.sampler; see "
                    "docs/configuration.md) — the rollout pump would deadlock; raise it to at "
                    f"least {required}"
                )
        if async_rl.max_inflight_prompts < 1:
            self.error("async_rl.max_inflight_prompts: must be at least 1")
        elif self.sampler_is_gated(builtin) and async_rl.max_inflight_prompts < min_groups:
            self.error(
                f"async_rl.max_inflight_prompts: {async_rl.max_inflight_prompts} is below "
                f"async_rl.min_groups_for_streaming_train ({min_groups}); under the gated "
                f"{sampler.name} sampler a train chunk could never be in flight at once — raise "
                f"max_inflight_prompts to at least {min_groups}"
            )

    def check_importance_sampling(self, algo: str) -> None:
        builtin = self.builtin_sampler(algo)
        if builtin is None:
            return
        knob = builtin.off_policy_reason()
        if knob is not None and not self.cfg.loss_fn.use_importance_sampling_correction:
            self.error(
                "loss_fn.use_importance_sampling_correction: must be true because the sampler "
                f"admits off-policy data ({knob}); set it to true, or make the sampler "
                "on-policy (in_order with max_lookahead_versions: 0)"
            )

    def check_ppo(self) -> None:
        cfg = self.cfg
        ppo = cfg.ppo
        assert ppo is not None  # check_algorithm_blocks chose ppo
        for key in ("value", "value_loss_fn"):
            if getattr(cfg, key) is None:
                self.error(f"{key}: required on a PPO run (the critic); add a {key}: block")
        if ppo.adv_estimator.name != "gae":
            self.error(
                f"ppo.adv_estimator.name: must be gae on a PPO run (got {ppo.adv_estimator.name!r})"
            )
        if not cfg.policy.offload_optimizer_for_logprob:
            self.error(
                "policy.offload_optimizer_for_logprob: must be true on a PPO run — it keeps the "
                "policy optimizer off the device while the critic runs"
            )
        if self.sampler.name != "in_order":
            self.error(
                f"async_rl.sampler.name: PPO supports only in_order (got {self.sampler.name!r})"
            )
        min_groups = cfg.async_rl.min_groups_for_streaming_train
        if min_groups != ppo.num_prompts_per_step:
            self.error(
                "async_rl.min_groups_for_streaming_train: must equal ppo.num_prompts_per_step "
                f"({ppo.num_prompts_per_step}) on a PPO run (got {min_groups}); the critic "
                "trains on the whole step, so splitting a step into chunks would multiply the "
                "optimizer updates — set it to ${ppo.num_prompts_per_step}"
            )
        failure = cfg.async_rl.rollout_failure
        for key in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
            value = getattr(failure, key)
            if value != 0:
                self.error(
                    f"async_rl.rollout_failure.{key}: must be 0 on a PPO run (got {value}); a "
                    "dropped prompt would shorten the step below value.train_global_batch_size"
                )
        self.errors.extend(
            ppo_epoch_problems(
                ppo_epochs=ppo.ppo_epochs,
                critic_ppo_epochs=ppo.critic_ppo_epochs,
                reuse_training_logprobs=cfg.loss_fn.reuse_training_logprobs,
            )
        )

    def check_warmup_lookahead(self, algo: str) -> None:
        sampler = self.sampler
        if sampler.name != "in_order" or sampler.warmup_lookahead_versions is None:
            return
        warmup = sampler.warmup_lookahead_versions
        ppo = self.cfg.ppo
        if algo != "ppo" or ppo is None or ppo.policy_training_start_step <= 0:
            self.error(
                "async_rl.sampler.warmup_lookahead_versions: only applies during PPO critic "
                "warm-up (ppo.policy_training_start_step > 0); remove it or set "
                "ppo.policy_training_start_step"
            )
        if warmup < sampler.max_lookahead_versions:
            self.error(
                f"async_rl.sampler.warmup_lookahead_versions: {warmup} is below "
                f"async_rl.sampler.max_lookahead_versions ({sampler.max_lookahead_versions}); "
                "the warm-up window may only be wider — raise it or remove it"
            )

    # ------------------------------------------------------------------ failure budgets

    def check_failure_budgets(self) -> None:
        failure = self.cfg.async_rl.rollout_failure
        if self.sampler.name not in ("in_order", "custom"):
            for key in ("max_skipped_prompts", "max_consecutive_dropped_prompts"):
                if getattr(failure, key) > 0:
                    self.error(
                        f"async_rl.rollout_failure.{key}: drop budgets need the in_order or a "
                        f"custom sampler (async_rl.sampler.name is {self.sampler.name!r}); set "
                        "it to 0 or change the sampler"
                    )
        if failure.on_dropped_prompt == "replace" and failure.replacement_reserve_size < 1:
            self.error(
                "async_rl.rollout_failure.replacement_reserve_size: must be at least 1 when "
                "async_rl.rollout_failure.on_dropped_prompt is replace"
            )

    # ------------------------------------------------------------------ checkpoints

    def check_checkpointing(self) -> None:
        cfg = self.cfg
        ckpt = cfg.checkpointing
        builtin = not isinstance(self.sampler, CustomSamplerConfig)
        if ckpt.enabled and builtin and not ckpt.save_data_plane:
            self.error(
                "checkpointing.save_data_plane: must be true when checkpointing.enabled is true "
                f"with the built-in {self.sampler.name} sampler, so completed unconsumed groups "
                "survive a restart"
            )
        if ckpt.save_data_plane:
            if cfg.data_plane.backend not in NATIVE_SAVE_BACKENDS:
                self.error(
                    "checkpointing.save_data_plane: needs a data_plane.backend with native "
                    f"save/load ({', '.join(NATIVE_SAVE_BACKENDS)}); got "
                    f"{cfg.data_plane.backend!r}"
                )
            if not ckpt.enabled:
                self.warn(
                    "checkpointing.save_data_plane: has no effect while checkpointing.enabled "
                    "is false"
                )
        if (
            ckpt.enabled
            and not builtin
            and self._custom_class is not None
            and not self.sampler_declares("supports_buffer_checkpoint")
        ):
            self.warn(
                f"async_rl.sampler.target: {self.sampler.target} does not declare "
                "supports_buffer_checkpoint = True; the data plane is checkpointed in shadow "
                "mode and completed buffered groups are NOT restored after a restart"
            )

    def check_rollout_checkpointing(self) -> None:
        cfg = self.cfg
        rc = cfg.rollout_checkpointing
        if rc.restore_mode not in RESTORE_MODES:
            self.error(
                f"rollout_checkpointing.restore_mode: {rc.restore_mode!r} is not one of "
                f"{', '.join(RESTORE_MODES)}"
            )
        if rc.keep_latest_k < 1:
            self.error(
                f"rollout_checkpointing.keep_latest_k: must be at least 1 (got {rc.keep_latest_k})"
            )
        for index, path in enumerate(rc.extra_fingerprint_excluded_paths):
            problem = _excluded_path_problem(path)
            if problem:
                self.error(
                    f"rollout_checkpointing.extra_fingerprint_excluded_paths[{index}]: {path!r} "
                    f"{problem}"
                )
        if rc.snapshot_attempt_interval_s is None:
            return
        need = "periodic rollout snapshots (rollout_checkpointing.snapshot_attempt_interval_s)"
        if not cfg.checkpointing.enabled:
            self.error(f"checkpointing.enabled: must be true for {need}")
        if not cfg.checkpointing.save_data_plane:
            self.error(f"checkpointing.save_data_plane: must be true for {need}")
        if cfg.data_plane.backend not in NATIVE_SAVE_BACKENDS:
            self.error(
                f"data_plane.backend: {need} need native save/load "
                f"({', '.join(NATIVE_SAVE_BACKENDS)}); got {cfg.data_plane.backend!r}"
            )
        if not cfg.token_capture.enabled:
            self.error(f"token_capture.enabled: must be true for {need}")
        if self.sampler.name == "custom" and self._custom_class is not None:
            missing = [
                attr
                for attr in ("supports_buffer_checkpoint", "supports_training_claims")
                if not self.sampler_declares(attr)
            ]
            if missing:
                self.error(
                    f"async_rl.sampler.target: {need} need a sampler declaring "
                    f"{' and '.join(f'{attr} = True' for attr in missing)}; "
                    f"{self.sampler.target} does not"
                )
        if cfg.checkpointing.save_period != 1:
            self.warn(
                f"checkpointing.save_period: {cfg.checkpointing.save_period} — a rollout "
                "snapshot after step N needs the trainer checkpoint of step N, so attempts are "
                "skipped between checkpoints; save_period: 1 gives continuous coverage"
            )

    def check_rollout_recovery(self) -> None:
        recovery = self.cfg.rollout_recovery
        non_default = []
        if recovery.default_granularity != "sibling":
            non_default.append("rollout_recovery.default_granularity")
        if recovery.task_source_granularity_overrides:
            non_default.append("rollout_recovery.task_source_granularity_overrides")
        if recovery.agent_granularity_overrides:
            non_default.append("rollout_recovery.agent_granularity_overrides")
        if non_default and not self.cfg.token_capture.enabled:
            self.error(
                f"token_capture.enabled: must be true for non-default recovery policies "
                f"({', '.join(non_default)}); enable token capture or remove them"
            )

    def check_task(self) -> None:
        """No silent substitution: a real model never trains on the toy task by omission."""
        cfg = self.cfg
        if cfg.data.dataset is not None:
            return
        model = cfg.policy.model_name
        if not model.startswith("tiny://"):
            self.error(
                f"data.dataset: not set, so policy.model_name {model!r} would train on the "
                "built-in counting task; set data.dataset to your JSONL file (with "
                "data.prompt_key, data.answer_key) and env.name to its environment, or write "
                "data.dataset: builtin://counting to train on the counting task on purpose"
            )
        elif cfg.env.name != "counting":
            self.error(
                f"data.dataset: not set while env.name is {cfg.env.name!r}; the default "
                "dataset is the counting task — set data.dataset (builtin://math for the "
                "bundled math prompts, or your JSONL file)"
            )

    def check_env(self) -> None:
        env = self.cfg.env
        if env.name == "custom" and not env.target:
            self.error("env.target: required when env.name is custom ('module:ClassName')")
        if env.name != "custom" and env.target:
            self.error(
                f"env.target: only used when env.name is custom (env.name is {env.name!r}); "
                "remove it"
            )
        if env.name != "custom" and env.python_path:
            self.error(
                f"env.python_path: only used when env.name is custom (env.name is {env.name!r}); "
                "remove it"
            )
        for index, entry in enumerate(env.python_path):
            if not entry.strip():
                self.error(f"env.python_path[{index}]: empty; give a directory")

    # ------------------------------------------------------------------ prompts

    def check_prompt_format(self) -> None:
        data, policy = self.cfg.data, self.cfg.policy
        if data.prompt_format != "chat":
            defaults = type(data)()
            for key in ("system_prompt", "messages_key"):
                # A value other than the default: a written-out default is no choice (the
                # printed config must load back).
                if getattr(data, key) != getattr(defaults, key):
                    self.error(
                        f"data.{key}: applies to data.prompt_format: chat only (it is "
                        f"{data.prompt_format!r}); set data.prompt_format: chat or remove it"
                    )
            return
        # Imported lazily: the data package imports this config package.
        from tandemrl.data.prompt_format import chat_template_problem

        problem = chat_template_problem(policy.model_name, policy.tokenizer.name)
        if problem == "":
            source = policy.tokenizer.name or policy.model_name
            self.warn(
                f"data.prompt_format: chat — the tokenizer folder {source!r} does not exist on "
                "this machine, so its chat template is checked only when the run starts"
            )
        elif problem is not None:
            self.error(problem)


def ppo_epoch_problems(
    *, ppo_epochs: int, critic_ppo_epochs: int, reuse_training_logprobs: bool
) -> list[str]:
    """The PPO epoch rules, one message per violation (validation reports them with the rest;
    ``PPOStepRunner`` refuses settings built without validation by the same rules)."""
    problems = [
        f"ppo.{key}: must be at least 1 (got {value})"
        for key, value in (("ppo_epochs", ppo_epochs), ("critic_ppo_epochs", critic_ppo_epochs))
        if value < 1
    ]
    if reuse_training_logprobs and ppo_epochs > 1:
        problems.append(
            f"loss_fn.reuse_training_logprobs: must be false with ppo.ppo_epochs > 1 (got "
            f"{ppo_epochs}); from the second epoch on the training forward runs on updated "
            "weights, so its logprobs are no longer the pre-step ones. Set it to false, or "
            "ppo.ppo_epochs to 1"
        )
    return problems


def _excluded_path_problem(path: Any) -> str:
    """Why a fingerprint-exclusion dotpath is malformed, or '' when it is fine."""
    if not isinstance(path, str) or not path:
        return "must be a non-empty dotpath"
    if path.strip() in ("*", "**"):
        return "would exclude the whole config; name at least one concrete key"
    segments = path.split(".")
    if any(segment == "" for segment in segments):
        return "has an empty segment (leading, trailing or doubled '.')"
    if any(("*" in segment and segment not in ("*", "**")) for segment in segments):
        return "mixes '*' with other characters in a segment; use '*' or '**' alone"
    if all(segment in ("*", "**") for segment in segments):
        return "is wildcards only; name at least one concrete key"
    return ""
