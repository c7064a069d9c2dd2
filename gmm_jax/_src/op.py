"""The differentiable gmm op: one JAX primitive with jvp, transpose, batching and lowering
rules, like `jax.lax.ragged_dot_general_p`.

Floor 2: below it only the dispatcher, the metadata and the data modules. Every derivative
is another gmm, so backends implement forwards only.

For m-grouping, y = act(z), z[rows of g] = lhs[rows of g] @ rhs[g] + bias[g]:
  tangent    dz = gmm_m(dlhs, rhs) + gmm_m(lhs, drhs) + dbias[group of each row]
  transpose  dlhs = gmm_m(ct, rhs^T)      (the same group list and group_offset)
             drhs[g] = lhs[rows of g]^T @ ct[rows of g] = gmm_k over the rows
             dbias[g] = sum of ct over the rows of g
For k-grouping, out[g] = act(lhs[:, cols of g] @ rhs[cols of g] + bias[g]):
  transpose  dlhs^T = gmm_m(rhs, ct^T)    (rows of rhs grouped like the columns of lhs)
             drhs = gmm_m(lhs^T, ct)
             dbias[g] = sum of ct[g] over M
The family {gmm_m, gmm_k} x transposes is closed under transposition, so derivatives of
any order are gmms. An activation makes the op nonlinear: its jvp computes the f32
pre-activation z with a gmm and applies the activation's own jvp; the tangent gmms carry no
activation, so only linear gmms are ever transposed. Rows and groups that are not local get
zero derivatives because the forward gmms never write them.

Why a primitive and not a `jax.custom_vjp`: a custom_vjp function cannot be
forward-differentiated (jax.jvp, jax.linearize, hessians by forward-over-reverse), its
backward cannot be differentiated again when the forward is a while loop, and its static
options travel as nondiff_argnums. A primitive composes with every transformation, and
its lowering is where the platform of a call is known: the lowering rule asks the
dispatcher for the platform the program is lowered for (a deviceless compile for a GPU
or TPU picks their kernels).

Operands: the leaves of lhs and rhs (each an array or a `QArray`, whose tree structures
are parameters), counts, group_offset, and bias when present. QArray operands are
differentiable in their float leaves (scale, zero point, float values) through
`dequantize`; their integer values get float0 tangents.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from gmm_jax._src import dispatch, group_list, metadata, strategy, tuning
from gmm_jax._src.config import GmmConfig, output_shape, saved_preactivation_dtype
from gmm_jax._src.epilogue import (NO_ROWS, Rows, finish, gather_rows, resolve_activation,
                                   rows_sum, scatter_rows)
from gmm_jax._src.qarray import QArray, dequantize, quant_mode

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


def _primitive() -> Primitive:
  """The primitive for the current trace: deviceless under an abstract mesh alone (no
  concrete mesh in context: `jax.sharding.use_abstract_mesh`, or inside a shard_map,
  where every device's blocks are already local)."""
  if (not jax.sharding.get_abstract_mesh().empty and _concrete_mesh is not None
      and _concrete_mesh().empty):
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
        rows: Rows = NO_ROWS) -> jax.Array:
  """The differentiable gmm on canonical operands (see `GmmConfig`).

  Args:
    lhs, rhs: arrays, or `QArray`s for a quantized mode that some backend serves (the
      lowering dequantizes when none does on the platform it lowers for).
    counts: int32 ``[G]`` sizes that fit the grouped dimension (`group_list.to_counts`).
    group_offset: int32 scalar.
    bias: None or ``[num_local, N]``.
    cfg: the static options.
    out_hint: None or a PartitionSpec for the output's dims that no operand decides (the
      groups of a k-grouped output: the weight gradient takes the weights' sharding).
    rows: the row operands that `cfg` announces (``cfg.gather_rows``, ``cfg.row_weights``,
      ``cfg.out_rows``; see `GmmConfig`).
  """
  lhs_leaves, lhs_tree = jax.tree.flatten(lhs)
  rhs_leaves, rhs_tree = jax.tree.flatten(rhs)
  operands = [*lhs_leaves, *rhs_leaves, counts, group_offset]
  if bias is not None:
    operands.append(bias)
  for present, value in ((cfg.gather_rows is not None, rows.lhs_indices),
                         (cfg.row_weights, rows.row_weights),
                         (cfg.out_rows is not None, rows.out_indices)):
    if present:
      operands.append(value)
  operands = _same_vma([jnp.asarray(x) for x in operands])
  return _primitive().bind(*operands, cfg=cfg, trees=(lhs_tree, rhs_tree),
                           has_bias=bias is not None, out_hint=out_hint)


def _unpack(operands, trees, has_bias):
  """(lhs, rhs, counts, group_offset, bias) from the flat operands (or their avals,
  tangents, batch dims: anything with one entry per operand)."""
  lhs_tree, rhs_tree = trees
  num_lhs, num_rhs = lhs_tree.num_leaves, rhs_tree.num_leaves
  lhs = jax.tree.unflatten(lhs_tree, operands[:num_lhs])
  rhs = jax.tree.unflatten(rhs_tree, operands[num_lhs:num_lhs + num_rhs])
  rest = operands[num_lhs + num_rhs:]
  return lhs, rhs, rest[0], rest[1], rest[2] if has_bias else None


def _rows(operands, trees, has_bias, cfg: GmmConfig) -> Rows:
  """The row operands (or their avals, tangents, batch dims) after the bias."""
  rest = iter(operands[trees[0].num_leaves + trees[1].num_leaves + 2 + int(has_bias):])
  return Rows(next(rest) if cfg.gather_rows is not None else None,
              next(rest) if cfg.row_weights else None,
              next(rest) if cfg.out_rows is not None else None)


