#!/usr/bin/env bash
# Fill .whl/ (git-ignored) with what the device machine's image lacks for k3rl: fla 0.6.0, and Prefect
# (embedded mode: the same `k3rl run` there) with every dependency the image does not already hold
# (benchmarks/device_image_packages.txt, from the device tool's package list). About 36 MiB: the
# device tool carries at most 64 MiB of tree plus carried files per call. Run here, on a machine with
# a package index; then name `.whl` in the device call's `carry`; benchmarks/device_env.sh installs it.
#   bash benchmarks/device_wheels.sh
set -eu -o pipefail
PY=${PYTHON:-.venv/bin/python}  # the project environment: its Prefect version is the one carried
cd "$(dirname "$0")/.."
mkdir -p .whl
tmp=$(mktemp -d)
"$PY" -m pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform any \
  -d "$tmp" "prefect==$("$PY" -c 'import importlib.metadata as m; print(m.version("prefect"))')" fastapi uvicorn
"$PY" -m pip download -q --no-deps --only-binary=:all: -d "$tmp" fla-core==0.6.0 flash-linear-attention==0.6.0
"$PY" - "$tmp" <<'PY'
import pathlib, re, shutil, sys
have = {re.sub(r"[-_.]+", "-", l.strip().lower()) for l in open("benchmarks/device_image_packages.txt") if l.strip()}
for w in sorted(pathlib.Path(sys.argv[1]).glob("*.whl")):
    if re.sub(r"[-_.]+", "-", w.name.split("-")[0].lower()) not in have:
        shutil.copy(w, ".whl/")
PY
rm -rf "$tmp"
du -sh .whl
