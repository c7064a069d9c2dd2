"""Group-aligned work items whose windows start at multiples of a row granule
(`metadata.make_tile_metadata(align="group", granule=...)`, the Mosaic GPU kernel's 8-row
windows), checked against the documented properties on random group sizes with empty
groups, decode-size groups and group offsets.
"""

from __future__ import annotations

import math

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_test_base import group_sizes
from oracle import local_rows

from gmm_jax._src.core import group_list, metadata

# Eager: the shapes change with every example, and op-by-op dispatch reuses the compiled
# primitives where jit would compile each new shape whole.
_build = metadata.make_tile_metadata


def _items_per_group(meta, num_local):
  n = int(meta.num_items)
  rows = np.asarray(meta.item_end)[:n] - np.asarray(meta.item_start)[:n]
  return np.bincount(np.asarray(meta.group_ids)[:n][rows > 0], minlength=num_local)


def check_granule_windows(meta, dim, tile, granule, sizes, offset, num_local, skip=0,
                          cover=False):
  """Every row of every local group (past its first `skip`) owned by exactly one item;
  windows at multiples of `granule` that hold their item; items in group order; at most the
  tile-aligned bound, and no group with more items than tile alignment gives it."""
  bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  np.testing.assert_array_equal(np.asarray(meta.bounds), bounds)
  num_items = int(meta.num_items)
  bound = metadata.max_work_items(dim, tile, num_local, "group", cover, granule)
  assert bound == math.ceil(dim / tile) + max(1, num_local if cover else
                                               min(num_local, dim)) - 1
  assert meta.item_start.shape == (bound,) and num_items <= bound, (num_items, bound)
  windows = np.asarray(metadata.window_starts(meta, tile, "group", granule))
  starts, ends = np.asarray(meta.item_start), np.asarray(meta.item_end)
  group_ids, tile_ids = np.asarray(meta.group_ids), np.asarray(meta.tile_ids)
  assert np.all(np.diff(group_ids[:num_items]) >= 0), group_ids[:num_items]
  assert np.all(windows % granule == 0), windows
  coverage = np.zeros(dim, int)
  for item in range(num_items):
    start, end, window = int(starts[item]), int(ends[item]), int(windows[item])
    local = int(group_ids[item])
    assert 0 <= local < num_local
    if cover and start == end:  # an empty local group's one item
      assert np.sum(group_ids[:num_items] == local) == 1
      continue
    group = offset + local
    assert group < len(sizes), (item, group)
    assert bounds[group] + skip <= start < end <= bounds[group + 1], (item, start, end)
    assert window <= start and end <= window + tile, (item, window, start, end)
    # Only a group's first item starts after its window, only its last ends before it.
    first = start == min(bounds[group] + skip, bounds[group + 1])
    assert first or start == window, (item, window, start)
    assert end == bounds[group + 1] or end == window + tile, (item, window, end)
    assert tile_ids[item] == start // tile
    coverage[start:end] += 1
  want = local_rows(sizes, dim, offset, num_local).astype(int)
  if skip:
    for g in range(offset, min(offset + num_local, len(sizes))):
      want[bounds[g]:min(bounds[g] + skip, bounds[g + 1])] = 0
  np.testing.assert_array_equal(coverage, want)
  assert np.all(starts[num_items:] == ends[num_items:])
  if not skip:  # never more windows per group than the tiles it touches
    tiled = _build(jnp.asarray(sizes, jnp.int32), dim_size=dim, tile=tile,
                   group_offset=jnp.int32(offset), num_local=num_local, align="tile")
    assert np.all(_items_per_group(meta, num_local) <= _items_per_group(tiled, num_local))


@st.composite
def granule_problems(draw):
  granule = draw(st.sampled_from([2, 4, 8]))
  tile = granule * draw(st.integers(1, 8))
  dim = draw(st.integers(1, 160))
  num_groups = draw(st.integers(1, 12))
  return dict(dim=dim, tile=tile, granule=granule, sizes=draw(group_sizes(num_groups, dim)),
              num_local=draw(st.integers(1, num_groups)),
              offset=draw(st.integers(0, num_groups)))


