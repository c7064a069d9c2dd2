"""The MoE block's variants against a plain per-token loop of the same formula.

Every router option (softmax/sigmoid scores, a routing bias that only selects, group-limited
top-k, routed scaling, top-1 without renormalization) and expert option (shared experts,
expert biases, clamped SwiGLU, GeGLU, a plain FFN, capacity) is checked forward and by
jax.grad against `reference`, which loops over the tokens and their chosen experts with
numpy-chosen experts and jnp arithmetic. Fused and unfused paths agree; the top-1 router
learns from the task loss; aux, presets, Linen names, metadata and eager sharding."""

from __future__ import annotations

import math

import numpy as np
import pytest

flax = pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import linen, nnx  # noqa: E402
from gmm_jax import nn  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

E, D, F = 8, 16, 12

GATES = {
    "silu": lambda g, u: jax.nn.silu(g) * u,
    "gelu": lambda g, u: jax.nn.gelu(g, approximate=False) * u,
    "swiglu_clamped": lambda g, u: (jnp.minimum(g, 7.0) * jax.nn.sigmoid(
        1.702 * jnp.minimum(g, 7.0)) * (jnp.clip(u, -7.0, 7.0) + 1)),
}
PLAIN = {"relu": jax.nn.relu, "gelu": lambda z: jax.nn.gelu(z, approximate=False)}


def choose(model: nn.MoE, p, tokens):
  """The experts each token goes to, by the documented rule, in numpy (float32 scores as
  the model computes them): [T, k] int."""
  logits = np.asarray(tokens @ p["router"]["kernel"], np.float32)
  if "bias" in p["router"]:
    logits = logits + np.asarray(p["router"]["bias"])
  if model.score == "softmax":
    scores = np.exp(logits - logits.max(-1, keepdims=True))
    scores /= scores.sum(-1, keepdims=True)
  else:
    scores = 1 / (1 + np.exp(-logits))
  if model.routing_bias is not None:
    scores = scores + np.asarray(model.routing_bias[...])
  chosen = []
  for s in scores:
    candidates = np.arange(E)
    if model.num_expert_groups:
      groups = s.reshape(model.num_expert_groups, -1)
      group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
      best = np.argsort(-group_score, kind="stable")[:model.top_k_groups]
      candidates = np.concatenate([np.arange(g * groups.shape[1], (g + 1) * groups.shape[1])
                                   for g in sorted(best)])
    order = np.argsort(-s[candidates], kind="stable")
    chosen.append(candidates[order[:model.top_k]])
  return np.stack(chosen)


def kept_of(chosen, capacity):
  """bool [T, k]: each expert takes its first `capacity` assignments in token order."""
  taken = np.zeros(E, int)
  kept = np.ones(chosen.shape, bool)
  for t, j in np.ndindex(*chosen.shape):
    taken[chosen[t, j]] += 1
    kept[t, j] = capacity is None or taken[chosen[t, j]] <= capacity
  return kept


def reference(model: nn.MoE, p, x, chosen, kept):
  """y for x [T, D] from params p (a pure dict): the formula for one token (over its
  chosen experts, a loop), mapped over the tokens."""

  def one_token(x_t, experts, keep):
    logits = x_t @ p["router"]["kernel"]
    if "bias" in p["router"]:
      logits = logits + p["router"]["bias"]
    s = jax.nn.softmax(logits) if model.score == "softmax" else jax.nn.sigmoid(logits)
    w = s[experts]
    if model.normalize_top_k:
      w = w / jnp.sum(w)
    w = w * model.routed_scaling_factor
    y = jnp.zeros(D)
    for j in range(model.top_k):
      e = experts[j]
      if model.gated:
        z = x_t @ p["gate_up"]["kernel"][e]
        if "bias" in p["gate_up"]:
          z = z + p["gate_up"]["bias"][e]
        h = GATES[model.activation](z[:F], z[F:])
      else:
        z = x_t @ p["up"]["kernel"][e]
        if "bias" in p["up"]:
          z = z + p["up"]["bias"][e]
        h = PLAIN[model.activation](z)
      o = h @ p["down"]["kernel"][e]
      if "bias" in p["down"]:
        o = o + p["down"]["bias"][e]
      y = y + jnp.where(keep[j], w[j], 0.0) * o
    if "shared" in p:
      z = x_t @ p["shared"]["up"]["kernel"]
      half = z.shape[0] // 2
      y = y + GATES[model.activation](z[:half], z[half:]) @ p["shared"]["down"]["kernel"]
    return y

  return jax.vmap(one_token)(x, jnp.asarray(chosen), jnp.asarray(kept))


