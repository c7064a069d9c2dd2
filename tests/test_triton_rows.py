"""The Triton m-grouped kernel's row operations and gated activations, in interpret mode on
CPU: gathered lhs rows (repeated and out-of-range indices), row weights, scattered output
rows (unwritten rows stay 0), gated activations with bias, empty groups, group_offset.

The oracle is numpy float64 with per-group loops, written here from the interface's words
(nothing from gmm_jax), so a shared bug in the library's row helpers cannot hide in both
sides of a comparison.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax import quantize
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.core.epilogue import Rows, apply_epilogue
from gmm_jax.pallas.gpu import triton as triton_gmm
from gmm_jax.pallas.gpu import triton_kernel
from grids import covering
from oracle import ACTIVATIONS, f64, tolerances
from oracle import GATED as ORACLE_GATED

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

T, K, N, G = 12, 32, 32, 3
TILES = Tiling(tile_m=16, tile_k=16, tile_n=16)


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


GATED = {  # (gate, up) -> out, float64
    "swiglu": lambda g, u: ACTIVATIONS["silu"](g) * u,
    "geglu": lambda g, u: ACTIVATIONS["gelu"](g) * u,
    "geglu_tanh": lambda g, u: ACTIVATIONS["gelu_tanh"](g) * u,
    "swiglu_clamped": lambda g, u: (np.minimum(g, 7.0) * _sigmoid(1.702 * np.minimum(g, 7.0))
                                    * (np.clip(u, -7.0, 7.0) + 1.0)),
}


def rows_oracle(lhs, rhs, sizes, *, lhs_indices=None, row_weights=None, out_indices=None,
                out_rows=None, bias=None, activation=None, group_offset=0):
  """float64 result of the m-grouped gmm with row operands, one group at a time."""
  lhs, rhs = f64(lhs), f64(rhs)
  num_local = rhs.shape[0]
  sizes = [int(s) for s in sizes]
  num_rows = lhs.shape[0] if lhs_indices is None else len(lhs_indices)
  gated = activation in GATED
  n_out = rhs.shape[-1] // 2 if gated else rhs.shape[-1]
  y = np.zeros((num_rows, n_out))
  written = np.zeros(num_rows, bool)
  start = 0
  for g, size in enumerate(sizes):
    local = g - group_offset
    for r in range(start, min(start + size, num_rows)):
      if not 0 <= local < num_local:
        continue
      if lhs_indices is None:
        x = lhs[r]
      else:
        t = int(lhs_indices[r])
        x = lhs[t] if 0 <= t < lhs.shape[0] else np.zeros(lhs.shape[1])
      z = x @ rhs[local]
      if bias is not None:
        z = z + f64(bias)[local]
      if gated:
        z = GATED[activation](z[:n_out], z[n_out:])
      elif activation is not None:
        z = ACTIVATIONS[activation](z)
      if row_weights is not None:
        z = z * float(f64(row_weights)[r])
      y[r] = z
      written[r] = True
    start += size
  if out_indices is None:
    return y
  out = np.zeros((num_rows if out_rows is None else out_rows, n_out))
  for r in range(num_rows):
    target = int(out_indices[r])
    if written[r] and 0 <= target < out.shape[0]:
      out[target] = y[r]
  return out


def _operands(*, k=K, n=N, num_local=G, dtype=jnp.float32, bias=False, seed=0):
  keys = jax.random.split(jax.random.key(seed), 3)
  lhs = jax.random.normal(keys[0], (T, k), jnp.float32).astype(dtype)
  rhs = (jax.random.normal(keys[1], (num_local, k, n), jnp.float32) / math.sqrt(k)).astype(dtype)
  b = jax.random.normal(keys[2], (num_local, n), jnp.float32).astype(dtype) if bias else None
  return lhs, rhs, b


def _run(lhs, rhs, sizes, cfg, rows, *, bias=None, group_offset=0, tiling=TILES):
  fn = jax.jit(lambda lhs, rhs, counts, offset, bias, rows: triton_gmm.gmm_triton(
      lhs, rhs, counts, offset, bias, cfg, tiling, rows=rows))
  return fn(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(group_offset), bias, rows)


# 20 grouped rows over 12 tokens: repeats, a negative and a too-large index; the groups
# leave one row past their total (19 of 20 rows grouped) and an empty group in the middle.
LHS_INDICES = np.array([3, 3, 0, 11, -1, 5, 12, 7, 7, 7, 2, 1, 0, 9, 100, 4, 6, 8, 10, 3],
                       np.int32)
SIZES = [9, 0, 10]


@pytest.mark.parametrize("k", [K, 40])  # 40: a masked last K step of the gathered rows
def test_gather(k):
  lhs, rhs, _ = _operands(k=k)
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True, gather_rows=len(LHS_INDICES))
  rows = Rows(lhs_indices=jnp.asarray(LHS_INDICES))
  got = _run(lhs, rhs, SIZES, cfg, rows)
  want = rows_oracle(lhs, rhs, SIZES, lhs_indices=LHS_INDICES)
  assert got.shape == (len(LHS_INDICES), N)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=k))
  assert not np.any(f64(got)[[4, 6, 14, 19]])  # out-of-range reads and the ungrouped row


@pytest.mark.parametrize("group_offset", [0, 1])
def test_gather_weights_scatter(group_offset):
  """The MoE down projection: weights and a scatter to a permutation of slots, with
  unwritten rows (a non-local group, rows past the total, out-of-range targets)."""
  r = len(LHS_INDICES)
  num_local = G - group_offset
  lhs, rhs, bias = _operands(num_local=num_local, bias=True, seed=1)
  sizes = [5, 0, 7, 6] if group_offset else SIZES  # group 0 is not local with the offset
  weights = np.linspace(0.25, 2.0, r).astype(np.float32)
  out_rows = 24
  out_indices = np.random.default_rng(0).permutation(out_rows)[:r].astype(np.int32)
  out_indices[[2, 8]] = [-5, out_rows]  # written nowhere
  cfg = GmmConfig(group_type="m", num_local=num_local, interpret=True, gather_rows=r,
                  row_weights=True, out_rows=out_rows, activation="silu")
  rows = Rows(jnp.asarray(LHS_INDICES), jnp.asarray(weights), jnp.asarray(out_indices))
  got = _run(lhs, rhs, sizes, cfg, rows, bias=bias, group_offset=group_offset)
  want = rows_oracle(lhs, rhs, sizes, lhs_indices=LHS_INDICES, row_weights=weights,
                     out_indices=out_indices, out_rows=out_rows, bias=bias, activation="silu",
                     group_offset=group_offset)
  assert got.shape == (out_rows, N)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=K))
  unwritten = np.setdiff1d(np.arange(out_rows), out_indices)
  assert unwritten.size and not np.any(f64(got)[unwritten])


def test_weights_and_scatter_without_gather():
  lhs, rhs, _ = _operands(seed=2)
  sizes = [4, 0, 7]  # 11 of 12 rows grouped
  weights = np.arange(1, T + 1, dtype=np.float32) / 4
  out_indices = np.arange(T, dtype=np.int32)[::-1].copy()
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True, row_weights=True, out_rows=T,
                  out_dtype=jnp.bfloat16)
  rows = Rows(row_weights=jnp.asarray(weights), out_indices=jnp.asarray(out_indices))
  got = _run(lhs, rhs, sizes, cfg, rows)
  want = rows_oracle(lhs, rhs, sizes, row_weights=weights, out_indices=out_indices)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.bfloat16, k=K))
  assert not np.any(f64(got)[0])  # row 11 is past the total: its target stays 0


@pytest.mark.parametrize("activation", ["swiglu", "swiglu_clamped", "geglu", "geglu_tanh"])
def test_gated_gather_bias(activation):
  """The fused gate/up projection: gathered rows, [gate | up] weights and bias; N = 24 is
  not a multiple of the 16-column tile (masked up half)."""
  n_out = 24
  lhs, rhs, bias = _operands(n=2 * n_out, bias=True, seed=3)
  lhs = lhs * 3  # reach the clamp of swiglu_clamped
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True, gather_rows=len(LHS_INDICES),
                  activation=activation)
  got = _run(lhs, rhs, SIZES, cfg, Rows(lhs_indices=jnp.asarray(LHS_INDICES)), bias=bias)
  want = rows_oracle(lhs, rhs, SIZES, lhs_indices=LHS_INDICES, bias=bias,
                     activation=activation)
  assert got.shape == (len(LHS_INDICES), n_out)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=K))


def test_gated_weights_scatter_offset_bf16():
  n_out = 32
  lhs, rhs, bias = _operands(n=2 * n_out, num_local=2, dtype=jnp.bfloat16, bias=True, seed=4)
  weights = np.linspace(-1.0, 1.0, T).astype(np.float32)
  out_indices = np.array([5, 0, 14, 2, 9, 1, 3, 4, 6, 7, 8, 10], np.int32)  # 11 is unwritten
  cfg = GmmConfig(group_type="m", num_local=2, interpret=True, row_weights=True, out_rows=12,
                  activation="swiglu", out_dtype=jnp.bfloat16)
  rows = Rows(row_weights=jnp.asarray(weights), out_indices=jnp.asarray(out_indices))
  sizes = [3, 5, 0, 4]
  got = _run(lhs, rhs, sizes, cfg, rows, bias=bias, group_offset=1)
  want = rows_oracle(lhs, rhs, sizes, row_weights=weights, out_indices=out_indices,
                     out_rows=12, bias=bias, activation="swiglu", group_offset=1)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.bfloat16, k=K))
  assert not np.any(f64(got)[[5, 11]])  # group 0 is not local; no row targets 11


@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_weight_only_int8_gather_gated(transpose_rhs):
  lhs, rhs, _ = _operands(n=2 * N, seed=5)
  qrhs = quantize(rhs, jnp.int8, channelwise_axes=(0, 2))
  dequantized = f64(qrhs.qvalue) * f64(qrhs.scale)
  if transpose_rhs:  # [G, 2N, K] int8 weights (the 8-bit fast layout), per-channel scales
    qrhs = quantize(jnp.swapaxes(rhs, 1, 2), jnp.int8, channelwise_axes=(0, 1))
    dequantized = np.swapaxes(f64(qrhs.qvalue) * f64(qrhs.scale), 1, 2)
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True, gather_rows=len(LHS_INDICES),
                  activation="swiglu", transpose_rhs=transpose_rhs)
  got = _run(lhs, qrhs, SIZES, cfg, Rows(lhs_indices=jnp.asarray(LHS_INDICES)))
  want = rows_oracle(lhs, dequantized, SIZES, lhs_indices=LHS_INDICES, activation="swiglu")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=K))


def test_scaled_int8_gather_per_token_scales():
  """Scaled int8 x int8: the per-token scales follow the gathered rows."""
  lhs, rhs, _ = _operands(seed=6)
  qlhs = quantize(lhs, jnp.int8, channelwise_axes=(0,))
  qrhs = quantize(rhs, jnp.int8, channelwise_axes=(0, 2))
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True, gather_rows=len(LHS_INDICES),
                  tiling=Tiling(tile_m=16, tile_k=32, tile_n=16))
  got = _run(qlhs, qrhs, SIZES, cfg, Rows(lhs_indices=jnp.asarray(LHS_INDICES)),
             tiling=Tiling(tile_m=16, tile_k=32, tile_n=16))
  want = rows_oracle(f64(qlhs.qvalue) * f64(qlhs.scale), f64(qrhs.qvalue) * f64(qrhs.scale),
                     SIZES, lhs_indices=LHS_INDICES)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=K))


def test_k_grouped_gated_bias():
  """k-grouping with a gated activation: the epilogue runs after the kernel's sum."""
  m, n_out, sizes = 20, 24, [10, 0, 13]
  keys = jax.random.split(jax.random.key(7), 3)
  lhs = jax.random.normal(keys[0], (m, K), jnp.float32)
  rhs = jax.random.normal(keys[1], (K, 2 * n_out), jnp.float32) / math.sqrt(K)
  bias = jax.random.normal(keys[2], (G, 2 * n_out), jnp.float32)
  cfg = GmmConfig(group_type="k", num_local=G, interpret=True, activation="swiglu_clamped")
  got = _run(lhs, rhs, sizes, cfg, Rows(), bias=bias)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  want = np.stack([GATED["swiglu_clamped"](*np.split(
      f64(lhs)[:, starts[g]:starts[g + 1]] @ f64(rhs)[starts[g]:starts[g + 1]]
      + f64(bias)[g], 2, axis=-1)) for g in range(G)])
  assert got.shape == (G, m, n_out)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=K))


