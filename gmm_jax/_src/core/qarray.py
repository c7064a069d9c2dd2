"""Quantized operands as data: `QArray`, `quantize`/`dequantize`, `QuantSpec`, `quant_mode`.

Floor 0: imports nothing from gmm_jax. How gmm computes with QArrays lives in
`quantized.py` (composed above the op) and in the kernels that dequantize in-kernel.

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

from gmm_jax._src.core.errors import describe, is_index

# The fnuz fp8 types (no negative zero, no infinities; largest finite 240 and 57344) are
# what AMD MI300-class chips multiply natively, and what MaxText's "nanoo_fp8" quantizes to.
QTYPES = tuple(np.dtype(t) for t in (jnp.int8, jnp.int4, jnp.float8_e4m3fn, jnp.float8_e5m2,
                                     jnp.float4_e2m1fn, jnp.float8_e4m3fnuz,
                                     jnp.float8_e5m2fnuz))
SCALE_DTYPES = tuple(np.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16,
                                           jnp.float8_e8m0fnu))
E8M0 = np.dtype(jnp.float8_e8m0fnu)


def is_integer_dtype(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.integer)


def _is_qtype(dtype) -> bool:
  """Integers, or floats of at most 8 bits (fp8, fp4): what a QArray's values may be."""
  dtype = np.dtype(dtype)
  if dtype == np.bool_:
    return False
  return is_integer_dtype(dtype) or (jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 1)


def _qrange(dtype) -> tuple[float, float]:
  if is_integer_dtype(dtype):
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
    for name, value in (("qvalue", qvalue), ("scale", scale)):
      if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ValueError(f"QArray {name} must be an array, got {value!r}")
    if not _is_qtype(qvalue.dtype):
      raise ValueError(
          f"QArray qvalue must hold quantized values: an integer dtype (int8, int4, uint8, "
          f"...) or an 8/4-bit float (float8_e4m3fn, float8_e5m2, float4_e2m1fn, ...), got "
          f"{np.dtype(qvalue.dtype)}; use gmm_jax.quantize to make one from a float array")
    if not jnp.issubdtype(scale.dtype, jnp.floating):
      raise ValueError(f"QArray scale must be floating, got {np.dtype(scale.dtype)}")
    if zero_point is not None and not hasattr(zero_point, "shape"):
      raise ValueError(f"QArray zero_point must be None or an array, got {zero_point!r}")
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


