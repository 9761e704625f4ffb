"""Packed (padding-free) training micro-batches: the packing itself, and packed == padded
logprobs and gradients through the PolicyWorker (CPU: reference attention; CUDA: varlen)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from test_policy_worker import build_tiny_qwen2, grads, make_batch, make_worker
from transformers import GPT2Config, GPT2LMHeadModel

from tandemrl.config.models import LossConfig, PolicyConfig
from tandemrl.training import packing
from tandemrl.training.batch import count_loss_tokens
from tandemrl.training.packing import pack_rows, split_packed
from tandemrl.training.policy_worker import PolicyWorker


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2-packing"))


def test_pack_rows_concatenates_real_tokens_and_restarts_positions() -> None:
    input_ids = torch.tensor([[5, 6, 7, 0], [8, 9, 0, 0], [3, 4, 5, 6]])
    mask = (input_ids != 0).long()
    rows = pack_rows(input_ids, mask)
    assert rows.input_ids.tolist() == [[5, 6, 7, 8, 9, 3, 4, 5, 6]]
    assert rows.position_ids.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3]]
    assert rows.cu_seqlens.tolist() == [0, 3, 5, 9]
    assert rows.cu_seqlens.dtype == torch.int32
    assert rows.max_length == 4
    # padded flat index r * 4 + t -> packed offsets[r] + t
    padded = torch.tensor([1, 2, 5, 9, 11])
    assert rows.packed_index(padded, 4).tolist() == [1, 2, 4, 6, 8]


def test_pack_rows_refuses_left_padding_and_empty_rows() -> None:
    ids = torch.tensor([[0, 5, 6], [7, 8, 9]])
    with pytest.raises(ValueError, match="right-padded"):
        pack_rows(ids, (ids != 0).long())
    ids = torch.tensor([[0, 0, 0], [7, 8, 9]])
    with pytest.raises(ValueError, match="without any real token"):
        pack_rows(ids, (ids != 0).long())


def test_split_packed_counts_real_tokens_and_rows() -> None:
    lengths = [10, 8, 6, 6, 3, 2]
    assert split_packed(lengths, max_rows=6, max_tokens=None) == [(0, 6)]
    assert split_packed(lengths, max_rows=4, max_tokens=None) == [(0, 4), (4, 6)]
    assert split_packed(lengths, max_rows=6, max_tokens=20) == [(0, 2), (2, 6)]
    # a row longer than the budget goes alone
    assert split_packed([30, 5, 5], max_rows=6, max_tokens=12) == [(0, 1), (1, 3)]


def run_step(worker, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, float]]:
    logprobs = asyncio.run(worker.get_logprobs(batch))

    async def step() -> dict[str, float]:
        await worker.begin_train_step()
        return await worker.train_microbatches(
            batch,
            step_num_sequences=batch["input_ids"].shape[0],
            step_num_tokens=count_loss_tokens(batch),
        )

    metrics = asyncio.run(step())
    return logprobs, grads(worker), metrics


@pytest.mark.parametrize("micro_tokens", [None, 12])
def test_packed_matches_padded_logprobs_and_gradients_on_cpu(
    model_dir: Path, micro_tokens: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []
    reference = packing._reference_varlen

    def counting(*args, **kwargs):
        calls.append(args[0].shape[0])
        return reference(*args, **kwargs)

    monkeypatch.setattr(packing, "_reference_varlen", counting)
    results = {}
    for mode in ("off", "on"):
        worker = make_worker(
            model_dir,
            sequence_packing=mode,
            train_micro_batch_size=6,
            train_micro_batch_tokens=micro_tokens,
        )
        assert worker.sequence_packing == (mode == "on")
        batch = make_batch(num=6, seed=3)
        batch["prev_logprobs"] = -torch.rand(
            batch["input_ids"].shape, generator=torch.Generator().manual_seed(1)
        )
        results[mode] = run_step(worker, batch)
        if mode == "off":
            assert calls == []
    # packed forwards ran (2 layers each, get_logprobs and the train step)
    assert calls and max(calls) <= (micro_tokens or 10**9) + 5
    padded, packed = results["off"], results["on"]
    torch.testing.assert_close(packed[0], padded[0], rtol=1e-5, atol=1e-6)
    assert padded[1].keys() == packed[1].keys()
    for name in padded[1]:
        torch.testing.assert_close(packed[1][name], padded[1][name], rtol=1e-4, atol=1e-6)
    assert packed[2]["loss"] == pytest.approx(padded[2]["loss"], rel=1e-5)


def test_sequence_packing_auto_is_off_on_cpu_and_on_refuses_unsupported_models(
    model_dir: Path, tmp_path: Path
) -> None:
    assert make_worker(model_dir).sequence_packing is False  # auto, CPU
    config = GPT2Config(vocab_size=16, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        GPT2LMHeadModel(config).save_pretrained(tmp_path / "gpt2")
    cfg = PolicyConfig(model_name=str(tmp_path / "gpt2"), device="cpu", sequence_packing="on")
    with pytest.raises(ValueError, match=r"policy\.sequence_packing: on .*gpt2"):
        PolicyWorker(cfg, LossConfig())
    off = PolicyConfig(model_name=str(tmp_path / "gpt2"), device="cpu", sequence_packing="auto")
    assert PolicyWorker(off, LossConfig()).sequence_packing is False


def test_sequence_packing_rejects_unknown_values_and_reads_yaml_booleans() -> None:
    with pytest.raises(ValueError, match="sequence_packing"):
        PolicyConfig(sequence_packing="always")
    assert PolicyConfig(sequence_packing=True).sequence_packing == "on"
    assert PolicyConfig(sequence_packing=False).sequence_packing == "off"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (varlen flash attention)")
def test_packed_matches_padded_on_cuda_bf16(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("packed attention on CUDA under bf16 must take varlen_attn")

    monkeypatch.setattr(packing, "_reference_varlen", refuse)
    results = {}
    for mode in ("off", "on"):
        worker = make_worker(
            model_dir,
            device="cuda",
            precision="bfloat16",
            sequence_packing=mode,
            train_micro_batch_size=6,
            train_micro_batch_tokens=14,
        )
        assert worker.sequence_packing == (mode == "on")
        batch = make_batch(num=6, seed=5)
        batch["prev_logprobs"] = -torch.rand(
            batch["input_ids"].shape, generator=torch.Generator().manual_seed(2)
        )
        results[mode] = run_step(worker, batch)
    padded, packed = results["off"], results["on"]
    # bf16 compute: the two attention kernels round differently.
    torch.testing.assert_close(packed[0], padded[0], rtol=0, atol=3e-2)
    for name in padded[1]:
        a, b = packed[1][name].double(), padded[1][name].double()
        assert float((a - b).norm() / b.norm().clamp(min=1e-30)) < 5e-2, name
    assert packed[2]["loss"] == pytest.approx(padded[2]["loss"], rel=2e-2, abs=1e-3)
