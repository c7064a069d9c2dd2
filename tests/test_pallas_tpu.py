"""The Pallas TPU (Mosaic) kernels: the shared suite in interpret mode on CPU, several tiles
per dimension with ragged edges, and cross-lowering for TPU (Mosaic's own checks: block
shapes, lowerable primitives), which needs no TPU."""

from __future__ import annotations

import functools

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.backends.reference import gmm_reference
from gmm_jax._src.tiling import cost_models
from gmm_jax.pallas.tpu import mosaic_tpu, mosaic_tpu_plan
from grids import covering
from gmm_test_base import SIZES_WITH_EMPTY, GmmTestBase, lowering_problem, make_operands
from lowering import lower_for, mosaic_calls
from oracle import f64, gmm_oracle, local_rows, tolerances


class TestPallasTpu(GmmTestBase):
  IMPLEMENTATION = "pallas_tpu"
  INTERPRET = True


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="compiled Mosaic kernels need a TPU")
class TestPallasTpuCompiled(GmmTestBase):
  IMPLEMENTATION = "pallas_tpu"
  INTERPRET = False


# ---------------------------------------------------------------- kernels with several tiles

# The suite's shapes fit one tile. Here every dimension spans several blocks with a ragged
# edge (Mosaic blocks are multiples of 128 on lanes; tile_m may be a multiple of 32 when lhs
# is untransposed), groups straddle tiles, a tile holds several groups, and the K edge
# (300 = 2 x 128 + 44) is padded garbage that the kernels must mask.
SEVERAL_TILES = [
    pytest.param("m", [70, 0, 41, 100], 0, False, False, id="m"),
    pytest.param("m", [70, 0, 41, 100], 1, False, True, id="m-offset1-tr"),
    pytest.param("m", [70, 0, 41, 100], 0, True, True, id="m-tl-tr"),
    pytest.param("k", [130, 0, 41, 100], 0, False, False, id="k"),
    pytest.param("k", [130, 0, 41, 100], 2, True, False, id="k-offset2-tl"),
    pytest.param("k", [0, 250, 0, 0], 0, False, True, id="k-one-group-tr"),
]


@pytest.mark.parametrize("group_type, sizes, offset, transpose_lhs, transpose_rhs",
                         SEVERAL_TILES)
def test_several_tiles_per_dimension(group_type, sizes, offset, transpose_lhs, transpose_rhs):
  m, k, n, num_local = (230, 300, 260, 3) if group_type == "m" else (70, 300, 260, 3)
  lhs, rhs, bias = make_operands(group_type, m=m, k=k, n=n, num_local=num_local,
                                 transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                                 with_bias=True, seed=7)
  cfg = GmmConfig(group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, activation="gelu",
                  out_dtype=np.dtype("float32"), interpret=True)
  tiling = Tiling(tile_m=128 if transpose_lhs else 32, tile_k=128, tile_n=128)
  counts, group_offset = jnp.asarray(sizes, jnp.int32), jnp.int32(offset)
  got = jax.jit(lambda *a: mosaic_tpu.gmm_tpu(*a, cfg, tiling))(
      lhs, rhs, counts, group_offset, bias)
  want = jax.jit(lambda *a: gmm_reference(*a, cfg))(lhs, rhs, counts, group_offset, bias)
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(jnp.float32, k=k))


def test_tiling_override_through_gmm():
  # gmm(..., tiling=) reaches the kernel: an unblockable tile is refused by name.
  lhs, rhs, _ = make_operands("m", m=200, k=24, n=8)
  sizes = np.asarray([50, 0, 100, 30], np.int32)
  with pytest.raises(NotImplementedError, match="tile_m=48"):
    gmm_jax.gmm(lhs, rhs, sizes, implementation="pallas_tpu", interpret=True,
                tiling=Tiling(tile_m=48, tile_k=128, tile_n=128))
  got = gmm_jax.gmm(lhs, rhs, sizes, implementation="pallas_tpu", interpret=True,
                    tiling=Tiling(tile_m=64, tile_k=128, tile_n=128))
  want = gmm_jax.gmm(lhs, rhs, sizes, implementation="reference")
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(jnp.float32, k=24))


@pytest.mark.parametrize("group_type", ["m", "k"])
@pytest.mark.parametrize("m, k, n", [(8, 8, 8), (1000, 4096, 1024), (8192, 2048, 7168),
                                     (300, 129, 257)])
