"""Ascend's aclnnGroupedMatmul (V5) as a facade over gmm_jax (``torch_npu.npu_grouped_matmul``
argument names), for the scenarios implemented so far: non-quantized (group types -1, 0, 2;
single and multi tensors; every split_item), weight-only (A16W8/A16W4 antiquant, per-channel
and per-group, with offsets) and A8W8 (static per-channel/per-tensor scales, dynamic per-token
scales, int32 or float bias, int32 output). See ``shared/spec/ascend_grouped_matmul.md``.

Arrays are logical JAX arrays: where Ascend passes a transposed view (x for k-grouping,
optionally the weight), pass the logical ``[M, K]`` / ``[K, N]`` array.

Decided semantics where Ascend leaves memory unwritten: output rows past the group list's
total are 0. Superset: act_type 1/2/4/5 are honoured in every implemented scenario (Ascend
only fuses them for A8W8 with bf16/f16 output); 3 (GELU_ERR_FUNC) is rejected as on Ascend.
Not implemented yet (NotImplementedError): UINT64/INT64-packed scales (int8 output), A8W4,
A4W4, MX, G-B, FP8/HiF8 and tuning_config.
"""

from __future__ import annotations

from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import quant
from gmm_jax._src.api import gmm

ACT_TYPES = {0: None, 1: "relu", 2: "gelu_tanh", 4: "fast_gelu", 5: "silu"}
MAX_GROUPS = 1024
MAX_WEIGHTS = 128
MAX_LAST_DIM = 65536


def _as_list(value, name):
  if value is None:
    return None
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError(f"{name} must not be an empty list")
    return [jnp.asarray(v) for v in value]
  return [jnp.asarray(value)]


def _counts(group_list, group_list_type, num_groups, dim_name):
  """Ascend group list -> (per-entry expert index or None, per-entry sizes) as jnp arrays.

  Sparse entries are processed in list order, each consuming the next `size` rows, and
  processing stops at the first entry whose size is <= 0 (Ascend's kernel semantics).
  """
  group_list = jnp.asarray(group_list)
  if not jnp.issubdtype(group_list.dtype, jnp.integer):
    raise ValueError(f"group_list must be an integer tensor (INT64 on Ascend), got "
                     f"{group_list.dtype}")
  if group_list_type not in (0, 1, 2):
    raise ValueError(f"group_list_type must be 0 (cumsum), 1 (counts) or 2 (sparse), got "
                     f"{group_list_type}")
  if group_list_type == 2:
    if group_list.ndim != 2 or group_list.shape[1] != 2:
      raise ValueError(f"a sparse group_list (type 2) must be [E, 2], got "
                       f"{list(group_list.shape)}")
  elif group_list.ndim != 1:
    raise ValueError(f"group_list must be 1-D for type {group_list_type}, got "
                     f"{list(group_list.shape)}")
  if group_list.shape[0] > MAX_GROUPS:
    raise ValueError(f"group_list has {group_list.shape[0]} entries; at most {MAX_GROUPS}")
  if num_groups > 1 and group_list.shape[0] != num_groups:
    raise ValueError(f"group_list has {group_list.shape[0]} entries but there are "
                     f"{num_groups} groups along {dim_name}")
  group_list = group_list.astype(jnp.int32)
  if group_list_type == 0:
    return None, jnp.diff(group_list, prepend=0)
  if group_list_type == 1:
    return None, group_list
  sizes = group_list[:, 1]
  processed = jnp.cumsum((sizes <= 0).astype(jnp.int32)) == 0
  return group_list[:, 0], jnp.where(processed, sizes, 0)


def _check_weights(weights):
  for w in weights:
    if w.ndim < 2:
      raise ValueError(f"weight tensors must be at least 2-D, got {list(w.shape)}")
    if w.shape[-1] >= MAX_LAST_DIM:
      raise ValueError(f"the weight's last dimension must be < {MAX_LAST_DIM}, got "
                       f"{w.shape[-1]}")
    if w.dtype == jnp.int4 and w.shape[-1] % 2:
      raise ValueError(f"INT4 weights need an even last dimension, got {w.shape[-1]}")


