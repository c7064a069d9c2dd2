"""fp8 training (`gmm(..., quantization=...)`): the forward and both backward gmms against
a numpy oracle of the blockwise formula (tests/fp8_oracle.py), on every CPU
implementation, with the options and transformations it combines with."""

from __future__ import annotations

import functools

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gmm_jax
import combinations as comb
import fp8_oracle
from gmm_jax._src.backends import registry
from gmm_jax._src.moe import experts
from gmm_jax.pallas import common
from gmm_jax.tools import bench_moe
from gmm_jax._src.core.epilogue import gated_halves_f32

M, K, N, G = 200, 256, 384, 3


def _data(seed, m=M, k=K, n=N, g=G, transpose_rhs=False):
  keys = jax.random.split(jax.random.key(seed), 4)
  x = jax.random.normal(keys[0], (m, k), jnp.float32)
  # Blocks of different magnitudes, so a scale applied to the wrong block shows.
  x = x * jnp.repeat(jnp.exp2(jnp.arange(-(-k // 128)) % 3), 128)[None, :k]
  w = jax.random.normal(keys[1], (g, n, k) if transpose_rhs else (g, k, n)) / 16
  bias = jax.random.normal(keys[2], (g, n))
  ct = jax.random.normal(keys[3], (m, n))
  ct = ct * jnp.repeat(jnp.exp2(jnp.arange(-(-m // 128)) % 2), 128)[:m, None]
  return x, w, bias, ct


def _close(actual, expected, rel=2e-5):
  actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
  assert actual.shape == expected.shape
  if not expected.size:
    return
  scale = max(np.max(np.abs(expected)), 1e-30)
  np.testing.assert_allclose(actual, expected, rtol=0, atol=rel * scale)


@functools.lru_cache(maxsize=None)
def _library_quantizer(dtype, blocks, e8m0):
  recipe = gmm_jax.Fp8Training(dtype=dtype, block=max(b for b in blocks),
                               scale_dtype=jnp.float8_e8m0fnu if e8m0 else None)
  if len(blocks) == 3:
    return jax.jit(recipe.weights)
  return jax.jit(functools.partial(recipe.activations, axis=blocks.index(recipe.block)))


def library_blocks(x, dtype, blocks, e8m0=False):
  """The oracle's quantizer fed gmm_jax's quantized values (see fp8_oracle), for the
  quantization the op uses: `Fp8Training.activations` / `.weights`."""
  q = _library_quantizer(np.dtype(dtype), tuple(blocks), bool(e8m0))(jnp.asarray(x))
  return fp8_oracle.expand(q.qvalue, q.scale, q.tile)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, pytest.param(jnp.float8_e5m2,
                                                                   marks=pytest.mark.slow)])
@pytest.mark.parametrize("e8m0", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_recipe_quantizes_in_the_blocks_of_the_recipe(dtype, e8m0):
  """Per token 1 x 128 and per column 128 x 1 activations, per expert 128 x 128 weights:
  the same blocks, scales and values as the numpy quantization, bit for bit (both compute
  the formula's products with f32 reciprocals, on every jax)."""
  x, w, _, _ = _data(10, transpose_rhs=True)
  recipe = gmm_jax.Fp8Training(dtype=dtype,
                               scale_dtype=jnp.float8_e8m0fnu if e8m0 else None)
  for q, value, blocks, scale_shape in (
      (recipe.activations(x, 1), x, (1, 128), (M, 2)),
      (recipe.activations(x, 0), x, (128, 1), (2, K)),
      (recipe.weights(w), w, (1, 128, 128), (G, 3, 2))):
    assert q.scale.shape == scale_shape and q.qtype == np.dtype(dtype)
    got = fp8_oracle.expand(q.qvalue, q.scale, q.tile)
    want = fp8_oracle.quantize_blocks(value, dtype, blocks, e8m0)
    np.testing.assert_array_equal(got, want)


def _recipe_args(recipe: gmm_jax.Fp8Training):
  return dict(block=recipe.block, dtype=recipe.dtype,
              e8m0=recipe.scale_dtype is not None, quantizer=library_blocks)


sizes_strategy = st.lists(st.integers(0, 90), min_size=G, max_size=G).filter(
    lambda s: sum(s) <= M)


@pytest.mark.parametrize("implementation", [
    "xla", pytest.param("reference", marks=pytest.mark.slow)])
# transpose_rhs=False: the recipe and row-operand tests below check it against the oracle.
@pytest.mark.parametrize("transpose_rhs", [pytest.param(False, marks=pytest.mark.slow), True])
@hypothesis.given(sizes=sizes_strategy)
@hypothesis.settings(max_examples=2, deadline=None)
def test_forward_and_gradients_match_the_blockwise_oracle(implementation, transpose_rhs,
                                                          sizes):
  x, w, bias, ct = _data(len(sizes) + sum(sizes), transpose_rhs=transpose_rhs)
  counts = jnp.asarray(sizes, jnp.int32)

  def f(x, w, bias):
    return gmm_jax.gmm(x, w, counts, bias=bias, transpose_rhs=transpose_rhs,
                       quantization="fp8", implementation=implementation)

  z, vjp = jax.vjp(jax.jit(f), x, w, bias)
  _close(z, fp8_oracle.fp8_forward(x, w, sizes, bias, transpose_rhs=transpose_rhs,
                                   quantizer=library_blocks))
  dx, dw, dbias = vjp(ct)
  want = fp8_oracle.fp8_vjp(x, w, sizes, ct, transpose_rhs=transpose_rhs,
                            quantizer=library_blocks)
  for got, expected in zip((dx, dw, dbias), want):
    assert got.dtype == jnp.float32
    _close(got, expected)


@pytest.mark.parametrize("recipe", [
    gmm_jax.Fp8Training(grad_dtype=jnp.float8_e5m2),
    pytest.param(gmm_jax.Fp8Training(scale_dtype=jnp.float8_e8m0fnu), marks=pytest.mark.slow),
    pytest.param(gmm_jax.Fp8Training(dtype=jnp.float8_e5m2, block=64),
                 marks=pytest.mark.slow),
], ids=["e5m2-grads", "e8m0-scales", "e5m2-block64"])
def test_recipes(recipe):
  sizes = [70, 0, 100]
  x, w, _, ct = _data(1)
  counts = jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda x, w: gmm_jax.gmm(x, w, counts, quantization=recipe))
  z, vjp = jax.vjp(f, x, w)
  args = _recipe_args(recipe)
  _close(z, fp8_oracle.fp8_forward(x, w, sizes, **args))
  dx, dw, _ = fp8_oracle.fp8_vjp(x, w, sizes, ct, grad_dtype=recipe.grad_dtype, **args)
  got_dx, got_dw = vjp(ct)
  _close(got_dx, dx)
  _close(got_dw, dw)


@pytest.mark.slow
def test_e5m2_gradients_differ_from_e4m3():
  """The grad dtype is used: E5M2's 2-bit mantissa gives other gradients than E4M3."""
  x, w, _, ct = _data(2)
  counts = jnp.asarray([80, 60, 60], jnp.int32)
  grads = [jax.jit(lambda x, ct, q=q: jax.vjp(
      lambda x: gmm_jax.gmm(x, w, counts, quantization=q), x)[1](ct)[0])(x, ct)
           for q in ("fp8", "fp8_e5m2_grads")]
  assert float(jnp.max(jnp.abs(grads[0] - grads[1]))) > 0


@pytest.mark.slow
def test_bf16_operands_keep_their_dtype_and_stay_near_the_float_gmm():
  x, w, bias, ct = _data(3)
  x, w = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  counts = jnp.asarray([50, 90, 40], jnp.int32)

  def f(q):
    return jax.vjp(jax.jit(lambda x, w: gmm_jax.gmm(x, w, counts, quantization=q)), x, w)

  (z8, vjp8), (z, vjp) = f("fp8"), f(None)
  assert z8.dtype == jnp.bfloat16
  grads8, grads = vjp8(ct.astype(jnp.bfloat16)), vjp(ct.astype(jnp.bfloat16))
  for a, b in ((z8, z),) + tuple(zip(grads8, grads)):
    assert a.dtype == b.dtype
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    # E4M3 keeps 3 mantissa bits: ~3-6% relative error per element, averaged by the sums.
    assert np.linalg.norm(a - b) / np.linalg.norm(b) < 0.08


def test_activation_row_operands_and_row_weights():
  """The MoE call: rows gathered by index, gated activation, router weights, results
  scattered to slots; the pre-activation is the fp8 formula, the rest elementwise."""
  sizes = [60, 0, 90]
  r = sum(sizes) + 10  # 10 rows of no group
  x, w, bias, _ = _data(4, m=120, n=2 * 128)
  rng = np.random.default_rng(0)
  idx = jnp.asarray(rng.integers(0, 120, r), jnp.int32)
  weights = jnp.asarray(rng.uniform(0.1, 1, r), jnp.float32)
  out_idx = jnp.asarray(rng.permutation(2 * r)[:r], jnp.int32)
  counts = jnp.asarray(sizes, jnp.int32)

  def f(x, w, weights):
    return gmm_jax.gmm(x, w, counts, bias=bias, activation="swiglu", lhs_indices=idx,
                       row_weights=weights, out_indices=out_idx, out_rows=2 * r,
                       quantization="fp8")

  f = jax.jit(f)
  y = f(x, w, weights)
  x_rows = np.asarray(x)[np.asarray(idx)]
  z = fp8_oracle.fp8_forward(x_rows, w, sizes, bias, quantizer=library_blocks)
  gate, up = z[:, :128], z[:, 128:]
  h = gate / (1 + np.exp(-gate)) * up * np.asarray(weights, np.float64)[:, None]
  h[sum(sizes):] = 0
  want = np.zeros((2 * r, 128))
  want[np.asarray(out_idx)] = h
  _close(y, want, rel=1e-4)
  # The gradients exist, are finite, and x's sums every row that reads a token.
  dx, dw, dweights = jax.jit(jax.grad(lambda *a: jnp.sum(f(*a) ** 2), argnums=(0, 1, 2)))(
      x, w, weights)
  assert np.all(np.isfinite(dx)) and np.all(np.isfinite(dw))
  read = np.zeros(120, bool)
  read[np.asarray(idx)[:sum(sizes)]] = True
  assert np.all(np.asarray(dx)[~read] == 0) and np.any(np.asarray(dx)[read] != 0)
  assert np.all(np.asarray(dweights)[sum(sizes):] == 0)


@pytest.mark.slow
def test_group_offset_keeps_only_local_groups():
  sizes = [40, 50, 30, 20]
  x, w, _, ct = _data(5, g=2)
  counts = jnp.asarray(sizes, jnp.int32)
  f = jax.jit(lambda x, w: gmm_jax.gmm(x, w, counts, group_offset=1, quantization="fp8"))
  z, vjp = jax.vjp(f, x, w)
  # Rows of groups 1 and 2 (global) are rows 40..120; the rest are zero.
  full_w = jnp.concatenate([jnp.zeros_like(w[:1]), w, jnp.zeros_like(w[:1])])
  want = fp8_oracle.fp8_forward(x, full_w, sizes, quantizer=library_blocks)
  want[:40] = 0
  want[120:] = 0
  _close(z, want)
  dx, dw = vjp(ct)
  ct_local = np.asarray(ct).copy()
  ct_local[:40] = 0
  ct_local[120:] = 0
  want_dx, want_dw, _ = fp8_oracle.fp8_vjp(x, full_w, sizes, ct_local,
                                            quantizer=library_blocks)
  _close(dx, want_dx)
  _close(dw, want_dw[1:3])


def test_vmap_and_jit_compose():
  x, w, _, _ = _data(6)
  xs = jnp.stack([x, 2 * x])
  counts = jnp.asarray([100, 0, 60], jnp.int32)
  f = lambda x, w: gmm_jax.gmm(x, w, counts, quantization="fp8")
  batched = jax.jit(jax.vmap(f, in_axes=(0, None)))(xs, w)
  one = jax.jit(f)
  for b in range(2):
    np.testing.assert_array_equal(batched[b], one(xs[b], w))
  loss = lambda x, w: jnp.sum(f(x, w))
  grads = jax.jit(jax.vmap(jax.grad(loss), in_axes=(0, None)))(xs, w)
  np.testing.assert_array_equal(grads[1], jax.jit(jax.grad(loss))(xs[1], w))


@pytest.mark.slow
def test_masked_lhs():
  """The decode layout goes through the same op (row operands over the slots)."""
  x, w, _, _ = _data(7, m=3 * 16)
  masked = gmm_jax.MaskedArray(x.reshape(3, 16, K), jnp.asarray([5, 0, 16], jnp.int32))
  y = jax.jit(lambda m, w: gmm_jax.gmm(m, w, quantization="fp8"))(masked, w)
  for g, count in enumerate([5, 0, 16]):
    want = fp8_oracle.fp8_forward(np.asarray(x.reshape(3, 16, K)[g, :count]), w[g:g + 1],
                                  [count], quantizer=library_blocks)
    _close(y.values[g, :count], want)
    assert np.all(np.asarray(y.values[g, count:]) == 0)


@pytest.mark.parametrize("call, error, match", [
    (lambda x, w, c: gmm_jax.gmm(x, w, c, quantization="int8"), ValueError,
     "quantization must be"),
    (lambda x, w, c: gmm_jax.gmm(x, gmm_jax.quantize(w, jnp.int8), c, quantization="fp8"),
     NotImplementedError, "QArray rhs"),
    (lambda x, w, c: gmm_jax.gmm(x, w, c, quantization="fp8",
                                 quantize_lhs=gmm_jax.QuantSpec(jnp.int8)),
     NotImplementedError, "quantize_lhs"),
    (lambda x, w, c: gmm_jax.gmm(x, w[0], c, group_type="k", quantization="fp8"),
     NotImplementedError, "m-grouped"),
    (lambda x, w, c: gmm_jax.gmm(x, w, c, quantization="fp8",
                                 preferred_element_type=jnp.int32),
     (NotImplementedError, ValueError), "float"),
    (lambda x, w, c: gmm_jax.Fp8Training(grad_dtype=jnp.int8), ValueError, "grad_dtype"),
    (lambda x, w, c: gmm_jax.Fp8Training(block=0), ValueError, "block"),
])
def test_bad_calls(call, error, match):
  x, w, _, _ = _data(8, m=64, k=256, n=128)
  with pytest.raises(error, match=match):
    call(x, w, jnp.asarray([20, 20, 20], jnp.int32))


def test_forward_mode_is_not_defined():
  x, w, _, _ = _data(9, m=64, n=128)
  counts = jnp.asarray([20, 20, 20], jnp.int32)
  with pytest.raises(TypeError, match="custom_vjp"):
    jax.jvp(lambda x: gmm_jax.gmm(x, w, counts, quantization="fp8"), (x,), (x,))


@pytest.mark.parametrize("kind, x_spec, w_spec", [
    ("auto", ("data",), ()),  # tokens sharded (data parallel)
    pytest.param("explicit", (), ("expert",), marks=pytest.mark.slow),  # experts sharded
    pytest.param("auto", (None, "expert"), (), marks=pytest.mark.slow),  # contraction
    pytest.param("explicit", ("data",), (), marks=pytest.mark.slow),
    pytest.param("auto", (), ("expert",), marks=pytest.mark.slow),
    pytest.param("explicit", (None, "expert"), (), marks=pytest.mark.slow),
], ids=["auto-rows", "explicit-experts", "auto-contraction", "explicit-rows",
        "auto-experts", "explicit-contraction"])
def test_sharded_under_plain_jit(kind, x_spec, w_spec):
  """Under plain jit on a mesh (Auto or Explicit axes), the op's three gmms are
  partitioned like any gmm; the gradients are the unsharded ones (up to sum order)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  import meshes
  mesh = meshes.mesh((2, 2), ("data", "expert"), kind)
  x, w, _, _ = _data(11, m=256, g=4)
  counts = jnp.asarray([64, 0, 100, 60], jnp.int32)
  loss = lambda x, w: jnp.sum(gmm_jax.gmm(x, w, counts, quantization="fp8") ** 2)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  want = step(x, w)
  got = step(jax.device_put(x, NamedSharding(mesh, P(*x_spec))),
             jax.device_put(w, NamedSharding(mesh, P(*w_spec))))
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _close(a, b, rel=1e-5)


def test_moe_layer_trains_its_experts_in_fp8():
  """nn.MoE(quantization="fp8"): the fused expert gmms (rows by index, SwiGLU, router
  weights, slots) run the fp8 op; the layer's output and every gradient stay near the
  bf16 layer's and differ from them."""
  pytest.importorskip("flax")
  from flax import nnx
  from gmm_jax import nn
  x = jax.random.normal(jax.random.key(12), (64, 256), jnp.bfloat16)

  def run(quantization):
    layer = nn.MoE(4, 256, 256, top_k=2, dtype=jnp.bfloat16, quantization=quantization,
                   rngs=nnx.Rngs(0))
    graph, state = nnx.split(layer)

    def loss(state):
      y, _ = nnx.merge(graph, state)(x)
      return jnp.sum(y.astype(jnp.float32) ** 2)

    return jax.jit(jax.value_and_grad(loss))(state)

  (value8, grads8), (value, grads) = run("fp8"), run(None)
  assert abs(float(value8) - float(value)) < 0.05 * abs(float(value))
  for name in ("gate_up", "down"):
    a = np.asarray(getattr(grads8, name).kernel[...], np.float64)
    b = np.asarray(getattr(grads, name).kernel[...], np.float64)
    assert 0 < np.linalg.norm(a - b) / np.linalg.norm(b) < 0.1, name


@pytest.mark.parametrize("platform, kernel", [("tpu", "pallas_tpu"), ("gpu", "pallas_triton")])
def test_the_kernels_serve_the_blocked_gmms(platform, kernel):
  """On TPU and GPU the op's blocked fp8 gmms go to the Pallas kernels (in-kernel scales),
  not to the dequantizing composition (which would show as quantization 'none')."""
  x = jax.ShapeDtypeStruct((256, 256), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 256, 256), jnp.bfloat16)
  text = gmm_jax.explain(x, w, jax.ShapeDtypeStruct((4,), jnp.int32), quantization="fp8",
                         platform=platform)
  assert "fp8 training" in text
  assert f"quantization 'blocked', 4 local groups, out bfloat16 on {platform}: {kernel}" in text


# ------------------------------------------------------------------ the gated prologue


def _prologue_operands(name, m=96, k=256, n=256, dtype=jnp.float32):
  """z [M, 2K] (its K blocks of different magnitudes), w [3, K, N], sizes with an empty
  group and rows past the total, and a cotangent."""
  keys = jax.random.split(jax.random.key(hash(name) % 1000), 3)
  z = jax.random.uniform(keys[0], (m, 2 * k), jnp.float32, -2, 2)
  z = (z * jnp.repeat(jnp.exp2(jnp.arange(2 * k // 128) % 2 - 1.0), 128)[None, :]).astype(dtype)
  w = (jax.random.normal(keys[1], (3, k, n)) / 16).astype(dtype)
  ct = jax.random.normal(keys[2], (m, n), jnp.float32)
  return z, w, [30, 0, 50], ct


def _prologue_oracle(name, z, w, sizes, ct):
  """float64 (result, dz, dw) of the fp8 gmm of act(z) (numpy, rounded to z's dtype) on
  the library's blocks; dz from act(z)'s cotangent (rounded to z's dtype, as the kernels
  round their product) through the numpy gated vjp."""
  act, act_vjp = comb.activation_rules(name)
  z64 = np.asarray(z, np.float64)
  x = np.asarray(jnp.asarray(act(z64).astype(np.float32), z.dtype), np.float32)
  out = fp8_oracle.fp8_forward(x, np.asarray(w, np.float32), sizes, quantizer=library_blocks)
  dx, dw, _ = fp8_oracle.fp8_vjp(x, np.asarray(w, np.float32), sizes, np.asarray(ct),
                                 quantizer=library_blocks)
  dx = np.asarray(jnp.asarray(dx.astype(np.float32), z.dtype), np.float64)
  return out, act_vjp(z64, dx), dw


def _loose_close(got, want, what):
  comb.assert_fp8_close(got, want, what, loose=True)


@pytest.mark.parametrize("name, implementation, platform", [
    ("swiglu", "xla", None),
    ("geglu", "reference", None),
    ("swiglu", "pallas_triton", "gpu"),
    ("geglu", "pallas_tpu", "tpu"),
])
def test_a_gated_prologue_equals_its_formula(name, implementation, platform):
  """``gmm(z, w, lhs_activation=name, quantization="fp8")``: the fp8 gmm of act(z),
  whose dlhs gmm writes z's cotangent; on the kernels (their platform's blocked mode) the
  cotangent comes from the kernel's epilogue, not formed around it, and Triton quantizes
  act(z) in its prologue (1 x 128 blocks, f32 scales)."""
  z, w, sizes, ct = _prologue_operands(name)
  options = dict(implementation=implementation, interpret=implementation.startswith("pallas"),
                 platform=platform)
  f = jax.jit(lambda z, w: gmm_jax.gmm(z, w, jnp.asarray(sizes, jnp.int32),
                                       lhs_activation=name, quantization="fp8", **options))
  with registry.record() as decisions:
    out, vjp = jax.vjp(f, z, w)
    dz, dw = vjp(ct)
  want, want_dz, want_dw = _prologue_oracle(name, z, w, sizes, ct)
  _loose_close(out, want, "result")
  assert dz.shape == z.shape and dz.dtype == z.dtype
  _loose_close(dz, want_dz, "dz")
  _loose_close(dw, want_dw, "dw")
  if platform is not None:
    (epilogue,) = [d for d in decisions if d.cfg.cotangent_of == name]
    assert (epilogue.implementation, epilogue.quant_mode) == (implementation, "blocked")
    assert "gated_cotangent" not in epilogue.materialized, epilogue.describe()
    # The forward: Triton quantizes act(z) in its prologue; the TPU kernel multiplies the
    # blocks formed before it.
    (forward,) = [d for d in decisions if d.cfg.group_type == "m" and d.cfg.cotangent_of is None
                  and not d.cfg.transpose_rhs]
    assert (forward.implementation, forward.quant_mode) == (implementation, "blocked")
    in_kernel = implementation == "pallas_triton"
    assert (forward.cfg.quantize_prologue is not None) is in_kernel, forward.cfg
    assert (forward.cfg.lhs_activation == name) is in_kernel, forward.cfg
    assert "gated_lhs" not in forward.materialized, forward.describe()


@pytest.mark.parametrize("implementation, platform", [
    ("xla", None), ("pallas_triton", "gpu"),
    pytest.param("pallas_tpu", "tpu", marks=pytest.mark.slow)])
def test_a_gated_prologue_is_the_composition(implementation, platform):
  """bf16, the MoE layer's dtype: the prologue's result and gradients equal those of the
  fp8 gmm of act(z) formed in jnp (same blocks, same products, same roundings)."""
  z, w, sizes, ct = _prologue_operands("swiglu", dtype=jnp.bfloat16)
  counts = jnp.asarray(sizes, jnp.int32)
  options = dict(implementation=implementation, interpret=implementation != "xla",
                 platform=platform, quantization="fp8", preferred_element_type=jnp.bfloat16)
  fused = lambda z, w: gmm_jax.gmm(z, w, counts, lhs_activation="swiglu", **options)
  composed = lambda z, w: gmm_jax.gmm(  # noqa: E731
      gated_halves_f32("swiglu", z).astype(z.dtype), w, counts, **options)
  out, vjp = jax.vjp(jax.jit(fused), z, w)
  want, want_vjp = jax.vjp(jax.jit(composed), z, w)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))
  for got, expected, what in zip(vjp(ct.astype(out.dtype)), want_vjp(ct.astype(out.dtype)),
                                 ("dz", "dw")):
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(expected, np.float32),
                               rtol=1e-2, atol=1e-2, err_msg=what)


@pytest.mark.parametrize("platform, native", [("tpu", False), ("gpu", True), ("cpu", False)])
def test_the_layer_takes_the_prologue_in_fp8_where_the_kernels_fuse_it(monkeypatch, platform,
                                                                       native):
  """ExpertFFN(quantization="fp8"): the default takes the gated prologue where the
  platform's kernels quantize act(z) in the forward's prologue and write z's cotangent
  from the dlhs gmm's epilogue (Triton: not the TPU kernel, which multiplies act(z)'s
  blocks formed before it); an E8M0 recipe (quantized before the kernel) and dynamic
  quantization (quantize_rhs=) do not."""
  monkeypatch.setattr(registry, "trace_platform", lambda: platform)
  w_down = jnp.zeros((4, 48, 32), jnp.bfloat16)

  def prologues(options):
    spec = gmm_jax.ExpertFFN(4, "silu", gated=True, options=options)
    return experts._prologue(spec, w_down) == "swiglu"

  assert prologues((("quantization", "fp8"),)) is native
  assert prologues((("quantization", gmm_jax.Fp8Training(
      scale_dtype=jnp.float8_e8m0fnu)),)) is False
  assert prologues((("quantize_rhs", jnp.int8),)) is False


def test_the_layer_trains_the_same_with_the_gated_prologue():
  """f32: the fp8 layer's result and gradients are the same with the prologue forced on
  and off (the same fp8 products of the same act(z); act(z)'s cotangent reaches z through
  the gated vjp in either order of rounding-free f32 steps)."""
  params = bench_moe.layout("moe_fused", bench_moe.init_params(jax.random.key(0), 256, 256, 4))
  x = jax.random.normal(jax.random.key(1), (128, 256))

  def block(prologue, params, x):
    top_p, top_e = bench_moe._router(params, x, 2)
    spec = gmm_jax.ExpertFFN(4, "silu", gated=True, gated_prologue=prologue,
                             options=(("quantization", "fp8"),))
    return gmm_jax.routed_experts(spec, x, top_e, top_p,
                                  dict(w_in=params["gate_up"], w_down=params["down"]))[0]

  loss = lambda prologue: jax.jit(jax.value_and_grad(  # noqa: E731
      lambda p, x: jnp.sum(block(prologue, p, x) ** 2), argnums=(0, 1)))
  (v1, g1), (v0, g0) = loss(True)(params, x), loss(False)(params, x)
  np.testing.assert_allclose(float(v1), float(v0), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert np.linalg.norm(a - b) <= 1e-3 * np.linalg.norm(b)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_the_kernels_tile_quantizer_is_the_recipes(dtype):
  """`common.quantize_rows` (a kernel quantizing act(z) per 1 x 128 block) gives the
  values and scales of `Fp8Training.activations` on the same block (an all-zero row
  included)."""
  x = jax.random.normal(jax.random.key(3), (16, 128), jnp.float32) * 30
  x = x.at[5].set(0.0).astype(jnp.bfloat16)
  values, scale = jax.jit(functools.partial(common.quantize_rows, dtype=dtype))(x)
  want = gmm_jax.Fp8Training(dtype=dtype).activations(x, 1)
  np.testing.assert_array_equal(np.asarray(scale), np.asarray(want.scale))
  np.testing.assert_array_equal(np.asarray(values.astype(jnp.float32)),
                                np.asarray(want.qvalue.astype(jnp.float32)))


def test_power_of_2_scales_are_quantized_before_the_kernel():
  """An e8m0 recipe's act(z) is formed and quantized before the Triton kernel (it
  quantizes with f32 scales only), with the same result as the composition."""
  z, w, sizes, ct = _prologue_operands("swiglu", dtype=jnp.bfloat16)
  counts = jnp.asarray(sizes, jnp.int32)
  recipe = gmm_jax.Fp8Training(scale_dtype=jnp.float8_e8m0fnu)
  options = dict(implementation="pallas_triton", interpret=True, platform="gpu",
                 quantization=recipe, preferred_element_type=jnp.bfloat16)
  with registry.record() as decisions:
    out = jax.jit(lambda z, w: gmm_jax.gmm(z, w, counts, lhs_activation="swiglu",
                                           **options))(z, w)
  (forward,) = decisions
  assert forward.cfg.lhs_activation is None and forward.quant_mode == "blocked", forward
  want = gmm_jax.gmm(gated_halves_f32("swiglu", z).astype(z.dtype), w, counts, **options)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(want, np.float32))


def test_tilings_choose_each_gmms_tiles():
  """``tiling=gmm_jax.Tilings(fwd=, dlhs=, drhs=)`` reaches each of fp8 training's three
  gmms (a kernel asks each callable for its own problem), as for the float gmm."""
  seen = []

  def note(role):
    def choose(problem):
      seen.append((role, problem.group_type, problem.quant_mode))
      return None  # the kernel's own choice
    return choose

  tilings = gmm_jax.Tilings(fwd=note("fwd"), dlhs=note("dlhs"), drhs=note("drhs"))
  x, w, _, ct = _data(0, m=256)
  counts = jnp.asarray([100, 0, 130], jnp.int32)
  f = lambda x, w: gmm_jax.gmm(x, w, counts, quantization="fp8", tiling=tilings,  # noqa: E731
                               implementation="pallas_triton", interpret=True, platform="gpu")
  jax.vjp(jax.jit(f), x, w)[1](ct)
  assert set(seen) == {("fwd", "m", "blocked"), ("dlhs", "m", "blocked"),
                       ("drhs", "k", "blocked")}, seen


@pytest.mark.parametrize("kind, z_spec, w_spec", [
    ("auto", ("data",), ()),  # rows sharded
    ("explicit", (), ("expert",)),  # experts sharded: the op's trace-time split
    pytest.param("explicit", ("data",), (), marks=pytest.mark.slow),
], ids=["auto-rows", "explicit-experts", "explicit-rows"])
def test_a_gated_prologue_sharded_under_plain_jit(kind, z_spec, w_spec):
  """fp8 training through a gated prologue on a 2 x 2 mesh: the gradients are the
  unsharded ones (up to sum order), dz in z's dtype and, on Explicit axes, z's sharding."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  import meshes
  mesh = meshes.mesh((2, 2), ("data", "expert"), kind)
  z, w, _, _ = _prologue_operands("swiglu", m=256)
  w = jnp.concatenate([w, w[:1] * 0.5])  # 4 experts
  counts = jnp.asarray([64, 0, 100, 60], jnp.int32)
  loss = lambda z, w: jnp.sum(gmm_jax.gmm(  # noqa: E731
      z, w, counts, lhs_activation="swiglu", quantization="fp8") ** 2)
  step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))
  want = step(z, w)
  sharded = (jax.device_put(z, NamedSharding(mesh, P(*z_spec))),
             jax.device_put(w, NamedSharding(mesh, P(*w_spec))))
  got = step(*sharded)
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    _close(a, b, rel=1e-5)
  dz = got[1][0]
  assert dz.shape == z.shape and dz.dtype == z.dtype
  if kind == "explicit":
    assert jax.typeof(dz).sharding.spec == jax.typeof(sharded[0]).sharding.spec
