"""Ascend aclnnGroupedMatmulV5's first phase for `gmm_jax.compat.ascend`: which scenario of
the spec's section 6 a call is, and the rules each scenario's table sets (which arguments it
takes or needs, its group types, output and bias dtypes), plus section 8's tuning_config."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax.compat import _ascend_scales as scales
from gmm_jax.compat._ascend_scales import (BF16, E8M0, F16, F32, FLOATS, FP4, FP8, GB_BLOCK, I4,
                                           I8, I32)
from gmm_jax.compat._ascend_scales import array as _array
from gmm_jax.compat._ascend_scales import dtype as _dtype

ACT_TYPES = {0: None, 1: "relu", 2: "gelu_tanh", 4: "fast_gelu", 5: "silu"}
MAX_GROUPS = 1024
MAX_WEIGHTS = 128  # quantized scenarios; non-quant lists go up to MAX_GROUPS (950)
MAX_LAST_DIM = 65536

NAMES = {
    "non_quant": "non-quant", "weight_only": "weight-only (A16W8/A16W4/fp8 weight)",
    "a8w8_int32": "A8W8 with INT32 output", "a8w8_packed": "A8W8 with a UINT64/INT64 scale",
    "a8w8": "A8W8", "a8w4": "A8W4", "a4w4": "A4W4", "fp8_packed": "FP8 with a packed scale",
    "fp8": "FP8 (static/dynamic)", "gb": "G-B (FP8, 128-blocks)", "mx": "MX",
}
# The optional quantization arguments each scenario takes (others must be null).
_TAKES = {
    "non_quant": (), "weight_only": ("antiquant_scale", "antiquant_offset"),
    "a8w8_int32": (), "a8w8_packed": ("scale",), "a8w8": ("scale", "per_token_scale"),
    "a8w4": ("scale", "offset", "per_token_scale"), "a4w4": ("scale", "per_token_scale"),
    "fp8_packed": ("scale",), "fp8": ("scale", "per_token_scale"),
    "gb": ("scale", "per_token_scale"), "mx": ("scale", "per_token_scale"),
}
_FULL_QUANT = ("a8w8_int32", "a8w8_packed", "a8w8", "a4w4", "fp8_packed", "fp8", "gb", "mx")
_SUPPORTED_PAIRS = ("f32/f16/bf16 x the same (non-quant); f16/bf16 x int8/int4/fp8 "
                    "(weight-only); int8 x int8 (A8W8); int8 x int4 (A8W4); int4 x int4 (A4W4); "
                    "fp8 x fp8 (FP8, MX, G-B); fp4 x fp4 (MX). HiFloat8 has no JAX dtype")


# ------------------------------------------------------------------------------- helpers


def as_list(value, name):
  if value is None:
    return None
  if isinstance(value, (list, tuple)):
    if not value:
      raise ValueError(f"{name} must not be an empty list")
    return list(value)
  return [value]


def counts(group_list, group_list_type, num_groups, dim_name):
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
  # Ascend checks no values (V3+) and gives undefined results for bad ones; a host list is
  # checked here; a traced one can be, with gmm_jax.check_group_list under checkify.
  known = concrete(group_list)
  if group_list_type == 0:
    if known is not None and (np.diff(known, prepend=0) < 0).any():
      raise ValueError(f"a cumsum group_list (type 0) must be non-negative and non-decreasing, "
                       f"got {known.tolist()}")
    return None, jnp.diff(group_list, prepend=0)
  if group_list_type == 1:
    if known is not None and (known < 0).any():
      raise ValueError(f"a counts group_list (type 1) must be non-negative, got "
                       f"{known.tolist()}")
    return None, group_list
  sizes = group_list[:, 1]
  processed = jnp.cumsum((sizes <= 0).astype(jnp.int32)) == 0
  return group_list[:, 0], jnp.where(processed, sizes, 0)


def concrete(value):
  return None if isinstance(value, jax.core.Tracer) else np.asarray(value)


# ------------------------------------------------------------------------ the scenario


def scenario(x, weight, scale, antiquant_scale, group_type, k: int, n: int, g: int):
  """Which section-6 scenario an (x, weight, scale) triple is, or a ValueError."""
  xt, wt = _dtype(x), _dtype(weight)
  if xt in FLOATS and wt == xt:
    if antiquant_scale is not None or scale is not None:
      raise ValueError(f"{xt} x with {wt} weights is non-quant: scale and antiquant_scale "
                       "must be null")
    return "non_quant"
  if xt in (F16, BF16) and wt in (I8, I4) + FP8:
    if antiquant_scale is None:
      raise ValueError(f"{xt} x with {wt} weights is weight-only quantization: it needs "
                       "antiquant_scale")
    return "weight_only"
  if xt == I8 and wt == I8:
    if scale is None:
      return "a8w8_int32"
    return "a8w8_packed" if scales.is_packed(scale) else "a8w8"
  if xt == I8 and wt == I4:
    return "a8w4"
  if xt == I4 and wt == I4:
    return "a4w4"
  if (xt in FP8 and wt in FP8) or (xt == FP4 and wt == FP4):
    if scale is None:
      raise ValueError(f"{xt} x {wt} is full quantization: it needs a scale")
    if scales.is_packed(scale):
      return "fp8_packed" if xt in FP8 else "mx"
    if _dtype(_array(scale)) == E8M0 or xt == FP4:
      return "mx"
    return "gb" if _is_gb_scale(_array(scale), group_type, k, n, g) else "fp8"
  raise ValueError(f"x {xt} with weight {wt} matches no Ascend scenario; supported: "
                   f"{_SUPPORTED_PAIRS}")


def _is_gb_scale(scale, group_type, k, n, g) -> bool:
  blocks_n = -(-n // GB_BLOCK)
  if group_type == 2:  # (K/128 + g, ceil(N/128)); with K < 128 it reads as per-group
    return (scale.ndim == 2 and scale.shape == (scales.k_rows_needed(k, g, GB_BLOCK),
                                                blocks_n) and scale.shape != (g, n))
  return scale.ndim == 3


def check_arguments(kind, args, xt, weight_type, group_type, single_x, single_w):
  """Which arguments each scenario takes, requires, and where it may run (sections 3, 6)."""
  name = NAMES[kind]
  for arg in ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale"):
    if args[arg] is not None and arg not in _TAKES[kind]:
      raise ValueError(f"{arg} must be null for {name} (x {xt}, weight {weight_type})")
  required = {"a8w4": ("scale", "per_token_scale", "bias"), "a4w4": ("scale",),
              "gb": ("per_token_scale",), "mx": ("per_token_scale",)}.get(kind, ())
  for arg in required:
    if args[arg] is None:
      raise ValueError(f"{name} needs {arg}")
  fp8_weight = kind == "weight_only" and weight_type in FP8
  allowed = {"non_quant": (-1, 0, 2), "weight_only": (0,) if fp8_weight else (-1, 0),
             "fp8": (0, 2), "gb": (0, 2), "mx": (0, 2) if xt in FP8 else (0,)}.get(kind, (0,))
  if group_type not in allowed:
    raise ValueError(f"{name} supports group_type {allowed}, got {group_type}")
  if kind in _FULL_QUANT and not (single_x and single_w):
    raise ValueError(f"{name} needs a single x and a single weight tensor")
  if kind == "a8w4" and not single_x:
    raise ValueError("A8W4 needs a single x tensor")
  if args["per_token_scale"] is not None and not (single_x and single_w):
    raise ValueError("per_token_scale needs single x, weight and out tensors")
  if fp8_weight and args["antiquant_offset"] is not None:
    raise ValueError("fp8 weight-only quantization takes no antiquant_offset")
  for arg in ("antiquant_scale", "antiquant_offset"):
    if kind == "weight_only" and args[arg] is not None:
      dtype = _dtype(jnp.asarray(as_list(args[arg], arg)[0]))
      if dtype != xt:
        raise ValueError(f"{arg} must have x's dtype {xt}, got {dtype}")
  scale = args["scale"]
  if scale is not None and kind != "mx":
    packed = scales.is_packed(scale)
    scale_dtype = _dtype(jnp.asarray(as_list(scale, "scale")[0])) if not packed else None
    if kind in ("a8w4", "a4w4") and not packed:
      raise ValueError(f"{name} takes a UINT64/INT64 scale (trans_quant_param), got "
                       f"{scale_dtype}")
    floats = (F32, BF16) if kind == "a8w8" else (F32,)
    if not packed and scale_dtype not in floats:
      raise ValueError(f"{name} takes a {'f32/bf16' if kind == 'a8w8' else 'f32'} or "
                       f"UINT64/INT64 scale, got {scale_dtype}")


def out_dtype_of(kind, xt, scale, offset, output_dtype):
  """The output dtypes each scenario's table allows; the first is the default."""
  if kind in ("non_quant", "weight_only"):
    allowed = (xt,)
  elif kind == "a8w8_int32":
    allowed = (I32,)
  elif kind == "a8w8_packed":
    allowed = (np.dtype(jnp.int8), BF16, F16, I32)
  elif kind == "a8w8":
    allowed = (BF16,) if _dtype(_array(scale)) == BF16 else (BF16, F16)
  elif kind == "a8w4":
    allowed = (F16,) if offset is not None else (BF16, F16)
  elif kind == "a4w4":
    allowed = (BF16, F16)
  else:
    allowed = (BF16, F16, F32)
  if output_dtype is None:
    return allowed[0]
  out = np.dtype(output_dtype)
  if out not in allowed:
    raise ValueError(f"{NAMES[kind]} (x {xt}) gives {[str(a) for a in allowed]} output, not "
                     f"{out}")
  return out


