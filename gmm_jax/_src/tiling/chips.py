"""The chips gmm_jax plans for: one table per platform and the TPU target reader.

Floor 0 (imports nothing from gmm_jax): the cost models, the kernels' tile choices and the
dispatcher read a chip's facts here.

* GPU: `GPU_KINDS` (compute capability and SMs by device kind, B200 included) for a target
  that names only its kind, and the H100/H200 defaults (`DEFAULT_NUM_SMS`, `L2_BYTES`) for
  one that says nothing. The target GPU itself is read by `cost_models.gpu_target`.
* TPU: `TPU_CHIPS` (VMEM, MXU, peak rates, HBM per jax device, by device kind, TPU7x
  included: no int8 MXU, two devices per chip), the target's kind (`tpu_kind`) and entry
  (`tpu_chip`), `int8_mxu`, jax's own description of the target (`target_tpu_info`) and
  the peak rates a roofline uses (`device_rates`).
"""

from __future__ import annotations

import dataclasses

import jax

from gmm_jax._src.core import jax_private

MIB = 2**20
GIB = 2**30


# -------------------------------------------------------------------------------- GPU

# H100 / H200 (SXM): streaming multiprocessors when the target does not say, and L2.
DEFAULT_NUM_SMS = 132
L2_BYTES = 50 * 2**20

# Compute capability and SMs of the GPU kinds gmm_jax knows, for a target that names only its
# kind (an abstract device); a jax Device says both itself (``compute_capability``,
# ``core_count``). Hopper kinds are sm_90 (the Mosaic GPU kernel's wgmma).
GPU_KINDS = {
    "NVIDIA H100": ((9, 0), 132),
    "NVIDIA H200": ((9, 0), 132),
    "NVIDIA H800": ((9, 0), 132),
    "NVIDIA H20": ((9, 0), 78),
    "NVIDIA GH200": ((9, 0), 132),
    "NVIDIA B200": ((10, 0), 148),
}


@dataclasses.dataclass(frozen=True)
class GpuPeaks:
  """A GPU's dense tensor-core peaks in FLOP/s by operand type and its HBM bandwidth in
  bytes/s (NVIDIA's datasheet figures for the SXM parts, without sparsity), and the limits
  of one SM that decide how many programs it holds at once."""

  bf16: float  # also f16
  fp8: float
  int8: float
  tf32: float
  hbm: float
  registers_per_sm: int = 65536
  smem_per_sm: int = 228 * 1024
  threads_per_sm: int = 2048
  blocks_per_sm: int = 32


GPU_PEAKS = {
    "NVIDIA H100": GpuPeaks(bf16=989e12, fp8=1979e12, int8=1979e12, tf32=494e12, hbm=3.35e12),
    "NVIDIA H200": GpuPeaks(bf16=989e12, fp8=1979e12, int8=1979e12, tf32=494e12, hbm=4.8e12),
    "NVIDIA B200": GpuPeaks(bf16=2250e12, fp8=4500e12, int8=4500e12, tf32=1100e12, hbm=8e12),
}


def gpu_kind_entry(kind) -> tuple[tuple[int, int], int] | None:
  """The `GPU_KINDS` entry whose name is in `kind` ("NVIDIA H100 80GB HBM3"), longest first."""
  return _by_kind(GPU_KINDS, kind)


def gpu_peaks(kind) -> GpuPeaks | None:
  """The `GPU_PEAKS` entry whose name is in `kind`, longest first."""
  return _by_kind(GPU_PEAKS, kind)


def _by_kind(table: dict, kind):
  kind = str(kind or "")
  for name in sorted(table, key=len, reverse=True):
    if name.removeprefix("NVIDIA ") in kind:
      return table[name]
  return None


# -------------------------------------------------------------------------------- TPU


