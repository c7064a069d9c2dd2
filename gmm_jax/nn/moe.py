"""`MoE`: a routed mixture-of-experts block composed of a router (`router`), the routed
experts' FFN (`expert_ffn`) run by the strategy `dispatch` picks, and optional shared
experts (`shared`)."""

from __future__ import annotations

import fractions
import functools
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gmm_jax import QuantSpec
from gmm_jax.nn import dispatch
from gmm_jax.nn.expert_ffn import check_options, expert_layers, expert_params, ffn_spec
from gmm_jax.nn.grouped_linear import GroupedLinear
from gmm_jax.nn.params import mesh_axes, param, reshard
from gmm_jax.nn.presets import scaled
from gmm_jax.nn.router import Router
from gmm_jax.nn.shared import SharedExperts
from gmm_jax._src.moe import experts
from gmm_jax._src.core.epilogue import SWIGLU_ALPHA, SWIGLU_LIMIT

Array = jax.Array

# The router options of `MoE` with their defaults (a replacement router takes none).
_ROUTER_DEFAULTS = dict(score="softmax", normalize_top_k=None, routing_bias=False,
                        num_expert_groups=None, top_k_groups=None,
                        group_score="sum_top2", routed_scaling_factor=1.0,
                        sparsemixer_eps=0.01, router_bias=False,
                        load_balancing_convention="gmm_jax", normalize_epsilon=0.0)
