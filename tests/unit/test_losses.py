"""Policy loss (clipped PG, importance sampling modes, normalization) and clipped value loss."""

from __future__ import annotations

import math

import pytest
import torch

from tandemrl.config.models import ImportanceSamplingConfig, LossConfig, ValueLossConfig
from tandemrl.training.batch import split_microbatches
from tandemrl.training.losses import (
    AllMaskedStepError,
    importance_weights,
    policy_loss,
    token_entropy,
    value_loss,
)


def make_batch(batch_size: int = 4, length: int = 6, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    token_mask = torch.zeros(batch_size, length)
    for i in range(batch_size):
        token_mask[i, 2 : length - (i % 3)] = 1.0
    prev = -torch.rand(batch_size, length, generator=gen) * 2
    return {
        "token_mask": token_mask,
        "sample_mask": torch.ones(batch_size),
        "advantages": torch.randn(batch_size, 1, generator=gen).expand(-1, length) * token_mask,
        "prev_logprobs": prev * token_mask,
        "generation_logprobs": (prev + 0.3 * torch.randn(batch_size, length, generator=gen))
        * token_mask,
    }


def test_ratio_one_gives_plain_policy_gradient() -> None:
    batch = make_batch()
    batch["sample_mask"][3] = 0.0
    curr = batch["prev_logprobs"].clone().requires_grad_(True)
    loss, metrics = policy_loss(curr, batch, LossConfig())
    loss.backward()
    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    expected = -batch["advantages"] * mask / mask.sum()
    torch.testing.assert_close(curr.grad, expected)
    torch.testing.assert_close(loss, -(batch["advantages"] * mask).sum() / mask.sum())
    assert metrics["ratio_mean"] == pytest.approx(1.0)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["num_tokens"] == mask.sum().item()


def test_clipping_zeroes_gradient_outside_the_trust_region() -> None:
    mask = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    advantages = torch.tensor([[1.0, 1.0, -1.0, -1.0]])
    prev = torch.zeros(1, 4)
    # log-ratios: +0.5 (A>0, clipped), -0.5 (A>0, not clipped), -0.5 (A<0, clipped),
    # +0.5 (A<0, not clipped: the pessimistic bound keeps the unclipped ratio).
    curr = torch.tensor([[0.5, -0.5, -0.5, 0.5]], requires_grad=True)
    batch = {
        "token_mask": mask,
        "sample_mask": torch.ones(1),
        "advantages": advantages,
        "prev_logprobs": prev,
        "generation_logprobs": prev,
    }
    loss, metrics = policy_loss(curr, batch, LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.2))
    loss.backward()
    e = math.exp(0.5)
    ei = math.exp(-0.5)
    torch.testing.assert_close(
        curr.grad, torch.tensor([[0.0, -ei / 4, 0.0, e / 4]]), rtol=1e-6, atol=1e-7
    )
    expected_loss = (-1.2 - ei + 0.8 + e) / 4
    assert loss.item() == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["clip_fraction"] == pytest.approx(0.5)


def is_cfg(mode: str, **kwargs: float) -> LossConfig:
    return LossConfig(
        use_importance_sampling_correction=True,
        importance_sampling=ImportanceSamplingConfig(mode=mode, **kwargs),
    )


def test_importance_weight_modes_on_hand_made_tensors() -> None:
    # Per-token log w = prev - gen.
    log_w = torch.tensor([[math.log(3.0), math.log(0.25), 0.0], [math.log(1.5), 0.0, 0.0]])
    gen = torch.zeros(2, 3)
    prev = log_w.clone()
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    raw = torch.exp(log_w) * mask + (1 - mask)  # masked positions: log w forced to 0

    weights, measured = importance_weights(prev, gen, mask, is_cfg("tis", truncation=2.0))
    torch.testing.assert_close(measured, raw)
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.25, 1.0], [1.5, 1.0, 1.0]]))

    weights, _ = importance_weights(prev, gen, mask, is_cfg("icepop", low=0.5, high=2.0))
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 1.0], [1.5, 1.0, 1.0]]))

    # Row 0 geometric mean: (3 x 0.25 x 1)^(1/3) ≈ 0.909 → kept (then truncated per token);
    # row 1: (1.5 x 1)^(1/2) ≈ 1.22 → kept. With low 0.95 row 0 is dropped whole.
    weights, _ = importance_weights(
        prev, gen, mask, is_cfg("seq-mask-tis", low=0.5, high=2.0, truncation=2.0)
    )
    torch.testing.assert_close(weights, torch.tensor([[2.0, 0.25, 1.0], [1.5, 1.0, 1.0]]))
    weights, _ = importance_weights(
        prev, gen, mask, is_cfg("seq-mask-tis", low=0.95, high=2.0, truncation=2.0)
    )
    torch.testing.assert_close(weights, torch.tensor([[0.0, 0.0, 0.0], [1.5, 1.0, 1.0]]))

    weights, _ = importance_weights(prev, gen, mask, is_cfg("none"))
    assert torch.equal(weights, torch.ones(2, 3))
    weights, _ = importance_weights(prev, gen, mask, LossConfig())
    assert torch.equal(weights, torch.ones(2, 3))


