"""The Pallas Mosaic GPU (Hopper) kernel: numerics in jax's GPU interpreter on CPU (jax >=
0.12; it simulates shared memory, TMA, barriers and wgmma), its refusals (the dispatcher
then falls back to Triton), the target-GPU detection, and a deviceless compile for an H200
(needs the CUDA plugin; skipped without it).
"""

from __future__ import annotations


import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import h200
import pytest
import simulators
from gmm_test_base import make_operands
from oracle import f64, gmm_oracle, local_rows, tolerances

import gmm_jax
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.tiling import chips

mosaic = pytest.importorskip("gmm_jax.pallas.gpu.mosaic_gpu",
                             reason="this jax's Pallas Mosaic GPU lacks the kernel's API")
mosaic_kernel = pytest.importorskip("gmm_jax.pallas.gpu.mosaic_gpu_kernel")
plgpu = mosaic.plgpu

HAS_INTERPRETER = hasattr(plgpu, "InterpretGPUParams")
NO_INTERPRETER = (f"jax {jax.__version__} has no Mosaic GPU interpreter that runs this kernel "
                  "(jax 0.10.2's lacks a memory space for Ref operands; jax 0.12 runs it)")
pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")


def _run(lhs, rhs, sizes, offset, bias, cfg, tiling):
  """The kernel, called directly under jit, in jax's Mosaic GPU simulator (race detector
  on; `cfg.interpret` stands for it)."""
  cfg = cfg.replace(interpret=simulators.gpu())

  def kernel(*args):
    return mosaic.gmm_mosaic_gpu(*args, cfg, tiling)

  with simulators.no_race("gpu"):
    return jax.jit(kernel)(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.int32(offset), bias)


# ------------------------------------------------------------- numerics (GPU interpreter)


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


# (M, K, N, sizes, num_local, group_offset, transpose_rhs, activation, operand and out
# dtypes, tiling):
# K and N not multiples of the tiles (TMA zero-fill and clipped stores), groups straddling
# 64-row windows, empty groups, rows past the total, a group offset, 128-row windows; tiles
# of 128+ columns run the warp-specialized kernel, 64 columns the single-warpgroup one.
NUMERIC_CASES = [
    pytest.param(200, 72, 80, [70, 0, 65, 40], 3, 1, False, "gelu_tanh", jnp.bfloat16,
                 jnp.float32, Tiling(64, 64, 128), id="specialized-offset1-gelu-tanh-ragged"),
    pytest.param(200, 136, 80, [70, 0, 65, 40], 4, 0, True, None, jnp.float16, jnp.float16,
                 Tiling(64, 64, 64), id="one-warpgroup-transpose-rhs-f16"),
    pytest.param(130, 64, 256, [3, 120, 5], 3, 0, True, "silu", jnp.bfloat16, jnp.float32,
                 Tiling(128, 64, 256), id="specialized-tile128-silu"),
    pytest.param(48, 64, 64, [0, 0, 0], 3, 0, False, jax.nn.sigmoid, jnp.bfloat16,
                 jnp.float32, Tiling(64, 64, 64), id="all-empty-sigmoid"),
    # The cases gmm_test_base checks on every implementation that the ones above missed:
    # sizes that fill M (no row past the total), groups spanning several windows, offsets
    # whose local groups run past the list (3: one of two local groups exists; 4: none),
    # many decode-size groups with a 16-bit output (the default tiling).
    pytest.param(96, 64, 64, [40, 0, 56], 3, 0, False, "relu", jnp.bfloat16, jnp.bfloat16,
                 Tiling(64, 64, 64), id="sizes-fill-m-relu-bf16-out"),
    pytest.param(400, 64, 128, [300, 0, 5, 90], 4, 0, False, None, jnp.bfloat16,
                 jnp.float32, Tiling(64, 64, 128), id="groups-spanning-several-windows"),
    pytest.param(32, 64, 64, [5, 0, 7, 6], 2, 3, False, "silu", jnp.bfloat16, jnp.float32,
                 Tiling(64, 64, 64), id="offset3-second-local-group-past-the-list"),
    pytest.param(32, 64, 64, [5, 0, 7, 6], 2, 4, False, "silu", jnp.bfloat16, jnp.float32,
                 Tiling(64, 64, 64), id="offset4-no-local-group"),
    pytest.param(96, 64, 64, [0, 40, 3, 16, 17, 1, 0, 10], 8, 0, False, "gelu_tanh",
                 jnp.bfloat16, jnp.bfloat16, None, id="small-and-large-groups-default-tiling"),
]


