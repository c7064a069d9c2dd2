"""Registers the gmm implementations with the dispatcher, and each platform's chain.

Floor 3. The Pallas kernels register where this jax can import their backend; one that
fails to import stays in its chain as unavailable (a call for its platform records why it
was skipped, `explain` shows it, and a warning says so once), each registered one behind a check of the target chip: a GPU kernel only for
the compute capabilities it compiles for (`GPU_ARCHS`: Mosaic GPU is Hopper's), the TPU
kernel's integer products only on chips with an int8 MXU (not TPU7x).
"""

from __future__ import annotations

import importlib

import jax.numpy as jnp

from gmm_jax._src.tiling import chips, cost_models
from gmm_jax._src.backends import registry
from gmm_jax._src.core import jax_private
from gmm_jax._src.backends import lax_ragged_dot as lax_ragged, reference, xla
from gmm_jax._src.core.qarray import QArray

# Preference order per platform; names that did not register are skipped.
CHAINS = {
    "cpu": ("xla", "reference"),
    "gpu": ("pallas_mosaic_gpu", "pallas_triton", "xla"),
    "tpu": ("pallas_tpu", "lax_ragged_dot", "xla"),
}
# For calls that gather, weight or scatter rows (a fused MoE layer) or use a gated
# activation: Triton does them in-kernel, Mosaic GPU does not (it would run on a gathered
# copy), so Triton goes first on GPUs. On TPUs the kernel still goes first: its MXU tiles on
# a gathered copy beat the XLA path's loops.
FUSED_CHAINS = {"gpu": ("pallas_triton", "pallas_mosaic_gpu", "xla")}
# (name, module, function, platform) of each kernel family. They dequantize in-kernel;
# the module's `check_operands` says which quantized layouts they take.
KERNELS = (
    ("pallas_tpu", "gmm_jax.pallas.tpu", "gmm_tpu", "tpu"),
    ("pallas_mosaic_gpu", "gmm_jax.pallas.gpu.mosaic_gpu", "gmm_mosaic_gpu", "gpu"),
    ("pallas_triton", "gmm_jax.pallas.gpu", "gmm_triton", "gpu"),
)

# The compute capability majors each GPU kernel compiles for (absent: any), as its module
# declares them (``ARCHS``; filled when it registers). The Mosaic GPU gmm is built on wgmma,
# which only sm_90a (Hopper) has: on Blackwell (sm_100a, 10.x) and older GPUs it is skipped
# up front and Triton serves.
GPU_ARCHS: dict[str, tuple[int, ...]] = {}


def gpu_chain(chain: tuple[str, ...], capability: tuple[int, int] | None) -> tuple[str, ...]:
  """The names of a GPU `chain` that compile for a GPU of `capability` (None: unknown, all
  of them; the kernels then check the target themselves)."""
  if capability is None:
    return tuple(chain)
  return tuple(name for name in chain
               if capability[0] in GPU_ARCHS.get(name, (capability[0],)))


def _check_arch(name: str, cfg) -> None:
  """NotImplementedError when the target GPU's compute capability is not one `name` compiles
  for (`GPU_ARCHS`); interpret mode runs anywhere."""
  if cfg.interpret or name not in GPU_ARCHS:
    return
  capability = cost_models.gpu_capability()
  if capability is not None and not gpu_chain((name,), capability):
    majors = ", ".join(f"{m}.x" for m in GPU_ARCHS[name])
    raise NotImplementedError(
        f"{name} compiles for compute capability {majors} only; the target GPU is "
        f"{capability[0]}.{capability[1]}")


def _integer_product(lhs, rhs) -> bool:
  values = lambda x: x.qvalue if isinstance(x, QArray) else x  # noqa: E731
  lhs, rhs = values(lhs), values(rhs)
  return jnp.issubdtype(lhs.dtype, jnp.integer) and jnp.issubdtype(rhs.dtype, jnp.integer)


