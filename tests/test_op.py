"""gmm as a JAX op: every transformation composes (jvp, linearize, grad of grad,
linear_transpose, vmap over any operand, shard_map), invalid traced group lists have one
defined result in every implementation, `implementation=` sequences and the platform of a
call.

Derivatives are checked numerically (`check_grads`, order 2, both modes) and against
`jax.lax.ragged_dot` where it applies; vmap against a Python loop over the examples.
"""

from __future__ import annotations

import functools
import subprocess
import sys

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_test_base import jnp_gmm
from grids import covering
from jax.sharding import Mesh, PartitionSpec as P
from jax.test_util import check_grads
from oracle import f64, gmm_oracle, tolerances

M, K, N, G = 10, 9, 4, 3
SIZES = [3, 0, 5]  # an empty group, and rows (m) or columns (k) past the total


def _operands(group_type, seed=0, scale=0.5, transpose_lhs=False, transpose_rhs=False,
              num_local=G):
  rng = np.random.default_rng(seed)
  lhs = rng.standard_normal((K, M) if transpose_lhs else (M, K)) * scale
  matrix = (N, K) if transpose_rhs else (K, N)
  rhs = rng.standard_normal(((num_local,) if group_type == "m" else ()) + matrix) * scale
  bias = rng.standard_normal((num_local, N)) * scale
  return (jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32),
          jnp.asarray(bias, jnp.float32))


# ------------------------------------------------------------------- derivatives, order 2

# (group_type, activation, bias, group_offset, transpose_lhs, transpose_rhs)
CHECK_GRADS_CASES = [
    ("m", None, False, None, False, False),
    ("m", "silu", True, 1, True, True),
    ("m", "gelu", True, None, True, False),
    ("m", "fast_gelu", False, None, False, True),
    ("m", jnp.tanh, True, None, False, False),
    ("k", None, True, None, False, False),
    ("k", "silu", True, None, True, False),
    ("k", "gelu_tanh", True, 1, True, True),
    ("k", "gelu", False, 1, False, True),
]
# Run with -m slow only (the default run keeps both group types, every layout, with and
# without bias and offset, and a callable activation; test_order_2_matches_jnp_autodiff
# checks the built-in activations' second derivatives exactly).
CHECK_GRADS_SLOW = {0, 3, 5, 6}


def _case_id(case):
  group_type, activation, bias, offset, tl, tr = case
  name = getattr(activation, "__name__", activation)
  return f"{group_type}-{name}-bias{int(bias)}-off{offset}-t{int(tl)}{int(tr)}"


@pytest.mark.parametrize("case", [
    pytest.param(case, id=_case_id(case),
                 marks=[pytest.mark.slow] if i in CHECK_GRADS_SLOW else [])
    for i, case in enumerate(CHECK_GRADS_CASES)])
def test_check_grads_order_2(case):
  group_type, activation, with_bias, offset, tl, tr = case
  num_local = G - 1 if offset else G
  lhs, rhs, bias = _operands(group_type, seed=1, transpose_lhs=tl, transpose_rhs=tr,
                             num_local=num_local)
  sizes = np.asarray(SIZES, np.int32)

  def fn(lhs, rhs, *bias):
    # The reference backend compiles fastest; the rules under test do not depend on it
    # (test_vmap_of_grad_and_grad_of_vmap_on_the_xla_path runs them on the XLA path).
    return gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, activation=activation,
                       bias=bias[0] if bias else None, group_offset=offset,
                       transpose_lhs=tl, transpose_rhs=tr, implementation="reference",
                       num_groups=num_local if group_type == "k" else None)

  args = (lhs, rhs, bias) if with_bias else (lhs, rhs)
  # eps 3e-3: f32 central differences of second order (1e-2 truncates, 1e-4 rounds).
  check_grads(fn, args, order=2, modes=("fwd", "rev"), eps=3e-3)


