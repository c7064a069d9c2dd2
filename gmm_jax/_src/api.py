"""The public `gmm`: validate -> canonicalize -> route.

Floor 5: `gmm` checks its arguments once (`validate`: canonical operands, int32 group sizes
and the one `GmmConfig`) and routes the call down the floors: the sharded form, fp8
training, the quantized compositions, or the differentiable op. Below it every layer takes
canonical operands ``(lhs, rhs, counts, group_offset, bias, cfg)``.
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import op, validate
from gmm_jax._src.backends import builtin as backends  # noqa: F401  (registers the implementations)
from gmm_jax._src.backends import fp8_training, quantized
from gmm_jax._src.core import grouped_array, metadata
from gmm_jax._src.core.config import Tiling, Tilings
from gmm_jax._src.core.errors import GmmShapeError, describe
from gmm_jax._src.core.grouped_array import GroupedArray, MaskedArray
from gmm_jax._src.core.qarray import Fp8Training, QArray, QuantSpec, as_qarray
from gmm_jax._src.sharding import spec as sharding_lib

Array = jax.Array


def _route(call: validate.Call):
  """The one path a canonical call takes down the floors."""
  args = (call.lhs, call.rhs, call.counts, call.group_offset, call.bias, call.cfg)
  dynamic = call.quantize_lhs is not None or call.quantize_rhs is not None
  requantized = call.output_scale is not None or call.output_offset is not None
  if call.sharding is not None:
    if dynamic or requantized:
      raise NotImplementedError(
          "sharded gmm supports float and QArray operands; dynamic quantization "
          "(quantize_lhs/quantize_rhs) and output_scale/output_offset run per shard with "
          "shard-local statistics, so quantize outside the sharded call")
    return sharding_lib.sharded_gmm(*args, call.sharding)
  if call.quantization is not None:
    return fp8_training.fp8_gmm(*args, call.quantization, rows=call.rows)
  if dynamic:
    return quantized.dynamic_gmm(*args, call.quantize_lhs, call.quantize_rhs,
                                 call.straight_through, call.output_scale, call.output_offset)
  if isinstance(call.lhs, QArray) or isinstance(call.rhs, QArray):
    return quantized.gmm_quantized(*args, call.output_scale, call.output_offset, call.rows)
  return op.gmm(*args, rows=call.rows)


# The options a masked lhs does not take (unset: None, "counts" or False).
_MASKED_UNSUPPORTED = ("group_list_type", "num_groups", "transpose_lhs", "group_offset",
                       "quantize_lhs", "quantize_rhs", "sharding", "lhs_indices",
                       "out_indices", "out_rows", "lhs_activation")


def _masked_gmm(lhs: MaskedArray, rhs, group_list, options: dict) -> MaskedArray:
  """gmm of a masked lhs ``[G, R, K]`` (counts ``[G]``) and rhs ``[G, K, N]`` -> masked
  ``[G, R, N]`` with the same counts (and num_rows bound).

  It is the m-grouped gmm of the ``[G*R, K]`` slots read through row operands, with a
  grouped problem of ``lhs.num_rows`` rows (not G*R: a decode step's T*k rows, when the
  bound is set, rather than E*T slots): row r of the grouped problem reads slot
  ``lhs_indices[r]`` and is written back to the same slot
  (``out_indices``), so every implementation that serves row operands (the reference, the
  XLA path, the Pallas kernels) serves the masked layout with no copy of the activations,
  padding slots are never read (no gradient to them), never written (exactly 0), and the
  gradients are the row-operand gmm's own (dlhs scatters into the slots, drhs reads them).
  """
  supported = ("a MaskedArray lhs supports group_type='m' with rhs [G, K, N] (or a "
               "weight-only QArray rhs), bias, activation (gated too), row_weights [G, R], "
               "transpose_rhs, preferred_element_type, precision, implementation, interpret, "
               "tiling, platform, deterministic")
  if group_list is not None:
    raise ValueError("a MaskedArray lhs carries its own counts; pass no group_list")
  if options.get("group_type") not in (None, "m"):
    raise NotImplementedError(f"{supported}; got group_type={options['group_type']!r}")
  defaults = {"group_list_type": "counts", "transpose_lhs": False}
  given = [name for name in _MASKED_UNSUPPORTED if options[name] is not None and not (
      isinstance(options[name], (str, bool)) and options[name] == defaults.get(name))]
  if given:
    raise NotImplementedError(f"{supported}; got {', '.join(given)}")
  values = lhs.values
  if isinstance(values, QArray) or as_qarray(values) is not None:
    raise NotImplementedError(f"{supported}; got a quantized lhs {describe(values)}")
  g, max_rows, k = lhs.shape
  rhs_q = as_qarray(rhs)
  rhs_shape = tuple(np.shape(rhs if rhs_q is None else rhs_q.qvalue))
  rhs_k = rhs_shape[2 if options["transpose_rhs"] else 1] if len(rhs_shape) == 3 else None
  if rhs_k is None or rhs_shape[0] != g or rhs_k != k:
    raise GmmShapeError(
        f"a MaskedArray lhs {lhs.shape} ([G, max_rows, K]) needs rhs [G, K, N] with G={g}, "
        f"K={k} ([G, N, K] with transpose_rhs), got rhs {describe(rhs)} (transpose_rhs="
        f"{options['transpose_rhs']})")
  total, num_rows = g * max_rows, lhs.num_rows
  counts = metadata.counts_in_range(jnp.clip(lhs.counts, 0, max_rows), 0, num_rows)
  slots = grouped_array.ragged_slots(counts, max_rows, num_rows)
  row_weights = options.pop("row_weights")
  if row_weights is not None:
    row_weights = jnp.asarray(row_weights)
    if row_weights.shape != (g, max_rows) or not jnp.issubdtype(row_weights.dtype,
                                                                 jnp.floating):
      raise ValueError(f"row_weights with a MaskedArray lhs must be float [G, max_rows] = "
                       f"[{g}, {max_rows}], got {jax.typeof(row_weights)}")
    row_weights = jnp.take(row_weights.reshape(total), slots, mode="fill", fill_value=0)
  for name in _MASKED_UNSUPPORTED + ("group_type",):
    options.pop(name)
  out = gmm(jnp.reshape(values, (total, k)), rhs, counts, lhs_indices=slots,
            out_indices=slots, out_rows=total, row_weights=row_weights, **options)
  return MaskedArray(out.reshape(g, max_rows, out.shape[-1]), counts, lhs.num_rows)


def gmm(lhs: jax.typing.ArrayLike | QArray | GroupedArray | MaskedArray,
        rhs: jax.typing.ArrayLike | QArray,
        group_list: jax.typing.ArrayLike | None = None, *, group_type: str | None = None,
        group_list_type: str = "counts", num_groups: int | None = None, bias=None,
        activation: str | Callable[[Array], Array] | None = None, transpose_lhs: bool = False,
        transpose_rhs: bool = False, preferred_element_type=None, precision=None,
        group_offset=None, implementation: str | Sequence[str] | None = None,
        interpret: bool = False, tiling: Tiling | Tilings | Callable | None = None, output_scale=None,
        output_offset=None, quantize_lhs: QuantSpec | None = None,
        quantize_rhs: QuantSpec | None = None, straight_through: bool = True,
        sharding: sharding_lib.GmmSharding | None = None,
        platform: str | None = None, lhs_indices=None, row_weights=None, out_indices=None,
        out_rows: int | None = None, deterministic: bool = True,
        quantization: str | Fp8Training | None = None,
        lhs_activation: str | None = None) -> Array | GroupedArray | MaskedArray:
  """Grouped matrix multiplication with a fused bias + activation epilogue.

  m-grouping (``group_type="m"``): lhs ``[M, K]`` (``[K, M]`` if transpose_lhs), rhs
  ``[G, K, N]`` (``[G, N, K]`` if transpose_rhs) -> ``[M, N]``; the rows of group g are
  multiplied by ``rhs[g]``. Rows at or past the total of the group sizes, and rows of groups
  not held locally (group_offset), are exactly 0.

  k-grouping (``group_type="k"``): lhs ``[M, K]`` (``[K, M]``), rhs ``[K, N]`` (``[N, K]``)
  with K split into contiguous groups -> ``[G, M, N]``, ``out[g] = lhs[:, cols of g] @
  rhs[rows of g]``; an empty group gives ``activation(bias[g])``.

  gmm is a JAX primitive: jit, grad (any order), jvp/linearize, linear_transpose, vmap (over
  any operand, group sizes included) and shard_map all compose with it; every derivative is
  another gmm.

  Args:
    lhs: the left operand, a `QArray`, a `GroupedArray` (its offsets are then the group
      list and its variable_dim picks the grouping: 0 -> "m", 1 -> "k"), or a
      `MaskedArray` ``[G, max_rows, K]`` with counts ``[G]`` (the decode layout: rhs ``[G,
      K, N]``, no group_list; the result is a MaskedArray ``[G, max_rows, N]`` with the
      same counts, rows past each count exactly 0 and no gradient to or from them;
      row_weights are then ``[G, max_rows]``).
    rhs: the right operand (per-group weights for "m"), or a `QArray`. Plain operands of
      two kinds (an integer array with a float one) are multiplied in the float's dtype,
      as `jax.lax.ragged_dot` promotes them.
    group_list: ``[G]`` int sizes ("counts"), ``[G]`` non-decreasing end offsets ("cumsum")
      or ``[E, 2]`` rows ``(group_index, size)`` with increasing indices ("sparse"; unlisted
      groups are empty). May be traced: one compilation serves any sizes. A concrete list
      is validated; a traced one has defined results when invalid (see
      `gmm_jax.check_group_list`).
    group_type: "m" or "k"; default "m" (or from a GroupedArray lhs).
    group_list_type: "counts", "cumsum" or "sparse".
    num_groups: G of a sparse list (default ``rhs.shape[0]`` for "m"); for "k" the number
      of output groups (default G of the list).
    bias: ``[G_local, N]``, added in the f32 accumulator.
    activation: None, "relu", "gelu_tanh", "gelu", "fast_gelu", "silu" or a jnp-traceable
      elementwise callable, applied after the bias and before the cast.
    transpose_lhs, transpose_rhs: operands stored transposed (see shapes above).
    preferred_element_type: output dtype; default the promoted input dtype. Floating inputs
      always accumulate in f32; integer inputs accumulate exactly in int32. An integer type
      needs integer or quantized operands.
    precision: as in jax.lax.dot_general (None, a name, a jax.lax.Precision, a pair, or a
      jax.lax.DotAlgorithmPreset).
    group_offset: int or traced int32 scalar (or ``[1]`` array): rhs (for "m") or the
      output (for "k") holds only groups ``[group_offset, group_offset + G_local)`` of the
      list (expert parallelism).
    implementation: None/"auto" (the platform's chain), a registered name ("xla",
      "reference", "pallas_triton", "pallas_tpu"; see `gmm_jax.implementations`), or a
      sequence of names tried in order (the first that serves the call runs).
    interpret: run Pallas kernels in interpret mode (any platform).
    tiling: None: each implementation picks its tiles from `gmm_jax.autotune`'s cache,
      else its built-in per-target tile table, else its heuristic. A `Tiling` fixes the
      forward call's tiles (the backward's gmms keep the automatic choice); a callable
      ``gmm_jax.Problem -> Tiling | None`` chooses for every gmm of the call, forward and
      backward (None: the automatic choice); `gmm_jax.Tilings(fwd=, dlhs=, drhs=)` gives
      each of the three gmms its own (Tiling, callable or None). A backend that cannot use
      a tiling (e.g. Triton needs powers of 2) raises NotImplementedError and the chain
      moves on.
    output_scale, output_offset: quantized operands only: ``y * output_scale +
      output_offset`` after the activation, before the cast (requantization when the output
      dtype is an integer: rounded to nearest even and saturated). Scalar, ``[N]``,
      ``[G_local, 1]`` or ``[G_local, N]``.
    quantize_lhs, quantize_rhs: `QuantSpec` objects: gmm quantizes the float operand itself
      (dynamic quantization, e.g. per-token int8 activations) and runs the quantized mode.
    straight_through: with quantize_lhs/quantize_rhs, gradients w.r.t. the float operands
      are the float gmm's gradients at the dequantized operands (the straight-through
      estimator); False gives them no gradient.
    sharding: a `GmmSharding(mesh, lhs=PartitionSpec, rhs=PartitionSpec)`: how the operands
      lie on a device mesh; gmm then runs per shard with the matching strategy (expert
      parallel, rows, columns, contraction; see `gmm_jax.explain`) through `jax.shard_map`.
    platform: None (the platform the call is lowered for: the devices of its operands, a
      topology's abstract mesh, ``jax.default_device``, or the default backend), or "cpu",
      "gpu", "tpu" to use that platform's chain of implementations.
    quantization: None, "fp8", "fp8_e5m2_grads" or a `gmm_jax.Fp8Training`: fp8 training
      of a float m-grouped gmm. The forward and both backward gmms multiply 8-bit float
      values with f32 accumulation, the scales computed inside the op: activations in 1 x
      128 blocks along K, weights in 128 x 128 blocks (E4M3), the output cotangent in 1 x
      128 blocks (dlhs) and the weight gradient's operands in 128 x 1 blocks along the
      tokens (E4M3, or E5M2 with "fp8_e5m2_grads"). Gradients are the fp8 products (the
      straight-through estimate, DeepSeek-V3's recipe); reverse mode only (no jvp).
      Kernels that serve the "blocked" mode run them with fp8 MMA (see
      `gmm_jax.explain`), others dequantize. Not combined with QArray operands,
      quantize_lhs/quantize_rhs, output_scale/offset or sharding=.
    lhs_activation: None, or a gated activation ("swiglu", "geglu", "geglu_tanh",
      "swiglu_clamped") applied to lhs before the product (a gated prologue; m-grouping,
      float lhs, not transposed or gathered): lhs ``[M, 2K]`` is a pre-activation z, gate
      half then up half, and the product reads ``act(z[:, :K]) * z[:, K:]`` (in f32,
      rounded to lhs's dtype), so ``gmm(z, w_down, lhs_activation="swiglu")`` is an MoE
      down projection reading the up projection's output. Its input gradient is written
      by one gmm: the dlhs gmm's epilogue forms the ``[M, 2K]`` cotangent of z from its
      product and z (natively on the TPU and Triton kernels, see `gmm_jax.explain`), with
      no ``[M, K]`` cotangent of the activation kept beside it. With fp8 training
      (``quantization=``) act(z) is quantized in 1 x 128 blocks (in the Triton kernel's
      prologue) and the dlhs gmm's epilogue reads the blockwise fp8 product.
    deterministic: True (default): the result, and every gradient, is bitwise identical
      from run to run on every implementation (split-K partial sums are summed in a fixed
      order, token rows in a fixed order). False lets an implementation add partial sums
      with atomics where that is faster (Triton's split-K on GPUs); `gmm_jax.explain` says
      which implementations do.

  Row operands (m-grouping; an MoE layer's token dispatch and combine inside the gmm, with
  no permuted copy of the activations):

  * lhs_indices: int ``[R]``: row r of the grouped problem reads ``lhs[lhs_indices[r]]``;
    lhs is ``[T, K]`` for any T and the group list covers the R rows.
  * row_weights: float ``[R]``: row r of the result is multiplied by it after the
    activation, in f32 before the cast (the router probability); differentiable.
  * out_indices: int ``[R]`` (with out_rows, default R): row r is written to row
    ``out_indices[r]`` of an ``[out_rows, N]`` result; the written rows' indices must be
    unique; rows nothing writes are exactly 0 (top-k combine: ``out_rows = T*k`` slots,
    then a sum over k).

  Concrete out-of-range or repeated (out_indices) indices of written rows raise ValueError;
  traced ones read a zero row / write nothing. The gradient w.r.t. lhs sums each token's
  rows in a fixed order (`gmm_jax.route` makes the indices). A gated activation
  ("swiglu", "geglu", "geglu_tanh", "swiglu_clamped": gpt-oss's clamped SwiGLU) takes rhs
  with 2N columns, the gate half then the up half, and gives N: ``act(z[:, :N]) * z[:, N:]``
  (bias ``[G, 2N]``).

  Quantized operands (a `QArray`, or a qwix QArray) select a mode: float lhs x QArray rhs is
  weight-only (``x @ dequantize(W)``); QArray x QArray multiplies the quantized values
  exactly (int32 accumulation for integers) and applies both scales, per K block when a
  scale varies along K (MX, G-B, per-group). An int32 bias is added in the accumulator
  (before the scales); a float bias after them. See `gmm_jax.quantize`.

  Returns:
    ``[M, N]`` for "m" (a `GroupedArray` with lhs's offsets if lhs was one, a
    `MaskedArray` ``[G, max_rows, N]`` if lhs was one), ``[G_local, M, N]`` for "k".

  Raises:
    GmmShapeError: an operand or group list of the wrong rank, shape, dtype or type, or
      shapes that do not fit together (a TypeError, as jax raises for these, and a
      ValueError).
    ValueError: malformed names, flags or options, or a concrete group list that is
      negative, decreasing (cumsum), has bad sparse indices, does not fit int32 or sums
      past the grouped dimension.
    NotImplementedError: a valid combination no registered implementation serves, or
      symbolic dimensions (`jax.export`; gmm_jax.ragged_dot serves those).
  """
  if isinstance(lhs, MaskedArray):
    options = dict(locals())
    return _masked_gmm(options.pop("lhs"), options.pop("rhs"), options.pop("group_list"),
                       options)
  lhs, group_list, group_type, group_list_type, out_offsets = validate.unwrap_grouped_array(
      lhs, group_list, group_type, group_list_type, transpose_lhs)
  call = validate.validate(
      lhs, rhs, group_list, group_type=group_type, group_list_type=group_list_type,
      num_groups=num_groups, bias=bias, activation=activation, transpose_lhs=transpose_lhs,
      transpose_rhs=transpose_rhs, preferred_element_type=preferred_element_type,
      precision=precision, group_offset=group_offset, implementation=implementation,
      interpret=interpret, tiling=tiling, output_scale=output_scale,
      output_offset=output_offset, quantize_lhs=quantize_lhs, quantize_rhs=quantize_rhs,
      straight_through=straight_through, sharding=sharding, platform=platform,
      lhs_indices=lhs_indices, row_weights=row_weights, out_indices=out_indices,
      out_rows=out_rows, deterministic=deterministic, quantization=quantization,
      lhs_activation=lhs_activation)
  if out_offsets is not None and call.cfg.has_rows:
    raise ValueError("a GroupedArray lhs carries its own row layout; pass row operands "
                     "(lhs_indices, row_weights, out_indices) with a plain lhs")
  out = _route(call)
  return out if out_offsets is None else GroupedArray(out, out_offsets, 0)
