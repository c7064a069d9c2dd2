"""Sharded gmm on 8 host CPU devices: every strategy against the numpy float64 oracle and
against the single-device result, forward and gradient, with the compiled HLO checked for
the promised communication (no all-gather of the weights or of the tokens; one all-reduce
where a reduction is needed)."""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax import GmmSharding, quantize
from gmm_jax._src.sharding import strategy
from gmm_jax._src.op import lowering
from gmm_jax._src.core.config import GmmConfig
from jax.sharding import NamedSharding, PartitionSpec as P
from grids import covering
from meshes import collectives, mesh
from oracle import dequantize, f64, gmm_oracle, gmm_oracle_vjp, tolerances, vjp_tolerances

M, K, N, G = 64, 32, 16, 8
SIZES = [5, 0, 9, 3, 12, 0, 7, 20]  # sum 56 < M: rows past the total, empty groups


MESHES = {
    "8": ((8,), ("e",)),
    "2x4": ((2, 4), ("d", "e")),
    "4x2": ((4, 2), ("d", "e")),
}


def operands(seed=0):
  rng = np.random.default_rng(seed)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((G, K, N)) / np.sqrt(K), jnp.float32)
  b = jnp.asarray(rng.standard_normal((G, N)), jnp.float32)
  return x, w, b


FORMS = ["GmmSharding", "jit", "explicit"]


def run_case(the_mesh, lhs_spec, rhs_spec, *, group_type="m", sizes=SIZES, x=None, w=None,
             b=None, transpose_lhs=False, activation="silu", form="GmmSharding"):
  """Forward and gradient on placed operands against one device, and their collectives.

  form: "GmmSharding" (the explicit form), "jit" (plain jit: the operands' shardings
  alone; the gradient jit is told to keep the operands' shardings, as a training step
  does by updating the parameters in place) or "explicit" (the same mesh with Explicit
  axes under `jax.set_mesh`: the layout is in the operands' types and the gmm splits
  itself at trace time)."""
  if form == "explicit":
    the_mesh = mesh(the_mesh.axis_sizes, the_mesh.axis_names, "explicit")
    if isinstance(w, gmm_jax.QArray):  # placed by the caller on the Auto mesh
      w = jax.tree.map(lambda a: jax.device_put(a, NamedSharding(the_mesh, a.sharding.spec)),
                       w)
    with jax.set_mesh(the_mesh):
      return run_case(the_mesh, lhs_spec, rhs_spec, group_type=group_type, sizes=sizes, x=x,
                      w=w, b=b, transpose_lhs=transpose_lhs, activation=activation,
                      form="typed")
  sharding = GmmSharding(the_mesh, lhs_spec, rhs_spec) if form == "GmmSharding" else None
  kwargs = dict(group_type=group_type, bias=b, activation=activation,
                transpose_lhs=transpose_lhs)
  sizes = jnp.asarray(sizes, jnp.int32)
  place = lambda a, spec: jax.device_put(a, NamedSharding(the_mesh, spec))  # noqa: E731
  xs = place(x, lhs_spec)
  ws = jax.tree.map(lambda a: a, w)
  if not isinstance(w, gmm_jax.QArray):
    ws = place(w, rhs_spec)

  fwd = jax.jit(lambda x, w, s: gmm_jax.gmm(x, w, s, sharding=sharding, **kwargs))
  got = fwd(xs, ws, sizes)
  want = gmm_jax.gmm(x, w, sizes, **kwargs)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  # ... and both against numpy (a bug shared by the sharded and single-device paths).
  w_values = dequantize(w) if isinstance(w, gmm_jax.QArray) else f64(w)
  oracle_options = dict(group_type=group_type, bias=b, activation=activation,
                        transpose_lhs=transpose_lhs)
  contraction = x.shape[0] if transpose_lhs else x.shape[1]
  np.testing.assert_allclose(f64(got), gmm_oracle(x, w_values, sizes, **oracle_options),
                             **tolerances(jnp.float32, k=contraction))
  fwd_hlo = collectives(fwd.lower(xs, ws, sizes).compile().as_text())

  grad_hlo = None
  if not isinstance(w, gmm_jax.QArray):
    cot = jnp.asarray(np.random.default_rng(1).standard_normal(want.shape), jnp.float32)
    loss = lambda sharding: (lambda x, w: jnp.sum(  # noqa: E731
        gmm_jax.gmm(x, w, sizes, sharding=sharding, **kwargs) * cot))
    grad = jax.jit(jax.grad(loss(sharding), argnums=(0, 1)),
                   out_shardings=None if sharding else (xs.sharding, ws.sharding))
    got_grads = grad(xs, ws)
    want_grads = jax.grad(loss(None), argnums=(0, 1))(x, w)
    for g, wg in zip(got_grads, want_grads):
      np.testing.assert_allclose(g, wg, rtol=1e-4, atol=1e-4)
    oracle_grads = gmm_oracle_vjp(x, w, sizes, cotangent=cot, **oracle_options)
    tols = vjp_tolerances(jnp.float32, x, w, sizes, group_type, cot, activation=activation,
                          transpose_lhs=transpose_lhs)
    for name, g, wg in zip(("lhs", "rhs"), got_grads, oracle_grads):
      np.testing.assert_allclose(f64(g), wg, err_msg=f"d{name}", **tols[name])
    grad_hlo = collectives(grad.lower(xs, ws).compile().as_text())
    # Gradients keep the operands' sharding.
    assert got_grads[1].sharding.is_equivalent_to(ws.sharding, w.ndim)
  return fwd_hlo, grad_hlo


