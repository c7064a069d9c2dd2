"""One process of a two-process MoE training step (run by tests/test_multiprocess.py, and
by hand: ``python tests/multiprocess_step.py <process_id> <port> <out.json>`` in two shells).

2 processes x 4 CPU devices, joined by `jax.distributed.initialize` on localhost with gloo
collectives: a mesh ("data"=2 across the processes, "e"=4 within each), tokens sharded over
"data", expert weights over "e". One SGD step of `nn.MoE` (forward, gradient, update) under
plain jit, compared with the same step on one device of this process; the compiled
program's all-gathers are listed. The same code runs on a multi-host TPU or GPU cluster
(`jax.distributed.initialize()` with no arguments there).
"""

from __future__ import annotations

import json
import re
import sys


def _best_time(fn, repeats: int = 5) -> float:
  """The fastest of `repeats` runs (after one warm-up), in seconds."""
  import time

  import jax

  jax.block_until_ready(fn())
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn())
    best = min(best, time.perf_counter() - start)
  return best


def main(process_id: int, port: int, out_path: str) -> None:
  import jax

  jax.config.update("jax_num_cpu_devices", 4)
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(f"localhost:{port}", num_processes=2, process_id=process_id,
                             initialization_timeout=60)
  import jax.numpy as jnp
  import numpy as np
  from flax import nnx
  from jax.experimental import multihost_utils
  from jax.sharding import NamedSharding, PartitionSpec as P

  from gmm_jax import nn
  from gmm_jax.tools.bench_host import communicated_bytes

  assert jax.process_count() == 2 and len(jax.devices()) == 8, jax.devices()
  mesh = jax.make_mesh((2, 4), ("data", "e"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
  model = nn.MoE(8, 16, 32, top_k=2, rngs=nnx.Rngs(0),
                 data_parallel=(mesh, ("data",)), expert_parallel=(mesh, "e"))
  model.router.kernel[...] = jax.random.normal(jax.random.key(1), (16, 8))
  graphdef, state = nnx.split(model)
  x = jax.random.normal(jax.random.key(2), (16, 8, 16))  # 128 tokens, the same everywhere
  target = jnp.tanh(x)

  def make_step(graph):
    """One SGD step of the MoE described by `graph` (sharded or not)."""

    def step(state, x, target):
      def loss_fn(state):
        y, aux = nnx.merge(graph, state)(x)
        return jnp.mean((y - target) ** 2) + 0.01 * aux["load_balancing_loss"]

      loss, grads = jax.value_and_grad(loss_fn)(state)
      return loss, jax.tree.map(lambda p, g: p - 0.5 * g, state, grads)

    return step

  step = make_step(graphdef)
  # The reference: the same step on this process's first device, unsharded.
  local = jax.tree.map(lambda a: jax.device_put(a, jax.local_devices()[0]), (state, x, target))
  reference_step = make_step(nnx.split(nn.MoE(8, 16, 32, top_k=2, rngs=nnx.Rngs(0)))[0])
  want_loss, want_state = jax.jit(reference_step)(*local)

  def global_array(a, spec):
    a = np.asarray(a)
    sharding = NamedSharding(mesh, spec)
    return jax.make_array_from_callback(a.shape, sharding, lambda index: a[index])

  expert = lambda a: P("e") if a.ndim == 3 else P()  # noqa: E731
  placed = jax.tree.map(lambda a: global_array(a, expert(a)), state)
  xs, ts = global_array(x, P("data")), global_array(target, P("data"))
  sharded_step = jax.jit(step)
  loss, new_state = sharded_step(placed, xs, ts)
  text = sharded_step.lower(placed, xs, ts).compile().as_text()
  seconds = _best_time(lambda: sharded_step(placed, xs, ts))
  reference_seconds = _best_time(lambda: jax.jit(reference_step)(*local))

  errors = []
  for got, want in zip(jax.tree.leaves(new_state), jax.tree.leaves(want_state)):
    got = multihost_utils.process_allgather(got, tiled=True)
    errors.append(float(np.max(np.abs(np.asarray(got) - np.asarray(want)))))
  kernel_specs = [list(a.sharding.spec)[:1] for a in jax.tree.leaves(new_state) if a.ndim == 3]
  result = dict(
      process=process_id, loss=float(loss), want_loss=float(want_loss),
      max_error=max(errors), kernel_specs=kernel_specs,
      all_gathers=re.findall(r"= (.*?) all-gather(?:-start)?\(", text),
      bytes_by_collective=communicated_bytes(text),
      step_ms=seconds * 1e3, one_device_step_ms=reference_seconds * 1e3)
  with open(out_path, "w") as f:
    json.dump(result, f)
  jax.distributed.shutdown()


if __name__ == "__main__":
  main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3])
