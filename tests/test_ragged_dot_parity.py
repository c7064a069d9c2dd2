"""`gmm_jax.ragged_dot` / `ragged_dot_general` behave as jax.lax's where it is observable
beyond values: the exception jax raises for a malformed input (a TypeError; ours is
`GmmShapeError`, also a ValueError), 64-bit mode with strict dtype promotion, and
`jax.export` with symbolic dimensions. jax.lax itself is the oracle throughout."""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax import GmmShapeError
from jax import export

Numbers = jax.lax.RaggedDotDimensionNumbers
NC = Numbers((([1], [1]), ([], [])), [0], [0])  # jax.lax.ragged_dot's numbers
CONTRACTING = Numbers((([1], [0]), ([], [])), [1], [])
BATCH = Numbers((([2], [1]), ([0], [0])), [0], [])


def _rand(shape, seed):
  return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------- the same errors

# (lhs shape, rhs shape, group_sizes shape, group_sizes dtype, dimension numbers,
#  preferred_element_type, operand dtype): inputs jax.lax.ragged_dot_general rejects.
BAD_GENERAL = {
    "two_ragged_dims": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1]), ([], [])), [0, 1], [0]), None, "float32"),
    "no_ragged_dim": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1]), ([], [])), [], [0]), None, "float32"),
    "ragged_dim_past_rank": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1]), ([], [])), [2], [0]), None, "float32"),
    "ragged_dim_negative": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1]), ([], [])), [-1], [0]), None, "float32"),
    "scalar_group_sizes": ((6, 4), (3, 4, 5), (), "int32", NC, None, "float32"),
    "float_group_sizes": ((6, 4), (3, 4, 5), (3,), "float32", NC, None, "float32"),
    "bool_group_sizes": ((6, 4), (3, 4, 5), (3,), "bool", NC, None, "float32"),
    "group_count_differs": ((6, 4), (3, 4, 5), (4,), "int32", NC, None, "float32"),
    "k_differs": ((6, 4), (3, 5, 5), (3,), "int32", NC, None, "float32"),
    "no_rhs_group_dim": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1]), ([], [])), [0], []), None, "float32"),
    "two_rhs_group_dims": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1]), ([], [])), [0], [0, 2]), None, "float32"),
    "rhs_group_dim_past_rank": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1]), ([], [])), [0], [3]), None, "float32"),
    "rhs_group_dim_contracts": ((6, 4), (4, 4, 5), (4,), "int32", Numbers((([1], [1]), ([], [])), [0], [1]), None, "float32"),
    "rhs_group_dim_is_batch": ((2, 6, 4), (2, 4, 5), (2,), "int32", Numbers((([2], [1]), ([0], [0])), [1], [0]), None, "float32"),
    "nc_batched_sizes_wrong_prefix": ((2, 6, 4), (2, 3, 4, 5), (3, 3), "int32", Numbers((([2], [2]), ([0], [0])), [1], [1]), None, "float32"),
    "nc_sizes_rank_3": ((2, 6, 4), (2, 3, 4, 5), (2, 1, 3), "int32", Numbers((([2], [2]), ([0], [0])), [1], [1]), None, "float32"),
    "nc_outer_free_dim_prefix": ((2, 6, 4), (3, 4, 5), (3, 3), "int32", Numbers((([2], [1]), ([], [])), [1], [0]), None, "float32"),
    "contracting_with_group_dim": ((6, 8), (8, 5), (3,), "int32", Numbers((([1], [0]), ([], [])), [1], [0]), None, "float32"),
    "contracting_sizes_wrong_prefix": ((2, 6, 8), (2, 8, 5), (3, 3), "int32", Numbers((([2], [1]), ([0], [0])), [2], []), None, "float32"),
    "contracting_k_differs": ((6, 8), (7, 5), (3,), "int32", CONTRACTING, None, "float32"),
    # Ragged batch dim 1 of batch dims (0, 1): group_sizes must be (17, g).
    "batch_sizes_wrong_prefix": ((17, 19, 11, 5), (17, 19, 5, 7), (19, 3), "int32", Numbers((([3], [2]), ([0, 1], [0, 1])), [1], []), None, "float32"),
    "batch_with_group_dim": ((3, 6, 4), (3, 4, 5), (2,), "int32", Numbers((([2], [1]), ([0], [0])), [0], [0]), None, "float32"),
    "batch_sizes_differ": ((3, 6, 4), (2, 4, 5), (2,), "int32", BATCH, None, "float32"),
    "batch_dim_counts_differ": ((3, 6, 4), (3, 4, 5), (2,), "int32", Numbers((([2], [1]), ([0], [])), [0], []), None, "float32"),
    "contracting_counts_differ": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [1, 2]), ([], [])), [0], [0]), None, "float32"),
    "lhs_contracting_past_rank": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([2], [1]), ([], [])), [0], [0]), None, "float32"),
    "rhs_contracting_past_rank": ((6, 4), (3, 4, 5), (3,), "int32", Numbers((([1], [3]), ([], [])), [0], [0]), None, "float32"),
    "dim_batch_and_contracting": ((3, 6, 4), (3, 4, 5), (2,), "int32", Numbers((([0], [0]), ([0], [0])), [1], []), None, "float32"),
    "narrower_int_result": ((6, 4), (3, 4, 5), (3,), "int32", NC, "int8", "int32"),
}

