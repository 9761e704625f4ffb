"""Metrics: JSONL lines, required fields, TensorBoard events, the plot, resume, progress."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from rich.console import Console

from tandemrl.config.models import LoggerConfig
from tandemrl.metrics import REQUIRED_FIELDS, MetricsLogger, ProgressDisplay
from tandemrl.metrics.logger import previous_run_files

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def step_metrics(step: int, **extra: Any) -> dict[str, Any]:
    return {
        "step": step,
        "trainer_version": step + 1,
        "reward_mean": 0.1 * step,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "groups_trained": 16,
        "tokens_per_s": 1000.0 + step,
        "step_time_s": 0.25,
        "weight_sync_s": 0.01,
        **extra,
    }


def config(log_dir: Path, **overrides: Any) -> LoggerConfig:
    fields = {"log_dir": str(log_dir), "tensorboard": False, "plot": False, "progress": False}
    fields.update(overrides)
    return LoggerConfig(**fields)


def read_lines(log_dir: Path) -> list[dict[str, Any]]:
    text = (log_dir / "metrics.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines()]


def log_steps(log_dir: Path, steps: range, **cfg_overrides: Any) -> None:
    with MetricsLogger(config(log_dir, **cfg_overrides)) as metrics_logger:
        for step in steps:
            metrics_logger.log_step(step_metrics(step))


def test_one_json_line_per_step_flushed_immediately(tmp_path: Path) -> None:
    metrics_logger = MetricsLogger(config(tmp_path))
    metrics_logger.log_step(step_metrics(0, grad_norm=np.float32(0.5), note="warmup"))
    # Readable before close: each line is flushed as it is written.
    assert read_lines(tmp_path) == [step_metrics(0, grad_norm=0.5, note="warmup")]
    metrics_logger.log_step(step_metrics(1))
    metrics_logger.close()
    assert [line["step"] for line in read_lines(tmp_path)] == [0, 1]
    assert set(REQUIRED_FIELDS) <= set(read_lines(tmp_path)[1])


@pytest.mark.parametrize("missing", REQUIRED_FIELDS)
def test_missing_required_field_raises_and_writes_nothing(tmp_path: Path, missing: str) -> None:
    metrics = step_metrics(0)
    del metrics[missing]
    with (
        MetricsLogger(config(tmp_path)) as metrics_logger,
        pytest.raises(ValueError, match=f"'{missing}'"),
    ):
        metrics_logger.log_step(metrics)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_steps_must_increase(tmp_path: Path) -> None:
    with MetricsLogger(config(tmp_path)) as metrics_logger:
        metrics_logger.log_step(step_metrics(3))
        with pytest.raises(ValueError, match="does not come after step 3"):
            metrics_logger.log_step(step_metrics(3))
        with pytest.raises(TypeError, match="must be an int"):
            metrics_logger.log_step(step_metrics(4) | {"step": 4.0})


def test_unserialisable_value_is_an_error(tmp_path: Path) -> None:
    with (
        MetricsLogger(config(tmp_path)) as metrics_logger,
        pytest.raises(TypeError, match="not JSON"),
    ):
        metrics_logger.log_step(step_metrics(0, bad=object()))


def test_jsonl_off_writes_no_file(tmp_path: Path) -> None:
    log_steps(tmp_path, range(2), jsonl=False)
    assert not (tmp_path / "metrics.jsonl").exists()


def test_tensorboard_scalars_written(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log_steps(tmp_path, range(3), tensorboard=True)
    event_files = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(event_files) == 1
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    rewards = accumulator.Scalars("reward_mean")
    assert [event.step for event in rewards] == [0, 1, 2]
    assert [event.value for event in rewards] == pytest.approx([0.0, 0.1, 0.2])
    assert "tokens_per_s" in accumulator.Tags()["scalars"]
    assert "step" not in accumulator.Tags()["scalars"]


def test_plot_written_on_close_only_when_on(tmp_path: Path) -> None:
    log_steps(tmp_path / "on", range(4), plot=True)
    assert (tmp_path / "on" / "reward_throughput.png").read_bytes()[:8] == PNG_MAGIC
    log_steps(tmp_path / "off", range(4), plot=False)
    assert not (tmp_path / "off" / "reward_throughput.png").exists()
    log_steps(tmp_path / "empty", range(0), plot=True)
    assert not (tmp_path / "empty" / "reward_throughput.png").exists()


# -- restarts ---------------------------------------------------------------------------------


def test_resume_keeps_only_steps_before_the_resume_step(tmp_path: Path) -> None:
    log_steps(tmp_path, range(5))
    with MetricsLogger(config(tmp_path, plot=True), resume_step=3) as metrics_logger:
        # Untouched until the resumed run logs its first step.
        assert [line["step"] for line in read_lines(tmp_path)] == [0, 1, 2, 3, 4]
        with pytest.raises(ValueError, match="does not come after step 2"):
            metrics_logger.log_step(step_metrics(2))
        metrics_logger.log_step(step_metrics(3, reward_mean=0.9))
    lines = read_lines(tmp_path)
    assert [line["step"] for line in lines] == [0, 1, 2, 3]
    assert lines[3]["reward_mean"] == 0.9
    assert not list(tmp_path.glob(".metrics.jsonl.*"))  # no temporary file left behind
    assert (tmp_path / "reward_throughput.png").exists()


def test_restart_without_resume_step_appends_and_refuses_old_steps(tmp_path: Path) -> None:
    log_steps(tmp_path, range(2))
    with MetricsLogger(config(tmp_path)) as metrics_logger:
        with pytest.raises(ValueError, match="resume_step"):
            metrics_logger.log_step(step_metrics(0))
        metrics_logger.log_step(step_metrics(2))
    assert [line["step"] for line in read_lines(tmp_path)] == [0, 1, 2]


def test_resume_step_zero_starts_the_file_over(tmp_path: Path) -> None:
    log_steps(tmp_path, range(3))
    with MetricsLogger(config(tmp_path), resume_step=0) as metrics_logger:
        assert len(read_lines(tmp_path)) == 3  # nothing changes before the first step
        metrics_logger.log_step(step_metrics(0))
        assert [line["step"] for line in read_lines(tmp_path)] == [0]
    assert [line["step"] for line in read_lines(tmp_path)] == [0]


def test_a_run_that_logs_no_step_leaves_the_previous_runs_files_as_they_were(
    tmp_path: Path,
) -> None:
    """A run failing during setup (before its first step) must not wipe the last run's files."""
    log_steps(tmp_path, range(3), tensorboard=True, plot=True)
    before = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    assert tmp_path / "metrics.jsonl" in before and tmp_path / "reward_throughput.png" in before
    for overwrite in (False, True):
        failed = MetricsLogger(
            config(tmp_path, tensorboard=True, plot=True), resume_step=0, overwrite=overwrite
        )
        failed.close()
    after = {path: path.read_bytes() for path in tmp_path.rglob("*") if path.is_file()}
    assert after == before


