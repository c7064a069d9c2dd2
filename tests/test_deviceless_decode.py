"""A decode-shaped gmm is cheap to launch: compiled deviceless for a TPU v5e and an H200,
its ENTRY computation holds one kernel and a few fused ops for the group metadata
(`gmm_jax.tools.bench_decode.entry_ops`; ``python -m gmm_jax.tools.bench_decode --deviceless`` prints
the comparison with megablox, tokamax and `jax.lax.ragged_dot`).

Needs libtpu (TPU) or the CUDA plugin (GPU) in this Python; skipped where they are not
importable, as the other deviceless tests are.
"""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax.tools import bench_decode
from lowering import GPU_COMPILER, has_gpu_compiler, has_module

COMPILER_MODULE = {"v5e": "libtpu", "h200": GPU_COMPILER}
# At most this many top-level ops that do work (the kernel included) per target, with the
# pinned compilers of .ci/aot_env.sh. v5e: the kernel and six fused ops of its tile walk
# (benchmarks/log.md). H200: the kernel, the zeroed output it writes into, and four fused ops
# of metadata (the groups' bounds, items per group, each item's group, its rows).
MAX_ENTRY_OPS = {"v5e": 7, "h200": 6}


def _require_compiler(target: str) -> None:
  module = COMPILER_MODULE[target]
  if not (has_module(module) if target == "v5e" else has_gpu_compiler()):
    pytest.skip(f"{module} is not importable: this jax install has no compiler for {target}")


def _compile(target: str, fn, *args) -> str:
  topology = bench_decode._topology(target)
  mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
  placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in args]
  with jax.default_device(topology.devices[0]):
    return jax.jit(fn).lower(*specs).compile().as_text()


def _decode_args():
  m, g, k, n = bench_decode.DECODE_GMM
  return (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
          jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
          jax.ShapeDtypeStruct((g,), jnp.int32))


@pytest.mark.parametrize("target", ["v5e", "h200"])
def test_decode_gmm_is_one_kernel_and_a_few_ops(target):
  _require_compiler(target)
  text = _compile(target, lambda x, w, c: gmm_jax.gmm(x, w, c), *_decode_args())
  ops, kernels = bench_decode.entry_ops(text)
  listing = [op for op, _ in bench_decode.entry_opcodes(text)
             if op not in bench_decode.FREE_OPCODES]
  assert kernels == 1, listing
  assert ops <= MAX_ENTRY_OPS[target], listing
  # No loop, sort or scan left around the kernel: the group metadata is fused arithmetic.
  assert not {"while", "sort", "reduce-window", "scatter", "gather"} & set(listing), listing


@pytest.mark.parametrize("target", ["v5e", "h200"])
def test_decode_moe_has_one_kernel_per_gmm(target):
  _require_compiler(target)
  tokens, experts, top_k, dim, mlp = 8, 64, 8, 512, 256
  args = (jax.ShapeDtypeStruct((tokens, dim), jnp.bfloat16),
          jax.ShapeDtypeStruct((experts, dim, 2 * mlp), jnp.bfloat16),
          jax.ShapeDtypeStruct((experts, mlp, dim), jnp.bfloat16),
          jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
          jax.ShapeDtypeStruct((tokens, top_k), jnp.float32))
  for name in ("moe_masked", "moe_ragged"):
    fn = bench_decode.MOE_METHODS[name]
    text = _compile(target, lambda *a, fn=fn: fn(*a, max_rows=tokens), *args)
    assert bench_decode.entry_ops(text)[1] == 2, name  # the up and the down gmm
