"""The fused epilogue: bias in the accumulator, activation, output scale, cast.

Floor 0: imports nothing from gmm_jax. The same functions serve the kernels (on a tile of
the accumulator) and the layers above the op (on a whole pre-activation).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np


def _fast_gelu(x):
  return x * jax.nn.sigmoid(1.702 * x)


ACTIVATIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "relu": jax.nn.relu,
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "fast_gelu": _fast_gelu,
    "silu": jax.nn.silu,
}


def resolve_activation(activation) -> Callable[[jax.Array], jax.Array] | None:
  """Maps None, a name of `ACTIVATIONS` or a jnp-traceable callable to a callable."""
  if activation is None:
    return None
  if isinstance(activation, str):
    if activation not in ACTIVATIONS:
      raise ValueError(
          f"unknown activation {activation!r}; use one of {sorted(ACTIVATIONS)}, None, or a "
          "jnp-traceable callable"
      )
    return ACTIVATIONS[activation]
  if callable(activation):
    return activation
  raise ValueError(f"activation must be a name, a callable or None, got {activation!r}")


def apply_epilogue(acc: jax.Array, bias, activation, out_dtype) -> jax.Array:
  """``cast(activation(acc + bias))`` computed in the accumulator's precision.

  Args:
    acc: the f32 (or int32 for integer inputs) accumulator.
    bias: None or an array broadcasting against `acc`.
    activation: a name, callable or None (see `resolve_activation`).
    out_dtype: the dtype of the result.
  """
  fn = resolve_activation(activation)
  if jnp.issubdtype(acc.dtype, jnp.integer) and (
      fn is not None or (bias is not None and not jnp.issubdtype(bias.dtype, jnp.integer))):
    # An integer accumulator meets a float bias or an activation: continue in f32.
    acc = acc.astype(jnp.float32)
  if bias is not None:
    acc = acc + bias.astype(acc.dtype)
  if fn is not None:
    acc = fn(acc)
  return acc.astype(out_dtype)


def finish(z: jax.Array, activation, out_dtype, *, row_mask=None, output_scale=None,
           output_offset=None) -> jax.Array:
  """A float pre-activation (bias already added) -> the result.

  ``activation(z) * output_scale + output_offset``, then the cast; an integer `out_dtype`
  means requantization (rounded to nearest even and saturated). Rows where `row_mask`
  (bool ``[M]``, m-grouping) is False are exactly 0.

  Args:
    z: ``[M, N]`` or ``[L, M, N]`` float pre-activation.
    activation: a name, callable or None.
    out_dtype: the dtype of the result.
    row_mask: None or bool ``[M]``.
    output_scale, output_offset: None or arrays broadcasting against `z`.
  """
  fn = resolve_activation(activation)
  y = z if fn is None else fn(z)
  if output_scale is not None:
    y = y * output_scale
  if output_offset is not None:
    y = y + output_offset
  out_dtype = np.dtype(out_dtype)
  if jnp.issubdtype(out_dtype, jnp.integer):
    info = jnp.iinfo(out_dtype)
    y = jnp.clip(jnp.round(y), info.min, info.max)
  y = y.astype(out_dtype)
  if row_mask is not None:
    y = jnp.where(row_mask[:, None], y, jnp.zeros((), y.dtype))
  return y
