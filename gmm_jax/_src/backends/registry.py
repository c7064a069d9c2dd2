"""The one dispatcher: a registry of gmm implementations keyed by what they can serve.

Floor 1. An implementation registers (from `backends.py`) with the grouping types,
quantization modes and platforms it supports, and each platform has a preference chain. A
call with ``implementation=None`` walks its platform's chain; a sequence of names is tried
in that order; an implementation that cannot serve the case raises `NotImplementedError`
and the next one is tried; when all fail, one error lists every reason. This module names
no backend.

The platform of a call is the platform it is lowered for, unless ``GmmConfig.platform``
overrides it: the op's lowering rule reads it from the lowering context, and decisions taken
above the op are made per platform with `on_lowering_platform`.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Callable

import jax
import numpy as np

from gmm_jax._src.core import metadata, recording
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.core.epilogue import (NO_ROWS, Rows, finish, gated_cotangent, gather_rows,
                                        prologue_input, scatter_rows)
from gmm_jax._src.core.qarray import QArray, blockwise, quant_mode as _quant_mode

# What an implementation may do natively beyond the plain gmm (`Backend.features`):
# "gather" of m-grouped lhs rows, "gather_k" of the grouped (contraction) rows of a
# k-grouped lhs (the weight gradient of a gathered gmm), row weights, scattered rows, gated
# activations, a gated prologue on lhs (its value or its tangent, `GmmConfig.lhs_activation`)
# and the gated-cotangent epilogue (`GmmConfig.cotangent_of`).
FEATURES = ("gather", "row_weights", "scatter", "gated", "gather_k", "gated_lhs",
            "gated_cotangent")


@dataclasses.dataclass(frozen=True)
class Backend:
  """A registered gmm implementation.

  ``fn(lhs, rhs, counts, group_offset, bias, cfg, rows=Rows(...))`` computes the forward
  on canonical operands (see `GmmConfig`; lhs/rhs are QArrays in a quantized mode) or
  raises NotImplementedError for a case it cannot serve. ``check(lhs, rhs, cfg)``, if
  given, is the static part of that refusal (shapes and dtypes only, so it also runs on
  abstract values): the layers above the op ask it before they hand over QArrays.
  ``features`` (of `FEATURES`) are the row operations and gated activations it does
  natively; for the others the dispatcher gathers lhs before it and scatters the rows
  after it, and applies the activation and row weights after it (both, in f32) when it
  lacks either (`_around`, `run`).
  """

  name: str
  fn: Callable
  platforms: tuple[str, ...]
  group_types: tuple[str, ...] = ("m", "k")
  quant_modes: tuple[str, ...] = ("none",)
  check: Callable | None = None
  features: tuple[str, ...] = ()
  # Whether it may use atomics (results not bitwise reproducible) for a call with
  # ``cfg.deterministic=False``; with the default ``deterministic=True`` it never does.
  atomics: bool = False


_REGISTRY: dict[str, Backend] = {}
# Implementations that could not be registered (a kernel package that failed to import):
# name -> (platforms, why). They stay in the chains: a call that would try one records why
# it was skipped (`explain`) and warns once, instead of silently running the next one.
_UNAVAILABLE: dict[str, tuple[tuple[str, ...], str]] = {}
_WARNED_UNAVAILABLE: set[str] = set()
# Preference order per platform (set by the backends module); unregistered names are skipped.
_CHAINS: dict[str, tuple[str, ...]] = {}
# The chains for calls that gather, weight or scatter rows or use a gated activation
# (implementations that do them natively first); platforms without one use `_CHAINS`.
_FUSED_CHAINS: dict[str, tuple[str, ...]] = {}
_DEFAULT_CHAIN_PLATFORM = "cpu"


@dataclasses.dataclass(frozen=True)
class Decision:
  """One dispatch: which implementation served a (sub-)gmm and why the earlier ones did not."""

  cfg: GmmConfig
  quant_mode: str
  platform: str
  implementation: str
  refusals: tuple[str, ...]
  materialized: tuple[str, ...] = ()
  atomics: bool = False

  def describe(self) -> str:
    text = (f"{self.cfg.group_type}-grouped gmm, quantization {self.quant_mode!r}, "
            f"{self.cfg.num_local} local groups, out {np.dtype(self.cfg.out_dtype).name} on "
            f"{self.platform}: {self.implementation}")
    if self.materialized:
      text += f" ({', '.join(self.materialized)} around it, not fused)"
    text += ("; deterministic=False: may add partial sums with atomics (not bitwise "
             "reproducible run to run)" if self.atomics else "; bitwise deterministic")
    return text + "".join(f"\n      (skipped {reason})" for reason in self.refusals)


_RECORDERS: list[list[Decision]] = []


def record():
  """Collects the `Decision`s of the gmms lowered inside the block."""
  return recording.collecting(_RECORDERS)


_PLAN_RECORDERS: list[list] = []


def record_plans():
  """Collects the sharding plans of the gmms traced or compiled inside the block (split at
  trace time, or by the partitioner under plain jit; each has a ``describe()``), and the
  fallbacks taken where neither could split one."""
  return recording.collecting(_PLAN_RECORDERS)


def note_plan(plan) -> None:
  """Called with the plan a gmm was split by (at trace time, or by the partitioning rule)."""
  for recorder in _PLAN_RECORDERS:
    recorder.append(plan)


def register(backend: Backend) -> None:
  if backend.name in _REGISTRY:
    raise ValueError(f"a gmm implementation named {backend.name!r} is already registered")
  _REGISTRY[backend.name] = backend


def mark_unavailable(name: str, platforms: tuple[str, ...], why: str) -> None:
  """Records that implementation `name` (for `platforms`) could not be registered, and why."""
  _UNAVAILABLE[name] = (tuple(platforms), why)


def unavailable() -> dict[str, str]:
  """The implementations that could not be registered: name -> why."""
  return {name: why for name, (_, why) in _UNAVAILABLE.items()}


def _skip_unavailable(name: str, platform: str, cfg: GmmConfig) -> str:
  """The refusal of an implementation that could not be registered; warns once per name
  when the call is for its platform (a chain would otherwise fall through unseen)."""
  platforms, why = _UNAVAILABLE[name]
  if (platform in platforms or cfg.implementation) and name not in _WARNED_UNAVAILABLE:
    _WARNED_UNAVAILABLE.add(name)
    warnings.warn(f"gmm_jax: the {name} implementation could not be loaded ({why}); calls "
                  f"on {platform!r} run the next implementation of the chain instead",
                  stacklevel=3)
  return f"{name}: could not be loaded ({why})"


def set_chain(platform: str, names: tuple[str, ...],
              fused: tuple[str, ...] | None = None) -> None:
  """The implementations `implementation=None` tries on `platform`, in order (`fused`: for
  calls with row operands or a gated activation, if different)."""
  _CHAINS[platform] = tuple(names)
  if fused is not None:
    _FUSED_CHAINS[platform] = tuple(fused)


def implementations() -> tuple[str, ...]:
  """Names of the registered implementations."""
  return tuple(_REGISTRY)


# jax's lowering platforms and the gmm_jax platform of each.
JAX_PLATFORMS = (("cpu", "cpu"), ("cuda", "gpu"), ("rocm", "gpu"), ("tpu", "tpu"))


def normalize_platform(platform: str) -> str:
  """jax's platform names ("cuda", "rocm", ...) as gmm_jax's ("cpu", "gpu", "tpu")."""
  platform = str(platform).lower()
  return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def mesh_platform(mesh) -> str | None:
  """The platform of a concrete mesh's devices ("cpu", "gpu", "tpu"), None for an abstract
  mesh (or none): callers that know it trace one platform's branch instead of all."""
  try:
    device = np.asarray(mesh.devices).flat[0]
    return normalize_platform(device.platform)
  except (AttributeError, IndexError, TypeError, ValueError, RuntimeError):
    return None


