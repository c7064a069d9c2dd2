"""The fused epilogue: bias in the accumulator, activation (plain or gated), per-row
weights, output scale, cast; and the row operations around it (gathered input rows,
scattered output rows).

Floor 0: imports nothing from gmm_jax. The same functions serve the kernels (on a tile of
the accumulator) and the layers above the op (on a whole pre-activation).
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np


def _fast_gelu(x):
  return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "fast_gelu": _fast_gelu,
    "silu": jax.nn.silu,
}


# gpt-oss's clamped SwiGLU: the gate clamped above, the up projection on both sides, a
# sharper sigmoid and ``up + 1``.
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0


def _halves(z):
  n = z.shape[-1] // 2
  return z[..., :n], z[..., n:]


def _swiglu_clamped(gate, up, limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA):
  gate = jnp.minimum(gate, limit)
  up = jnp.clip(up, -limit, limit)
  return gate * jax.nn.sigmoid(alpha * gate) * (up + 1)


def swiglu_clamped(limit: float = SWIGLU_LIMIT, alpha: float = SWIGLU_ALPHA
                   ) -> Callable[[jax.Array], jax.Array]:
  """gpt-oss's clamped SwiGLU ``[..., 2N] -> [..., N]`` (gate half first) with its clamp
  `limit` and sigmoid `alpha` (configs' ``swiglu_limit``; the defaults are the
  ``"swiglu_clamped"`` activation's, the constants the kernels' epilogues use)."""
  return lambda z: _swiglu_clamped(*_halves(z), limit, alpha)


# The gated activations ``act(gate) * up`` by the name of the gate's activation.
_GATE_ACTIVATION = {"swiglu": "silu", "geglu": "gelu", "geglu_tanh": "gelu_tanh"}


def gated_pair(name: str, elementwise=None) -> Callable[[jax.Array, jax.Array], jax.Array]:
  """A gated activation on its two halves, ``(gate, up) -> out``: how a kernel that keeps
  them in two accumulators applies it (Triton cannot slice a tile in half).

  Args:
    name: a name of `GATED_ACTIVATIONS`.
    elementwise: maps the gate's activation name to its function (default
      `resolve_activation`; a kernel passes its own lowering, e.g. of erf).
  """
  if name == "swiglu_clamped":
    return _swiglu_clamped
  gate_fn = (elementwise or resolve_activation)(_GATE_ACTIVATION[name])
  return lambda gate, up: gate_fn(gate) * up


def _gated(name: str) -> Callable[[jax.Array], jax.Array]:
  return lambda z: gated_pair(name)(*_halves(z))


# ``[..., 2N] -> [..., N]``: the gate half first, then the up half (`config.GATED_ACTIVATIONS`
# holds the same names).
GATED_ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    name: _gated(name) for name in ("swiglu", "geglu", "geglu_tanh", "swiglu_clamped")}


def _widened(x):
  return x.astype(jnp.float32) if jnp.dtype(x.dtype).itemsize < 4 else x


def gated_halves_f32(name: str, z: jax.Array) -> jax.Array:
  """``GATED_ACTIVATIONS[name]`` of z ``[..., 2N]`` in f32 (a 16-bit z widened), each half
  widened after it is sliced (the same values): no f32 copy of the whole z is formed, which
  XLA:TPU would keep for the other readers of z (see `gated_cotangent`)."""
  return gated_pair(name)(*(_widened(half) for half in _halves(z)))


def gated_tangent_f32(name: str, z: jax.Array, dz: jax.Array) -> jax.Array:
  """The tangent ``[..., N]`` of the gated activation `name` at the pre-activation z
  ``[..., 2N]`` along dz (z's shape), in f32 (16-bit halves widened): jax's own jvp of
  `gated_pair`. The arithmetic of the one-op tangent (`op.gated_tangent`)."""
  halves = lambda x: tuple(_widened(half) for half in _halves(x))  # noqa: E731
  return jax.jvp(gated_pair(name), halves(z), halves(dz))[1]


def gated_cotangent(name: str, z: jax.Array, ct: jax.Array, dtype) -> jax.Array:
  """``[..., 2N]`` in `dtype`: the cotangent of the pre-activation z ``[..., 2N]`` of the
  gated activation `name` (applied in f32) for the cotangent ct ``[..., N]`` of its
  result, gate half then up half, in one elementwise pass (`jax.vjp` of `gated_pair`)."""
  # Each half is widened after it is sliced: no f32 copy of the whole z is formed, which
  # XLA:TPU would keep alive for z's other reader (the recomputed activation).
  _, pull = jax.vjp(gated_pair(name), *(_widened(half) for half in _halves(z)))
  d_gate, d_up = pull(ct.astype(jnp.float32))
  return jnp.concatenate([d_gate, d_up], axis=-1).astype(dtype)


def prologue_input(name: str, lhs: jax.Array, source: jax.Array | None = None) -> jax.Array:
  """The values of `op.gated_tangent.gated_input` in plain jnp (no primitive, no custom
  derivative), for a program nothing differentiates any more: what the dispatcher forms
  before an implementation that lacks the gated prologue, inside the op's lowering.
  ``act(lhs)`` for a pre-activation lhs ``[..., 2K]``, or, given the pre-activation
  `source` z, the activation's tangent along lhs; both in f32, rounded once to lhs's dtype."""
  if source is None:
    return gated_halves_f32(name, lhs).astype(lhs.dtype)
  return gated_tangent_f32(name, source, lhs).astype(lhs.dtype)


def resolve_activation(activation) -> Callable[[jax.Array], jax.Array] | None:
  """Maps None, a name of `ACTIVATIONS` or a jnp-traceable callable to a callable."""
  if activation is None:
    return None
  if isinstance(activation, str):
    if activation in GATED_ACTIVATIONS:
      return GATED_ACTIVATIONS[activation]
    if activation not in ACTIVATIONS:
      raise ValueError(
          f"unknown activation {activation!r}; use one of {sorted(ACTIVATIONS)}, a gated "
          f"one of {sorted(GATED_ACTIVATIONS)}, None, or a jnp-traceable callable"
      )
    return ACTIVATIONS[activation]
  if callable(activation):
    return activation
  raise ValueError(f"activation must be a name, a callable or None, got {activation!r}")


def apply_epilogue(acc: jax.Array, bias, activation, out_dtype, row_weights=None) -> jax.Array:
  """``cast(activation(acc + bias) * row_weights)``: `finish`'s arithmetic on one group's tile
  (the kernels' in-kernel epilogue), with the operands already as they meet the tile.

  Args:
    acc: the f32 (or int32 for integer inputs) accumulator, ``[rows, N]`` (``[rows, 2N]``
      for a gated activation, which halves it).
    bias: None or an array broadcasting against `acc`.
    activation: a name, callable or None (see `resolve_activation`).
    out_dtype: the dtype of the result.
    row_weights: None or ``[rows]`` (or ``[rows, 1]``, a kernel's column block) floats
      multiplying each row after the activation.
  """
  return _finished(acc, bias, activation, out_dtype, row_weights)


def _finished(z, bias, activation, out_dtype, row_weights=None, output_scale=None,
              output_offset=None) -> jax.Array:
  """The finishing arithmetic, once, for `finish` (whole results) and `apply_epilogue`
  (kernel tiles): the operands already broadcast against `z`.

  In f32: a 16-bit z is widened, an integer z stays integer only while nothing but an
  integer bias meets it. An integer `out_dtype` from a float result means requantization
  (rounded to nearest even, saturated).
  """
  fn = resolve_activation(activation)
  if jnp.issubdtype(z.dtype, jnp.integer):
    if (fn is not None or row_weights is not None or output_scale is not None
        or output_offset is not None
        or (bias is not None and not jnp.issubdtype(jnp.asarray(bias).dtype, jnp.integer))):
      z = z.astype(jnp.float32)
  elif jnp.dtype(z.dtype).itemsize < 4:
    z = z.astype(jnp.float32)
  if bias is not None:
    z = z + bias.astype(z.dtype)
  y = z if fn is None else fn(z)
  if row_weights is not None:
    weights = row_weights.astype(y.dtype)
    y = y * (weights[:, None] if weights.ndim == 1 else weights)
  if output_scale is not None:
    y = y * output_scale
  if output_offset is not None:
    y = y + output_offset
  out_dtype = np.dtype(out_dtype)
  if jnp.issubdtype(out_dtype, jnp.integer) and not jnp.issubdtype(y.dtype, jnp.integer):
    info = jnp.iinfo(out_dtype)
    y = jnp.clip(jnp.round(y), info.min, info.max)
  return y.astype(out_dtype)


def per_group(values, row_ids, ndim: int):
  """Per-group values (``[L, C]`` or ``[L, 1]``; scalars and ``[C]`` broadcast) as they meet
  a result of `ndim` dims: m-grouping (``ndim == 2``, `row_ids` int32 ``[M]``) each row's
  group's entry (rows of no local group, id -1, take group 0's: `finish` zeroes them);
  k-grouping (``ndim == 3``, the result ``[L, M, C]``) broadcast over M."""
  if values is None:
    return None
  values = jnp.asarray(values)
  if values.ndim < 2:
    return values
  if ndim == 2:
    if row_ids is None:
      raise ValueError("per-group values of an m-grouped result need the rows' group ids")
    return values[jnp.maximum(row_ids, 0)]
  return values[:, None, :]


def finish(z: jax.Array, activation, out_dtype, *, row_ids=None, bias=None,
           row_weights=None, output_scale=None, output_offset=None, out_indices=None,
           out_rows: int | None = None) -> jax.Array:
  """The one finishing step of a whole pre-activation, for both group types: every path
  that does not fuse it into a kernel (the op's jvp, the sharding strategies, the
  dispatcher around an implementation, the quantized compositions) calls this, and every
  kernel's in-kernel epilogue (`apply_epilogue` on a tile) is tested against it.

  ``y = cast(activation(z + bias) * row_weights * output_scale + output_offset)``, in f32
  (a 16-bit z is widened; an integer z stays integer only while nothing but an integer
  bias meets it); an integer `out_dtype` from a float y means requantization (rounded to
  nearest even, saturated). m-grouping: rows whose `row_ids` entry is -1 (no local group)
  are exactly 0, then rows are scattered to ``out_indices`` when given.

  Args:
    z: ``[M, C]`` (m-grouping) or ``[L, M, C]`` (k-grouping) pre-activation, C = 2N for a
      gated activation (the gate half then the up half), which gives N columns.
    activation: a name, callable or None (see `resolve_activation`).
    out_dtype: the dtype of the result.
    row_ids: m-grouping: int32 ``[M]``, each row's local group, -1 where none (see
      `metadata.row_group_ids`); None: no row is masked (and no per-group values).
    bias, output_scale, output_offset: None, or per-group values (see `per_group`):
      the bias ``[L, C]`` enters before the activation, scale and offset ``[L, N]`` after.
    row_weights: m-grouping: None or ``[M]`` floats multiplying each row after the
      activation.
    out_indices, out_rows: m-grouping: None, or int32 ``[M]`` target rows of an
      ``[out_rows, N]`` result (see `scatter_rows`; rows of no local group write nothing).
  """
  ndim = z.ndim
  y = _finished(z, per_group(bias, row_ids, ndim), activation, out_dtype, row_weights,
                per_group(output_scale, row_ids, ndim), per_group(output_offset, row_ids, ndim))
  written = None
  if row_ids is not None and ndim == 2:
    written = row_ids >= 0
    y = jnp.where(written[:, None], y, jnp.zeros((), y.dtype))
  if out_indices is not None:
    y = scatter_rows(y, out_indices, y.shape[0] if out_rows is None else out_rows, written)
  return y


# ------------------------------------------------------------------------- row operations


class Rows(NamedTuple):
  """The row operands of an m-grouped gmm (each None when absent; see `GmmConfig`).

  Fields:
    lhs_indices: int32 ``[R]``: row r of the grouped problem reads ``lhs[lhs_indices[r]]``.
    row_weights: float ``[R]``: row r of the result is multiplied by it after the
      activation.
    out_indices: int32 ``[R]``: row r is written to result row ``out_indices[r]``.
    source: the gated pre-activation z that a tangent-mode gated prologue (``[R, 2K]``,
      `GmmConfig.lhs_tangent`) or a gated-cotangent epilogue (``[R, 2N]``,
      `GmmConfig.cotangent_of`) reads (see `op.gated_tangent.gated_input`, `gated_cotangent`).
  """

  lhs_indices: jax.Array | None = None
  row_weights: jax.Array | None = None
  out_indices: jax.Array | None = None
  source: jax.Array | None = None


NO_ROWS = Rows()


def gather_rows(lhs: jax.Array, lhs_indices: jax.Array) -> jax.Array:
  """``[R, K]``: row r is ``lhs[lhs_indices[r]]``, a zero row where the index is out of
  ``[0, T)`` (a traced bad index reads nothing)."""
  rows = lhs.shape[0]
  valid = (lhs_indices >= 0) & (lhs_indices < rows)
  taken = jnp.take(lhs, jnp.clip(lhs_indices, 0, max(rows - 1, 0)), axis=0)
  return jnp.where(valid[:, None], taken, jnp.zeros((), lhs.dtype))


def scatter_targets(out_indices: jax.Array, written: jax.Array | None, out_rows: int):
  """int32 ``[R]`` target rows for `scatter_rows`: ``out_indices`` where the row is written
  and the index lies in ``[0, out_rows)``, else a distinct row past the result (dropped), so
  the targets stay unique whenever the written indices are."""
  num = out_indices.shape[0]
  valid = (out_indices >= 0) & (out_indices < out_rows)
  if written is not None:
    valid = valid & written
  past = out_rows + jnp.arange(num, dtype=jnp.int32)
  return jnp.where(valid, out_indices.astype(jnp.int32), past)


def scatter_rows(y: jax.Array, out_indices: jax.Array, out_rows: int,
                 written: jax.Array | None = None) -> jax.Array:
  """``[out_rows, N]`` zeros with row ``out_indices[r]`` set to ``y[r]`` for the rows r that
  are `written` (all when None) and whose index is in range. The written indices must be
  unique (a permutation of some rows): then this is a plain scatter whose transpose is a
  gather, deterministic on every platform."""
  targets = scatter_targets(out_indices, written, out_rows)
  out = jnp.zeros((out_rows,) + y.shape[1:], y.dtype)
  return out.at[targets].set(y, mode="drop", unique_indices=True)
