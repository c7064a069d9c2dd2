"""Tests of the public API around gmm: ragged_dot, GroupedArray, grouped_desc, tile
metadata, check_group_list and every input error. Numbers are checked against the numpy
oracle (and jax.lax.ragged_dot for the drop-in)."""

from __future__ import annotations

import dataclasses
import math

import gmm_jax
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.backends import registry
from gmm_test_base import group_sizes
from jax.experimental import checkify
from oracle import f64, gmm_oracle, local_rows, tolerances

M, K, N, G = 16, 12, 4, 3
SIZES = [4, 0, 7]  # sum 11: an empty group and rows past the total


def _operands(lhs_dtype=jnp.float32, rhs_dtype=None, seed=0):
  rng = np.random.default_rng(seed)
  rhs_dtype = lhs_dtype if rhs_dtype is None else rhs_dtype

  def sample(shape, dtype):
    if jnp.issubdtype(dtype, jnp.integer):
      return jnp.asarray(rng.integers(-8, 9, size=shape), dtype)
    return jnp.asarray(rng.standard_normal(shape), dtype)

  return sample((M, K), lhs_dtype), sample((G, K, N), rhs_dtype)


# ------------------------------------------------------------------------------ ragged_dot


@pytest.mark.parametrize("dtype, preferred", [
    pytest.param(jnp.float32, None, id="f32"),
    pytest.param(jnp.bfloat16, None, id="bf16"),
    pytest.param(jnp.bfloat16, jnp.float32, id="bf16_to_f32"),
    pytest.param(jnp.int8, jnp.int32, id="int8_to_int32"),
])
def test_ragged_dot_matches_lax(dtype, preferred):
  lhs, rhs = _operands(dtype, seed=1)
  sizes = jnp.asarray(SIZES, jnp.int32)
  got = gmm_jax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred)
  want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=preferred)
  assert got.dtype == want.dtype and got.shape == want.shape
  expected = gmm_oracle(lhs, rhs, SIZES, "m")
  if jnp.issubdtype(got.dtype, jnp.integer):
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    np.testing.assert_array_equal(np.asarray(got), expected.astype(np.int64))
  else:
    tol = tolerances(dtype, got.dtype, k=K)
    np.testing.assert_allclose(f64(got), f64(want), **tol)
    np.testing.assert_allclose(f64(got), expected, **tol)
  assert np.all(f64(got)[sum(SIZES):] == 0)


def test_ragged_dot_traced_sizes_match_lax():
  lhs, rhs = _operands(seed=2)
  ours = jax.jit(gmm_jax.ragged_dot)
  for sizes in ([4, 0, 7], [0, 16, 0], [1, 2, 3]):
    sizes = jnp.asarray(sizes, jnp.int32)
    np.testing.assert_allclose(ours(lhs, rhs, sizes), jax.lax.ragged_dot(lhs, rhs, sizes),
                               **tolerances(jnp.float32, k=K))


def test_ragged_dot_group_offset_array():
  # rhs holds groups [1, 3) of 3 (a [1] offset array, as in ragged_dot_general).
  lhs, rhs = _operands(seed=3)
  sizes = [4, 5, 7]
  got = gmm_jax.ragged_dot(lhs, rhs[:2], jnp.asarray(sizes, jnp.int32),
                           group_offset=jnp.array([1], jnp.int32))
  expected = gmm_oracle(lhs, rhs[:2], sizes, "m", group_offset=1)
  np.testing.assert_allclose(got, expected, **tolerances(jnp.float32, k=K))
  assert np.all(np.asarray(got)[:4] == 0) and np.all(np.asarray(got)[16:] == 0)


def test_ragged_dot_zero_groups_matches_lax():
  # jax.lax.ragged_dot accepts G = 0 and returns zeros.
  lhs = jnp.ones((4, 3), jnp.float32)
  rhs = jnp.ones((0, 3, 2), jnp.float32)
  sizes = jnp.zeros((0,), jnp.int32)
  want = jax.lax.ragged_dot(lhs, rhs, sizes)
  np.testing.assert_array_equal(gmm_jax.ragged_dot(lhs, rhs, sizes), want)


def test_platform_chains():
  cfg = gmm_jax.GmmConfig(group_type="m", num_local=1)
  assert registry.candidates(cfg, "cpu") == ("xla", "reference")
  assert registry.candidates(cfg, "gpu") == ("pallas_mosaic_gpu", "pallas_triton", "xla")
  assert registry.candidates(cfg, "tpu") == ("pallas_tpu", "lax_ragged_dot", "xla")
  assert registry.candidates(cfg.replace(implementation="reference"), "tpu") == ("reference",)