# Default run: each activation once, the group types in turn; all 8 with -m slow.
@covering(("group_type", ["m", "k"]), ("activation", [None, "relu", "gelu", "silu"]))
def test_order_2_matches_jnp_autodiff(group_type, activation):
  # Exact second derivatives (forward over reverse and reverse over reverse) against jax's
  # own autodiff of a per-group jnp gmm; relu included (finite differences break at kinks).
  lhs, rhs, bias = _operands(group_type, seed=15)
  sizes = np.asarray(SIZES, np.int32)
  options = dict(group_type=group_type, activation=activation)
  ours = lambda l, r, b: gmm_jax.gmm(l, r, sizes, bias=b, implementation="reference",  # noqa
                                     **options)
  theirs = lambda l, r, b: jnp_gmm(l, r, b, SIZES, **options)  # noqa: E731
  tangents = _operands(group_type, seed=16)

  def second(f):
    scalar = lambda *a: jnp.sum(jnp.sin(f(*a)))  # noqa: E731
    grad = jax.grad(scalar, argnums=(0, 1, 2))
    fwd_over_rev = jax.jvp(grad, (lhs, rhs, bias), tangents)[1]
    rev_over_rev = jax.grad(lambda *a: sum(jnp.vdot(g, t) for g, t in zip(grad(*a), tangents)),
                            argnums=(0, 1, 2))(lhs, rhs, bias)
    return fwd_over_rev, rev_over_rev

  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
               second(ours), second(theirs))


def test_jvp_linearize_and_hessian_match_lax_ragged_dot():
  lhs, rhs, _ = _operands("m", seed=3)
  sizes = jnp.asarray(SIZES, jnp.int32)
  dlhs, drhs, _ = _operands("m", seed=4)
  ours = functools.partial(gmm_jax.ragged_dot, group_sizes=sizes)
  theirs = functools.partial(jax.lax.ragged_dot, group_sizes=sizes)
  tol = tolerances(jnp.float32, k=K)
  for a, b in zip(jax.jvp(ours, (lhs, rhs), (dlhs, drhs)),
                  jax.jvp(theirs, (lhs, rhs), (dlhs, drhs))):
    np.testing.assert_allclose(a, b, **tol)
  out, lin = jax.linearize(ours, lhs, rhs)
  np.testing.assert_allclose(lin(dlhs, drhs), jax.jvp(theirs, (lhs, rhs), (dlhs, drhs))[1],
                             **tol)
  scalar = lambda f: lambda l, r: jnp.sum(jnp.sin(f(l, r)))  # noqa: E731
  # Hessian-vector products, forward over reverse (jax.hessian of jax.lax.ragged_dot itself
  # fails: its vmap rule only maps dim 0).
  hvp = lambda f: jax.jvp(jax.grad(scalar(f), argnums=(0, 1)), (lhs, rhs),  # noqa: E731
                          (dlhs, drhs))[1]
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
               jax.jit(lambda: hvp(ours))(), hvp(theirs))
  assert jax.jit(jax.hessian(scalar(ours)))(lhs, rhs).shape == lhs.shape * 2
  # grad of grad and of grad of grad (jax.lax.ragged_dot has no transpose for those: the
  # per-group jnp gmm is the reference).
  theirs = lambda l, r: jnp_gmm(l, r, None, SIZES, "m")  # noqa: E731
  for order in (2, 3):
    def nested(f, n=order):
      g = scalar(f)
      for _ in range(n - 1):
        g = (lambda g: lambda l, r: jnp.sum(jax.grad(g, argnums=(0, 1))(l, r)[1] ** 2))(g)
      return jax.grad(g, argnums=(0, 1))
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4),
                 nested(ours)(lhs, rhs), nested(theirs)(lhs, rhs))


