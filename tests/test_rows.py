"""Token dispatch and combine inside gmm: lhs_indices (gather), row_weights, out_indices
(scatter), gated activations and `gmm_jax.route`, against the numpy oracle (per-row loops)
on every implementation that runs here; gradients by check_grads and against the unfused
formulation (copies around plain gmms); bitwise determinism; bad indices."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import gmm_jax
from gmm_jax._src.backends import registry  # the decisions of the gmms lowered
from gmm_jax._src.op.rows_sum import rows_sum  # the transpose of the gather
from oracle import GATED, rows_oracle, tolerances

# The implementations that run on CPU: the reference, the XLA path (gathers and scatters in
# its loops), and the TPU kernel in interpret mode (rows gathered/scattered around it).
IMPLEMENTATIONS = [dict(implementation="reference"), dict(implementation="xla"),
                   dict(implementation="pallas_tpu", interpret=True,
                        tiling=gmm_jax.Tiling(128, 128, 128))]
IDS = ["reference", "xla", "pallas_tpu"]


def _topk_problem(seed, tokens=12, k=2, experts=4, d=16, f=8, *, capacity=None,
                  empty=(1,)):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(tokens, d)).astype(np.float32)
  w = rng.normal(size=(experts, d, f)).astype(np.float32) / np.sqrt(d)
  allowed = [e for e in range(experts) if e not in empty]
  ids = np.stack([rng.choice(allowed, size=k, replace=False) for _ in range(tokens)])
  probs = rng.random((tokens, k)).astype(np.float32)
  routing = gmm_jax.route(ids, experts, weights=probs, capacity=capacity)
  return x, w, ids, probs, routing


def _dense_moe(x, w, ids, probs, kept, activation=None):
  """sum_j p_tj * act(x_t @ w[e_tj]) over kept assignments, in float64 (per token)."""
  out = np.zeros((x.shape[0], w.shape[-1] // (2 if activation in GATED else 1)))
  for t in range(x.shape[0]):
    for j in range(ids.shape[1]):
      if kept[t, j]:
        z = x[t].astype(np.float64) @ w[ids[t, j]].astype(np.float64)
        y = z if activation is None else GATED[activation](z)
        out[t] += probs[t, j] * y
  return out


@pytest.mark.parametrize("options", IMPLEMENTATIONS, ids=IDS)
@pytest.mark.parametrize("capacity", [None, 2])
def test_topk_dispatch_and_combine(options, capacity):
  x, w, ids, probs, r = _topk_problem(0, capacity=capacity)
  y = gmm_jax.gmm(x, w, r.group_sizes, lhs_indices=r.lhs_indices, row_weights=r.row_weights,
                  out_indices=r.out_indices, out_rows=r.num_slots, **options)
  assert y.shape == (r.num_slots, w.shape[-1])
  expected = rows_oracle(x, w, r.group_sizes, lhs_indices=np.asarray(r.lhs_indices),
                         row_weights=np.asarray(r.row_weights),
                         out_indices=np.asarray(r.out_indices), out_rows=r.num_slots)
  np.testing.assert_allclose(y, expected, **tolerances(np.float32, k=16))
  kept = np.asarray(r.kept)
  np.testing.assert_array_equal(np.asarray(y).reshape(12, 2, -1)[~kept], 0.0)  # dropped: 0
  np.testing.assert_allclose(r.combine(y), _dense_moe(x, w, ids, probs, kept),
                             **tolerances(np.float32, k=16))


@pytest.mark.parametrize("options", IMPLEMENTATIONS, ids=IDS)
@pytest.mark.parametrize("activation", sorted(GATED))
def test_gated_activation_with_gather_and_bias(options, activation):
  x, _, ids, probs, r = _topk_problem(1)
  rng = np.random.default_rng(2)
  w = (rng.normal(size=(4, 16, 16)) * 2).astype(np.float32)  # large enough to clamp
  bias = rng.normal(size=(4, 16)).astype(np.float32)
  y = gmm_jax.gmm(x, w, r.group_sizes, lhs_indices=r.lhs_indices, bias=bias,
                  activation=activation, **options)
  assert y.shape == (r.num_rows, 8)
  expected = rows_oracle(x, w, r.group_sizes, lhs_indices=np.asarray(r.lhs_indices),
                         bias=bias, activation=activation)
  np.testing.assert_allclose(y, expected, rtol=1e-5, atol=1e-4)


@hypothesis.given(data=st.data())
@hypothesis.settings(max_examples=12, deadline=None)
def test_random_rows_match_oracle(data):
  """Random group sizes (empty groups, rows past the total), repeated and out-of-range
  traced indices, group_offset, both jitted implementations."""
  tokens = data.draw(st.integers(1, 9))
  rows = data.draw(st.integers(1, 14))
  groups = data.draw(st.integers(1, 4))
  sizes = data.draw(st.lists(st.integers(0, 5), min_size=groups, max_size=groups))
  num_local = data.draw(st.integers(1, groups))
  offset = data.draw(st.integers(0, groups - num_local))
  seed = data.draw(st.integers(0, 2**16))
  out_rows = data.draw(st.integers(rows, rows + 3))
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(tokens, 8)).astype(np.float32)
  w = rng.normal(size=(num_local, 8, 6)).astype(np.float32)
  lhs_indices = rng.integers(-1, tokens + 1, size=rows).astype(np.int32)  # some out of range
  row_weights = rng.normal(size=rows).astype(np.float32)
  out_indices = rng.permutation(out_rows + 2)[:rows].astype(np.int32) - 1  # unique, some out
  activation = data.draw(st.sampled_from([None, "silu", "swiglu"]))
  implementation = data.draw(st.sampled_from(["reference", "xla"]))

  @jax.jit
  def run(x, w, sizes, offset, lhs_indices, row_weights, out_indices):
    return gmm_jax.gmm(x, w, sizes, group_offset=offset, lhs_indices=lhs_indices,
                       row_weights=row_weights, out_indices=out_indices, out_rows=out_rows,
                       activation=activation, implementation=implementation)

  got = run(x, w, np.asarray(sizes, np.int32), offset, lhs_indices, row_weights, out_indices)
  expected = rows_oracle(x, w, sizes, lhs_indices=lhs_indices, row_weights=row_weights,
                         out_indices=out_indices, out_rows=out_rows, activation=activation,
                         group_offset=offset, num_local=num_local)
  np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-5)


def _fused(x, w_up, w_down, r, activation="swiglu", **options):
  h = gmm_jax.gmm(x, w_up, r.group_sizes, lhs_indices=r.lhs_indices, activation=activation,
                  **options)
  y = gmm_jax.gmm(h, w_down, r.group_sizes, row_weights=r.row_weights,
                  out_indices=r.out_indices, out_rows=r.num_slots, **options)
  return r.combine(y)


def _unfused(x, w_up, w_down, probs, ids, capacity=None, activation="swiglu"):
  """Today's MoE formulation: copies of the rows around plain gmms."""
  experts = w_up.shape[0]
  r = gmm_jax.route(ids, experts, capacity=capacity)
  rows = x[jnp.minimum(r.lhs_indices, x.shape[0] - 1)]
  z = gmm_jax.gmm(rows, w_up, r.group_sizes)
  n = z.shape[-1] // 2
  h = jax.nn.silu(z[:, :n]) * z[:, n:]
  y = gmm_jax.gmm(h, w_down, r.group_sizes)
  slot_weights = probs.reshape(-1)[jnp.minimum(r.out_indices, r.num_slots - 1)]
  y = y * jnp.where(r.out_indices < r.num_slots, slot_weights, 0)[:, None]
  slots = jnp.zeros((r.num_slots, y.shape[1])).at[r.out_indices].set(y, mode="drop")
  return slots.reshape(x.shape[0], -1, y.shape[1]).sum(1)


