"""The jvp of the gmm primitive. Linear in (lhs, rhs, bias) without an activation: the
tangent is a sum of gmms. With an activation (or varying row weights) one gmm gives the
pre-activation (named `PREACTIVATION` for checkpoint policies) and the activation's own
jvp follows, rematerialized; the finishing step (`epilogue.finish`) masks, weights and
scatters every result the same way.

Floor 2 (the op package).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name
from jax.interpreters import ad

from gmm_jax._src.core.config import GmmConfig, is_gated, saved_preactivation_dtype
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, finish, resolve_activation
from gmm_jax._src.op.gated_tangent import gated_f32
from gmm_jax._src.op.primitive import (PREACTIVATION, PRIMITIVES, as_float, composed, gmm,
                                       grouped_rows, row_ids, row_operands, unpack)
from gmm_jax._src.op.prologue_tangent import prologue_tangent
from gmm_jax._src.core.qarray import QArray, dequantize


def _is_zero(tangent) -> bool:
  return type(tangent) is ad.Zero


def _has_tangent(tangent) -> bool:
  return not all(_is_zero(t) for t in jax.tree.leaves(tangent, is_leaf=_is_zero))


def _dequantized_tangent(q: QArray, tangent) -> jax.Array:
  """The tangent of ``dequantize(q)`` (f32) for tangents of q's leaves."""
  leaves, tree = jax.tree.flatten(q)
  tangents = [ad.instantiate_zeros(t) for t in jax.tree.leaves(tangent, is_leaf=_is_zero)]
  return jax.jvp(lambda *xs: dequantize(jax.tree.unflatten(tree, xs)), leaves, tangents)[1]


def _bias_tangent(t_bias, lhs, counts, group_offset, cfg: GmmConfig, out_shape,
                  rows: Rows):
  """The bias tangent as it enters the (linear) result: the finishing step of a zero
  pre-activation with that bias (each row its group's, rows of no local group 0, row
  weights and scatter as `cfg` says)."""
  if cfg.group_type == "k":
    return finish(jnp.zeros(out_shape, jnp.float32), None, cfg.out_dtype, bias=t_bias)
  num_rows = grouped_rows(cfg, lhs)
  return finish(jnp.zeros((num_rows, t_bias.shape[-1]), jnp.float32), None, cfg.out_dtype,
                row_ids=row_ids(counts, group_offset, cfg, num_rows), bias=t_bias,
                row_weights=rows.row_weights if cfg.row_weights else None,
                out_indices=rows.out_indices if cfg.out_rows is not None else None,
                out_rows=cfg.out_rows)


def _tangent(lhs, rhs, counts, group_offset, tangents, cfg: GmmConfig, out_shape, out_hint,
             rows: Rows = NO_ROWS):
  """The linear part: gmm(dlhs, rhs) + gmm(lhs, drhs) + bias(dbias), or None when every
  tangent is zero. `cfg` has no activation; its out_dtype is the tangent's dtype; its row
  operations (gather, constant row weights, scatter) apply to every term."""
  t_lhs, t_rhs, t_bias = tangents
  terms = []
  if (cfg.lhs_activation is not None and not isinstance(rhs, QArray)
      and _has_tangent(t_lhs) and _has_tangent(t_rhs)):
    # A gated prologue along z and w: one linear op, whose transpose orders the weight
    # gradient before the dlhs gmm that writes z's cotangent (`prologue_tangent`).
    terms.append(prologue_tangent(ad.instantiate_zeros(t_lhs), ad.instantiate_zeros(t_rhs),
                                  lhs, rhs, counts, group_offset, cfg, out_hint, rows))
    t_lhs = t_rhs = None
  if _has_tangent(t_lhs):
    if isinstance(lhs, QArray):
      terms.append(gmm(_dequantized_tangent(lhs, t_lhs), as_float(rhs), counts,
                       group_offset, None, cfg, out_hint, rows))
    elif cfg.lhs_activation is not None:
      # A gated prologue: the product reads act(z) (z = lhs); its tangent gmm reads the
      # activation's tangent along t_lhs, with z as the source (transposed, the dlhs gmm
      # writes the [M, 2K] cotangent of z in its epilogue).
      terms.append(gmm(ad.instantiate_zeros(t_lhs), rhs, counts, group_offset, None,
                       cfg.replace(lhs_tangent=True), out_hint, rows._replace(source=lhs)))
    else:
      terms.append(gmm(ad.instantiate_zeros(t_lhs), rhs, counts, group_offset, None, cfg,
                       out_hint, rows))
  if _has_tangent(t_rhs):
    if isinstance(rhs, QArray):
      t_rhs = _dequantized_tangent(rhs, t_rhs)
    terms.append(gmm(as_float(lhs), ad.instantiate_zeros(t_rhs), counts, group_offset, None,
                     cfg, out_hint, rows))
  if t_bias is not None and not _is_zero(t_bias):
    terms.append(_bias_tangent(t_bias, lhs, counts, group_offset, cfg, out_shape, rows))
  if not terms:
    return None
  return functools.reduce(jnp.add, [t.astype(cfg.out_dtype) for t in terms])


