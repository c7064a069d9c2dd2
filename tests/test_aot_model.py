"""The static model of a compiled GPU kernel's share of peak (`gmm_jax.tools.aot_model`),
the dots of a compiled HLO module it models `jax.lax.ragged_dot` from, and the device-side
comparison of measured against modelled (`gmm_jax.tools.aot_measure`, run here on the CPU).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gmm_jax._src.core.config import Problem
from gmm_jax._src.tiling import chips
from gmm_jax.tools import aot_measure, aot_model
from gmm_jax.tools.aot_cases import CASES, SHAPES, build
from gmm_jax.tools.aot_code import hlo_dot_cost

H200 = chips.GPU_PEAKS["NVIDIA H200"]


def _problem(m=16384, k=4096, n=14336, groups=8, kind="NVIDIA H200", dtype=jnp.bfloat16,
             group_type="m"):
  return Problem(implementation="pallas_triton", platform="gpu", device_kind=kind,
                 group_type=group_type, m=m, k=k, n=n, num_groups=groups, num_local=groups,
                 lhs_dtype=np.dtype(dtype), rhs_dtype=np.dtype(dtype),
                 out_dtype=np.dtype(jnp.bfloat16))


def test_blocks_per_sm_takes_the_tightest_limit():
  # 8 warps, 168 registers, 192 KiB of shared memory: one program (shared memory);
  # 4 warps, 84 registers (88 allocated), 54 KiB: four (shared memory, before registers: 5).
  assert aot_model.blocks_per_sm(H200, 8, 168, 196624) == 1
  assert aot_model.blocks_per_sm(H200, 4, 84, 55296) == 4
  assert aot_model.blocks_per_sm(H200, 4, 84, 0) == 5  # registers
  assert aot_model.blocks_per_sm(H200, 8, 255, 300 * 1024) == 0  # does not fit


def test_mma_family_is_the_fastest_in_the_code():
  assert aot_model.mma_family("mma.sync bf16 (m16n8k16), wgmma bf16.bf16", 9) == "wgmma"
  assert aot_model.mma_family("mma.sync bf16 (m16n8k16), tcgen05.mma kind::f16", 10) == (
      "tcgen05")
  assert aot_model.mma_family("mma.sync bf16 (m16n8k16)", 10) == "mma.sync"
  assert aot_model.mma_family("-", 9) is None


def test_a_large_training_gmm_is_compute_bound_at_the_families_ceiling():
  estimate = aot_model.estimate(_problem(), (128, 64, 256), warps=8, registers=168,
                                smem=196624, mma="mma.sync bf16 (m16n8k16), wgmma bf16.bf16")
  ceiling = aot_model.MMA_CEILING[("wgmma", 9)]
  assert estimate.bound == "compute" and estimate.family == "wgmma"
  assert 0.9 * ceiling < estimate.share <= ceiling
  assert estimate.tflops == pytest.approx(estimate.share * H200.bf16 / 1e12)
  assert estimate.mma_per_step == 2 * 1 * 4  # m64n256k16 over a 128 x 64 x 256 tile
  # The same kernel on mma.sync alone: the lower ceiling, nothing else changes.
  slow = aot_model.estimate(_problem(), (128, 64, 256), warps=8, registers=168, smem=196624,
                            mma="mma.sync bf16 (m16n8k16)")
  assert slow.share == pytest.approx(estimate.share * aot_model.MMA_CEILING[("mma.sync", 9)]
                                     / ceiling, rel=0.02)


def test_decode_is_memory_bound_and_the_fp8_peak_is_the_fp8_rate():
  decode = aot_model.estimate(_problem(m=64), (16, 64, 128), warps=4, registers=84,
                              smem=55296, mma="mma.sync bf16 (m16n8k16)")
  assert decode.bound == "memory" and decode.share < 0.1 and decode.blocks_per_sm == 4
  # Reading each expert's weights once at the chip's bandwidth bounds it from above.
  weights = 8 * 4096 * 14336 * 2
  assert decode.seconds >= weights / H200.hbm
  fp8 = _problem(dtype=jnp.float8_e4m3fn)
  assert aot_model.peak_for(H200, fp8.lhs_dtype, fp8.rhs_dtype, "blocked") == H200.fp8
  assert aot_model.peak_for(H200, np.dtype(jnp.int8), np.dtype(jnp.int8), "scaled") == H200.int8
  assert aot_model.peak_for(H200, np.dtype(jnp.float32), np.dtype(jnp.float32), "none") == (
      H200.tf32)


def test_a_persistent_kernel_holds_one_program_per_sm_and_unknowns_give_none():
  # Mosaic GPU's grid is one program per SM: no register count is needed.
  persistent = aot_model.estimate(_problem(), (128, 64, 256), warps=12, registers=None,
                                  smem=None, mma="wgmma bf16.bf16", programs=132)
  assert persistent is not None and persistent.blocks_per_sm == 1
  assert aot_model.estimate(_problem(), (128, 64, 256), warps=8, registers=None, smem=None,
                            mma="wgmma bf16.bf16", programs=7616) is None
  assert aot_model.estimate(_problem(kind="NVIDIA A100"), (128, 64, 256), warps=8,
                            registers=168, smem=0, mma="wgmma bf16.bf16") is None
  b200 = aot_model.estimate(_problem(kind="NVIDIA B200"), (128, 64, 256), warps=8,
                            registers=168, smem=196624, mma="tcgen05.mma kind::f16")
  assert b200.family == "tcgen05" and b200.share <= aot_model.MMA_CEILING[("tcgen05", 10)]


_HLO = """
  %p0 = bf16[16384,32768]{1,0} parameter(0)
  %p1 = bf16[32768,14336]{1,0} parameter(1)
  %dot.5 = f32[16384,14336]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %b0 = bf16[10,16384,4096]{2,1,0} parameter(2)
  %b1 = bf16[10,16384,14336]{2,1,0} parameter(3)
  %dot.7 = f32[10,4096,14336]{2,1,0} dot(%b0, %b1), lhs_batch_dims={0}, lhs_contracting_dims={1}, rhs_batch_dims={0}, rhs_contracting_dims={1}
