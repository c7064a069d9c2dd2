"""The accelerator tables of `gmm_jax.tools.bench`: MoE shapes on the default device.

gmm as the dispatcher picks it against jax.lax.ragged_dot, a dense matmul of the same FLOPs
and tokamax's ragged_dot, in TFLOP/s (the GPU / TPU table); `gmm_jax.autotune` on the same
shapes; and the kernels' static proxies (their host-side models of a launch: no timing)."""

from __future__ import annotations

import dataclasses
import importlib

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax import autotune, gmm
from gmm_jax._src.backends import registry
from gmm_jax._src.core.config import GmmConfig, Problem
from gmm_jax._src.tiling import tuning
from gmm_jax.tools import deviceless
from gmm_jax.tools.bench_host import fmt, fwd_bwd, group_sizes, time_fn


def _tokamax_ragged_dot():
  try:
    import tokamax
  except ImportError:
    return None
  return getattr(tokamax, "ragged_dot", None)


def _gpu_candidates(dtype, implementation, interpret):
  acc = jnp.float32

  def ours(x, w, gs):
    return gmm(x, w, gs, implementation=implementation, interpret=interpret,
               preferred_element_type=dtype)

  def ragged(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=acc).astype(dtype)

  def dense(x, w, gs):
    del gs
    return jnp.matmul(x, w[0], preferred_element_type=acc).astype(dtype)

  fns = {"gmm": ours, "ragged": ragged, "dense": dense}
  tokamax_ragged_dot = _tokamax_ragged_dot()
  if tokamax_ragged_dot is not None:
    # In the operands' dtype, as gmm: tokamax's kernels accumulate in f32 themselves, and its
    # backward refuses a cotangent (an f32 result's) of another dtype than the weights.
    fns["tokamax"] = lambda x, w, gs: tokamax_ragged_dot(x, w, gs, preferred_element_type=dtype)
  return fns


# MoE shapes of the GPU table: name -> (M tokens x top-k rows, K, N, G).
MOE_SHAPES = {
    "mixtral": (16384, 4096, 14336, 8),
    "deepseek": (8192, 2048, 1408, 64),
    "decode": (64, 4096, 14336, 8),
}


@dataclasses.dataclass
class GpuRow:
  """One MoE shape, distribution and mode of the GPU table (seconds per candidate)."""

  shape: str
  m: int
  k: int
  n: int
  groups: int
  distribution: str
  mode: str
  seconds: dict
  error: float | None
  implementation: str = ""


def _operands(dtype, m, k, n, num_groups, distribution, seed, deviceless_target):
  """lhs, rhs, group sizes and a cotangent of one row (abstract, on one chip of a deviceless
  target, where one is given)."""
  if deviceless_target is not None:
    return deviceless.on_chip(deviceless_target, (
        jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((num_groups, k, n), dtype),
        jax.ShapeDtypeStruct((num_groups,), jnp.int32),
        jax.ShapeDtypeStruct((m, n), jnp.float32)))
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
  rhs = jnp.asarray(rng.standard_normal((num_groups, k, n), np.float32) / np.sqrt(k), dtype)
  sizes = jnp.asarray(group_sizes(m, num_groups, distribution, seed))
  cot = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.float32)
  return lhs, rhs, sizes, cot


def _check(fns, lhs, rhs, sizes, deviceless_target):
  """(gmm's implementations, its error against ragged_dot relative to the largest |ragged_dot|
  entry, both f32-accumulated); deviceless: the implementations the compile chose, no
  error."""
  if deviceless_target is not None:
    with registry.record() as decisions:
      deviceless.compile_for(deviceless_target, fns["gmm"], (lhs, rhs, sizes))
    return ",".join(sorted({d.implementation for d in decisions})), None
  want = jax.jit(fns["ragged"])(lhs, rhs, sizes).astype(jnp.float32)
  with registry.record() as decisions:
    got = jax.jit(fns["gmm"])(lhs, rhs, sizes).astype(jnp.float32)
  chosen = ",".join(sorted({d.implementation for d in decisions}))
  return chosen, float(jnp.max(jnp.abs(got - want))
                       / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))


