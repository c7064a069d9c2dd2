"""gmm_jax.compat.ascend.grouped_matmul: one oracle test per quantized scenario row of the spec.

Each parametrized case names the row of ``shared/spec/ascend_grouped_matmul.md`` it exercises
(its pytest id starts with the section: 6.1, 6.2, 6.3, 6.4, 6.5, 6.8). The oracles are float64
numpy loops over the groups written from the spec's formulas (section 5) and the facade's
contract, never from the implementation:

* 6.1 A2/A3: the five A8W8 rows (INT8 output with a packed UINT64 scale; BF16 output with a BF16
  scale; the NZ-only BF16 row, here a transposed weight; FP16 output with an FP32 scale; INT32
  output without a scale), A4W4 (per-channel and per-group packed scales), both A8W4 rows
  (symmetric per-group; asymmetric per-channel with `offset`) and the A16W8/A16W4 rows.
* 6.2 static, 6.3 dynamic: INT8 x INT8 (packed UINT64/INT64 or float scales, INT32/float
  bias, INT8/INT32/BF16/FP16 output) and FP8 x FP8 (group types 0 and 2).
* 6.4 MX: FP8 (group types 0 and 2) and FP4 with E8M0 scales in the packed layouts.
* 6.5 G-B: FP8 with 1x128 activation / 128x128 weight scales (group types 0 and 2).
* 6.8 950 weight-only: INT8/INT4 weights (group types -1 and 0) and FP8 weights (transposed).

Skipped, with no test: every HIFLOAT8 row (6.2 rows 5 and 6, 6.3 row 3, 6.5 row 1 and the
HIFLOAT8 weights of 6.8 rows 3 and 4) -- JAX has no hifloat8 dtype. Non-quant rows (6.7) are
covered by tests/test_compat_ascend.py.

Decided semantics checked throughout: rows past the group list's total are exactly 0
(m-grouping); a k-grouping group with k_i = 0 is all zeros. Packed (UINT64/INT64) scales are
built here with an encoder written from the spec's last paragraph of section 5 and decoded by
the oracle independently; `ascend.trans_quant_param` is checked against the same encoder.
"""

from __future__ import annotations

import zlib

import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax.compat import ascend
from oracle import ascend_act as np_act

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
I8, I4, I32 = jnp.int8, jnp.int4, jnp.int32
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
FP4, E8M0 = jnp.float4_e2m1fn, jnp.float8_e8m0fnu

# Values placed where a layout says "unused": any read of them blows the result up.
MX_GARBAGE = 2.0 ** 20
GB_GARBAGE = 1e6

# Elementwise rtol and atol (times max |want|) by output dtype; the Frobenius bound is half.
TOLERANCE = {np.dtype(BF16): 2e-2, np.dtype(F16): 5e-3, np.dtype(F32): 1e-4}


def case(name, **kwargs):
  return pytest.param(dict(kwargs, name=name), id=name)


def rng_for(c):
  return np.random.default_rng(zlib.crc32(c["name"].encode()))


def arr(values, dtype):
  """A JAX array of `dtype` (converted by numpy/ml_dtypes, so no JAX op runs here)."""
  return jnp.asarray(np.asarray(values).astype(dtype))


def f64(a):
  """Any array (ml_dtypes narrow types included) decoded to float64 via float32."""
  return np.asarray(a).astype(np.float32).astype(np.float64)


def transposed(w):
  """[..., K, N] -> the memory layout [..., N, K] of a transposed weight."""
  return jnp.asarray(np.ascontiguousarray(np.swapaxes(np.asarray(w), -1, -2)))


def rand_float(rng, shape, dtype, low=-2.0, high=2.0):
  return arr(rng.uniform(low, high, shape), dtype)


def rand_int(rng, shape, dtype):
  low, high = (-128, 128) if dtype == I8 else (-8, 8)
  return arr(rng.integers(low, high, shape), dtype)


# ------------------------------------------------------------------ packed (UINT64) scales


def np_pack_scale(scale, offset=None, unsigned=False):
  """aclnnTransQuantParam: fp32 bits & 0xFFFFE000, bit 46 set, 9-bit offset at bits 37-45."""
  bits = np.asarray(scale, np.float32).view(np.uint32).astype(np.uint64)
  bits = (bits & np.uint64(0xFFFFE000)) | np.uint64(1 << 46)
  if offset is not None:
    off = np.clip(np.round(np.asarray(offset, np.float64)), -256, 255).astype(np.int64)
    bits |= (off.view(np.uint64) & np.uint64(0x1FF)) << np.uint64(37)
  return bits if unsigned else bits.view(np.int64)


def np_unpack_scale(packed):
  """-> (scale, offset) in float64, decoded from the bit fields."""
  bits = np.asarray(packed).view(np.uint64)
  scale = (bits & np.uint64(0xFFFFE000)).astype(np.uint32).view(np.float32)
  field = ((bits >> np.uint64(37)) & np.uint64(0x1FF)).astype(np.int64)
  return scale.astype(np.float64), np.where(field >= 256, field - 512, field).astype(np.float64)


def test_trans_quant_param_bits():
  scale = np.array([[1e-3, -2.5e-2, 3.0], [7.7e-5, 1.0, 0.1234567]], np.float32)
  offset = np.array([[3.2, -4.0, 300.0], [-300.0, 255.0, -256.0]], np.float32)
  for off in (None, offset):
    got = np.asarray(ascend.trans_quant_param(scale, off))
    assert got.shape == scale.shape
    np.testing.assert_array_equal(got.view(np.uint64), np_pack_scale(scale, off, True))
  s, o = np_unpack_scale(np_pack_scale(scale, offset))
  np.testing.assert_array_equal(o, [[3, -4, 255], [-256, 255, -256]])
  np.testing.assert_allclose(s, scale, rtol=2 ** -10)


