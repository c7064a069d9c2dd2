"""The Pallas kernels' in-kernel dequantization (weight-only int8/int4/fp8; int8 x int8
with per-token x per-channel scales): interpret mode on CPU against the composed XLA path
(itself checked against the numpy oracle in test_quant.py), gradients, the fallback for
layouts a kernel refuses, and cross-lowering for TPU and CUDA."""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax import QArray, quantize
from gmm_jax._src.backends import registry
from grids import covering
from lowering import implementations_used, lower_for, triton_calls
from oracle import dequantize, f64, gmm_oracle, tolerances

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

KERNELS = ["pallas_triton", "pallas_tpu"]
M, N, G = 45, 40, 3
SIZES = [17, 0, 20]  # an empty group, rows past the total


def _transposed(q: QArray) -> QArray:
  """The same weights stored [G, N, K]."""
  swap = lambda a: None if a is None else jnp.swapaxes(a, 1, 2)  # noqa: E731
  return QArray(swap(q.qvalue), swap(q.scale), swap(q.zero_point),
                tile=(q.tile[0], q.tile[2], q.tile[1]))


def _weights(case: str, k: int, seed: int = 0, n: int = N):
  w = np.random.default_rng(seed).standard_normal((G, k, n)).astype(np.float32) / np.sqrt(k)
  if case == "int8 per-channel":
    return quantize(w, jnp.int8, channelwise_axes=(0, 2))
  if case == "int4 per-channel zero-point":
    return quantize(w, jnp.int4, channelwise_axes=(0, 2), zero_point=True)
  if case == "int4 per-group-128":
    return quantize(w, jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: 128})
  if case == "fp8 e4m3 per-channel":
    return quantize(w, jnp.float8_e4m3fn, channelwise_axes=(0, 2))
  assert case == "fp8 e5m2 per-tensor", case
  return quantize(w, jnp.float8_e5m2, channelwise_axes=(0,))


def _pallas_calls(fn, *args) -> int:
  """gmms of the lowered program that a Pallas kernel serves."""
  return sum(name.startswith("pallas") for name in implementations_used(fn, *args))


WEIGHT_CASES = ["int8 per-channel", "int4 per-channel zero-point", "int4 per-group-128",
                "fp8 e4m3 per-channel", "fp8 e5m2 per-tensor"]


# Default run: each kernel with each weight format, the layouts in turn; the other layout
# of each with -m slow.
@covering(("implementation", KERNELS), ("case", WEIGHT_CASES), ("transpose_rhs", [False, True]),
          default=lambda index: index[2] == (index[0] + index[1]) % 2)
def test_weight_only_in_kernel(implementation, case, transpose_rhs):
  k = 256  # two groups of 128 along K for the per-group case
  q = _weights(case, k)
  q = _transposed(q) if transpose_rhs else q
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.standard_normal((M, k)), jnp.bfloat16)
  bias = jnp.asarray(rng.standard_normal((G, N)), jnp.float32)

  def run(implementation, x, bias):
    return gmm_jax.gmm(x, q, SIZES, bias=bias, activation="gelu_tanh",
                       transpose_rhs=transpose_rhs, preferred_element_type=jnp.float32,
                       implementation=implementation, interpret=True)

  assert _pallas_calls(lambda x, b: run(implementation, x, b), x, bias) == 1
  got = run(implementation, x, bias)
  want = run("xla", x, bias)
  np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
  assert np.all(np.asarray(got)[sum(SIZES):] == 0)


@pytest.mark.parametrize("implementation", KERNELS)
def test_weight_only_gradients_through_the_kernel(implementation):
  q = _weights("int8 per-channel", 96)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.standard_normal((M, 96)), jnp.float32)
  bias = jnp.asarray(rng.standard_normal((G, N)), jnp.float32)
  cot = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)

  def loss(implementation):
    return lambda x, b: jnp.sum(gmm_jax.gmm(
        x, q, SIZES, bias=b, activation="silu", implementation=implementation,
        interpret=True) * cot)

  got = jax.grad(loss(implementation), argnums=(0, 1))(x, bias)
  want = jax.grad(loss("reference"), argnums=(0, 1))(x, bias)
  for g, w in zip(got, want):
    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("mode", ["weight_only", "scaled"])