@st.composite
def decode_problems(draw):
  """Decode-size groups (0-20 rows) that rarely start at a multiple of 8, 64-row tiles."""
  num_groups = draw(st.integers(1, 24))
  sizes = draw(st.lists(st.integers(0, 20), min_size=num_groups, max_size=num_groups))
  dim = sum(sizes) + draw(st.integers(0, 20))
  return dict(dim=max(dim, 1), tile=draw(st.sampled_from([64, 128])), granule=8, sizes=sizes,
              num_local=num_groups, offset=0)


def _check(problem, skip=0, cover=False):
  meta = _build(jnp.asarray(problem["sizes"], jnp.int32), dim_size=problem["dim"],
                tile=problem["tile"], group_offset=jnp.int32(problem["offset"]),
                num_local=problem["num_local"], align="group", skip=skip, cover=cover,
                granule=problem["granule"])
  check_granule_windows(meta, problem["dim"], problem["tile"], problem["granule"],
                        problem["sizes"], problem["offset"], problem["num_local"], skip, cover)
  return meta


@pytest.mark.parametrize("skip, cover", [(0, False), (0, True), (3, False)])
@hypothesis.given(problem=granule_problems())
def test_granule_windows_properties(skip, cover, problem):
  _check(problem, skip, cover)


@hypothesis.given(problem=decode_problems())
def test_granule_windows_decode_sizes(problem):
  _check(problem)


def test_granule_windows_cut_from_the_rounded_first_row():
  # Groups [0, 5) [5, 9) [9, 9) [9, 29) [29, 100): 8-row granule, 16-row tiles.
  sizes = [5, 4, 0, 20, 71]
  meta = _check(dict(dim=104, tile=16, granule=8, sizes=sizes, num_local=5, offset=0))
  windows = metadata.window_starts(meta, 16, "group", 8)
  n = int(meta.num_items)
  np.testing.assert_array_equal(np.asarray(meta.group_ids)[:n], [0, 1, 3, 3, 4, 4, 4, 4, 4])
  np.testing.assert_array_equal(np.asarray(windows)[:n], [0, 0, 8, 24, 24, 40, 56, 72, 88])
  np.testing.assert_array_equal(np.asarray(meta.item_start)[:n],
                                [0, 5, 9, 24, 29, 40, 56, 72, 88])
  np.testing.assert_array_equal(np.asarray(meta.item_end)[:n],
                                [5, 9, 24, 29, 40, 56, 72, 88, 100])
  # Tile-aligned windows of 16 rows need one more (group 4 starts in tile 1, at row 29).
  tiled = metadata.make_tile_metadata(jnp.asarray(sizes, jnp.int32), 104, 16)
  assert int(tiled.num_items) == 10


@pytest.mark.parametrize("sizes, dim, tile, offset, num_local", [
    ([3, 9, 0, 14, 5], 40, 8, 1, 3), ([0, 0, 17, 2, 21], 40, 8, 2, 3), ([7] * 6, 42, 16, 0, 6),
])
def test_granule_one_is_the_group_alignment(sizes, dim, tile, offset, num_local):
  # granule=1 is today's align="group": the same items, bitwise.
  counts = jnp.asarray(sizes, jnp.int32)
  plain = metadata.make_tile_metadata(counts, dim, tile, jnp.int32(offset), num_local, "group")
  one = metadata.make_tile_metadata(counts, dim, tile, jnp.int32(offset), num_local, "group",
                                    granule=1)
  for got, want in zip(one, plain):
    np.testing.assert_array_equal(got, want)
  assert metadata.max_work_items(dim, tile, num_local, "group", granule=1) == (
      metadata.max_work_items(dim, tile, num_local, "group"))
  np.testing.assert_array_equal(metadata.window_starts(plain, tile, "group"), plain.item_start)


def test_tile_alignment_windows_are_its_tiles():
  meta = metadata.make_tile_metadata(jnp.asarray([5, 0, 6], jnp.int32), 16, 4)
  np.testing.assert_array_equal(metadata.window_starts(meta, 4), np.asarray(meta.tile_ids) * 4)


