"""Quantization: `quantize`/`dequantize`/`QArray`, and every quantized gmm mode against a
float64 numpy oracle written from the Ascend GroupedMatmul formulas (spec section 5), with
the QArray's raw fields decoded by numpy (independently of gmm_jax.dequantize).

Accuracy against the unquantized f32 result is checked with a relative-error budget per
mode (||y - y_f32|| / ||y_f32||, Frobenius norm), stated in `BUDGETS` and in docs/quantization.md."""

from __future__ import annotations

import sys
import types

import gmm_jax
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from gmm_jax import QArray, QuantSpec, dequantize, quantize
from gmm_jax._src.core.qarray import check_fits
from gmm_test_base import encode
from grids import covering
from oracle import dequantize as np_dequantize  # numpy, from the raw fields
from oracle import f64, gmm_oracle, tolerances

M, K, N, G = 40, 96, 24, 4
SIZES = [10, 0, 17, 9]  # sum 36 < M: an empty group and rows past the total
K_SIZES = [30, 0, 41, 20]  # k-grouping: sum 91 < K

# Relative-error budgets against the f32 result (gaussian data, Frobenius norm). Measured
# (2026-11-30): int8 per-channel 0.6%, int4 per-group-32 9.4% (absmax int4 has a step of
# ~absmax/7, so ~10% is inherent), fp8 e4m3 2.4%, int8 x int8 0.9%, MX e4m3 3.5%, MX e5m2
# 7.1%, MX fp4 15.7%, A8W4 11.6%.
BUDGETS = {
    "int8 per-channel weights": 0.01,
    "int4 per-group weights": 0.12,
    "fp8 e4m3 per-channel weights": 0.04,
    "int8 per-token x int8 per-channel": 0.02,
    "MX fp8 e4m3": 0.05,
    "MX fp8 e5m2": 0.10,
    "MX fp4 e2m1": 0.25,
    "G-B fp8 e4m3": 0.05,
    "A8W4": 0.15,
}


# ------------------------------------------------------------------------- numpy oracle