def test_tiling_is_passed_to_the_backend(monkeypatch):
  seen = []
  original = registry._REGISTRY["xla"]
  monkeypatch.setitem(registry._REGISTRY, "xla", dataclasses.replace(
      original, fn=lambda *args: seen.append(args[-1].tiling) or original.fn(*args)))
  lhs, rhs = _operands(seed=5)
  tiling = gmm_jax.Tiling(tile_m=8, tile_k=8, tile_n=8)
  out = gmm_jax.gmm(lhs, rhs, np.asarray(SIZES, np.int32), implementation="xla", tiling=tiling)
  np.testing.assert_allclose(out, gmm_oracle(lhs, rhs, SIZES, "m"),
                             **tolerances(jnp.float32, k=K))
  assert seen == [tiling]


def test_default_implementation_and_registry():
  assert {"xla", "reference"} <= set(gmm_jax.implementations())
  lhs, rhs = _operands(seed=4)
  sizes = np.asarray(SIZES, np.int32)
  expected = gmm_oracle(lhs, rhs, SIZES, "m")
  for implementation in (None, "auto"):
    out = gmm_jax.gmm(lhs, rhs, sizes, implementation=implementation)
    np.testing.assert_allclose(out, expected, **tolerances(jnp.float32, k=K))


@pytest.mark.parametrize("list_dtype", [np.int64, np.int16, np.uint8])
def test_group_list_integer_dtypes(list_dtype):
  lhs, rhs = _operands(seed=10)
  out = gmm_jax.gmm(lhs, rhs, np.asarray(SIZES, list_dtype))
  np.testing.assert_allclose(out, gmm_oracle(lhs, rhs, SIZES, "m"),
                             **tolerances(jnp.float32, k=K))


# ---------------------------------------------------------------------------- GroupedArray


def test_grouped_array_pytree_round_trip_through_jit():
  values = jnp.arange(M * K, dtype=jnp.float32).reshape(M, K)
  offsets = jnp.asarray([3, 3, 9], jnp.int32)
  grouped = gmm_jax.GroupedArray(values, offsets, variable_dim=1)
  leaves, treedef = jax.tree_util.tree_flatten(grouped)
  assert len(leaves) == 2
  other_dim = jax.tree_util.tree_structure(gmm_jax.GroupedArray(values, offsets, 0))
  assert treedef != other_dim  # variable_dim is static (part of the treedef)

  out = jax.jit(lambda g: gmm_jax.GroupedArray(g.values * 2, g.offsets + 1, g.variable_dim))(
      grouped)
  assert isinstance(out, gmm_jax.GroupedArray) and out.variable_dim == 1
  np.testing.assert_array_equal(out.values, values * 2)
  np.testing.assert_array_equal(out.offsets, [4, 4, 10])
  same = jax.jit(lambda g: g)(grouped)
  assert jax.tree_util.tree_structure(same) == treedef
  np.testing.assert_array_equal(same.values, values)
  np.testing.assert_array_equal(same.offsets, offsets)


@pytest.mark.parametrize("variable_dim", [0, 1])
def test_grouped_array_from_list_to_list_with_empty_groups(variable_dim):
  rng = np.random.default_rng(5)
  sizes = [0, 3, 0, 2, 0]  # empty first, middle and last groups
  shapes = [(s, K) if variable_dim == 0 else (K, s) for s in sizes]
  arrays = [rng.standard_normal(shape).astype(np.float32) for shape in shapes]
  grouped = gmm_jax.GroupedArray.from_list(arrays, variable_dim=variable_dim)
  assert grouped.variable_dim == variable_dim
  assert grouped.num_groups == 5
  assert grouped.shape == ((5, K) if variable_dim == 0 else (K, 5))
  assert grouped.dtype == jnp.float32
  np.testing.assert_array_equal(grouped.offsets, [0, 3, 3, 5, 5])
  np.testing.assert_array_equal(grouped.group_sizes, sizes)
  back = grouped.to_list()
  assert len(back) == 5
  for original, piece in zip(arrays, back):
    assert piece.shape == original.shape
    np.testing.assert_array_equal(piece, original)


def test_gmm_grouped_array_lhs_m_grouping():
  lhs, rhs = _operands(seed=6)
  offsets = jnp.asarray(np.cumsum(SIZES), jnp.int32)
  out = gmm_jax.gmm(gmm_jax.GroupedArray(lhs, offsets, 0), rhs, activation="relu")
  assert isinstance(out, gmm_jax.GroupedArray) and out.variable_dim == 0
  np.testing.assert_array_equal(out.offsets, offsets)
  expected = gmm_oracle(lhs, rhs, SIZES, "m", activation="relu")
  np.testing.assert_allclose(out.values, expected, **tolerances(jnp.float32, k=K))
  assert np.all(np.asarray(out.values)[sum(SIZES):] == 0)


