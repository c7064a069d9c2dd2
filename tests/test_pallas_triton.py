"""The Pallas GPU (Triton backend) kernels: the shared suite in interpret mode on CPU, and
cross-lowering for CUDA of the compiled kernels (Triton's own checks: power-of-2 blocks,
lowerable primitives), which needs no GPU."""

from __future__ import annotations

import types

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax import dequantize, quantize
from gmm_jax._src.tiling import chips, cost_models
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.core.epilogue import apply_epilogue
from gmm_jax._src.backends.reference import gmm_reference
from gmm_jax.pallas.gpu import triton as triton_gmm
from gmm_jax.pallas.gpu import triton_kernel
from grids import covering
from gmm_test_base import SIZES_WITH_EMPTY, GmmTestBase, lowering_problem, make_operands
from lowering import lower_for, triton_calls
from oracle import f64, gmm_oracle, tolerances

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


# Default run: each problem once, the layouts alternating (-m slow: both for each).
@covering(("group_type, sizes, offset", [
    pytest.param("m", [17, 0, 3, 20], 0, id="m"),
    pytest.param("m", [17, 0, 3, 20], 1, id="m-offset1"),
    pytest.param("k", [17, 0, 3, 29], 0, id="k"),
    pytest.param("k", [17, 0, 3, 29], 2, id="k-offset2"),
]), ("transpose_lhs, transpose_rhs", [(False, False), (True, True)]))
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
  np.testing.assert_allclose(triton_kernel.erf_f32(x), jax.scipy.special.erf(x), rtol=2e-6,
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
  chain = registry.candidates(GmmConfig(group_type="m", num_local=1), "gpu")
  assert "pallas_triton" in chain and chain[-1] == "xla"
  lhs, rhs, _ = make_operands("m")
  sizes = np.asarray(SIZES_WITH_EMPTY, np.int32)
  erf_gelu = lambda x: jax.nn.gelu(x, approximate=False)  # noqa: E731
  with pytest.raises(NotImplementedError, match="erf"):
    _lower_for_cuda(lambda l, r: gmm_jax.gmm(l, r, sizes, activation=erf_gelu,
                                             implementation="pallas_triton"), lhs, rhs)
  text = _lower_for_cuda(lambda l, r: gmm_jax.gmm(l, r, sizes, activation=erf_gelu), lhs, rhs)
  assert triton_calls(text) == 0  # the platform chain served it without Triton


# ------------------------------------------------------------------- program order (L2)


@pytest.mark.parametrize("num_rows, num_cols, band", [
    (1, 1, 1), (7, 5, 4), (16, 3, 8), (9, 1, 16), (33, 7, 8), (5, 12, 1),
])
def test_program_order_visits_every_tile_once(num_rows, num_cols, band):
  programs = np.arange(num_rows * num_cols)
  rows, cols = cost_models.program_order(programs, num_rows, num_cols, band, xp=np)
  assert sorted(zip(rows.tolist(), cols.tolist())) == [
      (r, c) for r in range(num_rows) for c in range(num_cols)]
  # Rows run fastest inside a band: consecutive programs share a column and cover a band
  # of neighbouring rows before the column advances.
  for first in range(0, num_rows, band):
    in_band = (rows >= first) & (rows < first + band)
    size = min(band, num_rows - first)
    assert np.all(np.diff(np.flatnonzero(in_band)) == 1), "a band is contiguous in time"
    assert np.all(cols[in_band] == np.repeat(np.arange(num_cols), size))
  # The traced in-kernel form gives the same mapping.
  traced = jax.jit(lambda p: cost_models.program_order(p, num_rows, num_cols, band))(
      jnp.asarray(programs, jnp.int32))
  np.testing.assert_array_equal(np.asarray(traced[0]), rows)
  np.testing.assert_array_equal(np.asarray(traced[1]), cols)


# ----------------------------------------------------------- partial windows, K tails


@pytest.mark.parametrize("tile_m", [32, 64])
def test_partial_windows_in_row_classes(tile_m):
  # Groups of 0/1/15/17/33 rows: windows of 1, 15, 17, 33 (and the remainders past full
  # tiles) land in the 16-, 32- and 64-row branches; K = 40 has a masked 8-row tail step.
  sizes = [0, 1, 15, 17, 33, 0]
  m, k, n, num_local = 80, 40, 48, 6
  lhs, rhs, bias = make_operands("m", m=m, k=k, n=n, num_local=num_local, with_bias=True,
                                 seed=7)
  cfg = GmmConfig(group_type="m", num_local=num_local, activation="silu",
                  out_dtype=np.dtype("float32"), interpret=True)
  tiling = Tiling(tile_m=tile_m, tile_k=16, tile_n=32)
  got = jax.jit(lambda *a: triton_gmm.gmm_triton(*a, cfg, tiling))(
      lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(0), bias)
  want = gmm_oracle(lhs, rhs, sizes, "m", bias=bias, activation="silu")
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=k))
  assert np.all(np.asarray(got)[sum(sizes):] == 0)


