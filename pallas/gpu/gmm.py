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
the epilogue (an empty group gives ``activation(bias)``; a gated activation keeps the gate
and up accumulators as m-grouping does). With split-K (a small grid and a long K) the
windows are chunks of ``k_chunk`` rows computed in parallel, and the epilogue runs once
afterwards on the f32 sum of their partial sums. By default (``GmmConfig.deterministic``)
each chunk stores its partial sum to its own slot of a ``[chunks, L, M, N]`` buffer and
the slots are added in a fixed order, so results are bitwise the same on every run; with
``deterministic=False`` the chunks add into one ``[L, M, N]`` buffer with atomic adds
(less memory, an order that changes from run to run: `ATOMICS`).

Large operands: an operand of 2**31 or more 1-byte elements reaches the kernel as 16-bit
words and its tiles are unpacked in-kernel (see `needs_words`), because Pallas Triton
indexes such an operand with 32-bit offsets that would wrap.

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
(int32 / f32 accumulation, per-token x per-channel scales in the epilogue). Two 8-bit float
tiles multiply through `fp8_dot`, whose Triton lowering lets Triton pick Hopper's fp8 wgmma
(``wgmma ... .f32.e4m3.e4m3``, and ``.e4m3.e5m2`` / ``.e5m2.e4m3`` for the mixed pairs: Pallas's
own dot would upcast to f16 and refuse mixed types; see `fp8_dot`). Windows of at most 32
rows (the smallest row classes) run Triton's warp-level MMA on f16 values instead: wgmma
needs 64 rows. "blocked" mode (fp8 training's blockwise scales, `common.QuantOperands`;
both group types) takes K steps of one scale block each (``tile_k = k_block``) and adds each
step's product times the rows' and the columns' scales of that block, in f32; the
k-grouped kernel starts a group's steps at a multiple of ``tile_k`` (blocks are counted
from row 0) and masks the rows outside the group.

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
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from jax.interpreters import mlir

from gmm_jax._src.tiling import cost_models
from gmm_jax._src.core import epilogue, metadata
from gmm_jax._src.core.config import GmmConfig, Tiling, is_gated, out_columns
from gmm_jax._src.tiling.cost_models import band_rows, default_k_chunk, program_order, row_classes
from gmm_jax._src.core.epilogue import apply_epilogue, resolve_activation
from gmm_jax._src.core.qarray import QArray, quant_mode
from gmm_jax.pallas import common
from gmm_jax.pallas.common import edge_mask, power_of_2_tile

# The row operations (`epilogue.Rows`) and gated activations the m-grouped kernel does
# in-kernel; the dispatcher materializes nothing around it for these.
FEATURES = ("gather", "row_weights", "scatter", "gated")
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
  common.check_quant(lhs, rhs, cfg, scaled_types=SCALED_TYPES, blocked_types=BLOCKED_TYPES)


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


def fit_registers(tiling: Tiling, cfg: GmmConfig, step_product: bool = False) -> Tiling:
  """128 columns instead of 256 where the 128x256 accumulator spills registers on sm_90a:
  with a transposed lhs (its tile transposes through registers) or the exact GELU (the
  rational erf); `python -m gmm_jax.tools.aot` measured both spilling. A gated activation keeps
  two accumulators (gate and up columns): 128 columns each, a 128x256 footprint, which
  compiled without spills for swiglu, the exact-GELU geglu and a transposed lhs alike (the
  activation runs on the gate half only). `step_product`: each K step's product is held
  beside the accumulator (blocked scales multiply it before it is added; fp8 wgmma sums
  are promoted to the f32 accumulator every K tile, `fp8_dot`): 128 columns too (the
  fp8 x fp8 "scaled" forward spilled with 128x256). Applied to the automatic choices (tile
  table, heuristic), not to a user's tiling."""
  heavy = tiling.tile_m >= 128 and (cfg.transpose_lhs or cfg.activation == "gelu")
  if tiling.tile_n > 128 and (cfg.gated or heavy or step_product):
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


# ------------------------------------------------------------------- fp8 tensor-core dots