def test_gmm_grouped_array_lhs_under_jit():
  lhs, rhs = _operands(seed=9)
  sizes = [0, 9, 5]
  grouped = gmm_jax.GroupedArray(lhs, jnp.asarray(np.cumsum(sizes), jnp.int32), 0)
  out = jax.jit(gmm_jax.gmm)(grouped, rhs)
  assert isinstance(out, gmm_jax.GroupedArray) and out.variable_dim == 0
  np.testing.assert_array_equal(out.offsets, np.cumsum(sizes))
  np.testing.assert_allclose(out.values, gmm_oracle(lhs, rhs, sizes, "m"),
                             **tolerances(jnp.float32, k=K))


def test_gmm_grouped_array_lhs_k_grouping():
  lhs, rhs = _operands(seed=7)
  rhs_k = rhs[0]  # [K, N]
  sizes = [5, 0, 4]
  grouped = gmm_jax.GroupedArray(lhs, jnp.asarray(np.cumsum(sizes), jnp.int32), 1)
  out = gmm_jax.gmm(grouped, rhs_k)
  assert not isinstance(out, gmm_jax.GroupedArray) and out.shape == (3, M, N)
  np.testing.assert_allclose(out, gmm_oracle(lhs, rhs_k, sizes, "k"),
                             **tolerances(jnp.float32, k=K))
  assert np.all(np.asarray(out)[1] == 0)


@pytest.mark.parametrize("make, match", [
    pytest.param(lambda: gmm_jax.GroupedArray(jnp.ones((4, 3)), jnp.array([4]), 2),
                 "variable_dim must be 0 or 1, got 2", id="variable_dim"),
    pytest.param(lambda: gmm_jax.GroupedArray(jnp.ones((2, 4, 3)), jnp.array([4]), 0),
                 r"2-D, got shape \(2, 4, 3\)", id="values_rank"),
    pytest.param(lambda: gmm_jax.GroupedArray(jnp.ones((4, 3)), jnp.array([[4]]), 0),
                 r"1-D \[num_groups\], got \(1, 1\)", id="offsets_rank"),
    pytest.param(lambda: gmm_jax.GroupedArray(jnp.ones((4, 3)), jnp.array([4.0]), 0),
                 "integer, got float32", id="float_offsets"),
    pytest.param(lambda: gmm_jax.GroupedArray.from_list([]), "at least one", id="empty_list"),
    pytest.param(lambda: gmm_jax.GroupedArray.from_list([np.ones((2, 3)), np.ones((2, 4))]),
                 r"agreeing on dim 1, got shapes \[\(2, 3\), \(2, 4\)\]", id="ragged_list"),
])
def test_grouped_array_errors(make, match):
  with pytest.raises(ValueError, match=match):
    make()


# ----------------------------------------------------------------------------- grouped_desc


@pytest.mark.parametrize("dtype, values_bytes", [
    (jnp.float32, 10240000), (jnp.bfloat16, 5120000), (jnp.int8, 2560000)])
def test_grouped_desc_sizes(dtype, values_bytes):
  desc = gmm_jax.grouped_desc((5000, 512), dtype, variable_dim_idx=0, num_groups=8)
  assert isinstance(desc, gmm_jax.GroupedDesc)
  assert desc.dims == (5000, 512) and desc.variable_dim_idx == 0 and desc.num_groups == 8
  assert desc.dtype == np.dtype(dtype)
  assert desc.size(0) == values_bytes
  assert desc.size(1) == 32


def test_grouped_desc_variable_dim_1_and_bad_buffer():
  desc = gmm_jax.grouped_desc((64, 3000), jnp.float16, variable_dim_idx=1, num_groups=5)
  assert desc.size(0) == 64 * 3000 * 2 and desc.size(1) == 20
  with pytest.raises(ValueError, match="buffers 0 and 1, got 2"):
    desc.size(2)


@pytest.mark.parametrize("dims, variable_dim_idx, num_groups, match", [
    ((5000,), 0, 8, r"2-D only, got dims \(5000,\)"),
    ((5000, 512, 2), 0, 8, r"2-D only, got dims \(5000, 512, 2\)"),
    ((5000, -1), 0, 8, r"non-negative ints, got \(5000, -1\)"),
    ((5000, 2.5), 0, 8, r"non-negative ints, got \(5000, 2.5\)"),
    ((5000, 512), 0, 0, "num_groups must be a positive int, got 0"),
    ((5000, 512), 2, 8, "variable_dim_idx must be 0 or 1, got 2"),
    ((5000, 512), -1, 8, "variable_dim_idx must be 0 or 1, got -1"),
])
def test_grouped_desc_invalid(dims, variable_dim_idx, num_groups, match):
  with pytest.raises(ValueError, match=match):
    gmm_jax.grouped_desc(dims, jnp.float32, variable_dim_idx, num_groups)


# ---------------------------------------------------------------------------- tile metadata


