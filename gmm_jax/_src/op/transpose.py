"""The transpose of the (linear) gmm primitive: every cotangent is another gmm in the
family {m-grouped, k-grouped} x transposes, so backends implement forwards only.

Floor 2 (the op package).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.interpreters import ad
from jax.sharding import PartitionSpec as P

from gmm_jax._src.core import metadata
from gmm_jax._src.tiling import tuning
from gmm_jax._src.core.config import GmmConfig
from gmm_jax._src.core.epilogue import Rows, gather_rows
from gmm_jax._src.op.gated_tangent import gated_input
from gmm_jax._src.op.rows_sum import rows_sum
from gmm_jax._src.op.primitive import (PRIMITIVES, as_float, composed, gmm, grouped_rows,
                                       is_plain, row_operands, unpack)


def _is_zero(tangent) -> bool:
  return type(tangent) is ad.Zero


def _undefined(x) -> bool:
  return any(ad.is_undefined_primal(leaf)
             for leaf in jax.tree.leaves(x, is_leaf=ad.is_undefined_primal))


def _spec_hint(x):
  """The spec of an undefined primal's type on a mesh (Explicit axes), else None."""
  sharding = getattr(x.aval, "sharding", None)
  if sharding is None or sharding.mesh.empty or sharding.spec == P():
    return None
  return sharding.spec


def linear_transpose_of(fn, ct, operands):
  """The transpose of ``fn(*operands)`` (linear in its undefined operands) with respect to
  them, by `jax.linear_transpose` of fn with the defined operands fixed: derivative rules
  of the gmms that only second derivatives reach go through their jnp compositions."""
  undefined = [i for i, x in enumerate(operands) if ad.is_undefined_primal(x)]

  def linear(*values):
    full = list(operands)
    for i, value in zip(undefined, values):
      full[i] = value
    return fn(*full)

  avals = [jax.ShapeDtypeStruct(operands[i].aval.shape, operands[i].aval.dtype)
           for i in undefined]
  cts = jax.linear_transpose(linear, *avals)(ct)
  results = [None] * len(operands)
  for i, value in zip(undefined, cts):
    results[i] = value
  return results


def _transpose_composed(ct, operands, cfg, trees, has_bias, out_hint):
  """The transpose of a gmm with a source (`primitive.composed`: the plain gmm and the
  gated epilogue's jnp functions) with respect to its undefined operands."""
  return linear_transpose_of(
      functools.partial(composed, cfg=cfg, trees=trees, has_bias=has_bias,
                        out_hint=out_hint), ct, operands)


def _check_linear(operands, cfg, trees, has_bias):
  """The operands unpacked (lhs, rhs, counts, group_offset, bias) and the row operands,
  once gmm is known to be linear in the undefined ones (ValueError, NotImplementedError)."""
  if cfg.activation is not None:
    raise ValueError("a gmm with an activation is not linear; only its tangent gmms (which "
                     "carry no activation) are transposed")
  lhs, rhs, counts, group_offset, bias = unpack(operands, trees, has_bias)
  if ad.is_undefined_primal(counts) or ad.is_undefined_primal(group_offset):
    raise ValueError("gmm is not linear in its group sizes or group_offset")
  rows = row_operands(operands, trees, has_bias, cfg)
  if any(x is not None and ad.is_undefined_primal(x) for x in rows):
    raise NotImplementedError(
        "transposing gmm with respect to its row operands is not supported (the op "
        "differentiates row_weights in its jvp; indices are not differentiable)")
  return (lhs, rhs, counts, group_offset, bias), rows


