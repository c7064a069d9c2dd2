"""The shared gmm test suite, parameterized by the implementation.

Each backend's test file subclasses `GmmTestBase` and sets ``IMPLEMENTATION`` (and
``INTERPRET=True`` for Pallas kernels run in interpret mode on CPU). Shapes stay small
(M, K, N <= 40, G <= 6; one test has a long grouped dimension) so the interpret-mode
kernels stay quick. Every case, forward and gradients, compares against the float64 numpy
oracle in `oracle.py` (`gmm_oracle`, `gmm_oracle_vjp`), with tolerances derived from the
dtypes (`tolerances`, `vjp_tolerances`). `jnp_gmm` (a jnp per-group implementation with static
sizes and slicing loops) serves tests that need a differentiable jax function.
"""

from __future__ import annotations

import functools

import gmm_jax
import hypothesis
import hypothesis.strategies as st
import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from grids import covering
from oracle import (f64, gmm_oracle, gmm_oracle_vjp, local_rows, tolerances,
                    vjp_tolerances)

# Problem sizes of the fixed-shape tests. The grouped dimension is M (m-grouping) or K
# (k-grouping); both are larger than the group totals used below, so rows/columns past the
# total exist.
M, K, N, G = 32, 24, 8, 4

# 4 groups summing to 21 (< M and < K), with empty groups in every position.
EMPTY_PATTERNS = {
    "none": [5, 3, 7, 6],
    "first": [0, 3, 7, 6],
    "middle": [5, 0, 0, 6],
    "last": [5, 3, 7, 0],
    "all": [0, 0, 0, 0],
}
ENCODINGS = ("counts", "cumsum", "sparse")
GROUP_TYPES = ("m", "k")
SIZES_WITH_EMPTY = [4, 0, 9, 6]  # sum 19: an empty middle group and rows past the total
LONG_DIM = 1200  # test_groups_spanning_several_tiles only
# Examples of test_random_problems per implementation in the default run (each draws a new
# shape, so a new compilation: ~1-2 s each in interpret mode on CPU), and of its slow twin
# test_random_problems_thorough.
RANDOM_EXAMPLES = 8
THOROUGH_EXAMPLES = 500
SLOW = pytest.mark.slow


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


# (pytest id, gmm activation, oracle activation). The callables check user activations; the
# sigmoid has f(0) != 0, so it also checks that rows past the total skip the epilogue.
ACTIVATION_CASES = [
    pytest.param(None, None, id="bias_only"),
    pytest.param("relu", "relu", id="relu"),
    pytest.param("gelu_tanh", "gelu_tanh", id="gelu_tanh"),
    pytest.param("gelu", "gelu", id="gelu"),
    pytest.param("fast_gelu", "fast_gelu", id="fast_gelu"),
    pytest.param("silu", "silu", id="silu"),
    pytest.param(jax.nn.tanh, np.tanh, id="callable_tanh"),
    pytest.param(jax.nn.sigmoid, _np_sigmoid, id="callable_sigmoid"),
]

# jnp activations for the autodiff comparison, written independently of gmm_jax.ACTIVATIONS.
JNP_ACTIVATIONS = {
    None: lambda x: x,
    "relu": jax.nn.relu,
    "gelu_tanh": functools.partial(jax.nn.gelu, approximate=True),
    "gelu": functools.partial(jax.nn.gelu, approximate=False),
    "fast_gelu": lambda x: x * jax.nn.sigmoid(1.702 * x),
    "silu": jax.nn.silu,
}


def encode(sizes, encoding: str) -> np.ndarray:
  """Counts -> the group-list encoding, by hand (independent of gmm_jax's decoder)."""
  sizes = np.asarray(sizes, np.int32)
  if encoding == "counts":
    return sizes
  if encoding == "cumsum":
    return np.cumsum(sizes).astype(np.int32)
  assert encoding == "sparse", encoding
  rows = [(g, int(size)) for g, size in enumerate(sizes) if size > 0]
  return np.asarray(rows, np.int32).reshape(-1, 2)


def encoding_kwargs(encoding: str, num_groups: int) -> dict:
  """The gmm keyword arguments that go with a group list of `encoding`."""
  kwargs = dict(group_list_type=encoding)
  if encoding == "sparse":
    kwargs["num_groups"] = num_groups
  return kwargs


def make_operands(group_type, *, m=M, k=K, n=N, num_local=G, lhs_dtype=np.float32,
                  rhs_dtype=None, transpose_lhs=False, transpose_rhs=False, with_bias=False,
                  seed=0):
  """Random lhs, rhs and bias (None unless `with_bias`), stored as the flags say."""
  rng = np.random.default_rng(seed)
  rhs_dtype = lhs_dtype if rhs_dtype is None else rhs_dtype

  def sample(shape, dtype):
    if np.issubdtype(np.dtype(dtype), np.integer):
      return rng.integers(-8, 9, size=shape).astype(dtype)
    return jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)

  lhs = sample((k, m) if transpose_lhs else (m, k), lhs_dtype)
  rhs_matrix = (n, k) if transpose_rhs else (k, n)
  rhs = sample(((num_local,) if group_type == "m" else ()) + rhs_matrix, rhs_dtype)
  bias = sample((num_local, n), lhs_dtype) if with_bias else None
  return lhs, rhs, bias


