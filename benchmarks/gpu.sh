#!/usr/bin/env bash
# One GPU session (the device tool gives ~15 minutes): compiled kernel tests, then the GPU
# benchmark table, each written under $OUT as it goes so a timeout keeps what finished.
#
#   run(command="bash benchmarks/gpu.sh", timeout_s=540)
#
# The device has jax + CUDA but no network: gmm_jax is put on PYTHONPATH from this tree
# (pallas/ copied in as gmm_jax/pallas, as the wheel installs it) instead of pip installing.
set -uo pipefail
OUT="${OUT:-/tmp/gmm_gpu_out}"
mkdir -p "$OUT"
SITE="$(mktemp -d)"
cp -r gmm_jax "$SITE/gmm_jax" && cp -r pallas "$SITE/gmm_jax/pallas"
export PYTHONPATH="$SITE"
PY="${PYTHON:-python3}"
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv 2>&1
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
} > "$OUT/env.txt" 2>&1

# 1. The shared suite with the compiled Triton kernels (and the benchmark-script check).
if "$PY" -c "import pytest, hypothesis" 2>/dev/null; then
  # One process (the addopts' xdist workers would share the GPU, and xdist may be absent).
  timeout 240 "$PY" -m pytest -q -x -p no:cacheprovider -o addopts="-ra" \
    tests/test_pallas_triton.py -k "Compiled" > "$OUT/tests.txt" 2>&1
  echo "pytest exit $?" >> "$OUT/tests.txt"
else
  echo "pytest/hypothesis not installed: compiled suite skipped" > "$OUT/tests.txt"
fi

# 2. The benchmark (every row is also checked against jax.lax.ragged_dot), small shapes
#    first so that a timeout still leaves a table.
timeout 120 "$PY" -m gmm_jax.bench --platform gpu --m 8192 --kn 2048 4096 --groups 8 32 128 \
  > "$OUT/bench_small.md" 2>&1
timeout 150 "$PY" -m gmm_jax.bench --platform gpu --m 32768 65536 --kn 7168 --groups 8 128 \
  --repeats 5 > "$OUT/bench_large.md" 2>&1
echo done > "$OUT/finished.txt"
