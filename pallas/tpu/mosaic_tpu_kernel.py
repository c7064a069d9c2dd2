"""The Mosaic TPU gmm kernel bodies: `m_kernel` (m-grouping) and `k_kernel` (k-grouping).

m-grouping, grid ``(N tiles, steps, K tiles)`` with the step count read from a scalar (a
dynamic grid bound: only the steps that exist are visited). The steps are those of the
scalar-prefetched `metadata.TileWalk`: one per (row tile, local group it touches), plus a
*zero step* for every row tile that no local group touches, so every output tile is written
exactly once and rows no step owns (past the group total, of remote groups) are zeros
written by the kernel itself: no pass over the output after the call. A zero step does no
compute and repeats a neighbouring step's input block indices (no DMA; `Step`). An item that
owns part of a row tile computes only the `row_chunk`-row slices it touches (the MXU's rows),
not the whole tile.

k-grouping, grid ``(M tiles, N tiles, items)`` (items over K, built with ``cover=True`` so an
empty group has one zero-column item and its output is ``activation(bias)``): the
accumulator is reset at a group's first item, takes the item's K columns (only items that do
not cover their whole K tile mask the other groups' columns) and is finalised into
``out[g]`` at the group's last item. A heavy group is just more consecutive items; output
tiles cover M and N where VMEM allows, so each operand is read ``N/tile_n`` or
``M/tile_m`` times.

Quantized m-grouping: int8 x int8 ("scaled") multiplies int8 on the MXU into int32 and
applies both scales in the epilogue. Weight-only dequantizes the weight tile to the dot dtype
(``(w - zero) * scale``, the composed XLA path's numerics); with one K step the dequantized
tile is cached in VMEM and redone only when the group (or column block) changes, so it is
paid once per group and column block, not once per item. fp8 weights are always dequantized:
the MXU path used on v5e/v6e is bf16/int8. Blocked fp8 (both group types): one dot per scale
block (`mosaic_tpu_fp8`).

Epilogue: a gated activation keeps one accumulator per half (gate and up column blocks) and
applies the activation to the pair; row weights multiply the rows after the activation, in
f32 before the cast (`tile_epilogue`). A gated prologue (m-grouping) applies the gated
activation to z's gate and up K blocks before the dot; a gated-cotangent epilogue writes the
cotangents of z's gate and up tiles of each complete row tile by DMA.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax.numpy as jnp
from jax import lax

from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.tiling.cost_models import DEQUANT_ROWS
from gmm_jax.pallas import common
from gmm_jax.pallas.tpu.mosaic_tpu_fp8 import block_widths, blocked_product, dot_values
from gmm_jax.pallas.tpu.mosaic_tpu_plan import k_chunks, out_row_chunk
from gmm_jax.pallas.tpu.mosaic_tpu_tile import (GATED_PAIRS, dequantized, dot, mask_k,
                                                tile_epilogue)
from gmm_jax.pallas.jax_pallas import pl, tpu as pltpu


class Step:
  """What grid step `i` of the m-grouped kernel works on, read from the `metadata.TileWalk`
  (the scalar-prefetched ``ranges, row_starts, steps_end``) with a few scalar reads
  (`metadata.walk_step`); for the index maps and the kernel body alike.

  A step that owns no rows (before the first or after the last real step) borrows the
  group, lhs tile and K block of the nearest real step: its block indices repeat a
  neighbour's, so it fetches nothing.
  """

  def __init__(self, walk, i, *, m: int, tile_m: int, num_local: int, k_steps: int):
    (self.out_tile, self.start, self.end, self.real, self.group, self.lhs_tile,
     self._after) = metadata.walk_step(*walk[:3], i, dim_size=m, tile=tile_m,
                                       num_local=num_local)
    self._k_steps = k_steps

  def k_block(self, k_i):
    """The K block: the grid's for a real step, the last one after the real steps, else
    the first."""
    return jnp.where(self.real, k_i, jnp.where(self._after, self._k_steps - 1, 0))


# ------------------------------------------------------------------------- m-grouping


class _MRefs(NamedTuple):
  """The m-grouped kernel's refs by role (None: absent), in the call's operand order."""

  lhs: Any
  # A gated prologue: lhs holds z [M, 2K]; the up half's K block is K/tile_k blocks later.
  lhs_up: Any
  rhs: Any
  up: Any  # a gated activation: rhs's up column block (N/2 later)
  biases: list | None  # the bias row of each rhs column block (gate and up when gated)
  scale: Any
  zero: Any
  lhs_scale: Any
  weights: Any  # [tile_m, 1] f32 row weights
  z: tuple | None  # a gated-cotangent epilogue: z's gate and up tiles beside the output tile
  out: Any
  accs: list | None  # an accumulator per rhs column block, with several K steps
  cache: Any  # one K step of weight-only quantization: the dequantized weight tile
  cached: Any  # and the group it holds (SMEM)
  # A gated-cotangent epilogue: the output stays in HBM and gets the two cotangent tiles of
  # each row tile by DMA, from a VMEM pair that the row tile's items fill.
  pair: Any
  sems: Any

  @property
  def tile(self):
    """The output tile the program writes: the VMEM pair of a cotangent epilogue, else the
    output block."""
    return self.out if self.pair is None else self.pair


def _m_refs(refs, *, quant, gated: bool, has_bias: bool, weighted: bool, cotangent: bool,
            prologue: bool, k_steps: int, weight_cache: bool) -> _MRefs:
  """The kernel's refs (after the scalars) by role."""
  refs = list(refs)

  def take(present: bool):
    return refs.pop(0) if present else None

  lhs, lhs_up, rhs, up = refs.pop(0), take(prologue), refs.pop(0), take(gated)
  biases = [refs.pop(0) for _ in range(2 if gated else 1)] if has_bias else None
  scale = take(quant is not None)
  zero = take(quant is not None and quant.has_zero)
  lhs_scale = take(quant is not None and quant.mode != "weight_only")
  weights = take(weighted)
  z = (refs.pop(0), refs.pop(0)) if cotangent else None
  out = refs.pop(0)
  accs = [refs.pop(0) for _ in range(2 if gated else 1)] if k_steps > 1 else None
  cache, cached = (refs.pop(0), refs.pop(0)) if weight_cache else (None, None)
  pair, sems = (refs.pop(0), refs.pop(0)) if cotangent else (None, None)
  return _MRefs(lhs=lhs, lhs_up=lhs_up, rhs=rhs, up=up, biases=biases, scale=scale,
                zero=zero, lhs_scale=lhs_scale, weights=weights, z=z, out=out, accs=accs,
                cache=cache, cached=cached, pair=pair, sems=sems)


