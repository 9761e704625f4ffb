"""Samplers: gates per mode, waiting and waking, drops and replacements, selection, eviction,
claims, dispatch-state save/restore, lookahead retuning, custom sampler import and checks."""

from __future__ import annotations

import asyncio
import json
import textwrap
import uuid
from pathlib import Path

import pytest

from tandemrl.buffer import ReplayBuffer
from tandemrl.config.models import (
    CustomSamplerConfig,
    InOrderSamplerConfig,
    ReadyFirstSamplerConfig,
    WeightFifoSamplerConfig,
    WindowedSamplerConfig,
)
from tandemrl.records import RowMeta
from tandemrl.samplers import (
    InOrderSampler,
    PromptGroupSampler,
    ReadyFirstSampler,
    SamplerClosed,
    SamplerConfigError,
    SamplerError,
    StructuralSamplerAdapter,
    WeightFifoSampler,
    WindowedSampler,
    create_sampler,
    load_sampler_class,
)

GROUP_SIZE = 2


def rows(group_id: str) -> list[RowMeta]:
    return [
        RowMeta(f"{group_id}-s{i}", group_id, i, 0.5, 1.0, 3, 4, False, 0, 0)
        for i in range(GROUP_SIZE)
    ]


def add(buffer: ReplayBuffer, group_id: str, start_weight: int, *, ready: bool = True, target=None):
    buffer.reserve(group_id, start_weight, target_step=target)
    if ready:
        buffer.commit(group_id, rows(group_id), end_weight=start_weight)


def new_buffer(capacity: int = 16) -> ReplayBuffer:
    return ReplayBuffer(group_size=GROUP_SIZE, capacity=capacity)


def ids(groups) -> list[str] | None:
    return None if groups is None else [slot.group_id for slot in groups]


def select(sampler, weight: int, lo: int = 1, hi: int = 8):
    return asyncio.run(
        sampler.select(current_train_weight=weight, min_prompt_groups=lo, max_prompt_groups=hi)
    )


class Version:
    """A trainer version the test bumps; ``fn`` is what the pump passes to admit."""

    def __init__(self) -> None:
        self.value = 0

    def fn(self) -> int:
        return self.value


async def admit_now(sampler: PromptGroupSampler, version: Version):
    """Admit if the gate is open right now; None-sentinel 'blocked' otherwise (no waiting)."""
    task = asyncio.ensure_future(sampler.admit(trainer_version_fn=version.fn))
    for _ in range(3):
        await asyncio.sleep(0)
    if task.done():
        return task.result()
    task.cancel()
    return "blocked"


# --------------------------------------------------------------------------- gates


@pytest.mark.parametrize(
    ("sampler_cls", "kwargs", "stamps"),
    [
        (InOrderSampler, {"max_lookahead_versions": 1}, [0, 0, 1, 1]),
        (WeightFifoSampler, {"max_staleness_versions": 1}, [None] * 4),
        (ReadyFirstSampler, {"max_staleness_versions": 1}, [None] * 4),
    ],
)
def test_gated_samplers_lead_by_at_most_lookahead_batches(sampler_cls, kwargs, stamps) -> None:
    async def scenario() -> None:
        sampler = sampler_cls(new_buffer(), groups_per_step=2, **kwargs)
        version = Version()
        got = [await admit_now(sampler, version) for _ in range(4)]
        assert got == stamps
        assert await admit_now(sampler, version) == "blocked"  # batch 2 > version 0 + 1
        waiting = asyncio.ensure_future(sampler.admit(trainer_version_fn=version.fn))
        await asyncio.sleep(0)
        sampler.notify()  # a notify without a version bump re-checks and keeps waiting
        await asyncio.sleep(0)
        assert not waiting.done()
        version.value = 1
        sampler.notify()
        stamp = await asyncio.wait_for(waiting, timeout=5)
        assert stamp == (2 if sampler_cls is InOrderSampler else None)
        assert await admit_now(sampler, version) == stamp
        assert await admit_now(sampler, version) == "blocked"

    asyncio.run(scenario())