# ------------------------------------------------------------------------------ split-K


# Default run: each shape once with an activation and the summation alternating, and the
# atomic sum on ragged edges too; the other 8 cases with -m slow.
@covering(("activation", ["gelu", None]), ("m, n, transpose_lhs, transpose_rhs", [
    (32, 64, False, False),  # tiles divide M and N: the unmasked atomic add itself
    (32, 64, True, True),
    (24, 40, False, False),  # ragged M and N edges (masked; read-modify-write here)
]), ("deterministic", [pytest.param(True, id="ordered"), pytest.param(False, id="atomic")]),
          keep=[(0, 2, 1)])
def test_split_k_matches_the_oracle(activation, m, n, transpose_lhs, transpose_rhs,
                                    deterministic):
  # Chunks of 32 K rows: the 70-row group is three chunks (the last masked), the 5-row one
  # a single partial chunk, the empty group none (its output is activation(bias)).
  sizes = [70, 0, 5, 37]
  k, num_local = 120, 4
  lhs, rhs, bias = make_operands("k", m=m, k=k, n=n, num_local=num_local,
                                 transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs,
                                 with_bias=True, seed=11)
  cfg = GmmConfig(group_type="k", num_local=num_local, transpose_lhs=transpose_lhs,
                  transpose_rhs=transpose_rhs, activation=activation,
                  out_dtype=np.dtype("float32"), interpret=True, deterministic=deterministic)
  tiling = Tiling(tile_m=16, tile_k=16, tile_n=32)
  fn = jax.jit(lambda *a: triton_gmm.gmm_triton(*a, cfg, tiling, k_chunk=32))
  got = fn(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(0), bias)
  want = gmm_oracle(lhs, rhs, sizes, "k", bias=bias, activation=activation,
                    transpose_lhs=transpose_lhs, transpose_rhs=transpose_rhs)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=k))
  jaxpr = str(jax.make_jaxpr(fn)(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(0), bias))
  # Deterministic: each chunk stores its partial sum to its own slot (no atomic in the
  # kernel), and the slots are added in order; else one atomically added buffer.
  assert ("gmm_k_triton_chunks" in jaxpr) == deterministic
  assert ("gmm_k_triton_split" in jaxpr) != deterministic
  if deterministic:
    assert "atomic" not in jaxpr
  elif m % tiling.tile_m == 0 and n % tiling.tile_n == 0:  # masked: read-modify-write here
    assert "atomic" in jaxpr


def test_split_k_ordered_buffer_and_sum():
  # The ordered path's result is, bitwise, the epilogue of its chunks' partial sums added
  # left to right, and two runs agree bit for bit.
  sizes = [70, 0, 5, 37]
  m, k, n, num_local = 24, 120, 40, 4
  lhs, rhs, bias = make_operands("k", m=m, k=k, n=n, num_local=num_local, with_bias=True,
                                 seed=5)
  cfg = GmmConfig(group_type="k", num_local=num_local, activation="silu",
                  out_dtype=np.dtype("float32"), interpret=True)
  assert cfg.deterministic  # the default
  tiling = Tiling(tile_m=16, tile_k=16, tile_n=32)
  counts = jnp.asarray(sizes, jnp.int32)
  fn = jax.jit(lambda *a: triton_gmm.gmm_triton(*a, cfg, tiling, k_chunk=32))
  first = np.asarray(fn(lhs, rhs, counts, jnp.int32(0), bias))
  second = np.asarray(fn(lhs, rhs, counts, jnp.int32(0), bias))
  assert first.tobytes() == second.tobytes()
  # Each chunk's partial sums, one unsplit kernel call per group's chunk.
  starts = np.concatenate([[0], np.cumsum(sizes)])
  plain = cfg.replace(activation=None)
  chunk_sums = []
  for chunk in range(cost_models.split_chunks(k, 32)):
    parts = np.zeros((num_local, m, n), np.float32)
    for g in range(num_local):  # group g's chunk: its K rows [lo, hi)
      lo = min(starts[g] + 32 * chunk, starts[g + 1])
      hi = min(lo + 32, starts[g + 1])
      if hi > lo:
        one = triton_gmm.gmm_triton(lhs[:, lo:hi], rhs[lo:hi], jnp.asarray([hi - lo],
                                    jnp.int32), jnp.int32(0), None,
                                    plain.replace(num_local=1), tiling, k_chunk=0)
        parts[g] = np.asarray(one)[0]
    chunk_sums.append(parts)
  total = chunk_sums[0]
  for part in chunk_sums[1:]:
    total = total + part
  want = apply_epilogue(jnp.asarray(total), bias[:, None, :], "silu", np.float32)
  np.testing.assert_array_equal(first, np.asarray(want))


