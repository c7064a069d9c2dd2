"""An MoE layer's training step three ways, side by side in one run: the fused gmm
(token dispatch and combine inside gmm), today's unfused block (copies around plain gmms)
and a MaxText-style block on `jax.lax.ragged_dot`.

    python -m gmm_jax.tools.bench_moe                       # T=4096 D=1024 F=2048 E=64 k=2, f32 and bf16
    python -m gmm_jax.tools.bench_moe --tokens 1024 --embed 256 --mlp 512 --experts 16
    JAX_PLATFORMS=cpu python -m gmm_jax.tools.bench_moe --dtypes bfloat16 --deviceless h200 v5e

Each block is the same function of the same parameter values: a softmax top-k router, a
gated SwiGLU expert FFN and the probability-weighted combine. The fused block holds the
gate and up projections as one ``[E, D, 2F]`` parameter (its layout: one gmm reads both),
the others as two ``[E, D, F]``. The step is
``jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))`` (the gradients of the parameters and
of x, as for a layer inside a model); the table gives its time (the minimum over rounds
that run every block once each, so that a noisy machine slows them alike) and its peak
temporary memory from XLA's compiled memory analysis
(``temp_size_in_bytes``: everything the step allocates besides its arguments and
results), and the ratios to the unfused block. The ragged_dot block does dense work per
group on CPU: at large shapes it is compiled (memory) but only timed with ``--time-ragged``.

``moe_fused`` and ``moe_unfused`` are the expert FFN as `gmm_jax.nn.MoE` runs it under
plain jit where it may be partitioned (several devices, or a deviceless target):
`gmm_jax.routed_experts`, whose backward recomputes its forward; each is compared with
``moe_unfused``. ``moe_fused`` has `ExpertFFN`'s defaults, so its ``gated_prologue`` is the
platform's (the TPU's compiles use it, the others not); ``moe_prologue`` forces it
(``gated_prologue=True``: the down gmm reads the gate|up pre-activation through its gated
prologue, so its dlhs gmm writes the pre-activation's cotangent) and ``moe_epilogue``
forces it off (``False``: the gate|up gmm applies the activation). ``--deviceless h200 v5e`` also compiles every block's step for one
NVIDIA H200 and one TPU v5e chip without the hardware (jax >= 0.12 with the CUDA plugin
and libtpu: the environment ``bash .ci/aot_env.sh`` prints, run with
``JAX_PLATFORMS=cpu``) and prints their temporaries beside the CPU ones: the memory the
accelerators' compilers plan, where XLA:CPU's figures carry copies of its own. Nothing
runs there, so those rows have no time.

Floor 6: public API only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import gmm_jax
from gmm_jax.tools import deviceless
from gmm_jax._src.tiling.autotune import min_wall_time


def init_params(key, embed: int, mlp: int, experts: int, dtype=jnp.float32) -> dict:
  """Router ``[D, E]``, gate and up ``[E, D, F]`` and down ``[E, F, D]`` (fan-in scaled)."""
  keys = jax.random.split(key, 4)
  normal = lambda k, shape, fan_in: (jax.random.normal(k, shape, jnp.float32)
                                     / math.sqrt(fan_in)).astype(dtype)
  return dict(router=normal(keys[0], (embed, experts), embed),
              gate=normal(keys[1], (experts, embed, mlp), embed),
              up=normal(keys[2], (experts, embed, mlp), embed),
              down=normal(keys[3], (experts, mlp, embed), mlp))


def _router(params, x, top_k: int):
  logits = (x @ params["router"]).astype(jnp.float32)
  probs = jax.nn.softmax(logits, axis=-1)
  top_p, top_e = jax.lax.top_k(probs, top_k)
  return top_p / jnp.sum(top_p, axis=-1, keepdims=True), top_e


FFN_POLICY = jax.checkpoint_policies.save_only_these_names(gmm_jax.PREACTIVATION)


def fused_block(params, x, top_k: int):
  """Rows read by index inside the first gmm (gate and up as one [E, D, 2F] SwiGLU gmm),
  weighted and written to their slots inside the second. The expert FFN keeps only the two
  gmms' pre-activations for its backward (`gmm_jax.PREACTIVATION`): the activation and
  the rows between the gmms are recomputed (elementwise), not stored."""
  top_p, top_e = _router(params, x, top_k)
  return jax.checkpoint(_fused_ffn, policy=FFN_POLICY)(params, x, top_p, top_e)


def _fused_ffn(params, x, top_p, top_e):
  experts = params["gate_up"].shape[0]
  r = gmm_jax.route(top_e, experts, weights=top_p)
  h = gmm_jax.gmm(x, params["gate_up"], r.group_sizes, lhs_indices=r.lhs_indices,
                  activation="swiglu")
  y = gmm_jax.gmm(h, params["down"], r.group_sizes, row_weights=r.row_weights,
                  out_indices=r.out_indices, out_rows=r.num_slots)
  return r.combine(y)


def unfused_block(params, x, top_k: int):
  """The rows copied into expert order, three plain gmms, copied back, weighted, summed."""
  top_p, top_e = _router(params, x, top_k)
  tokens, embed = x.shape
  experts = params["gate"].shape[0]
  flat_e = top_e.reshape(-1)
  rows = jnp.broadcast_to(x[:, None, :], (tokens, top_k, embed)).reshape(-1, embed)
  order = jnp.argsort(flat_e, stable=True)
  sizes = jnp.bincount(flat_e, length=experts).astype(jnp.int32)
  sorted_rows = rows[order]
  h = (jax.nn.silu(gmm_jax.gmm(sorted_rows, params["gate"], sizes))
       * gmm_jax.gmm(sorted_rows, params["up"], sizes))
  y_sorted = gmm_jax.gmm(h.astype(x.dtype), params["down"], sizes)
  y = jnp.zeros_like(y_sorted).at[order].set(y_sorted)
  weighted = y.astype(jnp.float32).reshape(tokens, top_k, -1) * top_p[..., None]
  return jnp.sum(weighted, axis=1).astype(x.dtype)


def ragged_dot_block(params, x, top_k: int):
  """MaxText's dropless path: sort, `jax.lax.ragged_dot` per projection, unsort, combine."""
  top_p, top_e = _router(params, x, top_k)
  tokens, embed = x.shape
  experts = params["gate"].shape[0]
  flat_e = top_e.reshape(-1)
  order = jnp.argsort(flat_e, stable=True)
  sizes = jnp.bincount(flat_e, length=experts).astype(jnp.int32)
  sorted_rows = jnp.repeat(x, top_k, axis=0)[order]
  gate = jax.lax.ragged_dot(sorted_rows, params["gate"], sizes)
  up = jax.lax.ragged_dot(sorted_rows, params["up"], sizes)
  h = (jax.nn.silu(gate) * up).astype(x.dtype)
  y_sorted = jax.lax.ragged_dot(h, params["down"], sizes)
  y = y_sorted[jnp.argsort(order)]
  weighted = y.astype(jnp.float32).reshape(tokens, top_k, -1) * top_p[..., None]
  return jnp.sum(weighted, axis=1).astype(x.dtype)


