"""Choose what a restart resumes from (read-only), then re-install it into a controller.

Selection (``plan_restore``) never writes or deletes anything:

- Trainer checkpoints are tried newest first; one whose manifest or files do not verify is
  skipped (with the reason) in favour of the previous valid one.
- ``restore_mode: latest``: under the chosen anchor (the newest valid trainer checkpoint, or
  the bootstrap anchor when no trainer checkpoint exists) the newest committed snapshot whose
  files verify and whose config fingerprint matches is used for the rollout state; otherwise
  the trainer checkpoint's own rollout state. Bootstrap state written under a different
  config is refused, listing each changed dotpath.
- ``restore_mode: trainer_checkpoint``: the trainer checkpoint bundle only; newer periodic
  snapshots are ignored. With bootstrap state but no trainer checkpoint it refuses, because a
  bootstrap snapshot has no model or optimizer state to resume.

The rollout state a plan resumes was generated under a config: the identity recorded in the
chosen bundle's manifest, and in the ``open`` record of every later attempt whose commit-log
records the restart replays. When one of them differs from the current config's
(``identity_changes``: operational keys never count), the plan carries a ``ConfigChange``
listing every changed dotpath, and ``rollout_checkpointing.on_config_change`` decides:
``refuse`` (``plan_restore`` raises ``RestoreRefused``; nothing was started or modified),
``drop_rollouts`` (``restore_run`` turns every restored committed and unfinished group into
one generated again) or ``keep`` (refused when the distillation teacher set changed: the rows
hold the old teachers' logprobs). After either of the last two, ``resume`` writes a rollout
snapshot at once under the new identity, so the choice is made once.

Applying a plan (``restore_run``) loads the models and re-installs the chosen rollout state
into the run's ``RunState`` (through the ``CheckpointWriter`` that holds it, with the data
plane, the models and the commit log) and, in ``latest`` mode with the commit log on, replays
the log records written after it (``tandemrl.checkpoint.commit_replay``); ``resume`` then
opens this attempt's log segment and journal entry.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from tandemrl.checkpoint.commit_log import branch_opens, read_log
from tandemrl.checkpoint.commit_replay import (
    ReplayedRows,
    apply_replay,
    commit_log_dir,
    replay_for,
)
from tandemrl.checkpoint.fingerprint import (
    BUILTIN_EXCLUDED_PATHS,
    TEACHER_SET_PREFIX,
    compatibility_identity,
    excluded_patterns,
    fingerprint_digest,
    identity_changes,
)
from tandemrl.checkpoint.journal import RunJournal
from tandemrl.checkpoint.layout import (
    MANIFEST,
    TRAIN_STATE,
    CheckpointCorrupt,
    bootstrap_dir,
    list_snapshot_dirs,
    list_step_dirs,
    read_manifest,
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


ON_CONFIG_CHANGE = ("refuse", "drop_rollouts", "keep")
# Changes no policy can resume: the saved buffer holds groups of the old size, the saved
# dispatch position belongs to the old sampler.
UNRESUMABLE_CHANGES = (
    "grpo.num_generations_per_prompt",
    "ppo.num_generations_per_prompt",
    "on_policy_distillation.num_generations_per_prompt",
    "async_rl.sampler.name",
)


@dataclass
class ConfigChange:
    """The rollout state a plan resumes was generated under another config.

    ``sources``: where each differing identity is recorded (the bundle's manifest, or the
    ``open`` record of a later attempt on the replayed log branch) with its changed dotpaths
    (``path: old -> new``, credentials redacted). ``policy``: the current config's
    ``rollout_checkpointing.on_config_change``.
    """

    policy: str
    sources: list[tuple[str, list[str]]]

    @property
    def changes(self) -> list[str]:
        """Every changed dotpath line, each once, in the order the sources name them."""
        return list(dict.fromkeys(line for _, lines in self.sources for line in lines))

    def lines(self) -> list[str]:
        return [f"{line}  (since {where})" for where, lines in self.sources for line in lines]

    def refusal(self, rollout_dir: Path | None) -> str:
        changed = "\n".join(f"  {line}" for line in self.lines())
        return (
            f"the rollout state this restart would resume ({rollout_dir}) was generated under "
            f"a different config, and rollout_checkpointing.on_config_change is refuse:\n"
            f"{changed}\n"
            "To go on: restart with the original values; or set "
            "rollout_checkpointing.on_config_change=drop_rollouts (resume the model, optimizer "
            "and data position, and generate the buffered and unfinished groups again); or "
            "=keep (train them as they are: only when the change does not alter what a "
            "rollout means, e.g. a learning rate); or choose a new "
            "checkpointing.checkpoint_dir. Nothing was started or modified."
        )


@dataclass
class RestorePlan:
    checkpoint_dir: Path
    restore_mode: str
    trainer_dir: Path | None = None
    rollout_dir: Path | None = None
    step: int = 0
    considered: list[Candidate] = field(default_factory=list)
    # Set when the rollout state was generated under another config (None: same config, or
    # not checked).
    config_change: ConfigChange | None = None

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


@dataclass(frozen=True)
class CurrentConfig:
    """What a plan compares stored identities with: the current config's identity, the
    patterns taken out of stored ones (operational keys, extra exclusions), and what the
    config says to do about a change."""

    identity: dict[str, Any]
    excluded: Sequence[str] = BUILTIN_EXCLUDED_PATHS
    on_config_change: str = "refuse"
    commit_log: bool = True

    @classmethod
    def of(cls, cfg: MasterConfig) -> CurrentConfig:
        return cls(
            identity=compatibility_identity(cfg),
            excluded=tuple(excluded_patterns(cfg)),
            on_config_change=cfg.rollout_checkpointing.on_config_change,
            commit_log=cfg.rollout_checkpointing.commit_log,
        )

    @cached_property
    def fingerprint(self) -> str:
        return fingerprint_digest(self.identity)

    def changes_since(self, stored: Any, fingerprint: Any = None) -> list[str]:
        """The changed dotpaths of a stored identity (empty: compatible)."""
        if fingerprint is not None and fingerprint == self.fingerprint:
            return []
        if not isinstance(stored, dict):
            return ["<no config identity recorded>"]
        return identity_changes(stored, self.identity, self.excluded)


def _fingerprint_problem(manifest: dict[str, Any], current: CurrentConfig | None) -> str | None:
    """Why a manifest's config differs from the current one (None: same, or not checked)."""
    if current is None:
        return None
    changed = current.changes_since(manifest.get("identity"), manifest.get("fingerprint"))
    return ("config changed since it was written: " + "; ".join(changed)) if changed else None


