#!/usr/bin/env bash
# Prints the path of a cached Python 3.12 virtual environment with one of the jax stacks CI
# checks beside the default run's (Python 3.11's jax 0.10.2), with gmm_jax installed from
# this checkout (editable, without deps):
#
#   aot     jax 0.12.0.1 + its CUDA 12 plugin (the compiler side only: no cuDNN, cuBLAS or
#           NCCL) + libtpu 0.0.50.1 + flax: the deviceless compiles of the kernels
#           (`python -m gmm_jax.tools.aot`) and of whole training steps (`aot_pod`).
#   device  the GPU machine's stack (`benchmarks/gpu.sh`): jax 0.11.2 with the CUDA 13 plugin,
#           flax, optax, chex, pytest, pytest-xdist, hypothesis, numpy 2.5.2 and the packages
#           of that machine's image that tokamax needs; nothing outside that image's package
#           list, so that a package the machine lacks (a wheel to carry:
#           benchmarks/device_wheels.txt) is missing here too. `gpu.sh --dry-run` runs in it.
#   newest  the newest jax (0.12.1) with its CUDA 13 plugin, libtpu 0.0.52 and flax
#           (jax[tpu]==0.12.1 asks for libtpu 0.0.53, which the package index does not hold;
#           0.0.52 compiles for TPUs deviceless with it).
#
# nvJitLink turns PTX into cubin, so GPU programs compile without the hardware. An
# environment is cached under ~/.cache/gmm_jax/venv-<stack>-jax<version> (GMM_JAX_<STACK>_VENV
# picks another path) and reused while it imports. `--deps-only` builds (or checks) it
# without installing gmm_jax and prints nothing: .ci/run builds them in the background.
#
#   bash .ci/jax_env.sh aot|device|newest [--deps-only]
set -euo pipefail
STACK=${1:?usage: bash .ci/jax_env.sh aot|device|newest [--deps-only]}
DEPS_ONLY=0
[ "${2:-}" = "--deps-only" ] && DEPS_ONLY=1
cd "$(dirname "$0")/.."
NO_DEPS=()
case "$STACK" in
  aot)
    JAX=0.12.0.1
    PACKAGES=(jax==$JAX jaxlib==$JAX libtpu==0.0.50.1 pytest hypothesis absl-py "flax>=0.12.3")
    NO_DEPS=(jax-cuda12-plugin==$JAX jax-cuda12-pjrt==$JAX nvidia-nvjitlink-cu12==12.9.86)
    IMPORTS="jax_plugins.xla_cuda12, libtpu, flax.nnx, pytest, absl" ;;
  device)
    JAX=0.11.2
    PACKAGES=(
      jax==$JAX jaxlib==$JAX jax-cuda13-plugin==$JAX jax-cuda13-pjrt==$JAX nvidia-nvjitlink
      numpy==2.5.2 flax optax chex absl-py pytest pytest-xdist hypothesis
      # on the image, and imported by tokamax or the packages its wheels bring
      jaxtyping tqdm six wadler-lindig requests urllib3 certifi idna charset-normalizer
      werkzeug markupsafe protobuf grpcio attrs aiohttp aiosignal aiohappyeyeballs frozenlist
      multidict propcache yarl)
    IMPORTS="jax_plugins.xla_cuda13, flax.nnx, pytest, xdist, hypothesis, absl" ;;
  newest)
    JAX=0.12.1
    PACKAGES=(jax==$JAX jaxlib==$JAX jax-cuda13-plugin==$JAX jax-cuda13-pjrt==$JAX
              nvidia-nvjitlink libtpu==0.0.52 pytest hypothesis absl-py "flax>=0.12.3")
    IMPORTS="jax_plugins.xla_cuda13, libtpu, flax.nnx, pytest, hypothesis, absl" ;;
  *) echo "unknown stack $STACK: aot, device or newest" >&2; exit 2 ;;
esac
OVERRIDE="GMM_JAX_$(echo "$STACK" | tr '[:lower:]' '[:upper:]')_VENV"
VENV=${!OVERRIDE:-$HOME/.cache/gmm_jax/venv-$STACK-jax$JAX}
check() {
  JAX_PLATFORMS=cpu "$VENV/bin/python" -c "
import jax, $IMPORTS
assert jax.__version__ == '$JAX', jax.__version__" > /dev/null 2>&1
}
if ! check; then
  PY=""
  for candidate in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.12; do
    if "$candidate" -c "import venv" > /dev/null 2>&1; then PY=$candidate; break; fi
  done
  [ -n "$PY" ] || { echo "no python3.12 found for the $STACK environment" >&2; exit 1; }
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" >&2
  # jax pinned beside flax, so that pip keeps it at $JAX; no byte-compiling at install (it
  # would take the CPU from the test suite this runs beside in CI).
  "$VENV/bin/pip" install -q --no-compile "${PACKAGES[@]}" >&2
  if [ ${#NO_DEPS[@]} -gt 0 ]; then
    "$VENV/bin/pip" install -q --no-compile --no-deps "${NO_DEPS[@]}" >&2
  fi
  check || { echo "the $STACK environment $VENV does not import" >&2; exit 1; }
fi
[ "$DEPS_ONLY" = 1 ] && exit 0
"$VENV/bin/pip" install -q --no-deps -e . >&2
echo "$VENV"
