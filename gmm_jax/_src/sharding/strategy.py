"""How one gmm splits over a device mesh: the strategy for a layout of its operands, and the
computation each device runs.

Floor 1: imports only floor-0 modules. Two callers share it: the gmm primitive's
partitioning rule (plain `jax.jit` with sharded operands, op.py) and the explicit
`GmmSharding` form (`jax.shard_map`, sharding.py). Both run `local_gmm` on every device.

Logical dims: m (rows of lhs), k (the contraction), n (columns of rhs) and g (the groups:
the experts of rhs for m-grouping, the output's groups for k-grouping).

Strategies (m-grouping; lhs ``[M, K]``, rhs ``[G, K, N]``, by mesh axis):
  expert       rhs sharded on G over axis e: each device holds G/e experts, computes only
               their rows (``group_offset + axis_index(e) * G/e``; other rows are exactly 0)
               and one psum over e combines the rows. The weights are never gathered.
  rows         lhs sharded on M over axis d (and the output too): each device clips the
               global group offsets to its row range to get its local group sizes. No
               communication.
  columns      rhs (and bias, output) sharded on N: no communication.
  contraction  lhs and rhs sharded on K over the same axis t: partial products, one psum
               over t, then the bias and activation (which must see the whole sum).
k-grouping (lhs ``[M, K]`` with K grouped, rhs ``[K, N]``, out ``[G, M, N]``; the weight
gradient of an m-grouped gmm):
  contraction    the grouped K sharded over d in both: each device clips the global offsets
                 to its K range, runs the local k-gmm and one psum over d combines the groups.
  output groups  the output's G sharded over e (the weight gradient of expert-sharded
                 weights): each device computes only its groups. No communication.
  rows / columns M of lhs or N of rhs sharded: no communication.
Axes combine (e.g. expert on one axis and rows on another).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from gmm_jax._src.core import metadata
from gmm_jax._src.core.config import GmmConfig, accumulator_dtype, problem_dims
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, finish
from gmm_jax._src.core.qarray import QArray

Axes = tuple[str, ...]
NAMES = ("m", "k", "n", "g")


def operand_dims(cfg: GmmConfig) -> dict[str, tuple[str, ...]]:
  """The logical dim of every stored dimension of lhs, rhs, the output and the bias."""
  lhs = ("k", "m") if cfg.transpose_lhs else ("m", "k")
  rhs = ("n", "k") if cfg.transpose_rhs else ("k", "n")
  if cfg.group_type == "m":
    return dict(lhs=lhs, rhs=("g",) + rhs, out=("m", "n"), bias=("g", "n"))
  return dict(lhs=lhs, rhs=rhs, out=("g", "m", "n"), bias=("g", "n"))


def axes_of(entry) -> Axes:
  """The mesh axes of one PartitionSpec entry."""
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def entry_of(axes: Axes):
  """One PartitionSpec entry for `axes`."""
  return None if not axes else (axes[0] if len(axes) == 1 else tuple(axes))


def spec_dims(spec, ndim: int) -> list[Axes]:
  """The mesh axes of each of `ndim` dims (a shorter spec leaves the rest replicated)."""
  entries = list(spec or ()) + [None] * (ndim - len(spec or ()))
  if len(entries) != ndim:
    raise ValueError(f"PartitionSpec {spec} has more entries than the operand's {ndim} dims")
  return [axes_of(e) for e in entries]


@dataclasses.dataclass(frozen=True)
class Plan:
  """A chosen strategy: the mesh axes of each logical dim, and why."""

  group_type: str
  transpose_lhs: bool
  transpose_rhs: bool
  m: Axes
  k: Axes
  n: Axes
  g: Axes
  mesh_shape: tuple[tuple[str, int], ...]
  notes: tuple[str, ...] = ()

  @staticmethod
  def make(cfg: GmmConfig, axes: Mapping[str, Axes], mesh_shape: Mapping[str, int],
           notes: Sequence[str] = ()) -> "Plan":
    return Plan(cfg.group_type, cfg.transpose_lhs, cfg.transpose_rhs,
                *(tuple(axes.get(name, ())) for name in NAMES),
                tuple((a, int(s)) for a, s in mesh_shape.items()), tuple(notes))

  def _axes(self, name: str) -> Axes:
    return getattr(self, name)

  def shards(self, name: str) -> int:
    sizes = dict(self.mesh_shape)
    return math.prod(sizes[a] for a in self._axes(name))

  def _dims(self) -> dict[str, tuple[str, ...]]:
    probe = GmmConfig(group_type=self.group_type, num_local=1,
                      transpose_lhs=self.transpose_lhs, transpose_rhs=self.transpose_rhs)
    return operand_dims(probe)

  def spec(self, operand: str) -> P:
    """The PartitionSpec of "lhs", "rhs", "out" or "bias" (values, as stored)."""
    return P(*(entry_of(self._axes(name)) for name in self._dims()[operand]))

  @property
  def reduce_over(self) -> Axes:
    return (self.g + self.k) if self.group_type == "m" else self.k

  @property
  def strategies(self) -> tuple[str, ...]:
    names = (("g", "expert"), ("m", "rows"), ("n", "columns"), ("k", "contraction"))
    if self.group_type == "k":
      names = (("k", "contraction"), ("g", "output groups"), ("m", "rows"), ("n", "columns"))
    return tuple(label for name, label in names if self._axes(name))

  def describe(self) -> str:
    lines = [f"sharding strategy: {' + '.join(self.strategies) or 'replicated'}"]
    explained = {
        "expert": f"rhs groups sharded over {self.g}: each device runs its local experts "
                  "(group_offset) and the rows are combined by a psum; weights never gathered",
        "rows": f"lhs rows sharded over {self.m}: local group sizes from the global offsets "
                "clipped to each shard's rows; lhs never gathered",
        "columns": f"N sharded over {self.n}: no communication",
        "output groups": f"output groups sharded over {self.g}: each device computes its "
                         "own groups; no communication",
        "contraction": (f"K sharded over {self.k}: partial products, psum, then bias/"
                        "activation" if self.group_type == "m" else
                        f"the grouped K sharded over {self.k}: local group sizes from the "
                        "clipped offsets, local k-gmm, psum, then bias/activation"),
    }
    lines += [f"  - {explained[s]}" for s in self.strategies]
    lines += [f"  - {note}" for note in self.notes]
    if self.reduce_over:
      lines.append(f"  collectives: one psum over {self.reduce_over} of the output")
    else:
      lines.append("  collectives: none")
    lines.append(f"  output spec: {self.spec('out')}")
    return "\n".join(lines)


_SUPPORTED = ("supported: rhs experts sharded (expert parallel), lhs rows sharded, N sharded, "
              "or K sharded identically on both operands, on distinct mesh axes")


def plan(mesh_shape: Mapping[str, int], cfg: GmmConfig, lhs_spec, rhs_spec,
         lhs_ndim: int = 2, rhs_ndim: int | None = None) -> Plan:
  """The strategy for operands laid out exactly as given (the explicit `GmmSharding`
  form): NotImplementedError naming the supported layouts when there is none."""
  dims = operand_dims(cfg)
  rhs_ndim = rhs_ndim or len(dims["rhs"])
  lhs_axes = dict(zip(dims["lhs"], spec_dims(lhs_spec, lhs_ndim)))
  rhs_axes = dict(zip(dims["rhs"], spec_dims(rhs_spec, rhs_ndim)[-len(dims["rhs"]):]))
  for axes in list(lhs_axes.values()) + list(rhs_axes.values()):
    for axis in axes:
      if axis not in mesh_shape:
        raise ValueError(f"mesh axis {axis!r} is not in the mesh {tuple(mesh_shape)}")
  if lhs_axes["k"] != rhs_axes["k"]:
    raise NotImplementedError(
        f"lhs and rhs shard K differently ({lhs_axes['k'] or 'replicated'} vs "
        f"{rhs_axes['k'] or 'replicated'}); {_SUPPORTED}")
  if lhs_axes["k"] and cfg.lhs_activation is not None:
    raise NotImplementedError(
        f"a gated lhs_activation reads each K column's gate and up halves of lhs together: "
        f"K must not be sharded (got {lhs_axes['k']}); {_SUPPORTED}")
  axes = dict(m=lhs_axes["m"], k=lhs_axes["k"], n=rhs_axes["n"], g=rhs_axes.get("g", ()))
  used = [a for name in NAMES for a in axes[name]]
  if len(used) != len(set(used)):
    shared = set(axes["g"]) & set(axes["m"])
    if shared:
      raise NotImplementedError(
          f"tokens (lhs M) and experts share the mesh axes {sorted(shared)}: tokens must "
          "first be routed to their experts' devices (gmm_jax.routed_gmm does it with an "
          f"all-to-all); {_SUPPORTED}")
    raise NotImplementedError(f"a mesh axis shards two dimensions {used}; {_SUPPORTED}")
  return Plan.make(cfg, axes, mesh_shape)


def leaf_spec(leaf_shape, value_shape, dims: Sequence[Axes],
              mesh_shape: Mapping[str, int]) -> P:
  """The spec of a QArray component (scale, zero point): the value's axes where the
  component is not broadcast; NotImplementedError where a blockwise scale cannot be split
  at tile boundaries."""
  entries = []
  for size, full, axes in zip(leaf_shape, value_shape, dims):
    if not axes or size == 1:
      entries.append(None)
      continue
    shards = math.prod(mesh_shape[a] for a in axes)
    if size == full or (size % shards == 0 and (full // shards) % (full // size or 1) == 0):
      entries.append(entry_of(axes))
    else:
      raise NotImplementedError(
          f"a quantization scale of {size} entries along a dimension of {full} cannot be "
          f"split over {axes} ({shards} shards) at tile boundaries")
  return P(*entries)


def leaf_specs(leaf_shapes: Sequence[tuple[int, ...]], spec: P,
               mesh_shape: Mapping[str, int]) -> list[P]:
  """Specs of an operand's leaves (values first, then a QArray's scale and zero point)."""
  value_shape = leaf_shapes[0]
  dims = spec_dims(spec, len(value_shape))
  return [P(*(entry_of(d) for d in dims))] + [
      leaf_spec(shape, value_shape, dims, mesh_shape) for shape in leaf_shapes[1:]]


def choose(mesh_shape: Mapping[str, int], cfg: GmmConfig, lhs_shapes, rhs_shapes, lhs_spec,
           rhs_spec, out_spec=None, bias_spec=None) -> Plan:
  """The strategy for operands as they arrive under plain `jax.jit` (any layout).

  Each logical dim takes the mesh axes of the first operand that shards it: rhs, then
  lhs, then the output the partitioner asks for (a replicated operand is sliced locally for
  free), then the bias. Where two dims claim one axis, the earlier dim keeps it (m-grouping:
  experts, then K, N, M, so weights stay in place; k-grouping: the grouped K, then M, N, G)
  and the other operand is gathered along it. A dim that its shards do not divide (or whose
  quantization scale cannot be split there) stays whole. Every such choice is in the plan's
  notes.

  Args:
    lhs_shapes, rhs_shapes: shapes of each operand's leaves (values first).
    lhs_spec, rhs_spec, out_spec, bias_spec: PartitionSpecs (None: replicated).
  """
  dims = operand_dims(cfg)
  m, k, n = problem_dims(lhs_shapes[0], rhs_shapes[0], cfg)
  sizes = dict(m=m, k=k, n=n, g=cfg.num_local)
  given = {}
  for operand, spec, shape in (("rhs", rhs_spec, rhs_shapes[0]), ("lhs", lhs_spec,
                                                                 lhs_shapes[0]),
                               ("out", out_spec, None), ("bias", bias_spec, None)):
    names = dims[operand]
    for name, axes in zip(names, spec_dims(spec, len(names))):
      axes = tuple(a for a in axes if a in mesh_shape and mesh_shape[a] > 1)
      if axes and name not in given:
        given[name] = (axes, operand)
  order = ("g", "k", "n", "m") if cfg.group_type == "m" else ("k", "m", "n", "g")
  chosen, used, notes = {}, set(), []
  for name in order:
    axes, source = given.get(name, ((), None))
    if set(axes) & used:
      notes.append(f"{name.upper()} of {source} is sharded over {sorted(set(axes) & used)}, "
                   "which an earlier dim uses: gathered along it"
                   + (" (route tokens to their experts with gmm_jax.routed_gmm instead)"
                      if name == "m" and cfg.group_type == "m" else ""))
      axes = tuple(a for a in axes if a not in used)
    shards = math.prod(mesh_shape[a] for a in axes)
    if axes and sizes[name] % shards:
      notes.append(f"{name.upper()}={sizes[name]} does not split over {axes} ({shards} "
                   "shards): kept whole")
      axes = ()
    elif axes and name == "k" and cfg.lhs_activation is not None:
      notes.append("a gated lhs_activation reads each K column's gate and up halves of lhs "
                   "together: K kept whole")
      axes = ()
    elif axes and name == "n" and cfg.gated and (sizes["n"] // 2) % shards:
      notes.append(f"the {sizes['n'] // 2} output columns of the gated activation do not "
                   f"split over {axes} ({shards} shards): N kept whole")
      axes = ()
    chosen[name] = axes
    used |= set(axes)
  # A quantization scale that cannot be split where its values are: that dim stays whole.
  for operand, shapes in (("lhs", lhs_shapes), ("rhs", rhs_shapes)):
    for shape in shapes[1:]:
      for name, size, full in zip(dims[operand], shape, shapes[0]):
        axes = chosen[name]
        try:
          leaf_spec((size,), (full,), [axes], mesh_shape)
        except NotImplementedError as err:
          notes.append(f"{err}: {name.upper()} kept whole")
          chosen[name] = ()
  return Plan.make(cfg, chosen, mesh_shape, notes)


def for_rows(plan_: Plan, cfg: GmmConfig) -> Plan:
  """The plan of a gmm with row operands (gathered, weighted or scattered rows): the row
  indices name rows of the whole lhs and output, so lhs's rows and K stay whole (gathered);
  its experts (and, without a gated activation, its columns) still split, so the weights
  are never gathered."""
  if not cfg.has_rows:
    return plan_
  notes = list(plan_.notes)
  axes = dict(g=plan_.g, n=plan_.n)
  if plan_.m or plan_.k:
    notes.append("row operands index the whole lhs: its rows and K are gathered")
  if cfg.gated and plan_.n:
    notes.append("a gated activation with row operands: N kept whole")
    axes["n"] = ()
  if cfg.cotangent_of is not None and plan_.n:
    notes.append("a gated-cotangent epilogue writes each column's gate and up cotangents "
                 "together: N kept whole")
    axes["n"] = ()
  return Plan.make(cfg, axes, dict(plan_.mesh_shape), notes)


# ------------------------------------------------------------------- on every device


def linear_index(axes: Axes):
  """This device's position along the (possibly several) mesh axes of one dimension."""
  index = jnp.int32(0)
  for axis in axes:
    index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
  return index


