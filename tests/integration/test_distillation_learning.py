"""The distillation exemplar learns on the real path (Ray, tiny CPU models): a fresh student's
reverse KL to its teacher falls and its counting reward rises.

The exemplar's teacher is the default job's trained model (one ``tandemrl train`` command);
here it is built in the test instead, deterministically and in seconds: the same tiny preset,
fine-tuned on the counting answers with cross-entropy (seeded).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.controller.run import run_training
from tandemrl.envs.counting import continue_count
from tandemrl.models import load_causal_lm, load_tokenizer, resolve_model_path

pytestmark = pytest.mark.integration

EXEMPLAR = "examples/configs/distill_tiny_cpu.yaml"
TEACHER_STEPS = 40  # about 85% of its sampled answers are exact at temperature 1


def counting_teacher(folder: Path, steps: int = TEACHER_STEPS) -> Path:
    """The student's preset fine-tuned on "583=" -> "456<eos>" (64 prompts a step)."""
    source = resolve_model_path("tiny://qwen2-counting")
    tokenizer = load_tokenizer(source)
    rng = random.Random(0)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = load_causal_lm(source, dtype=torch.float32, device="cpu").train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
        for _ in range(steps):
            rows = []
            for _ in range(64):
                prompt = "".join(str(rng.randrange(10)) for _ in range(3)) + "="
                answer = continue_count(int(prompt[2]))
                rows.append(tokenizer.encode(prompt + answer, add_special_tokens=False))
            input_ids = torch.tensor([[*row, tokenizer.eos_token_id] for row in rows])
            labels = input_ids.clone()
            labels[:, :4] = -100  # the loss on the answer and its end only
            loss = model(input_ids=input_ids, labels=labels).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_the_student_moves_toward_its_teacher(ray_session, tmp_path):
    teacher = counting_teacher(tmp_path / "teacher")
    log_dir = tmp_path / "logs"
    cfg = load_config(
        EXEMPLAR,
        (
            f"on_policy_distillation.teachers.0.model_name={teacher}",
            "on_policy_distillation.max_num_steps=40",
            f"logger.log_dir={log_dir}",
            "logger.progress=false",
            "logger.tensorboard=false",
            "logger.plot=false",
            "logger.save_final_model=false",
        ),
    )
    assert run_training(cfg) == 0
    rows = [json.loads(line) for line in (log_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == list(range(1, 41))

    def mean(key: str, part: list[dict]) -> float:
        return sum(row[key] for row in part) / len(part)

    first, last = rows[:8], rows[-8:]
    kl_first, kl_last = mean("train/reverse_kl", first), mean("train/reverse_kl", last)
    reward_first, reward_last = mean("reward_mean", first), mean("reward_mean", last)
    assert kl_last < 0.5 * kl_first, (kl_first, kl_last)
    assert reward_last > 2 * reward_first and reward_last > 0.15, (reward_first, reward_last)
    # scored in the rollout pump (the default), with the one-version-old samples reweighted
    assert all(row["train/teacher_groups_scored_in_train_pump"] == 0 for row in rows)
    assert any(row["staleness_mean"] > 0 for row in rows)
