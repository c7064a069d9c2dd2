"""Public entry points: `gmm` and the `jax.lax.ragged_dot` drop-in."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import dispatch, layout, quant
from gmm_jax._src import sharding as sharding_lib
from gmm_jax._src.config import GmmConfig, Tiling
from gmm_jax._src.epilogue import resolve_activation
from gmm_jax._src.layout import GroupedArray
from gmm_jax._src.vjp import gmm_core

GROUP_TYPES = ("m", "k")


def _check_operand_dtype(x, name):
  dtype = x.dtype
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"{name} must be a floating or integer array, got {jax.typeof(x)}")


def _group_offset(group_offset, num_total: int):
  if group_offset is None:
    return jnp.zeros((), jnp.int32)
  if not isinstance(group_offset, jax.core.Tracer):
    value = np.asarray(group_offset)
    if value.size != 1 or not np.issubdtype(value.dtype, np.integer):
      raise ValueError(f"group_offset must be an integer scalar, got {group_offset!r}")
    if not 0 <= int(value.reshape(())) <= num_total:
      raise ValueError(f"group_offset must lie in [0, {num_total}], got {int(value.reshape(()))}")
  group_offset = jnp.asarray(group_offset)
  if group_offset.size != 1 or not jnp.issubdtype(group_offset.dtype, jnp.integer):
    raise ValueError(f"group_offset must be an integer scalar, got {jax.typeof(group_offset)}")
  return group_offset.reshape(()).astype(jnp.int32)


def _run_one(lhs, rhs, counts, group_offset, bias, cfg):
  """One (possibly quantized) gmm on canonical operands: what each shard runs."""
  if isinstance(lhs, quant.QArray) or isinstance(rhs, quant.QArray):
    return quant.gmm_quantized(lhs, rhs, counts, group_offset, bias, cfg)
  return gmm_core(cfg, lhs, rhs, counts, group_offset, bias)


def _finish_after_reduction(z, counts, group_offset, bias, cfg):
  """Bias, activation and cast of a K-reduced f32 pre-activation."""
  if bias is not None:
    if cfg.group_type == "m":
      ids = layout.row_group_ids(counts, z.shape[0], group_offset, cfg.num_local)
      z = z + bias.astype(jnp.float32)[jnp.maximum(ids, 0)]
    else:
      z = z + bias.astype(jnp.float32)[:, None, :]
  return quant.finish(z, counts, group_offset, cfg)


def _describe(x) -> str:
  return repr(x) if isinstance(x, quant.QArray) else str(jax.typeof(x))


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


def gmm(lhs, rhs, group_list=None, *, group_type=None, group_list_type="counts",
        num_groups=None, bias=None, activation=None, transpose_lhs=False, transpose_rhs=False,
        preferred_element_type=None, precision=None, group_offset=None, implementation=None,
        interpret=False, tiling=None, output_scale=None, output_offset=None,
        quantize_lhs=None, quantize_rhs=None, straight_through=True, sharding=None):
  """Grouped matrix multiplication with a fused bias + activation epilogue.

  m-grouping (``group_type="m"``): lhs ``[M, K]`` (``[K, M]`` if transpose_lhs), rhs
  ``[G, K, N]`` (``[G, N, K]`` if transpose_rhs) -> ``[M, N]``; the rows of group g are
  multiplied by ``rhs[g]``. Rows at or past the total of the group sizes, and rows of groups
  not held locally (group_offset), are exactly 0.

  k-grouping (``group_type="k"``): lhs ``[M, K]`` (``[K, M]``), rhs ``[K, N]`` (``[N, K]``)
  with K split into contiguous groups -> ``[G, M, N]``, ``out[g] = lhs[:, cols of g] @
  rhs[rows of g]``; an empty group gives ``activation(bias[g])``.

  Args:
    lhs: the left operand, or a `GroupedArray` (its offsets are then the group list and its
      variable_dim picks the grouping: 0 -> "m", 1 -> "k").
    rhs: the right operand (per-group weights for "m").
    group_list: ``[G]`` int sizes ("counts"), ``[G]`` non-decreasing end offsets ("cumsum")
      or ``[E, 2]`` rows ``(group_index, size)`` with increasing indices ("sparse"; unlisted
      groups are empty). May be traced: one compilation serves any sizes.
    group_type: "m" or "k"; default "m" (or from a GroupedArray lhs).
    group_list_type: "counts", "cumsum" or "sparse".
    num_groups: G of a sparse list (default ``rhs.shape[0]`` for "m"); for "k" the number
      of output groups (default G of the list).
    bias: ``[G_local, N]``, added in the f32 accumulator.
    activation: None, "relu", "gelu_tanh", "gelu", "fast_gelu", "silu" or a jnp-traceable
      callable, applied after the bias and before the cast.
    transpose_lhs, transpose_rhs: operands stored transposed (see shapes above).
    preferred_element_type: output dtype; default the promoted input dtype. Floating inputs
      always accumulate in f32; integer inputs accumulate exactly in int32.
    precision: passed to the dots (as in jax.lax.dot_general).
    group_offset: int or traced int32 scalar: rhs (for "m") or the output (for "k") holds
      only groups ``[group_offset, group_offset + G_local)`` of the list (expert
      parallelism).
    implementation: None/"auto" (platform default chain), "xla" or "reference" (and the
      kernels registered by later releases).
    interpret: run Pallas kernels in interpret mode.
    tiling: a `Tiling` overriding the chosen implementation's tile heuristic for the
      forward call (the backward's gmms keep the heuristic). A backend that cannot use it
      (e.g. Triton needs powers of 2) raises NotImplementedError and the chain moves on.
    output_scale, output_offset: quantized operands only: ``y * output_scale +
      output_offset`` after the activation, before the cast (requantization when the output
      dtype is an integer: rounded to nearest even and saturated). Scalar, ``[N]``,
      ``[G_local, 1]`` or ``[G_local, N]``.
    quantize_lhs, quantize_rhs: `QuantSpec`s: gmm quantizes the float operand itself
      (dynamic quantization, e.g. per-token int8 activations) and runs the quantized mode.
    straight_through: with quantize_lhs/quantize_rhs, gradients w.r.t. the float operands
      are the float gmm's gradients at the dequantized operands (the straight-through
      estimator); False gives them no gradient.
    sharding: a `GmmSharding(mesh, lhs=PartitionSpec, rhs=PartitionSpec)`: how the operands
      lie on a device mesh; gmm then runs per shard with the matching strategy (expert
      parallel, rows, columns, contraction; see `gmm_jax.explain`) through `jax.shard_map`.

  Quantized operands (a `QArray`, or a qwix QArray) select a mode: float lhs x QArray rhs is
  weight-only (``x @ dequantize(W)``); QArray x QArray multiplies the quantized values
  exactly (int32 accumulation for integers) and applies both scales, per K block when a
  scale varies along K (MX, G-B, per-group). An int32 bias is added in the accumulator
  (before the scales); a float bias after them. See `gmm_jax.quantize`.

  Returns:
    ``[M, N]`` for "m" (a `GroupedArray` with lhs's offsets if lhs was one), ``[G_local, M,
    N]`` for "k".

  Raises:
    ValueError: malformed shapes, dtypes, names, or a concrete group list that is negative,
      decreasing (cumsum), has bad sparse indices or sums past the grouped dimension.
    NotImplementedError: a valid combination no registered implementation serves.
  """
  out_offsets = None
  if isinstance(lhs, GroupedArray):
    if group_list is not None:
      raise ValueError("pass either a GroupedArray lhs or a group_list, not both")
    if transpose_lhs:
      raise ValueError("a GroupedArray lhs is stored untransposed; transpose_lhs must be False")
    inferred = "m" if lhs.variable_dim == 0 else "k"
    if group_type is not None and group_type != inferred:
      raise ValueError(
          f"a GroupedArray with variable_dim={lhs.variable_dim} means group_type="
          f"{inferred!r}, got {group_type!r}")
    group_type, group_list, group_list_type = inferred, lhs.offsets, "cumsum"
    out_offsets = lhs.offsets if inferred == "m" else None
    lhs = lhs.values
  group_type = "m" if group_type is None else group_type
  if group_type not in GROUP_TYPES:
    raise ValueError(f"group_type must be one of {GROUP_TYPES}, got {group_type!r}")
  if group_list is None:
    raise ValueError("gmm needs a group_list (or a GroupedArray lhs)")

  lhs_q, rhs_q = quant.as_qarray(lhs), quant.as_qarray(rhs)
  lhs = lhs_q if lhs_q is not None else jnp.asarray(lhs)
  rhs = rhs_q if rhs_q is not None else jnp.asarray(rhs)
  for spec, operand, name in ((quantize_lhs, lhs, "lhs"), (quantize_rhs, rhs, "rhs")):
    if spec is None:
      continue
    if not isinstance(spec, quant.QuantSpec):
      raise ValueError(f"quantize_{name} must be a gmm_jax.QuantSpec or None, got {spec!r}")
    if isinstance(operand, quant.QArray) or not jnp.issubdtype(operand.dtype, jnp.floating):
      raise ValueError(f"quantize_{name} needs a float {name}, got {_describe(operand)}")
  quantized = (lhs_q is not None or rhs_q is not None or quantize_lhs is not None
               or quantize_rhs is not None)
  if not quantized:
    _check_operand_dtype(lhs, "lhs")
    _check_operand_dtype(rhs, "rhs")
    if jnp.issubdtype(lhs.dtype, jnp.integer) != jnp.issubdtype(rhs.dtype, jnp.integer):
      raise NotImplementedError(
          f"mixed integer and floating operands ({lhs.dtype} x {rhs.dtype}): pass the "
          "integer side as a gmm_jax.QArray (its scale says what the integers mean); "
          "plain arrays must be both floating or both integer")
  elif lhs_q is None and not jnp.issubdtype(lhs.dtype, jnp.floating):
    raise ValueError(f"with a quantized rhs, lhs must be a float array or a QArray, got "
                     f"{_describe(lhs)}")
  rhs_rank = 3 if group_type == "m" else 2
  if lhs.ndim != 2 or rhs.ndim != rhs_rank:
    raise ValueError(
        f"group_type={group_type!r} needs a 2-D lhs and a {rhs_rank}-D rhs, got lhs "
        f"{_describe(lhs)} and rhs {_describe(rhs)}")
  m, k = (lhs.shape[1], lhs.shape[0]) if transpose_lhs else lhs.shape
  rhs_k, n = (rhs.shape[-1], rhs.shape[-2]) if transpose_rhs else rhs.shape[-2:]
  if rhs_k != k:
    raise ValueError(
        f"contraction sizes differ: lhs {lhs.shape} (transpose_lhs={transpose_lhs}) has "
        f"K={k}, rhs {rhs.shape} (transpose_rhs={transpose_rhs}) has K={rhs_k}")

  group_list = layout.as_group_list(group_list)
  layout.check_group_list_shape(group_list, group_list_type)
  list_len = np.shape(group_list)[0]
  if group_list_type == "sparse":
    if num_groups is None:
      if group_type == "k" or group_offset is not None:
        raise ValueError(
            "num_groups is required for a sparse group_list with group_type='k' or a "
            "group_offset")
      num_groups = rhs.shape[0]
    num_total = int(num_groups)
  else:
    num_total = list_len
  if group_type == "m":
    num_local = rhs.shape[0]
    if group_list_type != "sparse" and num_groups is not None and num_groups != num_total:
      raise ValueError(f"num_groups={num_groups} differs from the group_list length {num_total}")
    if group_offset is None and num_local != num_total:
      raise ValueError(
          f"rhs {rhs.shape} holds {num_local} groups but the group list has {num_total}; "
          "pass group_offset if rhs holds a slice of the groups")
    if num_local > num_total:
      raise ValueError(f"rhs {rhs.shape} holds more groups than the group list ({num_total})")
  else:
    num_local = num_total if (num_groups is None or group_list_type == "sparse") else int(
        num_groups)
    if num_local > num_total:
      raise ValueError(f"num_groups={num_local} exceeds the group list length {num_total}")
  dim_size, dim_name = (m, "M") if group_type == "m" else (k, "K")
  layout.validate_concrete_group_list(
      group_list, group_list_type, dim_size, num_total, dim_name)
  offset = _group_offset(group_offset, num_total)

  if bias is not None:
    bias = jnp.asarray(bias)
    _check_operand_dtype(bias, "bias")
    if bias.shape != (num_local, n):
      raise ValueError(f"bias must have shape [G_local, N] = {(num_local, n)}, got {bias.shape}")
  output_scale = _per_group_vector(output_scale, "output_scale", num_local, n)
  output_offset = _per_group_vector(output_offset, "output_offset", num_local, n)
  if not quantized and (output_scale is not None or output_offset is not None):
    raise NotImplementedError(
        "output_scale/output_offset (requantization) apply to quantized operands (QArray or "
        "quantize_lhs/quantize_rhs); for float operands scale the result")
  resolve_activation(activation)
  if preferred_element_type is None:
    if quantized:  # weight-only keeps the activations' dtype; others give f32
      out_dtype = lhs.dtype if (lhs_q is None and quantize_lhs is None) else jnp.float32
    else:
      out_dtype = jnp.promote_types(lhs.dtype, rhs.dtype)
  else:
    try:
      out_dtype = jnp.dtype(preferred_element_type)
    except TypeError as err:
      raise ValueError(f"bad preferred_element_type {preferred_element_type!r}") from err

  if tiling is not None and not isinstance(tiling, Tiling):
    raise ValueError(f"tiling must be a gmm_jax.Tiling or None, got {tiling!r}")
  cfg = GmmConfig(
      group_type=group_type, num_local=num_local, transpose_lhs=bool(transpose_lhs),
      transpose_rhs=bool(transpose_rhs), activation=activation, out_dtype=np.dtype(out_dtype),
      precision=precision, implementation=implementation, interpret=bool(interpret),
      tiling=tiling)
  dispatch.candidates(cfg)  # unknown implementation names fail here, with the list
  counts = layout.to_counts(group_list, group_list_type, num_total)
  if sharding is not None:
    if not isinstance(sharding, sharding_lib.GmmSharding):
      raise ValueError(f"sharding must be a gmm_jax.GmmSharding or None, got {sharding!r}")
    if (quantize_lhs is not None or quantize_rhs is not None or output_scale is not None
        or output_offset is not None):
      raise NotImplementedError(
          "sharded gmm supports float and QArray operands; dynamic quantization "
          "(quantize_lhs/quantize_rhs) and output_scale/output_offset run per shard with "
          "shard-local statistics, so quantize outside the sharded call")
    out = sharding_lib.sharded_gmm(lhs, rhs, counts, offset, bias, cfg, sharding,
                                   _run_one, _finish_after_reduction)
  elif quantize_lhs is not None or quantize_rhs is not None:
    out = quant.dynamic_gmm(lhs, rhs, counts, offset, bias, cfg, quantize_lhs, quantize_rhs,
                            bool(straight_through), output_scale, output_offset)
  elif quantized:
    out = quant.gmm_quantized(lhs, rhs, counts, offset, bias, cfg, output_scale,
                              output_offset)
  else:
    out = gmm_core(cfg, lhs, rhs, counts, offset, bias)
  return out if out_offsets is None else GroupedArray(out, out_offsets, 0)


def ragged_dot(lhs, rhs, group_sizes, precision=None, preferred_element_type=None,
               group_offset=None):
  """A drop-in for `jax.lax.ragged_dot` (m-grouping, counts), backed by `gmm`.

  Args:
    lhs: ``[M, K]``.
    rhs: ``[G, K, N]``.
    group_sizes: int ``[G]``.
    precision, preferred_element_type: as in jax.lax.ragged_dot.
    group_offset: optional int scalar (or ``[1]`` array): rhs holds groups
      ``[group_offset, group_offset + rhs.shape[0])`` of group_sizes.

  Returns:
    ``[M, N]``; rows past ``sum(group_sizes)`` are 0.
  """
  return gmm(lhs, rhs, group_sizes, group_type="m", group_list_type="counts",
             precision=precision, preferred_element_type=preferred_element_type,
             group_offset=group_offset)


def explain(lhs, rhs, group_list=None, **kwargs) -> str:
  """What `gmm(lhs, rhs, group_list, **kwargs)` would do, and why: the quantization mode,
  the sharding strategy and collectives (with ``sharding=``), and which implementation
  serves each gmm it runs (the forward; each skipped implementation with its reason).

  Traces the call abstractly (nothing is computed); arguments as for `gmm`.
  """
  lines = []
  lq, rq = quant.as_qarray(lhs), quant.as_qarray(rhs)
  if kwargs.get("quantize_lhs") is not None or kwargs.get("quantize_rhs") is not None:
    lines.append("quantization: dynamic (gmm quantizes the float operands; gradients "
                 f"{'straight-through' if kwargs.get('straight_through', True) else 'none'})")
  elif lq is not None or rq is not None:
    probe = GmmConfig(group_type=kwargs.get("group_type") or "m", num_local=1,
                      transpose_lhs=kwargs.get("transpose_lhs", False),
                      transpose_rhs=kwargs.get("transpose_rhs", False))
    lines.append(f"quantization: {quant.quant_mode(lq or lhs, rq or rhs, probe)}")
  else:
    lines.append("quantization: none")
  sharding = kwargs.get("sharding")
  if sharding is not None:
    group_type = kwargs.get("group_type") or "m"
    probe = GmmConfig(group_type=group_type, num_local=1,
                      transpose_lhs=kwargs.get("transpose_lhs", False),
                      transpose_rhs=kwargs.get("transpose_rhs", False))
    lines.append(sharding_lib.plan(sharding, probe, np.ndim(lq.qvalue if lq else lhs),
                                   np.ndim(rq.qvalue if rq else rhs)).describe())
  with dispatch.record() as decisions:
    jax.eval_shape(lambda l, r, g: gmm(l, r, g, **kwargs), lhs, rhs, group_list)
  lines.append("implementations (forward):")
  seen = []
  for decision in decisions:
    text = decision.describe()
    if text not in seen:
      seen.append(text)
      lines.append("  - " + text.replace("\n", "\n  "))
  return "\n".join(lines)
