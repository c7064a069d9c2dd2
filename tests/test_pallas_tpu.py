"""The Pallas TPU (Mosaic) kernels: the shared suite in interpret mode on CPU, several tiles
per dimension with ragged edges, and cross-lowering for TPU (Mosaic's own checks: block
shapes, lowerable primitives), which needs no TPU."""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.config import GmmConfig, Tiling
from gmm_jax._src.reference import gmm_reference
from gmm_jax.pallas.tpu import gmm as tpu_gmm
from gmm_test_base import SIZES_WITH_EMPTY, GmmTestBase, lowering_problem, make_operands
from lowering import lower_for, mosaic_calls
from oracle import f64, tolerances


class TestPallasTpu(GmmTestBase):
  IMPLEMENTATION = "pallas_tpu"
  INTERPRET = True


@pytest.mark.skipif(jax.default_backend() != "tpu", reason="compiled Mosaic kernels need a TPU")
class TestPallasTpuCompiled(GmmTestBase):
  IMPLEMENTATION = "pallas_tpu"
  INTERPRET = False


# ---------------------------------------------------------------- kernels with several tiles

# The suite's shapes fit one tile. Here every dimension spans several blocks with a ragged
# edge (Mosaic blocks are multiples of 128 on lanes; tile_m may be a multiple of 32 when lhs
# is untransposed), groups straddle tiles, a tile holds several groups, and the K edge
# (300 = 2 x 128 + 44) is padded garbage that the kernels must mask.
SEVERAL_TILES = [
    pytest.param("m", [70, 0, 41, 100], 0, False, False, id="m"),
    pytest.param("m", [70, 0, 41, 100], 1, False, True, id="m-offset1-tr"),
    pytest.param("m", [70, 0, 41, 100], 0, True, True, id="m-tl-tr"),
    pytest.param("k", [130, 0, 41, 100], 0, False, False, id="k"),
    pytest.param("k", [130, 0, 41, 100], 2, True, False, id="k-offset2-tl"),
    pytest.param("k", [0, 250, 0, 0], 0, False, True, id="k-one-group-tr"),
]


@pytest.mark.parametrize("group_type, sizes, offset, transpose_lhs, transpose_rhs",
                         SEVERAL_TILES)
def test_several_tiles_per_dimension(group_type, sizes, offset, transpose_lhs, transpose_rhs):
  m, k, n, num_local = (230, 300, 260, 3) if group_type == "m" else (70, 300, 260, 3)
  lhs, rhs, bias = make_operands(group_type, m=m, k=k, n=n, num_local=num_local,
                                 transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                                 with_bias=True, seed=7)
  cfg = GmmConfig(group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, activation="gelu",
                  out_dtype=np.dtype("float32"), interpret=True)
  tiling = Tiling(tile_m=128 if transpose_lhs else 32, tile_k=128, tile_n=128)
  counts, group_offset = jnp.asarray(sizes, jnp.int32), jnp.int32(offset)
  got = jax.jit(lambda *a: tpu_gmm.gmm_tpu(*a, cfg, tiling))(
      lhs, rhs, counts, group_offset, bias)
  want = jax.jit(lambda *a: gmm_reference(*a, cfg))(lhs, rhs, counts, group_offset, bias)
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(jnp.float32, k=k))


def test_tiling_override_through_gmm():
  # gmm(..., tiling=) reaches the kernel: an unblockable tile is refused by name.
  lhs, rhs, _ = make_operands("m", m=200, k=24, n=8)
  sizes = np.asarray([50, 0, 100, 30], np.int32)
  with pytest.raises(NotImplementedError, match="tile_m=48"):
    gmm_jax.gmm(lhs, rhs, sizes, implementation="pallas_tpu", interpret=True,
                tiling=Tiling(tile_m=48, tile_k=128, tile_n=128))
  got = gmm_jax.gmm(lhs, rhs, sizes, implementation="pallas_tpu", interpret=True,
                    tiling=Tiling(tile_m=64, tile_k=128, tile_n=128))
  want = gmm_jax.gmm(lhs, rhs, sizes, implementation="reference")
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(jnp.float32, k=24))


@pytest.mark.parametrize("group_type", ["m", "k"])
@pytest.mark.parametrize("m, k, n", [(8, 8, 8), (1000, 4096, 1024), (8192, 2048, 7168),
                                     (300, 129, 257)])
