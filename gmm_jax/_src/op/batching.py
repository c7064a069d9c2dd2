"""The batching rule of the gmm primitive: a batch folds into more rows (only lhs batched)
or more columns (only rhs and bias batched) where that is exact, else one gmm per example.

Floor 2 (the op package).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import batching

from gmm_jax._src.core import group_list
from gmm_jax._src.op.primitive import PRIMITIVES, current_primitive, gmm, is_plain, unpack


def _moved(x, dim, to):
  return jnp.moveaxis(x, dim, to)


def _fold_into_rows(lhs, dim, size, rhs, counts, group_offset, bias, cfg, out_hint):
  """Only lhs is batched: the batch becomes more rows of the same groups."""
  if cfg.group_type == "m":
    # Row r*B + b is row r of example b, so every group stays contiguous with B times as
    # many rows.
    if cfg.transpose_lhs:  # [K, M, B] -> [K, M*B]
      moved = _moved(lhs, dim, 2)
      m = moved.shape[1]
      folded = moved.reshape(moved.shape[0], m * size)
    else:  # [M, B, K] -> [M*B, K]
      moved = _moved(lhs, dim, 1)
      m = moved.shape[0]
      folded = moved.reshape(m * size, moved.shape[-1])
    sizes = group_list.clamp_counts(counts, m) * size
    out = gmm(folded, rhs, sizes, group_offset, bias, cfg, out_hint)  # [M*B, N]
    return out.reshape(m, size, -1), 1
  # k-grouping: M is not grouped, so the examples are stacked along it.
  if cfg.transpose_lhs:  # [K, B, M] -> [K, B*M]
    moved = _moved(lhs, dim, 1)
    folded = moved.reshape(moved.shape[0], -1)
  else:  # [B, M, K] -> [B*M, K]
    moved = _moved(lhs, dim, 0)
    folded = moved.reshape(-1, moved.shape[-1])
  out = gmm(folded, rhs, counts, group_offset, bias, cfg, out_hint)  # [L, B*M, N]
  return out.reshape(out.shape[0], size, -1, out.shape[-1]), 1


def _columns_last(x, dim, gated: bool):
  """``[..., C]`` with a batch at `dim` -> ``[..., B*C]`` (the batch moved next to the
  columns and folded into them). Gated (C = 2N, [gate | up]): ``[..., 2*B*N]`` = all B gate
  halves, then all B up halves, so the folded problem is gated again and pairs each
  example's halves."""
  moved = _moved(x, dim, x.ndim - 2)  # [..., B, C]
  if not gated:
    return moved.reshape(*moved.shape[:-2], -1)
  half = moved.shape[-1] // 2
  gate, up = moved[..., :half], moved[..., half:]
  return jnp.concatenate([gate.reshape(*gate.shape[:-2], -1),
                          up.reshape(*up.shape[:-2], -1)], axis=-1)


def _fold_into_columns(lhs, rhs, dim, size, counts, group_offset, bias, bias_dim, cfg,
                       out_hint):
  """Only rhs (and the bias) are batched: the batch becomes more output columns."""
  if cfg.transpose_rhs:  # [B, ..., N, K] -> [B, ..., K, N] -> [..., K, B*N] -> [..., B*N, K]
    folded = jnp.swapaxes(_moved(rhs, dim, 0), -1, -2)
    folded = jnp.swapaxes(_columns_last(folded, 0, cfg.gated), -1, -2)
  else:  # [..., K, N] with a batch -> [..., K, B*N]
    folded = _columns_last(rhs, dim, cfg.gated)
  if bias is not None:
    if bias_dim is None:
      bias = jnp.broadcast_to(bias[:, None, :], (bias.shape[0], size, bias.shape[-1]))
      bias_dim = 1
    bias = _columns_last(bias, bias_dim, cfg.gated)
  out = gmm(lhs, folded, counts, group_offset, bias, cfg, out_hint)  # [M, B*N] / [L, M, B*N]
  return out.reshape(*out.shape[:-1], size, -1), out.ndim - 1


def _batch(operands, dims, *, cfg, trees, has_bias, out_hint):
  size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
  dims = [d for d in dims]
  lhs, rhs, counts, group_offset, bias = unpack(operands, trees, has_bias)
  lhs_dims, rhs_dims, counts_dim, offset_dim, bias_dim = unpack(dims, trees, has_bias)
  lhs_batched = any(d is not None for d in jax.tree.leaves(lhs_dims))
  rhs_batched = any(d is not None for d in jax.tree.leaves(rhs_dims))
  shared_groups = counts_dim is None and offset_dim is None and not cfg.has_rows
  if shared_groups and is_plain(trees[0]) and lhs_batched and not rhs_batched and (
      bias_dim is None):
    return _fold_into_rows(lhs, lhs_dims, size, rhs, counts, group_offset, bias, cfg,
                           out_hint)
  if shared_groups and is_plain(trees[1]) and rhs_batched and not lhs_batched:
    return _fold_into_columns(lhs, rhs, rhs_dims, size, counts, group_offset, bias, bias_dim,
                              cfg, out_hint)
  # A batch of problems (each with its own weights or group sizes): one gmm per example.
  batched = [i for i, d in enumerate(dims) if d is not None]
  stacked = tuple(_moved(operands[i], dims[i], 0) for i in batched)

  def one(slices):
    example = list(operands)
    for i, x in zip(batched, slices):
      example[i] = x
    return current_primitive().bind(*example, cfg=cfg, trees=trees, has_bias=has_bias,
                                    out_hint=out_hint)

  return lax.map(one, stacked), 0


for _prim in PRIMITIVES:
  batching.primitive_batchers[_prim] = _batch
