"""oneDNN's grouped memory format: `GroupedArray` (values + int32 cumulative end offsets)
and its descriptor `GroupedDesc`.

Floor 1: reads group lists through `group_list`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import group_list


def _is_int(value) -> bool:
  return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_variable_dim(value, name: str) -> None:
  if not _is_int(value) or value not in (0, 1):
    raise ValueError(f"{name} must be 0 or 1, got {value!r}")


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
    return group_list.to_counts(self.offsets, "cumsum")

  @property
  def shape(self) -> tuple[int, ...]:
    return tuple(np.shape(self.values))

  @property
  def dtype(self):
    return jnp.result_type(self.values)

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
  if not all(_is_int(d) for d in dims) or any(d < 0 for d in dims):
    raise ValueError(f"grouped memory dims must be non-negative ints, got {dims!r}")
  dims = tuple(int(d) for d in dims)
  if not _is_int(num_groups) or num_groups <= 0:
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
