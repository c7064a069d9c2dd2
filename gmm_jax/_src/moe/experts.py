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

Floor 6: built on the public API (`gmm`, `route`) and the routing transports.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from gmm_jax._src.api import gmm
from gmm_jax._src.backends import registry as dispatch
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.backends.registry import mesh_platform, on_lowering_platform
from gmm_jax._src.core.grouped_array import from_ragged, to_ragged
from gmm_jax._src.core.epilogue import (GATED_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT, gather_rows,
                                    swiglu_clamped)
from gmm_jax._src.op.primitive import (PREACTIVATION, explicit_axes, explicit_mesh,
                                       typed_spec)
from gmm_jax._src.sharding.spec import reshard
from gmm_jax._src.moe import routing
from gmm_jax._src.moe.routing import route

# The gated activation of each plain one: ``act(gate) * up`` on a [.., 2F] product.
GATED_NAMES = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh",
               **{name: name for name in GATED_ACTIVATIONS}}
# What the fused expert FFN keeps for its backward: the gmms' pre-activations.
FFN_POLICY = jax.checkpoint_policies.save_only_these_names(PREACTIVATION)
STRATEGIES = ("local", "experts", "travel")
TRANSPORTS = routing.TRANSPORTS
WEIGHT_ON = ("output", "input")


def gated_activation(activation, *, swiglu_limit: float = SWIGLU_LIMIT,
                     swiglu_alpha: float = SWIGLU_ALPHA) -> Callable:
  """A gated FFN's activation ``[..., 2F] -> [..., F]`` (gate half first) in jnp: a plain
  name of `GATED_NAMES` ("swiglu_clamped" with its clamp limit and alpha) or a callable on
  the gate half (``act(gate) * up``)."""
  if callable(activation):
    def gated(z):
      half = z.shape[-1] // 2
      return activation(z[..., :half]) * z[..., half:]
    return gated
  if activation == "swiglu_clamped":
    return swiglu_clamped(swiglu_limit, swiglu_alpha)
  return GATED_ACTIVATIONS[GATED_NAMES[activation]]


@dataclasses.dataclass(frozen=True)
class ExpertFFN:
  """The static description of the experts' FFN (hashable: a partitioning rule's param).

  Fields:
    num_experts: E.
    activation: a gated activation's plain name ("silu", ...) or a callable on the gate
      half (gated), or a name of `gmm_jax.ACTIVATIONS` or a callable (plain).
    gated: ``w_in`` is ``[E, D, 2F]`` [gate | up] (else ``[E, D, F]``).
    fused: gate and up as one gmm with the gated activation, tokens read by index (else
      the unfused baseline: sorted copies, gate and up as two gmms).
    options: the gmm keyword options (``implementation``, ``precision``, quantization...)
      as sorted (name, value) pairs.
    weight_on: "output": each assignment's result times its router weight (``w *
      ffn(x)``); "input": the expert's input row times it (``ffn(w * x)``, Llama 4).
    swiglu_limit, swiglu_alpha: the clamped SwiGLU's constants ("swiglu_clamped"). The
      gmm's epilogue (and every kernel's) has the defaults; other values run the gated
      activation after the gmm, in jnp (`epilogue.swiglu_clamped`).
    gated_prologue: fused and gated (a named activation the gmms know): True: the gate|up
      gmm writes the pre-activation z ``[R, 2F]`` and the down gmm reads it through its
      gated prologue (``lhs_activation``), so that the backward's dlhs gmm of the down
      projection writes z's cotangent itself (no ``[R, F]`` cotangent of the activation,
      its f32 copy or the halves beside it; on TPU it runs after the down weights'
      gradient, so z dies there). False: the gate|up gmm applies the activation in its
      epilogue and the down gmm reads h ``[R, F]`` (half the bytes between the two
      gmms). None (default): True where the
      kernels the two gmms try first on the platform being traced for do the prologue and
      the cotangent epilogue natively (`prologue_is_native`: Pallas TPU), else False: on
      TPU v5e the one-chip bench step's temporaries are 90 MB against 191 MB, Mixtral's
      expert-parallel step on 4 chips 1.55 against 2.24 GiB; on GPU and CPU, where
      act(z) and the cotangent are formed around the kernels, neither wins everywhere
      (benchmarks/log.md, "The gated prologue by default where the kernels fuse it").
      Quantized down weights (or a quantization option) take the False path. Gradients
      are equal for an equal cotangent; the forward differs by one rounding (True rounds z
      to the output dtype before the activation, as every backward recomputes it).
  """

  num_experts: int
  activation: Any
  gated: bool
  fused: bool = True
  options: tuple[tuple[str, Any], ...] = ()
  weight_on: str = "output"
  swiglu_limit: float = SWIGLU_LIMIT
  swiglu_alpha: float = SWIGLU_ALPHA
  gated_prologue: bool | None = None

  def __post_init__(self):
    if self.gated_prologue is not None and not isinstance(self.gated_prologue,
                                                          (bool, np.bool_)):
      raise ValueError(f"gated_prologue must be None (the platform's choice), True or False, "
                       f"got {self.gated_prologue!r}")
    if self.gated_prologue is not None:
      object.__setattr__(self, "gated_prologue", bool(self.gated_prologue))

  @property
  def gmm_options(self) -> dict[str, Any]:
    return dict(self.options)

  @property
  def epilogue_activation(self):
    """The activation the gate|up gmm applies in its epilogue, or None when `after_gmm`
    applies it (a user's callable gate, clamped SwiGLU constants the kernels lack)."""
    if not self.gated:
      return self.activation
    if self.after_gmm is not None:
      return None
    return GATED_NAMES[self.activation]

  @property
  def after_gmm(self) -> Callable | None:
    """The gated activation applied to the gate|up gmm's ``[R, 2F]`` result in jnp, or
    None when the gmm's epilogue applies it."""
    if not self.gated:
      return None
    if callable(self.activation) or (
        self.activation == "swiglu_clamped"
        and (self.swiglu_limit, self.swiglu_alpha) != (SWIGLU_LIMIT, SWIGLU_ALPHA)):
      return gated_activation(self.activation, swiglu_limit=self.swiglu_limit,
                              swiglu_alpha=self.swiglu_alpha)
    return None


