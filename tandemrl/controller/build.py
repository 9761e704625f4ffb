"""Assemble a SingleController from the config and the heavy parts it is handed.

``build_controller`` makes every pure-state part (replay buffer, sampler, data plane,
dataloader, ledger, budgets, barrier, rollout manager, the teachers' routing) from the config;
the heavy parts — trainer, generation engines, distillation teachers' workers, weight
synchroniser, environment, text codec — are arguments.
Tests and benchmarks pass fakes; ``tandemrl.controller.setup`` passes Ray workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tandemrl.agents import is_agent_run
from tandemrl.agents.runner import AgentRollouts
from tandemrl.agents.setup import make_agent_rollouts
from tandemrl.barrier import CheckpointBarrier
from tandemrl.buffer import ReplayBuffer
from tandemrl.checkpoint.commit_log import CommitLog
from tandemrl.checkpoint.commit_replay import CommitLogEvents, commit_log_dir
from tandemrl.checkpoint.journal import RunJournal
from tandemrl.checkpoint.layout import JOURNAL, POLICY_DIR, VALUE_DIR
from tandemrl.checkpoint.writer import CheckpointedModel, CheckpointWriter
from tandemrl.codec import TextCodec
from tandemrl.config.distillation import TeacherRoutes, teacher_name
from tandemrl.config.errors import ConfigError
from tandemrl.config.models import MasterConfig
from tandemrl.controller.distill_step import DistillationStepRunner
from tandemrl.controller.ppo_step import PPOStepRunner
from tandemrl.controller.single_controller import (
    ControllerSettings,
    SingleController,
    StepHook,
    StepSink,
)
from tandemrl.controller.step_runner import GRPOStepRunner, StepRunner
from tandemrl.controller.validation import ValidationSetup
from tandemrl.controller.weight_sync import DirectWeightSync, WeightSynchronizer
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord, dataset_fingerprint, load_validation_records
from tandemrl.dataplane import create_data_plane
from tandemrl.dataplane.base import DataPlane
from tandemrl.envs.base import Environment
from tandemrl.records import PromptItem
from tandemrl.rollout.events import OwnershipEvents
from tandemrl.rollout.failures import FailureBudgets
from tandemrl.rollout.generation_pool import GenerationPool
from tandemrl.rollout.ledger import OwnershipLedger
from tandemrl.rollout.manager import RolloutManager, SamplingParams
from tandemrl.rollout.teachers import TeacherPool, TeacherScorer
from tandemrl.rollout.validation_state import ValidationSchedule, ValidationState
from tandemrl.run_state import ControllerState, RunState
from tandemrl.samplers import PromptGroupSampler, create_sampler
from tandemrl.training.rewards import RewardTransform


@dataclass
class ControllerParts:
    trainer: Any
    engines: list[Any]
    env: Environment | None  # None on an agent run (env.name: agent): the agent scores
    codec: TextCodec
    # default: DirectWeightSync(trainer, pool); a callable gets the generation pool
    weight_sync: WeightSynchronizer | Callable[[GenerationPool], WeightSynchronizer] | None = None
    data_plane: DataPlane | None = None  # default: from cfg.data_plane
    dataloader: PromptDataLoader | None = None  # default: from cfg.data
    step_runner: StepRunner | None = None  # default: make_step_runner(cfg, trainer, ...)
    value_trainer: Any = None  # PPO: the critic (a ValueTrainer); None on GRPO
    # On-policy distillation: per teacher of on_policy_distillation.teachers, its workers
    # (TeacherWorker objects or async proxies of their actors).
    teacher_engines: list[list[Any]] | None = None
    # Remote engines (Ray actors): send one generate call per worker per event-loop turn.
    coalesce_generate_calls: bool = False
    # Where each step's metrics row is written before its checkpoint (None: kept in history).
    metrics_sink: StepSink | None = None
    # Agent runs (env.name: agent): the agent, and the tokenizer whose chat template the
    # policy endpoint renders requests with.
    agent: Any = None
    tokenizer: Any = None
    # Held-out prompts for validation passes (default: from cfg.data.validation).
    validation_prompts: list[PromptItem] | None = None
    # Keep a record of every trained group (``SingleController.trained_groups``) for tests and
    # in-process runs; the Ray controller actor turns it off so a long run does not grow.
    keep_trained_groups: bool = True


def make_step_runner(
    cfg: MasterConfig,
    trainer: Any,
    *,
    pad_token_id: int,
    value_trainer: Any = None,
    teachers: TeacherScorer | None = None,
) -> StepRunner:
    """GRPO: ``GRPOStepRunner``. PPO: ``PPOStepRunner`` over the policy and the critic
    (``value_trainer``). On-policy distillation: ``DistillationStepRunner`` over the policy and
    the ``teachers``."""
    if cfg.is_ppo:
        if value_trainer is None:
            raise ValueError(
                "a PPO run needs a critic: pass value_trainer (ControllerParts.value_trainer)"
            )
        return PPOStepRunner.from_config(cfg, trainer, value_trainer, pad_token_id=pad_token_id)
    distill = cfg.on_policy_distillation
    if distill is not None:
        if teachers is None:
            raise ValueError(
                "an on_policy_distillation run needs its teachers: pass their workers "
                "(ControllerParts.teacher_engines)"
            )
        return DistillationStepRunner(
            trainer,
            teachers,
            group_size=distill.num_generations_per_prompt,
            kl_coef=distill.kl_coef,
            reward_coef=distill.reward_coef,
            log_ratio_clamp=distill.log_ratio_clamp,
            leave_one_out_baseline=distill.use_leave_one_out_baseline,
            normalize_rewards=distill.normalize_rewards,
            pad_token_id=pad_token_id,
        )
    algo = cfg.grpo
    assert algo is not None  # validation: exactly one algorithm block
    return GRPOStepRunner(
        trainer,
        group_size=algo.num_generations_per_prompt,
        leave_one_out_baseline=algo.use_leave_one_out_baseline,
        normalize_rewards=algo.normalize_rewards,
        pad_token_id=pad_token_id,
        reuse_training_logprobs=cfg.loss_fn.reuse_training_logprobs,
        reference_kl=cfg.loss_fn.reference_policy_kl_penalty > 0,
    )


def make_teacher_scorer(
    cfg: MasterConfig, teacher_engines: list[list[Any]] | None
) -> TeacherScorer | None:
    """The run's teachers over their workers (None on GRPO and PPO)."""
    distill = cfg.on_policy_distillation
    if distill is None:
        return None
    if teacher_engines is None or len(teacher_engines) != len(distill.teachers):
        given = 0 if teacher_engines is None else len(teacher_engines)
        raise ValueError(
            f"on_policy_distillation.teachers lists {len(distill.teachers)} teacher(s) but "
            f"workers for {given} were given (ControllerParts.teacher_engines)"
        )
    pools = [
        TeacherPool(
            teacher_name(teacher, index), engines, max_batch_sequences=teacher.micro_batch_size
        )
        for index, (teacher, engines) in enumerate(
            zip(distill.teachers, teacher_engines, strict=True)
        )
    ]
    return TeacherScorer(TeacherRoutes.from_config(distill), pools)


