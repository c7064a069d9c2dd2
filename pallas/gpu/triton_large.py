"""Large operands of the Pallas Triton kernels: 1-byte operands read as 16-bit words.

An operand of 2**31 or more 1-byte elements reaches the kernel as 16-bit words and its
tiles are unpacked in-kernel (`needs_words`, `unpack`), because Pallas Triton indexes such
an operand with 32-bit offsets that would wrap. The wrapper (`triton`) converts the
operands (`word_operands`); the kernel bodies (`triton_kernel`) load their words.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from gmm_jax._src.core.config import GmmConfig, Tiling

# Pallas Triton (jax 0.10 to 0.12) computes the element offsets of a load or store in 32
# bits unless the operand holds more than 2**32 bytes, and Triton adds them to the pointer
# as signed numbers: an operand of 2**31 or more 1-byte elements (and at most 2**32 bytes)
# would be read at wrapped, negative offsets. DeepSeek-V3's fp8 experts [256, 7168, 2048]
# hold 3.76e9. Such an operand reaches the kernel as uint16 words (a bitcast, no copy: two
# elements a word, so fewer than 2**31 words) and the kernel unpacks its tiles; every
# smaller operand keeps its own dtype and 32-bit offsets.
OFFSET_LIMIT = 2**31  # elements that signed 32-bit offsets address
_WORD = jnp.uint16


def needs_words(x) -> bool:
  """Whether operand `x` reaches the kernels as words: 1-byte elements, at least
  `OFFSET_LIMIT` of them, at most 2**32 bytes (past that jax indexes in 64 bits)."""
  return np.dtype(x.dtype).itemsize == 1 and OFFSET_LIMIT <= math.prod(x.shape) <= 2**32


def as_words(x: jax.Array) -> jax.Array:
  """``[..., C]`` of a 1-byte dtype (C even) -> ``[..., C / 2]`` uint16, little-endian: a
  word's low byte is the element with the lower index."""
  pairs = x.reshape(*x.shape[:-1], x.shape[-1] // 2, 2)
  if pairs.dtype != jnp.uint8:
    pairs = lax.bitcast_convert_type(pairs, jnp.uint8)
  return lax.bitcast_convert_type(pairs, _WORD)


def unpack(words: jax.Array, dtype) -> jax.Array:
  """The inverse of `as_words` on a tile: ``[r, w]`` uint16 -> ``[r, 2w]`` of `dtype`."""
  low = (words & 0xFF).astype(jnp.uint8)
  high = (words >> 8).astype(jnp.uint8)
  pairs = jnp.stack([low, high], axis=-1)  # Triton joins them
  return lax.bitcast_convert_type(pairs.reshape(words.shape[0], 2 * words.shape[1]), dtype)



def word_operands(lhs, rhs, out_shape, out_dtype, cfg: GmmConfig, tiling: Tiling):
  """(lhs, rhs, lhs elements, rhs elements): an operand that `needs_words` as words, its
  element dtype beside it (None for the others).

  Raises:
    NotImplementedError: such an operand the kernels cannot read as words (k-grouping, a
      transposed lhs, an odd minor dimension or tile start), or such an output.
  """
  if needs_words(jax.ShapeDtypeStruct(out_shape, out_dtype)):
    raise NotImplementedError(
        f"the Triton kernels address at most {OFFSET_LIMIT} elements of a 1-byte output; "
        f"got {out_shape} {np.dtype(out_dtype).name}")
  big_lhs, big_rhs = needs_words(lhs), needs_words(rhs)
  if not big_lhs and not big_rhs:
    return lhs, rhs, None, None
  n = rhs.shape[-2] if cfg.transpose_rhs else rhs.shape[-1]
  # The minor dimension's tiles start at multiples of tile_k (K) or tile_n (N; the up half
  # of a gated product N / 2 columns later), so they are word-aligned when these are even.
  aligned = (cfg.group_type == "m" and not (big_lhs and cfg.transpose_lhs)
             and n % (4 if cfg.gated else 2) == 0 and lhs.shape[-1] % 2 == 0
             and tiling.tile_k % 2 == 0 and tiling.tile_n % 2 == 0
             and jnp.dtype(rhs.dtype) != jnp.int4 and jnp.dtype(lhs.dtype) != jnp.int4)
  if not aligned:
    raise NotImplementedError(
        f"the Triton kernels read an operand of {OFFSET_LIMIT} or more 1-byte elements as "
        "16-bit words, for m-grouping with an even minor dimension (lhs not transposed); "
        f"got {cfg.group_type}-grouping, lhs {lhs.shape} {lhs.dtype}, rhs {rhs.shape} "
        f"{rhs.dtype}, transpose_lhs={cfg.transpose_lhs}")
  return (as_words(lhs) if big_lhs else lhs, as_words(rhs) if big_rhs else rhs,
          np.dtype(lhs.dtype) if big_lhs else None, np.dtype(rhs.dtype) if big_rhs else None)
