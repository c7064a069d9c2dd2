"""Pallas GPU (Triton backend) gmm, its op wrapper: `gmm_triton`, its checks and tile rules.

The kernel bodies are `triton_kernel`'s (m-grouping: one program per (work item, N tile);
k-grouping: one per (K window of a group, M tile, N tile)); fp8 x fp8 tiles multiply
through `triton_fp8`, and operands of 2**31 or more 1-byte elements reach the kernels as
16-bit words (`triton_large`).

k-grouping's split-K (a small grid and a long K): the windows are chunks of ``k_chunk``
rows computed in parallel, and the epilogue runs once afterwards on the f32 sum of their
partial sums. By default (``GmmConfig.deterministic``) each chunk stores its partial sum to
its own slot of a ``[chunks, L, M, N]`` buffer and the slots are added in a fixed order
(`sum_in_order`), so results are bitwise the same on every run; with
``deterministic=False`` the chunks add into one ``[L, M, N]`` buffer with atomic adds
(less memory, an order that changes from run to run: `ATOMICS`).

Every block is a power of 2 (Triton needs it) of at least 16 (the smallest `tl.dot`); the
edges of M, K and N are masked, so no dimension has to divide a tile. Operands are whole
arrays in memory (no BlockSpecs): rows start at arbitrary offsets, which a Blocked index map
cannot express.

Hopper's 8-bit wgmma reads both operands K-major from shared memory. Tiles stored K-major
(lhs ``[M, K]``, weights ``[G, N, K]`` with ``transpose_rhs=True``) reach shared memory as
stored (cp.async, pipelined); an N-major (or M-major) 8-bit tile, as fp8 training's forward
weights ``[G, K, N]`` and both operands of its k-grouped drhs, goes through registers into a
K-major shared layout (Triton: "Forcing a different order on SMEM"), which costs register
traffic and pipeline depth (`python -m gmm_jax.tools.aot`: 81,920 B of shared memory for the
forward against 131,072 B for the K-major dlhs; triton-lang/triton#7629). Store 8-bit
weights ``[G, N, K]`` (as `quantize` of a transposed weight) for the fast path.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.tiling import cost_models
from gmm_jax._src.core import epilogue, metadata
from gmm_jax._src.core.config import GmmConfig, Tiling, out_columns
from gmm_jax._src.tiling.cost_models import band_rows, default_k_chunk
from gmm_jax._src.core.epilogue import apply_epilogue
from gmm_jax._src.core.qarray import QArray, quant_mode
from gmm_jax.pallas import common
from gmm_jax.pallas.common import power_of_2_tile
from gmm_jax.pallas.gpu.triton_fp8 import FP8_MMA, FP8_MMA_K, fp8_pair
from gmm_jax.pallas.gpu.triton_kernel import (GATED_PAIRS, KernelStatic, _k_kernel, _m_kernel,
                                              kernel_activation, tile_columns)
from gmm_jax.pallas.gpu.triton_large import word_operands
from gmm_jax.pallas.jax_pallas import pl, triton as plgpu

# The row operations (`epilogue.Rows`), gated activations and the MoE backward's gated ends
# (a gated prologue's value, a gated-cotangent epilogue) the m-grouped kernel does
# in-kernel; the dispatcher materializes nothing around it for these.
FEATURES = ("gather", "row_weights", "scatter", "gated", "gated_lhs", "gated_cotangent")
# Split-K may add its partial sums with atomics, in an order that changes from run to run:
# only where a call allows it (``GmmConfig.deterministic=False``); the dispatcher reports it
# (`dispatch.Backend.atomics`, `gmm_jax.explain`).
ATOMICS = True
ALIGN = cost_models.TRITON_ALIGN  # work items may start at any row: loads are masked
SMALLEST_TILE = cost_models.SMALLEST_TILE  # tl.dot needs every dimension >= 16
SMEM_BYTES = cost_models.GPU_SMEM_BYTES  # sm_90's opt-in shared memory per block
# Re-exported for gmm_jax.tools.bench, which reads the model here (it lives in `cost_models`).
static_cost = cost_models.triton_static_cost
# The "scaled" dtype pairs these kernels multiply on the tensor cores.
SCALED_TYPES = common.INT8_SCALED + common.FP8_SCALED
# The "blocked" pairs (fp8 training's blockwise scales; both group types).
BLOCKED_TYPES = common.FP8_BLOCKED


def check_operands(lhs, rhs, cfg) -> None:
  """`common.check_quant` for these kernels: they also serve fp8 x fp8 "scaled" mode and
  fp8 "blocked" mode (scales varying along K, either group type)."""
  common.check_quant(lhs, rhs, cfg, scaled_types=SCALED_TYPES, blocked_types=BLOCKED_TYPES,
                     prologue=True)


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
  (the product's ``n`` is 2N) and `fit_registers` caps it for the two accumulators; a
  gated-cotangent epilogue sizes it by the product's columns (`tile_columns`).
  """
  n = tile_columns(n, cfg)
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


