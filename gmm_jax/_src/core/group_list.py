"""Group lists: the three encodings, their validation, and the int32 counts every layer
below the API receives.

Floor 0: imports nothing from gmm_jax. Nobody else parses an encoding.

Encodings (``group_list_type``):
  counts  ``[G]`` group sizes.
  cumsum  ``[G]`` cumulative end offsets without a leading 0 (oneDNN's buffer 1, Ascend's
          groupListType 0): group g is ``[cumsum[g-1], cumsum[g])``.
  sparse  ``[E, 2]`` rows ``(group_index, size)`` with increasing indices; unlisted groups
          are empty.

Concrete lists are validated on the host (`validate_concrete`). A traced list is never
synced to the host: `to_counts` gives it *defined* results instead (see `clamp_counts`), the
same in every implementation, and `check_group_list` is a `checkify` check of it.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import checkify

GROUP_LIST_TYPES = ("counts", "cumsum", "sparse")
_INT32_MAX = 2**31 - 1


def as_group_list(group_list):
  """Python lists and tuples become numpy arrays (ValueError for integers past int64);
  arrays and tracers pass through."""
  if isinstance(group_list, (list, tuple)):
    try:
      array = np.asarray(group_list)
    except (OverflowError, ValueError) as err:
      raise ValueError(f"group_list must be a rectangular integer array, got {group_list!r}: "
                       f"{err}") from None
    if array.dtype == object:
      raise ValueError(f"group_list holds integers past int64 or non-numbers: {group_list!r}")
    return array
  return group_list


def check_shape(group_list, group_list_type: str,
                shape_error: type[Exception] = ValueError) -> None:
  """Raises `shape_error` unless `group_list` is an integer array shaped for its encoding
  (ValueError for an unknown encoding).

  `shape_error` is the caller's class for a malformed operand: the API passes its
  `GmmShapeError` (a TypeError as jax raises, and a ValueError); this floor-0 module
  imports nothing from gmm_jax, so it takes the class as an argument.
  """
  if group_list_type not in GROUP_LIST_TYPES:
    raise ValueError(
        f"group_list_type must be one of {GROUP_LIST_TYPES}, got {group_list_type!r}"
    )
  if not hasattr(group_list, "shape") or not hasattr(group_list, "dtype"):
    raise shape_error(f"group_list must be an integer array, got {group_list!r}")
  shape, dtype = tuple(group_list.shape), np.dtype(group_list.dtype)
  if dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.integer):
    raise shape_error(
        f"group_list must be an integer array, got dtype {dtype} shape {shape}")
  if group_list_type == "sparse":
    if len(shape) != 2 or shape[1] != 2:
      raise shape_error(
          f"a 'sparse' group_list must have shape [E, 2] (group_index, size), got {shape}"
      )
  elif len(shape) != 1:
    raise shape_error(f"a {group_list_type!r} group_list must have shape [G], got {shape}")


def is_concrete(x) -> bool:
  return not isinstance(x, jax.core.Tracer)


def validate_concrete(group_list, group_list_type: str, dim_size: int, num_groups: int | None,
                      dim_name: str) -> None:
  """Raises ValueError for a concrete group list that cannot describe `dim_size` rows.

  A traced list is not checked (no host sync): `to_counts` clamps it, and
  `check_group_list` is its checkify check.
  """
  if not is_concrete(group_list):
    return
  values = np.asarray(group_list)
  if values.size and (values.max() > _INT32_MAX or values.min() < -_INT32_MAX - 1):
    raise ValueError(f"group_list values must fit int32, got {values.tolist()}")
  values = values.astype(np.int64)
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


# Up to this many elements, a running sum over a list is a broadcast compare-and-sum (as in
# `metadata.FUSED_ELEMENTS`).
_FUSED_ELEMENTS = 1 << 18


def _clip_to_int32(values, low: int, high: int) -> jax.Array:
  """Integer values of any width clipped to ``[low, high]`` (within int32), as int32: no
  value wraps around when it is narrowed."""
  if isinstance(values, np.ndarray):
    return jnp.asarray(np.clip(values.astype(np.int64), low, high), jnp.int32)
  values = jnp.asarray(values)
  info = jnp.iinfo(values.dtype)
  low_, high_ = max(low, info.min), min(high, info.max)
  return jnp.clip(values, low_, high_).astype(jnp.int32)


def clamp_counts(counts: jax.Array, dim_size: int) -> jax.Array:
  """Group sizes made to fit a grouped dimension of `dim_size`: the defined result of an
  invalid traced list.

  Every size is clamped to what is left of the dimension after the groups before it:
  ``size[g] = clip(counts[g], 0, dim_size - (size[0] + ... + size[g-1]))``. A negative size
  becomes 0, the first groups win, and the running total never passes `dim_size` (so it
  cannot wrap around int32). A valid list is unchanged.

  Args:
    counts: int32 ``[G]`` (values already within int32).
    dim_size: the size of the grouped dimension.

  Returns:
    int32 ``[G]`` sizes summing to at most `dim_size`.
  """
  if counts.shape[0] == 0:
    return counts.astype(jnp.int32)
  limit = jnp.int32(dim_size)
  sizes = jnp.clip(counts.astype(jnp.int32), 0, limit)
  num = counts.shape[0]
  if num * max(int(dim_size), 1) < _INT32_MAX and num * num <= _FUSED_ELEMENTS:
    # The running sum cannot overflow, so the saturating one is min(running sum, limit);
    # over a small list, a compare-and-sum (elementwise work that XLA fuses) rather than
    # a scan, which TPU lowers to a chain of slices, pads and adds.
    index = jnp.arange(num, dtype=jnp.int32)
    ends = jnp.sum(jnp.where(index[None, :] <= index[:, None], sizes[None, :], 0), axis=1,
                   dtype=jnp.int32)
    return jnp.minimum(ends, limit) - jnp.minimum(ends - sizes, limit)
  # A saturating running sum: min(a + b, limit), computed without overflow for a, b in
  # [0, limit]; it is associative, so the scan is parallel.
  ends = lax.associative_scan(lambda a, b: jnp.minimum(a, limit - b) + b, sizes)
  return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


def to_counts(group_list, group_list_type: str, num_groups: int | None = None,
              dim_size: int | None = None) -> jax.Array:
  """Converts any group-list encoding to int32 group sizes ``[G]``.

  Args:
    group_list: ``[G]`` counts or cumsum end offsets, or ``[E, 2]`` sparse
      ``(group_index, size)`` rows; any integer dtype.
    group_list_type: "counts", "cumsum" or "sparse".
    num_groups: G for a sparse list (required there, ignored otherwise).
    dim_size: the size of the grouped dimension. When given, the sizes are made to fit it
      with `clamp_counts` (the defined result of an invalid traced list: negative sizes
      and decreasing cumsums give empty groups, a list past the dimension is cut short;
      sparse entries out of ``[0, G)`` are dropped). A valid list is unchanged.

  Returns:
    int32 ``[G]`` group sizes; traced if `group_list` is.
  """
  group_list = as_group_list(group_list)
  check_shape(group_list, group_list_type)
  # Values past the dimension (or past int32) act like the dimension itself.
  high = _INT32_MAX if dim_size is None else int(dim_size)
  if group_list_type == "counts":
    counts = _clip_to_int32(group_list, 0, high)
  elif group_list_type == "cumsum":
    ends = _clip_to_int32(group_list, 0, high)
    counts = jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))
  else:
    if num_groups is None:
      raise ValueError("a 'sparse' group_list needs num_groups")
    index = _clip_to_int32(group_list[:, 0], -1, num_groups)
    index = jnp.where(index < 0, num_groups, index)  # out of range: dropped (not wrapped)
    sizes = _clip_to_int32(group_list[:, 1], 0, high)
    if dim_size is not None:  # in entry order, so that the scatter below cannot overflow
      sizes = clamp_counts(sizes, dim_size)
    counts = jnp.zeros((num_groups,), jnp.int32).at[index].add(sizes, mode="drop")
  return counts if dim_size is None else clamp_counts(counts, dim_size)


def fitted_counts(group_list, group_list_type: str, num_groups: int | None,
                  dim_size: int) -> jax.Array:
  """Group sizes for the gmm op: `to_counts` with `dim_size` as the groups' bounds see it.

  Every size is clipped to ``[0, dim_size]``; where no running sum of such sizes can wrap
  around int32 (``G * dim_size`` below 2**31), a list that runs past the dimension is left
  so, since every consumer of the op's sizes reads the groups' rows from their running sum
  clipped to the dimension (`metadata.bounds_from_counts`, `metadata.tile_walk`): the same
  rows `clamp_counts` gives, without the running sum it computes first. Elsewhere (and for
  a sparse list, clamped in entry order) the sizes are `to_counts`'.
  """
  group_list = as_group_list(group_list)
  num_total = num_groups if group_list_type == "sparse" else group_list.shape[0]
  if group_list_type == "sparse" or num_total * max(int(dim_size), 1) >= _INT32_MAX:
    return to_counts(group_list, group_list_type, num_groups, dim_size=dim_size)
  counts = to_counts(group_list, group_list_type, num_groups)
  return jnp.clip(counts, 0, dim_size)


def check_group_list(
    group_list, group_list_type: str = "counts", dim_size: int | None = None,
    num_groups: int | None = None,
) -> None:
  """A `checkify` check of a (possibly traced) group list.

  Call it inside a function transformed by ``jax.experimental.checkify.checkify`` (its
  errors are then returned as values, without a host sync inside the computation):

    err, out = checkify.checkify(lambda gl: (check_group_list(gl, "counts", M), gmm(x, w, gl))[1])(gl)
    err.throw()

  Without the check an invalid traced list raises nothing and has a defined result, the
  same in every implementation: each size is clamped to what is left of the grouped
  dimension, in group order (negative sizes and decreasing cumsum steps give empty groups,
  the first groups win, no int32 wraparound; see `clamp_counts`).

  Args:
    group_list: the list as passed to `gmm`.
    group_list_type: its encoding.
    dim_size: the size of the grouped dimension (M or K); the sizes must not sum past it.
    num_groups: G, for a sparse list.
  """
  group_list = as_group_list(group_list)
  check_shape(group_list, group_list_type)
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
