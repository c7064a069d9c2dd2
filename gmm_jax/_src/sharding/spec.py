"""Sharding-aware gmm, the explicit form: `GmmSharding` says how the operands lie on a mesh
and gmm runs per shard with the matching strategy (`strategy.py`) under `jax.shard_map`
around the one differentiable gmm (so gradients are shard_map's transposes: the same
layouts, no hidden gathers). Under plain `jax.jit` the gmm primitive partitions itself with
the same strategies (op.py); this form is for code that wants the layout stated, or that
already runs inside a shard_map.

Floor 4: above the op and the quantized composition, below the public API.
"""

from __future__ import annotations

import dataclasses

import jax
from jax.sharding import Mesh, PartitionSpec as P

from gmm_jax._src.backends import quantized
from gmm_jax._src.sharding import strategy
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.core.qarray import QArray


@dataclasses.dataclass(frozen=True)
class GmmSharding:
  """How gmm's operands lie on a mesh: a PartitionSpec per stored operand.

  Args:
    mesh: a `jax.sharding.Mesh` (any axis types).
    lhs: spec of lhs as stored (``[M, K]``, or ``[K, M]`` if transpose_lhs).
    rhs: spec of rhs as stored (``[G, K, N]`` / ``[K, N]``, last two swapped if
      transpose_rhs). A QArray rhs uses it for its values and, where a scale dimension is
      not 1, for its scale.
  """

  mesh: Mesh
  lhs: P = P()
  rhs: P = P()


def plan(sharding: GmmSharding, cfg, lhs_ndim: int = 2,
         rhs_ndim: int | None = None) -> strategy.Plan:
  """The strategy for this call, or NotImplementedError naming the supported layouts."""
  return strategy.plan(dict(sharding.mesh.shape), cfg, sharding.lhs, sharding.rhs, lhs_ndim,
                       rhs_ndim)


def operand_spec(x, spec: P, mesh: Mesh):
  """The PartitionSpec of an operand as a pytree: a QArray's scale and zero point follow
  the values' spec where they are not broadcast."""
  if isinstance(x, QArray):
    leaves, tree = jax.tree.flatten(x)
    specs = strategy.leaf_specs([leaf.shape for leaf in leaves], spec, dict(mesh.shape))
    return jax.tree.unflatten(tree, specs)
  return spec


def explicit_axes(mesh) -> bool:
  """Whether a mesh has Explicit axes (shardings in the types)."""
  types = getattr(mesh, "axis_types", None) or ()
  return jax.sharding.AxisType.Explicit in tuple(types)


def axes_of(value) -> tuple[str, ...]:
  """Mesh axes as a tuple (None, one name, or a sequence of names)."""
  if value is None:
    return ()
  return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def token_layout(x, mesh=None, token_axes=None):
  """(mesh, token axes) of tokens x ``[..., K]``: the given ones, else what x's type carries
  on a mesh with Explicit axes (the axes of its leading dims), else the context mesh
  (`jax.set_mesh`) with unsharded tokens."""
  typed = getattr(jax.typeof(x), "sharding", None)
  typed_mesh = getattr(typed, "mesh", None)
  if mesh is None:
    if typed_mesh is not None and not typed_mesh.empty:
      mesh = typed_mesh
    elif not jax.sharding.get_abstract_mesh().empty:
      mesh = jax.sharding.get_abstract_mesh()
  if token_axes is None and typed_mesh is not None and not typed_mesh.empty:
    axes = []
    for entry in list(typed.spec)[:x.ndim - 1]:
      axes += [a for a in axes_of(entry) if a not in axes]
    token_axes = tuple(axes)
  return mesh, axes_of(token_axes)


def reshard(x, spec, mesh: Mesh):
  """x laid out as `spec` on `mesh` (a pytree of specs for a pytree x), as shard_map's
  in_specs need: on a mesh with Explicit axes the types must match the specs."""
  if not explicit_axes(mesh):
    return x
  return jax.tree.map(
      lambda a, s: None if a is None else jax.sharding.reshard(
          a, jax.sharding.NamedSharding(mesh, s)), x, spec, is_leaf=lambda a: a is None)


def sharded_gmm(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, sharding: GmmSharding):
  """Runs the (possibly quantized) gmm per shard with `plan`'s strategy."""
  p = plan(sharding, cfg, lhs.ndim, rhs.ndim)
  mesh = sharding.mesh
  m_global = lhs.shape[1] if cfg.transpose_lhs else lhs.shape[0]
  k_global = lhs.shape[0] if cfg.transpose_lhs else lhs.shape[1]
  for name, axes, size in (("M", p.m, m_global), ("K", p.k, k_global)):
    shards = p.shards("m" if name == "M" else "k")
    if size % shards:
      raise ValueError(f"{name}={size} is not divisible by its {shards} shards over {axes}")
  n_global = rhs.shape[-2] if cfg.transpose_rhs else rhs.shape[-1]
  if cfg.gated and n_global // 2 % p.shards("n"):
    raise ValueError(f"the {n_global // 2} output columns of the gated activation are not "
                     f"divisible by their {p.shards('n')} shards over {p.n} (each device "
                     "needs whole gate and up blocks of its output columns)")
  if cfg.group_type == "m" and cfg.num_local % p.shards("g"):
    raise ValueError(f"rhs holds {cfg.num_local} groups, not divisible by its "
                     f"{p.shards('g')} expert shards over {p.g}")

  def body(lhs, rhs, counts, group_offset, bias):
    return strategy.local_gmm(quantized.gmm_any, p, lhs, rhs, counts, group_offset, bias, cfg)

  in_specs = (operand_spec(lhs, sharding.lhs, mesh), operand_spec(rhs, sharding.rhs, mesh),
              P(), P(), None if bias is None else p.spec("bias"))
  operands = reshard((lhs, rhs, counts, group_offset, bias), in_specs, mesh)
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=p.spec("out"),
                     check_vma=False)
  return fn(*operands)
