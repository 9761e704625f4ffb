"""Property tests of the real controller over fakes: random accepted configs and latencies.

For every config that validation accepts, with random per-request latencies (so rollouts
finish in random orders), a run must finish (no deadlock) and:

- no trained group is staler than its sampler allows (ready_first: unbounded by design);
- no group is trained twice;
- every admitted prompt ends trained, evicted or aborted (windowed only), or still buffered
  or in flight;
- the buffer never holds more than max_buffered_rollouts unconsumed groups and no more than
  max_inflight_prompts groups are ever in flight.
"""

from __future__ import annotations

import asyncio

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandemrl.config.loader import load_config
from tandemrl.config.validate import ConfigError, validate_single_controller_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.data.dataset import PromptRecord
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.training.fake import FakeTrainer


@st.composite
def accepted_configs(draw):
    n = draw(st.integers(1, 4))
    g = draw(st.integers(1, 3))
    mode = draw(st.sampled_from(["in_order", "weight_fifo", "ready_first", "windowed"]))
    window = draw(st.integers(0, 2))
    knob = "max_lookahead_versions" if mode == "in_order" else "max_staleness_versions"
    min_groups = draw(st.integers(1, n))
    gated_capacity = n * (window + 1) if mode != "windowed" else n
    capacity = gated_capacity + draw(st.integers(0, 4))
    inflight = draw(st.integers(min_groups, capacity + 2))
    off_policy = window > 0 or mode == "ready_first"
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"grpo.num_prompts_per_step={n}",
            f"grpo.num_generations_per_prompt={g}",
            f"policy.train_global_batch_size={n * g}",
            f"policy.train_micro_batch_size={n * g}",
            "grpo.max_num_steps=4",
            f"async_rl.sampler={{name: {mode}, {knob}: {window}}}",
            f"loss_fn.use_importance_sampling_correction={off_policy}",
            f"async_rl.min_groups_for_streaming_train={min_groups}",
            f"async_rl.max_buffered_rollouts={capacity}",
            f"async_rl.max_inflight_prompts={inflight}",
            "logger.progress=false",
        ),
    )
    try:
        validate_single_controller_config(cfg)
    except ConfigError:
        return None
    return cfg


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cfg=accepted_configs(), seed=st.integers(0, 10_000), sigma=st.floats(0.1, 1.5))
def test_accepted_configs_finish_and_keep_every_invariant(cfg, seed, sigma):
    if cfg is None:
        return
    records = [PromptRecord(prompt=f"{i:03d}=", answer="123") for i in range(40)]
    handed_out: list[str] = []
    loader = PromptDataLoader(records, max_num_epochs=1, seed=seed)
    original_next = loader.next_item

    def recording_next():
        item = original_next()
        if item is not None:
            handed_out.append(item.prompt_id)
        return item

    loader.next_item = recording_next  # type: ignore[method-assign]
    engine = FakeGenerationBackend(
        latency=LatencyModel("lognormal", seconds=0.002, sigma=sigma), seed=seed
    )
    peaks = {"buffer": 0, "inflight": 0}

    async def go():
        controller = build_fake_controller(
            cfg, trainer=FakeTrainer(), engines=[engine], dataloader=loader
        )
        notify = controller._notify

        def probing_notify():
            peaks["buffer"] = max(peaks["buffer"], len(controller.buffer))
            peaks["inflight"] = max(peaks["inflight"], controller.inflight_count)
            notify()

        controller._notify = probing_notify  # type: ignore[method-assign]
        await asyncio.wait_for(controller.run(), timeout=20)  # a deadlock fails here
        return controller

    controller = asyncio.run(go())
    sampler_cfg = cfg.async_rl.sampler
    window = getattr(sampler_cfg, "max_lookahead_versions", None)
    if window is None:
        window = sampler_cfg.max_staleness_versions
    trained = [group.group_id for _, group in controller.trained_groups]
    assert len(trained) == len(set(trained))
    assert len(controller.history) == 4
    if sampler_cfg.name != "ready_first":
        assert all(group.staleness <= window for _, group in controller.trained_groups)
    assert all(group.staleness >= 0 for _, group in controller.trained_groups)
    assert peaks["buffer"] <= cfg.async_rl.max_buffered_rollouts
    assert peaks["inflight"] <= cfg.async_rl.max_inflight_prompts

    evicted_or_aborted = sum(
        row["evicted_groups"] + row["aborted_groups"] for row in controller.history
    )
    if sampler_cfg.name != "windowed":
        assert evicted_or_aborted == 0
    buffered = {slot.group_id for slot in controller.buffer.live_groups()}
    unaccounted = set(handed_out) - set(trained) - buffered
    # only windowed may lose prompts, and exactly the ones it evicted or aborted as stale
    assert len(unaccounted) == evicted_or_aborted
