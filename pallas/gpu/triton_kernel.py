"""Pallas Triton gmm kernel bodies: `_m_kernel` (m-grouping), `_k_kernel` (k-grouping).

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

The MoE backward's gated ends (m-grouping): a gated prologue (``cfg.lhs_activation``) reads
each K step's tile of z's gate half and the up half's tile K columns later and multiplies
``act(gate, up)`` (f32, rounded to z's dtype, `epilogue.prologue_input`), so no ``[M, K]``
input exists; a gated-cotangent epilogue (``cfg.cotangent_of``) finishes its product tile
(row weights, rounding to out_dtype), reads z's gate and up tiles of the same rows (the
``source`` row operand ``[M, 2N]``) and stores both cotangent tiles, N columns apart, into
the ``[M, 2N]`` output, so the product itself is never written. In fp8 training ("blocked"
mode) the prologue quantizes each K step's act(z) tile per row in-kernel
(`common.quantize_rows`: the step is one 1 x ``k_block`` block) and multiplies its 8-bit
values times their scales; the epilogue finishes the blockwise product as any other.

k-grouping: one program per (K window of a group, M tile, N tile). Without split-K a
group is one window and its program loops over the group's whole K range, then applies
the epilogue (an empty group gives ``activation(bias)``; a gated activation keeps the gate
and up accumulators as m-grouping does). With split-K each program stores its chunk's
partial sum to its slot, or adds it atomically (see `triton`).

Program order (L2 reuse): the grid is 1-D; `program_order` walks bands of ``band``
consecutive rows (work items, or (item, M tile) pairs) across every N tile, rows fastest,
so the programs running at the same time share a few lhs row tiles and a few weight
tiles, which stay in L2 instead of being re-read from HBM for every N tile.

K steps: every step but the last is full, so only the last one masks K (for m-grouping K
is static, so the masked tail step exists only when ``tile_k`` does not divide K).

8-bit operands: int8 x int8 and fp8 x fp8 ("scaled" mode) multiply on the tensor cores
(int32 / f32 accumulation, per-token x per-channel scales in the epilogue); two 8-bit
float tiles multiply through `triton_fp8.fp8_dot`. "blocked" mode (fp8 training's
blockwise scales, `common.QuantOperands`; both group types) takes K steps of one scale
block each (``tile_k = k_block``) and adds each step's product times the rows' and the
columns' scales of that block, in f32; the k-grouped kernel starts a group's steps at a
multiple of ``tile_k`` (blocks are counted from row 0) and masks the rows outside the group.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.core.config import GmmConfig, Tiling, out_columns
from gmm_jax._src.tiling.cost_models import program_order, row_classes
from gmm_jax.pallas import common
from gmm_jax.pallas.common import edge_mask
from gmm_jax.pallas.gpu.triton_fp8 import FP8_MMA, FP8_MMA_K, fp8_dot, fp8_pair
from gmm_jax.pallas.gpu.triton_large import unpack
from gmm_jax.pallas.jax_pallas import pl, triton as plgpu

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


# The gated activations on the two halves of the pre-activation (the kernel keeps them in
# two accumulators), "geglu"'s gate through `gelu_erf`.
GATED_PAIRS = common.gated_pairs(kernel_activation)


# ----------------------------------------------------------------------------- tiles


class Span(NamedTuple):
  """``size`` consecutive indices from ``first``; ``ok`` masks those below ``limit`` (None:
  all are, and `limit` may be None)."""

  first: jax.Array
  size: int
  ok: jax.Array | None
  limit: int | jax.Array | None = None


def _span(first, size: int, limit) -> Span:
  return Span(first, size, edge_mask(first, size, limit), limit)


def _cols(first, size: int, limit: int) -> Span:
  """A span along a static dimension: unmasked when `size` divides it."""
  return Span(first, size, None if limit % size == 0 else edge_mask(first, size, limit), limit)


def _shifted(span: Span, offset: int) -> Span:
  """The same span `offset` indices later (the up half of a gated product), masked alike."""
  limit = None if span.limit is None else span.limit + offset
  return Span(span.first + offset, span.size, span.ok, limit)


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

def _halved(span: Span) -> Span:
  """The words of a span of bytes that starts at an even index and has an even size."""
  first = span.first // 2
  if span.ok is None:
    return Span(first, span.size // 2, None)
  return Span(first, span.size // 2, edge_mask(first, span.size // 2, (span.limit + 1) // 2))


def _load_tile(ref, index: tuple, rows: Span, cols: Span, transposed: bool, elements=None):
  """`_load`, for an operand stored as words (`as_words`) when `elements` (its dtype) is
  given: the words of the tile's minor span, unpacked."""
  if elements is None:
    return _load(ref, index, rows, cols, transposed)
  if transposed:
    return unpack(_load(ref, index, _halved(rows), cols, True), elements)
  return unpack(_load(ref, index, rows, _halved(cols), False), elements)