@dataclasses.dataclass(frozen=True)
class TpuChip:
  """One TPU generation as gmm_jax plans for it, per jax device (a TensorCore on chips
  whose cores are separate devices, the whole chip on single-core and megacore chips).

  Fields: ``vmem_bytes`` per core; ``mxu`` the systolic array's side (rows = columns);
  ``bf16_flops``, ``int8_ops``, ``fp8_flops`` dense peak per device (0: the MXU has no
  such path); ``hbm_bandwidth`` bytes/s and ``hbm_bytes`` per device; ``devices_per_chip``
  the jax devices one chip shows.
  """

  name: str
  vmem_bytes: int
  mxu: int
  bf16_flops: float
  int8_ops: float
  fp8_flops: float
  hbm_bandwidth: float
  hbm_bytes: int
  devices_per_chip: int = 1

  @property
  def int8_mxu(self) -> bool:
    """Whether int8 x int8 products run on the MXU (into int32)."""
    return self.int8_ops > 0

  @property
  def fp8_mxu(self) -> bool:
    """Whether 8-bit float products (e4m3/e5m2) run on the MXU (into f32)."""
    return self.fp8_flops > 0


_V5E = TpuChip("v5e", 128 * MIB, 128, 197e12, 394e12, 0, 819e9, 16 * GIB)
_V5P = TpuChip("v5p", 64 * MIB, 128, 459e12, 918e12, 0, 2765e9, 95 * GIB)
_V6E = TpuChip("v6e", 128 * MIB, 256, 918e12, 1836e12, 0, 1640e9, 32 * GIB)
# TPU7x (Ironwood): per chip 2.31 PFLOP/s bf16, 4.61 PFLOP/s fp8, no int8 MXU path, 192 GiB
# HBM at 7.37 TB/s; its two TensorCores are two jax devices, so each gets half of those.
_TPU7X = TpuChip("TPU7x", 64 * MIB, 256, 2.31e15 / 2, 0, 4.61e15 / 2, 7.37e12 / 2,
                 96 * GIB, devices_per_chip=2)
# device_kind (as jax reports it) -> chip.
TPU_CHIPS = {
    "TPU v5 lite": _V5E, "TPU v5e": _V5E,
    "TPU v5": _V5P, "TPU v5p": _V5P,
    "TPU v6 lite": _V6E, "TPU v6e": _V6E,
    "TPU7x": _TPU7X,
}


def tpu_kind() -> str | None:
  """The device kind of the TPU a kernel is compiled for (the default device, else the
  abstract mesh's device, else the first local TPU), None when none is in sight."""
  candidates = [jax.config.jax_default_device]
  try:
    candidates.append(jax.sharding.get_abstract_mesh().abstract_device)
  except Exception:  # noqa: BLE001  (older jax: no abstract device)
    pass
  for candidate in candidates:
    if candidate is not None and getattr(candidate, "platform", None) == "tpu":
      return str(candidate.device_kind)
  try:
    return str(jax.devices("tpu")[0].device_kind)
  except RuntimeError:  # no TPU backend in this process
    return None


def tpu_chip(kind: str | None = None) -> TpuChip | None:
  """The `TPU_CHIPS` entry of device kind `kind` (default: the target's, `tpu_kind`)."""
  kind = tpu_kind() if kind is None else kind
  return TPU_CHIPS.get(kind) if kind is not None else None


def int8_mxu(kind: str | None = None) -> bool:
  """Whether the target TPU (or device kind `kind`) multiplies int8 x int8 on its MXU.
  False for TPU7x (fp8 instead); True for kinds gmm_jax does not know (as before)."""
  chip = tpu_chip(kind)
  return True if chip is None else chip.int8_mxu


def target_tpu_info():
  """The target TPU's `TpuInfo` (the default device's), or None when it is not a TPU."""
  try:
    return jax_private.tpu_info()
  except jax_private.MissingJaxInternal:
    jax_private.warn_missing("tpu_info", "the TPU tiles and cost models use gmm_jax's own "
                             "chip table (TPU_CHIPS)")
    return None
  except Exception:  # noqa: BLE001  (CPU: ValueError; no device or not a TPU: others)
    return None


def device_rates() -> tuple[float, float]:
  """(bf16 MXU flop/s, HBM bytes/s) of the target TPU, per jax device: jax's TPU info, else
  `TPU_CHIPS`, else v5e's."""
  info = target_tpu_info()
  flops = float(getattr(info, "bf16_ops_per_second", 0)
                or getattr(tpu_chip(), "bf16_flops", 0) or 197e12)
  bandwidth = float(getattr(info, "mem_bw_bytes_per_second", 0)
                    or getattr(tpu_chip(), "hbm_bandwidth", 0) or 820e9)
  return flops, bandwidth
