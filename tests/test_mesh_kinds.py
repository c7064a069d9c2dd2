"""Sharding with no sharding argument, on every kind of mesh: `jax.sharding.Mesh`, and
`jax.make_mesh` with Auto and with Explicit axes under `jax.set_mesh`. Plain jit partitions
gmm and ragged_dot with the strategies of `GmmSharding` (no all-gather of weights or
tokens, forward or gradient); `GmmSharding`, `routed_gmm` and `nn.MoE` accept every mesh
kind; a data-parallel MoE routes within each token shard. Each case against one device."""

from __future__ import annotations

import contextlib

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax import GmmSharding
from jax.sharding import NamedSharding, PartitionSpec as P
from meshes import collective_shapes, collectives, mesh
from oracle import gmm_oracle

KINDS = ["mesh", "auto", "explicit"]
M, K, N, G = 64, 32, 16, 8
SIZES = jnp.asarray([5, 0, 9, 3, 12, 0, 7, 20], jnp.int32)


def context(the_mesh, kind):
  """`jax.set_mesh` for the make_mesh kinds (jax's idiom); a plain Mesh needs none."""
  return contextlib.nullcontext() if kind == "mesh" else jax.set_mesh(the_mesh)


def operands(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.float32)
  return x, w


def place(the_mesh, a, spec):
  return jax.device_put(a, NamedSharding(the_mesh, spec))


def spec_of(a):
  """The spec of a result: its type's (Explicit axes) or its placement's."""
  typed = getattr(jax.typeof(a), "sharding", None)
  if typed is not None and jax.sharding.AxisType.Explicit in tuple(typed.mesh.axis_types):
    return typed.spec
  return a.sharding.spec


@pytest.mark.parametrize("kind", [k if k != "auto" else pytest.param(k, marks=pytest.mark.slow)
                                  for k in KINDS])