@st.composite
def tile_problems(draw):
  dim = draw(st.integers(1, 64))
  num_groups = draw(st.integers(1, 8))
  return dict(
      dim=dim,
      tile=draw(st.integers(1, 24)),
      sizes=draw(group_sizes(num_groups, dim)),
      num_local=draw(st.integers(1, num_groups)),
      offset=draw(st.integers(0, num_groups)),
  )


def check_tile_metadata(meta, dim, tile, sizes, offset, num_local, align="tile", cover=False):
  """The documented properties of the work items of `make_tile_metadata`."""
  bounds = np.asarray(meta.bounds)
  np.testing.assert_array_equal(bounds, np.concatenate([[0], np.cumsum(sizes)]))
  num_items = int(meta.num_items)
  num_tiles = math.ceil(dim / tile)
  bound = num_tiles + num_local - 1 if align == "tile" else num_tiles + num_local
  assert num_items <= bound, (num_items, num_tiles, num_local)
  starts, ends = np.asarray(meta.item_start), np.asarray(meta.item_end)
  group_ids, tile_ids = np.asarray(meta.group_ids), np.asarray(meta.tile_ids)
  assert len(starts) >= num_items
  coverage = np.zeros(dim, int)
  # Items run in local-group order (kernels detect a group's first and last item).
  assert np.all(np.diff(group_ids[:num_items]) >= 0), group_ids[:num_items]
  if cover:  # every local group has an item; an empty one exactly one, of zero rows
    held_sizes = [sizes[offset + g] if offset + g < len(sizes) else 0
                  for g in range(num_local)]
    for g in range(num_local):
      mine = np.flatnonzero(group_ids[:num_items] == g)
      assert len(mine) >= 1, (g, group_ids[:num_items])
      if held_sizes[g] == 0:
        assert len(mine) == 1 and starts[mine[0]] == ends[mine[0]], (g, mine)
        assert 0 <= tile_ids[mine[0]] < max(1, num_tiles)
  for item in range(num_items):
    start, end = int(starts[item]), int(ends[item])
    if cover and start == end:
      continue
    assert 0 <= start < end <= dim, (item, start, end)
    assert tile_ids[item] == start // tile, (item, start, tile_ids[item])
    # Within one local group.
    local = int(group_ids[item])
    assert 0 <= local < num_local
    group = offset + local
    assert group < len(sizes) and bounds[group] <= start and end <= bounds[group + 1]
    if align == "tile":  # within one tile
      assert start // tile == (end - 1) // tile, (item, start, end)
    else:  # windows of `tile` rows from the group's first row; only the last is partial
      assert (start - bounds[group]) % tile == 0, (item, start, bounds[group])
      assert end - start == tile or end == bounds[group + 1], (item, start, end)
    coverage[start:end] += 1
  # Every row of every local group exactly once; rows of other groups (and past the
  # total) never.
  np.testing.assert_array_equal(coverage, local_rows(sizes, dim, offset, num_local))
  assert np.all(starts[num_items:] == ends[num_items:])


# Compiled (a few times faster than eager for one-off shapes); the offset is traced.
_jit_tile_metadata = jax.jit(gmm_jax.make_tile_metadata,
                             static_argnames=("dim_size", "tile", "num_local", "align", "cover"))


# Each drawn shape compiles make_tile_metadata anew (~1 s): 8 examples per alignment in the
# default run, 100 in the slow twin below.
TILE_EXAMPLES, TILE_EXAMPLES_SLOW = 8, 100


@pytest.mark.parametrize("align, cover", [("tile", False), ("group", False), ("tile", True)])
@hypothesis.settings(max_examples=TILE_EXAMPLES)
@hypothesis.given(problem=tile_problems())
def test_tile_metadata_properties(align, cover, problem):
  _check_tile_problem(align, cover, problem)


@pytest.mark.slow
@pytest.mark.parametrize("align, cover", [("tile", False), ("group", False), ("tile", True)])
@hypothesis.settings(max_examples=TILE_EXAMPLES_SLOW)
@hypothesis.given(problem=tile_problems())
def test_tile_metadata_properties_slow(align, cover, problem):
  _check_tile_problem(align, cover, problem)


def _check_tile_problem(align, cover, problem):
  meta = _jit_tile_metadata(
      jnp.asarray(problem["sizes"], jnp.int32), dim_size=problem["dim"], tile=problem["tile"],
      group_offset=jnp.int32(problem["offset"]), num_local=problem["num_local"], align=align,
      cover=cover)
  check_tile_metadata(meta, problem["dim"], problem["tile"], problem["sizes"],
                      problem["offset"], problem["num_local"], align, cover)