@pytest.mark.parametrize("num_local", [1, 8, 256])
@pytest.mark.parametrize("itemsize", [1, 2, 4])
@pytest.mark.parametrize("transpose_lhs", [False, True])
def test_default_tiling_is_blockable(group_type, m, k, n, num_local, itemsize, transpose_lhs):
  cfg = GmmConfig(group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs)
  tiling = tpu_gmm.default_tiling(m, k, n, cfg, itemsize)
  tpu_gmm.check_tiling(tiling, m, k, n, cfg)  # raises if Mosaic could not block it


# ----------------------------------------------------------------------- lowering for TPU


def _lower_for_tpu(fn, *args) -> str:
  return lower_for("tpu", fn, *args)


LOWERING_SHAPES = [  # (M, K, N): aligned, below one tile, ragged, several ragged tiles
    (256, 128, 256),
    (45, 50, 40),
    (7, 5, 3),
    (300, 129, 257),
    (1100, 640, 700),
]
LOWERING_CASES = [  # (lhs dtype, rhs dtype, preferred, transpose_lhs, transpose_rhs, act)
    (jnp.float32, jnp.float32, None, False, False, "silu"),
    (jnp.bfloat16, jnp.bfloat16, None, True, False, "gelu"),
    (jnp.float16, jnp.float16, jnp.float32, False, True, "gelu_tanh"),
    (jnp.bfloat16, jnp.float32, None, True, True, "relu"),
    (jnp.int8, jnp.int8, jnp.int32, False, False, None),
    (jnp.bfloat16, jnp.bfloat16, None, False, False, "fast_gelu"),
    (jnp.float32, jnp.bfloat16, jnp.bfloat16, False, True, jax.nn.sigmoid),
]
LOWERING_TILINGS = [None, Tiling(tile_m=128, tile_k=128, tile_n=128),
                    Tiling(tile_m=512, tile_k=256, tile_n=512)]


@pytest.mark.parametrize("tiling", range(len(LOWERING_TILINGS)))
@pytest.mark.parametrize("case", range(len(LOWERING_CASES)))
@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_lowers_for_tpu(group_type, shape, case, tiling):
  num_local = 4
  lhs, rhs, bias, options = lowering_problem(group_type, shape, LOWERING_CASES[case],
                                             num_local)

  def f(lhs, rhs, bias, sizes, offset):
    # implementation=None: the TPU chain must choose the kernel.
    return gmm_jax.gmm(lhs, rhs, sizes, bias=bias, group_offset=offset,
                       tiling=LOWERING_TILINGS[tiling], **options)

  sizes = jnp.zeros((num_local + 1,), jnp.int32)  # traced: any routing, one lowering
  text = _lower_for_tpu(f, lhs, rhs, bias, sizes, jnp.int32(1))
  assert mosaic_calls(text) == 1, "one Mosaic kernel"


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_gradients_lower_for_tpu(group_type):
  # The backward pass is forward gmms in the other grouping modes (and transposed layouts).
  lhs, rhs, bias = make_operands(group_type, m=300, k=129, n=257, lhs_dtype=jnp.bfloat16,
                                 with_bias=True)

  def loss(lhs, rhs, bias, sizes):
    out = gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, bias=bias, activation="gelu")
    return jnp.sum(out.astype(jnp.float32))

  text = _lower_for_tpu(jax.grad(loss, argnums=(0, 1, 2)), lhs, rhs, bias,
                        jnp.asarray(SIZES_WITH_EMPTY, jnp.int32))
  assert mosaic_calls(text) >= 3, "forward, dlhs and drhs kernels"


def test_unlowerable_activation_and_tiling_fall_back_to_xla():
  # erfc has no Mosaic rule and a 16-row tile cannot be blocked: the kernel refuses both
  # before it builds its pallas_call, so the TPU chain serves the call with "xla" instead
  # of failing inside Mosaic's lowering.
  lhs, rhs, _ = make_operands("m")
  sizes = np.asarray(SIZES_WITH_EMPTY, np.int32)
  erfc_gelu = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
  with pytest.raises(NotImplementedError, match="erfc"):
    _lower_for_tpu(lambda l, r: gmm_jax.gmm(l, r, sizes, activation=erfc_gelu,
                                            implementation="pallas_tpu"), lhs, rhs)
  for options in (dict(activation=erfc_gelu), dict(tiling=Tiling(tile_m=16))):
    text = _lower_for_tpu(lambda l, r: gmm_jax.gmm(l, r, sizes, **options), lhs, rhs)
    assert mosaic_calls(text) == 0  # served by "xla"