def np_gmm(x, w, sizes, group_type="m", bias=None):
  """Per-group loops in float64: x [M, K]; w [G, K, N] (m) or [K, N] (k)."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  if group_type == "m":
    out = np.zeros((x.shape[0], w.shape[-1]))
    for g in range(len(sizes)):
      rows = slice(bounds[g], bounds[g + 1])
      out[rows] = x[rows] @ w[g] + (0.0 if bias is None else bias[g])
    return out
  out = np.zeros((len(sizes), x.shape[0], w.shape[-1]))
  for g in range(len(sizes)):
    cols = slice(bounds[g], bounds[g + 1])
    out[g] = x[:, cols] @ w[cols] + (0.0 if bias is None else bias[g])
  return out


def row_mask(sizes, m):
  return (np.arange(m) < np.sum(sizes))[:, None]


def rel_error(got, want):
  """Relative error in the Frobenius norm: ||got - want|| / ||want||."""
  got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
  return float(np.linalg.norm(got - want) / np.linalg.norm(want))


def operands(seed=0, group_type="m"):
  rng = np.random.default_rng(seed)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = (rng.standard_normal((G, K, N) if group_type == "m" else (K, N)) / np.sqrt(K)).astype(
      np.float32)
  bias = rng.standard_normal((G, N)).astype(np.float32)
  return x, w, bias


def np_silu(x):
  return x / (1.0 + np.exp(-x))


def np_quantize_int8(x, channelwise_axes=()):
  """Symmetric absmax int8 quantization in numpy (one scale per index of
  `channelwise_axes`, shared along the other axes): the dequantized values, float64.

  Computed in float32 like gmm's own (the scale absmax / 127 and the division rounded to
  f32, then round half to even), so a value at a rounding boundary lands on the same
  integer; the dequantization itself is exact in float64."""
  x = np.asarray(x, np.float32)
  reduce = tuple(axis for axis in range(x.ndim) if axis not in channelwise_axes)
  scale = np.max(np.abs(x), axis=reduce, keepdims=True) / np.float32(127)
  scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
  q = np.clip(np.round(x / scale), -127, 127)
  return q.astype(np.float64) * scale.astype(np.float64)


def mode_operands(mode, group_type, x, w):
  """(lhs, rhs, gmm keyword arguments, lhs and rhs as the oracle sees them: the float64
  dequantized values) of one quantized mode; per-token lhs scales, per-expert and
  per-channel (m) or per-column (k) rhs scales, per-tile along K for "blocked"."""
  k_axis = 1 if group_type == "m" else 0
  w_channels = (0, 2) if group_type == "m" else (1,)
  if mode == "weight_only":
    rhs = quantize(w, jnp.int8, channelwise_axes=w_channels)
    return x, rhs, {}, np.asarray(x, np.float64), np_dequantize(rhs)
  if mode == "scaled":
    lhs = quantize(x, jnp.int8, channelwise_axes=(0,))
    rhs = quantize(w, jnp.int8, channelwise_axes=w_channels)
    return lhs, rhs, {}, np_dequantize(lhs), np_dequantize(rhs)
  if mode == "blocked":
    lhs = quantize(x, jnp.float8_e5m2, channelwise_axes=(0,), tiled_axes={1: 32})
    rhs = quantize(w, jnp.float8_e5m2, channelwise_axes=w_channels, tiled_axes={k_axis: 32})
    return lhs, rhs, {}, np_dequantize(lhs), np_dequantize(rhs)
  assert mode == "dynamic", mode  # gmm quantizes both float operands itself
  specs = dict(quantize_lhs=QuantSpec(jnp.int8, channelwise_axes=(0,)),
               quantize_rhs=QuantSpec(jnp.int8, channelwise_axes=w_channels))
  return x, w, specs, np_quantize_int8(x, (0,)), np_quantize_int8(w, w_channels)


def check_quantized(got, want, lhs_values, rhs_values, sizes, group_type):
  """`got` against the float64 oracle of the dequantized operands, at the f32 tolerance for
  a contraction of K products of their typical size (rows past the total exactly 0)."""
  rms = lambda a: float(np.sqrt(np.mean(np.square(a))))  # noqa: E731
  got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
  assert got.shape == want.shape, (got.shape, want.shape)
  np.testing.assert_allclose(got, want, **tolerances(
      np.float32, k=lhs_values.shape[1], scale=rms(lhs_values) * rms(rhs_values)))
  if group_type == "m":
    assert np.all(got[np.sum(sizes):] == 0)


# ----------------------------------------------------------------------- quantize itself


@pytest.mark.parametrize("dtype", ["int8", "int4", "float8_e4m3fn", "float8_e5m2",
                                   "float4_e2m1fn"])
@pytest.mark.parametrize("layout, channelwise, tiled, scale_shape", [
    ("per-tensor", (), None, (1, 1, 1)),
    ("per-channel", (0, 2), None, (G, 1, N)),
    ("per-group-K", (0, 2), {1: 32}, (G, 3, N)),
    ("block-2d", (0,), {1: 32, 2: 8}, (G, 3, 3)),
])
def test_quantize_scale_shapes_and_error(dtype, layout, channelwise, tiled, scale_shape):
  _, w, _ = operands()
  q = quantize(w, dtype, channelwise_axes=channelwise, tiled_axes=tiled)
  assert q.qvalue.dtype == np.dtype(dtype) and q.shape == w.shape
  assert q.scale.shape == scale_shape and q.scale.dtype == np.float32
  # Every value is inside the format's range and dequantizes within the rounding step.
  deq = np_dequantize(q)
  scale = np.broadcast_to(np_dequantize(QArray(jnp.ones(w.shape, jnp.int8), q.scale,
                                               tile=q.tile)), w.shape)
  if dtype.startswith("int"):
    np.testing.assert_array_less(np.abs(deq - w), scale * 0.5 + 1e-6)
  else:  # floats: relative step of the mantissa, plus the subnormal floor
    mantissa = {"float8_e4m3fn": 3, "float8_e5m2": 2, "float4_e2m1fn": 1}[dtype]
    finfo = ml_dtypes.finfo(np.dtype(dtype))
    bound = np.abs(w) * 2.0 ** -(mantissa + 1) + scale * float(finfo.smallest_subnormal)
    np.testing.assert_array_less(np.abs(deq - w), bound * 1.0001 + 1e-7)
  # The largest magnitude of each scale group maps to the top of the range.
  top = float(np.max(np.abs(np.asarray(q.qvalue.astype(jnp.float32)))))
  qmax = (jnp.iinfo(dtype).max if dtype.startswith("int") else float(ml_dtypes.finfo(
      np.dtype(dtype)).max))
  assert top == pytest.approx(qmax, rel=0.02)


def test_quantize_shorter_last_tile_and_dequantize():
  x = np.arange(-50, 50, dtype=np.float32).reshape(2, 50)
  q = quantize(x, jnp.int8, channelwise_axes=(0,), tiled_axes={1: 32})
  assert q.scale.shape == (2, 2) and q.tile == (1, 32)  # tiles of 32 and 18 columns
  np.testing.assert_allclose(q.scale[:, 0], np.abs(x[:, :32]).max(1) / 127, rtol=1e-6)
  np.testing.assert_allclose(q.scale[:, 1], np.abs(x[:, 32:]).max(1) / 127, rtol=1e-6)
  np.testing.assert_allclose(dequantize(q), np_dequantize(q), rtol=1e-6)
  np.testing.assert_allclose(dequantize(q), x, atol=float(q.scale.max()) / 2 + 1e-6)


def test_quantize_zero_point_is_asymmetric():
  x = np.linspace(0.5, 3.0, 64, dtype=np.float32).reshape(4, 16)  # all positive
  q = quantize(x, jnp.int8, channelwise_axes=(0,), zero_point=True)
  assert q.zero_point.dtype == np.int8 and q.zero_point.shape == (4, 1)
  # The range [0, max] (zero stays exact) spans all 256 levels: 0 -> -128, max -> 127.
  np.testing.assert_array_equal(np.asarray(q.zero_point), -128)
  np.testing.assert_array_equal(np.asarray(q.qvalue).max(axis=1), 127)
  np.testing.assert_allclose(np_dequantize(q), x, atol=float(q.scale.max()) / 2 + 1e-6)
  assert float(q.scale.max()) < 3.0 / 127  # finer than symmetric's 3/127


def test_quantize_e8m0_scales_are_powers_of_two_without_saturation():
  x = np.random.default_rng(3).standard_normal((8, 64)).astype(np.float32) * 37.0
  q = quantize(x, jnp.float8_e4m3fn, channelwise_axes=(0,), tiled_axes={1: 32},
               scale_dtype=jnp.float8_e8m0fnu)
  assert q.scale.dtype == np.dtype(jnp.float8_e8m0fnu)
  scale = np.asarray(q.scale.astype(jnp.float32))
  np.testing.assert_array_equal(np.exp2(np.round(np.log2(scale))), scale)
  assert np.all(np.isfinite(np.asarray(q.qvalue.astype(jnp.float32))))
  assert rel_error(np_dequantize(q), x) < 0.07


def test_quantize_all_zero_tile():
  q = quantize(np.zeros((4, 8), np.float32), jnp.int8, channelwise_axes=(0,))
  np.testing.assert_array_equal(np_dequantize(q), 0.0)


@pytest.mark.parametrize("call, match", [
    (lambda x: quantize(x, jnp.int16), "quantize dtype must be one of"),
    (lambda x: quantize(x, jnp.int8, scale_dtype=jnp.int8), "scale_dtype must be one of"),
    (lambda x: quantize(x, jnp.float8_e4m3fn, zero_point=True), "needs an integer dtype"),
    (lambda x: quantize(x, jnp.int8, channelwise_axes=(1,), tiled_axes={1: 4}),
     "both channelwise and tiled"),
    (lambda x: quantize(x, jnp.int8, tiled_axes={1: 0}), "positive ints"),
    (lambda x: quantize(x, jnp.int8, channelwise_axes=(2,)), "axis 2 out of range"),
    (lambda x: quantize(x.astype(np.int32), jnp.int8), "needs a float array"),
    (lambda x: QArray(jnp.zeros((4, 8), jnp.int8), jnp.ones((4,))), "same rank|rank of"),
    (lambda x: QArray(jnp.zeros((4, 8), jnp.int8), jnp.ones((4, 3))), "does not tile"),
    (lambda x: QArray(jnp.zeros((4, 8), jnp.int8), jnp.ones((4, 1)), jnp.ones((4, 2))),
     "zero_point"),
    (lambda x: quantize(x, jnp.int8, bound=0.0), "bound must be a positive finite"),
    (lambda x: quantize(x, jnp.int8, bound=np.inf), "bound must be a positive finite"),
    (lambda x: quantize(x, jnp.int8, bound=True), "bound must be a positive finite"),
    (lambda x: quantize(x, jnp.int8, bound=127.5, zero_point=True), "symmetric"),
    (lambda x: gmm_jax.QuantSpec(jnp.int8, bound=-1), "bound must be a positive finite"),
])
def test_quantize_errors(call, match):
  with pytest.raises(ValueError, match=match):
    call(np.ones((4, 8), np.float32))


@pytest.mark.parametrize("dtype, bound", [(jnp.int8, 127.5), (jnp.int4, 7.5),
                                          (jnp.float8_e4m3fn, 240.0)])
def test_quantize_bound_is_what_the_absmax_maps_to(dtype, bound):
  """qwix's integer convention (qmax + 0.5): the scale is absmax / bound; values rounding
  past the type's range saturate."""
  x = np.linspace(-3.0, 2.0, 32, dtype=np.float32).reshape(4, 8)
  # Each row's peak positive: a negative peak lands on -bound, a rounding tie that the last
  # bit of the scale decides.
  x = np.where(np.abs(x) == np.abs(x).max(axis=1, keepdims=True), np.abs(x), x)
  q = quantize(x, dtype, channelwise_axes=(0,), bound=bound)
  scale = np.abs(x).max(axis=1, keepdims=True) / bound
  np.testing.assert_allclose(np.asarray(q.scale), scale, rtol=1e-6)
  values = np.asarray(q.qvalue.astype(jnp.float32))
  low, high = (jnp.iinfo(dtype).min, jnp.iinfo(dtype).max) if jnp.issubdtype(
      dtype, jnp.integer) else (-float(jnp.finfo(dtype).max), float(jnp.finfo(dtype).max))
  assert values.min() >= low and values.max() <= high
  if jnp.issubdtype(dtype, jnp.integer):
    np.testing.assert_array_equal(values, np.clip(np.round(x / np.asarray(q.scale)), low, high))
  spec = gmm_jax.QuantSpec(dtype, channelwise_axes=(0,), bound=bound)
  np.testing.assert_array_equal(np.asarray(spec(x).qvalue), np.asarray(q.qvalue))


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fnuz, jnp.float8_e5m2fnuz])
def test_fnuz_fp8_quantize_and_gmm(dtype):
  """The fnuz fp8 types (MaxText's nanoo_fp8): the absmax maps to their largest finite value,
  and gmm multiplies them like the other fp8 types."""
  rng = np.random.default_rng(3)
  x = rng.standard_normal((12, 16)).astype(np.float32)
  w = rng.standard_normal((3, 16, 8)).astype(np.float32)
  qx = quantize(x, dtype, channelwise_axes=(0,))
  qw = quantize(w, dtype, channelwise_axes=(0, 2))
  assert qx.qtype == np.dtype(dtype)
  np.testing.assert_allclose(np.abs(np_dequantize(qx)).max(axis=1), np.abs(x).max(axis=1),
                             rtol=1e-6)
  sizes = np.array([5, 0, 7], np.int32)
  got = jax.jit(lambda a, b: gmm_jax.gmm(a, b, sizes))(qx, qw)
  want = gmm_oracle(np_dequantize(qx), np_dequantize(qw), sizes, "m")
  np.testing.assert_allclose(f64(got), want, rtol=1e-5, atol=1e-4)


