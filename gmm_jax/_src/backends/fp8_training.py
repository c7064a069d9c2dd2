"""fp8 training of a gmm: forward, dlhs and drhs as fp8 gmms with blockwise scales.

Floor 4, above the quantized compositions (`quantized.gmm_quantized`) and the op. With
``quantization=Fp8Training(...)`` a float m-grouped gmm ``z = lhs @ rhs[g] + bias[g]`` runs as

    forward  z   = Q(lhs, 1 x b along K) . Q(rhs, b x b)                  ("blocked" mode)
    dlhs     dx  = Q(dz, 1 x b along N, grad dtype) . Q(rhs, b x b)^T
    drhs     dW  = Q(lhs, b x 1 along rows)^T . Q(dz, b x 1 along rows)   (k-grouped)
    dbias    the per-group sums of dz (f32)

each a gmm of QArray operands (8-bit float values, f32 scales, f32 accumulation) that an
implementation multiplies in-kernel where it serves the "blocked" mode (fp8 MMA on Hopper),
else composed (see `quantized`). The scales are computed here, inside the op; the forward
keeps lhs already quantized for the weight gradient (fp8 values + scales: about half a
bf16 copy). The backward is the one jax.custom_vjp: the gradients are those of the
unquantized gmm, each evaluated with fp8 operands (the straight-through estimate, as in
DeepSeek-V3 / DeepGEMM), not the zero derivative of rounding. Forward-mode (jvp) is not
defined, as for any custom_vjp.

The activation, row masking, row weights and the scatter to ``out_indices`` run after the
fp8 gmm on its f32 pre-activation (`epilogue.finish`), differentiated by jax; a gathered lhs
(``lhs_indices``) is gathered before it, its gradient summed back per token in a fixed order
(`op.rows_sum`).

A gated prologue (``lhs_activation``: lhs is the pre-activation z ``[M, 2K]``, the gmm
multiplies act(z)): the forward's activations are act(z) in 1 x b blocks
(`GmmConfig.quantize_prologue`: quantized in the kernel's prologue where one serves it, else
formed and quantized before it); the forward keeps z, the dlhs gmm writes z's cotangent
from its epilogue (`GmmConfig.cotangent_of`, on the blockwise fp8 operands) and the weight
gradient quantizes the recomputed act(z) in b x 1 blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, finish, gather_rows, prologue_input
from gmm_jax._src.core.qarray import Fp8Training
from gmm_jax._src.backends.quantized import explicit_sharding, gmm_quantized, reshard_like
from gmm_jax._src.op.rows_sum import rows_sum
from gmm_jax._src.tiling import tuning

_F32 = np.dtype(jnp.float32)


def _float0(x):
  return np.zeros(np.shape(x), jax.dtypes.float0)


def _product_input(cfg: GmmConfig, lhs):
  """What the gmm multiplies: lhs, or act(z) of a gated prologue's pre-activation z (in
  f32, rounded to z's dtype, as the float gmm's prologue rounds it)."""
  return lhs if cfg.lhs_activation is None else prologue_input(cfg.lhs_activation, lhs)


def _forward(static, lhs, rhs, bias, counts, group_offset):
  cfg, recipe, _ = static
  if cfg.lhs_activation is not None:  # act(z), quantized in the kernel's prologue where
    # one serves it (`GmmConfig.quantize_prologue`)
    return gmm_quantized(lhs, recipe.weights(rhs), counts, group_offset, bias,
                         cfg.replace(quantize_prologue=recipe.forward_blocks))
  return gmm_quantized(recipe.activations(lhs, 1), recipe.weights(rhs), counts,
                       group_offset, bias, cfg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _fp8_gmm(static, lhs, rhs, bias, counts, group_offset):
  return _forward(static, lhs, rhs, bias, counts, group_offset)


def _fp8_forward(static, lhs, rhs, bias, counts, group_offset):
  cfg, recipe, _ = static
  out = _forward(static, lhs, rhs, bias, counts, group_offset)
  # The weight gradient's b x 1 blocks of lhs; a gated prologue keeps z instead (the
  # backward's dlhs gmm reads it, and act(z) is recomputed for the weight gradient).
  kept = lhs if cfg.lhs_activation is not None else recipe.activations(lhs, 0)
  return out, (kept, rhs, bias, counts, group_offset, jnp.zeros((0,), lhs.dtype))


def _fp8_backward(static, residuals, ct):
  cfg, recipe, (lhs_sharding, rhs_sharding) = static
  kept, rhs, bias, counts, group_offset, lhs_like = residuals
  base = cfg.replace(tiling=None, activation=None, lhs_activation=None)
  tr = cfg.transpose_rhs
  # Rows of no local group contribute nothing: zeroed, they do not widen a block's scale.
  ids = metadata.row_group_ids(counts, ct.shape[0], group_offset, cfg.num_local)
  ct = jnp.where((ids >= 0)[:, None], ct, jnp.zeros((), ct.dtype))
  # dlhs [M, K] = dz [M, N] . rhs[g]^T: the same b x b weight blocks, read transposed.
  ct_rows = recipe.activations(ct, 1, recipe.grad_dtype)
  # Each gradient is written in its operand's dtype by the gmm that sums it in f32 (one
  # rounding, as a cast of an f32 result would round): no f32 copy of the weights'
  # gradient exists. A gated prologue's dlhs gmm writes z's cotangent [M, 2K] from its
  # epilogue (`GmmConfig.cotangent_of`), reading z.
  d_cfg = base.replace(transpose_rhs=not tr, out_dtype=lhs_like.dtype,
                       cotangent_of=cfg.lhs_activation,
                       tiling=tuning.backward_tiling(cfg.tiling, "dlhs"))
  d_rows = NO_ROWS if cfg.lhs_activation is None else Rows(source=kept)
  d_lhs = gmm_quantized(ct_rows, recipe.weights(rhs), counts, group_offset, None, d_cfg,
                        rows=d_rows)
  lhs_by_rows = (kept if cfg.lhs_activation is None
                 else recipe.activations(_product_input(cfg, kept), 0))
  # drhs: k-grouped over the tokens, both operands in b x 1 blocks along the rows.
  ct_cols = recipe.activations(ct, 0, recipe.grad_dtype)
  k_cfg = base.replace(group_type="k", transpose_lhs=True, transpose_rhs=False,
                       out_dtype=rhs.dtype, tiling=tuning.backward_tiling(cfg.tiling, "drhs"))
  if tr:  # [L, N, K] = dz_g^T lhs_g
    d_rhs = gmm_quantized(ct_cols, lhs_by_rows, counts, group_offset, None, k_cfg)
  else:  # [L, K, N] = lhs_g^T dz_g
    d_rhs = gmm_quantized(lhs_by_rows, ct_cols, counts, group_offset, None, k_cfg)
  d_bias = None
  if bias is not None:
    ids = jnp.where(ids >= 0, ids, cfg.num_local)  # rows of no local group are dropped
    d_bias = jax.ops.segment_sum(ct.astype(_F32), ids, cfg.num_local + 1)
    d_bias = d_bias[:cfg.num_local].astype(bias.dtype)
  return (reshard_like(d_lhs.astype(lhs_like.dtype), lhs_sharding),
          reshard_like(d_rhs.astype(rhs.dtype), rhs_sharding), d_bias, _float0(counts),
          _float0(group_offset))


_fp8_gmm.defvjp(_fp8_forward, _fp8_backward)


@jax.custom_vjp
def _gather(x, indices):
  return gather_rows(x, indices)


def _gather_forward(x, indices):
  return gather_rows(x, indices), (indices, x.shape[0])


def _gather_backward(residuals, ct):
  indices, num_rows = residuals
  return rows_sum(ct, indices, num_rows), _float0(indices)


_gather.defvjp(_gather_forward, _gather_backward)


def check(lhs, rhs, cfg: GmmConfig) -> None:
  """NotImplementedError for a call fp8 training does not cover (naming what it does)."""
  supported = ("fp8 training (quantization=) covers m-grouped gmms of float operands (lhs "
               "[M, K], rhs [G, K, N] or transpose_rhs), with bias, activation and row "
               "operands")
  if cfg.group_type != "m" or cfg.transpose_lhs:
    raise NotImplementedError(f"{supported}; got group_type={cfg.group_type!r}, "
                              f"transpose_lhs={cfg.transpose_lhs}")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    if not jnp.issubdtype(x.dtype, jnp.floating):
      raise NotImplementedError(f"{supported}; got {name} of dtype {np.dtype(x.dtype)}")
  if not jnp.issubdtype(cfg.out_dtype, jnp.floating):
    raise NotImplementedError(f"{supported}, with a float result; got {cfg.out_dtype}")


def fp8_gmm(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, recipe: Fp8Training,
            rows: Rows = NO_ROWS):
  """The gmm of float operands (canonical m-grouped call, `GmmConfig`) trained in fp8
  (see the module docstring)."""
  check(lhs, rhs, cfg)
  if rows.lhs_indices is not None:
    lhs = _gather(lhs, rows.lhs_indices)
  num_rows = lhs.shape[0]
  direct = cfg.activation is None and not cfg.has_rows
  core = cfg.without_rows().replace(activation=None,
                                    out_dtype=cfg.out_dtype if direct else _F32)
  shardings = (explicit_sharding(lhs), explicit_sharding(rhs))
  z = _fp8_gmm((core, recipe, shardings), lhs, rhs, bias, counts, group_offset)
  if direct:
    return z
  row_ids = metadata.row_group_ids(counts, num_rows, group_offset, cfg.num_local)
  return finish(z, cfg.activation, cfg.out_dtype, row_ids=row_ids,
                row_weights=rows.row_weights if cfg.row_weights else None,
                out_indices=rows.out_indices, out_rows=cfg.out_rows)
