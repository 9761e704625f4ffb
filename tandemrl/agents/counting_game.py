"""The two-turn counting game: the agent exemplar's task (examples/configs/grpo_tiny_cpu_agent.yaml).

Turn 1: the user asks ``583=``; the policy should continue counting from the prompt's last
digit: ``456`` (``answer_length`` 3, the default), or ``4`` (``answer_length`` 1, what the
exemplar plays). The environment then replies with a digit of its own, ``7=``, and asks for
the count from there; turn 2 should be ``890`` (or ``8``). The environment's digit is drawn
for the prompt (``seed`` and ``prompt_id``: every sibling of a group plays the same game, and
a replay after a restart plays it again), so turn 2's answer cannot be known before the
reply: the policy must read it. The reward is the mean of the two turns' per-position match
scores (``tandemrl.envs.counting``), so a policy that counts correctly in both turns earns 1,
and each turn is worth half of it. A turn that runs out of ``max_tokens`` before it ends
(``finish_reason`` ``length``) scores ``unfinished_turn_credit`` of its match (1 by default;
the exemplar's 0.5: otherwise a policy that follows the digit with any token but the end of
its turn loses nothing, and learns to).

Everything goes through the ``client`` the run hands over, with the official OpenAI call
``client.chat.completions.create``; the endpoint applies the chat template, and the trainer
trains on the exact tokens of both turns (the environment's reply between them is masked).
"""

from __future__ import annotations

import random
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
    """See the module docstring; ``env.kwargs``: ``turns`` (2), ``answer_length`` digits per
    turn (3), ``max_tokens`` per turn (answer_length + 1: the digits and the end-of-turn
    token), ``model`` (the endpoint's served name), ``seed`` of the environment's digits (0),
    ``unfinished_turn_credit`` (1.0: the share of its score a turn keeps when it did not end)."""

    def __init__(
        self,
        turns: int = 2,
        answer_length: int = DEFAULT_ANSWER_LENGTH,
        max_tokens: int | None = None,
        model: str = "policy",
        seed: int = 0,
        unfinished_turn_credit: float = 1.0,
    ) -> None:
        if turns < 1:
            raise ValueError(f"env.kwargs.turns must be at least 1, got {turns}")
        if answer_length < 1:
            raise ValueError(f"env.kwargs.answer_length must be at least 1, got {answer_length}")
        if not 0.0 <= unfinished_turn_credit <= 1.0:
            raise ValueError(
                "env.kwargs.unfinished_turn_credit must be within [0, 1], got "
                f"{unfinished_turn_credit}"
            )
        self.turns = turns
        self.answer_length = answer_length
        self.max_tokens = max_tokens if max_tokens is not None else answer_length + 1
        self.model = model
        self.seed = seed
        self.unfinished_turn_credit = unfinished_turn_credit

    def replies(self, item: PromptItem) -> list[int]:
        """The digits the environment gives after turns 1, 2, ... of ``item``'s game."""
        rng = random.Random(f"{self.seed}/{item.prompt_id}")
        return [rng.randrange(10) for _ in range(self.turns - 1)]

    async def run(self, item: PromptItem, client: Any) -> AgentResult:
        messages: list[dict[str, str]] = [{"role": "user", "content": item.prompt}]
        target = counting_target(item.prompt, self.answer_length)
        replies = self.replies(item)
        scores: list[float] = []
        for turn in range(self.turns):
            reply = await client.chat.completions.create(
                model=self.model, messages=messages, max_tokens=self.max_tokens
            )
            choice = reply.choices[0]
            answer = choice.message.content or ""
            score = positional_match_reward(target, clean_completion(answer))
            if choice.finish_reason != "stop":  # the turn ran out of tokens before it ended
                score *= self.unfinished_turn_credit
            scores.append(score)
            if turn + 1 == self.turns:
                break
            # The environment's reply: a digit of its own; the count goes on from there.
            digit = replies[turn]
            messages += [
                {"role": "assistant", "content": answer},
                {"role": "user", "content": f"{digit}="},
            ]
            target = continue_count(digit, self.answer_length)
        return AgentResult(
            reward=sum(scores) / len(scores),
            metadata={f"turn{index + 1}_reward": score for index, score in enumerate(scores)},
        )
