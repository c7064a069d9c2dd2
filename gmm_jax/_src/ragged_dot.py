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

Every input jax checks is checked first, by jax's own shape and dtype rules run on abstract
values: what jax rejects raises `GmmShapeError`, a TypeError as jax raises (and a
ValueError). With a symbolic size (`jax.export` shape polymorphism) the ragged
non-contracting and contracting modes call `jax.lax.ragged_dot_general` itself: gmm sizes its
work lists and kernel grids while tracing.
"""

from __future__ import annotations

import functools
import inspect
import math
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.api import gmm
from gmm_jax._src.core import jax_private
from gmm_jax._src.core.errors import GmmShapeError, describe
from gmm_jax._src.core.qarray import as_qarray

# jax.lax.ragged_dot's dimension numbers: lhs [m, k], rhs [g, k, n].
_RAGGED_DOT_NUMBERS = lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


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


def _abstract(x):
  """A ShapeDtypeStruct of an array, tracer or nested list (dtype as jax would make it)."""
  dtype = getattr(x, "dtype", None)
  if dtype is None:
    dtype = np.asarray(x).dtype
  return jax.ShapeDtypeStruct(np.shape(x), jax.dtypes.canonicalize_dtype(dtype))


def _describe(x) -> str:
  return describe(_abstract(x))


def _check_as_jax(lhs, rhs, group_sizes, numbers, preferred_element_type, group_offset):
  """jax.lax.ragged_dot_general's shape and dtype rules, run on abstract values: what jax
  rejects raises GmmShapeError (a TypeError, as jax raises) naming the shapes.

  jax does not implement group_offset; with one, rhs may hold fewer groups than
  group_sizes, so rhs is checked as if it held them all.

  Returns:
    The result's dtype as jax gives it (None for quantized operands, which gmm checks).
  """
  if as_qarray(lhs) is not None or as_qarray(rhs) is not None:
    return None
  try:
    specs = [_abstract(x) for x in (lhs, rhs, group_sizes)]
  except (TypeError, ValueError) as err:
    raise GmmShapeError(f"ragged_dot: lhs, rhs and group_sizes must be arrays: {err}") from None
  group_dims = tuple(getattr(numbers, "rhs_group_dimensions", ()))
  sizes_shape, rhs_shape = specs[2].shape, list(specs[1].shape)
  if (group_offset is not None and len(group_dims) == 1 and sizes_shape
      and 0 <= group_dims[0] < len(rhs_shape)):
    rhs_shape[group_dims[0]] = sizes_shape[-1]
    specs[1] = jax.ShapeDtypeStruct(tuple(rhs_shape), specs[1].dtype)
  # Under Explicit mesh axes jax infers no result sharding for ragged_dot_general (its
  # shape and dtype rules run before it asks): name one, since only the type is wanted.
  mesh = jax.sharding.get_abstract_mesh()
  explicit = any(kind == jax.sharding.AxisType.Explicit for kind in
                 getattr(mesh, "axis_types", ()))
  rule = functools.partial(lax.ragged_dot_general, ragged_dot_dimension_numbers=numbers,
                           preferred_element_type=preferred_element_type,
                           out_sharding=jax.sharding.PartitionSpec() if explicit else None)
  try:
    return jax.eval_shape(rule, *specs).dtype
  except (TypeError, AttributeError) as err:
    raise GmmShapeError(
        f"{err} (lhs {_describe(lhs)}, rhs {_describe(rhs)}, group_sizes "
        f"{_describe(group_sizes)}, {numbers})") from None


def _jax_types(lhs, rhs, out_dtype):
  """Plain operands as jax multiplies them: an integer operand with a floating one is
  converted to the (floating) result type, where gmm takes only one kind."""
  if out_dtype is None or not jnp.issubdtype(out_dtype, jnp.floating):
    return lhs, rhs
  lhs, rhs = jnp.asarray(lhs), jnp.asarray(rhs)
  if jnp.issubdtype(lhs.dtype, jnp.integer) == jnp.issubdtype(rhs.dtype, jnp.integer):
    return lhs, rhs
  return lhs.astype(out_dtype), rhs.astype(out_dtype)


def _is_symbolic(*arrays) -> bool:
  return any(jax.export.is_symbolic_dim(d) for x in arrays
             for d in (x.shape if hasattr(x, "shape") else np.shape(x)))


def _jax_ragged_dot_general(lhs, rhs, group_sizes, numbers, precision, preferred_element_type,
                            group_offset):
  """jax.lax.ragged_dot_general itself: the path for symbolic sizes."""
  if group_offset is not None:
    raise NotImplementedError(
        "group_offset with symbolic dimensions (jax.export): gmm needs static shapes, and "
        "jax.lax.ragged_dot_general, which serves symbolic ones, has no group_offset")
  return lax.ragged_dot_general(lhs, rhs, group_sizes, numbers, precision=precision,
                                preferred_element_type=preferred_element_type)


def _ordered(reduction_order, group_offset, implementation) -> bool:
  """Whether the call asks for an order of the contraction's sums (a `reduction_order` of
  jax >= 0.12.1 other than None / "unordered" / a scoped Unordered): an order gmm's
  implementations do not promise, so jax's own ragged_dot_general computes the call."""
  if reduction_order is None:
    return False
  if "reduction_order" not in inspect.signature(lax.ragged_dot_general).parameters:
    if reduction_order == "unordered":
      return False
    raise NotImplementedError(
        f"reduction_order={reduction_order!r}: jax {jax.__version__}'s ragged_dot has no "
        "reduction_order (jax >= 0.12.1 has); None and 'unordered' are served")
  if jax_private.reduction_order_is_free(reduction_order):
    return False
  if group_offset is not None or implementation is not None:
    raise NotImplementedError(
        f"reduction_order={reduction_order!r} with group_offset or implementation: an "
        "ordered reduction is computed by jax.lax.ragged_dot_general, which has neither "
        "(None, 'unordered' and Unordered scopes run on gmm with both)")
  return True


