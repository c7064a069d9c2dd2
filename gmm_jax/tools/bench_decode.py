"""Per-call cost of decode-shaped grouped matmuls, side by side in one run: gmm on the ragged
form, gmm on the masked form (`gmm_jax.MaskedArray`), `jax.lax.ragged_dot` on the ragged
form, and a masked dense einsum (``einsum('grk,gkn->grn')`` times the row mask, what a
batched matmul over the padded slots costs).

    python -m gmm_jax.tools.bench_decode                    # T 1, 8, 64; E 64, 256; k=8; D=F=512
    python -m gmm_jax.tools.bench_decode --tokens 1 16 --experts 128 --dim 1024
    python -m gmm_jax.tools.bench_decode --moe              # a decode MoE FFN, masked vs ragged
    python -m gmm_jax.tools.bench_decode --deviceless       # ENTRY ops per target, nothing run

Each of T tokens picks k distinct experts at random (a fixed seed); the ragged form is the
``[T*k, D]`` rows sorted by expert with counts ``[E]``, the masked form ``[E, T, D]`` (T is
the exact static bound on an expert's rows when each token picks k distinct experts).
Operands are prepared outside the timed call; the call is ``jax.jit`` of the matmul alone
with the counts as a runtime argument (one compilation serves any routing). The table gives
the compiled HLO's instruction count (every computation of ``compile().as_text()``, and the
entry computation's alone: roughly the ops that run one after the other), and the time per
call: the minimum over rounds (each round runs every method `number` times, interleaved, so
that a noisy machine slows them alike; a method slower than 10 ms per call runs fewer times,
at least once) of the mean per call.

``--deviceless`` compiles instead, on this host, for a TPU v5e and an H200 (no device
needed: libtpu and jax's CUDA plugin) and
prints, per target, the compiled ENTRY computation's ops (`entry_ops`: every top-level
instruction but parameters, constants, tuples and their elements, bitcasts) and kernel
launches of: a decode-shaped gmm (`DECODE_GMM`: 64 rows, 64 groups, K=2048, N=1024, bf16)
with gmm_jax, megablox (TPU), tokamax's ragged_dot (when importable) and
`jax.lax.ragged_dot`; and of the decode MoE FFN (`DECODE_MOE`) masked and ragged.

Floor 6: public API only.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import pathlib
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies
from jax.experimental.pallas.ops.tpu.megablox import gmm as megablox_gmm

import gmm_jax

_INSTRUCTION = re.compile(r"^\s*(ROOT\s+)?%?[\w.\-]+\s*=\s")


def hlo_op_counts(compiled_text: str) -> tuple[int, int]:
  """(instructions in every computation, instructions in the ENTRY computation) of a
  compiled HLO module's text."""
  total = entry = 0
  in_entry = False
  for line in compiled_text.splitlines():
    if line.startswith("ENTRY"):
      in_entry = True
      continue
    if line.startswith("}"):
      in_entry = False
      continue
    if _INSTRUCTION.match(line) and not line.lstrip().startswith("HloModule"):
      total += 1
      entry += in_entry
  return total, entry


_OPCODE = re.compile(r"[\]\)}]\s+([a-z][a-z0-9\-]*)\(")
_TARGET = re.compile(r'custom_call_target="([^"]+)"')
# ENTRY instructions that launch nothing and move no data: they name values.
FREE_OPCODES = frozenset({"parameter", "constant", "get-tuple-element", "bitcast", "tuple"})
# Custom-call targets that are kernel launches (Mosaic TPU, Mosaic GPU, Triton); others
# (AllocateBuffer, ...) are XLA's own bookkeeping.
_KERNEL_TARGETS = ("tpu_custom_call", "mosaic_gpu", "triton")


def entry_opcodes(compiled_text: str) -> list[tuple[str, str]]:
  """(opcode, custom-call target or "") of every instruction of the ENTRY computation of a
  compiled HLO module's text."""
  out, in_entry = [], False
  for line in compiled_text.splitlines():
    if line.startswith("ENTRY"):
      in_entry = True
      continue
    if in_entry and line.startswith("}"):
      break
    if in_entry and _INSTRUCTION.match(line):
      rhs = line.split("=", 1)[1]
      opcode = _OPCODE.search(rhs)
      target = _TARGET.search(line)
      out.append((opcode.group(1) if opcode else "?", target.group(1) if target else ""))
  return out


