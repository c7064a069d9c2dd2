"""Whole training steps (small shapes) compiled deviceless by `gmm_jax.tools.aot_pod` for TPU v5e
2x2 and 8 x H200, as users write them: `nn.MoE` under plain jit, under `jax.set_mesh` (built
by `nnx.eval_shape` inside it), on Explicit axes, unfused, with expert parallelism, and the
gradients of `nn.GroupedLinear`. Each compiles with Pallas kernels and no expert-weight
all-gather, and no TPU program holds a `custom_partitioning` call (libtpu has no partitioner
for it: jax-ml/jax#38196): where the trace sees the mesh, every gmm splits itself with
`shard_map`. The step whose trace sees no mesh (``default+blind``) compiles too: on TPU as
the dense reference that XLA partitions, with no weight all-gather either.

Needs jax >= 0.12 with libtpu and the CUDA plugin (the deviceless-compile environment,
``bash .ci/aot_env.sh``); skipped where they are not importable. Slow (16 compiles, 2-3
minutes on 2 cores): excluded from the default run; CI runs it in that environment.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import lowering

pytest.importorskip("flax")
from gmm_jax.tools import aot_pod  # noqa: E402

pytestmark = pytest.mark.slow

# The steps compiled: (topology, strategies); the blind step's gmms are no kernels on TPU.
SPLIT = ("default", "default+set_mesh", "explicit", "unfused", "grouped_linear", "ep")
# v5e 4x8: libtpu refuses the ragged all-to-all there (limited ICI routing); the default
# transport is then the fixed-buffer all-to-all, with no option set.
STEPS = (("v5e:2x2", SPLIT + ("default+blind",)), ("h200:1x1x8", SPLIT + ("default+blind",)),
         ("v5e:4x8", ("ep",)))
ROUTED = ("default", "default+set_mesh", "explicit", "unfused", "ep")


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package (jax_plugins) is missing
    return False


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  if not (_importable("libtpu") and lowering.has_gpu_compiler()):
    pytest.skip(f"libtpu and {lowering.GPU_COMPILER} are not both importable: no deviceless "
                "compiler for the small pod")
  by_key, statuses = {}, []
  for topology, strategies in STEPS:
    out = tmp_path_factory.mktemp("pod") / "rows.json"
    statuses.append(aot_pod.main(["--small", "--topologies", topology, "--strategies",
                                  *strategies, "--require", *strategies, "--json", str(out),
                                  "--timeout", "600", "--jobs", "2"]))
    by_key.update({(r["topology"], r["strategy"]): r for r in json.loads(out.read_text())})
  return statuses, by_key


def test_every_step_has_a_row(rows):
  _, by_key = rows
  assert set(by_key) == {(t, s) for t, strategies in STEPS for s in strategies}


@pytest.mark.parametrize("topology, strategy", [(t, s) for t, ss in STEPS for s in ss])
def test_step_compiles_with_kernels_and_no_weight_gather(rows, topology, strategy):
  statuses, by_key = rows
  row = by_key[(topology, strategy)]
  assert row["status"] == "ok", row["error"] + "\n" + row["detail"]
  assert statuses == [0] * len(STEPS)  # --require: compiled, no expert-weight all-gather
  assert row["weight_gather_bytes"] == 0
  if topology.startswith("v5e"):
    assert row["custom_partitionings"] == 0
  if strategy in ROUTED:  # tokens travel to their experts
    kind = "all-to-all" if topology == "v5e:4x8" else "ragged-all-to-all"
    assert row["collective_bytes"][kind] > 0
  if strategy == "default+blind" and topology.startswith("v5e"):
    assert set(row["implementations"]) == {"reference"}, row  # XLA partitions it
    return
  assert row["implementations"] and all(name.startswith("pallas_")
                                        for name in row["implementations"]), row
  kernels = row["kernels"]
  if topology.startswith("v5e"):
    assert kernels.get("tpu_custom_call", 0) > 0, kernels
  else:  # H200: Mosaic GPU and/or Triton
    assert kernels.get("mosaic_gpu", 0) + kernels.get("triton", 0) > 0, kernels
  assert 0 < row["peak_bytes"] < row["hbm_bytes"]
