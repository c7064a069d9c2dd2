"""Ascend's quantization parameters in gmm_jax terms (used by `gmm_jax.compat.ascend`).

* UINT64/INT64 "quant parameters" (aclnnTransQuantParam): an fp32 scale with its low 13
  mantissa bits dropped, bit 46 set, and an optional 9-bit signed offset at bits 37..45.
* The 950's MX layouts: e8m0 scales of 32-wide K blocks, two consecutive blocks packed in a
  trailing axis of 2.
* k-grouping block layouts (MX and G-B): every group's blocks start at its own first column,
  group i's first block row being ``(K_0 + ... + K_{i-1}) // block + i`` (spec 6.4/6.5; floor
  division is our reading where the sum is not a multiple of the block).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import layout

PACKED_DTYPES = (np.dtype(np.uint64), np.dtype(np.int64))
_SCALE_MASK = 0xFFFFE000
_FLAG = 1 << 46
_OFFSET_SHIFT = 37
_OFFSET_MASK = 0x1FF  # 9 bits
MX_BLOCK = 32
GB_BLOCK = 128


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


def is_packed(value) -> bool:
  """Whether `value` (an array or a list of them) is a UINT64/INT64 quant parameter."""
  if isinstance(value, (list, tuple)):
    return bool(value) and is_packed(value[0])
  dtype = getattr(value, "dtype", None)
  return dtype is not None and np.dtype(dtype) in PACKED_DTYPES


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
  bounds = layout.bounds_from_counts(sizes, k)
  ids = jnp.maximum(layout.row_group_ids(sizes, k), 0)
  local = jnp.arange(k, dtype=jnp.int32) - bounds[ids]
  return ids, local, bounds[:-1]


def k_block_rows(sizes, k: int, block: int):
  """Row of each column's block in a k-grouped block layout (spec 6.4/6.5): group i's
  blocks start at row ``start_i // block + i``, one row per `block` columns of the group."""
  ids, local, starts = column_groups(sizes, k)
  return starts[ids] // block + ids + local // block, local


def k_rows_needed(k: int, g: int, block: int) -> int:
  return k // block + g