@pytest.mark.parametrize("capacity", [None, 3])
def test_gradients_match_unfused_formulation(capacity):
  x, _, ids, probs, _ = _topk_problem(3, capacity=capacity)
  rng = np.random.default_rng(4)
  w_up = rng.normal(size=(4, 16, 16)).astype(np.float32) / 4
  w_down = rng.normal(size=(4, 8, 16)).astype(np.float32) / 3

  def fused_loss(x, w_up, w_down, probs):
    r = gmm_jax.route(ids, 4, weights=probs, capacity=capacity)
    return jnp.sum(jnp.sin(_fused(x, w_up, w_down, r)))

  def unfused_loss(x, w_up, w_down, probs):
    return jnp.sum(jnp.sin(_unfused(x, w_up, w_down, probs, ids, capacity)))

  args = (x, w_up, w_down, probs)
  np.testing.assert_allclose(fused_loss(*args), unfused_loss(*args), rtol=1e-5)
  got = jax.jit(jax.grad(fused_loss, argnums=(0, 1, 2, 3)))(*args)
  want = jax.grad(unfused_loss, argnums=(0, 1, 2, 3))(*args)
  for name, a, b in zip(("x", "w_up", "w_down", "probs"), got, want):
    np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5, err_msg=name)
  assert float(jnp.abs(got[3]).max()) > 1e-3  # the router weights learn


