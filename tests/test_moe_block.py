"""The MoE block's variants against a plain per-token loop of the same formula.

Every router option (softmax/sigmoid scores, a routing bias that only selects, group-limited
top-k, routed scaling, top-1 without renormalization, both load-balancing conventions) and
expert option (shared experts with or without their sigmoid gate, expert biases, clamped
SwiGLU with its constants, GeGLU, a plain FFN, router weights on the output or the input,
capacity per call or per sequence) is checked forward and by jax.grad against `reference`
(tests/moe_oracle.py), which loops over the tokens and their chosen experts with
numpy-chosen experts and jnp arithmetic, fused and unfused. The top-1 router learns from the
task loss; aux, presets, a replacement router, Linen names, metadata, bad options and eager
sharding."""

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
from moe_oracle import (balance_loss, choose, kept_of, leaf, loss_of,  # noqa: E402
                        reference)

E, D, F = 8, 16, 12

# The default run covers every option at least once (several per variant); the rest run
# with -m slow.
VARIANTS = {
    "softmax_top2": dict(),
    # Qwen2-MoE-like: unnormalized, a sigmoid-gated shared expert, transformers' loss scale.
    "gelu_top3_unnormalized_scaled_gated_shared_transformers_loss": dict(
        top_k=3, activation="gelu", normalize_top_k=False, routed_scaling_factor=0.5,
        num_shared_experts=2, shared_mlp=8, shared_gate=True,
        load_balancing_convention="transformers"),
    "deepseek_sigmoid_bias_groups_scaled_shared": dict(
        score="sigmoid", routing_bias=True, num_expert_groups=4, top_k_groups=2, top_k=3,
        routed_scaling_factor=2.5, num_shared_experts=1),
    # DeepSeek-V2's group_limited_greedy: softmax, groups ranked by their best score.
    "deepseek_v2_softmax_max_group_score_unnormalized": dict(
        num_expert_groups=4, top_k_groups=2, group_score="max", top_k=3,
        normalize_top_k=False, routed_scaling_factor=1.5),
    # gpt-oss with other clamp constants (applied after the gmm) and the router weights on
    # the expert inputs (with biases and capacity: a dropped row's ffn(0) is not 0).
    "gpt_oss_biases_clamp_constants_input_weights_capacity": dict(
        activation="swiglu_clamped", swiglu_limit=2.0, swiglu_alpha=1.3, use_bias=True,
        router_bias=True, capacity_factor=0.5, router_weight_on="input"),
    # Switch in transformers: top-1, not gated, capacity per sequence (x [2, 8, D]).
    "switch_plain_top1_capacity_per_sequence": dict(
        gated=False, activation="relu", top_k=1, capacity_factor=1.0,
        capacity_per="sequence"),
    "slow_gpt_oss_biases_clamped_capacity": dict(
        activation="swiglu_clamped", use_bias=True, router_bias=True, capacity_factor=0.5),
    # Llama 4: sigmoid of the top-1 logit on the expert input, a shared expert.
    "slow_llama4_sigmoid_top1_input_weights_shared": dict(
        score="sigmoid", top_k=1, normalize_top_k=False, router_weight_on="input",
        num_shared_experts=1),
    "slow_switch_plain_top1_capacity": dict(gated=False, activation="relu", top_k=1,
                                            capacity_factor=1.0),
}
SLOW = [pytest.param(name, marks=pytest.mark.slow) if name.startswith("slow_") else name
        for name in sorted(VARIANTS)]


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




