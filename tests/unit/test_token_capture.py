"""Turns → rows: prefix merge, the general row block, collation and GRPO over split episodes."""

from __future__ import annotations

import pytest
import torch

from tandemrl.buffer import ReplayBuffer, ReplayBufferError
from tandemrl.controller.step_runner import GRPOStepRunner
from tandemrl.dataplane.rows import RowError, make_sequence_block
from tandemrl.records import AgentTurn, RowMeta
from tandemrl.rollout.token_capture import PrefixMismatch, merge_turns
from tandemrl.training.batch import collate_rows, loss_mask
from tandemrl.training.fake import FakeTrainer


def turn(prompt, tokens, version=0):
    return AgentTurn(
        prompt, tokens, [-(i + 1) / 10 for i in range(len(tokens))], "stop", version, version
    )


def test_turns_that_extend_each_other_merge_with_the_tokens_between_masked():
    first = turn([1, 2, 3], [4, 5], version=1)
    second = turn([1, 2, 3, 4, 5, 9, 9], [6], version=2)  # env reply 9 9, then a sampled 6
    third = turn([1, 2, 3, 4, 5, 9, 9, 6], [7, 8], version=2)  # nothing in between
    (row,) = merge_turns([first, second, third], on_prefix_mismatch="error")
    assert row.input_ids == [1, 2, 3, 4, 5, 9, 9, 6, 7, 8]
    assert row.token_mask == [0, 0, 0, 1, 1, 0, 0, 1, 1, 1]
    assert row.logprobs == [0, 0, 0, -0.1, -0.2, 0, 0, -0.1, -0.1, -0.2]
    assert (row.start_weight_version, row.end_weight_version) == (1, 2)
    assert row.turns == [0, 1, 2] and row.num_sampled_tokens == 5


def test_a_broken_prefix_splits_or_raises():
    first = turn([1, 2, 3], [4, 5])
    drifted = turn([1, 2, 3, 45, 9], [6])  # 4, 5 re-encoded as one token 45
    rows = merge_turns([first, drifted], on_prefix_mismatch="split")
    assert [r.input_ids for r in rows] == [[1, 2, 3, 4, 5], [1, 2, 3, 45, 9, 6]]
    assert [r.token_mask for r in rows] == [[0, 0, 0, 1, 1], [0, 0, 0, 0, 0, 1]]
    with pytest.raises(PrefixMismatch, match="differ at position 3"):
        merge_turns([first, drifted], on_prefix_mismatch="error")
    with pytest.raises(ValueError, match="logprobs"):
        merge_turns([AgentTurn([1], [2, 3], [-1.0], "stop")], on_prefix_mismatch="split")


def test_rows_of_any_shape_collate_with_their_own_masks():
    block = make_sequence_block(
        ["g/0", "g/1/r0", "g/1/r1"],
        [[1, 2, 3, 4, 5], [1, 2, 7], [1, 2, 7, 9, 9, 8, 8]],
        [[0, 0, 1, 0, 1], [0, 0, 1], [0, 0, 0, 0, 0, 1, 1]],
        [[0, 0, -1, 0, -2], [0, 0, -3], [0, 0, 0, 0, 0, -4, -5]],
        [1.0, 0.5, 0.5],
        [1.0, 1.0, 0.0],
    )
    batch = collate_rows(list(block.rows().values()), pad_token_id=0)
    assert batch["input_ids"].shape == (3, 7)
    assert batch["token_mask"][0].tolist() == [0, 0, 1, 0, 1, 0, 0]
    assert batch["attention_mask"].sum(dim=1).tolist() == [5, 3, 7]
    # The loss positions are the sampled tokens of kept rows, wherever they sit in a row.
    assert loss_mask(batch).nonzero().tolist() == [[0, 2], [0, 4], [1, 2]]
    with pytest.raises(RowError, match="logprob where its token_mask is 0"):
        make_sequence_block(["x"], [[1, 2]], [[0, 0]], [[0, -1]], [0.0], [1.0])
    with pytest.raises(RowError, match="first token"):
        make_sequence_block(["x"], [[1, 2]], [[1, 0]], [[-1, 0]], [0.0], [1.0])


def meta(group, sibling, sample_id, reward):
    return RowMeta(sample_id, group, sibling, reward, 1.0, 2, 1, False, 0, 0)


def test_a_group_of_split_episodes_commits_and_gets_one_advantage_per_episode():
    buffer = ReplayBuffer(group_size=2, capacity=2)
    buffer.reserve("g", 0, None, None)
    rows = [meta("g", 0, "g/0", 1.0), meta("g", 1, "g/1/r0", 0.0), meta("g", 1, "g/1/r1", 0.0)]
    slot = buffer.commit("g", rows, end_weight=0)
    assert slot.sample_ids == ["g/0", "g/1/r0", "g/1/r1"]
    buffer.reserve("h", 0, None, None)
    with pytest.raises(ReplayBufferError, match="each of the 2 siblings holding one or more"):
        buffer.commit(
            "h",
            [meta("h", 0, "h/0/r0", 1.0), meta("h", 0, "h/0/r1", 1.0), meta("h", 0, "h/0/r2", 1.0)],
            0,
        )

    block = make_sequence_block(
        slot.sample_ids,
        [[1, 2], [1, 3], [1, 3, 4]],
        [[0, 1], [0, 1], [0, 0, 1]],
        [[0, -1], [0, -1], [0, 0, -1]],
        [1.0, 0.0, 0.0],
        [1.0, 1.0, 1.0],
    )
    runner = GRPOStepRunner(
        FakeTrainer(),
        group_size=2,
        leave_one_out_baseline=False,
        normalize_rewards=False,
        pad_token_id=0,
    )
    batch = runner.advantage_stage([slot], block.rows())
    per_row = (batch["advantages"].sum(dim=1) / batch["token_mask"].sum(dim=1)).tolist()
    # Two episodes, rewards 1 and 0: advantages +0.5 and -0.5, the split episode's on both rows
    # (not three rows averaging 1/3).
    assert per_row == pytest.approx([0.5, -0.5, -0.5])
    assert batch["start_weight"].tolist() == [0, 0, 0]
    assert torch.equal(batch["advantages"] != 0, batch["token_mask"] > 0)