def trace_platform() -> str:
  """The platform a program traced now is most likely lowered for: ``jax.default_device``'s
  when it is a device (how a deviceless compile names its target), else the default
  backend's. For decisions a layer makes while tracing (e.g. `ExpertFFN.gated_prologue`
  left to the platform); the op's kernels are chosen when lowering."""
  default = jax.config.jax_default_device
  if isinstance(default, jax.Device):
    return normalize_platform(default.platform)
  return normalize_platform(jax.default_backend())


def native_features(cfg: GmmConfig, platform: str) -> tuple[str, ...]:
  """The `FEATURES` the first implementation a call with `cfg` tries on `platform` does
  natively (the others are done around it: `_around`)."""
  names = [name for name in candidates(cfg, platform) if name in _REGISTRY]
  return _REGISTRY[names[0]].features if names else ()


def on_lowering_platform(fn: Callable, platform: str | None, *args):
  """``fn(platform, *args)`` for the platform the program is lowered for.

  With `platform` given (``GmmConfig.platform``, an explicit override) it is called once.
  Otherwise every platform's branch is traced and `jax.lax.platform_dependent` lowers only
  the one of the lowering platform, so a program lowered for a GPU or TPU (a deviceless
  compile on a CPU host included) takes their path. Callers skip this when every platform
  would decide the same way.
  """
  if platform is not None:
    return fn(platform, *args)
  branches = {jax_name: functools.partial(fn, ours) for jax_name, ours in JAX_PLATFORMS}
  return jax.lax.platform_dependent(*args, default=functools.partial(fn, "cpu"), **branches)


