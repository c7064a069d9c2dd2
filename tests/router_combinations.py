"""The option space of `nn.MoE`'s router and layer, drawn by hypothesis and held to the
per-token oracle of tests/moe_oracle.py.

A case: the score (softmax, sigmoid, sparsemixer with its window), top-k, the
renormalization and its epsilon, the routing bias, expert groups with their group score,
the routed scaling, the router bias, identity experts, shared experts (count, gate, scale),
the output bias, a capacity (a factor or an absolute count, per call or per sequence), the
FFN (gated or plain, its activation, expert biases), where the router weight goes, the load
balancing convention, and the implementation (`fused`, `partitionable`); optionally the
tokens sharded over a 2 x 4 CPU mesh ("data", "expert") with the expert kernels replicated
or over "expert". `refusal` says, from the documented rules, which combinations the layer
refuses and with what; `check_case` runs the others under `nnx.jit` (forward, the gradient
of a scalar loss w.r.t. x and every parameter, the aux entries) against the oracle.
"""

from __future__ import annotations

import dataclasses

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from gmm_jax import nn
from gmm_jax._src.moe.layout import record_layouts
from jax.sharding import NamedSharding, PartitionSpec as P

import meshes
import moe_oracle

E, D, F = 8, 16, 12
TOKENS = 16
MESH = ((2, 4), ("data", "expert"))
# A decision (top-k boundary, group rank, sparsemixer window) closer than this in float64
# may go either way in the layer's float32: such a draw is skipped.
DECISIVE = 1e-4


@dataclasses.dataclass(frozen=True)
class RouterCase:
  """`options`: nn.MoE's keyword arguments (sorted items); `shape`: x's leading dims;
  `sharded`: tokens over the mesh (experts over "expert" when `experts_sharded`)."""

  options: tuple
  shape: tuple = (TOKENS,)
  sharded: bool = False
  experts_sharded: bool = False
  seed: int = 0

  @property
  def kwargs(self) -> dict:
    return dict(self.options)


def router_cases(sharded: bool = False, taken: bool = False):
  """RouterCases; `taken`: only those the layer takes (no documented refusal)."""
  cases = _router_cases(sharded)
  return cases.filter(lambda case: not refusal(case.kwargs)) if taken else cases