def check_fits(q: QArray, name: str = "QArray") -> QArray:
  """Checks that `q`'s scale (and zero point) fit its values and tile; returns `q`.

  `QArray.__init__` checks this, but a QArray rebuilt by `jax.tree_util.tree_unflatten` (as
  transformations and user code do) skips `__init__`: a scale of the wrong shape would
  otherwise be broadcast silently (`broadcast_scale` slices a longer scale to the values'
  size). Call it where an operation is about to use the scales.

  Args:
    q: the QArray.
    name: what to call it in the error (e.g. "rhs").

  Returns:
    `q`, unchanged.

  Raises:
    ValueError: the ranks differ, the tile has the wrong length, the zero point's shape is
      not the scale's, or along some axis the scale has neither 1 entry (shared) nor
      ``ceil(size / tile)`` entries; the message names the shapes.
  """
  shape, scale_shape = tuple(np.shape(q.qvalue)), tuple(np.shape(q.scale))
  tile = tuple(q.tile) if q.tile is not None else None
  described = f"{name} QArray with values {shape}, scale {scale_shape} and tile {tile}"
  if len(scale_shape) != len(shape):
    raise ValueError(f"{described}: the scale must have the values' rank")
  if tile is None or len(tile) != len(shape):
    raise ValueError(f"{described}: the tile must have one entry per axis of the values")
  if q.zero_point is not None and tuple(np.shape(q.zero_point)) != scale_shape:
    raise ValueError(f"{described}: zero point {tuple(np.shape(q.zero_point))} must have the "
                     f"scale's shape")
  for axis, (size, ssize, t) in enumerate(zip(shape, scale_shape, tile)):
    if not isinstance(t, (int, np.integer)) or t <= 0:
      raise ValueError(f"{described}: tile {t!r} on axis {axis} must be a positive int")
    if ssize != -(-size // t) and not (ssize == 1 and t >= size):
      raise ValueError(
          f"{described}: axis {axis} of size {size} with tile {t} needs {-(-size // t)} "
          f"scales (or 1), got {ssize}")
  return q


def broadcast_scale(scale, shape: Sequence[int], tile: Sequence[int]) -> jax.Array:
  """Expands a scale (or zero point) to `shape`: tiled axes repeated, size-1 axes kept."""
  scale = jnp.asarray(scale)
  for axis, (size, t) in enumerate(zip(shape, tile)):
    if scale.shape[axis] not in (1, size):
      scale = jnp.repeat(scale, t, axis=axis)
      scale = jax.lax.slice_in_dim(scale, 0, size, axis=axis)
  return scale


def dequantize(q: QArray, dtype=jnp.float32) -> jax.Array:
  """``(qvalue - zero_point) * scale``, broadcast, in `dtype` (computed in f32).

  Raises:
    ValueError: `q` is not a gmm_jax (or qwix) QArray.
  """
  quantized = as_qarray(q)
  if quantized is None:
    raise ValueError(f"dequantize needs a gmm_jax.QArray (or a qwix QArray), got "
                     f"{describe(q)}")
  q = quantized
  value = q.qvalue.astype(jnp.float32)
  if q.zero_point is not None:
    value = value - broadcast_scale(q.zero_point.astype(jnp.float32), q.shape, q.tile)
  return (value * broadcast_scale(q.scale.astype(jnp.float32), q.shape, q.tile)).astype(dtype)




def _normalize_axes(axes, ndim, name):
  if is_index(axes):
    axes = (axes,)
  try:
    axes = tuple(axes)
  except TypeError:
    raise ValueError(f"{name} must be an int or a sequence of ints, got {axes!r}") from None
  out = []
  for axis in axes:
    if not is_index(axis):
      raise ValueError(f"{name} axes must be ints, got {axis!r} in {axes!r}")
    if not -ndim <= axis < ndim:
      raise ValueError(f"{name} axis {axis} out of range for rank {ndim}")
    out.append(axis % ndim)
  return out


def _split_sharding(x):
  """The sharding of `x` reshaped to ``(blocks, tile)`` pairs per axis, when x is sharded
  over explicit mesh axes (jax needs it said): each axis's mesh axes on its block index.
  None otherwise (jax infers it)."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  spec = getattr(sharding, "spec", None)
  if spec is None or sharding.mesh.empty or all(s is None for s in spec):
    return None
  spec = tuple(spec) + (None,) * (x.ndim - len(spec))
  return jax.sharding.NamedSharding(
      sharding.mesh, jax.sharding.PartitionSpec(*[a for s in spec for a in (s, None)]))


def stored_scale(scale, scale_dtype):
  """A block's f32 scale as `quantize` stores it: 1 for an all-zero block, rounded up to
  a power of 2 for float8_e8m0fnu, in `scale_dtype` (the kernels that quantize a tile
  in-kernel apply the same steps)."""
  scale = jnp.where(scale > 0, scale, 1.0)
  if np.dtype(scale_dtype) == E8M0:
    scale = jnp.exp2(jnp.ceil(jnp.log2(scale)))
  return scale.astype(scale_dtype)


def quantize(x, dtype, *, channelwise_axes: Sequence[int] = (),
             tiled_axes: Mapping[int, int] | None = None, scale_dtype=None,
             zero_point: bool = False, bound: float | None = None) -> QArray:
  """Quantizes `x` (absmax calibration, round to nearest even, saturating).

  Args:
    x: a float array.
    dtype: int8, int4, float8_e4m3fn, float8_e5m2, float4_e2m1fn, float8_e4m3fnuz or
      float8_e5m2fnuz.
    channelwise_axes: an axis or axes with one scale per index (e.g. 0 or (0,) per token
      of [M, K]; (0, 2) per expert and output channel of [G, K, N]).
    tiled_axes: ``{axis: tile}``: one scale per tile of `tile` indices (per-group along K:
      ``{1: 128}`` of [M, K]; 2-D blocks ``{1: 128, 2: 128}`` of [G, K, N]). The last tile
      may be shorter. All other axes share a scale.
    scale_dtype: f32 (default), bf16, f16, or float8_e8m0fnu (MX: the scale is rounded up
      to a power of 2, so no value saturates).
    zero_point: asymmetric quantization with an integer zero point (integer dtypes only).
    bound: the value a tile's absmax maps to (symmetric quantization): the scale is
      ``absmax / bound``. Default: the dtype's largest value (127 for int8, 448 for
      float8_e4m3fn). qwix (and so MaxText) maps it to ``qmax + 0.5`` for integers (127.5
      for int8, 7.5 for int4), which fills the largest bucket's rounding interval; values
      rounding past qmax saturate.

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
  if zero_point and not is_integer_dtype(dtype):
    raise ValueError(f"zero_point=True needs an integer dtype, got {dtype}")
  bound = _check_bound(bound, zero_point)
  if not hasattr(x, "dtype") and not isinstance(x, (list, tuple, float, int)):
    raise ValueError(f"quantize needs a float array, got {x!r}")
  x = jnp.asarray(x)
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"quantize needs a float array, got {describe(x)}")
  ndim = x.ndim
  channelwise = _normalize_axes(channelwise_axes, ndim, "channelwise_axes")
  tiled = _check_tiled(tiled_axes, channelwise, ndim)
  tile = []
  for axis, size in enumerate(x.shape):
    tile.append(1 if axis in channelwise else
                min(int(tiled[axis]), max(size, 1)) if axis in tiled else max(size, 1))
  xf = x.astype(jnp.float32)
  blocks = _tile_blocks(xf, tile)
  reduce_axes = tuple(range(1, 2 * ndim, 2))
  qmin, qmax = _qrange(dtype)
  if zero_point:
    low = jnp.minimum(jnp.min(blocks, axis=reduce_axes), 0.0)
    high = jnp.maximum(jnp.max(blocks, axis=reduce_axes), 0.0)
    scale = (high - low) * _reciprocal(qmax - qmin)
  else:
    scale = jnp.max(jnp.abs(blocks), axis=reduce_axes) * _reciprocal(
        qmax if bound is None else bound)
  scale = stored_scale(scale, scale_dtype)
  q, zp = _scaled_values(xf, scale.astype(jnp.float32), tile, dtype,
                         low if zero_point else None)
  return QArray(jnp.clip(q, qmin, qmax).astype(dtype), scale, zp, tile=tile)


