"""The one grouped-layout module of gmm_jax.

Everything that knows how groups are laid out along the grouped dimension lives here:
parsing the three group-list encodings into per-group sizes, offsets, per-row group ids,
the oneDNN grouped memory format (`GroupedArray`, `grouped_desc`) and the tile metadata
(work items of a tile of rows x the groups it touches) that the XLA path and the Pallas
kernels consume. Nobody else re-derives any of it.

Conventions: ``counts`` is an int32 ``[G]`` vector of group sizes (the canonical form every
implementation receives); ``offsets`` are int32 cumulative *end* offsets without a leading
zero (oneDNN's buffer 1, Ascend's groupListType 0); ``bounds`` are ``[G + 1]`` start offsets
with the total appended. A group list may be a traced array: nothing here syncs with the
host unless the list is concrete, and then only to validate it.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import checkify

GROUP_LIST_TYPES = ("counts", "cumsum", "sparse")


# --------------------------------------------------------------------------- group lists


def _is_concrete(x) -> bool:
  if isinstance(x, jax.core.Tracer):
    return False
  return True


def as_group_list(group_list):
  """Python lists and tuples become numpy arrays; arrays and tracers pass through."""
  if isinstance(group_list, (list, tuple)):
    return np.asarray(group_list)
  return group_list


def check_group_list_shape(group_list, group_list_type: str) -> None:
  group_list = as_group_list(group_list)
  if group_list_type not in GROUP_LIST_TYPES:
    raise ValueError(
        f"group_list_type must be one of {GROUP_LIST_TYPES}, got {group_list_type!r}"
    )
  shape = np.shape(group_list)
  dtype = jnp.result_type(group_list)
  if not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"group_list must be an integer array, got dtype {dtype} shape {shape}")
  if group_list_type == "sparse":
    if len(shape) != 2 or shape[1] != 2:
      raise ValueError(
          f"a 'sparse' group_list must have shape [E, 2] (group_index, size), got {shape}"
      )
  elif len(shape) != 1:
    raise ValueError(f"a {group_list_type!r} group_list must have shape [G], got {shape}")


def validate_concrete_group_list(
    group_list, group_list_type: str, dim_size: int, num_groups: int | None, dim_name: str
) -> None:
  """Raises ValueError for a concrete group list that cannot describe `dim_size` rows.

  A traced list is not checked (no host sync); see `check_group_list` for a checkify check.
  """
  if not _is_concrete(group_list):
    return
  values = np.asarray(as_group_list(group_list)).astype(np.int64)
  if group_list_type == "counts":
    if (values < 0).any():
      raise ValueError(f"group sizes must be non-negative, got counts {values.tolist()}")
    total = int(values.sum())
  elif group_list_type == "cumsum":
    if values.size and values[0] < 0:
      raise ValueError(f"cumsum group_list must be non-negative, got {values.tolist()}")
    if (np.diff(values) < 0).any():
      raise ValueError(f"cumsum group_list must be non-decreasing, got {values.tolist()}")
    total = int(values[-1]) if values.size else 0
  else:
    index, size = values[:, 0], values[:, 1]
    if (size < 0).any():
      raise ValueError(f"sparse group sizes must be non-negative, got {values.tolist()}")
    if num_groups is not None and ((index < 0) | (index >= num_groups)).any():
      raise ValueError(
          f"sparse group indices must lie in [0, {num_groups}), got {index.tolist()}"
      )
    used = index[size > 0]
    if (np.diff(used) <= 0).any():
      raise ValueError(
          "non-empty entries of a sparse group_list must have strictly increasing group "
          f"indices, got {values.tolist()}"
      )
    total = int(size.sum())
  if total > dim_size:
    raise ValueError(
        f"group sizes sum to {total}, past {dim_name}={dim_size} ({group_list_type} list "
        f"{values.tolist()})"
    )


def to_counts(group_list, group_list_type: str, num_groups: int | None = None) -> jax.Array:
  """Converts any group-list encoding to int32 group sizes ``[G]``.

  Args:
    group_list: ``[G]`` counts or cumsum end offsets, or ``[E, 2]`` sparse
      ``(group_index, size)`` rows.
    group_list_type: "counts", "cumsum" or "sparse".
    num_groups: G for a sparse list (required there, ignored otherwise).

  Returns:
    int32 ``[G]`` group sizes; traced if `group_list` is.
  """
  group_list = as_group_list(group_list)
  check_group_list_shape(group_list, group_list_type)
  group_list = jnp.asarray(group_list).astype(jnp.int32)
  if group_list_type == "counts":
    return group_list
  if group_list_type == "cumsum":
    return jnp.diff(group_list, prepend=jnp.zeros((1,), jnp.int32))
  if num_groups is None:
    raise ValueError("a 'sparse' group_list needs num_groups")
  counts = jnp.zeros((num_groups,), jnp.int32)
  return counts.at[group_list[:, 0]].add(group_list[:, 1], mode="drop")


def check_group_list(
    group_list, group_list_type: str = "counts", dim_size: int | None = None,
    num_groups: int | None = None,
) -> None:
  """A `checkify` check of a (possibly traced) group list.

  Call it inside a function transformed by ``jax.experimental.checkify.checkify`` (its
  errors are then returned as values, without a host sync inside the computation):

    err, out = checkify.checkify(lambda gl: (check_group_list(gl, "counts", M), gmm(x, w, gl))[1])(gl)
    err.throw()

  Args:
    group_list: the list as passed to `gmm`.
    group_list_type: its encoding.
    dim_size: the size of the grouped dimension (M or K); the sizes must not sum past it.
    num_groups: G, for a sparse list.
  """
  group_list = as_group_list(group_list)
  check_group_list_shape(group_list, group_list_type)
  group_list = jnp.asarray(group_list).astype(jnp.int32)
  if group_list_type == "counts":
    checkify.check(jnp.all(group_list >= 0), "group sizes must be non-negative")
    total = jnp.sum(group_list)
  elif group_list_type == "cumsum":
    checkify.check(
        jnp.all(jnp.diff(group_list, prepend=jnp.zeros((1,), jnp.int32)) >= 0),
        "cumsum group_list must be non-negative and non-decreasing",
    )
    total = group_list[-1] if group_list.shape[0] else jnp.int32(0)
  else:
    index, size = group_list[:, 0], group_list[:, 1]
    checkify.check(jnp.all(size >= 0), "sparse group sizes must be non-negative")
    if num_groups is not None:
      checkify.check(
          jnp.all((index >= 0) & (index < num_groups)),
          "sparse group indices must lie in [0, {G})", G=jnp.int32(num_groups),
      )
    # Non-empty entries must have strictly increasing indices.
    last_used = jax.lax.cummax(jnp.where(size > 0, index, -1))
    previous = jnp.concatenate([jnp.full((1,), -1, jnp.int32), last_used[:-1]])
    checkify.check(
        jnp.all((size == 0) | (index > previous)),
        "non-empty sparse entries must have strictly increasing group indices",
    )
    total = jnp.sum(size)
  if dim_size is not None:
    checkify.check(
        total <= dim_size, "group sizes sum to {total}, past the grouped dimension {dim}",
        total=total, dim=jnp.int32(dim_size),
    )


def bounds_from_counts(counts: jax.Array, dim_size: int) -> jax.Array:
  """``[G + 1]`` group start offsets (the last entry is the total), clipped to `dim_size`."""
  ends = jnp.cumsum(counts.astype(jnp.int32))
  bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])
  return jnp.clip(bounds, 0, dim_size)


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


# --------------------------------------------------------------------------- tile metadata


class TileMetadata(NamedTuple):
  """Work items of a tiling of the grouped dimension: (row tile) x (a group it touches).

  Tiles are aligned to multiples of ``tile`` (what a BlockSpec index map addresses); a
  group that straddles a tile boundary yields one item per tile it touches, and a tile that
  holds several groups yields one item per group. Only groups held locally (group_offset)
  produce items, so the work never grows with empty or remote groups. At most
  ``num_tiles + num_local - 1`` items exist; the arrays are padded to that static length
  and items past ``num_items`` are empty (``item_start == item_end``).

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
                   cover: bool = False) -> int:
  """Static bound on the number of work items (the length of the metadata arrays)."""
  num_tiles = max(1, math.ceil(dim_size / tile))
  # With `cover`, every local group has an item, even an empty one.
  groups = max(1, num_local if cover else min(num_local, dim_size))
  # Tile-aligned: consecutive groups share at most one tile. Group-aligned: each group adds
  # at most one partial window.
  return num_tiles + groups - 1 if align == "tile" else num_tiles + groups