def ragged_dot(lhs: jax.typing.ArrayLike, rhs: jax.typing.ArrayLike,
               group_sizes: jax.typing.ArrayLike, precision=None,
               preferred_element_type: jax.typing.DTypeLike | None = None,
               group_offset: jax.typing.ArrayLike | None = None, out_sharding=None, *,
               reduction_order=None, implementation: str | Sequence[str] | None = None,
               interpret: bool = False) -> jax.Array:
  """A drop-in for `jax.lax.ragged_dot` (m-grouping, counts), backed by `gmm`.

  Takes every argument jax.lax.ragged_dot takes (jax 0.10-0.12) with the same results (and
  result type) and the same errors, and supports `group_offset` (jax raises
  NotImplementedError for it). Like jax's, lhs may have more dims (``[M, K, X...]``).
  With a symbolic dimension (`jax.export`) it is `jax.lax.ragged_dot` itself (gmm sizes
  its work while tracing); group_offset then raises NotImplementedError, as in jax.

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
    reduction_order: as in jax >= 0.12.1's: None, "unordered" (or a scoped
      ``Unordered``) run on gmm, whose implementations choose their own order of sums; an
      ordered one ("linear", a tiled, cast, padded or ring order) is a promise about the
      order of the float sums, which jax's own ``jax.lax.ragged_dot`` keeps: the call is
      jax's (its values and errors), without group_offset or implementation.
    implementation, interpret: as in `gmm`.

  Returns:
    ``[M, N]``; rows past ``sum(group_sizes)`` are 0.

  Raises:
    GmmShapeError: shapes or dtypes jax rejects (a TypeError, as jax raises, and a
      ValueError).
    ValueError: a concrete group_sizes that is negative or sums past M, or a
      reduction_order jax rejects.
    NotImplementedError: an ordered reduction_order with group_offset or implementation,
      or on a jax without reduction_order.
  """
  if _ordered(reduction_order, group_offset, implementation):
    return lax.ragged_dot(lhs, rhs, group_sizes, precision, preferred_element_type,
                          out_sharding=out_sharding, reduction_order=reduction_order)
  out_dtype = _check_as_jax(lhs, rhs, group_sizes, _RAGGED_DOT_NUMBERS,
                            preferred_element_type, group_offset)
  lhs, rhs = _jax_types(lhs, rhs, out_dtype)
  if preferred_element_type is None:  # jax's result type (f16 x bf16 is bf16; gmm: f32)
    preferred_element_type = out_dtype
  if _is_symbolic(lhs, rhs, group_sizes):
    out = _jax_ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DOT_NUMBERS, precision,
                                  preferred_element_type, group_offset)
  elif as_qarray(lhs) is None and np.ndim(lhs) != 2:
    # jax takes any lhs whose dim 1 contracts with rhs's dim 1 ([m, k, x...]).
    return ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DOT_NUMBERS, precision,
                              preferred_element_type, group_offset, out_sharding,
                              implementation=implementation, interpret=interpret)
  else:
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
    raise GmmShapeError(f"group_sizes must be an integer array, got {sizes.dtype}")
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


