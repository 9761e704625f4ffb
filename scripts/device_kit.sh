#!/usr/bin/env bash
# Build .devkit: what `tandemrl train` and the test suite need on the lent H200 beyond the
# device image's own packages (Python 3.12, torch, transformers, numpy, aiohttp, rich, pytest,
# pytest-timeout, hypothesis, ...). Ray and pydantic come from the workplace's kit
# (../shared/tools/device-ray-kit.sh: Ray stripped and xz-packed, so that it fits a call);
# the rest travel as cp312 wheels: config (OmegaConf, Hydra), the agent endpoint (FastAPI,
# uvicorn, the openai client) and the TransferQueue data plane. The trackers' packages
# (wandb, mlflow) are not carried: their tests skip without them.
#
#   bash scripts/device_kit.sh [.devkit]      # here, once; .devkit is git-ignored
#
# Then every device call carries [".devkit"] and starts with
#   bash .devkit/install.sh && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
dest=${1:-.devkit}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
ray_kit=${RAY_KIT:-$here/../shared/tools/device-ray-kit.sh}
if [ ! -f "$ray_kit" ]; then
    echo "device_kit.sh: the Ray kit script $ray_kit is missing (set RAY_KIT=...)" >&2
    exit 2
fi
[ -f "$dest/ray-site.tar.xz" ] || bash "$ray_kit" "$dest"
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d "$dest" \
    omegaconf==2.3.1 hydra-core==1.3.8 \
    fastapi==0.136.3 starlette==1.10.0 uvicorn==0.54.0 httptools==0.9.0 orjson==3.13.0 \
    openai==3.57.0 httpx2==2.16.2 httpcore2==2.16.2 truststore==0.10.5 jiter==0.19.0 \
    sniffio==1.3.1 \
    transferqueue==0.1.11 tensordict==0.15.3 pyvers==0.2.3 msgspec==0.23.0 pyzmq==27.3.0
# antlr4 4.9.3 (what hydra-core 1.3 needs) is published as a source package only: pure Python,
# so a wheel built here installs there.
python3 -m pip wheel -q --no-deps -w "$dest" antlr4-python3-runtime==4.9.3
du -sh "$dest"
