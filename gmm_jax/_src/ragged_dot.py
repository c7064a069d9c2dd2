"""Drop-ins for `jax.lax.ragged_dot` and `jax.lax.ragged_dot_general`, backed by `gmm`.

Floor 6: built on the public `gmm` only. The three modes of jax's dimension numbers map to
gmm as:
  ragged non-contracting  m-grouping; batch dims and lhs non-contracting dims outer to the
                          ragged one become vmapped gmms (each with its own group sizes);
                          inner non-contracting dims join the grouped rows.
  ragged contracting      k-grouping, the same way; lhs contracting dims outer to the ragged
                          one are summed over.
  ragged batch            jax computes the plain batched product (the group sizes do not
                          change it); so does this.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.api import gmm


def _constrain(out, out_sharding):
  """`out` laid out as `out_sharding` (a NamedSharding, or a PartitionSpec of the current
  mesh): a reshard on Explicit axes, a sharding constraint otherwise."""
  if out_sharding is None:
    return out
  mesh = getattr(out_sharding, "mesh", None) or jax.sharding.get_abstract_mesh()
  explicit = any(kind == jax.sharding.AxisType.Explicit for kind in
                 getattr(mesh, "axis_types", ()))
  if explicit:
    return jax.sharding.reshard(out, out_sharding)
  return lax.with_sharding_constraint(out, out_sharding)


def ragged_dot(lhs: jax.typing.ArrayLike, rhs: jax.typing.ArrayLike,
               group_sizes: jax.typing.ArrayLike, precision=None,
               preferred_element_type: jax.typing.DTypeLike | None = None,
               group_offset: jax.typing.ArrayLike | None = None, out_sharding=None, *,
               implementation: str | Sequence[str] | None = None,
               interpret: bool = False) -> jax.Array:
  """A drop-in for `jax.lax.ragged_dot` (m-grouping, counts), backed by `gmm`.

  Takes every argument jax.lax.ragged_dot takes (jax 0.10-0.12) with the same results, and
  supports `group_offset` (jax raises NotImplementedError for it).

  Args:
    lhs: ``[M, K]``.
    rhs: ``[G, K, N]``.
    group_sizes: int ``[G]``.
    precision, preferred_element_type: as in jax.lax.ragged_dot (an integer
      preferred_element_type needs integer operands).
    group_offset: optional int scalar (or ``[1]`` array): rhs holds groups
      ``[group_offset, group_offset + rhs.shape[0])`` of group_sizes.
    out_sharding: optional NamedSharding (or PartitionSpec of the current mesh) of the
      result.
    implementation, interpret: as in `gmm`.

  Returns:
    ``[M, N]``; rows past ``sum(group_sizes)`` are 0.
  """
  out = gmm(lhs, rhs, group_sizes, group_type="m", group_list_type="counts",
            precision=precision, preferred_element_type=preferred_element_type,
            group_offset=group_offset, implementation=implementation, interpret=interpret)
  return _constrain(out, out_sharding)


def _remaining(rank: int, *used: Sequence[int]) -> list[int]:
  taken = {d for dims in used for d in dims}
  return [d for d in range(rank) if d not in taken]


def _prod(shape, dims) -> int:
  return math.prod(shape[d] for d in dims)


def _check_concrete_sizes(group_sizes, dim_size: int) -> None:
  """The checks gmm makes of a concrete list, for each row of a batched one."""
  if isinstance(group_sizes, jax.core.Tracer):
    return
  sizes = np.asarray(group_sizes)
  if not np.issubdtype(sizes.dtype, np.integer):
    raise ValueError(f"group_sizes must be an integer array, got {sizes.dtype}")
  if (sizes < 0).any():
    raise ValueError(f"group sizes must be non-negative, got {sizes.tolist()}")
  totals = sizes.astype(np.int64).sum(axis=-1)
  if (totals > dim_size).any():
    raise ValueError(f"group sizes sum to {int(totals.max())}, past the ragged dimension "
                     f"{dim_size} ({sizes.tolist()})")


def _group_sizes(group_sizes, prefix: tuple[int, int], inner: int, ragged: int):
  """group_sizes as ``[G]`` (shared) or ``[B, X, G]``, scaled to rows of ``ragged * inner``."""
  sizes = jnp.asarray(group_sizes)
  if sizes.ndim != 1:
    sizes = sizes.reshape(*prefix, sizes.shape[-1])
  if inner != 1:  # each ragged index stands for `inner` consecutive rows
    sizes = jnp.clip(sizes.astype(jnp.int32), 0, ragged) * inner
  return sizes


def _map(fn, x, w, sizes, w_per_outer: bool):
  """`fn` over the batch (B) and outer (X) axes of x ``[B, X, ...]``, w ``[B, ...]`` (or
  ``[B, X, ...]``) and sizes (``[G]`` shared, or ``[B, X, G]``), skipping axes of size 1."""
  batch, outer = x.shape[:2]
  shared = sizes.ndim == 1
  inner_axes = (0, 0 if w_per_outer else None, None if shared else 0)
  outer_axes = (0, 0, None if shared else 0)
  if batch == 1 and outer == 1:
    return fn(x[0, 0], w[0, 0] if w_per_outer else w[0], sizes if shared else sizes[0, 0])[
        None, None]
  return jax.vmap(jax.vmap(fn, in_axes=inner_axes), in_axes=outer_axes)(x, w, sizes)


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, out_sharding=None, *,
                       implementation=None, interpret: bool = False):
  """A drop-in for `jax.lax.ragged_dot_general`, backed by `gmm`.

  Same arguments and results as jax's (`jax.lax.RaggedDotDimensionNumbers`, the three
  modes, arbitrary batch and contracting dimensions, ``group_sizes`` ``[g]`` or
  ``[b..., x..., g]``). `group_offset`, which jax does not implement, works in the ragged
  non-contracting mode (rhs then holds groups ``[group_offset, group_offset +
  rhs_groups)``); the other modes raise NotImplementedError for it, as jax does.

  Raises:
    ValueError: dimension numbers or shapes jax rejects, or an invalid concrete group list.
    NotImplementedError: group_offset outside the ragged non-contracting mode.
  """
  numbers = ragged_dot_dimension_numbers
  try:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = numbers.dot_dimension_numbers
    ragged_dims = tuple(numbers.lhs_ragged_dimensions)
    group_dims = tuple(numbers.rhs_group_dimensions)
  except (AttributeError, TypeError, ValueError):
    raise ValueError(f"ragged_dot_dimension_numbers must be a jax.lax."
                     f"RaggedDotDimensionNumbers, got {numbers!r}") from None
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  lhs_contract, rhs_contract = list(lhs_contract), list(rhs_contract)
  lhs_batch, rhs_batch = list(lhs_batch), list(rhs_batch)
  if len(ragged_dims) != 1 or not 0 <= ragged_dims[0] < lhs.ndim:
    raise ValueError(f"ragged_dot_general needs exactly one lhs ragged dimension in "
                     f"[0, {lhs.ndim}), got {ragged_dims}")
  ragged = ragged_dims[0]
  sizes_shape = np.shape(group_sizes)
  if len(sizes_shape) == 0:
    raise ValueError("group_sizes must have rank >= 1, got a scalar")
  num_groups = sizes_shape[-1]
  lhs_free = _remaining(lhs.ndim, lhs_contract, lhs_batch)
  if ragged in lhs_free:
    mode = "non-contracting"
  elif ragged in lhs_contract:
    mode = "contracting"
  else:
    mode = "batch"
  if mode == "non-contracting":
    if len(group_dims) != 1 or not 0 <= group_dims[0] < rhs.ndim or (
        group_dims[0] in rhs_contract or group_dims[0] in rhs_batch):
      raise ValueError(
          "a ragged non-contracting dimension needs exactly one rhs group dimension, distinct "
          f"from the contracting and batch dimensions, got {group_dims}")
  elif group_dims:
    raise ValueError(f"a ragged {mode} dimension takes no rhs group dimension, got "
                     f"{group_dims}")
  rhs_plain = (jnp.moveaxis(rhs, group_dims[0], 0)[0] if mode == "non-contracting" else rhs)
  plain_numbers = ((lhs_contract, [d - (d > group_dims[0]) for d in rhs_contract]),
                   (lhs_batch, [d - (d > group_dims[0]) for d in rhs_batch])) if (
                       mode == "non-contracting") else numbers.dot_dimension_numbers
  try:  # jax's own checks of the dimension numbers and sizes
    jax.eval_shape(lambda a, b: lax.dot_general(a, b, plain_numbers), lhs, rhs_plain)
  except TypeError as err:
    raise ValueError(f"ragged_dot_general: {err}") from None

  if mode == "batch":
    if group_offset is not None:
      raise NotImplementedError("group_offset with a ragged batch dimension (jax does not "
                                "implement group_offset either)")
    out = lax.dot_general(lhs, rhs, numbers.dot_dimension_numbers, precision=precision,
                          preferred_element_type=preferred_element_type)
    return _constrain(out, out_sharding)

  if mode == "non-contracting":
    position = lhs_free.index(ragged)
    outer, inner = lhs_free[:position], lhs_free[position + 1:]
  else:
    position = lhs_contract.index(ragged)
    outer, inner = lhs_contract[:position], lhs_contract[position + 1:]
    if group_offset is not None:
      raise NotImplementedError("group_offset with a ragged contracting dimension (jax "
                                "does not implement group_offset either)")
  prefix_shape = [lhs.shape[d] for d in lhs_batch + outer]  # of a batched group_sizes
  if len(sizes_shape) != 1 and tuple(sizes_shape) != tuple(prefix_shape) + (num_groups,):
    raise ValueError(f"group_sizes must have shape [g] or {tuple(prefix_shape) + ('g',)}, "
                     f"got {tuple(sizes_shape)}")
  if mode == "non-contracting" and group_offset is None and rhs.shape[group_dims[0]] != num_groups:
    raise ValueError(f"the rhs group dimension has {rhs.shape[group_dims[0]]} groups, "
                     f"group_sizes {num_groups}")
  _check_concrete_sizes(group_sizes, lhs.shape[ragged])
  batch = _prod(lhs.shape, lhs_batch)
  options = dict(precision=precision, preferred_element_type=preferred_element_type,
                 implementation=implementation, interpret=interpret)

  if mode == "non-contracting":
    rhs_free = _remaining(rhs.ndim, rhs_contract, rhs_batch, group_dims)
    # lhs [B, X, R*Y, C]; rhs [B, G, C, N]; sizes [B, X, G].
    rows = lhs.shape[ragged] * _prod(lhs.shape, inner)
    x = jnp.transpose(lhs, lhs_batch + outer + [ragged] + inner + lhs_contract).reshape(
        batch, _prod(lhs.shape, outer), rows, _prod(lhs.shape, lhs_contract))
    w = jnp.transpose(rhs, rhs_batch + list(group_dims) + rhs_contract + rhs_free).reshape(
        batch, rhs.shape[group_dims[0]], _prod(rhs.shape, rhs_contract),
        _prod(rhs.shape, rhs_free))
    sizes = _group_sizes(group_sizes, x.shape[:2], _prod(lhs.shape, inner),
                         lhs.shape[ragged])

    def one(x, w, sizes):
      return gmm(x, w, sizes, group_offset=group_offset, **options)

    out = _map(one, x, w, sizes, w_per_outer=False)  # [B, X, R*Y, N]
    shape = ([lhs.shape[d] for d in lhs_batch + lhs_free]
             + [rhs.shape[d] for d in rhs_free])
    return _constrain(out.reshape(shape), out_sharding)

  rhs_ragged = rhs_contract[position]
  rhs_outer, rhs_inner = rhs_contract[:position], rhs_contract[position + 1:]
  rhs_free = _remaining(rhs.ndim, rhs_contract, rhs_batch)
  # lhs [B, X, M, R*Y]; rhs [B, X, R*Y, N]; sizes [B, X, G]; summed over X.
  columns = lhs.shape[ragged] * _prod(lhs.shape, inner)
  num_outer = _prod(lhs.shape, outer)
  x = jnp.transpose(lhs, lhs_batch + outer + lhs_free + [ragged] + inner).reshape(
      batch, num_outer, _prod(lhs.shape, lhs_free), columns)
  w = jnp.transpose(rhs, rhs_batch + rhs_outer + [rhs_ragged] + rhs_inner + rhs_free).reshape(
      batch, num_outer, columns, _prod(rhs.shape, rhs_free))
  sizes = _group_sizes(group_sizes, x.shape[:2], _prod(lhs.shape, inner), lhs.shape[ragged])
  if num_outer == 1:
    k_options = options
  else:  # the outer contracting dims are summed over: accumulate the sum in f32 / int32
    final = jax.eval_shape(lambda: gmm(x[0, 0], w[0, 0], sizes if sizes.ndim == 1 else
                                       sizes[0, 0], group_type="k", **options)).dtype
    k_options = dict(options, preferred_element_type=(
        jnp.int32 if jnp.issubdtype(final, jnp.integer) else jnp.float32))

  def one_k(x, w, sizes):
    return gmm(x, w, sizes, group_type="k", **k_options)

  out = _map(one_k, x, w, sizes, w_per_outer=True)  # [B, X, G, M, N]
  out = out[:, 0] if num_outer == 1 else out.sum(axis=1).astype(final)
  out = jnp.moveaxis(out, 1, 0)  # [G, B, M, N]
  shape = ([num_groups] + [lhs.shape[d] for d in lhs_batch + lhs_free]
           + [rhs.shape[d] for d in rhs_free])
  return _constrain(out.reshape(shape), out_sharding)
