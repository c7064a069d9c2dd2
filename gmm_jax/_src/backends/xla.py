"""The fast jax.numpy/XLA gmm: loops over the work items of the metadata module.

Floor 2 (a backend). Work is proportional to the rows actually grouped, not to G: each work
item (a window of at most a tile of rows inside one group, from
`metadata.make_tile_metadata(align="group")`) does one dot of its rows with its group's
weights. A partial item of L rows runs in the smallest window of `metadata.size_classes`
that holds it (8, 16, 32, 64, then steps of ~1.5x; one while loop per class, so no
`lax.cond`/`lax.switch`, which copies the output on XLA:CPU), so the waste per item is under
2x its own rows. Rows are written with a select, leaving exact zeros past the group total
and in groups that are not local.

Two XLA:CPU behaviours decide how 16-bit float operands enter the loops, and they differ
between jax versions, so both are detected rather than assumed:
- Some XLA:CPU versions (jax 0.10) convert every bf16/f16 array that a while loop carries
  (the operands it slices) to f32 in full before the loop: a copy twice the weights' size
  and a convert back on every slice. There the operands are carried as their 16-bit
  pattern (`_as_bits`, itself one copy of them). Where XLA keeps them as they are (jax
  0.12) that copy of all G weight matrices is pure loss (~1.5x the whole gmm at G=64), so
  the operands go in untouched. `loop_upcasts_16bit` compiles a tiny loop once to tell.
- The batched "head" pass for small 16-bit groups (`head_capacity`) pays off only where a
  16-bit dot in a loop costs much more than its share of a batched dot (the AMX/oneDNN
  path of an AVX-512 Xeon, or the bit-pattern loops of jax 0.10); otherwise it costs a
  whole batched dot on top of the loops (2x the floor with skewed groups), so it is used
  only on a CPU with AMX or where the operands are carried as bit patterns.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
from jax import lax

from gmm_jax._src.core import metadata
from gmm_jax._src.tiling import tuning
from gmm_jax._src.core.config import (GmmConfig, Tiling, accumulator_dtype, out_columns,
                                  problem_dims)
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, apply_epilogue, gather_rows, scatter_targets

# The row operations it does inside its loops (no gathered copy of lhs, no scattered copy
# of the result).
FEATURES = ("gather", "row_weights", "scatter", "gated", "gather_k")


ALIGN = "group"


def default_tiling(m: int, k: int, n: int, num_groups: int) -> Tiling:
  """Tile sizes for the XLA path (measured on a 2-core AVX-512 CPU, see benchmarks/log.md)."""
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


@functools.lru_cache(maxsize=None)
def loop_upcasts_16bit() -> bool:
  """Whether this XLA:CPU converts bf16 arrays carried by a while loop to f32 in full.

  Compiles (once per process, on the CPU backend) a two-step loop that slices bf16
  operands and looks for an f32 copy of a whole operand. If the probe cannot run, assumes
  it does (carrying bit patterns is correct everywhere, only slower where not needed).
  """

  def probe(x, w):
    def body(i, acc):
      xs = lax.dynamic_index_in_dim(x, i, 0, keepdims=False)
      ws = lax.dynamic_index_in_dim(w, i, 0, keepdims=False)
      return acc + lax.dot(xs, ws, preferred_element_type=jnp.float32)

    return lax.fori_loop(0, x.shape[0], body, jnp.zeros((8, 16), jnp.float32))

  try:
    cpu = jax.devices("cpu")[0]
    args = (jax.ShapeDtypeStruct((3, 8, 16), jnp.bfloat16),
            jax.ShapeDtypeStruct((3, 16, 16), jnp.bfloat16))
    with jax.default_device(cpu):
      text = jax.jit(probe).lower(*args).compile().as_text()
  except Exception:  # noqa: BLE001 - no CPU backend or an unexpected API: the safe choice
    return True
  return "f32[3,8,16]" in text or "f32[3,16,16]" in text


@functools.lru_cache(maxsize=None)
def cpu_has_amx() -> bool:
  """Whether the host CPU reports AMX (Linux /proc/cpuinfo; False where unknown)."""
  try:
    with open("/proc/cpuinfo") as f:
      return re.search(r"^flags\s*:.*\bamx_bf16\b", f.read(), re.M) is not None
  except OSError:
    return False


def _as_bits(x, carry_bits: bool = True, tie=None):
  """A 16-bit float operand as the loops carry it, and a function that views a slice back.

  With `carry_bits` (an XLA:CPU that upcasts loop-carried 16-bit arrays, see
  `loop_upcasts_16bit`) the operand travels as its bit pattern: XLA would otherwise
  convert it to f32 in full before the loop (a copy twice its size) and back on every
  slice, which also takes the dots off their fast bf16 path. Without it the operand is
  used as it is (the bit-pattern view would itself copy it in full).
  """
  storage = _storage_dtype(x.dtype)
  if storage == x.dtype or not carry_bits:
    return x, lambda piece: piece
  dtype = x.dtype
  bits = lax.bitcast_convert_type(x, storage)
  if tie is not None and tie.size:
    # The copy belongs to this call: XLA would merge equal copies of one operand (the
    # forward gmm's and the backward's of the same weights) into one that lives from the
    # forward pass to the backward (measured: +537 MB at the peak of a bf16 MoE step). OR-ing
    # in a zero computed from the call's other operand makes the copies differ at no cost
    # (it fuses into the copy): ``p != p and p == p`` is false for every float p, NaN
    # included, which XLA does not simplify.
    probe = lax.index_in_dim(tie.reshape(-1), 0, keepdims=False)
    bits = bits | ((probe != probe) & (probe == probe)).astype(storage)
  return bits, lambda piece: lax.bitcast_convert_type(piece, dtype)


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
  larger groups go through the loops. Measured on an AMX Xeon; `gmm_xla` uses it on a CPU
  with AMX and where XLA upcasts loop-carried 16-bit arrays (jax 0.10), not otherwise: with
  jax 0.12 on an AVX2 CPU a bf16 dot in a loop costs what an f32 one does, and with skewed
  groups the head's batched dot over all groups came on top of the loops (1.7-2.6x the
  batched floor at G=64 instead of 1.2-1.3x without it).
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
                     cfg.out_dtype).reshape(num_local * capacity, out_columns(n, cfg))
  local = metadata.row_group_ids(counts, m, group_offset, num_local)
  offset = jnp.arange(m, dtype=jnp.int32) - starts[jnp.maximum(local, 0)]
  in_head = (local >= 0) & (offset < capacity)
  source = jnp.where(in_head, local * capacity + offset, 0)
  return jnp.where(in_head[:, None], y[source], jnp.zeros((), y.dtype))


def _unshared_zero(lhs, rhs, dtype):
  """A zero scalar that XLA cannot prove equal to another call's.

  XLA merges equal broadcasts: the zero accumulators of every k-grouped gmm of a program
  (the weight gradients of an MoE layer) became one temporary of the whole ``[L, M, N]``
  that was then copied into each loop (measured: +537 MB on an E=64, 1024x2048 layer), where
  a broadcast of its own is built in the loop's (the result's) buffer. This zero depends on
  the call's operands: ``-0.0`` if the sum of their first elements is NaN, else ``0.0``; both
  add as zero.
  """
  if not jnp.issubdtype(dtype, jnp.floating) or lhs.size == 0 or rhs.size == 0:
    return jnp.zeros((), dtype)
  probe = (lax.index_in_dim(lhs.reshape(-1), 0, keepdims=False).astype(jnp.float32)
           + lax.index_in_dim(rhs.reshape(-1), 0, keepdims=False).astype(jnp.float32))
  return jnp.where(probe != probe, jnp.array(-0.0, dtype), jnp.array(0.0, dtype))


def gmm_xla(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, tiling: Tiling | None = None,
            *, head: bool | None = None, carry_bits: bool | None = None, rows: Rows = NO_ROWS):
  """Fast XLA gmm on canonical operands (see `GmmConfig`).

  Row operands (`rows`, m-grouping): each work item gathers its rows of lhs by
  ``lhs_indices`` (``jnp.take`` of its window), weights them in the epilogue and scatters
  them to ``out_indices`` of the result, which the loop carries in place.

  `head` (the batched pass for small 16-bit groups, see `head_capacity`) and `carry_bits`
  (16-bit operands carried as bit patterns, see `_as_bits`) default to what suits this
  XLA:CPU and CPU (`cpu_has_amx`, `loop_upcasts_16bit`); tests force either way. Results
  are the same bits whichever is chosen.
  """
  m, k, n = problem_dims(lhs.shape, rhs.shape, cfg)
  sixteen = any(_storage_dtype(x.dtype) != x.dtype for x in (lhs, rhs))
  if carry_bits is None:
    carry_bits = sixteen and loop_upcasts_16bit()
  if head is None:
    # Where the loops need bit-pattern copies of the operands, a 16-bit loop dot also costs
    # more than its share of one batched dot (measured with jax 0.10.2 on AVX2: 1.0-1.1x
    # the batched floor at G=64 balanced with the head, 1.4x without).
    head = cpu_has_amx() or (sixteen and loop_upcasts_16bit())
  if tiling is None:
    problem = tuning.make_problem("xla", cfg.platform, lhs, rhs, counts, cfg, (m, k, n))
    tiling = tuning.choose(problem, cfg.tiling,
                           lambda: default_tiling(m, k, n, counts.shape[0]))
  acc_dtype = accumulator_dtype(lhs.dtype, rhs.dtype)
  n_out = out_columns(n, cfg)
  out_m = m if cfg.out_rows is None else cfg.out_rows
  if cfg.num_local == 0 or counts.shape[0] == 0:  # no group: nothing is written
    shape = (out_m, n_out) if cfg.group_type == "m" else (cfg.num_local, m, n_out)
    return jnp.zeros(shape, cfg.out_dtype)
  if cfg.group_type == "m":
    return _gmm_m(lhs, rhs, counts, group_offset, bias, cfg, tiling, head, carry_bits, rows,
                  acc_dtype)
  return _gmm_k(lhs, rhs, counts, group_offset, bias, cfg, tiling.tile_k, carry_bits, rows,
                acc_dtype)


def _gmm_m(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, tiling: Tiling, head: bool,
           carry_bits: bool, rows: Rows, acc_dtype):
  """m-grouping: the batched head pass (if `head`) for the first rows of each group, then
  one loop step per work item of the rest, each writing its rows of the result in place
  (or scattering them to ``rows.out_indices``)."""
  m, _, n = problem_dims(lhs.shape, rhs.shape, cfg)
  lhs_k_axis = 0 if cfg.transpose_lhs else 1
  rhs_k_axis = 1 if cfg.transpose_rhs else 0  # of one group's [K, N] / [N, K] matrix
  storage = _storage_dtype(cfg.out_dtype)
  # The batched head pass reads rows by position and writes them in place: not with row
  # operands.
  head = head_capacity(m, cfg.num_local, tiling.tile_m, lhs.dtype) if (
      head and not cfg.has_rows) else 0
  meta = metadata.make_tile_metadata(counts, m, tiling.tile_m, group_offset, cfg.num_local,
                                    ALIGN, skip=head)

  def run_items(out):
    lhs_bits, lhs_view = _as_bits(lhs, carry_bits, tie=rhs)
    rhs_bits, rhs_view = _as_bits(rhs, carry_bits, tie=lhs)

    def body(window, start, end, group, out):
      first = jnp.minimum(start, m - window)
      if cfg.gather_rows is not None:
        indices = lax.dynamic_slice_in_dim(rows.lhs_indices, first, window)
        x = lhs_view(gather_rows(lhs_bits, indices))
      else:
        x = lhs_view(lax.dynamic_slice_in_dim(lhs_bits, first, window, axis=1 - lhs_k_axis))
      w = rhs_view(lax.dynamic_index_in_dim(rhs_bits, group, 0, keepdims=False))
      acc = lax.dot_general(x, w, (((lhs_k_axis,), (rhs_k_axis,)), ((), ())),
                            precision=cfg.precision, preferred_element_type=acc_dtype)
      group_bias = None if bias is None else lax.dynamic_index_in_dim(bias, group, 0)
      weights = (lax.dynamic_slice_in_dim(rows.row_weights, first, window)
                 if cfg.row_weights else None)
      y = _to_storage(apply_epilogue(acc, group_bias, cfg.activation, cfg.out_dtype, weights),
                      storage)
      row_ids = first + lax.iota(jnp.int32, window)
      keep = (row_ids >= start) & (row_ids < end)
      if cfg.out_rows is not None:
        targets = scatter_targets(lax.dynamic_slice_in_dim(rows.out_indices, first, window),
                                  keep, cfg.out_rows)
        return out.at[targets].set(y, mode="drop", unique_indices=True)
      old = lax.dynamic_slice_in_dim(out, first, window, axis=0)
      return lax.dynamic_update_slice_in_dim(out, jnp.where(keep[:, None], y, old), first,
                                             axis=0)

    return _for_each_item(meta, metadata.size_classes(tiling.tile_m, m), body, out)

  if head:
    out = _to_storage(
        _gmm_m_heads(lhs, rhs, counts, group_offset, bias, cfg, head, acc_dtype), storage)
    # Only when some group is longer than the head do the loops (and the bit-pattern
    # copies of the operands they need) run; one cond outside the loops copies [M, N] once.
    out = lax.cond(meta.num_items > 0, run_items, lambda out: out, out)
  else:
    out_m = m if cfg.out_rows is None else cfg.out_rows
    out = run_items(jnp.zeros((out_m, out_columns(n, cfg)), storage))
  return out if storage == cfg.out_dtype else lax.bitcast_convert_type(out, cfg.out_dtype)


def _gmm_k(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, tile_k: int, carry_bits: bool,
           rows: Rows, acc_dtype):
  """k-grouping: one pass per local group, which sums its K rows into an ``[M, N]``
  accumulator of its own and writes the group's result once, in the output dtype.

  The group's last partial tile runs first, in the smallest window of
  `metadata.size_classes` that holds it (a `lax.switch` whose branches return only that
  window's product, which starts the accumulator); its full tiles of `tile_k` rows follow
  unmasked. So no ``[L, M, N]`` accumulator exists besides the result (bf16 weight
  gradients: no f32 copy of all of them) and nothing is read back and added per work item.
  """
  m, k, n = problem_dims(lhs.shape, rhs.shape, cfg)
  n_out = out_columns(n, cfg)
  lhs_k_axis = 0 if cfg.transpose_lhs else 1
  rhs_row_axis = 1 if cfg.transpose_rhs else 0
  lhs, lhs_view = _as_bits(lhs, carry_bits, tie=rhs)
  rhs, rhs_view = _as_bits(rhs, carry_bits, tie=lhs)
  if k == 0:  # every group is empty: the epilogue of zero sums
    acc = jnp.zeros((cfg.num_local, m, n), acc_dtype)
    return apply_epilogue(acc, None if bias is None else bias[:, None, :], cfg.activation,
                          cfg.out_dtype)
  starts, ends = metadata.local_group_bounds(counts, k, group_offset, cfg.num_local)
  classes = metadata.size_classes(tile_k, k)
  tile = classes[-1]  # the largest window: tile_k, or K if smaller
  # The result is written whole per group (no masked update), but an XLA:CPU that upcasts
  # loop-carried 16-bit arrays still converts the carried result in full on every write.
  storage = _storage_dtype(cfg.out_dtype) if loop_upcasts_16bit() else cfg.out_dtype

  def rows_of(first, window):
    if cfg.gather_rows is not None:  # lhs stored [T, M]: the window's K rows by index
      return lhs_view(gather_rows(lhs, lax.dynamic_slice_in_dim(rows.lhs_indices, first,
                                                                window)))
    return lhs_view(lax.dynamic_slice_in_dim(lhs, first, window, axis=lhs_k_axis))

  def product(x, r):
    return lax.dot_general(x, r, (((lhs_k_axis,), (rhs_row_axis,)), ((), ())),
                           precision=cfg.precision, preferred_element_type=acc_dtype)

  def partial_tile(window):
    def run(start, end):  # rows [start, end) of K, end - start <= window
      first = jnp.minimum(start, k - window)
      cols = first + lax.iota(jnp.int32, window)
      keep = (cols >= start) & (cols < end)
      x = rows_of(first, window)
      r = rhs_view(lax.dynamic_slice_in_dim(rhs, first, window, axis=rhs_row_axis))
      # Rows outside the group are zeroed in both operands, so even inf/NaN there is inert.
      x = jnp.where(jnp.expand_dims(keep, 1 - lhs_k_axis), x, jnp.zeros((), x.dtype))
      r = jnp.where(jnp.expand_dims(keep, 1 - rhs_row_axis), r, jnp.zeros((), r.dtype))
      return product(x, r)
    return run

  def nothing(start, end):
    del start, end
    return jnp.zeros((m, n), acc_dtype)

  branches = [nothing] + [partial_tile(window) for window in classes]
  windows = jnp.asarray(classes, jnp.int32)

  def group_body(g, out):
    start, end = starts[g], ends[g]
    full = (end - start) // tile
    rest = start + full * tile
    # The partial tile first: its product starts the accumulator (no zeros to add to).
    branch = jnp.where(rest < end, 1 + jnp.searchsorted(windows, end - rest), 0)
    acc = lax.switch(branch, branches, rest, end)

    def full_tile(j, acc):
      first = start + j * tile
      r = rhs_view(lax.dynamic_slice_in_dim(rhs, first, tile, axis=rhs_row_axis))
      return acc + product(rows_of(first, tile), r)

    acc = lax.fori_loop(0, full, full_tile, acc)
    group_bias = None if bias is None else lax.dynamic_index_in_dim(bias, g, 0)
    y = _to_storage(apply_epilogue(acc, group_bias, cfg.activation, cfg.out_dtype), storage)
    return lax.dynamic_update_index_in_dim(out, y, g, 0)

  zero = _to_storage(_unshared_zero(lhs, rhs, cfg.out_dtype), storage)
  out = jnp.broadcast_to(zero, (cfg.num_local, m, n_out))
  out = lax.fori_loop(0, cfg.num_local, group_body, out)
  return out if storage == cfg.out_dtype else lax.bitcast_convert_type(out, cfg.out_dtype)