def local_qarray(x):
  """A QArray shard: its tile sizes clipped to the local values."""
  if not isinstance(x, QArray):
    return x
  tile = tuple(min(t, s) for t, s in zip(x.tile, x.qvalue.shape))
  return QArray(x.qvalue, x.scale, x.zero_point, tile=tile)


def _shape(x) -> tuple[int, ...]:
  return tuple(x.qvalue.shape if isinstance(x, QArray) else x.shape)


def gated_column_pairs(x, axes: Axes):
  """The columns of a gated pre-activation sharded over `axes` rearranged so that each
  device holds the gate and up halves of its own output columns.

  A gated product has 2N columns, [gate | up]; split over s devices, device d holds
  columns ``[2d c, 2(d+1) c)`` (c = N/s): blocks 2d and 2d+1 of the 2s blocks of width c.
  Its output columns ``[d c, (d+1) c)`` need block d (gate) and block s+d (up). Each block
  b goes to device ``b mod s``: four partial permutations (gate or up, from the first or
  second local block), so every device sends its 2c columns once and receives 2c.

  Args:
    x: ``[..., 2c]`` this device's columns.
    axes: the mesh axes the columns are sharded over (manual in this context).
  Returns:
    ``[..., 2c]``: [gate block d | up block d].
  """
  shards = 1
  for axis in axes:
    shards *= jax.lax.axis_size(axis)
  if shards == 1:
    return x
  width = x.shape[-1] // 2
  axis_name = axes[0] if len(axes) == 1 else tuple(axes)
  received = {"gate": [], "up": []}
  for slot in (0, 1):
    block = x[..., slot * width:(slot + 1) * width]
    for role, first in (("gate", 0), ("up", shards)):
      perm = [(d, 2 * d + slot - first) for d in range(shards)
              if first <= 2 * d + slot < first + shards]
      if perm:
        received[role].append(jax.lax.ppermute(block, axis_name, perm))
  gate = functools.reduce(jnp.add, received["gate"])
  up = functools.reduce(jnp.add, received["up"])
  return jnp.concatenate([gate, up], axis=-1)


