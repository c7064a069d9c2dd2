"""A warning before XLA:CPU's compiles run into Linux's memory-map limit.

XLA:CPU loads every kernel of a compiled program as an object file of its own, about three
memory mappings each, for as long as the program lives (jax's caches keep it). Linux
refuses new mappings past ``vm.max_map_count`` (65,530 by default), and the next compile
then dies inside LLVM: an abort ("LLVM ERROR: Unable to allocate section memory!") or a
segmentation fault, with no Python error to catch. A program with gmm's XLA path holds
~190 maps (its loops are ~64 kernels), so a process that compiles a few hundred distinct
gmm programs (a shape sweep, autotuning, a long notebook) reaches it (docs/testing.md,
"Long processes").

`note_cpu_lowering` counts the gmm programs lowered for the CPU; every `CHECK_EVERY` it
reads the process's map count, and once it passes `WARN_SHARE` of the limit it warns, once
per process, with the remedies: ``jax.clear_caches()`` (which gives the maps back) or a
higher ``vm.max_map_count``. Where /proc cannot be read (not Linux) it does nothing.

Floor 0: imports nothing from gmm_jax.
"""

from __future__ import annotations

import warnings

MAPS = "/proc/self/maps"
LIMIT = "/proc/sys/vm/max_map_count"
CHECK_EVERY = 16  # CPU lowerings of a gmm between two readings of the map count
WARN_SHARE = 0.75  # of vm.max_map_count

_state = {"lowerings": 0, "warned": False}


def map_count() -> int | None:
  """The memory mappings this process holds (None where /proc cannot be read)."""
  try:
    with open(MAPS, "rb") as maps:
      return sum(1 for _ in maps)
  except OSError:
    return None


def map_limit() -> int | None:
  """Linux's ``vm.max_map_count`` (None where it cannot be read)."""
  try:
    with open(LIMIT) as limit:
      return int(limit.read().split()[0])
  except (OSError, ValueError, IndexError):
    return None


def check() -> bool:
  """Warns (once per process) when the maps held pass `WARN_SHARE` of the limit; whether it
  warned now."""
  if _state["warned"]:
    return False
  count, limit = map_count(), map_limit()
  if count is None or not limit or count < WARN_SHARE * limit:
    return False
  _state["warned"] = True
  warnings.warn(
      f"gmm_jax: this process holds {count} memory maps of Linux's limit of {limit} "
      "(vm.max_map_count). XLA:CPU keeps about 3 per kernel of every compiled program "
      "that jax caches (a gmm program: ~190), and a compile past the limit aborts the "
      "process. Call jax.clear_caches() to give them back, or raise the limit "
      "(sysctl -w vm.max_map_count=262144).", ResourceWarning, stacklevel=2)
  return True


def note_cpu_lowering() -> None:
  """Counts one gmm program lowered for the CPU; checks the maps every `CHECK_EVERY`."""
  _state["lowerings"] += 1
  if _state["lowerings"] % CHECK_EVERY == 0:
    check()