@pytest.mark.parametrize("group_type", ["m", "k"])
@pytest.mark.parametrize("transpose_lhs, transpose_rhs", [(False, False), (True, True)])
def test_linear_transpose_in_lhs_and_rhs(group_type, transpose_lhs, transpose_rhs):
  lhs, rhs, _ = _operands(group_type, seed=5, transpose_lhs=transpose_lhs,
                          transpose_rhs=transpose_rhs)
  options = dict(group_type=group_type, transpose_lhs=transpose_lhs,
                 transpose_rhs=transpose_rhs)
  sizes = np.asarray(SIZES, np.int32)
  ours = lambda l, r: gmm_jax.gmm(l, r, sizes, **options)  # noqa: E731
  theirs = lambda l, r: jnp_gmm(l, r, None, SIZES, **options)  # noqa: E731
  out = ours(lhs, rhs)
  ct = jnp.asarray(np.random.default_rng(6).standard_normal(out.shape), jnp.float32)
  tol = tolerances(jnp.float32, k=max(M, K, N))
  for arg, fixed in ((0, rhs), (1, lhs)):
    def linear(f, x):
      return f(x, fixed) if arg == 0 else f(fixed, x)
    primal = lhs if arg == 0 else rhs
    got = jax.linear_transpose(functools.partial(linear, ours), primal)(ct)[0]
    want = jax.linear_transpose(functools.partial(linear, theirs), primal)(ct)[0]
    assert got.shape == primal.shape and got.dtype == primal.dtype
    np.testing.assert_allclose(got, want, **tol)
  if group_type == "m" and not transpose_lhs and not transpose_rhs:
    lax_t = jax.linear_transpose(lambda l: jax.lax.ragged_dot(l, rhs, sizes), lhs)(ct)[0]
    np.testing.assert_allclose(jax.linear_transpose(lambda l: ours(l, rhs), lhs)(ct)[0],
                               lax_t, **tol)


def test_linear_transpose_in_bias():
  lhs, rhs, bias = _operands("m", seed=7)
  sizes = np.asarray(SIZES, np.int32)
  ct = jnp.ones((M, N), jnp.float32)
  zero = jnp.zeros_like(lhs)
  got = jax.linear_transpose(lambda b: gmm_jax.gmm(zero, rhs, sizes, bias=b), bias)(ct)[0]
  np.testing.assert_allclose(got, np.asarray(SIZES, np.float32)[:, None] * np.ones((G, N)))


def test_integer_operands_have_zero_float0_tangents():
  lhs = jnp.ones((M, K), jnp.int8)
  rhs = jnp.ones((G, K, N), jnp.int8)
  sizes = np.asarray(SIZES, np.int32)
  f = lambda l: gmm_jax.gmm(l, rhs, sizes, preferred_element_type=jnp.int32)  # noqa: E731
  tangent = np.zeros((M, K), jax.dtypes.float0)
  out, dout = jax.jvp(f, (lhs,), (tangent,))
  assert out.dtype == jnp.int32 and dout.dtype == jax.dtypes.float0


