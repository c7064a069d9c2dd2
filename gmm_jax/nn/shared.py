"""`SharedExperts`: the dense FFN that every token of an MoE layer goes through."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from gmm_jax.nn.params import param
from gmm_jax._src.core.epilogue import SWIGLU_ALPHA, SWIGLU_LIMIT, resolve_activation
from gmm_jax._src.moe.experts import gated_activation

Array = jax.Array


class SharedExperts(nnx.Module):
  """Shared experts: one dense FFN (gated or plain) that every token goes through,
  optionally scaled by a learned gate ``sigmoid(x @ gate.kernel)`` per token (Qwen2-MoE,
  Qwen3-Next).

  Parameters: ``up.kernel [D, 2F]`` (gated: the gate half first) or ``[D, F]``,
  ``down.kernel [F, D]``, ``gate.kernel [D, 1]`` (with `gate`).

  Args:
    embed, mlp: D, F.
    gated, activation: the FFN's kind and activation (as `MoE`'s).
    gate: scale the output by ``sigmoid(x @ gate.kernel)``.
    swiglu_limit, swiglu_alpha: the constants of "swiglu_clamped".
    dtype, param_dtype, rngs: as nnx.Linear's.
  """

  def __init__(self, embed: int, mlp: int, *, gated: bool = True, activation="silu",
               gate: bool = False, swiglu_limit: float = SWIGLU_LIMIT,
               swiglu_alpha: float = SWIGLU_ALPHA, dtype: Any = None,
               param_dtype: Any = jnp.float32, rngs: nnx.Rngs):
    self.gated, self.activation, self.dtype = gated, activation, dtype
    self.swiglu_limit, self.swiglu_alpha = swiglu_limit, swiglu_alpha
    width = 2 * mlp if gated else mlp
    self.up = nnx.Linear(embed, width, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                         rngs=rngs)
    self.up.kernel = param(self.up.kernel[...], ("embed", "mlp"))
    self.down = nnx.Linear(mlp, embed, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                           rngs=rngs)
    self.down.kernel = param(self.down.kernel[...], ("mlp", "embed"))
    self.gate = (nnx.Linear(embed, 1, use_bias=False, dtype=dtype, param_dtype=param_dtype,
                            rngs=rngs) if gate else None)
    if gate:
      self.gate.kernel = param(self.gate.kernel[...], ("embed", None))

  def __call__(self, x: Array) -> Array:
    z = self.up(x)
    if not self.gated:
      h = resolve_activation(self.activation)(z)
    else:
      h = gated_activation(self.activation, swiglu_limit=self.swiglu_limit,
                           swiglu_alpha=self.swiglu_alpha)(z)
    y = self.down(h)
    if self.gate is not None:
      y = jax.nn.sigmoid(self.gate(x)) * y
    return y