def _value_dtype(x):
  return np.dtype(jnp.float32) if isinstance(x, QArray) else np.dtype(x.dtype)


def _preactivation_dtype(lhs, rhs, cfg):
  return saved_preactivation_dtype(_value_dtype(lhs), _value_dtype(rhs), cfg.out_dtype)


def _widen(z):
  """A 16-bit pre-activation in f32 (the activation runs in f32 either way)."""
  return z.astype(jnp.float32) if jnp.dtype(z.dtype).itemsize < 4 else z


def _in_f32(fn):
  return lambda z: fn(_widen(z))


def _activation_jvp(activation, z, dz):
  """(activation(z), its tangent along dz), in f32 (a 16-bit z widened). Rematerialized:
  the backward keeps z alone and recomputes the activation's derivative (elementwise)
  instead of keeping its intermediates (two or three arrays like z). A gated activation's
  tangent is one op (`gated_tangent`) whose transpose writes the ``[R, 2N]``
  cotangent in one elementwise pass from z and the result's cotangent."""
  fn = (functools.partial(gated_f32, activation) if is_gated(activation)
        else _in_f32(resolve_activation(activation)))
  return jax.jvp(jax.checkpoint(fn), (z,), (dz,))


def _jvp_composed(primals, tangents, *, cfg, trees, has_bias, out_hint):
  fn = functools.partial(composed, cfg=cfg, trees=trees, has_bias=has_bias,
                         out_hint=out_hint)
  return jax.jvp(fn, tuple(primals), tuple(ad.instantiate_zeros(t) for t in tangents))


def _jvp(primals, tangents, *, cfg, trees, has_bias, out_hint):
  if cfg.has_source:
    return _jvp_composed(primals, tangents, cfg=cfg, trees=trees, has_bias=has_bias,
                         out_hint=out_hint)
  if cfg.has_rows:
    return _jvp_rows(primals, tangents, cfg=cfg, trees=trees, has_bias=has_bias,
                     out_hint=out_hint)
  lhs, rhs, counts, group_offset, bias = unpack(primals, trees, has_bias)
  t_lhs, t_rhs, _, _, t_bias = unpack(tangents, trees, has_bias)
  if cfg.activation is None:
    linear_cfg = cfg
    out = gmm(lhs, rhs, counts, group_offset, bias, cfg, out_hint)
    z = None
  else:
    # The pre-activation, for the activation's derivative.
    linear_cfg = cfg.replace(activation=None, out_dtype=_preactivation_dtype(lhs, rhs, cfg))
    z = checkpoint_name(gmm(lhs, rhs, counts, group_offset, bias, linear_cfg, out_hint),
                        PREACTIVATION)
    out = finish(z, cfg.activation, cfg.out_dtype,
                 row_ids=row_ids(counts, group_offset, cfg, z.shape[0]))
  zero = ad.Zero(jax.typeof(out).to_tangent_aval())
  if not jnp.issubdtype(cfg.out_dtype, jnp.inexact):
    return out, zero
  dz = _tangent(lhs, rhs, counts, group_offset, (t_lhs, t_rhs, t_bias), linear_cfg,
                out.shape if z is None else z.shape, out_hint)
  if dz is None:
    return out, zero
  if z is None:
    return out, dz
  _, dy = _activation_jvp(cfg.activation, z, dz)
  return out, finish(dy, None, cfg.out_dtype,
                     row_ids=row_ids(counts, group_offset, cfg, z.shape[0]))