@pytest.mark.parametrize("num_local", [1, 8, 256])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("transpose_lhs", [False, True])
def test_default_tiling_is_blockable(group_type, m, k, n, num_local, itemsize, transpose_lhs):
  cfg = GmmConfig(group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs)
  tiling = mosaic_tpu_plan.default_tiling(m, k, n, cfg, itemsize)
  mosaic_tpu_plan.check_tiling(tiling, m, k, n, cfg)  # raises if Mosaic could not block it


# ------------------------------------------- rows no item owns, K edge, VMEM, cost model


def _m_problem(m, k, n, num_local, seed=3):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((m, k)).astype(np.float32)
  rhs = rng.standard_normal((num_local, k, n)).astype(np.float32)
  bias = rng.standard_normal((num_local, n)).astype(np.float32)
  return lhs, rhs, bias


# Default run: each routing once, tile_k alternating (-m slow: both for each).
@covering(("sizes, offset, num_local", [
    ([70, 0, 41, 100], 1, 2),  # local rows [70, 111): tiles before and after have no item
    ([10, 20, 5, 0], 0, 4),  # rows past the total (35 of 230)
    ([100, 50, 60, 20], 4, 2),  # no local group at all: every tile is a zero item
]), ("tile_k", [128, 512]))  # several K steps (edge masked) / one
def test_rows_no_item_owns_are_zero_from_the_kernel(sizes, offset, num_local, tile_k):
  # NaN in every lhs row that no local group owns: it must not reach the output, and those
  # rows must be exactly 0 (interpret mode fills never-written output with NaN).
  m, k, n = 230, 300, 200
  lhs, rhs, bias = _m_problem(m, k, n, num_local)
  owned = local_rows(sizes, m, offset, num_local)
  lhs[~owned] = np.nan
  cfg = GmmConfig(group_type="m", num_local=num_local, activation="silu",
                  out_dtype=np.dtype("float32"), interpret=True)
  tiling = Tiling(tile_m=64, tile_k=tile_k, tile_n=128)
  args = (jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes, jnp.int32), jnp.int32(offset),
          jnp.asarray(bias))
  got = np.asarray(jax.jit(lambda *a: mosaic_tpu.gmm_tpu(*a, cfg, tiling))(*args))
  assert np.all(got[~owned] == 0)
  want = gmm_oracle(np.where(owned[:, None], lhs, 0), rhs, sizes, "m", bias=bias,
                    activation="silu", group_offset=offset, num_local=num_local)
  np.testing.assert_allclose(got, want, **tolerances(jnp.float32, k=k))
  # The kernel's output is the result: no select pass over it after the call.
  jaxpr = jax.make_jaxpr(lambda *a: mosaic_tpu.gmm_tpu(*a, cfg, tiling))(*args).jaxpr
  producer = next(e for e in jaxpr.eqns if jaxpr.outvars[0] in e.outvars)
  assert producer.primitive.name == "pallas_call"


@pytest.mark.parametrize("transpose_lhs, transpose_rhs", [(False, False), (True, True)])
@pytest.mark.parametrize("k", [300, 384])  # a ragged K edge (masked on the last step) / none
def test_k_edge_masked_on_the_last_step_is_exact(k, transpose_lhs, transpose_rhs):
  # Three K steps of 128: the last one is 44 columns of data and 84 of padding.
  m, n, sizes = 200, 130, [90, 0, 60, 50]
  lhs, rhs, bias = _m_problem(m, k, n, 4, seed=11)
  lhs, rhs = lhs * 100, rhs * 100  # padding that leaked in would show far above tolerance
  stored_lhs = lhs.T if transpose_lhs else lhs
  stored_rhs = np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  cfg = GmmConfig(group_type="m", num_local=4, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, out_dtype=np.dtype("float32"), interpret=True)
  tiling = Tiling(tile_m=128, tile_k=128, tile_n=128)
  got = mosaic_tpu.gmm_tpu(jnp.asarray(stored_lhs), jnp.asarray(stored_rhs),
                           jnp.asarray(sizes, jnp.int32), jnp.int32(0), None, cfg, tiling)
  want = gmm_oracle(lhs, rhs, sizes, "m")
  np.testing.assert_allclose(f64(got), want, rtol=1e-5, atol=1e-5 * 1e4 * np.sqrt(k))


