"""Start NeMo-Gym's servers with Gym's own ``RunHelper`` and keep them up (runs in the Gym venv).

TandemRL runs this file with the Gym venv's Python (``scripts/install_nemo_gym.sh``); it
imports ``nemo_gym`` and nothing of TandemRL. The one argument is a JSON file:

    {"initial_global_config_dict": {...},   # config_paths, policy_*, head_server, overrides
     "venv_links_dir": "...",               # where each server's ".venv" link is made
     "ready_file": "...",                   # written once every server answers
     "max_server_restarts": 3}

What it does, in order:

1. parses the Gym config exactly as ``gym env start`` does (``get_global_config_dict`` with
   the initial dict: config files, then overrides), which also picks every server's port;
2. points every server's per-server venv (Gym makes one per server folder with uv) at this
   venv through a link under ``venv_links_dir`` with ``skip_venv_if_present``, so no server
   installs anything at start;
3. starts the Ray cluster Gym's servers connect to (every Gym server process joins one; a
   local cluster without the dashboard, which starts several times faster here than the full
   one Gym would start itself), then ``RunHelper.start``: Gym's own head server and one
   process per server, waiting until each answers;
4. writes ``ready_file`` (the head server's address and every server's host and port), then
   polls twice a second: a server process that exited is started again with the same command
   and port (Gym's ``setup_env_command`` / ``run_command``), up to ``max_server_restarts``
   times per server; past that, or when the process that started this one is gone (TandemRL
   was killed), or on SIGTERM/SIGINT, every server is stopped and this process exits.

A restarted server keeps its port, so the URLs TandemRL read from the head server stay valid.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import ray
from nemo_gym.cli.env import RunHelper, _resolve_server_dir
from nemo_gym.cli.setup_command import run_command, setup_env_command
from nemo_gym.global_config import (
    NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME,
    NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME,
    GlobalConfigDictParserConfig,
    get_global_config_dict,
)
from omegaconf import DictConfig, OmegaConf, open_dict

POLL_S = 0.5
SERVER_TYPES = ("responses_api_agents", "responses_api_models", "resources_servers")


class Stop(Exception):
    """SIGTERM or SIGINT: stop every server and exit."""


def _raise_stop(signum: int, _frame: Any) -> None:
    raise Stop(signal.Signals(signum).name)


def server_instances(global_config: DictConfig) -> dict[str, tuple[str, str, DictConfig]]:
    """Top-level name → (server type, server folder name, its config), as RunHelper walks them."""
    found = {}
    for name, value in global_config.items():
        if not isinstance(value, DictConfig) or len(value) != 1:
            continue
        server_type = next(iter(value))
        if server_type not in SERVER_TYPES or not isinstance(value[server_type], DictConfig):
            continue
        folder = next(iter(value[server_type]))
        inner = value[server_type][folder]
        if isinstance(inner, DictConfig) and "entrypoint" in inner:
            found[str(name)] = (server_type, str(folder), inner)
    return found


def link_server_venvs(instances: dict[str, tuple[str, str, DictConfig]], links: Path) -> None:
    """``<links>/<type>/<folder>/.venv`` → this venv, for every server (see step 2)."""
    for server_type, folder, _ in instances.values():
        link = links / server_type / folder / ".venv"
        link.parent.mkdir(parents=True, exist_ok=True)
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(sys.prefix, target_is_directory=True)


def server_command(name: str, server_type: str, folder: str, inner: DictConfig) -> tuple[str, Path]:
    """The shell command RunHelper.start runs for one server, and its folder."""
    global_config = get_global_config_dict()
    dir_path = _resolve_server_dir(Path(server_type, folder))
    config_yaml = shlex.quote(OmegaConf.to_yaml(global_config))
    command = (
        f"{setup_env_command(dir_path, global_config, name)} && "
        f"{NEMO_GYM_CONFIG_DICT_ENV_VAR_NAME}={config_yaml} "
        f"{NEMO_GYM_CONFIG_PATH_ENV_VAR_NAME}={shlex.quote(name)} python {inner.entrypoint}"
    )
    return command, dir_path


def kill_tree(pid: int) -> None:
    """SIGKILL a server's shell and everything under it (the Python server is its child)."""
    try:
        root = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    for process in [*root.children(recursive=True), root]:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            continue


