"""A custom TandemRL environment: reverse the digits of the prompt (``"583:"`` -> ``"385"``).

``config.yaml`` beside this file trains the tiny default model on it:

    tandemrl train --config examples/custom_env/config.yaml

The config names this class (``env.target: reverse_env:ReverseDigitsEnv``), lists this
folder in ``env.python_path`` so the controller can import the module, passes
``env.kwargs`` to ``__init__``, and reads ``reverse_digits.jsonl`` (``data.prompt_key:
question``, ``data.answer_key: reversed``, ``data.task_source_key: source``; the file's other
field, ``digits``, arrives in ``item.metadata``). docs/environments.md explains the contract.
"""

from __future__ import annotations

from tandemrl.envs.base import Environment
from tandemrl.records import EnvResult, PromptItem


class ReverseDigitsEnv(Environment):
    """Partial credit per position; ``exact_bonus`` is added for a fully correct answer."""

    def __init__(self, exact_bonus: float = 0.0) -> None:
        if exact_bonus < 0:
            raise ValueError(f"env.kwargs.exact_bonus must be >= 0, got {exact_bonus}")
        self.exact_bonus = exact_bonus

    def score(self, item: PromptItem, completion: str, *, truncated: bool) -> EnvResult:
        # The dataset's answer is the target. A row without one is a dataset error: raising
        # makes it a data failure of this prompt (retried, then dropped within the budgets).
        if item.answer is None:
            raise ValueError(f"prompt {item.prompt_id} ({item.prompt!r}) has no answer")
        target = str(item.answer)
        answer = completion.strip()  # the completion arrives without its end-of-sequence token
        matches = sum(1 for got, want in zip(answer, target, strict=False) if got == want)
        reward = matches / max(len(target), len(answer))
        correct = answer == target
        if correct:
            reward += self.exact_bonus
        return EnvResult(
            reward=reward,
            keep=True,  # False would leave this completion out of the loss
            metadata={
                "correct": correct,  # plain JSON values: checkpoints store them
                "answer": answer,
                "digits": item.metadata.get("digits"),
                "truncated": truncated,
                **self.item_metadata(item),  # task_source, when the dataset gives one
            },
        )