def gmm_transpose(ct, *operands, cfg, trees, has_bias, out_hint):
  (lhs, rhs, counts, group_offset, bias), rows = _check_linear(operands, cfg, trees, has_bias)
  results = [None] * len(operands)
  if _is_zero(ct):
    return results
  if cfg.lhs_activation is not None and not cfg.lhs_tangent:
    if _undefined(lhs):
      raise ValueError("a gmm with a gated prologue (lhs_activation) is not linear in lhs; "
                       "only its tangent gmms are transposed")
    # Linear in rhs and the bias: the product of act(lhs).
    lhs = gated_input(cfg.lhs_activation, lhs)
    operands = (lhs,) + tuple(operands[1:])
    cfg = cfg.replace(lhs_activation=None)
  if cfg.cotangent_of is not None or (cfg.lhs_tangent and (
      not _undefined(lhs) or _undefined(rhs) or (bias is not None and _undefined(bias)))):
    # Transposes that only second derivatives reach: through the jnp composition.
    return _transpose_composed(ct, operands, cfg, trees, has_bias, out_hint)
  for name, x, tree in (("lhs", lhs, trees[0]), ("rhs", rhs, trees[1])):
    if _undefined(x) and not is_plain(tree):
      raise NotImplementedError(
          f"transposing gmm with respect to the components of a QArray {name} is not "
          "supported; transpose with respect to a float operand (or dequantize it first)")
  if cfg.group_type == "k" and cfg.has_rows:
    return _transpose_gathered_k(ct, operands, lhs, rows, cfg, trees, has_bias)
  # A fixed Tiling was chosen for the forward's shapes: the transposed gmms take their
  # `Tilings` entries (or the same callable), else the tuned/table/heuristic choice.
  tilings = (tuning.backward_tiling(cfg.tiling, "dlhs"),
             tuning.backward_tiling(cfg.tiling, "drhs"))
  if cfg.has_rows:
    cts = _transpose_rows(ct, lhs, rhs, counts, group_offset, bias, rows, cfg,
                          cfg.replace(tiling=None), *tilings)
  elif cfg.group_type == "m":
    cts = _transpose_m(ct, lhs, rhs, counts, group_offset, bias, cfg, tilings)
  else:
    cts = _transpose_k(ct, lhs, rhs, counts, group_offset, bias, cfg, tilings)
  for index, value, primal in zip(_cotangent_slots(trees), cts, (lhs, rhs, bias)):
    if value is not None:
      results[index] = _typed_like(value, primal)
  return results


def _cotangent_slots(trees) -> tuple[int, int, int]:
  """Where the cotangents of lhs, rhs and the bias go among the flat operands."""
  num_lhs, num_rhs = trees[0].num_leaves, trees[1].num_leaves
  return 0, num_lhs, num_lhs + num_rhs + 2


def _transpose_m(ct, lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, tilings):
  """(ct_lhs, ct_rhs, ct_bias) of an m-grouped gmm (None where the primal is defined):
  ``ct rhs^T`` (m-grouped), ``lhs^T ct`` (k-grouped) and the per-group sum of ct's rows."""
  base, (dlhs_tiling, drhs_tiling) = cfg.replace(tiling=None), tilings
  tl, tr = cfg.transpose_lhs, cfg.transpose_rhs
  ct_lhs = ct_rhs = ct_bias = None
  if ad.is_undefined_primal(lhs):
    ct_lhs = gmm(ct, rhs, counts, group_offset, None,
                 base.replace(transpose_lhs=False, transpose_rhs=not tr,
                              out_dtype=lhs.aval.dtype, tiling=dlhs_tiling))  # [M, K]
    ct_lhs = ct_lhs.T if tl else ct_lhs
  if ad.is_undefined_primal(rhs):
    k_cfg = base.replace(group_type="k", out_dtype=rhs.aval.dtype, tiling=drhs_tiling)
    hint = _spec_hint(rhs)  # the weight gradient is laid out like the weights
    if tr:  # [L, N, K] = ct_g^T lhs_g
      ct_rhs = gmm(ct, as_float(lhs), counts, group_offset, None,
                   k_cfg.replace(transpose_lhs=True, transpose_rhs=tl), hint)
    else:  # [L, K, N] = lhs_g^T ct_g
      ct_rhs = gmm(as_float(lhs), ct, counts, group_offset, None,
                   k_cfg.replace(transpose_lhs=not tl, transpose_rhs=False), hint)
  if bias is not None and ad.is_undefined_primal(bias):
    ids = metadata.row_group_ids(counts, ct.shape[0], group_offset, cfg.num_local)
    ids = jnp.where(ids >= 0, ids, cfg.num_local)  # rows of no local group are dropped
    ct_bias = jax.ops.segment_sum(ct.astype(jnp.float32), ids, cfg.num_local + 1)
    ct_bias = ct_bias[:cfg.num_local].astype(bias.aval.dtype)
  return ct_lhs, ct_rhs, ct_bias


