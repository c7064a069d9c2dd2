"""The fused MoE layer's bf16 training step plans at most 0.3x the temporaries of the unfused
one on one H200 (issue 27; XLA's compiled ``temp_size_in_bytes``, compiled deviceless at the
bench's shape). A regression guard for the backward's ordering (`op.transpose`'s gathered
rows formed only beside their weight gradient: 0.32x before, 0.28x with it). Needs the
deviceless-compile environment (.ci/aot_env.sh: jax >= 0.12 with the CUDA plugin)."""

from __future__ import annotations


import jax.numpy as jnp
import pytest
from lowering import has_module

from gmm_jax import bench_moe

# bench_moe's default shape: T, D, F, E, k.
SHAPE = (4096, 1024, 2048, 64, 2)
BOUND = 0.3


_has = has_module  # tests/lowering.py


@pytest.mark.slow
@pytest.mark.skipif(not _has("jax_plugins.xla_cuda12"),
                    reason="needs the deviceless-compile environment (.ci/aot_env.sh)")
def test_fused_moe_step_temporaries_on_h200():
  rows = bench_moe.compile_deviceless("h200", *SHAPE, [jnp.bfloat16],
                                      ("moe_fused", "moe_unfused"))
  temp = {r.block: r.temp_bytes for r in rows}
  assert temp["moe_fused"] <= BOUND * temp["moe_unfused"], (
      f"fused {temp['moe_fused'] / 1e6:.1f} MB vs unfused {temp['moe_unfused'] / 1e6:.1f} MB "
      f"({temp['moe_fused'] / temp['moe_unfused']:.3f}x, bound {BOUND}x)")
