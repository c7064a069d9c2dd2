"""jax's megablox call signatures (``jax.experimental.pallas.ops.tpu.megablox``) on gmm_jax.

Replacing the import is the whole migration::

    from gmm_jax.compat.megablox import ops       # was: ...tpu.megablox import ops
    out = ops.gmm(lhs, rhs, group_sizes, jnp.bfloat16, tiling, group_offset, existing_out)

    from gmm_jax.compat.megablox import gmm, tgmm # was: ...tpu.megablox.gmm import gmm, tgmm

megablox has a forward kernel `gmm`, a kernel `tgmm` (the weight gradient) and `ops.gmm`, a
`custom_vjp` over both. Here `gmm` and `ops.gmm` are one function: gmm_jax's gmm is always
differentiable (lhs, rhs and existing_out; any order, jvp, vmap). The arguments are those of
megablox as shipped with jax 0.10-0.12, plus MaxText's additions to `ops.gmm`
(``lhs_quantize_dtype``, ``rhs_quantize_dtype``) and a 9-tuple `tiling`.

Where the two differ, by design:

* Rows of the result outside the local groups (past ``sum(group_sizes)``, or of groups not
  held locally) are whatever memory held in megablox when ``existing_out`` is None (NaN in
  interpret mode); here they are exactly 0.
* megablox needs ``m % tm == 0``, int32 group sizes and f32/bf16 operands; gmm_jax takes any
  M, any integer group sizes and every dtype gmm takes.
* ``tiling=None`` (or a callable returning None) raises ValueError in megablox; here it is
  gmm_jax's automatic tile choice.
* The gradient w.r.t. ``existing_out`` is the cotangent on the rows the result takes from it
  (megablox's ``ops.gmm`` returns the whole cotangent, also on the rows it overwrote).
"""

from __future__ import annotations

import types
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import gmm_jax

__all__ = ["gmm", "tgmm", "ops"]

MegabloxTiling = Any  # (tm, tk, tn), 9 ints (fwd, dlhs, drhs), (m, k, n) -> tuple, or None


def _as_tiling(tiles, role: str) -> gmm_jax.Tiling:
  """megablox's ``(tm, tk, tn)`` of one kernel call as gmm_jax's `Tiling` of the same call.

  The forward and dlhs gmms are m-grouped: the names agree. The drhs call is megablox's
  tgmm, whose ``tm`` tiles its grouped dimension (gmm_jax's K of k-grouping) and whose
  ``tk`` tiles its output rows (gmm_jax's M).
  """
  tile_m, tile_k, tile_n = tiles
  if role == "drhs":
    tile_m, tile_k = tile_k, tile_m
  return gmm_jax.Tiling(tile_m=tile_m, tile_k=tile_k, tile_n=tile_n)


def _role_tiles(tiles, role: str):
  """The 3 tiles of `role` from a 3-tuple (every role) or a 9-tuple (fwd, dlhs, drhs)."""
  tiles = tuple(tiles)
  if len(tiles) == 9:
    start = {"fwd": 0, "dlhs": 3, "drhs": 6}[role]
    return tiles[start:start + 3]
  if len(tiles) == 3:
    return tiles
  raise ValueError(f"megablox tiling must be 3 ints (tm, tk, tn) or 9 ints (forward, dlhs "
                   f"and drhs tiles), got {tiles!r}")


def _lookup(fn: Callable, role: str):
  """A gmm_jax tiling callable (Problem -> Tiling | None) over megablox's (m, k, n) -> tiles.

  megablox calls it with its kernel's own dims: ``(m, k, n)`` for the forward gmm,
  ``(m, n, k)`` for the dlhs gmm (the gradient ``[m, n]`` times rhs transposed) and
  ``(m, k, n)`` for the tgmm computing drhs, whose grouped m is gmm_jax's k-grouped K.
  """

  def choose(problem: gmm_jax.Problem):
    if problem.group_type == "k":
      tiles = fn(problem.k, problem.m, problem.n)
    else:
      tiles = fn(problem.m, problem.k, problem.n)
    return None if tiles is None else _as_tiling(_role_tiles(tiles, role), role)

  return choose


def _tilings(tiling: MegabloxTiling, *, kernel: str = "gmm"):
  """megablox's `tiling` as gmm_jax's ``tiling=``: a `Tilings` whose three entries are the
  tiles megablox's ops.gmm gives its forward gmm, its dlhs gmm and its drhs tgmm."""
  if tiling is None:
    return None
  if callable(tiling):
    if kernel == "tgmm":  # the call is itself a k-grouped gmm: tiles in tgmm's names
      return gmm_jax.Tilings(fwd=_lookup(tiling, "drhs"), dlhs=None, drhs=None)
    return gmm_jax.Tilings(fwd=_lookup(tiling, "fwd"), dlhs=_lookup(tiling, "dlhs"),
                           drhs=_lookup(tiling, "drhs"))
  if isinstance(tiling, (str, bytes)) or not hasattr(tiling, "__len__"):
    raise ValueError(f"megablox tiling must be a tuple of 3 or 9 ints or a callable "
                     f"(m, k, n) -> tiles, got {tiling!r}")
  if kernel == "tgmm":
    return gmm_jax.Tilings(fwd=_as_tiling(_role_tiles(tiling, "drhs"), "drhs"))
  return gmm_jax.Tilings(**{role: _as_tiling(_role_tiles(tiling, role), role)
                            for role in ("fwd", "dlhs", "drhs")})


