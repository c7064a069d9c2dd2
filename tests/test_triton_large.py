"""Operands of 2**31 or more elements in the Triton kernels.

Pallas Triton indexes an operand with 32-bit signed offsets unless it holds more than 2**32
bytes, so a 1-byte operand of 2**31 to 2**32 elements (DeepSeek-V3's fp8 experts) would be
read at wrapped offsets; the kernels read such an operand as 16-bit words. Checked here:
the lowered TTIR of DeepSeek-V3's shape (no 32-bit offset into an operand of 2**31 or
more elements; nothing is allocated), and the word path itself in interpret mode on small
shapes (with the limit lowered) against the numpy oracle.
"""

from __future__ import annotations

import math

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton_ir
from gmm_jax import quantize
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.core.epilogue import Rows
from gmm_jax.pallas.gpu import triton as triton_gmm
from gmm_jax.pallas.gpu import triton_large
from lowering import gpu_model
from oracle import f64, rows_oracle, tolerances

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

# DeepSeek-V3's routed experts: 256 experts, D = 7168, F = 2048.
EXPERTS, HIDDEN, FFN = 256, 7168, 2048


def _deepseek_v3(dtype: str, tokens: int = 4096):
  """(function, abstract operands) of the m-grouped gmm with DeepSeek-V3's expert weights
  [256, 7168, 2048]: fp8 e4m3 x fp8 e4m3 (per-token x per-channel scales), or bf16."""
  x = jax.ShapeDtypeStruct((tokens, HIDDEN), jnp.float32)
  w = jax.ShapeDtypeStruct((EXPERTS, HIDDEN, FFN), jnp.float32)
  sizes = jax.ShapeDtypeStruct((EXPERTS,), jnp.int32)
  if dtype == "bfloat16":
    x, w = (jax.ShapeDtypeStruct(a.shape, jnp.bfloat16) for a in (x, w))
  else:
    x = jax.eval_shape(lambda a: quantize(a, jnp.float8_e4m3fn, channelwise_axes=(0,)), x)
    w = jax.eval_shape(lambda a: quantize(a, jnp.float8_e4m3fn, channelwise_axes=(0, 2)), w)

  def fn(x, w, sizes):
    return gmm_jax.gmm(x, w, sizes, implementation="pallas_triton",
                       preferred_element_type=jnp.bfloat16)

  return fn, (x, w, sizes)


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_no_32_bit_offset_into_an_operand_of_2_31_elements(dtype):
  fn, args = _deepseek_v3(dtype)
  assert math.prod(args[1].shape) >= 2**31
  try:
    additions = triton_ir.offsets(fn, *args, lowering=gpu_model)
  except triton_ir.Unreadable as err:
    pytest.skip(f"this jax's lowered Triton IR cannot be read here: {err}")
  assert additions, "no pointer arithmetic found"
  wrapped = [a for a in additions if a.elements >= 2**31 and a.bits < 64]
  assert not wrapped, f"32-bit offsets into operands of >= 2**31 elements: {set(wrapped)}"
  # The weights are read: through words (fp8: fewer than 2**31 of them, 32-bit offsets
  # suffice) or with 64-bit offsets (bf16: jax's own rule past 2**32 bytes).
  big = [a for a in additions if a.elements >= 2**30]
  assert big, additions
  if dtype == "bfloat16":
    assert {a.bits for a in big} == {64}


def test_only_large_1_byte_operands_become_words():
  small = jax.ShapeDtypeStruct((EXPERTS, HIDDEN, FFN // 2), jnp.float8_e4m3fn)
  large = jax.ShapeDtypeStruct((EXPERTS, HIDDEN, FFN), jnp.float8_e4m3fn)
  past_4gib = jax.ShapeDtypeStruct((EXPERTS, HIDDEN, 2 * FFN + 2), jnp.int8)
  bf16 = jax.ShapeDtypeStruct((EXPERTS, HIDDEN, FFN), jnp.bfloat16)
  assert not triton_large.needs_words(small)  # 1.9e9 elements: 32-bit offsets are right
  assert triton_large.needs_words(large)  # 3.76e9
  assert not triton_large.needs_words(past_4gib)  # jax indexes it in 64 bits
  assert not triton_large.needs_words(bf16)  # ditto (7.5 GB)


# --------------------------------------------------------------- the word path itself


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.int8, jnp.uint8])
def test_words_round_trip(dtype):
  rng = np.random.default_rng(0)
  values = jnp.asarray(rng.integers(0, 256, (3, 5, 8), dtype=np.uint8))
  values = jax.lax.bitcast_convert_type(values, dtype) if dtype != jnp.uint8 else values
  words = triton_large.as_words(values)
  assert words.dtype == jnp.uint16 and words.shape == (3, 5, 4)
  back = triton_large.unpack(words.reshape(15, 4), dtype).reshape(values.shape)
  np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(back, jnp.uint8)
                                           if dtype != jnp.uint8 else back),
                                np.asarray(jax.lax.bitcast_convert_type(values, jnp.uint8)
                                           if dtype != jnp.uint8 else values))


@pytest.fixture
def small_limit(monkeypatch):
  """Operands of 64 or more 1-byte elements take the word path."""
  monkeypatch.setattr(triton_large, "OFFSET_LIMIT", 64)


