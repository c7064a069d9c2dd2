"""Quantized operands: `QArray`, `quantize`/`dequantize`, and how gmm computes with them.

Conventions follow qwix: a `QArray` holds ``qvalue`` (the quantized values, the logical
shape), ``scale`` of the same rank, and an optional ``zero_point`` of the scale's shape, with

    value ~= (qvalue - zero_point) * broadcast(scale)

where along each axis the scale has the full size (channelwise: one scale per index), size 1
(shared by the whole axis) or ``ceil(size / tile)`` (tiled: one scale per tile of `tile`
consecutive indices; the last tile may be shorter). Per-tensor, per-channel, per-token,
per-group along K (32..256) and 2-D blocks such as 128 x 128 are all such layouts.

How gmm uses them (the "mode" follows from which side is quantized and how):
  weight_only  float lhs x QArray rhs:  x @ ((W - zp) * scale) + bias
  scaled       QArray lhs x QArray rhs, scales constant along K (per-tensor / per-token lhs,
               per-tensor / per-channel rhs): (xq @ wq) accumulated exactly (int32 for
               integers) [+ int32 bias], then * lhs_scale * rhs_scale [+ float bias]
  blocked      QArray lhs x QArray rhs with a scale that varies along K (MX blocks of 32,
               G-B 1x128 x 128x128, per-group int4 weights of A8W4):
               sum over K blocks of (xq_j @ wq_j) * lhs_scale_j * rhs_scale_j [+ bias]
then the activation, an optional output scale and offset (requantization), and the cast.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

QTYPES = tuple(np.dtype(t) for t in (jnp.int8, jnp.int4, jnp.float8_e4m3fn, jnp.float8_e5m2,
                                     jnp.float4_e2m1fn))
SCALE_DTYPES = tuple(np.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16,
                                           jnp.float8_e8m0fnu))
E8M0 = np.dtype(jnp.float8_e8m0fnu)


def _is_int(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.integer)


def _qrange(dtype) -> tuple[float, float]:
  if _is_int(dtype):
    info = jnp.iinfo(dtype)
    return float(info.min), float(info.max)
  top = float(jnp.finfo(dtype).max)
  return -top, top


@jax.tree_util.register_pytree_node_class
class QArray:
  """A quantized array (qwix conventions; see the module docstring).

  Args:
    qvalue: the quantized values, of a dtype in `QTYPES` (or any integer/float8 dtype).
    scale: same rank as qvalue; along each axis the full size, 1, or ``ceil(size / tile)``.
    zero_point: None (symmetric) or an array of the scale's shape (integer qvalues only).
    tile: optional static tile size per axis (None entries are inferred as ``size //
      scale_size``, which must then divide exactly, as in qwix).
  """

  def __init__(self, qvalue, scale, zero_point=None, tile: Sequence[int | None] | None = None):
    self.qvalue, self.scale, self.zero_point = qvalue, scale, zero_point
    shape, scale_shape = np.shape(qvalue), np.shape(scale)
    if len(scale_shape) != len(shape):
      raise ValueError(f"QArray scale {scale_shape} must have the rank of qvalue {shape}")
    if zero_point is not None and np.shape(zero_point) != scale_shape:
      raise ValueError(
          f"QArray zero_point {np.shape(zero_point)} must have the scale's shape {scale_shape}")
    tile = [None] * len(shape) if tile is None else list(tile)
    if len(tile) != len(shape):
      raise ValueError(f"QArray tile {tuple(tile)} must have one entry per axis of {shape}")
    tiles = []
    for axis, (size, ssize, t) in enumerate(zip(shape, scale_shape, tile)):
      if t is None:
        if ssize == 0 or size % ssize:
          raise ValueError(
              f"QArray scale {scale_shape} does not tile qvalue {shape} evenly along axis "
              f"{axis}; pass tile= for a shorter last tile")
        t = size // ssize if ssize else 1
      if t <= 0 or -(-size // t) != ssize and not (ssize == 1 and t >= size):
        raise ValueError(
            f"QArray scale {scale_shape} does not match qvalue {shape} with tile {t} on axis "
            f"{axis}: expected {-(-size // max(t, 1))} scales")
      tiles.append(int(max(1, min(t, size)) if size else 1))
    self.tile = tuple(tiles)

  def tree_flatten(self):
    return (self.qvalue, self.scale, self.zero_point), self.tile

  @classmethod
  def tree_unflatten(cls, tile, children):
    obj = object.__new__(cls)
    obj.qvalue, obj.scale, obj.zero_point = children
    obj.tile = tile
    return obj

  shape = property(lambda self: tuple(np.shape(self.qvalue)))
  ndim = property(lambda self: len(np.shape(self.qvalue)))
  qtype = property(lambda self: np.dtype(self.qvalue.dtype))
  dtype = property(lambda self: np.dtype(self.scale.dtype))

  def scale_varies_along(self, axis: int) -> bool:
    return np.shape(self.scale)[axis] not in (1,) and self.shape[axis] > 1

  def __repr__(self):
    return (f"QArray(qvalue={self.qtype}{list(self.shape)}, scale={self.dtype}"
            f"{list(np.shape(self.scale))}, zero_point={self.zero_point is not None}, "
            f"tile={self.tile})")


def broadcast_scale(scale, shape: Sequence[int], tile: Sequence[int]) -> jax.Array:
  """Expands a scale (or zero point) to `shape`: tiled axes repeated, size-1 axes kept."""
  scale = jnp.asarray(scale)
  for axis, (size, t) in enumerate(zip(shape, tile)):
    if scale.shape[axis] not in (1, size):
      scale = jnp.repeat(scale, t, axis=axis)
      scale = jax.lax.slice_in_dim(scale, 0, size, axis=axis)
  return scale


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """``(qvalue - zero_point) * scale``, broadcast, in `dtype` (computed in f32)."""
  value = q.qvalue.astype(jnp.float32)
  if q.zero_point is not None:
    value = value - broadcast_scale(q.zero_point.astype(jnp.float32), q.shape, q.tile)
  return (value * broadcast_scale(q.scale.astype(jnp.float32), q.shape, q.tile)).astype(dtype)


def _normalize_axes(axes, ndim, name):
  out = []
  for axis in axes:
    if not -ndim <= axis < ndim:
      raise ValueError(f"{name} axis {axis} out of range for rank {ndim}")
    out.append(axis % ndim)
  return out


def quantize(x, dtype, *, channelwise_axes: Sequence[int] = (),
             tiled_axes: Mapping[int, int] | None = None, scale_dtype=None,
             zero_point: bool = False) -> QArray:
  """Quantizes `x` (absmax calibration, round to nearest even, saturating).

  Args:
    x: a float array.
    dtype: int8, int4, float8_e4m3fn, float8_e5m2 or float4_e2m1fn.
    channelwise_axes: axes with one scale per index (e.g. (0,) per token of [M, K]; (0, 2)
      per expert and output channel of [G, K, N]).
    tiled_axes: ``{axis: tile}``: one scale per tile of `tile` indices (per-group along K:
      ``{1: 128}`` of [M, K]; 2-D blocks ``{1: 128, 2: 128}`` of [G, K, N]). The last tile
      may be shorter. All other axes share a scale.
    scale_dtype: f32 (default), bf16, f16, or float8_e8m0fnu (MX: the scale is rounded up
      to a power of 2, so no value saturates).
    zero_point: asymmetric quantization with an integer zero point (integer dtypes only).

  Returns:
    A `QArray`.
  """
  dtype = np.dtype(dtype)
  if dtype not in QTYPES:
    raise ValueError(f"quantize dtype must be one of {[str(t) for t in QTYPES]}, got {dtype}")
  scale_dtype = np.dtype(jnp.float32 if scale_dtype is None else scale_dtype)
  if scale_dtype not in SCALE_DTYPES:
    raise ValueError(
        f"scale_dtype must be one of {[str(t) for t in SCALE_DTYPES]}, got {scale_dtype}")
  if zero_point and not _is_int(dtype):
    raise ValueError(f"zero_point=True needs an integer dtype, got {dtype}")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize needs a float array, got {x.dtype}")
  ndim = x.ndim
  channelwise = _normalize_axes(channelwise_axes, ndim, "channelwise")
  tiled = dict(zip(_normalize_axes(list((tiled_axes or {}).keys()), ndim, "tiled"),
                   (tiled_axes or {}).values()))
  if set(channelwise) & set(tiled):
    raise ValueError(f"an axis cannot be both channelwise and tiled: {channelwise} and "
                     f"{sorted(tiled)}")
  for axis, t in tiled.items():
    if not isinstance(t, (int, np.integer)) or t <= 0:
      raise ValueError(f"tile sizes must be positive ints, got {t} for axis {axis}")

  tile = []
  for axis, size in enumerate(x.shape):
    tile.append(1 if axis in channelwise else
                min(int(tiled[axis]), max(size, 1)) if axis in tiled else max(size, 1))
  # Reduce each tile: pad to whole tiles (edge values keep min/max), split and reduce.
  xf = x.astype(jnp.float32)
  pads = [(0, -size % t) for size, t in zip(x.shape, tile)]
  padded = jnp.pad(xf, pads, mode="edge") if any(p[1] for p in pads) and xf.size else xf
  split = []
  for size, t in zip(padded.shape, tile):
    split += [size // t if t else 0, t]
  blocks = padded.reshape(split)
  reduce_axes = tuple(range(1, 2 * ndim, 2))
  qmin, qmax = _qrange(dtype)
  if zero_point:
    low = jnp.minimum(jnp.min(blocks, axis=reduce_axes), 0.0)
    high = jnp.maximum(jnp.max(blocks, axis=reduce_axes), 0.0)
    scale = (high - low) / (qmax - qmin)
  else:
    scale = jnp.max(jnp.abs(blocks), axis=reduce_axes) / qmax
  scale = jnp.where(scale > 0, scale, 1.0)
  if scale_dtype == E8M0:
    scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
  scale = scale.astype(scale_dtype)
  scale_f32 = scale.astype(jnp.float32)
  full_scale = broadcast_scale(scale_f32, x.shape, tile)
  zp = None
  if zero_point:
    zp_f32 = jnp.clip(jnp.round(qmin - low / scale_f32), qmin, qmax)
    zp = zp_f32.astype(dtype)
    q = jnp.round(xf / full_scale) + broadcast_scale(zp_f32, x.shape, tile)
  elif _is_int(dtype):
    q = jnp.round(xf / full_scale)
  else:
    q = xf / full_scale  # the cast rounds to nearest even
  q = jnp.clip(q, qmin, qmax).astype(dtype)
  return QArray(q, scale, zp, tile=tile)


def from_qwix(array) -> QArray | None:
  """A qwix QArray as a gmm_jax `QArray` (None if `array` is not one)."""
  cls = type(array)
  if cls.__name__ != "QArray" or not cls.__module__.startswith("qwix"):
    return None
  return QArray(array.qvalue, array.scale, getattr(array, "zero_point", None))


def as_qarray(x) -> QArray | None:
  if isinstance(x, QArray):
    return x
  return from_qwix(x)


@dataclasses.dataclass(frozen=True)
class QuantSpec:
  """How gmm quantizes a float operand itself (dynamic quantization): `quantize`'s
  arguments. Hashable, so it travels in the static config."""

  dtype: Any
  channelwise_axes: tuple[int, ...] = ()
  tiled_axes: tuple[tuple[int, int], ...] = ()
  scale_dtype: Any = None
  zero_point: bool = False

  def __post_init__(self):
    object.__setattr__(self, "channelwise_axes", tuple(self.channelwise_axes))
    tiled = self.tiled_axes.items() if isinstance(self.tiled_axes, Mapping) else self.tiled_axes
    object.__setattr__(self, "tiled_axes", tuple(sorted((int(a), int(t)) for a, t in tiled)))

  def __call__(self, x) -> QArray:
    return quantize(x, self.dtype, channelwise_axes=self.channelwise_axes,
                    tiled_axes=dict(self.tiled_axes), scale_dtype=self.scale_dtype,
                    zero_point=self.zero_point)


def compute_dtype(q: QArray):
  """The dtype gmm multiplies `q`'s values in: int8 for integers (exact int32 accumulation),
  bf16 for 8- and 4-bit floats (every fp8/fp4 value is exact in bf16; XLA:CPU has no fast
  fp8 dot)."""
  if _is_int(q.qtype):  # unsigned 8/4-bit values do not fit int8
    signed = jnp.iinfo(q.qtype).min < 0
    return np.dtype(jnp.int8) if signed and q.qtype.itemsize == 1 or q.qtype == np.dtype(
        jnp.int4) else np.dtype(jnp.int32)
  return np.dtype(jnp.bfloat16)


# ------------------------------------------------------------------------ gmm with QArrays

MODES = ("weight_only", "scaled", "blocked")


def _k_axis(cfg, side: str) -> int:
  """The contraction axis of the (stored) lhs or of one group's rhs matrix."""
  if side == "lhs":
    return 0 if cfg.transpose_lhs else 1
  return -1 if cfg.transpose_rhs else -2