def test_qarray_is_a_pytree_through_jit():
  q = quantize(operands()[1], jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: 32})
  leaves, treedef = jax.tree.flatten(q)
  assert len(leaves) == 2  # qvalue, scale (no zero point)
  back = jax.jit(lambda q: q)(q)
  assert isinstance(back, QArray) and back.tile == q.tile
  np.testing.assert_array_equal(dequantize(back), dequantize(q))


def _rebuilt(q: QArray, **leaves) -> QArray:
  """`q` rebuilt by `tree_unflatten` (which skips `QArray.__init__`) with some leaves
  replaced, as a transformation or user code may do."""
  children, aux = q.tree_flatten()
  fields = dict(zip(("qvalue", "scale", "zero_point"), children), **leaves)
  return QArray.tree_unflatten(aux, (fields["qvalue"], fields["scale"], fields["zero_point"]))


@pytest.mark.parametrize("shape, kwargs", [
    ((G, K, N), dict()),
    ((G, K, N), dict(channelwise_axes=(0, 2))),
    ((G, K, N), dict(channelwise_axes=(0, 2), tiled_axes={1: 32}, zero_point=True)),
    ((G, 70, N), dict(channelwise_axes=(0,), tiled_axes={1: 32, 2: 7})),  # shorter last tiles
    ((0, 8), dict()),
    ((3, 0), dict(channelwise_axes=(0,))),
])
def test_check_fits_accepts_every_quantize_layout(shape, kwargs):
  q = quantize(np.random.default_rng(0).standard_normal(shape).astype(np.float32), jnp.int8,
               **kwargs)
  assert check_fits(q) is q
  assert check_fits(_rebuilt(q)) is not None  # a plain round trip stays valid


@pytest.mark.parametrize("replace, match", [
    (lambda q: dict(scale=jnp.ones((G, 1, N + 1))),
     r"rhs QArray with values \(4, 96, 24\), scale \(4, 1, 25\).*axis 2 of size 24 with "
     r"tile 1 needs 24 scales \(or 1\), got 25"),
    (lambda q: dict(scale=jnp.ones((G, 2, N))), r"axis 1 of size 96 with tile 96 needs 1"),
    (lambda q: dict(scale=jnp.ones((G, N))), r"scale \(4, 24\).*the values' rank"),
    (lambda q: dict(zero_point=jnp.zeros((G, 1, 1), jnp.int8)),
     r"zero point \(4, 1, 1\) must have the scale's shape"),
    (lambda q: dict(qvalue=q.qvalue[:, :, :N - 1]),
     r"values \(4, 96, 23\).*axis 2 of size 23 with tile 1 needs 23 scales"),
])
def test_check_fits_names_the_shapes_of_a_rebuilt_qarray(replace, match):
  q = quantize(operands()[1], jnp.int8, channelwise_axes=(0, 2))
  with pytest.raises(ValueError, match=match):
    check_fits(_rebuilt(q, **replace(q)), "rhs")


def test_gmm_rejects_a_rebuilt_qarray_whose_scale_does_not_fit():
  x, w, _ = operands()
  q = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  bad = _rebuilt(q, scale=jnp.ones((G, 1, N + 1)))
  # (It was used with its first N scales before gmm checked operand scales.)
  with pytest.raises(ValueError, match=r"\(4, 1, 25\)"):
    gmm_jax.gmm(x, bad, SIZES)


# ---------------------------------------------------------------------------- the modes


def check(got, want, sizes=SIZES, group_type="m", rtol=2e-5):
  got = np.asarray(jnp.asarray(got).astype(jnp.float32), np.float64)
  scale = max(np.max(np.abs(want)), 1e-6)
  np.testing.assert_allclose(got, want, atol=rtol * scale, rtol=rtol)
  if group_type == "m":  # rows past the total are exactly 0
    assert np.all(got[np.sum(sizes):] == 0)


@pytest.mark.parametrize("encoding", ["counts", "cumsum", "sparse"])
@pytest.mark.parametrize("case", [
    "int8 per-channel", "int4 per-group", "int4 per-channel zero-point", "fp8 e4m3 transposed",
    "fp8 e5m2 per-tensor"])
