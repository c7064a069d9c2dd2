"""fp8 training's three gmms compile with the Pallas TPU kernel, deviceless (libtpu, no TPU).

The forward (m-grouped), dlhs (m-grouped, the weights read transposed) and drhs (k-grouped,
lhs transposed) gmms on blocked fp8 QArrays, as `gmm_jax.quantize` makes them for fp8
training (1 x 128 activation blocks, 128 x 128 weight blocks, 128 x 1 blocks of the weight
gradient's operands), are lowered through `gmm_tpu` for a TPU topology and compiled by
Mosaic: the kernel itself takes the fp8 values and the block scales (no dequantized copy is
made before it), one dot per 128-block. v5e has no fp8 MXU path (the kernel converts the
values to bf16 in-kernel); TPU7x has one (the values go to the dot as they are).

Needs libtpu in this Python (the deviceless-compile environment of `.ci/aot_env.sh`);
skipped, with the reason, only where it is not importable.
"""

from __future__ import annotations

import importlib.util

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax._src.tiling import tuning
from gmm_jax._src.core.config import GmmConfig
from gmm_jax.pallas.tpu import mosaic_tpu, mosaic_tpu_plan

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Tokens, model dim, expert dim, experts: ragged against the 128 blocks (300 = 2 x 128 + 44).
T, D, F, G = 1000, 300, 256, 3


def _topology(name: str, monkeypatch):
  if importlib.util.find_spec("libtpu") is None:
    pytest.skip("libtpu is not importable: this jax install has no TPU compiler")
  # Other processes on this host may hold libtpu's lockfile (parallel compiles).
  monkeypatch.setenv("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  return topologies.get_topology_desc(name, platform="tpu")


def _quantized(shape, dtype, channelwise_axes, tiled_axes):
  """The QArray's shapes (as `gmm_jax.quantize` makes it) without computing it."""
  return jax.eval_shape(
      lambda a: gmm_jax.quantize(a, dtype, channelwise_axes=channelwise_axes,
                                 tiled_axes=tiled_axes),
      jax.ShapeDtypeStruct(shape, jnp.float32))


def _training_gmms(grad_type):
  """(role, lhs, rhs, cfg) of fp8 training's forward, dlhs and drhs gmms."""
  w = _quantized((G, D, F), E4M3, (0,), {1: 128, 2: 128})
  return [
      ("fwd", _quantized((T, D), E4M3, (0,), {1: 128}), w,
       GmmConfig(group_type="m", num_local=G, out_dtype=np.dtype(jnp.bfloat16))),
      ("dlhs", _quantized((T, F), grad_type, (0,), {1: 128}), w,
       GmmConfig(group_type="m", num_local=G, transpose_rhs=True,
                 out_dtype=np.dtype(jnp.float32))),
      ("drhs", _quantized((T, D), E4M3, (1,), {0: 128}),
       _quantized((T, F), grad_type, (1,), {0: 128}),
       GmmConfig(group_type="k", num_local=G, transpose_lhs=True,
                 out_dtype=np.dtype(jnp.float32))),
  ]


# (topology, gradient dtype, the kernel's dot dtype for fwd / dlhs / drhs). v5e converts every
# fp8 value to bf16 (e5m2 gradients: the two backward gmms are e5m2 x e4m3); TPU7x multiplies
# e4m3 x e4m3 in fp8 (e4m3 gradients).
BF16 = jnp.bfloat16
TARGETS = [("v5e:1x1", E5M2, dict(fwd=BF16, dlhs=BF16, drhs=BF16)),
           ("tpu7x:1x1x1", E4M3, dict(fwd=E4M3, dlhs=E4M3, drhs=E4M3))]


@pytest.mark.parametrize("topology_name, grad_type, kernel_dot", TARGETS,
                         ids=[t[0] for t in TARGETS])
def test_fp8_training_gmms_compile_with_the_tpu_kernel(topology_name, grad_type, kernel_dot,
                                                       monkeypatch):
  topology = _topology(topology_name, monkeypatch)
  mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
  placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  place = lambda tree: jax.tree.map(  # noqa: E731
      lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed), tree)
  sizes = jax.ShapeDtypeStruct((G,), jnp.int32, sharding=placed)
  for role, lhs, rhs, cfg in _training_gmms(grad_type):
    planned = {}

    def fn(lhs, rhs, counts, cfg=cfg, planned=planned):
      planned["plan"] = mosaic_tpu_plan.plan(lhs, rhs, counts, cfg)
      return mosaic_tpu.gmm_tpu(lhs, rhs, counts, jnp.int32(0), None, cfg)

    with jax.default_device(topology.devices[0]), tuning.record_launches() as launches:
      lowered = jax.jit(fn).lower(place(lhs), place(rhs), sizes)
    where = f"{topology_name} {role}"
    assert [launch.name for launch in launches] == [
        "gmm_k_tpu" if role == "drhs" else "gmm_m_tpu"], where
    plan = planned["plan"]
    assert plan.prepared.quant.mode == "blocked", where
    # A K step (item) spans whole 128-blocks, one dot each (or all of a K below a step).
    tile_k = plan.tiling.tile_k
    assert tile_k % 128 == 0 or plan.k_steps == 1, where
    assert plan.blocks_per_step == -(-tile_k // 128), where
    assert plan.prepared.dot_dtype == np.dtype(kernel_dot[role]), where
    # The kernel's operands are the fp8 values themselves (nothing dequantized before it).
    call = next(line for line in lowered.as_text().splitlines()
                if "tpu_custom_call" in line and "stablehlo.custom_call" in line)
    assert "f8E4M3FN" in call, where
    lowered.compile()  # Mosaic accepts the kernel for this chip
