"""ReplayBuffer: slot life cycle, claims, capacity, snapshots (examples and property tests)."""

from __future__ import annotations

import builtins
import copy
import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandemrl.buffer import BufferError, ReplayBuffer, ReplayBufferError, Slot
from tandemrl.records import RowMeta

GROUP_SIZE = 2


def rows_for(group_id: str, n: int = GROUP_SIZE, weight: int = 0) -> list[RowMeta]:
    return [
        RowMeta(
            sample_id=f"{group_id}-s{i}",
            group_id=group_id,
            sibling_index=i,
            reward=float(i),
            sample_mask=1.0,
            num_prompt_tokens=3,
            num_completion_tokens=4,
            truncated=False,
            start_weight_version=weight,
            end_weight_version=weight,
        )
        for i in range(n)
    ]


def committed(buffer: ReplayBuffer, group_id: str, start_weight: int = 0, **kw) -> Slot:
    buffer.reserve(group_id, start_weight, **kw)
    return buffer.commit(group_id, rows_for(group_id, buffer.group_size), end_weight=start_weight)


def test_reserve_commit_orders_by_dispatch() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=4)
    a = buffer.reserve("a", 0, target_step=0)
    buffer.reserve("b", 0, target_step=0)
    buffer.reserve("c", 1)
    assert [a.dispatch_index, buffer.slot("b").dispatch_index] == [0, 1]
    assert (len(buffer), buffer.num_reserved, buffer.num_ready) == (3, 3, 0)
    buffer.commit("c", rows_for("c"), end_weight=2)
    buffer.commit("a", rows_for("a"), end_weight=1)
    assert [s.group_id for s in buffer.ready_groups()] == ["a", "c"]  # dispatch order
    assert [s.group_id for s in buffer.reserved_groups()] == ["b"]
    assert buffer.slot("a").sample_ids == ["a-s0", "a-s1"]
    assert buffer.slot("a").end_weight == 1 and buffer.slot("a").target_step == 0


def test_reserve_refuses_duplicates_and_overflow() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=2)
    buffer.reserve("a", 0)
    with pytest.raises(BufferError, match="'a' is already in the buffer"):
        buffer.reserve("a", 0)
    buffer.reserve("b", 0)
    assert not buffer.has_capacity()
    with pytest.raises(BufferError, match="buffer is full"):
        buffer.reserve("c", 0)
    # The project's error is also the built-in BufferError.
    assert issubclass(ReplayBufferError, builtins.BufferError)


def test_commit_checks_rows_and_state() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    buffer.reserve("a", 1)
    with pytest.raises(BufferError, match="has 1 rows, expected 2"):
        buffer.commit("a", rows_for("a", 1), end_weight=1)
    with pytest.raises(BufferError, match="rows of another group"):
        buffer.commit("a", rows_for("b"), end_weight=1)
    with pytest.raises(BufferError, match="no reserved slot"):
        buffer.commit("zz", rows_for("zz"), end_weight=1)
    assert not buffer.slot("a").ready  # failed commits changed nothing
    buffer.commit("a", rows_for("a"), end_weight=1)
    with pytest.raises(BufferError, match="already committed"):
        buffer.commit("a", rows_for("a"), end_weight=1)


def test_remove_frees_capacity_and_returns_slot() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=1)
    committed(buffer, "a")
    slot = buffer.remove("a")
    assert slot.sample_ids == ["a-s0", "a-s1"] and len(buffer) == 0 and buffer.has_capacity()
    with pytest.raises(BufferError, match="not live"):
        buffer.remove("a")


def test_claims_leave_live_index_and_roll_back_in_dispatch_order() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    for name in "abc":
        committed(buffer, name)
    claimed = buffer.claim_for_training(["c", "a"])
    assert [s.group_id for s in claimed] == ["c", "a"]
    assert len(buffer) == 1 and buffer.has_capacity()
    assert [s.group_id for s in buffer.claimed_groups()] == ["a", "c"]
    assert [s.group_id for s in buffer.ready_groups()] == ["b"]
    with pytest.raises(BufferError, match="not a ready, unclaimed group"):
        buffer.claim_for_training(["a"])
    with pytest.raises(BufferError, match="not live"):
        buffer.remove("a")  # claimed groups are the train step's, not evictable
    buffer.reserve("d", 1)
    buffer.reserve("e", 1)
    assert buffer.release_claims(["a", "c"], consumed=False) == []
    assert [s.group_id for s in buffer.live_groups()] == ["a", "b", "c", "d", "e"]
    # A rollback may overfill; reserve refuses until the buffer drains.
    assert len(buffer) == 5 and not buffer.has_capacity()


def test_release_consumed_returns_sample_ids() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    committed(buffer, "a")
    committed(buffer, "b")
    buffer.claim_for_training(["a", "b"])
    with pytest.raises(BufferError, match="not claimed exactly once"):
        buffer.release_claims(["a", "zz"], consumed=True)
    assert buffer.num_claimed == 2  # refused release changed nothing
    assert buffer.release_claims(["a", "b"], consumed=True) == ["a-s0", "a-s1", "b-s0", "b-s1"]
    assert "a" not in buffer and buffer.num_claimed == 0 and len(buffer) == 0


