"""Helpers shared by the Pallas kernels: tile sizes, edge masks, per-group bounds.

Kernels read the grouped layout only through `gmm_jax._src.layout` (work items, group
bounds); nothing here re-derives group offsets from a group list.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from gmm_jax._src import layout


def next_power_of_2(x: int) -> int:
  """The smallest power of 2 >= max(x, 1)."""
  return 1 << max(0, int(x) - 1).bit_length()


def power_of_2_tile(size: int, smallest: int, largest: int) -> int:
  """A power-of-2 tile covering `size` elements, clamped to ``[smallest, largest]``.

  `smallest` and `largest` must be powers of 2 (Triton blocks are; its dots need >= 16).
  """
  return min(largest, max(smallest, next_power_of_2(size)))


def edge_mask(first, size: int, limit) -> jax.Array:
  """bool ``[size]``: which of the indices ``first + [0, size)`` lie below `limit`."""
  return first + lax.iota(jnp.int32, size) < limit


def local_group_bounds(counts: jax.Array, dim_size: int, group_offset,
                       num_local: int) -> tuple[jax.Array, jax.Array]:
  """int32 ``[num_local]`` start and end of each local group along the grouped dimension.

  Local group ``g`` is global group ``group_offset + g``; one past the last global group it
  is empty (start == end == 0), so a kernel that loops over ``[start, end)`` does nothing.
  """
  bounds = layout.bounds_from_counts(counts, dim_size)
  first, end = layout.local_group_range(group_offset, num_local, counts.shape[0])
  global_ids = first + jnp.arange(num_local, dtype=jnp.int32)
  held = global_ids < end
  index = jnp.where(held, global_ids, 0)
  starts = jnp.where(held, bounds[index], 0)
  ends = jnp.where(held, bounds[index + 1], 0)
  return starts.astype(jnp.int32), ends.astype(jnp.int32)


def unsupported_primitives(fn, rules) -> set[str]:
  """Primitives of `fn` (traced on an f32 tile) that have no rule in `rules`.

  `rules` is a Pallas backend's lowering table (primitive -> rule). Best effort: a kernel
  calls this before building a pallas_call so that an activation it cannot lower raises
  NotImplementedError at trace time (the dispatcher then falls back), instead of failing
  when lowering.
  """
  if fn is None:
    return set()
  jaxpr = jax.make_jaxpr(fn)(jax.ShapeDtypeStruct((16, 128), jnp.float32))
  missing = set()

  def walk(inner):
    for eqn in inner.eqns:
      if eqn.primitive not in rules:
        missing.add(eqn.primitive.name)
      for param in eqn.params.values():
        for sub in param if isinstance(param, (tuple, list)) else (param,):
          sub = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr's Jaxpr
          if hasattr(sub, "eqns"):
            walk(sub)

  walk(jaxpr.jaxpr)
  return missing
