"""`gmm_jax.autotune`: sweeps tilings of one gmm problem on the device it runs on and writes
the fastest to the cache that gmm reads (`tuning.cache_path`).

Floor 6: uses the public gmm, and the tuning floor for the problem keys and the cache.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import functools
import pathlib
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import api
from gmm_jax._src.backends import registry
from gmm_jax._src.tiling import tuning
from gmm_jax._src.core.config import Problem, Tiling, Tilings
from gmm_jax._src.core.qarray import quantize

ROLES = ("fwd", "dlhs", "drhs")


@dataclasses.dataclass(frozen=True)
class TuneResult:
  """What `autotune` measured for one gmm of the call.

  Fields:
    role: "fwd", "dlhs" or "drhs".
    problem: the tuned `Problem` (the cache key).
    best: the fastest tiling.
    seconds: the best tiling's time, summed over the group-size distributions.
    default_seconds: the time of the tiling gmm chose before tuning.
    timings: (tiling, seconds or None when the implementation refused it) per candidate.
  """

  role: str
  problem: Problem
  best: Tiling
  seconds: float
  default_seconds: float
  timings: tuple[tuple[Tiling, float | None], ...]


def default_candidates(problem: Problem) -> tuple[Tiling, ...]:
  """The tilings swept for a problem when none are given: per implementation, the tile
  sizes its kernels can use around the sizes that matter for the shape."""
  impl = problem.implementation
  if impl == "pallas_tpu":
    ms, ks, ns = (128, 256, 512), (512, 1024, 2048), (512, 1024, 2048)
  elif impl in ("pallas_triton", "pallas_mosaic_gpu"):
    ms, ks, ns = (64, 128), (32, 64), (128, 256)
  else:  # the XLA path: rows per work item (m-grouping) or K per item (k-grouping)
    ms, ks, ns = (64, 128, 256, 512), (128, 256, 512), (512,)
  grouped = problem.m if problem.group_type == "m" else problem.k
  out = []
  for tm in ms:
    for tk in ks:
      for tn in ns:
        if problem.group_type == "m" and tm > max(16, 2 * grouped):
          continue
        out.append(Tiling(tile_m=tm, tile_k=tk, tile_n=tn))
  return tuple(out)


def min_wall_time(fn, args, repeats: int = 5) -> float:
  """Minimum wall time in seconds of a compiled call (after one warm-up)."""
  jax.block_until_ready(fn(*args))
  best = float("inf")
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready(fn(*args))
    best = min(best, time.perf_counter() - start)
  return best


def _balanced(m: int, g: int) -> np.ndarray:
  sizes = np.full(g, m // g, np.int32)
  sizes[: m - sizes.sum()] += 1
  return sizes


def autotune(m: int, k: int, n: int, num_groups: int, *, group_type: str = "m",
             dtype=jnp.bfloat16, weight_dtype=None, out_dtype=None,
             transpose_lhs: bool = False, transpose_rhs: bool = False, activation=None,
             group_sizes: Sequence | None = None, backward: bool = False,
             implementation=None, candidates: Sequence[Tiling] | None = None,
             repeats: int = 5, interpret: bool = False, cache=None,
             write: bool = True, seed: int = 0, device=None) -> tuple[TuneResult, ...]:
  """Times candidate tilings of one gmm on the default device and caches the fastest.

  Builds random operands of the given shapes, finds the `Problem` that gmm would run
  (implementation, device kind, dtypes, ...), times each candidate `Tiling` for it, summed
  over the representative group-size distributions, and stores the fastest in the cache
  (``$GMM_JAX_AUTOTUNE_CACHE``, else ``~/.cache/gmm_jax/autotune.json``), keyed by the
  problem. Later gmm calls of that problem, on this device kind, use it automatically
  (an explicit ``tiling=`` still wins).

  Args:
    m, k, n: the gmm's dims; num_groups: G.
    group_type: "m" or "k".
    dtype: the operands' dtype.
    weight_dtype: None, or a quantized weight type (int8, int4, float8_e4m3fn): rhs is then
      quantized per expert and output channel (weight-only mode).
    out_dtype: ``preferred_element_type`` (default: the operands' dtype).
    transpose_lhs, transpose_rhs, activation: as gmm's.
    group_sizes: representative group-size vectors (each summing to at most M, or K for
      k-grouping); default one balanced vector. The tiling with the smallest total time
      over them wins; they are recorded in the cache entry.
    backward: also tune the two gmms of the backward (the gradients of lhs and rhs), each
      keyed by its own problem.
    implementation: as gmm's (default: the platform's chain).
    candidates: the tilings to try (default `default_candidates`). Tilings an
      implementation refuses are skipped.
    repeats: timed runs per candidate (the minimum is kept).
    interpret: Pallas interpret mode (to check the sweep on a CPU; not for timing kernels).
    cache: the cache file (default as above).
    write: store the results (False: only measure).
    seed: the operands' random seed.
    device: the device to tune for (default: the default device). A device of a deviceless
      topology (`jax.experimental.topologies`, e.g. an H100's described on a CPU host)
      compiles the default and every candidate for that chip instead of timing them: each
      time is NaN and nothing is cached, and a candidate that fails to compile fails
      here as it would on the chip (a check of a sweep before it runs on the hardware).

  Returns:
    One `TuneResult` per tuned gmm ("fwd", then "dlhs" and "drhs" with backward=True).

  Raises:
    ValueError: bad shapes or group sizes.
  """
  dims = dict(m=m, k=k, n=n, num_groups=num_groups)
  for name, value in dims.items():
    if not isinstance(value, (int, np.integer)) or value <= 0:
      raise ValueError(f"autotune needs positive int dims, got {name}={value!r}")
  if repeats < 1:
    raise ValueError(f"repeats must be >= 1, got {repeats}")
  distributions = _distributions(m if group_type == "m" else k, num_groups, group_sizes)
  lhs, rhs = _operands(m, k, n, num_groups, group_type, dtype, weight_dtype, transpose_lhs,
                       transpose_rhs, seed)
  options = dict(group_type=group_type, transpose_lhs=transpose_lhs,
                 transpose_rhs=transpose_rhs, activation=activation,
                 preferred_element_type=out_dtype, implementation=implementation,
                 interpret=interpret)
  counts = [jnp.asarray(s) for s in distributions]
  program = functools.partial(_program, weights_differentiable=weight_dtype is None)
  timer, context = min_wall_time, contextlib.nullcontext()
  if device is not None and _deviceless(device):
    (lhs, rhs), counts = _abstract_on(device, (lhs, rhs)), _abstract_on(device, counts)
    timer, context, write = _compiling(device), jax.default_device(device), False
  elif device is not None:
    (lhs, rhs), counts = jax.device_put((lhs, rhs), device), jax.device_put(counts, device)
    context = jax.default_device(device)
  results = []
  for role in (ROLES if backward else ("fwd",)):
    with context:
      result = _tune_role(role, program, options, (lhs, rhs), counts, candidates, repeats,
                          timer)
    results.append(result)
    if write:
      tuning.cache_store(result.problem, result.best, {
          "seconds": result.seconds, "default_seconds": result.default_seconds,
          "group_sizes": [s.tolist() for s in distributions], "repeats": repeats,
          "jax": jax.__version__, "date": datetime.date.today().isoformat(),
          "candidates": len(result.timings)}, None if cache is None else pathlib.Path(cache))
  return tuple(results)


def _deviceless(device) -> bool:
  """Whether `device` is described without the hardware (none of this process's devices)."""
  try:
    return device not in jax.local_devices(backend=device.platform)
  except RuntimeError:  # no runtime backend for its platform in this process
    return True


def _abstract_on(device, tree):
  """`tree`'s arrays (QArrays' too) as abstract values on `device`."""
  sharding = jax.sharding.SingleDeviceSharding(device)
  return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding),
                      tree)