def _check_tpu_chip(lhs, rhs, cfg) -> None:
  """NotImplementedError for integer x integer products (plain int8 operands or the scaled
  int8 x int8 mode) on a TPU without an int8 MXU path (TPU7x: `chips.TPU_CHIPS`): the
  kernel's dot would ask for int8 MXU passes the chip does not have. Plain integer gmms go
  to the next implementation (XLA's, exact int32); `quantized` composes the scaled mode from
  a bf16 gmm of the values (exact in bf16) instead."""
  del cfg  # the chip, not the call's options, decides (interpret mode included)
  if not _integer_product(lhs, rhs):
    return
  kind = chips.tpu_kind()
  if not chips.int8_mxu(kind):
    raise NotImplementedError(
        f"{kind} has no int8 MXU path (integer x integer products are not the TPU "
        "kernel's there)")


# The kernel each of jax's simulators runs (`jax_private.simulator` of `interpret`); the
# others take interpret=True (Pallas's plain interpret mode) or run compiled.
SIMULATED = {"tpu": "pallas_tpu", "gpu": "pallas_mosaic_gpu"}


def _check_interpret(name: str, cfg) -> None:
  """NotImplementedError when `cfg.interpret` asks for a simulator that does not run kernel
  `name` (the TPU simulator runs the Mosaic TPU kernel, the GPU one the Mosaic GPU kernel)."""
  asked = jax_private.simulator(cfg.interpret)
  if asked is not None and SIMULATED[asked] != name:
    runs = "; ".join(f"{params} runs {kernel}" for params, kernel in (
        ("pltpu.InterpretParams", SIMULATED["tpu"]),
        ("plgpu.InterpretGPUParams", SIMULATED["gpu"])))
    raise NotImplementedError(
        f"{name} does not run under jax's {asked.upper()} simulator ({runs}; interpret=True "
        "runs the others in Pallas's plain interpret mode)")


def _guarded(name: str, module, function: str, platform: str):
  """(fn, check) of kernel `name`: the module's, behind the target-chip check of its
  platform (run before the module's own static check and before the kernel)."""
  inner = getattr(module, function)
  if platform == "tpu":
    chip_check = _check_tpu_chip
  else:
    chip_check = lambda lhs, rhs, cfg: _check_arch(name, cfg)  # noqa: E731

  def check(lhs, rhs, cfg):
    _check_interpret(name, cfg)
    chip_check(lhs, rhs, cfg)
    module.check_operands(lhs, rhs, cfg)

  def fn(lhs, rhs, counts, group_offset, bias, cfg, **kw):
    _check_interpret(name, cfg)
    chip_check(lhs, rhs, cfg)
    return inner(lhs, rhs, counts, group_offset, bias, cfg, **kw)

  return fn, check


# Every kernel declares these; its own `check_operands` (pallas/common.check_quant) refuses
# the layouts and dtypes it cannot dequantize in-kernel.
QUANT_MODES = ("none", "weight_only", "scaled", "blocked")


def _register() -> None:
  every_platform = tuple(CHAINS)
  registry.register(registry.Backend("reference", reference.gmm_reference,
                                     platforms=every_platform, features=reference.FEATURES))
  registry.register(registry.Backend("xla", lambda *args, **kw: xla.gmm_xla(*args, **kw),
                                     platforms=every_platform, features=xla.FEATURES))
  registry.register(registry.Backend(
      "lax_ragged_dot", lambda *args, **kw: lax_ragged.gmm_lax_ragged(*args, **kw),
      platforms=every_platform, features=lax_ragged.FEATURES))
  for name, module_name, function, platform in KERNELS:
    try:  # an optional dependency: this jax's Pallas backend for the platform
      module = importlib.import_module(module_name)
    except ImportError as err:  # skipped with its reason (`explain`), warned about once
      registry.mark_unavailable(name, (platform,), f"{type(err).__name__}: {err}")
      continue
    if getattr(module, "ARCHS", None):
      GPU_ARCHS[name] = tuple(module.ARCHS)
    fn, check = _guarded(name, module, function, platform)
    registry.register(registry.Backend(name, fn, platforms=(platform,),
                                       quant_modes=QUANT_MODES,
                                       check=check,
                                       features=getattr(module, "FEATURES", ()),
                                       atomics=getattr(module, "ATOMICS", False)))
  for platform, chain in CHAINS.items():
    registry.set_chain(platform, chain, FUSED_CHAINS.get(platform))


_register()
