"""Mesh helpers of the sharding tests: meshes over the 8 host CPU devices that conftest.py
asks for, and the collectives in a compiled program's HLO."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from jax.sharding import Mesh


def mesh(shape, names, kind: str = "mesh"):
  """A mesh of the first prod(shape) host devices: "mesh" (`jax.sharding.Mesh`, Auto axes),
  "auto" or "explicit" (`jax.make_mesh` with those axis types)."""
  count = int(np.prod(shape))
  if len(jax.devices()) < count:
    pytest.skip(f"needs {count} host CPU devices (tests/conftest.py sets jax_num_cpu_devices=8)")
  if kind == "mesh":
    return Mesh(np.array(jax.devices()[:count]).reshape(shape), names)
  axis_type = {"auto": jax.sharding.AxisType.Auto,
               "explicit": jax.sharding.AxisType.Explicit}[kind]
  return jax.make_mesh(tuple(shape), tuple(names), axis_types=(axis_type,) * len(shape),
                       devices=jax.devices()[:count])


def collectives(compiled_text: str) -> dict[str, int]:
  """How many of each collective a compiled HLO module runs."""
  return {name: len(re.findall(rf"\b{name}(-start)?\(", compiled_text))
          for name in ("all-gather", "all-reduce", "all-to-all", "reduce-scatter",
                       "collective-permute")}


def collective_shapes(compiled_text: str, name: str) -> list[str]:
  """The result shapes of one kind of collective, e.g. ``['f32[64,16]']``."""
  return re.findall(rf"= (\S+) {name}(?:-start)?\(", compiled_text)