def test_claim_refuses_reserved_and_is_all_or_nothing() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    committed(buffer, "a")
    buffer.reserve("b", 0)
    with pytest.raises(BufferError, match="'b' is not a ready"):
        buffer.claim_for_training(["a", "b"])
    assert buffer.num_claimed == 0 and buffer.slot("a").ready


def test_promote_ready_group() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    committed(buffer, "late", target_step=3)
    buffer.reserve("busy", 0, target_step=3)
    assert buffer.promote_ready_group("late", 2).target_step == 2
    with pytest.raises(BufferError, match="not a ready, unclaimed group"):
        buffer.promote_ready_group("busy", 2)


def test_state_dict_is_json_and_rolls_back_claims() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=4)
    committed(buffer, "a", 0, target_step=0)
    committed(buffer, "b", 0, target_step=0)
    buffer.reserve("c", 1, target_step=1)
    committed(buffer, "d", 1, target_step=1)
    buffer.claim_for_training(["a"])
    state = json.loads(json.dumps(buffer.state_dict()))
    assert [g["group_id"] for g in state["groups"]] == ["a", "b", "d"]
    assert [g["group_id"] for g in state["reserved"]] == ["c"]
    restored = ReplayBuffer(group_size=GROUP_SIZE, capacity=4)
    restored.load_state_dict(state, expect_group_size=GROUP_SIZE)
    assert [s.group_id for s in restored.ready_groups()] == ["a", "b", "d"]
    assert restored.num_reserved == 0 and restored.num_claimed == 0
    assert restored.slot("d").target_step == 1 and restored.slot("d").dispatch_index == 3
    assert restored.slot("a").rows_meta == buffer.slot("a").rows_meta
    # New reservations continue the dispatch order after the snapshot's.
    assert restored.reserve("e", 2).dispatch_index == 4


def good_state() -> dict:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    committed(buffer, "a")
    committed(buffer, "b")
    return buffer.state_dict()


def _wrong_group_size(state: dict) -> None:
    state["group_size"] = 3


def _duplicate_group(state: dict) -> None:
    state["groups"].append(copy.deepcopy(state["groups"][0]))
    state["groups"][-1]["dispatch_index"] = 7
    state["next_dispatch_index"] = 8


def _over_capacity(state: dict) -> None:
    for i in range(2):
        extra = copy.deepcopy(state["groups"][0])
        extra["group_id"] = f"x{i}"
        extra["dispatch_index"] = 10 + i
        for j, row in enumerate(extra["rows_meta"]):
            row["group_id"] = f"x{i}"
            row["sample_id"] = f"x{i}-s{j}"
        state["groups"].append(extra)
    state["next_dispatch_index"] = 20


def _short_group(state: dict) -> None:
    state["groups"][1]["rows_meta"].pop()


def _malformed_row(state: dict) -> None:
    del state["groups"][0]["rows_meta"][0]["reward"]


def _bad_next_index(state: dict) -> None:
    state["next_dispatch_index"] = 1


def _wrong_format(state: dict) -> None:
    state["format"] = "something.else"


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_wrong_group_size, "groups of 3 rows"),
        (_duplicate_group, "'a' appears twice"),
        (_over_capacity, "more than max_buffered_rollouts"),
        (_short_group, "'b' has 1 rows, expected 2"),
        (_malformed_row, "malformed group entry"),
        (_bad_next_index, "next_dispatch_index"),
        (_wrong_format, "not a replay buffer state"),
    ],
)
def test_load_state_dict_preflight_refuses_without_mutating(corrupt, message) -> None:
    state = good_state()
    corrupt(state)
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    committed(buffer, "keep")
    before = buffer.state_dict()
    with pytest.raises(BufferError, match=message):
        buffer.load_state_dict(state)
    assert buffer.state_dict() == before


def test_load_state_dict_expect_group_size() -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    with pytest.raises(BufferError, match="expected 4"):
        buffer.load_state_dict(good_state(), expect_group_size=4)
    assert len(buffer) == 0


# --------------------------------------------------------------------------- properties

