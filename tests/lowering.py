"""Cross-lowering helpers of the tests: lower a function for CUDA or TPU on this CPU host
(no accelerator needed) and count the kernels in the lowered module.

The platform of a gmm call is the platform it is lowered for, so nothing else has to be
told that the target is a GPU or a TPU.
"""

from __future__ import annotations

import contextlib
import importlib.util

import jax
from gmm_jax._src.backends import registry
from jax.experimental.pallas import triton as plgpu


def gpu_model():
  """An abstract H100 for jax >= 0.11's Triton lowering, which reads the GPU model
  (compute capability) from the device, or from the abstract mesh's device when there is no
  GPU, and otherwise raises. jax 0.10 falls back to compute capability 9.0 by itself."""
  if not hasattr(plgpu, "get_gpu_info"):
    return contextlib.nullcontext()
  device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None,
                                       platform="gpu")
  mesh = jax.sharding.AbstractMesh((1,), ("x",), (jax.sharding.AxisType.Explicit,),
                                   abstract_device=device)
  return jax.sharding.use_abstract_mesh(mesh)


def lower_for(platform: str, fn, *args) -> str:
  """The StableHLO text of ``jax.jit(fn)(*args)`` lowered for "cuda" or "tpu"."""
  context = gpu_model() if platform == "cuda" else contextlib.nullcontext()
  with context:  # around the trace too: lowering sees the trace-time context
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def triton_calls(text: str) -> int:
  """Triton kernel launches in a lowered module (the custom-call target by jaxlib version)."""
  return text.count("xla.gpu.triton") + text.count("triton_kernel_call_ffi")


def mosaic_calls(text: str) -> int:
  """Mosaic TPU kernels in a lowered module."""
  return text.count("tpu_custom_call")


def implementations_used(fn, *args) -> list[str]:
  """The implementation that serves each gmm of ``jax.jit(fn)(*args)``, as the dispatcher
  chooses them while the program is lowered (for this host's platform)."""
  with registry.record() as decisions:
    jax.jit(fn).lower(*args)
  return [decision.implementation for decision in decisions]


def has_module(module: str) -> bool:
  """Whether `module` can be imported (a missing parent package counts as missing)."""
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    return False


# jax's CUDA plugins, either of which compiles GPU programs deviceless (with nvJitLink).
GPU_COMPILERS = ("jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
GPU_COMPILER = " or ".join(GPU_COMPILERS)


def has_gpu_compiler() -> bool:
  """Whether this jax install has a CUDA plugin (CUDA 12 or 13) that compiles for GPUs."""
  return any(has_module(module) for module in GPU_COMPILERS)
