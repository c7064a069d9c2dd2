"""How the routed experts op splits over a mesh: the tokens' and the experts' mesh axes, the
strategy they make (local, experts, travel; see `partitioned`), and the notes of what was
gathered to get there.

Floor 6, with the op that reads it (`partitioned`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from jax.sharding import PartitionSpec as P

from gmm_jax._src.core import recording

STRATEGIES = ("local", "experts", "travel")


@dataclasses.dataclass(frozen=True)
class Layout:
  """How one call splits: the mesh axes of the tokens and of the experts, and the strategy
  (`STRATEGIES`, see `partitioned`). Static."""

  token_axes: tuple[str, ...] = ()
  expert_axes: tuple[str, ...] = ()
  token_shards: int = 1
  expert_shards: int = 1
  platform: str | None = None  # the mesh's devices' (None: every branch traced)
  mesh: Any = None  # the partitioner's mesh (its devices' kind picks the transport)

  @property
  def strategy(self) -> str:
    if not self.expert_axes:
      return "local"
    return "travel" if set(self.expert_axes) <= set(self.token_axes) else "experts"

  @property
  def weight_sum_axes(self) -> tuple[str, ...]:
    """The axes a weight gradient is summed over: tokens split there, weights not."""
    return tuple(a for a in self.token_axes if a not in self.expert_axes)


def entry_axes(entry) -> tuple[str, ...]:
  """The mesh axes of one entry of a PartitionSpec."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def dim_axes(shape, dim: int) -> tuple[str, ...]:
  """The mesh axes dimension `dim` of a value (or ShapeDtypeStruct) is sharded over."""
  spec = getattr(getattr(shape, "sharding", None), "spec", None) or ()
  return entry_axes(spec[dim]) if len(spec) > dim else ()


def spec_entry(axes):
  """The PartitionSpec entry of `axes` (None, one name or a tuple of names)."""
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def choose_layout(mesh_shape: dict[str, int], x_shape, token_axes, expert_axes,
                  num_experts: int) -> tuple[Layout, tuple[str, ...]]:
  """The layout for tokens sharded over `token_axes` and expert weights over `expert_axes`
  (as they arrive), with the notes of what was changed: axes that do not divide the tokens
  or the experts are dropped (those operands are gathered along them); an expert axis that
  shares only part of the token axes is kept (`experts` over the rest, tokens gathered)."""
  notes = []
  token_axes = tuple(a for a in token_axes if mesh_shape.get(a, 1) > 1)
  expert_axes = tuple(a for a in expert_axes if mesh_shape.get(a, 1) > 1)
  tokens = math.prod(mesh_shape[a] for a in token_axes)
  if tokens > 1 and x_shape[0] % tokens:
    notes.append(f"{x_shape[0]} tokens do not split over {token_axes}: gathered")
    token_axes, tokens = (), 1
  experts = math.prod(mesh_shape[a] for a in expert_axes)
  if experts > 1 and num_experts % experts:
    notes.append(f"{num_experts} experts do not split over {expert_axes}: gathered")
    expert_axes, experts = (), 1
  if len(expert_axes) > 1 and set(expert_axes) <= set(token_axes):
    # The transports move rows over one axis: experts over several are gathered.
    notes.append(f"experts over several axes {expert_axes} with tokens there too: gathered")
    expert_axes, experts = (), 1
  if expert_axes and not set(expert_axes) <= set(token_axes) and set(expert_axes) & set(
      token_axes):
    notes.append(f"tokens over {token_axes} and experts over {expert_axes} overlap "
                 "partly: tokens gathered along the shared axes")
    token_axes = tuple(a for a in token_axes if a not in expert_axes)
    tokens = math.prod(mesh_shape[a] for a in token_axes)
  return Layout(token_axes, expert_axes, tokens, experts), tuple(notes)


_RECORDERS: list[list] = []


def note_layout(layout: Layout, notes) -> None:
  """Called with the layout a call of the op was split by, and the notes of its choice."""
  for recorder in _RECORDERS:
    recorder.append((layout, notes))


def record_layouts():
  """A context collecting the (Layout, notes) the partitioner chose for the expert ops
  compiled inside it (forward and backward)."""
  return recording.collecting(_RECORDERS)