def _newest_valid_snapshot(
    anchor: Path, current: CurrentConfig | None, plan: RestorePlan
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
        problem = _fingerprint_problem(manifest, current)
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
    """What a restart resumes (read-only); raises ``RestoreRefused`` when it must not start,
    a changed config under ``on_config_change: refuse`` included."""
    if not cfg.checkpointing.enabled:
        return RestorePlan(
            Path(cfg.checkpointing.checkpoint_dir), cfg.rollout_checkpointing.restore_mode
        )
    plan = plan_restore_dir(
        Path(cfg.checkpointing.checkpoint_dir),
        restore_mode=cfg.rollout_checkpointing.restore_mode,
        current=CurrentConfig.of(cfg),
    )
    refusal = config_change_refusal(plan)
    if refusal is not None:
        raise RestoreRefused(refusal)
    return plan


def config_change_refusal(plan: RestorePlan) -> str | None:
    """Why a restart must not start because of its config change (None: it may)."""
    change = plan.config_change
    if change is None:
        return None
    if change.policy == "refuse":
        return change.refusal(plan.rollout_dir)
    unresumable = [line for line in change.changes if line.split(":")[0] in UNRESUMABLE_CHANGES]
    teachers = [line for line in change.changes if line.startswith(TEACHER_SET_PREFIX)]
    if change.policy == "keep" and teachers:
        return (
            f"the rollout state in {plan.rollout_dir} was scored by other distillation teachers "
            f"({'; '.join(teachers)}): its rows hold those teachers' logprobs, so "
            "rollout_checkpointing.on_config_change=keep would train toward the old teachers. "
            "Set it to drop_rollouts (the groups are generated and scored again), restart with "
            "the original on_policy_distillation.teachers, or choose a new "
            "checkpointing.checkpoint_dir. Nothing was started or modified."
        )
    if not unresumable:
        return None
    return (
        f"the rollout state in {plan.rollout_dir} cannot be resumed under "
        f"{'; '.join(unresumable)}, whatever rollout_checkpointing.on_config_change says (the "
        "saved buffer and dispatch position belong to the old value). Restart with the "
        "original value, or choose a new checkpointing.checkpoint_dir. Nothing was started "
        "or modified."
    )


def log_config_change(plan: RestorePlan) -> None:
    """Say what changed and what the restart does about it (before anything trains)."""
    change = plan.config_change
    if change is None:
        return
    what = {
        "drop_rollouts": "the buffered and unfinished groups are generated again",
        "keep": "the buffered and unfinished groups are kept and trained as they are "
        "(your explicit choice)",
        "refuse": "the restart is refused",
    }[change.policy]
    log.warning(
        "config changed since the rollout state in %s was generated; "
        "rollout_checkpointing.on_config_change=%s: %s",
        plan.rollout_dir,
        change.policy,
        what,
    )
    for line in change.lines():
        log.warning("  changed: %s", line)


def plan_restore_dir(
    checkpoint_dir: Path, *, restore_mode: str, current: CurrentConfig | None
) -> RestorePlan:
    """``plan_restore`` on a directory, without refusing a changed config (the plan says what
    changed); ``current`` None skips every fingerprint check (``tandemrl inspect`` without
    ``--config``). Read-only, like ``plan_restore``."""
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
        plan.config_change = _config_change(plan, current)
        return plan

    if plan.trainer_dir is not None:
        snapshot = _newest_valid_snapshot(plan.trainer_dir, current, plan)
        if snapshot is not None:
            plan.rollout_dir = snapshot
        plan.config_change = _config_change(plan, current)
        return plan

    if (bootstrap / MANIFEST).exists():
        try:
            manifest = json.loads((bootstrap / MANIFEST).read_text())
        except (OSError, ValueError) as exc:  # bad JSON or bytes that are not UTF-8
            raise RestoreRefused(
                f"{bootstrap / MANIFEST}: unreadable bootstrap manifest ({exc})"
            ) from exc
        problem = _fingerprint_problem(manifest, current)
        if problem is not None:
            # Before the first step there is no trained model to carry over: every
            # on_config_change policy refuses, as the reference does for bootstrap state.
            raise RestoreRefused(
                f"bootstrap state in {bootstrap} cannot be recovered by this config — {problem}. "
                "Restart with the original config, or choose a new checkpointing.checkpoint_dir "
                "(rollout_checkpointing.on_config_change does not apply before the first "
                "trainer checkpoint). Nothing was modified."
            )
        plan.considered.append(
            Candidate(bootstrap, "bootstrap", True, "bootstrap anchor (no trainer checkpoint)")
        )
        plan.rollout_dir = _newest_valid_snapshot(bootstrap, current, plan)
    return plan


def _config_change(plan: RestorePlan, current: CurrentConfig | None) -> ConfigChange | None:
    """Compare the identities the chosen rollout state was generated under with the current
    config: the bundle's own, then each later attempt's on the log branch it replays."""
    if current is None or plan.rollout_dir is None:
        return None
    sources: list[tuple[str, list[str]]] = []
    try:
        manifest = read_manifest(plan.rollout_dir)
    except CheckpointCorrupt:
        return None  # selection verified it; a failure now is reported by the restore itself
    changed = current.changes_since(manifest.get("identity"), manifest.get("fingerprint"))
    if changed:
        sources.append((_short(plan), changed))
    if current.commit_log and plan.restore_mode == "latest":
        for record in _replayed_opens(plan):
            if "identity" not in record:
                continue  # written before attempts recorded their identity
            changed = current.changes_since(record["identity"], record.get("fingerprint"))
            if changed:
                sources.append((f"the attempt at commit log LSN {record['lsn']}", changed))
    if not sources:
        return None
    return ConfigChange(policy=current.on_config_change, sources=sources)


def _short(plan: RestorePlan) -> str:
    assert plan.rollout_dir is not None
    return str(plan.rollout_dir.relative_to(plan.checkpoint_dir))


def _replayed_opens(plan: RestorePlan) -> list[dict[str, Any]]:
    """The ``open`` records of the attempts whose log records the restart replays."""
    assert plan.rollout_dir is not None
    try:
        train_state = json.loads((plan.rollout_dir / TRAIN_STATE).read_text())
        next_lsn = (train_state.get("commit_log") or {}).get("next_lsn")
        if next_lsn is None:
            return []
        return branch_opens(read_log(commit_log_dir(plan.checkpoint_dir)).records, int(next_lsn))
    except (OSError, ValueError, TypeError, AttributeError, CheckpointCorrupt):
        return []  # unreadable: the restore itself fails on it, naming the file


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
    if plan.config_change is not None:
        summary["config_change"] = await _apply_config_change(plan, checkpoints)
    if plan.step > 0:
        # Generation workers started from the initial model: give them the restored weights.
        await sync_weights(run.controller.trainer_version)
    return summary


async def _apply_config_change(plan: RestorePlan, checkpoints: CheckpointWriter) -> dict[str, Any]:
    """``drop_rollouts``: every restored group is generated again (its admission, target step
    and dataloader position kept); ``keep``: nothing changes. Either way, say what happened."""
    change = plan.config_change
    assert change is not None and change.policy in ("drop_rollouts", "keep"), change
    run = checkpoints.run
    result: dict[str, Any] = {"policy": change.policy, "changes": change.changes}
    if change.policy == "keep":
        result.update(
            kept_committed=[slot.group_id for slot in run.buffer.ready_groups()],
            kept_unfinished=[group.group_id for group in run.recovered_groups],
        )
        log.warning(
            "on_config_change=keep: %d committed and %d unfinished group(s) generated under the "
            "previous config are kept and trained",
            len(result["kept_committed"]),
            len(result["kept_unfinished"]),
        )
        return result
    try:
        dropped = run.drop_restored_rollouts()
    except ValueError as exc:
        raise CheckpointCorrupt(f"{plan.rollout_dir}: {exc}") from exc
    await checkpoints.data_plane.clear(dropped.sample_ids)
    result.update(
        dropped_committed=dropped.committed,
        dropped_unfinished=dropped.unfinished,
        discarded_siblings=dropped.discarded_siblings,
    )
    log.warning(
        "on_config_change=drop_rollouts: %d committed and %d unfinished group(s) generated under "
        "the previous config are generated again (%d finished sibling(s) discarded); the "
        "dataloader and sampler positions are kept",
        len(dropped.committed),
        len(dropped.unfinished),
        dropped.discarded_siblings,
    )
    return result


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
        commit_log.open(
            parent=summary["commit_log_tip"],
            step=plan.step,
            fingerprint=checkpoints.fingerprint,
            identity=checkpoints.identity,
        )
        interval = checkpoints.cfg.rollout_checkpointing.snapshot_attempt_interval_s
        if plan.fresh and interval is not None:
            await checkpoints.attempt_snapshot()
    if plan.config_change is not None and plan.trainer_dir is not None:
        # The state as drop_rollouts/keep left it, under this config's identity: a later
        # restart with this config resumes from it without asking again.
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
            fingerprint=checkpoints.fingerprint,
            config_change=summary.get("config_change"),
        )
    return summary
