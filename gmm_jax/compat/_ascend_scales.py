"""Ascend's quantization parameters in gmm_jax terms (used by `gmm_jax.compat.ascend`).

* UINT64/INT64 "quant parameters" (aclnnTransQuantParam): an fp32 scale with its low 13
  mantissa bits dropped, bit 46 set, and an optional 9-bit signed offset at bits 37..45.
* The 950's MX layouts: e8m0 scales of 32-wide K blocks, two consecutive blocks packed in a
  trailing axis of 2.
* k-grouping block layouts (MX and G-B): every group's blocks start at its own first column,
  group i's first block row being ``(K_0 + ... + K_{i-1}) // block + i`` (spec 6.4/6.5; floor
  division is our reading where the sum is not a multiple of the block).

`m_parameters` and `k_dequantized` turn a call's scale arguments into gmm_jax operands' terms:
logical per-expert and per-row scales (m-grouping), or per-column dequantized operands
(k-grouping).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core import metadata

PACKED_DTYPES = (np.dtype(np.uint64), np.dtype(np.int64))
_SCALE_MASK = 0xFFFFE000
_FLAG = 1 << 46
_OFFSET_SHIFT = 37
_OFFSET_MASK = 0x1FF  # 9 bits
MX_BLOCK = 32
GB_BLOCK = 128

F32, F16, BF16 = np.dtype(jnp.float32), np.dtype(jnp.float16), np.dtype(jnp.bfloat16)
I8, I4, I32 = np.dtype(jnp.int8), np.dtype(jnp.int4), np.dtype(jnp.int32)
FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
FP4 = np.dtype(jnp.float4_e2m1fn)
E8M0 = np.dtype(jnp.float8_e8m0fnu)
FLOATS = (F32, F16, BF16)


def trans_quant_param(scale, offset=None) -> np.ndarray:
  """aclnnTransQuantParam / ``torch_npu.npu_trans_quant_param``: fp32 scale (and offset) ->
  the INT64 quant parameter Ascend's INT8-output paths take.

  Args:
    scale: float array (any shape), e.g. ``[E, N]``.
    offset: None or a float array broadcastable to scale: rounded, clamped to [-256, 255].

  Returns:
    A numpy int64 array of scale's shape (numpy, because JAX holds 64-bit integers only with
    ``jax_enable_x64``). Pass it as ``scale=`` to `grouped_matmul`.
  """
  scale = np.asarray(scale, np.float32)
  bits = (scale.view(np.uint32).astype(np.uint64) & np.uint64(_SCALE_MASK)) | np.uint64(_FLAG)
  if offset is not None:
    offset = np.asarray(offset, np.float32)
    try:
      offset = np.broadcast_to(offset, scale.shape)
    except ValueError:
      raise ValueError(f"offset {list(offset.shape)} does not broadcast to scale "
                       f"{list(scale.shape)}") from None
    field = np.clip(np.round(offset), -256, 255).astype(np.int64).astype(np.uint64)
    bits = bits | ((field & np.uint64(_OFFSET_MASK)) << np.uint64(_OFFSET_SHIFT))
  return bits.astype(np.int64)


def unpack_int4(weight) -> jax.Array:
  """An INT32 weight holding 8 INT4 values per element (A8W4's packed form, ``[..., N/8]``)
  -> ``int4 [..., N]``; the lowest nibble is the first value (our reading: Ascend's int4
  packing is little-endian)."""
  shifts = jnp.arange(8, dtype=jnp.int32) * 4
  nibbles = (weight.astype(jnp.int32)[..., None] >> shifts) & 0xF
  values = jnp.where(nibbles >= 8, nibbles - 16, nibbles)
  return values.reshape(*weight.shape[:-1], weight.shape[-1] * 8).astype(jnp.int4)


def is_packed(value) -> bool:
  """Whether `value` (an array or a list of them) is a UINT64/INT64 quant parameter."""
  if isinstance(value, (list, tuple)):
    return bool(value) and is_packed(value[0])
  dtype = getattr(value, "dtype", None)
  return dtype is not None and np.dtype(dtype) in PACKED_DTYPES


def dtype(value):
  return np.dtype(value.dtype)


def array(value):
  """A parameter as one array: a list of one tensor is that tensor, longer lists (one tensor
  per weight) are stacked; numpy is kept for packed 64-bit scales, which JAX cannot hold
  without x64."""
  if value is None:
    return None
  if isinstance(value, (list, tuple)) and len(value) == 1:
    value = value[0]
  if isinstance(value, (list, tuple)):
    if is_packed(value) and not any(isinstance(v, jax.Array) for v in value):
      return np.stack([np.asarray(v) for v in value])
    return jnp.stack([jnp.asarray(v) for v in value])
  if is_packed(value) and not isinstance(value, jax.Array):
    return np.asarray(value)
  return jnp.asarray(value)


def decode_packed(value):
  """UINT64/INT64 quant parameter -> (f32 scale, f32 offset or None), same shape.

  Host (numpy) values are decoded with numpy; JAX arrays need ``jax_enable_x64``.
  """
  if isinstance(value, jax.Array):
    bits = value.astype(jnp.uint64)
    scale = jax.lax.bitcast_convert_type((bits & _SCALE_MASK).astype(jnp.uint32), jnp.float32)
    field = ((bits >> _OFFSET_SHIFT) & _OFFSET_MASK).astype(jnp.int32)
    offset = jnp.where(field >= 256, field - 512, field).astype(jnp.float32)
    return scale, offset
  bits = np.asarray(value).astype(np.uint64)
  scale = (bits & np.uint64(_SCALE_MASK)).astype(np.uint32).view(np.float32)
  field = ((bits >> np.uint64(_OFFSET_SHIFT)) & np.uint64(_OFFSET_MASK)).astype(np.int32)
  offset = np.where(field >= 256, field - 512, field).astype(np.float32)
  return jnp.asarray(scale), (jnp.asarray(offset) if offset.any() else None)


def _check_shape(value, want, name, layout_name):
  if tuple(value.shape) != tuple(want):
    raise ValueError(f"{name} must be {layout_name} = {list(want)}, got {list(value.shape)}")


def mx_weight_scale(scale, e: int, k: int, n: int, transposed: bool) -> jax.Array:
  """m-grouping MX weight scale ``(E, ceil(K/64), N, 2)`` (transposed weight: ``(E, N,
  ceil(K/64), 2)``) -> logical ``(E, ceil(K/32), N)``."""
  pairs, blocks = -(-k // (2 * MX_BLOCK)), -(-k // MX_BLOCK)
  if transposed:
    _check_shape(scale, (e, n, pairs, 2), "scale", "(E, N, ceil(K/64), 2)")
    return jnp.swapaxes(scale.reshape(e, n, 2 * pairs)[:, :, :blocks], 1, 2)
  _check_shape(scale, (e, pairs, n, 2), "scale", "(E, ceil(K/64), N, 2)")
  return jnp.swapaxes(scale, 2, 3).reshape(e, 2 * pairs, n)[:, :blocks]


def mx_token_scale(per_token_scale, m: int, k: int) -> jax.Array:
  """m-grouping MX per_token_scale ``(M, ceil(K/64), 2)`` -> logical ``(M, ceil(K/32))``."""
  pairs, blocks = -(-k // (2 * MX_BLOCK)), -(-k // MX_BLOCK)
  _check_shape(per_token_scale, (m, pairs, 2), "per_token_scale", "(M, ceil(K/64), 2)")
  return per_token_scale.reshape(m, 2 * pairs)[:, :blocks]


def column_groups(sizes, k: int):
  """For each of the K columns of a k-grouped problem: its group (clamped to 0 past the
  total, where gmm ignores the column) and its offset from its group's first column, plus
  each group's first column."""
  bounds = metadata.bounds_from_counts(sizes, k)
  ids = jnp.maximum(metadata.row_group_ids(sizes, k), 0)
  local = jnp.arange(k, dtype=jnp.int32) - bounds[ids]
  return ids, local, bounds[:-1]


def k_block_rows(sizes, k: int, block: int):
  """Row of each column's block in a k-grouped block layout (spec 6.4/6.5): group i's
  blocks start at row ``start_i // block + i``, one row per `block` columns of the group."""
  ids, local, starts = column_groups(sizes, k)
  return starts[ids] // block + ids + local // block, local


def k_rows_needed(k: int, g: int, block: int) -> int:
  return k // block + g


# ------------------------------------------------ parameters in logical layouts


def k_dequantized(kind, x, w, sizes, g, scale, pts):
  """Full quant with K grouped (FP8, MX, G-B on the 950): each column of x and row of w
  belongs to one group, so both are dequantized elementwise with that group's (block)
  scales; the f32 k-grouped gmm then sums the block products times their scales."""
  m, k = x.shape
  n = w.shape[1]
  ids, local, _ = column_groups(sizes, k)
  if kind == "mx":
    rows = k_rows_needed(k, g, 2 * MX_BLOCK)
    if scale.shape != (rows, n, 2):
      raise ValueError(f"MX k-grouping scale must be (K/64 + g, N, 2) = {[rows, n, 2]}, got "
                       f"{list(scale.shape)}")
    if pts.shape != (rows, m, 2):
      raise ValueError(f"MX k-grouping per_token_scale must be (K/64 + g, M, 2) = "
                       f"{[rows, m, 2]}, got {list(pts.shape)}")
    row, local = k_block_rows(sizes, k, 2 * MX_BLOCK)
    slot = (local // MX_BLOCK) % 2
    w_scale = scale.astype(jnp.float32)[row, :, slot]  # [K, N]
    x_scale = pts.astype(jnp.float32)[row, :, slot].T  # [M, K]
  elif kind == "gb":
    rows = k_rows_needed(k, g, GB_BLOCK)
    if pts.shape != (rows, m):
      raise ValueError(f"G-B k-grouping per_token_scale must be (K/128 + g, M) = {[rows, m]}, "
                       f"got {list(pts.shape)}")
    row, _ = k_block_rows(sizes, k, GB_BLOCK)
    columns = jnp.arange(n) // GB_BLOCK
    w_scale = scale.astype(jnp.float32)[row][:, columns]
    x_scale = pts.astype(jnp.float32)[row].T
  else:  # per-channel [g, N] / per-tensor [g] or [g, 1]; x per-token [g, M] or per-tensor
    w_scale = per_group(scale, g, n, "scale", "[g, N], [g] or [g, 1]")[ids]  # [K, N]
    x_scale = (jnp.ones((1, 1), jnp.float32) if pts is None else
               per_group(pts, g, m, "per_token_scale", "[g, M], [g] or [g, 1]")[ids].T)
  return x.astype(jnp.float32) * x_scale, w.astype(jnp.float32) * w_scale


def per_group(value, g, size, name, shapes):
  """``[g, size]``, ``[g]`` or ``[g, 1]`` -> f32 ``[g, size]``."""
  if value.shape == (g, size) or value.shape == (g, 1):
    return jnp.broadcast_to(value.astype(jnp.float32), (g, size))
  if value.shape == (g,):
    return jnp.broadcast_to(value.astype(jnp.float32)[:, None], (g, size))
  raise ValueError(f"{name} must be {shapes} with g={g}, got {list(value.shape)}")


def m_parameters(kind, e, m, k, n, weight_transposed, int8_out, params):
  """The scenario's parameters in logical layouts: per expert (leading E, gathered for a
  sparse list) and per row of x.

  Args:
    params: arrays (lists already stacked): scale (a packed one already decoded to f32, its
      offset in packed_offset), offset, antiquant_scale, antiquant_offset, per_token_scale.
  """
  per_expert, per_row = {}, {}
  scale, pts = params["scale"], params["per_token_scale"]
  if kind == "weight_only":
    per_expert["antiquant_scale"] = params["antiquant_scale"]
    per_expert["antiquant_offset"] = params["antiquant_offset"]
  elif kind in ("a8w8", "fp8", "a8w8_packed", "fp8_packed", "a4w4", "a8w4"):
    value, out_offset = scale.astype(jnp.float32), params["packed_offset"]
    if kind == "a8w4":
      per_expert.update(_a8w4_parameters(value, params["offset"], e, k, n))
    elif kind == "a4w4":
      per_expert["scale"] = _a4w4_scale(value, e, k, n)
    else:
      per_expert["scale"] = channel_scale(value, e, n, int8_out)
      if out_offset is not None:
        per_expert["output_offset"] = channel_scale(out_offset, e, n, int8_out)[:, 0, :]
    if pts is not None:
      if dtype(pts) != F32:
        raise ValueError(f"per_token_scale must be f32, got {pts.dtype}")
      if pts.shape == (m,):  # per-token (also when g == M, spec 6.6)
        per_row["token_scale"] = pts[:, None]
      elif kind == "fp8" and pts.shape in ((e,), (e, 1)):
        per_expert["tensor_scale"] = pts.reshape(e)
      else:
        shapes = "[M] or [g] / [g, 1]" if kind == "fp8" else "[M]"
        raise ValueError(f"per_token_scale must be {shapes} (M={m}, g={e}), got "
                         f"{list(pts.shape)}")
  elif kind == "gb":
    kb, nb = -(-k // GB_BLOCK), -(-n // GB_BLOCK)
    want = (e, nb, kb) if weight_transposed else (e, kb, nb)
    if scale.shape != want:
      raise ValueError(f"G-B scale must be {list(want)} (g, ceil(K/128), ceil(N/128)"
                       f"{', transposed' if weight_transposed else ''}), got "
                       f"{list(scale.shape)}")
    if pts.shape != (m, kb) or dtype(pts) != F32:
      raise ValueError(f"G-B per_token_scale must be f32 (M, ceil(K/128)) = {[m, kb]}, got "
                       f"{pts.dtype} {list(pts.shape)}")
    per_expert["scale"] = jnp.swapaxes(scale, 1, 2) if weight_transposed else scale
    per_row["token_scale"] = pts
  elif kind == "mx":
    if dtype(scale) != E8M0 or dtype(pts) != E8M0:
      raise ValueError(f"MX scale and per_token_scale must be float8_e8m0fnu, got "
                       f"{scale.dtype} and {pts.dtype}")
    per_expert["scale"] = mx_weight_scale(scale, e, k, n, weight_transposed)
    per_row["token_scale"] = mx_token_scale(pts, m, k)
  return per_expert, per_row


def _a8w4_parameters(value, offset, e, k, n):
  """A8W4's f32 scale, ``[E, 1, N]`` with an offset (also ``[E, 1, N]``) or per group of
  256 rows of K ``[E, K/256, N]`` without one: {"scale", "offset" where given}."""
  want = (e, 1, n) if offset is not None else (e, k // 256, n)
  if offset is None and (k % 256 or k > 18432 or n % 8):
    raise ValueError(f"per-group A8W4 needs K % 256 == 0, K <= 18432 and N % 8 == 0, got "
                     f"K={k}, N={n}")
  if value.shape != want:
    raise ValueError(f"A8W4 scale must be {list(want)}, got {list(value.shape)}")
  if offset is None:
    return {"scale": value}
  if offset.shape != (e, 1, n) or dtype(offset) != F32:
    raise ValueError(f"A8W4 offset must be f32 [E, 1, N]={[e, 1, n]}, got "
                     f"{offset.dtype} {list(offset.shape)}")
  return {"scale": value, "offset": offset}


def _a4w4_scale(value, e, k, n):
  """A4W4's f32 scale ``[E, N]`` (per channel) or ``[E, G, N]`` (per group of K, each of an
  even size) -> ``[E, 1 or G, N]``."""
  if n % 8:
    raise ValueError(f"A4W4 needs N % 8 == 0, got N={n}")
  if value.ndim == 3 and value.shape[0] == e and value.shape[2] == n:
    groups = value.shape[1]
    if k % groups or (k // groups) % 2:
      raise ValueError(f"per-group A4W4 scale {list(value.shape)}: K={k} must split into "
                       f"{groups} groups of an even size")
    return value
  if value.shape == (e, n):
    return value[:, None, :]
  raise ValueError(f"A4W4 scale must be [E, N] or [E, G, N], got {list(value.shape)}")


def channel_scale(value, e, n, int8_out):
  """Per-channel ``[E, N]`` or per-tensor ``[E]`` / ``[E, 1]`` -> ``[E, 1, N or 1]``."""
  per_tensor = value.shape == (e,) or (value.shape == (e, 1) and n != 1)
  if per_tensor and int8_out:
    raise ValueError(f"INT8 output needs a per-channel scale [E, N]={[e, n]}; per-tensor "
                     f"{list(value.shape)} is not supported")
  if value.shape == (e, n) or value.shape == (e, 1):
    return value[:, None, :]
  if value.shape == (e,):
    return value[:, None, None]
  raise ValueError(f"scale must be [E, N] (per-channel) or [E] / [E, 1] (per-tensor) with "
                   f"E={e}, N={n}, got {list(value.shape)}")
