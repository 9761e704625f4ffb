"""Capture, write, read and re-apply the controller's rollout state.

The rollout state accounts for every prompt drawn from the dataloader: each is unfinished
(ownership ledger), committed and unconsumed (replay index + data-plane rows), or consumed
(counted in the controller state). ``capture_rollout_state`` takes all of it synchronously —
no ``await`` in between — so the parts agree; the caller holds the checkpoint barrier while the
data-plane rows are written, so the rows on disk are exactly the ones the index lists.

Sidecars are plain containers of str/int/float written with ``torch.save`` and read with
``torch.load(weights_only=True)``; the controller state is JSON.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandemrl.checkpoint.layout import (
    DATA_PLANE_DIR,
    DATALOADER,
    REPLACEMENT_RESERVE,
    REPLAY_INDEX,
    ROLLOUT_RECOVERY,
    TRAIN_STATE,
    CheckpointCorrupt,
)
from tandemrl.dataplane.base import DataPlane, DataPlaneError
from tandemrl.records import PromptItem
from tandemrl.rollout.ledger import OwnershipLedger, UnfinishedGroup

log = logging.getLogger(__name__)


@dataclass
class RolloutState:
    controller: dict[str, Any]
    sampler: dict[str, Any]
    budgets: dict[str, Any]
    dataloader: dict[str, Any]
    replay_index: dict[str, Any] | None  # None in shadow mode (no authoritative index)
    ledger: dict[str, Any]
    replacement_reserve: list[dict[str, Any]] = field(default_factory=list)
    # Shadow mode only: prompts of the committed, unconsumed groups (to regenerate them).
    shadow_prompts: list[dict[str, Any]] = field(default_factory=list)
    # The commit log's next LSN at the capture: the state holds exactly the records below it
    # (None: written without the log, nothing to replay).
    commit_log_next_lsn: int | None = None

    def committed_sample_ids(self) -> list[str]:
        if self.replay_index is None:
            return []
        return [sid for group in self.replay_index["groups"] for sid in group_sample_ids(group)]


def group_sample_ids(group: dict[str, Any]) -> list[str]:
    return [meta["sample_id"] for meta in group["rows_meta"]]


def capture_rollout_state(controller: Any, *, authoritative: bool) -> RolloutState:
    """Everything but the rows, taken synchronously (call it under the checkpoint barrier)."""
    import dataclasses

    return RolloutState(
        controller=controller.state.state_dict(),
        sampler={"name": controller.sampler.name, "dispatch": controller.sampler.dispatch_state()},
        budgets=controller.rollout_manager.budgets.state_dict(),
        dataloader=controller.dataloader.state_dict(),
        replay_index=controller.buffer.state_dict() if authoritative else None,
        ledger=controller.rollout_manager.ledger.state_dict(),
        replacement_reserve=[
            dataclasses.asdict(item) for item in controller.replacement_reserve_items()
        ],
        shadow_prompts=[]
        if authoritative
        else [dataclasses.asdict(item) for item in controller.committed_prompts()],
        commit_log_next_lsn=_commit_log_position(controller) if authoritative else None,
    )


def _commit_log_position(controller: Any) -> int | None:
    commit_log = getattr(controller, "commit_log", None)
    if commit_log is None or not commit_log.opened:
        return None
    return commit_log.next_lsn


def _save(path: Path, payload: Any) -> None:
    torch.save(payload, path)


def _load(path: Path) -> Any:
    try:
        return torch.load(path, weights_only=True)
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path}: missing") from None
    except Exception as exc:  # a truncated or foreign file: any unpickling error
        raise CheckpointCorrupt(f"{path}: unreadable ({type(exc).__name__}: {exc})") from exc


async def write_rollout_state(
    directory: Path, state: RolloutState, data_plane: DataPlane
) -> dict[str, str]:
    """Write the sidecars and the data-plane rows of the committed groups; return row digests."""
    digests = await data_plane.save(directory / DATA_PLANE_DIR, keys=state.committed_sample_ids())
    missing = set(state.committed_sample_ids()) - set(digests)
    if missing:
        raise DataPlaneError(
            f"data-plane snapshot lacks {len(missing)} indexed row(s), e.g. {sorted(missing)[:3]}"
        )
    _save(directory / DATALOADER, state.dataloader)
    _save(
        directory / ROLLOUT_RECOVERY,
        {"ledger": state.ledger, "shadow_prompts": state.shadow_prompts},
    )
    if state.replay_index is not None:
        _save(directory / REPLAY_INDEX, {"buffer": state.replay_index, "row_digests": digests})
    if state.replacement_reserve:
        _save(directory / REPLACEMENT_RESERVE, state.replacement_reserve)
    train_state = {
        "controller": state.controller,
        "sampler": state.sampler,
        "budgets": state.budgets,
        "shadow": state.replay_index is None,
        "commit_log": {"next_lsn": state.commit_log_next_lsn},
    }
    (directory / TRAIN_STATE).write_text(json.dumps(train_state, indent=2, sort_keys=True))
    return digests


def read_rollout_state(directory: Path) -> RolloutState:
    path = directory / TRAIN_STATE
    try:
        train_state = json.loads(path.read_text())
        controller, sampler, budgets = (
            train_state["controller"],
            train_state["sampler"],
            train_state["budgets"],
        )
    except FileNotFoundError:
        raise CheckpointCorrupt(f"{path}: missing") from None
    except (OSError, ValueError, KeyError, TypeError) as exc:  # ValueError: JSON or UTF-8
        raise CheckpointCorrupt(f"{path}: unreadable or incomplete ({exc})") from exc
    replay_index = None
    if not train_state.get("shadow", False):
        replay_index = _load(directory / REPLAY_INDEX)
    try:
        next_lsn = (train_state.get("commit_log") or {}).get("next_lsn")
        next_lsn = None if next_lsn is None else int(next_lsn)
    except (AttributeError, TypeError, ValueError) as exc:
        raise CheckpointCorrupt(f"{path}: bad commit_log.next_lsn ({exc})") from exc
    reserve_path = directory / REPLACEMENT_RESERVE
    recovery = _load(directory / ROLLOUT_RECOVERY)
    if not isinstance(recovery, dict) or "ledger" not in recovery:
        raise CheckpointCorrupt(f"{directory / ROLLOUT_RECOVERY}: not an ownership ledger")
    return RolloutState(
        controller=controller,
        sampler=sampler,
        budgets=budgets,
        dataloader=_load(directory / DATALOADER),
        replay_index=replay_index,
        ledger=recovery["ledger"],
        replacement_reserve=_load(reserve_path) if reserve_path.exists() else [],
        shadow_prompts=list(recovery.get("shadow_prompts", [])),
        commit_log_next_lsn=next_lsn,
    )


def unfinished_groups(state: RolloutState) -> list[UnfinishedGroup]:
    try:
        return OwnershipLedger.groups_from_state(state.ledger)
    except ValueError as exc:
        raise CheckpointCorrupt(f"{ROLLOUT_RECOVERY}: {exc}") from exc


async def apply_rollout_state(
    controller: Any, state: RolloutState, directory: Path
) -> dict[str, int]:
    """Re-install a captured rollout state into a freshly built controller (before ``run``).

    Committed groups become selectable again; unfinished groups are queued for redispatch at
    the recovery granularity their ledger entry recorded. In shadow mode (no authoritative
    index) the prompts of the buffered groups go back to the dataloader instead, so they are
    regenerated rather than lost.
    """
    if state.sampler.get("name") != controller.sampler.name:
        raise CheckpointCorrupt(
            f"{directory / TRAIN_STATE}: written by sampler {state.sampler.get('name')!r}, but "
            f"async_rl.sampler.name is {controller.sampler.name!r}; restore with the original sampler "
            "or start a new checkpointing.checkpoint_dir"
        )
    groups = unfinished_groups(state)
    controller.state.load_state_dict(state.controller)
    controller.dataloader.load_state_dict(state.dataloader)
    controller.sampler.load_dispatch_state(state.sampler["dispatch"])
    controller.rollout_manager.budgets.load_state_dict(state.budgets)
    restored_groups = 0
    if state.replay_index is not None:
        loaded = await controller.data_plane.load(directory / DATA_PLANE_DIR)
        expected = state.replay_index["row_digests"]
        if loaded != expected:
            differing = sorted(set(loaded.items()) ^ set(expected.items()))[:3]
            raise CheckpointCorrupt(
                f"{directory / DATA_PLANE_DIR} does not match {directory / REPLAY_INDEX} "
                f"(rows differ, e.g. {differing}); refusing a partial restore"
            )
        buffer_state = state.replay_index["buffer"]
        controller.buffer.load_state_dict(
            buffer_state, expect_group_size=controller.settings.group_size
        )
        restored_groups = len(buffer_state["groups"])
    else:
        controller.dataloader.requeue([PromptItem(**item) for item in state.shadow_prompts])
    for group in groups:
        if group.granularity == "prompt_group":
            group.discard_staged()
        # Owned by the ledger from now on, so a snapshot taken before the group is redispatched
        # still accounts for it.
        controller.rollout_manager.ledger.adopt(group)
    controller.recovered_groups = groups
    controller.replacement_reserve_restore(
        [PromptItem(**item) for item in state.replacement_reserve]
    )
    log.info(
        "restored rollout state from %s: %d committed group(s), %d unfinished group(s) to redispatch",
        directory,
        restored_groups,
        len(groups),
    )
    return {"committed_groups": restored_groups, "unfinished_groups": len(groups)}