def run_gpu_case(dtype, shape, distribution, modes=("fwd", "fwd+bwd"),
                 implementation=None, repeats=10, interpret=False, seed=0,
                 deviceless_target=None):
  """Times one MoE shape on the default device: gmm (the dispatcher's choice unless
  `implementation`), jax.lax.ragged_dot, a dense matmul of the same FLOPs and tokamax's
  ragged_dot when importable. Returns a `GpuRow` per mode (a candidate that fails to compile
  or run is recorded as None). With `deviceless_target` (a name of `deviceless.TARGETS`)
  every candidate is compiled for one chip of it instead (NaN seconds, no error)."""
  m, k, n, num_groups = MOE_SHAPES[shape] if isinstance(shape, str) else shape
  name = shape if isinstance(shape, str) else f"{m}x{k}x{n}x{num_groups}"
  lhs, rhs, sizes, cot = _operands(dtype, m, k, n, num_groups, distribution, seed,
                                   deviceless_target)
  fns = _gpu_candidates(dtype, implementation, interpret)
  chosen, error = _check(fns, lhs, rhs, sizes, deviceless_target)
  time_fn_of = (time_fn if deviceless_target is None
                else deviceless.compiling_timer(deviceless_target))
  out = []
  for mode in modes:
    seconds = {}
    for candidate, fn in fns.items():
      if mode == "fwd":
        compiled, args = jax.jit(fn), (lhs, rhs, sizes)
      else:
        compiled, args = jax.jit(fwd_bwd(fn)), (lhs, rhs, sizes, cot)
      try:
        seconds[candidate] = time_fn_of(compiled, args, repeats)
      except Exception as err:  # noqa: BLE001 - report and go on with the others
        print(f"# {candidate} {mode} {name} {distribution} failed: "
              f"{type(err).__name__}: {str(err)[:300]}", flush=True)
        seconds[candidate] = None
    out.append(GpuRow(name, m, k, n, num_groups, distribution, mode, seconds, error, chosen))
  return out


