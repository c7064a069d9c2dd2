"""Pallas TPU (Mosaic) gmm kernels.

Both kernels run a grid over the work items of `metadata.make_tile_metadata(align="tile")`
(a tile of the grouped dimension x one local group it touches; at most ``num_tiles +
num_local - 1`` of them, so the cost does not grow with empty or remote groups). The item
arrays are scalar-prefetched into SMEM and drive the BlockSpec index maps; the grid has the
static bound as its length and the items past ``num_items`` repeat the last item's block
indices (so no new DMA) and skip their compute.

m-grouping, grid ``(N tiles, items, K tiles)``: the lhs row tile of the item and its
group's ``rhs[g]`` K x N tile are multiplied into an f32 VMEM accumulator (int32 for int8);
at the last K step the fused epilogue (bias, activation, cast) runs and the item's rows of
the output tile are stored with a row mask. Consecutive items of one row tile keep the
output block in VMEM, so a tile shared by several groups is assembled in place. Rows that
no item owns (past the group total, or of groups not held locally) are zeroed after the
call.

k-grouping, grid ``(M tiles, N tiles, items)``: the items of one group are consecutive; the
accumulator is reset at a group's first item, takes the item's K columns (the columns of
other groups in the tile are masked to zero in both operands) and is finalised into
``out[g]`` at the group's last item. The metadata is built with ``cover=True``, so an empty
group has one zero-column item and its output is ``activation(bias)``.

No dimension has to divide its tile: edge blocks are padded by Pallas, the K edge is masked
to zero in both operands (garbage x garbage could be NaN), and out-of-range rows/columns of
the output are never written back.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from gmm_jax._src import metadata
from gmm_jax._src.config import GmmConfig, Tiling
from gmm_jax._src.epilogue import apply_epilogue, resolve_activation
from gmm_jax.pallas import common

ALIGN = "tile"  # BlockSpec index maps address whole tiles
LANE = 128


def _fit(tile: int, dim: int) -> int:
  """A block extent for `dim`: the whole dim when the tile covers it, else the tile."""
  return dim if tile >= dim else tile


def default_tiling(m: int, k: int, n: int, cfg: GmmConfig, itemsize: int = 2) -> Tiling:
  """Tiles for the TPU kernels: multiples of 128 (or the whole dimension).

  m-grouping: 128-row tiles while the average group is under 256 rows (a tile shared by
  several groups is computed once per group), 256 otherwise (512 for M >= 8192 with 16-bit
  operands). K and N steps of 512 (256 for 32-bit operands), which keeps the double-buffered
  blocks plus the f32 accumulator at ~3 MB of VMEM. k-grouping: 512 K columns per item
  when groups average >= 512 columns, else 128 or 256, and 256 x 512 output tiles.
  """
  wide = 512 if itemsize <= 2 else 256
  groups = max(1, cfg.num_local)
  if cfg.group_type == "m":
    mean = m // groups
    tile_m = 128 if mean < 256 else (512 if m >= 8192 and itemsize <= 2 else 256)
    return Tiling(tile_m=tile_m, tile_k=wide, tile_n=wide)
  mean = k // groups
  tile_k = 128 if mean < 256 else (256 if mean < 512 else 512)
  return Tiling(tile_m=256, tile_k=tile_k, tile_n=wide)


def check_tiling(tiling: Tiling, m: int, k: int, n: int, cfg: GmmConfig) -> None:
  """Raises NotImplementedError for a tile Mosaic cannot block.

  Each tile must be a multiple of 128 or cover its whole dimension; with lhs stored
  untransposed, ``tile_m`` (a sublane dimension) may also be a multiple of 32.
  """
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


def unsupported_primitives(activation) -> set[str]:
  """Primitives of `activation` without a Mosaic TPU (TensorCore) lowering rule.

  Best effort: empty when the lowering table (a private jax module) cannot be read.
  """
  try:
    from jax._src.pallas.mosaic import lowering as mosaic_lowering
    rules = mosaic_lowering.lowering_rules
    if not isinstance(next(iter(rules)), jax.extend.core.Primitive):  # keyed by core type
      rules = next(table for core, table in rules.items() if str(core).lower() == "tc")
  except (ImportError, AttributeError, StopIteration):
    return set()
  return common.unsupported_primitives(resolve_activation(kernel_activation(activation)), rules)


def _padded_items(meta: metadata.TileMetadata):
  """The item arrays with the padding items repeating the last active item's indices."""
  item = jnp.arange(meta.item_start.shape[0], dtype=jnp.int32)
  source = jnp.where(item < meta.num_items, item, jnp.maximum(meta.num_items - 1, 0))
  return (meta.group_ids[source], meta.tile_ids[source], meta.item_start[source],
          meta.item_end[source], jnp.reshape(meta.num_items, (1,)).astype(jnp.int32))


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


