"""Agents the agent-worker tests name by ``env.target`` (a worker process imports this module
through ``env.python_path``, so their state is per worker process, never the test's)."""

from __future__ import annotations

import asyncio
import os
from collections import Counter
from pathlib import Path

from tandemrl.agents import Agent, AgentInfraFailure, AgentResult
from tandemrl.agents.counting_game import CountingGameAgent
from tandemrl.records import PromptItem


class Player(Agent):
    """The counting game's player; appends the id of the process that played to ``log``."""

    def __init__(self, log: str) -> None:
        self.log = Path(log)

    async def run(self, item: PromptItem, client) -> AgentResult:
        result = await CountingGameAgent().run(item, client)
        with self.log.open("a") as out:
            out.write(f"{os.getpid()}\n")
        return result


class DiesOnce(Agent):
    """The first episode of prompt e0-i1 kills its worker process (once: ``marker`` remembers
    across the restart); everything else plays correctly."""

    def __init__(self, marker: str) -> None:
        self.marker = Path(marker)

    async def run(self, item: PromptItem, client) -> AgentResult:
        if item.prompt_id == "e0-i1" and not self.marker.exists():
            self.marker.write_text("died")
            os._exit(1)
        return await CountingGameAgent().run(item, client)


class Troublesome(Agent):
    """Each prompt's first two episodes fail in their own way, then it plays correctly."""

    def __init__(self) -> None:
        self.runs: Counter[str] = Counter()

    async def run(self, item: PromptItem, client) -> AgentResult:
        self.runs[item.prompt_id] += 1
        if self.runs[item.prompt_id] <= 2 and item.index < 5:
            trouble = ["raise", "hang", "malformed", "tool down", "refused"][item.index]
            if trouble == "raise":
                raise RuntimeError("the agent's parser broke")
            if trouble == "hang":
                await asyncio.sleep(60)  # a tool that never answers
            if trouble == "malformed":
                return {"reward": 1.0}  # type: ignore[return-value]
            if trouble == "tool down":
                raise AgentInfraFailure("the sandbox is down")
            await client.chat.completions.create(model="not-the-policy", messages=[])
        return await CountingGameAgent().run(item, client)


class Paced(Agent):
    """Plays nothing: an episode whose key starts with ``hang`` waits for a minute, any other
    answers at once with the worker's process id and its key."""

    async def run(self, item: PromptItem, client) -> AgentResult:
        if client.api_key.startswith("hang"):
            await asyncio.sleep(60)
        return AgentResult(1.0, metadata={"pid": os.getpid(), "key": client.api_key})