def _jvp_rows(primals, tangents, *, cfg, trees, has_bias, out_hint):
  """The jvp of an m-grouped gmm with row operands. Without an activation and with
  constant row weights it is linear: the tangent gmms carry the same row operations.
  Otherwise the pre-activation z (dtype: `saved_preactivation_dtype`) of the R grouped
  rows (gathered, not weighted or scattered) is one gmm; the activation (in f32), the
  weights (their tangent times the activation) and the scatter follow in jnp."""
  lhs, rhs, counts, group_offset, bias = unpack(primals, trees, has_bias)
  t_lhs, t_rhs, _, _, t_bias = unpack(tangents, trees, has_bias)
  rows = row_operands(primals, trees, has_bias, cfg)
  t_weights = row_operands(tangents, trees, has_bias, cfg).row_weights
  weights_vary = t_weights is not None and not _is_zero(t_weights)
  float_out = jnp.issubdtype(cfg.out_dtype, jnp.inexact)
  if cfg.activation is None and not weights_vary:
    out = gmm(lhs, rhs, counts, group_offset, bias, cfg, out_hint, rows)
    dy = None
    if float_out:
      dy = _tangent(lhs, rhs, counts, group_offset, (t_lhs, t_rhs, t_bias), cfg, out.shape,
                    out_hint, rows)
    return out, (ad.Zero(jax.typeof(out).to_tangent_aval()) if dy is None else dy)
  gathered = Rows(rows.lhs_indices, None, None)
  linear_cfg = cfg.replace(activation=None, row_weights=False, out_rows=None,
                           out_dtype=_preactivation_dtype(lhs, rhs, cfg))
  z = checkpoint_name(gmm(lhs, rhs, counts, group_offset, bias, linear_cfg, out_hint, gathered),
                      PREACTIVATION)  # [R, N]
  ids = row_ids(counts, group_offset, cfg, z.shape[0])
  scatter = dict(out_indices=rows.out_indices if cfg.out_rows is not None else None,
                 out_rows=cfg.out_rows)
  dz = None
  if float_out:
    dz = _tangent(lhs, rhs, counts, group_offset, (t_lhs, t_rhs, t_bias), linear_cfg, z.shape,
                  out_hint, gathered)
  fn = resolve_activation(cfg.activation)
  if fn is None:
    a, da = _widen(z), None if dz is None else _widen(dz)
  elif dz is None:
    a, da = fn(_widen(z)), None
  else:
    a, da = _activation_jvp(cfg.activation, z, dz)
  weights = rows.row_weights if cfg.row_weights else None
  out = finish(a, None, cfg.out_dtype, row_ids=ids, row_weights=weights, **scatter)
  if not float_out or (da is None and not weights_vary):
    return out, ad.Zero(jax.typeof(out).to_tangent_aval())
  dy = jnp.zeros(a.shape, a.dtype) if da is None else da
  if weights is not None:
    dy = dy * weights.astype(dy.dtype)[:, None]
  if weights_vary:
    dy = dy + a * t_weights.astype(a.dtype)[:, None]
  return out, finish(dy, None, cfg.out_dtype, row_ids=ids, **scatter)


for _prim in PRIMITIVES:
  ad.primitive_jvps[_prim] = _jvp

