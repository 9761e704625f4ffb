"""The drain gate (async_rl.in_flight_weight_updates: false) with fakes: every completion comes
from one weight version, under every sampler; requests past the deadline are generated again."""

from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from tandemrl.config.loader import load_config
from tandemrl.config.validate import validate_single_controller_config
from tandemrl.controller.build import build_fake_controller
from tandemrl.generation.fake import FakeGenerationBackend, LatencyModel
from tandemrl.training.fake import FakeTrainer

N, G = 4, 2
SAMPLERS = {
    "in_order": ("{name: in_order, max_lookahead_versions: 1}", N),
    "weight_fifo": ("{name: weight_fifo, max_staleness_versions: 1}", 2),
    "ready_first": ("{name: ready_first, max_staleness_versions: 1}", 2),
    "windowed": ("{name: windowed, max_staleness_versions: 1}", 2),
}
# Long-tail requests (median 8 ms) against 10 ms train steps: many span a weight sync.
LATENCY = LatencyModel("lognormal", seconds=0.008, sigma=1.0)


def make_cfg(sampler: str, min_groups: int, *overrides: str):
    cfg = load_config(
        "examples/configs/grpo_tiny_cpu.yaml",
        (
            f"grpo.num_prompts_per_step={N}",
            f"grpo.num_generations_per_prompt={G}",
            f"policy.train_global_batch_size={N * G}",
            f"policy.train_micro_batch_size={N * G}",
            "grpo.max_num_steps=8",
            f"async_rl.sampler={sampler}",
            f"async_rl.min_groups_for_streaming_train={min_groups}",
            f"async_rl.max_buffered_rollouts={3 * N}",
            f"async_rl.max_inflight_prompts={2 * N}",
            "logger.progress=false",
            *overrides,
        ),
    )
    validate_single_controller_config(cfg)
    return cfg


def run(cfg):
    """(controller, history, (start, end) weight version of every committed row)."""
    versions: list[tuple[int, int]] = []

    async def go():
        controller = build_fake_controller(
            cfg,
            trainer=FakeTrainer(train_seconds_per_step=0.01),
            engines=[FakeGenerationBackend(latency=LATENCY, seed=2)],
        )
        commit = controller.buffer.commit

        def recording_commit(group_id, rows_meta, *, end_weight):
            versions.extend((m.start_weight_version, m.end_weight_version) for m in rows_meta)
            return commit(group_id, rows_meta, end_weight=end_weight)

        controller.buffer.commit = recording_commit
        history = await asyncio.wait_for(controller.run(), timeout=60)
        return controller, history

    controller, history = asyncio.run(go())
    return controller, history, versions


@pytest.mark.parametrize("name", list(SAMPLERS))
def test_every_completion_comes_from_one_weight_version(name):
    sampler, min_groups = SAMPLERS[name]
    controller, history, versions = run(
        make_cfg(sampler, min_groups, "async_rl.in_flight_weight_updates=false")
    )
    assert len(history) == 8 and all(row["groups_trained"] == N for row in history)
    assert versions and all(start == end for start, end in versions)
    assert sum(row["drain/drain_s"] for row in history) > 0
    trained = Counter(group.group_id for _, group in controller.trained_groups)
    assert max(trained.values()) == 1


def test_a_standing_down_engine_wakes_for_the_drain():
    """Colocated with stand-down: requests frozen during the train step finish on the old
    weights after it (the engine wakes before the sync instead of after it)."""
    _, history, versions = run(
        make_cfg(
            *SAMPLERS["in_order"],
            "async_rl.in_flight_weight_updates=false",
            "policy.generation.colocated.enabled=true",
        )
    )
    assert len(history) == 8 and all(start == end for start, end in versions)


def test_with_in_flight_updates_completions_span_a_sync():
    """The same workload without the gate: some completions start on one version and end on
    the next (what the gate prevents)."""
    _, _, versions = run(make_cfg(*SAMPLERS["in_order"]))
    assert any(start != end for start, end in versions)


def test_past_the_deadline_requests_are_aborted_and_generated_again():
    controller, history, versions = run(
        make_cfg(
            *SAMPLERS["ready_first"],
            "async_rl.in_flight_weight_updates=false",
            "async_rl.drain_timeout_s=0",
        )
    )
    assert sum(row["drain/redispatched_groups"] for row in history) > 0
    assert all(start == end for start, end in versions)
    assert len(history) == 8 and all(row["groups_trained"] == N for row in history)
    trained = Counter(group.group_id for _, group in controller.trained_groups)
    assert max(trained.values()) == 1
    # Nothing is left owned but unfinished: the run drained its last redispatches too.
    assert controller._redispatch_after_sync == []
