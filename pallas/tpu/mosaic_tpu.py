"""The Mosaic TPU gmm op: `gmm_tpu` plans a call and builds its pallas_call.

`gmm_tpu` takes canonical operands (`GmmConfig`), runs f16 as f32, asks `plan` for the tiles
and the VMEM limit, and builds the call of either grouping: the block specs and index maps
of its operands, the scratch, the grid (`mosaic_tpu_kernel` describes the kernels and their
grids) and one `common.pallas_call` for both.

Epilogue features (`FEATURES`; the dispatcher gathers and scatters rows around the kernels):
a gated activation (rhs columns ``[gate | up]``, both group types) passes rhs (and the
bias) twice, one BlockSpec for the gate column block ``n`` and one for the up block
``n + N/2 / tile_n``; ``tile_n`` counts output columns, a multiple of 128 dividing N/2; the
program keeps one accumulator per half and applies the activation to the pair in its
epilogue. Row weights (m-grouping) come as ``[tile_m, 1]`` f32 blocks of the item's row
tile and multiply the rows after the activation, in f32 before the cast
(`epilogue.finish`'s numerics). Quantized operands with a gated activation are refused
(the dispatcher then applies it after the plain kernel).
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.core.epilogue import NO_ROWS, Rows
from gmm_jax._src.core.qarray import QArray
from gmm_jax._src.tiling.cost_models import k_items
from gmm_jax.pallas import common
from gmm_jax.pallas.tpu.mosaic_tpu_fp8 import blocked_scales
from gmm_jax.pallas.tpu.mosaic_tpu_kernel import Step, k_kernel, m_kernel
from gmm_jax.pallas.tpu.mosaic_tpu_plan import TpuPlan, plan
from gmm_jax.pallas.jax_pallas import pl, tpu as pltpu

# What the kernels do in their epilogue beyond the plain gmm (`dispatch.Backend.features`):
# row weights (m-grouping) and gated activations (both group types). Gathered and scattered
# rows are done around them by the dispatcher (exact data movement).
FEATURES = ("row_weights", "gated", "gated_lhs", "gated_cotangent")


def check_operands(lhs, rhs, cfg: GmmConfig) -> None:
  """`common.check_quant` with the blocked fp8 mode (both group types) served in-kernel."""
  common.check_quant(lhs, rhs, cfg, blocked_types=common.FP8_BLOCKED)


# ---------------------------------------------------------------------------- the calls


class _Call(NamedTuple):
  """What the calls of both groupings share: the plan, the operands and their blocks."""

  plan: TpuPlan
  cfg: GmmConfig
  lhs: Any
  rhs: Any
  biases: list  # the bias [L, 1, N], once per rhs column block (gate and up when gated)
  lhs_block: tuple[int, int]
  rhs_block: tuple[int, int]
  halves: tuple[int, ...]  # block index shift of each rhs column block: (0,) or (0, up)
  kernel_options: dict


class _Launch(NamedTuple):
  """One grouping's pallas_call: kernel, grid, block specs and operands."""

  kernel: Any
  scalars: tuple
  grid: tuple
  in_specs: list
  out_spec: Any
  scratch: list
  operands: list
  semantics: tuple[str, str, str]
  name: str
  elements: int  # output elements the activation is applied to
  hbm: int  # bytes modelled to be read and written in HBM


def _nbytes(shape, dtype) -> int:
  return int(np.prod(shape)) * np.dtype(dtype).itemsize


def _transcendentals(cfg: GmmConfig, elements: int) -> int:
  return 0 if cfg.activation in (None, "relu") else int(elements)


def _cost_estimate(flops: int, transcendentals: int, bytes_accessed: int):
  if not hasattr(pl, "CostEstimate"):
    return {}
  return dict(cost_estimate=pl.CostEstimate(flops=int(flops), transcendentals=int(transcendentals),
                                            bytes_accessed=int(bytes_accessed)))


