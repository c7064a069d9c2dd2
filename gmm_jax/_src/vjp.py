"""The one VJP of gmm: every gradient is another forward gmm.

For m-grouping, y = act(z), z[rows of g] = lhs[rows of g] @ rhs[g] + bias[g]:
  dlhs = gmm_m(dz, rhs^T)                  (same group list, same group_offset)
  drhs[g] = lhs[rows of g]^T @ dz[rows]     = gmm_k over the rows
  dbias[g] = sum of dz over the rows of g
For k-grouping, out[g] = act(lhs[:, cols g] @ rhs[cols g] + bias[g]):
  dlhs^T = gmm_m(rhs, dz^T)                 (rows of rhs grouped like the columns of lhs)
  drhs = gmm_m(lhs^T, dz)
  dbias[g] = sum of dz[g] over M
So each backend implements forward kernels only; rows and groups that are not local get
zero gradient because the forward gmms never write them. Static options travel in the
frozen `GmmConfig`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src import dispatch, layout, quant
from gmm_jax._src.config import GmmConfig, accumulator_dtype
from gmm_jax._src.epilogue import resolve_activation


# Jitted so that eager calls reuse one compilation per (shapes, config) instead of tracing
# and compiling the work-item loops on every call; under an outer jit it is inlined. The
# platform is part of the cache key: the same config picks another kernel elsewhere.
_run_on = jax.jit(
    lambda lhs, rhs, counts, group_offset, bias, cfg, platform: dispatch.run(
        lhs, rhs, counts, group_offset, bias, cfg, platform=platform),
    static_argnums=(5, 6))


def _forward(lhs, rhs, counts, group_offset, bias, cfg):
  if dispatch.recording():  # explain(): trace afresh so that every dispatch is seen
    return dispatch.run(lhs, rhs, counts, group_offset, bias, cfg)
  return _run_on(lhs, rhs, counts, group_offset, bias, cfg, dispatch.current_platform())


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def gmm_core(cfg: GmmConfig, lhs, rhs, counts, group_offset, bias):
  """Differentiable gmm on canonical operands (see `GmmConfig`)."""
  return _forward(lhs, rhs, counts, group_offset, bias, cfg)


def _preactivation_dtype(lhs, rhs):
  acc = accumulator_dtype(lhs.dtype, rhs.dtype)
  return acc if jnp.issubdtype(acc, jnp.floating) else np.dtype(np.float32)


def _valid_rows(cfg, counts, group_offset, m):
  return layout.row_group_ids(counts, m, group_offset, cfg.num_local) >= 0


def _fwd(cfg, lhs, rhs, counts, group_offset, bias):
  if cfg.activation is None:
    out = _forward(lhs, rhs, counts, group_offset, bias, cfg)
    return out, (lhs, rhs, counts, group_offset, bias, None)
  # Keep the pre-activation (in f32) for the activation's derivative.
  z = _forward(lhs, rhs, counts, group_offset, bias,
               cfg.replace(activation=None, out_dtype=_preactivation_dtype(lhs, rhs)))
  out = resolve_activation(cfg.activation)(z)
  if cfg.group_type == "m":  # rows outside the local groups stay exactly 0
    out = jnp.where(_valid_rows(cfg, counts, group_offset, z.shape[0])[:, None], out, 0)
  return out.astype(cfg.out_dtype), (lhs, rhs, counts, group_offset, bias, z)


def _zero_cotangent(x):
  if isinstance(x, quant.QArray):  # quantized operands get no gradient here
    return jax.tree.map(_zero_cotangent, x)
  if jnp.issubdtype(x.dtype, jnp.inexact):
    return jnp.zeros(np.shape(x), x.dtype) if not isinstance(x, np.ndarray) else np.zeros_like(x)
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _differentiable(x) -> bool:
  return not isinstance(x, quant.QArray) and jnp.issubdtype(x.dtype, jnp.inexact)


def _as_float(x, dtype):
  """A QArray operand as the float values the backward multiplies by."""
  return quant.dequantize(x, dtype) if isinstance(x, quant.QArray) else x


def _bwd(cfg, residuals, dy):
  lhs, rhs, counts, group_offset, bias, z = residuals
  if dy.dtype == jax.dtypes.float0:  # integer output: nothing is differentiable
    return (_zero_cotangent(lhs), _zero_cotangent(rhs), _zero_cotangent(counts),
            _zero_cotangent(group_offset), None if bias is None else _zero_cotangent(bias))
  if z is not None:
    _, activation_vjp = jax.vjp(resolve_activation(cfg.activation), z)
    dz = activation_vjp(dy.astype(z.dtype))[0]
  else:
    dz = dy
  # A user's tiling was chosen for the forward's shapes; the backward's gmms (other
  # grouping types, swapped K and N) use each backend's heuristic.
  plain = cfg.replace(activation=None, tiling=None)
  # Quantized operands (kernels that dequantize in-kernel) enter the backward as the float
  # values they stand for; they get no gradient themselves.
  float_dtype = dz.dtype if jnp.issubdtype(dz.dtype, jnp.floating) else jnp.float32
  lhs_values = _as_float(lhs, float_dtype)
  rhs_values = _as_float(rhs, float_dtype)

  def forward(group_type, a, b, out_dtype, transpose_a, transpose_b):
    call_cfg = plain.replace(group_type=group_type, transpose_lhs=transpose_a,
                             transpose_rhs=transpose_b, out_dtype=np.dtype(out_dtype))
    return gmm_core(call_cfg, a, b, counts, group_offset, None)

  tl, tr = cfg.transpose_lhs, cfg.transpose_rhs
  dlhs = drhs = dbias = None
  if cfg.group_type == "m":
    if _differentiable(lhs):
      dlhs = forward("m", dz, rhs_values, lhs.dtype, False, not tr)  # [M, K]
      dlhs = dlhs.T if tl else dlhs
    if _differentiable(rhs):
      if tr:  # [L, N, K] = dz_g^T lhs_g
        drhs = forward("k", dz, lhs_values, rhs.dtype, True, tl)
      else:  # [L, K, N] = lhs_g^T dz_g
        drhs = forward("k", lhs_values, dz, rhs.dtype, not tl, False)
    if bias is not None:
      ids = layout.row_group_ids(counts, dz.shape[0], group_offset, cfg.num_local)
      ids = jnp.where(ids >= 0, ids, cfg.num_local)  # out-of-range segments are dropped
      dbias = jax.ops.segment_sum(dz.astype(jnp.float32), ids, cfg.num_local + 1)
      dbias = dbias[:cfg.num_local].astype(bias.dtype)
  else:
    if _differentiable(lhs):
      dlhs_t = forward("m", rhs_values, dz, lhs.dtype, tr, True)  # [K, M] = dlhs^T
      dlhs = dlhs_t if tl else dlhs_t.T
    if _differentiable(rhs):
      drhs = forward("m", lhs_values, dz, rhs.dtype, not tl, False)  # [K, N]
      drhs = drhs.T if tr else drhs
    if bias is not None:
      dbias = jnp.sum(dz.astype(jnp.float32), axis=1).astype(bias.dtype)
  return (
      _zero_cotangent(lhs) if dlhs is None else dlhs,
      _zero_cotangent(rhs) if drhs is None else drhs,
      _zero_cotangent(counts),
      _zero_cotangent(group_offset),
      None if bias is None else (dbias if _differentiable(bias) else _zero_cotangent(bias)),
  )


gmm_core.defvjp(_fwd, _bwd)
