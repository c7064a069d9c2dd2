"""Pallas Mosaic GPU gmm kernel bodies for Hopper (sm_90a), launched by `mosaic_gpu`.

One persistent kernel: a grid of as many programs as the GPU has SMs, each looping over
(work item, N tile) pairs in an L2-friendly order (`_snake`: a band of BAND consecutive
work items, mostly of one group, walks the N tiles together, every other band backwards, so
the band's lhs rows and each rhs tile are read from HBM about once).

Per (item, N tile): a multi-stage TMA -> shared-memory ring feeds wgmma with f32
accumulators in registers. Tiles of 128 or more columns are warp-specialized
(`plgpu.emit_pipeline_warp_specialized`): a producer warpgroup issues the TMA loads, two
consumer warpgroups each multiply the window by one half of the columns; narrower tiles run
one warpgroup (`plgpu.emit_pipeline`). One wgmma stays in flight (its stage is released a
step later). The K edge is zero-filled by the TMA (each dimension of the descriptor is
bounded separately, so a K block past K reads zeros, never the next group's weights).
Each consumer's epilogue adds the group's bias, applies the activation, casts, writes its
tile to shared memory and stores only the item's rows with TMA stores of 2^j rows each (a
static ladder of descriptors: the row count is only known at run time), so rows of other
groups in the window are never written; columns past N are clipped by the TMA. The output
is a zero array passed in as a mutable Ref (aliased), so rows no item owns (past the group
total, or of groups that are not local) stay exactly 0. A tile's stores overlap the next
tile's main loop (they are waited for before the staging buffer is rewritten).

Blocked fp8 (fp8 training's forward and dlhs gmms: QArrays of e4m3 / e5m2 values whose
scales vary along K, 1 x 128 activations and 128 x 128 weights): the K step is the scale
block (`common.with_quant_k_step`, a multiple of 128: one 128-byte swizzled row of fp8),
each step's wgmma (``f32.e4m3.e4m3``, or ``e5m2.e4m3`` for an E5M2 gradient) accumulates
into a fresh f32 accumulator, which is waited for and added to the running sum (a pipeline
carry in registers) times the step's lhs scale column and rhs scale row, read from GMEM
while the wgmma runs. fp8 wgmma reads both operands K-major (only 16-bit types take a
transpose flag), so the forward's weights ``[L, K, N]`` are transposed to ``[L, N, K]`` by
XLA before the kernel (`mosaic_gpu`); the dlhs's (``transpose_rhs``) already are. Two
accumulators per consumer warpgroup: tiles of at most 64 x 128 elements each.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import NamedTuple

import jax
import jax.numpy as jnp

from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.core.epilogue import apply_epilogue, resolve_activation
from gmm_jax.pallas.jax_pallas import mosaic_gpu as plgpu, pl

# A jax without (this much of) Pallas Mosaic GPU raises ImportError here or above, and
# backends.py then skips the registration.
_NEEDED = ("kernel", "emit_pipeline", "wgmma", "wgmma_wait", "ACC", "SMEM", "BlockSpec",
           "nd_loop", "TilingTransform", "SwizzleTransform", "find_swizzle",
           "copy_smem_to_gmem", "commit_smem", "commit_smem_to_gmem_group",
           "wait_smem_to_gmem", "load", "Layout", "LoweringSemantics")
_MISSING = [name for name in _NEEDED if not hasattr(plgpu, name)]
if _MISSING or not hasattr(jax, "new_ref"):
  raise ImportError(f"this jax's Pallas Mosaic GPU lacks {_MISSING or ['jax.new_ref']}")

COMPUTE_WGS = 2  # warp-specialized kernel: consumer warpgroups, each owning tile_n / 2 columns
BAND = 8  # work items walked together over the N tiles (L2 reuse of rhs tiles)


@dataclasses.dataclass(frozen=True)
class KernelPlan:
  """What the wrapper decides for one launch and the kernel bodies close over.

  Attributes:
    dims: (M, K, N) of the product.
    tiling: the tiles (checked by `mosaic_gpu.check_tiling`).
    cfg: the static options (``transpose_rhs`` set for the blocked mode's K-major weights).
    has_bias: whether a ``[num_local, whole N tiles]`` bias operand follows rhs.
    stages: the depth of the TMA ring.
    granule: the rows the work items' windows start at multiples of.
    blocked: None, or the blocked mode's rhs scales: "uniform" (one scale per warpgroup's
      columns and K block) or "columns" (a row of them).
  """

  dims: tuple[int, int, int]
  tiling: Tiling
  cfg: GmmConfig
  has_bias: bool
  stages: int
  granule: int
  blocked: str | None = None


def warp_specialized(tiling: Tiling) -> bool:
  """Tiles of at least 128 columns run warp-specialized (two consumer warpgroups)."""
  return tiling.tile_n >= 128 and hasattr(plgpu, "emit_pipeline_warp_specialized")


def kernel_body(plan: KernelPlan):
  """The kernel body of `plan` for `plgpu.kernel`: warp-specialized (`_kernel_ws`) or one
  warpgroup (`_kernel`)."""
  return functools.partial(_kernel_ws if warp_specialized(plan.tiling) else _kernel,
                           plan=plan)


def _transforms(shape, dtype, rows_per_tile: int = 8):
  swizzle = plgpu.find_swizzle(shape[-1] * jnp.dtype(dtype).itemsize * 8)
  elements = swizzle // jnp.dtype(dtype).itemsize
  return (plgpu.TilingTransform((rows_per_tile, elements)), plgpu.SwizzleTransform(swizzle))


_LOAD_TAKES_INDEX = "idx" in inspect.signature(plgpu.load).parameters


def _load(ref, layout):
  """`plgpu.load` across jax versions (0.10 takes an index argument)."""
  if _LOAD_TAKES_INDEX:
    return plgpu.load(ref, (), layout=layout, optimized=False)
  return plgpu.load(ref, layout=layout, optimized=False)


def _snake(linear, n_tiles: int):
  """(work item, N tile) of the `linear`-th unit of work: bands of BAND consecutive items
  walk the N tiles together, every other band backwards (the rhs tile at the turn is still
  in L2). Only static divisors: a division by a run-time value is a subroutine call in
  SASS, and ptxas then serializes every wgmma of the kernel."""
  per_band = BAND * n_tiles
  band = linear // per_band
  within = linear % per_band
  n_tile = within // BAND
  n_tile = jnp.where(band % 2 == 1, n_tiles - 1 - n_tile, n_tile)
  return band * BAND + within % BAND, n_tile


def _specs(tiling: Tiling, cfg: GmmConfig, dtype, delay_release: int):
  """BlockSpecs of the lhs window ``[tile_m, K]`` and the rhs columns ``[K, tile_n]`` (or
  ``[tile_n, K]``) in K steps, tiled and swizzled for wgmma."""
  tile_m, tile_k, tile_n = tiling.tile_m, tiling.tile_k, tiling.tile_n
  rhs_block = (tile_n, tile_k) if cfg.transpose_rhs else (tile_k, tile_n)
  rhs_index = (lambda step: (0, step)) if cfg.transpose_rhs else (lambda step: (step, 0))
  return [plgpu.BlockSpec((tile_m, tile_k), lambda step: (0, step),
                          transforms=_transforms((tile_m, tile_k), dtype),
                          delay_release=delay_release),
          plgpu.BlockSpec(rhs_block, rhs_index, transforms=_transforms(rhs_block, dtype),
                          delay_release=delay_release)]


def _store_rows(acc, out_smem, out_gmem, bias_gmem, group, window, start, size, cols,
                activation):
  """The epilogue of one accumulator tile: bias, activation, cast, then TMA stores of the
  item's `size` rows only (from row ``start - window`` of the tile), one per set bit of
  `size` (a descriptor's row count is static). The staging buffer is rewritten only after
  the previous tile's stores have read it."""
  tile_m, width = acc.shape
  bias = None
  if bias_gmem is not None:  # padded to whole N tiles by the wrapper
    bias = _load(bias_gmem.at[group, cols], plgpu.Layout.WGMMA.reduce(0))
    bias = jax.lax.broadcast_in_dim(bias.astype(jnp.float32), (tile_m, width), (1,))
  out = apply_epilogue(acc, bias, activation, out_smem.dtype)
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  out_smem[...] = out
  plgpu.commit_smem()
  offset = start - window
  chunk = tile_m
  while chunk:
    @pl.when(size & chunk != 0)
    def _store(chunk=chunk, offset=offset):
      plgpu.copy_smem_to_gmem(out_smem.at[pl.ds(offset, chunk)],
                              out_gmem.at[pl.ds(window + offset, chunk), cols],
                              commit_group=False)
    offset = offset + (size & chunk)
    chunk //= 2
  plgpu.commit_smem_to_gmem_group()


def _out_smem(shape, dtype):
  # Rows of the staging tile are stored from any row offset: tiles of 1 row.
  return plgpu.SMEM(shape, dtype, transforms=_transforms(shape, dtype, 1))


def _zero_acc(shape):
  """A zero f32 accumulator value in registers (the running sum of the blocked mode)."""
  return plgpu.layout_cast(jnp.zeros(shape, jnp.float32), plgpu.Layout.WGMMA)


class _Scales(NamedTuple):
  """The blocked mode's scale operands: lhs ``[Kb, M + tile_m]`` and rhs ``[L, Kb, N
  tiles]`` (padded by the wrapper so that a window past M or a tile past N reads no
  further), and whether each warpgroup's columns share one rhs scale per K block (128 x 128
  weight blocks: one scalar a step instead of a row)."""

  lhs: object
  rhs: object
  uniform_columns: bool


def _scales(refs, plan: KernelPlan) -> _Scales | None:
  """The blocked mode's scale operands, after the bias among the kernel's `refs`."""
  if not plan.blocked:
    return None
  return _Scales(*refs[plan.has_bias:plan.has_bias + 2], plan.blocked == "uniform")


def _blocked_step(acc, lhs_smem, rhs_smem, step, scales: _Scales, window, group, first_col):
  """One scale block of the blocked fp8 mode: ``acc + (lhs @ rhs) * lhs_scale column *
  rhs_scale row``, the block's product in a fresh f32 wgmma accumulator.

  `rhs_smem` is the K-major ``[K, width]`` view (fp8 wgmma reads both operands K-major).
  The scales are read from GMEM before the wgmma is issued, so their latency hides behind
  the MMA. With one rhs scale for the warpgroup's columns, the two scales meet on the rows
  (a few values a thread) and each element costs one multiply-add.
  """
  tile_m, width = acc.shape
  lhs_scale = _load(scales.lhs.at[step, pl.ds(window, tile_m)], plgpu.Layout.WGMMA.reduce(1))
  if scales.uniform_columns:
    lhs_scale = lhs_scale * scales.rhs[group, step, first_col]
  else:
    rhs_scale = _load(scales.rhs.at[group, step, pl.ds(first_col, width)],
                      plgpu.Layout.WGMMA.reduce(0))

  def block(block_ref):
    plgpu.wgmma(block_ref, lhs_smem, rhs_smem)
    return block_ref[...]  # waits for this wgmma

  product = pl.run_scoped(block, plgpu.ACC((tile_m, width), jnp.float32))
  scale = jax.lax.broadcast_in_dim(lhs_scale, (tile_m, width), (0,))
  if not scales.uniform_columns:
    scale = scale * jax.lax.broadcast_in_dim(rhs_scale, (tile_m, width), (1,))
  return acc + product * scale


class _Work:
  """The scalars of one (work item, N tile)."""

  def __init__(self, refs, linear, n_tiles: int, granule: int, tile_n: int):
    window_ref, start_ref, end_ref, group_ref = refs
    item, n_tile = _snake(linear, n_tiles)
    self.start = start_ref[item]
    self.size = end_ref[item] - self.start  # 0 for padding items
    # The TMA addresses the window's first row as (row // 8, row % 8): a multiple of 8.
    self.window = pl.multiple_of(window_ref[item], granule)
    self.group = group_ref[item]
    self.n_first = pl.multiple_of(n_tile * tile_n, tile_n)


def _kernel(window_ref, start_ref, end_ref, group_ref, lhs_gmem, rhs_gmem, *refs,
            plan: KernelPlan):
  """One warpgroup per program: the TMA ring (`emit_pipeline`) and wgmma in one thread."""
  tiling, cfg, stages, granule, blocked = (plan.tiling, plan.cfg, plan.stages, plan.granule,
                                           plan.blocked)
  bias_gmem = refs[0] if plan.has_bias else None
  scales = _scales(refs, plan)
  out_gmem = refs[-1]  # the aliased zero buffer (a Ref operand), written in place
  _, k, n = plan.dims
  tile_m, tile_k, tile_n = tiling.tile_m, tiling.tile_k, tiling.tile_n
  n_tiles = pl.cdiv(n, tile_n)
  num_items = window_ref.shape[0]  # a multiple of BAND (see `_snake`)
  activation = resolve_activation(cfg.activation)
  # Keep one wgmma in flight: its stage is released a step later (with 2+ steps). The
  # blocked mode waits for each block's product (it scales it), so nothing stays in flight.
  in_flight = 1 if pl.cdiv(k, tile_k) > 1 and not blocked else 0
  specs = _specs(tiling, cfg, lhs_gmem.dtype, delay_release=in_flight)

  def mma(_, lhs_smem, rhs_smem, acc_ref):
    plgpu.wgmma(acc_ref, lhs_smem, rhs_smem.T if cfg.transpose_rhs else rhs_smem)
    plgpu.wgmma_wait(in_flight)
    return acc_ref

  @functools.partial(pl.run_scoped, out_smem=_out_smem((tile_m, tile_n), out_gmem.dtype))
  def _scope(out_smem):
    @plgpu.nd_loop((num_items * n_tiles,), collective_axes="sm")
    def _loop(loop_info):
      work = _Work((window_ref, start_ref, end_ref, group_ref), loop_info.index[0], n_tiles,
                   granule, tile_n)

      @pl.when(work.size > 0)  # padding items are empty
      def _item():
        cols = pl.ds(work.n_first, tile_n)
        rhs_cols = rhs_gmem.at[work.group, cols, :] if cfg.transpose_rhs else rhs_gmem.at[
            work.group, :, cols]

        operands = (lhs_gmem.at[pl.ds(work.window, tile_m), :], rhs_cols)
        if blocked:
          def scaled(indices, lhs_smem, rhs_smem, acc):
            return _blocked_step(acc, lhs_smem, rhs_smem.T, indices[0], scales,
                                 work.window, work.group, work.n_first)

          acc = plgpu.emit_pipeline(scaled, grid=(pl.cdiv(k, tile_k),), in_specs=specs,
                                    max_concurrent_steps=stages,
                                    init_carry=_zero_acc((tile_m, tile_n)))(*operands)
        else:
          def accumulate(acc_ref):
            plgpu.emit_pipeline(functools.partial(mma, acc_ref=acc_ref),
                                grid=(pl.cdiv(k, tile_k),), in_specs=specs,
                                max_concurrent_steps=stages)(*operands)
            return acc_ref[...]

          acc = pl.run_scoped(accumulate, plgpu.ACC((tile_m, tile_n), jnp.float32))
        _store_rows(acc, out_smem, out_gmem, bias_gmem, work.group, work.window, work.start,
                    work.size, cols, activation)

    plgpu.wait_smem_to_gmem(0)


def _ignore(*_, **__):
  """A pipeline body and context for `get_allocations` (which do not depend on them)."""
  return None


def _kernel_ws(window_ref, start_ref, end_ref, group_ref, lhs_gmem, rhs_gmem, *refs,
               plan: KernelPlan):
  """Warp-specialized: a producer warpgroup issues the TMA loads of the ring, two consumer
  warpgroups run wgmma on the two column halves of the tile and store their halves."""
  tiling, cfg, granule, blocked = plan.tiling, plan.cfg, plan.granule, plan.blocked
  bias_gmem = refs[0] if plan.has_bias else None
  scales = _scales(refs, plan)
  out_gmem = refs[-1]
  _, k, n = plan.dims
  tile_m, tile_k, tile_n = tiling.tile_m, tiling.tile_k, tiling.tile_n
  half = tile_n // COMPUTE_WGS
  n_tiles = pl.cdiv(n, tile_n)
  num_items = window_ref.shape[0]
  activation = resolve_activation(cfg.activation)
  in_flight = 1 if pl.cdiv(k, tile_k) > 1 and not blocked else 0
  specs = _specs(tiling, cfg, lhs_gmem.dtype, delay_release=in_flight)

  def pipeline(body, context):
    return plgpu.emit_pipeline_warp_specialized(
        body, grid=(pl.cdiv(k, tile_k),), memory_registers=40, in_specs=specs,
        wg_axis="wg", num_compute_wgs=COMPUTE_WGS, max_concurrent_steps=plan.stages,
        compute_context=context)

  @functools.partial(
      pl.run_scoped,
      allocations=pipeline(_ignore, _ignore).get_allocations(lhs_gmem, rhs_gmem.at[0]),
      out_smem=_out_smem((COMPUTE_WGS, tile_m, half), out_gmem.dtype),
      collective_axes="wg")
  def _scope(allocations, out_smem):
    wg = jax.lax.axis_index("wg")

    @plgpu.nd_loop((num_items * n_tiles,), collective_axes="sm")
    def _loop(loop_info):
      work = _Work((window_ref, start_ref, end_ref, group_ref), loop_info.index[0], n_tiles,
                   granule, tile_n)
      halves = pl.ds(wg * half, half)

      half_cols = pl.ds(pl.multiple_of(work.n_first + wg * half, half), half)

      def mma(indices, lhs_smem, rhs_smem, acc_ref):
        rhs_half = rhs_smem.at[halves, :].T if cfg.transpose_rhs else rhs_smem.at[:, halves]
        if blocked:  # the carry is the running sum's value
          return _blocked_step(acc_ref, lhs_smem, rhs_half, indices[0], scales,
                               work.window, work.group, work.n_first + wg * half)
        plgpu.wgmma(acc_ref, lhs_smem, rhs_half)
        plgpu.wgmma_wait(in_flight)
        return acc_ref

      def context(eval_pipeline):
        if blocked:
          acc = eval_pipeline(_zero_acc((tile_m, half)))
          _store_rows(acc, out_smem.at[wg], out_gmem, bias_gmem, work.group, work.window,
                      work.start, work.size, half_cols, activation)
          return

        @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((tile_m, half), jnp.float32))
        def _acc(acc_ref):
          eval_pipeline(acc_ref)
          _store_rows(acc_ref[...], out_smem.at[wg], out_gmem, bias_gmem, work.group,
                      work.window, work.start, work.size, half_cols, activation)

      @pl.when(work.size > 0)  # the same branch in every warpgroup
      def _item():
        cols = pl.ds(work.n_first, tile_n)
        rhs_cols = rhs_gmem.at[work.group, cols, :] if cfg.transpose_rhs else rhs_gmem.at[
            work.group, :, cols]
        pipeline(mma, context)(lhs_gmem.at[pl.ds(work.window, tile_m), :], rhs_cols,
                               allocations=allocations)

    plgpu.wait_smem_to_gmem(0)
