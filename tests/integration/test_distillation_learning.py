"""The distillation exemplar learns with the real parts (torch generation engine, policy
worker, teacher worker, both pumps), in one process to keep it short: a fresh student's
reverse KL to its teacher falls and its counting reward rises within 60 steps. The same run
through Ray and ``tandemrl train`` (teacher actors included) is the distillation chaos test.

The exemplar's teacher is the default job's trained model (one ``tandemrl train`` command);
here it is built in the test instead, deterministically and in seconds: the same tiny preset,
fine-tuned on the counting answers with cross-entropy (seeded).
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.controller.actor import run_text_codec
from tandemrl.controller.build import ControllerParts, build_controller
from tandemrl.envs.counting import CountingEnv, continue_count
from tandemrl.generation import create_generation_backend
from tandemrl.models import load_causal_lm, load_tokenizer, resolve_model_path
from tandemrl.training.policy_worker import PolicyWorker
from tandemrl.training.teacher_worker import TeacherWorker

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


def test_the_student_moves_toward_its_teacher(tmp_path):
    teacher = counting_teacher(tmp_path / "teacher")
    cfg = load_config(
        EXEMPLAR,
        (
            f"on_policy_distillation.teachers.0.model_name={teacher}",
            "on_policy_distillation.max_num_steps=60",
            "logger.progress=false",
        ),
    )
    validate_single_controller_config(cfg)
    student = str(resolve_model_path(cfg.policy.model_name))

    async def run() -> list[dict[str, float]]:
        parts = ControllerParts(
            trainer=PolicyWorker(cfg.policy, cfg.loss_fn, model_path=student, seed=42),
            engines=[create_generation_backend(cfg.policy, student, seed=42)],
            env=CountingEnv(),
            codec=run_text_codec(cfg, student),
            teacher_engines=[[TeacherWorker(teacher, device="cpu")]],
        )
        return await build_controller(cfg, parts).run()

    rows = asyncio.run(run())
    assert [row["step"] for row in rows] == list(range(1, 61))

    def mean(key: str, part: list[dict[str, float]]) -> float:
        return sum(row[key] for row in part) / len(part)

    first, last = rows[:8], rows[-8:]
    kl_first, kl_last = mean("train/reverse_kl", first), mean("train/reverse_kl", last)
    reward_first, reward_last = mean("reward_mean", first), mean("reward_mean", last)
    # measured: KL 3.04 -> 1.47, reward 0.031 -> 0.208
    assert kl_last < 0.6 * kl_first, (kl_first, kl_last)
    assert reward_last > 3 * reward_first and reward_last > 0.12, (reward_first, reward_last)
    # scored in the rollout pump (the default); samples one version old were reweighted
    assert all(row["train/teacher_groups_scored_in_train_pump"] == 0 for row in rows)
    assert any(row["staleness_mean"] > 0 for row in rows)
