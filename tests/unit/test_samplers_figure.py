"""The reference spec's figure: one buffer, four samplers, four different training batches.

Trainer weight 2, ``num_prompts_per_step`` N = 2, staleness window [0, 2] (L = 2 for every
mode). in_order stamped each group's target_step = dispatch index // N at admission; the pump
stamped start_weight at reserve. Steps 0 and 1 are trained; what is left, in dispatch order::

    group  start_weight  target_step  state
    g4     0             2            ready
    g5     1             2            in flight   (dispatched late, finishing late)
    g6     1             3            ready
    g7     2             3            ready       (finished before g5 although dispatched after)
    g8     2             4            ready

The train pump asks for a streaming chunk: at least 1 group, at most 3.

- in_order takes the groups meant for step 2: only g4 is ready (g5 is still running).
- weight_fifo drains weight 0 (g4, complete), then weight 1: g6 is ready but g5 of the same
  weight is in flight, so it stops there rather than skip ahead to weight 2: g4, g6.
- ready_first takes any ready group with start_weight <= 2, oldest dispatch first: g4, g6, g7.
- windowed with sample_freshest_first takes the newest start_weight first: g7, g8, then g6.

They agree when rollouts finish in order: with g5 ready too, in_order picks g4, g5 and
weight_fifo and ready_first both pick g4, g5, g6.
"""

from __future__ import annotations

import asyncio

import pytest

from tandemrl.buffer import ReplayBuffer
from tandemrl.records import RowMeta
from tandemrl.samplers import (
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    WeightFifoSampler,
    WindowedSampler,
)

N = 2
TRAINER_WEIGHT = 2
GROUP_SIZE = 2
# (group_id, start_weight, target_step, ready) in dispatch order.
FIGURE = [
    ("g4", 0, 2, True),
    ("g5", 1, 2, False),
    ("g6", 1, 3, True),
    ("g7", 2, 3, True),
    ("g8", 2, 4, True),
]


def rows(group_id: str, weight: int) -> list[RowMeta]:
    return [
        RowMeta(f"{group_id}-s{i}", group_id, i, 1.0, 1.0, 3, 4, False, weight, weight)
        for i in range(GROUP_SIZE)
    ]


def figure_buffer(*, g5_ready: bool = False) -> ReplayBuffer:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=N * 3)
    for group_id, start_weight, target_step, ready in FIGURE:
        buffer.reserve(group_id, start_weight, target_step=target_step)
        if ready or (group_id == "g5" and g5_ready):
            buffer.commit(group_id, rows(group_id, start_weight), end_weight=TRAINER_WEIGHT)
    return buffer


def make(mode: str, buffer: ReplayBuffer) -> PromptGroupSampler:
    if mode == "in_order":
        return InOrderSampler(buffer, groups_per_step=N, max_lookahead_versions=2)
    if mode == "weight_fifo":
        return WeightFifoSampler(buffer, groups_per_step=N, max_staleness_versions=2)
    if mode == "ready_first":
        return ReadyFirstSampler(buffer, groups_per_step=N, max_staleness_versions=2)
    if mode == "windowed":
        return WindowedSampler(
            buffer, groups_per_step=N, max_staleness_versions=2, sample_freshest_first=True
        )
    raise AssertionError(mode)


def select(sampler: PromptGroupSampler, min_groups: int = 1, max_groups: int = 3):
    return asyncio.run(
        sampler.select(
            current_train_weight=TRAINER_WEIGHT,
            min_prompt_groups=min_groups,
            max_prompt_groups=max_groups,
        )
    )


@pytest.mark.parametrize(
    ("mode", "expected", "n_eligible"),
    [
        ("in_order", ["g4"], 1),
        ("weight_fifo", ["g4", "g6"], 2),
        ("ready_first", ["g4", "g6", "g7"], 4),
        ("windowed", ["g7", "g8", "g6"], 4),
    ],
)
def test_figure_out_of_order_completion(mode: str, expected: list[str], n_eligible: int) -> None:
    buffer = figure_buffer()
    groups, n = select(make(mode, buffer))
    assert groups is not None
    assert [slot.group_id for slot in groups] == expected
    assert n == n_eligible
    # The selection is claimed: out of the live index, held by the train step.
    assert [slot.group_id for slot in buffer.claimed_groups()] == sorted(expected)
    assert not {slot.group_id for slot in buffer.ready_groups()} & set(expected)


def test_figure_the_four_batches_all_differ() -> None:
    batches = set()
    for mode in ("in_order", "weight_fifo", "ready_first", "windowed"):
        groups, _ = select(make(mode, figure_buffer()))
        assert groups is not None
        batches.add(tuple(slot.group_id for slot in groups))
    assert len(batches) == 4


def test_figure_full_batch_request() -> None:
    """A full batch (min = max = N): in_order must wait for g5 and claims nothing meanwhile."""
    for mode, expect_batch in [
        ("in_order", None),
        ("weight_fifo", ["g4", "g6"]),
        ("ready_first", ["g4", "g6"]),
        ("windowed", ["g7", "g8"]),
    ]:
        buffer = figure_buffer()
        groups, _ = select(make(mode, buffer), min_groups=N, max_groups=N)
        assert (None if groups is None else [s.group_id for s in groups]) == expect_batch, mode
        if groups is None:
            assert buffer.num_claimed == 0 and buffer.num_ready == 4


def test_figure_in_order_completion_agrees() -> None:
    picks = {}
    for mode in ("in_order", "weight_fifo", "ready_first"):
        groups, _ = select(make(mode, figure_buffer(g5_ready=True)))
        assert groups is not None
        picks[mode] = [slot.group_id for slot in groups]
    assert picks == {
        "in_order": ["g4", "g5"],
        "weight_fifo": ["g4", "g5", "g6"],
        "ready_first": ["g4", "g5", "g6"],
    }