def fit_registers(tiling: Tiling, cfg: GmmConfig, step_product: bool = False) -> Tiling:
  """128 columns instead of 256 where the 128x256 accumulator spills registers on sm_90a:
  with a transposed lhs (its tile transposes through registers) or the exact GELU (the
  rational erf); `python -m gmm_jax.tools.aot` measured both spilling. A gated activation keeps
  two accumulators (gate and up columns): 128 columns each, a 128x256 footprint, which
  compiled without spills for swiglu, the exact-GELU geglu and a transposed lhs alike (the
  activation runs on the gate half only). `step_product`: each K step's product is held
  beside the accumulator (blocked scales multiply it before it is added; fp8 wgmma sums
  are promoted to the f32 accumulator every K tile, `fp8_dot`): 128 columns too (the
  fp8 x fp8 "scaled" forward spilled with 128x256). A gated prologue holds z's two tiles in
  f32 each K step: 128 columns too. A gated-cotangent epilogue holds z's two tiles and both
  cotangents beside the product: 64 columns from 128 rows (128x128 spilled 336 bytes on
  sm_90a, 128x64 and 64x128 compiled in 176-182 registers). Applied to the automatic
  choices (tile table, heuristic), not to a user's tiling."""
  heavy = tiling.tile_m >= 128 and (cfg.transpose_lhs or cfg.activation == "gelu")
  widest = 128 if (cfg.gated or heavy or step_product or cfg.lhs_activation is not None
                   or cfg.cotangent_of is not None) else tiling.tile_n
  if cfg.cotangent_of is not None and tiling.tile_m >= 128:
    widest = 64
  if tiling.tile_n > widest:
    return Tiling(tile_m=tiling.tile_m, tile_k=tiling.tile_k, tile_n=widest)
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
  """8 warps (two warpgroups) from 128x128 of `halves` ``tile_m x tile_n`` tiles held at
  once (2 for a gated activation's accumulators or a gated-cotangent epilogue's pair of
  cotangent tiles), else 4."""
  return 8 if tiling.tile_m * tiling.tile_n * halves >= 128 * 128 else 4


