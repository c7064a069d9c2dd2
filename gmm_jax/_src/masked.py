"""The masked grouped layout: `MaskedArray` (values ``[G, max_rows, K]`` + int32 counts
``[G]``), the fixed-shape form of vLLM's and DeepGEMM's "masked" grouped GEMM for decode, and
its conversions to and from the ragged form (``[M, K]`` rows sorted by group + group sizes,
what gmm's m-grouping takes).

Group g uses the first ``counts[g]`` rows of ``values[g]``; the rest are padding. The shapes
depend only on (G, max_rows), not on the routing, so one compiled decode step serves any
token-to-expert assignment.

Floor 1 (beside `grouped_array`): bounds and row group ids come from `metadata`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import metadata
from gmm_jax._src.grouped_array import GroupedArray


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


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
class MaskedArray:
  """Grouped rows in fixed-size slots: ``values [G, max_rows, K]`` and int32 ``counts [G]``.

  Group g's rows are ``values[g, :counts[g]]``; rows past a group's count are padding
  (`from_ragged` and gmm write them as exactly 0, and gmm neither reads them nor gives them
  a gradient). A registered pytree (jit, grad, vmap); counts may be traced, and traced
  counts outside ``[0, max_rows]`` are clipped to it.
  """

  def __init__(self, values, counts):
    if np.ndim(values) != 3:
      raise ValueError(f"MaskedArray values must be 3-D [G, max_rows, K], got shape "
                       f"{np.shape(values)}")
    if np.ndim(counts) != 1 or np.shape(counts)[0] != np.shape(values)[0]:
      raise ValueError(f"MaskedArray counts must be [G] = [{np.shape(values)[0]}] for values "
                       f"{np.shape(values)}, got shape {np.shape(counts)}")
    if not jnp.issubdtype(jnp.result_type(counts), jnp.integer):
      raise ValueError(f"MaskedArray counts must be integer, got {jnp.result_type(counts)}")
    check_counts(counts, int(np.shape(values)[1]))
    self.values = values
    self.counts = jnp.asarray(counts, jnp.int32)

  def tree_flatten(self):
    return (self.values, self.counts), None

  @classmethod
  def tree_unflatten(cls, _, children):
    obj = object.__new__(cls)
    obj.values, obj.counts = children
    return obj

  @property
  def num_groups(self) -> int:
    return int(np.shape(self.values)[0])

  @property
  def max_rows(self) -> int:
    return int(np.shape(self.values)[1])

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(np.shape(self.values))

  @property
  def dtype(self):
    return jnp.result_type(self.values)

  def to_ragged(self, num_rows: int | None = None):
    """`to_ragged(self, num_rows)`."""
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
  (static) defaults to ``G * max_rows``, which always fits; a smaller one keeps the first
  `num_rows` rows and the counts are cut to match. Differentiable in the values.
  """
  if not isinstance(masked, MaskedArray):
    raise ValueError(f"to_ragged needs a gmm_jax.MaskedArray, got {type(masked).__name__}")
  g, max_rows, k = masked.shape
  total = g * max_rows
  num_rows = total if num_rows is None else num_rows
  if not _is_int(num_rows) or num_rows < 0:
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
  rows (padding slots get no gradient to give).
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
  if not _is_int(max_rows) or max_rows < 0:
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
  return MaskedArray(values.reshape(num_groups, max_rows, k), counts)
