"""The public `gmm` and `explain`: validate -> canonicalize -> route.

Floor 5: the only place that validates user input and builds a `GmmConfig`. Below it every
layer takes canonical operands ``(lhs, rhs, counts, group_offset, bias, cfg)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.backends import builtin as backends  # noqa: F401  (registers the implementations)
from gmm_jax._src.backends import registry as dispatch, fp8_training, quantized
from gmm_jax._src.core import group_list
from gmm_jax._src import op
from gmm_jax._src.sharding import spec as sharding_lib
from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import (GATED_ACTIVATIONS, GROUP_TYPES, PLATFORMS, GmmConfig, Tiling,
                                 Tilings, is_gated)
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, resolve_activation
from gmm_jax._src.core.errors import GmmShapeError, describe, is_index
from gmm_jax._src.core import grouped_array
from gmm_jax._src.core.grouped_array import GroupedArray, MaskedArray
from gmm_jax._src.core.qarray import (Fp8Training, QArray, QuantSpec, as_qarray, as_quantization,
                                 check_fits, quant_mode)

Array = jax.Array


# ------------------------------------------------------------------------------ validate


def _check_bool(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def _as_operand(x, name: str):
  """A QArray (gmm_jax or qwix) or a numeric array; ValueError for anything else."""
  quantized_x = as_qarray(x)
  if quantized_x is not None:
    return check_fits(quantized_x, name)
  if x is None or isinstance(x, (str, bytes, dict, set)):
    raise GmmShapeError(f"{name} must be an array or a gmm_jax.QArray, got {x!r}")
  try:
    x = jnp.asarray(x)
  except (TypeError, ValueError) as err:
    raise GmmShapeError(
        f"{name} must be an array or a gmm_jax.QArray, got {x!r}: {err}") from None
  dtype = x.dtype
  if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.floating)
                               or jnp.issubdtype(dtype, jnp.integer)):
    raise GmmShapeError(f"{name} must be a floating or integer array, got {jax.typeof(x)}")
  return x


def _check_quant_specs(lhs, rhs, quantize_lhs, quantize_rhs) -> None:
  for spec, operand, name in ((quantize_lhs, lhs, "lhs"), (quantize_rhs, rhs, "rhs")):
    if spec is None:
      continue
    if not isinstance(spec, QuantSpec):
      raise ValueError(f"quantize_{name} must be a gmm_jax.QuantSpec or None, got {spec!r}")
    if isinstance(operand, QArray) or not jnp.issubdtype(operand.dtype, jnp.floating):
      raise ValueError(f"quantize_{name} needs a float {name}, got {describe(operand)}")


def _narrow(dtype) -> bool:
  """An integer or an 8-bit (or narrower) float: values that mean something only with a
  scale, which plain arrays of two kinds are multiplied in the wider one's dtype."""
  return jnp.issubdtype(dtype, jnp.integer) or (
      jnp.issubdtype(dtype, jnp.floating) and np.dtype(dtype).itemsize == 1)


def _promote_plain(lhs, rhs):
  """Plain operands of one kind: an integer (or fp8) operand with a wider float one is
  converted to the float's dtype, as `jax.lax.dot_general` and `jax.lax.ragged_dot` promote
  an integer one (a float32 x int8 pair is a float32 product; a float32 x float8_e4m3fn
  pair, which jax has no implicit promotion for, likewise). A QArray is the way to say what
  the narrow values mean beyond themselves (a scale)."""
  lhs_narrow, rhs_narrow = _narrow(lhs.dtype), _narrow(rhs.dtype)
  if lhs_narrow == rhs_narrow:
    if (jnp.issubdtype(lhs.dtype, jnp.integer) == jnp.issubdtype(rhs.dtype, jnp.integer)):
      return lhs, rhs
    # An integer with an fp8 operand: both in bfloat16, which holds int8 and fp8 exactly.
    wide = np.dtype(jnp.bfloat16)
    return lhs.astype(wide), rhs.astype(wide)
  return (lhs.astype(rhs.dtype), rhs) if lhs_narrow else (lhs, rhs.astype(lhs.dtype))


def _problem_dims(lhs, rhs, group_type, transpose_lhs, transpose_rhs, gated_lhs=False):
  rhs_rank = 3 if group_type == "m" else 2
  if lhs.ndim != 2 or rhs.ndim != rhs_rank:
    raise GmmShapeError(
        f"group_type={group_type!r} needs a 2-D lhs and a {rhs_rank}-D rhs, got lhs "
        f"{describe(lhs)} and rhs {describe(rhs)}")
  m, k = (lhs.shape[1], lhs.shape[0]) if transpose_lhs else lhs.shape
  rhs_k, n = (rhs.shape[-1], rhs.shape[-2]) if transpose_rhs else rhs.shape[-2:]
  if gated_lhs:
    if k != 2 * rhs_k:
      raise GmmShapeError(
          f"a gated lhs_activation reads lhs [M, 2K] (gate half, then up half) against rhs "
          f"with K rows: lhs {lhs.shape} has {k} columns, rhs {rhs.shape} "
          f"(transpose_rhs={transpose_rhs}) has K={rhs_k} (needs {2 * rhs_k})")
    k = rhs_k
  if rhs_k != k:
    raise GmmShapeError(
        f"contraction sizes differ: lhs {lhs.shape} (transpose_lhs={transpose_lhs}) has "
        f"K={k}, rhs {rhs.shape} (transpose_rhs={transpose_rhs}) has K={rhs_k}")
  return m, k, n


def _lhs_activation(lhs_activation, *, group_type, transpose_lhs, lhs, rhs, quantized,
                    lhs_indices, quantization):
  """The gated prologue's name, after the checks of what it combines with."""
  if lhs_activation is None:
    return None
  if not is_gated(lhs_activation):
    raise ValueError(f"lhs_activation must be None or a gated activation name "
                     f"{GATED_ACTIVATIONS}, got {lhs_activation!r}")
  given = [name for name, v in (
      ("group_type='k'", group_type == "k"), ("transpose_lhs", transpose_lhs),
      ("quantized operands", quantized), ("lhs_indices", lhs_indices is not None),
      ("quantization=", quantization is not None)) if v]
  if given:
    raise NotImplementedError(
        f"lhs_activation (a gated prologue) supports an m-grouped float lhs [M, 2K] that is "
        f"not transposed or gathered, with any rhs layout, bias, activation, row_weights, "
        f"out_indices; got {', '.join(given)}")
  if not jnp.issubdtype(lhs.dtype, jnp.floating) or not jnp.issubdtype(rhs.dtype,
                                                                       jnp.floating):
    raise ValueError(f"lhs_activation needs float operands, got lhs {describe(lhs)} and "
                     f"rhs {describe(rhs)}")
  return lhs_activation


