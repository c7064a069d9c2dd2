#!/usr/bin/env bash
# Prints the path of a Python 3.12 virtual environment with jax 0.12 + the CUDA plugin
# (without cuDNN/cuBLAS/NCCL: only the compiler side is used) + libtpu, for the deviceless
# compile of the kernels (`python -m gmm_jax.tools.aot`). The environment is cached under
# ${GMM_JAX_AOT_VENV:-~/.cache/gmm_jax/venv-aot-<versions>} and reused while it imports;
# gmm_jax itself is (re)installed into it from this checkout, editable, without deps.
# flax is for `python -m gmm_jax.tools.aot_pod` (whole nn.MoE training steps on multi-chip
# topologies); an environment cached before it was added gets it installed in place.
# `--deps-only` builds (or checks) the environment without installing gmm_jax into it and
# prints nothing: .ci/run starts it in the background while the test suite runs.
set -euo pipefail
DEPS_ONLY=0
[ "${1:-}" = "--deps-only" ] && DEPS_ONLY=1
cd "$(dirname "$0")/.."
JAX=0.12.0.1
PACKAGES=(jax==$JAX jaxlib==$JAX libtpu==0.0.50.1 pytest hypothesis absl-py)
FLAX=("flax>=0.12.3")  # with jax and jaxlib pinned, so that pip keeps jax at $JAX
NO_DEPS=(jax-cuda12-plugin==$JAX jax-cuda12-pjrt==$JAX nvidia-nvjitlink-cu12==12.9.86)
VENV=${GMM_JAX_AOT_VENV:-$HOME/.cache/gmm_jax/venv-aot-jax$JAX}
check() {
  JAX_PLATFORMS=cpu "$VENV/bin/python" -c "import jax, jax_plugins.xla_cuda12, libtpu, pytest, absl" \
    > /dev/null 2>&1
}
if ! check; then
  PY=""
  for candidate in "$HOME"/.pyenv/versions/3.12*/bin/python3.12 python3.12; do
    if "$candidate" -c "import venv" > /dev/null 2>&1; then PY=$candidate; break; fi
  done
  [ -n "$PY" ] || { echo "no python3.12 found for the deviceless-compile environment" >&2; exit 1; }
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" >&2
  "$VENV/bin/pip" install -q "${PACKAGES[@]}" "${FLAX[@]}" >&2
  "$VENV/bin/pip" install -q --no-deps "${NO_DEPS[@]}" >&2
  check || { echo "the deviceless-compile environment $VENV does not import" >&2; exit 1; }
fi
if ! JAX_PLATFORMS=cpu "$VENV/bin/python" -c "import flax.nnx" > /dev/null 2>&1; then
  "$VENV/bin/pip" install -q "${FLAX[@]}" jax==$JAX jaxlib==$JAX >&2
fi
[ "$DEPS_ONLY" = 1 ] && exit 0
"$VENV/bin/pip" install -q --no-deps -e . >&2
echo "$VENV"
