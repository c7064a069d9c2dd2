"""Sharding-aware gmm: a strategy per layout of the operands on a device mesh, run with
`jax.shard_map` around the one differentiable gmm (so gradients are shard_map's transposes:
the same layouts, no hidden gathers).

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
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from gmm_jax._src import layout, quant


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


def _clip_counts(counts, start, size):
  """Group sizes of the global list restricted to the index range [start, start + size)."""
  bounds = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(counts.astype(jnp.int32))])
  clipped = jnp.clip(bounds, start, start + size)
  return (clipped[1:] - clipped[:-1]).astype(jnp.int32)


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


def _operand_spec(x, spec: P, mesh: Mesh):
  if isinstance(x, quant.QArray):
    dims = _spec_dims(spec, x.ndim)
    parts = [P(*[_entry(d) for d in dims]), _leaf_spec(x.scale.shape, x.shape, dims, mesh),
             None if x.zero_point is None else _leaf_spec(x.zero_point.shape, x.shape, dims,
                                                          mesh)]
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(x),
                                        [p for p in parts if p is not None])
  return spec


def _local_qarray(x):
  """A QArray shard (shard_map hands over the components' local blocks)."""
  if not isinstance(x, quant.QArray):
    return x
  tile = tuple(min(t, s) for t, s in zip(x.tile, x.qvalue.shape))
  return quant.QArray(x.qvalue, x.scale, x.zero_point, tile=tile)


def sharded_gmm(lhs, rhs, counts, group_offset, bias, cfg, sharding: GmmSharding, run,
                finish_fn):
  """Runs ``run(lhs, rhs, counts, group_offset, bias, cfg)`` per shard with `plan`'s
  strategy. `finish_fn(z, counts, group_offset, bias, cfg)` applies bias/activation/cast
  after a K reduction."""
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
      local_counts = _clip_counts(counts, _linear_index(p.m) * rows, rows)
    if p.k:
      cols = k_global // int(np.prod([mesh.shape[a] for a in p.k]))
      if cfg.group_type == "k":
        local_counts = _clip_counts(counts, _linear_index(p.k) * cols, cols)
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

  in_specs = (_operand_spec(lhs, sharding.lhs, mesh), _operand_spec(rhs, sharding.rhs, mesh),
              P(), P(), None if bias is None else P(*bias_entry))
  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=p.out_spec,
                     check_vma=False)
  out = fn(lhs, rhs, counts, group_offset, bias)
  if reduce_k:
    # Bias and activation after the reduction, with the global group list (rows are still
    # sharded on M and N as the plan says; XLA keeps this elementwise step local).
    out = finish_fn(out, counts, group_offset, bias, cfg)
  return out


# ------------------------------------------------------------- tokens routed to experts


def _emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets,
                                recv_sizes, *, axis_name):
  """`jax.lax.ragged_all_to_all`'s documented semantics (one slice per device) from
  all_gather and scatters: XLA:CPU has no ragged-all-to-all, so CPU runs (and the tests)
  use this; accelerators use the real collective."""
  del recv_sizes
  me = jax.lax.axis_index(axis_name)
  sources = jax.lax.all_gather(operand, axis_name)  # [D, rows, ...]
  offsets = jax.lax.all_gather(input_offsets, axis_name)  # [D, D]
  sizes = jax.lax.all_gather(send_sizes, axis_name)
  destinations = jax.lax.all_gather(output_offsets, axis_name)
  rows = jnp.arange(operand.shape[0], dtype=jnp.int32)
  result = output
  for source in range(sources.shape[0]):
    valid = rows < sizes[source, me]
    target = jnp.where(valid, destinations[source, me] + rows, output.shape[0])
    picked = jnp.take(sources[source], jnp.clip(offsets[source, me] + rows, 0,
                                                operand.shape[0] - 1), axis=0)
    result = result.at[target].set(picked, mode="drop")
  return result