def test_qarray_scale_is_differentiable():
  # Weight-only: the op differentiates through dequantize, so the scale gets its gradient.
  lhs, rhs, _ = _operands("m", seed=8)
  q = gmm_jax.quantize(rhs, jnp.int8, channelwise_axes=(0, 2))
  sizes = np.asarray(SIZES, np.int32)

  def ours(x, scale):
    return jnp.sum(jnp.sin(gmm_jax.gmm(x, gmm_jax.QArray(q.qvalue, scale), sizes)))

  def theirs(x, scale):
    w = gmm_jax.dequantize(gmm_jax.QArray(q.qvalue, scale))
    return jnp.sum(jnp.sin(jnp_gmm(x, w, None, SIZES, "m")))

  for a, b in zip(jax.grad(ours, (0, 1))(lhs, q.scale), jax.grad(theirs, (0, 1))(lhs, q.scale)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)
  tangents = (jnp.ones_like(lhs), q.scale * 0.1)
  np.testing.assert_allclose(jax.jvp(ours, (lhs, q.scale), tangents)[1],
                             jax.jvp(theirs, (lhs, q.scale), tangents)[1], rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------------ vmap

B = 3
# in_axes of (lhs, rhs, group sizes, group_offset, bias); None: shared by the examples.
VMAP_CASES = [
    (0, None, None, None, None),  # lhs only: the batch becomes more rows
    (1, None, None, None, None),
    (None, 0, None, None, None),  # rhs only: the batch becomes more columns
    (None, 2, None, None, 0),
    (None, None, None, None, 0),  # bias only
    (None, None, 0, None, None),  # each example its own group sizes
    (None, None, None, 0, None),  # each its own group_offset
    (0, 0, 0, 0, 0),  # a batch of whole problems
]


def _batched(x, axis):
  """B examples of `x` stacked along `axis` (each a little different)."""
  if axis is None:
    return x
  return jnp.stack([x * (1.0 + 0.1 * b) if jnp.issubdtype(x.dtype, jnp.floating) else x
                    for b in range(B)], axis=axis)


# Transposed operands matter to the folds (lhs-only, rhs-only); the rest maps per example.
VMAP_PARAMS = [(axes, False) for axes in VMAP_CASES] + [
    (axes, True) for axes in VMAP_CASES[:4]]


@pytest.mark.parametrize("in_axes, transposed", VMAP_PARAMS, ids=[
    "".join("-" if x is None else str(x) for x in axes) + ("-t" if t else "")
    for axes, t in VMAP_PARAMS])
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_vmap_matches_a_loop(group_type, in_axes, transposed):
  num_local = G - 1
  lhs, rhs, bias = _operands(group_type, seed=9, transpose_lhs=transposed,
                             transpose_rhs=transposed, num_local=num_local)
  options = dict(group_type=group_type, transpose_lhs=transposed, transpose_rhs=transposed,
                 activation="silu", implementation="reference",
                 num_groups=num_local if group_type == "k" else None)
  args = [lhs, rhs, jnp.asarray(SIZES, jnp.int32), jnp.int32(1), bias]
  batched = [_batched(x, axis) for x, axis in zip(args, in_axes)]
  if in_axes[2] is not None:  # different group sizes per example
    batched[2] = jnp.asarray([[3, 0, 5], [0, 6, 2], [6, 1, 1]], jnp.int32)
  if in_axes[3] is not None:
    batched[3] = jnp.asarray([0, 1, 1], jnp.int32)

  def f(lhs, rhs, sizes, offset, bias):
    return gmm_jax.gmm(lhs, rhs, sizes, group_offset=offset, bias=bias, **options)

  got = jax.jit(jax.vmap(f, in_axes=in_axes))(*batched)
  examples = [[x if axis is None else jnp.take(x, b, axis=axis)
               for x, axis in zip(batched, in_axes)] for b in range(B)]
  want = jnp.stack([f(*example) for example in examples])
  np.testing.assert_allclose(got, want, **tolerances(jnp.float32, k=K))


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_vmap_of_grad_and_grad_of_vmap_on_the_xla_path(group_type):
  lhs, rhs, _ = _operands(group_type, seed=10)
  lhs_b = _batched(lhs, 0)
  sizes_b = jnp.asarray([[3, 0, 5], [0, 6, 2], [6, 1, 1]], jnp.int32)

  def loss(lhs, rhs, sizes):
    return jnp.sum(gmm_jax.gmm(lhs, rhs, sizes, group_type=group_type, activation="gelu") ** 2)

  got = jax.jit(jax.vmap(jax.grad(loss, (0, 1)), in_axes=(0, None, 0)))(lhs_b, rhs, sizes_b)
  for b in range(B):
    want = jax.grad(loss, (0, 1))(lhs_b[b], rhs, sizes_b[b])
    for g, w in zip(got, want):
      np.testing.assert_allclose(g[b], w, rtol=1e-4, atol=1e-4)
  total = lambda l, r: jnp.sum(jax.vmap(loss, (0, None, 0))(l, r, sizes_b))  # noqa: E731
  grads = jax.jit(jax.grad(total, (0, 1)))(lhs_b, rhs)
  want_rhs = sum(jax.grad(loss, 1)(lhs_b[b], rhs, sizes_b[b]) for b in range(B))
  np.testing.assert_allclose(grads[1], want_rhs, rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------------------ shard_map


def test_inside_shard_map_with_vma_checks():
  # Each device multiplies its own rows (its own group sizes); check_vma=True types the
  # output as varying over the axis, and the gradient flows through shard_map.
  mesh = Mesh(np.array(jax.devices()[:2]), ("d",))
  lhs, rhs, _ = _operands("m", seed=11)
  lhs2 = jnp.concatenate([lhs, lhs * 2])
  sizes = jnp.asarray([[3, 0, 5], [1, 4, 4]], jnp.int32)

  def local(lhs, rhs, sizes):
    return gmm_jax.gmm(lhs, rhs, sizes[0], activation="silu")

  fn = jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(P("d"), P(), P("d")),
                             out_specs=P("d")))
  out = fn(lhs2, rhs, sizes)
  for d in range(2):
    want = gmm_oracle(lhs2[d * M:(d + 1) * M], rhs, np.asarray(sizes[d]), "m",
                      activation="silu")
    np.testing.assert_allclose(f64(out[d * M:(d + 1) * M]), want, **tolerances(jnp.float32, k=K))
  grad = jax.grad(lambda r: jnp.sum(fn(lhs2, r, sizes)))(rhs)
  want = jax.grad(lambda r: sum(jnp.sum(local(lhs2[d * M:(d + 1) * M], r, sizes[d:d + 1]))
                                for d in range(2)))(rhs)
  np.testing.assert_allclose(grad, want, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------ invalid traced group lists


def _clamped(values, dim):
  """The documented defined result, by hand: each size clipped to what is left."""
  out, left = [], dim
  for value in values:
    size = min(max(int(value), 0), left)
    out.append(size)
    left -= size
  return out


# (encoding, traced list, its counts before the clamp)
INVALID_LISTS = [
    ("counts", [9, -5, 6], [9, -5, 6]),
    ("counts", [2**31 - 1] * 3, [2**31 - 1] * 3),
    ("counts", [-3, 20, 1], [-3, 20, 1]),
    ("cumsum", [5, 3, 8], [5, -2, 5]),
    ("cumsum", [20, 30, 40], [20, 10, 10]),
    ("sparse", [[2, 4], [7, 3]], [0, 0, 4]),  # index 7 is out of [0, 3): dropped
    ("sparse", [[0, 2**31 - 1], [1, 5]], [2**31 - 1, 5, 0]),
]
IMPLEMENTATIONS = [("xla", False), ("reference", False), ("lax_ragged_dot", False),
                   ("pallas_triton", True), ("pallas_tpu", True)]


@functools.lru_cache(maxsize=None)
def _traced_list_gmm(group_type, encoding, implementation, interpret):
  """One compiled gmm per (grouping, encoding, implementation): every list runs on it."""
  lhs, rhs, bias = _operands(group_type, seed=12)
  return jax.jit(lambda gl: gmm_jax.gmm(
      lhs, rhs, gl, group_type=group_type, group_list_type=encoding, bias=bias,
      num_groups=G, implementation=implementation, interpret=interpret))


# Default run: each implementation once, the group types in turn; all 8 with -m slow.
@covering(("group_type", ["m", "k"]), ("implementation, interpret", [
    pytest.param(name, interpret, id=name) for name, interpret in IMPLEMENTATIONS]))
def test_invalid_traced_lists_give_the_same_defined_result(group_type, implementation,
                                                          interpret):
  # Every implementation gives the documented result: each size clamped to what is left
  # (compared with the oracle run on the clamped sizes, exact zeros included).
  lhs, rhs, bias = _operands(group_type, seed=12)
  dim = M if group_type == "m" else K
  for encoding, group_list, counts in INVALID_LISTS:
    clamped = _clamped(counts, dim)
    want = gmm_oracle(lhs, rhs, clamped, group_type, bias=bias)
    fn = _traced_list_gmm(group_type, encoding, implementation, interpret)
    got = f64(fn(jnp.asarray(group_list, jnp.int32)))
    np.testing.assert_allclose(got, want, err_msg=f"{encoding} {group_list}",
                               **tolerances(jnp.float32, k=K))
    if group_type == "m":  # rows of no group are exactly 0
      rows = np.arange(M) >= sum(clamped)
      assert np.all(got[rows] == 0), (encoding, group_list)


@covering(("group_type", ["m", "k"]), ("implementation, interpret", [
    pytest.param(name, interpret, id=name) for name, interpret in IMPLEMENTATIONS]))
def test_invalid_traced_lists_differentiate_as_the_clamped_list(group_type, implementation,
                                                               interpret):
  # The op's sizes are cut where their running sum passes the dimension, not clamped first:
  # its derivative rules (the transposed gmms, the bias and row-id masks) must cut them the
  # same way. Gradients of an invalid list equal those of its clamped sizes, exactly the
  # same computation.
  lhs, rhs, bias = _operands(group_type, seed=14)
  dim = M if group_type == "m" else K
  out_shape = (M, N) if group_type == "m" else (G, M, N)
  cotangent = jnp.asarray(np.random.default_rng(15).standard_normal(out_shape), jnp.float32)

  def loss(encoding, group_list, lhs, rhs, bias):
    out = gmm_jax.gmm(lhs, rhs, group_list, group_type=group_type, group_list_type=encoding,
                      bias=bias, num_groups=G, implementation=implementation,
                      interpret=interpret, activation="silu")
    return jnp.sum(out * cotangent)

  grad = jax.jit(jax.grad(loss, argnums=(2, 3, 4)), static_argnums=0)
  for encoding, group_list, counts in INVALID_LISTS[:5]:
    clamped = jnp.asarray(_clamped(counts, dim), jnp.int32)
    got = grad(encoding, jnp.asarray(group_list, jnp.int32), lhs, rhs, bias)
    want = grad("counts", clamped, lhs, rhs, bias)
    for name, a, b in zip(("lhs", "rhs", "bias"), got, want):
      np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6,
                                 err_msg=f"{name} {encoding} {group_list}")