@pytest.mark.parametrize("align, granule, tile", [("tile", 8, 64), ("group", 8, 60),
                                                  ("group", 0, 64)])
def test_granule_rejects_what_it_cannot_cut(align, granule, tile):
  with pytest.raises(ValueError, match="granule"):
    metadata.make_tile_metadata(jnp.asarray([3, 4], jnp.int32), 16, tile, align=align,
                                granule=granule)


@pytest.mark.parametrize("counts_dtype", ["int32", "int64"])
def test_metadata_under_x64_strict_promotion(counts_dtype):
  # Everything is int32 whatever the counts' width: under jax_enable_x64 an untyped arange
  # or sum is int64, which strict promotion will not mix with int32.
  with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
    counts = jnp.asarray([5, 0, 9], counts_dtype)
    meta = jax.jit(lambda c: metadata.make_tile_metadata(c, 16, 16, num_local=3,
                                                         align="group"))(counts)
    classes = metadata.size_classes(16, 16)
    order, class_start, class_count = jax.jit(
        lambda m: metadata.items_by_size_class(m, classes))(meta)
    ids = jax.jit(lambda c: metadata.row_group_ids(c, 16))(counts)
  for array in (*meta, order, class_start, class_count, ids):
    assert array.dtype == jnp.int32
  # Group 0's 5 rows fit the class of 8, group 2's 9 rows the class of 16.
  assert classes == (8, 16)
  np.testing.assert_array_equal(class_count, [1, 1])
  np.testing.assert_array_equal(class_start, [0, 1])
  np.testing.assert_array_equal(order[:2], [0, 1])
  np.testing.assert_array_equal(ids, [0] * 5 + [2] * 9 + [-1] * 2)


@st.composite
def overlong_lists(draw):
  """Group sizes, each within the dimension, whose running sum may pass it (what the gmm
  op's `group_list.fitted_counts` hands on), with a tile, an offset and local groups."""
  dim = draw(st.integers(1, 40))
  num_groups = draw(st.integers(1, 6))
  sizes = draw(st.lists(st.integers(0, dim), min_size=num_groups, max_size=num_groups))
  num_local = draw(st.integers(1, num_groups))
  return dict(dim=dim, sizes=sizes, tile=draw(st.sampled_from([1, 4, 8, 16])),
              offset=draw(st.integers(0, num_groups - num_local)), num_local=num_local)


@hypothesis.given(problem=overlong_lists(), align=st.sampled_from(["tile", "group"]),
                  cover=st.booleans())
def test_a_list_past_the_dimension_reads_as_its_clamped_sizes(problem, align, cover):
  # Every derivation cuts a list where its running sum passes the dimension: the same
  # bounds, row ids, local bounds, shard counts, work items and tile walk as the clamped
  # sizes (`group_list.clamp_counts`) give.
  dim, tile, offset, num_local = (problem[k] for k in ("dim", "tile", "offset", "num_local"))
  raw = jnp.asarray(problem["sizes"], jnp.int32)
  clamped = group_list.clamp_counts(raw, dim)
  np.testing.assert_array_equal(
      group_list.fitted_counts(raw, "counts", None, dim), raw)  # already within [0, dim]
  for fn in (lambda c: metadata.bounds_from_counts(c, dim),
             lambda c: metadata.row_group_ids(c, dim, jnp.int32(offset), num_local),
             lambda c: metadata.local_group_bounds(c, dim, jnp.int32(offset), num_local),
             lambda c: metadata.counts_in_range(c, dim // 2, dim - dim // 2),
             lambda c: metadata.make_tile_metadata(c, dim, tile, jnp.int32(offset), num_local,
                                                   align, cover=cover),
             lambda c: metadata.tile_walk(c, dim, tile, jnp.int32(offset), num_local)):
    for got, want in zip(jax.tree.leaves(fn(raw)), jax.tree.leaves(fn(clamped))):
      np.testing.assert_array_equal(got, want)
