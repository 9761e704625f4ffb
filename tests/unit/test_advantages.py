"""GRPO group advantages, GAE against a hand-written reference, masked whitening."""

from __future__ import annotations

import pytest
import torch

from tandemrl.training.advantages import (
    gae,
    grpo_advantages,
    grpo_advantages_by_group,
    sequence_rewards_to_tokens,
    whiten,
)


def test_grpo_plain_baseline_is_group_mean() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.5, 0.5])
    adv = grpo_advantages(rewards, leave_one_out=False, normalize=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0]))


def test_grpo_leave_one_out_uses_mean_of_the_others() -> None:
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    adv = grpo_advantages(rewards, leave_one_out=True, normalize=False)
    expected = torch.tensor([1.0 - 0.5 / 3, 0.0 - 1.5 / 3, 0.0 - 1.5 / 3, 0.5 - 1.0 / 3])
    torch.testing.assert_close(adv, expected)


def test_grpo_normalize_divides_by_group_std() -> None:
    rewards = torch.tensor([3.0, 1.0, 2.0, 6.0])
    std = float(torch.tensor([3.0, 1.0, 2.0, 6.0]).std())
    adv = grpo_advantages(rewards, leave_one_out=False, normalize=True, eps=0.0)
    torch.testing.assert_close(adv, (rewards - 3.0) / std)
    loo = grpo_advantages(rewards, leave_one_out=True, normalize=True, eps=0.0)
    baseline = (rewards.sum() - rewards) / 3
    torch.testing.assert_close(loo, (rewards - baseline) / std)


@pytest.mark.parametrize("leave_one_out", [True, False])
@pytest.mark.parametrize("normalize", [True, False])
def test_grpo_equal_rewards_give_zero(leave_one_out: bool, normalize: bool) -> None:
    adv = grpo_advantages(torch.full((8,), 0.7), leave_one_out=leave_one_out, normalize=normalize)
    assert torch.equal(adv, torch.zeros(8))


def test_grpo_single_member_group_is_zero_and_shape_checked() -> None:
    assert torch.equal(
        grpo_advantages(torch.tensor([1.0]), leave_one_out=True, normalize=True),
        torch.zeros(1),
    )
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), leave_one_out=False, normalize=False)


def test_grpo_by_group_handles_each_group_separately() -> None:
    rewards = torch.tensor([1.0, 0.0, 5.0, 5.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2])
    adv = grpo_advantages_by_group(rewards, groups, leave_one_out=False, normalize=False)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.0, 0.0, -1.0, 1.0]))


def reference_gae(rewards, values, mask, gamma, lam):
    """Plain-Python GAE over the masked positions of each row."""
    out_adv, out_ret = [], []
    for r_row, v_row, m_row in zip(rewards, values, mask, strict=True):
        steps = [t for t, m in enumerate(m_row) if m]
        adv = [0.0] * len(r_row)
        ret = [0.0] * len(r_row)
        running = 0.0
        for k in reversed(range(len(steps))):
            t = steps[k]
            next_v = v_row[steps[k + 1]] if k + 1 < len(steps) else 0.0
            delta = r_row[t] + gamma * next_v - v_row[t]
            running = delta + gamma * lam * running
            adv[t] = running
            ret[t] = running + v_row[t]
        out_adv.append(adv)
        out_ret.append(ret)
    return torch.tensor(out_adv), torch.tensor(out_ret)


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 1.0), (1.0, 0.0), (0.9, 0.95), (0.8, 0.0)])
def test_gae_matches_reference(gamma: float, lam: float) -> None:
    # Row 0: 2 prompt tokens, 3 generated; row 1: 1 prompt, 2 generated, 2 padding;
    # row 2: generated positions with a hole (a masked-out tool token) in the middle.
    mask = torch.tensor([[0, 0, 1, 1, 1], [0, 1, 1, 0, 0], [0, 1, 0, 1, 1]], dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    values = torch.randn(3, 5, generator=gen)
    rewards = sequence_rewards_to_tokens(torch.tensor([1.0, -0.5, 2.0]), mask)
    assert rewards[0].tolist() == [0, 0, 0, 0, 1.0]
    assert rewards[1].tolist() == [0, 0, -0.5, 0, 0]
    adv, ret = gae(rewards, values, mask, gamma, lam)
    ref_adv, ref_ret = reference_gae(rewards.tolist(), values.tolist(), mask.tolist(), gamma, lam)
    torch.testing.assert_close(adv, ref_adv)
    torch.testing.assert_close(ret, ref_ret)
    assert torch.all(adv[mask == 0] == 0) and torch.all(ret[mask == 0] == 0)


def test_gae_hand_values_lambda_extremes() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    values = torch.tensor([[9.0, 0.5, 0.25, 0.75]])
    rewards = torch.tensor([[0.0, 0.0, 0.0, 1.0]])
    # lambda 1, gamma 1: advantage = total future reward - V_t (Monte-Carlo), return = 1.
    adv, ret = gae(rewards, values, mask, 1.0, 1.0)
    torch.testing.assert_close(adv, torch.tensor([[0.0, 0.5, 0.75, 0.25]]))
    torch.testing.assert_close(ret, torch.tensor([[0.0, 1.0, 1.0, 1.0]]))
    # lambda 0: one-step TD error r_t + gamma V_{t+1} - V_t, bootstrap 0 after the last token.
    adv, ret = gae(rewards, values, mask, 0.5, 0.0)
    torch.testing.assert_close(
        adv, torch.tensor([[0.0, 0.5 * 0.25 - 0.5, 0.5 * 0.75 - 0.25, 1.0 - 0.75]])
    )
    torch.testing.assert_close(ret, torch.tensor([[0.0, 0.125, 0.375, 1.0]]))


def test_gae_rejects_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="must all be"):
        gae(torch.zeros(2, 3), torch.zeros(2, 4), torch.zeros(2, 3), 1.0, 1.0)


def test_whiten_masked_statistics() -> None:
    x = torch.tensor([[1.0, 2.0, 100.0], [3.0, -50.0, 4.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 1.0]])
    out = whiten(x, mask)
    selected = out[mask == 1]
    assert abs(selected.mean().item()) < 1e-6
    assert abs(selected.var(unbiased=False).item() - 1.0) < 1e-4
    assert torch.all(out[mask == 0] == 0)
    kept_mean = whiten(x, mask, shift_mean=False)[mask == 1]
    assert abs(kept_mean.mean().item() - 2.5) < 1e-5
    with pytest.raises(ValueError, match="no positions"):
        whiten(x, torch.zeros_like(mask))
