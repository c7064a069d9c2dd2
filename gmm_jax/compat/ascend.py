"""Ascend's aclnnGroupedMatmul (V5) as a facade over gmm_jax, with ``torch_npu.npu_grouped_matmul``
argument names. See ``shared/spec/ascend_grouped_matmul.md`` (section numbers below are its).

Scenarios (the union of the A2/A3 and 950 tables, section 6)::

  non-quant     f32/f16/bf16 x and weight alike; group types -1, 0, 2
  weight-only   f16/bf16 x, int8/int4 weight (A16W8/A16W4; antiquant scale [+ offset],
                per-channel or per-group; group types -1, 0) or fp8 weight (950; transposed,
                per-channel, group type 0)
  A8W8          int8 x int8: float scale [+ per-token scale] (bf16/f16 out), UINT64/INT64
                quant parameter (int8/bf16/f16 out, static), or no scale (int32 out)
  A8W4          int8 x int4 (or INT32 holding 8 INT4, lowest nibble first): packed scale,
                bias (mandatory), per-token scale, optional offset
  A4W4          int4 x int4: packed scale, optional per-token scale
  FP8           e4m3fn/e5m2 x e4m3fn/e5m2: f32 or packed scale, per-token or per-tensor x scale
                (static/dynamic T-C, T-T, K-C, K-T); group types 0, 2 (packed: 0)
  MX            fp8 x fp8 (group types 0, 2) or fp4 x fp4 (group type 0), e8m0 scales in
                the 950's packed layouts
  G-B           fp8 x fp8, 1 x 128 activation groups and 128 x 128 weight blocks; 0, 2

HiFloat8 rows cannot be served: JAX (ml_dtypes) has no hifloat8 dtype.

Arrays are logical JAX arrays. Where Ascend passes a transposed view, pass the logical array:
x is ``[M, K]`` also for k-grouping. A transposed weight (Ascend's non-contiguous view of the
last two axes, which changes the scale layouts of MX and G-B) is given in its memory layout
``[E, N, K]`` with ``weight_transposed=True``.

Decided semantics where Ascend leaves them open:
  * Output rows past the group list's total are 0 (Ascend leaves that memory unwritten).
  * act_type 1/2/4/5 are applied in every scenario but INT32 output (Ascend fuses them only
    for A8W8 with bf16/f16 output and rejects or ignores them elsewhere): a superset. 3
    (GELU_ERR_FUNC) is rejected as on Ascend. The activation follows the scales and the bias,
    and precedes an INT8 output's offset (the output zero point) and rounding.
  * INT8 outputs round half to even, then saturate.
  * INT32 output with a packed scale (950 table 6.2) is the int32 accumulator (+ int32 bias):
    the scale has nothing to dequantize into an integer output.
  * A8W4 with an offset: ``((x - 8) @ (w * scale + offset) + bias) * per_token_scale``.
  * A8W4 without an offset reads the group list as counts whatever group_list_type says, as
    Ascend does (a warning is emitted when another type is passed).
  * ``tuning_config`` is validated as on Ascend and otherwise unused: gmm_jax picks its tiles.
  * Full-quant scale shapes that two readings share (spec 6.6: e.g. per-token vs per-group x
    scales when K < 128) give the same numbers under both readings.
"""

from __future__ import annotations

import warnings

import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core import metadata
from gmm_jax._src.api import gmm
from gmm_jax._src.core.epilogue import resolve_activation
from gmm_jax._src.core.qarray import QArray
from gmm_jax.compat import _ascend_scales as scales
from gmm_jax.compat._ascend_rules import (ACT_TYPES, as_list, check_arguments, check_bias,
                                          check_scenario, check_structure, concrete, counts,
                                          out_dtype_of, scenario)
from gmm_jax.compat._ascend_scales import I32, array, dtype, trans_quant_param

__all__ = ["grouped_matmul", "trans_quant_param"]


