"""The distillation advantage through the policy loss, against a hand computation on a toy
vocabulary: its value estimates KL(student || teacher), its gradient is the reverse-KL
gradient, and stale samples get the importance weight of any other advantage."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.config.models import LossConfig
from tandemrl.training.distillation import distillation_advantages, reverse_kl_sums
from tandemrl.training.losses import policy_loss

VOCAB = 4
STUDENT_LOGITS = [0.3, -1.2, 0.8, 0.1]
TEACHER_PROBS = [0.1, 0.2, 0.6, 0.1]


def one_token_rows(
    student_logprob: torch.Tensor,
    teacher_logprob: float,
    *,
    generation_logprob: float | None = None,
    kl_coef: float = 1.0,
    log_ratio_clamp: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A batch of one row: a prompt token, then the sampled token (position 1)."""
    curr = torch.stack([torch.zeros(()), student_logprob]).unsqueeze(0)
    prev = curr.detach()
    token_mask = torch.tensor([[0.0, 1.0]])
    teacher = torch.tensor([[0.0, teacher_logprob]])
    batch = {
        "token_mask": token_mask,
        "sample_mask": torch.ones(1),
        "prev_logprobs": prev,
        "generation_logprobs": prev
        if generation_logprob is None
        else torch.tensor([[0.0, generation_logprob]]),
        "advantages": distillation_advantages(
            prev, teacher, token_mask, kl_coef=kl_coef, log_ratio_clamp=log_ratio_clamp
        ),
    }
    return curr, batch


def loss_gradient(token: int, cfg: LossConfig, **kw: float) -> torch.Tensor:
    """d(policy loss)/d(student logits) for one sampled ``token``."""
    logits = torch.tensor(STUDENT_LOGITS, requires_grad=True)
    logprobs = torch.log_softmax(logits, dim=-1)
    curr, batch = one_token_rows(logprobs[token], math.log(TEACHER_PROBS[token]), **kw)
    loss, _ = policy_loss(curr, batch, cfg)
    (grad,) = torch.autograd.grad(loss, logits)
    return grad


def test_advantage_is_minus_the_log_ratio_to_the_teacher_by_hand():
    prev = torch.tensor([[0.0, math.log(0.5), math.log(0.25)]])
    teacher = torch.tensor([[0.0, math.log(0.25), math.log(0.5)]])
    mask = torch.tensor([[0.0, 1.0, 1.0]])
    advantages = distillation_advantages(prev, teacher, mask, kl_coef=2.0, log_ratio_clamp=None)
    # log 0.5 - log 0.25 = log 2: the student is too sure of token 1, not sure enough of token 2
    expected = torch.tensor([[0.0, -2 * math.log(2), 2 * math.log(2)]])
    assert torch.allclose(advantages, expected)
    clamped = distillation_advantages(prev, teacher, mask, kl_coef=1.0, log_ratio_clamp=0.5)
    assert torch.allclose(clamped, torch.tensor([[0.0, -0.5, 0.5]]))
    mixed = distillation_advantages(
        prev,
        teacher,
        mask,
        kl_coef=1.0,
        log_ratio_clamp=None,
        reward_advantages=torch.tensor([[0.0, 1.0, 1.0]]),
        reward_coef=0.5,
    )
    assert torch.allclose(mixed, torch.tensor([[0.0, 0.5 - math.log(2), 0.5 + math.log(2)]]))


def test_expected_log_ratio_is_the_exact_reverse_kl():
    p = torch.softmax(torch.tensor(STUDENT_LOGITS), dim=-1)
    q = torch.tensor(TEACHER_PROBS)
    exact = float((p * (p.log() - q.log())).sum())  # KL(p || q) by hand
    estimates = []
    for token in range(VOCAB):
        prev = torch.tensor([[0.0, float(p[token].log())]])
        teacher = torch.tensor([[0.0, math.log(TEACHER_PROBS[token])]])
        gap, count = reverse_kl_sums(prev, teacher, torch.tensor([[0.0, 1.0]]))
        assert count.item() == 1
        estimates.append(float(gap))
    expected = sum(float(p[t]) * estimates[t] for t in range(VOCAB))
    assert expected == pytest.approx(exact, rel=1e-6)
    assert exact > 0.1  # a real gap, so the check means something


def test_gradient_of_one_sample_and_its_expectation_match_the_reverse_kl_gradient():
    cfg = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.2)
    logits = torch.tensor(STUDENT_LOGITS)
    p = torch.softmax(logits, dim=-1)
    q = torch.tensor(TEACHER_PROBS)
    expectation = torch.zeros(VOCAB)
    for token in range(VOCAB):
        grad = loss_gradient(token, cfg, kl_coef=0.7)
        # by hand: -A * d log p_y / dz = 0.7 (log p_y - log q_y) (onehot_y - p)
        onehot = torch.nn.functional.one_hot(torch.tensor(token), VOCAB).float()
        by_hand = 0.7 * (p[token].log() - q[token].log()) * (onehot - p)
        assert torch.allclose(grad, by_hand, atol=1e-6), (token, grad, by_hand)
        expectation += p[token] * grad
    exact_logits = logits.clone().requires_grad_(True)
    student = torch.softmax(exact_logits, dim=-1)
    kl = (student * (student.log() - q.log())).sum()
    (kl_grad,) = torch.autograd.grad(0.7 * kl, exact_logits)
    assert torch.allclose(expectation, kl_grad, atol=1e-6), (expectation, kl_grad)
    # descending the loss moves the student toward the teacher
    stepped = torch.softmax(logits - 0.5 * expectation, dim=-1)
    assert float((stepped * (stepped.log() - q.log())).sum()) < float(kl.detach())


def test_a_stale_sample_gets_the_importance_weight_of_the_policy_loss():
    # generated under older weights with logprob gen: the gradient is scaled by
    # w = exp(prev - gen), truncated at importance_sampling.truncation (tis)
    cfg = LossConfig(use_importance_sampling_correction=True)
    token = 1
    fresh = loss_gradient(token, cfg)
    p1 = float(torch.softmax(torch.tensor(STUDENT_LOGITS), dim=-1)[token])
    for generation_p, weight in ((p1 / 1.5, 1.5), (p1 / 4.0, cfg.importance_sampling.truncation)):
        stale = loss_gradient(token, cfg, generation_logprob=math.log(generation_p))
        assert torch.allclose(stale, weight * fresh, atol=1e-6), (weight, stale, fresh)
    off = LossConfig(use_importance_sampling_correction=False)
    assert torch.allclose(
        loss_gradient(token, off, generation_logprob=math.log(p1 / 4.0)), loss_gradient(token, off)
    )
