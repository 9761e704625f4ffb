"""Choose what a restart resumes from (read-only), then re-install it into a controller.

Selection (``plan_restore``) never writes or deletes anything:

- Trainer checkpoints are tried newest first; one whose manifest or files do not verify is
  skipped (with the reason) in favour of the previous valid one.
- ``restore_mode: latest``: under the chosen anchor (the newest valid trainer checkpoint, or
  the bootstrap anchor when no trainer checkpoint exists) the newest committed snapshot whose
  files verify and whose config fingerprint matches is used for the rollout state; otherwise
  the trainer checkpoint's own rollout state. Bootstrap state written under a different
  config is refused, listing each changed dotpath; so is a trainer checkpoint whose
  distillation teacher set (``on_policy_distillation.teachers``) differs from the config's.
- ``restore_mode: trainer_checkpoint``: the trainer checkpoint bundle only; newer periodic
  snapshots are ignored. With bootstrap state but no trainer checkpoint it refuses, because a
  bootstrap snapshot has no model or optimizer state to resume.

Applying a plan (``restore_run``) loads the models and re-installs the chosen rollout state
into the run's ``RunState`` (through the ``CheckpointWriter`` that holds it, with the data
plane, the models and the commit log) and, in ``latest`` mode with the commit log on, replays
the log records written after it (``tandemrl.checkpoint.commit_replay``); ``resume`` then
opens this attempt's log segment and journal entry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandemrl.checkpoint.commit_replay import ReplayedRows, apply_replay, replay_for
from tandemrl.checkpoint.fingerprint import (
    TEACHER_SET_PREFIX,
    compatibility_identity,
    diff_identities,
    fingerprint_digest,
)
from tandemrl.checkpoint.journal import RunJournal
from tandemrl.checkpoint.layout import (
    MANIFEST,
    CheckpointCorrupt,
    bootstrap_dir,
    list_snapshot_dirs,
    list_step_dirs,
    verify_bundle,
)
from tandemrl.checkpoint.rollout_state import apply_rollout_state, read_rollout_state
from tandemrl.checkpoint.writer import CheckpointWriter
from tandemrl.config.models import MasterConfig

log = logging.getLogger(__name__)


class RestoreRefused(RuntimeError):
    """The checkpoint directory holds state this run must not resume or overwrite."""


@dataclass
class Candidate:
    path: Path
    kind: str  # trainer | snapshot | bootstrap
    chosen: bool
    reason: str


@dataclass
class RestorePlan:
    checkpoint_dir: Path
    restore_mode: str
    trainer_dir: Path | None = None
    rollout_dir: Path | None = None
    step: int = 0
    considered: list[Candidate] = field(default_factory=list)

    @property
    def fresh(self) -> bool:
        return self.trainer_dir is None and self.rollout_dir is None

    def describe(self) -> str:
        if self.fresh:
            return f"fresh start in {self.checkpoint_dir}"
        source = (
            self.rollout_dir if self.rollout_dir != self.trainer_dir else "the trainer checkpoint"
        )
        return f"resume after step {self.step} from {self.trainer_dir or 'the initial model'}; rollout state from {source}"


def _fingerprint_problem(manifest: dict[str, Any], identity: dict[str, Any] | None) -> str | None:
    """Why a manifest's config differs from ``identity`` (None: no config, nothing checked)."""
    if identity is None or manifest.get("fingerprint") == fingerprint_digest(identity):
        return None
    changed = diff_identities(manifest.get("identity", {}), identity)
    return "config changed since it was written: " + (
        "; ".join(changed) if changed else "fingerprint differs"
    )


def _teacher_set_problem(manifest: dict[str, Any], identity: dict[str, Any] | None) -> str | None:
    """The changed teacher-set dotpaths between a bundle's config and ``identity`` (None: the
    same teachers, or no config to compare)."""
    if identity is None:
        return None

    def teachers(values: dict[str, Any]) -> dict[str, Any]:
        return {
            path: value for path, value in values.items() if path.startswith(TEACHER_SET_PREFIX)
        }

    changed = diff_identities(teachers(manifest.get("identity", {})), teachers(identity))
    return "; ".join(changed) if changed else None


