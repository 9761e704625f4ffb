"""Length-sorted micro-batches: same logprobs (in the caller's row order) and same gradient."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandemrl.config.models import LossConfig, PolicyConfig
from tandemrl.training.batch import collate_rows, make_training_row
from tandemrl.training.policy_worker import PolicyWorker, sort_rows_by_length

VOCAB = 16


def build_tiny_qwen2(folder: Path) -> Path:
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
        eos_token_id=1,
        bos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def make_worker(model_dir: Path, micro_batch: int) -> PolicyWorker:
    cfg = PolicyConfig(model_name=str(model_dir), train_micro_batch_size=micro_batch, device="cpu")
    return PolicyWorker(cfg, LossConfig(entropy_coef=0.005), seed=0)


def make_batch(worker: PolicyWorker | None = None, num: int = 6, seed: int = 0):
    """Rows of different prompt and completion lengths (so sorting reorders them)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num):
        prompt = torch.randint(3, VOCAB, (2 + i % 3,), generator=gen)
        completion = torch.randint(3, VOCAB, (3 + i % 2,), generator=gen)
        logprobs = -torch.rand(completion.numel(), generator=gen) - 1.0
        row = make_training_row(prompt, completion, logprobs, reward=float(i % 2), sample_mask=1.0)
        row["advantages"] = torch.tensor(1.0 if i % 2 else -1.0)
        rows.append(row)
    batch = collate_rows(rows, pad_token_id=0)
    if worker is not None:
        batch["prev_logprobs"] = asyncio.run(worker.get_logprobs(batch))
    return batch


def grads(worker: PolicyWorker) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in worker.model.named_parameters() if p.grad is not None}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-sorting"))


def test_sort_rows_by_length_orders_longest_first_and_keeps_rows_whole() -> None:
    batch = make_batch(num=7, seed=3)
    batch["sample_mask"] = torch.arange(7, dtype=torch.float32)  # a per-row field
    reordered, order = sort_rows_by_length(batch)
    lengths = reordered["attention_mask"].sum(dim=1)
    assert bool((lengths[:-1] >= lengths[1:]).all())
    assert sorted(order.tolist()) == list(range(7))
    for key, value in batch.items():
        torch.testing.assert_close(reordered[key], value[order], rtol=0, atol=0)


def test_logprobs_come_back_in_row_order_whatever_the_micro_batch(model_dir: Path) -> None:
    worker = make_worker(model_dir, 2)
    batch = make_batch(num=7, seed=5)
    together = asyncio.run(worker.get_logprobs(batch))
    for row in range(7):
        alone = asyncio.run(worker.get_logprobs({k: v[row : row + 1] for k, v in batch.items()}))
        width = alone.shape[1]
        torch.testing.assert_close(together[row : row + 1, :width], alone, atol=1e-5, rtol=0)
        assert bool((together[row, width:] == 0).all())


def test_sorted_micro_batches_give_the_unsplit_gradient(model_dir: Path) -> None:
    def step_grads(micro: int) -> dict[str, torch.Tensor]:
        worker = make_worker(model_dir, micro)
        batch = make_batch(worker, num=7, seed=6)

        async def run() -> None:
            await worker.begin_train_step()
            await worker.train_microbatches(batch, step_num_sequences=7)

        asyncio.run(run())
        return grads(worker)

    split, whole = step_grads(2), step_grads(7)
    assert split.keys() == whole.keys()
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], atol=1e-5, rtol=1e-4, msg=name)
