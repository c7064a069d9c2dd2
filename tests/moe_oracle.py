"""The `nn.MoE` layer's definition as a per-token oracle, written from the documented formula
(`nn.MoE`'s and `nn.Router`'s docstrings, docs/moe.md), not from the layer's code.

* `routing_of`: the experts each token goes to, in float64 numpy: scores (softmax, sigmoid,
  or sparsemixer's k best logits), the routing bias that only selects, group-limited top-k
  ("sum_top2" or "max" group scores), sparsemixer's windows, and the margin by which every
  discrete decision was taken (a case decided by rounding says so).
* `kept_of`: the capacity's kept assignments: each expert takes its first C assignments in
  (token, choice) order, of each block of tokens (the call, a sequence, a token shard).
* `reference`: y for x ``[T, D]`` from the parameters as a pure dict, a jnp loop over each
  token's chosen experts (differentiable: its jax.grad is the gradient oracle): weights
  renormalized (plus ``normalize_epsilon``) and scaled, identity experts (``w * x``),
  gated or plain FFNs with biases, router weights on the output or the input, shared
  experts (gated, scaled), the output bias.
* `balance_loss`, `expert_load_of`: the aux entries by their documented formulas.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

GATES = {
    "silu": lambda g, u: jax.nn.silu(g) * u,
    "gelu": lambda g, u: jax.nn.gelu(g, approximate=False) * u,
    "gelu_tanh": lambda g, u: jax.nn.gelu(g, approximate=True) * u,
}
PLAIN = {"relu": jax.nn.relu, "gelu": lambda z: jax.nn.gelu(z, approximate=False),
         "silu": jax.nn.silu, "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True)}


def gate_of(model):
  """The gated activation on (gate, up), gpt-oss's with the model's limit and alpha."""
  if model.activation != "swiglu_clamped":
    return GATES[model.activation]
  limit, alpha = model.swiglu_limit, model.swiglu_alpha
  return lambda g, u: (jnp.minimum(g, limit) * jax.nn.sigmoid(alpha * jnp.minimum(g, limit))
                       * (jnp.clip(u, -limit, limit) + 1))


def logits_of(p, tokens):
  """The router logits ``[T, E (+ Z)]`` in float32 numpy, as the layer computes them."""
  logits = np.asarray(np.asarray(tokens) @ np.asarray(p["router"]["kernel"]), np.float32)
  if "bias" in p["router"]:
    logits = logits + np.asarray(p["router"]["bias"])
  return logits


def _softmax(logits):
  exp = np.exp(logits - logits.max(-1, keepdims=True))
  return exp / exp.sum(-1, keepdims=True)


class Choice(NamedTuple):
  """`routing_of`'s answer.

  chosen: int ``[T, k]``, best first. windows: bool ``[T, k, N]`` for sparsemixer (the
  experts each weight's softmax runs over), else None. margin: the smallest gap, over the
  tokens, between a decision's two sides (consecutive ranked scores around the choice, the
  group ranks, sparsemixer's window bound): a case below float32 rounding is undecided.
  """

  chosen: np.ndarray
  windows: np.ndarray | None
  margin: float


def routing_of(model, p, tokens) -> Choice:
  """The experts each token goes to, by the documented rule, from float64 scores of the
  float32 logits."""
  logits = logits_of(p, tokens).astype(np.float64)
  num_routed = logits.shape[-1]
  k = model.top_k
  margin = np.inf
  if model.score == "sparsemixer":
    # The k best logits; the j-th weight's softmax runs over the experts not chosen before
    # it whose relative distance (l_j - l) / max(|l|, l_j) is at most 2 * eps.
    eps = model.router.sparsemixer_eps
    chosen, windows = [], []
    for row in logits:
      order = np.argsort(-row, kind="stable")
      ranked = row[order[:k + 1]] if k < num_routed else row[order]
      margin = min(margin, np.min(-np.diff(ranked)) if len(ranked) > 1 else np.inf)
      token_windows = []
      for j, e in enumerate(order[:k]):
        distance = (row[e] - row) / np.maximum(np.abs(row), row[e])
        window = distance <= 2 * eps
        window[order[:j]] = False
        others = np.ones(num_routed, bool)
        others[order[:j + 1]] = False
        if others.any():
          margin = min(margin, np.min(np.abs(distance[others] - 2 * eps)))
        token_windows.append(window)
      chosen.append(order[:k])
      windows.append(token_windows)
    return Choice(np.stack(chosen), np.asarray(windows), float(margin))
  scores = _softmax(logits) if model.score == "softmax" else 1 / (1 + np.exp(-logits))
  if model.routing_bias is not None:
    scores = scores + np.asarray(model.routing_bias[...], np.float64)
  chosen = []
  for s in scores:
    candidates = np.arange(num_routed)
    if model.num_expert_groups:
      groups = s.reshape(model.num_expert_groups, -1)
      if model.group_score == "max":
        group_score = groups.max(-1)
      else:  # the sum of the two best (the one, for groups of one expert)
        group_score = np.sort(groups, axis=-1)[:, -2:].sum(-1)
      ranked_groups = np.argsort(-group_score, kind="stable")
      if model.top_k_groups < model.num_expert_groups:
        margin = min(margin, group_score[ranked_groups[model.top_k_groups - 1]]
                     - group_score[ranked_groups[model.top_k_groups]])
      size = groups.shape[1]
      candidates = np.concatenate([np.arange(g * size, (g + 1) * size)
                                   for g in sorted(ranked_groups[:model.top_k_groups])])
    order = np.argsort(-s[candidates], kind="stable")
    if len(order) > k:
      margin = min(margin, s[candidates[order[k - 1]]] - s[candidates[order[k]]])
    chosen.append(candidates[order[:k]])
  return Choice(np.stack(chosen), None, float(margin))


def choose(model, p, tokens):
  """The experts each token goes to (`routing_of`): int ``[T, k]``."""
  return routing_of(model, p, tokens).chosen


def capacity_of(model, tokens: int):
  """The most assignments one expert takes of a block of `tokens` tokens: the layer's
  ``expert_capacity``, or ``ceil(capacity_factor * tokens * top_k / E)``; None: dropless."""
  if getattr(model, "expert_capacity", None) is not None:
    return model.expert_capacity
  if model.capacity_factor is None:
    return None
  return math.ceil(model.capacity_factor * tokens * model.top_k / model.num_experts)


def kept_of(chosen, capacity, sequence=None):
  """bool [T, k]: each expert takes its first `capacity` assignments in (token, choice)
  order (of each block of `sequence` tokens when given: a sequence, a token shard)."""
  if sequence is not None:
    return np.concatenate([kept_of(chosen[s:s + sequence], capacity)
                           for s in range(0, chosen.shape[0], sequence)])
  taken = {}
  kept = np.ones(chosen.shape, bool)
  for t, j in np.ndindex(*chosen.shape):
    e = int(chosen[t, j])
    taken[e] = taken.get(e, 0) + 1
    kept[t, j] = capacity is None or taken[e] <= capacity
  return kept


def _ffn(model, p, e, x_in):
  """FFN_e(x_in) of routed expert e."""
  num_mlp = p["down"]["kernel"].shape[1]
  layer = p["gate_up"] if model.gated else p["up"]
  z = x_in @ layer["kernel"][e]
  if "bias" in layer:
    z = z + layer["bias"][e]
  h = gate_of(model)(z[:num_mlp], z[num_mlp:]) if model.gated else PLAIN[model.activation](z)
  o = h @ p["down"]["kernel"][e]
  if "bias" in p["down"]:
    o = o + p["down"]["bias"][e]
  return o


def _shared(model, p, x_t):
  z = x_t @ p["shared"]["up"]["kernel"]
  if model.gated:
    half = z.shape[0] // 2
    h = gate_of(model)(z[:half], z[half:])
  else:
    h = PLAIN[model.activation](z)
  shared = h @ p["shared"]["down"]["kernel"]
  if "gate" in p["shared"]:  # Qwen2-MoE: sigmoid(x @ w) scales the shared expert
    shared = shared * jax.nn.sigmoid(x_t @ p["shared"]["gate"]["kernel"])[0]
  return shared


def reference(model, p, x, chosen, kept, windows=None):
  """y for x [T, D] from params p (a pure dict): the formula for one token (over its
  chosen experts, a loop), mapped over the tokens. `chosen` [T, k] (ids >= E: identity
  experts), `kept` bool [T, k] (the capacity's), `windows` bool [T, k, N] (sparsemixer's,
  `routing_of`)."""
  num_experts = model.num_experts
  identity = getattr(model, "num_identity_experts", 0)
  epsilon = getattr(model, "normalize_epsilon", 0.0) or 0.0
  shared_scale = getattr(model, "shared_scale", 1.0)
  if windows is None:
    windows = np.zeros(chosen.shape + (1,), bool)

  def one_token(x_t, experts, keep, window):
    logits = x_t @ p["router"]["kernel"]
    if "bias" in p["router"]:
      logits = logits + p["router"]["bias"]
    if model.score == "sparsemixer":  # w_j: the softmax over its window, at e_j
      w = jnp.stack([jnp.exp(logits[experts[j]] - logits[experts[j]])
                     / jnp.sum(jnp.where(window[j], jnp.exp(logits - logits[experts[j]]), 0))
                     for j in range(model.top_k)])
    else:
      s = jax.nn.softmax(logits) if model.score == "softmax" else jax.nn.sigmoid(logits)
      w = s[experts]
    if model.normalize_top_k:
      w = w / (jnp.sum(w) + epsilon)
    w = w * model.routed_scaling_factor
    on_input = model.router_weight_on == "input"
    y = jnp.zeros(x_t.shape)
    for j in range(model.top_k):
      e = experts[j]
      x_in = x_t * w[j] if on_input else x_t  # Llama 4: the weight scales the input
      o = _ffn(model, p, jnp.minimum(e, num_experts - 1), x_in)
      o = jnp.where(keep[j], 1.0 if on_input else w[j], 0.0) * o
      if identity:  # LongCat-Flash's zero experts: FFN_e(x) = x for e >= E
        o = jnp.where(e >= num_experts, w[j] * x_t, o)
      y = y + o
    if "shared" in p:
      y = y + shared_scale * _shared(model, p, x_t)
    if "output_bias" in p:  # JetMoE
      y = y + p["output_bias"]
    return y

  return jax.vmap(one_token)(x, jnp.asarray(chosen), jnp.asarray(kept), jnp.asarray(windows))


def expert_load_of(chosen, num_routed):
  """aux["expert_load"]: the fraction of the T*k assignments that chose each of the
  router's experts (before capacity)."""
  return np.bincount(np.asarray(chosen).reshape(-1), minlength=num_routed) / chosen.size


def balance_loss(model, p, tokens, chosen):
  """aux["load_balancing_loss"] by the documented formula of the model's convention, over
  the router's N experts (N = E + Z with identity experts)."""
  logits = logits_of(p, np.asarray(tokens)).astype(np.float64)
  num_routed = logits.shape[-1]
  softmax = _softmax(logits)
  if model.router.load_balancing_convention == "transformers":
    top = np.argsort(-softmax, axis=-1, kind="stable")[:, :model.top_k]
    counts = np.bincount(top.reshape(-1), minlength=num_routed) / tokens.shape[0]
    return num_routed * np.sum(counts * softmax.mean(0))
  scores = 1 / (1 + np.exp(-logits)) if model.score == "sigmoid" else softmax
  scores = scores / scores.sum(-1, keepdims=True)
  return num_routed * np.sum(expert_load_of(chosen, num_routed) * scores.mean(0))


def loss_of(y):
  """The scalar loss whose gradients the layer tests compare."""
  return jnp.sum(jnp.sin(y) * y)


def leaf(tree, path):
  """The entry of a nested dict at a `jax.tree_util` key path."""
  for key in path:
    tree = tree[key.key]
  return tree