def _scaled_values(xf, scale_f32, tile, dtype, low):
  """f32 `xf` in units of its scale, rounded for an integer `dtype` and offset by the
  integer zero point of an asymmetric one (whose tiles' minimum is `low`), not yet
  clipped; and that zero point (None if symmetric)."""
  # x times the scale's f32 reciprocal: XLA turns a division by a broadcast scale into that
  # product on jax <= 0.12.0.1 (so qwix's, MaxText's, values) but not on 0.12.1, which
  # moves values on rounding ties (qwix's bound 127.5 makes many). Written out, it is the
  # same on every version; so for 8-bit floats, whose cast rounds (RNE), and for the kernels
  # that quantize a tile in-kernel (`pallas/common.quantize_rows`).
  scaled = xf * broadcast_scale(1.0 / scale_f32, xf.shape, tile)
  if not is_integer_dtype(dtype):
    return scaled, None
  q = jnp.round(scaled)
  if low is None:
    return q, None
  qmin, qmax = _qrange(dtype)
  zp = jnp.clip(jnp.round(qmin - low / scale_f32), qmin, qmax)
  return q + broadcast_scale(zp, xf.shape, tile), zp.astype(dtype)


def _reciprocal(value: float) -> np.float32:
  """1 / value rounded to f32: the product XLA makes of a division by a constant on every
  jax version, written out so that none can differ."""
  return np.float32(1) / np.float32(value)


def _check_tiled(tiled_axes, channelwise: tuple[int, ...], ndim: int) -> dict[int, int]:
  """`quantize`'s `tiled_axes` as ``{axis: tile}`` with normalized axes, checked: a mapping
  of positive int tiles on axes that are not channelwise."""
  if tiled_axes is None:
    tiled_axes = {}
  if not isinstance(tiled_axes, Mapping):
    raise ValueError(f"tiled_axes must be a dict {{axis: tile}}, got {tiled_axes!r}")
  tiled = dict(zip(_normalize_axes(tuple(tiled_axes.keys()), ndim, "tiled_axes"),
                   tiled_axes.values()))
  if set(channelwise) & set(tiled):
    raise ValueError(f"an axis cannot be both channelwise and tiled: {channelwise} and "
                     f"{sorted(tiled)}")
  for axis, t in tiled.items():
    if not is_index(t) or t <= 0:
      raise ValueError(f"tiled_axes tile sizes must be positive ints, got {t!r} for axis "
                       f"{axis}")
  return tiled