def test_sm_count_from_the_target():
  fake = types.SimpleNamespace
  default = chips.DEFAULT_NUM_SMS
  assert cost_models.gpu_sm_count(fake(platform="gpu", core_count=148)) == 148
  assert cost_models.gpu_sm_count(fake(platform="gpu", num_cores=78)) == 78  # abstract
  assert cost_models.gpu_sm_count(fake(platform="gpu", core_count=None)) == default
  assert cost_models.gpu_sm_count(jax.devices("cpu")[0]) == default
  assert cost_models.gpu_sm_count() == default  # a CPU host: no target says
  if hasattr(jax.sharding, "AbstractDevice"):  # jax >= 0.11: the abstract mesh's device
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA B200", num_cores=148,
                                         platform="gpu")
    mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                     abstract_device=device)
    with jax.sharding.use_abstract_mesh(mesh):
      assert cost_models.gpu_sm_count() == 148
  # The wave model and the split choice follow the count.
  cfg, tiling = GmmConfig(group_type="k", num_local=2), Tiling(128, 64, 128)
  assert (cost_models.default_k_chunk(256, 262144, 256, cfg, tiling, num_sms=148)
          < cost_models.default_k_chunk(256, 262144, 256, cfg, tiling, num_sms=132))


def test_split_k_is_chosen_for_a_small_grid_and_long_k():
  cfg = GmmConfig(group_type="k", num_local=2)
  tiling = Tiling(tile_m=128, tile_k=64, tile_n=128)
  chunk = cost_models.default_k_chunk(256, 65536, 256, cfg, tiling)
  assert chunk is not None and chunk % 64 == 0 and 1024 <= chunk < 65536
  assert cost_models.default_k_chunk(4096, 16384, 14336, cfg, tiling) is None  # big grid
  assert cost_models.default_k_chunk(256, 1024, 256, cfg, tiling) is None  # short K


# --------------------------------------------------------------- 8-bit scaled on the MMA


@pytest.mark.parametrize("lhs_type, rhs_type", [
    (jnp.int8, jnp.int8),
    (jnp.float8_e4m3fn, jnp.float8_e4m3fn),
    (jnp.float8_e5m2, jnp.float8_e5m2),
    (jnp.float8_e4m3fn, jnp.float8_e5m2),
])
def test_scaled_8bit_in_kernel(lhs_type, rhs_type):
  rng = np.random.default_rng(3)
  m, k, n, num_local = 45, 96, 40, 3
  sizes = jnp.asarray([17, 0, 20], jnp.int32)
  x = quantize(rng.standard_normal((m, k)).astype(np.float32), lhs_type,
               channelwise_axes=(0,))
  w = quantize((rng.standard_normal((num_local, k, n)) / 10).astype(np.float32), rhs_type,
               channelwise_axes=(0, 2))
  bias = jnp.asarray(rng.standard_normal((num_local, n)), jnp.float32)
  cfg = GmmConfig(group_type="m", num_local=num_local, activation="silu",
                  out_dtype=np.dtype("float32"), interpret=True)
  triton_gmm.check_operands(x, w, cfg)  # served in-kernel, not composed
  got = triton_gmm.gmm_triton(x, w, sizes, jnp.int32(0), bias, cfg,
                              Tiling(tile_m=16, tile_k=32, tile_n=16))
  # Oracle: the dequantized operands in float64 (exact products of the values times both
  # scales), then bias and activation.
  want = gmm_oracle(np.asarray(dequantize(x, jnp.float32)),
                    np.asarray(dequantize(w, jnp.float32)), np.asarray(sizes), "m", bias=bias,
                    activation="silu")
  np.testing.assert_allclose(f64(got), want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------- cost model


def _ratio(sizes, m, k, n, num_local):
  cfg = GmmConfig(group_type="m", num_local=num_local)
  tiling = triton_gmm.default_tiling(m, k, n, cfg, 2)
  cost = cost_models.triton_static_cost(sizes, m, k, n, cfg, tiling, 2)
  assert cost["useful_rows"] == sum(sizes)
  return cost["mma_rows"] / cost["useful_rows"], cost


def test_static_cost_row_padding():
  from gmm_jax.tools.bench_host import group_sizes
  m, k, n, groups = 8192, 2048, 1408, 64  # 128 rows per expert
  balanced, _ = _ratio(group_sizes(m, groups, "balanced"), m, k, n, groups)
  assert balanced <= 1.10
  skewed, cost = _ratio(group_sizes(m, groups, "skewed"), m, k, n, groups)
  assert skewed <= 1.25, cost
  # Without the row classes every partial window would pay a full 128-row tile.
  sizes = group_sizes(m, groups, "skewed")
  full_tiles = sum(-(-int(s) // 128) * 128 for s in sizes)
  assert cost["mma_rows"] < full_tiles


def test_static_cost_l2_order_reads_lhs_about_once():
  # Mixtral-like: the banded order reads each operand about once (the item-fastest 2-D
  # order re-read lhs for every 1-2 N tiles: ~56x here).
  m, k, n, groups = 16384, 4096, 14336, 8
  _, cost = _ratio([m // groups] * groups, m, k, n, groups)
  assert cost["hbm_bytes"] <= 1.5 * cost["ideal_bytes"], cost
  assert cost["busy_steps"] <= cost["grid_steps"]
