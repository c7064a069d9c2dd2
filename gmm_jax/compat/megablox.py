"""jax's megablox call signatures (``jax.experimental.pallas.ops.tpu.megablox``) on gmm_jax.

Replacing the import is the whole migration::

    from gmm_jax.compat.megablox import ops       # was: ...tpu.megablox import ops
    out = ops.gmm(lhs, rhs, group_sizes, jnp.bfloat16, tiling, group_offset, existing_out)

    from gmm_jax.compat.megablox import gmm, tgmm # was: ...tpu.megablox.gmm import gmm, tgmm

megablox has a forward kernel `gmm`, a kernel `tgmm` (the weight gradient) and `ops.gmm`, a
`custom_vjp` over both. Here `gmm` and `ops.gmm` are one function: gmm_jax's gmm is always
differentiable (lhs, rhs and existing_out; any order, jvp, vmap). The arguments are those of
megablox as shipped with jax 0.10-0.12, plus those MaxText (0.2.x) passes to its own
megablox (``maxtext.kernels.megablox``): every keyword of its ``ops.gmm`` (quantize dtypes,
qwix rules, backend switches, ``*_vma_axes``, ``partial_sum``, a 9-tuple `tiling`) and the
``varying_axes`` of its kernel-level ``backend.gmm`` / ``backend.tgmm``, so MaxText's call
sites run unchanged with ``mblx`` (or its ``backend``) replaced by this module. Keywords
that choose MaxText's kernels (``use_tokamax_backend``, ``use_gmm_v2``) do not change the
result and are accepted; a value gmm_jax cannot honour raises NotImplementedError naming it.

Quantization follows qwix, the quantizer MaxText's megablox calls: absmax scales in the
operand's dtype, with the integer bound at ``qmax + 0.5`` (127.5 for int8), lhs per row and
rhs per output column (shared by all experts), or per tensor where the rule disables
channelwise axes; fp8 (``float8_e4m3fn``, ``float8_e5m2``) and MaxText's ``nanoo_fp8``
(``float8_e4m3fnuz``) map the absmax to the type's largest value.

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
* ``partial_sum`` is added to the result in every implementation (MaxText's forward adds it
  only in its tokamax v2 kernel, while its backward always returns its cotangent).
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any, Callable, Sequence

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


@dataclasses.dataclass(frozen=True)
class _Rule:
  """What to quantize, in qwix's ``QtRule`` terms (the fields MaxText's megablox reads)."""
  act_qtype: Any = None
  weight_qtype: Any = None
  channelwise: bool = True


def _qwix_bound(dtype) -> float | None:
  """qwix's symmetric bound: ``qmax + 0.5`` for integers, the largest value for floats."""
  dtype = np.dtype(dtype)
  return float(np.iinfo(dtype).max) + 0.5 if np.issubdtype(dtype, np.integer) else None


def _quant_spec(dtype, operand, channel_axis: int, channelwise: bool):
  """How qwix quantizes `operand` to `dtype` (absmax, scale in the operand's dtype)."""
  if dtype is None or hasattr(operand, "qvalue"):
    return None  # not quantized, or quantized by the caller already
  scale_dtype = np.dtype(operand.dtype)
  if scale_dtype not in (np.dtype(jnp.float32), np.dtype(jnp.bfloat16), np.dtype(jnp.float16)):
    scale_dtype = np.dtype(jnp.float32)
  return gmm_jax.QuantSpec(dtype, channelwise_axes=(channel_axis,) if channelwise else (),
                           scale_dtype=scale_dtype, bound=_qwix_bound(dtype))


def _rule_of(qwix_rule) -> _Rule:
  """A qwix ``QtRule`` as the quantization gmm_jax applies; NotImplementedError for what it
  cannot (quantized gradients, calibrations other than absmax)."""
  if qwix_rule is None:
    return _Rule()
  bwd = getattr(qwix_rule, "bwd_qtype", None)
  if bwd is not None:
    raise NotImplementedError(
        f"a qwix rule with bwd_qtype={bwd} (quantized gradients) is not supported here; "
        f"supported: rules quantizing the forward operands (act_qtype, weight_qtype) with "
        f"absmax calibration, gradients straight through")
  for side in ("act", "weight"):
    method = getattr(qwix_rule, f"{side}_calibration_method", "absmax")
    if getattr(qwix_rule, f"{side}_qtype", None) is not None and method != "absmax":
      raise NotImplementedError(
          f"qwix {side}_calibration_method={method!r} is not supported here; supported: "
          f"'absmax'")
  return _Rule(act_qtype=getattr(qwix_rule, "act_qtype", None),
               weight_qtype=getattr(qwix_rule, "weight_qtype", None),
               channelwise=not getattr(qwix_rule, "disable_channelwise_axes", False))