def _dot(x, w, cfg: GmmConfig, dot_dtype, acc_dtype):
  """``x @ w`` of tiles loaded by `_load` (x: [M, K] or [K, M]; w: [K, N] or [N, K]).

  Two 8-bit float tiles (e4m3 and/or e5m2) with an f32 accumulator multiply as they are
  (`fp8_dot`: Hopper's fp8 wgmma) where this jax lets us lower it; else as `dot_dtype`.
  """
  lhs_contract = 0 if cfg.transpose_lhs else 1
  rhs_contract = 1 if cfg.transpose_rhs else 0
  if (FP8_MMA and fp8_pair(x.dtype, w.dtype) and np.dtype(acc_dtype) == np.float32
      and x.shape[lhs_contract] >= FP8_MMA_K):
    return fp8_dot(x, w, (lhs_contract, rhs_contract))
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


# The tile epilogue, `common.finish_tile` with this kernel's GELU.
finish_tile = functools.partial(common.finish_tile, kernel_activation=kernel_activation,
                                pairs=GATED_PAIRS)


# ----------------------------------------------------------------------------- kernels


def _gather_load(ref, row_index, row_ok, cols: Span, elements=None):
  """The ``[rows, cols]`` tile whose row r is ``ref[row_index[r]]`` (a zero row where
  `row_ok` is False): a pointer gather, 2-D integer indices (interpret mode takes no mix of
  integer and slice indices). `elements`: as in `_load_tile`."""
  stored = cols if elements is None else _halved(cols)
  shape = (row_index.shape[0], stored.size)
  row_ids = jnp.broadcast_to(row_index[:, None], shape)
  col_ids = jnp.broadcast_to((stored.first + lax.iota(jnp.int32, stored.size))[None, :], shape)
  mask = row_ok[:, None] if stored.ok is None else row_ok[:, None] & stored.ok[None, :]
  tile = plgpu.load(ref.at[row_ids, col_ids], mask=jnp.broadcast_to(mask, shape),
                    other=jnp.zeros((), ref.dtype))
  return tile if elements is None else unpack(tile, elements)


def _scatter_store(out_ref, target, row_ok, cols: Span, value):
  """Row r of `value` into ``out_ref[target[r]]`` where `row_ok`; other rows write nothing
  (their target is past the output: interpret mode drops it, compiled mode masks it)."""
  shape = value.shape
  target = jnp.where(row_ok, target, out_ref.shape[0])
  row_ids = jnp.broadcast_to(target[:, None], shape)
  col_ids = jnp.broadcast_to((cols.first + lax.iota(jnp.int32, cols.size))[None, :], shape)
  mask = row_ok[:, None] if cols.ok is None else row_ok[:, None] & cols.ok[None, :]
  plgpu.store(out_ref.at[row_ids, col_ids], value, mask=jnp.broadcast_to(mask, shape))


def tile_columns(n: int, cfg: GmmConfig) -> int:
  """The columns the N tiles of a launch cover for a product of `n` columns: the output's
  (`out_columns`), but the product's for a gated-cotangent epilogue (each of its tiles
  writes a gate and an up cotangent tile, N columns apart)."""
  return n if cfg.cotangent_of is not None else out_columns(n, cfg)