def test_weight_only(case, encoding):
  # y = x @ ((W + offset) * scale) + b   (Ascend's offset is minus the zero point)
  x, w, bias = operands(1)
  transpose_rhs = "transposed" in case
  stored = np.swapaxes(w, 1, 2) if transpose_rhs else w
  k_axis = 2 if transpose_rhs else 1
  if case == "int8 per-channel":
    q = quantize(stored, jnp.int8, channelwise_axes=(0, 2))
  elif case == "int4 per-group":
    q = quantize(stored, jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: 32})
  elif case == "int4 per-channel zero-point":
    q = quantize(stored, jnp.int4, channelwise_axes=(0, 2), zero_point=True)
  elif case == "fp8 e4m3 transposed":
    q = quantize(stored, jnp.float8_e4m3fn, channelwise_axes=(0, 3 - k_axis))
  else:
    q = quantize(stored, jnp.float8_e5m2, channelwise_axes=(0,))
  x16 = jnp.asarray(x, jnp.bfloat16)
  got = gmm_jax.gmm(x16, q, encode(SIZES, encoding), group_list_type=encoding, bias=bias,
                    activation="silu", transpose_rhs=transpose_rhs,
                    preferred_element_type=jnp.float32)
  weights = np_dequantize(q)
  weights = np.swapaxes(weights, 1, 2) if transpose_rhs else weights
  # The kernel multiplies bf16 activations by the weights dequantized to bf16.
  weights_bf16 = np.asarray(jnp.asarray(weights, jnp.bfloat16).astype(jnp.float32))
  want = np_silu(np_gmm(np.asarray(x16.astype(jnp.float32)), weights_bf16, SIZES, bias=bias))
  check(got, want * row_mask(SIZES, M), rtol=1e-4)
  # The default output dtype is the activations'.
  assert gmm_jax.gmm(x16, q, SIZES, transpose_rhs=transpose_rhs).dtype == jnp.bfloat16


@pytest.mark.parametrize("name, make", [
    ("int8 per-channel weights", lambda w: quantize(w, jnp.int8, channelwise_axes=(0, 2))),
    ("int4 per-group weights", lambda w: quantize(w, jnp.int4, channelwise_axes=(0, 2),
                                                  tiled_axes={1: 32})),
    ("fp8 e4m3 per-channel weights", lambda w: quantize(w, jnp.float8_e4m3fn,
                                                        channelwise_axes=(0, 2))),
])
def test_weight_only_accuracy_budget(name, make):
  x, w, _ = operands(2)
  err = rel_error(gmm_jax.gmm(x, make(w), SIZES), np_gmm(x, w, SIZES) * row_mask(SIZES, M))
  assert err <= BUDGETS[name], (name, err)


@pytest.mark.parametrize("lhs_layout", ["per-tensor", "per-token"])
@pytest.mark.parametrize("rhs_layout", ["per-tensor", "per-channel"])
@pytest.mark.parametrize("bias_kind", ["none", "int32", "float"])
@pytest.mark.parametrize("out", ["float32", "bfloat16"])
def test_scaled_int8_m(lhs_layout, rhs_layout, bias_kind, out):
  # Static (T-T, T-C) and dynamic (K-T, K-C) full quantization, m-grouping:
  #   y = (x W) * scale * per_token_scale                    (no bias)
  #   y = (x W + b_int32) * scale * per_token_scale          (int32 bias)
  #   y = (x W) * scale * per_token_scale + b                (float bias)
  x, w, fbias = operands(3)
  xq = quantize(x, jnp.int8, channelwise_axes=(0,) if lhs_layout == "per-token" else ())
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2) if rhs_layout == "per-channel" else (0,))
  ibias = np.random.default_rng(4).integers(-3000, 3000, (G, N)).astype(np.int32)
  bias = {"none": None, "int32": ibias, "float": fbias}[bias_kind]
  got = gmm_jax.gmm(xq, wq, SIZES, bias=bias, preferred_element_type=out)
  xv = np.asarray(xq.qvalue, np.float64)
  wv = np.asarray(wq.qvalue, np.float64)
  per_token = np.broadcast_to(np.asarray(xq.scale, np.float64), (M, 1))
  scale = np.broadcast_to(np.asarray(wq.scale, np.float64), (G, 1, N))[:, 0]
  acc = np_gmm(xv, wv, SIZES, bias=ibias if bias_kind == "int32" else None)
  bounds = np.concatenate([[0], np.cumsum(SIZES)])
  want = np.zeros((M, N))
  for g in range(G):
    rows = slice(bounds[g], bounds[g + 1])
    want[rows] = acc[rows] * scale[g] * per_token[rows]
    if bias_kind == "float":
      want[rows] += fbias[g]
  check(got, want, rtol=1e-5 if out == "float32" else 1e-2)
  assert got.dtype == np.dtype(out)


def test_scaled_int8_accuracy_budget():
  x, w, _ = operands(5)
  got = gmm_jax.gmm(quantize(x, jnp.int8, channelwise_axes=(0,)),
                    quantize(w, jnp.int8, channelwise_axes=(0, 2)), SIZES)
  err = rel_error(got, np_gmm(x, w, SIZES) * row_mask(SIZES, M))
  assert err <= BUDGETS["int8 per-token x int8 per-channel"], err


@pytest.mark.parametrize("activation, np_act", [("relu", lambda v: np.maximum(v, 0)),
                                                ("silu", np_silu)])
def test_static_int8_output_requantization(activation, np_act):
  # y_int8 = saturate(round(act((x W + b) * scale) * out_scale + out_offset)), rows past the
  # total 0: the A8W8 int8-output path with the requantization as an output scale/offset.
  x, w, _ = operands(6)
  xq = quantize(x, jnp.int8)
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  ibias = np.random.default_rng(7).integers(-500, 500, (G, N)).astype(np.int32)
  out_scale = np.full((G, 1), 40.0, np.float32)
  got = gmm_jax.gmm(xq, wq, SIZES, bias=ibias, activation=activation,
                    preferred_element_type=jnp.int8, output_scale=out_scale,
                    output_offset=-5.0)
  acc = np_gmm(np.asarray(xq.qvalue, np.float64), np.asarray(wq.qvalue, np.float64), SIZES,
               bias=ibias)
  scale = float(xq.scale.reshape(())) * np.asarray(wq.scale, np.float64)[:, 0]  # [G, N]
  bounds = np.concatenate([[0], np.cumsum(SIZES)])
  want = np.zeros((M, N))
  for g in range(G):
    rows = slice(bounds[g], bounds[g + 1])
    want[rows] = np.clip(np.round(np_act(acc[rows] * scale[g]) * 40.0 - 5.0), -128, 127)
  assert got.dtype == jnp.int8
  diff = np.abs(np.asarray(got, np.float64) - want)
  assert diff.max() <= 1  # f32 vs f64 at a rounding boundary moves a value by one step
  assert (diff > 0).mean() < 0.01
  assert np.all(np.asarray(got)[np.sum(SIZES):] == 0)


