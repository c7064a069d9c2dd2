"""The routed expert computation of an MoE layer as one partitionable op.

``y[t] = sum_j p[t, j] * ffn_{e[t, j]}(x[t])`` for tokens x ``[T, D]``, their chosen experts
e ``[T, k]`` and router weights p ``[T, k]``, with the experts' weights stacked on a leading
``[E, ...]`` dimension. Under plain `jax.jit` the layer that calls it knows no mesh: how the
work splits is decided here, by the partitioner, from the operands' shardings
(`jax.experimental.custom_partitioning`), so that no Pallas kernel ever sits in a program XLA
partitions on its own and the expert weights are never gathered:

  local     weights replicated (data parallel): each device routes its own tokens to every
            expert (the fused path: gathered gate|up gmm, weighted and scattered down gmm).
  experts   weights sharded over an expert axis the tokens are not sharded over: each device
            runs its own experts on the tokens it holds; one psum over the expert axis.
  travel    weights and tokens both sharded over the expert axis: each device's assignments
            travel to their experts' devices and back (`routing`'s all-to-all transports,
            receive buffers of `buffer_rows` rows).

The backward is a second partitionable op (a `jax.custom_vjp`): each device recomputes its
forward and differentiates it; the weight gradients are summed over the token axes the
weights are not sharded over. Single device (or no mesh): the local strategy on everything.

Floor 6: built on the experts' FFN (`experts`), its layouts (`layout`) and the routing
transports.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from gmm_jax._src.backends import registry
from gmm_jax._src.backends.registry import mesh_platform, on_lowering_platform
from gmm_jax._src.moe import routing
from gmm_jax._src.moe.experts import (ExpertFFN, ffn_routed, ffn_rows, ffn_sorted,
                                      input_weighted)
from gmm_jax._src.moe.layout import (Layout, choose_layout, dim_axes, entry_axes, note_layout,
                                     spec_entry)
from gmm_jax._src.op.primitive import explicit_axes, explicit_mesh, typed_spec
from gmm_jax._src.sharding.spec import reshard


@dataclasses.dataclass(frozen=True)
class Static:
  """The op's static parameters."""

  ffn: ExpertFFN
  params_tree: Any
  capacity_factor: float | None = None
  buffer_factor: float | None = None
  transport: str = "auto"
  # (mesh, Layout) of a call split at trace time (operands typed on Explicit axes: a
  # shard_map per direction), None for the partitionable ops.
  split: Any = None
  # No mesh in sight on TPU, where no partitioner runs the partitionable ops
  # (jax-ml/jax#38196): the per-device computation inline, each gmm then split as the op's
  # lowering splits a gmm XLA partitions there (the dense reference).
  inline: bool = False


# --------------------------------------------------------------------- on every device


def _linear_index(axes):
  index = jnp.int32(0)
  for axis in axes:
    index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return index


def _capacity(static: Static, num_tokens: int, top_k: int) -> int | None:
  if static.capacity_factor is None:
    return None
  return math.ceil(static.capacity_factor * num_tokens * top_k / static.ffn.num_experts)


def _ffn(spec: ExpertFFN) -> Callable:
  return ffn_routed if spec.fused else ffn_sorted


def local_forward(static: Static, layout: Layout, x, top_e, top_p, params):
  """One device's part of the forward (inside a context where the layout's axes are
  manual), before the collective that combines devices in the experts strategy. Returns
  (y ``[T_local, D]`` f32, kept ``[T_local, k]`` int32)."""
  spec = static.ffn
  num_tokens, top_k = top_e.shape
  capacity = _capacity(static, num_tokens, top_k)
  num_local = params["w_in"].shape[0]
  top_e = top_e.astype(jnp.int32)
  if layout.strategy == "local":
    y, kept = _ffn(spec)(spec, x, top_e, top_p, params, capacity=capacity)
  elif layout.strategy == "experts":
    # Only this device's experts: the others' assignments are no assignment here.
    first = _linear_index(layout.expert_axes) * num_local
    local_e = jnp.where((top_e >= first) & (top_e < first + num_local), top_e - first, -1)
    y, kept = _ffn(spec)(spec, x, local_e, top_p, params, capacity=capacity)
  else:
    y, kept = _travel(static, layout, x, top_e, top_p, params, capacity)
  return y, kept.astype(jnp.int32)


