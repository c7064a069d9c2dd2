"""gmm_jax.compat.megablox against megablox itself (jax's Pallas TPU kernels, run on the CPU
through the Pallas interpreter, as shipped with jax 0.10 and 0.12), jax.lax.ragged_dot and
a float64 numpy oracle; and docs/migration.md's tgmm row, run against megablox's tgmm.

megablox in interpret mode costs 2-6 s per call (mostly compiling), so the default run
compares a few calls that each cover several options at once; the variants run with -m slow.
"""

from __future__ import annotations

import functools
import importlib
import pathlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import f64, gmm_oracle, local_rows, tolerances

import gmm_jax
from gmm_jax._src.backends import registry
from gmm_jax.compat import megablox
from gmm_jax.compat.megablox import ops

mb_kernels = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.gmm")
mb_ops = importlib.import_module("jax.experimental.pallas.ops.tpu.megablox.ops")

DOCS = pathlib.Path(__file__).resolve().parent.parent / "docs"

# K = 48 with tk = 32: megablox's tile does not divide K. Group 1 is empty; rows 60-63 are
# past the total (megablox leaves them unwritten without existing_out).
M, K, N = 64, 48, 32
SIZES = np.array([20, 0, 30, 10], np.int32)
TILES = (16, 32, 32)
TOL = tolerances(jnp.float32, k=max(M, K, N), scale=16.0)


def _inputs(seed=0, dtype=jnp.float32):
  rng = np.random.default_rng(seed)
  lhs = jnp.asarray(rng.standard_normal((M, K)), dtype)
  rhs = jnp.asarray(rng.standard_normal((len(SIZES), K, N)), dtype)
  return lhs, rhs, jnp.asarray(SIZES)


def _ragged_dot_local(lhs, rhs_local, sizes, group_offset):
  """jax.lax.ragged_dot with rhs holding groups [offset, offset + G_local) of `sizes`: the
  other groups get zero weights."""
  full = jnp.zeros((len(sizes),) + rhs_local.shape[1:], rhs_local.dtype)
  full = full.at[group_offset:group_offset + rhs_local.shape[0]].set(rhs_local)
  return jax.lax.ragged_dot(lhs, full, sizes, preferred_element_type=jnp.float32)


def _jit(thunk):
  """Runs a call compiled as one program (much faster on the CPU than op by op)."""
  return jax.jit(thunk)()


def _close(actual, expected, **tol):
  np.testing.assert_allclose(f64(actual), f64(expected), **(tol or TOL))


# ------------------------------------------------------------------------ megablox, live


def test_gmm_equals_megablox_positional_and_keyword():
  lhs, rhs, sizes = _inputs()
  want = mb_kernels.gmm(lhs, rhs, sizes, jnp.float32, TILES, interpret=True)
  valid = slice(0, int(SIZES.sum()))  # megablox's rows past the total are unwritten
  positional = _jit(lambda: megablox.gmm(lhs, rhs, sizes, jnp.float32, TILES))
  keyword = _jit(lambda: ops.gmm(lhs=lhs, rhs=rhs, group_sizes=sizes,
                                 preferred_element_type=jnp.float32, tiling=TILES,
                                 transpose_rhs=False, interpret=False))
  for got in (positional, keyword):
    assert got.shape == want.shape and got.dtype == want.dtype
    _close(got[valid], want[valid])
    _close(got, jax.lax.ragged_dot(lhs, rhs, sizes))
    np.testing.assert_array_equal(np.asarray(got[valid.stop:]), 0)


def test_gmm_group_offset_and_existing_out_equal_megablox():
  lhs, rhs, sizes = _inputs(1)
  existing = jnp.asarray(np.random.default_rng(2).standard_normal((M, N)), jnp.float32)
  offset = jnp.array(1, jnp.int32)
  local = rhs[1:3]  # groups 1 (empty) and 2 of 4
  want = mb_kernels.gmm(lhs, local, sizes, jnp.float32, TILES, offset, existing, interpret=True)
  got = _jit(lambda: megablox.gmm(lhs, local, sizes, jnp.float32, TILES, offset, existing))
  _close(got, want)
  np.testing.assert_array_equal(  # a [1] group_offset (megablox's raises) works the same
      _jit(lambda: megablox.gmm(lhs, local, sizes, jnp.float32, TILES, offset[None],
                                existing)), got)
  # Rows outside the local groups are existing_out's, bit for bit.
  mask = local_rows(SIZES, M, 1, 2)
  np.testing.assert_array_equal(np.asarray(got)[~mask], np.asarray(existing)[~mask])
  _close(got, jnp.where(mask[:, None], _ragged_dot_local(lhs, local, sizes, 1), existing))


