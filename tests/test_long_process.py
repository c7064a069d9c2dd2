"""A long process stays under the kernel's memory-map limit: what one compiled gmm costs.

XLA:CPU loads every kernel of a compiled program as an object file of its own, and each
object takes about three memory mappings (code, read-only data, data) for as long as the
executable lives, i.e. while jax's caches hold it. Linux refuses new mappings past
``vm.max_map_count`` (65,530 by default), and XLA:CPU's compile then aborts or segfaults
(docs/testing.md, "Long processes"). These tests pin down what gmm_jax controls: the kernels
and mappings one compiled gmm program adds, and that ``jax.clear_caches()`` gives them back
(what tests/conftest.py does after every module, and what a long-running user can do).

Measured (2026-12-07, jax 0.10.2 and 0.12.1, 8 groups, M=300: all 8 size classes of the
XLA path's loops): 64 kernel objects and ~190 mappings per m-grouped forward program, 87-88
objects and ~257 mappings for the gradient of both operands; ``jax.lax.ragged_dot`` 3 and
~8. The bounds below leave ~15% room for changes to the XLA path; a program that needs
more kernels should say why (docs/testing.md).
"""

from __future__ import annotations

import gc
import os
import pathlib
import sys

import jax
import jax.numpy as jnp
import pytest

import gmm_jax

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or jax.default_backend() != "cpu",
    reason="counts XLA:CPU's mappings in /proc/self/maps")

G, K, N = 8, 64, 128
M = 300  # >= tile_m (256): every size class of the XLA path gets its loop
SIZES = [40, 0, 50, 20, 60, 0, 30, 10]
# Kernel objects per compiled program (measured 64 and 87-88, see the docstring).
MAX_OBJECTS = {"forward": 74, "grad": 100}
# Mappings per object: code, read-only data and data (measured 2.9-3.0 with jax 0.10.2 and
# 0.12.1; neighbours of the same permissions sometimes merge).
MAPS_PER_OBJECT = 3.2


def _maps() -> int:
  with open("/proc/self/maps") as f:
    return sum(1 for _ in f)


def _args(m):
  lhs = jax.ShapeDtypeStruct((m, K), jnp.float32)
  rhs = jax.ShapeDtypeStruct((G, K, N), jnp.float32)
  return lhs, rhs, jax.ShapeDtypeStruct((G,), jnp.int32)


def _forward(lhs, rhs, sizes):
  return gmm_jax.gmm(lhs, rhs, sizes)


def _grad(lhs, rhs, sizes):
  return jax.grad(lambda a, b: gmm_jax.gmm(a, b, sizes).sum(), (0, 1))(lhs, rhs)


PROGRAMS = {"forward": _forward, "grad": _grad}


@pytest.fixture
def no_persistent_cache():
  # A program loaded from the persistent cache is not compiled, so nothing is dumped.
  saved = jax.config.jax_enable_compilation_cache
  jax.config.update("jax_enable_compilation_cache", False)
  yield
  jax.config.update("jax_enable_compilation_cache", saved)


@pytest.mark.parametrize("kind", sorted(PROGRAMS))
def test_kernel_objects_per_compiled_program(kind, tmp_path, no_persistent_cache):
  # XLA:CPU writes one object file per kernel it loads; --xla_dump_to shows them.
  fn = jax.jit(PROGRAMS[kind])
  fn.lower(*_args(M)).compile(compiler_options={"xla_dump_to": str(tmp_path)})
  pattern = f"*.jit_{PROGRAMS[kind].__name__}.*.o"  # this program's, not another compile's
  objects = sorted(path.name for path in pathlib.Path(tmp_path).glob(pattern))
  if not objects:  # an XLA:CPU that dumps no object files: the maps test still counts
    pytest.skip(f"XLA:CPU dumped no object files: {sorted(os.listdir(tmp_path))[:5]}")
  assert len(objects) <= MAX_OBJECTS[kind], (
      f"a compiled gmm {kind} program loads {len(objects)} kernel objects (bound "
      f"{MAX_OBJECTS[kind]}), each ~3 memory maps while the program lives; kernels: {objects}")


def test_mappings_per_program_and_clear_caches_returns_them():
  fn = jax.jit(_forward)
  fn.lower(*_args(M - 1)).compile()  # the first compile starts XLA's threads
  x = jnp.ones((M - 2, K), jnp.float32)
  w = jnp.ones((G, K, N), jnp.float32)
  sizes = jnp.asarray(SIZES, jnp.int32)
  jax.block_until_ready(gmm_jax.gmm(x, w, sizes))  # and the eager path's
  gc.collect()
  start = _maps()

  # Distinct programs, held: AOT-compiled ones by this list, jitted and eager ones
  # (gmm_jax compiles an eager call's program once per signature) by jax's caches.
  held = [fn.lower(*_args(M + i)).compile() for i in range(2)]
  jax.block_until_ready(jax.jit(_forward)(jnp.ones((M + 2, K)), w, sizes))
  jax.block_until_ready(gmm_jax.gmm(jnp.ones((M + 3, K)), w, sizes))
  added = _maps() - start
  per_program = added / 4
  bound = MAX_OBJECTS["forward"] * MAPS_PER_OBJECT
  assert per_program <= bound, (
      f"{per_program:.0f} memory maps per compiled gmm forward program (bound {bound:.0f}): "
      f"vm.max_map_count (65,530) allows ~{65_000 / per_program:.0f} such programs")
  assert per_program > 20, f"only {per_program:.1f} maps per program: nothing measured?"

  del held
  jax.clear_caches()
  gc.collect()
  kept = _maps() - start
  assert kept <= 0.1 * added, (
      f"jax.clear_caches() gave back only {added - kept} of the {added} maps of 4 programs")


def test_a_process_near_the_limit_is_warned_once(monkeypatch):
  """gmm_jax reads the map count every `CHECK_EVERY` gmm programs lowered for the CPU and
  warns once, naming the remedies, when it passes `WARN_SHARE` of the limit (here set just
  above what the process holds)."""
  from gmm_jax._src.core import host_limits
  monkeypatch.setattr(host_limits, "_state", {"lowerings": 0, "warned": False})
  held = host_limits.map_count()
  assert held is not None and held > 0
  monkeypatch.setattr(host_limits, "map_limit", lambda: int(held / host_limits.WARN_SHARE))
  fn = jax.jit(_forward)
  with pytest.warns(ResourceWarning, match="jax.clear_caches"):
    for m in range(1, host_limits.CHECK_EVERY + 1):  # distinct shapes: one lowering each
      fn.lower(*_args(m))
  assert host_limits._state["warned"]
  assert not host_limits.check()  # once per process


def test_no_warning_far_from_the_limit(monkeypatch, recwarn):
  from gmm_jax._src.core import host_limits
  monkeypatch.setattr(host_limits, "_state", {"lowerings": 0, "warned": False})
  monkeypatch.setattr(host_limits, "map_limit", lambda: 10 * host_limits.map_count())
  for _ in range(host_limits.CHECK_EVERY):
    host_limits.note_cpu_lowering()
  assert not [w for w in recwarn if issubclass(w.category, ResourceWarning)]
