"""The replay buffer: group-granular metadata of rollouts between dispatch and training.

A pure state machine: no tensors (rows live in the data plane, keyed by sample id), no tasks,
no I/O. The rollout pump and the train pump drive it; samplers read it and claim from it.

Life of a prompt group (one ``Slot``)::

    reserve ──> reserved ──commit──> ready ──claim_for_training──> claimed
                   │                   │                              │
                   └──remove──> gone <─┘            release_claims(consumed=True) ──> gone
                                                    release_claims(consumed=False) ──> ready

- ``reserve`` appends a slot at dispatch and stamps ``start_weight`` (and ``target_step`` for
  in_order); the slot keeps the group's prompt (``item``). Slots are appended, so buffer order is dispatch order (``dispatch_index``, a
  counter that only grows) and ``start_weight`` never decreases along the buffer.
- ``commit`` records the group's rows (one per sibling; an agent episode split into turns
  has several) and ``end_weight`` and flips it ready.
  Invariant: the caller has written those rows to the data plane BEFORE committing, so a
  ready slot always has its rows stored; a sampler may hand it to the trainer at once.
- The live index holds reserved and ready groups; ``capacity`` (``max_buffered_rollouts``)
  bounds it. Claimed groups belong to the train step that selected them: they are neither
  selectable, nor evictable, nor counted against capacity. The step's outcome decides their
  fate: consumed (forgotten; the caller clears their rows) or rolled back (back into the live
  index at their original dispatch position).
- A rollback can push the live index above ``capacity`` when the rollout pump refilled the
  freed room meanwhile; ``reserve`` then refuses until it drains. Nothing else exceeds it.

``state_dict`` captures committed groups (ready and claimed; a snapshot rolls claims back)
for replay recovery; reserved groups are only listed, since their redispatch is the recovery
ledger's business.
"""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from tandemrl.records import PromptItem, RowMeta

STATE_FORMAT = "tandemrl.replay_buffer"
STATE_VERSION = 1


class ReplayBufferError(builtins.BufferError):
    """A buffer operation broke an invariant; the message names the group and the rule."""


# The module's public name; it subclasses the built-in BufferError, so either spelling catches it.
BufferError = ReplayBufferError


@dataclass
class Slot:
    """One prompt group's metadata, from dispatch to training."""

    group_id: str
    start_weight: int
    # in_order: the train step (trainer version) the group is meant for; None otherwise.
    target_step: int | None
    # Position in dispatch order (monotonic per buffer, restored with the buffer).
    dispatch_index: int
    end_weight: int | None = None
    ready: bool = False
    rows_meta: list[RowMeta] = field(default_factory=list)
    # The group's prompt (None for a group restored from a replay index, which omits it).
    item: PromptItem | None = field(default=None, repr=False, compare=False)
    # sample_ids, worked out once per rows_meta list (both pumps ask for it several times per
    # group) and for the list it was worked out from.
    _sample_ids: list[str] = field(default_factory=list, init=False, repr=False, compare=False)
    _sample_ids_of: list[RowMeta] | None = field(
        default=None, init=False, repr=False, compare=False
    )

    @property
    def sample_ids(self) -> list[str]:
        """The group's sample ids in row order (a shared list: read it, do not change it)."""
        rows = self.rows_meta
        if self._sample_ids_of is not rows:
            self._sample_ids = [row.sample_id for row in rows]
            self._sample_ids_of = rows
        return self._sample_ids

    def to_state(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "start_weight": self.start_weight,
            "target_step": self.target_step,
            "dispatch_index": self.dispatch_index,
            "end_weight": self.end_weight,
            "ready": self.ready,
            "rows_meta": [asdict(row) for row in self.rows_meta],
        }


