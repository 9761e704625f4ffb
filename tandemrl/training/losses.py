"""Policy loss (PPO clipped surrogate with importance-sampling correction) and value loss.

Policy loss, per generated token t of a sequence with advantage A_t:

    ratio_t = exp(curr_t - prev_t)                       prev: the trainer's own logprobs
    surrogate_t = max(-A_t·ratio_t, -A_t·clip(ratio_t, 1 - ratio_clip_min, 1 + ratio_clip_max))
    dual clip (ratio_clip_c = c, optional): where A_t < 0, surrogate_t = min(surrogate_t, -c·A_t)
    loss_t = w_t · surrogate_t + beta · KL_t - entropy_coef · H_t

The clip range may be asymmetric (``ratio_clip_max`` above ``ratio_clip_min``: DAPO's
clip-higher). The dual clip bounds the loss of a negative-advantage token whose ratio grew
large, so one such token cannot dominate the step.

``KL_t`` (``reference_policy_kl_penalty`` = beta > 0) penalises drift from a frozen reference
policy, from the sampled token alone (``reference_kl``): with logr_t = ref_t - curr_t clamped
to ±``kl_input_clamp_value``, k1 = -logr, k2 = logr²/2, k3 = exp(logr) - 1 - logr (unbiased,
never negative), times w_t, then clamped to ±``kl_output_clamp_value``. ``ref_t`` comes from
the batch's ``reference_logprobs`` (the policy worker's frozen copy of the initial weights).

``w_t`` corrects for off-policy data: the sampled tokens came from the *generating* weights,
whose logprobs are ``generation_logprobs``, while the PPO ratio is taken against the trainer's
``prev_logprobs``. With ``use_importance_sampling_correction``, w_t = exp(prev_t - gen_t),
detached, shaped by ``importance_sampling.mode``:

- ``tis``: min(w_t, truncation)
- ``icepop``: w_t where low ≤ w_t ≤ high, else 0 (the token is dropped from the gradient)
- ``seq-mask-tis``: a sequence whose geometric-mean weight exp(mean_t log w_t) lies outside
  [low, high] is dropped whole; the others get min(w_t, truncation)
- ``untruncated``: w_t as it is
- ``none``: 1 (the weights are still measured for the metrics)

Normalization (the loss is a sum over the *whole RL step*, which may arrive in chunks):

- ``token_level_loss`` (token mean): loss = Σ_tokens loss_t / N_tokens, where N_tokens is the
  number of valid tokens (token_mask x sample_mask) of the whole step, passed in as
  ``num_step_tokens``. Summing the losses (and gradients) of any chunking of the step gives
  exactly the loss of the unsplit step. (A worker that does not know N yet passes a
  provisional constant and rescales the summed gradient once N is known: see
  ``worker_common.StepTracker``.) Dropped tokens (icepop / seq-mask-tis) stay in
  N_tokens: the correction removes their gradient, it does not re-weight the others.
- sequence mean: each sequence's token mean, summed and divided by ``num_step_sequences``
  (the number of sequences of the whole step; a sequence with sample_mask 0 adds 0). A
  streaming worker rescales it the same way once the step's rows are known.

A step whose valid-token count is 0 raises ``AllMaskedStepError``: every completion was
filtered, and training on nothing must not pass for a step.

Value loss: ``0.5 · max((V - R)², (V_clipped - R)²)`` with V_clipped the new value clipped to
``old ± value_clip``, token mean over the step's valid tokens, times ``loss_coef``.
"""

from __future__ import annotations

import torch

from tandemrl.config.models import LossConfig, ValueLossConfig
from tandemrl.training.api import TrainBatch
from tandemrl.training.batch import loss_mask


class AllMaskedStepError(ValueError):
    """Every completion of an RL step is masked out (sample_mask or token_mask all zero)."""


