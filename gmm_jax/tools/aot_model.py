"""A static model of a compiled GPU kernel's share of peak, for `gmm_jax.tools.aot`.

Read from each kernel's deviceless compile and plan, with no GPU:

* occupancy: the programs an SM holds at once, from ptxas's registers and the kernel's
  shared memory (`GpuPeaks` limits);
* the MMA instruction family of its code (tcgen05 / wgmma / mma.sync) and how many of them
  one K step of a tile issues;
* the rows and bytes its plan moves (`cost_models.triton_static_cost` on balanced groups:
  the padded rows the MMAs process and the HBM bytes through an L2 of whole tiles);
* waves of programs over the target's SMs, and the chip's peak FLOP/s and bandwidth.

The kernel's time is ``max(compute, memory) + LAUNCH_S``: compute is the busiest SM's
share of the MMA work at the instruction family's ceiling (`MMA_CEILING`), memory the
modelled HBM bytes at the chip's bandwidth. Modelled TFLOP/s counts the useful FLOPs (the
groups' rows only), so masked rows, waves and memory all show as a lower share of peak.

The ceilings are assumptions, each the best share of peak a kernel issuing only that
instruction family is known to sustain, from public measurements of dense GEMMs; one run
on a device (``benchmarks/gpu.sh`` prints measured beside modelled) checks them.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.tiling import chips, cost_models

# The best share of the chip's dense peak a kernel issuing only this MMA family sustains:
# wgmma (sm_90): large bf16 GEMMs reach ~0.8 of H100's 989 TFLOP/s, fp8 ones (DeepGEMM on
# H800) about the same; tcgen05 (sm_100): cuBLAS reaches 1,610-1,650 of B200's 2,250 bf16
# TFLOP/s at 4096-8192 (pyptx.dev's measurement), 0.73; mma.sync: Hopper's tensor cores run
# at full rate only through wgmma (FlashAttention-2 on mma.sync reaches about half of
# FlashAttention-3's wgmma rate on H100), and Blackwell's legacy path is a guess to be
# measured. Keys: (family, compute capability major).
MMA_CEILING = {("tcgen05", 10): 0.73, ("wgmma", 9): 0.80, ("mma.sync", 9): 0.40,
               ("mma.sync", 10): 0.25}
# Fewer than 8 warps resident on an SM (one warpgroup) leave its loads and epilogue
# unoverlapped with another warpgroup's MMAs: that share of the ceiling (an assumption).
ONE_WARPGROUP = 0.75
LAUNCH_S = 4e-6  # a kernel launch's fixed cost
# The GPU kinds of the deviceless targets (`deviceless.TARGETS`).
TARGET_KINDS = {"h100": "NVIDIA H100", "h200": "NVIDIA H200", "b200": "NVIDIA B200"}


@dataclasses.dataclass(frozen=True)
class Estimate:
  """The model of one kernel launch."""

  tflops: float  # useful TFLOP/s
  share: float  # of the chip's dense peak for the operands' type
  bound: str  # "compute" or "memory"
  blocks_per_sm: int  # programs an SM holds at once
  waves: float  # programs over (SMs x blocks_per_sm)
  mma_per_step: int  # MMA instructions of one K step of a tile
  family: str  # the MMA family the model runs it at
  seconds: float


def mma_family(mma: str, major: int) -> str | None:
  """The fastest MMA family a kernel's instructions (`aot_code.mma_kind`, comma-separated)
  hold on a chip of compute capability `major`."""
  for family in ("tcgen05", "wgmma", "mma.sync"):
    if family in mma and (family, major) in MMA_CEILING:
      return family
  return None


def peak_for(peaks: chips.GpuPeaks, lhs_dtype, rhs_dtype, quant_mode: str) -> float:
  """The dense peak the kernel's products run at: 8-bit floats (both sides) at the fp8
  rate, int8 x int8 at the int8 rate, f32 at TF32's, the rest (bf16, f16, weights
  dequantized to them) at bf16's."""
  lhs, rhs = np.dtype(lhs_dtype), np.dtype(rhs_dtype)
  if lhs.itemsize == 1 and rhs.itemsize == 1 and quant_mode in ("scaled", "blocked", "none"):
    return peaks.int8 if lhs.kind == "i" else peaks.fp8
  if lhs.itemsize == 4 and rhs.itemsize == 4:
    return peaks.tf32
  return peaks.bf16


def _mma_per_step(family: str, tiles, itemsize: int) -> int:
  """The MMA instructions one K step of a ``tile_m x tile_k x tile_n`` tile issues, at the
  family's largest shape for these operands (K 16 for 2-byte, 32 for 1-byte, 8 for 4-byte
  elements)."""
  tile_m, tile_k, tile_n = tiles
  k = {1: 32, 2: 16}.get(itemsize, 8)
  m, n = {"tcgen05": (min(tile_m, 128), min(tile_n, 256)),
          "wgmma": (64, min(tile_n, 256)), "mma.sync": (16, 8)}[family]
  return math.ceil(tile_m / m) * math.ceil(tile_n / n) * math.ceil(tile_k / k)