def _is_plain(tree) -> bool:
  return jax.tree_util.treedef_is_leaf(tree)


# ---------------------------------------------------------------------- abstract eval


def _leaf_shapes(x) -> list[tuple[int, ...]]:
  return [tuple(leaf.shape) for leaf in jax.tree.leaves(x)]


def _explicit_spec(aval):
  """The spec an aval's type carries on a mesh with Explicit axes (else replicated)."""
  spec = getattr(aval.sharding, "spec", None)
  return P() if spec is None else spec


def _abstract_eval(*avals, cfg, trees, has_bias, out_hint):
  lhs, rhs, _, _, bias = _unpack(avals, trees, has_bias)
  lhs_value, rhs_value = jax.tree.leaves(lhs)[0], jax.tree.leaves(rhs)[0]
  shape = output_shape(lhs_value.shape, rhs_value.shape, cfg)
  meshes = [a.sharding.mesh for a in avals if not a.sharding.mesh.empty]
  mesh = meshes[0] if meshes else avals[0].sharding.mesh
  if mesh.empty:
    return jax.core.ShapedArray(shape, cfg.out_dtype)
  if cfg.has_rows:  # gathered/scattered rows: XLA's propagation shards it (replicated type)
    return jax.core.ShapedArray(shape, cfg.out_dtype,
                                sharding=NamedSharding(mesh, P(*[None] * len(shape))),
                                manual_axis_type=avals[0].mat)
  # With Explicit mesh axes the output's type is sharded as the partitioning rule will
  # make it (see `strategy.choose`); inside shard_map the result varies over the mesh axes
  # its (cast) operands vary over.
  spec = P(*[None] * len(shape))
  if any(_explicit_spec(a) != P() for a in avals) or out_hint:
    mesh_shape = {a: s for a, s in zip(mesh.axis_names, mesh.axis_sizes)}
    plan = strategy.choose(mesh_shape, cfg, _leaf_shapes(lhs), _leaf_shapes(rhs),
                           _explicit_spec(lhs_value), _explicit_spec(rhs_value), out_hint,
                           None if bias is None else _explicit_spec(bias))
    spec = plan.spec("out")
  return jax.core.ShapedArray(shape, cfg.out_dtype, sharding=NamedSharding(mesh, spec),
                              manual_axis_type=avals[0].mat)


for _prim in PRIMITIVES:
  _prim.def_abstract_eval(_abstract_eval)


# ----------------------------------------------------------------------- eager and lowering


@functools.partial(jax.jit, static_argnames=("cfg", "trees", "has_bias", "out_hint"))
def _compiled(*operands, cfg, trees, has_bias, out_hint):
  # One compilation per (shapes, parameters): eager calls do not re-trace the kernels.
  return gmm_p.bind(*operands, cfg=cfg, trees=trees, has_bias=has_bias, out_hint=out_hint)


for _prim in PRIMITIVES:
  _prim.def_impl(lambda *operands, **params: _compiled(*operands, **params))


def _as_float(x, dtype=jnp.float32):
  return dequantize(x, dtype) if isinstance(x, QArray) else x


def _implementation(*operands, platform, cfg, trees, has_bias):
  lhs, rhs, counts, group_offset, bias = _unpack(operands, trees, has_bias)
  rows = _rows(operands, trees, has_bias, cfg)
  return _run_on(platform)(lhs, rhs, counts, group_offset, bias, cfg, rows)


def _run_on(platform):
  """The unsharded gmm on `platform`, as `strategy.local_gmm` calls it."""

  def run(lhs, rhs, counts, group_offset, bias, cfg, rows=NO_ROWS):
    try:
      return dispatch.run(lhs, rhs, counts, group_offset, bias, cfg, platform, rows)
    except NotImplementedError as err:
      if quant_mode(lhs, rhs, cfg) == "none":
        raise
      # No implementation on this platform serves the quantized mode: the float gmm of the
      # values the QArrays stand for (weight-only keeps the activations' dtype).
      lhs_float = _as_float(lhs)
      rhs_float = _as_float(rhs, lhs_float.dtype
                            if jnp.issubdtype(lhs_float.dtype, jnp.floating) else jnp.float32)
      try:
        return dispatch.run(lhs_float, rhs_float, counts, group_offset, bias, cfg, platform,
                            rows)
      except NotImplementedError as float_err:
        raise NotImplementedError(f"{err}; dequantized: {float_err}") from None

  return run


# ------------------------------------------------------------------ partitioning rule
#
# Under plain jit with sharded operands, the lowering calls a `custom_partitioning`
# function: XLA's partitioner asks `_partition` how to split the gmm given the operands'
# shardings, and every device runs `strategy.local_gmm` (local experts + psum, local group
# sizes, ...). Without it the partitioner would see an opaque loop and gather the operands.
# (../shared/notes/jax-primitive-and-partitioning.md, section 5.)
#
# A custom_partitioning call made inside another primitive's lowering gets the devices only
# if the primitive is in jax's private set of primitives that need them while lowering.
# Whether a trace has concrete devices is also private (`jax.sharding.get_mesh` refuses to
# run inside jit).
try:
  import jax._src.dispatch as _jax_dispatch
  import jax._src.mesh as _jax_mesh

  _jax_dispatch.prim_requires_devices_during_lowering.add(gmm_p)
  _concrete_mesh = _jax_mesh.get_concrete_mesh
  PARTITIONABLE = True
except (ImportError, AttributeError):  # a jax without them: plain lowering only
  _concrete_mesh = None
  PARTITIONABLE = False


