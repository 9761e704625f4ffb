"""Experiment trackers beside metrics.jsonl and TensorBoard: Weights & Biases and MLflow.

Each tracker is a ``MetricsSink``: ``log_step(step, metrics)`` receives exactly the rows
``MetricsLogger`` writes to metrics.jsonl and logs every numeric field at that step (the
same scalars TensorBoard gets); ``log_validation(version, metrics)`` gets each validation pass
(its ``val/`` fields at the version it evaluated: MLflow at that step; W&B, whose steps only
grow, against its own ``val/trainer_version`` axis); ``close()`` ends the run. ``open_trackers`` starts the ones
``logger.wandb.enabled`` / ``logger.mlflow.enabled`` ask for.

- W&B: ``wandb.init`` with ``dir=<log_dir>``; ``logger.wandb.mode: offline`` (or
  ``WANDB_MODE=offline``) writes the run under ``<log_dir>/wandb`` for ``wandb sync``.
  The API key comes from the environment or ``wandb login``, never from the config.
- MLflow: an ``MlflowClient`` on ``logger.mlflow.tracking_uri``, by default a local sqlite
  store ``<log_dir>/mlflow.db`` (artifacts under ``<log_dir>/mlartifacts``).

Both get the config with credentials redacted (``config/redact.py``) as the run's
config/params. The run id is kept in ``<log_dir>`` so that a resumed run (``resume_step``)
continues the same tracker run instead of starting another.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from tandemrl.config.models import LoggerConfig, MlflowConfig, WandbConfig
from tandemrl.config.redact import redact_url

log = logging.getLogger(__name__)

WANDB_RUN_ID_FILE = "wandb_run_id"
MLFLOW_RUN_ID_FILE = "mlflow_run_id"
MLFLOW_DEFAULT_DB = "mlflow.db"
VALIDATION_AXIS = "val/trainer_version"
# MLflow's limit on one param value; longer values are cut (a config list can be long).
_MLFLOW_PARAM_CHARS = 6000


class TrackerError(RuntimeError):
    """A tracker could not start; the message names the logger.* key involved."""


class MetricsSink(Protocol):
    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None: ...

    def log_validation(self, version: int, metrics: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def validation_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The ``val/`` numbers of a validation pass's row."""
    return {
        name: value for name, value in numeric_metrics(metrics).items() if name.startswith("val/")
    }


def numeric_metrics(metrics: Mapping[str, Any]) -> dict[str, float]:
    """The fields a tracker logs: numbers (bools and the step itself excluded)."""
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if name == "step" or isinstance(value, bool):
            continue
        if hasattr(value, "item") and not isinstance(value, int | float):
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[name] = float(value)
    return out


def open_trackers(
    cfg: LoggerConfig,
    *,
    run_config: Mapping[str, Any] | None = None,
    resume: bool = False,
) -> list[MetricsSink]:
    """The trackers ``cfg`` enables, started; a failure closes the ones already open."""
    log_dir = Path(cfg.log_dir)
    sinks: list[MetricsSink] = []
    try:
        if cfg.wandb.enabled:
            sinks.append(WandbSink(cfg.wandb, log_dir, run_config, resume=resume))
        if cfg.mlflow.enabled:
            sinks.append(MlflowSink(cfg.mlflow, log_dir, run_config, resume=resume))
    except BaseException:
        for sink in sinks:
            sink.close()
        raise
    return sinks


def _saved_run_id(log_dir: Path, name: str, resume: bool) -> str | None:
    path = log_dir / name
    if resume and path.is_file():
        return path.read_text(encoding="utf-8").strip() or None
    return None


