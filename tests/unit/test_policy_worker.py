"""PolicyWorker in-process on a tiny random Qwen2: the split step, learning, weights, checkpoints."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandemrl.config.models import LossConfig, PolicyConfig, SchedulerConfig
from tandemrl.dataplane.rows import make_training_row
from tandemrl.training.api import Trainer
from tandemrl.training.batch import collate_rows, count_loss_tokens
from tandemrl.training.losses import AllMaskedStepError
from tandemrl.training.policy_worker import PolicyWorker
from tandemrl.training.worker_common import CheckpointError, TrainStepError

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
        model = Qwen2ForCausalLM(config)
    model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def make_worker(model_dir: Path, **policy_overrides) -> PolicyWorker:
    loss_cfg = policy_overrides.pop("loss_cfg", None) or LossConfig(entropy_coef=0.005)
    policy_overrides.setdefault("train_micro_batch_size", 3)
    policy_overrides.setdefault("device", "cpu")
    cfg = PolicyConfig(model_name=str(model_dir), **policy_overrides)
    return PolicyWorker(cfg, loss_cfg, seed=0)


def make_batch(worker: PolicyWorker | None = None, num: int = 6, seed: int = 0):
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


def test_chunked_step_matches_one_big_step_and_steps_once(model_dir: Path) -> None:
    whole = make_worker(model_dir)
    chunked = make_worker(model_dir)
    batch = make_batch(whole)
    step_tokens = count_loss_tokens(batch)

    async def run() -> tuple[dict, dict]:
        await whole.begin_train_step()
        await whole.train_microbatches(batch, step_num_sequences=6, step_num_tokens=step_tokens)
        await chunked.begin_train_step()
        first = {k: v[:4] for k, v in batch.items()}
        second = {k: v[4:] for k, v in batch.items()}
        for part in (first, second):
            await chunked.train_microbatches(
                part, step_num_sequences=6, step_num_tokens=step_tokens
            )
        grads_whole, grads_chunked = grads(whole), grads(chunked)
        assert grads_whole.keys() == grads_chunked.keys() and grads_whole
        for name in grads_whole:
            torch.testing.assert_close(grads_chunked[name], grads_whole[name], atol=1e-6, rtol=1e-5)
        return await whole.finish_train_step(), await chunked.finish_train_step()

    metrics_whole, metrics_chunked = asyncio.run(run())
    assert isinstance(whole, Trainer)
    assert whole.optimizer_steps == chunked.optimizer_steps == 1
    assert metrics_chunked["optimizer_steps"] == 1.0 and metrics_chunked["num_chunks"] == 2.0
    assert metrics_whole["num_tokens"] == metrics_chunked["num_tokens"] == step_tokens
    assert metrics_whole["loss"] == pytest.approx(metrics_chunked["loss"], abs=1e-6)
    assert metrics_whole["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    state = chunked.optimizer.state[next(iter(chunked.model.parameters()))]
    assert int(state["step"].item()) == 1


def test_streamed_chunks_without_token_count_match_one_big_step(model_dir: Path) -> None:
    """Chunks trained before the step's token count is known: finish rescales the gradient."""
    whole = make_worker(model_dir, max_grad_norm=None)
    streamed = make_worker(model_dir, max_grad_norm=None)
    batch = make_batch(whole)

    async def run() -> tuple[dict, dict]:
        await whole.begin_train_step()
        await whole.train_microbatches(batch, step_num_sequences=6)
        await streamed.begin_train_step()
        for rows in (slice(0, 1), slice(1, 6)):
            part = {k: v[rows] for k, v in batch.items()}
            await streamed.train_microbatches(part, step_num_sequences=6)
        return await whole.finish_train_step(), await streamed.finish_train_step()

    metrics_whole, metrics_streamed = asyncio.run(run())
    assert metrics_streamed["grad_norm"] == pytest.approx(metrics_whole["grad_norm"], rel=1e-5)
    assert metrics_streamed["loss"] == pytest.approx(metrics_whole["loss"], abs=1e-6)
    assert metrics_streamed["num_tokens"] == metrics_whole["num_tokens"]
    torch.testing.assert_close(
        asyncio.run(streamed.get_logprobs(batch)),
        asyncio.run(whole.get_logprobs(batch)),
        atol=1e-5,
        rtol=0,
    )
    assert streamed.optimizer_steps == 1


