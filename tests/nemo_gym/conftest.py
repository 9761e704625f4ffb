"""Fixtures of the NeMo-Gym tests: one set of real Gym servers for the whole session.

These tests run TandemRL in its own environment and NeMo-Gym's servers in the Gym venv
(``scripts/install_nemo_gym.sh DIR``, then ``TANDEMRL_NEMO_GYM_VENV=DIR python -m pytest
tests/nemo_gym``; ``.ci/run`` does both); the main test run does not collect this folder.

Starting Gym (its Ray, head server, and the agent, model and resources servers) costs
15-80 s on the shared 2-core machines, so the session starts it once, the way a run with
``env.nemo_gym.config_paths`` does (``GymAgent.start``), with its model server pointed at a
fixed port: each test's run serves its policy endpoint there and connects to these servers
through ``env.nemo_gym.head_server``.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "unit"))  # agent_helpers: the scripted engine, tokenizer
sys.path.insert(0, str(REPO / "tests" / "chaos"))  # chaos_harness

from tandemrl.config.models import NemoGymConfig  # noqa: E402
from tandemrl.nemo_gym.agent import GymAgent  # noqa: E402
from tandemrl.nemo_gym.servers import GymTopology  # noqa: E402
from tandemrl.nemo_gym.venv import VENV_ENV_VAR, check_gym_venv  # noqa: E402

EXEMPLAR = REPO / "examples" / "configs" / "grpo_tiny_cpu_nemo_gym.yaml"
CONFIG_PATHS = [
    "resources_servers/tandemrl_counting/configs/tandemrl_counting.yaml",
    "responses_api_models/vllm_model/configs/vllm_model.yaml",
]
AGENT = "tandemrl_counting_simple_agent"
DATASET = REPO / "tandemrl/nemo_gym/resources_servers/tandemrl_counting/data/train.jsonl"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class GymServers:
    agent: GymAgent  # the one that started them (its process is the launcher)
    topology: GymTopology
    policy_port: int  # where the Gym model server sends its calls

    def connect_overrides(self) -> list[str]:
        """Config overrides for a run that uses these servers."""
        head = self.topology.head_url.removeprefix("http://")
        host, port = head.split(":")
        return [
            "env.nemo_gym.config_paths=[]",
            f"++env.nemo_gym.head_server={{host: {host}, port: {port}}}",
            f"env.nemo_gym.venv={os.environ[VENV_ENV_VAR]}",
            f"policy.generation.http_server.port={self.policy_port}",
            f"data.dataset={DATASET}",
        ]


@pytest.fixture(scope="session")
def gym(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GymServers]:
    if not os.environ.get(VENV_ENV_VAR):
        pytest.fail(
            f"tests/nemo_gym need the Gym venv: bash scripts/install_nemo_gym.sh DIR, then "
            f"{VENV_ENV_VAR}=DIR python -m pytest tests/nemo_gym"
        )
    check_gym_venv(None)
    port = free_port()
    agent = GymAgent(
        NemoGymConfig(config_paths=CONFIG_PATHS, startup_timeout_s=400),
        run_dir=tmp_path_factory.mktemp("gym"),
        served_model_name="policy",
    )
    asyncio.run(agent.start(f"http://127.0.0.1:{port}/v1"))
    assert agent.topology is not None
    try:
        yield GymServers(agent, agent.topology, port)
    finally:
        asyncio.run(agent.stop())