def _arg_spec(shape) -> P:
  sharding = getattr(shape, "sharding", None)
  spec = getattr(sharding, "spec", None)
  return P() if spec is None else spec


def _leaf_groups(flat, trees, has_bias):
  """(lhs leaves, rhs leaves, bias or None) of the flat operands (or their shapes)."""
  num_lhs, num_rhs = trees[0].num_leaves, trees[1].num_leaves
  return (list(flat[:num_lhs]), list(flat[num_lhs:num_lhs + num_rhs]),
          flat[-1] if has_bias else None)


def _choose(static, mesh, arg_shapes, result_spec):
  cfg, trees, has_bias, _ = static
  (arg_shapes,) = arg_shapes  # the one dynamic argument of `_partitioned`: the operands
  lhs_leaves, rhs_leaves, bias = _leaf_groups(list(arg_shapes), trees, has_bias)
  mesh_shape = dict(mesh.shape)
  plan = strategy.choose(mesh_shape, cfg, [s.shape for s in lhs_leaves],
                         [s.shape for s in rhs_leaves], _arg_spec(lhs_leaves[0]),
                         _arg_spec(rhs_leaves[0]), result_spec,
                         None if bias is None else _arg_spec(bias))
  specs = (strategy.leaf_specs([s.shape for s in lhs_leaves], plan.spec("lhs"), mesh_shape)
           + strategy.leaf_specs([s.shape for s in rhs_leaves], plan.spec("rhs"), mesh_shape)
           + [P(None), P()] + ([plan.spec("bias")] if has_bias else []))
  return plan, specs


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _partition(static, mesh, arg_shapes, result_shape):
  cfg, trees, has_bias, platform = static
  plan, specs = _choose(static, mesh, arg_shapes, _arg_spec(result_shape))
  dispatch.note_plan(plan)

  def lower_fn(operands):
    lhs, rhs, counts, group_offset, bias = _unpack(operands, trees, has_bias)
    # Traced per device with every mesh axis manual: a context mesh of the user's
    # (`jax.set_mesh`) must not make its arrays sharding-typed.
    with jax.sharding.use_abstract_mesh(_NO_MESH):
      return strategy.local_gmm(_run_on(platform), plan, lhs, rhs, counts, group_offset,
                                bias, cfg)

  shardings = tuple(NamedSharding(mesh, spec) for spec in specs)
  return mesh, lower_fn, NamedSharding(mesh, plan.spec("out")), (shardings,)


def _infer_output_sharding(static, mesh, arg_shapes, result_shape):
  # GSPMD (jax_use_shardy_partitioner=False) asks this; Shardy uses the rule below.
  plan, _ = _choose(static, mesh, arg_shapes, None)
  return NamedSharding(mesh, plan.spec("out"))


def _sharding_rule(static, mesh, operand_types, result_types):
  """Shardy's factors: m, k, n, g as in `strategy.operand_dims`; the group list its own
  replicated factor; a QArray scale dim that is not the values' size its own factor."""
  cfg, trees, has_bias, _ = static
  dims = strategy.operand_dims(cfg)
  shapes = [tuple(mlir.ir.ShapedType(t).shape) for t in operand_types]
  lhs_shapes, rhs_shapes, _ = _leaf_groups(shapes, trees, has_bias)
  extra = iter(f"s{i}" for i in range(64))
  mappings = []
  for operand, leaves in (("lhs", lhs_shapes), ("rhs", rhs_shapes)):
    for shape in leaves:
      mappings.append(" ".join(
          name if size == full else next(extra)
          for name, size, full in zip(dims[operand], shape, leaves[0])))
  mappings += ["h", ""] + (["g n"] if has_bias else [])
  rule = ", ".join(mappings) + " -> " + " ".join(dims["out"])
  reductions = ("g", "k") if cfg.group_type == "m" else ("k",)
  order = []
  for token in rule.replace(",", " ").split():
    if token not in order and token != "->":
      order.append(token)
  return rule, dict(
      reduction_factors=tuple(f for f in order if f in reductions),
      need_replication_factors=tuple(f for f in order if f == "h"))


@functools.partial(custom_partitioning, static_argnums=(0,))
def _partitioned(static, operands):
  # The unpartitioned form (what a single device or a fully manual context lowers): the
  # primitive itself, whose lowering there calls the implementation directly.
  cfg, trees, has_bias, platform = static
  return gmm_deviceless_p.bind(*operands, cfg=cfg.replace(platform=platform), trees=trees,
                               has_bias=has_bias, out_hint=None)


_partitioned.def_partition(partition=_partition,
                           infer_sharding_from_operands=_infer_output_sharding,
                           sharding_rule=_sharding_rule)


def _needs_partitioning(ctx) -> bool:
  """A program for several devices whose shardings name a mesh (some operand or result has
  a NamedSharding), not inside a shard_map that makes every axis manual (there the
  operands are already each device's blocks). A program with no mesh (e.g. under
  `jax.set_mesh` with only unplaced arrays) has nothing to partition."""
  context = ctx.module_context.axis_context
  devices = getattr(context, "device_assignment", None)
  return (PARTITIONABLE and type(context).__name__ == "ShardingContext"
          and devices is not None and len(devices) > 1
          and getattr(context, "abstract_mesh", None) is not None)


