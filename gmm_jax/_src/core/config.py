"""Static options of one gmm call, shared by the dispatcher, the backends and the op.

Floor 0: imports nothing from gmm_jax.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Literal, Union, get_args

import jax.numpy as jnp
import numpy as np

GroupType = Literal["m", "k"]
Platform = Literal["cpu", "gpu", "tpu"]
GROUP_TYPES: tuple[str, ...] = get_args(GroupType)
PLATFORMS: tuple[str, ...] = get_args(Platform)
Activation = Union[str, Callable[[Any], Any], None]
# Gated activations: the rhs holds 2N columns, the gate half ``[:N]`` then the up half
# ``[N:]``, and ``act(z[:, :N]) * z[:, N:]`` gives N output columns (the functions live in
# `epilogue.GATED_ACTIVATIONS`, whose names must be these).
GATED_ACTIVATIONS: tuple[str, ...] = ("swiglu", "geglu", "geglu_tanh", "swiglu_clamped")


def is_gated(activation) -> bool:
  """Whether `activation` names a gated activation (2N pre-activation columns -> N)."""
  return isinstance(activation, str) and activation in GATED_ACTIVATIONS

# Tile sizes index int32 arrays inside the kernels.
_MAX_TILE = 2**31 - 1


@dataclasses.dataclass(frozen=True)
class Tiling:
  """Tile sizes, with the same field names on every backend.

  tile_m: rows of lhs per work item (m-grouping); tile_k: contraction elements per work item
  (the grouped dim of k-grouping, or the K step of a kernel); tile_n: output columns per
  block (kernels; the XLA path takes all of N at once). Python or numpy integers in
  ``[1, 2**31)``.
  """

  tile_m: int = 256
  tile_k: int = 512
  tile_n: int = 512

  def __post_init__(self):
    for name in ("tile_m", "tile_k", "tile_n"):
      value = getattr(self, name)
      if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise ValueError(f"Tiling.{name} must be a positive int, got {value!r}")
      if not 0 < value <= _MAX_TILE:
        raise ValueError(f"Tiling.{name} must lie in [1, 2**31), got {int(value)}")
      object.__setattr__(self, name, int(value))


@dataclasses.dataclass(frozen=True)
class Tilings:
  """Separate tilings for the three gmms of a training step.

  fwd: the forward gmm; dlhs: the gmm computing the gradient of lhs; drhs: the gmm computing
  the gradient of rhs (the weight gradient: a k-grouped gmm when the forward is m-grouped).
  Each is a `Tiling`, a callable ``Problem -> Tiling | None``, or None (the tuned or built-in
  choice).
  """

  fwd: Any = None
  dlhs: Any = None
  drhs: Any = None

  def __post_init__(self):
    for name in ("fwd", "dlhs", "drhs"):
      value = getattr(self, name)
      if value is not None and not isinstance(value, Tiling) and not callable(value):
        raise ValueError(
            f"Tilings.{name} must be a Tiling, a callable Problem -> Tiling or None, got "
            f"{value!r}")


@dataclasses.dataclass(frozen=True)
class Problem:
  """What a tiling is chosen for: one gmm as one implementation runs it.

  A ``tiling=`` callable receives this and returns a `Tiling` (or None for the default
  choice); `gmm_jax.autotune` and the built-in tile tables are keyed by it.

  Fields:
    implementation: the registered implementation that runs it ("pallas_triton", ...).
    platform: "cpu", "gpu" or "tpu".
    device_kind: the target device's kind ("NVIDIA H200", "TPU v5 lite", "cpu"), None when
      unknown.
    group_type, m, k, n: the canonical call (see `GmmConfig`).
    num_groups: G, the groups of the group list; num_local: groups held locally.
    lhs_dtype, rhs_dtype: the stored operand dtypes (quantized values for a QArray).
    out_dtype: the result's dtype.
    quant_mode: "none", "weight_only", "scaled", ...
    transpose_lhs, transpose_rhs: the stored layouts.
  """

  implementation: str
  platform: str | None
  device_kind: str | None
  group_type: str
  m: int
  k: int
  n: int
  num_groups: int
  num_local: int
  lhs_dtype: np.dtype
  rhs_dtype: np.dtype
  out_dtype: np.dtype
  quant_mode: str = "none"
  transpose_lhs: bool = False
  transpose_rhs: bool = False


@dataclasses.dataclass(frozen=True)
class GmmConfig:
  """Everything about a gmm call that is static under jit (hashable: it is a parameter of
  the gmm primitive).

  Below the public API every layer receives canonical operands ``(lhs, rhs, counts,
  group_offset, bias, cfg)``: counts are int32 ``[G]`` global group sizes, each within
  the grouped dimension, cut where their running sum passes it (see
  `group_list.fitted_counts`), group_offset an int32 scalar (the first
  global group held in ``rhs``/the output), bias None or ``[num_local, N]``.

  Fields:
    group_type: "m" (rows of lhs grouped) or "k" (the contraction dim grouped).
    num_local: groups held locally (rhs.shape[0] for "m", the output's dim 0 for "k").
    transpose_lhs: lhs is stored ``[K, M]``.
    transpose_rhs: rhs is stored ``[..., N, K]``.
    activation: None, a name of `ACTIVATIONS` or a callable, applied after the bias.
    out_dtype: dtype of the result.
    precision: passed to the dots (a canonical `jax.lax.Precision`, pair or algorithm).
    implementation: None (the platform's chain) or the names to try, in order.
    interpret: False (compiled kernels), True (Pallas's plain interpret mode), or the
      parameters of one of jax's simulators (`pltpu.InterpretParams`,
      `plgpu.InterpretGPUParams`): the kernel of that family runs under the simulator
      (the primitive then declares the simulator's effects; see `op.primitive`).
    tiling: None (tuned cache, built-in tile table, else the backend's heuristic), a `Tiling`,
      a callable ``Problem -> Tiling | None``, or `Tilings` (per gmm of a training step;
      the op hands each backward gmm its entry).
    platform: None (the platform the call is lowered for) or a platform whose chain to use.
    gather_rows: None, or R when an int32 ``[R]`` lhs_indices operand is present. m-grouping:
      row r of the grouped problem reads ``lhs[lhs_indices[r]]`` (lhs ``[T, K]`` for any T;
      the group list covers the R rows; an out-of-range index reads a zero row).
      k-grouping (the weight gradient of a gathered gmm; transpose_lhs, lhs stored
      ``[T, M]``): row r of the grouped dimension (K = R) of the stored lhs is
      ``lhs[lhs_indices[r]]``.
    row_weights: m-grouping: an f32-able ``[R]`` row_weights operand is present: row r of
      the result is multiplied by it after the activation, in f32 before the cast.
    out_rows: m-grouping: None, or the rows of the result when an int32 ``[R]``
      out_indices operand is present: row r is written to output row ``out_indices[r]``
      (written indices unique; out-of-range ones write nothing); unwritten rows are 0.
    deterministic: True (the default): bitwise identical results run to run on every
      implementation (split-K partial sums go to a buffer summed in a fixed order). False
      lets an implementation use atomics where they are faster (Triton's split-K).
    lhs_activation: m-grouping: None, or a gated activation (of `GATED_ACTIVATIONS`)
      applied to lhs before the product (a gated prologue): lhs ``[M, 2K]`` holds a
      pre-activation z, gate half then up half, and the product reads
      ``act(z)`` ``[M, K]`` (in f32, rounded to lhs's dtype). Not with transpose_lhs,
      gathered rows or a quantized lhs.
    lhs_tangent: with lhs_activation: lhs ``[M, 2K]`` is a tangent t of the pre-activation
      z, which a ``source`` row operand ``[M, 2K]`` holds; the product reads the tangent
      of the activation, ``op.gated_tangent.gated_tangent(z, t)`` (rounded to lhs's
      dtype). Linear in lhs: the op's jvp binds it, its transpose is a `cotangent_of` gmm.
    cotangent_of: m-grouping: None, or a gated activation: a ``source`` row operand z
      ``[M, 2N]`` is present and the result ``[M, 2N]`` is the cotangent of z for the
      product ``[M, N]`` (rounded to out_dtype, row weights applied) as the cotangent of
      ``act(z)``: ``epilogue.gated_cotangent(z, product)``. The transpose of an
      `lhs_tangent` gmm: the input gradient of a gated prologue, written by the dlhs gmm.
    quantize_prologue: with lhs_activation (its value) and a QArray rhs in blocks along
      K: None, or ``(dtype, block, scale_dtype)``: act(z) is quantized in 1 x `block`
      blocks along K to the 8-bit float `dtype` (absmax scales as
      `qarray.quantize` computes them; `scale_dtype` None for f32, or float8_e8m0fnu)
      before the "blocked" product: fp8 training's forward through a gated prologue.
  """

  group_type: GroupType
  num_local: int
  transpose_lhs: bool = False
  transpose_rhs: bool = False
  activation: Activation = None
  out_dtype: np.dtype = np.dtype(np.float32)
  precision: Any = None
  implementation: tuple[str, ...] | None = None
  interpret: Any = False
  tiling: Any = None
  platform: Platform | None = None
  gather_rows: int | None = None
  row_weights: bool = False
  out_rows: int | None = None
  deterministic: bool = True
  lhs_activation: str | None = None
  lhs_tangent: bool = False
  cotangent_of: str | None = None
  quantize_prologue: tuple | None = None

  def __post_init__(self):
    implementation = self.implementation
    if implementation == "auto":
      implementation = None
    elif isinstance(implementation, str):
      implementation = (implementation,)
    elif implementation is not None:
      implementation = tuple(implementation)
    object.__setattr__(self, "implementation", implementation)
    object.__setattr__(self, "out_dtype", np.dtype(self.out_dtype))

  def replace(self, **changes) -> "GmmConfig":
    return dataclasses.replace(self, **changes)

  @property
  def gated(self) -> bool:
    return is_gated(self.activation)

  @property
  def has_source(self) -> bool:
    """Whether a ``source`` row operand (a gated pre-activation z) is present: a tangent of
    a gated prologue (`lhs_tangent`) or a gated-cotangent epilogue (`cotangent_of`)."""
    return self.lhs_tangent or self.cotangent_of is not None

  @property
  def has_rows(self) -> bool:
    """Whether the call gathers, weights or scatters rows or reads a source (see
    `epilogue.Rows`)."""
    return (self.gather_rows is not None or self.row_weights or self.out_rows is not None
            or self.has_source)

  def without_rows(self) -> "GmmConfig":
    return dataclasses.replace(self, gather_rows=None, row_weights=False, out_rows=None,
                               lhs_tangent=False, cotangent_of=None,
                               lhs_activation=None if self.lhs_tangent
                               else self.lhs_activation)

  def without_gated_operands(self) -> "GmmConfig":
    """The plain product of this call: no gated prologue, tangent or cotangent epilogue."""
    return dataclasses.replace(self, lhs_activation=None, lhs_tangent=False,
                               cotangent_of=None)


def accumulator_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
  """f32 for floating inputs (f64 if either is f64), int32 for integer inputs."""
  if jnp.issubdtype(lhs_dtype, jnp.integer) and jnp.issubdtype(rhs_dtype, jnp.integer):
    return np.dtype(jnp.int32)
  if np.dtype(lhs_dtype) == np.float64 or np.dtype(rhs_dtype) == np.float64:
    return np.dtype(np.float64)
  return np.dtype(jnp.float32)


def preactivation_dtype(lhs_dtype, rhs_dtype) -> np.dtype:
  """The dtype an activation is applied in: the accumulator's, f32 for integer inputs."""
  acc = accumulator_dtype(lhs_dtype, rhs_dtype)
  return acc if jnp.issubdtype(acc, jnp.floating) else np.dtype(np.float32)


def saved_preactivation_dtype(lhs_dtype, rhs_dtype, out_dtype) -> np.dtype:
  """The dtype of the pre-activation that a differentiated gmm with an activation keeps for
  its backward: a 16-bit float output's dtype (as an unfused 16-bit layer keeps its
  projections: half the bytes, and the backward's products stay 16-bit), else
  `preactivation_dtype`. The activation itself is applied in f32 either way."""
  out_dtype = np.dtype(out_dtype)
  if jnp.issubdtype(out_dtype, jnp.floating) and out_dtype.itemsize == 2:
    return out_dtype
  return preactivation_dtype(lhs_dtype, rhs_dtype)


def problem_dims(lhs_shape, rhs_shape, cfg: GmmConfig) -> tuple[int, int, int]:
  """(M, K, N) of a validated call: M the grouped problem's rows (R with gathered rows), K
  the product's contraction (half lhs's columns with a gated prologue), N the product's
  columns (2N' for a gated activation)."""
  m, k = (lhs_shape[1], lhs_shape[0]) if cfg.transpose_lhs else tuple(lhs_shape)
  if cfg.lhs_activation is not None:
    k //= 2
  if cfg.gather_rows is not None and cfg.group_type == "m":
    m = cfg.gather_rows
  elif cfg.gather_rows is not None:
    k = cfg.gather_rows
  n = rhs_shape[-2] if cfg.transpose_rhs else rhs_shape[-1]
  return m, k, n


def out_columns(n: int, cfg: GmmConfig) -> int:
  """The result's columns for a product of `n` columns (half of them when gated, twice
  them for a gated-cotangent epilogue)."""
  if cfg.cotangent_of is not None:
    return 2 * n
  return n // 2 if cfg.gated else n


def output_shape(lhs_shape, rhs_shape, cfg: GmmConfig) -> tuple[int, ...]:
  """``[M, N]`` for m-grouping (``[out_rows, N]`` when rows are scattered),
  ``[num_local, M, N]`` for k-grouping; N halved by a gated activation."""
  m, _, n = problem_dims(lhs_shape, rhs_shape, cfg)
  n = out_columns(n, cfg)
  if cfg.group_type == "m":
    return (m if cfg.out_rows is None else cfg.out_rows, n)
  return (cfg.num_local, m, n)