def check_bias(kind, xt, out, bias_dtypes, weight_type):
  if not bias_dtypes:
    return
  if kind == "non_quant":
    allowed = {F32: (F32,), F16: (F16, F32), BF16: (BF16, F32)}[xt]
  elif kind == "weight_only":
    allowed = (BF16, F32) if xt == BF16 else (F16,)
  elif kind in ("a8w8_int32", "a8w8_packed"):
    allowed = (I32,)
  elif kind == "a8w8":
    allowed = (I32, out, F32)
  elif kind == "a8w4" or (kind == "mx" and xt == FP4):
    allowed = (F32,)
  else:
    raise ValueError(f"bias must be null for {NAMES[kind]} (x {xt}, weight {weight_type})")
  for dtype in bias_dtypes:
    if dtype not in allowed:
      raise ValueError(f"{NAMES[kind]} with {out} output takes a bias of "
                       f"{sorted({str(a) for a in allowed})}, got {dtype}")


def check_tuning(tuning_config, kind, max_m, per_channel_a8w4):
  if tuning_config is None:
    return
  values = np.asarray(tuning_config)
  if values.ndim != 1 or values.size > 3 or not np.issubdtype(values.dtype, np.integer):
    raise ValueError(f"tuning_config must be at most 3 integers, got {tuning_config!r}")
  if values.size and not 0 <= values[0] <= max_m:
    raise ValueError(f"tuning_config[0] (expected tokens per expert) must lie in [0, "
                     f"{max_m}] (the largest x dim 0), got {values[0]}")
  if values.size > 1:
    if values[1] not in (0, 1):
      raise ValueError(f"tuning_config[1] must be 0 or 1, got {values[1]}")
    if values[1] == 1 and not (kind == "a8w4" and per_channel_a8w4):
      raise ValueError("tuning_config[1] = 1 (pre-transposed weight layout) is for per-channel "
                       "A8W4 only")
  if values.size > 2 and values[2] < -1:
    raise ValueError(f"tuning_config[2] (A8W8 workspace bytes) must be -1 or >= 0, got "
                     f"{values[2]}")