# ----------------------------------------------------------------------------- the API


def grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                   antiquant_offset=None, per_token_scale=None, group_list=None,
                   split_item: int = 0, group_type: int = -1, group_list_type: int = 0,
                   act_type: int = 0, output_dtype=None, tuning_config=None,
                   weight_transposed: bool = False) -> list:
  """aclnnGroupedMatmulV5 / ``torch_npu.npu_grouped_matmul`` with Ascend's semantics.

  Args:
    x, weight, bias: arrays or lists of arrays (single vs multi tensors). Single weight:
      ``[E, K, N]`` (group type 0) or ``[K, N]`` (group type 2); bias ``[E, N]`` (or one
      ``[N]`` per weight).
    scale: full-quant dequant scale. A8W8: f32/bf16 ``[E, N]`` (per-channel) or ``[E]`` /
      ``[E, 1]`` (per-tensor), or a UINT64/INT64 quant parameter (`trans_quant_param`) of
      those shapes. A8W4: packed ``[E, K/256, N]`` or ``[E, 1, N]``. A4W4: packed ``[E, N]``
      or ``[E, G, N]``. FP8: f32 or packed ``[g, N]`` / ``[g]`` / ``[g, 1]``; MX: e8m0 in the
      950's layouts; G-B: f32 ``(g, ceil(K/128), ceil(N/128))`` (k-grouping:
      ``(K/128 + g, ceil(N/128))``).
    offset: A8W4 only: f32 ``[E, 1, N]`` (asymmetric per-channel weights).
    antiquant_scale, antiquant_offset: weight-only, x's dtype: ``[E, N]`` or ``[E, G, N]``
      (lists: ``[N_i]`` or ``[G_i, N_i]``); ``W_deq = (W + offset) * scale``.
    per_token_scale: x's scale: f32 ``[M]`` (per-token), ``[g]`` (per-tensor, FP8), ``[g, M]``
      (FP8 k-grouping), or the MX (e8m0) / G-B block layouts.
    group_list: sizes along the grouped dimension (see group_list_type).
    split_item: 0/1 multi-tensor output, 2/3 single-tensor output.
    group_type: -1 (no grouping: lists of matrices), 0 (M grouped), 2 (K grouped).
    group_list_type: 0 cumsum, 1 counts, 2 sparse ``[E, 2]`` rows (expert, size).
    act_type: 0 none, 1 relu, 2 gelu_tanh, 4 fast_gelu, 5 silu (3 is rejected).
    output_dtype: the output dtype; each scenario's table says which (default: the first).
    tuning_config: up to 3 non-negative ints (Ascend's tiling hints): validated, unused.
    weight_transposed: the weight is given as stored by a transposed view, ``[E, N, K]``
      (``[N, K]`` per tensor): needed for fp8 weight-only, allowed for m-grouping otherwise.

  Returns:
    A list of arrays: one per group (split_item 0/1) or a single one (2/3).

  Raises:
    ValueError: a combination Ascend's first phase rejects, naming the rule.
  """
  xs, weights, biases = as_list(x, "x"), as_list(weight, "weight"), as_list(bias, "bias")
  if xs is None or weights is None:
    raise ValueError("x and weight are required")
  xs, weights = [jnp.asarray(v) for v in xs], [jnp.asarray(v) for v in weights]
  biases = None if biases is None else [jnp.asarray(v) for v in biases]
  check_structure(xs, weights, biases, group_type, split_item, act_type, weight_transposed)
  if dtype(xs[0]) == np.dtype(jnp.int8) and dtype(weights[0]) == I32:
    weights = [scales.unpack_int4(w) for w in weights]  # A8W4's 8 x INT4 per INT32
  if weight_transposed:
    weights = [jnp.swapaxes(w, -1, -2) for w in weights]

  w0 = weights[0]
  k, n = w0.shape[-2], w0.shape[-1]
  g = w0.shape[0] if (group_type == 0 and len(weights) == 1) else len(weights)
  if group_type == 2 and len(weights) == 1:
    g = np.shape(group_list)[0] if group_list is not None else 1
  kind = scenario(xs[0], w0, scale, antiquant_scale, group_type, xs[0].shape[-1], n, g)
  args = dict(scale=scale, offset=offset, antiquant_scale=antiquant_scale,
              antiquant_offset=antiquant_offset, per_token_scale=per_token_scale, bias=bias)
  xt = dtype(xs[0])
  check_arguments(kind, args, xt, dtype(w0), group_type, len(xs) == 1, len(weights) == 1)
  out_dtype = out_dtype_of(kind, xt, scale, offset, output_dtype)
  check_bias(kind, xt, out_dtype, [dtype(b) for b in biases or ()], dtype(w0))
  check_scenario(kind, xs, weights, k, n, group_type, out_dtype, act_type, antiquant_scale,
                 offset, tuning_config, weight_transposed)
  activation = ACT_TYPES[act_type]
  params = dict(args, bias=biases)

  if group_type == -1:
    return _no_grouping(xs, weights, kind, params, group_list, split_item, activation,
                        out_dtype)
  if group_type == 2:
    return _k_grouping(xs, weights, kind, params, group_list, group_list_type, split_item,
                       activation, out_dtype)
  return _m_grouping(xs, weights, kind, params, group_list, group_list_type, split_item,
                     activation, out_dtype, weight_transposed)