def test_overwrite_replaces_the_previous_runs_files_at_the_first_step(tmp_path: Path) -> None:
    log_steps(tmp_path, range(3), tensorboard=True, plot=True)
    old_events = list((tmp_path / "tensorboard").iterdir())
    assert previous_run_files(tmp_path)
    with MetricsLogger(
        config(tmp_path, tensorboard=True), resume_step=0, overwrite=True
    ) as metrics_logger:
        metrics_logger.log_step(step_metrics(1))
    assert [line["step"] for line in read_lines(tmp_path)] == [1]
    assert not any(path.exists() for path in old_events)
    assert not (tmp_path / "reward_throughput.png").exists()  # this run's plot is off


def test_samples_go_to_jsonl_with_their_step(tmp_path: Path) -> None:
    with MetricsLogger(config(tmp_path, tensorboard=True)) as metrics_logger:
        metrics_logger.log_samples(4, [{"prompt": "12=", "completion": "345", "reward": 1.0}])
    (line,) = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert json.loads(line) == {"step": 4, "prompt": "12=", "completion": "345", "reward": 1.0}
    assert list((tmp_path / "tensorboard").iterdir())


def test_torn_last_line_is_dropped_before_appending(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    log_steps(tmp_path, range(2))
    with (tmp_path / "metrics.jsonl").open("a") as handle:
        handle.write('{"step": 2, "rew')  # killed mid-write
    with caplog.at_level(logging.WARNING), MetricsLogger(config(tmp_path)) as metrics_logger:
        metrics_logger.log_step(step_metrics(2))
    assert "torn last line" in caplog.text
    assert [line["step"] for line in read_lines(tmp_path)] == [0, 1, 2]


def test_complete_last_line_without_newline_is_kept(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(json.dumps(step_metrics(0)))
    log_steps(tmp_path, range(1, 2))
    assert [line["step"] for line in read_lines(tmp_path)] == [0, 1]


def test_corrupt_line_in_the_middle_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "metrics.jsonl").write_text(
        json.dumps(step_metrics(0)) + "\ngarbage\n" + json.dumps(step_metrics(1)) + "\n"
    )
    metrics_logger = MetricsLogger(config(tmp_path), resume_step=1)
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):
        metrics_logger.log_step(step_metrics(1))


