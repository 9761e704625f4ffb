"""Training rows, collation into a padded train batch, micro-batch splitting."""

from __future__ import annotations

from array import array

import pytest
import torch

from tandemrl.dataplane.base import DataPlaneError, RowBlock
from tandemrl.dataplane.rows import make_group_block, make_training_row
from tandemrl.training.batch import (
    BatchError,
    collate_rows,
    count_loss_tokens,
    split_microbatches,
    trim_padding,
)


def test_make_training_row_places_completion_fields() -> None:
    row = make_training_row([5, 6, 7], [1, 2], [-0.5, -1.5], reward=0.75, sample_mask=1.0)
    assert row["input_ids"].tolist() == [5, 6, 7, 1, 2]
    assert row["input_ids"].dtype == torch.long
    assert row["token_mask"].tolist() == [0, 0, 0, 1, 1]
    assert row["generation_logprobs"].tolist() == [0, 0, 0, -0.5, -1.5]
    assert row["reward"].shape == () and row["reward"].item() == 0.75
    assert row["sample_mask"].item() == 1.0
    with pytest.raises(BatchError, match="one logprob per generated token"):
        make_training_row([1], [2, 3], [-0.1], reward=0.0, sample_mask=1.0)


def test_collate_right_pads_and_builds_attention_mask() -> None:
    rows = [
        make_training_row([5, 6], [1, 2, 3], [-1.0, -2.0, -3.0], 1.0, 1.0),
        make_training_row([7], [4], [-0.25], 0.0, 0.0),
    ]
    rows[0]["advantages"] = torch.tensor(0.5)
    rows[1]["advantages"] = torch.tensor(-2.0)
    rows[0]["values"] = torch.arange(5, dtype=torch.float32)
    rows[1]["values"] = torch.tensor([9.0, 8.0])
    batch = collate_rows(rows, pad_token_id=0)
    assert batch["input_ids"].tolist() == [[5, 6, 1, 2, 3], [7, 4, 0, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]
    assert batch["token_mask"].tolist() == [[0, 0, 1, 1, 1], [0, 1, 0, 0, 0]]
    assert batch["generation_logprobs"][1].tolist() == [0, -0.25, 0, 0, 0]
    assert batch["reward"].tolist() == [1.0, 0.0]
    assert batch["sample_mask"].tolist() == [1.0, 0.0]
    # Scalar advantages are broadcast over the generated positions only.
    assert batch["advantages"].tolist() == [[0, 0, 0.5, 0.5, 0.5], [0, -2.0, 0, 0, 0]]
    assert batch["values"].tolist() == [[0, 1, 2, 3, 4], [9, 8, 0, 0, 0]]
    assert count_loss_tokens(batch) == 3


def test_collate_rejects_inconsistent_rows() -> None:
    good = make_training_row([1], [2], [-0.1], 0.0, 1.0)
    other = make_training_row([1], [2], [-0.1], 0.0, 1.0)
    other["returns"] = torch.zeros(2)
    with pytest.raises(BatchError, match="disagree"):
        collate_rows([good, other], pad_token_id=0)
    bad = make_training_row([1], [2], [-0.1], 0.0, 1.0)
    bad["values"] = torch.zeros(3)
    bad2 = make_training_row([1], [2], [-0.1], 0.0, 1.0)
    bad2["values"] = torch.zeros(2)
    with pytest.raises(BatchError, match="'values'"):
        collate_rows([bad2, bad], pad_token_id=0)
    with pytest.raises(BatchError, match="at least one row"):
        collate_rows([], pad_token_id=0)
    missing = {"input_ids": torch.tensor([1, 2])}
    with pytest.raises(BatchError, match="lacks required"):
        collate_rows([missing], pad_token_id=0)


def test_split_microbatches_and_trim() -> None:
    rows = [make_training_row([1] * (i + 1), [2], [-0.1], float(i), 1.0) for i in range(5)]
    batch = collate_rows(rows, pad_token_id=0)
    parts = split_microbatches(batch, 2)
    assert [p["input_ids"].shape[0] for p in parts] == [2, 2, 1]
    assert torch.equal(torch.cat([p["reward"] for p in parts]), batch["reward"])
    trimmed = trim_padding(parts[0])
    assert trimmed["input_ids"].shape == (2, 3)
    assert trimmed["reward"].shape == (2,)
    with pytest.raises(BatchError, match=">= 1"):
        split_microbatches(batch, 0)


def _group(completions: list[list[int]], seed: int = 0):
    logprobs = [[-0.5 * (seed + i + j) for j in range(len(c))] for i, c in enumerate(completions)]
    rewards = [float((seed + i) % 3) / 2 for i in range(len(completions))]
    masks = [float((seed + i) % 2) for i in range(len(completions))]
    return logprobs, rewards, masks


@pytest.mark.parametrize(
    "completions", [[[1, 2], [3, 4], [5, 1]], [[1], [3, 4, 2], [5, 1]]], ids=["equal", "ragged"]
)
def test_group_block_rows_equal_rows_built_one_by_one(completions) -> None:
    prompt = [5, 6, 7]
    logprobs, rewards, masks = _group(completions)
    ids = [f"g/{i}" for i in range(len(completions))]
    block = make_group_block(ids, prompt, completions, logprobs, rewards, masks)
    one_by_one = [
        make_training_row(prompt, c, lp, reward=r, sample_mask=m)
        for c, lp, r, m in zip(completions, logprobs, rewards, masks, strict=True)
    ]
    assert block.sample_ids == tuple(ids)
    for rows in (list(block.rows().values()), block.row_views()):
        for got, want in zip(rows, one_by_one, strict=True):
            assert sorted(got) == sorted(want)
            for key in want:
                assert got[key].dtype == want[key].dtype
                assert torch.equal(got[key], want[key]), key


def test_group_block_rejects_bad_groups() -> None:
    with pytest.raises(BatchError, match="one logprob per generated token"):
        make_group_block(["g/0"], [1], [[2, 3]], [[-0.1]], [0.0], [1.0])
    with pytest.raises(BatchError, match="at least one prompt token"):
        make_group_block(["g/0"], [], [[2]], [[-0.1]], [0.0], [1.0])
    with pytest.raises(BatchError, match="must match"):
        make_group_block(["g/0", "g/1"], [1], [[2], [3]], [[-0.1]], [0.0, 1.0], [1.0, 1.0])
    with pytest.raises(DataPlaneError, match="distinct"):
        make_group_block(["g/0", "g/0"], [1], [[2], [3]], [[-0.1], [-0.2]], [0.0, 1.0], [1, 1])
    with pytest.raises(BatchError, match=r"does not fit a torch\.int64 buffer"):
        make_group_block(["g/0"], [1], [[2**70]], [[-0.1]], [0.0], [1.0])


def _blocks(pad_widths: bool):
    """Three blocks: equal lengths, ragged, and (optionally) a wider one."""
    groups = [[[1, 2], [3, 4]], [[1], [3, 4, 2]], [[4, 4, 4, 4], [2]] if pad_widths else [[4], [2]]]
    blocks = []
    for index, completions in enumerate(groups):
        logprobs, rewards, masks = _group(completions, seed=index)
        ids = [f"g{index}/{i}" for i in range(len(completions))]
        blocks.append(
            make_group_block(ids, [9, 8][: index % 2 + 1], completions, logprobs, rewards, masks)
        )
    return blocks


def _as_tensor_block(block: RowBlock) -> RowBlock:
    return RowBlock(block.sample_ids, block.fields, block.lengths)


@pytest.mark.parametrize("pad_token_id", [0, 7])
@pytest.mark.parametrize("pad_widths", [False, True])
@pytest.mark.parametrize("storage", ["buffers", "tensors", "mixed"])
def test_collating_whole_blocks_equals_collating_rows(
    pad_token_id: int, pad_widths: bool, storage: str
) -> None:
    blocks = _blocks(pad_widths)
    if storage == "tensors":
        blocks = [_as_tensor_block(block) for block in blocks]
    elif storage == "mixed":
        blocks[1] = _as_tensor_block(blocks[1])
    views = [view for block in blocks for view in block.row_views()]
    plain = [dict(view) for view in views]  # same rows as plain dicts: the row-by-row path
    fast = collate_rows(views, pad_token_id=pad_token_id)
    slow = collate_rows(plain, pad_token_id=pad_token_id)
    assert sorted(fast) == sorted(slow)
    for key in slow:
        assert fast[key].dtype == slow[key].dtype, key
        assert torch.equal(fast[key], slow[key]), key
    # The batch owns its tensors: writing to it leaves the stored blocks alone.
    before = views[0]["input_ids"].clone()
    fast["input_ids"].fill_(-1)
    assert torch.equal(views[0]["input_ids"], before)


def test_collating_part_of_a_block_or_out_of_order_falls_back_to_rows() -> None:
    views = [view for block in _blocks(True) for view in block.row_views()]
    for rows in (views[1:], views[::-1], views[:3]):
        got = collate_rows(rows, pad_token_id=3)
        want = collate_rows([dict(row) for row in rows], pad_token_id=3)
        for key in want:
            assert torch.equal(got[key], want[key]), key


def test_block_from_buffers_checks_sizes_and_types() -> None:
    ids, lengths = ["a", "b"], [2, 1]
    ok = {"input_ids": array("q", [1, 2, 3, 0])}
    block = RowBlock.from_buffers(ids, lengths, per_token=ok, per_row={"r": array("f", [1, 2])})
    assert block.fields["input_ids"].tolist() == [[1, 2], [3, 0]]
    assert block.fields["r"].dtype == torch.float32
    with pytest.raises(DataPlaneError, match="holds 3 values, expected 4"):
        RowBlock.from_buffers(ids, lengths, per_token={"x": array("q", [1, 2, 3])}, per_row={})
    with pytest.raises(DataPlaneError, match="typecode"):
        RowBlock.from_buffers(ids, lengths, per_token={"x": [1, 2, 3, 4]}, per_row={})  # type: ignore[dict-item]
    with pytest.raises(DataPlaneError, match="both per token and per row"):
        RowBlock.from_buffers(
            ids, [1, 1], per_token={"x": array("f", [1, 2])}, per_row={"x": array("f", [1, 2])}
        )


def test_collating_blocks_checks_fields() -> None:
    first, second, _ = _blocks(False)
    odd = RowBlock(second.sample_ids, {**second.fields, "extra": torch.zeros(2)}, second.lengths)
    with pytest.raises(BatchError, match="disagree"):
        collate_rows([*odd.row_views(), *first.row_views()], pad_token_id=0)
    with pytest.raises(BatchError, match="disagree"):
        collate_rows([*first.row_views(), *odd.row_views()], pad_token_id=0)
    bare = RowBlock(first.sample_ids, {"input_ids": first.fields["input_ids"]}, first.lengths)
    with pytest.raises(BatchError, match="lacks required"):
        collate_rows(bare.row_views(), pad_token_id=0)
