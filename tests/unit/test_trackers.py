"""logger.wandb (offline) and logger.mlflow (local store): the per-step metrics of metrics.jsonl,
written to the trackers' own files, with no credential on disk."""

from __future__ import annotations

import glob
import json
import struct
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from mlflow.tracking import MlflowClient
from wandb.proto import wandb_internal_pb2

from tandemrl.checkpoint.fingerprint import compatibility_identity
from tandemrl.config.models import LoggerConfig, MasterConfig
from tandemrl.config.redact import REDACTED, redact_tree, redact_url
from tandemrl.metrics import MetricsLogger
from tandemrl.metrics.trackers import MLFLOW_DEFAULT_DB, MLFLOW_RUN_ID_FILE, WANDB_RUN_ID_FILE

SECRETS = ("sekrit-wandb-key-123", "sekrit-env-token-456", "sekrit-url-pass-789")


def step_metrics(step: int) -> dict[str, Any]:
    return {
        "step": step,
        "trainer_version": step + 1,
        "reward_mean": 0.25 * step,
        "staleness_mean": 0.5,
        "staleness_max": 1,
        "groups_trained": 16,
        "tokens_per_s": np.float32(1000.0 + step),
        "step_time_s": 0.25,
        "weight_sync_s": 0.01,
        "note": "text is not a metric",
    }


def logger_config(log_dir: Path) -> LoggerConfig:
    return LoggerConfig.model_validate(
        {
            "log_dir": str(log_dir),
            "tensorboard": False,
            "plot": False,
            "progress": False,
            "wandb": {"enabled": True, "project": "tandemrl-test", "name": "t", "mode": "offline"},
            "mlflow": {"enabled": True, "experiment_name": "tandemrl-test", "run_name": "t"},
        }
    )


def run_config() -> dict[str, Any]:
    cfg = MasterConfig.model_validate(
        {
            "grpo": {},
            "env": {
                "name": "custom",
                "target": "pkg.mod:Env",
                "kwargs": {
                    "api_token": SECRETS[1],
                    "judge_url": f"https://judge:{SECRETS[2]}@judge.example/v1",
                },
            },
        }
    )
    return redact_tree(cfg.model_dump(mode="json", by_alias=True))


def wandb_history(log_dir: Path) -> list[dict[str, float]]:
    """History rows of the offline run file (LevelDB-log records of W&B protobufs)."""
    (path,) = glob.glob(str(log_dir / "wandb" / "offline-run-*" / "run-*.wandb"))
    data = Path(path).read_bytes()
    block, position, records, pending = 32768, 7, [], b""
    while position + 7 <= len(data):
        left = block - position % block
        if left < 7:
            position += left
            continue
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if kind == 0 and length == 0:
            position += left
            continue
        chunk = data[position + 7 : position + 7 + length]
        position += 7 + length
        if kind == 1:
            records.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            records.append(pending + chunk)
            pending = b""
    rows = []
    for raw in records:
        record = wandb_internal_pb2.Record()
        record.ParseFromString(raw)
        if record.WhichOneof("record_type") == "history":
            items = {
                item.key or "/".join(item.nested_key): json.loads(item.value_json)
                for item in record.history.item
            }
            rows.append({k: v for k, v in items.items() if not k.startswith("_") or k == "_step"})
    return rows


def expected_rows(log_dir: Path) -> list[dict[str, float]]:
    """What metrics.jsonl holds, as the numeric fields a tracker logs."""
    rows = []
    for line in (log_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        rows.append(
            {
                key: float(value)
                for key, value in record.items()
                if key != "step" and isinstance(value, int | float) and not isinstance(value, bool)
            }
            | {"_step": record["step"]}
        )
    return rows


def test_trackers_log_every_jsonl_metric_at_its_step_and_no_credential(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", SECRETS[0])
    log_dir = tmp_path / "run"
    with MetricsLogger(logger_config(log_dir), run_config=run_config()) as metrics:
        for step in range(3):
            metrics.log_step(step_metrics(step))
            if step == 1:  # a validation pass of version 0, reported after step 1
                metrics.log_validation(
                    {"trainer_version": 0, "reported_at_step": 1, "val/reward_mean": 0.5}
                )
    expected = expected_rows(log_dir)
    assert len(expected) == 3 and "note" not in expected[0]

    # W&B steps only grow: the pass joins step 1's row, on its own val/trainer_version axis.
    history = wandb_history(log_dir)
    validation = {"val/reward_mean": 0.5, "val/trainer_version": 0}
    assert history == [row | validation if row["_step"] == 1 else row for row in expected]

    client = MlflowClient(tracking_uri=f"sqlite:///{log_dir / MLFLOW_DEFAULT_DB}")
    run_id = (log_dir / MLFLOW_RUN_ID_FILE).read_text()
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in expected[0]:
        if key == "_step":
            continue
        history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))
        assert history == [(row["_step"], pytest.approx(row[key])) for row in expected], key
    # MLflow takes any step: the pass is at the version it evaluated.
    validated = client.get_metric_history(run_id, "val/reward_mean")
    assert [(m.step, m.value) for m in validated] == [(0, 0.5)]
    assert client.get_metric_history(run_id, "reported_at_step") == []
    # The config is recorded, with its credentials redacted.
    assert run.data.params["env.kwargs.api_token"] == REDACTED
    assert SECRETS[2] not in run.data.params["env.kwargs.judge_url"]
    assert run.data.params["grpo.num_prompts_per_step"] == "16"

    for path in tmp_path.rglob("*"):
        if path.is_file():
            content = path.read_bytes()
            for secret in SECRETS:
                assert secret.encode() not in content, (secret, path)


def test_a_resumed_run_continues_the_same_tracker_runs(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    log_dir = tmp_path / "run"
    with MetricsLogger(logger_config(log_dir)) as metrics:
        metrics.log_step(step_metrics(0))
        metrics.log_step(step_metrics(1))
    wandb_id = (log_dir / WANDB_RUN_ID_FILE).read_text()
    mlflow_id = (log_dir / MLFLOW_RUN_ID_FILE).read_text()
    with MetricsLogger(logger_config(log_dir), resume_step=2) as metrics:
        metrics.log_step(step_metrics(2))
    assert (log_dir / WANDB_RUN_ID_FILE).read_text() == wandb_id
    assert (log_dir / MLFLOW_RUN_ID_FILE).read_text() == mlflow_id
    client = MlflowClient(tracking_uri=f"sqlite:///{log_dir / MLFLOW_DEFAULT_DB}")
    steps = sorted(m.step for m in client.get_metric_history(mlflow_id, "reward_mean"))
    assert steps == [0, 1, 2]


def test_the_fingerprint_redacts_passwords_inside_urls():
    cfg = MasterConfig.model_validate(
        {"grpo": {}, "env": {"kwargs": {"judge_url": "https://u:pw-123@host/v1", "n": 2}}}
    )
    identity = compatibility_identity(cfg)
    assert identity["env.kwargs.judge_url"] == f"https://u:{REDACTED}@host/v1"
    assert identity["env.kwargs.n"] == 2
    assert redact_url("sqlite:///tmp/x.db") == "sqlite:///tmp/x.db"
    assert redact_url("https://tok@host/") == f"https://{REDACTED}@host/"
