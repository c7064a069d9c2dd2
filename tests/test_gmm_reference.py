"""The shared gmm suite on the reference implementation (the one the others are checked
against must itself match the numpy oracle)."""

from gmm_test_base import GmmTestBase


class TestReference(GmmTestBase):
  IMPLEMENTATION = "reference"
  # The reference is one masked dense product per group, then the shared epilogue; the
  # default run holds its group lists, layouts, epilogues, offsets, edge shapes and
  # gradients to numpy.
  # These repeat that per dtype, under jit, or at random shapes: -m slow only (the XLA and
  # kernel suites run them by default; test_op.py differentiates the reference to 2nd order).
  SLOW_TESTS = (
      "test_random_problems", "test_16bit_small_and_large_groups", "test_dtypes",
      "test_bf16_accumulates_in_f32", "test_int8_to_int32_is_exact",
      "test_activation_without_bias", "test_traced_group_offset_under_jit",
      "test_traced_group_list_compiles_once", "test_deterministic",
      "test_vjp_group_offset_under_jit", "test_check_grads",
  )
