"""Silent waste: a run that evicts a large share of its groups says so, naming the knobs,
a few times over the run rather than every step (fake engine and trainer)."""

from __future__ import annotations

import asyncio
import logging
import math

from tandemrl.config.loader import load_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.controller.eviction_warning import EvictionWatch
from tandemrl.generation.fake import FakeGenerationBackend
from tandemrl.training.fake import FakeTrainer

N, G = 4, 2
STEPS = 12
LOGGER = "tandemrl.controller.eviction_warning"


def run(*overrides: str):
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"grpo.num_prompts_per_step={N}",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={N * G}",
            f"policy.train_micro_batch_size={N * G}",
            f"grpo.max_num_steps={STEPS}",
            "logger.progress=false",
            *overrides,
        ),
    )

    async def go():
        controller = build_fake_controller(
            cfg,
            # Training is slower than the (instant) fake generation: the buffer is always full.
            trainer=FakeTrainer(train_seconds_per_step=0.005),
            engines=[FakeGenerationBackend(seed=0)],
        )
        history = await asyncio.wait_for(controller.run(), timeout=60)
        return controller, history

    return asyncio.run(go())


# Ungated, a buffer four steps deep and a window of one version: most of it ages out.
WASTEFUL_WINDOWED = (
    "async_rl.sampler={name: windowed, max_staleness_versions: 1, sample_freshest_first: true}",
    "loss_fn.use_importance_sampling_correction=true",
    f"async_rl.max_buffered_rollouts={4 * N}",
    f"async_rl.max_inflight_prompts={4 * N}",
    f"async_rl.min_groups_for_streaming_train={N}",
)


def test_a_windowed_run_that_evicts_more_than_it_trains_warns_with_the_knobs(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        controller, history = run(*WASTEFUL_WINDOWED)
    evicted = sum(row["evicted_groups"] for row in history)
    trained = sum(row["groups_trained"] for row in history)
    assert len(history) == STEPS and evicted > trained  # the premise: a wasteful run
    warnings = [r.getMessage() for r in caplog.records if r.name == LOGGER]
    assert warnings == controller.eviction_watch.warnings
    # Rate-limited: the evicted count doubles between warnings, so a handful, not one a step.
    assert 1 <= len(warnings) <= math.log2(evicted / N) + 1 < STEPS
    for message in warnings:
        assert "async_rl.sampler.max_staleness_versions=1" in message
        assert f"async_rl.max_buffered_rollouts (now {4 * N})" in message
        assert f"async_rl.max_inflight_prompts (now {4 * N})" in message
        assert "sample_freshest_first: true" in message
    # The figures are the run's own: every evicted group is counted.
    assert controller.eviction_watch.evicted == evicted


def test_a_run_that_never_evicts_stays_quiet(caplog):
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        controller, history = run()  # the default job's in_order sampler never evicts
    assert len(history) == STEPS
    assert [r for r in caplog.records if r.name == LOGGER] == []
    assert controller.eviction_watch.warnings == []


def test_the_watch_judges_the_share_and_then_waits_for_the_waste_to_double():
    watch = EvictionWatch(advice="lower the knobs.", groups_per_step=4)
    assert watch.observe(evicted=3, trained_groups=0) is None  # less than a step's worth
    assert watch.observe(evicted=0, trained_groups=8) is None
    assert watch.observe(evicted=1, trained_groups=8) is None  # 4 evicted, 8 trained: 50%
    first = watch.observe(evicted=1, trained_groups=8)  # 5 > 0.5 x 8
    assert first == (
        "5 prompt groups evicted against 8 trained so far (62% of trained): their generation "
        "was wasted. lower the knobs."
    )
    assert watch.observe(evicted=4, trained_groups=12) is None  # 9 < 10: not doubled yet
    second = watch.observe(evicted=1, trained_groups=12)  # 10 = 2 x 5
    assert second is not None and second.startswith("10 prompt groups evicted against 12")
    assert watch.observe(evicted=100, trained_groups=1000) is None  # below the share again
    assert len(watch.warnings) == 2


def test_a_resumed_run_compares_against_the_groups_it_trained_itself():
    watch = EvictionWatch(advice="", groups_per_step=4)
    assert watch.observe(evicted=0, trained_groups=5000) is None  # restored from a checkpoint
    assert watch.observe(evicted=6, trained_groups=5008) is not None  # 6 against 8
