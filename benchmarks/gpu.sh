#!/usr/bin/env bash
# The prepared run for a machine with one NVIDIA GPU (H100 or H200, B200 later; python3 3.12
# with jax 0.11.2 and the CUDA 13 plugin, no network), in under 10 minutes, every result
# under $OUT as it goes (a step that runs out of time keeps what the others wrote):
#   1. tests     the kernel suites compiled on the GPU against the float64 oracle,
#   2. model     measured beside modelled: the programs of the deviceless table's modelled
#                shapes (benchmarks/modelled_gpu.json, `python -m gmm_jax.tools.aot`) timed on
#                this GPU next to their kernels' modelled time (`gmm_jax.tools.aot_measure`),
#   3. bench     gmm vs jax.lax.ragged_dot vs tokamax vs a dense bf16 matmul of the same
#                FLOPs, in TFLOP/s, on the Mixtral-like, DeepSeek-like and decode shapes with
#                balanced and skewed routing, forward and forward+backward,
#   4. autotune  the autotuner on the two training shapes, writing $OUT/autotune.json,
#   5. moe       the fused MoE layer's training step against the unfused block and the
#                copy-free floor (bf16).
# The GPU is read from jax's device (`gmm_jax.tools.deviceless.local_target`): its target
# chooses the modelled rows, and gmm its tile rows and peak figures by its device kind.
#
#   bash benchmarks/gpu.sh                  on the GPU machine (results under $OUT)
#   bash benchmarks/gpu.sh --wheels         here: fetch benchmarks/device_wheels.txt into .whl
#   bash benchmarks/gpu.sh --dry-run [--target h100|h200|b200] [--quick]
#                                           here, without the GPU: every step on the GPU
#                                           machine's stack (.ci/device_env.sh: jax 0.11.2 +
#                                           CUDA 13 plugin), deviceless; exit 1 when a step
#                                           would fail there for a reason other than the GPU
#                                           (--quick: one shape per step, CI's ~3 minutes)
#
# The dry run: the tests are collected (the imports, the selection), the model's, the
# benchmark's, the autotuner's and the MoE layer's programs are compiled for one chip of the
# target without the hardware (`--deviceless`: nothing is timed), and tokamax is imported
# and run from the wheels of .whl (fetched first when missing). A step fails when it exits
# non-zero or prints a failure ("failed:", a traceback).
#
# .whl holds the wheels the GPU machine lacks (benchmarks/device_wheels.txt: tokamax and
# its needs); without it the tokamax column stays empty. gmm_jax goes on PYTHONPATH from
# this tree (pallas/ copied in as gmm_jax/pallas, as the wheel installs it).
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=device
TARGET=""
QUICK=0
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) MODE=dry-run ;;
    --wheels) MODE=wheels ;;
    --quick) QUICK=1 ;;
    --target) TARGET=${2:?--target needs a value}; shift ;;
    *) echo "usage: bash benchmarks/gpu.sh [--dry-run [--target T] [--quick] | --wheels]" >&2
       exit 2 ;;
  esac
  shift
done

fetch_wheels() {
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl \
    -r benchmarks/device_wheels.txt
}
if [ "$MODE" = wheels ]; then
  fetch_wheels && ls .whl && exit 0
  exit 1
fi

OUT="${OUT:-/tmp/gmm_gpu_out}"
mkdir -p "$OUT"
if [ "$MODE" = dry-run ]; then
  PY="${PYTHON:-$(bash .ci/device_env.sh)/bin/python}" || exit 1
  TARGET=${TARGET:-h100}
  export JAX_PLATFORMS=cpu  # the CUDA plugin compiles without touching a GPU
  [ -d .whl ] || fetch_wheels || { echo "fetching the wheels failed" >&2; exit 1; }
else
  PY="${PYTHON:-python3}"