# ------------------------------------------------------------ implementation sequences

# A fresh interpreter in which the TPU kernel package fails to import: the dispatcher keeps
# pallas_tpu in the TPU chain as unavailable, `explain` says why it was skipped, a warning
# says so once, and a call naming it gets the reason.
_BROKEN_KERNELS = """
import sys, warnings
sys.modules["gmm_jax.pallas.tpu"] = None  # importing it raises ImportError
import gmm_jax, jax.numpy as jnp
from gmm_jax._src.backends import registry
assert "pallas_tpu" in registry.unavailable(), registry.unavailable()
x, w, sizes = jnp.ones((8, 16)), jnp.ones((2, 16, 4)), jnp.array([3, 5])
with warnings.catch_warnings(record=True) as caught:
  warnings.simplefilter("always")
  text = gmm_jax.explain(x, w, sizes, platform="tpu")
  gmm_jax.explain(x, w, sizes, platform="tpu")
print(text)
print("WARNINGS", [str(c.message) for c in caught])
try:
  gmm_jax.gmm(x, w, sizes, implementation="pallas_tpu", interpret=True)
except NotImplementedError as err:
  print("REFUSED", err)
"""


def test_a_kernel_package_that_fails_to_import_is_reported_not_silently_replaced():
  result = subprocess.run([sys.executable, "-c", _BROKEN_KERNELS], capture_output=True,
                          text=True, timeout=300, check=False)
  assert result.returncode == 0, result.stderr
  out = result.stdout
  assert "skipped pallas_tpu: could not be loaded (ModuleNotFoundError" in out, out
  assert ": lax_ragged_dot" in out, out  # the next of the TPU chain serves
  warned = [line for line in out.splitlines() if line.startswith("WARNINGS")]
  assert warned and warned[0].count("pallas_tpu implementation could not be loaded") == 1, out
  assert "REFUSED" in out and "pallas_tpu: could not be loaded (" in out, out