def _prologue(spec: ExpertFFN, w_down) -> str | None:
  """The gated activation the down gmm applies in its prologue (`ExpertFFN.gated_prologue`),
  or None when the gate|up gmm applies it."""
  name = spec.epilogue_activation
  if not (spec.gated and spec.fused and spec.gated_prologue is not False and name is not None):
    return None
  options = spec.gmm_options
  quantized = any(options.get(key) is not None
                  for key in ("quantization", "quantize_lhs", "quantize_rhs"))
  if quantized or not isinstance(w_down, (jax.Array, np.ndarray)) or not jnp.issubdtype(
      w_down.dtype, jnp.floating):
    return None
  if spec.gated_prologue is None and not prologue_is_native(name, options):
    return None
  return name


def prologue_is_native(name: str, options: dict[str, Any]) -> bool:
  """Whether the gmms of a gated prologue (`ExpertFFN.gated_prologue`) run natively where
  this is traced for: the kernel the forward's down gmm tries first applies act(z) in its
  prologue (``"gated_lhs"``) and the one its backward's dlhs gmm tries first writes z's
  cotangent in its epilogue (``"gated_cotangent"``). Pallas TPU does both; elsewhere
  act(z) and the cotangent would be formed around the kernels (benchmarks/log.md, "The gated
  prologue by default where the kernels fuse it")."""
  platform = options.get("platform") or dispatch.trace_platform()
  platform = dispatch.normalize_platform(platform)
  chosen = dispatch.check_implementation(options.get("implementation"))
  forward = GmmConfig(group_type="m", num_local=1, lhs_activation=name, implementation=chosen)
  dlhs = GmmConfig(group_type="m", num_local=1, cotangent_of=name, transpose_rhs=True,
                   implementation=chosen)
  return ("gated_lhs" in dispatch.native_features(forward, platform)
          and "gated_cotangent" in dispatch.native_features(dlhs, platform))


def _input_weighted(rows, weights):
  """Rows times their router weights (``weight_on="input"``), in f32, in the rows' dtype."""
  return (rows.astype(jnp.float32) * weights.astype(jnp.float32)[:, None]).astype(rows.dtype)


