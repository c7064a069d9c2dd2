"""The obviously-correct jax.numpy gmm: one masked dense product per local group.

Floor 2 (a backend). It does G times the work of the fast paths and exists to be read and
trusted: tests compare the other implementations against it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, accumulator_dtype
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, apply_epilogue, gather_rows, scatter_rows


def _dot(spec: str, a, b, cfg, acc_dtype):
  """``einsum(spec, a, b)`` accumulated in `acc_dtype` (a dot_general: a transposed
  operand is read in place, so XLA's partitioner sees no transpose of the weights)."""
  if jnp.issubdtype(acc_dtype, jnp.floating):
    # Exact upcast: the same products and f32 sums, and it keeps XLA:CPU off a bf16 dot thunk
    # that rejects bf16 x bf16 -> f32 for some operand layouts (transposed operands).
    a, b = a.astype(acc_dtype), b.astype(acc_dtype)
  return jnp.einsum(spec, a, b, precision=cfg.precision, preferred_element_type=acc_dtype)


FEATURES = ("gather", "row_weights", "scatter", "gated", "gather_k")


def gmm_reference(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
                  rows: Rows = NO_ROWS) -> jax.Array:
  """Reference gmm on canonical operands (see `GmmConfig`; `rows` the row operands).

  Every local group's product is one batch of a batched dot over the groups (lhs, and for
  k-grouping rhs, masked to the group's rows), so the groups are a batch dimension: XLA's
  partitioner splits it where rhs (or the output) is sharded over its groups and never
  moves a group's weights (the fallback under a partitioner that cannot split a kernel)."""
  acc_dtype = accumulator_dtype(lhs.dtype, rhs.dtype)
  if cfg.gather_rows is not None:  # the stored rows: [R, K] ("m"), [R, M] ("k", transposed)
    lhs = gather_rows(lhs, rows.lhs_indices)
  # The stored layouts, read in place: lhs [M, K] or [K, M], rhs [..., K, N] or [..., N, K].
  lhs_dims = "km" if cfg.transpose_lhs else "mk"
  rhs_dims = "nk" if cfg.transpose_rhs else "kn"
  m_axis, k_axis = lhs_dims.index("m"), lhs_dims.index("k")
  m, k = lhs.shape[m_axis], lhs.shape[k_axis]
  groups = jnp.arange(cfg.num_local, dtype=jnp.int32)
  per_group_bias = None if bias is None else bias[:, None, :]
  if cfg.group_type == "m":
    group_of_row = metadata.row_group_ids(counts, m, group_offset, cfg.num_local)
    in_group = group_of_row[None, :] == groups[:, None]  # [G, M]
    lhs_mask = in_group[:, :, None] if m_axis == 0 else in_group[:, None, :]
    acc = _dot(f"g{lhs_dims},g{rhs_dims}->gmn",
               jnp.where(lhs_mask, lhs[None], jnp.zeros((), lhs.dtype)), rhs, cfg, acc_dtype)
    in_group = in_group[:, :, None]
    y = apply_epilogue(acc, per_group_bias, cfg.activation, cfg.out_dtype,
                       rows.row_weights if cfg.row_weights else None)
    # Each row's own group's result (a sum of exact zeros but one: no NaN of another
    # group's weights reaches it).
    out = jnp.sum(jnp.where(in_group, y, jnp.zeros((), y.dtype)), axis=0, dtype=y.dtype)
    if cfg.out_rows is not None:
      out = scatter_rows(out, rows.out_indices, cfg.out_rows, group_of_row >= 0)
    return out
  group_of_col = metadata.row_group_ids(counts, k, group_offset, cfg.num_local)
  in_group = group_of_col[None, :] == groups[:, None]  # [G, K]
  lhs_mask = in_group[:, None, :] if k_axis == 1 else in_group[:, :, None]
  rhs_mask = in_group[:, :, None] if rhs_dims == "kn" else in_group[:, None, :]
  acc = _dot(f"g{lhs_dims},g{rhs_dims}->gmn",
             jnp.where(lhs_mask, lhs[None], jnp.zeros((), lhs.dtype)),
             jnp.where(rhs_mask, rhs[None], jnp.zeros((), rhs.dtype)), cfg, acc_dtype)
  return apply_epilogue(acc, per_group_bias, cfg.activation, cfg.out_dtype)