def _compiling(device):
  """`min_wall_time`'s signature, compiling the program for a deviceless `device` instead
  of running it (NaN seconds)."""
  def timer(fn, args, repeats: int = 1) -> float:
    del repeats
    with jax.default_device(device):
      fn.lower(*args).compile()
    return float("nan")
  return timer


def _distributions(grouped: int, num_groups: int, group_sizes) -> list[np.ndarray]:
  """The group-size vectors `autotune` times (default one balanced vector), checked: each
  `num_groups` non-negative sizes summing to at most `grouped` (M, or K for k-grouping)."""
  if group_sizes is None:
    group_sizes = [_balanced(grouped, num_groups)]
  distributions = []
  for sizes in group_sizes:
    sizes = np.asarray(sizes, np.int32)
    if sizes.shape != (num_groups,) or sizes.min() < 0 or sizes.sum() > grouped:
      raise ValueError(
          f"each group_sizes vector must be {num_groups} non-negative sizes summing to at "
          f"most {grouped}, got {sizes.tolist()}")
    distributions.append(sizes)
  return distributions


def _operands(m: int, k: int, n: int, num_groups: int, group_type: str, dtype, weight_dtype,
              transpose_lhs: bool, transpose_rhs: bool, seed: int):
  """Random lhs and rhs of the tuned gmm (rhs quantized per expert and output channel when
  `weight_dtype` is given)."""
  rng = np.random.default_rng(seed)
  lhs_shape = (k, m) if transpose_lhs else (m, k)
  if group_type == "m":
    rhs_shape = (num_groups, n, k) if transpose_rhs else (num_groups, k, n)
  else:
    rhs_shape = (n, k) if transpose_rhs else (k, n)
  lhs = jnp.asarray(rng.standard_normal(lhs_shape, np.float32), dtype)
  rhs = jnp.asarray(rng.standard_normal(rhs_shape, np.float32) / np.sqrt(k), dtype)
  if weight_dtype is not None:
    n_axis = rhs.ndim - 2 if transpose_rhs else rhs.ndim - 1
    rhs = quantize(rhs.astype(jnp.float32), weight_dtype,
                   channelwise_axes=(0, n_axis) if group_type == "m" else (n_axis,))
  return lhs, rhs