def test_several_k_steps_with_zero_items_and_partial_row_chunks():
  # tile_m 256 with 128-row MXU slices: items that own part of a tile compute only the
  # slices they touch; several K steps; tiles with no local group are zero items.
  m, k, n, sizes = 700, 300, 140, [0, 130, 3, 300, 0, 120]
  lhs, rhs, bias = _m_problem(m, k, n, 3, seed=5)
  cfg = GmmConfig(group_type="m", num_local=3, activation="gelu",
                  out_dtype=np.dtype("float32"), interpret=True)
  tiling = Tiling(tile_m=256, tile_k=128, tile_n=128)
  got = mosaic_tpu.gmm_tpu(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes, jnp.int32),
                           jnp.int32(1), jnp.asarray(bias), cfg, tiling)
  want = gmm_oracle(lhs, rhs, sizes, "m", bias=bias, activation="gelu", group_offset=1,
                    num_local=3)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=k))


@pytest.mark.parametrize("offset", [0, 1])
def test_weight_only_cast_cache_follows_the_group(offset):
  # One K step: the cast int8 weight tile is cached per (column block, group); leading zero
  # items (offset 1: tiles 0 and 1 hold no local row) must not leave a stale cache.
  m, k, n, sizes = 230, 256, 200, [70, 60, 41, 59]
  rng = np.random.default_rng(9)
  w = rng.standard_normal((3, k, n)).astype(np.float32) / 16
  q = gmm_jax.quantize(w, jnp.int8, channelwise_axes=(0, 2))
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)

  def run(implementation):
    return gmm_jax.gmm(x, q, sizes, group_offset=offset, preferred_element_type=jnp.float32,
                       implementation=implementation, interpret=True,
                       tiling=Tiling(tile_m=32, tile_k=256, tile_n=128))

  got, want = np.asarray(run("pallas_tpu")), np.asarray(run("xla"))
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert np.all(got[~local_rows(sizes, m, offset, 3)] == 0)


