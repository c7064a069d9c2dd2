"""The lowering of the gmm primitive: the implementation the dispatcher picks for the
platform the program is lowered for, and, under a multi-device context, the partitioning
rule that splits the gmm over the mesh (`strategy`) so that no implementation (a Pallas
call in particular) sits in a program XLA partitions on its own.

Floor 2 (the op package).
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.interpreters import mlir
from jax.sharding import NamedSharding, PartitionSpec as P

from gmm_jax._src.backends import registry
from gmm_jax._src.core import host_limits, jax_private
from gmm_jax._src.sharding import strategy
from gmm_jax._src.core.epilogue import NO_ROWS
from gmm_jax._src.op import primitive
from gmm_jax._src.op.primitive import (PRIMITIVES, concrete_mesh, as_float, gmm_deviceless_p,
                                       gmm_p, row_operands, unpack)
from gmm_jax._src.core.qarray import quant_mode


def _implementation(*operands, platform, cfg, trees, has_bias):
  lhs, rhs, counts, group_offset, bias = unpack(operands, trees, has_bias)
  rows = row_operands(operands, trees, has_bias, cfg)
  return _run_on(platform)(lhs, rhs, counts, group_offset, bias, cfg, rows)


def _run_on(platform):
  """The unsharded gmm on `platform`, as `strategy.local_gmm` calls it."""

  def run(lhs, rhs, counts, group_offset, bias, cfg, rows=NO_ROWS):
    try:
      return registry.run(lhs, rhs, counts, group_offset, bias, cfg, platform, rows)
    except NotImplementedError as err:
      if quant_mode(lhs, rhs, cfg) == "none":
        raise
      # No implementation on this platform serves the quantized mode: the float gmm of the
      # values the QArrays stand for (weight-only keeps the activations' dtype).
      lhs_float = as_float(lhs)
      rhs_float = as_float(rhs, lhs_float.dtype
                            if jnp.issubdtype(lhs_float.dtype, jnp.floating) else jnp.float32)
      try:
        return registry.run(lhs_float, rhs_float, counts, group_offset, bias, cfg, platform,
                            rows)
      except NotImplementedError as float_err:
        raise NotImplementedError(f"{err}; dequantized: {float_err}") from None

  return run


def _bound_on(platform):
  """The unsharded gmm on `platform` as one primitive (lowered, in a manual context, by
  `_implementation`). The partitioner lowers each device's program on its own and refuses
  one with effects: the Mosaic GPU kernel writes its output through a mutable Ref
  (`InternalMutableArrayEffect`), which stays hidden inside the primitive's lowering."""

  def run(lhs, rhs, counts, group_offset, bias, cfg, rows=NO_ROWS):
    return primitive.gmm(lhs, rhs, counts, group_offset, bias, cfg.replace(platform=platform),
                         rows=rows, primitive=gmm_deviceless_p)

  return run


# ------------------------------------------------------------------ partitioning rule
#
# Under plain jit with sharded operands, the lowering calls a `custom_partitioning`
# function: XLA's partitioner asks `_partition` how to split the gmm given the operands'
# shardings, and every device runs `strategy.local_gmm` (local experts + psum, local group
# sizes, ...). Without it the partitioner would see an opaque loop and gather the operands.
#
# A custom_partitioning call made inside another primitive's lowering gets the devices only
# if the primitive is in jax's private set of primitives that need them while lowering.
# Whether a trace has concrete devices is also private (`jax.sharding.get_mesh` refuses to
# run inside jit).
# Without either (a jax that lacks them; `jax_private` warns) only the plain lowering runs.
PARTITIONABLE = (jax_private.require_devices_during_lowering(gmm_p)
                 and concrete_mesh is not None)


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
  plan = strategy.for_rows(strategy.choose(
      mesh_shape, cfg, [s.shape for s in lhs_leaves], [s.shape for s in rhs_leaves],
      _arg_spec(lhs_leaves[0]), _arg_spec(rhs_leaves[0]), result_spec,
      None if bias is None else _arg_spec(bias)), cfg)
  num_rows = len(arg_shapes) - len(lhs_leaves) - len(rhs_leaves) - 2 - int(has_bias)
  specs = (strategy.leaf_specs([s.shape for s in lhs_leaves], plan.spec("lhs"), mesh_shape)
           + strategy.leaf_specs([s.shape for s in rhs_leaves], plan.spec("rhs"), mesh_shape)
           + [P(None), P()] + ([plan.spec("bias")] if has_bias else [])
           + [P(None)] * num_rows)  # row operands: whole on every device
  return plan, specs


_NO_MESH = jax.sharding.AbstractMesh((), ())