# (lhs shape, rhs shape, group_sizes shape, group_sizes dtype): inputs jax.lax.ragged_dot
# rejects.
BAD_RAGGED_DOT = {
    "lhs_1d": ((4,), (3, 4, 5), (3,), "int32"),
    "rhs_2d": ((6, 4), (4, 5), (3,), "int32"),
    "k_differs": ((6, 4), (3, 5, 5), (3,), "int32"),
    "group_count_differs": ((6, 4), (3, 4, 5), (2,), "int32"),
    "sizes_2d": ((6, 4), (3, 4, 5), (2, 3), "int32"),
    "scalar_sizes": ((6, 4), (3, 4, 5), (), "int32"),
    "float_sizes": ((6, 4), (3, 4, 5), (3,), "float32"),
}


def _raises_as_jax(theirs, ours):
  """Runs both; ours must raise jax's exception type (and, for a TypeError, ValueError)."""
  with pytest.raises(Exception) as jax_error:
    theirs()
  assert type(jax_error.value) is TypeError, jax_error.value  # the table is what jax rejects
  with pytest.raises(TypeError) as our_error:
    ours()
  assert isinstance(our_error.value, ValueError)  # today's callers catch ValueError
  assert isinstance(our_error.value, GmmShapeError)
  return our_error.value


@pytest.mark.parametrize("case", list(BAD_GENERAL))
def test_ragged_dot_general_rejects_what_jax_rejects(case):
  lhs_shape, rhs_shape, sizes_shape, sizes_dtype, numbers, preferred, dtype = BAD_GENERAL[case]
  lhs, rhs = jnp.ones(lhs_shape, dtype), jnp.ones(rhs_shape, dtype)
  sizes = jnp.ones(sizes_shape, sizes_dtype)
  args = (lhs, rhs, sizes, numbers)
  _raises_as_jax(lambda: jax.lax.ragged_dot_general(*args, preferred_element_type=preferred),
                 lambda: gmm_jax.ragged_dot_general(*args, preferred_element_type=preferred))


@pytest.mark.parametrize("case", list(BAD_RAGGED_DOT))
def test_ragged_dot_rejects_what_jax_rejects(case):
  lhs_shape, rhs_shape, sizes_shape, sizes_dtype = BAD_RAGGED_DOT[case]
  args = (jnp.ones(lhs_shape), jnp.ones(rhs_shape), jnp.ones(sizes_shape, sizes_dtype))
  error = _raises_as_jax(lambda: jax.lax.ragged_dot(*args), lambda: gmm_jax.ragged_dot(*args))
  assert f"lhs float32[{','.join(map(str, lhs_shape))}]" in str(error)  # names the shapes


def test_ragged_dot_takes_what_jax_takes():
  # jax.lax.ragged_dot's numbers only fix lhs dim 0 (ragged) and dim 1 (contracting): a
  # 3-D lhs [m, k, x] is accepted, the x dim kept.
  lhs, rhs = jnp.asarray(_rand((6, 4, 2), 0)), jnp.asarray(_rand((3, 4, 5), 1))
  sizes = jnp.asarray([2, 1, 3], jnp.int32)
  want = jax.lax.ragged_dot(lhs, rhs, sizes)
  got = jax.jit(gmm_jax.ragged_dot)(lhs, rhs, sizes)
  assert got.shape == want.shape == (6, 2, 5)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("lhs_dtype, rhs_dtype", [
    ("float16", "bfloat16"), ("float32", "int8"), ("int8", "int8")])
