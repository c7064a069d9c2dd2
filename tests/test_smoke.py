"""A short check of an installation, on any supported jax: every module imports, one gmm per
implementation (and its gradient) equals the float64 oracle, and one kernel compiles,
without the hardware, for each target whose compiler this jax has.

The default run holds it; CI also runs it alone on the jax releases the full suite does not
run on there (`.ci/run`: 0.12.1 with its CUDA 13 plugin and libtpu, 0.11.2 with the CUDA 13
plugin, 0.12.0.1 with the CUDA 12 plugin and libtpu), in a minute or two each.
"""

from __future__ import annotations

import importlib
import pkgutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gmm_jax
import lowering
import simulators
from gmm_test_base import make_operands
from oracle import f64, gmm_oracle, gmm_oracle_vjp, tolerances

pytestmark = pytest.mark.filterwarnings("ignore:The Pallas Triton backend is deprecated")
# Modules that need optional dependencies: (module prefix, the dependencies).
OPTIONAL = (("gmm_jax.nn", ("flax",)), ("gmm_jax.tools.aot_pod", ("flax",)),
            ("gmm_jax.examples", ("flax", "optax", "matplotlib")))


def _modules():
  names = ["gmm_jax"]
  for package in (gmm_jax, importlib.import_module("gmm_jax.pallas")):
    names += [info.name for info in pkgutil.walk_packages(package.__path__,
                                                          package.__name__ + ".")]
  return sorted(set(names))


@pytest.mark.parametrize("name", _modules())
def test_every_module_imports(name):
  for prefix, dependencies in OPTIONAL:
    missing = [d for d in dependencies if not lowering.has_module(d)]
    if name.startswith(prefix) and missing:
      pytest.skip(f"{name} needs {missing}, which this installation lacks")
  importlib.import_module(name)


# How each implementation runs on a CPU: compiled (XLA's), or a kernel in Pallas's plain
# interpret mode, or under one of jax's simulators.
INTERPRET = {"reference": False, "xla": False, "lax_ragged_dot": False,
             "pallas_triton": True, "pallas_tpu": "tpu", "pallas_mosaic_gpu": "gpu"}


@pytest.mark.parametrize("implementation", sorted(INTERPRET))
def test_one_gmm_per_implementation(implementation):
  assert implementation in gmm_jax.implementations(), gmm_jax.implementations()
  interpret = INTERPRET[implementation]
  dtype = jnp.float32
  if interpret == "gpu":
    if not simulators.HAS_GPU_SIMULATOR:
      pytest.skip(simulators.NO_GPU_SIMULATOR)
    interpret, dtype = simulators.gpu(), jnp.bfloat16  # the kernel takes 16-bit operands
  elif interpret == "tpu":
    interpret = simulators.tpu()
  lhs, rhs, _ = make_operands("m", m=64, k=128, n=128, num_local=3, lhs_dtype=dtype, seed=1)
  sizes = [20, 0, 30]
  ct = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)

  # The Mosaic GPU kernel serves m-grouping only: the weight gradient's k-grouped gmm is
  # XLA's.
  chain = (implementation, "xla") if implementation == "pallas_mosaic_gpu" else implementation

  def loss(lhs, rhs):
    out = gmm_jax.gmm(lhs, rhs, jnp.asarray(sizes), implementation=chain, interpret=interpret)
    return jnp.sum(out.astype(jnp.float32) * ct), out

  (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(lhs, rhs)
  np.testing.assert_allclose(f64(out), gmm_oracle(lhs, rhs, sizes, "m"),
                             **tolerances(dtype, k=128))
  want = gmm_oracle_vjp(lhs, rhs, sizes, "m", f64(jnp.asarray(ct, out.dtype)))
  for got, expected, k in zip(grads, want, (128, 64)):
    np.testing.assert_allclose(f64(got), expected, **tolerances(dtype, k=k))


# One kernel per target family: the compiler it needs, and how its launch shows in the HLO.
TARGETS = {"h200": ("gpu", ("__gpu$xla.gpu.triton", "mosaic_gpu")),
           "b200": ("gpu", ("__gpu$xla.gpu.triton", "triton")),
           "v5e": ("tpu", ("tpu_custom_call",))}


@pytest.mark.parametrize("target", sorted(TARGETS))
def test_one_kernel_compiles_per_target(target):
  family, markers = TARGETS[target]
  if family == "gpu" and not lowering.has_gpu_compiler():
    pytest.skip(f"{lowering.GPU_COMPILER} is not importable: this jax has no GPU compiler")
  if family == "tpu" and not lowering.has_module("libtpu"):
    pytest.skip("libtpu is not importable: this jax has no TPU compiler")
  from gmm_jax.tools import deviceless
  lhs, rhs, _ = make_operands("m", m=256, k=256, n=256, num_local=4, lhs_dtype=jnp.bfloat16)

  def fn(lhs, rhs, sizes):
    return gmm_jax.gmm(lhs, rhs, sizes, activation="silu")

  text = deviceless.compile_for(target, fn, (lhs, rhs, jnp.zeros(4, jnp.int32))).as_text()
  assert any(marker in text for marker in markers), (target, markers)