# ------------------------------------------------------------------- group type -1


def _no_grouping(xs, weights, kind, params, group_list, split_item, activation, out_dtype):
  if group_list is not None:
    raise ValueError("group_list must be null with group_type=-1")
  if split_item in (2, 3):
    raise ValueError("split_item 2/3 (single output) needs group_type 0 or 2")
  if len(xs) != len(weights):
    raise ValueError(f"group_type=-1 pairs x and weight: {len(xs)} vs {len(weights)}")
  per_tensor = {}
  for arg in ("antiquant_scale", "antiquant_offset", "bias"):
    values = as_list(params[arg], arg)
    if values is not None and len(values) != len(weights):
      raise ValueError(f"{arg} has {len(values)} tensors but weight has {len(weights)} "
                       "(all or none)")
    per_tensor[arg] = values
  outs = []
  for i, (xi, wi) in enumerate(zip(xs, weights)):
    lead = xi.shape[:-1]
    x2 = xi.reshape(-1, xi.shape[-1])
    if wi.ndim != 2 or wi.shape[0] != x2.shape[1]:
      raise ValueError(f"x[{i}] {list(xi.shape)} and weight[{i}] {list(wi.shape)} do not "
                       "share K")
    rhs = wi[None]
    if kind == "weight_only":
      aq = jnp.asarray(per_tensor["antiquant_scale"][i])
      if aq.ndim not in (1, 2):
        raise ValueError(f"antiquant_scale[{i}] must be [N] (per-channel) or [G, N] "
                         f"(per-group), got {list(aq.shape)}")
      off = per_tensor["antiquant_offset"]
      rhs = _weight_qarray(rhs, aq.reshape(1, -1, aq.shape[-1]),
                           None if off is None else jnp.asarray(off[i]).reshape(
                               1, -1, aq.shape[-1]))
    b = None if per_tensor["bias"] is None else per_tensor["bias"][i][None, :]
    y = gmm(x2, rhs, jnp.asarray([x2.shape[0]], jnp.int32), bias=b, activation=activation,
            preferred_element_type=out_dtype)
    outs.append(y.reshape(*lead, -1))
  return outs