def test_m_items_cover_every_tile_once_in_order():
  sizes = jnp.asarray([70, 0, 41, 100], jnp.int32)
  arrays, count = cost_models.m_items(sizes, 230, 32, jnp.int32(1), 2, k_steps=3)
  groups, out_tiles, lhs_tiles, starts, ends, real, k_fixed = (
      np.asarray(a)[:int(count)] for a in arrays)
  # Local groups: global 1 (empty) and 2, rows [70, 111), in tiles 2 and 3 of 8. The rows
  # before them (tiles 0-2) and after them (tiles 3-7) are zero items, one per tile they
  # touch: tiles 2 and 3 get a zero item and a real one.
  assert int(count) == 10
  np.testing.assert_array_equal(out_tiles, [0, 1, 2, 2, 3, 3, 4, 5, 6, 7])
  np.testing.assert_array_equal(real, [0, 0, 0, 1, 1, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(starts, [0, 0, 0, 70, 96, 0, 0, 0, 0, 0])
  np.testing.assert_array_equal(ends, [0, 0, 0, 96, 111, 0, 0, 0, 0, 0])
  # Zero items reuse a neighbour's blocks: the first real item's before it (K block 0),
  # the previous real item's after it (its last K block): no new DMA.
  np.testing.assert_array_equal(lhs_tiles, [2, 2, 2, 2, 3, 3, 3, 3, 3, 3])
  np.testing.assert_array_equal(groups, [1] * 10)
  np.testing.assert_array_equal(k_fixed, [0, 0, 0, 0, 0, 2, 2, 2, 2, 2])


def test_vmem_bytes_and_limit():
  tiling = Tiling(tile_m=512, tile_k=4096, tile_n=1024)
  needed = cost_models.vmem_bytes(tiling, "m", lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
                                  dot_itemsize=2, k_steps=1)
  blocks = 2 * 512 * 4096 * 2 + 2 * 4096 * 1024 * 2 + 2 * 512 * 1024 * 2
  assert needed == blocks + 2 * 512 * 1024 * 4  # + the f32 dot result and a temporary
  with_acc = cost_models.vmem_bytes(tiling, "m", lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
                                    dot_itemsize=2, k_steps=2)
  assert with_acc == needed + 512 * 1024 * 4
  mib = 2**20
  # 25% + 4 MiB headroom, rounded up to a MiB, capped below the capacity less the reserve.
  assert cost_models.vmem_limit(40 * mib, capacity=128 * mib) == 54 * mib
  assert cost_models.vmem_limit(40 * mib + 1, capacity=128 * mib) == 55 * mib
  assert cost_models.vmem_limit(100 * mib, capacity=128 * mib) == 120 * mib
  with pytest.raises(NotImplementedError, match="VMEM"):
    cost_models.vmem_limit(121 * mib, capacity=128 * mib)


def test_tiles_too_large_for_vmem_are_refused():
  m, k, n = 4096, 8192, 8192
  cfg = GmmConfig(group_type="m", num_local=2, out_dtype=np.dtype("float32"))
  args = (jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((2, k, n), jnp.float32),
          jax.ShapeDtypeStruct((2,), jnp.int32), jax.ShapeDtypeStruct((), jnp.int32), None)
  huge = Tiling(tile_m=1024, tile_k=8192, tile_n=4096)
  with pytest.raises(NotImplementedError, match="MiB of VMEM"):
    jax.eval_shape(lambda *a: mosaic_tpu.gmm_tpu(*a, cfg, huge), *args)
  info = mosaic_tpu_plan.plan(*args[:2], args[2], cfg)  # the default tiles fit
  assert info.vmem_limit_bytes <= cost_models.vmem_capacity() - cost_models.VMEM_RESERVE


@pytest.mark.parametrize("m, k, n, num_local", [(16384, 4096, 14336, 8), (8192, 2048, 1408, 64),
                                                (64, 4096, 14336, 8)])
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_default_tiles_cover_k_and_split_n_evenly(m, k, n, num_local, group_type):
  cfg = GmmConfig(group_type=group_type, num_local=num_local, out_dtype=np.dtype("bfloat16"))
  tiling = mosaic_tpu_plan.default_tiling(m, k, n, cfg, 2)
  if group_type == "m":
    assert tiling.tile_k >= k  # weights fetched once per column block, not per item
  assert n % tiling.tile_n == 0 and (tiling.tile_n % 128 == 0 or tiling.tile_n == n)
  needed = cost_models.vmem_bytes(tiling, group_type, lhs_itemsize=2, rhs_itemsize=2,
                                  out_itemsize=2, dot_itemsize=2, k_steps=1)
  assert needed <= cost_models.vmem_capacity() // 2


@pytest.mark.parametrize("m, k, n", [(16384, 14336, 4096), (8192, 2048, 1024), (4096, 1408, 2048),
                                     (512, 384, 256)])
def test_default_tiles_of_a_gated_prologue_divide_k(m, k, n):
  # The prologue reads z's gate and up K blocks K columns apart: a ragged tile_k (8192 for
  # Mixtral's 14336) would make the kernel refuse it, and act(z) be formed around it.
  cfg = GmmConfig(group_type="m", num_local=8, out_dtype=np.dtype("bfloat16"),
                  lhs_activation="swiglu")
  tiling = mosaic_tpu_plan.default_tiling(m, k, n, cfg, 2)
  assert k % tiling.tile_k == 0
  mosaic_tpu_plan.check_tiling(tiling, m, k, n, cfg)
  needed = cost_models.vmem_bytes(tiling, "m", lhs_itemsize=2, rhs_itemsize=2, out_itemsize=2,
                                  dot_itemsize=2, k_steps=k // tiling.tile_k, weight_cache=True,
                                  has_bias=True) + 2 * tiling.tile_m * tiling.tile_k * 2
  assert needed <= cost_models.vmem_capacity() // 2
  lhs = jax.ShapeDtypeStruct((m, 2 * k), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((8, k, n), jnp.bfloat16)
  counts = jax.ShapeDtypeStruct((8,), jnp.int32)
  mosaic_tpu_plan.plan(lhs, rhs, counts, cfg)  # the kernel serves it (no NotImplementedError)


def _zipf_sizes(m, groups, seed=0):
  weights = 1.0 / np.arange(1, groups + 1)
  sizes = np.floor(m * weights / weights.sum()).astype(np.int64)
  sizes[: m - sizes.sum()] += 1
  return np.random.default_rng(seed).permutation(sizes)


def test_static_cost_model():
  m, k, n, groups = 2048, 512, 768, 16
  cfg = GmmConfig(group_type="m", num_local=groups, out_dtype=np.dtype("bfloat16"))
  whole = Tiling(tile_m=128, tile_k=k, tile_n=n)
  # 128 rows per group on 128-row tiles: no padding, and each operand moves once.
  cost = mosaic_tpu_plan.static_cost(np.full(groups, 128), m, k, n, cfg, whole, 2, row_chunk=128)
  assert cost["useful_rows"] == m and cost["mma_rows"] == m
  assert cost["grid_steps"] == cost["work_steps"] == groups
  assert cost["hbm_bytes"] == cost["ideal_bytes"] == (m * k + groups * k * n + m * n) * 2
  # Zipf sizes: a 512-row tile computes only the 128-row MXU slices an item touches.
  zipf = _zipf_sizes(m, groups)
  big = Tiling(tile_m=512, tile_k=k, tile_n=n)
  sliced = mosaic_tpu_plan.static_cost(zipf, m, k, n, cfg, big, 2, row_chunk=128)
  unsliced = mosaic_tpu_plan.static_cost(zipf, m, k, n, cfg, big, 2, row_chunk=512)
  assert sliced["useful_rows"] == m
  assert sliced["group_aligned_rows"] <= sliced["mma_rows"] < unsliced["mma_rows"]
  # Tile-aligned items pay up to one 128-row slice per group boundary on each side: with a
  # mean of 128 rows per group that is ~2x (the group-aligned floor is ~1.5x).
  assert sliced["mma_rows"] <= 2 * m
  # Two K steps: an item re-fetches its group's weights (K block changes every step).
  split = Tiling(tile_m=512, tile_k=k // 2, tile_n=n)
  one = mosaic_tpu_plan.static_cost([m], m, k, n, cfg.replace(num_local=1), split, 2)
  assert one["hbm_bytes"] == (m * k + 4 * k * n + m * n) * 2
  # Local rows [70, 111) (one non-empty local group): zero items for the other rows' tiles
  # (8, tiles 2 and 3 also hold local rows), which fetch nothing new.
  remote = mosaic_tpu_plan.static_cost([70, 0, 41, 100], 230, k, n, cfg.replace(num_local=2),
                                       Tiling(tile_m=32, tile_k=k, tile_n=n), 2, group_offset=1,
                                       row_chunk=32)
  assert remote["grid_steps"] == 10 and remote["work_steps"] == 2
  assert remote["useful_rows"] == 41
  assert remote["hbm_bytes"] == (2 * 32 * k + k * n + 230 * n) * 2
  # k-grouping: (M tiles, N tiles, items); lhs is re-read per column block.
  kcfg = GmmConfig(group_type="k", num_local=4, out_dtype=np.dtype("float32"))
  kcost = mosaic_tpu_plan.static_cost([256, 0, 128, 128], 256, 512, 256, kcfg,
                                      Tiling(tile_m=256, tile_k=128, tile_n=128), 2)
  assert kcost["useful_rows"] == 512 and kcost["mma_rows"] == 512
  assert kcost["hbm_bytes"] == (2 * 256 * 512 + 512 * 256) * 2 + 4 * 256 * 256 * 4


# ----------------------------------------------------------------------- lowering for TPU


def _lower_for_tpu(fn, *args) -> str:
  return lower_for("tpu", fn, *args)


LOWERING_SHAPES = [  # (M, K, N): aligned, below one tile, ragged, several ragged tiles
    (256, 128, 256),
    (45, 50, 40),
    (7, 5, 3),
    (300, 129, 257),
    (1100, 640, 700),
]
LOWERING_CASES = [  # (lhs dtype, rhs dtype, preferred, transpose_lhs, transpose_rhs, act)
    (jnp.float32, jnp.float32, None, False, False, "silu"),
    (jnp.bfloat16, jnp.bfloat16, None, True, False, "gelu"),
    (jnp.float16, jnp.float16, jnp.float32, False, True, "gelu_tanh"),
    (jnp.bfloat16, jnp.float32, None, True, True, "relu"),
    (jnp.int8, jnp.int8, jnp.int32, False, False, None),
    (jnp.bfloat16, jnp.bfloat16, None, False, False, "fast_gelu"),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16, False, True, jax.nn.sigmoid),
]
LOWERING_TILINGS = [None, Tiling(tile_m=128, tile_k=128, tile_n=128),
                    Tiling(tile_m=512, tile_k=256, tile_n=512)]


def _lowering_params():
  # Default run: each (shape, case) pair with one of the tilings, in turn, for both group
  # types (70 of the 210 lowerings: every shape, case and tiling, and each pair of them,
  # at least once); the rest with -m slow.
  params = []
  for group_type in ("m", "k"):
    for s, shape in enumerate(LOWERING_SHAPES):
      for case in range(len(LOWERING_CASES)):
        for tiling in range(len(LOWERING_TILINGS)):
          marks = () if tiling == (s + case) % len(LOWERING_TILINGS) else (pytest.mark.slow,)
          params.append(pytest.param(
              group_type, shape, case, tiling, marks=marks,
              id=f"{group_type}-{'x'.join(map(str, shape))}-{case}-{tiling}"))
  return params


@pytest.mark.parametrize("group_type, shape, case, tiling", _lowering_params())
def test_lowers_for_tpu(group_type, shape, case, tiling):
  num_local = 4
  lhs, rhs, bias, options = lowering_problem(group_type, shape, LOWERING_CASES[case],
                                             num_local)

  def f(lhs, rhs, bias, sizes, offset):
    # implementation=None: the TPU chain must choose the kernel.
    return gmm_jax.gmm(lhs, rhs, sizes, bias=bias, group_offset=offset,
                       tiling=LOWERING_TILINGS[tiling], **options)

  sizes = jnp.zeros((num_local + 1,), jnp.int32)  # traced: any routing, one lowering
  text = _lower_for_tpu(f, lhs, rhs, bias, sizes, jnp.int32(1))
  assert mosaic_calls(text) == 1, "one Mosaic kernel"


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_gradients_lower_for_tpu(group_type):
  # The backward pass is forward gmms in the other grouping modes (and transposed layouts).
  lhs, rhs, bias = make_operands(group_type, m=300, k=129, n=257, lhs_dtype=jnp.bfloat16,
                                 with_bias=True)

  def loss(lhs, rhs, bias, sizes):
    out = gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, bias=bias, activation="gelu")
    return jnp.sum(out.astype(jnp.float32))

  text = _lower_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), lhs, rhs, bias,
                        jnp.asarray(SIZES_WITH_EMPTY, jnp.int32))
  assert mosaic_calls(text) >= 3, "forward, dlhs and drhs kernels"


