"""The tangent of a gmm with a gated prologue along its input and its weights at once, as one
linear primitive, so that one transpose rule orders the two products of its backward.

``y = gmm(z, w, lhs_activation=act)`` (y = act(z) @ w per group) has the tangent

    dy = gmm(t_z, w; lhs_tangent, source z) + gmm(z, t_w; lhs_activation)

whose transposes are the dlhs gmm writing z's ``[M, 2K]`` cotangent in its epilogue and the
weight gradient ``act(z)^T ct`` (act(z) formed again from z). As two gmms, two transpose
rules emit them separately and the compiler picks their order: XLA:TPU schedules the
weight gradient last, so the saved z lives to the end of the backward beside dz. Here the
two terms are one primitive; its transpose emits the weight gradient first and the dlhs
gmm after it (its cotangent operand tied to the weight gradient by an optimization
barrier), so z's last reader is the dlhs gmm. Everything else (evaluation, lowering,
batching, the jvp and second-order transposes) is the sum of the two gmms.

Floor 2 (the op package).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

from gmm_jax._src.core import jax_private
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.core.epilogue import Rows
from gmm_jax._src.op import transpose
from gmm_jax._src.op.primitive import (abstract_eval, current_primitive, effects, gmm,
                                       gmm_deviceless_p, gmm_p, row_operands, unpack)

prologue_tangent_p = Primitive("gmm_jax_prologue_tangent")


def prologue_tangent(t_lhs, t_rhs, lhs, rhs, counts, group_offset, cfg: GmmConfig,
                     out_hint=None, rows: Rows = Rows()):
  """``gmm(t_lhs, rhs; lhs_tangent, source lhs) + gmm(lhs, t_rhs; lhs_activation)`` for a
  float gmm with a gated prologue (`cfg.lhs_activation`, no bias: its tangent is a term of
  its own); `rows` are the gmm's row operands without the source."""
  term_cfg = cfg.replace(lhs_tangent=True)
  trees = (jax.tree.structure(t_lhs), jax.tree.structure(rhs))
  flat = [t_lhs, rhs, counts, group_offset]
  for present, value in ((cfg.gather_rows is not None, rows.lhs_indices),
                         (cfg.row_weights, rows.row_weights),
                         (cfg.out_rows is not None, rows.out_indices)):
    if present:
      flat.append(value)
  flat += [lhs, t_rhs]  # the source (z), then the weights' tangent
  return prologue_tangent_p.bind(*flat, cfg=term_cfg, trees=trees, out_hint=out_hint,
                                 deviceless=current_primitive() is gmm_deviceless_p)


def _terms(operands):
  """(the tangent gmm's operands, the weights' tangent)."""
  return list(operands[:-1]), operands[-1]


def _value(*operands, cfg, trees, out_hint, deviceless):
  primitive = gmm_deviceless_p if deviceless else gmm_p
  along_lhs, t_rhs = _terms(operands)
  _, _, counts, group_offset, _ = unpack(along_lhs, trees, False)
  rows = row_operands(along_lhs, trees, False, cfg)
  first = primitive.bind(*along_lhs, cfg=cfg, trees=trees, has_bias=False,
                         out_hint=out_hint)
  second = gmm(rows.source, t_rhs, counts, group_offset, None,
               cfg.replace(lhs_tangent=False), out_hint, rows._replace(source=None),
               primitive=primitive)
  return first + second


def _abstract(*avals, cfg, trees, out_hint, deviceless):
  del deviceless
  return abstract_eval(*avals[:-1], cfg=cfg, trees=trees, has_bias=False, out_hint=out_hint)


def _jvp(primals, tangents, **params):
  return jax.jvp(functools.partial(_value, **params), tuple(primals),
                 tuple(ad.instantiate_zeros(t) for t in tangents))