def ffn_rows(spec: ExpertFFN, rows, sizes, params):
  """The expert FFN on expert-contiguous rows (rows past ``sum(sizes)`` give 0):
  ``down(act(rows @ w_in + b_in))``; `params` a dict of w_in, w_down (b_in, b_down)."""
  options = spec.gmm_options
  w_in, w_down = params["w_in"], params["w_down"]
  b_in, b_down = params.get("b_in"), params.get("b_down")
  prologue = _prologue(spec, w_down)
  if prologue is not None:  # z [R, 2F]; the down gmm applies the activation
    h = checkpoint_name(gmm(rows, w_in, sizes, bias=b_in, **options), PREACTIVATION)
  elif not spec.gated or spec.fused:
    h = gmm(rows, w_in, sizes, bias=b_in, activation=spec.epilogue_activation, **options)
    if spec.after_gmm is not None:  # the gated activation the epilogue cannot apply
      h = spec.after_gmm(h)
  else:
    half = w_in.shape[-1] // 2
    gate = gmm(rows, w_in[..., :half], sizes, bias=None if b_in is None else b_in[..., :half],
               **options)
    up = gmm(rows, w_in[..., half:], sizes, bias=None if b_in is None else b_in[..., half:],
             **options)
    h = gated_activation(spec.activation, swiglu_limit=spec.swiglu_limit,
                         swiglu_alpha=spec.swiglu_alpha)(jnp.concatenate([gate, up], axis=-1))
  return gmm(h.astype(rows.dtype), w_down, sizes, bias=b_down, lhs_activation=prologue,
             **options)


def ffn_routed(spec: ExpertFFN, x, top_e, top_p, params, *, capacity=None):
  """The fused expert FFN on unsorted tokens: `route` -> one gmm reading the tokens by
  index (gate|up with the gated activation) -> one gmm weighting each row by its router
  weight and writing it to its (token, k) slot -> each token's slots summed. Experts are
  the leading dim of `params` (ids outside it are no assignment). No sorted copy of x
  (with ``weight_on="input"``: the gathered rows, weighted, are one).
  Returns (y ``[T, D]`` f32, kept ``[T, k]`` bool)."""

  def body(x, top_e, top_p, params):
    num_local = params["w_in"].shape[0]
    options = spec.gmm_options
    r = route(top_e, num_local, weights=top_p, capacity=capacity)
    w_in, w_down = params["w_in"], params["w_down"]
    b_in, b_down = params.get("b_in"), params.get("b_down")
    sizes = r.group_sizes
    if spec.weight_on == "input":
      # The gmm's row weights scale its results; these scale its input rows.
      rows = dict(lhs=_input_weighted(gather_rows(x, r.lhs_indices), r.row_weights))
      out_weights = None
    else:
      rows = dict(lhs=x, lhs_indices=r.lhs_indices)
      out_weights = r.row_weights
    prologue = _prologue(spec, w_down)
    if prologue is not None:  # z [R, 2F]; the down gmm applies the activation
      h = checkpoint_name(gmm(rows.pop("lhs"), w_in, sizes, bias=b_in, **rows, **options),
                          PREACTIVATION)
    else:
      h = gmm(rows.pop("lhs"), w_in, sizes, bias=b_in, activation=spec.epilogue_activation,
              **rows, **options)
      if spec.after_gmm is not None:  # the gated activation the epilogue cannot apply
        h = spec.after_gmm(h)
    y = gmm(h.astype(x.dtype), w_down, sizes, bias=b_down, row_weights=out_weights,
            out_indices=r.out_indices, out_rows=r.num_slots, lhs_activation=prologue,
            **options)
    return r.combine(y).astype(jnp.float32), r.kept

  # Keeps only the two gmms' pre-activations for a backward; the routing and the rows
  # between the gmms are recomputed.
  return jax.checkpoint(body, policy=FFN_POLICY)(x, top_e, top_p, params)