VARIANTS = {
    "softmax_top2": dict(),
    "gelu_top3_unnormalized_scaled_shared": dict(
        top_k=3, activation="gelu", normalize_top_k=False, routed_scaling_factor=0.5,
        num_shared_experts=2, shared_mlp=8),
    "deepseek_sigmoid_bias_groups_scaled_shared": dict(
        score="sigmoid", routing_bias=True, num_expert_groups=4, top_k_groups=2, top_k=3,
        routed_scaling_factor=2.5, num_shared_experts=1),
    "gpt_oss_biases_clamped_capacity": dict(
        activation="swiglu_clamped", use_bias=True, router_bias=True, capacity_factor=0.5),
    "switch_plain_top1_capacity": dict(gated=False, activation="relu", top_k=1,
                                       capacity_factor=1.0),
}


def build(options, seed=0):
  model = nn.MoE(E, D, F, rngs=nnx.Rngs(seed), **options)
  keys = jax.random.split(jax.random.key(seed + 100), 6)
  model.router.kernel[...] = jax.random.normal(keys[0], (D, E))  # decisive routing
  for layer in (model.gate_up, model.up, model.down):
    if layer is not None and layer.bias is not None:
      layer.bias[...] = 0.3 * jax.random.normal(keys[1], layer.bias.shape)
  if model.router.bias is not None:
    model.router.bias[...] = jax.random.normal(keys[2], (E,))
  if model.routing_bias is not None:
    model.routing_bias[...] = 0.5 * jax.random.normal(keys[3], (E,))
  x = jax.random.normal(keys[4], (16, D))
  return model, x


def loss_of(y):
  return jnp.sum(jnp.sin(y) * y)


def leaf(tree, path):
  for key in path:
    tree = tree[key.key]
  return tree


