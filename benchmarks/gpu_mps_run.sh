#!/usr/bin/env bash
# Run a command (a gpu_grpo run with the engine in a process of its own) under CUDA MPS.
#
# Without MPS the GPU time-slices between processes: an engine process and a trainer process
# never run kernels at once (docs/benchmarks.md, session 6). One process running both avoids
# that but makes the engine's step thread wait for the GIL beside the trainer's (session 8).
# Under MPS the two processes' kernels share the GPU like two streams of one process, each
# with a GIL of its own. This starts an MPS control daemon with private pipe and log
# folders, runs the command as its client, and stops the daemon however the command ends.
# It changes no setting of the card (compute mode, clocks, persistence stay as they are).
#
#   bash benchmarks/gpu_mps_run.sh python3 benchmarks/gpu_grpo.py --part grpo \
#       --placements two_processes --modes sync async_in_order_1 --steps 12 --warmup-steps 6
set -euo pipefail

if [ "$#" -eq 0 ]; then
    echo "usage: $0 COMMAND [ARGS...]" >&2
    exit 2
fi
if ! command -v nvidia-cuda-mps-control >/dev/null; then
    echo "$0: nvidia-cuda-mps-control not found (the NVIDIA driver's MPS tools)" >&2
    exit 1
fi
root=$(mktemp -d /tmp/tandemrl-mps.XXXXXX)
export CUDA_MPS_PIPE_DIRECTORY="$root/pipe" CUDA_MPS_LOG_DIRECTORY="$root/log"
mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
nvidia-cuda-mps-control -d
stop() {
    echo quit | nvidia-cuda-mps-control || echo "$0: the MPS daemon did not stop" >&2
    cat "$CUDA_MPS_LOG_DIRECTORY"/control.log >&2 2>/dev/null || true
}
trap stop EXIT
"$@"
