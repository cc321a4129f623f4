#!/usr/bin/env bash
# Everything k3rl measures on a GPU, in one go (the device machine: one H200, torch 2.11, triton 3.6).
# Usage (from the repository root, wheels of fla-core/flash-linear-attention in .whl/):
#   bash benchmarks/gpu_suite.sh PART OUTDIR      PART = tests | kernels | systems
# Each step's output goes to OUTDIR/<step>.log; a failing step does not stop the others.
set -u
part=${1:-tests}; out=${2:-out}; mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="${PYTHONPATH:-}:$(pwd)"
step() { local name=$1 limit=$2; shift 2; echo "=== $name: $*"; timeout "$limit" "$@" >"$out/$name.log" 2>&1; echo "=== $name rc=$?"; tail -n 25 "$out/$name.log"; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'
case $part in
  tests)
    step gpu_tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/k3core/ops tests/k3core/optim tests/k3core/checkpoint/test_odirect.py tests/k3core/model
    ;;
  kernels)
    step kda 150 python3 benchmarks/kda_cpu.py --device cuda
    step situ 150 python3 benchmarks/situ.py --device cuda
    step mxfp4 120 python3 benchmarks/mxfp4.py --device cuda
    step moe_dispatch 90 python3 benchmarks/moe_dispatch.py --device cuda --tokens 16384
    ;;
  systems)
    step streamed_adam 240 python3 benchmarks/streamed_adam.py --device cuda
    step checkpoint_write 200 python3 benchmarks/checkpoint_write.py --dir /tmp/k3rl_ckpt --repeat 2 --thread-count 4
    step plan_calibration 150 python3 benchmarks/plan_calibration.py --device cuda --json "$out/plan_calibration.json"
    ;;
esac
