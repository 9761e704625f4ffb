"""Advantage estimators: GRPO group baselines and GAE, plus masked whitening.

- ``grpo_advantages``: one prompt group's rewards [G] → one advantage per generation.
  Baseline = mean of the group (or, leave-one-out, the mean of the *other* G-1 rewards);
  ``normalize`` divides by the group's standard deviation. A group whose rewards are all
  equal carries no signal and gets advantage 0 for every member.
- ``gae``: generalized advantage estimation over the generated positions of each sequence
  (the prompt is not part of the episode). Entry t of ``values`` estimates the return from
  token t on; the recursion runs backwards over generated positions only, skipping prompt
  and padding, and bootstraps with 0 after the last generated token:
  ``delta_t = r_t + gamma * V_next - V_t``, ``A_t = delta_t + gamma * lam * A_next``,
  ``returns_t = A_t + V_t``.
- ``whiten``: (x - masked mean) / masked std over the masked positions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def grpo_advantages(
    rewards: torch.Tensor,
    *,
    leave_one_out: bool,
    normalize: bool,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[G] advantages of one prompt group's [G] rewards (see the module docstring).

    The standard deviation is the unbiased std of the whole group; a group of one, or one
    whose std is below ``eps``, gets zeros.
    """
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D [G], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    group_size = rewards.numel()
    if group_size < 2:
        return torch.zeros_like(rewards)
    std = rewards.std()
    if std.item() < eps:
        return torch.zeros_like(rewards)
    if leave_one_out:
        baseline = (rewards.sum() - rewards) / (group_size - 1)
    else:
        baseline = rewards.mean().expand_as(rewards)
    advantages = rewards - baseline
    if normalize:
        advantages = advantages / (std + eps)
    return advantages


def has_zero_advantage(rewards: Sequence[float], *, eps: float = 1e-6) -> bool:
    """True when ``grpo_advantages`` gives every member of the group 0: fewer than two
    members, or an unbiased standard deviation below ``eps`` (all rewards equal). Such a
    group carries no policy-gradient signal (DAPO's dynamic sampling drops it)."""
    count = len(rewards)
    if count < 2:
        return True
    mean = sum(rewards) / count
    variance = sum((reward - mean) ** 2 for reward in rewards) / (count - 1)
    return math.sqrt(variance) < eps