SIZES = [9, 0, 14, 21]
T, K, N, G = 50, 64, 48, 4


def _uses_words(fn, *args) -> bool:
  return "u16[" in str(jax.make_jaxpr(fn)(*args))


@pytest.mark.parametrize("transpose_rhs", [False, True])
@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_int8_operands_as_words(small_limit, activation, transpose_rhs):
  del small_limit
  rng = np.random.default_rng(1)
  lhs = jnp.asarray(rng.integers(-9, 9, (T, K)), jnp.int8)
  rhs = rng.integers(-9, 9, (G, K, N)).astype(np.int8)
  stored = jnp.asarray(np.swapaxes(rhs, 1, 2) if transpose_rhs else rhs)
  cfg = GmmConfig(group_type="m", num_local=G, transpose_rhs=transpose_rhs,
                  activation=activation, interpret=True,
                  out_dtype=np.dtype("int32" if activation is None else "float32"))
  fn = jax.jit(lambda *a: triton_gmm.gmm_triton(*a, None, cfg, Tiling(16, 32, 16)))
  args = (lhs, stored, jnp.asarray(SIZES, jnp.int32), jnp.int32(0))
  assert _uses_words(fn, *args)
  got = fn(*args)
  want = rows_oracle(lhs[:sum(SIZES)], rhs, SIZES, activation=activation)
  if activation is None:  # integer sums: exact
    np.testing.assert_array_equal(np.asarray(got)[:sum(SIZES)], want.astype(np.int64))
  else:
    np.testing.assert_allclose(f64(got)[:sum(SIZES)], want, rtol=1e-5, atol=1e-5)
  assert np.all(np.asarray(got)[sum(SIZES):] == 0)


def test_fp8_scaled_gathered_rows_as_words(small_limit):
  del small_limit
  rng = np.random.default_rng(2)
  tokens = 30
  indices = np.concatenate([rng.permutation(tokens), rng.permutation(tokens)[:14]])
  x = quantize(rng.standard_normal((tokens, K)).astype(np.float32), jnp.float8_e4m3fn,
               channelwise_axes=(0,))
  w = quantize((rng.standard_normal((G, K, 2 * N)) / 8).astype(np.float32),
               jnp.float8_e4m3fn, channelwise_axes=(0, 2))
  cfg = GmmConfig(group_type="m", num_local=G, activation="swiglu", interpret=True,
                  gather_rows=len(indices), out_dtype=np.dtype("float32"))
  rows = Rows(lhs_indices=jnp.asarray(indices, jnp.int32))
  fn = jax.jit(lambda x, w, sizes: triton_gmm.gmm_triton(
      x, w, sizes, jnp.int32(0), None, cfg, Tiling(16, 32, 16), rows=rows))
  sizes = jnp.asarray(SIZES, jnp.int32)
  assert _uses_words(fn, x, w, sizes)
  got = fn(x, w, sizes)
  want = rows_oracle(f64(x.qvalue) * f64(x.scale), f64(w.qvalue) * f64(w.scale), SIZES,
                     lhs_indices=indices, activation="swiglu")
  np.testing.assert_allclose(f64(got), want, rtol=1e-5, atol=1e-5)


def test_weight_only_fp8_as_words(small_limit):
  del small_limit
  rng = np.random.default_rng(3)
  lhs = jnp.asarray(rng.standard_normal((T, K)), jnp.float32)
  w = quantize((rng.standard_normal((G, K, N)) / 8).astype(np.float32), jnp.float8_e4m3fn,
               channelwise_axes=(0, 2))
  bias = jnp.asarray(rng.standard_normal((G, N)), jnp.float32)
  cfg = GmmConfig(group_type="m", num_local=G, activation="silu", interpret=True,
                  out_dtype=np.dtype("float32"))
  fn = jax.jit(lambda *a: triton_gmm.gmm_triton(*a, cfg, Tiling(16, 32, 16)))
  args = (lhs, w, jnp.asarray(SIZES, jnp.int32), jnp.int32(0), bias)
  assert _uses_words(fn, *args)
  want = rows_oracle(lhs[:sum(SIZES)], f64(w.qvalue) * f64(w.scale), SIZES, bias=bias,
                     activation="silu")
  np.testing.assert_allclose(f64(fn(*args))[:sum(SIZES)], want, **tolerances(jnp.float32, k=K))


def test_word_path_refusals(small_limit):
  del small_limit
  lhs = jnp.zeros((K, T), jnp.int8)
  rhs = jnp.zeros((G, K, N), jnp.int8)
  sizes, zero = jnp.asarray(SIZES, jnp.int32), jnp.int32(0)
  transposed = GmmConfig(group_type="m", num_local=G, transpose_lhs=True, interpret=True,
                         out_dtype=np.dtype("int32"))
  with pytest.raises(NotImplementedError, match="words"):
    triton_gmm.gmm_triton(lhs, rhs, sizes, zero, None, transposed, Tiling(16, 32, 16))
  k_grouped = GmmConfig(group_type="k", num_local=G, interpret=True,
                        out_dtype=np.dtype("int32"))
  with pytest.raises(NotImplementedError, match="words"):
    triton_gmm.gmm_triton(jnp.zeros((T, K), jnp.int8), jnp.zeros((K, N), jnp.int8), sizes,
                          zero, None, k_grouped, Tiling(16, 32, 16))

