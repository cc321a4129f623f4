#!/usr/bin/env bash
# One device call that makes the shipped fla configs: tune the presets' KDA calls, then the calls
# the GPU tests make (running those tests as it goes), each kernel limited to a few candidates
# (`fla_tune --max-configs`), and copy the result out. Usage, from the repository root with the fla
# wheels in .whl/:
#   bash benchmarks/fla_tune_session.sh OUTDIR [GROUPS_DEADLINE_S] [PYTEST_DEADLINE_S] [MAX_CONFIGS]
# Resumable: entries already shipped are read in strict mode and only missing keys are tuned.
# Then unpack OUTDIR/fla_configs.tgz over k3core/ops/kda/ and commit.
set -u -o pipefail
out=${1:?usage: bash benchmarks/fla_tune_session.sh OUTDIR [GROUPS_DEADLINE_S] [PYTEST_DEADLINE_S] [MAX_CONFIGS]}
groups_deadline=${2:-300}
pytest_deadline=${3:-240}
max_configs=${4:-4}
mkdir -p "$out"
# the calls of a bf16 run (--dtype auto on CUDA), what a training step needs first; the GPU tests'
# fp32 calls are tuned by the pytest pass below. FLA_TUNE_GROUPS overrides (fla_tune --list).
default_groups="medium-bf16-packed tiny-bf16 tiny-bf16-packed small-bf16 small-bf16-packed full-bf16-packed medium-bf16 full-bf16"
source benchmarks/device_env.sh
unset FLA_CACHE_MODE FLA_CONFIG_DIR
{
  echo "# bash benchmarks/fla_tune_session.sh $out $groups_deadline $pytest_deadline $max_configs   (commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import importlib.metadata as m, torch, triton; print("python3", __import__("sys").version.split()[0], "torch", torch.__version__, "triton", triton.__version__, "fla-core", m.version("fla-core"))'
} 2>&1 | tee "$out/fla_tune_session.log"
t0=$(date +%s)
python3 -m k3core.ops.kda.fla_tune --max-configs "$max_configs" --deadline "$groups_deadline" --logs "$out/logs" \
  --only ${FLA_TUNE_GROUPS:-$default_groups} 2>&1 | tee -a "$out/fla_tune_session.log"
echo "groups: $(( $(date +%s) - t0 )) s" | tee -a "$out/fla_tune_session.log"
t1=$(date +%s)
mapfile -t files < <(grep -rlE --include='test_*.py' 'mark\.gpu' tests | sort)
python3 -m k3core.ops.kda.fla_tune --max-configs "$max_configs" --deadline "$pytest_deadline" --logs "$out/logs" \
  --pytest -m gpu -p no:cacheprovider -q -rfE --durations=10 "${files[@]}" 2>&1 | tee -a "$out/fla_tune_session.log"
echo "pytest: $(( $(date +%s) - t1 )) s" | tee -a "$out/fla_tune_session.log"
# one archive: the device tool returns no folder named like a version (0.6.0) nor names with commas
tar czf "$out/fla_configs.tgz" -C k3core/ops/kda fla_configs
