"""The option space of the routed experts (`gmm_jax.routed_experts`), drawn by hypothesis and
held to a float64 per-token oracle.

A case: tokens T, experts E, top-k, FFN (gated or plain, its activation, fused or unfused,
biases, the gated prologue or the epilogue activation), capacity factor, and the layout the operands are sharded in on a 2 x 4 CPU mesh
("data", "expert"): unsharded, tokens over both axes with replicated experts ("local"),
tokens over "data" with experts over "expert" ("experts"), tokens over both with experts
over "expert" ("travel", with either transport). The partitioner must pick the layout's
strategy; forward and the gradients of x, the router weights and every parameter must equal
the oracle's. The oracle is written here from the definition (numpy loops for the forward,
jax.grad of a dense per-(token, choice) formula for the gradients, no gmm), and the
capacity's kept assignments are counted here from the rule (each token shard, each expert,
earlier tokens first).
"""

from __future__ import annotations

import dataclasses
import math

import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

import gmm_jax
import meshes
from gmm_jax._src.moe.layout import record_layouts

D, F = 8, 4
MESH = ((2, 4), ("data", "expert"))
# layout -> (tokens spec, weights spec); None: unsharded (one device).
LAYOUTS = {
    "none": None,
    "local": (P(("data", "expert")), P()),
    "experts": (P("data"), P("expert")),
    "travel": (P(("data", "expert")), P("expert")),
}
# The activations in numpy: (name the FFN takes, gated) -> function of the pre-activation.
_GELU_TANH = lambda z: 0.5 * z * (1 + np.tanh(np.sqrt(2 / np.pi) * (z + 0.044715 * z ** 3)))
NUMPY_ACTIVATIONS = {
    "silu": lambda z: z / (1 + np.exp(-z)),
    "gelu_tanh": _GELU_TANH,
    "relu": lambda z: np.maximum(z, 0),
}
JNP_ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda z: jax.nn.gelu(z, approximate=True),
                   "relu": jax.nn.relu}


@dataclasses.dataclass(frozen=True)
class MoECase:
  tokens: int = 16
  num_experts: int = 4
  top_k: int = 2
  gated: bool = True
  activation: str = "silu"
  fused: bool = True
  bias: bool = False
  capacity_factor: float | None = None
  layout: str = "none"
  transport: str = "all_to_all"
  weight_on: str = "output"
  gated_prologue: bool | None = None  # None: the platform's (on CPU: the epilogue)
  seed: int = 0

  @property
  def ffn(self) -> gmm_jax.ExpertFFN:
    return gmm_jax.ExpertFFN(self.num_experts, self.activation, gated=self.gated,
                             fused=self.fused, weight_on=self.weight_on,
                             gated_prologue=self.gated_prologue)

  @property
  def token_shards(self) -> int:
    """How many contiguous token shards the capacity is counted in."""
    if self.layout in ("local", "travel"):
      return 8
    return 2 if self.layout == "experts" else 1


@st.composite
def moe_cases(draw) -> MoECase:
  gated = draw(st.booleans())
  activation = draw(st.sampled_from(["silu", "gelu_tanh"] if gated else ["relu", "silu"]))
  layout = draw(st.sampled_from(sorted(LAYOUTS)))
  return MoECase(
      tokens=8 * draw(st.integers(1, 4)), num_experts=draw(st.sampled_from([4, 8])),
      top_k=draw(st.integers(1, 2)), gated=gated, activation=activation,
      fused=draw(st.booleans()), bias=draw(st.booleans()),
      capacity_factor=draw(st.sampled_from([None, None, 1.0])), layout=layout,
      transport=draw(st.sampled_from(["all_to_all", "ragged"])),
      weight_on=draw(st.sampled_from(["output", "input"])),
      gated_prologue=draw(st.sampled_from([None, True, False])),
      seed=draw(st.integers(0, 2 ** 16)))