@pytest.fixture(scope="module")
def megablox_tgmm():
  """megablox's tgmm of the groups [1, 3) of SIZES, with existing_out, and its inputs."""
  rng = np.random.default_rng(3)
  lhs = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)  # megablox's [k, m]
  rhs = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)  # [m, n]
  existing = jnp.asarray(rng.standard_normal((2, K, N)), jnp.float32)
  sizes, offset = jnp.asarray(SIZES), jnp.array(1, jnp.int32)
  out = mb_kernels.tgmm(lhs, rhs, sizes, jnp.float32, TILES, offset, 2, existing,
                        interpret=True)
  plain = mb_kernels.tgmm(lhs, rhs, sizes, jnp.float32, TILES, interpret=True)
  return dict(lhs=lhs, rhs=rhs, sizes=sizes, offset=offset, existing=existing, out=out,
              plain=plain)


def test_tgmm_equals_megablox(megablox_tgmm):
  c = megablox_tgmm
  got = _jit(lambda: megablox.tgmm(c["lhs"], c["rhs"], c["sizes"], jnp.float32, TILES,
                                   c["offset"], 2, c["existing"]))
  assert got.shape == c["out"].shape == (2, K, N)
  _close(got, c["out"])
  oracle = gmm_oracle(c["lhs"], c["rhs"], SIZES, "k")  # [G, K, N], gmm's names
  _close(got, oracle[1:3] + f64(c["existing"]))
  plain = _jit(lambda: megablox.tgmm(lhs=c["lhs"], rhs=c["rhs"], group_sizes=c["sizes"]))
  _close(plain, c["plain"])
  _close(plain, oracle)
  np.testing.assert_array_equal(np.asarray(plain[1]), 0)  # the empty group
  dims = jax.lax.RaggedDotDimensionNumbers(dot_dimension_numbers=(([1], [0]), ([], [])),
                                           lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
  _close(plain, jax.lax.ragged_dot_general(c["lhs"], c["rhs"], c["sizes"], dims,
                                           preferred_element_type=jnp.float32))


def _migration_tgmm_section():
  text = (DOCS / "migration.md").read_text()
  start = text.index("| megablox `tgmm`")
  return text[start:text.index("\n## ", start)]


def test_migration_page_tgmm_row_runs_against_megablox(megablox_tgmm):
  """The page's tgmm mapping, executed as written, gives megablox's tgmm."""
  section = _migration_tgmm_section()
  header = section.splitlines()[0]
  assert 'group_type="k"' in header and "transpose_lhs=True" not in header, header
  blocks = re.findall(r"```python\n(.*?)```", section, flags=re.S)
  assert blocks, "the tgmm section of docs/migration.md has no python example"
  c = megablox_tgmm
  scope = dict(gmm_jax=gmm_jax, jnp=jnp, lhs=c["lhs"], rhs=c["rhs"], group_sizes=c["sizes"],
               group_offset=c["offset"], existing_out=c["existing"])
  for block in blocks:
    exec(block, scope)  # pylint: disable=exec-used
  _close(scope["out"], c["plain"])
  _close(scope["out_local"], c["out"])


@pytest.mark.slow  # the default run checks these gradients against jax.lax.ragged_dot's
def test_ops_gmm_gradients_equal_megablox():
  """ops.gmm under jit + grad, transpose_rhs and group_offset, against megablox's ops.gmm."""
  lhs, rhs, sizes = _inputs(4)
  local = jnp.swapaxes(rhs[:3], 1, 2)  # groups [0, 3) stored [G, N, K]
  offset = jnp.array(0, jnp.int32)
  cot = jnp.asarray(np.random.default_rng(5).standard_normal((M, N)), jnp.float32)
  valid = jnp.asarray(local_rows(SIZES, M, 0, 3))[:, None]

  def loss(fn, interpret, a, b):  # megablox leaves rows past the local groups unwritten
    out = fn(a, b, sizes, jnp.float32, TILES, offset, None, True, interpret)
    return jnp.sum(jnp.where(valid, out * cot, 0.0))

  want = jax.jit(jax.grad(functools.partial(loss, mb_ops.gmm, True), (0, 1)))(lhs, local)
  got = jax.jit(jax.grad(functools.partial(loss, ops.gmm, False), (0, 1)))(lhs, local)
  for g, w in zip(got, want):
    assert g.shape == w.shape and g.dtype == w.dtype
    _close(g, w)
  ref = jax.grad(lambda a, b: jnp.sum(jnp.where(valid, cot * _ragged_dot_local(
      a, jnp.swapaxes(b, 1, 2), sizes, 0), 0.0)), (0, 1))(lhs, local)
  for g, r in zip(got, ref):
    _close(g, r)


# ------------------------------------------------------- jax.lax.ragged_dot and the oracle


def _maxtext_moe(gmm_fn, x, wi, wo, sizes, group_offset, buffer, wi_tiles, wo_tiles):
  """The shape of MaxText's megablox call sites: a partial over group_sizes and dtype,
  the 9-tuple tiles per weight, expert-parallel group_offset, existing_out, transpose_rhs."""
  gmm = functools.partial(gmm_fn, group_sizes=sizes, preferred_element_type=jnp.float32)
  h = jax.nn.silu(gmm(x, wi, tiling=wi_tiles, group_offset=group_offset))
  return gmm(h, wo, tiling=wo_tiles, group_offset=group_offset, existing_out=buffer,
             transpose_rhs=True)


WI_TILES = (16, 32, 32, 16, 32, 32, 16, 32, 32)  # fwd, dlhs, drhs, each (tm, tk, tn)
WO_TILES = (16, 32, 32, 16, 32, 32, 32, 16, 32)
F = 40  # the MLP width


def _maxtext_inputs():
  rng = np.random.default_rng(6)
  x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  wi = jnp.asarray(rng.standard_normal((2, K, F)) / 4, jnp.float32)  # local experts 1, 2
  wo = jnp.asarray(rng.standard_normal((2, K, F)) / 4, jnp.float32)  # stored [E, out, in]
  buffer = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
  return x, wi, wo, buffer


def _maxtext_reference(x, wi, wo, buffer):
  sizes = jnp.asarray(SIZES)
  h = jax.nn.silu(_ragged_dot_local(x, wi, sizes, 1))
  out = _ragged_dot_local(h, jnp.swapaxes(wo, 1, 2), sizes, 1)
  return jnp.where(jnp.asarray(local_rows(SIZES, M, 1, 2))[:, None], out, buffer)


def test_maxtext_call_site_runs_unchanged_and_equals_ragged_dot():
  x, wi, wo, buffer = _maxtext_inputs()
  sizes, offset = jnp.asarray(SIZES), jnp.array(1, jnp.int32)
  cot = jnp.asarray(np.random.default_rng(7).standard_normal((M, K)), jnp.float32)

  def loss(x, wi, wo):
    return jnp.sum(cot * _maxtext_moe(ops.gmm, x, wi, wo, sizes, offset, buffer, WI_TILES,
                                      WO_TILES))

  value, grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2)))(x, wi, wo)
  want, want_grads = jax.value_and_grad(
      lambda *a: jnp.sum(cot * _maxtext_reference(*a, buffer)), (0, 1, 2))(x, wi, wo)
  _close(value, want, rtol=1e-5, atol=1e-3)
  for g, w in zip(grads, want_grads):
    _close(g, w)


