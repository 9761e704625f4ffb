"""Restart with fakes: interrupt a run at arbitrary moments, resume from disk, prove exactly-once."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import pytest

from tandemrl.checkpoint.journal import lineage, read_journal
from tandemrl.checkpoint.layout import JOURNAL, list_step_dirs
from tandemrl.checkpoint.restore import plan_restore
from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.training.fake import FakeTrainer

NUM_PROMPTS = 40
EPOCHS = 2


def make_cfg(checkpoint_dir: Path, *overrides: str):
    return load_config(
        "examples/configs/grpo_tiny_cpu_checkpointed.yaml",
        (
            "grpo.num_prompts_per_step=4",
            "grpo.num_generations_per_prompt=2",
            "policy.train_global_batch_size=8",
            "policy.train_micro_batch_size=8",
            "grpo.max_num_steps=1000",
            f"grpo.max_num_epochs={EPOCHS}",
            "async_rl.min_groups_for_streaming_train=2",
            "async_rl.max_buffered_rollouts=8",
            "async_rl.max_inflight_prompts=8",
            f"checkpointing.checkpoint_dir={checkpoint_dir}",
            "checkpointing.save_period=1",
            "rollout_checkpointing.snapshot_attempt_interval_s=0.01",
            "logger.progress=false",
            *overrides,
        ),
    )


def make_loader() -> PromptDataLoader:
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(NUM_PROMPTS)]
    return PromptDataLoader(records, max_num_epochs=EPOCHS, seed=3)


async def one_attempt(cfg, *, stop_after_s: float | None, seed: int) -> bool:
    """Run until done or interrupted after ``stop_after_s``; return True when it finished."""
    engine = FakeGenerationBackend(latency=LatencyModel("uniform", low=0.0, high=0.004), seed=seed)
    controller = build_fake_controller(
        cfg,
        trainer=FakeTrainer(train_seconds_per_step=0.002),
        engines=[engine],
        dataloader=make_loader(),
    )
    await controller.resume(plan_restore(cfg))
    try:
        await asyncio.wait_for(controller.run(), timeout=stop_after_s)
    except TimeoutError:
        return False
    finally:
        controller.journal.close()
    return True


def run_with_interruptions(cfg, stops: list[float]) -> None:
    for index, stop in enumerate(stops):
        asyncio.run(one_attempt(cfg, stop_after_s=stop, seed=index))
    assert asyncio.run(one_attempt(cfg, stop_after_s=30, seed=len(stops)))


def all_prompt_ids() -> set[str]:
    return {f"e{epoch}-i{index}" for epoch in range(EPOCHS) for index in range(NUM_PROMPTS)}


@pytest.mark.parametrize("granularity", ["sibling", "prompt_group"])
def test_interrupted_runs_train_every_prompt_exactly_once(tmp_path, granularity):
    cfg = make_cfg(tmp_path / "ckpt", f"rollout_recovery.default_granularity={granularity}")
    rng = random.Random(7)
    run_with_interruptions(cfg, [rng.uniform(0.05, 0.25) for _ in range(4)])

    result = lineage(read_journal(tmp_path / "ckpt" / JOURNAL))
    trained = result.trained_groups()
    assert len(trained) == len(set(trained)), "a group was trained twice"
    assert set(trained) == all_prompt_ids(), "a prompt was lost"
    assert sorted(result.trained) == list(range(1, len(result.trained) + 1)), (
        "step numbering has a gap"
    )
    assert result.attempts == 5
    # work restored from disk (committed groups, staged siblings) is never generated again
    assert result.regenerated_after_restore == []


def test_resume_continues_step_numbering_and_weights_version(tmp_path):
    first = make_cfg(tmp_path / "ckpt", "grpo.max_num_steps=3")
    assert asyncio.run(one_attempt(first, stop_after_s=30, seed=0))
    steps = list_step_dirs(tmp_path / "ckpt")
    assert [step for step, _ in steps][-1] == 3
    plan = plan_restore(first)
    assert plan.trainer_dir == steps[-1][1] and plan.step == 3

    async def resumed_run():
        controller = build_fake_controller(
            make_cfg(tmp_path / "ckpt", "grpo.max_num_steps=5"),
            trainer=FakeTrainer(),
            engines=[FakeGenerationBackend(seed=1)],
            dataloader=make_loader(),
        )
        await controller.resume(plan)
        assert controller.state.step == 3 and controller.trainer_version == 3
        history = await controller.run()
        controller.journal.close()
        return history, controller

    history, controller = asyncio.run(resumed_run())
    assert [row["step"] for row in history] == [4, 5]
    assert controller.trainer.optimizer_steps == 5  # the fake trainer's own state was restored
