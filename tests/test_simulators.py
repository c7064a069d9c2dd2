"""The kernels under jax's own simulators, through the public op.

`gmm_jax.gmm(..., interpret=pltpu.InterpretParams(...))` runs the Mosaic TPU kernel in jax's
TPU simulator (HBM, VMEM, DMAs and semaphores, with a happens-before race detector),
`interpret=plgpu.InterpretGPUParams(...)` the Mosaic GPU kernel in jax's GPU simulator
(shared memory, TMA, barriers, wgmma), and ``pltpu.force_tpu_interpret_mode`` forces the
first for every gmm traced inside. Each kernel variant runs here with the race detector
on (`simulators`: uninitialized TPU memory NaN, out-of-bounds reads raising), against the
float64 numpy oracle; gradients against the oracle's vjp. A race fails the test.

Shapes are the smallest that take each code path (Mosaic TPU blocks are multiples of 128
lanes; a simulated call takes seconds).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu

import gmm_jax
import simulators
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import Tiling
from gmm_jax.pallas.tpu import mosaic_tpu_plan
from gmm_test_base import make_operands
from oracle import (dequantize, f64, gmm_oracle, gmm_oracle_vjp, rows_oracle, tolerances)

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
E4M3 = jnp.float8_e4m3fn


def _tpu(lhs, rhs, sizes, *, cores=1, **options):
  """The public gmm on the Mosaic TPU kernel under the TPU simulator, checked for races."""
  with simulators.no_race("tpu"):
    return jax.block_until_ready(gmm_jax.gmm(
        lhs, rhs, jnp.asarray(sizes, jnp.int32), implementation="pallas_tpu",
        interpret=simulators.tpu(cores), **options))


def _kernels_used(fn, *args):
  with registry.record() as decisions:
    jax.jit(fn).lower(*args)
  return {d.implementation for d in decisions}, decisions


# ------------------------------------------------------------------------- the TPU kernel

# (group type, shapes, sizes, options, simulated TensorCores): m-grouping with a group
# offset, an empty group and rows past the total; both layouts; k-grouping (the weight
# gradient's layout: lhs transposed) with columns past the total; two TensorCores where the
# grid's first (parallel) dimension has two tiles.
TPU_CASES = [
    pytest.param("m", (40, 128, 256), [5, 12, 0, 20], dict(group_offset=1, activation="relu"),
                 2, id="m-offset-relu-2-cores"),
    pytest.param("m", (40, 128, 128), [12, 0, 20], dict(transpose_lhs=True, transpose_rhs=True,
                                                        activation="gelu"),
                 1, id="m-transposed-gelu"),
    pytest.param("k", (128, 200, 256), [50, 0, 100], dict(transpose_lhs=True), 2,
                 id="k-transposed-lhs-2-cores"),
]


@pytest.mark.parametrize("group_type, shape, sizes, options, cores", TPU_CASES)
def test_tpu_kernel_matches_the_oracle(group_type, shape, sizes, options, cores):
  m, k, n = shape
  num_local = 3 if group_type == "m" else len(sizes)
  lhs, rhs, bias = make_operands(group_type, m=m, k=k, n=n, num_local=num_local,
                                 transpose_lhs=options.get("transpose_lhs", False),
                                 transpose_rhs=options.get("transpose_rhs", False),
                                 with_bias=True, seed=3)
  extra = dict(num_groups=num_local) if group_type == "k" else {}
  got = _tpu(lhs, rhs, sizes, cores=cores, group_type=group_type, bias=bias, **extra,
             **options)
  want = gmm_oracle(lhs, rhs, sizes, group_type, bias=bias, num_local=num_local,
                    **{key: value for key, value in options.items() if key != "num_groups"})
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=k))


def test_tpu_kernel_bf16_accumulates_in_f32():
  lhs, rhs, _ = make_operands("m", m=32, k=256, n=128, num_local=2, lhs_dtype=jnp.bfloat16,
                              seed=4)
  got = _tpu(lhs, rhs, [20, 12], preferred_element_type=jnp.float32)
  np.testing.assert_allclose(f64(got), gmm_oracle(lhs, rhs, [20, 12], "m"),
                             **tolerances(jnp.bfloat16, jnp.float32, k=256))


def test_tpu_gated_epilogue():
  lhs, rhs, bias = make_operands("m", m=40, k=128, n=256, num_local=2, with_bias=True, seed=5)
  got = _tpu(lhs, rhs, [17, 15], bias=bias, activation="swiglu")
  want = rows_oracle(lhs, rhs, [17, 15], bias=bias, activation="swiglu")
  assert got.shape == (40, 128)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=128, scale=16.0))


def test_tpu_gated_prologue():
  # lhs holds z [M, 2K]; the product reads swiglu(z) [M, K].
  z, rhs, _ = make_operands("m", m=40, k=256, n=128, num_local=2, seed=6)
  rhs = rhs[:, :128]
  got = _tpu(z, rhs, [20, 14], lhs_activation="swiglu")
  x = rows_oracle(z, np.eye(256)[None], [40], activation="swiglu")  # act(z), [M, K]
  want = gmm_oracle(x, rhs, [20, 14], "m")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=128, scale=16.0))


def test_tpu_gathered_weighted_rows():
  lhs, rhs, _ = make_operands("m", m=24, k=128, n=128, num_local=2, seed=7)
  rng = np.random.default_rng(8)
  indices = rng.integers(0, 24, size=40).astype(np.int32)
  weights = rng.uniform(0.5, 1.5, size=40).astype(np.float32)
  got = _tpu(lhs, rhs, [25, 11], lhs_indices=indices, row_weights=weights,
             activation="gelu")
  want = rows_oracle(lhs, rhs, [25, 11], lhs_indices=indices, row_weights=weights,
                     activation="gelu")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=128))


def test_tpu_chunked_k_and_row_loops(monkeypatch):
  """A K block of two chunks (m-grouping) and an output tile of two row chunks
  (k-grouping): the kernels' loops over chunks, a ragged K edge in the last chunk."""
  monkeypatch.setattr(mosaic_tpu_plan, "K_CHUNK", 128)
  monkeypatch.setattr(mosaic_tpu_plan, "OUT_ROW_CHUNK", 128)
  lhs, rhs, _ = make_operands("m", m=40, k=300, n=128, num_local=2, seed=9)
  got = _tpu(lhs, rhs, [21, 13], tiling=Tiling(32, 256, 128))
  np.testing.assert_allclose(f64(got), gmm_oracle(lhs, rhs, [21, 13], "m"),
                             **tolerances(jnp.float32, k=300))
  lhs, rhs, _ = make_operands("k", m=256, k=150, n=128, num_local=2, seed=10)
  got = _tpu(lhs, rhs, [70, 60], group_type="k", num_groups=2,
             tiling=Tiling(256, 128, 128))
  np.testing.assert_allclose(f64(got), gmm_oracle(lhs, rhs, [70, 60], "k"),
                             **tolerances(jnp.float32, k=150))


