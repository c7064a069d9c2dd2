"""Tiling rules and the plan of a Mosaic TPU gmm call: which tiles, grid and VMEM limit.

The default tiles cover K and, where VMEM allows, N (or split N evenly), so the weights
``rhs[g]`` are fetched once per column block while consecutive items of one group keep the
block index (Pallas skips a DMA whose block index did not change). With one K step there is
no accumulator; with several, the K edge is masked on the last step only. The VMEM limit is
set from the block sizes (`vmem_limit`); tiles that do not fit raise NotImplementedError
rather than relying on Mosaic's default scoped limit.

Code size (Mosaic's compile time grows with the MXU code it unrolls): each step's product
is traced once (twice with a ragged K edge, whose last step masks it), a partial item's row
slices run in a loop, and a K block wider than `K_CHUNK` columns is multiplied
`K_CHUNK` columns at a time in a loop (`k_chunks`); the k-grouping kernel computes an output
tile taller than `OUT_ROW_CHUNK` rows in row chunks, in a loop (`out_row_chunk`). The
blocks, the grid and the DMAs stay the tiles'; `code_size` is one iteration's product.

`plan` checks what the kernels serve and returns a `TpuPlan`: the prepared operands, the
tiles fitted to the problem, the K steps and the VMEM estimate and limit.
`cost_models.tpu_static_cost` models on the host what a call does (rows through the MXU,
grid steps, bytes DMA'd from HBM given the grid order and the skipped DMAs); the VMEM model
and the work items live there too.
"""

from __future__ import annotations

import dataclasses
import math


from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, Tiling, out_columns
from gmm_jax._src.tiling import cost_models
from gmm_jax._src.tiling.cost_models import (LANE, fit_tile, modelled_seconds, mxu_rows,
                                             vmem_bytes, vmem_capacity, vmem_limit)
from gmm_jax.pallas import common
from gmm_jax.pallas.tpu.mosaic_tpu_fp8 import block_widths, blocked_dot_dtype, blocked_tile_k
from gmm_jax.pallas.tpu.mosaic_tpu_tile import (unsupported_cotangent_primitives,
                                                unsupported_primitives)
from gmm_jax.pallas.jax_pallas import pl

ALIGN = cost_models.TPU_ALIGN  # BlockSpec index maps address whole tiles
# The kernels' host-side model, which gmm_jax.tools.bench reads beside `default_tiling` (the
# model lives in `cost_models`).
static_cost = cost_models.tpu_static_cost


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


# -------------------------------------------------------------------------------- the plan


@dataclasses.dataclass(frozen=True)
class TpuPlan:
  """What `gmm_tpu` runs for its operands (`plan`).

  Attributes:
    prepared: the operands as the kernels take them (`common.Prepared`), with the output
      shape of the call (N output columns for a gated activation, 2N for a gated-cotangent
      epilogue) and the dot dtype of blocked fp8 values.
    tiling: the tiles fitted to the problem (``tile_n`` counts output columns).
    k_steps: the K blocks (m-grouping: K steps of the grid).
    weight_cache: the m-grouped kernel dequantizes the weight tile into a VMEM cache once
      per group and column block (weight-only quantization, one K step).
    vmem_bytes: the modelled VMEM footprint of the blocks.
    row_chunk: the rows of the MXU, by which a partial item's row slices go.
    out_columns: N of the output (the gate/up halves' width for a gated activation).
    blocks_per_step: blocked fp8: the scale blocks one K step spans (else 0).
    vmem_limit_bytes: the scoped VMEM limit of the call (None for an empty problem).
    grid: the grid, the items axis as its static bound (None for an empty problem).
  """

  prepared: common.Prepared
  tiling: Tiling
  k_steps: int
  weight_cache: bool
  vmem_bytes: int
  row_chunk: int
  out_columns: int
  blocks_per_step: int
  vmem_limit_bytes: int | None = None
  grid: tuple[int, int, int] | None = None


def _check_gated_operand(cfg: GmmConfig, refused: bool, serves: str, missing, what: str):
  """NotImplementedError for a gated prologue or cotangent epilogue the kernel does not
  serve (`refused`, or k-grouping), or (compiled mode) whose `missing()` primitives Mosaic
  cannot lower."""
  if refused or cfg.group_type != "m":
    raise NotImplementedError(f"the TPU kernel's {serves}")
  if not cfg.interpret:
    common.require_lowerable(missing(), what, "Mosaic TPU")


def _checked_features(prepared: common.Prepared, cfg: GmmConfig):
  """(prepared, n): refuses the row operations and the feature combinations the kernels do
  not serve; n is the output columns (a gated activation's half of the product's), and the
  output shape and dot dtype follow the features."""
  m, _, n = prepared.dims
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
        cfg, cfg.gated or (quant is not None and quant.mode != "blocked"),
        "gated-cotangent epilogue serves an m-grouped gmm of float operands or fp8 "
        "training's blocked operands, with no activation of its own",
        lambda: unsupported_cotangent_primitives(cfg.cotangent_of),
        f"the cotangent of {cfg.cotangent_of!r}")
    prepared = prepared._replace(out_shape=(m, 2 * n))
  if quant is not None and quant.mode == "blocked":
    prepared = prepared._replace(dot_dtype=blocked_dot_dtype(prepared.lhs.dtype,
                                                             prepared.rhs.dtype))
  return prepared, n


