"""Every private jax API gmm_jax uses, in one place.

jax's private modules (``jax._src.*``) change without notice between releases. Each one
gmm_jax relies on is reached through an accessor here, and nowhere else (a test checks
that no other module imports ``jax._src``), so that a jax release that moves or drops one
breaks one module, loudly:

* an accessor that the op needs to work at all (`concrete_mesh`,
  `require_devices_during_lowering`, `vma_check_off`) warns once, naming the API and what
  gmm_jax cannot do without it;
* an accessor that a kernel's pre-check needs (`lowering_rules`) raises
  `MissingJaxInternal` (a NotImplementedError naming the API), so that the dispatcher tries
  the next implementation instead of letting an unchecked activation reach the compiler;
* the simulators' and the tools' accessors raise `MissingJaxInternal`.

`ENTRIES` lists every API with what it is for; tests/test_jax_private.py resolves each on
the installed jax, and the suite runs on every supported release (0.10.2 to 0.12.1).

Floor 0: imports nothing from gmm_jax.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib
import warnings
from typing import Any, Callable

import jax


class MissingJaxInternal(NotImplementedError):
  """A private jax API that gmm_jax needs is not in the installed jax (the message names
  it). A NotImplementedError, so that a kernel refusing for this reason falls through the
  dispatcher's chain like any other refusal."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """One private API: ``module.attribute`` (an attribute path, dots allowed), what gmm_jax
  uses it for, and the first jax release that has it (None: every supported one)."""

  module: str
  attribute: str
  purpose: str
  since: str | None = None

  @property
  def name(self) -> str:
    return f"{self.module}.{self.attribute}" if self.attribute else self.module


ENTRIES: dict[str, Entry] = {entry_name: Entry(*fields) for entry_name, fields in {
    "concrete_mesh": (
        "jax._src.mesh", "get_concrete_mesh",
        "whether a trace has concrete devices (jax.sharding.get_mesh refuses to run in jit)"),
    "devices_during_lowering": (
        "jax._src.dispatch", "prim_requires_devices_during_lowering",
        "a primitive whose lowering calls custom_partitioning gets the devices"),
    "check_vma": (
        "jax._src.config", "_check_vma",
        "the kernels are traced on plain types inside shard_map(check_vma=True)"),
    "interpret_mode": (
        "jax._src.config", "pallas_tpu_interpret_mode_context_manager",
        "the simulator parameters of pltpu.force_tpu_interpret_mode / "
        "plgpu.force_gpu_interpret_mode in effect"),
    "interpret_effects": (
        "jax._src.pallas.core", "get_interpret_effects",
        "the effects a simulated pallas_call has, which the gmm primitive declares"),
    "tpu_races": (
        "jax._src.pallas.mosaic.interpret.interpret_pallas_call", "races",
        "whether the TPU simulator's race detector found a race"),
    "gpu_races": (
        "jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks", "_races",
        "whether the Mosaic GPU simulator's race detector found a race"),
    "mosaic_tpu_rules": (
        "jax._src.pallas.mosaic.lowering", "lowering_rules",
        "which primitives of an activation the Mosaic TPU kernel can lower"),
    "triton_rules": (
        "jax._src.pallas.triton.lowering", "triton_lowering_rules",
        "which primitives of an activation the Triton kernel can lower, and the fp8 MMA "
        "rule gmm_jax adds to it"),
    "triton_lowering": (
        "jax._src.pallas.triton.lowering", "",
        "the Triton dialect, MLIR module and zero constant of gmm_jax's fp8 MMA rule"),
    "mosaic_gpu_rules": (
        "jax._src.pallas.mosaic_gpu.lowering", "mosaic_lowering_rules",
        "which primitives of an activation the Mosaic GPU kernel can lower"),
    "mosaic_gpu_warpgroup": (
        "jax._src.pallas.mosaic_gpu.core", "PrimitiveSemantics.Warpgroup",
        "the key of the warpgroup lowering rules in the Mosaic GPU table"),
    "tpu_info": (
        "jax._src.pallas.mosaic.tpu_info", "get_tpu_info",
        "the target TPU's MXU and VMEM sizes and peak rates"),
    "tpu_library_path": (
        "jax._src.xla_bridge", "get_tpu_library_path",
        "the tools' deviceless TPU compiles load libtpu as a PJRT plugin"),
    "plugin_callbacks": (
        "jax._src.xla_bridge", "_plugin_callbacks",
        "the tools register custom_partitioning's partitioner with the TPU plugin"),
    "xla_client": (
        "jax._src.lib", "xla_client",
        "the tools load and initialize the TPU PJRT plugin"),
    "custom_partitioning_module": (
        "jax._src.custom_partitioning", "",
        "imported for its plugin callback (the partitioner registration)"),
    "reduction_order": (
        "jax._src.reduction_order", "",
        "jax.lax.ragged_dot's reduction_order values (not exported by jax)", "0.12.1"),
}.items()}


def resolve(entry_name: str) -> Any:
  """The object `ENTRIES[entry_name]` names; MissingJaxInternal naming it when this jax has
  no such module or attribute."""
  entry = ENTRIES[entry_name]
  try:
    value = importlib.import_module(entry.module)
    for part in filter(None, entry.attribute.split(".")):
      value = getattr(value, part)
  except (ImportError, AttributeError) as err:
    raise MissingJaxInternal(
        f"gmm_jax needs jax's private {entry.name} ({entry.purpose}), which jax "
        f"{jax.__version__} does not have ({type(err).__name__}: {err}); gmm_jax supports "
        "jax 0.10.2 to 0.12.1") from None
  return value


_WARNED: set[str] = set()


def warn_missing(entry_name: str, consequence: str) -> None:
  """Warns once per process that `entry_name` is missing and what follows from it."""
  if entry_name not in _WARNED:
    _WARNED.add(entry_name)
    warnings.warn(f"gmm_jax: jax {jax.__version__} has no {ENTRIES[entry_name].name}: "
                  f"{consequence}", RuntimeWarning, stacklevel=3)


# ----------------------------------------------------------------------- the op's own needs


def concrete_mesh() -> Callable[[], Any] | None:
  """jax's getter of the trace's concrete mesh (None, with a warning, where jax has none:
  then every gmm binds the primitive that needs devices, and a deviceless cross-lowering
  under an abstract mesh alone fails in jax instead of lowering)."""
  try:
    return resolve("concrete_mesh")
  except MissingJaxInternal:
    warn_missing("concrete_mesh", "gmm under an abstract mesh alone cannot be lowered, and "
                  "gmm under plain jit with sharded operands is not split by gmm_jax")
    return None


def require_devices_during_lowering(primitive) -> bool:
  """Asks jax to hand `primitive`'s lowering the devices (a custom_partitioning call made
  inside it needs them). False, with a warning, where jax has no such set: gmm under plain
  jit with sharded operands is then not partitioned by gmm_jax (XLA's partitioner sees an
  opaque loop and gathers the operands; on TPU and GPU the kernels cannot be split)."""
  try:
    resolve("devices_during_lowering").add(primitive)
  except MissingJaxInternal:
    warn_missing("devices_during_lowering",
                  "gmm under plain jit with sharded operands is not partitioned by gmm_jax "
                  "(use jax.set_mesh with Explicit axes, or jax.shard_map)")
    return False
  return True


def vma_check_off():
  """A context in which jax's vma check (shard_map's varying manual axes) is off. Without
  jax's switch, a null context with a warning: inside ``shard_map(check_vma=True)`` the
  kernels then need their own vma types (pass check_vma=False)."""
  try:
    switch = resolve("check_vma")
  except MissingJaxInternal:
    warn_missing("check_vma", "inside jax.shard_map(check_vma=True) the Pallas kernels "
                  "fail to type their outputs; pass check_vma=False")
    return contextlib.nullcontext()
  return switch(False)


# ----------------------------------------------------------------------------- simulators


def forced_interpret_params():
  """The simulator parameters of an enclosing ``pltpu.force_tpu_interpret_mode(params)`` or
  ``plgpu.force_gpu_interpret_mode(params)`` (both set one jax config), else None."""
  return resolve("interpret_mode").value


# The simulators' parameter classes, by their public paths (the GPU one is public from
# jax 0.11; jax 0.10's Mosaic GPU interpreter cannot run gmm_jax's kernel anyway).
_SIMULATOR_PARAMS = {"tpu": ("jax.experimental.pallas.tpu", "InterpretParams"),
                     "gpu": ("jax.experimental.pallas.mosaic_gpu", "InterpretGPUParams")}


def simulator(interpret) -> str | None:
  """Which of jax's simulators the `interpret` value of a gmm or pallas_call asks for:
  "tpu" (a `pltpu.InterpretParams`), "gpu" (a `plgpu.InterpretGPUParams`), or None (a
  bool: compiled, or plain interpret mode)."""
  if isinstance(interpret, bool) or interpret is None:
    return None
  for name, (module, attribute) in _SIMULATOR_PARAMS.items():
    try:
      cls = getattr(importlib.import_module(module), attribute)
    except (ImportError, AttributeError):
      continue
    if isinstance(interpret, cls):
      return name
  return None


def is_simulator_params(value) -> bool:
  """Whether `value` is the parameters of one of jax's simulators."""
  return simulator(value) is not None