def _lowering(ctx, *operands, platform, **params):
  # The implementation is traced on plain types: mesh-typed or varying avals would make
  # its slicing and while loops sharding-typed.
  ctx = ctx.replace(avals_in=[jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_in],
                    avals_out=[jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_out])
  params.pop("out_hint")
  if params["cfg"].platform is not None:
    platform = params["cfg"].platform
  elif platform is None:
    platform = dispatch.normalize_platform(ctx.module_context.platforms[0])
  # Gathered or scattered rows are not split by the partitioning rule: XLA's propagation
  # shards them (the MoE layers run them per shard, inside `routed_apply`).
  if _needs_partitioning(ctx) and not params["cfg"].has_rows:
    static = (params["cfg"], params["trees"], params["has_bias"], platform)
    return mlir.lower_fun(lambda *xs: _partitioned(static, xs),
                          multiple_results=False)(ctx, *operands)
  return mlir.lower_fun(functools.partial(_implementation, platform=platform, **params),
                        multiple_results=False)(ctx, *operands)


for _prim in PRIMITIVES:
  mlir.register_lowering(_prim, functools.partial(_lowering, platform=None))
  for _jax_platform, _platform in dispatch.JAX_PLATFORMS:
    mlir.register_lowering(_prim, functools.partial(_lowering, platform=_platform),
                           platform=_jax_platform)


# --------------------------------------------------------------------------------- jvp


def _is_zero(tangent) -> bool:
  return type(tangent) is ad.Zero


def _has_tangent(tangent) -> bool:
  return not all(_is_zero(t) for t in jax.tree.leaves(tangent, is_leaf=_is_zero))


def _dequantized_tangent(q: QArray, tangent) -> jax.Array:
  """The tangent of ``dequantize(q)`` (f32) for tangents of q's leaves."""
  leaves, tree = jax.tree.flatten(q)
  tangents = [ad.instantiate_zeros(t) for t in jax.tree.leaves(tangent, is_leaf=_is_zero)]
  return jax.jvp(lambda *xs: dequantize(jax.tree.unflatten(tree, xs)), leaves, tangents)[1]


def _row_mask(counts, group_offset, cfg: GmmConfig, m: int):
  if cfg.group_type != "m":
    return None
  return metadata.row_group_ids(counts, m, group_offset, cfg.num_local) >= 0


def _bias_term(bias, counts, group_offset, cfg: GmmConfig, out_shape, dtype):
  """The bias as it enters the pre-activation: ``[M, N]`` rows of their group's bias (0 on
  rows of no local group) or ``[L, M, N]``."""
  bias = bias.astype(dtype)
  if cfg.group_type == "k":
    return jnp.broadcast_to(bias[:, None, :], out_shape)
  ids = metadata.row_group_ids(counts, out_shape[0], group_offset, cfg.num_local)
  return jnp.where((ids >= 0)[:, None], bias[jnp.maximum(ids, 0)], jnp.zeros((), dtype))


def _grouped_rows(cfg: GmmConfig, lhs) -> int:
  """R: the rows of an m-grouped problem (gathered rows, else lhs's)."""
  if cfg.gather_rows is not None:
    return cfg.gather_rows
  value = jax.tree.leaves(lhs)[0]
  return value.shape[1] if cfg.transpose_lhs else value.shape[0]


def _rows_out(values, rows: Rows, counts, group_offset, cfg: GmmConfig):
  """Per-row values of the R grouped rows (``[R, N]``) as the result holds them: weighted
  (in f32) and scattered as `cfg` says, in its out_dtype."""
  if cfg.row_weights:
    values = values.astype(jnp.float32) * rows.row_weights.astype(jnp.float32)[:, None]
  values = values.astype(cfg.out_dtype)
  if cfg.out_rows is not None:
    written = metadata.row_group_ids(counts, values.shape[0], group_offset, cfg.num_local) >= 0
    values = scatter_rows(values, rows.out_indices, cfg.out_rows, written)
  return values


def _tangent(lhs, rhs, counts, group_offset, tangents, cfg: GmmConfig, out_shape, out_hint,
             rows: Rows = NO_ROWS):
  """The linear part: gmm(dlhs, rhs) + gmm(lhs, drhs) + bias(dbias), or None when every
  tangent is zero. `cfg` has no activation; its out_dtype is the tangent's dtype; its row
  operations (gather, constant row weights, scatter) apply to every term."""
  t_lhs, t_rhs, t_bias = tangents
  terms = []
  if _has_tangent(t_lhs):
    if isinstance(lhs, QArray):
      terms.append(gmm(_dequantized_tangent(lhs, t_lhs), _as_float(rhs), counts,
                       group_offset, None, cfg, out_hint, rows))
    else:
      terms.append(gmm(ad.instantiate_zeros(t_lhs), rhs, counts, group_offset, None, cfg,
                       out_hint, rows))
  if _has_tangent(t_rhs):
    if isinstance(rhs, QArray):
      t_rhs = _dequantized_tangent(rhs, t_rhs)
    terms.append(gmm(_as_float(lhs), ad.instantiate_zeros(t_rhs), counts, group_offset, None,
                     cfg, out_hint, rows))
  if t_bias is not None and not _is_zero(t_bias):
    if cfg.has_rows:
      shape = (_grouped_rows(cfg, lhs), t_bias.shape[-1])
      terms.append(_rows_out(_bias_term(t_bias, counts, group_offset, cfg, shape, jnp.float32),
                             rows, counts, group_offset, cfg))
    else:
      terms.append(_bias_term(t_bias, counts, group_offset, cfg, out_shape, cfg.out_dtype))
  if not terms:
    return None
  return functools.reduce(jnp.add, [t.astype(cfg.out_dtype) for t in terms])


def _value_dtype(x):
  return np.dtype(jnp.float32) if isinstance(x, QArray) else np.dtype(x.dtype)


