"""Sharding-aware gmm: a strategy per layout of the operands on a device mesh, run with
`jax.shard_map` around the one differentiable gmm (so gradients are shard_map's transposes:
the same layouts, no hidden gathers).

Floor 4: above the op and the quantized composition, below the public API.

Strategies (m-grouping; lhs ``[M, K]``, rhs ``[G, K, N]``, by mesh axis):
  expert     rhs sharded on G over axis e: each device holds G/e experts, computes only
             their rows (``group_offset = axis_index(e) * G/e``; other rows are exactly 0)
             and one psum over e combines the rows. The weights are never gathered.
  rows       lhs sharded on M over axis d (and the output too): each device clips the global
             group offsets to its row range to get its local group sizes. No communication.
  columns    rhs (and bias, output) sharded on N: no communication.
  contraction  lhs and rhs sharded on K over the same axis t: partial products, one psum
             over t, then the bias and activation (which must see the full sum).
k-grouping (lhs ``[M, K]`` with K grouped, rhs ``[K, N]``; the weight gradient):
  contraction  the grouped K sharded over d in both: each device clips the global offsets
             to its K range, runs the local k-gmm and one psum over d combines the groups.
  rows / columns  M of lhs or N of rhs sharded: no communication.
Axes combine (e.g. expert on one axis and rows on another).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from gmm_jax._src import metadata, quantized
from gmm_jax._src.config import GmmConfig
from gmm_jax._src.epilogue import finish
from gmm_jax._src.qarray import QArray


@dataclasses.dataclass(frozen=True)
class GmmSharding:
  """How gmm's operands lie on a mesh: a PartitionSpec per stored operand.

  Args:
    mesh: a `jax.sharding.Mesh`.
    lhs: spec of lhs as stored (``[M, K]``, or ``[K, M]`` if transpose_lhs).
    rhs: spec of rhs as stored (``[G, K, N]`` / ``[K, N]``, last two swapped if
      transpose_rhs). A QArray rhs uses it for its values and, where a scale dimension is
      not 1, for its scale.
  """

  mesh: Mesh
  lhs: P = P()
  rhs: P = P()


@dataclasses.dataclass(frozen=True)
class Plan:
  """A chosen strategy: the logical dims' mesh axes, collectives and the reasons."""

  group_type: str
  m: tuple[str, ...]
  k: tuple[str, ...]
  n: tuple[str, ...]
  experts: tuple[str, ...]  # m-grouping: rhs group dim
  strategies: tuple[str, ...]
  reduce_over: tuple[str, ...]
  out_spec: P
  notes: tuple[str, ...]

  def describe(self) -> str:
    lines = [f"sharding strategy: {' + '.join(self.strategies) or 'replicated'}"]
    lines += [f"  - {note}" for note in self.notes]
    if self.reduce_over:
      lines.append(f"  collectives: one psum over {self.reduce_over} of the output")
    else:
      lines.append("  collectives: none")
    lines.append(f"  output spec: {self.out_spec}")
    return "\n".join(lines)


def _axes(entry) -> tuple[str, ...]:
  if entry is None:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def _spec_dims(spec: P, ndim: int) -> list[tuple[str, ...]]:
  entries = list(spec) + [None] * (ndim - len(spec))
  if len(entries) != ndim:
    raise ValueError(f"PartitionSpec {spec} has more entries than the operand's {ndim} dims")
  return [_axes(e) for e in entries]


