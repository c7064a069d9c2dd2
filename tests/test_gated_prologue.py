"""The gated prologue (``gmm(z, w, lhs_activation=...)``): lhs ``[M, 2K]`` read as
``act(z)``, whose input gradient the dlhs gmm writes in its epilogue (`GmmConfig.cotangent_of`).

The option space (every implementation x transformation) is drawn by
tests/test_combinations.py (`combinations.Case.lhs_activation`); these tests hold the parts
the draws do not name: the refusals, the one-gmm input gradient, the TPU kernel's epilogue
(served, refused for partial tiles), the MoE layer's option and the explicit-sharding types
of the cotangents.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads
from jax.sharding import NamedSharding, PartitionSpec as P
from oracle import GATED, f64, gmm_oracle

import gmm_jax
from gmm_jax.tools import bench_moe
from gmm_jax._src.backends import registry

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

SIZES = (60, 0, 100, 40)  # 200 of 256 rows; an empty group; 56 rows past the total


def _operands(m=256, k=128, n=128, dtype=jnp.float32, seed=0):
  rng = np.random.default_rng(seed)
  z = jnp.asarray(rng.uniform(-2, 2, (m, 2 * k)), dtype)
  w = jnp.asarray(rng.uniform(-1, 1, (len(SIZES), k, n)) / np.sqrt(k), dtype)
  sizes = SIZES if m >= 256 else (m // 4, 0, m // 2, m // 8)
  return z, w, jnp.asarray(sizes, jnp.int32)


def _oracle(name, z, w, sizes):
  x = f64(jnp.asarray(GATED[name](f64(z)).astype(np.float32), z.dtype))
  return gmm_oracle(x, f64(w), np.asarray(sizes), "m")


# Every activation on every implementation; the reference's repeats of the rarer two (the
# XLA path's composition in jnp again) run with -m slow.
@pytest.mark.parametrize("name, implementation", [
    (name, implementation) if name in ("swiglu", "geglu") or implementation != "reference"
    else pytest.param(name, implementation, marks=pytest.mark.slow)
    for name in ("swiglu", "geglu", "geglu_tanh", "swiglu_clamped")
    for implementation in ("reference", "xla", "pallas_tpu", "pallas_triton")])
def test_equals_the_oracle_and_its_gradient_is_the_composition(name, implementation):
  z, w, sizes = _operands()
  options = dict(implementation=implementation, interpret=implementation.startswith("pallas"))
  f = lambda z, w: gmm_jax.gmm(z, w, sizes, lhs_activation=name, **options)  # noqa: E731
  np.testing.assert_allclose(f64(f(z, w)), _oracle(name, z, w, sizes), rtol=1e-5, atol=1e-5)
  # The composition: the activation in jnp, then the plain gmm on the xla path.
  composed = lambda z, w: gmm_jax.gmm(  # noqa: E731
      gmm_jax._src.core.epilogue.gated_halves_f32(name, z), w, sizes)
  ct = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (z.shape[0], w.shape[-1])),
                   jnp.float32)
  got = jax.vjp(f, z, w)[1](ct)
  want = jax.vjp(composed, z, w)[1](ct)
  for g, r, what in zip(got, want, ("dz", "dw")):
    np.testing.assert_allclose(f64(g), f64(r), rtol=1e-5, atol=1e-5, err_msg=what)


def test_second_derivatives():
  z, w, sizes = _operands(m=32, k=8, n=8)
  sizes = jnp.asarray([8, 0, 12, 4], jnp.int32)
  f = lambda z, w: gmm_jax.gmm(z, w, sizes, lhs_activation="swiglu")  # noqa: E731
  check_grads(f, (z, w), order=2, modes=("fwd", "rev"), atol=2e-2, rtol=2e-2)


def test_the_input_gradient_is_one_gmm():
  # The transpose of the prologue's tangent gmm is a gmm with the gated-cotangent epilogue:
  # no separate activation cotangent, no [M, K] intermediate.
  z, w, sizes = _operands(m=32, k=8, n=8)
  grad = jax.grad(lambda z: jnp.sum(gmm_jax.gmm(z, w, sizes, lhs_activation="geglu") ** 2))
  eqns = jax.make_jaxpr(grad)(z).eqns
  gmms = [e for e in eqns if e.primitive.name.startswith("gmm_jax")]
  cotangents = [e for e in gmms if e.params["cfg"].cotangent_of == "geglu"]
  assert len(cotangents) == 1, [e.params["cfg"] for e in gmms]
  (dz,) = cotangents[0].outvars
  assert dz.aval.shape == z.shape and dz.aval.dtype == z.dtype


def _primitive_names(jaxpr):
  return [e.primitive.name for e in jaxpr.eqns]


def test_the_tangent_along_both_operands_is_one_linear_op():
  # The two tangent terms (along z: the dlhs gmm's source; along w: act(z) @ t_w) are one
  # primitive, so that one transpose rule sees both products of the backward.
  z, w, sizes = _operands(m=32, k=8, n=8)
  f = lambda z, w: gmm_jax.gmm(z, w, sizes, lhs_activation="swiglu")  # noqa: E731
  _, linear = jax.linearize(f, z, w)
  names = _primitive_names(jax.make_jaxpr(linear)(z, w).jaxpr)
  assert names.count("gmm_jax_prologue_tangent") == 1, names
  # Along one operand alone it stays the one tangent gmm.
  _, along_z = jax.linearize(lambda z: f(z, w), z)
  assert "gmm_jax_prologue_tangent" not in _primitive_names(jax.make_jaxpr(along_z)(z).jaxpr)


def test_the_backward_computes_the_weight_gradient_before_the_input_gradient():
  # The transpose emits the weight gradient (k-grouped), then `after_on_tpu` ties the
  # cotangent to it, then the dlhs gmm that writes dz reads that cotangent: on a TPU, z's
  # last reader is the dlhs gmm (the measured order, benchmarks/log.md).
  z, w, sizes = _operands(m=32, k=8, n=8)
  grad = jax.grad(lambda z, w: jnp.sum(gmm_jax.gmm(z, w, sizes, lhs_activation="swiglu")
                                       ** 2), argnums=(0, 1))
  eqns = jax.make_jaxpr(grad)(z, w).eqns
  gmms = [i for i, e in enumerate(eqns) if e.primitive.name.startswith("gmm_jax_gmm")]
  (weights,) = [i for i in gmms if eqns[i].params["cfg"].group_type == "k"]
  (inputs,) = [i for i in gmms if eqns[i].params["cfg"].cotangent_of == "swiglu"]
  (after,) = [i for i, e in enumerate(eqns) if e.primitive.name == "gmm_jax_after_on_tpu"]
  assert weights < after < inputs
  assert eqns[after].invars[1] is eqns[weights].outvars[0]
  assert eqns[inputs].invars[0] is eqns[after].outvars[0]


def test_after_on_tpu_is_a_barrier_on_tpu_only():
  from gmm_jax._src.op.prologue_tangent import after_on_tpu
  x, y = jnp.ones((8, 4)), jnp.ones((2, 4, 4))
  f = jax.jit(after_on_tpu)
  texts = {platform: jax.export.export(f, platforms=[platform])(x, y).mlir_module()
           for platform in ("cpu", "tpu", "cuda")}
  assert "optimization_barrier" in texts["tpu"]
  assert "optimization_barrier" not in texts["cpu"]
  assert "optimization_barrier" not in texts["cuda"]
  np.testing.assert_array_equal(f(x, y), x)
  # The identity in its first operand under every transformation.
  assert jax.grad(lambda x: jnp.sum(after_on_tpu(x, y) * 3.0))(x).tolist() == (
      np.full((8, 4), 3.0).tolist())
  np.testing.assert_array_equal(jax.vmap(after_on_tpu, in_axes=(0, None))(x, y), x)
  np.testing.assert_array_equal(jax.jvp(lambda x: after_on_tpu(x, y), (x,), (x * 2,))[1],
                                x * 2)


@pytest.mark.parametrize("axes", [(None, 0), (0, None), (0, 0)])
def test_vmapped_gradients_along_both_operands(axes):
  # vmap over each operand of the gradient (the joint tangent's batching rule) against
  # the composition (the activation in jnp, then the plain gmm).
  z, w, sizes = _operands(m=32, k=8, n=8)
  zs = jnp.stack([z, z * 0.5 + 0.1]) if axes[0] == 0 else z
  ws = jnp.stack([w, -w]) if axes[1] == 0 else w

  def grads(fn):
    return jax.vmap(jax.grad(lambda z, w: jnp.sum(jnp.sin(fn(z, w))), argnums=(0, 1)),
                    in_axes=axes)(zs, ws)

  got = grads(lambda z, w: gmm_jax.gmm(z, w, sizes, lhs_activation="geglu"))
  want = grads(lambda z, w: gmm_jax.gmm(gmm_jax._src.core.epilogue.gated_halves_f32("geglu", z),
                                        w, sizes))
  for g, r in zip(got, want):
    np.testing.assert_allclose(f64(g), f64(r), rtol=1e-5, atol=1e-5)


KERNELS = ["pallas_tpu", "pallas_triton"]


@pytest.mark.parametrize("implementation", KERNELS)
def test_the_kernel_writes_the_cotangent(implementation):
  z, w, sizes = _operands(dtype=jnp.bfloat16)
  f = lambda z: gmm_jax.gmm(z, w, sizes, lhs_activation="swiglu",  # noqa: E731
                            implementation=implementation, interpret=True)
  with registry.record() as decisions:  # a fresh jit lowers anew (decisions are recorded)
    jax.jit(jax.grad(lambda z: jnp.sum(f(z).astype(jnp.float32)))).lower(z)
  (epilogue,) = [d for d in decisions if d.cfg.cotangent_of is not None]
  assert epilogue.implementation == implementation and epilogue.materialized == (), epilogue


@pytest.mark.parametrize("implementation", KERNELS)
@pytest.mark.parametrize("name", ["swiglu", "geglu"])
def test_the_kernel_applies_the_prologue(name, implementation):
  # The forward reads z's gate and up K blocks and applies the activation before its dot:
  # no [M, K] input is formed around the kernel. Its tangent gmm is composed.
  z, w, sizes = _operands(dtype=jnp.bfloat16)
  f = lambda z: gmm_jax.gmm(z, w, sizes, lhs_activation=name,  # noqa: E731
                            implementation=implementation, interpret=True)
  with registry.record() as decisions:  # a fresh jit lowers anew (decisions are recorded)
    jax.jit(lambda z: f(z)).lower(z)
  (forward,) = decisions
  assert forward.implementation == implementation and forward.materialized == (), forward
  np.testing.assert_allclose(f64(f(z)), _oracle(name, z, w, sizes), rtol=2e-2, atol=2e-2)
  with registry.record() as decisions:
    jax.jit(lambda z: jax.jvp(f, (z,), (z,))).lower(z)
  assert any("gated_lhs" in d.materialized for d in decisions if d.cfg.lhs_tangent), decisions


@pytest.mark.parametrize("name", ["swiglu", "geglu_tanh", "swiglu_clamped"])
def test_the_triton_kernel_fuses_both_ends_with_the_moe_rows(name):
  # The fused layer's calls: the down gmm reads z through its prologue, weights its rows
  # and scatters them to their slots; its dlhs gmm gathers the slots' cotangent rows,
  # weights them and writes dz [R, 2F] in its epilogue. Odd sizes mask every edge (M, K,
  # N, a group's last tile). In-kernel, against the float64 oracle and the XLA path.
  rng = np.random.default_rng(3)
  m, k, n, slots = 100, 40, 24, 130
  sizes = jnp.asarray([30, 0, 50, 12], jnp.int32)  # 92 of 100 rows
  z = jnp.asarray(rng.uniform(-2, 2, (m, 2 * k)), jnp.float32)
  w = jnp.asarray(rng.uniform(-1, 1, (4, k, n)) / np.sqrt(k), jnp.float32)
  weights = jnp.asarray(rng.uniform(0.1, 1, m), jnp.float32)
  out_indices = jnp.asarray(rng.permutation(slots)[:m], jnp.int32)
  f = lambda impl, z, w: gmm_jax.gmm(  # noqa: E731
      z, w, sizes, lhs_activation=name, row_weights=weights, out_indices=out_indices,
      out_rows=slots, implementation=impl, interpret=impl == "pallas_triton")
  x = f64(jnp.asarray(GATED[name](f64(z)).astype(np.float32)))
  want = np.zeros((slots, n))
  rows = gmm_oracle(x, f64(w), np.asarray(sizes), "m") * f64(weights)[:, None]
  written = np.arange(m) < int(np.sum(sizes))
  want[np.asarray(out_indices)[written]] = rows[written]
  ct = jnp.asarray(rng.uniform(-1, 1, (slots, n)), jnp.float32)
  with registry.record() as decisions:
    y, pull = jax.vjp(functools.partial(f, "pallas_triton"), z, w)
    got = pull(ct)
  fused = [(d.cfg.lhs_activation, d.cfg.cotangent_of) for d in decisions
           if d.implementation == "pallas_triton" and not d.materialized]
  assert (name, None) in fused and (None, name) in fused, decisions
  np.testing.assert_allclose(f64(y), want, rtol=1e-5, atol=1e-5)
  for g, r, what in zip(got, jax.vjp(functools.partial(f, "xla"), z, w)[1](ct), ("dz", "dw")):
    np.testing.assert_allclose(f64(g), f64(r), rtol=1e-5, atol=1e-5, err_msg=what)


@pytest.mark.parametrize("options, match", [
    (dict(activation="swiglu"), "no gated activation of its own"),
    (dict(out_rows=130), "unscattered"),
])
def test_the_triton_kernel_refuses_other_cotangent_epilogues(options, match):
  # Served around the plain kernel by the dispatcher instead (the message is its reason).
  from gmm_jax._src.core.config import GmmConfig
  from gmm_jax._src.core.epilogue import Rows
  from gmm_jax.pallas.gpu import triton
  z, w, sizes = _operands(m=32, k=8, n=8)
  cfg = GmmConfig(group_type="m", num_local=4, cotangent_of="swiglu", interpret=True,
                  **options)
  ct = jnp.ones((32, 8), jnp.float32)
  rows = Rows(None, None, jnp.arange(32, dtype=jnp.int32) if "out_rows" in options else None,
              jnp.ones((32, 16), jnp.float32))
  with pytest.raises(NotImplementedError, match=match):
    triton.gmm_triton(ct, w, sizes, jnp.int32(0), None, cfg, rows=rows)


def test_the_tpu_kernel_composes_partial_tiles():
  # M = 200 is no multiple of a row tile: the kernel refuses its epilogue (whole-tile DMAs)
  # and the dispatcher forms the cotangent after the plain kernel; the values are the same.
  z, w, sizes = _operands(m=200)
  sizes = jnp.asarray([60, 0, 100, 20], jnp.int32)
  loss = lambda impl, z: jnp.sum(gmm_jax.gmm(  # noqa: E731
      z, w, sizes, lhs_activation="swiglu", implementation=impl,
      interpret=impl == "pallas_tpu") ** 2)
  with registry.record() as decisions:  # a fresh jit lowers anew (decisions are recorded)
    jax.jit(lambda z: jax.grad(functools.partial(loss, "pallas_tpu"))(z)).lower(z)
  got = jax.grad(functools.partial(loss, "pallas_tpu"))(z)
  (epilogue,) = [d for d in decisions if d.cfg.cotangent_of is not None]
  assert "gated_cotangent" in epilogue.materialized, epilogue
  np.testing.assert_allclose(f64(got), f64(jax.grad(functools.partial(loss, "xla"))(z)),
                             rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("options, error, match", [
    (dict(lhs_activation="silu"), ValueError, "gated activation"),
    (dict(lhs_activation="swiglu", group_type="k"), NotImplementedError, "m-grouped"),
    (dict(lhs_activation="swiglu", transpose_lhs=True), NotImplementedError, "transpose_lhs"),
    (dict(lhs_activation="swiglu", lhs_indices=jnp.zeros(32, jnp.int32)),
     NotImplementedError, "lhs_indices"),
])
def test_refusals(options, error, match):
  z, w, _ = _operands(m=32, k=8, n=8)
  with pytest.raises(error, match=match):
    gmm_jax.gmm(z, w, jnp.asarray([8, 0, 12, 4], jnp.int32), **options)


def test_shape_mismatch_names_the_shapes():
  z, w, sizes = _operands(m=32, k=8, n=8)
  with pytest.raises(ValueError, match=r"\[M, 2K\].*\(32, 12\) has 12 columns.*needs 16"):
    gmm_jax.gmm(z[:, :12], w, sizes, lhs_activation="swiglu")
  with pytest.raises(ValueError, match="float"):
    gmm_jax.gmm(z.astype(jnp.int8), w.astype(jnp.int8), sizes, lhs_activation="swiglu")


def test_quantized_weights_are_refused():
  z, w, sizes = _operands(m=32, k=8, n=8)
  q = gmm_jax.quantize(w, jnp.int8, channelwise_axes=(0, 2))
  with pytest.raises(NotImplementedError, match="quantized"):
    gmm_jax.gmm(z, q, sizes, lhs_activation="swiglu")


@pytest.mark.parametrize("dtype", [jnp.float32, pytest.param(jnp.bfloat16,
                                                              marks=pytest.mark.slow)])
def test_moe_gated_prologue_has_the_same_gradients(dtype):
  # ExpertFFN(gated_prologue=True): the same function; for one cotangent the same
  # gradients (bitwise on the xla path: the same products, the same roundings).
  params = bench_moe.layout("moe_fused", bench_moe.init_params(jax.random.key(0), 32, 48, 4,
                                                                dtype))
  x = jax.random.normal(jax.random.key(1), (64, 32), dtype)

  def block(prologue, params, x):
    top_p, top_e = bench_moe._router(params, x, 2)
    spec = gmm_jax.ExpertFFN(4, "silu", gated=True, gated_prologue=prologue,
                             options=(("preferred_element_type", x.dtype),))
    y, _ = gmm_jax.routed_experts(spec, x, top_e, top_p,
                                  dict(w_in=params["gate_up"], w_down=params["down"]))
    return y

  y0, pull0 = jax.vjp(functools.partial(block, False), params, x)
  y1, pull1 = jax.vjp(functools.partial(block, True), params, x)
  tol = 0 if dtype == jnp.float32 else 2e-2  # bf16: z rounded before the activation
  np.testing.assert_allclose(f64(y1), f64(y0), rtol=tol, atol=tol)
  ct = jax.random.normal(jax.random.key(2), y0.shape, y0.dtype)
  for g1, g0 in zip(jax.tree.leaves(pull1(ct)), jax.tree.leaves(pull0(ct))):
    np.testing.assert_array_equal(np.asarray(g1), np.asarray(g0))


def _prologues_traced(prologue, options=()):
  """The lhs_activation values of the gmms in nn.MoE's routed experts' jaxpr."""
  params = bench_moe.layout("moe_fused", bench_moe.init_params(jax.random.key(0), 32, 48, 4))
  x = jax.random.normal(jax.random.key(1), (64, 32))

  def block(params, x):
    top_p, top_e = bench_moe._router(params, x, 2)
    spec = gmm_jax.ExpertFFN(4, "silu", gated=True, gated_prologue=prologue,
                             options=tuple(options))
    return gmm_jax.routed_experts(spec, x, top_e, top_p,
                                  dict(w_in=params["gate_up"], w_down=params["down"]))[0]

  return set(re.findall(r"lhs_activation=([^,)\s]*)", str(jax.make_jaxpr(block)(params, x))))


@pytest.mark.parametrize("platform, native", [("tpu", True), ("gpu", True), ("cpu", False)])
def test_the_default_takes_the_prologue_where_the_kernels_fuse_it(monkeypatch, platform, native):
  # ExpertFFN(gated_prologue=None): the prologue where the platform's kernels apply act(z)
  # in the down gmm's prologue and write dz in the dlhs gmm's epilogue (Pallas TPU and
  # Triton, the first kernel of a GPU's chain for such calls), the
  # epilogue activation where they would be formed around the kernels (benchmarks/log.md).
  from gmm_jax._src.moe import experts
  assert experts.prologue_is_native("swiglu", {"platform": platform}) is native
  monkeypatch.setattr(registry, "trace_platform", lambda: platform)
  assert ("'swiglu'" in _prologues_traced(None)) is native
  assert "'swiglu'" in _prologues_traced(True)  # forced, on every platform
  assert "'swiglu'" not in _prologues_traced(False)
  # A user's implementation choice decides it: the XLA path fuses neither.
  assert "'swiglu'" not in _prologues_traced(None, [("implementation", "xla")])
  assert ("'swiglu'" in _prologues_traced(None, [("platform", "tpu")])) is True


@pytest.mark.parametrize("implementation", [pytest.param("pallas_tpu", marks=pytest.mark.slow),
                                            "pallas_triton"])
def test_the_default_on_a_kernel_fuses_both_ends_and_equals_the_epilogue_path(implementation):
  # The layer's default with a kernel chosen (interpret mode): the down gmm applies act(z)
  # in the kernel's prologue and the dlhs gmm writes dz in its epilogue (neither is formed
  # around it), and the result and every gradient equal the epilogue path's (f32).
  params = bench_moe.layout("moe_fused", bench_moe.init_params(jax.random.key(0), 128, 128, 4))
  x = jax.random.normal(jax.random.key(1), (64, 128))

  def block(prologue, params, x):
    top_p, top_e = bench_moe._router(params, x, 2)
    spec = gmm_jax.ExpertFFN(4, "silu", gated=True, gated_prologue=prologue,
                             options=(("implementation", implementation), ("interpret", True)))
    return gmm_jax.routed_experts(spec, x, top_e, top_p,
                                  dict(w_in=params["gate_up"], w_down=params["down"]))[0]

  with registry.record() as decisions:
    y1, pull1 = jax.vjp(functools.partial(block, None), params, x)
    ct = jax.random.normal(jax.random.key(2), y1.shape, y1.dtype)
    got = pull1(ct)
  fused = [(d.cfg.lhs_activation, d.cfg.cotangent_of) for d in decisions
           if d.implementation == implementation
           and not {"gated_lhs", "gated_cotangent"} & set(d.materialized)]
  assert ("swiglu", None) in fused and (None, "swiglu") in fused, decisions
  y0, pull0 = jax.vjp(functools.partial(block, False), params, x)
  np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), rtol=1e-5, atol=1e-5)
  for g1, g0 in zip(jax.tree.leaves(got), jax.tree.leaves(pull0(ct))):
    np.testing.assert_allclose(np.asarray(g1), np.asarray(g0), rtol=1e-5, atol=1e-5)


def test_nn_moe_takes_the_option():
  pytest.importorskip("flax")
  from flax import nnx
  from gmm_jax import nn
  x = jax.random.normal(jax.random.key(3), (2, 8, 16))
  outputs = []
  assert nn.MoE(4, 16, 24, top_k=2, rngs=nnx.Rngs(0)).gated_prologue is None  # the platform's
  for prologue in (True, False):
    layer = nn.MoE(4, 16, 24, top_k=2, gated_prologue=prologue, rngs=nnx.Rngs(0))
    assert layer.gated_prologue is prologue
    y, _ = layer(x)
    outputs.append(np.asarray(y))
  np.testing.assert_allclose(outputs[0], outputs[1], rtol=1e-6, atol=1e-6)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py)")
@pytest.mark.parametrize("z_spec, w_spec", [
    (P("x", None), P()), (P(None, "x"), P()), (P(), P("x")), (P(), P(None, None, "y")),
    (P("x", "y"), P("y", None, "x"))])
def test_sharded_gradients_keep_the_operands_types(z_spec, w_spec):
  # On a mesh with Explicit axes each cotangent is typed as its operand (also the plain
  # gmm's: a weight gradient whose rows the activations' sharded columns would shard).
  z, w, sizes = _operands(m=64, k=16, n=32)
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4],
                       axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  loss = lambda z, w, **o: jnp.sum(gmm_jax.gmm(z, w, sizes, **o) ** 2)  # noqa: E731
  for options in (dict(lhs_activation="swiglu"), {}):
    zz = z if options else z[:, :16]
    want = jax.grad(functools.partial(loss, **options), argnums=(0, 1))(zz, w)
    placed = (jax.device_put(zz, NamedSharding(mesh, z_spec)),
              jax.device_put(w, NamedSharding(mesh, w_spec)))
    got = jax.jit(jax.grad(functools.partial(loss, **options), argnums=(0, 1)))(*placed)
    for g, r, x in zip(got, want, placed):
      assert jax.typeof(g).sharding.spec == jax.typeof(x).sharding.spec
      np.testing.assert_allclose(f64(g), f64(r), rtol=1e-4, atol=1e-4)


@pytest.mark.skipif(len(jax.devices()) < 4, reason="needs 4 devices (tests/conftest.py)")
def test_explicit_sharding_splits_rows_and_experts_not_k():
  z, w, sizes = _operands(m=64, k=16, n=32)
  mesh = jax.make_mesh((2, 2), ("x", "y"), devices=jax.devices()[:4])
  want = gmm_jax.gmm(z, w, sizes, lhs_activation="swiglu")
  # Rows over x, the columns over y: each device's z rows, whole K.
  got = gmm_jax.gmm(z, w, sizes, lhs_activation="swiglu",
                    sharding=gmm_jax.GmmSharding(mesh, lhs=P("x", None),
                                                 rhs=P(None, None, "y")))
  np.testing.assert_allclose(f64(got), f64(want), rtol=1e-5, atol=1e-5)
  with pytest.raises(NotImplementedError, match="K must not be sharded"):
    gmm_jax.gmm(z, w, sizes, lhs_activation="swiglu",
                sharding=gmm_jax.GmmSharding(mesh, lhs=P(None, "x"), rhs=P(None, "x", None)))


@pytest.mark.parametrize("value", ["yes", 1, 0.0])
def test_expert_ffn_gated_prologue_takes_none_true_or_false(value):
  with pytest.raises(ValueError, match="gated_prologue must be None"):
    gmm_jax.ExpertFFN(4, "silu", gated=True, gated_prologue=value)
  assert gmm_jax.ExpertFFN(4, "silu", gated=True, gated_prologue=np.True_).gated_prologue is True
