"""The grouped layouts: oneDNN's grouped memory format, `GroupedArray` (values + int32
cumulative end offsets) and its descriptor `GroupedDesc`; and the masked layout,
`MaskedArray` (values ``[G, max_rows, K]`` + int32 counts ``[G]``), the fixed-shape form of
vLLM's and DeepGEMM's "masked" grouped GEMM for decode, with its conversions to and from the
ragged form (``[M, K]`` rows sorted by group + group sizes, what gmm's m-grouping takes).

In the masked layout group g uses the first ``counts[g]`` rows of ``values[g]``; the rest
are padding. Its shapes depend only on (G, max_rows), not on the routing, so one compiled
decode step serves any token-to-expert assignment.

Floor 1: reads group lists through `group_list`, bounds and row group ids through
`metadata`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core.errors import is_index
from gmm_jax._src.core import group_list, metadata


def _check_variable_dim(value, name: str) -> None:
  if not is_index(value) or value not in (0, 1):
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


class _GroupedValues:
  """What the grouped layouts share: the shape and dtype of their ``values``, and the
  pytree protocol of two array fields (`_CHILDREN`, traced through jit, grad and vmap) and
  one static field (`_STATIC`): flattening reads them, unflattening sets them on a new
  object without running ``__init__``'s checks."""

  _CHILDREN: tuple[str, str]
  _STATIC: str

  def tree_flatten(self):
    return tuple(getattr(self, name) for name in self._CHILDREN), getattr(self, self._STATIC)

  @classmethod
  def tree_unflatten(cls, static, children):
    obj = object.__new__(cls)
    for name, child in zip(cls._CHILDREN, children):
      setattr(obj, name, child)
    setattr(obj, cls._STATIC, static)
    return obj

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(np.shape(self.values))

  @property
  def dtype(self):
    return jnp.result_type(self.values)


@jax.tree_util.register_pytree_node_class
class GroupedArray(_GroupedValues):
  """oneDNN's grouped memory format: concatenated groups plus int32 end offsets.

  ``values`` is a 2-D array whose dimension `variable_dim` is split into ``num_groups``
  consecutive, variable-sized groups (``[total_M, K]`` for variable_dim=0, ``[M, total_K]``
  for variable_dim=1); ``offsets`` is int32 ``[num_groups]``, the cumulative end of each
  group with no leading 0. Empty groups are valid (equal consecutive offsets). Rows past
  ``offsets[-1]`` belong to no group. A registered pytree: it passes through jit, grad and
  vmap-free transformations; `variable_dim` is static.
  """

  _CHILDREN, _STATIC = ("values", "offsets"), "variable_dim"

  def __init__(self, values, offsets, variable_dim: int = 0):
    _check_variable_dim(variable_dim, "variable_dim")
    if np.ndim(values) != 2:
      raise ValueError(f"GroupedArray values must be 2-D, got shape {np.shape(values)}")
    if np.ndim(offsets) != 1:
      raise ValueError(f"GroupedArray offsets must be 1-D [num_groups], got {np.shape(offsets)}")
    if not jnp.issubdtype(jnp.result_type(offsets), jnp.integer):
      raise ValueError(f"GroupedArray offsets must be integer, got {jnp.result_type(offsets)}")
    self.values = values
    self.offsets = offsets
    self.variable_dim = variable_dim

  @property
  def num_groups(self) -> int:
    return int(np.shape(self.offsets)[0])

  @property
  def group_sizes(self) -> jax.Array:
    return group_list.to_counts(self.offsets, "cumsum")

  @classmethod
  def from_list(cls, arrays: Sequence, variable_dim: int = 0) -> "GroupedArray":
    """Concatenates per-group 2-D arrays along `variable_dim` (empty groups allowed)."""
    _check_variable_dim(variable_dim, "variable_dim")
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
    """Bytes of buffer 0 (values, sub-byte types packed; 0 for a zero-volume memory) or
    buffer 1 (int32 offsets)."""
    if buffer == 0:
      bits = jnp.iinfo(self.dtype).bits if jnp.issubdtype(self.dtype, jnp.integer) else (
          jnp.finfo(self.dtype).bits)
      return math.ceil(self.dims[0] * self.dims[1] * bits / 8)
    if buffer == 1:
      return self.num_groups * 4
    raise ValueError(f"a grouped memory has buffers 0 and 1, got {buffer}")


