"""The `lax_ragged_dot` implementation (one `jax.lax.ragged_dot_general` and the epilogue)
against the numpy oracle, and its place in the accelerators' chains.

The shared suite (`GmmTestBase`) runs on it; the tests below add what that suite does not
check for it: gated activations for both group types, values of non-local groups that must
stay inert (local groups are expressed through the group sizes), gradients of both group
types against numpy (f32 and 16-bit), vmap, the refusals, and the chains.
"""

from __future__ import annotations

import functools

import gmm_jax
import jax
import jax.test_util
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_test_base import GmmTestBase, make_operands
from grids import covering
from oracle import GATED, f64, gmm_oracle, local_rows, rows_oracle, tolerances

from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.backends.lax_ragged_dot import gmm_lax_ragged

NAME = "lax_ragged_dot"
gmm = functools.partial(gmm_jax.gmm, implementation=NAME)


# The whole shared suite runs with `-m slow` (about 4 CPU-minutes): lax_ragged_dot is the TPU
# chain's fallback, and the module-level tests below hold it to the oracle in the default run
# (both group types, gated activations, offsets, 16-bit dtypes, gradients, vmap).
@pytest.mark.slow
class TestLaxRagged(GmmTestBase):
  IMPLEMENTATION = NAME

  @pytest.mark.parametrize("group_type", ["m", "k"])
  def test_int8_to_int32_is_exact(self, group_type):
    # Integer accumulation is refused (next in a chain: "xla"), never computed in floats.
    lhs, rhs, _ = make_operands(group_type, lhs_dtype=np.int8, seed=8)
    sizes = np.asarray([4, 0, 9, 6], np.int32)
    with pytest.raises(NotImplementedError, match="float operands"):
      self.gmm(lhs, rhs, sizes, group_type=group_type, preferred_element_type=jnp.int32)
    out = gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, preferred_element_type=jnp.int32,
                      implementation=(NAME, "xla"))
    np.testing.assert_array_equal(np.asarray(out), gmm_oracle(lhs, rhs, sizes, group_type))


SIZES = [5, 0, 7, 6]  # sum 18 < M, K: an empty group and rows past the total
M, K, N = 24, 20, 6


def _operands(group_type, *, num_local, dtype=np.float32, n=N, transpose_lhs=False,
              transpose_rhs=False, seed=0):
  return make_operands(group_type, m=M, k=K, n=n, num_local=num_local, lhs_dtype=dtype,
                       transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                       with_bias=True, seed=seed)


# ------------------------------------------------------------------------------ forward


