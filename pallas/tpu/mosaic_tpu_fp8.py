"""Blockwise fp8 in the Mosaic TPU gmm kernels: scale windows, K steps and the blocked dot.

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
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.tiling import cost_models
from gmm_jax._src.tiling.cost_models import LANE
from gmm_jax.pallas import common
from gmm_jax.pallas.tpu.mosaic_tpu_tile import dot, mask_k
from gmm_jax.pallas.jax_pallas import pl

_FP8_TYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))

# Scale blocks per K step (k_block = 128: tile_k = 512) when the kernel picks the tiles: fewer
# grid steps and larger DMAs than one block per step, the same 128-deep dots.
MAX_BLOCKS_PER_STEP = 4


def blocked_dot_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
  """The dot dtype of blocked fp8 values: the fp8 type itself on a chip with an fp8 MXU path
  when both sides share it; else bf16, which holds every e4m3 and e5m2 value exactly."""
  if cost_models.fp8_mxu() and np.dtype(lhs_dtype) == np.dtype(rhs_dtype):
    return np.dtype(lhs_dtype)
  return np.dtype(jnp.bfloat16)


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


def blocked_scales(quant: common.QuantOperands, m: int, n: int, k: int, steps: int,
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


def block_widths(tile_k: int, k_block: int) -> list[int]:
  """The widths of the scale blocks one K step of `tile_k` spans (the last may be short
  when the step covers a K that is not a multiple of `k_block`)."""
  return [min(k_block, tile_k - lo) for lo in range(0, tile_k, k_block)]


def dot_values(block, dot_dtype):
  """8-bit float values as the dot takes them: converted (exactly) to the dot dtype (bf16)
  before any mask or transpose where the chip has no fp8 MXU path; others as stored."""
  if np.dtype(block.dtype) in _FP8_TYPES and np.dtype(block.dtype) != dot_dtype:
    return block.astype(dot_dtype)
  return block


def blocked_product(lhs_ref, rhs_ref, lhs_scale_ref, rhs_scale_ref, rows, base,
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
  for j, width in enumerate(block_widths(lhs_ref.shape[0 if cfg.transpose_lhs else 1],
                                         k_block)):
    # Block base + j's lhs scale column (a masked lane sum) and rhs scale row.
    column = jnp.sum(jnp.where(lane == (base + j) % lhs_scales.shape[1], lhs_scales, 0.0),
                     axis=1, keepdims=True)
    row = rhs_scale_ref[pl.ds((base + j) % rhs_scale_ref.shape[0], 1), :]
    cols = slice(j * k_block, j * k_block + width)
    x = dot_values(lhs_ref[cols, rows] if cfg.transpose_lhs else lhs_ref[rows, cols],
                   dot_dtype)
    w = dot_values(rhs_ref[:, cols] if cfg.transpose_rhs else rhs_ref[cols, :], dot_dtype)
    if mask is not None:
      first, lo, hi = mask
      x = mask_k(x, first + j * k_block, lo, hi, 0 if cfg.transpose_lhs else 1)
      w = mask_k(w, first + j * k_block, lo, hi, 1 if cfg.transpose_rhs else 0)
    part = dot(x, w, cfg, dot_dtype, acc_dtype) * column * row
    total = part if total is None else total + part
  return total
