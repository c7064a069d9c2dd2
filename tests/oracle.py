"""An independent numpy float64 oracle for gmm, and the tolerances the tests compare with.

Nothing here imports gmm_jax: the oracle walks the groups with plain Python loops over
group *counts* (the tests encode cumsum/sparse lists themselves), so a shared bug in the
library's layout code cannot hide in both sides of a comparison.
"""

from __future__ import annotations

import functools
import math
from typing import Callable

import numpy as np


def _sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


_erf = np.vectorize(math.erf, otypes=[np.float64])

ACTIVATIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda x: np.maximum(x, 0.0),
    "gelu_tanh": lambda x: 0.5 * x * (
        1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x**3))),
    "gelu": lambda x: 0.5 * x * (1.0 + _erf(x / math.sqrt(2.0))),
    "fast_gelu": lambda x: x * _sigmoid(1.702 * x),
    "silu": lambda x: x * _sigmoid(x),
}


def _normal_pdf(x):
  return np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _gelu_tanh_grad(x):
  c = math.sqrt(2.0 / math.pi)
  t = np.tanh(c * (x + 0.044715 * x**3))
  return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3 * 0.044715 * x * x)


# d activation / dx, derived by hand (relu: 0 at 0, as jax.nn.relu's gradient).
ACTIVATION_GRADS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "relu": lambda x: (x > 0).astype(np.float64),
    "gelu_tanh": _gelu_tanh_grad,
    "gelu": lambda x: 0.5 * (1.0 + _erf(x / math.sqrt(2.0))) + x * _normal_pdf(x),
    "fast_gelu": lambda x: (_sigmoid(1.702 * x)
                            + 1.702 * x * _sigmoid(1.702 * x) * (1.0 - _sigmoid(1.702 * x))),
    "silu": lambda x: _sigmoid(x) * (1.0 + x * (1.0 - _sigmoid(x))),
}


def ascend_act(y, act_type: int):
  """Ascend's act_type (0 none, 1 relu, 2 gelu_tanh, 4 fast_gelu, 5 silu) in numpy."""
  names = {1: "relu", 2: "gelu_tanh", 4: "fast_gelu", 5: "silu"}
  return ACTIVATIONS[names[act_type]](y) if act_type in names else y


def resolve(activation):
  """None, a name of ACTIVATIONS, or a numpy callable -> a numpy callable (or None)."""
  if activation is None or callable(activation):
    return activation
  return ACTIVATIONS[activation]


def f64(x) -> np.ndarray:
  """Any array (jax, numpy, bf16/f16/int) -> numpy float64, exactly."""
  return np.asarray(x).astype(np.float64)


def dequantize(q) -> np.ndarray:
  """A QArray's values in float64: ``(qvalue - zero_point) * scale``, each scale (and zero
  point) entry repeated over its tile, read from the raw fields (``qvalue``, ``scale``,
  ``zero_point``, ``tile``) independently of gmm_jax's own dequantize."""
  value = f64(np.asarray(q.qvalue).astype(np.float32))
  scale = f64(np.asarray(q.scale).astype(np.float32))
  zero = None if q.zero_point is None else f64(np.asarray(q.zero_point).astype(np.float32))
  for axis, (size, tile) in enumerate(zip(value.shape, q.tile)):
    if scale.shape[axis] not in (1, size):
      index = np.arange(size) // tile
      scale = np.take(scale, index, axis=axis)
      zero = None if zero is None else np.take(zero, index, axis=axis)
  return (value - (0.0 if zero is None else zero)) * scale


