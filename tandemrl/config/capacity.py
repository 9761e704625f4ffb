"""How many unconsumed prompt groups a built-in sampler needs the replay buffer to hold.

One formula per sampler mode, stated here and nowhere else (validation and the sampler
classes both call ``required_buffer_capacity``). ``N`` is ``num_prompts_per_step``:

- ``in_order``: dispatch may lead the trainer by ``L`` batches, so up to ``N x (L + 1)`` groups
  (the batch being trained plus ``L`` batches ahead) are reserved or ready at once. ``L`` is the
  widest lookahead the run ever uses: ``warmup_lookahead_versions`` when set (PPO critic
  warm-up), else ``max_lookahead_versions``.
- ``weight_fifo`` and ``ready_first``: the same gate, with ``L = max_staleness_versions``.
- ``windowed``: dispatch is not gated; the buffer must hold at least one full step (``N``).
  Anything above that is over-sampling headroom.

A ``max_buffered_rollouts`` below this value deadlocks the rollout pump: the gate admits a
prompt the buffer has no slot for, and the slot only frees when the trainer consumes a batch
that cannot fill.
"""

from __future__ import annotations

from typing import Any

GATED_SAMPLER_MODES = ("in_order", "weight_fifo", "ready_first")


def widest_lookahead(sampler_cfg: Any) -> int:
    """Largest number of versions a gated sampler lets dispatch run ahead of the trainer."""
    name = sampler_cfg.name
    if name == "in_order":
        warmup = sampler_cfg.warmup_lookahead_versions
        lookahead = sampler_cfg.max_lookahead_versions
        return lookahead if warmup is None else max(lookahead, warmup)
    if name in ("weight_fifo", "ready_first", "windowed"):
        return sampler_cfg.max_staleness_versions
    raise ValueError(f"sampler mode {name!r} has no built-in lookahead; its class declares it")


def required_buffer_capacity(sampler_cfg: Any, num_prompts_per_step: int) -> int:
    """Smallest ``async_rl.max_buffered_rollouts`` the built-in sampler can run with.

    ``sampler_cfg`` is one of the built-in sampler config models (anything with the same
    attributes). A custom sampler declares its own capacity; passing one raises ValueError.
    """
    if num_prompts_per_step < 1:
        raise ValueError(f"num_prompts_per_step must be >= 1, got {num_prompts_per_step}")
    name = sampler_cfg.name
    if name in GATED_SAMPLER_MODES:
        return num_prompts_per_step * (widest_lookahead(sampler_cfg) + 1)
    if name == "windowed":
        return num_prompts_per_step
    raise ValueError(
        f"sampler mode {name!r}: required buffer capacity is declared by the sampler class "
        "(PromptGroupSampler.required_buffer_capacity), not by the config"
    )