@pytest.mark.parametrize("activation", ["swiglu", "geglu", "swiglu_clamped"])
@pytest.mark.parametrize("transpose_lhs, transpose_rhs", [(False, False), (True, True)])
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_gated_activation(group_type, activation, transpose_lhs, transpose_rhs):
  # The gate and up halves of each row pair up after the whole product: the gated numpy
  # activation of the ungated oracle (non-local rows are 0 there, and gated(0) = 0).
  lhs, rhs, bias = _operands(group_type, num_local=len(SIZES), n=2 * N,
                             transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs, seed=1)
  flags = dict(transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
  out = gmm(lhs, rhs, np.asarray(SIZES, np.int32), group_type=group_type, bias=bias,
            activation=activation, **flags)
  want = GATED[activation](gmm_oracle(lhs, rhs, SIZES, group_type, bias=bias, **flags))
  assert out.shape == want.shape
  np.testing.assert_allclose(f64(out), want, **tolerances(np.float32, k=K))


@pytest.mark.parametrize("offset", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_non_local_values_are_inert(group_type, offset):
  # Local groups are expressed through the sizes: m-grouping computes the rows before the
  # first local group with local group 0's weights and masks them, k-grouping gives the
  # columns before and after the local groups groups of their own. NaN and inf there must
  # reach neither the local groups nor the zero rows.
  num_local = 2
  lhs, rhs, bias = _operands(group_type, num_local=num_local, seed=2)
  lhs, rhs = np.array(lhs), np.array(rhs)
  grouped = M if group_type == "m" else K
  local = local_rows(SIZES, grouped, offset, num_local)
  if group_type == "m":
    lhs[~local] = np.nan
    lhs[~local, 0] = np.inf
  else:
    lhs[:, ~local] = np.nan
    rhs[~local] = -np.inf
  out = gmm(lhs, rhs, np.asarray(SIZES, np.int32), group_type=group_type, bias=bias,
            activation="silu", group_offset=offset,
            num_groups=num_local if group_type == "k" else None)
  want = gmm_oracle(np.where(np.isfinite(lhs), lhs, 0), np.where(np.isfinite(rhs), rhs, 0),
                    SIZES, group_type, bias=bias, activation="silu", group_offset=offset,
                    num_local=num_local)
  got = f64(out)
  np.testing.assert_allclose(got, want, **tolerances(np.float32, k=K))
  if group_type == "m":
    assert np.all(got[~local] == 0)


@pytest.mark.parametrize("offset", [0, 2, 5])
def test_traced_offset_past_the_list_m(offset):
  # A traced offset at or past G: no local group, every row exactly 0.
  lhs, rhs, bias = _operands("m", num_local=2, seed=3)
  run = jax.jit(lambda offset: gmm(lhs, rhs, np.asarray(SIZES, np.int32), bias=bias,
                                   activation=jax.nn.sigmoid, group_offset=offset))
  got = f64(run(jnp.int32(offset)))
  want = gmm_oracle(lhs, rhs, SIZES, "m", bias=bias, activation=lambda x: 1 / (1 + np.exp(-x)),
                    group_offset=offset, num_local=2)
  np.testing.assert_allclose(got, want, **tolerances(np.float32, k=K))
  assert np.all(got[~local_rows(SIZES, M, offset, 2)] == 0)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_16bit(group_type, dtype):
  lhs, rhs, bias = _operands(group_type, num_local=len(SIZES), dtype=dtype,
                             transpose_rhs=True, seed=4)
  out = gmm(lhs, rhs, np.asarray(SIZES, np.int32), group_type=group_type, bias=bias,
            activation="gelu_tanh", transpose_rhs=True)
  assert out.dtype == dtype
  want = gmm_oracle(lhs, rhs, SIZES, group_type, bias=bias, activation="gelu_tanh",
                    transpose_rhs=True)
  np.testing.assert_allclose(f64(out), want, **tolerances(dtype, k=K))


def test_row_operands_are_done_around_it():
  # No row features: the dispatcher gathers lhs before it and weights and scatters after.
  rng = np.random.default_rng(5)
  tokens, num_local = 10, len(SIZES)
  lhs = rng.standard_normal((tokens, K)).astype(np.float32)
  rhs = rng.standard_normal((num_local, K, 2 * N)).astype(np.float32)
  bias = rng.standard_normal((num_local, 2 * N)).astype(np.float32)
  rows = sum(SIZES) + 2
  lhs_indices = rng.integers(0, tokens, rows).astype(np.int32)
  row_weights = rng.random(rows).astype(np.float32)
  out_indices = rng.permutation(rows + 3)[:rows].astype(np.int32)
  with registry.record() as decisions:
    out = gmm(lhs, rhs, np.asarray(SIZES, np.int32), bias=bias, activation="swiglu",
              lhs_indices=lhs_indices, row_weights=row_weights, out_indices=out_indices,
              out_rows=rows + 3)
  assert decisions and all(d.implementation == NAME for d in decisions)
  want = rows_oracle(lhs, rhs, SIZES, lhs_indices=lhs_indices, row_weights=row_weights,
                     out_indices=out_indices, out_rows=rows + 3, bias=bias,
                     activation="swiglu")
  np.testing.assert_allclose(f64(out), want, **tolerances(np.float32, k=K))


def test_refusals():
  lhs, rhs, bias = _operands("m", num_local=2, seed=6)
  counts, offset = jnp.asarray(SIZES, jnp.int32), jnp.int32(0)
  cfg = GmmConfig(group_type="m", num_local=2)
  with pytest.raises(NotImplementedError, match="float operands"):
    gmm_lax_ragged(jnp.asarray(lhs, jnp.int8), jnp.asarray(rhs, jnp.int8), counts, offset,
                   None, cfg.replace(out_dtype=np.int32))
  with pytest.raises(NotImplementedError, match="float results"):
    gmm_lax_ragged(lhs, rhs, counts, offset, None, cfg.replace(out_dtype=np.int32))
  with pytest.raises(NotImplementedError, match="row operands"):
    gmm_lax_ragged(lhs, rhs, counts, offset, None, cfg.replace(row_weights=True))


# ---------------------------------------------------------------------------- gradients


def _silu_and_derivative(z):
  s = 1.0 / (1.0 + np.exp(-z))
  return z * s, s * (1.0 + z * (1.0 - s))


def _epilogue_vjp(z, ct, activation):
  """The cotangent of the pre-activation `z` (``[..., N]``, or ``[..., 2N]`` gated)."""
  if activation is None:
    return ct
  if activation == "silu":
    return ct * _silu_and_derivative(z)[1]
  assert activation == "swiglu", activation
  half = z.shape[-1] // 2
  gate, up = z[..., :half], z[..., half:]
  silu, dsilu = _silu_and_derivative(gate)
  return np.concatenate([ct * up * dsilu, ct * silu], axis=-1)


def grad_oracle(lhs, rhs, bias, ct, sizes, group_type, activation, group_offset, num_local):
  """float64 (dlhs, drhs, dbias) of ``sum(gmm(...) * ct)``, one group at a time (canonical
  layouts: lhs ``[M, K]``, rhs ``[L, K, N]`` / ``[K, N]``)."""
  lhs, rhs, bias, ct = f64(lhs), f64(rhs), f64(bias), f64(ct)
  z = gmm_oracle(lhs, rhs, sizes, group_type, bias=bias, group_offset=group_offset,
                 num_local=num_local)
  dz = _epilogue_vjp(z, ct, activation)
  dlhs, drhs, dbias = np.zeros_like(lhs), np.zeros_like(rhs), np.zeros_like(bias)
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  for local in range(num_local):
    g = group_offset + local
    if g >= len(sizes):
      if group_type == "k":  # no columns: only the bias sees the cotangent
        dbias[local] = dz[local].sum(axis=0)
      continue
    span = slice(starts[g], starts[g + 1])
    if group_type == "m":
      dlhs[span] = dz[span] @ rhs[local].T
      drhs[local] = lhs[span].T @ dz[span]
      dbias[local] = dz[span].sum(axis=0)
    else:
      dlhs[:, span] = dz[local] @ rhs[span].T
      drhs[span] = lhs[:, span].T @ dz[local]
      dbias[local] = dz[local].sum(axis=0)
  return dlhs, drhs, dbias


# Default run: float32 for every case, bfloat16 for two (its other six with -m slow).
@covering(("group_type", ["m", "k"]),
          ("activation, offset", [(None, 0), ("silu", 1), ("swiglu", 0), ("swiglu", 2)]),
          ("dtype", [jnp.float32, jnp.bfloat16]),
          default=lambda i: i[2] == 0 or i[0:2] in ((0, 2), (1, 1)))
def test_gradients_match_numpy(group_type, activation, offset, dtype):
  # Forward, dlhs (m-grouped with transpose_rhs / m-grouped for "k") and drhs (k-grouped
  # with transpose_lhs / m-grouped) all run on lax_ragged_dot; empty groups' weight
  # gradients (and every non-local group's) are exactly 0.
  num_local = 2 if offset else len(SIZES)
  n = 2 * N if activation == "swiglu" else N
  lhs, rhs, bias = _operands(group_type, num_local=num_local, dtype=dtype, n=n, seed=7)
  out_n = N
  ct_shape = (M, out_n) if group_type == "m" else (num_local, M, out_n)
  ct = jnp.asarray(np.random.default_rng(8).standard_normal(ct_shape), dtype)
  sizes = np.asarray(SIZES, np.int32)

  def loss(lhs, rhs, bias):
    out = gmm(lhs, rhs, sizes, group_type=group_type, bias=bias, activation=activation,
              group_offset=offset, num_groups=num_local if group_type == "k" else None)
    return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32))

  with registry.record() as decisions:
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(lhs, rhs, bias)
  assert {d.implementation for d in decisions} == {NAME}
  want = grad_oracle(lhs, rhs, bias, ct, SIZES, group_type, activation, offset, num_local)
  contraction = max(M, K, n)
  for name, primal, got, expected in zip(("lhs", "rhs", "bias"), (lhs, rhs, bias), grads,
                                         want):
    assert got.dtype == primal.dtype and got.shape == primal.shape, name
    # 16-bit: the saved pre-activation and the cotangent of the product are rounded to the
    # operands' dtype before the backward's gmms, so the budget is the dtype's.
    np.testing.assert_allclose(f64(got), expected, err_msg=f"d{name}",
                               **tolerances(dtype, k=contraction))
  drhs = f64(grads[1])
  for local in range(num_local):
    g = offset + local
    if g >= len(SIZES) or SIZES[g] == 0:
      if group_type == "m":
        assert np.all(drhs[local] == 0), f"empty group {g}: its weight gradient must be 0"
  if group_type == "k":
    assert np.all(drhs[~local_rows(SIZES, K, offset, num_local)] == 0)


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_check_jvp(group_type):
  # Forward-mode (the shared suite checks reverse mode).
  lhs, rhs, bias = make_operands(group_type, m=8, k=6, n=3, num_local=3, with_bias=True,
                                 seed=9)
  sizes = np.asarray([3, 0, 2], np.int32)
  jax.test_util.check_grads(
      lambda lhs, rhs, bias: gmm(lhs, rhs, sizes, group_type=group_type, bias=bias,
                                 activation="gelu_tanh"),
      (lhs, rhs, bias), order=1, modes=("fwd",), eps=1e-3, atol=1e-2, rtol=1e-2)


