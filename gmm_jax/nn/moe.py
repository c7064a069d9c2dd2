"""`MoE`: a routed mixture-of-experts block composed of a router (`router`), the routed
experts' FFN (`expert_ffn`) run by the strategy `dispatch` picks, and optional shared
experts (`shared`)."""

from __future__ import annotations

import dataclasses
import fractions
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from gmm_jax.nn import dispatch
from gmm_jax.nn.config import (IDENTITY_EXPERTS_ALONE, MASKED_NEEDS_ONE_DEVICE,
                               ROUTER_OPTIONS, MoEConfig)
from gmm_jax.nn.expert_ffn import expert_layers, expert_params, ffn_spec
from gmm_jax.nn.grouped_linear import GroupedLinear
from gmm_jax.nn.params import mesh_axes, param, reshard
from gmm_jax.nn.presets import preset
from gmm_jax.nn.router import Router
from gmm_jax.nn.shared import SharedExperts

Array = jax.Array


def _layer_config(sizes: tuple, config: MoEConfig | None, options: dict) -> MoEConfig:
  """The layer's config from its keyword form (`sizes` and `options`) or its config form;
  TypeError for both forms, or neither."""
  if config is None:
    if None in sizes:
      raise TypeError(f"MoE takes num_experts, embed and mlp (got {sizes}) or "
                      f"config=MoEConfig(...)")
    return MoEConfig(*sizes, **options)
  if not isinstance(config, MoEConfig):
    raise TypeError(f"config must be a MoEConfig, got {type(config).__name__}")
  if options or sizes != (None, None, None):
    given = [name for name, size in zip(("num_experts", "embed", "mlp"), sizes)
             if size is not None] + sorted(options)
    raise TypeError(f"MoE(config=...) holds every option: {given} beside it would be "
                    f"ignored (dataclasses.replace(config, ...) makes a variant)")
  return config


def _layer_router(config: MoEConfig, router: nnx.Module | None, rngs: nnx.Rngs) -> nnx.Module:
  """The built-in `Router` of the config's router options, or the replacement `router`,
  checked: it has a ``route`` method and the config leaves the router options alone."""
  if router is None:
    return Router(config.embed, config.num_experts + config.num_identity_experts,
                  top_k=config.top_k, use_bias=config.router_bias,
                  param_dtype=config.param_dtype, rngs=rngs,
                  **{name: getattr(config, name) for name in ROUTER_OPTIONS
                     if name != "router_bias"})
  if config.num_identity_experts:
    raise NotImplementedError(IDENTITY_EXPERTS_ALONE)
  changed = config.changed_router_options()
  if changed:
    raise ValueError(f"router= replaces the built-in router: its options {changed} "
                     "do not apply (give them to the router)")
  if not callable(getattr(router, "route", None)):
    raise ValueError(f"router must have a route(tokens) -> Routing method, got "
                     f"{type(router).__name__}")
  return router


def _router_setting(name: str) -> property:
  """A read-only property of `MoE`: its router's `name` (None for a replacement router
  without it)."""
  return property(lambda self: getattr(self.router, name, None))