class ReplayBuffer:
    """Reserve/commit slot accounting for prompt groups; see the module docstring."""

    def __init__(self, *, group_size: int, capacity: int) -> None:
        if group_size < 1:
            raise ReplayBufferError(f"group_size must be >= 1, got {group_size}")
        if capacity < 1:
            raise ReplayBufferError(
                f"capacity (max_buffered_rollouts) must be >= 1, got {capacity}"
            )
        self.group_size = group_size
        self.capacity = capacity
        # Live index (reserved + ready), kept sorted by dispatch_index.
        self._live: dict[str, Slot] = {}
        # Groups selected by an open train step.
        self._claimed: dict[str, Slot] = {}
        self._next_dispatch_index = 0

    # ------------------------------------------------------------------ queries

    def __len__(self) -> int:
        """Live groups: reserved plus ready (what counts against capacity)."""
        return len(self._live)

    def __contains__(self, group_id: object) -> bool:
        return group_id in self._live or group_id in self._claimed

    @property
    def num_ready(self) -> int:
        return sum(1 for slot in self._live.values() if slot.ready)

    @property
    def num_reserved(self) -> int:
        return sum(1 for slot in self._live.values() if not slot.ready)

    @property
    def num_claimed(self) -> int:
        return len(self._claimed)

    @property
    def next_dispatch_index(self) -> int:
        return self._next_dispatch_index

    def has_capacity(self) -> bool:
        """True when one more group may be reserved."""
        return len(self._live) < self.capacity

    def ready_groups(self) -> list[Slot]:
        """Ready, unclaimed groups in dispatch order."""
        return [slot for slot in self._live.values() if slot.ready]

    def reserved_groups(self) -> list[Slot]:
        """Reserved (in-flight) groups in dispatch order."""
        return [slot for slot in self._live.values() if not slot.ready]

    def live_groups(self) -> list[Slot]:
        """Reserved and ready groups in dispatch order."""
        return list(self._live.values())

    def claimed_groups(self) -> list[Slot]:
        """Groups held by the open train step, in dispatch order."""
        return sorted(self._claimed.values(), key=lambda slot: slot.dispatch_index)

    def slot(self, group_id: str) -> Slot:
        """The live or claimed slot of ``group_id``."""
        found = self._live.get(group_id) or self._claimed.get(group_id)
        if found is None:
            raise ReplayBufferError(f"group {group_id!r} is not in the buffer")
        return found

    # ------------------------------------------------------------------ rollout side

    def reserve(
        self,
        group_id: str,
        start_weight: int,
        target_step: int | None = None,
        item: PromptItem | None = None,
    ) -> Slot:
        """Append a reserved slot for a group being dispatched now (``item``: its prompt)."""
        live = self._live
        if group_id in live or group_id in self._claimed:
            raise ReplayBufferError(f"reserve: group {group_id!r} is already in the buffer")
        if len(live) >= self.capacity:  # not has_capacity()
            raise ReplayBufferError(
                f"reserve: buffer is full ({len(live)} of {self.capacity} reserved or "
                f"ready groups); group {group_id!r} must wait for the trainer to consume a batch"
            )
        # Positional, in field order: this runs once per dispatched prompt group.
        slot = Slot(group_id, start_weight, target_step, self._next_dispatch_index)
        slot.item = item
        self._next_dispatch_index += 1
        live[group_id] = slot
        return slot

    def commit(self, group_id: str, rows_meta: list[RowMeta], end_weight: int) -> Slot:
        """Mark a reserved group ready with its rows (already written to the data plane)."""
        slot = self._live.get(group_id)
        if slot is None:
            raise ReplayBufferError(f"commit: group {group_id!r} has no reserved slot")
        if slot.ready:
            raise ReplayBufferError(f"commit: group {group_id!r} is already committed")
        sample_ids = _check_rows(group_id, rows_meta, self.group_size, "commit")
        slot.rows_meta = list(rows_meta)
        slot._sample_ids, slot._sample_ids_of = sample_ids, slot.rows_meta
        slot.end_weight = end_weight
        slot.ready = True
        return slot

    def remove(self, group_id: str) -> Slot:
        """Drop a live group (failed rollout, eviction); the caller clears its rows, if any."""
        slot = self._live.pop(group_id, None)
        if slot is None:
            where = "claimed by the open train step" if group_id in self._claimed else "unknown"
            raise ReplayBufferError(f"remove: group {group_id!r} is not live ({where})")
        return slot

    def promote_ready_group(self, group_id: str, target_step: int | None) -> Slot:
        """Re-stamp a ready group's ``target_step`` (in_order replacement).

        When a group of step ``s`` is dropped and the run replaces drops, a ready group meant
        for a later step can be moved forward to fill the hole, so step ``s`` trains a full
        batch without waiting for a fresh rollout. Its dispatch position is unchanged.
        """
        slot = self._live.get(group_id)
        if slot is None or not slot.ready:
            raise ReplayBufferError(
                f"promote_ready_group: group {group_id!r} is not a ready, unclaimed group"
            )
        slot.target_step = target_step
        return slot

    # ------------------------------------------------------------------ train side

    def claim_for_training(self, group_ids: Iterable[str]) -> list[Slot]:
        """Move ready groups from the live index to the open train step's claims."""
        group_ids = list(group_ids)
        if len(set(group_ids)) != len(group_ids):
            raise ReplayBufferError(f"claim_for_training: duplicate group ids in {group_ids}")
        for group_id in group_ids:
            slot = self._live.get(group_id)
            if slot is None or not slot.ready:
                raise ReplayBufferError(
                    f"claim_for_training: group {group_id!r} is not a ready, unclaimed group"
                )
        claimed = [self._live.pop(group_id) for group_id in group_ids]
        for slot in claimed:
            self._claimed[slot.group_id] = slot
        return claimed

    def release_claims(self, group_ids: Iterable[str], *, consumed: bool) -> list[str]:
        """Close claims: consumed (step closed) or rolled back (step abandoned).

        Returns the sample ids of consumed groups, whose rows the caller now clears; a
        rollback returns an empty list (the rows stay, the groups are selectable again).
        """
        group_ids = list(group_ids)
        unknown = [group_id for group_id in group_ids if group_id not in self._claimed]
        if unknown or len(set(group_ids)) != len(group_ids):
            raise ReplayBufferError(
                f"release_claims: group(s) {unknown or group_ids} are not claimed exactly once"
            )
        slots = [self._claimed.pop(group_id) for group_id in group_ids]
        if consumed:
            return [sample_id for slot in slots for sample_id in slot.sample_ids]
        for slot in slots:
            self._live[slot.group_id] = slot
        self._sort_live()
        return []

    # ------------------------------------------------------------------ snapshots

    def state_dict(self) -> dict[str, Any]:
        """JSON-able snapshot: committed groups (claims rolled back), reserved ones listed."""
        committed = sorted(
            [slot for slot in self._live.values() if slot.ready] + list(self._claimed.values()),
            key=lambda slot: slot.dispatch_index,
        )
        return {
            "format": STATE_FORMAT,
            "version": STATE_VERSION,
            "group_size": self.group_size,
            "capacity": self.capacity,
            "next_dispatch_index": self._next_dispatch_index,
            "groups": [slot.to_state() for slot in committed],
            # Not restorable here: unfinished groups are redispatched by the recovery ledger.
            "reserved": [
                {key: value for key, value in slot.to_state().items() if key != "rows_meta"}
                for slot in self.reserved_groups()
            ],
        }

    def load_state_dict(
        self, state: dict[str, Any], *, expect_group_size: int | None = None
    ) -> None:
        """Replace the buffer's contents with the committed groups of ``state``.

        Every check runs before anything changes: a refused snapshot leaves the buffer as it
        was. Restored groups are ready and unclaimed; reserved groups are not restored.
        """
        slots, next_index = self._parse_state(state, expect_group_size)
        self._live = {slot.group_id: slot for slot in slots}
        self._claimed = {}
        self._next_dispatch_index = next_index
        self._sort_live()

    def adopt_committed(self, slot: Slot) -> None:
        """Commit-log replay: re-install a group that committed after the restored snapshot.

        Like a rolled-back claim it may push the live index above ``capacity`` (``reserve``
        refuses until it drains); it keeps its logged dispatch position.
        """
        if slot.group_id in self:
            raise ReplayBufferError(
                f"adopt_committed: group {slot.group_id!r} is already in the buffer"
            )
        _check_rows(slot.group_id, slot.rows_meta, self.group_size, "adopt_committed")
        if any(other.dispatch_index == slot.dispatch_index for other in self._live.values()):
            raise ReplayBufferError(
                f"adopt_committed: dispatch index {slot.dispatch_index} of {slot.group_id!r} is taken"
            )
        slot.ready = True
        self._live[slot.group_id] = slot
        self._next_dispatch_index = max(self._next_dispatch_index, slot.dispatch_index + 1)
        self._sort_live()

    # ------------------------------------------------------------------ helpers

    def _sort_live(self) -> None:
        ordered = sorted(self._live.values(), key=lambda slot: slot.dispatch_index)
        self._live = {slot.group_id: slot for slot in ordered}

    def _parse_state(
        self, state: dict[str, Any], expect_group_size: int | None
    ) -> tuple[list[Slot], int]:
        def refuse(message: str) -> ReplayBufferError:
            return ReplayBufferError(f"replay buffer snapshot refused: {message}")

        if not isinstance(state, dict):
            raise refuse(f"expected a dict, got {type(state).__name__}")
        if state.get("format") != STATE_FORMAT:
            raise refuse(f"not a replay buffer state (format {state.get('format')!r})")
        if state.get("version") != STATE_VERSION:
            raise refuse(f"version {state.get('version')!r}, expected {STATE_VERSION}")
        group_size = state.get("group_size")
        if group_size != self.group_size:
            raise refuse(
                f"it holds groups of {group_size} rows, this run uses {self.group_size} "
                "(num_generations_per_prompt changed)"
            )
        if expect_group_size is not None and group_size != expect_group_size:
            raise refuse(f"it holds groups of {group_size} rows, expected {expect_group_size}")
        groups = state.get("groups")
        if not isinstance(groups, list):
            raise refuse("'groups' is missing or not a list")
        if len(groups) > self.capacity:
            raise refuse(
                f"it holds {len(groups)} committed groups, more than max_buffered_rollouts "
                f"({self.capacity})"
            )
        slots: list[Slot] = []
        seen_ids: set[str] = set()
        seen_indices: set[int] = set()
        for entry in groups:
            try:
                slot = _slot_from_state(entry)
            except (KeyError, TypeError, ValueError) as exc:
                raise refuse(f"malformed group entry {entry!r} ({exc})") from exc
            if slot.group_id in seen_ids:
                raise refuse(f"group {slot.group_id!r} appears twice")
            if slot.dispatch_index in seen_indices:
                raise refuse(f"dispatch index {slot.dispatch_index} appears twice")
            try:
                _check_rows(slot.group_id, slot.rows_meta, self.group_size, "snapshot")
            except ReplayBufferError as exc:
                raise refuse(str(exc)) from exc
            seen_ids.add(slot.group_id)
            seen_indices.add(slot.dispatch_index)
            slots.append(slot)
        next_index = state.get("next_dispatch_index")
        if (
            isinstance(next_index, bool)
            or not isinstance(next_index, int)
            or any(index >= next_index for index in seen_indices)
        ):
            raise refuse(f"next_dispatch_index {next_index!r} is not above every group's index")
        return slots, next_index