def _require(batch: TrainBatch, *keys: str) -> None:
    missing = [key for key in keys if key not in batch]
    if missing:
        raise KeyError(
            f"train batch lacks {missing}; it has {sorted(batch)}. The advantage stage sets "
            "'advantages', get_logprobs provides 'prev_logprobs', get_reference_logprobs "
            "'reference_logprobs' (loss_fn.reference_policy_kl_penalty > 0), the value stage "
            "'values'/'returns'"
        )


def _normalizers(
    mask: torch.Tensor, num_step_tokens: int | None, num_step_sequences: int | None
) -> tuple[float, float]:
    tokens = float(mask.sum().item()) if num_step_tokens is None else float(num_step_tokens)
    if tokens <= 0:
        raise AllMaskedStepError(
            "every completion of this RL step is masked out (token_mask x sample_mask sums "
            "to 0): there is nothing to train on. Check overlong_filtering / environment "
            "keep flags, or the step_num_tokens the controller passed"
        )
    sequences = float(mask.shape[0]) if num_step_sequences is None else float(num_step_sequences)
    if sequences <= 0:
        raise AllMaskedStepError(f"num_step_sequences must be positive, got {num_step_sequences}")
    return tokens, sequences


def _reduce(
    per_token: torch.Tensor,
    mask: torch.Tensor,
    *,
    token_level: bool,
    tokens: float,
    sequences: float,
) -> torch.Tensor:
    if token_level:
        return (per_token * mask).sum() / tokens
    per_sequence = (per_token * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1.0)
    return per_sequence.sum() / sequences


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """[..., V] logits → [...] entropy of the softmax distribution (differentiable)."""
    logits = logits.float()
    log_probs = torch.log_softmax(logits, dim=-1)
    return -(log_probs.exp() * log_probs).sum(dim=-1)