# -- progress ---------------------------------------------------------------------------------


def test_progress_off_logs_one_plain_line_per_step(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with (
        caplog.at_level(logging.INFO, logger="tandemrl.metrics"),
        MetricsLogger(config(tmp_path), total_steps=10) as metrics_logger,
    ):
        metrics_logger.log_step(step_metrics(5))
    assert not metrics_logger.progress.uses_rich
    assert "step 5/10 | reward 0.500 | staleness 0.50/1 | 1005 tok/s" in caplog.messages


def test_progress_on_a_terminal_uses_rich(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    output = io.StringIO()
    console = Console(file=output, force_terminal=True, width=120)
    with (
        caplog.at_level(logging.INFO, logger="tandemrl.metrics"),
        MetricsLogger(
            config(tmp_path, progress=True), total_steps=10, console=console
        ) as metrics_logger,
    ):
        metrics_logger.log_step(step_metrics(5))
    assert metrics_logger.progress.uses_rich
    assert "reward 0.500" in output.getvalue()
    assert "5/10" in output.getvalue()  # step 5 of 10 done (steps count from 1)
    assert not caplog.messages


def test_progress_on_but_not_a_terminal_falls_back_to_log_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    console = Console(file=io.StringIO(), force_terminal=False)
    display = ProgressDisplay(enabled=True, total_steps=None, console=console)
    with caplog.at_level(logging.INFO, logger="tandemrl.metrics"):
        display.update(step_metrics(1))
    display.close()
    assert not display.uses_rich
    assert caplog.messages == ["step 1 | reward 0.100 | staleness 0.50/1 | 1001 tok/s"]


def test_validation_passes_go_to_jsonl_tensorboard_and_the_plot_once_per_version(
    tmp_path: Path,
) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def val(version: int, reward: float) -> dict:
        return {
            "trainer_version": version,
            "reported_at_step": version + 1,
            "val/reward_mean": reward,
        }

    with MetricsLogger(config(tmp_path, tensorboard=True, plot=True)) as metrics_logger:
        metrics_logger.log_validation(val(0, 0.1))  # before any step: at_start
        for step in range(1, 5):
            metrics_logger.log_step(step_metrics(step))
            if step % 2 == 0:
                metrics_logger.log_validation(val(step, 0.1 * step))
        metrics_logger.log_validation(val(4, 0.45))  # version 4 again: replaces its line
        plotted = list(metrics_logger._validation.items())
    lines = [json.loads(line) for line in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert [(r["trainer_version"], r["val/reward_mean"]) for r in lines] == [
        (0, 0.1),
        (2, 0.2),
        (4, 0.45),
    ]
    assert [version for version, _ in plotted] == [0, 2, 4]
    assert (tmp_path / "reward_throughput.png").stat().st_size > 0
    accumulator = EventAccumulator(str(tmp_path / "tensorboard"))
    accumulator.Reload()
    assert {e.step for e in accumulator.Scalars("val/reward_mean")} == {0, 2, 4}
    assert "reported_at_step" not in accumulator.Tags()["scalars"]

    # A restart after step 2 keeps the passes of versions up to 2 (later ones run again).
    with MetricsLogger(config(tmp_path), resume_step=3) as metrics_logger:
        metrics_logger.log_step(step_metrics(3))
    lines = [json.loads(line) for line in (tmp_path / "validation.jsonl").read_text().splitlines()]
    assert [r["trainer_version"] for r in lines] == [0, 2]