class _Dims(NamedTuple):
  """jax's dot dimension numbers as lists, with the rhs group dims and the lhs dims that
  are neither contracting nor batch (``lhs_free``)."""
  lhs_contract: list[int]
  rhs_contract: list[int]
  lhs_batch: list[int]
  rhs_batch: list[int]
  group_dims: tuple[int, ...]
  lhs_free: list[int]


class _Ragged(NamedTuple):
  """The lhs ragged dim, its index among the dims of its kind (free or contracting), and
  the dims of that kind before it (``outer``) and after it (``inner``)."""
  dim: int
  position: int
  outer: list[int]
  inner: list[int]


def _ragged_mode(dims: _Dims, ragged_dims: tuple, lhs_ndim: int, rhs_ndim: int,
                 sizes_shape: tuple) -> tuple[int, str]:
  """(the lhs ragged dim, its mode: "non-contracting", "contracting" or "batch"); raises
  GmmShapeError for ragged or group dims jax would reject, or a scalar group_sizes."""
  if len(ragged_dims) != 1 or not 0 <= ragged_dims[0] < lhs_ndim:
    raise GmmShapeError(f"ragged_dot_general needs exactly one lhs ragged dimension in "
                        f"[0, {lhs_ndim}), got {ragged_dims}")
  ragged = ragged_dims[0]
  if len(sizes_shape) == 0:
    raise GmmShapeError("group_sizes must have rank >= 1, got a scalar")
  if ragged in dims.lhs_free:
    mode = "non-contracting"
  elif ragged in dims.lhs_contract:
    mode = "contracting"
  else:
    mode = "batch"
  group_dims = dims.group_dims
  if mode == "non-contracting":
    if len(group_dims) != 1 or not 0 <= group_dims[0] < rhs_ndim or (
        group_dims[0] in dims.rhs_contract or group_dims[0] in dims.rhs_batch):
      raise GmmShapeError(
          "a ragged non-contracting dimension needs exactly one rhs group dimension, distinct "
          f"from the contracting and batch dimensions, got {group_dims}")
  elif group_dims:
    raise GmmShapeError(f"a ragged {mode} dimension takes no rhs group dimension, got "
                        f"{group_dims}")
  return ragged, mode


def _ragged_layout(dims: _Dims, ragged: int, mode: str, lhs, rhs, sizes_shape: tuple,
                   group_offset) -> _Ragged:
  """Where the ragged dim sits among its kind, once group_offset (ragged non-contracting
  only) and the shapes of group_sizes and of the rhs groups are checked."""
  kind = dims.lhs_free if mode == "non-contracting" else dims.lhs_contract
  position = kind.index(ragged)
  layout = _Ragged(ragged, position, kind[:position], kind[position + 1:])
  if mode == "contracting" and group_offset is not None:
    raise NotImplementedError("group_offset with a ragged contracting dimension (jax "
                              "does not implement group_offset either)")
  num_groups = sizes_shape[-1]
  prefix_shape = [lhs.shape[d] for d in dims.lhs_batch + layout.outer]  # of batched sizes
  if len(sizes_shape) != 1 and tuple(sizes_shape) != tuple(prefix_shape) + (num_groups,):
    raise GmmShapeError(f"group_sizes must have shape [g] or {tuple(prefix_shape) + ('g',)}, "
                        f"got {tuple(sizes_shape)}")
  group_dim = dims.group_dims[0] if mode == "non-contracting" else None
  if mode == "non-contracting" and group_offset is None and rhs.shape[group_dim] != num_groups:
    raise GmmShapeError(f"the rhs group dimension has {rhs.shape[group_dim]} groups, "
                        f"group_sizes {num_groups}")
  return layout


