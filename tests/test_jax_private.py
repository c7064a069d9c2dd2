"""Every private jax API gmm_jax uses (`gmm_jax._src.core.jax_private`), on the installed jax.

The suite runs on each supported jax release (0.10.2, 0.11.2, 0.12.0.1, 0.12.1): each entry
resolves there and does what gmm_jax takes it for, and a missing one fails loudly (a
warning naming it, or a NotImplementedError the dispatcher falls through), never by
quietly changing what gmm computes.
"""

from __future__ import annotations

import importlib.util
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.experimental.pallas import tpu as pltpu

import gmm_jax
import lowering
from gmm_jax._src.backends import registry
from gmm_jax._src.core import jax_private
from gmm_jax._src.core.jax_private import ENTRIES, MissingJaxInternal

def _version(text: str) -> tuple[int, ...]:
  return tuple(int(part) for part in text.split(".")[:3])


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_every_entry_resolves(name):
  since = ENTRIES[name].since
  if since is not None and _version(jax.__version__) < _version(since):
    with pytest.raises(MissingJaxInternal):
      jax_private.resolve(name)
    return
  value = jax_private.resolve(name)  # MissingJaxInternal where this jax lacks it
  if name not in ("tpu_races", "gpu_races"):  # module state, None until a simulator runs
    assert value is not None, ENTRIES[name].name


def test_a_missing_entry_names_itself(monkeypatch):
  monkeypatch.setitem(ENTRIES, "concrete_mesh", jax_private.Entry(
      "jax._src.no_such_module", "get_concrete_mesh", "a purpose"))
  with pytest.raises(MissingJaxInternal, match=r"jax\._src\.no_such_module.*a purpose"):
    jax_private.resolve("concrete_mesh")
  monkeypatch.setitem(ENTRIES, "concrete_mesh", jax_private.Entry(
      "jax._src.mesh", "no_such_getter", "a purpose"))
  with pytest.raises(MissingJaxInternal, match="no_such_getter"):
    jax_private.resolve("concrete_mesh")


def _missing(monkeypatch, name):
  entry = ENTRIES[name]
  monkeypatch.setitem(ENTRIES, name, jax_private.Entry(entry.module, "gone_" + name,
                                                       entry.purpose))
  monkeypatch.setattr(jax_private, "_WARNED", set())


def test_concrete_mesh_is_empty_under_plain_jit_and_warns_when_missing(monkeypatch):
  getter = jax_private.concrete_mesh()
  seen = []
  jax.jit(lambda x: seen.append(getter().empty) or x)(1.0)
  assert seen == [True]
  _missing(monkeypatch, "concrete_mesh")
  with pytest.warns(RuntimeWarning, match="gone_concrete_mesh"):
    assert jax_private.concrete_mesh() is None


def test_devices_during_lowering_takes_the_primitive_and_warns_when_missing(monkeypatch):
  primitive = jax.extend.core.Primitive("gmm_jax_probe")
  assert jax_private.require_devices_during_lowering(primitive)
  assert primitive in jax_private.resolve("devices_during_lowering")
  _missing(monkeypatch, "devices_during_lowering")
  with pytest.warns(RuntimeWarning, match="not partitioned"):
    assert not jax_private.require_devices_during_lowering(primitive)


def test_vma_check_off_lets_a_kernel_trace_in_shard_map_and_warns_when_missing(monkeypatch):
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:2]), ("x",))
  lhs = jnp.ones((16, 8))
  rhs = jnp.ones((2, 8, 8))

  def body(lhs, rhs):
    return gmm_jax.gmm(lhs, rhs, jnp.array([4, 4]), implementation="pallas_triton",
                       interpret=True)

  out = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(jax.P("x"), jax.P()),
                              out_specs=jax.P("x")))(lhs, rhs)
  np.testing.assert_allclose(out, np.concatenate([np.full((8, 8), 8.0)] * 2), rtol=1e-6)
  with jax_private.vma_check_off():
    pass
  _missing(monkeypatch, "check_vma")
  with pytest.warns(RuntimeWarning, match="check_vma"):
    with jax_private.vma_check_off():
      pass


def test_forced_interpret_params_are_the_enclosing_simulators():
  assert jax_private.forced_interpret_params() is None
  params = pltpu.InterpretParams(detect_races=True)
  with pltpu.force_tpu_interpret_mode(params):
    assert jax_private.forced_interpret_params() == params
  assert jax_private.forced_interpret_params() is None


def test_interpret_effects_and_simulators():
  assert jax_private.interpret_effects(True) == frozenset()
  assert jax_private.interpret_effects(False) == frozenset()
  tpu = pltpu.InterpretParams()
  assert jax_private.simulator(tpu) == "tpu"
  assert jax_private.interpret_effects(tpu)  # ordered IO callbacks
  assert jax_private.simulator(True) is None and jax_private.simulator("tpu") is None
  plgpu = pytest.importorskip("jax.experimental.pallas.mosaic_gpu")
  if hasattr(plgpu, "InterpretGPUParams"):
    gpu = plgpu.InterpretGPUParams()
    assert jax_private.simulator(gpu) == "gpu"
    assert jax_private.interpret_effects(gpu)