def copy_free_floor(params, x, top_k: int):
  """Not the same function: the unfused block's three gmms with the routed group sizes on
  the rows as they come (``repeat(x, k)``, no permutation) and no combine permutation. It
  times what is left of a step when every row copy is free, the bound for any fusion of
  them on this machine."""
  top_p, top_e = _router(params, x, top_k)
  tokens, embed = x.shape
  experts = params["gate"].shape[0]
  sizes = jnp.bincount(top_e.reshape(-1), length=experts).astype(jnp.int32)
  rows = jnp.repeat(x, top_k, axis=0)
  h = (jax.nn.silu(gmm_jax.gmm(rows, params["gate"], sizes))
       * gmm_jax.gmm(rows, params["up"], sizes))
  y = gmm_jax.gmm(h.astype(x.dtype), params["down"], sizes)
  weighted = y.astype(jnp.float32).reshape(tokens, top_k, -1) * top_p[..., None]
  return jnp.sum(weighted, axis=1).astype(x.dtype)


def _moe_block(fused: bool, gated_prologue: bool | None = None):
  def block(params, x, top_k: int, quantization=None):
    top_p, top_e = _router(params, x, top_k)
    experts = params["gate_up"].shape[0]
    options = (("preferred_element_type", x.dtype),)
    if quantization is not None:
      options += (("quantization", quantization),)
    spec = gmm_jax.ExpertFFN(experts, "silu", gated=True, fused=fused, options=options,
                             gated_prologue=gated_prologue)
    y, _ = gmm_jax.routed_experts(spec, x, top_e, top_p,
                                  dict(w_in=params["gate_up"], w_down=params["down"]))
    return y.astype(x.dtype)
  prologue = {None: "", True: ", the down gmm reading z through its gated prologue",
              False: ", the gate|up gmm applying the activation"}[gated_prologue]
  block.__doc__ = (f"nn.MoE's routed experts under plain jit (`gmm_jax.routed_experts`), "
                   f"{'fused' if fused else 'unfused'}{prologue if fused else ''}.")
  return block