def test_in_order_sync_mode_dispatches_one_step_at_a_time() -> None:
    async def scenario() -> None:
        sampler = InOrderSampler(new_buffer(), groups_per_step=3, max_lookahead_versions=0)
        version = Version()
        assert [await admit_now(sampler, version) for _ in range(4)] == [0, 0, 0, "blocked"]
        version.value = 1
        assert [await admit_now(sampler, version) for _ in range(4)] == [1, 1, 1, "blocked"]

    asyncio.run(scenario())


def test_windowed_is_ungated() -> None:
    async def scenario() -> None:
        sampler = WindowedSampler(new_buffer(), groups_per_step=2, max_staleness_versions=0)
        stamps = [await admit_now(sampler, Version()) for _ in range(50)]
        assert stamps == [None] * 50 and sampler.num_admitted == 50

    asyncio.run(scenario())


def test_close_ends_waiting_and_future_admits() -> None:
    async def scenario() -> None:
        sampler = InOrderSampler(new_buffer(), groups_per_step=1, max_lookahead_versions=0)
        version = Version()
        await sampler.admit(trainer_version_fn=version.fn)
        waiters = [
            asyncio.ensure_future(sampler.admit(trainer_version_fn=version.fn)) for _ in range(2)
        ]
        await asyncio.sleep(0)
        sampler.close()
        for waiter in waiters:
            with pytest.raises(SamplerClosed):
                await asyncio.wait_for(waiter, timeout=5)
        with pytest.raises(SamplerClosed):
            await sampler.admit(trainer_version_fn=version.fn)

    asyncio.run(scenario())


# --------------------------------------------------------------------------- drops


def test_in_order_drop_keeps_its_slot_and_replacement_is_not_gated() -> None:
    async def scenario() -> None:
        buffer = new_buffer()
        sampler = InOrderSampler(buffer, groups_per_step=2, max_lookahead_versions=0)
        version = Version()
        for i in range(2):
            target = await admit_now(sampler, version)
            buffer.reserve(f"g{i}", 0, target_step=target)
        failed = buffer.remove("g1")
        sampler.on_group_removed(failed)
        sampler.notify()
        # Shrink: the hole is not handed to the next dataloader prompt.
        assert await admit_now(sampler, version) == "blocked"
        # Replace: the replacement reuses the dropped group's place at once, for step 0.
        assert sampler.admit_replacement(0) == 0
        with pytest.raises(SamplerError, match="no dropped group with target_step 0"):
            sampler.admit_replacement(0)
        with pytest.raises(SamplerError, match="needs the dropped group's target_step"):
            sampler.admit_replacement(None)

    asyncio.run(scenario())


def test_weight_fifo_replacement_cannot_deadlock_a_full_gate() -> None:
    """N=2, L=0: the step needs both groups; one fails. A gated replacement would wait for the
    trainer, which waits for the replacement; admit_replacement is admitted at once."""

    async def scenario() -> None:
        buffer = new_buffer()
        sampler = WeightFifoSampler(buffer, groups_per_step=2, max_staleness_versions=0)
        version = Version()
        for name in ("a", "b"):
            assert await admit_now(sampler, version) is None
            buffer.reserve(name, 0)
        buffer.commit("a", rows("a"), end_weight=0)
        sampler.on_group_removed(buffer.remove("b"))
        assert await admit_now(sampler, version) == "blocked"
        assert await sampler.select(
            current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2
        ) == (None, 1)
        assert sampler.admit_replacement(None) is None
        add(buffer, "b2", 0)
        groups, _ = await sampler.select(
            current_train_weight=0, min_prompt_groups=2, max_prompt_groups=2
        )
        assert ids(groups) == ["a", "b2"]

    asyncio.run(scenario())


# --------------------------------------------------------------------------- selection