def _call_for(found: TpuPlan, bias, cfg: GmmConfig) -> _Call:
  """The blocks and the bias rows of the call of `found`."""
  prepared, tiling = found.prepared, found.tiling
  m, k, n = prepared.dims
  tile_m, tile_k, tile_n = tiling.tile_m, tiling.tile_k, tiling.tile_n
  # A gated activation's up column blocks are `up` block indices after its gate blocks; rhs
  # and bias are passed twice, one BlockSpec for each half.
  up = found.out_columns // tile_n if cfg.gated else 0
  halves = (0, up) if cfg.gated else (0,)
  biases = [] if bias is None else [bias.reshape(cfg.num_local, 1, n)] * len(halves)
  kernel_options = dict(dims=(m, k, n), tiling=tiling, cfg=cfg, dot_dtype=prepared.dot_dtype,
                        acc_dtype=prepared.acc_dtype, has_bias=bias is not None,
                        gated=cfg.gated)
  return _Call(plan=found, cfg=cfg, lhs=prepared.lhs, rhs=prepared.rhs, biases=biases,
               lhs_block=(tile_k, tile_m) if cfg.transpose_lhs else (tile_m, tile_k),
               rhs_block=(tile_n, tile_k) if cfg.transpose_rhs else (tile_k, tile_n),
               halves=halves, kernel_options=kernel_options)


def _pallas_call(call: _Call, launch: _Launch):
  """The call of either grouping (`common.pallas_call`, noting the launch)."""
  found, cfg = call.plan, call.cfg
  prepared, tiling = found.prepared, found.tiling
  m, k, n = prepared.dims
  grid_spec = pltpu.PrefetchScalarGridSpec(
      num_scalar_prefetch=len(launch.scalars),
      grid=launch.grid,
      in_specs=launch.in_specs,
      out_specs=launch.out_spec,
      scratch_shapes=launch.scratch,
  )
  return common.pallas_call(
      launch.kernel, prepared, tiles=(tiling.tile_m, tiling.tile_k, tiling.tile_n),
      grid_spec=grid_spec,
      out_shape=jax.ShapeDtypeStruct(prepared.out_shape, cfg.out_dtype),
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=launch.semantics,
          vmem_limit_bytes=found.vmem_limit_bytes),
      interpret=cfg.interpret,
      name=launch.name,
      **_cost_estimate(2 * m * k * n, _transcendentals(cfg, launch.elements), launch.hbm),
  )(*launch.scalars, *launch.operands)


# ------------------------------------------------------------------------- m-grouping


class _MMaps:
  """The index maps of the m-grouped call: grid ``(n_i, i, k_i)`` and the walk's scalars,
  each step's blocks as `Step` reads them."""

  def __init__(self, call: _Call):
    found, cfg = call.plan, call.cfg
    self.cfg = cfg
    self.at = functools.partial(Step, m=found.prepared.dims[0], tile_m=found.tiling.tile_m,
                                num_local=cfg.num_local, k_steps=found.k_steps)

  def lhs(self, n_i, i, k_i, *walk):
    step = self.at(walk, i)
    kb = step.k_block(k_i)
    return (kb, step.lhs_tile) if self.cfg.transpose_lhs else (step.lhs_tile, kb)

  def rhs(self, n_i, i, k_i, *walk, shift=0):
    step = self.at(walk, i)
    kb = step.k_block(k_i)
    return (step.group, n_i + shift, kb) if self.cfg.transpose_rhs else (
        step.group, kb, n_i + shift)

  def group_row(self, n_i, i, k_i, *walk, shift=0):
    return (self.at(walk, i).group, 0, n_i + shift)

  def row_tile(self, n_i, i, k_i, *walk):
    return (self.at(walk, i).lhs_tile, 0)

  def out_tile(self, n_i, i, k_i, *walk):
    return (self.at(walk, i).out_tile, n_i)

  def z_tile(self, n_i, i, k_i, *walk, shift):
    return (self.at(walk, i).out_tile, n_i + shift)