def _m_kernel(group_ids_ref, tile_ids_ref, item_start_ref, item_end_ref, num_items_ref,
              lhs_ref, rhs_ref, *refs, dims, tiling: Tiling, cfg: GmmConfig, dot_dtype,
              acc_dtype, has_bias: bool, quant: common.QuantStatic | None = None):
  refs = list(refs)
  bias_ref = refs.pop(0) if has_bias else None
  scale_ref = refs.pop(0) if quant is not None else None
  zero_ref = refs.pop(0) if quant is not None and quant.has_zero else None
  lhs_scale_ref = refs.pop(0) if quant is not None and quant.mode == "scaled" else None
  out_ref, acc_ref = refs[-2], refs[-1]
  weight_only = quant is not None and quant.mode == "weight_only"
  _, k, _ = dims
  tile_m, tile_k = tiling.tile_m, tiling.tile_k
  item, k_step = pl.program_id(1), pl.program_id(2)
  last_k = pl.num_programs(2) - 1
  active = item < num_items_ref[0]

  @pl.when(k_step == 0)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

  @pl.when(active)
  def _():
    x, w = lhs_ref[...], rhs_ref[...]
    if weight_only:  # scale/zero blocks are [1, tile_n] ([tile_n, 1] for a transposed rhs)
      w = common.dequantize_tile(w, scale_ref[...], None if zero_ref is None else zero_ref[...],
                                 cfg.transpose_rhs, dot_dtype)
    if k % tile_k:  # the padded K edge of the last step reads garbage: zero it in both
      first = k_step * tile_k
      x = _mask_k(x, first, 0, k, 0 if cfg.transpose_lhs else 1)
      w = _mask_k(w, first, 0, k, 1 if cfg.transpose_rhs else 0)
    acc_ref[...] += _dot(x, w, cfg, dot_dtype, acc_dtype)

  @pl.when(active & (k_step == last_k))
  def _():
    bias = None if bias_ref is None else bias_ref[...]  # [1, tile_n]
    acc = acc_ref[...]
    if lhs_scale_ref is not None:  # int8 x int8: exact int32 sums, then both scales
      acc = acc.astype(jnp.float32) * lhs_scale_ref[...] * scale_ref[...]
    y = apply_epilogue(acc, bias, kernel_activation(cfg.activation), cfg.out_dtype)
    rows = tile_ids_ref[item] * tile_m + lax.broadcasted_iota(jnp.int32, y.shape, 0)
    mine = (rows >= item_start_ref[item]) & (rows < item_end_ref[item])
    out_ref[...] = jnp.where(mine, y, out_ref[...])


def _k_kernel(group_ids_ref, tile_ids_ref, item_start_ref, item_end_ref, num_items_ref,
              lhs_ref, rhs_ref, *refs, dims, tiling: Tiling, cfg: GmmConfig, dot_dtype,
              acc_dtype, has_bias: bool):
  bias_ref = refs[0] if has_bias else None
  out_ref, acc_ref = refs[-2], refs[-1]
  item = pl.program_id(2)
  num_items = num_items_ref[0]
  last_item = pl.num_programs(2) - 1
  group = group_ids_ref[item]
  active = item < num_items
  first_of_group = (item == 0) | (group_ids_ref[jnp.maximum(item - 1, 0)] != group)
  last_of_group = (item == num_items - 1) | (
      group_ids_ref[jnp.minimum(item + 1, last_item)] != group)
  start, end = item_start_ref[item], item_end_ref[item]

  @pl.when(active & first_of_group)
  def _():
    acc_ref[...] = jnp.zeros(acc_ref.shape, acc_ref.dtype)

  @pl.when(active & (end > start))
  def _():
    first = tile_ids_ref[item] * tiling.tile_k
    # Columns of other groups in this K tile, and the padded K edge, are zeroed in both.
    x = _mask_k(lhs_ref[...], first, start, end, 0 if cfg.transpose_lhs else 1)
    w = _mask_k(rhs_ref[...], first, start, end, 1 if cfg.transpose_rhs else 0)
    acc_ref[...] += _dot(x, w, cfg, dot_dtype, acc_dtype)

  @pl.when(active & last_of_group)
  def _():
    bias = None if bias_ref is None else bias_ref[...]  # [1, tile_n]
    out_ref[...] = apply_epilogue(acc_ref[...], bias, kernel_activation(cfg.activation),
                       cfg.out_dtype)


