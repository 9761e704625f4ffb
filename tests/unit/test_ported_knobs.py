"""Knobs added so that NeMo-RL settings keep their meaning: LinearLR warm-up, untruncated IS."""

from __future__ import annotations

import pytest
import torch

from tandemrl.config.models import LossConfig, SchedulerConfig
from tandemrl.training.losses import importance_weights
from tandemrl.training.worker_common import WarmupFactor, build_scheduler


def test_linear_warmup_with_a_start_factor_follows_torch_linear_lr():
    params = [torch.nn.Parameter(torch.zeros(1))]
    ours = build_scheduler(
        torch.optim.SGD(params, lr=1.0),
        SchedulerConfig(name="linear_warmup", warmup_steps=4, start_factor=0.1),
    )
    theirs_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = torch.optim.lr_scheduler.LinearLR(
        theirs_optimizer, start_factor=0.1, end_factor=1.0, total_iters=4
    )
    for _ in range(7):
        assert ours.get_last_lr()[0] == pytest.approx(theirs.get_last_lr()[0])
        ours.optimizer.step()
        theirs_optimizer.step()
        ours.step()
        theirs.step()


def test_linear_warmup_without_a_start_factor_is_unchanged():
    assert [WarmupFactor(4)(step) for step in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]


def test_untruncated_importance_weights_are_the_raw_ratios():
    prev = torch.tensor([[0.0, -1.0, -2.0]])
    generation = torch.tensor([[-3.0, -1.0, 0.0]])
    mask = torch.ones(1, 3)
    cfg = LossConfig(
        use_importance_sampling_correction=True, importance_sampling={"mode": "untruncated"}
    )
    weights, raw = importance_weights(prev, generation, mask, cfg)
    assert torch.allclose(weights, torch.exp(prev - generation))
    assert weights.max() > 2.0  # tis would have cut it at the default truncation
    assert torch.equal(weights, raw)