@pytest.mark.parametrize("bias_kind", ["none", "float", "int32"])
def test_scaled_int8_k_grouping(bias_kind):
  # k-grouping (the weight-gradient case): out[g] = (x[:, K_g] W[K_g]) * sx * sw (+ b[g]).
  x, w, fbias = operands(8, "k")
  xq = quantize(x, jnp.int8, channelwise_axes=(0,))
  wq = quantize(w, jnp.int8, channelwise_axes=(1,))
  ibias = np.random.default_rng(9).integers(-100, 100, (G, N)).astype(np.int32)
  bias = {"none": None, "int32": ibias, "float": fbias}[bias_kind]
  got = gmm_jax.gmm(xq, wq, K_SIZES, group_type="k", bias=bias)
  acc = np_gmm(np.asarray(xq.qvalue, np.float64), np.asarray(wq.qvalue, np.float64),
               K_SIZES, "k", bias=ibias if bias_kind == "int32" else None)
  want = acc * np.asarray(xq.scale, np.float64)[None] * np.asarray(wq.scale, np.float64)[None]
  if bias_kind == "float":
    want = want + fbias[:, None, :]
  check(got, want, K_SIZES, "k", rtol=1e-5)


@pytest.mark.parametrize("group_type", ["m", "k"])
@pytest.mark.parametrize("dtype, budget", [("float8_e4m3fn", "MX fp8 e4m3"),
                                           ("float8_e5m2", "MX fp8 e5m2"),
                                           ("float4_e2m1fn", "MX fp4 e2m1")])
def test_mx(group_type, dtype, budget):
  # MX: fp8/fp4 values with e8m0 scales per 32 along K, both operands:
  #   y[m, n] = sum_j (sum_t x[m, 32j+t] w[32j+t, n]) * sx[m, j] * sw[j, n] (+ bias)
  x, w, bias = operands(10, group_type)
  e8m0 = jnp.float8_e8m0fnu
  xq = quantize(x, dtype, channelwise_axes=(0,), tiled_axes={1: 32}, scale_dtype=e8m0)
  w_axes = (0, 2) if group_type == "m" else (1,)
  w_tiled = {1: 32} if group_type == "m" else {0: 32}
  wq = quantize(w, dtype, channelwise_axes=w_axes, tiled_axes=w_tiled, scale_dtype=e8m0)
  sizes = SIZES if group_type == "m" else K_SIZES
  with_bias = dtype == "float4_e2m1fn"  # Ascend: bias only with fp4
  got = gmm_jax.gmm(xq, wq, sizes, group_type=group_type,
                    bias=bias if with_bias else None)
  xv, wv = (np.asarray(q.qvalue.astype(jnp.float32), np.float64) for q in (xq, wq))
  sx = np.asarray(xq.scale.astype(jnp.float32), np.float64)  # [M, K/32]
  sw = np.asarray(wq.scale.astype(jnp.float32), np.float64)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  if group_type == "m":
    want = np.zeros((M, N))
    for g in range(G):
      for r in range(bounds[g], bounds[g + 1]):
        for j in range(K // 32):
          block = slice(32 * j, 32 * (j + 1))
          want[r] += (xv[r, block] @ wv[g, block]) * sx[r, j] * sw[g, j]
        if with_bias:
          want[r] += bias[g]
  else:
    want = np.zeros((G, M, N))
    for g in range(G):
      for col in range(bounds[g], bounds[g + 1]):  # block of column `col` is col // 32
        j = col // 32
        want[g] += np.outer(xv[:, col] * sx[:, j], wv[col] * sw[j])
      if with_bias:
        want[g] += bias[g]
  check(got, want, sizes, group_type, rtol=1e-5)
  if budget:
    reference = np_gmm(x, w, sizes, group_type, bias=bias if with_bias else None)
    if group_type == "m":
      reference = reference * row_mask(sizes, M)
    assert rel_error(got, reference) <= BUDGETS[budget]


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_gb(group_type):
  # G-B: activations per-group 1x128, weights per-block 128x128, f32 scales (K=N=256 so
  # there are two blocks each way; one group spans a block boundary).
  rng = np.random.default_rng(11)
  m, k, n = 24, 256, 256
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((G, k, n) if group_type == "m" else (k, n)) / 16).astype(
      np.float32)
  sizes = [5, 0, 11, 6] if group_type == "m" else [100, 0, 90, 60]
  fp8 = jnp.float8_e4m3fn
  xq = quantize(x, fp8, channelwise_axes=(0,), tiled_axes={1: 128})
  wq = (quantize(w, fp8, channelwise_axes=(0,), tiled_axes={1: 128, 2: 128})
        if group_type == "m" else quantize(w, fp8, tiled_axes={0: 128, 1: 128}))
  got = gmm_jax.gmm(xq, wq, sizes, group_type=group_type)
  xv, wv = (np.asarray(q.qvalue.astype(jnp.float32), np.float64) for q in (xq, wq))
  sx, sw = np.asarray(xq.scale, np.float64), np.asarray(wq.scale, np.float64)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  if group_type == "m":
    want = np.zeros((m, n))
    for g in range(G):
      rows = slice(bounds[g], bounds[g + 1])
      for j in range(2):
        kb = slice(128 * j, 128 * (j + 1))
        for b in range(2):
          nb = slice(128 * b, 128 * (b + 1))
          want[rows, nb] += (xv[rows, kb] @ wv[g, kb, nb]) * sx[rows, j:j + 1] * sw[g, j, b]
  else:
    want = np.zeros((G, m, n))
    for g in range(G):
      for col in range(bounds[g], bounds[g + 1]):
        j = col // 128
        want[g] += np.outer(xv[:, col] * sx[:, j], wv[col] * np.repeat(sw[j], 128))
  check(got, want, sizes, group_type, rtol=1e-5)
  reference = np_gmm(x, w, sizes, group_type)
  if group_type == "m":
    reference = reference * row_mask(sizes, m)
  assert rel_error(got, reference) <= BUDGETS["G-B fp8 e4m3"]


