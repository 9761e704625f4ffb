"""`tandemrl train` on Ray with models other than the default Qwen2: a Llama in raw text (the
command that crashed in the trainer's first logprob pass), and a Llama 3 chat preset on the
math data in chat format with packed micro-batches."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tandemrl.cli import main

pytestmark = pytest.mark.integration


def metrics(log_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize(
    "overrides",
    [
        pytest.param(("policy.model_name=tiny://llama-small",), id="llama-small-raw"),
        pytest.param(
            (
                "policy.model_name=tiny://llama3",
                "policy.sequence_packing=on",
                "policy.max_total_sequence_length=128",
                "data.dataset=builtin://math",
                "data.prompt_format=chat",
                "data.system_prompt=Give the number.",
                "env.name=math",
            ),
            id="llama3-chat-packed",
        ),
    ],
)
def test_a_llama_trains_end_to_end_through_tandemrl_train(
    ray_session, tmp_path: Path, overrides: tuple[str, ...]
) -> None:
    code = main(
        [
            "train",
            "--config",
            "examples/configs/grpo_tiny_cpu.yaml",
            *overrides,
            "grpo.max_num_steps=3",
            f"logger.log_dir={tmp_path}",
            "logger.tensorboard=false",
            "logger.progress=false",
        ]
    )
    assert code == 0
    rows = metrics(tmp_path)
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0, row
        assert row["groups_trained"] == 16