def grouped_desc(dims, dtype, variable_dim_idx: int, num_groups: int) -> GroupedDesc:
  """Describes a 2-D grouped tensor; `dims` give the total along the variable dim.

  A dimension of 0 is valid here (an empty GroupedArray: ``size(0) == 0``); oneDNN's
  descriptor rejects it, which `gmm_jax.compat.onednn` enforces.

  Raises:
    ValueError: as oneDNN rejects it: not 2-D, a negative or non-integer dim, num_groups
      <= 0, variable_dim_idx outside [0, 2), or a dtype that is not a number (bool).
  """
  try:
    dims = tuple(dims)
  except TypeError:
    raise ValueError(f"grouped memory dims must be a pair of ints, got {dims!r}") from None
  if len(dims) != 2:
    raise ValueError(f"grouped memory is 2-D only, got dims {dims}")
  if not all(is_index(d) for d in dims) or any(d < 0 for d in dims):
    raise ValueError(f"grouped memory dims must be non-negative ints, got {dims!r}")
  dims = tuple(int(d) for d in dims)
  if not is_index(num_groups) or num_groups <= 0:
    raise ValueError(f"num_groups must be a positive int, got {num_groups!r}")
  _check_variable_dim(variable_dim_idx, "variable_dim_idx")
  try:
    dtype = np.dtype(dtype)
  except TypeError:
    raise ValueError(f"grouped memory dtype must be a numeric dtype, got {dtype!r}") from None
  if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.integer) or
                               jnp.issubdtype(dtype, jnp.floating)):
    raise ValueError(f"grouped memory dtype must be an integer or floating dtype, got {dtype}")
  return GroupedDesc(dims, dtype, int(variable_dim_idx), int(num_groups))


# ------------------------------------------------------------------------ masked layout


def _is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def check_counts(counts, max_rows: int, what: str = "counts") -> None:
  """ValueError for concrete counts outside ``[0, max_rows]`` (traced ones are clipped)."""
  if not _is_concrete(counts):
    return
  values = np.asarray(counts)
  bad = np.flatnonzero((values < 0) | (values > max_rows))
  if bad.size:
    raise ValueError(
        f"{what} must lie in [0, max_rows={max_rows}], got {values[bad[:8]].tolist()} for "
        f"groups {bad[:8].tolist()} (counts {list(values.shape)})")


@jax.tree_util.register_pytree_node_class
class MaskedArray(_GroupedValues):
  """Grouped rows in fixed-size slots: ``values [G, max_rows, K]`` and int32 ``counts [G]``.

  Group g's rows are ``values[g, :counts[g]]``; rows past a group's count are padding
  (`from_ragged` and gmm write them as exactly 0, and gmm neither reads them nor gives them
  a gradient). A registered pytree (jit, grad, vmap); counts may be traced, and traced
  counts outside ``[0, max_rows]`` are clipped to it.

  ``num_rows`` (static, default ``G * max_rows``) bounds the rows all groups hold together
  (a decode step's ``tokens * top_k``; `from_ragged` sets it to the ragged form's rows): gmm
  runs a grouped problem of that many rows, so a tight bound saves work when most slots
  are padding. Concrete counts summing past it raise ValueError; traced ones keep the
  first num_rows rows (in group order).
  """

  _CHILDREN, _STATIC = ("values", "counts"), "_num_rows"

  def __init__(self, values, counts, num_rows: int | None = None):
    if np.ndim(values) != 3:
      raise ValueError(f"MaskedArray values must be 3-D [G, max_rows, K], got shape "
                       f"{np.shape(values)}")
    if np.ndim(counts) != 1 or np.shape(counts)[0] != np.shape(values)[0]:
      raise ValueError(f"MaskedArray counts must be [G] = [{np.shape(values)[0]}] for values "
                       f"{np.shape(values)}, got shape {np.shape(counts)}")
    if not jnp.issubdtype(jnp.result_type(counts), jnp.integer):
      raise ValueError(f"MaskedArray counts must be integer, got {jnp.result_type(counts)}")
    groups, max_rows = (int(d) for d in np.shape(values)[:2])
    check_counts(counts, max_rows)
    if num_rows is not None:
      if not is_index(num_rows) or not 0 <= num_rows <= groups * max_rows:
        raise ValueError(f"num_rows must be an int in [0, G * max_rows = {groups * max_rows}] "
                         f"for values {np.shape(values)}, got {num_rows!r}")
      num_rows = int(num_rows)
      if _is_concrete(counts) and int(np.sum(np.asarray(counts, np.int64))) > num_rows:
        raise ValueError(f"counts sum to {int(np.sum(np.asarray(counts, np.int64)))}, past "
                         f"num_rows={num_rows}")
    self.values = values
    self.counts = jnp.asarray(counts, jnp.int32)
    self._num_rows = num_rows

  @property
  def num_rows(self) -> int:
    """The static bound on the rows of all groups together (default G * max_rows)."""
    if self._num_rows is None:
      return self.num_groups * self.max_rows
    return self._num_rows

  @property
  def num_groups(self) -> int:
    return int(np.shape(self.values)[0])

  @property
  def max_rows(self) -> int:
    return int(np.shape(self.values)[1])

  def to_ragged(self, num_rows: int | None = None):
    """The ragged form ``(rows [num_rows, K], counts [G])``: see `gmm_jax.to_ragged`."""
    return to_ragged(self, num_rows)

  def __repr__(self):
    return f"MaskedArray(shape={self.shape}, dtype={self.dtype}, num_groups={self.num_groups})"


def _clipped(counts, max_rows: int) -> jax.Array:
  return jnp.clip(jnp.asarray(counts).astype(jnp.int32), 0, max_rows)


