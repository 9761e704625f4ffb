"""``GymAgent``: a TandemRL agent whose episodes NeMo-Gym's own servers play (env.name: nemo_gym).

One episode is one ``POST /run`` to the Gym agent server that the row's ``agent_ref`` names
(``env.nemo_gym.agent_routes`` may send it elsewhere; rows without one go to
``default_agent``). Gym's agent calls its model server, which calls TandemRL's policy endpoint
with the episode's key in the body (``rows.run_body``), so every turn is captured by the
endpoint exactly as for any agent (prompt ids, sampled ids, logprobs, weight versions); the
agent then has the resources server ``/verify`` the response and answers with the reward.

Failures, by what went wrong (the classes of ``tandemrl.rollout.failures``):

- infrastructure (``AgentInfraFailure``, retried with backoff): the agent server refused or
  dropped the connection, or ``/run`` took longer than ``env.nemo_gym.run_timeout_s`` (Gym
  retries an unreachable inner server forever, so a dead resources or model server shows up
  as a ``/run`` that never returns); the message names the Gym servers that no longer answer
  their liveness probe. Engine failures and call deadlines the endpoint met while serving the
  episode are infrastructure failures too (the agent runner reads them off the episode).
- data (``DataFailure``, retried without backoff): ``/run`` answered an HTTP error (Gym's
  agent turns an exception of ``/verify``, of a tool, or a refusal by the endpoint such as a
  wrong temperature into a 500 naming the inner server) or an answer without a finite
  ``reward``.

As a run service (``start`` / ``stop``, called by the agent runner around the pumps) it starts
the Gym servers with the policy endpoint's URL as their model backend, or connects to running
ones; ``health`` names the servers that stopped answering, for the stall watchdog.
"""

from __future__ import annotations

import asyncio
import logging
import math
from pathlib import Path
from typing import Any

import httpx

from tandemrl.agents.api import Agent, AgentInfraFailure, AgentResult
from tandemrl.config.models import NemoGymConfig
from tandemrl.data.gym_rows import GYM_ROW_KEY
from tandemrl.nemo_gym import servers as gym_servers
from tandemrl.nemo_gym.rows import run_body
from tandemrl.nemo_gym.servers import GymProcess, GymStartError, GymTopology
from tandemrl.nemo_gym.venv import check_gym_venv
from tandemrl.records import PromptItem
from tandemrl.rollout.failures import DataFailure

log = logging.getLogger(__name__)

# Gym's model servers send this api key; the endpoint reads the episode from the body.
PROXY_API_KEY = "tandemrl-gym"
# An error body is quoted up to this many characters in a failure message.
ERROR_EXCERPT = 600


def _free_port(host: str) -> int:
    import socket

    with socket.socket() as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def verify_metrics(answer: dict[str, Any], row: dict[str, Any]) -> dict[str, Any]:
    """The numbers and booleans the resources server added to its answer (``exact_match``...):
    averaged per step as ``env/<key>``."""
    return {
        key: value
        for key, value in answer.items()
        if key != "reward"
        and key not in row
        and isinstance(value, bool | int | float)
        and math.isfinite(float(value))
    }


