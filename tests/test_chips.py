"""Newer chips in the dispatcher's tables, without the chips: B200 (sm_100a) and TPU7x.

* GPU: the compute capability of the target decides which kernels may serve. The Mosaic
  GPU gmm is Hopper's (wgmma, sm_90a): a Blackwell target (10.0) skips it up front and
  Triton serves; the SM count of the target (148 on a B200) reaches the Triton schedule.
* TPU: `chips.TPU_CHIPS` holds each generation's VMEM, MXU side, peak rates and HBM
  per jax device. TPU7x has no int8 MXU path (fp8 instead) and shows its two TensorCores
  as two devices: int8 x int8 products there are not the TPU kernel's; the scaled int8 mode
  is composed from a bf16 gmm of the values, checked here against a numpy oracle.

The table entries are checked against public figures written out here, and, where this
jax has it, against jax's own TPU description (`jax._src.pallas.mosaic.tpu_info`). The
deviceless compiles (B200, TPU7x) run where the CUDA plugin / libtpu are installed (the
deviceless-compile environment, `.ci/aot_env.sh`), and skip elsewhere.
"""

from __future__ import annotations

import importlib.util
import pathlib
import types

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import lowering
from gmm_jax._src.backends import builtin as backends, registry, quantized
from gmm_jax._src.tiling import chips, cost_models
from gmm_jax._src.core.config import GmmConfig, Tiling

TARGETS = pathlib.Path(gmm_jax.__file__).parent / "tools" / "targets"
GIB = 2**30


# -------------------------------------------------------------------------------- GPU


def test_b200_target_description_states_the_public_figures():
  text = (TARGETS / "nvidia_b200.txtpb").read_text()
  for line in ("core_count: 148", "major: 10", 'device_description_str: "NVIDIA B200"',
               "shared_memory_per_block_optin: 232448", "shared_memory_per_core: 233472",
               "registers_per_core_limit: 65536", "l2_cache_size: 132644864"):
    assert line in text
  assert chips.GPU_KINDS["NVIDIA B200"] == ((10, 0), 148)
  assert chips.GPU_KINDS["NVIDIA H200"] == ((9, 0), 132)


@pytest.mark.parametrize("capability, chain", [
    ((9, 0), ("pallas_mosaic_gpu", "pallas_triton", "xla")),    # H100 / H200
    ((10, 0), ("pallas_triton", "xla")),                        # B200 / GB200
    ((10, 3), ("pallas_triton", "xla")),                        # B300
    ((12, 0), ("pallas_triton", "xla")),                        # RTX PRO 6000 Blackwell
    ((8, 0), ("pallas_triton", "xla")),                         # A100
    (None, ("pallas_mosaic_gpu", "pallas_triton", "xla")),      # unknown: kernels check
])
def test_gpu_chain_by_compute_capability(capability, chain):
  assert backends.gpu_chain(backends.CHAINS["gpu"], capability) == chain


def _gpu(kind, capability=None, cores=None):
  return types.SimpleNamespace(platform="gpu", device_kind=kind,
                               compute_capability=capability, core_count=cores)


def test_capability_and_sm_count_flow_from_the_target_device():
  b200 = _gpu("NVIDIA B200", "10.0", 148)
  assert cost_models.gpu_capability(b200) == (10, 0)
  assert cost_models.gpu_sm_count(b200) == 148
  # A device that names only its kind (an abstract device): the table says.
  assert cost_models.gpu_capability(_gpu("NVIDIA B200")) == (10, 0)
  assert cost_models.gpu_capability(_gpu("NVIDIA H100 80GB HBM3")) == (9, 0)
  assert cost_models.gpu_capability(_gpu("NVIDIA L4")) is None
  assert cost_models.gpu_capability(types.SimpleNamespace(platform="cpu")) is None
  # The split-K choice of the Triton k-grouped kernel reads the SM count.
  cfg, tiling, dims = GmmConfig(group_type="k", num_local=2), Tiling(128, 64, 128), (
      256, 262144, 256)
  assert (cost_models.default_k_chunk(*dims, cfg, tiling, num_sms=148)
          != cost_models.default_k_chunk(*dims, cfg, tiling, num_sms=132))


