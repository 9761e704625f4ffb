"""Multi-turn agents: an OpenAI-compatible policy endpoint with exact token capture.

A user writes an ``Agent`` (``api.py``) whose ``run(item, client)`` talks to the policy for as
many turns as it likes and returns an ``AgentResult``. The pieces behind it:

- ``service.py``: ``PolicyService``, the policy as an OpenAI API (checks, chat template,
  generation through the ``GenerationPool``, one captured turn per call);
- ``server.py``: ``PolicyEndpoint``, that service over HTTP (Starlette + uvicorn, in the
  controller's event loop); ``inprocess.py``: the same surface without HTTP;
- ``episodes.py``: episode keys (the bearer token) and the turns they capture;
- ``runner.py``: ``AgentRollouts``, one episode per sibling of a group, failures sorted into
  data and infrastructure, for the rollout manager; ``setup.py`` builds it from the config.

How turns become training rows is ``tandemrl.rollout.token_capture``; docs/agents.md tells a
user how to write an agent and what the endpoint answers.
"""

from __future__ import annotations

from pathlib import Path

from tandemrl.agents.api import Agent, AgentInfraFailure, AgentResult, import_agent_class
from tandemrl.config.models import EnvConfig, MasterConfig

# env.name values whose episodes are agent runs: a user's Agent, or NeMo-Gym's servers.
AGENT_RUNS = ("agent", "nemo_gym")


def is_agent_run(cfg: EnvConfig) -> bool:
    return cfg.name in AGENT_RUNS


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


def create_run_agent(cfg: MasterConfig) -> Agent:
    """The run's agent: ``env.target`` (env.name: agent), or the NeMo-Gym agent whose episodes
    Gym's servers play (env.name: nemo_gym; its logs go to ``<logger.log_dir>/nemo_gym``)."""
    if cfg.env.name == "nemo_gym":
        from tandemrl.nemo_gym.agent import GymAgent

        return GymAgent(
            cfg.env.nemo_gym,
            run_dir=Path(cfg.logger.log_dir) / "nemo_gym",
            served_model_name=cfg.policy.generation.http_server.served_model_name,
        )
    return create_agent(cfg.env)


__all__ = [
    "AGENT_RUNS",
    "Agent",
    "AgentInfraFailure",
    "AgentResult",
    "agent_class",
    "create_agent",
    "create_run_agent",
    "import_agent_class",
    "is_agent_run",
]