def _scenario(x, weight, scale, per_token_scale, antiquant_scale):
  xt, wt = np.dtype(x.dtype), np.dtype(weight.dtype)
  floats = (np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16))
  if xt in floats and wt == xt and antiquant_scale is None and scale is None:
    return "non_quant"
  if xt in floats[1:] and wt in (np.dtype(jnp.int8), np.dtype(jnp.int4)):
    if antiquant_scale is None:
      raise ValueError(f"{xt} x with {wt} weights is weight-only quantization: it needs "
                       "antiquant_scale")
    return "weight_only"
  if xt == np.dtype(jnp.int8) and wt == np.dtype(jnp.int8):
    return "a8w8"
  supported = ("non-quant (x and weight f32/f16/bf16 alike), weight-only (f16/bf16 x, "
               "int8/int4 weight, antiquant_scale), A8W8 (int8 x int8)")
  raise NotImplementedError(f"x {xt} with weight {wt} is not implemented here; supported: "
                            f"{supported}")


def _weight_qarray(weight, antiquant_scale, antiquant_offset):
  """A16W8/A16W4: W_deq = (W + offset) * scale; offset = -zero_point in QArray terms."""
  scale = jnp.asarray(antiquant_scale)
  if scale.ndim == 2:  # per-channel [E, N]
    scale = scale[:, None, :]
  elif scale.ndim != 3:
    raise ValueError(f"antiquant_scale must be [E, N] (per-channel) or [E, G, N] (per-group), "
                     f"got {list(scale.shape)}")
  offset = None
  if antiquant_offset is not None:
    offset = jnp.asarray(antiquant_offset)
    if offset.shape != jnp.asarray(antiquant_scale).shape:
      raise ValueError(f"antiquant_offset {list(offset.shape)} must match antiquant_scale "
                       f"{list(jnp.asarray(antiquant_scale).shape)}")
    offset = offset[:, None, :] if offset.ndim == 2 else offset
  k = weight.shape[1]
  if scale.shape[1] > 1 and k % scale.shape[1]:
    raise ValueError(f"per-group antiquant_scale {list(scale.shape)}: K={k} must split into "
                     f"{scale.shape[1]} equal groups")
  try:
    return quant.QArray(weight, scale, None if offset is None else -offset.astype(jnp.float32))
  except ValueError as err:
    raise ValueError(f"antiquant_scale {list(scale.shape)} does not fit weight "
                     f"{list(weight.shape)}: {err}") from None


def grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                   antiquant_offset=None, per_token_scale=None, group_list=None,
                   split_item: int = 0, group_type: int = -1, group_list_type: int = 0,
                   act_type: int = 0, output_dtype=None, tuning_config=None) -> list:
  """aclnnGroupedMatmulV5 / ``torch_npu.npu_grouped_matmul`` with Ascend's semantics.

  Args:
    x, weight, bias: arrays or lists of arrays (single vs multi tensors). Single weight:
      ``[E, K, N]`` (group type 0) or ``[K, N]`` (group type 2).
    scale: A8W8 dequant scale, f32/bf16, ``[E, N]`` (per-channel) or ``[E]``/``[E, 1]``
      (per-tensor).
    offset: not implemented (A8W4 / int8 output).
    antiquant_scale, antiquant_offset: weight-only dequantization, ``[E, N]`` or
      ``[E, G, N]``: ``W_deq = (W + offset) * scale``.
    per_token_scale: A8W8 dynamic quantization, f32 ``[M]``.
    group_list: sizes along the grouped dimension (see group_list_type).
    split_item: 0/1 multi-tensor output, 2/3 single-tensor output.
    group_type: -1 (no grouping: lists of matrices), 0 (M grouped), 2 (K grouped).
    group_list_type: 0 cumsum, 1 counts, 2 sparse ``[E, 2]`` rows (expert, size).
    act_type: 0 none, 1 relu, 2 gelu_tanh, 4 fast_gelu, 5 silu (3 is rejected).
    output_dtype: the output dtype (default: x's float type; f32... for A8W8 bf16).
    tuning_config: not implemented (a tiling hint on Ascend).

  Returns:
    A list of arrays: one per group (split_item 0/1) or a single one (2/3).

  Raises:
    ValueError: a combination Ascend's first phase rejects, naming the rule.
    NotImplementedError: a scenario this facade does not implement yet.
  """
  xs = _as_list(x, "x")
  weights = _as_list(weight, "weight")
  biases = _as_list(bias, "bias")
  if xs is None or weights is None:
    raise ValueError("x and weight are required")
  if group_type == 1:
    raise ValueError("group_type=1 (split-N) is not supported")
  if group_type not in (-1, 0, 2):
    raise ValueError(f"group_type must be -1, 0 or 2, got {group_type}")
  if split_item not in (0, 1, 2, 3):
    raise ValueError(f"split_item must be 0-3, got {split_item}")
  single_out = split_item in (2, 3)
  if act_type not in (0, 1, 2, 3, 4, 5):
    raise ValueError(f"act_type must be in 0-5, got {act_type}")
  if act_type == 3:
    raise ValueError("act_type=3 (GELU_ERR_FUNC) is not supported (as on Ascend)")
  if offset is not None or tuning_config is not None:
    raise NotImplementedError("offset (A8W4 / int8 output) and tuning_config are not "
                              "implemented in this facade yet")
  if len(weights) > MAX_WEIGHTS:
    raise ValueError(f"at most {MAX_WEIGHTS} weight tensors, got {len(weights)}")
  if biases is not None and len(biases) != len(weights):
    raise ValueError(f"bias has {len(biases)} tensors but weight has {len(weights)}")
  _check_weights(weights)
  for xi in xs:
    if not 2 <= xi.ndim <= 6:
      raise ValueError(f"x tensors must be 2-6-D, got {list(xi.shape)}")
  activation = ACT_TYPES[act_type]

  if group_type == -1:
    if group_list is not None:
      raise ValueError("group_list must be null with group_type=-1")
    if single_out:
      raise ValueError("split_item 2/3 (single output) needs group_type 0 or 2")
    if len(xs) != len(weights):
      raise ValueError(f"group_type=-1 pairs x and weight: {len(xs)} vs {len(weights)}")
    outs = []
    for i, (xi, wi) in enumerate(zip(xs, weights)):
      lead = xi.shape[:-1]
      x2 = xi.reshape(-1, xi.shape[-1])
      if wi.ndim != 2 or wi.shape[0] != x2.shape[1]:
        raise ValueError(f"x[{i}] {list(xi.shape)} and weight[{i}] {list(wi.shape)} do not "
                         "share K")
      mode = _scenario(xi, wi, scale, per_token_scale, antiquant_scale)
      if mode != "non_quant":
        raise NotImplementedError("quantized scenarios with group_type=-1 are not implemented "
                                  "in this facade yet")
      b = None if biases is None else biases[i][None, :]
      y = gmm(x2, wi[None], jnp.asarray([x2.shape[0]], jnp.int32), bias=b,
              activation=activation, preferred_element_type=output_dtype or xi.dtype)
      outs.append(y.reshape(*lead, -1))
    return outs

  if group_type == 2:
    if biases is not None:
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
      experts, sizes = _counts(group_list, group_list_type, 1, "K")
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
    mode = _scenario(x2, w, scale, per_token_scale, antiquant_scale)
    if mode != "non_quant":
      raise NotImplementedError("quantized k-grouping (full quant on 950) is not implemented "
                                "in this facade yet")
    out = gmm(x2, w, sizes, group_type="k", group_list_type="counts", num_groups=num_groups,
              activation=activation, preferred_element_type=output_dtype or x2.dtype)
    return [out] if single_out else list(out)

  # group_type == 0
  if not single_out:
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
  num_groups = w.shape[0]
  if group_list is None:
    if implied is None:
      raise ValueError("group_type=0 with a single x needs a group_list")
    experts, sizes = None, implied
  else:
    experts, sizes = _counts(group_list, group_list_type, num_groups, "M")
    if implied is not None and not isinstance(sizes, jax.core.Tracer) and not np.array_equal(
        np.asarray(sizes), np.asarray(implied)):
      raise ValueError("with multiple x tensors, the group sizes must equal each x's rows")
  if x2.shape[1] != w.shape[1]:
    raise ValueError(f"x {list(x2.shape)} has K={x2.shape[1]}, weight {list(w.shape)} "
                     f"K={w.shape[1]}")
  if not isinstance(sizes, jax.core.Tracer) and int(np.sum(np.asarray(sizes))) > x2.shape[0]:
    raise ValueError(f"the group list covers {int(np.sum(np.asarray(sizes)))} rows, more than "
                     f"x's {x2.shape[0]}")
  bias_array = None if biases is None else (biases[0] if len(biases) == 1 else
                                            jnp.stack(biases))
  if bias_array is not None and bias_array.shape != (num_groups, w.shape[2]):
    raise ValueError(f"bias must be [E, N]={[num_groups, w.shape[2]]}, got "
                     f"{list(bias_array.shape)}")

  mode = _scenario(x2, w, scale, per_token_scale, antiquant_scale)
  lhs, rhs = x2, w
  out_dtype = output_dtype
  if mode == "weight_only":
    rhs = _weight_qarray(w, antiquant_scale, antiquant_offset)
    out_dtype = out_dtype or x2.dtype
  elif mode == "a8w8":
    if scale is None:  # INT32 output: the raw accumulator (+ int32 bias)
      if out_dtype not in (None, jnp.int32, np.dtype(jnp.int32)):
        raise ValueError("A8W8 without scale gives INT32 output only")
      out_dtype = jnp.int32
      if per_token_scale is not None:
        raise ValueError("per_token_scale needs scale")
    else:
      scale_array = jnp.asarray(scale)
      if scale_array.dtype in (jnp.uint64, jnp.int64, jnp.uint32):
        raise NotImplementedError("UINT64/INT64-packed scales (int8 output) are not "
                                  "implemented in this facade yet")
      if scale_array.ndim == 1:  # per-tensor [E]
        scale_array = scale_array[:, None, None]
      elif scale_array.ndim == 2:  # [E, N] per-channel or [E, 1] per-tensor
        scale_array = scale_array[:, None, :]
      else:
        raise ValueError(f"scale must be [E, N], [E, 1] or [E], got {list(scale_array.shape)}")
      pts = (jnp.ones((1, 1), jnp.float32) if per_token_scale is None
             else jnp.asarray(per_token_scale, jnp.float32)[:, None])
      if per_token_scale is not None and pts.shape[0] != x2.shape[0]:
        raise ValueError(f"per_token_scale must be [M]={[x2.shape[0]]}, got "
                         f"{list(np.shape(per_token_scale))}")
      lhs = quant.QArray(x2, pts)
      rhs = quant.QArray(w, scale_array.astype(jnp.float32))
      out_dtype = out_dtype or jnp.bfloat16
  else:
    out_dtype = out_dtype or x2.dtype

  if experts is not None:
    # Sparse: entry i takes the next sizes[i] rows with expert experts[i]'s weights (any
    # order, stopping at the first empty entry): one gmm group per entry.
    index = jnp.clip(experts, 0, num_groups - 1)
    rhs = jax.tree.map(lambda a: a[index] if a.shape[0] == num_groups else a, rhs)
    bias_array = None if bias_array is None else bias_array[index]
  out = gmm(lhs, rhs, sizes, group_list_type="counts", bias=bias_array, activation=activation,
            preferred_element_type=out_dtype)
  return [out]