# Default run: each activation, layout and summation at least once (4 of 18); the rest
# with -m slow.
@covering(("activation", ["swiglu", "geglu", "swiglu_clamped"]),
          ("transposed", [False, True]), ("k_chunk, deterministic", [
              pytest.param(0, True, id="one-pass"),
              pytest.param(32, True, id="split-ordered"),
              pytest.param(32, False, id="split-atomic"),
          ]), keep=[(0, 1, 2)])
def test_k_grouped_gated_against_the_oracle(activation, transposed, k_chunk, deterministic):
  """k-grouping's gated activation in-kernel (gate and up accumulators, a one-pass
  program's epilogue) or after split-K's sum: act(z[..., :N]) * z[..., N:] of z = x_g @ w_g
  + bias_g, bias [G, 2N]; an empty group gives the gated bias."""
  m, n_out, k, sizes = 20, 24, 96, [40, 0, 13, 29]
  keys = jax.random.split(jax.random.key(9), 3)
  lhs = jax.random.normal(keys[0], (m, k), jnp.float32)
  rhs = jax.random.normal(keys[1], (k, 2 * n_out), jnp.float32) / math.sqrt(k)
  bias = jax.random.normal(keys[2], (len(sizes), 2 * n_out), jnp.float32)
  cfg = GmmConfig(group_type="k", num_local=len(sizes), interpret=True, activation=activation,
                  transpose_lhs=transposed, transpose_rhs=transposed,
                  deterministic=deterministic)
  fn = jax.jit(lambda *a: triton_gmm.gmm_triton(*a, cfg, TILES, k_chunk=k_chunk))
  got = fn(lhs.T if transposed else lhs, rhs.T if transposed else rhs,
           jnp.asarray(sizes, jnp.int32), jnp.int32(0), bias)
  starts = np.concatenate([[0], np.cumsum(sizes)])
  z = np.stack([f64(lhs)[:, starts[g]:starts[g + 1]] @ f64(rhs)[starts[g]:starts[g + 1]]
                + f64(bias)[g] for g in range(len(sizes))])
  assert got.shape == (len(sizes), m, n_out)
  np.testing.assert_allclose(f64(got), ORACLE_GATED[activation](z),
                             **tolerances(jnp.float32, k=k))