CAPACITY_PER = ("call", "sequence")
LAYOUTS = ("ragged", "masked")


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
    top_k: experts per token.
    activation: for gated FFNs "silu" (SwiGLU), "gelu" / "gelu_tanh" (GeGLU),
      "swiglu_clamped" (gpt-oss: ``gate = min(gate, limit)``, ``up = clip(up, -limit,
      limit)``, ``gate * sigmoid(alpha * gate) * (up + 1)``), or a callable on the gate
      half; for plain FFNs a name of `gmm_jax.ACTIVATIONS` ("relu", "gelu", ...) or a
      callable.
    swiglu_limit, swiglu_alpha: the clamped SwiGLU's limit and alpha (gpt-oss configs'
      ``swiglu_limit``; defaults 7.0 and 1.702; other values only with
      "swiglu_clamped"). The gmm kernels' epilogues hold the defaults: other values run
      the gated activation after the gate|up gmm, in jnp (the same function,
      `gmm_jax._src.core.epilogue.swiglu_clamped`), keeping its ``[R, 2F]`` result.
    gated: True: gated FFN, ``gate_up`` kernel ``[E, D, 2F]`` (gate half first); False: a
      Switch-style FFN, ``up`` kernel ``[E, D, F]``. Either way ``down`` is ``[E, F, D]``.
    fused: the fused path (above) or the unfused baseline.
    gated_prologue: fused and gated: the down projection reads the gate|up
      pre-activation through its gated prologue, and its input gradient (the ``[R, 2F]``
      cotangent of the pre-activation) comes from one gmm. None (default): where the
      platform's kernels do both natively (TPU), else not; True/False force it
      (`gmm_jax.ExpertFFN`, with the measurements).
    score: "softmax" or "sigmoid" router scores, or "sparsemixer" (PhiMoE's: the k best
      logits, each weighted by a softmax over a window of the logits not chosen before it,
      `Router`).
    sparsemixer_eps: the window of "sparsemixer" (PhiMoE's ``router_jitter_noise``).
    normalize_top_k: renormalize the chosen weights to sum to 1; default: when top_k > 1
      (a top-1 weight renormalized is always 1, leaving the router without a gradient),
      except with score="sparsemixer", whose weights are never renormalized.
    normalize_epsilon: added to the chosen weights' sum before that division (LFM2-MoE:
      1e-6); 0 by default.
    routing_bias: add a `RoutingBias` (zeros at first) to the scores for the selection.
    num_expert_groups, top_k_groups: group-limited routing (None: off).
    group_score: the rank of a group for group-limited routing: "sum_top2" (default: the
      sum of its two best biased scores, DeepSeek-V3) or "max" (its best score,
      DeepSeek-V2's ``group_limited_greedy``).
    routed_scaling_factor: multiplies the routed experts' weights.
    router_bias: the router has a bias (gpt-oss).
    router: None (the built-in `Router` from the options above, at ``self.router``), or a
      replacement: any nnx.Module with ``route(tokens [T, D]) -> Routing(weights [T, k]
      float, experts [T, k] int, aux dict)`` (see `Router`); the router options above
      must then keep their defaults.
    load_balancing_convention: the scale of ``aux["load_balancing_loss"]`` (`Router`):
      "gmm_jax" (default): Switch's ``E * sum_e f_e * P_e`` with f_e the fraction of the
      T*k assignments that chose e and P_e the mean score of e: 1 when balanced.
      "transformers": their ``load_balancing_loss_func``, ``E * sum_e (c_e / T) *
      mean_t softmax(logits)_te`` with c_e the tokens whose top-k of the softmax holds e:
      top_k times the former for softmax routers, so that their ``router_aux_loss_coef``
      carries over.
    router_weight_on: "output" (default): ``y = sum_j w_j * ffn_j(x)``; "input":
      ``y = sum_j ffn_j(w_j * x)``, the router weight multiplies the expert's input row
      (Llama 4; the same only for linear experts). Fused, the gathered rows are scaled
      (one ``[T*k, D]`` copy the output weighting does not make); also under
      expert parallelism and `routed_experts`.
    num_identity_experts: Z zero-computation experts that return their input (LongCat-
      Flash's "zero experts"): the router scores E + Z experts (``router.kernel [D, E+Z]``,
      its biases ``[E+Z]``), and a chosen id ``e >= E`` adds ``w * x`` to the token's
      output instead of an FFN, so that a token can spend fewer than top_k FFNs. Not with
      a capacity or a replacement router.
    num_shared_experts, shared_mlp: shared experts, one dense FFN of width ``shared_mlp``
      (default ``mlp * num_shared_experts``) applied to every token, gated like the experts.
    shared_gate: the shared experts' output times ``sigmoid(x @ shared.gate.kernel)``, a
      learned ``[D, 1]`` kernel (Qwen2-MoE's and Qwen3-Next's ``shared_expert_gate``);
      needs num_shared_experts >= 1.
    shared_scale: multiplies the shared experts' output (Cohere2-MoE's "average"
      combination ``(routed + shared) / 2`` is 0.5 with ``routed_scaling_factor=0.5``);
      other than 1 it needs num_shared_experts >= 1.
    use_bias: expert biases ``[E, 2F]`` (or ``[E, F]``) and ``[E, D]`` (gpt-oss).
    output_bias: a learned ``[D]`` bias (zeros at first, ``output_bias``) added to every
      token's output, after the routed and shared experts (JetMoE's MoE ``bias``).
    capacity_factor: None (dropless) or c: each expert takes at most
      ``ceil(c * T * top_k / E)`` assignments (earlier tokens first; the rest give 0), and
      the grouped buffers hold ``min(T * top_k, E * capacity)`` rows.
    capacity_per: "call" (default: T is every token of the call, or of a token shard on a
      mesh) or "sequence": x ``[..., S, D]`` (a 2-D x is one sequence), each sequence's
      assignments ranked on their own, ``ceil(c * S * top_k / E)`` per expert and
      sequence (Switch Transformer in transformers: its ``expert_capacity`` is this
      number: `expert_capacity`).
    expert_capacity: None, or C (an int, instead of capacity_factor): each expert takes at
      most C assignments of the call, or of each sequence with ``capacity_per="sequence"``
      (Switch Transformer's ``expert_capacity``); the capacity_factor whose capacity is C
      for the call's sizes. On a mesh with sharded tokens, each token shard's capacity is
      its share, as for capacity_factor.
    layout: "ragged" (default: the routed rows as one grouped gmm of T * top_k rows) or
      "masked" (decode: the rows as ``[E, max_rows, D]`` slots, `gmm_jax.MaskedArray`,
      every shape independent of the routing, as vLLM's and DeepGEMM's masked grouped
      GEMMs; `gmm_jax._src.moe.experts.ffn_masked`). Masked runs on one device's view (plain
      jit: its gmms partition by their rule) and not with `expert_parallel` /
      `data_parallel` / `partitionable=True`. On the CPU it is 1.0-4.4x slower than the
      ragged path (benchmarks/log.md, decode-shaped calls): it is for accelerators' fixed
      decode shapes.
    max_rows: the masked layout's slots per expert (default: T, exact when each token
      picks top_k distinct experts); an expert's assignments past it give 0 and count in
      ``aux["dropped_fraction"]``, as a capacity does.
    buffer_factor: None (dropless: receive buffers sized for the worst case, every
      assignment of a token shard sent to one device) or b: under expert parallelism with
      the tokens sharded over the expert axis, each device receives at most
      ``ceil(b * T_shard * top_k / D)`` rows from each of the D devices of that axis (b = 1:
      the balanced load), so per-device memory stays flat as the mesh grows; rows past it
      give 0 and count in ``aux["dropped_fraction"]`` (MaxText's ragged buffer factor).
    partitionable: without mesh arguments, True: the routed experts are one op the
      partitioner splits from the shardings (`gmm_jax.routed_experts`; its backward
      recomputes the expert forward per device: a one-device CPU training step measured
      1.34x slower; on TPU, where no partitioner runs it, the fused gmms inline). False:
      the fused gmms inline, keeping their pre-activations for the backward: for one
      device, or inside the user's own shard_map. Either keeps the layer from pinning a
      layout of its own on a mesh with Auto axes. None (default): on a mesh with Auto axes
      in sight (`jax.set_mesh`, or x placed on one), the layer's own layout (experts over
      the axis the expert kernels' logical names map to, tokens over every mesh axis that
      divides them) through `routed_apply`; else True when jax sees more than one device
      (`jax.device_count()`, every process's) or the program is compiled for another
      platform's devices (`jax.default_device`, as a deviceless compile for a TPU or GPU
      topology does).
    transport: how rows travel under expert parallelism (`gmm_jax.routed_apply`): "auto"
      (ragged all-to-all on GPU and TPU, except TPU slices whose ICI routing libtpu's
      ragged all-to-all does not support, v5e beyond 16 chips, and CPU: all_to_all
      there), "ragged" or "all_to_all" (fixed [devices, rows] buffers).
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
      op (`gmm_jax.routed_experts`; see `partitionable`): the partitioner picks
      local routing (replicated experts), per-device experts with a psum (tokens not
      sharded over the experts' axis) or expert parallelism with all-to-all (tokens
      sharded over it too) from the shardings of the tokens and the expert kernels.
    weight_quant, input_quant: QuantSpecs for the expert projections (see GroupedLinear).
    quantization: None, "fp8", "fp8_e5m2_grads" or a `gmm_jax.Fp8Training`: fp8 training of
      the routed experts' gmms (forward and both backward gmms in fp8 with blockwise
      scales, see `gmm_jax.gmm`); the router and shared experts stay in `dtype`.
    dtype, param_dtype, implementation: as in GroupedLinear.
    kernel_metadata: metadata of every expert kernel Param (as nnx.Linear's).
    out_sharding: the output's sharding (a NamedSharding or a PartitionSpec of the context
      mesh); __call__'s argument overrides it.
    rngs: nnx.Rngs.

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

  def __init__(self, num_experts: int, embed: int, mlp: int, *, top_k: int = 2,
               activation="silu", gated: bool = True, fused: bool = True,
               score: str = "softmax", normalize_top_k: bool | None = None,
               normalize_epsilon: float = 0.0, routing_bias: bool = False,
               num_expert_groups: int | None = None, top_k_groups: int | None = None,
               group_score: str = "sum_top2", routed_scaling_factor: float = 1.0,
               sparsemixer_eps: float = 0.01,
               router_bias: bool = False, router: nnx.Module | None = None,
               load_balancing_convention: str = "gmm_jax",
               router_weight_on: str = "output", num_identity_experts: int = 0,
               num_shared_experts: int = 0,
               shared_mlp: int | None = None, shared_gate: bool = False,
               shared_scale: float = 1.0, use_bias: bool = False, output_bias: bool = False,
               swiglu_limit: float = SWIGLU_LIMIT, swiglu_alpha: float = SWIGLU_ALPHA,
               gated_prologue: bool | None = None,
               capacity_factor: float | None = None, capacity_per: str = "call",
               expert_capacity: int | None = None,
               buffer_factor: float | None = None, layout: str = "ragged",
               max_rows: int | None = None,
               partitionable: bool | None = None, transport: str = "auto",
               expert_parallel=None,
               data_parallel=None, dtype: Any = None, param_dtype: Any = jnp.float32,
               weight_quant: QuantSpec | None = None, input_quant: QuantSpec | None = None,
               quantization=None, implementation: str | None = None,
               kernel_metadata: Mapping[str, Any] | None = None, out_sharding=None,
               rngs: nnx.Rngs):
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    if capacity_factor is not None and capacity_factor <= 0:
      raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    if expert_capacity is not None:
      if (isinstance(expert_capacity, (bool, np.bool_))
          or not isinstance(expert_capacity, (int, np.integer)) or expert_capacity < 1):
        raise ValueError(f"expert_capacity must be a positive int, got {expert_capacity!r}")
      if capacity_factor is not None:
        raise ValueError(f"expert_capacity={expert_capacity} and capacity_factor="
                         f"{capacity_factor} both bound the experts' load: give one")
    if gated_prologue is not None and not isinstance(gated_prologue, (bool, np.bool_)):
      raise ValueError(f"gated_prologue must be None (the platform's choice), True or False, "
                       f"got {gated_prologue!r}")
    check_options(activation, gated, router_weight_on=router_weight_on,
                  swiglu_limit=swiglu_limit, swiglu_alpha=swiglu_alpha)
    if capacity_per not in CAPACITY_PER:
      raise ValueError(f"capacity_per must be one of {CAPACITY_PER}, got {capacity_per!r}")
    if shared_gate and not num_shared_experts:
      raise ValueError("shared_gate=True gates the shared experts: it needs "
                       "num_shared_experts >= 1")
    if shared_scale != 1.0 and not num_shared_experts:
      raise ValueError(f"shared_scale={shared_scale} scales the shared experts: it needs "
                       f"num_shared_experts >= 1")
    if layout not in LAYOUTS:
      raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if max_rows is not None and (layout != "masked" or not isinstance(max_rows, int)
                                 or max_rows < 1):
      raise ValueError(f"max_rows is a positive int for layout='masked', got {max_rows!r} "
                       f"with layout={layout!r}")
    if layout == "masked" and (expert_parallel is not None or data_parallel is not None
                               or partitionable):
      raise NotImplementedError(
          "layout='masked' runs on one device's view (plain jit partitions its gmms); "
          "expert_parallel, data_parallel and partitionable=True need layout='ragged'")
    if buffer_factor is not None and buffer_factor <= 0:
      raise ValueError(f"buffer_factor must be positive, got {buffer_factor}")
    if not isinstance(num_identity_experts, int) or num_identity_experts < 0:
      raise ValueError(f"num_identity_experts must be an int >= 0, got "
                       f"{num_identity_experts!r}")
    if num_identity_experts and (capacity_factor is not None or expert_capacity is not None
                                 or router is not None):
      raise NotImplementedError("num_identity_experts with capacity_factor, expert_capacity "
                                "or a replacement router")
    if transport not in experts.TRANSPORTS:
      raise ValueError(f"transport must be one of {experts.TRANSPORTS}, got {transport!r}")
    router_options = dict(score=score, normalize_top_k=normalize_top_k,
                          normalize_epsilon=normalize_epsilon,
                          routing_bias=routing_bias, num_expert_groups=num_expert_groups,
                          top_k_groups=top_k_groups, group_score=group_score,
                          sparsemixer_eps=sparsemixer_eps,
                          routed_scaling_factor=routed_scaling_factor,
                          router_bias=router_bias,
                          load_balancing_convention=load_balancing_convention)
    if router is None:
      options = dict(router_options)
      router = Router(embed, num_experts + num_identity_experts, top_k=top_k,
                      use_bias=options.pop("router_bias"),
                      param_dtype=param_dtype, rngs=rngs, **options)
    else:
      changed = sorted(k for k, v in router_options.items() if v != _ROUTER_DEFAULTS[k])
      if changed:
        raise ValueError(f"router= replaces the built-in router: its options {changed} "
                         "do not apply (give them to the router)")
      if not callable(getattr(router, "route", None)):
        raise ValueError(f"router must have a route(tokens) -> Routing method, got "
                         f"{type(router).__name__}")
    self.num_experts, self.embed, self.mlp, self.top_k = num_experts, embed, mlp, top_k
    self.activation, self.gated, self.fused = activation, gated, fused
    self.num_identity_experts = num_identity_experts
    self.gated_prologue = None if gated_prologue is None else bool(gated_prologue)
    self.router_weight_on = router_weight_on
    self.swiglu_limit, self.swiglu_alpha = float(swiglu_limit), float(swiglu_alpha)
    self.capacity_factor, self.buffer_factor = capacity_factor, buffer_factor
    self.capacity_per = capacity_per
    self.expert_capacity = None if expert_capacity is None else int(expert_capacity)
    self.shared_scale = float(shared_scale)
    self.layout, self.max_rows = layout, max_rows
    self.partitionable, self.transport = partitionable, transport
    self.expert_parallel, self.data_parallel = expert_parallel, data_parallel
    self.dtype, self.out_sharding = dtype, out_sharding

    self.router = router
    self.gate_up, self.up, self.down = expert_layers(
        num_experts, embed, mlp, gated=gated, use_bias=use_bias, dtype=dtype,
        param_dtype=param_dtype, weight_quant=weight_quant, input_quant=input_quant,
        quantization=quantization,
        implementation=implementation, kernel_metadata=kernel_metadata, rngs=rngs)
    self.output_bias = (param(jnp.zeros((embed,), param_dtype), ("embed",)) if output_bias
                        else None)
    shared_mlp = shared_mlp or mlp * num_shared_experts
    self.shared = SharedExperts(embed, shared_mlp, gated=gated, activation=activation,
                                gate=shared_gate, swiglu_limit=swiglu_limit,
                                swiglu_alpha=swiglu_alpha, dtype=dtype,
                                param_dtype=param_dtype,
                                rngs=rngs) if num_shared_experts else None

  @classmethod
  def from_preset(cls, name: str, *, rngs: nnx.Rngs, scale: float = 1.0, **overrides):
    """An MoE layer shaped as `MOE_PRESETS[name]`; `scale` multiplies the widths (embed,
    mlp, shared_mlp; multiples of 8, at least 8) to shrink it for tests; `overrides`
    replace any argument."""
    kwargs = scaled(name, scale)
    kwargs.update(overrides)
    return cls(kwargs.pop("num_experts"), kwargs.pop("embed"), kwargs.pop("mlp"), rngs=rngs,
               **kwargs)

  # ------------------------------------------------------------------------- routing
  # The built-in router's settings, read through the layer (None for a replacement
  # router without them).

  @property
  def score(self):
    return getattr(self.router, "score", None)

  @property
  def normalize_top_k(self):
    return getattr(self.router, "normalize_top_k", None)

  @property
  def normalize_epsilon(self):
    return getattr(self.router, "normalize_epsilon", None)

  @property
  def num_expert_groups(self):
    return getattr(self.router, "num_expert_groups", None)

  @property
  def top_k_groups(self):
    return getattr(self.router, "top_k_groups", None)

  @property
  def group_score(self):
    return getattr(self.router, "group_score", None)

  @property
  def routed_scaling_factor(self):
    return getattr(self.router, "routed_scaling_factor", None)

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
