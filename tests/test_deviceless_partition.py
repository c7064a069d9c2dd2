"""Partitioned gmms compiled deviceless for a multi-chip GPU topology (8 x H200 on one host):
under plain jit with sharded operands every device runs the target's kernel inside the
partitioning rule, and the compiled program gathers no weights. The same for the Flax
`nn.GroupedLinear` layer's training gradients and for a user's expert FFN inside
`gmm_jax.routed_apply` (per device in its shard_map).

Runs where the CUDA plugin is importable (the aot environment of `.ci/run`); skipped with the
reason elsewhere.
"""

from __future__ import annotations

import importlib.util
import pathlib
import re

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import lowering
from gmm_jax._src.backends import registry
from gmm_jax._src.moe import routing
from jax.experimental import topologies
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

H200 = pathlib.Path(gmm_jax.__file__).parent / "tools" / "targets" / "nvidia_h200.txtpb"


def _gpu_pod(devices: int = 8):
  if not lowering.has_gpu_compiler():
    pytest.skip(f"{lowering.GPU_COMPILER} is not importable: this jax has no GPU compiler")
  return topologies.get_topology_desc(platform="cuda", topology=f"1x1x{devices}",
                                      target_config=H200.read_text())


def _all_gathers(text: str) -> list[str]:
  """The result types of the compiled program's all-gathers."""
  return re.findall(r"= (\S+) all-gather(?:-start)?\(", text)


@pytest.mark.parametrize("activation", [None, "swiglu"])
def test_expert_sharded_gmm_runs_a_kernel_on_every_device(activation):
  # The Mosaic GPU kernel writes its output through a mutable Ref; a partitioning rule's
  # per-device program must not carry that effect (the partitioner refused it: "Cannot lower
  # jaxpr with effects: ... InternalMutableArrayEffect").
  topology = _gpu_pod()
  mesh = Mesh(np.array(topology.devices).reshape(8), ("x",))
  m, k, n, g = 1024, 256, 512, 8

  def arg(shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  x = arg((m, k), jnp.bfloat16, P())
  w = arg((g, k, n), jnp.bfloat16, P("x"))
  sizes = arg((g,), jnp.int32, P())

  def loss(x, w, sizes):
    y = gmm_jax.gmm(x, w, sizes, activation=activation)
    return jnp.sum(y.astype(jnp.float32) ** 2)

  # The weight gradient sharded like the weights (as a training step's update makes it):
  # each device computes only its expert's gradient.
  for fn, out in ((lambda x, w, s: gmm_jax.gmm(x, w, s, activation=activation), None),
                  (jax.grad(loss, argnums=(0, 1)), (x.sharding, w.sharding))):
    with jax.default_device(topology.devices[0]), registry.record() as decisions:
      compiled = jax.jit(fn, out_shardings=out).lower(x, w, sizes).compile()
    # The forward's gated epilogue is Triton's (the Mosaic GPU kernel has none); the
    # gradient's pre-activation gmm and dlhs are Mosaic GPU's, its drhs Triton's.
    expected = ({"pallas_triton" if activation else "pallas_mosaic_gpu"} if out is None
                else {"pallas_mosaic_gpu", "pallas_triton"})
    assert {d.implementation for d in decisions} == expected
    assert all(d.cfg.num_local == 1 for d in decisions)  # each device: its one expert
    text = compiled.as_text()
    assert ("mosaic_gpu" in text) == ("pallas_mosaic_gpu" in expected)
    assert _all_gathers(text) == []  # the weights stay where they are


def _compile_on_pod(fn, *args):
  """Lowers and compiles `fn` for the 8 x H200 pod (the default device is the pod's, as the
  Pallas lowering reads it); returns the program text and the implementations chosen."""
  topology = _gpu_pod()
  with jax.default_device(topology.devices[0]), registry.record() as decisions:
    compiled = jax.jit(fn).lower(*args).compile()
  return compiled.as_text(), {d.implementation for d in decisions}


def test_grouped_linear_layer_trains_partitioned_with_kernels():
  # `nn.GroupedLinear` under plain jit: the kernel's experts over the 8 devices, tokens
  # replicated; a training step's gradients. Every gmm runs a Pallas kernel per device.
  nnx = pytest.importorskip("flax.nnx")
  from gmm_jax import nn
  mesh = Mesh(np.array(_gpu_pod().devices).reshape(8), ("x",))
  layer = nnx.eval_shape(lambda: nn.GroupedLinear(8, 256, 512, param_dtype=jnp.bfloat16,
                                                  rngs=nnx.Rngs(0)))
  graphdef, state = nnx.split(layer)
  specs = {"kernel": P("x"), "bias": P("x")}

  def abstract(path, leaf):
    spec = specs[str(path[-1].key)]
    return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, spec))

  params = jax.tree_util.tree_map_with_path(abstract, nnx.to_pure_dict(state))
  x = jax.ShapeDtypeStruct((1024, 256), jnp.bfloat16, sharding=NamedSharding(mesh, P()))
  sizes = jax.ShapeDtypeStruct((8,), jnp.int32, sharding=NamedSharding(mesh, P()))

  def loss(params, x, sizes):
    model = nnx.merge(graphdef, params)
    return jnp.sum(model(x, sizes, activation="silu").astype(jnp.float32) ** 2)

  text, chosen = _compile_on_pod(jax.grad(loss, argnums=(0, 1)), params, x, sizes)
  assert chosen <= {"pallas_mosaic_gpu", "pallas_triton"} and chosen, chosen
  assert "mosaic_gpu" in text or "triton" in text
  assert _all_gathers(text) == []


