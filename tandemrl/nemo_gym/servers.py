"""The NeMo-Gym servers of a run: start them (Gym's RunHelper, in the Gym venv) or find running ones.

Two ways in, one result (a ``GymTopology``: every server's name, kind and URL):

- **start** (``env.nemo_gym.config_paths``): ``GymProcess`` runs ``gym_side/launch.py`` with the
  Gym venv's Python, in a session of its own, its output in ``<log_dir>/nemo_gym.log``. The
  launcher parses the Gym config (the files, then TandemRL's policy endpoint as
  ``policy_base_url`` / ``policy_model_name`` / ``policy_api_key``, then
  ``env.nemo_gym.overrides``), starts every server with Gym's ``RunHelper``, restarts one that
  dies (same port), and exits when TandemRL's process is gone. ``stop`` ends its whole session.
- **connect** (``env.nemo_gym.head_server``): servers someone started with ``gym env start``;
  their table comes from the head server (``GET /server_instances``) and their config from
  ``GET /global_config_dict_yaml``, which also tells whether the model server's backend is this
  run's endpoint.

``probe`` asks each server's liveness route (``GET /``) and returns the ones that did not answer:
a timed-out episode and the stall watchdog name them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

log = logging.getLogger(__name__)

LAUNCHER = Path(__file__).resolve().parent / "gym_side" / "launch.py"
AGENT_TYPE = "responses_api_agents"
MODEL_TYPE = "responses_api_models"
RESOURCES_TYPE = "resources_servers"
KIND_NAMES = {AGENT_TYPE: "agent", MODEL_TYPE: "model", RESOURCES_TYPE: "resources"}
PROBE_TIMEOUT_S = 2.0


class GymStartError(RuntimeError):
    """The Gym servers did not come up, or the running ones do not fit this run."""


@dataclass(frozen=True)
class GymServer:
    name: str  # the top-level name in the Gym config: what agent_ref names, what URLs key on
    server_type: str  # responses_api_agents | responses_api_models | resources_servers
    host: str
    port: int

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def describe(self) -> str:
        return f"Gym {KIND_NAMES.get(self.server_type, self.server_type)} server {self.name} ({self.host}:{self.port})"


@dataclass(frozen=True)
class GymTopology:
    servers: dict[str, GymServer]
    head_url: str

    def agents(self) -> list[str]:
        return sorted(name for name, s in self.servers.items() if s.server_type == AGENT_TYPE)

    def agent(self, name: str) -> GymServer:
        server = self.servers.get(name)
        if server is None or server.server_type != AGENT_TYPE:
            raise KeyError(name)
        return server


async def probe(topology: GymTopology, timeout_s: float = PROBE_TIMEOUT_S) -> list[GymServer]:
    """The servers whose liveness route did not answer within ``timeout_s``."""

    async def alive(client: httpx.AsyncClient, server: GymServer) -> bool:
        try:
            await client.get(server.url + "/")
        except httpx.HTTPError:
            return False
        return True

    servers = list(topology.servers.values())
    async with httpx.AsyncClient(timeout=timeout_s) as client:
        answers = await asyncio.gather(*(alive(client, server) for server in servers))
    return [server for server, answered in zip(servers, answers, strict=True) if not answered]


def describe_down(down: list[GymServer]) -> str:
    return ", ".join(server.describe() for server in down) or "every Gym server answers"


# --------------------------------------------------------------------------- connect


def _head_get(head_url: str, path: str, timeout_s: float) -> Any:
    try:
        response = httpx.get(head_url + path, timeout=timeout_s)
        response.raise_for_status()
    except httpx.HTTPError as error:
        raise GymStartError(
            f"env.nemo_gym.head_server: the Gym head server at {head_url} did not answer "
            f"GET {path} ({type(error).__name__}: {error}); start it with `gym env start` or "
            "give env.nemo_gym.config_paths to let TandemRL start Gym"
        ) from error
    return response.json()


def read_head_server(head_url: str, timeout_s: float = 10.0) -> tuple[GymTopology, dict[str, Any]]:
    """The running servers and the merged Gym config, from a head server."""
    instances = _head_get(head_url, "/server_instances", timeout_s)
    config = yaml.safe_load(_head_get(head_url, "/global_config_dict_yaml", timeout_s))
    servers = {}
    for instance in instances:
        name = instance.get("process_name") or instance.get("config_path")
        if not name or instance.get("port") is None:
            continue
        servers[name] = GymServer(
            name, str(instance["server_type"]), str(instance["host"]), int(instance["port"])
        )
    if not servers:
        raise GymStartError(
            f"env.nemo_gym.head_server: the Gym head server at {head_url} lists no servers"
        )
    return GymTopology(servers, head_url), config


def model_server_backend(config: dict[str, Any], model_server: str) -> list[str]:
    """The backend URLs the Gym config gives ``model_server`` (``base_url``, a string or a list;
    the head server's config keeps ``${policy_base_url}`` references, resolved here)."""
    from omegaconf import OmegaConf

    entry = config.get(model_server)
    if not isinstance(entry, dict) or MODEL_TYPE not in entry:
        return []
    folder = next(iter(entry[MODEL_TYPE]), None)
    if folder is None:
        return []
    tree = OmegaConf.create(config)
    base_url: Any = None
    for key in ("base_url", "openai_base_url"):
        base_url = OmegaConf.select(tree, f"{model_server}.{MODEL_TYPE}.{folder}.{key}")
        if base_url is not None:
            break
    if base_url is None:
        return []
    if not isinstance(base_url, str):
        base_url = OmegaConf.to_container(base_url, resolve=True)
    return [base_url] if isinstance(base_url, str) else [str(url) for url in base_url]


# --------------------------------------------------------------------------- start


class GymProcess:
    """The launcher subprocess of a run that starts its own Gym servers (module docstring)."""

    def __init__(
        self,
        *,
        python: Path,
        initial_config: dict[str, Any],
        run_dir: Path,
        working_dir: Path,
        max_server_restarts: int,
    ) -> None:
        self.python = python
        self.initial_config = initial_config
        self.run_dir = run_dir
        self.working_dir = working_dir
        self.max_server_restarts = max_server_restarts
        self.log_path = run_dir / "nemo_gym.log"
        self.ready_path = run_dir / "nemo_gym_ready.json"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, startup_timeout_s: float) -> GymTopology:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.ready_path.unlink(missing_ok=True)
        spec_path = self.run_dir / "nemo_gym_launch.json"
        spec = {
            "initial_global_config_dict": self.initial_config,
            "venv_links_dir": str(self.run_dir / "nemo_gym_venvs"),
            "ready_file": str(self.ready_path),
            "max_server_restarts": self.max_server_restarts,
        }
        spec_path.write_text(json.dumps(spec, indent=1))
        env = dict(os.environ)
        # The Gym venv's own packages only: nothing of TandemRL's environment leaks in.
        for name in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "RAY_ADDRESS"):
            env.pop(name, None)
        # Let the servers' imports keep their bytecode (a first start compiles it once).
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PATH"] = f"{self.python.parent}{os.pathsep}{env.get('PATH', '')}"
        env.setdefault("RAY_AUTH_MODE", "disabled")
        # The raylet waits this long for its agent processes (default 30 s), which a loaded
        # machine can exceed.
        env.setdefault("RAY_agent_register_timeout_ms", "120000")
        with self.log_path.open("ab") as log_file:
            self.process = subprocess.Popen(
                [str(self.python), str(LAUNCHER), str(spec_path)],
                cwd=self.working_dir,
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        log.info("starting NeMo-Gym servers (pid %d, log %s)", self.process.pid, self.log_path)
        deadline = time.monotonic() + startup_timeout_s
        while not self.ready_path.exists():
            if self.process.poll() is not None:
                raise GymStartError(
                    f"the NeMo-Gym servers did not start (launcher exit code "
                    f"{self.process.returncode}); the end of {self.log_path}:\n{self.log_tail()}"
                )
            if time.monotonic() > deadline:
                self.stop()
                raise GymStartError(
                    f"the NeMo-Gym servers were not all up within env.nemo_gym."
                    f"startup_timeout_s={startup_timeout_s}; the end of {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            time.sleep(0.2)
        ready = json.loads(self.ready_path.read_text())
        head = ready["head_server"]
        servers = {
            name: GymServer(name, entry["type"], str(entry["host"]), int(entry["port"]))
            for name, entry in ready["servers"].items()
        }
        return GymTopology(servers, f"http://{head['host']}:{head['port']}")

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def stop(self, grace_s: float = 5.0) -> None:
        """End the launcher's session: the launcher, every server, Gym's Ray cluster."""
        if self.process is None:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.process.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.process.wait(timeout=grace_s)
                if sig == signal.SIGTERM:
                    # The launcher stopped its servers; take anything left in its session.
                    os.killpg(self.process.pid, signal.SIGKILL)
                break
            except subprocess.TimeoutExpired:
                continue
            except ProcessLookupError:
                break
        self.process = None
