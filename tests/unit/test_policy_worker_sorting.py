"""Length-sorted micro-batches: same logprobs (in the caller's row order) and same gradient."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_policy_worker import build_tiny_qwen2, grads, make_batch
from test_policy_worker import make_worker as make_policy_worker

from tandemrl.training.policy_worker import PolicyWorker, sort_rows_by_length


def make_worker(model_dir: Path, micro_batch: int) -> PolicyWorker:
    return make_policy_worker(model_dir, train_micro_batch_size=micro_batch)


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
