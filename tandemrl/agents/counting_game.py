"""The two-turn counting game: the agent exemplar's task (examples/configs/grpo_tiny_cpu_agent.yaml).

Turn 1: the user asks ``583=``; the policy should continue counting from the last digit:
``456``. The environment then answers that completion with where the count should stand,
``6=``, and asks for the continuation; turn 2 should be ``789``. The reward is the mean of
the two turns' per-position match scores (``tandemrl.envs.counting``), so a policy that
counts correctly in both turns earns 1.

Everything goes through the ``client`` the run hands over, with the official OpenAI call
``client.chat.completions.create``; the endpoint applies the chat template, and the trainer
trains on the exact tokens of both turns (the environment's reply between them is masked).
"""

from __future__ import annotations

from typing import Any

from tandemrl.agents.api import Agent, AgentResult
from tandemrl.envs.counting import (
    DEFAULT_ANSWER_LENGTH,
    clean_completion,
    continue_count,
    counting_target,
    positional_match_reward,
)
from tandemrl.records import PromptItem


class CountingGameAgent(Agent):
    """See the module docstring; ``env.kwargs``: ``turns`` (2), ``answer_length`` (3),
    ``max_tokens`` per turn (answer_length + 1: the digits and the end-of-turn token),
    ``model`` (the endpoint's served name)."""

    def __init__(
        self,
        turns: int = 2,
        answer_length: int = DEFAULT_ANSWER_LENGTH,
        max_tokens: int | None = None,
        model: str = "policy",
    ) -> None:
        if turns < 1:
            raise ValueError(f"env.kwargs.turns must be at least 1, got {turns}")
        self.turns = turns
        self.answer_length = answer_length
        self.max_tokens = max_tokens if max_tokens is not None else answer_length + 1
        self.model = model

    async def run(self, item: PromptItem, client: Any) -> AgentResult:
        messages: list[dict[str, str]] = [{"role": "user", "content": item.prompt}]
        target = counting_target(item.prompt, self.answer_length)
        scores: list[float] = []
        for turn in range(self.turns):
            reply = await client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.max_tokens
            )
            answer = reply.choices[0].message.content or ""
            scores.append(positional_match_reward(target, clean_completion(answer)))
            if turn + 1 == self.turns:
                break
            # The environment's answer: where the count should stand now; continue from it.
            follow_up = f"{target[-1]}="
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": follow_up},
            ]
            target = continue_count(int(target[-1]), self.answer_length)
        return AgentResult(
            reward=sum(scores) / len(scores),
            metadata={f"turn{index + 1}_reward": score for index, score in enumerate(scores)},
        )
