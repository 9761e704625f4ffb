#!/usr/bin/env bash
# Build (or bring up to date) the NeMo-Gym environment that env.name: nemo_gym runs Gym's
# servers in, and that `python -m pytest tests/nemo_gym` needs.
#
#   scripts/install_nemo_gym.sh .venv-gym
#
# What goes in: Python 3.12 (nemo-gym 0.4.0 needs >= 3.12), nemo-gym with its own pins (Ray,
# FastAPI, uvicorn, openai<=2.7.2, hydra, mlflow, wandb, datasets, ...), and this checkout of
# TandemRL linked in without its dependencies, so that the resources servers we ship
# (tandemrl/nemo_gym/resources_servers/) import their scoring from tandemrl.envs. No torch: the trainer
# never runs here. TandemRL itself keeps running in its own environment (Python 3.11, torch
# 2.13.0 CPU) and talks to Gym over HTTP; docs/nemo_gym.md says why.
#
# Gym resolves a server by folder name, first under the working directory, then under its
# install root; the script links our servers into that root, so they start like built-ins.
#
# Environment:
#   PYTHON_GYM    a Python >= 3.12 to build the venv with (default: python3.12 on PATH, else
#                 the newest 3.12 under ~/.pyenv/versions)
#   NEMO_GYM_SPEC the nemo-gym requirement (default nemo-gym==0.4.0)
#   UV_CACHE_DIR  uv's download cache (CI points it at a scratch folder: nothing is kept)
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV_PATH" >&2
    exit 2
fi
venv=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
gym_spec=${NEMO_GYM_SPEC:-nemo-gym==0.4.0}
started=$(date +%s)

find_python() {
    if [ -n "${PYTHON_GYM:-}" ]; then
        echo "$PYTHON_GYM"
        return
    fi
    # python3.12 on PATH may be a pyenv shim that refuses to run: try each candidate.
    local candidate
    for candidate in python3.12 $(ls -d "$HOME"/.pyenv/versions/3.12*/bin/python3.12 2>/dev/null | sort -V -r); do
        if "$candidate" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 12))' >/dev/null 2>&1; then
            command -v "$candidate"
            return
        fi
    done
    echo "no working Python 3.12 found (nemo-gym needs Python >= 3.12): set PYTHON_GYM" >&2
    exit 1
}

python=$(find_python)
if [ ! -x "$venv/bin/python" ]; then
    # No pip in the venv (ensurepip is slow and nothing here uses it): uv installs everything.
    "$python" -m venv --without-pip "$venv"
fi
py="$venv/bin/python"
"$py" - <<'PY'
import sys

if sys.version_info < (3, 12):
    sys.exit(f"{sys.executable} is Python {sys.version.split()[0]}; nemo-gym needs >= 3.12")
PY

# uv resolves and installs nemo-gym's ~160 packages several times faster than pip. Use $UV, or
# uv on PATH (TandemRL's test extra has it), else install it beside the venv with the
# interpreter's own pip.
uv_bin=${UV:-}
if [ -z "$uv_bin" ]; then
    if command -v uv >/dev/null 2>&1 && uv --version >/dev/null 2>&1; then
        uv_bin=$(command -v uv)
    else
        if [ ! -x "$venv/.uv/bin/uv" ]; then
            "$python" -m pip install --quiet --disable-pip-version-check --target "$venv/.uv" uv \
                2> >(grep -v "is neither a file nor a directory" >&2)
        fi
        uv_bin="$venv/.uv/bin/uv"
    fi
fi
uv=("$uv_bin" pip install --quiet --python "$py")

# One resolve: nemo-gym, then TandemRL linked without dependencies (its torch/transformers
# pins are for the trainer's environment; what our Gym servers import of it is checked below).
"${uv[@]}" "$gym_spec"
"${uv[@]}" --no-deps -e "$repo"

# Our resources servers, where Gym looks for built-in ones (its install root, site-packages).
site=$("$py" -c 'import nemo_gym, pathlib; print(pathlib.Path(nemo_gym.__file__).parents[1])')
for server in "$repo"/tandemrl/nemo_gym/resources_servers/*/; do
    name=$(basename "$server")
    [ -f "$server/app.py" ] || continue
    ln -sfn "${server%/}" "$site/resources_servers/$name"
done

# Fail here, not in the first test: Gym imports, our server imports, and the packages TandemRL
# code imports in this venv meet TandemRL's own ranges (pyproject.toml).
# Bytecode is written here (PYTHONDONTWRITEBYTECODE unset): exactly the modules Gym's servers
# and Ray's agents import get compiled once, instead of at every start.
env -u PYTHONDONTWRITEBYTECODE RAY_AUTH_MODE=disabled RAY_agent_register_timeout_ms=120000 \
    "$py" - "$repo/pyproject.toml" <<'PY'
import sys
import tomllib
from importlib.metadata import version

from packaging.requirements import Requirement

import nemo_gym  # noqa: F401
from resources_servers.tandemrl_counting.app import CountingResourcesServer  # noqa: F401

with open(sys.argv[1], "rb") as file:
    wanted = {Requirement(text).name: Requirement(text) for text in tomllib.load(file)["project"]["dependencies"]}
# What tandemrl.envs and tandemrl.config import; the rest of TandemRL never runs here.
for name in ("pydantic", "pyyaml", "omegaconf", "hydra-core"):
    have = version(name)
    if not wanted[name].specifier.contains(have, prereleases=True):
        sys.exit(f"{name} {have} in the Gym venv is outside TandemRL's range {wanted[name]}")
# Start Gym's Ray once, as the launcher does: its processes compile their bytecode now, not
# inside the raylet's 30 s registration window at a run's first start.
sys.path.insert(0, str(__import__("pathlib").Path(sys.argv[1]).parent / "tandemrl" / "nemo_gym" / "gym_side"))
import ray
from launch import start_ray

start_ray()
ray.shutdown()
print(f"nemo-gym {version('nemo-gym')}, ray {version('ray')}, openai {version('openai')}, python {sys.version.split()[0]}")
PY
echo "Gym venv ready in $(($(date +%s) - started)) s: $venv"