def _prologue_tile(lhs_ref, rows: Span, ks: Span, k: int, name: str):
  """A gated prologue's input tile: ``act(gate, up)`` of the K columns `ks` of z's gate
  half and the up half's (K columns later), in f32, rounded to z's dtype as
  `epilogue.prologue_input` rounds it (a masked element reads 0 in both: act(0, 0) = 0)."""
  gate = _load(lhs_ref, (), rows, ks, False)
  up = _load(lhs_ref, (), rows, _shifted(ks, k), False)
  return GATED_PAIRS[name](gate.astype(jnp.float32), up.astype(jnp.float32)).astype(
      lhs_ref.dtype)


def _halves(cols: Span, n_out: int, cfg: GmmConfig) -> tuple[Span, ...]:
  """The product's columns a program reads for output columns `cols`: the same span, or
  the gate and up spans of a gated activation (the up half starts N columns later)."""
  return (cols, _shifted(cols, n_out)) if cfg.gated else (cols,)


def _biases(bias_ref, group, halves: tuple[Span, ...]) -> list:
  """The group's bias row (``[1, width]``) of each of `halves`, or None each without bias."""
  if bias_ref is None:
    return [None] * len(halves)
  return [_load_vector(bias_ref, (group,), span)[None, :] for span in halves]


class KernelStatic(NamedTuple):
  """What both kernels close over besides the config: the wrapper's plan of one launch."""

  dims: tuple[int, int, int]
  tiling: Tiling
  dot_dtype: np.dtype
  acc_dtype: np.dtype
  has_bias: bool
  num_items: int  # the launch's work items (the grid's rows, `program_order`)
  band: int  # rows walked together across the N tiles (`program_order`)
  # The stored element dtype of an operand that reaches the kernel as words (`as_words`),
  # else None.
  lhs_elements: np.dtype | None = None
  rhs_elements: np.dtype | None = None


# ------------------------------------------------------------------------ m-grouping


class _MRefs(NamedTuple):
  """The m-grouped kernel's operands after rhs (`_m_refs`), None where the call has none."""

  bias: object
  scale: object  # rhs scales
  zero: object  # rhs zero points (weight-only)
  lhs_scale: object  # "scaled": [M] per-token scales; "blocked": [Kb, M], per K block
  lhs_indices: object
  row_weights: object
  out_indices: object
  source: object  # a gated-cotangent epilogue's z [M, 2N]
  out: object  # the output (the aliased zero input precedes it)


def _m_refs(refs, static: KernelStatic, quant: common.QuantStatic | None, gather: bool,
            weighted: bool, scatter: bool, source: bool) -> _MRefs:
  refs = list(refs)
  bias_ref = refs.pop(0) if static.has_bias else None
  scale_ref = refs.pop(0) if quant is not None else None
  zero_ref = refs.pop(0) if quant is not None and quant.has_zero else None
  lhs_scale_ref = (refs.pop(0) if quant is not None and quant.mode in ("scaled", "blocked")
                   and quant.prologue is None else None)
  lhs_indices_ref = refs.pop(0) if gather else None
  row_weights_ref = refs.pop(0) if weighted else None
  out_indices_ref = refs.pop(0) if scatter else None
  source_ref = refs.pop(0) if source else None
  return _MRefs(bias_ref, scale_ref, zero_ref, lhs_scale_ref, lhs_indices_ref, row_weights_ref,
                out_indices_ref, source_ref, refs[-1])


def _gathered_rows(indices_ref, rows: Span, num_rows: int):
  """(the lhs row of each of the tile's rows, whether it is in ``[0, num_rows)``): an
  out-of-range index reads a zero row."""
  source = _load_vector(indices_ref, (), rows)
  source_ok = rows.ok & (source >= 0) & (source < num_rows)
  return jnp.where(source_ok, source, 0), source_ok


