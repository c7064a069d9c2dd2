"""The MoE router: scores, top-k, group-limited selection, the routing bias that only
selects, and the auxiliary losses. `MoE` takes any module with the same `route` (see
`Router`)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from gmm_jax.nn.params import param, replicated_last

Array = jax.Array

SCORES = ("softmax", "sigmoid", "sparsemixer")
GROUP_SCORES = ("sum_top2", "max")
LOAD_BALANCING_CONVENTIONS = ("gmm_jax", "transformers")


def renormalizes(top_k: int, score: str, normalize_top_k: bool | None) -> bool:
  """Whether the chosen weights are renormalized: `normalize_top_k`, or by default when
  top_k > 1 (a top-1 weight renormalized is always 1, leaving the router without a
  gradient) and the score is not "sparsemixer" (never renormalized)."""
  if normalize_top_k is None:
    return top_k > 1 and score != "sparsemixer"
  return normalize_top_k


def check_router_options(num_experts: int, top_k: int, *, score: str,
                         normalize_top_k: bool | None, routing_bias: bool,
                         num_expert_groups: int | None, top_k_groups: int | None,
                         group_score: str, load_balancing_convention: str,
                         normalize_epsilon: float, sparsemixer_eps: float):
  """ValueError (NotImplementedError for "sparsemixer" with what it does not take) unless
  the options make a `Router` over `num_experts` experts (`MoEConfig` checks them too, so
  that a config is valid once built)."""
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
  if score not in SCORES:
    raise ValueError(f"score must be one of {SCORES}, got {score!r}")
  if score == "sparsemixer" and (normalize_top_k or routing_bias
                                 or num_expert_groups is not None):
    raise NotImplementedError("score='sparsemixer' with normalize_top_k, routing_bias or "
                              "group-limited routing")
  if not sparsemixer_eps >= 0:
    raise ValueError(f"sparsemixer_eps must be >= 0, got {sparsemixer_eps!r}")
  if load_balancing_convention not in LOAD_BALANCING_CONVENTIONS:
    raise ValueError(f"load_balancing_convention must be one of "
                     f"{LOAD_BALANCING_CONVENTIONS}, got {load_balancing_convention!r}")
  if not normalize_epsilon >= 0:
    raise ValueError(f"normalize_epsilon must be >= 0, got {normalize_epsilon}")
  if (num_expert_groups is None) != (top_k_groups is None):
    raise ValueError("num_expert_groups and top_k_groups go together")
  if group_score not in GROUP_SCORES:
    raise ValueError(f"group_score must be one of {GROUP_SCORES}, got {group_score!r}")
  if num_expert_groups is not None:
    if num_experts % num_expert_groups or not 1 <= top_k_groups <= num_expert_groups:
      raise ValueError(f"{num_experts} experts in {num_expert_groups} groups, choosing "
                       f"{top_k_groups} of them: the groups must split the experts")
    if top_k_groups * (num_experts // num_expert_groups) < top_k:
      raise ValueError(f"top_k={top_k} is more than the experts of {top_k_groups} groups")
  if normalize_epsilon and not renormalizes(top_k, score, normalize_top_k):
    raise ValueError(f"normalize_epsilon={normalize_epsilon} is for the renormalization: "
                     f"it needs normalize_top_k")


class RoutingBias(nnx.Variable):
  """A per-expert routing bias that is not trained by gradient (DeepSeek-V3's auxiliary-
  loss-free balancing): its own collection, outside ``nnx.Param`` (optimizers built with
  ``wrt=nnx.Param`` skip it); `Router.update_routing_bias` moves it. Linen collection:
  "routing_bias"."""


try:  # the Linen collection name of RoutingBias (flax >= 0.11)
  nnx.register_variable_name("routing_bias", RoutingBias, overwrite=True)
except AttributeError:
  pass


class Routing(NamedTuple):
  """What a router gives `MoE` for tokens ``[T, D]``.

  Fields:
    weights: float ``[T, k]``: each chosen expert's weight (differentiable: the router
      learns through it).
    experts: int32 ``[T, k]``: the chosen experts (ids outside ``[0, E)``: no assignment).
    aux: dict of scalars or arrays the layer returns in its ``aux`` (the built-in router's:
      ``load_balancing_loss``, ``router_z_loss``, ``expert_load``).
  """

  weights: Array
  experts: Array
  aux: dict[str, Array]


class Router(nnx.Module):
  """A top-k router: ``logits = x @ kernel (+ bias)``, scores ``s = softmax(logits)`` or
  ``sigmoid(logits)``; experts chosen by ``s + routing_bias`` (the bias only selects),
  optionally only within the best ``top_k_groups`` of ``num_expert_groups`` groups (ranked
  by the sum of their top-2 biased scores, DeepSeek-V3, or their best one: `group_score`);
  weights ``w = s[chosen]``, divided by their sum (plus ``normalize_epsilon``) when
  ``normalize_top_k``, times ``routed_scaling_factor``.

  The interface `MoE` uses (a replacement router, ``MoE(..., router=my_router)``, is any
  nnx.Module with it): ``route(tokens)`` with tokens ``[T, D]`` (the layer's input rows,
  in the input's dtype) returns a `Routing` ``(weights [T, k] float, experts [T, k] int,
  aux dict)``, k being the layer's ``top_k``. Everything else here (``__call__`` giving the
  logits, `select`, `update_routing_bias`, the attributes) belongs to this router only.

  Args:
    embed, num_experts: D, E.
    top_k: experts per token.
    score: "softmax" or "sigmoid" scores, or "sparsemixer" (SparseMixer's inference-time
      routing, PhiMoE's): the experts of the k best logits; the j-th one's weight is the
      softmax, over the experts not chosen before it whose logit l is within a relative
      distance ``(l_j - l) / max(|l|, l_j) <= 2 * sparsemixer_eps`` of its own, taken at
      it (the window is chosen without gradient). Not renormalized; no routing bias or
      groups. SparseMixer's training-time Gumbel sampling and its gradient estimator are
      not reproduced: the weights' gradient is the plain one of this formula.
    sparsemixer_eps: the window of "sparsemixer" (PhiMoE's ``router_jitter_noise``).
    normalize_top_k: renormalize the chosen weights to sum to 1; default: when top_k > 1
      (a top-1 weight renormalized is always 1, leaving the router without a gradient).
    normalize_epsilon: added to the chosen weights' sum before the division (LFM2-MoE's
      1e-6, which keeps sigmoid weights from a near-zero sum finite); 0 by default.
    routing_bias: a `RoutingBias` (zeros at first) added to the scores for the selection.
    num_expert_groups, top_k_groups: group-limited routing (None: off).
    group_score: how a group is ranked for group-limited routing, from its experts' biased
      scores: "sum_top2" (default: the sum of its two best, DeepSeek-V3) or "max" (its best
      one, DeepSeek-V2's ``group_limited_greedy``).
    routed_scaling_factor: multiplies the chosen weights.
    use_bias: the router has a bias (gpt-oss).
    load_balancing_convention: the scale of ``aux["load_balancing_loss"]`` (see
      `aux_losses`): "gmm_jax" (Switch's ``E * sum_e f_e P_e``, 1 when balanced) or
      "transformers" (their ``load_balancing_loss_func``, top_k when balanced).
    param_dtype: of the kernel and bias.
    rngs: nnx.Rngs.

  Parameters: ``kernel [D, E]`` (("embed", "expert")), ``bias [E]`` (("expert",)),
  ``routing_bias [E]`` (a `RoutingBias`, ("expert",)).
  """

  def __init__(self, embed: int, num_experts: int, *, top_k: int = 2,
               score: str = "softmax", normalize_top_k: bool | None = None,
               routing_bias: bool = False, num_expert_groups: int | None = None,
               top_k_groups: int | None = None, group_score: str = "sum_top2",
               routed_scaling_factor: float = 1.0,
               use_bias: bool = False, load_balancing_convention: str = "gmm_jax",
               normalize_epsilon: float = 0.0, sparsemixer_eps: float = 0.01,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    check_router_options(num_experts, top_k, score=score, normalize_top_k=normalize_top_k,
                         routing_bias=routing_bias, num_expert_groups=num_expert_groups,
                         top_k_groups=top_k_groups, group_score=group_score,
                         load_balancing_convention=load_balancing_convention,
                         normalize_epsilon=normalize_epsilon, sparsemixer_eps=sparsemixer_eps)
    self.num_experts, self.top_k, self.score = num_experts, top_k, score
    self.normalize_top_k = renormalizes(top_k, score, normalize_top_k)
    self.normalize_epsilon = float(normalize_epsilon)
    self.sparsemixer_eps = float(sparsemixer_eps)
    self.num_expert_groups, self.top_k_groups = num_expert_groups, top_k_groups
    self.group_score = group_score
    self.routed_scaling_factor = routed_scaling_factor
    self.load_balancing_convention = load_balancing_convention
    # The keys in nnx.Linear's order (kernel, then bias): the same initial values.
    init = nnx.initializers.normal(0.02)
    self.kernel = param(init(rngs.params(), (embed, num_experts), param_dtype),
                        ("embed", "expert"))
    bias_key = rngs.params() if use_bias else None
    self.bias = (param(nnx.initializers.zeros_init()(bias_key, (num_experts,), param_dtype),
                       ("expert",)) if use_bias else None)
    self.routing_bias = (param(jnp.zeros((num_experts,), jnp.float32), ("expert",),
                               kind=RoutingBias) if routing_bias else None)

  def __call__(self, x: Array) -> Array:
    """The logits ``[..., E]`` of x ``[..., D]`` (as nnx.Linear: computed in the promoted
    dtype of x and the kernel)."""
    kernel = self.kernel[...]
    bias = None if self.bias is None else self.bias[...]
    dtype = jnp.result_type(*[a for a in (x, kernel, bias) if a is not None])
    logits = jax.lax.dot_general(x.astype(dtype), kernel.astype(dtype),
                                 (((x.ndim - 1,), (0,)), ((), ())))
    if bias is not None:
      logits = logits + bias.astype(dtype)
    return logits

  def select(self, tokens: Array):
    """tokens ``[T, D]`` -> (logits ``[T, E]`` f32, scores ``[T, E]``, weights ``[T, k]``,
    experts int32 ``[T, k]``)."""
    logits = replicated_last(self(tokens).astype(jnp.float32))
    scores = (jax.nn.sigmoid(logits) if self.score == "sigmoid"
              else jax.nn.softmax(logits, axis=-1))
    if self.score == "sparsemixer":  # the softmax: for the auxiliary losses
      top_e = top_k(jax.lax.stop_gradient(logits), self.top_k)
      weights = sparsemixer_weights(logits, top_e, self.sparsemixer_eps)
      if self.routed_scaling_factor != 1.0:
        weights = weights * self.routed_scaling_factor
      return logits, scores, weights, top_e
    choice = scores
    if self.routing_bias is not None:
      choice = choice + jax.lax.stop_gradient(self.routing_bias[...]).astype(jnp.float32)
    choice = jax.lax.stop_gradient(choice)  # the selection is discrete
    if self.num_expert_groups is not None:
      choice = limit_to_groups(choice, self.num_expert_groups, self.top_k_groups,
                               self.group_score)
    top_e = top_k(choice, self.top_k)
    weights = jnp.take_along_axis(scores, top_e, axis=-1)
    if self.normalize_top_k:
      total = jnp.sum(weights, axis=-1, keepdims=True)
      weights = weights / (total + self.normalize_epsilon if self.normalize_epsilon else total)
    if self.routed_scaling_factor != 1.0:
      weights = weights * self.routed_scaling_factor
    return logits, scores, weights, top_e

  def aux_losses(self, logits: Array, scores: Array, experts: Array) -> dict[str, Array]:
    """The auxiliary losses of T tokens' routing, and the load.

    ``load_balancing_loss``, by ``load_balancing_convention``:

    * "gmm_jax" (Switch Transformer's): ``E * sum_e f_e * P_e``, f_e the fraction of the
      T*k top-k assignments that chose e (``expert_load``), P_e the mean over the tokens
      of e's score (sigmoid scores normalized per token). 1 when balanced.
    * "transformers" (their ``load_balancing_loss_func``, Mixtral's and the others'):
      ``E * sum_e (c_e / T) * mean_t softmax(logits)_te``, c_e the number of tokens whose
      top-k of ``softmax(logits)`` holds e (the unbiased softmax whatever the score and
      the selection). With softmax scores and plain top-k, top_k times "gmm_jax"'s; top_k
      when balanced.

    ``router_z_loss`` (ST-MoE): ``mean(logsumexp(logits)^2)``; ``expert_load``: f ``[E]``.
    """
    num_experts, k = self.num_experts, experts.shape[-1]
    expert_load = jnp.mean(jnp.sum(jax.nn.one_hot(experts, num_experts, dtype=jnp.float32),
                                   axis=1), axis=0) / k
    if self.load_balancing_convention == "transformers":
      probs = jax.nn.softmax(logits, axis=-1)
      chosen = top_k(jax.lax.stop_gradient(probs), k)
      counts = jnp.sum(jax.nn.one_hot(chosen, num_experts, dtype=jnp.float32), axis=(0, 1))
      balance = num_experts * jnp.sum(counts / logits.shape[0] * jnp.mean(probs, axis=0))
    else:
      balance_probs = scores if self.score == "softmax" else (
          scores / jnp.sum(scores, axis=-1, keepdims=True))
      balance = num_experts * jnp.sum(expert_load * jnp.mean(balance_probs, axis=0))
    return {
        "load_balancing_loss": balance,
        "router_z_loss": jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2),
        "expert_load": expert_load,
    }

  def route(self, tokens: Array) -> Routing:
    """tokens ``[T, D]`` -> `Routing` (the interface `MoE` calls)."""
    logits, scores, weights, experts = self.select(tokens)
    return Routing(weights, experts, self.aux_losses(logits, scores, experts))

  def update_routing_bias(self, expert_load: Array, rate: float = 1e-3):
    """DeepSeek-V3's balancing step: each expert's bias moves by `rate` towards balance
    (down when its load, ``aux["expert_load"]``, is above ``1/E``, up when below)."""
    if self.routing_bias is None:
      raise ValueError("this router has no routing bias (routing_bias=False)")
    step = rate * jnp.sign(1.0 / self.num_experts - expert_load.astype(jnp.float32))
    self.routing_bias[...] = self.routing_bias[...] + step


def top_k(scores, k: int):
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


def sparsemixer_weights(logits, experts, eps: float):
  """SparseMixer's weights at inference: ``[T, k]`` for the experts ``[T, k]`` (ranked
  best first) of logits ``[T, E]``; the j-th is the softmax, over the experts not chosen
  before it within a relative distance ``2 * eps`` of its logit, taken at it."""
  num_experts = logits.shape[-1]
  fixed = jax.lax.stop_gradient(logits)
  excluded = jnp.zeros(logits.shape, bool)
  weights = []
  for j in range(experts.shape[-1]):
    chosen = jax.nn.one_hot(experts[:, j], num_experts, dtype=bool)
    threshold = jnp.sum(jnp.where(chosen, fixed, 0), axis=-1, keepdims=True)
    far = (threshold - fixed) / jnp.maximum(jnp.abs(fixed), threshold) > 2 * eps
    masked = jnp.where(excluded | far, -jnp.inf, logits)
    weights.append(jnp.sum(jnp.where(chosen, jax.nn.softmax(masked, axis=-1), 0), axis=-1))
    excluded = excluded | chosen
  return jnp.stack(weights, axis=-1)


def limit_to_groups(choice, num_groups: int, top_groups: int, group_score: str = "sum_top2"):
  """Group-limited routing: the experts of all but the `top_groups` best groups get -inf; a
  group's rank is the sum of its two best scores ("sum_top2", DeepSeek-V3) or its best
  score ("max", DeepSeek-V2)."""
  num_tokens, num_experts = choice.shape
  grouped = choice.reshape(num_tokens, num_groups, num_experts // num_groups)
  best = jnp.max(grouped, axis=-1)
  ranking = best
  if group_score == "sum_top2" and grouped.shape[-1] > 1:
    first = jax.nn.one_hot(jnp.argmax(grouped, axis=-1), grouped.shape[-1], dtype=bool)
    ranking = best + jnp.max(jnp.where(first, -jnp.inf, grouped), axis=-1)
  chosen = jnp.sum(jax.nn.one_hot(top_k(ranking, top_groups), num_groups, dtype=bool),
                   axis=1, dtype=jnp.int32) > 0  # [T, groups]
  mask = jnp.repeat(chosen, num_experts // num_groups, axis=-1)
  return jnp.where(mask, choice, -jnp.inf)
