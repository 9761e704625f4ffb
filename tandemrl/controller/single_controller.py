"""SingleController: the rollout pump and the train pump, running concurrently over one buffer.

Rollout pump, per prompt group (reference spec, "Coordination Flow"):

    wait for room (max_inflight_prompts, max_buffered_rollouts) → sampler.admit (gate; stamps
    target_step) → draw the prompt → reserve a slot at the current trainer version →
    RolloutManager.generate_and_push (generate, score, push rows, commit)

Train pump, per RL step:

    sampler.evict → sampler.select (≥ min_groups_for_streaming_train per chunk, a step is
    num_prompts_per_step groups) → [dynamic sampling: drop zero-advantage groups, select
    again] → advantage stage → policy begin_train_step /
    train_microbatches per chunk / finish_train_step → clear the step's rows →
    trainer_version += 1 → weight sync (rollout permission closed meanwhile; with the drain
    gate, in-flight groups finish on the old weights first, or are generated again after it)

Validation (``tandemrl.controller.validation``) is a third producer on the same loop and the
same generation workers: a pass opens after the weight sync that brings its version, holds a
share of ``max_inflight_prompts`` while it has prompts left, and is reported once; it never
touches the buffer, the ledger, the data plane or the sampler.

Both pumps share one ``asyncio`` loop; nothing here blocks it. A crash in either pump ends
the run with the original exception; in-flight rollouts are cancelled on exit (they stay in
the ownership ledger, so a checkpoint written then still owns them).

State and persistence: what a checkpoint holds is one ``RunState`` (``tandemrl.run_state``:
the counters, the buffer, the sampler, the ledger, the budgets, the dataloader, the
replacement reserve); the checkpoint writer captures it without seeing the controller. Each
change of a group's owner is reported once to ``events`` (``tandemrl.rollout.events``: the
journal and the commit log), never written here.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import math
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from tandemrl.barrier import CheckpointBarrier
from tandemrl.buffer import Slot
from tandemrl.checkpoint.commit_log import CommitLog
from tandemrl.checkpoint.journal import RunJournal, read_journal, reported_validations
from tandemrl.checkpoint.restore import RestorePlan, resume
from tandemrl.checkpoint.writer import CheckpointWriter
from tandemrl.config.models import StallWatchdogConfig
from tandemrl.controller.dynamic_sampling import DynamicSampling
from tandemrl.controller.eviction_warning import EvictionWatch
from tandemrl.controller.step_metrics import StepAccumulator, TrainedGroup, episode_rewards
from tandemrl.controller.step_runner import StepRunner
from tandemrl.controller.validation import ValidationRunner, ValidationSetup, describe_pass
from tandemrl.controller.watchdog import stall_watchdog
from tandemrl.controller.weight_sync import WeightSynchronizer
from tandemrl.dataplane.base import DataPlane
from tandemrl.records import PromptItem
from tandemrl.rollout.events import OwnershipEvents
from tandemrl.rollout.failures import RolloutDropped
from tandemrl.rollout.generation_pool import GenerationPool
from tandemrl.rollout.ledger import UnfinishedGroup
from tandemrl.rollout.manager import GroupAborted, RolloutManager
from tandemrl.rollout.validation_state import OpenPass
from tandemrl.run_state import RunState
from tandemrl.training.api import Trainer

log = logging.getLogger(__name__)

# Container allocations between two young garbage collections while a run is on (Python's
# default is 700); see ``run``.
GC_YOUNG_THRESHOLD = 10_000
# Drain gate: past its deadline, how often the groups still scoring or committing are polled
# (they are not cancelled; one that starts another generation round then is).
DRAIN_POLL_S = 0.05


class StepShrunkTooFar(RuntimeError):
    """Dropped prompts left a step below async_rl.rollout_failure.min_step_batch_fraction."""


@dataclass(frozen=True)
class ControllerSettings:
    num_prompts_per_step: int
    group_size: int
    max_num_steps: int
    min_groups_for_streaming_train: int
    max_inflight_prompts: int
    # Generation sleeps for every train step (colocated with its stand-down).
    stands_down: bool = False
    on_dropped_prompt: str = "shrink"
    min_step_batch_fraction: float = 0.5
    replacement_reserve_size: int = 0
    # Every this many steps, the last few completions go to the metrics sink (0: never).
    sample_log_period: int = 0
    # grpo.use_dynamic_sampling: its dynamic_sampling_max_gen_batches (None: off).
    dynamic_sampling_max_gen_batches: int | None = None
    # async_rl.in_flight_weight_updates false: the drain gate, with drain_timeout_s.
    drain_timeout_s: float | None = None

    def __post_init__(self) -> None:
        # The config model refuses it too; a step must never be allowed to shrink to nothing.
        if not 0.0 < self.min_step_batch_fraction <= 1.0:
            raise ValueError(
                "async_rl.rollout_failure.min_step_batch_fraction must be in (0, 1], got "
                f"{self.min_step_batch_fraction}"
            )


StepHook = Callable[["SingleController", dict[str, float]], Awaitable[None]]


class RunService(Protocol):
    """Something that runs beside the pumps for the whole run (the agents' policy endpoint):
    started before the pumps, stopped after them; ``health`` says what is wrong with it (or
    with what it depends on, such as NeMo-Gym's servers) for the stall watchdog's report."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    async def health(self) -> str | None: ...


class StepSink(Protocol):
    """Where each step's metrics row (and now and then a few samples) is written, in the
    controller's process, before the step's checkpoint (``tandemrl.metrics.MetricsLogger``)."""

    def log_step(self, metrics: Mapping[str, Any]) -> None: ...

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None: ...

    def log_validation(self, metrics: Mapping[str, Any]) -> None:
        """A validation pass's metrics (``trainer_version`` is the version it evaluated)."""


class SingleController:
    def __init__(
        self,
        *,
        settings: ControllerSettings,
        run_state: RunState,
        data_plane: DataPlane,
        rollout_manager: RolloutManager,
        generation: GenerationPool,
        trainer: Trainer,
        step_runner: StepRunner,
        weight_sync: WeightSynchronizer,
        barrier: CheckpointBarrier,
        step_hooks: list[StepHook] | None = None,
        events: OwnershipEvents | None = None,
        checkpointer: CheckpointWriter | None = None,
        journal: RunJournal | None = None,
        commit_log: CommitLog | None = None,
        watchdog_cfg: StallWatchdogConfig | None = None,
        metrics_sink: StepSink | None = None,
        services: list[RunService] | None = None,
        validation: ValidationSetup | None = None,
        keep_trained_groups: bool = True,
    ) -> None:
        self.settings = settings
        self.services = list(services or [])
        self.metrics_sink = metrics_sink
        self.run_state = run_state
        # The parts of the run state the pumps touch per group, bound once (the same objects:
        # a restore loads into them in place).
        self.state = run_state.controller
        self.buffer = run_state.buffer
        self.sampler = run_state.sampler
        self.dataloader = run_state.dataloader
        self.data_plane = data_plane
        self.rollout_manager = rollout_manager
        self.generation = generation
        self.trainer = trainer
        self.step_runner = step_runner
        self.weight_sync = weight_sync
        self.barrier = barrier
        self.step_hooks = list(step_hooks or [])
        # Ownership changes go here (the journal, the commit log); None: neither is on.
        self.events = events
        self.checkpointer = checkpointer
        # Opened and closed with the run (``events`` writes to them).
        self.journal = journal
        self.commit_log = commit_log
        self.watchdog_cfg = watchdog_cfg
        self.stall_warnings = 0
        self.inflight_started_at: dict[str, float] = {}
        self._inflight: dict[str, asyncio.Task[None]] = {}
        self._abort_requested: set[str] = set()
        # Drain gate: groups cancelled mid-generation at the drain deadline, and those of them
        # waiting to be generated again once the new weights are in.
        self._redispatch_requested: set[str] = set()
        self._redispatch_after_sync: list[UnfinishedGroup] = []
        self._rollout_permission = asyncio.Event()
        # The staleness gate reads the version when it decides (made once, not per admission).
        self._trainer_version_fn = lambda: self.trainer_version
        self._rollout_permission.set()
        # Set by the next _notify; created only when someone waits (notify runs per group).
        self._changed: asyncio.Event | None = None
        self._rollout_done = False
        self._stopping = False
        # A graceful stop (SIGTERM, Ctrl-C): no new admissions, no new step; see request_stop.
        self.stop_requested = False
        self._acc = StepAccumulator()
        self._fatal: asyncio.Future[None] | None = None
        # The last step's tail (weight sync, metrics row, checkpoint, hooks) when it runs while
        # the next step trains (see _train_one_step).
        self._step_tail: asyncio.Task[None] | None = None
        self.waiting_on: dict[str, str] = {"rollout": "not started", "train": "not started"}
        self.last_progress_at = time.monotonic()
        # Metrics rows of finished steps not yet taken by ``take_progress`` (the driver's
        # display); a controller run without a driver keeps them all.
        self.history: list[dict[str, float]] = []
        self._history_taken = 0  # rows taken and forgotten before history[0]
        # (step index, group) for every group trained by this process, for tests and
        # in-process runs to inspect; off under ``tandemrl train`` (keep_trained_groups=False),
        # where nothing is kept per group once its step closed and the journal has it.
        self.keep_trained_groups = keep_trained_groups
        self.trained_groups: list[tuple[int, TrainedGroup]] = []
        # The third producer (None: no validation pass is scheduled).
        self.validation: ValidationRunner | None = None
        if validation is not None:
            if run_state.validation is None:
                raise ValueError("validation needs run_state.validation (its ValidationState)")
            self.validation = ValidationRunner(
                validation,
                state=run_state.validation,
                generation=generation,
                scorer=rollout_manager,
                failure_cfg=rollout_manager.failure_cfg,
                max_inflight_prompts=settings.max_inflight_prompts,
                training_inflight=lambda: len(self._inflight),
                dispatch_allowed=self._rollout_permission.is_set,
                wait_change=self._wait_change,
                notify=self._notify,
                report=self._report_validation,
                opened=self._validation_opened,
                progressed=self._validation_progressed,
            )
        # Metrics rows of the validation passes this process reported, in report order.
        self.validation_history: list[dict[str, Any]] = []
        self.dynamic_sampling = (
            None
            if settings.dynamic_sampling_max_gen_batches is None
            else DynamicSampling(
                num_prompts_per_step=settings.num_prompts_per_step,
                max_gen_batches=settings.dynamic_sampling_max_gen_batches,
            )
        )
        self.eviction_watch = EvictionWatch.for_sampler(
            self.sampler,
            groups_per_step=settings.num_prompts_per_step,
            max_inflight_prompts=settings.max_inflight_prompts,
            buffer_capacity=self.buffer.capacity,
        )

    # ------------------------------------------------------------------ public

    @property
    def trainer_version(self) -> int:
        return self.state.trainer_version

    @property
    def inflight_count(self) -> int:
        return len(self._inflight)

    def take_progress(self, since: int) -> list[dict[str, float]]:
        """Rows of the steps finished after the first ``since`` ones; rows before ``since``
        have been seen by the caller and are forgotten (memory stays flat on long runs)."""
        forget = min(max(since - self._history_taken, 0), len(self.history))
        if forget:
            del self.history[:forget]
            self._history_taken += forget
        return self.history[max(since - self._history_taken, 0) :]

    def retained_records(self) -> dict[str, int]:
        """How many records each container that a step or a group adds to holds now.

        On a long run each stays bounded by the config (groups in flight, buffer capacity,
        rows not yet taken by the driver), never by the number of steps run: the unit tests
        and ``benchmarks/controller_heap.py`` check it.
        """
        manager = self.rollout_manager
        return {
            "history": len(self.history),
            "trained_groups": len(self.trained_groups),
            "inflight": len(self._inflight),
            "inflight_started_at": len(self.inflight_started_at),
            "abort_requested": len(self._abort_requested),
            "step_groups": len(self._acc.groups),
            "buffer_slots": len(self.buffer),
            "ledger_groups": len(self.run_state.ledger),
            "dropped_for_step": len(self.state.dropped_for_step),
            "replacement_credits": len(self.sampler.replacement_credits),
            "replacement_reserve": len(self.run_state.replacement_reserve),
            "recovered_groups": len(self.run_state.recovered_groups),
            "active_requests": len(manager.active_requests),
            "recent_samples": len(manager.recent_samples),
            "eviction_warnings": len(self.eviction_watch.warnings),
            "generation_batches": self.generation.open_batches,
        }

    def request_stop(self) -> None:
        """Stop gracefully: admit nothing more, start no new step, end the step being
        assembled without training it (its groups go back to the buffer), then ``run``
        writes the final checkpoint (when checkpointing is on) and returns. Groups in flight
        stay in the ownership ledger, so a restart redispatches them."""
        self.stop_requested = True
        self._notify()

    async def resume(self, plan: RestorePlan) -> dict[str, Any]:
        """Re-install what ``plan`` chose (``tandemrl.checkpoint.restore.resume``) before
        ``run``; with checkpointing off only a fresh start is possible."""
        if self.checkpointer is None:
            if not plan.fresh:
                raise ValueError(f"cannot {plan.describe()}: checkpointing is off")
            return {"commit_log_tip": None}
        summary = await resume(
            plan,
            self.checkpointer,
            replayed_rows=self.rollout_manager,
            sync_weights=self.weight_sync.sync,
            journal=self.journal,
        )
        self._restore_validation()
        return summary

    def _restore_validation(self) -> None:
        """Passes the run journal shows reported (in this lineage) are never re-opened; the
        checkpoint writer ranks checkpoints with their scores."""
        if self.validation is None or self.journal is None or not self.journal.path.is_file():
            return
        reported = reported_validations(read_journal(self.journal.path))
        dropped = self.validation.state.forget_reported(set(reported))
        for version in dropped:
            log.info("validation pass of version %d was reported before the restart", version)
        if self.checkpointer is not None:
            self.checkpointer.seed_validation_scores(reported)

    async def run(self) -> list[dict[str, float]]:
        """Run both pumps until max_num_steps or the data runs out; return per-step metrics."""
        self._acc = StepAccumulator()
        self._fatal = asyncio.get_running_loop().create_future()
        if self.commit_log is not None and not self.commit_log.opened:
            self.commit_log.open(parent=None)  # not resumed through checkpoint.restore.resume
        started: list[RunService] = []
        try:
            for service in self.services:
                await service.start()
                started.append(service)
            return await self._run_pumps(self._fatal)
        finally:
            for service in reversed(started):
                await service.stop()

    async def _run_pumps(self, fatal: asyncio.Future[None]) -> list[dict[str, float]]:
        if self.validation is not None:
            # Passes a restore re-opened continue; val_at_start opens version 0's pass.
            self.validation.resume_open_passes()
            self.validation.on_weights(
                self.trainer_version, final=self.state.step >= self.settings.max_num_steps
            )
        rollout = asyncio.create_task(self._rollout_pump(), name="rollout_pump")
        train = asyncio.create_task(self._train_pump(), name="train_pump")
        background = [rollout]
        if self.validation is not None:
            background.append(asyncio.create_task(self.validation.run(), name="validation"))
        if self.watchdog_cfg is not None and self.watchdog_cfg.enabled:
            background.append(
                asyncio.create_task(stall_watchdog(self, self.watchdog_cfg), name="watchdog")
            )
        if (
            self.checkpointer is not None
            and self.checkpointer.cfg.rollout_checkpointing.snapshot_attempt_interval_s
        ):
            background.append(
                asyncio.create_task(self.checkpointer.snapshot_loop(), name="snapshots")
            )
        # Everything alive now (torch, Ray, the dataset) outlives the run: frozen, it is not
        # rescanned by the collector's full passes (each one stalls both pumps for a scan of
        # the whole startup heap, and the run's own allocations keep triggering them).
        # Young collections run every GC_YOUNG_THRESHOLD allocations instead of 700: most of a
        # group's records have died by then, so fewer survive to be scanned again (callgrind,
        # control_plane.py: collections took 3.5% of the run's instructions at 700; 10,000 cut
        # the total by 2.6%). Both are undone when the run ends.
        gc.freeze()
        thresholds = gc.get_threshold()
        gc.set_threshold(GC_YOUNG_THRESHOLD, *thresholds[1:])
        try:
            pending: set[asyncio.Future[Any]] = {*background, train, fatal}
            while train in pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    task.result()  # re-raises a pump's exception with its original traceback
            if self.validation is not None and not self.stop_requested:
                rollout.cancel()  # no more training rollouts: the run's last step is done
                await self._finish_validation(pending)
            await self._final_checkpoint()
        finally:
            gc.set_threshold(*thresholds)
            gc.unfreeze()
            self._collect_fatal(raised=sys.exc_info()[1])
            await self.shutdown(*background, train)
        return self.history

    async def _finish_validation(self, pending: set[asyncio.Future[Any]]) -> None:
        """The val_at_end pass and every open pass end before the final checkpoint (a stop
        request leaves them open in it instead: a restart re-opens them)."""
        assert self.validation is not None
        finish = asyncio.create_task(
            self.validation.finish(self.trainer_version, lambda: self.stop_requested),
            name="validation_finish",
        )
        self.waiting_on["train"] = "validation passes before the end of the run"
        watched = {finish, *(task for task in pending if not task.done())}
        try:
            while not finish.done():
                done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    if task is not finish and not task.cancelled():
                        task.result()  # a failed pass, a watchdog abort: re-raised here
                    watched.discard(task)
        finally:
            finish.cancel()

    def _validation_progressed(self) -> None:
        # A finished validation prompt is progress for the stall watchdog too.
        self.last_progress_at = time.monotonic()

    def _validation_opened(self, opened: OpenPass) -> None:
        if self.journal is not None:
            self.journal.record(
                "validation_opened",
                version=opened.version,
                pending=len(opened.pending),
                kept=len(opened.results),
                restarts=opened.restarts,
            )

    def _report_validation(self, opened: OpenPass, metrics: dict[str, float]) -> None:
        """A finished pass, reported once: the metrics sink first, then the run journal (the
        record a restart reads), then the checkpoint writer (best-checkpoint ranking)."""
        row: dict[str, Any] = {
            "trainer_version": opened.version,
            "reported_at_step": self.state.step,
            **metrics,
        }
        self.validation_history.append(row)
        if self.metrics_sink is not None:
            self.metrics_sink.log_validation(row)
        if self.journal is not None:
            self.journal.record(
                "validated", version=opened.version, restarts=opened.restarts, metrics=row
            )
        if self.checkpointer is not None:
            self.checkpointer.note_validation(opened.version, row)
        assert self.validation is not None
        log.info("%s", describe_pass(opened.version, row, self.validation.setup.num_generations))

    def _collect_fatal(self, *, raised: BaseException | None) -> None:
        """Read the fatal future's exception, so none is left unretrieved (asyncio would log it
        from a finalizer, at any later point: once inside pytest's import of a module, where
        CPython 3.11's AST validator then failed with a recursion-depth SystemError). A
        failure other than the one ``run`` raises is logged."""
        fatal = self._fatal
        if fatal is None or not fatal.done() or fatal.cancelled():
            return
        exc = fatal.exception()
        if exc is not None and exc is not raised:
            log.error("a further failure while the run ended: %r", exc, exc_info=exc)

    async def shutdown(self, *tasks: asyncio.Task[Any]) -> None:
        """Stop both pumps and cancel in-flight rollouts; nothing is left waiting."""
        self._stopping = True
        self.sampler.close()
        self._notify()
        inflight = list(self._inflight.values())
        if self._step_tail is not None:
            tasks = (*tasks, self._step_tail)
        for task in [*tasks, *inflight]:
            if not task.done():
                task.cancel()
        await asyncio.gather(*tasks, *inflight, return_exceptions=True)
        if self.commit_log is not None:
            self.commit_log.close()

    # ------------------------------------------------------------------ rollout pump

    async def _rollout_pump(self) -> None:
        # Groups restored from a checkpoint were admitted before the crash and are in the ledger
        # already (so a snapshot taken while they wait still owns them): reserve and relaunch.
        recovered = self.run_state.recovered_groups
        while recovered and not self._stopping:
            await self._wait_for_room()
            group = recovered.pop(0)
            self.rollout_manager.reserve_recovered(group, current_weight=self.trainer_version)
            await self._wait_for_permission()
            self._launch(group)

        while not self._stopping and not self.stop_requested:
            self._fill_replacement_reserve()
            if not self._has_prompt():
                break
            if self._no_room():  # only then a coroutine: this runs once per group
                await self._wait_for_room()
            self.waiting_on["rollout"] = "sampler.admit (staleness gate)"
            blocked_from = time.monotonic()
            target_step = await self.sampler.admit(trainer_version_fn=self._trainer_version_fn)
            # From the admission to the reserved slot without an await: a snapshot sees the
            # admission, the drawn prompt and the ledger entry together, or none of them.
            item = self._take_prompt()
            if item is None:
                break
            group = self.rollout_manager.reserve(
                item, start_weight=self.trainer_version, target_step=target_step
            )
            if self.events is not None:
                self.events.admitted(group)
            # Generation starts once the engines hold the weights of the group's start version.
            if not self._rollout_permission.is_set():
                await self._wait_for_permission()
            self._acc.rollout_blocked_s += time.monotonic() - blocked_from
            self._launch(group)
            self.waiting_on["rollout"] = "dispatching"
        self._rollout_done = True
        stopped = self._stopping or self.stop_requested
        self.waiting_on["rollout"] = "stopped" if stopped else "data exhausted"
        self._notify()

    # The replacement reserve (on_dropped_prompt: replace) holds spare prompts drawn ahead from
    # the dataloader; they are checkpointed with it. When the data runs out, the spares are
    # dispatched like ordinary prompts, so none is left untrained.

    def _fill_replacement_reserve(self) -> None:
        if self.settings.on_dropped_prompt != "replace":
            return
        reserve = self.run_state.replacement_reserve
        drawn = 0
        while len(reserve) < self.settings.replacement_reserve_size:
            item = self.dataloader.next_item()
            if item is None:
                break
            reserve.append(item)
            drawn += 1
        if drawn and self.events is not None:
            self.events.reserve_filled()

    def _has_prompt(self) -> bool:
        return not self.dataloader.exhausted or bool(self.run_state.replacement_reserve)

    def _take_prompt(self) -> PromptItem | None:
        item = self.dataloader.next_item()
        reserve = self.run_state.replacement_reserve
        if item is None and reserve:
            return reserve.pop(0)
        return item

    def _no_room(self) -> bool:
        """True while the in-flight cap or the buffer's capacity holds the next group back."""
        held = 0 if self.validation is None else self.validation.slots_held
        return (
            len(self._inflight) + held >= self.settings.max_inflight_prompts
            or not self.buffer.has_capacity()
        )

    async def _wait_for_room(self) -> None:
        blocked_from = time.monotonic()
        while self._no_room():
            self.waiting_on["rollout"] = (
                f"room: in-flight {len(self._inflight)}/{self.settings.max_inflight_prompts}, "
                f"buffer {len(self.buffer)}/{self.buffer.capacity}"
            )
            await self._wait_change()
        self._acc.rollout_blocked_s += time.monotonic() - blocked_from

    async def _wait_for_permission(self) -> None:
        if not self._rollout_permission.is_set():
            self.waiting_on["rollout"] = "weight sync (rollout permission closed)"
            await self._rollout_permission.wait()

    def _launch(self, group: UnfinishedGroup) -> None:
        task = asyncio.create_task(self._run_group(group), name=f"group:{group.group_id}")
        self._inflight[group.group_id] = task
        self.inflight_started_at[group.group_id] = time.monotonic()

    async def _run_group(self, group: UnfinishedGroup) -> None:
        # One coroutine drives the group (each await level costs every resume of the task).
        try:
            try:
                await self.rollout_manager.generate_and_push(group)
                self.last_progress_at = time.monotonic()
            except RolloutDropped as dropped:
                self._acc.dropped_prompts += 1
                slot = dropped.slot
                assert slot is not None  # the manager removed it before re-raising
                try:
                    self._after_drop(group, slot)
                finally:
                    self._log_dropped(group)
            except GroupAborted:
                self._acc.aborted_groups += 1
                self._log_dropped(group)
            except asyncio.CancelledError:
                if group.group_id in self._abort_requested and not self._stopping:
                    await self.rollout_manager.drop_aborted(group)
                    self._acc.aborted_groups += 1
                    self._log_dropped(group)
                elif group.group_id in self._redispatch_requested and not self._stopping:
                    # Slot and ledger entry stay: generated again after the sync.
                    self._redispatch_after_sync.append(group)
                else:
                    raise
        except Exception as exc:
            # A budget exceeded, every worker dead, a step shrunk too far: the run must end
            # with this exception instead of the group task dying unobserved.
            self._end_run_with(exc)
        finally:
            self._inflight.pop(group.group_id, None)
            self.inflight_started_at.pop(group.group_id, None)
            self._abort_requested.discard(group.group_id)
            self._redispatch_requested.discard(group.group_id)
            self._notify()

    def _log_dropped(self, group: UnfinishedGroup) -> None:
        if self.events is not None:
            self.events.dropped(group)

    def _after_drop(self, group: UnfinishedGroup, slot: Slot) -> None:
        """A dropped group: replace it from the reserve, or let its step train short (ends the
        run with StepShrunkTooFar below the floor; see ``_groups_for_step``)."""
        if self.settings.on_dropped_prompt == "replace" and self.run_state.replacement_reserve:
            self._replace_dropped(slot)
            return
        step = group.target_step if group.target_step is not None else self.trainer_version
        self.state.dropped_for_step[step] += 1
        self._groups_for_step(step)  # raises StepShrunkTooFar below the step's floor

    def _replace_dropped(self, slot: Slot) -> None:
        """Fill the dropped group's place: move a ready group of a later step forward when one
        exists (the step trains on time), and dispatch a spare prompt for the place it left."""
        self.sampler.on_group_removed(slot)
        hole = slot.target_step
        if hole is not None:
            later = [
                s
                for s in self.buffer.ready_groups()
                if s.target_step is not None and s.target_step > hole
            ]
            if later:
                donor = min(later, key=lambda s: (s.target_step, s.dispatch_index))
                donor_step = donor.target_step
                self.buffer.promote_ready_group(donor.group_id, hole)
                self.sampler.on_group_promoted(from_step=donor_step, to_step=hole)
                if self.events is not None:
                    self.events.promoted(donor.group_id, hole)
                hole = donor_step
        target_step = self.sampler.admit_replacement(hole)
        spare = self.run_state.replacement_reserve.pop(0)
        group = self.rollout_manager.reserve(
            spare, start_weight=self.trainer_version, target_step=target_step
        )
        if self.events is not None:
            self.events.admitted(group)
        self._launch(group)
        self._acc.replaced_prompts += 1

    def _groups_for_step(self, step: int) -> int:
        """The groups step ``step`` trains: num_prompts_per_step less its dropped prompts.

        Below the floor, ceil(num_prompts_per_step x min_step_batch_fraction) (at least 1: the
        fraction is above 0), it raises StepShrunkTooFar. Both pumps ask: the rollout pump
        when a drop shrinks a step, the train pump whenever it sizes the step it assembles,
        so a step emptied by drops ends the run with this error and is never trained.
        """
        dropped = self.state.dropped_for_step.get(step, 0)
        groups = self.settings.num_prompts_per_step - dropped
        floor = math.ceil(
            self.settings.num_prompts_per_step * self.settings.min_step_batch_fraction
        )
        if groups < floor:
            raise StepShrunkTooFar(
                f"step {step} lost {dropped} prompt group(s) and would train {groups} < "
                "ceil(num_prompts_per_step * async_rl.rollout_failure.min_step_batch_fraction) "
                f"= {floor}"
            )
        return groups

    # ------------------------------------------------------------------ train pump

    async def _train_pump(self) -> None:
        while self.state.step < self.settings.max_num_steps and not self.stop_requested:
            trained = await self._train_one_step()
            if not trained:
                if not self.stop_requested:
                    log.info("no complete step can be assembled any more; ending the run")
                break
        await self._await_step_tail()
        self.waiting_on["train"] = "finished"

    async def _train_one_step(self) -> bool:
        version = self.trainer_version
        # Re-read after every wait: drops shrink the step meanwhile (never below its floor,
        # which is at least one group, so the loop below trains a chunk before it ends).
        groups_wanted = self._groups_for_step(version)
        claimed: list[Slot] = []
        # The step's size as planned when its first chunk trained: every chunk passes it (the
        # trainer refuses a count that changes within a step); a drop after that leaves the
        # step fewer rows, and the step runner normalises by the rows the step trains.
        planned_sequences = 0
        began = False
        if self.dynamic_sampling is not None:
            self.dynamic_sampling.begin_step()
        while len(claimed) < groups_wanted:
            await self._evict(version)
            remaining = groups_wanted - len(claimed)
            min_groups = min(self.settings.min_groups_for_streaming_train, remaining)
            slots, _ = await self.sampler.select(
                current_train_weight=version,
                min_prompt_groups=min_groups,
                max_prompt_groups=remaining,
            )
            if slots is not None and self.dynamic_sampling is not None:
                slots = await self._filter_zero_advantage(slots, min_groups=min_groups)
                if slots is None:
                    continue  # too few left to train: select again (it waits when it must)
            if slots is None:
                if self._no_more_groups_can_arrive() or self.stop_requested:
                    await self._roll_back(claimed)
                    return False
                self.waiting_on["train"] = (
                    f"data: {len(claimed)}/{groups_wanted} groups of step {version}"
                )
                waited_from = time.monotonic()
                await self._wait_change()
                self._acc.train_waiting_s += time.monotonic() - waited_from
                groups_wanted = self._groups_for_step(version)
                continue
            self.waiting_on["train"] = f"training chunk of {len(slots)} group(s)"
            if not began:
                if self.settings.stands_down:
                    if not await self._validation_done_before_stand_down():
                        await self._roll_back([*claimed, *slots])
                        return False
                    await self.generation.sleep()
                await self.step_runner.begin(version=version)
                began = True
                planned_sequences = groups_wanted * self.settings.group_size
            claimed.extend(slots)
            await self._train_chunk(slots, version, step_num_sequences=planned_sequences)
        if not began:
            # Unreachable while the floor holds (at least one group, see _groups_for_step);
            # kept so that a step never begun can never be finished.
            raise RuntimeError(f"step {version} assembled no group: refusing to finish it")
        # The previous step's tail ends before this step's optimizer step changes the weights
        # it exports and checkpoints.
        await self._await_step_tail()
        train_metrics = await self.step_runner.finish()
        await self._close_step(claimed)
        ended = time.monotonic()
        acc, self._acc = self._acc, StepAccumulator(started_at=ended)
        acc.ended_at = ended
        # Read now: the next step's begin() may reset what the runner answers.
        tail = self._finish_step(acc, train_metrics, refit=self.step_runner.refit_after_step())
        if self._tail_may_overlap():
            self._step_tail = asyncio.create_task(tail, name=f"step_tail_{self.state.step}")
            self._step_tail.add_done_callback(self._on_tail_done)
        else:
            self.waiting_on["train"] = "weight sync"
            await tail
        return True

    async def _validation_done_before_stand_down(self) -> bool:
        """Colocated with a stand-down: open validation passes end while the engine is still
        awake. False when a stop request came meanwhile (the step is not trained)."""
        if self.validation is None or self.validation.idle:
            return True
        self.waiting_on["train"] = "validation pass (before the stand-down)"
        await self.validation.wait_idle(lambda: self.stop_requested)
        return not self.stop_requested

    def _tail_may_overlap(self) -> bool:
        """Whether the next step may train while this step's weights travel to generation.

        Safe because only ``step_runner.finish`` changes the trainer's weights, and the next
        step awaits the tail before it: the sync exports, and a checkpoint saves, exactly the
        weights of the step just closed. The trainer then never waits for generation to load
        them (on the tiny CPU job that wait was ~10% of an async step). Kept serial where
        the sync needs the trainer itself (CUDA IPC, NCCL), when generation stands down (it
        wakes after the sync) and when this step writes a checkpoint.
        """
        if self.settings.stands_down or not getattr(self.weight_sync, "overlaps_training", False):
            return False
        return self.checkpointer is None or not self.checkpointer.due(self.state.step, last=False)

    async def _finish_step(
        self, acc: StepAccumulator, train_metrics: dict[str, float], *, refit: bool
    ) -> None:
        sync_seconds = await self._sync_weights(refit)
        await self._finish_step_bookkeeping(acc, train_metrics, sync_seconds)

    def _on_tail_done(self, task: asyncio.Task[None]) -> None:
        # A failed tail (a sync error, a hook) ends the run at once, even while the train pump
        # waits for data that a failed sync would never let generation produce.
        if task.cancelled():
            return
        failure = task.exception()
        if failure is not None:
            self._end_run_with(failure)

    def _end_run_with(self, exc: BaseException) -> None:
        """``run`` re-raises ``exc`` (the first such failure wins) and shuts down."""
        if self._fatal is not None and not self._fatal.done():
            self._fatal.set_exception(exc)

    async def _await_step_tail(self) -> None:
        tail, self._step_tail = self._step_tail, None
        if tail is not None:
            self.waiting_on["train"] = "weight sync of the previous step"
            await tail

    async def _evict(self, version: int) -> None:
        evicted = await self.sampler.evict(current_train_weight=version)
        self.eviction_watch.observe(evicted=len(evicted), trained_groups=self.state.consumed_groups)
        if evicted:
            async with self.barrier.mutation():
                await self.data_plane.clear([sid for slot in evicted for sid in slot.sample_ids])
            self._acc.evicted_groups += len(evicted)
            if self.events is not None:
                self.events.evicted([slot.group_id for slot in evicted])
            self._notify()

    async def _train_chunk(
        self, slots: list[Slot], version: int, *, step_num_sequences: int
    ) -> None:
        rows = await self.data_plane.get([sid for slot in slots for sid in slot.sample_ids])
        await self.step_runner.train_chunk(slots, rows, step_num_sequences=step_num_sequences)
        for slot in slots:
            metas = slot.rows_meta
            trained = TrainedGroup(  # positional, in field order: this runs once per group
                slot.group_id,
                slot.start_weight,
                slot.end_weight,
                slot.target_step,
                version - slot.start_weight,  # staleness
                # rewards: one per sibling (an agent episode split into rows counts once)
                [meta.reward for meta in metas]
                if len(metas) == self.settings.group_size
                else episode_rewards(metas),
                sum([meta.num_completion_tokens for meta in metas]),  # completion_tokens
                [meta.env_metrics for meta in metas],  # env_metrics
            )
            self._acc.groups.append(trained)
            if self.keep_trained_groups:
                self.trained_groups.append((self.state.step, trained))

    async def _filter_zero_advantage(
        self, slots: list[Slot], *, min_groups: int
    ) -> list[Slot] | None:
        """Dynamic sampling: drop the chunk's zero-advantage groups (``dynamic_sampling``);
        the rest, or None (their claims rolled back) when fewer than ``min_groups`` remain."""
        assert self.dynamic_sampling is not None
        keep, drop = self.dynamic_sampling.split(slots)
        self._acc.filter_cap_reached = self.dynamic_sampling.cap_reached
        if drop:
            dropped_ids = [slot.group_id for slot in drop]
            # A gated sampler owes the step a fresh group for each: a replacement credit.
            gated = self.sampler.lookahead_at(self.trainer_version) is not None
            async with self.barrier.mutation():
                sample_ids = self.buffer.release_claims(dropped_ids, consumed=True)
                await self.data_plane.clear(sample_ids)
                if gated:
                    for slot in drop:
                        self.sampler.on_group_filtered(slot)
                if self.events is not None:
                    self.events.filtered(dropped_ids)
            self._acc.filtered_groups += len(drop)
            self._acc.filtered_rewards.extend(
                meta.reward for slot in drop for meta in slot.rows_meta
            )
            self._notify()
        if len(keep) < min_groups:  # only after a drop: select claimed at least min_groups
            await self._roll_back(keep)
            return None
        return keep

    async def _close_step(self, claimed: list[Slot]) -> None:
        """Consume the step's groups and advance the step and trainer version as one unit.

        Done under the barrier: a snapshot sees either the step open (its groups selectable
        again after a restore) or closed and counted, never half of it. Rollout permission is
        closed in the same instant, so nothing is dispatched at the new version before
        generation holds the new weights.
        """
        group_ids = [slot.group_id for slot in claimed]
        async with self.barrier.mutation():
            sample_ids = self.buffer.release_claims(group_ids, consumed=True)
            await self.data_plane.clear(sample_ids)
            self.state.consumed_groups += len(group_ids)
            self.state.trainer_version += 1
            self.state.step += 1
            self.state.forget_closed_steps()
            self._rollout_permission.clear()
        if self.events is not None:
            self.events.trained(self.state.step, group_ids)

    async def _roll_back(self, claimed: list[Slot]) -> None:
        if claimed:
            self.buffer.release_claims([slot.group_id for slot in claimed], consumed=False)
            self._notify()

    async def _sync_weights(self, refit: bool) -> float:
        """Push the new weights to generation (permission was closed by ``_close_step``).

        With the drain gate (``async_rl.in_flight_weight_updates: false``) the requests in
        flight finish on the old weights first (``_drain_inflight``); a standing-down engine
        wakes for that. Groups cut off at the drain deadline are generated again afterwards.
        """
        try:
            seconds = 0.0
            awake = not self.settings.stands_down
            if refit and self.settings.drain_timeout_s is not None:
                if not awake:
                    await self.generation.wake()
                    awake = True
                await self._drain_inflight(self.settings.drain_timeout_s)
            if refit:
                seconds = await self.weight_sync.sync(self.trainer_version)
            await self._abort_stale_inflight()
            await self._redispatch_drained()
            if not awake:
                await self.generation.wake()
            if self.validation is not None:
                # Generation holds this version now: its pass (when due) is pinned to it.
                self.validation.on_weights(
                    self.trainer_version, final=self.state.step >= self.settings.max_num_steps
                )
        finally:
            self._rollout_permission.set()
            self._notify()
        return seconds

    async def _drain_inflight(self, timeout_s: float) -> None:
        """The drain gate: nothing is admitted (permission is closed); wait up to
        ``timeout_s`` for the groups in flight, then cancel the ones still generating (their
        requests aborted on the engines) for ``_redispatch_drained``. Groups past generation
        (scoring, committing) are waited for: they never touch the weights again."""
        if not self._inflight:
            return
        started = time.monotonic()
        self.waiting_on["train"] = f"drain gate: {len(self._inflight)} group(s) in flight"
        await asyncio.wait(list(self._inflight.values()), timeout=timeout_s)
        while self._inflight:
            generating = [
                group_id
                for group_id in self._inflight
                if group_id in self.rollout_manager.active_requests
                and group_id not in self._redispatch_requested
            ]
            request_ids = [
                request.request_id
                for group_id in generating
                for request in self.rollout_manager.active_requests[group_id]
            ]
            for group_id in generating:
                self._redispatch_requested.add(group_id)
                self._inflight[group_id].cancel()
            if request_ids:
                await self.generation.abort(request_ids)
            if self._inflight:  # the cancelled ones may have ended during the abort
                await asyncio.wait(list(self._inflight.values()), timeout=DRAIN_POLL_S)
        self._acc.drain_s += time.monotonic() - started

    async def _redispatch_drained(self) -> None:
        """Generate the groups the drain cut off again, on the new weights (or drop the ones
        the sampler says can never be trained, as ``_abort_stale_inflight`` would)."""
        groups, self._redispatch_after_sync = self._redispatch_after_sync, []
        for group in groups:
            slot = self.buffer.slot(group.group_id)
            if self.sampler.should_abort_inflight(
                start_weight=slot.start_weight, current_train_weight=self.trainer_version
            ):
                await self.rollout_manager.drop_aborted(group)
                self._acc.aborted_groups += 1
                self._log_dropped(group)
                continue
            self._launch(group)
            self._acc.redispatched_groups += 1

    async def _abort_stale_inflight(self) -> None:
        """Windowed sampler: in-flight groups that can never be trained are aborted."""
        for group_id, task in list(self._inflight.items()):
            slot = self.buffer.slot(group_id)
            if self.sampler.should_abort_inflight(
                start_weight=slot.start_weight, current_train_weight=self.trainer_version
            ):
                self._abort_requested.add(group_id)
                task.cancel()

    async def _final_checkpoint(self) -> None:
        """The last step's trainer checkpoint, unless it is written already (it holds the
        rollout state of now). A graceful stop after it writes a rollout snapshot instead,
        with rollout snapshots on: groups finished since, and staged siblings, are kept."""
        checkpointer = self.checkpointer
        if checkpointer is None:
            return
        if self.state.step > 0 and checkpointer.last_saved_step != self.state.step:
            await checkpointer.save_trainer_checkpoint()
        elif self.stop_requested and checkpointer.snapshots_enabled:
            snapshot = await checkpointer.attempt_snapshot()
            log.info("rollout snapshot at the stop: %s", snapshot)

    async def _maybe_checkpoint(self) -> None:
        if self.checkpointer is not None and self.checkpointer.due(self.state.step, last=False):
            await self.checkpointer.save_trainer_checkpoint()

    async def _finish_step_bookkeeping(
        self, acc: StepAccumulator, train_metrics: dict[str, float], sync_seconds: float
    ) -> None:
        extra = {f"train/{k}": float(v) for k, v in train_metrics.items()}
        extra.update(
            {
                "buffer_ready": float(self.buffer.num_ready),
                "buffer_reserved": float(self.buffer.num_reserved),
                "inflight": float(len(self._inflight)),
                "consumed_groups": float(self.state.consumed_groups),
            }
        )
        row = acc.close_step(
            step=self.state.step,
            trainer_version=self.trainer_version,
            weight_sync_s=sync_seconds,
            extra=extra,
        )
        self.history.append(row)
        self.last_progress_at = time.monotonic()
        if self.metrics_sink is not None:
            # Written before the step's checkpoint: a restart from it never lacks the row.
            self.metrics_sink.log_step(row)
            period = self.settings.sample_log_period
            if period and self.state.step % period == 0:
                self.metrics_sink.log_samples(
                    self.state.step, self.rollout_manager.take_recent_samples()
                )
        await self._maybe_checkpoint()
        for hook in self.step_hooks:
            await hook(self, row)

    # ------------------------------------------------------------------ coordination

    def _no_more_groups_can_arrive(self) -> bool:
        return self._rollout_done and not self._inflight and self.buffer.num_reserved == 0

    def _notify(self) -> None:
        """Wake everything waiting on a state change (commit, drop, claim, version bump)."""
        changed, self._changed = self._changed, None
        if changed is not None:
            changed.set()
        self.sampler.notify()

    async def _wait_change(self) -> None:
        if self._changed is None:
            self._changed = asyncio.Event()
        await self._changed.wait()