def stands_down(cfg: MasterConfig) -> bool:
    """Whether generation sleeps for every train step (colocated, with its stand-down)."""
    colocated = cfg.policy.generation.colocated
    return colocated.enabled and colocated.stand_down


def controller_settings(cfg: MasterConfig) -> ControllerSettings:
    algo = cfg.algorithm
    failure = cfg.async_rl.rollout_failure
    return ControllerSettings(
        num_prompts_per_step=algo.num_prompts_per_step,
        group_size=algo.num_generations_per_prompt,
        max_num_steps=algo.max_num_steps,
        min_groups_for_streaming_train=cfg.async_rl.min_groups_for_streaming_train,
        max_inflight_prompts=cfg.async_rl.max_inflight_prompts,
        stands_down=stands_down(cfg),
        on_dropped_prompt=failure.on_dropped_prompt,
        min_step_batch_fraction=failure.min_step_batch_fraction,
        replacement_reserve_size=failure.replacement_reserve_size,
        sample_log_period=cfg.logger.sample_log_period,
        dynamic_sampling_max_gen_batches=(
            algo.dynamic_sampling_max_gen_batches if algo.use_dynamic_sampling else None
        ),
        drain_timeout_s=(
            None if cfg.async_rl.in_flight_weight_updates else cfg.async_rl.drain_timeout_s
        ),
    )