def gmm_oracle(lhs, rhs, sizes, group_type, bias=None, activation=None, transpose_lhs=False,
               transpose_rhs=False, group_offset=0, num_local=None) -> np.ndarray:
  """float64 gmm, one group at a time.

  Args:
    lhs: ``[M, K]`` (``[K, M]`` if transpose_lhs).
    rhs: ``[G_local, K, N]`` for "m", ``[K, N]`` for "k" (last two dims swapped if
      transpose_rhs).
    sizes: plain group counts ``[G]`` (global groups).
    group_type: "m" or "k".
    bias: ``[G_local, N]`` or None.
    activation: None, a name of `ACTIVATIONS`, or a numpy callable.
    group_offset: first global group held locally.
    num_local: G_local; default ``rhs.shape[0]`` for "m", ``len(sizes)`` for "k".

  Returns:
    float64 ``[M, N]`` ("m"; rows of non-local groups and rows past the total are exactly 0,
    with no bias or activation) or ``[G_local, M, N]`` ("k"; a group with no columns, or
    past the end of the list, gives ``activation(bias)``).
  """
  lhs, rhs = f64(lhs), f64(rhs)
  lhs = lhs.T if transpose_lhs else lhs
  rhs = np.swapaxes(rhs, -1, -2) if transpose_rhs else rhs
  sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
  act = resolve(activation)
  bias = None if bias is None else f64(bias)
  m, k = lhs.shape
  n = rhs.shape[-1]

  def epilogue(acc, local):
    if bias is not None:
      acc = acc + bias[local]
    return acc if act is None else act(acc)

  if group_type == "m":
    num_local = rhs.shape[0] if num_local is None else num_local
    assert sum(sizes) <= m, (sizes, m)
    out = np.zeros((m, n))
    start = 0
    for g, size in enumerate(sizes):
      local = g - group_offset
      if 0 <= local < num_local:
        rows = slice(start, start + size)
        out[rows] = epilogue(lhs[rows] @ rhs[local], local)
      start += size
    return out
  assert group_type == "k", group_type
  num_local = len(sizes) if num_local is None else num_local
  assert sum(sizes) <= k, (sizes, k)
  starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
  out = np.zeros((num_local, m, n))
  for local in range(num_local):
    g = group_offset + local
    acc = np.zeros((m, n))
    if g < len(sizes):
      cols = slice(starts[g], starts[g + 1])
      acc = lhs[:, cols] @ rhs[cols]
    out[local] = epilogue(acc, local)
  return out


def gmm_oracle_vjp(lhs, rhs, sizes, group_type, cotangent, bias=None, activation=None,
                   transpose_lhs=False, transpose_rhs=False, group_offset=0, num_local=None,
                   bound=False):
  """float64 gradients of `gmm_oracle` at `cotangent`, one group at a time.

  With ``z = lhs_g @ rhs_g (+ bias_g)`` the pre-activation of a group (its rows for "m", the
  product of its columns for "k") and ``dz`` its cotangent (`activation_rules`;
  ``cotangent_g * activation'(z)`` for an elementwise activation):
  ``dlhs_g = dz @ rhs_g^T``, ``drhs_g = lhs_g^T @ dz``, ``dbias_g = sum over rows of dz``.
  Rows (m) or columns (k) of no local group get exactly 0; a "k" group with no columns still
  has ``z = bias_g``, so its bias gradient is ``sum(cotangent_g * activation'(bias_g))``.

  Args:
    The operands and options of `gmm_oracle` (activation: None or a name of
    `ACTIVATION_GRADS` or `GATES`), `cotangent` of the result's shape, and `bound`: each
    entry's sum of |terms| instead of its value (`activation_rules`; the magnitude
    `rounding_bound` scales).

  Returns:
    float64 ``(dlhs, drhs, dbias)`` in the stored layouts of lhs and rhs (dbias None
    without a bias).
  """
  lhs, rhs, cotangent = _operands(bound, lhs, rhs, cotangent)
  lhs = lhs.T if transpose_lhs else lhs
  rhs = np.swapaxes(rhs, -1, -2) if transpose_rhs else rhs
  sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
  bias = None if bias is None else _operands(bound, bias)[0]
  _, vjp = activation_rules(activation, bound)
  dlhs, drhs = np.zeros_like(lhs), np.zeros_like(rhs)
  dbias = None if bias is None else np.zeros_like(bias)

  def pre_activation_grad(acc, ct, local):
    z = acc if bias is None else acc + bias[local]
    dz = vjp(z, ct)
    if dbias is not None:
      dbias[local] += dz.sum(axis=0)
    return dz

  if group_type == "m":
    num_local = rhs.shape[0] if num_local is None else num_local
    start = 0
    for g, size in enumerate(sizes):
      local, rows = g - group_offset, slice(start, start + size)
      start += size
      if not 0 <= local < num_local:
        continue
      dz = pre_activation_grad(lhs[rows] @ rhs[local], cotangent[rows], local)
      dlhs[rows] = dz @ rhs[local].T
      drhs[local] = lhs[rows].T @ dz
  else:
    assert group_type == "k", group_type
    num_local = len(sizes) if num_local is None else num_local
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(int)
    for local in range(num_local):
      g = group_offset + local
      cols = slice(starts[g], starts[g + 1]) if g < len(sizes) else slice(0, 0)
      dz = pre_activation_grad(lhs[:, cols] @ rhs[cols], cotangent[local], local)
      dlhs[:, cols] = dz @ rhs[cols].T
      drhs[cols] = lhs[:, cols].T @ dz
  dlhs = dlhs.T if transpose_lhs else dlhs
  drhs = np.swapaxes(drhs, -1, -2) if transpose_rhs else drhs
  return dlhs, drhs, dbias


