"""Training rows, collation into a padded train batch, micro-batch splitting."""

from __future__ import annotations

import pytest
import torch

from tandemrl.training.batch import (
    BatchError,
    collate_rows,
    count_loss_tokens,
    make_training_row,
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


def test_group_rows_equal_rows_built_one_by_one():
    from tandemrl.training.batch import make_group_rows

    prompt = [5, 6, 7]
    for completions in ([[1, 2], [3, 4], [5, 1]], [[1], [3, 4, 2], [5, 1]]):  # equal and ragged
        logprobs = [[-0.5 * (i + j) for j in range(len(c))] for i, c in enumerate(completions)]
        rewards, masks = [0.0, 1.0, 0.5], [1.0, 0.0, 1.0]
        grouped = make_group_rows(prompt, completions, logprobs, rewards, masks)
        one_by_one = [
            make_training_row(prompt, c, lp, reward=r, sample_mask=m)
            for c, lp, r, m in zip(completions, logprobs, rewards, masks, strict=True)
        ]
        for got, want in zip(grouped, one_by_one, strict=True):
            assert got.keys() == want.keys()
            for key in want:
                torch.testing.assert_close(got[key], want[key])
