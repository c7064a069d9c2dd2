"""A numpy oracle of fp8 training's blockwise formula (independent of gmm_jax).

Quantization: per block, ``scale = max|x| * f32(1 / 448)`` (E4M3; 57344 for E5M2; 1 for an
all-zero block), values ``round_to_nearest_even(clip(x * f32(1 / scale)))`` in the 8-bit
float (ml_dtypes), computed in f32: the library's formula, which writes its divisions as
products with f32 reciprocals so that every jax gives the same bits (XLA rewrote a division
by a broadcast scale into that product up to jax 0.12.0.1; 0.12.1 divides exactly). The
formula's tests feed the oracle the library's quantized blocks (read by numpy: `expand`)
and test the quantization against `quantize_blocks` separately.

Products: per group, the dequantized operands (values times their block scales, in
float64) multiplied in float64, which is the sum over contraction blocks of the block
products times both block scales.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np

E4M3 = np.dtype(ml_dtypes.float8_e4m3fn)
E5M2 = np.dtype(ml_dtypes.float8_e5m2)


def _power_of_2_up(scale):
  return np.exp2(np.ceil(np.log2(scale))).astype(np.float32)


def quantize_blocks(x, dtype, blocks, e8m0: bool = False) -> np.ndarray:
  """`x` (2-D or 3-D) quantized in blocks of `blocks` (one size per axis, None: the whole
  axis) and dequantized again, as float64: what the fp8 products multiply."""
  x = np.asarray(x, np.float32)
  dtype = np.dtype(dtype)
  top = float(ml_dtypes.finfo(dtype).max)
  out = np.zeros(x.shape, np.float64)
  sizes = [size if b is None else b for size, b in zip(x.shape, blocks)]
  ranges = [range(0, max(n, 1), s) for n, s in zip(x.shape, sizes)]
  for start in np.stack(np.meshgrid(*ranges, indexing="ij"), -1).reshape(-1, x.ndim):
    index = tuple(slice(int(a), int(a) + s) for a, s in zip(start, sizes))
    block = x[index]
    if block.size == 0:
      continue
    scale = np.float32(np.max(np.abs(block)) * (np.float32(1) / np.float32(top)))
    scale = np.float32(1.0) if scale == 0 else scale
    if e8m0:
      scale = _power_of_2_up(scale)
    values = np.clip(block * (np.float32(1) / scale), -top, top).astype(dtype)
    out[index] = values.astype(np.float64) * np.float64(scale)
  return out


def expand(qvalue, scale, tile) -> np.ndarray:
  """A QArray's values times its block scales, in float64, by numpy alone: each scale
  repeated over its `tile` entries (the last block of an axis may be shorter)."""
  values = np.asarray(np.asarray(qvalue).astype(np.float32), np.float64)
  scale = np.asarray(np.asarray(scale).astype(np.float32), np.float64)
  for axis, (size, block) in enumerate(zip(values.shape, tile)):
    scale = np.repeat(scale, block if scale.shape[axis] > 1 else size, axis=axis)
    scale = scale.take(range(size), axis=axis)
  return values * scale


def group_rows(sizes, m: int):
  """Each group's (start, end) rows."""
  ends = np.cumsum(np.asarray(sizes))
  starts = ends - np.asarray(sizes)
  return [(int(s), int(min(e, m))) for s, e in zip(starts, ends)]


def fp8_forward(x, w, sizes, bias=None, *, transpose_rhs=False, block=128, dtype=E4M3,
                e8m0=False, quantizer=quantize_blocks) -> np.ndarray:
  """``z[rows of g] = Q(x, 1 x b) @ Q(w[g], b x b) + bias[g]`` (f64), other rows 0.
  `quantizer(x, dtype, blocks, e8m0)` gives the dequantized blocks (default: this
  module's numpy quantization)."""
  xq = quantizer(x, dtype, (1, block), e8m0)
  wq = quantizer(w, dtype, (1, block, block), e8m0)
  if transpose_rhs:
    wq = np.swapaxes(wq, 1, 2)
  m = x.shape[0]
  out = np.zeros((m, wq.shape[2]))
  for g, (s, e) in enumerate(group_rows(sizes, m)):
    out[s:e] = xq[s:e] @ wq[g]
    if bias is not None:
      out[s:e] += np.asarray(bias, np.float64)[g]
  return out


def fp8_vjp(x, w, sizes, ct, *, transpose_rhs=False, block=128, dtype=E4M3,
            grad_dtype=E4M3, e8m0=False, quantizer=quantize_blocks):
  """(dx, dw, dbias) of fp8 training for the cotangent `ct` of z, in float64:
  ``dx = Q(ct, 1 x b) @ Q(w, b x b)^T``; ``dw[g] = Q(x, b x 1)^T @ Q(ct, b x 1)`` over the
  rows of g (row blocks counted from row 0); ``dbias[g]`` the sum of ct's rows of g.
  ct's rows past the groups are zeroed first (they widen no block's scale)."""
  m = x.shape[0]
  ct = np.asarray(ct, np.float32).copy()
  ct[sum(int(s) for s in sizes):] = 0  # rows of no group: no contribution, no scale
  wq = quantizer(w, dtype, (1, block, block), e8m0)
  if transpose_rhs:
    wq = np.swapaxes(wq, 1, 2)  # [G, K, N]
  ct_rows = quantizer(ct, grad_dtype, (1, block), e8m0)
  ct_cols = quantizer(ct, grad_dtype, (block, 1), e8m0)
  x_cols = quantizer(x, dtype, (block, 1), e8m0)
  dx = np.zeros(x.shape)
  dw = np.zeros(wq.shape)
  dbias = np.zeros((wq.shape[0], wq.shape[2]))
  for g, (s, e) in enumerate(group_rows(sizes, m)):
    dx[s:e] = ct_rows[s:e] @ wq[g].T
    dw[g] = x_cols[s:e].T @ ct_cols[s:e]
    dbias[g] = np.asarray(ct, np.float64)[s:e].sum(0)
  if transpose_rhs:
    dw = np.swapaxes(dw, 1, 2)
  return dx, dw, dbias