def ragged_slots(counts, max_rows: int, num_rows: int) -> jax.Array:
  """int32 ``[num_rows]``: the flat masked slot (``g * max_rows + j``) that row r of the
  ragged form holds, ``G * max_rows`` (out of range) for rows past the total.

  `counts` are the masked counts (clipped to ``[0, max_rows]``); the ragged rows are
  those groups' rows sorted by group.
  """
  counts = _clipped(counts, max_rows)
  group_ids = metadata.row_group_ids(counts, num_rows)
  bounds = metadata.bounds_from_counts(counts, num_rows)
  rows = jnp.arange(num_rows, dtype=jnp.int32)
  held = group_ids >= 0
  group = jnp.where(held, group_ids, 0)
  slot = group * max_rows + rows - bounds[group]
  return jnp.where(held, slot, counts.shape[0] * max_rows).astype(jnp.int32)


def to_ragged(masked: MaskedArray, num_rows: int | None = None):
  """The ragged form of a masked array: ``(rows [num_rows, K], counts [G])``.

  ``rows`` holds each group's first ``counts[g]`` rows, sorted by group (what gmm's
  m-grouping takes with ``group_list=counts``); rows past the total are 0. `num_rows`
  (static) defaults to the masked array's `num_rows` bound (``G * max_rows`` unless set),
  which always fits; a smaller one keeps the first `num_rows` rows and the counts are cut
  to match. Differentiable in the values.
  """
  if not isinstance(masked, MaskedArray):
    raise ValueError(f"to_ragged needs a gmm_jax.MaskedArray, got {type(masked).__name__}")
  g, max_rows, k = masked.shape
  total = g * max_rows
  num_rows = masked.num_rows if num_rows is None else num_rows
  if not is_index(num_rows) or num_rows < 0:
    raise ValueError(f"num_rows must be a non-negative int, got {num_rows!r}")
  counts = _clipped(masked.counts, max_rows)
  slots = ragged_slots(counts, max_rows, int(num_rows))
  flat = jnp.reshape(masked.values, (total, k))
  rows = jnp.take(flat, slots, axis=0, mode="fill", fill_value=0)
  return rows, metadata.counts_in_range(counts, 0, int(num_rows))


def from_ragged(rows, group_sizes=None, max_rows: int | None = None) -> MaskedArray:
  """A masked array from the ragged form: ``rows [M, K]`` sorted by group and
  ``group_sizes [G]`` (or a `GroupedArray` with variable_dim=0 and no group_sizes).

  Slot ``[g, j]`` holds row ``start_g + j`` for ``j < group_sizes[g]`` and is exactly 0
  past it. `max_rows` (static) is the slot count per group. Concrete sizes above max_rows
  (or summing past M) raise ValueError; traced ones are cut to fit. Differentiable in the
  rows (padding slots get no gradient to give). The result's `num_rows` bound is M (at
  most ``G * max_rows``).
  """
  if isinstance(rows, GroupedArray):
    if group_sizes is not None:
      raise ValueError("pass either a GroupedArray or rows with group_sizes, not both")
    if rows.variable_dim != 0:
      raise ValueError(f"from_ragged needs a row-grouped GroupedArray (variable_dim=0), got "
                       f"variable_dim={rows.variable_dim}")
    rows, group_sizes = rows.values, rows.group_sizes
  if group_sizes is None:
    raise ValueError("from_ragged needs group_sizes (or a GroupedArray)")
  if not is_index(max_rows) or max_rows < 0:
    raise ValueError(f"max_rows must be a non-negative int, got {max_rows!r}")
  if np.ndim(rows) != 2:
    raise ValueError(f"from_ragged rows must be 2-D [M, K], got shape {np.shape(rows)}")
  if np.ndim(group_sizes) != 1 or not jnp.issubdtype(jnp.result_type(group_sizes),
                                                     jnp.integer):
    raise ValueError(f"group_sizes must be a 1-D int array [G], got "
                     f"{jnp.result_type(group_sizes)}{list(np.shape(group_sizes))}")
  m, k = np.shape(rows)
  check_counts(group_sizes, int(max_rows), "group_sizes")
  if _is_concrete(group_sizes) and int(np.sum(np.asarray(group_sizes, np.int64))) > m:
    raise ValueError(f"group_sizes sum to {int(np.sum(np.asarray(group_sizes, np.int64)))}, "
                     f"past the {m} rows of rows {np.shape(rows)}")
  num_groups = int(np.shape(group_sizes)[0])
  # Sizes cut to the rows there are, then to the slots.
  fitted = metadata.counts_in_range(jnp.asarray(group_sizes).astype(jnp.int32), 0, m)
  starts = metadata.bounds_from_counts(fitted, m)[:-1]
  counts = jnp.minimum(fitted, max_rows)
  slot = jnp.arange(max_rows, dtype=jnp.int32)
  source = jnp.where(slot[None, :] < counts[:, None], starts[:, None] + slot[None, :], m)
  values = jnp.take(jnp.asarray(rows), source.reshape(-1), axis=0, mode="fill", fill_value=0)
  return MaskedArray(values.reshape(num_groups, max_rows, k), counts,
                     min(m, num_groups * max_rows))