def jnp_gmm(lhs, rhs, bias, sizes, group_type, activation=None, transpose_lhs=False,
            transpose_rhs=False, group_offset=0, num_local=None):
  """A plain jnp gmm with static `sizes`: slicing loops, one dot per group (for autodiff)."""
  act = JNP_ACTIVATIONS[activation]
  lhs = lhs.T if transpose_lhs else lhs
  rhs = jnp.swapaxes(rhs, -1, -2) if transpose_rhs else rhs
  m, k = lhs.shape
  n = rhs.shape[-1]
  sizes = [int(s) for s in sizes]
  dot = functools.partial(jnp.matmul, precision=jax.lax.Precision.HIGHEST)

  def epilogue(acc, local):
    return act(acc if bias is None else acc + bias[local])

  if group_type == "m":
    num_local = rhs.shape[0] if num_local is None else num_local
    pieces, start = [], 0
    for g, size in enumerate(sizes):
      local = g - group_offset
      rows = lhs[start:start + size]
      if 0 <= local < num_local:
        pieces.append(epilogue(dot(rows, rhs[local]), local))
      else:
        pieces.append(jnp.zeros((size, n), lhs.dtype))
      start += size
    pieces.append(jnp.zeros((m - start, n), lhs.dtype))
    return jnp.concatenate(pieces, axis=0)
  num_local = len(sizes) if num_local is None else num_local
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  outs = []
  for local in range(num_local):
    g = group_offset + local
    if g < len(sizes):
      acc = dot(lhs[:, starts[g]:starts[g + 1]], rhs[starts[g]:starts[g + 1]])
    else:
      acc = jnp.zeros((m, n), lhs.dtype)
    outs.append(epilogue(acc, local))
  return jnp.stack(outs)


