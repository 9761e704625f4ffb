"""Validation passes as pure state: which versions are due, what open passes have finished,
and the metrics a finished pass reports. No tasks, no clients; the validation runner
(``tandemrl.controller.validation``) drives it and a checkpoint captures it.

A pass evaluates every held-out prompt (``data.validation``, the first ``max_val_samples``)
with ``val_num_generations`` completions each. It is *pinned* to the trainer version that
generation holds when it opens, and reported under that version:

    due        v % val_period == 0 (v > 0); v == 0 with val_at_start; the final version with
               val_at_end (``open_if_due`` / ``open_final``)
    open       one entry per pass not reported yet, oldest first: its version, the prompts
               still pending and the outcome of every finished prompt
    reported   ``close`` hands a finished pass to the runner, which reports its metrics once

Several passes may be open at once (a pass longer than ``val_period`` steps): each keeps the
version it opened at, and the runner serves the oldest first. Nothing here touches the replay
buffer, the ledger, the data plane or the sampler.

Restarts: ``state_dict`` holds the open passes with their finished prompts and
``scheduled_through`` (every version up to it has been considered); a restart re-opens them and
evaluates only their pending prompts. State written for another validation set (its
fingerprint) or another k restarts those passes from scratch.

Metrics of a pass (``pass_metrics``): ``val/reward_mean``, ``val/pass@{k}`` (prompts with at
least one solved completion: the environment's ``correct`` metadata, or a reward of at least
1.0 without it), ``val/mean_length`` (completion tokens), ``val/truncated_frac``,
``val/version_span`` (highest minus lowest weight version among the pass's tokens: 0 when the
weights did not change during the pass), the same four per ``task_source`` as
``val/<source>/...``, and counts.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import Any

# The metric names a pass always reports (``pass@{k}`` is spelled with the configured k).
CORE_METRICS = ("reward_mean", "mean_length", "truncated_frac")


def pass_at(k: int) -> str:
    return f"pass@{k}"


def metric_name_problem(name: str, *, k: int) -> str | None:
    """Why ``name`` is not a metric a validation pass reports (None: it is)."""
    known = [*CORE_METRICS, pass_at(k), "version_span"]
    parts = name.split("/")
    if parts[0] == "val" and (
        (len(parts) == 2 and parts[1] in known)
        or (len(parts) == 3 and parts[1] and parts[2] in known[:4])
    ):
        return None
    listed = ", ".join(f"val/{metric}" for metric in known)
    return (
        f"{name!r} is not a validation metric; use one of {listed}, or "
        f"val/<task_source>/<metric> for one task source"
    )


@dataclass
class PromptOutcome:
    """One held-out prompt's completions in one pass (failed ones counted, not listed)."""

    index: int
    task_source: str | None
    rewards: list[float] = field(default_factory=list)
    lengths: list[int] = field(default_factory=list)
    truncated: list[bool] = field(default_factory=list)
    solved: list[bool] = field(default_factory=list)
    # Lowest and highest weight version that generated any of its tokens (None: nothing came).
    lowest_version: int | None = None
    highest_version: int | None = None
    failed: int = 0
    failure: str | None = None  # why the failed completions failed (the first cause)

    def add_weight_versions(self, versions: list[int]) -> None:
        if not versions:
            return
        low, high = min(versions), max(versions)
        self.lowest_version = low if self.lowest_version is None else min(self.lowest_version, low)
        self.highest_version = (
            high if self.highest_version is None else max(self.highest_version, high)
        )


@dataclass
class OpenPass:
    version: int
    pending: list[int]
    results: dict[int, PromptOutcome] = field(default_factory=dict)
    # Restarts that re-opened this pass (its finished prompts were kept).
    restarts: int = 0

    @property
    def finished(self) -> bool:
        return not self.pending


@dataclass(frozen=True)
class ValidationSchedule:
    val_period: int
    at_start: bool
    at_end: bool

    @property
    def enabled(self) -> bool:
        return self.val_period > 0 or self.at_start or self.at_end

    def due(self, version: int) -> bool:
        if version == 0:
            return self.at_start
        return self.val_period > 0 and version % self.val_period == 0