def _weight_qarray(weight, antiquant_scale, antiquant_offset):
  """Weight-only: ``W_deq = (W + offset) * scale``, i.e. a QArray with zero point -offset.

  Args:
    weight: ``[E, K, N]``; antiquant_scale/offset: ``[E, N]`` or ``[E, G, N]``.
  """
  scale = jnp.asarray(antiquant_scale)
  if scale.ndim == 2:  # per-channel [E, N]
    scale = scale[:, None, :]
  elif scale.ndim != 3:
    raise ValueError(f"antiquant_scale must be [E, N] (per-channel) or [E, G, N] (per-group), "
                     f"got {list(scale.shape)}")
  zero_point = None
  if antiquant_offset is not None:
    offset = jnp.asarray(antiquant_offset)
    if offset.shape != jnp.asarray(antiquant_scale).shape:
      raise ValueError(f"antiquant_offset {list(offset.shape)} must match antiquant_scale "
                       f"{list(jnp.asarray(antiquant_scale).shape)}")
    zero_point = -(offset[:, None, :] if offset.ndim == 2 else offset).astype(jnp.float32)
  if scale.shape[0] != weight.shape[0]:
    raise ValueError(f"antiquant_scale {list(jnp.asarray(antiquant_scale).shape)} holds "
                     f"{scale.shape[0]} experts, the weight {list(weight.shape)} "
                     f"{weight.shape[0]}: it must be [E, N] or [E, G, N]")
  k = weight.shape[1]
  if scale.shape[1] > 1 and k % scale.shape[1]:
    raise ValueError(f"per-group antiquant_scale {list(scale.shape)}: K={k} must split into "
                     f"{scale.shape[1]} equal groups")
  try:
    return QArray(weight, scale, zero_point)
  except ValueError as err:
    raise ValueError(f"antiquant_scale {list(scale.shape)} does not fit weight "
                     f"{list(weight.shape)}: {err}") from None


# ---------------------------------------------------------------------- group type 2


def _k_grouping(xs, weights, kind, params, group_list, group_list_type, split_item,
                activation, out_dtype):
  single_out = split_item in (2, 3)
  if params["bias"] is not None:
    raise ValueError("bias must be null for group_type=2 (k-grouping)")
  if len(xs) != 1:
    raise ValueError("group_type=2 needs a single x (logical [M, K], stored transposed)")
  x2 = xs[0]
  if x2.ndim != 2:
    raise ValueError(f"group_type=2 needs a 2-D x, got {list(x2.shape)}")
  if len(weights) == 1 and single_out:
    w = weights[0]
    if w.ndim != 2:
      raise ValueError(f"group_type=2 needs a 2-D weight [K, N], got {list(w.shape)}")
    if group_list is None:
      raise ValueError("group_type=2 with a single weight needs a group_list")
    num_groups = np.shape(group_list)[0]
    experts, sizes = counts(group_list, group_list_type, 1, "K")
  elif not single_out:  # S-M-M: group sizes from the weights
    if group_list is not None:
      raise ValueError("group_type=2 with multiple weights (S-M-M) takes no group_list")
    w = jnp.concatenate(weights, axis=0)
    if w.shape[0] > x2.shape[1]:
      raise ValueError(f"the weights' rows ({w.shape[0]}) exceed x's K ({x2.shape[1]})")
    # x's columns past the weights' total are ignored (as rows past a group list's total).
    w = jnp.pad(w, ((0, x2.shape[1] - w.shape[0]), (0, 0)))
    sizes = jnp.asarray([wi.shape[0] for wi in weights], jnp.int32)
    num_groups, experts = len(weights), None
  else:
    raise ValueError("group_type=2: single weight with split_item 2/3, or multiple weights "
                     "with split_item 0/1")
  if experts is not None:
    raise ValueError("a sparse group_list (type 2) is for group_type=0 only")
  if x2.shape[1] != w.shape[0]:
    raise ValueError(f"x {list(x2.shape)} has K={x2.shape[1]}, weight(s) K={w.shape[0]}")
  known = concrete(sizes)
  if known is not None and int(known.sum()) > x2.shape[1]:
    raise ValueError(f"the group list covers {int(known.sum())} columns of K, more than "
                     f"x's {x2.shape[1]}")
  if kind == "non_quant":
    out = gmm(x2, w, sizes, group_type="k", group_list_type="counts", num_groups=num_groups,
              activation=activation, preferred_element_type=out_dtype)
  else:
    lhs, rhs = scales.k_dequantized(kind, x2, w, sizes, num_groups, array(params["scale"]),
                                    array(params["per_token_scale"]))
    out = gmm(lhs, rhs, sizes, group_type="k", group_list_type="counts", num_groups=num_groups,
              activation=activation, preferred_element_type=out_dtype)
  return [out] if single_out else list(out)


