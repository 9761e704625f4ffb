"""The on-policy distillation advantage: per-token reverse KL of the student to its teacher.

For a completion token y_t the student sampled, with the student's logprob s_t (the trainer's
``prev_logprobs``, before the step) and the teacher's logprob q_t:

    log_ratio_t = clamp(s_t - q_t, -log_ratio_clamp, log_ratio_clamp)
    A_t = -kl_coef * log_ratio_t  (+ reward_coef * the group advantage of the reward)

``A_t`` is a constant of the loss (like a GRPO advantage): it goes through the clipped policy
loss (``tandemrl.training.losses``), so the ratio clipping and the importance-sampling
correction of stale samples apply to it as to any advantage. Why it trains toward the teacher:
at the pre-step weights the loss gradient is ``-E_y[A_y * grad log p(y)] = kl_coef *
E_{y~p}[(log p(y) - log q(y)) * grad log p(y)] = kl_coef * grad KL(p || q)`` (the ``E[grad log
p] = 0`` term drops), so one sampled token is an unbiased estimate of the reverse-KL gradient
(``tests/unit/test_distillation_loss.py`` checks it exactly on a toy vocabulary). The mean of
``s_t - q_t`` over sampled tokens is likewise an unbiased estimate of KL(p || q) per token:
the ``reverse_kl`` metric.
"""

from __future__ import annotations

import torch


def distillation_advantages(
    prev_logprobs: torch.Tensor,
    teacher_logprobs: torch.Tensor,
    token_mask: torch.Tensor,
    *,
    kl_coef: float,
    log_ratio_clamp: float | None,
    reward_advantages: torch.Tensor | None = None,
    reward_coef: float = 0.0,
) -> torch.Tensor:
    """[B, L] advantages (0 off the completion) per the module docstring.

    ``prev_logprobs``, ``teacher_logprobs``, ``token_mask`` and ``reward_advantages`` (the
    reward's group advantage broadcast over the completion) are [B, L].
    """
    mask = token_mask.to(torch.float32)
    log_ratio = (prev_logprobs.float() - teacher_logprobs.float()) * mask
    if log_ratio_clamp is not None:
        log_ratio = log_ratio.clamp(-log_ratio_clamp, log_ratio_clamp)
    advantages = -kl_coef * log_ratio
    if reward_coef > 0:
        if reward_advantages is None:
            raise ValueError("reward_coef > 0 needs the reward advantages")
        advantages = advantages + reward_coef * reward_advantages.float()
    return advantages * mask


def reverse_kl_sums(
    prev_logprobs: torch.Tensor, teacher_logprobs: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: (sum over its valid tokens of s_t - q_t, its number of valid tokens); their
    ratio over a step is the per-token reverse-KL estimate (unclamped)."""
    mask = mask.to(torch.float32)
    gap = (prev_logprobs.float() - teacher_logprobs.float()) * mask
    return gap.sum(dim=1), mask.sum(dim=1)