class WandbSink:
    def __init__(
        self,
        cfg: WandbConfig,
        log_dir: Path,
        run_config: Mapping[str, Any] | None,
        *,
        resume: bool,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise TrackerError(
                "logger.wandb.enabled: the wandb package is not installed; install it with "
                "pip install 'tandemrl[trackers]'"
            ) from exc
        log_dir.mkdir(parents=True, exist_ok=True)
        run_id = _saved_run_id(log_dir, WANDB_RUN_ID_FILE, resume)
        settings = wandb.Settings(
            silent=True, console="off", disable_git=True, save_code=False, x_disable_stats=True
        )
        try:
            self.run = wandb.init(
                project=cfg.project,
                name=cfg.name,
                entity=cfg.entity,
                tags=list(cfg.tags) or None,
                mode=cfg.mode,
                dir=str(log_dir),
                config=dict(run_config or {}),
                id=run_id,
                resume="allow" if run_id else None,
                settings=settings,
            )
        except Exception as exc:
            raise TrackerError(
                f"logger.wandb: could not start a W&B run ({exc}); with no network, set "
                "logger.wandb.mode: offline (or WANDB_MODE=offline)"
            ) from exc
        (log_dir / WANDB_RUN_ID_FILE).write_text(self.run.id, encoding="utf-8")
        # A pass reports after later steps were logged: its own x axis, the version.
        self.run.define_metric(VALIDATION_AXIS)
        self.run.define_metric("val/*", step_metric=VALIDATION_AXIS)
        log.info("wandb: run %s (%s)", self.run.id, self.run.settings.mode)

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        self.run.log(numeric_metrics(metrics), step=step)

    def log_validation(self, version: int, metrics: Mapping[str, Any]) -> None:
        # commit=False: joins the current step's row, plotted against VALIDATION_AXIS.
        self.run.log({**validation_metrics(metrics), VALIDATION_AXIS: version}, commit=False)

    def close(self) -> None:
        self.run.finish()


class MlflowSink:
    def __init__(
        self,
        cfg: MlflowConfig,
        log_dir: Path,
        run_config: Mapping[str, Any] | None,
        *,
        resume: bool,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise TrackerError(
                "logger.mlflow.enabled: the mlflow package is not installed; install it with "
                "pip install 'tandemrl[trackers]'"
            ) from exc
        log_dir.mkdir(parents=True, exist_ok=True)
        local = cfg.tracking_uri is None
        uri = f"sqlite:///{(log_dir / MLFLOW_DEFAULT_DB).resolve()}" if local else cfg.tracking_uri
        shown = redact_url(str(uri))
        try:
            self.client = MlflowClient(tracking_uri=uri)
            experiment = self.client.get_experiment_by_name(cfg.experiment_name)
            if experiment is not None:
                experiment_id = experiment.experiment_id
            else:
                artifacts = (log_dir / "mlartifacts").resolve().as_uri() if local else None
                experiment_id = self.client.create_experiment(
                    cfg.experiment_name, artifact_location=artifacts
                )
            run_id = _saved_run_id(log_dir, MLFLOW_RUN_ID_FILE, resume)
            if run_id is None:
                run = self.client.create_run(experiment_id, run_name=cfg.run_name)
                run_id = run.info.run_id
                self._log_params(run_id, run_config or {})
            else:
                self.client.update_run(run_id, status="RUNNING")
        except Exception as exc:
            raise TrackerError(
                f"logger.mlflow: could not start an MLflow run at {shown} ({exc})"
            ) from exc
        self.run_id = run_id
        (log_dir / MLFLOW_RUN_ID_FILE).write_text(run_id, encoding="utf-8")
        log.info("mlflow: run %s in %s", run_id, shown)

    def _log_params(self, run_id: str, run_config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        params = [
            Param(key, str(value)[:_MLFLOW_PARAM_CHARS]) for key, value in _flatten(run_config)
        ]
        # MLflow takes at most 100 params per batch.
        for start in range(0, len(params), 100):
            self.client.log_batch(run_id, params=params[start : start + 100])

    def log_step(self, step: int, metrics: Mapping[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        values = [
            Metric(name, value, now, step) for name, value in numeric_metrics(metrics).items()
        ]
        if values:
            self.client.log_batch(self.run_id, metrics=values)

    def log_validation(self, version: int, metrics: Mapping[str, Any]) -> None:
        self.log_step(version, validation_metrics(metrics))

    def close(self) -> None:
        self.client.set_terminated(self.run_id)


def _flatten(node: Any, prefix: str = "") -> list[tuple[str, Any]]:
    if isinstance(node, Mapping):
        items: list[tuple[str, Any]] = []
        for key, value in node.items():
            items.extend(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return items
    return [(prefix, node)]