def _spy(monkeypatch):
  calls = []
  real = gmm_jax.gmm

  def spy(*args, **kwargs):
    calls.append(kwargs)
    return real(*args, **kwargs)

  monkeypatch.setattr(gmm_jax, "gmm", spy)
  return calls


def test_tiling_tuples_reach_forward_dlhs_and_drhs(monkeypatch):
  calls = _spy(monkeypatch)
  lhs, rhs, sizes = _inputs()
  want = jax.lax.ragged_dot(lhs, rhs, sizes)
  _close(_jit(lambda: megablox.gmm(lhs, rhs, sizes, tiling=(16, 32, 64))), want)
  _close(_jit(lambda: ops.gmm(lhs, rhs, sizes, tiling=tuple(range(8, 80, 8)))), want)
  T = gmm_jax.Tiling
  # megablox's ops.gmm gives its one 3-tuple to the forward gmm, the dlhs gmm and the drhs
  # tgmm, whose tm tiles the grouped dimension (gmm_jax's tile_k of k-grouping).
  assert calls[0]["tiling"] == gmm_jax.Tilings(fwd=T(16, 32, 64), dlhs=T(16, 32, 64),
                                               drhs=T(tile_m=32, tile_k=16, tile_n=64))
  assert calls[1]["tiling"] == gmm_jax.Tilings(fwd=T(8, 16, 24), dlhs=T(32, 40, 48),
                                               drhs=T(tile_m=64, tile_k=56, tile_n=72))
  _close(_jit(lambda: megablox.tgmm(lhs.T, lhs, sizes, tiling=(8, 16, 24))),
         gmm_oracle(lhs.T, lhs, SIZES, "k"))
  assert calls[2]["tiling"].fwd == T(tile_m=16, tile_k=8, tile_n=24)
  assert calls[2]["group_type"] == "k" and not calls[2].get("transpose_lhs")


