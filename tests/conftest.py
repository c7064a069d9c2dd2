"""Shared pytest setup for the gmm_jax tests.

* A deterministic hypothesis profile ("gmm", loaded by default): the same examples on every
  run, no deadline (the first call of a shape compiles), few examples so the whole suite stays
  fast on a 2-core CPU. ``HYPOTHESIS_PROFILE=<name>`` selects another registered profile
  (e.g. "gmm-thorough" for a longer, still deterministic run).
* 64-bit mode stays off: the library is tested with the dtypes users run (int32 group lists,
  f32/bf16/f16 operands); the float64 oracle is numpy's, not jax's.
* 8 host CPU devices (`jax_num_cpu_devices`, set before jax starts its backend) for the
  sharding tests; every other test runs on the first one as usual.
* jax's persistent compilation cache, shared by the two xdist workers and kept between runs
  in ``~/.cache/gmm_jax/jax-<version>-compilation-cache`` (``$XDG_CACHE_HOME`` if set):
  the suite compiles thousands of small programs, many of them more than once (the caches
  are cleared per module). Measured on tests/test_rows.py, test_op.py and test_sharding.py
  (2 workers, 2-core CPU, jax 0.10.2): 314 s without, 283 s with an empty cache, 100 s with
  a warm one. The key is the program and the compile options, so a changed gmm_jax compiles
  anew. ``JAX_COMPILATION_CACHE_DIR`` picks another directory; ``GMM_JAX_TEST_CACHE=0``
  turns it off.
* XLA:CPU compiles with its LLVM backend at ``-O0`` (``--xla_backend_optimization_level=0``
  appended to ``XLA_FLAGS`` unless it names a level; not where the CUDA plugin or libtpu
  is installed, so that deviceless compiles for GPU and TPU chips are a real build's): the
  suite's programs are small and run once or twice, so compiling them is most of its time.
  The HLO passes (fusion, the order of every sum) are the same, and without fast math LLVM
  reorders no float arithmetic at any level, so the results are too. Measured on
  tests/test_rows.py and test_op.py with an empty cache (2 workers, 2-core CPU, jax
  0.10.2): 102 s at the default level, 78 s at -O0.
* The tests directory and the repository root are importable (`oracle`, `gmm_test_base`,
  and `gmm_jax` from an uninstalled checkout).
"""

from __future__ import annotations

import importlib.util
import os
import sys

_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
_COMPILES_FOR_CHIPS = any(importlib.util.find_spec(name) is not None
                          for name in ("jax_plugins", "libtpu"))
if not _COMPILES_FOR_CHIPS and "--xla_backend_optimization_level" not in _XLA_FLAGS:
  os.environ["XLA_FLAGS"] = f"{_XLA_FLAGS} --xla_backend_optimization_level=0".strip()

import hypothesis  # noqa: E402
import jax  # noqa: E402
import pytest  # noqa: E402

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

if os.environ.get("GMM_JAX_TEST_CACHE", "1") != "0":
  if not os.environ.get("JAX_COMPILATION_CACHE_DIR"):
    _cache_home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"),
                                                                   ".cache")
    jax.config.update("jax_compilation_cache_dir", os.path.join(
        _cache_home, "gmm_jax", f"jax-{jax.__version__}-compilation-cache"))
  # Every program, however small or quick to compile (the defaults keep only those over 1 s).
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)

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