def _travel(static: Static, layout: Layout, x, top_e, top_p, params, capacity):
  """Each assignment's row travels to its expert's device over the expert axis and back."""
  spec = static.ffn
  (axis,) = layout.expert_axes
  num_tokens, k = top_e.shape
  num_devices = layout.expert_shards
  local_experts = spec.num_experts // num_devices
  flat_e, flat_p = top_e.reshape(-1), top_p.reshape(-1).astype(jnp.float32)
  valid = (flat_e >= 0) & (flat_e < spec.num_experts)
  if capacity is not None:
    hot = jax.nn.one_hot(jnp.where(valid, flat_e, spec.num_experts), spec.num_experts,
                         dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(hot, axis=0) - 1) * hot, axis=-1)
    valid = valid & (rank < capacity)
  ids = jnp.where(valid, flat_e, 0)  # a dropped assignment: computed, weight 0
  rows = jnp.broadcast_to(x[:, None, :], (num_tokens, k, x.shape[-1])).reshape(
      num_tokens * k, x.shape[-1])
  if spec.weight_on == "input":
    rows = input_weighted(rows, flat_p)
  per_pair = num_tokens * k  # the worst case: every row to one device
  if static.buffer_factor is not None:
    per_pair = max(1, min(per_pair, math.ceil(static.buffer_factor * num_tokens * k
                                              / num_devices)))
  if per_pair < num_tokens * k:
    # The transports send each device's first `per_pair` rows (in expert order) to each
    # destination and give the rest 0: those are dropped.
    order = jnp.argsort(ids, stable=True)
    dest = ids[order] // local_experts
    counts = jnp.bincount(dest, length=num_devices)
    rank = jnp.arange(ids.shape[0]) - (jnp.cumsum(counts) - counts)[dest]
    valid = valid & jnp.zeros_like(valid).at[order].set(rank < per_pair)
  run = functools.partial(
      routing.travel, fn=lambda rows, sizes: ffn_rows(spec, rows, sizes, params),
      transport=static.transport, mesh=layout.mesh, axis=axis, num_devices=num_devices,
      local_experts=local_experts, capacity=per_pair)
  out = on_lowering_platform(run, layout.platform, rows, ids)
  # The rows past a transport's buffer came back 0 (valid is False there): either way the
  # mask takes out every dropped row's result.
  out_p = flat_p if spec.weight_on == "output" else jnp.ones_like(flat_p)
  weighted = out.astype(jnp.float32).reshape(num_tokens, k, -1) * jnp.where(
      valid, out_p, 0).reshape(num_tokens, k, 1)
  return jnp.sum(weighted, axis=1), valid.reshape(num_tokens, k)


def _forward_on_device(static: Static, layout: Layout, x, top_e, top_p, params):
  y, kept = local_forward(static, layout, x, top_e, top_p, params)
  if layout.strategy == "experts":
    y = jax.lax.psum(y, layout.expert_axes)
    kept = jax.lax.psum(kept, layout.expert_axes)
  return y, kept


def _float_leaf(x) -> bool:
  return jnp.issubdtype(jnp.asarray(x).dtype if not hasattr(x, "dtype") else x.dtype,
                        jnp.floating)


def _backward_on_device(static: Static, layout: Layout, x, top_e, top_p, params, dy):
  """(dx, dtop_p, the float leaves' dparams) of this device's part."""
  leaves, tree = jax.tree.flatten(params)
  is_float = [_float_leaf(leaf) for leaf in leaves]

  def f(x, top_p, float_leaves):
    it = iter(float_leaves)
    full = [next(it) if flag else leaf for leaf, flag in zip(leaves, is_float)]
    y, _ = local_forward(static, layout, x, top_e, top_p, jax.tree.unflatten(tree, full))
    return y

  floats = [leaf for leaf, flag in zip(leaves, is_float) if flag]
  _, vjp = jax.vjp(f, x, top_p, floats)
  dx, dp, dw = vjp(dy.astype(jnp.float32))
  if layout.strategy == "experts":  # every device's experts saw every local token
    dx, dp = jax.lax.psum((dx, dp), layout.expert_axes)
  if layout.weight_sum_axes:
    dw = jax.lax.psum(dw, layout.weight_sum_axes)
  return dx, dp, dw


