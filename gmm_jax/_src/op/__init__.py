"""The differentiable gmm op: one JAX primitive with jvp, transpose, batching and lowering
rules, like `jax.lax.ragged_dot_general_p`.

Floor 2. The package is split by concern: `primitive` (definition, binding, abstract
evaluation), `lowering` (the implementation per platform and the partitioning rule), `jvp`,
`transpose` and `batching` (the rules, registered on import), and `prologue_tangent` (the
tangent of a gmm with a gated prologue along both operands, as one linear primitive whose
transpose orders the two backward gmms). The op's two small primitives have a module each:
`gated_tangent` (a gated activation's tangent as one op, transposed in one pass) and
`rows_sum` (the fixed-order sum of rows, the transpose of a row gather). Every derivative
is another gmm, so backends implement forwards only; every result that is not finished inside a
kernel is finished by `epilogue.finish`.

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


from gmm_jax._src.op import (batching, jvp, lowering, prologue_tangent,  # noqa: F401
                             transpose)  # (the rules)
from gmm_jax._src.op.lowering import PARTITIONABLE as PARTITIONABLE
from gmm_jax._src.op.primitive import PREACTIVATION as PREACTIVATION
from gmm_jax._src.op.primitive import PRIMITIVES as PRIMITIVES
from gmm_jax._src.op.primitive import gmm as gmm
