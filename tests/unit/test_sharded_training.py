"""The sharded trainer (FSDP2 over gloo, CPU) takes the very step of one process.

Data-parallel 2 and 3 against the unsharded ``PolicyWorker`` / ``ValueWorker`` on the same
batch, split across the ranks by tokens as ``ShardedTrainer`` splits it (uneven tokens and
micro-batch counts per rank; at 3 ranks one chunk leaves a rank without rows): equal logprobs,
loss, gradients before clipping, grad norm, and parameters after one step with the token count
given up front and one streamed step with clipping, and a streamed sequence-mean step that
declares more rows than it holds (a dropped prompt) against the exact one. Tolerance: 1e-6 absolute on logprobs,
gradients and parameters (float32 summation order is all that differs), 1e-6 relative on the
loss and the grad norm.

The same steps with `policy.dtensor_cfg.reshard_after_forward: false` (the gathered weights kept
through the backward) at 2 ranks.

Checkpoints: a DCP checkpoint saved at 2 ranks restores at 3 ranks and in one unsharded
process with bit-exact parameters and optimizer state; one missing a shard file is refused
naming the file, and nothing of it is loaded.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from sharded_ranks import run_phases
from transformers import Qwen2Config, Qwen2ForCausalLM

from tandemrl.config.models import (
    LossConfig,
    OptimizerConfig,
    PolicyConfig,
    ValueConfig,
    ValueLossConfig,
)
from tandemrl.dataplane.rows import make_training_row
from tandemrl.training.batch import collate_rows, count_loss_tokens
from tandemrl.training.policy_worker import PolicyWorker
from tandemrl.training.trainer_group import (
    merge_metrics,
    row_tokens,
    split_rows_by_tokens,
    take_rows,
)
from tandemrl.training.value_worker import ValueWorker
from tandemrl.training.worker_common import CheckpointError

VOCAB = 16
ATOL = 1e-6
RTOL = 1e-6
MAX_GRAD_NORM = 0.05  # below the streamed step's norm: clipping is active


def build_model(folder: Path) -> Path:
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


def make_batch(num: int, seed: int) -> dict[str, torch.Tensor]:
    """Rows of uneven lengths (prompt 2-6, completion 2-7 tokens)."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(num):
        prompt = torch.randint(3, VOCAB, (2 + (i * 3) % 5,), generator=gen)
        completion = torch.randint(3, VOCAB, (2 + (i * 5) % 6,), generator=gen)
        logprobs = -torch.rand(completion.numel(), generator=gen) - 1.0
        row = make_training_row(prompt, completion, logprobs, reward=float(i % 2), sample_mask=1.0)
        row["advantages"] = torch.tensor(1.0 if i % 3 else -0.5)
        row["values"] = torch.rand(prompt.numel() + completion.numel(), generator=gen)
        row["returns"] = torch.rand(prompt.numel() + completion.numel(), generator=gen)
        rows.append(row)
    return collate_rows(rows, pad_token_id=0)


def policy_cfg(model_dir: Path) -> PolicyConfig:
    return PolicyConfig(
        model_name=str(model_dir),
        device="cpu",
        train_micro_batch_size=2,
        max_grad_norm=MAX_GRAD_NORM,
    )


def eps_policy_cfg(model_dir: Path) -> PolicyConfig:
    """Adam's first step with the default eps is about lr x sign(g): sharp on near-zero
    gradients, where float summation order alone flips a sign. A large eps keeps the update
    proportional to g, so the parameters compare to 1e-6."""
    return policy_cfg(model_dir).model_copy(update={"optimizer": OptimizerConfig(eps=1e-3)})


def value_cfg(model_dir: Path) -> ValueConfig:
    return ValueConfig(model_name=str(model_dir), train_micro_batch_size=2, max_grad_norm=None)


LOSS = LossConfig(entropy_coef=0.01)
SEQUENCE_MEAN = LossConfig(entropy_coef=0.01, token_level_loss=False)
# A streamed step that a dropped prompt left short declares the step as planned: more rows
# than its chunks hold.
DROPPED_ROWS = 3
VALUE_LOSS = ValueLossConfig()


def rank_share(batch: dict[str, torch.Tensor], rank: int, world_size: int) -> Any:
    return take_rows(batch, split_rows_by_tokens(row_tokens(batch), world_size)[rank])


# ---------------------------------------------------------------------------- on the ranks


