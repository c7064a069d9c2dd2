"""Every bad input gets a clear error at the door: a ValueError that names the argument and
the offending value or shape, and what was wrongly refused or wrongly accepted before now
behaves as documented."""

from __future__ import annotations

import gmm_jax
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from gmm_jax.compat import ascend, onednn

M, K, N, G = 8, 6, 4, 2
LHS = jnp.ones((M, K), jnp.float32)
RHS = jnp.ones((G, K, N), jnp.float32)
SIZES = np.asarray([3, 4], np.int32)


def _gmm(**kwargs):
  args = dict(lhs=LHS, rhs=RHS, group_list=SIZES)
  args.update(kwargs)
  return lambda: gmm_jax.gmm(args.pop("lhs"), args.pop("rhs"), args.pop("group_list"), **args)


BAD_INPUTS = [
    ("lhs_none", _gmm(lhs=None), r"lhs must be an array or a gmm_jax.QArray, got None"),
    ("rhs_string", _gmm(rhs="weights"), r"rhs must be an array .* got 'weights'"),
    ("list_past_int64", _gmm(group_list=[2**70, 1]), "past int64"),
    ("list_past_int32", _gmm(group_list=np.asarray([2**40, 1])), r"must fit int32, got \[1099511627776, 1\]"),
    ("num_groups_negative", _gmm(group_list=np.asarray([[0, 3]]), group_list_type="sparse",
                                 num_groups=-1), "num_groups must be a non-negative int, got -1"),
    ("num_groups_float", _gmm(group_list=np.asarray([[0, 3]]), group_list_type="sparse",
                              num_groups=3.7), "num_groups must be a non-negative int, got 3.7"),
    ("num_groups_string", _gmm(num_groups="2"), "num_groups must be a non-negative int, got '2'"),
    ("num_groups_bool", _gmm(num_groups=True), "got True"),
    ("activation_changes_shape", _gmm(activation=lambda x: jnp.sum(x, axis=-1)),
     r"must keep the shape of its input .* to float32\[2\]"),
    ("precision_string", _gmm(precision="extreme"), r"precision='extreme' is not a jax.lax.Precision"),
    ("precision_triple", _gmm(precision=("high", "high", "high")), "must be a pair"),
    ("transpose_lhs_string", _gmm(transpose_lhs="false"), "transpose_lhs must be a bool, got 'false'"),
    ("transpose_rhs_int", _gmm(transpose_rhs=1), "transpose_rhs must be a bool, got 1"),
    ("interpret_none", _gmm(interpret=None),
     "interpret must be a bool, a jax.experimental.pallas.tpu.InterpretParams or a "
     "jax.experimental.pallas.mosaic_gpu.InterpretGPUParams, got None"),
    ("float_to_int", _gmm(preferred_element_type=jnp.int32),
     r"preferred_element_type=int32 is an integer type but the operands are floating"),
    ("bool_out", _gmm(preferred_element_type=bool), "must be a floating or integer dtype, got bool"),
    ("complex_out", _gmm(preferred_element_type=jnp.complex64),
     "must be a floating or integer dtype, got complex64"),
    ("bool_bias", _gmm(bias=jnp.ones((G, N), bool)), "bias must be a floating or integer array"),
    ("bool_group_list", _gmm(group_list=np.asarray([True, False])), "integer array, got dtype bool"),
    ("platform", _gmm(platform="npu"), "platform must be None or one of"),
    ("bad_quantize_spec", _gmm(quantize_rhs="int8"), "quantize_rhs must be a gmm_jax.QuantSpec"),
    ("tiled_axes_string_key",
     lambda: gmm_jax.quantize(np.ones((4, 8), np.float32), jnp.int8, tiled_axes={"1": 4}),
     r"tiled_axes axes must be ints, got '1'"),
    ("tiled_axes_not_a_dict",
     lambda: gmm_jax.quantize(np.ones((4, 8), np.float32), jnp.int8, tiled_axes=[(1, 4)]),
     r"tiled_axes must be a dict"),
    ("quant_spec_tile_string", lambda: gmm_jax.QuantSpec(jnp.int8, tiled_axes={1: "a"}),
     r"QuantSpec tiled_axes must map int axes to positive int tile sizes, got \{1: 'a'\}"),
    ("quant_spec_dtype", lambda: gmm_jax.QuantSpec(jnp.float32),
     "QuantSpec dtype must be one of"),
    ("dequantize_plain_array", lambda: gmm_jax.dequantize(jnp.ones((2, 2))),
     r"dequantize needs a gmm_jax.QArray \(or a qwix QArray\), got float32\[2,2\]"),
    ("qarray_float_values", lambda: gmm_jax.QArray(jnp.ones((4, 8)), jnp.ones((4, 1))),
     r"qvalue must hold quantized values: an integer dtype .* got float32"),
    ("qarray_int_scale", lambda: gmm_jax.QArray(jnp.ones((4, 8), jnp.int8),
                                                jnp.ones((4, 1), jnp.int32)),
     "scale must be floating, got int32"),
    ("from_list_variable_dim", lambda: gmm_jax.GroupedArray.from_list(
        [np.ones((2, 3))], variable_dim=2), "variable_dim must be 0 or 1, got 2"),
    ("grouped_desc_variable_dim_string", lambda: gmm_jax.grouped_desc(
        (8, 4), jnp.float32, variable_dim_idx="0", num_groups=2),
     "variable_dim_idx must be 0 or 1, got '0'"),
    ("grouped_desc_bool_dtype", lambda: gmm_jax.grouped_desc((8, 4), bool, 0, 2),
     "integer or floating dtype, got bool"),
    ("tiling_past_int32", lambda: gmm_jax.Tiling(2**31, 128, 128),
     r"Tiling.tile_m must lie in \[1, 2\*\*31\), got 2147483648"),
    ("tiling_float", lambda: gmm_jax.Tiling(128.0, 128, 128),
     "Tiling.tile_m must be a positive int, got 128.0"),
    ("tiling_bool", lambda: gmm_jax.Tiling(True, 128, 128), "got True"),
]


