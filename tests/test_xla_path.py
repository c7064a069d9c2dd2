"""The XLA path's machine-dependent choices: every combination gives the oracle's result.

`gmm_xla` picks, per XLA:CPU version and CPU, whether 16-bit operands travel through its
loops as bit patterns (`carry_bits`) and whether small 16-bit groups get a batched head
pass (`head`). The shared suite (test_gmm_xla.py) runs only the defaults of the machine it
runs on; these tests force each choice on small shapes, so both stay correct everywhere.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.backends import xla
from gmm_jax._src.core.config import GmmConfig, Tiling
from oracle import f64, gmm_oracle, local_rows, tolerances

# Small and large groups around a mean of 12 rows (head capacity 16 with tile_m 256), with
# empty groups and rows past the total.
SIZES = [0, 40, 3, 16, 17, 1, 0, 10]
M, K, N = 96, 24, 40
CHOICES = list(itertools.product([False, True], [False, True]))  # (head, carry_bits)


def _operands(dtype, transpose_lhs, transpose_rhs, num_local, seed=0):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((K, M) if transpose_lhs else (M, K))
  rhs = rng.standard_normal((num_local,) + ((N, K) if transpose_rhs else (K, N)))
  bias = rng.standard_normal((num_local, N))
  return (jnp.asarray(lhs.astype(np.float32), dtype), jnp.asarray(rhs.astype(np.float32), dtype),
          jnp.asarray(bias.astype(np.float32), dtype))


def _check_m(out, lhs, rhs, bias, sizes, *, group_offset, num_local, activation, **flags):
  expected = gmm_oracle(lhs, rhs, sizes, "m", bias=bias, activation=activation,
                        group_offset=group_offset, num_local=num_local, **flags)
  got = f64(out)
  np.testing.assert_allclose(got, expected, **tolerances(lhs.dtype, out.dtype, k=K))
  computed = local_rows(sizes, M, group_offset, num_local)
  assert np.all(got[~computed] == 0), "rows of no local group must be exactly 0"


def test_head_capacity_engages_for_small_16bit_groups():
  # Mean 12 rows: the head takes the first 16 rows of every group.
  assert xla.head_capacity(M, len(SIZES), 256, jnp.bfloat16) == 16
  assert xla.head_capacity(M, len(SIZES), 256, jnp.float32) == 0


@pytest.mark.parametrize("head,carry_bits", CHOICES)
@pytest.mark.parametrize("dtype,transpose_lhs,transpose_rhs,group_offset,num_local",
                         [(jnp.bfloat16, False, False, 0, 8), (jnp.float16, True, True, 2, 5)])
def test_m_grouping_every_choice(dtype, head, carry_bits, transpose_lhs, transpose_rhs,
                                 group_offset, num_local):
  lhs, rhs, bias = _operands(dtype, transpose_lhs, transpose_rhs, num_local)
  cfg = GmmConfig(group_type="m", num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, activation="gelu_tanh",
                  out_dtype=np.dtype(dtype))

  @jax.jit
  def run(lhs, rhs, counts, offset, bias):
    return xla.gmm_xla(lhs, rhs, counts, offset, bias, cfg, head=head, carry_bits=carry_bits)

  out = run(lhs, rhs, jnp.asarray(SIZES, jnp.int32), jnp.int32(group_offset), bias)
  assert out.dtype == dtype and out.shape == (M, N)
  _check_m(out, lhs, rhs, bias, SIZES, group_offset=group_offset, num_local=num_local,
           activation="gelu_tanh", transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)


@pytest.mark.parametrize("carry_bits", [False, True])
@pytest.mark.parametrize("transpose_lhs,transpose_rhs", [(False, False), (True, True)])
def test_k_grouping_every_choice(carry_bits, transpose_lhs, transpose_rhs):
  sizes = [5, 0, 9, 6]  # sum 20 < K: columns past the total
  rng = np.random.default_rng(1)
  m, k, n, num_local = 16, 24, 8, 4
  lhs = jnp.asarray(rng.standard_normal((k, m) if transpose_lhs else (m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((n, k) if transpose_rhs else (k, n)), jnp.bfloat16)
  cfg = GmmConfig(group_type="k", num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, out_dtype=np.dtype(jnp.float32))
  out = jax.jit(lambda a, b, c: xla.gmm_xla(a, b, c, jnp.int32(0), None, cfg,
                                            carry_bits=carry_bits))(
      lhs, rhs, jnp.asarray(sizes, jnp.int32))
  expected = gmm_oracle(lhs, rhs, sizes, "k", transpose_lhs=transpose_lhs,
                        transpose_rhs=transpose_rhs)
  np.testing.assert_allclose(f64(out), expected, **tolerances(jnp.bfloat16, k=k))
  assert np.all(f64(out)[1] == 0), "an empty group's output must be exactly 0"


@pytest.mark.parametrize("carry_bits", [False, True])
@pytest.mark.parametrize("transpose_lhs,transpose_rhs", [(False, False), (True, False),
                                                         (False, True)])
def test_k_grouping_full_and_partial_tiles(carry_bits, transpose_lhs, transpose_rhs):
  # tile_k=8: groups of several full tiles, full tiles with a partial one, a partial one
  # alone, empty groups, a group past the total; a 16-bit result with bias and activation,
  # and the local window of groups 1..4 of 6.
  sizes = [3, 17, 0, 8, 11, 6]  # sum 45 < K = 48
  group_offset, num_local = 1, 4
  rng = np.random.default_rng(2)
  m, k, n = 16, 48, 24
  lhs = jnp.asarray(rng.standard_normal((k, m) if transpose_lhs else (m, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((n, k) if transpose_rhs else (k, n)), jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal((num_local, n)), jnp.bfloat16)
  cfg = GmmConfig(group_type="k", num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, out_dtype=np.dtype(jnp.bfloat16),
                  activation="gelu")
  tiling = Tiling(tile_m=8, tile_k=8, tile_n=8)
  out = jax.jit(lambda a, b, c, d: xla.gmm_xla(a, b, c, jnp.int32(group_offset), d, cfg,
                                               tiling, carry_bits=carry_bits))(
      lhs, rhs, jnp.asarray(sizes, jnp.int32), bias)
  expected = gmm_oracle(lhs, rhs, sizes, "k", bias=bias, activation="gelu",
                        transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                        group_offset=group_offset, num_local=num_local)
  assert out.dtype == jnp.bfloat16 and out.shape == (num_local, m, n)
  np.testing.assert_allclose(f64(out), expected, **tolerances(jnp.bfloat16, k=17))


@pytest.mark.parametrize("carry_bits", [False, True])
@pytest.mark.parametrize("group_type,lhs_shape,rhs_shape,sizes", [
    ("m", (8, 0), (2, 0, 4), [3, 5]),  # K = 0: the epilogue of zero sums
    ("m", (0, 8), (2, 8, 4), [0, 0]),  # M = 0
    ("k", (4, 0), (0, 3), [0, 0]),     # K = 0
    ("k", (0, 6), (6, 3), [2, 4]),     # M = 0
])
def test_zero_sized_16bit_operands(carry_bits, group_type, lhs_shape, rhs_shape, sizes):
  lhs = jnp.zeros(lhs_shape, jnp.bfloat16)
  rhs = jnp.zeros(rhs_shape, jnp.bfloat16)
  cfg = GmmConfig(group_type=group_type, num_local=2, out_dtype=np.dtype(jnp.bfloat16))
  out = jax.jit(lambda a, b, c: xla.gmm_xla(a, b, c, jnp.int32(0), None, cfg, head=False,
                                            carry_bits=carry_bits))(
      lhs, rhs, jnp.asarray(sizes, jnp.int32))
  expected = gmm_oracle(lhs, rhs, sizes, group_type)
  assert out.shape == expected.shape
  np.testing.assert_array_equal(f64(out), expected)


def test_k_grouping_16bit_result_has_no_f32_accumulator():
  # Each group sums into an accumulator of its own and is written once in the result's
  # dtype: no f32 [G, M, N] accumulator (twice the result) besides it.
  m, k, n, num_groups = 128, 64, 256, 32
  lhs = jnp.zeros((k, m), jnp.bfloat16)
  rhs = jnp.zeros((k, n), jnp.bfloat16)
  counts = jnp.full((num_groups,), k // num_groups, jnp.int32)
  cfg = GmmConfig(group_type="k", num_local=num_groups, transpose_lhs=True,
                  out_dtype=np.dtype(jnp.bfloat16))
  compiled = jax.jit(lambda a, b, c: xla.gmm_xla(a, b, c, jnp.int32(0), None, cfg)).lower(
      lhs, rhs, counts).compile()
  result_bytes = num_groups * m * n * 2
  assert compiled.memory_analysis().temp_size_in_bytes < 1.5 * result_bytes


def test_choices_agree_bit_for_bit():
  # The choices only move data differently: the dots and their f32 accumulation are the
  # same, so every choice returns the same bits.
  lhs, rhs, bias = _operands(jnp.bfloat16, False, False, 8, seed=3)
  cfg = GmmConfig(group_type="m", num_local=8, out_dtype=np.dtype(jnp.bfloat16))
  counts = jnp.asarray(SIZES, jnp.int32)
  outs = [jax.jit(lambda a, b, c, h=h, cb=cb: xla.gmm_xla(a, b, c, jnp.int32(0), None, cfg,
                                                          head=h, carry_bits=cb))(
              lhs, rhs, counts) for h, cb in CHOICES]
  for out in outs[1:]:
    np.testing.assert_array_equal(np.asarray(out.astype(jnp.float32)),
                                  np.asarray(outs[0].astype(jnp.float32)))


def test_loop_upcast_probe_is_a_bool():
  assert isinstance(xla.loop_upcasts_16bit(), bool)
  assert isinstance(xla.cpu_has_amx(), bool)


def test_default_never_copies_the_weights_in_f32():
  # The default choice keeps the G weight matrices as they are: no f32 copy of all of them
  # (XLA's upcast of loop-carried bf16), and no bit-pattern copy where XLA does not need it.
  # (Buffers, not HLO text: a fusion may convert inside it without any f32 buffer.)
  num_local, k, n = 8, 256, 256
  rng = np.random.default_rng(0)
  lhs = jnp.asarray(rng.standard_normal((M, k)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((num_local, k, n)), jnp.bfloat16)
  cfg = GmmConfig(group_type="m", num_local=num_local, out_dtype=np.dtype(jnp.bfloat16))
  fn = jax.jit(lambda a, b, c: xla.gmm_xla(a, b, c, jnp.int32(0), None, cfg, head=False))
  compiled = fn.lower(lhs, rhs, jnp.asarray(SIZES, jnp.int32)).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  weight_bytes = rhs.size * 2
  assert temp < (1.5 if xla.loop_upcasts_16bit() else 0.5) * weight_bytes, temp