def blocks_per_sm(peaks: chips.GpuPeaks, warps: int, registers: int, smem: int) -> int:
  """Programs one SM holds at once: the fewest its registers (allocated per warp in units
  of 256), shared memory (plus 1 KiB reserved per block), threads and block slots allow."""
  threads = 32 * warps
  per_warp = math.ceil(max(registers, 1) * 32 / 256) * 256
  by_registers = peaks.registers_per_sm // (per_warp * warps)
  by_smem = peaks.smem_per_sm // (smem + 1024) if smem else peaks.blocks_per_sm
  return max(0, min(by_registers, by_smem, peaks.threads_per_sm // threads,
                    peaks.blocks_per_sm))


def estimate(problem, tiles, *, warps: int | None, registers: int | None, smem: int | None,
             mma: str, programs: int | None = None) -> Estimate | None:
  """The model of one kernel launch of `problem` (`tuning.Problem`, on a GPU kind of
  `chips.GPU_PEAKS`) with `tiles` (tile_m, tile_k, tile_n), from its compile: `warps` per
  program, ptxas's `registers`, its shared memory and MMA instructions, and the programs
  its grid launches (a persistent kernel's one per SM holds one per SM); None where one of
  them is unknown."""
  peaks = chips.gpu_peaks(problem.device_kind) if problem is not None else None
  entry = chips.gpu_kind_entry(problem.device_kind) if problem is not None else None
  if peaks is None or entry is None or not warps or not mma:
    return None
  (major, _), sms = entry
  persistent = programs is not None and programs <= sms  # one program per SM, it compiled
  if registers is None and not persistent:
    return None
  family = mma_family(mma, major)
  if family is None:
    return None
  m, k, n = problem.m, problem.k, problem.n
  tile_m, tile_k, tile_n = tiles
  group_rows = m if problem.group_type == "m" else k
  groups = max(problem.num_local, 1)
  counts = np.full(groups, group_rows // groups, np.int64)
  counts[: group_rows % groups] += 1
  cfg = GmmConfig(group_type=problem.group_type, num_local=groups,
                  out_dtype=problem.out_dtype, transpose_lhs=problem.transpose_lhs,
                  transpose_rhs=problem.transpose_rhs)
  itemsize = max(np.dtype(problem.lhs_dtype).itemsize, np.dtype(problem.rhs_dtype).itemsize)
  cost = cost_models.triton_static_cost(counts, m, k, n, cfg, Tiling(tile_m, tile_k, tile_n),
                                        itemsize, num_sms=sms)
  useful = 2.0 * m * k * n
  padded = cost["mma_rows"] / max(cost["useful_rows"], 1)
  executed = useful * padded * (math.ceil(n / tile_n) * tile_n / max(n, 1))
  peak = peak_for(peaks, problem.lhs_dtype, problem.rhs_dtype, problem.quant_mode)
  resident = 1 if registers is None else blocks_per_sm(peaks, warps, registers, smem or 0)
  if programs:
    resident = min(resident, math.ceil(programs / sms))
  if resident == 0:
    return Estimate(0.0, 0.0, "does not fit", 0, math.inf, 0, family, math.inf)
  rate = peak / sms * MMA_CEILING[(family, major)] * (
      1.0 if resident * warps >= 8 else ONE_WARPGROUP)
  busy = max(cost["busy_steps"], 1)
  compute = math.ceil(busy / sms) * (executed / busy) / rate
  memory = cost["hbm_bytes"] / peaks.hbm
  seconds = max(compute, memory) + LAUNCH_S
  tflops = useful / seconds / 1e12
  return Estimate(tflops, tflops * 1e12 / peak, "compute" if compute >= memory else "memory",
                  resident, busy / (sms * resident), _mma_per_step(family, tiles, itemsize),
                  family, seconds)


def xla_estimate(kind: str, dtype, useful: float, flops: float,
                 bytes_accessed: float) -> Estimate | None:
  """The same model for a program of XLA's own kernels (`jax.lax.ragged_dot`), from its
  compiled cost analysis: the FLOPs it executes at the chip's best MMA family's ceiling
  (XLA's GEMMs use it), its bytes at the chip's bandwidth; `useful` FLOPs over that time.
  None for an unknown kind or an empty analysis."""
  peaks, entry = chips.gpu_peaks(kind), chips.gpu_kind_entry(kind)
  if peaks is None or entry is None or flops <= 0:
    return None
  (major, _), _ = entry
  family = next(f for f in ("tcgen05", "wgmma") if (f, major) in MMA_CEILING)
  peak = peak_for(peaks, dtype, dtype, "none")
  compute = flops / (peak * MMA_CEILING[(family, major)])
  memory = bytes_accessed / peaks.hbm
  seconds = max(compute, memory) + LAUNCH_S
  tflops = useful / seconds / 1e12
  return Estimate(tflops, tflops * 1e12 / peak, "compute" if compute >= memory else "memory",
                  0, 0.0, 0, family, seconds)