def _tile_blocks(xf, tile: list[int]):
  """`xf` split into tiles to reduce: padded to whole tiles (edge values keep min/max) and
  reshaped to ``[d0 // t0, t0, d1 // t1, t1, ...]``."""
  pads = [(0, -size % t) for size, t in zip(xf.shape, tile)]
  padded = jnp.pad(xf, pads, mode="edge") if any(p[1] for p in pads) and xf.size else xf
  split = []
  for size, t in zip(padded.shape, tile):
    split += [size // t if t else 0, t]
  return jnp.reshape(padded, split, out_sharding=_split_sharding(padded))


def _check_bound(bound, zero_point: bool) -> float | None:
  """`quantize`'s `bound`, checked: a positive finite number, for symmetric quantization."""
  if bound is None:
    return None
  if zero_point:
    raise ValueError("bound= is for symmetric quantization; zero_point=True maps the "
                     "tile's min and max to the dtype's whole range")
  if (isinstance(bound, (bool, np.bool_)) or not isinstance(bound, (int, float, np.number))
      or not np.isfinite(bound) or bound <= 0):
    raise ValueError(f"bound must be a positive finite number, got {bound!r}")
  return float(bound)


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
  bound: float | None = None

  def __post_init__(self):
    try:
      dtype = np.dtype(self.dtype)
    except TypeError:
      dtype = None
    if dtype not in QTYPES:
      raise ValueError(f"QuantSpec dtype must be one of {[str(t) for t in QTYPES]}, got "
                       f"{self.dtype!r}")
    axes = self.channelwise_axes
    axes = (axes,) if is_index(axes) else axes
    if not isinstance(axes, (tuple, list)) or not all(is_index(a) for a in axes):
      raise ValueError(f"QuantSpec channelwise_axes must be an int or a sequence of ints, got "
                       f"{self.channelwise_axes!r}")
    object.__setattr__(self, "channelwise_axes", tuple(int(a) for a in axes))
    tiled = self.tiled_axes.items() if isinstance(self.tiled_axes, Mapping) else self.tiled_axes
    try:
      tiled = tuple(tiled)
      ok = all(len(pair) == 2 and is_index(pair[0]) and is_index(pair[1]) and pair[1] > 0
               for pair in tiled)
    except TypeError:
      ok = False
    if not ok:
      raise ValueError(f"QuantSpec tiled_axes must map int axes to positive int tile sizes, "
                       f"got {self.tiled_axes!r}")
    object.__setattr__(self, "tiled_axes", tuple(sorted((int(a), int(t)) for a, t in tiled)))
    object.__setattr__(self, "bound", _check_bound(self.bound, self.zero_point))

  def __call__(self, x) -> QArray:
    return quantize(x, self.dtype, channelwise_axes=self.channelwise_axes,
                    tiled_axes=dict(self.tiled_axes), scale_dtype=self.scale_dtype,
                    zero_point=self.zero_point, bound=self.bound)


def compute_dtype(q: QArray):
  """The dtype gmm multiplies `q`'s values in: int8 for integers (exact int32 accumulation),
  bf16 for 8- and 4-bit floats (every fp8/fp4 value is exact in bf16; XLA:CPU has no fast
  fp8 dot)."""
  if is_integer_dtype(q.qtype):  # unsigned 8/4-bit values do not fit int8
    signed = jnp.iinfo(q.qtype).min < 0
    return np.dtype(jnp.int8) if signed and q.qtype.itemsize == 1 or q.qtype == np.dtype(
        jnp.int4) else np.dtype(jnp.int32)
  return np.dtype(jnp.bfloat16)


MODES = ("weight_only", "scaled", "blocked")


def k_axis(cfg, side: str) -> int:
  """The contraction axis of the (stored) lhs or of one group's rhs matrix."""
  if side == "lhs":
    return 0 if cfg.transpose_lhs else 1
  return -1 if cfg.transpose_rhs else -2


def quant_mode(lhs, rhs, cfg) -> str:
  """"none", or the mode of `MODES` that a (QArray or array) pair means (see module doc).

  Raises:
    NotImplementedError: a QArray lhs with a plain rhs.
  """
  lq, rq = isinstance(lhs, QArray), isinstance(rhs, QArray)
  if not lq and not rq:
    return "none"
  if lq and not rq:
    raise NotImplementedError(
        "a quantized lhs needs a quantized rhs (modes: weight_only = float lhs x QArray rhs; "
        "scaled/blocked = QArray lhs x QArray rhs); dequantize lhs or quantize rhs")
  if not lq:  # float lhs: quantized in the prologue (fp8 training), else weight-only
    return "blocked" if getattr(cfg, "quantize_prologue", None) else "weight_only"
  if (lhs.scale_varies_along(k_axis(cfg, "lhs")) or
      rhs.scale_varies_along(rhs.ndim + k_axis(cfg, "rhs"))):
    return "blocked"
  return "scaled"




FP8_TYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


@dataclasses.dataclass(frozen=True)
class Fp8Training:
  """fp8 training of a gmm (``gmm(..., quantization=Fp8Training(...))``, or
  ``quantization="fp8"`` for the defaults): the forward and both backward gmms multiply
  8-bit float values with f32 accumulation, each operand quantized inside the op with
  blockwise absmax scales (DeepSeek-V3 / DeepGEMM's recipe):

    forward  lhs x rhs       activations in 1 x `block` blocks along K, weights in
                             `block` x `block` blocks, both `dtype`
    dlhs     ct x rhs^T      the output cotangent in 1 x `block` blocks along N
                             (`grad_dtype`), the forward's weight blocks
    drhs     lhs^T x ct      lhs and the cotangent in `block` x 1 blocks along the rows
                             (a k-grouped gmm over the tokens)

  Hashable: it travels in the static config.

  Fields:
    dtype: the forward operands' values: float8_e4m3fn (default) or float8_e5m2.
    grad_dtype: the output cotangent's values in the backward: float8_e4m3fn (default,
      DeepSeek-V3) or float8_e5m2 (more range, less precision).
    block: the scale block along the contraction (and the weights' second axis): 128.
    scale_dtype: None (f32 scales) or float8_e8m0fnu (power-of-2 scales, DeepSeek-V3.1's
      UE8M0: the scaling is then exact).
  """

  dtype: Any = jnp.float8_e4m3fn
  grad_dtype: Any = jnp.float8_e4m3fn
  block: int = 128
  scale_dtype: Any = None

  def __post_init__(self):
    for name in ("dtype", "grad_dtype"):
      value = getattr(self, name)
      try:
        dtype = np.dtype(value)
      except TypeError:
        dtype = None
      if dtype not in FP8_TYPES:
        raise ValueError(f"Fp8Training {name} must be float8_e4m3fn or float8_e5m2, got "
                         f"{value!r}")
      object.__setattr__(self, name, dtype)
    if not is_index(self.block) or self.block <= 0:
      raise ValueError(f"Fp8Training block must be a positive int, got {self.block!r}")
    if self.scale_dtype is not None:
      scale = np.dtype(self.scale_dtype)
      if scale not in SCALE_DTYPES:
        raise ValueError(f"Fp8Training scale_dtype must be None or one of "
                         f"{[str(t) for t in SCALE_DTYPES]}, got {self.scale_dtype!r}")
      object.__setattr__(self, "scale_dtype", None if scale == np.dtype(jnp.float32)
                         else scale)

  def activations(self, x, axis: int, dtype=None) -> QArray:
    """2-D `x` quantized in blocks of `block` along `axis`, one scale per block and per
    index of the other axis (1 x block per token, or block x 1 per column)."""
    return blockwise(x, axis, (self.dtype if dtype is None else dtype, self.block,
                               self.scale_dtype))

  @property
  def forward_blocks(self) -> tuple:
    """The forward activations' ``(dtype, block, scale_dtype)`` (`blockwise` along K;
    `GmmConfig.quantize_prologue`)."""
    return (self.dtype, self.block, self.scale_dtype)

  def weights(self, w) -> QArray:
    """``[G, A, B]`` weights quantized in `block` x `block` blocks per group."""
    return quantize(w, self.dtype, channelwise_axes=0,
                    tiled_axes={1: self.block, 2: self.block}, scale_dtype=self.scale_dtype)


def blockwise(x, axis: int, blocks: tuple) -> QArray:
  """2-D `x` quantized in 1-D blocks along `axis`: ``blocks = (dtype, block, scale_dtype)``
  (absmax scales, one per block and per index of the other axis)."""
  dtype, block, scale_dtype = blocks
  return quantize(x, dtype, channelwise_axes=1 - axis, tiled_axes={axis: block},
                  scale_dtype=scale_dtype)


QUANTIZATIONS = {"fp8": Fp8Training(),
                 "fp8_e5m2_grads": Fp8Training(grad_dtype=jnp.float8_e5m2)}


def as_quantization(value) -> Fp8Training | None:
  """None, an `Fp8Training`, or a name of `QUANTIZATIONS` -> an Fp8Training or None.

  Raises:
    ValueError: anything else (the message names the accepted values).
  """
  if value is None or isinstance(value, Fp8Training):
    return value
  if isinstance(value, str) and value in QUANTIZATIONS:
    return QUANTIZATIONS[value]
  raise ValueError(f"quantization must be None, a gmm_jax.Fp8Training or one of "
                   f"{sorted(QUANTIZATIONS)}, got {value!r}")
