"""The fused epilogue: bias in the accumulator, activation, cast to the output dtype."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


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
