"""Multi-turn agents: an OpenAI-compatible policy endpoint with exact token capture.

A user writes an ``Agent`` (``api.py``) whose ``run(item, client)`` talks to the policy for as
many turns as it likes and returns an ``AgentResult``. The pieces behind it:

- ``service.py``: ``PolicyService``, the policy as an OpenAI API (checks, chat template,
  generation through the ``GenerationPool``, one captured turn per call);
- ``server.py``: ``PolicyEndpoint``, that service over HTTP (FastAPI + uvicorn, in the
  controller's event loop); ``inprocess.py``: the same surface without HTTP;
- ``episodes.py``: episode keys (the bearer token) and the turns they capture;
- ``runner.py``: ``AgentRollouts``, one episode per sibling of a group, failures sorted into
  data and infrastructure, for the rollout manager; ``setup.py`` builds it from the config.

How turns become training rows is ``tandemrl.rollout.token_capture``; docs/agents.md tells a
user how to write an agent and what the endpoint answers.
"""

from __future__ import annotations

from tandemrl.agents.api import Agent, AgentInfraFailure, AgentResult, import_agent_class
from tandemrl.config.models import EnvConfig


def agent_class(cfg: EnvConfig) -> type[Agent]:
    """The ``Agent`` subclass ``env.target`` names, imported through ``env.python_path``."""
    from tandemrl.envs import add_python_path

    if not cfg.target:
        raise ValueError("env.name is 'agent' but env.target is not set ('module:ClassName')")
    add_python_path(cfg)
    return import_agent_class(cfg.target)


def create_agent(cfg: EnvConfig) -> Agent:
    """The run's agent: ``env.target`` built with ``env.kwargs``."""
    cls = agent_class(cfg)
    try:
        return cls(**cfg.kwargs)
    except TypeError as error:
        raise TypeError(
            f"env.target={cfg.target!r}: env.kwargs {cfg.kwargs!r} rejected: {error}"
        ) from error


__all__ = [
    "Agent",
    "AgentInfraFailure",
    "AgentResult",
    "agent_class",
    "create_agent",
    "import_agent_class",
]