def test_tile_metadata_cover_gives_empty_groups_one_item():
  # Local groups 1..3 of [4, 0, 6, 0] plus one past the list (offset 1, 4 local groups).
  meta = gmm_jax.make_tile_metadata(jnp.asarray([4, 0, 6, 0], jnp.int32), 12, 4,
                                    group_offset=1, num_local=4, cover=True)
  n = int(meta.num_items)
  np.testing.assert_array_equal(np.asarray(meta.group_ids)[:n], [0, 1, 1, 2, 3])
  np.testing.assert_array_equal(np.asarray(meta.item_start)[:n], [4, 4, 8, 10, 12])
  np.testing.assert_array_equal(np.asarray(meta.item_end)[:n], [4, 8, 10, 10, 12])
  np.testing.assert_array_equal(np.asarray(meta.tile_ids)[:n], [1, 1, 2, 2, 2])


def test_tile_metadata_default_is_tile_aligned():
  counts = jnp.asarray([5, 0, 6], jnp.int32)
  default = gmm_jax.make_tile_metadata(counts, 16, 4)
  tile_aligned = gmm_jax.make_tile_metadata(counts, 16, 4, align="tile")
  for got, want in zip(default, tile_aligned):
    np.testing.assert_array_equal(got, want)
  # Group 2 covers rows [5, 11): tile-aligned items [5, 8) and [8, 11).
  assert int(default.num_items) == 4
  np.testing.assert_array_equal(np.asarray(default.item_start)[:4], [0, 4, 5, 8])
  np.testing.assert_array_equal(np.asarray(default.item_end)[:4], [4, 5, 8, 11])


@pytest.mark.parametrize("align", ["tile", "group"])
def test_tile_metadata_traced_counts_and_offset(align):
  dim, tile, num_local = 40, 8, 3
  build = jax.jit(lambda counts, offset: gmm_jax.make_tile_metadata(
      counts, dim, tile, group_offset=offset, num_local=num_local, align=align))
  for sizes, offset in (([3, 9, 0, 14, 5], 1), ([0, 0, 17, 2, 21], 2), ([8, 8, 8, 8, 8], 0)):
    meta = build(jnp.asarray(sizes, jnp.int32), jnp.int32(offset))
    assert isinstance(meta, gmm_jax.TileMetadata)
    check_tile_metadata(meta, dim, tile, sizes, offset, num_local, align)


@pytest.mark.parametrize("num_local", [None, 0])
def test_tile_metadata_zero_groups(num_local):
  meta = gmm_jax.make_tile_metadata(jnp.zeros((0,), jnp.int32), 8, 4, num_local=num_local)
  check_tile_metadata(meta, 8, 4, [], 0, 0)
  assert int(meta.num_items) == 0


def test_tile_metadata_rejects_bad_arguments():
  with pytest.raises(ValueError, match="tile must be positive, got 0"):
    gmm_jax.make_tile_metadata(jnp.asarray([1, 2], jnp.int32), 8, 0)
  with pytest.raises(ValueError, match="align must be one of .*got 'rows'"):
    gmm_jax.make_tile_metadata(jnp.asarray([1, 2], jnp.int32), 8, 4, align="rows")


# ----------------------------------------------------------------------------------- errors

_LHS, _RHS = _operands(seed=8)
_RHS_K = _RHS[0]
_COUNTS = np.asarray(SIZES, np.int32)


def _gmm(lhs=_LHS, rhs=_RHS, group_list=_COUNTS, **kwargs):
  return lambda: gmm_jax.gmm(lhs, rhs, group_list, **kwargs)