def test_select_validates_bounds_and_claims_nothing_when_short() -> None:
    buffer = new_buffer()
    add(buffer, "a", 0)
    sampler = ReadyFirstSampler(buffer, groups_per_step=2, max_staleness_versions=1)
    with pytest.raises(SamplerError, match="min_prompt_groups"):
        select(sampler, 0, lo=0, hi=2)
    with pytest.raises(SamplerError, match="min_prompt_groups"):
        select(sampler, 0, lo=3, hi=2)
    assert select(sampler, 0, lo=2, hi=2) == (None, 1)
    assert buffer.num_claimed == 0


def test_claims_are_not_reselected_until_rolled_back() -> None:
    buffer = new_buffer()
    for name in "abc":
        add(buffer, name, 0)
    sampler = ReadyFirstSampler(buffer, groups_per_step=2, max_staleness_versions=1)
    first, n = select(sampler, 0, lo=1, hi=2)
    assert ids(first) == ["a", "b"] and n == 3
    second, _ = select(sampler, 0, lo=1, hi=2)
    assert ids(second) == ["c"]
    buffer.release_claims(["a", "b"], consumed=False)
    again, _ = select(sampler, 0, lo=1, hi=2)
    assert ids(again) == ["a", "b"]


def test_in_order_selects_only_its_target_step() -> None:
    buffer = new_buffer()
    add(buffer, "s0", 0, target=0)
    add(buffer, "s1a", 0, target=1)
    add(buffer, "s1b", 0, target=1, ready=False)
    sampler = InOrderSampler(buffer, groups_per_step=2, max_lookahead_versions=1)
    assert sampler.pending_for_step(1) == 1
    assert select(sampler, 1, lo=2, hi=2) == (None, 1)
    groups, _ = select(sampler, 1, lo=1, hi=2)
    assert ids(groups) == ["s1a"]
    assert ids(buffer.ready_groups()) == ["s0"]


def test_promoted_group_fills_a_dropped_place_for_in_order() -> None:
    buffer = new_buffer()
    add(buffer, "s2a", 1, target=2)
    add(buffer, "s3a", 1, target=3)
    sampler = InOrderSampler(buffer, groups_per_step=2, max_lookahead_versions=1)
    buffer.promote_ready_group("s3a", 2)
    groups, _ = select(sampler, 2, lo=2, hi=2)
    assert ids(groups) == ["s2a", "s3a"]


def test_promotion_moves_the_replacement_credit_to_the_later_step() -> None:
    buffer = new_buffer()
    sampler = InOrderSampler(buffer, groups_per_step=2, max_lookahead_versions=1)
    buffer.reserve("s2b", 1, target_step=2)
    add(buffer, "s3a", 1, target=3)
    sampler.on_group_removed(buffer.remove("s2b"))
    buffer.promote_ready_group("s3a", 2)
    sampler.on_group_promoted(from_step=3, to_step=2)
    with pytest.raises(SamplerError, match="target_step 2"):
        sampler.admit_replacement(2)
    assert sampler.admit_replacement(3) == 3
    with pytest.raises(SamplerError, match="target_step 3"):
        sampler.on_group_promoted(from_step=4, to_step=3)


def test_ready_first_trains_late_stragglers_that_weight_fifo_and_windowed_do_not() -> None:
    def straggler_buffer() -> ReplayBuffer:
        buffer = new_buffer()
        add(buffer, "old", 0)  # staleness 5 at trainer version 5, window is 1
        add(buffer, "fresh", 5)
        return buffer

    ready_first = ReadyFirstSampler(straggler_buffer(), groups_per_step=2, max_staleness_versions=1)
    assert ids(select(ready_first, 5)[0]) == ["old", "fresh"]
    weight_fifo = WeightFifoSampler(straggler_buffer(), groups_per_step=2, max_staleness_versions=1)
    assert ids(select(weight_fifo, 5)[0]) == ["fresh"]
    windowed = WindowedSampler(straggler_buffer(), groups_per_step=2, max_staleness_versions=1)
    assert ids(select(windowed, 5)[0]) == ["fresh"]