def _non_contracting(lhs, rhs, group_sizes, dims: _Dims, layout: _Ragged, group_offset,
                     options: dict):
  """The ragged non-contracting mode: m-grouped gmms over the batch and outer dims."""
  ragged, outer, inner, group_dims = layout.dim, layout.outer, layout.inner, dims.group_dims
  lhs_batch, lhs_contract = dims.lhs_batch, dims.lhs_contract
  rhs_free = _remaining(rhs.ndim, dims.rhs_contract, dims.rhs_batch, group_dims)
  # lhs [B, X, R*Y, C]; rhs [B, G, C, N]; sizes [B, X, G].
  batch, rows = _prod(lhs.shape, lhs_batch), lhs.shape[ragged] * _prod(lhs.shape, inner)
  x = jnp.transpose(lhs, lhs_batch + outer + [ragged] + inner + lhs_contract).reshape(
      batch, _prod(lhs.shape, outer), rows, _prod(lhs.shape, lhs_contract))
  w = jnp.transpose(rhs, dims.rhs_batch + list(group_dims) + dims.rhs_contract + rhs_free
                    ).reshape(batch, rhs.shape[group_dims[0]],
                              _prod(rhs.shape, dims.rhs_contract), _prod(rhs.shape, rhs_free))
  sizes = _group_sizes(group_sizes, x.shape[:2], _prod(lhs.shape, inner), lhs.shape[ragged])

  def one(x, w, sizes):
    return gmm(x, w, sizes, group_offset=group_offset, **options)

  out = _map(one, x, w, sizes, w_per_outer=False)  # [B, X, R*Y, N]
  return out.reshape([lhs.shape[d] for d in lhs_batch + dims.lhs_free]
                     + [rhs.shape[d] for d in rhs_free])


def _contracting(lhs, rhs, group_sizes, dims: _Dims, layout: _Ragged, options: dict):
  """The ragged contracting mode: k-grouped gmms over the batch and outer dims, summed over
  the outer ones (in f32 / int32)."""
  ragged, position, outer, inner = layout
  rhs_ragged = dims.rhs_contract[position]
  rhs_outer, rhs_inner = dims.rhs_contract[:position], dims.rhs_contract[position + 1:]
  rhs_free = _remaining(rhs.ndim, dims.rhs_contract, dims.rhs_batch)
  # lhs [B, X, M, R*Y]; rhs [B, X, R*Y, N]; sizes [B, X, G]; summed over X.
  batch, columns = _prod(lhs.shape, dims.lhs_batch), lhs.shape[ragged] * _prod(lhs.shape, inner)
  num_outer = _prod(lhs.shape, outer)
  x = jnp.transpose(lhs, dims.lhs_batch + outer + dims.lhs_free + [ragged] + inner).reshape(
      batch, num_outer, _prod(lhs.shape, dims.lhs_free), columns)
  w = jnp.transpose(rhs, dims.rhs_batch + rhs_outer + [rhs_ragged] + rhs_inner + rhs_free
                    ).reshape(batch, num_outer, columns, _prod(rhs.shape, rhs_free))
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
  return out.reshape([np.shape(group_sizes)[-1]]
                     + [lhs.shape[d] for d in dims.lhs_batch + dims.lhs_free]
                     + [rhs.shape[d] for d in rhs_free])