def make_problem(case: MoECase):
  """float64 numpy operands: x [T, D], top_e [T, k] (distinct per token, one hot expert),
  top_p [T, k], params."""
  rng = np.random.default_rng(case.seed)
  t, e, k = case.tokens, case.num_experts, case.top_k
  x = rng.normal(size=(t, D))
  top_e = np.stack([rng.choice(e, k, replace=False) for _ in range(t)]).astype(np.int32)
  top_e[: t // 2, 0] = 1  # a hot expert, so capacities and uneven shards are met
  if k > 1:
    top_e[: t // 2, 1] = np.where(top_e[: t // 2, 1] == 1, 0, top_e[: t // 2, 1])
  top_p = rng.uniform(0.1, 1.0, size=(t, k))
  width = 2 * F if case.gated else F
  params = dict(w_in=rng.normal(size=(e, D, width)) * 0.4,
                w_down=rng.normal(size=(e, F, D)) * 0.4)
  if case.bias:
    params["b_in"] = rng.normal(size=(e, width)) * 0.3
    params["b_down"] = rng.normal(size=(e, D)) * 0.3
  return x, top_e, top_p, params


def kept_of(case: MoECase, top_e: np.ndarray) -> np.ndarray:
  """1 where an assignment is computed: with a capacity factor c, each expert takes at most
  ceil(c * T_shard * k / E) assignments of each token shard, earlier tokens first."""
  kept = np.ones(top_e.shape, bool)
  if case.capacity_factor is None:
    return kept
  shards = case.token_shards
  per_shard = case.tokens // shards
  capacity = math.ceil(case.capacity_factor * per_shard * case.top_k / case.num_experts)
  for s in range(shards):
    taken = np.zeros(case.num_experts, int)
    for t in range(s * per_shard, (s + 1) * per_shard):
      for j in range(case.top_k):
        e = top_e[t, j]
        kept[t, j] = taken[e] < capacity
        taken[e] += 1
  return kept


def _ffn_numpy(case: MoECase, row: np.ndarray, e: int, params) -> np.ndarray:
  z = row @ params["w_in"][e] + (params["b_in"][e] if case.bias else 0)
  act = NUMPY_ACTIVATIONS[case.activation]
  h = act(z[:F]) * z[F:] if case.gated else act(z)
  return h @ params["w_down"][e] + (params["b_down"][e] if case.bias else 0)


def oracle_forward(case: MoECase, x, top_e, top_p, params, kept) -> np.ndarray:
  """``y_t = sum_j kept_tj p_tj ffn_{e_tj}(x_t)`` (``weight_on="input"``: ``sum_j kept_tj
  ffn_{e_tj}(p_tj x_t)``, Llama 4), a float64 loop per token and choice."""
  y = np.zeros((case.tokens, D))
  for t in range(case.tokens):
    for j in range(case.top_k):
      if kept[t, j]:
        if case.weight_on == "input":
          y[t] += _ffn_numpy(case, top_p[t, j] * x[t], top_e[t, j], params)
        else:
          y[t] += top_p[t, j] * _ffn_numpy(case, x[t], top_e[t, j], params)
  return y


def oracle_grads(case: MoECase, x, top_e, top_p, params, kept):
  """The gradients of ``sum(sin(y))`` (x, top_p, params) through a dense per-(token, choice)
  formula with each choice's weights gathered (jax, float64 on the CPU; no gmm)."""
  act = JNP_ACTIVATIONS[case.activation]

  def y_of(x, top_p, params):
    w_in, w_down = params["w_in"][top_e], params["w_down"][top_e]  # [T, k, ...]
    rows = jnp.broadcast_to(x[:, None, :], top_p.shape + x.shape[-1:])
    if case.weight_on == "input":
      rows = rows * top_p[..., None]
    z = jnp.einsum("tkd,tkdf->tkf", rows, w_in)
    if case.bias:
      z = z + params["b_in"][top_e]
    h = act(z[..., :F]) * z[..., F:] if case.gated else act(z)
    out = jnp.einsum("tkf,tkfd->tkd", h, w_down)
    if case.bias:
      out = out + params["b_down"][top_e]
    weights = kept if case.weight_on == "input" else top_p * kept
    return jnp.einsum("tk,tkd->td", weights, out)

  with jax.enable_x64(True):
    args = (jnp.asarray(x), jnp.asarray(top_p), jax.tree.map(jnp.asarray, params))
    grads = jax.grad(lambda *a: jnp.sum(jnp.sin(y_of(*a))), argnums=(0, 1, 2))(*args)
    return jax.tree.map(np.asarray, grads)


def check_routed_experts(case: MoECase):
  x, top_e, top_p, params = make_problem(case)
  kept = kept_of(case, top_e)
  want = oracle_forward(case, x, top_e, top_p, params, kept)
  want_dx, want_dp, want_dw = oracle_grads(case, x, top_e, top_p, params, kept)

  def loss(x, top_p, params, top_e):
    y, got_kept = gmm_jax.routed_experts(case.ffn, x, top_e, top_p, params,
                                         capacity_factor=case.capacity_factor,
                                         transport=case.transport)
    return jnp.sum(jnp.sin(y)), (y, got_kept)

  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))
  args = (jnp.asarray(x, jnp.float32), jnp.asarray(top_p, jnp.float32),
          jax.tree.map(lambda w: jnp.asarray(w, jnp.float32), params), jnp.asarray(top_e))
  if LAYOUTS[case.layout] is not None:
    mesh = meshes.mesh(*MESH)
    tokens, weights = LAYOUTS[case.layout]
    put = lambda a, s: jax.device_put(a, NamedSharding(mesh, s))  # noqa: E731
    args = (put(args[0], tokens), put(args[1], tokens),
            jax.tree.map(lambda w: put(w, weights), args[2]), put(args[3], tokens))
  with record_layouts() as chosen:
    compiled = step.lower(*args).compile()
  if LAYOUTS[case.layout] is not None:  # forward and backward both take the layout's plan
    assert [c[0].strategy for c in chosen] == [case.layout] * 2, (case, chosen)
  (_, (y, got_kept)), (dx, dp, dw) = compiled(*args)
  np.testing.assert_array_equal(np.asarray(got_kept).astype(bool), kept, err_msg=str(case))
  tol = dict(rtol=2e-4, atol=2e-5)
  np.testing.assert_allclose(np.asarray(y), want, **tol, err_msg=f"y {case}")
  scaled = lambda g: dict(rtol=tol["rtol"], atol=tol["atol"] * max(1.0, np.abs(g).max()))
  np.testing.assert_allclose(np.asarray(dx), want_dx, **scaled(want_dx), err_msg=f"dx {case}")
  np.testing.assert_allclose(np.asarray(dp), want_dp, **scaled(want_dp), err_msg=f"dp {case}")
  for name, g in want_dw.items():
    np.testing.assert_allclose(np.asarray(dw[name]), g, **scaled(g), err_msg=f"d{name} {case}")