def check_implementation(implementation) -> tuple[str, ...] | None:
  """The names a user's ``implementation=`` stands for (None: the platform's chain).

  Raises:
    ValueError: an unknown name, an empty sequence or something that is not a name.
  """
  if implementation is None or implementation == "auto":
    return None
  names = (implementation,) if isinstance(implementation, str) else implementation
  try:
    names = tuple(names)
  except TypeError:
    names = None
  if not names or not all(isinstance(name, str) for name in names):
    raise ValueError(
        f"implementation must be None, 'auto', a name or a sequence of names of "
        f"{implementations()}, got {implementation!r}")
  for name in names:
    if name not in _REGISTRY and name not in _UNAVAILABLE:
      raise ValueError(
          f"unknown implementation {name!r}; registered: {implementations()} (or "
          "None/'auto', or a sequence of names tried in order)")
  return names


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


def candidates(cfg: GmmConfig, platform: str) -> tuple[str, ...]:
  """The implementations a call would try, in order: registered ones, and those that could
  not be registered (`unavailable`), which `run` skips with their reason."""
  if cfg.implementation is not None:
    chain = cfg.implementation
  else:
    chain = _CHAINS.get(platform, _CHAINS.get(_DEFAULT_CHAIN_PLATFORM, ()))
    if needed_features(cfg) and platform in _FUSED_CHAINS:
      chain = _FUSED_CHAINS[platform]
  return tuple(name for name in chain if name in _REGISTRY or name in _UNAVAILABLE)


def serves(lhs, rhs, cfg: GmmConfig, platform: str) -> bool:
  """Whether some implementation the call would try serves these operands' quantization
  mode (declared support, and its static `check` of shapes and dtypes)."""
  mode = _quant_mode(lhs, rhs, cfg)
  for name in candidates(cfg, platform):
    if name not in _REGISTRY:
      continue
    backend = _REGISTRY[name]
    try:
      _check_support(backend, cfg, mode, platform)
      if backend.check is not None:
        backend.check(lhs, rhs, cfg)
      return True
    except NotImplementedError:
      pass
  return False


def needed_features(cfg: GmmConfig) -> tuple[str, ...]:
  """The `FEATURES` a call uses."""
  gathered = cfg.gather_rows is not None
  used = (gathered and cfg.group_type == "m", cfg.row_weights, cfg.out_rows is not None,
          cfg.gated, gathered and cfg.group_type == "k", cfg.lhs_activation is not None,
          cfg.cotangent_of is not None)
  return tuple(name for name, use in zip(FEATURES, used) if use)


def quantized_prologue_input(cfg: GmmConfig, lhs) -> QArray:
  """`prologue_input` of a call with ``cfg.quantize_prologue``, quantized in its 1 x block
  blocks along K (`qarray.blockwise`): the QArray a "blocked" gmm multiplies where no
  kernel quantizes act(z) in its prologue."""
  return blockwise(prologue_input(cfg.lhs_activation, lhs), 1, cfg.quantize_prologue)


