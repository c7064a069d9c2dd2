"""The shared gmm suite on the compiled jax.numpy/XLA path."""

from gmm_test_base import GmmTestBase


class TestXla(GmmTestBase):
  IMPLEMENTATION = "xla"
