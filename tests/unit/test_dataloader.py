"""Datasets and the prompt dataloader: order, epochs, exact resume, requeue, errors."""

from __future__ import annotations

import io
import json
import re
from pathlib import Path

import pytest
import torch

from tandemrl.config.models import DataConfig
from tandemrl.data import (
    DataLoaderStateError,
    DatasetError,
    PromptDataLoader,
    PromptRecord,
    generate_counting_records,
    load_prompt_records,
)
from tandemrl.data.make_math_small import make_problems
from tandemrl.envs.counting import counting_target
from tandemrl.envs.math import MathEnv


def records(count: int) -> list[PromptRecord]:
    return [PromptRecord(prompt=f"p{index}", answer=index) for index in range(count)]


def prompts_of(items: list) -> list[str]:
    return [item.prompt for item in items]


def write_jsonl(path: Path, lines: list[str]) -> Path:
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


# -- order and epochs -------------------------------------------------------------------------


def test_same_seed_same_order_and_each_epoch_is_a_permutation() -> None:
    first = list(PromptDataLoader(records(20), max_num_epochs=3, seed=7))
    second = list(PromptDataLoader(records(20), max_num_epochs=3, seed=7))
    assert prompts_of(first) == prompts_of(second)
    assert len(first) == 60
    epochs = [first[0:20], first[20:40], first[40:60]]
    for epoch, items in enumerate(epochs):
        assert sorted(prompts_of(items)) == sorted(f"p{index}" for index in range(20))
        assert [item.prompt_id for item in items] == [f"e{epoch}-i{index}" for index in range(20)]
        assert {item.epoch for item in items} == {epoch}
    # Shuffled per epoch with seed + epoch: epochs differ from each other and from seed 8.
    assert prompts_of(epochs[0]) != prompts_of(epochs[1])
    other_seed = list(PromptDataLoader(records(20), max_num_epochs=1, seed=8))
    assert prompts_of(other_seed) != prompts_of(epochs[0])
    # Epoch 1 of seed 7 is epoch 0 of seed 8.
    assert prompts_of(other_seed) == prompts_of(epochs[1])


def test_no_shuffle_keeps_dataset_order_and_metadata_keeps_dataset_index() -> None:
    items = list(PromptDataLoader(records(4), max_num_epochs=2, shuffle=False))
    assert prompts_of(items) == ["p0", "p1", "p2", "p3"] * 2
    assert [item.metadata["dataset_index"] for item in items[:4]] == [0, 1, 2, 3]
    assert items[2].answer == 2


def test_epoch_bound_and_position_properties() -> None:
    loader = PromptDataLoader(records(3), max_num_epochs=2, seed=1)
    assert (loader.epoch, loader.position, loader.remaining_in_epoch) == (0, 0, 3)
    loader.take(2)
    assert (loader.epoch, loader.position, loader.remaining_in_epoch) == (0, 2, 1)
    loader.take(1)
    assert (loader.epoch, loader.position, loader.remaining_in_epoch) == (1, 0, 3)
    assert len(loader.take(10)) == 3
    assert loader.exhausted
    assert loader.epoch == 2
    assert loader.remaining_in_epoch == 0
    assert loader.next_item() is None
    assert loader.peek() is None
    assert loader.take(5) == []


def test_peek_does_not_consume() -> None:
    loader = PromptDataLoader(records(5), max_num_epochs=1, seed=3)
    peeked = loader.peek()
    assert peeked == loader.peek()
    assert loader.next_item() == peeked
    assert loader.position == 1


@pytest.mark.parametrize("max_num_epochs", [0, -1])
def test_non_positive_max_num_epochs_is_refused(max_num_epochs: int) -> None:
    with pytest.raises(ValueError, match="max_num_steps"):
        PromptDataLoader(records(3), max_num_epochs=max_num_epochs)


# -- resume -----------------------------------------------------------------------------------


@pytest.mark.parametrize("consumed", [0, 1, 6, 10, 11, 17])
def test_resume_yields_exactly_the_remaining_prompts(consumed: int) -> None:
    full = list(PromptDataLoader(records(10), max_num_epochs=2, seed=5))
    loader = PromptDataLoader(records(10), max_num_epochs=2, seed=5)
    loader.take(consumed)
    # Through torch.save/torch.load(weights_only=True), as a checkpoint stores it.
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    resumed = PromptDataLoader(records(10), max_num_epochs=2, seed=5)
    resumed.load_state_dict(state)
    assert list(resumed) == full[consumed:]