def _full(tensor: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (tensor.full_tensor() if isinstance(tensor, DTensor) else tensor).detach().clone()


def _gather_metrics(metrics: dict[str, float], *, mean_loss: bool) -> dict[str, float]:
    import torch.distributed as dist

    rows: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(rows, metrics)
    return merge_metrics(rows, mean_loss=mean_loss)


def _policy_steps(worker: Any, chunks: list, streamed: dict, rank: int, world: int) -> dict:
    """What both the sharded ranks and the reference report (the reference: rank 0 of 1)."""
    sharded = world > 1
    share = (lambda b: rank_share(b, rank, world)) if sharded else (lambda b: b)
    out: dict[str, Any] = {}
    first = chunks[0]
    out["logprobs_rows"] = split_rows_by_tokens(row_tokens(first), world)[rank] if sharded else None
    out["logprobs"] = worker._get_logprobs(share(first))
    # step 1: the step's token count given up front, two chunks
    total = sum(count_loss_tokens(chunk) for chunk in chunks)
    size = sum(chunk["input_ids"].shape[0] for chunk in chunks)
    worker._begin_train_step()
    chunk_metrics = [worker._train_microbatches(share(c), size, total) for c in chunks]
    if sharded:
        chunk_metrics = [_gather_metrics(m, mean_loss=True) for m in chunk_metrics]
    out["chunk_loss"] = [m["loss"] for m in chunk_metrics]
    out["grads"] = {n: _full(p.grad) for n, p in worker.model.named_parameters()}
    finish = worker._finish_train_step()
    out["step1"] = _gather_metrics(finish, mean_loss=False) if sharded else finish
    # step 2: streamed (token count unknown until finish), clipped
    worker._begin_train_step()
    worker._train_microbatches(share(streamed), streamed["input_ids"].shape[0], None)
    finish = worker._finish_train_step()
    out["step2"] = _gather_metrics(finish, mean_loss=False) if sharded else finish
    out["params"] = {n: _full(p) for n, p in worker.model.named_parameters()}
    return out


def _short_sequence_mean_step(worker: Any, batch: dict, rank: int, world: int) -> dict:
    """One streamed sequence-mean step of ``batch``; on the ranks it declares the step as
    planned (``DROPPED_ROWS`` more rows than it holds), in the reference the exact counts."""
    rows = batch["input_ids"].shape[0]
    worker._begin_train_step()
    if world > 1:
        worker._train_microbatches(rank_share(batch, rank, world), rows + DROPPED_ROWS, None)
    else:
        worker._train_microbatches(batch, rows, count_loss_tokens(batch))
    finish = worker._finish_train_step()
    return {
        "finish": _gather_metrics(finish, mean_loss=False) if world > 1 else finish,
        "params": {n: _full(p) for n, p in worker.model.named_parameters()},
    }


def _value_step(worker: Any, batch: dict, rank: int, world: int, sharded: bool) -> dict:
    share = rank_share(batch, rank, world) if sharded else batch
    out: dict[str, Any] = {"values": worker._get_values(share)}
    worker._begin_train_step()
    worker._train_microbatches(share, batch["input_ids"].shape[0], count_loss_tokens(batch))
    out["grads"] = {n: _full(p.grad) for n, p in worker.critic.named_parameters()}
    finish = worker._finish_train_step()
    out["finish"] = _gather_metrics(finish, mean_loss=False) if sharded else finish
    out["params"] = {n: _full(p) for n, p in worker.critic.named_parameters()}
    return out


def _optimizer_full(worker: Any) -> dict[str, torch.Tensor]:
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state = get_optimizer_state_dict(worker.forward_module, worker.optimizer)["state"]
    return {
        f"{name}.{key}": _full(value)
        for name, entry in state.items()
        for key, value in entry.items()
        if torch.is_tensor(value)
    }


def _on_rank(rank: int, world: int, model_dir: Path, chunks, streamed, value_batch, ckpt) -> dict:
    from tandemrl.training.sharded_workers import ShardedPolicyWorker, ShardedValueWorker

    policy = ShardedPolicyWorker(policy_cfg(model_dir), LOSS, seed=0)
    out = {"policy": _policy_steps(policy, chunks, streamed, rank, world)}
    if world == 2:
        short = ShardedPolicyWorker(eps_policy_cfg(model_dir), SEQUENCE_MEAN, seed=0)
        out["sequence_mean"] = _short_sequence_mean_step(short, streamed, rank, world)
        policy._save_checkpoint(ckpt, True)
        out["saved_optimizer"] = _optimizer_full(policy)
        critic = ShardedValueWorker(value_cfg(model_dir), VALUE_LOSS, seed=0, device="cpu")
        out["value"] = _value_step(critic, value_batch, rank, world, sharded=True)
    else:
        restored = ShardedPolicyWorker(policy_cfg(model_dir), LOSS, seed=0)
        restored._load_checkpoint(ckpt, True)
        out["restored_params"] = {n: _full(p) for n, p in restored.model.named_parameters()}
        out["restored_optimizer"] = _optimizer_full(restored)
        out["restored_steps"] = restored.optimizer_steps
    return out


def _on_rank_keeping_gathered_weights(
    rank: int, world: int, model_dir: Path, chunks, streamed, value_batch, ckpt
) -> dict:
    """The policy steps with ``policy.dtensor_cfg.reshard_after_forward: false``."""
    from tandemrl.training.sharded_workers import ShardedPolicyWorker

    cfg = policy_cfg(model_dir)
    cfg = cfg.model_copy(
        update={"dtensor_cfg": cfg.dtensor_cfg.model_copy(update={"reshard_after_forward": False})}
    )
    policy = ShardedPolicyWorker(cfg, LOSS, seed=0)
    return {"policy": _policy_steps(policy, chunks, streamed, rank, world)}


# ---------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sharded")
    model_dir = build_model(root / "model")
    batch = make_batch(7, seed=1)
    # chunk 2 holds 2 rows: at 3 ranks one rank has none
    chunks = [take_rows(batch, list(range(5))), take_rows(batch, [5, 6])]
    streamed = make_batch(6, seed=2)
    value_batch = make_batch(5, seed=3)
    reference = PolicyWorker(policy_cfg(model_dir), LOSS, seed=0)
    for chunk in [*chunks, streamed]:
        chunk["prev_logprobs"] = reference._get_logprobs(chunk)
    ckpt = root / "ckpt_dp2"
    one = {"policy": _policy_steps(reference, chunks, streamed, 0, 1)}
    sequence_mean = PolicyWorker(eps_policy_cfg(model_dir), SEQUENCE_MEAN, seed=0)
    one["sequence_mean"] = _short_sequence_mean_step(sequence_mean, streamed, 0, 1)
    reference_value = ValueWorker(value_cfg(model_dir), VALUE_LOSS, seed=0, device="cpu")
    one["value"] = _value_step(reference_value, value_batch, 0, 1, sharded=False)
    args = (model_dir, chunks, streamed, value_batch, ckpt)
    dp2, dp3, keep = run_phases(
        [(2, _on_rank), (3, _on_rank), (2, _on_rank_keeping_gathered_weights)], *args
    )
    return {
        "one": one,
        2: dp2,
        3: dp3,
        "keep": keep,
        "ckpt": ckpt,
        "model_dir": model_dir,
        "root": root,
    }


def assert_close_dicts(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=ATOL, rtol=0, msg=f"{what} {name}")


@pytest.mark.parametrize("world", [2, 3])
def test_a_sharded_step_equals_the_one_process_step(runs: dict, world: int) -> None:
    one = runs["one"]["policy"]
    ranks = [result["policy"] for result in runs[world]]
    first_chunk = runs["one"]["policy"]["logprobs"]
    for result in ranks:  # each rank's logprobs are those of its rows
        if result["logprobs"] is not None:
            rows = result["logprobs_rows"]
            torch.testing.assert_close(result["logprobs"], first_chunk[rows], atol=ATOL, rtol=0)
    sharded = ranks[0]
    assert sharded["chunk_loss"] == pytest.approx(one["chunk_loss"], rel=RTOL)
    assert_close_dicts(sharded["grads"], one["grads"], "gradient")
    for step in ("step1", "step2"):
        for key in ("loss", "grad_norm", "num_tokens", "entropy"):
            assert sharded[step][key] == pytest.approx(one[step][key], rel=RTOL), (step, key)
        assert sharded[step]["optimizer_steps"] == one[step]["optimizer_steps"]
    assert one["step2"]["grad_norm"] > MAX_GRAD_NORM  # the streamed step was clipped
    assert one["step2"]["optimizer_steps"] == 2.0  # exactly one optimizer step per RL step
    for result in ranks:  # every rank holds the same model
        assert_close_dicts(result["params"], one["params"], "parameter")


def test_a_sharded_sequence_mean_step_left_short_by_a_drop_divides_by_its_rows(
    runs: dict,
) -> None:
    """The ranks sum the rows they trained: the provisional count is corrected to the step's
    rows over every rank, as one process with the exact counts."""
    one = runs["one"]["sequence_mean"]
    for result in runs[2]:
        sharded = result["sequence_mean"]
        for key in ("loss", "grad_norm", "num_tokens"):
            assert sharded["finish"][key] == pytest.approx(one["finish"][key], rel=RTOL), key
        assert_close_dicts(sharded["params"], one["params"], "parameter")


def test_the_ranks_trained_uneven_shares() -> None:
    batch = make_batch(7, seed=1)
    shares = split_rows_by_tokens(row_tokens(batch), 3)
    tokens = [sum(row_tokens(batch)[i] for i in share) for share in shares]
    assert sorted(i for share in shares for i in share) == list(range(7))
    assert len(set(tokens)) > 1 and max(tokens) - min(tokens) <= max(row_tokens(batch))
    assert [len(s) for s in split_rows_by_tokens(row_tokens(take_rows(batch, [5, 6])), 3)].count(
        0
    ) == 1


def test_a_sharded_critic_step_equals_the_one_process_step(runs: dict) -> None:
    one = runs["one"]["value"]
    for rank, result in enumerate(runs[2]):
        sharded = result["value"]
        rows = split_rows_by_tokens(row_tokens(make_batch(5, seed=3)), 2)[rank]
        torch.testing.assert_close(sharded["values"], one["values"][rows], atol=ATOL, rtol=0)
        assert_close_dicts(sharded["params"], one["params"], "critic parameter")
    sharded = runs[2][0]["value"]
    assert_close_dicts(sharded["grads"], one["grads"], "critic gradient")
    assert sharded["finish"]["value_loss"] == pytest.approx(one["finish"]["value_loss"], rel=RTOL)
    assert sharded["finish"]["grad_norm"] == pytest.approx(one["finish"]["grad_norm"], rel=RTOL)


def test_a_checkpoint_saved_at_two_ranks_restores_bit_exact_at_three(runs: dict) -> None:
    saved = runs[2][0]
    for result in runs[3]:
        assert result["restored_steps"] == 2
        for name, value in saved["policy"]["params"].items():
            assert torch.equal(result["restored_params"][name], value), name
        assert result["restored_optimizer"].keys() == saved["saved_optimizer"].keys()
        for name, value in saved["saved_optimizer"].items():
            assert torch.equal(result["restored_optimizer"][name], value), name


def test_a_checkpoint_saved_at_two_ranks_restores_bit_exact_in_one_process(runs: dict) -> None:
    worker = PolicyWorker(policy_cfg(runs["model_dir"]), LOSS, seed=0)
    asyncio.run(worker.load_checkpoint(runs["ckpt"], load_optimizer=True))
    saved = runs[2][0]
    for name, param in worker.model.named_parameters():
        assert torch.equal(param.detach(), saved["policy"]["params"][name]), name
    for name, value in _optimizer_full(worker).items():
        assert torch.equal(value, saved["saved_optimizer"][name]), name
    assert worker.optimizer_steps == 2
    # and it trains on from there like the run that saved it
    assert worker.state()["lr"] == saved["policy"]["step2"]["lr"]


def test_a_checkpoint_missing_a_shard_is_refused_naming_the_file(runs: dict) -> None:
    damaged = runs["root"] / "ckpt_missing_shard"
    shutil.copytree(runs["ckpt"], damaged)
    (damaged / "dcp" / "__1_0.distcp").unlink()
    worker = PolicyWorker(policy_cfg(runs["model_dir"]), LOSS, seed=0)
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    with pytest.raises(CheckpointError, match=r"__1_0\.distcp is missing"):
        asyncio.run(worker.load_checkpoint(damaged, load_optimizer=True))
    for name, param in worker.model.named_parameters():  # nothing of it was loaded
        assert torch.equal(param.detach(), before[name]), name
    assert worker.optimizer_steps == 0


def test_keeping_the_gathered_weights_through_the_backward_takes_the_same_steps(runs: dict) -> None:
    want = runs["one"]["policy"]
    for rank, out in enumerate(runs["keep"]):
        got = out["policy"]
        assert_close_dicts(got["grads"], want["grads"], f"rank {rank} grads")
        assert_close_dicts(got["params"], want["params"], f"rank {rank} params after 2 steps")