def _transpose_rule(ct, *operands, cfg, trees, out_hint, deviceless):
  along_lhs, t_rhs = _terms(operands)
  t_lhs = along_lhs[0]
  fixed = along_lhs[1:]
  if any(ad.is_undefined_primal(x) for x in fixed):
    # Linear in its tangents only; a transpose along z or w (a second derivative) goes
    # through the two gmms' own rules.
    return transpose.linear_transpose_of(
        functools.partial(_value, cfg=cfg, trees=trees, out_hint=out_hint,
                          deviceless=deviceless), ct, operands)
  results = [None] * len(operands)
  if type(ct) is ad.Zero:
    return results
  _, _, counts, group_offset, _ = unpack(along_lhs, trees, False)
  rows = row_operands(along_lhs, trees, False, cfg)
  ct_along_lhs = ct
  if ad.is_undefined_primal(t_rhs):
    # The weight gradient first (it reads act(z) and the cotangent rows)...
    weights_cfg = cfg.replace(lhs_tangent=False)
    weights_operands = [rows.source, t_rhs, counts, group_offset] + [
        x for x in rows._replace(source=None) if x is not None]
    ct_rhs = transpose.gmm_transpose(ct, *weights_operands, cfg=weights_cfg, trees=trees,
                                     has_bias=False, out_hint=out_hint)[1]
    results[-1] = ct_rhs
    # ... then the dlhs gmm, z's last reader.
    ct_along_lhs = after_on_tpu(ct, ct_rhs)
  if ad.is_undefined_primal(t_lhs):
    results[0] = transpose.gmm_transpose(ct_along_lhs, *along_lhs, cfg=cfg, trees=trees,
                                         has_bias=False, out_hint=out_hint)[0]
  return results


# ------------------------------------------------------------- the order, on TPU only
#
# `after_on_tpu(x, y)` is x; lowered for a TPU it is available only once y exists (an
# optimization barrier), elsewhere it is x alone. Measured on the bf16 MoE training step
# with the gated prologue (`bench_moe --blocks moe_prologue --deviceless`): ordered, the
# v5e step's temporaries are 90 MB (274 MB with the two gmms in XLA:TPU's order), while
# the H200's grow 102 -> 134 MB (XLA:GPU orders them better on its own).

after_on_tpu_p = Primitive("gmm_jax_after_on_tpu")


def after_on_tpu(x, y):
  """x, computed after y on a TPU (see above)."""
  return after_on_tpu_p.bind(x, y)


def _after_batch(operands, dims):
  return after_on_tpu(*operands), dims[0]


def _after_jvp(primals, tangents):
  x, y = primals
  t_x = tangents[0]
  return after_on_tpu(x, y), (t_x if type(t_x) is ad.Zero else after_on_tpu(t_x, y))


def _after_transpose(ct, x, y):
  if ad.is_undefined_primal(y):
    raise ValueError("after_on_tpu is linear in its first operand only")
  return [ct, None]


after_on_tpu_p.def_impl(lambda x, y: x)
after_on_tpu_p.def_abstract_eval(lambda x, y: x)
ad.primitive_jvps[after_on_tpu_p] = _after_jvp
ad.primitive_transposes[after_on_tpu_p] = _after_transpose
batching.primitive_batchers[after_on_tpu_p] = _after_batch
mlir.register_lowering(after_on_tpu_p, lambda ctx, x, y: [x])
mlir.register_lowering(
    after_on_tpu_p,
    mlir.lower_fun(lambda x, y: lax.optimization_barrier((x, y))[0], multiple_results=False),
    platform="tpu")


def _batch(operands, dims, **params):
  in_axes = [None if d is batching.not_mapped else d for d in dims]
  return jax.vmap(functools.partial(_value, **params), in_axes=in_axes)(*operands), 0


prologue_tangent_p.def_impl(_value)
prologue_tangent_p.def_effectful_abstract_eval(
    lambda *avals, **params: (_abstract(*avals, **params), effects(params["cfg"])))
ad.primitive_jvps[prologue_tangent_p] = _jvp
ad.primitive_transposes[prologue_tangent_p] = _transpose_rule
batching.primitive_batchers[prologue_tangent_p] = _batch
mlir.register_lowering(prologue_tangent_p, mlir.lower_fun(_value, multiple_results=False))
# Its gmms' lowering may partition them (see `lowering`): it needs the devices too.
jax_private.require_devices_during_lowering(prologue_tangent_p)