def local_rows(sizes, dim: int, group_offset: int = 0, num_local: int | None = None):
  """Boolean ``[dim]``: True on the rows (m) or columns (k) of groups held locally."""
  sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
  num_local = len(sizes) if num_local is None else num_local
  mask = np.zeros(dim, bool)
  start = 0
  for g, size in enumerate(sizes):
    if 0 <= g - group_offset < num_local:
      mask[start:start + size] = True
    start += size
  return mask


# (rtol, atol per sqrt(K) per unit of product magnitude) by the least precise dtype
# involved. In units of the dtype's machine epsilon (bf16 2^-7, f16 2^-10, f32 2^-23):
# bf16 2.6 / 1.3 eps, f16 5.1 / 2.0 eps (the output's rounding is eps/2); f32 84 eps both
# (XLA:CPU's f32 dot may reassociate and use FMA).
_BASE_TOLERANCE = {
    "float64": (1e-9, 1e-9),
    "float32": (1e-5, 1e-5),
    "float16": (5e-3, 2e-3),
    "bfloat16": (2e-2, 1e-2),
}


def tolerances(*dtypes, k: int = 1, scale: float = 1.0) -> dict[str, float]:
  """``assert_allclose`` tolerances for a result computed from/into `dtypes`.

  The oracle must see the operands *after* their cast to the low-precision dtype (then
  upcast to float64), so the budget only covers f32 accumulation, the epilogue and the final
  rounding of the output: a relative term for the output's own rounding plus an absolute
  term growing like sqrt(K) for the rounding of K accumulated products, each of magnitude up
  to `scale`. Integer-only results must be exact.

  The budget comes from the dtypes and the problem only, never from the result compared.

  Args:
    *dtypes: every dtype involved (operands, intermediates the implementation rounds to, and
      output).
    k: the contraction length.
    scale: the largest magnitude of one accumulated product (``max|a| * max|b|`` for
      ``sum_k a_k b_k``); 1 for the unit-variance operands of most tests. A gradient's is
      its cotangent's chain (`gradient_scale`).
  """
  names = [np.dtype(d).name for d in dtypes]
  floats = [name for name in names if name in _BASE_TOLERANCE]
  if not floats:
    if all(np.issubdtype(np.dtype(d), np.integer) for d in dtypes):
      return dict(rtol=0.0, atol=0.0)
    raise ValueError(f"no tolerance for dtypes {names}")
  rtol, atol = max(_BASE_TOLERANCE[name] for name in floats)
  return dict(rtol=rtol, atol=atol * math.sqrt(max(k, 1)) * float(scale))


# Unit roundoff (half an ulp of 1) by dtype.
_UNIT_ROUNDOFF = {"float64": 2.0**-53, "float32": 2.0**-24, "float16": 2.0**-11,
                  "bfloat16": 2.0**-8}
# The roundings an entry of a gmm's gradient goes through besides its sums, each in the
# least precise dtype involved: the cotangent's cast to the result's dtype, the saved
# pre-activation, the activation's derivative (a few ulps), a dequantized or gated
# operand, the product with a row weight, the cotangent before its gmm, the result.
ROUNDINGS = 8


def rounding_bound(magnitude, *dtypes, length: int) -> np.ndarray:
  """The most a value computed in `dtypes` may differ from its float64 oracle, per entry.

  A forward error bound, not a fitted tolerance: a sum of n terms in floating point is off
  by at most ``n u sum|terms|`` (u the unit roundoff; Higham, "Accuracy and Stability of
  Numerical Algorithms", 3.1), and each rounding of a factor by u of its magnitude. So an
  entry that goes through `length` f32 additions (the pre-activation's contraction, then
  its gradient's) and `ROUNDINGS` roundings in the least precise of `dtypes` is within
  ``(ROUNDINGS u_dtype + length u_f32) * magnitude``, to first order, where `magnitude`
  is its float64 sum of |terms| (``gmm_oracle_vjp(..., bound=True)``, `rows_oracle_vjp`).
  For f32 that is (8 + length) half-ulps of the magnitude (about 1e-6 of it for the tests'
  shapes): a relative error of 1e-4 in a gradient is far outside it.

  Args:
    magnitude: float64 sums of |terms|, one per entry.
    *dtypes: every float dtype the value is computed from or rounded to.
    length: the longest chain of additions an entry goes through.
  """
  names = [np.dtype(d).name for d in dtypes]
  unknown = [name for name in names if name not in _UNIT_ROUNDOFF]
  if unknown or not names:
    raise ValueError(f"no unit roundoff for dtypes {names}")
  low = max(_UNIT_ROUNDOFF[name] for name in names)
  accumulation = _UNIT_ROUNDOFF["float64" if set(names) == {"float64"} else "float32"]
  return (ROUNDINGS * low + length * accumulation) * f64(magnitude)


