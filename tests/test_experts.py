"""The routed experts as one partitionable op (`gmm_jax.routed_experts`): under plain jit
with sharded operands the partitioner picks local routing, per-device experts or expert
parallelism from the shardings; every layout equals the numpy oracle, forward and gradients,
and gathers no expert weights."""

from __future__ import annotations

import contextlib

import math

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.moe.layout import record_layouts
from jax.sharding import NamedSharding, PartitionSpec as P

import meshes
from grids import covering
import oracle

T, D, F, E, K = 64, 16, 8, 8, 2


def _problem(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(T, D))
  top_e = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
  top_e[: T // 4, 0] = 3  # a hot expert: some shards send most of their rows to one device
  top_e[: T // 4, 1] = 5
  top_p = rng.uniform(0.1, 1.0, size=(T, K))
  params = dict(w_in=rng.normal(size=(E, D, 2 * F)) * 0.3,
                w_down=rng.normal(size=(E, F, D)) * 0.3)
  return x, top_e, top_p, params


def _silu(z):
  return z / (1.0 + np.exp(-z))


def _oracle(x, top_e, top_p, params, kept=None):
  """Per token and choice, float64: ``sum_j p * down_e(silu(x W_gate) * (x W_up))``."""
  y = np.zeros((x.shape[0], params["w_down"].shape[-1]))
  for t in range(x.shape[0]):
    for j in range(top_e.shape[1]):
      if kept is not None and not kept[t, j]:
        continue
      e = top_e[t, j]
      z = x[t] @ params["w_in"][e]
      h = _silu(z[:F]) * z[F:]
      y[t] += top_p[t, j] * (h @ params["w_down"][e])
  return y


def _as_jax(x, top_e, top_p, params, dtype=jnp.float32):
  return (jnp.asarray(x, dtype), jnp.asarray(top_e), jnp.asarray(top_p, jnp.float32),
          jax.tree.map(lambda w: jnp.asarray(w, dtype), params))


def _step(spec, **options):
  def loss(x, top_e, top_p, params):
    y, kept = gmm_jax.routed_experts(spec, x, top_e, top_p, params, **options)
    return jnp.sum(jnp.sin(y)), (y, kept)

  return jax.value_and_grad(loss, argnums=(0, 2, 3), has_aux=True)


def _oracle_grads(x, top_e, top_p, params, kept=None):
  """The gradients of ``sum(sin(y))`` through the oracle, by the chain rule per token and
  choice (float64)."""
  y = _oracle(x, top_e, top_p, params, kept)
  dy = np.cos(y)
  dx, dp = np.zeros_like(x), np.zeros_like(top_p)
  dw = {name: np.zeros_like(w) for name, w in params.items()}
  for t in range(x.shape[0]):
    for j in range(top_e.shape[1]):
      if kept is not None and not kept[t, j]:
        continue
      e = top_e[t, j]
      w_in, w_down = params["w_in"][e], params["w_down"][e]
      z = x[t] @ w_in
      gate, up = z[:F], z[F:]
      sig = 1.0 / (1.0 + np.exp(-gate))
      h = gate * sig * up
      dp[t, j] = dy[t] @ (h @ w_down)
      dw["w_down"][e] += top_p[t, j] * np.outer(h, dy[t])
      dh = top_p[t, j] * (w_down @ dy[t])
      dgate = dh * up * (sig + gate * sig * (1.0 - sig))
      dup = dh * gate * sig
      dz = np.concatenate([dgate, dup])
      dw["w_in"][e] += np.outer(x[t], dz)
      dx[t] += w_in @ dz
  return dx, dp, dw


# (tokens spec, weights spec) -> the strategy the partitioner must pick.
LAYOUTS = {
    "local": (P(("data", "expert")), P()),
    "experts": (P("data"), P("expert")),
    "travel": (P(("data", "expert")), P("expert")),
}


@pytest.fixture(scope="module")
def reference():
  problem = _problem()
  y = _oracle(*problem)
  return problem, y, _oracle_grads(*problem)


def _check(out, y_ref, grads_ref, dtype=jnp.float32):
  (_, (y, _)), (dx, dp, dw) = out
  tol = oracle.tolerances(dtype)
  np.testing.assert_allclose(np.asarray(y), y_ref, **tol)
  gx, gp, gw = grads_ref
  scale = lambda g: dict(rtol=tol["rtol"], atol=tol["atol"] * max(1.0, np.abs(g).max()))
  np.testing.assert_allclose(np.asarray(dx), gx, **scale(gx))
  np.testing.assert_allclose(np.asarray(dp), gp, **scale(gp))
  for name in gw:
    np.testing.assert_allclose(np.asarray(dw[name]), gw[name], **scale(gw[name]))


@pytest.mark.parametrize("fused", [True, False])
def test_one_device_equals_the_oracle(reference, fused):
  problem, y_ref, grads_ref = reference
  spec = gmm_jax.ExpertFFN(E, "silu", gated=True, fused=fused)
  _check(jax.jit(_step(spec))(*_as_jax(*problem)), y_ref, grads_ref)


@covering(("layout", sorted(LAYOUTS)), ("fused", [True, False]), ("kind", ["mesh", "explicit"]))
def test_each_layout_equals_the_oracle_and_gathers_no_weights(reference, layout, fused, kind):
  # kind "mesh": Auto axes, the partitioner splits the op (forward and backward); Explicit
  # axes: the op reads the layout from the types and splits itself at trace time.
  problem, y_ref, grads_ref = reference
  mesh = meshes.mesh((2, 4), ("data", "expert"), kind)
  tokens, weights = LAYOUTS[layout]
  x, top_e, top_p, params = _as_jax(*problem)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  args = (put(x, tokens), put(top_e, tokens), put(top_p, tokens),
          jax.tree.map(lambda w: put(w, weights), params))
  spec = gmm_jax.ExpertFFN(E, "silu", gated=True, fused=fused)
  step = jax.jit(_step(spec))
  with record_layouts() as chosen, (
      jax.set_mesh(mesh) if kind == "explicit" else contextlib.nullcontext()):
    lowered = step.lower(*args)
    compiled = lowered.compile()
  if kind == "explicit":
    assert [c[0].strategy for c in chosen] == [layout]  # one plan, at trace time
    assert "CustomSPMDPartitioning" not in lowered.as_text()
  else:
    assert [c[0].strategy for c in chosen] == [layout, layout]  # forward and backward
  _check(compiled(*args), y_ref, grads_ref)
  weight_shapes = {f"f32[{','.join(map(str, w.shape))}]" for w in params.values()}
  assert not set(meshes.collective_shapes(compiled.as_text(), "all-gather")) & weight_shapes


def test_receive_buffers_drop_rows_past_the_buffer_factor(reference):
  problem, y_ref, _ = reference
  x, top_e, top_p, params = problem
  mesh = meshes.mesh((2, 4), ("data", "expert"))
  tokens, weights = LAYOUTS["travel"]
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  jx, je, jp, jw = _as_jax(*problem)
  args = (put(jx, tokens), put(je, tokens), put(jp, tokens),
          jax.tree.map(lambda w: put(w, weights), jw))
  spec = gmm_jax.ExpertFFN(E, "silu", gated=True)
  # Worst case per pair is all 16 rows of a shard; 4 devices: b=1 allows 4 rows per pair.
  run = lambda b: jax.jit(lambda *a: gmm_jax.routed_experts(spec, *a, buffer_factor=b))(*args)
  y_all, kept_all = run(4.0)  # 16 rows per pair: nothing dropped
  np.testing.assert_allclose(np.asarray(y_all), y_ref, **oracle.tolerances(jnp.float32))
  assert np.asarray(kept_all).all()
  y, kept = run(1.0)
  kept = np.asarray(kept).astype(bool)
  # The documented rule, per token shard (16 tokens, 32 rows): rows sorted by expert, the
  # first 4 to each destination device (2 experts per device) kept.
  expected = np.zeros((T, K), bool)
  shard_rows = T * K // 8
  flat_e = top_e.reshape(8, shard_rows)
  for shard in range(8):
    order = np.argsort(flat_e[shard], kind="stable")
    dest = flat_e[shard][order] // 2
    rank = np.arange(shard_rows) - np.searchsorted(dest, dest)
    keep = np.zeros(shard_rows, bool)
    keep[order] = rank < 4
    expected.reshape(8, shard_rows)[shard] = keep
  assert not expected.all()  # the hot experts overflow
  np.testing.assert_array_equal(kept, expected)
  np.testing.assert_allclose(np.asarray(y), _oracle(x, top_e, top_p, params, expected),
                             **oracle.tolerances(jnp.float32))


@pytest.mark.parametrize("partitionable", [None, True])
def test_nn_moe_under_plain_jit_is_partitioned_like_its_operands(partitionable):
  # Arguments placed on a mesh: by default the layer sees the mesh and pins its own layout
  # (split at trace time, no partitioner op); partitionable=True asks for the op, which
  # the partitioner splits by the operands' shardings.
  nnx = pytest.importorskip("flax.nnx")
  from gmm_jax import nn  # noqa: PLC0415 (the optional flax extra)
  mesh = meshes.mesh((2, 4), ("data", "expert"))
  layer = nn.MoE(E, D, F, top_k=K, rngs=nnx.Rngs(0), partitionable=partitionable)
  graph, state = nnx.split(layer)
  x = jnp.asarray(np.random.default_rng(1).normal(size=(T, D)), jnp.float32)

  def loss(state, x):
    y, aux = nnx.merge(graph, state)(x)
    return jnp.sum(y ** 2) + aux["load_balancing_loss"]

  step = jax.jit(jax.value_and_grad(loss))
  reference = step(state, x)

  def spec_of(path, leaf):
    names = [getattr(p, "key", getattr(p, "name", None)) for p in path]
    return P("expert") if leaf.ndim == 3 or (leaf.ndim == 2 and "bias" in names
                                              and "router" not in names) else P()

  sharded_state = jax.tree_util.tree_map_with_path(
      lambda p, a: jax.device_put(a, NamedSharding(mesh, spec_of(p, a))), state)
  xs = jax.device_put(x, NamedSharding(mesh, P(("data", "expert"))))
  with record_layouts() as chosen:
    compiled = step.lower(sharded_state, xs).compile()
  assert {c[0].strategy for c in chosen} == ({"travel"} if partitionable else set())
  value, grads = compiled(sharded_state, xs)
  np.testing.assert_allclose(float(value), float(reference[0]), rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=1e-4, atol=1e-5),
               grads, reference[1])
  expert_shapes = {f"f32[{E},{D},{2 * F}]", f"f32[{E},{F},{D}]"}
  assert not set(meshes.collective_shapes(compiled.as_text(), "all-gather")) & expert_shapes


def test_bad_options_raise_value_error():
  x, top_e, top_p, params = _as_jax(*_problem())
  spec = gmm_jax.ExpertFFN(E, "silu", gated=True)
  with pytest.raises(ValueError, match="buffer_factor"):
    gmm_jax.routed_experts(spec, x, top_e, top_p, params, buffer_factor=0)
  with pytest.raises(ValueError, match="transport"):
    gmm_jax.routed_experts(spec, x, top_e, top_p, params, transport="carrier pigeon")
  with pytest.raises(ValueError, match="leading dim"):
    gmm_jax.routed_experts(gmm_jax.ExpertFFN(E + 1, "silu", gated=True), x, top_e, top_p,
                           params)


def test_nn_moe_inline_path_equals_the_partitionable_op():
  # partitionable=False keeps the fused gmms inline (pre-activations saved, no recompute):
  # the same values and gradients as the op, whose backward recomputes the forward.
  nnx = pytest.importorskip("flax.nnx")
  from gmm_jax import nn  # noqa: PLC0415 (the optional flax extra)
  x = jnp.asarray(np.random.default_rng(2).normal(size=(T, D)), jnp.float32)
  results = []
  for partitionable in (True, False):
    layer = nn.MoE(E, D, F, top_k=K, capacity_factor=1.0, partitionable=partitionable,
                   rngs=nnx.Rngs(0))
    graph, state = nnx.split(layer)

    def loss(state, x):
      y, aux = nnx.merge(graph, state)(x)
      return jnp.sum(y ** 2), aux["dropped_fraction"]

    results.append(jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(state, x))
  (value_op, dropped_op), grads_op = results[0]
  (value_inline, dropped_inline), grads_inline = results[1]
  assert float(dropped_op) == float(dropped_inline) > 0  # capacity 1.0 drops some
  np.testing.assert_allclose(float(value_op), float(value_inline), rtol=1e-6)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       rtol=1e-5, atol=1e-6),
               grads_op, grads_inline)


