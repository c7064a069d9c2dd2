"""gmm with quantized operands, composed above the one differentiable op.

Floor 3. A quantized call is decided here once, then goes down to the op (never back up):
  * If an implementation of the call's platform serves the mode for these operands (the
    Pallas kernels dequantize in-kernel), the op gets the QArrays themselves.
  * Otherwise the mode is composed from float/int gmms and elementwise work:
      weight_only  x @ dequantize(W)                        (the activations' dtype)
      scaled       exact product of the values (int32 for integers), times both scales
      blocked      dequantized operands multiplied in f32 (= the sum over K blocks of the
                   block products times both block scales)
then the activation, the output scale and offset (requantization) and the cast.

Derivatives: the op's rules differentiate QArray operands through `dequantize` (their
integer values get none). Dynamic quantization (`quantize_lhs`/`quantize_rhs`) is the one
place whose backward is deliberately not the derivative: a `jax.custom_vjp` gives the float
operands the straight-through estimate (the float gmm's gradient at the dequantized
operands) instead of the zero derivative of rounding.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.tiling import chips
from gmm_jax._src.backends import registry
from gmm_jax._src.core import metadata
from gmm_jax._src import op
from gmm_jax._src.core.config import PLATFORMS, GmmConfig, problem_dims
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, finish, gated_cotangent, per_group
from gmm_jax._src.core.qarray import (QArray, is_integer_dtype, QuantSpec, as_qarray,
                                        broadcast_scale, compute_dtype, dequantize, quant_mode)

_F32 = np.dtype(jnp.float32)


def _row_scale(q: QArray, cfg: GmmConfig, m: int) -> jax.Array:
  """lhs scale as ``[M, 1]`` (or ``[1, 1]``), f32; K is constant (scaled mode)."""
  scale = q.scale.astype(jnp.float32)
  scale = scale.T if cfg.transpose_lhs else scale  # [M or 1, 1]
  return broadcast_scale(scale, (m, 1), (q.tile[1], 1) if cfg.transpose_lhs else
                         (q.tile[0], 1))


def _col_scale(q: QArray, cfg: GmmConfig, n: int) -> jax.Array:
  """rhs scale as ``[L or 1, 1, N or 1]`` (m) / ``[1, N or 1]`` (k), f32; K constant."""
  scale = q.scale.astype(jnp.float32)
  tile = q.tile
  if cfg.transpose_rhs:
    scale = jnp.swapaxes(scale, -1, -2)
    tile = tile[:-2] + (tile[-1], tile[-2])
  shape = scale.shape[:-1] + (n,)
  return broadcast_scale(scale, shape, tile[:-1] + (tile[-1],))


def _values(q: QArray, dtype) -> jax.Array:
  """The quantized values ready for an exact product: zero point subtracted (int32 then)."""
  if q.zero_point is None:
    return q.qvalue.astype(dtype)
  return (q.qvalue.astype(jnp.int32)
          - broadcast_scale(q.zero_point.astype(jnp.int32), q.shape, q.tile))


def _per_row(values, counts, group_offset, cfg: GmmConfig, m: int) -> jax.Array:
  """``[L, C]`` per-group values as each of the M rows meets them (`epilogue.per_group`)."""
  return per_group(values, metadata.row_group_ids(counts, m, group_offset, cfg.num_local), 2)


def finish_quantized(z, counts, group_offset, cfg: GmmConfig, output_scale=None,
                     output_offset=None, cast: bool = True, bias=None):
  """f32 pre-activation -> the finishing step (`epilogue.finish`): a float bias, the
  activation, output scale/offset, rounding, cast; rows outside the local groups
  (m-grouping) exactly 0. ``cast=False`` stops before the rounding/cast."""
  row_ids = None
  if cfg.group_type == "m":
    row_ids = metadata.row_group_ids(counts, z.shape[0], group_offset, cfg.num_local)
  return finish(z, cfg.activation, cfg.out_dtype if cast else z.dtype, row_ids=row_ids,
                bias=bias, output_scale=output_scale, output_offset=output_offset)


def gmm_quantized(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, output_scale=None,
                  output_offset=None, rows: Rows = NO_ROWS):
  """gmm with QArray operands (canonical layout otherwise; see `GmmConfig`).

  On each platform: the QArrays go to the op when an implementation there serves the mode
  (in-kernel dequantization), else the mode is composed (see the module docstring). The
  platform is the one the program is lowered for (or ``cfg.platform``).

  Args:
    output_scale, output_offset: None or f32 ``[L, N]`` (already broadcast).
    rows: row operands (weight-only mode without requantization only: the api checks).
  """
  if cfg.cotangent_of is not None:
    return _cotangent(lhs, rhs, counts, group_offset, bias, cfg, rows)
  if cfg.quantize_prologue is not None:
    return _quantized_prologue(lhs, rhs, counts, group_offset, bias, cfg)
  if cfg.has_rows:
    if quant_mode(lhs, rhs, cfg) != "weight_only" or output_scale is not None or (
        output_offset is not None):
      raise NotImplementedError("row operands (lhs_indices, row_weights, out_indices) with "
                                "quantized operands: supported for weight-only rhs without "
                                "output_scale/output_offset")
    platforms = (cfg.platform,) if cfg.platform is not None else PLATFORMS
    if all(registry.serves(lhs, rhs, cfg, p) for p in platforms):
      return op.gmm(lhs, rhs, counts, group_offset, bias, cfg, rows=rows)
    float_dtype = lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else jnp.float32
    return op.gmm(lhs, dequantize(rhs, float_dtype), counts, group_offset, bias, cfg,
                  rows=rows)
  int_bias = bias is not None and is_integer_dtype(bias.dtype)

  def decide(platform):  # (a kernel serves it, integer values multiplied in bf16)
    # A TPU without an int8 MXU path (TPU7x) multiplies integer values in bf16 (exact).
    return (not int_bias and registry.serves(lhs, rhs, cfg, platform),
            platform == "tpu" and not chips.int8_mxu())

  def one(plan, *args):
    kernel, bf16_values = plan
    if kernel:
      return _in_kernel(*args, cfg)
    return _composed(*args, cfg, bf16_values=bf16_values)

  return _by_platform(cfg, decide, one,
                      (lhs, rhs, counts, group_offset, bias, output_scale, output_offset))


def explicit_sharding(x):
  """x's sharding when it lies on explicit mesh axes (a value computed for it, such as its
  cotangent, must then have it too), else None."""
  sharding = getattr(jax.typeof(x), "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if mesh is None or mesh.empty or not any(
      t == jax.sharding.AxisType.Explicit for t in getattr(mesh, "axis_types", ())):
    return None
  return sharding


def reshard_like(x, sharding):
  """x resharded to `sharding` (`explicit_sharding` of another value), or x for None."""
  return x if sharding is None else jax.sharding.reshard(x, sharding)


def _by_platform(cfg: GmmConfig, decide, run, operands: tuple):
  """``run(decide(platform), *operands)`` for the platform the call is lowered for: once
  when every platform it may lower for decides the same (no per-platform branch), else
  through `registry.on_lowering_platform`."""
  platforms = (cfg.platform,) if cfg.platform is not None else PLATFORMS
  plan = {p: decide(p) for p in platforms}
  if len(set(plan.values())) == 1:
    return run(plan[platforms[0]], *operands)
  return registry.on_lowering_platform(lambda p, *args: run(plan[p], *args), None,
                                       *operands)


def _cotangent(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, rows: Rows):
  """A gated-cotangent epilogue (`GmmConfig.cotangent_of`, z in ``rows.source``) on a
  quantized product (fp8 training's dlhs gmm): on each platform the op's where an
  implementation there serves the mode (it writes z's cotangent from its epilogue, or the
  dispatcher applies `epilogue.gated_cotangent` around it), else applied to the product
  the mode's composition gives, rounded to out_dtype first as the kernels round theirs."""
  if (cfg.gather_rows is not None or cfg.row_weights or cfg.out_rows is not None
      or cfg.lhs_tangent):
    raise NotImplementedError("a gated-cotangent epilogue of a quantized gmm reads no other "
                              "row operand (lhs_indices, row_weights, out_indices)")
  like_source = explicit_sharding(rows.source)

  def one(served, lhs, rhs, counts, group_offset, bias, source):
    if served:
      out = op.gmm(lhs, rhs, counts, group_offset, bias, cfg, rows=Rows(source=source))
    else:
      y = gmm_quantized(lhs, rhs, counts, group_offset, bias, cfg.replace(cotangent_of=None))
      out = gated_cotangent(cfg.cotangent_of, source, y, cfg.out_dtype)
    # z's cotangent in z's layout on explicit mesh axes: every platform's branch the same.
    return reshard_like(out, like_source)

  return _by_platform(cfg, lambda p: registry.serves(lhs, rhs, cfg, p), one,
                      (lhs, rhs, counts, group_offset, bias, rows.source))


def _quantized_prologue(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig):
  """A gated prologue whose act(z) is quantized in blocks along K
  (`GmmConfig.quantize_prologue`, fp8 training's forward) on a "blocked" rhs: on each
  platform the op's where an implementation there quantizes it in its prologue, else the
  blocked gmm of `registry.quantized_prologue_input` (act(z) formed and quantized first)."""
  def one(served, lhs, rhs, counts, group_offset, bias):
    if served:
      return op.gmm(lhs, rhs, counts, group_offset, bias, cfg)
    return gmm_quantized(registry.quantized_prologue_input(cfg, lhs), rhs, counts,
                         group_offset, bias,
                         cfg.replace(lhs_activation=None, quantize_prologue=None))

  return _by_platform(cfg, lambda p: registry.serves(lhs, rhs, cfg, p), one,
                      (lhs, rhs, counts, group_offset, bias))


def _in_kernel(lhs, rhs, counts, group_offset, bias, output_scale, output_offset,
               cfg: GmmConfig):
  """The QArrays handed to the op (an implementation dequantizes them in-kernel); for
  requantization it leaves the activation and output scale to the f32 epilogue here."""
  if output_scale is None and output_offset is None and not is_integer_dtype(cfg.out_dtype):
    return op.gmm(lhs, rhs, counts, group_offset, bias, cfg)
  z = op.gmm(lhs, rhs, counts, group_offset, bias, cfg.replace(activation=None, out_dtype=_F32))
  return finish_quantized(z, counts, group_offset, cfg, output_scale, output_offset)


def _composed(lhs, rhs, counts, group_offset, bias, output_scale, output_offset,
              cfg: GmmConfig, bf16_values: bool = False):
  """The quantized mode composed from float/int gmms and elementwise work. `bf16_values`:
  integer x integer values are multiplied as bf16 (every 8- and 4-bit integer, and their
  differences with a zero point, are exact in bf16) with f32 sums, for a chip without an
  int8 MXU path (TPU7x); the sums are exact up to 2**24 (K * 127 * 127 below it)."""
  mode = quant_mode(lhs, rhs, cfg)
  m, _, n = problem_dims(lhs.shape, rhs.shape, cfg)
  int_bias = bias is not None and is_integer_dtype(bias.dtype)
  direct = output_scale is None and output_offset is None and not is_integer_dtype(cfg.out_dtype)
  if mode == "weight_only":
    if int_bias:
      raise NotImplementedError("an int32 bias needs integer operands (scaled mode); "
                                "weight_only takes a float bias")
    float_dtype = lhs.dtype if jnp.issubdtype(lhs.dtype, jnp.floating) else jnp.float32
    weights = dequantize(rhs, float_dtype)
    if direct:
      return op.gmm(lhs, weights, counts, group_offset, bias, cfg)
    z = op.gmm(lhs, weights, counts, group_offset, bias,
               cfg.replace(activation=None, out_dtype=_F32))
    return finish_quantized(z, counts, group_offset, cfg, output_scale, output_offset)

  if mode == "blocked":
    if int_bias:
      raise NotImplementedError(
          "an int32 bias is added before the scales, so it needs scales constant along K "
          "(scaled mode); blocked scales take a float bias")
    z = op.gmm(dequantize(lhs), dequantize(rhs), counts, group_offset, bias,
               cfg.replace(activation=None, out_dtype=_F32))
    return finish_quantized(z, counts, group_offset, cfg, output_scale, output_offset)

  # scaled: exact product of the values, then lhs row scale x rhs (group, column) scale.
  integer = is_integer_dtype(lhs.qtype) and is_integer_dtype(rhs.qtype)
  if not integer and (is_integer_dtype(lhs.qtype) or is_integer_dtype(rhs.qtype)):
    raise NotImplementedError(
        f"mixed integer and float quantized values ({lhs.qtype} x {rhs.qtype}); supported: "
        "both integer (int8/int4) or both float (fp8/fp4)")
  if int_bias and not integer:
    raise NotImplementedError("an int32 bias needs integer quantized values")
  value_dtype = np.promote_types(compute_dtype(lhs), compute_dtype(rhs))
  acc_dtype = np.dtype(jnp.int32) if integer else _F32
  in_bf16 = integer and bf16_values
  if in_bf16:
    value_dtype, acc_dtype = np.dtype(jnp.bfloat16), _F32
  cast = (lambda v: v.astype(jnp.bfloat16)) if in_bf16 else (lambda v: v)  # noqa: E731
  acc = op.gmm(cast(_values(lhs, value_dtype)), cast(_values(rhs, value_dtype)), counts,
               group_offset,
               bias if int_bias and not in_bf16 else None,
               cfg.replace(activation=None, out_dtype=acc_dtype))
  z = acc.astype(_F32)
  if int_bias and in_bf16:  # in accumulator units, before the scales
    int_term = bias.astype(_F32)
    z = z + (_per_row(int_term, counts, group_offset, cfg, m) if cfg.group_type == "m"
             else int_term[:, None, :])
  row = _row_scale(lhs, cfg, m)  # [M, 1]
  col = _col_scale(rhs, cfg, n)  # m: [L or 1, 1, N or 1]; k: [1, N or 1]
  if cfg.group_type == "m":
    col = jnp.broadcast_to(col, (cfg.num_local, 1, col.shape[-1]))[:, 0, :]
    z = z * row * _per_row(col, counts, group_offset, cfg, m)
  else:
    z = z * row[None] * col[None]
  # A float bias is in output units: the finishing step adds it after the scales.
  float_bias = None if (bias is None or int_bias) else bias.astype(_F32)
  return finish_quantized(z, counts, group_offset, cfg, output_scale, output_offset,
                          bias=float_bias)


def gmm_any(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig):
  """One gmm on canonical operands, quantized (QArrays) or not."""
  if isinstance(lhs, QArray) or isinstance(rhs, QArray):
    return gmm_quantized(lhs, rhs, counts, group_offset, bias, cfg)
  return op.gmm(lhs, rhs, counts, group_offset, bias, cfg)


# ------------------------------------------------------------- dynamic quantization (STE)


def _bias_term(bias, lhs_q, rhs_q, counts, group_offset, cfg: GmmConfig, m: int, n: int):
  """The bias as the quantized formula adds it to the f32 pre-activation (an int32 bias is
  in accumulator units: times both scales)."""
  value = bias.astype(jnp.float32)
  if is_integer_dtype(bias.dtype):
    row = _row_scale(lhs_q, cfg, m) if isinstance(lhs_q, QArray) else 1.0
    col = _col_scale(rhs_q, cfg, n) if isinstance(rhs_q, QArray) else 1.0
    row, col = jax.lax.stop_gradient(row), jax.lax.stop_gradient(col)
    if cfg.group_type == "m":
      col = jnp.broadcast_to(col, (cfg.num_local, 1, n))[:, 0, :]
      return _per_row(value * col, counts, group_offset, cfg, m) * row
    return value[:, None, :] * row[None] * col[None]
  if cfg.group_type == "m":
    return _per_row(value, counts, group_offset, cfg, m)
  return value[:, None, :]


def _quantize(spec: QuantSpec | None, x):
  if spec is not None:
    return spec(x)
  return as_qarray(x) or x


def _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                     output_offset):
  cfg, lhs_spec, rhs_spec = static
  return gmm_quantized(_quantize(lhs_spec, lhs), _quantize(rhs_spec, rhs), counts,
                       group_offset, bias, cfg, output_scale, output_offset)


