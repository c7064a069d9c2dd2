"""XLA:CPU's own formulations of a grouped matmul's work, timed beside the floor.

What gmm's CPU path is built from, on the balanced problem of `gmm_jax.tools.bench` (M rows
in G equal groups, K = N): a dense matmul of the same FLOPs; one batched dot over the groups
(``einsum("gck,gkn->gcn")``); a loop over the groups, one dot each with the group's weight
matrix sliced from the stacked weights (what every loop formulation does); and the time to
read the weights once. XLA:CPU copies a weight matrix sliced inside a loop into a buffer of
its own before the dot reads it (a ``dynamic-slice`` fusion: the weights cross memory three
times), and its batched dot of a few rows per group runs well below the dense rate: these
two are the ceiling of any gmm made of XLA ops on a CPU.

    python benchmarks/cpu_primitives.py --groups 64 256 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax.tools.bench_host import time_fn, weights_seconds


def programs(m: int, k: int, n: int, groups: int, dtype):
  """name -> the jitted program of (x [M, K], w [G, K, N])."""
  rows = m // groups
  acc = jnp.float32

  def loop(x, w):
    def body(g, out):
      y = jnp.matmul(lax.dynamic_slice_in_dim(x, g * rows, rows),
                     lax.dynamic_index_in_dim(w, g, 0, keepdims=False),
                     preferred_element_type=acc).astype(dtype)
      return lax.dynamic_update_slice_in_dim(out, y, g * rows, 0)
    return lax.fori_loop(0, groups, body, jnp.zeros((m, n), dtype))

  return {
      "dense": jax.jit(lambda x, w: jnp.matmul(x, w[0], preferred_element_type=acc)
                       .astype(dtype)),
      "batched": jax.jit(lambda x, w: jnp.einsum(
          "gck,gkn->gcn", x.reshape(groups, rows, k), w, preferred_element_type=acc)
                         .astype(dtype)),
      "loop of dots": jax.jit(loop),
  }


def main(argv=None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--m", type=int, default=2048)
  parser.add_argument("--kn", type=int, default=1024)
  parser.add_argument("--groups", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  print(f"jax {jax.__version__}, M={args.m}, K=N={args.kn}, balanced groups; ms (x the floor, "
        "max(dense, weights read once))")
  print("| dtype | G | dense | weights read once | batched | loop of dots |")
  print("|---|---|---|---|---|---|")
  rng = np.random.default_rng(0)
  for dtype in args.dtypes:
    for groups in args.groups:
      x = jnp.asarray(rng.standard_normal((args.m, args.kn)), dtype)
      w = jnp.asarray(rng.standard_normal((groups, args.kn, args.kn)) / 32, dtype)
      seconds = {name: time_fn(fn, (x, w), args.repeats)
                 for name, fn in programs(args.m, args.kn, args.kn, groups, dtype).items()}
      read = weights_seconds(w, "fwd", args.repeats)
      floor = max(seconds["dense"], read)
      cell = lambda s: f"{s * 1e3:.1f} ({s / floor:.2f}x)"  # noqa: E731
      print(f"| {dtype} | {groups} | {cell(seconds['dense'])} | {cell(read)} | "
            f"{cell(seconds['batched'])} | {cell(seconds['loop of dots'])} |", flush=True)


if __name__ == "__main__":
  main()
