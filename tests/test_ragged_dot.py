"""`gmm_jax.ragged_dot` and `gmm_jax.ragged_dot_general` as drop-ins for jax's: every
argument jax takes, the same results (jax's own function is the oracle here, itself a
masked dense product), gradients, and group_offset where jax has none."""

from __future__ import annotations

import inspect

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from oracle import f64, gmm_oracle, tolerances

from gmm_jax._src.core import jax_private

Numbers = jax.lax.RaggedDotDimensionNumbers
M, K, N, G = 12, 8, 5, 3
SIZES = [4, 0, 6]
# jax.lax.ragged_dot's dimension numbers (lhs [m, k], rhs [g, k, n]).
RAGGED_NUMBERS = Numbers(dot_dimension_numbers=(([1], [1]), ([], [])),
                         lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def _rand(shape, seed, dtype=jnp.float32):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape), dtype)


@pytest.mark.parametrize("name", ["ragged_dot", "ragged_dot_general"])
def test_takes_every_argument_of_jax(name):
  ours = inspect.signature(getattr(gmm_jax, name)).parameters
  theirs = inspect.signature(getattr(jax.lax, name)).parameters
  for position, (param, spec) in enumerate(theirs.items()):
    assert param in ours, param
    assert list(ours).index(param) == position, param  # positional calls match too
    assert ours[param].default == spec.default, param


JAX_HAS_REDUCTION_ORDER = "reduction_order" in inspect.signature(jax.lax.ragged_dot).parameters


def _orders():
  """jax's reduction orders, by name (the order classes are not exported by jax)."""
  ro = jax_private.resolve("reduction_order")
  return {"none": None, "unordered": "unordered", "scoped": ro.Unordered("experts"),
          "tiled-linear": ro.Tile(4, "unordered", "linear"),
          "cast": ro.Cast(jnp.float32, "unordered"), "linear": "linear",
          "unreduced": "unreduced", "invalid": "sideways"}


@pytest.mark.skipif(not JAX_HAS_REDUCTION_ORDER, reason="jax < 0.12.1 has no reduction_order")
@pytest.mark.parametrize("name", ["none", "unordered", "scoped", "tiled-linear", "cast",
                                  "linear", "unreduced", "invalid"])
@pytest.mark.parametrize("fn", ["ragged_dot", "ragged_dot_general"])
def test_reduction_order_as_jax(fn, name):
  """Free orders run on gmm and ordered ones are jax's own: the same values, and the same
  errors where jax has none ("linear": no XLA lowering; "unreduced"; an invalid name)."""
  order = _orders()[name]
  lhs, rhs = _rand((M, K), 5), _rand((G, K, N), 6)
  sizes = jnp.asarray(SIZES, jnp.int32)
  numbers = (RAGGED_NUMBERS,) if fn == "ragged_dot_general" else ()

  def call(module):
    return jax.jit(lambda *a: getattr(module, fn)(*a, *numbers, reduction_order=order))(
        lhs, rhs, sizes)

  try:
    want = call(jax.lax)
  except (NotImplementedError, ValueError) as err:
    with pytest.raises(type(err)):
      call(gmm_jax)
    return
  np.testing.assert_allclose(f64(call(gmm_jax)), f64(want), **tolerances(jnp.float32, k=K))
  if name in ("none", "unordered", "scoped"):  # served by gmm: with group_offset too
    got = gmm_jax.ragged_dot(lhs, rhs[1:], sizes, group_offset=1, reduction_order=order)
    np.testing.assert_allclose(f64(got)[4:], f64(want)[4:], **tolerances(jnp.float32, k=K))
  else:
    with pytest.raises(NotImplementedError, match="group_offset"):
      gmm_jax.ragged_dot(lhs, rhs[1:], sizes, group_offset=1, reduction_order=order)


@pytest.mark.skipif(JAX_HAS_REDUCTION_ORDER, reason="this jax has reduction_order")
def test_reduction_order_on_a_jax_without_it():
  lhs, rhs = _rand((M, K), 5), _rand((G, K, N), 6)
  sizes = jnp.asarray(SIZES, jnp.int32)
  want = jax.lax.ragged_dot(lhs, rhs, sizes)
  for order in (None, "unordered"):
    np.testing.assert_allclose(gmm_jax.ragged_dot(lhs, rhs, sizes, reduction_order=order),
                               want, **tolerances(jnp.float32, k=K))
  with pytest.raises(NotImplementedError, match="0.12.1"):
    gmm_jax.ragged_dot(lhs, rhs, sizes, reduction_order="linear")