def gmm_tpu(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
            tiling: Tiling | None = None):
  """gmm on canonical operands (see `GmmConfig`) with the Pallas Mosaic TPU kernels.

  Args:
    lhs: ``[M, K]`` (``[K, M]`` if ``cfg.transpose_lhs``).
    rhs: m-grouping ``[num_local, K, N]``, k-grouping ``[K, N]`` (last two dims swapped if
      ``cfg.transpose_rhs``).
    counts: int32 ``[G]`` global group sizes.
    group_offset: int32 scalar, the first global group held locally.
    bias: None or ``[num_local, N]``.
    cfg: the static options (``cfg.tiling`` overrides `default_tiling`).
    tiling: overrides ``cfg.tiling``.

  Returns:
    ``[M, N]`` (m-grouping) or ``[num_local, M, N]`` (k-grouping) of ``cfg.out_dtype``.

  Raises:
    NotImplementedError: a tile Mosaic cannot block (see `check_tiling`), or an activation
      with a primitive Mosaic cannot lower (compiled mode only).
  """
  prepared = common.preamble(lhs, rhs, counts, cfg, tiling, default_tiling=default_tiling,
                             check_tiling=check_tiling, unsupported=unsupported_primitives,
                             backend="Mosaic TPU")
  if prepared.empty:
    return jnp.zeros(prepared.out_shape, cfg.out_dtype)
  lhs, rhs, quant, tiling = prepared.lhs, prepared.rhs, prepared.quant, prepared.tiling
  m, k, n = prepared.dims
  dot_dtype, acc_dtype, out_shape = prepared.dot_dtype, prepared.acc_dtype, prepared.out_shape
  k_blocks = max(k, 1)
  tile_m, tile_k, tile_n = _fit(tiling.tile_m, m), _fit(tiling.tile_k, k_blocks), _fit(
      tiling.tile_n, n)
  tiling = Tiling(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)
  has_bias = bias is not None
  kernel_options = dict(dims=(m, k, n), tiling=tiling, cfg=cfg, dot_dtype=dot_dtype,
                        acc_dtype=acc_dtype, has_bias=has_bias)
  lhs_block = (tile_k, tile_m) if cfg.transpose_lhs else (tile_m, tile_k)
  rhs_block = (tile_n, tile_k) if cfg.transpose_rhs else (tile_k, tile_n)
  scratch = [pltpu.VMEM((tile_m, tile_n), acc_dtype)]
  biases = [] if bias is None else [bias.reshape(cfg.num_local, 1, n)]
  num_m_tiles, num_n_tiles = pl.cdiv(m, tile_m), pl.cdiv(n, tile_n)

  if cfg.group_type == "m":
    meta = metadata.make_tile_metadata(counts, m, tile_m, group_offset, cfg.num_local, ALIGN)
    scalars = _padded_items(meta)

    def lhs_map(n_i, i, k_i, groups, tiles, *_):
      return (k_i, tiles[i]) if cfg.transpose_lhs else (tiles[i], k_i)

    def rhs_map(n_i, i, k_i, groups, *_):
      return (groups[i], n_i, k_i) if cfg.transpose_rhs else (groups[i], k_i, n_i)

    in_specs = [pl.BlockSpec(lhs_block, lhs_map),
                pl.BlockSpec((None, *rhs_block), rhs_map)]
    if has_bias:
      in_specs.append(pl.BlockSpec((None, 1, tile_n),
                                   lambda n_i, i, k_i, groups, *_: (groups[i], 0, n_i)))
    quant_operands = []
    if quant is not None and quant.mode == "weight_only":
      per_group = quant.k_block < max(k, 1)
      # [L, Kb, 1, N] (or [L, Kb, N, 1] for a transposed rhs): a [1, tile_n] ([tile_n, 1])
      # block of the K step's scale row.
      axis = 3 if cfg.transpose_rhs else 2

      def scale_map(n_i, i, k_i, groups, *_):
        kb = k_i if per_group else 0
        return (groups[i], kb, n_i, 0) if cfg.transpose_rhs else (groups[i], kb, 0, n_i)

      block = (None, None, tile_n, 1) if cfg.transpose_rhs else (None, None, 1, tile_n)
      for array in (quant.rhs_scale, quant.rhs_zero):
        if array is not None:
          quant_operands.append(jnp.expand_dims(array, axis))
          in_specs.append(pl.BlockSpec(block, scale_map))
    elif quant is not None:  # scaled: [L, 1, N] column scales, [M, 1] row scales
      quant_operands = [quant.rhs_scale[:, :1, :], quant.lhs_scale]
      in_specs.append(pl.BlockSpec((None, 1, tile_n),
                                   lambda n_i, i, k_i, groups, *_: (groups[i], 0, n_i)))
      in_specs.append(pl.BlockSpec((tile_m, 1),
                                   lambda n_i, i, k_i, groups, tiles, *_: (tiles[i], 0)))
    grid_spec = pltpu.PrefetchScalarGridSpec(
        num_scalar_prefetch=len(scalars),
        grid=(num_n_tiles, scalars[0].shape[0], pl.cdiv(k_blocks, tile_k)),
        in_specs=in_specs,
        out_specs=pl.BlockSpec((tile_m, tile_n),
                               lambda n_i, i, k_i, groups, tiles, *_: (tiles[i], n_i)),
        scratch_shapes=scratch,
    )
    out = pl.pallas_call(
        functools.partial(_m_kernel, quant=common.quant_static(quant), **kernel_options),
        grid_spec=grid_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype),
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "arbitrary", "arbitrary")),
        interpret=cfg.interpret,
        name="gmm_m_tpu",
    )(*scalars, lhs, rhs, *biases, *quant_operands)
    # Rows that no item owns were never written (or hold another tile's leftovers).
    owned = metadata.row_group_ids(counts, m, group_offset, cfg.num_local) >= 0
    return jnp.where(owned[:, None], out, jnp.zeros((), out.dtype))

  meta = metadata.make_tile_metadata(counts, k_blocks if k else 0, tile_k, group_offset,
                                    cfg.num_local, ALIGN, cover=True)
  scalars = _padded_items(meta)

  def k_lhs_map(m_i, n_i, i, groups, tiles, *_):
    return (tiles[i], m_i) if cfg.transpose_lhs else (m_i, tiles[i])

  def k_rhs_map(m_i, n_i, i, groups, tiles, *_):
    return (n_i, tiles[i]) if cfg.transpose_rhs else (tiles[i], n_i)

  in_specs = [pl.BlockSpec(lhs_block, k_lhs_map), pl.BlockSpec(rhs_block, k_rhs_map)]
  if has_bias:
    in_specs.append(pl.BlockSpec((None, 1, tile_n),
                                 lambda m_i, n_i, i, groups, *_: (groups[i], 0, n_i)))
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(scalars),
      grid=(num_m_tiles, num_n_tiles, scalars[0].shape[0]),
      in_specs=in_specs,
      out_specs=pl.BlockSpec((None, tile_m, tile_n),
                             lambda m_i, n_i, i, groups, *_: (groups[i], m_i, n_i)),
      scratch_shapes=scratch,
  )
  return pl.pallas_call(
      functools.partial(_k_kernel, **kernel_options),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=("parallel", "parallel", "arbitrary")),
      interpret=cfg.interpret,
      name="gmm_k_tpu",
  )(*scalars, lhs, rhs, *biases)