# ---------------------------------------------------------------------- group type 0


def _m_grouping(xs, weights, kind, params, group_list, group_list_type, split_item,
                activation, out_dtype, weight_transposed):
  if split_item not in (2, 3):
    raise ValueError("group_type=0 needs split_item 2 or 3 (single output)")
  if len(xs) > 1:  # M-M-S
    x2 = jnp.concatenate([xi.reshape(-1, xi.shape[-1]) for xi in xs], axis=0)
    implied = jnp.asarray([int(np.prod(xi.shape[:-1])) for xi in xs], jnp.int32)
  else:
    x2, implied = xs[0], None
  if x2.ndim != 2:
    raise ValueError(f"group_type=0 needs a 2-D x, got {list(x2.shape)}")
  w = weights[0] if len(weights) == 1 else jnp.stack(weights)
  if w.ndim != 3:
    raise ValueError(f"group_type=0 needs a weight [E, K, N] (or a list of [K, N]), got "
                     f"{list(w.shape)}")
  num_groups, m, k, n = w.shape[0], x2.shape[0], w.shape[1], w.shape[2]
  if group_list is None:
    if implied is None:
      raise ValueError("group_type=0 with a single x needs a group_list")
    experts, sizes = None, implied
  else:
    if kind == "a8w4" and params["offset"] is None and group_list_type != 1:
      warnings.warn("A8W4 without offset reads group_list as counts (Ascend forces "
                    f"groupListType=1); group_list_type={group_list_type} is ignored",
                    stacklevel=3)
      group_list_type = 1
    experts, sizes = counts(group_list, group_list_type, num_groups, "M")
    known = concrete(sizes)
    if implied is not None and known is not None and not np.array_equal(
        known, np.asarray(implied)):
      raise ValueError("with multiple x tensors, the group sizes must equal each x's rows")
  if x2.shape[1] != k:
    raise ValueError(f"x {list(x2.shape)} has K={x2.shape[1]}, weight {list(w.shape)} K={k}")
  known = concrete(sizes)
  if known is not None and int(known.sum()) > m:
    raise ValueError(f"the group list covers {int(known.sum())} rows, more than x's {m}")
  biases = params["bias"]
  bias = None if biases is None else biases[0] if len(biases) == 1 else jnp.stack(biases)
  if bias is not None and bias.shape != (num_groups, n):
    raise ValueError(f"bias must be [E, N]={[num_groups, n]}, got {list(bias.shape)}")

  per_expert, per_row = _m_scales(kind, params, (num_groups, m, k, n), weight_transposed,
                                  out_dtype)
  per_expert["weight"], per_expert["bias"] = w, bias
  if experts is not None:
    per_expert = _per_entry(per_expert, experts, sizes, num_groups)
  if "tensor_scale" in per_expert:  # FP8 per-tensor x scale: each row takes its group's
    ids = jnp.maximum(metadata.row_group_ids(sizes, m), 0)
    per_row["token_scale"] = per_expert.pop("tensor_scale")[ids][:, None]
  return [_m_gmm(kind, x2, sizes, per_expert, per_row, activation, out_dtype)]


