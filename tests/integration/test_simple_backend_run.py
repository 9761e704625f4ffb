"""A full tiny GRPO run on the TransferQueue (`simple`) data plane, then a restart from it."""

from __future__ import annotations

import json

import pytest

from tandemrl.checkpoint.journal import lineage, read_journal
from tandemrl.checkpoint.restore import plan_restore
from tandemrl.config.loader import load_config
from tandemrl.controller.run import run_training

pytestmark = pytest.mark.integration


def test_train_and_resume_on_the_simple_data_plane(ray_session, tmp_path):
    def cfg(steps: int):
        return load_config(
            "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
            (
                "data_plane.backend=simple",
                f"grpo.max_num_steps={steps}",
                f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
                f"logger.log_dir={tmp_path / 'logs'}",
                "logger.progress=false",
                "logger.tensorboard=false",
            ),
        )

    assert run_training(cfg(3)) == 0
    plan = plan_restore(cfg(6))
    assert plan.step == 3
    # the checkpoint holds committed, unconsumed groups written through TransferQueue
    index = plan.trainer_dir / "replay_index.pt"
    assert index.exists() and (plan.trainer_dir / "data_plane" / "manifest.json").exists()

    assert run_training(cfg(6)) == 0
    steps = [
        json.loads(line)["step"]
        for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert steps == [1, 2, 3, 4, 5, 6]
    result = lineage(read_journal(tmp_path / "ckpt" / "journal.jsonl"))
    trained = result.trained_groups()
    assert len(trained) == len(set(trained)) == 6 * 16
    assert result.restores[-1]["restored_committed"], "the restart restored no committed group"
    assert result.regenerated_after_restore == []