def test_tiling_callable_sees_each_kernels_dims():
  """megablox calls a tiling function with its kernel's (m, k, n): (m, k, n) forward,
  (m, n, k) for the dlhs gmm, (m, k, n) for the drhs tgmm (m grouped)."""
  seen = []

  def lut(m, k, n):
    seen.append((m, k, n))
    return (16, 16, 16)

  lhs, rhs, sizes = _inputs()
  cot = jnp.ones((M, N), jnp.float32)
  grads = jax.jit(jax.grad(lambda a, b: jnp.sum(cot * ops.gmm(a, b, sizes, jnp.float32, lut)),
                           (0, 1)))(lhs, rhs)
  assert set(seen) == {(M, K, N), (M, N, K)}, seen  # fwd and drhs share (m, k, n)
  want = jax.grad(lambda a, b: jnp.sum(cot * jax.lax.ragged_dot(a, b, sizes)), (0, 1))(lhs, rhs)
  for g, w in zip(grads, want):
    _close(g, w)
  seen.clear()
  _jit(lambda: megablox.tgmm(lhs.T, lhs, sizes, jnp.float32, lut))
  assert set(seen) == {(M, K, K)}, seen  # tgmm's lhs [k, m] x rhs [m, n]: (m, k, n)
  # None from the function: gmm_jax's automatic choice (megablox raises ValueError).
  _close(_jit(lambda: megablox.gmm(lhs, rhs, sizes, tiling=lambda m, k, n: None)),
         jax.lax.ragged_dot(lhs, rhs, sizes))


def test_existing_out_gradient_is_the_cotangent_of_the_rows_it_gives():
  lhs, rhs, sizes = _inputs(8)
  existing = jnp.zeros((M, N), jnp.float32)
  cot = jnp.asarray(np.random.default_rng(9).standard_normal((M, N)), jnp.float32)
  grad = jax.jit(jax.grad(lambda e: jnp.sum(cot * ops.gmm(
      lhs, rhs[2:], sizes, jnp.float32, TILES, jnp.array(2, jnp.int32), e))))(existing)
  mask = local_rows(SIZES, M, 2, 2)
  np.testing.assert_array_equal(np.asarray(grad), np.where(mask[:, None], 0.0, cot))


def test_tgmm_num_actual_groups_and_bf16_existing_out_rounding():
  rng = np.random.default_rng(10)
  lhs = jnp.asarray(rng.standard_normal((K, M)), jnp.bfloat16)
  rhs = jnp.asarray(rng.standard_normal((M, N)), jnp.bfloat16)
  existing = jnp.asarray(rng.standard_normal((3, K, N)), jnp.bfloat16)
  got = _jit(lambda: megablox.tgmm(lhs, rhs, jnp.asarray(SIZES), jnp.bfloat16, TILES,
                                   jnp.array([1], jnp.int32), 3, existing))
  assert got.shape == (3, K, N) and got.dtype == jnp.bfloat16
  # One rounding: the f32 sum of the product and existing_out, cast to bf16.
  want = gmm_oracle(lhs, rhs, SIZES, "k")[1:4] + f64(existing)
  _close(got, want, **tolerances(jnp.bfloat16, k=M, scale=16.0))


def _qwix_int8(x, axis):
  """qwix's absmax int8 (MaxText's quantizer): the absmax maps to 127.5, values round to
  nearest and saturate at [-128, 127], computed in float32 as qwix does for float32
  operands; dequantized, in float64. XLA divides by the constant 127.5 as a product with
  its float32 reciprocal: the scale here is that product, to the last bit."""
  x = np.asarray(x, np.float32)
  scale = np.abs(x).max(axis=axis, keepdims=True) * np.float32(1 / 127.5)
  return np.clip(np.round(x / scale), -128, 127).astype(np.float64) * scale


def _positive_absmax(x, axis):
  """`x` with each channel's largest magnitude made positive. A channel's absmax lands on
  +-127.5, a rounding tie: +127.5 gives 127 both ways, but -127.5 gives -128 or -127 as the
  last bit of the scale falls, which is rounding, not quantization."""
  x = np.array(x)
  peak = np.abs(x) == np.abs(x).max(axis=axis, keepdims=True)
  return np.where(peak, np.abs(x), x)


