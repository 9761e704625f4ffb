"""Samplers: the staleness policy shared by the rollout pump (admit) and the train pump
(evict, select). One module per mode of the reference spec's "Sampler modes" table:

=============  =========================================  ==============================================
mode           rollout gating                             train selection
=============  =========================================  ==============================================
in_order       lead the trainer by <= L batches           target_step == current_train_weight
weight_fifo    same gate, L = max_staleness_versions      oldest in-window start_weight first, waits
                                                          for that weight's batch to fill
ready_first    same gate, L = max_staleness_versions      any ready group with start_weight <= train
windowed       ungated (buffer capacity only)             start_weight in [train - L, train]; evicts
                                                          older groups; optional freshest-first
custom         the imported class                         the imported class
=============  =========================================  ==============================================
"""

from __future__ import annotations

from tandemrl.buffer import ReplayBuffer
from tandemrl.config.models import (
    CustomSamplerConfig,
    InOrderSamplerConfig,
    ReadyFirstSamplerConfig,
    WeightFifoSamplerConfig,
    WindowedSamplerConfig,
)
from tandemrl.samplers.base import (
    GatedSampler,
    PromptGroupSampler,
    SamplerClosed,
    SamplerConfigError,
    SamplerError,
)
from tandemrl.samplers.custom import (
    StructuralSamplerAdapter,
    create_custom_sampler,
    load_sampler_class,
)
from tandemrl.samplers.in_order import InOrderSampler
from tandemrl.samplers.ready_first import ReadyFirstSampler
from tandemrl.samplers.weight_fifo import WeightFifoSampler
from tandemrl.samplers.windowed import WindowedSampler

__all__ = [
    "BUILTIN_SAMPLERS",
    "GatedSampler",
    "InOrderSampler",
    "PromptGroupSampler",
    "ReadyFirstSampler",
    "SamplerClosed",
    "SamplerConfigError",
    "SamplerError",
    "StructuralSamplerAdapter",
    "WeightFifoSampler",
    "WindowedSampler",
    "create_sampler",
    "load_sampler_class",
]

BUILTIN_SAMPLERS: dict[str, type[PromptGroupSampler]] = {
    "in_order": InOrderSampler,
    "weight_fifo": WeightFifoSampler,
    "ready_first": ReadyFirstSampler,
    "windowed": WindowedSampler,
}


def create_sampler(
    cfg: InOrderSamplerConfig
    | WeightFifoSamplerConfig
    | ReadyFirstSamplerConfig
    | WindowedSamplerConfig
    | CustomSamplerConfig,
    buffer: ReplayBuffer,
    *,
    groups_per_step: int,
) -> PromptGroupSampler:
    """The sampler ``async_rl.sampler`` describes, over ``buffer``.

    ``groups_per_step`` is ``num_prompts_per_step`` (one prompt group per prompt).
    """
    if isinstance(cfg, InOrderSamplerConfig):
        return InOrderSampler.from_config(cfg, buffer, groups_per_step=groups_per_step)
    if isinstance(cfg, WeightFifoSamplerConfig):
        return WeightFifoSampler.from_config(cfg, buffer, groups_per_step=groups_per_step)
    if isinstance(cfg, ReadyFirstSamplerConfig):
        return ReadyFirstSampler.from_config(cfg, buffer, groups_per_step=groups_per_step)
    if isinstance(cfg, WindowedSamplerConfig):
        return WindowedSampler.from_config(cfg, buffer, groups_per_step=groups_per_step)
    if isinstance(cfg, CustomSamplerConfig):
        return create_custom_sampler(
            cfg.target, buffer, groups_per_step=groups_per_step, kwargs=cfg.constructor_kwargs()
        )
    raise SamplerConfigError(
        f"async_rl.sampler.name: unknown sampler mode {getattr(cfg, 'name', cfg)!r}"
    )