def build_controller(
    cfg: MasterConfig,
    parts: ControllerParts,
    *,
    step_hooks: list[StepHook] | None = None,
    model_path: str | None = None,
) -> SingleController:
    algo = cfg.algorithm
    failure = cfg.async_rl.rollout_failure
    buffer = ReplayBuffer(
        group_size=algo.num_generations_per_prompt, capacity=cfg.async_rl.max_buffered_rollouts
    )
    sampler = create_sampler(
        cfg.async_rl.sampler,
        buffer,
        groups_per_step=algo.num_prompts_per_step,
        policy_training_start_step=0 if cfg.ppo is None else cfg.ppo.policy_training_start_step,
    )
    check_buffer_capacity(sampler, cfg)
    # "is None": an empty data plane is falsy (it has a length).
    data_plane = (
        parts.data_plane if parts.data_plane is not None else create_data_plane(cfg.data_plane)
    )
    dataloader = parts.dataloader or PromptDataLoader.from_config(
        cfg.data,
        max_num_epochs=algo.max_num_epochs,
        gym_rows=cfg.env.name == "nemo_gym",
        images=cfg.policy.is_vlm,
    )
    pool = GenerationPool(
        parts.engines,
        generation_timeout_s=failure.generation_timeout_s,
        # Coalesced calls finish together: a rollout deadline would time its batchmates too.
        coalesce_calls=parts.coalesce_generate_calls and failure.rollout_timeout_s is None,
        # One engine batch per call, so early groups still come back early.
        max_requests_per_call=cfg.policy.generation.max_batch_size,
    )
    generation_cfg = cfg.policy.generation
    eos = () if parts.codec.eos_token_id is None else (parts.codec.eos_token_id,)
    stop_ids = tuple(
        dict.fromkeys((*generation_cfg.stop_token_ids, *eos, *parts.codec.stop_token_ids))
    )
    validation = validation_setup(cfg, parts, stop_ids=stop_ids)
    run_state = RunState(
        controller=ControllerState(),
        buffer=buffer,
        sampler=sampler,
        ledger=OwnershipLedger(
            cfg.rollout_recovery,
            token_capture=cfg.token_capture.enabled,
            # NeMo-Gym rows carry their own agent_ref (or none: then the task source decides).
            default_agent_ref=cfg.env.target if cfg.env.name == "agent" else None,
        ),
        budgets=FailureBudgets(failure),
        dataloader=dataloader,
        validation=None
        if validation is None
        else ValidationState(
            validation.schedule,
            num_prompts=len(validation.prompts),
            k=validation.num_generations,
            fingerprint=validation.fingerprint,
        ),
    )
    barrier = CheckpointBarrier()
    checkpointer: CheckpointWriter | None = None
    journal: RunJournal | None = None
    commit_log: CommitLog | None = None
    events: OwnershipEvents | None = None
    if cfg.checkpointing.enabled:
        checkpoint_dir = Path(cfg.checkpointing.checkpoint_dir)
        authoritative = sampler.supports_buffer_checkpoint
        journal = RunJournal(checkpoint_dir / JOURNAL)
        # Only over an authoritative replay index: shadow mode regenerates committed groups.
        if (
            cfg.rollout_checkpointing.commit_log
            and authoritative
            and cfg.checkpointing.save_data_plane
        ):
            commit_log = CommitLog(commit_log_dir(checkpoint_dir))
        models: dict[str, CheckpointedModel] = {POLICY_DIR: parts.trainer}
        if cfg.is_ppo and parts.value_trainer is not None:
            models[VALUE_DIR] = parts.value_trainer
        checkpointer = CheckpointWriter(
            cfg,
            model_path=model_path,
            authoritative=authoritative,
            run=run_state,
            data_plane=data_plane,
            barrier=barrier,
            models=models,
            commit_log=commit_log,
        )
        # The pumps report ownership changes once: to the log, which hands them to the
        # journal, or to the journal alone.
        events = journal
        if commit_log is not None:
            events = CommitLogEvents(
                commit_log,
                run_state,
                records_reserve=failure.on_dropped_prompt == "replace",
                journal=journal,
            )
    agents = None
    if is_agent_run(cfg.env):
        agents = _agent_rollouts(cfg, parts, pool, stop_ids)
    elif parts.env is None:
        raise ValueError(f"env.name={cfg.env.name!r} needs an environment (ControllerParts.env)")
    teachers = make_teacher_scorer(cfg, parts.teacher_engines)
    distill = cfg.on_policy_distillation
    manager = RolloutManager(
        buffer=buffer,
        data_plane=data_plane,
        generation=pool,
        env=parts.env,
        codec=parts.codec,
        sampling=SamplingParams(
            max_new_tokens=generation_cfg.max_new_tokens,
            temperature=generation_cfg.temperature,
            top_p=generation_cfg.top_p,
            stop_token_ids=stop_ids,
            max_total_tokens=cfg.policy.max_total_sequence_length,
        ),
        group_size=algo.num_generations_per_prompt,
        failure_cfg=failure,
        ledger=run_state.ledger,
        budgets=run_state.budgets,
        barrier=barrier,
        overlong_filtering=algo.overlong_filtering,
        seed=algo.seed,
        events=events,
        agents=agents,
        reward_transform=RewardTransform(scaling=algo.reward_scaling, shaping=algo.reward_shaping),
        teachers=teachers,
        teacher_stage=distill is not None and distill.teacher_scoring == "rollout",
    )
    return SingleController(
        settings=controller_settings(cfg),
        run_state=run_state,
        data_plane=data_plane,
        rollout_manager=manager,
        generation=pool,
        trainer=parts.trainer,
        step_runner=parts.step_runner
        or make_step_runner(
            cfg,
            parts.trainer,
            pad_token_id=parts.codec.pad_token_id,
            value_trainer=parts.value_trainer,
            teachers=teachers,
        ),
        weight_sync=_weight_sync(parts, pool),
        barrier=barrier,
        step_hooks=step_hooks,
        events=events,
        checkpointer=checkpointer,
        journal=journal,
        commit_log=commit_log,
        watchdog_cfg=cfg.async_rl.stall_watchdog,
        metrics_sink=parts.metrics_sink,
        services=[] if agents is None else [agents],
        keep_trained_groups=parts.keep_trained_groups,
        validation=validation,
    )