def num_stages(tiling: Tiling, itemsize: int, halves: int = 1, lhs_tiles: int = 1,
               lhs_itemsize: int | None = None) -> int:
  """Pipeline depth: as many stages (2..4) as shared memory holds.

  Triton keeps one buffer of each of the `lhs_tiles` lhs tiles (2 for a gated prologue:
  z's gate and up tiles, of `lhs_itemsize` bytes each element where they differ from the
  dot's `itemsize`) and the `halves` weight tiles per stage; the epilogue's layout
  conversion reuses them once the K loop is done.
  """
  lhs_bytes = itemsize if lhs_itemsize is None else lhs_itemsize
  per_stage = (lhs_tiles * tiling.tile_m * tiling.tile_k * lhs_bytes
               + halves * tiling.tile_k * tiling.tile_n * itemsize)
  return int(max(2, min(4, (SMEM_BYTES - 8192) // max(per_stage, 1))))


def compiler_params(tiling: Tiling, itemsize: int, cfg: GmmConfig,
                    lhs_itemsize: int | None = None) -> plgpu.CompilerParams:
  """Warps and stages for a launch of `cfg` (`num_warps`, `num_stages`); `lhs_itemsize`:
  the bytes of lhs's elements as stored where they differ from the dot's `itemsize` (a
  gated prologue's z, quantized in-kernel)."""
  halves = 2 if cfg.gated else 1
  held = 2 if cfg.gated or cfg.cotangent_of is not None else 1
  prologue = cfg.lhs_activation is not None
  return plgpu.CompilerParams(
      num_warps=num_warps(tiling, held),
      num_stages=num_stages(tiling, itemsize, halves, 2 if prologue else 1,
                            lhs_itemsize if prologue else None))


def unsupported_primitives(activation) -> set[str]:
  """Primitives of `activation` (on an f32 tile) without a Pallas Triton lowering rule
  (MissingJaxInternal, a NotImplementedError, where this jax has no readable table)."""
  return common.unsupported_activation_primitives(
      activation, "triton", kernel_activation=kernel_activation, pairs=GATED_PAIRS)


def _blocked_scales(quant: common.QuantOperands) -> tuple[jax.Array, jax.Array]:
  """(rhs scales ``[L, Kb, N]``, lhs scales ``[Kb, M]``) of "blocked" mode: the lhs scales
  of one K block are contiguous (each step loads a row of them); at least one block (K = 0
  reads none, and the kernels get no zero-sized operand)."""
  rhs_scale = quant.rhs_scale
  if quant.lhs_scale is None:  # act(z) quantized in-kernel: no lhs scales
    if rhs_scale.shape[1] == 0:
      rhs_scale = jnp.ones((rhs_scale.shape[0], 1, rhs_scale.shape[2]), jnp.float32)
    return rhs_scale, None
  lhs_scale = quant.lhs_scale.T
  if lhs_scale.shape[0] == 0:
    lhs_scale = jnp.ones((1, lhs_scale.shape[1]), jnp.float32)
    rhs_scale = jnp.ones((rhs_scale.shape[0], 1, rhs_scale.shape[2]), jnp.float32)
  return rhs_scale, lhs_scale


def sum_in_order(partials: jax.Array) -> jax.Array:
  """``partials[0] + partials[1] + ...``, left to right: elementwise adds in a fixed order,
  so the sum is bitwise the same on every run (a reduction may be split differently)."""
  if partials.shape[0] <= 64:  # one fusion reads each slot once
    total = partials[0]
    for chunk in range(1, partials.shape[0]):
      total = total + partials[chunk]
    return total
  return lax.fori_loop(1, partials.shape[0], lambda chunk, total: total + partials[chunk],
                       partials[0])


# ----------------------------------------------------------------------------- entry point

class _Launch(NamedTuple):
  """What `gmm_triton` prepared for the launch of either group type (`_launch`)."""

  prepared: common.Prepared
  lhs: jax.Array  # as the kernels read it (words where `triton_large.needs_words`)
  rhs: jax.Array
  quant: common.QuantOperands | None  # the per-token scales gathered with the rows
  tiling: Tiling
  out_shape: tuple[int, ...]
  lhs_elements: np.dtype | None  # the element dtype of an operand read as words
  rhs_elements: np.dtype | None
  params: plgpu.CompilerParams
  cost: pl.CostEstimate

  @property
  def blocked(self) -> bool:
    """Whether the operands are in "blocked" mode (scales varying along K)."""
    return self.quant is not None and self.quant.mode == "blocked"

  @property
  def tiles(self) -> tuple[int, int, int]:
    """(tile_m, tile_k, tile_n), as `common.pallas_call` records them."""
    return self.tiling.tile_m, self.tiling.tile_k, self.tiling.tile_n

  def static(self, has_bias: bool, num_items: int, band: int) -> KernelStatic:
    """The kernels' `KernelStatic` for a grid of `num_items` rows in bands of `band`."""
    return KernelStatic(dims=self.prepared.dims, tiling=self.tiling,
                        dot_dtype=self.prepared.dot_dtype, acc_dtype=self.prepared.acc_dtype,
                        has_bias=has_bias, num_items=num_items, band=band,
                        lhs_elements=self.lhs_elements, rhs_elements=self.rhs_elements)


def _preamble(lhs, rhs, counts, cfg: GmmConfig, tiling: Tiling | None, rows: epilogue.Rows):
  """(`common.preamble`'s `Prepared`, the ``[T, 1]`` per-token scales of gathered rows or
  None), after the row operands' and the 8-bit tiles' checks."""
  _check_rows(cfg, rows)
  _check_gated_ends(lhs, rhs, cfg)
  gather = rows.lhs_indices is not None
  if gather and quant_mode(lhs, rhs, cfg) == "blocked":
    raise NotImplementedError(
        "the Triton kernels gather rows (lhs_indices) with blocked scales: not supported "
        "(weight-only and scaled quantized operands are)")
  token_scale = None
  if gather and isinstance(lhs, QArray) and quant_mode(lhs, rhs, cfg) == "scaled":
    # The per-token scales follow the gathered rows: a placeholder scale through the
    # preamble (which sizes them by the R grouped rows), the [R] gathered scales after.
    token_scale = jnp.broadcast_to(lhs.scale.astype(jnp.float32), (lhs.shape[0], 1))
    lhs = QArray(lhs.qvalue, jnp.ones((1, 1), jnp.float32))
  prepared = common.preamble(lhs, rhs, counts, cfg, tiling, default_tiling=default_tiling,
                             check_tiling=check_tiling, unsupported=unsupported_primitives,
                             backend="Pallas Triton", implementation="pallas_triton",
                             platform="gpu", scaled_types=SCALED_TYPES,
                             blocked_types=BLOCKED_TYPES, prologue=True)
  if prepared.dot_dtype.itemsize == 1 and prepared.tiling.tile_k < 32:
    raise NotImplementedError(
        f"8-bit Triton dots need tile_k >= 32, got {prepared.tiling.tile_k}")
  return prepared, token_scale


def _out_shape(prepared: common.Prepared, cfg: GmmConfig) -> tuple[int, ...]:
  """``[M, N]`` (m-grouping; ``[out_rows, N]`` with scattered rows) or ``[num_local, M,
  N]`` (k-grouping), N halved by a gated activation."""
  m, _, n = prepared.dims
  if cfg.gated and n % 2:
    raise ValueError(f"a gated activation ({cfg.activation!r}) needs an even number of rhs "
                     f"columns [gate | up], got {n}")
  n_out = out_columns(n, cfg)
  if cfg.group_type == "m":
    return (m if cfg.out_rows is None else cfg.out_rows, n_out)
  return (cfg.num_local, m, n_out)


def _launch(prepared: common.Prepared, token_scale, rows: epilogue.Rows,
            out_shape: tuple[int, ...], cfg: GmmConfig) -> _Launch:
  """The operands, tiles, compiler parameters and cost of a non-empty launch."""
  # The bytes of an element of the dot's operands: 1 for two 8-bit floats multiplied as
  # they are (`fp8_dot`; e4m3 x e5m2 too), else the dot dtype's.
  quant = prepared.quant
  lhs_values = (prepared.lhs.dtype if quant is None or quant.prologue is None
                else quant.prologue[0])  # act(z) quantized in-kernel: its 8-bit values
  fp8_mma = (FP8_MMA and fp8_pair(lhs_values, prepared.rhs.dtype)
             and prepared.tiling.tile_k >= FP8_MMA_K)
  itemsize = 1 if fp8_mma else jnp.dtype(prepared.dot_dtype).itemsize
  m, k, n = prepared.dims
  lhs, rhs, quant, tiling = prepared.lhs, prepared.rhs, prepared.quant, prepared.tiling
  if token_scale is not None:
    quant = quant._replace(lhs_scale=epilogue.gather_rows(token_scale, rows.lhs_indices))
  blocked = quant is not None and quant.mode == "blocked"
  if prepared.automatic:
    tiling = fit_registers(tiling, cfg, blocked or fp8_mma)
  lhs, rhs, lhs_elements, rhs_elements = word_operands(lhs, rhs, out_shape, cfg.out_dtype,
                                                       cfg, tiling)
  params = compiler_params(tiling, itemsize, cfg, prepared.lhs.dtype.itemsize)
  out_bytes = math.prod(out_shape) * np.dtype(cfg.out_dtype).itemsize
  return _Launch(prepared, lhs, rhs, quant, tiling, out_shape, lhs_elements, rhs_elements,
                 params, _cost(m, k, n, lhs, rhs, out_bytes, cfg))



def _cost(m, k, n, lhs, rhs, out_bytes, cfg) -> pl.CostEstimate:
  return pl.CostEstimate(
      flops=int(2 * m * k * n),
      transcendentals=int(m * n) if cfg.activation is not None else 0,
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
                        ("out_indices", cfg.out_rows is not None),
                        ("source", cfg.has_source)):
    if (getattr(rows, name) is not None) != flagged:
      raise ValueError(
          f"rows.{name} is {'missing' if flagged else 'given'} but the config says "
          f"gather_rows={cfg.gather_rows}, row_weights={cfg.row_weights}, "
          f"out_rows={cfg.out_rows}, lhs_tangent={cfg.lhs_tangent}, "
          f"cotangent_of={cfg.cotangent_of}")
  if cfg.gather_rows is not None and cfg.transpose_lhs:
    raise NotImplementedError(
        "the Triton kernels gather rows (lhs_indices) of an lhs stored [T, K] "
        "(transpose_lhs=False) only; got transpose_lhs=True")


def _check_gated_ends(lhs, rhs, cfg: GmmConfig) -> None:
  """NotImplementedError for a gated prologue or gated-cotangent epilogue the m-grouped
  kernel does not serve (the dispatcher then forms it around the plain kernel): the
  prologue serves the value of a gmm of float operands of 2 or 4 bytes (its tangent is
  composed), the epilogue a float gmm with no gated activation of its own whose rows are
  not scattered; compiled, each needs Triton lowerings of its activation's primitives."""
  name = cfg.lhs_activation or cfg.cotangent_of
  if name is None:
    return
  mode = quant_mode(lhs, rhs, cfg)
  quantized_prologue = mode == "blocked" and cfg.quantize_prologue is not None
  if cfg.lhs_activation is not None and (cfg.lhs_tangent or np.dtype(lhs.dtype).itemsize == 1
                                         or (mode != "none" and not quantized_prologue)):
    raise NotImplementedError(
        "the Triton kernel's gated prologue serves the value of an m-grouped gmm of 2- or "
        "4-byte float operands, or of blockwise fp8 weights with act(z) quantized in-kernel "
        f"(fp8 training); got lhs_tangent={cfg.lhs_tangent}, lhs {lhs.dtype}, "
        f"quantization {mode!r} (the dispatcher forms its input)")
  if cfg.cotangent_of is not None and (cfg.gated or mode not in ("none", "blocked")
                                       or cfg.out_rows is not None):
    raise NotImplementedError(
        "the Triton kernel's gated-cotangent epilogue serves an m-grouped gmm of float "
        "operands or fp8 training's blocked operands, with no gated activation of its own "
        f"and unscattered rows; got activation={cfg.activation!r}, out_rows={cfg.out_rows}, "
        f"quantization {mode!r}")
  if not cfg.interpret:
    what = ("the prologue" if cfg.lhs_activation else "the cotangent of") + f" {name!r}"
    common.require_lowerable(common.unsupported_gated_primitives(
        GATED_PAIRS[name], "triton", cotangent=cfg.cotangent_of is not None),
        what, "Pallas Triton")


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
    cfg: the static options; with ``cfg.deterministic`` split-K partial sums are stored
      per chunk and summed in a fixed order, else added atomically.
    tiling: power-of-2 tiles (each >= 16); default ``cfg.tiling``, else `default_tiling`.
      ``tile_n`` counts output columns (a gated program reads twice as many).
    k_chunk: k-grouping only: K rows per split-K work item (a multiple of ``tile_k``), 0
      for no split; default `cost_models.default_k_chunk`.
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
      only), a tile that is not a power of 2 >= 16, row operands with k-grouping, gathered
      rows with a transposed lhs, or an operand of 2**31 or more 1-byte elements that the
      kernels cannot read as words (see `needs_words`).
    ValueError: a `k_chunk` that is not a positive multiple of ``tile_k``; row operands
      that do not match the config.
  """
  prepared, token_scale = _preamble(lhs, rhs, counts, cfg, tiling, rows)
  out_shape = _out_shape(prepared, cfg)
  if prepared.empty or math.prod(out_shape) == 0:
    return jnp.zeros(out_shape, cfg.out_dtype)
  launch = _launch(prepared, token_scale, rows, out_shape, cfg)
  if cfg.group_type == "m":
    return _gmm_m(launch, counts, group_offset, bias, cfg, rows)
  return _gmm_k(launch, counts, group_offset, bias, cfg, k_chunk)


def _gmm_m(launch: _Launch, counts, group_offset, bias, cfg: GmmConfig,
           rows: epilogue.Rows) -> jax.Array:
  """The m-grouped kernel's launch: one program per (work item, N tile)."""
  quant, tiling = launch.quant, launch.tiling
  m, k, _ = launch.prepared.dims
  gather, weighted, scatter = (operand is not None for operand in rows[:3])
  cotangent = cfg.cotangent_of is not None
  quant_operands = []
  if quant is not None and quant.mode == "scaled":  # [L, N] and [M] scales
    quant_operands = [quant.rhs_scale[:, 0, :], quant.lhs_scale[:, 0]]
  elif launch.blocked:  # [L, Kb, N] and [Kb, M] scales (none for act(z) quantized here)
    quant_operands = [scale for scale in _blocked_scales(quant) if scale is not None]
  elif quant is not None:
    quant_operands = [quant.rhs_scale] + ([] if quant.rhs_zero is None else [quant.rhs_zero])
  meta = metadata.make_tile_metadata(counts, m, tiling.tile_m, group_offset, cfg.num_local,
                                     ALIGN)
  num_items = meta.item_start.shape[0]
  # The bands hold lhs tiles as stored.
  band = band_rows(tiling.tile_m * k * launch.prepared.lhs.dtype.itemsize, num_items)
  row_operands = [rows.lhs_indices.astype(jnp.int32)] if gather else []
  row_operands += [rows.row_weights] if weighted else []
  row_operands += [rows.out_indices.astype(jnp.int32)] if scatter else []
  row_operands += [rows.source] if cotangent else []  # z [M, 2N]
  biases = [] if bias is None else [bias]
  operands = [meta.group_ids, meta.item_start, meta.item_end, launch.lhs, launch.rhs, *biases,
              *quant_operands, *row_operands, jnp.zeros(launch.out_shape, cfg.out_dtype)]
  return common.pallas_call(
      functools.partial(_m_kernel, static=launch.static(bias is not None, num_items, band),
                        cfg=cfg, quant=common.quant_static(quant), gather=gather,
                        weighted=weighted, scatter=scatter),
      launch.prepared, tiles=launch.tiles,
      out_shape=jax.ShapeDtypeStruct(launch.out_shape, cfg.out_dtype),
      grid=(num_items * pl.cdiv(tile_columns(launch.prepared.dims[2], cfg), tiling.tile_n),),
      input_output_aliases={len(operands) - 1: 0},  # rows no item owns stay 0
      interpret=cfg.interpret,
      compiler_params=launch.params,
      cost_estimate=launch.cost,
      name="gmm_m_triton",
  )(*operands)


def _k_operands(launch: _Launch, meta, split: str | None) -> list[jax.Array]:
  """The k-grouped kernel's operands before the bias (or the partial-sum buffer)."""
  operands = [meta.num_items.reshape(1), meta.group_ids, meta.item_start, meta.item_end,
              launch.lhs, launch.rhs]
  if launch.blocked:  # [Kb, M] and [Kb, N] scales
    rhs_scale, lhs_scale = _blocked_scales(launch.quant)
    operands += [lhs_scale, rhs_scale[0]]
  if split == "ordered":
    # A split item's chunk within its group (a group's items are consecutive): its slot of
    # the ordered partial-sum buffer.
    num_items = meta.item_start.shape[0]
    operands.append(jnp.arange(num_items, dtype=jnp.int32) - jnp.searchsorted(
        meta.group_ids, meta.group_ids, side="left").astype(jnp.int32))
  return operands


def _gmm_k(launch: _Launch, counts, group_offset, bias, cfg: GmmConfig,
           k_chunk: int | None) -> jax.Array:
  """The k-grouped kernel's launch: one program per (K window of a group, M tile, N tile),
  the windows whole groups or, split-K, chunks of `k_chunk` rows summed afterwards."""
  quant, tiling, prepared = launch.quant, launch.tiling, launch.prepared
  m, k, n = prepared.dims
  n_out = launch.out_shape[-1]
  if k_chunk is None:
    k_chunk = default_k_chunk(m, k, n_out, cfg, tiling) or 0
  if k_chunk < 0 or k_chunk % tiling.tile_k:
    raise ValueError(f"k_chunk must be 0 or a positive multiple of tile_k={tiling.tile_k}, "
                     f"got {k_chunk}")
  split = 0 < k_chunk < k
  meta = metadata.make_tile_metadata(counts, k, k_chunk if split else max(k, 1), group_offset,
                                     cfg.num_local, ALIGN, cover=not split)
  num_items = meta.item_start.shape[0]
  m_tiles = pl.cdiv(m, tiling.tile_m)
  window = k_chunk if split else max(1, k // max(1, cfg.num_local))
  band = band_rows(tiling.tile_m * window * prepared.lhs.dtype.itemsize, num_items * m_tiles)
  mode = None if not split else ("ordered" if cfg.deterministic else "atomic")
  if quant is not None and not launch.blocked:
    raise NotImplementedError(f"the k-grouped Triton kernel dequantizes blocked scales only, "
                              f"got {quant.mode}")
  kernel = functools.partial(_k_kernel, static=launch.static(bias is not None and not split,
                                                             num_items, band),
                             cfg=cfg, quant=common.quant_static(quant), split=mode)
  operands = _k_operands(launch, meta, mode)
  grid = (num_items * m_tiles * pl.cdiv(n_out, tiling.tile_n),)
  options = dict(tiles=launch.tiles, grid=grid, interpret=cfg.interpret,
                 compiler_params=launch.params, cost_estimate=launch.cost)
  if not split:
    return common.pallas_call(
        kernel, prepared, out_shape=jax.ShapeDtypeStruct(launch.out_shape, cfg.out_dtype),
        name="gmm_k_triton", **options,
    )(*operands, *([] if bias is None else [bias]))
  # Split-K: the epilogue needs the whole sum. f32 (int32) partial sums of the 2N product
  # columns of a gated activation, which the epilogue halves.
  partial_shape = (cfg.num_local, m, n)
  if mode == "ordered":
    partial_shape = (cost_models.split_chunks(k, k_chunk), *partial_shape)
  partials = common.pallas_call(
      kernel, prepared, out_shape=jax.ShapeDtypeStruct(partial_shape, prepared.acc_dtype),
      input_output_aliases={len(operands): 0},
      name="gmm_k_triton_split" if mode == "atomic" else "gmm_k_triton_chunks", **options,
  )(*operands, jnp.zeros(partial_shape, prepared.acc_dtype))
  total = sum_in_order(partials) if mode == "ordered" else partials
  return apply_epilogue(total, None if bias is None else bias[:, None, :], cfg.activation,
                        cfg.out_dtype)
