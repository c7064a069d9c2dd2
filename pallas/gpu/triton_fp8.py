"""fp8 tensor-core dots for the Pallas Triton kernels: the `fp8_dot` primitive and its lowering.

Two 8-bit float tiles multiply through `fp8_dot`, whose Triton lowering lets Triton pick
Hopper's fp8 wgmma (``wgmma ... .f32.e4m3.e4m3``, and ``.e4m3.e5m2`` / ``.e5m2.e4m3`` for the
mixed pairs): Pallas's own dot would upcast to f16 and refuse mixed types. The kernel bodies
(`triton_kernel`) use it; windows of at most 32 rows (the smallest row classes) run
Triton's warp-level MMA on f16 values instead: wgmma needs 64 rows.
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.extend as jex
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.interpreters import mlir

from gmm_jax._src.core import jax_private

# Pallas Triton's dot_general (jax 0.10 to 0.12) emits Triton's dot without
# ``maxNumImpreciseAcc``, and Triton then refuses Hopper's fp8 wgmma for an f32 accumulator
# ("MMA version 3 acceleration not applied") and upcasts both tiles to f16 for
# ``mma.sync ... f16.f16`` (the f16 tensor-core rate); it also refuses two different 8-bit
# floats. `fp8_dot` is our own primitive whose Triton lowering passes
# ``maxNumImpreciseAcc`` = the tile's K: Triton then emits ``wgmma ... .f32.e4m3.e4m3`` (or
# ``.e4m3.e5m2``, ``.e5m2.e4m3``: wgmma takes the two 8-bit types independently) and
# promotes each K tile's tensor-core sum into an f32 register accumulator (the sums inside
# one tile keep the tensor core's fp8 accumulation precision; DeepSeek-V3's recipe
# promotes every 128 as well). In interpret mode (and anywhere else) it is an f32 dot of
# the exactly converted values.
_FP8 = (np.dtype(jnp.float8_e4m3fn), np.dtype(jnp.float8_e5m2))
FP8_MMA_K = 32  # the K of one fp8 wgmma; smaller K tiles multiply as the dot dtype


def fp8_pair(lhs_dtype, rhs_dtype) -> bool:
  """Whether both dtypes are 8-bit floats (e4m3 or e5m2, in either order)."""
  return np.dtype(lhs_dtype) in _FP8 and np.dtype(rhs_dtype) in _FP8


def _fp8_dot_reference(lhs, rhs, *, contract):
  dims = (((contract[0],), (contract[1],)), ((), ()))
  return lax.dot_general(lhs.astype(jnp.float32), rhs.astype(jnp.float32), dims,
                         precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32)


def _fp8_dot_shape(lhs, rhs, *, contract):
  if not fp8_pair(lhs.dtype, rhs.dtype) or lhs.ndim != 2 or rhs.ndim != 2:
    raise ValueError(f"fp8_dot takes two 2-D 8-bit float tiles, got {lhs} and {rhs}")
  if lhs.shape[contract[0]] != rhs.shape[contract[1]]:
    raise ValueError(f"fp8_dot: contracted sizes differ: {lhs.shape} and {rhs.shape}")
  return jax.core.ShapedArray((lhs.shape[1 - contract[0]], rhs.shape[1 - contract[1]]),
                              jnp.float32)


fp8_dot_p = jex.core.Primitive("gmm_fp8_dot")
fp8_dot_p.def_impl(_fp8_dot_reference)
fp8_dot_p.def_abstract_eval(_fp8_dot_shape)
mlir.register_lowering(fp8_dot_p, mlir.lower_fun(_fp8_dot_reference, multiple_results=False))


def fp8_dot(lhs, rhs, contract: tuple[int, int]) -> jax.Array:
  """f32 ``lhs @ rhs`` of two 8-bit float tiles (each its own type), contracting dimension
  ``contract[0]`` of lhs with ``contract[1]`` of rhs (0 or 1: a tile as stored, no
  transpose materialized)."""
  return fp8_dot_p.bind(lhs, rhs, contract=tuple(int(c) for c in contract))


def _fp8_dot_triton(triton_lowering, ctx, lhs, rhs, *, contract):
  del ctx
  tt, ir = triton_lowering.tt_dialect, triton_lowering.ir
  if contract[0] == 0:
    lhs = tt.trans(lhs, (1, 0))
  if contract[1] == 1:
    rhs = tt.trans(rhs, (1, 0))
  m, k = ir.RankedTensorType(lhs.type).shape
  n = ir.RankedTensorType(rhs.type).shape[1]
  acc = triton_lowering._zeros(ir.RankedTensorType.get([m, n], ir.F32Type.get()))
  # Triton's MMA v3 takes fp8 with an f32 accumulator from 32 (one fp8 wgmma's K) up.
  return tt.dot(lhs, rhs, acc, max_num_imprecise_acc=max(FP8_MMA_K, int(k)))


def _register_fp8_mma() -> bool:
  """Adds `fp8_dot`'s rule to Pallas Triton's lowering table (a private jax module, the
  same on jax 0.10 to 0.12); False, with a warning, where this jax has none (the kernels
  then multiply fp8 tiles with Pallas's own dot: f16 MMA, exact, at the f16 rate)."""
  try:
    triton_lowering = jax_private.triton_lowering_module()
  except jax_private.MissingJaxInternal as err:
    warnings.warn(f"gmm_jax: {err}; the Triton kernels multiply fp8 tiles with f16 MMA",
                  RuntimeWarning, stacklevel=2)
    return False
  triton_lowering.triton_lowering_rules[fp8_dot_p] = functools.partial(_fp8_dot_triton,
                                                                      triton_lowering)
  return True


# Whether the compiled kernels multiply 8-bit floats with fp8 MMA (`fp8_dot`).
FP8_MMA = _register_fp8_mma()