def quant_mode(lhs, rhs, cfg) -> str:
  """"none", or the mode of `MODES` that a (QArray or array) pair means (see module doc)."""
  lq, rq = isinstance(lhs, QArray), isinstance(rhs, QArray)
  if not lq and not rq:
    return "none"
  if lq and not rq:
    raise NotImplementedError(
        "a quantized lhs needs a quantized rhs (modes: weight_only = float lhs x QArray rhs; "
        "scaled/blocked = QArray lhs x QArray rhs); dequantize lhs or quantize rhs")
  if not lq:
    return "weight_only"
  if (lhs.scale_varies_along(_k_axis(cfg, "lhs")) or
      rhs.scale_varies_along(rhs.ndim + _k_axis(cfg, "rhs"))):
    return "blocked"
  return "scaled"


def _row_scale(q: QArray, cfg, m: int) -> jax.Array:
  """lhs scale as ``[M, 1]`` (or ``[1, 1]``), f32; K is constant (scaled mode)."""
  scale = q.scale.astype(jnp.float32)
  scale = scale.T if cfg.transpose_lhs else scale  # [M or 1, 1]
  return broadcast_scale(scale, (m, 1), (q.tile[1], 1) if cfg.transpose_lhs else
                         (q.tile[0], 1))


def _col_scale(q: QArray, cfg, n: int) -> jax.Array:
  """rhs scale as ``[L or 1, 1, N or 1]`` (m) / ``[1, N or 1]`` (k), f32; K constant."""
  scale = q.scale.astype(jnp.float32)
  tile = q.tile
  if cfg.transpose_rhs:
    scale = jnp.swapaxes(scale, -1, -2)
    tile = tile[:-2] + (tile[-1], tile[-2])
  shape = scale.shape[:-1] + (n,)
  return broadcast_scale(scale, shape, tile[:-1] + (tile[-1],))


