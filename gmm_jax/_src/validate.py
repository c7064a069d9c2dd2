"""The checks of a gmm call's arguments, and their canonical form.

`validate` turns what a user passed to `gmm` into a `Call` (canonical operands, int32 group
sizes, a frozen `GmmConfig`), raising `GmmShapeError`, `ValueError` or
`NotImplementedError` with the offending values.

Floor 5, with `api` (the public `gmm`, which routes the `Call`): the only place that
validates user input and builds a `GmmConfig`. Below it every layer takes canonical
operands ``(lhs, rhs, counts, group_offset, bias, cfg)``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.backends import fp8_training, registry
from gmm_jax._src.core import group_list, jax_private, metadata
from gmm_jax._src.core.config import (GATED_ACTIVATIONS, GROUP_TYPES, PLATFORMS, GmmConfig,
                                      Tiling, Tilings, is_gated)
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, resolve_activation
from gmm_jax._src.core.errors import GmmShapeError, describe, is_index
from gmm_jax._src.core.grouped_array import GroupedArray
from gmm_jax._src.core.qarray import (Fp8Training, QArray, QuantSpec, as_qarray,
                                      as_quantization, check_fits)
from gmm_jax._src.sharding import spec as sharding_lib

Array = jax.Array


# ---------------------------------------------------------------------------- operands


def _check_bool(value, name: str) -> bool:
  if not isinstance(value, (bool, np.bool_)):
    raise ValueError(f"{name} must be a bool, got {value!r}")
  return bool(value)


def _check_interpret(value):
  """`interpret`: a bool, or the parameters of one of jax's simulators."""
  if isinstance(value, (bool, np.bool_)):
    return bool(value)
  if jax_private.is_simulator_params(value):
    return value
  raise ValueError("interpret must be a bool, a jax.experimental.pallas.tpu.InterpretParams "
                   f"or a jax.experimental.pallas.mosaic_gpu.InterpretGPUParams, got {value!r}")


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
                    lhs_indices):
  """The gated prologue's name, after the checks of what it combines with."""
  if lhs_activation is None:
    return None
  if not is_gated(lhs_activation):
    raise ValueError(f"lhs_activation must be None or a gated activation name "
                     f"{GATED_ACTIVATIONS}, got {lhs_activation!r}")
  given = [name for name, v in (
      ("group_type='k'", group_type == "k"), ("transpose_lhs", transpose_lhs),
      ("quantized operands", quantized), ("lhs_indices", lhs_indices is not None)) if v]
  if given:
    raise NotImplementedError(
        f"lhs_activation (a gated prologue) supports an m-grouped float lhs [M, 2K] that is "
        f"not transposed or gathered, with any rhs layout, bias, activation, row_weights, "
        f"out_indices and fp8 training (quantization=); got {', '.join(given)}")
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
  if not isinstance(platform, str) or registry.normalize_platform(platform) not in PLATFORMS:
    raise ValueError(f"platform must be None or one of {PLATFORMS}, got {platform!r}")
  return registry.normalize_platform(platform)


# ---------------------------------------------------------------------- rows and the call


@dataclasses.dataclass(frozen=True)
class Call:
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


def unwrap_grouped_array(lhs, groups, group_type, group_list_type, transpose_lhs):
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


def _group_type(group_type, groups) -> str:
  group_type = "m" if group_type is None else group_type
  if group_type not in GROUP_TYPES:
    raise ValueError(f"group_type must be one of {GROUP_TYPES}, got {group_type!r}")
  if groups is None:
    raise ValueError("gmm needs a group_list (or a GroupedArray lhs)")
  return group_type


def _operands(lhs, rhs, groups, quantize_lhs, quantize_rhs):
  """lhs and rhs as QArrays or numeric arrays, with static shapes and fitting quantization
  specs."""
  lhs, rhs = _as_operand(lhs, "lhs"), _as_operand(rhs, "rhs")
  _check_static(lhs=lhs, rhs=rhs, group_list=groups)
  _check_quant_specs(lhs, rhs, quantize_lhs, quantize_rhs)
  return lhs, rhs


def _fp8_training(quantization, lhs_q: bool, rhs_q: bool, quantize_lhs, quantize_rhs,
                  output_scale, output_offset, sharding) -> Fp8Training | None:
  """The fp8 training recipe of ``quantization=`` (None: none), and what it does not
  combine with."""
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
  return quantization


def _of_one_kind(lhs, rhs, quantized_call: bool, lhs_q: bool):
  """Plain operands promoted to one kind (`_promote_plain`); a quantized call's lhs checked
  to be a float array or a QArray."""
  if not quantized_call:
    return _promote_plain(lhs, rhs)
  if not lhs_q and not jnp.issubdtype(lhs.dtype, jnp.floating):
    raise ValueError(f"with a quantized rhs, lhs must be a float array or a QArray, got "
                     f"{describe(lhs)}")
  return lhs, rhs