@pytest.mark.parametrize("name", SLOW)
def test_variant_matches_per_token_loop_and_unfused(name):
  model, x = build(VARIANTS[name])
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  chosen = choose(model, pure, x)
  capacity, sequence = None, None
  if model.capacity_per == "sequence":
    sequence = x.shape[0] // 2  # the layer sees x as [2, S, D]
  if model.capacity_factor is not None:
    capacity = math.ceil(model.capacity_factor * (sequence or x.shape[0]) * model.top_k / E)
  kept = kept_of(chosen, capacity, sequence)
  shape = (2, sequence, D) if sequence else x.shape

  @jax.jit
  def run(params, x):
    def loss(params):
      y, aux = nnx.merge(graphdef, params, rest)(x.reshape(shape))
      return loss_of(y), (y.reshape(x.shape), aux)

    grads, (y, aux) = jax.grad(loss, has_aux=True)(params)
    unfused = nnx.merge(graphdef, params, rest)
    unfused.fused = False  # the baseline, from the same parameters
    y_unfused, aux_unfused = unfused(x.reshape(shape))
    return grads, y, aux, (y_unfused.reshape(x.shape), aux_unfused)

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
  np.testing.assert_allclose(aux["load_balancing_loss"], balance_loss(model, pure, x, chosen),
                             rtol=1e-5)
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
  assert set(nn.MOE_PRESETS) == {
      "mixtral-8x7b", "qwen1.5-moe-a2.7b", "qwen3-moe-30b-a3b", "qwen3-next-80b-a3b",
      "deepseek-v3", "olmoe-1b-7b", "gpt-oss-120b", "granite-3.0-3b-a800m", "dbrx",
      "glm-4.5-air", "llama-4-scout", "switch-base-8", "granite-4.0-h-tiny", "jamba-v0.1",
      "lfm2-8b-a1b", "minimax-m2", "mistral-small-4", "solar-open-100b", "deepseek-v2",
      "dots.llm1", "ernie-4.5-21b-a3b", "ernie-4.5-vl-28b-a3b-text", "hunyuan-a13b",
      "jetmoe-8b", "kimi-linear-48b-a3b", "longcat-flash", "phi-3.5-moe"}
  # The models' own defaults: Qwen2-MoE and OLMoE do not renormalize, Qwen3-MoE does.
  normalized = {name: nn.MOE_PRESETS[name].get("normalize_top_k") for name in
                ("qwen1.5-moe-a2.7b", "olmoe-1b-7b", "qwen3-moe-30b-a3b")}
  assert normalized == {"qwen1.5-moe-a2.7b": False, "olmoe-1b-7b": False,
                        "qwen3-moe-30b-a3b": True}
  qwen = nnx.eval_shape(lambda: nn.MoE.from_preset("qwen3-next-80b-a3b", rngs=nnx.Rngs(0)))
  assert qwen.shared.gate.kernel.shape == (2048, 1) and qwen.gate_up.kernel.shape == (
      512, 2048, 1024)
  llama = nn.MOE_PRESETS["llama-4-scout"]
  assert llama["router_weight_on"] == "input" and llama["top_k"] == 1
  assert nn.MOE_PRESETS["switch-base-8"]["capacity_per"] == "sequence"
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
    # The router's experts: the identity experts too.
    routed = (nn.MOE_PRESETS[name]["num_experts"]
              + nn.MOE_PRESETS[name].get("num_identity_experts", 0))
    assert aux["expert_load"].shape == (routed,)
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
  with pytest.raises(ValueError, match="group_score"):
    nn.MoE(E, D, F, num_expert_groups=4, top_k_groups=2, group_score="min", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="gated activation"):
    nn.MoE(E, D, F, activation="relu", rngs=nnx.Rngs(0))
  bad = [
      (dict(router_weight_on="both"), "router_weight_on"),
      (dict(capacity_per="batch"), "capacity_per"),
      (dict(load_balancing_convention="hf"), "load_balancing_convention"),
      (dict(swiglu_limit=5.0), "swiglu_clamped"),  # constants of another activation
      (dict(activation="swiglu_clamped", swiglu_alpha=0.0), "swiglu_alpha"),
      (dict(shared_gate=True), "num_shared_experts"),
      (dict(router=nnx.Linear(D, E, rngs=nnx.Rngs(0))), "route"),
      (dict(router=nn.Router(D, E, rngs=nnx.Rngs(0)), score="sigmoid"), "score"),
      (dict(normalize_epsilon=-1e-6), "normalize_epsilon"),
      (dict(shared_scale=0.5), "num_shared_experts"),
      (dict(normalize_top_k=False, normalize_epsilon=1e-6), "normalize_top_k"),
      (dict(router=nn.Router(D, E, rngs=nnx.Rngs(0)), normalize_epsilon=1e-6),
       "normalize_epsilon"),
  ]
  for options, message in bad:
    with pytest.raises(ValueError, match=message):
      nn.MoE(E, D, F, rngs=nnx.Rngs(0), **options)


