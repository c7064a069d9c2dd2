"""The deviceless H200 target of the GPU tests (a test helper, not a test module)."""

from __future__ import annotations

import pathlib

import pytest
import lowering

import gmm_jax

H200 = pathlib.Path(gmm_jax.__file__).parent / "tools" / "targets" / "nvidia_h200.txtpb"


def topology():
  """The 1-chip H200 topology from the package's target description. Skips only where this
  jax has no GPU compiler at all; with the plugin installed, a target that cannot be
  described is a failure, not a skip."""
  if not lowering.has_gpu_compiler():
    pytest.skip(f"{lowering.GPU_COMPILER} is not importable: this jax install has no GPU "
                "compiler")
  assert H200.exists(), f"the package's GPU target description is missing: {H200}"
  from jax.experimental import topologies  # noqa: PLC0415  (needs the plugin checked above)
  return topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                      target_config=H200.read_text())
