"""`SharedExperts`: the dense FFN that every token of an MoE layer goes through."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gmm_jax.nn.expert_ffn import gated_activation
from gmm_jax.nn.params import param
from gmm_jax._src.epilogue import resolve_activation

Array = jax.Array


class SharedExperts(nnx.Module):
  """Shared experts: one dense FFN (gated or plain) that every token goes through.

  Parameters: ``up.kernel [D, 2F]`` (gated: the gate half first) or ``[D, F]``,
  ``down.kernel [F, D]``.
  """

  def __init__(self, embed: int, mlp: int, *, gated: bool = True, activation="silu",
               dtype: Any = None, param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.gated, self.activation, self.dtype = gated, activation, dtype
    width = 2 * mlp if gated else mlp
    self.up = nnx.Linear(embed, width, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)
    self.up.kernel = param(self.up.kernel[...], ("embed", "mlp"))
    self.down = nnx.Linear(mlp, embed, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)
    self.down.kernel = param(self.down.kernel[...], ("mlp", "embed"))

  def __call__(self, x: Array) -> Array:
    z = self.up(x)
    if not self.gated:
      h = resolve_activation(self.activation)(z)
    else:
      h = gated_activation(self.activation)(z)
    return self.down(h)