def test_unlowerable_activation_and_tiling_fall_back_to_xla():
  # erfc has no Mosaic rule and a 16-row tile cannot be blocked: the kernel refuses both
  # before it builds its pallas_call, so the TPU chain serves the call with "xla" instead
  # of failing inside Mosaic's lowering.
  lhs, rhs, _ = make_operands("m")
  sizes = np.asarray(SIZES_WITH_EMPTY, np.int32)
  erfc_gelu = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
  with pytest.raises(NotImplementedError, match="erfc"):
    _lower_for_tpu(lambda l, r: gmm_jax.gmm(l, r, sizes, activation=erfc_gelu,
                                            implementation="pallas_tpu"), lhs, rhs)
  for options in (dict(activation=erfc_gelu), dict(tiling=Tiling(tile_m=16))):
    text = _lower_for_tpu(lambda l, r: gmm_jax.gmm(l, r, sizes, **options), lhs, rhs)
    assert mosaic_calls(text) == 0  # served by "xla"


# ------------------------------------------------- epilogue features: gated, row weights

# The kernels keep a gated activation's gate and up column blocks (and accumulators) side
# by side and apply row weights in the epilogue (`FEATURES`); against the reference on
# several tiles per dimension, several K steps with a ragged K edge, both group types.
EPILOGUE_CASES = [
    pytest.param("m", "swiglu", False, (32, 128, 128), False, False, 300, id="m-swiglu"),
    pytest.param("m", "swiglu", True, (32, 128, 128), False, False, 300, id="m-swiglu-weighted"),
    pytest.param("m", "gelu", True, (32, 128, 128), False, True, 300, id="m-gelu-weighted-tr"),
    pytest.param("m", "geglu", True, None, False, True, 300, id="m-geglu-default-tiles"),
    pytest.param("m", "swiglu_clamped", False, (128, 128, 128), True, True, 300,
                 id="m-clamped-tl-tr"),
    pytest.param("m", "swiglu", True, (32, 512, 256), False, False, 384, id="m-one-k-step"),
    pytest.param("k", "swiglu", False, (32, 128, 128), False, False, 300, id="k-swiglu"),
    pytest.param("k", "geglu", False, (128, 128, 128), True, True, 300, id="k-geglu-tl-tr"),
]


