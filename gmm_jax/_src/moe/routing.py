"""Token routing for MoE: `route` turns each token's chosen experts into the row operands
of a fused gmm (which rows to read, where to write, with which weight); for data- and
expert-parallel MoE, tokens are grouped by expert within their shard, or travel to the
devices of their experts and back, around any per-expert function (`routed_apply`), and
`routed_gmm` on it. Works on any mesh (Auto or Explicit axes, `jax.set_mesh`).

Floor 6: built on the public API (`gmm`, `GmmSharding`'s operand specs, `QArray`).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from gmm_jax._src.api import gmm
from gmm_jax._src.backends.registry import mesh_platform, on_lowering_platform
from gmm_jax._src.core.qarray import QArray
from gmm_jax._src.sharding.spec import axes_of, explicit_axes, operand_spec, reshard, token_layout



def permute_rows(x: jax.Array, order: jax.Array) -> jax.Array:
  """``x[order]`` for a permutation `order`: a gather of unique rows, whose transpose is a
  scatter of unique rows (no accumulation: cheaper to compile and run than a scatter-add,
  which XLA:TPU emulates for bf16)."""
  return x.at[order].get(unique_indices=True)


def unpermute_rows(y: jax.Array, order: jax.Array) -> jax.Array:
  """The inverse of `permute_rows`: ``out[order] = y``, a scatter of unique rows (its
  transpose a gather)."""
  return jnp.zeros_like(y).at[order].set(y, unique_indices=True)


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
  send = jnp.zeros((num_devices * capacity + 1, k), x.dtype).at[slot].set(permute_rows(x, order))
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
  return unpermute_rows(y_sorted, order)


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
  recv = collective(permute_rows(x, order), jnp.zeros((buffer_rows, k), x.dtype), starts, send_sizes,
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
  return unpermute_rows(y_sorted, order)


@functools.partial(jax.tree_util.register_dataclass,
                   data_fields=("lhs_indices", "out_indices", "group_sizes", "row_weights",
                                "kept", "inverse"),
                   meta_fields=("num_tokens", "top_k"))
@dataclasses.dataclass(frozen=True)
class Routing:
  """Tokens' expert choices as the row operands of a fused gmm (see `route`).

  The grouped problem has R rows, expert-contiguous: the kept assignments (token t's j-th
  choice is slot ``t * top_k + j``) sorted by expert, tokens in order within an expert,
  then padding rows (past ``sum(group_sizes)``: gmm writes nothing for them).

  Fields:
    lhs_indices: int32 ``[R]``: the token of each row (gmm's ``lhs_indices``).
    out_indices: int32 ``[R]``: the slot of each row (gmm's ``out_indices`` with
      ``out_rows=num_slots``); padding rows hold ``num_slots`` (out of range).
    group_sizes: int32 ``[E]``: rows per expert.
    row_weights: f32 ``[R]`` weight of each row's assignment (0 on padding), or None.
    kept: bool ``[T, top_k]``: which assignments have a row (all valid ones when dropless).
    inverse: int32 ``[T * top_k]``: the row of each slot, R where it has none.
    num_tokens, top_k: T and k (static).
  """

  lhs_indices: jax.Array
  out_indices: jax.Array
  group_sizes: jax.Array
  row_weights: jax.Array | None
  kept: jax.Array
  inverse: jax.Array
  num_tokens: int
  top_k: int

  @property
  def num_slots(self) -> int:
    """T * top_k: the rows of the scattered result (gmm's ``out_rows``)."""
    return self.num_tokens * self.top_k

  @property
  def num_rows(self) -> int:
    """R: the rows of the grouped problem."""
    return self.lhs_indices.shape[0]

  def combine(self, slots: jax.Array) -> jax.Array:
    """``[T * top_k, N]`` per-slot results -> ``[T, N]``: each token's k slots summed in a
    fixed order (in f32, then the slots' dtype)."""
    summed = jnp.sum(slots.reshape(self.num_tokens, self.top_k, -1).astype(jnp.float32),
                     axis=1)
    return summed.astype(slots.dtype)


def route(expert_ids: jax.typing.ArrayLike, num_experts: int, *,
          weights: jax.typing.ArrayLike | None = None, capacity: int | None = None
          ) -> Routing:
  """The row operands of a fused MoE gmm for the experts each token chose.

  Args:
    expert_ids: int ``[T, k]`` (or ``[T]`` for top-1): token t's experts; ids outside
      ``[0, num_experts)`` are no assignment.
    num_experts: E.
    weights: None or float ``[T, k]`` router weights of the assignments (differentiable:
      `Routing.row_weights` gathers them).
    capacity: None (dropless: R = T * k rows) or the most rows one expert takes: earlier
      tokens first; the buffers have ``R = min(T * k, E * capacity)`` rows and a dropped
      assignment has no row (its slot stays 0 in the result).

  Returns:
    A `Routing`. The expert FFN of a top-k MoE layer, with no permuted copy of x::

      r = route(top_e, E, weights=top_p)
      h = gmm(x, w_gate_up, r.group_sizes, lhs_indices=r.lhs_indices, activation="swiglu")
      y = gmm(h, w_down, r.group_sizes, row_weights=r.row_weights,
              out_indices=r.out_indices, out_rows=r.num_slots)
      y = r.combine(y)  # [T, D]

  Raises:
    ValueError: non-integer ids, weights of another shape, a negative capacity.
  """
  expert_ids = jnp.asarray(expert_ids)
  if not jnp.issubdtype(expert_ids.dtype, jnp.integer) or expert_ids.ndim not in (1, 2):
    raise ValueError(f"expert_ids must be an int [T, k] (or [T]) array, got "
                     f"{jax.typeof(expert_ids)}")
  if expert_ids.ndim == 1:
    expert_ids = expert_ids[:, None]
  num_tokens, top_k = expert_ids.shape
  if weights is not None:
    weights = jnp.asarray(weights)
    weights = weights[:, None] if weights.ndim == 1 else weights
    if weights.shape != expert_ids.shape or not jnp.issubdtype(weights.dtype, jnp.floating):
      raise ValueError(f"weights must be float {list(expert_ids.shape)} like expert_ids, got "
                       f"{jax.typeof(weights)}")
  if not isinstance(num_experts, int) or num_experts < 1:
    raise ValueError(f"num_experts must be a positive int, got {num_experts!r}")
  if capacity is not None and (not isinstance(capacity, int) or capacity < 0):
    raise ValueError(f"capacity must be None or a non-negative int, got {capacity!r}")
  num_slots = num_tokens * top_k
  flat = expert_ids.reshape(-1).astype(jnp.int32)
  valid = (flat >= 0) & (flat < num_experts)
  key = jnp.where(valid, flat, num_experts)
  order = jnp.argsort(key, stable=True).astype(jnp.int32)  # slots by expert, then slot
  sorted_key = key[order]
  counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
  position = jnp.arange(num_slots, dtype=jnp.int32)
  if capacity is None:
    num_rows, sizes = num_slots, counts
    kept_sorted = sorted_key < num_experts
    row_slot = jnp.where(kept_sorted, order, num_slots)
  else:
    num_rows = min(num_slots, num_experts * capacity)
    starts = jnp.cumsum(counts) - counts
    rank = position - starts[jnp.minimum(sorted_key, num_experts - 1)]
    kept_sorted = (sorted_key < num_experts) & (rank < capacity)
    sizes = jnp.minimum(counts, capacity)
    new_starts = jnp.cumsum(sizes) - sizes
    dest = jnp.where(kept_sorted, new_starts[jnp.minimum(sorted_key, num_experts - 1)] + rank,
                     num_rows + position)
    row_slot = jnp.full((num_rows,), num_slots, jnp.int32).at[dest].set(
        order, mode="drop", unique_indices=True)
  kept = jnp.zeros((num_slots,), bool).at[order].set(kept_sorted, unique_indices=True)
  row_of = jnp.arange(num_rows, dtype=jnp.int32)
  inverse = jnp.full((num_slots,), num_rows, jnp.int32).at[row_slot].set(
      row_of, mode="drop", unique_indices=True)
  row_weights = None
  if weights is not None:
    present = row_slot < num_slots
    taken = jnp.take(weights.reshape(-1), jnp.minimum(row_slot, num_slots - 1))
    row_weights = jnp.where(present, taken, 0).astype(jnp.float32)
  return Routing(lhs_indices=(row_slot // top_k).astype(jnp.int32), out_indices=row_slot,
                 group_sizes=sizes.astype(jnp.int32), row_weights=row_weights,
                 kept=kept.reshape(num_tokens, top_k), inverse=inverse,
                 num_tokens=num_tokens, top_k=top_k)


TRANSPORTS = ("auto", "all_to_all", "ragged")
# libtpu emits a ragged all-to-all on these TPU generations only on slices of at most this
# many chips: larger slices have limited ICI routing, which its emitter refuses ("Ragged
# all-to-all is currently not supported in limited ICI routing settings"; compiled
# deviceless: v5e 2x2 and 4x4 emit it, 4x8, 8x8 and 16x16 refuse; v6e up to 16x16 and v5p
# 4x4x4 emit it).
_LIMITED_ICI_ROUTING = {"TPU v5 lite": 16, "TPU v5e": 16}


def device_kind(mesh) -> str | None:
  """The device kind of a mesh's devices (concrete or abstract), None if unknown."""
  try:
    return np.asarray(mesh.devices).flat[0].device_kind
  except (AttributeError, IndexError, TypeError, ValueError, RuntimeError):
    return getattr(getattr(mesh, "abstract_device", None), "device_kind", None)


def transport_for(transport: str, platform: str | None, mesh) -> str:
  """The transport that "auto" means for a mesh lowered for `platform`: the ragged
  all-to-all on GPU and TPU where libtpu emits it, the fixed-buffer all_to_all on TPU
  slices with limited ICI routing (v5e beyond 16 chips) and on CPU (no such collective);
  any other value as it is."""
  if transport != "auto":
    return transport
  if platform not in ("gpu", "tpu"):
    return "all_to_all"
  limit = _LIMITED_ICI_ROUTING.get(device_kind(mesh)) if platform == "tpu" else None
  size = math.prod(getattr(mesh, "axis_sizes", ()) or (1,))
  return "all_to_all" if limit is not None and size > limit else "ragged"


def routed_apply(fn, x, expert_ids, weights, *, mesh: Mesh | None = None,
                 axis: str | None = None, token_axes=None, capacity: int | None = None,
                 transport: str = "auto"):
  """Groups tokens by expert within each shard, applies `fn` there, and ungroups: data- and
  expert-parallel MoE routing. Tokens never leave their shard except to reach the devices
  of their experts (and come back).

  x ``[T, K]`` and expert_ids ``[T]`` are sharded over `token_axes` (blocks of T/S tokens
  per shard); every leaf of `weights` (a pytree, e.g. ``(w_gate, w_up, w_down)``, QArrays
  allowed) has the experts as its leading dimension, sharded over the expert `axis`
  (G/D per device) or replicated (axis=None). On each device, ``fn(rows, group_sizes,
  local_weights) -> [R, N]`` gets rows grouped by local expert (rows past
  ``sum(group_sizes)`` are padding and must come out 0, as gmm makes them). Three layouts:

  * axis=None: each shard sorts its own tokens and runs every expert (data parallel).
  * axis in token_axes: tokens travel to their experts' devices over `axis` and back (one
    dispatch and one return per call, whatever `fn` computes; `capacity`, `transport`).
  * axis not in token_axes (tokens replicated over the expert axis): each device runs its
    own experts on the tokens it holds and a psum over `axis` combines them.

  Args:
    mesh: the device mesh (any axis types); default: x's mesh (Explicit axes) or the
      context mesh (`jax.set_mesh`).
    axis: the expert axis, or None.
    token_axes: mesh axes the tokens are sharded over; default: x's type on an Explicit
      mesh, else ``(axis,)``.
    capacity: tokens one device may send to one other device (routing over `axis` only).
      Default T/S (the worst case: nothing is ever dropped); smaller bounds the buffers,
      and a token past its destination's capacity gets output 0.
    transport: "all_to_all" (fixed [devices, capacity] buffers move whole), "ragged"
      (`jax.lax.ragged_all_to_all`: only the routed rows move; on CPU, which lacks the
      collective, an all_gather-based emulation of its semantics), or "auto": ragged on GPU
      and TPU, except TPU slices whose ICI routing libtpu's ragged all-to-all does not
      support (v5e beyond 16 chips), and all_to_all there and on CPU (`transport_for`).
      The platform is the one the program is lowered for.

  Returns:
    ``[T, N]``, sharded like x.
  """
  if transport not in TRANSPORTS:
    raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
  mesh, token_axes = _routed_mesh(x, mesh, axis, token_axes)
  num_experts, num_devices, token_shards = _routed_sizes(x, weights, mesh, axis, token_axes)
  local_experts = num_experts // num_devices
  local_tokens = x.shape[0] // token_shards
  capacity = local_tokens if capacity is None else int(capacity)
  if capacity <= 0:
    raise ValueError(f"capacity must be positive, got {capacity}")
  routed = axis is not None and axis in token_axes

  def group_locally(x, ids, weights):
    # Local experts first (in order), then the others' rows, which fn leaves 0.
    first = 0 if axis is None else jax.lax.axis_index(axis) * local_experts
    key = (ids - first) % num_experts
    order = jnp.argsort(key, stable=True)
    sizes = jnp.bincount(key, length=num_experts)[:local_experts].astype(jnp.int32)
    y = fn(permute_rows(x, order), sizes, weights)
    out = unpermute_rows(y, order)
    return out if axis is None else jax.lax.psum(out, axis)

  def body(x, ids, weights):
    ids = jnp.clip(ids.astype(jnp.int32), 0, num_experts - 1)
    if not routed:
      return group_locally(x, ids, weights)
    route = functools.partial(
        travel, fn=lambda rows, sizes: fn(rows, sizes, weights), transport=transport,
        mesh=mesh, axis=axis, num_devices=num_devices, local_experts=local_experts,
        capacity=capacity)
    # A mesh of accelerators fixes the platform: its branch alone is traced. Every
    # platform's, under `lax.platform_dependent`, leaves XLA:TPU a conditional around the
    # whole routed backward, which it neither inlines nor fuses across: measured on the
    # Mixtral expert-parallel step on 4 x v5e, f32 copies of the weight gradients inside
    # it (1.4 GB per chip; 2.98 -> 2.24 GiB of temporaries without it). A CPU mesh may
    # stand in for a program lowered for another platform, so it keeps every branch.
    platform = mesh_platform(mesh)
    return on_lowering_platform(route, platform if platform in ("gpu", "tpu") else None,
                                x, ids)

  tokens = P(_entry(token_axes))
  weight_spec = P(axis) if axis is not None else P()
  weight_specs = jax.tree.map(lambda w: operand_spec(w, weight_spec, mesh), weights,
                              is_leaf=lambda w: isinstance(w, QArray))
  in_specs = (tokens, tokens, weight_specs)
  operands = reshard((x, expert_ids, weights), in_specs, mesh)
  fn_sharded = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=tokens,
                             check_vma=False)
  return fn_sharded(*operands)


def _routed_mesh(x, mesh, axis, token_axes):
  """(mesh, token_axes) of a `routed_apply` call: given, or read from x's type or the
  context mesh; the tokens default to the expert axis on a mesh with no Explicit axes."""
  mesh, token_axes = token_layout(x, mesh, token_axes)
  if not token_axes and axis is not None:
    token_axes = (axis,) if not explicit_axes(mesh) else ()
  if mesh is None or mesh.empty:
    raise ValueError("routed_apply needs a mesh: pass mesh=, or call it under jax.set_mesh")
  for name in token_axes + axes_of(axis):
    if name not in mesh.axis_names:
      raise ValueError(f"mesh axis {name!r} is not in the mesh {mesh.axis_names}")
  return mesh, token_axes


def _routed_sizes(x, weights, mesh, axis, token_axes):
  """(experts, devices of the expert axis, token shards) of a `routed_apply` call, checked
  to split evenly."""
  leaves = jax.tree.leaves(weights)
  if not leaves:
    raise ValueError("routed_apply needs at least one expert weight")
  num_experts = leaves[0].shape[0]
  num_devices = mesh.shape[axis] if axis is not None else 1
  if num_experts % num_devices:
    raise ValueError(f"{num_experts} experts do not split over {num_devices} devices of "
                     f"{axis!r}")
  token_shards = math.prod(mesh.shape[a] for a in token_axes)
  if x.shape[0] % token_shards:
    raise ValueError(f"{x.shape[0]} tokens do not split over {token_shards} shards of "
                     f"{token_axes}")
  return num_experts, num_devices, token_shards


def travel(platform: str | None, rows, ids, *, fn, transport: str, mesh, axis: str,
           num_devices: int, local_experts: int, capacity: int):
  """Rows travel over `axis` to the devices of their experts (``ids``, global expert ids,
  ``local_experts`` on each of the `num_devices`), ``fn(rows, group_sizes)`` runs there on
  what arrived grouped by local expert, and the results travel back in the rows' order.
  `transport` ("auto" resolved for `platform` by `transport_for`) moves at most `capacity`
  rows from one device to another each way; the rows past it come back 0. For
  `on_lowering_platform` (the platform first)."""

  def compute(recv, recv_ids):
    # Group what arrived by local expert; empty slots (id = local_experts) sort last and
    # lie past the group total.
    order = jnp.argsort(recv_ids, stable=True)
    sizes = jnp.bincount(recv_ids, length=local_experts + 1)[:local_experts]
    y = fn(permute_rows(recv, order), sizes.astype(jnp.int32))
    return unpermute_rows(y, order)

  options = dict(axis=axis, num_devices=num_devices, local_experts=local_experts,
                 capacity=capacity)
  if transport_for(transport, platform, mesh) == "all_to_all":
    return _route_dense(rows, ids, compute=compute, **options)
  collective = (jax.lax.ragged_all_to_all if platform in ("gpu", "tpu")
                else _emulated_ragged_all_to_all)
  return _route_ragged(rows, ids, compute=compute, collective=collective, **options)


def _entry(axes: tuple[str, ...]):
  return None if not axes else (axes[0] if len(axes) == 1 else axes)


def routed_gmm(x, w, expert_ids, *, mesh: Mesh | None = None, axis: str | None = None,
               bias=None, activation=None, token_axes=None, capacity: int | None = None,
               transport: str = "auto", implementation=None, interpret: bool = False):
  """Expert parallelism for tokens that live on the devices of the expert axis:
  ``y[t] = activation(x[t] @ w[expert_ids[t]] + bias[expert_ids[t]])``.

  x ``[T, K]`` and expert_ids ``[T]`` sharded over `axis`, w ``[G, K, N]`` (and bias
  ``[G, N]``) sharded over `axis` on the experts. Tokens travel to their experts' devices
  and back (see `routed_apply` for `mesh`, `token_axes`, `capacity` and `transport`); the
  weights never move. Differentiable (the collectives transpose to themselves).

  Returns:
    y ``[T, N]``, sharded like x.
  """
  def fn(rows, sizes, weights):
    w, bias = weights
    return gmm(rows, w, sizes, bias=bias, activation=activation,
               implementation=implementation, interpret=interpret)

  return routed_apply(fn, x, expert_ids, (w, bias), mesh=mesh, axis=axis,
                      token_axes=token_axes, capacity=capacity, transport=transport)
