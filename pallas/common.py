"""Helpers shared by the Pallas kernels: tile sizes, edge masks, per-group bounds.

Kernels read the grouped layout only through `gmm_jax._src.layout` (work items, group
bounds); nothing here re-derives group offsets from a group list.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src import layout


def next_power_of_2(x: int) -> int:
  """The smallest power of 2 >= max(x, 1)."""
  return 1 << max(0, int(x) - 1).bit_length()


def power_of_2_tile(size: int, smallest: int, largest: int) -> int:
  """A power-of-2 tile covering `size` elements, clamped to ``[smallest, largest]``.

  `smallest` and `largest` must be powers of 2 (Triton blocks are; its dots need >= 16).
  """
  return min(largest, max(smallest, next_power_of_2(size)))


def edge_mask(first, size: int, limit) -> jax.Array:
  """bool ``[size]``: which of the indices ``first + [0, size)`` lie below `limit`."""
  return first + lax.iota(jnp.int32, size) < limit


def local_group_bounds(counts: jax.Array, dim_size: int, group_offset,
                       num_local: int) -> tuple[jax.Array, jax.Array]:
  """int32 ``[num_local]`` start and end of each local group along the grouped dimension.

  Local group ``g`` is global group ``group_offset + g``; one past the last global group it
  is empty (start == end == 0), so a kernel that loops over ``[start, end)`` does nothing.
  """
  bounds = layout.bounds_from_counts(counts, dim_size)
  first, end = layout.local_group_range(group_offset, num_local, counts.shape[0])
  global_ids = first + jnp.arange(num_local, dtype=jnp.int32)
  held = global_ids < end
  index = jnp.where(held, global_ids, 0)
  starts = jnp.where(held, bounds[index], 0)
  ends = jnp.where(held, bounds[index + 1], 0)
  return starts.astype(jnp.int32), ends.astype(jnp.int32)


def unsupported_primitives(fn, rules) -> set[str]:
  """Primitives of `fn` (traced on an f32 tile) that have no rule in `rules`.

  `rules` is a Pallas backend's lowering table (primitive -> rule). Best effort: a kernel
  calls this before building a pallas_call so that an activation it cannot lower raises
  NotImplementedError at trace time (the dispatcher then falls back), instead of failing
  when lowering.
  """
  if fn is None:
    return set()
  jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((16, 128), jnp.float32))
  missing = set()

  def walk(inner):
    for eqn in inner.eqns:
      if eqn.primitive not in rules:
        missing.add(eqn.primitive.name)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(jaxpr.jaxpr)
  return missing


# --------------------------------------------------------------------- quantized operands


class QuantOperands(NamedTuple):
  """What a kernel needs to dequantize in-kernel (see `prepare_quant`).

  Fields:
    mode: "weight_only" or "scaled".
    rhs_scale: f32 ``[L, Kb, N]``: one row of N scales per K block of `k_block` rows
      (Kb = 1: per-channel or per-tensor, broadcast to N).
    rhs_zero: None or f32 like rhs_scale (weight-only zero points).
    k_block: rows of K sharing a scale row (K itself when Kb == 1).
    lhs_scale: "scaled" only: f32 ``[M, 1]`` per-token (or per-tensor, broadcast) scale.
  """

  mode: str
  rhs_scale: jax.Array
  rhs_zero: jax.Array | None
  k_block: int
  lhs_scale: jax.Array | None


class QuantStatic(NamedTuple):
  """The static part of `QuantOperands` (what a kernel body may close over)."""

  mode: str
  has_zero: bool
  k_block: int


def quant_static(quant: QuantOperands | None) -> QuantStatic | None:
  if quant is None:
    return None
  return QuantStatic(quant.mode, quant.rhs_zero is not None, quant.k_block)


def prepare_quant(lhs, rhs, cfg, m: int, k: int, n: int):
  """Splits QArray operands into plain values + `QuantOperands` for an in-kernel
  dequantizing gmm, or raises NotImplementedError naming what the kernels support:
  m-grouping; weight-only int8/int4/fp8 weights with per-tensor, per-channel or per-group
  (along K) scales and optional zero points; or int8 x int8 with a per-token/per-tensor lhs
  scale and a per-channel/per-tensor rhs scale, no zero points.

  Returns:
    (lhs values, rhs values, QuantOperands or None when neither operand is quantized).
  """
  from gmm_jax._src import quant

  lq, rq = isinstance(lhs, quant.QArray), isinstance(rhs, quant.QArray)
  if not lq and not rq:
    return lhs, rhs, None
  mode = quant.quant_mode(lhs, rhs, cfg)
  supported = ("the kernels dequantize in-kernel for m-grouping: weight-only int8/int4/fp8 "
               "weights (per-tensor, per-channel or per-group scales, optional zero points) "
               "and int8 x int8 with per-token/per-tensor x per-channel/per-tensor scales")
  if cfg.group_type != "m" or mode not in ("weight_only", "scaled"):
    raise NotImplementedError(f"{supported}; got group_type={cfg.group_type!r}, mode {mode}")
  if rq and rhs.qtype not in (np.dtype(jnp.int8), np.dtype(jnp.int4),
                              np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2)):
    raise NotImplementedError(f"{supported}; got rhs values {rhs.qtype}")
  # rhs scale as [L or 1, Kb, N or 1] in the canonical [K, N] orientation.
  scale, zero, tile = rhs.scale, rhs.zero_point, rhs.tile
  if cfg.transpose_rhs:
    scale = jnp.swapaxes(scale, -1, -2)
    zero = None if zero is None else jnp.swapaxes(zero, -1, -2)
    tile = tile[:-2] + (tile[-1], tile[-2])
  num_kb = scale.shape[1]
  if scale.shape[2] not in (1, n):
    raise NotImplementedError(f"{supported}; got rhs scales blocked along N {rhs.scale.shape}")
  k_block = max(k, 1) if num_kb == 1 else tile[1]
  shape = (cfg.num_local, num_kb, n)
  rhs_scale = jnp.broadcast_to(scale.astype(jnp.float32), shape)
  rhs_zero = None if zero is None else jnp.broadcast_to(zero.astype(jnp.float32), shape)
  if mode == "weight_only":
    return lhs, rhs.qvalue, QuantOperands(mode, rhs_scale, rhs_zero, k_block, None)
  if (lhs.qtype != np.dtype(jnp.int8) or rhs.qtype != np.dtype(jnp.int8)
      or lhs.zero_point is not None or rhs.zero_point is not None):
    raise NotImplementedError(
        f"{supported}; got {lhs.qtype} x {rhs.qtype} (zero points: "
        f"{lhs.zero_point is not None}, {rhs.zero_point is not None})")
  lhs_scale = lhs.scale.astype(jnp.float32)
  lhs_scale = lhs_scale.T if cfg.transpose_lhs else lhs_scale  # [M or 1, 1]
  if lhs_scale.shape[0] not in (1, m):
    raise NotImplementedError(f"{supported}; got lhs scales {lhs.scale.shape}")
  lhs_scale = jnp.broadcast_to(lhs_scale, (m, 1))
  return lhs.qvalue, rhs.qvalue, QuantOperands(mode, rhs_scale, None, k_block, lhs_scale)


def dequantize_tile(w, scale_row, zero_row, transposed: bool, dtype):
  """A weight tile ``(w - zero) * scale`` in `dtype`; the scale/zero rows are ``[1, N]``
  (``[N, 1]`` when the tile is stored transposed, ``[N, K]``)."""
  w = w.astype(jnp.float32)
  if zero_row is not None:
    w = w - zero_row
  return (w * scale_row).astype(dtype)


def kernel_dtypes(lhs, rhs, quant: QuantOperands | None):
  """(dot dtype, accumulator dtype) of a kernel on prepared operands: weight-only
  dequantizes the weights to the activations' float type; otherwise the promoted type, with
  an int32 accumulator for integers and f32 for floats."""
  from gmm_jax._src.config import accumulator_dtype

  if quant is not None and quant.mode == "weight_only":
    dot_dtype = lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else jnp.float32
    return np.dtype(dot_dtype), np.dtype(jnp.float32)
  return np.dtype(jnp.promote_types(lhs.dtype, rhs.dtype)), accumulator_dtype(lhs.dtype,
                                                                              rhs.dtype)


def with_quant_k_step(tiling, quant: QuantOperands | None, k: int):
  """Per-group weight scales take one K step per scale row: ``tile_k = k_block``."""
  from gmm_jax._src.config import Tiling

  if quant is None or quant.k_block >= max(k, 1):
    return tiling
  return Tiling(tile_m=tiling.tile_m, tile_k=quant.k_block, tile_n=tiling.tile_n)
