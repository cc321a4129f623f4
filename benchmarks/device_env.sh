# Sourced by the device-machine scripts (gpu_tests.sh, fla_tune_session.sh, gpu_loop runs) from the
# repository root: installs the carried wheels (.whl/, made by benchmarks/device_wheels.sh: fla, and
# Prefect with what the image lacks) where fla or Prefect does not import, and puts the checkout first
# on PYTHONPATH. python3 -m pip: a bare pip on the device machine belongs to another interpreter.
export PYTHONUNBUFFERED=1
if ! python3 -c "import fla, prefect" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/k3rl_site .whl/*.whl || exit 1
  export PYTHONPATH="/tmp/k3rl_site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$(pwd)${PYTHONPATH:+:$PYTHONPATH}"