class _MProgram:
  """One program of the m-grouped kernel: grid step ``(column block, item, K step)`` on the
  refs of `_m_refs`, its phases traced in `run`'s order."""

  def __init__(self, walk, refs: _MRefs, *, dims, tiling: Tiling, cfg: GmmConfig, dot_dtype,
               acc_dtype, k_steps: int, row_chunk: int, weight_cache: bool,
               quant: common.QuantStatic | None, gated: bool, prologue: bool):
    self.refs, self.dims, self.tiling, self.cfg = refs, dims, tiling, cfg
    self.dot_dtype, self.acc_dtype, self.k_steps = dot_dtype, acc_dtype, k_steps
    self.row_chunk, self.weight_cache, self.quant = row_chunk, weight_cache, quant
    self.gated, self.prologue = gated, prologue
    self.blocked = quant is not None and quant.mode == "blocked"
    self.weight_only = quant is not None and quant.mode == "weight_only"
    self.k = dims[1]
    self.tile_m, self.tile_k = tiling.tile_m, tiling.tile_k
    self.mask_edge = k_steps > 1 and self.k % self.tile_k != 0
    self.column, self.item, self.k_step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    self.last_k = self.k_step == k_steps - 1
    self.at = functools.partial(Step, walk, m=dims[0], tile_m=self.tile_m,
                                num_local=cfg.num_local, k_steps=k_steps)
    self.step = self.at(self.item)
    self.tile_lo = self.step.out_tile * self.tile_m
    self.first_in_tile = (self.item == 0) | (
        self.at(jnp.maximum(self.item - 1, 0)).out_tile != self.step.out_tile)

  def run(self):
    """Zeroes the rows no item owns, fills the weight cache, computes the item's rows and
    (a gated-cotangent epilogue) writes the complete row tile's cotangents."""
    tile_ref = self.refs.tile

    @pl.when(self.last_k & self.first_in_tile)
    def _():  # rows of this tile that no item owns stay zero
      tile_ref[...] = jnp.zeros(tile_ref.shape, tile_ref.dtype)

    if self.weight_cache:
      self._fill_weight_cache()
    self._item_rows()
    if self.refs.pair is not None:
      self._write_cotangents()

  def _fill_weight_cache(self):
    """One K step: casts the weight tile once per group and column block."""
    refs, cfg = self.refs, self.cfg
    group = self.step.group

    @pl.when(self.item == 0)  # a new column block (or core): nothing cached yet
    def _():
      refs.cached[0] = -1

    @pl.when(self.step.real & (refs.cached[0] != group))
    def _():
      # In slices of DEQUANT_ROWS stored rows, so the f32 temporaries stay small.
      for lo in range(0, refs.cache.shape[0], DEQUANT_ROWS):
        hi = min(lo + DEQUANT_ROWS, refs.cache.shape[0])
        scale = refs.scale[lo:hi, :] if cfg.transpose_rhs else refs.scale[...]
        zero = None if refs.zero is None else (
            refs.zero[lo:hi, :] if cfg.transpose_rhs else refs.zero[...])
        refs.cache[lo:hi, :] = common.dequantize_tile(refs.rhs[lo:hi, :], scale, zero,
                                                      cfg.transpose_rhs, self.dot_dtype)
      refs.cached[0] = group

  def _weights(self, w_ref):
    """The whole weight block as the dot takes it: cached, dequantized or as stored."""
    if self.weight_cache:
      return self.refs.cache[...]
    if self.weight_only:
      return dequantized(w_ref, self.refs.scale, self.refs.zero, self.cfg, self.dot_dtype)
    return w_ref[...]

  def _w_refs(self):
    return (self.refs.rhs, self.refs.up) if self.gated else (self.refs.rhs,)

  def _chunk_product(self, span, ks, first, masked: bool):
    """The product over the K columns `ks` of the step's block (None: all of them; the
    first is the problem's column `first`) on the lhs rows `span`, for each rhs column
    block."""
    refs, cfg, dot_dtype = self.refs, self.cfg, self.dot_dtype
    whole = ks is None
    ks = slice(None) if whole else ks
    if self.prologue:  # act(gate, up) in f32, rounded to lhs's dtype (`epilogue.prologue_input`)
      x = GATED_PAIRS[cfg.lhs_activation](
          refs.lhs[span, ks].astype(jnp.float32),
          refs.lhs_up[span, ks].astype(jnp.float32)).astype(refs.lhs.dtype)
      x = dot_values(x, dot_dtype)
    else:
      x = dot_values(refs.lhs[ks, span] if cfg.transpose_lhs
                     else refs.lhs[span, ks], dot_dtype)
    if masked:  # the padded K edge of the last step reads garbage: zero it in both
      x = mask_k(x, first, 0, self.k, 0 if cfg.transpose_lhs else 1)
    out = []
    for w_ref in self._w_refs():
      w = dot_values(self._weights(w_ref) if whole else (
          w_ref[:, ks] if cfg.transpose_rhs else w_ref[ks, :]), dot_dtype)
      if masked:
        w = mask_k(w, first, 0, self.k, 1 if cfg.transpose_rhs else 0)
      out.append(dot(x, w, cfg, dot_dtype, self.acc_dtype))
    return out

  def _products(self, span, size: int, masked: bool):
    """The step's product on the lhs rows `span` (`size` of them) for each rhs column block
    (gate and up when gated)."""
    refs, tile_k, k_step = self.refs, self.tile_k, self.k_step
    if self.blocked:  # one dot per scale block of this K step, times its row and column scales
      return [blocked_product(refs.lhs, refs.rhs, refs.lhs_scale, refs.scale, span,
                              k_step * len(block_widths(tile_k, self.quant.k_block)),
                              self.cfg, self.quant.k_block, self.dot_dtype, self.acc_dtype,
                              (k_step * tile_k, 0, self.k) if masked else None)]
    chunks = k_chunks(tile_k, self.weight_cache or self.weight_only)
    if chunks == 1:
      return self._chunk_product(span, None, k_step * tile_k, masked)
    # `k_chunks` columns at a time in a loop: Mosaic compiles one chunk's MXU code instead
    # of the whole block's (its compile time grows with the unrolled code); the block's DMA
    # and the grid are unchanged.
    width_k = tile_k // chunks

    def chunk_body(c, accs):
      lo_k = pl.multiple_of(c * width_k, width_k)
      parts = self._chunk_product(span, pl.ds(lo_k, width_k), k_step * tile_k + lo_k, masked)
      return tuple(acc + part for acc, part in zip(accs, parts))

    width = refs.rhs.shape[0] if self.cfg.transpose_rhs else refs.rhs.shape[1]
    init = tuple(jnp.zeros((size, width), self.acc_dtype) for _ in self._w_refs())
    return list(lax.fori_loop(0, chunks, chunk_body, init))

  def _finish(self, span, lo, accs):
    """The epilogue of the tile rows ``lo + [0, size)`` (`span`) from their sums: written
    where the item owns the row (a cotangent epilogue: the cotangent pair's rows)."""
    refs, cfg = self.refs, self.cfg
    if refs.lhs_scale is not None and not self.blocked:  # int8 x int8: int32 sums, then scales
      accs = [acc.astype(jnp.float32) * refs.lhs_scale[span, :] * refs.scale[...]
              for acc in accs]
    biases = [None] * len(accs) if refs.biases is None else [b[...] for b in refs.biases]
    row_weights = None if refs.weights is None else refs.weights[span, :]
    y = tile_epilogue(accs, biases, cfg, row_weights)
    row = self.tile_lo + lo + lax.broadcasted_iota(jnp.int32, y.shape, 0)
    mine = (row >= self.step.start) & (row < self.step.end)
    if refs.pair is not None:
      halves = common.gated_cotangent_tiles(GATED_PAIRS[cfg.cotangent_of],
                                            refs.z[0][span, :], refs.z[1][span, :], y)
      for h, d in enumerate(halves):
        refs.pair[h, span, :] = jnp.where(mine, d.astype(refs.pair.dtype),
                                          refs.pair[h, span, :])
      return
    refs.out[span, :] = jnp.where(mine, y, refs.out[span, :])

  def _rows(self, lo, size: int):
    """The item's work on the rows ``[lo, lo + size)`` of the tile (`lo` static, or traced
    and a multiple of `row_chunk`)."""
    span = pl.ds(lo, size)
    if self.k_steps == 1:
      self._finish(span, lo, self._products(span, size, False))
    elif self.blocked:
      self._blocked_steps(span, size, lo)
    else:
      self._steps(span, size, lo)

  def _blocked_steps(self, span, size: int, lo):
    """Several K steps of blocked fp8: one copy of the (per-block unrolled) product per
    variant, not three."""
    own, acc_refs, last_k = (span, slice(None)), self.refs.accs, self.last_k

    @pl.when(self.k_step == 0)
    def _():
      for acc_ref in acc_refs:
        acc_ref[own] = jnp.zeros((size, acc_ref.shape[1]), acc_ref.dtype)

    def accumulate(masked: bool):
      for acc_ref, part in zip(acc_refs, self._products(span, size, masked)):
        acc_ref[own] += part

    if self.mask_edge:  # the padded K edge only on the last step
      pl.when(~last_k)(functools.partial(accumulate, False))
      pl.when(last_k)(functools.partial(accumulate, True))
    else:
      accumulate(False)
    pl.when(last_k)(lambda: self._finish(span, lo, [acc_ref[own] for acc_ref in acc_refs]))

  def _steps(self, span, size: int, lo):
    """Several K steps. The step's product is traced once, outside the branches that use
    it: a copy per branch (first, middle, last K step) tripled the kernel's unrolled MXU
    code and Mosaic's compile time, for the same work at run time. A ragged K edge masks
    the last step's product: that step gets its own (masked) copy, the others share one."""
    own, acc_refs, k_step, last_k = (span, slice(None)), self.refs.accs, self.k_step, self.last_k

    def accumulate(parts, middle):
      """The first K step stores the product, the `middle` ones add it."""
      @pl.when(k_step == 0)
      def _():
        for acc_ref, part in zip(acc_refs, parts):
          acc_ref[own] = part

      @pl.when(middle)
      def _():
        for acc_ref, part in zip(acc_refs, parts):
          acc_ref[own] += part

    def last_step(parts):
      self._finish(span, lo, [acc_ref[own] + part for acc_ref, part in zip(acc_refs, parts)])

    if self.mask_edge:
      pl.when(~last_k)(lambda: accumulate(self._products(span, size, False), k_step > 0))
      pl.when(last_k)(lambda: last_step(self._products(span, size, True)))
    else:
      parts = self._products(span, size, False)
      accumulate(parts, (k_step > 0) & ~last_k)
      pl.when(last_k)(lambda: last_step(parts))

  def _item_rows(self):
    """The item's rows: the whole tile, or (a partial item) only the MXU row slices it
    touches."""
    tile_m, row_chunk, tile_lo = self.tile_m, self.row_chunk, self.tile_lo
    real, start, end = self.step.real, self.step.start, self.step.end
    chunks = tile_m // row_chunk if row_chunk < tile_m and tile_m % row_chunk == 0 else 1
    if chunks == 1:
      pl.when(real)(lambda: self._rows(0, tile_m))
      return
    full = (start <= tile_lo) & (end >= tile_lo + tile_m)
    pl.when(real & full)(lambda: self._rows(0, tile_m))
    touches = lambda lo: (start < tile_lo + lo + row_chunk) & (end > tile_lo + lo)  # noqa: E731
    if self.cfg.transpose_lhs or self.blocked:  # lane-dim or per-block slices: one copy each
      for chunk in range(chunks):
        lo = chunk * row_chunk
        pl.when(real & ~full & touches(lo))(functools.partial(self._rows, lo, row_chunk))
      return

    # A loop over the chunks at a traced row offset, so that Mosaic compiles one chunk's
    # code instead of `chunks` unrolled copies (which doubled the kernel's code for the
    # same run-time work).
    @pl.when(real & ~full)
    def _():
      def chunk_body(chunk, carry):
        lo = pl.multiple_of(chunk * row_chunk, row_chunk)
        pl.when(touches(lo))(functools.partial(self._rows, lo, row_chunk))
        return carry

      lax.fori_loop(0, chunks, chunk_body, 0)

  def _write_cotangents(self):
    """At the row tile's last item: its gate and up cotangent tiles, N columns apart, from
    the VMEM pair to the output in HBM by DMA."""
    refs, item, tile_m = self.refs, self.item, self.tile_m
    last = pl.num_programs(1) - 1
    last_in_tile = (item == last) | (
        self.at(jnp.minimum(item + 1, last)).out_tile != self.step.out_tile)

    @pl.when(self.last_k & last_in_tile)
    def _():  # the row tile is complete
      tile_rows = pl.ds(pl.multiple_of(self.tile_lo, tile_m), tile_m)
      tile_n = self.tiling.tile_n
      copies = [pltpu.make_async_copy(
          refs.pair.at[h], refs.out.at[tile_rows, pl.ds(
              pl.multiple_of((self.column + h * (self.dims[2] // tile_n)) * tile_n, tile_n),
              tile_n)],
          refs.sems.at[h]) for h in (0, 1)]
      for copy in copies:
        copy.start()
      for copy in copies:
        copy.wait()


def m_kernel(ranges_ref, row_starts_ref, steps_end_ref, *refs, dims,
             tiling: Tiling, cfg: GmmConfig,
             dot_dtype, acc_dtype, has_bias: bool, k_steps: int, row_chunk: int,
             weight_cache: bool, quant: common.QuantStatic | None = None,
             gated: bool = False, weighted: bool = False, cotangent: bool = False,
             prologue: bool = False):
  """The m-grouped kernel: the scalar-prefetched `metadata.TileWalk`, then the operand,
  output and scratch refs (`_m_refs`)."""
  refs = _m_refs(refs, quant=quant, gated=gated, has_bias=has_bias, weighted=weighted,
                 cotangent=cotangent, prologue=prologue, k_steps=k_steps,
                 weight_cache=weight_cache)
  _MProgram((ranges_ref, row_starts_ref, steps_end_ref), refs, dims=dims, tiling=tiling,
            cfg=cfg, dot_dtype=dot_dtype, acc_dtype=acc_dtype, k_steps=k_steps,
            row_chunk=row_chunk, weight_cache=weight_cache, quant=quant, gated=gated,
            prologue=prologue).run()


# ------------------------------------------------------------------------- k-grouping


def k_kernel(groups_ref, tiles_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, *refs, dims,
             tiling: Tiling, cfg: GmmConfig, dot_dtype, acc_dtype, has_bias: bool,
             k_block: int | None = None, gated: bool = False):
  """The k-grouped kernel: the items' groups, K tiles and column ranges, then the operand,
  output and accumulator refs."""
  refs = list(refs)
  # A gated activation: the up column block (N/2 later) of rhs and of the bias.
  up_ref = refs.pop(0) if gated else None
  bias_refs = [refs.pop(0) for _ in range(2 if gated else 1)] if has_bias else None
  # Blocked fp8 (k_block given): the item's K tile spans whole scale blocks; their lhs row
  # scales [blocks, tile_m, 1] and rhs column scales [blocks, 1, tile_n].
  blocked = k_block is not None
  lhs_scale_ref, rhs_scale_ref = (refs.pop(0), refs.pop(0)) if blocked else (None, None)
  out_ref, *acc_refs = refs
  item = pl.program_id(2)
  last_item = pl.num_programs(2) - 1
  group = groups_ref[item]
  first_of_group = (item == 0) | (groups_ref[jnp.maximum(item - 1, 0)] != group)
  last_of_group = (item == last_item) | (groups_ref[jnp.minimum(item + 1, last_item)] != group)
  start, end = starts_ref[item], ends_ref[item]
  first = tiles_ref[item] * tiling.tile_k
  full = (start == first) & (end == first + tiling.tile_k)

  @pl.when(first_of_group)
  def _():
    for acc_ref in acc_refs:
      acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

  w_refs = (rhs_ref, up_ref) if gated else (rhs_ref,)

  def products(masked: bool, rows):
    """The item's product on the output rows `rows` for each rhs column block (gate and up
    when gated)."""
    if blocked:
      return [blocked_product(lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref, rows,
                              tiles_ref[item] * len(block_widths(tiling.tile_k, k_block)),
                              cfg, k_block, dot_dtype, acc_dtype,
                              (first, start, end) if masked else None)]
    x = dot_values(lhs_ref[:, rows] if cfg.transpose_lhs else lhs_ref[rows, :], dot_dtype)
    if masked:  # columns of other groups in this K tile, and the padded K edge: zero in both
      x = mask_k(x, first, start, end, 0 if cfg.transpose_lhs else 1)
    out = []
    for w_ref in w_refs:
      w = dot_values(w_ref[...], dot_dtype)
      if masked:
        w = mask_k(w, first, start, end, 1 if cfg.transpose_rhs else 0)
      out.append(dot(x, w, cfg, dot_dtype, acc_dtype))
    return out

  chunk = tiling.tile_m if blocked else out_row_chunk(tiling.tile_m)

  def accumulate(masked: bool):
    if chunk == tiling.tile_m:
      for acc_ref, part in zip(acc_refs, products(masked, slice(None))):
        acc_ref[...] += part
      return

    # `chunk` output rows at a time, in a loop: Mosaic compiles one chunk's MXU code
    # instead of the whole tile's (its compile time grows with the unrolled code).
    def chunk_body(c, carry):
      rows = pl.ds(pl.multiple_of(c * chunk, chunk), chunk)
      for acc_ref, part in zip(acc_refs, products(masked, rows)):
        acc_ref[rows, :] += part
      return carry

    lax.fori_loop(0, tiling.tile_m // chunk, chunk_body, 0)

  pl.when(full)(functools.partial(accumulate, False))
  pl.when(~full & (end > start))(functools.partial(accumulate, True))

  @pl.when(last_of_group)
  def _():
    biases = [None] * len(acc_refs) if bias_refs is None else [b[...] for b in bias_refs]
    out_ref[...] = tile_epilogue([acc_ref[...] for acc_ref in acc_refs], biases, cfg)