def _current_qwix_rule():
  """The rule qwix's interception holds for "gmm" (MaxText's use_qwix_quantization), or
  None where qwix is not installed (nothing can have set one)."""
  try:
    import qwix.pallas as qpl  # pylint: disable=g-import-not-at-top
  except ImportError:
    return None
  return qpl.get_current_rule("gmm")


def _maxtext_rule(lhs_quantize_dtype, rhs_quantize_dtype, use_qwix_quantization, qwix_rule,
                  use_manual_quantization) -> _Rule:
  """The quantization MaxText's ``ops.gmm`` applies for its arguments."""
  if use_manual_quantization:
    raise NotImplementedError("use_manual_quantization=True (MaxText's batch-split weight "
                              "quantization) is not supported here; supported: False")
  if use_qwix_quantization:
    return _rule_of(qwix_rule if qwix_rule is not None else _current_qwix_rule())
  # MaxText hand-crafts the rule of its AQT-style dtypes: absmax, channelwise.
  return _Rule(act_qtype=lhs_quantize_dtype, weight_qtype=rhs_quantize_dtype)


def _check_flags(**flags) -> None:
  for name, value in flags.items():
    if not isinstance(value, (bool, np.bool_)):
      raise ValueError(f"{name} must be a bool, got {value!r}")


def _axis_names(value, name: str) -> tuple[str, ...]:
  if value is None:
    return ()
  if isinstance(value, str) or not all(isinstance(a, str) for a in value):
    raise ValueError(f"{name} must be a sequence of mesh axis names, got {value!r}")
  return tuple(value)


def _check_gather_axes(weight_gather_axes) -> None:
  """MaxText's ``weight_gather_axes``: ``[(axis name, weight axis), ...]``."""
  if weight_gather_axes is None:
    return
  try:
    ok = all(isinstance(a, str) and isinstance(i, (int, np.integer))
             for a, i in weight_gather_axes)
  except (TypeError, ValueError):
    ok = False
  if not ok:
    raise ValueError(f"weight_gather_axes must be a sequence of (mesh axis name, axis) pairs, "
                     f"got {weight_gather_axes!r}")


def _vary(out, axes: tuple[str, ...]):
  """`out` varying over the manual mesh `axes` (as MaxText's kernels type their result)."""
  if not axes:
    return out
  mat = getattr(jax.typeof(out), "mat", None)
  varying = getattr(mat, "varying", frozenset())
  missing = tuple(a for a in axes if a not in varying)
  return jax.lax.pcast(out, missing, to="varying") if missing else out


def _check_shapes(lhs, rhs, rhs_ndim: int, name: str) -> None:
  lhs, rhs = getattr(lhs, "qvalue", lhs), getattr(rhs, "qvalue", rhs)  # QArrays: values
  if np.ndim(lhs) != 2:
    raise ValueError(f"{name}: expected a 2-tensor lhs, got shape {np.shape(lhs)}")
  if np.ndim(rhs) != rhs_ndim:
    raise ValueError(f"{name}: expected a {rhs_ndim}-tensor rhs, got shape {np.shape(rhs)}")


def _local_groups(rhs_groups: int, group_sizes, group_offset):
  """megablox's default ``group_offset`` of 0 when rhs holds fewer groups than the list."""
  if group_offset is None and rhs_groups != np.shape(group_sizes)[0]:
    return 0
  return group_offset


