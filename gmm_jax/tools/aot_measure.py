"""Times the deviceless table's programs on this machine's GPU, beside their modelled time.

``python -m gmm_jax.tools.aot_measure --rows benchmarks/modelled_gpu.json --target h200``
reads the rows `gmm_jax.tools.aot` wrote (``--json``; each GPU kernel with its modelled
seconds, `aot_model`), builds each case of that target with concrete operands (balanced
group sizes, in-range row indices, random values), runs it on the local GPU and prints,
per case, the modelled time (its kernels' modelled seconds summed) beside the measured one
(the median of ``--repeats`` runs of the whole jitted program, which also holds the few
non-gmm ops around the kernels), both as time and as useful TFLOP/s. A measured / modelled
ratio far from 1 says which of the model's assumptions (`aot_model.MMA_CEILING`, ...) the
device contradicts.
"""

from __future__ import annotations

import json
import pathlib
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from gmm_jax._src import cli
from gmm_jax.tools import deviceless
from gmm_jax.tools.aot_cases import CASES, MOE_TOP_K, SHAPES, build


def _define_flags() -> flags.FlagValues:
  fv = cli.flag_values()
  flags.DEFINE_string("rows", "benchmarks/modelled_gpu.json",
                      "the JSON rows of `gmm_jax.tools.aot --json`", flag_values=fv)
  flags.DEFINE_string("target", "h200", "the target whose rows this GPU measures",
                      flag_values=fv)
  flags.DEFINE_integer("repeats", 10, "timed runs per case (after 2 warm-up runs)",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("deviceless", False,
                    "compile each case for one chip of --target without the hardware "
                    "instead of timing it (the device script's dry run; NaN times)",
                    flag_values=fv)
  return fv


def concrete(case, args, seed: int = 0):
  """Concrete operands for the abstract ones of `build(case, ...)`: group sizes ``[G]``
  balanced over the grouped rows, other integer operands in-range row indices, floats
  random (cast to their dtype)."""
  m, k, _, g = SHAPES[case.shape]
  grouped = k if case.group_type == "k" and case.kind != "fp8-train" else m
  rng = np.random.default_rng(seed)

  def leaf(a):
    if a is None:
      return None
    if jnp.issubdtype(a.dtype, jnp.integer):
      if a.shape == (g,):
        sizes = np.full(g, grouped // g)
        sizes[: grouped % g] += 1
        return jnp.asarray(sizes, a.dtype)
      return jnp.asarray(np.arange(int(np.prod(a.shape))) % max(1, m // MOE_TOP_K),
                         a.dtype).reshape(a.shape)
    values = rng.standard_normal(a.shape, np.float32) * 0.1
    return jnp.asarray(values).astype(a.dtype)

  return jax.tree.map(leaf, args, is_leaf=lambda a: a is None)


def measure(case, repeats: int) -> float:
  """The median seconds of the case's program on the local GPU."""
  device = jax.devices()[0]
  mesh = jax.sharding.Mesh(np.array([device]), ("x",))
  sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
  fn, args = build(case, sharding)
  values = concrete(case, args)
  step = jax.jit(fn)
  for _ in range(2):
    jax.block_until_ready(step(*values))
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(step(*values))
    times.append(time.perf_counter() - start)
  return float(np.median(times))


def compile_only(target: str):
  """A `compare` timer that compiles each case for one chip of `target` (deviceless)
  instead of running it: NaN seconds."""
  def timer(case, repeats: int) -> float:
    del repeats
    device = deviceless.chip(target)
    fn, args = build(case, jax.sharding.SingleDeviceSharding(device))
    with jax.default_device(device):
      jax.jit(fn).lower(*args).compile()
    return float("nan")
  return timer


def compare(rows: list[dict], target: str, repeats: int, timer=measure) -> list[dict]:
  """Per case of `target` whose kernels all have a modelled time: the modelled and the
  measured seconds and useful TFLOP/s (`timer(case, repeats)` measures)."""
  by_name = {case.name: case for case in CASES}
  cases: dict[str, list[dict]] = {}
  for row in rows:
    if row["target"] == target and row["case"] in by_name:
      cases.setdefault(row["case"], []).append(row)
  results = []
  for name, kernels in cases.items():
    if any(not r.get("model_seconds") for r in kernels):
      continue
    modelled = sum(r["model_seconds"] for r in kernels)
    useful = sum(r["model_seconds"] * r["model_tflops"] * 1e12 for r in kernels)
    try:
      measured = timer(by_name[name], repeats)
    except Exception as err:  # noqa: BLE001  (one case failing is reported, the rest run)
      results.append(dict(case=name, gmms="+".join(r["gmm"] for r in kernels),
                          modelled_s=modelled, error=f"{type(err).__name__}: {err}"[:300]))
      continue
    results.append(dict(case=name, gmms="+".join(r["gmm"] for r in kernels),
                        modelled_s=modelled, measured_s=measured,
                        modelled_tflops=useful / modelled / 1e12,
                        measured_tflops=useful / measured / 1e12))
  return results


def table(results: list[dict]) -> str:
  """`compare`'s results as a Markdown table."""
  lines = ["| case | gmms | modelled ms | measured ms | measured / modelled | "
           "modelled TFLOP/s | measured TFLOP/s |", "|---|---|---|---|---|---|---|"]
  for r in results:
    if "error" in r:
      lines.append(f"| {r['case']} | {r['gmms']} | {1e3 * r['modelled_s']:.3f} | "
                   f"{r['error']} | | | |")
      continue
    lines.append(f"| {r['case']} | {r['gmms']} | {1e3 * r['modelled_s']:.3f} | "
                 f"{1e3 * r['measured_s']:.3f} | {r['measured_s'] / r['modelled_s']:.2f} | "
                 f"{r['modelled_tflops']:.0f} | {r['measured_tflops']:.0f} |")
  return "\n".join(lines)


def main(argv=None) -> int:
  """Prints the measured beside the modelled table for the flags of `argv`."""
  argv = sys.argv[1:] if argv is None else list(argv)
  args = cli.parse_flags(_define_flags(), "gmm-jax-aot-measure", argv, __doc__)
  rows = json.loads(pathlib.Path(args.rows).read_text())
  if args.deviceless:
    print(f"deviceless {args.target} (compiled, not run): the rows of {args.target} in "
          f"{args.rows}")
    results = compare(rows, args.target, args.repeats, compile_only(args.target))
  else:
    print(f"{jax.devices()[0].device_kind}: the rows of {args.target} in {args.rows}")
    results = compare(rows, args.target, args.repeats)
  print(table(results))
  if not results:
    print(f"no case of {args.target} with modelled times in {args.rows}")
    return 1
  return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
  cli.run(main)