# ------------------------------------------------------------- the partitionable ops


def _unflatten(static: Static, flat):
  x, top_e, top_p = flat[:3]
  num = static.params_tree.num_leaves
  params = jax.tree.unflatten(static.params_tree, flat[3:3 + num])
  return x, top_e, top_p, params, flat[3 + num:]


def _layout_of(static: Static, mesh, arg_shapes):
  x_shape = arg_shapes[0]
  weights = [s for s in arg_shapes[3:3 + static.params_tree.num_leaves]
             if s.shape and s.shape[0] == static.ffn.num_experts]
  token_axes = dim_axes(x_shape, 0)
  expert_axes = dim_axes(weights[0], 0) if weights else ()
  layout, notes = choose_layout(dict(mesh.shape), x_shape.shape, token_axes, expert_axes,
                                static.ffn.num_experts)
  # The partitioner's mesh has the target's devices: the transports trace their branch only.
  return dataclasses.replace(layout, platform=mesh_platform(mesh), mesh=mesh), notes


def _operand_shardings(static: Static, layout: Layout, mesh, arg_shapes):
  tokens = P(spec_entry(layout.token_axes))
  experts = spec_entry(layout.expert_axes)
  specs = [tokens, tokens, tokens]
  for shape in arg_shapes[3:3 + static.params_tree.num_leaves]:
    lead = experts if shape.shape and shape.shape[0] == static.ffn.num_experts else None
    specs.append(P(lead))
  specs += [tokens] * (len(arg_shapes) - len(specs))  # the backward's dy
  return tuple(NamedSharding(mesh, s) for s in specs)


def _sharding_rule(num_outputs_tokens: int):
  """Shardy's factors: t (tokens), j (choices), d (model width) shared by the token
  operands and results; the experts' leading dim e; every other dim its own factor (the
  partition callback decides what is kept)."""

  def rule(static, mesh, operand_types, result_types):
    shapes = [tuple(mlir.ir.ShapedType(t).shape) for t in operand_types]
    extra = iter(f"w{i}" for i in range(256))
    parts = ["t d", "t j", "t j"]
    for shape in shapes[3:3 + static.params_tree.num_leaves]:
      dims = [("e" if i == 0 and size == static.ffn.num_experts else next(extra))
              for i, size in enumerate(shape)]
      parts.append(" ".join(dims))
    for _ in shapes[3 + static.params_tree.num_leaves:]:
      parts.append("t d")  # dy
    results = []
    for t in result_types:
      shape = tuple(mlir.ir.ShapedType(t).shape)
      if len(results) < num_outputs_tokens:
        results.append("t d" if len(results) == 0 else "t j")
      else:  # weight gradients, like their weights
        results.append(" ".join(
            "e" if i == 0 and size == static.ffn.num_experts else next(extra)
            for i, size in enumerate(shape)))
    return ", ".join(parts) + " -> " + ", ".join(results)

  return rule


@functools.partial(custom_partitioning, static_argnums=(0,))
def _forward_op(static: Static, *flat):
  x, top_e, top_p, params, _ = _unflatten(static, flat)
  return local_forward(static, Layout(), x, top_e, top_p, params)


def _forward_partition(static, mesh, arg_shapes, result_shape):
  layout, notes = _layout_of(static, mesh, arg_shapes)
  note_layout(layout, notes)
  shardings = _operand_shardings(static, layout, mesh, arg_shapes)
  tokens = NamedSharding(mesh, P(spec_entry(layout.token_axes)))

  def lower_fn(*flat):
    x, top_e, top_p, params, _ = _unflatten(static, flat)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      return _forward_on_device(static, layout, x, top_e, top_p, params)

  return mesh, lower_fn, (tokens, tokens), shardings


def _forward_infer(static, mesh, arg_shapes, result_shape):
  layout, _ = _layout_of(static, mesh, arg_shapes)
  tokens = NamedSharding(mesh, P(spec_entry(layout.token_axes)))
  return (tokens, tokens)


_forward_op.def_partition(partition=_forward_partition,
                          infer_sharding_from_operands=_forward_infer,
                          sharding_rule=_sharding_rule(2))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _backward_op(static: Static, *flat):
  x, top_e, top_p, params, (dy,) = _unflatten(static, flat)
  dx, dp, dw = _backward_on_device(static, Layout(), x, top_e, top_p, params, dy)
  return (dx, dp, *dw)