def gmm(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
        preferred_element_type: jax.typing.DTypeLike = jnp.float32,
        tiling: MegabloxTiling = (128, 128, 128), group_offset: jax.Array | None = None,
        existing_out: jax.Array | None = None, transpose_rhs: bool = False,
        interpret: bool | None = False, lhs_quantize_dtype: jax.typing.DTypeLike | None = None,
        rhs_quantize_dtype: jax.typing.DTypeLike | None = None,
        use_qwix_quantization: bool = False, use_tokamax_backend: bool = False,
        weight_gather_axes: Sequence[tuple[str, int]] | None = None,
        lhs_vma_axes: Sequence[str] = (), rhs_vma_axes: Sequence[str] = (),
        qwix_rule: Any = None, use_manual_quantization: bool = False,
        use_gmm_v2: bool = False, use_gmm_v2_heuristic_tiling: bool = False,
        partial_sum: jax.Array | None = None, *, varying_axes: Sequence[str] = (),
        implementation: str | tuple[str, ...] | None = None) -> jax.Array:
  """megablox's ``gmm`` and ``ops.gmm``: ``lhs[rows of g] @ rhs[g]`` for each group g.

  The positional order is MaxText's ``ops.gmm`` (jax's megablox ``gmm`` is its first nine).

  Args:
    lhs: ``[m, k]``, or a qwix / gmm_jax QArray (quantized by the caller).
    rhs: ``[num_groups, k, n]`` (``[num_groups, n, k]`` with transpose_rhs), or a QArray;
      with group_offset, the local groups ``[group_offset, group_offset + rhs.shape[0])``
      (without it, groups ``[0, rhs.shape[0])``, as megablox defaults the offset to 0).
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
    interpret: run the TPU kernel through the Pallas interpreter (see module docs); None
      is False, as in MaxText.
    lhs_quantize_dtype, rhs_quantize_dtype: MaxText's dynamic quantization (int8, int4,
      float8_e4m3fn, float8_e5m2, float8_e4m3fnuz): lhs per row and rhs per output column,
      qwix's absmax; gradients are the straight-through estimator's. gmm_jax needs rhs
      quantized whenever lhs is (NotImplementedError).
    use_qwix_quantization: take the quantization from `qwix_rule`, else from the rule qwix's
      interception holds for "gmm" (none where qwix is not installed), instead of the
      quantize dtypes. Rules with quantized gradients (``bwd_qtype``) or a calibration other
      than absmax raise NotImplementedError.
    use_tokamax_backend, use_gmm_v2, use_gmm_v2_heuristic_tiling: MaxText's choice of
      kernels; gmm_jax's dispatcher chooses its own, with the same result. With
      ``use_gmm_v2_heuristic_tiling`` the tiles are gmm_jax's automatic choice.
    weight_gather_axes: MaxText gathers quantized weights over these ``(axis, dim)`` pairs
      only when its gradients are quantized with fixed scales, which this module refuses;
      for every call it serves MaxText ignores them, and so does this.
    lhs_vma_axes, rhs_vma_axes: inside ``jax.shard_map``, the manual axes the result (and
      the rhs gradient) vary over; gmm_jax's results already vary over their operands'.
    qwix_rule: a qwix ``QtRule`` (with use_qwix_quantization).
    use_manual_quantization: MaxText's batch-split weight quantization: only False.
    partial_sum: ``[m, n]``, added to the result (in f32 for a float result); its gradient
      is the output cotangent.
    varying_axes: MaxText's kernel-level ``backend.gmm`` keyword, as `lhs_vma_axes`.
    implementation: gmm_jax's implementation name(s); overrides `interpret`'s choice.

  Returns:
    ``[m, n]`` of preferred_element_type.

  Raises:
    ValueError: shapes megablox rejects, an existing_out or partial_sum of another shape,
      an existing_out of another dtype, malformed MaxText keywords.
    NotImplementedError: a quantization gmm_jax cannot honour (named in the message).
  """
  _check_shapes(lhs, rhs, 3, "gmm")
  _check_flags(transpose_rhs=transpose_rhs, use_qwix_quantization=use_qwix_quantization,
               use_tokamax_backend=use_tokamax_backend, use_gmm_v2=use_gmm_v2,
               use_gmm_v2_heuristic_tiling=use_gmm_v2_heuristic_tiling,
               use_manual_quantization=use_manual_quantization)
  _check_gather_axes(weight_gather_axes)
  vary = (_axis_names(lhs_vma_axes, "lhs_vma_axes")
          + _axis_names(varying_axes, "varying_axes"))
  _axis_names(rhs_vma_axes, "rhs_vma_axes")
  interpret = bool(interpret)
  rule = _maxtext_rule(lhs_quantize_dtype, rhs_quantize_dtype, use_qwix_quantization,
                       qwix_rule, use_manual_quantization)
  num_local = np.shape(getattr(rhs, "qvalue", rhs))[0]
  group_offset = _local_groups(num_local, group_sizes, _group_offset(group_offset))
  m = np.shape(getattr(lhs, "qvalue", lhs))[0]
  n = np.shape(getattr(rhs, "qvalue", rhs))[1 if transpose_rhs else 2]
  if existing_out is not None:
    if jnp.dtype(existing_out.dtype) != jnp.dtype(preferred_element_type):
      raise ValueError(f"existing_out dtype {existing_out.dtype} must match "
                       f"preferred_element_type {jnp.dtype(preferred_element_type)}")
    if tuple(np.shape(existing_out)) != (m, n):
      raise ValueError(f"existing_out must have the result's shape {(m, n)}, got "
                       f"{tuple(np.shape(existing_out))}")
  out_dtype = jnp.dtype(preferred_element_type)
  acc_dtype = out_dtype
  if partial_sum is not None:
    if tuple(np.shape(partial_sum)) != (m, n):
      raise ValueError(f"partial_sum must have the result's shape {(m, n)}, got "
                       f"{tuple(np.shape(partial_sum))}")
    if jnp.issubdtype(out_dtype, jnp.floating):
      acc_dtype = jnp.dtype(jnp.float32)
  out = gmm_jax.gmm(
      lhs, rhs, group_sizes, preferred_element_type=acc_dtype,
      tiling=None if use_gmm_v2_heuristic_tiling else _tilings(tiling),
      group_offset=group_offset, transpose_rhs=transpose_rhs,
      implementation=_implementation(interpret, implementation), interpret=interpret,
      quantize_lhs=_quant_spec(rule.act_qtype, lhs, 0, rule.channelwise),
      quantize_rhs=_quant_spec(rule.weight_qtype, rhs, 1 if transpose_rhs else 2,
                               rule.channelwise))
  if partial_sum is not None:
    out = (out + partial_sum.astype(acc_dtype)).astype(out_dtype)
  if existing_out is not None:
    out = _local_rows_into(existing_out, out, group_sizes, group_offset, num_local)
  return _vary(out, vary)