def check_structure(xs, weights, biases, group_type, split_item, act_type, weight_transposed):
  """The attributes and the tensor lists' ranks, counts and last dims (section 9)."""
  if group_type == 1:
    raise ValueError("group_type=1 (split-N) is not supported")
  if group_type not in (-1, 0, 2):
    raise ValueError(f"group_type must be -1, 0 or 2, got {group_type}")
  if split_item not in (0, 1, 2, 3):
    raise ValueError(f"split_item must be 0-3, got {split_item}")
  if act_type not in (0, 1, 2, 3, 4, 5):
    raise ValueError(f"act_type must be in 0-5, got {act_type}")
  if act_type == 3:
    raise ValueError("act_type=3 (GELU_ERR_FUNC) is not supported (as on Ascend)")
  if biases is not None and len(biases) != len(weights):
    raise ValueError(f"bias has {len(biases)} tensors but weight has {len(weights)}")
  if len({_dtype(w) for w in weights}) > 1 or len({_dtype(v) for v in xs}) > 1:
    raise ValueError("the tensors of a list must share one dtype")
  for w in weights:
    if w.ndim < 2:
      raise ValueError(f"weight tensors must be at least 2-D, got {list(w.shape)}")
    if w.shape[-1] >= MAX_LAST_DIM:
      raise ValueError(f"the weight's last dimension must be < {MAX_LAST_DIM}, got "
                       f"{w.shape[-1]}")
    if _dtype(w) in (I4, FP4) and w.shape[-1] % 2:
      raise ValueError(f"{_dtype(w)} weights need an even last dimension, got {w.shape[-1]}")
  for xi in xs:
    if not 2 <= xi.ndim <= 6:
      raise ValueError(f"x tensors must be 2-6-D, got {list(xi.shape)}")
  if group_type == 2 and weight_transposed:
    raise ValueError("group_type=2 (k-grouping) needs a weight that is not transposed")
  # Stored last dims (x is stored [K, M] for k-grouping).
  x_last = xs[0].shape[0] if group_type == 2 else xs[0].shape[-1]
  if x_last >= MAX_LAST_DIM:
    raise ValueError(f"x's stored last dimension must be < {MAX_LAST_DIM}, got {x_last}")


