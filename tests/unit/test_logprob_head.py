"""The chunked logprob head, the head vs full-logits paths of PolicyWorker, and
``loss_fn.reuse_training_logprobs`` (worker, GRPO runner, PPO validation)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from test_policy_worker import build_tiny_qwen2, grads, make_batch, make_worker

from tandemrl.buffer import Slot
from tandemrl.config.loader import load_config
from tandemrl.config.models import LossConfig
from tandemrl.config.validate import ConfigError, validate_single_controller_config
from tandemrl.controller.step_runner import GRPOStepRunner
from tandemrl.dataplane.rows import make_training_row
from tandemrl.records import RowMeta
from tandemrl.training.batch import collate_rows
from tandemrl.training.logprob_head import head_logprobs, supports_head_logprobs
from tandemrl.training.policy_worker import is_right_padded, split_by_rows_and_tokens


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-head"))


def reference(hidden, weight, targets, temperature):
    logits = (hidden @ weight.t()) / temperature
    log_probs = torch.log_softmax(logits, dim=-1)
    picked = log_probs.gather(1, targets[:, None]).squeeze(1)
    entropy = -(log_probs.exp() * log_probs).sum(-1)
    return picked, entropy


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [3, 64])
def test_head_matches_log_softmax_values_and_gradients(temperature: float, chunk: int) -> None:
    gen = torch.Generator().manual_seed(1)
    rows, width, vocab = 11, 8, 37
    hidden = torch.randn(rows, width, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, width, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (rows,), generator=gen)
    g_lp, g_ent = torch.randn(rows, generator=gen), torch.randn(rows, generator=gen)

    lp, ent = head_logprobs(hidden, weight, targets, temperature=temperature, chunk_tokens=chunk)
    ((lp * g_lp).sum() + (ent * g_ent).sum()).backward()
    got = (lp, ent, hidden.grad, weight.grad)

    # Reference in float64 (the head computes in float32).
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().double().requires_grad_()
    ref_lp, ref_ent = reference(hidden64, weight64, targets, temperature)
    ((ref_lp * g_lp).sum() + (ref_ent * g_ent).sum()).backward()
    want = (ref_lp, ref_ent, hidden64.grad, weight64.grad)
    for name, a, b in zip(("logprobs", "entropy", "d hidden", "d weight"), got, want, strict=True):
        error = (a.detach().double() - b.detach()).norm() / b.detach().norm()
        assert error < 1e-5, (name, float(error))


def test_head_gradient_of_logprobs_alone_and_input_checks() -> None:
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(5, 4, generator=gen, requires_grad=True)
    weight = torch.randn(9, 4, generator=gen, requires_grad=True)
    targets = torch.randint(0, 9, (5,), generator=gen)
    lp, _ = head_logprobs(hidden, weight, targets, temperature=1.0)
    lp.sum().backward()  # entropy unused: its gradient arrives as None
    expected = torch.autograd.grad(
        F.log_softmax(hidden @ weight.t(), -1).gather(1, targets[:, None]).sum(), hidden
    )[0]
    assert torch.allclose(hidden.grad, expected, atol=1e-6)
    with pytest.raises(ValueError, match="hidden \\[rows, H\\]"):
        head_logprobs(hidden[None], weight, targets, temperature=1.0)
    with pytest.raises(ValueError, match="chunk_tokens"):
        head_logprobs(hidden, weight, targets, temperature=1.0, chunk_tokens=0)


def test_is_right_padded() -> None:
    assert is_right_padded(torch.tensor([[1, 1, 0], [1, 1, 1]]))
    assert not is_right_padded(torch.tensor([[0, 1, 1], [1, 1, 1]]))
    assert not is_right_padded(torch.tensor([[1, 0, 1]]))


def left_padded_batch(worker) -> dict:
    batch = make_batch(None, num=4, seed=3)
    # Move row 0's padding to the left: the worker must then keep the attention mask.
    length = int(batch["attention_mask"][0].sum())
    for key in ("input_ids", "attention_mask", "token_mask", "generation_logprobs", "advantages"):
        row = batch[key][0].clone()
        batch[key][0] = torch.roll(row, batch[key].shape[1] - length)
    assert not is_right_padded(batch["attention_mask"])
    return batch


@pytest.mark.parametrize("left_padding", [False, True])
def test_head_path_matches_full_logits_path(model_dir: Path, left_padding: bool) -> None:
    head = make_worker(model_dir, generation={"temperature": 0.8})
    plain = make_worker(model_dir, generation={"temperature": 0.8})
    assert supports_head_logprobs(head.model) and head.use_head_logprobs
    plain.use_head_logprobs = False
    batch = left_padded_batch(head) if left_padding else make_batch(None)
    got, want = (asyncio.run(w.get_logprobs(batch)) for w in (head, plain))
    assert torch.allclose(got, want, atol=1e-5)
    batch["prev_logprobs"] = want
    metrics = []
    for worker in (head, plain):
        asyncio.run(worker.begin_train_step())
        metrics.append(asyncio.run(worker.train_microbatches(batch, step_num_sequences=4)))
    for name, grad in grads(head).items():
        assert torch.allclose(grad, grads(plain)[name], atol=1e-5), name
    for key in ("loss", "entropy", "ratio_mean", "num_tokens"):
        assert metrics[0][key] == pytest.approx(metrics[1][key], abs=1e-5), key


def test_reuse_training_logprobs_gives_the_same_step(model_dir: Path) -> None:
    separate = make_worker(model_dir, loss_cfg=LossConfig(entropy_coef=0.005))
    reuse = make_worker(
        model_dir, loss_cfg=LossConfig(entropy_coef=0.005, reuse_training_logprobs=True)
    )
    batch = make_batch(None, num=6)
    with_prev = {**batch, "prev_logprobs": asyncio.run(separate.get_logprobs(batch))}
    results = []
    for worker, train_batch in ((separate, with_prev), (reuse, batch)):
        asyncio.run(worker.begin_train_step())
        # Two chunks: the second forward must still see the pre-step weights.
        for rows in (slice(0, 4), slice(4, 6)):
            chunk = {key: value[rows] for key, value in train_batch.items()}
            asyncio.run(
                worker.train_microbatches(chunk, step_num_sequences=6, step_num_tokens=None)
            )
        results.append(asyncio.run(worker.finish_train_step()))
    assert results[0]["loss"] == pytest.approx(results[1]["loss"], abs=1e-6)
    assert results[1]["ratio_mean"] == 1.0 and results[1]["clip_fraction"] == 0.0
    for (name, a), b in zip(
        separate.model.named_parameters(), reuse.model.parameters(), strict=True
    ):
        assert torch.allclose(a, b, atol=1e-6), name


def test_missing_prev_logprobs_without_the_knob_names_it(model_dir: Path) -> None:
    worker = make_worker(model_dir)
    asyncio.run(worker.begin_train_step())
    with pytest.raises(KeyError, match=r"loss_fn\.reuse_training_logprobs"):
        asyncio.run(worker.train_microbatches(make_batch(None), step_num_sequences=6))


class RecordingTrainer:
    def __init__(self) -> None:
        self.logprob_calls = 0
        self.batches: list[dict] = []

    async def get_logprobs(self, batch):
        self.logprob_calls += 1
        return torch.zeros_like(batch["generation_logprobs"])

    async def train_microbatches(self, batch, *, step_num_sequences, step_num_tokens=None):
        self.batches.append(batch)
        return {}


def committed_slot(group_id: str, sample_ids: list[str], dispatch_index: int) -> Slot:
    """A ready buffer slot of a two-sibling group whose rows are ``sample_ids``."""
    rows_meta = [
        RowMeta(
            sample_id=sample_id,
            group_id=group_id,
            sibling_index=sibling,
            reward=0.0,
            sample_mask=1.0,
            num_prompt_tokens=2,
            num_completion_tokens=2,
            truncated=False,
            start_weight_version=0,
            end_weight_version=0,
        )
        for sibling, sample_id in enumerate(sample_ids)
    ]
    return Slot(
        group_id=group_id,
        start_weight=0,
        target_step=None,
        dispatch_index=dispatch_index,
        end_weight=0,
        ready=True,
        rows_meta=rows_meta,
    )


@pytest.mark.parametrize("reuse", [False, True])
def test_grpo_runner_skips_get_logprobs_when_reusing(reuse: bool) -> None:
    rows = {
        f"s{i}": make_training_row([3, 4], [5, 6], [-1.0, -1.0], reward=float(i), sample_mask=1.0)
        for i in range(4)
    }
    trainer = RecordingTrainer()
    runner = GRPOStepRunner(
        trainer,
        group_size=2,
        leave_one_out_baseline=False,
        normalize_rewards=False,
        pad_token_id=0,
        reuse_training_logprobs=reuse,
    )
    slots = [committed_slot("g0", ["s0", "s1"], 0), committed_slot("g1", ["s2", "s3"], 1)]
    asyncio.run(runner.train_chunk(slots, rows, step_num_sequences=4))
    assert trainer.logprob_calls == (0 if reuse else 1)
    assert ("prev_logprobs" in trainer.batches[0]) is not reuse
    assert collate_rows(list(rows.values()), 0)["input_ids"].shape == (4, 4)


def test_validation_refuses_reuse_with_several_ppo_epochs() -> None:
    overrides = ("loss_fn.reuse_training_logprobs=true", "ppo.ppo_epochs=2")
    cfg = load_config("examples/configs/ppo_tiny_cpu.yaml", overrides)
    with pytest.raises(ConfigError, match=r"loss_fn\.reuse_training_logprobs.*ppo\.ppo_epochs"):
        validate_single_controller_config(cfg)
    cfg = load_config("examples/configs/ppo_tiny_cpu.yaml", (overrides[0], "ppo.ppo_epochs=1"))
    validate_single_controller_config(cfg)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_compiled_bf16_head_on_cuda_matches_float64() -> None:
    gen = torch.Generator(device="cuda").manual_seed(5)
    rows, width, vocab = 3000, 256, 50_000
    hidden = torch.randn(rows, width, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = (0.05 * torch.randn(vocab, width, device="cuda", generator=gen)).requires_grad_()
    targets = torch.randint(0, vocab, (rows,), device="cuda", generator=gen)
    g_lp = torch.randn(rows, device="cuda", generator=gen)
    lp, ent = head_logprobs(hidden, weight, targets, temperature=0.9, chunk_tokens=1024)
    (lp * g_lp).sum().backward()
    hidden64 = hidden.detach().double().requires_grad_()
    weight64 = weight.detach().bfloat16().double().requires_grad_()
    ref_lp, ref_ent = reference(hidden64, weight64, targets, 0.9)
    (ref_lp * g_lp.double()).sum().backward()
    for name, a, b in (
        ("logprobs", lp, ref_lp),
        ("entropy", ent, ref_ent),
        ("d hidden", hidden.grad, hidden64.grad),
        ("d weight", weight.grad, weight64.grad),
    ):
        error = (a.detach().double() - b.detach()).norm() / b.detach().norm()
        assert error < 1e-2, (name, float(error))


def test_split_by_rows_and_tokens_keeps_each_micro_batch_in_budget() -> None:
    lengths = [9, 8, 8, 5, 4, 4, 3, 2, 2, 1]
    mask = (torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]).long()
    batch = {"input_ids": mask.clone(), "attention_mask": mask, "sample_mask": torch.ones(10)}
    micros = split_by_rows_and_tokens(batch, max_rows=4, max_tokens=16)
    sizes = [m["input_ids"].shape[0] for m in micros]
    assert sizes == [1, 2, 3, 4]  # 9 | 8 8 | 5 4 4 | 3 2 2 1
    for micro in micros:
        rows = micro["input_ids"].shape[0]
        longest = int(micro["attention_mask"].sum(1).max())
        assert rows == 1 or rows * longest <= 16
        assert rows <= 4
    assert torch.equal(torch.cat([m["sample_mask"] for m in micros]), batch["sample_mask"])
    fixed = split_by_rows_and_tokens(batch, max_rows=4, max_tokens=None)
    assert [m["input_ids"].shape[0] for m in fixed] == [4, 4, 2]