class MoE(nnx.Module):
  """A top-k routed mixture of experts (dropless by default), with optional shared experts.

  ``y = c * shared(x) + sum_{e in top_k(x)} w_e(x) * down_e(act(x @ gate_e) * (x @ up_e))``
  (c: ``shared_scale``, 1 by default).
  The router: ``logits = x @ W_router (+ b)``, scores ``s = softmax(logits)`` or
  ``sigmoid(logits)``; experts chosen by ``s + routing_bias`` (the bias only selects),
  optionally only within the best ``top_k_groups`` of ``num_expert_groups`` groups (ranked by
  the sum of their top-2 biased scores, DeepSeek-V3); weights ``w = s[chosen]``, divided by
  their sum (plus ``normalize_epsilon``) when ``normalize_top_k``, times
  ``routed_scaling_factor``.

  The fused path (default): `gmm_jax.route` gives the expert-grouped rows; gate and up are
  ONE gmm on the ``[E, D, 2F]`` kernel reading the tokens by ``lhs_indices`` with the gated
  activation in its epilogue; the down projection is one gmm that weights each row by its
  router weight and writes it to its (token, k) slot (``row_weights``, ``out_indices``);
  ``route.combine`` sums each token's k slots. No sorted copy of the tokens is made.
  ``fused=False`` is the unfused baseline: tokens sorted and copied, gate and up as two
  gmms (on the two halves of the same kernel: the same parameters), unsorted and combined.

  Args:
    num_experts, embed, mlp: E, the model width D, the expert FFN width F.
    **options: the other options, by name: the fields of `MoEConfig`, with its defaults
      (``top_k``, ``activation``, the router's, capacity, layout, dtypes, ...): the
      keyword form, from which the layer builds its config.
    config: a `MoEConfig` instead of num_experts, embed, mlp and the options: the config
      form (both forms build the same layer). ``layer.config`` is the config the layer
      was built from (an attribute assigned afterwards, ``layer.fused = False``, leaves it
      as it was); ``MoE(config=dataclasses.replace(layer.config, top_k=1), rngs=...)``
      builds a variant.
    router: None (the built-in `Router` from the config's router options, at
      ``self.router``), or a replacement: any nnx.Module with ``route(tokens [T, D]) ->
      Routing(weights [T, k] float, experts [T, k] int, aux dict)`` (see `Router`); the
      router options must then keep their defaults.
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
      Without either and with no mesh in sight (plain `jax.jit` whose arguments carry no
      placement in their types, or one device), the routed experts are one partitionable
      op (`gmm_jax.routed_experts`; see `MoEConfig.partitionable`): the partitioner picks
      local routing (replicated experts), per-device experts with a psum (tokens not
      sharded over the experts' axis) or expert parallelism with all-to-all (tokens
      sharded over it too) from the shardings of the tokens and the expert kernels.
    kernel_metadata: metadata of every expert kernel Param (as nnx.Linear's).
    out_sharding: the output's sharding (a NamedSharding or a PartitionSpec of the context
      mesh); __call__'s argument overrides it.
    rngs: nnx.Rngs.

  These five and rngs are not fields of `MoEConfig`: they are the objects the layer is
  built with or placed by (a module, meshes, shardings), not options (`MoEConfig` says
  why for each).

  Raises:
    ValueError, NotImplementedError: from `MoEConfig` for the options; here for a
      replacement router beside router options or identity experts, and for the masked
      layout with mesh arguments.
    TypeError: both a config and options, or neither.

  Parameters: ``router.kernel [D, E]`` (``router.bias [E]``, ``router.routing_bias [E]``,
  the latter a `RoutingBias`), ``gate_up.kernel [E, D, 2F]`` (gate half first) or
  ``up.kernel [E, D, F]``, ``down.kernel [E, F, D]`` (biases ``[E, 2F]``/``[E, F]`` and
  ``[E, D]``), ``shared.up.kernel [D, 2F_s]``, ``shared.down.kernel [F_s, D]``,
  ``shared.gate.kernel [D, 1]``, ``output_bias [D]``.

  Returns (from __call__): ``(y, aux)``: the router's aux (the built-in router's:
  ``aux["load_balancing_loss"]`` the Switch balance loss ``E * sum_e f_e * P_e`` (f_e:
  fraction of top-k assignments to e, P_e: mean score of e, sigmoid scores normalized per
  token), ``aux["router_z_loss"]`` the ST-MoE z-loss ``mean(logsumexp(logits)^2)``,
  ``aux["expert_load"]`` f ``[E]``, ``[E + Z]`` with Z identity experts), and
  ``aux["dropped_fraction"]`` (assignments over capacity). The caller weights the losses.
  """

  def __init__(self, num_experts: int | None = None, embed: int | None = None,
               mlp: int | None = None, *, config: MoEConfig | None = None,
               router: nnx.Module | None = None, expert_parallel=None, data_parallel=None,
               kernel_metadata: Mapping[str, Any] | None = None, out_sharding=None,
               rngs: nnx.Rngs, **options):
    config = _layer_config((num_experts, embed, mlp), config, options)
    if config.layout == "masked" and (expert_parallel is not None
                                      or data_parallel is not None):
      raise NotImplementedError(MASKED_NEEDS_ONE_DEVICE)
    num_experts, embed, mlp = config.num_experts, config.embed, config.mlp
    router = _layer_router(config, router, rngs)
    self.config = config
    self.num_experts, self.embed, self.mlp, self.top_k = num_experts, embed, mlp, config.top_k
    self.activation, self.gated, self.fused = config.activation, config.gated, config.fused
    self.num_identity_experts = config.num_identity_experts
    self.gated_prologue = (None if config.gated_prologue is None
                           else bool(config.gated_prologue))
    self.router_weight_on = config.router_weight_on
    self.swiglu_limit = float(config.swiglu_limit)
    self.swiglu_alpha = float(config.swiglu_alpha)
    self.capacity_factor, self.buffer_factor = config.capacity_factor, config.buffer_factor
    self.capacity_per = config.capacity_per
    self.expert_capacity = (None if config.expert_capacity is None
                            else int(config.expert_capacity))
    self.shared_scale = float(config.shared_scale)
    self.layout, self.max_rows = config.layout, config.max_rows
    self.partitionable, self.transport = config.partitionable, config.transport
    self.expert_parallel, self.data_parallel = expert_parallel, data_parallel
    self.dtype, self.out_sharding = config.dtype, out_sharding

    self.router = router
    self.gate_up, self.up, self.down = expert_layers(
        num_experts, embed, mlp, gated=config.gated, use_bias=config.use_bias,
        dtype=config.dtype, param_dtype=config.param_dtype,
        weight_quant=config.weight_quant, input_quant=config.input_quant,
        quantization=config.quantization, implementation=config.implementation,
        kernel_metadata=kernel_metadata, rngs=rngs)
    self.output_bias = (param(jnp.zeros((embed,), config.param_dtype), ("embed",))
                        if config.output_bias else None)
    shared_mlp = config.shared_mlp or mlp * config.num_shared_experts
    self.shared = SharedExperts(embed, shared_mlp, gated=config.gated,
                                activation=config.activation, gate=config.shared_gate,
                                swiglu_limit=config.swiglu_limit,
                                swiglu_alpha=config.swiglu_alpha, dtype=config.dtype,
                                param_dtype=config.param_dtype,
                                rngs=rngs) if config.num_shared_experts else None

  @classmethod
  def from_preset(cls, name: str, *, rngs: nnx.Rngs, scale: float = 1.0, **overrides):
    """An MoE layer of the preset `name`'s config (`gmm_jax.nn.presets.preset`); `scale`
    multiplies the widths (embed, mlp, shared_mlp; multiples of 8, at least 8) to shrink
    it for tests; `overrides` replace any field of the config, or give the layer's other
    arguments (`router`, `expert_parallel`, ...)."""
    fields = {field.name for field in dataclasses.fields(MoEConfig)}
    config = preset(name, scale, **{k: v for k, v in overrides.items() if k in fields})
    return cls(config=config, rngs=rngs,
               **{k: v for k, v in overrides.items() if k not in fields})

  # ------------------------------------------------------------------------- routing
  # The built-in router's settings, read through the layer (None for a replacement
  # router without them).

  score = _router_setting("score")
  normalize_top_k = _router_setting("normalize_top_k")
  normalize_epsilon = _router_setting("normalize_epsilon")
  num_expert_groups = _router_setting("num_expert_groups")
  top_k_groups = _router_setting("top_k_groups")
  group_score = _router_setting("group_score")
  routed_scaling_factor = _router_setting("routed_scaling_factor")

  @property
  def routing_bias(self):
    """The built-in router's `RoutingBias` variable (``router.routing_bias``), or None."""
    return getattr(self.router, "routing_bias", None)

  def route_tokens(self, tokens: Array):
    """The built-in router's choice for tokens ``[T, D]``: (logits ``[T, E]`` f32, scores
    ``[T, E]``, weights ``[T, k]``, experts int32 ``[T, k]``) (`Router.select`)."""
    return self.router.select(tokens)

  def update_routing_bias(self, expert_load: Array, rate: float = 1e-3):
    """DeepSeek-V3's balancing step (`Router.update_routing_bias`): each expert's bias
    moves by `rate` towards balance (down when its load, ``aux["expert_load"]``, is above
    ``1/E``, up when below)."""
    if self.routing_bias is None:
      raise ValueError("this MoE has no routing bias (routing_bias=False)")
    self.router.update_routing_bias(expert_load, rate)

  # ------------------------------------------------------------------------- experts

  def _in_layer(self) -> GroupedLinear:
    return self.gate_up if self.gated else self.up

  def __call__(self, x: Array, *, out_sharding=None) -> tuple[Array, dict[str, Array]]:
    shape = x.shape
    tokens = x.reshape(-1, shape[-1])
    in_kernel = self._in_layer().kernel[...]
    mesh, axis, token_axes = dispatch.layout(
        x, self.expert_parallel, self.data_parallel, in_kernel,
        # The masked layout runs on one device's view, and partitionable=True / False ask
        # for the partitioner's op / the inlined gmms: no layout of its own is pinned.
        None if self.layout == "masked" or self.partitionable is not None
        else functools.partial(mesh_axes, self._in_layer().kernel))
    routing = self.router.route(tokens)
    top_e, top_p = routing.experts, routing.weights
    if top_e.shape != (tokens.shape[0], self.top_k):
      raise ValueError(f"the router chose experts of shape {top_e.shape}; the layer takes "
                       f"[{tokens.shape[0]}, top_k={self.top_k}]")
    dtype = self.dtype or jnp.result_type(x, in_kernel)
    identity_weight = None
    if self.num_identity_experts:  # ids >= E: w * x, and no FFN row
      is_identity = top_e >= self.num_experts
      identity_weight = jnp.sum(jnp.where(is_identity, top_p, 0), axis=-1, keepdims=True)
      top_e = jnp.where(is_identity, -1, top_e)
    sequence_length = None
    if self.capacity_per == "sequence":  # x [..., S, D]; a 2-D x is one sequence
      sequence_length = shape[-2] if len(shape) >= 3 else tokens.shape[0]
    spec = ffn_spec(self.num_experts, self.activation, self.gated, self.fused,
                    self._in_layer(), dtype, weight_on=self.router_weight_on,
                    swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha,
                    gated_prologue=self.gated_prologue)
    capacity_factor = self.capacity_factor
    if self.expert_capacity is not None:
      # The factor whose capacity ceil(c * n * k / E) is expert_capacity, exactly.
      counted = sequence_length if sequence_length is not None else tokens.shape[0]
      capacity_factor = fractions.Fraction(self.expert_capacity * self.num_experts,
                                           max(counted * self.top_k, 1))
    y, kept = dispatch.run_experts(
        spec, tokens.astype(dtype), top_e, top_p,
        expert_params(self._in_layer(), self.down, dtype), mesh=mesh, axis=axis,
        token_axes=token_axes, partitionable=self.partitionable,
        capacity_factor=capacity_factor, buffer_factor=self.buffer_factor,
        transport=self.transport, sequence_length=sequence_length,
        masked_rows=(self.max_rows or tokens.shape[0]) if self.layout == "masked" else None)
    if identity_weight is not None:
      y = y + (identity_weight.astype(jnp.float32) * tokens.astype(jnp.float32))
    if self.shared is not None:
      shared = self.shared(tokens).astype(jnp.float32)
      y = y + (shared if self.shared_scale == 1.0 else shared * self.shared_scale)
    if self.output_bias is not None:
      y = y + self.output_bias[...].astype(jnp.float32)
    aux = dict(routing.aux)
    # The mean of exact 0s and 1s: 0 when nothing is dropped (1 - mean(kept) rounds).
    aux["dropped_fraction"] = (jnp.zeros((), jnp.float32) if kept is None
                               else jnp.mean(1.0 - kept.astype(jnp.float32)))
    y = y.astype(x.dtype).reshape(shape)
    out_sharding = self.out_sharding if out_sharding is None else out_sharding
    return reshard(y, out_sharding), aux