@pytest.mark.parametrize("group_type, activation, weighted, tiles, transpose_lhs, "
                         "transpose_rhs, k", EPILOGUE_CASES)
def test_gated_and_row_weights_epilogue(group_type, activation, weighted, tiles,
                                        transpose_lhs, transpose_rhs, k):
  from gmm_jax._src.core.epilogue import Rows
  gated = activation in ("swiglu", "geglu", "swiglu_clamped")
  m, n_out, num_local = (230, 256, 3) if group_type == "m" else (70, 256, 3)
  sizes = [70, 0, 41, 100] if group_type == "m" else [130, 0, 41, 100]
  lhs, rhs, bias = make_operands(group_type, m=m, k=k, n=2 * n_out if gated else n_out,
                                 num_local=num_local, transpose_lhs=transpose_lhs,
                                 transpose_rhs=transpose_rhs, with_bias=True, seed=11)
  weights = jnp.asarray(np.random.default_rng(5).standard_normal(m), jnp.float32)
  rows = Rows(None, weights if weighted else None, None)
  cfg = GmmConfig(group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, activation=activation, row_weights=weighted,
                  out_dtype=np.dtype("float32"), interpret=True)
  tiling = None if tiles is None else Tiling(*tiles)
  counts, group_offset = jnp.asarray(sizes, jnp.int32), jnp.int32(1)
  got = jax.jit(lambda *a: mosaic_tpu.gmm_tpu(*a, cfg, tiling, rows))(
      lhs, rhs, counts, group_offset, bias)
  assert got.shape == ((m, n_out) if group_type == "m" else (num_local, m, n_out))
  want = jax.jit(lambda *a: gmm_reference(*a, cfg, rows=rows) if weighted
                 else gmm_reference(*a, cfg))(lhs, rhs, counts, group_offset, bias)
  # f32 sums of another order, each rounding error times the other factor of gate * up
  # (at most the largest pre-activation, from the reference without the activation).
  z = gmm_reference(lhs, rhs, counts, group_offset, bias, cfg.replace(activation=None,
                                                                      row_weights=False))
  scale = (float(jnp.max(jnp.abs(lhs)) * jnp.max(jnp.abs(rhs)))
           * max(1.0, float(jnp.max(jnp.abs(z)))) * float(jnp.max(jnp.abs(weights))))
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(jnp.float32, k=k, scale=scale))


