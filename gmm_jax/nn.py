"""Flax (nnx) layers on gmm: `GroupedLinear` and a dropless top-k `MoE` block.

Needs the optional extra: ``pip install "gmm_jax[flax]"``. Linen versions come from
``flax.nnx.bridge`` (`grouped_linear_linen`, `moe_linen`), not a second implementation.

Parameters carry logical axis names ("expert", "embed", "mlp") as variable metadata, so
users shard them with their own rules (``nnx.get_partition_spec`` + a logical-to-mesh map).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gmm_jax import QuantSpec, gmm, routed_apply
from gmm_jax._src.epilogue import resolve_activation
from gmm_jax._src.sharding import explicit_axes, token_layout

Array = jax.Array


def _param(value, axes: tuple[str, ...]) -> nnx.Param:
  """An nnx.Param with logical axis names, across flax versions' metadata names (0.12:
  ``out_sharding`` with eager sharding off, so no mesh is needed at construction)."""
  for metadata in (dict(out_sharding=axes, eager_sharding=False), dict(sharding_names=axes),
                   dict(sharding=axes)):
    try:
      return nnx.Param(value, **metadata)
    except (TypeError, ValueError):
      continue
  return nnx.Param(value)


def grouped_kernel_init(key, shape, dtype=jnp.float32):
  """nnx.Linear's default (LeCun normal, fan-in = K) for each group's ``[K, N]`` matrix."""
  init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                           out_axis=-1, batch_axis=(0,))
  return init(key, shape, dtype)


class GroupedLinear(nnx.Module):
  """Per-group (per-expert) linear layers applied to group-contiguous rows with one gmm.

  ``y[rows of g] = x[rows of g] @ kernel[g] + bias[g]``; kernel ``[G, K, N]`` with axes
  ("expert", "embed", "mlp") by default, bias ``[G, N]`` with ("expert", "mlp").

  Args:
    num_groups, in_features, out_features: G, K, N.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as in nnx.Linear
      (kernel_init receives the ``[G, K, N]`` shape).
    kernel_axes, bias_axes: logical axis names of the parameters.
    weight_quant: a `QuantSpec` to quantize the kernel on the fly (weight-only int8/int4/
      fp8; straight-through gradients for training).
    input_quant: a `QuantSpec` for the inputs (dynamic quantization, e.g. per-token int8).
    implementation: gmm implementation (None: the platform's chain).
    rngs: nnx.Rngs.
  """

  def __init__(self, num_groups: int, in_features: int, out_features: int, *,
               use_bias: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
               precision: Any = None, kernel_init=grouped_kernel_init,
               bias_init=nnx.initializers.zeros_init(),
               kernel_axes: tuple[str, ...] = ("expert", "embed", "mlp"),
               bias_axes: tuple[str, ...] = ("expert", "mlp"),
               weight_quant: QuantSpec | None = None, input_quant: QuantSpec | None = None,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
    self.dtype, self.precision, self.implementation = dtype, precision, implementation
    self.weight_quant, self.input_quant = weight_quant, input_quant
    shape = (num_groups, in_features, out_features)
    self.kernel = _param(kernel_init(rngs.params(), shape, param_dtype), tuple(kernel_axes))
    self.bias = (_param(bias_init(rngs.params(), (num_groups, out_features), param_dtype),
                        tuple(bias_axes)) if use_bias else None)

  def __call__(self, x: Array, group_sizes: Array, *, activation=None,
               group_offset=None) -> Array:
    """x ``[M, K]`` rows sorted by group; group_sizes ``[G]`` -> ``[M, N]``."""
    kernel = self.kernel[...]
    bias = None if self.bias is None else self.bias[...]
    dtype = self.dtype or jnp.result_type(x, kernel)
    x = x.astype(dtype)
    if self.weight_quant is None:
      kernel = kernel.astype(dtype)
    return gmm(x, kernel, group_sizes, bias=bias, activation=activation,
               precision=self.precision, group_offset=group_offset,
               quantize_lhs=self.input_quant, quantize_rhs=self.weight_quant,
               preferred_element_type=dtype, implementation=self.implementation)


class MoE(nnx.Module):
  """A top-k routed, gated-FFN mixture of experts (dropless by default).

  ``y = sum_{e in top_k(x)} p_e(x) * down_e(act(gate_e(x)) * up_e(x))`` with the router
  ``p = softmax(x @ W_router)`` (top-k probabilities renormalized to sum to 1 unless
  ``normalize_top_k=False``). Tokens are sorted to expert-contiguous order, the three expert
  projections are gmm calls, and the results are unsorted and combined with the router
  weights.

  Args:
    num_experts, embed, mlp: G, the model width, the expert FFN width.
    top_k: experts per token.
    activation: "silu" (SwiGLU) or "gelu"/"gelu_tanh" (GeGLU), or a callable.
    capacity_factor: None (dropless) or c: each expert takes at most
      ``ceil(c * tokens * top_k / G)`` tokens (later tokens in order are dropped for it:
      output 0 from that expert).
    expert_parallel: None, or ``(mesh, axis)``: the expert kernels sharded over the mesh
      axis. Tokens sharded over the same axis travel to their experts' devices
      (`gmm_jax.routed_apply`) once per call; tokens replicated over it are each run by
      the devices of their experts and combined with one psum.
    data_parallel: None, or ``(mesh, axes)``: tokens (the leading dims of x) sharded over
      these mesh axes (data parallel, FSDP). Each shard groups its own tokens (local sort,
      local group sizes) and the output keeps the tokens' sharding: no token is gathered.
      Default with expert_parallel: tokens sharded over the expert axis. With
      capacity_factor, each shard's capacity is computed from its own tokens.
    On a mesh with Explicit axes (`jax.make_mesh`, `jax.set_mesh`) both follow from the
    types: the tokens' axes from x's sharding, the expert axis from the expert kernels'
    leading dim.
    weight_quant, input_quant: QuantSpecs for the expert projections (see GroupedLinear).
    dtype, param_dtype, implementation: as in GroupedLinear.
    rngs: nnx.Rngs.

  Returns (from __call__): ``(y, aux)`` with ``aux = {"load_balancing_loss",
  "router_z_loss"}``: the Switch-Transformer balance loss ``G * sum_e f_e * P_e`` (f_e:
  fraction of top-k assignments to e, P_e: mean router probability of e) and the ST-MoE
  z-loss ``mean(logsumexp(logits)^2)``. The caller weights and adds them.
  """

  def __init__(self, num_experts: int, embed: int, mlp: int, *, top_k: int = 2,
               activation="silu", capacity_factor: float | None = None,
               normalize_top_k: bool = True, expert_parallel=None, data_parallel=None,
               dtype: Any = None,
               param_dtype: Any = jnp.float32, weight_quant: QuantSpec | None = None,
               input_quant: QuantSpec | None = None, implementation: str | None = None,
               rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if capacity_factor is not None and capacity_factor <= 0:
      raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    self.num_experts, self.top_k, self.activation = num_experts, top_k, activation
    self.capacity_factor, self.normalize_top_k = capacity_factor, normalize_top_k
    self.expert_parallel, self.data_parallel = expert_parallel, data_parallel
    self.router = nnx.Linear(embed, num_experts, use_bias=False, param_dtype=param_dtype,
                             kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.router.kernel = _param(self.router.kernel[...], ("embed", "expert"))
    common = dict(use_bias=False, dtype=dtype, param_dtype=param_dtype,
                  weight_quant=weight_quant, input_quant=input_quant,
                  implementation=implementation, rngs=rngs)
    self.gate = GroupedLinear(num_experts, embed, mlp, **common)
    self.up = GroupedLinear(num_experts, embed, mlp, **common)
    self.down = GroupedLinear(num_experts, mlp, embed, kernel_axes=("expert", "mlp", "embed"),
                              **common)

  def _experts(self, rows, sizes, kernels=None):
    """The gated FFN on expert-contiguous rows (kernels: local slices, expert parallel)."""
    act = resolve_activation(self.activation)
    if kernels is None:
      return self.down(act(self.gate(rows, sizes)) * self.up(rows, sizes), sizes)
    w_gate, w_up, w_down = kernels
    options = dict(quantize_lhs=self.gate.input_quant, quantize_rhs=self.gate.weight_quant,
                   implementation=self.gate.implementation)
    h = act(gmm(rows, w_gate, sizes, **options)) * gmm(rows, w_up, sizes, **options)
    return gmm(h.astype(rows.dtype), w_down, sizes, **options)

  def _layout(self, x):
    """(mesh, expert axis, token axes) of this call; mesh None: one device's view."""
    mesh = axis = token_axes = None
    if self.expert_parallel is not None:
      mesh, axis = self.expert_parallel
    if self.data_parallel is not None:
      data_mesh, token_axes = self.data_parallel
      mesh = data_mesh if mesh is None else mesh
      token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
    mesh, token_axes = token_layout(x, mesh, token_axes)
    typed = getattr(jax.typeof(self.gate.kernel[...]), "sharding", None)
    if axis is None and typed is not None and not typed.mesh.empty and len(typed.spec):
      entry = typed.spec[0]  # the expert kernels' leading dim on an Explicit mesh
      axis = entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry
    if mesh is None or mesh.empty or (axis is None and not token_axes):
      return None, None, ()
    if not token_axes and self.data_parallel is None and not explicit_axes(mesh):
      token_axes = (axis,)
    return mesh, axis, token_axes

  def __call__(self, x: Array) -> tuple[Array, dict[str, Array]]:
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    num_tokens, g, k = tokens.shape[0], self.num_experts, self.top_k
    mesh, axis, token_axes = self._layout(x)
    logits = _replicated_last(self.router(tokens).astype(jnp.float32))  # [T, G]
    probs = jax.nn.softmax(logits, axis=-1)
    top_p, top_e = _top_k(probs, k)  # [T, k]
    if self.normalize_top_k:
      top_p = top_p / jnp.sum(top_p, axis=-1, keepdims=True)

    flat_e = top_e.reshape(-1)  # [T*k] assignments, token-major
    flat_p = top_p.reshape(-1)
    # The token of each assignment (a broadcast: keeps the tokens' sharding on any mesh).
    rows = jnp.broadcast_to(tokens[:, None, :], (num_tokens, k, shape[-1])).reshape(
        num_tokens * k, shape[-1])
    kept = None
    if self.capacity_factor is not None:
      # Each expert takes the first `capacity` assignments of each token shard, in order.
      shards = 1 if mesh is None else math.prod(mesh.shape[a] for a in token_axes)
      capacity = math.ceil(self.capacity_factor * num_tokens * k / (g * shards))
      hot = jax.nn.one_hot(flat_e.reshape(shards, -1), g, dtype=jnp.int32)
      rank = jnp.sum((jnp.cumsum(hot, axis=1) - 1) * hot, axis=-1).reshape(-1)
      kept = rank < capacity
      flat_p = jnp.where(kept, flat_p, 0.0)

    if mesh is not None:
      ids = flat_e if kept is None else jnp.where(kept, flat_e, 0)  # dropped: weight 0
      kernels = (self.gate.kernel[...], self.up.kernel[...], self.down.kernel[...])
      out = routed_apply(lambda rows, sizes, ws: self._experts(rows, sizes, ws), rows, ids,
                         kernels, mesh=mesh, axis=axis, token_axes=token_axes)
    else:
      # Dropped assignments sort after every expert (past the group total: gmm gives 0).
      key = flat_e if kept is None else jnp.where(kept, flat_e, g)
      order = jnp.argsort(key, stable=True)
      sizes = jnp.bincount(key, length=g + 1)[:g].astype(jnp.int32)
      y_sorted = self._experts(rows[order], sizes)
      out = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
    # Each token's k results, weighted: a reshape and a sum (no scatter across shards).
    weighted = (out.astype(jnp.float32).reshape(num_tokens, k, -1)
                * flat_p.reshape(num_tokens, k, 1))
    y = jnp.sum(weighted, axis=1)

    fraction = jnp.mean(jnp.sum(jax.nn.one_hot(top_e, g, dtype=jnp.float32), axis=1),
                        axis=0) / k
    aux = {
        "load_balancing_loss": g * jnp.sum(fraction * jnp.mean(probs, axis=0)),
        "router_z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
    }
    return y.astype(x.dtype).reshape(shape), aux


def _top_k(probs, k: int):
  """`jax.lax.top_k` over the experts as k max/argmax passes: reductions that the
  partitioner keeps local to each token shard (XLA:CPU's TopK gathers every token's
  probabilities). Ties go to the lower expert index, as in top_k."""
  values, indices = [], []
  remaining = probs
  for _ in range(k):
    index = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
    values.append(jnp.take_along_axis(probs, index[:, None], axis=-1)[:, 0])
    indices.append(index)
    remaining = jnp.where(jax.nn.one_hot(index, probs.shape[-1], dtype=bool), -jnp.inf,
                          remaining)
  return jnp.stack(values, axis=-1), jnp.stack(indices, axis=-1)


def _replicated_last(logits):
  """Router logits whole along the experts (top_k needs them), on any mesh: on Explicit
  axes a router kernel sharded over experts would otherwise shard them."""
  typed = getattr(jax.typeof(logits), "sharding", None)
  if typed is None or typed.mesh.empty or not explicit_axes(typed.mesh):
    return logits
  spec = list(typed.spec) + [None] * (logits.ndim - len(typed.spec))
  if spec[-1] is None:
    return logits
  return jax.sharding.reshard(logits, jax.sharding.NamedSharding(
      typed.mesh, jax.sharding.PartitionSpec(*spec[:-1], None)))


def grouped_linear_linen(*args, **kwargs):
  """A Linen module wrapping `GroupedLinear` (``flax.nnx.bridge.ToLinen``)."""
  return nnx.bridge.ToLinen(GroupedLinear, args=args, kwargs=kwargs)


def moe_linen(*args, **kwargs):
  """A Linen module wrapping `MoE` (``flax.nnx.bridge.ToLinen``)."""
  return nnx.bridge.ToLinen(MoE, args=args, kwargs=kwargs)