def interpret_effects(interpret) -> frozenset:
  """The effects of a pallas_call run with ``interpret=interpret`` (jax's simulators run
  the kernel body through ordered IO callbacks; plain interpret mode has none)."""
  if isinstance(interpret, bool) or interpret is None:
    return frozenset()
  return frozenset(resolve("interpret_effects")(interpret))


def races_found(simulator: str) -> bool:
  """Whether the "tpu" or "gpu" simulator's race detector found a race in the kernels run
  since its state was last reset (False when detection was off)."""
  if simulator in ("tpu", "gpu"):
    state = resolve(f"{simulator}_races")  # None until the simulator first runs
  else:
    raise ValueError(f"simulator must be 'tpu' or 'gpu', got {simulator!r}")
  return bool(getattr(state, "races_found", False))


# -------------------------------------------------------------------- the kernels' checks


def lowering_rules(backend: str, lowering_semantics=None) -> dict:
  """A Pallas backend's lowering table (primitive -> rule): "mosaic_tpu" (the TensorCore
  rules), "triton", or "mosaic_gpu" (the rules of `lowering_semantics` for warpgroup
  threads). MissingJaxInternal where this jax has none of that shape: a kernel cannot check
  an activation's primitives without it."""
  if backend == "mosaic_tpu":
    rules = resolve("mosaic_tpu_rules")
    if rules and not isinstance(next(iter(rules)), jax.extend.core.Primitive):
      # Keyed by core type first (jax 0.10 to 0.12): the TensorCore's table.
      tables = [table for core, table in rules.items() if str(core).lower() == "tc"]
      if not tables:
        raise MissingJaxInternal(f"jax {jax.__version__}'s Mosaic TPU lowering table has no "
                                 f"TensorCore entry (keys: {list(rules)})")
      rules = tables[0]
    return rules
  if backend == "triton":
    return resolve("triton_rules")
  if backend == "mosaic_gpu":
    rules = resolve("mosaic_gpu_rules")
    key = (lowering_semantics, resolve("mosaic_gpu_warpgroup"))
    if key not in rules:  # keyed by (lowering semantics, thread semantics)
      raise MissingJaxInternal(f"jax {jax.__version__}'s Mosaic GPU lowering table has no "
                               f"entry {key} (keys: {list(rules)})")
    return rules[key]
  raise ValueError(f"backend must be 'mosaic_tpu', 'triton' or 'mosaic_gpu', got {backend!r}")


