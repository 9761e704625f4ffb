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
from tandemrl.config.vision_rules import vision_problems
from tandemrl.config.weight_sync import facts_from_config, weight_sync_problems

# Data-plane backends whose rows can be saved to and loaded from a checkpoint directory.
NATIVE_SAVE_BACKENDS = ("local", "simple")
RESTORE_MODES = ("latest", "trainer_checkpoint")
SUPPORTED_GENERATION_BACKENDS = ("torch", "vllm", "fake")
ALGORITHM_BLOCKS = ("grpo", "ppo", "on_policy_distillation")


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
        self.check_drain_gate()
        self.check_checkpointing()
        self.check_rollout_checkpointing()
        self.check_rollout_recovery()
        self.check_task()
        self.check_env()
        self.check_agents()
        self.check_nemo_gym()
        self.check_prompt_format()
        self.errors.extend(vision_problems(self.cfg))

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
        if policy.is_vlm:
            self.error(
                f"policy.is_vlm: true is not supported {where} (the ranks shard the decoder "
                "layers, not a vision tower); set data_parallel_size: 1"
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
        """Exactly one of grpo:/ppo:/on_policy_distillation:; returns its name, or None when
        that rule failed."""
        present = [key for key in ALGORITHM_BLOCKS if getattr(self.cfg, key) is not None]
        if len(present) > 1:
            self.error(
                f"{', '.join(present)}: {len(present)} algorithm blocks are present; they are "
                "mutually exclusive — keep grpo: (GRPO), ppo: (PPO) or on_policy_distillation: "
                "(a student trained toward teachers) and delete the others"
            )
            return None
        if not present:
            self.error(
                "grpo, ppo, on_policy_distillation: neither algorithm block is present; add grpo: "
                "(GRPO), ppo: (PPO) or on_policy_distillation: (docs/distillation.md)"
            )
            return None
        return present[0]

    def check_algorithm(self, algo: str) -> None:
        """Rules that read the step settings of the one algorithm block."""
        self.check_legacy_and_epochs(algo)
        self.check_unsupported_features(algo)
        self.check_batch_sizes(algo)
        self.check_sequence_length()
        self.check_streaming(algo)
        self.check_buffer_and_inflight(algo)
        self.check_importance_sampling(algo)
        self.check_over_sampling(algo)
        self.check_loss()
        if algo == "ppo":
            self.check_ppo()
        else:
            for key in ("value", "value_loss_fn"):
                if getattr(self.cfg, key) is not None:
                    self.error(
                        f"{key}: only used by PPO; remove it from a {algo} config (or switch "
                        f"{algo}: to ppo:)"
                    )
        if algo == "on_policy_distillation":
            self.check_distillation()
        self.check_warmup_lookahead(algo)
        self.check_validation(algo)

    def check_legacy_and_epochs(self, algo: str) -> None:
        block = self.cfg.algorithm
        legacy_key = {"ppo": "async_ppo", "grpo": "async_grpo"}.get(algo)
        if legacy_key is not None and getattr(block, legacy_key) is not None:
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
        self.check_rewards(algo)
        self.check_dynamic_sampling(algo)

    def check_rewards(self, algo: str) -> None:
        """reward_scaling and reward_shaping (``tandemrl.training.rewards``)."""
        block = self.cfg.algorithm
        scaling = block.reward_scaling
        if scaling is not None and not scaling.enabled and scaling != type(scaling)():
            self.error(
                f"{algo}.reward_scaling: its ranges are set but enabled is false, so they do "
                f"nothing; set {algo}.reward_scaling.enabled: true or remove the block"
            )
        elif scaling is not None and scaling.enabled:
            for low, high in (("source_min", "source_max"), ("target_min", "target_max")):
                if getattr(scaling, low) >= getattr(scaling, high):
                    self.error(
                        f"{algo}.reward_scaling.{low}: {getattr(scaling, low)} must be below "
                        f"{algo}.reward_scaling.{high} ({getattr(scaling, high)})"
                    )
        shaping = block.reward_shaping
        if shaping is None:
            return
        where = f"{algo}.reward_shaping"
        overlong_keys = ("overlong_buffer_length", "overlong_buffer_penalty", "max_response_length")
        if not shaping.enabled:
            if shaping != type(shaping)():
                self.error(
                    f"{where}: its penalties are set but enabled is false, so they do nothing; "
                    f"set {where}.enabled: true or remove the block"
                )
            return
        if shaping.stop_properly_penalty_coef is not None:
            for key in overlong_keys:
                if getattr(shaping, key) is not None:
                    self.error(
                        f"{where}.{key}: the overlong penalty and "
                        f"{where}.stop_properly_penalty_coef exclude each other (with the "
                        "coefficient set, this key would be ignored); keep one of them"
                    )
            return
        missing = [key for key in overlong_keys if getattr(shaping, key) is None]
        for key in missing:
            self.error(
                f"{where}.{key}: required by the overlong penalty (enabled: true); set "
                f"overlong_buffer_length, overlong_buffer_penalty and max_response_length, or "
                f"{where}.stop_properly_penalty_coef instead"
            )
        if missing:
            return
        buffer, longest = shaping.overlong_buffer_length, shaping.max_response_length
        assert buffer is not None and longest is not None
        if buffer > longest:
            self.error(
                f"{where}.overlong_buffer_length: {buffer} is longer than "
                f"{where}.max_response_length ({longest}); the penalty starts at "
                "max_response_length - overlong_buffer_length tokens, which must be >= 0"
            )
        new_tokens = self.cfg.policy.generation.max_new_tokens
        if longest - buffer >= new_tokens:
            self.warn(
                f"{where}: the penalty starts above {longest - buffer} tokens "
                f"(max_response_length - overlong_buffer_length), but no completion is longer "
                f"than policy.generation.max_new_tokens ({new_tokens}): it never applies"
            )

    def check_dynamic_sampling(self, algo: str) -> None:
        block = self.cfg.algorithm
        default_cap = type(block).model_fields["dynamic_sampling_max_gen_batches"].default
        if not block.use_dynamic_sampling:
            if block.dynamic_sampling_max_gen_batches != default_cap:
                self.error(
                    f"{algo}.dynamic_sampling_max_gen_batches: does nothing while "
                    f"{algo}.use_dynamic_sampling is false; set use_dynamic_sampling: true or "
                    "remove it"
                )
            return
        if algo == "on_policy_distillation":
            self.error(
                "on_policy_distillation.use_dynamic_sampling: GRPO only — a distillation "
                "group's advantage is the per-token KL to its teacher, which is not 0 when its "
                "rewards are all equal; set it to false"
            )
        if algo == "ppo":
            self.error(
                "ppo.use_dynamic_sampling: GRPO only — it drops groups whose rewards are all "
                "equal because their group-baseline advantage is 0, which GAE's is not; set it "
                "to false"
            )
        if block.num_generations_per_prompt < 2:
            self.error(
                f"{algo}.use_dynamic_sampling: needs {algo}.num_generations_per_prompt >= 2 "
                f"(got {block.num_generations_per_prompt}); a group of one always has "
                "advantage 0, so every group would be dropped"
            )
        if isinstance(self.sampler, CustomSamplerConfig):
            self.error(
                f"{algo}.use_dynamic_sampling: needs a built-in sampler (async_rl.sampler.name "
                "is custom): a dropped group is replaced through the built-in samplers' "
                "replacement credits"
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

    def check_loss(self) -> None:
        """The clip range and the reference-policy KL penalty (``tandemrl.training.losses``)."""
        loss = self.cfg.loss_fn
        if loss.ratio_clip_min >= 1.0:
            self.error(
                f"loss_fn.ratio_clip_min: {loss.ratio_clip_min} puts the lower clip bound "
                f"1 - ratio_clip_min at or below 0, where no ratio can fall; use a value below "
                "1 (the bounds are [1 - ratio_clip_min, 1 + ratio_clip_max]; they may differ)"
            )
        if loss.reference_policy_kl_penalty == 0:
            defaults = type(loss)()
            for key in (
                "reference_policy_kl_type",
                "kl_input_clamp_value",
                "kl_output_clamp_value",
            ):
                if getattr(loss, key) != getattr(defaults, key):
                    self.error(
                        f"loss_fn.{key}: {getattr(loss, key)!r} does nothing while "
                        "loss_fn.reference_policy_kl_penalty is 0; set the penalty (> 0) or "
                        "remove it"
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
        # Any sampler and any chunking: the critic streams its first epoch over the chunks and
        # every epoch is one optimizer step normalised by the rows the step holds, so a step
        # shortened by a drop trains correctly too (tandemrl/controller/ppo_step.py).
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

    # ------------------------------------------------------------------ distillation

    def check_distillation(self) -> None:
        """Teachers, their routes and the loss of an on_policy_distillation run."""
        from tandemrl.config.distillation import distillation_problems

        self.errors.extend(distillation_problems(self.cfg))

    # ------------------------------------------------------------------ validation

    def check_validation(self, algo: str) -> None:
        """Validation passes: held-out data, a share of the in-flight budget, sampling the
        engines support, a best-checkpoint metric a pass reports."""
        cfg = self.cfg
        block = cfg.algorithm
        generation = cfg.policy.generation
        if not cfg.validates:
            if cfg.data.validation is not None:
                self.error(
                    f"data.validation: set, but no validation pass is scheduled ({algo}."
                    f"val_period: 0, val_at_start and val_at_end false); set {algo}.val_period "
                    "(or val_at_start/val_at_end), or remove data.validation"
                )
            for key, default in (
                ("max_val_samples", None),
                ("val_batch_size", None),
                ("val_num_generations", 1),
            ):
                if getattr(block, key) != default:
                    self.warn(f"{algo}.{key}: has no effect while no validation pass is scheduled")
            self.check_best_checkpoint_metric(algo)
            return
        if cfg.data.validation is None:
            keys = [
                key for key in ("val_period", "val_at_start", "val_at_end") if getattr(block, key)
            ]
            self.error(
                f"data.validation: required by {', '.join(f'{algo}.{k}' for k in keys)} — a "
                "validation pass needs held-out prompts; set data.validation to a JSONL file "
                "(read with data.prompt_key/answer_key) or a builtin:// dataset, or set "
                f"{algo}.val_period: 0 and val_at_start/val_at_end: false"
            )
        share, budget = cfg.val_inflight_share, cfg.async_rl.max_inflight_prompts
        if share >= budget:
            self.error(
                f"{algo}.val_batch_size: {share} validation prompts in flight would leave "
                f"training no slot of async_rl.max_inflight_prompts ({budget}); set it below "
                f"{budget} (the default is a quarter of max_inflight_prompts)"
            )
        top_k = generation.val_top_k
        # Greedy (temperature 0, or top-1) needs no top-k sampling.
        greedy = generation.val_temperature == 0 or top_k == 1
        if top_k is not None and top_k > 1 and not greedy:
            self.error(
                f"policy.generation.val_top_k: {top_k} needs top-k sampling, which TandemRL's "
                "engines do not support; set it to null (or -1), use val_top_p, or sample "
                "greedily (val_temperature: 0)"
            )
        k = block.val_num_generations
        if k > 1 and greedy:
            self.error(
                f"{algo}.val_num_generations: {k} greedy completions of one prompt are all the "
                f"same (val_temperature 0 or val_top_k 1 is greedy), so pass@{k} would equal "
                "pass@1; set policy.generation.val_temperature above 0 to sample them, or "
                f"{algo}.val_num_generations: 1"
            )
        self.check_best_checkpoint_metric(algo)

    def check_best_checkpoint_metric(self, algo: str) -> None:
        ckpt = self.cfg.checkpointing
        name = ckpt.metric_name
        if name is None:
            return
        if not ckpt.enabled:
            self.error(
                f"checkpointing.metric_name: {name!r} ranks trainer checkpoints, but "
                "checkpointing.enabled is false; enable checkpointing or remove metric_name"
            )
        if not self.cfg.validates:
            self.error(
                f"checkpointing.metric_name: {name!r} is a validation metric, and no validation "
                f"pass is scheduled; set {algo}.val_period (and data.validation), or remove "
                "metric_name"
            )
            return
        from tandemrl.rollout.validation_state import metric_name_problem

        problem = metric_name_problem(name, k=self.cfg.algorithm.val_num_generations)
        if problem is not None:
            self.error(f"checkpointing.metric_name: {problem}")
        period, save_period = self.cfg.algorithm.val_period, ckpt.save_period
        if ckpt.enabled and period and period % save_period:
            self.warn(
                f"checkpointing.metric_name: {algo}.val_period {period} is not a multiple of "
                f"checkpointing.save_period {save_period}, so some validated versions have no "
                "trainer checkpoint to keep; make val_period a multiple of save_period"
            )

    # ------------------------------------------------------------------ failure budgets

    def check_over_sampling(self, algo: str) -> None:
        builtin = self.builtin_sampler(algo)
        limit = getattr(builtin, "dispatch_limit", lambda: None)()
        buffered = self.cfg.async_rl.max_buffered_rollouts
        if limit is not None and buffered < limit:
            self.warn(
                f"async_rl.sampler.over_sampling_ratio: dispatch is capped at {limit} in-window "
                f"groups, but async_rl.max_buffered_rollouts ({buffered}) holds fewer, so the "
                f"buffer caps it first; raise max_buffered_rollouts to {limit} or lower the ratio"
            )

    def check_drain_gate(self) -> None:
        async_rl = self.cfg.async_rl
        default = type(async_rl).model_fields["drain_timeout_s"].default
        if async_rl.in_flight_weight_updates and async_rl.drain_timeout_s != default:
            self.error(
                f"async_rl.drain_timeout_s: {async_rl.drain_timeout_s} applies only to the "
                "drain gate; set async_rl.in_flight_weight_updates: false or remove it"
            )

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
        takes_target = env.name in ("custom", "agent")
        if takes_target and not env.target:
            self.error(f"env.target: required when env.name is {env.name} ('module:ClassName')")
        if not takes_target and env.target:
            self.error(
                f"env.target: only used when env.name is custom or agent (env.name is "
                f"{env.name!r}); remove it"
            )
        if not takes_target and env.python_path:
            self.error(
                f"env.python_path: only used when env.name is custom or agent (env.name is "
                f"{env.name!r}); remove it"
            )
        for index, entry in enumerate(env.python_path):
            if not entry.strip():
                self.error(f"env.python_path[{index}]: empty; give a directory")

    def check_agents(self) -> None:
        """Agent runs (env.name: agent), the policy endpoint, and the keys only they use."""
        cfg = self.cfg
        agent_run = cfg.env.name in ("agent", "nemo_gym")
        server = cfg.policy.generation.http_server
        if not agent_run:
            if server.enabled:
                self.error(
                    "policy.generation.http_server.enabled: true serves the policy to agents; "
                    f"env.name is {cfg.env.name!r} — set env.name: agent (with env.target) or "
                    "nemo_gym, or leave the endpoint off"
                )
            if cfg.env.agent != type(cfg.env.agent)():
                self.error(
                    f"env.agent: set, but env.name is {cfg.env.name!r} — these keys configure "
                    "agent episodes only; remove them or set env.name: agent"
                )
            if cfg.token_capture.on_prefix_mismatch != "split":
                self.error(
                    "token_capture.on_prefix_mismatch: applies to agent episodes only "
                    f"(env.name is {cfg.env.name!r}); remove it or set env.name: agent"
                )
            return
        if cfg.env.agent.client == "http" and not server.enabled:
            self.error(
                "env.agent.client: http needs the endpoint: set "
                "policy.generation.http_server.enabled: true (or env.agent.client: auto / "
                "in_process)"
            )
        if cfg.is_ppo:
            self.error(
                "env.name: agent trains with GRPO only; replace ppo: with grpo: (agent "
                "episodes under PPO are not supported)"
            )
        if cfg.on_policy_distillation is not None:
            self.error(
                "on_policy_distillation: not supported with env.name: agent (teachers score "
                "single completions, not agent episodes); use grpo: or a single-turn env"
            )
        if cfg.validates:
            self.error(
                "validation passes (val_period / val_at_start / val_at_end) are not supported "
                "with env.name: agent (they score single completions with an environment); "
                "turn them off"
            )
        if not cfg.loss_fn.token_level_loss and cfg.token_capture.on_prefix_mismatch == "split":
            self.error(
                "loss_fn.token_level_loss: false with env.name: agent and "
                "token_capture.on_prefix_mismatch: split — a split episode is several rows, "
                "and a sequence-mean loss would weigh it once per row; use token_level_loss: "
                "true or on_prefix_mismatch: error"
            )
        if cfg.data.prompt_format != "raw":
            self.error(
                "data.prompt_format: chat has no effect with env.name: agent — the agent builds "
                "its own messages and the endpoint renders them with the chat template; remove it"
            )
        agent = cfg.env.agent
        if agent.workers:
            if cfg.env.name == "nemo_gym":
                self.error(
                    "env.agent.workers: NeMo-Gym's episodes play in Gym's own servers; set it "
                    "to 0 with env.name: nemo_gym"
                )
            elif agent.client == "in_process" or (agent.client == "auto" and not server.enabled):
                self.error(
                    f"env.agent.workers: {agent.workers} — agents in worker processes reach the "
                    "policy over HTTP: set policy.generation.http_server.enabled: true (with "
                    "env.agent.client: auto or http), or env.agent.workers: 0"
                )
        limit = cfg.policy.max_total_sequence_length
        if agent.max_tokens_per_turn is not None and agent.max_tokens_per_turn >= limit:
            self.error(
                f"env.agent.max_tokens_per_turn: {agent.max_tokens_per_turn} leaves no room for "
                f"a prompt within policy.max_total_sequence_length ({limit}); lower it"
            )

    def check_nemo_gym(self) -> None:
        """env.name: nemo_gym: where the Gym servers come from, and what they need of the run."""
        cfg = self.cfg
        gym = cfg.env.nemo_gym
        if cfg.env.name != "nemo_gym":
            if gym != type(gym)():
                self.error(
                    f"env.nemo_gym: set, but env.name is {cfg.env.name!r} — these keys configure "
                    "NeMo-Gym rollouts only; remove them or set env.name: nemo_gym"
                )
            return
        if bool(gym.config_paths) == (gym.head_server is not None):
            self.error(
                "env.nemo_gym: give exactly one of config_paths (TandemRL starts the Gym "
                "servers from these Gym config files) and head_server (connect to servers "
                "started with `gym env start`)"
            )
        if gym.head_server is not None and gym.overrides:
            self.error(
                "env.nemo_gym.overrides: only used when TandemRL starts the Gym servers "
                "(config_paths); with head_server set, pass them to `gym env start`"
            )
        server = cfg.policy.generation.http_server
        if not server.enabled:
            self.error(
                "policy.generation.http_server.enabled: must be true with env.name: nemo_gym "
                "(Gym's model server calls the policy over HTTP)"
            )
        if cfg.env.agent.client == "in_process":
            self.error(
                "env.agent.client: in_process cannot serve NeMo-Gym's servers (they call the "
                "policy over HTTP); use auto or http"
            )
        if gym.head_server is not None and server.port == 0:
            self.error(
                "policy.generation.http_server.port: 0 (a free port) with env.nemo_gym."
                "head_server — the running Gym model server calls a fixed URL; set the port it "
                "was started with (its policy_base_url)"
            )
        if gym.run_timeout_s >= cfg.env.agent.episode_timeout_s:
            self.error(
                f"env.nemo_gym.run_timeout_s: {gym.run_timeout_s} must be below "
                f"env.agent.episode_timeout_s ({cfg.env.agent.episode_timeout_s}), so a Gym "
                "server that stops answering is an infrastructure failure, not a data one"
            )
        if cfg.data.dataset is None or cfg.data.dataset.startswith("builtin://"):
            self.error(
                f"data.dataset: {cfg.data.dataset!r} — env.name: nemo_gym reads a JSONL file of "
                "NeMo-Gym rows (responses_create_params, agent_ref, task_source, ...)"
            )
        for key in ("prompt_key", "answer_key", "task_source_key", "agent_ref_key"):
            if getattr(cfg.data, key) != getattr(type(cfg.data)(), key):
                self.error(
                    f"data.{key}: NeMo-Gym rows have fixed fields (responses_create_params, "
                    "agent_ref.name, task_source); remove it"
                )
        for source, target in gym.agent_routes.items():
            if not source or not target:
                self.error(f"env.nemo_gym.agent_routes: empty agent name in {source!r}: {target!r}")

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
