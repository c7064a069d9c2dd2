"""The gmm_jax demo: an MoE expert FFN, forward and backward, checked and timed.

    python -m gmm_jax.demo

1. Routes tokens to experts (some experts get none), runs the gated expert FFN
   ``down(silu(x @ gate[e]) * (x @ up[e]))`` with gmm under jit, takes gradients w.r.t. the
   tokens and all expert weights, and checks them against the reference implementation.
2. Prints a small side-by-side speed table: gmm vs jax.lax.ragged_dot vs a dense matmul of the
   same FLOPs vs a batched matmul over G equal groups (see `gmm_jax.tools.bench`).
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import gmm_jax
from gmm_jax.tools import bench_host


def route(tokens: jax.Array, router: jax.Array):
  """Top-1 routing: sorts tokens by expert and returns them with the group sizes."""
  expert = jnp.argmax(tokens @ router, axis=-1)
  order = jnp.argsort(expert, stable=True)
  sizes = jnp.bincount(expert, length=router.shape[1]).astype(jnp.int32)
  return tokens[order], sizes


def expert_ffn(x, sizes, gate, up, down, implementation):
  hidden = gmm_jax.gmm(x, gate, sizes, activation="silu", implementation=implementation)
  hidden = hidden * gmm_jax.gmm(x, up, sizes, implementation=implementation)
  return gmm_jax.gmm(hidden, down, sizes, implementation=implementation)


def check_moe(num_tokens=1024, d_model=256, d_ff=512, num_experts=16, seed=0) -> float:
  """Forward + backward of the expert FFN, "xla" against "reference"; returns the max error."""
  keys = jax.random.split(jax.random.key(seed), 5)
  tokens = jax.random.normal(keys[0], (num_tokens, d_model))
  # A skewed router: a few experts are popular, some get no token at all.
  router = jax.random.normal(keys[1], (d_model, num_experts)) * jnp.linspace(0.0, 2.0, num_experts)
  scale = d_model ** -0.5
  gate = jax.random.normal(keys[2], (num_experts, d_model, d_ff)) * scale
  up = jax.random.normal(keys[3], (num_experts, d_model, d_ff)) * scale
  down = jax.random.normal(keys[4], (num_experts, d_ff, d_model)) * d_ff ** -0.5
  x, sizes = route(tokens, router)

  def loss(params, implementation):
    x, gate, up, down = params
    y = expert_ffn(x, sizes, gate, up, down, implementation)
    return jnp.mean(y ** 2)

  grad = jax.jit(jax.value_and_grad(loss), static_argnums=1)
  params = (x, gate, up, down)
  value, grads = grad(params, "xla")
  ref_value, ref_grads = grad(params, "reference")
  errors = [abs(float(value - ref_value)) / abs(float(ref_value))]
  for name, got, want in zip(("tokens", "gate", "up", "down"), grads, ref_grads):
    errors.append(float(jnp.max(jnp.abs(got - want)) / (jnp.max(jnp.abs(want)) + 1e-30)))
  sizes_np = np.asarray(sizes)
  print(f"MoE expert FFN: {num_tokens} tokens, d_model={d_model}, d_ff={d_ff}, "
        f"{num_experts} experts (sizes {sizes_np.tolist()}, {int((sizes_np == 0).sum())} empty)")
  print(f"  loss {float(value):.6f}; forward + backward vs reference: max relative error "
        f"{max(errors):.2e}")
  return max(errors)


def main(argv=None):
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--m", type=int, default=2048)
  parser.add_argument("--kn", type=int, default=512)
  parser.add_argument("--groups", nargs="+", type=int, default=[8, 64])
  args = parser.parse_args(argv)
  print(f"gmm_jax {gmm_jax.__version__} on jax {jax.__version__} ({jax.default_backend()})")
  error = check_moe()
  if not error < 1e-4:
    raise SystemExit(f"gmm disagrees with the reference: max relative error {error:.2e}")
  print(f"\nSpeed, float32, M={args.m}, K=N={args.kn}, skewed group sizes "
        "(ratios measured side by side; lower is better):")
  print(bench_host.header())
  for num_groups in args.groups:
    for row in bench_host.run_case(jnp.float32, args.m, args.kn, num_groups, "skewed", repeats=3):
      print(bench_host.format_row(row), flush=True)


if __name__ == "__main__":
  main()