def _preactivation_dtype(lhs, rhs, cfg):
  return saved_preactivation_dtype(_value_dtype(lhs), _value_dtype(rhs), cfg.out_dtype)


def _widen(z):
  """A 16-bit pre-activation in f32 (the activation runs in f32 either way)."""
  return z.astype(jnp.float32) if jnp.dtype(z.dtype).itemsize < 4 else z


def _in_f32(fn):
  return lambda z: fn(_widen(z))


def _jvp(primals, tangents, *, cfg, trees, has_bias, out_hint):
  if cfg.has_rows:
    return _jvp_rows(primals, tangents, cfg=cfg, trees=trees, has_bias=has_bias,
                     out_hint=out_hint)
  lhs, rhs, counts, group_offset, bias = _unpack(primals, trees, has_bias)
  t_lhs, t_rhs, _, _, t_bias = _unpack(tangents, trees, has_bias)
  if cfg.activation is None:
    linear_cfg = cfg
    out = gmm(lhs, rhs, counts, group_offset, bias, cfg, out_hint)
    z = None
  else:
    # The pre-activation, for the activation's derivative.
    linear_cfg = cfg.replace(activation=None, out_dtype=_preactivation_dtype(lhs, rhs, cfg))
    z = checkpoint_name(gmm(lhs, rhs, counts, group_offset, bias, linear_cfg, out_hint),
                        PREACTIVATION)
    mask = _row_mask(counts, group_offset, cfg, z.shape[0])
    out = finish(_widen(z), cfg.activation, cfg.out_dtype, row_mask=mask)
  zero = ad.Zero(jax.typeof(out).to_tangent_aval())
  if not jnp.issubdtype(cfg.out_dtype, jnp.inexact):
    return out, zero
  dz = _tangent(lhs, rhs, counts, group_offset, (t_lhs, t_rhs, t_bias), linear_cfg,
                out.shape if z is None else z.shape, out_hint)
  if dz is None:
    return out, zero
  if z is None:
    return out, dz
  # Rematerialized: the backward keeps z alone and recomputes the activation's derivative
  # (elementwise) instead of keeping its intermediates (two or three arrays like z).
  _, dy = jax.jvp(jax.checkpoint(_in_f32(resolve_activation(cfg.activation))), (z,), (dz,))
  mask = _row_mask(counts, group_offset, cfg, z.shape[0])
  if mask is not None:
    dy = jnp.where(mask[:, None], dy, jnp.zeros((), dy.dtype))
  return out, dy.astype(cfg.out_dtype)


def _jvp_rows(primals, tangents, *, cfg, trees, has_bias, out_hint):
  """The jvp of an m-grouped gmm with row operands. Without an activation and with
  constant row weights it is linear: the tangent gmms carry the same row operations.
  Otherwise the pre-activation z (dtype: `saved_preactivation_dtype`) of the R grouped
  rows (gathered, not weighted or scattered) is one gmm; the activation (in f32), the
  weights (their tangent times the activation) and the scatter follow in jnp."""
  lhs, rhs, counts, group_offset, bias = _unpack(primals, trees, has_bias)
  t_lhs, t_rhs, _, _, t_bias = _unpack(tangents, trees, has_bias)
  rows = _rows(primals, trees, has_bias, cfg)
  t_weights = _rows(tangents, trees, has_bias, cfg).row_weights
  weights_vary = t_weights is not None and not _is_zero(t_weights)
  float_out = jnp.issubdtype(cfg.out_dtype, jnp.inexact)
  if cfg.activation is None and not weights_vary:
    out = gmm(lhs, rhs, counts, group_offset, bias, cfg, out_hint, rows)
    dy = None
    if float_out:
      dy = _tangent(lhs, rhs, counts, group_offset, (t_lhs, t_rhs, t_bias), cfg, out.shape,
                    out_hint, rows)
    return out, (ad.Zero(jax.typeof(out).to_tangent_aval()) if dy is None else dy)
  gathered = Rows(rows.lhs_indices, None, None)
  linear_cfg = cfg.replace(activation=None, row_weights=False, out_rows=None,
                           out_dtype=_preactivation_dtype(lhs, rhs, cfg))
  z = checkpoint_name(gmm(lhs, rhs, counts, group_offset, bias, linear_cfg, out_hint, gathered),
                      PREACTIVATION)  # [R, N]
  written = metadata.row_group_ids(counts, z.shape[0], group_offset, cfg.num_local) >= 0
  dz = None
  if float_out:
    dz = _tangent(lhs, rhs, counts, group_offset, (t_lhs, t_rhs, t_bias), linear_cfg, z.shape,
                  out_hint, gathered)
  fn = resolve_activation(cfg.activation)
  if fn is None:
    a, da = _widen(z), None if dz is None else _widen(dz)
  elif dz is None:
    a, da = fn(_widen(z)), None
  else:
    a, da = jax.jvp(jax.checkpoint(_in_f32(fn)), (z,), (dz,))
  weights = rows.row_weights if cfg.row_weights else None
  out = finish(a, None, cfg.out_dtype, row_mask=written, row_weights=weights)
  if cfg.out_rows is not None:
    out = scatter_rows(out, rows.out_indices, cfg.out_rows, written)
  if not float_out or (da is None and not weights_vary):
    return out, ad.Zero(jax.typeof(out).to_tangent_aval())
  dy = jnp.zeros(a.shape, a.dtype) if da is None else da
  if weights is not None:
    dy = dy * weights.astype(dy.dtype)[:, None]
  if weights_vary:
    dy = dy + a * t_weights.astype(a.dtype)[:, None]
  dy = jnp.where(written[:, None], dy, jnp.zeros((), dy.dtype)).astype(cfg.out_dtype)
  if cfg.out_rows is not None:
    dy = scatter_rows(dy, rows.out_indices, cfg.out_rows, written)
  return out, dy