def _implementation(interpret: bool, implementation):
  """megablox's ``interpret`` as gmm_jax's implementation choice.

  ``interpret=True`` runs megablox's TPU kernel through the Pallas interpreter on any
  host: here it runs gmm_jax's TPU kernel ("pallas_tpu") the same way, and gmm_jax's XLA
  path where that kernel cannot serve the call (tiles that are not multiples of 128, which
  megablox's interpreter accepts). ``interpret=False``
  is gmm_jax's chain of the platform the call is lowered for ("pallas_tpu" first on TPUs;
  the XLA path on CPUs, where megablox cannot run uninterpreted). An explicit
  ``implementation=`` wins.
  """
  if implementation is not None:
    return implementation
  return ("pallas_tpu", "xla") if interpret else None


def _group_offset(group_offset):
  """megablox's ``()`` group_offset; a ``[1]`` one (tokamax's and gmm_jax's) works too."""
  if group_offset is None:
    return None
  shape = np.shape(group_offset)
  if shape in ((), (1,)):
    return group_offset
  raise ValueError(f"group_offset must be a ()-shaped array, got shape {shape}")


def _quant_spec(dtype, channel_axis: int):
  if dtype is None:
    return None
  # AQT-style dynamic quantization, as MaxText's ops.gmm does: absmax scales per row of
  # lhs and per output column of rhs, kept in f32.
  return gmm_jax.QuantSpec(dtype, channelwise_axes=(channel_axis,), scale_dtype=jnp.float32)


def _check_shapes(lhs, rhs, rhs_ndim: int, name: str) -> None:
  if np.ndim(lhs) != 2:
    raise ValueError(f"{name}: expected a 2-tensor lhs, got shape {np.shape(lhs)}")
  if np.ndim(rhs) != rhs_ndim:
    raise ValueError(f"{name}: expected a {rhs_ndim}-tensor rhs, got shape {np.shape(rhs)}")


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        preferred_element_type: jax.typing.DTypeLike = jnp.float32,
        tiling: MegabloxTiling = (128, 128, 128), group_offset: jax.Array | None = None,
        existing_out: jax.Array | None = None, transpose_rhs: bool = False,
        interpret: bool = False, lhs_quantize_dtype: jax.typing.DTypeLike | None = None,
        rhs_quantize_dtype: jax.typing.DTypeLike | None = None, *,
        implementation: str | tuple[str, ...] | None = None) -> jax.Array:
  """megablox's ``gmm`` and ``ops.gmm``: ``lhs[rows of g] @ rhs[g]`` for each group g.

  Args:
    lhs: ``[m, k]``.
    rhs: ``[num_groups, k, n]`` (``[num_groups, n, k]`` with transpose_rhs); with
      group_offset, the local groups ``[group_offset, group_offset + rhs.shape[0])``.
    group_sizes: integer ``[G]`` rows per group (all groups, local or not).
    preferred_element_type: the result's dtype (megablox's default: float32).
    tiling: ``(tm, tk, tn)`` for every gmm of the call (forward, dlhs and drhs, as
      megablox's ops.gmm passes one tiling to all three); 9 ints, the forward's, the dlhs
      gmm's and the drhs tgmm's tiles (MaxText's convention; each triple in the names of
      that kernel call); a callable ``(m, k, n) -> tiles | None`` called with each kernel
      call's dims; or None, gmm_jax's automatic choice. Tiles a backend cannot use fall
      through to the next implementation of gmm_jax's chain.
    group_offset: int32 ``()`` (or ``[1]``) array: the first group rhs holds.
    existing_out: ``[m, n]`` of dtype preferred_element_type: the result's rows outside
      the local groups' rows are taken from it (expert-parallel shards written into one
      buffer).
    transpose_rhs: rhs is stored ``[num_groups, n, k]``.
    interpret: run the TPU kernel through the Pallas interpreter (see module docs).
    lhs_quantize_dtype, rhs_quantize_dtype: MaxText's dynamic quantization: lhs per row
      and rhs per output column, absmax scales; gradients are the straight-through
      estimator's. gmm_jax needs rhs quantized whenever lhs is (NotImplementedError).
    implementation: gmm_jax's implementation name(s); overrides `interpret`'s choice.

  Returns:
    ``[m, n]`` of preferred_element_type.

  Raises:
    ValueError: shapes megablox rejects, an existing_out of another dtype or shape.
  """
  _check_shapes(lhs, rhs, 3, "gmm")
  group_offset = _group_offset(group_offset)
  m = np.shape(lhs)[0]
  n = np.shape(rhs)[1 if transpose_rhs else 2]
  if existing_out is not None:
    if jnp.dtype(existing_out.dtype) != jnp.dtype(preferred_element_type):
      raise ValueError(f"existing_out dtype {existing_out.dtype} must match "
                       f"preferred_element_type {jnp.dtype(preferred_element_type)}")
    if tuple(np.shape(existing_out)) != (m, n):
      raise ValueError(f"existing_out must have the result's shape {(m, n)}, got "
                       f"{tuple(np.shape(existing_out))}")
  out = gmm_jax.gmm(
      lhs, rhs, group_sizes, preferred_element_type=preferred_element_type,
      tiling=_tilings(tiling), group_offset=group_offset, transpose_rhs=transpose_rhs,
      implementation=_implementation(interpret, implementation), interpret=interpret,
      quantize_lhs=_quant_spec(lhs_quantize_dtype, 0),
      quantize_rhs=_quant_spec(rhs_quantize_dtype, 1 if transpose_rhs else 2))
  if existing_out is None:
    return out
  num_local = np.shape(rhs)[0]
  first = 0 if group_offset is None else jnp.reshape(group_offset, ()).astype(jnp.int32)
  # The rows of the local groups: [bounds[first], bounds[first + num_local]).
  bounds = gmm_jax.make_tile_metadata(jnp.asarray(group_sizes), m, max(m, 1)).bounds
  last = jnp.minimum(first + num_local, np.shape(group_sizes)[0])
  rows = jnp.arange(m, dtype=jnp.int32)
  local = (rows >= bounds[first]) & (rows < bounds[last])
  return jnp.where(local[:, None], out, existing_out)


def tgmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
         preferred_element_type: jax.typing.DTypeLike = jnp.float32,
         tiling: MegabloxTiling = (128, 128, 128), group_offset: jax.Array | None = None,
         num_actual_groups: int | None = None, existing_out: jax.Array | None = None,
         interpret: bool = False, *,
         implementation: str | tuple[str, ...] | None = None) -> jax.Array:
  """megablox's ``tgmm``: ``out[g] = lhs[:, cols of g] @ rhs[rows of g]``.

  In megablox's names lhs is ``[k, m]`` and rhs ``[m, n]`` with m grouped; in gmm_jax's this
  is ``gmm(lhs, rhs, group_sizes, group_type="k")`` (lhs ``[M, K]`` with K grouped,
  ``transpose_lhs=False``). An empty group gives zeros (plus existing_out).

  Args:
    lhs: ``[k, m]``.
    rhs: ``[m, n]``.
    group_sizes: integer ``[G]``, splitting m.
    preferred_element_type: the result's dtype (default float32).
    tiling: ``(tm, tk, tn)`` in tgmm's names (tm tiles the grouped m), the last three of 9
      ints, a callable ``(m, k, n) -> tiles | None``, or None (automatic).
    group_offset: int32 ``()`` or ``[1]`` array: the first group computed.
    num_actual_groups: groups computed, from group_offset (default G).
    existing_out: ``[num_actual_groups, k, n]``, added to the result (in f32, then cast).
    interpret: see `gmm`.
    implementation: gmm_jax's implementation name(s); overrides `interpret`'s choice.

  Returns:
    ``[num_actual_groups, k, n]`` of preferred_element_type.
  """
  _check_shapes(lhs, rhs, 2, "tgmm")
  group_offset = _group_offset(group_offset)
  num_groups = np.shape(group_sizes)[0] if num_actual_groups is None else num_actual_groups
  out_dtype = jnp.dtype(preferred_element_type)
  if existing_out is not None:
    shape = (num_groups, np.shape(lhs)[0], np.shape(rhs)[1])
    if tuple(np.shape(existing_out)) != shape:
      raise ValueError(f"existing_out must have the result's shape {shape}, got "
                       f"{tuple(np.shape(existing_out))}")
  # megablox adds existing_out to the f32 accumulator and casts once.
  floating = jnp.issubdtype(out_dtype, jnp.floating)
  acc_dtype = jnp.float32 if existing_out is not None and floating else out_dtype
  out = gmm_jax.gmm(
      lhs, rhs, group_sizes, group_type="k", num_groups=num_groups,
      preferred_element_type=acc_dtype, tiling=_tilings(tiling, kernel="tgmm"),
      group_offset=group_offset, implementation=_implementation(interpret, implementation),
      interpret=interpret)
  if existing_out is None:
    return out
  return (out + existing_out.astype(acc_dtype)).astype(out_dtype)


ops = types.ModuleType(
    __name__ + ".ops",
    "megablox's ``ops`` module: ``ops.gmm`` is the differentiable gmm (the same function as "
    "`gmm_jax.compat.megablox.gmm`).")
ops.gmm = gmm