def test_weight_fifo_waits_for_oldest_weight_then_moves_on() -> None:
    buffer = new_buffer()
    add(buffer, "w0a", 0)
    add(buffer, "w0b", 0, ready=False)
    add(buffer, "w1a", 1)
    sampler = WeightFifoSampler(buffer, groups_per_step=2, max_staleness_versions=1)
    assert select(sampler, 1, lo=2, hi=2) == (None, 1)  # waits for w0b, does not take w1a
    buffer.commit("w0b", rows("w0b"), end_weight=1)
    assert ids(select(sampler, 1, lo=2, hi=2)[0]) == ["w0a", "w0b"]
    assert ids(select(sampler, 1, lo=1, hi=2)[0]) == ["w1a"]


def test_weight_fifo_does_not_let_a_slow_group_age_out() -> None:
    """N=1, L=1: g0 and g1 dispatched at weight 0; g1 finishes first and trains step 0; g2
    (weight 1) finishes before g0. Taking g2 at step 1 would leave g0 (weight 0) outside the
    window [1, 2] at step 2, never trainable; weight_fifo waits for g0 instead."""
    buffer = new_buffer()
    add(buffer, "g0", 0, ready=False)
    add(buffer, "g2", 1)
    sampler = WeightFifoSampler(buffer, groups_per_step=1, max_staleness_versions=1)
    assert select(sampler, 1, lo=1, hi=1) == (None, 0)
    buffer.commit("g0", rows("g0"), end_weight=1)
    assert ids(select(sampler, 1, lo=1, hi=1)[0]) == ["g0"]


def test_weight_fifo_ignores_in_flight_groups_older_than_the_window() -> None:
    buffer = new_buffer()
    add(buffer, "ancient", 0, ready=False)
    add(buffer, "w2", 2)
    sampler = WeightFifoSampler(buffer, groups_per_step=2, max_staleness_versions=1)
    assert ids(select(sampler, 3, lo=1, hi=2)[0]) == ["w2"]


def test_windowed_freshest_first_and_window() -> None:
    def window_buffer() -> ReplayBuffer:
        buffer = new_buffer()
        for name, weight in [("w1", 1), ("w2a", 2), ("w3", 3), ("w2b", 2), ("w4", 4)]:
            add(buffer, name, weight)
        return buffer

    buffer = window_buffer()
    oldest_first = WindowedSampler(buffer, groups_per_step=2, max_staleness_versions=1)
    groups, n = select(oldest_first, 3, hi=2)
    assert ids(groups) == ["w2a", "w3"] and n == 3  # w1 too old, w4 newer than the trainer
    freshest = WindowedSampler(
        window_buffer(), groups_per_step=2, max_staleness_versions=1, sample_freshest_first=True
    )
    assert ids(select(freshest, 3, hi=3)[0]) == ["w3", "w2a", "w2b"]


# --------------------------------------------------------------------------- eviction


def test_windowed_evicts_aged_ready_groups_only() -> None:
    buffer = new_buffer()
    add(buffer, "aged", 1)
    add(buffer, "inflight-aged", 0, ready=False)
    add(buffer, "kept", 2)
    sampler = WindowedSampler(buffer, groups_per_step=2, max_staleness_versions=1)
    evicted = asyncio.run(sampler.evict(current_train_weight=3))
    assert ids(evicted) == ["aged"] and evicted[0].sample_ids == ["aged-s0", "aged-s1"]
    assert ids(buffer.live_groups()) == ["inflight-aged", "kept"]
    assert sampler.should_abort_inflight(start_weight=0, current_train_weight=3)
    assert not sampler.should_abort_inflight(start_weight=2, current_train_weight=3)