BLOCKS = {"fused": fused_block, "unfused": unfused_block, "ragged_dot": ragged_dot_block,
          "copy_free_floor": copy_free_floor, "moe_fused": _moe_block(True),
          "moe_prologue": _moe_block(True, gated_prologue=True),
          "moe_epilogue": _moe_block(True, gated_prologue=False),
          "moe_unfused": _moe_block(False)}
# The block each one is compared with.
BASELINE = {name: "moe_unfused" if name.startswith("moe_") else "unfused" for name in BLOCKS}
# The parameters' layout: gate and up as one [E, D, 2F] parameter.
JOINT_GATE_UP = ("fused", "moe_fused", "moe_prologue", "moe_epilogue", "moe_unfused")


@dataclasses.dataclass
class Row:
  block: str
  dtype: str
  seconds: float | None
  temp_bytes: int
  target: str = "cpu"  # "cpu" (this machine) or a deviceless target (`deviceless.TARGETS`)


def training_step(block, top_k: int, quantization=None):
  """The jitted value and gradients of a block's mean square; `quantization` (the moe
  blocks' gmm option, e.g. "fp8") is passed to the block when given."""
  if quantization is not None:
    block = functools.partial(block, quantization=quantization)

  def loss(params, x):
    y = block(params, x, top_k)
    return jnp.mean(jnp.square(y.astype(jnp.float32)))
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))


def layout(name: str, params: dict) -> dict:
  """The parameters as block `name` holds them (`JOINT_GATE_UP`: gate and up as one)."""
  if name not in JOINT_GATE_UP:
    return params
  rest = {k: v for k, v in params.items() if k not in ("gate", "up")}
  return dict(rest, gate_up=jnp.concatenate([params["gate"], params["up"]], axis=-1))


def run(tokens: int, embed: int, mlp: int, experts: int, top_k: int, dtypes, *,
        time_ragged: bool, repeats: int, blocks=tuple(BLOCKS),
        quantization=None) -> list[Row]:
  rows = []
  for dtype in dtypes:
    params = init_params(jax.random.key(0), embed, mlp, experts, dtype)
    x = jax.random.normal(jax.random.key(1), (tokens, embed), jnp.float32).astype(dtype)
    compiled, timed = {}, {}
    for name in blocks:
      args = (layout(name, params), x)
      step = training_step(BLOCKS[name], top_k, quantization)
      compiled[name] = (step.lower(*args).compile(), args)
      if repeats and (name != "ragged_dot" or time_ragged):
        timed[name] = float("inf")
    for _ in range(repeats):
      for name in timed:
        step, args = compiled[name]
        timed[name] = min(timed[name], min_wall_time(step, args, 1))
    for name in blocks:
      step, _ = compiled[name]
      rows.append(Row(name, np.dtype(dtype).name, timed.get(name),
                      int(step.memory_analysis().temp_size_in_bytes)))
  return rows