@st.composite
def _router_cases(draw, sharded: bool) -> RouterCase:
  options = {}

  def pick(name, values):
    value = draw(st.sampled_from(values))
    if value is not None:
      options[name] = value
    return value

  score = pick("score", ["softmax", "sigmoid", "sparsemixer"])
  # sparsemixer refuses renormalization, the routing bias and groups: drawn now and then.
  sometimes = score != "sparsemixer" or draw(st.integers(0, 4)) == 0
  pick("top_k", [1, 2, 3])
  pick("normalize_top_k", [None, True, False] if sometimes else [None, False])
  pick("normalize_epsilon", [None, None, 1e-6, 0.25] if sometimes else [None])
  if score == "sparsemixer":
    pick("sparsemixer_eps", [None, 0.2, 0.5])
  pick("routing_bias", [None, True] if sometimes else [None])
  groups = pick("num_expert_groups", [None, None, 2, 4] if sometimes else [None])
  if groups is not None:
    options["top_k_groups"] = draw(st.integers(1, groups))
    pick("group_score", [None, "max"])
  pick("routed_scaling_factor", [None, 2.5])
  pick("router_bias", [None, True])
  pick("num_identity_experts", [None, None, 2, 4])
  shared = pick("num_shared_experts", [None, None, 1, 2])
  if shared or draw(st.integers(0, 9)) == 0:  # now and then, refused without them
    pick("shared_gate", [None, True])
    pick("shared_scale", [None, 0.5])
  pick("output_bias", [None, True])
  capacity = draw(st.sampled_from([None, "factor", "count"]))
  if capacity == "factor":
    pick("capacity_factor", [0.5, 1.0])
  if capacity == "count":
    pick("expert_capacity", [1, 2, 3])
  if capacity:
    pick("capacity_per", [None, "sequence"])
  gated = draw(st.booleans())
  if not gated:
    options["gated"] = False
    options["activation"] = draw(st.sampled_from(["relu", "gelu"]))
  else:
    pick("activation", [None, "gelu_tanh", "swiglu_clamped"])
  pick("use_bias", [None, True])
  pick("router_weight_on", [None, "input"])
  pick("load_balancing_convention", [None, "transformers"])
  pick("fused", [None, False])
  if sharded:
    pick("partitionable", [None, True])
  else:
    pick("partitionable", [True, False])
  return RouterCase(options=tuple(sorted(options.items())),
                    shape=draw(st.sampled_from([(TOKENS,), (2, TOKENS // 2)])),
                    sharded=sharded, experts_sharded=sharded and draw(st.booleans()),
                    seed=draw(st.integers(0, 2 ** 16)))


def refusal(options: dict):
  """[(exception type, message pattern)] of every documented rule the options break
  (empty: the layer takes them)."""
  rules = []
  shared = options.get("num_shared_experts", 0)
  identity = options.get("num_identity_experts", 0)
  score = options.get("score", "softmax")
  top_k = options.get("top_k", 2)
  capacity = ("capacity_factor" in options) or ("expert_capacity" in options)
  if options.get("shared_gate") and not shared:
    rules.append((ValueError, "num_shared_experts"))
  if options.get("shared_scale", 1.0) != 1.0 and not shared:
    rules.append((ValueError, "num_shared_experts"))
  if "capacity_factor" in options and "expert_capacity" in options:
    rules.append((ValueError, "give one"))
  if identity and capacity:
    rules.append((NotImplementedError, "num_identity_experts"))
  normalize = options.get("normalize_top_k")
  if score == "sparsemixer" and (normalize or options.get("routing_bias")
                                 or "num_expert_groups" in options):
    rules.append((NotImplementedError, "sparsemixer"))
  if normalize is None:  # the default: when top_k > 1; sparsemixer is not renormalized
    normalize = top_k > 1 and score != "sparsemixer"
  if options.get("normalize_epsilon") and not normalize:
    rules.append((ValueError, "normalize_top_k"))
  groups = options.get("num_expert_groups")
  if groups is not None:
    routed = E + identity
    if routed % groups:
      rules.append((ValueError, "groups"))
    elif top_k > options["top_k_groups"] * (routed // groups):
      rules.append((ValueError, "top_k"))
  return rules


# Cases every run holds (hypothesis.example), besides the drawn ones: an absolute capacity
# per call whose per-shard share is not a whole number of the sharded call's, and the newer
# options all at once.
SHARDED_SHARE = RouterCase(
    options=(("expert_capacity", 3), ("partitionable", True), ("top_k", 2)),
    sharded=True, experts_sharded=True, seed=5)
EVERYTHING = RouterCase(
    options=tuple(sorted(dict(
        score="sparsemixer", sparsemixer_eps=0.5, top_k=3, routed_scaling_factor=2.5,
        num_identity_experts=2, num_shared_experts=1, shared_gate=True, shared_scale=0.5,
        output_bias=True, router_weight_on="input", router_bias=True, use_bias=True,
        fused=False, partitionable=False).items())), seed=7)
CAPACITY_PER_SEQUENCE = RouterCase(
    options=tuple(sorted(dict(
        score="sigmoid", top_k=3, normalize_epsilon=0.25, num_expert_groups=4, top_k_groups=2,
        group_score="max", routing_bias=True, expert_capacity=2, capacity_per="sequence",
        num_shared_experts=2, shared_scale=0.5, output_bias=True, gated=False,
        activation="relu").items())), shape=(2, TOKENS // 2), seed=9)


def _sharded(mesh, spec):
  return lambda a: jax.device_put(a, NamedSharding(mesh, spec))


def build(case: RouterCase):
  """The layer with decisive random parameters, and x."""
  model = nn.MoE(E, D, F, rngs=nnx.Rngs(case.seed), **case.kwargs)
  keys = iter(jax.random.split(jax.random.key(case.seed + 1), 8))
  routed = model.router.kernel.shape[-1]
  model.router.kernel[...] = jax.random.normal(next(keys), (D, routed))
  for layer in (model.gate_up, model.up, model.down):
    if layer is not None and layer.bias is not None:
      layer.bias[...] = 0.3 * jax.random.normal(next(keys), layer.bias.shape)
  if model.router.bias is not None:
    model.router.bias[...] = jax.random.normal(next(keys), (routed,))
  if model.routing_bias is not None:
    model.routing_bias[...] = 0.5 * jax.random.normal(next(keys), (routed,))
  if model.output_bias is not None:
    model.output_bias[...] = 0.5 * jax.random.normal(next(keys), (D,))
  x = jax.random.normal(next(keys), case.shape + (D,))
  return model, x


def _grad_tol(want):
  """float32 gradients (the existing variants' rtol 2e-3, atol 1e-5): atol relative to the
  gradient's largest entry, as tests/moe_combinations.py's, since an entry near 0 is a
  cancellation of terms of that size (scaled weights and shared experts make them
  larger than 1)."""
  return dict(rtol=2e-3, atol=1e-5 * max(1.0, float(np.abs(want).max())))




def expected_kept(model, case: RouterCase, chosen):
  """The capacity's kept assignments by the documented rule: per sequence, or per call,
  which on a mesh is per token shard (with an absolute capacity: each shard's share)."""
  if model.capacity_factor is None and model.expert_capacity is None:
    return np.ones(chosen.shape, bool)
  if model.capacity_per == "sequence":
    sequence = case.shape[-1] if len(case.shape) > 1 else TOKENS
    return moe_oracle.kept_of(chosen, moe_oracle.capacity_of(model, sequence), sequence)
  shards = int(np.prod(MESH[0])) if case.sharded else 1
  block = TOKENS // shards
  if model.expert_capacity is not None:
    capacity = -(-model.expert_capacity * block // TOKENS)  # ceil: the shard's share
  else:
    capacity = moe_oracle.capacity_of(model, block)
  return moe_oracle.kept_of(chosen, capacity, block)


def check_refusal(options: dict) -> bool:
  """Whether the layer refuses `options`, asserting that it does so iff `refusal` says,
  with one of the broken rules' exceptions."""
  rules = refusal(options)
  try:
    nn.MoE(E, D, F, rngs=nnx.Rngs(0), **options)
  except (ValueError, NotImplementedError) as error:
    assert rules, (options, error)
    assert any(isinstance(error, kind) and pattern in str(error) for kind, pattern in rules), (
        options, rules, error)
    return True
  assert not rules, f"{options} was taken; documented refusals: {rules}"
  return False


def check_case(case: RouterCase):
  """Refused combinations raise as documented; the others equal the oracle under nnx.jit:
  y, the gradient of a scalar loss w.r.t. x and every nnx.Param, and the aux entries."""
  if check_refusal(case.kwargs):
    return
  model, x = build(case)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  pure = nnx.to_pure_dict(params)
  tokens = np.asarray(x).reshape(-1, D)
  routing = moe_oracle.routing_of(model, pure, tokens)
  hypothesis.assume(routing.margin > DECISIVE)
  kept = expected_kept(model, case, routing.chosen)

  if case.sharded:
    mesh = meshes.mesh(*MESH)
    token_spec = P(("data", "expert")) if len(case.shape) == 1 else P("data", "expert")
    x = _sharded(mesh, token_spec)(x)
    if case.experts_sharded:
      for layer in (model.gate_up, model.up, model.down):
        if layer is not None:
          for variable in (layer.kernel, layer.bias):
            if variable is not None:
              variable[...] = _sharded(mesh, P("expert"))(variable[...])

  @nnx.jit
  def run(model, x):
    def loss(model, x):
      y, aux = model(x)
      return moe_oracle.loss_of(y), (y, aux)
    (_, (y, aux)), (grads, dx) = nnx.value_and_grad(loss, argnums=(0, 1), has_aux=True)(
        model, x)
    return y, aux, grads, dx

  @jax.jit
  def run_reference(pure, tokens):
    def loss(p, tokens):
      y = moe_oracle.reference(model, p, tokens, routing.chosen, kept, routing.windows)
      return moe_oracle.loss_of(y), y
    return jax.grad(loss, argnums=(0, 1), has_aux=True)(pure, tokens)

  with record_layouts() as layouts:
    y, aux, grads, dx = run(model, x)
  if case.sharded and case.kwargs.get("partitionable"):
    # The partitioner's plan for the layout, forward and backward.
    want_layout = "travel" if case.experts_sharded else "local"
    assert [layout.strategy for layout, _ in layouts] == [want_layout] * 2, (case, layouts)
  elif case.sharded:  # the layer sees the mesh and splits itself at trace time
    assert layouts == [], (case, layouts)
  (want_grads, want_dx), want = run_reference(pure, jnp.asarray(tokens))
  message = str(case)
  np.testing.assert_allclose(np.asarray(y).reshape(-1, D), want, rtol=1e-4, atol=1e-5,
                             err_msg=message)
  np.testing.assert_allclose(np.asarray(dx).reshape(-1, D), want_dx, **_grad_tol(want_dx),
                             err_msg=f"dx {message}")
  got = nnx.to_pure_dict(grads)
  want_paths = {jax.tree_util.keystr(p) for p, _ in
                jax.tree_util.tree_leaves_with_path(want_grads)}
  got_paths = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(got)}
  assert got_paths == want_paths, (message, got_paths ^ want_paths)
  for path, g in jax.tree_util.tree_leaves_with_path(want_grads):
    np.testing.assert_allclose(moe_oracle.leaf(got, path), g, **_grad_tol(g),
                               err_msg=f"d{jax.tree_util.keystr(path)} {message}")

  routed = model.router.kernel.shape[-1]
  np.testing.assert_allclose(aux["expert_load"],
                             moe_oracle.expert_load_of(routing.chosen, routed), rtol=1e-6,
                             err_msg=message)
  np.testing.assert_allclose(aux["load_balancing_loss"],
                             moe_oracle.balance_loss(model, pure, tokens, routing.chosen),
                             rtol=1e-5, err_msg=message)
  np.testing.assert_allclose(aux["dropped_fraction"], 1.0 - kept.mean(), rtol=1e-6,
                             atol=1e-7, err_msg=message)
  if kept.all():
    assert float(aux["dropped_fraction"]) == 0.0, message