def test_icepop_drops_token_gradient_and_reports_metrics() -> None:
    mask = torch.ones(1, 3)
    prev = torch.zeros(1, 3)
    gen = torch.tensor([[0.0, math.log(1 / 3.0), 0.0]])  # w = [1, 3, 1]
    batch = {
        "token_mask": mask,
        "sample_mask": torch.ones(1),
        "advantages": torch.ones(1, 3),
        "prev_logprobs": prev,
        "generation_logprobs": gen,
    }
    curr = prev.clone().requires_grad_(True)
    loss, metrics = policy_loss(curr, batch, is_cfg("icepop", low=0.5, high=2.0))
    loss.backward()
    torch.testing.assert_close(curr.grad, torch.tensor([[-1 / 3, 0.0, -1 / 3]]))
    assert metrics["is_masked_fraction"] == pytest.approx(1 / 3)
    assert metrics["is_weight_max"] == pytest.approx(3.0, rel=1e-5)
    assert metrics["is_weight_mean"] == pytest.approx(5 / 3, rel=1e-5)
    # k3 estimate of KL(gen || trainer): mean of (w - 1 - log w).
    assert metrics["kl_gen_trainer"] == pytest.approx((2 - math.log(3)) / 3, rel=1e-5)

    tis_curr = prev.clone().requires_grad_(True)
    tis_loss, _ = policy_loss(tis_curr, batch, is_cfg("tis", truncation=2.0))
    tis_loss.backward()
    torch.testing.assert_close(tis_curr.grad, torch.tensor([[-1 / 3, -2 / 3, -1 / 3]]))


@pytest.mark.parametrize("how", ["sample_mask", "token_mask"])
def test_all_masked_step_raises(how: str) -> None:
    batch = make_batch()
    if how == "sample_mask":
        batch["sample_mask"] = torch.zeros(4)
    else:
        batch["token_mask"] = torch.zeros_like(batch["token_mask"])
    curr = batch["prev_logprobs"].clone().requires_grad_(True)
    with pytest.raises(AllMaskedStepError, match="masked out"):
        policy_loss(curr, batch, LossConfig())
    with pytest.raises(AllMaskedStepError):
        policy_loss(batch["prev_logprobs"], make_batch(), LossConfig(), num_step_tokens=0)
    batch["values"] = torch.zeros_like(batch["token_mask"])
    batch["returns"] = torch.ones_like(batch["token_mask"])
    with pytest.raises(AllMaskedStepError):
        value_loss(torch.zeros_like(batch["token_mask"]), batch, ValueLossConfig())


def test_missing_fields_are_named() -> None:
    batch = make_batch()
    del batch["prev_logprobs"]
    with pytest.raises(KeyError, match="prev_logprobs"):
        policy_loss(torch.zeros(4, 6), batch, LossConfig())
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(torch.zeros(4, 6), make_batch(), LossConfig(entropy_coef=0.1))


