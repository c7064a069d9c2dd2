"""Side-by-side benchmark of gmm against jax.lax.ragged_dot, a dense matmul and a batched matmul.

    python -m gmm_jax.tools.bench                      # the full CPU table of benchmarks/log.md
    python -m gmm_jax.tools.bench --m 2048 --kn 1024 --groups 8 64 --dtypes float32
    python -m gmm_jax.tools.bench --platform gpu       # the GPU table: MoE shapes, TFLOP/s

(``gmm-jax-bench`` is the same command.) ``--platform`` defaults to the machine's
(``jax.default_backend()``): cpu, gpu or tpu. A repeated flag takes its values after one
name, comma-separated, or by repeating it (``--groups 8 64``, ``--groups=8,64``,
``--groups=8 --groups=64``). ``--progress`` (default: when stderr is a terminal) shows a
progress bar on stderr.

GPU / TPU mode (``--platform gpu`` or ``tpu``) times, for bf16 MoE shapes (Mixtral-like
M=16384 K=4096 N=14336 G=8, DeepSeek-like M=8192 K=2048 N=1408 G=64, decode M=64; balanced
and skewed routing), gmm as the dispatcher picks it, jax.lax.ragged_dot, a dense matmul of the same
FLOPs (the roofline proxy) and tokamax's ragged_dot when tokamax is importable, and prints
TFLOP/s and ratios. With ``--interpret`` it runs the kernels in interpret mode (a CPU check
of the script itself).

``--proxies`` prints the static proxies of the kernels instead (no timing, any machine):
wasted MMA rows / useful rows, modelled HBM bytes / ideal bytes, and grid steps, per kernel,
MoE shape and routing distribution.

Every row times, in one process and interleaved, for the same M, K, N, G and dtype:
  gmm      gmm(implementation=...) (default "xla")
  ragged   jax.lax.ragged_dot (skipped where it would take minutes: it does G times the work)
  dense    one [M, K] x [K, N] matmul: the same FLOPs
  batched  einsum("gmk,gkn->gmn") on [G, M/G, K] x [G, K, N]: the same FLOPs and the same
           weight bytes
  weights  the weight traffic no gmm avoids: reading the G weight matrices once (a sum over
           the groups); fwd+bwd: reading them twice and writing their gradient once
The floor is max(dense, weights): the dense product's FLOPs, or the weight traffic once the
G weight matrices dominate (many small groups). Ratios are to the floor, dense and batched;
"fwd+bwd" times the gradient w.r.t. lhs and rhs of sum(out * cotangent). Memory is the
compiled executable's temporary bytes.
"""

from __future__ import annotations

import sys

import jax
import jax.numpy as jnp
from absl import flags

from gmm_jax._src import cli
from gmm_jax.tools.bench_accel import (AUTOTUNE_HEADER, MOE_SHAPES, PROXY_HEADER,
                                       format_gpu_row, gpu_header, run_autotune, run_gpu_case,
                                       run_proxies)
from gmm_jax.tools.bench_host import (format_quant_row, format_row, format_sharding_rows, header,
                                      quant_header, run_case, run_quant_case,
                                      run_sharding_case)


def _shapes(args):
  """(M, K=N, G, sizes) of the grid (one group is never skewed)."""
  for m in args.m:
    for kn in args.kn:
      for num_groups in args.groups:
        for distribution in args.sizes:
          if not (num_groups == 1 and distribution == "skewed"):
            yield m, kn, num_groups, distribution


PLATFORM_DEFAULTS = {
    "cpu": dict(dtypes=["float32", "bfloat16"], m=[2048, 8192], kn=[1024, 2048],
                groups=[1, 8, 64, 256], implementation="xla", repeats=5),
    "gpu": dict(dtypes=["bfloat16"], m=[], kn=[], groups=[], implementation=None,
                repeats=10),
    # TPUs get the accelerator table of the GPUs: MoE shapes, the dispatcher's choice.
    "tpu": dict(dtypes=["bfloat16"], m=[], kn=[], groups=[], implementation=None,
                repeats=10),
}


