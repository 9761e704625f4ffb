"""Write the run's ownership changes to the commit log, and replay them on restore.

``CommitLogEvents`` is the log's implementation of the pumps' ``OwnershipEvents`` (each event
one cheap, synchronous append, except ``committed``, which waits until its record is fsynced),
reading the prompt stream's cursor from the ``RunState``; it hands every event on to the run
journal when there is one. ``apply_replay`` runs after a bundle was applied
(``apply_rollout_state``) and brings the run state to that of the last record on the bundle's
branch:

- a group committed after the bundle becomes a ready group again — rows rebuilt from its
  logged siblings, its recorded ``start_weight``, ``end_weight``, ``target_step`` and dispatch
  position — whether or not a step consumed it before the crash: the trainer went back to the
  bundle's step, so every step closed after it is rolled back and retrained;
- a group admitted after the bundle and not committed becomes an unfinished group to
  redispatch, with the siblings it staged (``sibling`` recovery; ``prompt_group`` discards
  them, as a restore from a snapshot does);
- a dropped group is forgotten; a promoted group keeps its new target step; a group that
  dynamic sampling filtered is removed (from the bundle's ready groups too);
- the dataloader, the sampler's dispatch state, the drops per step, the replacement reserve
  and the failure budgets take the values of the last record that carried them, so no prompt
  is drawn twice.

Staleness is then the sampler's business, exactly as for groups restored from a snapshot:
``evict`` removes a replayed group older than the window (windowed) at the first step.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any, Protocol

from tandemrl.buffer import Slot
from tandemrl.checkpoint.commit_log import (
    COMMIT_LOG_DIR,
    CommitLog,
    LogReplay,
    branch_records,
    fold,
    read_log,
)
from tandemrl.checkpoint.journal import RunJournal, teacher_passes_of
from tandemrl.checkpoint.layout import CheckpointCorrupt
from tandemrl.records import PromptItem, RowMeta
from tandemrl.rollout.ledger import (
    OwnershipLedger,
    StagedSibling,
    UnfinishedGroup,
    group_entry,
    staged_entry,
)
from tandemrl.run_state import RunState
from tandemrl.samplers.base import SamplerError

log = logging.getLogger(__name__)


def commit_log_dir(checkpoint_dir: Path) -> Path:
    return Path(checkpoint_dir) / COMMIT_LOG_DIR


class ReplayedRows(Protocol):
    """Rewrites a committed group's rows from its logged siblings, or clears those of a group
    the log removed (the rollout manager)."""

    async def write_replayed_rows(self, group: UnfinishedGroup) -> list[RowMeta]: ...

    async def clear_replayed_rows(self, sample_ids: list[str]) -> None: ...


class CommitLogEvents:
    """The commit log's side of the ownership events; then the journal's, when there is one.

    ``records_reserve``: the cursor carries the replacement reserve (on_dropped_prompt:
    replace). The journal's ``staged`` and ``generated`` lines are written once the log record
    is written (on the log's writer thread), so a restart keeps every sibling and every
    committed group the journal says finished, and the journal names every commit a restart
    replays.
    """

    def __init__(
        self,
        commit_log: CommitLog,
        run: RunState,
        *,
        records_reserve: bool,
        journal: RunJournal | None = None,
    ) -> None:
        self.log = commit_log
        self.run = run
        self.records_reserve = records_reserve
        self.journal = journal

    def cursor(self) -> dict[str, Any]:
        """Where the prompt stream stands: what replay restores so no prompt is drawn twice."""
        run = self.run
        loader = run.dataloader
        reserve = None
        if self.records_reserve:
            reserve = [dataclasses.asdict(item) for item in run.replacement_reserve]
        return {
            "dataloader": {
                "epoch": loader.epoch,
                "position": loader.position,
                "requeued": loader.num_requeued,
            },
            "dispatch": run.sampler.dispatch_state(),
            "dropped_for_step": {
                str(step): count for step, count in run.controller.dropped_for_step.items()
            },
            "reserve": reserve,
        }

    def admitted(self, group: UnfinishedGroup) -> None:
        self.log.append(
            "admitted",
            group_id=group.group_id,
            group=group_entry(group, with_staged=False),
            cursor=self.cursor(),
        )
        if self.journal is not None:
            self.journal.admitted(group)

    def staged(self, group: UnfinishedGroup, siblings: list[int]) -> None:
        """Logged only where a restart keeps the siblings (``sibling`` recovery with token
        capture); the journal hears of them once the record is written, or at once when
        nothing is logged."""
        journal = self.journal
        if group.granularity != "sibling" or not self.run.ledger.token_capture:
            if journal is not None:
                journal.staged(group, siblings)
            return
        after_write = None
        if journal is not None:

            def after_write() -> None:
                journal.staged(group, siblings)

        self.log.append_then(
            "staged",
            after_write,
            group_id=group.group_id,
            siblings={str(index): staged_entry(group.staged[index]) for index in siblings},
        )

    async def committed(
        self, group: UnfinishedGroup, slot: Slot, *, end_weight: int, fresh_siblings: list[int]
    ) -> None:
        """Durable before the caller flips the slot ready (called inside the barrier)."""
        entry = group_entry(group, with_staged=True)
        entry.update(
            start_weight=slot.start_weight,
            target_step=slot.target_step,
            dispatch_index=slot.dispatch_index,
            end_weight=end_weight,
        )
        journal = self.journal
        after_write = None
        if journal is not None:
            group_id = group.group_id
            teacher_passes = teacher_passes_of(group)

            def after_write() -> None:
                # Once the record is written (a process kill no longer loses it), as for
                # ``staged``: the journal's ``generated`` line then never misses a commit
                # that a restart replays from the log.
                journal.generated(group_id, fresh_siblings, teacher_passes)

        lsn = self.log.append_then("committed", after_write, group_id=group.group_id, group=entry)
        await self.log.wait_durable(lsn + 1)

    def dropped(self, group: UnfinishedGroup) -> None:
        self.log.append(
            "dropped",
            group_id=group.group_id,
            cursor=self.cursor(),
            budgets=self.run.budgets.state_dict(),
        )
        if self.journal is not None:
            self.journal.dropped(group)

    def promoted(self, group_id: str, target_step: int | None) -> None:
        self.log.append("promoted", group_id=group_id, target_step=target_step)
        if self.journal is not None:
            self.journal.promoted(group_id, target_step)

    def evicted(self, group_ids: list[str]) -> None:
        # Not logged: a replayed group older than the window is evicted again at once.
        if self.journal is not None:
            self.journal.evicted(group_ids)

    def filtered(self, group_ids: list[str]) -> None:
        # Logged with the cursor (the replacements the sampler owes): a restart forgets the
        # groups and dispatches the replacements still owed, instead of filtering them again
        # and owing a second replacement for a group already replaced.
        self.log.append("filtered", group_ids=list(group_ids), cursor=self.cursor())
        if self.journal is not None:
            self.journal.filtered(group_ids)

    def trained(self, step: int, group_ids: list[str]) -> None:
        # Not logged: a restart goes back to the bundle's step and trains again from there.
        if self.journal is not None:
            self.journal.trained(step, group_ids)

    def reserve_filled(self) -> None:
        self.log.append("reserve", cursor=self.cursor())
        if self.journal is not None:
            self.journal.reserve_filled()


# ---------------------------------------------------------------------------- replay


def _group(entry: dict[str, Any], where: str) -> UnfinishedGroup:
    try:
        return OwnershipLedger.groups_from_state({"groups": [entry]})[0]
    except ValueError as exc:
        raise CheckpointCorrupt(f"{where}: {exc}") from exc


def _staged(entries: dict[int, dict[str, Any]], where: str) -> dict[int, StagedSibling]:
    probe = {
        "item": dataclasses.asdict(PromptItem(prompt_id="-", epoch=0, index=0, prompt="")),
        "group_id": "-",
        "target_step": None,
        "start_weight": 0,
        "granularity": "sibling",
        "staged": {str(index): entry for index, entry in entries.items()},
    }
    return _group(probe, where).staged


def replay_for(checkpoint_dir: Path, from_lsn: int | None) -> tuple[LogReplay, int | None]:
    """Fold the records a bundle captured at ``from_lsn`` replays; also return the tip (the
    LSN of the last record the restored state contains, None when off the log)."""
    if from_lsn is None:
        return LogReplay(), None
    contents = read_log(commit_log_dir(checkpoint_dir))
    records = branch_records(contents.records, from_lsn)
    replay = fold(records)
    tip = replay.last_lsn if replay.last_lsn is not None else from_lsn - 1
    return replay, tip


async def apply_replay(
    run: RunState, replay: LogReplay, *, rows: ReplayedRows, source: str
) -> dict[str, int]:
    """Bring a run state restored from a bundle up to the end of its log branch."""
    buffer = run.buffer
    recovered = {group.group_id: group for group in run.recovered_groups}

    def forget_unfinished(group_id: str) -> None:
        if group_id in recovered:
            run.recovered_groups.remove(recovered.pop(group_id))
            run.ledger.close(group_id)

    for group_id in replay.dropped:
        forget_unfinished(group_id)

    # Zero-advantage groups dynamic sampling removed after the bundle (their replacement
    # owed replacements come back with the cursor below).
    for group_id in replay.filtered:
        if group_id in buffer and buffer.slot(group_id).ready:
            await rows.clear_replayed_rows(buffer.remove(group_id).sample_ids)

    restored = 0
    for group_id, entry in replay.committed.items():
        forget_unfinished(group_id)
        if group_id in buffer:
            continue  # already ready in the bundle (replaying twice changes nothing)
        group = _group(entry, f"{source}: committed group {group_id}")
        if sorted(group.staged) != list(range(buffer.group_size)):
            raise CheckpointCorrupt(
                f"{source}: committed group {group_id} logged siblings {sorted(group.staged)}, "
                f"expected 0..{buffer.group_size - 1}"
            )
        metas = await rows.write_replayed_rows(group)
        slot = Slot(
            group_id=group_id,
            start_weight=int(entry["start_weight"]),
            target_step=entry["target_step"],
            dispatch_index=int(entry["dispatch_index"]),
            end_weight=int(entry["end_weight"]),
            ready=True,
            rows_meta=metas,
            item=group.item,
        )
        buffer.adopt_committed(slot)
        restored += 1

    for group_id, target_step in replay.promoted.items():
        if group_id in buffer and buffer.slot(group_id).ready:
            buffer.promote_ready_group(group_id, target_step)

    # Siblings staged after the bundle by groups the bundle already owned.
    for group_id, entries in replay.staged.items():
        if group_id in recovered and group_id not in replay.admitted:
            group = recovered[group_id]
            if group.granularity == "sibling":
                group.staged.update(_staged(entries, f"{source}: staged siblings of {group_id}"))

    reopened = 0
    for group_id, entry in replay.admitted.items():
        if group_id in recovered or group_id in buffer:
            continue
        group = _group(entry, f"{source}: admitted group {group_id}")
        if group.granularity == "sibling":
            group.staged = _staged(
                replay.staged.get(group_id, {}), f"{source}: staged siblings of {group_id}"
            )
        run.ledger.adopt(group)
        run.recovered_groups.append(group)
        recovered[group_id] = group
        reopened += 1

    if replay.cursor is not None:
        _apply_cursor(run, replay.cursor, source)
    if replay.budgets is not None:
        run.budgets.load_state_dict(replay.budgets)
    if replay.records:
        log.info(
            "replayed %d commit log record(s) from %s: %d committed group(s) kept, %d unfinished "
            "group(s) reopened, %d dropped",
            replay.records,
            source,
            restored,
            reopened,
            len(replay.dropped),
        )
    return {"records": replay.records, "committed_groups": restored, "reopened_groups": reopened}


def _apply_cursor(run: RunState, cursor: dict[str, Any], source: str) -> None:
    try:
        loader_state = run.dataloader.state_dict()
        position = cursor["dataloader"]
        requeued = loader_state["requeued"]
        keep = int(position["requeued"])
        if keep > len(requeued):
            raise ValueError(f"{keep} requeued prompt(s) logged, {len(requeued)} restored")
        # Requeued prompts only leave, from the front: keep the last ``keep`` of them.
        loader_state.update(
            epoch=int(position["epoch"]),
            position=int(position["position"]),
            requeued=requeued[len(requeued) - keep :],
        )
        run.dataloader.load_state_dict(loader_state)
        run.sampler.load_dispatch_state(dict(cursor["dispatch"]))
        run.controller.dropped_for_step.clear()
        run.controller.dropped_for_step.update(
            {int(step): int(count) for step, count in cursor["dropped_for_step"].items()}
        )
        if cursor.get("reserve") is not None:
            run.replacement_reserve = [PromptItem(**item) for item in cursor["reserve"]]
    except (KeyError, TypeError, ValueError, SamplerError) as exc:
        raise CheckpointCorrupt(f"{source}: unusable cursor in the commit log ({exc})") from exc