@pytest.mark.parametrize("activation", [None, "relu", "gelu", "gelu_tanh", "silu",
                                        "fast_gelu", "swiglu", "geglu", "geglu_tanh",
                                        "swiglu_clamped"])
@pytest.mark.parametrize("acc_dtype, out_dtype", [(jnp.float32, jnp.float32),
                                                  (jnp.float32, jnp.bfloat16),
                                                  (jnp.int32, jnp.float32)])
@pytest.mark.parametrize("weighted", [False, True])
def test_tile_epilogue_follows_apply_epilogue(activation, acc_dtype, out_dtype, weighted):
  """The kernels' epilogue of a tile (`finish_tile`, the gate and up accumulators kept
  apart) is `apply_epilogue` on the ``[gate | up]`` tile: bias, activation, gated halves,
  row weights, cast."""
  rows, cols = 16, 32
  keys = jax.random.split(jax.random.key(3), 5)
  gated = activation in ORACLE_GATED

  def tile(key, shape):
    if acc_dtype == jnp.int32:
      return jax.random.randint(key, shape, -40, 40, jnp.int32)
    return 3 * jax.random.normal(key, shape, jnp.float32)

  accs = (tile(keys[0], (rows, cols)), tile(keys[1], (rows, cols)))[:2 if gated else 1]
  biases = tuple(jax.random.normal(key, (1, cols), jnp.float32) for key in keys[2:4])
  biases = biases[:len(accs)]
  weights = jax.random.uniform(keys[4], (rows,), jnp.float32) if weighted else None
  got = triton_kernel.finish_tile(accs, biases, activation, out_dtype, weights)
  want = apply_epilogue(jnp.concatenate(accs, -1), jnp.concatenate(biases, -1), activation,
                        out_dtype, row_weights=weights)
  assert got.dtype == want.dtype and got.shape == want.shape == (rows, cols)
  if activation in ("gelu", "geglu"):
    # The kernel's erf is a rational approximation, within a few f32 ulps of 1 where
    # 1 + erf(x) is small: an absolute error of about 2**-22 |x| in x * Phi(x) (times |up|
    # for geglu); a 16-bit output may round the other way.
    scale = float(jnp.max(jnp.abs(jnp.concatenate(accs, -1)) + 1.0)) ** (2 if gated else 1)
    rtol = 2e-6 if out_dtype == jnp.float32 else 8e-3
    np.testing.assert_allclose(f64(got), f64(want), rtol=rtol, atol=2**-21 * scale)
  else:
    np.testing.assert_array_equal(f64(got), f64(want))