def test_state_is_json_serialisable_and_names_its_fields() -> None:
    loader = PromptDataLoader(records(4), max_num_epochs=1, seed=2)
    loader.take(1)
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 0
    assert state["position"] == 1
    assert state["seed"] == 2
    assert len(state["fingerprint"]) == 64


def test_resume_with_different_dataset_is_refused() -> None:
    loader = PromptDataLoader(records(4), max_num_epochs=1)
    state = loader.state_dict()
    changed = records(4)
    changed[2] = PromptRecord(prompt="changed", answer=2)
    with pytest.raises(DataLoaderStateError, match="different dataset"):
        PromptDataLoader(changed, max_num_epochs=1).load_state_dict(state)
    with pytest.raises(DataLoaderStateError, match="different dataset"):
        PromptDataLoader(records(5), max_num_epochs=1).load_state_dict(state)


def test_resume_with_different_seed_or_shuffle_is_refused() -> None:
    state = PromptDataLoader(records(4), max_num_epochs=1, seed=1).state_dict()
    with pytest.raises(DataLoaderStateError, match=r"data\.seed=1"):
        PromptDataLoader(records(4), max_num_epochs=1, seed=2).load_state_dict(state)
    with pytest.raises(DataLoaderStateError, match=r"data\.shuffle"):
        PromptDataLoader(records(4), max_num_epochs=1, seed=1, shuffle=False).load_state_dict(state)
    with pytest.raises(DataLoaderStateError, match="lacks"):
        PromptDataLoader(records(4), max_num_epochs=1).load_state_dict({"epoch": 0})


def test_resume_can_extend_max_num_epochs() -> None:
    loader = PromptDataLoader(records(3), max_num_epochs=1, seed=4)
    list(loader)
    longer = PromptDataLoader(records(3), max_num_epochs=2, seed=4)
    longer.load_state_dict(loader.state_dict())
    assert [item.prompt_id for item in longer] == ["e1-i0", "e1-i1", "e1-i2"]


# -- requeue ----------------------------------------------------------------------------------


def test_requeued_prompts_come_first_in_order_and_keep_their_ids() -> None:
    expected_order = list(PromptDataLoader(records(6), max_num_epochs=1, seed=0))
    loader = PromptDataLoader(records(6), max_num_epochs=1, seed=0)
    first, second, _third = loader.take(3)
    loader.requeue([second, first])
    assert loader.num_requeued == 2
    assert loader.remaining_in_epoch == 3  # requeued prompts are counted apart
    assert loader.peek() == second
    assert loader.take(3) == [second, first, expected_order[3]]
    assert loader.num_requeued == 0
    assert list(loader) == expected_order[4:]


def test_requeued_prompts_survive_state_dict_and_exhaustion() -> None:
    loader = PromptDataLoader(records(3), max_num_epochs=1, seed=9)
    taken = list(loader)
    assert loader.exhausted
    loader.requeue([taken[1]])
    assert not loader.exhausted
    buffer = io.BytesIO()
    torch.save(loader.state_dict(), buffer)
    buffer.seek(0)
    resumed = PromptDataLoader(records(3), max_num_epochs=1, seed=9)
    resumed.load_state_dict(torch.load(buffer, weights_only=True))
    assert list(resumed) == [taken[1]]
    assert resumed.exhausted


def test_requeueing_the_same_prompt_twice_is_refused() -> None:
    loader = PromptDataLoader(records(3), max_num_epochs=1)
    item = loader.next_item()
    assert item is not None
    loader.requeue([item])
    with pytest.raises(ValueError, match="already requeued"):
        loader.requeue([item])


# -- JSONL datasets ---------------------------------------------------------------------------


