"""Property test: a simulated rollout pump and train pump over each built-in sampler.

Hypothesis drives a random interleaving of dispatches, completions (in any order), failures
(each replaced through ``admit_replacement``) and train-pump rounds (streaming chunks until a
full step of N groups). Checked throughout: the buffer never overflows, in_order trains each
group at its target_step, in_order / weight_fifo / windowed never train a group staler than
their window, and no in_order / weight_fifo group ages out of it while waiting; and at the end, letting every rollout finish always lets training progress
(no gate, capacity or replacement deadlock).
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tandemrl.buffer import ReplayBuffer
from tandemrl.records import RowMeta
from tandemrl.samplers import (
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    WeightFifoSampler,
    WindowedSampler,
)

GROUP_SIZE = 1


def make_sampler(mode: str, n: int, lookahead: int) -> tuple[PromptGroupSampler, ReplayBuffer]:
    if mode == "in_order":
        capacity = n * (lookahead + 1)
        buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=capacity)
        return InOrderSampler(buffer, groups_per_step=n, max_lookahead_versions=lookahead), buffer
    if mode == "windowed":
        buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=n * (lookahead + 1) + 1)
        sampler = WindowedSampler(buffer, groups_per_step=n, max_staleness_versions=lookahead)
        assert sampler.required_buffer_capacity(n) <= buffer.capacity
        return sampler, buffer
    cls = WeightFifoSampler if mode == "weight_fifo" else ReadyFirstSampler
    sampler = cls(
        ReplayBuffer(group_size=GROUP_SIZE, capacity=n * (lookahead + 1)),
        groups_per_step=n,
        max_staleness_versions=lookahead,
    )
    assert sampler.required_buffer_capacity(n) == sampler.buffer.capacity
    return sampler, sampler.buffer


class Run:
    def __init__(self, mode: str, n: int, lookahead: int) -> None:
        self.mode, self.n, self.lookahead = mode, n, lookahead
        self.sampler, self.buffer = make_sampler(mode, n, lookahead)
        self.version = 0
        self.next_group = 0
        self.step_groups: list[str] = []
        self.trained: list[str] = []

    def check_nothing_aged_out(self) -> None:
        """Gated FIFO modes: every live group can still be trained within the window."""
        if self.mode in ("in_order", "weight_fifo"):
            for slot in self.buffer.live_groups():
                assert slot.start_weight >= self.version - self.lookahead, (slot, self.version)
                if self.mode == "in_order":
                    assert slot.target_step >= self.version, (slot, self.version)

    def version_fn(self) -> int:
        return self.version

    async def dispatch(self) -> bool:
        if not (self.sampler.gate_open(self.version) and self.buffer.has_capacity()):
            return False
        stamp = await self.sampler.admit(trainer_version_fn=self.version_fn)
        self._reserve(stamp)
        return True

    def _reserve(self, target_step: int | None) -> None:
        group_id = f"g{self.next_group}"
        self.next_group += 1
        self.buffer.reserve(group_id, self.version, target_step=target_step)

    def finish(self, pick: int) -> None:
        inflight = self.buffer.reserved_groups()
        if inflight:
            slot = inflight[pick % len(inflight)]
            row = RowMeta(f"{slot.group_id}-s0", slot.group_id, 0, 0.0, 1.0, 1, 1, False, 0, 0)
            self.buffer.commit(slot.group_id, [row], end_weight=self.version)

    def fail(self, pick: int) -> None:
        inflight = self.buffer.reserved_groups()
        if inflight:
            slot = self.buffer.remove(inflight[pick % len(inflight)].group_id)
            self.sampler.on_group_removed(slot)
            self._reserve(self.sampler.admit_replacement(slot.target_step))

    async def train(self, pick: int = 0) -> None:
        """One train-pump round: evict (windowed), then claim a chunk of 1..remaining groups."""
        if self.mode == "windowed":
            await self.sampler.evict(current_train_weight=self.version)
            for slot in self.buffer.reserved_groups():
                if self.sampler.should_abort_inflight(
                    start_weight=slot.start_weight, current_train_weight=self.version
                ):
                    self.buffer.remove(slot.group_id)
        groups, _ = await self.sampler.select(
            current_train_weight=self.version,
            min_prompt_groups=1,
            max_prompt_groups=1 + pick % (self.n - len(self.step_groups)),
        )
        for slot in groups or []:
            staleness = self.version - slot.start_weight
            assert staleness >= 0
            if self.mode != "ready_first":
                assert staleness <= self.lookahead, (slot, self.version)
            if self.mode == "in_order":
                assert slot.target_step == self.version
            self.step_groups.append(slot.group_id)
        if len(self.step_groups) == self.n:
            self.buffer.release_claims(self.step_groups, consumed=True)
            self.trained += self.step_groups
            self.step_groups = []
            self.version += 1
            self.sampler.notify()


ACTIONS = st.lists(
    st.tuples(
        st.sampled_from(["dispatch", "dispatch", "finish", "finish", "fail", "train"]),
        st.integers(min_value=0, max_value=1000),
    ),
    max_size=120,
)


@pytest.mark.parametrize("mode", ["in_order", "weight_fifo", "ready_first", "windowed"])
@settings(max_examples=75, deadline=None)
@given(
    n=st.integers(min_value=1, max_value=3),
    lookahead=st.integers(min_value=0, max_value=2),
    actions=ACTIONS,
)
def test_simulated_pumps_respect_windows_and_never_deadlock(mode, n, lookahead, actions) -> None:
    async def scenario() -> None:
        run = Run(mode, n, lookahead)
        for action, pick in actions:
            if action == "dispatch":
                await run.dispatch()
            elif action == "finish":
                run.finish(pick)
            elif action == "fail":
                run.fail(pick)
            else:
                await run.train(pick)
            assert len(run.buffer) <= run.buffer.capacity
            run.check_nothing_aged_out()
        # Drain: every rollout finishes; training must keep moving.
        start_version = run.version
        for _ in range(20 * (lookahead + 2)):
            while await run.dispatch():
                pass
            for _ in range(len(run.buffer.reserved_groups())):
                run.finish(0)
            await run.train(0)  # chunks of one group: the slowest way to fill a step
            if run.version >= start_version + 3:
                break
        assert run.version >= start_version + 3, f"stuck at version {run.version}"
        assert len(run.trained) == len(set(run.trained))

    asyncio.run(scenario())
