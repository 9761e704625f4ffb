"""The run's state: everything a checkpoint captures and a restart re-installs.

Every prompt drawn from the dataloader is, at every moment, exactly one of: unfinished (the
ownership ledger), committed and unconsumed (the replay buffer; its rows in the data plane),
or consumed (counted in the controller state). ``RunState`` holds those parts together with
the rest of what decides the run's future — the sampler's dispatch position, the failure
budgets, the dataloader's cursor, the replacement reserve — as one typed object:

    controller   step, trainer_version, consumed groups, drops per step   ``ControllerState``
    buffer       committed groups (the replay index), reserved slots      ``ReplayBuffer``
    sampler      admissions so far, replacement credits                   ``PromptGroupSampler``
    ledger       unfinished groups and their staged siblings              ``OwnershipLedger``
    budgets      drops so far                                             ``FailureBudgets``
    dataloader   epoch, position, requeued prompts                        ``PromptDataLoader``
    validation   open validation passes, how far the schedule went        ``ValidationState``
    replacement_reserve, recovered_groups                                  plain lists

The controller drives these parts; checkpoint code reads them with ``capture()`` and writes
them back with ``restore()``, and never sees the controller. ``capture`` is synchronous (no
``await``), so its parts agree with each other; the caller holds the checkpoint barrier while
it also writes the data-plane rows. The captured record, ``RolloutState``, holds only plain
containers of str/int/float (``tandemrl.checkpoint.rollout_state`` writes and reads it).
"""

from __future__ import annotations

import dataclasses
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from tandemrl.buffer import ReplayBuffer
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.records import PromptItem
from tandemrl.rollout.failures import FailureBudgets
from tandemrl.rollout.ledger import OwnershipLedger, UnfinishedGroup, resolve_granularity
from tandemrl.rollout.validation_state import ValidationState
from tandemrl.samplers.base import PromptGroupSampler

log = logging.getLogger(__name__)