def test_gated_tiles_must_divide_the_output_columns():
  cfg = GmmConfig(group_type="m", num_local=2, activation="swiglu")
  # 2N = 1024 product columns: N = 512 output columns, which 384 does not divide.
  with pytest.raises(NotImplementedError, match="divides the 512 output columns"):
    mosaic_tpu_plan.check_tiling(Tiling(tile_m=128, tile_k=128, tile_n=384), 256, 128, 1024, cfg)
  with pytest.raises(NotImplementedError, match="multiple of 128"):  # 96 divides 192
    mosaic_tpu_plan.check_tiling(Tiling(tile_m=128, tile_k=128, tile_n=96), 256, 128, 384, cfg)
  mosaic_tpu_plan.check_tiling(Tiling(tile_m=128, tile_k=128, tile_n=256), 256, 128, 1024, cfg)
  mosaic_tpu_plan.check_tiling(Tiling(tile_m=128, tile_k=128, tile_n=1024), 256, 128, 1024, cfg)
  tiling = mosaic_tpu_plan.default_tiling(4096, 1024, 2 * 1408, cfg)
  assert 1408 % tiling.tile_n == 0 and tiling.tile_n % 128 == 0


@pytest.mark.parametrize("n_out, fused", [(256, True), (64, False)])
def test_dispatch_fuses_what_the_kernel_does_and_moves_the_rest_around(n_out, fused):
  # Gathered rows, a gated activation and row weights on TPU: the kernel does the gated
  # activation and the weights in its epilogue; the gather is done before it (exact). With
  # N/2 = 64 output columns (no 128-lane tile divides it) the kernel refuses the fused form
  # and serves the plain gmm, the activation and weights done after it in f32.
  from gmm_jax._src.backends import registry
  tokens, k, num_local = 50, 128, 3
  x = jnp.asarray(np.random.default_rng(1).standard_normal((tokens, k)), jnp.float32)
  rhs = jnp.asarray(np.random.default_rng(2).standard_normal((num_local, k, 2 * n_out)) / 8,
                    jnp.float32)
  sizes = jnp.asarray([40, 0, 60], jnp.int32)
  indices = jnp.asarray(np.random.default_rng(3).integers(0, tokens, 100), jnp.int32)
  weights = jnp.asarray(np.random.default_rng(4).random(100), jnp.float32)

  def f(x, rhs, implementation, interpret):
    return gmm_jax.gmm(x, rhs, sizes, activation="swiglu", lhs_indices=indices,
                       row_weights=weights, implementation=implementation,
                       interpret=interpret)

  with registry.record() as decisions:
    got = jax.jit(lambda x, r: f(x, r, "pallas_tpu", True))(x, rhs)
  (decision,) = decisions
  assert decision.implementation == "pallas_tpu"
  assert decision.materialized == (("gather",) if fused
                                   else ("gather", "row_weights", "gated"))
  want = f(x, rhs, "reference", False)
  np.testing.assert_allclose(f64(got), f64(want), rtol=1e-5, atol=1e-5)
  if fused:  # lowered for a TPU: one Mosaic kernel gives the [R, N] result itself
    text = _lower_for_tpu(lambda x, r: f(x, r, None, False), x, rhs)
    assert mosaic_calls(text) == 1
    assert f"tensor<100x{2 * n_out}xf32>" not in text.split("tpu_custom_call")[-1]