fi
SITE="$(mktemp -d)"
cp -r gmm_jax "$SITE/gmm_jax" && cp -r pallas "$SITE/gmm_jax/pallas"
if [ -d .whl ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$SITE" .whl/*.whl > "$OUT/wheels.txt" 2>&1
fi
export PYTHONPATH="$SITE" PYTHONUNBUFFERED=1
export GMM_JAX_AUTOTUNE_CACHE="$OUT/autotune.json"
export XLA_PYTHON_CLIENT_PREALLOCATE=false  # several test processes share the GPU
if [ -z "$TARGET" ]; then
  TARGET=$("$PY" -c "from gmm_jax.tools.deviceless import local_target; print(local_target())")
fi
start=$(date +%s)
{
  date -u
  echo "mode $MODE, target $TARGET"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1
  "$PY" -c "import jax; print('jax', jax.__version__, jax.devices())"
  "$PY" -c "import tokamax; print('tokamax', getattr(tokamax, '__version__', '?'))"
} > "$OUT/env.txt" 2>&1

FAILED=0
step() {  # step NAME SECONDS COMMAND...: output in $OUT/NAME.txt, time in $OUT/env.txt
  local name=$1 limit=$2 t0 status
  shift 2
  t0=$(date +%s)
  timeout "$limit" "$@" > "$OUT/$name.txt" 2>&1
  status=$?
  echo "$name: exit $status after $(( $(date +%s) - t0 )) s (limit $limit s)" >> "$OUT/env.txt"
  if [ "$status" != 0 ] || grep -q -E "failed:|^Traceback" "$OUT/$name.txt"; then
    FAILED=1
    echo "$name: FAILED (exit $status; $OUT/$name.txt)" >> "$OUT/env.txt"
  fi
}
TESTS=(tests/test_pallas_triton.py tests/test_pallas_mosaic_gpu.py tests/test_quant_kernels.py)
if [ "$MODE" = dry-run ]; then
  # The device's commands with --deviceless; --quick: one shape per step (the same code).
  BENCH_SHAPES=(); TUNE_SHAPES=(mixtral deepseek); MOE_SHAPE=()
  if [ "$QUICK" = 1 ]; then
    BENCH_SHAPES=(--shapes decode); TUNE_SHAPES=(deepseek)
    MOE_SHAPE=(--tokens 512 --embed 256 --mlp 512 --experts 8)
  fi
  # Limits for compiling on a 2-core machine (the device runs the same programs faster).
  step tests 300 "$PY" -m pytest -q --collect-only -p no:cacheprovider -o addopts="" \
    "${TESTS[@]}" -k "Compiled or compiled"
  step model 1200 "$PY" -m gmm_jax.tools.aot_measure --rows benchmarks/modelled_gpu.json \
    --target "$TARGET" --deviceless
  step bench 1800 "$PY" -m gmm_jax.tools.bench --platform gpu --repeats 1 \
    "${BENCH_SHAPES[@]}" --deviceless "$TARGET"
  step autotune 1200 "$PY" -m gmm_jax.tools.bench --platform gpu --autotune \
    --shapes "${TUNE_SHAPES[@]}" --modes fwd --repeats 1 --deviceless "$TARGET"
  step moe 1200 "$PY" -m gmm_jax.tools.bench_moe --dtypes bfloat16 --blocks fused unfused \
    copy_free_floor --repeats 0 "${MOE_SHAPE[@]}" --deviceless "$TARGET"
  step tokamax 120 "$PY" -c "
import jax, jax.numpy as jnp, tokamax
out = tokamax.ragged_dot(jnp.ones((8, 16)), jnp.ones((2, 16, 4)), jnp.array([3, 5]),
                         implementation='xla')
assert float(out.sum()) == 8 * 16 * 4, out
print('tokamax', getattr(tokamax, '__version__', '?'), 'imports and runs from .whl')"
else
  # 1. The suites with the compiled kernels (Triton, Mosaic GPU, quantized).
  step tests 160 "$PY" -m pytest -q -x -p no:cacheprovider -o addopts="-ra" -n 8 \
    "${TESTS[@]}" -k "Compiled or compiled"
  # 2 (second: it checks the model every GPU row of BENCHMARKS.md rests on).
  step model 150 "$PY" -m gmm_jax.tools.aot_measure --rows benchmarks/modelled_gpu.json \
    --target "$TARGET" --repeats 10
  # 3. The benchmark (every row also checked against jax.lax.ragged_dot).
  step bench 160 "$PY" -m gmm_jax.tools.bench --platform gpu --repeats 20
  # 4. The autotuner (forward gmms of the two training shapes).
  step autotune 60 "$PY" -m gmm_jax.tools.bench --platform gpu --autotune \
    --shapes mixtral deepseek --modes fwd --repeats 5
  # 5. The fused MoE layer (its time target: fused <= 0.9x the unfused block).
  step moe 50 "$PY" -m gmm_jax.tools.bench_moe --dtypes bfloat16 --blocks fused unfused \
    copy_free_floor --repeats 5
fi
echo "total $(( $(date +%s) - start )) s" >> "$OUT/env.txt"
cat "$OUT/env.txt"
if [ "$MODE" = dry-run ]; then
  exit "$FAILED"
fi