@dataclass
class ControllerState:
    """The controller's own counters (the other parts of ``RunState`` persist themselves)."""

    step: int = 0
    trainer_version: int = 0
    consumed_groups: int = 0
    dropped_for_step: Counter[int] = field(default_factory=Counter)

    def forget_closed_steps(self) -> None:
        """Drop the counts of steps already trained (only the open and later steps are asked)."""
        for step in [step for step in self.dropped_for_step if step < self.trainer_version]:
            del self.dropped_for_step[step]

    def state_dict(self) -> dict[str, Any]:
        return {
            "step": self.step,
            "trainer_version": self.trainer_version,
            "consumed_groups": self.consumed_groups,
            "dropped_for_step": {str(k): v for k, v in self.dropped_for_step.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.trainer_version = int(state["trainer_version"])
        self.consumed_groups = int(state["consumed_groups"])
        self.dropped_for_step = Counter(
            {int(k): int(v) for k, v in state["dropped_for_step"].items()}
        )


@dataclass
class RolloutState:
    """A captured ``RunState``, in plain containers (what a checkpoint bundle stores)."""

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
    # (None: written without the log, nothing to replay). Set by the checkpoint writer.
    commit_log_next_lsn: int | None = None
    # Read back from a bundle: the digest of each indexed row (the data plane's must match).
    row_digests: dict[str, str] = field(default_factory=dict)
    # Open validation passes and the schedule's position (empty: validation off, or a
    # checkpoint written before validation existed).
    validation: dict[str, Any] = field(default_factory=dict)

    def committed_sample_ids(self) -> list[str]:
        if self.replay_index is None:
            return []
        return [sid for group in self.replay_index["groups"] for sid in group_sample_ids(group)]


def group_sample_ids(group: dict[str, Any]) -> list[str]:
    return [meta["sample_id"] for meta in group["rows_meta"]]


@dataclass
class DroppedRollouts:
    """What ``RunState.drop_restored_rollouts`` turned into groups to generate again."""

    committed: list[str]  # committed groups, now unfinished with nothing staged
    unfinished: list[str]  # unfinished groups whose staged siblings were discarded
    discarded_siblings: int
    sample_ids: list[str]  # rows of the committed groups, for the caller to clear


@dataclass
class RunState:
    """The parts of a run that a checkpoint holds (module docstring)."""

    controller: ControllerState
    buffer: ReplayBuffer
    sampler: PromptGroupSampler
    ledger: OwnershipLedger
    budgets: FailureBudgets
    dataloader: PromptDataLoader
    # Spare prompts drawn ahead for on_dropped_prompt: replace.
    replacement_reserve: list[PromptItem] = field(default_factory=list)
    # Unfinished groups restored from a checkpoint, redispatched before new prompts. They are
    # in the ledger already, so a snapshot taken while they wait still owns them.
    recovered_groups: list[UnfinishedGroup] = field(default_factory=list)
    # Validation passes (None: no validation scheduled).
    validation: ValidationState | None = None

    def capture(self, *, authoritative: bool) -> RolloutState:
        """Everything but the data-plane rows, taken synchronously.

        ``authoritative``: the replay index is saved (its groups' rows are restored). In
        shadow mode it is not; the prompts of the committed groups are kept instead, to be
        regenerated after a restore.
        """
        return RolloutState(
            controller=self.controller.state_dict(),
            sampler={"name": self.sampler.name, "dispatch": self.sampler.dispatch_state()},
            budgets=self.budgets.state_dict(),
            dataloader=self.dataloader.state_dict(),
            replay_index=self.buffer.state_dict() if authoritative else None,
            ledger=self.ledger.state_dict(),
            replacement_reserve=[dataclasses.asdict(item) for item in self.replacement_reserve],
            shadow_prompts=[]
            if authoritative
            else [dataclasses.asdict(item) for item in self.committed_prompts()],
            validation={} if self.validation is None else self.validation.state_dict(),
        )

    def restore(self, state: RolloutState, unfinished: list[UnfinishedGroup]) -> int:
        """Re-install ``state`` (before the run starts); returns the committed groups restored.

        The caller has checked that ``state`` was written by this sampler and that the data
        plane holds the rows its replay index lists. Committed groups become selectable
        again; the ``unfinished`` groups (parsed from ``state.ledger``) are owned by the
        ledger again and queued for redispatch at the recovery granularity their entry
        recorded. In shadow mode the prompts of the committed groups go back to the dataloader
        instead, so they are regenerated rather than lost.
        """
        self.controller.load_state_dict(state.controller)
        self.dataloader.load_state_dict(state.dataloader)
        self.sampler.load_dispatch_state(state.sampler["dispatch"])
        self.budgets.load_state_dict(state.budgets)
        restored = 0
        if state.replay_index is not None:
            self.buffer.load_state_dict(state.replay_index)
            restored = len(state.replay_index["groups"])
        else:
            self.dataloader.requeue([PromptItem(**item) for item in state.shadow_prompts])
        for group in unfinished:
            if group.granularity == "prompt_group":
                group.discard_staged()
            self.ledger.adopt(group)
        self.recovered_groups = list(unfinished)
        self.replacement_reserve = [PromptItem(**item) for item in state.replacement_reserve]
        if self.validation is not None and state.validation:
            for note in self.validation.load_state_dict(state.validation):
                log.warning("%s", note)
        return restored

    def drop_restored_rollouts(self) -> DroppedRollouts:
        """Right after a restore (``on_config_change: drop_rollouts``): every restored group
        is generated again, none lost, none trained twice.

        A committed group leaves the buffer (the caller clears its rows) and becomes an
        unfinished group with nothing staged; an unfinished group discards its staged
        siblings. Each keeps its admission — group id, ``target_step`` (in_order: the step it
        was admitted for) — and the dataloader and sampler positions stay where they are: the
        groups are *redispatched* as recovered groups (``readmit``: no gate, no count), not
        drawn again. Drawing them again would count their admissions twice and stamp them
        for later steps, leaving the steps they were admitted for short. Earlier target
        steps go first, so the step the trainer waits for is never queued behind later ones.
        """
        version = self.controller.trainer_version
        committed = sorted(self.buffer.ready_groups(), key=lambda slot: slot.dispatch_index)
        regenerated: list[UnfinishedGroup] = []
        sample_ids: list[str] = []
        for slot in committed:
            # A group restored from a replay index has no prompt: draw it again by its id.
            item = slot.item if slot.item is not None else self.dataloader.item_for(slot.group_id)
            self.buffer.remove(slot.group_id)
            sample_ids.extend(slot.sample_ids)
            group = UnfinishedGroup(
                item,
                slot.group_id,
                slot.target_step,
                version,
                resolve_granularity(item, self.ledger.cfg),
                recovered=True,
            )
            self.ledger.adopt(group)
            regenerated.append(group)
        discarded = 0
        for group in self.recovered_groups:
            discarded += len(group.staged)
            group.discard_staged()
        unfinished = [group.group_id for group in self.recovered_groups]
        groups = [*regenerated, *self.recovered_groups]
        groups.sort(key=lambda group: (group.target_step is None, group.target_step or 0))
        for group in groups:  # the ledger in the same order: a snapshot keeps it
            self.ledger.close(group.group_id)
        for group in groups:
            self.ledger.adopt(group)
        self.recovered_groups = groups
        return DroppedRollouts(
            committed=[group.group_id for group in regenerated],
            unfinished=unfinished,
            discarded_siblings=discarded,
            sample_ids=sample_ids,
        )

    def committed_prompts(self) -> list[PromptItem]:
        """Prompts of the committed, unconsumed groups (in buffer order)."""
        slots = [*self.buffer.live_groups(), *self.buffer.claimed_groups()]
        prompts = []
        for slot in slots:
            if not slot.ready:
                continue
            if slot.item is None:
                raise RuntimeError(
                    f"committed group {slot.group_id} has no prompt (restored from a replay "
                    "index); a shadow-mode capture cannot regenerate it"
                )
            prompts.append(slot.item)
        return prompts
