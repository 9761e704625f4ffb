"""Per-step metrics: ``<log_dir>/metrics.jsonl``, TensorBoard scalars, a plot at the end.

``MetricsLogger.log_step(metrics)`` takes one train step's metrics, refuses it when a required
field (``REQUIRED_FIELDS``) is missing or the step does not come after the last one, then:

- appends one JSON object as one line to ``metrics.jsonl`` and flushes it (``logger.jsonl``);
- writes every numeric field as a TensorBoard scalar at that step (``logger.tensorboard``);
- updates the progress display (rich bar, or one log line per step) unless ``display=False``;
- hands the row to each experiment tracker ``logger.wandb`` / ``logger.mlflow`` enables
  (``trackers.py``), which log the same numeric fields at the same step.

``log_samples(step, samples)`` appends a few sampled completions with their rewards to
``samples.jsonl`` and to TensorBoard as text. ``log_validation(row)`` takes one validation
pass's metrics (``trainer_version``: the version it evaluated; ``val/...`` fields): one line in
``validation.jsonl`` (one line per version: a version logged again replaces its line), its
``val/`` fields as TensorBoard scalars at step = that version, and the trackers. ``close()``
writes ``reward_throughput.png`` (reward_mean per step with the validation curve of
``val/reward_mean`` beside it, and tokens_per_s) when ``logger.plot`` is on and at least one
step was logged.

Nothing in ``log_dir`` is touched before the first step is logged: a run that fails during
setup leaves an earlier run's files as they were. Validation passes reported before it (of
the initial weights) are held and written with the first step.

Restarts: an existing ``metrics.jsonl`` is appended to, never truncated. With
``resume_step=N`` the file is first rewritten atomically keeping only lines with
``step < N`` (steps at or after the checkpoint are trained again and logged again), and
``validation.jsonl`` keeping only passes of versions below N; pass
``resume_step=0`` to start a fresh run in a used ``log_dir``, and ``overwrite=True`` to also
remove that run's TensorBoard events, samples and plot (both at the first logged step). A torn
last line (the process was killed mid-write) is dropped with a warning.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from rich.console import Console

from tandemrl.config.models import LoggerConfig
from tandemrl.metrics.progress import ProgressDisplay
from tandemrl.metrics.trackers import MetricsSink, open_trackers

logger = logging.getLogger(__name__)

REQUIRED_FIELDS: tuple[str, ...] = (
    "step",
    "trainer_version",
    "reward_mean",
    "staleness_mean",
    "staleness_max",
    "groups_trained",
    "tokens_per_s",
    "step_time_s",
    "weight_sync_s",
)
METRICS_FILE = "metrics.jsonl"
SAMPLES_FILE = "samples.jsonl"
VALIDATION_FILE = "validation.jsonl"
PLOT_FILE = "reward_throughput.png"
TENSORBOARD_DIR = "tensorboard"
# What a finished run leaves in its log_dir (besides the final model, written at the end).
RUN_FILES: tuple[str, ...] = (
    METRICS_FILE,
    SAMPLES_FILE,
    VALIDATION_FILE,
    PLOT_FILE,
    TENSORBOARD_DIR,
)


def previous_run_files(log_dir: str | Path) -> list[Path]:
    """The files an earlier run left in ``log_dir`` (a non-empty metrics file, TensorBoard
    events, samples, the plot); empty when the folder is free for a new run."""
    root = Path(log_dir)
    found: list[Path] = []
    for name in RUN_FILES:
        path = root / name
        if path.is_dir():
            if any(path.iterdir()):
                found.append(path)
        elif path.is_file() and path.stat().st_size > 0:
            found.append(path)
    return found


def _to_json_value(value: Any) -> Any:
    # numpy and torch scalars carry .item(); anything else is a caller bug worth a clear error.
    if hasattr(value, "item"):
        return value.item()
    raise TypeError(f"metric value {value!r} of type {type(value).__name__} is not JSON")


def _read_metrics_lines(path: Path, key: str = "step") -> tuple[list[dict[str, Any]], bool, bool]:
    """Parsed lines of ``path``; whether a torn last line was dropped; whether to rewrite.
    Every line must hold an integer ``key``."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines()
    records: list[dict[str, Any]] = []
    dropped_torn = False
    for line_number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            if line_number == len(lines):
                dropped_torn = True
                break
            raise ValueError(f"{path}:{line_number}: not a JSON line ({error.msg})") from error
        if not isinstance(record, dict) or not isinstance(record.get(key), int):
            raise ValueError(f"{path}:{line_number}: not a metrics line (no integer {key!r})")
        records.append(record)
    # A last line without its newline would glue the next appended line onto it.
    needs_rewrite = dropped_torn or (bool(text) and not text.endswith("\n"))
    return records, dropped_torn, needs_rewrite