def test_jsonl_field_mapping(tmp_path: Path) -> None:
    path = write_jsonl(
        tmp_path / "data.jsonl",
        [
            json.dumps({"q": "1+1=", "a": 2, "src": "math/add", "agent": "calc", "extra": 1}),
            "",
            json.dumps({"q": "2+2=", "a": "4"}),
        ],
    )
    cfg = DataConfig(
        dataset=str(path),
        prompt_key="q",
        answer_key="a",
        task_source_key="src",
        agent_ref_key="agent",
    )
    loaded = load_prompt_records(cfg)
    assert loaded == [
        PromptRecord("1+1=", 2, "math/add", "calc", {"extra": 1}),
        PromptRecord("2+2=", "4"),
    ]
    item = PromptDataLoader.from_config(
        cfg.model_copy(update={"shuffle": False}), max_num_epochs=1
    ).next_item()
    assert item is not None
    assert (item.task_source, item.agent_ref, item.metadata["extra"]) == ("math/add", "calc", 1)


@pytest.mark.parametrize(
    ("bad_line", "message"),
    [
        ("{not json", r":3: invalid JSON"),
        ("[1, 2]", r":3: expected a JSON object"),
        ('{"answer": 1}', r":3: missing field 'prompt' \(data\.prompt_key\)"),
        ('{"prompt": "x="}', r":3: missing field 'answer' \(data\.answer_key\)"),
        ('{"prompt": 5, "answer": 1}', r":3: field 'prompt' \(data\.prompt_key\) must be"),
        ('{"prompt": "x", "answer": 1, "task_source": 3}', r":3: field 'task_source'"),
    ],
)
def test_bad_jsonl_line_names_file_line_and_field(
    tmp_path: Path, bad_line: str, message: str
) -> None:
    good = json.dumps({"prompt": "1=", "answer": "234"})
    path = write_jsonl(tmp_path / "bad.jsonl", [good, good, bad_line])
    with pytest.raises(DatasetError, match=re.escape(str(path)) + message):
        load_prompt_records(DataConfig(dataset=str(path)))


def test_missing_or_empty_dataset_file(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file"):
        load_prompt_records(DataConfig(dataset=str(tmp_path / "absent.jsonl")))
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DatasetError, match="holds no prompts"):
        load_prompt_records(DataConfig(dataset=str(empty)))
    with pytest.raises(DatasetError, match="unknown built-in"):
        load_prompt_records(DataConfig(dataset="builtin://nope"))


# -- built-in datasets ------------------------------------------------------------------------


def test_builtin_counting_is_deterministic_and_correct() -> None:
    cfg = DataConfig(dataset="builtin://counting", num_prompts=50, seed=3)
    first = load_prompt_records(cfg)
    assert first == load_prompt_records(cfg)
    assert first != load_prompt_records(cfg.model_copy(update={"seed": 4}))
    assert len(first) == 50
    for record in first:
        assert re.fullmatch(r"\d{3}=", record.prompt)
        assert record.answer == counting_target(record.prompt)
    assert generate_counting_records(50, 3) == first


@pytest.mark.parametrize("dataset", ["builtin://math", "builtin://math-heldout"])
def test_builtin_math_loads_and_its_answers_are_right(dataset: str) -> None:
    loaded = load_prompt_records(DataConfig(dataset=dataset))
    assert 150 <= len(loaded) <= 300
    assert len({record.prompt for record in loaded}) == len(loaded)
    env = MathEnv()
    loader = PromptDataLoader(loaded, max_num_epochs=1, shuffle=False)
    for item in loader:
        # The prompts are plain arithmetic; Python evaluates them as an independent check.
        expression = item.prompt.removesuffix("=")
        assert re.fullmatch(r"[0-9.+\-*/]+", expression), expression
        expected = eval(expression, {"__builtins__": {}}, {})
        assert env.score(item, repr(expected), truncated=False).reward == 1.0, item


def test_bundled_math_file_matches_its_generator() -> None:
    bundled = load_prompt_records(DataConfig(dataset="builtin://math"))
    generated = make_problems()
    assert [record.prompt for record in bundled] == [problem["prompt"] for problem in generated]
    assert [record.answer for record in bundled] == [problem["answer"] for problem in generated]


def test_heldout_math_shares_no_problem_with_the_training_set() -> None:
    training = load_prompt_records(DataConfig(dataset="builtin://math"))
    heldout = load_prompt_records(DataConfig(dataset="builtin://math-heldout"))
    assert len(heldout) == len(training) == 200
    assert not {record.prompt for record in training} & {record.prompt for record in heldout}
    # Every kind of problem is represented in both.
    assert {r.task_source for r in heldout} == {r.task_source for r in training}