@pytest.mark.parametrize("implementation", ["reference", "xla"])
def test_check_grads_all_row_operands(implementation):
  x, w, _, _, r = _topk_problem(5, tokens=5, d=4, f=6)
  bias = np.random.default_rng(6).normal(size=(4, 6)).astype(np.float32)

  def f(x, w, bias, weights):
    return gmm_jax.gmm(x, w, r.group_sizes, bias=bias, lhs_indices=r.lhs_indices,
                       row_weights=weights, out_indices=r.out_indices, out_rows=r.num_slots,
                       activation="silu", implementation=implementation)

  check_grads(f, (x, w, bias, r.row_weights), order=2, modes=["fwd", "rev"], atol=2e-2,
              rtol=2e-2)
  # Linear (no activation, constant weights): the tangent and transposed gmms keep the rows.
  check_grads(lambda x, w: gmm_jax.gmm(x, w, r.group_sizes, lhs_indices=r.lhs_indices,
                                       out_indices=r.out_indices, out_rows=r.num_slots,
                                       implementation=implementation),
              (x, w), order=2, modes=["fwd", "rev"], atol=2e-2, rtol=2e-2)


def test_gated_gradients():
  x, _, _, _, r = _topk_problem(7, tokens=6, d=4)
  w = np.random.default_rng(8).normal(size=(4, 4, 10)).astype(np.float32)
  for activation in sorted(GATED):
    check_grads(lambda x, w: gmm_jax.gmm(x, w, r.group_sizes, lhs_indices=r.lhs_indices,
                                         activation=activation),
                (x, w), order=1, modes=["fwd", "rev"], atol=2e-2, rtol=2e-2)


def test_gradients_bitwise_deterministic():
  x, _, ids, probs, _ = _topk_problem(9, tokens=64, k=4, experts=8, empty=())
  rng = np.random.default_rng(10)
  w_up = rng.normal(size=(8, 16, 16)).astype(np.float32)
  w_down = rng.normal(size=(8, 8, 16)).astype(np.float32)

  @jax.jit
  def grads(x, w_up, w_down, probs):
    def loss(*args):
      r = gmm_jax.route(ids, 8, weights=args[3])
      return jnp.sum(_fused(*args[:3], r) ** 2)
    return jax.grad(loss, argnums=(0, 1, 2, 3))(x, w_up, w_down, probs)

  first = grads(x, w_up, w_down, probs)
  second = grads(x, w_up, w_down, probs)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint32), np.asarray(b).view(np.uint32))