def local_gmm(run: Callable, plan: Plan, lhs, rhs, counts, group_offset, bias,
              cfg: GmmConfig, rows: Rows = NO_ROWS):
  """One device's part of a gmm split by `plan`, inside a context where the plan's mesh
  axes are manual (shard_map, or a partitioning rule's lowering).

  Args:
    run: ``run(lhs, rhs, counts, group_offset, bias, cfg, rows)``, the unsharded gmm.
    lhs, rhs, bias: this device's blocks; counts, group_offset: the global ones.
    cfg: the global call's config.
    rows: the row operands (whole) of a call with them; its plan splits only the experts
      and columns (`for_rows`): each device gathers, weights and scatters every row of its
      own experts (the others' rows are exact zeros, combined by the psum).
  """
  if cfg.has_rows and (plan.m or plan.k or (
      (cfg.gated or cfg.cotangent_of is not None) and plan.n)):
    raise NotImplementedError(f"a gmm with row operands splits only its experts and "
                              f"columns, not {plan.strategies}")
  lhs, rhs = local_qarray(lhs), local_qarray(rhs)
  m_local, k_local, _ = problem_dims(_shape(lhs), _shape(rhs), cfg)
  local_cfg = cfg.replace(num_local=cfg.num_local // plan.shards("g"))
  offset = group_offset
  if plan.g:
    offset = offset + linear_index(plan.g) * local_cfg.num_local
  local_counts = counts
  if cfg.group_type == "m" and plan.m:
    local_counts = metadata.counts_in_range(counts, linear_index(plan.m) * m_local, m_local)
  if cfg.group_type == "k" and plan.k:
    local_counts = metadata.counts_in_range(counts, linear_index(plan.k) * k_local, k_local)
  # Partial sums over K must be whole before the bias and activation; a gated
  # activation with N sharded needs each output column's gate and up halves on one device.
  gated_columns = cfg.gated and plan.n
  if plan.k or gated_columns:
    values = [x.qvalue.dtype if isinstance(x, QArray) else x.dtype for x in (lhs, rhs)]
    quantized = isinstance(lhs, QArray) or isinstance(rhs, QArray)
    z_dtype = np.dtype(jnp.float32) if quantized else accumulator_dtype(*values)
    z = run(lhs, rhs, local_counts, offset, None,
            local_cfg.replace(activation=None, out_dtype=z_dtype))
    if plan.k:
      z = jax.lax.psum(z, plan.k)
    if gated_columns:
      z = gated_column_pairs(z, plan.n)
      bias = None if bias is None else gated_column_pairs(bias, plan.n)
    row_ids = None
    if cfg.group_type == "m":
      row_ids = metadata.row_group_ids(local_counts, z.shape[0], offset, local_cfg.num_local)
    out = finish(z, cfg.activation, cfg.out_dtype, row_ids=row_ids, bias=bias)
  elif cfg.has_rows:
    out = run(lhs, rhs, local_counts, offset, bias, local_cfg, rows)
  else:
    out = run(lhs, rhs, local_counts, offset, bias, local_cfg)
  if cfg.group_type == "m" and plan.g:
    # Each row is some device's: the others hold exact zeros there.
    out = jax.lax.psum(out, plan.g)
  return out
