"""Tile operations of the Mosaic TPU gmm kernels: what a kernel body does to its blocks.

The dot of blocks as stored (either layout of each side), the K masks, the dequantized
weight tile and the finishing epilogue of an output tile (the gated cotangent on tiles is
`common.gated_cotangent_tiles`); the activations as Mosaic lowers them
(`kernel_activation`, `GATED_PAIRS`) and which of their primitives it has no lowering rule
for (`unsupported_primitives`), which the plan checks before a compiled call.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from gmm_jax._src.core.config import GmmConfig
from gmm_jax.pallas import common


def kernel_activation(activation):
  """The activation as the kernel applies it: the exact GELU through ``lax.erf`` (Mosaic
  lowers erf but not the erfc that ``jax.nn.gelu(approximate=False)`` uses); others as
  given."""
  if activation == "gelu":
    return lambda x: 0.5 * x * (1.0 + lax.erf(x * 0.7071067811865476))
  return activation


# The gated activations on the gate and up halves, which the kernels keep in two blocks and
# accumulators ("geglu"'s gate through `kernel_activation`'s erf).
GATED_PAIRS = common.gated_pairs(kernel_activation)


def unsupported_primitives(activation) -> set[str]:
  """Primitives of `activation` without a Mosaic TPU (TensorCore) lowering rule
  (MissingJaxInternal, a NotImplementedError, where this jax has no readable table)."""
  return common.unsupported_activation_primitives(
      activation, "mosaic_tpu", kernel_activation=kernel_activation, pairs=GATED_PAIRS)


def unsupported_cotangent_primitives(name: str) -> set[str]:
  """Primitives of the gated-cotangent epilogue of `name` without a Mosaic TPU lowering
  (as `unsupported_primitives`)."""
  return common.unsupported_gated_primitives(GATED_PAIRS[name], "mosaic_tpu", cotangent=True)


def dot(x, w, cfg: GmmConfig, dot_dtype, acc_dtype):
  """``x @ w`` of blocks as stored (x: [M, K] or [K, M]; w: [K, N] or [N, K])."""
  if cfg.transpose_lhs:  # contract the sublane dim of x: transpose in VMEM first
    x = x.T
  rhs_contract = 1 if cfg.transpose_rhs else 0
  return lax.dot_general(
      x.astype(dot_dtype), w.astype(dot_dtype), (((1,), (rhs_contract,)), ((), ())),
      precision=cfg.precision, preferred_element_type=acc_dtype)


def mask_k(block, first, limit_lo, limit_hi, k_axis: int):
  """Zeroes the entries of `block` whose K index (``first`` + position) is outside
  ``[limit_lo, limit_hi)``."""
  index = first + lax.broadcasted_iota(jnp.int32, block.shape, k_axis)
  return jnp.where((index >= limit_lo) & (index < limit_hi), block, jnp.zeros((), block.dtype))


def dequantized(w_ref, scale_ref, zero_ref, cfg: GmmConfig, dot_dtype):
  """The weight tile ``(w - zero) * scale`` in the dot dtype (the composed XLA path's
  numerics); the scale/zero blocks are ``[1, tile_n]`` (``[tile_n, 1]`` when rhs is stored
  ``[N, K]``)."""
  return common.dequantize_tile(w_ref[...], scale_ref[...],
                                None if zero_ref is None else zero_ref[...],
                                cfg.transpose_rhs, dot_dtype)


def tile_epilogue(accs, biases, cfg: GmmConfig, row_weights=None):
  """`common.finish_tile` with this kernel's erf GELU: ``cast(activation(acc + bias) *
  row_weights)`` in f32, a gated activation on its gate and up accumulators (``accs`` holds
  both, `biases` their bias rows ``[1, tile_n]`` or None); `row_weights` ``[rows, 1]``."""
  return common.finish_tile(accs, biases, cfg.activation, cfg.out_dtype, row_weights,
                            kernel_activation=kernel_activation, pairs=GATED_PAIRS)
