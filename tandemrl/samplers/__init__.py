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
    "BuiltinSampler",
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
    "builtin_sampler",
    "create_sampler",
    "load_sampler_class",
    "required_buffer_capacity",
]

BuiltinSampler = InOrderSampler | WeightFifoSampler | ReadyFirstSampler | WindowedSampler
BuiltinSamplerConfig = (
    InOrderSamplerConfig | WeightFifoSamplerConfig | ReadyFirstSamplerConfig | WindowedSamplerConfig
)

BUILTIN_SAMPLERS: dict[str, type[BuiltinSampler]] = {
    cls.name: cls for cls in (InOrderSampler, WeightFifoSampler, ReadyFirstSampler, WindowedSampler)
}


def create_sampler(
    cfg: BuiltinSamplerConfig | CustomSamplerConfig,
    buffer: ReplayBuffer,
    *,
    groups_per_step: int,
    policy_training_start_step: int = 0,
) -> PromptGroupSampler:
    """The sampler ``async_rl.sampler`` describes, over ``buffer``.

    ``groups_per_step`` is ``num_prompts_per_step`` (one prompt group per prompt);
    ``policy_training_start_step`` is ``ppo.policy_training_start_step`` (the critic warm-up
    in_order's lookahead follows; 0 on GRPO).
    """
    if isinstance(cfg, CustomSamplerConfig):
        return create_custom_sampler(
            cfg.target, buffer, groups_per_step=groups_per_step, kwargs=cfg.constructor_kwargs()
        )
    return builtin_sampler(
        cfg,
        buffer,
        groups_per_step=groups_per_step,
        policy_training_start_step=policy_training_start_step,
    )


def builtin_sampler(
    cfg: BuiltinSamplerConfig,
    buffer: ReplayBuffer | None = None,
    *,
    groups_per_step: int,
    policy_training_start_step: int = 0,
) -> BuiltinSampler:
    """The built-in sampler ``cfg`` describes. Without ``buffer`` it sits on an empty one: what
    validation builds to ask the sampler for its rules before any run exists."""
    if buffer is None:
        buffer = ReplayBuffer(group_size=1, capacity=1)
    sampler_class = BUILTIN_SAMPLERS.get(cfg.name)
    if sampler_class is None:
        raise SamplerConfigError(f"async_rl.sampler.name: unknown sampler mode {cfg.name!r}")
    # A built-in sampler's constructor keywords are its config block's keys (but ``name``).
    knobs = cfg.model_dump(exclude={"name"})
    if sampler_class is InOrderSampler:
        knobs["policy_training_start_step"] = policy_training_start_step
    return sampler_class(buffer, groups_per_step=groups_per_step, **knobs)


def required_buffer_capacity(
    sampler_cfg: BuiltinSamplerConfig | CustomSamplerConfig, num_prompts_per_step: int
) -> int:
    """Smallest ``async_rl.max_buffered_rollouts`` the built-in sampler ``sampler_cfg`` describes
    runs with (its ``required_buffer_capacity``). A custom sampler's is declared by its class
    and asked at setup, once the class is built; passing its config raises ValueError."""
    if isinstance(sampler_cfg, CustomSamplerConfig):
        raise ValueError(
            f"sampler mode {sampler_cfg.name!r}: required buffer capacity is declared by the "
            "sampler class (PromptGroupSampler.required_buffer_capacity), not by the config"
        )
    sampler = builtin_sampler(sampler_cfg, groups_per_step=num_prompts_per_step)
    return sampler.required_buffer_capacity(num_prompts_per_step)