# ------------------------------------------------------------------------ command line


def _define_flags() -> flags.FlagValues:
  """This command's flags, in a FlagValues of their own (none are registered globally)."""
  fv = cli.flag_values()
  flags.DEFINE_enum(
      "platform", "auto", ["auto", *sorted(PLATFORM_DEFAULTS)],
      "which table: cpu (vs batched/dense/ragged, temp memory) or gpu/tpu (MoE shapes, "
      "TFLOP/s vs dense/ragged/tokamax); sets the defaults of --dtypes, --m, --kn, --groups, "
      "--implementation and --repeats. auto (default): jax.default_backend()",
      flag_values=fv)
  flags.DEFINE_multi_string("dtypes", None, "dtypes (default: float32 bfloat16 on cpu, "
                            "bfloat16 on gpu/tpu)", flag_values=fv)
  flags.DEFINE_multi_integer("m", None, "rows (tokens)", flag_values=fv)
  flags.DEFINE_multi_integer("kn", None, "K = N (square shapes)", flag_values=fv)
  flags.DEFINE_multi_integer("groups", None, "number of groups G", flag_values=fv)
  flags.DEFINE_multi_enum("sizes", ["balanced", "skewed"], ["balanced", "skewed"],
                          "group size distributions", flag_values=fv)
  flags.DEFINE_multi_enum("modes", ["fwd", "fwd+bwd"], ["fwd", "fwd+bwd"],
                          "forward, and forward + the gradient", flag_values=fv)
  flags.DEFINE_string("implementation", None, "gmm's implementation (default: xla on cpu, "
                      "the dispatcher's choice on gpu/tpu)", flag_values=fv)
  flags.DEFINE_multi_enum("shapes", None, sorted(MOE_SHAPES),
                          "gpu/tpu table: the MoE shapes (default all; --m/--kn/--groups add "
                          "square ones)", flag_values=fv)
  flags.DEFINE_integer("repeats", None, "timed runs per candidate (the minimum is kept)",
                       lower_bound=1, flag_values=fv)
  flags.DEFINE_bool("interpret", False,
                    "run Pallas kernels in interpret mode (gpu table on a CPU)", flag_values=fv)
  flags.DEFINE_string("deviceless", None,
                      "gpu table and --autotune: compile every program for one chip of this "
                      "target (h100, h200, b200: `gmm_jax.tools.deviceless`) instead of "
                      "timing it, on a machine without it (the device script's dry run)",
                      flag_values=fv)
  flags.DEFINE_bool("proxies", False,
                    "the kernels' static proxies instead (no timing): MMA rows / useful rows, "
                    "modelled HBM bytes / ideal, grid steps, on the gpu shapes", flag_values=fv)
  flags.DEFINE_bool("autotune", False,
                    "run gmm_jax.autotune on the shapes (the --platform gpu shapes by default) "
                    "and write its cache; prints the tilings it chose", flag_values=fv)
  flags.DEFINE_bool("sharding", False,
                    "the sharding table instead: weak scaling over 1-8 host CPU devices "
                    "(expert-parallel gmm and routed all_to_all), bytes communicated",
                    flag_values=fv)
  flags.DEFINE_bool("quant", False,
                    "the quantized table instead: weight-only int8/int4/fp8 and w8a8 gmm "
                    "against bf16 and f32 gmm", flag_values=fv)
  return fv