# ------------------------------------------------------------------------- group lists

# m-grouping, 3 experts over M=20 rows: sizes 6, 0, 9 (rows 15..19 are past the total).
M_LISTS = {0: np.array([6, 6, 15], np.int64), 1: np.array([6, 0, 9], np.int64),
           2: np.array([[2, 6], [0, 9], [1, 0]], np.int64)}


def m_segments(group_list, group_list_type):
  """(expert, first row, end row) per processed entry (spec 4.3; sparse stops at size <= 0)."""
  gl = np.asarray(group_list, np.int64)
  if group_list_type == 2:
    pairs = []
    for expert, size in gl:
      if size <= 0:
        break
      pairs.append((int(expert), int(size)))
  else:
    sizes = np.diff(gl, prepend=0) if group_list_type == 0 else gl
    pairs = [(e, int(size)) for e, size in enumerate(sizes)]
  segs, start = [], 0
  for expert, size in pairs:
    segs.append((expert, start, start + size))
    start += size
  return segs


def k_segments(sizes):
  """(group, first k, end k) for k-grouping counts."""
  ends = np.cumsum(sizes)
  return [(i, int(end - size), int(end)) for i, (size, end) in enumerate(zip(sizes, ends))]


def k_list(sizes, group_list_type):
  sizes = np.asarray(sizes, np.int64)
  return np.cumsum(sizes) if group_list_type == 0 else sizes


def np_m_grouped(m, n, segs, group_fn):
  out = np.zeros((m, n))
  for e, lo, hi in segs:
    if hi > lo:
      out[lo:hi] = group_fn(e, lo, hi)
  return out


def np_k_grouped(m, n, segs, group_fn):
  out = np.zeros((len(segs), m, n))
  for i, lo, hi in segs:
    if hi > lo:
      out[i] = group_fn(i, lo, hi)
  return out