def _around(backend: Backend, lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
            rows: Rows, missing: tuple[str, ...]):
  """`backend` on a call whose `missing` features it lacks (or refused), those done around
  it and the others in it.

  A missing gather (data movement, exact) gathers lhs before it; a missing scatter scatters
  its result after it. A missing gated activation or row weights moves both, with the
  scatter, to the finishing step after it (`epilogue.finish`, on its f32 result), so that
  every path rounds once, after the activation and the weights, as the fused kernels do.
  A missing gated prologue reads `epilogue.prologue_input` of lhs (formed before it;
  quantized in its blocks with ``cfg.quantize_prologue``, `quantized_prologue_input`); a
  missing gated-cotangent epilogue applies `epilogue.gated_cotangent` to its result
  (rounded to out_dtype first, as the kernel rounds its product).
  """
  if cfg.cotangent_of is not None:  # anything else done around it comes before it
    inner = cfg.replace(cotangent_of=None)
    inner_rows = rows._replace(source=None)
    inner_missing = tuple(f for f in missing if f != "gated_cotangent")
    if inner_missing:
      y = _around(backend, lhs, rhs, counts, group_offset, bias, inner, inner_rows,
                  inner_missing)
    elif needed_features(inner):
      y = backend.fn(lhs, rhs, counts, group_offset, bias, inner, rows=inner_rows)
    else:
      y = backend.fn(lhs, rhs, counts, group_offset, bias, inner)
    return gated_cotangent(cfg.cotangent_of, rows.source, y, cfg.out_dtype)
  if cfg.lhs_activation is not None and "gated_lhs" in missing:
    if cfg.quantize_prologue is not None:  # act(z) in the blocks the kernel would form
      lhs = quantized_prologue_input(cfg, lhs)
    else:
      lhs = prologue_input(cfg.lhs_activation, lhs, rows.source if cfg.lhs_tangent else None)
    cfg = cfg.replace(lhs_activation=None, lhs_tangent=False, quantize_prologue=None)
    rows = rows._replace(source=None) if cfg.cotangent_of is None else rows
    missing = tuple(f for f in missing if f != "gated_lhs")
    if not missing:
      if needed_features(cfg):
        return backend.fn(lhs, rhs, counts, group_offset, bias, cfg, rows=rows)
      return backend.fn(lhs, rhs, counts, group_offset, bias, cfg)
  if cfg.gather_rows is not None and any(f in missing for f in ("gather", "gather_k")):
    lhs = gather_rows(lhs, rows.lhs_indices)
    cfg, rows = cfg.replace(gather_rows=None), rows._replace(lhs_indices=None)
  after = (cfg.gated or cfg.row_weights) and any(f in missing for f in ("gated", "row_weights"))
  scatter = cfg.out_rows is not None and (after or "scatter" in missing)
  inner, inner_rows = cfg, rows
  if after:
    inner = inner.replace(activation=None, row_weights=False,
                          out_dtype=np.dtype(np.float32))
    inner_rows = inner_rows._replace(row_weights=None)
  if scatter:
    inner, inner_rows = inner.replace(out_rows=None), inner_rows._replace(out_indices=None)
  if needed_features(inner):
    y = backend.fn(lhs, rhs, counts, group_offset, bias, inner, rows=inner_rows)
  else:
    y = backend.fn(lhs, rhs, counts, group_offset, bias, inner)
  if not after and not scatter:
    return y
  row_ids = None
  if cfg.group_type == "m":
    row_ids = metadata.row_group_ids(counts, y.shape[0], group_offset, cfg.num_local)
  if not after:  # the kernel's rows as they are, each written to its target row
    return scatter_rows(y, rows.out_indices, cfg.out_rows, row_ids >= 0)
  return finish(y, cfg.activation, cfg.out_dtype, row_ids=row_ids,
                row_weights=rows.row_weights if cfg.row_weights else None,
                out_indices=rows.out_indices if scatter else None,
                out_rows=cfg.out_rows if scatter else None)


def run(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, platform: str,
        rows: Rows = NO_ROWS):
  """Runs the first implementation that serves this call on `platform` (lhs/rhs may be
  QArrays; the quantization mode then follows from them). The row operands (`rows`, see
  `GmmConfig`) and a gated activation go to an implementation that does them natively
  (its ``features``), and around one that does not.

  Raises:
    NotImplementedError: no implementation serves it; the message lists each reason.
  """
  mode = _quant_mode(lhs, rhs, cfg)
  needed = needed_features(cfg)
  reasons = []
  for name in candidates(cfg, platform):
    if name not in _REGISTRY:
      reasons.append(_skip_unavailable(name, platform, cfg))
      continue
    backend = _REGISTRY[name]
    missing = tuple(f for f in needed if f not in backend.features)
    try:
      _check_support(backend, cfg, mode, platform)
      if not needed:
        out = backend.fn(lhs, rhs, counts, group_offset, bias, cfg)
      else:
        try:
          if missing:
            out = _around(backend, lhs, rhs, counts, group_offset, bias, cfg, rows, missing)
          else:
            out = backend.fn(lhs, rhs, counts, group_offset, bias, cfg, rows=rows)
        except NotImplementedError as err:
          if set(missing) == set(needed):
            raise
          # A kernel may refuse a fused form for some operands (tiles, quantization): it
          # then serves the plain gmm, with everything done around it.
          reasons.append(f"{name} (fused {', '.join(f for f in needed if f not in missing)})"
                         f": {err}")
          missing = needed
          out = _around(backend, lhs, rhs, counts, group_offset, bias, cfg, rows, missing)
    except NotImplementedError as err:
      reasons.append(f"{name}: {err}")
    else:
      for recorder in _RECORDERS:
        recorder.append(Decision(cfg, mode, platform, name, tuple(reasons), missing,
                                 backend.atomics and not cfg.deterministic))
      return out
  raise NotImplementedError(
      f"no gmm implementation serves group_type={cfg.group_type!r}, quantization "
      f"{mode!r} on {platform!r}: " + "; ".join(reasons or ["none registered"])
  )