def test_training_raises_logprob_of_rewarded_tokens(model_dir: Path) -> None:
    worker = make_worker(model_dir)
    batch = make_batch(num=6, seed=1)
    mask = batch["token_mask"]
    positive = (batch["advantages"] > 0).float() * mask
    negative = (batch["advantages"] < 0).float() * mask

    async def run() -> list[tuple[float, float, float]]:
        history = []
        for _ in range(8):
            batch["prev_logprobs"] = await worker.get_logprobs(batch)
            pos = float((batch["prev_logprobs"] * positive).sum() / positive.sum())
            neg = float((batch["prev_logprobs"] * negative).sum() / negative.sum())
            await worker.begin_train_step()
            metrics = await worker.train_microbatches(batch, step_num_sequences=6)
            await worker.finish_train_step()
            history.append((pos, neg, metrics["loss"]))
        return history

    history = asyncio.run(run())
    assert worker.optimizer_steps == 8
    assert history[-1][0] > history[0][0] + 0.1
    assert history[-1][1] < history[0][1] - 0.1
    assert history[-1][2] < history[0][2]


def test_logprobs_match_tempered_log_softmax(model_dir: Path) -> None:
    worker = make_worker(model_dir, generation={"temperature": 0.5})
    batch = make_batch(num=3)
    logprobs = asyncio.run(worker.get_logprobs(batch))
    with torch.no_grad():
        logits = worker.model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]
        ).logits
    expected = torch.log_softmax(logits[:, :-1] / 0.5, -1).gather(
        -1, batch["input_ids"][:, 1:, None]
    )[..., 0]
    expected = torch.nn.functional.pad(expected, (1, 0)) * batch["attention_mask"]
    torch.testing.assert_close(logprobs, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(logprobs[batch["attention_mask"] == 0] == 0)


def test_export_and_load_weights_round_trip(model_dir: Path) -> None:
    trained = make_worker(model_dir)
    fresh = make_worker(model_dir)
    batch = make_batch(trained)

    async def run() -> dict[str, torch.Tensor]:
        await trained.begin_train_step()
        await trained.train_microbatches(batch, step_num_sequences=6)
        await trained.finish_train_step()
        return await trained.export_weights()

    weights = asyncio.run(run())
    assert "lm_head.weight" in weights and "model.embed_tokens.weight" in weights
    assert all(t.device.type == "cpu" and t.is_contiguous() for t in weights.values())
    before = asyncio.run(trained.get_logprobs(batch))
    assert not torch.allclose(before, asyncio.run(fresh.get_logprobs(batch)))
    asyncio.run(fresh.load_weights(weights))
    torch.testing.assert_close(asyncio.run(fresh.get_logprobs(batch)), before, atol=0, rtol=0)
    # The export is a copy: changing it leaves the trainer untouched.
    for tensor in weights.values():
        tensor.zero_()
    torch.testing.assert_close(asyncio.run(trained.get_logprobs(batch)), before, atol=0, rtol=0)


def train_steps(worker: PolicyWorker, batch, steps: int) -> None:
    async def run() -> None:
        for _ in range(steps):
            batch["prev_logprobs"] = await worker.get_logprobs(batch)
            await worker.begin_train_step()
            await worker.train_microbatches(batch, step_num_sequences=6)
            await worker.finish_train_step()

    asyncio.run(run())


def test_checkpoint_restores_logprobs_and_optimizer(model_dir: Path, tmp_path: Path) -> None:
    schedule = {"scheduler": SchedulerConfig(name="linear_warmup", warmup_steps=5)}
    original = make_worker(model_dir, **schedule)
    batch = make_batch(num=6, seed=2)
    train_steps(original, batch, 2)
    asyncio.run(original.save_checkpoint(tmp_path / "policy", save_optimizer=True))
    assert (tmp_path / "policy" / "model.safetensors").is_file()

    restored = make_worker(model_dir, **schedule)
    asyncio.run(restored.load_checkpoint(tmp_path / "policy", load_optimizer=True))
    assert restored.optimizer_steps == 2
    torch.testing.assert_close(
        asyncio.run(restored.get_logprobs(batch)), asyncio.run(original.get_logprobs(batch))
    )
    for p_orig, p_rest in zip(
        original.model.parameters(), restored.model.parameters(), strict=True
    ):
        s_orig, s_rest = original.optimizer.state[p_orig], restored.optimizer.state[p_rest]
        torch.testing.assert_close(s_rest["exp_avg"], s_orig["exp_avg"], atol=0, rtol=0)
        torch.testing.assert_close(s_rest["exp_avg_sq"], s_orig["exp_avg_sq"], atol=0, rtol=0)
    assert restored.state()["lr"] == original.state()["lr"]
    # The next step is identical too (moments, step count and warm-up position restored).
    train_steps(original, batch, 1)
    train_steps(restored, batch, 1)
    torch.testing.assert_close(
        asyncio.run(restored.get_logprobs(batch)),
        asyncio.run(original.get_logprobs(batch)),
        atol=1e-6,
        rtol=0,
    )


def test_checkpoint_errors_name_the_file(model_dir: Path, tmp_path: Path) -> None:
    worker = make_worker(model_dir)
    asyncio.run(worker.save_checkpoint(tmp_path / "ckpt", save_optimizer=False))
    with pytest.raises(CheckpointError, match=r"optimizer\.pt"):
        asyncio.run(worker.load_checkpoint(tmp_path / "ckpt", load_optimizer=True))
    asyncio.run(worker.load_checkpoint(tmp_path / "ckpt", load_optimizer=False))

    asyncio.run(worker.save_checkpoint(tmp_path / "full", save_optimizer=True))
    (tmp_path / "full" / "optimizer.pt").write_bytes(b"not a torch file")
    with pytest.raises(CheckpointError, match=r"optimizer\.pt"):
        asyncio.run(worker.load_checkpoint(tmp_path / "full", load_optimizer=True))
    (tmp_path / "full" / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        asyncio.run(worker.load_checkpoint(tmp_path / "full", load_optimizer=False))
    (tmp_path / "full" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        asyncio.run(worker.load_checkpoint(tmp_path / "full", load_optimizer=False))
    with pytest.raises(CheckpointError, match="does not exist"):
        asyncio.run(worker.load_checkpoint(tmp_path / "nowhere", load_optimizer=False))


def test_all_masked_step_raises_and_does_not_step(model_dir: Path) -> None:
    worker = make_worker(model_dir)
    batch = make_batch(worker)
    batch["sample_mask"] = torch.zeros_like(batch["sample_mask"])

    async def run() -> None:
        await worker.begin_train_step()
        with pytest.raises(AllMaskedStepError):
            await worker.train_microbatches(batch, step_num_sequences=6, step_num_tokens=0)
        with pytest.raises(AllMaskedStepError):
            await worker.finish_train_step()
        # Streaming (no token count up front): the empty step is refused at finish.
        await worker.begin_train_step()
        await worker.train_microbatches(batch, step_num_sequences=6)
        with pytest.raises(AllMaskedStepError, match="refusing"):
            await worker.finish_train_step()

    asyncio.run(run())
    assert worker.optimizer_steps == 0


def test_split_api_misuse_is_refused(model_dir: Path) -> None:
    worker = make_worker(model_dir)
    batch = make_batch(worker)
    tokens = count_loss_tokens(batch)

    async def run() -> None:
        with pytest.raises(TrainStepError, match="begin_train_step"):
            await worker.train_microbatches(batch, step_num_sequences=6)
        await worker.begin_train_step()
        await worker.train_microbatches(batch, step_num_sequences=6)
        with pytest.raises(TrainStepError, match="or to none"):
            await worker.train_microbatches(batch, step_num_sequences=6, step_num_tokens=tokens)
        with pytest.raises(TrainStepError, match="step_num_sequences changed"):
            await worker.train_microbatches(batch, step_num_sequences=7)
        await worker.finish_train_step()
        # The declared count must match what the chunks held.
        await worker.begin_train_step()
        await worker.train_microbatches(batch, step_num_sequences=6, step_num_tokens=tokens + 5)
        with pytest.raises(TrainStepError, match="wrong count"):
            await worker.finish_train_step()

    asyncio.run(run())
    assert worker.optimizer_steps == 1


def test_offload_transitions_and_warmup_lr(model_dir: Path) -> None:
    worker = make_worker(
        model_dir,
        offload_optimizer_for_logprob=True,
        scheduler=SchedulerConfig(name="linear_warmup", warmup_steps=4),
        dtensor_cfg={"activation_checkpointing": True},
    )
    assert worker.model.is_gradient_checkpointing
    batch = make_batch(worker)
    assert worker.optimizer_location == "cpu"

    async def run() -> list[float]:
        lrs = []
        for _ in range(2):
            batch["prev_logprobs"] = await worker.get_logprobs(batch)
            await worker.begin_train_step()
            await worker.train_microbatches(batch, step_num_sequences=6)
            assert worker.optimizer_location == "cpu"
            lrs.append((await worker.finish_train_step())["lr"])
            assert worker.optimizer_location == "device"
        return lrs

    lrs = asyncio.run(run())
    lr = worker.cfg.optimizer.lr
    assert lrs == pytest.approx([lr / 4, lr / 2])
    assert worker.state()["optimizer_transitions"] == ["offload", "reload", "offload", "reload"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_bf16_fused_offload_and_checkpoint(model_dir: Path, tmp_path: Path) -> None:
    worker = make_worker(model_dir, device="cuda", offload_optimizer_for_logprob=True)
    assert worker.autocast_dtype == torch.bfloat16
    assert worker.optimizer.defaults["fused"]
    batch = make_batch(num=6, seed=4)

    def state_devices() -> set[str]:
        return {
            value.device.type
            for state in worker.optimizer.state.values()
            for key, value in state.items()
            if key != "step"
        }

    async def step() -> dict[str, float]:
        batch["prev_logprobs"] = await worker.get_logprobs(batch)
        await worker.begin_train_step()
        await worker.train_microbatches(batch, step_num_sequences=6)
        if worker.optimizer.state:
            assert state_devices() == {"cpu"}
        metrics = await worker.finish_train_step()
        assert state_devices() == {"cuda"}
        return metrics

    for _ in range(3):
        metrics = asyncio.run(step())
    assert worker.optimizer_steps == 3 and metrics["grad_norm"] > 0
    assert worker.state()["optimizer_transitions"] == ["offload", "reload"] * 3
    assert all(p.dtype == torch.float32 for p in worker.model.parameters())
    logprobs = asyncio.run(worker.get_logprobs(batch))
    assert logprobs.device.type == "cpu" and torch.isfinite(logprobs).all()

    asyncio.run(worker.save_checkpoint(tmp_path / "policy", save_optimizer=True))
    restored = make_worker(model_dir, device="cuda")
    asyncio.run(restored.load_checkpoint(tmp_path / "policy", load_optimizer=True))
    torch.testing.assert_close(asyncio.run(restored.get_logprobs(batch)), logprobs)
    restored_state = restored.optimizer.state[next(iter(restored.model.parameters()))]
    assert restored_state["exp_avg"].device.type == "cuda"
    weights = asyncio.run(worker.export_weights())
    assert all(t.device.type == "cpu" for t in weights.values())


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
        ),
    ],
)
def test_reference_policy_stays_frozen_at_the_initial_weights(
    model_dir: Path, tmp_path, device: str
) -> None:
    """With a KL penalty the worker keeps the initial weights as the reference: its logprobs
    equal the policy's before training, stay put while the policy moves, and survive a
    checkpoint reload of the policy; the step reports the KL to it."""
    loss_cfg = LossConfig(reference_policy_kl_penalty=0.05)
    worker = make_worker(model_dir, loss_cfg=loss_cfg, device=device)
    batch = make_batch(worker)

    async def run() -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        initial = await worker.get_reference_logprobs(batch)
        torch.testing.assert_close(initial, batch["prev_logprobs"], atol=1e-6, rtol=0)
        metrics: dict[str, float] = {}
        for _ in range(3):
            batch["prev_logprobs"] = await worker.get_logprobs(batch)
            batch["reference_logprobs"] = await worker.get_reference_logprobs(batch)
            await worker.begin_train_step()
            await worker.train_microbatches(batch, step_num_sequences=6)
            metrics = await worker.finish_train_step()
        await worker.save_checkpoint(tmp_path / "policy", save_optimizer=False)
        await worker.load_checkpoint(tmp_path / "policy", load_optimizer=False)
        return initial, await worker.get_reference_logprobs(batch), metrics

    initial, after, metrics = asyncio.run(run())
    torch.testing.assert_close(after, initial, atol=0, rtol=0)
    moved = asyncio.run(worker.get_logprobs(batch))
    assert not torch.allclose(moved, initial, atol=1e-3)
    assert metrics["kl_reference"] > 0
    assert not any(p.requires_grad for p in worker.reference_model.parameters())
    with pytest.raises(ValueError, match="reference_policy_kl_penalty"):
        asyncio.run(make_worker(model_dir, device=device).get_reference_logprobs(batch))