"""


def test_hlo_dot_cost_counts_every_dot_and_the_xla_model_charges_them():
  flops, moved = hlo_dot_cost(_HLO)
  first = 2.0 * 16384 * 14336 * 32768
  second = 2.0 * 10 * 4096 * 14336 * 16384
  assert flops == first + second
  assert moved == (16384 * 32768 + 32768 * 14336) * 2 + 16384 * 14336 * 4 + (
      10 * 16384 * 4096 + 10 * 16384 * 14336) * 2 + 10 * 4096 * 14336 * 4
  # The dense expansion: 8 groups' worth of work for one group's useful FLOPs.
  useful = 2.0 * 16384 * 4096 * 14336
  model = aot_model.xla_estimate("NVIDIA H200", np.dtype(jnp.bfloat16), useful, 8 * useful, 0)
  assert model.share == pytest.approx(aot_model.MMA_CEILING[("wgmma", 9)] / 8, rel=0.01)
  assert aot_model.xla_estimate("NVIDIA H200", np.dtype(jnp.bfloat16), useful, 0, 0) is None


def test_measured_beside_modelled_on_this_machine():
  # The device-side comparison, run on the CPU: concrete operands for a case's abstract
  # ones (group sizes summing to the grouped rows, in-range row indices), its program timed,
  # and the table of modelled against measured per case.
  case = next(c for c in CASES if c.name == "small-moe-train")
  m, _, _, g = SHAPES[case.shape]
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  _, args = build(case, sharding)
  values = aot_measure.concrete(case, args)
  sizes = [v for v in jax.tree.leaves(values) if v.shape == (g,) and v.dtype == jnp.int32]
  assert sizes and int(sizes[0].sum()) == m
  seconds = aot_measure.measure(case, repeats=1)
  assert seconds > 0
  rows = [dict(target="h200", case=case.name, gmm=gmm, model_seconds=1e-3,
               model_tflops=2.0) for gmm in ("fwd", "drhs", "dlhs")]
  rows.append(dict(target="b200", case=case.name, gmm="fwd", model_seconds=1e-3,
                   model_tflops=2.0))
  rows.append(dict(target="h200", case="mixtral-train", gmm="fwd", model_seconds=None,
                   model_tflops=None))  # a kernel without a model: the case is left out
  results = aot_measure.compare(rows, "h200", 1, timer=lambda case, repeats: 6e-3)
  assert len(results) == 1
  (result,) = results
  assert result["gmms"] == "fwd+drhs+dlhs" and result["modelled_s"] == pytest.approx(3e-3)
  assert result["measured_tflops"] == pytest.approx(3 * 2.0 * 1e-3 / 6e-3)
  assert "| small-moe-train | fwd+drhs+dlhs | 3.000 | 6.000 | 2.00 |" in (
      aot_measure.table(results))
