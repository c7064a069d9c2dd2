"""The Pallas modules the kernels are written with, from the path the installed jax prefers.

jax 0.12.1 made ``jax.pallas`` (with ``jax.pallas.tpu`` and ``jax.pallas.mosaic_gpu``) the
public home of Pallas; ``jax.experimental.pallas`` re-exports it there, and is the only
path in jax 0.10 to 0.12.0. The Triton backend stays under ``jax.experimental.pallas``
(jax deprecated it in 0.12 and gave it no ``jax.pallas`` module). Each kernel module takes
its Pallas modules from here::

    from gmm_jax.pallas.jax_pallas import pl, tpu as pltpu

The backend modules are imported when first asked for, so a kernel family whose backend
this jax cannot import fails alone (the dispatcher marks it unavailable).
"""

from __future__ import annotations

import importlib
import importlib.util

# jax.pallas where this jax has it (0.12.1 and newer), else jax.experimental.pallas.
PREFIX = ("jax.pallas" if importlib.util.find_spec("jax.pallas") is not None
          else "jax.experimental.pallas")
pl = importlib.import_module(PREFIX)

# Backend -> the module that holds it, by the path this jax prefers.
MODULES = {"tpu": f"{PREFIX}.tpu", "mosaic_gpu": f"{PREFIX}.mosaic_gpu",
           "triton": "jax.experimental.pallas.triton"}

__all__ = ["MODULES", "PREFIX", "pl", *MODULES]


def __getattr__(name: str):
  if name in MODULES:
    return importlib.import_module(MODULES[name])
  raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
