"""The commit log on its own: format, torn tails, corruption, branches, fold, trimming."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandemrl.checkpoint.commit_log import (
    HEADER_SIZE,
    CommitLog,
    branch_records,
    encode_record,
    fold,
    list_segments,
    read_log,
    read_segment,
)
from tandemrl.checkpoint.layout import CheckpointCorrupt


def write_log(directory: Path, bodies: list[dict], *, parent: int | None = None) -> CommitLog:
    async def main() -> CommitLog:
        commit_log = CommitLog(directory)
        commit_log.open(parent=parent)
        for body in bodies[:-1]:
            commit_log.append("admitted", **body)
        await commit_log.append_durable("committed", **bodies[-1])
        commit_log.close()
        return commit_log

    return asyncio.run(main())


def bodies(count: int) -> list[dict]:
    return [{"group_id": f"e0-i{i}", "group": {"payload": "x" * (i % 7)}} for i in range(count)]


def test_records_come_back_in_order_with_consecutive_lsns(tmp_path):
    commit_log = write_log(tmp_path, bodies(5))
    contents = read_log(tmp_path)
    assert [r["lsn"] for r in contents.records] == list(range(6))
    assert [r["kind"] for r in contents.records] == ["open", *["admitted"] * 4, "committed"]
    assert contents.records[3]["group_id"] == "e0-i2"
    assert contents.torn == []
    assert commit_log.fsyncs >= 1  # the durable append and the close


def test_a_second_attempt_writes_its_own_segment_after_every_record(tmp_path):
    write_log(tmp_path, bodies(3))
    write_log(tmp_path, bodies(2), parent=3)
    segments = list_segments(tmp_path)
    assert [first for first, _ in segments] == [0, 4]
    records = read_log(tmp_path).records
    assert [r["lsn"] for r in records] == list(range(7))
    assert records[4] == {"lsn": 4, "kind": "open", "parent": 3}


def test_durable_append_waits_for_fsync_and_close_writes_the_queue(tmp_path):
    async def main() -> None:
        commit_log = CommitLog(tmp_path)
        commit_log.open(parent=None)
        lsn = await commit_log.append_durable("committed", group_id="g")
        assert commit_log._durable_lsn >= lsn
        commit_log.append("admitted", group_id="h")
        commit_log.close()

    asyncio.run(main())
    assert [r.get("group_id") for r in read_log(tmp_path).records] == [None, "g", "h"]


def test_abandon_loses_only_what_was_still_queued(tmp_path):
    async def main() -> None:
        commit_log = CommitLog(tmp_path)
        commit_log.open(parent=None)
        await commit_log.append_durable("committed", group_id="kept")
        commit_log.abandon()  # a kill: nothing more reaches the file

    asyncio.run(main())
    assert [r.get("group_id") for r in read_log(tmp_path).records] == [None, "kept"]


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(cut=st.integers(min_value=1, max_value=10_000))
def test_a_record_cut_off_anywhere_is_ignored_and_reported(tmp_path_factory, cut):
    directory = tmp_path_factory.mktemp("torn")
    write_log(directory, bodies(4))
    (_, path), *_ = list_segments(directory)
    data = path.read_bytes()
    last = len(data) - len(encode_record(read_segment(path).records[-1]))
    keep = last + 1 + cut % (len(data) - last - 1)  # cut inside the last record
    path.write_bytes(data[:keep])
    segment = read_segment(path)
    assert [r["lsn"] for r in segment.records] == [0, 1, 2, 3]
    assert segment.torn_at == last


def test_a_torn_tail_is_logged_as_a_warning(tmp_path, caplog):
    write_log(tmp_path, bodies(2))
    (_, path), *_ = list_segments(tmp_path)
    path.write_bytes(path.read_bytes()[:-3])
    with caplog.at_level(logging.WARNING):
        read_log(tmp_path)
    assert "cut off at byte offset" in caplog.text and path.name in caplog.text


def test_zeros_after_the_last_record_are_a_torn_tail(tmp_path):
    write_log(tmp_path, bodies(2))
    (_, path), *_ = list_segments(tmp_path)
    size = path.stat().st_size
    with open(path, "ab") as handle:
        handle.write(b"\0" * 40)  # space a crash left allocated but never written
    assert read_segment(path).torn_at == size


@settings(
    max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(position=st.integers(min_value=0, max_value=1_000_000), flip=st.integers(1, 255))
def test_any_flipped_byte_is_an_error_or_a_reported_torn_tail_never_silent(
    tmp_path_factory, position, flip
):
    directory = tmp_path_factory.mktemp("flip")
    write_log(directory, bodies(4))
    (_, path), *_ = list_segments(directory)
    original = read_segment(path).records
    data = bytearray(path.read_bytes())
    position %= len(data)
    data[position] ^= flip
    path.write_bytes(bytes(data))
    last_start = len(data) - len(encode_record(original[-1]))
    try:
        segment = read_segment(path)
    except CheckpointCorrupt as exc:
        assert str(path) in str(exc) and "byte offset" in str(exc)
        return
    # Only damage inside the last record's payload can pass as a torn tail.
    assert position >= last_start + HEADER_SIZE
    assert segment.torn_at == last_start
    assert segment.records == original[:-1]


def test_corruption_in_the_middle_names_the_file_and_offset(tmp_path):
    write_log(tmp_path, bodies(4))
    (_, path), *_ = list_segments(tmp_path)
    data = bytearray(path.read_bytes())
    second = len(encode_record(read_segment(path).records[0]))
    data[second + HEADER_SIZE + 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointCorrupt, match=rf"{path.name}.*byte offset {second}"):
        read_log(tmp_path)


# ---------------------------------------------------------------------------- branches


def rec(lsn: int, kind: str = "admitted", **body) -> dict:
    return {"lsn": lsn, "kind": kind, **body}


def test_branch_follows_attempts_that_continued_from_the_tip():
    records = [
        rec(0, "open", parent=None),
        rec(1),
        rec(2),  # a bundle was captured here: next_lsn 3
        rec(3),
        rec(4),
        rec(5, "open", parent=4),  # resumed from a bundle at 3 and replayed 3..4
        rec(6),
    ]
    assert [r["lsn"] for r in branch_records(records, 3)] == [3, 4, 6]
    assert [r["lsn"] for r in branch_records(records, 1)] == [1, 2, 3, 4, 6]


def test_branch_skips_attempts_that_forked_elsewhere():
    records = [
        rec(0, "open", parent=None),
        rec(1),
        rec(2),
        rec(3),
        rec(4, "open", parent=1),  # restored a bundle at 2 without replaying (trainer mode)
        rec(5),
        rec(6, "open", parent=5),  # continued attempt 4's branch
        rec(7),
        rec(8, "open", parent=None),  # started from a bundle written without the log
        rec(9),
    ]
    # From the first attempt's bundle at 3: its own tail only; the later attempts forked.
    assert [r["lsn"] for r in branch_records(records, 3)] == [3]
    # From a bundle written by attempt 4 after record 5: attempt 6 continues it.
    assert [r["lsn"] for r in branch_records(records, 6)] == [7]
    assert [r["lsn"] for r in branch_records(records, 2)] == [2, 3]


def test_fold_tracks_admission_commit_drop_and_the_last_cursor():
    replay = fold(
        [
            rec(1, group_id="a", group={"id": "a"}, cursor={"n": 1}),
            rec(2, group_id="b", group={"id": "b"}, cursor={"n": 2}),
            rec(3, "staged", group_id="b", siblings={"0": {"s": 0}}),
            rec(4, "committed", group_id="a", group={"id": "a", "target_step": 1}),
            rec(5, "promoted", group_id="a", target_step=0),
            rec(6, group_id="c", group={"id": "c"}, cursor={"n": 3}),
            rec(7, "dropped", group_id="c", cursor={"n": 3, "dropped": 1}, budgets={"k": 1}),
            rec(8, "staged", group_id="z", siblings={"1": {"s": 1}}),
        ]
    )
    assert list(replay.committed) == ["a"] and replay.committed["a"]["target_step"] == 0
    assert list(replay.admitted) == ["b"]
    assert replay.staged == {"b": {0: {"s": 0}}, "z": {1: {"s": 1}}}
    assert replay.dropped == {"c"}
    assert replay.cursor == {"n": 3, "dropped": 1} and replay.budgets == {"k": 1}
    assert replay.records == 8 and replay.last_lsn == 8


def test_unknown_record_kinds_are_refused():
    with pytest.raises(CheckpointCorrupt, match="unknown kind"):
        fold([rec(0, "teleported")])


def test_trim_keeps_the_segments_a_bundle_replays_and_the_active_one(tmp_path):
    for attempt in range(3):
        write_log(tmp_path, bodies(3), parent=None if attempt == 0 else 4 * attempt - 1)
    assert [first for first, _ in list_segments(tmp_path)] == [0, 4, 8]

    async def main() -> list[Path]:
        commit_log = CommitLog(tmp_path)
        commit_log.open(parent=11)
        await commit_log.wait_durable(commit_log.next_lsn)
        removed = commit_log.trim(keep_from_lsn=9)  # a bundle replays from LSN 9
        commit_log.close()
        return removed

    removed = asyncio.run(main())
    assert [path.name for path in removed] == [
        "segment_000000000000.log",
        "segment_000000000004.log",
    ]
    assert [first for first, _ in list_segments(tmp_path)] == [8, 12]
    assert [r["lsn"] for r in read_log(tmp_path).records] == [8, 9, 10, 11, 12]


def test_lsns_going_backwards_are_refused(tmp_path):
    (tmp_path / "segment_000000000000.log").write_bytes(
        encode_record(rec(0, "open", parent=None)) + encode_record(rec(5))
    )
    (tmp_path / "segment_000000000003.log").write_bytes(encode_record(rec(3)))
    with pytest.raises(CheckpointCorrupt, match="go backwards"):
        read_log(tmp_path)


@st.composite
def histories(draw):
    """Attempts that restore random bundles (``latest`` replays, ``trainer_checkpoint`` does
    not), append records, capture bundles, and are killed losing an unpublished tail."""
    records: list[dict] = []
    state_after: dict[int, tuple[int, ...]] = {}  # what the writer held right after a record
    bundles: list[tuple[int, tuple[int, ...]]] = []  # (next LSN at capture, content)
    checks: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for _ in range(draw(st.integers(1, 6))):
        next_lsn = records[-1]["lsn"] + 1 if records else 0
        if bundles and draw(st.booleans()):
            from_lsn, content = bundles[draw(st.integers(0, len(bundles) - 1))]
            if draw(st.booleans()):  # latest: the bundle plus its branch
                replayed = branch_records(records, from_lsn)
                state = content + tuple(r["lsn"] for r in replayed)
                parent = replayed[-1]["lsn"] if replayed else from_lsn - 1
                # replay reconstructs a state some attempt really held
                checks.append((state, state_after[parent]))
            else:  # trainer_checkpoint: the bundle alone, a new branch
                state, parent = content, from_lsn - 1
        else:
            state, parent = (), None
        records.append(rec(next_lsn, "open", parent=parent))
        state_after[next_lsn] = state
        last_published = next_lsn
        for _ in range(draw(st.integers(0, 6))):
            lsn = records[-1]["lsn"] + 1
            if draw(st.integers(0, 2)) == 0:
                bundles.append((lsn, state))  # flushed up to here before it is published
                last_published = lsn - 1
            else:
                records.append(rec(lsn))
                state = (*state, lsn)
                state_after[lsn] = state
        # killed: records after the last published bundle may not have reached the disk
        lost = draw(st.integers(0, len([r for r in records if r["lsn"] > last_published])))
        if lost:
            del records[-lost:]
    return checks


@settings(max_examples=150, deadline=None)
@given(checks=histories())
def test_replay_from_any_bundle_reconstructs_a_state_an_attempt_held(checks):
    for replayed_state, held in checks:
        assert replayed_state == held