def test_tpu_gradients_and_the_cotangent_epilogue():
  """The backward's dlhs (m-grouping) and drhs (k-grouping) gmms on the kernel; with a
  gated prologue the dlhs gmm writes z's cotangent from its epilogue."""
  lhs, rhs, _ = make_operands("m", m=40, k=128, n=128, num_local=2, seed=11)
  sizes = [22, 11]
  ct = np.random.default_rng(12).standard_normal((40, 128)).astype(np.float32)

  def loss(lhs, rhs, **options):
    out = gmm_jax.gmm(lhs, rhs, jnp.asarray(sizes), implementation="pallas_tpu",
                      interpret=simulators.tpu(), **options)
    return jnp.sum(out * ct)

  with simulators.no_race("tpu"):
    dlhs, drhs = jax.grad(loss, argnums=(0, 1))(lhs, rhs)
  want = gmm_oracle_vjp(lhs, rhs, sizes, "m", ct)
  np.testing.assert_allclose(f64(dlhs), want[0], **tolerances(jnp.float32, k=128))
  np.testing.assert_allclose(f64(drhs), want[1], **tolerances(jnp.float32, k=40))

  z, w, _ = make_operands("m", m=40, k=256, n=128, num_local=2, seed=13)
  w = w[:, :128]
  grad = jax.grad(functools.partial(loss, lhs_activation="swiglu"), argnums=(0, 1))
  used, decisions = _kernels_used(grad, z, w)
  assert used == {"pallas_tpu"}
  assert any(d.cfg.cotangent_of == "swiglu" for d in decisions)  # dz from the epilogue
  with simulators.no_race("tpu"):
    dz, dw = grad(z, w)
  reference = jax.grad(lambda z, w: jnp.sum(gmm_jax.gmm(
      z, w, jnp.asarray(sizes), implementation="reference", lhs_activation="swiglu") * ct),
      argnums=(0, 1))
  want_dz, want_dw = reference(jnp.asarray(z, jnp.float32), w)
  for got, want in ((dz, want_dz), (dw, want_dw)):
    np.testing.assert_allclose(f64(got), f64(want), rtol=1e-4,
                               atol=1e-4 * float(np.abs(f64(want)).max()))