def _agent_rollouts(
    cfg: MasterConfig, parts: ControllerParts, pool: GenerationPool, stop_ids: tuple[int, ...]
) -> AgentRollouts:
    """The agent episodes' runner (and its endpoint) for an agent run."""
    if parts.agent is None:
        raise ValueError("env.name: agent needs the agent (ControllerParts.agent)")
    return make_agent_rollouts(
        cfg,
        agent=parts.agent,
        tokenizer=parts.tokenizer,
        codec=parts.codec,
        pool=pool,
        stop_token_ids=stop_ids,
    )


def validation_setup(
    cfg: MasterConfig, parts: ControllerParts, *, stop_ids: tuple[int, ...]
) -> ValidationSetup | None:
    """The held-out prompts and sampling of validation passes; None when none is scheduled."""
    if not cfg.validates:
        return None
    algo = cfg.algorithm
    prompts = parts.validation_prompts
    if prompts is None:
        records = load_validation_records(cfg.data, max_samples=algo.max_val_samples)
        prompts = [
            PromptItem(
                f"val-i{index}",
                0,
                index,
                record.prompt,
                record.answer,
                record.task_source,
                record.agent_ref,
                dict(record.metadata),
            )
            for index, record in enumerate(records)
        ]
    generation = cfg.policy.generation
    # Greedy: val_temperature 0, or top-1 (the same argmax).
    greedy = generation.val_temperature == 0 or generation.val_top_k == 1
    return ValidationSetup(
        prompts=list(prompts),
        schedule=ValidationSchedule(algo.val_period, algo.val_at_start, algo.val_at_end),
        num_generations=algo.val_num_generations,
        inflight_share=cfg.val_inflight_share,
        sampling=SamplingParams(
            max_new_tokens=generation.max_new_tokens,
            temperature=0.0 if greedy else generation.val_temperature,
            top_p=generation.val_top_p,
            stop_token_ids=stop_ids,
            max_total_tokens=cfg.policy.max_total_sequence_length,
        ),
        seed=algo.seed,
        fingerprint=_prompts_fingerprint(prompts),
    )


