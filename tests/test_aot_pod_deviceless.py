"""`python -m gmm_jax.aot_pod --small` (whole nn.MoE training steps, small shapes, compiled
deviceless for TPU v5e 2x2 and 8 x H200): the expert-parallel step compiles on both, with
Pallas kernels and no expert-weight all-gather; every strategy gets a row.

Needs jax >= 0.12 with libtpu and the CUDA plugin (the deviceless-compile environment,
``bash .ci/aot_env.sh``); skipped where they are not importable. Slow (2-3 minutes on 2
cores): excluded from the default run; CI runs it in that environment.
"""

from __future__ import annotations

import importlib.util
import json

import pytest

pytest.importorskip("flax")
from gmm_jax import aot_pod  # noqa: E402

pytestmark = pytest.mark.slow


def _importable(module: str) -> bool:
  try:
    return importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:  # its parent package (jax_plugins) is missing
    return False


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
  for module in ("libtpu", "jax_plugins.xla_cuda12"):
    if not _importable(module):
      pytest.skip(f"{module} is not importable: no deviceless compiler for the small pod")
  out = tmp_path_factory.mktemp("pod") / "rows.json"
  status = aot_pod.main(["--small", "--require", "ep", "--json", str(out), "--timeout",
                         "600"])
  rows = json.loads(out.read_text())
  return status, {(r["topology"], r["strategy"]): r for r in rows}


def test_every_step_has_a_row(rows):
  _, by_key = rows
  assert set(by_key) == {(t, s) for t in aot_pod.SMALL_TOPOLOGIES for s in aot_pod.STRATEGIES}
  for row in by_key.values():
    assert row["status"] in ("ok", "FAIL", "timeout"), row
    assert (row["status"] == "ok") == (not row["error"]), row


@pytest.mark.parametrize("topology, kernel", [("v5e:2x2", "tpu_custom_call"),
                                              ("h200:1x1x8", None)])
def test_expert_parallel_step_compiles_with_kernels_and_no_weight_gather(rows, topology,
                                                                          kernel):
  status, by_key = rows
  row = by_key[(topology, "ep")]
  assert row["status"] == "ok", row["error"] + "\n" + row["detail"]
  assert status == 0  # --require ep
  assert row["weight_gather_bytes"] == 0
  assert row["collective_bytes"]["ragged-all-to-all"] > 0  # tokens travel to their experts
  assert row["implementations"] and all(name.startswith("pallas_")
                                        for name in row["implementations"]), row
  kernels = row["kernels"]
  if kernel:
    assert kernels.get(kernel, 0) > 0, kernels
  else:  # H200: Mosaic GPU and/or Triton
    assert kernels.get("mosaic_gpu", 0) + kernels.get("triton", 0) > 0, kernels
  assert 0 < row["peak_bytes"] < row["hbm_bytes"]


@pytest.mark.parametrize("topology", aot_pod.SMALL_TOPOLOGIES)
def test_ragged_dot_baseline_compiles(rows, topology):
  row = rows[1][(topology, "ragged_dot")]
  assert row["status"] == "ok", row["error"] + "\n" + row["detail"]
  assert not row["implementations"]  # no gmm_jax in it