@covering(("mesh_name", list(MESHES)), ("form", FORMS))
def test_expert_parallel(mesh_name, form):
  shape, names = MESHES[mesh_name]
  the_mesh = mesh(shape, names)
  x, w, b = operands()
  # Experts over "e"; tokens replicated (8) or sharded over "d" (2x4, 4x2).
  lhs_spec = P("d") if "d" in names else P()
  fwd, grad = run_case(the_mesh, lhs_spec, P("e"), x=x, w=w, b=b, form=form)
  assert fwd["all-gather"] == 0 and fwd["all-to-all"] == 0
  assert fwd["all-reduce"] + fwd["reduce-scatter"] == 1  # the one combine of rows
  assert grad["all-gather"] == 0  # dw stays expert-sharded; dx is reduced, not gathered


@pytest.mark.parametrize("mesh_name", ["8", "2x4"])
@pytest.mark.parametrize("form", FORMS)
def test_rows(mesh_name, form):
  shape, names = MESHES[mesh_name]
  the_mesh = mesh(shape, names)
  x, w, b = operands(2)
  rows = P(names) if len(names) > 1 else P("e")  # M over every device
  fwd, grad = run_case(the_mesh, rows, P(), x=x, w=w, b=b, form=form)
  assert sum(fwd.values()) == 0  # local group sizes from the global offsets: no communication
  assert grad["all-gather"] == 0  # the weight gradient is reduced over rows, never gathered


@pytest.mark.parametrize("form", FORMS)
def test_columns_and_contraction(form):
  the_mesh = mesh((2, 4), ("d", "t"))
  x, w, b = operands(3)
  fwd, _ = run_case(the_mesh, P("d"), P(None, None, "t"), x=x, w=w, b=b, form=form)
  assert sum(fwd.values()) == 0  # N-sharded weights: nothing moves
  fwd, grad = run_case(the_mesh, P(None, "t"), P(None, "t"), x=x, w=w, b=b, form=form)
  assert fwd["all-gather"] == 0 and fwd["all-reduce"] == 1  # one psum of partial products
  assert grad["all-gather"] == 0


@pytest.mark.parametrize("mesh_name", ["8", "4x2"])
@pytest.mark.parametrize("form", FORMS)
def test_k_grouping_weight_gradient_form(mesh_name, form):
  # dW = gmm_k(x^T, dz): tokens are the grouped contraction, sharded over the data axis in
  # both operands: a local k-gmm per device, then one reduction.
  shape, names = MESHES[mesh_name]
  the_mesh = mesh(shape, names)
  rng = np.random.default_rng(4)
  tokens = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)  # stored [tokens, K]
  dz = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  data = P(names[0]) if len(names) == 1 else P(names)
  b = jnp.asarray(rng.standard_normal((G, N)), jnp.float32)
  fwd, grad = run_case(the_mesh, data, data, group_type="k", x=tokens, w=dz, b=b,
                       transpose_lhs=True, activation="relu", form=form)
  assert fwd["all-gather"] == 0 and fwd["all-reduce"] == 1
  assert grad["all-gather"] == 0


