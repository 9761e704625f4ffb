"""The vision-language exemplar learns through the real path on local Ray: the tiny Qwen2-VL
in a torch generation worker and a policy worker, images from builtin://shape-colour through
the processor, the data plane and weight sync. A model that ignores the image scores at most
0.25 (the prompt text is the same for every image): the run must climb past that."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandemrl.config.loader import load_config
from tandemrl.controller.run import run_training

pytestmark = pytest.mark.integration

STEPS = 50
BLIND_CEILING = 0.25  # always the same letter: one colour in four


def test_the_vlm_exemplar_learns_to_read_the_colour_from_the_image(ray_session, tmp_path: Path):
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu_vlm.yaml",
        (
            f"grpo.max_num_steps={STEPS}",
            # The exemplar's curve at a higher learning rate, so that a short run shows it
            # (docs/vlm.md: lr 3e-4 gets there in about twice the steps).
            "policy.optimizer.lr=1e-3",
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard=false",
            "logger.plot=false",
            "logger.progress=false",
        ),
    )
    assert run_training(cfg) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    first = sum(row["reward_mean"] for row in rows[:10]) / 10
    last = sum(row["reward_mean"] for row in rows[-10:]) / 10
    assert last >= first + 0.3 and last > BLIND_CEILING + 0.1, (first, last)
    assert (tmp_path / "final_model" / "preprocessor_config.json").is_file()