def _newest_valid_snapshot(
    anchor: Path, identity: dict[str, Any] | None, plan: RestorePlan
) -> Path | None:
    chosen = None
    for _, path in reversed(list_snapshot_dirs(anchor)):
        if chosen is not None:
            plan.considered.append(
                Candidate(path, "snapshot", False, "older than the chosen snapshot")
            )
            continue
        try:
            manifest = verify_bundle(path).manifest
        except CheckpointCorrupt as exc:
            plan.considered.append(Candidate(path, "snapshot", False, f"corrupt: {exc}"))
            continue
        problem = _fingerprint_problem(manifest, identity)
        if problem is not None:
            plan.considered.append(Candidate(path, "snapshot", False, problem))
            continue
        if manifest.get("step") != plan.step:
            plan.considered.append(
                Candidate(path, "snapshot", False, f"anchored on step {manifest.get('step')}")
            )
            continue
        plan.considered.append(
            Candidate(path, "snapshot", True, "newest compatible committed snapshot")
        )
        chosen = path
    return chosen


def plan_restore(cfg: MasterConfig) -> RestorePlan:
    if not cfg.checkpointing.enabled:
        return RestorePlan(
            Path(cfg.checkpointing.checkpoint_dir), cfg.rollout_checkpointing.restore_mode
        )
    return plan_restore_dir(
        Path(cfg.checkpointing.checkpoint_dir),
        restore_mode=cfg.rollout_checkpointing.restore_mode,
        identity=compatibility_identity(cfg),
    )


def plan_restore_dir(
    checkpoint_dir: Path, *, restore_mode: str, identity: dict[str, Any] | None
) -> RestorePlan:
    """``plan_restore`` on a directory; ``identity`` None skips every fingerprint check
    (``tandemrl inspect`` without ``--config``). Read-only, like ``plan_restore``."""
    plan = RestorePlan(checkpoint_dir, restore_mode)

    for step, path in reversed(list_step_dirs(checkpoint_dir)):
        if plan.trainer_dir is not None:
            plan.considered.append(
                Candidate(path, "trainer", False, "older than the chosen checkpoint")
            )
            continue
        try:
            verify_bundle(path)
        except CheckpointCorrupt as exc:
            log.warning("skipping damaged trainer checkpoint %s: %s", path, exc)
            plan.considered.append(Candidate(path, "trainer", False, f"corrupt: {exc}"))
            continue
        teachers_changed = _teacher_set_problem(_read_manifest(path), identity)
        if teachers_changed is not None:
            raise RestoreRefused(
                f"{path} was trained with other distillation teachers than this config names "
                f"({teachers_changed}); its buffered rows hold those teachers' logprobs. Restart "
                "with the original on_policy_distillation.teachers, or choose a new "
                "checkpointing.checkpoint_dir. Nothing was modified."
            )
        plan.trainer_dir = path
        plan.rollout_dir = path
        plan.step = step
        plan.considered.append(Candidate(path, "trainer", True, "newest valid trainer checkpoint"))

    if plan.trainer_dir is None and plan.considered:
        # Every published trainer checkpoint is damaged: starting over would silently drop the
        # run's progress (and retention would later delete the evidence).
        damaged = "; ".join(candidate.reason for candidate in plan.considered)
        raise RestoreRefused(
            f"no trainer checkpoint in {checkpoint_dir} verifies ({damaged}). Repair or move the "
            "damaged step_N folders aside to start over, or choose a new "
            "checkpointing.checkpoint_dir. Nothing was modified."
        )

    bootstrap = bootstrap_dir(checkpoint_dir)
    if plan.restore_mode == "trainer_checkpoint":
        if plan.trainer_dir is None and bootstrap.exists():
            raise RestoreRefused(
                f"rollout_checkpointing.restore_mode=trainer_checkpoint, but {checkpoint_dir} holds only "
                f"bootstrap state ({bootstrap}) and no trainer checkpoint: a bootstrap snapshot has no model "
                "or optimizer state. Use restore_mode=latest to recover it, or choose a new "
                "checkpointing.checkpoint_dir to start from scratch. Nothing was modified."
            )
        return plan

    if plan.trainer_dir is not None:
        snapshot = _newest_valid_snapshot(plan.trainer_dir, identity, plan)
        if snapshot is not None:
            plan.rollout_dir = snapshot
        return plan

    if (bootstrap / MANIFEST).exists():
        try:
            manifest = json.loads((bootstrap / MANIFEST).read_text())
        except (OSError, ValueError) as exc:  # bad JSON or bytes that are not UTF-8
            raise RestoreRefused(
                f"{bootstrap / MANIFEST}: unreadable bootstrap manifest ({exc})"
            ) from exc
        problem = _fingerprint_problem(manifest, identity)
        if problem is not None:
            raise RestoreRefused(
                f"bootstrap state in {bootstrap} cannot be recovered by this config — {problem}. "
                "Restart with the original config, or choose a new checkpointing.checkpoint_dir. "
                "Nothing was modified."
            )
        plan.considered.append(
            Candidate(bootstrap, "bootstrap", True, "bootstrap anchor (no trainer checkpoint)")
        )
        plan.rollout_dir = _newest_valid_snapshot(bootstrap, identity, plan)
    return plan