def test_plain_jit_gmm_and_ragged_dot(kind):
  # Tokens over "d", experts over "e": expert + rows strategies, chosen by the partitioner.
  the_mesh = mesh((2, 4), ("d", "e"), kind)
  x, w = operands()
  want = jax.jit(lambda x, w: gmm_jax.gmm(x, w, SIZES, activation="silu"))(x, w)
  loss = lambda x, w: jnp.sum(gmm_jax.gmm(x, w, SIZES, activation="silu") ** 2)  # noqa: E731
  want_grads = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  with context(the_mesh, kind):
    xs, ws = place(the_mesh, x, P("d")), place(the_mesh, w, P("e"))
    fwd = jax.jit(lambda x, w: gmm_jax.gmm(x, w, SIZES, activation="silu"))
    got = fwd(xs, ws)
    np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(got, gmm_oracle(x, w, SIZES, "m", activation="silu"),
                               rtol=1e-4, atol=1e-4)
    assert tuple(spec_of(got)) in (("d",), ("d", None))
    fwd_hlo = collectives(fwd.lower(xs, ws).compile().as_text())
    # An SGD step: the weight gradient lands where the weights are (any mesh kind).
    step = jax.jit(lambda x, w: (jax.grad(loss, argnums=0)(x, w),
                                 w - 0.1 * jax.grad(loss, argnums=1)(x, w)))
    dx, w_new = step(xs, ws)
    np.testing.assert_allclose(dx, want_grads[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(w_new, w - 0.1 * want_grads[1], rtol=1e-4, atol=1e-4)
    assert tuple(spec_of(w_new))[:1] == ("e",)
    step_text = step.lower(xs, ws).compile().as_text()
    rd = jax.jit(jax.value_and_grad(
        lambda x, w: jnp.sum(gmm_jax.ragged_dot(x, w, SIZES) ** 2), argnums=(0, 1)))
    value, (rdx, rdw) = rd(xs, ws)
    rd_text = rd.lower(xs, ws).compile().as_text()
  assert fwd_hlo["all-gather"] == 0 and fwd_hlo["all-reduce"] + fwd_hlo["reduce-scatter"] == 1
  assert collectives(step_text)["all-gather"] == 0
  want_rd = jax.jit(jax.value_and_grad(
      lambda x, w: jnp.sum(jax.lax.ragged_dot(x, w, SIZES) ** 2), argnums=(0, 1)))(x, w)
  np.testing.assert_allclose(value, want_rd[0], rtol=1e-4)
  np.testing.assert_allclose(rdx, want_rd[1][0], rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(rdw, want_rd[1][1], rtol=1e-4, atol=1e-4)
  # The tiny group-size vector may move; no operand-sized array does.
  assert all("[8]" in s or "[]" in s for s in collective_shapes(rd_text, "all-gather"))


@pytest.mark.parametrize("kind", KINDS)
def test_gmm_sharding_and_routed_gmm(kind):
  the_mesh = mesh((8,), ("e",), kind)
  x, w = operands(1)
  with context(the_mesh, kind):
    xs, ws = place(the_mesh, x, P()), place(the_mesh, w, P("e"))
    sharding = GmmSharding(the_mesh, P(), P("e"))
    got = jax.jit(lambda x, w: gmm_jax.gmm(x, w, SIZES, sharding=sharding))(xs, ws)
    np.testing.assert_allclose(got, gmm_jax.gmm(x, w, SIZES), rtol=2e-5, atol=2e-5)
    ids = jnp.asarray(np.random.default_rng(2).integers(0, G, M), jnp.int32)
    xt = place(the_mesh, x, P("e"))
    # Under jax.set_mesh the mesh argument may be left out.
    mesh_arg = dict(mesh=the_mesh) if kind == "mesh" else {}
    routed = jax.jit(lambda x, w: gmm_jax.routed_gmm(x, w, ids, axis="e", **mesh_arg))
    got = routed(xt, ws)
    assert tuple(spec_of(got))[:1] == ("e",)
  np.testing.assert_allclose(got, jnp.einsum("tk,tkn->tn", x, w[ids]), rtol=2e-5, atol=2e-5)


# ----------------------------------------------------------------------------- the MoE

flax = pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from gmm_jax import nn  # noqa: E402

LAYOUTS = {
    # name: (mesh shape, token axes, expert axis or None)
    "data": ((8,), ("data",), None),  # data parallel, experts replicated
    "data+expert": ((2, 4), ("data",), "e"),  # tokens replicated over e: local experts + psum
    "data+routed": ((2, 4), ("data", "e"), "e"),  # tokens over both: all-to-all over e
}


def _mesh_names(layout):
  shape, _, _ = LAYOUTS[layout]
  return shape, ("data",) if len(shape) == 1 else ("data", "e")


@pytest.mark.parametrize("layout, kind", [
    pytest.param("data", "explicit", marks=pytest.mark.slow), ("data+expert", "mesh"),
    pytest.param("data+routed", "mesh", marks=pytest.mark.slow), ("data+routed", "explicit")])
def test_data_parallel_moe(layout, kind):
  shape, names = _mesh_names(layout)
  _, token_axes, expert_axis = LAYOUTS[layout]
  the_mesh = mesh(shape, names, kind)
  reference = nn.MoE(8, 16, 24, top_k=2, rngs=nnx.Rngs(0))
  reference.router.kernel[...] = jax.random.normal(jax.random.key(1), (16, 8))
  x = jax.random.normal(jax.random.key(2), (8, 4, 16))  # 32 tokens, 64 assignments
  graphdef, state = nnx.split(reference)

  def loss(state, x, **layout_kwargs):
    model = nnx.merge(graphdef, state)
    for name, value in layout_kwargs.items():
      setattr(model, name, value)
    y, aux = model(x)
    return jnp.sum(y ** 2) + aux["load_balancing_loss"], y

  (want_loss, want), want_grads = jax.jit(jax.value_and_grad(loss, has_aux=True))(state, x)
  kwargs = {}
  if kind == "mesh":  # Auto axes: the layout is said; Explicit: it is in the types
    kwargs = dict(data_parallel=(the_mesh, token_axes))
    if expert_axis:
      kwargs["expert_parallel"] = (the_mesh, expert_axis)
  with context(the_mesh, kind):
    xs = place(the_mesh, x, P(token_axes))
    expert_spec = lambda a: P(expert_axis) if a.ndim == 3 and expert_axis else P()  # noqa: E731
    placed = jax.tree.map(lambda a: place(the_mesh, a, expert_spec(a)), state)
    fn = jax.jit(jax.value_and_grad(lambda s, x: loss(s, x, **kwargs), has_aux=True))
    (got_loss, got), grads = fn(placed, xs)
    assert tuple(spec_of(got))[:1] == (token_axes if len(token_axes) > 1 else token_axes[0],)
    text = fn.lower(placed, xs).compile().as_text()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
  # No token activations and no expert weights are gathered: at most router-sized values.
  for gathered in collective_shapes(text, "all-gather"):
    assert "16,24" not in gathered and "24,16" not in gathered and ",16]" not in gathered, (
        gathered)


def test_data_parallel_capacity_is_per_shard():
  # With a capacity factor, each token shard fills its experts' capacity from its own
  # tokens: the result equals the one-device MoE run on each shard's tokens in turn.
  the_mesh = mesh((4,), ("data",))
  model = nn.MoE(4, 16, 24, top_k=1, capacity_factor=1.0, rngs=nnx.Rngs(3),
                 data_parallel=(the_mesh, ("data",)))
  kernel = np.zeros((16, 4), np.float32)
  kernel[:, 0] = 1.0  # everyone prefers expert 0: drops in every shard
  model.router.kernel[...] = jnp.asarray(kernel)
  x = jnp.abs(jax.random.normal(jax.random.key(4), (32, 16)))
  got = nnx.jit(lambda m, x: m(x)[0])(model, place(the_mesh, x, P("data")))
  model.data_parallel = None
  one_device = nnx.jit(lambda m, x: m(x)[0])
  want = jnp.concatenate([one_device(model, shard) for shard in jnp.split(x, 4)])
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  assert float(jnp.abs(got[2:8]).max()) == 0.0  # 8 tokens per shard, capacity 2


@pytest.mark.parametrize("kind", [pytest.param("auto", marks=pytest.mark.slow), "explicit"])
def test_moe_expert_parallel_argument_on_make_mesh(kind):
  # nn.MoE(expert_parallel=(make_mesh(...), "e")) with unsharded tokens
  # (replicated over "e": each device runs its experts, one psum) and sharded ones (routed).
  the_mesh = mesh((8,), ("e",), kind)
  model = nn.MoE(8, 16, 24, top_k=2, rngs=nnx.Rngs(5), expert_parallel=(the_mesh, "e"))
  x = jax.random.normal(jax.random.key(6), (16, 16))
  model.expert_parallel = None
  want = nnx.jit(lambda m, x: m(x)[0])(model, x)
  model.expert_parallel = (the_mesh, "e")
  with jax.set_mesh(the_mesh):
    for spec in (P(), P("e")):
      if kind == "auto" and spec == P("e"):
        model.data_parallel = (the_mesh, ("e",))  # Auto axes: the tokens' layout is said
      got = nnx.jit(lambda m, x: m(x)[0])(model, place(the_mesh, x, spec))
      np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("kind", ["auto", "explicit"])
def test_moe_built_and_run_under_set_mesh_splits_itself(kind):
  # A sharded model as users build it: nnx.eval_shape under jax.set_mesh (logical names the
  # mesh lacks replicate; the expert kernels follow their "expert" name), then the step
  # traced under the same mesh with no mesh argument: on either axis type the layer splits
  # itself at trace time (experts over "expert", tokens over every axis): no custom
  # partitioning call, no expert weight gathered, the one-device result.
  the_mesh = mesh((2, 4), ("data", "expert"), kind)
  make = lambda: nn.MoE(8, 16, 24, top_k=2, rngs=nnx.Rngs(7))  # noqa: E731
  with jax.set_mesh(the_mesh):
    abstract = nnx.eval_shape(make)
  assert abstract.gate_up.kernel.get_value().sharding.spec == P("expert", None, None)
  model = make()
  graphdef, state = nnx.split(model)
  x = jax.random.normal(jax.random.key(8), (32, 16))

  def loss(state, x):
    y, aux = nnx.merge(graphdef, state)(x)
    return jnp.sum(y ** 2) + aux["load_balancing_loss"], y

  step = jax.value_and_grad(loss, has_aux=True)
  (want_loss, want), want_grads = jax.jit(step)(state, x)
  with jax.set_mesh(the_mesh):
    xs = place(the_mesh, x, P(("data", "expert")))
    placed = jax.tree.map(
        lambda a: place(the_mesh, a, P("expert") if a.ndim == 3 else P()), state)
    fn = jax.jit(step)
    (got_loss, got), grads = fn(placed, xs)
    lowered = fn.lower(placed, xs)
    text = lowered.compile().as_text()
  assert "CustomSPMDPartitioning" not in lowered.as_text()
  np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
  np.testing.assert_allclose(got_loss, want_loss, rtol=1e-4)
  for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(a, b, rtol=1e-3, atol=1e-5)
  for gathered in collective_shapes(text, "all-gather"):  # no [8, 16, 48] nor [16, 48]
    assert "16,48" not in gathered and "48,16" not in gathered and "24,16" not in gathered, (
        gathered)


@pytest.mark.parametrize("kind", ["mesh", "auto", "explicit"])
def test_grouped_linear_gradients_on_a_mesh(kind):
  # nn.GroupedLinear on every mesh kind with no mesh argument: its gmm (and the weight
  # gradient's k-grouped gmm) split at trace time; the one-device values.
  the_mesh = mesh((2, 4), ("data", "expert"), kind)
  layer = nn.GroupedLinear(8, 16, 24, rngs=nnx.Rngs(9))
  graphdef, state = nnx.split(layer)
  x, _ = operands(3)
  x = x[:, :16]
  loss = lambda s, x: jnp.sum(nnx.merge(graphdef, s)(x, SIZES) ** 2)  # noqa: E731
  grad = jax.value_and_grad(loss, argnums=(0, 1))
  want = jax.jit(grad)(state, x)
  with context(the_mesh, kind):
    xs = place(the_mesh, x, P("data"))
    placed = jax.tree.map(lambda a: place(the_mesh, a, P("expert")), state)
    lowered = jax.jit(grad).lower(placed, xs)
    got = jax.jit(grad)(placed, xs)
  assert "CustomSPMDPartitioning" not in lowered.as_text()
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_explicit_axes_split_composes_with_vmap_and_jvp():
  # The trace-time split under vmap over each operand and under forward-mode jax.jvp: the
  # same values as one device, the batch dim unsharded, the rows keeping their axis.
  the_mesh = mesh((2, 4), ("d", "e"), "explicit")
  x, w = operands(4)
  xb = jnp.stack([x, 2 * x, -x])
  wb = jnp.stack([w, 0.5 * w])
  f = lambda x, w: gmm_jax.gmm(x, w, SIZES, activation="silu")  # noqa: E731
  want_x = jax.vmap(f, in_axes=(0, None))(xb, w)
  want_w = jax.vmap(f, in_axes=(None, 0))(x, wb)
  tangents = (jnp.ones_like(x), jnp.ones_like(w))
  want_jvp = jax.jvp(f, (x, w), tangents)
  with jax.set_mesh(the_mesh):
    xs, ws = jax.device_put(xb, P(None, "d")), jax.device_put(w, P("e"))
    got_x = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, ws)
    got_w = jax.jit(jax.vmap(f, in_axes=(None, 0)))(xs[0], jax.device_put(wb, P(None, "e")))
    got_jvp = jax.jit(lambda a, b, ta, tb: jax.jvp(f, (a, b), (ta, tb)))(
        xs[0], ws, jax.device_put(tangents[0], P("d")), jax.device_put(tangents[1], P("e")))
  assert spec_of(got_x)[:2] == (None, "d")
  np.testing.assert_allclose(got_x, want_x, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(got_w, want_w, rtol=1e-5, atol=1e-5)
  for got, want in zip(got_jvp, want_jvp):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