def test_routed_apply_with_a_user_ffn_compiles_with_kernels():
  # A user's expert FFN inside `gmm_jax.routed_apply` (tokens and experts over the same
  # axis: they travel), forward and gradients: the gmms run per device inside its
  # shard_map, as kernels, and the expert weights are never gathered.
  mesh = Mesh(np.array(_gpu_pod().devices).reshape(8), ("e",))
  t, d, f, e = 4096, 256, 512, 16

  def arg(shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  x = arg((t, d), jnp.bfloat16, P("e"))
  ids = arg((t,), jnp.int32, P("e"))
  w_up, w_down = arg((e, d, f), jnp.bfloat16, P("e")), arg((e, f, d), jnp.bfloat16, P("e"))

  def ffn(rows, sizes, weights):
    up, down = weights
    return gmm_jax.gmm(gmm_jax.gmm(rows, up, sizes, activation="gelu_tanh"), down, sizes)

  def loss(weights, x, ids):
    y = gmm_jax.routed_apply(ffn, x, ids, weights, mesh=mesh, axis="e", transport="ragged")
    return jnp.sum(y.astype(jnp.float32) ** 2)

  text, chosen = _compile_on_pod(jax.grad(loss), (w_up, w_down), x, ids)
  assert chosen <= {"pallas_mosaic_gpu", "pallas_triton"} and chosen, chosen
  assert "ragged-all-to-all" in text
  weight_shapes = {"bf16[16,256,512]", "bf16[16,512,256]", "bf16[2,256,512]",
                   "bf16[2,512,256]"}
  assert not set(_all_gathers(text)) & weight_shapes


def test_routed_apply_on_accelerators_traces_their_branch_alone():
  # On a mesh of GPU (or TPU) devices the transport is that platform's, chosen at trace
  # time: no `lax.platform_dependent` conditional around the routed forward and backward
  # (XLA:TPU keeps such a conditional and fuses nothing across it; benchmarks/log.md).
  mesh = Mesh(np.array(_gpu_pod().devices).reshape(8), ("e",))
  t, d, f, e = 512, 128, 256, 16

  def arg(shape, dtype, spec):
    return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

  x, ids = arg((t, d), jnp.bfloat16, P("e")), arg((t,), jnp.int32, P("e"))
  w = arg((e, d, f), jnp.bfloat16, P("e"))

  def loss(w, x, ids):
    y = gmm_jax.routed_gmm(x, w, ids, mesh=mesh, axis="e")
    return jnp.sum(y.astype(jnp.float32) ** 2)

  with jax.default_device(mesh.devices.flat[0]):
    text = str(jax.make_jaxpr(jax.grad(loss))(w, x, ids))
  assert "ragged_all_to_all" in text
  assert "platform_index" not in text and "cond[" not in text


def _tpu_devices(topology: str):
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not importable: no TPU topology to describe")
  return topologies.get_topology_desc(platform="tpu", topology_name=topology).devices


@pytest.mark.parametrize("topology, want", [("v5e:2x2", "ragged"), ("v5e:4x4", "ragged"),
                                            ("v5e:4x8", "all_to_all"),
                                            ("v5e:8x8", "all_to_all"),
                                            ("v6e:8x8", "ragged")])
def test_auto_transport_follows_the_topology(topology, want):
  # libtpu refuses the ragged all-to-all on v5e slices beyond 16 chips (limited ICI
  # routing); "auto" picks the fixed-buffer all_to_all there, and an explicit choice stays.
  devices = np.array(_tpu_devices(topology))
  mesh = Mesh(devices.reshape(-1), ("x",))
  assert routing.transport_for("auto", "tpu", mesh) == want
  assert routing.transport_for("auto", "tpu", mesh.abstract_mesh) == want
  assert routing.transport_for("ragged", "tpu", mesh) == "ragged"
  assert routing.transport_for("auto", "cpu", mesh) == "all_to_all"



def test_routed_experts_on_tpu_with_no_mesh_in_sight_compiles():
  # Plain jit whose inputs only in_shardings place: the trace sees no layout, and on TPU no
  # partitioner runs the routed-experts op (jax-ml/jax#38196). It runs inline there, each
  # gmm as the dense reference XLA partitions: compiled for v5e 2x2 with no
  # custom_partitioning call and no expert weight gathered, forward and gradients.
  devices = _tpu_devices("v5e:2x2")
  mesh = Mesh(np.array(devices).reshape(1, 4), ("data", "expert"))
  e, d, f, t, k = 8, 256, 384, 512, 2
  spec = gmm_jax.ExpertFFN(e, "silu", gated=True)
  abstract = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
  params = {"w_in": abstract((e, d, 2 * f), jnp.bfloat16),
            "w_down": abstract((e, f, d), jnp.bfloat16)}

  def loss(x, top_p, top_e, params):
    y, _ = gmm_jax.routed_experts(spec, x, top_e, top_p, params)
    return jnp.sum(y ** 2)

  tokens = NamedSharding(mesh, P(("data", "expert")))
  experts = NamedSharding(mesh, P("expert"))
  step = jax.jit(jax.grad(loss, argnums=(0, 1, 3)),
                 in_shardings=(tokens, tokens, tokens, {"w_in": experts, "w_down": experts}))
  with jax.default_device(devices[0]), registry.record() as decisions:
    lowered = step.lower(abstract((t, d), jnp.bfloat16), abstract((t, k), jnp.float32),
                         abstract((t, k), jnp.int32), params)
    text = lowered.compile().as_text()
  assert "CustomSPMDPartitioning" not in lowered.as_text()
  assert {decision.implementation for decision in decisions} == {"reference"}
  weights = {f"bf16[{e},{d},{2 * f}]", f"bf16[{e},{f},{d}]", f"bf16[{d},{2 * f}]",
             f"bf16[{f},{d}]"}
  assert not {s.split("{")[0] for s in _all_gathers(text)} & weights
