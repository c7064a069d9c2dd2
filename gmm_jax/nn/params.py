"""Parameters with logical axis names, created sharded (as nnx.Linear's), and the layers'
output resharding: the helpers every layer of `gmm_jax.nn` builds its variables with."""

from __future__ import annotations

from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from gmm_jax._src.sharding.spec import explicit_axes


def _resolve_names(names):
  """Logical names -> mesh axis names under the context's ``logical_axis_rules``."""
  try:
    from flax.core import spmd
    return tuple(spmd.apply_rules(tuple(names), None))
  except Exception:  # flax without the rules helpers: the names are the mesh axes
    return tuple(names)


def _eager_shard(value, names):
  """`value` sharded over the axes of the context mesh named by `names` (nnx.Linear's eager
  sharding, on the names that are mesh axes; the others replicate)."""
  try:
    if not nnx.using_eager_sharding():
      return value
  except AttributeError:  # flax < 0.12: no eager sharding
    return value
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty or not names:
    return value
  spec = [name if isinstance(name, str) and name in mesh.axis_names else None
          for name in _resolve_names(names)]
  if not any(spec):
    return value
  sharding = NamedSharding(mesh, P(*spec))
  axis_types = set(mesh.axis_types)
  if axis_types == {jax.sharding.AxisType.Explicit}:
    return jax.sharding.reshard(value, sharding)
  if axis_types == {jax.sharding.AxisType.Auto}:
    return jax.lax.with_sharding_constraint(value, sharding)
  return value


def _context_rules() -> tuple:
  try:
    from flax.core import spmd
    return tuple(spmd.get_logical_axis_rules() or ())
  except Exception:  # flax without the rules helpers
    return ()


def _unmapped(names) -> tuple:
  """Rules ``(name, None)`` for the logical names that neither the context mesh has as an
  axis nor the context's ``logical_axis_rules`` map: under a mesh they replicate, as
  `_eager_shard` lays them out (flax resolves a parameter's names against the context mesh
  when it builds abstract parameters, `nnx.eval_shape`, and refuses a name it lacks)."""
  mesh = jax.sharding.get_abstract_mesh()
  if mesh.empty:
    return ()
  ruled = {alias for alias, _ in _context_rules()}
  return tuple((name, None) for name in dict.fromkeys(names)
               if isinstance(name, str) and name not in mesh.axis_names and name not in ruled)


def mesh_axes(variable, mesh) -> tuple:
  """The mesh axis (or None) of each dim of a parameter made by `param`, on `mesh`: its
  logical names through the context's ``logical_axis_rules``, names that are not axes of
  `mesh` (or are axes of one device) None."""
  names = ()
  for key in ("out_sharding", "sharding_names", "sharding"):
    names = getattr(variable, key, None) or ()
    if names:
      break
  sizes = dict(zip(mesh.axis_names, mesh.axis_sizes))
  return tuple(name if isinstance(name, str) and sizes.get(name, 1) > 1 else None
               for name in _resolve_names(tuple(names)))


def auto_mesh(x):
  """The mesh with Auto axes a layer's call on x runs on (x's placement as its type names
  it, else the context mesh of `jax.set_mesh`), None where there is none or its axes are
  Explicit (there the types carry the layout)."""
  mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
  if mesh is None or mesh.empty:
    mesh = jax.sharding.get_abstract_mesh()
  types = tuple(getattr(mesh, "axis_types", None) or ())
  if (mesh.empty or any(t != jax.sharding.AxisType.Auto for t in types)
      or not any(s > 1 for s in mesh.axis_sizes)):
    return None  # Explicit axes (the gmm splits by the types) or manual ones (shard_map)
  return mesh


def param(value, axes: tuple[str, ...], metadata: Mapping[str, Any] | None = None,
          kind=None) -> nnx.Variable:
  """An nnx.Param (or `kind`) with logical axis names, across flax versions' metadata names
  (0.12: ``out_sharding``; the eager sharding is ours, `_eager_shard`, so that logical names
  that are not mesh axes need no mesh). `metadata` (e.g. ``kernel_metadata``) is added; an
  ``out_sharding`` in it replaces `axes`."""
  kind = kind or nnx.Param
  metadata = dict(metadata or {})
  axes = tuple(metadata.pop("out_sharding", axes))
  eager = metadata.pop("eager_sharding", True)
  if eager:
    value = _eager_shard(value, axes)
  rules = _unmapped(axes)
  first = dict(out_sharding=axes, eager_sharding=False)
  if rules:
    first["sharding_rules"] = rules
  for names in (first, dict(out_sharding=axes, eager_sharding=False), dict(sharding_names=axes),
                dict(sharding=axes)):
    try:
      return kind(value, **names, **metadata)
    except (TypeError, ValueError):
      continue
  return kind(value, **metadata)


def reshard(y, sharding):
  """y laid out as `sharding` (a NamedSharding, or a PartitionSpec of the context mesh), as
  nnx.Linear's ``out_sharding``: a reshard on Explicit axes, a constraint on Auto ones."""
  if sharding is None:
    return y
  mesh = getattr(sharding, "mesh", None)
  if mesh is None:
    mesh = jax.sharding.get_abstract_mesh()
    sharding = NamedSharding(mesh, sharding)
  if explicit_axes(mesh):
    return jax.sharding.reshard(y, sharding)
  return jax.lax.with_sharding_constraint(y, sharding)


def replicated_last(logits):
  """`logits` whole along their last dim (the experts: top_k needs them), on any mesh: on
  Explicit axes a router kernel sharded over experts would otherwise shard them."""
  typed = getattr(jax.typeof(logits), "sharding", None)
  if typed is None or typed.mesh.empty or not explicit_axes(typed.mesh):
    return logits
  spec = list(typed.spec) + [None] * (logits.ndim - len(typed.spec))
  if spec[-1] is None:
    return logits
  return jax.sharding.reshard(logits, NamedSharding(typed.mesh, P(*spec[:-1], None)))

