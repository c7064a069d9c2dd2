"""The Pallas Triton kernels' "blocked" fp8 mode: fp8 training's three gmms on blockwise-
quantized operands (1 x 128 activation and gradient blocks, 128 x 128 weight blocks; the
drhs's 128 x 1 blocks along the tokens), e4m3 x e4m3 and the e5m2 gradient option.

Interpret mode on CPU against a numpy float64 oracle of the blockwise formula (each
operand's values times its block scales, then a per-group matmul: the sum over K blocks of
the block products times both block scales), with an empty group, rows past the total, and
group boundaries inside a 128-row block of the k-grouped contraction. The kernels' dots as
lowered for CUDA (no GPU needed) are fp8 x fp8 Triton dots that Hopper runs as fp8 wgmma;
tests/test_deviceless.py compiles them for sm_90a and reads the instructions.
"""

from __future__ import annotations

import gmm_jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton_ir
from gmm_jax import quantize
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig
from gmm_jax.pallas.gpu import triton as triton_gmm
from gmm_jax.pallas.gpu import triton_fp8
from lowering import gpu_model
from oracle import dequantize, gmm_oracle

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# K: two 128-blocks and a partial third; N: two blocks. Groups: an empty one, rows past the
# total (M > 170), and boundaries at rows 70 and 130, inside the first and second 128-row
# blocks of the k-grouped contraction.
M, K, N, G = 190, 320, 256, 4
SIZES = np.array([70, 0, 60, 40], np.int32)
# 32-row tiles (the m-grouped kernel's row classes are 16 and 32 rows: fewer branches to
# interpret); K steps of one 128-block.
TILING = gmm_jax.Tiling(tile_m=32, tile_k=128, tile_n=128)