def grpo_advantages_by_group(
    rewards: torch.Tensor,
    group_index: torch.Tensor,
    *,
    leave_one_out: bool,
    normalize: bool,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[N] advantages of [N] rewards where ``group_index[i]`` names row i's prompt group."""
    if rewards.shape != group_index.shape or rewards.dim() != 1:
        raise ValueError(
            f"rewards {tuple(rewards.shape)} and group_index {tuple(group_index.shape)} "
            "must be 1-D of the same length"
        )
    advantages = torch.zeros_like(rewards, dtype=torch.float32)
    for group in torch.unique(group_index):
        members = group_index == group
        advantages[members] = grpo_advantages(
            rewards[members], leave_one_out=leave_one_out, normalize=normalize, eps=eps
        )
    return advantages


def grpo_advantages_grouped(
    rewards: torch.Tensor,
    *,
    leave_one_out: bool,
    normalize: bool,
    eps: float = 1e-6,
) -> torch.Tensor:
    """[K, G] advantages of K equal-sized groups at once; row k equals ``grpo_advantages(rewards[k])``."""
    if rewards.dim() != 2:
        raise ValueError(f"rewards must be 2-D [K, G], got shape {tuple(rewards.shape)}")
    rewards = rewards.to(torch.float32)
    group_size = rewards.shape[1]
    if group_size < 2:
        return torch.zeros_like(rewards)
    std = rewards.std(dim=1, keepdim=True)
    if leave_one_out:
        baseline = (rewards.sum(dim=1, keepdim=True) - rewards) / (group_size - 1)
    else:
        baseline = rewards.mean(dim=1, keepdim=True)
    advantages = rewards - baseline
    if normalize:
        advantages = advantages / (std + eps)
    return torch.where(std < eps, torch.zeros_like(advantages), advantages)


def broadcast_sequence_values(per_sequence: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[B] values → [B, L]: each sequence's value at its generated positions, 0 elsewhere."""
    return per_sequence.to(torch.float32)[:, None] * token_mask.to(torch.float32)


def sequence_rewards_to_tokens(rewards: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """[B] sequence rewards → [B, L] with each reward on its sequence's last generated token.

    A sequence without generated tokens gets no reward position (all zeros).
    """
    mask = token_mask > 0
    length = mask.shape[1]
    positions = torch.arange(length, device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, torch.full_like(positions, -1)).max(dim=1).values
    out = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device)
    has_tokens = last >= 0
    rows = torch.nonzero(has_tokens).squeeze(1)
    out[rows, last[rows]] = rewards.to(torch.float32)[rows]
    return out


def gae(
    rewards_per_token: torch.Tensor,
    values: torch.Tensor,
    token_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(advantages, returns), both [B, L] and 0 outside ``token_mask`` (see module docstring).

    Rewards at positions outside ``token_mask`` are ignored; put a sequence-level reward on
    the last generated token (``sequence_rewards_to_tokens``).
    """
    if not (rewards_per_token.shape == values.shape == token_mask.shape):
        raise ValueError(
            f"rewards {tuple(rewards_per_token.shape)}, values {tuple(values.shape)} and "
            f"token_mask {tuple(token_mask.shape)} must all be [B, L]"
        )
    rewards_per_token = rewards_per_token.to(torch.float32)
    values = values.to(torch.float32)
    mask = token_mask > 0
    batch, length = mask.shape
    advantages = torch.zeros(batch, length, dtype=torch.float32, device=values.device)
    next_value = torch.zeros(batch, dtype=torch.float32, device=values.device)
    next_advantage = torch.zeros(batch, dtype=torch.float32, device=values.device)
    for t in range(length - 1, -1, -1):
        here = mask[:, t]
        delta = rewards_per_token[:, t] + gamma * next_value - values[:, t]
        advantage = delta + gamma * lam * next_advantage
        advantages[:, t] = torch.where(here, advantage, torch.zeros_like(advantage))
        # Prompt and padding positions are not steps of the episode: carry across them.
        next_value = torch.where(here, values[:, t], next_value)
        next_advantage = torch.where(here, advantage, next_advantage)
    returns = (advantages + values) * mask.to(torch.float32)
    return advantages, returns


def whiten(
    x: torch.Tensor, mask: torch.Tensor, *, shift_mean: bool = True, eps: float = 1e-8
) -> torch.Tensor:
    """Normalize ``x`` to unit variance (and zero mean if ``shift_mean``) over ``mask``.

    Positions outside the mask are returned as 0. Uses the biased (population) variance;
    fewer than two masked positions leave the values centred but unscaled.
    """
    return whiten_together([x], [mask], shift_mean=shift_mean, eps=eps)[0]


def whiten_together(
    xs: Sequence[torch.Tensor],
    masks: Sequence[torch.Tensor],
    *,
    shift_mean: bool = True,
    eps: float = 1e-8,
) -> list[torch.Tensor]:
    """``whiten`` with one mean and variance over the masked positions of every tensor (the
    chunks of one step, of different lengths): each result equals the matching slice of the
    whitened concatenation."""
    masks = [mask.to(torch.float32) for mask in masks]
    xs = [x.to(torch.float32) for x in xs]
    count = sum(mask.sum() for mask in masks)
    if float(count) == 0:
        raise ValueError("whiten: the mask selects no positions")
    mean = sum((x * mask).sum() for x, mask in zip(xs, masks, strict=True)) / count
    variance = (
        sum((((x - mean) * mask) ** 2).sum() for x, mask in zip(xs, masks, strict=True)) / count
    )
    out = []
    for x, mask in zip(xs, masks, strict=True):
        centred = x - mean
        scaled = centred if float(count) < 2 else centred * torch.rsqrt(variance + eps)
        if not shift_mean:
            scaled = scaled + mean
        out.append(scaled * mask)
    return out
