"""The prompt-group sampler contract and the admission gate shared by the built-in samplers.

A sampler is the staleness policy of a run, applied on both sides of the replay buffer:

- rollout side: ``admit`` is awaited by the rollout pump before it dispatches a prompt. It
  returns at once while the gate is open, and waits (asyncio) while it is closed, re-checking
  whenever a pump calls ``notify`` (after a version bump, a commit, a removal, a step close).
  ``close`` wakes every waiter with ``SamplerClosed`` so that shutdown never hangs.
- train side: ``evict`` drops groups the policy can never train, then ``select`` picks the next
  batch (or chunk) from the ready groups and claims it in the buffer.

Samplers are pure state machines: they own no tasks, clients or I/O; the pumps drive them.
``notify`` and ``close`` must be called from the event loop's thread.

Each sampler owns its rules and is asked for them (by validation, setup and the pumps), so
each rule is stated once, in the sampler's words:

- ``lookahead_at(trainer_version)``: how many batches dispatch may lead the trainer by at that
  version (None: not gated);
- ``required_buffer_capacity(groups_per_step)``: the smallest ``max_buffered_rollouts`` it runs
  with (a smaller buffer deadlocks the rollout pump, so setup refuses it);
- the built-ins also say whether they admit off-policy data (``off_policy_reason``), which
  decides whether importance-sampling correction is required.

The gate of the gated samplers (in_order, weight_fifo, ready_first), in the spec's words,
"dispatch may lead the trainer by up to L batches": the i-th admitted group (i = 0, 1, 2 …)
belongs to batch ``i // N`` and is admitted while ``i // N <= trainer_version + L``, i.e.

    admitted_so_far < (trainer_version + L + 1) * N        N = groups per step

with L = ``lookahead_at(trainer_version)``: ``max_lookahead_versions`` (in_order; during PPO
critic warm-up ``warmup_lookahead_versions``) or ``max_staleness_versions`` (weight_fifo,
ready_first). The buffer must hold every group the widest gate admits: ``N x (widest L + 1)``.
``admitted_so_far`` never goes down: a group that fails or is dropped keeps its
gate slot, exactly as a dropped in_order group keeps its dispatch index. Two consequences:

- ``on_dropped_prompt: shrink`` — the step the drop belonged to trains short; the gate does
  not hand the slot to an unrelated prompt (that would let dispatch run further ahead than L
  batches, and a weight_fifo group could then age out of its window and never be trained).
- ``on_dropped_prompt: replace`` — the pump reports the drop with ``on_group_removed`` and
  dispatches the replacement through ``admit_replacement``, which is NOT gated: it reuses the
  dropped group's slot. Gating it could deadlock (the trainer waits for the replacement to fill
  the step, the replacement waits for the trainer to finish the step).
- dynamic sampling (``grpo.use_dynamic_sampling``) reports a filtered zero-advantage group
  with ``on_group_filtered``; the replacement is owed until the rollout pump's next ``admit``,
  which returns it before it consults the gate (so it is not gated either, for the same
  reason).

After a restart, ``load_dispatch_state`` restores the admission count, which already includes
the groups that were in flight at the snapshot; the recovery ledger redispatches those with
``readmit`` (no gate, no count), so nothing is charged twice.
"""

from __future__ import annotations

import asyncio
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from tandemrl.buffer import ReplayBuffer, Slot


class SamplerClosed(RuntimeError):
    """Raised by ``admit`` once the sampler is closed (shutdown): stop dispatching."""


class SamplerError(RuntimeError):
    """A sampler call broke the sampler's contract (bad state, unknown replacement, ...)."""


class SamplerConfigError(ValueError):
    """``async_rl.sampler`` cannot be turned into a sampler; the message names the dotpath."""


TrainerVersionFn = Callable[[], int]
Selection = tuple[list[Slot] | None, int]