# Pallas Triton's dot_general (jax 0.10 to 0.12) emits Triton's dot without
# ``maxNumImpreciseAcc``, and Triton then refuses Hopper's fp8 wgmma for an f32 accumulator
# ("MMA version 3 acceleration not applied") and upcasts both tiles to f16 for
# ``mma.sync ... f16.f16`` (the f16 tensor-core rate); it also refuses two different 8-bit
# floats. `fp8_dot` is our own primitive whose Triton lowering passes
# ``maxNumImpreciseAcc`` = the tile's K: Triton then emits ``wgmma ... .f32.e4m3.e4m3`` (or
# ``.e4m3.e5m2``, ``.e5m2.e4m3``: wgmma takes the two 8-bit types independently) and
# promotes each K tile's tensor-core sum into an f32 register accumulator (the sums inside
# one tile keep the tensor core's fp8 accumulation precision; DeepSeek-V3's recipe
# promotes every 128 as well). In interpret mode (and anywhere else) it is an f32 dot of
# the exactly converted values.
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
FP8_MMA_K = 32  # the K of one fp8 wgmma; smaller K tiles multiply as the dot dtype


def _fp8_pair(lhs_dtype, rhs_dtype) -> bool:
  return np.dtype(lhs_dtype) in _FP8 and np.dtype(rhs_dtype) in _FP8


def _fp8_dot_reference(lhs, rhs, *, contract):
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dims,
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _fp8_dot_shape(lhs, rhs, *, contract):
  if not _fp8_pair(lhs.dtype, rhs.dtype) or lhs.ndim != 2 or rhs.ndim != 2:
    raise ValueError(f"fp8_dot takes two 2-D 8-bit float tiles, got {lhs} and {rhs}")
  if lhs.shape[contract[0]] != rhs.shape[contract[1]]:
    raise ValueError(f"fp8_dot: contracted sizes differ: {lhs.shape} and {rhs.shape}")
  return jax.core.ShapedArray((lhs.shape[1 - contract[0]], rhs.shape[1 - contract[1]]),
                              jnp.float32)


fp8_dot_p = jex.core.Primitive("gmm_fp8_dot")
fp8_dot_p.def_impl(_fp8_dot_reference)
fp8_dot_p.def_abstract_eval(_fp8_dot_shape)
mlir.register_lowering(fp8_dot_p, mlir.lower_fun(_fp8_dot_reference, multiple_results=False))


def fp8_dot(lhs, rhs, contract: tuple[int, int]) -> jax.Array:
  """f32 ``lhs @ rhs`` of two 8-bit float tiles (each its own type), contracting dimension
  ``contract[0]`` of lhs with ``contract[1]`` of rhs (0 or 1: a tile as stored, no
  transpose materialized)."""
  return fp8_dot_p.bind(lhs, rhs, contract=tuple(int(c) for c in contract))


def _fp8_dot_triton(triton_lowering, ctx, lhs, rhs, *, contract):
  del ctx
  tt, ir = triton_lowering.tt_dialect, triton_lowering.ir
  if contract[0] == 0:
    lhs = tt.trans(lhs, (1, 0))
  if contract[1] == 1:
    rhs = tt.trans(rhs, (1, 0))
  m, k = ir.RankedTensorType(lhs.type).shape
  n = ir.RankedTensorType(rhs.type).shape[1]
  acc = triton_lowering._zeros(ir.RankedTensorType.get([m, n], ir.F32Type.get()))
  # Triton's MMA v3 takes fp8 with an f32 accumulator from 32 (one fp8 wgmma's K) up.
  return tt.dot(lhs, rhs, acc, max_num_imprecise_acc=max(FP8_MMA_K, int(k)))


def _register_fp8_mma() -> bool:
  """Adds `fp8_dot`'s rule to Pallas Triton's lowering table (a private jax module, the
  same on jax 0.10 to 0.12); False where this jax has none (the kernels then multiply fp8
  tiles with Pallas's own dot: f16 MMA, exact)."""
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
    for name in ("triton_lowering_rules", "tt_dialect", "ir", "_zeros"):
      getattr(triton_lowering, name)
  except (ImportError, AttributeError):
    return False
  triton_lowering.triton_lowering_rules[fp8_dot_p] = functools.partial(_fp8_dot_triton,
                                                                      triton_lowering)
  return True