def test_implementation_sequence_tries_in_order():
  lhs, rhs, _ = _operands("m", seed=13)
  sizes = np.asarray(SIZES, np.int32)
  # pallas_triton does not run on the CPU (compiled), so the next name serves the call.
  text = gmm_jax.explain(lhs, rhs, sizes, implementation=("pallas_triton", "xla"))
  assert ": xla" in text and "skipped pallas_triton: pallas_triton runs on ('gpu',)" in text
  out = gmm_jax.gmm(lhs, rhs, sizes, implementation=["pallas_triton", "reference"])
  np.testing.assert_allclose(f64(out), gmm_oracle(lhs, rhs, SIZES, "m"),
                             **tolerances(jnp.float32, k=K))
  assert ": reference" in gmm_jax.explain(lhs, rhs, sizes,
                                          implementation=("reference", "xla"))
  with pytest.raises(NotImplementedError, match="pallas_triton: .*pallas_tpu: "):
    gmm_jax.gmm(lhs, rhs, sizes, implementation=("pallas_triton", "pallas_tpu"))


@pytest.mark.parametrize("implementation, match", [
    ((), "sequence of names"),
    (("xla", 3), "sequence of names"),
    (("xla", "nope"), "unknown implementation 'nope'"),
    (3, "sequence of names"),
])
def test_bad_implementation(implementation, match):
  lhs, rhs, _ = _operands("m")
  with pytest.raises(ValueError, match=match):
    gmm_jax.gmm(lhs, rhs, np.asarray(SIZES, np.int32), implementation=implementation)


