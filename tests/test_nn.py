"""The Flax layers: GroupedLinear against per-expert nnx.Linear, the MoE block against a dense
per-token loop (forward and gradient), capacity dropping, a tiny training run, sharding
metadata on a fake 8-device mesh, expert parallelism (router weights on the output or the
input), and the Linen bridge."""

from __future__ import annotations

import numpy as np
import pytest

flax = pytest.importorskip("flax")

import gmm_jax  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from gmm_jax import nn  # noqa: E402
from gmm_jax._src.moe.layout import record_layouts  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

G, EMBED, MLP = 4, 16, 24


def value(variable):
  """A variable's value (a PartitionSpec cannot be read with [...])."""
  return variable.get_value() if hasattr(variable, "get_value") else variable.value


def test_grouped_linear_equals_per_expert_linear():
  layer = nn.GroupedLinear(G, EMBED, MLP, rngs=nnx.Rngs(0))
  layer.bias[...] = jax.random.normal(jax.random.key(1), (G, MLP))
  sizes = np.array([3, 0, 5, 2], np.int32)
  x = jax.random.normal(jax.random.key(2), (12, EMBED))  # 2 rows past the total
  got = layer(x, jnp.asarray(sizes), activation="relu")
  start = 0
  for g, size in enumerate(sizes):
    linear = nnx.Linear(EMBED, MLP, rngs=nnx.Rngs(0))
    linear.kernel[...] = layer.kernel[g]
    linear.bias[...] = layer.bias[g]
    np.testing.assert_allclose(got[start:start + size],
                               jax.nn.relu(linear(x[start:start + size])), rtol=1e-5,
                               atol=1e-5)
    start += size
  np.testing.assert_array_equal(got[start:], 0.0)
  # nnx.Linear's default init, per expert: fan-in scaling.
  assert abs(float(jnp.std(layer.kernel[...])) - 1 / np.sqrt(EMBED)) < 0.05


def test_grouped_linear_axis_names_and_quantized_weights():
  layer = nn.GroupedLinear(G, EMBED, MLP, weight_quant=gmm_jax.QuantSpec(
      jnp.int8, channelwise_axes=(0, 2)), rngs=nnx.Rngs(0))
  specs = nnx.get_partition_spec(nnx.state(layer))
  assert value(specs["kernel"]) == P("expert", "embed", "mlp")
  assert value(specs["bias"]) == P("expert", "mlp")
  x = jax.random.normal(jax.random.key(3), (10, EMBED))
  sizes = jnp.asarray([4, 0, 6, 0], jnp.int32)
  exact = gmm_jax.gmm(x, layer.kernel[...], sizes)
  got = layer(x, sizes)
  assert float(jnp.linalg.norm(got - exact) / jnp.linalg.norm(exact)) < 0.01
  grads = nnx.grad(lambda m: jnp.sum(m(x, sizes) ** 2))(layer)  # straight-through
  assert float(jnp.abs(grads["kernel"][...]).max()) > 0


def dense_moe(model: nn.MoE, x, capacity=None, top_e=None):
  """Every token through its top-k experts by explicit loops (independent of the sort);
  `top_e`: the experts chosen (numpy), or None: chosen here (eagerly)."""
  tokens = x.reshape(-1, x.shape[-1])
  logits = tokens @ model.router.kernel[...]
  probs = jax.nn.softmax(logits, axis=-1)
  if top_e is None:
    top_e = np.asarray(jax.lax.top_k(probs, model.top_k)[1])
  top_p = jnp.take_along_axis(probs, jnp.asarray(top_e), axis=-1)
  if model.normalize_top_k:
    top_p = top_p / top_p.sum(-1, keepdims=True)
  w_gate_up, wd = model.gate_up.kernel[...], model.down.kernel[...]
  wg, wu = w_gate_up[..., :MLP], w_gate_up[..., MLP:]  # the gate half first
  taken = np.zeros(model.num_experts, int)
  rows = []
  for t in range(tokens.shape[0]):
    y = jnp.zeros(tokens.shape[1])
    for j in range(model.top_k):
      e = int(top_e[t, j])
      taken[e] += 1
      if capacity is not None and taken[e] > capacity:
        continue
      h = jax.nn.silu(tokens[t] @ wg[e]) * (tokens[t] @ wu[e])
      y = y + top_p[t, j] * (h @ wd[e])
    rows.append(y)
  return jnp.stack(rows).reshape(x.shape)