_ROW_FIELDS = frozenset(row_field.name for row_field in fields(RowMeta))


def _int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{what} must be an int, got {value!r}")
    return value


def _row_from_state(row: Any) -> RowMeta:
    if not isinstance(row, dict) or set(row) != _ROW_FIELDS:
        raise ValueError(f"row entry {row!r} does not have exactly the fields of RowMeta")
    for key in ("sample_id", "group_id"):
        if not isinstance(row[key], str):
            raise TypeError(f"row {key} must be a str, got {row[key]!r}")
    return RowMeta(**row)


def _slot_from_state(entry: Any) -> Slot:
    if not isinstance(entry, dict):
        raise TypeError(f"group entry must be a dict, got {type(entry).__name__}")
    if not isinstance(entry["group_id"], str):
        raise TypeError(f"group_id must be a str, got {entry['group_id']!r}")
    if not isinstance(entry["rows_meta"], list):
        raise TypeError("rows_meta must be a list")
    target_step = entry["target_step"]
    return Slot(
        group_id=entry["group_id"],
        start_weight=_int(entry["start_weight"], "start_weight"),
        target_step=None if target_step is None else _int(target_step, "target_step"),
        dispatch_index=_int(entry["dispatch_index"], "dispatch_index"),
        end_weight=_int(entry["end_weight"], "end_weight"),
        ready=True,
        rows_meta=[_row_from_state(row) for row in entry["rows_meta"]],
    )


