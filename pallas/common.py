"""What the Pallas kernels share: one preamble (quantized operand preparation, dtypes, tile
checks, the empty and K=0 cases), tile sizes, edge masks, in-kernel dequantization.

Floor 2 with the kernels. Kernels read the grouped layout only through
`gmm_jax._src.core.metadata` (work items, group bounds); nothing here re-derives group offsets
from a group list.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.core import epilogue, jax_private
from gmm_jax._src.core.config import (GmmConfig, Problem, Tiling, accumulator_dtype, is_gated,
                                      problem_dims)
from gmm_jax._src.tiling import tuning
from gmm_jax._src.core.qarray import QArray, broadcast_scale, quant_mode, stored_scale
from gmm_jax.pallas.jax_pallas import pl


def next_power_of_2(x: int) -> int:
  """The smallest power of 2 >= max(x, 1)."""
  return 1 << max(0, int(x) - 1).bit_length()


def power_of_2_tile(size: int, smallest: int, largest: int) -> int:
  """A power-of-2 tile covering `size` elements, clamped to ``[smallest, largest]``.

  `smallest` and `largest` must be powers of 2 (Triton blocks are; its dots need >= 16).
  """
  return min(largest, max(smallest, next_power_of_2(size)))


def edge_mask(first, size: int, limit) -> jax.Array:
  """bool ``[size]``: which of the indices ``first + [0, size)`` lie below `limit`."""
  return first + lax.iota(jnp.int32, size) < limit


def unsupported_primitives(fn, rules) -> set[str]:
  """Primitives of `fn` (traced on an f32 tile) that have no rule in `rules`.

  `rules` is a Pallas backend's lowering table (primitive -> rule). Best effort: a kernel
  calls this before building a pallas_call so that an activation it cannot lower raises
  NotImplementedError at trace time (the dispatcher then falls back), instead of failing
  when lowering.
  """
  if fn is None:
    return set()
  jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((16, 128), jnp.float32))
  missing = set()

  def walk(inner):
    for eqn in inner.eqns:
      if eqn.primitive not in rules:
        missing.add(eqn.primitive.name)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(jaxpr.jaxpr)
  return missing


# --------------------------------------------------------------------- quantized operands


class QuantOperands(NamedTuple):
  """What a kernel needs to dequantize in-kernel (see `prepare_quant`).

  Fields:
    mode: "weight_only", "scaled" or "blocked".
    rhs_scale: f32 ``[L, Kb, N]``: one row of N scales per K block of `k_block` rows
      (Kb = 1: per-channel or per-tensor, broadcast to N). k-grouping ("blocked" only):
      ``[1, Kb, N]`` (its rhs has no group dim).
    rhs_zero: None or f32 like rhs_scale (weight-only zero points).
    k_block: rows of K sharing a scale row (K itself when Kb == 1).
    lhs_scale: "scaled": f32 ``[M, 1]`` per-token (or per-tensor, broadcast) scale.
      "blocked": f32 ``[M, Kb]``: row i's scale in contraction block j (K blocks of
      `k_block`, counted from K = 0 for both group types: a k-grouped kernel's contraction
      tiles are aligned to multiples of `k_block`, so each tile lies in one block).

  "blocked" (fp8 training's blockwise scales: 1 x 128 activations, 128 x 128 weights, and
  the 128 x 1 blocks of the weight gradient's operands) is, per contraction block j,
  ``acc += dot(lhs_values[:, j], rhs_values[j, :]) * lhs_scale[:, j:j+1] *
  rhs_scale[g, j:j+1, :]`` with f32 accumulation; the kernels take ``tile_k = k_block``.
  """

  mode: str
  rhs_scale: jax.Array
  rhs_zero: jax.Array | None
  k_block: int
  lhs_scale: jax.Array | None
  # "blocked" with a float lhs: the ``(dtype, block, scale_dtype)`` act(z) of a gated
  # prologue is quantized to in-kernel (`GmmConfig.quantize_prologue`; lhs_scale None).
  prologue: tuple | None = None


class QuantStatic(NamedTuple):
  """The static part of `QuantOperands` (what a kernel body may close over)."""

  mode: str
  has_zero: bool
  k_block: int
  prologue: tuple | None = None


def quant_static(quant: QuantOperands | None) -> QuantStatic | None:
  if quant is None:
    return None
  return QuantStatic(quant.mode, quant.rhs_zero is not None, quant.k_block, quant.prologue)


_WEIGHT_TYPES = tuple(np.dtype(t) for t in (jnp.int8, jnp.int4, jnp.float8_e4m3fn,
                                            jnp.float8_e5m2))
_FP8_TYPES = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
# (lhs values, rhs values) pairs of "scaled" mode (per-token x per-channel scales, exact
# products of the values). INT8_SCALED is what every kernel serves; a kernel that also
# multiplies 8-bit floats declares FP8_SCALED too (see `check_quant`).
INT8_SCALED = ((np.dtype(jnp.int8), np.dtype(jnp.int8)),)
FP8_SCALED = tuple((a, b) for a in _FP8_TYPES for b in _FP8_TYPES)
# (lhs values, rhs values) pairs of "blocked" mode (scales varying along K; both group
# types) a kernel may declare (see `check_quant`); none by default.
FP8_BLOCKED = FP8_SCALED


def _supported(scaled_types) -> str:
  pairs = ", ".join(f"{a.name} x {b.name}" for a, b in scaled_types)
  return ("the kernels dequantize in-kernel for m-grouping: weight-only int8/int4/fp8 "
          "weights (per-tensor, per-channel or per-group scales, optional zero points) "
          f"and scaled {pairs} with per-token/per-tensor x per-channel/per-tensor scales")


def _rhs_scale_layout(rhs: QArray, cfg):
  """The rhs scale, zero point and tiles in the canonical ``[L, K, N]`` orientation."""
  scale, zero, tile = rhs.scale, rhs.zero_point, rhs.tile
  if cfg.transpose_rhs:
    scale = jnp.swapaxes(scale, -1, -2)
    zero = None if zero is None else jnp.swapaxes(zero, -1, -2)
    tile = tile[:-2] + (tile[-1], tile[-2])
  return scale, zero, tile


def blocked_k_block(lhs: QArray, rhs: QArray, cfg) -> int | None:
  """The contraction block of a "blocked" pair (the K tile of the side(s) whose scale
  varies along K), or None when both vary with different tiles."""
  tiles = []
  lhs_axis = 0 if cfg.transpose_lhs else 1
  if lhs.scale_varies_along(lhs_axis):
    tiles.append(lhs.tile[lhs_axis])
  rhs_axis = rhs.ndim + (-1 if cfg.transpose_rhs else -2)
  if rhs.scale_varies_along(rhs_axis):
    tiles.append(rhs.tile[rhs_axis])
  return tiles[0] if len(set(tiles)) == 1 else None


def _check_blocked(lhs, rhs, cfg, blocked_types) -> None:
  pairs = ", ".join(f"{a.name} x {b.name}" for a, b in blocked_types) or "none"
  supported = (f"blocked scales (varying along K) in-kernel: {pairs}, no zero points, "
               "one contraction block size for both sides")
  if ((np.dtype(lhs.qtype), np.dtype(rhs.qtype)) not in
      {(np.dtype(a), np.dtype(b)) for a, b in blocked_types}
      or lhs.zero_point is not None or rhs.zero_point is not None):
    raise NotImplementedError(f"{supported}; got {lhs.qtype} x {rhs.qtype} (zero points: "
                              f"{lhs.zero_point is not None}, {rhs.zero_point is not None})")
  if blocked_k_block(lhs, rhs, cfg) is None:
    raise NotImplementedError(f"{supported}; got lhs tile {lhs.tile}, rhs tile {rhs.tile}")


def _check_quantized_prologue(rhs, cfg, blocked_types, prologue: bool) -> None:
  """A gated prologue quantized in-kernel (`GmmConfig.quantize_prologue`): a kernel that
  declares it (`prologue`), a blocked pair it serves, and rhs blocks along K (if any) of
  the prologue's block."""
  dtype, block, scale_dtype = cfg.quantize_prologue
  if not prologue:
    raise NotImplementedError("this kernel does not quantize a gated prologue's act(z) "
                              "in-kernel (fp8 training's forward; Triton does)")
  if scale_dtype is not None and np.dtype(scale_dtype) != np.dtype(jnp.float32):
    raise NotImplementedError(f"a gated prologue is quantized in-kernel with f32 scales; "
                              f"got {np.dtype(scale_dtype)} scales")
  if ((np.dtype(dtype), np.dtype(rhs.qtype)) not in
      {(np.dtype(a), np.dtype(b)) for a, b in blocked_types} or rhs.zero_point is not None):
    raise NotImplementedError(f"a quantized gated prologue multiplies {dtype} act(z) with "
                              f"blocked 8-bit float weights; got {rhs.qtype} weights")
  rhs_axis = rhs.ndim + (-1 if cfg.transpose_rhs else -2)
  if rhs.scale_varies_along(rhs_axis) and rhs.tile[rhs_axis] != block:
    raise NotImplementedError(f"a quantized gated prologue's blocks of {block} along K "
                              f"need rhs blocks of {block} along K; got tile {rhs.tile}")


def check_quant(lhs, rhs, cfg, *, scaled_types=INT8_SCALED, blocked_types=(),
                prologue: bool = False) -> None:
  """Raises NotImplementedError for quantized operands the kernels cannot dequantize
  in-kernel (shapes and dtypes only: it runs on abstract values too). Plain operands pass.

  Args:
    scaled_types: the (lhs values, rhs values) dtype pairs whose "scaled" mode the kernel
      multiplies in-kernel (`INT8_SCALED`, optionally `FP8_SCALED`).
    blocked_types: the pairs whose "blocked" mode (either group type) the kernel serves
      (`FP8_BLOCKED`); none by default.
    prologue: whether the kernel quantizes a gated prologue's act(z) in-kernel for a
      blocked rhs (`GmmConfig.quantize_prologue`).
  """
  lq, rq = isinstance(lhs, QArray), isinstance(rhs, QArray)
  if not lq and not rq:
    return
  if not lq and getattr(cfg, "quantize_prologue", None):
    _check_quantized_prologue(rhs, cfg, blocked_types, prologue)
    return
  supported = _supported(scaled_types)
  mode = quant_mode(lhs, rhs, cfg)
  if mode == "blocked" and blocked_types:
    _check_blocked(lhs, rhs, cfg, blocked_types)
    return
  if cfg.group_type != "m" or mode not in ("weight_only", "scaled"):
    raise NotImplementedError(f"{supported}; got group_type={cfg.group_type!r}, mode {mode}")
  if rhs.qtype not in _WEIGHT_TYPES:
    raise NotImplementedError(f"{supported}; got rhs values {rhs.qtype}")
  n = rhs.shape[-2] if cfg.transpose_rhs else rhs.shape[-1]
  scale_n = rhs.scale.shape[-2] if cfg.transpose_rhs else rhs.scale.shape[-1]
  if scale_n not in (1, n):
    raise NotImplementedError(f"{supported}; got rhs scales blocked along N {rhs.scale.shape}")
  if mode == "weight_only":
    return
  pairs = {(np.dtype(a), np.dtype(b)) for a, b in scaled_types}
  if ((np.dtype(lhs.qtype), np.dtype(rhs.qtype)) not in pairs
      or lhs.zero_point is not None or rhs.zero_point is not None):
    raise NotImplementedError(
        f"{supported}; got {lhs.qtype} x {rhs.qtype} (zero points: "
        f"{lhs.zero_point is not None}, {rhs.zero_point is not None})")
  m = lhs.shape[1] if cfg.transpose_lhs else lhs.shape[0]
  scale_m = lhs.scale.shape[1] if cfg.transpose_lhs else lhs.scale.shape[0]
  if scale_m not in (1, m):
    raise NotImplementedError(f"{supported}; got lhs scales {lhs.scale.shape}")


def _blocked_operands(lhs: QArray | None, rhs: QArray, cfg, m: int, k: int, n: int):
  """`QuantOperands` of "blocked" mode: scales as ``[M, Kb]`` and ``[L or 1, Kb, N]``;
  lhs None: act(z) of a gated prologue, quantized in-kernel (no lhs scales; the
  `QuantOperands.prologue` blocks)."""
  lhs_scale, prologue = None, None
  if lhs is None:
    prologue = tuple(cfg.quantize_prologue)
    k_block = prologue[1]
  else:
    k_block = blocked_k_block(lhs, rhs, cfg)
  num_kb = -(-k // k_block)
  if lhs is not None:
    scale, tile = lhs.scale.astype(jnp.float32), lhs.tile
    if cfg.transpose_lhs:
      scale, tile = scale.T, tile[::-1]
    scale = broadcast_scale(scale, (m, scale.shape[1]), (tile[0], 1))
    lhs_scale = jnp.broadcast_to(scale, (m, num_kb))
  scale, _, tile = _rhs_scale_layout(rhs, cfg)
  scale = scale.astype(jnp.float32)
  scale = broadcast_scale(scale, scale.shape[:-1] + (n,), (1,) * (scale.ndim - 1) + tile[-1:])
  if scale.ndim == 2:  # k-grouping: [Kb, N]
    scale = scale[None]
  groups = cfg.num_local if cfg.group_type == "m" else 1
  rhs_scale = jnp.broadcast_to(scale, (groups, num_kb, n))
  return QuantOperands("blocked", rhs_scale, None, k_block, lhs_scale, prologue)


def prepare_quant(lhs, rhs, cfg, m: int, k: int, n: int, *, scaled_types=INT8_SCALED,
                  blocked_types=(), prologue: bool = False):
  """Splits QArray operands into plain values + `QuantOperands` for an in-kernel
  dequantizing gmm (NotImplementedError from `check_quant` for what the kernels cannot
  serve; `scaled_types`, `blocked_types` and `prologue` as there).

  Returns:
    (lhs values, rhs values, QuantOperands or None when neither operand is quantized).
  """
  check_quant(lhs, rhs, cfg, scaled_types=scaled_types, blocked_types=blocked_types,
              prologue=prologue)
  if not isinstance(rhs, QArray):
    return lhs, rhs, None
  mode = quant_mode(lhs, rhs, cfg)
  if mode == "blocked" and not isinstance(lhs, QArray):  # act(z) quantized in-kernel
    return lhs, rhs.qvalue, _blocked_operands(None, rhs, cfg, m, k, n)
  if mode == "blocked":
    return lhs.qvalue, rhs.qvalue, _blocked_operands(lhs, rhs, cfg, m, k, n)
  # rhs scale as [L or 1, Kb, N or 1] in the canonical [K, N] orientation.
  scale, zero, tile = _rhs_scale_layout(rhs, cfg)
  num_kb = scale.shape[1]
  k_block = max(k, 1) if num_kb == 1 else tile[1]
  shape = (cfg.num_local, num_kb, n)
  rhs_scale = jnp.broadcast_to(scale.astype(jnp.float32), shape)
  rhs_zero = None if zero is None else jnp.broadcast_to(zero.astype(jnp.float32), shape)
  if mode == "weight_only":
    return lhs, rhs.qvalue, QuantOperands(mode, rhs_scale, rhs_zero, k_block, None)
  lhs_scale = lhs.scale.astype(jnp.float32)
  lhs_scale = lhs_scale.T if cfg.transpose_lhs else lhs_scale  # [M or 1, 1]
  lhs_scale = jnp.broadcast_to(lhs_scale, (m, 1))
  return lhs.qvalue, rhs.qvalue, QuantOperands(mode, rhs_scale, None, k_block, lhs_scale)


def dequantize_tile(w, scale_row, zero_row, transposed: bool, dtype):
  """A weight tile ``(w - zero) * scale`` in `dtype`; the scale/zero rows are ``[1, N]``
  (``[N, 1]`` when the tile is stored transposed, ``[N, K]``)."""
  w = w.astype(jnp.float32)
  if zero_row is not None:
    w = w - zero_row
  return (w * scale_row).astype(dtype)


def kernel_dtypes(lhs, rhs, quant: QuantOperands | None):
  """(dot dtype, accumulator dtype) of a kernel on prepared operands: weight-only
  dequantizes the weights to the activations' float type; two different 8-bit floats
  (scaled e4m3 x e5m2, which no MMA takes as a pair) meet in bf16, which holds both
  exactly; otherwise the promoted type, with an int32 accumulator for integers and f32 for
  floats."""
  if quant is not None and quant.mode == "weight_only":
    dot_dtype = lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else jnp.float32
    return np.dtype(dot_dtype), np.dtype(jnp.float32)
  if quant is not None and quant.prologue is not None:  # the dot reads act(z)'s values
    lhs = jax.ShapeDtypeStruct((), quant.prologue[0])
  if np.dtype(lhs.dtype) != np.dtype(rhs.dtype) and {np.dtype(lhs.dtype),
                                                     np.dtype(rhs.dtype)} <= set(_FP8_TYPES):
    return np.dtype(jnp.bfloat16), np.dtype(jnp.float32)
  return np.dtype(jnp.promote_types(lhs.dtype, rhs.dtype)), accumulator_dtype(lhs.dtype,
                                                                              rhs.dtype)


def with_quant_k_step(tiling, quant: QuantOperands | None, k: int):
  """Per-group weight scales take one K step per scale row: ``tile_k = k_block``."""
  if quant is None or quant.k_block >= max(k, 1):
    return tiling
  return Tiling(tile_m=tiling.tile_m, tile_k=quant.k_block, tile_n=tiling.tile_n)


# ------------------------------------------------------------------------------- preamble


class Prepared(NamedTuple):
  """A gmm call made ready for a kernel (see `preamble`).

  Fields:
    lhs, rhs: plain values (the quantized values of QArrays); a zero column each when K=0.
    quant: `QuantOperands` of the in-kernel dequantization, or None.
    dims: (M, K, N) of the call (K as given, 0 included).
    dot_dtype, acc_dtype: the dtypes of the kernel's dots and accumulator.
    tiling: the tiles (the user's, else the kernel's heuristic), with the quantized K step.
    out_shape: the result's shape.
    empty: nothing to compute (no group, or M or N is 0): the result is zeros.
    problem: the `Problem` the tiling was chosen for (None with an explicit tiling).
    automatic: the tiling came from the autotune cache, a tile table or the heuristic (a
      kernel may adapt it), not from the user.
  """

  lhs: jax.Array
  rhs: jax.Array
  quant: QuantOperands | None
  dims: tuple[int, int, int]
  dot_dtype: np.dtype
  acc_dtype: np.dtype
  tiling: Tiling
  out_shape: tuple[int, ...]
  empty: bool
  problem: Problem | None = None
  automatic: bool = False


def require_lowerable(missing: set, what: str, backend: str) -> None:
  """NotImplementedError when `what` (an activation, an epilogue) uses the `missing`
  primitives, which the `backend` lowering has no rule for."""
  if missing:
    raise NotImplementedError(f"{what} uses {sorted(missing)}, which the {backend} "
                              "lowering does not support")


def preamble(lhs, rhs, counts, cfg: GmmConfig, tiling: Tiling | None, *,
             default_tiling: Callable[..., Tiling], check_tiling: Callable[..., None],
             unsupported: Callable[[object], set], backend: str,
             implementation: str | None = None, platform: str | None = None,
             scaled_types=INT8_SCALED, blocked_types=(), prologue: bool = False) -> Prepared:
  """The steps every kernel entry point takes before its pallas_call.

  Args:
    lhs, rhs, counts, cfg: the canonical call (see `GmmConfig`).
    tiling: an explicit tiling; else `tuning.choose` picks ``cfg.tiling`` (a Tiling, a
      callable or `Tilings`), the autotune cache, the built-in tile table or
      `default_tiling`, in that order.
    default_tiling: ``(m, k, n, cfg, itemsize) -> Tiling``, the kernel's heuristic.
    check_tiling: ``(tiling, m, k, n, cfg)``; raises NotImplementedError for tiles the
      kernel cannot use.
    unsupported: ``activation -> set of primitive names`` the compiled kernel cannot lower.
    backend: the kernel's name, for messages.
    implementation, platform: the registered name and platform of the kernel (the keys of
      the tile tables and the autotune cache).
    scaled_types: the "scaled" dtype pairs the kernel multiplies (see `check_quant`).
    blocked_types: the "blocked" dtype pairs it serves (see `check_quant`).
    prologue: whether it quantizes a gated prologue's act(z) in-kernel (see `check_quant`).

  Raises:
    NotImplementedError: quantized operands the kernels cannot dequantize, tiles they
      cannot use, or (compiled mode) an activation they cannot lower.
  """
  m, k, n = problem_dims(lhs.shape, rhs.shape, cfg)
  mode = quant_mode(lhs, rhs, cfg)
  lhs, rhs, quant = prepare_quant(lhs, rhs, cfg, m, k, n, scaled_types=scaled_types,
                                  blocked_types=blocked_types, prologue=prologue)
  dot_dtype, acc_dtype = kernel_dtypes(lhs, rhs, quant)
  problem, automatic = None, False
  if tiling is None:
    problem = tuning.make_problem(implementation, platform, lhs, rhs, counts, cfg, (m, k, n),
                                  mode)
    tiling, source = tuning.choose_with_source(
        problem, cfg.tiling, lambda: default_tiling(m, k, n, cfg, dot_dtype.itemsize))
    automatic = source not in ("user", "callable")
  tiling = with_quant_k_step(tiling, quant, k)
  check_tiling(tiling, m, k, n, cfg)
  if not cfg.interpret:
    require_lowerable(unsupported(cfg.activation), f"activation {cfg.activation!r}", backend)
  out_shape = (m, n) if cfg.group_type == "m" else (cfg.num_local, m, n)
  # No group or an empty output: nothing is written (as the XLA path), and the kernels get
  # no zero-sized grid.
  empty = cfg.num_local == 0 or counts.shape[0] == 0 or m == 0 or n == 0
  if k == 0 and not empty:
    # An empty contraction is a zero accumulator: one zero column each (kernels get no
    # zero-sized operand; the group bounds still see K = 0).
    lhs = jnp.zeros((1, m) if cfg.transpose_lhs else (m, 1), lhs.dtype)
    rhs = jnp.zeros(rhs.shape[:-2] + ((n, 1) if cfg.transpose_rhs else (1, n)), rhs.dtype)
  return Prepared(lhs, rhs, quant, (m, k, n), dot_dtype, acc_dtype, tiling, out_shape, empty,
                  problem, automatic)


def pallas_call(kernel, prepared: Prepared, *, name: str, tiles: tuple[int, ...], **options):
  """``pl.pallas_call(kernel, name=name, **options)``, noting the launch (`tuning.Launch`:
  name, grid, tiles, VMEM limit) for `gmm_jax.tools.aot` and the benchmarks."""
  grid = options.get("grid")
  if grid is None and options.get("grid_spec") is not None:
    grid = options["grid_spec"].grid
  grid = tuple(int(g) if isinstance(g, (int, np.integer)) else -1  # -1: sized at run time
               for g in (grid if isinstance(grid, (tuple, list)) else (grid or 1,)))
  params = options.get("compiler_params")
  note_launch(prepared, name, grid, tiles, getattr(params, "vmem_limit_bytes", None),
              getattr(params, "num_warps", None))
  return pl.pallas_call(kernel, name=name, **options)


def note_launch(prepared: Prepared, name: str, grid: tuple[int, ...], tiles, vmem_limit=None,
                warps=None):
  """Notes a kernel launch (`tuning.Launch`) for `gmm_jax.tools.aot` and the benchmarks."""
  problem = prepared.problem
  tuning.note_launch(tuning.Launch(
      name=name, implementation=None if problem is None else problem.implementation,
      problem=problem, grid=tuple(grid), tiles=tuple(int(t) for t in tiles),
      vmem_limit=vmem_limit, warps=warps))



# ------------------------------------------------------------------ the tile epilogue


def gated_pairs(kernel_activation) -> dict:
  """The gated activations on the gate and up halves, which the kernels keep in two blocks
  and accumulators, each gate activation as the kernel lowers it (`kernel_activation`: a
  kernel's own GELU, e.g.)."""
  return {name: epilogue.gated_pair(
              name, lambda gate: epilogue.resolve_activation(kernel_activation(gate)))
          for name in epilogue.GATED_ACTIVATIONS}


def finish_tile(accs, biases, activation, out_dtype, row_weights=None, *, kernel_activation,
                pairs):
  """The kernels' epilogue of one output tile: `epilogue.apply_epilogue`'s contract (bias,
  activation, gated halves, row weights, cast; `epilogue.finish`'s numerics) on the
  accumulators a program keeps.

  Args:
    accs: ``(acc,)``, one ``[rows, cols]`` accumulator; or for a gated `activation`
      ``(gate, up)``, the gate columns' tile and the up columns' tile (N columns later),
      together the ``[gate | up]`` pre-activation (kernels keep the halves apart: Triton
      cannot concatenate or slice tiles), summed with their biases in f32.
    biases: the bias rows (``[1, cols]`` or None) matching `accs`.
    activation: ``GmmConfig.activation``.
    out_dtype: the result's dtype.
    row_weights: None, ``[rows]`` or ``[rows, 1]``, multiplied after the activation.
    kernel_activation: the activation as the kernel lowers it (by name).
    pairs: the kernel's `gated_pairs`.
  """
  if not is_gated(activation):
    return epilogue.apply_epilogue(accs[0], biases[0], kernel_activation(activation),
                                   out_dtype, row_weights=row_weights)
  gate, up = (acc.astype(jnp.float32) for acc in accs)
  if biases[0] is not None:
    gate, up = gate + biases[0].astype(jnp.float32), up + biases[1].astype(jnp.float32)
  return epilogue.apply_epilogue(pairs[activation](gate, up), None, None, out_dtype,
                                 row_weights=row_weights)


def quantize_rows(x, dtype):
  """A tile ``[rows, block]`` quantized per row to the 8-bit float `dtype` as
  `qarray.quantize` quantizes 1 x block blocks (absmax / the dtype's largest value, f32
  scales): (values, f32 scales ``[rows, 1]``)."""
  top = float(jnp.finfo(dtype).max)
  x = x.astype(jnp.float32)
  # Products with f32 reciprocals, as `quantize` writes them (no compiler rewrites a
  # division differently then: the same bits on every jax and backend).
  scale = stored_scale(jnp.max(jnp.abs(x), axis=1, keepdims=True)
                       * (np.float32(1) / np.float32(top)), jnp.float32)
  return jnp.clip(x * (1.0 / scale), -top, top).astype(dtype), scale


def gated_cotangent_tiles(pair, gate, up, ct):
  """`epilogue.gated_cotangent` on tiles: the cotangents (f32) of z's gate and up tiles
  for the cotangent tile ct of ``pair(gate, up)`` (a kernel's `gated_pairs` entry, so its
  own lowering of the gate's activation is what is differentiated)."""
  _, pull = jax.vjp(pair, gate.astype(jnp.float32), up.astype(jnp.float32))
  return pull(ct.astype(jnp.float32))


def unsupported_activation_primitives(activation, backend: str, *, kernel_activation,
                                      pairs) -> set[str]:
  """Primitives of `activation` as a kernel lowers it (`kernel_activation`; a gated one
  through its `pairs` entry) on f32 tiles without a rule in `backend`'s lowering table
  (`jax_private.lowering_rules`: MissingJaxInternal, a NotImplementedError, where this jax
  has none, so that an activation nothing checked never reaches the compiler)."""
  if activation is None:
    return set()
  if is_gated(activation):
    return unsupported_gated_primitives(pairs[activation], backend)
  return unsupported_primitives(epilogue.resolve_activation(kernel_activation(activation)),
                                jax_private.lowering_rules(backend))


def unsupported_gated_primitives(pair, backend: str, cotangent: bool = False) -> set[str]:
  """Primitives of a gated `pair` (or, with `cotangent`, of its `gated_cotangent_tiles`)
  on f32 tiles that have no rule in `backend`'s lowering table (as
  `unsupported_activation_primitives`)."""
  rules = jax_private.lowering_rules(backend)
  if cotangent:
    def both(z):
      d_gate, d_up = gated_cotangent_tiles(pair, z, z, z)
      return d_gate + d_up
    return unsupported_primitives(both, rules)
  return unsupported_primitives(lambda z: pair(z, z), rules)