@pytest.mark.skipif(not HAS_INTERPRETER, reason=NO_INTERPRETER)
@pytest.mark.parametrize("m, k, n, sizes, num_local, offset, transpose_rhs, activation, "
                         "dtype, out_dtype, tiling", NUMERIC_CASES)
def test_matches_oracle_in_interpreter(m, k, n, sizes, num_local, offset, transpose_rhs,
                                       activation, dtype, out_dtype, tiling):
  lhs, rhs, bias = make_operands("m", m=m, k=k, n=n, num_local=num_local,
                                 lhs_dtype=dtype, transpose_rhs=transpose_rhs,
                                 with_bias=activation is not None, seed=7)
  cfg = GmmConfig(group_type="m", num_local=num_local, transpose_rhs=transpose_rhs,
                  activation=activation, out_dtype=np.dtype(out_dtype), interpret=True)
  got = _run(lhs, rhs, sizes, offset, bias, cfg, tiling)
  oracle_act = _np_sigmoid if activation is jax.nn.sigmoid else activation
  want = gmm_oracle(lhs, rhs, sizes, "m", bias=bias, activation=oracle_act,
                    transpose_rhs=transpose_rhs, group_offset=offset, num_local=num_local)
  assert got.shape == (m, n) and got.dtype == np.dtype(out_dtype)
  np.testing.assert_allclose(f64(got), want, **tolerances(dtype, out_dtype, k=k))
  # Rows no local group owns are exactly 0 (no bias, no activation: sigmoid(0) != 0).
  owned = np.zeros(m, bool)
  bounds = np.concatenate([[0], np.cumsum(sizes)])
  for g in range(offset, min(offset + num_local, len(sizes))):
    owned[bounds[g]:bounds[g + 1]] = True
  assert not np.any(f64(got)[~owned])


# ------------------------------------------------------- 8-row windows (decode-size groups)

# Decode-size groups (0-20 rows) that mostly start off multiples of 8: [57, 66) straddles
# the 64-row tile boundary, the last window reads rows past M=128 (zero-filled).
DECODE_SIZES = [5, 13, 0, 20, 19, 9, 17, 3, 11, 7]
# 12 groups, 128-row tiles: [118, 129) straddles row 128, rows 129..135 belong to none.
DECODE_SIZES_128 = [0, 7, 20, 15, 18, 1, 19, 14, 12, 10, 2, 11]


def _expected_windows(sizes, offset, num_local, tile_m, granule):
  """{local group: its windows' first rows}, from each group's first row rounded down."""
  bounds = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  windows = {}
  for local in range(num_local):
    group = offset + local
    if group >= len(sizes) or sizes[group] == 0:
      continue
    first = bounds[group] // granule * granule
    windows[local] = list(range(first, bounds[group + 1], tile_m))
  return windows


@pytest.mark.parametrize("m, num_groups, tile_m, granule", [
    (512, 64, 64, 8),       # decode: 64 tokens x top-8 over 64 experts
    (1024, 64, 64, 8),
    (8192, 8, 128, 8),      # prefill: never more windows than tiles, so 8 rows too
    (130, 3, 128, 8),
    (4096, 1, 128, 128),    # one group starts at row 0: the same windows
    (64, 8, 64, 64),        # M within one tile (gmm_jax.tools.aot's decode case): the same items
    (48, 3, 64, 64),
])
def test_window_granule_is_a_function_of_static_shapes(m, num_groups, tile_m, granule):
  assert mosaic.window_granule(m, num_groups, tile_m) == granule


@pytest.mark.parametrize("sizes, m, tile_m, offset, num_local", [
    pytest.param(DECODE_SIZES, 128, 64, 0, len(DECODE_SIZES), id="decode-tile64"),
    pytest.param(DECODE_SIZES_128, 136, 128, 0, len(DECODE_SIZES_128), id="decode-tile128"),
    pytest.param(DECODE_SIZES, 128, 64, 3, 5, id="decode-offset3"),
    pytest.param([60, 70, 1, 62], 200, 64, 0, 4, id="tile-size-groups"),
])
def test_work_items_start_at_8_row_boundaries(sizes, m, tile_m, offset, num_local):
  # The kernel's items: windows at multiples of 8 from each group's first row, each item
  # inside its window, every local row owned once, fewer windows than tile alignment.
  items = mosaic.work_items(
      jnp.asarray(sizes, jnp.int32), jnp.int32(offset), m, tile_m, num_local)
  assert items.granule == 8
  windows, starts, ends, groups = map(np.asarray, items.operands)
  assert len(windows) % mosaic_kernel.BAND == 0
  active = ends > starts
  assert np.all(windows % 8 == 0)
  assert np.all((windows <= starts) & (ends <= windows + tile_m) | ~active)
  got = {}
  for window, group in zip(windows[active], groups[active]):
    got.setdefault(int(group), []).append(int(window))
  assert got == _expected_windows(sizes, offset, num_local, tile_m, 8)
  coverage = np.zeros(m, int)
  for start, end in zip(starts[active], ends[active]):
    coverage[start:end] += 1
  np.testing.assert_array_equal(coverage, local_rows(sizes, m, offset, num_local))
  tiles = sum(len(w) for w in _expected_windows(sizes, offset, num_local, tile_m, tile_m)
              .values())
  assert active.sum() < tiles, (active.sum(), tiles)


