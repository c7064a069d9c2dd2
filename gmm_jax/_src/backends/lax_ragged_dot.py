"""gmm as one `jax.lax.ragged_dot_general`, then the epilogue.

Floor 2 (a backend). The accelerators' fallback where no Pallas kernel serves a call: XLA
lowers ``ragged_dot_general`` to its own grouped kernels on TPU (Mosaic custom calls that
visit only the grouped rows), where the XLA path's loops (`xla.py`, tuned for XLA:CPU) run
one small dot per work item. Which of the two a GPU falls back to is measured in
benchmarks/log.md ("Fallbacks on accelerators"), by `python -m gmm_jax.tools.bench_fallback`.

One ``ragged_dot_general`` computes the f32 products of the local groups; bias, activation
(plain or gated), row mask and cast follow in the one finishing step (`epilogue.finish`). Local groups (``group_offset``,
expert parallelism) are expressed through the group sizes, since no jax version lowers
``ragged_dot_general``'s own ``group_offset`` (jax 0.10.2 and 0.12 raise
NotImplementedError on every platform):

- m-grouping: rhs holds only the local groups, so the sizes are the local groups' and the
  rows before the first local group join local group 0: they are computed with its weights
  and then masked to exactly 0, as are the rows past the local groups. That wastes the rows
  of earlier groups' work on a device holding later experts, and costs nothing where
  ``group_offset`` is 0 (one device), which a copy shifting lhs and the result would.
- k-grouping: the contraction columns before and after the local groups are two extra
  groups of their own (the sizes then sum to K, so nothing depends on how a platform treats
  columns past the total), whose products are dropped.

Refused (NotImplementedError, the next implementation of the chain serves it): integer
operands (int32 accumulation), quantized operands (registered for mode "none" only) and
row operands (no "gather"/"scatter"/"row_weights" features: the dispatcher gathers lhs
before and scatters the result after this backend).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, accumulator_dtype, out_columns, problem_dims
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, finish

# Gated activations are finished here (after the whole product); row operations are not.
FEATURES = ("gated",)


def _refuse(lhs, rhs, cfg: GmmConfig) -> None:
  """The cases one ``ragged_dot_general`` with a float epilogue cannot express."""
  if cfg.has_rows:
    raise NotImplementedError(
        "lax_ragged_dot has no row operands (the dispatcher gathers/scatters around it)")
  for name, x in (("lhs", lhs), ("rhs", rhs)):
    dtype = getattr(x, "dtype", None)
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
      raise NotImplementedError(
          f"lax_ragged_dot takes float operands, got {name} {jax.typeof(x)} (integer "
          "accumulation and quantized operands go to the next implementation)")
  if not jnp.issubdtype(cfg.out_dtype, jnp.floating):
    raise NotImplementedError(
        f"lax_ragged_dot gives float results, not {cfg.out_dtype.name}")


def _local_sizes(counts, dim: int, group_offset, num_local: int):
  """(int32 rows before the first local group, int32 ``[L]`` local group sizes, clipped to
  `dim`)."""
  bounds = metadata.bounds_from_counts(counts, dim)
  first, _ = metadata.local_group_range(group_offset, num_local, counts.shape[0])
  starts, ends = metadata.local_group_bounds(counts, dim, group_offset, num_local)
  return bounds[first], (ends - starts).astype(jnp.int32)


def gmm_lax_ragged(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig,
                   rows: Rows = NO_ROWS) -> jax.Array:
  """gmm on canonical operands (see `GmmConfig`) by `jax.lax.ragged_dot_general`.

  Args:
    lhs: ``[M, K]`` (``[K, M]`` with transpose_lhs), float.
    rhs: ``[L, K, N]`` (m-grouping) or ``[K, N]`` (k-grouping); last two dims swapped with
      transpose_rhs.
    counts: int32 ``[G]`` global group sizes.
    group_offset: int32 scalar, the first global group held locally.
    bias: None or ``[L, N]``.
    cfg: the call's options.
    rows: must be empty (`FEATURES` has no row operations).

  Returns:
    ``[M, N']`` (m-grouping) or ``[L, M, N']`` (k-grouping) in ``cfg.out_dtype``; N' = N/2
    for a gated activation.

  Raises:
    NotImplementedError: integer or quantized operands, an integer result, row operands.
  """
  del rows  # `_refuse` rejects a call that has them
  _refuse(lhs, rhs, cfg)
  m, k, n = problem_dims(lhs.shape, rhs.shape, cfg)
  acc_dtype = accumulator_dtype(lhs.dtype, rhs.dtype)
  num_local = cfg.num_local
  lhs_k = 0 if cfg.transpose_lhs else 1
  lhs_m = 1 - lhs_k
  if cfg.group_type == "m":
    if num_local == 0 or counts.shape[0] == 0:  # no local group: every row is 0
      return jnp.zeros((m, out_columns(n, cfg)), cfg.out_dtype)
    lead, sizes = _local_sizes(counts, m, group_offset, num_local)
    sizes = sizes.at[0].add(lead)
    rhs_k = 2 if cfg.transpose_rhs else 1
    numbers = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(((lhs_k,), (rhs_k,)), ((), ())),
        lhs_ragged_dimensions=(lhs_m,), rhs_group_dimensions=(0,))
    acc = jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers, precision=cfg.precision,
                                     preferred_element_type=acc_dtype)  # [M, N]
    group_of_row = metadata.row_group_ids(counts, m, group_offset, num_local)
    return finish(acc, cfg.activation, cfg.out_dtype, row_ids=group_of_row, bias=bias)
  if num_local == 0:
    return jnp.zeros((0, m, out_columns(n, cfg)), cfg.out_dtype)
  if counts.shape[0] == 0:
    sizes = jnp.zeros((num_local,), jnp.int32)
    lead = jnp.zeros((), jnp.int32)
  else:
    lead, sizes = _local_sizes(counts, k, group_offset, num_local)
  trail = k - lead - jnp.sum(sizes, dtype=jnp.int32)  # int32 under x64 with strict promotion
  sizes = jnp.concatenate([lead[None], sizes, trail[None]]).astype(jnp.int32)
  rhs_k = 1 if cfg.transpose_rhs else 0
  numbers = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((lhs_k,), (rhs_k,)), ((), ())),
      lhs_ragged_dimensions=(lhs_k,), rhs_group_dimensions=())
  acc = jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers, precision=cfg.precision,
                                   preferred_element_type=acc_dtype)  # [L + 2, M, N]
  acc = acc[1:num_local + 1]
  return finish(acc, cfg.activation, cfg.out_dtype, bias=bias)
