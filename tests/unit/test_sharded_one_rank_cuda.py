"""FSDP2 at one rank over NCCL takes the step of today's single-process trainer (CUDA only).

The sharded worker gathers bfloat16 parameters (``MixedPrecisionPolicy``) where the
single-process worker casts float32 parameters under bfloat16 autocast, so the two agree to
bfloat16 rounding, not bit for bit: logprobs within 5e-2, the loss within 2 % and the
parameters after one AdamW step within 2·lr + 1e-3 (an Adam step moves a weight by about lr).
Skips without CUDA.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandemrl.config.models import LossConfig, PolicyConfig
from tandemrl.training.batch import count_loss_tokens

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

LR = 3e-4


def build_model(folder: Path) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
    )
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(folder)
    return folder


def make_batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    rows, width = 6, 48
    lengths = [48, 40, 44, 30, 36, 48]
    input_ids = torch.zeros(rows, width, dtype=torch.long)
    attention = torch.zeros(rows, width, dtype=torch.long)
    for row, length in enumerate(lengths):
        input_ids[row, :length] = torch.randint(3, 128, (length,), generator=generator)
        attention[row, :length] = 1
    token_mask = attention.float()
    token_mask[:, :12] = 0
    return {
        "input_ids": input_ids,
        "attention_mask": attention,
        "token_mask": token_mask,
        "sample_mask": torch.ones(rows),
        "advantages": torch.randn(rows, 1, generator=generator).expand(rows, width).contiguous(),
        "generation_logprobs": -torch.rand(rows, width, generator=generator) * token_mask,
    }


def one_step(worker, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
    batch = dict(batch)
    logprobs = worker._get_logprobs(batch)
    batch["prev_logprobs"] = logprobs
    worker._begin_train_step()
    worker._train_microbatches(batch, batch["input_ids"].shape[0], count_loss_tokens(batch))
    return logprobs, worker._finish_train_step()


def test_one_fsdp2_rank_on_nccl_matches_the_single_process_trainer(tmp_path: Path) -> None:
    from torch.distributed.tensor import DTensor

    from tandemrl.training.policy_worker import PolicyWorker
    from tandemrl.training.rank_group import join_rank_group, leave_rank_group, open_rank_rendezvous
    from tandemrl.training.sharded_workers import ShardedPolicyWorker

    model_dir = build_model(tmp_path / "model")
    cfg = PolicyConfig(model_name=str(model_dir), device="cuda", train_micro_batch_size=2)
    cfg.optimizer.lr = LR
    batch = make_batch()
    single = PolicyWorker(cfg, LossConfig(), seed=0)
    single_logprobs, single_metrics = one_step(single, batch)
    single_params = {n: p.detach().float().cpu() for n, p in single.model.named_parameters()}

    store, address = open_rank_rendezvous(1, 60.0, "nccl")
    join_rank_group(address, 0, store=store, device=torch.device("cuda", 0))
    try:
        sharded = ShardedPolicyWorker(cfg, LossConfig(), seed=0)
        sharded_logprobs, sharded_metrics = one_step(sharded, batch)
        sharded_params = {
            n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().float().cpu()
            for n, p in sharded.model.named_parameters()
        }
        flat = sharded._export_weights_flat()
    finally:
        leave_rank_group()

    torch.testing.assert_close(sharded_logprobs, single_logprobs, atol=5e-2, rtol=0)
    assert sharded_metrics["loss"] == pytest.approx(single_metrics["loss"], rel=2e-2, abs=1e-3)
    assert sharded_metrics["optimizer_steps"] == single_metrics["optimizer_steps"] == 1.0
    for name, value in single_params.items():
        torch.testing.assert_close(sharded_params[name], value, atol=2 * LR + 1e-3, rtol=0)
    # the weights the generators get are the full float32 parameters
    assert flat is not None
    exported = flat.to_state_dict()
    for name, value in sharded_params.items():
        assert torch.equal(exported[name], value), name