def ffn_masked(spec: ExpertFFN, x, top_e, top_p, params, *, max_rows: int,
               capacity=None):
  """The expert FFN in the masked layout (decode): `route` -> the routed rows as
  ``[E, max_rows, D]`` slots (`from_ragged`) -> the gate|up gmm and the down gmm on the
  masked form (the router weights as the down gmm's ``row_weights [E, max_rows]``, or on
  the input rows with ``weight_on="input"``) -> `to_ragged`, each row to its (token, k)
  slot, each token's slots summed. Every shape depends on (T, E, max_rows) only, whatever
  the routing. Each expert takes at most ``min(max_rows, capacity)`` assignments (earlier
  tokens first); the rest give 0 and count as dropped. The gate and up halves are one gmm
  (the gated activation in its epilogue) whatever ``spec.fused`` says.
  Returns (y ``[T, D]`` f32, kept ``[T, k]`` bool)."""
  if not isinstance(max_rows, int) or max_rows < 1:
    raise ValueError(f"max_rows must be a positive int, got {max_rows!r}")
  num_local = params["w_in"].shape[0]
  options = spec.gmm_options
  limit = max_rows if capacity is None else min(max_rows, capacity)
  r = route(top_e, num_local, weights=top_p, capacity=limit)
  w_in, w_down = params["w_in"], params["w_down"]
  b_in, b_down = params.get("b_in"), params.get("b_down")
  rows = gather_rows(x, r.lhs_indices)
  out_weights = None
  if spec.weight_on == "input":
    rows = _input_weighted(rows, r.row_weights)
  else:
    out_weights = from_ragged(r.row_weights[:, None], r.group_sizes, max_rows).values[..., 0]
  masked = from_ragged(rows, r.group_sizes, max_rows)
  h = gmm(masked, w_in, bias=b_in, activation=spec.epilogue_activation, **options)
  values = h.values
  if spec.after_gmm is not None:  # the gated activation the epilogue cannot apply
    values = spec.after_gmm(values)
  h = type(h)(values.astype(x.dtype), h.counts, h.num_rows)
  y = gmm(h, w_down, bias=b_down, row_weights=out_weights, **options)
  y_rows, _ = to_ragged(y, r.num_rows)
  slots = jnp.zeros((r.num_slots, y_rows.shape[-1]), y_rows.dtype)
  slots = slots.at[r.out_indices].set(y_rows, mode="drop")
  return r.combine(slots).astype(jnp.float32), r.kept


def ffn_sorted(spec: ExpertFFN, x, top_e, top_p, params, *, capacity=None):
  """The unfused baseline: each assignment's row copied, sorted by expert, `ffn_rows`,
  unsorted, weighted and summed over k. Returns (y ``[T, D]`` f32, kept)."""
  num_tokens, k = top_e.shape
  num_local = params["w_in"].shape[0]
  flat_e, flat_p = top_e.reshape(-1), top_p.reshape(-1)
  copies = jnp.broadcast_to(x[:, None, :], (num_tokens, k, x.shape[-1])).reshape(
      num_tokens * k, x.shape[-1])
  valid = (flat_e >= 0) & (flat_e < num_local)
  key = jnp.where(valid, flat_e, num_local)
  if capacity is not None:
    hot = jax.nn.one_hot(key, num_local, dtype=jnp.int32)
    rank = jnp.sum((jnp.cumsum(hot, axis=0) - 1) * hot, axis=-1)
    valid = valid & (rank < capacity)
    key = jnp.where(valid, key, num_local)
  order = jnp.argsort(key, stable=True)
  sizes = jnp.bincount(key, length=num_local + 1)[:num_local].astype(jnp.int32)
  rows, out_p = weighted_rows(spec, copies, jnp.where(valid, flat_p, 0), valid)
  y_sorted = ffn_rows(spec, routing.permute_rows(rows, order), sizes, params)
  out = routing.unpermute_rows(y_sorted, order)
  weighted = (out.astype(jnp.float32).reshape(num_tokens, k, -1)
              * out_p.reshape(num_tokens, k, 1).astype(jnp.float32))
  return jnp.sum(weighted, axis=1), valid.reshape(num_tokens, k)


def weighted_rows(spec: ExpertFFN, rows, weights, kept):
  """Assignment rows ``[A, D]`` with their router weights ``[A]`` (0 where dropped) and
  kept mask ``[A]``, as the sorted paths feed them: (the expert input rows, what each
  result row is multiplied by): ``(rows, weights)`` for ``weight_on="output"``,
  ``(weights * rows, kept)`` for "input" (a dropped row's result, ffn(0), is not 0 with
  biases: the mask removes it)."""
  if spec.weight_on == "input":
    return _input_weighted(rows, weights), kept.astype(jnp.float32)
  return rows, weights