def _scale_row(ref, group, step_index, span: Span, tiling: Tiling, quant: common.QuantStatic,
               cfg: GmmConfig):
  """The scale row of K step `step_index`'s block, as [1, N] (or [N, 1] for a transposed
  tile)."""
  block = (step_index * tiling.tile_k) // quant.k_block
  row = _load_vector(ref, (group, block), span)
  return row[:, None] if cfg.transpose_rhs else row[None, :]


def _m_epilogue(accs, ops: _MRefs, rows: Span, cols: Span, halves: tuple[Span, ...], group,
                cfg: GmmConfig, quant: common.QuantStatic | None, scatter: bool) -> None:
  """Scales ("scaled" mode), bias, activation, row weights and cast of a tile's `accs`,
  then its store (or its scatter to ``out_indices``), or for a gated-cotangent epilogue the
  store of z's two cotangent tiles (`common.gated_cotangent_tiles`) for it."""
  if quant is not None and quant.mode == "scaled":  # exact 8-bit sums, then both scales
    per_token = _load_vector(ops.lhs_scale, (), rows)
    accs = tuple(acc.astype(jnp.float32) * per_token[:, None]
                 * _load_vector(ops.scale, (group,), span)[None, :]
                 for acc, span in zip(accs, halves))
  biases = _biases(ops.bias, group, halves)
  weights = None if ops.row_weights is None else _load_vector(ops.row_weights, (), rows)
  out = finish_tile(accs, biases, cfg.activation, cfg.out_dtype, weights)
  if cfg.cotangent_of is not None:  # z's gate and up tiles of these rows, N columns apart
    up_cols = _shifted(cols, cols.limit)
    cotangents = common.gated_cotangent_tiles(
        GATED_PAIRS[cfg.cotangent_of], _load(ops.source, (), rows, cols, False),
        _load(ops.source, (), rows, up_cols, False), out)
    for span, d in zip((cols, up_cols), cotangents):
      _store(ops.out, (), rows, span, d.astype(cfg.out_dtype))
  elif scatter:
    target = _load_vector(ops.out_indices, (), rows)
    written = rows.ok & (target >= 0) & (target < ops.out.shape[0])
    _scatter_store(ops.out, target, written, cols, out)
  else:
    _store(ops.out, (), rows, cols, out)