def _atomic_write_lines(path: Path, records: list[dict[str, Any]]) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as handle:
            for record in records:
                handle.write(json.dumps(record, default=_to_json_value) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        # mkstemp makes the file private (0600); the metrics file is as readable as any other.
        os.chmod(tmp_name, 0o666 & ~_umask())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class MetricsLogger:
    def __init__(
        self,
        cfg: LoggerConfig,
        *,
        resume_step: int | None = None,
        total_steps: int | None = None,
        console: Console | None = None,
        display: bool = True,
        overwrite: bool = False,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        """``run_config``: the config (credentials redacted) the trackers record with the run."""
        if resume_step is not None and resume_step < 0:
            raise ValueError(f"resume_step must be >= 0, got {resume_step}")
        self.cfg = cfg
        self.log_dir = Path(cfg.log_dir)
        self.metrics_path = self.log_dir / METRICS_FILE
        self.samples_path = self.log_dir / SAMPLES_FILE
        self.validation_path = self.log_dir / VALIDATION_FILE
        self.plot_path = self.log_dir / PLOT_FILE
        self.resume_step = resume_step
        self.overwrite = overwrite
        # step, reward_mean and tokens_per_s of every step in this run's history, for the
        # plot: packed (8 bytes a value), so a 100k-step run holds 2.4 MB, not 15.
        self._steps = array("q")
        self._rewards = array("d")
        self._throughputs = array("d")
        # Validation passes of this run's history by version (what validation.jsonl holds).
        self._validation: dict[int, dict[str, Any]] = {}
        # Passes reported before the first step: written with it (see the module docstring).
        self._held_validation: list[dict[str, Any]] = []
        self._last_step: int | None = None
        self._opened = False
        self._closed = False
        self._jsonl: TextIO | None = None
        self._writer: Any = None
        self._run_config = run_config
        self._trackers: list[MetricsSink] = []
        self.progress: ProgressDisplay | None = None
        if display:
            self.progress = ProgressDisplay(
                enabled=cfg.progress,
                total_steps=total_steps,
                initial_step=max((resume_step or 1) - 1, 0),
                console=console,
            )

    def _open(self) -> None:
        """Create or resume the files: at the first logged step, never before."""
        if self._opened:
            return
        self._opened = True
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.overwrite:
            for name in (SAMPLES_FILE, VALIDATION_FILE, PLOT_FILE):
                (self.log_dir / name).unlink(missing_ok=True)
            shutil.rmtree(self.log_dir / TENSORBOARD_DIR, ignore_errors=True)
        if self.cfg.jsonl:
            self._restore_jsonl(self.resume_step)
            self._restore_validation(self.resume_step)
            self._jsonl = self.metrics_path.open("a", encoding="utf-8")
        elif self.resume_step is not None:
            self._last_step = self.resume_step - 1
        if self.cfg.tensorboard:
            # Imported here: it is slow to import and runs without TensorBoard do not need it.
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(
                log_dir=str(self.log_dir / TENSORBOARD_DIR), purge_step=self.resume_step
            )
        # A resumed run continues its tracker runs; resume_step 0 (or --overwrite) starts new
        # ones.
        self._trackers = open_trackers(
            self.cfg, run_config=self._run_config, resume=bool(self.resume_step)
        )

    def _restore_jsonl(self, resume_step: int | None) -> None:
        if self.metrics_path.exists():
            records, dropped_torn, needs_rewrite = _read_metrics_lines(self.metrics_path)
            if dropped_torn:
                logger.warning("%s: dropped a torn last line (killed mid-write)", self.metrics_path)
            kept = records
            if resume_step is not None:
                kept = [record for record in records if record["step"] < resume_step]
            if needs_rewrite or len(kept) != len(records):
                _atomic_write_lines(self.metrics_path, kept)
            for record in kept:
                self._remember(record)
        if resume_step is not None:
            # Every kept line has step < resume_step; the resumed run logs resume_step next.
            self._last_step = resume_step - 1

    def _restore_validation(self, resume_step: int | None) -> None:
        if not self.validation_path.exists():
            return
        records, dropped_torn, needs_rewrite = _read_metrics_lines(
            self.validation_path, key="trainer_version"
        )
        if dropped_torn:
            logger.warning("%s: dropped a torn last line (killed mid-write)", self.validation_path)
        kept = records
        if resume_step is not None:
            kept = [r for r in records if r["trainer_version"] < resume_step]
        if needs_rewrite or len(kept) != len(records):
            _atomic_write_lines(self.validation_path, kept)
        for record in kept:
            self._validation[int(record["trainer_version"])] = record

    def _remember(self, record: Mapping[str, Any]) -> None:
        step = int(record["step"])
        self._steps.append(step)
        self._rewards.append(float(record.get("reward_mean", math.nan)))
        self._throughputs.append(float(record.get("tokens_per_s", math.nan)))
        self._last_step = step

    def log_step(self, metrics: Mapping[str, Any]) -> None:
        if self._closed:
            raise RuntimeError("MetricsLogger.log_step() after close()")
        missing = [name for name in REQUIRED_FIELDS if name not in metrics]
        if missing:
            raise ValueError(
                f"step metrics lack required fields {missing}; every step must report "
                f"{list(REQUIRED_FIELDS)}"
            )
        step = metrics["step"]
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"metrics 'step' must be an int, got {step!r}")
        self._open()
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"step {step} does not come after step {self._last_step} already in "
                f"{self.metrics_path}; on a restart pass resume_step (0 starts the file over)"
            )
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(dict(metrics), default=_to_json_value) + "\n")
            self._jsonl.flush()
        if self._writer is not None:
            for name, value in metrics.items():
                if (
                    name != "step"
                    and isinstance(value, int | float)
                    and not isinstance(value, bool)
                ):
                    self._writer.add_scalar(name, value, global_step=step)
            self._writer.flush()
        for tracker in self._trackers:
            tracker.log_step(step, metrics)
        self._remember(metrics)
        if self.progress is not None:
            self.progress.update(metrics)
        held, self._held_validation = self._held_validation, []
        for row in held:
            self.log_validation(row)

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        """A few completions of ``step`` with their rewards: ``samples.jsonl`` (one line each,
        with the step) and one TensorBoard text entry (``logger.tensorboard``)."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log_samples() after close()")
        if not samples:
            return
        self._open()
        with self.samples_path.open("a", encoding="utf-8") as handle:
            for sample in samples:
                handle.write(json.dumps({"step": step, **sample}, default=_to_json_value) + "\n")
        if self._writer is not None:
            table = "\n\n".join(
                f"**reward {float(sample.get('reward', math.nan)):.3f}** "
                f"`{sample.get('prompt', '')!s}` → `{sample.get('completion', '')!s}`"
                for sample in samples
            )
            self._writer.add_text("samples", table, global_step=step)
            self._writer.flush()

    def log_validation(self, metrics: Mapping[str, Any]) -> None:
        """One validation pass: ``validation.jsonl``, TensorBoard at its version, trackers."""
        if self._closed:
            raise RuntimeError("MetricsLogger.log_validation() after close()")
        version = metrics.get("trainer_version")
        if isinstance(version, bool) or not isinstance(version, int):
            raise TypeError(f"validation metrics need an int 'trainer_version', got {version!r}")
        row = dict(metrics)
        if not self._opened:
            self._held_validation.append(row)
            return
        self._open()
        replaces = version in self._validation
        self._validation[version] = row
        if self.cfg.jsonl:
            if replaces:  # the same version again (a pass redone after a kill): one line each
                _atomic_write_lines(
                    self.validation_path, [self._validation[v] for v in sorted(self._validation)]
                )
            else:
                with self.validation_path.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps(row, default=_to_json_value) + "\n")
        if self._writer is not None:
            for name, value in row.items():
                if (
                    name.startswith("val/")
                    and isinstance(value, int | float)
                    and not isinstance(value, bool)
                ):
                    self._writer.add_scalar(name, value, global_step=version)
            self._writer.flush()
        for tracker in self._trackers:
            tracker.log_validation(version, row)

    def close(self) -> None:
        """Close files and the display; write the plot (when on). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self.progress is not None:
            self.progress.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._writer is not None:
            self._writer.close()
        for tracker in self._trackers:
            tracker.close()
        if self.cfg.plot and self._steps:
            self.write_plot()

    def write_plot(self) -> Path:
        # Figure + Agg canvas directly: no pyplot global state, no GUI backend switch.
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure

        steps = self._steps
        figure = Figure(figsize=(8, 6), layout="constrained")
        FigureCanvasAgg(figure)
        reward_axes, throughput_axes = figure.subplots(2, 1, sharex=True)
        reward_axes.plot(steps, self._rewards, color="tab:blue", label="train")
        validated = [
            (version, float(row["val/reward_mean"]))
            for version, row in sorted(self._validation.items())
            if isinstance(row.get("val/reward_mean"), int | float)
        ]
        if validated:
            reward_axes.plot(
                [version for version, _ in validated],
                [value for _, value in validated],
                color="tab:green",
                marker="o",
                label="validation (val/reward_mean)",
            )
            reward_axes.legend(loc="best")
        reward_axes.set_ylabel("reward_mean")
        reward_axes.grid(alpha=0.3)
        throughput_axes.plot(steps, self._throughputs, color="tab:orange")
        throughput_axes.set_ylabel("tokens_per_s")
        throughput_axes.set_xlabel("step")
        throughput_axes.grid(alpha=0.3)
        figure.suptitle("reward and throughput per train step")
        figure.savefig(self.plot_path, dpi=100)
        return self.plot_path

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