@pytest.mark.parametrize("capability, refused", [((10, 0), True), ((9, 0), False)])
def test_mosaic_gpu_is_skipped_up_front_on_blackwell(monkeypatch, capability, refused):
  if "pallas_mosaic_gpu" not in registry.implementations():
    pytest.skip("this jax has no Pallas Mosaic GPU backend")
  monkeypatch.setattr(cost_models, "gpu_capability", lambda device=None: capability)
  backend = registry._REGISTRY["pallas_mosaic_gpu"]
  x = jax.ShapeDtypeStruct((64, 32), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((2, 32, 16), jnp.bfloat16)
  cfg = GmmConfig(group_type="m", num_local=2)
  if refused:
    with pytest.raises(NotImplementedError, match="compute capability 9.x only; the target "
                                                  "GPU is 10.0"):
      backend.check(x, w, cfg)
  else:
    backend.check(x, w, cfg)
  # Interpret mode is not compiled for the target: never refused for it.
  backend.check(x, w, cfg.replace(interpret=True))


# -------------------------------------------------------------------------------- TPU

# Public per-chip figures (dense peak): bf16 FLOP/s, int8 OP/s (0: none), fp8 FLOP/s (0:
# not above the bf16 rate), HBM bytes, HBM bytes/s, VMEM per core, MXU side, jax devices.
PUBLIC = {
    "TPU v5 lite": (197e12, 394e12, 0, 16 * GIB, 819e9, 128 * 2**20, 128, 1),
    "TPU v5p": (459e12, 918e12, 0, 95 * GIB, 2765e9, 64 * 2**20, 128, 1),
    "TPU v6 lite": (918e12, 1836e12, 0, 32 * GIB, 1640e9, 128 * 2**20, 256, 1),
    "TPU7x": (2.31e15, 0, 4.61e15, 192 * GIB, 7.37e12, 64 * 2**20, 256, 2),
}


@pytest.mark.parametrize("kind", sorted(PUBLIC))
def test_tpu_chip_table_per_device(kind):
  bf16, int8, fp8, hbm, bandwidth, vmem, mxu, devices = PUBLIC[kind]
  chip = chips.TPU_CHIPS[kind]
  assert chip.devices_per_chip == devices
  # Per jax device: a chip's figures divided among the devices it shows.
  assert chip.bf16_flops * devices == pytest.approx(bf16)
  assert chip.int8_ops * devices == pytest.approx(int8)
  assert chip.fp8_flops * devices == pytest.approx(fp8)
  assert chip.hbm_bytes * devices == hbm
  assert chip.hbm_bandwidth * devices == pytest.approx(bandwidth)
  assert (chip.vmem_bytes, chip.mxu) == (vmem, mxu)
  assert chip.int8_mxu == (int8 > 0)


def test_tpu7x_agrees_with_jax_where_jax_describes_it():
  try:
    from jax._src.pallas.mosaic import tpu_info
    version = tpu_info.chip_version_from_device_kind("TPU7x")
    info = tpu_info.get_tpu_info_for_chip(version, 1)
  except Exception as err:  # noqa: BLE001  (older jax: no such table)
    pytest.skip(f"this jax does not describe TPU7x: {err}")
  chip = chips.TPU_CHIPS["TPU7x"]
  assert info.vmem_capacity_bytes == chip.vmem_bytes
  assert info.mxu_column_size == chip.mxu
  assert info.int8_ops_per_second == 0 and not chip.int8_mxu
  assert info.bf16_ops_per_second == pytest.approx(chip.bf16_flops, rel=0.01)
  assert info.fp8_ops_per_second == pytest.approx(chip.fp8_flops, rel=0.01)
  assert info.mem_bw_bytes_per_second == pytest.approx(chip.hbm_bandwidth, rel=0.01)
  assert version.num_physical_tensor_cores_per_chip == chip.devices_per_chip


def test_int8_mxu_by_kind():
  assert not chips.int8_mxu("TPU7x")
  assert chips.int8_mxu("TPU v5 lite") and chips.int8_mxu("TPU v6 lite")
  assert chips.int8_mxu("TPU v99")  # unknown kinds keep the int8 path


@pytest.fixture
def target_tpu(monkeypatch):
  """Sets the TPU kind the dispatcher plans for (what a deviceless compile's device says)."""
  def use(kind):
    monkeypatch.setattr(chips, "tpu_kind", lambda: kind)
  return use


def test_cost_models_read_the_table_when_jax_cannot_say(target_tpu, monkeypatch):
  monkeypatch.setattr(chips, "target_tpu_info", lambda: None)
  target_tpu("TPU7x")
  assert cost_models.vmem_capacity() == 64 * 2**20
  assert cost_models.mxu_rows() == 256
  assert chips.device_rates() == (2.31e15 / 2, 7.37e12 / 2)
  target_tpu(None)  # no TPU in sight: v5e's figures, as before
  assert cost_models.vmem_capacity() == 128 * 2**20


M, K, N, G = 32, 128, 16, 3
SIZES = np.array([10, 0, 17], np.int32)  # an empty group and rows past the total


def _int8_operands():
  rng = np.random.default_rng(0)
  x = rng.standard_normal((M, K)).astype(np.float32)
  w = rng.standard_normal((G, K, N)).astype(np.float32)
  xq = gmm_jax.quantize(x, jnp.int8, channelwise_axes=(0,))
  wq = gmm_jax.quantize(w, jnp.int8, channelwise_axes=(0, 2))
  return xq, wq


def _oracle(xq, wq, bias=None):
  """The scaled int8 formula in float64 per group: (x_q @ w_q[g] + bias) * sx * sw[g]."""
  xv, wv = np.asarray(xq.qvalue, np.float64), np.asarray(wq.qvalue, np.float64)
  sx, sw = np.asarray(xq.scale, np.float64), np.asarray(wq.scale, np.float64)
  out, start = np.zeros((M, N)), 0
  for g, size in enumerate(SIZES):
    rows = slice(start, start + size)
    acc = xv[rows] @ wv[g] + (0 if bias is None else np.asarray(bias[g], np.float64))
    out[rows] = acc * sx[rows] * sw[g]
    start += size
  return out


def _explain(xq, wq):
  return gmm_jax.explain(xq, wq, SIZES, platform="tpu",
                         preferred_element_type=jnp.float32)


def test_int8_x_int8_on_tpu7x_is_not_the_kernels_int8_mxu_path(target_tpu):
  if "pallas_tpu" not in registry.implementations():
    pytest.skip("this jax has no Pallas TPU backend")
  xq, wq = _int8_operands()
  target_tpu("TPU v5 lite")
  assert "quantization 'scaled', 3 local groups, out float32 on tpu: pallas_tpu" in (
      _explain(xq, wq))
  target_tpu("TPU7x")
  text = _explain(xq, wq)
  # Composed: the TPU kernel multiplies the values as bf16 (f32 out), scales applied after.
  assert "quantization 'none', 3 local groups, out float32 on tpu: pallas_tpu" in text
  assert "'scaled'" not in text.split("implementations")[1]
  # Plain int8 operands: not the kernel's there (the XLA path's, exact int32).
  plain = gmm_jax.explain(xq.qvalue, wq.qvalue, SIZES, platform="tpu",
                          preferred_element_type=jnp.int32)
  assert "int32 on tpu: xla" in plain and "TPU7x has no int8 MXU path" in plain


def test_scaled_int8_in_bf16_values_matches_the_oracle():
  # The composition used on TPU7x, run on this host: bf16 values, f32 sums (exact here:
  # K * 127 * 127 < 2**24), then both scales; an int32 bias is in accumulator units.
  xq, wq = _int8_operands()
  bias = np.arange(G * N, dtype=np.int32).reshape(G, N) - 20
  cfg = GmmConfig(group_type="m", num_local=G, out_dtype=np.dtype(np.float32))
  compose = lambda a, b, s, bb: quantized._composed(  # noqa: E731
      a, b, s, jnp.int32(0), bb, None, None, cfg, bf16_values=True)
  plain, biased = jax.jit(lambda *args: (compose(*args[:3], None), compose(*args)))(
      xq, wq, SIZES, jnp.asarray(bias))
  np.testing.assert_allclose(np.asarray(plain), _oracle(xq, wq), rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(np.asarray(biased), _oracle(xq, wq, bias), rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ deviceless (where installed)


def _require(module: str) -> None:
  try:
    found = importlib.util.find_spec(module) is not None
  except ModuleNotFoundError:
    found = False
  if not found:
    pytest.skip(f"{module} is not importable: no deviceless compiler for this target here")


def _compile_on(topology, fn, *shapes):
  placed = jax.sharding.NamedSharding(jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",)),
                                      jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=placed) for s in shapes]
  with jax.default_device(topology.devices[0]), registry.record() as decisions:
    lowered = jax.jit(fn).lower(*args)
  lowered.compile()
  return decisions


def test_b200_deviceless_compile_serves_triton():
  if not lowering.has_gpu_compiler():
    pytest.skip(f"{lowering.GPU_COMPILER} is not importable: this jax has no GPU compiler")
  from jax.experimental import topologies
  topology = topologies.get_topology_desc(
      platform="cuda", topology="1x1x1",
      target_config=(TARGETS / "nvidia_b200.txtpb").read_text())
  device = topology.devices[0]
  assert (device.device_kind, device.core_count) == ("NVIDIA B200", 148)
  with jax.default_device(device):
    assert cost_models.gpu_capability() == (10, 0) and cost_models.gpu_sm_count() == 148
  x = jax.ShapeDtypeStruct((256, 128), jnp.bfloat16)
  w = jax.ShapeDtypeStruct((4, 128, 128), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((4,), jnp.int32)
  decisions = _compile_on(topology, lambda x, w, s: gmm_jax.gmm(x, w, s), x, w, s)
  (decision,) = decisions
  assert decision.implementation == "pallas_triton"
  assert any("compute capability 9.x only; the target GPU is 10.0" in r
             for r in decision.refusals)


def test_tpu7x_deviceless_compile_two_devices_per_chip():
  _require("libtpu")
  from jax.experimental import topologies
  topology = topologies.get_topology_desc("tpu7x:1x1x1", platform="tpu")
  assert len(topology.devices) == 2  # one chip, two TensorCores, two devices
  assert {d.device_kind for d in topology.devices} == {"TPU7x"}
  xq, wq = _int8_operands()
  shapes = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (xq, wq))
  s = jax.ShapeDtypeStruct((G,), jnp.int32)
  decisions = _compile_on(topology, lambda x, w, s: gmm_jax.gmm(
      x, w, s, preferred_element_type=jnp.float32), *shapes, s)
  assert [(d.quant_mode, d.implementation) for d in decisions] == [("none", "pallas_tpu")]