def entry_ops(compiled_text: str) -> tuple[int, int]:
  """(ops, kernels) of a compiled module's ENTRY computation: ``ops`` counts the top-level
  instructions that do work (every one but `FREE_OPCODES`: fusions, slices, pads, sorts,
  loops, custom calls, ...), ``kernels`` the custom calls that launch a Pallas or XLA kernel
  (Mosaic TPU, Mosaic GPU, Triton)."""
  ops = kernels = 0
  for opcode, target in entry_opcodes(compiled_text):
    ops += opcode not in FREE_OPCODES
    kernels += opcode == "custom-call" and any(k in target for k in _KERNEL_TARGETS)
  return ops, kernels


def decode_problem(tokens: int, experts: int, top_k: int, dim: int, mlp: int, seed: int = 0,
                   dtype=jnp.float32):
  """(ragged rows [T*k, D], counts [E], masked [E, T, D] values, weights [E, D, F])."""
  if top_k > experts:
    raise ValueError(f"top_k={top_k} needs at least as many experts, got {experts}")
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(tokens, dim)).astype(np.float32)
  ids = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k]
  order = np.argsort(ids.reshape(-1), kind="stable")
  rows = x[order // top_k]
  counts = np.bincount(ids.reshape(-1), minlength=experts).astype(np.int32)
  weights = (rng.normal(size=(experts, dim, mlp)) / np.sqrt(dim)).astype(np.float32)
  masked = gmm_jax.from_ragged(rows, counts, max_rows=tokens)
  cast = lambda a: jnp.asarray(a, dtype)
  return cast(rows), jnp.asarray(counts), cast(masked.values), cast(weights)


def _methods():
  def gmm_ragged(rows, counts, values, weights):
    return gmm_jax.gmm(rows, weights, counts)

  def gmm_masked(rows, counts, values, weights):
    return gmm_jax.gmm(gmm_jax.MaskedArray(values, counts), weights).values

  def ragged_dot(rows, counts, values, weights):
    return jax.lax.ragged_dot(rows, weights, counts)

  def masked_einsum(rows, counts, values, weights):
    valid = jnp.arange(values.shape[1])[None, :] < counts[:, None]
    out = jnp.einsum("grk,gkn->grn", values, weights, preferred_element_type=jnp.float32)
    return jnp.where(valid[..., None], out, 0).astype(values.dtype)

  return dict(gmm_ragged=gmm_ragged, gmm_masked=gmm_masked, ragged_dot=ragged_dot,
              masked_einsum=masked_einsum)


METHODS = tuple(_methods())


@dataclasses.dataclass(frozen=True)
class Row:
  tokens: int
  experts: int
  top_k: int
  dim: int
  method: str
  hlo_ops: int
  entry_ops: int
  us_per_call: float


def run(tokens: int, experts: int, top_k: int, dim: int, mlp: int, *, number: int = 20,
        rounds: int = 5, methods=METHODS, dtype=jnp.float32) -> list[Row]:
  """Compiles and times each method on one decode shape; checks they agree."""
  args = decode_problem(tokens, experts, top_k, dim, mlp, dtype=dtype)
  fns = {name: fn for name, fn in _methods().items() if name in methods}
  return _time(fns, args, tokens, experts, top_k, dim, number, rounds,
               ragged_rows=tokens * top_k)


def _time(fns, args, tokens, experts, top_k, dim, number, rounds, ragged_rows):
  compiled, counts = {}, {}
  for name, fn in fns.items():
    compiled[name] = jax.jit(fn).lower(*args).compile()
    counts[name] = hlo_op_counts(compiled[name].as_text())
  # The methods compute the same products: the ragged ones on the sorted rows, the masked
  # ones in the slots; compare them in the ragged form.
  results = {name: jax.block_until_ready(fn(*args)) for name, fn in compiled.items()}
  reference = None
  for name, out in results.items():
    out = np.asarray(out, np.float32)
    if out.ndim == 3:
      out = np.asarray(gmm_jax.to_ragged(gmm_jax.MaskedArray(out, args[1]), ragged_rows)[0])
    if reference is None:
      reference = out
    elif not np.allclose(out, reference, rtol=2e-2, atol=2e-2):
      raise AssertionError(f"{name} differs from {next(iter(results))}")
  best = {name: float("inf") for name in compiled}
  calls = {}
  for name, fn in compiled.items():  # slow methods get fewer calls per round (>= 1)
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls[name] = max(1, min(number, int(0.2 / max(time.perf_counter() - start, 1e-9))))
  for _ in range(rounds):
    for name, fn in compiled.items():
      start = time.perf_counter()
      for _ in range(calls[name]):
        out = fn(*args)
      jax.block_until_ready(out)
      best[name] = min(best[name], (time.perf_counter() - start) / calls[name])
  return [Row(tokens, experts, top_k, dim, name, *counts[name], best[name] * 1e6)
          for name in compiled]


# ------------------------------------------------------------------ an MoE layer's decode


def moe_decode_masked(x, gate_up, down, top_e, top_p, max_rows: int):
  """An MoE expert FFN (SwiGLU) for a decode step, in the masked layout.

  x ``[T, D]``, gate_up ``[E, D, 2F]`` (gate half, then up half), down ``[E, F, D]``,
  top_e/top_p ``[T, k]`` -> ``[T, D]``. The routed rows become ``[E, max_rows, D]`` slots
  (`gmm_jax.from_ragged`; `max_rows` static: T is exact when each token picks k distinct
  experts, a smaller bound drops an expert's later tokens as a capacity does), both gmms
  run on the masked form (the router weight as the down gmm's ``row_weights [E,
  max_rows]``), and the result goes back through `gmm_jax.to_ragged` and the routing's
  combine. Every shape depends on (T, E, max_rows) only.
  """
  experts = gate_up.shape[0]
  routing = gmm_jax.route(top_e, experts, weights=top_p, capacity=max_rows)
  rows = jnp.take(x, routing.lhs_indices, axis=0, mode="fill", fill_value=0)
  masked = gmm_jax.from_ragged(rows, routing.group_sizes, max_rows)
  weights = gmm_jax.from_ragged(routing.row_weights[:, None], routing.group_sizes,
                                max_rows).values[..., 0]
  h = gmm_jax.gmm(masked, gate_up, activation="swiglu")
  y = gmm_jax.gmm(h, down, row_weights=weights)
  y_rows, _ = gmm_jax.to_ragged(y, routing.num_rows)
  slots = jnp.zeros((routing.num_slots, y_rows.shape[-1]), y_rows.dtype)
  slots = slots.at[routing.out_indices].set(y_rows, mode="drop")
  return routing.combine(slots)


def moe_decode_ragged(x, gate_up, down, top_e, top_p, max_rows: int):
  """The same FFN with the fused ragged gmms (rows gathered and scattered inside gmm)."""
  routing = gmm_jax.route(top_e, gate_up.shape[0], weights=top_p, capacity=max_rows)
  h = gmm_jax.gmm(x, gate_up, routing.group_sizes, lhs_indices=routing.lhs_indices,
                  activation="swiglu")
  y = gmm_jax.gmm(h, down, routing.group_sizes, row_weights=routing.row_weights,
                  out_indices=routing.out_indices, out_rows=routing.num_slots)
  return routing.combine(y)


def moe_decode_ragged_dot(x, gate_up, down, top_e, top_p, max_rows: int):
  """The same FFN on `jax.lax.ragged_dot` (sorted copies of the rows around it)."""
  routing = gmm_jax.route(top_e, gate_up.shape[0], weights=top_p, capacity=max_rows)
  rows = jnp.take(x, routing.lhs_indices, axis=0, mode="fill", fill_value=0)
  z = jax.lax.ragged_dot(rows, gate_up, routing.group_sizes)
  half = z.shape[-1] // 2
  h = jax.nn.silu(z[:, :half]) * z[:, half:]
  y = jax.lax.ragged_dot(h, down, routing.group_sizes) * routing.row_weights[:, None]
  slots = jnp.zeros((routing.num_slots, y.shape[-1]), y.dtype)
  return routing.combine(slots.at[routing.out_indices].set(y, mode="drop"))


MOE_METHODS = dict(moe_masked=moe_decode_masked, moe_ragged=moe_decode_ragged,
                   moe_ragged_dot=moe_decode_ragged_dot)


def moe_problem(tokens: int, experts: int, top_k: int, dim: int, mlp: int, seed: int = 0):
  """(x [T, D], gate_up [E, D, 2F], down [E, F, D], top_e [T, k], top_p [T, k])."""
  rng = np.random.default_rng(seed)
  x = rng.normal(size=(tokens, dim)).astype(np.float32)
  gate_up = (rng.normal(size=(experts, dim, 2 * mlp)) / np.sqrt(dim)).astype(np.float32)
  down = (rng.normal(size=(experts, mlp, dim)) / np.sqrt(mlp)).astype(np.float32)
  top_e = np.argsort(rng.random((tokens, experts)), axis=1)[:, :top_k].astype(np.int32)
  top_p = rng.random((tokens, top_k)).astype(np.float32)
  return tuple(jnp.asarray(a) for a in (x, gate_up, down, top_e, top_p))


def run_moe(tokens: int, experts: int, top_k: int, dim: int, mlp: int, *, number: int = 20,
            rounds: int = 5) -> list[Row]:
  """The decode MoE FFN three ways on one shape (max_rows = T), checked to agree."""
  args = moe_problem(tokens, experts, top_k, dim, mlp)
  fns = {name: functools.partial(fn, max_rows=tokens) for name, fn in MOE_METHODS.items()}
  return _time(fns, args, tokens, experts, top_k, dim, number, rounds, ragged_rows=None)


def table(rows: list[Row]) -> str:
  lines = ["| T | E | k | D=F | method | HLO ops (all / entry) | us per call | vs ragged_dot |",
           "|---|---|---|---|---|---|---|---|"]
  base = {(r.tokens, r.experts, r.dim): r.us_per_call for r in rows
          if r.method in ("ragged_dot", "moe_ragged_dot")}
  for r in rows:
    ratio = r.us_per_call / base[(r.tokens, r.experts, r.dim)] if (
        (r.tokens, r.experts, r.dim) in base) else float("nan")
    lines.append(f"| {r.tokens} | {r.experts} | {r.top_k} | {r.dim} | {r.method} | "
                 f"{r.hlo_ops} / {r.entry_ops} | {r.us_per_call:.1f} | {ratio:.2f} |")
  return "\n".join(lines)


# ------------------------------------------------------------ deviceless op counts


# (M rows, G groups, K, N): one decode step's gmm, 64 rows over 64 experts (~1 row each).
DECODE_GMM = (64, 64, 2048, 1024)
# (T tokens, E experts, k, D, F): the decode MoE FFN of `run_moe`, SwiGLU, bf16.
DECODE_MOE = (8, 64, 8, 2048, 1024)
DEVICELESS_TARGETS = ("v5e", "h200")
_H200 = pathlib.Path(__file__).with_name("targets") / "nvidia_h200.txtpb"


@dataclasses.dataclass(frozen=True)
class OpCount:
  target: str
  problem: str
  method: str
  entry_ops: int | None
  kernels: int | None
  note: str = ""


def _topology(target: str):
  if target == "v5e":
    return topologies.get_topology_desc("v5e:1x1", platform="tpu")
  return topologies.get_topology_desc(platform="cuda", topology="1x1x1",
                                      target_config=_H200.read_text())


def _tokamax_ragged_dot(target: str):
  """tokamax's ragged_dot on its Pallas kernel for `target`, or the reason it is absent."""
  try:
    import tokamax  # optional: a comparison library
  except ImportError as err:
    return f"tokamax not importable ({err})"
  implementation = "mosaic"  # tokamax's Pallas Mosaic kernel of the platform
  return lambda x, w, c: tokamax.ragged_dot(x, w, c, implementation=implementation)


def _gmm_methods(target: str) -> dict:
  methods = {"gmm_jax.gmm": lambda x, w, c: gmm_jax.gmm(x, w, c)}
  if target == "v5e":
    # Its row tile divides M (the 128-row default would not divide 64 rows).
    methods["megablox"] = lambda x, w, c: megablox_gmm(
        x, w, c, preferred_element_type=x.dtype, tiling=(min(128, x.shape[0]), 128, 128))
  methods["tokamax.ragged_dot"] = _tokamax_ragged_dot(target)
  methods["jax.lax.ragged_dot"] = lambda x, w, c: jax.lax.ragged_dot(x, w, c)
  return methods


def _compile_counts(topology, fn, args) -> tuple[int, int]:
  mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
  placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=placed) for a in args]
  with jax.default_device(topology.devices[0]):
    compiled = jax.jit(fn).lower(*specs).compile()
  return entry_ops(compiled.as_text())