# Whether the compiled kernels multiply 8-bit floats with fp8 MMA (`fp8_dot`).
FP8_MMA = _register_fp8_mma()


# ---------------------------------------------------------------------- large operands

# Pallas Triton (jax 0.10 to 0.12) computes the element offsets of a load or store in 32
# bits unless the operand holds more than 2**32 bytes, and Triton adds them to the pointer
# as signed numbers: an operand of 2**31 or more 1-byte elements (and at most 2**32 bytes)
# would be read at wrapped, negative offsets. DeepSeek-V3's fp8 experts [256, 7168, 2048]
# hold 3.76e9. Such an operand reaches the kernel as uint16 words (a bitcast, no copy: two
# elements a word, so fewer than 2**31 words) and the kernel unpacks its tiles; every
# smaller operand keeps its own dtype and 32-bit offsets.
OFFSET_LIMIT = 2**31  # elements that signed 32-bit offsets address
_WORD = jnp.uint16


def needs_words(x) -> bool:
  """Whether operand `x` reaches the kernels as words: 1-byte elements, at least
  `OFFSET_LIMIT` of them, at most 2**32 bytes (past that jax indexes in 64 bits)."""
  return np.dtype(x.dtype).itemsize == 1 and OFFSET_LIMIT <= math.prod(x.shape) <= 2**32


def as_words(x: jax.Array) -> jax.Array:
  """``[..., C]`` of a 1-byte dtype (C even) -> ``[..., C / 2]`` uint16, little-endian: a
  word's low byte is the element with the lower index."""
  pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
  if pairs.dtype != jnp.uint8:
    pairs = lax.bitcast_convert_type(pairs, jnp.uint8)
  return lax.bitcast_convert_type(pairs, _WORD)


def _unpack(words: jax.Array, dtype) -> jax.Array:
  """The inverse of `as_words` on a tile: ``[r, w]`` uint16 -> ``[r, 2w]`` of `dtype`."""
  low = (words & 0xFF).astype(jnp.uint8)
  high = (words >> 8).astype(jnp.uint8)
  pairs = jnp.stack([low, high], axis=-1)  # Triton joins them
  return lax.bitcast_convert_type(pairs.reshape(words.shape[0], 2 * words.shape[1]), dtype)


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
    return _unpack(_load(ref, index, _halved(rows), cols, True), elements)
  return _unpack(_load(ref, index, rows, _halved(cols), False), elements)