def test_rows_sum_is_a_fixed_order_sum():
  values = np.float32([[1e8], [1.0], [-1e8], [1.0], [5.0]])
  indices = np.int32([0, 0, 0, 2, 9])  # 9: out of range, dropped
  out = rows_sum(values, indices, 3)
  # Rows in ascending order, in f32: (1e8 + 1) rounds to 1e8, so row 0 sums to exactly 0.
  in_order = (np.float32(1e8) + np.float32(1.0)) + np.float32(-1e8)
  np.testing.assert_array_equal(out, [[in_order], [0.0], [1.0]])


def test_route_fields():
  ids = np.array([[0, 2], [2, 1], [0, 2], [5, 0]])  # 5: no such expert
  r = gmm_jax.route(ids, 3, weights=np.ones((4, 2), np.float32), capacity=2)
  np.testing.assert_array_equal(r.group_sizes, [2, 1, 2])  # expert 0 drops token 3's slot
  np.testing.assert_array_equal(r.kept, [[True, True], [True, True], [True, False],
                                         [False, False]])
  np.testing.assert_array_equal(r.out_indices[:5], [0, 4, 3, 1, 2])
  np.testing.assert_array_equal(r.lhs_indices[:5], [0, 2, 1, 0, 1])
  assert r.num_rows == 6 and r.num_slots == 8
  assert int(r.out_indices[5]) == 8  # padding row: out of range
  np.testing.assert_array_equal(r.inverse, [0, 3, 4, 2, 1, 6, 6, 6])
  np.testing.assert_array_equal(r.row_weights, [1, 1, 1, 1, 1, 0])


def test_vmap_and_jvp_compose():
  x, w, _, _, r = _topk_problem(11)
  f = lambda x: gmm_jax.gmm(x, w, r.group_sizes, lhs_indices=r.lhs_indices,
                            row_weights=r.row_weights, out_indices=r.out_indices,
                            out_rows=r.num_slots, activation="relu")
  batch = np.stack([x, 2 * x])
  np.testing.assert_allclose(jax.vmap(f)(batch)[1], f(2 * x), rtol=1e-5, atol=1e-6)
  y, dy = jax.jvp(f, (x,), (x,))
  np.testing.assert_allclose(y, f(x), rtol=1e-6)
  _, lin = jax.linearize(f, x)
  np.testing.assert_allclose(lin(x), dy, rtol=1e-5, atol=1e-6)


def test_bad_indices():
  x, w, _, _, r = _topk_problem(12)
  sizes = r.group_sizes
  with pytest.raises(ValueError, match="lhs_indices must lie in"):
    gmm_jax.gmm(x, w, sizes, lhs_indices=np.full(24, 12, np.int32))
  with pytest.raises(ValueError, match="must be unique"):
    gmm_jax.gmm(x, w, np.int32([12, 0, 0, 0]), out_indices=np.zeros(12, np.int32))
  with pytest.raises(ValueError, match="out_indices must lie in"):
    gmm_jax.gmm(x, w, np.int32([12, 0, 0, 0]), out_indices=np.arange(12, dtype=np.int32),
                out_rows=5)
  with pytest.raises(ValueError, match=r"row_weights must be a float \[R\]"):
    gmm_jax.gmm(x, w, np.int32([12, 0, 0, 0]), row_weights=np.ones(3, np.float32))
  with pytest.raises(ValueError, match="out_rows needs out_indices"):
    gmm_jax.gmm(x, w, np.int32([12, 0, 0, 0]), out_rows=4)
  with pytest.raises(ValueError, match="2N columns"):
    gmm_jax.gmm(x, w[..., :7], np.int32([12, 0, 0, 0]), activation="swiglu")
  with pytest.raises(NotImplementedError, match="group_type='m'"):
    gmm_jax.gmm(x, np.ones((16, 4), np.float32), np.int32([16]), group_type="k",
                lhs_indices=np.arange(12, dtype=np.int32))
  # Rows past the group total may hold anything (route's padding holds out-of-range slots).
  y = gmm_jax.gmm(x, w, np.int32([3, 0, 0, 0]), out_indices=np.r_[np.arange(3), [99] * 9]
                  .astype(np.int32), out_rows=3)
  assert y.shape == (3, 8)