def test_races_found_sees_a_race():
  """Two simulated TensorCores write one output block of a parallel grid: the TPU race
  detector reports it (with jax >= 0.12.1's on_race="ignore", instead of raising)."""
  from jax.experimental import pallas as pl

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + pl.program_id(0).astype(jnp.float32)

  on_race = ({"on_race": "ignore"} if "on_race" in pltpu.InterpretParams.__dataclass_fields__
             else {})
  racy = pl.pallas_call(
      kernel, out_shape=jax.ShapeDtypeStruct((8, 128), jnp.float32), grid=(2,),
      in_specs=[pl.BlockSpec((8, 128), lambda i: (0, 0))],
      out_specs=pl.BlockSpec((8, 128), lambda i: (0, 0)),
      compiler_params=pltpu.CompilerParams(dimension_semantics=("parallel",)),
      interpret=pltpu.InterpretParams(detect_races=True, num_cores_or_threads=2, **on_race))
  pltpu.reset_tpu_interpret_mode_state()
  jax.block_until_ready(racy(jnp.zeros((8, 128))))
  assert jax_private.races_found("tpu")
  pltpu.reset_tpu_interpret_mode_state()


def test_races_found_reads_the_detectors():
  for simulator in ("tpu", "gpu"):
    assert jax_private.races_found(simulator) in (True, False)
  with pytest.raises(ValueError, match="'tpu' or 'gpu'"):
    jax_private.races_found("cpu")


@pytest.mark.parametrize("backend", ["mosaic_tpu", "triton", "mosaic_gpu"])
def test_lowering_tables_hold_the_rules_of_common_primitives(backend):
  semantics = None
  if backend == "mosaic_gpu":
    from gmm_jax.pallas.gpu import mosaic_gpu
    semantics = mosaic_gpu.LOWERING_SEMANTICS
  rules = jax_private.lowering_rules(backend, semantics)
  assert lax.exp_p in rules and lax.max_p in rules


def test_a_missing_lowering_table_refuses_the_kernel_not_the_check(monkeypatch):
  """Without the table a kernel cannot check an activation: it refuses (a
  NotImplementedError naming the table), and the dispatcher runs the next implementation
  with the same values, instead of letting the activation reach the compiler."""
  from gmm_jax.pallas.gpu import triton
  assert not triton.unsupported_primitives("silu")
  _missing(monkeypatch, "triton_rules")
  assert triton.unsupported_primitives(None) == set()  # nothing to check
  with pytest.raises(MissingJaxInternal, match="gone_triton_rules"):
    triton.unsupported_primitives("silu")
  assert issubclass(MissingJaxInternal, NotImplementedError)


def test_the_triton_lowering_module_holds_what_the_fp8_rule_uses():
  module = jax_private.triton_lowering_module()
  for name in ("triton_lowering_rules", "tt_dialect", "ir", "_zeros"):
    assert hasattr(module, name)
  from gmm_jax.pallas.gpu import triton_fp8
  assert triton_fp8.FP8_MMA
  assert triton_fp8.fp8_dot_p in module.triton_lowering_rules


def test_tpu_info_reader_is_there_and_refuses_a_cpu():
  reader = jax_private.resolve("tpu_info")
  assert callable(reader)
  with pytest.raises(Exception) as info:  # jax raises its own error off a TPU
    jax_private.tpu_info()
  assert not isinstance(info.value, MissingJaxInternal)
  from gmm_jax._src.tiling import chips
  assert chips.target_tpu_info() is None


def test_the_dispatcher_records_a_missing_table_as_a_refusal(monkeypatch):
  """Cross-lowered for a GPU (the table is checked for compiled kernels): Triton refuses,
  naming the table, and XLA's implementation serves the call."""
  _missing(monkeypatch, "triton_rules")
  lhs, rhs = jnp.ones((8, 16)), jnp.ones((2, 16, 16))

  def fn(lhs, rhs):
    return gmm_jax.gmm(lhs, rhs, jnp.array([3, 5]), activation="silu",
                       implementation=("pallas_triton", "xla"))

  with registry.record() as decisions:
    text = lowering.lower_for("cuda", fn, lhs, rhs)
  assert [d.implementation for d in decisions] == ["xla"]
  assert "gone_triton_rules" in " ".join(decisions[0].refusals)
  assert lowering.triton_calls(text) == 0


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (the deviceless TPU compiles need it)")
def test_the_tpu_partitioner_registers_once_or_says_it_cannot():
  """Registered once (a second call does nothing); where libtpu was loaded before without
  it (an earlier test described a TPU topology), strict raises and lenient says so."""
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    loaded_before = jax_private.resolve("xla_client").pjrt_plugin_loaded("tpu")
    if loaded_before and not jax_private._TPU_PARTITIONER:
      assert not jax_private.register_tpu_partitioner(strict=False)
      with pytest.raises(RuntimeError, match="loaded already"):
        jax_private.register_tpu_partitioner()
    else:
      assert jax_private.register_tpu_partitioner()
      assert jax_private.register_tpu_partitioner()  # a second call does nothing
  assert jax_private.resolve("xla_client").pjrt_plugin_loaded("tpu")
