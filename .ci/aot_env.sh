#!/usr/bin/env bash
# The deviceless-compile environment (jax 0.12.0.1 + the CUDA 12 plugin + libtpu + flax):
# `.ci/jax_env.sh aot`, which says what it holds and where it is cached.
#
#   bash .ci/aot_env.sh [--deps-only]
exec bash "$(dirname "$0")/jax_env.sh" aot "$@"