def _jobs(args, gpu: bool, square_given: bool):
  """The work items of the chosen table: (header, [(label, () -> rows)])."""
  if args.sharding:
    head = ("| pattern | devices | mode | ms | MiB communicated per device | by collective "
            "(MiB) |\n|---|---|---|---|---|---|")
    return head, [
        (f"{pattern} x{devices}",
         lambda p=pattern, d=devices: format_sharding_rows(d, p, run_sharding_case(
             d, p, repeats=args.repeats)))
        for pattern in ("expert", "expert-jit", "ragged_dot-jit", "routed")
        for devices in (1, 2, 4, 8) if devices <= len(jax.devices())]
  if args.quant:
    implementation = None if args.implementation == "xla" else args.implementation
    return quant_header(), [
        (f"M={m} K=N={kn} G={g} {dist}",
         lambda c=(m, kn, g, dist): [format_quant_row(row) for row in run_quant_case(
             *c, args.modes, implementation, args.repeats, args.interpret)])
        for m, kn, g, dist in _shapes(args)]
  if args.proxies:
    square = [(m, kn, kn, g) for m in args.m for kn in args.kn for g in args.groups
              ] if square_given else []
    shapes = list(args.shapes or ([] if square else MOE_SHAPES)) + square
    return PROXY_HEADER, [("proxies", lambda: run_proxies(shapes, args.sizes))]
  square = [(m, kn, kn, g) for m in args.m for kn in args.kn for g in args.groups]
  shapes = list(args.shapes or ([] if square else MOE_SHAPES)) + square
  name = lambda shape: shape if isinstance(shape, str) else "x".join(map(str, shape))
  if args.autotune:
    return AUTOTUNE_HEADER, [
        (f"autotune {dtype} {name(shape)}",
         lambda d=dtype, s=shape: run_autotune([s], jnp.dtype(d), "fwd+bwd" in args.modes,
                                               args.repeats, args.interpret,
                                               args.implementation,
                                               deviceless_target=args.deviceless))
        for dtype in args.dtypes for shape in shapes]
  if gpu:
    return gpu_header(), [
        (f"{dtype} {name(shape)} {dist}",
         lambda c=(dtype, shape, dist): [format_gpu_row(row) for row in run_gpu_case(
             jnp.dtype(c[0]), c[1], c[2], args.modes, args.implementation, args.repeats,
             args.interpret, deviceless_target=args.deviceless)])
        for dtype in args.dtypes for shape in shapes for dist in args.sizes]
  return header(), [
      (f"{dtype} M={m} K=N={kn} G={g} {dist}",
       lambda c=(dtype, m, kn, g, dist): [format_row(row) for row in run_case(
           jnp.dtype(c[0]), *c[1:], args.modes, args.implementation, args.repeats)])
      for dtype in args.dtypes for m, kn, g, dist in _shapes(args)]


def main(argv=None) -> int:
  """Runs the benchmark for command-line flags `argv` (without the program name; None:
  sys.argv[1:]) and prints its Markdown table on stdout."""
  args = cli.parse_flags(_define_flags(), "gmm-jax-bench",
                         sys.argv[1:] if argv is None else argv, __doc__)
  square_given = args.m is not None  # --m/--kn/--groups add square shapes to the MoE ones
  if args.sharding:  # before jax starts its CPU backend (a running one keeps its devices)
    try:
      jax.config.update("jax_num_cpu_devices", 8)
    except RuntimeError:
      pass
  platform = args.platform
  if platform == "auto":
    platform = jax.default_backend()
    platform = platform if platform in PLATFORM_DEFAULTS else "cpu"
  for name, value in PLATFORM_DEFAULTS[platform].items():
    if getattr(args, name) is None:
      setattr(args, name, value)
  if args.deviceless:
    print(f"jax {jax.__version__}: every program compiled for one {args.deviceless} "
          "without the hardware (deviceless), nothing timed")
  else:
    print(f"jax {jax.__version__}, backend {jax.default_backend()}, "
          f"{jax.devices()[0].device_kind}; times are the minimum of {args.repeats} runs")
  head, jobs = _jobs(args, platform in ("gpu", "tpu"), square_given)
  print(head, flush=True)
  bar = cli.Progress(len(jobs), cli.show_progress(args))
  try:
    for label, job in jobs:
      bar.begin(label)
      for row in job():
        bar.print(row)
      bar.advance()
  finally:
    bar.close()
  return 0


def run():
  """The `gmm-jax-bench` console script (and ``python -m gmm_jax.tools.bench``)."""
  cli.run(main)


if __name__ == "__main__":
  run()
