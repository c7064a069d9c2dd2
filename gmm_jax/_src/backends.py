"""Registers the gmm implementations with the dispatcher, and each platform's chain.

Floor 3. The Pallas kernels register where this jax can import their backend (else the
chains fall through to "xla").
"""

from __future__ import annotations

import importlib

from gmm_jax._src import dispatch
from gmm_jax._src import lax_ragged, reference, xla

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
    ("pallas_mosaic_gpu", "gmm_jax.pallas.gpu.mosaic", "gmm_mosaic_gpu", "gpu"),
    ("pallas_triton", "gmm_jax.pallas.gpu", "gmm_triton", "gpu"),
)


def _register() -> None:
  every_platform = tuple(CHAINS)
  dispatch.register(dispatch.Backend("reference", reference.gmm_reference,
                                     platforms=every_platform, features=reference.FEATURES))
  dispatch.register(dispatch.Backend("xla", lambda *args, **kw: xla.gmm_xla(*args, **kw),
                                     platforms=every_platform, features=xla.FEATURES))
  dispatch.register(dispatch.Backend(
      "lax_ragged_dot", lambda *args, **kw: lax_ragged.gmm_lax_ragged(*args, **kw),
      platforms=every_platform, features=lax_ragged.FEATURES))
  for name, module_name, function, platform in KERNELS:
    try:  # an optional dependency: this jax's Pallas backend for the platform
      module = importlib.import_module(module_name)
    except ImportError:
      continue
    fn = getattr(module, function)
    dispatch.register(dispatch.Backend(name, lambda *args, fn=fn, **kw: fn(*args, **kw),
                                       platforms=(platform,),
                                       quant_modes=("none", "weight_only", "scaled"),
                                       check=module.check_operands,
                                       features=getattr(module, "FEATURES", ()),
                                       atomics=getattr(module, "ATOMICS", False)))
  for platform, chain in CHAINS.items():
    dispatch.set_chain(platform, chain, FUSED_CHAINS.get(platform))


_register()