def _values(q: QArray, dtype) -> jax.Array:
  """The quantized values ready for an exact product: zero point subtracted (int32 then)."""
  if q.zero_point is None:
    return q.qvalue.astype(dtype)
  return (q.qvalue.astype(jnp.int32)
          - broadcast_scale(q.zero_point.astype(jnp.int32), q.shape, q.tile))


def _per_row(values, counts, group_offset, cfg, m):
  """``[L, ...]`` per-group values gathered to ``[M, ...]`` by each row's local group."""
  ids = layout_row_ids(counts, m, group_offset, cfg.num_local)
  return values[jnp.maximum(ids, 0)], ids >= 0


def layout_row_ids(counts, m, group_offset, num_local):
  from gmm_jax._src import layout
  return layout.row_group_ids(counts, m, group_offset, num_local)


def finish(z, counts, group_offset, cfg, output_scale=None, output_offset=None,
           cast: bool = True):
  """f32 pre-activation -> activation, output scale/offset, rounding, cast; rows outside
  the local groups (m-grouping) exactly 0. ``cast=False`` stops before the rounding/cast."""
  from gmm_jax._src.epilogue import resolve_activation
  fn = resolve_activation(cfg.activation)
  y = z if fn is None else fn(z)
  if cfg.group_type == "m":
    m = z.shape[0]
    if output_scale is not None:
      y = y * _per_row(output_scale, counts, group_offset, cfg, m)[0]
    if output_offset is not None:
      y = y + _per_row(output_offset, counts, group_offset, cfg, m)[0]
  else:
    if output_scale is not None:
      y = y * output_scale[:, None, :]
    if output_offset is not None:
      y = y + output_offset[:, None, :]
  out_dtype = np.dtype(cfg.out_dtype) if cast else y.dtype
  if _is_int(out_dtype):  # requantization: round to nearest even, saturate
    info = jnp.iinfo(out_dtype)
    y = jnp.clip(jnp.round(y), info.min, info.max)
  y = y.astype(out_dtype)
  if cfg.group_type == "m":
    valid = layout_row_ids(counts, z.shape[0], group_offset, cfg.num_local) >= 0
    y = jnp.where(valid[:, None], y, jnp.zeros((), y.dtype))
  return y