def _local_rows_into(existing_out, out, group_sizes, group_offset, num_local: int):
  """`existing_out` with the rows of the `num_local` groups from `group_offset` on (rhs's
  local groups) taken from `out`, both ``[m, n]``."""
  m = np.shape(out)[0]
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
         interpret: bool | None = False, *, varying_axes: Sequence[str] = (),
         implementation: str | tuple[str, ...] | None = None) -> jax.Array:
  """megablox's ``tgmm``: ``out[g] = lhs[:, cols of g] @ rhs[rows of g]``.

  In megablox's names lhs is ``[k, m]`` and rhs ``[m, n]`` with m grouped; in gmm_jax's this
  is ``gmm(lhs, rhs, group_sizes, group_type="k")`` (lhs ``[M, K]`` with K grouped,
  ``transpose_lhs=False``). An empty group gives zeros (plus existing_out). The operands
  MaxText's backward passes are taken as they come: an integer operand with a float one
  (its int8 values times a scaled cotangent) is multiplied in the float's dtype, as
  `jax.lax.ragged_dot_general` does; qwix / gmm_jax QArrays are quantized operands.

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
    varying_axes: MaxText's kernel-level ``backend.tgmm`` keyword: inside
      ``jax.shard_map``, the manual axes the result varies over.
    implementation: gmm_jax's implementation name(s); overrides `interpret`'s choice.

  Returns:
    ``[num_actual_groups, k, n]`` of preferred_element_type.
  """
  _check_shapes(lhs, rhs, 2, "tgmm")
  vary = _axis_names(varying_axes, "varying_axes")
  interpret = bool(interpret)
  group_offset = _group_offset(group_offset)
  num_groups = np.shape(group_sizes)[0] if num_actual_groups is None else num_actual_groups
  out_dtype = jnp.dtype(preferred_element_type)
  if existing_out is not None:
    shape = (num_groups, np.shape(getattr(lhs, "qvalue", lhs))[0],
             np.shape(getattr(rhs, "qvalue", rhs))[1])
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
  if existing_out is not None:
    out = (out + existing_out.astype(acc_dtype)).astype(out_dtype)
  return _vary(out, vary)


ops = types.ModuleType(
    __name__ + ".ops",
    "megablox's ``ops`` module: ``ops.gmm`` is the differentiable gmm (the same function as "
    "`gmm_jax.compat.megablox.gmm`).")
ops.gmm = gmm
