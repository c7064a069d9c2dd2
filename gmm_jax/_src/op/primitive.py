"""The gmm primitive: its definition, binding, operand layout, abstract evaluation and eager
implementation. The rules that make it differentiable, batchable and partitionable live
beside it (`jvp`, `transpose`, `batching`, `lowering`) and register themselves when the
package is imported.

Floor 2 (the op package): below it only the dispatcher, the strategies, the metadata and the
data modules.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad
from jax.sharding import NamedSharding, PartitionSpec as P

from gmm_jax._src.backends import registry
from gmm_jax._src.core import jax_private, metadata
from gmm_jax._src.sharding import strategy
from gmm_jax._src.core.config import GmmConfig, output_shape
from gmm_jax._src.core.epilogue import NO_ROWS, Rows, gated_cotangent
from gmm_jax._src.core.qarray import QArray, dequantize
from gmm_jax._src.op.gated_tangent import gated_input

# Whether a trace has concrete devices is private to jax (`jax.sharding.get_mesh` refuses
# to run inside jit); without it (a warning says so) every trace binds `gmm_p`.
concrete_mesh = jax_private.concrete_mesh()

# The name of the pre-activation that the jvp of a gmm with an activation (or varying row
# weights) computes (f32; a 16-bit output's dtype for 16-bit outputs, see
# `saved_preactivation_dtype`): `jax.checkpoint` policies save it by this name
# (`jax.checkpoint_policies.save_only_these_names(PREACTIVATION)`), so that a layer keeps
# only pre-activations for its backward and recomputes the elementwise rest.
PREACTIVATION = "gmm_jax_preactivation"

gmm_p = Primitive("gmm_jax_gmm")
# The same op, for programs traced under an abstract mesh with no devices (deviceless
# cross-lowering, e.g. Triton for an abstract GPU from a CPU host on jax >= 0.11): jax
# refuses to lower a primitive that needs devices there (see the partitioning rule), so
# this one is lowered without it.
gmm_deviceless_p = Primitive("gmm_jax_gmm_deviceless")
PRIMITIVES = (gmm_p, gmm_deviceless_p)


def current_primitive() -> Primitive:
  """The primitive for the current trace: deviceless under an abstract mesh alone (no
  concrete mesh in context: `jax.sharding.use_abstract_mesh`, or inside a shard_map,
  where every device's blocks are already local)."""
  if (not jax.sharding.get_abstract_mesh().empty and concrete_mesh is not None
      and concrete_mesh().empty):
    return gmm_deviceless_p
  return gmm_p


# ----------------------------------------------------------------------------- binding


def _same_vma(operands):
  """Inside `shard_map` (check_vma=True), the operands cast to one set of varying mesh
  axes, so that the output is typed with it."""
  try:
    sets = [jax.typeof(x).mat.varying for x in operands]
  except AttributeError:  # a jax without varying manual axes
    return operands
  union = frozenset().union(*sets)
  if not union:
    return operands
  return [lax.pcast(x, tuple(sorted(union - v)), to="varying") if union - v else x
          for x, v in zip(operands, sets)]


def gmm(lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, out_hint=None,
        rows: Rows = NO_ROWS, primitive: Primitive | None = None) -> jax.Array:
  """The differentiable gmm on canonical operands (see `GmmConfig`).

  Args:
    lhs, rhs: arrays, or `QArray`s for a quantized mode that some backend serves (the
      lowering dequantizes when none does on the platform it lowers for).
    counts: int32 ``[G]`` sizes in ``[0, dim]`` (`group_list.fitted_counts`); a list whose
      running sum passes the grouped dimension is cut there (every consumer reads the
      groups' rows through `metadata.bounds_from_counts` or `metadata.tile_walk`).
    group_offset: int32 scalar.
    bias: None or ``[num_local, N]``.
    cfg: the static options.
    out_hint: None or a PartitionSpec for the output's dims that no operand decides (the
      groups of a k-grouped output: the weight gradient takes the weights' sharding).
    rows: the row operands that `cfg` announces (``cfg.gather_rows``, ``cfg.row_weights``,
      ``cfg.out_rows``, ``cfg.has_source``; see `GmmConfig`).
    primitive: the primitive to bind (default: `current_primitive()`).
  """
  lhs_leaves, lhs_tree = jax.tree.flatten(lhs)
  rhs_leaves, rhs_tree = jax.tree.flatten(rhs)
  operands = [*lhs_leaves, *rhs_leaves, counts, group_offset]
  if bias is not None:
    operands.append(bias)
  for present, value in ((cfg.gather_rows is not None, rows.lhs_indices),
                         (cfg.row_weights, rows.row_weights),
                         (cfg.out_rows is not None, rows.out_indices),
                         (cfg.has_source, rows.source)):
    if present:
      operands.append(value)
  operands = [jnp.asarray(x) for x in operands]
  cfg = with_forced_interpret(cfg)
  mesh = explicit_mesh(operands)
  if mesh is not None and primitive is None:
    return _split(mesh, lhs, rhs, counts, group_offset, bias, cfg, out_hint, rows)
  operands = _same_vma(operands)
  return (primitive or current_primitive()).bind(
      *operands, cfg=cfg, trees=(lhs_tree, rhs_tree), has_bias=bias is not None,
      out_hint=out_hint)


def with_forced_interpret(cfg: GmmConfig) -> GmmConfig:
  """`cfg` with the simulator parameters of an enclosing ``pltpu.force_tpu_interpret_mode``
  or ``plgpu.force_gpu_interpret_mode`` as its `interpret` (jax runs every Pallas call
  traced inside under them, whatever its own `interpret`: the primitive declares their
  effects, and the kernels choose by them)."""
  forced = jax_private.forced_interpret_params()
  if forced is None or cfg.interpret is forced:
    return cfg
  return cfg.replace(interpret=forced)


def effects(cfg: GmmConfig) -> frozenset:
  """The effects of a gmm bound with `cfg`: those of its kernel's simulated pallas_call
  (jax's simulators run a kernel through ordered IO callbacks), declared so that the
  implementation's lowering gets their tokens; none otherwise."""
  return jax_private.interpret_effects(cfg.interpret)


# ------------------------------------------------------------------ the trace-time split
#
# Where the trace knows the mesh and the operands' layout (their types carry it on a mesh
# with Explicit axes), the gmm splits itself before XLA sees it: a `jax.shard_map` around
# `strategy.local_gmm` with the plan the partitioning rule computes (`strategy.choose`), so
# that no platform's partitioner has to split a kernel (on TPU it cannot:
# `custom_partitioning` does not run there). Its derivatives are shard_map's: the same
# plan's per-device gmms, differentiated where they are bound.


def explicit_mesh(operands):
  """The mesh with Explicit axes the operands' types name (None: none does, or every such
  axis is already manual)."""
  for x in operands:
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is not None and not mesh.empty and explicit_axes(mesh):
      return mesh
  return None


def explicit_axes(mesh) -> tuple[str, ...]:
  """The axes of `mesh` with Explicit types and more than one device."""
  types = getattr(mesh, "axis_types", None) or ()
  return tuple(name for name, size, kind in zip(mesh.axis_names, mesh.axis_sizes, types)
               if kind == jax.sharding.AxisType.Explicit and size > 1)


def typed_spec(x) -> P:
  """The PartitionSpec an operand's type carries (replicated where it carries none)."""
  spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
  return P() if spec is None else spec


def split_plan(mesh, lhs, rhs, bias, cfg: GmmConfig, out_hint=None) -> strategy.Plan:
  """The plan for operands typed on `mesh`: `strategy.choose` over its Explicit axes (the
  rule under plain jit), narrowed for row operands (`strategy.for_rows`)."""
  axes = explicit_axes(mesh)
  mesh_shape = {a: s for a, s in zip(mesh.axis_names, mesh.axis_sizes) if a in axes}
  lhs_value, rhs_value = jax.tree.leaves(lhs)[0], jax.tree.leaves(rhs)[0]
  return strategy.for_rows(strategy.choose(
      mesh_shape, cfg, _leaf_shapes(lhs), _leaf_shapes(rhs), typed_spec(lhs_value),
      typed_spec(rhs_value), out_hint, None if bias is None else typed_spec(bias)), cfg)


def _split(mesh, lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, out_hint, rows: Rows):
  plan = split_plan(mesh, lhs, rhs, bias, cfg, out_hint)
  registry.note_plan(dataclasses.replace(plan, notes=plan.notes + (
      "split at trace time: a shard_map over the Explicit mesh axes",)))
  mesh_shape = dict(plan.mesh_shape)
  whole = P()

  def specs(x, spec):
    leaves, tree = jax.tree.flatten(x)
    return jax.tree.unflatten(tree, strategy.leaf_specs([l.shape for l in leaves], spec,
                                                         mesh_shape))

  row_values = tuple(rows)
  in_specs = (specs(lhs, plan.spec("lhs")), specs(rhs, plan.spec("rhs")), whole, whole,
              None if bias is None else plan.spec("bias"),
              tuple(None if r is None else whole for r in row_values))
  operands = (lhs, rhs, counts, group_offset, bias, row_values)
  operands = jax.tree.map(
      lambda x, spec: None if x is None else jax.sharding.reshard(
          x, NamedSharding(mesh, spec)), operands,
      in_specs, is_leaf=lambda x: x is None)

  def body(lhs, rhs, counts, group_offset, bias, row_values):
    def run(lhs, rhs, counts, group_offset, bias, cfg, rows=NO_ROWS):
      return gmm(lhs, rhs, counts, group_offset, bias, cfg, rows=rows)

    return strategy.local_gmm(run, plan, lhs, rhs, counts, group_offset, bias, cfg,
                              Rows(*row_values))

  fn = jax.shard_map(body, mesh=mesh, in_specs=in_specs, out_specs=plan.spec("out"),
                     axis_names=frozenset(mesh_shape), check_vma=False)
  return fn(*operands)


def composed(*operands, cfg, trees, has_bias, out_hint):
  """A gmm with a source (a gated prologue's tangent or a gated-cotangent epilogue) as the
  plain gmm and the epilogue's jnp functions around it: the same values, differentiable
  by the plain gmm's rules (for the derivatives of these linear gmms: second order)."""
  lhs, rhs, counts, group_offset, bias = unpack(operands, trees, has_bias)
  rows = row_operands(operands, trees, has_bias, cfg)
  inner_rows = rows._replace(source=None)
  if cfg.lhs_tangent:
    x = gated_input(cfg.lhs_activation, lhs, rows.source)
    return gmm(x, rhs, counts, group_offset, bias,
               cfg.replace(lhs_activation=None, lhs_tangent=False), out_hint, inner_rows)
  y = gmm(lhs, rhs, counts, group_offset, bias, cfg.replace(cotangent_of=None), out_hint,
          inner_rows)
  return gated_cotangent(cfg.cotangent_of, rows.source, y, cfg.out_dtype)


def unpack(operands, trees, has_bias):
  """(lhs, rhs, counts, group_offset, bias) from the flat operands (or their avals,
  tangents, batch dims: anything with one entry per operand)."""
  lhs_tree, rhs_tree = trees
  num_lhs, num_rhs = lhs_tree.num_leaves, rhs_tree.num_leaves
  lhs = jax.tree.unflatten(lhs_tree, operands[:num_lhs])
  rhs = jax.tree.unflatten(rhs_tree, operands[num_lhs:num_lhs + num_rhs])
  rest = operands[num_lhs + num_rhs:]
  return lhs, rhs, rest[0], rest[1], rest[2] if has_bias else None


def row_operands(operands, trees, has_bias, cfg: GmmConfig) -> Rows:
  """The row operands (or their avals, tangents, batch dims) after the bias."""
  rest = iter(operands[trees[0].num_leaves + trees[1].num_leaves + 2 + int(has_bias):])
  return Rows(next(rest) if cfg.gather_rows is not None else None,
              next(rest) if cfg.row_weights else None,
              next(rest) if cfg.out_rows is not None else None,
              next(rest) if cfg.has_source else None)


def is_plain(tree) -> bool:
  return jax.tree_util.treedef_is_leaf(tree)

# ---------------------------------------------------------------------- abstract eval


def _leaf_shapes(x) -> list[tuple[int, ...]]:
  return [tuple(leaf.shape) for leaf in jax.tree.leaves(x)]


def _explicit_spec(aval):
  """The spec an aval's type carries on a mesh with Explicit axes (else replicated)."""
  spec = getattr(aval.sharding, "spec", None)
  return P() if spec is None else spec


def abstract_eval(*avals, cfg, trees, has_bias, out_hint):
  lhs, rhs, _, _, bias = unpack(avals, trees, has_bias)
  lhs_value, rhs_value = jax.tree.leaves(lhs)[0], jax.tree.leaves(rhs)[0]
  shape = output_shape(lhs_value.shape, rhs_value.shape, cfg)
  meshes = [a.sharding.mesh for a in avals if not a.sharding.mesh.empty]
  mesh = meshes[0] if meshes else avals[0].sharding.mesh
  if mesh.empty:
    return jax.core.ShapedArray(shape, cfg.out_dtype)
  if cfg.gather_rows is not None or cfg.row_weights or cfg.out_rows is not None:
    # gathered/scattered rows: XLA's propagation shards it (replicated type)
    return jax.core.ShapedArray(shape, cfg.out_dtype,
                                sharding=NamedSharding(mesh, P(*[None] * len(shape))),
                                manual_axis_type=avals[0].mat)
  # With Explicit mesh axes the output's type is sharded as the partitioning rule will
  # make it (see `strategy.choose`); inside shard_map the result varies over the mesh axes
  # its (cast) operands vary over.
  spec = P(*[None] * len(shape))
  # A tangent gmm of a gated prologue is typed as the gmm it is the tangent of.
  cfg = cfg.replace(lhs_tangent=False) if cfg.lhs_tangent else cfg
  if any(_explicit_spec(a) != P() for a in avals) or out_hint:
    mesh_shape = {a: s for a, s in zip(mesh.axis_names, mesh.axis_sizes)}
    plan = strategy.choose(mesh_shape, cfg, _leaf_shapes(lhs), _leaf_shapes(rhs),
                           _explicit_spec(lhs_value), _explicit_spec(rhs_value), out_hint,
                           None if bias is None else _explicit_spec(bias))
    spec = plan.spec("out")
  return jax.core.ShapedArray(shape, cfg.out_dtype, sharding=NamedSharding(mesh, spec),
                              manual_axis_type=avals[0].mat)


def _effectful_abstract_eval(*avals, **params):
  return abstract_eval(*avals, **params), effects(params["cfg"])


for _prim in PRIMITIVES:
  _prim.def_effectful_abstract_eval(_effectful_abstract_eval)


# ----------------------------------------------------------------------- eager and lowering


@functools.partial(jax.jit, static_argnames=("cfg", "trees", "has_bias", "out_hint"))
def _compiled(*operands, cfg, trees, has_bias, out_hint):
  # One compilation per (shapes, parameters): eager calls do not re-trace the kernels.
  return gmm_p.bind(*operands, cfg=cfg, trees=trees, has_bias=has_bias, out_hint=out_hint)


for _prim in PRIMITIVES:
  _prim.def_impl(lambda *operands, **params: _compiled(*operands, **params))


def as_float(x, dtype=jnp.float32):
  """A QArray dequantized (in `dtype`); an array as it is."""
  return dequantize(x, dtype) if isinstance(x, QArray) else x


def grouped_rows(cfg: GmmConfig, lhs) -> int:
  """R: the rows of an m-grouped problem (gathered rows, else lhs's)."""
  if cfg.gather_rows is not None:
    return cfg.gather_rows
  # An undefined primal (a transpose with respect to lhs) is an empty pytree: its aval.
  value = lhs.aval if ad.is_undefined_primal(lhs) else jax.tree.leaves(lhs)[0]
  return value.shape[1] if cfg.transpose_lhs else value.shape[0]


def row_ids(counts, group_offset, cfg: GmmConfig, num_rows: int):
  """The local group of each of the `num_rows` grouped rows (-1: none) of an m-grouped
  call, None for k-grouping: what `epilogue.finish` masks and gathers per-group values by."""
  if cfg.group_type != "m":
    return None
  return metadata.row_group_ids(counts, num_rows, group_offset, cfg.num_local)
