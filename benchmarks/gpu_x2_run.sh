#!/usr/bin/env bash
# One device call on the two-GPU machine (nvidia-h200-x2), recorded in docs/benchmarks.md:
#   A. both GPUs: GRPO sync / async / streaming with generation on one GPU and training on the
#      other (NCCL weight sync), the NCCL sync alone for 0.5B and 1.5B, then the train part in
#      the same process (it failed there once, after the two-GPU GRPO runs);
#   B. GPU 0 only: the one-GPU GRPO rows (colocated, two processes with CUDA IPC).
# First, tests/unit/test_weight_sync_gpu.py checks both transports exactly on the GPUs.
# Each part has its own time limit (A_S, B_S seconds) so that B cannot eat A's results; JSON
# results and the log are packed into $OUT (two files: run.log, results.tgz).
#
#   OUT=/tmp/out A_S=280 B_S=110 bash benchmarks/gpu_x2_run.sh
set -u -o pipefail
OUT=${OUT:-runs/gpu_x2}
A_S=${A_S:-280}
B_S=${B_S:-110}
RESULTS=$(mktemp -d)
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
COMMON=(--length-cap 128 --steps 3)
{
    date -u
    nvidia-smi --query-gpu=index,name,memory.used,utilization.gpu --format=csv
    echo "=== GPU weight-sync tests (CUDA IPC on one GPU, NCCL across two)"
    timeout "${T_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/unit/test_weight_sync_gpu.py
    echo "=== A: two GPUs"
    timeout "$A_S" python3 benchmarks/gpu_grpo.py --part ceilings grpo sync train \
        --placements two_gpus --sync-sizes 0.5b 1.5b --sync-nccl-only "${COMMON[@]}" \
        --out "$RESULTS/x2"
    echo "A exit $? at $(date -u +%T)"
    echo "=== B: one GPU"
    CUDA_VISIBLE_DEVICES=0 timeout "$B_S" python3 benchmarks/gpu_grpo.py --part ceilings grpo \
        --placements colocated two_processes "${COMMON[@]}" --out "$RESULTS/x1"
    echo "B exit $? at $(date -u +%T)"
} 2>&1 | tee "$OUT/run.log"
tar czf "$OUT/results.tgz" -C "$RESULTS" .