def test_normalize_epsilon_adds_to_the_sum():
  """normalize_epsilon: the chosen weights divided by their sum plus it (a value large
  enough to see), in the forward and the router's gradient."""
  model = nn.MoE(E, D, F, top_k=3, score="sigmoid", normalize_top_k=True,
                 normalize_epsilon=0.25, rngs=nnx.Rngs(3))
  assert model.normalize_epsilon == 0.25
  x = jax.random.normal(jax.random.key(4), (6, D))

  def weights(kernel, epsilon):
    scores = jax.nn.sigmoid(x @ kernel)
    chosen = model.route_tokens(x)[3]
    w = jnp.take_along_axis(scores, chosen, axis=-1)
    return w / (jnp.sum(w, axis=-1, keepdims=True) + epsilon)

  kernel = model.router.kernel[...]
  np.testing.assert_allclose(model.route_tokens(x)[2], weights(kernel, 0.25), rtol=1e-6)
  assert not np.allclose(weights(kernel, 0.25), weights(kernel, 0.0), rtol=1e-3)

  def loss(router):
    return jnp.sum(router.route(x).weights * jnp.arange(3.0))

  grad = nnx.grad(loss)(model.router).kernel[...]
  expected = jax.grad(lambda k: jnp.sum(weights(k, 0.25) * jnp.arange(3.0)))(kernel)
  np.testing.assert_allclose(grad, expected, rtol=1e-5, atol=1e-7)


def test_shared_scale_multiplies_the_shared_output():
  """shared_scale=c: y = routed + c * shared, forward and gradients (the same parameters
  as a layer with c = 1, whose shared part alone is its output minus the routed one)."""
  scaled = nn.MoE(E, D, F, top_k=2, num_shared_experts=1, shared_scale=0.5,
                  rngs=nnx.Rngs(5))
  plain = nn.MoE(E, D, F, top_k=2, num_shared_experts=1, rngs=nnx.Rngs(5))
  x = jax.random.normal(jax.random.key(6), (6, D))
  shared = plain.shared(x)
  y_scaled, _ = scaled(x)
  y_plain, _ = plain(x)
  np.testing.assert_allclose(y_scaled, y_plain - 0.5 * shared, rtol=1e-5, atol=1e-6)
  grad_scaled = nnx.grad(lambda m: jnp.sum(m(x)[0] ** 2))(scaled)
  grad_down = jax.grad(lambda w: jnp.sum(
      (y_plain - shared + 0.5 * (jax.nn.silu(x @ plain.shared.up.kernel[...][:, :F]) *
                                 (x @ plain.shared.up.kernel[...][:, F:])) @ w) ** 2))(
      plain.shared.down.kernel[...])
  np.testing.assert_allclose(grad_scaled.shared.down.kernel[...], grad_down, rtol=1e-4,
                             atol=1e-6)


def test_a_replacement_router():
  class Doubled(nnx.Module):
    """The built-in router's choice with its weights doubled and its own aux."""

    def __init__(self, rngs):
      self.inner = nn.Router(D, E, top_k=2, rngs=rngs)

    def route(self, tokens):
      weights, experts, _ = self.inner.route(tokens)
      return nn.Routing(2.0 * weights, experts, {"mine": jnp.ones(())})

  model = nn.MoE(E, D, F, router=Doubled(nnx.Rngs(1)), rngs=nnx.Rngs(2))
  plain = nn.MoE(E, D, F, rngs=nnx.Rngs(2))
  plain.router.kernel[...] = model.router.inner.kernel[...]  # the same, weights not doubled
  for name in ("gate_up", "down"):
    getattr(plain, name).kernel[...] = getattr(model, name).kernel[...]
  x = jax.random.normal(jax.random.key(12), (8, D))
  (y, aux), (want, _) = nnx.jit(lambda a, b: (a(x), b(x)))(model, plain)
  np.testing.assert_allclose(y, 2.0 * want, rtol=1e-5, atol=1e-6)  # linear in the weights
  assert set(aux) == {"mine", "dropped_fraction"}


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


@pytest.mark.parametrize("options, max_rows", [
    (dict(), None),  # dropless: T slots per expert
    # gpt-oss-like, input weights and biases, with fewer slots than the hot experts need:
    # max_rows acts as a capacity (earlier tokens first), together with capacity_factor.
    (dict(activation="swiglu_clamped", use_bias=True, router_weight_on="input",
          capacity_factor=0.75), 2),
])
def test_masked_layout_matches_per_token_loop(options, max_rows):
  # The decode layout (`layout="masked"`, `[E, max_rows, D]` slots): forward, gradients and
  # the dropped fraction against the per-token loop with the kept assignments counted here.
  model, x = build(dict(options, layout="masked", max_rows=max_rows))
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  chosen = choose(model, pure, x)
  limit = max_rows
  if model.capacity_factor is not None:
    capacity = math.ceil(model.capacity_factor * x.shape[0] * model.top_k / E)
    limit = capacity if limit is None else min(limit, capacity)
  kept = kept_of(chosen, limit)

  @jax.jit
  def run(params, x):
    def loss(params):
      y, aux = nnx.merge(graphdef, params, rest)(x)
      return loss_of(y), (y, aux)
    return jax.grad(loss, has_aux=True)(params)

  @jax.jit
  def run_reference(pure):
    def loss(p):
      y = reference(model, p, x, chosen, kept)
      return loss_of(y), y
    return jax.grad(loss, has_aux=True)(pure)

  grads, (y, aux) = run(params, x)
  want_grads, want = run_reference(pure)
  np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-5)
  got = nnx.to_pure_dict(grads)
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    np.testing.assert_allclose(leaf(got, path), g, rtol=2e-3, atol=1e-5,
                               err_msg=jax.tree_util.keystr(path))
  assert (limit is None) == bool(kept.all())
  np.testing.assert_allclose(aux["dropped_fraction"], 1.0 - kept.mean(), rtol=1e-6, atol=1e-7)


