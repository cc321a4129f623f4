#!/usr/bin/env bash
# The O_DIRECT writer against stock and dd on one disk, over the knobs that set how much I/O is in
# flight: serialising threads (files written at once), I/O threads (pwrites in flight), buffer size.
# Each row is one run of benchmarks/checkpoint_write.py (its own stock and dd rows measured beside
# it). Usage, from the repository root:
#   bash benchmarks/checkpoint_writer_sweep.sh DIR [SIZE_GIB]
set -u -o pipefail
dir=${1:?usage: bash benchmarks/checkpoint_writer_sweep.sh DIR [SIZE_GIB]}
size=${2:-4}
PY=${PYTHON:-python3}
df -h "$(dirname "$dir")" 2>/dev/null | tail -1
# thread_count io_threads buffer_mib (buffers: one being filled per thread, one in each I/O thread, two more)
for cfg in "1 1 16" "4 1 16" "4 4 16" "4 8 16" "8 8 16" "4 4 64"; do
  set -- $cfg
  echo "## thread_count=$1 io_threads=$2 buffer_mib=$3"
  "$PY" benchmarks/checkpoint_write.py --dir "$dir" --size-gib "$size" --repeat 2 \
    --thread-count "$1" --io-threads "$2" --buffer-mib "$3" --num-buffers $(( $1 + $2 + 2 )) 2>&1 | grep -E "^\| |odirect /|growth =|^# state"
done
rm -rf "$dir"