def gmm_quantized(lhs, rhs, counts, group_offset, bias, cfg, output_scale=None,
                  output_offset=None):
  """gmm with QArray operands (canonical layout otherwise; see `GmmConfig`).

  Every mode reduces to the one differentiable gmm (`vjp.gmm_core`, dispatched like any
  unquantized call) plus elementwise work: weight_only multiplies by the dequantized
  weights; scaled multiplies the quantized values exactly (int32 for integers, f32 for
  floats) and scales the accumulator; blocked multiplies the dequantized operands in f32,
  which is the sum over K blocks of the block products times both block scales.

  Args:
    output_scale, output_offset: None or f32 ``[L, N]`` (already broadcast).
  """
  from gmm_jax._src import dispatch
  from gmm_jax._src.vjp import gmm_core
  mode = quant_mode(lhs, rhs, cfg)
  m = lhs.shape[1] if cfg.transpose_lhs else lhs.shape[0]
  n = rhs.shape[-2] if cfg.transpose_rhs else rhs.shape[-1]
  f32 = np.dtype(jnp.float32)
  int_bias = bias is not None and _is_int(bias.dtype)
  requant = output_scale is not None or output_offset is not None

  if not int_bias and dispatch.serves(cfg, mode):
    # A kernel that dequantizes in-kernel (the Pallas backends) serves this mode: hand it
    # the QArrays. It may still refuse a layout (NotImplementedError): then compose below.
    direct = not requant and not _is_int(cfg.out_dtype)
    kernel_cfg = cfg if direct else cfg.replace(activation=None, out_dtype=f32)
    try:
      out = gmm_core(kernel_cfg, lhs, rhs, counts, group_offset, bias)
    except NotImplementedError:
      pass
    else:
      return out if direct else finish(out, counts, group_offset, cfg, output_scale,
                                        output_offset)

  if mode == "weight_only":
    float_dtype = lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else jnp.float32
    weights = dequantize(rhs, float_dtype)
    if int_bias:
      raise NotImplementedError("an int32 bias needs integer operands (scaled mode); "
                                "weight_only takes a float bias")
    if not requant and not _is_int(cfg.out_dtype):
      return gmm_core(cfg, lhs, weights, counts, group_offset, bias)
    z = gmm_core(cfg.replace(activation=None, out_dtype=f32), lhs, weights, counts,
                 group_offset, bias)
    return finish(z, counts, group_offset, cfg, output_scale, output_offset)

  if mode == "blocked":
    if int_bias:
      raise NotImplementedError(
          "an int32 bias is added before the scales, so it needs scales constant along K "
          "(scaled mode); blocked scales take a float bias")
    z = gmm_core(cfg.replace(activation=None, out_dtype=f32), dequantize(lhs),
                 dequantize(rhs), counts, group_offset, bias)
    return finish(z, counts, group_offset, cfg, output_scale, output_offset)

  # scaled: exact product of the values, then lhs row scale x rhs (group, column) scale.
  integer = _is_int(lhs.qtype) and _is_int(rhs.qtype)
  if not integer and (_is_int(lhs.qtype) or _is_int(rhs.qtype)):
    raise NotImplementedError(
        f"mixed integer and float quantized values ({lhs.qtype} x {rhs.qtype}); supported: "
        "both integer (int8/int4) or both float (fp8/fp4)")
  if int_bias and not integer:
    raise NotImplementedError("an int32 bias needs integer quantized values")
  value_dtype = np.promote_types(compute_dtype(lhs), compute_dtype(rhs))
  acc_dtype = np.dtype(jnp.int32) if integer else f32
  acc = gmm_core(cfg.replace(activation=None, out_dtype=acc_dtype),
                 _values(lhs, value_dtype), _values(rhs, value_dtype), counts, group_offset,
                 bias if int_bias else None)
  z = acc.astype(f32)
  row = _row_scale(lhs, cfg, m)  # [M, 1]
  col = _col_scale(rhs, cfg, n)  # m: [L or 1, 1, N or 1]; k: [1, N or 1]
  float_bias = None if (bias is None or int_bias) else bias.astype(f32)
  if cfg.group_type == "m":
    col = jnp.broadcast_to(col, (cfg.num_local, 1, col.shape[-1]))[:, 0, :]
    z = z * row * _per_row(col, counts, group_offset, cfg, m)[0]
    if float_bias is not None:
      z = z + _per_row(float_bias, counts, group_offset, cfg, m)[0]
  else:
    z = z * row[None] * col[None]
    if float_bias is not None:
      z = z + float_bias[:, None, :]
  return finish(z, counts, group_offset, cfg, output_scale, output_offset)