class GymAgent(Agent):
    """See the module docstring."""

    def __init__(self, cfg: NemoGymConfig, *, run_dir: Path, served_model_name: str) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self.served_model_name = served_model_name
        self.topology: GymTopology | None = None
        self.process: GymProcess | None = None
        self._client: httpx.AsyncClient | None = None

    # ------------------------------------------------------------------ run service

    async def start(self, policy_base_url: str | None) -> None:
        if policy_base_url is None:
            raise GymStartError(
                "env.name: nemo_gym needs the policy endpoint (policy.generation.http_server."
                "enabled: true): Gym's model server calls the policy over HTTP"
            )
        # One INFO line per /run from httpx would drown the run's log; its warnings stay.
        httpx_log = logging.getLogger("httpx")
        if httpx_log.level == logging.NOTSET:
            httpx_log.setLevel(logging.WARNING)
        if self.cfg.head_server is not None:
            self.topology = await asyncio.to_thread(self._connect, policy_base_url)
        else:
            self.topology = await asyncio.to_thread(self._launch, policy_base_url)
        self._check_routes(self.topology)
        log.info(
            "NeMo-Gym servers: %s",
            ", ".join(server.describe() for server in self.topology.servers.values()),
        )

    def _launch(self, policy_base_url: str) -> GymTopology:
        python = check_gym_venv(self.cfg.venv)
        working_dir = Path(self.cfg.working_dir or Path.cwd()).resolve()
        if not working_dir.is_dir():
            raise GymStartError(f"env.nemo_gym.working_dir={str(working_dir)!r}: no such folder")
        initial = {
            **self.cfg.overrides,
            "config_paths": list(self.cfg.config_paths),
            "policy_base_url": policy_base_url,
            "policy_api_key": PROXY_API_KEY,
            "policy_model_name": self.served_model_name,
            "head_server": {"host": "127.0.0.1", "port": _free_port("127.0.0.1")},
        }
        self.process = GymProcess(
            python=python,
            initial_config=initial,
            run_dir=self.run_dir,
            working_dir=working_dir,
            max_server_restarts=self.cfg.max_server_restarts,
        )
        return self.process.start(self.cfg.startup_timeout_s)

    def _connect(self, policy_base_url: str) -> GymTopology:
        head = self.cfg.head_server
        assert head is not None  # start() picks _connect only with a head server
        topology, config = gym_servers.read_head_server(f"http://{head.host}:{head.port}")
        backends = [
            url.rstrip("/")
            for url in gym_servers.model_server_backend(config, self.cfg.model_server)
        ]
        if policy_base_url.rstrip("/") not in backends:
            raise GymStartError(
                f"env.nemo_gym.head_server: the Gym model server {self.cfg.model_server!r} "
                f"(env.nemo_gym.model_server) sends its calls to {backends or 'nowhere'}, not to "
                f"this run's policy endpoint {policy_base_url}; start Gym with "
                f"policy_base_url={policy_base_url} (fix the endpoint's port with "
                "policy.generation.http_server.port)"
            )
        return topology

    def _check_routes(self, topology: GymTopology) -> None:
        agents = topology.agents()
        named = dict(self.cfg.agent_routes)
        if self.cfg.default_agent is not None:
            named["<no agent_ref>"] = self.cfg.default_agent
        for source, target in named.items():
            if target not in agents:
                where = (
                    "env.nemo_gym.default_agent"
                    if source == "<no agent_ref>"
                    else f"env.nemo_gym.agent_routes.{source}"
                )
                raise GymStartError(
                    f"{where}={target!r} is not an agent server of the Gym config; its agent "
                    f"servers are {agents}"
                )
        if self.cfg.model_server not in topology.servers:
            raise GymStartError(
                f"env.nemo_gym.model_server={self.cfg.model_server!r} is not a server of the "
                f"Gym config (servers: {sorted(topology.servers)})"
            )

    async def stop(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None
        if self.process is not None:
            await asyncio.to_thread(self.process.stop)
            self.process = None

    async def health(self) -> str | None:
        """None when every Gym server answers; else which ones do not."""
        if self.topology is None:
            return None
        down = await gym_servers.probe(self.topology)
        if not down:
            return None
        return "not answering: " + gym_servers.describe_down(down)

    # ------------------------------------------------------------------ episodes

    def agent_for(self, item: PromptItem) -> str:
        """The Gym agent server that plays ``item`` (module docstring)."""
        if item.agent_ref is not None:
            return self.cfg.agent_routes.get(item.agent_ref, item.agent_ref)
        if self.cfg.default_agent is not None:
            return self.cfg.default_agent
        raise DataFailure(
            f"prompt {item.prompt_id}: the row has no agent_ref and env.nemo_gym.default_agent "
            "is not set, so no Gym agent can play it"
        )

    def _http(self) -> httpx.AsyncClient:
        """The client of the /run calls, made in the loop that plays the episodes: one
        connection per concurrent episode, each call bounded by run_timeout_s."""
        if self._client is None:
            self._client = httpx.AsyncClient(
                timeout=httpx.Timeout(self.cfg.run_timeout_s, connect=10.0),
                limits=httpx.Limits(max_connections=None, max_keepalive_connections=256),
            )
        return self._client

    async def run(self, item: PromptItem, client: Any) -> AgentResult:
        if self.topology is None:
            raise RuntimeError("GymAgent.run before start: the Gym servers are not up")
        row = item.metadata.get(GYM_ROW_KEY)
        if not isinstance(row, dict):
            raise DataFailure(f"prompt {item.prompt_id} is not a NeMo-Gym row (data.dataset)")
        agent_name = self.agent_for(item)
        try:
            agent = self.topology.agent(agent_name)
        except KeyError:
            raise DataFailure(
                f"prompt {item.prompt_id}: agent_ref {agent_name!r} is not an agent server of "
                f"the Gym config (agent servers: {self.topology.agents()})"
            ) from None
        body = run_body(row, agent_name=agent_name, episode_key=str(client.api_key))
        try:
            response = await self._http().post(agent.url + "/run", json=body)
        except httpx.TimeoutException as error:
            down = await gym_servers.probe(self.topology)
            raise AgentInfraFailure(
                f"{agent.describe()}: /run gave no answer within env.nemo_gym.run_timeout_s="
                f"{self.cfg.run_timeout_s}; {gym_servers.describe_down(down)}"
            ) from error
        except httpx.TransportError as error:
            raise AgentInfraFailure(
                f"{agent.describe()}: /run failed ({type(error).__name__}: {error})"
            ) from error
        if response.status_code != 200:
            raise DataFailure(
                f"{agent.describe()}: /run answered HTTP {response.status_code}: "
                f"{response.text[:ERROR_EXCERPT]}"
            )
        try:
            answer = response.json()
            reward = float(answer["reward"])
        except (ValueError, KeyError, TypeError) as error:
            raise DataFailure(
                f"{agent.describe()}: /run answered without a numeric reward: "
                f"{response.text[:ERROR_EXCERPT]}"
            ) from error
        if not math.isfinite(reward):
            raise DataFailure(f"{agent.describe()}: /run answered reward {reward}")
        return AgentResult(reward=reward, keep=True, metadata=verify_metrics(answer, row))
