"""Assemble a SingleController from the config and the heavy parts it is handed.

``build_controller`` makes every pure-state part (replay buffer, sampler, data plane,
dataloader, ledger, budgets, barrier, rollout manager) from the config; the heavy parts —
trainer, generation engines, weight synchroniser, environment, text codec — are arguments.
Tests and benchmarks pass fakes; ``tandemrl.controller.setup`` passes Ray workers.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

from tandemrl.barrier import CheckpointBarrier
from tandemrl.buffer import ReplayBuffer
from tandemrl.checkpoint.commit_log import CommitLog
from tandemrl.checkpoint.commit_replay import CommitLogEvents, commit_log_dir
from tandemrl.checkpoint.journal import RunJournal
from tandemrl.checkpoint.layout import JOURNAL, POLICY_DIR, VALUE_DIR
from tandemrl.checkpoint.writer import CheckpointedModel, CheckpointWriter
from tandemrl.codec import TextCodec
from tandemrl.config.errors import ConfigError
from tandemrl.config.models import MasterConfig
from tandemrl.controller.ppo_step import PPOStepRunner
from tandemrl.controller.single_controller import (
    ControllerSettings,
    SingleController,
    StepHook,
    StepSink,
)
from tandemrl.controller.step_runner import GRPOStepRunner, StepRunner
from tandemrl.controller.weight_sync import DirectWeightSync, WeightSynchronizer
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.dataplane import create_data_plane
from tandemrl.dataplane.base import DataPlane
from tandemrl.envs.base import Environment
from tandemrl.rollout.events import OwnershipEvents
from tandemrl.rollout.failures import FailureBudgets
from tandemrl.rollout.generation_pool import GenerationPool
from tandemrl.rollout.ledger import OwnershipLedger
from tandemrl.rollout.manager import RolloutManager, SamplingParams
from tandemrl.run_state import ControllerState, RunState
from tandemrl.samplers import PromptGroupSampler, create_sampler


@dataclass
class ControllerParts:
    trainer: Any
    engines: list[Any]
    env: Environment
    codec: TextCodec
    # default: DirectWeightSync(trainer, pool); a callable gets the generation pool
    weight_sync: WeightSynchronizer | Callable[[GenerationPool], WeightSynchronizer] | None = None
    data_plane: DataPlane | None = None  # default: from cfg.data_plane
    dataloader: PromptDataLoader | None = None  # default: from cfg.data
    step_runner: StepRunner | None = None  # default: make_step_runner(cfg, trainer, ...)
    value_trainer: Any = None  # PPO: the critic (a ValueTrainer); None on GRPO
    # Remote engines (Ray actors): send one generate call per worker per event-loop turn.
    coalesce_generate_calls: bool = False
    # Where each step's metrics row is written before its checkpoint (None: kept in history).
    metrics_sink: StepSink | None = None


def make_step_runner(
    cfg: MasterConfig,
    trainer: Any,
    *,
    pad_token_id: int,
    value_trainer: Any = None,
) -> StepRunner:
    """GRPO: ``GRPOStepRunner``. PPO: ``PPOStepRunner`` over the policy and the critic
    (``value_trainer``)."""
    if cfg.is_ppo:
        if value_trainer is None:
            raise ValueError(
                "a PPO run needs a critic: pass value_trainer (ControllerParts.value_trainer)"
            )
        return PPOStepRunner.from_config(cfg, trainer, value_trainer, pad_token_id=pad_token_id)
    algo = cfg.grpo
    assert algo is not None  # validation: exactly one of grpo:/ppo:
    return GRPOStepRunner(
        trainer,
        group_size=algo.num_generations_per_prompt,
        leave_one_out_baseline=algo.use_leave_one_out_baseline,
        normalize_rewards=algo.normalize_rewards,
        pad_token_id=pad_token_id,
        reuse_training_logprobs=cfg.loss_fn.reuse_training_logprobs,
    )


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
    data_plane = parts.data_plane or create_data_plane(cfg.data_plane)
    dataloader = parts.dataloader or PromptDataLoader.from_config(
        cfg.data, max_num_epochs=algo.max_num_epochs, images=cfg.policy.is_vlm
    )
    pool = GenerationPool(
        parts.engines,
        generation_timeout_s=failure.generation_timeout_s,
        # Coalesced calls finish together: a rollout deadline would time its batchmates too.
        coalesce_calls=parts.coalesce_generate_calls and failure.rollout_timeout_s is None,
        # One engine batch per call, so early groups still come back early.
        max_requests_per_call=cfg.policy.generation.max_batch_size,
    )
    run_state = RunState(
        controller=ControllerState(),
        buffer=buffer,
        sampler=sampler,
        ledger=OwnershipLedger(cfg.rollout_recovery, token_capture=cfg.token_capture.enabled),
        budgets=FailureBudgets(failure),
        dataloader=dataloader,
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
    generation_cfg = cfg.policy.generation
    eos = () if parts.codec.eos_token_id is None else (parts.codec.eos_token_id,)
    stop_ids = tuple(
        dict.fromkeys((*generation_cfg.stop_token_ids, *eos, *parts.codec.stop_token_ids))
    )
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
    )
    return build_controller(cfg, parts, step_hooks=step_hooks)