@st.composite
def group_sizes(draw, num_groups: int, dim: int):
  """Sizes of `num_groups` groups summing to at most `dim`, often with empty groups."""
  cap = max(1, 2 * dim // num_groups)
  sizes = draw(st.lists(st.integers(0, cap), min_size=num_groups, max_size=num_groups))
  empty = draw(st.lists(st.booleans(), min_size=num_groups, max_size=num_groups))
  out, left = [], dim
  for size, is_empty in zip(sizes, empty):
    size = 0 if is_empty else min(size, left)
    out.append(size)
    left -= size
  return out


@st.composite
def random_problems(draw, group_type: str):
  m = draw(st.integers(1, 40))
  k = draw(st.integers(1, 40))
  n = draw(st.integers(1, 16))
  num_groups = draw(st.integers(1, 6))
  sizes = draw(group_sizes(num_groups, m if group_type == "m" else k))
  return dict(
      m=m, k=k, n=n, sizes=sizes,
      encoding=draw(st.sampled_from(ENCODINGS)),
      transpose_lhs=draw(st.booleans()),
      transpose_rhs=draw(st.booleans()),
      with_bias=draw(st.booleans()),
      seed=draw(st.integers(0, 2**16)),
  )


class GmmTestBase:
  """The gmm tests every implementation must pass. Subclasses set IMPLEMENTATION."""

  IMPLEMENTATION: str = "xla"
  INTERPRET: bool = False

  # ----------------------------------------------------------------------------- helpers

  def gmm(self, *args, **kwargs):
    return gmm_jax.gmm(*args, implementation=self.IMPLEMENTATION, interpret=self.INTERPRET,
                       **kwargs)


  def check(self, out, lhs, rhs, sizes, group_type, *, bias=None, activation=None,
            out_dtype=None, transpose_lhs=False, transpose_rhs=False, group_offset=0,
            num_local=None, zero_activation=True):
    """Compares `out` with the oracle, and checks exact zeros where nothing was computed.

    `zero_activation`: activation(0) == 0 (so a k-group with no columns and no bias must be
    exactly 0).
    """
    out_dtype = jnp.result_type(lhs.dtype, rhs.dtype) if out_dtype is None else out_dtype
    assert out.dtype == out_dtype, (out.dtype, out_dtype)
    expected = gmm_oracle(lhs, rhs, sizes, group_type, bias=bias, activation=activation,
                          transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                          group_offset=group_offset, num_local=num_local)
    assert out.shape == expected.shape, (out.shape, expected.shape)
    contraction = lhs.shape[0] if transpose_lhs else lhs.shape[1]
    got = f64(out)
    np.testing.assert_allclose(
        got, expected, **tolerances(lhs.dtype, rhs.dtype, out.dtype, k=contraction))
    if group_type == "m":
      computed = local_rows(sizes, out.shape[0], group_offset,
                            rhs.shape[0] if num_local is None else num_local)
      not_computed = got[~computed]
      assert np.all(not_computed == 0), (
          f"rows outside the local groups/past the total must be exactly 0; nonzero rows "
          f"{np.nonzero(~computed)[0][np.any(not_computed != 0, axis=1)].tolist()}")
    elif bias is None and zero_activation:
      for local in range(out.shape[0]):
        g = group_offset + local
        if g >= len(sizes) or sizes[g] == 0:
          assert np.all(got[local] == 0), f"group {g} has no columns: must be exactly 0"

  def check_vjp(self, grads, lhs, rhs, bias, sizes, group_type, cotangent, *, activation=None,
                transpose_lhs=False, transpose_rhs=False, group_offset=0, num_local=None):
    """Compares gradients (dlhs, drhs[, dbias]) with the numpy oracle's, at tolerances from
    the operands' dtype; each keeps its primal's shape and dtype."""
    options = dict(activation=activation, transpose_lhs=transpose_lhs,
                   transpose_rhs=transpose_rhs)
    want = gmm_oracle_vjp(lhs, rhs, sizes, group_type, cotangent, bias=bias,
                          group_offset=group_offset, num_local=num_local, **options)
    tols = vjp_tolerances(lhs.dtype, lhs, rhs, sizes, group_type, cotangent, **options)
    for name, primal, got, expected in zip(("lhs", "rhs", "bias"), (lhs, rhs, bias), grads,
                                           want):
      if primal is None:
        continue
      assert got.shape == primal.shape and got.dtype == primal.dtype, (
          name, got.shape, got.dtype, primal.shape, primal.dtype)
      np.testing.assert_allclose(f64(got), expected, err_msg=f"d{name}", **tols[name])

  # ----------------------------------------------------------------------- group lists

  @pytest.mark.parametrize("pattern", list(EMPTY_PATTERNS))
  @pytest.mark.parametrize("encoding", ENCODINGS)
  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_group_list_encodings(self, group_type, encoding, pattern):
    sizes = EMPTY_PATTERNS[pattern]
    lhs, rhs, _ = make_operands(group_type, seed=1)
    out = self.gmm(lhs, rhs, encode(sizes, encoding), group_type=group_type,
                   **encoding_kwargs(encoding, G))
    self.check(out, lhs, rhs, sizes, group_type)

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_sparse_list_with_explicit_empty_entries(self, group_type):
    sizes = [5, 0, 0, 6]
    group_list = np.array([[0, 5], [1, 0], [2, 0], [3, 6]], np.int32)
    lhs, rhs, bias = make_operands(group_type, with_bias=True, seed=2)
    out = self.gmm(lhs, rhs, group_list, group_type=group_type, group_list_type="sparse",
                   num_groups=G, bias=bias)
    self.check(out, lhs, rhs, sizes, group_type, bias=bias)

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_sizes_fill_the_grouped_dimension(self, group_type):
    dim = M if group_type == "m" else K
    sizes = [9, 0, 5, dim - 14]
    lhs, rhs, _ = make_operands(group_type, seed=3)
    out = self.gmm(lhs, rhs, np.asarray(sizes, np.int32), group_type=group_type)
    self.check(out, lhs, rhs, sizes, group_type)

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_zero_groups(self, group_type):
    # G = 0 (as jax.lax.ragged_dot allows): "m" gives all-zero rows, "k" an empty stack.
    lhs, rhs, _ = make_operands(group_type, num_local=0, seed=22)
    out = self.gmm(lhs, rhs, np.zeros((0,), np.int32), group_type=group_type)
    self.check(out, lhs, rhs, [], group_type)

  @pytest.mark.parametrize("group_type, dims", [
      pytest.param("m", dict(m=0), id="m-M0"),
      pytest.param("m", dict(k=0), id="m-K0"),
      pytest.param("k", dict(k=0), id="k-K0"),
      pytest.param("k", dict(n=0), id="k-N0"),
  ])
  def test_zero_sized_dims(self, group_type, dims):
    lhs, rhs, bias = make_operands(group_type, with_bias=True, seed=23, **dims)
    grouped_dim = lhs.shape[0] if group_type == "m" else lhs.shape[1]
    sizes = [grouped_dim // 2, 0, grouped_dim - grouped_dim // 2, 0]
    out = self.gmm(lhs, rhs, np.asarray(sizes, np.int32), group_type=group_type, bias=bias,
                   activation="silu")
    self.check(out, lhs, rhs, sizes, group_type, bias=bias, activation="silu")

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_groups_spanning_several_tiles(self, group_type):
    # The only test with a long grouped dimension: groups longer than one tile and groups
    # straddling tile boundaries (the XLA path's default tiles are 256 rows of M and 512 of
    # K; the other shapes here all fit in one tile). N and the other dims stay tiny.
    if group_type == "m":
      dims, sizes = dict(m=LONG_DIM, k=8, n=4), [300, 0, 5, 260, 100]
    else:
      dims, sizes = dict(m=4, k=LONG_DIM, n=4), [600, 0, 13, 530, 0]
    lhs, rhs, bias = make_operands(group_type, num_local=len(sizes), with_bias=True, seed=24,
                                   **dims)
    out = self.gmm(lhs, rhs, encode(sizes, "cumsum"), group_type=group_type,
                   group_list_type="cumsum", bias=bias, activation="silu")
    self.check(out, lhs, rhs, sizes, group_type, bias=bias, activation="silu")

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_non_finite_values_past_the_total_are_inert(self, group_type):
    # Rows (m) or columns (k) past the total are often uninitialized padding: NaN/inf there
    # must neither reach the groups nor the zero rows of the output.
    sizes = SIZES_WITH_EMPTY
    total = sum(sizes)
    lhs, rhs, bias = make_operands(group_type, with_bias=True, seed=25)
    lhs, rhs = np.array(lhs), np.array(rhs)
    if group_type == "m":
      lhs[total:] = np.nan
      lhs[total::2, 0] = np.inf
    else:
      lhs[:, total:] = np.nan
      rhs[total:] = -np.inf
    out = self.gmm(lhs, rhs, np.asarray(sizes, np.int32), group_type=group_type, bias=bias,
                   activation="relu")
    self.check(out, lhs, rhs, sizes, group_type, bias=bias, activation="relu")

  # ------------------------------------------------------------- layouts and epilogues

  @pytest.mark.parametrize("transpose_lhs, transpose_rhs",
                           [(True, False), (False, True), (True, True)])
  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_transposes(self, group_type, transpose_lhs, transpose_rhs):
    lhs, rhs, bias = make_operands(group_type, transpose_lhs=transpose_lhs,
                                   transpose_rhs=transpose_rhs, with_bias=True, seed=4)
    out = self.gmm(lhs, rhs, np.asarray(SIZES_WITH_EMPTY, np.int32), group_type=group_type,
                   bias=bias, transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
    self.check(out, lhs, rhs, SIZES_WITH_EMPTY, group_type, bias=bias,
               transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)

  @pytest.mark.parametrize("activation, np_activation", ACTIVATION_CASES)
  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_bias_and_activation(self, group_type, activation, np_activation):
    # For "k" the empty group must give activation(bias); for "m" the rows past the total
    # must stay exactly 0 even though activation(bias) is not 0.
    lhs, rhs, bias = make_operands(group_type, with_bias=True, seed=5)
    out = self.gmm(lhs, rhs, np.asarray(SIZES_WITH_EMPTY, np.int32), group_type=group_type,
                   bias=bias, activation=activation)
    self.check(out, lhs, rhs, SIZES_WITH_EMPTY, group_type, bias=bias,
               activation=np_activation)

  @pytest.mark.parametrize("activation, np_activation", [
      pytest.param("gelu", "gelu", id="gelu"),
      pytest.param(jax.nn.sigmoid, _np_sigmoid, id="callable_sigmoid"),
  ])
  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_activation_without_bias(self, group_type, activation, np_activation):
    lhs, rhs, _ = make_operands(group_type, seed=6)
    out = self.gmm(lhs, rhs, np.asarray(SIZES_WITH_EMPTY, np.int32), group_type=group_type,
                   activation=activation)
    self.check(out, lhs, rhs, SIZES_WITH_EMPTY, group_type, activation=np_activation,
               zero_activation=activation == "gelu")

  # ------------------------------------------------------------------------------ dtypes

  # Default run: bf16 untransposed and f16 transposed; the other two pairs with -m slow.
  @covering(("dtype", [jnp.bfloat16, jnp.float16]),
            ("transpose_lhs, transpose_rhs", [(False, False), (True, True)]))
  def test_16bit_small_and_large_groups(self, dtype, transpose_lhs, transpose_rhs):
    # Mean group of 12 rows, groups from 0 to 40 rows: in 16-bit the XLA path computes the
    # first rows of every group in one batched dot and the rest in its work-item loops.
    sizes = [0, 40, 3, 16, 17, 1, 0, 10]
    m, num_local = 96, len(sizes)
    lhs, rhs, bias = make_operands("m", m=m, num_local=num_local, lhs_dtype=dtype,
                                   transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                                   with_bias=True, seed=7)
    flags = dict(transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
    out = self.gmm(lhs, rhs, np.asarray(sizes, np.int32), bias=bias, activation="gelu_tanh",
                   **flags)
    self.check(out, lhs, rhs, sizes, "m", bias=bias, activation="gelu_tanh", **flags)

    # Gradients in 16 bits against the numpy oracle (the cotangent rounded to the dtype, as
    # the output's is), at tolerances from the dtype and the operands' magnitudes.
    cotangent = jnp.asarray(np.cos(np.arange(m * N)).reshape(m, N), dtype)
    _, grads = self._vjp(
        lambda lhs, rhs, bias: self.gmm(lhs, rhs, np.asarray(sizes, np.int32), bias=bias,
                                        activation="silu", **flags),
        (lhs, rhs, bias), cotangent)
    self.check_vjp(grads, lhs, rhs, bias, sizes, "m", cotangent, activation="silu", **flags)


  # Default run: each dtype combination once, the group types alternating (-m slow: both).
  @covering(("group_type", GROUP_TYPES), ("lhs_dtype, rhs_dtype, preferred, out_dtype", [
      pytest.param(jnp.float32, jnp.float32, None, jnp.float32, id="f32"),
      pytest.param(jnp.bfloat16, jnp.bfloat16, None, jnp.bfloat16, id="bf16"),
      pytest.param(jnp.float16, jnp.float16, None, jnp.float16, id="f16"),
      pytest.param(jnp.bfloat16, jnp.float32, None, jnp.float32, id="bf16_x_f32"),
      pytest.param(jnp.bfloat16, jnp.bfloat16, jnp.float32, jnp.float32, id="bf16_to_f32"),
      pytest.param(jnp.float32, jnp.float32, jnp.bfloat16, jnp.bfloat16, id="f32_to_bf16"),
  ]))
  def test_dtypes(self, group_type, lhs_dtype, rhs_dtype, preferred, out_dtype):
    lhs, rhs, bias = make_operands(group_type, lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype,
                                   with_bias=True, seed=7)
    out = self.gmm(lhs, rhs, np.asarray(SIZES_WITH_EMPTY, np.int32), group_type=group_type,
                   bias=bias, preferred_element_type=preferred)
    self.check(out, lhs, rhs, SIZES_WITH_EMPTY, group_type, bias=bias, out_dtype=out_dtype)

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_bf16_accumulates_in_f32(self, group_type):
    # 256 + 23 * 1: exact in f32, but a bf16 accumulator (spacing 2 at 256) stays at 256.
    lhs = np.ones((M, K), np.float32)
    lhs[:, 0] = 256.0
    sizes = [M, 0, 0, 0] if group_type == "m" else [K, 0, 0, 0]
    rhs = np.ones((G, K, N) if group_type == "m" else (K, N), np.float32)
    out = self.gmm(jnp.asarray(lhs, jnp.bfloat16), jnp.asarray(rhs, jnp.bfloat16),
                   np.asarray(sizes, np.int32), group_type=group_type,
                   preferred_element_type=jnp.float32)
    computed = f64(out if group_type == "m" else out[0])
    np.testing.assert_array_equal(computed, np.full((M, N), 256.0 + K - 1))

  # Default run: each variant once, the group types alternating (-m slow: both).
  @covering(("group_type", GROUP_TYPES), ("variant", ["plain", "int32_bias", "int32_bias_relu"]))
  def test_int8_to_int32_is_exact(self, group_type, variant):
    lhs, rhs, _ = make_operands(group_type, lhs_dtype=np.int8, seed=8)
    bias = None
    if variant != "plain":
      bias = np.random.default_rng(9).integers(-1000, 1000, size=(G, N)).astype(np.int32)
    activation = "relu" if variant.endswith("relu") else None
    out = self.gmm(lhs, rhs, np.asarray(SIZES_WITH_EMPTY, np.int32), group_type=group_type,
                   bias=bias, activation=activation, preferred_element_type=jnp.int32)
    assert out.dtype == jnp.int32
    expected = gmm_oracle(lhs, rhs, SIZES_WITH_EMPTY, group_type, bias=bias,
                          activation=activation)
    np.testing.assert_array_equal(np.asarray(out), expected.astype(np.int64))

  # ------------------------------------------------------------------------ group_offset

  @pytest.mark.parametrize("offset, encoding", [
      (0, "counts"), (1, "counts"), (2, "cumsum"), (3, "sparse"), (4, "counts")])
  def test_group_offset_m(self, offset, encoding):
    # rhs holds 2 of the 4 groups: [offset, offset + 2); rows of other groups are exactly 0
    # (offset 3: only group 3 exists; offset 4: no local group at all).
    sizes, num_local = [5, 0, 7, 6], 2
    lhs, rhs, bias = make_operands("m", num_local=num_local, with_bias=True, seed=10)
    kwargs = encoding_kwargs(encoding, len(sizes))
    out = self.gmm(lhs, rhs, encode(sizes, encoding), group_type="m", bias=bias,
                   activation="silu", group_offset=offset, **kwargs)
    self.check(out, lhs, rhs, sizes, "m", bias=bias, activation="silu", group_offset=offset)

  @pytest.mark.parametrize("offset, encoding", [
      (0, "counts"), (1, "cumsum"), (2, "cumsum"), (3, "counts"), (4, "counts")])
  def test_group_offset_k(self, offset, encoding):
    # The output holds groups [offset, offset + 2) of 4; those past the list give
    # activation(bias). (No sparse list here: for "k" its num_groups is both the list's G
    # and the output's group count, so it cannot select a slice.)
    sizes, num_local = [5, 0, 7, 6], 2
    lhs, rhs, bias = make_operands("k", num_local=num_local, with_bias=True, seed=11)
    out = self.gmm(lhs, rhs, encode(sizes, encoding), group_type="k", bias=bias,
                   activation="gelu_tanh", group_offset=offset,
                   group_list_type=encoding, num_groups=num_local)
    self.check(out, lhs, rhs, sizes, "k", bias=bias, activation="gelu_tanh",
               group_offset=offset, num_local=num_local)

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_traced_group_offset_under_jit(self, group_type):
    sizes, num_local = [5, 0, 7, 6], 2
    lhs, rhs, bias = make_operands(group_type, num_local=num_local, with_bias=True, seed=12)
    traces = []

    @jax.jit
    def run(lhs, rhs, bias, group_list, offset):
      traces.append(None)
      return self.gmm(lhs, rhs, group_list, group_type=group_type, bias=bias,
                      activation="relu", group_offset=offset, num_groups=num_local
                      if group_type == "k" else None)

    for offset in range(len(sizes) + 1):
      out = run(lhs, rhs, bias, np.asarray(sizes, np.int32), jnp.int32(offset))
      self.check(out, lhs, rhs, sizes, group_type, bias=bias, activation="relu",
                 group_offset=offset, num_local=num_local)
    assert len(traces) == 1

  # -------------------------------------------------------------------------- hypothesis

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  @hypothesis.settings(max_examples=RANDOM_EXAMPLES)
  @hypothesis.given(data=st.data())
  def test_random_problems(self, group_type, data):
    self._check_random_problem(group_type, data)

  @pytest.mark.slow
  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  @hypothesis.settings(max_examples=THOROUGH_EXAMPLES)
  @hypothesis.given(data=st.data())
  def test_random_problems_thorough(self, group_type, data):
    # The same property with 60x the default run's examples (`pytest -m slow`): minutes per
    # implementation, hours for all of them in interpret mode, so not in the default run.
    self._check_random_problem(group_type, data)

  def _check_random_problem(self, group_type, data):
    problem = data.draw(random_problems(group_type), label="problem")
    sizes = problem["sizes"]
    num_groups = len(sizes)
    lhs, rhs, bias = make_operands(
        group_type, m=problem["m"], k=problem["k"], n=problem["n"], num_local=num_groups,
        transpose_lhs=problem["transpose_lhs"], transpose_rhs=problem["transpose_rhs"],
        with_bias=problem["with_bias"], seed=problem["seed"])
    encoding = problem["encoding"]
    out = self.gmm(lhs, rhs, encode(sizes, encoding), group_type=group_type, bias=bias,
                   transpose_lhs=problem["transpose_lhs"],
                   transpose_rhs=problem["transpose_rhs"],
                   **encoding_kwargs(encoding, num_groups))
    self.check(out, lhs, rhs, sizes, group_type, bias=bias,
               transpose_lhs=problem["transpose_lhs"], transpose_rhs=problem["transpose_rhs"])

  # ------------------------------------------------------------------------- compilation

  @pytest.mark.parametrize("group_type, encoding", [
      ("m", "counts"), ("m", "sparse"), ("k", "cumsum"), ("k", "sparse")])
  def test_traced_group_list_compiles_once(self, group_type, encoding):
    lhs, rhs, bias = make_operands(group_type, with_bias=True, seed=13)
    traces = []

    @jax.jit
    def run(lhs, rhs, bias, group_list):
      traces.append(None)
      return self.gmm(lhs, rhs, group_list, group_type=group_type, bias=bias,
                      **encoding_kwargs(encoding, G))

    # The same number of sparse entries each time, so only the values change.
    for sizes in ([5, 3, 0, 9], [0, 11, 2, 6], [1, 0, 20, 1]):
      out = run(lhs, rhs, bias, encode(sizes, encoding))
      self.check(out, lhs, rhs, sizes, group_type, bias=bias)
    assert len(traces) == 1
    if hasattr(run, "_cache_size"):
      assert run._cache_size() == 1

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_deterministic(self, group_type):
    lhs, rhs, bias = make_operands(group_type, lhs_dtype=jnp.bfloat16, with_bias=True,
                                   seed=14)
    group_list = np.asarray(SIZES_WITH_EMPTY, np.int32)
    run = functools.partial(self.gmm, lhs, rhs, group_list, group_type=group_type, bias=bias,
                            activation="gelu", preferred_element_type=jnp.float32)
    first, second = np.asarray(run()), np.asarray(run())
    assert first.tobytes() == second.tobytes()
    assert np.any(first != 0)

  # --------------------------------------------------------------------------- gradients

  @staticmethod
  def _vjp(fn, primals, cotangent):
    """(fn(*primals), its vjp at `cotangent`), compiled as one program (faster than eager)."""

    @jax.jit
    def run(primals, cotangent):
      out, pullback = jax.vjp(fn, *primals)
      return out, pullback(cotangent)

    return run(tuple(primals), cotangent)

  # Default run: each layout once, the group types alternating (-m slow: both); the other
  # gradient tests below run both group types untransposed.
  @covering(("group_type", GROUP_TYPES), ("activation, transpose_lhs, transpose_rhs, with_bias", [
      # (No-transpose, bias + activation: test_vjp_group_offset_under_jit.)
      pytest.param(None, True, True, False, id="plain_tboth"),
      pytest.param("silu", True, False, True, id="bias_silu_tlhs"),
      pytest.param("fast_gelu", False, True, False, id="fast_gelu_trhs"),
  ]))
  def test_vjp_matches_oracle(self, group_type, activation, transpose_lhs, transpose_rhs,
                              with_bias):
    sizes = SIZES_WITH_EMPTY
    lhs, rhs, bias = make_operands(group_type, transpose_lhs=transpose_lhs,
                                   transpose_rhs=transpose_rhs, with_bias=True, seed=15)
    bias = bias if with_bias else None
    options = dict(group_type=group_type, activation=activation,
                   transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
    cotangent = jnp.asarray(np.random.default_rng(16).standard_normal(
        (M, N) if group_type == "m" else (G, M, N)), jnp.float32)
    out, grads = self._vjp(
        lambda lhs, rhs, bias: self.gmm(lhs, rhs, np.asarray(sizes, np.int32), bias=bias,
                                        **options),
        (lhs, rhs, bias), cotangent)
    self.check(out, lhs, rhs, sizes, bias=bias, **options)
    self.check_vjp(grads, lhs, rhs, bias, sizes, cotangent=cotangent, **options)

  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_vjp_group_offset_under_jit(self, group_type):
    # Only groups [1, 3) of 4 are local: everything the other groups touch gets exactly
    # zero gradient.
    sizes, offset, num_local = [5, 6, 7, 4], 1, 2
    lhs, rhs, bias = make_operands(group_type, num_local=num_local, with_bias=True, seed=17)
    options = dict(group_type=group_type, activation="silu", num_local=num_local)
    cotangent = jnp.asarray(np.random.default_rng(18).standard_normal(
        (M, N) if group_type == "m" else (num_local, M, N)), jnp.float32)

    @jax.jit  # the group list and the offset are traced
    def with_gmm(lhs, rhs, bias, group_list, offset):
      return jax.vjp(
          lambda lhs, rhs, bias: self.gmm(
              lhs, rhs, group_list, group_type=group_type, bias=bias, activation="silu",
              group_offset=offset, num_groups=num_local if group_type == "k" else None),
          lhs, rhs, bias)[1](cotangent)

    grads = with_gmm(lhs, rhs, bias, np.asarray(sizes, np.int32), jnp.int32(offset))
    self.check_vjp(grads, lhs, rhs, bias, sizes, cotangent=cotangent, group_offset=offset,
                   **options)
    dim = M if group_type == "m" else K
    not_local = ~local_rows(sizes, dim, offset, num_local)
    dlhs, drhs = np.asarray(grads[0]), np.asarray(grads[1])
    if group_type == "m":
      assert np.all(dlhs[not_local] == 0)
    else:
      assert np.all(dlhs[:, not_local] == 0) and np.all(drhs[not_local] == 0)

  # Default run: bf16 (f32 gradients: test_vjp_matches_oracle and the tests around it; f16:
  # test_16bit_small_and_large_groups); f32 and f16 here with -m slow.
  @pytest.mark.parametrize("dtype", [pytest.param(jnp.float32, marks=SLOW), jnp.bfloat16,
                                     pytest.param(jnp.float16, marks=SLOW)])
  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_vjp_in_each_dtype_matches_oracle(self, group_type, dtype):
    # Every implementation, the reference included, against numpy (not against another
    # implementation): 16-bit gradients at tolerances from the dtype.
    lhs, rhs, bias = make_operands(group_type, lhs_dtype=dtype, with_bias=True, seed=19)
    group_list = encode(SIZES_WITH_EMPTY, "cumsum")

    def fn(lhs, rhs, bias):
      return self.gmm(lhs, rhs, group_list, group_type=group_type, group_list_type="cumsum",
                      bias=bias, activation="gelu")

    cotangent = jnp.asarray(np.random.default_rng(20).standard_normal(
        (M, N) if group_type == "m" else (G, M, N)), dtype)
    out, grads = self._vjp(fn, (lhs, rhs, bias), cotangent)
    self.check(out, lhs, rhs, SIZES_WITH_EMPTY, group_type, bias=bias, activation="gelu")
    self.check_vjp(grads, lhs, rhs, bias, SIZES_WITH_EMPTY, group_type, cotangent,
                   activation="gelu")
    for name, grad in zip(("lhs", "rhs", "bias"), grads):
      assert np.any(f64(grad) != 0), name

  # Default run: f32; the bf16 twin with -m slow.
  @pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16, marks=SLOW)])
  @pytest.mark.parametrize("group_type", GROUP_TYPES)
  def test_empty_groups_get_exactly_zero_weight_gradient(self, group_type, dtype):
    # tokamax#887: an empty group's weight (and bias) gradient must be exactly 0, not the
    # leftovers of a tile or of rows past the total. m-grouping: drhs[g] and dbias[g] of the
    # empty groups (first, middle, last). k-grouping is the weight-gradient form itself
    # (dW = x^T dz, lhs stored transposed): an empty group's result is exactly its bias (0
    # without one), whatever the columns past the total hold, and the gradients of those
    # columns are exactly 0.
    sizes = [0, 7, 0, 9, 0]
    num_local, dim = len(sizes), M if group_type == "m" else K
    transpose_lhs = group_type == "k"
    lhs, rhs, bias = make_operands(group_type, num_local=num_local, lhs_dtype=dtype,
                                   transpose_lhs=transpose_lhs, with_bias=True, seed=26)
    group_list = np.asarray(sizes, np.int32)
    empty = [g for g, size in enumerate(sizes) if size == 0]
    past_total = ~local_rows(sizes, dim)
    rng = np.random.default_rng(27)
    if group_type == "m":
      cotangent = jnp.asarray(rng.standard_normal((M, N)), dtype)
      _, (dlhs, drhs, dbias) = self._vjp(
          lambda lhs, rhs, bias: self.gmm(lhs, rhs, group_list, bias=bias, activation="silu"),
          (lhs, rhs, bias), cotangent)
      for g in empty:
        assert np.all(f64(drhs[g]) == 0), f"drhs of empty group {g}: {f64(drhs[g])}"
        assert np.all(f64(dbias[g]) == 0), f"dbias of empty group {g}: {f64(dbias[g])}"
      assert np.all(f64(dlhs)[past_total] == 0)
      nonempty = [g for g in range(num_local) if g not in empty]
      assert all(np.any(f64(drhs[g]) != 0) for g in nonempty)
      return
    # Columns past the total hold large values: they must reach no group.
    lhs = np.array(lhs)
    lhs[past_total] = 1e4  # lhs is stored [K, M]
    lhs = jnp.asarray(lhs, dtype)
    options = dict(group_type="k", transpose_lhs=True)
    for with_bias in (False, True):
      b = bias if with_bias else None
      out = self.gmm(lhs, rhs, group_list, bias=b, **options)
      for g in empty:
        want = np.broadcast_to(f64(bias[g]) if with_bias else 0.0, (M, N))
        np.testing.assert_array_equal(f64(out[g]), want, err_msg=f"empty group {g}")
      cotangent = jnp.asarray(rng.standard_normal((num_local, M, N)), dtype)
      _, (dlhs, drhs, *_) = self._vjp(
          lambda lhs, rhs, b: self.gmm(lhs, rhs, group_list, bias=b, **options),
          (lhs, rhs, b), cotangent)
      assert np.all(f64(dlhs)[past_total] == 0) and np.all(f64(drhs)[past_total] == 0)

  # Default run: m-grouping (k-grouping's gradients against numpy: the vjp tests above; its
  # finite differences with -m slow).
  @pytest.mark.parametrize("group_type, activation", [
      ("m", "silu"), pytest.param("k", "gelu_tanh", marks=SLOW)])
  def test_check_grads(self, group_type, activation):
    m, k, n, sizes = 8, 6, 3, [3, 0, 2]
    lhs, rhs, bias = make_operands(group_type, m=m, k=k, n=n, num_local=len(sizes),
                                   with_bias=True, seed=21)
    group_list = np.asarray(sizes, np.int32)

    def fn(lhs, rhs, bias):
      return self.gmm(lhs, rhs, group_list, group_type=group_type, bias=bias,
                      activation=activation)

    jax.test_util.check_grads(fn, (lhs, rhs, bias), order=1, modes=("rev",), eps=1e-3,
                              atol=1e-2, rtol=1e-2)


def lowering_problem(group_type, shape, case, num_local=4):
  """Operands and gmm options of one cross-lowering case.

  `case` is ``(lhs dtype, rhs dtype, preferred_element_type, transpose_lhs, transpose_rhs,
  activation)``; integer operands get an int32 bias.

  Returns:
    (lhs, rhs, bias, options for gmm_jax.gmm).
  """
  lhs_dtype, rhs_dtype, preferred, transpose_lhs, transpose_rhs, activation = case
  m, k, n = shape
  lhs, rhs, bias = make_operands(group_type, m=m, k=k, n=n, num_local=num_local,
                                 lhs_dtype=lhs_dtype, rhs_dtype=rhs_dtype,
                                 transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                                 with_bias=True)
  if jnp.issubdtype(lhs_dtype, jnp.integer):
    bias = jnp.asarray(bias, jnp.int32)
  options = dict(group_type=group_type, activation=activation, transpose_lhs=transpose_lhs,
                 transpose_rhs=transpose_rhs, preferred_element_type=preferred,
                 num_groups=num_local if group_type == "k" else None)
  return lhs, rhs, bias, options