@functools.cache
def triton_lowering_module():
  """jax's Pallas Triton lowering module, with the names gmm_jax's fp8 MMA rule uses
  (`triton_lowering_rules`, `tt_dialect`, `ir`, `_zeros`); MissingJaxInternal otherwise."""
  module = resolve("triton_lowering")
  missing = [name for name in ("triton_lowering_rules", "tt_dialect", "ir", "_zeros")
             if not hasattr(module, name)]
  if missing:
    raise MissingJaxInternal(f"jax {jax.__version__}'s {module.__name__} lacks {missing}: "
                             "gmm_jax's fp8 MMA rule for Triton cannot be registered")
  return module


def tpu_info():
  """jax's description of the target TPU (`get_tpu_info()`); MissingJaxInternal where jax
  has no such reader. Raises what jax raises when the target is not a TPU."""
  return resolve("tpu_info")()


# ---------------------------------------------------------------------- reduction orders


def reduction_order_is_free(order) -> bool:
  """Whether `order` (a `reduction_order` of jax >= 0.12.1's ragged_dot / dot_general)
  leaves the order of the contraction's sums to the implementation: None, "unordered" or a
  scoped `Unordered`. ValueError for a value jax rejects."""
  if order is None:
    return True
  module = resolve("reduction_order")
  order = module.normalize_order(order)
  return order is module.ReductionOrder.unordered or isinstance(order, module.Unordered)


# ------------------------------------------------------------------------------ the tools


_TPU_PARTITIONER = []  # non-empty once `register_tpu_partitioner` registered it


def register_tpu_partitioner(strict: bool = True) -> bool:
  """Registers `custom_partitioning`'s partitioner with libtpu, as jax does when a TPU
  backend starts: describing a topology loads libtpu without running the plugin callbacks,
  and a deviceless compile of a program with a custom partitioning then fails with "Custom
  emitter for CustomSPMDPartitioning not found". Loads libtpu as jax's "tpu" PJRT plugin
  and runs only that callback on it (the others register CPU and CUDA handlers). Call it
  before the first TPU topology is described (the plugin's C API is only handed out by the
  load); once it has run, a later call does nothing.

  Returns:
    Whether the partitioner is registered: False (with `strict` False) where libtpu was
    loaded already by something else, so that it cannot be any more (a program without
    custom partitioning, any one-chip program, compiles all the same).

  Raises:
    RuntimeError: (`strict`) libtpu was loaded already by something else; or jax
      registered no CustomSPMDPartitioning callback.
  """
  if _TPU_PARTITIONER:
    return True
  resolve("custom_partitioning_module")  # imported for the callback it registers
  xla_client = resolve("xla_client")
  if xla_client.pjrt_plugin_loaded("tpu"):
    if not strict:
      return False
    raise RuntimeError("libtpu is loaded already: register the partitioner before describing "
                       "a TPU topology")
  c_api = xla_client.load_pjrt_plugin_dynamically("tpu", resolve("tpu_library_path")())
  if not xla_client.pjrt_plugin_initialized("tpu"):
    xla_client.initialize_pjrt_plugin("tpu")
  callbacks = [c for c in resolve("plugin_callbacks")
               if getattr(c, "keywords", {}).get("name") == "CustomSPMDPartitioning"]
  if not callbacks:
    raise RuntimeError("jax registered no CustomSPMDPartitioning plugin callback")
  for callback in callbacks:
    callback(c_api=c_api)
  _TPU_PARTITIONER.append(True)
  return True
