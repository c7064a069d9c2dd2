"""Deviceless compile for an H200 (sm_90a) of the Mosaic GPU kernel's blocked fp8 mode: fp8
training's forward (e4m3 x e4m3) and dlhs (e5m2 or e4m3 gradient x e4m3 weights) gmms are
served by the kernel, and ptxas gets fp8 wgmma instructions (``wgmma.mma_async ...
.f32.e4m3.e4m3`` / ``.f32.e5m2.e4m3``), with no spills. The k-grouped drhs is not the
kernel's (it refuses k-grouping; the next implementation serves it).

Needs the CUDA plugin (the deviceless-compile environment, `.ci/aot_env.sh`); skipped, with
the reason, where it is not importable. Numerics: tests/test_pallas_mosaic_gpu_fp8.py.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import h200

import gmm_jax
from gmm_jax._src.backends import registry

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
M, K, N, G = 512, 256, 256, 4


def _h200():
  from jax.experimental import topologies
  topology = h200.topology()
  placed = jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("x",)),
                                      jax.sharding.PartitionSpec())
  return topology, placed


def _mosaic():
  return pytest.importorskip("gmm_jax.pallas.gpu.mosaic_gpu",
                             reason="this jax's Pallas Mosaic GPU lacks the kernel's API")


def _abstract(placed, shape, dtype, **axes):
  """A QArray of ShapeDtypeStructs on the target, quantized like fp8 training's operands."""
  q = gmm_jax.quantize(np.ones(shape, np.float32), dtype, **axes)
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), q)


ROWS = {"channelwise_axes": (0,), "tiled_axes": {1: 128}}  # 1 x 128 activation blocks
WEIGHTS = {"channelwise_axes": (0,), "tiled_axes": {1: 128, 2: 128}}  # 128 x 128, per expert


@pytest.mark.parametrize("role, lhs_type, out_dtype, types", [
    ("forward", E4M3, jnp.bfloat16, "e4m3.e4m3"),
    ("dlhs", E5M2, jnp.float32, "e5m2.e4m3"),
    ("dlhs", E4M3, jnp.float32, "e4m3.e4m3"),
])
def test_blocked_fp8_gmms_compile_to_fp8_wgmma(role, lhs_type, out_dtype, types, tmp_path,
                                                monkeypatch):
  topology, placed = _h200()
  if np.dtype(lhs_type) != np.dtype(E4M3) and not _mosaic().MIXED_FP8:
    pytest.skip(f"jax {jax.__version__}'s Mosaic GPU wgmma takes one fp8 type (the kernel "
                "refuses e5m2 x e4m3)")
  transpose_rhs = role == "dlhs"  # dy [M, N] @ w[g].T with w [G, K, N]
  lhs = _abstract(placed, (M, N if transpose_rhs else K), lhs_type, **ROWS)
  rhs = _abstract(placed, (G, K, N), E4M3, **WEIGHTS)
  sizes = jax.ShapeDtypeStruct((G,), jnp.int32, sharding=placed)

  def gmm(lhs, rhs, sizes):
    return gmm_jax.gmm(lhs, rhs, sizes, transpose_rhs=transpose_rhs,
                       preferred_element_type=out_dtype)

  # Mosaic GPU writes the PTX and ptxas's report of each kernel it compiles here.
  for name, value in (("MOSAIC_GPU_DUMP_TO", str(tmp_path)), ("MOSAIC_GPU_DUMP_PTX", "1"),
                      ("MOSAIC_GPU_DUMP_PTXAS", "1")):
    monkeypatch.setenv(name, value)
  with jax.default_device(topology.devices[0]), registry.record() as decisions:
    lowered = jax.jit(gmm).lower(lhs, rhs, sizes)
  assert [d.implementation for d in decisions] == ["pallas_mosaic_gpu"], decisions
  lowered.compile()
  ptx = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.ptx"))
  instructions = set(re.findall(r"wgmma\.mma_async\.sync\.aligned\.m64n\d+k\d+\.\S+?\.\w+\.\w+",
                                ptx))
  assert instructions, f"no wgmma in the PTX dumped to {tmp_path}"
  assert all(i.endswith(f"k32.f32.{types}") for i in instructions), instructions
  report = "".join(p.read_text(errors="replace") for p in tmp_path.glob("*.ptxas"))
  spills = [int(s) for s in re.findall(r"(\d+) bytes spill stores", report)]
  registers = re.findall(r"Used (\d+) registers", report)
  print(f"{role} {types}: {sorted(instructions)}, registers {registers}, spill stores {spills}")
  assert spills and not any(spills), report


def test_the_k_grouped_drhs_is_not_the_kernels():
  topology, placed = _h200()
  columns = {"channelwise_axes": (1,), "tiled_axes": {0: 128}}  # 128 x 1 along the rows
  x = _abstract(placed, (M, K), E4M3, **columns)
  dy = _abstract(placed, (M, N), E5M2, **columns)
  sizes = jax.ShapeDtypeStruct((G,), jnp.int32, sharding=placed)

  def drhs(x, dy, sizes):
    return gmm_jax.gmm(x, dy, sizes, group_type="k", transpose_lhs=True,
                       preferred_element_type=jnp.float32)

  with jax.default_device(topology.devices[0]), registry.record() as decisions:
    jax.jit(drhs).lower(x, dy, sizes)
  (decision,) = decisions
  assert decision.implementation != "pallas_mosaic_gpu"
  assert any("pallas_mosaic_gpu" in r and "group_type='k'" in r for r in decision.refusals)
