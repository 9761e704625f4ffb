"""Run metrics: per-step JSONL and TensorBoard logging, the end-of-run plot, progress display."""

from tandemrl.metrics.logger import METRICS_FILE, PLOT_FILE, REQUIRED_FIELDS, MetricsLogger
from tandemrl.metrics.progress import ProgressDisplay, format_step_summary

__all__ = [
    "METRICS_FILE",
    "PLOT_FILE",
    "REQUIRED_FIELDS",
    "MetricsLogger",
    "ProgressDisplay",
    "format_step_summary",
]