@pytest.mark.parametrize("implementation", KERNELS)
def test_vmap_and_group_offset_in_kernel_match_oracle(implementation, mode):
  # In-kernel dequantization under vmap (over lhs) with a group offset (rhs holds groups 1
  # and 2 of 3), each example against numpy on the dequantized operands.
  k, batch, offset = 96, 2, 1
  rng = np.random.default_rng(5)
  w = rng.standard_normal((2, k, N)).astype(np.float32) / np.sqrt(k)
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  xs = rng.standard_normal((batch, M, k)).astype(np.float32)
  bias = rng.standard_normal((2, N)).astype(np.float32)
  if mode == "scaled":
    examples = [quantize(x, jnp.int8, channelwise_axes=(0,)) for x in xs]
    lhs = jax.tree.map(lambda *leaves: jnp.stack(leaves), *examples)
    values = [dequantize(q) for q in examples]
  else:
    lhs, values = jnp.asarray(xs), [f64(x) for x in xs]

  def run(lhs):
    return jax.vmap(lambda x: gmm_jax.gmm(
        x, wq, SIZES, bias=bias, activation="silu", group_offset=offset,
        implementation=implementation, interpret=True))(lhs)

  assert _pallas_calls(run, lhs) >= 1
  got = run(lhs)
  for b in range(batch):
    want = gmm_oracle(values[b], dequantize(wq), SIZES, "m", bias=bias, activation="silu",
                      group_offset=offset, num_local=2)
    np.testing.assert_allclose(f64(got[b]), want, **tolerances(
        np.float32, k=k, scale=float(np.std(values[b]) * np.std(dequantize(wq)))))


@pytest.mark.parametrize("out", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("implementation", KERNELS)
def test_int8_scaled_in_kernel(implementation, out):
  rng = np.random.default_rng(3)
  x = rng.standard_normal((M, 96)).astype(np.float32)
  w = (rng.standard_normal((G, 96, N)) / 10).astype(np.float32)
  xq = quantize(x, jnp.int8, channelwise_axes=(0,))
  wq = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  bias = jnp.asarray(rng.standard_normal((G, N)), jnp.float32)
  extra = dict(output_scale=20.0, output_offset=1.0) if out == "int8" else {}

  def run(implementation):
    return gmm_jax.gmm(xq, wq, SIZES, bias=bias, activation="silu", preferred_element_type=out,
                       implementation=implementation, interpret=True, **extra)

  assert _pallas_calls(lambda: run(implementation)) == 1
  got, want = run(implementation), run("xla")
  assert got.dtype == np.dtype(out)
  if out == "int8":  # f32 sums in another order can move a value across a rounding edge
    assert np.abs(np.asarray(got, int) - np.asarray(want, int)).max() <= 1
  else:
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                               rtol=1e-2 if out == "bfloat16" else 1e-5, atol=1e-5)


def test_refused_layouts_fall_back_to_composition():
  # Per-group scales of 32 need 32-wide K steps, which Mosaic cannot block: the TPU kernel
  # refuses, and gmm multiplies by the dequantized weights instead (the kernel still runs,
  # on float weights). k-grouping and blocked (MX) modes always compose.
  rng = np.random.default_rng(4)
  w = rng.standard_normal((G, 96, N)).astype(np.float32)
  q = quantize(w, jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: 32})
  x = jnp.asarray(rng.standard_normal((M, 96)), jnp.float32)
  got = gmm_jax.gmm(x, q, SIZES, implementation="pallas_tpu", interpret=True)
  np.testing.assert_allclose(got, gmm_jax.gmm(x, q, SIZES, implementation="xla"), rtol=1e-5,
                             atol=1e-5)
  xm = quantize(np.asarray(x), jnp.float8_e4m3fn, channelwise_axes=(0,), tiled_axes={1: 32})
  wm = quantize(w, jnp.float8_e4m3fn, channelwise_axes=(0, 2), tiled_axes={1: 32})
  for implementation in KERNELS:
    got = gmm_jax.gmm(xm, wm, SIZES, implementation=implementation, interpret=True)
    np.testing.assert_allclose(got, gmm_jax.gmm(xm, wm, SIZES, implementation="xla"),
                               rtol=1e-5, atol=1e-5)