def _check_against_oracle(m, k, n, sizes, num_local, offset, transpose_rhs, activation, dtype,
                          out_dtype, tiling, seed=7):
  lhs, rhs, bias = make_operands("m", m=m, k=k, n=n, num_local=num_local, lhs_dtype=dtype,
                                 transpose_rhs=transpose_rhs,
                                 with_bias=activation is not None, seed=seed)
  cfg = GmmConfig(group_type="m", num_local=num_local, transpose_rhs=transpose_rhs,
                  activation=activation, out_dtype=np.dtype(out_dtype), interpret=True)
  got = _run(lhs, rhs, sizes, offset, bias, cfg, tiling)
  want = gmm_oracle(lhs, rhs, sizes, "m", bias=bias, activation=activation,
                    transpose_rhs=transpose_rhs, group_offset=offset, num_local=num_local)
  assert got.shape == (m, n) and got.dtype == np.dtype(out_dtype)
  np.testing.assert_allclose(f64(got), want, **tolerances(dtype, out_dtype, k=k))
  assert not np.any(f64(got)[~local_rows(sizes, m, offset, num_local)])


@pytest.mark.skipif(not HAS_INTERPRETER, reason=NO_INTERPRETER)
@pytest.mark.parametrize("m, k, n, sizes, num_local, offset, transpose_rhs, activation, "
                         "dtype, out_dtype, tiling", [
    pytest.param(128, 64, 64, DECODE_SIZES, 10, 0, False, "silu", jnp.bfloat16, jnp.float32,
                 Tiling(64, 64, 64), id="one-warpgroup-silu"),
    pytest.param(128, 72, 128, DECODE_SIZES, 10, 0, True, None, jnp.float16, jnp.float16,
                 Tiling(64, 64, 128), id="specialized-transpose-rhs-f16"),
    pytest.param(136, 64, 128, DECODE_SIZES_128, 12, 0, False, "gelu_tanh", jnp.bfloat16,
                 jnp.bfloat16, Tiling(128, 64, 128), id="tile128-straddling-row-128"),
    pytest.param(128, 64, 64, DECODE_SIZES, 5, 3, False, "relu", jnp.bfloat16, jnp.float32,
                 Tiling(64, 64, 64), id="group-offset3"),
])
def test_decode_size_groups_match_oracle(m, k, n, sizes, num_local, offset, transpose_rhs,
                                         activation, dtype, out_dtype, tiling):
  assert mosaic.window_granule(m, len(sizes), tiling.tile_m) == 8
  _check_against_oracle(m, k, n, sizes, num_local, offset, transpose_rhs, activation, dtype,
                        out_dtype, tiling)


@pytest.mark.skipif(not HAS_INTERPRETER, reason=NO_INTERPRETER)
@hypothesis.settings(max_examples=6)
@hypothesis.given(sizes=st.lists(st.integers(0, 20), min_size=12, max_size=12))
def test_random_decode_size_groups_match_oracle(sizes):
  # One shape (one compile): 12 groups of 0-20 rows in M=240 (rows past the total exist).
  _check_against_oracle(240, 64, 64, sizes, 12, 0, False, None, jnp.bfloat16, jnp.float32,
                        Tiling(64, 64, 64), seed=sum(sizes))


@pytest.mark.skipif(not HAS_INTERPRETER, reason=NO_INTERPRETER)
@pytest.mark.parametrize("m, sizes", [pytest.param(0, [0, 0], id="M0"),
                                      pytest.param(16, [], id="no-groups")])
def test_empty_problems_are_zero(m, sizes):
  num_local = max(1, len(sizes)) if sizes else 0
  lhs, rhs, _ = make_operands("m", m=m, k=64, n=64, num_local=num_local,
                              lhs_dtype=jnp.bfloat16)
  cfg = GmmConfig(group_type="m", num_local=num_local, out_dtype=np.dtype(jnp.float32),
                  interpret=True)
  got = _run(lhs, rhs, np.asarray(sizes, np.int32), 0, None, cfg, None)
  assert got.shape == (m, 64) and not np.any(f64(got))


