"""The host-side tables of `gmm_jax.tools.bench`, and the timing every table shares.

Group sizes of a routing distribution, the timer (the autotuner's) and a compiled call's
temporary bytes; the CPU table (gmm against jax.lax.ragged_dot, a dense and a batched
matmul of the same FLOPs), the quantized table (weight-only int8 / int4 / fp8 and w8a8 gmm
against bf16 and f32) and the sharding table (weak scaling over host CPU devices, the bytes
each collective communicates)."""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gmm_jax import GmmSharding, QuantSpec, gmm, quantize, routed_gmm
from gmm_jax._src.tiling.autotune import min_wall_time


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

  @property
  def floor(self) -> float | None:
    """max(dense, weights): the dense product's time or the time the weight traffic takes
    (`weights_seconds`), whichever is longer."""
    times = [self.seconds.get(name) for name in ("dense", "weights")]
    return None if None in times else max(times)


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


def fwd_bwd(fn):
  """The gradient w.r.t. lhs and rhs of ``sum(fn(x, w, gs) * cotangent)`` (the "fwd+bwd"
  mode)."""

  def loss(x, w, gs, cot):
    out = fn(x, w, gs)
    return jnp.sum(out.astype(jnp.float32) * cot[: out.shape[0]])

  return jax.grad(loss, argnums=(0, 1))


def _reads(w):
  """Programs that read every weight once and write next to nothing: a sum along each
  matrix row (the innermost axis) and the largest value (XLA:CPU streams the weights at
  memory speed through one or the other on every jax version; a sum over the groups, the
  outermost axis, took 60x longer with jax 0.10.2)."""
  return [jax.jit(lambda w: jnp.sum(w.reshape(-1, w.shape[-1]), axis=1, dtype=jnp.float32)),
          jax.jit(jnp.max)]


def _weight_passes(rhs, mode: str):
  """The weight traffic no gmm avoids, as (name, programs, times) passes: the forward reads
  the weights once (`_reads`, the faster of them); forward and backward read them twice
  (the forward's and the input gradient's products) and write their gradient once (the
  weights doubled: one read and one write of a new array, as a gradient is)."""
  passes = [("read", _reads(rhs), 1)]
  if mode != "fwd":
    passes += [("read", _reads(rhs), 1),
               ("read+write", [jax.jit(lambda w: w * jnp.asarray(2, w.dtype))], 1)]
  return passes


def weights_seconds(rhs, mode: str, repeats: int) -> float:
  """Seconds of `_weight_passes`: the weights' floor of a gmm with these weights."""
  return sum(min(time_fn(fn, (rhs,), repeats) for fn in programs)
             for _, programs, _ in _weight_passes(rhs, mode))


def run_case(dtype, m, kn, num_groups, distribution, modes=("fwd", "fwd+bwd"),
             implementation="xla", repeats=5, ragged_limit=6e11, seed=0):
  """Times one shape; returns a Row per mode (with "weights": `weights_seconds`)."""
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
        compiled, args = jax.jit(fwd_bwd(fn)), (lhs, rhs, sizes, cot)
      seconds[name] = time_fn(compiled, args, repeats)
      temps[name] = temp_bytes(compiled, args)
    seconds["weights"] = weights_seconds(rhs, mode, repeats)
    for name in ("gmm", "ragged", "dense", "batched"):
      seconds.setdefault(name, None)
      temps.setdefault(name, None)
    out.append(Row(jnp.dtype(dtype).name, m, kn, num_groups, distribution, mode, seconds, temps))
  return out


def fmt(value, spec):
  """A table cell: `value` formatted by `spec`, "-" for None."""
  return "-" if value is None else format(value, spec)


def header() -> str:
  return ("| dtype | M | K=N | G | sizes | mode | gmm ms | floor ms | gmm/floor | gmm/dense | "
          "gmm/batched | weights/dense | ragged/dense | batched/dense | gmm temp MB | "
          "ragged temp MB |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def format_row(row: Row) -> str:
  mb = lambda b: None if b is None else b / 2**20
  floor = row.floor
  return (f"| {row.dtype} | {row.m} | {row.kn} | {row.groups} | {row.distribution} | "
          f"{row.mode} | {fmt(row.seconds['gmm'] * 1e3, '.1f')} | "
          f"{fmt(floor and floor * 1e3, '.1f')} | "
          f"{fmt(floor and row.seconds['gmm'] / floor, '.2f')} | "
          f"{fmt(row.ratio('gmm', 'dense'), '.2f')} | {fmt(row.ratio('gmm', 'batched'), '.2f')} | "
          f"{fmt(row.ratio('weights', 'dense'), '.2f')} | "
          f"{fmt(row.ratio('ragged', 'dense'), '.1f')} | "
          f"{fmt(row.ratio('batched', 'dense'), '.2f')} | {fmt(mb(row.temp['gmm']), '.1f')} | "
          f"{fmt(mb(row.temp['ragged']), '.1f')} |")


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
  cells = " | ".join(fmt(row.seconds[name] * 1e3, ".1f") for name in QUANT_COLUMNS)
  ratios = " | ".join(fmt(row.ratio(name, "bf16"), ".2f") for name in QUANT_COLUMNS
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