def test_a8w4_matches_the_ascend_formula():
  # Ascend A8W4: y = ((x - 8) @ w * scale + bias) * per_token_scale, with the offline bias
  # bias[n] = 8 * sum_k w[k, n] * scale[k // 256, n] cancelling the shift. In gmm_jax terms
  # it is int8 per-token activations x int4 weights with per-group (256) x per-channel
  # scales: the blocked mode.
  rng = np.random.default_rng(12)
  m, k, n = 20, 512, 16
  xv = rng.integers(-128, 128, (m, k)).astype(np.int8)
  wv = rng.integers(-8, 8, (G, k, n)).astype(np.int8)
  scale = rng.uniform(0.001, 0.01, (G, k // 256, n)).astype(np.float32)
  per_token = rng.uniform(0.01, 0.1, (m, 1)).astype(np.float32)
  sizes = [6, 0, 9, 3]
  xq = QArray(jnp.asarray(xv), jnp.asarray(per_token))
  wq = QArray(jnp.asarray(wv, jnp.int4), jnp.asarray(scale))
  got = gmm_jax.gmm(xq, wq, sizes, preferred_element_type=jnp.float32)
  w_scaled = wv.astype(np.float64) * np.repeat(scale.astype(np.float64), 256, axis=1)
  ascend_bias = 8.0 * w_scaled.sum(axis=1)  # [G, N]
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  want = np.zeros((m, n))
  for g in range(G):
    rows = slice(bounds[g], bounds[g + 1])
    want[rows] = ((xv[rows].astype(np.float64) - 8.0) @ w_scaled[g] + ascend_bias[g]) * (
        per_token[rows])
  check(got, want, sizes, rtol=1e-5)


def test_a8w4_accuracy_budget():
  x, w, _ = operands(13)
  w = np.concatenate([w, w], axis=1)[:, :256]  # K = 256 = one quant group
  x = np.concatenate([x, x], axis=1)[:, :256]
  got = gmm_jax.gmm(quantize(x, jnp.int8, channelwise_axes=(0,)),
                    quantize(w, jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: 256}), SIZES)
  assert rel_error(got, np_gmm(x, w, SIZES) * row_mask(SIZES, M)) <= BUDGETS["A8W4"]


# Default run: each activation once, the modes and group types in turn (the finishing step
# after the quantized product is one function); all 30 cases with -m slow.
@covering(("activation", ["relu", "gelu_tanh", "fast_gelu", "silu", "gelu"]),
          ("mode", ["weight_only", "scaled", "blocked"]), ("group_type", ["m", "k"]))
def test_activation_in_every_mode(mode, activation, group_type):
  # activation(dequantized lhs @ dequantized rhs + bias) in numpy, one group at a time.
  x, w, bias = operands(14, group_type)
  sizes = SIZES if group_type == "m" else K_SIZES
  lhs, rhs, extra, lhs_values, rhs_values = mode_operands(mode, group_type, x, w)
  got = gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, bias=bias, activation=activation,
                    **extra)
  want = gmm_oracle(lhs_values, rhs_values, sizes, group_type, bias=bias,
                    activation=activation)
  check_quantized(got, want, lhs_values, rhs_values, sizes, group_type)


def test_group_offset_with_quantized_weights():
  x, w, bias = operands(15)
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  local = QArray(wq.qvalue[1:3], wq.scale[1:3])
  got = gmm_jax.gmm(x, local, SIZES, group_offset=1, bias=bias[1:3])
  full = np.asarray(gmm_jax.gmm(x, wq, SIZES, bias=bias))
  owned = np.zeros((M, 1), bool)
  owned[SIZES[0]:SIZES[0] + SIZES[1] + SIZES[2]] = True
  np.testing.assert_allclose(got, np.where(owned, full, 0.0), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ dynamic quantization, grads


@pytest.mark.parametrize("lhs_spec, rhs_layout", [
    (QuantSpec(jnp.int8), "per-tensor"),                          # T-T
    (QuantSpec(jnp.int8), "per-channel"),                         # T-C
    (QuantSpec(jnp.int8, channelwise_axes=(0,)), "per-tensor"),    # K-T
    (QuantSpec(jnp.int8, channelwise_axes=(0,)), "per-channel"),   # K-C
])
def test_dynamic_quantization_equals_quantize_then_gmm(lhs_spec, rhs_layout):
  x, w, bias = operands(16)
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2) if rhs_layout == "per-channel" else (0,))
  got = jax.jit(lambda x: gmm_jax.gmm(x, wq, SIZES, bias=bias, quantize_lhs=lhs_spec))(x)
  want = gmm_jax.gmm(lhs_spec(x), wq, SIZES, bias=bias)
  np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)  # jit may fuse differently
  assert rel_error(got, np_gmm(x, w, SIZES, bias=bias) * row_mask(SIZES, M)) < 0.02