class ValidationState:
    def __init__(
        self, schedule: ValidationSchedule, *, num_prompts: int, k: int, fingerprint: str
    ) -> None:
        self.schedule = schedule
        self.num_prompts = num_prompts
        self.k = k
        self.fingerprint = fingerprint  # of the held-out prompts (their records, in order)
        self.open: list[OpenPass] = []
        # Every version up to this one has been checked against the schedule (-1: none yet).
        self.scheduled_through = -1
        # Versions whose pass was reported (this process, or the run's lineage before a
        # restart): never opened again.
        self.reported: set[int] = set()

    # ------------------------------------------------------------------ schedule

    def open_if_due(self, version: int) -> OpenPass | None:
        """Generation now holds ``version``: open its pass when it is due (once per version)."""
        if version <= self.scheduled_through:
            return None
        self.scheduled_through = version
        if not self.schedule.due(version):
            return None
        return self._open(version)

    def open_final(self, version: int) -> OpenPass | None:
        """The run ends at ``version``: with val_at_end, open its pass unless it had one."""
        if not self.schedule.at_end:
            return None
        had_one = version <= self.scheduled_through and self.schedule.due(version)
        self.scheduled_through = max(self.scheduled_through, version)
        if had_one or any(p.version == version for p in self.open):
            return None
        return self._open(version)

    def _open(self, version: int) -> OpenPass | None:
        if version in self.reported:
            return None
        opened = OpenPass(version=version, pending=list(range(self.num_prompts)))
        self.open.append(opened)
        return opened

    # ------------------------------------------------------------------ progress

    def record(self, version: int, outcome: PromptOutcome) -> None:
        opened = self.pass_at(version)
        opened.pending.remove(outcome.index)
        opened.results[outcome.index] = outcome

    def pass_at(self, version: int) -> OpenPass:
        for opened in self.open:
            if opened.version == version:
                return opened
        raise KeyError(f"no validation pass of version {version} is open")

    def close(self, version: int) -> OpenPass:
        """Remove a finished pass (the runner reports it)."""
        opened = self.pass_at(version)
        if not opened.finished:
            raise RuntimeError(
                f"validation pass of version {version} still has {len(opened.pending)} prompt(s)"
            )
        self.open.remove(opened)
        self.reported.add(version)
        return opened

    def forget_reported(self, versions: set[int]) -> list[int]:
        """Passes of ``versions`` were reported already (before a restart): drop the open
        ones and never open them again."""
        self.reported |= versions
        dropped = [p.version for p in self.open if p.version in versions]
        self.open = [p for p in self.open if p.version not in versions]
        return dropped

    @property
    def idle(self) -> bool:
        return not self.open

    def unfinished_prompts(self) -> int:
        return sum(len(p.pending) for p in self.open)

    def open_versions(self) -> list[int]:
        return [p.version for p in self.open]

    # ------------------------------------------------------------------ state

    def state_dict(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "k": self.k,
            "scheduled_through": self.scheduled_through,
            "open": [
                {
                    "version": p.version,
                    "pending": list(p.pending),
                    "results": [asdict(outcome) for outcome in p.results.values()],
                    "restarts": p.restarts,
                }
                for p in self.open
            ],
        }

    def load_state_dict(self, state: dict[str, Any]) -> list[str]:
        """Re-install a captured state; returns one note per pass that starts over."""
        notes: list[str] = []
        self.scheduled_through = int(state.get("scheduled_through", -1))
        same_prompts = state.get("fingerprint") == self.fingerprint and state.get("k") == self.k
        self.open = []
        for entry in state.get("open", []):
            version = int(entry["version"])
            if not same_prompts:
                notes.append(
                    f"validation pass of version {version}: its held-out prompts or "
                    "val_num_generations changed since the checkpoint; it starts over"
                )
                restarted = self._open(version)
                if restarted is not None:
                    restarted.restarts = int(entry.get("restarts", 0)) + 1
                continue
            results = {
                int(outcome["index"]): PromptOutcome(**outcome) for outcome in entry["results"]
            }
            self.open.append(
                OpenPass(
                    version=version,
                    pending=[int(index) for index in entry["pending"]],
                    results=results,
                    restarts=int(entry.get("restarts", 0)) + 1,
                )
            )
        return notes


# --------------------------------------------------------------------------- metrics


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else math.nan


def _group_metrics(outcomes: list[PromptOutcome], k: int) -> dict[str, float]:
    rewards = [r for o in outcomes for r in o.rewards]
    lengths = [float(n) for o in outcomes for n in o.lengths]
    truncated = [float(t) for o in outcomes for t in o.truncated]
    scored = [o for o in outcomes if o.solved]
    return {
        "reward_mean": _mean(rewards),
        pass_at(k): _mean([float(any(o.solved)) for o in scored]),
        "mean_length": _mean(lengths),
        "truncated_frac": _mean(truncated),
    }


def pass_metrics(opened: OpenPass, k: int) -> dict[str, float]:
    """``val/...`` metrics of a finished pass (see the module docstring)."""
    outcomes = [opened.results[index] for index in sorted(opened.results)]
    metrics = {f"val/{name}": value for name, value in _group_metrics(outcomes, k).items()}
    low = [o.lowest_version for o in outcomes if o.lowest_version is not None]
    high = [o.highest_version for o in outcomes if o.highest_version is not None]
    metrics["val/version_span"] = float(max(high) - min(low)) if low else 0.0
    metrics["val/num_prompts"] = float(len(outcomes))
    metrics["val/num_completions"] = float(sum(len(o.rewards) for o in outcomes))
    metrics["val/failed_completions"] = float(sum(o.failed for o in outcomes))
    by_source: dict[str, list[PromptOutcome]] = defaultdict(list)
    for outcome in outcomes:
        if outcome.task_source is not None:
            by_source[outcome.task_source].append(outcome)
    for source in sorted(by_source):
        for name, value in _group_metrics(by_source[source], k).items():
            metrics[f"val/{source}/{name}"] = value
    return metrics


def is_solved(reward: float, metadata: dict[str, Any]) -> bool:
    """A completion solves its prompt: the environment's ``correct`` flag, else reward >= 1."""
    correct = metadata.get("correct")
    if isinstance(correct, bool | int | float):
        return bool(correct)
    return reward >= 1.0