for _prim in PRIMITIVES:
  ad.primitive_jvps[_prim] = _jvp


# --------------------------------------------------------------------------- transpose


def _undefined(x) -> bool:
  return any(ad.is_undefined_primal(leaf)
             for leaf in jax.tree.leaves(x, is_leaf=ad.is_undefined_primal))


def _spec_hint(x):
  """The spec of an undefined primal's type on a mesh (Explicit axes), else None."""
  sharding = getattr(x.aval, "sharding", None)
  if sharding is None or sharding.mesh.empty or sharding.spec == P():
    return None
  return sharding.spec


def _transpose(ct, *operands, cfg, trees, has_bias, out_hint):
  del out_hint
  if cfg.activation is not None:
    raise ValueError("a gmm with an activation is not linear; only its tangent gmms (which "
                     "carry no activation) are transposed")
  lhs, rhs, counts, group_offset, bias = _unpack(operands, trees, has_bias)
  if ad.is_undefined_primal(counts) or ad.is_undefined_primal(group_offset):
    raise ValueError("gmm is not linear in its group sizes or group_offset")
  rows = _rows(operands, trees, has_bias, cfg)
  if any(x is not None and ad.is_undefined_primal(x) for x in rows):
    raise NotImplementedError(
        "transposing gmm with respect to its row operands is not supported (the op "
        "differentiates row_weights in its jvp; indices are not differentiable)")
  results = [None] * len(operands)
  if _is_zero(ct):
    return results
  for name, x, tree in (("lhs", lhs, trees[0]), ("rhs", rhs, trees[1])):
    if _undefined(x) and not _is_plain(tree):
      raise NotImplementedError(
          f"transposing gmm with respect to the components of a QArray {name} is not "
          "supported; transpose with respect to a float operand (or dequantize it first)")
  # A fixed Tiling was chosen for the forward's shapes: the transposed gmms take their
  # `Tilings` entries (or the same callable), else the tuned/table/heuristic choice.
  base = cfg.replace(tiling=None)
  dlhs_tiling = tuning.backward_tiling(cfg.tiling, "dlhs")
  drhs_tiling = tuning.backward_tiling(cfg.tiling, "drhs")
  tl, tr = cfg.transpose_lhs, cfg.transpose_rhs
  ct_lhs = ct_rhs = ct_bias = None
  if cfg.group_type == "k" and cfg.has_rows:
    return _transpose_gathered_k(ct, operands, lhs, rows, cfg, trees, has_bias)
  if cfg.has_rows:
    ct_lhs, ct_rhs, ct_bias = _transpose_rows(ct, lhs, rhs, counts, group_offset, bias, rows,
                                              cfg, base, dlhs_tiling, drhs_tiling)
  elif cfg.group_type == "m":
    if ad.is_undefined_primal(lhs):
      ct_lhs = gmm(ct, rhs, counts, group_offset, None,
                     base.replace(transpose_lhs=False, transpose_rhs=not tr,
                                  out_dtype=lhs.aval.dtype, tiling=dlhs_tiling))  # [M, K]
      ct_lhs = ct_lhs.T if tl else ct_lhs
    if ad.is_undefined_primal(rhs):
      ct = _after(ct, ct_lhs)
      k_cfg = base.replace(group_type="k", out_dtype=rhs.aval.dtype, tiling=drhs_tiling)
      hint = _spec_hint(rhs)  # the weight gradient is laid out like the weights
      if tr:  # [L, N, K] = ct_g^T lhs_g
        ct_rhs = gmm(ct, _as_float(lhs), counts, group_offset, None,
                     k_cfg.replace(transpose_lhs=True, transpose_rhs=tl), hint)
      else:  # [L, K, N] = lhs_g^T ct_g
        ct_rhs = gmm(_as_float(lhs), ct, counts, group_offset, None,
                     k_cfg.replace(transpose_lhs=not tl, transpose_rhs=False), hint)
    if bias is not None and ad.is_undefined_primal(bias):
      ids = metadata.row_group_ids(counts, ct.shape[0], group_offset, cfg.num_local)
      ids = jnp.where(ids >= 0, ids, cfg.num_local)  # rows of no local group are dropped
      ct_bias = jax.ops.segment_sum(ct.astype(jnp.float32), ids, cfg.num_local + 1)
      ct_bias = ct_bias[:cfg.num_local].astype(bias.aval.dtype)
  else:
    m_cfg = base.replace(group_type="m")
    if ad.is_undefined_primal(lhs):
      ct_lhs_t = gmm(_as_float(rhs), ct, counts, group_offset, None,
                       m_cfg.replace(transpose_lhs=tr, transpose_rhs=True,
                                     out_dtype=lhs.aval.dtype, tiling=dlhs_tiling))  # [K, M]
      ct_lhs = ct_lhs_t if tl else ct_lhs_t.T
    if ad.is_undefined_primal(rhs):
      ct_rhs = gmm(_as_float(lhs), ct, counts, group_offset, None,
                     m_cfg.replace(transpose_lhs=not tl, transpose_rhs=False,
                                   out_dtype=rhs.aval.dtype, tiling=drhs_tiling))  # [K, N]
      ct_rhs = ct_rhs.T if tr else ct_rhs
    if bias is not None and ad.is_undefined_primal(bias):
      ct_bias = jnp.sum(ct.astype(jnp.float32), axis=1).astype(bias.aval.dtype)
  num_lhs, num_rhs = trees[0].num_leaves, trees[1].num_leaves
  if ct_lhs is not None:
    results[0] = ct_lhs
  if ct_rhs is not None:
    results[num_lhs] = ct_rhs
  if ct_bias is not None:
    results[num_lhs + num_rhs + 2] = ct_bias
  return results