def test_result_types_are_jax_s(lhs_dtype, rhs_dtype):
  # jax's dot rule picks the result type (f16 x bf16 -> bf16; mixed int and float -> the
  # float); small integer values keep every product exact.
  lhs = jnp.asarray(np.arange(24).reshape(6, 4) % 5, lhs_dtype)
  rhs = jnp.asarray(np.arange(60).reshape(3, 4, 5) % 7 - 3, rhs_dtype)
  sizes = jnp.asarray([2, 1, 3], jnp.int32)
  ours = jax.jit(lambda l, r, s: (gmm_jax.ragged_dot(l, r, s), gmm_jax.ragged_dot_general(
      l, r[0], s[:2], CONTRACTING)))(lhs, rhs, sizes)
  theirs = (jax.lax.ragged_dot(lhs, rhs, sizes),
            jax.lax.ragged_dot_general(lhs, rhs[0], sizes[:2], CONTRACTING))
  for ours, theirs in zip(ours, theirs):
    assert ours.dtype == theirs.dtype
    np.testing.assert_array_equal(np.asarray(ours, np.float64), np.asarray(theirs, np.float64))


def test_errors_under_jit_name_the_shapes():
  lhs, rhs, sizes = jnp.ones((17, 19, 11, 5)), jnp.ones((17, 19, 5, 7)), jnp.ones((19, 3), int)
  numbers = BAD_GENERAL["batch_sizes_wrong_prefix"][4]
  with pytest.raises(TypeError, match=r"group_sizes to have shape \(17, 3\), got \(19, 3\)"):
    jax.jit(lambda *a: gmm_jax.ragged_dot_general(*a, numbers))(lhs, rhs, sizes)


