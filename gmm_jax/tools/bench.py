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
           weight bytes, the real floor once the G weight matrices dominate memory traffic
Ratios are to dense and to batched; "fwd+bwd" times the gradient w.r.t. lhs and rhs of
sum(out * cotangent). Memory is the compiled executable's temporary bytes.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gmm_jax import GmmSharding, QuantSpec, autotune, gmm, quantize, routed_gmm
from gmm_jax._src import cli
from gmm_jax._src.backends import registry as dispatch
from gmm_jax._src.tiling import tuning
from gmm_jax._src.tiling.autotune import min_wall_time
from gmm_jax._src.core.config import GmmConfig, Problem


def group_sizes(m: int, num_groups: int, distribution: str, seed: int = 0) -> np.ndarray:
  """Group sizes summing to m: "balanced" (equal) or "skewed" (Zipf-like, ~1/4 empty)."""
  if distribution == "balanced":
    sizes = np.full(num_groups, m // num_groups, np.int64)
    sizes[: m - sizes.sum()] += 1
    return sizes.astype(np.int32)
  if distribution != "skewed":
    raise ValueError(f"distribution must be 'balanced' or 'skewed', got {distribution!r}")
  rng = np.random.default_rng(seed)
  weights = 1.0 / np.arange(1, num_groups + 1) ** 1.1
  if num_groups >= 4:
    weights[-(num_groups // 4):] = 0.0  # the least popular quarter gets no tokens
  weights = rng.permutation(weights)
  sizes = np.floor(weights / weights.sum() * m).astype(np.int64)
  sizes[np.argmax(weights)] += m - sizes.sum()
  return sizes.astype(np.int32)


def time_fn(fn: Callable, args, repeats: int = 5) -> float:
  """Minimum wall time in seconds of a compiled call (after one warm-up): the autotuner's
  timer."""
  return min_wall_time(fn, args, repeats)


def temp_bytes(fn: Callable, args) -> int | None:
  try:
    analysis = jax.jit(fn).lower(*args).compile().memory_analysis()
    return int(analysis.temp_size_in_bytes)
  except Exception:  # memory analysis is best-effort on some backends
    return None


@dataclasses.dataclass
class Row:
  dtype: str
  m: int
  kn: int
  groups: int
  distribution: str
  mode: str
  seconds: dict[str, float | None]
  temp: dict[str, int | None]
  error: float | None = None  # gpu table: max |gmm - ragged_dot| / max |ragged_dot|

  def ratio(self, name: str, base: str) -> float | None:
    a, b = self.seconds.get(name), self.seconds.get(base)
    return None if a is None or b is None else a / b


def _candidates(lhs, rhs, sizes, dtype, implementation, with_ragged):
  m, k = lhs.shape
  num_groups, _, n = rhs.shape
  acc = jnp.float32 if dtype != jnp.float32 else None

  def ours(x, w, gs):
    return gmm(x, w, gs, implementation=implementation)

  def ragged(x, w, gs):
    return jax.lax.ragged_dot(x, w, gs, preferred_element_type=acc).astype(x.dtype)

  def dense(x, w, gs):
    del gs
    return jnp.matmul(x, w[0], preferred_element_type=acc).astype(x.dtype)

  rows = m // num_groups

  def batched(x, w, gs):
    del gs
    xb = x[: rows * num_groups].reshape(num_groups, rows, k)
    out = jnp.einsum("gmk,gkn->gmn", xb, w, preferred_element_type=acc).astype(x.dtype)
    return out.reshape(rows * num_groups, n)

  out = {"gmm": ours, "dense": dense, "batched": batched}
  if with_ragged:
    out["ragged"] = ragged
  return out


def _fwd_bwd(fn):
  def loss(x, w, gs, cot):
    out = fn(x, w, gs)
    return jnp.sum(out.astype(jnp.float32) * cot[: out.shape[0]])

  return jax.grad(loss, argnums=(0, 1))


def run_case(dtype, m, kn, num_groups, distribution, modes=("fwd", "fwd+bwd"),
             implementation="xla", repeats=5, ragged_limit=6e11, seed=0):
  """Times one shape; returns a Row per mode."""
  rng = np.random.default_rng(seed)
  k = n = kn
  lhs = jnp.asarray(rng.standard_normal((m, k)), dtype)
  rhs = jnp.asarray(rng.standard_normal((num_groups, k, n)) / np.sqrt(k), dtype)
  sizes = jnp.asarray(group_sizes(m, num_groups, distribution, seed))
  cot = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  # ragged_dot does num_groups dense products: skip it where that takes minutes.
  with_ragged = 2.0 * m * k * n * num_groups <= ragged_limit
  fns = _candidates(lhs, rhs, sizes, dtype, implementation, with_ragged)
  out = []
  for mode in modes:
    seconds, temps = {}, {}
    for name, fn in fns.items():
      if mode == "fwd":
        compiled, args = jax.jit(fn), (lhs, rhs, sizes)
      else:
        compiled, args = jax.jit(_fwd_bwd(fn)), (lhs, rhs, sizes, cot)
      seconds[name] = time_fn(compiled, args, repeats)
      temps[name] = temp_bytes(compiled, args)
    for name in ("gmm", "ragged", "dense", "batched"):
      seconds.setdefault(name, None)
      temps.setdefault(name, None)
    out.append(Row(jnp.dtype(dtype).name, m, kn, num_groups, distribution, mode, seconds, temps))
  return out


# ------------------------------------------------------------------------ quantized table

QUANT_COLUMNS = ("f32", "bf16", "int8 w", "int4 w/128", "fp8 w", "w8a8")


def run_quant_case(m, kn, num_groups, distribution, modes=("fwd",), implementation=None,
                   repeats=5, interpret=False, seed=0):
  """Weight-only int8 / int4 (per-group 128) / fp8 and int8 x int8 (per-token x
  per-channel) gmm against bf16 and f32 gmm on the same shape; returns a Row per mode with
  the seconds of each column of `QUANT_COLUMNS`."""
  rng = np.random.default_rng(seed)
  k = n = kn
  x = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((num_groups, k, n)) / np.sqrt(k), jnp.float32)
  sizes = jnp.asarray(group_sizes(m, num_groups, distribution, seed))
  cot = jnp.asarray(rng.standard_normal((m, n)), jnp.float32)
  x16, w16 = x.astype(jnp.bfloat16), w.astype(jnp.bfloat16)
  weights = {
      "int8 w": quantize(w, jnp.int8, channelwise_axes=(0, 2)),
      "int4 w/128": quantize(w, jnp.int4, channelwise_axes=(0, 2), tiled_axes={1: 128}),
      "fp8 w": quantize(w, jnp.float8_e4m3fn, channelwise_axes=(0, 2)),
  }
  wq8 = weights["int8 w"]
  options = dict(implementation=implementation, interpret=interpret)
  cases = {
      "f32": (lambda a, b, s: gmm(a, b, s, **options), x, w),
      "bf16": (lambda a, b, s: gmm(a, b, s, **options), x16, w16),
      **{name: (lambda a, b, s: gmm(a, b, s, **options), x16, q) for name, q in weights.items()},
      # dynamic per-token int8 activations x per-channel int8 weights, bf16 out
      "w8a8": (lambda a, b, s: gmm(a, b, s, preferred_element_type=jnp.bfloat16,
                                   quantize_lhs=QuantSpec(jnp.int8, channelwise_axes=(0,)),
                                   **options), x16, wq8),
  }
  out = []
  for mode in modes:
    seconds = {}
    for name, (fn, a, b) in cases.items():
      if mode == "fwd":
        compiled, args = jax.jit(fn), (a, b, sizes)
      else:  # gradient w.r.t. the activations only (the weights are frozen/quantized)
        compiled = jax.jit(jax.grad(
            lambda a, b, s, c, fn=fn: jnp.sum(fn(a, b, s).astype(jnp.float32) * c)))
        args = (a, b, sizes, cot)
      seconds[name] = time_fn(compiled, args, repeats)
    out.append(Row("mixed", m, kn, num_groups, distribution, mode, seconds, {}))
  return out


def quant_header() -> str:
  cells = " | ".join(f"{name} ms" for name in QUANT_COLUMNS)
  ratios = " | ".join(f"{name}/bf16" for name in QUANT_COLUMNS if name != "bf16")
  return (f"| M | K=N | G | sizes | mode | {cells} | {ratios} |\n"
          f"|{'---|' * (5 + 2 * len(QUANT_COLUMNS) - 1)}")


def format_quant_row(row: Row) -> str:
  cells = " | ".join(_fmt(row.seconds[name] * 1e3, ".1f") for name in QUANT_COLUMNS)
  ratios = " | ".join(_fmt(row.ratio(name, "bf16"), ".2f") for name in QUANT_COLUMNS
                     if name != "bf16")
  return (f"| {row.m} | {row.kn} | {row.groups} | {row.distribution} | {row.mode} | {cells} | "
          f"{ratios} |")


# ------------------------------------------------------------------------- sharding table

_COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter",
                "collective-permute")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
                "pred": 1, "f64": 8, "s64": 8}


