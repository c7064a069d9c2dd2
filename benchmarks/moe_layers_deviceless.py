"""Temporaries of an MoE training step with several layers, compiled deviceless.

One layer's step can let XLA keep a saved activation somewhere a model of many layers
could not (XLA:TPU keeps the single layer's 67 MB pre-activation in VMEM); chaining layers
shows what the per-layer figures do as the step grows. Each layer is `bench_moe`'s
`moe_fused` block (nn.MoE's routed experts under plain jit) with its own weights, with
`ExpertFFN(gated_prologue=...)` forced on or off, or the default (the platform's).

  JAX_PLATFORMS=cpu python benchmarks/moe_layers_deviceless.py TARGET PROLOGUE LAYERS

TARGET: h100, h200, v5e or v6e; PROLOGUE: 1 (gated prologue), 0 (the epilogue activation)
or auto (the default: the prologue on TPU); in the environment of
.ci/aot_env.sh. Results: benchmarks/log.md, "The gated prologue".
"""

import sys

import jax
import jax.numpy as jnp

import gmm_jax
from gmm_jax.tools import bench_moe, deviceless

T, D, F, E, TOP_K = 4096, 1024, 2048, 64, 2


def block(prologue: bool | None, params, x):
  top_p, top_e = bench_moe._router(params, x, TOP_K)
  spec = gmm_jax.ExpertFFN(E, "silu", gated=True, fused=True, gated_prologue=prologue,
                           options=(("preferred_element_type", x.dtype),))
  y, _ = gmm_jax.routed_experts(spec, x, top_e, top_p,
                                dict(w_in=params["gate_up"], w_down=params["down"]))
  return y.astype(x.dtype)


def main(target: str, prologue: bool | None, layers: int) -> None:
  device = deviceless.chip(target)
  sharding = jax.sharding.SingleDeviceSharding(device)

  def loss(layer_params, x):
    for params in layer_params:
      x = block(prologue, params, x)
    return jnp.mean(jnp.square(x.astype(jnp.float32)))

  one = jax.eval_shape(lambda: bench_moe.layout(
      "moe_fused", bench_moe.init_params(jax.random.key(0), D, F, E, jnp.bfloat16)))
  layer_params = [jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype,
                                                              sharding=sharding), one)
                  for _ in range(layers)]
  x = jax.ShapeDtypeStruct((T, D), jnp.bfloat16, sharding=sharding)
  with jax.default_device(device):
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(layer_params,
                                                                       x).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  name = {None: "default", True: "prologue", False: "epilogue"}[prologue]
  print(f"{target} {name} {layers} layers: temporaries "
        f"{temp / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
  main(sys.argv[1], {"1": True, "0": False, "auto": None}[sys.argv[2]], int(sys.argv[3]))