def _blockwise_fp8(m: int, seed: int):
  """fp8 training's forward operands: e4m3 lhs ``[M, 256]`` with 1 x 128 block scales, rhs
  ``[2, 256, 128]`` with 128 x 128 ones."""
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((m, 256)).astype(np.float32)
  rhs = rng.standard_normal((2, 256, 128)).astype(np.float32)
  return (gmm_jax.quantize(lhs, E4M3, channelwise_axes=(0,), tiled_axes={1: 128}),
          gmm_jax.quantize(rhs, E4M3, channelwise_axes=(0,), tiled_axes={1: 128, 2: 128}))


def test_tpu_blockwise_fp8():
  """fp8 training's forward layout; the oracle multiplies the dequantized blocks in
  float64."""
  lhs_q, rhs_q = _blockwise_fp8(40, 14)
  got = _tpu(lhs_q, rhs_q, [24, 10], preferred_element_type=jnp.float32)
  want = gmm_oracle(dequantize(lhs_q), dequantize(rhs_q), [24, 10], "m")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=256))


def test_tpu_blockwise_fp8_weight_gradient():
  """fp8 training's weight gradient: k-grouped over the tokens, both operands in 128 x 1
  blocks along them (e5m2 cotangent), group boundaries inside the blocks."""
  rng = np.random.default_rng(22)
  x = rng.standard_normal((300, 128)).astype(np.float32)
  dy = rng.standard_normal((300, 128)).astype(np.float32)
  x_q = gmm_jax.quantize(x, E4M3, channelwise_axes=(1,), tiled_axes={0: 128})
  dy_q = gmm_jax.quantize(dy, jnp.float8_e5m2, channelwise_axes=(1,), tiled_axes={0: 128})
  sizes = [100, 0, 150]
  got = _tpu(x_q, dy_q, sizes, group_type="k", num_groups=3, transpose_lhs=True,
             preferred_element_type=jnp.float32)
  want = gmm_oracle(dequantize(x_q), dequantize(dy_q), sizes, "k", transpose_lhs=True)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=300))
  np.testing.assert_array_equal(f64(got)[1], 0.0)  # the empty group: exactly 0


@pytest.mark.parametrize("mode", ["weight_only", "scaled"])
def test_tpu_quantized_int8(mode):
  """int8 weights with per-channel scales (weight-only: f32 activations; scaled: int8 x
  int8 with both operands' scales)."""
  rng = np.random.default_rng(15)
  lhs = rng.standard_normal((40, 128)).astype(np.float32)
  rhs = rng.standard_normal((2, 128, 128)).astype(np.float32)
  rhs_q = gmm_jax.quantize(rhs, jnp.int8, channelwise_axes=(0, 2))
  lhs_op = gmm_jax.quantize(lhs, jnp.int8, channelwise_axes=(0,)) if mode == "scaled" else lhs
  got = _tpu(lhs_op, rhs_q, [30, 7], preferred_element_type=jnp.float32)
  want = gmm_oracle(dequantize(lhs_op) if mode == "scaled" else lhs, dequantize(rhs_q),
                    [30, 7], "m")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=128))


def test_force_tpu_interpret_mode_reaches_the_kernel():
  """Every gmm traced under ``pltpu.force_tpu_interpret_mode`` runs as if called with its
  parameters (jax simulates every Pallas TPU call there): jit, vmap and the same values."""
  lhs, rhs, _ = make_operands("m", m=32, k=128, n=128, num_local=2, seed=16)
  sizes = jnp.asarray([20, 12])
  fn = jax.jit(lambda lhs, rhs: gmm_jax.gmm(lhs, rhs, sizes, implementation="pallas_tpu",
                                            interpret=True))
  with simulators.no_race("tpu"), pltpu.force_tpu_interpret_mode(simulators.tpu()):
    got = fn(lhs, rhs)
    batched = jax.vmap(fn, in_axes=(None, 0))(lhs, jnp.stack([rhs, 2 * rhs]))
  want = gmm_oracle(lhs, rhs, [20, 12], "m")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=128))
  np.testing.assert_allclose(f64(batched[1]), 2 * want, **tolerances(jnp.float32, k=128))