@pytest.mark.parametrize("token_level", [True, False])
@pytest.mark.parametrize("mode", ["tis", "icepop", "seq-mask-tis"])
def test_two_chunks_give_the_gradient_of_one_big_step(token_level: bool, mode: str) -> None:
    batch = make_batch(batch_size=6, length=7, seed=3)
    batch["sample_mask"][4] = 0.0
    cfg = LossConfig(
        token_level_loss=token_level,
        use_importance_sampling_correction=True,
        importance_sampling=ImportanceSamplingConfig(mode=mode),
        entropy_coef=0.01,
    )
    gen = torch.Generator().manual_seed(7)
    logits_source = torch.randn(6, 7, 5, generator=gen)
    ids = torch.randint(0, 5, (6, 7), generator=gen)

    def forward(theta: torch.Tensor, rows: slice) -> tuple[torch.Tensor, torch.Tensor]:
        logits = logits_source[rows] + theta
        logprobs = torch.log_softmax(logits, -1).gather(-1, ids[rows, :, None]).squeeze(-1)
        return logprobs, token_entropy(logits)

    mask = batch["token_mask"] * batch["sample_mask"][:, None]
    step_tokens = int(mask.sum().item())

    theta_big = torch.zeros(5, requires_grad=True)
    curr, entropy = forward(theta_big, slice(0, 6))
    big_loss, _ = policy_loss(curr, batch, cfg, entropy=entropy)
    big_loss.backward()

    theta_chunked = torch.zeros(5, requires_grad=True)
    total = 0.0
    for start, chunk in zip((0, 4), split_microbatches(batch, 4), strict=True):
        rows = slice(start, start + chunk["token_mask"].shape[0])
        curr, entropy = forward(theta_chunked, rows)
        loss, _ = policy_loss(
            curr, chunk, cfg, num_step_tokens=step_tokens, num_step_sequences=6, entropy=entropy
        )
        loss.backward()
        total += loss.item()
    assert total == pytest.approx(big_loss.item(), abs=1e-6)
    torch.testing.assert_close(theta_chunked.grad, theta_big.grad, atol=1e-6, rtol=0)
    assert theta_big.grad.abs().sum() > 0


def test_value_loss_clipping_and_gradient() -> None:
    mask = torch.tensor([[0.0, 1.0, 1.0, 1.0]])
    batch = {
        "token_mask": mask,
        "sample_mask": torch.ones(1),
        "values": torch.tensor([[0.0, 0.0, 0.0, 0.0]]),
        "returns": torch.tensor([[5.0, 1.0, 1.0, -1.0]]),
    }
    new = torch.tensor([[3.0, 0.5, 2.0, 0.1]], requires_grad=True)
    loss, metrics = value_loss(new, batch, ValueLossConfig(value_clip=0.2, loss_coef=1.0))
    loss.backward()
    # pos1: new 0.5 → clipped 0.2; errors 0.25 vs 0.64 → clipped term wins, no gradient.
    # pos2: new 2.0 → clipped 0.2; errors 1.0 vs 0.64 → unclipped wins, grad (2-1)/3.
    # pos3: new 0.1 (inside the clip); error 1.21, grad 1.1/3.
    expected = (0.5 * 0.64 + 0.5 * 1.0 + 0.5 * 1.21) / 3
    assert loss.item() == pytest.approx(expected, rel=1e-6)
    torch.testing.assert_close(new.grad, torch.tensor([[0.0, 0.0, 1.0 / 3, 1.1 / 3]]))
    assert metrics["value_clip_fraction"] == pytest.approx(1 / 3)

    unclipped = new.detach().clone().requires_grad_(True)
    loss, _ = value_loss(unclipped, batch, ValueLossConfig(value_clip=None, loss_coef=2.0))
    loss.backward()
    torch.testing.assert_close(
        unclipped.grad, 2.0 * torch.tensor([[0.0, -0.5 / 3, 1.0 / 3, 1.1 / 3]])
    )


def _one_token_batch(advantages: list[float], prev: float = 0.0) -> dict[str, torch.Tensor]:
    n = len(advantages)
    return {
        "token_mask": torch.ones(1, n),
        "sample_mask": torch.ones(1),
        "advantages": torch.tensor([advantages]),
        "prev_logprobs": torch.full((1, n), prev),
    }


