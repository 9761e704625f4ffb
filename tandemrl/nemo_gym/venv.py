"""Where the NeMo-Gym virtual environment is, and the refusal when there is none.

NeMo-Gym needs Python >= 3.12 and pins packages (openai<=2.7.2 among them) that TandemRL's own
environment must not see, so it lives in a venv of its own, built by
``scripts/install_nemo_gym.sh DIR``; TandemRL runs Gym's servers with that venv's Python. The
venv is ``env.nemo_gym.venv``, else the ``TANDEMRL_NEMO_GYM_VENV`` environment variable.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

VENV_ENV_VAR = "TANDEMRL_NEMO_GYM_VENV"
INSTALL_HINT = (
    "build it with `bash scripts/install_nemo_gym.sh .venv-gym` (Python 3.12, about a minute) "
    f"and set env.nemo_gym.venv: .venv-gym (or the {VENV_ENV_VAR} environment variable)"
)


class GymVenvMissing(RuntimeError):
    """env.name: nemo_gym without a usable NeMo-Gym venv."""


def gym_venv_path(configured: str | None) -> Path:
    """The venv env.nemo_gym.venv (else $TANDEMRL_NEMO_GYM_VENV) names; refuse when neither does."""
    raw = configured or os.environ.get(VENV_ENV_VAR)
    if not raw:
        raise GymVenvMissing(
            f"env.nemo_gym.venv is not set and ${VENV_ENV_VAR} is empty: env.name: nemo_gym "
            f"runs NeMo-Gym's servers in a virtual environment of their own; {INSTALL_HINT}"
        )
    return Path(raw).expanduser().resolve()


def check_gym_venv(configured: str | None) -> Path:
    """The venv's Python, once it is shown to import nemo_gym; GymVenvMissing otherwise."""
    venv = gym_venv_path(configured)
    python = venv / "bin" / "python"
    source = "env.nemo_gym.venv" if configured else f"${VENV_ENV_VAR}"
    if not python.exists():
        raise GymVenvMissing(f"{source}={str(venv)!r} holds no bin/python; {INSTALL_HINT}")
    probe = subprocess.run(
        [str(python), "-c", "import nemo_gym, resources_servers.tandemrl_counting.app"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise GymVenvMissing(
            f"{source}={str(venv)!r}: its Python cannot import nemo_gym and TandemRL's Gym "
            f"servers ({last}); {INSTALL_HINT}"
        )
    return python