def _dot(x, w, cfg: GmmConfig, dot_dtype, acc_dtype):
  """``x @ w`` of tiles loaded by `_load` (x: [M, K] or [K, M]; w: [K, N] or [N, K]).

  Two 8-bit float tiles (e4m3 and/or e5m2) with an f32 accumulator multiply as they are
  (`fp8_dot`: Hopper's fp8 wgmma) where this jax lets us lower it; else as `dot_dtype`.
  """
  lhs_contract = 0 if cfg.transpose_lhs else 1
  rhs_contract = 1 if cfg.transpose_rhs else 0
  if (FP8_MMA and _fp8_pair(x.dtype, w.dtype) and np.dtype(acc_dtype) == np.float32
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
  return tile if elements is None else _unpack(tile, elements)


def _scatter_store(out_ref, target, row_ok, cols: Span, value):
  """Row r of `value` into ``out_ref[target[r]]`` where `row_ok`; other rows write nothing
  (their target is past the output: interpret mode drops it, compiled mode masks it)."""
  shape = value.shape
  target = jnp.where(row_ok, target, out_ref.shape[0])
  row_ids = jnp.broadcast_to(target[:, None], shape)
  col_ids = jnp.broadcast_to((cols.first + lax.iota(jnp.int32, cols.size))[None, :], shape)
  mask = row_ok[:, None] if cols.ok is None else row_ok[:, None] & cols.ok[None, :]
  plgpu.store(out_ref.at[row_ids, col_ids], value, mask=jnp.broadcast_to(mask, shape))


def _halves(cols: Span, n_out: int, cfg: GmmConfig) -> tuple[Span, ...]:
  """The product's columns a program reads for output columns `cols`: the same span, or
  the gate and up spans of a gated activation (the up half starts N columns later)."""
  return (cols, _shifted(cols, n_out)) if cfg.gated else (cols,)


class _Static(NamedTuple):
  """What both kernels close over besides the config."""

  dims: tuple[int, int, int]
  tiling: Tiling
  dot_dtype: np.dtype
  acc_dtype: np.dtype
  has_bias: bool
  # The stored element dtype of an operand that reaches the kernel as words (`as_words`),
  # else None.
  lhs_elements: np.dtype | None = None
  rhs_elements: np.dtype | None = None


def _m_kernel(group_ids_ref, item_start_ref, item_end_ref, lhs_ref, rhs_ref, *refs,
              static: _Static, cfg: GmmConfig, quant: common.QuantStatic | None,
              num_items: int, band: int, gather: bool, weighted: bool, scatter: bool):
  refs = list(refs)
  bias_ref = refs.pop(0) if static.has_bias else None
  scale_ref = refs.pop(0) if quant is not None else None
  zero_ref = refs.pop(0) if quant is not None and quant.has_zero else None
  blocked = quant is not None and quant.mode == "blocked"
  # "scaled": [M] per-token scales; "blocked": [Kb, M], the rows' scales per K block.
  lhs_scale_ref = (refs.pop(0) if quant is not None and quant.mode in ("scaled", "blocked")
                   else None)
  lhs_indices_ref = refs.pop(0) if gather else None
  row_weights_ref = refs.pop(0) if weighted else None
  out_indices_ref = refs.pop(0) if scatter else None
  out_ref = refs[-1]  # refs[-2] is the aliased zero input
  tiling, dot_dtype, acc_dtype = static.tiling, static.dot_dtype, static.acc_dtype
  _, k, n = static.dims
  n_out = out_columns(n, cfg)
  item, col = program_order(pl.program_id(0), num_items, pl.cdiv(n_out, tiling.tile_n), band)
  start = item_start_ref[item]
  end = item_end_ref[item]
  length = end - start
  group = group_ids_ref[item]
  cols = _cols(col * tiling.tile_n, tiling.tile_n, n_out)
  halves = _halves(cols, n_out, cfg)

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
        x = _gather_load(lhs_ref, source, source_ok, ks, static.lhs_elements)
      else:
        x = _load_tile(lhs_ref, (), rows, ks, cfg.transpose_lhs, static.lhs_elements)
      new = []
      if blocked:  # this step's K block: the rows' scales
        block = first // quant.k_block
        row_scale = _load_vector(lhs_scale_ref, (block,), rows)[:, None]
      for acc, span in zip(accs, halves):
        w = _load_tile(rhs_ref, (group,), ks, span, cfg.transpose_rhs, static.rhs_elements)
        if quant is not None and quant.mode == "weight_only":
          zero = None if zero_ref is None else scale_row(zero_ref, step_index, span)
          w = common.dequantize_tile(w, scale_row(scale_ref, step_index, span), zero,
                                     cfg.transpose_rhs, dot_dtype)
        product = _dot(x, w, cfg, dot_dtype, acc_dtype)
        if blocked:  # the block's product times both block scales, in f32
          product = product * row_scale * _load_vector(scale_ref, (group, block), span)[None, :]
        new.append(acc + product)
      return tuple(new)

    accs = tuple(jnp.zeros((tile_rows, tiling.tile_n), acc_dtype) for _ in halves)
    accs = _k_loop(step, accs, k // tiling.tile_k, pl.cdiv(k, tiling.tile_k))
    if quant is not None and quant.mode == "scaled":  # exact 8-bit sums, then both scales
      per_token = _load_vector(lhs_scale_ref, (), rows)
      accs = tuple(acc.astype(jnp.float32) * per_token[:, None]
                   * _load_vector(scale_ref, (group,), span)[None, :]
                   for acc, span in zip(accs, halves))
    biases = [None] * len(halves)
    if bias_ref is not None:
      biases = [_load_vector(bias_ref, (group,), span)[None, :] for span in halves]
    weights = None if row_weights_ref is None else _load_vector(row_weights_ref, (), rows)
    out = finish_tile(accs, biases, cfg.activation, cfg.out_dtype, weights)
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
              *refs, static: _Static, cfg: GmmConfig, quant: common.QuantStatic | None,
              split: str | None, num_items: int, band: int):
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
  row, col = program_order(pl.program_id(0), num_items * m_tiles,
                           pl.cdiv(n_out, tiling.tile_n), band)
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
    if quant is None:
      size = end - start
      accs = _k_loop(lambda i, a, masked: step(i, a, False, masked), accs, size // tile_k,
                     (size + tile_k - 1) // tile_k)
    else:  # a masked first step, full steps, a masked last step
      size = jnp.where(end > start, end - base, 0)
      num_steps, num_full = (size + tile_k - 1) // tile_k, size // tile_k
      head = jnp.minimum(num_steps, 1)
      body = jnp.maximum(num_full, head)
      accs = lax.fori_loop(0, head, lambda i, a: step(i, a, True, True), accs)
      accs = lax.fori_loop(head, body, lambda i, a: step(i, a, False, False), accs)
      accs = lax.fori_loop(body, num_steps, lambda i, a: step(i, a, False, True), accs)
    if split is None:
      biases = [None] * len(halves)
      if bias_ref is not None:
        biases = [_load_vector(bias_ref, (group,), span)[None, :] for span in halves]
      _store(out_ref, (group,), rows, cols, finish_tile(accs, biases, cfg.activation,
                                                        cfg.out_dtype))
      return
    for acc, span in zip(accs, halves):
      index = (group, pl.ds(rows.first, rows.size), pl.ds(span.first, span.size))
      mask = _mask2(rows, span)
      if split == "ordered":
        plgpu.store(out_ref.at[(slots_ref[item], *index)], acc, mask=mask)
      elif mask is not None and cfg.interpret:
        # Interpret mode has no masked atomics; it runs one program at a time, so a
        # read-modify-write is the same sum.
        view = out_ref.at[index]
        current = plgpu.load(view, mask=mask, other=jnp.zeros((), out_ref.dtype))
        plgpu.store(view, current + acc, mask=mask)
      else:
        plgpu.atomic_add(out_ref, index, acc, mask=mask)


def _blocked_scales(quant: common.QuantOperands) -> tuple[jax.Array, jax.Array]:
  """(rhs scales ``[L, Kb, N]``, lhs scales ``[Kb, M]``) of "blocked" mode: the lhs scales
  of one K block are contiguous (each step loads a row of them); at least one block (K = 0
  reads none, and the kernels get no zero-sized operand)."""
  rhs_scale, lhs_scale = quant.rhs_scale, quant.lhs_scale.T
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


def _word_operands(lhs, rhs, out_shape, out_dtype, cfg: GmmConfig, tiling: Tiling):
  """(lhs, rhs, lhs elements, rhs elements): an operand that `needs_words` as words, its
  element dtype beside it (None for the others).

  Raises:
    NotImplementedError: such an operand the kernels cannot read as words (k-grouping, a
      transposed lhs, an odd minor dimension or tile start), or such an output.
  """
  if needs_words(jax.ShapeDtypeStruct(out_shape, out_dtype)):
    raise NotImplementedError(
        f"the Triton kernels address at most {OFFSET_LIMIT} elements of a 1-byte output; "
        f"got {out_shape} {np.dtype(out_dtype).name}")
  big_lhs, big_rhs = needs_words(lhs), needs_words(rhs)
  if not big_lhs and not big_rhs:
    return lhs, rhs, None, None
  n = rhs.shape[-2] if cfg.transpose_rhs else rhs.shape[-1]
  # The minor dimension's tiles start at multiples of tile_k (K) or tile_n (N; the up half
  # of a gated product N / 2 columns later), so they are word-aligned when these are even.
  aligned = (cfg.group_type == "m" and not (big_lhs and cfg.transpose_lhs)
             and n % (4 if cfg.gated else 2) == 0 and lhs.shape[-1] % 2 == 0
             and tiling.tile_k % 2 == 0 and tiling.tile_n % 2 == 0
             and jnp.dtype(rhs.dtype) != jnp.int4 and jnp.dtype(lhs.dtype) != jnp.int4)
  if not aligned:
    raise NotImplementedError(
        f"the Triton kernels read an operand of {OFFSET_LIMIT} or more 1-byte elements as "
        "16-bit words, for m-grouping with an even minor dimension (lhs not transposed); "
        f"got {cfg.group_type}-grouping, lhs {lhs.shape} {lhs.dtype}, rhs {rhs.shape} "
        f"{rhs.dtype}, transpose_lhs={cfg.transpose_lhs}")
  return (as_words(lhs) if big_lhs else lhs, as_words(rhs) if big_rhs else rhs,
          np.dtype(lhs.dtype) if big_lhs else None, np.dtype(rhs.dtype) if big_rhs else None)


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
  _check_rows(cfg, rows)
  gather, weighted, scatter = (operand is not None for operand in rows[:3])
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
                             blocked_types=BLOCKED_TYPES)
  if prepared.dot_dtype.itemsize == 1 and prepared.tiling.tile_k < 32:
    raise NotImplementedError(
        f"8-bit Triton dots need tile_k >= 32, got {prepared.tiling.tile_k}")
  # The bytes of an element of the dot's operands: 1 for two 8-bit floats multiplied as
  # they are (`fp8_dot`; e4m3 x e5m2 too), else the dot dtype's.
  fp8_mma = (FP8_MMA and _fp8_pair(prepared.lhs.dtype, prepared.rhs.dtype)
             and prepared.tiling.tile_k >= FP8_MMA_K)
  itemsize = 1 if fp8_mma else jnp.dtype(prepared.dot_dtype).itemsize
  m, k, n = prepared.dims
  if cfg.gated and n % 2:
    raise ValueError(f"a gated activation ({cfg.activation!r}) needs an even number of rhs "
                     f"columns [gate | up], got {n}")
  n_out = out_columns(n, cfg)
  out_shape = prepared.out_shape
  if cfg.group_type == "m":
    out_shape = (m if cfg.out_rows is None else cfg.out_rows, n_out)
  else:
    out_shape = (cfg.num_local, m, n_out)
  if prepared.empty or math.prod(out_shape) == 0:
    return jnp.zeros(out_shape, cfg.out_dtype)
  lhs, rhs, quant, tiling = prepared.lhs, prepared.rhs, prepared.quant, prepared.tiling
  if token_scale is not None:
    quant = quant._replace(lhs_scale=epilogue.gather_rows(token_scale, rows.lhs_indices))
  blocked = quant is not None and quant.mode == "blocked"
  if prepared.automatic:
    tiling = fit_registers(tiling, cfg, blocked or fp8_mma)
  lhs, rhs, lhs_elements, rhs_elements = _word_operands(lhs, rhs, out_shape, cfg.out_dtype,
                                                        cfg, tiling)
  lhs_itemsize = prepared.lhs.dtype.itemsize  # the bands hold lhs tiles as stored
  static = _Static(dims=(m, k, n), tiling=tiling, dot_dtype=prepared.dot_dtype,
                   acc_dtype=prepared.acc_dtype, has_bias=bias is not None,
                   lhs_elements=lhs_elements, rhs_elements=rhs_elements)
  biases = [] if bias is None else [bias]
  n_tiles = pl.cdiv(n_out, tiling.tile_n)
  params = compiler_params(tiling, itemsize, 2 if cfg.gated else 1)
  out_bytes = math.prod(out_shape) * np.dtype(cfg.out_dtype).itemsize
  tiles = (tiling.tile_m, tiling.tile_k, tiling.tile_n)
  cost = _cost(m, k, n, lhs, rhs, out_bytes, cfg)

  if cfg.group_type == "m":
    quant_operands = []
    if quant is not None and quant.mode == "scaled":  # [L, N] and [M] scales
      quant_operands = [quant.rhs_scale[:, 0, :], quant.lhs_scale[:, 0]]
    elif blocked:  # [L, Kb, N] and [Kb, M] scales
      quant_operands = list(_blocked_scales(quant))
    elif quant is not None:
      quant_operands = [quant.rhs_scale] + ([] if quant.rhs_zero is None else [quant.rhs_zero])
    meta = metadata.make_tile_metadata(counts, m, tiling.tile_m, group_offset, cfg.num_local,
                                       ALIGN)
    num_items = meta.item_start.shape[0]
    band = band_rows(tiling.tile_m * k * lhs_itemsize, num_items)
    row_operands = [rows.lhs_indices.astype(jnp.int32)] if gather else []
    row_operands += [rows.row_weights] if weighted else []
    row_operands += [rows.out_indices.astype(jnp.int32)] if scatter else []
    operands = [meta.group_ids, meta.item_start, meta.item_end, lhs, rhs, *biases,
                *quant_operands, *row_operands, jnp.zeros(out_shape, cfg.out_dtype)]
    return common.pallas_call(
        functools.partial(_m_kernel, static=static, cfg=cfg, quant=common.quant_static(quant),
                          num_items=num_items, band=band, gather=gather, weighted=weighted,
                          scatter=scatter),
        prepared, tiles=tiles,
        out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype),
        grid=(num_items * n_tiles,),
        input_output_aliases={len(operands) - 1: 0},  # rows no item owns stay 0
        interpret=cfg.interpret,
        compiler_params=params,
        cost_estimate=cost,
        name="gmm_m_triton",
    )(*operands)

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
  band = band_rows(tiling.tile_m * window * lhs_itemsize, num_items * m_tiles)
  mode = None if not split else ("ordered" if cfg.deterministic else "atomic")
  if quant is not None and not blocked:
    raise NotImplementedError(f"the k-grouped Triton kernel dequantizes blocked scales only, "
                              f"got {quant.mode}")
  kernel = functools.partial(_k_kernel, static=static._replace(has_bias=static.has_bias
                                                               and not split),
                             cfg=cfg, quant=common.quant_static(quant), split=mode,
                             num_items=num_items, band=band)
  operands = [meta.num_items.reshape(1), meta.group_ids, meta.item_start, meta.item_end,
              lhs, rhs]
  if blocked:  # [Kb, M] and [Kb, N] scales
    rhs_scale, lhs_scale = _blocked_scales(quant)
    operands += [lhs_scale, rhs_scale[0]]
  if mode == "ordered":
    # A split item's chunk within its group (a group's items are consecutive): its slot of
    # the ordered partial-sum buffer.
    operands.append(jnp.arange(num_items, dtype=jnp.int32) - jnp.searchsorted(
        meta.group_ids, meta.group_ids, side="left").astype(jnp.int32))
  grid = (num_items * m_tiles * n_tiles,)
  if not split:
    return common.pallas_call(
        kernel, prepared, tiles=tiles,
        out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype), grid=grid,
        interpret=cfg.interpret, compiler_params=params, cost_estimate=cost,
        name="gmm_k_triton",
    )(*operands, *biases)
  # Split-K: the epilogue needs the whole sum. f32 (int32) partial sums of the 2N product
  # columns of a gated activation, which the epilogue halves.
  partial_shape = (cfg.num_local, m, n)
  if mode == "ordered":
    partial_shape = (cost_models.split_chunks(k, k_chunk), *partial_shape)
  partials = common.pallas_call(
      kernel, prepared, tiles=tiles, out_shape=jax.ShapeDtypeStruct(partial_shape,
                                                                    prepared.acc_dtype),
      grid=grid, input_output_aliases={len(operands): 0}, interpret=cfg.interpret,
      compiler_params=params, cost_estimate=cost,
      name="gmm_k_triton_split" if mode == "atomic" else "gmm_k_triton_chunks",
  )(*operands, jnp.zeros(partial_shape, prepared.acc_dtype))
  total = sum_in_order(partials) if mode == "ordered" else partials
  return apply_epilogue(total, None if bias is None else bias[:, None, :], cfg.activation,
                        cfg.out_dtype)