# ----------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one call splits: the mesh axes of the tokens and of the experts, and the strategy
  (see the module docstring). Static."""

  token_axes: tuple[str, ...] = ()
  expert_axes: tuple[str, ...] = ()
  token_shards: int = 1
  expert_shards: int = 1
  platform: str | None = None  # the mesh's devices' (None: every branch traced)
  mesh: Any = None  # the partitioner's mesh (its devices' kind picks the transport)

  @property
  def strategy(self) -> str:
    if not self.expert_axes:
      return "local"
    return "travel" if set(self.expert_axes) <= set(self.token_axes) else "experts"

  @property
  def weight_sum_axes(self) -> tuple[str, ...]:
    """The axes a weight gradient is summed over: tokens split there, weights not."""
    return tuple(a for a in self.token_axes if a not in self.expert_axes)


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


def _axes(entry) -> tuple[str, ...]:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _spec_entry(shape, dim: int):
  spec = getattr(getattr(shape, "sharding", None), "spec", None) or ()
  return _axes(spec[dim]) if len(spec) > dim else ()


def choose_layout(mesh_shape: dict[str, int], x_shape, token_axes, expert_axes,
                  num_experts: int) -> tuple[Layout, tuple[str, ...]]:
  """The layout for tokens sharded over `token_axes` and expert weights over `expert_axes`
  (as they arrive), with the notes of what was changed: axes that do not divide the tokens
  or the experts are dropped (those operands are gathered along them); an expert axis that
  shares only part of the token axes is kept (`experts` over the rest, tokens gathered)."""
  notes = []
  token_axes = tuple(a for a in token_axes if mesh_shape.get(a, 1) > 1)
  expert_axes = tuple(a for a in expert_axes if mesh_shape.get(a, 1) > 1)
  tokens = math.prod(mesh_shape[a] for a in token_axes)
  if tokens > 1 and x_shape[0] % tokens:
    notes.append(f"{x_shape[0]} tokens do not split over {token_axes}: gathered")
    token_axes, tokens = (), 1
  experts = math.prod(mesh_shape[a] for a in expert_axes)
  if experts > 1 and num_experts % experts:
    notes.append(f"{num_experts} experts do not split over {expert_axes}: gathered")
    expert_axes, experts = (), 1
  if len(expert_axes) > 1 and set(expert_axes) <= set(token_axes):
    # The transports move rows over one axis: experts over several are gathered.
    notes.append(f"experts over several axes {expert_axes} with tokens there too: gathered")
    expert_axes, experts = (), 1
  if expert_axes and not set(expert_axes) <= set(token_axes) and set(expert_axes) & set(
      token_axes):
    notes.append(f"tokens over {token_axes} and experts over {expert_axes} overlap "
                 "partly: tokens gathered along the shared axes")
    token_axes = tuple(a for a in token_axes if a not in expert_axes)
    tokens = math.prod(mesh_shape[a] for a in token_axes)
  return Layout(token_axes, expert_axes, tokens, experts), tuple(notes)


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
    rows = _input_weighted(rows, flat_p)
  per_pair = num_tokens * k  # the worst case: every row to one device
  if static.buffer_factor is not None:
    per_pair = max(1, min(per_pair, math.ceil(static.buffer_factor * num_tokens * k
                                              / num_devices)))
  options = dict(axis=axis, num_devices=num_devices, local_experts=local_experts,
                 capacity=per_pair)
  if per_pair < num_tokens * k:
    # The transports send each device's first `per_pair` rows (in expert order) to each
    # destination and give the rest 0: those are dropped.
    order = jnp.argsort(ids, stable=True)
    dest = ids[order] // local_experts
    counts = jnp.bincount(dest, length=num_devices)
    rank = jnp.arange(ids.shape[0]) - (jnp.cumsum(counts) - counts)[dest]
    valid = valid & jnp.zeros_like(valid).at[order].set(rank < per_pair)

  def compute(recv, recv_ids):
    order = jnp.argsort(recv_ids, stable=True)
    sizes = jnp.bincount(recv_ids, length=local_experts + 1)[:local_experts]
    y = ffn_rows(spec, routing.permute_rows(recv, order), sizes.astype(jnp.int32), params)
    return routing.unpermute_rows(y, order)

  def run(platform, rows, ids):
    kind = routing.transport_for(static.transport, platform, layout.mesh)
    if kind == "all_to_all":
      return routing._route_dense(rows, ids, compute=compute, **options)
    collective = (jax.lax.ragged_all_to_all if platform in ("gpu", "tpu")
                  else routing._emulated_ragged_all_to_all)
    return routing._route_ragged(rows, ids, compute=compute, collective=collective,
                                 **options)

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
  token_axes = _spec_entry(x_shape, 0)
  expert_axes = _spec_entry(weights[0], 0) if weights else ()
  layout, notes = choose_layout(dict(mesh.shape), x_shape.shape, token_axes, expert_axes,
                                static.ffn.num_experts)
  # The partitioner's mesh has the target's devices: the transports trace their branch only.
  return dataclasses.replace(layout, platform=mesh_platform(mesh), mesh=mesh), notes


def _operand_shardings(static: Static, layout: Layout, mesh, arg_shapes):
  tokens = P(_entry(layout.token_axes))
  experts = _entry(layout.expert_axes)
  specs = [tokens, tokens, tokens]
  for shape in arg_shapes[3:3 + static.params_tree.num_leaves]:
    lead = experts if shape.shape and shape.shape[0] == static.ffn.num_experts else None
    specs.append(P(lead))
  specs += [tokens] * (len(arg_shapes) - len(specs))  # the backward's dy
  return tuple(NamedSharding(mesh, s) for s in specs)


def _entry(axes):
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


_PLANS: list[list] = []


def _note(layout, notes):
  for recorder in _PLANS:
    recorder.append((layout, notes))


@contextlib.contextmanager
def record_layouts():
  """A context collecting the (Layout, notes) the partitioner chose for the expert ops
  compiled inside it (forward and backward)."""
  found: list = []
  _PLANS.append(found)
  try:
    yield found
  finally:
    _PLANS.remove(found)


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
  _note(layout, notes)
  shardings = _operand_shardings(static, layout, mesh, arg_shapes)
  tokens = NamedSharding(mesh, P(_entry(layout.token_axes)))

  def lower_fn(*flat):
    x, top_e, top_p, params, _ = _unflatten(static, flat)
    with jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ())):
      return _forward_on_device(static, layout, x, top_e, top_p, params)

  return mesh, lower_fn, (tokens, tokens), shardings


def _forward_infer(static, mesh, arg_shapes, result_shape):
  layout, _ = _layout_of(static, mesh, arg_shapes)
  tokens = NamedSharding(mesh, P(_entry(layout.token_axes)))
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
  _note(layout, notes)
  shardings = _operand_shardings(static, layout, mesh, arg_shapes)
  tokens = NamedSharding(mesh, P(_entry(layout.token_axes)))
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
  tokens = NamedSharding(mesh, P(_entry(layout.token_axes)))
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
  tokens = P(_entry(layout.token_axes))

  def body(*flat):
    x, top_e, top_p, params, _ = _unflatten(static, flat)
    return _forward_on_device(static, layout, x, top_e, top_p, params)

  flat = reshard(flat, specs, mesh)
  return jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=(tokens, tokens),
                       axis_names=frozenset(explicit_axes(mesh)),
                       check_vma=False)(*flat)


def _split_backward(static: Static, *flat):
  specs, layout, mesh = _split_specs(static, flat)
  tokens = P(_entry(layout.token_axes))
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
  if transport not in TRANSPORTS:
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
  if buffer_factor is not None and buffer_factor <= 0:
    raise ValueError(f"buffer_factor must be positive, got {buffer_factor}")
  leaves, tree = jax.tree.flatten(params)
  if not leaves or leaves[0].shape[0] != ffn.num_experts:
    raise ValueError(f"params must have the {ffn.num_experts} experts as their leading "
                     f"dim, got {[tuple(l.shape) for l in leaves]}")
  split = _trace_time_split(ffn, x, leaves)
  static = Static(ffn, tree, capacity_factor, buffer_factor, transport, split,
                  inline=split is None and dispatch.trace_platform() == "tpu")
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
    return _axes(spec[0]) if len(spec) else ()

  weights = [leaf for leaf in leaves if leaf.shape and leaf.shape[0] == ffn.num_experts]
  layout, notes = choose_layout(sizes, x.shape, lead(x), lead(weights[0]) if weights else (),
                                ffn.num_experts)
  layout = dataclasses.replace(layout, platform=mesh_platform(mesh), mesh=mesh)
  _note(layout, notes + ("split at trace time: a shard_map over the Explicit mesh axes",))
  return mesh, layout
