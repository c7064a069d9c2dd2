"""Pallas TPU (Mosaic) gmm kernels.

m-grouping, grid ``(N tiles, steps, K tiles)`` with the step count read from a scalar (a
dynamic grid bound: only the steps that exist are visited). The steps are those of the
scalar-prefetched `metadata.TileWalk`: one per (row tile, local group it touches), plus a
*zero step* for every row tile that no local group touches, so every output tile is written
exactly once and rows no step owns (past the group total, of remote groups) are zeros
written by the kernel itself: no pass over the output after the call. A zero step does no
compute and repeats a neighbouring step's input block indices (no DMA).

The default tiles cover K and, where VMEM allows, N (or split N evenly), so the weights
``rhs[g]`` are fetched once per column block while consecutive items of one group keep the
block index (Pallas skips a DMA whose block index did not change). With one K step there is
no accumulator; with several, the K edge is masked on the last step only. An item that owns
part of a row tile computes only the `row_chunk`-row slices it touches (the MXU's rows), not
the whole tile. The VMEM limit is set from the block sizes (`vmem_limit`); tiles that do not
fit raise NotImplementedError rather than relying on Mosaic's default scoped limit.

Code size (Mosaic's compile time grows with the MXU code it unrolls): each step's product
is traced once (twice with a ragged K edge, whose last step masks it), a partial item's row
slices run in a loop, and a K block wider than `K_CHUNK` columns is multiplied
`K_CHUNK` columns at a time in a loop (`k_chunks`); the k-grouping kernel computes an output
tile taller than `OUT_ROW_CHUNK` rows in row chunks, in a loop (`out_row_chunk`). The
blocks, the grid and the DMAs stay the tiles'; `code_size` is one iteration's product.

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
the MXU path used on v5e/v6e is bf16/int8.

Blocked fp8 (``blocked_types=common.FP8_BLOCKED``, both group types; fp8 training's forward,
dlhs and k-grouped drhs): per scale block of ``k_block`` (128) contraction elements, a dot of
the fp8 values with f32 accumulation times the block's lhs row scales ``[tile_m, 1]`` and rhs
column scales ``[1, tile_n]``, summed. A K step (an item, for k-grouping) spans a whole
number of scale blocks, `blocked_tile_k` of them (up to 512 elements when the tiles are the
kernel's own choice, else one block), and takes one dot per block; the k-grouped items are
aligned to global multiples of ``tile_k`` (`metadata.make_tile_metadata`, align "tile"), so
their blocks are the scale blocks. The scales stay lane-dense in HBM (lhs ``[M, Kb]``, rhs
``[L, Kb, N]``: a ``[Kb, M, 1]`` layout would pad each value to a 128-lane row) and come in
windows of 128 lanes / 8 rows of Kb, from which each block picks its column and row. On a
chip with an fp8 MXU path (`cost_models.fp8_mxu`: TPU7x) the fp8 values go to the dot as
they are (one type on both sides; e4m3 x e5m2 meets in bf16); elsewhere (v5e/v6e) they are
converted in-kernel to bf16 (exact) before any mask or transpose.

Epilogue features (`FEATURES`; the dispatcher gathers and scatters rows around the kernels):
a gated activation (rhs columns ``[gate | up]``, both group types) passes rhs (and the
bias) twice, one BlockSpec for the gate column block ``n`` and one for the up block
``n + N/2 / tile_n``; ``tile_n`` counts output columns, a multiple of 128 dividing N/2; the
program keeps one accumulator per half and applies the activation to the pair in its
epilogue. Row weights (m-grouping) come as ``[tile_m, 1]`` f32 blocks of the item's row
tile and multiply the rows after the activation, in f32 before the cast (`_epilogue`:
`epilogue.finish`'s numerics). Quantized operands with a gated activation are refused
(the dispatcher then applies it after the plain kernel).

`cost_models.tpu_static_cost` models on the host what a call does (rows through the MXU,
grid steps, bytes DMA'd from HBM given the grid order and the skipped DMAs); the VMEM model
and the work items live there too.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gmm_jax._src.tiling import cost_models
from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, Tiling, is_gated, out_columns
from gmm_jax._src.tiling.cost_models import (DEQUANT_ROWS, LANE, fit_tile, k_items, m_items,
                                      modelled_seconds, mxu_rows, vmem_bytes, vmem_capacity,
                                      vmem_limit)
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, resolve_activation
from gmm_jax._src.core.qarray import QArray
from gmm_jax.pallas import common

ALIGN = cost_models.TPU_ALIGN  # BlockSpec index maps address whole tiles
# Re-exported for tests/test_pallas_tpu.py and gmm_jax.tools.bench, which read them here (the
# model lives in `cost_models`).
static_cost = cost_models.tpu_static_cost
VMEM_RESERVE = cost_models.VMEM_RESERVE
# What the kernels do in their epilogue beyond the plain gmm (`dispatch.Backend.features`):
# row weights (m-grouping) and gated activations (both group types). Gathered and scattered
# rows are done around them by the dispatcher (exact data movement).
FEATURES = ("row_weights", "gated", "gated_lhs", "gated_cotangent")


# ------------------------------------------------------------------------------ tiling


# How much more modelled run time `default_tiling` trades for less kernel code (compile
# time): measured on the Mixtral-like training step for v5e, the chosen tiles cost at most
# ~2% more modelled time and compile about twice as fast (benchmarks/log.md).
COMPILE_SLACK = 0.03
# The m-grouping kernel multiplies a K block of more columns than this in chunks of this
# many, in a loop (`k_chunks`); the k-grouping kernel computes an output tile of more rows
# than OUT_ROW_CHUNK in chunks of that many (`out_row_chunk`).
K_CHUNK = 512
OUT_ROW_CHUNK = 256


def _lane_tiles(dim: int, largest: int, smallest: int = 256) -> list[int]:
  """Candidate tiles for a lane-blocked dim, best first: the whole dim when it is at most
  `largest`; then multiples of 128 that divide it (largest first, down to `smallest`); then
  the powers of two below `largest` (a ragged edge)."""
  out = [dim] if dim <= largest else []
  if dim % LANE == 0:
    out += [t for t in range(min(largest, dim - LANE) // LANE * LANE, smallest - 1, -LANE)
            if dim % t == 0]
  t = largest
  while t >= LANE:
    if t < dim:
      out.append(t)
    t //= 2
  seen = []
  for t in out:
    if t not in seen:
      seen.append(t)
  return seen or [dim]


def default_tiling(m: int, k: int, n: int, cfg: GmmConfig, itemsize: int = 2) -> Tiling:
  """Tiles for the TPU kernels: of those that fit in half of the TPU's VMEM and whose
  `modelled_seconds` (balanced groups) is within `COMPILE_SLACK` of the least, the one
  with the least `code_size` (Mosaic's compile time).

  Candidates: m-grouping: 128/256/512 rows (or M), K whole or split evenly into multiples of
  128 (>= 512), N whole up to 2048 or split evenly (>= 256, a ragged power of two when N
  has no such divisor). k-grouping: output tiles with M and N whole up to 2048 or split
  likewise, and K items of 128/256/512 columns by the mean group size. A gated activation
  tiles its N/2 output columns (``tile_n`` counts them; `paired` blocks of both halves are
  in VMEM) by tiles that divide N/2, so that the up block is a whole block index away. A
  gated prologue (`cfg.lhs_activation`) reads K blocks of z's gate and up halves, K apart:
  its tile_k divides K (14336 = 2 x 7168, not a ragged 8192).
  """
  budget = vmem_capacity() // 2
  out_itemsize = cfg.out_dtype.itemsize
  m, k, n = max(m, 1), max(k, 1), max(out_columns(n, cfg), 1)

  prologue = cfg.lhs_activation is not None

  def fits(tiling, k_steps):
    needed = vmem_bytes(paired(tiling, cfg), cfg.group_type, lhs_itemsize=itemsize,
                        rhs_itemsize=itemsize, out_itemsize=out_itemsize,
                        dot_itemsize=itemsize, k_steps=k_steps,
                        transpose_lhs=cfg.transpose_lhs, weight_cache=True, has_bias=True)
    if prologue:  # the up half's block of z, double-buffered
      needed += 2 * tiling.tile_m * tiling.tile_k * itemsize
    return needed <= budget

  def columns(largest):
    tiles = _lane_tiles(n, largest)
    if not cfg.gated:
      return tiles
    return [t for t in tiles if n % t == 0 and t % LANE == 0] or [n]

  if cfg.group_type == "m":
    candidates = [Tiling(tile_m=tm, tile_k=tk, tile_n=tn)
                  for tm in ([t for t in (512, 256, 128) if t <= m] or [m])
                  for tk in _lane_tiles(k, 16384, smallest=512)
                  if not prologue or k % tk == 0
                  for tn in columns(2048)]
    fallback = Tiling(tile_m=min(128, m), tile_k=min(512, k), tile_n=min(512, n))
  else:
    mean = k // max(1, cfg.num_local)
    tile_k = 128 if mean < 256 else (256 if mean < 512 else 512)
    candidates = [Tiling(tile_m=tm, tile_k=tile_k, tile_n=tn)
                  for tm in _lane_tiles(m, 2048) for tn in columns(2048)]
    fallback = Tiling(tile_m=min(256, m), tile_k=tile_k, tile_n=min(512, n))
  candidates = [t for t in candidates if fits(t, math.ceil(k / t.tile_k))]
  if not candidates:
    return fallback
  # Of the tiles within COMPILE_SLACK of the best modelled time, those with the least
  # unrolled MXU code per step (`code_size`: Mosaic's compile time grows with it, about
  # linearly); among them the larger tiles (fewer steps, fewer re-reads).
  scored = [(modelled_seconds(paired(t, cfg), m, k, n * (2 if cfg.gated else 1), cfg,
                              itemsize), t) for t in candidates]
  best = min(score for score, _ in scored)
  near = [t for score, t in scored if score <= best * (1 + COMPILE_SLACK)]
  least = min(code_size(t, cfg) for t in near)
  return max((t for t in near if code_size(t, cfg) == least),
             key=lambda t: (t.tile_k, t.tile_n, t.tile_m))


def k_chunks(tile_k: int, cached: bool = False) -> int:
  """How many `K_CHUNK`-column chunks the m-grouping kernel's K block is multiplied in, one
  loop iteration each (1: the block in one product; weights the kernel dequantizes into a
  cache, or dequantizes whole, are multiplied whole)."""
  if cached or tile_k <= K_CHUNK or tile_k % K_CHUNK:
    return 1
  return tile_k // K_CHUNK


def out_row_chunk(tile_m: int) -> int:
  """The rows per chunk the k-grouping kernel computes its output tile in, one loop
  iteration each: `OUT_ROW_CHUNK`, or 128 where that does not divide the tile (the tile
  itself where neither does, or where it is no larger)."""
  for rows in (OUT_ROW_CHUNK, 128):
    if tile_m > rows and tile_m % rows == 0:
      return rows
  return tile_m


def code_size(tiling: Tiling, cfg: GmmConfig) -> int:
  """A proxy for the kernel's code, and so its Mosaic compile time: the multiply-adds of
  the dot that Mosaic unrolls into MXU operations, one loop iteration's (`k_chunks`,
  `out_row_chunk`) of a grid step (gate and up when gated)."""
  tiling = paired(tiling, cfg)
  if cfg.group_type == "k":
    return out_row_chunk(tiling.tile_m) * tiling.tile_k * tiling.tile_n
  return tiling.tile_m * tiling.tile_k // k_chunks(tiling.tile_k) * tiling.tile_n


def paired(tiling: Tiling, cfg: GmmConfig) -> Tiling:
  """The tiles as VMEM holds them: a gated activation's program keeps the gate and the up
  column blocks (and accumulators) of its ``tile_n`` output columns."""
  if not cfg.gated:
    return tiling
  return Tiling(tile_m=tiling.tile_m, tile_k=tiling.tile_k, tile_n=2 * tiling.tile_n)


def check_tiling(tiling: Tiling, m: int, k: int, n: int, cfg: GmmConfig) -> None:
  """Raises NotImplementedError for a tile Mosaic cannot block.

  Each tile must be a multiple of 128 or cover its whole dimension; with lhs stored
  untransposed, ``tile_m`` (a sublane dimension) may also be a multiple of 32. A gated
  activation's ``tile_n`` counts output columns (N/2 of the N product columns) and must
  be a multiple of 128 dividing N/2 (its blocks never cover the 2N columns): the up block
  is then N/2 / tile_n block indices after the gate block.
  """
  if cfg.gated:
    n = out_columns(n, cfg)
    tile_n = min(tiling.tile_n, n)
    if n % tile_n or tile_n % LANE:
      raise NotImplementedError(
          f"a gated activation in the TPU kernel needs tile_n to be a multiple of {LANE} that "
          f"divides the {n} output columns (the up half is then a whole number of blocks "
          f"away), got tile_n={tiling.tile_n}")
  dims = dict(tile_m=m, tile_k=k, tile_n=n)
  for name, dim in dims.items():
    tile = getattr(tiling, name)
    sublane_ok = name == "tile_m" and not cfg.transpose_lhs and tile % 32 == 0
    if tile < dim and tile % LANE and not sublane_ok:
      raise NotImplementedError(
          f"the TPU kernels need tiles that are multiples of {LANE} (tile_m: of 32 when lhs is "
          f"not transposed) or cover the dimension; got {name}={tile} for a dimension of {dim}")


def kernel_activation(activation):
  """The activation as the kernel applies it: the exact GELU through ``lax.erf`` (Mosaic
  lowers erf but not the erfc that ``jax.nn.gelu(approximate=False)`` uses); others as
  given."""
  if activation == "gelu":
    return lambda x: 0.5 * x * (1.0 + lax.erf(x * 0.7071067811865476))
  return activation


# The gated activations on the gate and up halves, which the kernels keep in two blocks and
# accumulators ("geglu"'s gate through `kernel_activation`'s erf).
GATED_PAIRS = common.gated_pairs(kernel_activation)


def _mosaic_rules():
  """Mosaic TPU's (TensorCore) lowering rules by primitive, or None when the table (a
  private jax module) cannot be read."""
  try:
    from jax._src.pallas.mosaic import lowering as mosaic_lowering
    rules = mosaic_lowering.lowering_rules
    if not isinstance(next(iter(rules)), jax.extend.core.Primitive):  # keyed by core type
      rules = next(table for core, table in rules.items() if str(core).lower() == "tc")
  except (ImportError, AttributeError, StopIteration):
    return None
  return rules


def unsupported_primitives(activation) -> set[str]:
  """Primitives of `activation` without a Mosaic TPU (TensorCore) lowering rule.

  Best effort: empty when the lowering table (a private jax module) cannot be read.
  """
  rules = _mosaic_rules()
  if rules is None:
    return set()
  if is_gated(activation):
    pair = GATED_PAIRS[activation]
    return common.unsupported_primitives(lambda z: pair(z, z), rules)
  return common.unsupported_primitives(resolve_activation(kernel_activation(activation)), rules)


# ----------------------------------------------------------------------------- fp8 blocks


_FP8_TYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))


def check_operands(lhs, rhs, cfg: GmmConfig) -> None:
  """`common.check_quant` with the blocked fp8 mode (both group types) served in-kernel."""
  common.check_quant(lhs, rhs, cfg, blocked_types=common.FP8_BLOCKED)


def _blocked_dot_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
  """The dot dtype of blocked fp8 values: the fp8 type itself on a chip with an fp8 MXU path
  when both sides share it; else bf16, which holds every e4m3 and e5m2 value exactly."""
  if cost_models.fp8_mxu() and np.dtype(lhs_dtype) == np.dtype(rhs_dtype):
    return np.dtype(lhs_dtype)
  return np.dtype(jnp.bfloat16)


# Scale blocks per K step (k_block = 128: tile_k = 512) when the kernel picks the tiles: fewer
# grid steps and larger DMAs than one block per step, the same 128-deep dots.
MAX_BLOCKS_PER_STEP = 4


def blocked_tile_k(tiling: Tiling, k: int, k_block: int, cfg: GmmConfig,
                   automatic: bool) -> int:
  """The K step of a blocked call: ``k_block`` (what `common.with_quant_k_step` gives) for
  explicit tiles; for the kernel's own tiles, up to `MAX_BLOCKS_PER_STEP` blocks: as many as
  K needs (m-grouping), or by the mean group size as `default_tiling` picks K items
  (k-grouping)."""
  if not automatic or k <= k_block:
    return tiling.tile_k
  blocks = min(MAX_BLOCKS_PER_STEP, -(-k // k_block))
  if cfg.group_type == "k":  # items of a group cover its K: no wider than its mean size
    mean = k // max(1, cfg.num_local)
    blocks = min(blocks, 1 if mean < 2 * k_block else (2 if mean < 4 * k_block else blocks))
  return blocks * k_block


def _blocked_scales(quant: common.QuantOperands, m: int, n: int, k: int, steps: int,
                    blocks_per_step: int):
  """The blocked scales in lane-dense layouts (no padding of a unit dim to a whole vreg
  tile in HBM): lhs ``[M, Kb]`` and rhs ``[L, Kb, N]`` (``[Kb, N]`` for k-grouping), Kb
  padded with ones to ``steps * blocks_per_step`` (a K edge step reads no undefined scale),
  and the lanes / rows of Kb one block of each holds (`_scale_window`). K = 0: one block of
  ones (nothing is summed)."""
  lhs_scale, rhs_scale = quant.lhs_scale, quant.rhs_scale
  if k == 0:
    lhs_scale = jnp.ones((m, 1), jnp.float32)
    rhs_scale = jnp.ones((rhs_scale.shape[0], 1, n), jnp.float32)
  pad = steps * blocks_per_step - lhs_scale.shape[1]
  if pad > 0:
    lhs_scale = jnp.pad(lhs_scale, ((0, 0), (0, pad)), constant_values=1.0)
    rhs_scale = jnp.pad(rhs_scale, ((0, 0), (0, pad), (0, 0)), constant_values=1.0)
  num_kb = lhs_scale.shape[1]
  return lhs_scale, rhs_scale, _scale_window(num_kb, LANE), _scale_window(num_kb, 8)


def _scale_window(num_kb: int, tile: int) -> int:
  """Scale blocks per BlockSpec block along Kb: all of them up to a vreg tile's `tile`
  (lanes for the lhs scales, sublanes for the rhs scales), else `tile`; a K step's
  blocks (1, 2 or 4, or all of a single step) lie in one window."""
  return num_kb if num_kb <= tile else tile


def _block_widths(tile_k: int, k_block: int) -> list[int]:
  """The widths of the scale blocks one K step of `tile_k` spans (the last may be short
  when the step covers a K that is not a multiple of `k_block`)."""
  return [min(k_block, tile_k - lo) for lo in range(0, tile_k, k_block)]


def _blocked_product(lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref, rows, base,
                     cfg: GmmConfig, k_block: int, dot_dtype, acc_dtype, mask=None):
  """sum over the scale blocks j of this K step of ``dot(x_j, w_j) * lhs_scale[:, j] *
  rhs_scale[j, :]`` for the lhs rows (lanes, when lhs is stored ``[K, M]``) ``rows`` (a
  slice). The scale blocks are windows of Kb (`_scale_window`): ``[tile_m, lanes]`` and
  ``[rows, tile_n]``; the step's first scale block is global block `base`.
  `mask`: None, or ``(first, lo, hi)``: zero the K indices (``first`` + position in the step)
  outside ``[lo, hi)``."""
  lhs_scales = lhs_scale_ref[rows, :]  # [rows, lanes]: a lane per block of the window
  lane = lax.broadcasted_iota(jnp.int32, lhs_scales.shape, 1)
  total = None
  for j, width in enumerate(_block_widths(lhs_ref.shape[0 if cfg.transpose_lhs else 1],
                                          k_block)):
    # Block base + j's lhs scale column (a masked lane sum) and rhs scale row.
    column = jnp.sum(jnp.where(lane == (base + j) % lhs_scales.shape[1], lhs_scales, 0.0),
                     axis=1, keepdims=True)
    row = rhs_scale_ref[pl.ds((base + j) % rhs_scale_ref.shape[0], 1), :]
    cols = slice(j * k_block, j * k_block + width)
    x = _values(lhs_ref[cols, rows] if cfg.transpose_lhs else lhs_ref[rows, cols], dot_dtype)
    w = _values(rhs_ref[:, cols] if cfg.transpose_rhs else rhs_ref[cols, :], dot_dtype)
    if mask is not None:
      first, lo, hi = mask
      x = _mask_k(x, first + j * k_block, lo, hi, 0 if cfg.transpose_lhs else 1)
      w = _mask_k(w, first + j * k_block, lo, hi, 1 if cfg.transpose_rhs else 0)
    part = _dot(x, w, cfg, dot_dtype, acc_dtype) * column * row
    total = part if total is None else total + part
  return total


def _values(block, dot_dtype):
  """8-bit float values as the dot takes them: converted (exactly) to the dot dtype (bf16)
  before any mask or transpose where the chip has no fp8 MXU path; others as stored."""
  if np.dtype(block.dtype) in _FP8_TYPES and np.dtype(block.dtype) != dot_dtype:
    return block.astype(dot_dtype)
  return block


# ------------------------------------------------------------------------------ kernels


def _dot(x, w, cfg: GmmConfig, dot_dtype, acc_dtype):
  """``x @ w`` of blocks as stored (x: [M, K] or [K, M]; w: [K, N] or [N, K])."""
  if cfg.transpose_lhs:  # contract the sublane dim of x: transpose in VMEM first
    x = x.T
  rhs_contract = 1 if cfg.transpose_rhs else 0
  return lax.dot_general(
      x.astype(dot_dtype), w.astype(dot_dtype), (((1,), (rhs_contract,)), ((), ())),
      precision=cfg.precision, preferred_element_type=acc_dtype)


def _mask_k(block, first, limit_lo, limit_hi, k_axis: int):
  """Zeroes the entries of `block` whose K index (``first`` + position) is outside
  ``[limit_lo, limit_hi)``."""
  index = first + lax.broadcasted_iota(jnp.int32, block.shape, k_axis)
  return jnp.where((index >= limit_lo) & (index < limit_hi), block, jnp.zeros((), block.dtype))


def _dequantized(w_ref, scale_ref, zero_ref, cfg: GmmConfig, dot_dtype):
  """The weight tile ``(w - zero) * scale`` in the dot dtype (the composed XLA path's
  numerics); the scale/zero blocks are ``[1, tile_n]`` (``[tile_n, 1]`` when rhs is stored
  ``[N, K]``)."""
  return common.dequantize_tile(w_ref[...], scale_ref[...],
                                None if zero_ref is None else zero_ref[...],
                                cfg.transpose_rhs, dot_dtype)


def _epilogue(accs, biases, cfg: GmmConfig, row_weights=None):
  """`common.finish_tile` with this kernel's erf GELU: ``cast(activation(acc + bias) *
  row_weights)`` in f32, a gated activation on its gate and up accumulators (``accs`` holds
  both, `biases` their bias rows ``[1, tile_n]`` or None); `row_weights` ``[rows, 1]``."""
  return common.finish_tile(accs, biases, cfg.activation, cfg.out_dtype, row_weights,
                            kernel_activation=kernel_activation, pairs=GATED_PAIRS)


def _gated_cotangent_tiles(name: str, gate, up, ct):
  """`epilogue.gated_cotangent` on tiles: the cotangents of the gate and up tiles of z for
  the cotangent tile ct of the gated activation's result, in f32 (`GATED_PAIRS`' forms)."""
  _, pull = jax.vjp(GATED_PAIRS[name], gate.astype(jnp.float32), up.astype(jnp.float32))
  return pull(ct.astype(jnp.float32))


def unsupported_cotangent_primitives(name: str) -> set[str]:
  """Primitives of the gated-cotangent epilogue of `name` without a Mosaic TPU lowering
  (best effort, as `unsupported_primitives`)."""
  rules = _mosaic_rules()
  if rules is None:
    return set()
  return common.unsupported_primitives(
      lambda z: _gated_cotangent_tiles(name, z, z, z)[0] + _gated_cotangent_tiles(
          name, z, z, z)[1], rules)


def _check_gated_operand(cfg: GmmConfig, refused: bool, serves: str, missing, what: str):
  """NotImplementedError for a gated prologue or cotangent epilogue the kernel does not
  serve (`refused`, or k-grouping), or (compiled mode) whose `missing()` primitives Mosaic
  cannot lower."""
  if refused or cfg.group_type != "m":
    raise NotImplementedError(f"the TPU kernel's {serves}")
  if not cfg.interpret:
    common.require_lowerable(missing(), what, "Mosaic TPU")


class _Step:
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


def _m_kernel(ranges_ref, row_starts_ref, steps_end_ref, *refs, dims,
              tiling: Tiling, cfg: GmmConfig,
              dot_dtype, acc_dtype, has_bias: bool, k_steps: int, row_chunk: int,
              weight_cache: bool, quant: common.QuantStatic | None = None,
              gated: bool = False, weighted: bool = False, cotangent: bool = False,
              prologue: bool = False):
  refs = list(refs)
  lhs_ref = refs.pop(0)
  # A gated prologue: lhs holds z [M, 2K]; the up half's K block is K/tile_k blocks later.
  lhs_up_ref = refs.pop(0) if prologue else None
  rhs_ref = refs.pop(0)
  # A gated activation: the up column block (N/2 later) of rhs and of the bias.
  up_ref = refs.pop(0) if gated else None
  bias_refs = [refs.pop(0) for _ in range(2 if gated else 1)] if has_bias else None
  scale_ref = refs.pop(0) if quant is not None else None
  zero_ref = refs.pop(0) if quant is not None and quant.has_zero else None
  blocked = quant is not None and quant.mode == "blocked"
  lhs_scale_ref = refs.pop(0) if quant is not None and quant.mode != "weight_only" else None
  weights_ref = refs.pop(0) if weighted else None  # [tile_m, 1] f32 row weights
  # A gated-cotangent epilogue: z's gate and up tiles beside the output tile; the output
  # stays in HBM and gets the two cotangent tiles of each row tile by DMA, from a VMEM pair
  # that the row tile's items fill.
  z_refs = (refs.pop(0), refs.pop(0)) if cotangent else None
  out_ref = refs.pop(0)
  acc_refs = [refs.pop(0) for _ in range(2 if gated else 1)] if k_steps > 1 else None
  cache_ref, cached_ref = (refs.pop(0), refs.pop(0)) if weight_cache else (None, None)
  pair_ref, sems = (refs.pop(0), refs.pop(0)) if cotangent else (None, None)
  tile_ref = pair_ref if cotangent else out_ref
  weight_only = quant is not None and quant.mode == "weight_only"
  k = dims[1]
  tile_m, tile_k = tiling.tile_m, tiling.tile_k
  mask_edge = k_steps > 1 and k % tile_k != 0
  column, item, k_step = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  last_k = k_step == k_steps - 1
  walk = (ranges_ref, row_starts_ref, steps_end_ref)
  at = functools.partial(_Step, walk, m=dims[0], tile_m=tile_m, num_local=cfg.num_local,
                         k_steps=k_steps)
  step = at(item)
  real, start, end = step.real, step.start, step.end
  tile_lo = step.out_tile * tile_m
  first_in_tile = (item == 0) | (at(jnp.maximum(item - 1, 0)).out_tile != step.out_tile)

  @pl.when(last_k & first_in_tile)
  def _():  # rows of this tile that no item owns stay zero
    tile_ref[...] = jnp.zeros(tile_ref.shape, tile_ref.dtype)

  if weight_cache:  # one K step: cast the weight tile once per group and column block
    group = step.group

    @pl.when(item == 0)  # a new column block (or core): nothing cached yet
    def _():
      cached_ref[0] = -1

    @pl.when(real & (cached_ref[0] != group))
    def _():
      # In slices of DEQUANT_ROWS stored rows, so the f32 temporaries stay small.
      for lo in range(0, cache_ref.shape[0], DEQUANT_ROWS):
        hi = min(lo + DEQUANT_ROWS, cache_ref.shape[0])
        scale = scale_ref[lo:hi, :] if cfg.transpose_rhs else scale_ref[...]
        zero = None if zero_ref is None else (
            zero_ref[lo:hi, :] if cfg.transpose_rhs else zero_ref[...])
        cache_ref[lo:hi, :] = common.dequantize_tile(rhs_ref[lo:hi, :], scale, zero,
                                                     cfg.transpose_rhs, dot_dtype)
      cached_ref[0] = group

  def weights(w_ref):
    if weight_cache:
      return cache_ref[...]
    if weight_only:
      return _dequantized(w_ref, scale_ref, zero_ref, cfg, dot_dtype)
    return w_ref[...]

  def rows(lo, size: int):
    """The item's work on the rows ``[lo, lo + size)`` of the tile (`lo` static, or traced
    and a multiple of `row_chunk`)."""
    span = pl.ds(lo, size)
    own = (span, slice(None))

    def products(masked: bool):
      """The step's product for each rhs column block (gate and up when gated)."""
      if blocked:  # one dot per scale block of this K step, times its row and column scales
        return [_blocked_product(lhs_ref, rhs_ref, lhs_scale_ref, scale_ref,
                                 span,
                                 k_step * len(_block_widths(tile_k, quant.k_block)), cfg,
                                 quant.k_block, dot_dtype,
                                 acc_dtype, (k_step * tile_k, 0, k) if masked else None)]
      w_refs = (rhs_ref, up_ref) if gated else (rhs_ref,)

      def chunk_product(ks, first):
        """The product over the K columns `ks` of the step's block (None: all of them;
        the first is the problem's column `first`), for each rhs column block."""
        whole = ks is None
        ks = slice(None) if whole else ks
        if prologue:  # act(gate, up) in f32, rounded to lhs's dtype (`epilogue.gated_input`)
          x = GATED_PAIRS[cfg.lhs_activation](
              lhs_ref[span, ks].astype(jnp.float32),
              lhs_up_ref[span, ks].astype(jnp.float32)).astype(lhs_ref.dtype)
          x = _values(x, dot_dtype)
        else:
          x = _values(lhs_ref[ks, span] if cfg.transpose_lhs
                      else lhs_ref[span, ks], dot_dtype)
        if masked:  # the padded K edge of the last step reads garbage: zero it in both
          x = _mask_k(x, first, 0, k, 0 if cfg.transpose_lhs else 1)
        out = []
        for w_ref in w_refs:
          w = _values(weights(w_ref) if whole else (
              w_ref[:, ks] if cfg.transpose_rhs else w_ref[ks, :]), dot_dtype)
          if masked:
            w = _mask_k(w, first, 0, k, 1 if cfg.transpose_rhs else 0)
          out.append(_dot(x, w, cfg, dot_dtype, acc_dtype))
        return out

      chunks = k_chunks(tile_k, weight_cache or weight_only)
      if chunks == 1:
        return chunk_product(None, k_step * tile_k)

      # K_CHUNK columns at a time in a loop: Mosaic compiles one chunk's MXU code instead
      # of the whole block's (its compile time grows with the unrolled code); the block's
      # DMA and the grid are unchanged.
      def chunk_body(c, accs):
        lo_k = pl.multiple_of(c * K_CHUNK, K_CHUNK)
        parts = chunk_product(pl.ds(lo_k, K_CHUNK), k_step * tile_k + lo_k)
        return tuple(acc + part for acc, part in zip(accs, parts))

      width = (rhs_ref.shape[0] if cfg.transpose_rhs else rhs_ref.shape[1])
      init = tuple(jnp.zeros((size, width), acc_dtype) for _ in w_refs)
      return list(lax.fori_loop(0, chunks, chunk_body, init))

    def finish(accs):
      if lhs_scale_ref is not None and not blocked:  # int8 x int8: int32 sums, then scales
        accs = [acc.astype(jnp.float32) * lhs_scale_ref[span, :] * scale_ref[...]
                for acc in accs]
      biases = [None] * len(accs) if bias_refs is None else [b[...] for b in bias_refs]
      row_weights = None if weights_ref is None else weights_ref[span, :]
      y = _epilogue(accs, biases, cfg, row_weights)
      row = tile_lo + lo + lax.broadcasted_iota(jnp.int32, y.shape, 0)
      mine = (row >= start) & (row < end)
      if cotangent:
        halves = _gated_cotangent_tiles(cfg.cotangent_of, z_refs[0][span, :],
                                        z_refs[1][span, :], y)
        for h, d in enumerate(halves):
          pair_ref[h, span, :] = jnp.where(mine, d.astype(pair_ref.dtype),
                                  pair_ref[h, span, :])
        return
      out_ref[span, :] = jnp.where(mine, y, out_ref[span, :])

    if k_steps == 1:
      finish(products(False))
      return

    if blocked:  # one copy of the (per-block unrolled) product per variant, not three
      @pl.when(k_step == 0)
      def _():
        for acc_ref in acc_refs:
          acc_ref[own] = jnp.zeros((size, acc_ref.shape[1]), acc_ref.dtype)

      def accumulate(masked: bool):
        for acc_ref, part in zip(acc_refs, products(masked)):
          acc_ref[own] += part

      if mask_edge:  # the padded K edge only on the last step
        pl.when(~last_k)(functools.partial(accumulate, False))
        pl.when(last_k)(functools.partial(accumulate, True))
      else:
        accumulate(False)
      pl.when(last_k)(lambda: finish([acc_ref[own] for acc_ref in acc_refs]))
      return

    # The step's product is traced once, outside the branches that use it: a copy per
    # branch (first, middle, last K step) tripled the kernel's unrolled MXU code and
    # Mosaic's compile time, for the same work at run time. A ragged K edge masks the last
    # step's product: that step gets its own (masked) copy, the others share one.
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
      finish([acc_ref[own] + part for acc_ref, part in zip(acc_refs, parts)])

    if mask_edge:
      pl.when(~last_k)(lambda: accumulate(products(False), k_step > 0))
      pl.when(last_k)(lambda: last_step(products(True)))
    else:
      parts = products(False)
      accumulate(parts, (k_step > 0) & ~last_k)
      pl.when(last_k)(lambda: last_step(parts))

  chunks = tile_m // row_chunk if row_chunk < tile_m and tile_m % row_chunk == 0 else 1
  if chunks == 1:
    pl.when(real)(lambda: rows(0, tile_m))
  else:
    full = (start <= tile_lo) & (end >= tile_lo + tile_m)
    pl.when(real & full)(lambda: rows(0, tile_m))
    touches = lambda lo: (start < tile_lo + lo + row_chunk) & (end > tile_lo + lo)
    if cfg.transpose_lhs or blocked:  # lane-dim or per-block slices: one copy per chunk
      for chunk in range(chunks):  # a partial item: only the MXU row slices it touches
        lo = chunk * row_chunk
        pl.when(real & ~full & touches(lo))(functools.partial(rows, lo, row_chunk))
    else:
      # A partial item: only the MXU row slices it touches, by a loop over the chunks at a
      # traced row offset, so that Mosaic compiles one chunk's code instead of `chunks`
      # unrolled copies (which doubled the kernel's code for the same run-time work).
      @pl.when(real & ~full)
      def _():
        def chunk_body(chunk, carry):
          lo = pl.multiple_of(chunk * row_chunk, row_chunk)
          pl.when(touches(lo))(functools.partial(rows, lo, row_chunk))
          return carry

        lax.fori_loop(0, chunks, chunk_body, 0)
  if cotangent:
    last = pl.num_programs(1) - 1
    last_in_tile = (item == last) | (
        at(jnp.minimum(item + 1, last)).out_tile != step.out_tile)

    @pl.when(last_k & last_in_tile)
    def _():  # the row tile is complete: its gate and up cotangent tiles, N columns apart
      tile_rows = pl.ds(pl.multiple_of(tile_lo, tile_m), tile_m)
      tile_n = tiling.tile_n
      copies = [pltpu.make_async_copy(
          pair_ref.at[h], out_ref.at[tile_rows, pl.ds(
              pl.multiple_of((column + h * (dims[2] // tile_n)) * tile_n, tile_n), tile_n)],
          sems.at[h]) for h in (0, 1)]
      for copy in copies:
        copy.start()
      for copy in copies:
        copy.wait()


def _k_kernel(groups_ref, tiles_ref, starts_ref, ends_ref, lhs_ref, rhs_ref, *refs, dims,
              tiling: Tiling, cfg: GmmConfig, dot_dtype, acc_dtype, has_bias: bool,
              k_block: int | None = None, gated: bool = False):
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
      return [_blocked_product(lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref, rows,
                               tiles_ref[item] * len(_block_widths(tiling.tile_k, k_block)),
                               cfg, k_block, dot_dtype, acc_dtype,
                               (first, start, end) if masked else None)]
    x = _values(lhs_ref[:, rows] if cfg.transpose_lhs else lhs_ref[rows, :], dot_dtype)
    if masked:  # columns of other groups in this K tile, and the padded K edge: zero in both
      x = _mask_k(x, first, start, end, 0 if cfg.transpose_lhs else 1)
    out = []
    for w_ref in w_refs:
      w = _values(w_ref[...], dot_dtype)
      if masked:
        w = _mask_k(w, first, start, end, 1 if cfg.transpose_rhs else 0)
      out.append(_dot(x, w, cfg, dot_dtype, acc_dtype))
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
    out_ref[...] = _epilogue([acc_ref[...] for acc_ref in acc_refs], biases, cfg)


# --------------------------------------------------------------------------- entry point


def _transcendentals(cfg: GmmConfig, elements: int) -> int:
  return 0 if cfg.activation in (None, "relu") else int(elements)


def _cost_estimate(flops: int, transcendentals: int, bytes_accessed: int):
  if not hasattr(pl, "CostEstimate"):
    return {}
  return dict(cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                                            bytes_accessed=int(bytes_accessed)))


def _nbytes(shape, dtype) -> int:
  return int(np.prod(shape)) * np.dtype(dtype).itemsize


def plan(lhs, rhs, counts, cfg: GmmConfig, tiling: Tiling | None = None):
  """What `gmm_tpu` would run for these operands: a dict with the tiles, grid (the items
  axis as its static bound), VMEM estimate and limit; `Prepared` under "prepared".

  Raises:
    NotImplementedError: as `gmm_tpu`.
  """
  prepared = common.preamble(lhs, rhs, counts, cfg, tiling, default_tiling=default_tiling,
                             check_tiling=check_tiling, unsupported=unsupported_primitives,
                             backend="Mosaic TPU", implementation="pallas_tpu", platform="tpu",
                             blocked_types=common.FP8_BLOCKED)
  m, k, n = prepared.dims
  quant = prepared.quant
  if cfg.gather_rows is not None or cfg.out_rows is not None:
    raise NotImplementedError("the TPU kernels take grouped rows as they are (the dispatcher "
                              "gathers and scatters rows around them)")
  if cfg.gated:
    if n % 2:
      raise ValueError(f"a gated activation ({cfg.activation!r}) needs an even number of rhs "
                       f"columns [gate | up], got {n}")
    if quant is not None:
      raise NotImplementedError(
          f"a gated activation in the TPU kernel takes unquantized operands, not "
          f"{quant.mode!r} ones (the dispatcher applies it after the kernel)")
    # From here on n counts the output columns; the up half is n columns later.
    n = out_columns(n, cfg)
    prepared = prepared._replace(out_shape=(m, n) if cfg.group_type == "m"
                                 else (cfg.num_local, m, n))
  if cfg.lhs_activation is not None:
    _check_gated_operand(
        cfg, cfg.lhs_tangent or cfg.transpose_lhs or quant is not None,
        "gated prologue serves the value of an m-grouped float gmm (its tangent is composed)",
        lambda: unsupported_primitives(cfg.lhs_activation),
        f"the prologue {cfg.lhs_activation!r}")
  if cfg.cotangent_of is not None:
    _check_gated_operand(
        cfg, cfg.gated or quant is not None,
        "gated-cotangent epilogue serves an m-grouped float gmm with no activation of its own",
        lambda: unsupported_cotangent_primitives(cfg.cotangent_of),
        f"the cotangent of {cfg.cotangent_of!r}")
    prepared = prepared._replace(out_shape=(m, 2 * n))
  blocked = quant is not None and quant.mode == "blocked"
  if blocked:
    prepared = prepared._replace(dot_dtype=_blocked_dot_dtype(prepared.lhs.dtype,
                                                              prepared.rhs.dtype))
  k_blocks = max(k, 1)
  tiling = prepared.tiling
  if blocked:
    tiling = Tiling(tile_m=tiling.tile_m, tile_n=tiling.tile_n,
                    tile_k=blocked_tile_k(tiling, k, quant.k_block, cfg, prepared.automatic))
  tiling = Tiling(tile_m=fit_tile(tiling.tile_m, m) if m else 1,
                  tile_k=fit_tile(tiling.tile_k, k_blocks),
                  tile_n=fit_tile(tiling.tile_n, n) if n else 1)
  weight_only = quant is not None and quant.mode == "weight_only"
  k_steps = pl.cdiv(k_blocks, tiling.tile_k)
  if blocked and k_steps > 1 and tiling.tile_k % quant.k_block:
    raise NotImplementedError(
        f"blocked scales need K steps of whole scale blocks: tile_k {tiling.tile_k} for "
        f"blocks of {quant.k_block}")
  weight_cache = cfg.group_type == "m" and k_steps == 1 and weight_only
  rhs_dtype = prepared.rhs.dtype
  needed = vmem_bytes(
      paired(tiling, cfg), cfg.group_type, lhs_itemsize=prepared.lhs.dtype.itemsize,
      rhs_itemsize=rhs_dtype.itemsize, out_itemsize=cfg.out_dtype.itemsize,
      dot_itemsize=prepared.dot_dtype.itemsize, k_steps=k_steps,
      transpose_lhs=cfg.transpose_lhs, weight_cache=weight_cache,
      has_bias=True, scales=0 if quant is None else (1 if blocked else 2),
      lhs_scale=quant is not None)
  if cfg.row_weights:  # the [tile_m, 1] f32 weights pad to 128 lanes, double-buffered
    needed += 2 * tiling.tile_m * LANE * 4
  if cfg.lhs_activation is not None:
    if k % tiling.tile_k:
      raise NotImplementedError(
          f"the TPU kernel's gated prologue reads whole K blocks of both halves: K={k} must "
          f"be a multiple of tile_k={tiling.tile_k}")
    needed += 2 * tiling.tile_m * tiling.tile_k * prepared.lhs.dtype.itemsize  # the up block
  if cfg.cotangent_of is not None:
    if m % tiling.tile_m or n % tiling.tile_n:
      raise NotImplementedError(
          f"the TPU kernel's gated-cotangent epilogue writes whole tiles: M={m} and N={n} "
          f"must be multiples of tile_m={tiling.tile_m} and tile_n={tiling.tile_n}")
    # z's gate and up tiles (double-buffered) and the VMEM pair of cotangent tiles.
    tile = tiling.tile_m * tiling.tile_n
    needed += 4 * tile * lhs.dtype.itemsize + 2 * tile * cfg.out_dtype.itemsize
  info = dict(tiling=tiling, k_steps=k_steps, weight_cache=weight_cache, vmem_bytes=needed,
              row_chunk=mxu_rows(), prepared=prepared, out_columns=n,
              blocks_per_step=len(_block_widths(tiling.tile_k, quant.k_block)) if blocked else 0)
  if prepared.empty:
    return info
  info["vmem_limit_bytes"] = vmem_limit(needed)
  num_m, num_n = pl.cdiv(m, tiling.tile_m), pl.cdiv(n, tiling.tile_n)
  if cfg.group_type == "m":
    items = metadata.max_work_items(m, tiling.tile_m, cfg.num_local, ALIGN) + num_m
    info["grid"] = (num_n, items, k_steps)
  else:
    items = metadata.max_work_items(k_blocks, tiling.tile_k, cfg.num_local, ALIGN, cover=True)
    info["grid"] = (num_m, num_n, items)
  return info


def gmm_tpu(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
            tiling: Tiling | None = None, rows: Rows = NO_ROWS):
  """gmm on canonical operands (see `GmmConfig`) with the Pallas Mosaic TPU kernels.

  Args:
    lhs: ``[M, K]`` (``[K, M]`` if ``cfg.transpose_lhs``).
    rhs: m-grouping ``[num_local, K, N]``, k-grouping ``[K, N]`` (last two dims swapped if
      ``cfg.transpose_rhs``).
    counts: int32 ``[G]`` global group sizes.
    group_offset: int32 scalar, the first global group held locally.
    bias: None or ``[num_local, N]``.
    cfg: the static options (``cfg.tiling`` overrides `default_tiling`). A gated activation
      takes 2N columns ``[gate | up]`` (rhs and bias) and gives N; ``tile_n`` then counts
      output columns.
    tiling: overrides ``cfg.tiling``.
    rows: with ``cfg.row_weights`` (m-grouping), ``row_weights`` ``[M]``: each result row
      is multiplied by its weight after the activation, in f32 before the cast.

  Returns:
    ``[M, N]`` (m-grouping) or ``[num_local, M, N]`` (k-grouping) of ``cfg.out_dtype``.

  Raises:
    NotImplementedError: a tile Mosaic cannot block (see `check_tiling`), blocks that do not
      fit in VMEM, or an activation with a primitive Mosaic cannot lower (compiled mode).
  """
  plain = [x for x in (lhs, rhs) if not isinstance(x, QArray)]
  if any(x.dtype == jnp.float16 for x in plain) or cfg.out_dtype == np.float16:
    # Mosaic has no f16 vector loads or stores on v5e/v6e (the deviceless compile fails to
    # legalize them): f16 runs as f32, which holds every f16 value exactly.
    widen = lambda x: (x.astype(jnp.float32)
                       if not isinstance(x, QArray) and x.dtype == jnp.float16 else x)
    out = gmm_tpu(widen(lhs), widen(rhs), counts, group_offset,
                  None if bias is None else widen(bias),
                  cfg.replace(out_dtype=jnp.float32 if cfg.out_dtype == jnp.float16
                              else cfg.out_dtype), tiling, rows)
    return out.astype(cfg.out_dtype)
  info = plan(lhs, rhs, counts, cfg, tiling)
  prepared = info["prepared"]
  if prepared.empty:
    return jnp.zeros(prepared.out_shape, cfg.out_dtype)
  lhs, rhs, quant, tiling = prepared.lhs, prepared.rhs, prepared.quant, info["tiling"]
  m, k, n = prepared.dims
  dot_dtype, acc_dtype, out_shape = prepared.dot_dtype, prepared.acc_dtype, prepared.out_shape
  tile_m, tile_k, tile_n = tiling.tile_m, tiling.tile_k, tiling.tile_n
  k_steps = info["k_steps"]
  has_bias = bias is not None
  gated = cfg.gated
  kernel_options = dict(dims=(m, k, n), tiling=tiling, cfg=cfg, dot_dtype=dot_dtype,
                        acc_dtype=acc_dtype, has_bias=has_bias, gated=gated)
  lhs_block = (tile_k, tile_m) if cfg.transpose_lhs else (tile_m, tile_k)
  rhs_block = (tile_n, tile_k) if cfg.transpose_rhs else (tile_k, tile_n)
  n_out = info["out_columns"]
  # A gated activation's up column blocks are `up` block indices after its gate blocks; rhs
  # and bias are passed twice, one BlockSpec for each half.
  up = n_out // tile_n if gated else 0
  halves = (0, up) if gated else (0,)
  biases = [] if bias is None else [bias.reshape(cfg.num_local, 1, n)] * len(halves)
  num_m_tiles, num_n_tiles = pl.cdiv(m, tile_m), pl.cdiv(n_out, tile_n)
  out_bytes = _nbytes(out_shape, cfg.out_dtype)
  lhs_bytes, rhs_bytes = _nbytes(lhs.shape, lhs.dtype), _nbytes(rhs.shape, rhs.dtype)
  flops = 2 * m * k * n

  if cfg.group_type == "m":
    walk = metadata.tile_walk(counts, m, tile_m, group_offset, cfg.num_local)
    scalars, count = tuple(walk[:3]), walk.num_steps
    at = functools.partial(_Step, m=m, tile_m=tile_m, num_local=cfg.num_local,
                           k_steps=k_steps)

    def lhs_map(n_i, i, k_i, *walk):
      step = at(walk, i)
      kb = step.k_block(k_i)
      return (kb, step.lhs_tile) if cfg.transpose_lhs else (step.lhs_tile, kb)

    def rhs_map(n_i, i, k_i, *walk, shift=0):
      step = at(walk, i)
      kb = step.k_block(k_i)
      return (step.group, n_i + shift, kb) if cfg.transpose_rhs else (
          step.group, kb, n_i + shift)

    def group_row_map(n_i, i, k_i, *walk, shift=0):
      return (at(walk, i).group, 0, n_i + shift)

    prologue = cfg.lhs_activation is not None
    in_specs = [pl.BlockSpec(lhs_block, lhs_map)]
    if prologue:  # the up half of z: K / tile_k blocks after the gate's
      k_blocks_half = k // tile_k
      in_specs.append(pl.BlockSpec(lhs_block, lambda n_i, i, k_i, *rest: (
          lhs_map(n_i, i, k_i, *rest)[0], lhs_map(n_i, i, k_i, *rest)[1] + k_blocks_half)))
    in_specs += [pl.BlockSpec((None, *rhs_block), functools.partial(rhs_map, shift=shift))
                 for shift in halves]
    if has_bias:
      in_specs += [pl.BlockSpec((None, 1, tile_n), functools.partial(group_row_map, shift=shift))
                   for shift in halves]
    quant_operands = []
    if quant is not None and quant.mode == "weight_only":
      per_group = quant.k_block < max(k, 1)

      def scale_map(n_i, i, k_i, *walk):
        step = at(walk, i)
        kb = step.k_block(k_i) if per_group else 0
        return (step.group, kb, n_i, 0) if cfg.transpose_rhs else (step.group, kb, 0, n_i)

      # [L, Kb, N] -> [L, Kb, 1, N] ([L, Kb, N, 1] to scale a tile stored [N, K]).
      axis, block = (3, (None, None, tile_n, 1)) if cfg.transpose_rhs else (
          2, (None, None, 1, tile_n))

      for array in (quant.rhs_scale, quant.rhs_zero):
        if array is not None:
          quant_operands.append(jnp.expand_dims(array, axis))
          in_specs.append(pl.BlockSpec(block, scale_map))
    elif quant is not None and quant.mode == "blocked":
      # Per K step, the windows of Kb holding its scale blocks: rhs scale rows
      # [rows, tile_n] of the item's group, lhs scale columns [tile_m, lanes] of its rows.
      blocks = info["blocks_per_step"]
      lhs_scale, rhs_scale, lanes, sublanes = _blocked_scales(quant, m, n, k, k_steps, blocks)

      def block_row_map(n_i, i, k_i, *walk):
        step = at(walk, i)
        return (step.group, step.k_block(k_i) * blocks // sublanes, n_i)

      def block_column_map(n_i, i, k_i, *walk):
        step = at(walk, i)
        return (step.lhs_tile, step.k_block(k_i) * blocks // lanes)

      quant_operands = [rhs_scale, lhs_scale]
      in_specs.append(pl.BlockSpec((None, sublanes, tile_n), block_row_map))
      in_specs.append(pl.BlockSpec((tile_m, lanes), block_column_map))
    elif quant is not None:  # scaled: [L, 1, N] column scales, [M, 1] row scales
      quant_operands = [quant.rhs_scale[:, :1, :], quant.lhs_scale]
      in_specs.append(pl.BlockSpec((None, 1, tile_n), group_row_map))
      in_specs.append(pl.BlockSpec((tile_m, 1), lambda n_i, i, k_i, *walk: (
          at(walk, i).lhs_tile, 0)))
    row_operands = []
    if cfg.row_weights:  # [M, 1] f32, a block per row tile (a zero item's is not read)
      row_operands = [rows.row_weights.astype(jnp.float32).reshape(m, 1)]
      in_specs.append(pl.BlockSpec((tile_m, 1), lambda n_i, i, k_i, *walk: (
          at(walk, i).lhs_tile, 0)))
    cotangent = cfg.cotangent_of is not None
    out_spec = pl.BlockSpec((tile_m, tile_n),
                            lambda n_i, i, k_i, *walk: (at(walk, i).out_tile, n_i))
    if cotangent:  # z [M, 2N]: the gate and up tiles of the output tile's rows and columns
      row_operands += [rows.source] * 2
      in_specs += [pl.BlockSpec((tile_m, tile_n), functools.partial(
          lambda n_i, i, k_i, *walk, shift: (at(walk, i).out_tile, n_i + shift),
          shift=shift)) for shift in (0, n // tile_n)]
      out_spec = pl.BlockSpec(memory_space=pl.ANY)
    scratch = [pltpu.VMEM((tile_m, tile_n), acc_dtype)] * len(halves) if k_steps > 1 else []
    if info["weight_cache"]:
      scratch += [pltpu.VMEM(rhs_block, dot_dtype), pltpu.SMEM((1,), jnp.int32)]
    if cotangent:
      scratch += [pltpu.VMEM((2, tile_m, tile_n), cfg.out_dtype),
                  pltpu.SemaphoreType.DMA((2,))]
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_n_tiles, count, k_steps),
        in_specs=in_specs,
        out_specs=out_spec,
        scratch_shapes=scratch,
    )
    # Balanced estimate: lhs once per column block, each weight once, the output once.
    hbm = lhs_bytes * num_n_tiles + rhs_bytes + out_bytes
    return common.pallas_call(
        functools.partial(_m_kernel, quant=common.quant_static(quant), k_steps=k_steps,
                          row_chunk=info["row_chunk"], weight_cache=info["weight_cache"],
                          weighted=cfg.row_weights, cotangent=cotangent, prologue=prologue,
                          **kernel_options),
        info["prepared"], tiles=(tile_m, tile_k, tile_n),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary"),
            vmem_limit_bytes=info["vmem_limit_bytes"]),
        interpret=cfg.interpret,
        name="gmm_m_tpu",
        **_cost_estimate(flops, _transcendentals(cfg, m * n_out), hbm),
    )(*scalars, *[lhs] * (2 if prologue else 1), *[rhs] * len(halves), *biases,
      *quant_operands, *row_operands)

  scalars, count = k_items(counts, max(k, 1) if k else 0, tile_k, group_offset, cfg.num_local)

  def k_lhs_map(m_i, n_i, i, groups, tiles, *_):
    return (tiles[i], m_i) if cfg.transpose_lhs else (m_i, tiles[i])

  def k_rhs_map(m_i, n_i, i, groups, tiles, *_, shift=0):
    return (n_i + shift, tiles[i]) if cfg.transpose_rhs else (tiles[i], n_i + shift)

  def k_bias_map(m_i, n_i, i, groups, *_, shift=0):
    return (groups[i], 0, n_i + shift)

  in_specs = [pl.BlockSpec(lhs_block, k_lhs_map)]
  in_specs += [pl.BlockSpec(rhs_block, functools.partial(k_rhs_map, shift=shift))
               for shift in halves]
  if has_bias:
    in_specs += [pl.BlockSpec((None, 1, tile_n), functools.partial(k_bias_map, shift=shift))
                 for shift in halves]
  # Blocked (the only quantized mode the k-grouped kernel serves): the item's K tile spans
  # the scale blocks of tile tiles[i].
  k_block = None if quant is None else quant.k_block
  quant_operands = []
  if quant is not None:
    blocks = info["blocks_per_step"]
    lhs_scale, rhs_scale, lanes, sublanes = _blocked_scales(
        quant, m, n, k, pl.cdiv(max(k, 1), tile_k), blocks)
    quant_operands = [lhs_scale, rhs_scale[0]]
    in_specs.append(pl.BlockSpec(
        (tile_m, lanes), lambda m_i, n_i, i, groups, tiles, *_: (m_i, tiles[i] * blocks // lanes)))
    in_specs.append(pl.BlockSpec(
        (sublanes, tile_n),
        lambda m_i, n_i, i, groups, tiles, *_: (tiles[i] * blocks // sublanes, n_i)))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars),
      grid=(num_m_tiles, num_n_tiles, count),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, tile_m, tile_n),
                             lambda m_i, n_i, i, groups, *_: (groups[i], m_i, n_i)),
      scratch_shapes=[pltpu.VMEM((tile_m, tile_n), acc_dtype)] * len(halves),
  )
  hbm = lhs_bytes * num_n_tiles + rhs_bytes * num_m_tiles + out_bytes
  return common.pallas_call(
      functools.partial(_k_kernel, k_block=k_block, **kernel_options), info["prepared"],
      tiles=(tile_m, tile_k, tile_n),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary"),
          vmem_limit_bytes=info["vmem_limit_bytes"]),
      interpret=cfg.interpret,
      name="gmm_k_tpu",
      **_cost_estimate(flops, _transcendentals(cfg, cfg.num_local * m * n_out), hbm),
  )(*scalars, lhs, *[rhs] * len(halves), *biases, *quant_operands)
