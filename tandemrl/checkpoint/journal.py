"""The per-run journal: an append-only record of what every attempt of a run did.

One JSON object per line, flushed as it is written (a SIGKILL loses at most a torn last line,
which the reader drops):

- ``start``: an attempt began; ``resumed_step`` is the step it resumed after, with the
  committed groups and staged siblings its restore brought back.
- ``staged``: siblings of a group finished (generated and scored), before the group commits.
- ``generated``: a group committed; which siblings were generated fresh in this attempt and
  which were reused from token-capture staging (on-policy distillation: and how many teacher
  passes this attempt ran for it).
- ``trained``: a step closed; the groups it trained.
- ``validation_opened``: a validation pass opened at a trainer version (or was re-opened by a
  restart); ``validated``: it finished, with the metrics it reported.

``RunJournal`` implements the pumps' ``OwnershipEvents`` (``tandemrl.rollout.events``): it
records ``staged``, ``committed`` (as ``generated``), ``evicted`` and ``trained``, and ignores
the rest. Behind the commit log it is called by it (``CommitLogEvents``), so that a
``staged`` line is written only once the log holds the siblings it names.

``lineage`` replays the journal into what the final model was actually trained on: a
``start`` that resumed after step N voids every ``trained`` event after step N of the earlier
attempts. The chaos tests prove exactly-once training from it, and that no finished group or
sibling was generated again (``finished_again``). Each ``start`` also records the attempt's
config fingerprint and what a config change did (``config_change``), so the lineage can say,
for every trained group, under which attempt's config it was generated
(``trained_under_another_config``). ``reported_validations`` replays it the same way into the
validation passes reported in the current lineage: a restart re-opens a pass only when none of
them reported its version, so no version is reported twice.
"""

from __future__ import annotations

import json
import os
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandemrl.buffer import Slot
from tandemrl.rollout.ledger import UnfinishedGroup


class RunJournal:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.attempt = uuid.uuid4().hex[:12]
        self._handle = open(self.path, "a", encoding="utf-8")  # noqa: SIM115 - lives with the run
        # The commit log's writer thread records ``staged`` events too.
        self._lock = threading.Lock()

    def record(self, event: str, **fields: Any) -> None:
        line = json.dumps({"event": event, "attempt": self.attempt, **fields}, sort_keys=True)
        with self._lock:
            self._handle.write(line + "\n")
            self._handle.flush()

    # ------------------------------------------------------------------ ownership events

    def admitted(self, group: UnfinishedGroup) -> None:
        pass  # the journal records outcomes, not admissions

    def staged(self, group: UnfinishedGroup, siblings: list[int]) -> None:
        # May run on the commit log's writer thread (``record`` takes the lock).
        self.record("staged", group_id=group.group_id, siblings=siblings)

    async def committed(
        self, group: UnfinishedGroup, slot: Slot, *, end_weight: int, fresh_siblings: list[int]
    ) -> None:
        self.generated(group.group_id, fresh_siblings, teacher_passes_of(group))

    def generated(
        self, group_id: str, fresh_siblings: list[int], teacher_passes: int | None = None
    ) -> None:
        # May run on the commit log's writer thread (``record`` takes the lock).
        if teacher_passes is None:
            self.record("generated", group_id=group_id, fresh_siblings=fresh_siblings)
            return
        self.record(
            "generated",
            group_id=group_id,
            fresh_siblings=fresh_siblings,
            teacher_passes=teacher_passes,
        )

    def dropped(self, group: UnfinishedGroup) -> None:
        pass

    def promoted(self, group_id: str, target_step: int | None) -> None:
        pass

    def evicted(self, group_ids: list[str]) -> None:
        self.record("evicted", groups=group_ids)

    def filtered(self, group_ids: list[str]) -> None:
        self.record("filtered", groups=group_ids)

    def trained(self, step: int, group_ids: list[str]) -> None:
        self.record("trained", step=step, groups=group_ids)

    def reserve_filled(self) -> None:
        pass

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        if self._handle.closed:
            return
        self._handle.flush()
        os.fsync(self._handle.fileno())
        self._handle.close()


def teacher_passes_of(group: UnfinishedGroup) -> int | None:
    """On-policy distillation: the teacher passes this attempt ran for a committing group (0:
    its teacher logprobs came back from a checkpoint with its staged siblings); None when the
    group carries no teacher logprobs."""
    return None if group.teacher_logprobs is None else group.teacher_passes


