"""gmm_jax.compat.onednn against a float64 numpy oracle written from oneDNN's grouped-matmul
semantics (spec sections 3-8), the seed's worked example, and the validation rules."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax.compat import onednn

TOKENS = [800, 600, 700, 500, 650, 450, 550, 750]  # the seed's worked example


def test_seed_worked_example_descriptor_and_memory():
  md = onednn.memory_desc_grouped((5000, 512), "f32", 0, 8)
  assert md.get_size(0) == 10_240_000 and md.get_size(1) == 32
  offsets = np.cumsum(TOKENS).astype(np.int32)
  np.testing.assert_array_equal(offsets, [800, 1400, 2100, 2600, 3250, 3700, 4250, 5000])
  values = jnp.zeros((5000, 512), jnp.float32)
  mem = onednn.memory(md, (values, offsets))
  assert mem.get_size(0) == 10_240_000 and mem.get_size(1) == 32
  assert mem.get_data_handle(0) is mem.values and mem.get_data_handle(1).dtype == jnp.int32
  # First byte of each group (the seed's table): row offset x K x 4 bytes.
  starts = np.concatenate([[0], offsets[:-1]]) * 512 * 4
  np.testing.assert_array_equal(starts[:3], [0, 1_638_400, 2_867_200])


def test_seed_worked_example_matmul():
  rng = np.random.default_rng(0)
  k, n = 512, 16
  values = rng.standard_normal((5000, k)).astype(np.float32)
  weights = (rng.standard_normal((8, k, n)) / np.sqrt(k)).astype(np.float32)
  offsets = np.cumsum(TOKENS).astype(np.int32)
  src = onednn.memory(onednn.memory_desc_grouped((5000, k), "f32", 0, 8), (values, offsets))
  dst = onednn.matmul(src, weights)
  assert dst.desc.dims == (5000, n) and np.array_equal(dst.offsets, offsets)
  start = 0
  for g, end in enumerate(offsets):
    want = values[start:end].astype(np.float64) @ weights[g]
    np.testing.assert_allclose(dst.values[start:end], want, rtol=1e-4, atol=1e-4)
    start = end


@pytest.mark.parametrize("dtype, name, size", [
    (jnp.bfloat16, "bf16", 2 * 10 * 6), ("s4", "s4", 30), ("f4_e2m1", "f4_e2m1", 30),
    ("u8", "u8", 60)])
def test_sizes_by_type(dtype, name, size):
  assert onednn.memory_desc_grouped((10, 6), dtype, 0, 3).get_size(0) == size
  assert onednn.memory_desc_grouped((10, 6), name, 1, 3).get_size(1) == 12


# The creation-time rules of memory::desc::grouped (spec section 1.2), in oneDNN's order.
DESC_RULES = {
    "not_2d_is_unimplemented": (((2, 3, 4), "f32", 0, 2, "s32"), NotImplementedError, "2-D"),
    "1d_is_unimplemented": (((8,), "f32", 0, 2, "s32"), NotImplementedError, "2-D"),
    "unimplemented_before_invalid": (((2, 3, 4), "f32", 5, 0, "s64"), NotImplementedError,
                                     "2-D"),
    "group_count_0": (((8, 4), "f32", 0, 0, "s32"), ValueError, "group_count"),
    "group_count_negative": (((8, 4), "f32", 0, -3, "s32"), ValueError, "group_count"),
    "group_count_not_int": (((8, 4), "f32", 0, 2.0, "s32"), ValueError, "group_count"),
    "offsets_s64": (((8, 4), "f32", 0, 2, "s64"), ValueError, "s32"),
    "offsets_f32": (((8, 4), "f32", 0, 2, "f32"), ValueError, "s32"),
    "variable_dim_2": (((8, 4), "f32", 2, 2, "s32"), ValueError, "variable_dim_idx"),
    "variable_dim_negative": (((8, 4), "f32", -1, 2, "s32"), ValueError, "variable_dim_idx"),
    # A grouped tensor cannot have total size 0.
    "rows_0": (((0, 512), "f32", 0, 2, "s32"), ValueError, r"total size 0.*\(0, 512\)"),
    "columns_0": (((512, 0), "f32", 1, 2, "s32"), ValueError, r"total size 0.*\(512, 0\)"),
    "negative_dim": (((-1, 4), "f32", 0, 2, "s32"), ValueError, r"positive ints.*\(-1, 4\)"),
    "runtime_placeholder": (((-2**63, 4), "f32", 0, 2, "s32"), ValueError, "placeholder"),
    "unknown_dim": (((None, 4), "f32", 0, 2, "s32"), ValueError, "placeholder"),
    # Ordered as oneDNN checks: group_count, offsets type, variable dim, then dims.
    "group_count_before_dims": (((0, 4), "f32", 0, 0, "s64"), ValueError, "group_count"),
    "offsets_before_variable_dim": (((8, 4), "f32", 3, 2, "s64"), ValueError, "s32"),
    "variable_dim_before_dims": (((0, 4), "f32", 3, 2, "s32"), ValueError, "variable_dim"),
    "unknown_data_type": (((8, 4), "q7", 0, 2, "s32"), ValueError, "unknown data type"),
}


@pytest.mark.parametrize("rule", list(DESC_RULES))
def test_descriptor_creation_rules(rule):
  args, error, match = DESC_RULES[rule]
  with pytest.raises(error, match=match):
    onednn.memory_desc_grouped(*args)
  # allow_empty: the zero descriptor instead of the error.
  md = onednn.memory_desc_grouped(*args, allow_empty=True)
  assert md.is_zero() and md.dims == () and md.get_size(0) == 0 and md.get_size(1) == 0


def test_zero_dims_give_the_zero_descriptor():
  # ndims == 0 succeeds with a zero descriptor, whatever the other arguments.
  for args in [((), "f32", 0, 2), ((), "f32", 7, 0, "s64")]:
    md = onednn.memory_desc_grouped(*args)
    assert md.is_zero() and md.dims == () and md.num_groups == 0 and md.get_size(0) == 0
  assert not onednn.memory_desc_grouped((1, 1), "f32", 1, 1).is_zero()
  with pytest.raises(ValueError, match="zero memory descriptor"):
    onednn.memory(onednn.memory_desc_grouped((), "f32", 0, 2), (np.zeros(()), np.zeros(0)))


def test_matmul_with_zero_columns_is_rejected_as_onednn_would():
  # The dst [total_M, N=0] descriptor cannot be created.
  src = onednn.memory(onednn.memory_desc_grouped((4, 3), "f32", 0, 2),
                      (np.ones((4, 3), np.float32), np.asarray([2, 4], np.int32)))
  with pytest.raises(ValueError, match="total size 0"):
    onednn.matmul(src, np.ones((2, 3, 0), np.float32))


def np_var_m(src, weights, offsets, *, src_scale=None, wei_scale=None, src_zp=None,
             wei_zp=None, bias=None, k_block=None):
  """oneDNN's var-M arithmetic (spec 4.2) in float64: per K block, (src - zp) (wei - zp),
  times the src row scale and the weight (group, block, column) scale; then bias."""
  src = np.asarray(src, np.float64)
  weights = np.asarray(weights, np.float64)
  total_m, k = src.shape
  n = weights.shape[2]
  k_block = k_block or k
  out = np.zeros((total_m, n))
  start = 0
  for g, end in enumerate(np.asarray(offsets)):
    for m in range(start, end):
      for j in range(k // k_block):
        block = slice(j * k_block, (j + 1) * k_block)
        s = src[m, block] - (0.0 if src_zp is None else src_zp[m, j])
        w = weights[g, block] - (0.0 if wei_zp is None else wei_zp[g, j])
        acc = s @ w
        if src_scale is not None:
          acc = acc * src_scale[m, j]
        if wei_scale is not None:
          acc = acc * wei_scale[g, j]
        out[m] += acc
      if bias is not None:
        out[m] += bias[g]
    start = end
  return out


def _src(values, offsets, name):
  md = onednn.memory_desc_grouped(values.shape, name, 0, len(offsets))
  return onednn.memory(md, (values, np.asarray(offsets, np.int32)))


OFFSETS = [5, 5, 12, 15]  # group 1 empty; rows 15.. past the total


def test_var_m_float_bias_swish_and_router_weights():
  rng = np.random.default_rng(1)
  src = rng.standard_normal((16, 8)).astype(np.float32)
  weights = rng.standard_normal((4, 8, 6)).astype(np.float32)
  bias = rng.standard_normal((4, 6)).astype(np.float32)
  router = rng.uniform(size=(16, 1)).astype(np.float32)
  dst = onednn.matmul(_src(src, OFFSETS, "f32"), weights, bias,
                      post_ops=[onednn.eltwise("eltwise_swish", 1.0),
                                onednn.binary_mul(router)])
  z = np_var_m(src, weights, OFFSETS, bias=bias)
  want = z / (1 + np.exp(-z)) * router
  want[15:] = 0.0  # decided: rows past the last offset are 0
  np.testing.assert_allclose(dst.values, want, rtol=1e-5, atol=1e-5)
  # per-expert [G, 1] binary mul, and weights stored "acb" ([G, N, K])
  per_expert = np.arange(1, 5, dtype=np.float32)[:, None]
  dst = onednn.matmul(_src(src, OFFSETS, "f32"), np.swapaxes(weights, 1, 2),
                      weights_format="acb", post_ops=[onednn.binary_mul(per_expert)])
  groups = np.repeat(np.arange(4), np.diff([0] + OFFSETS))
  want = np_var_m(src, weights, OFFSETS)[:15] * per_expert[groups]
  np.testing.assert_allclose(dst.values[:15], want, rtol=1e-5, atol=1e-5)


def test_weight_only_s4_with_zero_points_and_k_groups():
  rng = np.random.default_rng(2)
  src = rng.standard_normal((16, 64)).astype(np.float32)
  wei = rng.integers(-8, 8, (4, 64, 6)).astype(np.int8)
  scale = rng.uniform(0.01, 0.1, (4, 2, 6)).astype(np.float32)  # [G, K/32, N]
  zp = rng.integers(-2, 3, (4, 2, 6)).astype(np.int8)
  dst = onednn.matmul(_src(jnp.asarray(src, jnp.bfloat16), OFFSETS, "bf16"),
                      jnp.asarray(wei, jnp.int4), wei_scales=scale,
                      wei_zero_points=jnp.asarray(zp, jnp.int4), dst_dtype="f32")
  src_bf16 = np.asarray(jnp.asarray(src, jnp.bfloat16).astype(jnp.float32))
  w_deq = (wei - np.repeat(zp, 32, axis=1)) * np.repeat(scale, 32, axis=1)
  w_bf16 = np.asarray(jnp.asarray(w_deq, jnp.bfloat16).astype(jnp.float32))
  want = np_var_m(src_bf16, w_bf16, OFFSETS)
  want[15:] = 0.0
  np.testing.assert_allclose(dst.values, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("src_type", ["s8", "u8"])
def test_int8_per_row_and_per_column_scales_with_src_zero_points(src_type):
  rng = np.random.default_rng(3)
  low, high = (-128, 128) if src_type == "s8" else (0, 256)
  src = rng.integers(low, high, (16, 32)).astype(onednn.data_type(src_type))
  wei = rng.integers(-128, 128, (4, 32, 6)).astype(np.int8)
  src_scale = rng.uniform(0.01, 0.02, (16,)).astype(np.float32)  # [total_M]
  wei_scale = rng.uniform(0.01, 0.02, (4, 6)).astype(np.float32)  # [G, N]
  src_zp = rng.integers(0, 5, (16,)).astype(np.int32)
  dst = onednn.matmul(_src(src, OFFSETS, src_type), wei, src_scales=src_scale,
                      wei_scales=wei_scale, src_zero_points=src_zp)
  want = np_var_m(src, wei, OFFSETS, src_scale=src_scale[:, None],
                  wei_scale=wei_scale[:, None, :], src_zp=src_zp[:, None])
  want[15:] = 0.0
  np.testing.assert_allclose(dst.values, want, rtol=1e-5, atol=1e-4)
  assert dst.values.dtype == jnp.float32


def test_mxfp8_e8m0_block_scales():
  rng = np.random.default_rng(4)
  src = jnp.asarray(rng.standard_normal((16, 64)), jnp.float8_e4m3fn)
  wei = jnp.asarray(rng.standard_normal((4, 64, 6)), jnp.float8_e4m3fn)
  src_scale = jnp.asarray(2.0 ** rng.integers(-3, 3, (16, 2)), jnp.float8_e8m0fnu)
  wei_scale = jnp.asarray(2.0 ** rng.integers(-3, 3, (4, 2, 6)), jnp.float8_e8m0fnu)
  dst = onednn.matmul(_src(src, OFFSETS, "f8_e4m3"), wei, src_scales=src_scale,
                      wei_scales=wei_scale, dst_dtype="bf16")
  f = lambda a: np.asarray(jnp.asarray(a).astype(jnp.float32), np.float64)  # noqa: E731
  want = np_var_m(f(src), f(wei), OFFSETS, src_scale=f(src_scale), wei_scale=f(wei_scale),
                  k_block=32)
  want[15:] = 0.0
  assert dst.values.dtype == jnp.bfloat16
  np.testing.assert_allclose(f(dst.values), want, rtol=1e-2, atol=1e-2)


def test_var_k_weight_gradient_form():
  rng = np.random.default_rng(5)
  m, n, total_k = 6, 5, 20
  offsets = np.array([7, 7, 16], np.int32)  # group 1 empty -> zeros; columns 16.. unused
  src = rng.standard_normal((m, total_k)).astype(np.float32)
  wei = rng.standard_normal((total_k, n)).astype(np.float32)
  src_mem = onednn.memory(onednn.memory_desc_grouped((m, total_k), "f32", 1, 3),
                          (src, offsets))
  wei_mem = onednn.memory(onednn.memory_desc_grouped((total_k, n), "f32", 0, 3),
                          (wei, offsets))
  dst = onednn.matmul(src_mem, wei_mem)
  assert dst.shape == (3, m, n)
  bounds = [0, 7, 7, 16]
  for g in range(3):
    cols = slice(bounds[g], bounds[g + 1])
    np.testing.assert_allclose(dst[g], src[:, cols].astype(np.float64) @ wei[cols],
                               rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(dst[1], 0.0)


def test_jit_with_memories():
  rng = np.random.default_rng(6)
  src = rng.standard_normal((16, 8)).astype(np.float32)
  weights = rng.standard_normal((4, 8, 6)).astype(np.float32)
  mem = _src(src, OFFSETS, "f32")
  out = jax.jit(lambda mem, w: onednn.matmul(mem, w).values)(mem, weights)
  np.testing.assert_allclose(out, onednn.matmul(mem, weights).values, rtol=1e-6)


@pytest.mark.parametrize("make, match", [
    (lambda s, w: onednn.matmul(s, w, src_scales=np.ones(16, np.float32)), "no src scales"),
    (lambda s, w: onednn.matmul(s, w.astype(np.int8)), "weight-only quantization needs"),
    (lambda s, w: onednn.matmul(s, w[:3]), r"\[G=4, K, N\]"),
    (lambda s, w: onednn.matmul(s, w, dst_dtype="s8"), "no s32/s8 destinations"),
    (lambda s, w: onednn.matmul(s, w, post_ops=[onednn.binary_mul(np.ones((1, 1)))]),
     r"no \[1, 1\] scalar"),
    (lambda s, w: onednn.matmul(s, w, post_ops=[("sum", None)]), "eltwise and binary_mul"),
    (lambda s, w: onednn.eltwise("eltwise_soft_relu_v9"), "unsupported eltwise"),
    (lambda s, w: onednn.memory(s.desc, (s.values[:3], s.offsets)), "do not match"),
    (lambda s, w: onednn.memory(s.desc, (s.values, s.offsets.astype(jnp.int16))), "s32"),
])
def test_matmul_validation(make, match):
  rng = np.random.default_rng(7)
  src = _src(rng.standard_normal((16, 8)).astype(np.float32), OFFSETS, "f32")
  weights = rng.standard_normal((4, 8, 6)).astype(np.float32)
  with pytest.raises(ValueError, match=match):
    make(src, weights)


def test_var_k_validation():
  md_src = onednn.memory_desc_grouped((4, 10), "f32", 1, 2)
  src = onednn.memory(md_src, (np.zeros((4, 10), np.float32), np.array([3, 10], np.int32)))
  wei = onednn.memory(onednn.memory_desc_grouped((10, 5), "f32", 0, 2),
                      (np.zeros((10, 5), np.float32), np.array([4, 10], np.int32)))
  with pytest.raises(ValueError, match="offsets must equal"):
    onednn.matmul(src, wei)
  with pytest.raises(ValueError, match="default attributes only"):
    onednn.matmul(src, wei, bias=np.zeros((2, 5), np.float32))