def _rms(x) -> float:
  x = f64(x)
  return float(np.sqrt(np.mean(x * x))) if x.size else 0.0


# A grid wide and fine enough to reach the peaks of each activation's derivatives.
_GRID = np.linspace(-12.0, 12.0, 24001)


@functools.cache
def max_slope(activation) -> float:
  """max |activation'| over the reals (1 for none and relu; 1.13 for gelu), on `_GRID`."""
  if activation is None:
    return 1.0
  return float(np.abs(ACTIVATION_GRADS[activation](_GRID)).max())


@functools.cache
def max_curvature(activation) -> float:
  """max |activation''| over the reals (0 for none; 0.5 for silu), by differences of the
  derivative on `_GRID` (relu's jump at 0 reads as 1 / the grid's step)."""
  if activation is None:
    return 0.0
  return float(np.abs(np.gradient(ACTIVATION_GRADS[activation](_GRID), _GRID)).max())


def vjp_tolerances(dtype, lhs, rhs, sizes, group_type, cotangent, activation=None,
                   transpose_lhs=False, transpose_rhs=False) -> dict[str, dict[str, float]]:
  """`tolerances` for each gradient of a gmm computed in `dtype`, by name (lhs, rhs, bias).

  Each gradient is a sum of products (`gmm_oracle_vjp`): dlhs contracts N, drhs and dbias
  the rows of a group ("m") or all M rows ("k"). A product's typical magnitude is
  ``rms(cotangent) * max|activation'| * rms(other operand)``; with the sqrt(K) growth of
  `tolerances` this is the random-walk size of the rounding of the pre-activation, its
  gradient and the operands in `dtype`. Nothing here reads the result being checked.
  """
  lhs = f64(lhs).T if transpose_lhs else f64(lhs)
  n = np.shape(rhs)[-2] if transpose_rhs else np.shape(rhs)[-1]
  sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
  rows = max(sizes, default=0) if group_type == "m" else lhs.shape[0]
  dz = _rms(cotangent) * max_slope(activation)
  return {
      "lhs": tolerances(dtype, k=n, scale=dz * _rms(rhs)),
      "rhs": tolerances(dtype, k=rows, scale=dz * _rms(lhs)),
      "bias": tolerances(dtype, k=rows, scale=dz),
  }


def _halves(z):
  n = z.shape[-1] // 2
  return z[..., :n], z[..., n:]


# A gated activation of z = [gate, up] (halves of the last axis) is gate_fn(gate) * up,
# gate_fn one of `ACTIVATIONS`; gpt-oss's clamps the gate above at 7 and the up half to
# [-7, 7] plus 1: fast_gelu(min(gate, 7)) * (clip(up, -7, 7) + 1).
GATES: dict[str, tuple[str, bool]] = {  # name: (gate_fn, clamped)
    "swiglu": ("silu", False),
    "geglu": ("gelu", False),
    "geglu_tanh": ("gelu_tanh", False),
    "swiglu_clamped": ("fast_gelu", True),
}
_CLAMP = 7.0


def _gated(name: str) -> Callable[[np.ndarray], np.ndarray]:
  gate_fn, clamped = GATES[name]

  def fn(z):
    gate, up = _halves(z)
    if clamped:
      gate, up = np.minimum(gate, _CLAMP), np.clip(up, -_CLAMP, _CLAMP) + 1.0
    return ACTIVATIONS[gate_fn](gate) * up
  return fn


GATED: dict[str, Callable[[np.ndarray], np.ndarray]] = {name: _gated(name) for name in GATES}


