"""The custom-environment example (examples/custom_env/): its config builds its environment
through env.python_path, and the environment scores its dataset as documented."""

from __future__ import annotations

import sys

import pytest

from tandemrl.config import load_config, validate_single_controller_config
from tandemrl.data.dataloader import PromptDataLoader
from tandemrl.envs import create_environment

CONFIG = "examples/custom_env/config.yaml"


@pytest.fixture
def example(monkeypatch):
    """The example's config and environment, built the way the controller builds them."""
    monkeypatch.setattr(sys, "path", list(sys.path))  # env.python_path is undone afterwards
    cfg = load_config(CONFIG)
    assert validate_single_controller_config(cfg) == []
    return cfg, create_environment(cfg.env)


def test_the_example_builds_its_environment_from_the_folder_beside_its_config(example):
    cfg, env = example
    assert type(env).__module__ == "reverse_env"
    assert type(env).__name__ == "ReverseDigitsEnv"
    assert env.exact_bonus == cfg.env.kwargs["exact_bonus"] == 0.5


def test_the_example_scores_its_dataset_with_partial_credit_and_metadata(example):
    cfg, env = example
    loader = PromptDataLoader.from_config(cfg.data, max_num_epochs=1)
    item = loader.next_item()
    target = item.answer
    assert item.prompt == f"{target[::-1]}:"  # reverse_digits.jsonl, mapped by data.*_key
    assert item.task_source == f"reverse/{len(target)}"
    exact = env.score(item, target, truncated=False)
    assert exact.reward == 1.0 + 0.5 and exact.keep
    assert exact.metadata == {
        "correct": True,
        "answer": target,
        "digits": len(target),
        "truncated": False,
        "task_source": item.task_source,
    }
    wrong_first = ("0" if target[0] != "0" else "1") + target[1:]
    partial = env.score(item, wrong_first, truncated=False)
    assert partial.reward == pytest.approx((len(target) - 1) / len(target))
    assert partial.metadata["correct"] is False
    too_long = env.score(item, target + "9", truncated=True)
    assert too_long.reward == pytest.approx(len(target) / (len(target) + 1))
    assert too_long.metadata["truncated"] is True


def test_every_example_prompt_has_a_consistent_answer(example):
    cfg, _ = example
    loader = PromptDataLoader.from_config(cfg.data, max_num_epochs=1)
    items = [loader.next_item() for _ in range(loader.num_prompts)]
    assert len(items) == 160
    for item in items:
        assert item.prompt == f"{item.answer[::-1]}:", item
        assert item.metadata["digits"] == len(item.answer)
