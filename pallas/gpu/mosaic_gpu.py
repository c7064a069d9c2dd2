"""Pallas Mosaic GPU gmm for Hopper (sm_90a), its op wrapper: m-grouping, bf16/f16 operands.

The kernel bodies (`mosaic_gpu_kernel`) run one persistent program per SM over (work item,
N tile) pairs. A work item is one of `metadata.make_tile_metadata`: the rows
``[item_start, item_end)`` of one local group inside a ``tile_m``-row window
(`metadata.window_starts`). Windows start at multiples of 8
because the TMA writes the tiled + swizzled shared-memory layout that wgmma reads, whose
rows come in tiles of 8: a window starting at any row cannot be loaded into it (the
descriptor addresses row r as tile r // 8, row r % 8; Mosaic GPU's layout inference asks
for the proof, ``pl.multiple_of(window, 8)``, and fails to lower without it; jax 0.12's
interpreter does not model this addressing, so the metadata tests and a deviceless compile
check it). So each group's windows start at its first row rounded down to 8
(``align="group", granule=8``, `window_granule`): a group never needs more windows than the
``tile_m``-aligned tiles it touches, and a decode-size group (a few rows) needs one where a
tile boundary inside it would cost two; where the two cannot differ (one group, or M within
one tile) the windows are the tiles (``align="tile"``). A wgmma still multiplies 64 rows
whatever the window's start, so a group of 8 rows costs a 64-row window. Loads past M are
zero-filled by the TMA.

Blocked fp8 (fp8 training's forward and dlhs gmms, `mosaic_gpu_kernel`): the K step is the
scale block; fp8 wgmma reads both operands K-major, so the forward's weights ``[L, K, N]``
are transposed to ``[L, N, K]`` here, by XLA, before the kernel.

Refuses (NotImplementedError, so the dispatcher falls back to Triton): k-grouping (the
drhs of fp8 training too), quantized operands other than blocked fp8 (weight-only,
scaled, blocked int8, blocks that are not multiples of 128), a transposed lhs, operands
other than bf16 x bf16 / f16 x f16 (e.g.
the dlhs of an f32-output gmm with an activation, whose cotangent is f32: Triton's), K or N not a
multiple of 8 (TMA strides are multiples of 16 bytes), activations without a Mosaic GPU
lowering, any GPU other than an sm_90 (wgmma is Hopper-only), and Pallas's plain interpret
mode (``interpret=True``). On a CPU the kernel runs under jax's Mosaic GPU simulator
(``interpret=plgpu.InterpretGPUParams(...)``, jax >= 0.11: shared memory, TMA, barriers and
wgmma simulated, with a race detector), through the gmm op like any call (the op declares
the simulator's effects); jax 0.10's simulator cannot run it.

The target GPU is the device the program is lowered for. A deviceless compile runs under
``jax.default_device(<a device of the target topology>)``, so it is
``jax.config.jax_default_device`` (its ``compute_capability`` and ``core_count``); else the
abstract mesh's abstract device (a device kind, e.g. the tests' cross-lowering); else the
first local GPU. With none of these the kernel refuses: it cannot know it targets an sm_90.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core import jax_private, metadata
from gmm_jax._src.tiling import cost_models
from gmm_jax._src.core.config import GmmConfig, Tiling, problem_dims
from gmm_jax._src.core.epilogue import resolve_activation
from gmm_jax._src.core.qarray import QArray, quant_mode
from gmm_jax.pallas import common
from gmm_jax.pallas.gpu.mosaic_gpu_kernel import (BAND, COMPUTE_WGS, KernelPlan, kernel_body,
                                                  warp_specialized)
from gmm_jax.pallas.jax_pallas import mosaic_gpu as plgpu, pl

GRANULE = 8  # rows per tile of the TMA's swizzled shared-memory layout: windows start here
SUPPORTED = ("the Mosaic GPU kernel serves m-grouping with bf16 x bf16 or f16 x f16 "
             "operands (lhs [M, K], rhs [G, K, N] or [G, N, K]), K and N multiples of 8, "
             "and fp8 'blocked' QArrays (e4m3/e5m2 values, scales varying along K in blocks "
             "of a multiple of 128, lhs not transposed, K multiple of 16), on sm_90a "
             "(Hopper) GPUs")
# fp8 wgmma reads both operands K-major (PTX: only 16-bit types take a transpose flag) from
# 128-byte swizzled rows: a K step of the blocked mode is a multiple of 128 values.
FP8_K_STEP = 128


def _mixed_fp8_wgmma() -> bool:
  """Whether this jax's `plgpu.wgmma` takes an e5m2 x e4m3 pair (PTX takes the two types
  separately; jax 0.11.2 and 0.12 accept the pair, jax 0.10 asks for one element type)."""
  try:
    return "float8_e5m2" in inspect.getsource(plgpu.wgmma)
  except (OSError, TypeError):
    return False


MIXED_FP8 = _mixed_fp8_wgmma()
LOWERING_SEMANTICS = plgpu.LoweringSemantics.Warpgroup
SMEM_BYTES = cost_models.GPU_SMEM_BYTES  # sm_90's shared memory per block
# The compute capability majors this kernel compiles for: wgmma is sm_90a's (the dispatcher
# skips the kernel on other GPUs up front, `backends.builtin.GPU_ARCHS`).
ARCHS = (9,)
# Primitives with a Mosaic GPU lowering rule but no layout inference rule (jax 0.12): they
# fail at lowering, so the kernel refuses them up front ("gelu" is jax.nn.gelu's erfc;
# Triton serves it with a rational erf).
NO_LAYOUT_RULE = ("erf", "erfc", "erf_inv")


# ------------------------------------------------------------------------- target GPU


def target_gpu() -> tuple[tuple[int, int] | None, int, str]:
  """(compute capability or None, number of SMs, a description) of the GPU being targeted:
  `cost_models.gpu_target`, the one reader (jax's default device, which a deviceless compile
  for a GPU topology sets, the abstract mesh's device, the first local GPU)."""
  return cost_models.gpu_target()


def _check_target() -> int:
  """The number of SMs of the target GPU; NotImplementedError unless it is an sm_90."""
  capability, num_sms, description = target_gpu()
  if capability is None or capability[0] not in ARCHS:
    raise NotImplementedError(
        f"the Mosaic GPU gmm kernel needs sm_90a (Hopper: wgmma); target: {description}, "
        f"compute capability {capability}")
  return num_sms


# ----------------------------------------------------------------------------- tiles


def default_tiling(m: int, k: int, n: int, cfg: GmmConfig, itemsize: int = 2, *,
                   blocked: bool = False) -> Tiling:
  """64-element K steps (one 128-byte swizzle row of bf16); 128-row windows, or 64 when
  the average group is shorter (a window never spans two groups); 256 columns (two
  warpgroups of 128) for 16-bit outputs, 128 for f32 ones (the staging tile must fit next
  to the ring), fewer for a narrow N.

  Blocked fp8 (`blocked`): the K step is the scale block (the preamble sets it); each
  consumer warpgroup holds two accumulators (the running sum and the block's product).
  64 rows x 256 columns: each warpgroup issues m64n128k32 wgmmas (128 x 128 tiles give
  m64n64k32, which read 33% more shared memory per MAC: with both operands in shared
  memory, fp8 wgmma at N = 64 needs all of an SM's 128 B/clk). On sm_90a both compile
  without spills (ptxas caps the three warpgroups at 168 registers a thread: 158 and 147
  used, jax 0.12). Not measured on a device."""
  del k, itemsize
  tile_m = 128 if m // max(1, cfg.num_local) >= 128 else 64
  if blocked:
    return Tiling(tile_m=64, tile_k=FP8_K_STEP,
                  tile_n=min(256, max(64, common.next_power_of_2(n))))
  widest = 256 if np.dtype(cfg.out_dtype).itemsize <= 2 else 128
  return Tiling(tile_m=tile_m, tile_k=64, tile_n=min(widest, max(64, common.next_power_of_2(n))))


def window_granule(m: int, num_groups: int, tile_m: int) -> int:
  """Where the work items' windows start (a pure function of static shapes): `GRANULE` (8:
  each group's windows from its first row rounded down to 8, ``align="group"``) or `tile_m`
  (the tiles, ``align="tile"``).

  Per group, 8-row windows are never more than the tiles it touches (its first window
  starts at or after its first tile and both step by ``tile_m``), and fewer wherever its
  rows fit in fewer windows from its own start: static MMA rows drop by up to 18% at decode
  shapes and 3-5% at prefill (benchmarks/log.md). Tiles are kept only where the two give the
  same items: one group (it starts at row 0) or M within one tile (every group then fits
  one window of either kind, and tile windows all read the same rows).
  """
  return tile_m if num_groups <= 1 or m <= tile_m else GRANULE


def _alignment(granule: int, tile_m: int) -> tuple[str, int]:
  """`metadata.make_tile_metadata`'s (align, granule) for windows at multiples of `granule`."""
  return ("tile", 1) if granule == tile_m else ("group", granule)


def check_tiling(tiling: Tiling, m: int, k: int, n: int, cfg: GmmConfig, *,
                 blocked: bool = False) -> None:
  """tile_m in {64, 128} (wgmma rows of one warpgroup), tile_k a multiple of 64, tile_n a
  multiple of 64 up to 256 (split between two consumer warpgroups from 128 on), and at
  most 128 x 128 f32 accumulator elements per warpgroup (registers). Blocked fp8: tile_k
  (the scale block) a multiple of 128 and at most 64 x 128 elements per accumulator (a
  warpgroup holds two)."""
  del m, k, n, cfg
  per_warpgroup = tiling.tile_n // (COMPUTE_WGS if warp_specialized(tiling) else 1)
  k_step, most = (FP8_K_STEP, 64 * 128) if blocked else (64, 128 * 128)
  if (tiling.tile_m not in (64, 128) or tiling.tile_k % k_step or tiling.tile_n % 64
      or tiling.tile_n > 256 or tiling.tile_m * per_warpgroup > most):
    raise NotImplementedError(
        f"the Mosaic GPU kernel needs tile_m in (64, 128), tile_k a multiple of {k_step}, "
        f"tile_n a multiple of 64 (<= 256) and at most {most} accumulator elements per "
        f"warpgroup{' (blocked fp8: two accumulators each)' if blocked else ''}, got {tiling}")


def _stages(tiling: Tiling, k: int, itemsize: int, out_itemsize: int) -> int:
  """Pipeline depth: up to 4 stages, as many as fit next to the output staging tile (at
  least 2: one wgmma stays in flight while the next stage loads)."""
  stage = (tiling.tile_m + tiling.tile_n) * tiling.tile_k * itemsize
  budget = SMEM_BYTES - tiling.tile_m * tiling.tile_n * out_itemsize - 2048  # + barriers
  stages = min(4, budget // stage, math.ceil(k / tiling.tile_k) + 1)
  if stages < 2:
    raise NotImplementedError(
        f"two pipeline stages of {tiling} and a {out_itemsize}-byte output tile exceed the "
        f"{SMEM_BYTES} bytes of shared memory of an sm_90")
  return stages


def unsupported_primitives(activation) -> set[str]:
  """Primitives of `activation` (on an f32 tile) without a Mosaic GPU lowering rule for the
  kernel's warpgroup lowering (MissingJaxInternal, a NotImplementedError, where this jax
  has no readable table)."""
  if activation is None:
    return set()
  rules = jax_private.lowering_rules("mosaic_gpu", LOWERING_SEMANTICS)
  rules = {p: rule for p, rule in rules.items() if p.name not in NO_LAYOUT_RULE}
  return common.unsupported_primitives(resolve_activation(activation), rules)


# ----------------------------------------------------------------------------- entry point

INTERPRET_NUM_SMS = 2  # programs of the persistent loop in the simulator (CPU threads)


class WorkItems(NamedTuple):
  """The kernel's work items: int32 arrays of one length, padded to whole bands of BAND
  items (static loop bounds, `mosaic_gpu_kernel._snake`) with empty items, which the kernel
  skips; the windows start at multiples of `granule` (`window_granule`)."""

  granule: int
  windows: jax.Array
  item_start: jax.Array
  item_end: jax.Array
  group_ids: jax.Array

  @property
  def operands(self) -> tuple[jax.Array, ...]:
    """The arrays in the kernel's operand order."""
    return self.windows, self.item_start, self.item_end, self.group_ids


def work_items(counts, group_offset, m: int, tile_m: int, num_local: int) -> WorkItems:
  """The kernel's work items (`WorkItems`) for groups of `counts` rows."""
  granule = window_granule(m, counts.shape[0], tile_m)
  align, metadata_granule = _alignment(granule, tile_m)
  meta = metadata.make_tile_metadata(counts, m, tile_m, group_offset, num_local, align,
                                     granule=metadata_granule)
  windows = metadata.window_starts(meta, tile_m, align, metadata_granule)
  pad = (0, -meta.item_start.shape[0] % BAND)
  return WorkItems(granule, *(jnp.pad(a, pad) for a in (windows, meta.item_start,
                                                        meta.item_end, meta.group_ids)))


def _blocked(lhs, rhs, cfg: GmmConfig) -> bool:
  """Whether the call is the blocked quantized mode (fp8 training's gmms)."""
  return (isinstance(lhs, QArray) and isinstance(rhs, QArray)
          and quant_mode(lhs, rhs, cfg) == "blocked")


def _check_blocked(lhs, rhs, cfg: GmmConfig) -> None:
  """Refusals of the blocked mode beyond the m-grouping ones: fp8 value pairs, no zero
  points, one contraction block (`common.check_quant`), a multiple of 128 (one swizzled
  row of fp8 per wgmma K group), K a multiple of 16 (the TMA's 16-byte strides)."""
  common.check_quant(lhs, rhs, cfg, blocked_types=common.FP8_BLOCKED)
  if np.dtype(lhs.qtype) != np.dtype(rhs.qtype) and not MIXED_FP8:
    raise NotImplementedError(
        f"{SUPPORTED}; this jax's Mosaic GPU wgmma multiplies one fp8 type, got "
        f"{lhs.qtype} x {rhs.qtype}")
  k_block = common.blocked_k_block(lhs, rhs, cfg)  # checked above: not None
  _, k, _ = problem_dims(lhs.shape, rhs.shape, cfg)
  if k_block % FP8_K_STEP or k % 16:
    raise NotImplementedError(
        f"{SUPPORTED}; got contraction blocks of {k_block}, K={k}")


def _scale_columns(rhs: QArray, cfg: GmmConfig, width: int) -> str:
  """"uniform" when each warpgroup's `width` columns (starting at multiples of `width`)
  lie in one block of rhs scales (128 x 128 weight blocks), else "columns"."""
  axis = -2 if cfg.transpose_rhs else -1
  shared = rhs.scale.shape[axis] == 1 or rhs.tile[axis] % width == 0
  return "uniform" if shared else "columns"


def check_operands(lhs, rhs, cfg: GmmConfig) -> None:
  """Static refusals (shapes and dtypes only): NotImplementedError naming what is served."""
  if cfg.group_type != "m":
    raise NotImplementedError(f"{SUPPORTED}; got group_type={cfg.group_type!r}")
  if cfg.transpose_lhs:
    raise NotImplementedError(f"{SUPPORTED}; got a transposed lhs")
  if _blocked(lhs, rhs, cfg):
    _check_blocked(lhs, rhs, cfg)
  elif isinstance(lhs, QArray) or isinstance(rhs, QArray):
    raise NotImplementedError(f"{SUPPORTED}; got quantized operands (mode "
                              f"{quant_mode(lhs, rhs, cfg)})")
  else:
    dtypes = {np.dtype(lhs.dtype), np.dtype(rhs.dtype)}
    if len(dtypes) != 1 or dtypes.pop() not in (np.dtype(jnp.bfloat16),
                                                np.dtype(jnp.float16)):
      raise NotImplementedError(f"{SUPPORTED}; got {lhs.dtype} x {rhs.dtype}")
  _, k, n = problem_dims(lhs.shape, rhs.shape, cfg)
  if k == 0 or k % 8 or n % 8:
    raise NotImplementedError(f"{SUPPORTED}; got K={k}, N={n}")
  if not jnp.issubdtype(cfg.out_dtype, jnp.floating) or np.dtype(cfg.out_dtype).itemsize > 4:
    raise NotImplementedError(f"{SUPPORTED}; got out_dtype {cfg.out_dtype}")


def gmm_mosaic_gpu(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
                   tiling: Tiling | None = None):
  """m-grouped gmm on canonical operands (see `GmmConfig`) with the Mosaic GPU kernel.

  Args:
    lhs: ``[M, K]`` bf16 or f16.
    rhs: ``[num_local, K, N]`` (``[num_local, N, K]`` if ``cfg.transpose_rhs``), lhs's dtype.
    counts: int32 ``[G]`` global group sizes.
    group_offset: int32 scalar, the first global group held locally.
    bias: None or ``[num_local, N]``.
    cfg: the static options.
    tiling: tiles (see `check_tiling`); default ``cfg.tiling``, else `default_tiling`.
  Returns:
    ``[M, N]`` of ``cfg.out_dtype``; rows no local group owns are 0.

  Raises:
    NotImplementedError: see the module docstring (the dispatcher then tries Triton).
  """
  check_operands(lhs, rhs, cfg)
  simulated = jax_private.simulator(cfg.interpret) == "gpu"
  if cfg.interpret and not simulated:
    raise NotImplementedError(
        f"{SUPPORTED}; interpret=True: this kernel runs on the CPU only under jax's Mosaic "
        "GPU simulator (interpret=plgpu.InterpretGPUParams(...), jax >= 0.11); Triton's "
        "interpreter serves interpret=True")
  interpret = cfg.interpret if simulated else None
  num_sms = INTERPRET_NUM_SMS if cfg.interpret else _check_target()
  blocked = _blocked(lhs, rhs, cfg)
  rhs_qarray = rhs
  prepared = common.preamble(
      lhs, rhs, counts, cfg, tiling,
      default_tiling=functools.partial(default_tiling, blocked=blocked),
      check_tiling=functools.partial(check_tiling, blocked=blocked),
      unsupported=unsupported_primitives, backend="Pallas Mosaic GPU",
      implementation="pallas_mosaic_gpu", platform="gpu",
      blocked_types=common.FP8_BLOCKED if blocked else ())
  if prepared.empty:
    return jnp.zeros(prepared.out_shape, cfg.out_dtype)
  lhs, rhs, tiling = prepared.lhs, prepared.rhs, prepared.tiling
  m, k, n = prepared.dims
  n_tiles = pl.cdiv(n, tiling.tile_n)
  items = work_items(counts, group_offset, m, tiling.tile_m, cfg.num_local)
  if blocked and tiling.tile_k != prepared.quant.k_block:
    raise NotImplementedError(
        f"{SUPPORTED}; the blocked mode's K step is the scale block "
        f"({prepared.quant.k_block}), got {tiling}")
  scale_columns = None  # the blocked mode's rhs scales (see `_scale_columns`)
  if blocked:
    width = tiling.tile_n // (COMPUTE_WGS if warp_specialized(tiling) else 1)
    scale_columns = _scale_columns(rhs_qarray, cfg, width)
  if blocked and not cfg.transpose_rhs:
    # fp8 wgmma reads B K-major only: the weights [L, K, N] become [L, N, K] (one pass over
    # the fp8 values, a copy XLA can fuse into the op that quantized them).
    rhs = jnp.swapaxes(rhs, 1, 2)
    cfg = dataclasses.replace(cfg, transpose_rhs=True)
  operands = [*items.operands, lhs, rhs]
  if bias is not None:  # whole N tiles: the epilogue loads tile_n bias columns
    operands.append(jnp.pad(bias, ((0, 0), (0, n_tiles * tiling.tile_n - n))))
  if blocked:  # scale rows per K block: [Kb, M] padded by a window, [L, Kb, whole N tiles]
    quant = prepared.quant
    operands.append(jnp.pad(quant.lhs_scale.T, ((0, 0), (0, tiling.tile_m))))
    operands.append(jnp.pad(quant.rhs_scale, ((0, 0), (0, 0), (0, n_tiles * tiling.tile_n - n))))
  stages = _stages(tiling, k, lhs.dtype.itemsize, cfg.out_dtype.itemsize)
  specialized = warp_specialized(tiling)
  threads = {"num_threads": COMPUTE_WGS + 1, "thread_name": "wg"} if specialized else {}
  out = jax.new_ref(jnp.zeros((m, n), cfg.out_dtype))
  common.note_launch(prepared, "gmm_m_mosaic_gpu", (num_sms,), dataclasses.astuple(tiling),
                     warps=4 * threads.get("num_threads", 1))
  plgpu.kernel(
      kernel_body(KernelPlan(dims=(m, k, n), tiling=tiling, cfg=cfg,
                             has_bias=bias is not None, stages=stages,
                             granule=items.granule, blocked=scale_columns)),
      out_type=(),
      grid=(num_sms,),
      grid_names=("sm",),
      **threads,
      compiler_params=plgpu.CompilerParams(lowering_semantics=LOWERING_SEMANTICS),
      **({} if interpret is None else {"interpret": interpret}),
  )(*operands, out)
  return jax.freeze(out) if hasattr(jax, "freeze") else out[...]
