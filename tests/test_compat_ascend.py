"""gmm_jax.compat.ascend against float64 numpy oracles written from Ascend GroupedMatmul's
formulas (spec section 5) for the implemented scenarios, and its first-phase rejections."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax.compat import ascend
from oracle import ascend_act as np_act

RNG = np.random.default_rng(0)


def np_split_m(x, w, sizes, experts=None, bias=None):
  """Rows consumed in order: entry i takes the next sizes[i] rows with weight experts[i]."""
  x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
  out = np.zeros((x.shape[0], w.shape[-1]))
  start = 0
  for i, size in enumerate(sizes):
    e = i if experts is None else experts[i]
    out[start:start + size] = x[start:start + size] @ w[e] + (0 if bias is None else bias[e])
    start += size
  return out


def f64(a):
  return np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)


# ------------------------------------------------------------------------------ non-quant


def test_worked_example_three_list_types():
  # M=789, E=9: experts 0, 2, 5 get 123, 333, 333 tokens (K, N reduced to keep it quick).
  k, n = 64, 32
  x = RNG.standard_normal((789, k)).astype(np.float32)
  w = RNG.standard_normal((9, k, n)).astype(np.float32)
  lists = {
      0: np.array([123, 123, 456, 456, 456, 789, 789, 789, 789], np.int64),
      1: np.array([123, 0, 333, 0, 0, 333, 0, 0, 0], np.int64),
      2: np.array([[0, 123], [2, 333], [5, 333], [1, 0], [3, 0], [4, 0], [6, 0], [7, 0],
                   [8, 0]], np.int64),
  }
  want = np_split_m(x, w, [123, 0, 333, 0, 0, 333, 0, 0, 0])
  for list_type, group_list in lists.items():
    (y,) = ascend.grouped_matmul(x, w, group_list=group_list, group_list_type=list_type,
                                 split_item=3, group_type=0)
    assert y.shape == (789, n)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_sparse_list_order_and_stop_at_first_empty_entry():
  x = RNG.standard_normal((24, 8)).astype(np.float32)
  w = RNG.standard_normal((4, 8, 5)).astype(np.float32)
  b = RNG.standard_normal((4, 5)).astype(np.float32)
  # Expert 2 first, then 0; the empty entry stops processing, so [3, 4] is never used.
  group_list = np.array([[2, 10], [0, 5], [1, 0], [3, 4]], np.int64)
  (y,) = ascend.grouped_matmul(x, w, bias=b, group_list=group_list, group_list_type=2,
                               split_item=2, group_type=0)
  want = np_split_m(x, w, [10, 5], experts=[2, 0], bias=b)
  np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(y)[15:], 0.0)  # decided: rows past the total


@pytest.mark.parametrize("act_type", [0, 1, 2, 4, 5])
def test_single_tensors_m_grouping_with_activation(act_type):
  x = RNG.standard_normal((20, 16)).astype(np.float32)
  w = RNG.standard_normal((3, 16, 8)).astype(np.float32)
  b = RNG.standard_normal((3, 8)).astype(np.float32)
  (y,) = ascend.grouped_matmul([x], [w], bias=[b], group_list=np.array([6, 6, 17]),
                               split_item=3, group_type=0, act_type=act_type)
  want = np_act(np_split_m(x, w, [6, 0, 11], bias=b), act_type)
  want[17:] = 0.0
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


def test_s_m_s_and_m_m_s():
  w_list = [RNG.standard_normal((16, 8)).astype(np.float32) for _ in range(3)]
  x = RNG.standard_normal((12, 16)).astype(np.float32)
  (y,) = ascend.grouped_matmul(x, w_list, group_list=np.array([4, 0, 8]), group_list_type=1,
                               split_item=2, group_type=0)
  np.testing.assert_allclose(y, np_split_m(x, np.stack(w_list), [4, 0, 8]), rtol=1e-5,
                             atol=1e-5)
  x_list = [x[:4], x[4:4], x[4:]]
  (y2,) = ascend.grouped_matmul(x_list, w_list, split_item=2, group_type=0)
  np.testing.assert_allclose(y2, y, rtol=1e-6, atol=1e-6)


def test_no_grouping_lists_of_matrices():
  xs = [RNG.standard_normal((2, 3, 16)).astype(np.float32),
        RNG.standard_normal((5, 12)).astype(np.float32)]
  ws = [RNG.standard_normal((16, 8)).astype(np.float32),
        RNG.standard_normal((12, 4)).astype(np.float32)]
  bs = [RNG.standard_normal((8,)).astype(np.float32), RNG.standard_normal((4,)).astype(
      np.float32)]
  ys = ascend.grouped_matmul(xs, ws, bias=bs, group_type=-1, split_item=0)
  assert [y.shape for y in ys] == [(2, 3, 8), (5, 4)]  # leading dims of x kept
  for y, x, w, b in zip(ys, xs, ws, bs):
    np.testing.assert_allclose(y, x.astype(np.float64) @ w + b, rtol=1e-5, atol=1e-5)


def test_k_grouping_single_and_multi_weights():
  m, n = 6, 5
  x = RNG.standard_normal((m, 30)).astype(np.float32)  # logical [M, K]
  w = RNG.standard_normal((30, n)).astype(np.float32)
  (y,) = ascend.grouped_matmul(x, w, group_list=np.array([10, 10, 25]), split_item=3,
                               group_type=2)
  assert y.shape == (3, m, n)
  np.testing.assert_allclose(y[0], x[:, :10].astype(np.float64) @ w[:10], rtol=1e-5,
                             atol=1e-5)
  np.testing.assert_array_equal(y[1], 0.0)  # an empty K group is zero-filled
  np.testing.assert_allclose(y[2], x[:, 10:25].astype(np.float64) @ w[10:25], rtol=1e-5,
                             atol=1e-5)
  ys = ascend.grouped_matmul(x, [w[:10], w[10:25]], split_item=0, group_type=2)  # S-M-M
  assert len(ys) == 2
  np.testing.assert_allclose(ys[1], y[2], rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------------------- quantized


@pytest.mark.parametrize("weight_type, per_group", [("int8", False), ("int4", False),
                                                    ("int4", True)])
def test_weight_only_antiquant(weight_type, per_group):
  # y = x @ ((W + offset) * scale) + b, bf16 activations, bf16 scale/offset.
  e, k, n = 3, 64, 8
  x = jnp.asarray(RNG.standard_normal((20, k)), jnp.bfloat16)
  low, high = (-128, 128) if weight_type == "int8" else (-8, 8)
  w = jnp.asarray(RNG.integers(low, high, (e, k, n)), weight_type)
  groups = 2 if per_group else None
  shape = (e, groups, n) if per_group else (e, n)
  scale = jnp.asarray(RNG.uniform(0.01, 0.05, shape), jnp.bfloat16)
  offset = jnp.asarray(RNG.integers(-3, 4, shape), jnp.bfloat16)
  b = jnp.asarray(RNG.standard_normal((e, n)), jnp.float32)
  (y,) = ascend.grouped_matmul(x, w, bias=b, antiquant_scale=scale, antiquant_offset=offset,
                               group_list=np.array([7, 7, 19]), split_item=3, group_type=0)
  assert y.dtype == jnp.bfloat16
  s, o = f64(scale), f64(offset)
  if per_group:
    s, o = np.repeat(s, k // groups, axis=1), np.repeat(o, k // groups, axis=1)
  else:
    s, o = s[:, None, :], o[:, None, :]
  w_deq = (f64(w) + o) * s
  w_bf16 = f64(jnp.asarray(w_deq, jnp.bfloat16))  # the weights are dequantized to bf16
  want = np_split_m(f64(x), w_bf16, [7, 0, 12], bias=f64(b))
  want[19:] = 0.0
  np.testing.assert_allclose(f64(y), want, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("bias_kind", ["none", "int32", "float"])
@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("per_tensor", [False, True])
def test_a8w8(bias_kind, dynamic, per_tensor):
  # static: y = (x W [+ b_int32]) * scale [+ b_float]; dynamic: also * per_token_scale.
  e, k, n, m = 3, 32, 8, 20
  x = jnp.asarray(RNG.integers(-128, 128, (m, k)), jnp.int8)
  w = jnp.asarray(RNG.integers(-128, 128, (e, k, n)), jnp.int8)
  scale = RNG.uniform(1e-4, 1e-3, (e,) if per_tensor else (e, n)).astype(np.float32)
  pts = RNG.uniform(0.5, 2.0, (m,)).astype(np.float32) if dynamic else None
  bias = {"none": None,
          "int32": RNG.integers(-1000, 1000, (e, n)).astype(np.int32),
          "float": RNG.standard_normal((e, n)).astype(np.float32)}[bias_kind]
  (y,) = ascend.grouped_matmul(x, w, bias=bias, scale=scale, per_token_scale=pts,
                               group_list=np.array([5, 5, 18]), split_item=3, group_type=0,
                               act_type=5, output_dtype=jnp.bfloat16)
  sizes = [5, 0, 13]
  acc = np_split_m(f64(x), f64(w), sizes, bias=bias if bias_kind == "int32" else None)
  s = np.broadcast_to(scale.reshape(e, -1), (e, n))
  groups = np.repeat(np.arange(e), sizes)
  want = np.zeros((m, n))
  want[:18] = acc[:18] * s[groups]
  if dynamic:
    want[:18] *= pts[:18, None]
  if bias_kind == "float":
    want[:18] += bias[groups]
  want = np_act(want, 5)
  want[18:] = 0.0
  assert y.dtype == jnp.bfloat16  # f32 output is not in Ascend's A8W8 tables
  np.testing.assert_allclose(f64(y), want, rtol=1e-2, atol=1e-2 * np.abs(want).max())


def test_a8w8_int32_output():
  x = jnp.asarray(RNG.integers(-128, 128, (10, 16)), jnp.int8)
  w = jnp.asarray(RNG.integers(-128, 128, (2, 16, 4)), jnp.int8)
  b = RNG.integers(-100, 100, (2, 4)).astype(np.int32)
  (y,) = ascend.grouped_matmul(x, w, bias=b, group_list=np.array([4, 10]), split_item=3,
                               group_type=0)
  assert y.dtype == jnp.int32
  np.testing.assert_array_equal(y, np_split_m(f64(x), f64(w), [4, 6], bias=b))


def test_jit_with_traced_group_list():
  x = RNG.standard_normal((12, 8)).astype(np.float32)
  w = RNG.standard_normal((3, 8, 4)).astype(np.float32)
  f = jax.jit(lambda x, w, gl: ascend.grouped_matmul(x, w, group_list=gl, split_item=3,
                                                     group_type=0, group_list_type=1)[0])
  np.testing.assert_allclose(f(x, w, jnp.asarray([3, 0, 9], jnp.int32)),
                             np_split_m(x, w, [3, 0, 9]), rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------- rejections

X = np.zeros((8, 16), np.float32)
W = np.zeros((2, 16, 4), np.float32)
GL = np.array([4, 8], np.int64)


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(group_type=1, split_item=3, group_list=GL), ValueError, "split-N"),
    (dict(group_type=7, split_item=3, group_list=GL), ValueError, "-1, 0 or 2"),
    (dict(group_type=0, split_item=5, group_list=GL), ValueError, "split_item must be 0-3"),
    (dict(group_type=-1, split_item=2, x=[X], weight=[W[0]]), ValueError, "needs group_type"),
    (dict(group_type=-1, split_item=0, x=[X], weight=[W[0]], group_list=GL), ValueError,
     "must be null"),
    (dict(group_type=0, split_item=0, group_list=GL), ValueError, "split_item 2 or 3"),
    (dict(group_type=0, split_item=3), ValueError, "needs a group_list"),
    (dict(group_type=0, split_item=3, group_list=GL, act_type=3), ValueError, "GELU_ERR"),
    (dict(group_type=0, split_item=3, group_list=GL, act_type=6), ValueError, "0-5"),
    (dict(group_type=0, split_item=3, group_list=np.array([4, 4, 8])), ValueError,
     "3 entries but there are 2 groups"),
    (dict(group_type=0, split_item=3, group_list=np.array([[0, 4, 1], [1, 4, 1]]),
          group_list_type=2), ValueError, r"must be \[E, 2\]"),
    (dict(group_type=0, split_item=3, group_list=np.ones(1025, np.int64)), ValueError,
     "at most 1024"),
    (dict(group_type=0, split_item=3, group_list=np.array([4, 12]), group_list_type=0),
     ValueError, "covers 12 rows, more than x's 8"),
    (dict(group_type=0, split_item=3, group_list=GL, bias=[np.zeros((2, 4))] * 3),
     ValueError, "bias has 3 tensors"),
    (dict(group_type=2, split_item=3, x=X, weight=W[0], group_list=GL,
          bias=np.zeros((2, 4))), ValueError, "bias must be null"),
    (dict(group_type=0, split_item=3, x=[], group_list=GL), ValueError, "empty list"),
    (dict(group_type=-1, split_item=0, x=[np.zeros((1,) * 7)], weight=[W[0]]), ValueError,
     "2-6-D"),
    (dict(group_type=0, split_item=3, group_list=GL,
          weight=np.zeros((2, 16, 3), jnp.int4), x=X.astype(jnp.bfloat16),
          antiquant_scale=np.ones((2, 3))), ValueError, "even last dimension"),
    (dict(group_type=0, split_item=3, group_list=GL,
          weight=np.zeros((2, 16, 4), np.int8), x=X.astype(jnp.bfloat16)), ValueError,
     "needs antiquant_scale"),
    (dict(group_type=0, split_item=3, group_list=GL, x=np.zeros((8, 12), np.float32)),
     ValueError, "K=12"),
])
def test_first_phase_rejections(kwargs, error, match):
  kwargs = dict(kwargs)
  x = kwargs.pop("x", X)
  weight = kwargs.pop("weight", W)
  with pytest.raises(error, match=match):
    ascend.grouped_matmul(x, weight, **kwargs)


def test_last_dim_limit():
  with pytest.raises(ValueError, match="< 65536"):
    ascend.grouped_matmul(np.zeros((2, 4), np.float32),
                          np.zeros((1, 4, 65536), np.float32), group_list=np.array([2]),
                          split_item=3, group_type=0)


# ------------------------------------------------- scenario rules (sections 3, 6, 7, 8, 9)

_K, _N = 256, 8
_XQ = {"f32": np.zeros((8, _K), np.float32), "bf16": jnp.zeros((8, _K), jnp.bfloat16),
       "f16": jnp.zeros((8, _K), jnp.float16), "i8": jnp.zeros((8, _K), jnp.int8),
       "i4": jnp.zeros((8, _K), jnp.int4), "fp8": jnp.zeros((8, _K), jnp.float8_e4m3fn),
       "fp4": jnp.zeros((8, _K), jnp.float4_e2m1fn), "u8": jnp.zeros((8, _K), jnp.uint8)}
_WQ = {"f32": np.zeros((2, _K, _N), np.float32), "bf16": jnp.zeros((2, _K, _N), jnp.bfloat16),
       "i8": jnp.zeros((2, _K, _N), jnp.int8), "i4": jnp.zeros((2, _K, _N), jnp.int4),
       "fp8": jnp.zeros((2, _K, _N), jnp.float8_e5m2),
       "fp4": jnp.zeros((2, _K, _N), jnp.float4_e2m1fn),
       "fp8t": jnp.zeros((2, _N, _K), jnp.float8_e5m2)}
_F32 = lambda *shape: np.ones(shape, np.float32)  # noqa: E731
_PK = lambda *shape: ascend.trans_quant_param(np.ones(shape))  # noqa: E731
_E8 = lambda *shape: jnp.ones(shape, jnp.float8_e8m0fnu)  # noqa: E731
_BF = lambda *shape: jnp.ones(shape, jnp.bfloat16)  # noqa: E731
_A8W4 = dict(scale=_PK(2, 1, _N), bias=_F32(2, _N), per_token_scale=_F32(8), group_list_type=1,
             group_list=np.array([4, 4]))


@pytest.mark.parametrize("x, w, kwargs, match", [
    # which (x, weight) pairs are scenarios at all
    ("f32", "i8", {}, "matches no Ascend scenario"),
    ("f16", "bf16", {}, "matches no Ascend scenario"),
    ("u8", "i8", {}, "HiFloat8 has no JAX dtype"),
    ("f32", "f32", dict(scale=_F32(2, _N)), "non-quant: scale and antiquant_scale must be null"),
    ("f32", "f32", dict(per_token_scale=_F32(8)), "per_token_scale must be null for non-quant"),
    ("f32", "f32", dict(output_dtype=jnp.float16), r"gives \['float32'\] output"),
    ("f32", "f32", dict(bias=np.zeros((2, _N), np.int32)), "takes a bias of"),
    ("bf16", "bf16", dict(bias=jnp.zeros((2, _N), jnp.float16)), "takes a bias of"),
    # weight-only
    ("bf16", "i8", dict(antiquant_scale=jnp.ones((2, _N), jnp.float16)), "must have x's dtype"),
    ("bf16", "i8", dict(antiquant_scale=_BF(2, _N), antiquant_offset=jnp.ones(
        (2, _N), jnp.float16)), "antiquant_offset must have x's dtype"),
    ("bf16", "i8", dict(antiquant_scale=_BF(2, _N), scale=_F32(2, _N)),
     "scale must be null for weight-only"),
    ("f16", "i8", dict(antiquant_scale=jnp.ones((2, _N), jnp.float16), bias=_F32(2, _N)),
     "takes a bias of"),
    ("bf16", "i8", dict(antiquant_scale=_BF(2, 3, _N)), "must split into 3 equal groups"),
    ("bf16", "fp8", dict(antiquant_scale=_BF(2, _N)), "needs a transposed weight"),
    ("bf16", "i4", dict(antiquant_scale=_BF(2, 256, _N), weight_transposed=True,
                        weight=jnp.zeros((2, _N, _K), jnp.int4)), "even per-group size"),
    ("f32", "f32", dict(group_list=np.array([[4], [8]])), "must be 1-D for type 0"),
    ("f32", "f32", dict(weight=None), "x and weight are required"),
    ("bf16", "fp8t", dict(antiquant_scale=_BF(2, _N), antiquant_offset=_BF(2, _N),
                          weight_transposed=True), "no antiquant_offset"),
    ("bf16", "i8", dict(antiquant_scale=_BF(2, _N), act_type=1, output_dtype=jnp.float32),
     "output"),
    # A8W8
    ("i8", "i8", dict(scale=_F32(2, _N), output_dtype=jnp.float32), "output, not float32"),
    ("i8", "i8", dict(scale=_BF(2, _N), output_dtype=jnp.float16), "output, not float16"),
    ("i8", "i8", dict(scale=jnp.ones((2, _N), jnp.float16)), "takes a f32/bf16"),
    ("i8", "i8", dict(scale=_F32(2, _N), per_token_scale=_F32(2)), r"must be \[M\]"),
    ("i8", "i8", dict(scale=_F32(2, _N), per_token_scale=jnp.ones(8, jnp.bfloat16)),
     "must be f32"),
    ("i8", "i8", dict(scale=_F32(2, 3)), "per-channel"),
    ("i8", "i8", dict(scale=_PK(2, _N), per_token_scale=_F32(8)),
     "per_token_scale must be null for A8W8 with a UINT64"),
    ("i8", "i8", dict(scale=_PK(2)), r"per-tensor \[2\] is not supported"),
    ("i8", "i8", dict(scale=_PK(2, _N), bias=_F32(2, _N)), "takes a bias of"),
    ("i8", "i8", dict(act_type=1), "INT32 output takes no activation"),
    ("i8", "i8", dict(output_dtype=jnp.bfloat16), "output, not bfloat16"),
    ("i8", "i8", dict(per_token_scale=_F32(8)), "per_token_scale must be null for A8W8 with"),
    ("i8", "i8", dict(antiquant_scale=_BF(2, _N)), "antiquant_scale must be null"),
    # A8W4
    ("i8", "i4", dict(_A8W4, bias=None), "A8W4 needs bias"),
    ("i8", "i4", dict(_A8W4, per_token_scale=None), "A8W4 needs per_token_scale"),
    ("i8", "i4", dict(_A8W4, scale=_F32(2, 1, _N)), "takes a UINT64/INT64 scale"),
    ("i8", "i4", dict(_A8W4, scale=_PK(2, 2, _N)), r"A8W4 scale must be \[2, 1, 8\]"),
    ("i8", "i4", dict(_A8W4, offset=_F32(2, 1, _N), output_dtype=jnp.bfloat16),
     r"\['float16'\] output"),
    ("i8", "i4", dict(_A8W4, offset=_F32(2, _N)), "offset must be f32"),
    ("i8", "i4", dict(_A8W4, bias=np.zeros((2, _N), np.int32)), "takes a bias of"),
    # A4W4
    ("i4", "i4", dict(scale=_PK(2, _N), bias=_F32(2, _N)), "bias must be null for A4W4"),
    ("i4", "i4", dict(scale=_PK(2, 256, _N)), "groups of an even size"),
    ("i4", "i4", {}, "A4W4 needs scale"),
    ("i4", "i4", dict(scale=_PK(2, _N), output_dtype=jnp.float32), "output, not float32"),
    # FP8 / MX / G-B
    ("fp8", "fp8", {}, "needs a scale"),
    ("fp8", "fp8", dict(scale=_F32(2, _N), bias=_F32(2, _N)), "bias must be null for FP8"),
    ("fp8", "fp8", dict(scale=_BF(2, _N)), "takes a f32 or UINT64"),
    ("fp8", "fp8", dict(scale=_F32(2, _N), per_token_scale=_F32(3)), r"\[M\] or \[g\]"),
    ("fp8", "fp8", dict(scale=_F32(2, _N), output_dtype=jnp.int8), "output, not int8"),
    ("fp8", "fp8", dict(scale=_F32(2, 2, 1)), "needs per_token_scale"),
    ("fp8", "fp8", dict(scale=_F32(2, 2, 1), per_token_scale=_F32(8, 3)),
     "G-B per_token_scale must be"),
    ("fp8", "fp8", dict(scale=_F32(2, 3, 1), per_token_scale=_F32(8, 2)), "G-B scale must be"),
    ("fp8", "fp8", dict(scale=_E8(2, 4, _N, 2)), "MX needs per_token_scale"),
    ("fp8", "fp8", dict(scale=_E8(2, 8, _N), per_token_scale=_E8(8, 4, 2)),
     r"\(E, ceil\(K/64\), N, 2\)"),
    ("fp8", "fp8", dict(scale=_E8(2, 4, _N, 2), per_token_scale=_E8(8, 8)),
     r"\(M, ceil\(K/64\), 2\)"),
    ("fp8", "fp8", dict(scale=_E8(2, 4, _N, 2), per_token_scale=_F32(8, 4, 2)),
     "must be float8_e8m0fnu"),
    ("fp4", "fp4", dict(scale=_E8(2, 4, _N, 2), per_token_scale=_E8(8, 4, 2),
                        bias=jnp.zeros((2, _N), jnp.bfloat16)), "takes a bias of"),
    ("fp8", "fp8", dict(scale=_E8(2, 4, _N, 2), per_token_scale=_E8(8, 4, 2),
                        bias=_F32(2, _N)), "bias must be null for MX"),
    # placement rules: group types, single tensors, transposes
    ("i8", "i8", dict(scale=_F32(2, _N), x=[_XQ["i8"][:4], _XQ["i8"][4:]]),
     "needs a single x and a single weight"),
    ("i8", "i4", dict(_A8W4, weight=[_WQ["i4"][0], _WQ["i4"][1]], bias=[_F32(_N)] * 2,
                      x=[_XQ["i8"][:4], _XQ["i8"][4:]]), "A8W4 needs"),
    ("i8", "i4", dict(_A8W4, weight_transposed=True, weight=jnp.zeros((2, _N, _K), jnp.int4)),
     "not transposed"),
    ("i4", "i4", dict(scale=_PK(2, _N), weight_transposed=True,
                      weight=jnp.zeros((2, _N, _K), jnp.int4)), "not transposed"),
    ("f32", "f32", dict(weight=[np.zeros((_K, _N), np.float32)] * 2, per_token_scale=_F32(8)),
     "per_token_scale must be null"),
    ("f32", "f32", dict(weight=[np.zeros((_K, _N), np.float32),
                                jnp.zeros((_K, _N), jnp.bfloat16)]), "share one dtype"),
    ("f32", "f32", dict(weight=np.zeros((_K,), np.float32)), "at least 2-D"),
    ("f32", "f32", dict(group_list_type=3), "group_list_type must be 0"),
    ("f32", "f32", dict(group_list=np.array([4.0, 8.0])), "integer tensor"),
    ("f32", "f32", dict(x=[_XQ["f32"][:3], _XQ["f32"][3:]]), "must equal each x's rows"),
    ("f32", "f32", dict(x=np.zeros((8, 0), np.float32), weight=np.zeros((2, 0, _N), np.float32)),
     "K = 0"),
    # tuning_config (section 8)
    ("i8", "i8", dict(scale=_F32(2, _N), tuning_config=[-1]), r"must lie in \[0, 8\]"),
    ("i8", "i8", dict(scale=_F32(2, _N), tuning_config=[9]), r"must lie in \[0, 8\]"),
    ("i8", "i8", dict(scale=_F32(2, _N), tuning_config=[4, 1]), "per-channel A8W4 only"),
    ("i8", "i8", dict(scale=_F32(2, _N), tuning_config=[4, 2]), "must be 0 or 1"),
    ("i8", "i8", dict(scale=_F32(2, _N), tuning_config=[4, 0, -2]), "must be -1 or >= 0"),
    ("i8", "i8", dict(scale=_F32(2, _N), tuning_config=[1, 0, 0, 0]), "at most 3 integers"),
])
def test_scenario_rules(x, w, kwargs, match):
  kwargs = dict(kwargs)
  call = dict(group_type=0, split_item=3, group_list=GL)
  call.update(kwargs)
  x_value, w_value = call.pop("x", _XQ[x]), call.pop("weight", _WQ[w])
  with pytest.raises(ValueError, match=match):
    ascend.grouped_matmul(x_value, w_value, **call)


@pytest.mark.parametrize("x, w, kwargs, group_type", [
    ("bf16", "i8", dict(antiquant_scale=_BF(2, _N)), 2),
    ("i8", "i8", dict(scale=_F32(2, _N)), 2),
    ("i8", "i4", _A8W4, 2),
    ("fp8", "fp8", dict(scale=_PK(2, _N)), 2),
    ("fp4", "fp4", dict(scale=_E8(2, 4, _N, 2), per_token_scale=_E8(8, 4, 2)), 2),
    ("i8", "i8", dict(scale=_F32(2, _N)), -1),
    ("fp8", "fp8", dict(scale=_F32(2, _N)), -1),
])
def test_group_types_per_scenario(x, w, kwargs, group_type):
  kwargs = {key: value for key, value in kwargs.items() if key != "group_list"}
  weight = _WQ[w][0] if group_type == 2 else [_WQ[w][0], _WQ[w][1]]
  xs = _XQ[x] if group_type == 2 else [_XQ[x][:4], _XQ[x][4:]]
  with pytest.raises(ValueError, match="supports group_type"):
    ascend.grouped_matmul(xs, weight, group_type=group_type,
                          split_item=3 if group_type == 2 else 0,
                          group_list=GL if group_type == 2 else None, **kwargs)


def test_group_type_rules():
  x, w = np.zeros((8, 16), np.float32), np.zeros((16, 4), np.float32)
  with pytest.raises(ValueError, match="not transposed"):
    ascend.grouped_matmul(x, w.T, group_list=GL, group_type=2, split_item=3,
                          weight_transposed=True)
  with pytest.raises(ValueError, match="group_type=0 only"):
    ascend.grouped_matmul(x, w, group_list=np.array([[0, 4], [1, 4]]), group_list_type=2,
                          group_type=2, split_item=3)
  with pytest.raises(ValueError, match="covers 20 columns of K, more than x's 16"):
    ascend.grouped_matmul(x, w, group_list=np.array([4, 20]), group_type=2, split_item=3)
  with pytest.raises(ValueError, match="S-M-M"):
    ascend.grouped_matmul(x, [w[:8], w[8:]], group_list=GL, group_type=2, split_item=0)
  with pytest.raises(ValueError, match="all or none"):
    ascend.grouped_matmul([jnp.zeros((2, 16), jnp.bfloat16)] * 2,
                          [jnp.zeros((16, 4), jnp.int8)] * 2,
                          antiquant_scale=[jnp.ones((4,), jnp.bfloat16)], group_type=-1)
  with pytest.raises(ValueError, match="x's stored last dimension"):  # k-grouping: x is [K, M]
    ascend.grouped_matmul(np.zeros((65536, 2), np.float32), np.zeros((2, 4), np.float32),
                          group_list=np.array([2]), group_type=2, split_item=3)


def test_list_length_limits():
  quantized = [jnp.zeros((2, 4), jnp.int8)] * 129
  with pytest.raises(ValueError, match="at most 128 weight tensors"):
    ascend.grouped_matmul([jnp.zeros((1, 2), jnp.bfloat16)] * 129, quantized,
                          antiquant_scale=[jnp.ones((4,), jnp.bfloat16)] * 129, group_type=-1)
  # Non-quant lists may hold up to 1024 tensors (950).
  ys = ascend.grouped_matmul([np.ones((1, 2), np.float32)] * 129,
                             [np.ones((2, 3), np.float32)] * 129, group_type=-1)
  assert len(ys) == 129 and float(ys[-1][0, 0]) == 2.0


def test_a8w4_reads_the_group_list_as_counts():
  x = jnp.asarray(RNG.integers(-128, 128, (8, _K)), jnp.int8)
  w = jnp.asarray(RNG.integers(-8, 8, (2, _K, _N)), jnp.int4)
  args = dict(scale=ascend.trans_quant_param(RNG.uniform(0.01, 0.02, (2, 1, _N))),
              bias=_F32(2, _N), per_token_scale=_F32(8), group_type=0, split_item=3)
  (want,) = ascend.grouped_matmul(x, w, group_list=np.array([3, 5]), group_list_type=1, **args)
  with pytest.warns(UserWarning, match="reads group_list as counts"):
    (y,) = ascend.grouped_matmul(x, w, group_list=np.array([3, 5]), group_list_type=0, **args)
  np.testing.assert_array_equal(y, want)


def test_trans_quant_param_bits():
  # Scale bits masked with 0xFFFFE000, bit 46 set, offset rounded/clamped in bits 37..45.
  scale = np.array([1.0, 0.1, -3.5e-4], np.float32)
  packed = ascend.trans_quant_param(scale, np.array([2.6, -300.0, -1.0]))
  assert packed.dtype == np.int64
  bits = packed.astype(np.uint64)
  np.testing.assert_array_equal(bits >> np.uint64(46) & np.uint64(1), 1)
  low = (bits & np.uint64(0xFFFFFFFF)).astype(np.uint32)
  np.testing.assert_array_equal(low, scale.view(np.uint32) & np.uint32(0xFFFFE000))
  field = (bits >> np.uint64(37)) & np.uint64(0x1FF)
  np.testing.assert_array_equal(field, [3, 256, 511])  # 3, -256, -1 as 9-bit two's complement
  decoded, offset = ascend.scales.decode_packed(packed)
  np.testing.assert_allclose(decoded, scale, rtol=2 ** -10)
  np.testing.assert_array_equal(offset, [3.0, -256.0, -1.0])


def test_packed_scale_under_x64():
  # JAX holds 64-bit quant parameters only with x64 enabled; then they decode on device.
  packed = ascend.trans_quant_param(np.array([[0.5, 0.25]], np.float32), np.array([[1, -2]]))
  with jax.enable_x64(True):
    decoded, offset = ascend.scales.decode_packed(jnp.asarray(packed))
  np.testing.assert_array_equal(decoded, [[0.5, 0.25]])
  np.testing.assert_array_equal(offset, [[1.0, -2.0]])


def test_torch_npu_style_lists_of_one_tensor():
  # torch_npu passes every tensor argument as a list; a list of one is the single tensor.
  e, m, k, n = 2, 10, 32, 8
  x = jnp.asarray(RNG.integers(-128, 128, (m, k)), jnp.int8)
  w = jnp.asarray(RNG.integers(-128, 128, (e, k, n)), jnp.int8)
  scale = RNG.uniform(1e-4, 1e-3, (e, n)).astype(np.float32)
  pts = RNG.uniform(0.5, 2.0, (m,)).astype(np.float32)
  bias = RNG.standard_normal((e, n)).astype(np.float32)
  args = dict(group_list=np.array([4, 10]), split_item=3, group_type=0)
  (want,) = ascend.grouped_matmul(x, w, bias=bias, scale=scale, per_token_scale=pts, **args)
  (y,) = ascend.grouped_matmul([x], [w], bias=[bias], scale=[scale], per_token_scale=[pts],
                               **args)
  np.testing.assert_array_equal(y, want)


def test_transposed_int_weight_only_matches_the_logical_layout():
  e, k, n = 2, 64, 8
  x = jnp.asarray(RNG.standard_normal((9, k)), jnp.bfloat16)
  w = jnp.asarray(RNG.integers(-8, 8, (e, k, n)), jnp.int4)
  scale = jnp.asarray(RNG.uniform(0.01, 0.05, (e, 4, n)), jnp.bfloat16)  # groups of 16
  args = dict(antiquant_scale=scale, group_list=np.array([4, 9]), split_item=3, group_type=0)
  (want,) = ascend.grouped_matmul(x, w, **args)
  (y,) = ascend.grouped_matmul(x, jnp.swapaxes(w, 1, 2), weight_transposed=True, **args)
  np.testing.assert_array_equal(f64(y), f64(want))


_NON_QUANT_ROWS = [  # 6.7 (950) and 6.1 (A2/A3): x = weight = out dtype, bias per row
    (jnp.bfloat16, jnp.bfloat16), (jnp.bfloat16, jnp.float32), (jnp.bfloat16, None),
    (jnp.float16, jnp.float16), (jnp.float16, jnp.float32), (jnp.float16, None),
    (jnp.float32, jnp.float32), (jnp.float32, None)]


def _non_quant_params():
  # Default run: each dtype row once, the group types in turn (8 of the 19 cases); the
  # others with -m slow.
  params = []
  for row, (dtype, bias) in enumerate(_NON_QUANT_ROWS):
    types = [group_type for group_type in (-1, 0, 2)
             if not (group_type == 2 and bias is not None)]  # k-grouping takes no bias
    for i, group_type in enumerate(types):
      marks = [] if i == row % len(types) else [pytest.mark.slow]
      params.append(pytest.param(dtype, bias, group_type, marks=marks))
  return params


@pytest.mark.parametrize("dtype, bias_dtype, group_type", _non_quant_params())
def test_non_quant_rows(dtype, bias_dtype, group_type):
  e, m, k, n = 3, 12, 32, 8
  tol = {jnp.bfloat16: 2e-2, jnp.float16: 5e-3, jnp.float32: 1e-5}[dtype]
  x = jnp.asarray(RNG.standard_normal((m, k)), dtype)
  w = jnp.asarray(RNG.standard_normal((e, k, n)), dtype)
  b = None if bias_dtype is None else jnp.asarray(RNG.standard_normal((e, n)), bias_dtype)
  if group_type == 2:
    wk = w[0]
    (y,) = ascend.grouped_matmul(x, wk, group_list=np.array([10, 10, 32]), group_type=2,
                                 split_item=3)
    want = np.stack([f64(x)[:, :10] @ f64(wk)[:10], np.zeros((m, n)),
                     f64(x)[:, 10:] @ f64(wk)[10:]])
  elif group_type == 0:
    (y,) = ascend.grouped_matmul(x, w, bias=b, group_list=np.array([5, 0, 4]),
                                 group_list_type=1, group_type=0, split_item=3)
    want = np_split_m(f64(x), f64(w), [5, 0, 4], bias=None if b is None else f64(b))
  else:
    ys = ascend.grouped_matmul([x[:5], x[5:]], [w[0], w[1]], group_type=-1,
                               bias=None if b is None else [b[0], b[1]])
    y = jnp.concatenate(ys)
    want = np.concatenate([f64(x)[:5] @ f64(w)[0], f64(x)[5:] @ f64(w)[1]])
    if b is not None:
      want += np.concatenate([np.broadcast_to(f64(b)[0], (5, n)),
                              np.broadcast_to(f64(b)[1], (m - 5, n))])
  assert y.dtype == dtype
  np.testing.assert_allclose(f64(y), want, rtol=tol, atol=tol * np.abs(want).max())


def test_a8w4_int32_packed_weights_equal_int4_weights():
  # Ascend takes A8W4 weights as INT32 words of 8 INT4 values (lowest nibble first).
  e, m = 2, 8
  w = RNG.integers(-8, 8, (e, _K, _N))
  nibbles = (w & 0xF).astype(np.uint32).reshape(e, _K, _N // 8, 8)
  words = (nibbles << (4 * np.arange(8, dtype=np.uint32))).sum(-1, dtype=np.uint32)
  packed = words.view(np.int32)
  x = jnp.asarray(RNG.integers(-128, 128, (m, _K)), jnp.int8)
  args = dict(scale=ascend.trans_quant_param(RNG.uniform(0.01, 0.02, (e, 1, _N))),
              bias=_F32(e, _N), per_token_scale=_F32(m), group_list=np.array([3, 5]),
              group_list_type=1, group_type=0, split_item=3)
  (want,) = ascend.grouped_matmul(x, jnp.asarray(w, jnp.int4), **args)
  (y,) = ascend.grouped_matmul(x, jnp.asarray(packed), **args)
  np.testing.assert_array_equal(f64(y), f64(want))


def test_fp8_scale_shapes_that_two_readings_share():
  # Spec 6.6, m-grouping with g == M: a [g] per_token_scale is per-token; [g, 1] follows the
  # per-channel weight, i.e. per-tensor (one scale per group).
  g = m = 4
  x = jnp.asarray(RNG.uniform(-2, 2, (m, 32)), jnp.float8_e4m3fn)
  w = jnp.asarray(RNG.uniform(-2, 2, (g, 32, 8)), jnp.float8_e4m3fn)
  scale = RNG.uniform(0.5, 1.5, (g, 8)).astype(np.float32)
  pts = RNG.uniform(0.5, 1.5, (g,)).astype(np.float32)
  sizes = [2, 0, 2, 0]  # rows 0-1 -> group 0, rows 2-3 -> group 2
  args = dict(scale=scale, group_list=np.array(sizes), group_list_type=1, group_type=0,
              split_item=3, output_dtype=jnp.float32)
  acc = np_split_m(f64(x), f64(w), sizes) * scale[[0, 0, 2, 2]]
  (per_token,) = ascend.grouped_matmul(x, w, per_token_scale=pts, **args)
  np.testing.assert_allclose(per_token, acc * pts[:, None], rtol=1e-5)
  (per_tensor,) = ascend.grouped_matmul(x, w, per_token_scale=pts[:, None], **args)
  np.testing.assert_allclose(per_tensor, acc * pts[[0, 0, 2, 2], None], rtol=1e-5)