_ERRORS = [
    ("lhs_rank", _gmm(lhs=_LHS[None]), r"2-D lhs and a 3-D rhs, got lhs float32\[1,16,12\]"),
    ("rhs_rank_m", _gmm(rhs=_RHS_K), r"3-D rhs, got lhs float32\[16,12\] and rhs float32\[12,4\]"),
    ("rhs_rank_k", _gmm(group_type="k"), r"2-D rhs, .* rhs float32\[3,12,4\]"),
    ("k_mismatch", _gmm(rhs=_RHS[:, :10]), r"lhs \(16, 12\) .* K=12, rhs \(3, 10, 4\) .* K=10"),
    ("k_mismatch_transposed", _gmm(lhs=_LHS.T, transpose_lhs=True, transpose_rhs=True),
     r"K=12, rhs \(3, 12, 4\) \(transpose_rhs=True\) has K=4"),
    ("k_mismatch_k_grouping", _gmm(rhs=_RHS_K[:11], group_type="k"), "K=12.*K=11"),
    ("bias_shape", _gmm(bias=jnp.ones((G, N + 1))), r"\(3, 4\), got \(3, 5\)"),
    ("bias_shape_k", _gmm(rhs=_RHS_K, group_type="k", bias=jnp.ones((G + 1, N))),
     r"\(3, 4\), got \(4, 4\)"),
    ("group_type", _gmm(group_type="x"), r"group_type must be one of .*got 'x'"),
    ("group_list_type", _gmm(group_list_type="dense"), "got 'dense'"),
    ("activation_name", _gmm(activation="swish"), "unknown activation 'swish'"),
    ("activation_type", _gmm(activation=3), "got 3"),
    ("negative_counts", _gmm(group_list=np.array([5, -1, 2], np.int32)), r"\[5, -1, 2\]"),
    ("negative_cumsum", _gmm(group_list=np.array([-1, 3, 8], np.int32),
                             group_list_type="cumsum"), r"\[-1, 3, 8\]"),
    ("decreasing_cumsum", _gmm(group_list=np.array([5, 3, 8], np.int32),
                               group_list_type="cumsum"), r"non-decreasing, got \[5, 3, 8\]"),
    ("sum_past_m_counts", _gmm(group_list=np.array([10, 4, 3], np.int32)),
     r"sum to 17, past M=16"),
    ("sum_past_m_cumsum", _gmm(group_list=np.array([4, 8, 17], np.int32),
                               group_list_type="cumsum"), r"sum to 17, past M=16"),
    ("sum_past_m_sparse", _gmm(group_list=np.array([[0, 10], [2, 7]], np.int32),
                               group_list_type="sparse"), r"sum to 17, past M=16"),
    ("sum_past_k", _gmm(rhs=_RHS_K, group_type="k", group_list=np.array([5, 5, 3], np.int32)),
     r"sum to 13, past K=12"),
    ("sum_past_k_sparse", _gmm(rhs=_RHS_K, group_type="k", group_list_type="sparse",
                               group_list=np.array([[1, 13]], np.int32), num_groups=3),
     r"sum to 13, past K=12"),
    ("sparse_decreasing", _gmm(group_list=np.array([[2, 3], [1, 4]], np.int32),
                               group_list_type="sparse"), r"increasing .*\[\[2, 3\], \[1, 4\]\]"),
    ("sparse_duplicate", _gmm(group_list=np.array([[1, 3], [1, 4]], np.int32),
                              group_list_type="sparse"), r"increasing .*\[\[1, 3\], \[1, 4\]\]"),
    ("sparse_index_past_g", _gmm(group_list=np.array([[0, 3], [3, 4]], np.int32),
                                 group_list_type="sparse"), r"\[0, 3\), got \[0, 3\]"),
    ("sparse_negative_index", _gmm(group_list=np.array([[-1, 3]], np.int32),
                                   group_list_type="sparse"), r"\[0, 3\), got \[-1\]"),
    ("sparse_negative_size", _gmm(group_list=np.array([[0, -2]], np.int32),
                                  group_list_type="sparse"), r"non-negative, got \[\[0, -2\]\]"),
    ("sparse_k_without_num_groups", _gmm(rhs=_RHS_K, group_type="k", group_list_type="sparse",
                                         group_list=np.array([[0, 3]], np.int32)),
     "num_groups is required"),
    ("sparse_offset_without_num_groups", _gmm(rhs=_RHS[:2], group_list_type="sparse",
                                              group_list=np.array([[0, 3]], np.int32),
                                              group_offset=1), "num_groups is required"),
    ("sparse_shape", _gmm(group_list=np.zeros((2, 3), np.int32), group_list_type="sparse"),
     r"\[E, 2\] .*got \(2, 3\)"),
    ("counts_shape", _gmm(group_list=np.zeros((3, 1), np.int32)), r"\[G\], got \(3, 1\)"),
    ("rhs_groups_vs_list", _gmm(rhs=_RHS[:2]), r"rhs \(2, 12, 4\) holds 2 groups .* has 3"),
    ("rhs_more_groups_than_list", _gmm(group_list=_COUNTS[:2], group_offset=0),
     r"rhs \(3, 12, 4\) holds more groups than the group list \(2\)"),
    ("num_groups_vs_list_m", _gmm(num_groups=4), "num_groups=4 differs from the group_list "
     "length 3"),
    ("num_groups_past_list_k", _gmm(rhs=_RHS_K, group_type="k", num_groups=5),
     "num_groups=5 exceeds the group list length 3"),
    ("float_group_list", _gmm(group_list=np.array([4.0, 0.0, 7.0], np.float32)),
     "integer array, got dtype float32"),
    ("no_group_list", _gmm(group_list=None), "needs a group_list"),
    ("implementation", _gmm(implementation="triton"), r"unknown implementation 'triton'.*xla"),
    ("tiling_type", _gmm(tiling=(128, 128, 128)), r"tiling must be None, a gmm_jax.Tiling.*\(128, 128"),
    ("group_offset_past_g", _gmm(rhs=_RHS[:2], group_offset=4), r"\[0, 3\], got 4"),
    ("group_offset_negative", _gmm(rhs=_RHS[:2], group_offset=-1), r"\[0, 3\], got -1"),
    ("group_offset_float", _gmm(rhs=_RHS[:2], group_offset=1.5), "integer scalar, got 1.5"),
    ("bool_lhs", _gmm(lhs=_LHS > 0), r"lhs must be a floating or integer array, got bool"),
    ("preferred_element_type", _gmm(preferred_element_type="not_a_dtype"), "not_a_dtype"),
    ("grouped_array_and_list", _gmm(lhs=gmm_jax.GroupedArray(_LHS, jnp.asarray([4, 4, 11]))),
     "either a GroupedArray lhs or a group_list"),
    ("grouped_array_transposed", _gmm(lhs=gmm_jax.GroupedArray(_LHS, jnp.asarray([4, 4, 11])),
                                      group_list=None, transpose_lhs=True),
     "transpose_lhs must be False"),
    ("grouped_array_group_type", _gmm(lhs=gmm_jax.GroupedArray(_LHS, jnp.asarray([4, 4, 11])),
                                      group_list=None, group_type="k"),
     "variable_dim=0 means group_type='m', got 'k'"),
]