@pytest.mark.parametrize(
    "sampler_cls", [InOrderSampler, WeightFifoSampler, ReadyFirstSampler], ids=lambda c: c.name
)
def test_gated_samplers_never_evict_or_abort(sampler_cls) -> None:
    buffer = new_buffer()
    add(buffer, "old", 0, target=0)
    sampler = sampler_cls(buffer, groups_per_step=1)
    assert asyncio.run(sampler.evict(current_train_weight=10)) == []
    assert ids(buffer.live_groups()) == ["old"]
    assert not sampler.should_abort_inflight(start_weight=0, current_train_weight=10)


# --------------------------------------------------------------------------- state, lookahead


def test_dispatch_state_round_trip_continues_stamps() -> None:
    async def scenario() -> None:
        sampler = InOrderSampler(new_buffer(), groups_per_step=2, max_lookahead_versions=1)
        version = Version()
        assert [await admit_now(sampler, version) for _ in range(3)] == [0, 0, 1]
        sampler.on_group_removed(new_buffer().reserve("x", 0, target_step=1))
        state = json.loads(json.dumps(sampler.dispatch_state()))
        restored = InOrderSampler(new_buffer(), groups_per_step=2, max_lookahead_versions=1)
        restored.load_dispatch_state(state)
        assert await admit_now(restored, version) == 1
        assert await admit_now(restored, version) == "blocked"
        assert restored.readmit(1) == 1  # an in-flight group of the snapshot, not re-charged
        with pytest.raises(SamplerError, match=r"steps 0\.\.1"):
            restored.readmit(2)
        assert restored.admit_replacement(1) == 1

    asyncio.run(scenario())


def test_load_dispatch_state_refuses_mismatch_without_mutating() -> None:
    sampler = InOrderSampler(new_buffer(), groups_per_step=2, max_lookahead_versions=1)
    state = sampler.dispatch_state()
    other = WeightFifoSampler(new_buffer(), groups_per_step=2, max_staleness_versions=1)
    with pytest.raises(SamplerError, match="saved by the 'in_order' sampler"):
        other.load_dispatch_state(state)
    for bad in ({"num_admitted": -1}, {"lookahead_versions": 5}, {"replacement_credits": "x"}):
        with pytest.raises(SamplerError, match="dispatch state"):
            sampler.load_dispatch_state({**state, "num_admitted": 7, **bad})
        assert sampler.num_admitted == 0 and sampler.lookahead_at(0) == 1


def test_lookahead_is_wide_during_the_critic_warmup_then_shrinks() -> None:
    async def scenario() -> None:
        sampler = InOrderSampler(
            new_buffer(),
            groups_per_step=1,
            max_lookahead_versions=0,
            warmup_lookahead_versions=2,
            policy_training_start_step=2,
        )
        version = Version()
        assert sampler.lookahead_at(0) == 2  # PPO critic warm-up starts wide
        assert [await admit_now(sampler, version) for _ in range(4)] == [0, 1, 2, "blocked"]
        version.value = 2  # warm-up over: lookahead 0
        assert sampler.lookahead_at(2) == 0
        assert await admit_now(sampler, version) == "blocked"  # step 3 > 2 + 0
        waiting = asyncio.ensure_future(sampler.admit(trainer_version_fn=version.fn))
        await asyncio.sleep(0)
        version.value = 3
        sampler.notify()  # wakes the waiter, which re-reads the version
        assert await asyncio.wait_for(waiting, timeout=5) == 3
        assert WindowedSampler(new_buffer(), groups_per_step=1).lookahead_at(0) is None
        with pytest.raises(SamplerError, match=">= 0"):
            InOrderSampler(new_buffer(), groups_per_step=1, max_lookahead_versions=-1)

    asyncio.run(scenario())