def test_dispatch_reports_materialized_rows():
  x, w, _, _, r = _topk_problem(13)
  text = gmm_jax.explain(x, w, r.group_sizes, lhs_indices=r.lhs_indices, implementation=
                         "pallas_tpu", interpret=True, tiling=gmm_jax.Tiling(128, 128, 128))
  assert "pallas_tpu (gather around it, not fused)" in text
  text = gmm_jax.explain(x, w, r.group_sizes, lhs_indices=r.lhs_indices, implementation="xla")
  assert ": xla; bitwise deterministic" in text and "not fused" not in text


def test_weight_gradient_reads_gathered_rows_by_index():
  """The drhs gmm of a gathered gmm is k-grouped over the gathered rows, reading them by
  index (no [R, K] copy on the XLA path; kernels get the copy made around them)."""
  x, w, _, _, r = _topk_problem(14)
  loss = lambda x, w: jnp.sum(gmm_jax.gmm(x, w, r.group_sizes, lhs_indices=r.lhs_indices,
                                          implementation="xla") ** 2)
  with registry.record() as decisions:
    jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w)
  k_grouped = [d for d in decisions if d.cfg.group_type == "k"]
  assert k_grouped and all(d.cfg.gather_rows == r.num_rows and not d.materialized
                           for d in k_grouped)
  got = jax.grad(loss, argnums=1)(x, w)
  rows = np.asarray(x)[np.asarray(r.lhs_indices)]
  expected = np.zeros(w.shape)
  start = 0
  for g, size in enumerate(np.asarray(r.group_sizes)):
    block = rows[start:start + size].astype(np.float64)
    expected[g] = block.T @ (2 * block @ np.asarray(w[g], np.float64))
    start += size
  np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-4)


def _saved_preactivations(fn, *args):
  """dtypes of the values named `gmm_jax.PREACTIVATION` in the jaxpr of fn's vjp."""
  jaxpr = jax.make_jaxpr(lambda *a: jax.vjp(fn, *a))(*args).jaxpr
  found = []

  def walk(jaxpr):
    for eqn in jaxpr.eqns:
      if eqn.params.get("name") == gmm_jax.PREACTIVATION:
        found.append(eqn.invars[0].aval.dtype)
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        walk(sub)

  walk(jaxpr)
  return found


@pytest.mark.parametrize("rows", [False, True])
@pytest.mark.parametrize("dtype,saved", [(jnp.bfloat16, jnp.bfloat16),
                                         (jnp.float32, jnp.float32)])
def test_differentiated_preactivation_dtype(rows, dtype, saved):
  # A 16-bit layer keeps its pre-activation in its own dtype for the backward (half the
  # bytes, 16-bit backward products); the activation still runs in f32. f32 keeps f32.
  x, w, _, probs, r = _topk_problem(3)
  x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
  kwargs = dict(lhs_indices=r.lhs_indices) if rows else {}
  lhs = x if rows else jnp.repeat(x, 2, axis=0)

  def f(lhs, w):
    return gmm_jax.gmm(lhs, w, r.group_sizes, activation="silu", **kwargs)

  assert _saved_preactivations(f, lhs, w) == [jnp.dtype(saved)]
  out, vjp = jax.vjp(f, lhs, w)
  # Differentiated, a 16-bit gmm applies its activation to the pre-activation rounded to
  # 16 bits (the forward alone: to the f32 accumulator): one bf16 rounding apart (2^-8
  # relative, times silu's slope <= 1.1). f32 is the same computation.
  tol = dict(rtol=1e-2, atol=1e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(out, np.float32),
                             np.asarray(f(lhs, w), np.float32), **tol)
  d_lhs, d_w = vjp(jnp.ones_like(out))
  assert d_lhs.dtype == dtype and d_w.dtype == dtype
