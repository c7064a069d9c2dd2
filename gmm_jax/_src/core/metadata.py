"""Group metadata: everything derived from int32 group sizes along a grouped dimension.

Floor 0: imports nothing from gmm_jax. Only this module derives group bounds, per-row group
ids, local group bounds and the work items (a tile of rows x one group it touches) that the
XLA path and the Pallas kernels consume; nobody re-derives them.

Conventions: ``counts`` is an int32 ``[G]`` vector of group sizes, each within the grouped
dimension; where their running sum passes it the list is cut there (the group bounds are
clipped to the dimension, as `group_list.clamp_counts` would cut the sizes), so every
function here gives the rows of the clamped list. ``bounds`` are ``[G + 1]`` start offsets
with the total appended. Counts may be traced: nothing here syncs with the host.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax


# Up to this many elements (queries x table entries), a prefix sum or a search over a small
# table is a broadcast compare-and-sum: elementwise work that XLA fuses into the ops around
# it. Above it, jnp.cumsum (a reduce-window per step on TPU) and jnp.searchsorted (a while
# loop) take over, whose cost grows with the log of the table instead of its size.
FUSED_ELEMENTS = 1 << 18


def prefix_sums(values: jax.Array, exclusive: bool = False) -> jax.Array:
  """int32 inclusive (or exclusive) prefix sums of an int ``[n]`` vector."""
  values = values.astype(jnp.int32)
  n = values.shape[0]
  if n * n <= FUSED_ELEMENTS:
    index = jnp.arange(n, dtype=jnp.int32)
    below = index[None, :] < index[:, None] if exclusive else index[None, :] <= index[:, None]
    return jnp.sum(jnp.where(below, values[None, :], 0), axis=1, dtype=jnp.int32)
  sums = jnp.cumsum(values, dtype=jnp.int32)
  return sums - values if exclusive else sums


def count_at_most(sorted_values: jax.Array, queries: jax.Array) -> jax.Array:
  """int32, per query, how many of the ascending `sorted_values` are <= it
  (``searchsorted(sorted_values, queries, side="right")``)."""
  if sorted_values.shape[0] * queries.size <= FUSED_ELEMENTS:
    return jnp.sum(sorted_values[None, :] <= queries.reshape(-1)[:, None], axis=1,
                   dtype=jnp.int32).reshape(queries.shape)
  return jnp.searchsorted(sorted_values, queries, side="right").astype(jnp.int32)


def bounds_from_counts(counts: jax.Array, dim_size: int) -> jax.Array:
  """``[G + 1]`` group start offsets (the last entry is the total), clipped to `dim_size`."""
  counts = counts.astype(jnp.int32)
  ends = prefix_sums(counts)
  bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  return jnp.clip(bounds, 0, dim_size)


def counts_in_range(counts: jax.Array, start, size: int) -> jax.Array:
  """Group sizes of the list restricted to the rows ``[start, start + size)`` of the grouped
  dimension (a shard's local group sizes): int32 ``[G]``."""
  ends = prefix_sums(counts)
  bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  clipped = jnp.clip(bounds, start, start + size)
  return (clipped[1:] - clipped[:-1]).astype(jnp.int32)


def local_group_range(group_offset, num_local: int, num_total: int) -> tuple[jax.Array, jax.Array]:
  """First and one-past-last global group held locally (``rhs`` groups), clipped to G."""
  first = jnp.clip(jnp.asarray(group_offset, jnp.int32), 0, num_total)
  return first, jnp.minimum(first + num_local, num_total)


def row_group_ids(
    counts: jax.Array, dim_size: int, group_offset=0, num_local: int | None = None
) -> jax.Array:
  """Local group id of every row (or column) of the grouped dimension, -1 where none.

  Rows at or past the total, and rows of groups outside ``[group_offset, group_offset +
  num_local)``, get -1.
  """
  num_total = counts.shape[0]
  num_local = num_total if num_local is None else num_local
  bounds = bounds_from_counts(counts, dim_size)
  rows = jnp.arange(dim_size, dtype=jnp.int32)
  global_ids = jnp.searchsorted(bounds[1:], rows, side="right").astype(jnp.int32)
  first, end = local_group_range(group_offset, num_local, num_total)
  local = (global_ids >= first) & (global_ids < end)
  return jnp.where(local, global_ids - first, -1)


def local_group_bounds(counts: jax.Array, dim_size: int, group_offset,
                       num_local: int) -> tuple[jax.Array, jax.Array]:
  """int32 ``[num_local]`` start and end of each local group along the grouped dimension.

  Local group ``g`` is global group ``group_offset + g``; one past the last global group it
  is empty (start == end == 0), so a kernel that loops over ``[start, end)`` does nothing.
  """
  bounds = bounds_from_counts(counts, dim_size)
  first, end = local_group_range(group_offset, num_local, counts.shape[0])
  global_ids = first + jnp.arange(num_local, dtype=jnp.int32)
  held = global_ids < end
  index = jnp.where(held, global_ids, 0)
  starts = jnp.where(held, bounds[index], 0)
  ends = jnp.where(held, bounds[index + 1], 0)
  return starts.astype(jnp.int32), ends.astype(jnp.int32)


# --------------------------------------------------------------------------- tile metadata


class TileMetadata(NamedTuple):
  """Work items of a tiling of the grouped dimension: (row tile) x (a group it touches).

  Tiles are aligned to multiples of ``tile`` (what a BlockSpec index map addresses); a
  group that straddles a tile boundary yields one item per tile it touches, and a tile that
  holds several groups yields one item per group. Only groups held locally (group_offset)
  produce items, so the work never grows with empty or remote groups. At most
  ``num_tiles + num_local - 1`` items exist; the arrays are padded to that static length
  and items past ``num_items`` are empty (``item_start == item_end``). The other
  alignments (see `make_tile_metadata`) cut windows from each group's first row instead;
  `window_starts` gives every item's window.

  Fields:
    bounds: int32 ``[G + 1]`` global group start offsets (last = total).
    group_ids: int32 ``[max_items]`` local group id (global id - group_offset) per item.
    tile_ids: int32 ``[max_items]`` tile index per item.
    item_start, item_end: int32 ``[max_items]`` the rows ``[start, end)`` the item owns
      (the tile intersected with the group).
    num_items: int32 scalar, the number of active items.
  """

  bounds: jax.Array
  group_ids: jax.Array
  tile_ids: jax.Array
  item_start: jax.Array
  item_end: jax.Array
  num_items: jax.Array


ALIGNMENTS = ("tile", "group")


def max_work_items(dim_size: int, tile: int, num_local: int, align: str = "tile",
                   cover: bool = False, granule: int = 1) -> int:
  """Static bound on the number of work items (the length of the metadata arrays)."""
  num_tiles = max(1, math.ceil(dim_size / tile))
  # With `cover`, every local group has an item, even an empty one.
  groups = max(1, num_local if cover else min(num_local, dim_size))
  # Tile-aligned: consecutive groups share at most one tile. Group-aligned: each group adds
  # at most one partial window. Group-aligned from granule-row blocks (granule > 1, tile a
  # multiple of it): a group covers whole blocks, consecutive groups share at most one, and
  # whole tiles of blocks cut them: the tile-aligned bound (see `make_tile_metadata`).
  if align == "tile" or granule > 1:
    return num_tiles + groups - 1
  return num_tiles + groups


def _check_tiling(tile: int, align: str, skip: int, granule: int) -> None:
  """ValueError unless `make_tile_metadata`'s tile, align, skip and granule go together."""
  if tile <= 0:
    raise ValueError(f"tile must be positive, got {tile}")
  if align not in ALIGNMENTS:
    raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
  if skip < 0 or (skip and align != "group"):
    raise ValueError(f"skip must be >= 0 and needs align='group', got {skip} with {align!r}")
  if granule <= 0 or (granule > 1 and (align != "group" or tile % granule)):
    raise ValueError(f"granule must be >= 1, and > 1 only with align='group' and a tile "
                     f"that is a multiple of it, got {granule} with {align!r}, tile {tile}")


def make_tile_metadata(
    counts: jax.Array, dim_size: int, tile: int, group_offset=0, num_local: int | None = None,
    align: str = "tile", skip: int = 0, cover: bool = False, granule: int = 1,
) -> TileMetadata:
  """Builds the work items for tiles of `tile` rows over a grouped dimension of `dim_size`.

  Args:
    counts: int32 ``[G]`` group sizes (global groups), possibly traced.
    dim_size: size of the grouped dimension (M for m-grouping, K for k-grouping).
    tile: rows per tile (> 0).
    group_offset: first global group held locally (int or traced int32 scalar).
    num_local: groups held locally (``rhs.shape[0]`` for m-grouping); default G.
    align: "tile" (megablox-style: tiles start at multiples of `tile`, what a BlockSpec
      index map addresses; at most ``num_tiles + num_local - 1`` items) or "group" (each
      group is cut into windows of `tile` rows starting at its first row, so only its last
      window is partial; at most ``num_tiles + num_local`` items; for kernels and loops that
      can start a block at any row). ``tile_ids`` is the tile holding an item's first row.
      With align="group" and a `granule` > 1, see `granule`.
    skip: with align="group", the first `skip` rows of every group get no item (another
      pass computed them); groups of at most `skip` rows get none.
    cover: every local group gets at least one item: an empty one (or one not in the list,
      past G) gets a single zero-row item at its start (``item_start == item_end``, tile
      clamped into range). For kernels that must write every group's output once (the
      k-grouped ``activation(bias)`` of an empty group). Items stay in group order and
      within the same bound.
    granule: with align="group", each group's windows of `tile` rows start at its first
      row rounded down to a multiple of `granule` (default 1: at its first row), so every
      window starts at a multiple of `granule`; an item owns the rows of its group in its
      window (the first item of a group may start after its window, only the last may end
      before it). For kernels whose blocks start at multiples of `granule` rows (Mosaic GPU:
      8, the TMA's swizzled shared-memory tiles); `tile` must be a multiple of `granule`.
      A group never has more items than with align="tile" (its first window starts at or
      after its first tile), and with `granule` > 1 the bound is the tile-aligned one:
      at most ``num_tiles + num_local - 1`` items. `window_starts` gives the windows.

  Returns:
    A `TileMetadata`.
  """
  _check_tiling(tile, align, skip, granule)
  num_total = counts.shape[0]
  num_local = num_total if num_local is None else num_local
  bounds = bounds_from_counts(counts, dim_size)
  max_items = max_work_items(dim_size, tile, num_local, align, cover, granule)
  if num_local == 0 or (num_total == 0 and not cover):  # no group, no work
    empty = jnp.zeros((max_items,), jnp.int32)
    return TileMetadata(bounds, empty, empty, empty, empty, jnp.int32(0))
  # Everything below is per local group g (global group first + g).
  first, end = local_group_range(group_offset, num_local, num_total)
  global_ids = first + jnp.arange(num_local, dtype=jnp.int32)
  held = global_ids < end
  index = jnp.minimum(global_ids, max(num_total - 1, 0))
  if num_total:
    starts = jnp.where(held, bounds[index], dim_size)
    ends = jnp.where(held, bounds[index + 1], dim_size)
  else:
    starts = ends = jnp.full((num_local,), dim_size, jnp.int32)
  starts = jnp.minimum(starts + skip, ends)
  active = ends > starts
  num_tiles = max(1, math.ceil(dim_size / tile))
  if align == "tile":
    first_tile = jnp.minimum(starts // tile, num_tiles - 1)
    spans = (ends - 1) // tile - first_tile + 1
  else:
    first_window = starts - starts % granule
    spans = (ends - first_window + tile - 1) // tile
  tiles_per_group = jnp.where(active, spans, 1 if cover else 0)
  items_end = prefix_sums(tiles_per_group)
  num_items = items_end[-1]

  item = jnp.arange(max_items, dtype=jnp.int32)
  group = jnp.minimum(count_at_most(items_end, item), num_local - 1)
  index_in_group = item - (items_end[group] - tiles_per_group[group])
  valid = item < num_items
  if align == "tile":
    tile_ids = first_tile[group] + index_in_group
    item_start = jnp.maximum(tile_ids * tile, starts[group])
    item_end = jnp.minimum((tile_ids + 1) * tile, ends[group])
    item_end = jnp.maximum(item_end, item_start)  # a covering item of an empty group
  else:
    window = first_window[group] + index_in_group * tile
    item_start = jnp.maximum(window, starts[group])
    item_end = jnp.minimum(window + tile, ends[group])
    item_end = jnp.maximum(item_end, item_start)  # a covering item of an empty group
    tile_ids = jnp.minimum(item_start // tile, num_tiles - 1)
  item_start = jnp.where(valid, item_start, 0)
  item_end = jnp.where(valid, item_end, 0)
  tile_ids = jnp.where(valid, tile_ids, 0)
  group_ids = group
  return TileMetadata(bounds, group_ids, tile_ids, item_start, item_end, num_items)


def window_starts(meta: TileMetadata, tile: int, align: str = "tile",
                  granule: int = 1) -> jax.Array:
  """int32 ``[max_items]`` the first row of each item's window of `tile` rows (the block a
  kernel loads; the item owns ``[item_start, item_end)`` inside it), for metadata built with
  the same `tile`, `align` and `granule`: the item's tile for align="tile", else its first
  row rounded down to a multiple of `granule`. Padding items get 0."""
  if align == "tile":
    return meta.tile_ids * tile
  return meta.item_start - meta.item_start % granule


def size_classes(tile: int, dim_size: int, smallest: int = 8) -> tuple[int, ...]:
  """Window sizes for partial work items: 8, 16, 32, 64, then steps of ~1.5x up to `tile`.

  A partial item of L rows is computed in the smallest class >= L, so its wasted work is
  under 2x its own rows for tiny items and under 1.5x from 64 rows on, rather than a whole
  tile. No class exceeds `dim_size` (the window must fit in the array).
  """
  classes = {min(tile, dim_size)}
  size = smallest
  while size < tile:
    classes.add(min(size, dim_size))
    if size >= 64 and size * 3 // 2 < tile:
      classes.add(min(size * 3 // 2, dim_size))
    size *= 2
  return tuple(sorted(c for c in classes if c > 0))


def items_by_size_class(meta: TileMetadata, classes: Sequence[int]):
  """Orders the active items by the smallest class that holds them.

  Returns:
    (order, class_start, class_count): ``order`` lists item indices grouped by class
    (inactive items last); class k owns ``order[class_start[k] : class_start[k] +
    class_count[k]]``.
  """
  length = meta.item_end - meta.item_start
  class_sizes = jnp.asarray(classes, jnp.int32)
  key = jnp.searchsorted(class_sizes, length, side="left").astype(jnp.int32)
  key = jnp.where(length > 0, key, len(classes))
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  # int32 throughout: under jax_enable_x64 an untyped arange (and a sum) is int64, which
  # strict dtype promotion will not mix with the int32 keys.
  class_ids = jnp.arange(len(classes), dtype=jnp.int32)
  class_count = jnp.sum(key[None, :] == class_ids[:, None], axis=1, dtype=jnp.int32)
  class_start = jnp.cumsum(class_count) - class_count
  return order, class_start, class_count


# --------------------------------------------------------------------- covering tile walk


class TileWalk(NamedTuple):
  """A walk over every ``tile``-row tile of the grouped dimension, in row order, that visits
  each (tile, local group) pair with rows in both once, and every tile at least once.

  The rows split into ``num_local + 2`` consecutive *ranges*: range 0 the rows before the
  first local group (remote groups), range ``1 + g`` local group ``g``, range
  ``num_local + 1`` the rest (remote groups after, rows past the total). Each non-empty
  range yields one step per tile it touches, so the steps cover every tile and a tile
  shared by ranges gets one step of each. A step of a local group is *real*: it owns the
  rows of its group in its tile; the others own none (a kernel zeroes their rows). The
  real steps are ``[steps_end[0], steps_end[num_local])``. At most ``num_tiles +
  num_local + 1`` steps exist; ``ranges`` is padded to that static length.

  The walk is compact: a kernel derives a step's tile, rows and blocks from it with a few
  scalar reads (`walk_step`; `walk_items` is the vector form for all steps). It costs
  elementwise work and compare-and-sums over small tables (no gather, sort or loop): XLA
  computes it in a few fused ops.

  Fields:
    ranges: int32 ``[steps]`` the range of each step.
    row_starts: int32 ``[num_local + 2]`` the first row of each range.
    steps_end: int32 ``[num_local + 2]`` one past each range's last step (a prefix sum of
      the steps per range); the last entry is the number of steps.
    num_steps: int32 scalar, the number of steps (a kernel's dynamic grid bound).
  """

  ranges: jax.Array
  row_starts: jax.Array
  steps_end: jax.Array
  num_steps: jax.Array


def max_walk_steps(dim_size: int, tile: int, num_local: int) -> int:
  """The static length of a `TileWalk`'s per-step arrays."""
  return max(1, math.ceil(dim_size / tile)) + num_local + 1


def tile_walk(counts: jax.Array, dim_size: int, tile: int, group_offset=0,
              num_local: int | None = None) -> TileWalk:
  """The `TileWalk` of ``tile``-row tiles over a grouped dimension of `dim_size` rows.

  Args:
    counts: int32 ``[G]`` group sizes (global groups), possibly traced.
    dim_size: rows of the grouped dimension.
    tile: rows per tile (> 0).
    group_offset: first global group held locally (int or traced int32 scalar).
    num_local: groups held locally; default G.
  """
  if tile <= 0:
    raise ValueError(f"tile must be positive, got {tile}")
  num_total = counts.shape[0]
  num_local = num_total if num_local is None else num_local
  num_ranges = num_local + 2
  counts = counts.astype(jnp.int32)
  first, end = local_group_range(group_offset, num_local, num_total)
  # Range r >= 1 starts where global group min(first + r - 1, end) starts, range 0 at row
  # 0: a compare-and-sum over the counts (no prefix sum, no gather).
  r = jnp.arange(num_ranges + 1, dtype=jnp.int32)
  groups_before = jnp.where(r > 0, jnp.minimum(first + r - 1, end), 0)
  group = jnp.arange(num_total, dtype=jnp.int32)
  bounds = jnp.sum(jnp.where(group[None, :] < groups_before[:, None], counts[None, :], 0),
                   axis=1, dtype=jnp.int32)
  # Clipped to the dimension, as `bounds_from_counts` clips: a list past it is cut there.
  lo = jnp.minimum(bounds[:-1], dim_size)
  hi = jnp.where(jnp.arange(num_ranges) == num_ranges - 1, dim_size,
                 jnp.minimum(bounds[1:], dim_size))
  row_starts = lo
  hi, tile_ = hi.astype(jnp.int32), jnp.int32(tile)  # int32 under jax_enable_x64 too
  spans = jnp.where(hi > lo, lax.div(hi - 1, tile_) - lax.div(lo, tile_) + 1, 0)
  steps_end = prefix_sums(spans)
  step = jnp.arange(max_walk_steps(dim_size, tile, num_local), dtype=jnp.int32)
  ranges = count_at_most(steps_end[:-1], step)
  return TileWalk(ranges, row_starts, steps_end, jnp.sum(spans, dtype=jnp.int32))


def walk_step(ranges, row_starts, steps_end, step, *, dim_size: int, tile: int,
              num_local: int):
  """What step `step` of a `TileWalk` works on, from its arrays (scalar reads when `step`
  is a scalar, as in a kernel's index maps; vectors work too).

  Returns:
    ``(tile, start, end, real, group, source_tile, after_real)``: the step's tile, the
    rows ``[start, end)`` it owns (real steps; meaningless otherwise), whether it is real,
    and for the blocks it reads: the local group and tile of the real step it borrows
    from (itself if real; else the last real step before it, else the first one, any when
    none is real), and whether it comes after the last real step.
  """
  num_tiles = max(1, math.ceil(dim_size / tile))
  num_ranges = num_local + 2

  def tile_of(at, r):
    first_step = jnp.where(r > 0, steps_end[jnp.maximum(r - 1, 0)], 0)
    # lax.div: the rows are >= 0, so truncation is the floor.
    start = row_starts[r]
    return jnp.clip(lax.div(start, jnp.asarray(tile, start.dtype)) + at - first_step, 0,
                    num_tiles - 1)

  r = ranges[step]
  tile_ = tile_of(step, r)
  hi = jnp.where(r + 1 < num_ranges, row_starts[jnp.minimum(r + 1, num_ranges - 1)],
                 dim_size)
  start = jnp.maximum(tile_ * tile, row_starts[r])
  end = jnp.minimum((tile_ + 1) * tile, hi)
  real = (r >= 1) & (r <= num_local)
  first_real, last_real = steps_end[0], steps_end[num_local] - 1
  source = jnp.clip(step, first_real, jnp.maximum(last_real, first_real))
  source_range = ranges[source]
  group = jnp.clip(source_range - 1, 0, max(num_local - 1, 0))
  after = (step > last_real) & (last_real >= first_real)
  return tile_, start, end, real, group, tile_of(source, source_range), after


class WalkItems(NamedTuple):
  """Per step of a `TileWalk` (`walk_step` for every step), for hosts and tests."""

  tiles: jax.Array
  starts: jax.Array  # the rows [start, end) a real step owns; 0, 0 for the others
  ends: jax.Array
  real: jax.Array  # 1 for a real step
  groups: jax.Array  # the local group; a step that is not real borrows a real step's
  source_tiles: jax.Array  # the tile of that real step (a real step's own)
  after_real: jax.Array  # 1 for a step after the last real step


def walk_items(walk: TileWalk, dim_size: int, tile: int, num_local: int) -> WalkItems:
  """The vector form of `walk_step` for every step (padding steps: not real)."""
  step = jnp.arange(walk.ranges.shape[0], dtype=jnp.int32)
  tiles, starts, ends, real, groups, source_tiles, after = walk_step(
      walk.ranges, walk.row_starts, walk.steps_end, step, dim_size=dim_size, tile=tile,
      num_local=num_local)
  real = real & (step < walk.num_steps)
  return WalkItems(tiles, jnp.where(real, starts, 0), jnp.where(real, ends, 0),
                   real.astype(jnp.int32), groups, source_tiles, after.astype(jnp.int32))