def test_checks_under_explicit_mesh_axes():
  # jax infers no sharding for ragged_dot_general under Explicit axes; the shape check still
  # runs, and a valid call still works (tests/test_mesh_kinds.py shards one).
  mesh = jax.make_mesh((2,), ("x",), axis_types=(jax.sharding.AxisType.Explicit,))
  set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh
  lhs, rhs = jnp.asarray(_rand((6, 4), 0)), jnp.asarray(_rand((3, 4, 5), 1))
  sizes = jnp.asarray([2, 1, 3], jnp.int32)
  with set_mesh(mesh):
    with pytest.raises(TypeError, match="rhs group dimension size to be 3, got 2"):
      jax.jit(gmm_jax.ragged_dot)(lhs, rhs[:2], sizes)
    got = jax.jit(gmm_jax.ragged_dot)(lhs, rhs, sizes)
  np.testing.assert_allclose(got, jax.lax.ragged_dot(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)


def test_gmm_shape_errors_are_type_errors_too():
  # gmm's own checks that jax also makes: rank, contraction size, group count, list dtype.
  lhs, rhs, sizes = jnp.ones((6, 4)), jnp.ones((3, 4, 5)), jnp.asarray([2, 2, 2])
  for call in (lambda: gmm_jax.gmm(lhs[0], rhs, sizes),
               lambda: gmm_jax.gmm(lhs, rhs[:, :3], sizes),
               lambda: gmm_jax.gmm(lhs, rhs[:2], sizes),
               lambda: gmm_jax.gmm(lhs, rhs, sizes.astype(jnp.float32)),
               lambda: gmm_jax.gmm(lhs, rhs, sizes[None])):
    with pytest.raises(TypeError) as error:
      call()
    assert isinstance(error.value, ValueError)
  # Values jax never checks stay a plain ValueError.
  with pytest.raises(ValueError) as error:
    gmm_jax.gmm(lhs, rhs, jnp.asarray([2, -1, 2]))
  assert not isinstance(error.value, TypeError)


# ------------------------------------------------------------- 64-bit, strict promotion

# (lhs shape, rhs shape, group sizes, numbers): the three modes, and a batched list.
MODES = {
    "non_contracting": ((8, 4), (3, 4, 5), [[2, 0, 5]], NC),
    "non_contracting_batched": ((2, 8, 4), (2, 3, 4, 5), [[2, 0, 5], [1, 6, 1]],
                                Numbers((([2], [2]), ([0], [0])), [1], [1])),
    "contracting": ((5, 8), (8, 3), [[3, 0, 4]], CONTRACTING),
    "contracting_batched": ((2, 5, 8), (2, 8, 3), [[3, 0, 4], [8, 0, 0]],
                            Numbers((([2], [1]), ([0], [0])), [2], [])),
    "batch": ((3, 4, 6), (3, 6, 5), [[1, 2]], BATCH),
}


def _mode_args(case, sizes_dtype):
  lhs_shape, rhs_shape, sizes, numbers = MODES[case]
  sizes = np.asarray(sizes, sizes_dtype)
  sizes = sizes[0] if sizes.shape[0] == 1 else sizes
  return jnp.asarray(_rand(lhs_shape, 1)), jnp.asarray(_rand(rhs_shape, 2)), sizes, numbers


@pytest.mark.parametrize("case, sizes_dtype", [
    ("non_contracting", "int32"), ("non_contracting_batched", "int64"),
    ("contracting", "int64"), ("contracting_batched", "int32"), ("batch", "int64")])
def test_x64_strict_promotion(case, sizes_dtype):
  with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
    lhs, rhs, sizes, numbers = _mode_args(case, sizes_dtype)
    sizes = jnp.asarray(sizes)
    assert sizes.dtype == sizes_dtype
    ours = lambda l, r: gmm_jax.ragged_dot_general(l, r, sizes, numbers)  # noqa: E731
    theirs = lambda l, r: jax.lax.ragged_dot_general(l, r, sizes, numbers)  # noqa: E731
    got, want = jax.jit(ours)(lhs, rhs), theirs(lhs, rhs)
    assert got.dtype == want.dtype == jnp.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    # Reverse mode (ours) against jax's forward mode through <ct, J t> = <J^T ct, t> (jax
    # has no reverse mode for a ragged contracting or batch dimension).
    tangents = (jnp.asarray(_rand(lhs.shape, 3)), jnp.asarray(_rand(rhs.shape, 4)))
    ct = jnp.asarray(_rand(want.shape, 5))
    _, want_jvp = jax.jvp(theirs, (lhs, rhs), tangents)
    pulled = jax.jit(lambda l, r, c: jax.vjp(ours, l, r)[1](c))(lhs, rhs, ct)
    assert [p.dtype for p in pulled] == [jnp.float32, jnp.float32]
    np.testing.assert_allclose(sum(jnp.vdot(p, t) for p, t in zip(pulled, tangents)),
                               jnp.vdot(ct, want_jvp), rtol=1e-4)


def test_x64_strict_ragged_dot_and_group_offset():
  with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
    lhs, rhs, sizes, _ = _mode_args("non_contracting", "int64")
    got = jax.jit(gmm_jax.ragged_dot)(lhs, rhs, sizes)
    np.testing.assert_allclose(got, jax.lax.ragged_dot(lhs, rhs, sizes), rtol=1e-5, atol=1e-5)
    grad = jax.grad(lambda l, r: gmm_jax.ragged_dot(l, r, sizes).sum(), argnums=(0, 1))
    want = jax.grad(lambda l, r: jax.lax.ragged_dot(l, r, sizes).sum(), argnums=(0, 1))
    for g, w in zip(jax.jit(grad)(lhs, rhs), want(lhs, rhs)):
      np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # group_offset (jax has none): groups 1 and 2 held; rows of group 0 are 0.
    local = jax.jit(lambda l, r, s: gmm_jax.ragged_dot(l, r, s, group_offset=jnp.int64(1)))(
        lhs, rhs[1:], sizes)
    np.testing.assert_allclose(local[2:7], got[2:7], rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(local[:2], 0)


@pytest.mark.parametrize("implementation", ["lax_ragged_dot", "pallas_tpu"])
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_x64_strict_tpu_paths(implementation, group_type):
  # The TPU chain's kernel (interpreted) and its fallback count rows in int32 under x64.
  with jax.enable_x64(True), jax.numpy_dtype_promotion("strict"):
    sizes = jnp.asarray([5, 0, 7], jnp.int64)
    if group_type == "m":
      lhs, rhs = jnp.asarray(_rand((16, 8), 1)), jnp.asarray(_rand((3, 8, 4), 2))
      theirs = lambda l, r: jax.lax.ragged_dot(l, r, sizes)  # noqa: E731
    else:
      lhs, rhs = jnp.asarray(_rand((4, 12), 1)), jnp.asarray(_rand((12, 5), 2))
      theirs = lambda l, r: jax.lax.ragged_dot_general(l, r, sizes, CONTRACTING)  # noqa: E731
    ours = lambda l, r: gmm_jax.gmm(l, r, sizes, group_type=group_type,  # noqa: E731
                                    implementation=implementation, interpret=True)
    got = jax.jit(ours)(lhs, rhs)
    want = theirs(lhs, rhs)
    np.testing.assert_allclose(got, want.reshape(got.shape), rtol=1e-5, atol=1e-5)
    grads = jax.jit(jax.grad(lambda l, r: jnp.sum(ours(l, r) ** 2), argnums=(0, 1)))(lhs, rhs)
    assert [g.dtype for g in grads] == [jnp.float32, jnp.float32]


# ------------------------------------------------------------ jax.export, symbolic sizes

def _specs(shapes_and_dtypes):
  return [jax.ShapeDtypeStruct(shape, dtype) for shape, dtype in shapes_and_dtypes]


# (symbolic lhs shape, rhs shape, group_sizes shape) per mode, over the symbols m, k.
SYMBOLIC = {
    "non_contracting": ("m, 4", "3, 4, 5", "3", NC),
    "non_contracting_batched": ("2, m, 4", "2, 3, 4, 5", "2, 3",
                                Numbers((([2], [2]), ([0], [0])), [1], [1])),
    "contracting": ("5, k", "k, 3", "3", CONTRACTING),
    "batch": ("m, 4, 6", "m, 6, 5", "2", BATCH),
}
CONCRETE = {"non_contracting": ((8, 4), (3, 4, 5), [2, 0, 5]),
            "non_contracting_batched": ((2, 8, 4), (2, 3, 4, 5), [[2, 0, 5], [1, 6, 1]]),
            "contracting": ((5, 8), (8, 3), [3, 0, 4]),
            "batch": ((3, 4, 6), (3, 6, 5), [1, 2])}


def _symbolic_specs(case):
  lhs, rhs, sizes, _ = SYMBOLIC[case]
  scope = export.SymbolicScope()
  shape = lambda text: export.symbolic_shape(text, scope=scope)  # noqa: E731
  return _specs([(shape(lhs), jnp.float32), (shape(rhs), jnp.float32),
                 (shape(sizes), jnp.int32)])


def _concrete(case):
  lhs_shape, rhs_shape, sizes = CONCRETE[case]
  return (jnp.asarray(_rand(lhs_shape, 3)), jnp.asarray(_rand(rhs_shape, 4)),
          jnp.asarray(sizes, jnp.int32))


@pytest.mark.parametrize("case", list(SYMBOLIC))
def test_export_with_symbolic_dimensions(case):
  numbers = SYMBOLIC[case][3]
  ours = lambda l, r, s: gmm_jax.ragged_dot_general(l, r, s, numbers)  # noqa: E731
  theirs = lambda l, r, s: jax.lax.ragged_dot_general(l, r, s, numbers)  # noqa: E731
  exported = export.export(jax.jit(ours))(*_symbolic_specs(case))
  lhs, rhs, sizes = _concrete(case)
  np.testing.assert_allclose(exported.call(lhs, rhs, sizes), theirs(lhs, rhs, sizes),
                             rtol=1e-5, atol=1e-5)
  # Forward-mode derivatives, exported (jax's own rule: the one every mode has).
  def jvp(f):
    return lambda l, r, s, tl, tr: jax.jvp(lambda a, b: f(a, b, s), (l, r), (tl, tr))[1]

  specs = _symbolic_specs(case)
  exported_jvp = export.export(jax.jit(jvp(ours)))(*specs, specs[0], specs[1])
  tangents = (jnp.asarray(_rand(lhs.shape, 5)), jnp.asarray(_rand(rhs.shape, 6)))
  np.testing.assert_allclose(exported_jvp.call(lhs, rhs, sizes, *tangents),
                             jvp(theirs)(lhs, rhs, sizes, *tangents), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["non_contracting", "non_contracting_batched", "batch"])
def test_export_a_gradient_with_symbolic_dimensions(case):
  # Reverse mode where jax has it (a ragged non-contracting dimension); for a ragged batch
  # dimension ours is the plain batched product's gradient, which jax computes as its value.
  numbers = SYMBOLIC[case][3]
  lhs, rhs, sizes = _concrete(case)
  ct = jnp.asarray(_rand(jax.lax.ragged_dot_general(lhs, rhs, sizes, numbers).shape, 7))

  def grad(f):
    return jax.grad(lambda l, r, s, c: jnp.vdot(f(l, r, s), c), argnums=(0, 1))

  ours = grad(lambda l, r, s: gmm_jax.ragged_dot_general(l, r, s, numbers))
  if case == "batch":
    theirs = grad(lambda l, r, s: jax.lax.dot_general(l, r, numbers.dot_dimension_numbers))
  else:
    theirs = grad(lambda l, r, s: jax.lax.ragged_dot_general(l, r, s, numbers))
  specs = _symbolic_specs(case)
  ct_spec = jax.eval_shape(lambda l, r, s: gmm_jax.ragged_dot_general(l, r, s, numbers),
                           *specs)
  exported = export.export(jax.jit(ours))(*specs, ct_spec)
  for got, want in zip(exported.call(lhs, rhs, sizes, ct), theirs(lhs, rhs, sizes, ct)):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_symbolic_contracting_mode_has_jax_s_derivatives():
  # There it is jax.lax.ragged_dot_general itself: forward mode (tested above), and no
  # reverse mode, as in jax (the static-shape path has one).
  specs = _symbolic_specs("contracting")
  for fn in (gmm_jax.ragged_dot_general, jax.lax.ragged_dot_general):
    loss = lambda l, r, s, fn=fn: fn(l, r, s, CONTRACTING).sum()  # noqa: E731
    with pytest.raises(NotImplementedError, match="RAGGED_CONTRACTING"):
      export.export(jax.jit(jax.grad(loss)))(*specs)
  lhs, rhs, sizes = _concrete("contracting")
  grad = jax.grad(lambda l: gmm_jax.ragged_dot_general(l, rhs, sizes, CONTRACTING).sum())
  assert grad(lhs).shape == lhs.shape


def test_export_ragged_dot_with_symbolic_dimensions():
  specs = _symbolic_specs("non_contracting")
  lhs, rhs, sizes = _concrete("non_contracting")
  loss = lambda f: lambda l, r, s: f(l, r, s).sum()  # noqa: E731
  exported = export.export(jax.jit(jax.value_and_grad(loss(gmm_jax.ragged_dot),
                                                      argnums=(0, 1))))(*specs)
  (value, grads) = exported.call(lhs, rhs, sizes)
  want_value, want_grads = jax.value_and_grad(loss(jax.lax.ragged_dot), argnums=(0, 1))(
      lhs, rhs, sizes)
  np.testing.assert_allclose(value, want_value, rtol=1e-5)
  for got, want in zip(grads, want_grads):
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_symbolic_dimensions_elsewhere_say_what_serves_them():
  specs = _symbolic_specs("non_contracting")
  with pytest.raises(NotImplementedError, match="group_offset with symbolic dimensions"):
    export.export(jax.jit(lambda l, r, s: gmm_jax.ragged_dot(l, r, s, group_offset=0)))(
        *specs)
  with pytest.raises(NotImplementedError, match="gmm needs static shapes.*ragged_dot"):
    export.export(jax.jit(gmm_jax.gmm))(*specs)
  # Shape errors are still jax's, symbolic or not.
  bad = _specs([(specs[0].shape, jnp.float32), ((2, 4, 5), jnp.float32), ((3,), jnp.int32)])
  with pytest.raises(TypeError, match="rhs group dimension size to be 3, got 2"):
    export.export(jax.jit(gmm_jax.ragged_dot))(*bad)