def _gated_vjp(name: str, z, ct):
  gate_fn, clamped = GATES[name]
  gate, up = _halves(z)
  d_gate, d_up = ACTIVATION_GRADS[gate_fn](gate), np.ones_like(up)
  if clamped:
    d_gate = np.where(gate < _CLAMP, ACTIVATION_GRADS[gate_fn](np.minimum(gate, _CLAMP)), 0.0)
    d_up = (np.abs(up) < _CLAMP).astype(np.float64)
    gate, up = np.minimum(gate, _CLAMP), np.clip(up, -_CLAMP, _CLAMP) + 1.0
  return np.concatenate([ct * up * d_gate, ct * ACTIVATIONS[gate_fn](gate) * d_up], axis=-1)


def activation_bound(activation, a, ct=None):
  """Envelopes of an activation and of its pre-activation's cotangent, for rounding bounds.

  Args:
    activation: None, a name of `ACTIVATION_GRADS` or of `GATES`.
    a: float64 >= |z|, each pre-activation entry's sum of |terms|.
    ct: float64 >= |the cotangent of activation(z)|, or None.

  Returns:
    float64 ``(value, dz)`` shaped as activation(z) and z (dz None without ct): if z is off
    by at most eps * a, the cotangent by eps * ct and the evaluation by a few ulps, the
    computed activation(z) and z's cotangent are off by O(eps) * value and O(eps) * dz, to
    first order. With s = `max_slope` and c = `max_curvature` of the elementwise function
    (0 at 0, as every one here): ``|act(z)| <= s a``, and ``ct act'(z)`` moves by ``ct (s
    ulps + c eps a)``; each half of a gated one's moves with both halves (``|up| <=
    a_up``, + 1 clamped), hence the 2s. Smooth where the drawn pre-activations lie
    (|z| < 3, far from the clamp at 7).
  """
  if activation is None:
    return a, ct
  if activation not in GATES:
    slope, curvature = max_slope(activation), max_curvature(activation)
    return slope * a, None if ct is None else ct * (slope + curvature * a)
  gate_fn, clamped = GATES[activation]
  slope, curvature = max_slope(gate_fn), max_curvature(gate_fn)
  a_gate, a_up = _halves(a)
  up = a_up + (1.0 if clamped else 0.0)
  value = 2 * slope * a_gate * up
  if ct is None:
    return value, None
  return value, np.concatenate([2 * ct * up * (slope + curvature * a_gate),
                                ct * slope * a_gate], axis=-1)


def activation_rules(activation, bound: bool = False):
  """``(forward, vjp)`` of an activation (None, a name of `ACTIVATION_GRADS` or `GATES`) on
  float64 arrays: ``forward(z)`` and ``vjp(z, ct)``, the cotangent of z for the cotangent
  ct of forward(z) (a gated one's: ``[..., N] -> [..., 2N]``). With `bound`, the
  envelopes of `activation_bound` (z and ct then being sums of |terms|)."""
  if bound:
    return (lambda a: activation_bound(activation, a)[0],
            lambda a, ct: activation_bound(activation, a, ct)[1])
  if activation is None:
    return (lambda z: z), (lambda z, ct: ct)
  if activation in GATES:
    return GATED[activation], functools.partial(_gated_vjp, activation)
  return ACTIVATIONS[activation], lambda z, ct: ct * ACTIVATION_GRADS[activation](z)


def _operands(bound: bool, *arrays):
  """The arrays in float64; with `bound`, their absolute values (`activation_rules`)."""
  return tuple(np.abs(f64(x)) if bound else f64(x) for x in arrays)


def rows_oracle(lhs, rhs, sizes, *, lhs_indices=None, row_weights=None, out_indices=None,
                out_rows=None, bias=None, activation=None, group_offset=0,
                num_local=None) -> np.ndarray:
  """float64 m-grouped gmm with row operands, one row at a time.

  Row r of the grouped problem (R = len(lhs_indices), else lhs's rows) reads
  ``lhs[lhs_indices[r]]`` (a zero row when out of range), belongs to the group its
  position falls in (`sizes`), is multiplied by ``rhs[g]``, gets ``bias[g]``, the
  activation (plain or gated: ``GATED``) and ``row_weights[r]``, and is written to row
  ``out_indices[r]`` of an ``[out_rows, N]`` result (nothing when out of range), or row r.
  Rows of no local group write nothing.
  """
  lhs, rhs = f64(lhs), f64(rhs)
  sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
  num_local = rhs.shape[0] if num_local is None else num_local
  num_rows = len(lhs_indices) if lhs_indices is not None else lhs.shape[0]
  act = GATED.get(activation) if isinstance(activation, str) else None
  if act is None:
    act = resolve(activation)
  n = rhs.shape[-1] // 2 if activation in GATED else rhs.shape[-1]
  result_rows = num_rows if out_indices is None else (
      num_rows if out_rows is None else out_rows)
  out = np.zeros((result_rows, n))
  group_of = np.full(num_rows, -1)
  start = 0
  for g, size in enumerate(sizes):
    end = min(start + size, num_rows)
    if 0 <= g - group_offset < num_local:
      group_of[start:end] = g - group_offset
    start = end
  for r in range(num_rows):
    local = group_of[r]
    if local < 0:
      continue
    source = r if lhs_indices is None else int(lhs_indices[r])
    x = lhs[source] if 0 <= source < lhs.shape[0] else np.zeros(lhs.shape[1])
    z = x @ rhs[local]
    if bias is not None:
      z = z + f64(bias)[local]
    y = z if act is None else act(z)
    if row_weights is not None:
      y = y * float(row_weights[r])
    target = r if out_indices is None else int(out_indices[r])
    if 0 <= target < result_rows:
      out[target] = y
  return out