def test_empty_groups_and_zero_out_rows():
  lhs, rhs, _ = _operands()
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True, gather_rows=len(LHS_INDICES),
                  out_rows=7)
  rows = Rows(lhs_indices=jnp.asarray(LHS_INDICES),
              out_indices=jnp.arange(len(LHS_INDICES), dtype=jnp.int32))
  got = _run(lhs, rhs, [0, 0, 0], cfg, rows)
  assert got.shape == (7, N) and not np.any(f64(got))
  cfg = cfg.replace(out_rows=0)
  assert _run(lhs, rhs, SIZES, cfg, rows).shape == (0, N)


def test_unsupported_combinations():
  lhs, rhs, _ = _operands()
  indices = Rows(lhs_indices=jnp.asarray(LHS_INDICES))
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True, transpose_lhs=True,
                  gather_rows=len(LHS_INDICES))
  with pytest.raises(NotImplementedError, match="transpose_lhs"):
    triton_gmm.gmm_triton(lhs.T, rhs, jnp.array(SIZES, jnp.int32), jnp.int32(0), None, cfg,
                          TILES, rows=indices)
  cfg = GmmConfig(group_type="k", num_local=G, interpret=True, row_weights=True)
  with pytest.raises(NotImplementedError, match="m-grouping"):
    triton_gmm.gmm_triton(lhs.T, rhs[0], jnp.array([4, 4, 4], jnp.int32), jnp.int32(0), None,
                          cfg, TILES, rows=Rows(row_weights=jnp.ones(T)))
  cfg = GmmConfig(group_type="m", num_local=G, interpret=True)
  with pytest.raises(ValueError, match="lhs_indices"):
    triton_gmm.gmm_triton(lhs, rhs, jnp.array(SIZES, jnp.int32), jnp.int32(0), None, cfg,
                          TILES, rows=indices)