# ------------------------------------------------------------- dynamic quantization (STE)


def _bias_term(bias, lhs_q, rhs_q, counts, group_offset, cfg, m, n):
  """The bias as the quantized formula adds it to the f32 pre-activation (an int32 bias is
  in accumulator units: times both scales)."""
  if bias is None:
    return 0.0
  value = bias.astype(jnp.float32)
  if _is_int(bias.dtype):
    row = _row_scale(lhs_q, cfg, m) if isinstance(lhs_q, QArray) else 1.0
    col = _col_scale(rhs_q, cfg, n) if isinstance(rhs_q, QArray) else 1.0
    row, col = jax.lax.stop_gradient(row), jax.lax.stop_gradient(col)
    if cfg.group_type == "m":
      col = jnp.broadcast_to(col, (cfg.num_local, 1, n))[:, 0, :]
      return _per_row(value * col, counts, group_offset, cfg, m)[0] * row
    return value[:, None, :] * row[None] * col[None]
  if cfg.group_type == "m":
    return _per_row(value, counts, group_offset, cfg, m)[0]
  return value[:, None, :]


def _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                     output_offset):
  cfg, lhs_spec, rhs_spec = static
  lhs_q = lhs_spec(lhs) if lhs_spec is not None else as_qarray(lhs) or lhs
  rhs_q = rhs_spec(rhs) if rhs_spec is not None else as_qarray(rhs) or rhs
  return gmm_quantized(lhs_q, rhs_q, counts, group_offset, bias, cfg, output_scale,
                       output_offset)