@pytest.mark.parametrize("call, match", [pytest.param(c, m, id=i) for i, c, m in _ERRORS])
def test_value_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call()


@pytest.mark.parametrize("group_list_type, bad", [
    ("counts", [5, -3, 2]),  # negative
    ("counts", [10, 4, 3]),  # past M
    ("cumsum", [5, 3, 8]),  # decreasing
])
def test_traced_bad_list_raises_no_error(group_list_type, bad):
  # A traced list is never synced to the host for validation (see check_group_list).
  out = jax.jit(lambda gl: gmm_jax.gmm(_LHS, _RHS, gl, group_list_type=group_list_type))(
      jnp.asarray(bad, jnp.int32))
  assert out.shape == (M, N) and out.dtype == jnp.float32


# ------------------------------------------------------------------ check_group_list


def _checked(group_list_type, num_groups=None):
  return jax.jit(checkify.checkify(
      lambda gl: gmm_jax.check_group_list(gl, group_list_type, dim_size=M,
                                          num_groups=num_groups)))


@pytest.mark.parametrize("group_list_type, good, bad, match", [
    pytest.param("counts", [4, 0, 7], [4, -1, 7], "non-negative", id="counts_negative"),
    pytest.param("counts", [4, 0, 12], [10, 4, 3], "sum to 17, past the grouped dimension 16",
                 id="counts_past_dim"),
    pytest.param("cumsum", [4, 4, 11], [4, 3, 11], "non-decreasing", id="cumsum_decreasing"),
    pytest.param("cumsum", [0, 4, 16], [4, 8, 17], "sum to 17", id="cumsum_past_dim"),
    pytest.param("sparse", [[0, 4], [2, 7]], [[2, 4], [0, 7]], "increasing",
                 id="sparse_decreasing"),
    pytest.param("sparse", [[0, 4], [1, 0], [2, 7]], [[0, 4], [2, -1]], "non-negative",
                 id="sparse_negative"),
])
def test_check_group_list_checkify(group_list_type, good, bad, match):
  checked = _checked(group_list_type)
  error, _ = checked(jnp.asarray(good, jnp.int32))
  assert error.get() is None, error.get()
  error, _ = checked(jnp.asarray(bad, jnp.int32))
  assert error.get() is not None and match in error.get(), error.get()
  with pytest.raises(checkify.JaxRuntimeError, match=match):
    error.throw()


def test_check_group_list_sparse_index_range():
  checked = _checked("sparse", num_groups=G)
  error, _ = checked(jnp.asarray([[0, 4], [2, 7]], jnp.int32))
  assert error.get() is None
  error, _ = checked(jnp.asarray([[0, 4], [3, 7]], jnp.int32))
  assert error.get() is not None and "[0, 3)" in error.get()


def test_check_group_list_with_gmm_under_checkify():
  # The docstring's recipe: the check and the gmm in one checkified, jitted function.
  @jax.jit
  @checkify.checkify
  def checked_gmm(group_list):
    gmm_jax.check_group_list(group_list, "counts", M)
    return gmm_jax.gmm(_LHS, _RHS, group_list)

  error, out = checked_gmm(jnp.asarray(SIZES, jnp.int32))
  assert error.get() is None
  np.testing.assert_allclose(out, gmm_oracle(_LHS, _RHS, SIZES, "m"),
                             **tolerances(jnp.float32, k=K))
  error, _ = checked_gmm(jnp.asarray([9, 9, 0], jnp.int32))
  assert error.get() is not None and "past the grouped dimension" in error.get()


def test_python_list_group_list_is_accepted():
  lhs = np.arange(12, dtype=np.float32).reshape(6, 2)
  rhs = np.ones((2, 2, 3), np.float32)
  got = gmm_jax.gmm(lhs, rhs, [2, 3])
  want = gmm_jax.gmm(lhs, rhs, np.asarray([2, 3], np.int32))
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  with pytest.raises(ValueError, match="past M=6"):
    gmm_jax.gmm(lhs, rhs, [4, 3])