def importance_weights(
    prev_logprobs: torch.Tensor,
    generation_logprobs: torch.Tensor,
    mask: torch.Tensor,
    cfg: LossConfig,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [B, L] detached, raw weights [B, L]) per the module docstring; 1 when off."""
    log_w = (prev_logprobs - generation_logprobs).detach().float() * mask
    raw = torch.exp(log_w)
    if not cfg.use_importance_sampling_correction:
        return torch.ones_like(raw), raw
    is_cfg = cfg.importance_sampling
    if is_cfg.mode == "none":
        weights = torch.ones_like(raw)
    elif is_cfg.mode == "untruncated":
        weights = raw
    elif is_cfg.mode == "tis":
        weights = raw.clamp(max=is_cfg.truncation)
    elif is_cfg.mode == "icepop":
        keep = (raw >= is_cfg.low) & (raw <= is_cfg.high)
        weights = torch.where(keep, raw, torch.zeros_like(raw))
    elif is_cfg.mode == "seq-mask-tis":
        counts = mask.sum(dim=1).clamp(min=1.0)
        geometric_mean = torch.exp(log_w.sum(dim=1) / counts)
        keep_sequence = (geometric_mean >= is_cfg.low) & (geometric_mean <= is_cfg.high)
        weights = raw.clamp(max=is_cfg.truncation) * keep_sequence.to(raw.dtype)[:, None]
    else:  # pragma: no cover - the config's Literal forbids other modes
        raise ValueError(f"unknown importance_sampling.mode {is_cfg.mode!r}")
    return weights, raw


def reference_kl(
    curr_logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor,
    cfg: LossConfig,
    weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """[B, L] per-token estimate of KL(pi || pi_ref) (module docstring), differentiable in
    ``curr_logprobs``; ``weights`` (detached importance weights) multiply it before the
    output clamp."""
    log_ratio = reference_logprobs.float() - curr_logprobs.float()
    if cfg.kl_input_clamp_value is not None:
        limit = cfg.kl_input_clamp_value
        log_ratio = log_ratio.clamp(-limit, limit)
    if cfg.reference_policy_kl_type == "k1":
        kl = -log_ratio
    elif cfg.reference_policy_kl_type == "k2":
        kl = 0.5 * log_ratio.square()
    else:
        kl = torch.exp(log_ratio) - 1.0 - log_ratio
    if weights is not None:
        kl = weights * kl
    if cfg.kl_output_clamp_value is not None:
        limit = cfg.kl_output_clamp_value
        kl = kl.clamp(-limit, limit)
    return kl


def policy_loss_terms(
    curr_logprobs: torch.Tensor,
    batch: TrainBatch,
    cfg: LossConfig,
    *,
    num_step_tokens: int | None = None,
    num_step_sequences: int | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """``policy_loss`` with its metrics left as 0-d tensors on the loss's device.

    Nothing here waits for the device (given ``num_step_tokens``), so a worker can queue the
    backward of every micro-batch and read all metrics back with one transfer at the end.
    """
    _require(batch, "token_mask", "sample_mask", "advantages", "prev_logprobs")
    if cfg.use_importance_sampling_correction:
        _require(batch, "generation_logprobs")
    kl_penalty = cfg.reference_policy_kl_penalty
    if kl_penalty > 0:
        _require(batch, "reference_logprobs")
    mask = loss_mask(batch).to(curr_logprobs.device)
    tokens, sequences = _normalizers(mask, num_step_tokens, num_step_sequences)
    if cfg.entropy_coef > 0 and entropy is None:
        raise ValueError("loss_fn.entropy_coef > 0 needs the per-token entropy of the logits")

    prev = batch["prev_logprobs"].to(curr_logprobs.device, torch.float32)
    generation = batch.get("generation_logprobs", prev).to(curr_logprobs.device, torch.float32)
    advantages = batch["advantages"].to(curr_logprobs.device, torch.float32)
    curr = curr_logprobs.float()

    # Masked positions may hold arbitrary logprobs; zero the log-ratio there so exp() is safe.
    log_ratio = (curr - prev) * mask
    ratio = torch.exp(log_ratio)
    clipped_ratio = ratio.clamp(1.0 - cfg.ratio_clip_min, 1.0 + cfg.ratio_clip_max)
    clipped_surrogate = torch.maximum(-advantages * ratio, -advantages * clipped_ratio)
    surrogate = clipped_surrogate
    if cfg.ratio_clip_c is not None:
        dual_bound = -advantages * cfg.ratio_clip_c
        surrogate = torch.where(
            advantages < 0, torch.minimum(clipped_surrogate, dual_bound), clipped_surrogate
        )
    weights, raw_weights = importance_weights(prev, generation, mask, cfg)
    per_token = weights * surrogate
    kl = None
    if kl_penalty > 0:
        reference = batch["reference_logprobs"].to(curr_logprobs.device, torch.float32)
        kl = reference_kl(curr, reference, cfg, weights) * mask
        per_token = per_token + kl_penalty * kl
    if entropy is not None and cfg.entropy_coef > 0:
        per_token = per_token - cfg.entropy_coef * entropy.float()
    loss = _reduce(
        per_token, mask, token_level=cfg.token_level_loss, tokens=tokens, sequences=sequences
    )

    with torch.no_grad():
        count = mask.sum()
        denom = count.clamp(min=1.0)
        clipped = ((-advantages * clipped_ratio) > (-advantages * ratio)).float()
        zero = torch.zeros((), device=mask.device)
        metrics = {
            "loss": loss.detach(),
            "ratio_mean": (ratio * mask).sum() / denom,
            "clip_fraction": (clipped * mask).sum() / denom,
            "is_weight_mean": (raw_weights * mask).sum() / denom,
            # 0 when nothing is valid: masked entries are filled with 0, weights are > 0.
            "is_weight_max": raw_weights.masked_fill(mask == 0, 0.0).max(),
            "is_masked_fraction": ((weights == 0).float() * mask).sum() / denom
            if cfg.use_importance_sampling_correction
            else zero,
            "kl_gen_trainer": ((raw_weights - 1.0 - torch.log(raw_weights)) * mask).sum() / denom,
            "num_tokens": count,
        }
        if entropy is not None:
            metrics["entropy"] = (entropy.float() * mask).sum() / denom
        if cfg.ratio_clip_c is not None:
            dual_clipped = (surrogate < clipped_surrogate).float()
            metrics["dual_clip_fraction"] = (dual_clipped * mask).sum() / denom
        if kl is not None:
            metrics["kl_reference"] = kl.sum() / denom
    return loss, metrics


def metrics_to_floats(rows: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Read a list of tensor-metric dicts back to the host with one transfer."""
    if not rows:
        return []
    flat = [value.detach().float().reshape(()) for row in rows for value in row.values()]
    values = iter(torch.stack(flat).cpu().tolist())
    return [{key: next(values) for key in row} for row in rows]


