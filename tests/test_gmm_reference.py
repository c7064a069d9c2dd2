"""The shared gmm suite on the reference implementation (the one the others are checked
against must itself match the numpy oracle)."""

from gmm_test_base import GmmTestBase


class TestReference(GmmTestBase):
  IMPLEMENTATION = "reference"