def _program(tilings, role: str, gmm_options: dict, *, weights_differentiable: bool):
  """The jitted program whose `role` gmm is timed: the forward, or the gradient that runs
  a backward gmm (with respect to lhs, and rhs unless it is quantized)."""
  def forward(x, w, sizes):
    return api.gmm(x, w, sizes, tiling=tilings, **gmm_options)
  if role == "fwd":
    return jax.jit(forward)
  # The backward gmms run inside the gradient (the forward's value is unused and
  # dropped); the other gmms keep their choice, so differences come from the tuned one.
  loss = lambda x, w, sizes: jnp.sum(forward(x, w, sizes).astype(jnp.float32))
  return jax.jit(jax.grad(loss, argnums=(0, 1) if weights_differentiable else (0,)))


def _tune_role(role: str, program, options: dict, operands, counts, candidates,
               repeats: int, timer=None) -> TuneResult:
  """Times the default and each candidate tiling of the `role` gmm, with the implementation
  that serves it pinned."""
  lhs, rhs = operands
  problem, _ = _problem_of(lambda t: program(t, role, options), lhs, rhs, counts[0], role)
  if problem is None:
    raise ValueError(f"the {role} gmm of this call is served by no implementation that "
                     "takes a tiling")
  # The implementation is pinned: a tiling it refuses raises instead of silently timing
  # the next implementation of the chain.
  pinned = dict(options, implementation=problem.implementation)

  def run_with(tiling):
    choose = lambda p, t=tiling: t if p == problem else None
    fn = program(Tilings(**{role: choose}), role, pinned)
    return sum((timer or min_wall_time)(fn, (lhs, rhs, c), repeats) for c in counts)

  default_seconds = run_with(None)
  timings = []
  for tiling in (candidates or default_candidates(problem)):
    try:
      seconds = run_with(tiling)
    except NotImplementedError:
      seconds = None
    timings.append((tiling, seconds))
  measured = [(s, t) for t, s in timings if s is not None]
  if not measured:
    raise ValueError(f"no candidate tiling ran for {problem}: "
                     f"{[t for t, _ in timings]}")
  # (NaN times, a deviceless sweep's, compare false: the first candidate that compiled.)
  seconds, best = min(measured, key=lambda st: st[0])
  return TuneResult(role, problem, best, seconds, default_seconds, tuple(timings))


def _problem_of(program, lhs, rhs, counts, role):
  """The `Problem` of the `role` gmm of a program, and the implementation serving it.

  ``program(tiling)`` builds the jitted program; it is lowered with `Tilings` whose
  entries are callables noting the problem each gmm asks about (and returning None, the
  automatic choice). A problem asked about by an implementation that then refused the call
  (the dispatcher moved on) is dropped.
  """
  asked: dict[str, list[Problem]] = {r: [] for r in ROLES}
  note = lambda r: (lambda p: asked[r].append(p))
  tilings = Tilings(fwd=note("fwd"), dlhs=note("dlhs"), drhs=note("drhs"))
  with registry.record() as decisions:
    program(tilings).lower(lhs, rhs, counts)
  served = {d.implementation for d in decisions}
  problems = [p for p in asked[role] if p.implementation in served]
  implementation = problems[-1].implementation if problems else None
  return (problems[-1] if problems else None), implementation
