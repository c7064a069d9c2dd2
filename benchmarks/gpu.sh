#!/usr/bin/env bash
# The prepared run for a machine with one GPU (an H200, python3 3.12 + jax 0.11.2 + CUDA 13, no
# network), in under 10 minutes, every result under $OUT as it goes (a step that runs out of
# time keeps what the others wrote):
#   1. the kernel suites compiled on the GPU against the float64 oracle,
#   2. the GPU benchmark: gmm vs jax.lax.ragged_dot vs tokamax vs a dense bf16 matmul of the
#      same FLOPs, in TFLOP/s, on the Mixtral-like, DeepSeek-like and decode shapes with
#      balanced and skewed routing, forward and forward+backward,
#   3. the autotuner on the two training shapes, writing $OUT/autotune.json,
#   4. the fused MoE layer's training step against the unfused block and the copy-free
#      floor (bf16; on a GPU the row copies are memory-bound passes next to the gmms),
#   5. measured beside modelled: the programs of the deviceless table's modelled shapes
#      (benchmarks/modelled_gpu.json, `python -m gmm_jax.tools.aot`) timed on this GPU
#      next to their kernels' modelled time (`gmm_jax.tools.aot_measure`).
#
#   bash benchmarks/gpu.sh        (from the repository root; results under $OUT)
#
# .whl holds the wheels such a machine lacks (tokamax and its needs, fetched with `pip
# download`; benchmarks/log.md, "GPU", lists them); without it the tokamax column stays
# empty. gmm_jax goes on PYTHONPATH from this tree (pallas/ copied in as gmm_jax/pallas, as
# the wheel installs it).
set -uo pipefail
OUT="${OUT:-/tmp/gmm_gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
SITE="$(mktemp -d)"
cp -r gmm_jax "$SITE/gmm_jax" && cp -r pallas "$SITE/gmm_jax/pallas"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl > "$OUT/wheels.txt" 2>&1
fi
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
export GMM_JAX_AUTOTUNE_CACHE="$OUT/autotune.json"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test processes share the GPU
start=$(date +%s)
{
  date -u
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  "$PY" -c "import tokamax; print('tokamax', getattr(tokamax, '__version__', '?'))"
} > "$OUT/env.txt" 2>&1

step() {  # step NAME SECONDS COMMAND...: output in $OUT/NAME.txt, time in $OUT/env.txt
  local name=$1 limit=$2 t0
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  echo "$name: exit $? after $(( $(date +%s) - t0 )) s (limit $limit s)" >> "$OUT/env.txt"
}

# 1. The suites with the compiled kernels (Triton, Mosaic GPU, quantized).
step tests 160 "$PY" -m pytest -q -x -p no:cacheprovider -o addopts="-ra" -n 8 \
  tests/test_pallas_triton.py tests/test_pallas_mosaic_gpu.py tests/test_quant_kernels.py \
  -k "Compiled or compiled"
# 5 (second: it checks the model every GPU row of BENCHMARKS.md rests on). Measured
# beside modelled, per program of the modelled shapes on this GPU's target.
step model 150 "$PY" -m gmm_jax.tools.aot_measure --rows benchmarks/modelled_gpu.json \
  --target h200 --repeats 10
# 2. The benchmark (every row also checked against jax.lax.ragged_dot).
step bench 160 "$PY" -m gmm_jax.tools.bench --platform gpu --repeats 20
# 3. The autotuner (forward gmms of the two training shapes).
step autotune 60 "$PY" -m gmm_jax.tools.bench --platform gpu --autotune --shapes mixtral deepseek \
  --modes fwd --repeats 5
# 4. The fused MoE layer (its time target: fused <= 0.9x the unfused block).
step moe 50 "$PY" -m gmm_jax.tools.bench_moe --dtypes bfloat16 --blocks fused unfused \
  copy_free_floor --repeats 5
echo "total $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