@pytest.mark.parametrize("form", FORMS)
def test_quantized_weights_sharded_on_experts(form):
  the_mesh = mesh((2, 4), ("d", "e"))
  x, w, b = operands(5)
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  placed = gmm_jax.QArray(
      jax.device_put(wq.qvalue, NamedSharding(the_mesh, P("e"))),
      jax.device_put(wq.scale, NamedSharding(the_mesh, P("e"))))
  fwd, _ = run_case(the_mesh, P("d"), P("e"), x=x, w=placed, b=b, form=form)
  assert fwd["all-gather"] == 0 and fwd["all-reduce"] + fwd["reduce-scatter"] == 1


def test_explain_names_the_strategy_and_implementation():
  the_mesh = mesh((2, 4), ("d", "e"))
  x, w, _ = operands()
  text = gmm_jax.explain(x, w, jnp.asarray(SIZES), sharding=GmmSharding(the_mesh, P("d"),
                                                                       P("e")))
  assert "expert + rows" in text and "psum over ('e',)" in text
  assert "2 local groups" in text and ": xla" in text


@pytest.mark.parametrize("lhs_spec, rhs_spec, error, match", [
    (P("e"), P("e"), NotImplementedError, "routed_gmm"),
    (P(None, "t"), P(), NotImplementedError, "shard K differently"),
    (P(), P("x"), ValueError, "not in the mesh"),
])
def test_sharding_errors(lhs_spec, rhs_spec, error, match):
  the_mesh = mesh((2, 4), ("e", "t"))
  x, w, _ = operands()
  with pytest.raises(error, match=match):
    gmm_jax.gmm(x, w, jnp.asarray(SIZES), sharding=GmmSharding(the_mesh, lhs_spec, rhs_spec))


