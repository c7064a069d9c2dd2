"""Host-side cost models of the Pallas kernels, and the schedule facts they share with them.

Floor 1 (beside `tuning`): the kernels (floor 2) import their schedule helpers and models
from here, never the reverse, so a model can be read, tested and used by the benchmarks
without building a kernel.

* Triton (`gmm_jax.pallas.gpu.triton`): the partial-window row classes, the banded program
  order (L2 reuse), the split-K chunk choice, and `triton_static_cost`, a wave model of
  the launch (programs in waves of one per SM, an LRU L2 of whole tiles). The number of SMs
  comes from the compile target (`gpu_sm_count`).
* Mosaic TPU (`gmm_jax.pallas.tpu.mosaic_tpu_plan`): the VMEM footprint of a tiling (`vmem_bytes`,
  `vmem_limit`), a roofline time (`modelled_seconds`), the kernels' work items (`m_items`,
  `k_items`) and `tpu_static_cost`, a model of the DMAs a grid order implies.
* The bytes both static models count as read from HBM (an LRU L2, DMAs of consecutive grid
  steps) are `traffic`'s.
* The target as the kernels see it: the GPU (`gpu_target`, `gpu_capability`, `gpu_sm_count`,
  its shared memory `GPU_SMEM_BYTES`) and the TPU's VMEM (`vmem_capacity`), MXU rows
  (`mxu_rows`) and fp8 MXU path (`fp8_mxu`), read from the device or else from the chip
  tables (`chips`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, Tiling
from gmm_jax._src.tiling import chips, traffic
from gmm_jax._src.tiling.chips import MIB


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


# ------------------------------------------------------------------------- GPU target

# Shared memory one block may use on sm_90 (228 KiB per SM, 1 KiB reserved): the kernels'
# pipeline depth and the tile tables are held to it.
GPU_SMEM_BYTES = 227 * 1024


_GPU_PLATFORMS = ("gpu", "cuda", "rocm")


def _device_sm_count(device) -> int | None:
  """SMs of a device-like object (a jax Device: ``core_count``; an abstract device:
  ``num_cores``), None when it is not a GPU or does not say."""
  if device is None or getattr(device, "platform", None) not in _GPU_PLATFORMS:
    return None
  cores = getattr(device, "core_count", None) or getattr(device, "num_cores", None)
  return int(cores) if cores else None


def _gpu_candidates(device) -> list:
  """Where a GPU's description is looked up: `device`, else jax's default device, the
  abstract mesh's device and the first local GPU."""
  candidates = [device] if device is not None else [jax.config.jax_default_device]
  if device is None:
    try:
      candidates.append(jax.sharding.get_abstract_mesh().abstract_device)
    except Exception:  # noqa: BLE001  (older jax: no abstract device)
      pass
    try:
      candidates.extend(jax.devices("gpu")[:1])
    except RuntimeError:  # no GPU backend in this process
      pass
  return candidates


def _parse_capability(value) -> tuple[int, int] | None:
  if value is None:
    return None
  major, _, minor = str(value).partition(".")
  try:
    return int(major), int(minor or 0)
  except ValueError:
    return None


def gpu_target(device=None) -> tuple[tuple[int, int] | None, int, str]:
  """The GPU a kernel is compiled for: (compute capability or None, SMs, a description).

  The one reader of the target GPU. Looked up in `device` if given, else jax's default
  device (a deviceless compile names its target so: the target config's
  ``compute_capability`` and ``core_count``), the abstract mesh's device (its kind in
  `chips.GPU_KINDS`), the first local GPU. With none of them a GPU (interpret mode on a
  CPU): no capability and `chips.DEFAULT_NUM_SMS` (H100/H200).
  """
  where = ("device", "default device", "abstract device", "local device")
  for place, candidate in zip(where if device is not None else where[1:],
                              _gpu_candidates(device)):
    if candidate is None or getattr(candidate, "platform", None) not in _GPU_PLATFORMS:
      continue
    kind = getattr(candidate, "device_kind", None)
    entry = chips.gpu_kind_entry(kind)
    capability = _parse_capability(getattr(candidate, "compute_capability", None))
    if capability is None and entry is not None:
      capability = entry[0]
    cores = _device_sm_count(candidate) or (entry[1] if entry else chips.DEFAULT_NUM_SMS)
    return capability, cores, f"{place} {kind}"
  return None, chips.DEFAULT_NUM_SMS, "no GPU device in sight"


