"""How an MoE layer's tokens reach their experts: the layer only chooses among the
strategies of `gmm_jax._src.moe` (the fused path, the unfused baseline, the
partitionable op) and `gmm_jax.routed_apply` (explicit meshes), from its mesh arguments,
the tokens' and kernels' shardings and the devices in sight."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from gmm_jax import routed_apply, routed_experts
from gmm_jax._src.moe import experts
from gmm_jax._src.backends.registry import trace_platform
from gmm_jax._src.moe.experts import ExpertFFN
from gmm_jax._src.sharding.spec import explicit_axes, token_layout
from gmm_jax.nn.params import auto_mesh

Array = jax.Array


def may_be_partitioned() -> bool:
  """Whether a program traced now may run on several devices: more than one device in
  sight, or a default device of another platform (a deviceless compile's target)."""
  if jax.device_count() > 1:
    return True
  device = jax.config.jax_default_device
  return device is not None and getattr(device, "platform", "cpu") != "cpu"


def layout(x, expert_parallel, data_parallel, in_kernel, kernel_axes=None):
  """(mesh, expert axis, token axes) of a call on x, from the layer's `expert_parallel`
  ``(mesh, axis)`` and `data_parallel` ``(mesh, axes)`` and the types of x and of the
  experts' input kernel `in_kernel`; mesh None: one device's view.

  Under a context mesh with Auto axes (`jax.set_mesh`), where the types carry no layout,
  `kernel_axes(mesh)` (the kernel's logical axes on that mesh, `params.mesh_axes`) names
  the expert axis, and the tokens are split over every mesh axis that divides them (else
  over the expert axis, else not at all): the layer then pins both to that layout."""
  mesh = axis = token_axes = None
  if expert_parallel is not None:
    mesh, axis = expert_parallel
  if data_parallel is not None:
    data_mesh, token_axes = data_parallel
    mesh = data_mesh if mesh is None else mesh
    token_axes = (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)
  mesh, token_axes = token_layout(x, mesh, token_axes)
  typed = getattr(jax.typeof(in_kernel), "sharding", None)
  if axis is None and typed is not None and not typed.mesh.empty and len(typed.spec):
    entry = typed.spec[0]  # the expert kernels' leading dim on an Explicit mesh
    axis = entry[0] if isinstance(entry, tuple) and len(entry) == 1 else entry
  auto_context = (expert_parallel is None and data_parallel is None
                  and kernel_axes is not None and auto_mesh(x) is not None)
  if auto_context:
    mesh = auto_mesh(x)
    axis = kernel_axes(mesh)[0] if axis is None else axis
    num_tokens = math.prod(x.shape[:-1])
    every = tuple(a for a, s in zip(mesh.axis_names, mesh.axis_sizes) if s > 1)
    for axes in (every, (axis,) if axis is not None else ()):
      if axes and num_tokens % math.prod(mesh.shape[a] for a in axes) == 0:
        token_axes = axes
        break
  if mesh is None or mesh.empty or (axis is None and not token_axes):
    return None, None, ()
  if not token_axes and data_parallel is None and not explicit_axes(mesh) and not auto_context:
    token_axes = (axis,)
  return mesh, axis, token_axes


def first_come(top_e, blocks: int, num_experts: int, capacity: int):
  """bool ``[T, k]``: each expert takes the first `capacity` assignments (in (token,
  choice) order) of each of `blocks` equal blocks of tokens (sequences, token shards)."""
  hot = jax.nn.one_hot(top_e.reshape(blocks, -1), num_experts, dtype=jnp.int32)
  rank = jnp.sum((jnp.cumsum(hot, axis=1) - 1) * hot, axis=-1)
  return (rank < capacity).reshape(top_e.shape)


def run_experts(spec: ExpertFFN, rows, top_e, top_p, params, *, mesh, axis, token_axes,
                partitionable: bool | None, capacity_factor: float | None,
                buffer_factor: float | None, transport: str,
                sequence_length: int | None = None, masked_rows: int | None = None):
  """The routed experts of rows ``[T, D]`` (see `MoE` for the options): one device's fused
  path or unfused baseline, the partitionable op under plain jit, or `routed_apply` on a
  mesh. `sequence_length` S: the capacity is per sequence of S rows (None: per call, or
  per token shard on a mesh). `masked_rows`: the masked layout (decode) with that many
  slots per expert, on one device's view (`experts.ffn_masked`). Returns (y ``[T, D]`` f32, kept ``[T, k]`` or None when
  nothing can be dropped)."""
  num_tokens, k = top_e.shape
  num_experts = spec.num_experts
  top_e = top_e.astype(jnp.int32)
  keep = None
  bound = None  # the most assignments one expert can get once `keep` has dropped
  if capacity_factor is not None and sequence_length is not None:
    # Each sequence's assignments past an expert's capacity become no assignment (-1);
    # the strategies then run dropless, their buffers bounded by the sequences' total.
    per_sequence = math.ceil(capacity_factor * sequence_length * k / num_experts)
    sequences = num_tokens // sequence_length
    keep = first_come(top_e, sequences, num_experts, per_sequence)
    top_e = jnp.where(keep, top_e, -1)
    capacity_factor, bound = None, per_sequence * sequences
  if masked_rows is not None:
    if mesh is not None:
      raise NotImplementedError("the masked layout runs on one device's view; tokens or "
                                "experts on a mesh need layout='ragged'")
    capacity = (bound if capacity_factor is None else
                math.ceil(capacity_factor * num_tokens * k / num_experts))
    y, kept = experts.ffn_masked(spec, rows, top_e, top_p, params, max_rows=masked_rows,
                                 capacity=capacity)
    return y, kept
  if partitionable is None:
    partitionable = may_be_partitioned()
  if mesh is None and partitionable and trace_platform() == "tpu":
    # No partitioner splits an op on TPU (`custom_partitioning` does not run there): the
    # fused path, whose gmms XLA partitions as the dense reference (the op warns once).
    partitionable = False
  if mesh is None and not partitionable:
    capacity = (bound if capacity_factor is None else
                math.ceil(capacity_factor * num_tokens * k / num_experts))
    ffn = experts.ffn_routed if spec.fused else experts.ffn_sorted
    y, kept = ffn(spec, rows, top_e, top_p, params, capacity=capacity)
    return y, None if capacity is None else kept
  if mesh is None:
    # Mesh-blind (plain jit, one device): the partitioner splits the routed experts by
    # the operands' shardings (`routed_experts`).
    y, kept = routed_experts(spec, rows, top_e, top_p, params,
                             capacity_factor=capacity_factor,
                             buffer_factor=buffer_factor, transport=transport)
    dropless = capacity_factor is None and buffer_factor is None and keep is None
    return y, None if dropless else kept.astype(bool)
  shards = math.prod(mesh.shape[a] for a in token_axes)
  capacity = None
  if capacity_factor is not None:
    capacity = math.ceil(capacity_factor * num_tokens * k / (num_experts * shards))
  return sorted_on_mesh(spec, rows, top_e, top_p, params, capacity=capacity, shards=shards,
                        mesh=mesh, axis=axis, token_axes=token_axes,
                        buffer_factor=buffer_factor, transport=transport, keep=keep)


def sorted_on_mesh(spec: ExpertFFN, rows, top_e, top_p, params, *, capacity, shards, mesh,
                   axis, token_axes, buffer_factor, transport, keep=None):
  """The mesh path (mesh arguments or Explicit axes): each assignment's row copied,
  sorted by expert within each shard (`routed_apply`), the expert FFN, unsorted, weighted
  and summed over k. `keep`: None or bool ``[T, k]``, the assignments not dropped before
  (per sequence)."""
  num_tokens, k = top_e.shape
  flat_e, flat_p = top_e.reshape(-1), top_p.reshape(-1)
  # The token of each assignment (a broadcast: keeps the tokens' sharding on any mesh).
  copies = jnp.broadcast_to(rows[:, None, :], (num_tokens, k, rows.shape[-1])).reshape(
      num_tokens * k, rows.shape[-1])
  kept = None if keep is None else keep.reshape(-1)
  if capacity is not None:
    # Each expert takes the first `capacity` assignments of each token shard, in order.
    kept = first_come(flat_e, shards, spec.num_experts, capacity)
  if kept is not None:
    flat_p = jnp.where(kept, flat_p, 0.0)
  ids = flat_e if kept is None else jnp.where(kept, flat_e, 0)  # dropped: weight 0
  copies, out_p = experts.weighted_rows(
      spec, copies, flat_p, jnp.ones_like(flat_p, bool) if kept is None else kept)
  per_pair = None  # routed_apply's default: the worst case
  if buffer_factor is not None and axis is not None and axis in token_axes:
    local_rows = num_tokens * k // shards
    per_pair = max(1, min(local_rows, math.ceil(buffer_factor * local_rows
                                                / mesh.shape[axis])))
  out = routed_apply(lambda r, s, w: experts.ffn_rows(spec, r, s, w), copies, ids, params,
                     mesh=mesh, axis=axis, token_axes=token_axes, capacity=per_pair,
                     transport=transport)
  # Each token's k results, weighted: a reshape and a sum (no scatter across shards).
  weighted = (out.astype(jnp.float32).reshape(num_tokens, k, -1)
              * out_p.reshape(num_tokens, k, 1))
  return jnp.sum(weighted, axis=1), None if kept is None else kept.reshape(num_tokens, k)