@covering(("capacity", [None, 2]), ("transport", ["all_to_all", "ragged"]))
def test_routed_gmm(capacity, transport):
  # Tokens and experts both over the 8 devices: route, compute, route back.
  the_mesh = mesh((8,), ("e",))
  rng = np.random.default_rng(6)
  tokens, experts = 64, 16
  x = jnp.asarray(rng.standard_normal((tokens, K)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((experts, K, N)) / np.sqrt(K), jnp.float32)
  b = jnp.asarray(rng.standard_normal((experts, N)), jnp.float32)
  # With a capacity, route to 4 popular experts (devices 0 and 1) so that some overflow.
  ids = jnp.asarray(rng.integers(0, experts if capacity is None else 4, tokens), jnp.int32)
  place = lambda a: jax.device_put(a, NamedSharding(the_mesh, P("e")))  # noqa: E731
  f = jax.jit(lambda x, w, b: gmm_jax.routed_gmm(x, w, ids, mesh=the_mesh, axis="e", bias=b,
                                                 activation="silu", capacity=capacity,
                                                 transport=transport))
  got = f(place(x), place(w), place(b))
  want = jax.nn.silu(jnp.einsum("tk,tkn->tn", x, w[ids]) + b[ids])
  if capacity is not None:  # tokens past a (source, destination) pair's capacity give 0
    dest = np.asarray(ids) // 2
    kept = np.zeros(tokens, bool)
    for src in range(8):
      mine = np.arange(src * 8, src * 8 + 8)
      for d in range(8):
        to_d = mine[np.argsort(np.asarray(ids)[mine], kind="stable")]
        to_d = to_d[dest[to_d] == d]
        kept[to_d[:capacity]] = True
    assert not kept.all()
    want = jnp.where(kept[:, None], want, 0.0)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  hlo = collectives(f.lower(place(x), place(w), place(b)).compile().as_text())
  if transport == "all_to_all":
    assert hlo["all-to-all"] >= 2 and hlo["all-gather"] == 0  # weights stay put
  if capacity is None:
    grads = jax.jit(jax.grad(lambda x, w: jnp.sum(gmm_jax.routed_gmm(
        x, w, ids, mesh=the_mesh, axis="e", activation="silu", transport=transport) ** 2),
        argnums=(0, 1)))(
            place(x), place(w))
    want_grads = jax.grad(lambda x, w: jnp.sum(jax.nn.silu(
        jnp.einsum("tk,tkn->tn", x, w[ids])) ** 2), argnums=(0, 1))(x, w)
    for g, wg in zip(grads, want_grads):
      np.testing.assert_allclose(g, wg, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("platform", ["tpu", "cuda"])
def test_routed_gmm_ragged_lowers_for_accelerators(platform):
  # On GPU/TPU "auto" uses the real ragged_all_to_all (XLA:CPU cannot run it): the forward
  # and the gradient lower for both platforms, picked by the lowering platform alone.
  the_mesh = mesh((8,), ("e",))
  rng = np.random.default_rng(7)
  x = jnp.asarray(rng.standard_normal((64, K)), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((16, K, N)), jnp.bfloat16)
  ids = jnp.asarray(rng.integers(0, 16, 64), jnp.int32)

  # The local gmm is the XLA path here: jax >= 0.11 lowers Triton only under an abstract
  # GPU mesh, which shard_map's own mesh excludes (the kernels' CUDA lowering is tested in
  # test_pallas_triton.py).
  def loss(x, w):
    return jnp.sum(gmm_jax.routed_gmm(x, w, ids, mesh=the_mesh, axis="e",
                                      implementation="xla").astype(jnp.float32))

  text = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, w).lower(
      lowering_platforms=(platform,)).as_text()
  assert "ragged_all_to_all" in text or "ragged-all-to-all" in text


def test_explain_reports_what_plain_jit_chose():
  the_mesh = mesh((2, 4), ("d", "e"))
  x, w, _ = operands()
  xs = jax.device_put(x, NamedSharding(the_mesh, P("e")))  # tokens on the experts' axis
  ws = jax.device_put(w, NamedSharding(the_mesh, P("e")))
  text = gmm_jax.explain(xs, ws, jnp.asarray(SIZES))
  assert "sharding: sharding strategy: expert" in text
  assert "custom_partitioning" in text  # the mechanism: the partitioning rule
  assert "gathered along it" in text and "routed_gmm" in text  # the conflict is named
  assert "2 local groups" in text and ": xla" in text


def test_explain_reports_the_trace_time_split_on_explicit_axes():
  the_mesh = mesh((2, 4), ("d", "e"), "explicit")
  x, w, _ = operands()
  with jax.set_mesh(the_mesh):
    xs = jax.device_put(x, P("d"))
    ws = jax.device_put(w, P("e"))
    text = gmm_jax.explain(xs, ws, jnp.asarray(SIZES))
  assert "sharding: sharding strategy: expert + rows" in text
  assert "split at trace time" in text and "custom_partitioning" not in text


def test_explain_names_the_tpu_fallback_and_its_fix(monkeypatch):
  # Plain jit on Auto axes explained for TPU: no partitioner splits a kernel there, so the
  # gmm runs as the dense reference that XLA partitions; explain says so and names the fix.
  the_mesh = mesh((2, 4), ("d", "e"))
  x, w, _ = operands()
  xs = jax.device_put(x, NamedSharding(the_mesh, P("d")))
  ws = jax.device_put(w, NamedSharding(the_mesh, P("e")))
  monkeypatch.setattr(lowering, "FALLBACK_WARNED", [])  # warned once per process
  with pytest.warns(UserWarning, match="jax.set_mesh"):
    text = gmm_jax.explain(xs, ws, jnp.asarray(SIZES), platform="tpu")
  assert "not split by gmm_jax" in text and "'reference'" in text
  assert "jax.set_mesh" in text and "expert_parallel" in text


@pytest.mark.parametrize("lhs_spec, rhs_spec, out_spec, want, note", [
    (P("d"), P("e"), None, dict(m=("d",), g=("e",)), None),
    (P(None, "t"), P(), None, dict(k=("t",)), None),  # rhs sliced along K for free
    (P(), P(), P(None, "t"), dict(n=("t",)), None),  # the partitioner asks for N sharded
    (P("e"), P("e"), None, dict(g=("e",)), "gathered along it"),  # experts keep the axis
    (P(), P(None, None, "x3"), None, {}, "does not split"),  # N=16 over 3 devices
])
def test_choose_resolves_any_layout(lhs_spec, rhs_spec, out_spec, want, note):
  cfg = GmmConfig(group_type="m", num_local=G)
  plan = strategy.choose({"d": 2, "e": 4, "t": 2, "x3": 3}, cfg, [(M, K)], [(G, K, N)],
                         lhs_spec, rhs_spec, out_spec)
  got = {name: getattr(plan, name) for name in "mkng" if getattr(plan, name)}
  assert got == want
  if note:
    assert any(note in n for n in plan.notes), plan.notes


def test_routed_apply_needs_a_mesh():
  x = jnp.ones((16, K))
  with pytest.raises(ValueError, match="needs a mesh"):
    gmm_jax.routed_gmm(x, jnp.ones((G, K, N)), jnp.zeros((16,), jnp.int32), axis="e")