def _float0(x):
  return np.zeros(np.shape(x), jax.dtypes.float0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ste_gmm(static, lhs, rhs, bias, counts, group_offset, output_scale, output_offset):
  return _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                          output_offset)


def _ste_forward(static, lhs, rhs, bias, counts, group_offset, output_scale, output_offset):
  out = _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                         output_offset)
  return out, (lhs, rhs, bias, counts, group_offset, output_scale, output_offset)


def _ste_backward(static, residuals, cotangent):
  cfg, lhs_spec, rhs_spec = static
  lhs, rhs, bias, counts, group_offset, output_scale, output_offset = residuals
  lhs_q, rhs_q = _quantize(lhs_spec, lhs), _quantize(rhs_spec, rhs)
  m, _, n = problem_dims(lhs.shape, rhs.shape, cfg)
  # Straight-through: the float gmm's gradient, taken at the dequantized operands, is
  # passed to the float inputs as if quantization were the identity.
  at_lhs = dequantize(lhs_q) if isinstance(lhs_q, QArray) else lhs
  at_rhs = dequantize(rhs_q) if isinstance(rhs_q, QArray) else rhs
  float_bias = bias if bias is not None and not is_integer_dtype(bias.dtype) else None

  def surrogate(a, b, fb, scale, offset):
    z = op.gmm(a.astype(jnp.float32), b.astype(jnp.float32), counts, group_offset, None,
               cfg.replace(activation=None, out_dtype=_F32))
    if bias is not None:
      z = z + _bias_term(fb if fb is not None else bias, lhs_q, rhs_q, counts, group_offset,
                         cfg, m, n)
    return finish_quantized(z, counts, group_offset, cfg, scale, offset, cast=False)

  _, vjp = jax.vjp(surrogate, at_lhs, at_rhs, float_bias, output_scale, output_offset)
  d_lhs, d_rhs, d_bias, d_scale, d_offset = vjp(cotangent.astype(jnp.float32))

  def like(grad, x):
    if x is None:
      return None
    if isinstance(x, QArray):  # already quantized: no straight-through gradient
      return jax.tree.map(lambda leaf: jnp.zeros_like(leaf) if jnp.issubdtype(
          leaf.dtype, jnp.inexact) else _float0(leaf), x)
    if not jnp.issubdtype(x.dtype, jnp.inexact):
      return _float0(x)
    return grad.astype(x.dtype)

  return (like(d_lhs, lhs), like(d_rhs, rhs),
          None if bias is None else (like(d_bias, bias) if float_bias is not None
                                     else _float0(bias)),
          _float0(counts), _float0(group_offset), like(d_scale, output_scale),
          like(d_offset, output_offset))


_ste_gmm.defvjp(_ste_forward, _ste_backward)


def dynamic_gmm(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, lhs_spec, rhs_spec,
                straight_through: bool, output_scale=None, output_offset=None):
  """gmm that quantizes its float lhs and/or rhs itself (`QuantSpec`s), then runs the
  quantized mode they make. Gradients w.r.t. the float inputs: straight-through (the float
  gmm's gradient at the dequantized operands) or, without it, none (rounding has zero
  derivative)."""
  static = (cfg, lhs_spec, rhs_spec)
  if not straight_through or is_integer_dtype(cfg.out_dtype):
    lhs = jax.lax.stop_gradient(lhs) if lhs_spec is not None else lhs
    rhs = jax.lax.stop_gradient(rhs) if rhs_spec is not None else rhs
    return _dynamic_forward(static, lhs, rhs, bias, counts, group_offset, output_scale,
                            output_offset)
  return _ste_gmm(static, lhs, rhs, bias, counts, group_offset, output_scale, output_offset)