def make_tile_metadata(
    counts: jax.Array, dim_size: int, tile: int, group_offset=0, num_local: int | None = None,
    align: str = "tile", skip: int = 0, cover: bool = False,
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
    skip: with align="group", the first `skip` rows of every group get no item (another
      pass computed them); groups of at most `skip` rows get none.
    cover: every local group gets at least one item: an empty one (or one not in the list,
      past G) gets a single zero-row item at its start (``item_start == item_end``, tile
      clamped into range). For kernels that must write every group's output once (the
      k-grouped ``activation(bias)`` of an empty group). Items stay in group order and
      within the same bound.

  Returns:
    A `TileMetadata`.
  """
  if tile <= 0:
    raise ValueError(f"tile must be positive, got {tile}")
  if align not in ALIGNMENTS:
    raise ValueError(f"align must be one of {ALIGNMENTS}, got {align!r}")
  if skip < 0 or (skip and align != "group"):
    raise ValueError(f"skip must be >= 0 and needs align='group', got {skip} with {align!r}")
  num_total = counts.shape[0]
  num_local = num_total if num_local is None else num_local
  bounds = bounds_from_counts(counts, dim_size)
  max_items = max_work_items(dim_size, tile, num_local, align, cover)
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
    spans = (ends - starts + tile - 1) // tile
  tiles_per_group = jnp.where(active, spans, 1 if cover else 0)
  items_end = jnp.cumsum(tiles_per_group)
  num_items = items_end[-1]

  item = jnp.arange(max_items, dtype=jnp.int32)
  group = jnp.searchsorted(items_end, item, side="right").astype(jnp.int32)
  group = jnp.minimum(group, num_local - 1)
  index_in_group = item - (items_end[group] - tiles_per_group[group])
  valid = item < num_items
  if align == "tile":
    tile_ids = first_tile[group] + index_in_group
    item_start = jnp.maximum(tile_ids * tile, starts[group])
    item_end = jnp.minimum((tile_ids + 1) * tile, ends[group])
    item_end = jnp.maximum(item_end, item_start)  # a covering item of an empty group
  else:
    item_start = starts[group] + index_in_group * tile
    item_end = jnp.minimum(item_start + tile, ends[group])
    tile_ids = jnp.minimum(item_start // tile, num_tiles - 1)
  item_start = jnp.where(valid, item_start, 0)
  item_end = jnp.where(valid, item_end, 0)
  tile_ids = jnp.where(valid, tile_ids, 0)
  group_ids = group
  return TileMetadata(bounds, group_ids, tile_ids, item_start, item_end, num_items)


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
  class_count = jnp.sum(key[None, :] == jnp.arange(len(classes))[:, None], axis=1)
  class_count = class_count.astype(jnp.int32)
  class_start = jnp.cumsum(class_count) - class_count
  return order, class_start, class_count


# --------------------------------------------------------------------------- grouped memory


@jax.tree_util.register_pytree_node_class
class GroupedArray:
  """oneDNN's grouped memory format: concatenated groups plus int32 end offsets.

  ``values`` is a 2-D array whose dimension `variable_dim` is split into ``num_groups``
  consecutive, variable-sized groups (``[total_M, K]`` for variable_dim=0, ``[M, total_K]``
  for variable_dim=1); ``offsets`` is int32 ``[num_groups]``, the cumulative end of each
  group with no leading 0. Empty groups are valid (equal consecutive offsets). Rows past
  ``offsets[-1]`` belong to no group. A registered pytree: it passes through jit, grad and
  vmap-free transformations; `variable_dim` is static.
  """

  def __init__(self, values, offsets, variable_dim: int = 0):
    if variable_dim not in (0, 1):
      raise ValueError(f"variable_dim must be 0 or 1, got {variable_dim}")
    if np.ndim(values) != 2:
      raise ValueError(f"GroupedArray values must be 2-D, got shape {np.shape(values)}")
    if np.ndim(offsets) != 1:
      raise ValueError(f"GroupedArray offsets must be 1-D [num_groups], got {np.shape(offsets)}")
    if not jnp.issubdtype(jnp.result_type(offsets), jnp.integer):
      raise ValueError(f"GroupedArray offsets must be integer, got {jnp.result_type(offsets)}")
    self.values = values
    self.offsets = offsets
    self.variable_dim = variable_dim

  def tree_flatten(self):
    return (self.values, self.offsets), self.variable_dim

  @classmethod
  def tree_unflatten(cls, variable_dim, children):
    obj = object.__new__(cls)
    obj.values, obj.offsets = children
    obj.variable_dim = variable_dim
    return obj

  @property
  def num_groups(self) -> int:
    return int(np.shape(self.offsets)[0])

  @property
  def group_sizes(self) -> jax.Array:
    return to_counts(self.offsets, "cumsum")

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(np.shape(self.values))

  @property
  def dtype(self):
    return jnp.result_type(self.values)

  @classmethod
  def from_list(cls, arrays: Sequence, variable_dim: int = 0) -> "GroupedArray":
    """Concatenates per-group 2-D arrays along `variable_dim` (empty groups allowed)."""
    if not arrays:
      raise ValueError("from_list needs at least one array")
    other = 1 - variable_dim
    shapes = [np.shape(a) for a in arrays]
    if any(len(s) != 2 for s in shapes) or len({s[other] for s in shapes}) != 1:
      raise ValueError(
          f"from_list needs 2-D arrays agreeing on dim {other}, got shapes {shapes}"
      )
    sizes = np.array([s[variable_dim] for s in shapes], np.int32)
    values = jnp.concatenate([jnp.asarray(a) for a in arrays], axis=variable_dim)
    return cls(values, jnp.asarray(np.cumsum(sizes), jnp.int32), variable_dim)

  def to_list(self) -> list[jax.Array]:
    """Splits back into per-group arrays (needs concrete offsets)."""
    offsets = np.asarray(self.offsets)
    starts = np.concatenate([[0], offsets[:-1]])
    index = [slice(None), slice(None)]
    out = []
    for start, end in zip(starts, offsets):
      index[self.variable_dim] = slice(int(start), int(end))
      out.append(self.values[tuple(index)])
    return out

  def __repr__(self):
    return (
        f"GroupedArray(shape={self.shape}, dtype={self.dtype}, num_groups={self.num_groups}, "
        f"variable_dim={self.variable_dim})"
    )


@dataclasses.dataclass(frozen=True)
class GroupedDesc:
  """Descriptor of a grouped memory (oneDNN ``memory::desc::grouped``)."""

  dims: tuple[int, int]
  dtype: np.dtype
  variable_dim_idx: int
  num_groups: int

  def size(self, buffer: int) -> int:
    """Bytes of buffer 0 (values, sub-byte types packed) or buffer 1 (int32 offsets)."""
    if buffer == 0:
      bits = jnp.iinfo(self.dtype).bits if jnp.issubdtype(self.dtype, jnp.integer) else (
          jnp.finfo(self.dtype).bits)
      return math.ceil(self.dims[0] * self.dims[1] * bits / 8)
    if buffer == 1:
      return self.num_groups * 4
    raise ValueError(f"a grouped memory has buffers 0 and 1, got {buffer}")


def grouped_desc(dims, dtype, variable_dim_idx: int, num_groups: int) -> GroupedDesc:
  """Describes a 2-D grouped tensor; `dims` give the total along the variable dim.

  Raises:
    ValueError: as oneDNN rejects it: not 2-D, a non-positive dim, num_groups <= 0 or
      variable_dim_idx outside [0, 2).
  """
  dims = tuple(int(d) for d in dims)
  if len(dims) != 2:
    raise ValueError(f"grouped memory is 2-D only, got dims {dims}")
  if any(d <= 0 for d in dims):
    raise ValueError(f"grouped memory dims must be positive, got {dims}")
  if num_groups <= 0:
    raise ValueError(f"num_groups must be positive, got {num_groups}")
  if variable_dim_idx not in (0, 1):
    raise ValueError(f"variable_dim_idx must be 0 or 1, got {variable_dim_idx}")
  return GroupedDesc(dims, np.dtype(dtype), variable_dim_idx, int(num_groups))