def check_scenario(kind, xs, weights, k, n, group_type, out_dtype, act_type, antiquant_scale,
                   offset, tuning_config, weight_transposed):
  """A scenario's own shape rules (sections 6, 7 and 9) and tuning_config (section 8)."""
  limit = MAX_GROUPS if kind == "non_quant" else MAX_WEIGHTS
  if len(weights) > limit:
    raise ValueError(f"at most {limit} weight tensors for {NAMES[kind]}, got {len(weights)}")
  w0 = weights[0]
  xt = _dtype(xs[0])
  if out_dtype == I32 and act_type:
    raise ValueError("INT32 output takes no activation (act_type must be 0)")
  if weight_transposed and kind in ("a8w4", "a4w4"):
    raise ValueError(f"{NAMES[kind]} needs a weight that is not transposed (ND)")
  if kind == "weight_only" and _dtype(w0) in FP8 and not weight_transposed:
    raise ValueError("fp8 weight-only quantization needs a transposed weight "
                     "(weight_transposed=True, weight [E, N, K])")
  if kind == "weight_only" and _dtype(w0) == I4 and weight_transposed:
    # A transposed int4 weight packs K pairwise, so a per-group K group must be even.
    first = jnp.asarray(as_list(antiquant_scale, "antiquant_scale")[0])
    groups = first.shape[-2] if first.ndim == (3 if group_type == 0 and len(weights) == 1
                                               else 2) else 1
    if groups > 1 and (k // groups) % 2:
      raise ValueError(f"a transposed int4 weight needs an even per-group size, got K={k} in "
                       f"{groups} groups")
  if xt == FP4 and (k % 2 or k == 2):
    raise ValueError(f"FP4 needs an even K other than 2, got K={k}")
  if xt == FP4 and not weight_transposed and n % 2:
    raise ValueError(f"FP4 with a non-transposed weight needs an even N, got N={n}")
  k_x = xs[0].shape[-1]
  if k_x == 0 and not (all(np.prod(v.shape[:-1]) == 0 for v in xs) or n == 0):
    raise ValueError("K = 0 is only valid when every x has no rows or every weight has no "
                     "columns")
  max_m = max(int(np.prod(v.shape[:-1])) for v in xs)
  check_tuning(tuning_config, kind, max_m, kind == "a8w4" and offset is not None)
