"""The split train step's contract, held by the fake trainer exactly as by the policy worker.

Tests over fakes stand in for the real worker only if the fake refuses what the worker
refuses: each case below drives both the same way and expects the same error.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from tandemrl.config.loader import load_config
from tandemrl.dataplane.rows import make_training_row
from tandemrl.training.batch import collate_rows, count_loss_tokens
from tandemrl.training.fake import FakeTrainer
from tandemrl.training.losses import AllMaskedStepError
from tandemrl.training.policy_worker import PolicyWorker
from tandemrl.training.worker_common import TrainStepError

ROWS = 4


@pytest.fixture(scope="module")
def policy_cfg(tmp_path_factory: pytest.TempPathFactory):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("tiny-qwen2-contract")
    config = Qwen2Config(
        vocab_size=16,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=32,
        tie_word_embeddings=True,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        Qwen2ForCausalLM(config).save_pretrained(folder)
    return load_config("examples/configs/grpo_tiny_cpu.yaml", (f"policy.model_name={folder}",))


@pytest.fixture(params=["fake", "policy_worker"])
def trainer(request, policy_cfg):
    if request.param == "fake":
        return FakeTrainer()
    return PolicyWorker(policy_cfg.policy, policy_cfg.loss_fn, seed=0)


def make_batch(trainer, *, masked: bool = False):
    rows = []
    for i in range(ROWS):
        row = make_training_row(
            [1, 2],
            [3, 4 + i],
            [-1.0, -1.0],
            reward=float(i % 2),
            sample_mask=0.0 if masked else 1.0,
        )
        row["advantages"] = torch.tensor(1.0 if i % 2 else -1.0)
        rows.append(row)
    batch = collate_rows(rows, pad_token_id=0)
    batch["prev_logprobs"] = asyncio.run(trainer.get_logprobs(batch))
    return batch


def test_calls_outside_a_step_are_refused(trainer):
    batch = make_batch(trainer)

    async def go() -> None:
        with pytest.raises(TrainStepError, match="finish_train_step called outside a train step"):
            await trainer.finish_train_step()
        with pytest.raises(TrainStepError, match="train_microbatches called outside a train step"):
            await trainer.train_microbatches(batch, step_num_sequences=ROWS)
        await trainer.begin_train_step()
        with pytest.raises(TrainStepError, match="while a step is open"):
            await trainer.begin_train_step()

    asyncio.run(go())


def test_inconsistent_step_counts_are_refused_and_the_step_is_dropped(trainer):
    batch = make_batch(trainer)
    tokens = count_loss_tokens(batch)

    async def go() -> None:
        await trainer.begin_train_step()
        await trainer.train_microbatches(batch, step_num_sequences=ROWS + 2)
        with pytest.raises(TrainStepError, match="step_num_sequences changed"):
            await trainer.train_microbatches(batch, step_num_sequences=ROWS)
        with pytest.raises(TrainStepError, match="or to none"):
            await trainer.train_microbatches(
                batch, step_num_sequences=ROWS + 2, step_num_tokens=tokens
            )
        await trainer.finish_train_step()  # deferred: normalised by what the chunk held
        # Exact counts that the chunks do not hold: refused at finish, nothing applied.
        for declared_sequences, declared_tokens, error in [
            (ROWS, tokens + 1, "wrong count"),
            (ROWS + 1, tokens, "sequences but step_num_sequences"),
        ]:
            await trainer.begin_train_step()
            await trainer.train_microbatches(
                batch, step_num_sequences=declared_sequences, step_num_tokens=declared_tokens
            )
            with pytest.raises(TrainStepError, match=error):
                await trainer.finish_train_step()

    asyncio.run(go())
    assert trainer.optimizer_steps == 1


def test_a_step_without_a_valid_token_is_refused(trainer):
    batch = make_batch(trainer, masked=True)

    async def go() -> None:
        await trainer.begin_train_step()
        await trainer.train_microbatches(batch, step_num_sequences=ROWS)
        with pytest.raises(AllMaskedStepError):
            await trainer.finish_train_step()
        # Refused, not left open: the next step begins.
        await trainer.begin_train_step()

    asyncio.run(go())
    assert trainer.optimizer_steps == 0