def communicated_bytes(hlo_text: str) -> dict[str, int]:
  """Bytes produced per device by each kind of collective in a compiled HLO module (the
  result shapes of every collective instruction, tuple results summed)."""
  out: dict[str, int] = {}
  for line in hlo_text.splitlines():
    for kind in _COLLECTIVES:
      match = re.search(rf"= (.*?) {kind}(?:-start)?\(", line)
      if match:
        total = 0
        for dtype, dims in re.findall(r"([a-z]+[0-9]*)\[([0-9,]*)\]", match.group(1)):
          total += _DTYPE_BYTES.get(dtype, 4) * int(
              np.prod([int(d) for d in dims.split(",") if d]))
        out[kind] = out.get(kind, 0) + total
        break
  return out


def run_sharding_case(devices: int, pattern: str, experts_per_device=4, tokens_per_device=1024,
                      kn=512, repeats=3, seed=0):
  """Weak scaling: `devices` devices on one mesh axis, each with `experts_per_device` experts
  and `tokens_per_device` tokens. pattern "expert" (tokens replicated over the axis, rows
  combined by a psum; the explicit `GmmSharding` form), "expert-jit" (the same layout under
  plain jit: the operands' shardings alone), "ragged_dot-jit" (`jax.lax.ragged_dot` in the
  same program, for comparison) or "routed" (tokens sharded, all_to_all to the experts'
  devices). The gradient jit keeps the operands' shardings (out_shardings), as a training
  step that updates the weights in place does.
  Returns [(seconds, bytes per device by collective)] for the forward and forward+backward."""
  mesh = Mesh(np.array(jax.devices()[:devices]), ("e",))
  rng = np.random.default_rng(seed)
  num_experts = experts_per_device * devices
  tokens = tokens_per_device * devices
  x = jnp.asarray(rng.standard_normal((tokens, kn)), jnp.float32)
  w = jnp.asarray(rng.standard_normal((num_experts, kn, kn)) / np.sqrt(kn), jnp.float32)
  ids = jnp.asarray(rng.integers(0, num_experts, tokens), jnp.int32)
  w = jax.device_put(w, NamedSharding(mesh, P("e")))
  sizes = jnp.bincount(ids, length=num_experts).astype(jnp.int32)
  if pattern == "expert":
    x = jax.device_put(x, NamedSharding(mesh, P()))
    sharding = GmmSharding(mesh, P(), P("e"))
    fn = lambda x, w: gmm(x, w, sizes, sharding=sharding)  # noqa: E731
  elif pattern == "expert-jit":
    x = jax.device_put(x, NamedSharding(mesh, P()))
    fn = lambda x, w: gmm(x, w, sizes)  # noqa: E731
  elif pattern == "ragged_dot-jit":
    x = jax.device_put(x, NamedSharding(mesh, P()))
    fn = lambda x, w: jax.lax.ragged_dot(x, w, sizes)  # noqa: E731
  else:
    x = jax.device_put(x, NamedSharding(mesh, P("e")))
    fn = lambda x, w: routed_gmm(x, w, ids, mesh=mesh, axis="e")  # noqa: E731
  grad = jax.grad(lambda x, w: jnp.sum(fn(x, w) ** 2), argnums=(0, 1))
  out = []
  for f in (jax.jit(fn), jax.jit(grad, out_shardings=(x.sharding, w.sharding))):
    seconds = time_fn(f, (x, w), repeats)
    comm = communicated_bytes(f.lower(x, w).compile().as_text())
    out.append((seconds, comm))
  return out