@pytest.mark.skipif(not HAS_INTERPRETER, reason=NO_INTERPRETER)
def test_non_finite_rows_past_the_total_are_inert():
  # The window of the last group reads rows past the total: NaN/inf there must reach
  # neither the group's rows nor the zero rows.
  sizes, m = [5, 0, 9, 6], 64
  lhs, rhs, bias = make_operands("m", m=m, k=64, n=64, num_local=4, lhs_dtype=jnp.bfloat16,
                                 with_bias=True, seed=25)
  lhs = np.array(lhs)
  lhs[sum(sizes):] = np.nan
  lhs[sum(sizes)::2, 0] = np.inf
  lhs = jnp.asarray(lhs)
  cfg = GmmConfig(group_type="m", num_local=4, activation="relu",
                  out_dtype=np.dtype(jnp.float32), interpret=True)
  got = f64(_run(lhs, rhs, sizes, 0, bias, cfg, Tiling(64, 64, 64)))
  want = gmm_oracle(lhs[:sum(sizes)], rhs, sizes, "m", bias=bias, activation="relu")
  np.testing.assert_allclose(got[:sum(sizes)], want, **tolerances(jnp.bfloat16, k=64))
  assert np.all(got[sum(sizes):] == 0)


@pytest.mark.skipif(not HAS_INTERPRETER, reason=NO_INTERPRETER)
def test_bf16_accumulates_in_f32():
  # 256 + 63 * 1 is exact in f32; a bf16 accumulator (spacing 2 at 256) would lose the ones.
  m, k, n = 32, 64, 64
  lhs = np.ones((m, k), np.float32)
  lhs[:, 0] = 256.0
  cfg = GmmConfig(group_type="m", num_local=1, out_dtype=np.dtype(jnp.float32),
                  interpret=True)
  got = _run(jnp.asarray(lhs, jnp.bfloat16), jnp.ones((1, k, n), jnp.bfloat16), [m], 0, None,
             cfg, None)
  np.testing.assert_array_equal(f64(got), np.full((m, n), 256.0 + k - 1))


def test_the_dispatcher_hands_plain_interpret_mode_to_triton():
  # interpret=True (Pallas's plain interpret mode) cannot run this kernel, so it refuses
  # and the next implementation serves, gradients too (jax's simulator runs it:
  # tests/test_simulators.py).
  lhs, rhs, _ = make_operands("m", m=48, k=64, n=64, num_local=3, lhs_dtype=jnp.bfloat16,
                              seed=3)
  sizes = jnp.asarray([20, 0, 25], jnp.int32)

  def loss(implementation, lhs, rhs):
    out = gmm_jax.gmm(lhs, rhs, sizes, implementation=implementation,
                      interpret=implementation != "xla")
    return jnp.sum(jnp.square(out.astype(jnp.float32)))

  with registry.record() as decisions:
    got = jax.jit(jax.grad(lambda *a: loss(("pallas_mosaic_gpu", "pallas_triton"), *a),
                           argnums=(0, 1)))(lhs, rhs)
  assert {d.implementation for d in decisions} == {"pallas_triton"}
  assert all("interpret" in d.refusals[0] for d in decisions if d.cfg.group_type == "m")
  want = jax.jit(jax.grad(lambda *a: loss("xla", *a), argnums=(0, 1)))(lhs, rhs)
  for g, w in zip(got, want):
    np.testing.assert_allclose(f64(g), f64(w), rtol=2e-2,
                               atol=2e-2 * float(np.abs(f64(w)).max()))


def test_plain_interpret_mode_is_refused():
  # interpret=True is Pallas's plain interpret mode, which cannot run this kernel: only
  # jax's Mosaic GPU simulator can (interpret=plgpu.InterpretGPUParams(...)).
  lhs, rhs, _ = make_operands("m", m=16, k=64, n=64, num_local=1, lhs_dtype=jnp.bfloat16)
  cfg = GmmConfig(group_type="m", num_local=1, interpret=True)
  with pytest.raises(NotImplementedError, match="InterpretGPUParams"):
    mosaic.gmm_mosaic_gpu(lhs, rhs, jnp.asarray([16], jnp.int32), jnp.int32(0), None, cfg)