@pytest.mark.parametrize("dtype, preferred_element_type, precision", [
    (jnp.float32, None, None),
    (jnp.float32, jnp.float32, "highest"),
    (jnp.float32, None, jax.lax.Precision.HIGHEST),
    (jnp.bfloat16, None, ("default", "highest")),
    (jnp.bfloat16, jnp.float32, None),
    (jnp.bfloat16, None, "default"),
])
def test_ragged_dot_matches_jax(dtype, preferred_element_type, precision):
  lhs, rhs = _rand((M, K), 1, dtype), _rand((G, K, N), 2, dtype)
  sizes = jnp.asarray(SIZES, jnp.int32)
  got = gmm_jax.ragged_dot(lhs, rhs, sizes, precision, preferred_element_type)
  want = jax.lax.ragged_dot(lhs, rhs, sizes, precision, preferred_element_type)
  assert got.dtype == want.dtype and got.shape == want.shape
  np.testing.assert_allclose(f64(got), f64(want), **tolerances(dtype, got.dtype, k=K))


def test_ragged_dot_out_sharding():
  mesh = Mesh(np.array(jax.devices()[:4]), ("x",))
  lhs, rhs = _rand((M, K), 3), _rand((G, K, N), 4)
  sizes = jnp.asarray(SIZES, jnp.int32)
  sharding = NamedSharding(mesh, P("x", None))
  assert gmm_jax.ragged_dot(lhs, rhs, sizes, out_sharding=None).shape == (M, N)
  for fn in (gmm_jax.ragged_dot, jax.jit(gmm_jax.ragged_dot, static_argnames="out_sharding")):
    out = fn(lhs, rhs, sizes, out_sharding=sharding)
    assert out.sharding.is_equivalent_to(sharding, 2)
    np.testing.assert_allclose(out, jax.lax.ragged_dot(lhs, rhs, sizes),
                               **tolerances(jnp.float32, k=K))
  with jax.sharding.use_mesh(mesh) if hasattr(jax.sharding, "use_mesh") else mesh:
    out = jax.jit(lambda l, r, s: gmm_jax.ragged_dot(l, r, s, out_sharding=P("x")))(
        lhs, rhs, sizes)
  assert out.sharding.is_equivalent_to(sharding, 2)


def test_ragged_dot_group_offset_which_jax_lacks():
  lhs, rhs = _rand((M, K), 5), _rand((G, K, N), 6)
  sizes = jnp.asarray([4, 5, 3], jnp.int32)
  with pytest.raises((NotImplementedError, TypeError)):  # jax: not implemented
    jax.lax.ragged_dot(lhs, rhs[1:], sizes, group_offset=jnp.int32(1))
  got = gmm_jax.ragged_dot(lhs, rhs[1:], sizes, group_offset=jnp.int32(1))
  np.testing.assert_allclose(f64(got), gmm_oracle(lhs, rhs[1:], [4, 5, 3], "m", group_offset=1),
                             **tolerances(jnp.float32, k=K))


# ------------------------------------------------------------------------ ragged_dot_general

# (lhs shape, rhs shape, group_sizes shape, dimension numbers)
GENERAL_CASES = {
    "basic": ((M, K), (G, K, N), (G,), Numbers((([1], [1]), ([], [])), [0], [0])),
    "rhs_transposed": ((M, K), (G, N, K), (G,), Numbers((([1], [2]), ([], [])), [0], [0])),
    "group_dim_last": ((M, K), (K, N, G), (G,), Numbers((([1], [0]), ([], [])), [0], [2])),
    "batch": ((2, M, K), (2, G, K, N), (2, G),
              Numbers((([2], [2]), ([0], [0])), [1], [1])),
    "batch_shared_sizes": ((2, M, K), (G, 2, K, N), (G,),
                           Numbers((([2], [2]), ([0], [1])), [1], [0])),
    "inner_free_dim": ((M, 3, K), (G, K, N), (G,), Numbers((([2], [1]), ([], [])), [0], [0])),
    "outer_free_dim": ((2, M, K), (G, K, N), (2, G), Numbers((([2], [1]), ([], [])), [1], [0])),
    "two_contracting": ((M, 2, K), (G, 2, K, N), (G,),
                        Numbers((([1, 2], [1, 2]), ([], [])), [0], [0])),
    "contracting": ((M, K), (K, N), (G,), Numbers((([1], [0]), ([], [])), [1], [])),
    "contracting_batch": ((2, M, K), (2, K, N), (2, G),
                          Numbers((([2], [1]), ([0], [0])), [2], [])),
    "contracting_outer": ((M, 2, K), (2, K, N), (2, G),
                          Numbers((([1, 2], [0, 1]), ([], [])), [2], [])),
    "contracting_transposed": ((K, M), (N, K), (G,), Numbers((([0], [1]), ([], [])), [0], [])),
    "batch_ragged": ((4, M, K), (4, K, N), (G,), Numbers((([2], [1]), ([0], [0])), [0], [])),
}


