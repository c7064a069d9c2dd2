"""The routed experts' FFN variants: gated (``[E, D, 2F]`` gate|up kernel) or plain
(``[E, D, F]``), their activations, biases and quantization, as the layers that hold the
parameters and as the static `ExpertFFN` the dispatch strategies
(`gmm_jax._src.experts`) run."""

from __future__ import annotations

from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp

from gmm_jax import QuantSpec
from gmm_jax.nn.grouped_linear import GroupedLinear
from gmm_jax._src.epilogue import GATED_ACTIVATIONS, resolve_activation
from gmm_jax._src.experts import GATED_NAMES, ExpertFFN

Array = jax.Array


def check_activation(activation, gated: bool):
  """ValueError unless `activation` suits the FFN: for gated FFNs a name of `GATED_NAMES`
  or a callable on the gate half, for plain ones a `gmm_jax.ACTIVATIONS` name or a
  callable."""
  if gated and isinstance(activation, str) and activation not in GATED_NAMES:
    raise ValueError(f"gated activation must be one of {sorted(GATED_NAMES)} or a "
                     f"callable, got {activation!r}")
  if not gated:
    resolve_activation(activation)


def gated_activation(activation) -> Callable[[Array], Array]:
  """The gated activation ``[..., 2F] -> [..., F]`` (gate half first) of a gated FFN's
  `activation` (a plain name of `GATED_NAMES` or a callable on the gate half)."""
  if callable(activation):
    def gated(z):
      half = z.shape[-1] // 2
      return activation(z[..., :half]) * z[..., half:]
    return gated
  return GATED_ACTIVATIONS[GATED_NAMES[activation]]


def expert_layers(num_experts: int, embed: int, mlp: int, *, gated: bool, use_bias: bool,
                  dtype: Any, param_dtype: Any, weight_quant: QuantSpec | None,
                  input_quant: QuantSpec | None, implementation: str | None,
                  kernel_metadata: Mapping[str, Any] | None, rngs):
  """The routed experts' parameter layers, each a `GroupedLinear`: (``gate_up``
  ``[E, D, 2F]`` or None, ``up`` ``[E, D, F]`` or None, ``down`` ``[E, F, D]``): gated FFNs
  have ``gate_up`` (the gate half first), plain ones ``up``."""
  common = dict(use_bias=use_bias, dtype=dtype, param_dtype=param_dtype,
                weight_quant=weight_quant, input_quant=input_quant,
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
             in_layer: GroupedLinear, dtype) -> ExpertFFN:
  """The static `ExpertFFN` of these experts (the gmm options from `in_layer`)."""
  options = in_layer.gmm_options(dtype)
  return ExpertFFN(num_experts, activation, gated, fused, tuple(sorted(options.items())))
