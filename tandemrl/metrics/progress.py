"""The run's one progress display: a rich bar over train steps, or one log line per step.

The rich display (a bar for steps, a text column with reward, staleness and tokens/s) is
used when ``logger.progress`` is on and the console is a terminal; otherwise each step is
reported as one plain ``logging`` line, so logs of a run without a terminal stay readable.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
)

logger = logging.getLogger(__name__)


def format_step_summary(metrics: Mapping[str, Any]) -> str:
    """``reward 0.512 | staleness 0.50/1 | 1234 tok/s`` from one step's metrics."""
    return (
        f"reward {float(metrics['reward_mean']):.3f} | "
        f"staleness {float(metrics['staleness_mean']):.2f}/{metrics['staleness_max']} | "
        f"{float(metrics['tokens_per_s']):.0f} tok/s"
    )


class ProgressDisplay:
    def __init__(
        self,
        *,
        enabled: bool,
        total_steps: int | None = None,
        initial_step: int = 0,
        console: Console | None = None,
    ) -> None:
        self.console = console if console is not None else Console(stderr=True)
        self.total_steps = total_steps
        # Rich redraws in place only on a terminal; elsewhere it would print escape noise.
        self.uses_rich = enabled and self.console.is_terminal
        self._progress: Progress | None = None
        self._task: TaskID | None = None
        if self.uses_rich:
            self._progress = Progress(
                TextColumn("[bold]steps"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("{task.fields[summary]}"),
                TimeElapsedColumn(),
                console=self.console,
            )
            self._task = self._progress.add_task(
                "train", total=total_steps, completed=initial_step, summary=""
            )
            self._progress.start()

    def update(self, metrics: Mapping[str, Any]) -> None:
        """Show one finished step (``metrics`` holds ``step`` and the summary fields)."""
        summary = format_step_summary(metrics)
        step = int(metrics["step"])
        if self._progress is not None and self._task is not None:
            self._progress.update(self._task, completed=step, summary=summary)
            return
        total = f"/{self.total_steps}" if self.total_steps is not None else ""
        logger.info("step %d%s | %s", step, total, summary)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