def _after(ct, ct_lhs):
  """`ct` for the weight gradient, available only once the input gradient `ct_lhs` exists.

  Ordering the two products of a transpose keeps their big temporaries apart: the input
  gradient's operands (on XLA:CPU with jax 0.10, a bit-pattern copy of the 16-bit weights)
  die before the weight gradient's result ([G, K, N]) is allocated. Measured on a bf16 MoE
  training step (E=64, D=1024, F=2048): peak temporaries 1286 -> 728 MB with jax 0.10.2.
  """
  if ct_lhs is None:
    return ct
  return lax.optimization_barrier((ct, ct_lhs))[0]


def _transpose_gathered_k(ct, operands, lhs, rows: Rows, cfg: GmmConfig, trees, has_bias):
  """The transpose of a k-grouped gmm whose contraction rows are gathered (a weight
  gradient, transposed again for a higher-order derivative): the plain k-grouped transpose
  on the gathered rows, whose cotangent sums back into lhs's rows (`rows_sum`)."""
  num_rows = cfg.gather_rows
  if ad.is_undefined_primal(lhs):
    lhs_rows = ad.UndefinedPrimal(jax.core.ShapedArray((num_rows,) + lhs.aval.shape[1:],
                                                       lhs.aval.dtype))
  else:
    lhs_rows = gather_rows(lhs, rows.lhs_indices)
  plain = [lhs_rows] + list(operands[1:len(operands) - 1])  # lhs is one leaf; no bias rows
  results = _transpose(ct, *plain, cfg=cfg.without_rows(), trees=trees, has_bias=has_bias,
                       out_hint=None)
  if ad.is_undefined_primal(lhs) and results[0] is not None:
    # Rows outside the local groups got a zero cotangent from the dlhs gmm.
    results[0] = rows_sum(results[0], rows.lhs_indices, lhs.aval.shape[0])
  return results + [None]


def _transpose_rows(ct, lhs, rhs, counts, group_offset, bias, rows: Rows, cfg: GmmConfig,
                    base: GmmConfig, dlhs_tiling, drhs_tiling):
  """The transpose of a linear m-grouped gmm with row operands: out = scatter(w * (gather(
  lhs) @ rhs[g] + bias[g])). The cotangent of the grouped rows is ``ct[out_indices] * w``:
  the dlhs gmm gathers ct's rows and weights its result rows itself; the gather of lhs
  transposes to `rows_sum` (a fixed-order sum per token, no atomics). The weight and bias
  gradients take the gathered, weighted rows."""
  num_rows = _grouped_rows(cfg, lhs)
  written = metadata.row_group_ids(counts, num_rows, group_offset, cfg.num_local) >= 0
  weights = rows.row_weights if cfg.row_weights else None
  scattered = cfg.out_rows is not None
  ct_lhs = ct_rhs = ct_bias = None
  if ad.is_undefined_primal(lhs):
    d_cfg = base.replace(transpose_lhs=False, transpose_rhs=not cfg.transpose_rhs,
                         out_dtype=lhs.aval.dtype, tiling=dlhs_tiling,
                         gather_rows=num_rows if scattered else None,
                         row_weights=weights is not None, out_rows=None)
    d_rows = gmm(ct, rhs, counts, group_offset, None, d_cfg,
                 rows=Rows(rows.out_indices if scattered else None, weights, None))  # [R, K]
    if cfg.gather_rows is not None:
      indices = jnp.where(written, rows.lhs_indices, -1)
      ct_lhs = rows_sum(d_rows, indices, lhs.aval.shape[0])
    else:
      ct_lhs = d_rows.T if cfg.transpose_lhs else d_rows
  if ad.is_undefined_primal(rhs) or (bias is not None and ad.is_undefined_primal(bias)):
    ct = _after(ct, ct_lhs)
    ct_rows = gather_rows(ct, rows.out_indices) if scattered else ct  # [R, N]
    if weights is not None:
      ct_rows = (ct_rows.astype(jnp.float32)
                 * weights.astype(jnp.float32)[:, None]).astype(ct.dtype)
    if ad.is_undefined_primal(rhs):
      x_rows = _as_float(lhs)
      transpose_lhs = cfg.transpose_lhs
      k_cfg = base.replace(group_type="k", out_dtype=rhs.aval.dtype, tiling=drhs_tiling,
                           gather_rows=None, row_weights=False, out_rows=None)
      hint = _spec_hint(rhs)
      if cfg.transpose_rhs:  # [L, N, K] = ct_g^T x_g
        if cfg.gather_rows is not None:
          x_rows, transpose_lhs = gather_rows(x_rows, rows.lhs_indices), False
        ct_rhs = gmm(ct_rows, x_rows, counts, group_offset, None,
                     k_cfg.replace(transpose_lhs=True, transpose_rhs=transpose_lhs), hint)
      elif cfg.gather_rows is not None:  # [L, K, N] = x[idx_g]^T ct_g: the rows by index
        ct_rhs = gmm(x_rows, ct_rows, counts, group_offset, None,
                     k_cfg.replace(transpose_lhs=True, transpose_rhs=False,
                                   gather_rows=num_rows), hint,
                     Rows(rows.lhs_indices, None, None))
      else:  # [L, K, N] = x_g^T ct_g
        ct_rhs = gmm(x_rows, ct_rows, counts, group_offset, None,
                     k_cfg.replace(transpose_lhs=not transpose_lhs, transpose_rhs=False), hint)
    if bias is not None and ad.is_undefined_primal(bias):
      ids = metadata.row_group_ids(counts, num_rows, group_offset, cfg.num_local)
      ids = jnp.where(ids >= 0, ids, cfg.num_local)
      ct_bias = jax.ops.segment_sum(ct_rows.astype(jnp.float32), ids, cfg.num_local + 1)
      ct_bias = ct_bias[:cfg.num_local].astype(bias.aval.dtype)
  return ct_lhs, ct_rhs, ct_bias


