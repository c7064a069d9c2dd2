"""The one dispatcher: a registry of gmm implementations keyed by what they can serve.

An implementation registers with the grouping types, quantization modes and platforms it
supports. A call with ``implementation=None`` (or "auto") walks the platform's chain; an
implementation that cannot serve the case raises `NotImplementedError` and the next one is
tried; when all fail, one error lists every reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
from typing import Callable

import jax
import numpy as np

from gmm_jax._src.config import GmmConfig


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered gmm implementation.

  ``fn(lhs, rhs, counts, group_offset, bias, cfg)`` computes the forward on canonical
  operands (see `GmmConfig`) or raises NotImplementedError for a case it cannot serve.
  """

  name: str
  fn: Callable
  platforms: tuple[str, ...]
  group_types: tuple[str, ...] = ("m", "k")
  quant_modes: tuple[str, ...] = ("none",)


_REGISTRY: dict[str, Backend] = {}

# Preference order per platform; names that are not registered are skipped.
_CHAINS: dict[str, tuple[str, ...]] = {
    "cpu": ("xla", "reference"),
    "gpu": ("pallas_triton", "xla"),
    "tpu": ("pallas_tpu", "xla"),
}


@dataclasses.dataclass(frozen=True)
class Decision:
  """One dispatch: which implementation served a (sub-)gmm and why the earlier ones did not."""

  cfg: GmmConfig
  quant_mode: str
  platform: str
  implementation: str
  refusals: tuple[str, ...]

  def describe(self) -> str:
    text = (f"{self.cfg.group_type}-grouped gmm, quantization {self.quant_mode!r}, "
            f"{self.cfg.num_local} local groups, out {np.dtype(self.cfg.out_dtype).name} on "
            f"{self.platform}: {self.implementation}")
    return text + "".join(f"\n      (skipped {reason})" for reason in self.refusals)


_RECORDERS: list[list[Decision]] = []


@contextlib.contextmanager
def record():
  """Collects the `Decision`s of the gmms traced inside the block."""
  decisions: list[Decision] = []
  _RECORDERS.append(decisions)
  try:
    yield decisions
  finally:
    _RECORDERS.remove(decisions)


def recording() -> bool:
  return bool(_RECORDERS)


def register(backend: Backend) -> None:
  if backend.name in _REGISTRY:
    raise ValueError(f"a gmm implementation named {backend.name!r} is already registered")
  _REGISTRY[backend.name] = backend


def implementations() -> tuple[str, ...]:
  """Names of the registered implementations."""
  return tuple(_REGISTRY)


def current_platform() -> str:
  platform = jax.default_backend()
  return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def _check_support(backend: Backend, cfg: GmmConfig, quant_mode: str, platform: str) -> None:
  if cfg.group_type not in backend.group_types:
    raise NotImplementedError(
        f"{backend.name} supports group_type in {backend.group_types}, not {cfg.group_type!r}")
  if quant_mode not in backend.quant_modes:
    raise NotImplementedError(
        f"{backend.name} supports quantization modes {backend.quant_modes}, not {quant_mode!r}")
  if platform not in backend.platforms and not cfg.interpret:
    raise NotImplementedError(
        f"{backend.name} runs on {backend.platforms}, not on {platform!r}")


def candidates(cfg: GmmConfig, platform: str | None = None) -> tuple[str, ...]:
  """The implementations a call would try, in order."""
  platform = platform or current_platform()
  if cfg.implementation not in (None, "auto"):
    if cfg.implementation not in _REGISTRY:
      raise ValueError(
          f"unknown implementation {cfg.implementation!r}; registered: {implementations()} "
          "(or None/'auto')"
      )
    return (cfg.implementation,)
  chain = _CHAINS.get(platform, ("xla", "reference"))
  return tuple(name for name in chain if name in _REGISTRY)


def serves(cfg: GmmConfig, quant_mode: str, platform: str | None = None) -> bool:
  """Whether some implementation the call would try declares support for `quant_mode`."""
  platform = platform or current_platform()
  for name in candidates(cfg, platform):
    try:
      _check_support(_REGISTRY[name], cfg, quant_mode, platform)
      return True
    except NotImplementedError:
      pass
  return False


def run(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, quant_mode: str | None = None,
        platform: str | None = None):
  """Runs the first implementation that serves this call (lhs/rhs may be QArrays; the
  quantization mode then follows from them)."""
  if quant_mode is None:
    from gmm_jax._src import quant
    quant_mode = quant.quant_mode(lhs, rhs, cfg)
  platform = platform or current_platform()
  reasons = []
  for name in candidates(cfg, platform):
    backend = _REGISTRY[name]
    try:
      _check_support(backend, cfg, quant_mode, platform)
      out = backend.fn(lhs, rhs, counts, group_offset, bias, cfg)
    except NotImplementedError as err:
      reasons.append(f"{name}: {err}")
    else:
      for recorder in _RECORDERS:
        recorder.append(Decision(cfg, quant_mode, platform, name, tuple(reasons)))
      return out
  raise NotImplementedError(
      f"no gmm implementation serves group_type={cfg.group_type!r}, quantization "
      f"{quant_mode!r} on {platform!r}: " + "; ".join(reasons or ["none registered"])
  )


def _register_builtin() -> None:
  from gmm_jax._src.reference import gmm_reference
  from gmm_jax._src.xla import gmm_xla

  register(Backend("reference", gmm_reference, platforms=("cpu", "gpu", "tpu")))
  register(Backend("xla", lambda *args: gmm_xla(*args), platforms=("cpu", "gpu", "tpu")))
  # The Pallas kernels, where this jax has the backend (else the chains fall through).
  kernels = (("pallas_tpu", "gmm_jax.pallas.tpu", "gmm_tpu", "tpu"),
             ("pallas_triton", "gmm_jax.pallas.gpu", "gmm_triton", "gpu"))
  for name, module_name, function, platform in kernels:
    try:
      fn = getattr(importlib.import_module(module_name), function)
    except ImportError:
      continue
    register(Backend(name, lambda *args, fn=fn: fn(*args), platforms=(platform,),
                     quant_modes=("none", "weight_only", "scaled")))

_register_builtin()
