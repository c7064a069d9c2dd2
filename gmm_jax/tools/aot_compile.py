"""Compiles one case of `gmm_jax.tools.aot` for one target and reports it as rows.

One `Row` per kernel launch (the implementation, its operands, tiles, grid and, on GPUs,
registers, spills, shared memory and tensor-core instructions) with the failures it shows,
and the rows as text: a line each and the Markdown table."""

from __future__ import annotations

import dataclasses
import math
import time

import jax
import numpy as np

from gmm_jax._src.backends import registry
from gmm_jax._src.tiling import tuning
from gmm_jax.tools.aot_cases import (FP8_MMA_TARGETS, ROLE_OF, SHAPES, TCGEN05_MIN_ROWS,
                                     TCGEN05_TARGETS, Case, build)
from gmm_jax.tools.aot_code import (CapturedOutput, code_report, has_fp8_mma, hlo_dot_cost,
                                    match_kernels, ptxas_report)
from gmm_jax.tools.aot_model import TARGET_KINDS, estimate, xla_estimate
from gmm_jax.tools.deviceless import TARGETS, topology_of


@dataclasses.dataclass
class Row:
  """One kernel launch of one compiled case."""

  target: str
  case: str
  gmm: str  # "fwd", "dlhs", "drhs" (in trace order)
  implementation: str
  operands: str = ""  # "<lhs values> x <rhs values> <quantized mode>"
  kernel: str = ""
  tiling: str = ""
  source: str = ""
  grid: str = ""
  registers: int | None = None
  spills: int | None = None
  smem: int | None = None
  vmem_limit: int | None = None
  # GPU: the kernel's tensor-core instructions ("wgmma e4m3.e4m3", ...; "-" none, "?" not
  # reported).
  mma: str = ""
  # GPU: the static model of the kernel (`aot_model.estimate`): useful TFLOP/s, its share
  # of the chip's dense peak, what bounds it and the programs an SM holds.
  model_tflops: float | None = None
  model_share: float | None = None
  model_bound: str = ""
  blocks_per_sm: int | None = None
  model_seconds: float | None = None
  seconds: float = 0.0
  status: str = "ok"
  error: str = ""


def _operands(problem) -> str:
  if problem is None:
    return ""
  names = lambda dtype: np.dtype(dtype).name.replace("float8_", "")  # noqa: E731
  return f"{names(problem.lhs_dtype)} x {names(problem.rhs_dtype)} {problem.quant_mode}"


def _compile(topology, fn, args):
  """Lowers and compiles `fn` on `args` under the topology's first device: (the dispatcher's
  decisions, the tile choices, the kernel launches, the compile's captured output (None
  where it failed), the error (None where it compiled), the compiled program's HLO text
  (empty where it failed))."""
  launches: list = []
  hlo = ""
  try:
    with jax.default_device(topology.devices[0]), registry.record() as decisions, \
        tuning.record() as choices, tuning.record_launches() as launches:
      lowered = jax.jit(fn).lower(*args)
    with CapturedOutput() as captured:
      compiled = lowered.compile()
    error = None
    hlo = compiled.as_text() or ""
  except Exception as err:  # noqa: BLE001  (a compile failure is a reported result)
    error = f"{type(err).__name__}: {err}"
    captured = None
  return decisions, choices, launches, captured, error, hlo


def _rows(target: str, case: Case, launches, choices, captured, seconds: float) -> list[Row]:
  """One `Row` per kernel launch, with what the compile's output says of its kernel."""
  platform = TARGETS[target][0]
  rows: list[Row] = []
  log = captured.text if captured is not None else ""
  stats = match_kernels(launches, ptxas_report(log), mosaic=False)
  codes = match_kernels(launches, code_report(log))
  for launch, stat, code in zip(launches, stats, codes):
    row = Row(target, case.name, ROLE_OF.get(launch.problem, "?"),
              launch.implementation, operands=_operands(launch.problem), kernel=launch.name,
              grid="x".join("dyn" if g < 0 else str(g) for g in launch.grid),
              vmem_limit=launch.vmem_limit, seconds=seconds)
    row.tiling = "x".join(str(v) for v in launch.tiles)
    choice = next((c for c in reversed(choices) if c.problem == launch.problem), None)
    row.source = choice.source if choice is not None else ""
    if platform == "gpu" and stat is not None:
      row.registers = stat["registers"]
      row.spills = stat["spills"]
      row.smem = stat["smem"]
    if platform == "gpu" and code is not None and code["smem"] is not None:
      row.smem = code["smem"]  # Triton's dynamic shared memory, told apart by thread
    if platform == "gpu" and captured is not None:
      # "-": the kernel's code holds no MMA instruction; "?": its code was not reported.
      row.mma = "?" if code is None else ", ".join(sorted(code["mma"])) or "-"
      _model(row, launch)
    rows.append(row)
  return rows


def _model(row: Row, launch) -> None:
  """Fills the row's modelled share of peak (`aot_model.estimate`) where it is known."""
  programs = math.prod(launch.grid) if all(g > 0 for g in launch.grid) else None
  model = estimate(launch.problem, launch.tiles, warps=launch.warps, registers=row.registers,
                   smem=row.smem, mma=row.mma, programs=programs)
  if model is not None:
    row.model_tflops, row.model_share = round(model.tflops, 1), round(model.share, 3)
    row.model_bound, row.blocks_per_sm = model.bound, model.blocks_per_sm
    row.model_seconds = model.seconds