def _check_static(**operands) -> None:
  """NotImplementedError for symbolic dimensions (`jax.export` shape polymorphism): the
  work lists and kernel grids are sized while tracing."""
  for name, x in operands.items():
    shape = getattr(x, "shape", ())
    if any(jax.export.is_symbolic_dim(d) for d in shape):
      raise NotImplementedError(
          f"gmm needs static shapes (its work lists and kernel grids are sized while "
          f"tracing), got {name} {describe(x)} with symbolic dimensions; "
          "gmm_jax.ragged_dot and ragged_dot_general call jax.lax.ragged_dot_general when "
          "a size is symbolic")


def _num_groups(num_groups):
  if num_groups is None:
    return None
  if not is_index(num_groups) or num_groups < 0:
    raise ValueError(f"num_groups must be a non-negative int, got {num_groups!r}")
  return int(num_groups)


def _group_counts(groups, group_list_type, num_groups, group_type, rhs_shape, group_offset,
                  dim_size, dim_name):
  """(counts, num_total, num_local): the list validated and made canonical."""
  groups = group_list.as_group_list(groups)
  group_list.check_shape(groups, group_list_type, shape_error=GmmShapeError)
  num_groups = _num_groups(num_groups)
  list_len = groups.shape[0]
  if group_list_type == "sparse":
    if num_groups is None:
      if group_type == "k" or group_offset is not None:
        raise ValueError(
            "num_groups is required for a sparse group_list with group_type='k' or a "
            "group_offset")
      num_groups = rhs_shape[0]
    num_total = num_groups
  else:
    num_total = list_len
  if group_type == "m":
    num_local = rhs_shape[0]
    if group_list_type != "sparse" and num_groups is not None and num_groups != num_total:
      raise ValueError(f"num_groups={num_groups} differs from the group_list length {num_total}")
    if group_offset is None and num_local != num_total:
      raise GmmShapeError(
          f"rhs {tuple(rhs_shape)} holds {num_local} groups but the group list has "
          f"{num_total}; pass group_offset if rhs holds a slice of the groups")
    if num_local > num_total:
      raise GmmShapeError(f"rhs {tuple(rhs_shape)} holds more groups than the group list "
                          f"({num_total})")
  else:
    num_local = num_total if (num_groups is None or group_list_type == "sparse") else num_groups
    if num_local > num_total:
      raise ValueError(f"num_groups={num_local} exceeds the group list length {num_total}")
  group_list.validate_concrete(groups, group_list_type, dim_size, num_total, dim_name)
  counts = group_list.fitted_counts(groups, group_list_type, num_total, dim_size)
  return counts, num_total, num_local


def _group_offset(group_offset, num_total: int):
  if group_offset is None:
    return jnp.zeros((), jnp.int32)
  if not isinstance(group_offset, jax.core.Tracer):
    value = np.asarray(group_offset)
    if value.size != 1 or value.dtype == np.bool_ or not np.issubdtype(value.dtype, np.integer):
      raise ValueError(f"group_offset must be an integer scalar, got {group_offset!r}")
    if not 0 <= int(value.reshape(())) <= num_total:
      raise ValueError(f"group_offset must lie in [0, {num_total}], got {int(value.reshape(()))}")
  group_offset = jnp.asarray(group_offset)
  if group_offset.size != 1 or not jnp.issubdtype(group_offset.dtype, jnp.integer):
    raise ValueError(f"group_offset must be an integer scalar, got {jax.typeof(group_offset)}")
  # A traced offset past the list holds no group (the metadata clips it to [0, G]).
  return group_offset.reshape(()).astype(jnp.int32)


def _bias(bias, num_local: int, n: int):
  if bias is None:
    return None
  bias = _as_operand(bias, "bias")
  if isinstance(bias, QArray):
    raise ValueError(f"bias must be a plain array, got {describe(bias)}")
  if bias.shape != (num_local, n):
    raise ValueError(f"bias must have shape [G_local, N] = {(num_local, n)}, got {bias.shape}")
  return bias


