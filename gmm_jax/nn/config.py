"""`MoEConfig`: every option of an `MoE` layer in one frozen dataclass, checked when it is
built, so that a config is valid once it exists (`MoE(config=...)`, the presets,
``dataclasses.replace`` for a variant)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from gmm_jax import Fp8Training, QuantSpec
from gmm_jax.nn.expert_ffn import check_options
from gmm_jax.nn.router import check_router_options
from gmm_jax._src.core.epilogue import SWIGLU_ALPHA, SWIGLU_LIMIT
from gmm_jax._src.moe import routing

CAPACITY_PER = ("call", "sequence")
LAYOUTS = ("ragged", "masked")
# The options of the built-in `Router` (router_bias is its use_bias): a replacement router
# takes none of them, so they must keep their defaults beside one.
ROUTER_OPTIONS = ("score", "normalize_top_k", "normalize_epsilon", "routing_bias",
                  "num_expert_groups", "top_k_groups", "group_score", "sparsemixer_eps",
                  "routed_scaling_factor", "router_bias", "load_balancing_convention")
# Raised by the config for the options it holds and by `MoE` for its mesh arguments and a
# replacement router: one message either way.
MASKED_NEEDS_ONE_DEVICE = (
    "layout='masked' runs on one device's view (plain jit partitions its gmms); "
    "expert_parallel, data_parallel and partitionable=True need layout='ragged'")
IDENTITY_EXPERTS_ALONE = ("num_identity_experts with capacity_factor, expert_capacity or a "
                          "replacement router")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
  """The options of an `MoE` layer (``MoE(config=MoEConfig(...), rngs=...)``, or the same
  options as `MoE`'s keywords). Frozen and checked when built: the ValueError (or
  NotImplementedError, for a valid but unsupported combination) comes from the config, and
  ``dataclasses.replace(config, ...)`` checks the variant again.

  Not options, so not fields: the objects a layer is built with or placed by, which `MoE`
  takes beside the config: ``rngs``; ``router`` (a replacement router is an nnx.Module
  with parameters: state, not an option; the router fields below configure the built-in
  one and keep their defaults beside it); ``expert_parallel`` / ``data_parallel`` (they
  hold a mesh: one config serves any mesh); ``out_sharding`` (a placement of the output,
  often on a mesh) and ``kernel_metadata`` (the expert kernels' Param metadata, their
  sharding names among it: a mapping, which would keep the config from being hashed as the
  layer's static data).

  The layer's shape.

  Fields:
    num_experts, embed, mlp: E, the model width D, the expert FFN width F (positional, the
      rest are keywords).
    top_k: experts per token.

  The routed experts' FFN.

  Fields:
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
    fused: the fused path (`MoE`) or the unfused baseline.
    gated_prologue: fused and gated: the down projection reads the gate|up
      pre-activation through its gated prologue, and its input gradient (the ``[R, 2F]``
      cotangent of the pre-activation) comes from one gmm. None (default): where the
      platform's kernels do both natively (TPU), else not; True/False force it
      (`gmm_jax.ExpertFFN`, with the measurements).
    use_bias: expert biases ``[E, 2F]`` (or ``[E, F]``) and ``[E, D]`` (gpt-oss).
    output_bias: a learned ``[D]`` bias (zeros at first, ``output_bias``) added to every
      token's output, after the routed and shared experts (JetMoE's MoE ``bias``).

  The built-in router (`Router`; with a replacement router these keep their defaults).

  Fields:
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
    load_balancing_convention: the scale of ``aux["load_balancing_loss"]`` (`Router`):
      "gmm_jax" (default): Switch's ``E * sum_e f_e * P_e`` with f_e the fraction of the
      T*k assignments that chose e and P_e the mean score of e: 1 when balanced.
      "transformers": their ``load_balancing_loss_func``, ``E * sum_e (c_e / T) *
      mean_t softmax(logits)_te`` with c_e the tokens whose top-k of the softmax holds e:
      top_k times the former for softmax routers, so that their ``router_aux_loss_coef``
      carries over.

  What the router's choice does.

  Fields:
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

  The shared experts.

  Fields:
    num_shared_experts, shared_mlp: shared experts, one dense FFN of width ``shared_mlp``
      (default ``mlp * num_shared_experts``) applied to every token, gated like the experts.
    shared_gate: the shared experts' output times ``sigmoid(x @ shared.gate.kernel)``, a
      learned ``[D, 1]`` kernel (Qwen2-MoE's and Qwen3-Next's ``shared_expert_gate``);
      needs num_shared_experts >= 1.
    shared_scale: multiplies the shared experts' output (Cohere2-MoE's "average"
      combination ``(routed + shared) / 2`` is 0.5 with ``routed_scaling_factor=0.5``);
      other than 1 it needs num_shared_experts >= 1.

  Capacity and the layout of the routed rows.

  Fields:
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
      ragged path (BENCHMARKS.md, decode-shaped calls): it is for accelerators' fixed
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

  How the routed experts run on devices (the mesh itself is `MoE`'s ``expert_parallel`` /
  ``data_parallel``).

  Fields:
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

  Numerics.

  Fields:
    dtype, param_dtype, implementation: as in GroupedLinear.
    weight_quant, input_quant: QuantSpecs for the expert projections (see GroupedLinear).
    quantization: None, "fp8", "fp8_e5m2_grads" or a `gmm_jax.Fp8Training`: fp8 training of
      the routed experts' gmms (forward and both backward gmms in fp8 with blockwise
      scales, see `gmm_jax.gmm`); the router and shared experts stay in `dtype`.
  """

  num_experts: int
  embed: int
  mlp: int
  _: dataclasses.KW_ONLY
  top_k: int = 2
  # The routed experts' FFN.
  activation: str | Callable[..., Any] = "silu"
  swiglu_limit: float = SWIGLU_LIMIT
  swiglu_alpha: float = SWIGLU_ALPHA
  gated: bool = True
  fused: bool = True
  gated_prologue: bool | None = None
  use_bias: bool = False
  output_bias: bool = False
  # The built-in router.
  score: str = "softmax"
  sparsemixer_eps: float = 0.01
  normalize_top_k: bool | None = None
  normalize_epsilon: float = 0.0
  routing_bias: bool = False
  num_expert_groups: int | None = None
  top_k_groups: int | None = None
  group_score: str = "sum_top2"
  routed_scaling_factor: float = 1.0
  router_bias: bool = False
  load_balancing_convention: str = "gmm_jax"
  # What the router's choice does.
  router_weight_on: str = "output"
  num_identity_experts: int = 0
  # The shared experts.
  num_shared_experts: int = 0
  shared_mlp: int | None = None
  shared_gate: bool = False
  shared_scale: float = 1.0
  # Capacity and the layout of the routed rows.
  capacity_factor: float | None = None
  capacity_per: str = "call"
  expert_capacity: int | None = None
  layout: str = "ragged"
  max_rows: int | None = None
  buffer_factor: float | None = None
  # How the routed experts run on devices.
  partitionable: bool | None = None
  transport: str = "auto"
  # Numerics.
  dtype: Any = None
  param_dtype: Any = jnp.float32
  weight_quant: QuantSpec | None = None
  input_quant: QuantSpec | None = None
  quantization: str | Fp8Training | None = None
  implementation: str | None = None

  def __post_init__(self):
    num_experts, top_k = self.num_experts, self.top_k
    if not 1 <= top_k <= num_experts:
      raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
    capacity_factor, expert_capacity = self.capacity_factor, self.expert_capacity
    if capacity_factor is not None and capacity_factor <= 0:
      raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    if expert_capacity is not None:
      if (isinstance(expert_capacity, (bool, np.bool_))
          or not isinstance(expert_capacity, (int, np.integer)) or expert_capacity < 1):
        raise ValueError(f"expert_capacity must be a positive int, got {expert_capacity!r}")
      if capacity_factor is not None:
        raise ValueError(f"expert_capacity={expert_capacity} and capacity_factor="
                         f"{capacity_factor} both bound the experts' load: give one")
    if self.gated_prologue is not None and not isinstance(self.gated_prologue,
                                                          (bool, np.bool_)):
      raise ValueError(f"gated_prologue must be None (the platform's choice), True or False, "
                       f"got {self.gated_prologue!r}")
    check_options(self.activation, self.gated, router_weight_on=self.router_weight_on,
                  swiglu_limit=self.swiglu_limit, swiglu_alpha=self.swiglu_alpha)
    if self.capacity_per not in CAPACITY_PER:
      raise ValueError(f"capacity_per must be one of {CAPACITY_PER}, got "
                       f"{self.capacity_per!r}")
    if self.shared_gate and not self.num_shared_experts:
      raise ValueError("shared_gate=True gates the shared experts: it needs "
                       "num_shared_experts >= 1")
    if self.shared_scale != 1.0 and not self.num_shared_experts:
      raise ValueError(f"shared_scale={self.shared_scale} scales the shared experts: it "
                       f"needs num_shared_experts >= 1")
    layout, max_rows = self.layout, self.max_rows
    if layout not in LAYOUTS:
      raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if max_rows is not None and (layout != "masked" or not isinstance(max_rows, int)
                                 or max_rows < 1):
      raise ValueError(f"max_rows is a positive int for layout='masked', got {max_rows!r} "
                       f"with layout={layout!r}")
    if layout == "masked" and self.partitionable:
      raise NotImplementedError(MASKED_NEEDS_ONE_DEVICE)
    if self.buffer_factor is not None and self.buffer_factor <= 0:
      raise ValueError(f"buffer_factor must be positive, got {self.buffer_factor}")
    identity = self.num_identity_experts
    if not isinstance(identity, int) or identity < 0:
      raise ValueError(f"num_identity_experts must be an int >= 0, got {identity!r}")
    if identity and (capacity_factor is not None or expert_capacity is not None):
      raise NotImplementedError(IDENTITY_EXPERTS_ALONE)
    if self.transport not in routing.TRANSPORTS:
      raise ValueError(f"transport must be one of {routing.TRANSPORTS}, got "
                       f"{self.transport!r}")
    # The built-in router scores the identity experts too.
    check_router_options(num_experts + identity, top_k, score=self.score,
                         normalize_top_k=self.normalize_top_k,
                         routing_bias=self.routing_bias,
                         num_expert_groups=self.num_expert_groups,
                         top_k_groups=self.top_k_groups, group_score=self.group_score,
                         load_balancing_convention=self.load_balancing_convention,
                         normalize_epsilon=self.normalize_epsilon,
                         sparsemixer_eps=self.sparsemixer_eps)

  def changed_router_options(self) -> list[str]:
    """The built-in router's options (`ROUTER_OPTIONS`) this config sets to other than
    their defaults, sorted: none may be set beside a replacement router."""
    defaults = {field.name: field.default for field in dataclasses.fields(self)}
    return sorted(name for name in ROUTER_OPTIONS
                  if getattr(self, name) != defaults[name])

  def keywords(self) -> dict[str, Any]:
    """The config as `MoE`'s keyword arguments (every field, by name): ``MoE(**kw,
    rngs=...)`` builds the layer ``MoE(config=self, rngs=...)`` does."""
    return {field.name: getattr(self, field.name) for field in dataclasses.fields(self)}
