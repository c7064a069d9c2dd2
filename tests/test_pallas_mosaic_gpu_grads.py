"""The Mosaic GPU kernel's share of a gmm's gradients, in jax's Mosaic GPU simulator on CPU.

The backward gmms are recorded from the op (their exact configs: dlhs is an m-grouped gmm
with the rhs transposed, drhs a k-grouped one) and the m-grouped ones are run on the Mosaic
GPU kernel directly, under the simulator with its race detector, against the numpy float64
oracle (tests/test_simulators.py runs the op's own gradients there). check_grads is not
used: the kernel takes only 16-bit operands, whose finite differences say nothing.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import simulators
from gmm_test_base import make_operands
from oracle import f64, gmm_oracle, tolerances

import gmm_jax
from gmm_jax._src.backends import registry

mosaic = pytest.importorskip("gmm_jax.pallas.gpu.mosaic_gpu",
                             reason="this jax's Pallas Mosaic GPU lacks the kernel's API")
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
needs_interpreter = pytest.mark.skipif(
    not hasattr(mosaic.plgpu, "InterpretGPUParams"),
    reason=f"jax {jax.__version__} has no Mosaic GPU interpreter that runs this kernel "
           "(jax 0.10.2's lacks a memory space for Ref operands; jax 0.12 runs it)")
CHAIN = ("pallas_mosaic_gpu", "pallas_triton")


def _recorded_configs(lhs, rhs, sizes, bias, **options):
  """{(group_type, transpose_rhs): cfg} of the forward gmm and both backward gmms."""
  def loss(lhs, rhs, bias):
    out = gmm_jax.gmm(lhs, rhs, sizes, bias=bias, implementation=CHAIN, interpret=True,
                      **options)
    return jnp.sum(out.astype(jnp.float32))

  with registry.record() as decisions:  # the backward gmms (grad records only those)
    jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(lhs, rhs, bias)
  with registry.record() as forward:
    jax.jit(loss).lower(lhs, rhs, bias)
  configs = {(d.cfg.group_type, d.cfg.transpose_rhs): d.cfg for d in decisions}
  assert len(configs) == 2 and len(forward) == 1, (decisions, forward)
  return configs, forward[0].cfg


def _mosaic(lhs, rhs, sizes, bias, cfg):
  cfg = cfg.replace(interpret=simulators.gpu())

  def kernel(lhs, rhs, counts, bias):
    return mosaic.gmm_mosaic_gpu(lhs, rhs, counts, jnp.int32(0), bias, cfg)

  with simulators.no_race("gpu"):
    return jax.jit(kernel)(lhs, rhs, jnp.asarray(sizes, jnp.int32), bias)


@needs_interpreter
@pytest.mark.parametrize("dtype, transpose_rhs, sizes", [
    pytest.param(jnp.bfloat16, False, [20, 0, 25, 3], id="bf16-empty-group"),
    pytest.param(jnp.float16, True, [0, 64, 9, 1], id="f16-transpose-rhs-first-empty"),
    # Decode-size groups off 8-row boundaries, [55, 67) across the 64-row tile boundary:
    # the kernel's 8-row windows (`mosaic.window_granule`) in the forward and in dlhs.
    pytest.param(jnp.bfloat16, False, [3, 13, 0, 20, 19, 12, 8], id="bf16-decode-size-groups"),
])
def test_backward_gmms_on_the_mosaic_kernel(dtype, transpose_rhs, sizes):
  m, k, n, groups = 80, 64, 72, len(sizes)
  lhs, rhs, bias = make_operands("m", m=m, k=k, n=n, num_local=groups, lhs_dtype=dtype,
                                 transpose_rhs=transpose_rhs, with_bias=True, seed=31)
  counts = np.asarray(sizes, np.int32)
  configs, forward_cfg = _recorded_configs(lhs, rhs, counts, bias, transpose_rhs=transpose_rhs)
  dlhs_cfg = configs[("m", not transpose_rhs)]
  (drhs_cfg,) = [cfg for (group_type, _), cfg in configs.items() if group_type == "k"]
  # What the op asks of each gmm; the kernel serves both m-grouped ones, not the k-grouped.
  mosaic.check_operands(lhs, rhs, forward_cfg)
  tile_m = mosaic.default_tiling(m, k, n, forward_cfg).tile_m
  assert mosaic.window_granule(m, groups, tile_m) == 8  # windows at 8-row boundaries
  cotangent = jnp.asarray(np.random.default_rng(32).standard_normal((m, n)), dtype)
  mosaic.check_operands(cotangent, rhs, dlhs_cfg)
  with pytest.raises(NotImplementedError, match="group_type='k'"):
    mosaic.check_operands(lhs, cotangent, drhs_cfg)

  out = _mosaic(lhs, rhs, sizes, bias, forward_cfg)
  want = gmm_oracle(lhs, rhs, sizes, "m", bias=bias, transpose_rhs=transpose_rhs)
  np.testing.assert_allclose(f64(out), want, **tolerances(dtype, k=k))

  # dlhs = ct @ rhs[g]^T on each group's rows, exactly 0 on rows past the total.
  dlhs = _mosaic(cotangent, rhs, sizes, None, dlhs_cfg)
  assert dlhs.dtype == lhs.dtype and dlhs.shape == lhs.shape
  want_dlhs = gmm_oracle(cotangent, rhs, sizes, "m", transpose_rhs=not transpose_rhs)
  np.testing.assert_allclose(f64(dlhs), want_dlhs, **tolerances(dtype, k=n))
  assert not np.any(f64(dlhs)[sum(sizes):])


def test_grad_through_the_op_against_the_oracle():
  # The op's own gradients with Mosaic GPU first in the chain (Triton's interpreter serves
  # them on CPU): d(sum(out * ct)) against the oracle; an empty group's weight and bias
  # gradients are exactly 0.
  sizes, m, k, n = [20, 0, 25, 3], 64, 64, 64
  lhs, rhs, bias = make_operands("m", m=m, k=k, n=n, num_local=len(sizes),
                                 lhs_dtype=jnp.bfloat16, with_bias=True, seed=33)
  cotangent = jnp.asarray(np.random.default_rng(34).standard_normal((m, n)), jnp.float32)

  def loss(lhs, rhs, bias):
    out = gmm_jax.gmm(lhs, rhs, np.asarray(sizes, np.int32), bias=bias, implementation=CHAIN,
                      interpret=True, preferred_element_type=jnp.float32)
    return jnp.sum(out * cotangent)

  dlhs, drhs, dbias = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(lhs, rhs, bias)
  ct = f64(cotangent)
  # The cotangent reaches the backward gmms in the operands' dtype (bf16).
  ct16 = f64(jnp.asarray(cotangent, jnp.bfloat16))
  want_dlhs = gmm_oracle(ct16, np.swapaxes(f64(rhs), 1, 2), sizes, "m")
  want_drhs = gmm_oracle(f64(lhs).T, ct16, sizes, "k")  # [G, K, N]
  np.testing.assert_allclose(f64(dlhs), want_dlhs, **tolerances(jnp.bfloat16, k=n))
  np.testing.assert_allclose(f64(drhs), want_drhs, **tolerances(jnp.bfloat16, k=m))
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  want_dbias = np.stack([ct[bounds[g]:bounds[g + 1]].sum(0) for g in range(len(sizes))])
  np.testing.assert_allclose(f64(dbias), want_dbias, **tolerances(jnp.bfloat16, k=m))
  assert np.all(f64(drhs)[1] == 0) and np.all(f64(dbias)[1] == 0)
  assert not np.any(f64(dlhs)[sum(sizes):])