def test_asymmetric_clip_bounds_are_one_minus_min_and_one_plus_max() -> None:
    """ratio_clip_max above ratio_clip_min (clip-higher): a positive-advantage token keeps its
    gradient up to ratio 1.28, a negative one down to 0.8, and no further."""
    cfg = LossConfig(ratio_clip_min=0.2, ratio_clip_max=0.28)
    ratios = [1.25, 1.30, 0.85, 0.75]
    batch = _one_token_batch([1.0, 1.0, -1.0, -1.0])
    curr = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    loss, metrics = policy_loss(curr, batch, cfg)
    loss.backward()
    # d(-A r)/d log r = -A r where unclipped, 0 where clipped; token mean over 4 tokens.
    expected = torch.tensor([[-1.25, 0.0, 0.85, 0.0]]) / 4
    torch.testing.assert_close(curr.grad, expected)
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    # Symmetric 0.2 would have clipped the first token too.
    curr_sym = curr.detach().clone().requires_grad_(True)
    policy_loss(curr_sym, batch, LossConfig())[0].backward()
    assert curr_sym.grad[0, 0] == 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantages() -> None:
    """ratio_clip_c = 3: for A < 0 the loss is min(max(-A r, -A clip(r)), -3 A)."""
    cfg = LossConfig(ratio_clip_c=3.0)
    ratios = [5.0, 2.0, 5.0]
    advantages = [-1.0, -1.0, 1.0]
    batch = _one_token_batch(advantages)
    curr = torch.tensor([[math.log(r) for r in ratios]], requires_grad=True)
    loss, metrics = policy_loss(curr, batch, cfg)
    loss.backward()
    # token 0: -A r = 5 > 3 = -c A -> loss 3, no gradient; token 1: -A r = 2 < 3 -> 2, grad r;
    # token 2 (A > 0): clipped at 1.2 -> -1.2, no gradient (the dual clip never applies).
    assert loss.item() == pytest.approx((3.0 + 2.0 - 1.2) / 3)
    torch.testing.assert_close(curr.grad, torch.tensor([[0.0, 2.0, 0.0]]) / 3)
    assert metrics["dual_clip_fraction"] == pytest.approx(1 / 3)
    plain = policy_loss(curr.detach(), batch, LossConfig())[0]
    assert plain.item() == pytest.approx((5.0 + 2.0 - 1.2) / 3)


@pytest.mark.parametrize(
    ("kl_type", "estimate"),
    [
        ("k1", lambda logr: -logr),
        ("k2", lambda logr: 0.5 * logr**2),
        ("k3", lambda logr: math.exp(logr) - 1.0 - logr),
    ],
)
def test_reference_kl_penalty_adds_beta_times_the_estimator(kl_type, estimate) -> None:
    beta = 0.1
    cfg = LossConfig(reference_policy_kl_penalty=beta, reference_policy_kl_type=kl_type)
    batch = _one_token_batch([0.0, 0.0])  # zero advantage: the loss is the KL term alone
    curr_values = [-1.0, -2.0]
    ref_values = [-1.5, -1.0]
    batch["prev_logprobs"] = torch.tensor([curr_values])
    batch["reference_logprobs"] = torch.tensor([ref_values])
    curr = torch.tensor([curr_values], requires_grad=True)
    loss, metrics = policy_loss(curr, batch, cfg)
    logrs = [r - c for r, c in zip(ref_values, curr_values, strict=True)]
    expected_kl = sum(estimate(x) for x in logrs) / 2
    assert loss.item() == pytest.approx(beta * expected_kl)
    assert metrics["kl_reference"] == pytest.approx(expected_kl)
    loss.backward()
    assert curr.grad is not None and torch.all(curr.grad != 0)
    with pytest.raises(KeyError, match="reference_logprobs"):
        policy_loss(
            curr.detach(), {k: v for k, v in batch.items() if k != "reference_logprobs"}, cfg
        )


def test_reference_kl_clamps_input_and_output() -> None:
    from tandemrl.training.losses import reference_kl

    curr = torch.tensor([[0.0, 0.0]])
    ref = torch.tensor([[30.0, -30.0]])
    cfg = LossConfig(reference_policy_kl_penalty=1.0, kl_input_clamp_value=20.0)
    # logr clamped to ±20, k3 of +20 is huge and clamped to 10; k3 of -20 is 19 -> 10 too.
    torch.testing.assert_close(reference_kl(curr, ref, cfg), torch.tensor([[10.0, 10.0]]))
    cfg = LossConfig(
        reference_policy_kl_penalty=1.0,
        reference_policy_kl_type="k1",
        kl_input_clamp_value=None,
        kl_output_clamp_value=None,
    )
    torch.testing.assert_close(reference_kl(curr, ref, cfg), torch.tensor([[-30.0, 30.0]]))
