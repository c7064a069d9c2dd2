"""What `gmm_jax.tools.aot_pod` reads from a compiled training step (collective bytes per kind,
all-gathers of whole expert weights, kernel calls, errors), its mesh and parameter layouts,
and that its ragged_dot baseline is the same MoE as `nn.MoE`. None of it needs libtpu or
the CUDA plugin: the deviceless compiles are `test_aot_pod_deviceless.py`."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("flax")
from flax import nnx  # noqa: E402
from gmm_jax import nn  # noqa: E402
from gmm_jax.tools import aot_pod, aot_pod_compile, aot_pod_hlo, aot_pod_steps  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

# A compiled step's HLO as XLA prints it after optimization: synchronous and async
# collectives (a -start tuple holds operands and results; its -done has the result), a
# tuple-shaped all-gather, a weight all-gather in the layout of a [E, D, 2F] kernel and one
# transposed, layouts with tiling and memory-space annotations, and kernel custom calls.
HLO = """\
HloModule jit_step, is_scheduled=true, entry_computation_layout={(bf16[2,256,1792]{2,1,0})->f32[]}

%region_0.1 (a: f32[], b: f32[]) -> f32[] {
  ROOT %add.1 = f32[] add(f32[] %a, f32[] %b)
}

ENTRY %main.9 (p0: bf16[2,256,1792], p1: bf16[2,896,256], p2: bf16[1024,256]) -> f32[] {
  %p0 = bf16[2,256,1792]{2,1,0:T(8,128)(2,1)} parameter(0)
  %p1 = bf16[2,896,256]{2,1,0} parameter(1)
  %p2 = bf16[1024,256]{1,0:S(7)} parameter(2)
  %all-gather.1 = bf16[8,256,1792]{2,1,0:T(8,128)(2,1)} all-gather(%p0), channel_id=1, replica_groups={{0,1,2,3}}, dimensions={0}
  %all-gather.2 = (s32[8,8]{1,0}, s32[8,8]{1,0}) all-gather(%x, %y), channel_id=2, dimensions={0}
  %all-gather-start = (bf16[2,896,256]{2,1,0}, bf16[8,256,896]{2,1,0}) all-gather-start(%p1), channel_id=3, dimensions={0}
  %all-gather-done = bf16[8,256,896]{2,1,0} all-gather-done(%all-gather-start)
  %all-reduce-start = ((f32[8]{0}), f32[8]{0}) all-reduce-start(%r), channel_id=4, to_apply=%region_0.1
  %all-reduce-done = f32[8]{0} all-reduce-done(%all-reduce-start)
  %all-reduce.7 = f32[] all-reduce(%s), channel_id=5, to_apply=%region_0.1
  %reduce-scatter.1 = f32[256,1792]{1,0} reduce-scatter(%g), channel_id=6, dimensions={0}, to_apply=%region_0.1
  %all-to-all.3 = s32[4]{0} all-to-all(%c), channel_id=7, dimensions={0}
  %ragged-all-to-all.6 = bf16[4096,256]{1,0:S(7)} ragged-all-to-all(%a0, %a1, %a2, %a3, %a4, /*index=5*/%a5), channel_id=8
  %collective-permute-start = (bf16[16,256]{1,0}, bf16[16,256]{1,0}, u32[], u32[]) collective-permute-start(%q), channel_id=9, source_target_pairs={{0,1}}
  %collective-permute-done = bf16[16,256]{1,0} collective-permute-done(%collective-permute-start)
  %custom-call.1 = bf16[1024,1792]{1,0} custom-call(%p2, %p0), custom_call_target="tpu_custom_call", backend_config={"custom_call_config": {"body": "all-gather(x)"}}
  %custom-call.2 = bf16[1024,256]{1,0} custom-call(%h, %p1), custom_call_target="__gpu$xla.gpu.triton", metadata={op_name="all-reduce"}
  %custom-call.3 = bf16[1024,256]{1,0} custom-call(%h, %p1), custom_call_target="mosaic_gpu_v2"
  %custom-call.4 = bf16[1024,256]{1,0} custom-call(%h, %p1), custom_call_target="mosaic_gpu_v2"
  %fusion.2 = bf16[64,64]{1,0} fusion(%p2), kind=kCustom, calls=%gemm, backend_config={"fusion_backend_config":{"kind":"__triton_gemm"}}
  ROOT %tuple = (f32[]) tuple(%all-reduce.7)
}
"""
# The expert weights of the layer that HLO belongs to: gate_up [8, 256, 1792] (its halves
# [8, 256, 896]) and down [8, 896, 256].
WEIGHTS = [(8, 256, 1792), (8, 256, 896), (8, 896, 256)]


def test_collective_bytes_per_kind():
  totals = aot_pod_hlo.collective_bytes(HLO)
  assert totals == {
      # [8, 256, 1792] bf16 + two [8, 8] s32 + the -done's [8, 256, 896] bf16
      "all-gather": 8 * 256 * 1792 * 2 + 2 * 8 * 8 * 4 + 8 * 256 * 896 * 2,
      "all-reduce": 8 * 4 + 4,  # the -done's f32[8] (not the -start tuple) + f32[]
      "reduce-scatter": 256 * 1792 * 4,
      "all-to-all": 4 * 4,
      "ragged-all-to-all": 4096 * 256 * 2,
      "collective-permute": 16 * 256 * 2,  # the -done's result, not the u32 contexts
  }


def test_collectives_are_found_by_opcode_not_by_name_or_text():
  # An op named like a collective, a custom call whose config mentions one and a fusion
  # are not collectives; the -start instructions are not counted twice.
  kinds = [kind for kind, _ in aot_pod_hlo.collectives(HLO)]
  assert kinds == ["all-gather", "all-gather", "all-gather", "all-reduce", "all-reduce",
                   "reduce-scatter", "all-to-all", "ragged-all-to-all", "collective-permute"]


def test_weight_gather_bytes_counts_whole_expert_weights_in_any_order():
  # all-gather.1 is the whole gate_up kernel; the async one is a gate half transposed
  # ([8, 256, 896] read as [8, 256, 896] -> matches); the s32 ones are routing metadata.
  assert aot_pod_hlo.weight_gather_bytes(HLO, WEIGHTS) == 8 * 256 * 1792 * 2 + 8 * 256 * 896 * 2
  assert aot_pod_hlo.weight_gather_bytes(HLO, [(8, 896, 256)]) == 8 * 256 * 896 * 2
  # A gathered shard of the experts (not the whole weight) is not a weight gather.
  assert aot_pod_hlo.weight_gather_bytes(HLO, [(16, 256, 1792)]) == 0
  no_gather = "\n".join(line for line in HLO.splitlines() if "all-gather" not in line)
  assert aot_pod_hlo.weight_gather_bytes(no_gather, WEIGHTS) == 0


def test_shapes_of_results():
  assert aot_pod_hlo.shapes("(bf16[2,3]{1,0:T(8,128)(2,1)}, f32[]{:S(1)}, s32[<=8]{0})") == [
      ("bf16", (2, 3)), ("f32", ()), ("s32", (8,))]
  assert aot_pod_hlo.shape_bytes("s4", (3,)) == 2
  assert aot_pod_hlo.shapes("f8e4m3fn[4,4]{1,0}") == [("f8e4m3fn", (4, 4))]


def test_kernel_calls():
  assert aot_pod_hlo.kernel_calls(HLO) == {"tpu_custom_call": 1, "triton": 1, "mosaic_gpu": 2}


def test_first_line_skips_blank_lines():
  err = NotImplementedError("\n\nMosaic kernels cannot be automatically partitioned.\nmore")
  assert aot_pod_compile.first_line(err) == (
      "NotImplementedError: Mosaic kernels cannot be automatically partitioned.")


def test_mesh_shape():
  assert aot_pod_steps.mesh_shape(4, 8) == (1, 4)
  assert aot_pod_steps.mesh_shape(16, 8) == (2, 8)
  assert aot_pod_steps.mesh_shape(256, 8) == (32, 8)
  assert aot_pod_steps.mesh_shape(16, 256) == (1, 16)
  assert aot_pod_steps.mesh_shape(16, 8, expert=4) == (4, 4)
  with pytest.raises(ValueError, match="must divide"):
    aot_pod_steps.mesh_shape(16, 8, expert=16)


def test_only_expert_weights_are_sharded():
  layer = aot_pod_steps.abstract_layer(aot_pod_steps.MODELS["deepseek-v3-small"])
  _, params, specs, rest = aot_pod_steps.nnx_loss(layer)
  by_shape = {tuple(p.shape): s for p, s in zip(params, specs)}
  num_experts, embed, mlp = layer.num_experts, layer.embed, layer.mlp
  assert by_shape[(num_experts, embed, 2 * mlp)] == P("expert")  # gate_up
  assert by_shape[(num_experts, mlp, embed)] == P("expert")  # down
  assert by_shape[(embed, num_experts)] == P()  # the router: replicated
  assert sum(s == P("expert") for s in specs) == 2  # the shared expert is replicated
  assert [r.shape for r in rest] == [(num_experts,)]  # the routing bias
  assert all(p.dtype == jnp.bfloat16 for p in params)
  # Each kernel whole, or one expert's (the gate_up kernel's halves too).
  assert aot_pod_steps.expert_weight_shapes(layer) == [
      (num_experts, embed, 2 * mlp), (embed, 2 * mlp), (num_experts, embed, mlp),
      (embed, mlp), (num_experts, mlp, embed), (mlp, embed)]


@pytest.mark.slow  # ~50 s: two whole MoE steps traced and run on the CPU
def test_ragged_dot_baseline_is_the_same_moe():
  """The baseline's loss and gradients equal nn.MoE's (Mixtral routing: softmax top-2,
  renormalized) for the same parameters (f32): it compiles the same math."""
  layer = nn.MoE.from_preset("mixtral-8x7b", rngs=nnx.Rngs(0), scale=1 / 128,
                             dtype=jnp.float32)
  loss, _, _, _ = aot_pod_steps.nnx_loss(layer)
  base_loss, base_params, _, _ = aot_pod_steps.ragged_dot_loss(layer)
  _, state, _ = nnx.split(layer, nnx.Param, ...)
  params = jax.tree.leaves(state)  # down, gate_up, router (nnx_loss's order)
  values = nnx.to_pure_dict(state)
  baseline = [values["router"]["kernel"], values["gate_up"]["kernel"],
              values["down"]["kernel"]]
  assert [(b.shape, b.dtype) for b in baseline] == [(p.shape, p.dtype) for p in base_params]
  x = jax.random.normal(jax.random.key(1), (64, layer.embed), jnp.float32)
  value, grads = jax.value_and_grad(loss)(params, [], x)
  base_value, base_grads = jax.value_and_grad(base_loss)(baseline, [], x)
  for ours, theirs in zip([value, *grads], [base_value, *base_grads[::-1]]):
    ours, theirs = np.asarray(ours), np.asarray(theirs)
    # Both accumulate in f32 (the two differ by at most a few ulps in practice).
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5 * np.max(np.abs(theirs)))


def test_failures_for_require():
  ok = dict(model="m", topology="t", strategy="ep", status="ok", error="",
            weight_gather_bytes=0)
  rows = [ok, dict(ok, strategy="default", status="FAIL", error="E: no"),
          dict(ok, strategy="unfused", weight_gather_bytes=2 ** 30),
          dict(ok, strategy="ragged_dot", weight_gather_bytes=2 ** 30)]
  assert aot_pod_compile.failures(rows, ("ep",)) == []
  assert aot_pod_compile.failures(rows, ("ep", "default")) == ["m t default: FAIL: E: no"]
  assert aot_pod_compile.failures(rows, ("unfused", "ragged_dot")) == [
      "m t unfused: all-gathers 1.00 GiB of expert weights"]


def test_markdown_marks_what_does_not_fit():
  row = dict(model="mixtral", topology="v5e:4x4", mesh="2x8", strategy="ep", status="ok",
             error="", seconds=12.3, argument_bytes=2 ** 30, output_bytes=2 ** 30,
             temp_bytes=20 * 2 ** 30, alias_bytes=2 ** 30, peak_bytes=21 * 2 ** 30,
             hbm_bytes=16 * 2 ** 30, collective_bytes={"ragged-all-to-all": 3 * 2 ** 20},
             weight_gather_bytes=0, implementations={"pallas_tpu": 6},
             kernels={"tpu_custom_call": 6})
  failed = dict(row, strategy="default", status="FAIL", error="NotImplementedError: a | b")
  table = aot_pod_compile.markdown([row, failed]).splitlines()
  assert len(table) == 4
  assert "21.00 GiB / 16.00 GiB (does not fit)" in table[2]
  assert "| 3.0 MiB |" in table[2] and "pallas_tpu x6" in table[2]
  assert "FAIL: NotImplementedError: a / b" in table[3]
  assert all(line.count("|") == table[0].count("|") for line in table)


def test_parse_buffer_factor():
  assert aot_pod_steps.parse_buffer_factor("none") is None
  assert aot_pod_steps.parse_buffer_factor("None") is None
  assert aot_pod_steps.parse_buffer_factor("1") == 1.0
  assert aot_pod_steps.parse_buffer_factor("0.5") == 0.5
  for bad in ("0", "-1", "nan", "inf", "two", ""):
    with pytest.raises(ValueError):
      aot_pod_steps.parse_buffer_factor(bad)


def test_label_names_the_buffer_factor():
  assert aot_pod_steps.label("ep", None) == "ep"
  assert aot_pod_steps.label("ep", 1.0) == "ep@b=1"
  assert aot_pod_steps.label("default", 1.25) == "default@b=1.25"


def test_steps_cross_the_buffer_factors_except_for_the_baseline():
  todo = aot_pod_steps.steps(["m"], ["t1", "t2"], ["ep", "ragged_dot", "default"], [None, 1.0, 2.0])
  assert todo == [
      ("m", "t1", "ep", None), ("m", "t1", "ep", 1.0), ("m", "t1", "ep", 2.0),
      ("m", "t1", "ragged_dot", None),
      ("m", "t1", "default", None), ("m", "t1", "default", 1.0), ("m", "t1", "default", 2.0),
      ("m", "t2", "ep", None), ("m", "t2", "ep", 1.0), ("m", "t2", "ep", 2.0),
      ("m", "t2", "ragged_dot", None),
      ("m", "t2", "default", None), ("m", "t2", "default", 1.0), ("m", "t2", "default", 2.0)]
  # A baseline without nn.MoE gets one row whatever the factors; repeats are dropped.
  assert aot_pod_steps.steps(["m"], ["t"], ["ragged_dot"], [1.0, 2.0]) == [
      ("m", "t", "ragged_dot", None)]
  assert aot_pod_steps.steps(["m"], ["t"], ["ep"], [1.0, 1.0]) == [("m", "t", "ep", 1.0)]


@pytest.mark.parametrize("strategy", ["default", "default+set_mesh", "ep", "unfused"])
def test_the_layer_of_every_gmm_jax_strategy_takes_the_buffer_factor(strategy):
  mesh = jax.make_mesh((1, 1), ("data", "expert"))
  model = aot_pod_steps.MODELS["mixtral-small"]
  layer = aot_pod_steps.abstract_layer(model, strategy, mesh, buffer_factor=1.5)
  assert layer.buffer_factor == 1.5
  assert aot_pod_steps.abstract_layer(model, strategy, mesh).buffer_factor is None
  assert (layer.expert_parallel is not None) == (strategy == "ep")
  assert layer.fused == (strategy != "unfused")


def _row(**changes):
  row = dict(model="mixtral", topology="v5e:4x4", mesh="2x8", strategy="ep",
             buffer_factor=None, status="ok", error="", seconds=12.3, argument_bytes=2 ** 30,
             output_bytes=2 ** 30, temp_bytes=20 * 2 ** 30, alias_bytes=2 ** 30,
             peak_bytes=21 * 2 ** 30, hbm_bytes=16 * 2 ** 30,
             collective_bytes={"ragged-all-to-all": 3 * 2 ** 20}, weight_gather_bytes=0,
             implementations={"pallas_tpu": 6}, kernels={"tpu_custom_call": 6})
  row.update(changes)
  return row


def test_table_and_require_name_the_buffer_factor():
  rows = [_row(), _row(buffer_factor=1.0, temp_bytes=2 ** 30),
          _row(strategy="default", buffer_factor=2.0, status="FAIL", error="E: no")]
  table = aot_pod_compile.markdown(rows).splitlines()
  assert [line.split(" | ")[3] for line in table[2:]] == ["ep", "ep@b=1", "default@b=2"]
  assert "| 1.00 GiB |" in table[3]
  # --require names the strategy; it holds for its rows with any factor.
  assert aot_pod_compile.failures(rows, ("default",)) == [
      "mixtral v5e:4x4 default@b=2: FAIL: E: no"]
  assert aot_pod_compile.failures(rows, ("ep",)) == []
  # Rows of a JSON file written before the buffer factor existed still print.
  old = _row()
  del old["buffer_factor"]
  assert aot_pod_compile.markdown([old]).splitlines()[2].split(" | ")[3] == "ep"


def test_a_compile_process_gets_the_step_and_its_buffer_factor(monkeypatch, tmp_path):
  calls = []

  def compile_step(model, topology, strategy, expert=None, buffer_factor=None):
    calls.append((model, topology, strategy, expert, buffer_factor))
    return aot_pod_compile.Row(model, topology, strategy, buffer_factor)

  monkeypatch.setattr(aot_pod, "compile_step", compile_step)
  out = tmp_path / "row.json"
  for factor, expert in ((0.1, None), (None, 4), (2.0, None)):
    flags = aot_pod.child_flags(out, "mixtral-small", "v5e:2x2", "ep", factor, expert)
    assert aot_pod.main(flags) == 0
    assert calls.pop() == ("mixtral-small", "v5e:2x2", "ep", expert, factor)
    assert json.loads(out.read_text())["buffer_factor"] == factor


def test_main_compiles_a_step_per_strategy_and_factor(monkeypatch, tmp_path, capsys):
  def run_one(model, topology, strategy, buffer_factor, expert, timeout):
    return _row(model=model, topology=topology, strategy=strategy,
                buffer_factor=buffer_factor)

  monkeypatch.setattr(aot_pod, "_run_one", run_one)
  out = tmp_path / "rows.json"
  status = aot_pod.main(["--models", "mixtral", "--topologies", "v5e:4x4", "--strategies", "ep",
                         "ragged_dot", "--buffer-factor", "none", "1", "--require", "ep",
                         "--json", str(out)])
  assert status == 0
  rows = json.loads(out.read_text())
  assert [(r["strategy"], r["buffer_factor"]) for r in rows] == [
      ("ep", None), ("ep", 1.0), ("ragged_dot", None)]
  assert "| ep@b=1 |" in capsys.readouterr().out
  with pytest.raises(SystemExit) as exit_:
    aot_pod.main(["--buffer-factor", "0"])
  assert exit_.value.code == 2