def _backward_partition(static, mesh, arg_shapes, result_shape):
  layout, notes = _layout_of(static, mesh, arg_shapes)
  note_layout(layout, notes)
  shardings = _operand_shardings(static, layout, mesh, arg_shapes)
  tokens = NamedSharding(mesh, P(spec_entry(layout.token_axes)))
  param_shardings = [s for s, shape in zip(shardings[3:], arg_shapes[3:-1])
                     if _float_leaf(shape)]

  def lower_fn(*flat):
    x, top_e, top_p, params, (dy,) = _unflatten(static, flat)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      dx, dp, dw = _backward_on_device(static, layout, x, top_e, top_p, params, dy)
    return (dx, dp, *dw)

  return mesh, lower_fn, (tokens, tokens, *param_shardings), shardings


def _backward_infer(static, mesh, arg_shapes, result_shape):
  layout, _ = _layout_of(static, mesh, arg_shapes)
  shardings = _operand_shardings(static, layout, mesh, arg_shapes)
  tokens = NamedSharding(mesh, P(spec_entry(layout.token_axes)))
  return (tokens, tokens, *[s for s, shape in zip(shardings[3:], arg_shapes[3:-1])
                            if _float_leaf(shape)])


_backward_op.def_partition(partition=_backward_partition,
                           infer_sharding_from_operands=_backward_infer,
                           sharding_rule=_sharding_rule(2))


def _split_specs(static: Static, flat_shapes):
  """in_specs of the flat operands (x, top_e, top_p, the params' leaves[, dy]) of a call
  split at trace time: `_operand_shardings`' specs."""
  mesh, layout = static.split
  shardings = _operand_shardings(static, layout, mesh, list(flat_shapes))
  return tuple(s.spec for s in shardings[:len(flat_shapes)]), layout, mesh


def _split_forward(static: Static, *flat):
  specs, layout, mesh = _split_specs(static, flat)
  tokens = P(spec_entry(layout.token_axes))

  def body(*flat):
    x, top_e, top_p, params, _ = _unflatten(static, flat)
    return _forward_on_device(static, layout, x, top_e, top_p, params)

  flat = reshard(flat, specs, mesh)
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tokens, tokens),
                       axis_names=frozenset(explicit_axes(mesh)),
                       check_vma=False)(*flat)


def _split_backward(static: Static, *flat):
  specs, layout, mesh = _split_specs(static, flat)
  tokens = P(spec_entry(layout.token_axes))
  param_specs = tuple(spec for spec, leaf in zip(specs[3:-1], flat[3:-1]) if _float_leaf(leaf))

  def body(*flat):
    x, top_e, top_p, params, (dy,) = _unflatten(static, flat)
    dx, dp, dw = _backward_on_device(static, layout, x, top_e, top_p, params, dy)
    return (dx, dp, *dw)

  flat = reshard(flat, specs, mesh)
  return jax.shard_map(body, mesh=mesh, in_specs=specs,
                       out_specs=(tokens, tokens, *param_specs),
                       axis_names=frozenset(explicit_axes(mesh)),
                       check_vma=False)(*flat)


def _inline_forward(static: Static, *flat):
  x, top_e, top_p, params, _ = _unflatten(static, flat)
  return _forward_on_device(static, Layout(), x, top_e, top_p, params)


def _inline_backward(static: Static, *flat):
  x, top_e, top_p, params, (dy,) = _unflatten(static, flat)
  dx, dp, dw = _backward_on_device(static, Layout(), x, top_e, top_p, params, dy)
  return (dx, dp, *dw)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _experts(static: Static, x, top_e, top_p, params):
  forward = (_split_forward if static.split is not None else
             _inline_forward if static.inline else _forward_op)
  return forward(static, x, top_e, top_p, *jax.tree.leaves(params))


def _experts_fwd(static, x, top_e, top_p, params):
  return _experts(static, x, top_e, top_p, params), (x, top_e, top_p, params)