def test_simulator_params_for_the_wrong_kernel_fall_through():
  """The TPU simulator runs the Mosaic TPU kernel only: with its parameters a chain that
  starts with Triton runs the TPU kernel (Triton refuses, naming the simulators)."""
  lhs, rhs, _ = make_operands("m", m=32, k=128, n=128, num_local=2, seed=17)
  fn = lambda lhs, rhs: gmm_jax.gmm(  # noqa: E731
      lhs, rhs, jnp.asarray([20, 12]), implementation=("pallas_triton", "pallas_tpu"),
      interpret=simulators.tpu())
  used, decisions = _kernels_used(fn, lhs, rhs)
  assert used == {"pallas_tpu"}
  assert "pltpu.InterpretParams runs pallas_tpu" in decisions[0].refusals[0]
  with pytest.raises(ValueError, match="interpret must be a bool"):
    gmm_jax.gmm(lhs, rhs, jnp.asarray([20, 12]), interpret="tpu")


# ---------------------------------------------------------------- the Mosaic GPU kernel


def _gpu(lhs, rhs, sizes, **options):
  with simulators.no_race("gpu"):
    return jax.block_until_ready(gmm_jax.gmm(
        lhs, rhs, jnp.asarray(sizes, jnp.int32), implementation="pallas_mosaic_gpu",
        interpret=simulators.gpu(), **options))


GPU_CASES = [
    # tile_n 128: the warp-specialized kernel (a producer warpgroup on TMA); 64: one
    # warpgroup. Ragged K and N, an empty group, rows past the total, a group offset.
    pytest.param(jnp.bfloat16, dict(group_offset=1, activation="gelu_tanh"),
                 Tiling(64, 64, 128), id="bf16-specialized-offset-gelu-tanh"),
    pytest.param(jnp.float16, dict(transpose_rhs=True), Tiling(64, 64, 64),
                 id="f16-one-warpgroup-transposed-rhs"),
]


@simulators.needs_gpu_simulator
@pytest.mark.parametrize("dtype, options, tiling", GPU_CASES)
def test_mosaic_gpu_kernel_matches_the_oracle(dtype, options, tiling):
  lhs, rhs, bias = make_operands("m", m=100, k=72, n=80, num_local=3, lhs_dtype=dtype,
                                 transpose_rhs=options.get("transpose_rhs", False),
                                 with_bias=True, seed=18)
  sizes = [30, 0, 41, 20] if "group_offset" in options else [30, 0, 41]
  got = _gpu(lhs, rhs, sizes, bias=bias, tiling=tiling, preferred_element_type=jnp.float32,
             **options)
  want = gmm_oracle(lhs, rhs, sizes, "m", bias=bias, num_local=3, **options)
  np.testing.assert_allclose(f64(got), want, **tolerances(dtype, jnp.float32, k=72))


@simulators.needs_gpu_simulator
def test_mosaic_gpu_blockwise_fp8():
  lhs_q, rhs_q = _blockwise_fp8(64, 19)
  got = _gpu(lhs_q, rhs_q, [40, 17], preferred_element_type=jnp.float32)
  want = gmm_oracle(dequantize(lhs_q), dequantize(rhs_q), [40, 17], "m")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=256))


@simulators.needs_gpu_simulator
def test_mosaic_gpu_gradients_through_the_op():
  """The op's gradients with the GPU simulator: the forward and dlhs gmms on the Mosaic GPU
  kernel, drhs (k-grouping, which it does not serve) on the next implementation."""
  lhs, rhs, _ = make_operands("m", m=64, k=64, n=64, num_local=3, lhs_dtype=jnp.bfloat16,
                              seed=20)
  sizes = [20, 0, 25]
  ct = np.random.default_rng(21).standard_normal((64, 64)).astype(np.float32)

  def loss(lhs, rhs):
    out = gmm_jax.gmm(lhs, rhs, jnp.asarray(sizes), implementation=("pallas_mosaic_gpu", "xla"),
                      interpret=simulators.gpu())  # bf16: so is its cotangent (dlhs's lhs)
    return jnp.sum(out.astype(jnp.float32) * ct)

  grad = jax.grad(loss, argnums=(0, 1))
  _, decisions = _kernels_used(grad, lhs, rhs)
  assert {(d.cfg.group_type, d.implementation) for d in decisions} == {
      ("m", "pallas_mosaic_gpu"), ("k", "xla")}
  with simulators.no_race("gpu"):
    dlhs, drhs = grad(lhs, rhs)
  want = gmm_oracle_vjp(lhs, rhs, sizes, "m", f64(jnp.asarray(ct, jnp.bfloat16)))
  np.testing.assert_allclose(f64(dlhs), want[0], **tolerances(jnp.bfloat16, k=64))
  np.testing.assert_allclose(f64(drhs), want[1], **tolerances(jnp.bfloat16, k=64))