@pytest.mark.parametrize("transport", ["all_to_all", "ragged"])
def test_travel_with_each_transport_equals_the_oracle(reference, transport):
  # "ragged" on CPU runs the all_gather emulation of ragged_all_to_all's semantics.
  problem, y_ref, _ = reference
  mesh = meshes.mesh((2, 4), ("data", "expert"))
  tokens, weights = LAYOUTS["travel"]
  x, top_e, top_p, params = _as_jax(*problem)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  args = (put(x, tokens), put(top_e, tokens), put(top_p, tokens),
          jax.tree.map(lambda w: put(w, weights), params))
  spec = gmm_jax.ExpertFFN(E, "silu", gated=True)
  y, kept = jax.jit(lambda *a: gmm_jax.routed_experts(spec, *a, transport=transport))(*args)
  np.testing.assert_allclose(np.asarray(y), y_ref, **oracle.tolerances(jnp.float32))
  assert np.asarray(kept).all()


def test_nn_moe_rejects_an_unknown_transport():
  nnx = pytest.importorskip("flax.nnx")
  from gmm_jax import nn  # noqa: PLC0415 (the optional flax extra)
  with pytest.raises(ValueError, match="transport"):
    nn.MoE(E, D, F, top_k=K, transport="carrier pigeon", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="buffer_factor"):
    nn.MoE(E, D, F, top_k=K, buffer_factor=0, rngs=nnx.Rngs(0))