def rows_oracle_vjp(lhs, rhs, sizes, cotangent, *, lhs_indices=None, row_weights=None,
                    out_indices=None, bias=None, activation=None, group_offset=0,
                    num_local=None, bound=False) -> dict[str, np.ndarray]:
  """float64 gradients of `rows_oracle` at `cotangent` (its result's shape), one group of
  rows at a time.

  Row r of local group g reads ``x_r = lhs[lhs_indices[r]]`` and gets ``dy_r =
  cotangent[out_indices[r]]`` (0 out of range); with ``z_r = x_r @ rhs[g] + bias[g]`` and
  ``dz_r`` the cotangent of z_r for ``row_weights[r] * dy_r`` (`activation_rules`):
  ``d row_weights[r] = <activation(z_r), dy_r>``, ``drhs[g] += x_r^T dz_r``, ``dbias[g] +=
  dz_r`` and ``dlhs[lhs_indices[r]] += dz_r @ rhs[g]^T``. Rows of no local group add
  nothing.

  Args:
    The operands and options of `rows_oracle` (activation: None or a name of
    `ACTIVATION_GRADS` or `GATES`), `cotangent` of its result's shape, and `bound`: each
    entry's sum of |terms| instead of its value (the magnitude `rounding_bound` scales).

  Returns:
    float64 gradients by operand: "lhs", "rhs", and "bias" and "row_weights" where given.
  """
  lhs, rhs, cotangent = _operands(bound, lhs, rhs, cotangent)
  bias = None if bias is None else _operands(bound, bias)[0]
  weights = None if row_weights is None else _operands(bound, row_weights)[0]
  forward, vjp = activation_rules(activation, bound)
  sizes = [int(s) for s in np.asarray(sizes).reshape(-1)]
  num_local = rhs.shape[0] if num_local is None else num_local
  num_rows = len(lhs_indices) if lhs_indices is not None else lhs.shape[0]
  sources = np.arange(num_rows) if lhs_indices is None else np.asarray(lhs_indices, int)
  read = (sources >= 0) & (sources < lhs.shape[0])
  x = np.where(read[:, None], lhs[np.where(read, sources, 0)], 0.0)
  targets = np.arange(num_rows) if out_indices is None else np.asarray(out_indices, int)
  written = (targets >= 0) & (targets < cotangent.shape[0])
  dy = np.where(written[:, None], cotangent[np.where(written, targets, 0)], 0.0)
  grads = {"lhs": np.zeros_like(lhs), "rhs": np.zeros_like(rhs)}
  if bias is not None:
    grads["bias"] = np.zeros_like(bias)
  if weights is not None:
    grads["row_weights"] = np.zeros(num_rows)
  dx = np.zeros_like(x)
  start = 0
  for g, size in enumerate(sizes):
    rows = slice(start, min(start + size, num_rows))
    start = rows.stop
    local = g - group_offset
    if not 0 <= local < num_local:
      continue
    z = x[rows] @ rhs[local] + (0.0 if bias is None else bias[local])
    ct = dy[rows]
    if weights is not None:
      grads["row_weights"][rows] = np.sum(forward(z) * ct, axis=1)
      ct = ct * weights[rows, None]
    dz = vjp(z, ct)
    grads["rhs"][local] = x[rows].T @ dz
    dx[rows] = dz @ rhs[local].T
    if bias is not None:
      grads["bias"][local] = dz.sum(axis=0)
  np.add.at(grads["lhs"], sources[read], dx[read])
  return grads
