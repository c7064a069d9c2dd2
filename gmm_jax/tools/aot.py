"""Compiles every gmm kernel variant for real accelerators without the hardware.

``python -m gmm_jax.tools.aot`` lowers and fully compiles (deviceless, ahead of time) the gmms of
MoE-shaped forward and training-step programs for one chip of each family by default,
NVIDIA H200 (sm_90a) and TPU v5e, on a CPU host; ``--targets all`` adds NVIDIA H100
(sm_90a), B200 (sm_100a), TPU v6e and TPU7x: the full run, made before a kernel or a
tile-table change lands. gmm picks its kernels itself: each program is traced under
``jax.default_device(<target device>)``, so the dispatcher serves the target's platform and
the tile tables its device kind. It prints one row per kernel launch: the implementation,
the operands it multiplies, the tiles and where they came from, the grid, and (GPU)
registers, spills and shared memory from ptxas and the tensor-core instructions of the
kernel's code ("mma": Triton's from the LLVM IR it hands to the PTX backend, Mosaic GPU's
from its PTX). A compile error, a register spill, shared-memory or VMEM overflow, a gmm
that falls back to the XLA path on an accelerator, (cases marked ``fp8_mma``) a Hopper
kernel without fp8 MMA instructions, or a B200 kernel of 64 or more rows per tile without
Blackwell's tcgen05.mma is a failure (exit status 1).

Needs jax >= 0.12 with the CUDA plugin (GPU targets) and libtpu (TPU targets); see
docs/kernels.md ("Compiled for real targets"). ``--setup DIR`` creates such a virtual
environment. Targets whose compiler this jax lacks are reported as skipped (or fail with
``--require``).

Usage::

  python -m gmm_jax.tools.aot                       # H200 and v5e, every case
  python -m gmm_jax.tools.aot --targets all         # every target: the full run
  python -m gmm_jax.tools.aot --targets b200 tpu7x  # B200 and TPU7x
  python -m gmm_jax.tools.aot --targets h200 v5e --cases mixtral-train
  python -m gmm_jax.tools.aot --list                # the cases
  python -m gmm_jax.tools.aot --json out.json --markdown table.md

``gmm-jax-aot`` is the same command. ``--targets`` and ``--cases`` take their values after
one name, comma-separated, or by repeating the flag; ``--progress`` (default: when stderr is
a terminal) shows a progress bar on stderr.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import queue
import subprocess
import sys
import tempfile
import threading
import time
import traceback

from absl import flags

from gmm_jax._src import cli
from gmm_jax.tools import deviceless
from gmm_jax.tools.aot_cases import CASES
from gmm_jax.tools.aot_compile import Row, compile_case, markdown, row_line
from gmm_jax.tools.deviceless import DEFAULT_TARGETS, TARGETS, topology_of

_CHILD_ENV = "GMM_JAX_AOT_CHILD"
_SPILL_FLAG = "--xla_gpu_fail_ptx_compilation_on_register_spilling=true"
# A compile process's line after each (target, case): the parent's progress bar counts them.
_DONE = "#done "


# ------------------------------------------------------------------------------- running


def _child(targets, cases, json_path):
  results = []
  for target in targets:
    try:
      topology_of(target)
    except Exception as err:  # noqa: BLE001  (no libtpu / CUDA plugin: many kinds)
      results.append(dataclasses.asdict(Row(target, "*", "-", "-", status="skipped",
                                            error=f"no {target} compiler: {err}"[:500])))
      for case in cases:
        if TARGETS[target][0] in case.platforms:
          print(f"{_DONE}{target} {case.name} (skipped)", flush=True)
      continue
    for case in cases:
      if TARGETS[target][0] not in case.platforms:
        continue
      try:
        rows = compile_case(target, case)
      except Exception:  # noqa: BLE001  (building the case failed: report, go on)
        rows = [Row(target, case.name, "-", "-", status="FAIL",
                    error=traceback.format_exc()[-2000:])]
      for row in rows:
        print(row_line(row), flush=True)
        results.append(dataclasses.asdict(row))
      print(f"{_DONE}{target} {case.name}", flush=True)
  pathlib.Path(json_path).write_text(json.dumps(results, indent=1))



def _child_env() -> dict[str, str]:
  env = deviceless.child_env(_CHILD_ENV)
  env["TF_CPP_MIN_LOG_LEVEL"] = "0"
  # ptxas's report: nvjitlink where the CUDA plugin links with nvJitLink (CUDA 12), and
  # subprocess_compilation where it runs a ptxas found on PATH (the CUDA 13 plugin of jax
  # 0.11-0.12); xtile_compiler: Triton's shared memory (2) and each Triton kernel's LLVM IR
  # (5), which `mma_report` reads.
  env["TF_CPP_VMODULE"] = "nvjitlink=3,subprocess_compilation=3,xtile_compiler=5"
  env["MOSAIC_GPU_DUMP_PTXAS"] = "1"
  env["MOSAIC_GPU_DUMP_PTX"] = "1"
  flags = env.get("XLA_FLAGS", "")
  if _SPILL_FLAG not in flags:
    env["XLA_FLAGS"] = (flags + " " + _SPILL_FLAG).strip()
  return env


def _define_flags() -> flags.FlagValues:
  """This command's flags, in a FlagValues of their own (none are registered globally)."""
  fv = cli.flag_values()
  flags.DEFINE_multi_enum("targets", list(DEFAULT_TARGETS), [*TARGETS, "all"],
                          "the targets to compile for (default: one chip per family; 'all': "
                          "every target, the full run)", flag_values=fv)
  flags.DEFINE_multi_enum("cases", [c.name for c in CASES], [c.name for c in CASES],
                          "the programs to compile (--list describes them)", flag_values=fv)
  flags.DEFINE_integer("jobs", 2, "compile processes (targets are split between them)",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_string("json", None, "write the rows as JSON here", flag_values=fv)
  flags.DEFINE_string("markdown", None, "write the Markdown table here", flag_values=fv)
  flags.DEFINE_bool("require", False,
                    "a target whose compiler is missing is a failure, not a skip", flag_values=fv)
  flags.DEFINE_bool("list", False, "list the cases and exit", flag_values=fv)
  # Internal: a compile process writes its rows here.
  flags.DEFINE_string("child_json", None, "(internal) run as a compile process",
                      flag_values=fv)
  return fv


def _read_lines(proc: subprocess.Popen, lines: queue.Queue):
  for line in proc.stdout:
    lines.put(line.rstrip("\n"))
  lines.put(None)


def _spawn(shards: list[list[str]], cases, tmp: str):
  """Starts a compile process for each shard of the targets: [(process, the JSON file of its
  rows)], and the queue of their output lines (None: one process's output ended)."""
  procs, lines = [], queue.Queue()
  for i, shard in enumerate(shards):
    out = pathlib.Path(tmp) / f"{i}.json"
    command = [sys.executable, "-m", "gmm_jax.tools.aot", "--child_json", str(out), "--targets",
               *shard, "--cases", *[c.name for c in cases]]
    proc = subprocess.Popen(command, env=_child_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    threading.Thread(target=_read_lines, args=(proc, lines), daemon=True).start()
    procs.append((proc, out))
  return procs, lines


def _compile_all(args, cases) -> list[dict]:
  """The rows of `cases` compiled for `args.targets` by up to `args.jobs` compile processes,
  printed as they come."""
  jobs = max(1, min(args.jobs, len(args.targets)))
  total = sum(TARGETS[t][0] in c.platforms for t in args.targets for c in cases)
  # Interleave GPU and TPU targets so that each process gets a mix.
  ordered = sorted(args.targets, key=lambda t: list(TARGETS).index(t))
  shards = [ordered[i::jobs] for i in range(jobs)]
  with tempfile.TemporaryDirectory() as tmp:
    procs, lines = _spawn(shards, cases, tmp)
    # The compile processes' rows as they come, and a bar counting the (target, case)s done.
    bar = cli.Progress(total, cli.show_progress(args))
    bar.begin(f"compiling for {', '.join(args.targets)}")
    running = len(procs)
    while running:
      line = lines.get()
      if line is None:
        running -= 1
      elif line.startswith(_DONE):
        bar.advance(line[len(_DONE):])
      else:
        bar.print(line)
    bar.close()
    rows = []
    for proc, out in procs:
      proc.wait()
      if out.exists():
        rows.extend(json.loads(out.read_text()))
      else:
        rows.append(dataclasses.asdict(Row("?", "?", "-", "-", status="FAIL",
                                           error=f"compile process exited {proc.returncode}")))
  return rows


def main(argv=None) -> int:
  """Compiles the cases for the targets of command-line flags `argv` (without the program
  name; None: sys.argv[1:]); prints one row per kernel launch and the Markdown table.
  Returns the exit status."""
  argv = sys.argv[1:] if argv is None else list(argv)
  if "--pod" in argv:  # whole MoE training steps on multi-chip topologies: gmm_jax.tools.aot_pod
    # (a command of its own: it needs flax and builds on gmm_jax.nn, a floor above this one)
    return subprocess.call([sys.executable, "-m", "gmm_jax.tools.aot_pod",
                            *(arg for arg in argv if arg != "--pod")])
  args = cli.parse_flags(_define_flags(), "gmm-jax-aot", argv,
                         __doc__)
  cases = [c for c in CASES if c.name in args.cases]
  if "all" in args.targets:
    args.targets = list(TARGETS)
  if args.list:
    for case in CASES:
      print(f"{case.name}: {case.describe()}")
    return 0
  if args.child_json:
    _child(args.targets, cases, args.child_json)
    return 0
  start = time.perf_counter()
  rows = _compile_all(args, cases)
  order = {t: i for i, t in enumerate(TARGETS)}
  names = [c.name for c in CASES]
  rows.sort(key=lambda r: (order.get(r["target"], 99),
                           names.index(r["case"]) if r["case"] in names else -1))
  failed = [r for r in rows if r["status"] == "FAIL"]
  skipped = [r for r in rows if r["status"] == "skipped"]
  summary = [f"{len(rows) - len(failed) - len(skipped)} kernel launches compiled, "
             f"{len(failed)} failed, {len(skipped)} targets skipped, in "
             f"{time.perf_counter() - start:.0f} s"]
  summary += [f"skipped {r['target']}: {r['error']}" for r in skipped]
  summary += [f"FAILED {r['target']} {r['case']}: {r['error']}" for r in failed]
  deviceless.report(rows, markdown(rows), summary, args.json, args.markdown)
  return 1 if failed or (skipped and args.require) else 0


def run():
  """The `gmm-jax-aot` console script (and ``python -m gmm_jax.tools.aot``)."""
  cli.run(main)


if __name__ == "__main__":
  run()