def ragged_dot_general(lhs, rhs, group_sizes, ragged_dot_dimension_numbers, precision=None,
                       preferred_element_type=None, group_offset=None, out_sharding=None, *,
                       reduction_order=None, implementation=None, interpret: bool = False):
  """A drop-in for `jax.lax.ragged_dot_general`, backed by `gmm`.

  Same arguments and results as jax's (`jax.lax.RaggedDotDimensionNumbers`, the three
  modes, arbitrary batch and contracting dimensions, ``group_sizes`` ``[g]`` or
  ``[b..., x..., g]``). `group_offset`, which jax does not implement, works in the ragged
  non-contracting mode (rhs then holds groups ``[group_offset, group_offset +
  rhs_groups)``); the other modes raise NotImplementedError for it, as jax does. The result
  type is jax's (its dot rule: e.g. f16 x bf16 gives bf16, an integer operand with a float
  one the float), and so are the errors.

  With a symbolic dimension (`jax.export`) the ragged non-contracting and contracting modes
  are `jax.lax.ragged_dot_general` itself (gmm sizes its work while tracing): the same
  values, and jax's derivatives (no reverse mode for a ragged contracting dimension);
  group_offset then raises NotImplementedError, as in jax.

  `reduction_order` (jax >= 0.12.1) is as in `ragged_dot`: an ordered one makes the call
  jax's own.

  Raises:
    GmmShapeError: dimension numbers, shapes or dtypes jax rejects (a TypeError, as jax
      raises, and a ValueError).
    ValueError: an invalid concrete group list (negative, or summing past the ragged
      dimension), or a reduction_order jax rejects.
    NotImplementedError: group_offset outside the ragged non-contracting mode; an ordered
      reduction_order with group_offset or implementation, or on a jax without it.
  """
  numbers = ragged_dot_dimension_numbers
  if _ordered(reduction_order, group_offset, implementation):
    return lax.ragged_dot_general(lhs, rhs, group_sizes, numbers, precision,
                                  preferred_element_type, out_sharding=out_sharding,
                                  reduction_order=reduction_order)
  try:
    (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = numbers.dot_dimension_numbers
    ragged_dims = tuple(numbers.lhs_ragged_dimensions)
    group_dims = tuple(numbers.rhs_group_dimensions)
  except (AttributeError, TypeError, ValueError):
    raise GmmShapeError(f"ragged_dot_dimension_numbers must be a jax.lax."
                        f"RaggedDotDimensionNumbers, got {numbers!r}") from None
  out_dtype = _check_as_jax(lhs, rhs, group_sizes, numbers, preferred_element_type,
                            group_offset)
  lhs, rhs = _jax_types(jnp.asarray(lhs), jnp.asarray(rhs), out_dtype)
  if preferred_element_type is None:
    preferred_element_type = out_dtype
  lhs_contract, lhs_batch = list(lhs_contract), list(lhs_batch)
  dims = _Dims(lhs_contract, list(rhs_contract), lhs_batch, list(rhs_batch), group_dims,
               _remaining(lhs.ndim, lhs_contract, lhs_batch))
  sizes_shape = np.shape(group_sizes)
  ragged, mode = _ragged_mode(dims, ragged_dims, lhs.ndim, rhs.ndim, sizes_shape)
  if mode == "batch":
    if group_offset is not None:
      raise NotImplementedError("group_offset with a ragged batch dimension (jax does not "
                                "implement group_offset either)")
    out = lax.dot_general(lhs, rhs, numbers.dot_dimension_numbers, precision=precision,
                          preferred_element_type=preferred_element_type)
    return _constrain(out, out_sharding)
  if _is_symbolic(lhs, rhs, group_sizes):
    out = _jax_ragged_dot_general(lhs, rhs, group_sizes, numbers, precision,
                                  preferred_element_type, group_offset)
    return _constrain(out, out_sharding)
  layout = _ragged_layout(dims, ragged, mode, lhs, rhs, sizes_shape, group_offset)
  _check_concrete_sizes(group_sizes, lhs.shape[ragged])
  options = dict(precision=precision, preferred_element_type=preferred_element_type,
                 implementation=implementation, interpret=interpret)
  if mode == "non-contracting":
    out = _non_contracting(lhs, rhs, group_sizes, dims, layout, group_offset, options)
  else:
    out = _contracting(lhs, rhs, group_sizes, dims, layout, options)
  return _constrain(out, out_sharding)