def _m_scales(kind, params, dims, weight_transposed, out_dtype):
  """The scenario's scales and offsets (`scales.m_parameters`) of an ``[E, K, N]`` weight
  and x's M rows, ``dims = (E, M, K, N)``: (per expert, per row); a packed scale decoded."""
  scale, packed_offset = array(params["scale"]), None
  if scales.is_packed(scale):  # decoded on the host: JAX holds no 64-bit ints without x64
    scale, packed_offset = scales.decode_packed(scale)
  arrays = dict(scale=scale, packed_offset=packed_offset, offset=array(params["offset"]),
                antiquant_scale=array(params["antiquant_scale"]),
                antiquant_offset=array(params["antiquant_offset"]),
                per_token_scale=array(params["per_token_scale"]))
  return scales.m_parameters(kind, *dims, weight_transposed,
                             out_dtype == np.dtype(jnp.int8), arrays)


def _per_entry(per_expert, experts, sizes, num_groups):
  """A sparse group list's parameters: entry i takes the next sizes[i] rows with expert
  experts[i]'s weights (any order, stopping at the first empty entry): one gmm group per
  entry, each per-expert parameter gathered by entry."""
  known_experts, known_sizes = concrete(experts), concrete(sizes)
  if known_experts is not None and known_sizes is not None:
    used = known_experts[known_sizes > 0]
    if ((used < 0) | (used >= num_groups)).any():
      raise ValueError(f"sparse group_list expert indices must lie in [0, {num_groups}), "
                       f"got {known_experts.tolist()}")
  # A traced index out of range reads the nearest expert (Ascend's result is undefined).
  index = jnp.clip(experts, 0, num_groups - 1)
  return {name: None if value is None else value[index] for name, value in per_expert.items()}


def _m_gmm(kind, x, sizes, per_expert, per_row, activation, out_dtype):
  """One gmm over the (gathered) per-entry parameters, in the scenario's formula."""
  w, bias = per_expert["weight"], per_expert["bias"]
  call = dict(group_list_type="counts", bias=bias, activation=activation,
              preferred_element_type=out_dtype)
  token = per_row.get("token_scale")
  if kind in ("non_quant", "a8w8_int32") or (kind == "a8w8_packed" and out_dtype == I32):
    return gmm(x, w, sizes, **call)
  if kind == "weight_only":
    return gmm(x, _weight_qarray(w, per_expert["antiquant_scale"],
                                 per_expert["antiquant_offset"]), sizes, **call)
  if kind == "a8w4":
    # ((x - 8) @ (w * scale [+ offset]) + bias) * per_token_scale: the per-token scale
    # follows the bias, so it is applied to the f32 result.
    scale = per_expert["scale"]
    w_deq = w.astype(jnp.float32) * jnp.repeat(scale, w.shape[1] // scale.shape[1], axis=1)
    if "offset" in per_expert:
      w_deq = w_deq + per_expert["offset"]
    z = gmm(x.astype(jnp.float32) - 8.0, w_deq, sizes, group_list_type="counts", bias=bias,
            preferred_element_type=jnp.float32)
    fn = resolve_activation(activation)
    z = z * token
    return (z if fn is None else fn(z)).astype(out_dtype)
  if kind in ("gb", "mx"):
    block = scales.GB_BLOCK if kind == "gb" else scales.MX_BLOCK
    rhs_tile = (1, block, scales.GB_BLOCK) if kind == "gb" else (1, block, 1)
    lhs = QArray(x, token, tile=(1, block))
    rhs = QArray(w, per_expert["scale"], tile=rhs_tile)
    return gmm(lhs, rhs, sizes, **call)
  # Scaled: exact products, then the row (token/tensor) scale x column scale.
  lhs = QArray(x, jnp.ones((1, 1), jnp.float32) if token is None else token)
  rhs = QArray(w, per_expert["scale"])
  return gmm(lhs, rhs, sizes, output_offset=per_expert.get("output_offset"), **call)
