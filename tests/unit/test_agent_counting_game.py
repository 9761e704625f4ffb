"""The exemplar's two-turn counting game scores what a player says in both turns: the second
against the environment's own digit, a turn that does not end at a share of its score."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest

from tandemrl.agents.counting_game import CountingGameAgent
from tandemrl.records import PromptItem


class ScriptedClient:
    """``chat.completions.create`` answering from ``play(messages)``: (content, finish_reason)."""

    def __init__(self, play: Any) -> None:
        self.calls: list[list[dict[str, str]]] = []
        self.chat = SimpleNamespace(completions=SimpleNamespace(create=self.create))
        self.play = play

    async def create(self, *, model: str, messages: list[dict[str, str]], max_tokens: int) -> Any:
        self.calls.append([dict(message) for message in messages])
        content, finish_reason = self.play(messages)
        message = SimpleNamespace(content=content)
        return SimpleNamespace(
            choices=[SimpleNamespace(message=message, finish_reason=finish_reason)]
        )


def next_digit(messages: list[dict[str, str]]) -> str:
    return str((int(messages[-1]["content"].rstrip("=")[-1]) + 1) % 10)


def play(agent: CountingGameAgent, item: PromptItem, how: Any) -> tuple[Any, ScriptedClient]:
    client = ScriptedClient(how)
    return asyncio.run(agent.run(item, client)), client


def test_the_second_turn_is_scored_on_the_environments_own_digit():
    agent = CountingGameAgent(answer_length=1, unfinished_turn_credit=0.5)
    item = PromptItem("e0-i7", 0, 7, "583=")
    result, client = play(agent, item, lambda messages: (next_digit(messages), "stop"))
    assert result.reward == 1.0 and result.metadata == {"turn1_reward": 1.0, "turn2_reward": 1.0}
    (digit,) = agent.replies(item)
    assert client.calls[1][1:] == [
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": f"{digit}="},
    ]
    # The reply is drawn per prompt: every sibling (and a replay) plays the same game, and a
    # player that keeps counting from its own answer instead of the reply is scored on it.
    assert agent.replies(item) == [digit]
    others = {agent.replies(PromptItem(f"e0-i{i}", 0, i, "583="))[0] for i in range(40)}
    assert len(others) > 5
    ignores_reply, _ = play(
        agent,
        item,
        lambda messages: ("4" if len(messages) == 1 else "5", "stop"),
    )
    assert ignores_reply.metadata["turn2_reward"] == (1.0 if digit == 4 else 0.0)


def test_a_turn_that_does_not_end_keeps_its_share_of_the_score():
    item = PromptItem("e0-i1", 0, 1, "120=")

    def runs_out_in_turn_one(messages: list[dict[str, str]]) -> tuple[str, str]:
        return next_digit(messages), "length" if len(messages) == 1 else "stop"

    half, _ = play(
        CountingGameAgent(answer_length=1, unfinished_turn_credit=0.5), item, runs_out_in_turn_one
    )
    assert half.metadata == {"turn1_reward": 0.5, "turn2_reward": 1.0} and half.reward == 0.75
    full, _ = play(CountingGameAgent(answer_length=1), item, runs_out_in_turn_one)
    assert full.reward == 1.0  # the default keeps the whole score
    with pytest.raises(ValueError, match="unfinished_turn_credit"):
        CountingGameAgent(unfinished_turn_credit=1.5)