def _route_dense(x, ids, *, axis, num_devices, local_experts, capacity, compute):
  """all_to_all with [devices, capacity] buffers each way."""
  tokens, k = x.shape
  order = jnp.argsort(ids, stable=True)  # by destination device, then expert
  ids_sorted = ids[order]
  dest = ids_sorted // local_experts
  dest_counts = jnp.bincount(dest, length=num_devices)
  dest_start = jnp.cumsum(dest_counts) - dest_counts
  rank = jnp.arange(tokens, dtype=jnp.int32) - dest_start[dest]
  kept = rank < capacity
  slot = jnp.where(kept, dest * capacity + rank, num_devices * capacity)  # spill slot
  send = jnp.zeros((num_devices * capacity + 1, k), x.dtype).at[slot].set(x[order])
  send_ids = jnp.full((num_devices * capacity + 1,), local_experts, jnp.int32).at[slot].set(
      ids_sorted % local_experts)
  send = send[:-1].reshape(num_devices, capacity, k)
  send_ids = send_ids[:-1].reshape(num_devices, capacity)
  recv = jax.lax.all_to_all(send, axis, 0, 0, tiled=False).reshape(-1, k)
  recv_ids = jax.lax.all_to_all(send_ids, axis, 0, 0, tiled=False).reshape(-1)
  y_recv = compute(recv, recv_ids)
  back = jax.lax.all_to_all(y_recv.reshape(num_devices, capacity, -1), axis, 0, 0,
                            tiled=False).reshape(num_devices * capacity, -1)
  back = jnp.concatenate([back, jnp.zeros((1, back.shape[1]), back.dtype)])
  y_sorted = back[slot]
  return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


def _route_ragged(x, ids, *, axis, num_devices, local_experts, capacity, compute, collective):
  """ragged_all_to_all: only the routed rows travel (buffers still sized for the worst
  case, [devices x capacity] rows)."""
  tokens, k = x.shape
  order = jnp.argsort(ids, stable=True)
  ids_sorted = ids[order]
  dest = ids_sorted // local_experts
  counts = jnp.bincount(dest, length=num_devices).astype(jnp.int32)
  starts = (jnp.cumsum(counts) - counts).astype(jnp.int32)
  send_sizes = jnp.minimum(counts, capacity)  # rows past a pair's capacity stay home
  # matrix[s, d]: rows device s sends to device d (every device needs the whole matrix to
  # know where its rows land on the receivers).
  matrix = jax.lax.all_gather(send_sizes, axis)
  me = jax.lax.axis_index(axis)
  before = jnp.cumsum(matrix, axis=0) - matrix  # rows from lower sources, per receiver
  output_offsets = before[me]
  recv_sizes = matrix[:, me]
  buffer_rows = num_devices * capacity
  recv = collective(x[order], jnp.zeros((buffer_rows, k), x.dtype), starts, send_sizes,
                    output_offsets, recv_sizes, axis_name=axis)
  recv_ids = collective((ids_sorted % local_experts).astype(jnp.int32),
                        jnp.full((buffer_rows,), local_experts, jnp.int32), starts, send_sizes,
                        output_offsets, recv_sizes, axis_name=axis)
  y_recv = compute(recv, recv_ids)
  # Back: the rows received from source s (contiguous, in source order) return to where s
  # took them from, its `starts[me]`.
  recv_starts = (jnp.cumsum(recv_sizes) - recv_sizes).astype(jnp.int32)
  home_offsets = jax.lax.all_gather(starts, axis)[:, me]
  y_sorted = collective(y_recv, jnp.zeros((tokens, y_recv.shape[1]), y_recv.dtype),
                        recv_starts, recv_sizes, home_offsets, send_sizes, axis_name=axis)
  rank = jnp.arange(tokens, dtype=jnp.int32) - starts[dest]
  y_sorted = jnp.where((rank < capacity)[:, None], y_sorted, jnp.zeros((), y_sorted.dtype))
  return jnp.zeros_like(y_sorted).at[order].set(y_sorted)


TRANSPORTS = ("auto", "all_to_all", "ragged")


