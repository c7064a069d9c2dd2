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


def _temporaries(*blocks) -> dict[str, int]:
  """Each block's bf16 training step compiled for one H200: its temporaries in bytes."""
  rows = bench_moe.compile_deviceless("h200", *SHAPE, [jnp.bfloat16], blocks)
  return {r.block: r.temp_bytes for r in rows}


@pytest.mark.slow
@pytest.mark.skipif(not _has("jax_plugins.xla_cuda12"),
                    reason="needs the deviceless-compile environment (.ci/aot_env.sh)")
def test_fused_moe_step_temporaries_on_h200():
  temp = _temporaries("moe_fused", "moe_unfused")
  assert temp["moe_fused"] <= BOUND * temp["moe_unfused"], (
      f"fused {temp['moe_fused'] / 1e6:.1f} MB vs unfused {temp['moe_unfused'] / 1e6:.1f} MB "
      f"({temp['moe_fused'] / temp['moe_unfused']:.3f}x, bound {BOUND}x)")


@pytest.mark.slow
@pytest.mark.skipif(not _has("jax_plugins.xla_cuda12"),
                    reason="needs the deviceless-compile environment (.ci/aot_env.sh)")
def test_gated_prologue_step_plans_fewer_temporaries_on_h200():
  # ExpertFFN(gated_prologue=True): the down gmm's dlhs writes z's cotangent, so neither
  # the [R, F] cotangent of the activation nor its f32 copy and halves are formed (measured
  # 102 MB vs 119 MB on 2026-12-03).
  temp = _temporaries("moe_fused", "moe_prologue")
  assert temp["moe_prologue"] <= 0.9 * temp["moe_fused"], (
      f"prologue {temp['moe_prologue'] / 1e6:.1f} MB vs fused {temp['moe_fused'] / 1e6:.1f} MB")
