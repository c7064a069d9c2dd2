"""The Pallas GPU (Triton backend) kernels: the shared suite in interpret mode on CPU, and
cross-lowering for CUDA of the compiled kernels (Triton's own checks: power-of-2 blocks,
lowerable primitives), which needs no GPU."""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src import dispatch
from gmm_jax._src.config import GmmConfig, Tiling
from gmm_jax._src.reference import gmm_reference
from gmm_jax.pallas.gpu import gmm as triton_gmm
from gmm_test_base import SIZES_WITH_EMPTY, GmmTestBase, lowering_problem, make_operands
from lowering import lower_for, triton_calls
from oracle import f64, tolerances

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


class TestPallasTriton(GmmTestBase):
  IMPLEMENTATION = "pallas_triton"
  INTERPRET = True


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="compiled Triton kernels need a GPU")
class TestPallasTritonCompiled(GmmTestBase):
  IMPLEMENTATION = "pallas_triton"
  INTERPRET = False


# ---------------------------------------------------------------- kernels with small tiles

# Default tiles cover the suite's small shapes in one K step and one N tile; 16x16x16
# tiles make every group span several items, K several steps and N several tiles, with
# ragged edges everywhere (45, 50 and 40 are not multiples of 16).
SMALL_TILES = Tiling(tile_m=16, tile_k=16, tile_n=16)


@pytest.mark.parametrize("transpose_lhs, transpose_rhs", [(False, False), (True, True)])
@pytest.mark.parametrize("group_type, sizes, offset", [
    pytest.param("m", [17, 0, 3, 20], 0, id="m"),
    pytest.param("m", [17, 0, 3, 20], 1, id="m-offset1"),
    pytest.param("k", [17, 0, 3, 29], 0, id="k"),
    pytest.param("k", [17, 0, 3, 29], 2, id="k-offset2"),
])
def test_several_tiles_per_group(group_type, sizes, offset, transpose_lhs, transpose_rhs):
  m, k, n, num_local = 45, 50, 40, 3
  lhs, rhs, bias = make_operands(group_type, m=m, k=k, n=n, num_local=num_local,
                                 transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                                 with_bias=True, seed=31)
  cfg = GmmConfig(group_type=group_type, num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, activation="gelu", out_dtype=np.dtype("float32"),
                  interpret=True)
  counts, group_offset = jnp.asarray(sizes, jnp.int32), jnp.int32(offset)
  got = jax.jit(lambda *a: triton_gmm.gmm_triton(*a, cfg, SMALL_TILES))(
      lhs, rhs, counts, group_offset, bias)
  want = jax.jit(lambda *a: gmm_reference(*a, cfg))(lhs, rhs, counts, group_offset, bias)
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(jnp.float32, k=k))


def test_erf_approximation():
  x = jnp.linspace(-6.0, 6.0, 4001, dtype=jnp.float32)
  np.testing.assert_allclose(triton_gmm.erf_f32(x), jax.scipy.special.erf(x), rtol=2e-6,
                             atol=1e-7)


def test_non_power_of_2_tiles_are_refused():
  cfg = GmmConfig(group_type="m", num_local=1, interpret=True)
  lhs, rhs, _ = make_operands("m", m=8, k=8, n=8, num_local=1)
  with pytest.raises(NotImplementedError, match="power-of-2"):
    triton_gmm.gmm_triton(lhs, rhs, jnp.array([8], jnp.int32), jnp.int32(0), None, cfg,
                          Tiling(tile_m=24, tile_k=16, tile_n=16))


# ----------------------------------------------------------------------- lowering for CUDA


def _lower_for_cuda(fn, *args) -> str:
  return lower_for("cuda", fn, *args)


LOWERING_SHAPES = [  # (M, K, N): powers of 2, and ragged / below-one-tile / prime sizes
    (64, 32, 64),
    (45, 50, 40),
    (7, 5, 3),
    (300, 129, 257),
]
LOWERING_CASES = [  # (lhs dtype, rhs dtype, preferred, transpose_lhs, transpose_rhs, act)
    (jnp.float32, jnp.float32, None, False, False, "silu"),
    (jnp.bfloat16, jnp.bfloat16, None, True, False, "gelu"),
    (jnp.float16, jnp.float16, jnp.float32, False, True, "gelu_tanh"),
    (jnp.bfloat16, jnp.float32, None, True, True, "relu"),
    (jnp.int8, jnp.int8, jnp.int32, False, False, None),
    (jnp.bfloat16, jnp.bfloat16, None, False, False, jax.nn.sigmoid),
]


@pytest.mark.parametrize("case", range(len(LOWERING_CASES)))
@pytest.mark.parametrize("shape", LOWERING_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_lowers_for_cuda(group_type, shape, case):
  num_local = 4
  lhs, rhs, bias, options = lowering_problem(group_type, shape, LOWERING_CASES[case],
                                             num_local)

  def f(lhs, rhs, bias, sizes, offset):
    return gmm_jax.gmm(lhs, rhs, sizes, bias=bias, group_offset=offset,
                       implementation="pallas_triton", **options)

  sizes = jnp.zeros((num_local + 1,), jnp.int32)  # traced: any routing, one lowering
  text = _lower_for_cuda(f, lhs, rhs, bias, sizes, jnp.int32(1))
  assert triton_calls(text) == 1, "one Triton kernel"


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_gradients_lower_for_cuda(group_type):
  # The backward pass is forward gmms in the other grouping modes (and transposed layouts).
  lhs, rhs, bias = make_operands(group_type, m=45, k=50, n=40, lhs_dtype=jnp.bfloat16,
                                 with_bias=True)

  def loss(lhs, rhs, bias, sizes):
    out = gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, bias=bias, activation="silu",
                      implementation="pallas_triton")
    return jnp.sum(out.astype(jnp.float32))

  text = _lower_for_cuda(jax.grad(loss, argnums=(0, 1, 2)), lhs, rhs, bias,
                         jnp.asarray(SIZES_WITH_EMPTY, jnp.int32))
  assert triton_calls(text) >= 3, (
      "forward, dlhs and drhs kernels")


def test_activation_without_triton_lowering_falls_back():
  # erf has no Triton lowering: the kernel refuses a callable that needs it before it
  # builds its pallas_call (so the platform chain moves on to "xla"), instead of failing
  # inside Triton's lowering.
  assert dispatch.candidates(GmmConfig(group_type="m", num_local=1), "gpu") == (
      "pallas_triton", "xla")
  lhs, rhs, _ = make_operands("m")
  sizes = np.asarray(SIZES_WITH_EMPTY, np.int32)
  erf_gelu = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
  with pytest.raises(NotImplementedError, match="erf"):
    _lower_for_cuda(lambda l, r: gmm_jax.gmm(l, r, sizes, activation=erf_gelu,
                                             implementation="pallas_triton"), lhs, rhs)
  text = _lower_for_cuda(lambda l, r: gmm_jax.gmm(l, r, sizes, activation=erf_gelu), lhs, rhs)
  assert triton_calls(text) == 0  # the platform chain served it with "xla"
