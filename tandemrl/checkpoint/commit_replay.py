"""Write the controller's ownership changes to the commit log, and replay them on restore.

``CommitRecorder`` is what the pumps call (each hook one cheap, synchronous append, except
``committed``, which waits until its record is fsynced; the pumps hold no hook when the log is
off). ``replay_commit_log`` runs after a bundle was applied (``apply_rollout_state``) and
brings the controller to the state of the last record on the bundle's branch:

- a group committed after the bundle becomes a ready group again — rows rebuilt from its
  logged siblings, its recorded ``start_weight``, ``end_weight``, ``target_step`` and dispatch
  position — whether or not a step consumed it before the crash: the trainer went back to the
  bundle's step, so every step closed after it is rolled back and retrained;
- a group admitted after the bundle and not committed becomes an unfinished group to
  redispatch, with the siblings it staged (``sibling`` recovery; ``prompt_group`` discards
  them, as a restore from a snapshot does);
- a dropped group is forgotten; a promoted group keeps its new target step;
- the dataloader, the sampler's dispatch state, the drops per step, the replacement reserve
  and the failure budgets take the values of the last record that carried them, so no prompt
  is drawn twice.

Staleness is then the sampler's business, exactly as for groups restored from a snapshot:
``evict`` removes a replayed group older than the window (windowed) at the first step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandemrl.buffer import Slot
from tandemrl.checkpoint.commit_log import (
    COMMIT_LOG_DIR,
    CommitLog,
    LogReplay,
    branch_records,
    fold,
    read_log,
)
from tandemrl.checkpoint.layout import CheckpointCorrupt
from tandemrl.records import PromptItem
from tandemrl.rollout.ledger import (
    OwnershipLedger,
    StagedSibling,
    UnfinishedGroup,
    group_entry,
    staged_entry,
)
from tandemrl.samplers.base import SamplerError

log = logging.getLogger(__name__)


def commit_log_dir(checkpoint_dir: Path) -> Path:
    return Path(checkpoint_dir) / COMMIT_LOG_DIR


class CommitRecorder:
    """The pumps' side of the commit log: one method per ownership change."""

    def __init__(self, commit_log: CommitLog, controller: Any) -> None:
        self.log = commit_log
        self.controller = controller

    def cursor(self) -> dict[str, Any]:
        """Where the prompt stream stands: what replay restores so no prompt is drawn twice."""
        controller = self.controller
        loader = controller.dataloader
        reserve = None
        if controller.settings.on_dropped_prompt == "replace":
            reserve = [dataclasses.asdict(item) for item in controller.replacement_reserve_items()]
        return {
            "dataloader": {
                "epoch": loader.epoch,
                "position": loader.position,
                "requeued": loader.num_requeued,
            },
            "dispatch": controller.sampler.dispatch_state(),
            "dropped_for_step": {
                str(step): count for step, count in controller.state.dropped_for_step.items()
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

    def staged(
        self,
        group: UnfinishedGroup,
        siblings: list[int],
        after_write: Callable[[], None] | None = None,
    ) -> bool:
        """Siblings finished; logged only where a restart keeps them (``sibling`` recovery
        with token capture). ``after_write`` runs once the record is written; returns False
        (and does not call it) when nothing is logged."""
        ledger = self.controller.rollout_manager.ledger
        if group.granularity != "sibling" or not ledger.token_capture:
            return False
        self.log.append_then(
            "staged",
            after_write,
            group_id=group.group_id,
            siblings={str(index): staged_entry(group.staged[index]) for index in siblings},
        )
        return True

    async def committed(self, group: UnfinishedGroup, slot: Slot, end_weight: int) -> None:
        """Durable before the caller flips the slot ready (called inside the barrier)."""
        entry = group_entry(group, with_staged=True)
        entry.update(
            start_weight=slot.start_weight,
            target_step=slot.target_step,
            dispatch_index=slot.dispatch_index,
            end_weight=end_weight,
        )
        await self.log.append_durable("committed", group_id=group.group_id, group=entry)

    def dropped(self, group: UnfinishedGroup) -> None:
        self.log.append(
            "dropped",
            group_id=group.group_id,
            cursor=self.cursor(),
            budgets=self.controller.rollout_manager.budgets.state_dict(),
        )

    def promoted(self, group_id: str, target_step: int | None) -> None:
        self.log.append("promoted", group_id=group_id, target_step=target_step)

    def reserve_filled(self) -> None:
        self.log.append("reserve", cursor=self.cursor())


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


async def apply_replay(controller: Any, replay: LogReplay, *, source: str) -> dict[str, int]:
    """Bring a controller restored from a bundle up to the end of its log branch."""
    manager = controller.rollout_manager
    buffer = controller.buffer
    recovered = {group.group_id: group for group in controller.recovered_groups}

    def forget_unfinished(group_id: str) -> None:
        if group_id in recovered:
            controller.recovered_groups.remove(recovered.pop(group_id))
            manager.ledger.close(group_id)

    for group_id in replay.dropped:
        forget_unfinished(group_id)

    restored = 0
    for group_id, entry in replay.committed.items():
        forget_unfinished(group_id)
        if group_id in buffer:
            continue  # already ready in the bundle (replaying twice changes nothing)
        group = _group(entry, f"{source}: committed group {group_id}")
        if sorted(group.staged) != list(range(manager.group_size)):
            raise CheckpointCorrupt(
                f"{source}: committed group {group_id} logged siblings {sorted(group.staged)}, "
                f"expected 0..{manager.group_size - 1}"
            )
        metas = await manager.write_replayed_rows(group)
        buffer.adopt_committed(
            Slot(
                group_id=group_id,
                start_weight=int(entry["start_weight"]),
                target_step=entry["target_step"],
                dispatch_index=int(entry["dispatch_index"]),
                end_weight=int(entry["end_weight"]),
                ready=True,
                rows_meta=metas,
            )
        )
        manager.committed_items[group_id] = group.item
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
        manager.ledger.adopt(group)
        controller.recovered_groups.append(group)
        recovered[group_id] = group
        reopened += 1

    if replay.cursor is not None:
        _apply_cursor(controller, replay.cursor, source)
    if replay.budgets is not None:
        manager.budgets.load_state_dict(replay.budgets)
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


def _apply_cursor(controller: Any, cursor: dict[str, Any], source: str) -> None:
    try:
        loader_state = controller.dataloader.state_dict()
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
        controller.dataloader.load_state_dict(loader_state)
        controller.sampler.load_dispatch_state(dict(cursor["dispatch"]))
        controller.state.dropped_for_step.clear()
        controller.state.dropped_for_step.update(
            {int(step): int(count) for step, count in cursor["dropped_for_step"].items()}
        )
        if cursor.get("reserve") is not None:
            controller.replacement_reserve_restore(
                [PromptItem(**item) for item in cursor["reserve"]]
            )
    except (KeyError, TypeError, ValueError, SamplerError) as exc:
        raise CheckpointCorrupt(f"{source}: unusable cursor in the commit log ({exc})") from exc