def deviceless_counts(targets=DEVICELESS_TARGETS, moe: bool = True) -> list[OpCount]:
  """Compiles the decode gmm (and the decode MoE FFN) for each target without a device and
  counts ENTRY ops and kernel launches per method; a method that fails to compile gets a
  row with the error."""
  m, g, k, n = DECODE_GMM
  gmm_args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
              jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
              jax.ShapeDtypeStruct((g,), jnp.int32))
  tokens, experts, top_k, dim, mlp = DECODE_MOE
  moe_args = (jax.ShapeDtypeStruct((tokens, dim), jnp.bfloat16),
              jax.ShapeDtypeStruct((experts, dim, 2 * mlp), jnp.bfloat16),
              jax.ShapeDtypeStruct((experts, mlp, dim), jnp.bfloat16),
              jax.ShapeDtypeStruct((tokens, top_k), jnp.int32),
              jax.ShapeDtypeStruct((tokens, top_k), jnp.float32))
  gmm_name = f"gmm {m}x{k} @ {g}x{k}x{n}"
  moe_name = f"MoE T={tokens} E={experts} k={top_k} D={dim} F={mlp}"
  rows = []
  for target in targets:
    topology = _topology(target)
    problems = [(gmm_name, _gmm_methods(target), gmm_args)]
    if moe:
      problems.append((moe_name, {name: functools.partial(fn, max_rows=tokens)
                                  for name, fn in MOE_METHODS.items()}, moe_args))
    for problem, methods, args in problems:
      for name, fn in methods.items():
        if isinstance(fn, str):
          rows.append(OpCount(target, problem, name, None, None, fn))
          continue
        try:
          ops, kernels = _compile_counts(topology, fn, args)
        except Exception as err:  # a comparison library that cannot compile this case
          rows.append(OpCount(target, problem, name, None, None,
                              f"{type(err).__name__}: {str(err).splitlines()[0][:120]}"))
        else:
          rows.append(OpCount(target, problem, name, ops, kernels))
  return rows