def _xla_row(target: str, case: Case, hlo: str, error: str | None, seconds: float) -> Row:
  """The one row of a program on `jax.lax.ragged_dot` (XLA's own kernels): its gmms
  together, modelled from the FLOPs and bytes of the compiled program's dots
  (`aot_code.hlo_dot_cost`, `aot_model.xla_estimate`)."""
  row = Row(target, case.name, "fwd+dlhs+drhs" if case.kind == "train" else "fwd",
            "lax_ragged_dot", kernel="(XLA)", seconds=seconds)
  if error:
    row.status, row.error = "FAIL", error[:2000]
    return row
  m, k, n, _ = SHAPES[case.shape]
  useful = 2.0 * m * k * n * (3 if case.kind == "train" else 1)
  flops, moved = hlo_dot_cost(hlo)
  model = xla_estimate(TARGET_KINDS[target], np.dtype(case.dtype), useful, flops, moved)
  if model is not None:
    row.model_tflops, row.model_share = round(model.tflops, 1), round(model.share, 3)
    row.model_bound, row.model_seconds = model.bound, model.seconds
  return row


def _problems(target: str, case: Case, rows: list[Row], served: list[str], launched: bool,
              error: str | None) -> list[str]:
  """What fails the case: the compile error, a gmm served by the XLA path, no kernel, a
  spill, a kernel of an ``fp8_mma`` case without fp8 MMA instructions, a kernel of 64 rows
  or more per tile without tcgen05.mma on Blackwell (`TCGEN05_TARGETS`)."""
  platform = TARGETS[target][0]
  problems = []
  if error:
    problems.append(error)
  if any(name in ("xla", "reference") for name in served):
    problems.append(f"a gmm fell back to the XLA path on {platform}: {served}")
  if not launched and not error:
    problems.append("no kernel was launched")
  for row in rows:
    if row.spills:
      problems.append(f"{row.kernel} spills {row.spills} bytes")
    if (case.fp8_mma and target in FP8_MMA_TARGETS and not error and row.mma != "?"
        and not has_fp8_mma(row.mma)):
      problems.append(f"{row.kernel} ({row.gmm}) holds no fp8 MMA instruction: "
                      f"{row.mma or 'none found'}")
    if (target in TCGEN05_TARGETS and not error and row.mma not in ("", "?")
        and int(row.tiling.split("x")[0]) >= TCGEN05_MIN_ROWS and "tcgen05" not in row.mma):
      problems.append(f"{row.kernel} ({row.gmm}, tiles {row.tiling}) holds no tcgen05.mma: "
                      f"{row.mma}")
  return problems


def compile_case(target: str, case: Case) -> list[Row]:
  """Lowers and compiles one case for one target; one `Row` per kernel launch."""

  topology = topology_of(target)
  mesh = jax.sharding.Mesh(np.array(topology.devices[:1]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  start = time.perf_counter()
  fn, args = build(case, sharding)
  ROLE_OF.clear()
  decisions, choices, launches, captured, error, hlo = _compile(topology, fn, args)
  seconds = time.perf_counter() - start
  if case.implementation == "lax_ragged_dot":
    return [_xla_row(target, case, hlo, error, seconds)]
  rows = _rows(target, case, launches, choices, captured, seconds)
  served = [d.implementation for d in decisions]
  problems = _problems(target, case, rows, served, bool(launches), error)
  if problems:
    if not rows:
      rows.append(Row(target, case.name, "-", ",".join(served) or "-", seconds=seconds))
    for row in rows:
      row.status, row.error = "FAIL", "; ".join(problems)[:2000]
  return rows


def row_line(row: Row) -> str:
  """A row as one line of the compile's output (and its error on the next)."""
  stats = ""
  if row.registers is not None:
    stats = f" regs={row.registers} spills={row.spills} smem={row.smem}"
  if row.vmem_limit:
    stats += f" vmem_limit={row.vmem_limit}"
  if row.mma:
    stats += f" mma=[{row.mma}]"
  if row.model_share is not None:
    resident = "" if row.blocks_per_sm is None else f", {row.blocks_per_sm}/SM"
    stats += (f" model={row.model_tflops} TFLOP/s ({100 * row.model_share:.0f}% of peak, "
              f"{row.model_bound}{resident})")
  operands = f" [{row.operands}]" if row.operands else ""
  text = (f"[{row.status}] {row.target} {row.case} {row.gmm}: {row.implementation}{operands} "
          f"{row.kernel} tiles={row.tiling} ({row.source}) grid={row.grid}{stats} "
          f"{row.seconds:.1f}s")
  return text + (f"\n    {row.error}" if row.error else "")


def markdown(rows: list[dict]) -> str:
  """The results as a Markdown table."""
  head = ("| target | case | gmm | implementation | operands | kernel | tiles (m x k x n) | "
          "tile source | grid | registers | spills (B) | shared memory (B) | VMEM limit (B) | "
          "MMA instructions | modelled TFLOP/s | % of peak | bound | blocks / SM | "
          "compile s | status |")
  lines = [head, "|" + "---|" * 20]
  blank = lambda v: "" if v is None else str(v)
  share = lambda v: "" if v is None else f"{100 * v:.0f}%"
  for r in rows:
    lines.append(
        f"| {r['target']} | {r['case']} | {r['gmm']} | {r['implementation']} | "
        f"{r.get('operands', '')} | {r['kernel']} | "
        f"{r['tiling']} | {r['source']} | {r['grid']} | {blank(r['registers'])} | "
        f"{blank(r['spills'])} | {blank(r['smem'])} | {blank(r['vmem_limit'])} | "
        f"{r.get('mma', '')} | {blank(r.get('model_tflops'))} | "
        f"{share(r.get('model_share'))} | {r.get('model_bound', '')} | "
        f"{blank(r.get('blocks_per_sm'))} | {r['seconds']:.1f} | {r['status']} |")
  return "\n".join(lines) + "\n"
