"""jax's simulators for the tests: the parameters the suite runs the kernels under, and a
check that a run found no race.

* TPU (`pltpu.InterpretParams`): HBM, VMEM, the DMAs and semaphores simulated, with the race
  detector on, uninitialized memory filled with NaN (a read of an unwritten buffer
  poisons the result) and out-of-bounds reads raising. `tpu(cores=2)` simulates two
  TensorCores, for grids with a parallel dimension.
* GPU (`plgpu.InterpretGPUParams`, jax >= 0.11): shared memory, TMA, barriers and wgmma
  simulated, with the race detector on.

A found race is a bug in a kernel (a test fails on it), never a skip. jax >= 0.12.1 raises
at the race (``on_race="raise"``, its default); on older jax `no_race` reads the detector
after the run (the state of the last simulated kernel).
"""

from __future__ import annotations

import contextlib

import jax
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.experimental.pallas import tpu as pltpu

from gmm_jax._src.core import jax_private

HAS_GPU_SIMULATOR = hasattr(plgpu, "InterpretGPUParams")
NO_GPU_SIMULATOR = (f"jax {jax.__version__} has no Mosaic GPU simulator that runs the kernel "
                    "(jax.experimental.pallas.mosaic_gpu.InterpretGPUParams)")
needs_gpu_simulator = pytest.mark.skipif(not HAS_GPU_SIMULATOR, reason=NO_GPU_SIMULATOR)


def tpu(cores: int = 1) -> pltpu.InterpretParams:
  """The TPU simulator, as strict as it goes (`cores` TensorCores)."""
  return pltpu.InterpretParams(detect_races=True, uninitialized_memory="nan",
                               out_of_bounds_reads="raise", num_cores_or_threads=cores)


def gpu():
  """The Mosaic GPU simulator with its race detector."""
  return plgpu.InterpretGPUParams(detect_races=True)


def _reset(simulator: str) -> None:
  reset = {"tpu": getattr(pltpu, "reset_tpu_interpret_mode_state", None),
           "gpu": getattr(plgpu, "reset_gpu_interpret_mode_state", None)}[simulator]
  if reset is not None:
    reset()


@contextlib.contextmanager
def no_race(simulator: str):
  """Runs its body with the `simulator`'s state reset, then fails if its race detector
  found a race in the kernels the body ran."""
  _reset(simulator)
  yield
  assert not jax_private.races_found(simulator), (
      f"jax's {simulator.upper()} simulator found a race in a gmm_jax kernel")
