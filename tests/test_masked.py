"""The masked grouped layout (`gmm_jax.MaskedArray`: ``[G, max_rows, K]`` + counts ``[G]``):
conversions to and from the ragged form, and gmm of a masked lhs on every implementation that
runs here, against per-group numpy float64 loops (`oracle.py`); gradients by check_grads and
against the oracle's VJP (padding rows give and get none); jvp, vmap over counts, one
compilation for any counts; bad inputs."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import gmm_jax
from oracle import GATED, f64, gmm_oracle_vjp, rows_oracle, tolerances

G, R, K, N = 4, 3, 8, 6

IMPLEMENTATIONS = [dict(implementation="reference"), dict(implementation="xla"),
                   dict(implementation="pallas_tpu", interpret=True,
                        tiling=gmm_jax.Tiling(128, 128, 128)),
                   pytest.param(dict(implementation="pallas_triton", interpret=True,
                                     tiling=gmm_jax.Tiling(16, 16, 16)),
                                marks=[pytest.mark.slow, pytest.mark.filterwarnings(
                                    "ignore:The Pallas Triton backend is deprecated")])]
IDS = ["reference", "xla", "pallas_tpu", "pallas_triton"]

counts_strategy = st.lists(st.integers(0, R), min_size=G, max_size=G)


def _problem(seed, n=N):
  rng = np.random.default_rng(seed)
  values = rng.normal(size=(G, R, K)).astype(np.float32)
  rhs = (rng.normal(size=(G, K, n)) / np.sqrt(K)).astype(np.float32)
  return values, rhs, rng


def _valid(counts):
  """bool ``[G, R, 1]``: the rows each group uses."""
  return (np.arange(R)[None, :] < np.asarray(counts)[:, None])[..., None]


def _masked_oracle(values, rhs, counts, *, bias=None, activation=None, row_weights=None):
  """float64 ``[G, R, N']``: each group's first counts[g] rows through its own rhs (the
  row oracle on one group at a time), 0 past them."""
  n = rhs.shape[-1] // 2 if activation in GATED else rhs.shape[-1]
  out = np.zeros((G, R, n))
  for g, c in enumerate(np.asarray(counts)):
    if c:
      out[g, :c] = rows_oracle(
          values[g, :c], rhs[g:g + 1], [c], activation=activation,
          bias=None if bias is None else bias[g:g + 1],
          row_weights=None if row_weights is None else row_weights[g, :c])
  return out


def _ragged_oracle(values, counts):
  rows = [values[g, :c] for g, c in enumerate(counts)]
  ragged = np.concatenate(rows + [np.zeros((G * R - sum(counts), values.shape[-1]))])
  return ragged


# ---------------------------------------------------------------------------- conversions


@hypothesis.given(counts=counts_strategy)
def test_to_from_ragged_round_trip(counts):
  values, _, _ = _problem(0)
  masked = gmm_jax.MaskedArray(values, np.asarray(counts, np.int32))
  rows, out_counts = _to_ragged(masked)
  np.testing.assert_array_equal(np.asarray(rows), _ragged_oracle(values, counts))
  np.testing.assert_array_equal(np.asarray(out_counts), counts)
  back = _from_ragged(rows, out_counts)
  # Padding becomes exactly 0; used rows come back bit for bit.
  np.testing.assert_array_equal(np.asarray(back.values), values * _valid(counts))
  np.testing.assert_array_equal(np.asarray(back.counts), counts)


_to_ragged = jax.jit(gmm_jax.to_ragged)
_from_ragged = jax.jit(functools.partial(gmm_jax.from_ragged, max_rows=R))


def test_from_grouped_array_and_short_ragged():
  rng = np.random.default_rng(1)
  rows = rng.normal(size=(5, K)).astype(np.float32)
  grouped = gmm_jax.GroupedArray(rows, np.array([2, 2, 5, 5], np.int32))
  masked = gmm_jax.from_ragged(grouped, max_rows=R)
  np.testing.assert_array_equal(np.asarray(masked.counts), [2, 0, 3, 0])
  np.testing.assert_array_equal(np.asarray(masked.values[2]), rows[2:5])
  np.testing.assert_array_equal(np.asarray(masked.values[0, 2]), np.zeros(K))
  # A shorter ragged form keeps its first rows; the counts are cut to match.
  short, counts = gmm_jax.to_ragged(masked, num_rows=3)
  np.testing.assert_array_equal(np.asarray(short), rows[:3])
  np.testing.assert_array_equal(np.asarray(counts), [2, 0, 1, 0])


def test_conversion_gradients_skip_padding():
  values, _, rng = _problem(2)
  counts = np.array([0, 3, 1, 2], np.int32)
  cot = rng.normal(size=(G * R, K)).astype(np.float32)
  _, vjp = jax.vjp(lambda v: gmm_jax.to_ragged(gmm_jax.MaskedArray(v, counts))[0], values)
  (grad,) = vjp(cot)
  expected = np.zeros_like(values)
  start = 0
  for g, c in enumerate(counts):
    expected[g, :c] = cot[start:start + c]
    start += c
  np.testing.assert_array_equal(np.asarray(grad), expected)
  check_grads(lambda r: gmm_jax.from_ragged(r, counts, R).values,
              (rng.normal(size=(G * R, K)),), order=1, modes=("rev",))


# ------------------------------------------------------------------------------------ gmm


@pytest.mark.parametrize("options", IMPLEMENTATIONS, ids=IDS)
def test_gmm_masked_matches_oracle(options):
  values, rhs, rng = _problem(3, n=2 * N)
  bias = rng.normal(size=(G, 2 * N)).astype(np.float32)
  weights = rng.random((G, R)).astype(np.float32)
  counts = np.array([2, 0, 3, 1], np.int32)
  # Padding rows hold garbage: gmm must not read them.
  values = np.where(_valid(counts), values, np.float32(1e30))
  for kwargs in (dict(), dict(bias=bias, activation="swiglu", row_weights=weights)):
    out = jax.jit(lambda v, c, w: gmm_jax.gmm(gmm_jax.MaskedArray(v, c), w, **kwargs,
                                              **options))(values, counts, rhs)
    assert isinstance(out, gmm_jax.MaskedArray)
    np.testing.assert_array_equal(np.asarray(out.counts), counts)
    expected = _masked_oracle(f64(values), f64(rhs), counts, **kwargs)
    np.testing.assert_allclose(np.asarray(out.values), expected, **tolerances(np.float32, k=K))
    padding = np.asarray(out.values)[~np.broadcast_to(_valid(counts), out.shape)]
    assert (padding == 0).all()


def test_num_rows_bound():
  values, rhs, _ = _problem(12)
  counts = np.array([3, 1, 0, 2], np.int32)
  f = jax.jit(lambda v, c, w: gmm_jax.gmm(gmm_jax.MaskedArray(v, c, num_rows=6), w,
                                          implementation="xla"))
  out = f(values, counts, rhs)
  assert out.num_rows == 6
  np.testing.assert_allclose(np.asarray(out.values),
                             _masked_oracle(f64(values), f64(rhs), counts),
                             **tolerances(np.float32, k=K))
  # Traced counts past the bound keep the first num_rows rows in group order.
  out = f(values, np.array([3, 3, 1, 2], np.int32), rhs)
  np.testing.assert_allclose(np.asarray(out.values),
                             _masked_oracle(f64(values), f64(rhs), [3, 3, 0, 0]),
                             **tolerances(np.float32, k=K))
  np.testing.assert_array_equal(np.asarray(out.counts), [3, 3, 0, 0])
  with pytest.raises(ValueError, match="counts sum to 9, past num_rows=6"):
    gmm_jax.MaskedArray(values, np.array([3, 3, 1, 2]), num_rows=6)
  with pytest.raises(ValueError, match=r"num_rows must be an int in \[0, G \* max_rows = 12\]"):
    gmm_jax.MaskedArray(values, counts, num_rows=13)
  assert gmm_jax.from_ragged(values.reshape(G * R, K)[:7], counts, R).num_rows == 7


def test_gmm_masked_weight_only_quantized_and_transposed_rhs():
  values, rhs, _ = _problem(10)
  counts = np.array([3, 1, 0, 2], np.int32)
  q = gmm_jax.quantize(rhs, "int8", channelwise_axes=(0, 2))
  out = jax.jit(lambda v, c, w: gmm_jax.gmm(gmm_jax.MaskedArray(v, c), w,
                                            implementation="xla").values)(values, counts, q)
  expected = _masked_oracle(f64(values), f64(gmm_jax.dequantize(q)), counts)
  np.testing.assert_allclose(np.asarray(out), expected, **tolerances(np.float32, k=K))
  out = jax.jit(lambda v, c, w: gmm_jax.gmm(gmm_jax.MaskedArray(v, c), w, transpose_rhs=True,
                                            implementation="xla").values)(
                                                values, counts, np.swapaxes(rhs, 1, 2))
  np.testing.assert_allclose(np.asarray(out), _masked_oracle(f64(values), f64(rhs), counts),
                             **tolerances(np.float32, k=K))


@functools.lru_cache(maxsize=None)
def _jitted_masked_gmm(implementation):
  return jax.jit(lambda v, c, w: gmm_jax.gmm(gmm_jax.MaskedArray(v, c), w,
                                             implementation=implementation).values)


@pytest.mark.parametrize("implementation", ["reference", "xla"])
@hypothesis.given(counts=counts_strategy)
def test_gmm_masked_any_counts_one_compilation(implementation, counts):
  values, rhs, _ = _problem(4)
  counts = np.asarray(counts, np.int32)
  out = _jitted_masked_gmm(implementation)(values, counts, rhs)
  np.testing.assert_allclose(np.asarray(out), _masked_oracle(f64(values), f64(rhs), counts),
                             **tolerances(np.float32, k=K))


def test_traced_counts_past_max_rows_are_clipped():
  values, rhs, _ = _problem(5)
  out = _jitted_masked_gmm("xla")(values, np.array([7, -2, 3, 1], np.int32), rhs)
  clipped = np.array([R, 0, 3, 1])
  np.testing.assert_allclose(np.asarray(out), _masked_oracle(f64(values), f64(rhs), clipped),
                             **tolerances(np.float32, k=K))


@pytest.mark.parametrize("activation,options", [
    (None, dict(implementation="xla")), ("silu", dict(implementation="xla")),
    pytest.param("silu", IMPLEMENTATIONS[2], marks=pytest.mark.slow, id="silu-pallas_tpu"),
    pytest.param("silu", IMPLEMENTATIONS[3].values[0], marks=IMPLEMENTATIONS[3].marks,
                 id="silu-pallas_triton")])
def test_gmm_masked_vjp_matches_oracle(activation, options):
  values, rhs, rng = _problem(6)
  counts = np.array([3, 0, 1, 2], np.int32)
  cot = rng.normal(size=(G, R, N)).astype(np.float32)  # nonzero on padding rows too
  f = lambda v, w: gmm_jax.gmm(gmm_jax.MaskedArray(v, counts), w, activation=activation,
                               **options).values
  dvalues, drhs = jax.jit(lambda v, w, ct: jax.vjp(f, v, w)[1](ct))(values, rhs, cot)
  for g, c in enumerate(counts):
    dlhs, drhs_g, _ = gmm_oracle_vjp(values[g, :c], rhs[g:g + 1], [c], "m", cot[g, :c],
                                     activation=activation)
    tol = tolerances(np.float32, k=max(N, int(c)), scale=4.0)
    np.testing.assert_allclose(np.asarray(dvalues[g, :c]), dlhs, **tol)
    np.testing.assert_allclose(np.asarray(drhs[g]), drhs_g[0], **tol)
  assert (np.asarray(dvalues)[~np.broadcast_to(_valid(counts), values.shape)] == 0).all()


def test_gmm_masked_check_grads_and_jvp():
  values, rhs, rng = _problem(7)
  counts = np.array([1, 3, 0, 2], np.int32)
  bias = rng.normal(size=(G, N)).astype(np.float32)
  weights = rng.random((G, R)).astype(np.float32)
  f = lambda v, w, b, p: gmm_jax.gmm(gmm_jax.MaskedArray(v, counts), w, bias=b,
                                     row_weights=p, activation="gelu_tanh",
                                     implementation="xla").values
  check_grads(jax.jit(lambda v, w: f(v, w, bias, weights)), (values, rhs), order=1,
              modes=("rev",),
              atol=5e-2, rtol=5e-2)
  # A tangent on a padding row changes nothing.
  tangent = np.zeros_like(values)
  tangent[2] = 1.0
  _, out_tangent = jax.jvp(lambda v: f(v, rhs, bias, weights), (values,), (tangent,))
  assert (np.asarray(out_tangent) == 0).all()


@pytest.mark.slow
def test_gmm_masked_check_grads_every_operand_second_order():
  values, rhs, rng = _problem(7)
  counts = np.array([1, 3, 0, 2], np.int32)
  bias = rng.normal(size=(G, N)).astype(np.float32)
  weights = rng.random((G, R)).astype(np.float32)
  f = lambda v, w, b, p: gmm_jax.gmm(gmm_jax.MaskedArray(v, counts), w, bias=b,
                                     row_weights=p, activation="gelu_tanh",
                                     implementation="xla").values
  check_grads(f, (values, rhs, bias, weights), order=2, modes=("fwd", "rev"),
              atol=5e-2, rtol=5e-2)


def test_gmm_masked_vmap_over_counts():
  values, rhs, _ = _problem(8)
  batch_counts = np.array([[0, 1, 2, 3], [3, 3, 0, 0]], np.int32)
  batch_values = np.stack([values, values[::-1]])
  out = jax.jit(jax.vmap(lambda v, c: gmm_jax.gmm(gmm_jax.MaskedArray(v, c), rhs,
                                          implementation="xla").values))(
                                              batch_values, batch_counts)
  for b in range(2):
    np.testing.assert_allclose(np.asarray(out[b]),
                               _masked_oracle(f64(batch_values[b]), f64(rhs), batch_counts[b]),
                               **tolerances(np.float32, k=K))


# ----------------------------------------------------------------------------- bad input


def test_bad_masked_inputs():
  values, rhs, _ = _problem(9)
  counts = np.array([1, 2, 3, 0], np.int32)
  with pytest.raises(ValueError, match=r"max_rows=3.*\[4\]"):
    gmm_jax.MaskedArray(values, np.array([1, 4, 0, 0]))
  with pytest.raises(ValueError, match=r"3-D \[G, max_rows, K\].*\(12, 8\)"):
    gmm_jax.MaskedArray(values.reshape(G * R, K), counts)
  with pytest.raises(ValueError, match=r"counts must be \[G\] = \[4\]"):
    gmm_jax.MaskedArray(values, counts[:3])
  masked = gmm_jax.MaskedArray(values, counts)
  with pytest.raises(gmm_jax.GmmShapeError, match=r"needs rhs \[G, K, N\] with G=4, K=8"):
    gmm_jax.gmm(masked, rhs[:3])
  with pytest.raises(gmm_jax.GmmShapeError, match=r"K=8"):
    gmm_jax.gmm(masked, rhs[:, :5])
  with pytest.raises(ValueError, match="pass no group_list"):
    gmm_jax.gmm(masked, rhs, counts)
  with pytest.raises(NotImplementedError, match="supports group_type='m'"):
    gmm_jax.gmm(masked, rhs, group_type="k")
  with pytest.raises(NotImplementedError, match="quantize_lhs"):
    gmm_jax.gmm(masked, rhs, quantize_lhs=gmm_jax.QuantSpec(jnp.int8))
  with pytest.raises(NotImplementedError, match="got transpose_lhs, group_offset"):
    gmm_jax.gmm(masked, rhs, transpose_lhs=True, group_offset=0)
  with pytest.raises(NotImplementedError, match="got group_list_type"):
    gmm_jax.gmm(masked, rhs, group_list_type="cumsum")
  with pytest.raises(gmm_jax.GmmShapeError, match="transpose_rhs=True"):
    gmm_jax.gmm(masked, rhs, transpose_rhs=True)
  with pytest.raises(NotImplementedError, match="lhs_indices"):
    gmm_jax.gmm(masked, rhs, lhs_indices=np.arange(G * R))
  with pytest.raises(ValueError, match=r"row_weights .* \[4, 3\]"):
    gmm_jax.gmm(masked, rhs, row_weights=np.ones((G * R,), np.float32))
  with pytest.raises(ValueError, match=r"group_sizes must lie in \[0, max_rows=2\]"):
    gmm_jax.from_ragged(values.reshape(G * R, K), counts, max_rows=2)
  with pytest.raises(ValueError, match="sum to 6, past the 5 rows"):
    gmm_jax.from_ragged(values.reshape(G * R, K)[:5], counts, max_rows=R)
  with pytest.raises(ValueError, match="needs a gmm_jax.MaskedArray"):
    gmm_jax.to_ragged(values)


# ------------------------------------------------------------------------ decode benchmark


@pytest.mark.slow
def test_bench_decode_runs_and_counts_ops():
  from gmm_jax.tools import bench_decode

  methods = ["gmm_masked", "ragged_dot"]
  rows = bench_decode.main(["--tokens", "2", "--experts", "8", "--top-k", "2", "--dim", "16",
                            "--number", "1", "--rounds", "1", "--methods", *methods])
  assert [r.method for r in rows] == methods
  assert all(r.hlo_ops >= r.entry_ops > 0 and r.us_per_call > 0 for r in rows)
  text = "ENTRY %main {\n  %p = f32[2] parameter(0)\n  ROOT %n = f32[2] negate(%p)\n}\n"
  assert bench_decode.hlo_op_counts(text) == (2, 2)


@pytest.mark.parametrize("max_rows", [5, pytest.param(2, marks=pytest.mark.slow)])
def test_moe_decode_masked_matches_dense_oracle(max_rows):
  from gmm_jax.tools import bench_decode

  x, gate_up, down, top_e, top_p = bench_decode.moe_problem(5, 4, 2, 8, 4, seed=11)
  got = jax.jit(functools.partial(bench_decode.moe_decode_masked, max_rows=max_rows))(
      x, gate_up, down, top_e, top_p)
  xs, wu, wd, ids, probs = (f64(a) for a in (x, gate_up, down, top_e, top_p))
  want = np.zeros_like(xs)
  taken = np.zeros(4, int)
  for t in range(5):  # an expert takes its first max_rows tokens (capacity)
    for j in range(2):
      e = int(ids[t, j])
      taken[e] += 1
      if taken[e] <= max_rows:
        want[t] += probs[t, j] * (GATED["swiglu"](xs[t] @ wu[e]) @ wd[e])
  np.testing.assert_allclose(np.asarray(got), want, **tolerances(np.float32, k=8, scale=4.0))