def _read_manifest(bundle: Path) -> dict[str, Any]:
    """A verified bundle's manifest (an unreadable one reads as empty: nothing to compare)."""
    try:
        manifest = json.loads((bundle / MANIFEST).read_text())
    except (OSError, ValueError):
        return {}
    return manifest if isinstance(manifest, dict) else {}


# async (trainer_version) -> seconds: push the trainer's weights to generation.
SyncWeights = Callable[[int], Awaitable[float]]


async def restore_run(
    plan: RestorePlan,
    checkpoints: CheckpointWriter,
    *,
    replayed_rows: ReplayedRows,
    sync_weights: SyncWeights,
) -> dict[str, Any]:
    """Load weights/optimizer (policy, critic) and the rollout state chosen by ``plan`` into
    what ``checkpoints`` writes, then replay the commit log on top of it (``latest`` mode, log
    on). The summary's ``commit_log_tip`` is the LSN of the last record the restored state
    contains (None: the state is not on the log)."""
    if plan.fresh:
        return {"commit_log_tip": None}
    run = checkpoints.run
    if plan.trainer_dir is not None:
        # step_N exists already: the final checkpoint of a run resumed after its last step must
        # not rewrite it (that would drop the snapshots anchored on it).
        checkpoints.mark_saved(plan.step)
        for folder, model in checkpoints.models.items():
            await model.load_checkpoint(plan.trainer_dir / folder, load_optimizer=True)
    assert plan.rollout_dir is not None
    state = read_rollout_state(plan.rollout_dir)
    if state.controller["step"] != plan.step:
        raise CheckpointCorrupt(
            f"{plan.rollout_dir}: rollout state is for step {state.controller['step']} but its anchor is step {plan.step}"
        )
    summary: dict[str, Any] = dict(
        await apply_rollout_state(run, state, plan.rollout_dir, checkpoints.data_plane)
    )
    summary["commit_log_tip"] = None
    commit_log = checkpoints.commit_log
    if commit_log is not None and state.commit_log_next_lsn is not None:
        from_lsn = state.commit_log_next_lsn
        if plan.restore_mode == "trainer_checkpoint":
            replay, tip = replay_for(plan.checkpoint_dir, None)
            tip = from_lsn - 1  # the bundle alone: later records are another branch now
        else:
            replay, tip = replay_for(plan.checkpoint_dir, from_lsn)
        summary["commit_log_tip"] = tip
        summary["commit_log"] = await apply_replay(
            run, replay, rows=replayed_rows, source=str(commit_log.directory)
        )
    if plan.step > 0:
        # Generation workers started from the initial model: give them the restored weights.
        await sync_weights(run.controller.trainer_version)
    return summary


async def resume(
    plan: RestorePlan,
    checkpoints: CheckpointWriter,
    *,
    replayed_rows: ReplayedRows,
    sync_weights: SyncWeights,
    journal: RunJournal | None = None,
) -> dict[str, Any]:
    """Restore ``plan`` (``restore_run``), open this attempt in the commit log and the run
    journal. A fresh start with the log on writes a bootstrap snapshot at once, so that from
    the first commit on every moment has a bundle to replay the log from."""
    summary = await restore_run(
        plan, checkpoints, replayed_rows=replayed_rows, sync_weights=sync_weights
    )
    commit_log = checkpoints.commit_log
    if commit_log is not None:
        commit_log.open(parent=summary["commit_log_tip"], step=plan.step)
        interval = checkpoints.cfg.rollout_checkpointing.snapshot_attempt_interval_s
        if plan.fresh and interval is not None:
            await checkpoints.attempt_snapshot()
    if journal is not None:
        run = checkpoints.run
        restored_committed = [slot.group_id for slot in run.buffer.ready_groups()]
        restored_staged = [
            [group.group_id, sibling]
            for group in run.recovered_groups
            for sibling in sorted(group.staged)
        ]
        journal.record(
            "start",
            resumed_step=plan.step,
            source=None if plan.fresh else str(plan.rollout_dir),
            restored_committed=restored_committed,
            restored_staged=restored_staged,
            replayed=summary.get("commit_log"),
        )
    return summary