@pytest.mark.parametrize("call, match", [pytest.param(c, m, id=i) for i, c, m in BAD_INPUTS])
def test_bad_input_raises_a_clear_value_error(call, match):
  with pytest.raises(ValueError, match=match):
    call()


def test_what_is_now_accepted():
  # channelwise_axes as one int, numpy integer tile sizes, zero-volume grouped memory.
  x = np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)
  one = gmm_jax.quantize(x, jnp.int8, channelwise_axes=0)
  seq = gmm_jax.quantize(x, jnp.int8, channelwise_axes=(0,))
  np.testing.assert_array_equal(one.scale, seq.scale)
  assert gmm_jax.QuantSpec(jnp.int8, channelwise_axes=1).channelwise_axes == (1,)
  tiling = gmm_jax.Tiling(np.int64(128), np.int32(64), 32)
  assert tiling == gmm_jax.Tiling(128, 64, 32) and type(tiling.tile_m) is int
  desc = gmm_jax.grouped_desc((0, 16), jnp.float32, 0, 2)
  assert desc.size(0) == 0 and desc.size(1) == 8
  # numpy booleans are bools.
  gmm_jax.gmm(LHS, RHS, SIZES, transpose_lhs=np.bool_(False))


def test_integer_preferred_type_for_integer_and_quantized_operands_is_allowed():
  ints = gmm_jax.gmm(LHS.astype(jnp.int8), RHS.astype(jnp.int8), SIZES,
                     preferred_element_type=jnp.int32)
  assert ints.dtype == jnp.int32
  q = gmm_jax.quantize(np.asarray(RHS), jnp.int8, channelwise_axes=(0, 2))
  requantized = gmm_jax.gmm(LHS, q, SIZES, preferred_element_type=jnp.int8)
  assert requantized.dtype == jnp.int8


def test_ascend_sparse_expert_index_out_of_range():
  x = np.ones((12, K), np.float32)
  w = np.ones((3, K, N), np.float32)
  for bad in ([[1, 4], [3, 2], [0, 0]], [[-1, 4], [0, 0], [0, 0]]):
    with pytest.raises(ValueError, match=r"expert indices must lie in \[0, 3\)"):
      ascend.grouped_matmul(x, w, group_list=np.asarray(bad), group_list_type=2, split_item=2,
                            group_type=0)
  # An index past the first empty entry is never used (Ascend stops there): accepted.
  (y,) = ascend.grouped_matmul(x, w, group_list=np.asarray([[1, 4], [0, 0], [9, 2]]),
                               group_list_type=2, split_item=2, group_type=0)
  assert y.shape == (12, N)


def test_ascend_antiquant_scale_with_the_wrong_expert_count():
  x = jnp.ones((12, K), jnp.bfloat16)
  w = jnp.ones((2, K, N), jnp.int8)
  with pytest.raises(ValueError, match=r"antiquant_scale \[1, 4\] holds 1 experts, the "
                                       r"weight \[2, 6, 4\] 2"):
    ascend.grouped_matmul(x, w, antiquant_scale=jnp.ones((1, N), jnp.bfloat16),
                          group_list=np.asarray([6, 12]), split_item=3, group_type=0)


def test_onednn_negative_and_zero_dims_rejected():
  with pytest.raises(ValueError, match=r"positive ints.*, got \(-2, 4\)"):
    onednn.memory_desc_grouped((-2, 4), "f32", 0, 2)
  with pytest.raises(ValueError, match=r"total size 0.*, got \(0, 4\)"):
    onednn.memory_desc_grouped((0, 4), "f32", 0, 2)


def test_traced_inputs_skip_the_value_checks_but_keep_the_type_checks():
  # A traced num_groups is not possible (it is static); a traced group list skips the
  # value checks and gets the defined clamped result instead (see test_op.py).
  out = jax.jit(lambda gl: gmm_jax.gmm(LHS, RHS, gl))(jnp.asarray([9, -5], jnp.int32))
  np.testing.assert_array_equal(out[:M], np.full((M, N), float(K)))
  with pytest.raises(ValueError, match="transpose_lhs must be a bool"):
    jax.jit(lambda gl: gmm_jax.gmm(LHS, RHS, gl, transpose_lhs="no"))(jnp.asarray(SIZES))