class PromptGroupSampler(ABC):
    """Base class of every sampler (built-in or custom); see the module docstring."""

    name: ClassVar[str] = "abstract"
    # Completed buffered groups may be restored from a checkpoint for this sampler.
    supports_buffer_checkpoint: ClassVar[bool] = False
    # select() claims groups in the buffer (claim_for_training) instead of removing them.
    supports_training_claims: ClassVar[bool] = False

    def __init__(self, buffer: ReplayBuffer, *, groups_per_step: int) -> None:
        if groups_per_step < 1:
            raise SamplerError(f"groups_per_step must be >= 1, got {groups_per_step}")
        self.buffer = buffer
        self.groups_per_step = groups_per_step
        # Prompts admitted so far (for in_order: the next dispatch index).
        self.num_admitted = 0
        # target_step (None outside in_order) of each dropped group not yet replaced.
        self.replacement_credits: list[int | None] = []
        # target_step (None outside in_order) of each group dynamic sampling filtered whose
        # replacement the rollout pump has not drawn yet (handed out by ``admit``).
        self.owed_replacements: list[int | None] = []
        self._closed = False
        self._wakeup: asyncio.Event | None = None
        self._wakeup_loop: asyncio.AbstractEventLoop | None = None

    # ------------------------------------------------------------------ rollout side

    async def admit(self, *, trainer_version_fn: TrainerVersionFn) -> int | None:
        """Wait until the gate admits one more prompt; return its target_step (or None).

        A replacement owed for a filtered group (``on_group_filtered``) is handed out first,
        without the gate: the step it belongs to needs a fresh group to fill.
        """
        while True:
            if self._closed:
                raise SamplerClosed(f"{self.name} sampler is closed; no more prompts are admitted")
            if self.owed_replacements:
                return self.owed_replacements.pop(0)
            if self.gate_open(trainer_version_fn()):
                return self._record_admission()
            await self._wait_for_notify()

    def gate_open(self, trainer_version: int) -> bool:
        """True when one more prompt may be admitted under ``trainer_version``. Ungated here."""
        return True

    def _record_admission(self) -> int | None:
        self.num_admitted += 1
        return None

    def on_group_removed(self, slot: Slot) -> None:
        """A group left the buffer without being trained (failed or dropped rollout).

        Records a replacement credit: the pump may dispatch one replacement for it through
        ``admit_replacement``. Under ``on_dropped_prompt: shrink`` the call may be skipped (an
        unused credit changes nothing; the drop budget bounds how many pile up). Eviction
        (windowed) is not reported here.
        """
        self.replacement_credits.append(slot.target_step)

    def on_group_filtered(self, slot: Slot) -> None:
        """Dynamic sampling removed a ready group of zero advantage: its step is one group
        short, so the next ``admit`` returns a replacement for it at once, ungated."""
        self.owed_replacements.append(slot.target_step)

    def on_group_promoted(self, *, from_step: int | None, to_step: int | None) -> None:
        """A ready group of ``from_step`` filled a dropped place of ``to_step``.

        Pair of ``buffer.promote_ready_group``: the dropped group's credit is used up by the
        promotion, and ``from_step``'s batch is now one group short, so the credit moves there
        (a later ``admit_replacement(from_step)`` refills it).
        """
        self._take_credit(to_step)
        self.replacement_credits.append(from_step)

    def admit_replacement(self, target_step: int | None = None) -> int | None:
        """Admit a prompt that takes a dropped group's place; not gated (see module docstring).

        ``target_step`` is the dropped group's (None outside in_order). Returns the stamp for
        the replacement: the same target_step.
        """
        self._take_credit(target_step)
        return target_step

    def _take_credit(self, target_step: int | None) -> None:
        if target_step not in self.replacement_credits:
            raise SamplerError(
                f"{self.name} sampler: no dropped group with target_step {target_step!r} awaits "
                f"a replacement (pending: {self.replacement_credits}); call on_group_removed "
                "first"
            )
        self.replacement_credits.remove(target_step)

    def readmit(self, target_step: int | None = None) -> int | None:
        """Redispatch a group admitted before a restart (its admission is already counted)."""
        return target_step

    # ------------------------------------------------------------------ train side

    @abstractmethod
    async def select(
        self, *, current_train_weight: int, min_prompt_groups: int, max_prompt_groups: int
    ) -> Selection:
        """Claim between min and max eligible ready groups; never waits.

        Returns ``(groups, n_eligible)`` when at least ``min_prompt_groups`` eligible groups
        are ready (the first ``max_prompt_groups`` of them in the sampler's order are claimed
        with ``buffer.claim_for_training``), else ``(None, n_eligible)`` and claims nothing.
        """

    async def evict(self, *, current_train_weight: int) -> list[Slot]:
        """Remove ready groups that can never be trained; return them (the caller clears rows)."""
        return []

    def should_abort_inflight(self, *, start_weight: int, current_train_weight: int) -> bool:
        """True when an in-flight group started at ``start_weight`` can never be trained."""
        return False

    @abstractmethod
    def required_buffer_capacity(self, groups_per_step: int) -> int:
        """Smallest ``max_buffered_rollouts`` this sampler runs with (setup refuses less)."""

    def lookahead_at(self, trainer_version: int) -> int | None:
        """Batches dispatch may lead the trainer by at ``trainer_version``; None: ungated."""
        return None

    # ------------------------------------------------------------------ dispatch state

    def dispatch_state(self) -> dict[str, Any]:
        """JSON-able dispatch position, saved with checkpoints."""
        return {
            "sampler": self.name,
            "num_admitted": self.num_admitted,
            "replacement_credits": list(self.replacement_credits),
            "owed_replacements": list(self.owed_replacements),
        }

    def load_dispatch_state(self, state: dict[str, Any]) -> None:
        """Restore ``dispatch_state()``; checks everything before changing anything."""
        if state.get("sampler") != self.name:
            raise SamplerError(
                f"dispatch state was saved by the {state.get('sampler')!r} sampler, this run uses "
                f"{self.name!r} (async_rl.sampler.name changed)"
            )
        num_admitted = state.get("num_admitted")
        credits = state.get("replacement_credits", [])
        owed = state.get("owed_replacements", [])  # absent in states written before it existed
        if not isinstance(num_admitted, int) or num_admitted < 0:
            raise SamplerError(f"dispatch state: bad num_admitted {num_admitted!r}")
        for key, steps in (("replacement_credits", credits), ("owed_replacements", owed)):
            if not isinstance(steps, list) or not all(
                c is None or isinstance(c, int) for c in steps
            ):
                raise SamplerError(f"dispatch state: bad {key} {steps!r}")
        self._check_dispatch_state(state)
        self.num_admitted = num_admitted
        self.replacement_credits = list(credits)
        self.owed_replacements = list(owed)
        self._apply_dispatch_state(state)

    def _check_dispatch_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Subclass hook: validate extra keys of ``state`` (raise SamplerError)."""

    def _apply_dispatch_state(self, state: dict[str, Any]) -> None:  # noqa: B027 - optional hook
        """Subclass hook: apply extra keys of an already validated ``state``."""

    # ------------------------------------------------------------------ wake-ups

    def notify(self) -> None:
        """Wake waiting ``admit`` calls so they re-check the gate (call from the loop thread)."""
        event, self._wakeup = self._wakeup, None
        if event is not None:
            event.set()

    def close(self) -> None:
        """Refuse further admissions; waiting ``admit`` calls raise SamplerClosed."""
        self._closed = True
        self.notify()

    @property
    def closed(self) -> bool:
        return self._closed

    def _wakeup_event(self) -> asyncio.Event:
        """The event the next ``notify`` sets (created synchronously, so no notify is missed)."""
        # One event per notify "generation": notify() sets it and drops it, so every waiter
        # that was parked before the notify wakes, and later waiters park on a fresh event.
        loop = asyncio.get_running_loop()
        if self._wakeup is None or self._wakeup_loop is not loop:
            self._wakeup = asyncio.Event()
            self._wakeup_loop = loop
        return self._wakeup

    async def _wait_for_notify(self) -> None:
        await self._wakeup_event().wait()

    # ------------------------------------------------------------------ helpers

    def _claim(
        self, eligible: list[Slot], min_prompt_groups: int, max_prompt_groups: int
    ) -> Selection:
        """Claim the first ``max_prompt_groups`` of ``eligible`` if there are at least ``min``."""
        if not 1 <= min_prompt_groups <= max_prompt_groups:
            raise SamplerError(
                f"select needs 1 <= min_prompt_groups <= max_prompt_groups, got "
                f"{min_prompt_groups} and {max_prompt_groups}"
            )
        if len(eligible) < min_prompt_groups:
            return None, len(eligible)
        chosen = eligible[:max_prompt_groups]
        self.buffer.claim_for_training([slot.group_id for slot in chosen])
        return chosen, len(eligible)


class GatedSampler(PromptGroupSampler):
    """The lookahead gate shared by in_order, weight_fifo and ready_first (module docstring).

    A subclass states its lookahead at each trainer version (``lookahead_at``) and the widest
    one it ever uses (``widest_lookahead_versions``); the gate and the capacity follow.
    """

    supports_buffer_checkpoint = True
    supports_training_claims = True

    @property
    @abstractmethod
    def widest_lookahead_versions(self) -> int:
        """The largest ``lookahead_at`` of the run: what the buffer is sized for."""

    @abstractmethod
    def lookahead_at(self, trainer_version: int) -> int: ...

    def gate_limit(self, trainer_version: int) -> int:
        """How many prompts may have been admitted in total under ``trainer_version``."""
        lookahead = self.lookahead_at(trainer_version)
        return (trainer_version + lookahead + 1) * self.groups_per_step

    def gate_open(self, trainer_version: int) -> bool:
        return self.num_admitted < self.gate_limit(trainer_version)

    def required_buffer_capacity(self, groups_per_step: int) -> int:
        """``N x (L + 1)`` for the widest ``L``: the batch being trained plus ``L`` ahead."""
        return groups_per_step * (self.widest_lookahead_versions + 1)

    def off_policy_reason(self) -> str | None:
        """The setting that lets the sampler hand the trainer off-policy groups; None if none."""
        if self.widest_lookahead_versions > 0:
            return "async_rl.sampler.max_staleness_versions"
        return None

    def _check_dispatch_state(self, state: dict[str, Any]) -> None:
        # Checkpoints written before the lookahead followed the trainer version hold the gate's
        # lookahead; it is checked (a state from a run with a wider gate is refused) and then
        # ignored: the lookahead at each version is this sampler's rule.
        if "lookahead_versions" not in state:
            return
        lookahead = state["lookahead_versions"]
        if not isinstance(lookahead, int) or not 0 <= lookahead <= self.widest_lookahead_versions:
            raise SamplerError(
                f"dispatch state: lookahead_versions {lookahead!r} is outside [0, "
                f"{self.widest_lookahead_versions}]"
            )


class StalenessGatedSampler(GatedSampler):
    """The gate with ``L = max_staleness_versions``: the base of weight_fifo and ready_first.

    Subclasses implement ``select``.
    """

    def __init__(
        self, buffer: ReplayBuffer, *, groups_per_step: int, max_staleness_versions: int = 1
    ) -> None:
        super().__init__(buffer, groups_per_step=groups_per_step)
        if max_staleness_versions < 0:
            raise SamplerError(f"max_staleness_versions must be >= 0, got {max_staleness_versions}")
        self.max_staleness_versions = max_staleness_versions

    @property
    def widest_lookahead_versions(self) -> int:
        return self.max_staleness_versions

    def lookahead_at(self, trainer_version: int) -> int:
        return self.max_staleness_versions