# The kernels multiply a K block wider than K_CHUNK (m-grouping) and an output tile taller
# than OUT_ROW_CHUNK (k-grouping) in chunks, in a loop (Mosaic compiles one chunk's code).
# Small chunks here, so that small shapes take the loops: several chunks per K step and
# per tile, a ragged K edge masked inside the last chunk, gated epilogues and prologues,
# both layouts, the gradients' k-grouped gmms; against the reference.
CHUNKED_CASES = [
    pytest.param("m", dict(activation="gelu"), (32, 256, 128), 300, id="m-2k-steps-edge"),
    pytest.param("m", dict(activation="swiglu"), (32, 384, 128), 384, id="m-one-k-step-swiglu"),
    pytest.param("m", dict(transpose_lhs=True, transpose_rhs=True), (128, 256, 128), 300,
                 id="m-tl-tr"),
    pytest.param("m", dict(lhs_activation="swiglu"), (32, 256, 128), 256, id="m-prologue"),
    pytest.param("k", dict(activation="gelu"), (256, 128, 128), 300, id="k-2-row-chunks"),
    pytest.param("k", dict(transpose_lhs=True, transpose_rhs=True, activation="swiglu"),
                 (256, 128, 128), 300, id="k-tl-tr-swiglu"),
]


@pytest.mark.parametrize("group_type, options, tiles, k", CHUNKED_CASES)
def test_chunked_products_match_the_reference(monkeypatch, group_type, options, tiles, k):
  monkeypatch.setattr(mosaic_tpu_plan, "K_CHUNK", 128)
  monkeypatch.setattr(mosaic_tpu_plan, "OUT_ROW_CHUNK", 128)
  tiling = Tiling(*tiles)
  if group_type == "m":
    assert mosaic_tpu_plan.k_chunks(tiling.tile_k) == tiling.tile_k // 128 > 1
  else:
    assert mosaic_tpu_plan.out_row_chunk(tiling.tile_m) == 128
  gated = options.get("activation") == "swiglu"
  prologue = "lhs_activation" in options
  m, n, num_local = (233, 264 if gated else 132, 3) if group_type == "m" else (
      261, 264 if gated else 132, 3)
  sizes = [70, 0, 41, 100] if group_type == "m" else [130, 0, 41, 100]
  transpose_lhs, transpose_rhs = (options.get("transpose_lhs", False),
                                  options.get("transpose_rhs", False))
  lhs, rhs, bias = make_operands(group_type, m=m, k=2 * k if prologue else k, n=n,
                                 num_local=num_local, transpose_lhs=transpose_lhs,
                                 transpose_rhs=transpose_rhs, with_bias=True, seed=23)
  if prologue:  # w's K is z's half
    rhs = rhs[:, :k] if not transpose_rhs else rhs[..., :k]
  counts = jnp.asarray(sizes, jnp.int32)

  def run(implementation, lhs, rhs):
    extra = dict(num_groups=num_local) if group_type == "k" else {}
    return gmm_jax.gmm(lhs, rhs, counts, group_type=group_type, group_offset=1,
                       bias=None if prologue else bias, **extra, implementation=implementation,
                       interpret=implementation == "pallas_tpu",
                       tiling=tiling if implementation == "pallas_tpu" else None,
                       preferred_element_type=jnp.float32, **options)

  got = jax.jit(functools.partial(run, "pallas_tpu"))(lhs, rhs)
  want = run("reference", lhs, rhs)
  # A gated output is a product of two sums: each one's rounding times the other (~|z|).
  scale = 16.0 if gated else 4.0
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(jnp.float32, k=k, scale=scale))
  if group_type == "m" and not prologue:  # the backward's dlhs (m) and drhs (k) gmms too
    loss = lambda impl, l, r: jnp.sum(run(impl, l, r) ** 2)  # noqa: E731
    got = jax.jit(jax.grad(functools.partial(loss, "pallas_tpu"), argnums=(0, 1)))(lhs, rhs)
    want = jax.grad(functools.partial(loss, "reference"), argnums=(0, 1))(lhs, rhs)
    for a, b in zip(got, want):  # f32 sums of other orders, relative to the largest entry
      np.testing.assert_allclose(f64(a), f64(b), rtol=1e-4,
                                 atol=1e-4 * float(np.max(np.abs(f64(b)))))
