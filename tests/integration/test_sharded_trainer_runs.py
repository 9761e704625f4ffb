"""The sharded trainer on Ray: a PPO run whose policy and critic have 2 ranks each (its
checkpoint restores in one process); and a rank killed mid-step, which ends the step at once
with an error naming the rank. The restart of a sharded run after a SIGKILL is
tests/chaos/test_multinode_cluster.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
import ray
import torch
from transformers import AutoModelForCausalLM

from tandemrl.checkpoint.restore import plan_restore
from tandemrl.config.loader import load_config
from tandemrl.controller.run import run_training
from tandemrl.controller.setup import launch_trainer_group, plan_placement
from tandemrl.dataplane.rows import make_training_row
from tandemrl.models import resolve_model_path
from tandemrl.training.batch import collate_rows
from tandemrl.training.trainer_group import TrainerRankError
from tandemrl.training.value_worker import ValueWorker
from tandemrl.training.worker_common import read_worker_state

pytestmark = pytest.mark.integration


def ppo_cfg(tmp_path, steps: int):
    return load_config(
        "examples/configs/ppo_tiny_cpu.yaml",
        (
            "policy.dtensor_cfg.data_parallel_size=2",
            "ppo.num_prompts_per_step=4",
            "policy.train_global_batch_size=32",
            "value.train_global_batch_size=32",
            "policy.train_micro_batch_size=8",
            "value.train_micro_batch_size=8",
            "ppo.ppo_epochs=2",
            "async_rl.max_buffered_rollouts=8",
            "async_rl.max_inflight_prompts=8",
            f"ppo.max_num_steps={steps}",
            "checkpointing.enabled=true",
            "checkpointing.save_period=1",
            "checkpointing.save_data_plane=true",
            f"checkpointing.checkpoint_dir={tmp_path / 'ckpt'}",
            f"logger.log_dir={tmp_path / 'logs'}",
            "logger.progress=false",
            "logger.tensorboard=false",
            "logger.plot=false",
        ),
    )


def test_a_ppo_run_with_two_rank_policy_and_critic_trains_and_checkpoints(ray_session, tmp_path):
    cfg = ppo_cfg(tmp_path, 1)
    assert run_training(cfg) == 0
    rows = [
        json.loads(line) for line in (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [row["step"] for row in rows] == [1]
    assert all("train/critic_value_loss" in row and "weight_sync_s" in row for row in rows)
    assert [row["train/optimizer_steps"] for row in rows] == [2.0]  # ppo_epochs per step
    plan = plan_restore(cfg)
    assert plan.step == 1
    for folder, kind in (("policy", "policy"), ("value", "value")):
        state = read_worker_state(plan.trainer_dir / folder)
        assert (state["kind"], state["layout"], state["data_parallel_size"]) == (kind, "dcp", 2)
        shards = sorted(path.name for path in (plan.trainer_dir / folder / "dcp").iterdir())
        assert shards == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    # the 2-rank critic's checkpoint restores in one process (the restart path at size 1)
    critic = ValueWorker(
        cfg.value,
        cfg.value_loss_fn,
        model_path=resolve_model_path(cfg.policy.model_name),
        device="cpu",
    )
    asyncio.run(critic.load_checkpoint(plan.trainer_dir / "value", load_optimizer=True))
    assert critic.optimizer_steps == 2
    final = tmp_path / "logs" / "final_model"
    model = AutoModelForCausalLM.from_pretrained(final)  # a transformers folder
    assert sum(p.numel() for p in model.parameters()) > 0


def grpo_group_cfg():
    return load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        ("policy.dtensor_cfg.data_parallel_size=2", "policy.train_micro_batch_size=4"),
    )


def long_batch(rows: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    built = []
    for _ in range(rows):
        completion = torch.randint(3, 12, (40,), generator=gen)
        row = make_training_row(
            torch.randint(3, 12, (20,), generator=gen),
            completion,
            -torch.ones(40),
            reward=1.0,
            sample_mask=1.0,
        )
        row["advantages"] = torch.tensor(1.0)
        built.append(row)
    batch = collate_rows(built, pad_token_id=0)
    batch["prev_logprobs"] = torch.zeros_like(batch["token_mask"])
    return batch


def test_a_rank_killed_mid_step_fails_the_step_at_once_naming_the_rank(ray_session):
    cfg = grpo_group_cfg()
    placement = plan_placement(cfg, cluster_cpus=8, cluster_gpus=0)
    model_path = str(resolve_model_path(cfg.policy.model_name))
    trainer, _, group = launch_trainer_group(cfg, placement, model_path, uses_gpu=False)
    try:
        pid = ray.get(trainer.ranks[1].ping.remote())

        async def step_with_a_kill() -> float:
            await trainer.begin_train_step()
            # 256 rows of 60 tokens a rank, 64 micro-batches: far more than a second of work
            # on any CPU, so the kill lands inside the step (64 rows were done within the
            # second on CI's machine); the step ends at the death, not after the work.
            train = asyncio.ensure_future(
                trainer.train_microbatches(long_batch(512), step_num_sequences=512)
            )
            await asyncio.sleep(1.0)
            assert not train.done()
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            with pytest.raises(TrainerRankError) as failure:
                await asyncio.wait_for(train, timeout=60)
            message = str(failure.value)
            assert "policy trainer rank 1 of 2 died" in message, message
            assert "train_microbatches" in message, message
            return time.monotonic() - killed

        seconds = asyncio.run(step_with_a_kill())
        assert seconds < 15, seconds  # the step ended, it did not wait out a timeout (600 s)
        print("RESULT", json.dumps({"rank_death_detected_s": round(seconds, 2)}))
    finally:
        for handle in trainer.ranks:
            ray.kill(handle, no_restart=True)
        ray.util.remove_placement_group(group)