def _float0(x):
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _ste_gmm_impl():
  import functools

  @functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
  def ste_gmm(static, lhs, rhs, bias, counts, group_offset, output_scale, output_offset):
    return _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                            output_offset)

  def fwd(static, lhs, rhs, bias, counts, group_offset, output_scale, output_offset):
    out = _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                           output_offset)
    return out, (lhs, rhs, bias, counts, group_offset, output_scale, output_offset)

  def bwd(static, residuals, cotangent):
    from gmm_jax._src.vjp import gmm_core
    cfg, lhs_spec, rhs_spec = static
    lhs, rhs, bias, counts, group_offset, output_scale, output_offset = residuals
    lhs_q = lhs_spec(lhs) if lhs_spec is not None else lhs
    rhs_q = rhs_spec(rhs) if rhs_spec is not None else rhs
    m = lhs.shape[1] if cfg.transpose_lhs else lhs.shape[0]
    n = rhs.shape[-2] if cfg.transpose_rhs else rhs.shape[-1]
    # Straight-through: the float gmm's gradient, taken at the dequantized operands, is
    # passed to the float inputs as if quantization were the identity.
    at_lhs = dequantize(lhs_q) if isinstance(lhs_q, QArray) else lhs
    at_rhs = dequantize(rhs_q) if isinstance(rhs_q, QArray) else rhs
    float_bias = bias if bias is not None and not _is_int(bias.dtype) else None

    def surrogate(a, b, fb, scale, offset):
      z = gmm_core(cfg.replace(activation=None, out_dtype=np.dtype(jnp.float32)),
                   a.astype(jnp.float32), b.astype(jnp.float32), counts, group_offset, None)
      if fb is not None:
        z = z + _bias_term(fb, lhs_q, rhs_q, counts, group_offset, cfg, m, n)
      elif bias is not None:
        z = z + _bias_term(bias, lhs_q, rhs_q, counts, group_offset, cfg, m, n)
      return finish(z, counts, group_offset, cfg, scale, offset, cast=False)

    _, vjp = jax.vjp(surrogate, at_lhs, at_rhs, float_bias, output_scale, output_offset)
    d_lhs, d_rhs, d_bias, d_scale, d_offset = vjp(cotangent.astype(jnp.float32))

    def like(grad, x):
      if x is None:
        return None
      if isinstance(x, QArray):  # already quantized: no straight-through gradient
        return jax.tree.map(lambda leaf: jnp.zeros_like(leaf) if jnp.issubdtype(
            leaf.dtype, jnp.inexact) else _float0(leaf), x)
      if not jnp.issubdtype(x.dtype, jnp.inexact):
        return _float0(x)
      return grad.astype(x.dtype)

    return (like(d_lhs, lhs), like(d_rhs, rhs),
            None if bias is None else (like(d_bias, bias) if float_bias is not None
                                       else _float0(bias)),
            _float0(counts), _float0(group_offset), like(d_scale, output_scale),
            like(d_offset, output_offset))

  ste_gmm.defvjp(fwd, bwd)
  return ste_gmm


_ste_gmm = _ste_gmm_impl()


def dynamic_gmm(lhs, rhs, counts, group_offset, bias, cfg, lhs_spec, rhs_spec,
                straight_through: bool, output_scale=None, output_offset=None):
  """gmm that quantizes its float lhs and/or rhs itself (`QuantSpec`s), then runs the
  quantized mode they make. Gradients w.r.t. the float inputs: straight-through (the float
  gmm's gradient at the dequantized operands) or, without it, none (rounding has zero
  derivative)."""
  static = (cfg, lhs_spec, rhs_spec)
  if not straight_through or _is_int(cfg.out_dtype):
    lhs = jax.lax.stop_gradient(lhs) if lhs_spec is not None else lhs
    rhs = jax.lax.stop_gradient(rhs) if rhs_spec is not None else rhs
    return _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                            output_offset)
  return _ste_gmm(static, lhs, rhs, bias, counts, group_offset, output_scale, output_offset)
