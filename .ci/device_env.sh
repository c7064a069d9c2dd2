#!/usr/bin/env bash
# The GPU machine's software stack (jax 0.11.2 + the CUDA 13 plugin and that machine's image
# packages), for `bash benchmarks/gpu.sh --dry-run`: `.ci/jax_env.sh device`, which says what
# it holds and where it is cached.
#
#   bash .ci/device_env.sh [--deps-only]
exec bash "$(dirname "$0")/jax_env.sh" device "$@"
