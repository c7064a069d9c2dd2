"""The routed experts' FFN variants: gated (``[E, D, 2F]`` gate|up kernel) or plain
(``[E, D, F]``), their activations, biases and quantization, as the layers that hold the
parameters and as the static `ExpertFFN` the dispatch strategies
(`gmm_jax._src.moe.experts`) run."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp

from gmm_jax import QuantSpec
from gmm_jax.nn.grouped_linear import GroupedLinear
from gmm_jax._src.core.epilogue import SWIGLU_ALPHA, SWIGLU_LIMIT, resolve_activation
from gmm_jax._src.moe.experts import GATED_NAMES, WEIGHT_ON, ExpertFFN

Array = jax.Array


def check_options(activation, gated: bool, *, router_weight_on: str = "output",
                  swiglu_limit: float = SWIGLU_LIMIT, swiglu_alpha: float = SWIGLU_ALPHA):
  """ValueError unless the options suit the FFN: for gated FFNs a name of `GATED_NAMES`
  or a callable on the gate half, for plain ones a `gmm_jax.ACTIVATIONS` name or a
  callable; `router_weight_on` in `WEIGHT_ON`; positive clamped-SwiGLU constants, other
  than the defaults only for "swiglu_clamped"."""
  if gated and isinstance(activation, str) and activation not in GATED_NAMES:
    raise ValueError(f"gated activation must be one of {sorted(GATED_NAMES)} or a "
                     f"callable, got {activation!r}")
  if not gated:
    resolve_activation(activation)
  if router_weight_on not in WEIGHT_ON:
    raise ValueError(f"router_weight_on must be one of {WEIGHT_ON}, got "
                     f"{router_weight_on!r}")
  for name, value in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
    if not isinstance(value, (int, float)) or not value > 0:
      raise ValueError(f"{name} must be a positive number, got {value!r}")
  if ((swiglu_limit, swiglu_alpha) != (SWIGLU_LIMIT, SWIGLU_ALPHA)
      and not (gated and activation == "swiglu_clamped")):
    raise ValueError(f"swiglu_limit={swiglu_limit} and swiglu_alpha={swiglu_alpha} are the "
                     f"constants of the gated activation 'swiglu_clamped', not of "
                     f"{activation!r} (gated={gated})")


def expert_layers(num_experts: int, embed: int, mlp: int, *, gated: bool, use_bias: bool,
                  dtype: Any, param_dtype: Any, weight_quant: QuantSpec | None,
                  input_quant: QuantSpec | None, implementation: str | None,
                  kernel_metadata: Mapping[str, Any] | None, rngs, quantization=None):
  """The routed experts' parameter layers, each a `GroupedLinear`: (``gate_up``
  ``[E, D, 2F]`` or None, ``up`` ``[E, D, F]`` or None, ``down`` ``[E, F, D]``): gated FFNs
  have ``gate_up`` (the gate half first), plain ones ``up``."""
  common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                weight_quant=weight_quant, input_quant=input_quant, quantization=quantization,
                implementation=implementation, kernel_metadata=kernel_metadata, rngs=rngs)
  width = 2 * mlp if gated else mlp
  gate_up = GroupedLinear(num_experts, embed, width, **common) if gated else None
  up = None if gated else GroupedLinear(num_experts, embed, width, **common)
  down = GroupedLinear(num_experts, mlp, embed, kernel_axes=("expert", "mlp", "embed"),
                       bias_axes=("expert", "embed"), **common)
  return gate_up, up, down


def expert_params(in_layer: GroupedLinear, down: GroupedLinear, dtype) -> dict[str, Any]:
  """The dispatch strategies' params: ``w_in``, ``w_down`` (and ``b_in``, ``b_down``), the
  kernels cast to the compute `dtype` unless quantized on the fly."""
  w_in, b_in = in_layer.weights(dtype)
  w_down, b_down = down.weights(dtype)
  params = dict(w_in=w_in, w_down=w_down)
  if b_in is not None:
    params.update(b_in=b_in, b_down=b_down)
  return params


def ffn_spec(num_experts: int, activation, gated: bool, fused: bool,
             in_layer: GroupedLinear, dtype, *, weight_on: str = "output",
             swiglu_limit: float = SWIGLU_LIMIT,
             swiglu_alpha: float = SWIGLU_ALPHA,
             gated_prologue: bool | None = None) -> ExpertFFN:
  """The static `ExpertFFN` of these experts (the gmm options from `in_layer`)."""
  options = in_layer.gmm_options(dtype)
  return ExpertFFN(num_experts, activation, gated, fused, tuple(sorted(options.items())),
                   weight_on=weight_on, swiglu_limit=float(swiglu_limit),
                   swiglu_alpha=float(swiglu_alpha),
                   gated_prologue=None if gated_prologue is None else bool(gated_prologue))