def test_required_buffer_capacity_per_mode() -> None:
    b = new_buffer()
    assert (
        InOrderSampler(b, groups_per_step=4, max_lookahead_versions=1).required_buffer_capacity(4)
        == 8
    )
    warm = InOrderSampler(
        b, groups_per_step=4, max_lookahead_versions=1, warmup_lookahead_versions=3
    )
    assert warm.required_buffer_capacity(4) == 16
    assert (
        WeightFifoSampler(b, groups_per_step=4, max_staleness_versions=2).required_buffer_capacity(
            4
        )
        == 12
    )
    assert (
        ReadyFirstSampler(b, groups_per_step=4, max_staleness_versions=0).required_buffer_capacity(
            4
        )
        == 4
    )
    assert (
        WindowedSampler(b, groups_per_step=4, max_staleness_versions=3).required_buffer_capacity(4)
        == 4
    )


def test_create_sampler_builtins() -> None:
    b = new_buffer()
    cases = [
        (InOrderSamplerConfig(name="in_order", max_lookahead_versions=2), InOrderSampler),
        (WeightFifoSamplerConfig(name="weight_fifo", max_staleness_versions=2), WeightFifoSampler),
        (ReadyFirstSamplerConfig(name="ready_first"), ReadyFirstSampler),
        (WindowedSamplerConfig(name="windowed", sample_freshest_first=True), WindowedSampler),
    ]
    for cfg, cls in cases:
        sampler = create_sampler(cfg, b, groups_per_step=3)
        assert type(sampler) is cls and sampler.name == cfg.name
        assert sampler.supports_buffer_checkpoint and sampler.supports_training_claims
        assert sampler.groups_per_step == 3
    assert create_sampler(cases[0][0], b, groups_per_step=3).lookahead_at(0) == 2
    assert create_sampler(cases[3][0], b, groups_per_step=3).sample_freshest_first


# --------------------------------------------------------------------------- custom