def _prompts_fingerprint(prompts: list[PromptItem]) -> str:
    return dataset_fingerprint(
        [
            PromptRecord(item.prompt, item.answer, item.task_source, item.agent_ref, item.metadata)
            for item in prompts
        ]
    )


def check_buffer_capacity(sampler: PromptGroupSampler, cfg: MasterConfig) -> None:
    """Refuse a buffer smaller than the sampler needs: the rollout pump would deadlock.

    Validation asks a built-in sampler before anything starts; a custom sampler's class is
    only built here, so this is where its declared capacity is checked (every sampler is
    asked, by the same rule).
    """
    groups_per_step = cfg.algorithm.num_prompts_per_step
    required = sampler.required_buffer_capacity(groups_per_step)
    buffered = cfg.async_rl.max_buffered_rollouts
    if buffered < required:
        raise ConfigError(
            f"async_rl.max_buffered_rollouts: {buffered} is below the {sampler.name} sampler's "
            f"required capacity {required} (its required_buffer_capacity("
            f"{groups_per_step})) — the rollout pump would deadlock; raise it to at least "
            f"{required}"
        )


def _weight_sync(parts: ControllerParts, pool: GenerationPool) -> WeightSynchronizer:
    given = parts.weight_sync
    if given is None:
        return DirectWeightSync(parts.trainer, pool)
    if hasattr(given, "sync"):
        return cast(WeightSynchronizer, given)
    return given(pool)


def build_fake_controller(
    cfg: MasterConfig,
    *,
    trainer: Any,
    engines: list[Any],
    dataloader: PromptDataLoader | None = None,
    step_hooks: list[StepHook] | None = None,
    teacher_engines: list[list[Any]] | None = None,
    metrics_sink: StepSink | None = None,
    keep_trained_groups: bool = True,
) -> SingleController:
    """A controller over fakes (tests and benchmarks): counting task, fake text codec."""
    from tandemrl.envs.counting import CountingEnv
    from tandemrl.generation.fake import fake_codec

    parts = ControllerParts(
        trainer=trainer,
        engines=engines,
        env=CountingEnv(),
        codec=fake_codec(),
        dataloader=dataloader,
        teacher_engines=teacher_engines,
        metrics_sink=metrics_sink,
        keep_trained_groups=keep_trained_groups,
    )
    return build_controller(cfg, parts, step_hooks=step_hooks)
