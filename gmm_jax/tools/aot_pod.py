"""Compiles whole MoE training steps for multi-chip TPU and GPU topologies without the hardware.

``python -m gmm_jax.tools.aot_pod`` (also ``python -m gmm_jax.tools.aot --pod``) builds, per (model,
topology, strategy), one training step of a `gmm_jax.nn.MoE` layer as a user writes it:
`nnx.split` the layer, ``loss = mean(y**2) + 0.01 * load balancing + 0.001 * z-loss``,
`jax.value_and_grad` over the parameters, an SGD update; bf16 parameters and compute,
4096 tokens per chip sharded over the mesh's ("data", "expert") axes, the expert kernels'
leading dim sharded over "expert", every other parameter (the router, shared experts)
replicated. It lowers and compiles the step (`jax.jit` with ``in_shardings`` and
``out_shardings``, the parameters donated) deviceless for the topology, and prints a row per
step: whether it compiled (or the first line of the error), the compile time, per-device
memory (arguments, outputs, temporaries, and the peak ``args + out + temp - aliased``)
against the chip's HBM, the bytes of each kind of collective, the bytes of all-gathers whose
result is a whole expert weight (a step that gathers its experts does not scale), the gmm
implementations the dispatcher chose and the kernel custom calls in the compiled program.

Strategies:
  default:  ``nn.MoE(...)`` with no mesh arguments under plain jit (the fused path).
  default+set_mesh: the same step, the layer built (``nnx.eval_shape``) and the step traced
            under ``jax.set_mesh(mesh)`` (Auto axes).
  ep:       ``nn.MoE(expert_parallel=(mesh, "expert"), data_parallel=(mesh, ("data",
            "expert")))``: expert parallelism through `gmm_jax.routed_apply`.
  default+blind: the default step given abstract arguments without their sharding (only
            jit's ``in_shardings`` place them), so that the trace sees no mesh: on TPU each
            gmm runs as the dense reference that XLA partitions, elsewhere the routed
            experts are split by their partitioning rule.
  explicit: the mesh's axes Explicit, the layer built (``nnx.eval_shape``) and the step
            traced under ``jax.set_mesh(mesh)``: the layout is in the types.
  unfused:  ``nn.MoE(fused=False)`` under plain jit (sorted copies, gate and up as two gmms).
  grouped_linear: the gradients of one ``nn.GroupedLinear`` of the expert input kernel's
            shape on the tokens as E equal groups, under plain jit.
  default+a2a, ep+a2a: default / ep with ``transport="all_to_all"`` (fixed buffers; libtpu's
            ragged all-to-all refuses TPU slices with limited ICI routing, e.g. v5e 8x8).
  default+fp8, unfused+fp8: default / unfused with ``quantization="fp8"`` (the experts'
            gmms trained in fp8, `gmm_jax.Fp8Training`).
  ragged_dot: a baseline without gmm_jax: the same MoE math (router, top-k, tokens sorted by
            expert, ``jax.lax.ragged_dot`` for both projections, shared expert) written here.

Buffer factor (``--buffer-factor``, the gmm_jax strategies): ``nn.MoE(buffer_factor=b)``,
the expert-parallel receive buffers bounded to ``ceil(b * T_shard * k / D)`` rows per source
device (rows past it dropped); ``none`` (the default) is the dropless worst case. Several
values give a row each; the table names a step with a factor ``ep@b=1``.

Mesh: ("data", "expert") with expert = min(#experts, #chips) (``--expert`` overrides it) and
data = #chips / expert: every chip holds E / expert whole experts; tokens are split over all
chips.

Each step compiles in a process of its own, with a time limit (``--timeout``), so that a
hang or a crash is one row of the table. Collective bytes are the result sizes of the
collectives in the compiled program, each counted once where it appears (a collective in a
loop body is not multiplied by the trip count); the async forms count at their ``-done``.

Needs jax >= 0.12 with libtpu (TPU topologies) and the CUDA plugin (GPU topologies), and
flax; ``bash .ci/aot_env.sh`` prints such a virtual environment. Run with
``JAX_PLATFORMS=cpu``.

Usage::

  python -m gmm_jax.tools.aot_pod --small                          # the CI configuration
  python -m gmm_jax.tools.aot_pod --models mixtral --topologies v5e:2x2 h200:1x1x8
  python -m gmm_jax.tools.aot_pod --small --require ep unfused ragged_dot --json rows.json
  python -m gmm_jax.tools.aot_pod --topologies v5e:4x4 --strategies ep --buffer-factor none 1
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from absl import flags

from gmm_jax._src import cli
from gmm_jax.tools import deviceless
from gmm_jax.tools.aot_pod_compile import (Row, compile_step, failures, markdown, row_label,
                                           row_line)
from gmm_jax.tools.aot_pod_steps import (DEFAULT_MODELS, DEFAULT_STRATEGIES, MODELS,
                                         SMALL_MODELS, STRATEGIES, parse_buffer_factor, steps)
from gmm_jax.tools.deviceless import DEFAULT_TOPOLOGIES, SMALL_TOPOLOGIES, TOPOLOGIES

_CHILD_ENV = "GMM_JAX_AOT_POD_CHILD"


# ----------------------------------------------------------------------------- running


def _define_flags() -> flags.FlagValues:
  fv = cli.flag_values()
  flags.DEFINE_multi_enum("models", list(DEFAULT_MODELS), list(MODELS), "the MoE layers",
                          flag_values=fv)
  flags.DEFINE_multi_enum("topologies", list(DEFAULT_TOPOLOGIES), list(TOPOLOGIES),
                          "the topologies", flag_values=fv)
  flags.DEFINE_multi_enum("strategies", list(DEFAULT_STRATEGIES), list(STRATEGIES),
                          "the ways of writing the step (the module's docstring)",
                          flag_values=fv)
  flags.DEFINE_bool("small", False, "the CI configuration: the small models on "
                    f"{', '.join(SMALL_TOPOLOGIES)} (unless --models / --topologies say)",
                    flag_values=fv)
  flags.DEFINE_multi_string(
      "buffer-factor", ["none"], "nn.MoE(buffer_factor=...) of the gmm_jax strategies: the "
      "expert-parallel receive buffers in units of the expected rows per source device; none: "
      "dropless (the worst case); several values: a step each", flag_values=fv)
  flags.register_validator("buffer-factor", _valid_buffer_factors,
                           "a buffer factor is a positive number or none", flag_values=fv)
  flags.DEFINE_integer("expert", None, "the expert axis size (default: min(#experts, #chips))",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_integer("timeout", 1800, "seconds one step may take to compile", lower_bound=1,
                       flag_values=fv)
  flags.DEFINE_integer("jobs", 1, "steps compiled at once (each in its own process)",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_multi_enum("require", [], list(STRATEGIES),
                          "exit 1 unless every step of these strategies compiles (and, for "
                          "the gmm_jax ones, gathers no expert weight)", flag_values=fv)
  flags.DEFINE_string("json", None, "write the rows as JSON here", flag_values=fv)
  flags.DEFINE_string("markdown", None, "write the Markdown table here", flag_values=fv)
  # Internal: a compile process writes its one row here.
  flags.DEFINE_string("child_json", None, "(internal) run as a compile process",
                      flag_values=fv)
  return fv


def _valid_buffer_factors(values) -> bool:
  try:
    for value in values:
      parse_buffer_factor(value)
  except ValueError:
    return False
  return True


def child_flags(out, model: str, topology: str, strategy: str, buffer_factor: float | None,
                expert: int | None) -> list[str]:
  """The flags of the compile process of one step, which writes its row to `out`."""
  factor = "none" if buffer_factor is None else repr(buffer_factor)  # repr: exact
  flags_ = ["--child_json", str(out), "--models", model, "--topologies", topology,
            "--strategies", strategy, f"--buffer-factor={factor}"]
  return flags_ if expert is None else flags_ + ["--expert", str(expert)]


def _run_one(model: str, topology: str, strategy: str, buffer_factor: float | None,
             expert: int | None, timeout: int) -> dict:
  """Compiles one step in a process of its own; a hang or crash becomes a row."""
  with tempfile.TemporaryDirectory() as tmp:
    out, log = pathlib.Path(tmp) / "row.json", pathlib.Path(tmp) / "log.txt"
    command = [sys.executable, "-m", "gmm_jax.tools.aot_pod",
               *child_flags(out, model, topology, strategy, buffer_factor, expert)]
    start = time.perf_counter()
    with open(log, "wb") as stderr:
      proc = subprocess.Popen(command, env=deviceless.child_env(_CHILD_ENV), stdout=stderr,
                              stderr=stderr, start_new_session=True)
      try:
        code = proc.wait(timeout=timeout)
      except subprocess.TimeoutExpired:
        os.killpg(proc.pid, 9)  # the compile process and anything it started
        proc.wait()
        code = None
    if out.exists():
      return json.loads(out.read_text())
    row = Row(model, topology, strategy, buffer_factor, seconds=time.perf_counter() - start,
              hbm_bytes=TOPOLOGIES[topology].hbm)
    if code is None:
      row.status, row.error = "timeout", f"no result in {timeout} s"
    else:
      tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()]
      row.status = "FAIL"
      row.error = f"compile process exited {code}: {tail[-1] if tail else ''}"[:400]
      row.detail = "\n".join(tail[-30:])[-3000:]
    return dataclasses.asdict(row)


def main(argv=None) -> int:
  """Compiles the steps of command-line flags `argv` (without the program name; None:
  sys.argv[1:]); prints a line per step and the Markdown table. Returns the exit status."""
  args = cli.parse_flags(_define_flags(), "python -m gmm_jax.tools.aot_pod",
                         sys.argv[1:] if argv is None else argv, __doc__)
  models, topologies_ = args.models, args.topologies
  if args.small:
    models = models if args["models"].present else list(SMALL_MODELS)
    topologies_ = topologies_ if args["topologies"].present else list(SMALL_TOPOLOGIES)
  factors = [parse_buffer_factor(value) for value in args["buffer-factor"].value]
  if args.child_json:
    row = compile_step(models[0], topologies_[0], args.strategies[0], args.expert, factors[0])
    pathlib.Path(args.child_json).write_text(json.dumps(dataclasses.asdict(row)))
    return 0
  todo = steps(models, topologies_, args.strategies, factors)
  bar = cli.Progress(len(todo), cli.show_progress(args))
  bar.begin(f"compiling {len(todo)} training steps")
  start = time.perf_counter()
  rows = []
  with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
    futures = [pool.submit(_run_one, *step, args.expert, args.timeout) for step in todo]
    for future in concurrent.futures.as_completed(futures):
      row = future.result()
      rows.append(row)
      bar.print(row_line(row))
      bar.advance(f"{row['model']} {row['topology']} {row_label(row)}")
  bar.close()
  order = {key: i for i, key in enumerate(todo)}
  rows.sort(key=lambda r: order[(r["model"], r["topology"], r["strategy"],
                                 r["buffer_factor"])])
  failed = failures(rows, tuple(args.require))
  compiled = sum(r["status"] == "ok" for r in rows)
  summary = [f"{compiled} of {len(rows)} training steps compiled in "
             f"{time.perf_counter() - start:.0f} s", *(f"REQUIRED: {line}" for line in failed)]
  deviceless.report(rows, markdown(rows), summary, args.json, args.markdown)
  return 1 if failed else 0


def run():
  """``python -m gmm_jax.tools.aot_pod``."""
  cli.run(main)


if __name__ == "__main__":
  run()
