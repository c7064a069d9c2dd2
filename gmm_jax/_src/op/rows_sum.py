"""The fixed-order sum of rows, the transpose of a row gather, as one primitive: ``out[t] =
sum of values[r] over the rows r with indices[r] == t``, in ascending r, accumulated in f32.

A scatter-add would do it in one pass, but on GPUs XLA runs a scatter-add with atomics,
whose order (and so the rounding of every row read by several rows, a token routed to k
experts) changes from run to run. Here each output row is summed in a fixed order: the rows
are ordered by their index (a stable sort), and a loop of `max multiplicity` steps (k for
top-k routing) adds each index's j-th row. It is a primitive so that it transposes back
into the gather (`epilogue.gather_rows`, and so derivatives of any order exist); its jvp is
itself.

Floor 2 (the op package): below it only the epilogue's row gather.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from gmm_jax._src.core.epilogue import gather_rows

rows_sum_p = jax.extend.core.Primitive("gmm_jax_rows_sum")


def rows_sum(values: jax.Array, indices: jax.Array, num_out: int) -> jax.Array:
  """``[num_out, ...]``: the sum of the rows of `values` (``[R, ...]``) that `indices`
  (int ``[R]``) sends to each output row, in a fixed order (bitwise deterministic);
  out-of-range indices send nothing. The transpose of `gather_rows`."""
  return rows_sum_p.bind(values, indices.astype(jnp.int32), num_out=int(num_out))


def _rows_sum_impl(values, indices, *, num_out):
  num_rows = values.shape[0]
  acc_dtype = jnp.float64 if values.dtype == jnp.float64 else jnp.float32
  out_shape = (num_out,) + values.shape[1:]
  if num_rows == 0 or num_out == 0:
    return jnp.zeros(out_shape, values.dtype)
  valid = (indices >= 0) & (indices < num_out)
  key = jnp.where(valid, indices, num_out)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)
  counts = jnp.bincount(key, length=num_out + 1)[:num_out].astype(jnp.int32)
  starts = jnp.cumsum(counts) - counts
  extra = (1,) * (values.ndim - 1)

  def add_jth(j, acc):
    row = order[jnp.minimum(starts + j, num_rows - 1)]
    taken = (j < counts).reshape((num_out,) + extra)
    return acc + jnp.where(taken, jnp.take(values, row, axis=0).astype(acc_dtype), 0)

  acc = jax.lax.fori_loop(0, jnp.max(counts), add_jth, jnp.zeros(out_shape, acc_dtype))
  return acc.astype(values.dtype)


def _rows_sum_abstract(values, indices, *, num_out):
  return jax.core.ShapedArray((num_out,) + values.shape[1:], values.dtype)


def _rows_sum_jvp(primals, tangents, *, num_out):
  values, indices = primals
  out = rows_sum(values, indices, num_out)
  t_values = tangents[0]
  if type(t_values) is ad.Zero:
    return out, ad.Zero(jax.typeof(out).to_tangent_aval())
  return out, rows_sum(ad.instantiate_zeros(t_values), indices, num_out)


def _rows_sum_transpose(ct, values, indices, *, num_out):
  del num_out
  if type(ct) is ad.Zero:
    return [None, None]
  return [gather_rows(ct, indices), None]


def _rows_sum_batch(args, dims, *, num_out):
  values, indices = args
  values_dim, indices_dim = dims
  if indices_dim is None:  # the batch becomes more columns of the same rows
    moved = jnp.moveaxis(values, values_dim, 1)
    out = rows_sum(moved.reshape(moved.shape[0], -1), indices, num_out)
    return out.reshape((num_out,) + moved.shape[1:]), 1
  size = values.shape[values_dim] if values_dim is not None else indices.shape[indices_dim]
  values = (jnp.moveaxis(values, values_dim, 0) if values_dim is not None
            else jnp.broadcast_to(values, (size,) + values.shape))
  indices = jnp.moveaxis(indices, indices_dim, 0)
  return jax.lax.map(lambda pair: rows_sum(pair[0], pair[1], num_out), (values, indices)), 0


rows_sum_p.def_impl(functools.partial(jax.jit, static_argnames=("num_out",))(_rows_sum_impl))
rows_sum_p.def_abstract_eval(_rows_sum_abstract)
mlir.register_lowering(rows_sum_p, mlir.lower_fun(_rows_sum_impl, multiple_results=False))
ad.primitive_jvps[rows_sum_p] = _rows_sum_jvp
ad.primitive_transposes[rows_sum_p] = _rows_sum_transpose
batching.primitive_batchers[rows_sum_p] = _rows_sum_batch