# ------------------------------------------------------------------ the platform of a call


def test_platform_override_picks_that_platforms_chain():
  lhs, rhs, _ = _operands("m", seed=14)
  sizes = np.asarray(SIZES, np.int32)
  assert "on tpu: pallas_tpu" in gmm_jax.explain(lhs, rhs, sizes, platform="tpu",
                                                 interpret=True)
  out = gmm_jax.gmm(lhs, rhs, sizes, platform="tpu", interpret=True)
  np.testing.assert_allclose(f64(out), gmm_oracle(lhs, rhs, SIZES, "m"),
                             **tolerances(jnp.float32, k=K))
  assert "on cpu: xla" in gmm_jax.explain(lhs, rhs, sizes)
  with pytest.raises(ValueError, match="platform must be None or one of"):
    gmm_jax.gmm(lhs, rhs, sizes, platform="quantum")


def test_lowering_platform_decides_the_quantized_path():
  # No hint at trace time: the program lowered for a TPU dequantizes in the Mosaic kernel,
  # the one lowered for the CPU composes the weight-only mode on the XLA path.
  from lowering import lower_for, mosaic_calls
  lhs = jnp.ones((256, 256), jnp.bfloat16)
  q = gmm_jax.quantize(np.ones((G, 256, 256), np.float32), jnp.int8, channelwise_axes=(0, 2))
  f = lambda x, w, s: gmm_jax.gmm(x, w, s)  # noqa: E731
  sizes = jnp.asarray([100, 0, 100], jnp.int32)
  assert mosaic_calls(lower_for("tpu", f, lhs, q, sizes)) == 1
  assert mosaic_calls(jax.jit(f).lower(lhs, q, sizes).as_text()) == 0
