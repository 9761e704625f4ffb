"""Policy and value workers as Ray actors on a tiny Qwen2: a chunked step, weights, checkpoints."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandemrl.config.models import LossConfig, PolicyConfig, ValueConfig, ValueLossConfig
from tandemrl.dataplane.rows import make_training_row
from tandemrl.training.batch import collate_rows, count_loss_tokens
from tandemrl.training.policy_worker import create_policy_worker_actor
from tandemrl.training.value_worker import create_value_worker_actor

pytestmark = pytest.mark.integration

VOCAB = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2-ray")
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
        pad_token_id=0,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(2)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def make_batch() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(11)
    rows = []
    for i in range(8):
        prompt = torch.randint(3, VOCAB, (3,), generator=gen)
        completion = torch.randint(3, VOCAB, (2 + i % 3,), generator=gen)
        row = make_training_row(prompt, completion, -torch.ones(completion.numel()), 0.0, 1.0)
        row["advantages"] = torch.tensor(1.0 if i % 2 else -1.0)
        rows.append(row)
    return collate_rows(rows, pad_token_id=0)


def test_policy_worker_actor_step_weights_checkpoint(
    ray_session, model_dir: Path, tmp_path: Path
) -> None:
    ray = ray_session
    policy_cfg = PolicyConfig(model_name=str(model_dir), device="cpu", train_micro_batch_size=4)
    loss_cfg = LossConfig(use_importance_sampling_correction=True, entropy_coef=0.005)
    actor = create_policy_worker_actor(policy_cfg, loss_cfg, seed=0)
    batch = make_batch()
    step_tokens = count_loss_tokens(batch)

    async def run() -> tuple[dict, dict]:
        batch["prev_logprobs"] = await actor.get_logprobs.remote(batch)
        await actor.begin_train_step.remote()
        for rows in (slice(0, 3), slice(3, 8)):
            chunk = {key: value[rows] for key, value in batch.items()}
            await actor.train_microbatches.remote(
                chunk, step_num_sequences=8, step_num_tokens=step_tokens
            )
        metrics = await actor.finish_train_step.remote()
        return metrics, await actor.get_state.remote()

    metrics, state = asyncio.run(run())
    assert state["optimizer_steps"] == 1 and metrics["num_chunks"] == 2.0
    assert metrics["num_tokens"] == step_tokens and metrics["grad_norm"] > 0
    # On-policy data with the generator's logprobs set to -1 everywhere: weights are measured.
    assert metrics["is_weight_mean"] > 0

    weights = ray.get(actor.export_weights.remote())
    assert "lm_head.weight" in weights
    after = ray.get(actor.get_logprobs.remote(batch))
    assert not torch.allclose(after, batch["prev_logprobs"])

    ray.get(actor.save_checkpoint.remote(tmp_path / "policy", save_optimizer=True))
    restored = create_policy_worker_actor(policy_cfg, loss_cfg, seed=0)
    ray.get(restored.load_checkpoint.remote(tmp_path / "policy", load_optimizer=True))
    torch.testing.assert_close(ray.get(restored.get_logprobs.remote(batch)), after)
    assert ray.get(restored.get_state.remote())["optimizer_steps"] == 1

    # Move the restored actor's weights away with one more step, then load the export back.
    async def step_again() -> None:
        await restored.begin_train_step.remote()
        await restored.train_microbatches.remote(batch, step_num_sequences=8)
        await restored.finish_train_step.remote()

    asyncio.run(step_again())
    assert not torch.allclose(ray.get(restored.get_logprobs.remote(batch)), after)
    ray.get(restored.load_weights.remote(weights))
    torch.testing.assert_close(ray.get(restored.get_logprobs.remote(batch)), after)
    for handle in (actor, restored):
        ray.kill(handle)


def test_value_worker_actor_trains(ray_session, model_dir: Path) -> None:
    ray = ray_session
    actor = create_value_worker_actor(
        ValueConfig(train_micro_batch_size=4, optimizer={"lr": 3e-3}),
        ValueLossConfig(),
        model_path=model_dir,
        device="cpu",
    )
    batch = make_batch()
    batch["returns"] = batch["token_mask"] * 0.5

    async def run() -> dict:
        metrics = {}
        for _ in range(3):
            batch["values"] = await actor.get_values.remote(batch)
            await actor.begin_train_step.remote()
            await actor.train_microbatches.remote(batch, step_num_sequences=8)
            metrics = await actor.finish_train_step.remote()
        return metrics

    metrics = asyncio.run(run())
    assert metrics["optimizer_steps"] == 3.0
    assert ray.get(actor.get_state.remote())["optimizer_steps"] == 3
    ray.kill(actor)