def routed_apply(fn, x, expert_ids, weights, *, mesh: Mesh, axis: str,
                 capacity: int | None = None, transport: str = "auto"):
  """Routes tokens to the devices of their experts, applies `fn` there, routes back.

  x ``[T, K]`` and expert_ids ``[T]`` are sharded over `axis` (T/D tokens per device);
  every leaf of `weights` (a pytree, e.g. ``(w_gate, w_up, w_down)``, QArrays allowed) has
  the experts as its leading dimension, sharded over `axis` (G/D per device). On each
  device, ``fn(rows, group_sizes, local_weights) -> [R, N]`` gets the rows it received
  grouped by local expert (rows past ``sum(group_sizes)`` are padding and must come out
  0, as gmm makes them). One dispatch and one return per call, whatever `fn` computes.

  Args:
    capacity: tokens one device may send to one other device. Default T/D (the worst case:
      nothing is ever dropped); smaller bounds the buffers, and a token past its
      destination's capacity gets output 0.
    transport: "all_to_all" (fixed [devices, capacity] buffers move whole), "ragged"
      (`jax.lax.ragged_all_to_all`: only the routed rows move; on CPU, which lacks the
      collective, an all_gather-based emulation of its semantics), or "auto": ragged on GPU
      and TPU, all_to_all on CPU.

  Returns:
    ``[T, N]``, sharded like x.
  """
  from gmm_jax._src import dispatch

  if transport not in TRANSPORTS:
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
  platform = dispatch.current_platform()
  if transport == "auto":
    transport = "ragged" if platform in ("gpu", "tpu") else "all_to_all"
  num_devices = mesh.shape[axis]
  leaves = jax.tree.leaves(weights)
  if not leaves:
    raise ValueError("routed_apply needs at least one expert weight")
  num_experts = (leaves[0].shape[0])
  if num_experts % num_devices:
    raise ValueError(f"{num_experts} experts do not split over {num_devices} devices of "
                     f"{axis!r}")
  if x.shape[0] % num_devices:
    raise ValueError(f"{x.shape[0]} tokens do not split over {num_devices} devices")
  local_experts = num_experts // num_devices
  local_tokens = x.shape[0] // num_devices
  capacity = local_tokens if capacity is None else int(capacity)
  if capacity <= 0:
    raise ValueError(f"capacity must be positive, got {capacity}")
  options = dict(axis=axis, num_devices=num_devices, local_experts=local_experts,
                 capacity=capacity)

  def body(x, ids, weights):
    ids = jnp.clip(ids.astype(jnp.int32), 0, num_experts - 1)

    def compute(recv, recv_ids):
      # Group what arrived by local expert; empty slots (id = local_experts) sort last and
      # lie past the group total.
      order = jnp.argsort(recv_ids, stable=True)
      sizes = jnp.bincount(recv_ids, length=local_experts + 1)[:local_experts]
      y = fn(recv[order], sizes.astype(jnp.int32), weights)
      return jnp.zeros_like(y).at[order].set(y)

    if transport == "all_to_all":
      return _route_dense(x, ids, compute=compute, **options)
    collective = (jax.lax.ragged_all_to_all if platform in ("gpu", "tpu")
                  else _emulated_ragged_all_to_all)
    return _route_ragged(x, ids, compute=compute, collective=collective, **options)

  weight_specs = jax.tree.map(lambda w: _operand_spec(w, P(axis), mesh), weights,
                              is_leaf=lambda w: isinstance(w, quant.QArray))
  fn_sharded = jax.shard_map(body, mesh=mesh, in_specs=(P(axis), P(axis), weight_specs),
                             out_specs=P(axis), check_vma=False)
  return fn_sharded(x, expert_ids, weights)


def routed_gmm(x, w, expert_ids, *, mesh: Mesh, axis: str, bias=None, activation=None,
               capacity: int | None = None, transport: str = "auto", implementation=None,
               interpret: bool = False):
  """Expert parallelism for tokens that live on the devices of the expert axis:
  ``y[t] = activation(x[t] @ w[expert_ids[t]] + bias[expert_ids[t]])``.

  x ``[T, K]`` and expert_ids ``[T]`` sharded over `axis`, w ``[G, K, N]`` (and bias
  ``[G, N]``) sharded over `axis` on the experts. Tokens travel to their experts' devices
  and back (see `routed_apply` for `capacity` and `transport`); the weights never move.
  Differentiable (the collectives transpose to themselves).

  Returns:
    y ``[T, N]``, sharded like x.
  """
  from gmm_jax._src.api import gmm

  def fn(rows, sizes, weights):
    w, bias = weights
    return gmm(rows, w, sizes, bias=bias, activation=activation,
               implementation=implementation, interpret=interpret)

  return routed_apply(fn, x, expert_ids, (w, bias), mesh=mesh, axis=axis, capacity=capacity,
                      transport=transport)
