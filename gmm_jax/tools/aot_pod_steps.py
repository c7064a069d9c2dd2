"""The training steps `gmm_jax.tools.aot_pod` compiles.

The models, the strategies (the ways of writing the step), the mesh, and each strategy's
loss over abstract parameters with their layouts, and the SGD step around it.

A gmm_jax strategy splits a `gmm_jax.nn.MoE` as a user does (`nnx_loss`); the baselines
write the same MoE math without gmm_jax (`ragged_dot_loss`) or train one
`nn.GroupedLinear` (`grouped_linear_loss`)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh, PartitionSpec as P

from gmm_jax import nn


@dataclasses.dataclass(frozen=True)
class Model:
  """A `nn.MoE` preset, optionally shrunk, and the tokens each chip trains on."""

  preset: str
  scale: float = 1.0
  tokens_per_chip: int = 4096
  overrides: tuple[tuple[str, object], ...] = ()


MODELS = {
    "mixtral": Model("mixtral-8x7b"),
    "deepseek-v3": Model("deepseek-v3"),
    # Small shapes: the same routing and expert counts, widths / 16, 256 tokens per chip.
    "mixtral-small": Model("mixtral-8x7b", scale=1 / 16, tokens_per_chip=256),
    "deepseek-v3-small": Model("deepseek-v3", scale=1 / 16, tokens_per_chip=256),
}
DEFAULT_MODELS = ("mixtral", "deepseek-v3")
# --small (CI): one small model, 2-3 minutes for every strategy on the small topologies.
SMALL_MODELS = ("mixtral-small",)
STRATEGIES = ("default", "default+set_mesh", "explicit", "ep", "unfused", "grouped_linear",
              "ragged_dot", "default+blind", "default+a2a", "ep+a2a", "default+fp8",
              "unfused+fp8")
# The strategies without nn.MoE: a buffer factor does not apply to them.
BASELINES = ("ragged_dot",)
DEFAULT_STRATEGIES = STRATEGIES[:8]  # the "+a2a" and "+fp8" variants on request
# The strategies whose layer is built (`nnx.eval_shape`) and whose step is traced under
# ``jax.set_mesh(mesh)``, and the axis types of their mesh.
IN_MESH = {"default+set_mesh": "Auto", "explicit": "Explicit"}
LEARNING_RATE = 1e-3


def mesh_shape(num_chips: int, num_experts: int, expert: int | None = None) -> tuple[int, int]:
  """(data, expert) sizes: expert = min(#experts, #chips) unless given; it must divide both
  the chips and the experts."""
  expert = min(num_experts, num_chips) if expert is None else expert
  if num_chips % expert or num_experts % expert:
    raise ValueError(f"an expert axis of {expert} must divide the {num_chips} chips and the "
                     f"{num_experts} experts")
  return num_chips // expert, expert



def parse_buffer_factor(text: str) -> float | None:
  """A ``--buffer-factor`` value: ``none`` (dropless) or a positive number."""
  if text.strip().lower() == "none":
    return None
  value = float(text)
  if not value > 0 or math.isinf(value):
    raise ValueError(f"a buffer factor must be a positive number or none, got {text!r}")
  return value


def label(strategy: str, buffer_factor: float | None) -> str:
  """A step's name in the table: the strategy, and ``@b=<factor>`` when it has one."""
  return strategy if buffer_factor is None else f"{strategy}@b={buffer_factor:g}"


def steps(models, topologies_, strategies, buffer_factors) -> list[tuple]:
  """The (model, topology, strategy, buffer factor) steps to compile, in table order: each
  gmm_jax strategy once per factor, a baseline once (without a factor: it has no nn.MoE)."""
  todo = []
  for m in models:
    for t in topologies_:
      for s in strategies:
        for b in ((None,) if s in BASELINES else buffer_factors):
          if (m, t, s, b) not in todo:
            todo.append((m, t, s, b))
  return todo


def _layer_kwargs(strategy: str, mesh: Mesh, buffer_factor: float | None = None) -> dict:
  kwargs = {} if buffer_factor is None else dict(buffer_factor=buffer_factor)
  if strategy.endswith("+a2a"):
    kwargs.update(transport="all_to_all")
    strategy = strategy[:-len("+a2a")]
  if strategy.endswith("+fp8"):
    kwargs.update(quantization="fp8")
    strategy = strategy[:-len("+fp8")]
  if strategy == "ep":
    kwargs.update(expert_parallel=(mesh, "expert"), data_parallel=(mesh, ("data", "expert")))
  if strategy == "unfused":
    kwargs.update(fused=False)
  return kwargs


def abstract_layer(model: Model, strategy: str = "default", mesh: Mesh | None = None,
                   buffer_factor: float | None = None):
  """The `nn.MoE` of `model` for `strategy` (with `buffer_factor`), bf16 parameters and
  compute, with abstract parameters (nothing is allocated: a Mixtral layer's experts are
  2.8 GB)."""
  kwargs = _layer_kwargs(strategy, mesh, buffer_factor) if mesh is not None else {}
  return nnx.eval_shape(lambda: nn.MoE.from_preset(
      model.preset, rngs=nnx.Rngs(0), scale=model.scale, dtype=jnp.bfloat16,
      param_dtype=jnp.bfloat16, **dict(model.overrides), **kwargs))


def param_spec(axes, ndim: int) -> P:
  """The mesh layout of a parameter with logical axes `axes` (`gmm_jax.nn`'s metadata): the
  expert weights (leading axis "expert", rank >= 2: kernels and biases) over the mesh's
  "expert" axis; everything else (the router, whose "expert" axis is its columns, the
  shared experts) replicated."""
  if ndim >= 2 and axes and axes[0] == "expert":
    return P("expert")
  return P()


def _axes(variable) -> tuple:
  for name in ("out_sharding", "sharding_names", "sharding"):
    axes = getattr(variable, name, None)
    if axes:
      return tuple(axes)
  return ()


def _loss(y, load_balancing, z_loss):
  return (jnp.mean(jnp.square(y.astype(jnp.float32))) + 0.01 * load_balancing
          + 0.001 * z_loss)


def nnx_loss(layer):
  """(loss(params, rest, x), abstract params, their specs, abstract rest) of a `nn.MoE`:
  the layer split into its `nnx.Param`s (flat list) and the rest (a routing bias)."""
  graphdef, params, rest = nnx.split(layer, nnx.Param, ...)
  is_variable = lambda v: isinstance(v, nnx.Variable)
  variables = jax.tree.leaves(params, is_leaf=is_variable)
  leaves, treedef = jax.tree.flatten(params)
  rest_leaves, rest_def = jax.tree.flatten(rest)
  specs = [param_spec(_axes(v), leaf.ndim) for v, leaf in zip(variables, leaves)]

  def loss(params, rest, x):
    layer = nnx.merge(graphdef, jax.tree.unflatten(treedef, params),
                      jax.tree.unflatten(rest_def, rest))
    y, aux = layer(x)
    return _loss(y, aux["load_balancing_loss"], aux["router_z_loss"])

  return loss, leaves, specs, rest_leaves


def ragged_dot_loss(layer):
  """The same as `nnx_loss` for the baseline: `layer`'s MoE math (router, top-k, renormalized
  and scaled weights, a gated FFN per expert, the shared expert) written with
  ``jax.lax.ragged_dot`` on tokens sorted by expert, without gmm_jax. Routing is plain
  top-k (no group limit, no routing bias): the same shapes and work."""
  num_experts, embed, mlp, top_k = layer.num_experts, layer.embed, layer.mlp, layer.top_k
  dtype = layer.dtype or jnp.float32  # the layer's compute dtype, for its parameters too
  shapes_ = [(embed, num_experts), (num_experts, embed, 2 * mlp), (num_experts, mlp, embed)]
  specs = [P(), P("expert"), P("expert")]
  if layer.shared is not None:
    shared = layer.shared.down.kernel.shape[0]
    shapes_ += [(embed, 2 * shared), (shared, embed)]
    specs += [P(), P()]
  leaves = [jax.ShapeDtypeStruct(s, dtype) for s in shapes_]

  def gated(z):
    half = z.shape[-1] // 2
    return (jax.nn.silu(z[..., :half].astype(jnp.float32)) * z[..., half:]).astype(dtype)

  def loss(params, rest, x):
    del rest
    router, w_in, w_down, *shared_weights = params
    num_tokens = x.shape[0]
    logits = jnp.dot(x, router, preferred_element_type=jnp.float32)
    scores = (jax.nn.softmax(logits, axis=-1) if layer.score == "softmax"
              else jax.nn.sigmoid(logits))
    top_p, top_e = jax.lax.top_k(scores, top_k)
    if layer.normalize_top_k:
      top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)
    top_p = top_p * layer.routed_scaling_factor
    flat_e = top_e.reshape(-1)
    order = jnp.argsort(flat_e)
    sizes = jnp.bincount(flat_e, length=num_experts).astype(jnp.int32)
    rows = x[order // top_k]
    h = gated(jax.lax.ragged_dot(rows, w_in, sizes, preferred_element_type=dtype))
    out = jax.lax.ragged_dot(h, w_down, sizes, preferred_element_type=dtype)
    out = jnp.zeros_like(out).at[order].set(out).reshape(num_tokens, top_k, embed)
    y = jnp.sum(out.astype(jnp.float32) * top_p[..., None], axis=1)
    if shared_weights:
      up, down = shared_weights
      y = y + jnp.dot(gated(jnp.dot(x, up)), down, preferred_element_type=jnp.float32)
    load = jnp.mean(jnp.sum(jax.nn.one_hot(top_e, num_experts), axis=1), axis=0) / top_k
    balance = scores / jnp.sum(scores, axis=-1, keepdims=True)
    load_balancing = num_experts * jnp.sum(load * jnp.mean(balance, axis=0))
    z_loss = jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    return _loss(y, load_balancing, z_loss)

  return loss, leaves, specs, []


def grouped_linear_loss(layer):
  """The same as `nnx_loss` for one `nn.GroupedLinear` with the shape of `layer`'s expert
  input kernel (``[E, D, 2F]``) on the tokens as group-contiguous rows, E equal groups:
  the layer's gradients (its weight gradient is a k-grouped gmm) under plain jit."""
  num_experts, embed, width = layer._in_layer().kernel.shape
  grouped = nnx.eval_shape(lambda: nn.GroupedLinear(
      num_experts, embed, width, dtype=jnp.bfloat16, param_dtype=jnp.bfloat16,
      rngs=nnx.Rngs(0)))
  graphdef, params = nnx.split(grouped, nnx.Param)
  leaves, treedef = jax.tree.flatten(params)

  def loss(params, rest, x):
    del rest
    linear = nnx.merge(graphdef, jax.tree.unflatten(treedef, params))
    sizes = jnp.full((num_experts,), x.shape[0] // num_experts, jnp.int32)
    return jnp.mean(jnp.square(linear(x, sizes).astype(jnp.float32)))

  return loss, leaves, [P("expert") for _ in leaves], []


def sgd_step(loss):
  """One training step: the loss's value and gradient w.r.t. the params, an SGD update."""

  def step(params, rest, x):
    value, grads = jax.value_and_grad(loss)(params, rest, x)
    new = [p - (LEARNING_RATE * g.astype(jnp.float32)).astype(p.dtype)
           for p, g in zip(params, grads)]
    return new, value

  return step


def expert_weight_shapes(layer) -> list[tuple[int, ...]]:
  """The global shapes of the expert kernels, and of the gate and up halves of a gated
  one: what a weight all-gather's result looks like."""
  found = []
  for grouped in (layer.gate_up, layer.up, layer.down):
    if grouped is None:
      continue
    shape = tuple(grouped.kernel.shape)
    found += [shape, shape[1:]]  # all of them, or one expert's
    if grouped is layer.gate_up:
      half = shape[:-1] + (shape[-1] // 2,)
      found += [half, half[1:]]
  return found