def test_rhs_quantize_dtype_is_per_column_absmax():
  lhs, rhs, sizes = _inputs(11)
  lhs, rhs = jnp.asarray(_positive_absmax(lhs, 1)), jnp.asarray(_positive_absmax(rhs, (0, 1)))
  got = _jit(lambda: megablox.gmm(lhs, rhs, sizes, rhs_quantize_dtype=jnp.int8))
  dequantized = _qwix_int8(rhs, axis=(0, 1))  # per output column n, all experts
  want = gmm_oracle(lhs, dequantized, SIZES, "m")
  _close(got, want, rtol=1e-5, atol=1e-3)
  both = _jit(lambda: ops.gmm(lhs, rhs, sizes, lhs_quantize_dtype=jnp.int8,
                              rhs_quantize_dtype=jnp.int8))
  want = gmm_oracle(_qwix_int8(lhs, axis=1), dequantized, SIZES, "m")  # lhs per row
  _close(both, want, rtol=1e-5, atol=1e-3)
  with pytest.raises(NotImplementedError, match="quantized rhs"):
    megablox.gmm(lhs, rhs, sizes, lhs_quantize_dtype=jnp.int8)


@pytest.mark.parametrize("call, match", [
    (lambda l, r, s: megablox.gmm(l[0], r, s), "2-tensor lhs"),
    (lambda l, r, s: megablox.gmm(l, r[0], s), "3-tensor rhs"),
    (lambda l, r, s: megablox.tgmm(l.T, r, s), "2-tensor rhs"),
    (lambda l, r, s: megablox.gmm(l, r, s, jnp.float32, TILES, None,
                                  jnp.zeros((M, N), jnp.bfloat16)), "must match"),
    (lambda l, r, s: megablox.gmm(l, r, s, jnp.float32, TILES, None,
                                  jnp.zeros((M, N + 1))), "shape"),
    (lambda l, r, s: megablox.gmm(l, r, s, group_offset=jnp.zeros((2,), jnp.int32)),
     "group_offset"),
    (lambda l, r, s: megablox.gmm(l, r, s, tiling=(16, 16)), "3 ints"),
    (lambda l, r, s: megablox.tgmm(l.T, l, s, existing_out=jnp.zeros((4, K, N))), "shape"),
])
def test_bad_inputs_raise_value_error(call, match):
  lhs, rhs, sizes = _inputs()
  with pytest.raises(ValueError, match=match):
    call(lhs, rhs, sizes)


# ------------------------------------------------------------- megablox, live, -m slow


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("transpose_rhs", [False, True])
def test_gmm_equals_megablox_variants(dtype, transpose_rhs):
  lhs, rhs, sizes = _inputs(12, dtype)
  rhs = jnp.swapaxes(rhs, 1, 2) if transpose_rhs else rhs
  want = mb_kernels.gmm(lhs, rhs, sizes, dtype, TILES, None, None, transpose_rhs, True)
  for interpret in (False, True):
    got = megablox.gmm(lhs, rhs, sizes, dtype, TILES, None, None, transpose_rhs, interpret)
    valid = slice(0, int(SIZES.sum()))
    _close(got[valid], want[valid], **tolerances(dtype, k=K, scale=16.0))


@pytest.mark.slow
def test_tiling_forms_equal_megablox():
  lhs, rhs, sizes = _inputs(13)
  want = mb_kernels.gmm(lhs, rhs, sizes, jnp.float32, lambda m, k, n: (32, 32, 32),
                        interpret=True)
  valid = slice(0, int(SIZES.sum()))
  for tiling in ((32, 32, 32), (32, 32, 32) * 3, lambda m, k, n: (32, 32, 32)):
    _close(megablox.gmm(lhs, rhs, sizes, jnp.float32, tiling)[valid], want[valid])