def test_moe_matches_dense_loops_forward_and_gradient():
  model = nn.MoE(G, EMBED, MLP, top_k=2, rngs=nnx.Rngs(4))
  model.router.kernel[...] = jax.random.normal(jax.random.key(5), (EMBED, G))
  x = jax.random.normal(jax.random.key(6), (2, 5, EMBED))
  y, aux = model(x)
  np.testing.assert_allclose(y, dense_moe(model, x), rtol=1e-4, atol=1e-5)
  assert y.shape == x.shape and float(aux["load_balancing_loss"]) > 0

  # The experts chosen outside: the loops then unroll with static experts under jit.
  logits = x.reshape(-1, EMBED) @ model.router.kernel[...]
  top_e = np.asarray(jax.lax.top_k(logits, model.top_k)[1])

  def loss(model, reference):
    out = dense_moe(model, x, top_e=top_e) if reference else model(x)[0]
    return jnp.sum(out ** 2)

  got = nnx.jit(nnx.grad(lambda m: loss(m, False)))(model)
  want = nnx.jit(nnx.grad(lambda m: loss(m, True)))(model)
  for path in (("gate_up", "kernel"), ("down", "kernel"), ("router", "kernel")):
    a, b = got[path[0]][path[1]][...], want[path[0]][path[1]][...]
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)


def test_moe_capacity_drops_late_tokens():
  model = nn.MoE(G, EMBED, MLP, top_k=1, capacity_factor=0.5, rngs=nnx.Rngs(7))
  # A router that prefers expert 0 for everyone: only the first 2 tokens fit (8 x 1 x 0.5/4).
  kernel = np.zeros((EMBED, G), np.float32)
  kernel[:, 0] = 1.0
  model.router.kernel[...] = jnp.asarray(kernel)
  x = jnp.abs(jax.random.normal(jax.random.key(8), (8, EMBED)))
  y, _ = model(x)
  np.testing.assert_allclose(y, dense_moe(model, x, capacity=1), rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(y[1:]).max()) == 0.0 and float(jnp.abs(y[0]).max()) > 0


def test_aux_losses():
  model = nn.MoE(G, EMBED, MLP, top_k=1, rngs=nnx.Rngs(9))
  model.router.kernel[...] = jnp.zeros((EMBED, G))  # uniform router
  x = jax.random.normal(jax.random.key(10), (16, EMBED))
  _, aux = model(x)
  # Uniform probabilities: P_e = 1/G for all e, and sum_e f_e = 1, so G * sum f_e P_e = 1.
  np.testing.assert_allclose(aux["load_balancing_loss"], 1.0, rtol=1e-6)
  np.testing.assert_allclose(aux["router_z_loss"], np.log(G) ** 2, rtol=1e-5)


def test_tiny_training_run_reduces_the_loss():
  import optax

  model = nn.MoE(G, EMBED, MLP, top_k=2, rngs=nnx.Rngs(11))
  optimizer = nnx.Optimizer(model, optax.adam(3e-3), wrt=nnx.Param)
  x = jax.random.normal(jax.random.key(12), (32, EMBED))
  target = jnp.tanh(x @ jax.random.normal(jax.random.key(13), (EMBED, EMBED)))

  @nnx.jit
  def step(model, optimizer):
    def loss_fn(model):
      y, aux = model(x)
      return jnp.mean((y - target) ** 2) + 0.01 * aux["load_balancing_loss"]

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  losses = [float(step(model, optimizer)) for _ in range(30)]
  assert losses[-1] < 0.7 * losses[0], losses


def test_parameters_shard_by_logical_axes_on_a_mesh():
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host CPU devices")
  mesh = Mesh(np.array(jax.devices()[:8]).reshape(2, 4), ("data", "model"))
  rules = {"expert": "model", "embed": None, "mlp": None}
  model = nn.MoE(8, EMBED, MLP, top_k=2, rngs=nnx.Rngs(14))
  specs = nnx.get_partition_spec(nnx.state(model))
  kernel_spec = value(specs["gate_up"]["kernel"])
  assert kernel_spec == P("expert", "embed", "mlp")
  mesh_spec = P(*[rules[name] for name in kernel_spec])
  placed = jax.device_put(model.gate_up.kernel[...], NamedSharding(mesh, mesh_spec))
  assert placed.sharding.spec == P("model", None, None)
  assert placed.addressable_shards[0].data.shape == (2, EMBED, 2 * MLP)