def test_masked_layout_refuses_meshes_and_bad_rows():
  with pytest.raises(NotImplementedError, match="layout='ragged'"):
    nn.MoE(E, D, F, layout="masked", partitionable=True, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="layout must be one of"):
    nn.MoE(E, D, F, layout="dense", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_rows"):
    nn.MoE(E, D, F, max_rows=4, rngs=nnx.Rngs(0))  # without layout="masked"
  with pytest.raises(ValueError, match="max_rows"):
    nn.MoE(E, D, F, layout="masked", max_rows=0, rngs=nnx.Rngs(0))


@pytest.mark.parametrize("capacity_per, shape", [("call", (24, D)), ("sequence", (3, 8, D))])
def test_expert_capacity_is_the_capacity_factor_of_that_count(capacity_per, shape):
  """An absolute capacity C is the factor whose ceil(c * n * k / E) is C (n: the call's
  tokens, or each sequence's), for every C up to the dropless count."""
  x = jax.random.normal(jax.random.key(11), shape)
  counted = shape[-2] if capacity_per == "sequence" else shape[0]
  for capacity in (1, 2, 5, counted * 2):
    absolute, _ = build(dict(top_k=2, expert_capacity=capacity, capacity_per=capacity_per))
    factor = capacity * E / (counted * 2) * (1 - 1e-9)
    relative, _ = build(dict(top_k=2, capacity_factor=factor, capacity_per=capacity_per))
    y, aux = nnx.jit(lambda m: m(x))(absolute)
    want, want_aux = nnx.jit(lambda m: m(x))(relative)
    np.testing.assert_allclose(y, want, rtol=1e-6, atol=1e-6)
    assert float(aux["dropped_fraction"]) == float(want_aux["dropped_fraction"])
    if capacity == 1:  # 2 * n assignments, at most E kept
      assert float(aux["dropped_fraction"]) >= 1 - E / (counted * 2)
    if capacity >= counted * 2:
      assert float(aux["dropped_fraction"]) == 0.0


@pytest.mark.parametrize("options, match", [
    (dict(expert_capacity=0), "positive int"),
    (dict(expert_capacity=2.5), "positive int"),
    (dict(expert_capacity=True), "positive int"),
    (dict(expert_capacity=4, capacity_factor=1.0), "give one"),
    (dict(gated_prologue="yes"), "gated_prologue must be None"),
    (dict(gated_prologue=1), "gated_prologue must be None"),
])
def test_capacity_and_prologue_options_are_checked(options, match):
  with pytest.raises(ValueError, match=match):
    nn.MoE(E, D, F, rngs=nnx.Rngs(0), **options)


def test_dropped_fraction_is_exactly_zero_when_nothing_is_dropped():
  """Under jit 1 - mean(kept) rounded to -4.5e-8 for a capacity that dropped nothing."""
  x = jax.random.normal(jax.random.key(12), (3, 56, D))
  model, _ = build(dict(top_k=2, expert_capacity=112, capacity_per="sequence"))
  aux = nnx.jit(lambda m: m(x)[1])(model)
  assert float(aux["dropped_fraction"]) == 0.0


def test_identity_experts_add_their_weight_times_the_input():
  """num_identity_experts: the router scores E + Z experts; a chosen id >= E adds w * x
  (LongCat-Flash's zero experts), the others run their FFN; forward and gradients equal a
  per-token loop, fused and unfused alike."""
  model = nn.MoE(E, D, F, top_k=3, num_identity_experts=3, rngs=nnx.Rngs(0))
  assert model.router.kernel.shape == (D, E + 3)
  model.router.kernel[...] = jax.random.normal(jax.random.key(1), (D, E + 3))
  x = jax.random.normal(jax.random.key(2), (32, D))
  _, _, weights, chosen = model.route_tokens(x)
  identity = np.asarray(chosen) >= E
  assert identity.any() and (~identity).any()
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  def reference(p, x):
    def one_token(x_t, experts, w):
      y = jnp.zeros(D)
      for j in range(model.top_k):
        e = jnp.minimum(experts[j], E - 1)
        z = x_t @ p["gate_up"]["kernel"][e]
        ffn = (jax.nn.silu(z[:F]) * z[F:]) @ p["down"]["kernel"][e]
        y = y + w[j] * jnp.where(experts[j] >= E, x_t, ffn)
      return y
    logits = x @ p["router"]["kernel"]
    w = jnp.take_along_axis(jax.nn.softmax(logits), chosen, axis=-1)
    return jax.vmap(one_token)(x, chosen, w / jnp.sum(w, -1, keepdims=True))

  def loss(fn, p, x):
    return jnp.sum(jnp.sin(fn(p, x)))

  def layer(fused):
    def fn(p, x):
      moe = nnx.merge(graphdef, p, rest)
      moe.fused = fused
      return moe(x)[0]
    return fn

  pure = nnx.to_pure_dict(params)
  want, want_grads = jax.jit(jax.value_and_grad(lambda p, x: loss(reference, p, x),
                                                (0, 1)))(pure, x)
  for fused in (True, False):
    got, (got_params, got_dx) = jax.jit(jax.value_and_grad(
        lambda p, x: loss(layer(fused), p, x), (0, 1)))(params, x)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    np.testing.assert_allclose(got_dx, want_grads[1], rtol=1e-4, atol=1e-5)
    got_params = nnx.to_pure_dict(got_params)
    for path, g in jax.tree_util.tree_leaves_with_path(want_grads[0]):
      np.testing.assert_allclose(leaf(got_params, path), g, rtol=2e-3, atol=1e-5,
                                 err_msg=jax.tree_util.keystr(path))
  with pytest.raises(NotImplementedError, match="capacity_factor"):
    nn.MoE(E, D, F, num_identity_experts=2, capacity_factor=1.0, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="num_identity_experts"):
    nn.MoE(E, D, F, num_identity_experts=-1, rngs=nnx.Rngs(0))


def test_sparsemixer_weights_follow_the_window_rule():
  """score="sparsemixer": the k best logits; the j-th weight is the softmax over the
  logits not chosen before it within the relative window 2 * eps of its own (numpy loop)."""
  eps = 0.2
  router = nn.Router(D, E, top_k=3, score="sparsemixer", sparsemixer_eps=eps,
                     rngs=nnx.Rngs(0))
  router.kernel[...] = jax.random.normal(jax.random.key(3), (D, E))
  x = jax.random.normal(jax.random.key(4), (24, D))
  logits, _, weights, experts = router.select(x)
  assert not router.normalize_top_k
  logits, weights, experts = map(np.asarray, (logits, weights, experts))
  assert (weights < 1).any() and np.isclose(weights, 1).any()
  for t in range(x.shape[0]):
    order = np.argsort(-logits[t], kind="stable")[:3]
    np.testing.assert_array_equal(experts[t], order)
    for j, e in enumerate(order):
      rest = [i for i in range(E) if i not in order[:j]]
      window = [i for i in rest if (logits[t, e] - logits[t, i])
                / max(abs(logits[t, i]), logits[t, e]) <= 2 * eps]
      want = 1 / np.sum(np.exp(logits[t, window] - logits[t, e]))
      np.testing.assert_allclose(weights[t, j], want, rtol=1e-5)
  with pytest.raises(NotImplementedError, match="sparsemixer"):
    nn.Router(D, E, score="sparsemixer", normalize_top_k=True, rngs=nnx.Rngs(0))


def test_output_bias_is_added_to_every_token():
  """output_bias=True: a [D] parameter added to the layer's output, with its gradient the
  sum of the output's cotangent over the tokens."""
  plain = nn.MoE(E, D, F, rngs=nnx.Rngs(0))
  biased = nn.MoE(E, D, F, output_bias=True, rngs=nnx.Rngs(0))
  assert biased.output_bias.shape == (D,) and plain.output_bias is None
  biased.output_bias[...] = jnp.arange(D, dtype=jnp.float32)
  x = jax.random.normal(jax.random.key(5), (6, D))
  np.testing.assert_allclose(biased(x)[0] - plain(x)[0], np.broadcast_to(np.arange(D), (6, D)),
                             rtol=1e-5, atol=1e-5)
  grads = nnx.grad(lambda m: jnp.sum(m(x)[0] * 2.0))(biased)
  np.testing.assert_allclose(grads.output_bias[...], np.full(D, 12.0), rtol=1e-6)