def gpu_header() -> str:
  return ("| shape | M | K | N | G | sizes | mode | gmm implementation | gmm ms | gmm TFLOP/s | "
          "dense TFLOP/s | gmm % of dense | ragged TFLOP/s | gmm / ragged speed | "
          "tokamax TFLOP/s | gmm / tokamax speed | rel. error vs ragged |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_gpu_row(row: GpuRow) -> str:
  flops = 2.0 * row.m * row.k * row.n * (3 if row.mode == "fwd+bwd" else 1)
  tflops = lambda name: (None if row.seconds.get(name) is None
                         else flops / row.seconds[name] / 1e12)
  ratio = lambda a, b: (None if row.seconds.get(a) is None or row.seconds.get(b) is None
                        else row.seconds[a] / row.seconds[b])
  dense_ratio = ratio("dense", "gmm")  # gmm TFLOP/s / dense TFLOP/s
  gmm_ms = row.seconds.get("gmm")
  return (f"| {row.shape} | {row.m} | {row.k} | {row.n} | {row.groups} | {row.distribution} | "
          f"{row.mode} | {row.implementation} | {fmt(gmm_ms and gmm_ms * 1e3, '.3f')} | "
          f"{fmt(tflops('gmm'), '.0f')} | {fmt(tflops('dense'), '.0f')} | "
          f"{fmt(dense_ratio and dense_ratio * 100, '.0f')} | {fmt(tflops('ragged'), '.0f')} | "
          f"{fmt(ratio('ragged', 'gmm'), '.2f')} | {fmt(tflops('tokamax'), '.0f')} | "
          f"{fmt(ratio('tokamax', 'gmm'), '.2f')} | {fmt(row.error, '.1e')} |")


def run_autotune(shapes, dtype, backward: bool, repeats: int, interpret: bool = False,
                 implementation=None, candidates=None, deviceless_target=None) -> list[str]:
  """`gmm_jax.autotune` on MoE shapes (balanced and skewed routing as the representative
  distributions); one Markdown row per tuned gmm. With `deviceless_target` the candidates
  are compiled for one chip of it instead of timed (`autotune`'s deviceless `device`)."""
  device = None if deviceless_target is None else deviceless.chip(deviceless_target)
  rows = []
  for shape in shapes:
    m, k, n, g = MOE_SHAPES[shape] if isinstance(shape, str) else shape
    name = shape if isinstance(shape, str) else f"{m}x{k}x{n}x{g}"
    sizes = [group_sizes(m, g, "balanced"), group_sizes(m, g, "skewed")]
    try:
      results = autotune(m, k, n, g, dtype=dtype, group_sizes=sizes, backward=backward,
                         repeats=repeats, interpret=interpret, implementation=implementation,
                         candidates=candidates, device=device)
    except Exception as err:  # noqa: BLE001 - report and go on with the other shapes
      rows.append(f"| {name} | - | failed: {type(err).__name__}: {str(err)[:200]} | | | | |")
      continue
    for r in results:
      t = r.best
      measured = sum(s is not None for _, s in r.timings)
      rows.append(f"| {name} | {r.role} | {r.problem.implementation} | "
                  f"{t.tile_m}x{t.tile_k}x{t.tile_n} | {r.seconds * 1e3:.3f} | "
                  f"{r.default_seconds * 1e3:.3f} | {r.default_seconds / r.seconds:.2f} | "
                  f"{measured}/{len(r.timings)} |")
  return rows


# Static proxies: the kernels' own host-side models of what they do (no timing).
PROXY_TARGETS = (("pallas_triton", "gpu", "NVIDIA H200"), ("pallas_tpu", "tpu", "TPU v5 lite"))


def _kernel_module(implementation):
  """The kernel module (an optional dependency: this jax's Pallas backend)."""
  name = "gpu.triton" if implementation == "pallas_triton" else "tpu.mosaic_tpu_plan"
  return importlib.import_module(f"gmm_jax.pallas.{name}")


def run_proxies(shapes, distributions=("balanced", "skewed")) -> list[str]:
  """One Markdown row per kernel, target, MoE shape, routing and gmm (the forward, m-grouped;
  the weight gradient, k-grouped): the tiles gmm would pick for the target's device kind
  and the kernel's static model of that launch."""
  rows = []
  for implementation, platform, kind in PROXY_TARGETS:
    module = _kernel_module(implementation)
    for shape in shapes:
      m, k, n, g = MOE_SHAPES[shape] if isinstance(shape, str) else shape
      name = shape if isinstance(shape, str) else f"{m}x{k}x{n}x{g}"
      for distribution in distributions:
        counts = group_sizes(m, g, distribution)
        # fwd: [M, K] x [G, K, N]; drhs: [K, M] x [M, N] grouped along the M tokens.
        for role, group_type, dims in (("fwd", "m", (m, k, n)), ("drhs", "k", (k, m, n))):
          cfg = GmmConfig(group_type=group_type, num_local=g, out_dtype=jnp.bfloat16)
          bf16 = np.dtype(jnp.bfloat16)
          problem = Problem(implementation, platform, kind, group_type, *dims, g, g, bf16,
                            bf16, bf16)
          tiling = tuning.choose(problem, None,
                                 lambda: module.default_tiling(*dims, cfg, 2))
          cost = module.static_cost(counts, *dims, cfg, tiling, 2)
          busy = cost.get("busy_steps", cost.get("work_steps"))
          rows.append(
              f"| {implementation} | {kind} | {name} | {distribution} | {role} | "
              f"{tiling.tile_m}x{tiling.tile_k}x{tiling.tile_n} | "
              f"{cost['mma_rows'] / max(cost['useful_rows'], 1):.3f} | "
              f"{cost['hbm_bytes'] / max(cost['ideal_bytes'], 1):.2f} | "
              f"{cost['grid_steps']} | {busy} |")
  return rows


PROXY_HEADER = ("| kernel | device kind | shape | sizes | gmm | tiles (m x k x n) | MMA rows / "
                "useful rows | modelled HBM bytes / ideal | grid steps | steps with work |\n"
                "|---|---|---|---|---|---|---|---|---|---|")


AUTOTUNE_HEADER = ("| shape | gmm | implementation | best tiles (m x k x n) | best ms (balanced + "
                   "skewed) | default ms | speed-up | candidates run |\n"
                   "|---|---|---|---|---|---|---|---|")
