"""Writes trainer checkpoints at step boundaries and periodic rollout snapshots between them.

Trainer checkpoint (``checkpointing.save_period``, and the last step): the policy (and critic)
weights and optimizer, the controller state, and — with ``save_data_plane`` — the rollout
state: data-plane rows of committed unconsumed groups, the replay index, the ownership ledger,
the replacement reserve and the sampler's dispatch position. The rows and the index are taken
under the checkpoint barrier, so they describe the same groups.

Periodic rollout snapshot (``rollout_checkpointing.snapshot_attempt_interval_s``): the rollout
state alone, anchored on the trainer checkpoint of the current step (and one more at a graceful
stop whose step is already checkpointed). An attempt after step N
succeeds only when ``step_N`` is durable; before the first step, snapshots are anchored on the
bootstrap manifest (initial model + config fingerprint). ``keep_latest_k`` snapshots are kept
per anchor; bootstrap snapshots are removed once a trainer checkpoint is durable.

Commit log (``rollout_checkpointing.commit_log``): a bundle records the log position of its
capture and is published only once the log is durable up to it; after each write, log
segments that no selectable bundle replays any more are removed, and every trainer checkpoint
starts a new segment.

Best checkpoint (``checkpointing.metric_name``): validation passes score the checkpoint of the
version they evaluated (``note_validation``); retention keeps the best one besides the latest
``keep_top_k`` and records it in ``best_checkpoint.json`` (``tandemrl.checkpoint.best``).

The writer is built with what it writes — the ``RunState`` (captured with ``capture``), the
data plane, the checkpoint barrier, the models by folder name (``policy``, ``value``) and the
commit log — and never sees the controller.
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from tandemrl.barrier import CheckpointBarrier
from tandemrl.checkpoint.best import BEST_FILE, best_record, choose_best, score_of, steps_to_keep
from tandemrl.checkpoint.commit_log import CommitLog, needed_from_lsn
from tandemrl.checkpoint.fingerprint import compatibility_identity, fingerprint_digest
from tandemrl.checkpoint.layout import (
    MANIFEST,
    SNAPSHOTS_DIR,
    TRAIN_STATE,
    bootstrap_dir,
    list_snapshot_dirs,
    list_step_dirs,
    sha256_file,
    snapshot_dir,
    step_dir,
    write_manifest,
)
from tandemrl.checkpoint.rollout_state import write_rollout_state
from tandemrl.config.models import MasterConfig
from tandemrl.dataplane.atomic import (
    atomic_directory,
    remove_stale_temporaries,
    write_json_atomic,
)
from tandemrl.dataplane.base import DataPlane
from tandemrl.run_state import RolloutState, RunState

log = logging.getLogger(__name__)


def model_identity(model_path: str | None) -> dict[str, str]:
    """sha256 of the initial model's config and weight files (what bootstrap state assumes)."""
    if model_path is None:
        return {}
    root = Path(model_path)
    files = sorted([*root.glob("*.safetensors"), *root.glob("config.json")])
    return {path.name: sha256_file(path) for path in files}


class CheckpointedModel(Protocol):
    """A model a trainer checkpoint holds (the policy trainer, the PPO critic)."""

    async def save_checkpoint(self, directory: Path, *, save_optimizer: bool) -> None: ...

    async def load_checkpoint(self, directory: Path, *, load_optimizer: bool) -> None: ...


