"""Pallas GPU (Triton backend) gmm kernels.

m-grouping: one program per (work item, N tile). The work items come from
`metadata.make_tile_metadata(..., align="group")`: a window of at most ``tile_m`` rows that
starts at any row and belongs to one local group. A program loads its rows with a mask
(any offset, any M), loops over K in ``tile_k`` steps accumulating in f32 (int32 for int8
operands), applies the fused epilogue to the accumulator and stores only its own rows. The
output starts as an aliased zero buffer, so rows that no item owns (past the group total,
or in groups that are not local) stay exactly 0; the padding items past ``num_items`` do
nothing.

k-grouping: one program per (local group, M tile, N tile) loops over the group's K range
in ``tile_k`` steps; an empty group gives ``activation(bias)``.

Every block is a power of 2 (Triton needs it) of at least 16 (the smallest `tl.dot`); the
edges of M, K and N are masked, so no dimension has to divide a tile. Operands are whole
arrays in memory (no BlockSpecs): rows start at arbitrary offsets, which a Blocked index map
cannot express.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from gmm_jax._src import metadata
from gmm_jax._src.config import GmmConfig, Tiling
from gmm_jax._src.epilogue import apply_epilogue, resolve_activation
from gmm_jax.pallas import common
from gmm_jax.pallas.common import edge_mask, power_of_2_tile

ALIGN = "group"  # work items may start at any row: loads are masked, not Blocked
SMALLEST_TILE = 16  # tl.dot needs every dimension >= 16


def default_tiling(m: int, k: int, n: int, cfg: GmmConfig, itemsize: int = 2) -> Tiling:
  """Power-of-2 tiles for the Triton kernels.

  m-grouping sizes ``tile_m`` by the average group (a work item never spans two groups, so
  a tile much larger than a group is mostly masked); k-grouping sizes ``tile_k`` likewise.
  32-bit operands get half the K step so that the pipelined stages fit in shared memory.
  """
  largest_k = 64 if itemsize <= 2 else 32
  smallest_k = 32 if itemsize == 1 else SMALLEST_TILE  # 8-bit MMA steps K by 32
  groups = max(1, cfg.num_local)
  if cfg.group_type == "m":
    tile_m = power_of_2_tile(max(1, m // groups), SMALLEST_TILE, 128)
    tile_k = power_of_2_tile(k, smallest_k, largest_k)
  else:
    tile_m = power_of_2_tile(m, SMALLEST_TILE, 128)
    tile_k = power_of_2_tile(max(1, k // groups), smallest_k, largest_k)
  return Tiling(tile_m=tile_m, tile_k=tile_k, tile_n=power_of_2_tile(n, SMALLEST_TILE, 128))


def check_tiling(tiling: Tiling, m: int, k: int, n: int, cfg: GmmConfig) -> None:
  """Raises NotImplementedError for tiles Triton cannot use: each a power of 2 >= 16."""
  del m, k, n, cfg
  for name in ("tile_m", "tile_k", "tile_n"):
    value = getattr(tiling, name)
    if value < SMALLEST_TILE or value & (value - 1):
      raise NotImplementedError(
          f"the Triton kernels need power-of-2 tiles >= {SMALLEST_TILE}, got {name}={value}")


def compiler_params(tiling: Tiling, itemsize: int) -> plgpu.CompilerParams:
  num_warps = 8 if tiling.tile_m * tiling.tile_n >= 128 * 128 else 4
  return plgpu.CompilerParams(num_warps=num_warps, num_stages=3 if itemsize <= 2 else 2)


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


def unsupported_primitives(activation) -> set[str]:
  """Primitives of `activation` (on an f32 tile) without a Pallas Triton lowering rule.

  Best effort: empty when the lowering table (a private jax module) cannot be read.
  """
  try:
    from jax._src.pallas.triton import lowering as triton_lowering
    rules = triton_lowering.triton_lowering_rules
  except (ImportError, AttributeError):
    return set()
  return common.unsupported_primitives(
      resolve_activation(kernel_activation(activation)), rules)


# ----------------------------------------------------------------------------- tiles


class Span(NamedTuple):
  """``size`` consecutive indices from ``first``; ``ok`` masks those inside the array."""

  first: jax.Array
  size: int
  ok: jax.Array


def _span(first, size: int, limit) -> Span:
  return Span(first, size, edge_mask(first, size, limit))


def _load(ref, index: tuple, rows: Span, cols: Span, transposed: bool):
  """Loads the ``[rows, cols]`` tile of a matrix stored ``[cols, rows]`` if `transposed`.

  The tile comes back as stored (transposed or not): the dot contracts the right axis
  instead of materializing a transpose. Masked elements read as 0, so NaN/inf outside the
  array or outside the group never reaches the accumulator.
  """
  first, second = (cols, rows) if transposed else (rows, cols)
  view = ref.at[(*index, pl.ds(first.first, first.size), pl.ds(second.first, second.size))]
  mask = first.ok[:, None] & second.ok[None, :]
  return plgpu.load(view, mask=mask, other=jnp.zeros((), ref.dtype))


def _dot(x, w, cfg: GmmConfig, dot_dtype, acc_dtype):
  """``x @ w`` of tiles loaded by `_load` (x: [M, K] or [K, M]; w: [K, N] or [N, K])."""
  lhs_contract = 0 if cfg.transpose_lhs else 1
  rhs_contract = 1 if cfg.transpose_rhs else 0
  return lax.dot_general(
      x.astype(dot_dtype), w.astype(dot_dtype), (((lhs_contract,), (rhs_contract,)), ((), ())),
      precision=cfg.precision, preferred_element_type=acc_dtype)


def _epilogue_and_store(acc, bias_ref, group, out_ref, out_index: tuple, rows: Span,
                        cols: Span, cfg: GmmConfig):
  bias = None
  if bias_ref is not None:
    view = bias_ref.at[group, pl.ds(cols.first, cols.size)]
    bias = plgpu.load(view, mask=cols.ok, other=jnp.zeros((), bias_ref.dtype))[None, :]
  out = apply_epilogue(acc, bias, kernel_activation(cfg.activation), cfg.out_dtype)
  view = out_ref.at[(*out_index, pl.ds(rows.first, rows.size), pl.ds(cols.first, cols.size))]
  plgpu.store(view, out, mask=rows.ok[:, None] & cols.ok[None, :])


# ----------------------------------------------------------------------------- kernels


def _m_kernel(group_ids_ref, item_start_ref, item_end_ref, lhs_ref, rhs_ref, *refs,
              dims, tiling: Tiling, cfg: GmmConfig, dot_dtype, acc_dtype, has_bias: bool,
              quant: common.QuantStatic | None):
  refs = list(refs)
  bias_ref = refs.pop(0) if has_bias else None
  scale_ref = refs.pop(0) if quant is not None else None
  zero_ref = refs.pop(0) if quant is not None and quant.has_zero else None
  lhs_scale_ref = refs.pop(0) if quant is not None and quant.mode == "scaled" else None
  out_ref = refs[-1]  # refs[-2] is the aliased zero input
  _, k, n = dims
  item = pl.program_id(0)
  n_first = pl.program_id(1) * tiling.tile_n  # (program ids outside pl.when: interpret mode)
  start = item_start_ref[item]
  end = item_end_ref[item]

  @pl.when(end > start)  # padding items past num_items are empty
  def _():
    group = group_ids_ref[item]
    rows = _span(start, tiling.tile_m, end)  # an item never exceeds tile_m rows
    cols = _span(n_first, tiling.tile_n, n)

    def scale_row(ref, step_index):
      # The scale row of this K step's block, as [1, N] (or [N, 1] for a transposed tile).
      block = (step_index * tiling.tile_k) // quant.k_block
      row = plgpu.load(ref.at[group, block, pl.ds(cols.first, cols.size)], mask=cols.ok,
                       other=jnp.zeros((), ref.dtype))
      return row[:, None] if cfg.transpose_rhs else row[None, :]

    def step(step_index, acc):
      ks = _span(step_index * tiling.tile_k, tiling.tile_k, k)
      x = _load(lhs_ref, (), rows, ks, cfg.transpose_lhs)
      w = _load(rhs_ref, (group,), ks, cols, cfg.transpose_rhs)
      if quant is not None and quant.mode == "weight_only":
        w = common.dequantize_tile(w, scale_row(scale_ref, step_index),
                                   None if zero_ref is None else scale_row(zero_ref, step_index),
                                   cfg.transpose_rhs, dot_dtype)
      return acc + _dot(x, w, cfg, dot_dtype, acc_dtype)

    acc = lax.fori_loop(0, pl.cdiv(k, tiling.tile_k), step,
                        jnp.zeros((tiling.tile_m, tiling.tile_n), acc_dtype))
    if lhs_scale_ref is not None:  # int8 x int8: exact int32 sums, then both scales
      per_token = plgpu.load(lhs_scale_ref.at[pl.ds(rows.first, rows.size)], mask=rows.ok,
                             other=0.0)
      per_channel = plgpu.load(scale_ref.at[group, pl.ds(cols.first, cols.size)],
                               mask=cols.ok, other=0.0)
      acc = acc.astype(jnp.float32) * per_token[:, None] * per_channel[None, :]
    _epilogue_and_store(acc, bias_ref, group, out_ref, (), rows, cols, cfg)


def _k_kernel(group_start_ref, group_end_ref, lhs_ref, rhs_ref, *refs, dims, tiling: Tiling,
              cfg: GmmConfig, dot_dtype, acc_dtype):
  bias_ref, out_ref = (refs[0], refs[1]) if len(refs) == 2 else (None, refs[0])
  m, _, n = dims
  group = pl.program_id(0)
  start = group_start_ref[group]
  end = group_end_ref[group]
  rows = _span(pl.program_id(1) * tiling.tile_m, tiling.tile_m, m)
  cols = _span(pl.program_id(2) * tiling.tile_n, tiling.tile_n, n)

  def step(step_index, acc):
    ks = _span(start + step_index * tiling.tile_k, tiling.tile_k, end)
    x = _load(lhs_ref, (), rows, ks, cfg.transpose_lhs)
    w = _load(rhs_ref, (), ks, cols, cfg.transpose_rhs)
    return acc + _dot(x, w, cfg, dot_dtype, acc_dtype)

  num_steps = (end - start + tiling.tile_k - 1) // tiling.tile_k
  acc = lax.fori_loop(0, num_steps, step, jnp.zeros((tiling.tile_m, tiling.tile_n), acc_dtype))
  _epilogue_and_store(acc, bias_ref, group, out_ref, (group,), rows, cols, cfg)


# ----------------------------------------------------------------------------- entry point


def gmm_triton(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
               tiling: Tiling | None = None):
  """gmm on canonical operands (see `GmmConfig`) with the Pallas Triton kernels.

  Args:
    lhs: ``[M, K]`` (``[K, M]`` if ``cfg.transpose_lhs``).
    rhs: m-grouping ``[num_local, K, N]``, k-grouping ``[K, N]`` (last two dims swapped if
      ``cfg.transpose_rhs``).
    counts: int32 ``[G]`` global group sizes.
    group_offset: int32 scalar, the first global group held locally.
    bias: None or ``[num_local, N]``.
    cfg: the static options.
    tiling: power-of-2 tiles (each >= 16); default ``cfg.tiling``, else `default_tiling`.

  Returns:
    ``[M, N]`` (m-grouping) or ``[num_local, M, N]`` (k-grouping) of ``cfg.out_dtype``.

  Raises:
    NotImplementedError: an activation with a primitive Triton cannot lower (compiled mode
      only), or a tile that is not a power of 2 >= 16.
  """
  prepared = common.preamble(lhs, rhs, counts, cfg, tiling, default_tiling=default_tiling,
                             check_tiling=check_tiling, unsupported=unsupported_primitives,
                             backend="Pallas Triton")
  if prepared.dot_dtype.itemsize == 1 and prepared.tiling.tile_k < 32:
    raise NotImplementedError(
        f"8-bit Triton dots need tile_k >= 32, got {prepared.tiling.tile_k}")
  if prepared.empty:
    return jnp.zeros(prepared.out_shape, cfg.out_dtype)
  lhs, rhs, quant, tiling = prepared.lhs, prepared.rhs, prepared.quant, prepared.tiling
  m, k, n = prepared.dims
  dot_dtype, acc_dtype, out_shape = prepared.dot_dtype, prepared.acc_dtype, prepared.out_shape
  kernel_options = dict(dims=(m, k, n), tiling=tiling, cfg=cfg, dot_dtype=dot_dtype,
                        acc_dtype=acc_dtype)
  biases = [] if bias is None else [bias]
  quant_operands = []
  if quant is not None and quant.mode == "scaled":  # [L, N] and [M] scales
    quant_operands = [quant.rhs_scale[:, 0, :], quant.lhs_scale[:, 0]]
  elif quant is not None:
    quant_operands = [quant.rhs_scale] + ([] if quant.rhs_zero is None else [quant.rhs_zero])
  call_options = dict(
      out_shape=jax.ShapeDtypeStruct(out_shape, cfg.out_dtype),
      interpret=cfg.interpret,
      compiler_params=compiler_params(tiling, jnp.dtype(dot_dtype).itemsize),
  )
  if cfg.group_type == "m":
    meta = metadata.make_tile_metadata(counts, m, tiling.tile_m, group_offset, cfg.num_local,
                                        ALIGN)
    operands = [meta.group_ids, meta.item_start, meta.item_end, lhs, rhs, *biases,
                *quant_operands, jnp.zeros(out_shape, cfg.out_dtype)]
    return pl.pallas_call(
        functools.partial(_m_kernel, has_bias=bias is not None, quant=common.quant_static(quant),
                          **kernel_options),
        grid=(meta.item_start.shape[0], pl.cdiv(n, tiling.tile_n)),
        input_output_aliases={len(operands) - 1: 0},  # rows no item owns stay 0
        name="gmm_m_triton",
        **call_options,
    )(*operands)

  group_start, group_end = metadata.local_group_bounds(counts, k, group_offset, cfg.num_local)
  return pl.pallas_call(
      functools.partial(_k_kernel, **kernel_options),
      grid=(cfg.num_local, pl.cdiv(m, tiling.tile_m), pl.cdiv(n, tiling.tile_n)),
      name="gmm_k_triton",
      **call_options,
  )(group_start, group_end, lhs, rhs, *biases)