def test_dispatcher_declares_the_quantized_modes():
  cfg = gmm_jax.GmmConfig(group_type="m", num_local=G)
  x = jnp.zeros((M, 128), jnp.bfloat16)
  w = _weights("int8 per-channel", 128)
  xq = quantize(np.ones((M, 128), np.float32), jnp.int8, channelwise_axes=(0,))
  mx = quantize(np.ones((G, 128, N), np.float32), jnp.float8_e4m3fn, tiled_axes={1: 32})
  xmx = quantize(np.ones((M, 128), np.float32), jnp.float8_e4m3fn, tiled_axes={1: 32})
  assert registry.serves(x, w, cfg, "gpu") and registry.serves(xq, w, cfg, "tpu")
  # blocked fp8 x fp8 (MX, G-B, fp8 training): the GPU kernels serve it in-kernel;
  # blocked integers (A8W4-like int8 x int8 with K blocks) are composed.
  assert registry.serves(xmx, mx, cfg, "gpu")
  xi = quantize(np.ones((M, 128), np.float32), jnp.int8, channelwise_axes=(0,),
                tiled_axes={1: 32})
  wi = quantize(np.ones((G, 128, N), np.float32), jnp.int8, tiled_axes={1: 32})
  assert not registry.serves(xi, wi, cfg, "gpu") and not registry.serves(xi, wi, cfg, "tpu")
  assert not registry.serves(x, w, cfg, "cpu")  # CPU: composed XLA path
  blocked_n = quantize(np.ones((G, 128, N), np.float32), jnp.int8, tiled_axes={2: 8})
  assert not registry.serves(x, blocked_n, cfg, "gpu")  # the kernels' static check refuses


# ------------------------------------------------------------------------------- lowering

LOWER_CASES = WEIGHT_CASES + ["int8 x int8"]


# Default run: each platform with each format, layouts and shapes in turn (12 of 48); the
# rest with -m slow.
@covering(("platform", ["tpu", "cuda"]), ("case", LOWER_CASES),
          ("transpose_rhs", [False, True]), ("shape", [(45, 256, 40), (300, 512, 384)]),
          default=lambda i: i[2] == (i[0] + i[1]) % 2 and i[3] == (i[0] + i[1] // 2) % 2)
def test_quantized_kernels_lower(platform, case, transpose_rhs, shape):
  m, k, n = shape
  rng = np.random.default_rng(5)
  w = rng.standard_normal((G, k, n)).astype(np.float32)
  bias = jnp.asarray(rng.standard_normal((G, n)), jnp.float32)
  if case == "int8 x int8":
    lhs = quantize(rng.standard_normal((m, k)).astype(np.float32), jnp.int8,
                   channelwise_axes=(0,))
    rhs = quantize(w, jnp.int8, channelwise_axes=(0, 2))
  else:
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.bfloat16)
    rhs = _weights(case, k, n=n)
  rhs = _transposed(rhs) if transpose_rhs else rhs

  def f(lhs, rhs, bias, sizes):
    return gmm_jax.gmm(lhs, rhs, sizes, bias=bias, activation="silu",
                       transpose_rhs=transpose_rhs)  # the platform's chain picks the kernel

  sizes = jnp.zeros((G,), jnp.int32)
  text = lower_for(platform, f, lhs, rhs, bias, sizes)
  if platform == "tpu":
    assert text.count("tpu_custom_call") == 1
  else:
    assert triton_calls(text) == 1
