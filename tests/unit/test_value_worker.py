"""ValueWorker in-process on a tiny random Qwen2: alignment, learning, split step, checkpoints."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandemrl.config.models import ValueConfig, ValueLossConfig
from tandemrl.dataplane.rows import make_training_row
from tandemrl.training.advantages import gae, sequence_rewards_to_tokens
from tandemrl.training.api import ValueTrainer
from tandemrl.training.batch import collate_rows, count_loss_tokens
from tandemrl.training.value_worker import ValueWorker
from tandemrl.training.worker_common import CheckpointError

VOCAB = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tiny-qwen2-value")
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
        torch.manual_seed(1)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def make_worker(model_dir: Path, *, lr: float = 3e-3, seed: int = 0) -> ValueWorker:
    cfg = ValueConfig(train_micro_batch_size=3, optimizer={"lr": lr})
    return ValueWorker(
        cfg, ValueLossConfig(value_clip=None), model_path=model_dir, seed=seed, device="cpu"
    )


def make_batch(worker: ValueWorker, num: int = 6) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(5)
    rows = []
    for i in range(num):
        prompt = torch.randint(3, VOCAB, (2 + i % 2,), generator=gen)
        completion = torch.randint(3, VOCAB, (3 + i % 3,), generator=gen)
        rows.append(
            make_training_row(
                prompt,
                completion,
                torch.zeros(completion.numel()),
                reward=float(i % 3) - 1.0,
                sample_mask=1.0,
            )
        )
    batch = collate_rows(rows, pad_token_id=0)
    batch["values"] = asyncio.run(worker.get_values(batch))
    rewards = sequence_rewards_to_tokens(batch["reward"], batch["token_mask"])
    _, batch["returns"] = gae(rewards, torch.zeros_like(rewards), batch["token_mask"], 1.0, 1.0)
    return batch


def test_values_are_aligned_and_causal(model_dir: Path) -> None:
    worker = make_worker(model_dir)
    batch = make_batch(worker)
    values = batch["values"]
    assert values.shape == batch["input_ids"].shape
    assert torch.all(values[:, 0] == 0)
    assert torch.all(values[batch["attention_mask"] == 0] == 0)
    # Entry t is computed from the state before token t: changing token t leaves it unchanged
    # and changes entry t + 1.
    changed = dict(batch)
    changed["input_ids"] = batch["input_ids"].clone()
    changed["input_ids"][0, 3] = (changed["input_ids"][0, 3] + 1) % VOCAB
    new_values = asyncio.run(worker.get_values(changed))
    torch.testing.assert_close(new_values[0, :4], values[0, :4])
    assert not torch.allclose(new_values[0, 4], values[0, 4])


def test_values_move_toward_returns(model_dir: Path) -> None:
    worker = make_worker(model_dir)
    batch = make_batch(worker)
    mask = batch["token_mask"]

    def error(values: torch.Tensor) -> float:
        return float(((values - batch["returns"]).abs() * mask).sum() / mask.sum())

    start = error(batch["values"])

    async def run() -> None:
        for _ in range(30):
            batch["values"] = await worker.get_values(batch)
            await worker.begin_train_step()
            await worker.train_microbatches(batch, step_num_sequences=6)
            await worker.finish_train_step()

    asyncio.run(run())
    end = error(asyncio.run(worker.get_values(batch)))
    assert worker.optimizer_steps == 30
    assert end < 0.5 * start, (start, end)


def test_chunked_step_matches_whole_step(model_dir: Path) -> None:
    whole, chunked = make_worker(model_dir), make_worker(model_dir)
    batch = make_batch(whole)
    batch["returns"] = batch["returns"] + 0.5 * batch["token_mask"]
    tokens = count_loss_tokens(batch)

    async def run() -> None:
        await whole.begin_train_step()
        await whole.train_microbatches(batch, step_num_sequences=6, step_num_tokens=tokens)
        await chunked.begin_train_step()
        for rows in (slice(0, 2), slice(2, 6)):
            part = {k: v[rows] for k, v in batch.items()}
            await chunked.train_microbatches(part, step_num_sequences=6, step_num_tokens=tokens)
        for p_whole, p_chunked in zip(whole._parameters(), chunked._parameters(), strict=True):
            if p_whole.grad is None:
                assert p_chunked.grad is None
                continue
            torch.testing.assert_close(p_chunked.grad, p_whole.grad, atol=1e-6, rtol=1e-5)
        await whole.finish_train_step()
        metrics = await chunked.finish_train_step()
        assert metrics["num_chunks"] == 2.0

    asyncio.run(run())
    assert whole.optimizer_steps == chunked.optimizer_steps == 1
    assert isinstance(whole, ValueTrainer)


def test_checkpoint_round_trip_and_warm_start(model_dir: Path, tmp_path: Path) -> None:
    worker = make_worker(model_dir)
    batch = make_batch(worker)

    async def train(w: ValueWorker) -> None:
        await w.begin_train_step()
        await w.train_microbatches(batch, step_num_sequences=6)
        await w.finish_train_step()

    asyncio.run(train(worker))
    asyncio.run(worker.save_checkpoint(tmp_path / "step_1" / "value", save_optimizer=True))
    expected = asyncio.run(worker.get_values(batch))

    restored = make_worker(model_dir, seed=9)
    assert not torch.allclose(asyncio.run(restored.get_values(batch)), expected)
    asyncio.run(restored.load_checkpoint(tmp_path / "step_1" / "value", load_optimizer=True))
    torch.testing.assert_close(asyncio.run(restored.get_values(batch)), expected)
    assert restored.optimizer_steps == 1
    for p_a, p_b in zip(worker._parameters(), restored._parameters(), strict=True):
        if p_a in worker.optimizer.state:
            torch.testing.assert_close(
                restored.optimizer.state[p_b]["exp_avg_sq"],
                worker.optimizer.state[p_a]["exp_avg_sq"],
            )
    asyncio.run(train(worker))
    asyncio.run(train(restored))
    torch.testing.assert_close(
        asyncio.run(restored.get_values(batch)),
        asyncio.run(worker.get_values(batch)),
        atol=1e-6,
        rtol=0,
    )

    warm = make_worker(model_dir, seed=3)
    asyncio.run(warm.load_warm_start(tmp_path / "step_1"))
    torch.testing.assert_close(asyncio.run(warm.get_values(batch)), expected)
    assert warm.optimizer_steps == 0 and not warm.optimizer.state

    broken = tmp_path / "broken"
    shutil.copytree(tmp_path / "step_1" / "value", broken)
    (broken / "value_head.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"value_head\.safetensors"):
        asyncio.run(warm.load_checkpoint(broken, load_optimizer=False))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_value_worker_on_cuda(model_dir: Path) -> None:
    worker = ValueWorker(
        ValueConfig(train_micro_batch_size=3),
        ValueLossConfig(),
        model_path=model_dir,
        device="cuda",
    )
    assert worker.autocast_dtype == torch.bfloat16
    batch = make_batch(worker)
    assert batch["values"].device.type == "cpu"

    async def run() -> dict[str, float]:
        await worker.begin_train_step()
        await worker.train_microbatches(batch, step_num_sequences=6)
        return await worker.finish_train_step()

    metrics = asyncio.run(run())
    assert metrics["optimizer_steps"] == 1.0 and metrics["grad_norm"] > 0


def test_streamed_chunks_without_token_count_match_whole_step(model_dir: Path) -> None:
    whole, streamed = make_worker(model_dir), make_worker(model_dir)
    batch = make_batch(whole)
    batch["returns"] = batch["returns"] + 0.5 * batch["token_mask"]

    async def run() -> tuple[dict, dict]:
        await whole.begin_train_step()
        await whole.train_microbatches(batch, step_num_sequences=6)
        await streamed.begin_train_step()
        for rows in (slice(0, 4), slice(4, 6)):
            part = {k: v[rows] for k, v in batch.items()}
            await streamed.train_microbatches(part, step_num_sequences=6)
        return await whole.finish_train_step(), await streamed.finish_train_step()

    metrics_whole, metrics_streamed = asyncio.run(run())
    assert metrics_streamed["grad_norm"] == pytest.approx(metrics_whole["grad_norm"], rel=1e-5)
    assert metrics_streamed["value_loss"] == pytest.approx(metrics_whole["value_loss"], rel=1e-6)
    torch.testing.assert_close(
        asyncio.run(streamed.get_values(batch)),
        asyncio.run(whole.get_values(batch)),
        atol=1e-5,
        rtol=0,
    )