def plan(sharding: GmmSharding, cfg, lhs_ndim: int = 2, rhs_ndim: int | None = None) -> Plan:
  """The strategy for this call, or NotImplementedError naming the supported layouts."""
  rhs_ndim = rhs_ndim or (3 if cfg.group_type == "m" else 2)
  lhs_dims = _spec_dims(sharding.lhs, lhs_ndim)
  rhs_dims = _spec_dims(sharding.rhs, rhs_ndim)
  for axes in lhs_dims + rhs_dims:
    for axis in axes:
      if axis not in sharding.mesh.axis_names:
        raise ValueError(f"mesh axis {axis!r} is not in the mesh {sharding.mesh.axis_names}")
  lhs_m, lhs_k = (lhs_dims[1], lhs_dims[0]) if cfg.transpose_lhs else (lhs_dims[0], lhs_dims[1])
  experts = rhs_dims[0] if cfg.group_type == "m" else ()
  rk, rn = rhs_dims[-2:]
  rhs_k, rhs_n = (rn, rk) if cfg.transpose_rhs else (rk, rn)
  supported = ("supported: rhs experts sharded (expert parallel), lhs rows sharded, N "
               "sharded, or K sharded identically on both operands, on distinct mesh axes")
  if lhs_k != rhs_k:
    raise NotImplementedError(
        f"lhs and rhs shard K differently ({lhs_k or 'replicated'} vs {rhs_k or 'replicated'}); "
        f"{supported}")
  used = [a for axes in (lhs_m, lhs_k, rhs_n, experts) for a in axes]
  if len(used) != len(set(used)):
    if set(experts) & set(lhs_m):
      raise NotImplementedError(
          f"tokens (lhs M) and experts share the mesh axes {sorted(set(experts) & set(lhs_m))}: "
          "tokens must first be routed to their experts' devices (gmm_jax.routed_gmm does it "
          f"with an all-to-all); {supported}")
    raise NotImplementedError(f"a mesh axis shards two dimensions {used}; {supported}")
  strategies, notes, reduce_over = [], [], []
  if experts:
    strategies.append("expert")
    notes.append(f"rhs groups sharded over {experts}: each device runs its local experts "
                 "(group_offset) and the rows are combined by a psum; weights never gathered")
    reduce_over += experts
  if lhs_m:
    strategies.append("rows")
    notes.append(f"lhs rows sharded over {lhs_m}: local group sizes from the global offsets "
                 "clipped to each shard's rows; lhs never gathered")
  if rhs_n:
    strategies.append("columns")
    notes.append(f"N sharded over {rhs_n}: no communication")
  if lhs_k:
    strategies.append("contraction")
    if cfg.group_type == "m":
      notes.append(f"K sharded over {lhs_k}: partial products, psum, then bias/activation")
    else:
      notes.append(f"the grouped K sharded over {lhs_k}: local group sizes from the clipped "
                   "offsets, local k-gmm, psum, then bias/activation")
    reduce_over += lhs_k
  if cfg.group_type == "m":
    out_spec = P(_entry(lhs_m), _entry(rhs_n))
  else:
    out_spec = P(None, _entry(lhs_m), _entry(rhs_n))
  return Plan(cfg.group_type, lhs_m, lhs_k, rhs_n, experts, tuple(strategies),
              tuple(reduce_over), out_spec, tuple(notes))


def _linear_index(axes: tuple[str, ...]):
  """This device's position along the (possibly several) mesh axes of one dimension."""
  index = jnp.int32(0)
  for axis in axes:
    index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return index