def format_sharding_rows(devices, pattern, results) -> list[str]:
  rows = []
  for mode, (seconds, comm) in zip(("fwd", "fwd+bwd"), results):
    detail = ", ".join(f"{k} {v / 2**20:.2f}" for k, v in sorted(comm.items())) or "none"
    rows.append(f"| {pattern} | {devices} | {mode} | {seconds * 1e3:.1f} | "
                f"{sum(comm.values()) / 2**20:.2f} | {detail} |")
  return rows


# ------------------------------------------------------------------------------- GPU table


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
    fns["tokamax"] = lambda x, w, gs: tokamax_ragged_dot(
        x, w, gs, preferred_element_type=acc).astype(dtype)
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


def run_gpu_case(dtype, shape, distribution, modes=("fwd", "fwd+bwd"),
                 implementation=None, repeats=10, interpret=False, seed=0):
  """Times one MoE shape on the default device: gmm (the dispatcher's choice unless
  `implementation`), jax.lax.ragged_dot, a dense matmul of the same FLOPs and tokamax's
  ragged_dot when importable. Returns a `GpuRow` per mode (a candidate that fails to compile
  or run is recorded as None)."""
  m, k, n, num_groups = MOE_SHAPES[shape] if isinstance(shape, str) else shape
  name = shape if isinstance(shape, str) else f"{m}x{k}x{n}x{num_groups}"
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), dtype)
  rhs = jnp.asarray(rng.standard_normal((num_groups, k, n), np.float32) / np.sqrt(k), dtype)
  sizes = jnp.asarray(group_sizes(m, num_groups, distribution, seed))
  cot = jnp.asarray(rng.standard_normal((m, n), np.float32), jnp.float32)
  fns = _gpu_candidates(dtype, implementation, interpret)
  # Correctness on the same operands: gmm against ragged_dot (both f32-accumulated), relative
  # to the largest |ragged_dot| entry.
  want = jax.jit(fns["ragged"])(lhs, rhs, sizes).astype(jnp.float32)
  with dispatch.record() as decisions:
    got = jax.jit(fns["gmm"])(lhs, rhs, sizes).astype(jnp.float32)
  chosen = ",".join(sorted({d.implementation for d in decisions}))
  error = float(jnp.max(jnp.abs(got - want)) / jnp.maximum(jnp.max(jnp.abs(want)), 1e-30))
  out = []
  for mode in modes:
    seconds = {}
    for candidate, fn in fns.items():
      if mode == "fwd":
        compiled, args = jax.jit(fn), (lhs, rhs, sizes)
      else:
        compiled, args = jax.jit(_fwd_bwd(fn)), (lhs, rhs, sizes, cot)
      try:
        seconds[candidate] = time_fn(compiled, args, repeats)
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
          f"{row.mode} | {row.implementation} | {_fmt(gmm_ms and gmm_ms * 1e3, '.3f')} | "
          f"{_fmt(tflops('gmm'), '.0f')} | {_fmt(tflops('dense'), '.0f')} | "
          f"{_fmt(dense_ratio and dense_ratio * 100, '.0f')} | {_fmt(tflops('ragged'), '.0f')} | "
          f"{_fmt(ratio('ragged', 'gmm'), '.2f')} | {_fmt(tflops('tokamax'), '.0f')} | "
          f"{_fmt(ratio('tokamax', 'gmm'), '.2f')} | {_fmt(row.error, '.1e')} |")