def policy_loss(
    curr_logprobs: torch.Tensor,
    batch: TrainBatch,
    cfg: LossConfig,
    *,
    num_step_tokens: int | None = None,
    num_step_sequences: int | None = None,
    entropy: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped PPO loss of one (micro-)batch as its share of the whole step's loss.

    ``curr_logprobs`` [B, L] (with grad) are aligned with ``input_ids``; ``batch`` holds
    ``token_mask``, ``sample_mask``, ``advantages``, ``prev_logprobs``,
    ``generation_logprobs``. ``num_step_tokens`` / ``num_step_sequences`` are the whole
    step's normalizers (None: this batch is the whole step). ``entropy`` [B, L] (with grad,
    from the full logits, e.g. ``token_entropy``) is required when ``cfg.entropy_coef > 0``.

    Metrics (means over this batch's valid tokens; ``num_tokens`` lets callers re-weight):
    ``loss``, ``ratio_mean``, ``clip_fraction``, ``is_weight_mean``, ``is_weight_max``
    (raw weights exp(prev - gen)), ``is_masked_fraction`` (tokens the correction dropped),
    ``kl_gen_trainer`` (k3 estimate of KL(generator ‖ trainer) from the sampled tokens),
    ``entropy`` (when given), ``dual_clip_fraction`` (with ``ratio_clip_c``: tokens the dual
    clip bounded), ``kl_reference`` (with the KL penalty: the mean per-token KL to the
    reference), ``num_tokens``.
    """
    loss, metrics = policy_loss_terms(
        curr_logprobs,
        batch,
        cfg,
        num_step_tokens=num_step_tokens,
        num_step_sequences=num_step_sequences,
        entropy=entropy,
    )
    return loss, metrics_to_floats([metrics])[0]


def value_loss(
    values: torch.Tensor,
    batch: TrainBatch,
    cfg: ValueLossConfig,
    *,
    num_step_tokens: int | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped value loss of [B, L] ``values`` against ``returns`` around the old ``values``.

    ``num_step_tokens`` is the whole step's valid-token count (None: this batch is the step).
    """
    _require(batch, "token_mask", "sample_mask", "values", "returns")
    mask = loss_mask(batch).to(values.device)
    tokens, _ = _normalizers(mask, num_step_tokens, None)
    old = batch["values"].to(values.device, torch.float32)
    returns = batch["returns"].to(values.device, torch.float32)
    new = values.float()
    unclipped_error = (new - returns) ** 2
    if cfg.value_clip is None:
        per_token = 0.5 * unclipped_error
        clipped_fraction = torch.zeros_like(per_token)
    else:
        clipped_values = old + (new - old).clamp(-cfg.value_clip, cfg.value_clip)
        clipped_error = (clipped_values - returns) ** 2
        per_token = 0.5 * torch.maximum(unclipped_error, clipped_error)
        clipped_fraction = (clipped_error > unclipped_error).float()
    loss = cfg.loss_coef * (per_token * mask).sum() / tokens
    with torch.no_grad():
        denom = mask.sum().clamp(min=1.0)
        metrics = {
            "value_loss": float(loss.item()),
            "value_clip_fraction": float(((clipped_fraction * mask).sum() / denom).item()),
            "value_mean": float(((new * mask).sum() / denom).item()),
            "return_mean": float(((returns * mask).sum() / denom).item()),
            "value_abs_error": float((((new - returns).abs() * mask).sum() / denom).item()),
            "num_tokens": float(mask.sum().item()),
        }
    return loss, metrics