def _leaf_spec(leaf_shape, value_shape, dims: list[tuple[str, ...]], mesh: Mesh) -> P:
  """A QArray component's spec: the value's axes where the component is not broadcast."""
  entries = []
  for size, full, axes in zip(leaf_shape, value_shape, dims):
    if not axes or size == 1:
      entries.append(None)
      continue
    shards = int(np.prod([mesh.shape[a] for a in axes]))
    if size == full or (size % shards == 0 and (full // shards) % (full // size or 1) == 0):
      entries.append(_entry(axes))
    else:
      raise NotImplementedError(
          f"a quantization scale of {size} entries along a dimension of {full} cannot be "
          f"split over {axes} ({shards} shards) at tile boundaries")
  return P(*entries)


def operand_spec(x, spec: P, mesh: Mesh):
  """The PartitionSpec of an operand as a pytree: a QArray's scale and zero point follow
  the values' spec where they are not broadcast."""
  if isinstance(x, QArray):
    dims = _spec_dims(spec, x.ndim)
    parts = [P(*[_entry(d) for d in dims]), _leaf_spec(x.scale.shape, x.shape, dims, mesh),
             None if x.zero_point is None else _leaf_spec(x.zero_point.shape, x.shape, dims,
                                                          mesh)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x),
                                        [p for p in parts if p is not None])
  return spec


def _local_qarray(x):
  """A QArray shard (shard_map hands over the components' local blocks)."""
  if not isinstance(x, QArray):
    return x
  tile = tuple(min(t, s) for t, s in zip(x.tile, x.qvalue.shape))
  return QArray(x.qvalue, x.scale, x.zero_point, tile=tile)


def _finish_after_reduction(z, counts, group_offset, bias, cfg: GmmConfig):
  """Bias, activation and cast of a K-reduced f32 pre-activation."""
  mask = None
  if cfg.group_type == "m":
    ids = metadata.row_group_ids(counts, z.shape[0], group_offset, cfg.num_local)
    mask = ids >= 0
    if bias is not None:
      z = z + bias.astype(jnp.float32)[jnp.maximum(ids, 0)]
  elif bias is not None:
    z = z + bias.astype(jnp.float32)[:, None, :]
  return finish(z, cfg.activation, cfg.out_dtype, row_mask=mask)


def sharded_gmm(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, sharding: GmmSharding):
  """Runs the (possibly quantized) gmm per shard with `plan`'s strategy."""
  run = quantized.gmm_any
  p = plan(sharding, cfg, lhs.ndim, rhs.ndim)
  mesh = sharding.mesh
  m_global = lhs.shape[1] if cfg.transpose_lhs else lhs.shape[0]
  k_global = lhs.shape[0] if cfg.transpose_lhs else lhs.shape[1]
  for name, axes, size in (("M", p.m, m_global), ("K", p.k, k_global)):
    shards = int(np.prod([mesh.shape[a] for a in axes])) if axes else 1
    if size % shards:
      raise ValueError(f"{name}={size} is not divisible by its {shards} shards over {axes}")
  num_experts_shards = int(np.prod([mesh.shape[a] for a in p.experts])) if p.experts else 1
  if cfg.group_type == "m" and cfg.num_local % num_experts_shards:
    raise ValueError(f"rhs holds {cfg.num_local} groups, not divisible by its "
                     f"{num_experts_shards} expert shards over {p.experts}")
  local_cfg = cfg.replace(num_local=cfg.num_local // num_experts_shards)
  reduce_k = bool(p.k)
  bias_entry = (_entry(p.experts) if cfg.group_type == "m" else None, _entry(p.n))

  def body(lhs, rhs, counts, group_offset, bias):
    lhs, rhs = _local_qarray(lhs), _local_qarray(rhs)
    offset = group_offset
    if p.experts:
      offset = offset + _linear_index(p.experts) * local_cfg.num_local
    local_counts = counts
    if cfg.group_type == "m" and p.m:
      rows = m_global // int(np.prod([mesh.shape[a] for a in p.m]))
      local_counts = metadata.counts_in_range(counts, _linear_index(p.m) * rows, rows)
    if p.k:
      cols = k_global // int(np.prod([mesh.shape[a] for a in p.k]))
      if cfg.group_type == "k":
        local_counts = metadata.counts_in_range(counts, _linear_index(p.k) * cols, cols)
    if reduce_k:
      # Partial sums: the bias and activation must see the whole sum.
      z = run(lhs, rhs, local_counts, offset, None,
              local_cfg.replace(activation=None, out_dtype=np.dtype(jnp.float32)))
      z = jax.lax.psum(z, p.k)
      if p.experts:  # every device then holds all groups' rows: finished below
        z = jax.lax.psum(z, p.experts)
      return z
    out = run(lhs, rhs, local_counts, offset, bias, local_cfg)
    if p.experts:
      out = jax.lax.psum(out, p.experts)
    return out

  in_specs = (operand_spec(lhs, sharding.lhs, mesh), operand_spec(rhs, sharding.rhs, mesh),
              P(), P(), None if bias is None else P(*bias_entry))
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=p.out_spec,
                     check_vma=False)
  out = fn(lhs, rhs, counts, group_offset, bias)
  if reduce_k:
    # Bias and activation after the reduction, with the global group list (rows are still
    # sharded on M and N as the plan says; XLA keeps this elementwise step local).
    out = _finish_after_reduction(out, counts, group_offset, bias, cfg)
  return out