def _weight_on_models(weight_on, **extra):
  """(one-device MoE, the same parameters with `extra` options): expert biases set (a
  padded or dropped row's ffn(0) is not 0), router weights on the expert outputs or
  inputs."""
  options = dict(top_k=2, use_bias=True, router_weight_on=weight_on)
  local = nn.MoE(8, EMBED, MLP, partitionable=False, rngs=nnx.Rngs(15), **options)
  local.down.bias[...] = 0.3 * jax.random.normal(jax.random.key(23), (8, EMBED))
  local.gate_up.bias[...] = 0.3 * jax.random.normal(jax.random.key(24), (8, 2 * MLP))
  other = nn.MoE(8, EMBED, MLP, rngs=nnx.Rngs(15), **options, **extra)
  nnx.update(other, nnx.state(local))
  return local, other


def _same_values_and_grads(local, other, x, x_other=None):
  run = nnx.jit(nnx.value_and_grad(lambda m, x: jnp.sum(jnp.sin(m(x)[0]))))
  (want, g_want), (got, g_got) = run(local, x), run(other, x if x_other is None else x_other)
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  for path in (("gate_up", "kernel"), ("down", "bias"), ("router", "kernel")):
    np.testing.assert_allclose(g_got[path[0]][path[1]][...], g_want[path[0]][path[1]][...],
                               rtol=1e-3, atol=1e-5, err_msg=str(path))


@pytest.mark.parametrize("weight_on", ["input", pytest.param("output", marks=pytest.mark.slow)])
def test_expert_parallel_moe_equals_single_device(weight_on):
  # The one-device path is checked against the per-token loop in test_moe_block.
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host CPU devices")
  mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))
  local, parallel = _weight_on_models(weight_on, expert_parallel=(mesh, "expert"))
  x = jax.random.normal(jax.random.key(16), (16, EMBED))  # 32 assignments over 8 devices
  _same_values_and_grads(local, parallel, x)


@pytest.mark.slow
def test_router_weights_on_the_input_in_the_partitionable_op():
  # Tokens and expert kernels over one axis: the partitioner's travel strategy.
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host CPU devices")
  mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))
  local, partitioned = _weight_on_models("input", partitionable=True)
  experts_first = lambda v: v.ndim >= 2 and v.shape[0] == 8  # noqa: E731
  nnx.update(partitioned, jax.tree.map(
      lambda v: jax.device_put(v, NamedSharding(mesh, P("expert") if experts_first(v)
                                                else P())), nnx.state(partitioned)))
  x = jax.random.normal(jax.random.key(16), (16, EMBED))
  with record_layouts() as chosen:
    _same_values_and_grads(local, partitioned, x,
                           jax.device_put(x, NamedSharding(mesh, P("expert"))))
  assert {layout.strategy for layout, _ in chosen} == {"travel"}


@pytest.mark.parametrize("fused", [False, True])
def test_expert_parallel_computes_in_the_layer_dtype(fused):
  # The expert kernels reach the gmm cast to the compute dtype (bf16 here), as on one device.
  if len(jax.devices()) < 8:
    pytest.skip("needs 8 host CPU devices")
  mesh = Mesh(np.array(jax.devices()[:8]), ("expert",))
  local = nn.MoE(8, EMBED, MLP, top_k=2, dtype=jnp.bfloat16, fused=fused, rngs=nnx.Rngs(20))
  parallel = nn.MoE(8, EMBED, MLP, top_k=2, dtype=jnp.bfloat16, fused=fused,
                    expert_parallel=(mesh, "expert"), rngs=nnx.Rngs(20))
  x = jax.random.normal(jax.random.key(21), (16, EMBED), jnp.bfloat16)
  jaxpr = jax.make_jaxpr(lambda x: parallel(x)[0])(x)
  experts = [eqn for eqn in jaxpr.eqns if eqn.primitive.name == "shard_map"]
  assert experts and all(
      v.aval.dtype == jnp.bfloat16 for eqn in experts for v in eqn.invars if v.aval.ndim == 3)
  run = nnx.jit(lambda m, x: m(x)[0])
  want, got = run(local, x), run(parallel, x)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_allclose(got.astype(np.float32), want.astype(np.float32), rtol=2e-2,
                             atol=2e-2)


def test_linen_bridge():
  module = nn.moe_linen(G, EMBED, MLP, top_k=2)
  x = jax.random.normal(jax.random.key(17), (6, EMBED))
  variables = module.init(jax.random.key(18), x)
  (y, aux) = module.apply(variables, x)
  assert y.shape == x.shape and set(aux) == {"load_balancing_loss", "router_z_loss",
                                             "expert_load", "dropped_fraction"}
  layer = nn.grouped_linear_linen(G, EMBED, MLP)
  sizes = jnp.asarray([2, 0, 3, 1], jnp.int32)
  variables = layer.init(jax.random.key(19), x, sizes)
  assert layer.apply(variables, x, sizes).shape == (6, MLP)