def _output_scales(output_scale, output_offset, activation, num_local: int, n: int,
                   quantized_call: bool):
  """(output_scale, output_offset) as f32 [G_local, N_out]: they meet the result's columns
  (half the product's when gated), for quantized calls only."""
  n_out = n // 2 if is_gated(activation) else n
  output_scale = _per_group_vector(output_scale, "output_scale", num_local, n_out)
  output_offset = _per_group_vector(output_offset, "output_offset", num_local, n_out)
  if not quantized_call and (output_scale is not None or output_offset is not None):
    raise NotImplementedError(
        "output_scale/output_offset (requantization) apply to quantized operands (QArray or "
        "quantize_lhs/quantize_rhs); for float operands scale the result")
  return output_scale, output_offset


def _check_tiling_and_sharding(tiling, sharding) -> None:
  if tiling is not None and not isinstance(tiling, (Tiling, Tilings)) and not callable(tiling):
    raise ValueError(f"tiling must be None, a gmm_jax.Tiling, a callable gmm_jax.Problem -> "
                     f"Tiling | None, or gmm_jax.Tilings, got {tiling!r}")
  if sharding is not None and not isinstance(sharding, sharding_lib.GmmSharding):
    raise ValueError(f"sharding must be a gmm_jax.GmmSharding or None, got {sharding!r}")


def validate(lhs, rhs, groups, *, group_type, group_list_type, num_groups, bias, activation,
             transpose_lhs, transpose_rhs, preferred_element_type, precision, group_offset,
             implementation, interpret, tiling, output_scale, output_offset, quantize_lhs,
             quantize_rhs, straight_through, sharding, platform, lhs_indices=None,
             row_weights=None, out_indices=None, out_rows=None,
             deterministic=True, quantization=None, lhs_activation=None) -> Call:
  """Every check of a gmm call, and its canonical form."""
  transpose_lhs = _check_bool(transpose_lhs, "transpose_lhs")
  transpose_rhs = _check_bool(transpose_rhs, "transpose_rhs")
  interpret = _check_interpret(interpret)
  deterministic = _check_bool(deterministic, "deterministic")
  straight_through = _check_bool(straight_through, "straight_through")
  group_type = _group_type(group_type, groups)
  lhs, rhs = _operands(lhs, rhs, groups, quantize_lhs, quantize_rhs)
  lhs_q, rhs_q = isinstance(lhs, QArray), isinstance(rhs, QArray)
  quantization = _fp8_training(quantization, lhs_q, rhs_q, quantize_lhs, quantize_rhs,
                               output_scale, output_offset, sharding)
  quantized_call = lhs_q or rhs_q or quantize_lhs is not None or quantize_rhs is not None
  lhs, rhs = _of_one_kind(lhs, rhs, quantized_call, lhs_q)
  lhs_activation = _lhs_activation(
      lhs_activation, group_type=group_type, transpose_lhs=transpose_lhs, lhs=lhs, rhs=rhs,
      quantized=quantized_call, lhs_indices=lhs_indices)
  m, k, n = _problem_dims(lhs, rhs, group_type, transpose_lhs, transpose_rhs,
                          lhs_activation is not None)
  rows, gather_rows, out_rows, num_rows = _row_operands(
      lhs, lhs_indices, row_weights, out_indices, out_rows, group_type=group_type,
      transpose_lhs=transpose_lhs,
      quantized_dynamic=quantize_lhs is not None or quantize_rhs is not None,
      sharding=sharding)
  num_tokens, m = m, (m if gather_rows is None else gather_rows)
  dim_size, dim_name = (m, "M") if group_type == "m" else (k, "K")
  counts, num_total, num_local = _group_counts(
      groups, group_list_type, num_groups, group_type, rhs.shape, group_offset, dim_size,
      dim_name)
  offset = _group_offset(group_offset, num_total)
  _check_row_values(rows, counts, offset, num_local, num_rows or m, num_tokens, out_rows)
  bias = _bias(bias, num_local, n)
  output_scale, output_offset = _output_scales(output_scale, output_offset, activation,
                                               num_local, n, quantized_call)
  _check_tiling_and_sharding(tiling, sharding)
  float_activations = not lhs_q and quantize_lhs is None
  cfg = GmmConfig(
      group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs,
      transpose_rhs=transpose_rhs, activation=_activation(activation, n),
      out_dtype=_out_dtype(preferred_element_type, lhs, rhs, quantized_call, float_activations),
      precision=_precision(precision),
      implementation=registry.check_implementation(implementation), interpret=interpret,
      tiling=tiling, platform=_platform(platform), gather_rows=gather_rows,
      row_weights=rows.row_weights is not None, out_rows=out_rows,
      deterministic=deterministic, lhs_activation=lhs_activation)
  if rows.row_weights is not None and not jnp.issubdtype(cfg.out_dtype, jnp.floating):
    raise NotImplementedError(f"row_weights need a floating result, got {cfg.out_dtype}")
  if quantization is not None:
    fp8_training.check(lhs, rhs, cfg)
  return Call(lhs, rhs, counts, offset, bias, cfg, quantize_lhs, quantize_rhs,
              straight_through, output_scale, output_offset, sharding, rows, quantization)