@pytest.mark.slow
def test_tgmm_num_actual_groups_equals_megablox():
  rng = np.random.default_rng(14)
  lhs = jnp.asarray(rng.standard_normal((K, M)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((M, N)), jnp.float32)
  sizes = jnp.asarray(SIZES)
  want = mb_kernels.tgmm(lhs, rhs, sizes, jnp.float32, TILES, None, 2, interpret=True)
  _close(megablox.tgmm(lhs, rhs, sizes, jnp.float32, TILES, None, 2), want)
  want = mb_kernels.tgmm(lhs, rhs, sizes, jnp.float32, TILES, jnp.array(2, jnp.int32), 2,
                         interpret=True)
  for offset in (jnp.array(2, jnp.int32), jnp.array([2], jnp.int32)):  # megablox: () only
    _close(megablox.tgmm(lhs, rhs, sizes, jnp.float32, TILES, offset, 2, interpret=True),
           want)


@pytest.mark.slow
def test_maxtext_call_site_equals_megablox():
  """The MaxText-style step through megablox's own ops.gmm (which takes 3-tuple tiles: its
  one tiling serves forward and backward)."""
  x, wi, wo, buffer = _maxtext_inputs()
  sizes, offset = jnp.asarray(SIZES), jnp.array(1, jnp.int32)
  cot = jnp.asarray(np.random.default_rng(15).standard_normal((M, K)), jnp.float32)

  def loss(gmm_fn, wi_tiles, wo_tiles, x, wi, wo):
    out = _maxtext_moe(gmm_fn, x, wi, wo, sizes, offset, buffer, wi_tiles, wo_tiles)
    return jnp.sum(cot * out)

  megablox_gmm = lambda *a, **kw: mb_ops.gmm(*a, **{**kw, "interpret": True})
  want = jax.jit(jax.value_and_grad(functools.partial(loss, megablox_gmm, TILES, TILES),
                                    (0, 1, 2)))(x, wi, wo)
  got = jax.jit(jax.value_and_grad(functools.partial(loss, ops.gmm, WI_TILES, WO_TILES),
                                   (0, 1, 2)))(x, wi, wo)
  _close(got[0], want[0], rtol=1e-5, atol=1e-3)
  for g, w in zip(got[1], want[1]):
    _close(g, w)


# --------------------------------------------------- MaxText's own megablox keywords

# What MaxText 0.2.x's RoutedMoE passes to its megablox ``ops.gmm`` on every call, at the
# values of an unquantized megablox run (its kernel-level backend calls add varying_axes).
MAXTEXT_KEYWORDS = dict(
    use_qwix_quantization=False, use_tokamax_backend=False, weight_gather_axes=None,
    lhs_vma_axes=(), rhs_vma_axes=(), use_gmm_v2=False, use_gmm_v2_heuristic_tiling=False,
    partial_sum=None, qwix_rule=None, use_manual_quantization=False)


def test_maxtext_keywords_at_their_do_nothing_values_change_nothing():
  lhs, rhs, sizes = _inputs(21)
  plain = _jit(lambda: ops.gmm(lhs, rhs, sizes, jnp.float32, TILES))
  got = _jit(lambda: ops.gmm(lhs=lhs, rhs=rhs, group_sizes=sizes,
                             preferred_element_type=jnp.float32, tiling=TILES * 3,
                             group_offset=None, interpret=None, **MAXTEXT_KEYWORDS))
  _close(got, plain, rtol=0, atol=0)
  # The backend switches choose MaxText's kernels, not the result.
  for flags in (dict(use_tokamax_backend=True), dict(use_gmm_v2=True),
                dict(use_gmm_v2=True, use_gmm_v2_heuristic_tiling=True)):
    _close(_jit(lambda: ops.gmm(lhs, rhs, sizes, jnp.float32, TILES, **flags)), plain)
  # MaxText gathers weights over these axes only for quantized gradients, refused here.
  _close(_jit(lambda: ops.gmm(lhs, rhs, sizes, weight_gather_axes=[("fsdp", 1)])), plain)
  kernel = _jit(lambda: megablox.gmm(lhs, rhs, sizes, jnp.float32, TILES, None, None,
                                     transpose_rhs=False, interpret=False, varying_axes=()))
  _close(kernel, plain, rtol=0, atol=0)
  tgmm_plain = _jit(lambda: megablox.tgmm(lhs.T, lhs[:, :N], sizes, jnp.float32, TILES))
  _close(_jit(lambda: megablox.tgmm(lhs.T, lhs[:, :N], sizes, jnp.float32, TILES, None, None,
                                    interpret=False, varying_axes=())), tgmm_plain, rtol=0,
         atol=0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(use_manual_quantization=True), "use_manual_quantization"),
    (dict(use_qwix_quantization=True, qwix_rule=types.SimpleNamespace(
        act_qtype=jnp.float8_e4m3fn, weight_qtype=jnp.float8_e4m3fn,
        bwd_qtype=jnp.float8_e5m2)), "bwd_qtype"),
    (dict(use_qwix_quantization=True, qwix_rule=types.SimpleNamespace(
        act_qtype=jnp.int8, weight_qtype=jnp.int8, act_calibration_method="fixed,-1,1",
        weight_calibration_method="absmax")), "calibration_method"),
])
def test_maxtext_values_gmm_jax_cannot_honour_raise(kwargs, match):
  lhs, rhs, sizes = _inputs(22)
  with pytest.raises(NotImplementedError, match=match):
    ops.gmm(lhs, rhs, sizes, **kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(use_gmm_v2="yes"), "use_gmm_v2 must be a bool"),
    (dict(weight_gather_axes=[("fsdp",)]), "weight_gather_axes"),
    (dict(lhs_vma_axes="expert"), "lhs_vma_axes"),
    (dict(partial_sum=jnp.zeros((M, N + 1))), "partial_sum must have"),
])
def test_malformed_maxtext_keywords_raise_value_error(kwargs, match):
  lhs, rhs, sizes = _inputs(23)
  with pytest.raises(ValueError, match=match):
    ops.gmm(lhs, rhs, sizes, **kwargs)


