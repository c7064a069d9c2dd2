"""The tangent of a gated activation as one primitive, so that its transpose (the backward of
the gated activation) is one elementwise pass; and the differentiable gated activation and
gated-prologue input built on it.

``dz [..., 2N] = concat(gate half, up half)`` of the cotangent is computed from the
pre-activation z and the cotangent alone. Written as plain jnp, the tangent's transpose is
two half-width products padded into place and added, which XLA:TPU materializes: an f32
copy of z, the f32 cotangent and both f32 halves before the sum (measured, deviceless for
one TPU v5e, on a bf16 MoE training step with R=8192, 2N=4096: 358 MB of temporaries
before, 157 MB with this op; `bench_moe --deviceless`). The values are those of jax's own
derivatives of the same activation (`jax.jvp` / `jax.vjp` of `epilogue.gated_pair` on the
widened halves): the arithmetic is the epilogue's (`epilogue.gated_tangent_f32`,
`epilogue.gated_cotangent`), this module adds the primitive and its rules.

Floor 2 (the op package): below it only the epilogue.
"""

from __future__ import annotations

import functools

import jax
import jax.extend
import jax.numpy as jnp
from jax.interpreters import ad, batching, mlir

from gmm_jax._src.core.epilogue import gated_cotangent, gated_halves_f32, gated_tangent_f32

gated_tangent_p = jax.extend.core.Primitive("gmm_jax_gated_tangent")


def gated_tangent(name: str, z: jax.Array, dz: jax.Array) -> jax.Array:
  """The tangent ``[..., N]`` of the gated activation `name` (of `GATED_ACTIVATIONS`),
  applied in f32 to a pre-activation z ``[..., 2N]`` (a 16-bit z widened), along dz (z's
  shape): ``jax.jvp(lambda z: GATED_ACTIVATIONS[name](widen(z)), (z,), (dz,))[1]``. Linear
  in dz; its transpose is `epilogue.gated_cotangent`."""
  if z.shape != dz.shape or z.shape[-1] % 2:
    raise ValueError(f"a gated tangent needs z and dz of one shape [..., 2N], got "
                     f"{z.shape} and {dz.shape}")
  return gated_tangent_p.bind(z, dz, name=name)


def _gated_tangent_impl(z, dz, *, name):
  return gated_tangent_f32(name, z, dz)


@functools.partial(jax.custom_jvp, nondiff_argnums=(0,))
def gated_f32(name: str, z: jax.Array) -> jax.Array:
  """`epilogue.gated_halves_f32` whose derivative is `gated_tangent` (one op, transposed in
  one pass)."""
  return gated_halves_f32(name, z)


@gated_f32.defjvp
def _gated_f32_jvp(name, primals, tangents):
  (z,), (dz,) = primals, tangents
  return gated_halves_f32(name, z), gated_tangent(name, z, dz.astype(z.dtype))


def gated_input(name: str, lhs: jax.Array, source: jax.Array | None = None) -> jax.Array:
  """What a gated prologue's product reads (`GmmConfig.lhs_activation`), in lhs's dtype:
  ``act(lhs)`` ``[..., K]`` for a pre-activation lhs ``[..., 2K]``, or, given the
  pre-activation `source` z, the activation's tangent along lhs ``gated_tangent(z, lhs)``
  (`GmmConfig.lhs_tangent`). Both in f32, rounded once. Its values, in plain jnp, are
  `epilogue.prologue_input`'s."""
  if source is None:
    return gated_f32(name, lhs).astype(lhs.dtype)
  return gated_tangent(name, source, lhs).astype(lhs.dtype)


def _gated_tangent_abstract(z, dz, *, name):
  del name
  dtype = jnp.float32 if jnp.dtype(z.dtype).itemsize < 4 else z.dtype
  return jax.core.ShapedArray(z.shape[:-1] + (z.shape[-1] // 2,), dtype)


def _gated_tangent_jvp(primals, tangents, *, name):
  z, dz = primals
  t_z, t_dz = tangents
  out = gated_tangent(name, z, dz)
  terms = []
  if type(t_dz) is not ad.Zero:
    terms.append(gated_tangent(name, z, t_dz))
  if type(t_z) is not ad.Zero:  # second derivatives: through the jnp form
    terms.append(jax.jvp(lambda z_: _gated_tangent_impl(z_, dz, name=name), (z,),
                         (t_z,))[1])
  if not terms:
    return out, ad.Zero(jax.typeof(out).to_tangent_aval())
  return out, functools.reduce(jnp.add, terms)


def _gated_tangent_transpose(ct, z, dz, *, name):
  if ad.is_undefined_primal(z):
    raise ValueError("a gated tangent is linear in its tangent only, not in z")
  if type(ct) is ad.Zero:
    return [None, None]
  return [None, gated_cotangent(name, z, ct, dz.aval.dtype)]


def _gated_tangent_batch(args, dims, *, name):
  z, dz = args
  size = next(x.shape[d] for x, d in zip(args, dims) if d is not None)
  moved = [jnp.broadcast_to(x, (size,) + x.shape) if d is None else jnp.moveaxis(x, d, 0)
           for x, d in zip(args, dims)]
  return gated_tangent(name, *moved), 0


gated_tangent_p.def_impl(functools.partial(jax.jit, static_argnames=("name",))(
    _gated_tangent_impl))
gated_tangent_p.def_abstract_eval(_gated_tangent_abstract)
mlir.register_lowering(gated_tangent_p, mlir.lower_fun(_gated_tangent_impl,
                                                       multiple_results=False))
ad.primitive_jvps[gated_tangent_p] = _gated_tangent_jvp
ad.primitive_transposes[gated_tangent_p] = _gated_tangent_transpose
batching.primitive_batchers[gated_tangent_p] = _gated_tangent_batch
