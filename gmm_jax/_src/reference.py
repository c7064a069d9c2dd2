"""The obviously-correct jax.numpy gmm: one masked dense product per local group.

Floor 2 (a backend). It does G times the work of the fast paths and exists to be read and
trusted: tests compare the other implementations against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gmm_jax._src import metadata
from gmm_jax._src.config import GmmConfig, accumulator_dtype, out_columns
from gmm_jax._src.epilogue import NO_ROWS, Rows, apply_epilogue, gather_rows, scatter_rows


def _dot(a, b, cfg, acc_dtype):
  if jnp.issubdtype(acc_dtype, jnp.floating):
    # Exact upcast: the same products and f32 sums, and it keeps XLA:CPU off a bf16 dot thunk
    # that rejects bf16 x bf16 -> f32 for some operand layouts (transposed operands).
    a, b = a.astype(acc_dtype), b.astype(acc_dtype)
  return jnp.matmul(a, b, precision=cfg.precision, preferred_element_type=acc_dtype)


FEATURES = ("gather", "row_weights", "scatter", "gated", "gather_k")


def gmm_reference(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
                  rows: Rows = NO_ROWS) -> jax.Array:
  """Reference gmm on canonical operands (see `GmmConfig`; `rows` the row operands)."""
  acc_dtype = accumulator_dtype(lhs.dtype, rhs.dtype)
  if cfg.gather_rows is not None:  # the stored rows: [R, K] ("m"), [R, M] ("k", transposed)
    lhs = gather_rows(lhs, rows.lhs_indices)
  lhs = lhs.T if cfg.transpose_lhs else lhs  # [M, K]
  rhs = jnp.swapaxes(rhs, -1, -2) if cfg.transpose_rhs else rhs  # [..., K, N]
  m, k = lhs.shape
  n = rhs.shape[-1]
  zero_lhs = jnp.zeros((), lhs.dtype)
  if cfg.group_type == "m":
    group_of_row = metadata.row_group_ids(counts, m, group_offset, cfg.num_local)
    out = jnp.zeros((m, out_columns(n, cfg)), cfg.out_dtype)
    for g in range(cfg.num_local):
      in_group = (group_of_row == g)[:, None]
      acc = _dot(jnp.where(in_group, lhs, zero_lhs), rhs[g], cfg, acc_dtype)
      y = apply_epilogue(acc, None if bias is None else bias[g], cfg.activation, cfg.out_dtype,
                         rows.row_weights if cfg.row_weights else None)
      out = jnp.where(in_group, y, out)
    if cfg.out_rows is not None:
      out = scatter_rows(out, rows.out_indices, cfg.out_rows, group_of_row >= 0)
    return out
  group_of_col = metadata.row_group_ids(counts, k, group_offset, cfg.num_local)
  outs = []
  for g in range(cfg.num_local):
    cols = group_of_col == g
    acc = _dot(
        jnp.where(cols[None, :], lhs, zero_lhs),
        jnp.where(cols[:, None], rhs, jnp.zeros((), rhs.dtype)), cfg, acc_dtype,
    )
    outs.append(
        apply_epilogue(acc, None if bias is None else bias[g], cfg.activation, cfg.out_dtype))
  if not outs:
    return jnp.zeros((0, m, n), cfg.out_dtype)
  return jnp.stack(outs)
