"""The platform of a call is the platform of the devices it is compiled for: a deviceless
compile for a TPU v5e or an H200 topology, from this CPU host, picks their kernels with no
other hint.

Needs libtpu (TPU) or the CUDA plugin (GPU) in this Python; skipped, with the reason, only
where they are not importable (the default CPU install of jax has neither). Where they are,
a topology that cannot be described fails.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import lowering
from gmm_jax._src.tiling import cost_models, tuning
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig, Tiling
from jax.experimental import topologies

H200 = pathlib.Path(gmm_jax.__file__).parent / "tools" / "targets" / "nvidia_h200.txtpb"


# The module that must be importable for jax to describe each kind of topology.
COMPILER_MODULE = {"tpu": "libtpu", "gpu": lowering.GPU_COMPILER}


def _require_compiler(kind: str) -> None:
  """Skips (with the reason) only where the compiler for `kind` is not installed at all."""
  module = COMPILER_MODULE[kind]
  found = lowering.has_gpu_compiler() if kind == "gpu" else lowering.has_module(module)
  if not found:
    pytest.skip(f"{module} is not importable: this jax install has no {kind} compiler")


def _topology(kind: str):
  # With the compiler installed, a topology that cannot be described is a failure (a wrong
  # target file, a jax/plugin mismatch), not a skip: jax's error propagates.
  _require_compiler(kind)
  if kind == "tpu":
    return topologies.get_topology_desc("v5e:1x1", platform="tpu")
  assert H200.exists(), f"the package's GPU target description is missing: {H200}"
  return topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                      target_config=H200.read_text())


# The implementations serving each gmm of the silu gmm's gradient, by role (forward: m-grouped;
# dlhs: m-grouped with the transposed weights; drhs: k-grouped), and the int8-weight gmm. On
# an H200 the bf16 forward is the Mosaic GPU (Hopper) kernel's, and so is the dlhs (a bf16
# output keeps a bf16 pre-activation, so the silu's cotangent is bf16 too); the k-grouped
# drhs and the int8 weights are Triton's.
TRITON, MOSAIC = "pallas_triton", "pallas_mosaic_gpu"
FORWARD, DLHS, DRHS = ("m", False), ("m", True), ("k", False)
SERVED = {
    "tpu": ({FORWARD: "pallas_tpu", DLHS: "pallas_tpu", DRHS: "pallas_tpu"},
            {FORWARD: "pallas_tpu"}),
    "gpu": ({FORWARD: MOSAIC, DLHS: MOSAIC, DRHS: TRITON}, {FORWARD: TRITON}),
}


@pytest.mark.parametrize("kind", ["tpu", "gpu"])
def test_deviceless_compile_picks_the_targets_kernels(kind):
  topology = _topology(kind)
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  m, k, n, g = 512, 256, 256, 4
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=placed)
  w = jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16, sharding=placed)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32, sharding=placed)
  quantized = gmm_jax.quantize(np.ones((g, k, n), np.float32), jnp.int8,
                               channelwise_axes=(0, 2))
  q = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), quantized)

  def loss(x, w, sizes):
    return jnp.sum(gmm_jax.gmm(x, w, sizes, activation="silu").astype(jnp.float32))

  cases = [(jax.grad(loss, argnums=(0, 1)), (x, w, sizes)),  # forward, dlhs, drhs
           (lambda x, q, sizes: gmm_jax.gmm(x, q, sizes), (x, q, sizes))]  # int8 weights
  for (fn, args), served in zip(cases, SERVED[kind]):
    with jax.default_device(topology.devices[0]), registry.record() as decisions:
      lowered = jax.jit(fn).lower(*args)
    assert len(decisions) == len(served)
    assert {(d.cfg.group_type, d.cfg.transpose_rhs): d.implementation
            for d in decisions} == served
    assert {d.platform for d in decisions} == {kind}
    lowered.compile()  # the target's compiler accepts the kernels


# --------------------------------------------------- Triton: SM count, split-K determinism


def test_triton_reads_the_sm_count_of_the_target():
  # The H200 description with another SM count (a B200 has 148): the split-K choice reads
  # the target's count, not a constant.
  _require_compiler("gpu")
  text = H200.read_text()
  assert "core_count: 132" in text
  topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                          target_config=text.replace("core_count: 132",
                                                                     "core_count: 148"))
  cfg, tiling = GmmConfig(group_type="k", num_local=2), Tiling(128, 64, 128)
  dims = (256, 262144, 256)  # 2 groups x 4 output tiles: split K into 2 * SMs programs
  with jax.default_device(topology.devices[0]):
    assert cost_models.gpu_sm_count() == 148
    chunk = cost_models.default_k_chunk(*dims, cfg, tiling)
  assert chunk == cost_models.default_k_chunk(*dims, cfg, tiling, num_sms=148)
  assert chunk != cost_models.default_k_chunk(*dims, cfg, tiling, num_sms=132)
  with jax.default_device(_topology("gpu").devices[0]):
    assert cost_models.gpu_sm_count() == 132


def test_triton_split_k_memory_deterministic_vs_atomic():
  # A k-grouped gmm whose grid is too small for the GPU (2 groups of 256 x 256 outputs,
  # K = 16384) splits K. Deterministic: each chunk stores its partial sums to its own slot
  # of [chunks, 2, 256, 256] f32, added in order; atomic: one [2, 256, 256] buffer. Same
  # grid; the buffer's bytes show in the compiled program's temporaries.
  topology = _topology("gpu")
  placed = jax.sharding.NamedSharding(topologies.make_mesh(topology, (1,), ("x",)),
                                      jax.sharding.PartitionSpec())
  m, k, n, g = 256, 16384, 256, 2
  x = jax.ShapeDtypeStruct((m, k), jnp.bfloat16, sharding=placed)
  w = jax.ShapeDtypeStruct((k, n), jnp.bfloat16, sharding=placed)
  sizes = jax.ShapeDtypeStruct((g,), jnp.int32, sharding=placed)
  measured = {}
  for deterministic in (True, False):
    fn = lambda x, w, s, d=deterministic: gmm_jax.gmm(  # noqa: E731
        x, w, s, group_type="k", implementation="pallas_triton", deterministic=d)
    with jax.default_device(topology.devices[0]), tuning.record_launches() as launches:
      lowered = jax.jit(fn).lower(x, w, sizes)
    compiled = lowered.compile()
    (launch,) = launches
    measured[deterministic] = (launch, compiled.memory_analysis().temp_size_in_bytes)
  (ordered, ordered_temp), (atomic, atomic_temp) = measured[True], measured[False]
  assert (ordered.name, atomic.name) == ("gmm_k_triton_chunks", "gmm_k_triton_split")
  assert ordered.grid == atomic.grid
  chunk = cost_models.default_k_chunk(m, k, n, GmmConfig(group_type="k", num_local=g),
                                      Tiling(*ordered.tiles), num_sms=132)
  chunks = cost_models.split_chunks(k, chunk)
  partial = g * m * n * 4
  print(f"split-K {chunks} chunks of {chunk}: temporaries ordered {ordered_temp} B, atomic "
        f"{atomic_temp} B; grid {ordered.grid}, tiles {ordered.tiles}")
  assert atomic_temp >= partial
  assert chunks >= 2 and ordered_temp >= chunks * partial > atomic_temp


# ------------------------------------------------------ fp8 training: fp8 MMA on sm_90a


def test_triton_fp8_training_gmms_use_fp8_wgmma(tmp_path):
  # fp8 training's three gmms (blockwise scales, "blocked" mode) on the Triton kernels,
  # compiled for an H200 by `python -m gmm_jax.tools.aot` (a process of its own: it reads the
  # kernels' instructions from XLA's log, which must be switched on before XLA starts): the
  # forward, the dlhs (rhs^T) and the k-grouped drhs (lhs^T) each hold Hopper's fp8 wgmma,
  # e4m3 x e4m3 and, with e5m2 gradients, e5m2 x e4m3 (dlhs) and e4m3 x e5m2 (drhs).
  _require_compiler("gpu")
  out = tmp_path / "rows.json"
  cases = ["fp8-train-triton", "fp8-train-e5m2-triton"]
  run = subprocess.run([sys.executable, "-m", "gmm_jax.tools.aot", "--targets", "h200", "--cases",
                        *cases, "--jobs", "1", "--json", str(out), "--noprogress"],
                       capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  rows = json.loads(out.read_text())
  print("\n".join(f"{r['case']} {r['gmm']}: {r['kernel']} [{r['operands']}] mma=[{r['mma']}] "
                  f"regs={r['registers']} spills={r['spills']} smem={r['smem']}" for r in rows))
  want = {
      ("fp8-train-triton", "fwd"): "wgmma e4m3.e4m3",
      ("fp8-train-triton", "dlhs"): "wgmma e4m3.e4m3",
      ("fp8-train-triton", "drhs"): "wgmma e4m3.e4m3",
      ("fp8-train-e5m2-triton", "fwd"): "wgmma e4m3.e4m3",
      ("fp8-train-e5m2-triton", "dlhs"): "wgmma e5m2.e4m3",
      ("fp8-train-e5m2-triton", "drhs"): "wgmma e4m3.e5m2",
  }
  got = {(r["case"], r["gmm"]): r for r in rows}
  assert set(got) == set(want)
  for key, instruction in want.items():
    row = got[key]
    assert row["implementation"] == "pallas_triton" and row["operands"].endswith("blocked")
    assert instruction in row["mma"].split(", "), (key, row["mma"])
    assert row["status"] == "ok" and row["spills"] == 0, row


# ------------------------------------------- the fused MoE backward and Blackwell's MMA


def test_gated_ends_compile_without_spills_and_b200_uses_tcgen05(tmp_path):
  # The MoE down gmm with the Triton kernel's gated ends (the forward's prologue, the dlhs
  # gmm's cotangent epilogue) and fp8 training's three gmms, compiled for H200 and B200 by
  # `python -m gmm_jax.tools.aot` (which fails a B200 kernel of 64+ rows per tile without
  # tcgen05.mma): 0 spills, Hopper's wgmma and Blackwell's tcgen05.mma (kind::f16 for
  # bf16, kind::f8f6f4 for fp8), whose accumulator lives in tensor memory.
  _require_compiler("gpu")
  out = tmp_path / "rows.json"
  cases = ["mixtral-moe-down-prologue-train", "fp8-train-triton"]
  run = subprocess.run([sys.executable, "-m", "gmm_jax.tools.aot", "--targets", "h200", "b200",
                        "--cases", *cases, "--jobs", "1", "--json", str(out), "--noprogress"],
                       capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
  rows = json.loads(out.read_text())
  got = {(r["target"], r["case"], r["gmm"]): r for r in rows}
  assert len(got) == 12, sorted(got)
  for (target, case, gmm), row in got.items():
    assert row["status"] == "ok" and row["spills"] == 0, row
    assert row["implementation"] == "pallas_triton", row
    fp8 = case.startswith("fp8")
    want = ("tcgen05.mma kind::f8f6f4" if fp8 else "tcgen05.mma kind::f16") if (
        target == "b200") else ("wgmma e4m3.e4m3" if fp8 else "wgmma bf16.bf16")
    assert want in row["mma"].split(", "), (target, case, gmm, row["mma"])


def test_autotune_on_a_deviceless_device_compiles_each_candidate(tmp_path):
  """`device=` a chip described without the hardware: the default and every candidate are
  compiled for it (an H200's Mosaic GPU kernel; a tile it cannot block is refused), their
  times NaN, nothing cached."""
  _require_compiler("gpu")
  from gmm_jax.tools import deviceless
  cache = tmp_path / "tuned.json"
  candidates = [Tiling(tile_m=64, tile_k=64, tile_n=128), Tiling(tile_m=48, tile_k=64,
                                                                 tile_n=128)]
  (fwd,) = gmm_jax.autotune(256, 128, 256, 4, dtype=jnp.bfloat16, repeats=1, cache=cache,
                            candidates=candidates, device=deviceless.chip("h200"))
  assert fwd.problem.implementation == "pallas_mosaic_gpu" and "H200" in fwd.problem.device_kind
  assert np.isnan(fwd.seconds) and fwd.timings[1][1] is None  # 48 rows: refused
  assert not cache.exists()