def read_journal(path: Path) -> list[dict[str, Any]]:
    events = []
    lines = Path(path).read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, start=1):
        try:
            events.append(json.loads(line))
        except json.JSONDecodeError:
            if number == len(lines):
                break  # torn last line of a killed attempt
            raise ValueError(f"{path}:{number}: corrupt journal line") from None
    return events


@dataclass
class Lineage:
    trained: dict[int, list[str]] = field(default_factory=dict)  # step -> groups, final lineage
    attempts: int = 0
    restores: list[dict[str, Any]] = field(default_factory=list)
    # (attempt, group_id, sibling) of every fresh generation, over all attempts
    fresh_generations: list[tuple[str, str, int]] = field(default_factory=list)
    regenerated_after_restore: list[str] = field(default_factory=list)
    # (group_id, sibling) -> the attempts in which it finished (``staged`` events)
    finished_in: dict[tuple[str, int], set[str]] = field(default_factory=dict)
    # step -> group -> (attempt that trained it, attempt whose commit it was trained from;
    # None: no commit of it in the journal), for the steps of the final lineage
    trained_from: dict[int, dict[str, tuple[str, str | None]]] = field(default_factory=dict)
    fingerprints: dict[str, str | None] = field(default_factory=dict)  # attempt -> its config

    def trained_under_another_config(self) -> list[tuple[int, str, str, str | None]]:
        """(step, group, trainer attempt, generator attempt) of each group the final model was
        trained on that was generated under another config than the attempt that trained it
        (generator None: no commit of it in the journal, it came from a restore)."""
        found = []
        for step in sorted(self.trained_from):
            for group, (trainer, generator) in self.trained_from[step].items():
                fingerprint = self.fingerprints.get(trainer)
                if generator is None or self.fingerprints.get(generator) != fingerprint:
                    found.append((step, group, trainer, generator))
        return found

    def finished_again(self) -> list[tuple[str, int]]:
        """Siblings that finished in more than one attempt: work a restart repeated."""
        return sorted(key for key, attempts in self.finished_in.items() if len(attempts) > 1)

    def trained_groups(self) -> list[str]:
        return [group for step in sorted(self.trained) for group in self.trained[step]]


def lineage(events: list[dict[str, Any]]) -> Lineage:
    result = Lineage()
    restored_committed: dict[str, set[str]] = {}
    restored_staged: dict[str, set[tuple[str, int]]] = {}
    generated_by: dict[str, str] = {}  # group -> attempt of its latest commit
    for event in events:
        kind = event["event"]
        if kind == "start":
            result.attempts += 1
            resumed = int(event.get("resumed_step", 0))
            result.trained = {
                step: groups for step, groups in result.trained.items() if step <= resumed
            }
            result.trained_from = {
                step: groups for step, groups in result.trained_from.items() if step <= resumed
            }
            result.fingerprints[event["attempt"]] = event.get("fingerprint")
            result.restores.append(event)
            restored_committed[event["attempt"]] = set(event.get("restored_committed", []))
            restored_staged[event["attempt"]] = {
                (g, int(s)) for g, s in event.get("restored_staged", [])
            }
        elif kind == "trained":
            result.trained[int(event["step"])] = list(event["groups"])
            result.trained_from[int(event["step"])] = {
                group: (event["attempt"], generated_by.get(group)) for group in event["groups"]
            }
        elif kind == "staged":
            for sibling in event["siblings"]:
                key = (event["group_id"], int(sibling))
                result.finished_in.setdefault(key, set()).add(event["attempt"])
        elif kind == "generated":
            attempt, group = event["attempt"], event["group_id"]
            generated_by[group] = attempt
            for sibling in event["fresh_siblings"]:
                result.fresh_generations.append((attempt, group, int(sibling)))
                if group in restored_committed.get(attempt, set()) or (
                    group,
                    int(sibling),
                ) in restored_staged.get(attempt, set()):
                    result.regenerated_after_restore.append(f"{group}/{sibling}")
    return result


def reported_validations(events: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Version -> metrics row of every validation pass reported in the current lineage: a
    ``start`` that resumed after step N voids the reports of versions above N (those steps
    are trained again, and their passes run again); a fresh start (no bundle: ``source``
    null) voids them all, as it starts the run's logs over."""
    reported: dict[int, dict[str, Any]] = {}
    for event in events:
        kind = event["event"]
        if kind == "start":
            resumed = int(event.get("resumed_step", 0))
            fresh = "source" in event and event["source"] is None
            reported = {v: row for v, row in reported.items() if v <= resumed and not fresh}
        elif kind == "validated":
            reported[int(event["version"])] = dict(event.get("metrics") or {})
    return reported
