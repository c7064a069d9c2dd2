"""Shared pytest setup for the gmm_jax tests.

* A deterministic hypothesis profile ("gmm", loaded by default): the same examples on every
  run, no deadline (the first call of a shape compiles), few examples so the whole suite stays
  fast on a 2-core CPU. ``HYPOTHESIS_PROFILE=<name>`` selects another registered profile
  (e.g. "gmm-thorough" for a longer, still deterministic run).
* 64-bit mode stays off: the library is tested with the dtypes users run (int32 group lists,
  f32/bf16/f16 operands); the float64 oracle is numpy's, not jax's.
* 8 host CPU devices (`jax_num_cpu_devices`, set before jax starts its backend) for the
  sharding tests; every other test runs on the first one as usual.
* The tests directory and the repository root are importable (`oracle`, `gmm_test_base`,
  and `gmm_jax` from an uninstalled checkout).
"""

from __future__ import annotations

import os
import sys

import hypothesis
import jax
import pytest

_TESTS_DIR = os.path.dirname(os.path.abspath(__file__))
_REPO_ROOT = os.path.dirname(_TESTS_DIR)
if _TESTS_DIR not in sys.path:  # e.g. under --import-mode=importlib
  sys.path.insert(0, _TESTS_DIR)
try:
  import gmm_jax  # noqa: F401
except ImportError:  # an uninstalled checkout: test the working tree
  sys.path.insert(0, _REPO_ROOT)

jax.config.update("jax_enable_x64", False)
jax.config.update("jax_num_cpu_devices", 8)

hypothesis.settings.register_profile(
    "gmm",
    derandomize=True,
    deadline=None,
    max_examples=25,
    print_blob=True,
    suppress_health_check=[hypothesis.HealthCheck.too_slow],
)
hypothesis.settings.register_profile(
    "gmm-thorough",
    parent=hypothesis.settings.get_profile("gmm"),
    max_examples=300,
)
hypothesis.settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gmm"))


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects
def pytest_collection_modifyitems(items):
  # A GmmTestBase subclass may name shared tests (SLOW_TESTS) that, for its implementation,
  # repeat what its default-run tests already check: those run with `-m slow` only.
  for item in items:
    if getattr(item, "originalname", None) in getattr(item.cls, "SLOW_TESTS", ()):
      item.add_marker(pytest.mark.slow)


@pytest.fixture(autouse=True)
def _no_x64():
  # A test that flips x64 on would silently change the dtypes every later test sees.
  assert not jax.config.jax_enable_x64, "jax_enable_x64 must stay off in the gmm_jax tests"
  yield
  assert not jax.config.jax_enable_x64, "a test left jax_enable_x64 on"


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_executables():
  # The suite compiles thousands of programs; dropping jax's caches after each test module
  # keeps the process small (measured: a run of five modules without it reached 3.3 GB; the
  # whole suite with it peaks at 2.0 GB), at the price of some recompilation.
  yield
  jax.clear_caches()