def _fitted_tiling(prepared: common.Prepared, cfg: GmmConfig, n: int) -> tuple[Tiling, int]:
  """(tiles, K steps): the tiles fitted to the problem (a blocked call's K step spanning
  whole scale blocks, `blocked_tile_k`)."""
  m, k, _ = prepared.dims
  quant = prepared.quant
  blocked = quant is not None and quant.mode == "blocked"
  k_blocks = max(k, 1)
  tiling = prepared.tiling
  if blocked:
    tiling = Tiling(tile_m=tiling.tile_m, tile_n=tiling.tile_n,
                    tile_k=blocked_tile_k(tiling, k, quant.k_block, cfg, prepared.automatic))
  tiling = Tiling(tile_m=fit_tile(tiling.tile_m, m) if m else 1,
                  tile_k=fit_tile(tiling.tile_k, k_blocks),
                  tile_n=fit_tile(tiling.tile_n, n) if n else 1)
  k_steps = pl.cdiv(k_blocks, tiling.tile_k)
  if blocked and k_steps > 1 and tiling.tile_k % quant.k_block:
    raise NotImplementedError(
        f"blocked scales need K steps of whole scale blocks: tile_k {tiling.tile_k} for "
        f"blocks of {quant.k_block}")
  return tiling, k_steps


def _vmem_needed(prepared: common.Prepared, cfg: GmmConfig, tiling: Tiling, k_steps: int,
                 weight_cache: bool, n: int, lhs) -> int:
  """The VMEM the call's blocks take (`vmem_bytes`, and the features' extra blocks);
  NotImplementedError where a gated prologue or cotangent epilogue would need partial
  blocks."""
  m, k, _ = prepared.dims
  quant = prepared.quant
  blocked = quant is not None and quant.mode == "blocked"
  needed = vmem_bytes(
      paired(tiling, cfg), cfg.group_type, lhs_itemsize=prepared.lhs.dtype.itemsize,
      rhs_itemsize=prepared.rhs.dtype.itemsize, out_itemsize=cfg.out_dtype.itemsize,
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
  return needed


def _grid(cfg: GmmConfig, tiling: Tiling, m: int, k: int, n: int,
          k_steps: int) -> tuple[int, int, int]:
  """The grid, the items axis as its static bound: m-grouping ``(N tiles, steps, K
  steps)``, k-grouping ``(M tiles, N tiles, items)``."""
  num_m, num_n = pl.cdiv(m, tiling.tile_m), pl.cdiv(n, tiling.tile_n)
  if cfg.group_type == "m":
    items = metadata.max_work_items(m, tiling.tile_m, cfg.num_local, ALIGN) + num_m
    return (num_n, items, k_steps)
  items = metadata.max_work_items(max(k, 1), tiling.tile_k, cfg.num_local, ALIGN, cover=True)
  return (num_m, num_n, items)


def plan(lhs, rhs, counts, cfg: GmmConfig, tiling: Tiling | None = None) -> TpuPlan:
  """What `gmm_tpu` would run for these operands (`TpuPlan`): the prepared operands, the
  tiles, the grid (the items axis as its static bound), the VMEM estimate and limit.

  Raises:
    NotImplementedError: as `gmm_tpu`.
  """
  prepared = common.preamble(lhs, rhs, counts, cfg, tiling, default_tiling=default_tiling,
                             check_tiling=check_tiling, unsupported=unsupported_primitives,
                             backend="Mosaic TPU", implementation="pallas_tpu", platform="tpu",
                             blocked_types=common.FP8_BLOCKED)
  prepared, n = _checked_features(prepared, cfg)
  m, k, _ = prepared.dims
  quant = prepared.quant
  tiling, k_steps = _fitted_tiling(prepared, cfg, n)
  weight_only = quant is not None and quant.mode == "weight_only"
  weight_cache = cfg.group_type == "m" and k_steps == 1 and weight_only
  needed = _vmem_needed(prepared, cfg, tiling, k_steps, weight_cache, n, lhs)
  blocks = (len(block_widths(tiling.tile_k, quant.k_block))
            if quant is not None and quant.mode == "blocked" else 0)
  found = TpuPlan(prepared=prepared, tiling=tiling, k_steps=k_steps,
                  weight_cache=weight_cache, vmem_bytes=needed, row_chunk=mxu_rows(),
                  out_columns=n, blocks_per_step=blocks)
  if prepared.empty:
    return found
  limit = vmem_limit(needed)
  return dataclasses.replace(found, vmem_limit_bytes=limit,
                             grid=_grid(cfg, tiling, m, k, n, k_steps))
