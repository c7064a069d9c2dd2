"""The gated activation's derivative as one op (`op.gated_tangent`): its tangent and
cotangent against float64 numpy (central differences of `oracle.GATED`), bitwise against
jax's own derivatives of the jnp activation (what the op differentiated before), and a gmm
with a gated activation differentiated in every mode (reverse, forward, second order,
vmap) against the same composition and against float64 numpy."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.test_util import check_grads

import gmm_jax
import oracle
from gmm_jax._src.core import epilogue
from gmm_jax._src.op import gated_tangent

GATED = ["swiglu", "geglu", "geglu_tanh", "swiglu_clamped"]
RNG = np.random.default_rng(11)


def _normal(shape, dtype, scale=1.5):
  return jnp.asarray(RNG.normal(size=shape) * scale, jnp.float32).astype(dtype)


def _jnp_gated(name):
  """The composition the op differentiated before: the jnp activation on the widened z."""
  fn = epilogue.GATED_ACTIVATIONS[name]
  return lambda z: fn(z.astype(jnp.float32))


def _np_jacobian_product(name, z, dz, eps=1e-6):
  """float64 central difference of `oracle.GATED[name]` at z along dz."""
  z, dz = oracle.f64(z), oracle.f64(dz)
  fn = oracle.GATED[name]
  return (fn(z + eps * dz) - fn(z - eps * dz)) / (2 * eps)


@pytest.mark.parametrize("name", GATED)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tangent_and_cotangent_equal_jax_derivatives_and_numpy(name, dtype):
  # Both compiled (XLA may contract products into FMAs alike).
  z, dz = _normal((6, 16), dtype), _normal((6, 16), dtype)
  ct = _normal((6, 8), jnp.float32)
  tangent = jax.jit(lambda z, dz: gated_tangent.gated_tangent(name, z, dz))(z, dz)
  expected = jax.jit(lambda z, dz: jax.jvp(_jnp_gated(name), (z,), (dz,))[1])(z, dz)
  assert tangent.dtype == jnp.float32
  np.testing.assert_array_equal(np.asarray(tangent), np.asarray(expected))
  np.testing.assert_allclose(np.asarray(tangent), _np_jacobian_product(name, z, dz),
                             rtol=1e-5, atol=1e-5)
  # Transposed (the backward): the cotangent of z, in z's dtype, equals jax's vjp of the
  # composition (a value: a -0.0 may come back +0.0) and numpy's <ct, J dz> = <J^T ct, dz>.
  cotangent = jax.jit(lambda ct: jax.linear_transpose(
      lambda t: gated_tangent.gated_tangent(name, z, t), dz)(ct)[0])(ct)
  expected_ct = jax.jit(lambda ct: jax.vjp(_jnp_gated(name), z)[1](ct)[0])(ct)
  assert cotangent.dtype == dtype
  np.testing.assert_array_equal(np.asarray(cotangent, np.float32),
                                np.asarray(expected_ct, np.float32))
  basis = np.eye(16)[None].repeat(6, 0)  # column j of z along e_j
  jac = np.stack([_np_jacobian_product(name, z, basis[:, j]) for j in range(16)], -1)
  np.testing.assert_allclose(np.asarray(cotangent, np.float64),
                             np.einsum("rn,rnj->rj", oracle.f64(ct), jac),
                             rtol=2e-2 if dtype == jnp.bfloat16 else 1e-5, atol=2e-2 if
                             dtype == jnp.bfloat16 else 1e-5)


def test_tangent_batches_and_has_second_derivatives():
  z, dz = _normal((3, 4, 8), jnp.float32), _normal((3, 4, 8), jnp.float32)
  batched = jax.jit(jax.vmap(lambda a, b: gated_tangent.gated_tangent("swiglu", a, b),
                             (0, None)))(z, dz[0])
  expected = jax.jit(jax.vmap(lambda a: jax.jvp(_jnp_gated("swiglu"), (a,), (dz[0],))[1]))(z)
  np.testing.assert_array_equal(np.asarray(batched), np.asarray(expected))
  # d/dz of the tangent (a Hessian-vector product's ingredient) through the jnp form.
  f = lambda a: jnp.sum(gated_tangent.gated_tangent("geglu", a, dz[0]) ** 2)
  g = lambda a: jnp.sum(jax.jvp(_jnp_gated("geglu"), (a,), (dz[0],))[1] ** 2)
  np.testing.assert_allclose(np.asarray(jax.grad(f)(z[0])), np.asarray(jax.grad(g)(z[0])),
                             rtol=1e-6, atol=1e-6)


def test_rejects_mismatched_shapes():
  with pytest.raises(ValueError, match="one shape"):
    gated_tangent.gated_tangent("swiglu", jnp.zeros((2, 4)), jnp.zeros((2, 6)))


SIZES = np.array([5, 0, 9, 6], np.int32)


def _operands(dtype, m=20, k=24, n=32):
  return _normal((m, k), dtype, 1.0), _normal((4, k, n), dtype, 0.3)


# One case in the default run; the others (each a few compiles) with -m slow.
_GMM_CASES = [pytest.param(name, dtype, marks=() if (name, dtype) == ("swiglu", jnp.bfloat16)
                           else pytest.mark.slow)
              for name in GATED for dtype in (jnp.float32, jnp.bfloat16)]


@pytest.mark.parametrize("name,dtype", _GMM_CASES)
def test_gmm_gradients_equal_the_composition_and_numpy(name, dtype):
  """The gmm's gradients equal (bitwise) those of the same gmm without activation followed
  by the jnp activation (the rules before the gated tangent op), and float64 numpy."""
  lhs, rhs = _operands(dtype)
  sizes = jnp.asarray(SIZES)
  ct = _normal((20, 16), jnp.float32)

  def fused(x, w):
    return gmm_jax.gmm(x, w, sizes, activation=name)

  def composed(x, w):
    z = gmm_jax.gmm(x, w, sizes, preferred_element_type=dtype)
    valid = jnp.arange(20) < SIZES.sum()
    return jnp.where(valid[:, None], _jnp_gated(name)(z), 0).astype(dtype)

  vjp = lambda f: jax.jit(lambda x, w, c: (lambda out, pull: (out, *pull(c)))(  # noqa: E731
      *jax.vjp(f, x, w)))
  got_out, got_lhs, got_rhs = vjp(fused)(lhs, rhs, ct.astype(dtype))
  for got, ref in zip((got_out, got_lhs, got_rhs), vjp(composed)(lhs, rhs, ct.astype(dtype))):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))
  # float64 numpy: z per group, dz = J^T ct by central differences, dlhs = dz rhs^T.
  x64, w64, ct64 = oracle.f64(lhs), oracle.f64(rhs), oracle.f64(ct.astype(dtype))
  dlhs, drhs = np.zeros_like(x64), np.zeros_like(w64)
  start = 0
  for g, size in enumerate(SIZES):
    rows = slice(start, start + size)
    start += size
    z = x64[rows] @ w64[g]
    dz = np.stack([(oracle.GATED[name](z + 1e-6 * e) - oracle.GATED[name](z - 1e-6 * e))
                   / 2e-6 for e in np.eye(32)], -1)
    dz = np.einsum("rn,rnj->rj", ct64[rows], dz)
    dlhs[rows], drhs[g] = dz @ w64[g].T, x64[rows].T @ dz
  tol = dict(rtol=5e-2, atol=5e-2) if dtype == jnp.bfloat16 else dict(rtol=1e-4, atol=1e-4)
  np.testing.assert_allclose(np.asarray(got_lhs, np.float64), dlhs, **tol)
  np.testing.assert_allclose(np.asarray(got_rhs, np.float64), drhs, **tol)


def test_gmm_with_rows_gradients_equal_the_composition():
  """The fused MoE form: gathered rows and a gated activation, bf16."""
  lhs, rhs = _operands(jnp.bfloat16, m=12)
  sizes = jnp.asarray(SIZES)
  indices = jnp.asarray(RNG.integers(0, 12, size=20), jnp.int32)
  ct = _normal((20, 16), jnp.bfloat16)

  def fused(x, w):
    return gmm_jax.gmm(x, w, sizes, lhs_indices=indices, activation="swiglu")

  def composed(x, w):
    z = gmm_jax.gmm(x, w, sizes, lhs_indices=indices, preferred_element_type=jnp.bfloat16)
    return _jnp_gated("swiglu")(z).astype(jnp.bfloat16)

  vjp = lambda f: jax.jit(lambda x, w, c: jax.vjp(f, x, w)[1](c))  # noqa: E731
  for got, ref in zip(vjp(fused)(lhs, rhs, ct), vjp(composed)(lhs, rhs, ct)):
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(ref, np.float32))


@pytest.mark.slow
def test_gmm_forward_mode_second_order_and_vmap():
  lhs, rhs = _operands(jnp.float32, m=20, k=6, n=8)
  sizes = jnp.asarray(SIZES)
  f = lambda x, w: gmm_jax.gmm(x, w, sizes, activation="swiglu")
  check_grads(f, (lhs, rhs), order=2, modes=("fwd", "rev"), atol=2e-2,
                            rtol=2e-2, eps=1e-3)
  loss = lambda x, w: jnp.sum(f(x, w) ** 2)
  per_batch = jax.vmap(jax.grad(loss), (0, None))(jnp.stack([lhs, 2 * lhs]), rhs)
  np.testing.assert_allclose(np.asarray(per_batch[1]), np.asarray(jax.grad(loss)(2 * lhs, rhs)),
                             rtol=1e-6, atol=1e-6)
