"""What a dlhs gmm that writes the gated activation's input cotangent itself would save.

The memory target of the TPU step (within 1.2x of the H200's temporaries) needs dz, the
``[R, 2F]`` cotangent of the up projection's output, written by the down projection's dlhs
gmm (an epilogue that reads z's gate and up tiles beside its dh tile) instead of by XLA
fusions after it. Before building that kernel this measures what it would save, deviceless:
one bf16 MoE training step (T=4096, D=1024, F=2048, E=64, k=2, gmm_jax's gmms, the expert
FFN as a custom_vjp) compiled twice,

* ``xla``: the backward as the op runs it today: ``dh = gmm(ct, W_down^T)``, then
  ``dz = epilogue.gated_cotangent(z, dh)`` in XLA;
* ``kernel``: an opaque gmm with dz's shape (``[R, D] x [E, D, 2F] -> [R, 2F]``, z kept
  alive up to it by an optimization barrier) stands in for the epilogue kernel. Its values
  are wrong; its buffers are the kernel's: dz is written once, no dh and no f32 or half
  copies exist.

  JAX_PLATFORMS=cpu python benchmarks/emulate_dz_epilogue.py v5e xla
  JAX_PLATFORMS=cpu python benchmarks/emulate_dz_epilogue.py v5e kernel

(targets: h100, h200, v5e, v6e; in the deviceless environment of .ci/aot_env.sh.) Results:
benchmarks/log.md, "The MoE backward's last copy: what a dz-writing kernel would save".
"""
import functools
import sys

import jax
import jax.numpy as jnp
from jax import lax

import gmm_jax
from gmm_jax.tools import bench_moe, deviceless
from gmm_jax._src.core import epilogue

T, D, F, E, TOP_K = 4096, 1024, 2048, 64, 2
BF16 = jnp.bfloat16


def _gmm(lhs, rhs, sizes, **options):
  return gmm_jax.gmm(lhs, rhs, sizes, preferred_element_type=BF16, **options)


def _swiglu(z):
  return epilogue.gated_halves_f32("swiglu", z).astype(BF16)


def expert_ffn(variant: str):
  """The expert FFN on rows sorted by expert, ``[R, D] -> [R, D]``, with the backward of
  `variant` (see the module docstring)."""

  @jax.custom_vjp
  def ffn(rows, sizes, w_up, w_down):
    return _gmm(_swiglu(_gmm(rows, w_up, sizes)), w_down, sizes)

  def fwd(rows, sizes, w_up, w_down):
    z = _gmm(rows, w_up, sizes)
    return _gmm(_swiglu(z), w_down, sizes), (rows, sizes, w_up, w_down, z)

  def bwd(res, ct):
    rows, sizes, w_up, w_down, z = res
    ct = ct.astype(BF16)
    dw_down = _gmm(_swiglu(z), ct, sizes, group_type="k", transpose_lhs=True)
    if variant == "xla":
      dz = epilogue.gated_cotangent("swiglu", z, _gmm(ct, w_down, sizes, transpose_rhs=True),
                                    BF16)
    else:  # the stand-in: one opaque kernel writes a [R, 2F] result; z lives until then
      dz, _ = lax.optimization_barrier((_gmm(ct, w_up, sizes), z))
    d_rows = _gmm(dz, w_up, sizes, transpose_rhs=True)
    dw_up = _gmm(rows, dz, sizes, group_type="k", transpose_lhs=True)
    return d_rows, None, dw_up, dw_down

  ffn.defvjp(fwd, bwd)
  return ffn


def loss(ffn, params, x):
  top_p, top_e = bench_moe._router(params, x, TOP_K)
  flat_e = top_e.reshape(-1)
  order = jnp.argsort(flat_e)
  sizes = jnp.bincount(flat_e, length=E).astype(jnp.int32)
  rows = jnp.repeat(x, TOP_K, axis=0)[order]
  y = ffn(rows, sizes, params["gate_up"], params["down"])[jnp.argsort(order)]
  y = jnp.sum(y.astype(jnp.float32).reshape(T, TOP_K, -1) * top_p[..., None], axis=1)
  return jnp.mean(jnp.square(y))


def main(target: str, variant: str) -> None:
  if variant not in ("xla", "kernel"):
    raise ValueError(f"variant must be 'xla' or 'kernel', got {variant!r}")
  device = deviceless.chip(target)
  sharding = jax.sharding.SingleDeviceSharding(device)
  params = jax.eval_shape(lambda: bench_moe.init_params(jax.random.key(0), D, F, E, BF16))
  params = jax.eval_shape(functools.partial(bench_moe.layout, "moe_fused"), params)
  params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                        params)
  x = jax.ShapeDtypeStruct((T, D), BF16, sharding=sharding)
  step = jax.jit(jax.value_and_grad(functools.partial(loss, expert_ffn(variant)),
                                    argnums=(0, 1)))
  with jax.default_device(device):
    compiled = step.lower(params, x).compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  print(f"{target} {variant}: temporaries {temp / 1e6:.1f} MB", flush=True)


if __name__ == "__main__":
  main(*sys.argv[1:3])
