"""The one finishing step (`epilogue.finish`) against its numpy definition, the kernels'
tile epilogue (`apply_epilogue`) against it, and the gated column pairing of the sharding
strategies against the global rearrangement it stands for."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import gmm_jax
import meshes
import oracle
from gmm_jax._src.core import epilogue
from gmm_jax._src.sharding import strategy

RNG = np.random.default_rng(7)
ACTIVATIONS = [None, "relu", "gelu", "gelu_tanh", "fast_gelu", "silu"]
GATED = ["swiglu", "geglu", "geglu_tanh", "swiglu_clamped"]


def _np_sigmoid(x):
  return 1.0 / (1.0 + np.exp(-x))


# The gated activations in float64 numpy, written from their definitions ([gate | up]).
NP_GATED = {
    "swiglu": lambda g, u: oracle.ACTIVATIONS["silu"](g) * u,
    "geglu": lambda g, u: oracle.ACTIVATIONS["gelu"](g) * u,
    "geglu_tanh": lambda g, u: oracle.ACTIVATIONS["gelu_tanh"](g) * u,
    "swiglu_clamped": lambda g, u: (np.minimum(g, 7.0) * _np_sigmoid(1.702 * np.minimum(g, 7.0))
                                    * (np.clip(u, -7.0, 7.0) + 1.0)),
}


def _np_activation(name, z):
  if name is None:
    return z
  if name in NP_GATED:
    half = z.shape[-1] // 2
    return NP_GATED[name](z[..., :half], z[..., half:])
  return oracle.ACTIVATIONS[name](z)


def _np_finish(z, activation, row_ids=None, bias=None, row_weights=None, scale=None,
               offset=None):
  """float64 numpy finishing step: per-group values by row (m) or broadcast over M (k)."""
  z = oracle.f64(z)

  def per_group(v):
    v = oracle.f64(v)
    return v[np.maximum(row_ids, 0)] if z.ndim == 2 else v[:, None, :]

  if bias is not None:
    z = z + per_group(bias)
  y = _np_activation(activation, z)
  if row_weights is not None:
    y = y * oracle.f64(row_weights)[:, None]
  if scale is not None:
    y = y * per_group(scale)
  if offset is not None:
    y = y + per_group(offset)
  if row_ids is not None and z.ndim == 2:
    y = np.where((np.asarray(row_ids) >= 0)[:, None], y, 0.0)
  return y


@pytest.mark.parametrize("activation", ACTIVATIONS + GATED)
@pytest.mark.parametrize("group_type", ["m", "k"])
def test_finish_equals_its_definition(activation, group_type):
  num_local, rows, cols = 3, 10, 8
  out_cols = cols // 2 if activation in GATED else cols
  z = RNG.normal(size=(rows, cols) if group_type == "m" else (num_local, rows, cols)) * 3
  bias = RNG.normal(size=(num_local, cols))
  scale = RNG.uniform(0.5, 2.0, size=(num_local, out_cols))
  offset = RNG.normal(size=(num_local, out_cols))
  row_ids = weights = None
  if group_type == "m":
    row_ids = np.array([0, 0, 2, 2, 2, -1, 1, -1, 0, 1], np.int32)
    weights = RNG.uniform(size=rows)
  got = epilogue.finish(
      jnp.asarray(z, jnp.float32), activation, jnp.float32,
      row_ids=None if row_ids is None else jnp.asarray(row_ids),
      bias=jnp.asarray(bias, jnp.float32),
      row_weights=None if weights is None else jnp.asarray(weights, jnp.float32),
      output_scale=jnp.asarray(scale, jnp.float32), output_offset=jnp.asarray(offset, jnp.float32))
  want = _np_finish(z, activation, row_ids, bias, weights, scale, offset)
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=2e-5, atol=2e-5)
  if row_ids is not None:  # rows of no local group are exactly 0, whatever act(bias) is
    assert np.all(np.asarray(got)[row_ids < 0] == 0)


def test_finish_requantizes_to_integers_and_scatters():
  z = jnp.asarray([[1.4, -2.5], [300.0, -300.0], [0.5, 1.5]], jnp.float32)
  row_ids = jnp.asarray([0, 0, -1], jnp.int32)
  out = epilogue.finish(z, None, jnp.int8, row_ids=row_ids,
                        out_indices=jnp.asarray([2, 0, 1], jnp.int32), out_rows=4)
  # Round to nearest even, saturate, row 2 (no local group) writes nothing.
  np.testing.assert_array_equal(np.asarray(out),
                                [[127, -128], [0, 0], [1, -2], [0, 0]])
  assert out.dtype == jnp.int8


def test_finish_keeps_an_integer_sum_integer_with_an_integer_bias():
  z = jnp.asarray([[2**30, 1]], jnp.int32)
  out = epilogue.finish(z, None, jnp.int32, row_ids=jnp.asarray([0]),
                        bias=jnp.asarray([[5, -1]], jnp.int32))
  np.testing.assert_array_equal(np.asarray(out), [[2**30 + 5, 0]])  # exact past f32's 2**24


@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("activation", ACTIVATIONS + GATED)
def test_the_tile_epilogue_of_the_kernels_equals_finish(activation, out_dtype):
  # A kernel finishes the rows of one group on a tile: bias[g], its activation, its row
  # weights and the cast. That must be what the one finishing step gives those rows.
  num_local, rows, cols = 3, 6, 8
  acc = jnp.asarray(RNG.normal(size=(rows, cols)) * 3, jnp.float32)
  bias = jnp.asarray(RNG.normal(size=(num_local, cols)), jnp.float32)
  weights = jnp.asarray(RNG.uniform(size=rows), jnp.float32)
  group = 2
  tile = epilogue.apply_epilogue(acc, bias[group], activation, out_dtype, weights)
  whole = epilogue.finish(acc, activation, out_dtype,
                          row_ids=jnp.full((rows,), group, jnp.int32), bias=bias,
                          row_weights=weights)
  np.testing.assert_array_equal(np.asarray(tile, np.float32), np.asarray(whole, np.float32))


@pytest.mark.parametrize("shape,axes", [((2,), ("x",)), ((4,), ("x",)), ((8,), ("x",)),
                                        ((2, 4), ("x", "y")), ((4, 2), ("y", "x"))])
def test_gated_column_pairs_give_each_device_its_gate_and_up_blocks(shape, axes):
  mesh = meshes.mesh(shape, axes)
  shards = int(np.prod(shape))
  out_cols = 3 * shards  # N: c = 3 columns of output per device
  z = jnp.asarray(RNG.normal(size=(5, 2 * out_cols)), jnp.float32)  # [gate | up]
  spec_axes = axes[0] if len(axes) == 1 else tuple(axes)

  @functools.partial(jax.shard_map, mesh=mesh, in_specs=P(None, spec_axes),
                     out_specs=P(None, spec_axes), check_vma=False)
  def pair(local):
    return strategy.gated_column_pairs(local, tuple(axes))

  got = np.asarray(pair(z))  # device d's [gate_d | up_d], concatenated over devices
  c = out_cols // shards
  gate, up = np.asarray(z[:, :out_cols]), np.asarray(z[:, out_cols:])
  want = np.concatenate([np.concatenate([gate[:, d * c:(d + 1) * c], up[:, d * c:(d + 1) * c]],
                                        axis=1) for d in range(shards)], axis=1)
  np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("group_type", ["m", "k"])
def test_gated_with_explicitly_sharded_columns_equals_the_oracle(group_type):
  # Tensor parallelism over N with GmmSharding (shard_map): each device's output columns
  # need their own gate and up halves (max error 49.8 when each device gated its own column
  # slice).
  mesh = meshes.mesh((4,), ("x",))
  sizes = np.array([5, 0, 7], np.int32)
  n = 8  # output columns: 2 per device
  if group_type == "m":
    lhs = RNG.normal(size=(16, 8))
    rhs = RNG.normal(size=(3, 8, 2 * n))
    rhs_spec = P(None, None, "x")
  else:
    lhs = RNG.normal(size=(6, 16))
    rhs = RNG.normal(size=(16, 2 * n))
    rhs_spec = P(None, "x")
  bias = RNG.normal(size=(3, 2 * n))
  got = gmm_jax.gmm(jnp.asarray(lhs, jnp.float32), jnp.asarray(rhs, jnp.float32),
                    jnp.asarray(sizes), group_type=group_type, activation="swiglu",
                    bias=jnp.asarray(bias, jnp.float32),
                    sharding=gmm_jax.GmmSharding(mesh, lhs=P(), rhs=rhs_spec))
  z = oracle.gmm_oracle(lhs, rhs, sizes, group_type, bias=bias)
  want = _np_activation("swiglu", z)
  if group_type == "m":  # rows past the total and of no group: exactly 0
    want[sizes.sum():] = 0
  np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-4, atol=1e-4)


def test_output_scale_of_a_gated_gmm_meets_the_result_columns():
  # The output scale multiplies the N columns of the result, not the 2N of the product (it
  # was sized and checked against 2N).
  x = jnp.asarray(RNG.normal(size=(12, 8)), jnp.float32)
  w = gmm_jax.quantize(jnp.asarray(RNG.normal(size=(3, 8, 2 * 4)), jnp.float32), jnp.int8,
                       channelwise_axes=(0, 2))
  sizes = jnp.asarray([5, 0, 6], jnp.int32)
  scale = jnp.asarray(RNG.uniform(0.5, 2.0, size=(4,)), jnp.float32)
  plain = gmm_jax.gmm(x, w, sizes, activation="swiglu")
  scaled = gmm_jax.gmm(x, w, sizes, activation="swiglu", output_scale=scale)
  np.testing.assert_allclose(np.asarray(scaled), np.asarray(plain) * np.asarray(scale),
                             rtol=1e-6, atol=1e-6)