def test_features_and_gated_tiles():
  assert set(triton_gmm.FEATURES) == {"gather", "row_weights", "scatter", "gated", "gated_lhs",
                                      "gated_cotangent"}
  cfg = GmmConfig(group_type="m", num_local=8, activation="swiglu")
  # The heuristic sizes tile_n by the N output columns; the two accumulators keep a
  # 128x256 footprint (no spills on sm_90a, see gmm_jax.tools.aot).
  for activation in ("swiglu", "geglu"):
    tiling = triton_gmm.default_tiling(8192, 4096, 2 * 14336, cfg.replace(activation=activation))
    assert (tiling.tile_m, tiling.tile_n) == (128, 128)
  assert triton_gmm.default_tiling(8192, 4096, 2 * 24, cfg).tile_n == 32


def test_the_gated_ends_tiles_and_launch_parameters():
  # The MoE down gmm's gated ends (sm_90a, `gmm_jax.tools.aot`: 0 spills). A gated prologue
  # (z [M, 2K]) keeps two lhs tiles per pipeline stage and 128 columns; a gated-cotangent
  # epilogue sizes its N tiles by the product's columns (its output has twice as many),
  # keeps 64 of them from 128 rows (128x128 spilled) and two warpgroups for the pair of
  # cotangent tiles.
  prologue = GmmConfig(group_type="m", num_local=8, lhs_activation="swiglu")
  tiling = triton_gmm.default_tiling(8192, 2048, 4096, prologue)
  assert (tiling.tile_m, tiling.tile_n) == (128, 128)
  wide_k = Tiling(128, 128, 128)  # z's gate and up tiles per stage: 3 stages fit, not 2
  assert triton_gmm.compiler_params(wide_k, 2, prologue).num_stages == 2
  assert triton_gmm.compiler_params(wide_k, 2, prologue.replace(lhs_activation=None)
                                    ).num_stages == 3
  cotangent = GmmConfig(group_type="m", num_local=8, cotangent_of="swiglu", transpose_rhs=True)
  tiling = triton_gmm.default_tiling(8192, 1024, 2048, cotangent)
  assert (tiling.tile_m, tiling.tile_n) == (128, 64)
  assert triton_gmm.compiler_params(tiling, 2, cotangent).num_warps == 8
  assert triton_gmm.default_tiling(8192, 1024, 24, cotangent).tile_n == 32  # 24 columns
  assert triton_gmm.fit_registers(Tiling(64, 64, 128), cotangent) == Tiling(64, 64, 128)


