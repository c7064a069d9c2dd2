"""The accelerators' fallback, measured without the hardware: what XLA compiles the XLA
path (`xla`) and `jax.lax.ragged_dot_general` (`lax_ragged_dot`) into on an H200 and a TPU
v5e, for calls no Pallas kernel serves.

For each target, shape, dtype and mode (forward, or forward and both gradients) it lowers
``gmm(..., implementation=NAME)`` for the target (a deviceless compile: the target's
topology, ``jax.default_device``) and reads from the compiled program: its temporaries
(``memory_analysis()``), its kernels (custom calls: Mosaic TPU, Pallas; and the gemm
fusions XLA:GPU emits with Triton or cuBLAS), its while loops and dots, the flops of its
HLO dots (each loop body once, so a lower bound for the XLA path's loops; a densified
ragged dot shows G times the grouped work) and XLA's own flop estimate where it gives one
(TPU). Plain ``jax.lax.ragged_dot`` is measured beside
them (``implementation="jax.lax.ragged_dot"``: no epilogue, no gmm op).

Needs jax >= 0.12 with the CUDA plugin and libtpu (see docs/kernels.md, "Compiled for real
targets"); run with ``JAX_PLATFORMS=cpu``::

  python -m gmm_jax.tools.bench_fallback                    # every target, case, dtype, mode
  python -m gmm_jax.tools.bench_fallback --targets h200 --cases g8 --dtypes bfloat16
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import json
import pathlib
import re
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import topologies

import gmm_jax
from gmm_jax.tools import deviceless
from gmm_jax._src.backends import registry

# The targets of `gmm_jax.tools.aot` this compares on.
TARGETS = {name: deviceless.TARGETS[name] for name in ("h200", "v5e")}
# (M, K, N, G): rows grouped, contraction, columns, groups (balanced sizes).
CASES = {
    "g8": (4096, 1024, 2048, 8),        # eight groups of 512 rows
    "moe": (8192, 2048, 1408, 64),      # DeepSeek-MoE-like: 4096 tokens x top-2, 64 experts
    "small-g": (2048, 1024, 1024, 2),   # few groups
}
IMPLEMENTATIONS = ("xla", "lax_ragged_dot", "jax.lax.ragged_dot")
# The TPU's own kernel, for scale, where it is the default.
KERNELS = {"tpu": ("pallas_tpu",), "gpu": ()}
MODES = ("fwd", "fwd+bwd")


@dataclasses.dataclass
class Row:
  """One compiled program."""

  target: str
  case: str
  dtype: str
  mode: str
  implementation: str
  served: str = ""          # the implementations the dispatcher chose, forward and backward
  temp_mb: float = 0.0      # temporaries, MB (1e6 bytes)
  custom_calls: str = ""    # custom-call targets and gemm fusion kinds, with counts
  whiles: int = 0
  dots: int = 0
  dot_gflop: float = 0.0    # of the HLO dots, each loop body counted once
  gflop: float = -1.0       # XLA's estimate (-1: none; GPU deviceless compiles give none)
  seconds: float = 0.0      # lowering + compile
  error: str = ""


def _program(implementation: str, mode: str):
  """f(x, w, sizes, cotangent) of one mode."""

  def forward(x, w, sizes):
    if implementation == "jax.lax.ragged_dot":
      return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32
                                ).astype(x.dtype)
    return gmm_jax.gmm(x, w, sizes, implementation=implementation)

  if mode == "fwd":
    return lambda x, w, sizes, cotangent: forward(x, w, sizes)

  def forward_and_gradients(x, w, sizes, cotangent):
    out, pullback = jax.vjp(lambda x, w: forward(x, w, sizes), x, w)
    return (out,) + pullback(cotangent)

  return forward_and_gradients


_CUSTOM_CALL = re.compile(r'custom_call_target="([^"]+)"')
# Fusions that XLA:GPU emits as a kernel of their own (Triton or cuBLAS gemms).
_FUSION_KIND = re.compile(r'"fusion_backend_config":\{"kind":"([^"]+)"')
# Buffer bookkeeping, not kernels.
_NOT_KERNELS = ("AllocateBuffer", "ConcatBitcast", "AssumeGatherIndicesInBound")
_SHAPE = re.compile(r"%?([\w.\-]+)(?: = |: )\w+\[([\d,]*)\]")
_DOT = re.compile(r"= \w+\[([\d,]*)\]\S* dot\(%?([\w.\-]+), [^)]*\),[^\n]*?"
                  r"lhs_contracting_dims=\{([\d,]*)\}")


def _dims(text: str) -> list[int]:
  return [int(d) for d in text.split(",") if d]


def _dot_gflop(text: str) -> float:
  """Flops of the HLO dots (2 x output elements x contraction), loop bodies once."""
  shapes = {name: _dims(dims) for name, dims in _SHAPE.findall(text)}
  flops = 0
  for out, lhs, contracting in _DOT.findall(text):
    lhs_shape = shapes.get(lhs, [])
    flops += 2 * int(np.prod(_dims(out))) * int(np.prod(
        [lhs_shape[c] for c in _dims(contracting) if c < len(lhs_shape)]))
  return flops / 1e9


def _count(pattern: str, text: str) -> int:
  return len(re.findall(pattern, text))


def measure(target: str, case: str, dtype: str, mode: str, implementation: str) -> Row:
  """Lowers and compiles one program for `target` and reads its figures."""
  row = Row(target, case, dtype, mode, implementation)
  m, k, n, g = CASES[case]
  topology = deviceless.topology_of(target)
  mesh = topologies.make_mesh(topology, (1,), ("x",))
  placed = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  args = [jax.ShapeDtypeStruct(shape, dt, sharding=placed) for shape, dt in (
      ((m, k), dtype), ((g, k, n), dtype), ((g,), jnp.int32), ((m, n), dtype))]
  start = time.perf_counter()
  try:
    with jax.default_device(topology.devices[0]), registry.record() as decisions:
      lowered = jax.jit(_program(implementation, mode)).lower(*args)
    compiled = lowered.compile()
  except Exception as err:  # noqa: BLE001  (a failed compile is a reported result)
    row.error = f"{type(err).__name__}: {err}"[:300]
    return row
  row.seconds = round(time.perf_counter() - start, 1)
  row.served = ",".join(sorted({d.implementation for d in decisions})) or "-"
  memory = compiled.memory_analysis()
  row.temp_mb = round(memory.temp_size_in_bytes / 1e6, 1) if memory is not None else -1.0
  text = compiled.as_text()
  calls = collections.Counter(name for name in _CUSTOM_CALL.findall(text)
                              if name not in _NOT_KERNELS)
  calls.update(_FUSION_KIND.findall(text))
  row.custom_calls = " ".join(f"{name}x{count}" for name, count in sorted(calls.items()))
  row.whiles = _count(r"\swhile\(", text)
  row.dots = _count(r"\s(?:dot|convolution)\(", text)  # XLA:TPU's dots are convolutions
  cost = compiled.cost_analysis()
  if isinstance(cost, (list, tuple)):  # older jax: one dict per program
    cost = cost[0] if cost else {}
  if cost and "flops" in cost:
    row.gflop = round(float(cost["flops"]) / 1e9, 1)
  row.dot_gflop = round(_dot_gflop(text), 1)
  return row


def markdown(rows: list[Row]) -> str:
  head = ("| target | case (M, K, N, G) | dtype | mode | implementation | served by | temp MB | "
          "kernels (custom calls, gemm fusions) | while | dot | HLO dot GFLOP | XLA GFLOP "
          "|\n|" + "---|" * 12)
  lines = [head]
  for r in rows:
    if r.error:
      lines.append(f"| {r.target} | {r.case} | {r.dtype} | {r.mode} | {r.implementation} | "
                   f"FAILED: {r.error} |||||||")
      continue
    lines.append(
        f"| {r.target} | {r.case} {CASES[r.case]} | {r.dtype} | {r.mode} | "
        f"{r.implementation} | {r.served} | {r.temp_mb:g} | {r.custom_calls or '-'} | "
        f"{r.whiles} | {r.dots} | {r.dot_gflop:g} | "
        f"{'-' if r.gflop < 0 else f'{r.gflop:g}'} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--targets", nargs="+", choices=list(TARGETS), default=list(TARGETS))
  parser.add_argument("--cases", nargs="+", choices=list(CASES), default=list(CASES))
  parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
  parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
  parser.add_argument("--implementations", nargs="+", default=None,
                      help="default: xla, lax_ragged_dot, jax.lax.ragged_dot and the "
                      "target's kernel")
  parser.add_argument("--json", type=pathlib.Path, default=None, help="also write the rows")
  args = parser.parse_args(argv)
  rows = []
  for target in args.targets:
    names = args.implementations or (IMPLEMENTATIONS + KERNELS[TARGETS[target][0]])
    for case in args.cases:
      for dtype in args.dtypes:
        for mode in args.modes:
          for name in names:
            row = measure(target, case, np.dtype(jnp.dtype(dtype)).name, mode, name)
            rows.append(row)
            print(markdown([row]).splitlines()[-1], flush=True)
  print(markdown(rows))
  if args.json is not None:
    args.json.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1))
  return 1 if any(r.error for r in rows) else 0


if __name__ == "__main__":
  sys.exit(main())