def gpu_sm_count(device=None) -> int:
  """Streaming multiprocessors of the GPU a kernel is compiled for (`gpu_target`)."""
  return gpu_target(device)[1]


def gpu_capability(device=None) -> tuple[int, int] | None:
  """(major, minor) compute capability of the GPU a kernel is compiled for, None when no
  GPU is in sight (interpret mode on a CPU) (`gpu_target`)."""
  return gpu_target(device)[0]


# ----------------------------------------------------------------- Triton: schedule

TRITON_ALIGN = "group"  # the Triton kernels' work items start at their group's first row
SMALLEST_TILE = 16  # tl.dot needs every dimension >= 16
# The lhs rows one band of `program_order` keeps in L2 (the rest of L2 holds the weight
# tiles the band streams through).
BAND_BYTES = chips.L2_BYTES // 3
MAX_BAND = 64
# Split-K writes and re-reads an f32 partial-sum buffer; a chunk of at least this many K
# rows keeps that round trip small next to the MMA work.
SPLIT_MIN_CHUNK = 1024


def row_classes(tile_m: int) -> tuple[int, ...]:
  """Row counts of the partial-window branches: powers of 2 from 16 below ``tile_m``."""
  classes, size = [], SMALLEST_TILE
  while size < tile_m:
    classes.append(size)
    size *= 2
  return tuple(classes)