def blocks(k0, k1, size):
  """(local block j, first k, end k) of [k0, k1) cut into `size`-wide blocks; last may be short."""
  count = -(-(k1 - k0) // size)
  return [(j, k0 + size * j, min(k0 + size * (j + 1), k1)) for j in range(count)]


# ----------------------------------------------------------------------------- checks


def assert_matches(y, want, dtype, zero_rows_from=None):
  """y against the float64 oracle: exact for INT32; INT8 within one step of the oracle's
  round-half-even requantization (f32 vs f64 products can straddle a .5) and exact on at least
  95% of entries; float outputs within TOLERANCE by elementwise and relative Frobenius error."""
  dtype = np.dtype(dtype)
  assert np.dtype(y.dtype) == dtype, (y.dtype, dtype)
  assert tuple(y.shape) == want.shape, (y.shape, want.shape)
  if zero_rows_from is not None:
    np.testing.assert_array_equal(f64(y)[zero_rows_from:], 0.0)
  if dtype == np.dtype(I32):
    np.testing.assert_array_equal(np.asarray(y, np.int64), want.astype(np.int64))
    return
  if dtype == np.dtype(I8):
    diff = np.abs(np.asarray(y, np.int64) - want.astype(np.int64))
    assert diff.max() <= 1, f"int8 output off by {diff.max()}"
    assert np.mean(diff == 0) >= 0.95, f"only {np.mean(diff == 0):.3f} of int8 outputs exact"
    return
  got, tol = f64(y), TOLERANCE[dtype]
  assert np.all(np.isfinite(got))
  assert np.linalg.norm(got - want) <= tol / 2 * np.linalg.norm(want), (
      f"relative Frobenius error {np.linalg.norm(got - want) / np.linalg.norm(want):.2e}")
  np.testing.assert_allclose(got, want, rtol=tol, atol=tol * np.abs(want).max())


def assert_k_grouped(y, want, out, sizes):
  """k-grouping: the oracle's groups, and every empty group all zeros."""
  assert_matches(y, want, out)
  for i, size in enumerate(sizes):
    if size == 0:
      np.testing.assert_array_equal(f64(y)[i], 0.0)


# ------------------------------------------------------------------- A8W8 (INT8 x INT8)

A8W8_CASES = [
    # 6.1 row 1: ND, bias INT32/null, scale UINT64, out INT8.
    case("6.1-a8w8-int8out-u64-bias_i32-offset", scale="u64", offset=True, bias="i32", out=I8),
    case("6.1-a8w8-int8out-u64-nobias", scale="u64", out=I8, glt=1),
    # 6.1 row 2: bias INT32/null, scale BF16, perTokenScale FLOAT/null, out BF16.
    case("6.1-a8w8-bf16out-bf16scale-bias_i32-pts", scale="bf16", bias="i32", pts=True, out=BF16),
    case("6.1-a8w8-bf16out-bf16scale-sparse", scale="bf16", out=BF16, glt=2),
    # 6.1 row 3 (NZ weight in [DOC-EN]; here the transposed weight): null bias, scale FLOAT/BF16.
    case("6.1-a8w8-nz-f32scale-pts", scale="f32", pts=True, out=BF16, transposed=True),
    case("6.1-a8w8-nz-bf16scale", scale="bf16", out=BF16, transposed=True),
    # 6.1 row 4: bias INT32/null, scale FLOAT, perTokenScale FLOAT/null, out FP16.
    case("6.1-a8w8-f16out-bias_i32", scale="f32", bias="i32", out=F16),
    case("6.1-a8w8-f16out-pts", scale="f32", pts=True, out=F16, glt=1),
    # 6.1 row 5: bias INT32/null, no scale, out INT32.
    case("6.1-a8w8-int32out-bias_i32", bias="i32", out=I32),
    case("6.1-a8w8-int32out-default", out=None, glt=1),
    # 6.2 row 1: bias INT32/null, scale UINT64/INT64, out BF16/FP16/INT8.
    case("6.2-int8-packed-i64-bf16out-bias_i32", scale="i64", bias="i32", out=BF16),
    case("6.2-int8-packed-u64-f16out-offset", scale="u64", offset=True, out=F16, glt=1),
    case("6.2-int8-packed-i64-int8out-default-sparse", scale="i64", offset=True, bias="i32",
         out=None, glt=2),
    # 6.2 row 2: bias INT32/null, scale null/UINT64/INT64, out INT32 (packed scale not applied).
    case("6.2-int8-int32out-noscale", out=I32),
    case("6.2-int8-int32out-u64-bias_i32", scale="u64", bias="i32", out=I32),
    case("6.2-int8-int32out-i64", scale="i64", out=I32, glt=1),
    # 6.2 row 3: bias INT32/BF16/FLOAT32/null, scale BF16/FLOAT32, out BF16.
    case("6.2-int8-bf16out-f32scale-bias_i32", scale="f32", bias="i32", out=BF16),
    case("6.2-int8-bf16out-bf16scale-bias_bf16-silu", scale="bf16", bias="bf16", out=BF16, act=5),
    case("6.2-int8-bf16out-f32scale-pertensor-bias_f32", scale="f32", per_tensor="g", bias="f32",
         out=BF16),
    case("6.2-int8-bf16out-bf16scale-pertensor_g1", scale="bf16", per_tensor="g1", out=BF16,
         glt=1),
    # 6.2 row 4: bias INT32/FLOAT16/FLOAT32/null, scale FLOAT32, out FP16.
    case("6.2-int8-f16out-bias_i32", scale="f32", bias="i32", out=F16),
    case("6.2-int8-f16out-bias_f16", scale="f32", bias="f16", out=F16, glt=1),
    case("6.2-int8-f16out-pertensor-bias_f32", scale="f32", per_tensor="g", bias="f32", out=F16),
    case("6.2-int8-f16out-nobias-transposed", scale="f32", out=F16, transposed=True),
    # 6.3 row 1: bias INT32/BF16/FLOAT32/null, scale BF16/FLOAT32, perTokenScale FLOAT32, BF16.
    case("6.3-int8-bf16out-bf16scale-bias_i32", scale="bf16", bias="i32", pts=True, out=BF16),
    case("6.3-int8-bf16out-f32scale-bias_bf16-silu", scale="f32", bias="bf16", pts=True,
         out=BF16, act=5),
    case("6.3-int8-bf16out-f32scale-bias_f32-transposed", scale="f32", bias="f32", pts=True,
         out=BF16, transposed=True, glt=1),
    case("6.3-int8-bf16out-bf16scale-nobias-sparse", scale="bf16", pts=True, out=BF16, glt=2),
    # 6.3 row 2: bias INT32/FLOAT16/FLOAT32/null, scale FLOAT32, perTokenScale FLOAT32, FP16.
    case("6.3-int8-f16out-bias_i32", scale="f32", bias="i32", pts=True, out=F16),
    case("6.3-int8-f16out-bias_f16", scale="f32", bias="f16", pts=True, out=F16),
    case("6.3-int8-f16out-bias_f32-pertensor", scale="f32", per_tensor="g", bias="f32",
         pts=True, out=F16, glt=1),
    case("6.3-int8-f16out-nobias-gelu_tanh", scale="f32", pts=True, out=F16, act=2),
]


@pytest.mark.parametrize("c", A8W8_CASES)
def test_a8w8(c):
  """Static: y = (x W [+ b_i32]) * scale [+ offset] [+ b_float]; dynamic: also * pts (spec 5).
  INT8 output: round half to even, clip to [-128, 127]. INT32 output: x W [+ b_i32] only."""
  rng = rng_for(c)
  e, m, k, n = 3, 20, 32, 16
  x, w = rand_int(rng, (m, k), I8), rand_int(rng, (e, k, n), I8)
  glt = c.get("glt", 0)
  scale_kind, per_tensor = c.get("scale"), c.get("per_tensor")
  packed = scale_kind in ("u64", "i64")
  out = c["out"] or (I8 if packed else I32)
  kwargs = dict(group_list=M_LISTS[glt], group_list_type=glt, split_item=3, group_type=0,
                act_type=c.get("act", 0))
  if c["out"] is not None:
    kwargs["output_dtype"] = c["out"]

  # scale_f / offset_f: float64 [E, N] (or [E, 1]) as the oracle reads them.
  scale_f, offset_f = None, np.zeros((e, 1))
  if scale_kind is not None:
    shape = {None: (e, n), "g": (e,), "g1": (e, 1)}[per_tensor]
    raw = rng.uniform(2e-3, 6e-3, shape).astype(np.float32)
    if packed:
      off = rng.integers(-20, 21, shape).astype(np.float32) if c.get("offset") else None
      kwargs["scale"] = np_pack_scale(raw, off, unsigned=scale_kind == "u64")
      scale_f, offset_f = np_unpack_scale(kwargs["scale"])
      assert (scale_kind == "u64") == (kwargs["scale"].dtype == np.uint64)
    elif scale_kind == "bf16":
      kwargs["scale"] = arr(raw, BF16)
      scale_f = f64(kwargs["scale"])
    else:
      kwargs["scale"] = raw
      scale_f = raw.astype(np.float64)
    scale_f, offset_f = scale_f.reshape(e, -1), offset_f.reshape(e, -1)
  pts = None
  if c.get("pts"):
    pts = rng.uniform(0.5, 2.0, (m,)).astype(np.float32)
    kwargs["per_token_scale"] = pts
  bias_kind, bias_f = c.get("bias"), None
  if bias_kind == "i32":
    kwargs["bias"] = rng.integers(-20000, 20000, (e, n)).astype(np.int32)
  elif bias_kind is not None:
    kwargs["bias"] = arr(rng.standard_normal((e, n)) * 10, {"bf16": BF16, "f16": F16,
                                                                     "f32": F32}[bias_kind])
  if bias_kind is not None:
    bias_f = f64(kwargs["bias"])
  w_arg = transposed(w) if c.get("transposed") else w
  if c.get("transposed"):
    kwargs["weight_transposed"] = True

  xf, wf = f64(x), f64(w)

  def group(g, lo, hi):
    acc = xf[lo:hi] @ wf[g]
    if bias_kind == "i32":
      acc = acc + bias_f[g]
    if np.dtype(out) == np.dtype(I32):
      return acc
    y = acc * scale_f[g]
    if pts is not None:
      y = y * pts[lo:hi, None].astype(np.float64)
    y = y + offset_f[g]
    if bias_kind not in (None, "i32"):
      y = y + bias_f[g]
    y = np_act(y, kwargs["act_type"])
    if np.dtype(out) == np.dtype(I8):
      y = np.clip(np.round(y), -128, 127)
    return y

  segs = m_segments(M_LISTS[glt], glt)
  want = np_m_grouped(m, n, segs, group)
  (y,) = ascend.grouped_matmul(x, w_arg, **kwargs)
  assert_matches(y, want, out, zero_rows_from=segs[-1][2])


# -------------------------------------------------------------------- A4W4 (INT4 x INT4)

A4W4_CASES = [
    # 6.1 A4W4: bias null, scale UINT64, perTokenScale FLOAT/null, out FP16/BF16.
    case("6.1-a4w4-perchannel-pts-bf16", groups=None, pts=True, out=BF16, scale="u64"),
    case("6.1-a4w4-pergroup4-nopts-f16", groups=4, pts=False, out=F16, scale="i64", glt=1),
    case("6.1-a4w4-pergroup2-pts-f16", groups=2, pts=True, out=F16, scale="u64"),
]


@pytest.mark.parametrize("c", A4W4_CASES)
def test_a4w4(c):
  """y = (x @ (w * scale)) * pts; scale [E, N] per-channel or [E, G, N] per-group (spec 5)."""
  rng = rng_for(c)
  e, m, k, n = 3, 20, 64, 16
  x, w = rand_int(rng, (m, k), I4), rand_int(rng, (e, k, n), I4)
  glt, groups = c.get("glt", 0), c["groups"]
  shape = (e, n) if groups is None else (e, groups, n)
  packed = np_pack_scale(rng.uniform(0.01, 0.05, shape), unsigned=c["scale"] == "u64")
  scale_f, _ = np_unpack_scale(packed)
  scale_k = (np.repeat(scale_f[:, None, :], k, axis=1) if groups is None
             else np.repeat(scale_f, k // groups, axis=1))  # [E, K, N]
  pts = rng.uniform(0.5, 2.0, (m,)).astype(np.float32) if c["pts"] else None
  xf, wf = f64(x), f64(w)

  def group(g, lo, hi):
    y = xf[lo:hi] @ (wf[g] * scale_k[g])
    return y if pts is None else y * pts[lo:hi, None].astype(np.float64)

  segs = m_segments(M_LISTS[glt], glt)
  want = np_m_grouped(m, n, segs, group)
  (y,) = ascend.grouped_matmul(x, w, scale=packed, per_token_scale=pts, group_list=M_LISTS[glt],
                               group_list_type=glt, split_item=3, group_type=0,
                               output_dtype=c["out"])
  assert_matches(y, want, c["out"], zero_rows_from=segs[-1][2])


# -------------------------------------------------------------------- A8W4 (INT8 x INT4)

A8W4_CASES = [
    # 6.1 A8W4 row 1: bias FLOAT, scale UINT64, offset null, perTokenScale FLOAT, out BF16.
    case("6.1-a8w4-pergroup-bf16", k=512, offset=False, out=BF16, scale="u64"),
    # 6.1 A8W4 row 2: bias FLOAT, scale UINT64, offset FLOAT/null, perTokenScale FLOAT, FP16.
    case("6.1-a8w4-pergroup-f16", k=256, offset=False, out=F16, scale="i64"),
    case("6.1-a8w4-perchannel-offset-f16", k=256, offset=True, out=F16, scale="u64"),
]


@pytest.mark.parametrize("c", A8W4_CASES)
def test_a8w4(c):
  """y = ((x - 8) @ W_deq + bias) * pts, W_deq = w * scale[e, k // 256, n] (symmetric
  per-group) or w * scale[e, 0, n] + offset[e, 0, n] (asymmetric per-channel) (spec 5)."""
  rng = rng_for(c)
  e, m, k, n = 3, 20, c["k"], 16
  x, w = rand_int(rng, (m, k), I8), rand_int(rng, (e, k, n), I4)
  blocks_k = 1 if c["offset"] else k // 256
  raw = rng.uniform(1e-4, 3e-4, (e, blocks_k, n))
  packed = np_pack_scale(raw, unsigned=c["scale"] == "u64")
  scale_f, _ = np_unpack_scale(packed)
  w_deq = f64(w) * np.repeat(scale_f, k // blocks_k, axis=1)
  kwargs = {}
  if c["offset"]:
    offset = (rng.integers(-2, 3, (e, 1, n)) * raw).astype(np.float32)
    kwargs["offset"] = offset
    w_deq = w_deq + offset.astype(np.float64)
    glt = 0  # with an offset the group list type is honoured
  else:
    glt = 1  # without one Ascend reads counts whatever the type says: pass counts
  # The offline bias (8 * sum_k W_deq) cancels the -8 shift; the noise keeps both terms visible.
  bias = (8 * w_deq.sum(axis=1) + rng.standard_normal((e, n))).astype(np.float32)
  pts = rng.uniform(0.5, 2.0, (m,)).astype(np.float32)
  xf = f64(x)

  def group(g, lo, hi):
    return ((xf[lo:hi] - 8) @ w_deq[g] + bias[g].astype(np.float64)) * pts[lo:hi, None]

  segs = m_segments(M_LISTS[glt], glt)
  want = np_m_grouped(m, n, segs, group)
  (y,) = ascend.grouped_matmul(x, w, bias=bias, scale=packed, per_token_scale=pts,
                               group_list=M_LISTS[glt], group_list_type=glt, split_item=3,
                               group_type=0, output_dtype=c["out"], **kwargs)
  assert_matches(y, want, c["out"], zero_rows_from=segs[-1][2])


# ------------------------------------------------------ FP8 x FP8 static / dynamic (T-C, K-C)

FP8_CASES = [
    # 6.2 row 7: group type 0, scale UINT64/INT64, out BF16/FP16/FLOAT32.
    case("6.2-fp8-packed-u64-perchannel-bf16", gt=0, dt=E4M3, scale="u64", sshape="gn",
         out=BF16),
    case("6.2-fp8-packed-i64-pertensor-f16", gt=0, dt=E5M2, scale="i64", sshape="g", out=F16,
         glt=1),
    case("6.2-fp8-packed-i64-perchannel-f32-transposed", gt=0, dt=E4M3, scale="i64",
         sshape="gn", out=F32, transposed=True),
    # 6.2 row 8: group type 0/2, scale FLOAT32, out BF16/FP16/FLOAT32.
    case("6.2-fp8-gt0-perchannel-default_bf16", gt=0, dt=E4M3, scale="f32", sshape="gn",
         out=None),
    case("6.2-fp8-gt0-pertensor_g1-f16", gt=0, dt=E5M2, scale="f32", sshape="g1", out=F16),
    case("6.2-fp8-gt0-pertensor-f32-transposed", gt=0, dt=E4M3, scale="f32", sshape="g",
         out=F32, transposed=True, glt=1),
    case("6.2-fp8-gt2-perchannel-f32", gt=2, dt=E4M3, scale="f32", sshape="gn", out=F32, glt=1),
    case("6.2-fp8-gt2-pertensor-bf16", gt=2, dt=E5M2, scale="f32", sshape="g", out=BF16),
    # 6.3 row 4: group type 0/2, scale FLOAT32, perTokenScale FLOAT32, out BF16/FP16/FLOAT32.
    case("6.3-fp8-gt0-pertoken-bf16-relu", gt=0, dt=E4M3, scale="f32", sshape="gn", pts="m",
         out=BF16, act=1),
    case("6.3-fp8-gt0-pertensor_x-f16", gt=0, dt=E5M2, scale="f32", sshape="g", pts="g",
         out=F16),
    case("6.3-fp8-gt0-pertoken-f32-transposed", gt=0, dt=E4M3, scale="f32", sshape="gn",
         pts="m", out=F32, transposed=True, glt=1),
    case("6.3-fp8-gt2-pertoken-f32", gt=2, dt=E4M3, scale="f32", sshape="gn", pts="gm",
         out=F32),
    case("6.3-fp8-gt2-pertensor-bf16-relu", gt=2, dt=E5M2, scale="f32", sshape="g", pts="g",
         out=BF16, act=1),
]


@pytest.mark.parametrize("c", FP8_CASES)
def test_fp8_static_dynamic(c):
  """y_i = (x_i @ w_i) * scale_i [* pts_i] (spec 5). scale [g, N] per-channel, [g]/[g, 1]
  per-tensor; pts: group type 0 [M] per-token or [g] per-tensor, group type 2 [g, M] or [g]."""
  rng = rng_for(c)
  gt, dt, g, n = c["gt"], c["dt"], 3, 16
  glt, act = c.get("glt", 0), c.get("act", 0)
  out = c["out"] or BF16
  # K >= 128 for k-grouping keeps (g, M) / (g, N) shapes from reading as G-B (spec 6.6).
  m, k = (20, 64) if gt == 0 else (12, 160)
  x = rand_float(rng, (m, k), dt)
  shape = {"gn": (g, n), "g": (g,), "g1": (g, 1)}[c["sshape"]]
  raw = rng.uniform(0.5, 1.5, shape).astype(np.float32)
  if c["scale"] == "f32":
    scale_arg, scale_f = raw, raw.astype(np.float64)
  else:
    scale_arg = np_pack_scale(raw, unsigned=c["scale"] == "u64")
    scale_f = np_unpack_scale(scale_arg)[0]
  scale_f = scale_f.reshape(g, -1)
  pts_kind = c.get("pts")
  pts_shape = {None: None, "m": (m,), "g": (g,), "gm": (g, m)}[pts_kind]
  pts = None if pts_kind is None else rng.uniform(0.5, 2.0, pts_shape).astype(np.float32)
  pts_f = None if pts is None else pts.astype(np.float64)
  kwargs = dict(scale=scale_arg, per_token_scale=pts, group_type=gt, group_list_type=glt,
                act_type=act)
  if c["out"] is not None:
    kwargs["output_dtype"] = c["out"]
  xf = f64(x)

  if gt == 0:
    w = rand_float(rng, (g, k, n), dt)
    wf = f64(w)

    def group(e, lo, hi):
      y = (xf[lo:hi] @ wf[e]) * scale_f[e]
      if pts_kind == "m":
        y = y * pts_f[lo:hi, None]
      elif pts_kind == "g":
        y = y * pts_f[e]
      return np_act(y, act)

    segs = m_segments(M_LISTS[glt], glt)
    want = np_m_grouped(m, n, segs, group)
    if c.get("transposed"):
      kwargs["weight_transposed"] = True
    (y,) = ascend.grouped_matmul(x, transposed(w) if c.get("transposed") else w,
                                 group_list=M_LISTS[glt], split_item=3, **kwargs)
    assert_matches(y, want, out, zero_rows_from=segs[-1][2])
  else:
    w = rand_float(rng, (k, n), dt)
    wf = f64(w)
    sizes = [64, 0, 80]  # 144 of K=160: the last 16 columns are ignored

    def group(i, lo, hi):
      y = (xf[:, lo:hi] @ wf[lo:hi]) * scale_f[i]
      if pts_kind == "gm":
        y = y * pts_f[i][:, None]
      elif pts_kind == "g":
        y = y * pts_f[i]
      return np_act(y, act)

    want = np_k_grouped(m, n, k_segments(sizes), group)
    (y,) = ascend.grouped_matmul(x, w, group_list=k_list(sizes, glt), split_item=2, **kwargs)
    assert_matches(y, want, out)
    np.testing.assert_array_equal(f64(y)[1], 0.0)  # the empty K group


# -------------------------------------------------------------------------- MX (6.4)

MX_CASES = [
    # FP8 x FP8, group type 0/2, no bias, out BF16/FP16/FLOAT32.
    case("6.4-mx-fp8-gt0-oddblocks-bf16", gt=0, dt=E4M3, k=96, out=BF16),
    case("6.4-mx-fp8-gt0-transposed-f32", gt=0, dt=E5M2, k=128, out=F32, transposed=True,
         glt=1),
    case("6.4-mx-fp8-gt0-f16-gelu_tanh", gt=0, dt=E4M3, k=160, out=F16, act=2),
    case("6.4-mx-fp8-gt2-bf16", gt=2, dt=E5M2, k=192, sizes=[64, 128, 0], out=BF16, glt=1),
    case("6.4-mx-fp8-gt2-partial-blocks-f32", gt=2, dt=E4M3, k=160, sizes=[48, 0, 80],
         out=F32),
    # FP4 x FP4, group type 0, bias FLOAT32/null, out BF16/FP16/FLOAT32.
    case("6.4-mx-fp4-gt0-bias-bf16", gt=0, dt=FP4, k=64, bias=True, out=BF16),
    case("6.4-mx-fp4-gt0-nobias-f16-transposed", gt=0, dt=FP4, k=96, out=F16, transposed=True),
    case("6.4-mx-fp4-gt0-bias-f32", gt=0, dt=FP4, k=128, bias=True, out=F32, glt=1),
]


def e8m0_values(rng, shape):
  return 2.0 ** rng.integers(-3, 3, shape)


@pytest.mark.parametrize("c", MX_CASES)
def test_mx(c):
  """y[m, n] = sum_j (x_blk_j @ w_blk_j)[m, n] * pts(m, j) * scale(j, n) + bias[n], 32-wide
  K blocks; logical block j of a group is stored at [..., j // 2, ..., j % 2] (spec 6.4)."""
  rng = rng_for(c)
  gt, dt, k, out, act = c["gt"], c["dt"], c["k"], c["out"], c.get("act", 0)
  glt, g = c.get("glt", 0), 3
  high = 6.0 if dt == FP4 else 2.0
  m, n = (20, 16) if gt == 0 else (12, 16)
  x = rand_float(rng, (m, k), dt, -high, high)
  xf = f64(x)
  kwargs = dict(group_type=gt, group_list_type=glt, output_dtype=out, act_type=act)

  if gt == 0:
    w = rand_float(rng, (g, k, n), dt, -high, high)
    wf = f64(w)
    nblk, rows = -(-k // 32), -(-k // 64)
    s_log, p_log = e8m0_values(rng, (g, nblk, n)), e8m0_values(rng, (m, nblk))
    s_packed = np.full((g, rows, n, 2), MX_GARBAGE)
    p_packed = np.full((m, rows, 2), MX_GARBAGE)
    for j in range(nblk):
      s_packed[:, j // 2, :, j % 2] = s_log[:, j]
      p_packed[:, j // 2, j % 2] = p_log[:, j]
    if c.get("transposed"):
      s_packed = s_packed.transpose(0, 2, 1, 3)  # (g, N, ceil(K/64), 2)
      kwargs["weight_transposed"] = True
    bias = rng.standard_normal((g, n)).astype(np.float32) if c.get("bias") else None

    def group(e, lo, hi):
      y = np.zeros((hi - lo, n))
      for j, a, b in blocks(0, k, 32):
        y += (xf[lo:hi, a:b] @ wf[e, a:b]) * p_log[lo:hi, j, None] * s_log[e, j]
      if bias is not None:
        y += bias[e].astype(np.float64)
      return np_act(y, act)

    segs = m_segments(M_LISTS[glt], glt)
    want = np_m_grouped(m, n, segs, group)
    (y,) = ascend.grouped_matmul(
        x, transposed(w) if c.get("transposed") else w, bias=bias,
        scale=arr(s_packed, E8M0), per_token_scale=arr(p_packed, E8M0),
        group_list=M_LISTS[glt], split_item=3, **kwargs)
    assert_matches(y, want, out, zero_rows_from=segs[-1][2])
  else:
    w = rand_float(rng, (k, n), dt, -high, high)
    wf = f64(w)
    sizes = c["sizes"]
    rows = k // 64 + g
    s_packed = np.full((rows, n, 2), MX_GARBAGE)
    p_packed = np.full((rows, m, 2), MX_GARBAGE)
    want = np.zeros((g, m, n))
    for i, k0, k1 in k_segments(sizes):
      base = k0 // 64 + i
      for j, a, b in blocks(k0, k1, 32):
        s, p = e8m0_values(rng, (n,)), e8m0_values(rng, (m,))
        s_packed[base + j // 2, :, j % 2] = s
        p_packed[base + j // 2, :, j % 2] = p
        want[i] += (xf[:, a:b] @ wf[a:b]) * p[:, None] * s
      want[i] = np_act(want[i], act)
    (y,) = ascend.grouped_matmul(x, w, scale=arr(s_packed, E8M0),
                                 per_token_scale=arr(p_packed, E8M0),
                                 group_list=k_list(sizes, glt), split_item=3, **kwargs)
    assert_k_grouped(y, want, out, sizes)


# ------------------------------------------------------------------------- G-B (6.5)

GB_CASES = [
    # FP8 x FP8, group type 0/2, scale FLOAT32, perTokenScale FLOAT32, out BF16/FP16/FLOAT32.
    case("6.5-gb-fp8-gt0-bf16", gt=0, dt=E4M3, k=256, n=48, out=BF16),
    case("6.5-gb-fp8-gt0-transposed-2nblocks-f32", gt=0, dt=E5M2, k=384, n=136, out=F32,
         transposed=True, glt=1),
    case("6.5-gb-fp8-gt0-partial-kblock-f16-fast_gelu", gt=0, dt=E4M3, k=320, n=32, out=F16,
         act=4),
    case("6.5-gb-fp8-gt2-f16", gt=2, dt=E4M3, k=384, n=48, sizes=[128, 0, 200], out=F16),
    case("6.5-gb-fp8-gt2-f32", gt=2, dt=E5M2, k=256, n=24, sizes=[0, 130, 64], out=F32, glt=1),
]


@pytest.mark.parametrize("c", GB_CASES)
def test_gb(c):
  """y[m, n] = sum_j (x_blk_j @ w_blk_j)[m, n] * pts[m, j] * scale[j, n // 128] with 128-wide
  K blocks; group type 2 group i's block j at row (K_0 + ... + K_{i-1}) // 128 + i + j."""
  rng = rng_for(c)
  gt, dt, k, n, out, act = c["gt"], c["dt"], c["k"], c["n"], c["out"], c.get("act", 0)
  glt, g, nb = c.get("glt", 0), 3, -(-c["n"] // 128)
  m = 20 if gt == 0 else 12
  x = rand_float(rng, (m, k), dt)
  xf = f64(x)
  kwargs = dict(group_type=gt, group_list_type=glt, output_dtype=out, act_type=act)

  def expand_n(s):  # [..., ceil(N/128)] -> [..., N]
    return np.repeat(s, 128, axis=-1)[..., :n]

  if gt == 0:
    w = rand_float(rng, (g, k, n), dt)
    wf = f64(w)
    kb = -(-k // 128)
    scale = rng.uniform(0.5, 1.5, (g, kb, nb)).astype(np.float32)
    pts = rng.uniform(0.5, 1.5, (m, kb)).astype(np.float32)
    scale_arg = scale
    if c.get("transposed"):
      scale_arg = np.ascontiguousarray(scale.transpose(0, 2, 1))  # (g, ceil(N/128), ceil(K/128))
      kwargs["weight_transposed"] = True

    def group(e, lo, hi):
      y = np.zeros((hi - lo, n))
      for j, a, b in blocks(0, k, 128):
        y += ((xf[lo:hi, a:b] @ wf[e, a:b]) * pts[lo:hi, j, None].astype(np.float64)
              * expand_n(scale[e, j].astype(np.float64)))
      return np_act(y, act)

    segs = m_segments(M_LISTS[glt], glt)
    want = np_m_grouped(m, n, segs, group)
    (y,) = ascend.grouped_matmul(x, transposed(w) if c.get("transposed") else w,
                                 scale=scale_arg, per_token_scale=pts, group_list=M_LISTS[glt],
                                 split_item=3, **kwargs)
    assert_matches(y, want, out, zero_rows_from=segs[-1][2])
  else:
    w = rand_float(rng, (k, n), dt)
    wf = f64(w)
    sizes = c["sizes"]
    rows = k // 128 + g
    scale = np.full((rows, nb), GB_GARBAGE, np.float32)
    pts = np.full((rows, m), GB_GARBAGE, np.float32)
    want = np.zeros((g, m, n))
    for i, k0, k1 in k_segments(sizes):
      base = k0 // 128 + i
      for j, a, b in blocks(k0, k1, 128):
        scale[base + j] = rng.uniform(0.5, 1.5, nb)
        pts[base + j] = rng.uniform(0.5, 1.5, m)
        want[i] += ((xf[:, a:b] @ wf[a:b]) * pts[base + j, :, None].astype(np.float64)
                    * expand_n(scale[base + j].astype(np.float64)))
      want[i] = np_act(want[i], act)
    (y,) = ascend.grouped_matmul(x, w, scale=scale, per_token_scale=pts,
                                 group_list=k_list(sizes, glt), split_item=3, **kwargs)
    assert_k_grouped(y, want, out, sizes)


# ------------------------------------------------------------- weight-only (6.1 A16, 6.8)

WO_CASES = [
    # 6.1 A16W8/A16W4, FLOAT16 x: bias FLOAT16/null, antiquant scale/offset FLOAT16.
    case("6.1-a16-f16-int8-perchannel-offset-bias_f16", xd=F16, wd=I8, groups=None, offset=True,
         bias=F16, gt=0),
    case("6.1-a16-f16-int4-pergroup-gt-1", xd=F16, wd=I4, groups=2, offset=False, bias=None,
         gt=-1),
    # 6.1 A16W8/A16W4, BFLOAT16 x: bias FLOAT/null, antiquant scale/offset BFLOAT16.
    case("6.1-a16-bf16-int4-perchannel-offset-bias_f32", xd=BF16, wd=I4, groups=None,
         offset=True, bias=F32, gt=0, glt=1),
    case("6.1-a16-bf16-int8-gt-1-offset-bias_f32", xd=BF16, wd=I8, groups=None, offset=True,
         bias=F32, gt=-1),
    # 6.8 row 1: BFLOAT16 x, INT8/INT4, bias BF16/FLOAT32/null, offset BF16/null, gt -1/0.
    case("6.8-bf16-int8-offset-bias_bf16", xd=BF16, wd=I8, groups=None, offset=True, bias=BF16,
         gt=0),
    case("6.8-bf16-int4-pergroup-offset-nobias", xd=BF16, wd=I4, groups=2, offset=True,
         bias=None, gt=0),
    case("6.8-bf16-int4-pergroup-gt-1-bias_f32", xd=BF16, wd=I4, groups=2, offset=False,
         bias=F32, gt=-1),
    # 6.8 row 2: FLOAT16 x, INT8/INT4, bias FLOAT16/null, offset FLOAT16/null, gt -1/0.
    case("6.8-f16-int4-perchannel-offset-bias_f16", xd=F16, wd=I4, groups=None, offset=True,
         bias=F16, gt=0),
    case("6.8-f16-int8-gt-1-3d-x-nooffset", xd=F16, wd=I8, groups=None, offset=False,
         bias=None, gt=-1),
    case("6.8-f16-int4-pergroup-bias_f16", xd=F16, wd=I4, groups=2, offset=False, bias=F16,
         gt=0, glt=1),
    # 6.8 rows 3/4: FP8 weights (transposed, per-channel, no offset), group type 0.
    case("6.8-bf16-fp8e4m3-bias_bf16", xd=BF16, wd=E4M3, bias=BF16, gt=0),
    case("6.8-bf16-fp8e5m2-bias_f32", xd=BF16, wd=E5M2, bias=F32, gt=0, glt=1),
    case("6.8-bf16-fp8e4m3-nobias", xd=BF16, wd=E4M3, bias=None, gt=0),
    case("6.8-f16-fp8e5m2-bias_f16", xd=F16, wd=E5M2, bias=F16, gt=0),
    case("6.8-f16-fp8e4m3-nobias", xd=F16, wd=E4M3, bias=None, gt=0, glt=1),
]


@pytest.mark.parametrize("c", WO_CASES)
def test_weight_only(c):
  """y = x @ ((w + antiquant_offset) * antiquant_scale) + bias (spec 5); FP8 weights are given
  as [E, N, K] (weight_transposed) with a per-channel [E, N] scale: y = x @ (w^T * s) + b."""
  rng = rng_for(c)
  xd, wd, out = c["xd"], c["wd"], c["xd"]
  fp8 = wd in (E4M3, E5M2)
  offset = c.get("offset", False)

  def quant_params(k, n, lead, groups):
    """(weight, scale, offset, bias) as passed, and the dequantized float64 weight."""
    if fp8:
      w = rand_float(rng, lead + (n, k), wd)  # memory layout [E, N, K]
      w_log = np.swapaxes(f64(w), -1, -2)
    else:
      w = rand_int(rng, lead + (k, n), wd)
      w_log = f64(w)
    shape = lead + (n,) if groups is None else lead + (groups, n)
    s = arr(rng.uniform(0.5, 1.5, shape) if fp8 else rng.uniform(0.01, 0.05, shape), xd)
    o = arr(rng.integers(-3, 4, shape), xd) if offset else None
    b = None if c["bias"] is None else arr(rng.standard_normal(lead + (n,)), c["bias"])
    s_f = f64(s)[..., None, :] if groups is None else np.repeat(f64(s), k // groups, axis=-2)
    o_f = 0.0 if o is None else (f64(o)[..., None, :] if groups is None
                                 else np.repeat(f64(o), k // groups, axis=-2))
    return w, s, o, b, (w_log + o_f) * s_f

  if c["gt"] == -1:
    x_shapes, ns = [(5, 64), (2, 3, 128)], [8, 6]
    xs, params, wants = [], [], []
    for x_shape, n in zip(x_shapes, ns):
      k = x_shape[-1]
      x = arr(rng.standard_normal(x_shape), xd)
      # per-group: [G_i, n_i] with the same group size (64) for every tensor
      w, s, o, b, w_deq = quant_params(k, n, (), None if c["groups"] is None else k // 64)
      xs.append(x)
      params.append((w, s, o, b))
      wants.append(f64(x) @ w_deq + (0.0 if b is None else f64(b)))
    ws, ss, offsets, bs = (list(p) for p in zip(*params))
    ys = ascend.grouped_matmul(xs, ws, bias=None if c["bias"] is None else bs,
                               antiquant_scale=ss, antiquant_offset=offsets if offset else None,
                               group_type=-1, split_item=0)
    assert len(ys) == 2
    for y, want in zip(ys, wants):
      assert_matches(y, want, out)
    return

  e, m, k, n = 3, 20, 128, 16
  glt = c.get("glt", 0)
  x = arr(rng.standard_normal((m, k)), xd)
  w, s, o, b, w_deq = quant_params(k, n, (e,), c.get("groups"))
  xf = f64(x)
  b_f = None if b is None else f64(b)

  def group(g, lo, hi):
    y = xf[lo:hi] @ w_deq[g]
    return y if b_f is None else y + b_f[g]

  segs = m_segments(M_LISTS[glt], glt)
  want = np_m_grouped(m, n, segs, group)
  kwargs = dict(weight_transposed=True) if fp8 else {}
  (y,) = ascend.grouped_matmul(x, w, bias=b, antiquant_scale=s, antiquant_offset=o,
                               group_list=M_LISTS[glt], group_list_type=glt, split_item=3,
                               group_type=0, **kwargs)
  assert_matches(y, want, out, zero_rows_from=segs[-1][2])
