"""Static options of one gmm call, shared by the dispatcher, the backends and the VJP."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class GmmConfig:
  """Everything about a gmm call that is static under jit.

  Backends receive canonical operands ``(lhs, rhs, counts, group_offset, bias)``: counts are
  int32 ``[G]`` global group sizes, group_offset an int32 scalar (the first global group held
  in ``rhs``/the output), bias None or ``[num_local, N]``.

  Fields:
    group_type: "m" (rows of lhs grouped) or "k" (the contraction dim grouped).
    num_local: groups held locally (rhs.shape[0] for "m", the output's dim 0 for "k").
    transpose_lhs: lhs is stored ``[K, M]``.
    transpose_rhs: rhs is stored ``[..., N, K]``.
    activation: None, a name or a callable, applied after the bias.
    out_dtype: dtype of the result.
    precision: passed to the dots.
    implementation: a registered name, or None for the platform's chain.
    interpret: run Pallas kernels in interpret mode.
    tiling: a `Tiling` that overrides the backend's heuristic, or None.
  """

  group_type: str
  num_local: int
  transpose_lhs: bool = False
  transpose_rhs: bool = False
  activation: Any = None
  out_dtype: Any = jnp.float32
  precision: Any = None
  implementation: str | None = None
  interpret: bool = False
  tiling: Any = None

  def replace(self, **changes) -> "GmmConfig":
    return dataclasses.replace(self, **changes)


def accumulator_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
  """f32 for floating inputs (f64 if either is f64), int32 for integer inputs."""
  if jnp.issubdtype(lhs_dtype, jnp.integer) and jnp.issubdtype(rhs_dtype, jnp.integer):
    return np.dtype(jnp.int32)
  if np.dtype(lhs_dtype) == np.float64 or np.dtype(rhs_dtype) == np.float64:
    return np.dtype(np.float64)
  return np.dtype(jnp.float32)


def problem_dims(lhs_shape, rhs_shape, cfg: GmmConfig) -> tuple[int, int, int]:
  """(M, K, N) of a validated call."""
  m, k = (lhs_shape[1], lhs_shape[0]) if cfg.transpose_lhs else lhs_shape
  n = rhs_shape[-2] if cfg.transpose_rhs else rhs_shape[-1]
  return m, k, n


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile sizes, with the same field names on every backend.

  tile_m: rows of lhs per work item (m-grouping); tile_k: contraction elements per work item
  (the grouped dim of k-grouping, or the K step of a kernel); tile_n: output columns per
  block (kernels; the XLA path takes all of N at once).
  """

  tile_m: int = 256
  tile_k: int = 512
  tile_n: int = 512

  def __post_init__(self):
    for name in ("tile_m", "tile_k", "tile_n"):
      value = getattr(self, name)
      if not isinstance(value, int) or value <= 0:
        raise ValueError(f"Tiling.{name} must be a positive int, got {value!r}")