def _data(seed=0):
  rng = np.random.default_rng(seed)
  # Blocks of different magnitudes along every blocked axis, so a scale applied to the
  # wrong block shows.
  k_scale = np.exp2(np.arange(K) // 128 % 3)
  row_scale = np.exp2(np.arange(M) // 128 % 2 * 2)
  x = rng.standard_normal((M, K)) * k_scale[None, :] * row_scale[:, None]
  w = rng.standard_normal((G, K, N)) / np.sqrt(K) * np.exp2(np.arange(N) // 128)[None, None]
  dy = rng.standard_normal((M, N)) * row_scale[:, None]
  bias = rng.standard_normal((G, N))
  return [np.asarray(a, np.float32) for a in (x, w, dy, bias)]


def _forward_operands(x, w):
  return (quantize(x, E4M3, channelwise_axes=(0,), tiled_axes={1: 128}),
          quantize(w, E4M3, channelwise_axes=(0,), tiled_axes={1: 128, 2: 128}))


def _run(lhs, rhs, **options):
  """The gmm on the Triton kernel (interpret mode), and the implementations that served."""
  with registry.record() as decisions:
    out = gmm_jax.gmm(lhs, rhs, SIZES, implementation="pallas_triton", interpret=True,
                      tiling=TILING, **options)
  return np.asarray(out, np.float64), [d.implementation for d in decisions]


def _close(got, want, out_dtype):
  # f32: only f32 rounding of 128-term block sums and of the scale products; bf16: the
  # result's rounding (2**-8 relative).
  rel = 2e-6 if out_dtype == jnp.float32 else 8e-3
  scale = np.max(np.abs(want))
  np.testing.assert_allclose(got, want, rtol=rel, atol=rel * scale)


@pytest.mark.parametrize("out_dtype, bias, activation", [
    (jnp.float32, True, "silu"),
    (jnp.bfloat16, False, None),
])
def test_forward(out_dtype, bias, activation):
  x, w, _, b = _data(1)
  xq, wq = _forward_operands(x, w)
  got, served = _run(xq, wq, bias=b if bias else None, activation=activation,
                     preferred_element_type=out_dtype)
  assert served == ["pallas_triton"]
  want = gmm_oracle(dequantize(xq), dequantize(wq), SIZES, "m", bias=b if bias else None,
                    activation=activation)
  _close(got, want, out_dtype)
  assert np.all(got[SIZES.sum():] == 0)


# Default run: the mixed pair (e4m3 x e4m3 is the forward's); -m slow: both.
@pytest.mark.parametrize("grad_dtype", [pytest.param(E4M3, marks=pytest.mark.slow), E5M2])
def test_dlhs(grad_dtype):
  x, w, dy, _ = _data(2)
  _, wq = _forward_operands(x, w)
  dyq = quantize(dy, grad_dtype, channelwise_axes=(0,), tiled_axes={1: 128})
  got, served = _run(dyq, wq, transpose_rhs=True, preferred_element_type=jnp.float32)
  assert served == ["pallas_triton"]
  want = gmm_oracle(dequantize(dyq), dequantize(wq), SIZES, "m", transpose_rhs=True)
  _close(got, want, jnp.float32)


def _drhs_operands(x, dy, grad_dtype):
  return (quantize(x, E4M3, channelwise_axes=(1,), tiled_axes={0: 128}),
          quantize(dy, grad_dtype, channelwise_axes=(1,), tiled_axes={0: 128}))


@pytest.mark.parametrize("grad_dtype, out_dtype, bias", [
    (E4M3, jnp.float32, False),
    (E5M2, jnp.bfloat16, True),
])
def test_drhs(grad_dtype, out_dtype, bias):
  x, _, dy, b = _data(3)
  xq, dyq = _drhs_operands(x, dy, grad_dtype)
  got, served = _run(xq, dyq, group_type="k", transpose_lhs=True, bias=b if bias else None,
                     preferred_element_type=out_dtype)
  assert served == ["pallas_triton"]
  want = gmm_oracle(dequantize(xq), dequantize(dyq), SIZES, "k", transpose_lhs=True,
                    bias=b if bias else None)
  _close(got, want, out_dtype)
  if not bias:
    assert np.all(got[1] == 0)  # the empty group


@pytest.mark.parametrize("deterministic", [pytest.param(True, marks=pytest.mark.slow), False])
def test_drhs_split_k(deterministic):
  # K split into 128-row chunks computed in parallel (ordered slots or atomic adds): the
  # chunks start at group starts + multiples of 128, not at block starts.
  x, _, dy, _ = _data(4)
  xq, dyq = _drhs_operands(x, dy, E5M2)
  cfg = GmmConfig(group_type="k", num_local=G, transpose_lhs=True, interpret=True,
                  deterministic=deterministic)
  got = triton_gmm.gmm_triton(xq, dyq, jnp.asarray(SIZES), jnp.int32(0), None, cfg,
                              k_chunk=128)
  want = gmm_oracle(dequantize(xq), dequantize(dyq), SIZES, "k", transpose_lhs=True)
  _close(np.asarray(got, np.float64), want, jnp.float32)


@pytest.mark.slow
def test_group_offset_forward():
  # Expert parallelism: the last two of the four groups held locally.
  x, w, _, _ = _data(5)
  xq, wq = _forward_operands(x, w[:2])
  got, _ = _run(xq, wq, group_offset=2, preferred_element_type=jnp.float32)
  want = gmm_oracle(dequantize(xq), dequantize(wq), SIZES, "m", group_offset=2)
  _close(got, want, jnp.float32)


def test_refuses_blocked_int8():
  # Blocked int8 is not the kernels' (the dispatcher composes it instead).
  x, w, _, _ = _data(6)
  xq = quantize(x, jnp.int8, channelwise_axes=(0,), tiled_axes={1: 128})
  wq = quantize(w, jnp.int8, channelwise_axes=(0,), tiled_axes={1: 128, 2: 128})
  with pytest.raises(NotImplementedError, match="blocked"):
    triton_gmm.check_operands(xq, wq, GmmConfig(group_type="m", num_local=G))


# ------------------------------------------------------------- the lowered kernels' dots


def _abstract_three(grad_dtype):
  """fp8 training's three gmms (f32 results) on the test's operands."""
  x, w, dy, _ = _data(7)
  xq, wq = _forward_operands(x, w)
  dyq = quantize(dy, grad_dtype, channelwise_axes=(0,), tiled_axes={1: 128})
  xk, dyk = _drhs_operands(x, dy, grad_dtype)
  options = dict(implementation="pallas_triton", preferred_element_type=jnp.float32)
  return [
      (lambda a, b: gmm_jax.gmm(a, b, SIZES, **options), (xq, wq)),
      (lambda a, b: gmm_jax.gmm(a, b, SIZES, transpose_rhs=True, **options), (dyq, wq)),
      (lambda a, b: gmm_jax.gmm(a, b, SIZES, group_type="k", transpose_lhs=True, **options),
       (xk, dyk)),
  ]


@pytest.mark.parametrize("grad_dtype", [E4M3, E5M2])
def test_lowered_dots_are_fp8(grad_dtype):
  # Each gmm's kernel multiplies the 8-bit values as they are (e4m3 x e5m2 too), with
  # maxNumImpreciseAcc >= 32: what Triton needs to take fp8 with an f32 accumulator to
  # Hopper's wgmma (Pallas's own dot leaves it 0, and Triton then upcasts to f16).
  if not triton_fp8.FP8_MMA:
    pytest.skip("this jax's Pallas Triton lowering table is not reachable")
  grad = np.dtype(grad_dtype)
  want_types = [("f8E4M3FN", "f8E4M3FN"),
                ("f8E5M2" if grad == np.dtype(E5M2) else "f8E4M3FN", "f8E4M3FN"),
                ("f8E4M3FN", "f8E5M2" if grad == np.dtype(E5M2) else "f8E4M3FN")]
  for (fn, args), types in zip(_abstract_three(grad_dtype), want_types):
    try:
      found = triton_ir.dots(fn, *args, lowering=gpu_model)
    except triton_ir.Unreadable as err:
      pytest.skip(f"this jax's lowered Triton IR cannot be read here: {err}")
    assert found, "no tt.dot in the kernel"
    for dot in found:
      assert (dot.lhs, dot.rhs) == types
      assert dot.max_num_imprecise_acc >= 32