def op_count_table(rows: list[OpCount]) -> str:
  lines = ["| target | problem | method | ENTRY ops | kernel launches | note |",
           "|---|---|---|---|---|---|"]
  for r in rows:
    show = lambda v: "-" if v is None else str(v)  # noqa: E731
    lines.append(f"| {r.target} | {r.problem} | {r.method} | {show(r.entry_ops)} | "
                 f"{show(r.kernels)} | {r.note} |")
  return "\n".join(lines)


def main(argv=None) -> list[Row]:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
  parser.add_argument("--experts", type=int, nargs="+", default=[64, 256])
  parser.add_argument("--top-k", type=int, default=8)
  parser.add_argument("--dim", type=int, nargs="+", default=[512], help="D = F")
  parser.add_argument("--dtype", default="float32")
  parser.add_argument("--number", type=int, default=20, help="calls per round")
  parser.add_argument("--rounds", type=int, default=5)
  parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
  parser.add_argument("--moe", action="store_true",
                      help="time an MoE layer's decode FFN (SwiGLU, F=D) instead: masked, "
                           "fused ragged gmm, ragged_dot")
  parser.add_argument("--deviceless", action="store_true",
                      help="compile for TPU v5e and H200 without a device and count the "
                           "ENTRY ops and kernel launches of the decode gmm and MoE FFN")
  parser.add_argument("--targets", nargs="+", default=list(DEVICELESS_TARGETS),
                      choices=DEVICELESS_TARGETS, help="with --deviceless")
  args = parser.parse_args(argv)
  if args.deviceless:
    counts = deviceless_counts(tuple(args.targets))
    print(f"jax {jax.__version__}, deviceless")
    print(op_count_table(counts))
    return counts
  rows = []
  for dim in args.dim:
    for experts in args.experts:
      for tokens in args.tokens:
        if args.moe:
          rows += run_moe(tokens, experts, args.top_k, dim, dim, number=args.number,
                          rounds=args.rounds)
        else:
          rows += run(tokens, experts, args.top_k, dim, dim, number=args.number,
                      rounds=args.rounds, methods=tuple(args.methods),
                      dtype=jnp.dtype(args.dtype))
  print(f"jax {jax.__version__}, {jax.default_backend()}, {jax.devices()[0].device_kind}")
  print(table(rows))
  return rows


if __name__ == "__main__":
  main()
