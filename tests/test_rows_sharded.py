"""gmms with row operands (lhs_indices, row_weights, out_indices) under plain jit with sharded
operands: the partitioning rule splits their experts (and ungated columns) so that no
implementation sits in a program XLA partitions on its own (on TPU and GPU a Pallas call it
cannot); forward and gradients equal the unsharded call, and the weights are never
gathered."""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.backends import registry
from jax.sharding import NamedSharding, PartitionSpec as P

import meshes

T, D, F, E, K = 32, 16, 8, 8, 2


def _problem(seed=0):
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(T, D)).astype(np.float32)
  ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int32)
  probs = rng.uniform(0.1, 1.0, size=(T, K)).astype(np.float32)
  w_up = (rng.normal(size=(E, D, 2 * F)) / 4).astype(np.float32)
  w_down = (rng.normal(size=(E, F, D)) / 3).astype(np.float32)
  return x, ids, probs, w_up, w_down


def _loss(x, ids, probs, w_up, w_down, activation):
  r = gmm_jax.route(ids, E, weights=probs)
  h = gmm_jax.gmm(x, w_up, r.group_sizes, lhs_indices=r.lhs_indices, activation=activation)
  y = gmm_jax.gmm(h, w_down, r.group_sizes, row_weights=r.row_weights,
                  out_indices=r.out_indices, out_rows=r.num_slots)
  return jnp.sum(jnp.sin(r.combine(y)))


# Two cases by default cover both activations and both weight layouts (the gated one with
# columns, which also checks its forward's whole N); the other two run with -m slow.
@pytest.mark.parametrize("activation,weights", [
    ("gelu", "experts"), ("swiglu", "experts+columns"),
    pytest.param("swiglu", "experts", marks=pytest.mark.slow),
    pytest.param("gelu", "experts+columns", marks=pytest.mark.slow)])
def test_row_gmms_split_their_experts_under_plain_jit(activation, weights):
  mesh = meshes.mesh((2, 4), ("data", "expert"))
  x, ids, probs, w_up, w_down = _problem()
  if activation == "gelu":
    w_up = w_up[..., :F]
  step = jax.jit(jax.value_and_grad(_loss, argnums=(0, 2, 3, 4)), static_argnums=5)
  reference = step(x, ids, probs, w_up, w_down, activation)
  put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
  columns = "data" if weights == "experts+columns" else None
  args = (put(x, P("data")), put(ids, P("data")), put(probs, P("data")),
          put(w_up, P("expert", None, columns)), put(w_down, P("expert", None, columns)))
  # The gradients laid out like their operands (as a training step's update makes them).
  sharded = jax.jit(jax.value_and_grad(_loss, argnums=(0, 2, 3, 4)), static_argnums=5,
                    out_shardings=(None, tuple(args[i].sharding for i in (0, 2, 3, 4))))
  with registry.record_plans() as plans, registry.record() as decisions:
    compiled = sharded.lower(*args, activation).compile()
  # Every gmm lowered went through the partitioning rule (none left to XLA's partitioner).
  assert len(plans) == len(decisions) >= 6
  value, grads = compiled(*args)
  # A sum of T * D sines in f32 whose order differs with the split: a few ulps per term.
  np.testing.assert_allclose(float(value), float(reference[0]),
                             atol=4 * T * D * np.finfo(np.float32).eps)
  for got, want in zip(grads, reference[1]):
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-5)
  # Every gmm (the two row gmms, their jvp and transposes) splits its experts.
  assert plans and all("expert" in p.strategies or "output groups" in p.strategies
                       for p in plans), [p.describe() for p in plans]
  if columns and activation == "gelu":
    assert any("columns" in p.strategies for p in plans)
  if columns and activation == "swiglu":
    # Under grad the gated gmm is a pre-activation gmm (columns split) and the activation
    # after it; the forward's gated epilogue needs each column's gate and up halves: whole.
    def forward(x, ids, probs, w_up):
      r = gmm_jax.route(ids, E, weights=probs)
      return gmm_jax.gmm(x, w_up, r.group_sizes, lhs_indices=r.lhs_indices,
                         activation="swiglu")

    with registry.record_plans() as plans:
      h = jax.jit(forward)(*args[:4])
    (plan,) = plans
    assert plan.strategies == ("expert",)
    assert any("N kept whole" in note for note in plan.notes)
    r = gmm_jax.route(ids, E, weights=probs)
    np.testing.assert_allclose(np.asarray(h), np.asarray(gmm_jax.gmm(
        x, w_up, r.group_sizes, lhs_indices=r.lhs_indices, activation="swiglu")),
        rtol=1e-5, atol=1e-5)
  weight_shapes = {f"f32[{','.join(map(str, w.shape))}]" for w in (w_up, w_down)}
  assert not set(meshes.collective_shapes(compiled.as_text(), "all-gather")) & weight_shapes
