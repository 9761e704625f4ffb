"""What a user writes for a multi-turn agent: an ``Agent`` subclass returning an ``AgentResult``.

``env.name: agent`` with ``env.target: "module:ClassName"`` names the class; it is built once
per run with ``env.kwargs``, and its ``run`` is awaited once per sibling of every prompt
group, on the controller's event loop (never block it: await I/O, put CPU-heavy tools in a
thread or process). ``client`` is an ``openai.AsyncOpenAI`` pointed at the policy endpoint
with the episode's key as its ``api_key`` (or an in-process client with the same surface);
every call made with it is a captured turn of this episode. See docs/agents.md.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any

from tandemrl.records import PromptItem
from tandemrl.targets import import_target_class


@dataclass
class AgentResult:
    """The outcome of one episode: its reward, whether to train on it, and numeric or other
    metadata (numbers are averaged into the step's metrics as ``env/<key>``)."""

    reward: float
    keep: bool = True
    metadata: dict[str, Any] = field(default_factory=dict)


class AgentInfraFailure(ConnectionError):
    """Raise from ``run`` when infrastructure the agent needs failed (a tool server is down):
    the episode is retried as an infrastructure failure (with backoff), not charged as data."""


class Agent(ABC):
    """One agent; ``run`` plays one episode (see the module docstring)."""

    @abstractmethod
    async def run(self, item: PromptItem, client: Any) -> AgentResult:
        """Play one episode of ``item`` through ``client``; return its reward."""

    async def start(self, policy_base_url: str | None) -> None:
        """Called once before the first episode, with the endpoint's base URL (None with the
        in-process client): start what the episodes need (NeMo-Gym's servers, a sandbox)."""
        return None

    async def stop(self) -> None:
        """Called once after the last episode (also when the run fails)."""
        return None

    async def health(self) -> str | None:
        """What is wrong with what the agent depends on, for the stall watchdog's report
        (None: nothing known to be wrong)."""
        return None


def check_agent_result(value: object) -> AgentResult:
    """``value`` if it is a well-formed ``AgentResult``; else ValueError saying what is wrong."""
    if not isinstance(value, AgentResult):
        raise ValueError(f"Agent.run returned {type(value).__name__} {value!r}, not an AgentResult")
    reward = value.reward
    if isinstance(reward, bool) or not isinstance(reward, int | float) or not math.isfinite(reward):
        raise ValueError(f"AgentResult.reward must be a finite number, got {reward!r}")
    if not isinstance(value.keep, bool):
        raise ValueError(f"AgentResult.keep must be a bool, got {value.keep!r}")
    if not isinstance(value.metadata, dict):
        raise ValueError(f"AgentResult.metadata must be a dict, got {value.metadata!r}")
    return value


def import_agent_class(target: str) -> type[Agent]:
    """Import ``env.target`` (``"module:ClassName"``) and check that it is an ``Agent``."""
    return import_target_class(target, Agent, "tandemrl.agents.Agent")