def _m_kernel(group_ids_ref, item_start_ref, item_end_ref, lhs_ref, rhs_ref, *refs,
              static: KernelStatic, cfg: GmmConfig, quant: common.QuantStatic | None,
              gather: bool, weighted: bool, scatter: bool):
  """m-grouping: one work item's rows times one N tile, in the smallest row class that
  holds them. `gather`, `weighted`, `scatter`: the row operands (`_MRefs`) the call has."""
  ops = _m_refs(refs, static, quant, gather, weighted, scatter, cfg.cotangent_of is not None)
  blocked = quant is not None and quant.mode == "blocked"
  tiling, dot_dtype, acc_dtype = static.tiling, static.dot_dtype, static.acc_dtype
  _, k, n = static.dims
  n_out = tile_columns(n, cfg)
  item, col = program_order(pl.program_id(0), static.num_items,
                            pl.cdiv(n_out, tiling.tile_n), static.band)
  start = item_start_ref[item]
  end = item_end_ref[item]
  length = end - start
  group = group_ids_ref[item]
  cols = _cols(col * tiling.tile_n, tiling.tile_n, n_out)
  halves = _halves(cols, n_out, cfg)
  scale_row = functools.partial(_scale_row, tiling=tiling, quant=quant, cfg=cfg)

  def compute(tile_rows: int):
    rows = _span(start, tile_rows, end)
    if gather:  # the tile's lhs rows; an out-of-range index reads a zero row
      source, source_ok = _gathered_rows(ops.lhs_indices, rows, lhs_ref.shape[0])

    def step(step_index, accs, masked: bool):
      first = step_index * tiling.tile_k
      ks = _span(first, tiling.tile_k, k) if masked else Span(first, tiling.tile_k, None)
      if gather:
        x = _gather_load(lhs_ref, source, source_ok, ks, static.lhs_elements)
      elif cfg.lhs_activation is not None:
        x = _prologue_tile(lhs_ref, rows, ks, k, cfg.lhs_activation)
      else:
        x = _load_tile(lhs_ref, (), rows, ks, cfg.transpose_lhs, static.lhs_elements)
      new = []
      if blocked:  # this step's K block: the rows' scales
        block = first // quant.k_block
        if quant.prologue is not None:  # act(z)'s block quantized here, as `quantize` does
          x, row_scale = common.quantize_rows(x, quant.prologue[0])
        else:
          row_scale = _load_vector(ops.lhs_scale, (block,), rows)[:, None]
      for acc, span in zip(accs, halves):
        w = _load_tile(rhs_ref, (group,), ks, span, cfg.transpose_rhs, static.rhs_elements)
        if quant is not None and quant.mode == "weight_only":
          zero = None if ops.zero is None else scale_row(ops.zero, group, step_index, span)
          w = common.dequantize_tile(w, scale_row(ops.scale, group, step_index, span), zero,
                                     cfg.transpose_rhs, dot_dtype)
        product = _dot(x, w, cfg, dot_dtype, acc_dtype)
        if blocked:  # the block's product times both block scales, in f32
          product = product * row_scale * _load_vector(ops.scale, (group, block), span)[None, :]
        new.append(acc + product)
      return tuple(new)

    accs = tuple(jnp.zeros((tile_rows, tiling.tile_n), acc_dtype) for _ in halves)
    accs = _k_loop(step, accs, k // tiling.tile_k, pl.cdiv(k, tiling.tile_k))
    _m_epilogue(accs, ops, rows, cols, halves, group, cfg, quant, scatter)

  # One static branch per row class: a window of `length` rows runs in the smallest class
  # that holds it (padding items past the active ones have length 0 and run none).
  bounds = (0, *row_classes(tiling.tile_m), tiling.tile_m)
  for low, high in zip(bounds[:-1], bounds[1:]):
    pl.when((length > low) & (length <= high))(functools.partial(compute, high))


# ------------------------------------------------------------------------ k-grouping


def _k_steps(step, accs, start, end, base, tile_k: int, blocked: bool):
  """`step(i, accs, lower, upper)` over the K steps of one item's rows ``[start, end)``:
  full steps then a masked last one, or with blocked scales (steps from `base`, a multiple
  of `tile_k`) a masked first step, full steps and a masked last step."""
  if not blocked:
    size = end - start
    return _k_loop(lambda i, a, masked: step(i, a, False, masked), accs, size // tile_k,
                   (size + tile_k - 1) // tile_k)
  size = jnp.where(end > start, end - base, 0)
  num_steps, num_full = (size + tile_k - 1) // tile_k, size // tile_k
  head = jnp.minimum(num_steps, 1)
  body = jnp.maximum(num_full, head)
  accs = lax.fori_loop(0, head, lambda i, a: step(i, a, True, True), accs)
  accs = lax.fori_loop(head, body, lambda i, a: step(i, a, False, False), accs)
  return lax.fori_loop(body, num_steps, lambda i, a: step(i, a, False, True), accs)


def _store_partials(out_ref, accs, group, item, rows: Span, halves: tuple[Span, ...],
                    split: str, slots_ref, interpret: bool) -> None:
  """Split-K: each partial sum of `accs` (the group's rows `rows`, columns `halves`) stored
  to the item's chunk slot ``slots_ref[item]`` ("ordered") or added atomically ("atomic")."""
  for acc, span in zip(accs, halves):
    index = (group, pl.ds(rows.first, rows.size), pl.ds(span.first, span.size))
    mask = _mask2(rows, span)
    if split == "ordered":
      plgpu.store(out_ref.at[(slots_ref[item], *index)], acc, mask=mask)
    elif mask is not None and interpret:
      # Interpret mode has no masked atomics; it runs one program at a time, so a
      # read-modify-write is the same sum.
      view = out_ref.at[index]
      current = plgpu.load(view, mask=mask, other=jnp.zeros((), out_ref.dtype))
      plgpu.store(view, current + acc, mask=mask)
    else:
      plgpu.atomic_add(out_ref, index, acc, mask=mask)


def _k_kernel(num_items_ref, group_ids_ref, item_start_ref, item_end_ref, lhs_ref, rhs_ref,
              *refs, static: KernelStatic, cfg: GmmConfig, quant: common.QuantStatic | None,
              split: str | None):
  """k-grouping. `split`: None (each program owns a group's whole K: the epilogue runs
  here), "atomic" (its f32 partial sum is added atomically into ``[L, M, N]``) or
  "ordered" (it is stored to its chunk's slot ``slots_ref[item]`` of ``[chunks, L, M, N]``,
  summed in a fixed order afterwards). `quant`: "blocked" mode (``[Kb, M]`` and ``[Kb, N]``
  scales follow lhs and rhs), else None."""
  refs = list(refs)
  lhs_scale_ref = refs.pop(0) if quant is not None else None
  rhs_scale_ref = refs.pop(0) if quant is not None else None
  slots_ref = refs.pop(0) if split == "ordered" else None
  bias_ref = refs.pop(0) if static.has_bias else None
  out_ref = refs[-1]  # split: refs[-2] is the aliased zero buffer
  tiling, dot_dtype, acc_dtype = static.tiling, static.dot_dtype, static.acc_dtype
  m, _, n = static.dims
  n_out = out_columns(n, cfg)
  m_tiles = pl.cdiv(m, tiling.tile_m)
  row, col = program_order(pl.program_id(0), static.num_items * m_tiles,
                           pl.cdiv(n_out, tiling.tile_n), static.band)
  item = row // m_tiles
  rows = _cols((row % m_tiles) * tiling.tile_m, tiling.tile_m, m)
  cols = _cols(col * tiling.tile_n, tiling.tile_n, n_out)
  halves = _halves(cols, n_out, cfg)

  @pl.when(item < num_items_ref[0])  # padding items past the active ones do nothing
  def _():
    group = group_ids_ref[item]
    start = item_start_ref[item]
    end = item_end_ref[item]

    tile_k = tiling.tile_k
    # Blocked scales: the steps start at a multiple of tile_k (so each lies in one K block,
    # blocks counted from row 0); the first one masks the rows before the item's start.
    base = start if quant is None else start - start % tile_k

    def step(step_index, accs, lower: bool, upper: bool):
      first = base + step_index * tile_k
      ok = edge_mask(first, tile_k, end) if upper else None
      if lower:
        after = first + lax.iota(jnp.int32, tile_k) >= start
        ok = after if ok is None else ok & after
      ks = Span(first, tile_k, ok, end)
      x = _load(lhs_ref, (), rows, ks, cfg.transpose_lhs)
      if quant is not None:
        block = first // quant.k_block
        row_scale = _load_vector(lhs_scale_ref, (block,), rows)[:, None]
      new = []
      for acc, span in zip(accs, halves):
        product = _dot(x, _load(rhs_ref, (), ks, span, cfg.transpose_rhs), cfg, dot_dtype,
                       acc_dtype)
        if quant is not None:  # the block's product times both block scales, in f32
          product = (product * row_scale
                     * _load_vector(rhs_scale_ref, (block,), span)[None, :])
        new.append(acc + product)
      return tuple(new)

    accs = tuple(jnp.zeros((tiling.tile_m, tiling.tile_n), acc_dtype) for _ in halves)
    accs = _k_steps(step, accs, start, end, base, tile_k, quant is not None)
    if split is None:
      _store(out_ref, (group,), rows, cols, finish_tile(accs, _biases(bias_ref, group, halves),
                                                        cfg.activation, cfg.out_dtype))
      return
    _store_partials(out_ref, accs, group, item, rows, halves, split, slots_ref, cfg.interpret)
