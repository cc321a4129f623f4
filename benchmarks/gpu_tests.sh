#!/usr/bin/env bash
# Every `-m gpu` test in one go, from a clean checkout, on the device machine (one H100 or H200).
# Usage, from the repository root with the fla wheels in .whl/ (README, Tests):
#   bash benchmarks/gpu_tests.sh OUTDIR [WORKERS]
# Installs the carried wheels when fla does not import, starts from an empty Triton cache (what a
# fresh machine pays: each kernel compiles once; fla autotunes nothing, since k3core points it at
# the configs shipped in k3core/ops/kda/fla_configs), runs `pytest -m gpu` over every test file that
# holds a gpu mark, WORKERS processes at a time (pytest-xdist: Triton compiles on one core per
# process), and writes OUTDIR/gpu_tests.log, OUTDIR/gpu_tests.xml and OUTDIR/gpu_tests.md.
set -u -o pipefail
out=${1:?usage: bash benchmarks/gpu_tests.sh OUTDIR [WORKERS]}
workers=${2:-8}
mkdir -p "$out"
source benchmarks/device_env.sh
TRITON_CACHE_DIR=$(mktemp -d /tmp/k3rl_triton.XXXXXX)
export TRITON_CACHE_DIR
unset TRITON_CACHE_AUTOTUNING FLA_CACHE_MODE FLA_CONFIG_DIR
# WORKERS processes on 16 cores: torch's CPU references (the exact CPU forwards of the decode-mode
# tests) would each start one thread per core; in a 12-worker run at that default those tests took
# 150-228 s each
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mapfile -t found < <(grep -rlE --include='test_*.py' 'mark\.gpu' tests | sort)
# The longest files first: xdist hands tests out in the order given, and in the H200 runs the tiny
# loop (283 s), the CPU-vs-GPU stage comparisons, the fp32 decode-mode tests (150-228 s) and CUDA IPC
# (143 s) came last in sorted order and were still running, or not yet started, at the budget.
slow=(tests/tasks/test_device_gpu.py tests/k3core/rollout/test_cuda_graph_decode.py tests/k3core/test_transfer_gpu.py
      tests/k3core/rollout/test_engine_batching.py tests/k3core/ops/test_kda.py tests/k3core/model/test_packed_gpu.py
      tests/k3core/model/test_model_gpu.py)
files=()
for f in "${slow[@]}"; do [[ " ${found[*]} " == *" $f "* ]] && files+=("$f"); done
for f in "${found[@]}"; do [[ " ${slow[*]} " == *" $f "* ]] || files+=("$f"); done
start=$(date +%s)
{
  echo "# bash benchmarks/gpu_tests.sh $out $workers   ($(date -u +%FT%TZ), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import importlib.metadata as m, torch, triton; print("python3", __import__("sys").version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla-core", m.version("fla-core"))'
  python3 -c 'from k3core.ops.kda._fla import gpu_arch, shipped_config_dir; print("arch", gpu_arch(), "fla configs", shipped_config_dir())'
  echo "files: ${files[*]}"
} 2>&1 | tee "$out/gpu_tests.log"
# -v: xdist names each test as it finishes; SIGINT at the budget still writes the failures so far
timeout -s INT -k 30 "${GPU_TESTS_BUDGET_S:-540}" \
python3 -m pytest -m gpu -p no:cacheprovider -p no:benchmark -v -n "$workers" --timeout 300 -rfE --durations=25 \
  --junitxml="$out/gpu_tests.xml" "${files[@]}" 2>&1 | tee -a "$out/gpu_tests.log"
rc=$?
python3 benchmarks/gpu_tests_summary.py "$out/gpu_tests.xml" --wall $(( $(date +%s) - start )) \
  --command "bash benchmarks/gpu_tests.sh OUTDIR $workers" --log "$out/gpu_tests.log" > "$out/gpu_tests.md"
cat "$out/gpu_tests.md"
exit $rc