class CheckpointWriter:
    def __init__(
        self,
        cfg: MasterConfig,
        *,
        model_path: str | None,
        authoritative: bool,
        run: RunState,
        data_plane: DataPlane,
        barrier: CheckpointBarrier,
        models: Mapping[str, CheckpointedModel],
        commit_log: CommitLog | None = None,
    ) -> None:
        self.cfg = cfg
        self.checkpoint_dir = Path(cfg.checkpointing.checkpoint_dir)
        self.model_path = model_path
        # False for samplers without supports_buffer_checkpoint: shadow mode.
        self.authoritative = authoritative
        self.run = run
        self.data_plane = data_plane
        self.barrier = barrier
        # Sub-folder of step_N -> the model saved there (policy/, value/), in save order.
        self.models = dict(models)
        self.commit_log = commit_log
        # The last step whose trainer checkpoint is durable (written here, or found at restore).
        self.last_saved_step: int | None = None
        self.identity = compatibility_identity(cfg)
        self.fingerprint = fingerprint_digest(self.identity)
        self.snapshots_written = 0
        self.snapshots_skipped = 0
        self._snapshot_lock = asyncio.Lock()
        # Trainer version -> value of checkpointing.metric_name its validation pass reported.
        self.validation_scores: dict[int, float] = {}
        self._warned_missing_metric = False

    # ------------------------------------------------------------------ trainer checkpoints

    def due(self, step: int, *, last: bool) -> bool:
        return self.cfg.checkpointing.enabled and (
            last or step % self.cfg.checkpointing.save_period == 0
        )

    async def save_trainer_checkpoint(self) -> Path:
        step = self.run.controller.step
        target = step_dir(self.checkpoint_dir, step)
        started = time.perf_counter()
        save_optimizer = self.cfg.checkpointing.save_optimizer
        async with self._snapshot_lock:
            with atomic_directory(target) as tmp:
                for folder, model in self.models.items():
                    await model.save_checkpoint(tmp / folder, save_optimizer=save_optimizer)
                await self._write_rollout(tmp)
                write_manifest(tmp, self._manifest_payload("trainer"))
            self.last_saved_step = step
            self._retain_trainer_checkpoints()
            self._drop_bootstrap_snapshots()
            # Folders of writes a crash interrupted (never selected); ours is published by now.
            remove_stale_temporaries(self.checkpoint_dir)
            if self.commit_log is not None:
                self.commit_log.rotate()
                self._trim_commit_log(self.commit_log)
        log.info("trainer checkpoint %s written in %.2f s", target, time.perf_counter() - started)
        return target

    def mark_saved(self, step: int) -> None:
        """``step_<step>`` is already durable (a restore resumed from it): never rewrite it."""
        self.last_saved_step = step

    def _capture(self) -> RolloutState:
        """The run state now (call under the barrier), with the commit log's position."""
        # Without save_data_plane (or in shadow mode) the index is not authoritative: the
        # prompts of committed groups are kept instead, to be regenerated on restore.
        authoritative = self.authoritative and self.cfg.checkpointing.save_data_plane
        state = self.run.capture(authoritative=authoritative)
        commit_log = self.commit_log
        if authoritative and commit_log is not None and commit_log.opened:
            state.commit_log_next_lsn = commit_log.next_lsn
        return state

    async def _write_rollout(self, directory: Path) -> None:
        async with self.barrier.capture():
            state = self._capture()
            await write_rollout_state(directory, state, self.data_plane)
        await self._log_durable_through(state)

    async def _log_durable_through(self, state: RolloutState) -> None:
        """A bundle is published only once every log record its state contains is durable,
        so the log has no gap before any selectable bundle."""
        if state.commit_log_next_lsn is not None:
            assert self.commit_log is not None  # only a writer with a log sets the position
            await self.commit_log.wait_durable(state.commit_log_next_lsn)

    def _trim_commit_log(self, commit_log: CommitLog) -> None:
        """Remove log segments older than what every selectable bundle replays from."""
        anchors = [path for _, path in list_step_dirs(self.checkpoint_dir)]
        anchors.append(bootstrap_dir(self.checkpoint_dir))
        bundles = [path for path in anchors if (path / MANIFEST).is_file()]
        bundles += [path for anchor in anchors for _, path in list_snapshot_dirs(anchor)]
        positions = []
        for bundle in bundles:
            try:
                train_state = json.loads((bundle / TRAIN_STATE).read_text())
            except (OSError, ValueError):
                continue  # the bootstrap anchor itself, or a damaged bundle: never replayed
            positions.append((train_state.get("commit_log") or {}).get("next_lsn"))
        keep_from = needed_from_lsn(positions)
        if keep_from is not None:
            removed = commit_log.trim(keep_from)
            if removed:
                log.info("commit log: removed %d segment(s) below LSN %d", len(removed), keep_from)

    def _manifest_payload(self, kind: str) -> dict[str, Any]:
        counters = self.run.controller
        return {
            "kind": kind,
            "step": counters.step,
            "trainer_version": counters.trainer_version,
            "fingerprint": self.fingerprint,
            "identity": self.identity,
            "authoritative": self.authoritative,
            "created_unix": time.time(),
        }

    def _retain_trainer_checkpoints(self) -> None:
        ckpt = self.cfg.checkpointing
        steps = list_step_dirs(self.checkpoint_dir)
        best = None
        if ckpt.metric_name is not None:
            best = choose_best(
                self.validation_scores,
                [step for step, _ in steps],
                higher_is_better=ckpt.higher_is_better,
            )
        if ckpt.keep_top_k is not None:
            pending = [] if self.run.validation is None else self.run.validation.open_versions()
            kept = steps_to_keep(
                [step for step, _ in steps], keep_latest=ckpt.keep_top_k, best=best, pending=pending
            )
            for step, path in steps:
                if step not in kept:
                    shutil.rmtree(path, ignore_errors=True)
        if ckpt.metric_name is not None:
            on_disk = [step for step, _ in list_step_dirs(self.checkpoint_dir)]
            record = best_record(
                self.checkpoint_dir,
                metric_name=ckpt.metric_name,
                higher_is_better=ckpt.higher_is_better,
                scores=self.validation_scores,
                on_disk=on_disk,
            )
            write_json_atomic(self.checkpoint_dir / BEST_FILE, record)

    # ------------------------------------------------------------------ best checkpoint

    def seed_validation_scores(self, reported: Mapping[int, Mapping[str, Any]]) -> None:
        """Scores of the passes a restored run's lineage reported (from the run journal)."""
        name = self.cfg.checkpointing.metric_name
        if name is None:
            return
        for version, metrics in reported.items():
            value = score_of(metrics, name)
            if value is not None:
                self.validation_scores[version] = value

    def note_validation(self, version: int, metrics: Mapping[str, Any]) -> None:
        """A validation pass of ``version`` reported ``metrics``: rank step_<version> by it."""
        name = self.cfg.checkpointing.metric_name
        if name is None:
            return
        value = score_of(metrics, name)
        if value is None:
            if not self._warned_missing_metric:
                self._warned_missing_metric = True
                log.warning(
                    "checkpointing.metric_name=%r: the validation pass of version %d reported "
                    "no finite value for it (reported: %s); its checkpoint is not ranked",
                    name,
                    version,
                    ", ".join(sorted(metrics)),
                )
            return
        self.validation_scores[version] = value
        if self.checkpoint_dir.is_dir():
            self._retain_trainer_checkpoints()

    def _drop_bootstrap_snapshots(self) -> None:
        root = bootstrap_dir(self.checkpoint_dir)
        if root.exists():
            shutil.rmtree(root, ignore_errors=True)

    # ------------------------------------------------------------------ rollout snapshots

    @property
    def snapshots_enabled(self) -> bool:
        """Periodic rollout snapshots are on (``snapshot_attempt_interval_s``)."""
        return self.cfg.rollout_checkpointing.snapshot_attempt_interval_s is not None

    def ensure_bootstrap_anchor(self) -> Path:
        root = bootstrap_dir(self.checkpoint_dir)
        manifest = root / MANIFEST
        if not manifest.exists():
            root.mkdir(parents=True, exist_ok=True)
            write_json_atomic(
                manifest,
                {
                    "format": 1,
                    "kind": "bootstrap",
                    "fingerprint": self.fingerprint,
                    "identity": self.identity,
                    "model": model_identity(self.model_path),
                    "files": {},
                },
            )
        return root

    async def attempt_snapshot(self) -> Path | None:
        """One periodic snapshot attempt; returns the published folder or None when skipped."""
        async with self._snapshot_lock:
            step = self.run.controller.step
            if step == 0:
                anchor = self.ensure_bootstrap_anchor()
            else:
                anchor = step_dir(self.checkpoint_dir, step)
                if not (anchor / MANIFEST).exists():
                    self.snapshots_skipped += 1  # step_N is not durable yet
                    return None
            existing = list_snapshot_dirs(anchor)
            sequence = existing[-1][0] + 1 if existing else 1
            target = snapshot_dir(anchor, sequence)
            with atomic_directory(target) as tmp:
                async with self.barrier.capture():
                    if self.run.controller.step != step:
                        self.snapshots_skipped += 1  # a step closed meanwhile: anchor is stale
                        raise _StaleAnchor
                    state = self._capture()
                    await write_rollout_state(tmp, state, self.data_plane)
                await self._log_durable_through(state)
                write_manifest(tmp, {**self._manifest_payload("snapshot"), "sequence": sequence})
            self.snapshots_written += 1
            remove_stale_temporaries(anchor / SNAPSHOTS_DIR)
            for _, old in list_snapshot_dirs(anchor)[
                : -self.cfg.rollout_checkpointing.keep_latest_k
            ]:
                shutil.rmtree(old, ignore_errors=True)
            if self.commit_log is not None:
                self._trim_commit_log(self.commit_log)
            return target

    async def snapshot_loop(self) -> None:
        interval = self.cfg.rollout_checkpointing.snapshot_attempt_interval_s
        assert interval is not None
        while True:
            await asyncio.sleep(interval)
            try:
                await self.attempt_snapshot()
            except _StaleAnchor:
                continue


class _StaleAnchor(Exception):
    """The step advanced while a snapshot was being captured; the attempt is dropped."""