def _transpose_k(ct, lhs, rhs, counts, group_offset, bias, cfg: GmmConfig, tilings):
  """(ct_lhs, ct_rhs, ct_bias) of a k-grouped gmm (None where the primal is defined): two
  m-grouped gmms of ct and the other operand, and ct summed over its rows."""
  m_cfg, (dlhs_tiling, drhs_tiling) = cfg.replace(tiling=None, group_type="m"), tilings
  tl, tr = cfg.transpose_lhs, cfg.transpose_rhs
  ct_lhs = ct_rhs = ct_bias = None
  if ad.is_undefined_primal(lhs):
    ct_lhs_t = gmm(as_float(rhs), ct, counts, group_offset, None,
                   m_cfg.replace(transpose_lhs=tr, transpose_rhs=True,
                                 out_dtype=lhs.aval.dtype, tiling=dlhs_tiling))  # [K, M]
    ct_lhs = ct_lhs_t if tl else ct_lhs_t.T
  if ad.is_undefined_primal(rhs):
    ct_rhs = gmm(as_float(lhs), ct, counts, group_offset, None,
                 m_cfg.replace(transpose_lhs=not tl, transpose_rhs=False,
                               out_dtype=rhs.aval.dtype, tiling=drhs_tiling))  # [K, N]
    ct_rhs = ct_rhs.T if tr else ct_rhs
  if bias is not None and ad.is_undefined_primal(bias):
    ct_bias = jnp.sum(ct.astype(jnp.float32), axis=1).astype(bias.aval.dtype)
  return ct_lhs, ct_rhs, ct_bias


def _typed_like(ct, x):
  """`ct` with the sharding type of the undefined primal x (Explicit mesh axes): a gmm
  types its result by its own plan (e.g. a weight gradient's rows sharded like the
  activations' columns), which a cotangent must not differ from."""
  sharding = getattr(x.aval, "sharding", None)
  if sharding is None or getattr(sharding, "mesh", None) is None or sharding.mesh.empty:
    return ct
  if jax.typeof(ct).sharding.spec == sharding.spec:
    return ct
  return jax.sharding.reshard(ct, sharding)


def _gathered_after(lhs, ct_rows):
  """`lhs` for a weight gradient that reads its rows by index, available only once the
  cotangent rows `ct_rows` exist.

  A kernel without a k-grouped gather (Triton's) gets a gathered copy of lhs ([R, K], made
  around it by the dispatcher). Left free, XLA forms that copy early (fused beside the
  first backward ops that read the routing) and keeps it through the whole backward; tied
  to the cotangent it is formed just before its gmm, short-lived enough to share memory
  with an output not yet written. Measured on the bf16 MoE training step, deviceless for
  one H200 (`bench_moe --deviceless h200`, T=4096 D=1024 F=2048 E=64 k=2): temporaries
  136 -> 119 MB (the unfused step's: 419 MB); TPU v5e unchanged.
  """
  return lax.optimization_barrier((lhs, ct_rows))


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
  results = gmm_transpose(ct, *plain, cfg=cfg.without_rows(), trees=trees,
                          has_bias=has_bias, out_hint=None)
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
  num_rows = grouped_rows(cfg, lhs)
  written = metadata.row_group_ids(counts, num_rows, group_offset, cfg.num_local) >= 0
  weights = rows.row_weights if cfg.row_weights else None
  scattered = cfg.out_rows is not None
  ct_lhs = ct_rhs = ct_bias = None
  if ad.is_undefined_primal(lhs):
    # A gated prologue's tangent (lhs_tangent): the dlhs gmm writes the [R, 2K] cotangent
    # of its source z in its epilogue.
    d_cfg = base.replace(transpose_lhs=False, transpose_rhs=not cfg.transpose_rhs,
                         out_dtype=lhs.aval.dtype, tiling=dlhs_tiling,
                         gather_rows=num_rows if scattered else None,
                         row_weights=weights is not None, out_rows=None,
                         lhs_activation=None, lhs_tangent=False,
                         cotangent_of=cfg.lhs_activation if cfg.lhs_tangent else None)
    d_rows = gmm(ct, rhs, counts, group_offset, None, d_cfg,
                 rows=Rows(rows.out_indices if scattered else None, weights, None,
                           rows.source if cfg.lhs_tangent else None))  # [R, K]
    if cfg.gather_rows is not None:
      indices = jnp.where(written, rows.lhs_indices, -1)
      ct_lhs = rows_sum(d_rows, indices, lhs.aval.shape[0])
    else:
      ct_lhs = d_rows.T if cfg.transpose_lhs else d_rows
  if ad.is_undefined_primal(rhs) or (bias is not None and ad.is_undefined_primal(bias)):
    ct_rows = gather_rows(ct, rows.out_indices) if scattered else ct  # [R, N]
    if weights is not None:
      ct_rows = (ct_rows.astype(jnp.float32)
                 * weights.astype(jnp.float32)[:, None]).astype(ct.dtype)
    if ad.is_undefined_primal(rhs):
      x_rows = as_float(lhs)
      if cfg.gather_rows is not None:
        x_rows, ct_rows = _gathered_after(x_rows, ct_rows)
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
  ad.primitive_transposes[_prim] = gmm_transpose