# -------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("change, match", [
    ({"group_type": "k"}, "group_type='k'"),
    ({"transpose_lhs": True}, "transposed lhs"),
    ({"lhs_dtype": jnp.float32}, "float32"),
    ({"k": 60}, "K=60"),
])
def test_refuses_what_it_does_not_serve(change, match):
  group_type = change.get("group_type", "m")
  transpose_lhs = change.get("transpose_lhs", False)
  lhs, rhs, _ = make_operands(group_type, m=32, k=change.get("k", 64), n=64, num_local=2,
                              lhs_dtype=change.get("lhs_dtype", jnp.bfloat16),
                              transpose_lhs=transpose_lhs)
  cfg = GmmConfig(group_type=group_type, num_local=2, transpose_lhs=transpose_lhs)
  with pytest.raises(NotImplementedError, match=match):
    mosaic.gmm_mosaic_gpu(lhs, rhs, jnp.asarray([10, 12], jnp.int32), jnp.int32(0), None, cfg)


def test_refuses_activations_it_cannot_lower():
  # erf lowers but has no layout inference rule in Mosaic GPU (jax 0.12): the exact GELU is
  # refused before lowering (Triton serves it), the tanh GELU is not.
  assert mosaic.unsupported_primitives("gelu")
  assert mosaic.unsupported_primitives(lambda x: jax.lax.erf(x)) == {"erf"}
  assert not mosaic.unsupported_primitives("gelu_tanh")


def test_refuses_quantized_weights():
  lhs, _, _ = make_operands("m", m=32, k=64, n=64, num_local=2, lhs_dtype=jnp.bfloat16)
  weights = gmm_jax.quantize(np.ones((2, 64, 64), np.float32), jnp.int8,
                             channelwise_axes=(0, 2))
  cfg = GmmConfig(group_type="m", num_local=2)
  with pytest.raises(NotImplementedError, match="quantized"):
    mosaic.check_operands(lhs, weights, cfg)


def test_refuses_without_a_hopper_target():
  # This host has no GPU: the kernel cannot tell it is lowered for an sm_90 and refuses
  # (naming sm_90a) before building anything, so the chain moves on to Triton.
  lhs, rhs, _ = make_operands("m", m=32, k=64, n=64, num_local=2, lhs_dtype=jnp.bfloat16)
  cfg = GmmConfig(group_type="m", num_local=2)
  with (jax.default_device(jax.devices("cpu")[0]),
        pytest.raises(NotImplementedError, match="sm_90a")):
    mosaic.gmm_mosaic_gpu(lhs, rhs, jnp.asarray([10, 12], jnp.int32), jnp.int32(0), None, cfg)


@pytest.mark.skipif(not hasattr(jax.sharding, "AbstractDevice"), reason="jax < 0.11")
@pytest.mark.parametrize("kind, hopper", [("NVIDIA H100", True), ("NVIDIA H200", True),
                                          ("NVIDIA A100-SXM4-80GB", False),
                                          ("NVIDIA B200", False)])
def test_target_from_the_abstract_device(kind, hopper):
  device = jax.sharding.AbstractDevice(device_kind=kind, num_cores=None, platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                   abstract_device=device)
  with jax.sharding.use_abstract_mesh(mesh):
    capability, num_sms, _ = mosaic.target_gpu()
    if hopper:
      assert capability == (9, 0) and num_sms == chips.DEFAULT_NUM_SMS
    else:
      with pytest.raises(NotImplementedError, match="sm_90a"):
        mosaic._check_target()


def test_is_first_in_the_gpu_chain():
  chain = registry.candidates(GmmConfig(group_type="m", num_local=1), "gpu")
  assert chain[:2] == ("pallas_mosaic_gpu", "pallas_triton")


# ---------------------------------------------------------------- deviceless H200 compile


def _h200():
  return h200.topology()


def test_deviceless_h200_compile_picks_the_mosaic_kernel():
  from jax.experimental import topologies
  topology = _h200()
  placed = jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("x",)),
                                      jax.sharding.PartitionSpec())
  m, k, n, g = 512, 256, 256, 4
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=placed)
  w = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=placed)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32, sharding=placed)

  def loss(x, w, sizes):  # forward, dlhs (m-grouped, transposed rhs) and drhs (k-grouped)
    return jnp.sum(jnp.square(gmm_jax.gmm(x, w, sizes).astype(jnp.float32)))

  with jax.default_device(topology.devices[0]), registry.record() as decisions:
    lowered = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w, sizes)
  served = {(d.cfg.group_type, d.cfg.transpose_rhs): d.implementation for d in decisions}
  assert served == {("m", False): "pallas_mosaic_gpu", ("m", True): "pallas_mosaic_gpu",
                    ("k", False): "pallas_triton"}
  lowered.compile()  # ptxas accepts the kernels for sm_90a
