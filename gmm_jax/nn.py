"""Flax (nnx) layers on gmm: `GroupedLinear` and a routed mixture-of-experts block `MoE`.

Needs the optional extra: ``pip install "gmm_jax[flax]"``. Linen versions come from
``flax.nnx.bridge`` (`grouped_linear_linen`, `moe_linen`), not a second implementation.

Parameters carry logical axis names ("expert", "embed", "mlp") as variable metadata, so
users shard them with their own rules (``nnx.get_partition_spec`` + a logical-to-mesh map);
under ``jax.set_mesh`` the names that are axes of the mesh (after ``nnx.logical_axis_rules``)
shard the parameters as they are created, as nnx.Linear does.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

import gmm_jax
from gmm_jax import QuantSpec, gmm, routed_apply
from gmm_jax._src import experts
from gmm_jax._src.epilogue import GATED_ACTIVATIONS, resolve_activation
from gmm_jax._src.experts import GATED_NAMES, ExpertFFN
from gmm_jax._src.sharding import explicit_axes, token_layout

Array = jax.Array


def _resolve_names(names):
  """Logical names -> mesh axis names under the context's ``logical_axis_rules``."""
  try:
    from flax.core import spmd
    return tuple(spmd.apply_rules(tuple(names), None))
  except Exception:  # flax without the rules helpers: the names are the mesh axes
    return tuple(names)


def _eager_shard(value, names):
  """`value` sharded over the axes of the context mesh named by `names` (nnx.Linear's eager
  sharding, on the names that are mesh axes; the others replicate)."""
  try:
    if not nnx.using_eager_sharding():
      return value
  except AttributeError:  # flax < 0.12: no eager sharding
    return value
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not names:
    return value
  spec = [name if isinstance(name, str) and name in mesh.axis_names else None
          for name in _resolve_names(names)]
  if not any(spec):
    return value
  sharding = NamedSharding(mesh, P(*spec))
  axis_types = set(mesh.axis_types)
  if axis_types == {jax.sharding.AxisType.Explicit}:
    return jax.sharding.reshard(value, sharding)
  if axis_types == {jax.sharding.AxisType.Auto}:
    return jax.lax.with_sharding_constraint(value, sharding)
  return value


def _param(value, axes: tuple[str, ...], metadata: Mapping[str, Any] | None = None,
           kind=None) -> nnx.Variable:
  """An nnx.Param (or `kind`) with logical axis names, across flax versions' metadata names
  (0.12: ``out_sharding``; the eager sharding is ours, `_eager_shard`, so that logical names
  that are not mesh axes need no mesh). `metadata` (e.g. ``kernel_metadata``) is added; an
  ``out_sharding`` in it replaces `axes`."""
  kind = kind or nnx.Param
  metadata = dict(metadata or {})
  axes = tuple(metadata.pop("out_sharding", axes))
  eager = metadata.pop("eager_sharding", True)
  if eager:
    value = _eager_shard(value, axes)
  for names in (dict(out_sharding=axes, eager_sharding=False), dict(sharding_names=axes),
                dict(sharding=axes)):
    try:
      return kind(value, **names, **metadata)
    except (TypeError, ValueError):
      continue
  return kind(value, **metadata)


def grouped_kernel_init(key, shape, dtype=jnp.float32):
  """nnx.Linear's default (LeCun normal, fan-in = K) for each group's ``[K, N]`` matrix."""
  init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                           out_axis=-1, batch_axis=(0,))
  return init(key, shape, dtype)


def _reshard(y, sharding):
  """y laid out as `sharding` (a NamedSharding, or a PartitionSpec of the context mesh), as
  nnx.Linear's ``out_sharding``: a reshard on Explicit axes, a constraint on Auto ones."""
  if sharding is None:
    return y
  mesh = getattr(sharding, "mesh", None)
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    sharding = NamedSharding(mesh, sharding)
  if explicit_axes(mesh):
    return jax.sharding.reshard(y, sharding)
  return jax.lax.with_sharding_constraint(y, sharding)