# --------------------------------------------------------------------------------- vmap


@pytest.mark.parametrize("axis", ["lhs", "rhs", "both"])
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_vmap_equals_a_loop(group_type, axis):
  batch, num_local = 3, len(SIZES)
  rng = np.random.default_rng(10)
  lhs_shape = (M, K)
  rhs_shape = (num_local, K, N) if group_type == "m" else (K, N)
  lhs = rng.standard_normal(((batch,) if axis != "rhs" else ()) + lhs_shape).astype(np.float32)
  rhs = rng.standard_normal(((batch,) if axis != "lhs" else ()) + rhs_shape).astype(np.float32)
  bias = rng.standard_normal((num_local, N)).astype(np.float32)
  in_axes = (0 if axis != "rhs" else None, 0 if axis != "lhs" else None)
  sizes = np.asarray(SIZES, np.int32)
  out = jax.vmap(lambda x, w: gmm(x, w, sizes, group_type=group_type, bias=bias,
                                  activation="relu"), in_axes=in_axes)(lhs, rhs)
  for b in range(batch):
    want = gmm_oracle(lhs[b] if axis != "rhs" else lhs, rhs[b] if axis != "lhs" else rhs,
                      SIZES, group_type, bias=bias, activation="relu")
    np.testing.assert_allclose(f64(out[b]), want, **tolerances(np.float32, k=K),
                               err_msg=f"batch element {b}")