def _sizes(shape, ragged_size, seed):
  """Random group sizes of `shape` whose rows sum to at most `ragged_size`."""
  rng = np.random.default_rng(seed)
  sizes = rng.integers(0, ragged_size // shape[-1] + 2, size=shape)
  sizes[..., 1] = 0  # an empty group
  return np.minimum(sizes, ragged_size // shape[-1]).astype(np.int32)


@pytest.mark.parametrize("case", list(GENERAL_CASES))
def test_ragged_dot_general_matches_jax(case):
  lhs_shape, rhs_shape, sizes_shape, numbers = GENERAL_CASES[case]
  lhs, rhs = _rand(lhs_shape, 7), _rand(rhs_shape, 8)
  ragged = numbers.lhs_ragged_dimensions[0]
  sizes = jnp.asarray(_sizes(sizes_shape, lhs_shape[ragged], 9))
  got = gmm_jax.ragged_dot_general(lhs, rhs, sizes, numbers)
  want = jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers)
  assert got.shape == want.shape and got.dtype == want.dtype
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  got_jit = jax.jit(gmm_jax.ragged_dot_general, static_argnums=3)(lhs, rhs, sizes, numbers)
  np.testing.assert_allclose(got_jit, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["basic", "batch", "inner_free_dim", "contracting",
                                  "contracting_outer"])
def test_ragged_dot_general_derivatives_match_jax(case):
  # Forward mode against jax's jvp; reverse mode against jax's jvp through the transpose
  # identity <ct, J t> = <J^T ct, t> (jax has no reverse mode for a ragged contracting
  # dimension).
  lhs_shape, rhs_shape, sizes_shape, numbers = GENERAL_CASES[case]
  lhs, rhs = _rand(lhs_shape, 10), _rand(rhs_shape, 11)
  tangents = (_rand(lhs_shape, 12), _rand(rhs_shape, 13))
  sizes = jnp.asarray(_sizes(sizes_shape, lhs_shape[numbers.lhs_ragged_dimensions[0]], 14))
  ours = lambda l, r: gmm_jax.ragged_dot_general(l, r, sizes, numbers)  # noqa: E731
  theirs = lambda l, r: jax.lax.ragged_dot_general(l, r, sizes, numbers)  # noqa: E731
  out, jvp = jax.jvp(ours, (lhs, rhs), tangents)
  _, want_jvp = jax.jvp(theirs, (lhs, rhs), tangents)
  np.testing.assert_allclose(jvp, want_jvp, rtol=1e-5, atol=1e-5)
  ct = _rand(out.shape, 15)
  _, vjp = jax.vjp(ours, lhs, rhs)
  pulled = vjp(ct)
  np.testing.assert_allclose(sum(jnp.vdot(p, t) for p, t in zip(pulled, tangents)),
                             jnp.vdot(ct, want_jvp), rtol=1e-4)


def test_ragged_dot_general_group_offset():
  lhs, rhs = _rand((M, K), 13), _rand((2, N, K), 14)
  numbers = GENERAL_CASES["rhs_transposed"][3]
  got = gmm_jax.ragged_dot_general(lhs, rhs, jnp.asarray([4, 5, 3]), numbers,
                                   group_offset=jnp.int32(1))
  want = gmm_oracle(lhs, rhs, [4, 5, 3], "m", transpose_rhs=True, group_offset=1)
  np.testing.assert_allclose(f64(got), want, **tolerances(jnp.float32, k=K))
  with pytest.raises(NotImplementedError, match="group_offset"):
    gmm_jax.ragged_dot_general(lhs, rhs[0].T, jnp.asarray([4, 5]),
                               GENERAL_CASES["contracting"][3], group_offset=1)


@pytest.mark.parametrize("lhs_shape, rhs_shape, sizes_shape, numbers, match", [
    ((M, K), (G, K, N), (G,), Numbers((([1], [1]), ([], [])), [0, 1], [0]),
     "exactly one lhs ragged dimension"),
    ((M, K), (G, K, N), (G,), Numbers((([1], [1]), ([], [])), [0], []),
     "exactly one rhs group dimension"),
    ((M, K), (K, N), (G,), Numbers((([1], [0]), ([], [])), [1], [0]),
     "zero group dimensions in the rhs"),
    ((M, K), (G, K + 1, N), (G,), Numbers((([1], [1]), ([], [])), [0], [0]),
     r"contracting dimensions to have the same shape, got \(8,\) and \(9,\)"),
    ((2, M, K), (2, G, K, N), (3, G), Numbers((([2], [2]), ([0], [0])), [1], [1]),
     r"group_sizes to have shape \(2, 3\), got \(3, 3\)"),
    ((M, K), (G, K, N), (G + 1,), Numbers((([1], [1]), ([], [])), [0], [0]),
     "rhs group dimension size to be 4, got 3"),
])
def test_ragged_dot_general_errors(lhs_shape, rhs_shape, sizes_shape, numbers, match):
  # jax's own rule's message, then the shapes; a ValueError as before (and a TypeError as
  # jax raises: tests/test_ragged_dot_parity.py).
  with pytest.raises(ValueError, match=match) as error:
    gmm_jax.ragged_dot_general(jnp.ones(lhs_shape), jnp.ones(rhs_shape),
                               jnp.ones(sizes_shape, jnp.int32), numbers)
  shapes = [",".join(map(str, shape)) for shape in (lhs_shape, rhs_shape)]
  assert f"lhs float32[{shapes[0]}], rhs float32[{shapes[1]}]" in str(error.value)