def test_weight_only_gradients_wrt_x_and_bias():
  x, w, bias = operands(17)
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  cot = np.random.default_rng(18).standard_normal((M, N)).astype(np.float32)

  def loss(fn):
    return lambda x, b: jnp.sum(fn(x, b) * cot)

  got = jax.grad(loss(lambda x, b: gmm_jax.gmm(x, wq, SIZES, bias=b, activation="silu")),
                 argnums=(0, 1))(x, bias)
  want = jax.grad(loss(lambda x, b: gmm_jax.gmm(x, dequantize(wq), SIZES, bias=b,
                                                activation="silu", implementation="reference")),
                  argnums=(0, 1))(x, bias)
  for g, w_ in zip(got, want):
    np.testing.assert_allclose(g, w_, rtol=1e-5, atol=1e-5)
  jax.test_util.check_grads(
      lambda x, b: gmm_jax.gmm(x, wq, SIZES, bias=b, activation="silu"), (x, bias), order=1,
      modes=("rev",), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_dynamic_straight_through_gradients(group_type):
  # STE: the gradients w.r.t. the float inputs are the float gmm's, taken at the
  # dequantized operands.
  x, w, bias = operands(19, group_type)
  sizes = SIZES if group_type == "m" else K_SIZES
  lspec = QuantSpec(jnp.int8, channelwise_axes=(0,))
  rspec = QuantSpec(jnp.int8, channelwise_axes=(0, 2) if group_type == "m" else (1,))
  shape = (M, N) if group_type == "m" else (G, M, N)
  cot = np.random.default_rng(20).standard_normal(shape).astype(np.float32)

  def q_loss(x, w, b):
    return jnp.sum(gmm_jax.gmm(x, w, sizes, group_type=group_type, bias=b, activation="silu",
                               quantize_lhs=lspec, quantize_rhs=rspec) * cot)

  def f_loss(x, w, b):
    return jnp.sum(gmm_jax.gmm(x, w, sizes, group_type=group_type, bias=b, activation="silu",
                               implementation="reference") * cot)

  got = jax.jit(jax.grad(q_loss, argnums=(0, 1, 2)))(x, w, bias)
  at = (dequantize(lspec(x)), dequantize(rspec(w)), bias)
  want = jax.grad(f_loss, argnums=(0, 1, 2))(*at)
  for g, w_ in zip(got, want):
    np.testing.assert_allclose(g, w_, rtol=1e-4, atol=1e-4)
  # Without the estimator the quantized inputs get no gradient (the bias still does).
  no_ste = jax.grad(lambda x, b: jnp.sum(gmm_jax.gmm(
      x, w, sizes, group_type=group_type, bias=b, quantize_lhs=lspec, quantize_rhs=rspec,
      straight_through=False) * cot), argnums=(0, 1))(x, bias)
  np.testing.assert_array_equal(no_ste[0], 0.0)
  assert np.abs(np.asarray(no_ste[1])).max() > 0


def test_traced_group_sizes_one_compilation():
  x, w, _ = operands(21)
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  traces = []

  @jax.jit
  def f(x, sizes):
    traces.append(1)
    return gmm_jax.gmm(x, wq, sizes, quantize_lhs=QuantSpec(jnp.int8, channelwise_axes=(0,)))

  for sizes in ([10, 0, 17, 9], [0, 40, 0, 0], [1, 2, 3, 4]):
    got = f(x, jnp.asarray(sizes, jnp.int32))
    want = gmm_jax.gmm(quantize(x, jnp.int8, channelwise_axes=(0,)), wq, sizes)
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
  assert len(traces) == 1


# ------------------------------------------------------------------- qwix and the errors


def test_qwix_style_qarray_is_accepted(monkeypatch):
  # gmm reads any object named QArray from a qwix module by its qvalue/scale/zero_point
  # (qwix's own convention): a stand-in with that shape, so this runs without qwix.
  module = types.ModuleType("qwix._src.core.qarray")

  class QwixQArray:  # the attributes of qwix's QArray
    def __init__(self, qvalue, scale, zero_point=None):
      self.qvalue, self.scale, self.zero_point = qvalue, scale, zero_point

  QwixQArray.__name__ = "QArray"
  QwixQArray.__module__ = module.__name__
  monkeypatch.setitem(sys.modules, module.__name__, module)
  x, w, _ = operands(22)
  ours = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  theirs = QwixQArray(ours.qvalue, ours.scale)
  np.testing.assert_array_equal(gmm_jax.gmm(x, theirs, SIZES), gmm_jax.gmm(x, ours, SIZES))


def test_real_qwix_qarray():
  qwix_qarray = pytest.importorskip("qwix._src.core.qarray")
  x, w, _ = operands(23)
  how = qwix_qarray.HowToQuantize(qtype=jnp.int8, channelwise_axes=(0, 2))
  theirs = qwix_qarray.quantize(jnp.asarray(w), how)
  got = gmm_jax.gmm(x, theirs, SIZES)
  want = np_gmm(x, np.asarray(qwix_qarray.dequantize(theirs), np.float64), SIZES)
  check(got, want * row_mask(SIZES, M), rtol=1e-5)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, wq, xq: gmm_jax.gmm(xq, jnp.asarray(operands()[1]), SIZES), NotImplementedError,
     "a quantized lhs needs a quantized rhs"),
    (lambda x, wq, xq: gmm_jax.gmm(x, wq, SIZES, quantize_lhs="int8"), ValueError,
     "QuantSpec"),
    (lambda x, wq, xq: gmm_jax.gmm(xq, wq, SIZES, quantize_lhs=QuantSpec(jnp.int8)),
     ValueError, "needs a float lhs"),
    (lambda x, wq, xq: gmm_jax.gmm(x, wq, SIZES, output_scale=np.ones((3, N))), ValueError,
     r"output_scale must be .*got \[3, 24\]"),
    (lambda x, wq, xq: gmm_jax.gmm(x, x[:4, :, None], SIZES, output_offset=1.0),
     (ValueError, NotImplementedError), "output_scale/output_offset|contraction"),
    (lambda x, wq, xq: gmm_jax.gmm(x, wq, SIZES, bias=np.ones((G, N), np.int32)),
     NotImplementedError, "int32 bias needs integer operands"),
    (lambda x, wq, xq: gmm_jax.gmm(
        quantize(x, jnp.float8_e4m3fn), wq, SIZES), NotImplementedError,
     "mixed integer and float quantized values"),
    (lambda x, wq, xq: gmm_jax.gmm(
        quantize(x, jnp.int8, channelwise_axes=(0,), tiled_axes={1: 32}), wq, SIZES,
        bias=np.ones((G, N), np.int32)), NotImplementedError, "constant along K"),
])
def test_quantized_errors(call, error, match):
  x, w, _ = operands()
  with pytest.raises(error, match=match):
    call(x, quantize(w, jnp.int8, channelwise_axes=(0, 2)),
         quantize(x, jnp.int8, channelwise_axes=(0,)))


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@pytest.mark.parametrize("group_type", ["m", "k"])
@pytest.mark.parametrize("mode", ["weight_only", "scaled", "blocked", "dynamic"])
def test_every_mode_on_both_jnp_paths_matches_oracle(group_type, mode, implementation):
  # Every mode on both jnp paths (the composition picks the inner implementation), each
  # against numpy rather than against the other: they share quantized._composed.
  x, w, bias = operands(24, group_type)
  sizes = SIZES if group_type == "m" else K_SIZES
  lhs, rhs, extra, lhs_values, rhs_values = mode_operands(mode, group_type, x, w)
  got = gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, bias=bias, activation="relu",
                    implementation=implementation, **extra)
  want = gmm_oracle(lhs_values, rhs_values, sizes, group_type, bias=bias, activation="relu")
  check_quantized(got, want, lhs_values, rhs_values, sizes, group_type)


def _stacked(qarrays):
  """QArrays of one layout stacked along a new leading (batch) axis."""
  return jax.tree.map(lambda *leaves: jnp.stack(leaves), *qarrays)


VMAP_B = 3


# Default run: 6 of the 18 cases (each mode over two of the axes, each axis in two modes,
# both group types); the rest with -m slow.
@covering(("mode", ["weight_only", "scaled", "dynamic"]), ("axis", ["lhs", "rhs", "both"]),
          ("group_type", ["m", "k"]), keep=[(0, 2, 1), (1, 0, 0), (2, 1, 1)])
def test_vmap_of_quantized_gmm_matches_oracle(mode, axis, group_type):
  # vmap over a (QArray) lhs, a QArray rhs, or both, each example against numpy.
  rng = np.random.default_rng(30)
  sizes = SIZES if group_type == "m" else K_SIZES
  examples = [mode_operands(mode, group_type, *operands(31 + b, group_type)[:2])
              for b in range(VMAP_B)]
  _, _, extra, _, _ = examples[0]
  bias = rng.standard_normal((G, N)).astype(np.float32)
  batch = lambda items: (_stacked(items) if isinstance(items[0], QArray)  # noqa: E731
                         else jnp.stack(items))
  lhs = batch([e[0] for e in examples]) if axis != "rhs" else examples[0][0]
  rhs = batch([e[1] for e in examples]) if axis != "lhs" else examples[0][1]
  in_axes = (0 if axis != "rhs" else None, 0 if axis != "lhs" else None)
  got = jax.vmap(lambda l, r: gmm_jax.gmm(l, r, sizes, group_type=group_type, bias=bias,
                                          activation="silu", **extra), in_axes=in_axes)(lhs, rhs)
  assert got.shape[0] == VMAP_B
  for b, example in enumerate(examples):
    lhs_values = example[3] if axis != "rhs" else examples[0][3]
    rhs_values = example[4] if axis != "lhs" else examples[0][4]
    want = gmm_oracle(lhs_values, rhs_values, sizes, group_type, bias=bias,
                      activation="silu")
    check_quantized(got[b], want, lhs_values, rhs_values, sizes, group_type)