def compile_deviceless(target: str, tokens: int, embed: int, mlp: int, experts: int,
                       top_k: int, dtypes, blocks=tuple(BLOCKS),
                       quantization=None) -> list[Row]:
  """Each block's training step compiled for one chip of `target` without the hardware
  (abstract arguments, traced and compiled under that chip as the default device, so that
  gmm picks its kernels); rows of temporary bytes, no time."""
  device = deviceless.chip(target)
  sharding = jax.sharding.SingleDeviceSharding(device)
  rows = []
  for dtype in dtypes:
    params = jax.eval_shape(lambda: init_params(jax.random.key(0), embed, mlp, experts, dtype))
    x = jax.ShapeDtypeStruct((tokens, embed), dtype, sharding=sharding)
    for name in blocks:
      args = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                          jax.eval_shape(functools.partial(layout, name), params))
      with jax.default_device(device):
        step = training_step(BLOCKS[name], top_k, quantization).lower(args, x).compile()
      rows.append(Row(name, np.dtype(dtype).name, None,
                      int(step.memory_analysis().temp_size_in_bytes), target))
  return rows


def table(rows: list[Row]) -> str:
  lines = ["| block | dtype | target | fwd+bwd ms | / baseline | peak temp MB | / baseline "
           "| baseline |",
           "|---|---|---|---|---|---|---|---|"]
  found = {(r.block, r.dtype, r.target): r for r in rows}
  for r in rows:
    base = BASELINE[r.block]
    ref = found.get((base, r.dtype, r.target))
    time_ratio = (f"{r.seconds / ref.seconds:.2f}" if ref and r.seconds and ref.seconds
                  else "-")
    ms = "-" if r.seconds is None else f"{r.seconds * 1e3:.0f}"
    mem_ratio = f"{r.temp_bytes / ref.temp_bytes:.2f}" if ref and ref.temp_bytes else "-"
    lines.append(f"| {r.block} | {r.dtype} | {r.target} | {ms} | {time_ratio} | "
                 f"{r.temp_bytes / 1e6:.0f} | {mem_ratio} | {base} |")
  return "\n".join(lines)


def main(argv=None) -> list[Row]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", type=int, default=4096)
  parser.add_argument("--embed", type=int, default=1024)
  parser.add_argument("--mlp", type=int, default=2048)
  parser.add_argument("--experts", type=int, default=64)
  parser.add_argument("--top-k", type=int, default=2)
  parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
  parser.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=list(BLOCKS))
  parser.add_argument("--time-ragged", action="store_true",
                      help="also time the ragged_dot block (dense work per group on CPU)")
  parser.add_argument("--repeats", type=int, default=3,
                      help="timing rounds on this machine (0: compile for memory only)")
  parser.add_argument("--deviceless", nargs="*", default=[], choices=sorted(deviceless.TARGETS),
                      help="also compile each step for one chip of these targets, without "
                           "the hardware (jax >= 0.12 with the CUDA plugin and libtpu)")
  parser.add_argument("--quantization", choices=("fp8", "fp8_e5m2_grads"), default=None,
                      help="the moe blocks' gmms trained in fp8 (gmm's quantization=)")
  args = parser.parse_args(argv)
  if args.quantization is not None and any(not b.startswith("moe_") for b in args.blocks):
    parser.error("--quantization applies to the moe_* blocks only")
  dtypes = [jnp.dtype(d) for d in args.dtypes]
  blocks = tuple(args.blocks)
  rows = run(args.tokens, args.embed, args.mlp, args.experts, args.top_k, dtypes,
             time_ragged=args.time_ragged, repeats=args.repeats, blocks=blocks,
             quantization=args.quantization)
  # TPU first: libtpu must be loaded by the partitioner's registration.
  for target in sorted(args.deviceless, key=lambda t: deviceless.TARGETS[t][0] != "tpu"):
    rows += compile_deviceless(target, args.tokens, args.embed, args.mlp, args.experts,
                               args.top_k, dtypes, blocks, args.quantization)
  print(f"MoE layer training step (fwd+bwd), T={args.tokens} D={args.embed} F={args.mlp} "
        f"E={args.experts} k={args.top_k}"
        + (f", {args.quantization} training" if args.quantization else "")
        + f", jax {jax.__version__}, "
        f"{jax.devices()[0].platform}"
        + (f"; deviceless: {', '.join(args.deviceless)}" if args.deviceless else ""))
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