def _per_group_vector(value, name: str, num_local: int, n: int):
  """None, or `value` (scalar, [N], [G_local, 1] or [G_local, N]) as f32 [G_local, N]."""
  if value is None:
    return None
  value = jnp.asarray(value)
  if not jnp.issubdtype(value.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating, got {value.dtype}")
  allowed = {(), (1,), (n,), (1, n), (num_local, 1), (num_local, n), (1, 1)}
  if value.shape not in allowed:
    raise ValueError(
        f"{name} must be a scalar, [N]={[n]}, [G_local, 1]={[num_local, 1]} or [G_local, N]="
        f"{[num_local, n]}, got {list(value.shape)}")
  value = value.reshape((1, -1)) if value.ndim < 2 else value
  return jnp.broadcast_to(value.astype(jnp.float32), (num_local, n))


def _activation(activation, n: int):
  """The activation, checked to keep the shape of what it is applied to (a gated one to
  halve an even number of columns)."""
  fn = resolve_activation(activation)
  if is_gated(activation) and n % 2:
    raise ValueError(
        f"gated activation {activation!r} needs rhs with 2N columns ([gate | up] halves), "
        f"got N={n}")
  if fn is None or isinstance(activation, str):
    return activation
  probe = jax.ShapeDtypeStruct((2, max(n, 1)), jnp.float32)
  out = jax.eval_shape(fn, probe)
  if getattr(out, "shape", None) != probe.shape:
    raise ValueError(
        f"activation {activation!r} must keep the shape of its input (it is applied to the "
        f"[rows, N] accumulator): it maps float32{list(probe.shape)} to "
        f"{describe(out) if hasattr(out, 'shape') else repr(out)}")
  return activation


def _precision_name(value):
  if isinstance(value, lax.Precision):
    return value
  if isinstance(value, str):
    try:
      return lax.Precision(value)
    except ValueError:
      pass
    if hasattr(lax, "DotAlgorithmPreset") and value.upper() in lax.DotAlgorithmPreset.__members__:
      return lax.DotAlgorithmPreset[value.upper()]
  raise ValueError(
      f"precision={value!r} is not a jax.lax.Precision: use None, 'default', 'high', "
      "'highest' (or 'bfloat16', 'tensorfloat32', 'float32', 'fastest'), a "
      "jax.lax.Precision, a pair of those, or a jax.lax.DotAlgorithmPreset")


def _precision(precision):
  """The precision as jax.lax.dot_general takes it, in a hashable form."""
  if precision is None:
    return None
  presets = tuple(getattr(lax, name) for name in ("DotAlgorithmPreset", "DotAlgorithm")
                  if hasattr(lax, name))
  if presets and isinstance(precision, presets):
    return precision
  if isinstance(precision, (tuple, list)):
    if len(precision) != 2:
      raise ValueError(f"precision as a sequence must be a pair, got {precision!r}")
    pair = tuple(_precision_name(p) for p in precision)
    if not all(isinstance(p, lax.Precision) for p in pair):
      raise ValueError(f"a precision pair must hold two jax.lax.Precision, got {precision!r}")
    return pair
  return _precision_name(precision)


def _out_dtype(preferred_element_type, lhs, rhs, quantized: bool, float_activations: bool):
  if preferred_element_type is None:
    if quantized:  # weight-only keeps the activations' dtype; others give f32
      return np.dtype(lhs.dtype) if float_activations else np.dtype(jnp.float32)
    return np.dtype(jnp.promote_types(lhs.dtype, rhs.dtype))
  try:
    dtype = np.dtype(jnp.dtype(preferred_element_type))
  except TypeError as err:
    raise ValueError(f"preferred_element_type={preferred_element_type!r} is not a dtype") from err
  if dtype == np.bool_ or not (jnp.issubdtype(dtype, jnp.floating)
                               or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"preferred_element_type must be a floating or integer dtype, got {dtype}")
  if (not quantized and jnp.issubdtype(dtype, jnp.integer)
      and jnp.issubdtype(lhs.dtype, jnp.floating)):
    raise ValueError(
        f"preferred_element_type={dtype} is an integer type but the operands are floating "
        f"({lhs.dtype} x {rhs.dtype}): the result would be truncated; use a float type, or "
        "quantized operands (an integer output of a quantized gmm is requantized)")
  return dtype


def _platform(platform):
  if platform is None:
    return None
  if not isinstance(platform, str) or dispatch.normalize_platform(platform) not in PLATFORMS:
    raise ValueError(f"platform must be None or one of {PLATFORMS}, got {platform!r}")
  return dispatch.normalize_platform(platform)


# ---------------------------------------------------------------------------- the call


@dataclasses.dataclass(frozen=True)
class _Call:
  """A validated, canonical gmm call and how to route it."""

  lhs: Any
  rhs: Any
  counts: Array
  group_offset: Array
  bias: Array | None
  cfg: GmmConfig
  quantize_lhs: QuantSpec | None
  quantize_rhs: QuantSpec | None
  straight_through: bool
  output_scale: Array | None
  output_offset: Array | None
  sharding: sharding_lib.GmmSharding | None
  rows: Rows = NO_ROWS
  quantization: Fp8Training | None = None


def _unwrap_grouped_array(lhs, groups, group_type, group_list_type, transpose_lhs):
  """A GroupedArray lhs carries its group list (cumsum) and its grouping type."""
  if not isinstance(lhs, GroupedArray):
    return lhs, groups, group_type, group_list_type, None
  if groups is not None:
    raise ValueError("pass either a GroupedArray lhs or a group_list, not both")
  if transpose_lhs:
    raise ValueError("a GroupedArray lhs is stored untransposed; transpose_lhs must be False")
  inferred = "m" if lhs.variable_dim == 0 else "k"
  if group_type is not None and group_type != inferred:
    raise ValueError(
        f"a GroupedArray with variable_dim={lhs.variable_dim} means group_type="
        f"{inferred!r}, got {group_type!r}")
  return lhs.values, lhs.offsets, inferred, "cumsum", lhs.offsets if inferred == "m" else None


def _index_vector(value, name: str, length: int | None):
  if isinstance(value, (list, tuple)):
    value = np.asarray(value)
  try:
    value = jnp.asarray(value)
  except (TypeError, ValueError) as err:
    raise ValueError(f"{name} must be an int array, got {value!r}: {err}") from None
  if value.ndim != 1 or not jnp.issubdtype(value.dtype, jnp.integer):
    raise ValueError(f"{name} must be a 1-D int array, got {jax.typeof(value)}")
  if length is not None and value.shape[0] != length:
    raise ValueError(f"{name} must have the {length} rows of the grouped problem, got "
                     f"{jax.typeof(value)}")
  return value.astype(jnp.int32)


def _row_operands(lhs, lhs_indices, row_weights, out_indices, out_rows, *, group_type,
                  transpose_lhs, quantized_dynamic, sharding):
  """(Rows, gather_rows, out_rows, R) of a call: the row operands checked for shape and
  dtype (their values are checked with the group list, `_check_row_values`)."""
  given = [name for name, v in (("lhs_indices", lhs_indices), ("row_weights", row_weights),
                                ("out_indices", out_indices), ("out_rows", out_rows))
           if v is not None]
  if not given:
    return NO_ROWS, None, None, None
  supported = ("lhs_indices, row_weights and out_indices/out_rows are supported for "
               "group_type='m' with a float or weight-only-quantized gmm, untransposed lhs, "
               "no dynamic quantization and no sharding= (use them per shard)")
  if group_type != "m" or quantized_dynamic or sharding is not None:
    raise NotImplementedError(f"{supported}; got {', '.join(given)} with group_type="
                              f"{group_type!r}" + (", dynamic quantization" if
                                                   quantized_dynamic else "")
                              + (", sharding=" if sharding is not None else ""))
  gather_rows = None
  if lhs_indices is not None:
    if transpose_lhs or isinstance(lhs, QArray):
      raise NotImplementedError(f"{supported}; got lhs {describe(lhs)} with transpose_lhs="
                                f"{transpose_lhs}")
    lhs_indices = _index_vector(lhs_indices, "lhs_indices", None)
    gather_rows = lhs_indices.shape[0]
  num_rows = gather_rows if gather_rows is not None else (
      lhs.shape[1] if transpose_lhs else lhs.shape[0])
  if row_weights is not None:
    row_weights = jnp.asarray(row_weights)
    if row_weights.shape != (num_rows,) or not jnp.issubdtype(row_weights.dtype, jnp.floating):
      raise ValueError(f"row_weights must be a float [R] = [{num_rows}] vector (one weight per "
                       f"row of the grouped problem), got {jax.typeof(row_weights)}")
  if out_indices is None and out_rows is not None:
    raise ValueError("out_rows needs out_indices (where each row of the grouped problem goes)")
  if out_indices is not None:
    out_indices = _index_vector(out_indices, "out_indices", num_rows)
    out_rows = num_rows if out_rows is None else out_rows
    if not is_index(out_rows) or out_rows < 0:
      raise ValueError(f"out_rows must be a non-negative int, got {out_rows!r}")
    out_rows = int(out_rows)
  return Rows(lhs_indices, row_weights, out_indices), gather_rows, out_rows, num_rows


def _concrete(x) -> bool:
  return x is not None and not isinstance(x, jax.core.Tracer)


def _check_row_values(rows: Rows, counts, group_offset, num_local: int, num_rows: int,
                      num_tokens: int, out_rows):
  """Concrete indices of the rows that are written (rows of local groups): lhs_indices in
  [0, T), out_indices in [0, out_rows) and unique. Traced ones have defined results (an
  out-of-range index reads or writes nothing)."""
  if rows.lhs_indices is None and rows.out_indices is None:
    return
  if not all(_concrete(x) for x in (counts, group_offset)) or not any(
      _concrete(x) for x in (rows.lhs_indices, rows.out_indices)):
    return
  written = np.asarray(metadata.row_group_ids(counts, num_rows, group_offset, num_local) >= 0)
  for name, indices, limit, what in (("lhs_indices", rows.lhs_indices, num_tokens,
                                      "the rows of lhs"),
                                     ("out_indices", rows.out_indices, out_rows,
                                      "the rows of the result")):
    if _concrete(indices):
      values = np.asarray(indices)[written]
      bad = values[(values < 0) | (values >= limit)]
      if bad.size:
        raise ValueError(f"{name} must lie in [0, {limit}) ({what}) for the rows of local "
                         f"groups, got {bad[:8].tolist()}")
  if _concrete(rows.out_indices):
    values = np.asarray(rows.out_indices)[written]
    unique, seen = np.unique(values, return_counts=True)
    if (seen > 1).any():
      raise ValueError(f"out_indices of the rows of local groups must be unique (each result "
                       f"row written once); repeated: {unique[seen > 1][:8].tolist()}")


def _validate(lhs, rhs, groups, *, group_type, group_list_type, num_groups, bias, activation,
              transpose_lhs, transpose_rhs, preferred_element_type, precision, group_offset,
              implementation, interpret, tiling, output_scale, output_offset, quantize_lhs,
              quantize_rhs, straight_through, sharding, platform, lhs_indices=None,
              row_weights=None, out_indices=None, out_rows=None,
              deterministic=True, quantization=None, lhs_activation=None) -> _Call:
  """Every check of a gmm call, and its canonical form."""
  transpose_lhs = _check_bool(transpose_lhs, "transpose_lhs")
  transpose_rhs = _check_bool(transpose_rhs, "transpose_rhs")
  interpret = _check_bool(interpret, "interpret")
  deterministic = _check_bool(deterministic, "deterministic")
  straight_through = _check_bool(straight_through, "straight_through")
  group_type = "m" if group_type is None else group_type
  if group_type not in GROUP_TYPES:
    raise ValueError(f"group_type must be one of {GROUP_TYPES}, got {group_type!r}")
  if groups is None:
    raise ValueError("gmm needs a group_list (or a GroupedArray lhs)")
  lhs, rhs = _as_operand(lhs, "lhs"), _as_operand(rhs, "rhs")
  _check_static(lhs=lhs, rhs=rhs, group_list=groups)
  _check_quant_specs(lhs, rhs, quantize_lhs, quantize_rhs)
  lhs_q, rhs_q = isinstance(lhs, QArray), isinstance(rhs, QArray)
  quantization = as_quantization(quantization)
  if quantization is not None:
    given = [name for name, v in (("a QArray lhs", lhs_q), ("a QArray rhs", rhs_q),
                                  ("quantize_lhs", quantize_lhs), ("quantize_rhs", quantize_rhs),
                                  ("output_scale", output_scale),
                                  ("output_offset", output_offset), ("sharding=", sharding))
             if v is not None and v is not False]
    if given:
      raise NotImplementedError(
          f"quantization= (fp8 training) quantizes float operands itself and runs per "
          f"device under jit; it does not combine with {', '.join(given)}")
  quantized_call = lhs_q or rhs_q or quantize_lhs is not None or quantize_rhs is not None
  if not quantized_call:
    lhs, rhs = _promote_plain(lhs, rhs)
  elif not lhs_q and not jnp.issubdtype(lhs.dtype, jnp.floating):
    raise ValueError(f"with a quantized rhs, lhs must be a float array or a QArray, got "
                     f"{describe(lhs)}")
  lhs_activation = _lhs_activation(
      lhs_activation, group_type=group_type, transpose_lhs=transpose_lhs, lhs=lhs, rhs=rhs,
      quantized=quantized_call, lhs_indices=lhs_indices, quantization=quantization)
  m, k, n = _problem_dims(lhs, rhs, group_type, transpose_lhs, transpose_rhs,
                          lhs_activation is not None)
  rows, gather_rows, out_rows, num_rows = _row_operands(
      lhs, lhs_indices, row_weights, out_indices, out_rows, group_type=group_type,
      transpose_lhs=transpose_lhs,
      quantized_dynamic=quantize_lhs is not None or quantize_rhs is not None,
      sharding=sharding)
  num_tokens = m
  if gather_rows is not None:
    m = gather_rows
  dim_size, dim_name = (m, "M") if group_type == "m" else (k, "K")
  counts, num_total, num_local = _group_counts(
      groups, group_list_type, num_groups, group_type, rhs.shape, group_offset, dim_size,
      dim_name)
  offset = _group_offset(group_offset, num_total)
  _check_row_values(rows, counts, offset, num_local, num_rows or m, num_tokens, out_rows)
  bias = _bias(bias, num_local, n)
  # The output scale and offset meet the result's columns (half the product's when gated).
  n_out = n // 2 if is_gated(activation) else n
  output_scale = _per_group_vector(output_scale, "output_scale", num_local, n_out)
  output_offset = _per_group_vector(output_offset, "output_offset", num_local, n_out)
  if not quantized_call and (output_scale is not None or output_offset is not None):
    raise NotImplementedError(
        "output_scale/output_offset (requantization) apply to quantized operands (QArray or "
        "quantize_lhs/quantize_rhs); for float operands scale the result")
  if tiling is not None and not isinstance(tiling, (Tiling, Tilings)) and not callable(tiling):
    raise ValueError(f"tiling must be None, a gmm_jax.Tiling, a callable gmm_jax.Problem -> "
                     f"Tiling | None, or gmm_jax.Tilings, got {tiling!r}")
  if sharding is not None and not isinstance(sharding, sharding_lib.GmmSharding):
    raise ValueError(f"sharding must be a gmm_jax.GmmSharding or None, got {sharding!r}")
  float_activations = not lhs_q and quantize_lhs is None
  cfg = GmmConfig(
      group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs,
      transpose_rhs=transpose_rhs, activation=_activation(activation, n),
      out_dtype=_out_dtype(preferred_element_type, lhs, rhs, quantized_call, float_activations),
      precision=_precision(precision),
      implementation=dispatch.check_implementation(implementation), interpret=interpret,
      tiling=tiling, platform=_platform(platform), gather_rows=gather_rows,
      row_weights=rows.row_weights is not None, out_rows=out_rows,
      deterministic=deterministic, lhs_activation=lhs_activation)
  if rows.row_weights is not None and not jnp.issubdtype(cfg.out_dtype, jnp.floating):
    raise NotImplementedError(f"row_weights need a floating result, got {cfg.out_dtype}")
  if quantization is not None:
    fp8_training.check(lhs, rhs, cfg)
  return _Call(lhs, rhs, counts, offset, bias, cfg, quantize_lhs, quantize_rhs,
               straight_through, output_scale, output_offset, sharding, rows, quantization)


def _route(call: _Call):
  """The one path a canonical call takes down the floors."""
  args = (call.lhs, call.rhs, call.counts, call.group_offset, call.bias, call.cfg)
  dynamic = call.quantize_lhs is not None or call.quantize_rhs is not None
  requantized = call.output_scale is not None or call.output_offset is not None
  if call.sharding is not None:
    if dynamic or requantized:
      raise NotImplementedError(
          "sharded gmm supports float and QArray operands; dynamic quantization "
          "(quantize_lhs/quantize_rhs) and output_scale/output_offset run per shard with "
          "shard-local statistics, so quantize outside the sharded call")
    return sharding_lib.sharded_gmm(*args, call.sharding)
  if call.quantization is not None:
    return fp8_training.fp8_gmm(*args, call.quantization, rows=call.rows)
  if dynamic:
    return quantized.dynamic_gmm(*args, call.quantize_lhs, call.quantize_rhs,
                                 call.straight_through, call.output_scale, call.output_offset)
  if isinstance(call.lhs, QArray) or isinstance(call.rhs, QArray):
    return quantized.gmm_quantized(*args, call.output_scale, call.output_offset, call.rows)
  return op.gmm(*args, rows=call.rows)


# The options a masked lhs does not take (unset: None, "counts" or False).
_MASKED_UNSUPPORTED = ("group_list_type", "num_groups", "transpose_lhs", "group_offset",
                       "quantize_lhs", "quantize_rhs", "sharding", "lhs_indices",
                       "out_indices", "out_rows", "lhs_activation")


def _masked_gmm(lhs: MaskedArray, rhs, group_list, options: dict) -> MaskedArray:
  """gmm of a masked lhs ``[G, R, K]`` (counts ``[G]``) and rhs ``[G, K, N]`` -> masked
  ``[G, R, N]`` with the same counts (and num_rows bound).

  It is the m-grouped gmm of the ``[G*R, K]`` slots read through row operands, with a
  grouped problem of ``lhs.num_rows`` rows (not G*R: a decode step's T*k rows, when the
  bound is set, rather than E*T slots): row r of the grouped problem reads slot
  ``lhs_indices[r]`` and is written back to the same slot
  (``out_indices``), so every implementation that serves row operands (the reference, the
  XLA path, the Pallas kernels) serves the masked layout with no copy of the activations,
  padding slots are never read (no gradient to them), never written (exactly 0), and the
  gradients are the row-operand gmm's own (dlhs scatters into the slots, drhs reads them).
  """
  supported = ("a MaskedArray lhs supports group_type='m' with rhs [G, K, N] (or a "
               "weight-only QArray rhs), bias, activation (gated too), row_weights [G, R], "
               "transpose_rhs, preferred_element_type, precision, implementation, interpret, "
               "tiling, platform, deterministic")
  if group_list is not None:
    raise ValueError("a MaskedArray lhs carries its own counts; pass no group_list")
  if options.get("group_type") not in (None, "m"):
    raise NotImplementedError(f"{supported}; got group_type={options['group_type']!r}")
  defaults = {"group_list_type": "counts", "transpose_lhs": False}
  given = [name for name in _MASKED_UNSUPPORTED if options[name] is not None and not (
      isinstance(options[name], (str, bool)) and options[name] == defaults.get(name))]
  if given:
    raise NotImplementedError(f"{supported}; got {', '.join(given)}")
  values = lhs.values
  if isinstance(values, QArray) or as_qarray(values) is not None:
    raise NotImplementedError(f"{supported}; got a quantized lhs {describe(values)}")
  g, max_rows, k = lhs.shape
  rhs_q = as_qarray(rhs)
  rhs_shape = tuple(np.shape(rhs if rhs_q is None else rhs_q.qvalue))
  rhs_k = rhs_shape[2 if options["transpose_rhs"] else 1] if len(rhs_shape) == 3 else None
  if rhs_k is None or rhs_shape[0] != g or rhs_k != k:
    raise GmmShapeError(
        f"a MaskedArray lhs {lhs.shape} ([G, max_rows, K]) needs rhs [G, K, N] with G={g}, "
        f"K={k} ([G, N, K] with transpose_rhs), got rhs {describe(rhs)} (transpose_rhs="
        f"{options['transpose_rhs']})")
  total, num_rows = g * max_rows, lhs.num_rows
  counts = metadata.counts_in_range(jnp.clip(lhs.counts, 0, max_rows), 0, num_rows)
  slots = grouped_array.ragged_slots(counts, max_rows, num_rows)
  row_weights = options.pop("row_weights")
  if row_weights is not None:
    row_weights = jnp.asarray(row_weights)
    if row_weights.shape != (g, max_rows) or not jnp.issubdtype(row_weights.dtype,
                                                                 jnp.floating):
      raise ValueError(f"row_weights with a MaskedArray lhs must be float [G, max_rows] = "
                       f"[{g}, {max_rows}], got {jax.typeof(row_weights)}")
    row_weights = jnp.take(row_weights.reshape(total), slots, mode="fill", fill_value=0)
  for name in _MASKED_UNSUPPORTED + ("group_type",):
    options.pop(name)
  out = gmm(jnp.reshape(values, (total, k)), rhs, counts, lhs_indices=slots,
            out_indices=slots, out_rows=total, row_weights=row_weights, **options)
  return MaskedArray(out.reshape(g, max_rows, out.shape[-1]), counts, lhs.num_rows)


def gmm(lhs: jax.typing.ArrayLike | QArray | GroupedArray | MaskedArray,
        rhs: jax.typing.ArrayLike | QArray,
        group_list: jax.typing.ArrayLike | None = None, *, group_type: str | None = None,
        group_list_type: str = "counts", num_groups: int | None = None, bias=None,
        activation: str | Callable[[Array], Array] | None = None, transpose_lhs: bool = False,
        transpose_rhs: bool = False, preferred_element_type=None, precision=None,
        group_offset=None, implementation: str | Sequence[str] | None = None,
        interpret: bool = False, tiling: Tiling | Tilings | Callable | None = None, output_scale=None,
        output_offset=None, quantize_lhs: QuantSpec | None = None,
        quantize_rhs: QuantSpec | None = None, straight_through: bool = True,
        sharding: sharding_lib.GmmSharding | None = None,
        platform: str | None = None, lhs_indices=None, row_weights=None, out_indices=None,
        out_rows: int | None = None, deterministic: bool = True,
        quantization: str | Fp8Training | None = None,
        lhs_activation: str | None = None) -> Array | GroupedArray | MaskedArray:
  """Grouped matrix multiplication with a fused bias + activation epilogue.

  m-grouping (``group_type="m"``): lhs ``[M, K]`` (``[K, M]`` if transpose_lhs), rhs
  ``[G, K, N]`` (``[G, N, K]`` if transpose_rhs) -> ``[M, N]``; the rows of group g are
  multiplied by ``rhs[g]``. Rows at or past the total of the group sizes, and rows of groups
  not held locally (group_offset), are exactly 0.

  k-grouping (``group_type="k"``): lhs ``[M, K]`` (``[K, M]``), rhs ``[K, N]`` (``[N, K]``)
  with K split into contiguous groups -> ``[G, M, N]``, ``out[g] = lhs[:, cols of g] @
  rhs[rows of g]``; an empty group gives ``activation(bias[g])``.

  gmm is a JAX primitive: jit, grad (any order), jvp/linearize, linear_transpose, vmap (over
  any operand, group sizes included) and shard_map all compose with it; every derivative is
  another gmm.

  Args:
    lhs: the left operand, a `QArray`, a `GroupedArray` (its offsets are then the group
      list and its variable_dim picks the grouping: 0 -> "m", 1 -> "k"), or a
      `MaskedArray` ``[G, max_rows, K]`` with counts ``[G]`` (the decode layout: rhs ``[G,
      K, N]``, no group_list; the result is a MaskedArray ``[G, max_rows, N]`` with the
      same counts, rows past each count exactly 0 and no gradient to or from them;
      row_weights are then ``[G, max_rows]``).
    rhs: the right operand (per-group weights for "m"), or a `QArray`. Plain operands of
      two kinds (an integer array with a float one) are multiplied in the float's dtype,
      as `jax.lax.ragged_dot` promotes them.
    group_list: ``[G]`` int sizes ("counts"), ``[G]`` non-decreasing end offsets ("cumsum")
      or ``[E, 2]`` rows ``(group_index, size)`` with increasing indices ("sparse"; unlisted
      groups are empty). May be traced: one compilation serves any sizes. A concrete list
      is validated; a traced one has defined results when invalid (see
      `gmm_jax.check_group_list`).
    group_type: "m" or "k"; default "m" (or from a GroupedArray lhs).
    group_list_type: "counts", "cumsum" or "sparse".
    num_groups: G of a sparse list (default ``rhs.shape[0]`` for "m"); for "k" the number
      of output groups (default G of the list).
    bias: ``[G_local, N]``, added in the f32 accumulator.
    activation: None, "relu", "gelu_tanh", "gelu", "fast_gelu", "silu" or a jnp-traceable
      elementwise callable, applied after the bias and before the cast.
    transpose_lhs, transpose_rhs: operands stored transposed (see shapes above).
    preferred_element_type: output dtype; default the promoted input dtype. Floating inputs
      always accumulate in f32; integer inputs accumulate exactly in int32. An integer type
      needs integer or quantized operands.
    precision: as in jax.lax.dot_general (None, a name, a jax.lax.Precision, a pair, or a
      jax.lax.DotAlgorithmPreset).
    group_offset: int or traced int32 scalar (or ``[1]`` array): rhs (for "m") or the
      output (for "k") holds only groups ``[group_offset, group_offset + G_local)`` of the
      list (expert parallelism).
    implementation: None/"auto" (the platform's chain), a registered name ("xla",
      "reference", "pallas_triton", "pallas_tpu"; see `gmm_jax.implementations`), or a
      sequence of names tried in order (the first that serves the call runs).
    interpret: run Pallas kernels in interpret mode (any platform).
    tiling: None: each implementation picks its tiles from `gmm_jax.autotune`'s cache,
      else its built-in per-target tile table, else its heuristic. A `Tiling` fixes the
      forward call's tiles (the backward's gmms keep the automatic choice); a callable
      ``gmm_jax.Problem -> Tiling | None`` chooses for every gmm of the call, forward and
      backward (None: the automatic choice); `gmm_jax.Tilings(fwd=, dlhs=, drhs=)` gives
      each of the three gmms its own (Tiling, callable or None). A backend that cannot use
      a tiling (e.g. Triton needs powers of 2) raises NotImplementedError and the chain
      moves on.
    output_scale, output_offset: quantized operands only: ``y * output_scale +
      output_offset`` after the activation, before the cast (requantization when the output
      dtype is an integer: rounded to nearest even and saturated). Scalar, ``[N]``,
      ``[G_local, 1]`` or ``[G_local, N]``.
    quantize_lhs, quantize_rhs: `QuantSpec` objects: gmm quantizes the float operand itself
      (dynamic quantization, e.g. per-token int8 activations) and runs the quantized mode.
    straight_through: with quantize_lhs/quantize_rhs, gradients w.r.t. the float operands
      are the float gmm's gradients at the dequantized operands (the straight-through
      estimator); False gives them no gradient.
    sharding: a `GmmSharding(mesh, lhs=PartitionSpec, rhs=PartitionSpec)`: how the operands
      lie on a device mesh; gmm then runs per shard with the matching strategy (expert
      parallel, rows, columns, contraction; see `gmm_jax.explain`) through `jax.shard_map`.
    platform: None (the platform the call is lowered for: the devices of its operands, a
      topology's abstract mesh, ``jax.default_device``, or the default backend), or "cpu",
      "gpu", "tpu" to use that platform's chain of implementations.
    quantization: None, "fp8", "fp8_e5m2_grads" or a `gmm_jax.Fp8Training`: fp8 training
      of a float m-grouped gmm. The forward and both backward gmms multiply 8-bit float
      values with f32 accumulation, the scales computed inside the op: activations in 1 x
      128 blocks along K, weights in 128 x 128 blocks (E4M3), the output cotangent in 1 x
      128 blocks (dlhs) and the weight gradient's operands in 128 x 1 blocks along the
      tokens (E4M3, or E5M2 with "fp8_e5m2_grads"). Gradients are the fp8 products (the
      straight-through estimate, DeepSeek-V3's recipe); reverse mode only (no jvp).
      Kernels that serve the "blocked" mode run them with fp8 MMA (see
      `gmm_jax.explain`), others dequantize. Not combined with QArray operands,
      quantize_lhs/quantize_rhs, output_scale/offset or sharding=.
    lhs_activation: None, or a gated activation ("swiglu", "geglu", "geglu_tanh",
      "swiglu_clamped") applied to lhs before the product (a gated prologue; m-grouping,
      float lhs, not transposed or gathered): lhs ``[M, 2K]`` is a pre-activation z, gate
      half then up half, and the product reads ``act(z[:, :K]) * z[:, K:]`` (in f32,
      rounded to lhs's dtype), so ``gmm(z, w_down, lhs_activation="swiglu")`` is an MoE
      down projection reading the up projection's output. Its input gradient is written
      by one gmm: the dlhs gmm's epilogue forms the ``[M, 2K]`` cotangent of z from its
      product and z (natively on the TPU kernel, see `gmm_jax.explain`), with no ``[M,
      K]`` cotangent of the activation kept beside it.
    deterministic: True (default): the result, and every gradient, is bitwise identical
      from run to run on every implementation (split-K partial sums are summed in a fixed
      order, token rows in a fixed order). False lets an implementation add partial sums
      with atomics where that is faster (Triton's split-K on GPUs); `gmm_jax.explain` says
      which implementations do.

  Row operands (m-grouping; an MoE layer's token dispatch and combine inside the gmm, with
  no permuted copy of the activations):

  * lhs_indices: int ``[R]``: row r of the grouped problem reads ``lhs[lhs_indices[r]]``;
    lhs is ``[T, K]`` for any T and the group list covers the R rows.
  * row_weights: float ``[R]``: row r of the result is multiplied by it after the
    activation, in f32 before the cast (the router probability); differentiable.
  * out_indices: int ``[R]`` (with out_rows, default R): row r is written to row
    ``out_indices[r]`` of an ``[out_rows, N]`` result; the written rows' indices must be
    unique; rows nothing writes are exactly 0 (top-k combine: ``out_rows = T*k`` slots,
    then a sum over k).

  Concrete out-of-range or repeated (out_indices) indices of written rows raise ValueError;
  traced ones read a zero row / write nothing. The gradient w.r.t. lhs sums each token's
  rows in a fixed order (`gmm_jax.route` makes the indices). A gated activation
  ("swiglu", "geglu", "geglu_tanh", "swiglu_clamped": gpt-oss's clamped SwiGLU) takes rhs
  with 2N columns, the gate half then the up half, and gives N: ``act(z[:, :N]) * z[:, N:]``
  (bias ``[G, 2N]``).

  Quantized operands (a `QArray`, or a qwix QArray) select a mode: float lhs x QArray rhs is
  weight-only (``x @ dequantize(W)``); QArray x QArray multiplies the quantized values
  exactly (int32 accumulation for integers) and applies both scales, per K block when a
  scale varies along K (MX, G-B, per-group). An int32 bias is added in the accumulator
  (before the scales); a float bias after them. See `gmm_jax.quantize`.

  Returns:
    ``[M, N]`` for "m" (a `GroupedArray` with lhs's offsets if lhs was one, a
    `MaskedArray` ``[G, max_rows, N]`` if lhs was one), ``[G_local, M, N]`` for "k".

  Raises:
    GmmShapeError: an operand or group list of the wrong rank, shape, dtype or type, or
      shapes that do not fit together (a TypeError, as jax raises for these, and a
      ValueError).
    ValueError: malformed names, flags or options, or a concrete group list that is
      negative, decreasing (cumsum), has bad sparse indices, does not fit int32 or sums
      past the grouped dimension.
    NotImplementedError: a valid combination no registered implementation serves, or
      symbolic dimensions (`jax.export`; gmm_jax.ragged_dot serves those).
  """
  if isinstance(lhs, MaskedArray):
    options = dict(locals())
    return _masked_gmm(options.pop("lhs"), options.pop("rhs"), options.pop("group_list"),
                       options)
  lhs, group_list, group_type, group_list_type, out_offsets = _unwrap_grouped_array(
      lhs, group_list, group_type, group_list_type, transpose_lhs)
  call = _validate(
      lhs, rhs, group_list, group_type=group_type, group_list_type=group_list_type,
      num_groups=num_groups, bias=bias, activation=activation, transpose_lhs=transpose_lhs,
      transpose_rhs=transpose_rhs, preferred_element_type=preferred_element_type,
      precision=precision, group_offset=group_offset, implementation=implementation,
      interpret=interpret, tiling=tiling, output_scale=output_scale,
      output_offset=output_offset, quantize_lhs=quantize_lhs, quantize_rhs=quantize_rhs,
      straight_through=straight_through, sharding=sharding, platform=platform,
      lhs_indices=lhs_indices, row_weights=row_weights, out_indices=out_indices,
      out_rows=out_rows, deterministic=deterministic, quantization=quantization,
      lhs_activation=lhs_activation)
  if out_offsets is not None and call.cfg.has_rows:
    raise ValueError("a GroupedArray lhs carries its own row layout; pass row operands "
                     "(lhs_indices, row_weights, out_indices) with a plain lhs")
  out = _route(call)
  return out if out_offsets is None else GroupedArray(out, out_offsets, 0)


def explain(lhs: jax.typing.ArrayLike | QArray | GroupedArray | jax.ShapeDtypeStruct,
            rhs: jax.typing.ArrayLike | QArray | jax.ShapeDtypeStruct,
            group_list: jax.typing.ArrayLike | jax.ShapeDtypeStruct | None = None,
            **kwargs: Any) -> str:
  """What `gmm(lhs, rhs, group_list, **kwargs)` would do, and why: the quantization mode,
  the sharding strategy and collectives (with ``sharding=``, or the plan a call on operands
  placed on several devices was split by, arrays or ShapeDtypeStructs with a sharding:
  at trace time on Explicit axes, else by the partitioning rule under plain jit; on TPU,
  where no partitioner splits a kernel, that the call runs as the dense reference XLA
  partitions, and the fix), and which implementation serves each gmm of the forward on the
  platform it is lowered for (each skipped implementation with its reason).

  Lowers the call, and compiles it when the operands are sharded (nothing is computed);
  arguments as for `gmm`. Arrays placed on (or typed for) other devices, or
  ``jax.default_device``, decide the platform; ``platform="tpu"`` (or "gpu") explains the
  call for that platform from any machine (lowered for it; where this jax cannot lower the
  chosen kernel without such a device, the choice is still reported, with the reason).
  """
  lines = []
  lq, rq = as_qarray(lhs), as_qarray(rhs)
  probe = GmmConfig(group_type=kwargs.get("group_type") or "m", num_local=1,
                    transpose_lhs=kwargs.get("transpose_lhs", False),
                    transpose_rhs=kwargs.get("transpose_rhs", False))
  recipe = as_quantization(kwargs.get("quantization"))
  if recipe is not None:
    lines.append(
        f"quantization: fp8 training ({recipe.dtype.name} forward, {recipe.grad_dtype.name} "
        f"gradients, {recipe.block}-blocks: the forward, dlhs and drhs are blocked-mode gmms)")
  elif kwargs.get("quantize_lhs") is not None or kwargs.get("quantize_rhs") is not None:
    lines.append("quantization: dynamic (gmm quantizes the float operands; gradients "
                 f"{'straight-through' if kwargs.get('straight_through', True) else 'none'})")
  elif lq is not None or rq is not None:
    lines.append(f"quantization: {quant_mode(lq or lhs, rq or rhs, probe)}")
  else:
    lines.append("quantization: none")
  sharding = kwargs.get("sharding")
  if sharding is not None:
    lines.append(sharding_lib.plan(sharding, probe, np.ndim(lq.qvalue if lq else lhs),
                                   np.ndim(rq.qvalue if rq else rhs)).describe())
  if isinstance(group_list, (list, tuple)):
    group_list = np.asarray(group_list)
  # ``platform=`` other than the default backend's: lower for that platform (the kernels of
  # another platform cannot be lowered for this one).
  target = kwargs.get("platform")
  if target is not None:
    target = dispatch.normalize_platform(target)
    if target == dispatch.normalize_platform(jax.default_backend()):
      target = None
  with dispatch.record() as decisions, dispatch.record_plans() as plans:
    fn = jax.jit(lambda l, r, g: gmm(l, r, g, **kwargs))
    lowered, not_lowered = None, None
    if target is None:
      lowered = fn.lower(lhs, rhs, group_list)
    else:
      try:
        lowered = fn.trace(lhs, rhs, group_list).lower(
            lowering_platforms=("cuda" if target == "gpu" else target,))
      except Exception as err:  # noqa: BLE001  (the choice is made; reported below)
        not_lowered = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    if lowered is not None and sharding is None and _on_several_devices(
        (lhs, rhs, group_list, kwargs.get("bias"))):
      # Plain jit with sharded operands: the partitioner picks the strategy (and the
      # per-device gmms are traced) while the program compiles.
      lowered.compile()
  for plan in plans:
    lines.append("sharding: " + plan.describe())
  lines.append("implementations (forward):")
  seen = []
  for decision in decisions:
    text = decision.describe()
    if text not in seen:
      seen.append(text)
      lines.append("  - " + text.replace("\n", "\n  "))
  if not_lowered is not None:
    lines.append(f"(the chosen kernel was not lowered for {target} here: {not_lowered})")
  return "\n".join(lines)


def _on_several_devices(tree) -> bool:
  """Whether any array (or ShapeDtypeStruct) in `tree` is placed on more than one device."""
  for leaf in jax.tree.leaves(tree):
    sharding = getattr(leaf, "sharding", None)
    if sharding is not None and len(getattr(sharding, "device_set", ())) > 1:
      return True
  return False