def test_public_moe_ffn_runs_natively():
  """gmm_jax.route + the two fused gmms through the dispatcher: the Triton kernel serves
  every row feature itself (nothing materialized around it)."""
  import gmm_jax
  from gmm_jax._src.backends import registry

  experts, top_k, hidden = 4, 2, 16
  keys = jax.random.split(jax.random.key(8), 5)
  x = jax.random.normal(keys[0], (T, K), jnp.float32)
  w_up = jax.random.normal(keys[1], (experts, K, 2 * hidden), jnp.float32) / math.sqrt(K)
  w_down = jax.random.normal(keys[2], (experts, hidden, N), jnp.float32) / math.sqrt(hidden)
  top_e = jax.random.randint(keys[3], (T, top_k), 0, experts)
  top_p = jax.nn.softmax(jax.random.normal(keys[4], (T, top_k)), axis=-1)
  options = dict(implementation="pallas_triton", interpret=True, tiling=TILES)

  def moe(x, w_up, w_down, top_e, top_p):
    r = gmm_jax.route(top_e, experts, weights=top_p)
    h = gmm_jax.gmm(x, w_up, r.group_sizes, lhs_indices=r.lhs_indices, activation="swiglu",
                    **options)
    y = gmm_jax.gmm(h, w_down, r.group_sizes, row_weights=r.row_weights,
                    out_indices=r.out_indices, out_rows=r.num_slots, **options)
    return r.combine(y)

  with registry.record() as decisions:
    got = jax.jit(moe)(x, w_up, w_down, top_e, top_p)
  assert [d.implementation for d in decisions] == ["pallas_triton"] * 2
  assert all(not d.materialized for d in decisions)
  xs, wu, wd = f64(x), f64(w_up), f64(w_down)
  want = np.zeros((T, N))
  for t in range(T):
    for j in range(top_k):
      e = int(top_e[t, j])
      z = xs[t] @ wu[e]
      want[t] += float(top_p[t, j]) * (GATED["swiglu"](z[:hidden], z[hidden:]) @ wd[e])
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=K))