class RoutingBias(nnx.Variable):
  """A per-expert routing bias that is not trained by gradient (DeepSeek-V3's auxiliary-
  loss-free balancing): its own collection, outside ``nnx.Param`` (optimizers built with
  ``wrt=nnx.Param`` skip it); `MoE.update_routing_bias` moves it. Linen collection:
  "routing_bias"."""


try:  # the Linen collection name of RoutingBias (flax >= 0.11)
  nnx.register_variable_name("routing_bias", RoutingBias, overwrite=True)
except AttributeError:
  pass


class GroupedLinear(nnx.Module):
  """Per-group (per-expert) linear layers applied to group-contiguous rows with one gmm.

  ``y[rows of g] = x[rows of g] @ kernel[g] + bias[g]``; kernel ``[G, K, N]`` with axes
  ("expert", "embed", "mlp") by default, bias ``[G, N]`` with ("expert", "mlp").

  Args:
    num_groups, in_features, out_features: G, K, N.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as in nnx.Linear
      (kernel_init receives the ``[G, K, N]`` shape).
    kernel_axes, bias_axes: logical axis names of the parameters.
    kernel_metadata, bias_metadata: more metadata of the parameters (as nnx.Linear's; an
      ``out_sharding`` there replaces the axes).
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
               kernel_metadata: Mapping[str, Any] | None = None,
               bias_metadata: Mapping[str, Any] | None = None,
               weight_quant: QuantSpec | None = None, input_quant: QuantSpec | None = None,
               implementation: str | None = None, rngs: nnx.Rngs):
    self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
    self.dtype, self.precision, self.implementation = dtype, precision, implementation
    self.weight_quant, self.input_quant = weight_quant, input_quant
    shape = (num_groups, in_features, out_features)
    self.kernel = _param(kernel_init(rngs.params(), shape, param_dtype), tuple(kernel_axes),
                         kernel_metadata)
    self.bias = (_param(bias_init(rngs.params(), (num_groups, out_features), param_dtype),
                        tuple(bias_axes), bias_metadata) if use_bias else None)

  def weights(self, dtype=None):
    """(kernel, bias) as the gmm takes them: the kernel cast to the compute dtype unless it
    is quantized on the fly."""
    kernel = self.kernel[...]
    if self.weight_quant is None and dtype is not None:
      kernel = kernel.astype(dtype)
    return kernel, None if self.bias is None else self.bias[...]

  def gmm_options(self, dtype):
    return dict(precision=self.precision, quantize_lhs=self.input_quant,
                quantize_rhs=self.weight_quant, preferred_element_type=dtype,
                implementation=self.implementation)

  def __call__(self, x: Array, group_sizes: Array, *, activation=None,
               group_offset=None) -> Array:
    """x ``[M, K]`` rows sorted by group; group_sizes ``[G]`` -> ``[M, N]``."""
    dtype = self.dtype or jnp.result_type(x, self.kernel[...])
    kernel, bias = self.weights(dtype)
    return gmm(x.astype(dtype), kernel, group_sizes, bias=bias, activation=activation,
               group_offset=group_offset, **self.gmm_options(dtype))


class MoE(nnx.Module):
  """A top-k routed mixture of experts (dropless by default), with optional shared experts.

  ``y = shared(x) + sum_{e in top_k(x)} w_e(x) * down_e(act(x @ gate_e) * (x @ up_e))``.
  The router: ``logits = x @ W_router (+ b)``, scores ``s = softmax(logits)`` or
  ``sigmoid(logits)``; experts chosen by ``s + routing_bias`` (the bias only selects),
  optionally only within the best ``top_k_groups`` of ``num_expert_groups`` groups (ranked by
  the sum of their top-2 biased scores, DeepSeek-V3); weights ``w = s[chosen]``, divided by
  their sum when ``normalize_top_k``, times ``routed_scaling_factor``.

  The fused path (default): `gmm_jax.route` gives the expert-grouped rows; gate and up are
  ONE gmm on the ``[E, D, 2F]`` kernel reading the tokens by ``lhs_indices`` with the gated
  activation in its epilogue; the down projection is one gmm that weights each row by its
  router weight and writes it to its (token, k) slot (``row_weights``, ``out_indices``);
  ``route.combine`` sums each token's k slots. No sorted copy of the tokens is made.
  ``fused=False`` is the unfused baseline: tokens sorted and copied, gate and up as two
  gmms (on the two halves of the same kernel: the same parameters), unsorted and combined.

  Args:
    num_experts, embed, mlp: E, the model width D, the expert FFN width F.
    top_k: experts per token.
    activation: for gated FFNs "silu" (SwiGLU), "gelu" / "gelu_tanh" (GeGLU),
      "swiglu_clamped" (gpt-oss), or a callable on the gate half; for plain FFNs a name of
      `gmm_jax.ACTIVATIONS` ("relu", "gelu", ...) or a callable.
    gated: True: gated FFN, ``gate_up`` kernel ``[E, D, 2F]`` (gate half first); False: a
      Switch-style FFN, ``up`` kernel ``[E, D, F]``. Either way ``down`` is ``[E, F, D]``.
    fused: the fused path (above) or the unfused baseline.
    score: "softmax" or "sigmoid" router scores.
    normalize_top_k: renormalize the chosen weights to sum to 1; default: when top_k > 1
      (a top-1 weight renormalized is always 1, leaving the router without a gradient).
    routing_bias: add a `RoutingBias` (zeros at first) to the scores for the selection.
    num_expert_groups, top_k_groups: group-limited routing (None: off).
    routed_scaling_factor: multiplies the routed experts' weights.
    router_bias: the router has a bias (gpt-oss).
    num_shared_experts, shared_mlp: shared experts, one dense FFN of width ``shared_mlp``
      (default ``mlp * num_shared_experts``) applied to every token, gated like the experts.
    use_bias: expert biases ``[E, 2F]`` (or ``[E, F]``) and ``[E, D]`` (gpt-oss).
    capacity_factor: None (dropless) or c: each expert takes at most
      ``ceil(c * T * top_k / E)`` assignments (earlier tokens first; the rest give 0), and
      the grouped buffers hold ``min(T * top_k, E * capacity)`` rows.
    buffer_factor: None (dropless: receive buffers sized for the worst case, every
      assignment of a token shard sent to one device) or b: under expert parallelism with
      the tokens sharded over the expert axis, each device receives at most
      ``ceil(b * T_shard * top_k / D)`` rows from each of the D devices of that axis (b = 1:
      the balanced load), so per-device memory stays flat as the mesh grows; rows past it
      give 0 and count in ``aux["dropped_fraction"]`` (MaxText's ragged buffer factor).
    partitionable: without mesh arguments, True: the routed experts are one op the
      partitioner splits from the shardings (`gmm_jax.routed_experts`; its backward
      recomputes the expert forward per device: a one-device CPU training step measured
      1.34x slower). False: the fused gmms inline, keeping their pre-activations for the
      backward: for one device, or inside the user's own shard_map. None (default): True
      when jax sees more than one device (`jax.device_count()`, every process's) or the
      program is compiled for another platform's devices (`jax.default_device`, as a
      deviceless compile for a TPU or GPU topology does).
    transport: how rows travel under expert parallelism (`gmm_jax.routed_apply`): "auto"
      (ragged all-to-all on GPU and TPU, all_to_all on CPU), "ragged" or "all_to_all"
      (fixed [devices, rows] buffers; for TPU slices whose ICI routing libtpu's ragged
      all-to-all does not support, e.g. v5e 8x8 and 16x16).
    expert_parallel: None, or ``(mesh, axis)``: the expert kernels sharded over the mesh
      axis. Tokens sharded over the same axis travel to their experts' devices
      (`gmm_jax.routed_apply`) once per call; tokens replicated over it are each run by
      the devices of their experts and combined with one psum.
    data_parallel: None, or ``(mesh, axes)``: tokens (the leading dims of x) sharded over
      these mesh axes (data parallel, FSDP). Each shard groups its own tokens and the output
      keeps the tokens' sharding. With capacity_factor, each shard's capacity is computed
      from its own tokens. On a mesh with Explicit axes both follow from the types. On a
      mesh the experts run inside `routed_apply` on sorted rows (the gate and up still one
      gmm with the gated activation when fused).
      Without either (plain `jax.jit` with sharded arguments, or one device), the routed
      experts are one partitionable op (`gmm_jax.routed_experts`): the partitioner picks
      local routing (replicated experts), per-device experts with a psum (tokens not
      sharded over the experts' axis) or expert parallelism with all-to-all (tokens
      sharded over it too) from the shardings of the tokens and the expert kernels.
    weight_quant, input_quant: QuantSpecs for the expert projections (see GroupedLinear).
    dtype, param_dtype, implementation: as in GroupedLinear.
    kernel_metadata: metadata of every expert kernel Param (as nnx.Linear's).
    out_sharding: the output's sharding (a NamedSharding or a PartitionSpec of the context
      mesh); __call__'s argument overrides it.
    rngs: nnx.Rngs.

  Returns (from __call__): ``(y, aux)``: ``aux["load_balancing_loss"]`` the Switch balance
  loss ``E * sum_e f_e * P_e`` (f_e: fraction of top-k assignments to e, P_e: mean score of
  e, sigmoid scores normalized per token), ``aux["router_z_loss"]`` the ST-MoE z-loss
  ``mean(logsumexp(logits)^2)``, ``aux["expert_load"]`` f ``[E]``, and
  ``aux["dropped_fraction"]`` (assignments over capacity). The caller weights the losses.
  """

  def __init__(self, num_experts: int, embed: int, mlp: int, *, top_k: int = 2,
               activation="silu", gated: bool = True, fused: bool = True,
               score: str = "softmax", normalize_top_k: bool | None = None,
               routing_bias: bool = False, num_expert_groups: int | None = None,
               top_k_groups: int | None = None, routed_scaling_factor: float = 1.0,
               router_bias: bool = False, num_shared_experts: int = 0,
               shared_mlp: int | None = None, use_bias: bool = False,
               capacity_factor: float | None = None, buffer_factor: float | None = None,
               partitionable: bool | None = None, transport: str = "auto",
               expert_parallel=None,
               data_parallel=None, dtype: Any = None, param_dtype: Any = jnp.float32,
               weight_quant: QuantSpec | None = None, input_quant: QuantSpec | None = None,
               implementation: str | None = None,
               kernel_metadata: Mapping[str, Any] | None = None, out_sharding=None,
               rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if capacity_factor is not None and capacity_factor <= 0:
      raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    if score not in ("softmax", "sigmoid"):
      raise ValueError(f"score must be 'softmax' or 'sigmoid', got {score!r}")
    if gated and isinstance(activation, str) and activation not in GATED_NAMES:
      raise ValueError(f"gated activation must be one of {sorted(GATED_NAMES)} or a "
                       f"callable, got {activation!r}")
    if not gated:
      resolve_activation(activation)
    if (num_expert_groups is None) != (top_k_groups is None):
      raise ValueError("num_expert_groups and top_k_groups go together")
    if num_expert_groups is not None:
      if num_experts % num_expert_groups or not 1 <= top_k_groups <= num_expert_groups:
        raise ValueError(f"{num_experts} experts in {num_expert_groups} groups, choosing "
                         f"{top_k_groups} of them: the groups must split the experts")
      if top_k_groups * (num_experts // num_expert_groups) < top_k:
        raise ValueError(f"top_k={top_k} is more than the experts of {top_k_groups} groups")
    self.num_experts, self.embed, self.mlp, self.top_k = num_experts, embed, mlp, top_k
    self.activation, self.gated, self.fused, self.score = activation, gated, fused, score
    self.normalize_top_k = top_k > 1 if normalize_top_k is None else normalize_top_k
    self.num_expert_groups, self.top_k_groups = num_expert_groups, top_k_groups
    self.routed_scaling_factor = routed_scaling_factor
    if buffer_factor is not None and buffer_factor <= 0:
      raise ValueError(f"buffer_factor must be positive, got {buffer_factor}")
    self.capacity_factor, self.buffer_factor = capacity_factor, buffer_factor
    if transport not in experts.TRANSPORTS:
      raise ValueError(f"transport must be one of {experts.TRANSPORTS}, got {transport!r}")
    self.partitionable, self.transport = partitionable, transport
    self.expert_parallel, self.data_parallel = expert_parallel, data_parallel
    self.dtype, self.out_sharding = dtype, out_sharding

    self.router = nnx.Linear(embed, num_experts, use_bias=router_bias, param_dtype=param_dtype,
                             kernel_init=nnx.initializers.normal(0.02), rngs=rngs)
    self.router.kernel = _param(self.router.kernel[...], ("embed", "expert"))
    if router_bias:
      self.router.bias = _param(self.router.bias[...], ("expert",))
    self.routing_bias = (_param(jnp.zeros((num_experts,), jnp.float32), ("expert",),
                                kind=RoutingBias) if routing_bias else None)
    common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                  weight_quant=weight_quant, input_quant=input_quant,
                  implementation=implementation, kernel_metadata=kernel_metadata, rngs=rngs)
    width = 2 * mlp if gated else mlp
    self.gate_up = GroupedLinear(num_experts, embed, width, **common) if gated else None
    self.up = None if gated else GroupedLinear(num_experts, embed, width, **common)
    self.down = GroupedLinear(num_experts, mlp, embed, kernel_axes=("expert", "mlp", "embed"),
                              bias_axes=("expert", "embed"), **common)
    shared_mlp = shared_mlp or mlp * num_shared_experts
    self.shared = SharedExperts(embed, shared_mlp, gated=gated, activation=activation,
                                dtype=dtype, param_dtype=param_dtype,
                                rngs=rngs) if num_shared_experts else None

  @classmethod
  def from_preset(cls, name: str, *, rngs: nnx.Rngs, scale: float = 1.0, **overrides):
    """An MoE layer shaped as `MOE_PRESETS[name]`; `scale` multiplies the widths (embed,
    mlp, shared_mlp; multiples of 8, at least 8) to shrink it for tests; `overrides`
    replace any argument."""
    if name not in MOE_PRESETS:
      raise ValueError(f"unknown preset {name!r}; one of {sorted(MOE_PRESETS)}")
    kwargs = dict(MOE_PRESETS[name])
    if scale != 1.0:
      for key in ("embed", "mlp", "shared_mlp"):
        if kwargs.get(key):
          kwargs[key] = max(8, int(round(kwargs[key] * scale / 8)) * 8)
    kwargs.update(overrides)
    return cls(kwargs.pop("num_experts"), kwargs.pop("embed"), kwargs.pop("mlp"), rngs=rngs,
               **kwargs)

  # ------------------------------------------------------------------------- routing

  def route_tokens(self, tokens: Array):
    """tokens ``[T, D]`` -> (logits ``[T, E]`` f32, scores ``[T, E]``, weights ``[T, k]``,
    experts int32 ``[T, k]``)."""
    logits = _replicated_last(self.router(tokens).astype(jnp.float32))
    scores = (jax.nn.softmax(logits, axis=-1) if self.score == "softmax"
              else jax.nn.sigmoid(logits))
    choice = scores
    if self.routing_bias is not None:
      choice = choice + jax.lax.stop_gradient(self.routing_bias[...]).astype(jnp.float32)
    choice = jax.lax.stop_gradient(choice)  # the selection is discrete
    if self.num_expert_groups is not None:
      choice = _limit_to_groups(choice, self.num_expert_groups, self.top_k_groups)
    top_e = _top_k(choice, self.top_k)
    weights = jnp.take_along_axis(scores, top_e, axis=-1)
    if self.normalize_top_k:
      weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    if self.routed_scaling_factor != 1.0:
      weights = weights * self.routed_scaling_factor
    return logits, scores, weights, top_e

  def update_routing_bias(self, expert_load: Array, rate: float = 1e-3):
    """DeepSeek-V3's balancing step: each expert's bias moves by `rate` towards balance
    (down when its load, ``aux["expert_load"]``, is above ``1/E``, up when below)."""
    if self.routing_bias is None:
      raise ValueError("this MoE has no routing bias (routing_bias=False)")
    step = rate * jnp.sign(1.0 / self.num_experts - expert_load.astype(jnp.float32))
    self.routing_bias[...] = self.routing_bias[...] + step

  # ------------------------------------------------------------------------- experts

  def _in_layer(self) -> GroupedLinear:
    return self.gate_up if self.gated else self.up

  def _expert_weights(self, dtype):
    w_in, b_in = self._in_layer().weights(dtype)
    w_down, b_down = self.down.weights(dtype)
    weights = dict(w_in=w_in, w_down=w_down)
    if b_in is not None:
      weights.update(b_in=b_in, b_down=b_down)
    return weights

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
    typed = getattr(jax.typeof(self._in_layer().kernel[...]), "sharding", None)
    if axis is None and typed is not None and not typed.mesh.empty and len(typed.spec):
      entry = typed.spec[0]  # the expert kernels' leading dim on an Explicit mesh
      axis = entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry
    if mesh is None or mesh.empty or (axis is None and not token_axes):
      return None, None, ()
    if not token_axes and self.data_parallel is None and not explicit_axes(mesh):
      token_axes = (axis,)
    return mesh, axis, token_axes

  def __call__(self, x: Array, *, out_sharding=None) -> tuple[Array, dict[str, Array]]:
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    num_tokens, num_experts, k = tokens.shape[0], self.num_experts, self.top_k
    mesh, axis, token_axes = self._layout(x)
    logits, scores, top_p, top_e = self.route_tokens(tokens)
    dtype = self.dtype or jnp.result_type(x, self._in_layer().kernel[...])
    rows = tokens.astype(dtype)
    weights = self._expert_weights(dtype)
    spec = self._ffn_spec(dtype)
    partitionable = self.partitionable
    if partitionable is None:
      partitionable = _may_be_partitioned()
    if mesh is None and not partitionable:
      capacity = (None if self.capacity_factor is None else
                  math.ceil(self.capacity_factor * num_tokens * k / num_experts))
      ffn = experts.ffn_routed if self.fused else experts.ffn_sorted
      y, kept = ffn(spec, rows, top_e.astype(jnp.int32), top_p, weights, capacity=capacity)
      kept = None if capacity is None else kept
    elif mesh is None:
      # Mesh-blind (plain jit, one device): the partitioner splits the routed experts by
      # the operands' shardings (`experts.routed_experts`).
      y, kept = experts.routed_experts(spec, rows, top_e, top_p, weights,
                                       capacity_factor=self.capacity_factor,
                                       buffer_factor=self.buffer_factor,
                                       transport=self.transport)
      kept = None if self.capacity_factor is None and self.buffer_factor is None else kept
    else:
      shards = math.prod(mesh.shape[a] for a in token_axes)
      capacity = None
      if self.capacity_factor is not None:
        capacity = math.ceil(self.capacity_factor * num_tokens * k / (num_experts * shards))
      y, kept = self._sorted(spec, rows, top_e, top_p, weights, capacity, shards, mesh, axis,
                             token_axes)
    if self.shared is not None:
      y = y + self.shared(tokens).astype(jnp.float32)

    expert_load = jnp.mean(jnp.sum(jax.nn.one_hot(top_e, num_experts, dtype=jnp.float32),
                                   axis=1), axis=0) / k
    balance_probs = scores if self.score == "softmax" else (
        scores / jnp.sum(scores, axis=-1, keepdims=True))
    aux = {
        "load_balancing_loss": num_experts * jnp.sum(expert_load
                                                     * jnp.mean(balance_probs, axis=0)),
        "router_z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "expert_load": expert_load,
        "dropped_fraction": (jnp.zeros((), jnp.float32) if kept is None
                             else 1.0 - jnp.mean(kept.astype(jnp.float32))),
    }
    y = y.astype(x.dtype).reshape(shape)
    out_sharding = self.out_sharding if out_sharding is None else out_sharding
    return _reshard(y, out_sharding), aux

  def _ffn_spec(self, dtype) -> ExpertFFN:
    options = self._in_layer().gmm_options(dtype)
    return ExpertFFN(self.num_experts, self.activation, self.gated, self.fused,
                     tuple(sorted(options.items())))

  def _sorted(self, spec, rows, top_e, top_p, weights, capacity, shards, mesh, axis,
              token_axes):
    """The mesh path (mesh arguments or Explicit axes): each assignment's row copied,
    sorted by expert within each shard (`routed_apply`), the expert FFN, unsorted, weighted
    and summed over k."""
    num_tokens, k = top_e.shape
    flat_e, flat_p = top_e.reshape(-1), top_p.reshape(-1)
    # The token of each assignment (a broadcast: keeps the tokens' sharding on any mesh).
    copies = jnp.broadcast_to(rows[:, None, :], (num_tokens, k, rows.shape[-1])).reshape(
        num_tokens * k, rows.shape[-1])
    kept = None
    if capacity is not None:
      # Each expert takes the first `capacity` assignments of each token shard, in order.
      hot = jax.nn.one_hot(flat_e.reshape(shards, -1), self.num_experts, dtype=jnp.int32)
      rank = jnp.sum((jnp.cumsum(hot, axis=1) - 1) * hot, axis=-1).reshape(-1)
      kept = rank < capacity
      flat_p = jnp.where(kept, flat_p, 0.0)
    ids = flat_e if kept is None else jnp.where(kept, flat_e, 0)  # dropped: weight 0
    per_pair = None  # routed_apply's default: the worst case
    if self.buffer_factor is not None and axis is not None and axis in token_axes:
      local_rows = num_tokens * k // shards
      per_pair = max(1, min(local_rows, math.ceil(self.buffer_factor * local_rows
                                                  / mesh.shape[axis])))
    out = routed_apply(lambda r, s, w: experts.ffn_rows(spec, r, s, w), copies, ids, weights,
                       mesh=mesh, axis=axis, token_axes=token_axes, capacity=per_pair,
                       transport=self.transport)
    # Each token's k results, weighted: a reshape and a sum (no scatter across shards).
    weighted = (out.astype(jnp.float32).reshape(num_tokens, k, -1)
                * flat_p.reshape(num_tokens, k, 1))
    return jnp.sum(weighted, axis=1), None if kept is None else kept.reshape(num_tokens, k)


class SharedExperts(nnx.Module):
  """Shared experts: one dense FFN (gated or plain) that every token goes through."""

  def __init__(self, embed: int, mlp: int, *, gated: bool = True, activation="silu",
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.gated, self.activation, self.dtype = gated, activation, dtype
    width = 2 * mlp if gated else mlp
    self.up = nnx.Linear(embed, width, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)
    self.up.kernel = _param(self.up.kernel[...], ("embed", "mlp"))
    self.down = nnx.Linear(mlp, embed, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)
    self.down.kernel = _param(self.down.kernel[...], ("mlp", "embed"))

  def __call__(self, x: Array) -> Array:
    z = self.up(x)
    if not self.gated:
      h = resolve_activation(self.activation)(z)
    elif callable(self.activation):
      half = z.shape[-1] // 2
      h = self.activation(z[..., :half]) * z[..., half:]
    else:
      h = GATED_ACTIVATIONS[GATED_NAMES[self.activation]](z)
    return self.down(h)


def _may_be_partitioned() -> bool:
  """Whether a program traced now may run on several devices: more than one device in
  sight, or a default device of another platform (a deviceless compile's target)."""
  if jax.device_count() > 1:
    return True
  device = jax.config.jax_default_device
  return device is not None and getattr(device, "platform", "cpu") != "cpu"


def _top_k(scores, k: int):
  """The indices of `jax.lax.top_k` over the experts as k max/argmax passes: reductions
  that the partitioner keeps local to each token shard (XLA:CPU's TopK gathers every
  token's scores). Ties go to the lower expert index, as in top_k."""
  indices = []
  remaining = scores
  for _ in range(k):
    index = jnp.argmax(remaining, axis=-1).astype(jnp.int32)
    indices.append(index)
    remaining = jnp.where(jax.nn.one_hot(index, scores.shape[-1], dtype=bool), -jnp.inf,
                          remaining)
  return jnp.stack(indices, axis=-1)


def _limit_to_groups(choice, num_groups: int, top_groups: int):
  """DeepSeek-V3's group-limited routing: the experts of all but the `top_groups` groups
  with the largest sum of their two best scores get -inf."""
  num_tokens, num_experts = choice.shape
  grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
  best = jnp.max(grouped, axis=-1)
  group_score = best
  if grouped.shape[-1] > 1:
    first = jax.nn.one_hot(jnp.argmax(grouped, axis=-1), grouped.shape[-1], dtype=bool)
    group_score = best + jnp.max(jnp.where(first, -jnp.inf, grouped), axis=-1)
  chosen = jnp.sum(jax.nn.one_hot(_top_k(group_score, top_groups), num_groups, dtype=bool),
                   axis=1, dtype=jnp.int32) > 0  # [T, groups]
  mask = jnp.repeat(chosen, num_experts // num_groups, axis=-1)
  return jnp.where(mask, choice, -jnp.inf)


def _replicated_last(logits):
  """Router logits whole along the experts (top_k needs them), on any mesh: on Explicit
  axes a router kernel sharded over experts would otherwise shard them."""
  typed = getattr(jax.typeof(logits), "sharding", None)
  if typed is None or typed.mesh.empty or not explicit_axes(typed.mesh):
    return logits
  spec = list(typed.spec) + [None] * (logits.ndim - len(typed.spec))
  if spec[-1] is None:
    return logits
  return jax.sharding.reshard(logits, NamedSharding(typed.mesh, P(*spec[:-1], None)))


# Layer shapes and routing of public MoE models (one MoE layer; `MoE.from_preset`).
MOE_PRESETS: dict[str, dict[str, Any]] = {
    # Mixtral-8x7B: softmax top-2 of 8, renormalized, SwiGLU experts.
    "mixtral-8x7b": dict(num_experts=8, embed=4096, mlp=14336, top_k=2, score="softmax",
                         activation="silu"),
    # DeepSeek-V3: sigmoid scores, bias-corrected selection (aux-loss-free balancing),
    # top-4 of 8 groups, top-8 of 256 experts, weights renormalized and scaled by 2.5, one
    # shared expert.
    "deepseek-v3": dict(num_experts=256, embed=7168, mlp=2048, top_k=8, score="sigmoid",
                        routing_bias=True, num_expert_groups=8, top_k_groups=4,
                        normalize_top_k=True, routed_scaling_factor=2.5,
                        num_shared_experts=1, activation="silu"),
    # Qwen3-30B-A3B: softmax top-8 of 128, renormalized (norm_topk_prob), no shared expert.
    "qwen3-moe-30b-a3b": dict(num_experts=128, embed=2048, mlp=768, top_k=8, score="softmax",
                              normalize_top_k=True, activation="silu"),
    # gpt-oss-120b: router with a bias, softmax over the top-4 of 128 (= renormalized),
    # clamped SwiGLU, expert biases.
    "gpt-oss-120b": dict(num_experts=128, embed=2880, mlp=2880, top_k=4, score="softmax",
                         normalize_top_k=True, router_bias=True, use_bias=True,
                         activation="swiglu_clamped"),
}


def grouped_linear_linen(*args, name: str | None = None, **kwargs):
  """A Linen module wrapping `GroupedLinear` (``flax.nnx.bridge.ToLinen``); `name` names it
  in its parent (inside ``@linen.compact``)."""
  return nnx.bridge.ToLinen(GroupedLinear, args=args, kwargs=kwargs, name=name)


def moe_linen(*args, name: str | None = None, **kwargs):
  """A Linen module wrapping `MoE` (``flax.nnx.bridge.ToLinen``); `name` names it in its
  parent (inside ``@linen.compact``)."""
  return nnx.bridge.ToLinen(MoE, args=args, kwargs=kwargs, name=name)