for _prim in PRIMITIVES:
  ad.primitive_transposes[_prim] = _transpose


# ---------------------------------------------------------------------------- batching


def _moved(x, dim, to):
  return jnp.moveaxis(x, dim, to)


def _fold_into_rows(lhs, dim, size, rhs, counts, group_offset, bias, cfg):
  """Only lhs is batched: the batch becomes more rows of the same groups."""
  if cfg.group_type == "m":
    # Row r*B + b is row r of example b, so every group stays contiguous with B times as
    # many rows.
    if cfg.transpose_lhs:  # [K, M, B] -> [K, M*B]
      moved = _moved(lhs, dim, 2)
      m = moved.shape[1]
      folded = moved.reshape(moved.shape[0], m * size)
    else:  # [M, B, K] -> [M*B, K]
      moved = _moved(lhs, dim, 1)
      m = moved.shape[0]
      folded = moved.reshape(m * size, moved.shape[-1])
    sizes = group_list.clamp_counts(counts, m) * size
    out = gmm(folded, rhs, sizes, group_offset, bias, cfg)  # [M*B, N]
    return out.reshape(m, size, -1), 1
  # k-grouping: M is not grouped, so the examples are stacked along it.
  if cfg.transpose_lhs:  # [K, B, M] -> [K, B*M]
    moved = _moved(lhs, dim, 1)
    folded = moved.reshape(moved.shape[0], -1)
  else:  # [B, M, K] -> [B*M, K]
    moved = _moved(lhs, dim, 0)
    folded = moved.reshape(-1, moved.shape[-1])
  out = gmm(folded, rhs, counts, group_offset, bias, cfg)  # [L, B*M, N]
  return out.reshape(out.shape[0], size, -1, out.shape[-1]), 1


def _fold_into_columns(lhs, rhs, dim, size, counts, group_offset, bias, bias_dim, cfg):
  """Only rhs (and the bias) are batched: the batch becomes more output columns."""
  if cfg.group_type == "m":
    if cfg.transpose_rhs:  # [G, B, N, K] -> [G, B*N, K]
      folded = _moved(rhs, dim, 1)
      folded = folded.reshape(folded.shape[0], -1, folded.shape[-1])
    else:  # [G, K, B, N] -> [G, K, B*N]
      folded = _moved(rhs, dim, 2)
      folded = folded.reshape(folded.shape[0], folded.shape[1], -1)
  elif cfg.transpose_rhs:  # [B, N, K] -> [B*N, K]
    folded = _moved(rhs, dim, 0)
    folded = folded.reshape(-1, folded.shape[-1])
  else:  # [K, B, N] -> [K, B*N]
    folded = _moved(rhs, dim, 1)
    folded = folded.reshape(folded.shape[0], -1)
  if bias is not None:
    if bias_dim is None:
      bias = jnp.broadcast_to(bias[:, None, :], (bias.shape[0], size, bias.shape[-1]))
    else:
      bias = _moved(bias, bias_dim, 1)
    bias = bias.reshape(bias.shape[0], -1)
  out = gmm(lhs, folded, counts, group_offset, bias, cfg)  # [M, B*N] / [L, M, B*N]
  return out.reshape(*out.shape[:-1], size, -1), out.ndim - 1


def _batch(operands, dims, *, cfg, trees, has_bias, out_hint):
  size = next(x.shape[d] for x, d in zip(operands, dims) if d is not None)
  dims = [d for d in dims]
  lhs, rhs, counts, group_offset, bias = _unpack(operands, trees, has_bias)
  lhs_dims, rhs_dims, counts_dim, offset_dim, bias_dim = _unpack(dims, trees, has_bias)
  lhs_batched = any(d is not None for d in jax.tree.leaves(lhs_dims))
  rhs_batched = any(d is not None for d in jax.tree.leaves(rhs_dims))
  shared_groups = counts_dim is None and offset_dim is None and not cfg.has_rows
  if shared_groups and _is_plain(trees[0]) and lhs_batched and not rhs_batched and (
      bias_dim is None):
    return _fold_into_rows(lhs, lhs_dims, size, rhs, counts, group_offset, bias, cfg)
  if shared_groups and _is_plain(trees[1]) and rhs_batched and not lhs_batched:
    return _fold_into_columns(lhs, rhs, rhs_dims, size, counts, group_offset, bias, bias_dim,
                              cfg)
  # A batch of problems (each with its own weights or group sizes): one gmm per example.
  batched = [i for i, d in enumerate(dims) if d is not None]
  stacked = tuple(_moved(operands[i], dims[i], 0) for i in batched)

  def one(slices):
    example = list(operands)
    for i, x in zip(batched, slices):
      example[i] = x
    return _primitive().bind(*example, cfg=cfg, trees=trees, has_bias=has_bias,
                             out_hint=out_hint)

  return lax.map(one, stacked), 0


for _prim in PRIMITIVES:
  batching.primitive_batchers[_prim] = _batch