def _check_rows(group_id: str, rows_meta: list[RowMeta], group_size: int, what: str) -> list[str]:
    """Refuse rows that are not the distinct rows of ``group_id``'s ``group_size`` siblings;
    their sample ids. One row per sibling, or, for agent episodes split into several rows
    (token_capture.on_prefix_mismatch: split), several rows of a sibling, every sibling
    0..group_size-1 holding at least one."""
    if len(rows_meta) < group_size or (
        len(rows_meta) > group_size
        and {row.sibling_index for row in rows_meta} != set(range(group_size))
    ):
        raise ReplayBufferError(
            f"{what}: group {group_id!r} has {len(rows_meta)} rows, expected {group_size} "
            "(num_generations_per_prompt; more only when agent episodes split into several "
            f"rows, with each of the {group_size} siblings holding one or more; it has "
            f"siblings {sorted({row.sibling_index for row in rows_meta})})"
        )
    sample_ids = [row.sample_id for row in rows_meta]
    if len(set(sample_ids)) != len(sample_ids):
        raise ReplayBufferError(f"{what}: group {group_id!r} has duplicate sample ids {sample_ids}")
    strangers = [row.sample_id for row in rows_meta if row.group_id != group_id]
    if strangers:
        raise ReplayBufferError(
            f"{what}: group {group_id!r} has rows of another group: {', '.join(strangers)}"
        )
    return sample_ids