def _m_operand_specs(call: _Call, maps: _MMaps) -> list:
  """The specs of lhs (z's gate and up halves with a gated prologue), rhs and the bias."""
  tiling, k = call.plan.tiling, call.plan.prepared.dims[1]
  in_specs = [pl.BlockSpec(call.lhs_block, maps.lhs)]
  if call.cfg.lhs_activation is not None:  # the up half of z: K / tile_k blocks after the gate's
    k_blocks_half = k // tiling.tile_k
    in_specs.append(pl.BlockSpec(call.lhs_block, lambda n_i, i, k_i, *rest: (
        maps.lhs(n_i, i, k_i, *rest)[0], maps.lhs(n_i, i, k_i, *rest)[1] + k_blocks_half)))
  in_specs += [pl.BlockSpec((None, *call.rhs_block), functools.partial(maps.rhs, shift=shift))
               for shift in call.halves]
  if call.biases:
    in_specs += [pl.BlockSpec((None, 1, tiling.tile_n),
                              functools.partial(maps.group_row, shift=shift))
                 for shift in call.halves]
  return in_specs


def _m_quant_specs(call: _Call, maps: _MMaps) -> tuple[list, list]:
  """(operands, specs) of the scales (and zero points) of quantized operands."""
  found, cfg = call.plan, call.cfg
  quant, (m, k, n) = found.prepared.quant, found.prepared.dims
  tile_m, tile_n = found.tiling.tile_m, found.tiling.tile_n
  if quant is None:
    return [], []
  if quant.mode == "weight_only":
    per_group = quant.k_block < max(k, 1)

    def scale_map(n_i, i, k_i, *walk):
      step = maps.at(walk, i)
      kb = step.k_block(k_i) if per_group else 0
      return (step.group, kb, n_i, 0) if cfg.transpose_rhs else (step.group, kb, 0, n_i)

    # [L, Kb, N] -> [L, Kb, 1, N] ([L, Kb, N, 1] to scale a tile stored [N, K]).
    axis, block = (3, (None, None, tile_n, 1)) if cfg.transpose_rhs else (
        2, (None, None, 1, tile_n))
    arrays = [array for array in (quant.rhs_scale, quant.rhs_zero) if array is not None]
    return ([jnp.expand_dims(array, axis) for array in arrays],
            [pl.BlockSpec(block, scale_map) for _ in arrays])
  if quant.mode == "blocked":
    # Per K step, the windows of Kb holding its scale blocks: rhs scale rows
    # [rows, tile_n] of the item's group, lhs scale columns [tile_m, lanes] of its rows.
    blocks = found.blocks_per_step
    lhs_scale, rhs_scale, lanes, sublanes = blocked_scales(quant, m, n, k, found.k_steps,
                                                           blocks)

    def block_row_map(n_i, i, k_i, *walk):
      step = maps.at(walk, i)
      return (step.group, step.k_block(k_i) * blocks // sublanes, n_i)

    def block_column_map(n_i, i, k_i, *walk):
      step = maps.at(walk, i)
      return (step.lhs_tile, step.k_block(k_i) * blocks // lanes)

    return [rhs_scale, lhs_scale], [pl.BlockSpec((None, sublanes, tile_n), block_row_map),
                                    pl.BlockSpec((tile_m, lanes), block_column_map)]
  # scaled: [L, 1, N] column scales, [M, 1] row scales
  return [quant.rhs_scale[:, :1, :], quant.lhs_scale], [
      pl.BlockSpec((None, 1, tile_n), maps.group_row), pl.BlockSpec((tile_m, 1), maps.row_tile)]


def _m_row_specs(call: _Call, maps: _MMaps, rows: Rows) -> tuple[list, list, Any]:
  """(operands, specs, output spec) of the row weights and a gated-cotangent epilogue."""
  cfg, (m, _, n) = call.cfg, call.plan.prepared.dims
  tile_m, tile_n = call.plan.tiling.tile_m, call.plan.tiling.tile_n
  operands, in_specs = [], []
  if cfg.row_weights:  # [M, 1] f32, a block per row tile (a zero item's is not read)
    operands = [rows.row_weights.astype(jnp.float32).reshape(m, 1)]
    in_specs.append(pl.BlockSpec((tile_m, 1), maps.row_tile))
  out_spec = pl.BlockSpec((tile_m, tile_n), maps.out_tile)
  if cfg.cotangent_of is not None:  # z [M, 2N]: the gate and up tiles of the output tile
    operands += [rows.source] * 2
    in_specs += [pl.BlockSpec((tile_m, tile_n), functools.partial(maps.z_tile, shift=shift))
                 for shift in (0, n // tile_n)]
    out_spec = pl.BlockSpec(memory_space=pl.ANY)
  return operands, in_specs, out_spec


def _m_scratch(call: _Call) -> list:
  """The accumulators (several K steps), the weight cache and the cotangent pair."""
  found, cfg = call.plan, call.cfg
  tile_m, tile_n = found.tiling.tile_m, found.tiling.tile_n
  scratch = ([pltpu.VMEM((tile_m, tile_n), found.prepared.acc_dtype)] * len(call.halves)
             if found.k_steps > 1 else [])
  if found.weight_cache:
    scratch += [pltpu.VMEM(call.rhs_block, found.prepared.dot_dtype),
                pltpu.SMEM((1,), jnp.int32)]
  if cfg.cotangent_of is not None:
    scratch += [pltpu.VMEM((2, tile_m, tile_n), cfg.out_dtype),
                pltpu.SemaphoreType.DMA((2,))]
  return scratch


def _m_launch(call: _Call, counts, group_offset, rows: Rows) -> _Launch:
  """The m-grouped call: grid ``(N tiles, steps of the walk, K steps)``."""
  found, cfg = call.plan, call.cfg
  prepared, tiling = found.prepared, found.tiling
  m = prepared.dims[0]
  walk = metadata.tile_walk(counts, m, tiling.tile_m, group_offset, cfg.num_local)
  maps = _MMaps(call)
  in_specs = _m_operand_specs(call, maps)
  quant_operands, quant_specs = _m_quant_specs(call, maps)
  row_operands, row_specs, out_spec = _m_row_specs(call, maps, rows)
  prologue = cfg.lhs_activation is not None
  num_n_tiles = pl.cdiv(found.out_columns, tiling.tile_n)
  # Balanced estimate: lhs once per column block, each weight once, the output once.
  hbm = (_nbytes(call.lhs.shape, call.lhs.dtype) * num_n_tiles
         + _nbytes(call.rhs.shape, call.rhs.dtype) + _nbytes(prepared.out_shape, cfg.out_dtype))
  kernel = functools.partial(
      m_kernel, quant=common.quant_static(prepared.quant), k_steps=found.k_steps,
      row_chunk=found.row_chunk, weight_cache=found.weight_cache, weighted=cfg.row_weights,
      cotangent=cfg.cotangent_of is not None, prologue=prologue, **call.kernel_options)
  return _Launch(
      kernel=kernel, scalars=tuple(walk[:3]), grid=(num_n_tiles, walk.num_steps, found.k_steps),
      in_specs=in_specs + quant_specs + row_specs, out_spec=out_spec, scratch=_m_scratch(call),
      operands=[*[call.lhs] * (2 if prologue else 1), *[call.rhs] * len(call.halves),
                *call.biases, *quant_operands, *row_operands],
      semantics=("parallel", "arbitrary", "arbitrary"), name="gmm_m_tpu",
      elements=m * found.out_columns, hbm=hbm)


# ------------------------------------------------------------------------- k-grouping


def _k_launch(call: _Call, counts, group_offset) -> _Launch:
  """The k-grouped call: grid ``(M tiles, N tiles, items over K)``."""
  found, cfg = call.plan, call.cfg
  prepared, tiling = found.prepared, found.tiling
  quant, (m, k, n) = prepared.quant, prepared.dims
  tile_m, tile_k, tile_n = tiling.tile_m, tiling.tile_k, tiling.tile_n
  scalars, count = k_items(counts, max(k, 1) if k else 0, tile_k, group_offset, cfg.num_local)

  def k_lhs_map(m_i, n_i, i, groups, tiles, *_):
    return (tiles[i], m_i) if cfg.transpose_lhs else (m_i, tiles[i])

  def k_rhs_map(m_i, n_i, i, groups, tiles, *_, shift=0):
    return (n_i + shift, tiles[i]) if cfg.transpose_rhs else (tiles[i], n_i + shift)

  def k_bias_map(m_i, n_i, i, groups, *_, shift=0):
    return (groups[i], 0, n_i + shift)

  in_specs = [pl.BlockSpec(call.lhs_block, k_lhs_map)]
  in_specs += [pl.BlockSpec(call.rhs_block, functools.partial(k_rhs_map, shift=shift))
               for shift in call.halves]
  if call.biases:
    in_specs += [pl.BlockSpec((None, 1, tile_n), functools.partial(k_bias_map, shift=shift))
                 for shift in call.halves]
  # Blocked (the only quantized mode the k-grouped kernel serves): the item's K tile spans
  # the scale blocks of tile tiles[i].
  quant_operands = []
  if quant is not None:
    blocks = found.blocks_per_step
    lhs_scale, rhs_scale, lanes, sublanes = blocked_scales(
        quant, m, n, k, pl.cdiv(max(k, 1), tile_k), blocks)
    quant_operands = [lhs_scale, rhs_scale[0]]
    in_specs.append(pl.BlockSpec(
        (tile_m, lanes), lambda m_i, n_i, i, groups, tiles, *_: (m_i, tiles[i] * blocks // lanes)))
    in_specs.append(pl.BlockSpec(
        (sublanes, tile_n),
        lambda m_i, n_i, i, groups, tiles, *_: (tiles[i] * blocks // sublanes, n_i)))
  num_m_tiles, num_n_tiles = pl.cdiv(m, tile_m), pl.cdiv(found.out_columns, tile_n)
  hbm = (_nbytes(call.lhs.shape, call.lhs.dtype) * num_n_tiles
         + _nbytes(call.rhs.shape, call.rhs.dtype) * num_m_tiles
         + _nbytes(prepared.out_shape, cfg.out_dtype))
  return _Launch(
      kernel=functools.partial(k_kernel, k_block=None if quant is None else quant.k_block,
                               **call.kernel_options),
      scalars=scalars, grid=(num_m_tiles, num_n_tiles, count), in_specs=in_specs,
      out_spec=pl.BlockSpec((None, tile_m, tile_n),
                            lambda m_i, n_i, i, groups, *_: (groups[i], m_i, n_i)),
      scratch=[pltpu.VMEM((tile_m, tile_n), prepared.acc_dtype)] * len(call.halves),
      operands=[call.lhs, *[call.rhs] * len(call.halves), *call.biases, *quant_operands],
      semantics=("parallel", "parallel", "arbitrary"), name="gmm_k_tpu",
      elements=cfg.num_local * m * found.out_columns, hbm=hbm)


# --------------------------------------------------------------------------- entry point


def _gmm_f16_as_f32(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
                    tiling: Tiling | None, rows: Rows):
  """`gmm_tpu` of f16 operands or output in f32, which holds every f16 value exactly: Mosaic
  has no f16 vector loads or stores on v5e/v6e (the deviceless compile fails to legalize
  them)."""
  widen = lambda x: (x.astype(jnp.float32)  # noqa: E731
                     if not isinstance(x, QArray) and x.dtype == jnp.float16 else x)
  out = gmm_tpu(widen(lhs), widen(rhs), counts, group_offset,
                None if bias is None else widen(bias),
                cfg.replace(out_dtype=jnp.float32 if cfg.out_dtype == jnp.float16
                            else cfg.out_dtype), tiling, rows)
  return out.astype(cfg.out_dtype)


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
    return _gmm_f16_as_f32(lhs, rhs, counts, group_offset, bias, cfg, tiling, rows)
  found = plan(lhs, rhs, counts, cfg, tiling)
  if found.prepared.empty:
    return jnp.zeros(found.prepared.out_shape, cfg.out_dtype)
  call = _call_for(found, bias, cfg)
  if cfg.group_type == "m":
    return _pallas_call(call, _m_launch(call, counts, group_offset, rows))
  return _pallas_call(call, _k_launch(call, counts, group_offset))