OPS = st.lists(
    st.tuples(
        st.sampled_from(["reserve", "commit", "remove", "claim", "consume", "rollback", "snap"]),
        st.integers(min_value=0, max_value=50),
        st.integers(min_value=0, max_value=3),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, capacity=st.integers(min_value=1, max_value=5))
def test_random_operation_sequences_keep_invariants(ops, capacity) -> None:
    """Against a simple model: no overflow except by rollback, no group counted twice, every
    group in exactly one place, snapshots round-trip."""
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=capacity)
    reserved: list[str] = []
    ready: list[str] = []
    claimed: list[str] = []
    consumed_samples: list[str] = []
    next_id = 0
    weight = 0
    for op, pick, count in ops:
        size_before = len(buffer)
        if op == "reserve":
            group_id = f"g{next_id}"
            if buffer.has_capacity():
                buffer.reserve(group_id, weight)
                reserved.append(group_id)
                next_id += 1
            else:
                with pytest.raises(BufferError):
                    buffer.reserve(group_id, weight)
        elif op == "commit" and reserved:
            group_id = reserved.pop(pick % len(reserved))
            buffer.commit(group_id, rows_for(group_id), end_weight=weight)
            ready.append(group_id)
        elif op == "remove" and (reserved or ready):
            pool = reserved if (pick % 2 == 0 and reserved) or not ready else ready
            group_id = pool.pop(pick % len(pool))
            assert buffer.remove(group_id).group_id == group_id
        elif op == "claim" and ready and not claimed:
            chosen = ready[: max(1, count)]
            buffer.claim_for_training(chosen)
            claimed.extend(chosen)
            del ready[: len(chosen)]
        elif op == "consume" and claimed:
            consumed_samples += buffer.release_claims(claimed, consumed=True)
            claimed.clear()
            weight += 1
        elif op == "rollback" and claimed:
            buffer.release_claims(claimed, consumed=False)
            ready.extend(claimed)
            claimed.clear()
        elif op == "snap":
            state = json.loads(json.dumps(buffer.state_dict()))
            if len(ready) + len(claimed) <= capacity:
                clone = ReplayBuffer(group_size=GROUP_SIZE, capacity=capacity)
                clone.load_state_dict(state)
                assert sorted(s.group_id for s in clone.ready_groups()) == sorted(ready + claimed)
                assert clone.state_dict()["groups"] == state["groups"]
            else:  # only possible after a rollback refilled the room
                with pytest.raises(BufferError, match="more than max_buffered_rollouts"):
                    ReplayBuffer(group_size=GROUP_SIZE, capacity=capacity).load_state_dict(state)

        # Invariants after every step.
        live = [s.group_id for s in buffer.live_groups()]
        assert len(live) == len(set(live)) == len(buffer)
        assert sorted(live) == sorted(reserved + ready)
        assert sorted(s.group_id for s in buffer.claimed_groups()) == sorted(claimed)
        assert not set(live) & set(claimed)
        assert buffer.num_ready == len(ready) and buffer.num_reserved == len(reserved)
        indices = [s.dispatch_index for s in buffer.live_groups()]
        assert indices == sorted(indices)
        # Only a rollback may push the live index above capacity; nothing else grows it then.
        if op != "rollback" and len(buffer) > capacity:
            assert len(buffer) <= size_before
    assert len(consumed_samples) == len(set(consumed_samples))


@settings(max_examples=100, deadline=None)
@given(
    n_groups=st.integers(min_value=0, max_value=4), n_claimed=st.integers(min_value=0, max_value=4)
)
def test_state_round_trip_preserves_order_and_rows(n_groups, n_claimed) -> None:
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=4)
    for i in range(n_groups):
        committed(buffer, f"g{i}", start_weight=i // 2, target_step=i // 2)
    buffer.claim_for_training([f"g{i}" for i in range(min(n_claimed, n_groups))])
    state = buffer.state_dict()
    clone = ReplayBuffer(group_size=GROUP_SIZE, capacity=4)
    clone.load_state_dict(json.loads(json.dumps(state)))
    assert clone.state_dict() == {**state, "reserved": []}
    assert [s.group_id for s in clone.ready_groups()] == [f"g{i}" for i in range(n_groups)]


JSON_VALUES = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-3, 10)
    | st.floats(allow_nan=False)
    | st.text(max_size=3),
    lambda children: (
        st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3)
    ),
    max_leaves=6,
)


def _paths(value, prefix=()):
    """Every (container, key) location inside a JSON-like value."""
    if isinstance(value, dict):
        for key, child in value.items():
            yield (*prefix, key)
            yield from _paths(child, (*prefix, key))
    elif isinstance(value, list):
        for index, child in enumerate(value):
            yield (*prefix, index)
            yield from _paths(child, (*prefix, index))


@settings(max_examples=100, deadline=None)
@given(data=st.data(), replacement=JSON_VALUES)
def test_load_state_dict_fuzz_refuses_cleanly_or_loads(data, replacement) -> None:
    """Any single value of a valid snapshot replaced by arbitrary JSON: the load either succeeds
    with a consistent buffer or raises BufferError, leaving the buffer untouched."""
    state = good_state()
    path = data.draw(st.sampled_from(list(_paths(state))))
    container = state
    for key in path[:-1]:
        container = container[key]
    container[path[-1]] = replacement
    buffer = ReplayBuffer(group_size=GROUP_SIZE, capacity=3)
    committed(buffer, "keep")
    before = buffer.state_dict()
    try:
        buffer.load_state_dict(state)
    except BufferError:
        assert buffer.state_dict() == before
        return
    for slot in buffer.ready_groups():
        assert len(slot.rows_meta) == GROUP_SIZE
        assert all(row.group_id == slot.group_id for row in slot.rows_meta)
        assert isinstance(slot.start_weight, int) and isinstance(slot.dispatch_index, int)
    assert len(buffer) <= buffer.capacity