@pytest.mark.parametrize("group_type", ["m", "k"])
@pytest.mark.parametrize("mode", ["weight_only", "scaled"])
def test_traced_group_offset_with_quantized_operands_matches_oracle(mode, group_type):
  # rhs holds 2 of the 4 groups ("m": a QArray of 2 experts; "k": 2 result groups), the
  # offset traced: one compilation for every offset, each against numpy.
  num_local = 2
  x, w, bias = operands(32, group_type)
  sizes = SIZES if group_type == "m" else K_SIZES
  w = w[:num_local] if group_type == "m" else w
  lhs, rhs, extra, lhs_values, rhs_values = mode_operands(mode, group_type, x, w)
  bias = bias[:num_local]
  traces = []

  @jax.jit
  def run(lhs, rhs, offset):
    traces.append(None)
    return gmm_jax.gmm(lhs, rhs, jnp.asarray(sizes, jnp.int32), group_type=group_type,
                       bias=bias, activation="silu", group_offset=offset,
                       num_groups=num_local if group_type == "k" else None, **extra)

  for offset in range(len(sizes) + 1):
    got = run(lhs, rhs, jnp.int32(offset))
    want = gmm_oracle(lhs_values, rhs_values, sizes, group_type, bias=bias,
                      activation="silu", group_offset=offset, num_local=num_local)
    check_quantized(got, want, lhs_values, rhs_values, sizes, group_type)
  assert len(traces) == 1


def test_vmap_over_group_offset_with_quantized_weights():
  x, w, bias = operands(33)
  lhs, rhs, _, lhs_values, rhs_values = mode_operands("weight_only", "m", x, w[:2])
  offsets = jnp.arange(len(SIZES) + 1, dtype=jnp.int32)
  got = jax.vmap(lambda offset: gmm_jax.gmm(lhs, rhs, SIZES, bias=bias[:2],
                                            group_offset=offset))(offsets)
  for offset in range(len(SIZES) + 1):
    want = gmm_oracle(lhs_values, rhs_values, SIZES, "m", bias=bias[:2], group_offset=offset,
                      num_local=2)
    check_quantized(got[offset], want, lhs_values, rhs_values, SIZES, "m")


@pytest.mark.parametrize("scale_dtype", ["bfloat16", "float16"])
def test_16bit_scales(scale_dtype):
  x, w, _ = operands(25)
  q = quantize(w, jnp.int8, channelwise_axes=(0, 2), scale_dtype=scale_dtype)
  assert q.scale.dtype == np.dtype(scale_dtype)
  got = gmm_jax.gmm(x, q, SIZES)
  check(got, np_gmm(x, np_dequantize(q), SIZES) * row_mask(SIZES, M), rtol=1e-5)
  assert rel_error(got, np_gmm(x, w, SIZES) * row_mask(SIZES, M)) <= 0.015


def _np_quantize_rows(x, dtype, bound, reciprocal=True):
  """numpy's f32 arithmetic of `quantize`'s formula, per row: scale = absmax times the f32
  reciprocal of the bound (1 for an all-zero row), values = x times the scale's f32
  reciprocal (`reciprocal`; else divided by it), rounded half to even (integers) or by the
  8-bit float cast (RNE), clipped."""
  x = np.asarray(x, np.float32)
  scale = np.max(np.abs(x), axis=1, keepdims=True) * (np.float32(1) / np.float32(bound))
  scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
  scaled = (x * (np.float32(1) / scale) if reciprocal else x / scale).astype(np.float32)
  if np.issubdtype(dtype, np.integer):
    info = np.iinfo(dtype)
    return np.clip(np.round(scaled), info.min, info.max).astype(dtype), scale
  top = float(ml_dtypes.finfo(dtype).max)
  return np.clip(scaled, -top, top).astype(dtype), scale


def _ties(dtype, bound, rng):
  """Rows whose values sit on rounding ties in units of their scale: halves (integers) or
  midpoints between neighbouring 8-bit floats, times each row's scale, and the row's
  absmax at the bound (so its scale is absmax times the bound's reciprocal)."""
  if np.issubdtype(dtype, np.integer):
    steps = rng.integers(-254, 255, size=(64, 127)) / 2.0
  else:  # a positive 8-bit float below the largest and the next one (its bits plus one)
    grid = np.float32(ml_dtypes.finfo(dtype).max) * rng.uniform(0.01, 0.9, size=(64, 127))
    below = grid.astype(dtype)
    above = (below.view(np.uint8) + np.uint8(1)).view(dtype)
    steps = (below.astype(np.float64) + above.astype(np.float64)) / 2
    steps = steps * rng.choice([-1.0, 1.0], size=steps.shape)
  absmax = rng.uniform(0.5, 4.0, size=(64, 1))
  scale = (absmax.astype(np.float32) * (np.float32(1) / np.float32(bound))).astype(np.float32)
  x = np.concatenate([absmax, steps * scale], axis=1).astype(np.float32)
  x[3] = 0.0  # an all-zero row: scale 1
  return x


@pytest.mark.parametrize("dtype, bound", [
    (np.dtype(np.int8), 127.5), (np.dtype(np.int8), None),
    (np.dtype(ml_dtypes.float8_e4m3fn), None), (np.dtype(ml_dtypes.float8_e5m2), None)])
def test_quantized_bits_are_the_formulas_on_every_jax(dtype, bound):
  """The same bits on every supported jax: `quantize` writes its divisions as products with
  f32 reciprocals (XLA rewrote a division by a broadcast scale into that product up to jax
  0.12.0.1 and divides exactly from 0.12.1), so numpy's f32 arithmetic of the formula is
  met bit for bit. The values sit on rounding ties (halves of the scale with qwix's int8
  bound 127.5, midpoints between 8-bit floats), where dividing instead rounds some of them
  the other way: the data holds such values, so a quantizer that divided would fail here
  on the jax that divides exactly."""
  top = bound if bound is not None else (
      float(np.iinfo(dtype).max) if np.issubdtype(dtype, np.integer)
      else float(ml_dtypes.finfo(dtype).max))
  x = _ties(dtype, top, np.random.default_rng(41))
  values, scale = _np_quantize_rows(x, dtype, top)
  divided, _ = _np_quantize_rows(x, dtype, top, reciprocal=False)
  assert np.sum(values.view(np.uint8) != divided.view(np.uint8)) >= 10  # ties that matter
  got = quantize(jnp.asarray(x), jnp.dtype(dtype), channelwise_axes=(0,), bound=bound)
  np.testing.assert_array_equal(np.asarray(got.scale).reshape(scale.shape), scale)
  np.testing.assert_array_equal(np.asarray(got.qvalue).view(np.uint8), values.view(np.uint8))
