"""Pallas GPU (Triton backend) gmm kernels.

m-grouping: one program per (work item, N tile). The work items come from
`metadata.make_tile_metadata(..., align="group")`: windows of at most ``tile_m`` rows that
start at their group's first row, so only a group's last window is partial. A program
loads its rows with a mask (any offset, any M), loops over K in ``tile_k`` steps
accumulating in f32 (int32 for int8 operands), applies the fused epilogue to the
accumulator and stores only its own rows. A partial window is computed in the smallest
power-of-2 row class that holds it (16, 32, ... below ``tile_m``: static branches of one
kernel), so the last window of a group pays for about its own rows instead of a full tile.
The output starts as an aliased zero buffer, so rows that no item owns stay exactly 0.

Fused MoE rows (m-grouping, `epilogue.Rows`): with ``lhs_indices`` a program loads the
index of each of its rows and gathers the lhs rows with a masked pointer gather (an index
out of ``[0, T)`` reads a zero row), so no permuted copy of lhs exists; ``row_weights``
multiply the rows after the activation, in f32 before the cast; with ``out_indices`` each
row is stored to its target row (a masked pointer scatter; rows out of range or of no local
group write nothing, and the aliased zero buffer leaves unwritten rows 0). A gated
activation (rhs columns ``[gate | up]``) gives each program an N tile of the output and two
accumulators, its gate columns and the matching up columns N later; the activation
combines them in the epilogue.

k-grouping: one program per (K window of a group, M tile, N tile). Without split-K a
group is one window and its program loops over the group's whole K range, then applies
the epilogue (an empty group gives ``activation(bias)``). With split-K (a small grid and a
long K) the windows are chunks of ``k_chunk`` rows computed in parallel; each adds its f32
partial sum into an f32 buffer with an atomic add and the epilogue runs once afterwards on
the sum.

Program order (L2 reuse): the grid is 1-D; `program_order` walks bands of ``band``
consecutive rows (work items, or (item, M tile) pairs) across every N tile, rows fastest,
so the programs running at the same time share a few lhs row tiles and a few weight
tiles, which stay in L2 instead of being re-read from HBM for every N tile.

K steps: every step but the last is full, so only the last one masks K (for m-grouping K
is static, so the masked tail step exists only when ``tile_k`` does not divide K).

Every block is a power of 2 (Triton needs it) of at least 16 (the smallest `tl.dot`); the
edges of M, K and N are masked, so no dimension has to divide a tile. Operands are whole
arrays in memory (no BlockSpecs): rows start at arbitrary offsets, which a Blocked index map
cannot express.

8-bit operands: int8 x int8 and fp8 x fp8 ("scaled" mode) multiply on the tensor cores
(int32 / f32 accumulation, per-token x per-channel scales in the epilogue); e4m3 x e5m2
meets in bf16 (exact). Hopper's 8-bit wgmma reads both operands K-major from shared
memory. The tiles reach shared memory in their stored order (cp.async keeps the global
layout), so 8-bit weights stored ``[G, N, K]`` (``transpose_rhs=True``; the dot contracts
the tile's minor axis, no transpose is materialized) are K-major for wgmma; for ``[G, K,
N]`` 8-bit weights Triton cannot use wgmma on the N-major tile and takes a slower MMA path
(triton-lang/triton#7629: fp8 weights "must be in column-major order" on Hopper). Store
8-bit weights ``[G, N, K]`` (as `quantize` of a transposed weight) for the fast path.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gmm_jax._src import epilogue, metadata
from gmm_jax._src.config import (GmmConfig, Tiling, is_gated, out_columns,
                                  preactivation_dtype)
from gmm_jax._src.epilogue import apply_epilogue, resolve_activation
from gmm_jax._src.qarray import QArray, quant_mode
from gmm_jax.pallas import common
from gmm_jax.pallas.common import edge_mask, power_of_2_tile

# The row operations (`epilogue.Rows`) and gated activations the m-grouped kernel does
# in-kernel; the dispatcher materializes nothing around it for these.
FEATURES = ("gather", "row_weights", "scatter", "gated")
ALIGN = "group"  # work items may start at any row: loads are masked, not Blocked
SMALLEST_TILE = 16  # tl.dot needs every dimension >= 16
# H100 / H200 (SXM): streaming multiprocessors, L2 and the opt-in shared memory per block.
NUM_SMS = 132
L2_BYTES = 50 * 2**20
SMEM_BYTES = 232448
# The lhs rows one band of `program_order` keeps in L2 (the rest of L2 holds the weight
# tiles the band streams through).
BAND_BYTES = L2_BYTES // 3
MAX_BAND = 64
# Split-K writes and re-reads an f32 [L, M, N] buffer; a chunk of at least this many K rows
# keeps that round trip small next to the MMA work.
SPLIT_MIN_CHUNK = 1024
# The "scaled" dtype pairs these kernels multiply on the tensor cores.
SCALED_TYPES = common.INT8_SCALED + common.FP8_SCALED


def check_operands(lhs, rhs, cfg) -> None:
  """`common.check_quant` for these kernels: they also serve fp8 x fp8 "scaled" mode."""
  common.check_quant(lhs, rhs, cfg, scaled_types=SCALED_TYPES)


# ----------------------------------------------------------------------------- tiling


def default_tiling(m: int, k: int, n: int, cfg: GmmConfig, itemsize: int = 2) -> Tiling:
  """Power-of-2 tiles for the Triton kernels on H100/H200.

  m-grouping sizes ``tile_m`` by the average group (a work item never spans two groups, so
  a tile much larger than a group is mostly masked): 128 from 128 rows per group, down to
  16 for decode. Wide 128x256 output tiles when groups fill 128-row tiles and N is large
  (8 warps; the MMA of an SM is fed best by 128x256, and the pipelined stages still fit in
  shared memory), else 128 columns. The K step holds 128 bytes per row (64 bf16, 128
  8-bit elements; 32 for 32-bit operands). k-grouping sizes ``tile_m`` by M and ``tile_k``
  by the average group's K. A gated activation sizes ``tile_n`` by the N output columns
  (the product's ``n`` is 2N) and `fit_registers` caps it for the two accumulators.
  """
  n = out_columns(n, cfg)
  widest_k = {1: 128, 2: 64}.get(itemsize, 32)
  smallest_k = 32 if itemsize == 1 else SMALLEST_TILE  # 8-bit MMA steps K by 32
  groups = max(1, cfg.num_local)
  if cfg.group_type == "m":
    tile_m = power_of_2_tile(max(1, m // groups), SMALLEST_TILE, 128)
    tile_k = power_of_2_tile(k, smallest_k, widest_k)
  else:
    tile_m = power_of_2_tile(m, SMALLEST_TILE, 128)
    tile_k = power_of_2_tile(max(1, k // groups), smallest_k, widest_k)
  # 256 columns only where they divide N (or N is large enough that a ragged last tile
  # costs little), and not with a transposed lhs (its tile transposes through registers:
  # 128x256 then spills with a GELU epilogue).
  wide = (tile_m >= 128 and itemsize <= 2 and not cfg.transpose_lhs
          and (n % 256 == 0 or n >= 4096))
  tile_n = 256 if wide else power_of_2_tile(n, SMALLEST_TILE, 128)
  return fit_registers(Tiling(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n), cfg)


def fit_registers(tiling: Tiling, cfg: GmmConfig) -> Tiling:
  """128 columns instead of 256 where the 128x256 accumulator spills registers on sm_90a:
  with a transposed lhs (its tile transposes through registers) or the exact GELU (the
  rational erf); `python -m gmm_jax.aot` measured both spilling. A gated activation keeps
  two accumulators (gate and up columns): 128 columns each, a 128x256 footprint, which
  compiled without spills for swiglu, the exact-GELU geglu and a transposed lhs alike (the
  activation runs on the gate half only). Applied to the automatic choices (tile table,
  heuristic), not to a user's tiling."""
  heavy = tiling.tile_m >= 128 and (cfg.transpose_lhs or cfg.activation == "gelu")
  if tiling.tile_n > 128 and (cfg.gated or heavy):
    return Tiling(tile_m=tiling.tile_m, tile_k=tiling.tile_k, tile_n=128)
  return tiling


def check_tiling(tiling: Tiling, m: int, k: int, n: int, cfg: GmmConfig) -> None:
  """Raises NotImplementedError for tiles Triton cannot use: each a power of 2 >= 16."""
  del m, k, n, cfg
  for name in ("tile_m", "tile_k", "tile_n"):
    value = getattr(tiling, name)
    if value < SMALLEST_TILE or value & (value - 1):
      raise NotImplementedError(
          f"the Triton kernels need power-of-2 tiles >= {SMALLEST_TILE}, got {name}={value}")


def num_warps(tiling: Tiling, halves: int = 1) -> int:
  """8 warps (two warpgroups) from 128x128 of accumulators (`halves` of ``tile_m x
  tile_n`` each: 2 for a gated activation), else 4."""
  return 8 if tiling.tile_m * tiling.tile_n * halves >= 128 * 128 else 4


def num_stages(tiling: Tiling, itemsize: int, halves: int = 1) -> int:
  """Pipeline depth: as many stages (2..4) as shared memory holds.

  Triton keeps one buffer of the lhs tile and the `halves` weight tiles per stage; the
  epilogue's layout conversion reuses them once the K loop is done.
  """
  per_stage = (tiling.tile_m * tiling.tile_k
               + halves * tiling.tile_k * tiling.tile_n) * itemsize
  return int(max(2, min(4, (SMEM_BYTES - 8192) // max(per_stage, 1))))


def compiler_params(tiling: Tiling, itemsize: int, halves: int = 1) -> plgpu.CompilerParams:
  return plgpu.CompilerParams(num_warps=num_warps(tiling, halves),
                              num_stages=num_stages(tiling, itemsize, halves))


def row_classes(tile_m: int) -> tuple[int, ...]:
  """Row counts of the partial-window branches: powers of 2 from 16 below ``tile_m``."""
  classes, size = [], SMALLEST_TILE
  while size < tile_m:
    classes.append(size)
    size *= 2
  return tuple(classes)


def band_rows(row_bytes: int, num_rows: int) -> int:
  """Rows per band of `program_order`: a power of 2 whose lhs tiles fit `BAND_BYTES`."""
  band = max(1, BAND_BYTES // max(int(row_bytes), 1))
  band = 1 << (int(band).bit_length() - 1)
  return int(max(1, min(band, MAX_BAND, num_rows)))


def program_order(program, num_rows: int, num_cols: int, band: int, xp=jnp):
  """(row, col) of 1-D program `program` in the banded order.

  Bands of `band` consecutive rows (the last band may be shorter) are visited one after
  the other; inside a band the row index runs fastest, then the column. Every (row, col)
  of ``num_rows x num_cols`` is visited exactly once by the programs ``[0, num_rows *
  num_cols)``. `xp` is jnp (in-kernel, traced ids) or np (host-side models).
  """
  per_band = band * num_cols
  band_index = program // per_band
  first_row = band_index * band
  rows_in_band = xp.minimum(num_rows - first_row, band)
  within = program - band_index * per_band
  return first_row + within % rows_in_band, within // rows_in_band


def default_k_chunk(m: int, k: int, n: int, cfg: GmmConfig, tiling: Tiling) -> int | None:
  """Split-K chunk (K rows per work item) of a k-grouped gmm, or None for no split.

  Split when the programs of all groups cannot fill the GPU (two programs per SM) and the
  average group's K is long enough that the f32 partial-sum buffer's round trip (about
  16 bytes per output element) costs little next to the MMA work (2 K flops per element).
  """
  if cfg.group_type != "k":
    return None
  mn_tiles = pl.cdiv(m, tiling.tile_m) * pl.cdiv(n, tiling.tile_n)
  groups = max(1, cfg.num_local)
  if groups * mn_tiles >= 2 * NUM_SMS or k < groups * SPLIT_MIN_CHUNK:
    return None
  chunks = pl.cdiv(2 * NUM_SMS, mn_tiles)
  chunk = pl.cdiv(pl.cdiv(k, chunks), tiling.tile_k) * tiling.tile_k
  chunk = max(SPLIT_MIN_CHUNK, chunk)
  return chunk if chunk < k else None


# ----------------------------------------------------------------------------- epilogue

# erf has no Triton lowering (jax 0.10 and 0.12), so the exact GELU uses the rational
# approximation of erf that XLA and Eigen use for f32 (max error ~1 ulp on [-4, 4];
# |erf| rounds to 1 beyond).
_ERF_ALPHA = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06,
              -5.69250639462346e-05, -7.34990630326855e-04, -2.95459980854025e-03,
              -1.60960333262415e-02)
_ERF_BETA = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03,
             -7.37332916720468e-03, -1.42647390514189e-02)


def _horner(x, coefficients):
  result = jnp.full_like(x, coefficients[0])
  for c in coefficients[1:]:
    result = result * x + c
  return result


def erf_f32(x: jax.Array) -> jax.Array:
  """erf from + - * / only (lowers on Triton), for f32 x."""
  x = jnp.clip(x, -4.0, 4.0)
  x2 = x * x
  return x * _horner(x2, _ERF_ALPHA) / _horner(x2, _ERF_BETA)


def gelu_erf(x: jax.Array) -> jax.Array:
  """The exact GELU ``x * Phi(x)`` with `erf_f32`."""
  return 0.5 * x * (1.0 + erf_f32(x * 0.7071067811865476))


def kernel_activation(activation):
  """The activation as the kernel applies it: "gelu" through `gelu_erf`, others as given."""
  return gelu_erf if activation == "gelu" else activation


def _clamped_swiglu(gate, up):
  gate = jnp.minimum(gate, epilogue.SWIGLU_LIMIT)
  up = jnp.clip(up, -epilogue.SWIGLU_LIMIT, epilogue.SWIGLU_LIMIT)
  return gate * jax.nn.sigmoid(epilogue.SWIGLU_ALPHA * gate) * (up + 1)


# `epilogue.GATED_ACTIVATIONS` on the two halves of the pre-activation, ``(gate, up) ->
# out``: the kernel keeps them in two accumulators (Triton cannot slice a tile in half).
GATED_PAIRS = {
    "swiglu": lambda gate, up: jax.nn.silu(gate) * up,
    "geglu": lambda gate, up: gelu_erf(gate) * up,
    "geglu_tanh": lambda gate, up: jax.nn.gelu(gate, approximate=True) * up,
    "swiglu_clamped": _clamped_swiglu,
}


def unsupported_primitives(activation) -> set[str]:
  """Primitives of `activation` (on an f32 tile) without a Pallas Triton lowering rule.

  Best effort: empty when the lowering table (a private jax module) cannot be read.
  """
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
    rules = triton_lowering.triton_lowering_rules
  except (ImportError, AttributeError):
    return set()
  if is_gated(activation):
    pair = GATED_PAIRS[activation]
    return common.unsupported_primitives(lambda z: pair(z, z), rules)
  return common.unsupported_primitives(
      resolve_activation(kernel_activation(activation)), rules)


# ----------------------------------------------------------------------------- tiles


class Span(NamedTuple):
  """``size`` consecutive indices from ``first``; ``ok`` masks those inside the array
  (None: all are)."""

  first: jax.Array
  size: int
  ok: jax.Array | None


def _span(first, size: int, limit) -> Span:
  return Span(first, size, edge_mask(first, size, limit))


def _cols(first, size: int, limit: int) -> Span:
  """A span along a static dimension: unmasked when `size` divides it."""
  return Span(first, size, None if limit % size == 0 else edge_mask(first, size, limit))


def _mask2(first: Span, second: Span):
  if first.ok is None and second.ok is None:
    return None
  if first.ok is None:
    return jnp.broadcast_to(second.ok[None, :], (first.size, second.size))
  if second.ok is None:
    return jnp.broadcast_to(first.ok[:, None], (first.size, second.size))
  return first.ok[:, None] & second.ok[None, :]


def _load(ref, index: tuple, rows: Span, cols: Span, transposed: bool):
  """Loads the ``[rows, cols]`` tile of a matrix stored ``[cols, rows]`` if `transposed`.

  The tile comes back as stored (transposed or not): the dot contracts the right axis
  instead of materializing a transpose. Masked elements read as 0, so NaN/inf outside the
  array or outside the group never reaches the accumulator.
  """
  first, second = (cols, rows) if transposed else (rows, cols)
  view = ref.at[(*index, pl.ds(first.first, first.size), pl.ds(second.first, second.size))]
  mask = _mask2(first, second)
  if mask is None:
    return plgpu.load(view)
  return plgpu.load(view, mask=mask, other=jnp.zeros((), ref.dtype))


def _load_vector(ref, index: tuple, span: Span):
  view = ref.at[(*index, pl.ds(span.first, span.size))]
  if span.ok is None:
    return plgpu.load(view)
  return plgpu.load(view, mask=span.ok, other=jnp.zeros((), ref.dtype))


def _dot(x, w, cfg: GmmConfig, dot_dtype, acc_dtype):
  """``x @ w`` of tiles loaded by `_load` (x: [M, K] or [K, M]; w: [K, N] or [N, K])."""
  lhs_contract = 0 if cfg.transpose_lhs else 1
  rhs_contract = 1 if cfg.transpose_rhs else 0
  return lax.dot_general(
      x.astype(dot_dtype), w.astype(dot_dtype), (((lhs_contract,), (rhs_contract,)), ((), ())),
      precision=cfg.precision, preferred_element_type=acc_dtype)


def _k_loop(step, acc, num_full, num_steps):
  """Full K steps (unmasked along K), then the rest (0 or 1 masked step)."""
  acc = lax.fori_loop(0, num_full, lambda i, acc: step(i, acc, False), acc)
  if isinstance(num_steps, int) and num_steps == num_full:
    return acc
  return lax.fori_loop(num_full, num_steps, lambda i, acc: step(i, acc, True), acc)


def _store(out_ref, out_index: tuple, rows: Span, cols: Span, value):
  view = out_ref.at[(*out_index, pl.ds(rows.first, rows.size), pl.ds(cols.first, cols.size))]
  plgpu.store(view, value, mask=_mask2(rows, cols))


def _epilogue_and_store(acc, bias_ref, group, out_ref, out_index: tuple, rows: Span,
                        cols: Span, cfg: GmmConfig):
  bias = None
  if bias_ref is not None:
    bias = _load_vector(bias_ref, (group,), cols)[None, :]
  out = apply_epilogue(acc, bias, kernel_activation(cfg.activation), cfg.out_dtype)
  _store(out_ref, out_index, rows, cols, out)


# ----------------------------------------------------------------------------- kernels


def _gather_load(ref, row_index, row_ok, cols: Span):
  """The ``[rows, cols]`` tile whose row r is ``ref[row_index[r]]`` (a zero row where
  `row_ok` is False): a pointer gather, 2-D integer indices (interpret mode takes no mix of
  integer and slice indices)."""
  shape = (row_index.shape[0], cols.size)
  row_ids = jnp.broadcast_to(row_index[:, None], shape)
  col_ids = jnp.broadcast_to((cols.first + lax.iota(jnp.int32, cols.size))[None, :], shape)
  mask = row_ok[:, None] if cols.ok is None else row_ok[:, None] & cols.ok[None, :]
  return plgpu.load(ref.at[row_ids, col_ids], mask=jnp.broadcast_to(mask, shape),
                    other=jnp.zeros((), ref.dtype))


def _scatter_store(out_ref, target, row_ok, cols: Span, value):
  """Row r of `value` into ``out_ref[target[r]]`` where `row_ok`; other rows write nothing
  (their target is past the output: interpret mode drops it, compiled mode masks it)."""
  shape = value.shape
  target = jnp.where(row_ok, target, out_ref.shape[0])
  row_ids = jnp.broadcast_to(target[:, None], shape)
  col_ids = jnp.broadcast_to((cols.first + lax.iota(jnp.int32, cols.size))[None, :], shape)
  mask = row_ok[:, None] if cols.ok is None else row_ok[:, None] & cols.ok[None, :]
  plgpu.store(out_ref.at[row_ids, col_ids], value, mask=jnp.broadcast_to(mask, shape))


def _m_kernel(group_ids_ref, item_start_ref, item_end_ref, lhs_ref, rhs_ref, *refs,
              dims, tiling: Tiling, cfg: GmmConfig, dot_dtype, acc_dtype, has_bias: bool,
              quant: common.QuantStatic | None, num_items: int, band: int, gather: bool,
              weighted: bool, scatter: bool):
  refs = list(refs)
  bias_ref = refs.pop(0) if has_bias else None
  scale_ref = refs.pop(0) if quant is not None else None
  zero_ref = refs.pop(0) if quant is not None and quant.has_zero else None
  lhs_scale_ref = refs.pop(0) if quant is not None and quant.mode == "scaled" else None
  lhs_indices_ref = refs.pop(0) if gather else None
  row_weights_ref = refs.pop(0) if weighted else None
  out_indices_ref = refs.pop(0) if scatter else None
  out_ref = refs[-1]  # refs[-2] is the aliased zero input
  _, k, n = dims
  n_out = out_columns(n, cfg)
  item, col = program_order(pl.program_id(0), num_items, pl.cdiv(n_out, tiling.tile_n), band)
  start = item_start_ref[item]
  end = item_end_ref[item]
  length = end - start
  group = group_ids_ref[item]
  # The product's columns this program reads: one span, or the gate and up spans of a
  # gated activation (the up half starts N columns later, masked like the gate half).
  cols = _cols(col * tiling.tile_n, tiling.tile_n, n_out)
  halves = (cols, Span(cols.first + n_out, cols.size, cols.ok)) if cfg.gated else (cols,)

  def compute(tile_rows: int):
    rows = _span(start, tile_rows, end)
    if gather:  # the tile's lhs rows; an out-of-range index reads a zero row
      source = _load_vector(lhs_indices_ref, (), rows)
      source_ok = rows.ok & (source >= 0) & (source < lhs_ref.shape[0])
      source = jnp.where(source_ok, source, 0)

    def scale_row(ref, step_index, span: Span):
      # The scale row of this K step's block, as [1, N] (or [N, 1] for a transposed tile).
      block = (step_index * tiling.tile_k) // quant.k_block
      row = _load_vector(ref, (group, block), span)
      return row[:, None] if cfg.transpose_rhs else row[None, :]

    def step(step_index, accs, masked: bool):
      first = step_index * tiling.tile_k
      ks = _span(first, tiling.tile_k, k) if masked else Span(first, tiling.tile_k, None)
      if gather:
        x = _gather_load(lhs_ref, source, source_ok, ks)
      else:
        x = _load(lhs_ref, (), rows, ks, cfg.transpose_lhs)
      new = []
      for acc, span in zip(accs, halves):
        w = _load(rhs_ref, (group,), ks, span, cfg.transpose_rhs)
        if quant is not None and quant.mode == "weight_only":
          zero = None if zero_ref is None else scale_row(zero_ref, step_index, span)
          w = common.dequantize_tile(w, scale_row(scale_ref, step_index, span), zero,
                                     cfg.transpose_rhs, dot_dtype)
        new.append(acc + _dot(x, w, cfg, dot_dtype, acc_dtype))
      return tuple(new)

    accs = tuple(jnp.zeros((tile_rows, tiling.tile_n), acc_dtype) for _ in halves)
    accs = _k_loop(step, accs, k // tiling.tile_k, pl.cdiv(k, tiling.tile_k))
    if lhs_scale_ref is not None:  # 8-bit x 8-bit: exact sums, then both scales
      per_token = _load_vector(lhs_scale_ref, (), rows)
      accs = tuple(acc.astype(jnp.float32) * per_token[:, None]
                   * _load_vector(scale_ref, (group,), span)[None, :]
                   for acc, span in zip(accs, halves))
    biases = [None] * len(halves)
    if bias_ref is not None:
      biases = [_load_vector(bias_ref, (group,), span)[None, :] for span in halves]
    weights = None if row_weights_ref is None else _load_vector(row_weights_ref, (), rows)
    if cfg.gated:
      gate, up = (acc.astype(jnp.float32) if jnp.issubdtype(acc.dtype, jnp.integer) else acc
                  for acc in accs)
      if bias_ref is not None:
        gate, up = gate + biases[0].astype(gate.dtype), up + biases[1].astype(up.dtype)
      out = apply_epilogue(GATED_PAIRS[cfg.activation](gate, up), None, None, cfg.out_dtype,
                           row_weights=weights)
    else:
      out = apply_epilogue(accs[0], biases[0], kernel_activation(cfg.activation),
                           cfg.out_dtype, row_weights=weights)
    if scatter:
      target = _load_vector(out_indices_ref, (), rows)
      written = rows.ok & (target >= 0) & (target < out_ref.shape[0])
      _scatter_store(out_ref, target, written, cols, out)
    else:
      _store(out_ref, (), rows, cols, out)

  # One static branch per row class: a window of `length` rows runs in the smallest class
  # that holds it (padding items past the active ones have length 0 and run none).
  bounds = (0, *row_classes(tiling.tile_m), tiling.tile_m)
  for low, high in zip(bounds[:-1], bounds[1:]):
    pl.when((length > low) & (length <= high))(functools.partial(compute, high))


def _k_kernel(num_items_ref, group_ids_ref, item_start_ref, item_end_ref, lhs_ref, rhs_ref,
              *refs, dims, tiling: Tiling, cfg: GmmConfig, dot_dtype, acc_dtype,
              has_bias: bool, split: bool, num_items: int, band: int):
  bias_ref = refs[0] if has_bias else None
  out_ref = refs[-1]  # split: refs[-2] is the aliased zero buffer
  m, _, n = dims
  m_tiles = pl.cdiv(m, tiling.tile_m)
  row, col = program_order(pl.program_id(0), num_items * m_tiles, pl.cdiv(n, tiling.tile_n),
                           band)
  item = row // m_tiles
  rows = _cols((row % m_tiles) * tiling.tile_m, tiling.tile_m, m)
  cols = _cols(col * tiling.tile_n, tiling.tile_n, n)

  @pl.when(item < num_items_ref[0])  # padding items past the active ones do nothing
  def _():
    group = group_ids_ref[item]
    start = item_start_ref[item]
    end = item_end_ref[item]

    def step(step_index, acc, masked: bool):
      first = start + step_index * tiling.tile_k
      ks = _span(first, tiling.tile_k, end) if masked else Span(first, tiling.tile_k, None)
      x = _load(lhs_ref, (), rows, ks, cfg.transpose_lhs)
      w = _load(rhs_ref, (), ks, cols, cfg.transpose_rhs)
      return acc + _dot(x, w, cfg, dot_dtype, acc_dtype)

    size = end - start
    acc = _k_loop(step, jnp.zeros((tiling.tile_m, tiling.tile_n), acc_dtype),
                  size // tiling.tile_k, (size + tiling.tile_k - 1) // tiling.tile_k)
    if split:
      index = (group, pl.ds(rows.first, rows.size), pl.ds(cols.first, cols.size))
      mask = _mask2(rows, cols)
      if mask is not None and cfg.interpret:
        # Interpret mode has no masked atomics; it runs one program at a time, so a
        # read-modify-write is the same sum.
        view = out_ref.at[index]
        current = plgpu.load(view, mask=mask, other=jnp.zeros((), out_ref.dtype))
        plgpu.store(view, current + acc, mask=mask)
      else:
        plgpu.atomic_add(out_ref, index, acc, mask=mask)
    else:
      _epilogue_and_store(acc, bias_ref, group, out_ref, (group,), rows, cols, cfg)


# ----------------------------------------------------------------------------- entry point


def _cost(m, k, n, num_out, lhs, rhs, out_bytes, cfg) -> pl.CostEstimate:
  return pl.CostEstimate(
      flops=int(2 * m * k * n * num_out),
      transcendentals=int(m * n * num_out) if cfg.activation is not None else 0,
      bytes_accessed=int(lhs.size * lhs.dtype.itemsize + rhs.size * rhs.dtype.itemsize
                         + out_bytes))


def _check_rows(cfg: GmmConfig, rows: epilogue.Rows) -> None:
  """The row operands must match the config's flags; raises NotImplementedError for what
  the kernels do not serve (rows with k-grouping, gathered rows of a transposed lhs)."""
  if cfg.group_type == "k":
    if cfg.has_rows or any(operand is not None for operand in rows):
      raise NotImplementedError(
          "the Triton kernels gather, weight and scatter rows for m-grouping only; got "
          "k-grouping with row operands")
    return
  for name, flagged in (("lhs_indices", cfg.gather_rows is not None),
                        ("row_weights", cfg.row_weights),
                        ("out_indices", cfg.out_rows is not None)):
    if (getattr(rows, name) is not None) != flagged:
      raise ValueError(
          f"rows.{name} is {'missing' if flagged else 'given'} but the config says "
          f"gather_rows={cfg.gather_rows}, row_weights={cfg.row_weights}, "
          f"out_rows={cfg.out_rows}")
  if cfg.gather_rows is not None and cfg.transpose_lhs:
    raise NotImplementedError(
        "the Triton kernels gather rows (lhs_indices) of an lhs stored [T, K] "
        "(transpose_lhs=False) only; got transpose_lhs=True")


def gmm_triton(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
               tiling: Tiling | None = None, *, k_chunk: int | None = None,
               rows: epilogue.Rows = epilogue.NO_ROWS):
  """gmm on canonical operands (see `GmmConfig`) with the Pallas Triton kernels.

  Args:
    lhs: ``[M, K]`` (``[K, M]`` if ``cfg.transpose_lhs``); ``[T, K]`` for any T when rows
      are gathered (``cfg.gather_rows``).
    rhs: m-grouping ``[num_local, K, N]``, k-grouping ``[K, N]`` (last two dims swapped if
      ``cfg.transpose_rhs``); 2N columns ``[gate | up]`` for a gated activation.
    counts: int32 ``[G]`` global group sizes.
    group_offset: int32 scalar, the first global group held locally.
    bias: None or ``[num_local, N]`` (``[num_local, 2N]`` gated).
    cfg: the static options.
    tiling: power-of-2 tiles (each >= 16); default ``cfg.tiling``, else `default_tiling`.
      ``tile_n`` counts output columns (a gated program reads twice as many).
    k_chunk: k-grouping only: K rows per split-K work item (a multiple of ``tile_k``), 0
      for no split; default `default_k_chunk`.
    rows: m-grouping's row operands (`epilogue.Rows`), present as the config says:
      lhs_indices int32 ``[R]`` (row r reads ``lhs[lhs_indices[r]]``, a zero row when out
      of range), row_weights ``[R]`` (multiplied after the activation, in f32 before the
      cast), out_indices int32 ``[R]`` (row r is written to ``out[out_indices[r]]``;
      rows out of range or owned by no local group write nothing).

  Returns:
    ``[M, N]`` (m-grouping; ``[out_rows, N]`` with scattered rows) or ``[num_local, M,
    N]`` (k-grouping) of ``cfg.out_dtype``, N halved by a gated activation.

  Raises:
    NotImplementedError: an activation with a primitive Triton cannot lower (compiled mode
      only), a tile that is not a power of 2 >= 16, row operands with k-grouping, or
      gathered rows with a transposed lhs.
    ValueError: a `k_chunk` that is not a positive multiple of ``tile_k``; row operands
      that do not match the config.
  """
  _check_rows(cfg, rows)
  plain = not isinstance(lhs, QArray) and not isinstance(rhs, QArray)
  if cfg.group_type == "k" and cfg.gated and plain:
    # k-grouping (weight gradients) rarely meets a gated activation: the kernel's sum in
    # the activation's precision, the epilogue (bias, halving) after it, as split-K does.
    inner = cfg.replace(activation=None, out_dtype=preactivation_dtype(lhs.dtype, rhs.dtype))
    partial = gmm_triton(lhs, rhs, counts, group_offset, None, inner, tiling, k_chunk=k_chunk)
    return apply_epilogue(partial, None if bias is None else bias[:, None, :], cfg.activation,
                          cfg.out_dtype)
  gather, weighted, scatter = (operand is not None for operand in rows)
  token_scale = None
  if gather and isinstance(lhs, QArray) and quant_mode(lhs, rhs, cfg) == "scaled":
    # The per-token scales follow the gathered rows: a placeholder scale through the
    # preamble (which sizes them by the R grouped rows), the [R] gathered scales after.
    token_scale = jnp.broadcast_to(lhs.scale.astype(jnp.float32), (lhs.shape[0], 1))
    lhs = QArray(lhs.qvalue, jnp.ones((1, 1), jnp.float32))
  prepared = common.preamble(lhs, rhs, counts, cfg, tiling, default_tiling=default_tiling,
                             check_tiling=check_tiling, unsupported=unsupported_primitives,
                             backend="Pallas Triton", implementation="pallas_triton",
                             platform="gpu", scaled_types=SCALED_TYPES)
  if prepared.dot_dtype.itemsize == 1 and prepared.tiling.tile_k < 32:
    raise NotImplementedError(
        f"8-bit Triton dots need tile_k >= 32, got {prepared.tiling.tile_k}")
  m, k, n = prepared.dims
  if cfg.gated and n % 2:
    raise ValueError(f"a gated activation ({cfg.activation!r}) needs an even number of rhs "
                     f"columns [gate | up], got {n}")
  n_out = out_columns(n, cfg)
  out_shape = prepared.out_shape
  if cfg.group_type == "m":
    out_shape = (m if cfg.out_rows is None else cfg.out_rows, n_out)
  if prepared.empty or math.prod(out_shape) == 0:
    return jnp.zeros(out_shape, cfg.out_dtype)
  lhs, rhs, quant, tiling = prepared.lhs, prepared.rhs, prepared.quant, prepared.tiling
  if token_scale is not None:
    quant = quant._replace(lhs_scale=epilogue.gather_rows(token_scale, rows.lhs_indices))
  if prepared.automatic:
    tiling = fit_registers(tiling, cfg)
  dot_dtype, acc_dtype = prepared.dot_dtype, prepared.acc_dtype
  itemsize = jnp.dtype(dot_dtype).itemsize
  kernel_options = dict(dims=(m, k, n), tiling=tiling, cfg=cfg, dot_dtype=dot_dtype,
                        acc_dtype=acc_dtype, has_bias=bias is not None)
  biases = [] if bias is None else [bias]
  n_tiles = pl.cdiv(n_out, tiling.tile_n)
  params = compiler_params(tiling, itemsize, 2 if cfg.gated else 1)
  out_bytes = math.prod(out_shape) * np.dtype(cfg.out_dtype).itemsize
  tiles = (tiling.tile_m, tiling.tile_k, tiling.tile_n)

  if cfg.group_type == "m":
    quant_operands = []
    if quant is not None and quant.mode == "scaled":  # [L, N] and [M] scales
      quant_operands = [quant.rhs_scale[:, 0, :], quant.lhs_scale[:, 0]]
    elif quant is not None:
      quant_operands = [quant.rhs_scale] + ([] if quant.rhs_zero is None else [quant.rhs_zero])
    meta = metadata.make_tile_metadata(counts, m, tiling.tile_m, group_offset, cfg.num_local,
                                       ALIGN)
    num_items = meta.item_start.shape[0]
    band = band_rows(tiling.tile_m * k * lhs.dtype.itemsize, num_items)
    row_operands = [rows.lhs_indices.astype(jnp.int32)] if gather else []
    row_operands += [rows.row_weights] if weighted else []
    row_operands += [rows.out_indices.astype(jnp.int32)] if scatter else []
    operands = [meta.group_ids, meta.item_start, meta.item_end, lhs, rhs, *biases,
                *quant_operands, *row_operands, jnp.zeros(out_shape, cfg.out_dtype)]
    return common.pallas_call(
        functools.partial(_m_kernel, quant=common.quant_static(quant), num_items=num_items,
                          band=band, gather=gather, weighted=weighted, scatter=scatter,
                          **kernel_options),
        prepared, tiles=tiles,
        out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype),
        grid=(num_items * n_tiles,),
        input_output_aliases={len(operands) - 1: 0},  # rows no item owns stay 0
        interpret=cfg.interpret,
        compiler_params=params,
        cost_estimate=_cost(m, k, n, 1, lhs, rhs, out_bytes, cfg),
        name="gmm_m_triton",
    )(*operands)

  if k_chunk is None:
    k_chunk = default_k_chunk(m, k, n, cfg, tiling) or 0
  if k_chunk < 0 or k_chunk % tiling.tile_k:
    raise ValueError(f"k_chunk must be 0 or a positive multiple of tile_k={tiling.tile_k}, "
                     f"got {k_chunk}")
  split = 0 < k_chunk < k
  meta = metadata.make_tile_metadata(counts, k, k_chunk if split else max(k, 1), group_offset,
                                     cfg.num_local, ALIGN, cover=not split)
  num_items = meta.item_start.shape[0]
  m_tiles = pl.cdiv(m, tiling.tile_m)
  window = k_chunk if split else max(1, k // max(1, cfg.num_local))
  band = band_rows(tiling.tile_m * window * lhs.dtype.itemsize, num_items * m_tiles)
  kernel_options["has_bias"] = bias is not None and not split
  kernel = functools.partial(_k_kernel, split=split, num_items=num_items, band=band,
                             **kernel_options)
  operands = [meta.num_items.reshape(1), meta.group_ids, meta.item_start, meta.item_end,
              lhs, rhs]
  grid = (num_items * m_tiles * n_tiles,)
  cost = _cost(m, k, n, 1, lhs, rhs, out_bytes, cfg)
  if not split:
    return common.pallas_call(
        kernel, prepared, tiles=tiles,
        out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype), grid=grid,
        interpret=cfg.interpret, compiler_params=params, cost_estimate=cost,
        name="gmm_k_triton",
    )(*operands, *biases)
  # Split-K: partial sums meet in an f32 (int32) buffer; the epilogue needs the whole sum.
  partial = common.pallas_call(
      kernel, prepared, tiles=tiles, out_shape=jax.ShapeDtypeStruct(out_shape, acc_dtype), grid=grid,
      input_output_aliases={len(operands): 0}, interpret=cfg.interpret,
      compiler_params=params, cost_estimate=cost, name="gmm_k_triton_split",
  )(*operands, jnp.zeros(out_shape, acc_dtype))
  return apply_epilogue(partial, None if bias is None else bias[:, None, :], cfg.activation,
                        cfg.out_dtype)


# ----------------------------------------------------------------------------- cost model


def _items(counts, dim_size: int, window: int, num_local: int, cover: bool = False):
  """Host-side twin of `metadata.make_tile_metadata(align="group")` with group_offset 0:
  a list of (group, start, end) windows of at most `window` rows, in group order."""
  bounds = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).clip(0, dim_size)
  items = []
  for group in range(num_local):
    start, end = (int(bounds[group]), int(bounds[group + 1])) if group < len(counts) else (0, 0)
    if start == end and cover:
      items.append((group, start, start))
    for first in range(start, end, window):
      items.append((group, first, min(first + window, end)))
  return items


class _L2:
  """An LRU cache of whole tiles: counts the bytes that miss (read from HBM).

  Programs run in waves of `NUM_SMS` (one 8-warp program per SM); the programs of a wave
  stream K in step, so a tile they share is read once per wave however long it is. Across
  waves a tile is reused only if it is still cached.
  """

  def __init__(self, capacity: int):
    self.capacity, self.used, self.missed = capacity, 0, 0
    self.lines = collections.OrderedDict()
    self.wave, self.programs = {}, 0

  def read(self, key, size: int):
    self.wave.setdefault(key, size)

  def program_done(self):
    self.programs += 1
    if self.programs % NUM_SMS == 0:
      self.flush()

  def flush(self):
    for key, size in self.wave.items():
      if key in self.lines:
        self.lines.move_to_end(key)
        continue
      self.missed += size
      self.lines[key] = size
      self.used += size
    while self.used > self.capacity:
      _, evicted = self.lines.popitem(last=False)
      self.used -= evicted
    self.wave = {}


def static_cost(counts, m: int, k: int, n: int, cfg: GmmConfig, tiling: Tiling,
                itemsize: int = 2, *, k_chunk: int | None = None,
                l2_bytes: int = L2_BYTES) -> dict:
  """What the kernel does for concrete group sizes (a host-side numpy model).

  Args:
    counts: the group sizes (concrete), group_offset 0.
    m, k, n, cfg, tiling: the call (`GmmConfig`) and its tiles.
    itemsize: bytes per operand element; the output uses ``cfg.out_dtype``.
    k_chunk: k-grouping's split-K chunk (default `default_k_chunk`; 0: no split).
    l2_bytes: the L2 the tiles are cached in (LRU of whole tiles, programs in launch order).

  Returns:
    dict with useful_rows (rows of the grouped dimension the groups own: M rows for
    m-grouping, K rows for k-grouping), mma_rows (the rows the MMAs process: m-grouping's
    partial windows rounded up to their row class, k-grouping's K steps rounded up to
    tile_k), grid_steps (programs launched), busy_steps (programs with work), hbm_bytes
    (modelled operand bytes read from HBM plus the output written), ideal_bytes (each
    operand read once and the output written once).
  """
  counts = np.asarray(counts, np.int64)
  out_itemsize = np.dtype(cfg.out_dtype).itemsize
  n_tiles = pl.cdiv(n, tiling.tile_n)
  l2 = _L2(l2_bytes)
  num_local = cfg.num_local
  if cfg.group_type == "m":
    items = _items(counts[:num_local], m, tiling.tile_m, num_local)
    num_rows = metadata.max_work_items(m, tiling.tile_m, num_local, ALIGN)
    classes = (*row_classes(tiling.tile_m), tiling.tile_m)
    lengths = np.array([end - start for _, start, end in items], np.int64)
    padded = [next(c for c in classes if c >= length) for length in lengths]
    useful, mma = int(lengths.sum()), int(sum(padded))
    band = band_rows(tiling.tile_m * k * itemsize, num_rows)
    programs = np.arange(num_rows * n_tiles)
    rows, cols = program_order(programs, num_rows, n_tiles, band, xp=np)
    busy = 0
    for row, col in zip(rows.tolist(), cols.tolist()):
      if row >= len(items):
        continue
      busy += 1
      group, start, end = items[row]
      width = min(tiling.tile_n, n - col * tiling.tile_n)
      l2.read(("lhs", row), (end - start) * k * itemsize)
      l2.read(("rhs", group, col), k * width * itemsize)
      l2.program_done()
    l2.flush()
    used_groups = len({group for group, _, _ in items})
    ideal_in = (useful * k + used_groups * k * n) * itemsize
    out_bytes = m * n * out_itemsize
    return dict(useful_rows=useful, mma_rows=mma, grid_steps=int(num_rows * n_tiles),
                busy_steps=busy, hbm_bytes=int(l2.missed + out_bytes),
                ideal_bytes=int(ideal_in + out_bytes))

  if k_chunk is None:
    k_chunk = default_k_chunk(m, k, n, cfg, tiling) or 0
  split = 0 < k_chunk < k
  items = _items(counts[:num_local], k, k_chunk if split else max(k, 1), num_local,
                 cover=not split)
  num_items = metadata.max_work_items(k, k_chunk if split else max(k, 1), num_local, ALIGN,
                                      cover=not split)
  m_tiles = pl.cdiv(m, tiling.tile_m)
  lengths = np.array([end - start for _, start, end in items], np.int64)
  useful = int(lengths.sum())
  mma = int(sum(pl.cdiv(int(length), tiling.tile_k) * tiling.tile_k for length in lengths))
  window = k_chunk if split else max(1, k // max(1, num_local))
  band = band_rows(tiling.tile_m * window * itemsize, num_items * m_tiles)
  programs = np.arange(num_items * m_tiles * n_tiles)
  rows, cols = program_order(programs, num_items * m_tiles, n_tiles, band, xp=np)
  busy = 0
  for row, col in zip(rows.tolist(), cols.tolist()):
    item, m_tile = divmod(row, m_tiles)
    if item >= len(items):
      continue
    busy += 1
    _, start, end = items[item]
    height = min(tiling.tile_m, m - m_tile * tiling.tile_m)
    width = min(tiling.tile_n, n - col * tiling.tile_n)
    l2.read(("lhs", item, m_tile), (end - start) * height * itemsize)
    l2.read(("rhs", item, col), (end - start) * width * itemsize)
    l2.program_done()
  l2.flush()
  out_bytes = num_local * m * n * out_itemsize
  hbm = l2.missed + out_bytes
  if split:  # zero fill, atomic read-modify-write per item tile, epilogue read
    hbm += num_local * m * n * 4 * 2 + len(items) * m * n * 4 * 2
  ideal = useful * (m + n) * itemsize + out_bytes
  return dict(useful_rows=useful, mma_rows=mma, grid_steps=int(num_items * m_tiles * n_tiles),
              busy_steps=busy, hbm_bytes=int(hbm), ideal_bytes=int(ideal))