# ------------------------------------------------------------------------------- chains


def test_chains_fall_back_to_ragged_dot_on_tpu_only():
  # TPU: its kernel, then ragged_dot_general (Mosaic kernels of XLA's own), then the XLA
  # loops. GPU: ragged_dot_general densifies there (benchmarks/log.md, "Fallbacks on
  # accelerators"), so the XLA loops stay its fallback. CPU: the XLA loops first.
  cfg = GmmConfig(group_type="m", num_local=1)
  tpu = registry.candidates(cfg, "tpu")
  assert tpu.index("pallas_tpu") < tpu.index(NAME) < tpu.index("xla")
  gpu = registry.candidates(cfg, "gpu")
  assert NAME not in gpu and gpu[-1] == "xla"
  assert registry.candidates(cfg, "cpu")[0] == "xla"


def test_explain_names_it_where_the_tpu_kernel_refuses():
  # A tiling Mosaic cannot block (tile_n not a multiple of 128 and smaller than N): the
  # TPU kernel refuses, and ragged_dot_general serves the call before the XLA loops.
  lhs = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
  rhs = jax.ShapeDtypeStruct((4, 256, 512), jnp.bfloat16)
  sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
  text = gmm_jax.explain(lhs, rhs, sizes, platform="tpu",
                         tiling=gmm_jax.Tiling(tile_m=128, tile_k=128, tile_n=96))
  assert f"on tpu: {NAME}" in text, text
  assert "skipped pallas_tpu" in text, text