def run_autotune(shapes, dtype, backward: bool, repeats: int, interpret: bool = False,
                 implementation=None, candidates=None) -> list[str]:
  """`gmm_jax.autotune` on MoE shapes (balanced and skewed routing as the representative
  distributions); one Markdown row per tuned gmm."""
  rows = []
  for shape in shapes:
    m, k, n, g = MOE_SHAPES[shape] if isinstance(shape, str) else shape
    name = shape if isinstance(shape, str) else f"{m}x{k}x{n}x{g}"
    sizes = [group_sizes(m, g, "balanced"), group_sizes(m, g, "skewed")]
    try:
      results = autotune(m, k, n, g, dtype=dtype, group_sizes=sizes, backward=backward,
                         repeats=repeats, interpret=interpret, implementation=implementation,
                         candidates=candidates)
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
  name = "gpu" if implementation == "pallas_triton" else "tpu"
  return importlib.import_module(f"gmm_jax.pallas.{name}.gmm")


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


def _fmt(value, spec):
  return "-" if value is None else format(value, spec)


def header() -> str:
  return ("| dtype | M | K=N | G | sizes | mode | gmm ms | gmm/dense | gmm/batched | "
          "ragged/dense | batched/dense | gmm temp MB | ragged temp MB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(row: Row) -> str:
  mb = lambda b: None if b is None else b / 2**20
  return (f"| {row.dtype} | {row.m} | {row.kn} | {row.groups} | {row.distribution} | "
          f"{row.mode} | {_fmt(row.seconds['gmm'] * 1e3, '.1f')} | "
          f"{_fmt(row.ratio('gmm', 'dense'), '.2f')} | {_fmt(row.ratio('gmm', 'batched'), '.2f')} | "
          f"{_fmt(row.ratio('ragged', 'dense'), '.1f')} | "
          f"{_fmt(row.ratio('batched', 'dense'), '.2f')} | {_fmt(mb(row.temp['gmm']), '.1f')} | "
          f"{_fmt(mb(row.temp['ragged']), '.1f')} |")


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
                                               args.implementation))
        for dtype in args.dtypes for shape in shapes]
  if gpu:
    return gpu_header(), [
        (f"{dtype} {name(shape)} {dist}",
         lambda c=(dtype, shape, dist): [format_gpu_row(row) for row in run_gpu_case(
             jnp.dtype(c[0]), c[1], c[2], args.modes, args.implementation, args.repeats,
             args.interpret)])
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