def test_qwix_rule_quantizes_as_the_handcrafted_dtypes_do():
  """use_qwix_quantization with a rule of absmax act/weight int8 (channelwise) is MaxText's
  AQT-style dtypes; with disable_channelwise_axes the scales are per tensor."""
  lhs, rhs, sizes = _inputs(24)
  lhs, rhs = jnp.asarray(_positive_absmax(lhs, 1)), jnp.asarray(_positive_absmax(rhs, (0, 1)))
  rule = types.SimpleNamespace(act_qtype=jnp.int8, weight_qtype=jnp.int8, bwd_qtype=None,
                               act_calibration_method="absmax",
                               weight_calibration_method="absmax",
                               disable_channelwise_axes=False)
  got = _jit(lambda: ops.gmm(lhs, rhs, sizes, use_qwix_quantization=True, qwix_rule=rule))
  want = _jit(lambda: ops.gmm(lhs, rhs, sizes, lhs_quantize_dtype=jnp.int8,
                              rhs_quantize_dtype=jnp.int8))
  _close(got, want, rtol=0, atol=0)
  per_tensor = types.SimpleNamespace(**{**vars(rule), "disable_channelwise_axes": True})
  got = _jit(lambda: ops.gmm(lhs, rhs, sizes, use_qwix_quantization=True,
                             qwix_rule=per_tensor))
  # Each tensor's peak is one of its channels' peaks: positive (no rounding tie).
  want = gmm_oracle(_qwix_int8(lhs, axis=None), _qwix_int8(rhs, axis=None), SIZES, "m")
  _close(got, want, rtol=1e-5, atol=1e-3)
  # No rule held (qwix absent or its interception not targeting gmm): no quantization.
  if importlib.util.find_spec("qwix") is None:
    _close(_jit(lambda: ops.gmm(lhs, rhs, sizes, use_qwix_quantization=True)),
           _jit(lambda: ops.gmm(lhs, rhs, sizes)), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_fp8_quantize_dtypes_map_the_absmax_to_the_largest_value(dtype):
  """MaxText's fp8 and nanoo_fp8 (fnuz: largest finite 240) quantize both operands."""
  lhs, rhs, sizes = _inputs(25)
  got = _jit(lambda: ops.gmm(lhs, rhs, sizes, lhs_quantize_dtype=dtype,
                             rhs_quantize_dtype=dtype))
  top = float(jnp.finfo(dtype).max)

  def fp8(x, axis):
    x = np.asarray(x, np.float32)
    scale = np.abs(x).max(axis=axis, keepdims=True) / np.float32(top)
    values = np.asarray(jnp.asarray(np.clip(x / scale, -top, top)).astype(dtype), np.float64)
    return values * scale

  want = gmm_oracle(fp8(lhs, 1), fp8(rhs, (0, 1)), SIZES, "m")
  _close(got, want, rtol=1e-5, atol=1e-3)
  # Straight-through gradients: those of the product of the dequantized operands.
  cot = jnp.asarray(np.random.default_rng(26).standard_normal((M, N)), jnp.float32)
  dlhs, drhs = jax.jit(jax.grad(lambda l, r: jnp.sum(cot * ops.gmm(
      l, r, sizes, lhs_quantize_dtype=dtype, rhs_quantize_dtype=dtype)), (0, 1)))(lhs, rhs)
  assert np.isfinite(f64(dlhs)).all() and np.isfinite(f64(drhs)).all()
  rows = local_rows(SIZES, M, 0, len(SIZES))
  want_dlhs = np.zeros((M, K))
  bounds = np.concatenate([[0], np.cumsum(SIZES)])
  w = fp8(rhs, (0, 1))
  for g in range(len(SIZES)):
    want_dlhs[bounds[g]:bounds[g + 1]] = f64(cot)[bounds[g]:bounds[g + 1]] @ w[g].T
  _close(np.where(rows[:, None], dlhs, 0), want_dlhs, rtol=1e-5, atol=1e-3)


def test_partial_sum_is_added_and_gets_the_cotangent():
  lhs, rhs, sizes = _inputs(27)
  partial = jnp.asarray(np.random.default_rng(28).standard_normal((M, N)), jnp.bfloat16)
  cot = jnp.asarray(np.random.default_rng(29).standard_normal((M, N)), jnp.float32)
  out, grad = jax.jit(jax.value_and_grad(lambda p: jnp.sum(cot * ops.gmm(
      lhs, rhs, sizes, jnp.float32, TILES * 3, partial_sum=p).astype(jnp.float32))))(partial)
  want = gmm_oracle(lhs, rhs, SIZES, "m") + f64(partial)
  _close(out, np.sum(f64(cot) * want), rtol=1e-5, atol=1e-2)
  _close(grad, f64(cot).astype(jnp.bfloat16), rtol=0, atol=0)


def test_rhs_of_the_first_groups_without_group_offset_is_megablox_default():
  """megablox defaults group_offset to 0: rhs[:2] holds groups 0 and 1."""
  lhs, rhs, sizes = _inputs(30)
  got = _jit(lambda: megablox.gmm(lhs, rhs[:2], sizes, jnp.float32, TILES))
  want = _jit(lambda: megablox.gmm(lhs, rhs[:2], sizes, jnp.float32, TILES,
                                   jnp.array(0, jnp.int32)))
  _close(got, want, rtol=0, atol=0)
  _close(got, np.where(local_rows(SIZES, M, 0, 2)[:, None],
                       gmm_oracle(lhs, rhs, SIZES, "m"), 0))


def test_maxtext_int8_backward_operands_float_times_plain_int8():
  """MaxText's int8 backward multiplies the scaled cotangent by the plain int8 values of the
  other operand, at its kernel level and through ragged_dot_general: gmm multiplies them in
  the float's dtype, as jax.lax.ragged_dot does."""
  lhs, rhs, sizes = _inputs(31)
  q = jnp.asarray(np.random.default_rng(32).integers(-128, 128, (len(SIZES), K, N)), jnp.int8)
  got = _jit(lambda: megablox.gmm(lhs[:, :N], q, sizes, jnp.float32, TILES,
                                  transpose_rhs=True, varying_axes=()))
  want = jax.lax.ragged_dot(lhs[:, :N], jnp.swapaxes(q, 1, 2), sizes)
  _close(got, want, rtol=1e-6, atol=1e-4)
  qt = jnp.asarray(np.random.default_rng(33).integers(-128, 128, (K, M)), jnp.int8)
  got = _jit(lambda: megablox.tgmm(qt, lhs[:, :N], sizes, jnp.float32, TILES, None, 4))
  want = gmm_oracle(f64(qt), lhs[:, :N], SIZES, "k")
  _close(got, want, rtol=1e-6, atol=1e-4)
  assert gmm_jax.gmm(lhs, q, sizes).dtype == jnp.float32


def test_inside_shard_map_with_check_vma_the_tpu_kernel_runs():
  """MaxText computes its MoE inside jax.shard_map(check_vma=True): gmm_jax's TPU kernel
  (interpreted here) serves the call per shard, forward and gradients."""
  mesh = jax.make_mesh((2,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,),
                       devices=jax.devices()[:2])
  rng = np.random.default_rng(34)  # K = N = 128: tiles the TPU kernel takes
  lhs = jnp.asarray(rng.standard_normal((M, 128)), jnp.float32)
  rhs = jnp.asarray(rng.standard_normal((4, 128, 128)) / 8, jnp.float32)
  local_sizes = jnp.asarray([12, 0, 16, 4], jnp.int32)  # each shard's 32 rows

  def body(x, w, s):
    return megablox.gmm(x, w, s, jnp.float32, (32, 128, 128), interpret=True)

  fn = jax.shard_map(body, mesh=mesh, in_specs=(jax.P("fsdp"), jax.P(), jax.P()),
                     out_specs=jax.P("fsdp"), check_vma=True)
  cot = jnp.asarray(np.random.default_rng(35).standard_normal((M, 128)), jnp.float32)
  with registry.record() as decisions:
    out, (dlhs, drhs) = jax.jit(jax.value_and_grad(
        lambda l, r: jnp.sum(cot * fn(l, r, local_sizes)), (0, 1)))(lhs, rhs)
  assert {d.implementation for d in decisions} == {"pallas_tpu"}, decisions
  sizes64 = np.asarray(local_sizes)
  want = np.concatenate([gmm_oracle(lhs[:32], rhs, sizes64, "m"),
                         gmm_oracle(lhs[32:], rhs, sizes64, "m")])
  _close(out, np.sum(f64(cot) * want), rtol=1e-5, atol=1e-2)
  want_dlhs = np.concatenate([gmm_oracle(cot[:32], np.swapaxes(f64(rhs), 1, 2), sizes64, "m"),
                              gmm_oracle(cot[32:], np.swapaxes(f64(rhs), 1, 2), sizes64, "m")])
  _close(dlhs, want_dlhs)
  want_drhs = (gmm_oracle(f64(lhs[:32]).T, cot[:32], sizes64, "k")
               + gmm_oracle(f64(lhs[32:]).T, cot[32:], sizes64, "k"))
  _close(drhs, want_drhs)