@pytest.mark.parametrize("skip", [1, 8])
def test_tile_metadata_skip_leaves_the_first_rows_of_each_group(skip):
  sizes, dim, tile = [0, 3, 20, 8, 9, 0, 1], 48, 4
  meta = gmm_jax.make_tile_metadata(jnp.asarray(sizes, jnp.int32), dim, tile, align="group",
                                    skip=skip)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  want = np.zeros(dim, int)
  for g in range(len(sizes)):
    want[min(bounds[g] + skip, bounds[g + 1]):bounds[g + 1]] = 1
  got = np.zeros(dim, int)
  for item in range(int(meta.num_items)):
    start, end = int(meta.item_start[item]), int(meta.item_end[item])
    group = int(meta.group_ids[item])
    assert bounds[group] + skip <= start < end <= bounds[group + 1]
    assert (start - bounds[group] - skip) % tile == 0
    got[start:end] += 1
  np.testing.assert_array_equal(got, want)
  with pytest.raises(ValueError, match="skip"):
    gmm_jax.make_tile_metadata(jnp.asarray(sizes, jnp.int32), dim, tile, skip=2)


def test_xla_head_capacity_engages_for_small_16bit_groups():
  # The 16-bit small-group tests of the shared base rely on this pass being active.
  from gmm_jax._src.backends.xla import head_capacity
  assert head_capacity(96, 8, 256, jnp.bfloat16) == 16
  assert head_capacity(2048, 64, 256, jnp.float16) == 32
  assert head_capacity(2048, 64, 256, jnp.float32) == 0  # f32 loops are not slowed down
  assert head_capacity(2048, 8, 256, jnp.bfloat16) == 0  # groups of a tile: loops only


def test_explain_for_another_platform_from_the_cpu():
  # The kernels of another platform cannot be lowered for the CPU: explain lowers for the
  # platform asked (and still reports the choice where this jax cannot lower it deviceless).
  lhs = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  assert "on tpu: pallas_tpu" in gmm_jax.explain(lhs, rhs, sizes, platform="tpu")
  text = gmm_jax.explain(lhs, rhs, sizes, activation="swiglu", platform="gpu")
  assert "on gpu: pallas_" in text, text


@pytest.mark.parametrize("float_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("int_side", ["lhs", "rhs"])
@pytest.mark.parametrize("narrow", [jnp.int8, jnp.float8_e4m3fn])
def test_float_with_plain_integer_operand_is_multiplied_in_the_float_dtype(float_dtype,
                                                                           int_side, narrow):
  """As jax.lax.ragged_dot promotes them: the integer operand's values in the float's dtype
  (exact for int8), the result in that dtype; the float side's gradient flows."""
  rng = np.random.default_rng(5)
  sizes = np.array([3, 0, 4], np.int32)
  x = rng.standard_normal((7, 6)).astype(np.float32)
  w = rng.standard_normal((3, 6, 5)).astype(np.float32)
  # MaxText's fp8 backward passes plain float8 values beside float32 ones, as its int8
  # backward passes plain int8 ones; jax has no implicit float32 x float8 promotion.
  xi = jnp.asarray(rng.integers(-128, 128, (7, 6)), narrow)
  wi = jnp.asarray(rng.integers(-128, 128, (3, 6, 5)), narrow)
  lhs, rhs = (xi, jnp.asarray(w, float_dtype)) if int_side == "lhs" else (
      jnp.asarray(x, float_dtype), wi)
  got = jax.jit(lambda a, b: gmm_jax.gmm(a, b, sizes))(lhs, rhs)
  assert got.dtype == float_dtype
  wide = lambda a: a.astype(float_dtype)  # noqa: E731  (jax's promotion, made explicit)
  want = jax.lax.ragged_dot(wide(lhs), wide(rhs), sizes)
  assert want.dtype == got.dtype
  np.testing.assert_allclose(np.asarray(got, np.float64),
                             gmm_oracle(np.asarray(lhs, np.float64), np.asarray(rhs, np.float64),
                                        sizes, "m"), **tolerances(float_dtype, k=6, scale=128.0))
  float_arg = 1 if int_side == "lhs" else 0
  grad = jax.grad(lambda *a: gmm_jax.gmm(*a, sizes).astype(jnp.float32).sum(),
                  argnums=float_arg)(lhs, rhs)
  want_grad = jax.grad(lambda *a: jax.lax.ragged_dot(*map(wide, a), sizes).astype(
      jnp.float32).sum(), argnums=float_arg)(lhs, rhs)
  np.testing.assert_allclose(np.asarray(grad, np.float64), np.asarray(want_grad, np.float64),
                             **tolerances(float_dtype, k=7, scale=128.0))