def start_ray(attempts: int = 3) -> None:
    """A local Ray cluster for Gym's servers. Ray gives its raylet 30 s (a constant in
    ``ray._private.node``) to register; on a loaded machine the first start after an install
    can miss that while its processes compile their bytecode, so a failed start is retried."""
    for attempt in range(1, attempts + 1):
        try:
            ray.init(include_dashboard=False, num_cpus=1, log_to_driver=False)
            return
        except Exception as error:
            print(
                f"[tandemrl gym launcher] Ray start {attempt}/{attempts} failed: {error}",
                flush=True,
            )
            ray.shutdown()
            # ray.shutdown leaves a node that never registered running (its GCS, monitors):
            # nothing else is a child yet (no server started), so every child goes.
            for child in psutil.Process().children(recursive=True):
                with contextlib.suppress(psutil.NoSuchProcess):
                    child.kill()
            if attempt == attempts:
                raise


def main(spec_path: str) -> int:
    spec = json.loads(Path(spec_path).read_text())
    parent = os.getppid()
    signal.signal(signal.SIGTERM, _raise_stop)
    signal.signal(signal.SIGINT, _raise_stop)
    initial = dict(spec["initial_global_config_dict"])
    # Step 2: every server runs in this venv (links made below), nothing is installed.
    initial["uv_venv_dir"] = spec["venv_links_dir"]
    initial["skip_venv_if_present"] = True
    parser_config = GlobalConfigDictParserConfig(
        initial_global_config_dict=DictConfig(initial),
        skip_load_from_cli=True,
        skip_load_from_dotenv=True,
    )
    global_config = get_global_config_dict(global_config_dict_parser_config=parser_config)
    instances = server_instances(global_config)
    link_server_venvs(instances, Path(spec["venv_links_dir"]))
    if not global_config.get("ray_head_node_address"):
        start_ray()
        with open_dict(global_config):
            global_config["ray_head_node_address"] = ray.get_runtime_context().gcs_address
    helper = RunHelper()
    restarts = dict.fromkeys(instances, 0)
    try:
        helper.start(parser_config)
        ready = {
            "head_server": OmegaConf.to_container(global_config["head_server"]),
            "servers": {
                name: {
                    "type": server_type,
                    "folder": folder,
                    "host": inner.host,
                    "port": inner.port,
                }
                for name, (server_type, folder, inner) in instances.items()
            },
            "pid": os.getpid(),
        }
        ready_file = Path(spec["ready_file"])
        ready_file.with_suffix(".tmp").write_text(json.dumps(ready))
        ready_file.with_suffix(".tmp").replace(ready_file)
        print(f"[tandemrl gym launcher] all {len(instances)} servers ready", flush=True)
        while True:
            time.sleep(POLL_S)
            if os.getppid() != parent:
                print("[tandemrl gym launcher] TandemRL is gone: stopping", flush=True)
                return 0
            for name, process in list(helper._processes.items()):
                if process.poll() is None:
                    continue
                if restarts[name] >= spec["max_server_restarts"]:
                    print(
                        f"[tandemrl gym launcher] server {name} exited (code "
                        f"{process.returncode}) after {restarts[name]} restart(s) "
                        "(env.nemo_gym.max_server_restarts): stopping",
                        flush=True,
                    )
                    return 1
                restarts[name] += 1
                kill_tree(process.pid)
                server_type, folder, inner = instances[name]
                command, dir_path = server_command(name, server_type, folder, inner)
                print(
                    f"[tandemrl gym launcher] server {name} exited (code {process.returncode});"
                    f" restart {restarts[name]} on port {inner.port}",
                    flush=True,
                )
                helper._processes[name] = run_command(command, dir_path, server_name=name)
    except Stop as stop:
        print(f"[tandemrl gym launcher] {stop}: stopping", flush=True)
        return 0
    finally:
        for process in helper.__dict__.get("_processes", {}).values():
            kill_tree(process.pid)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