def band_rows(row_bytes: int, num_rows: int) -> int:
  """Rows per band of `program_order`: a power of 2 whose lhs tiles fit `BAND_BYTES`."""
  band = max(1, BAND_BYTES // max(int(row_bytes), 1))
  band = 1 << (int(band).bit_length() - 1)
  return int(max(1, min(band, MAX_BAND, num_rows)))


def program_order(program, num_rows: int, num_cols: int, band: int, xp=jnp):
  """(row, col) of 1-D program `program` in the banded order.

  Bands of `band` consecutive rows (the last band may be shorter) are visited one after
  the other; inside a band the row index runs fastest, then the column. Every (row, col)
  of ``num_rows x num_cols`` is visited exactly once by the programs ``[0, num_rows *
  num_cols)``. `xp` is jnp (in-kernel, traced ids) or np (host-side models).
  """
  per_band = band * num_cols
  band_index = program // per_band
  first_row = band_index * band
  rows_in_band = xp.minimum(num_rows - first_row, band)
  within = program - band_index * per_band
  return first_row + within % rows_in_band, within // rows_in_band


def default_k_chunk(m: int, k: int, n: int, cfg: GmmConfig, tiling: Tiling,
                    num_sms: int | None = None) -> int | None:
  """Split-K chunk (K rows per work item) of a k-grouped gmm, or None for no split.

  Split when the programs of all groups cannot fill the GPU (two programs per SM) and the
  average group's K is long enough that the f32 partial-sum buffer's round trip (about
  16 bytes per output element) costs little next to the MMA work (2 K flops per element).
  `num_sms`: the target's (default `gpu_sm_count`).
  """
  num_sms = gpu_sm_count() if num_sms is None else num_sms
  if cfg.group_type != "k":
    return None
  mn_tiles = _cdiv(m, tiling.tile_m) * _cdiv(n, tiling.tile_n)
  groups = max(1, cfg.num_local)
  if groups * mn_tiles >= 2 * num_sms or k < groups * SPLIT_MIN_CHUNK:
    return None
  chunks = _cdiv(2 * num_sms, mn_tiles)
  chunk = _cdiv(_cdiv(k, chunks), tiling.tile_k) * tiling.tile_k
  chunk = max(SPLIT_MIN_CHUNK, chunk)
  return chunk if chunk < k else None


# ------------------------------------------------------------- Triton: wave model


def _triton_windows(counts, dim_size: int, window: int, num_local: int, cover: bool = False):
  """Host-side twin of `metadata.make_tile_metadata(align="group")` with group_offset 0:
  a list of (group, start, end) windows of at most `window` rows, in group order."""
  bounds = np.concatenate([[0], np.cumsum(np.asarray(counts, np.int64))]).clip(0, dim_size)
  items = []
  for group in range(num_local):
    start, end = (int(bounds[group]), int(bounds[group + 1])) if group < len(counts) else (0, 0)
    if start == end and cover:
      items.append((group, start, start))
    for first in range(start, end, window):
      items.append((group, first, min(first + window, end)))
  return items


def split_chunks(k: int, k_chunk: int) -> int:
  """Static bound on the split-K chunks of one group (a group's K rows are at most K):
  the leading dimension of the deterministic partial-sum buffer."""
  return max(1, _cdiv(k, k_chunk))


def triton_static_cost(counts, m: int, k: int, n: int, cfg: GmmConfig, tiling: Tiling,
                       itemsize: int = 2, *, k_chunk: int | None = None,
                       l2_bytes: int = chips.L2_BYTES, num_sms: int | None = None) -> dict:
  """What the kernel does for concrete group sizes (a host-side numpy model).

  Args:
    counts: the group sizes (concrete), group_offset 0.
    m, k, n, cfg, tiling: the call (`GmmConfig`) and its tiles.
    itemsize: bytes per operand element; the output uses ``cfg.out_dtype``.
    k_chunk: k-grouping's split-K chunk (default `default_k_chunk`; 0: no split).
    l2_bytes: the L2 the tiles are cached in (LRU of whole tiles, programs in launch order).
    num_sms: programs per wave (default `gpu_sm_count`).

  Returns:
    dict with useful_rows (rows of the grouped dimension the groups own: M rows for
    m-grouping, K rows for k-grouping), mma_rows (the rows the MMAs process: m-grouping's
    partial windows rounded up to their row class, k-grouping's K steps rounded up to
    tile_k), grid_steps (programs launched), busy_steps (programs with work), hbm_bytes
    (modelled operand bytes read from HBM plus the output written), ideal_bytes (each
    operand read once and the output written once), split_buffer_bytes (k-grouping's
    split-K f32 partial sums: ``[L, M, N]`` added atomically, or with
    ``cfg.deterministic`` ``[split_chunks, L, M, N]`` written per chunk and summed in a
    fixed order; 0 without split).
  """
  counts = np.asarray(counts, np.int64)
  num_sms = gpu_sm_count() if num_sms is None else num_sms
  l2 = traffic.L2(l2_bytes, num_sms)
  if cfg.group_type == "m":
    return _triton_m_cost(counts, m, k, n, cfg, tiling, itemsize, l2)
  if k_chunk is None:
    k_chunk = default_k_chunk(m, k, n, cfg, tiling, num_sms) or 0
  return _triton_k_cost(counts, m, k, n, cfg, tiling, itemsize, l2, k_chunk)


def _triton_m_cost(counts, m: int, k: int, n: int, cfg: GmmConfig, tiling: Tiling,
                   itemsize: int, l2: traffic.L2) -> dict:
  """`triton_static_cost` of m-grouping: each program one row window of a group (rounded
  up to its row class) times one column tile, in banded order."""
  num_local, n_tiles = cfg.num_local, _cdiv(n, tiling.tile_n)
  items = _triton_windows(counts[:num_local], m, tiling.tile_m, num_local)
  num_rows = metadata.max_work_items(m, tiling.tile_m, num_local, TRITON_ALIGN)
  classes = (*row_classes(tiling.tile_m), tiling.tile_m)
  lengths = np.array([end - start for _, start, end in items], np.int64)
  padded = [next(c for c in classes if c >= length) for length in lengths]
  useful, mma = int(lengths.sum()), int(sum(padded))
  band = band_rows(tiling.tile_m * k * itemsize, num_rows)
  rows, cols = program_order(np.arange(num_rows * n_tiles), num_rows, n_tiles, band, xp=np)
  busy = 0
  for row, col in zip(rows.tolist(), cols.tolist()):
    if row >= len(items):
      continue
    busy += 1
    group, start, end = items[row]
    width = min(tiling.tile_n, n - col * tiling.tile_n)
    l2.read(("lhs", row), (end - start) * k * itemsize)
    l2.read(("rhs", group, col), k * width * itemsize)
    l2.program_done()
  l2.flush()
  used_groups = len({group for group, _, _ in items})
  ideal_in = (useful * k + used_groups * k * n) * itemsize
  out_bytes = m * n * np.dtype(cfg.out_dtype).itemsize
  return dict(useful_rows=useful, mma_rows=mma, grid_steps=int(num_rows * n_tiles),
              busy_steps=busy, hbm_bytes=int(l2.missed + out_bytes),
              ideal_bytes=int(ideal_in + out_bytes), split_buffer_bytes=0)


def _triton_k_cost(counts, m: int, k: int, n: int, cfg: GmmConfig, tiling: Tiling,
                   itemsize: int, l2: traffic.L2, k_chunk: int) -> dict:
  """`triton_static_cost` of k-grouping: each program one K window of a group (a whole
  group, or a split-K chunk of one) times one output tile, in banded order."""
  num_local, n_tiles = cfg.num_local, _cdiv(n, tiling.tile_n)
  split = 0 < k_chunk < k
  items = _triton_windows(counts[:num_local], k, k_chunk if split else max(k, 1), num_local,
                          cover=not split)
  num_items = metadata.max_work_items(k, k_chunk if split else max(k, 1), num_local,
                                      TRITON_ALIGN, cover=not split)
  m_tiles = _cdiv(m, tiling.tile_m)
  lengths = np.array([end - start for _, start, end in items], np.int64)
  useful = int(lengths.sum())
  mma = int(sum(_cdiv(int(length), tiling.tile_k) * tiling.tile_k for length in lengths))
  window = k_chunk if split else max(1, k // max(1, num_local))
  band = band_rows(tiling.tile_m * window * itemsize, num_items * m_tiles)
  programs = np.arange(num_items * m_tiles * n_tiles)
  rows, cols = program_order(programs, num_items * m_tiles, n_tiles, band, xp=np)
  busy = 0
  for row, col in zip(rows.tolist(), cols.tolist()):
    item, m_tile = divmod(row, m_tiles)
    if item >= len(items):
      continue
    busy += 1
    _, start, end = items[item]
    height = min(tiling.tile_m, m - m_tile * tiling.tile_m)
    width = min(tiling.tile_n, n - col * tiling.tile_n)
    l2.read(("lhs", item, m_tile), (end - start) * height * itemsize)
    l2.read(("rhs", item, col), (end - start) * width * itemsize)
    l2.program_done()
  l2.flush()
  out_bytes = num_local * m * n * np.dtype(cfg.out_dtype).itemsize
  split_hbm, buffer = _split_traffic(cfg, m, n, k, k_chunk if split else 0, len(items))
  ideal = useful * (m + n) * itemsize + out_bytes
  return dict(useful_rows=useful, mma_rows=mma, grid_steps=int(num_items * m_tiles * n_tiles),
              busy_steps=busy, hbm_bytes=int(l2.missed + out_bytes + split_hbm),
              ideal_bytes=int(ideal), split_buffer_bytes=int(buffer))


def _split_traffic(cfg: GmmConfig, m: int, n: int, k: int, k_chunk: int,
                   num_items: int) -> tuple[int, int]:
  """(HBM bytes, bytes of the f32 partial-sum buffer) that split-K adds to k-grouping
  (`k_chunk` 0: no split, none)."""
  partial = cfg.num_local * m * n * 4
  if k_chunk and cfg.deterministic:  # zero fill, one write per item tile, the ordered sum
    buffer = split_chunks(k, k_chunk) * partial
    return 2 * buffer + num_items * m * n * 4 + partial, buffer
  if k_chunk:  # zero fill, atomic read-modify-write per item tile, epilogue read
    return partial * 2 + num_items * m * n * 4 * 2, partial
  return 0, 0


# ------------------------------------------------------------------------- TPU: VMEM

TPU_ALIGN = "tile"  # the TPU kernels' BlockSpec index maps address whole tiles
LANE = 128
# When neither jax's TPU info nor `chips.TPU_CHIPS` knows the target (CPU interpret mode):
# v5e's.
DEFAULT_VMEM_CAPACITY = 128 * MIB
DEFAULT_MXU_ROWS = 128
VMEM_RESERVE = 8 * MIB  # left to Mosaic's internal scratch
VMEM_HEADROOM = 4 * MIB
DEQUANT_ROWS = 256  # stored weight rows dequantized at a time into the VMEM cache
STEP_OVERHEAD_S = 0.35e-6  # per grid step (pipeline bookkeeping), the usual Pallas TPU figure


def fp8_mxu(kind: str | None = None) -> bool:
  """Whether the target TPU (or device kind `kind`) multiplies 8-bit floats on its MXU.
  True for TPU7x; False for v5e/v5p/v6e and for kinds gmm_jax does not know (their kernels
  convert fp8 values to bf16, exactly, before the dot)."""
  chip = chips.tpu_chip(kind)
  return False if chip is None else chip.fp8_mxu


def fit_tile(tile: int, dim: int) -> int:
  """A block extent for `dim`: the whole dim when the tile covers it, else the tile."""
  return dim if tile >= dim else tile


def vmem_capacity() -> int:
  """Bytes of VMEM of the target TPU core: jax's TPU info, else `chips.TPU_CHIPS` (64 MiB on
  TPU7x), else 128 MiB (v5e/v6e) when neither can say."""
  return int(getattr(chips.target_tpu_info(), "vmem_capacity_bytes", 0)
             or getattr(chips.tpu_chip(), "vmem_bytes", 0) or DEFAULT_VMEM_CAPACITY)


def mxu_rows() -> int:
  """Rows of the MXU (128 on v5e, 256 on v6e and TPU7x): the row slice a partial item
  computes (jax's TPU info, else `chips.TPU_CHIPS`, else 128)."""
  return int(getattr(chips.target_tpu_info(), "mxu_column_size", 0)
             or getattr(chips.tpu_chip(), "mxu", 0) or DEFAULT_MXU_ROWS)


def vmem_bytes(tiling: Tiling, group_type: str, *, lhs_itemsize: int, rhs_itemsize: int,
               out_itemsize: int, dot_itemsize: int, k_steps: int, transpose_lhs: bool = False,
               weight_cache: bool = False, has_bias: bool = False, scales: int = 0,
               lhs_scale: bool = False) -> int:
  """Bytes of VMEM one kernel invocation uses, modelled from its blocks.

  Double-buffered input and output blocks, the f32/int32 accumulator (k-grouping always;
  m-grouping with several K steps), the f32 dot result and one epilogue temporary, a cast
  weight tile (cached or not) when rhs is cast, the transposed lhs tile, and the small bias/
  scale blocks (a ``[1, tile_n]`` block pads to 8 sublanes, a ``[tile_m, 1]`` or
  ``[tile_n, 1]`` one to 128 lanes; scale blocks are counted at the latter size).
  """
  tm, tk, tn = tiling.tile_m, tiling.tile_k, tiling.tile_n
  total = 2 * tm * tk * lhs_itemsize + 2 * tk * tn * rhs_itemsize + 2 * tm * tn * out_itemsize
  if group_type == "k" or k_steps > 1:
    total += tm * tn * 4
  total += 2 * tm * tn * 4  # the dot's f32 result and an epilogue temporary
  if weight_cache or rhs_itemsize != dot_itemsize:
    total += tk * tn * dot_itemsize
  if weight_cache:  # f32 temporaries of one dequantized slice
    total += 2 * DEQUANT_ROWS * max(tk, tn) * 4
  if transpose_lhs:
    total += tm * tk * dot_itemsize
  total += 2 * 8 * tn * 4 * int(has_bias)
  total += 2 * tn * LANE * 4 * scales  # a [tile_n, 1] scale block pads to 128 lanes
  if lhs_scale:
    total += 2 * tm * LANE * 4
  return int(total)


def vmem_limit(needed: int, capacity: int | None = None) -> int:
  """The ``vmem_limit_bytes`` for a kernel that needs `needed` bytes: 25% + 4 MiB headroom,
  rounded up to a MiB, at most the capacity less Mosaic's reserve.

  Raises:
    NotImplementedError: `needed` does not fit (tiles too large for this TPU's VMEM).
  """
  capacity = vmem_capacity() if capacity is None else capacity
  ceiling = capacity - VMEM_RESERVE
  if needed > ceiling:
    raise NotImplementedError(
        f"the TPU kernel's blocks need about {needed / MIB:.1f} MiB of VMEM, more than the "
        f"{ceiling / MIB:.0f} MiB available ({capacity / MIB:.0f} MiB less "
        f"{VMEM_RESERVE / MIB:.0f} MiB reserve); use smaller tiles")
  limit = needed + needed // 4 + VMEM_HEADROOM
  return int(min(ceiling, -(-limit // MIB) * MIB))


def modelled_seconds(tiling: Tiling, m: int, k: int, n: int, cfg: GmmConfig, itemsize: int,
                     row_chunk: int | None = None) -> float:
  """A roofline estimate of one call with balanced groups: max(MXU time of the padded work,
  HBM time of the DMAs the grid order implies) + a fixed cost per grid step. Used to rank
  the tiles that fit in VMEM (`default_tiling`); `static_cost` models concrete counts."""
  peak, bandwidth = chips.device_rates()
  peak = peak * (2 / itemsize if itemsize > 2 else 1)  # f32 dots take several passes
  row_chunk = mxu_rows() if row_chunk is None else row_chunk
  tm, tk, tn = (fit_tile(tiling.tile_m, m), fit_tile(tiling.tile_k, k),
                fit_tile(tiling.tile_n, n))
  groups = max(1, min(cfg.num_local, m if cfg.group_type == "m" else k))
  out_itemsize = cfg.out_dtype.itemsize
  if cfg.group_type == "m":
    tiles, k_steps, n_tiles = math.ceil(m / tm), math.ceil(k / tk), math.ceil(n / tn)
    items = tiles + groups - 1
    rows = m + (groups - 1) * 2 * min(row_chunk, tm)  # slices at group boundaries
    flops = 2 * rows * k * n_tiles * tn
    lhs = m * k * itemsize * n_tiles * (items / tiles if k_steps > 1 else 1)
    rhs = (items if k_steps > 1 else groups) * k * n_tiles * tn * itemsize
    hbm = lhs + rhs + m * n * out_itemsize
    steps = n_tiles * items * k_steps
  else:
    m_tiles, n_tiles = math.ceil(m / tm), math.ceil(n / tn)
    items = math.ceil(k / tk) + groups - 1
    flops = 2 * m_tiles * tm * n_tiles * tn * items * tk
    hbm = (m * k * n_tiles + k * n * m_tiles) * itemsize + cfg.num_local * m * n * out_itemsize
    steps = m_tiles * n_tiles * items
  return max(flops / peak, hbm / bandwidth) + steps * STEP_OVERHEAD_S


# ------------------------------------------------------------------- TPU: items, DMAs


def m_items(counts, m: int, tile_m: int, group_offset, num_local: int, k_steps: int):
  """The m-grouping kernel's items: the steps of `metadata.tile_walk` (every row tile once
  per local group it holds rows of, and tiles or parts of tiles without local rows as zero
  items), in row tile order.

  Returns:
    A tuple of int32 arrays ``(groups, out_tiles, lhs_tiles, starts, ends, real, k_fixed)``
    of one static length, and the int32 item count. A zero item (``real == 0``) owns no
    rows; its group, lhs tile and K block (``k_fixed``) repeat the previous real item's last
    blocks (the first real item's first blocks before it), so it triggers no DMA.
  """
  walk = metadata.tile_walk(counts, m, tile_m, group_offset, num_local)
  items = metadata.walk_items(walk, m, tile_m, num_local)
  k_fixed = (items.after_real * (k_steps - 1)).astype(jnp.int32)
  return (items.groups, items.tiles, items.source_tiles, items.starts, items.ends,
          items.real, k_fixed), walk.num_steps


def k_items(counts, k: int, tile_k: int, group_offset, num_local: int):
  """The k-grouping kernel's items (``cover=True``): ``(groups, tiles, starts, ends)`` and
  the int32 item count."""
  meta = metadata.make_tile_metadata(counts, k, tile_k, group_offset, num_local, TPU_ALIGN,
                                     cover=True)
  return (meta.group_ids, meta.tile_ids, meta.item_start, meta.item_end), meta.num_items


def tpu_static_cost(counts, m: int, k: int, n: int, cfg: GmmConfig, tiling: Tiling,
                    itemsize: int = 2, *, group_offset: int = 0, row_chunk: int | None = None,
                    out_itemsize: int | None = None) -> dict:
  """A host-side model of what the kernels do for concrete group sizes.

  Args:
    counts: int ``[G]`` group sizes (concrete).
    m, k, n: the problem (M, K, N as `GmmConfig` defines them).
    cfg: group type and ``num_local`` (transposes do not change the model).
    tiling: the tiles (edges fitted to the dims as the kernels do).
    itemsize: bytes per lhs/rhs element; `out_itemsize` (default ``cfg.out_dtype``'s).
    group_offset: the first global group held locally.
    row_chunk: rows of a partial item's MXU slices (default: the target's `mxu_rows`).

  Returns:
    A dict: ``useful_rows`` (rows of the grouped dim owned by local groups, per column
    block), ``mma_rows`` (rows streamed through the MXU per column block: whole tiles for
    items that own a whole tile, touched ``row_chunk`` slices otherwise; k-grouping: K
    columns incl. the tile padding of partial items), ``grid_steps`` and ``work_steps``
    (steps that compute), ``hbm_bytes`` (lhs/rhs blocks fetched when their index changes
    between consecutive steps + output blocks written back once per visit),
    ``ideal_bytes`` (each operand once + the output once), ``items``, and
    ``group_aligned_rows`` (m-grouping: the rows any scheme that streams whole
    ``row_chunk``-row MXU passes per group needs, ``sum(ceil(count / row_chunk)) *
    row_chunk``: the floor for `mma_rows`; k-grouping: ``useful_rows``).
  """
  counts = jnp.asarray(np.asarray(counts), jnp.int32)
  out_itemsize = cfg.out_dtype.itemsize if out_itemsize is None else out_itemsize
  row_chunk = mxu_rows() if row_chunk is None else row_chunk
  kb = max(k, 1)
  tiles = (fit_tile(tiling.tile_m, m), fit_tile(tiling.tile_k, kb), fit_tile(tiling.tile_n, n))
  ideal = (m * kb + cfg.num_local * kb * n if cfg.group_type == "m" else m * kb + kb * n)
  ideal = ideal * itemsize + (m * n if cfg.group_type == "m" else cfg.num_local * m * n) * (
      out_itemsize)
  if cfg.group_type == "m":
    rows, (lhs, rhs, out) = _tpu_m_steps(counts, (m, kb, n), tiles, group_offset,
                                         cfg.num_local, row_chunk)
  else:
    rows, (lhs, rhs, out) = _tpu_k_steps(counts, (m, k, n), tiles, group_offset,
                                         cfg.num_local)
  hbm = (traffic.dma_bytes(*lhs) + traffic.dma_bytes(*rhs)) * itemsize
  hbm += traffic.dma_bytes(*out) * out_itemsize
  return dict(useful_rows=rows["useful"], mma_rows=rows["mma"],
              group_aligned_rows=rows["bound"], grid_steps=int(len(lhs[0])),
              work_steps=rows["work"], hbm_bytes=int(hbm), ideal_bytes=int(ideal),
              items=rows["items"])


def _mxu_pass_rows(starts, ends, lo, tm: int, row_chunk: int) -> np.ndarray:
  """Rows each m-grouping item streams through the MXU: the whole tile when it owns the
  tile (rows ``[lo, lo + tm)``), else the ``row_chunk`` slices its rows touch."""
  full = (starts <= lo) & (ends >= lo + tm)
  chunks = tm // row_chunk if row_chunk < tm and tm % row_chunk == 0 else 1
  if chunks == 1:
    return np.full_like(starts, tm)
  chunk_lo = lo[:, None] + np.arange(chunks)[None, :] * row_chunk
  touched = (starts[:, None] < chunk_lo + row_chunk) & (ends[:, None] > chunk_lo)
  return np.where(full, tm, touched.sum(axis=1) * row_chunk)


def _tpu_m_steps(counts, dims, tiles, group_offset: int, num_local: int, row_chunk: int):
  """`tpu_static_cost`'s row counts (a dict) and its (keys, sizes) of the lhs, rhs and
  output blocks at every grid step of the m-grouping kernel (column block, item, K block)."""
  (m, kb, n), (tm, tk, tn) = dims, tiles
  num_k, num_n = _cdiv(kb, tk), _cdiv(n, tn)
  arrays, count = m_items(counts, m, tm, jnp.int32(group_offset), num_local, num_k)
  groups, out_tiles, lhs_tiles, starts, ends, real, k_fixed = (
      np.asarray(a)[:int(count)] for a in arrays)
  real = real.astype(bool)
  rows = _mxu_pass_rows(starts, ends, out_tiles * tm, tm, row_chunk)
  n_i, item, k_i = (a.ravel() for a in np.meshgrid(np.arange(num_n), np.arange(len(groups)),
                                                   np.arange(num_k), indexing="ij"))
  k_eff = np.where(real[item], k_i, k_fixed[item])
  lhs = (np.stack([lhs_tiles[item], k_eff], 1),
         traffic.block_bytes(lhs_tiles[item], tm, m) * traffic.block_bytes(k_eff, tk, kb))
  rhs = (np.stack([groups[item], k_eff, n_i], 1),
         traffic.block_bytes(k_eff, tk, kb) * traffic.block_bytes(n_i, tn, n))
  out = (np.stack([out_tiles[item], n_i], 1),
         traffic.block_bytes(out_tiles[item], tm, m) * traffic.block_bytes(n_i, tn, n))
  group_starts, group_ends = (np.asarray(a) for a in metadata.local_group_bounds(
      counts, m, jnp.int32(group_offset), num_local))
  bound_chunk = min(row_chunk, tm)
  bound = int(np.sum(-(-(group_ends - group_starts) // bound_chunk)) * bound_chunk)
  return dict(useful=int(np.sum(np.where(real, ends - starts, 0))),
              mma=int(np.sum(np.where(real, rows, 0))), bound=bound,
              work=int(np.sum(real)) * num_n * num_k, items=len(groups)), (lhs, rhs, out)


def _tpu_k_steps(counts, dims, tiles, group_offset: int, num_local: int):
  """`tpu_static_cost`'s row counts (a dict) and its (keys, sizes) of the lhs, rhs and
  output blocks at every grid step of the k-grouping kernel (row block, column block, item)."""
  (m, k, n), (tm, tk, tn) = dims, tiles
  kb = max(k, 1)
  num_m, num_n = _cdiv(m, tm), _cdiv(n, tn)
  arrays, count = k_items(counts, kb if k else 0, tk, jnp.int32(group_offset), num_local)
  groups, k_tiles, starts, ends = (np.asarray(a)[:int(count)] for a in arrays)
  useful = int(np.sum(ends - starts))
  m_i, n_i, item = (a.ravel() for a in np.meshgrid(np.arange(num_m), np.arange(num_n),
                                                   np.arange(len(groups)), indexing="ij"))
  lhs = (np.stack([k_tiles[item], m_i], 1),
         traffic.block_bytes(k_tiles[item], tk, kb) * traffic.block_bytes(m_i, tm, m))
  rhs = (np.stack([k_tiles[item], n_i], 1),
         traffic.block_bytes(k_tiles[item], tk, kb) * traffic.block_bytes(n_i, tn, n))
  out = (np.stack([groups[item], m_i, n_i], 1),
         traffic.block_bytes(m_i, tm, m) * traffic.block_bytes(n_i, tn, n))
  return dict(useful=useful, mma=int(np.sum(np.where(ends > starts, tk, 0))), bound=useful,
              work=int(np.sum(ends > starts)) * num_m * num_n, items=len(groups)), (
                  lhs, rhs, out)