def _experts_bwd(static, residuals, cotangents):
  x, top_e, top_p, params = residuals
  dy, _ = cotangents
  leaves = jax.tree.leaves(params)
  backward = (_split_backward if static.split is not None else
              _inline_backward if static.inline else _backward_op)
  dx, dp, *dw = backward(static, x, top_e, top_p, *leaves, jnp.asarray(dy, jnp.float32))
  it = iter(dw)
  grads = [next(it).astype(leaf.dtype) if _float_leaf(leaf) else
           np.zeros(leaf.shape, jax.dtypes.float0) for leaf in leaves]
  return (dx.astype(x.dtype), np.zeros(top_e.shape, jax.dtypes.float0),
          dp.astype(top_p.dtype), jax.tree.unflatten(static.params_tree, grads))


_experts.defvjp(_experts_fwd, _experts_bwd)


def routed_experts(ffn: ExpertFFN, x, top_e, top_p, params, *,
                   capacity_factor: float | None = None, buffer_factor: float | None = None,
                   transport: str = "auto"):
  """The routed experts of an MoE layer, split over the mesh by the operands' shardings
  (see the module docstring): at trace time with `shard_map` where their types carry the
  layout (Explicit axes), else by the partitioner (CPU, GPU). On TPU, where no partitioner
  runs such an op, a call whose trace sees no layout runs inline, each of its gmms split
  as the op splits a gmm XLA partitions there (the dense reference).

  Args:
    ffn: the experts' FFN.
    x: ``[T, D]`` tokens; top_e: int ``[T, k]`` chosen experts; top_p: float ``[T, k]``
      their router weights.
    params: dict of ``w_in`` ``[E, D, 2F or F]``, ``w_down`` ``[E, F, D]`` (optional
      ``b_in``, ``b_down``); QArrays allowed (no gradient for integer leaves).
    capacity_factor: None (dropless) or c: each expert takes at most
      ``ceil(c * T_shard * k / E)`` assignments of each token shard (earlier tokens first).
    buffer_factor: travel strategy only: each device receives at most
      ``ceil(buffer_factor * T_shard * k / devices)`` rows from each other device (None:
      the worst case, every row of a shard to one device); rows past it give 0 and count
      as dropped.
    transport: "auto", "all_to_all" or "ragged" (see `routing.routed_apply`).

  Returns:
    (y ``[T, D]`` f32, kept int32 ``[T, k]``: 1 where the assignment was computed).
  """
  if transport not in routing.TRANSPORTS:
    raise ValueError(f"transport must be one of {routing.TRANSPORTS}, got {transport!r}")
  if buffer_factor is not None and buffer_factor <= 0:
    raise ValueError(f"buffer_factor must be positive, got {buffer_factor}")
  leaves, tree = jax.tree.flatten(params)
  if not leaves or leaves[0].shape[0] != ffn.num_experts:
    raise ValueError(f"params must have the {ffn.num_experts} experts as their leading "
                     f"dim, got {[tuple(l.shape) for l in leaves]}")
  split = _trace_time_split(ffn, x, leaves)
  static = Static(ffn, tree, capacity_factor, buffer_factor, transport, split,
                  inline=split is None and registry.trace_platform() == "tpu")
  return _experts(static, x, top_e, top_p, params)


def _trace_time_split(ffn: ExpertFFN, x, leaves):
  """(mesh, Layout) where the tokens' or the expert weights' types carry a mesh with
  Explicit axes (the trace knows the layout: the op splits itself with `shard_map`, which
  every platform compiles), else None (the partitionable ops). The mesh and the layouts
  are read as the gmm op's own split reads them (`explicit_mesh`, `typed_spec`)."""
  mesh = explicit_mesh([x, *leaves])
  if mesh is None:
    return None
  sizes = {a: s for a, s in zip(mesh.axis_names, mesh.axis_sizes) if a in explicit_axes(mesh)}

  def lead(value):
    spec = typed_spec(value)
    return entry_axes(spec[0]) if len(spec) else ()

  weights = [leaf for leaf in leaves if leaf.shape and leaf.shape[0] == ffn.num_experts]
  layout, notes = choose_layout(sizes, x.shape, lead(x), lead(weights[0]) if weights else (),
                                ffn.num_experts)
  layout = dataclasses.replace(layout, platform=mesh_platform(mesh), mesh=mesh)
  note_layout(layout, notes + ("split at trace time: a shard_map over the Explicit mesh axes",))
  return mesh, layout