@pytest.mark.parametrize("name", sorted(VARIANTS))
def test_variant_matches_per_token_loop_and_unfused(name):
  model, x = build(VARIANTS[name])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  chosen = choose(model, pure, x)
  capacity = None
  if model.capacity_factor is not None:
    capacity = math.ceil(model.capacity_factor * x.shape[0] * model.top_k / E)
  kept = kept_of(chosen, capacity)

  @jax.jit
  def run(params, x):
    def loss(params):
      y, aux = nnx.merge(graphdef, params, rest)(x)
      return loss_of(y), (y, aux)

    grads, (y, aux) = jax.grad(loss, has_aux=True)(params)
    unfused = nnx.merge(graphdef, params, rest)
    unfused.fused = False  # the baseline, from the same parameters
    return grads, y, aux, unfused(x)

  @jax.jit
  def run_reference(pure):
    def loss(p):
      y = reference(model, p, x, chosen, kept)
      return loss_of(y), y
    return jax.grad(loss, has_aux=True)(pure)

  grads, y, aux, (y_unfused, aux_unfused) = run(params, x)
  want_grads, want = run_reference(pure)
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
  got = nnx.to_pure_dict(grads)
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    np.testing.assert_allclose(leaf(got, path), g, rtol=2e-3, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  np.testing.assert_allclose(y_unfused, y, rtol=1e-5, atol=1e-6)

  # aux: the load over all assignments, the dropped fraction as the loop counts it.
  load = np.bincount(chosen.reshape(-1), minlength=E) / chosen.size
  np.testing.assert_allclose(aux["expert_load"], load, rtol=1e-6)
  assert (capacity is None) == bool(kept.all())
  np.testing.assert_allclose(aux["dropped_fraction"], 1.0 - kept.mean(), rtol=1e-6, atol=1e-7)
  assert set(aux) == {"load_balancing_loss", "router_z_loss", "expert_load",
                      "dropped_fraction"}
  for key in aux:
    np.testing.assert_allclose(aux_unfused[key], aux[key], rtol=1e-6)


def test_routing_bias_selects_but_does_not_weigh():
  model, x = build(dict(score="sigmoid", routing_bias=True, top_k=1))
  pure = nnx.to_pure_dict(nnx.state(model, nnx.Param))
  with_bias = choose(model, pure, x)
  model.routing_bias[...] = jnp.zeros(E)
  assert (choose(model, pure, x) != with_bias).any()  # the bias changes the selection
  model.routing_bias[...] = 100.0 * jax.nn.one_hot(3, E)  # everyone to expert 3 ...
  _, _, weights, experts = model.route_tokens(x)
  assert (np.asarray(experts) == 3).all()
  logits = x @ model.router.kernel[...]  # ... with expert 3's unbiased sigmoid score
  np.testing.assert_allclose(weights[:, 0], jax.nn.sigmoid(logits[:, 3]), rtol=1e-6)
  # Not a Param: no gradient, not in the optimizer's state; the balancing step moves it.
  assert "routing_bias" not in pure
  model.update_routing_bias(jax.nn.one_hot(3, E), rate=0.1)
  assert np.isclose(float(model.routing_bias[3]), 99.9)
  assert np.isclose(float(model.routing_bias[0]), 0.1)


def test_top1_router_learns_from_the_task_loss_and_sigmoid_aux():
  model = nn.MoE(E, D, F, top_k=1, rngs=nnx.Rngs(3))
  x = jax.random.normal(jax.random.key(4), (16, D))
  target = jax.random.normal(jax.random.key(5), (16, D))
  renormalized = nn.MoE(E, D, F, top_k=1, normalize_top_k=True, rngs=nnx.Rngs(3))
  sigmoid = nn.MoE(E, D, F, top_k=2, score="sigmoid", rngs=nnx.Rngs(6))
  sigmoid.router.kernel[...] = jnp.zeros((D, E))  # every score 1/2: normalized, 1/E

  @nnx.jit
  def run(model, renormalized, sigmoid):
    task = lambda m: jnp.mean((m(x)[0] - target) ** 2)  # noqa: E731  (no aux loss)
    return nnx.grad(task)(model), nnx.grad(task)(renormalized), sigmoid(x[:8])[1]

  grad, grad_renormalized, aux = run(model, renormalized, sigmoid)
  assert float(jnp.abs(grad["router"]["kernel"][...]).max()) > 1e-4
  # The old default renormalized the top-1 weight to 1.0: no router gradient.
  assert float(jnp.abs(grad_renormalized["router"]["kernel"][...]).max()) < 1e-5
  np.testing.assert_allclose(aux["load_balancing_loss"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(aux["router_z_loss"], (np.log(E) ** 2), rtol=1e-5)
  np.testing.assert_allclose(jnp.sum(aux["expert_load"]), 1.0, rtol=1e-6)
  assert float(aux["dropped_fraction"]) == 0.0


def test_presets():
  assert set(nn.MOE_PRESETS) == {"mixtral-8x7b", "deepseek-v3", "qwen3-moe-30b-a3b",
                                 "gpt-oss-120b"}
  full = nnx.eval_shape(lambda: nn.MoE.from_preset("deepseek-v3", rngs=nnx.Rngs(0)))
  assert full.gate_up.kernel.shape == (256, 7168, 4096)
  assert full.shared.up.kernel.shape == (7168, 4096) and full.top_k == 8
  assert full.routing_bias is not None and full.routed_scaling_factor == 2.5
  oss = nnx.eval_shape(lambda: nn.MoE.from_preset("gpt-oss-120b", rngs=nnx.Rngs(0)))
  assert oss.down.bias.shape == (128, 2880) and oss.activation == "swiglu_clamped"
  for name in sorted(nn.MOE_PRESETS):
    # Shrunk to width 16 and traced only (the layers' numerics are the variants' tests).
    def tiny_call(name=name):
      tiny = nn.MoE.from_preset(name, scale=16 / nn.MOE_PRESETS[name]["embed"],
                                rngs=nnx.Rngs(0))
      assert tiny.embed == 16 and tiny.num_experts == nn.MOE_PRESETS[name]["num_experts"]
      return tiny(jnp.zeros((4, 16)))

    y, aux = nnx.eval_shape(tiny_call)
    assert y.shape == (4, 16)
    assert aux["expert_load"].shape == (nn.MOE_PRESETS[name]["num_experts"],)
  with pytest.raises(ValueError, match="unknown preset"):
    nn.MoE.from_preset("mixtral", rngs=nnx.Rngs(0))


def test_linen_factories_take_a_name():
  class Block(linen.Module):
    @linen.compact
    def __call__(self, x):
      y, aux = nn.moe_linen(E, D, F, top_k=2, name="moe")(x)
      sizes = jnp.asarray([2, 0, 3, 1, 0, 0, 0, 0], jnp.int32)
      z = nn.grouped_linear_linen(E, D, 4, name="experts")(x[:6], sizes)
      return y, z, aux

  x = jax.random.normal(jax.random.key(9), (6, D))
  (y, z, aux), variables = jax.jit(Block().init_with_output)(jax.random.key(10), x)
  assert set(variables["params"]) == {"moe", "experts"}
  assert set(variables["params"]["moe"]) >= {"router", "gate_up", "down"}
  assert y.shape == x.shape and z.shape == (6, 4) and "expert_load" in aux


def test_kernel_metadata_and_bad_options():
  model = nn.MoE(E, D, F, kernel_metadata={"tag": "experts"}, rngs=nnx.Rngs(0))
  for kernel in (model.gate_up.kernel, model.down.kernel):
    assert kernel.get_metadata()["tag"] == "experts"
  assert kernel.get_metadata()["out_sharding"] == ("expert", "mlp", "embed")
  model = nn.MoE(E, D, F, kernel_metadata={"out_sharding": ("expert", None, None)},
                 rngs=nnx.Rngs(0))
  assert model.gate_up.kernel.get_metadata()["out_sharding"] == ("expert", None, None)
  with pytest.raises(ValueError, match="groups"):
    nn.MoE(E, D, F, num_expert_groups=3, top_k_groups=1, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="score"):
    nn.MoE(E, D, F, score="relu", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="gated activation"):
    nn.MoE(E, D, F, activation="relu", rngs=nnx.Rngs(0))


def test_eager_sharding_under_set_mesh_and_out_sharding():
  if len(jax.devices()) < 4:
    pytest.skip("needs 4 host CPU devices")
  mesh = jax.make_mesh((4,), ("expert",), axis_types=(jax.sharding.AxisType.Explicit,),
                       devices=jax.devices()[:4])
  with jax.set_mesh(mesh):
    model = nn.MoE(E, D, F, top_k=2, num_shared_experts=1, rngs=nnx.Rngs(0))
    assert model.gate_up.kernel[...].sharding.spec == P("expert", None, None)
    assert model.down.kernel[...].sharding.spec == P("expert", None, None)
    assert model.router.kernel[...].sharding.spec == P(None, "expert")
    # The logical names stay as metadata.
    assert model.gate_up.kernel.get_metadata()["out_sharding"] == ("expert", "embed", "mlp")
    x = jax.random.normal(jax.random.key(11), (8, D))
    y, _ = nnx.jit(lambda m, x: m(x, out_sharding=P("expert")))(model, x)
    assert y.sharding.spec == P("expert", None)
