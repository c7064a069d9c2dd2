"""The routed experts' FFN on one device's tokens: `ExpertFFN` and the ways to run it.

`ExpertFFN` is the static description of a gated or plain FFN, its activation, biases and
quantization. The ways: the fused path (`ffn_routed`: the tokens read by index, each result
weighted and written to its slot inside the gmms), the masked layout for decode
(`ffn_masked`), and the unfused baseline (`ffn_sorted`: sorted copies around plain gmms),
all on `ffn_rows`, the FFN on expert-contiguous rows.

Floor 6: built on the public API (`gmm`, `route`); `partitioned` splits these over a mesh.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from gmm_jax._src.api import gmm
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.core.qarray import as_quantization
from gmm_jax._src.core.epilogue import (GATED_ACTIVATIONS, SWIGLU_ALPHA, SWIGLU_LIMIT,
                                        gather_rows, swiglu_clamped)
from gmm_jax._src.core.grouped_array import from_ragged, to_ragged
from gmm_jax._src.moe import routing
from gmm_jax._src.moe.routing import route
from gmm_jax._src.op.primitive import PREACTIVATION

# The gated activation of each plain one: ``act(gate) * up`` on a [.., 2F] product.
GATED_NAMES = {"silu": "swiglu", "gelu": "geglu", "gelu_tanh": "geglu_tanh",
               **{name: name for name in GATED_ACTIVATIONS}}
# What the fused expert FFN keeps for its backward: the gmms' pre-activations.
FFN_POLICY = jax.checkpoint_policies.save_only_these_names(PREACTIVATION)
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
      the cotangent epilogue natively (`prologue_is_native`: Pallas TPU and Triton), else
      False: on TPU v5e the one-chip bench step's temporaries are 90 MB against 191 MB,
      Mixtral's expert-parallel step on 4 chips 1.55 against 2.24 GiB; on CPU, where
      act(z) and the cotangent are formed around the gmms, neither wins everywhere
      (benchmarks/log.md, "The gated prologue by default where the kernels fuse it").
      In fp8 training (``quantization=``) the default takes it where the forward's kernel
      also quantizes act(z) in its prologue (Triton) and the dlhs gmm writes z's
      cotangent from its blockwise fp8 operands: the H200 step's temporaries 247 MB
      against 537 MB; on TPU (act(z) quantized before the kernel) the epilogue path
      holds less.
      Quantized down weights or dynamic quantization (``quantize_lhs``,
      ``quantize_rhs``) take the False path. Gradients
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
  quantized = any(options.get(key) is not None for key in ("quantize_lhs", "quantize_rhs"))
  if quantized or not isinstance(w_down, (jax.Array, np.ndarray)) or not jnp.issubdtype(
      w_down.dtype, jnp.floating):
    return None
  if spec.gated_prologue is None and not prologue_is_native(name, options, w_down):
    return None
  return name


def prologue_is_native(name: str, options: dict[str, Any], w_down=None) -> bool:
  """Whether the gmms of a gated prologue (`ExpertFFN.gated_prologue`) run natively where
  this is traced for: the kernel the forward's down gmm tries first applies act(z) in its
  prologue (``"gated_lhs"``) and the one its backward's dlhs gmm tries first writes z's
  cotangent in its epilogue (``"gated_cotangent"``). Pallas TPU and Triton do both; elsewhere
  act(z) and the cotangent would be formed around the kernels (benchmarks/log.md, "The gated
  prologue by default where the kernels fuse it"). In fp8 training (``quantization=``, with
  the down weights `w_down` ``[E, F, D]``) the forward's kernel must also quantize act(z) in
  its prologue (Triton; the TPU kernel multiplies blocks formed before it, where the
  measured step holds more: benchmarks/log.md, "fp8 training through the fused ends")."""
  platform = options.get("platform") or registry.trace_platform()
  platform = registry.normalize_platform(platform)
  chosen = registry.check_implementation(options.get("implementation"))
  forward = GmmConfig(group_type="m", num_local=1, lhs_activation=name, implementation=chosen)
  dlhs = GmmConfig(group_type="m", num_local=1, cotangent_of=name, transpose_rhs=True,
                   implementation=chosen)
  native = ("gated_lhs" in registry.native_features(forward, platform)
            and "gated_cotangent" in registry.native_features(dlhs, platform))
  recipe = as_quantization(options.get("quantization"))
  if not native or recipe is None or w_down is None:
    return native
  weights = jax.eval_shape(recipe.weights, jax.ShapeDtypeStruct(w_down.shape, w_down.dtype))
  z = jax.ShapeDtypeStruct((recipe.block, 2 * w_down.shape[-2]), w_down.dtype)
  forward = forward.replace(num_local=w_down.shape[0], quantize_prologue=recipe.forward_blocks)
  return registry.serves(z, weights, forward, platform)


def input_weighted(rows, weights):
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
      rows = dict(lhs=input_weighted(gather_rows(x, r.lhs_indices), r.row_weights))
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
    rows = input_weighted(rows, r.row_weights)
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
    return input_weighted(rows, weights), kept.astype(jnp.float32)
  return rows, weights
