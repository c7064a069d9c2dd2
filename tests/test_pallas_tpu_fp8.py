"""The Pallas TPU kernels' blocked fp8 mode (fp8 training's three gmms), interpret mode on CPU.

Each gmm multiplies 8-bit float values per contraction block of 128 with f32 accumulation,
times that block's lhs row scales and rhs column scales (`pallas/common.py`,
`QuantOperands`). Oracle: the operands dequantized in float64 from their raw QArray fields
(`oracle.dequantize`) and multiplied group by group (`oracle.gmm_oracle`): the sum of the
block products times their scales. The contraction blocks get scales of very different
magnitudes (a factor up to 100 between neighbours), so a scale applied to the wrong block,
or a k-grouped tile that straddles two blocks, is far outside the tolerance.
"""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.tiling import chips, cost_models
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax.pallas.tpu import mosaic_tpu, mosaic_tpu_plan
from oracle import dequantize, gmm_oracle, tolerances

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
BLOCK = 128


def _block_magnitudes(rng, size: int) -> np.ndarray:
  """[size] factors, one per run of 128 along the contraction: 10**u, u in [-1, 1]."""
  per_block = 10.0 ** rng.uniform(-1.0, 1.0, size=-(-size // BLOCK))
  return np.repeat(per_block, BLOCK)[:size]


def _forward_operands(rng, m, k, n, groups, lhs_type, transpose_rhs=False):
  """fwd (``transpose_rhs=False``: x [M, K] @ w[g] [K, N]) or dlhs (``True``: dy [M, N] @
  w[g].T with w [G, K, N]): lhs 1 x 128 blocks along the contraction, rhs 128 x 128."""
  contraction = n if transpose_rhs else k
  lhs = rng.standard_normal((m, contraction)) * _block_magnitudes(rng, contraction)
  rhs = rng.standard_normal((groups, k, n))
  rhs = rhs * (_block_magnitudes(rng, n) if transpose_rhs else _block_magnitudes(rng, k)[:, None])
  lhs_q = gmm_jax.quantize(lhs.astype(np.float32), lhs_type, channelwise_axes=(0,),
                           tiled_axes={1: BLOCK})
  rhs_q = gmm_jax.quantize(rhs.astype(np.float32), E4M3, channelwise_axes=(0,),
                           tiled_axes={1: BLOCK, 2: BLOCK})
  return lhs_q, rhs_q


def _drhs_operands(rng, tokens, d, f, grad_type):
  """drhs: x [T, D] and dy [T, F], both 128 x 1 blocks along the tokens (the contraction,
  grouped); the gmm is x.T @ dy per group (k-grouping, lhs transposed)."""
  magnitudes = _block_magnitudes(rng, tokens)[:, None]
  x = rng.standard_normal((tokens, d)) * magnitudes
  dy = rng.standard_normal((tokens, f)) * magnitudes[::-1]
  x_q = gmm_jax.quantize(x.astype(np.float32), E4M3, channelwise_axes=(1,),
                         tiled_axes={0: BLOCK})
  dy_q = gmm_jax.quantize(dy.astype(np.float32), grad_type, channelwise_axes=(1,),
                          tiled_axes={0: BLOCK})
  return x_q, dy_q


def _run(lhs, rhs, sizes, cfg, bias=None, group_offset=0, tiling=None):
  counts = jnp.asarray(sizes, jnp.int32)
  return np.asarray(jax.jit(lambda *a: mosaic_tpu.gmm_tpu(*a, cfg, tiling))(
      lhs, rhs, counts, jnp.int32(group_offset), bias)).astype(np.float64)


def _tolerance(out_dtype, lhs, rhs, k):
  """f32 accumulation of `k` products, each at most max|lhs| * max|rhs| (an absolute
  budget), then the output's own rounding (relative; `oracle.tolerances`)."""
  scale = np.abs(dequantize(lhs)).max() * np.abs(dequantize(rhs)).max()
  accumulation, output = tolerances(jnp.float32, k=k, scale=scale), tolerances(out_dtype)
  return dict(rtol=max(accumulation["rtol"], output["rtol"]),
              atol=accumulation["atol"] + output["atol"])


def test_check_operands_serves_blocked_fp8_for_both_group_types():
  rng = np.random.default_rng(0)
  x_q, w_q = _forward_operands(rng, 32, 256, 128, 2, E4M3)
  mosaic_tpu.check_operands(x_q, w_q, GmmConfig(group_type="m", num_local=2))
  xk_q, dyk_q = _drhs_operands(rng, 256, 128, 128, E5M2)
  mosaic_tpu.check_operands(xk_q, dyk_q, GmmConfig(group_type="k", num_local=2,
                                                   transpose_lhs=True))
  # int8 values with blocked scales are not the kernel's (the dispatcher composes them).
  x8 = gmm_jax.quantize(np.ones((32, 256), np.float32), jnp.int8, channelwise_axes=(0,),
                        tiled_axes={1: BLOCK})
  w8 = gmm_jax.quantize(np.ones((2, 256, 128), np.float32), jnp.int8,
                        channelwise_axes=(0, 2), tiled_axes={1: BLOCK})
  with pytest.raises(NotImplementedError, match="blocked scales"):
    mosaic_tpu.check_operands(x8, w8, GmmConfig(group_type="m", num_local=2))


@pytest.mark.parametrize("kind, expected", [(None, jnp.bfloat16), ("TPU v5 lite", jnp.bfloat16),
                                            ("TPU v6 lite", jnp.bfloat16), ("TPU7x", E4M3)])
def test_dot_dtype_follows_the_chips_fp8_mxu(monkeypatch, kind, expected):
  monkeypatch.setattr(chips, "tpu_kind", lambda: kind)
  assert cost_models.fp8_mxu() == (kind == "TPU7x")
  rng = np.random.default_rng(1)
  counts = jnp.asarray([16, 16], jnp.int32)
  cfg = GmmConfig(group_type="m", num_local=2, interpret=True)
  same = mosaic_tpu_plan.plan(*_forward_operands(rng, 32, 256, 128, 2, E4M3), counts, cfg)
  mixed = mosaic_tpu_plan.plan(*_forward_operands(rng, 32, 256, 128, 2, E5M2), counts, cfg)
  assert same.prepared.dot_dtype == np.dtype(expected)
  assert mixed.prepared.dot_dtype == np.dtype(jnp.bfloat16)  # e5m2 x e4m3 meet in bf16
  # K = 256: one K step of both scale blocks (one dot each).
  assert (same.tiling.tile_k, same.k_steps, same.blocks_per_step) == (256, 1, 2)


# m-grouping: an empty group, a group boundary inside a row tile, rows past the total; K = 300
# is two whole scale blocks and a ragged third (the kernels mask its padding).
M_SIZES = [70, 0, 90, 30]


def test_forward_bf16_output_with_bias():
  rng = np.random.default_rng(2)
  m, k, n, groups = 200, 300, 256, len(M_SIZES)
  x_q, w_q = _forward_operands(rng, m, k, n, groups, E4M3)
  bias = jnp.asarray(rng.standard_normal((groups, n)), jnp.float32)
  cfg = GmmConfig(group_type="m", num_local=groups, out_dtype=np.dtype(jnp.bfloat16),
                  interpret=True)
  got = _run(x_q, w_q, M_SIZES, cfg, bias)
  want = gmm_oracle(dequantize(x_q), dequantize(w_q), M_SIZES, "m", bias=np.asarray(bias))
  np.testing.assert_allclose(got, want, **_tolerance(jnp.bfloat16, x_q, w_q, k))
  assert np.all(got[sum(M_SIZES):] == 0)  # rows no group owns


def test_dlhs_transposed_weights_e5m2_gradient_f32_output():
  # The contraction (N = 600, five scale blocks) takes two K steps of four blocks: the second
  # has one block and a ragged edge of data, then blocks past K (masked, scales padded).
  rng = np.random.default_rng(3)
  m, k, n, groups = 200, 256, 600, len(M_SIZES)
  dy_q, w_q = _forward_operands(rng, m, k, n, groups, E5M2, transpose_rhs=True)
  # dlhs: dy [M, N] times the forward's own w [G, K, N] QArray read transposed (w[g].T).
  cfg = GmmConfig(group_type="m", num_local=groups, transpose_rhs=True,
                  out_dtype=np.dtype(jnp.float32), interpret=True)
  got = _run(dy_q, w_q, M_SIZES, cfg)
  want = gmm_oracle(dequantize(dy_q), dequantize(w_q), M_SIZES, "m", transpose_rhs=True)
  assert got.shape == (m, k)
  assert mosaic_tpu_plan.plan(dy_q, w_q, jnp.asarray(M_SIZES, jnp.int32), cfg).k_steps == 2
  np.testing.assert_allclose(got, want, **_tolerance(jnp.float32, dy_q, w_q, n))


# k-grouping (drhs): group boundaries at 70 and 160 (inside scale blocks 0 and 1), an empty
# group, and a ragged last block (300 tokens, 280 in groups).
K_SIZES = [70, 0, 90, 120]
# Larger groups (a mean of 550 tokens): items of four scale blocks (512 tokens), the boundary
# at 300 inside block 2 of the first item, the last item past the 1000 tokens in groups.
WIDE_K_SIZES = [300, 700]


@pytest.mark.parametrize("grad_type, sizes, tokens, blocks_per_item", [
    (E5M2, K_SIZES, 300, 1), (E4M3, WIDE_K_SIZES, 1100, 4),
    # 133 scale blocks: the lhs scales come in windows of 128 lanes (tokens past 16384 in the
    # second, partial one).
    pytest.param(E5M2, [9000, 0, 7900], 17000, 4, marks=pytest.mark.slow)],
    ids=["e5m2", "e4m3-wide", "e5m2-lane-windows"])
def test_drhs_k_grouped_block_scales_with_boundaries_inside_blocks(grad_type, sizes, tokens,
                                                                   blocks_per_item):
  rng = np.random.default_rng(4)
  d, f = 128, 256
  x_q, dy_q = _drhs_operands(rng, tokens, d, f, grad_type)
  groups = len(sizes)
  bias = jnp.asarray(rng.standard_normal((groups, f)), jnp.float32)
  cfg = GmmConfig(group_type="k", num_local=groups, transpose_lhs=True,
                  out_dtype=np.dtype(jnp.float32), interpret=True)
  counts = jnp.asarray(sizes, jnp.int32)
  assert mosaic_tpu_plan.plan(x_q, dy_q, counts, cfg).blocks_per_step == blocks_per_item
  got = _run(x_q, dy_q, sizes, cfg, bias)
  want = gmm_oracle(dequantize(x_q), dequantize(dy_q), sizes, "k", bias=np.asarray(bias),
                    transpose_lhs=True)
  assert got.shape == (groups, d, f)
  np.testing.assert_allclose(got, want, **_tolerance(jnp.float32, x_q, dy_q, tokens))
  for empty in np.flatnonzero(np.asarray(sizes) == 0):  # activation(bias), exactly
    np.testing.assert_array_equal(got[empty], np.broadcast_to(np.asarray(bias)[empty], (d, f)))


def test_fp8_mxu_chip_feeds_fp8_values_to_the_dot(monkeypatch):
  # TPU7x (fp8 MXU): e4m3 x e4m3 values go to the dot as they are; bf16 output, k-grouped.
  monkeypatch.setattr(chips, "tpu_kind", lambda: "TPU7x")
  rng = np.random.default_rng(5)
  tokens, d, f = 300, 128, 128
  x_q, dy_q = _drhs_operands(rng, tokens, d, f, E4M3)
  groups = len(K_SIZES)
  cfg = GmmConfig(group_type="k", num_local=groups, transpose_lhs=True,
                  out_dtype=np.dtype(jnp.bfloat16), interpret=True)
  counts = jnp.asarray(K_SIZES, jnp.int32)
  assert mosaic_tpu_plan.plan(x_q, dy_q, counts, cfg).prepared.dot_dtype == np.dtype(E4M3)
  got = _run(x_q, dy_q, K_SIZES, cfg)
  want = gmm_oracle(dequantize(x_q), dequantize(dy_q), K_SIZES, "k", transpose_lhs=True)
  np.testing.assert_allclose(got, want, **_tolerance(jnp.bfloat16, x_q, dy_q, tokens))


@pytest.mark.slow
def test_local_groups_explicit_tiles_and_the_xla_composition():
  # Two of four groups held locally (group_offset 1), explicit tiles (one scale block per K
  # step: three steps), compared with the numpy oracle and with gmm(...,
  # implementation="xla") on the same QArrays (the composed blocked mode).
  rng = np.random.default_rng(6)
  m, k, n, sizes = 200, 384, 256, [40, 70, 0, 60]
  x_q, w_q = _forward_operands(rng, m, k, n, 2, E4M3)
  cfg = GmmConfig(group_type="m", num_local=2, out_dtype=np.dtype(jnp.float32),
                  interpret=True)
  tiling = Tiling(tile_m=128, tile_k=512, tile_n=128)
  planned = mosaic_tpu_plan.plan(x_q, w_q, jnp.asarray(sizes, jnp.int32), cfg, tiling)
  assert (planned.tiling.tile_k, planned.k_steps) == (BLOCK, 3)
  got = _run(x_q, w_q, sizes, cfg, group_offset=1, tiling=tiling)
  want = gmm_oracle(dequantize(x_q), dequantize(w_q), sizes, "m", group_offset=1)
  tolerance = _tolerance(jnp.float32, x_q, w_q, k)
  np.testing.assert_allclose(got, want, **tolerance)
  composed = gmm_jax.gmm(x_q, w_q, jnp.asarray(sizes, jnp.int32), group_offset=1,
                         implementation="xla", preferred_element_type=jnp.float32)
  np.testing.assert_allclose(got, np.asarray(composed, np.float64), **tolerance)

