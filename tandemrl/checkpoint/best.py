"""The best trainer checkpoint by a validation metric, kept besides the latest ones.

With ``checkpointing.metric_name`` (a ``val/...`` metric) each validation pass scores the
trainer checkpoint of the version it evaluated: trainer version N is the weights of
``step_N`` (the version is bumped once per step). Retention (``checkpointing.keep_top_k``)
then keeps:

    the latest keep_top_k step_N folders
    + the best scored one on disk (highest value, or lowest with higher_is_better: false;
      ties: the later step)
    + every step_N whose validation pass is still open (it may become the best)

``best_checkpoint.json`` in the checkpoint directory records the choice and the scores it was
made from; ``tandemrl inspect`` reads it and says which checkpoint is best and why. Scores of a
run's passes come from the run journal's ``validated`` events (``reported_validations``), so a
restart ranks with what its lineage reported.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from tandemrl.checkpoint.layout import step_dir

BEST_FILE = "best_checkpoint.json"


def score_of(metrics: Mapping[str, Any], metric_name: str) -> float | None:
    """The finite value of ``metric_name`` in a pass's metrics, or None."""
    value = metrics.get(metric_name)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def choose_best(
    scores: Mapping[int, float], on_disk: Iterable[int], *, higher_is_better: bool
) -> int | None:
    """The best scored step among ``on_disk`` (ties: the later step); None when none is scored."""
    candidates = [(step, scores[step]) for step in on_disk if step in scores]
    if not candidates:
        return None
    sign = 1.0 if higher_is_better else -1.0
    return max(candidates, key=lambda entry: (sign * entry[1], entry[0]))[0]


def steps_to_keep(
    on_disk: list[int], *, keep_latest: int | None, best: int | None, pending: Iterable[int]
) -> set[int]:
    """Which of ``on_disk`` (oldest first) retention keeps (module docstring)."""
    kept = set(on_disk if keep_latest is None else on_disk[-keep_latest:])
    if best is not None:
        kept.add(best)
    kept.update(step for step in pending if step in on_disk)
    return kept


def best_record(
    checkpoint_dir: Path,
    *,
    metric_name: str,
    higher_is_better: bool,
    scores: Mapping[int, float],
    on_disk: list[int],
) -> dict[str, Any]:
    """What ``best_checkpoint.json`` holds."""
    best = choose_best(scores, on_disk, higher_is_better=higher_is_better)
    return {
        "metric_name": metric_name,
        "higher_is_better": higher_is_better,
        "best": None
        if best is None
        else {
            "step": best,
            "path": str(step_dir(checkpoint_dir, best)),
            "value": scores[best],
        },
        # Scored checkpoints still on disk, and every score the run's passes reported.
        "validated_on_disk": {str(step): scores[step] for step in on_disk if step in scores},
        "scores": {str(version): value for version, value in sorted(scores.items())},
    }


def read_best_record(checkpoint_dir: Path) -> dict[str, Any] | None:
    path = checkpoint_dir / BEST_FILE
    if not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def explain(record: Mapping[str, Any], on_disk: Iterable[int]) -> str:
    """Why the recorded checkpoint is the best, in one paragraph (``tandemrl inspect``)."""
    name = record.get("metric_name")
    order = "higher" if record.get("higher_is_better", True) else "lower"
    validated = {
        int(step): value for step, value in (record.get("validated_on_disk") or {}).items()
    }
    best = record.get("best")
    if best is None:
        return (
            f"best checkpoint by {name} ({order} is better): none yet — no trainer checkpoint "
            "on disk has a reported validation pass"
        )
    present = set(on_disk)
    others = ", ".join(
        f"step_{step} {value:.4g}" for step, value in sorted(validated.items()) if step in present
    )
    missing = "" if best["step"] in present else " (its folder is gone from disk)"
    return (
        f"best checkpoint: step_{best['step']}{missing}, {name} = {best['value']:.4g} — the "
        f"{'highest' if order == 'higher' else 'lowest'} of the validated checkpoints on disk "
        f"({others}); kept besides the latest checkpointing.keep_top_k"
    )
