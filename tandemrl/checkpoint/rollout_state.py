"""Write, read and re-apply a captured run state (``tandemrl.run_state.RolloutState``).

The rollout state accounts for every prompt drawn from the dataloader: each is unfinished
(ownership ledger), committed and unconsumed (replay index + data-plane rows), or consumed
(counted in the controller state). ``RunState.capture`` takes all of it synchronously — no
``await`` in between — so the parts agree; the caller holds the checkpoint barrier while the
data-plane rows are written, so the rows on disk are exactly the ones the index lists.

Sidecars are plain containers of str/int/float written with ``torch.save`` and read with
``torch.load(weights_only=True)``; the controller state is JSON.
"""

from __future__ import annotations

import json
import logging
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
from tandemrl.rollout.ledger import OwnershipLedger, UnfinishedGroup
from tandemrl.run_state import RolloutState, RunState

log = logging.getLogger(__name__)


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
        "validation": state.validation,
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
    replay_index = row_digests = None
    if not train_state.get("shadow", False):
        index = _load(directory / REPLAY_INDEX)
        if not isinstance(index, dict) or "buffer" not in index or "row_digests" not in index:
            raise CheckpointCorrupt(f"{directory / REPLAY_INDEX}: not a replay index")
        replay_index, row_digests = index["buffer"], index["row_digests"]
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
        row_digests=row_digests or {},
        validation=dict(train_state.get("validation") or {}),
    )


def open_validation_versions(directory: Path) -> list[int]:
    """Versions of the validation passes a bundle holds open (read-only; [] when none)."""
    try:
        train_state = json.loads((directory / TRAIN_STATE).read_text())
        return [int(entry["version"]) for entry in train_state["validation"].get("open", [])]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return []


def unfinished_groups(state: RolloutState) -> list[UnfinishedGroup]:
    try:
        return OwnershipLedger.groups_from_state(state.ledger)
    except ValueError as exc:
        raise CheckpointCorrupt(f"{ROLLOUT_RECOVERY}: {exc}") from exc


async def apply_rollout_state(
    run: RunState, state: RolloutState, directory: Path, data_plane: DataPlane
) -> dict[str, int]:
    """Re-install a rollout state read from ``directory`` into a fresh run (before it starts).

    Refuses a state of another sampler, an unreadable ledger, or data-plane rows that do not
    match the replay index, before anything is re-installed; then ``RunState.restore``.
    """
    if state.sampler.get("name") != run.sampler.name:
        raise CheckpointCorrupt(
            f"{directory / TRAIN_STATE}: written by sampler {state.sampler.get('name')!r}, but "
            f"async_rl.sampler.name is {run.sampler.name!r}; restore with the original sampler "
            "or start a new checkpointing.checkpoint_dir"
        )
    groups = unfinished_groups(state)
    if state.replay_index is not None:
        loaded = await data_plane.load(directory / DATA_PLANE_DIR)
        expected = state.row_digests
        if loaded != expected:
            differing = sorted(set(loaded.items()) ^ set(expected.items()))[:3]
            raise CheckpointCorrupt(
                f"{directory / DATA_PLANE_DIR} does not match {directory / REPLAY_INDEX} "
                f"(rows differ, e.g. {differing}); refusing a partial restore"
            )
    restored_groups = run.restore(state, groups)
    log.info(
        "restored rollout state from %s: %d committed group(s), %d unfinished group(s) to redispatch",
        directory,
        restored_groups,
        len(groups),
    )
    return {"committed_groups": restored_groups, "unfinished_groups": len(groups)}