@pytest.fixture
def plugin(tmp_path: Path, monkeypatch):
    """Write a module of custom samplers under a unique name; return that name."""
    name = f"custom_samplers_{uuid.uuid4().hex[:8]}"
    (tmp_path / f"{name}.py").write_text(
        textwrap.dedent(
            """
            from tandemrl.samplers import PromptGroupSampler

            class NewestFirst(PromptGroupSampler):
                name = "newest_first"
                supports_buffer_checkpoint = True

                def __init__(self, buffer, *, groups_per_step, batch_cap=1):
                    super().__init__(buffer, groups_per_step=groups_per_step)
                    self.batch_cap = batch_cap

                async def select(self, *, current_train_weight, min_prompt_groups, max_prompt_groups):
                    eligible = list(reversed(self.buffer.ready_groups()))
                    return self._claim(eligible, min_prompt_groups, min(max_prompt_groups, self.batch_cap))

                def required_buffer_capacity(self, groups_per_step):
                    return 2 * groups_per_step

            class Incomplete(PromptGroupSampler):
                def required_buffer_capacity(self, groups_per_step):
                    return groups_per_step

            class Duck:
                def __init__(self, buffer, groups_per_step):
                    self.buffer = buffer

                async def admit(self, *, trainer_version_fn):
                    import asyncio
                    await asyncio.Event().wait()  # never opens by itself

                async def select(self, *, current_train_weight, min_prompt_groups, max_prompt_groups):
                    return None, 0

                async def evict(self, *, current_train_weight):
                    return []

                def should_abort_inflight(self, *, start_weight, current_train_weight):
                    return False

                def required_buffer_capacity(self, groups_per_step):
                    return groups_per_step

            class SyncDuck(Duck):
                def select(self, *, current_train_weight, min_prompt_groups, max_prompt_groups):
                    return None, 0

            not_a_class = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def custom_cfg(target: str, **extra) -> CustomSamplerConfig:
    return CustomSamplerConfig(name="custom", target=target, **extra)


def test_custom_subclass_gets_kwargs_and_works(plugin: str) -> None:
    buffer = new_buffer()
    for name in "abc":
        add(buffer, name, 0)
    sampler = create_sampler(
        custom_cfg(f"{plugin}:NewestFirst", batch_cap=2), buffer, groups_per_step=2
    )
    assert sampler.batch_cap == 2 and sampler.supports_buffer_checkpoint
    assert not sampler.supports_training_claims
    assert sampler.required_buffer_capacity(2) == 4
    assert ids(select(sampler, 0, hi=5)[0]) == ["c", "b"]
    assert load_sampler_class(f"{plugin}:NewestFirst").supports_buffer_checkpoint is True


@pytest.mark.parametrize(
    ("target", "message"),
    [
        ("no_colon_here", "not of the form 'module:ClassName'"),
        ("tandemrl_missing_mod_xyz:Cls", "cannot import module"),
        ("{plugin}:Missing", "has no attribute 'Missing'"),
        ("{plugin}:not_a_class", "is a int, not a class"),
        ("{plugin}:Incomplete", "does not implement select"),
        ("{plugin}:SyncDuck", r"select \(must be an async def\)"),
        ("json:JSONDecoder", "is not a PromptGroupSampler"),
    ],
)
def test_custom_target_errors_name_the_dotpath(plugin: str, target: str, message: str) -> None:
    with pytest.raises(SamplerConfigError, match=r"async_rl\.sampler\.target") as info:
        load_sampler_class(target.format(plugin=plugin))
    assert info.match(message)


def test_custom_constructor_errors(plugin: str) -> None:
    with pytest.raises(SamplerConfigError, match=r"constructing .*unknown_knob"):
        create_sampler(
            custom_cfg(f"{plugin}:NewestFirst", unknown_knob=1), new_buffer(), groups_per_step=1
        )
    with pytest.raises(SamplerConfigError, match="groups_per_step cannot be set"):
        create_sampler(
            custom_cfg(f"{plugin}:NewestFirst", groups_per_step=1), new_buffer(), groups_per_step=1
        )


def test_structural_custom_sampler_is_adapted_and_closable(plugin: str) -> None:
    async def scenario() -> None:
        sampler = create_sampler(custom_cfg(f"{plugin}:Duck"), new_buffer(), groups_per_step=2)
        assert isinstance(sampler, StructuralSamplerAdapter)
        assert sampler.supports_buffer_checkpoint is False
        assert await sampler.select(
            current_train_weight=0, min_prompt_groups=1, max_prompt_groups=1
        ) == (None, 0)
        assert sampler.required_buffer_capacity(2) == 2
        waiting = asyncio.ensure_future(sampler.admit(trainer_version_fn=lambda: 0))
        await asyncio.sleep(0)
        sampler.close()
        with pytest.raises(SamplerClosed):
            await asyncio.wait_for(waiting, timeout=5)

    asyncio.run(scenario())


def test_windowed_over_sampling_ratio_caps_dispatch_beyond_the_window() -> None:
    """N=4, L=1, ratio 0.5: at most (1 + 1) x 4 + ceil(0.5 x 4) = 10 in-window groups; groups
    that aged out of the window no longer count, claimed ones of the open step do."""

    async def scenario() -> None:
        buffer = new_buffer(capacity=32)
        sampler = WindowedSampler(
            buffer, groups_per_step=4, max_staleness_versions=1, over_sampling_ratio=0.5
        )
        version = Version()
        assert sampler.dispatch_limit() == 10
        for i in range(10):
            assert await admit_now(sampler, version) is None
            buffer.reserve(f"g{i}", 0, target_step=None)
        assert await admit_now(sampler, version) == "blocked"
        # Training claims two of them: still in the window, still counted.
        for i in (0, 1):
            buffer.commit(f"g{i}", rows(f"g{i}"), end_weight=0)
        buffer.claim_for_training(["g0", "g1"])
        assert await admit_now(sampler, version) == "blocked"
        # Version 2: start_weight 0 is out of the window [1, 2]; nothing counts any more.
        version.value = 2
        assert await admit_now(sampler, version) is None
        assert WindowedSampler(buffer, groups_per_step=4).dispatch_limit() is None

    asyncio.run(scenario())
