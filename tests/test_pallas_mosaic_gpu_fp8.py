"""The Pallas Mosaic GPU (Hopper) kernel's blocked fp8 mode (fp8 training's forward and dlhs
gmms): e4m3 / e5m2 values multiplied by wgmma with f32 accumulation, the 1 x 128 and
128 x 128 block scales applied per K step. Numerics in jax's Mosaic GPU interpreter on CPU
(jax >= 0.12; it simulates TMA, shared memory and wgmma), against a float64 numpy oracle of
the blockwise formula and against the XLA path on the same QArrays; the refusals that hand
the other gmms (k-grouped drhs, other blocks) to the next implementation.
The sm_90a compile is tests/test_deviceless_mosaic_fp8.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import simulators
from oracle import dequantize, f64, gmm_oracle, local_rows

import gmm_jax
from gmm_jax._src.core.config import GmmConfig, Tiling

mosaic = pytest.importorskip("gmm_jax.pallas.gpu.mosaic_gpu",
                             reason="this jax's Pallas Mosaic GPU lacks the kernel's API")
mosaic_kernel = pytest.importorskip("gmm_jax.pallas.gpu.mosaic_gpu_kernel")

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
HAS_INTERPRETER = hasattr(mosaic.plgpu, "InterpretGPUParams")
needs_interpreter = pytest.mark.skipif(
    not HAS_INTERPRETER, reason=f"jax {jax.__version__} has no Mosaic GPU interpreter that "
    "runs this kernel (jax 0.12 does)")


def _operands(m, k, n, num_local, transpose_rhs, lhs_type, seed, column_scales=False):
  """fp8 training's QArrays: lhs 1 x 128 blocks (per row), rhs 128 x 128 blocks per expert
  (``[L, K, N]``, or ``[L, N, K]`` for the dlhs; `column_scales`: 128 x 1 blocks, one scale
  per output column and K block, the kernel's per-column path). Columns of each
  contraction block and each expert are scaled differently (x 1, 9, 81, ...) so that a
  scale applied to the wrong block, row, column or expert shows."""
  rng = np.random.default_rng(seed)
  block_gain = 9.0 ** (np.arange(k) // 128)
  x = rng.standard_normal((m, k)) * block_gain * rng.uniform(0.5, 4.0, (m, 1))
  w = rng.standard_normal((num_local, k, n)) * block_gain[:, None]
  w *= rng.uniform(0.25, 4.0, (num_local, 1, n)) * (1.0 + np.arange(num_local))[:, None, None]
  if transpose_rhs:
    w = np.swapaxes(w, 1, 2)
  lhs = gmm_jax.quantize(x.astype(np.float32), lhs_type, channelwise_axes=(0,),
                         tiled_axes={1: 128})
  n_axis, k_axis = (1, 2) if transpose_rhs else (2, 1)
  if column_scales:
    rhs = gmm_jax.quantize(w.astype(np.float32), E4M3, channelwise_axes=(0, n_axis),
                           tiled_axes={k_axis: 128})
  else:
    rhs = gmm_jax.quantize(w.astype(np.float32), E4M3, channelwise_axes=(0,),
                           tiled_axes={1: 128, 2: 128})
  return lhs, rhs


def _run(lhs, rhs, sizes, offset, bias, cfg, tiling):
  """The kernel, called directly under jit, in jax's Mosaic GPU simulator (race detector
  on; `cfg.interpret` stands for it)."""
  cfg = cfg.replace(interpret=simulators.gpu())

  def kernel(*args):
    return mosaic.gmm_mosaic_gpu(*args, cfg, tiling)

  with simulators.no_race("gpu"):
    return jax.jit(kernel)(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(offset), bias)


# (M, K, N, sizes, num_local, offset, transpose_rhs, lhs values, activation + bias, out
# dtype, tiling). Empty groups, a group boundary inside a 128-row block (and inside a
# window), rows past the total, a group offset (rows of groups not held locally), 2-3
# contraction blocks (K = 320: the last block is half zero-filled by the TMA), N not a
# multiple of the tile; tiles of 128 columns run the warp-specialized kernel (two consumer
# warpgroups of 64 columns), 64 columns one warpgroup.
CASES = [
    pytest.param(200, 320, 256, [70, 0, 65, 40], 3, 1, False, E4M3, "relu", jnp.bfloat16,
                 Tiling(64, 128, 128), id="forward-e4m3-offset1-partial-block-relu-bf16"),
    pytest.param(160, 384, 192, [0, 90, 50], 3, 0, True, E5M2, None, jnp.float32,
                 Tiling(64, 128, 64), id="dlhs-e5m2xe4m3-one-warpgroup-column-scales"),
    pytest.param(256, 256, 128, [30, 0, 100, 60], 4, 0, False, E4M3, None, jnp.float32,
                 Tiling(128, 128, 128), id="forward-tile128", marks=pytest.mark.slow),
    pytest.param(144, 256, 128, [0, 140, 0], 3, 0, True, E4M3, None, jnp.float32, None,
                 id="dlhs-e4m3-default-tiling", marks=pytest.mark.slow),
]


@needs_interpreter
@pytest.mark.parametrize("m, k, n, sizes, num_local, offset, transpose_rhs, lhs_type, "
                         "activation, out_dtype, tiling", CASES)
def test_blocked_fp8_matches_the_blockwise_oracle(m, k, n, sizes, num_local, offset,
                                                   transpose_rhs, lhs_type, activation,
                                                   out_dtype, tiling, request):
  lhs, rhs = _operands(m, k, n, num_local, transpose_rhs, lhs_type, seed=m + k,
                       column_scales=request.node.callspec.id.endswith("column-scales"))
  bias = None
  if activation is not None:
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((num_local, n)) * 50,
                       jnp.float32)
  cfg = GmmConfig(group_type="m", num_local=num_local, transpose_rhs=transpose_rhs,
                  activation=activation, out_dtype=np.dtype(out_dtype), interpret=True)
  got = f64(_run(lhs, rhs, sizes, offset, bias, cfg, tiling))
  # The blockwise formula: each operand's values times its block scales (float64), then
  # per group; equal to the sum over K blocks of block products times both scales.
  want = gmm_oracle(dequantize(lhs), dequantize(rhs), sizes, "m", bias=bias,
                    activation=activation, transpose_rhs=transpose_rhs,
                    group_offset=offset, num_local=num_local)
  assert got.shape == (m, n)
  owned = local_rows(sizes, m, offset, num_local)
  # The products of 8-bit values are exact in f32 and the sums run in f32: the budget is
  # f32 rounding over K terms, plus the output's own rounding (bf16: 2^-8 relative).
  scale = np.abs(want).max()
  out_eps = 2.0 ** -8 if out_dtype == jnp.bfloat16 else 0.0
  np.testing.assert_allclose(got, want, rtol=out_eps, atol=(k * 2e-7 + out_eps) * scale)
  assert not np.any(got[~owned])  # rows of empty / non-local groups and past the total
  if transpose_rhs or tiling is None or tiling.tile_m != 64:
    return  # one XLA comparison is enough (each costs a compile)
  # The XLA path on the same QArrays (the dispatcher's composed reference).
  xla = f64(jax.jit(lambda a, b, s, bi: gmm_jax.gmm(
      a, b, s, bias=bi, activation=activation, transpose_rhs=transpose_rhs,
      group_offset=jnp.int32(offset), preferred_element_type=out_dtype,
      implementation="xla"))(lhs, rhs, jnp.asarray(sizes, jnp.int32), bias))
  np.testing.assert_allclose(got, xla, rtol=2 * out_eps, atol=(k * 4e-7 + 2 * out_eps) * scale)


@needs_interpreter
def test_blocked_fp8_all_groups_empty_is_zero():
  lhs, rhs = _operands(64, 256, 128, 3, False, E4M3, seed=3)
  cfg = GmmConfig(group_type="m", num_local=3, out_dtype=np.dtype(jnp.float32), interpret=True)
  got = f64(_run(lhs, rhs, [0, 0, 0], 0, None, cfg, Tiling(64, 128, 64)))
  assert got.shape == (64, 128) and not np.any(got)


@needs_interpreter
def test_each_k_block_takes_its_own_scales():
  # Exactly representable values: block 0 of x is 1 (scale 1/448), block 1 is 1/64 with
  # one 1/16 (scale 1/(16 * 448): values 112 and 448); w is 1, then 64. Each block with its
  # own scales: 128 + 127 + 4 = 259; block 0's scales for both would give 160.75.
  m, k, n = 64, 256, 64
  x = np.ones((m, k), np.float32)
  x[:, 128:] = 1.0 / 64
  x[:, -1] = 1.0 / 16
  w = np.ones((1, k, n), np.float32)
  w[:, 128:] = 64.0
  lhs = gmm_jax.quantize(x, E4M3, channelwise_axes=(0,), tiled_axes={1: 128})
  rhs = gmm_jax.quantize(w, E4M3, channelwise_axes=(0,), tiled_axes={1: 128, 2: 128})
  cfg = GmmConfig(group_type="m", num_local=1, out_dtype=np.dtype(jnp.float32), interpret=True)
  got = f64(_run(lhs, rhs, [m], 0, None, cfg, Tiling(64, 128, 64)))
  np.testing.assert_allclose(got, 259.0, rtol=1e-6)


# --------------------------------------------------------------------------- refusals


def _blocked_pair(group_type="m", k_block=128, qtype=E4M3):
  m, k, n = 64, 256, 128
  if group_type == "k":  # drhs: x^T dy, 128 x 1 blocks along the grouped rows
    lhs = gmm_jax.quantize(np.ones((m, k), np.float32), qtype, channelwise_axes=(1,),
                           tiled_axes={0: k_block})
    rhs = gmm_jax.quantize(np.ones((m, n), np.float32), qtype, channelwise_axes=(1,),
                           tiled_axes={0: k_block})
    return lhs, rhs, GmmConfig(group_type="k", num_local=2, transpose_lhs=True)
  lhs = gmm_jax.quantize(np.ones((m, k), np.float32), qtype, channelwise_axes=(0,),
                         tiled_axes={1: k_block})
  rhs = gmm_jax.quantize(np.ones((2, k, n), np.float32), qtype, channelwise_axes=(0,),
                         tiled_axes={1: k_block, 2: 128})
  return lhs, rhs, GmmConfig(group_type="m", num_local=2)


def test_serves_the_forward_and_dlhs_blocked_pairs():
  lhs, rhs, cfg = _blocked_pair()
  mosaic.check_operands(lhs, rhs, cfg)  # forward: x [64, 256] @ w [2, 256, 128]
  dy = gmm_jax.quantize(np.ones((64, 256), np.float32), E4M3, channelwise_axes=(0,),
                        tiled_axes={1: 128})
  w = gmm_jax.quantize(np.ones((2, 128, 256), np.float32), E4M3, channelwise_axes=(0,),
                       tiled_axes={1: 128, 2: 128})  # dlhs: dy [64, 256] @ w[g].T
  mosaic.check_operands(dy, w, GmmConfig(group_type="m", num_local=2, transpose_rhs=True))


@pytest.mark.parametrize("kwargs, match", [
    ({"group_type": "k"}, "group_type='k'"),      # drhs: Triton's (k-grouping)
    ({"k_block": 64}, "blocks of 64"),            # fp8 wgmma K groups are 128 values
    ({"qtype": jnp.int8}, "int8"),                # blocked int8: composed
])
def test_refuses_other_blocked_calls(kwargs, match):
  lhs, rhs, cfg = _blocked_pair(**kwargs)
  with pytest.raises(NotImplementedError, match=match):
    mosaic.check_operands(lhs, rhs, cfg)


@pytest.mark.parametrize("tiling", [Tiling(128, 128, 256), Tiling(64, 64, 128)])
def test_refuses_blocked_tiles_it_cannot_use(tiling):
  # 128 x 256: 128 x 128 per consumer warpgroup, twice (running sum + block product);
  # a 64-value K step: half a 128-byte swizzled row of fp8.
  cfg = GmmConfig(group_type="m", num_local=2)
  mosaic.check_tiling(tiling, 64, 256, 256, cfg)  # fine for bf16
  with pytest.raises(NotImplementedError, match="blocked fp8"):
    mosaic.check_tiling(tiling, 64, 256, 256, cfg, blocked=True)


@pytest.mark.parametrize("n, tiling", [(1024, Tiling(64, 128, 256)),
                                       (96, Tiling(64, 128, 128))])
def test_blocked_default_tiling(n, tiling):
  # 64 x 128 per consumer warpgroup (m64n128k32 wgmmas), narrower for a narrow N.
  cfg = GmmConfig(group_type="m", num_local=4)
  assert mosaic.default_tiling(4096, 1024, n, cfg, blocked=True) == tiling
  mosaic.check_tiling(tiling, 4096, 1024, n, cfg, blocked=True)


def test_mixed_fp8_pair_follows_this_jaxs_wgmma():
  # e5m2 gradients x e4m3 weights: one wgmma where jax's takes the pair (0.11.2 and 0.12),
  # refused (the next implementation serves) where it asks for one element type (0.10).
  dy = gmm_jax.quantize(np.ones((64, 256), np.float32), E5M2, channelwise_axes=(0,),
                        tiled_axes={1: 128})
  w = gmm_jax.quantize(np.ones((2, 128, 256), np.float32), E4M3, channelwise_axes=(0,),
                       tiled_axes={1: 128, 2: 128})
  cfg = GmmConfig(group_type="m", num_local=2, transpose_rhs=True)
  assert mosaic.MIXED_FP8 == (jax.__version_info__ >= (0, 11))
  if mosaic.MIXED_FP8:
    mosaic.check_operands(dy, w, cfg)
  else:
    with pytest.raises(NotImplementedError, match="one fp8 type"):
      mosaic.check_operands(dy, w, cfg)


@pytest.mark.parametrize("tiles, tile_n, want", [
    ({1: 128, 2: 128}, 128, "uniform"),   # 128 x 128 weight blocks, 64 columns a warpgroup
    ({1: 128, 2: 128}, 256, "uniform"),   # 128 columns a warpgroup
    ({1: 128, 2: 64}, 256, "columns"),    # a warpgroup's 128 columns span two blocks
])
def test_warpgroups_read_one_rhs_scale_per_block_where_they_can(tiles, tile_n, want):
  w = gmm_jax.quantize(np.ones((2, 256, 256), np.float32), E4M3, channelwise_axes=(0,),
                       tiled_axes=tiles)
  width = tile_n // mosaic_kernel.COMPUTE_WGS
  assert mosaic._scale_columns(w, GmmConfig(group_type="m", num_local=2), width) == want
  per_column = gmm_jax.quantize(np.ones((2, 256, 256), np.float32), E4M3,
                                channelwise_axes=(0, 2), tiled_axes={1: 128})
  assert mosaic._scale_columns(per_column, GmmConfig(group_type="m", num_local=2),
                               width) == "columns"