def _partition(static, mesh, arg_shapes, result_shape):
  cfg, trees, has_bias, platform = static
  plan, specs = _choose(static, mesh, arg_shapes, _arg_spec(result_shape))
  registry.note_plan(dataclasses.replace(plan, notes=plan.notes + (
      "split by the partitioning rule (custom_partitioning under plain jit)",)))

  def lower_fn(operands):
    lhs, rhs, counts, group_offset, bias = unpack(operands, trees, has_bias)
    rows = row_operands(operands, trees, has_bias, cfg)
    # Traced per device with every mesh axis manual: a context mesh of the user's
    # (`jax.set_mesh`) must not make its arrays sharding-typed.
    with jax.sharding.use_abstract_mesh(_NO_MESH):
      return strategy.local_gmm(_bound_on(platform), plan, lhs, rhs, counts, group_offset,
                                bias, cfg, rows)

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
  num_rows = len(shapes) - trees[0].num_leaves - trees[1].num_leaves - 2 - int(has_bias)
  lhs_shapes, rhs_shapes, _ = _leaf_groups(shapes[:len(shapes) - num_rows], trees, has_bias)
  if cfg.has_rows:
    # The row operands ([R]) are the grouped rows m; lhs's own rows (gathered from) and a
    # scattered output's rows are other sizes: their own factors.
    dims = dict(dims, lhs=tuple("l" + d if d == "m" else d for d in dims["lhs"]),
                out=tuple("o" + d if d == "m" and cfg.out_rows is not None else d
                          for d in dims["out"]))
  # A gated prologue's lhs holds 2K columns and a gated-cotangent epilogue's output 2N:
  # factors of their own, whole (with the K or N they pair), like the source z ([M, 2K] or
  # [M, 2N]) a tangent or cotangent gmm reads.
  whole = ["h"]
  if cfg.lhs_activation is not None:
    dims = dict(dims, lhs=tuple("kz" if d == "k" else d for d in dims["lhs"]))
    whole += ["k", "kz"]
  if cfg.cotangent_of is not None:
    dims = dict(dims, out=tuple("nz" if d == "n" else d for d in dims["out"]))
    whole += ["n", "nz"]
  extra = iter(f"s{i}" for i in range(64))
  mappings = []
  for operand, leaves in (("lhs", lhs_shapes), ("rhs", rhs_shapes)):
    for shape in leaves:
      mappings.append(" ".join(
          name if size == full else next(extra)
          for name, size, full in zip(dims[operand], shape, leaves[0])))
  rows = ["m"] * (num_rows - int(cfg.has_source))
  if cfg.has_source:
    rows.append("m zc")
    whole.append("zc")
  mappings += ["h", ""] + (["g n"] if has_bias else []) + rows
  rule = ", ".join(mappings) + " -> " + " ".join(dims["out"])
  reductions = ("g", "k") if cfg.group_type == "m" else ("k",)
  order = []
  for token in rule.replace(",", " ").split():
    if token not in order and token != "->":
      order.append(token)
  return rule, dict(
      reduction_factors=tuple(f for f in order if f in reductions and f not in whole),
      need_replication_factors=tuple(f for f in order if f in whole))


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


def _partitioned_by_xla(ctx) -> bool:
  """A program for several devices that XLA's partitioner splits (not a manual context:
  inside a shard_map every device's blocks are already local)."""
  context = ctx.module_context.axis_context
  return (type(context).__name__ == "ShardingContext"
          and getattr(context, "num_devices", 1) > 1)


@dataclasses.dataclass(frozen=True)
class Fallback:
  """What a gmm that nothing could split before XLA runs as (`explain` reports it)."""

  implementation: str
  why: str

  def describe(self) -> str:
    return f"not split by gmm_jax ({self.why}); runs as {self.implementation!r}"


FALLBACK = Fallback(
    "reference",
    "plain jit on several TPU chips with no mesh in the trace: the dense reference, a "
    "batched dot over the groups that XLA's partitioner splits, G times the work "
    "of the kernels; give the trace the mesh with jax.set_mesh and Explicit axes, the "
    "layout with gmm(..., sharding=GmmSharding(...)), or a layer its expert_parallel=")
FALLBACK_WARNED = []  # non-empty once the fallback's warning was given (once per process)


def _warn_fallback():
  if not FALLBACK_WARNED:
    FALLBACK_WARNED.append(True)
    warnings.warn(f"gmm_jax: {FALLBACK.why}", stacklevel=2)


def _lowering(ctx, *operands, platform, **params):
  # The implementation is traced on plain types: inside ``jax.shard_map(check_vma=True)``
  # jax would otherwise ask each Pallas call of it to type its output's varying axes, which
  # the plain operands do not have (the primitive's own abstract evaluation types the
  # result).
  # Its slicing and while loops are traced on plain types too: mesh-typed or varying avals
  # would make them sharding-typed. The plain context is a copy: the effect tokens its
  # lowering produces (a simulated kernel's) go back to jax's.
  plain = ctx.replace(avals_in=[jax.core.ShapedArray(a.shape, a.dtype) for a in ctx.avals_in],
                      avals_out=[jax.core.ShapedArray(a.shape, a.dtype)
                                 for a in ctx.avals_out])
  with jax_private.vma_check_off():
    out = _lower(plain, *operands, platform=platform, **params)
  if plain.tokens_out is not None:
    ctx.set_tokens_out(plain.tokens_out)
  return out


def _lower(ctx, *operands, platform, **params):
  params.pop("out_hint")
  if params["cfg"].platform is not None:
    platform = params["cfg"].platform
  elif platform is None:
    platform = registry.normalize_platform(ctx.module_context.platforms[0])
  if platform == "cpu":  # XLA:CPU's kernels each hold memory maps while jax caches them
    host_limits.note_cpu_lowering()
  if platform == "tpu" and _partitioned_by_xla(ctx):
    # No partitioner may split a kernel on TPU (`custom_partitioning` does not run there):
    # the dense reference, a batched dot over the groups that XLA splits like any other.
    _warn_fallback()
    registry.note_plan(FALLBACK)
    params = dict(params, cfg=params["cfg"].replace(implementation=(FALLBACK.implementation,)))
  elif _needs_partitioning(ctx):
    static = (params["cfg"], params["trees"], params["has_bias"], platform)
    return mlir.lower_fun(lambda *xs: _partitioned(static, xs),
                          multiple_results=False)(ctx, *operands)
  return mlir.lower_fun(functools.partial(_implementation, platform=platform, **params),
                        multiple_results=False)(ctx, *operands)


for _prim in PRIMITIVES:
  mlir.register_lowering(_prim, functools.partial(_lowering, platform=None))
  for _jax_platform, _platform in registry.JAX_PLATFORMS:
    mlir.register_lowering(_prim, functools.partial(_lowering, platform=_platform),
                           platform=_jax_platform)

