"""The fast jax.numpy/XLA gmm: loops over the work items of the metadata module.

Floor 2 (a backend). Work is proportional to the rows actually grouped, not to G: each work
item (a window of at most a tile of rows inside one group, from
`metadata.make_tile_metadata(align="group")`) does one dot of its rows with its group's
weights. A partial item of L rows runs in the smallest window of `metadata.size_classes`
that holds it (8, 16, 32, 64, then steps of ~1.5x; one while loop per class, so no
`lax.cond`/`lax.switch`, which copies the output on XLA:CPU), so the waste per item is under
2x its own rows. Rows are written with a select, leaving exact zeros past the group total
and in groups that are not local.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gmm_jax._src import metadata
from gmm_jax._src.config import GmmConfig, Tiling, accumulator_dtype, problem_dims
from gmm_jax._src.epilogue import apply_epilogue


ALIGN = "group"


def default_tiling(m: int, k: int, n: int, num_groups: int) -> Tiling:
  """Tile sizes for the XLA path (measured on a 2-core AVX-512 CPU, see BENCHMARKS.md)."""
  del k, n, num_groups
  return Tiling(tile_m=512 if m >= 8192 else 256, tile_k=512, tile_n=512)


def _storage_dtype(dtype):
  # XLA:CPU converts a 16-bit float buffer to f32 in full on every masked update inside a
  # loop; carrying the bit pattern keeps the update in place.
  dtype = jnp.dtype(dtype)
  if jnp.issubdtype(dtype, jnp.floating) and dtype.itemsize == 2:
    return jnp.dtype(jnp.uint16)
  return dtype


def _to_storage(x, storage):
  return x if x.dtype == storage else lax.bitcast_convert_type(x, storage)


def _as_bits(x):
  """A 16-bit float operand as its bit pattern, and a function that views a slice back.

  XLA:CPU otherwise converts a bf16/f16 array that a while loop slices to f32 in full
  before the loop (a copy twice its size) and back on every slice, which also takes the
  dots off their fast bf16 path.
  """
  storage = _storage_dtype(x.dtype)
  if storage == x.dtype:
    return x, lambda piece: piece
  dtype = x.dtype
  return lax.bitcast_convert_type(x, storage), lambda piece: lax.bitcast_convert_type(piece, dtype)


def _for_each_item(meta, classes, body, carry):
  """Runs ``body(window, start, end, group, carry)`` for every active work item."""
  order, class_start, class_count = metadata.items_by_size_class(meta, classes)
  for index, window in enumerate(classes):

    def step(j, carry, index=index, window=window):
      item = order[class_start[index] + j]
      return body(window, meta.item_start[item], meta.item_end[item], meta.group_ids[item],
                  carry)

    carry = lax.fori_loop(0, class_count[index], step, carry)
  return carry


def head_capacity(m: int, num_local: int, tile_m: int, dtype) -> int:
  """Rows per group that one batched dot computes before the work-item loops (0: none).

  On XLA:CPU a 16-bit float dot inside a while loop costs ~1 ms per weight matrix whatever
  its rows (the weights are repacked on every call), ~2.5x what one batched dot over all
  groups pays per group. So for bf16/f16 with small groups (mean rows per group under half a
  tile), the first `capacity` rows of every local group (capacity = the window class of the
  mean group size) go through one ``einsum("gck,gkn->gcn")``, and only the rows past it of
  larger groups go through the loops.
  """
  if jnp.dtype(dtype).itemsize != 2 or not jnp.issubdtype(dtype, jnp.floating):
    return 0
  if num_local == 0 or m == 0:
    return 0
  mean = -(-m // num_local)
  classes = metadata.size_classes(tile_m, m)
  capacity = next((c for c in classes if c >= mean), classes[-1])
  return capacity if capacity * 2 <= tile_m else 0


def _gmm_m_heads(lhs, rhs, counts, group_offset, bias, cfg, capacity, acc_dtype):
  """The first `capacity` rows of every local group, by one batched dot; other rows 0."""
  m, k, n = problem_dims(lhs.shape, rhs.shape, cfg)
  num_total, num_local = counts.shape[0], cfg.num_local
  bounds = metadata.bounds_from_counts(counts, m)
  first, _ = metadata.local_group_range(group_offset, num_local, num_total)
  group = first + jnp.arange(num_local, dtype=jnp.int32)
  exists = group < num_total
  group = jnp.minimum(group, num_total - 1)
  starts = bounds[group]
  sizes = jnp.where(exists, bounds[group + 1] - starts, 0)
  position = jnp.arange(capacity, dtype=jnp.int32)
  rows = jnp.minimum(starts[:, None] + position[None, :], max(m - 1, 0))  # [L, C]
  taken = position[None, :] < sizes[:, None]
  # Gathering rows of an [M, K] array keeps the batched dot on XLA:CPU's bf16 path (a gather
  # along axis 1 of [K, M] gave an operand layout its bf16 dot thunk rejects).
  x = jnp.take(lhs.T if cfg.transpose_lhs else lhs, rows, axis=0)  # [L, C, K]
  x = jnp.where(taken[..., None], x, jnp.zeros((), x.dtype))
  spec = "lck,lnk->lcn" if cfg.transpose_rhs else "lck,lkn->lcn"
  acc = jnp.einsum(spec, x, rhs, precision=cfg.precision, preferred_element_type=acc_dtype)
  y = apply_epilogue(acc, None if bias is None else bias[:, None, :], cfg.activation,
                     cfg.out_dtype).reshape(num_local * capacity, n)
  local = metadata.row_group_ids(counts, m, group_offset, num_local)
  offset = jnp.arange(m, dtype=jnp.int32) - starts[jnp.maximum(local, 0)]
  in_head = (local >= 0) & (offset < capacity)
  source = jnp.where(in_head, local * capacity + offset, 0)
  return jnp.where(in_head[:, None], y[source], jnp.zeros((), y.dtype))


def gmm_xla(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, tiling: Tiling | None = None):
  """Fast XLA gmm on canonical operands (see `GmmConfig`)."""
  m, k, n = problem_dims(lhs.shape, rhs.shape, cfg)
  tiling = tiling or cfg.tiling or default_tiling(m, k, n, counts.shape[0])
  acc_dtype = accumulator_dtype(lhs.dtype, rhs.dtype)
  lhs_k_axis = 0 if cfg.transpose_lhs else 1
  rhs_k_axis = 1 if cfg.transpose_rhs else 0  # of one group's [K, N] / [N, K] matrix

  if cfg.num_local == 0 or counts.shape[0] == 0:  # no group: nothing is written
    shape = (m, n) if cfg.group_type == "m" else (cfg.num_local, m, n)
    return jnp.zeros(shape, cfg.out_dtype)
  if cfg.group_type == "m":
    storage = _storage_dtype(cfg.out_dtype)
    head = head_capacity(m, cfg.num_local, tiling.tile_m, lhs.dtype)
    meta = metadata.make_tile_metadata(counts, m, tiling.tile_m, group_offset, cfg.num_local,
                                      ALIGN, skip=head)

    def run_items(out):
      lhs_bits, lhs_view = _as_bits(lhs)
      rhs_bits, rhs_view = _as_bits(rhs)

      def body(window, start, end, group, out):
        first = jnp.minimum(start, m - window)
        x = lhs_view(lax.dynamic_slice_in_dim(lhs_bits, first, window, axis=1 - lhs_k_axis))
        w = rhs_view(lax.dynamic_index_in_dim(rhs_bits, group, 0, keepdims=False))
        acc = lax.dot_general(x, w, (((lhs_k_axis,), (rhs_k_axis,)), ((), ())),
                              precision=cfg.precision, preferred_element_type=acc_dtype)
        group_bias = None if bias is None else lax.dynamic_index_in_dim(bias, group, 0)
        y = _to_storage(apply_epilogue(acc, group_bias, cfg.activation, cfg.out_dtype), storage)
        rows = first + lax.iota(jnp.int32, window)
        keep = ((rows >= start) & (rows < end))[:, None]
        old = lax.dynamic_slice_in_dim(out, first, window, axis=0)
        return lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, old), first, axis=0)

      return _for_each_item(meta, metadata.size_classes(tiling.tile_m, m), body, out)

    if head:
      out = _to_storage(
          _gmm_m_heads(lhs, rhs, counts, group_offset, bias, cfg, head, acc_dtype), storage)
      # Only when some group is longer than the head do the loops (and the bit-pattern
      # copies of the operands they need) run; one cond outside the loops copies [M, N] once.
      out = lax.cond(meta.num_items > 0, run_items, lambda out: out, out)
    else:
      out = run_items(jnp.zeros((m, n), storage))
    return out if storage == cfg.out_dtype else lax.bitcast_convert_type(out, cfg.out_dtype)

  lhs, lhs_view = _as_bits(lhs)
  rhs, rhs_view = _as_bits(rhs)
  meta = metadata.make_tile_metadata(counts, k, tiling.tile_k, group_offset, cfg.num_local, ALIGN)
  rhs_row_axis = 1 if cfg.transpose_rhs else 0

  def body(window, start, end, group, acc):
    first = jnp.minimum(start, k - window)
    cols = first + lax.iota(jnp.int32, window)
    keep = (cols >= start) & (cols < end)
    x = lhs_view(lax.dynamic_slice_in_dim(lhs, first, window, axis=lhs_k_axis))
    r = rhs_view(lax.dynamic_slice_in_dim(rhs, first, window, axis=rhs_row_axis))
    # Columns outside the group are zeroed in both operands, so even inf/NaN there is inert.
    x = jnp.where(jnp.expand_dims(keep, 1 - lhs_k_axis), x, jnp.zeros((), x.dtype))
    r = jnp.where(jnp.expand_dims(keep, 1 - rhs_row_axis), r, jnp.zeros((), r.dtype))
    part = lax.dot_general(x, r, (((lhs_k_axis,), (rhs_row_axis,)), ((), ())),
                           precision=cfg.precision, preferred_element_type=acc_dtype)
    old = lax.dynamic_index_in_dim(acc, group, 0, keepdims=False)
    return lax.dynamic_update_index_in_dim(acc, old + part, group, 0)

  acc = jnp.zeros((cfg.num_local, m, n), acc_dtype)
  acc = _for_each_item(meta, metadata.size_classes(tiling.tile_k, k), body, acc)
  return apply_epilogue(acc, None if bias is None else bias[:, None, :], cfg.activation,
                        cfg.out_dtype)
