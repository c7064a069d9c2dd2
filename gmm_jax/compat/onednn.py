"""oneDNN's grouped memory and grouped MatMul, as a facade over gmm_jax.

Mirrors ``memory::desc::grouped``, ``memory(md, engine, {values, offsets})`` and a matmul
primitive whose src is grouped (see ``shared/spec/onednn_grouped_memory.md``):

    md = memory_desc_grouped((5000, 512), "f32", 0, 8)
    src = memory(md, (values, offsets))                  # offsets: int32 cumulative ends
    dst = matmul(src, weights)                           # weights [G, K, N] -> grouped dst

var-M (``variable_dim_idx=0``): src ``[total_M, K]`` x weights ``[G, K, N]`` (``"acb"``:
stored ``[G, N, K]``) -> a grouped dst ``[total_M, N]`` with the same offsets. var-K
(``variable_dim_idx=1``): src ``[M, total_K]`` x grouped weights ``[total_K, N]`` (same
offsets) -> dense ``[G, M, N]``; an empty K group gives zeros.

Decided semantics where oneDNN leaves memory unwritten: dst rows past the last offset are 0.
Arrays are logical JAX arrays (no strides); "column-major" idx-1 values are passed as the
logical ``[M, total_K]`` array.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gmm_jax._src.core.errors import is_index
from gmm_jax._src.core import group_list, metadata
from gmm_jax._src.api import gmm
from gmm_jax._src.core.grouped_array import GroupedDesc, grouped_desc
from gmm_jax._src.core.qarray import QArray

DATA_TYPES = {
    "f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16, "s32": jnp.int32,
    "s8": jnp.int8, "u8": jnp.uint8, "s4": jnp.int4, "u4": jnp.uint4,
    "f8_e4m3": jnp.float8_e4m3fn, "f8_e5m2": jnp.float8_e5m2, "f4_e2m1": jnp.float4_e2m1fn,
    "e8m0": jnp.float8_e8m0fnu,
}
_FLOATS = tuple(np.dtype(t) for t in (jnp.float32, jnp.bfloat16, jnp.float16))
_FP_LOW = tuple(np.dtype(t) for t in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float4_e2m1fn))
_INTS = tuple(np.dtype(t) for t in (jnp.int8, jnp.uint8, jnp.int4, jnp.uint4))


def data_type(dtype) -> np.dtype:
  """A jnp dtype or a oneDNN name ("f32", "bf16", "s8", ...) as a numpy dtype."""
  if isinstance(dtype, str) and dtype in DATA_TYPES:
    return np.dtype(DATA_TYPES[dtype])
  try:
    return np.dtype(dtype)
  except TypeError as err:
    raise ValueError(f"unknown data type {dtype!r}; oneDNN names: {sorted(DATA_TYPES)}") from err


@dataclasses.dataclass(frozen=True)
class MemoryDesc:
  """``memory::desc::grouped``: a 2-D tensor with one dimension split into groups, or the
  zero descriptor (``desc`` None: what 0 dims, or a failure with ``allow_empty``, give)."""

  desc: GroupedDesc | None

  dims = property(lambda self: () if self.desc is None else self.desc.dims)
  data_type = property(lambda self: None if self.desc is None else self.desc.dtype)
  variable_dim_idx = property(
      lambda self: None if self.desc is None else self.desc.variable_dim_idx)
  num_groups = property(lambda self: 0 if self.desc is None else self.desc.num_groups)

  def is_zero(self) -> bool:
    """``memory::desc::is_zero()``: the zero descriptor (it describes no memory)."""
    return self.desc is None

  def get_size(self, index: int = 0) -> int:
    """Bytes of buffer 0 (values; sub-byte types packed) or 1 (``num_groups * 4``); 0 for
    the zero descriptor."""
    return 0 if self.desc is None else self.desc.size(index)


def memory_desc_grouped(dims: Sequence[int], dtype, variable_dim_idx: int, num_groups: int,
                        offsets_dtype="s32", allow_empty: bool = False) -> MemoryDesc:
  """oneDNN's ``memory::desc::grouped(dims, dt, variable_dim_idx, group_count, offsets_dt,
  allow_empty)``, with its creation-time checks in its order (spec section 1.2).

  Args:
    dims: ``(rows, columns)``, the variable dimension's size being the total over the
      groups; ``()`` (0 dims) gives the zero descriptor, as in oneDNN.
    dtype: a oneDNN name ("f32", "bf16", "s8", ...) or a jnp dtype.
    variable_dim_idx: 0 (rows vary) or 1 (columns vary).
    num_groups: oneDNN's group_count.
    offsets_dtype: must be s32.
    allow_empty: return the zero descriptor instead of raising (as oneDNN returns one
      instead of throwing).

  Raises:
    NotImplementedError: not 2-D (oneDNN: unimplemented).
    ValueError: group_count <= 0, an offsets type other than s32, variable_dim_idx
      outside [0, 2), or a dimension that is not a positive int: 0 (a grouped tensor
      cannot have total size 0), negative, or a runtime placeholder (None); oneDNN:
      invalid_arguments. Also an unknown data type.
  """
  try:
    return _memory_desc_grouped(dims, dtype, variable_dim_idx, num_groups, offsets_dtype)
  except (ValueError, NotImplementedError):
    if allow_empty:
      return MemoryDesc(None)
    raise


def _memory_desc_grouped(dims, dtype, variable_dim_idx, num_groups, offsets_dtype):
  try:
    dims = tuple(dims)
  except TypeError:
    raise ValueError(f"grouped memory dims must be a pair of ints, got {dims!r}") from None
  if not dims:
    return MemoryDesc(None)
  if len(dims) != 2:
    raise NotImplementedError(f"grouped memory is 2-D only (oneDNN: unimplemented), got "
                              f"dims {dims}")
  if not is_index(num_groups) or num_groups <= 0:
    raise ValueError(f"num_groups (group_count) must be a positive int (oneDNN: "
                     f"invalid_arguments), got {num_groups!r}")
  if data_type(offsets_dtype) != np.dtype(np.int32):
    raise ValueError(f"grouped offsets must be s32 (oneDNN: invalid_arguments), got "
                     f"{offsets_dtype!r}")
  if not is_index(variable_dim_idx) or not 0 <= variable_dim_idx < 2:
    raise ValueError(f"variable_dim_idx must be 0 or 1 (oneDNN: invalid_arguments), got "
                     f"{variable_dim_idx!r}")
  if not all(is_index(d) and d > 0 for d in dims):
    raise ValueError(f"grouped memory dims must be positive ints: a grouped tensor cannot "
                     f"have total size 0, and runtime placeholders are not accepted "
                     f"(oneDNN: invalid_arguments), got {dims!r}")
  return MemoryDesc(grouped_desc(dims, data_type(dtype), variable_dim_idx, num_groups))


@jax.tree_util.register_pytree_node_class
class Memory:
  """A grouped memory: the descriptor and its two buffers (values, int32 offsets)."""

  def __init__(self, desc: MemoryDesc, buffers):
    if desc.is_zero():
      raise ValueError("the zero memory descriptor describes no grouped memory")
    values, offsets = buffers
    self.desc = desc
    self.values = jnp.asarray(values)
    self.offsets = jnp.asarray(offsets)
    if self.values.shape != desc.dims:
      raise ValueError(f"values {self.values.shape} do not match the descriptor's dims "
                       f"{desc.dims}")
    if np.dtype(self.values.dtype) != desc.data_type:
      raise ValueError(f"values are {self.values.dtype}, the descriptor says "
                       f"{desc.data_type}")
    if self.offsets.shape != (desc.num_groups,) or self.offsets.dtype != jnp.int32:
      raise ValueError(f"offsets must be s32 [{desc.num_groups}], got "
                       f"{self.offsets.dtype}{list(self.offsets.shape)}")

  def get_data_handle(self, index: int = 0) -> jax.Array:
    if index not in (0, 1):
      raise ValueError(f"a grouped memory has buffers 0 and 1, got {index}")
    return self.values if index == 0 else self.offsets

  def get_size(self, index: int = 0) -> int:
    return self.desc.get_size(index)

  def get_desc(self) -> MemoryDesc:
    return self.desc

  def tree_flatten(self):
    return (self.values, self.offsets), self.desc

  @classmethod
  def tree_unflatten(cls, desc, children):
    obj = object.__new__(cls)
    obj.desc, (obj.values, obj.offsets) = desc, children
    return obj


def memory(desc: MemoryDesc, buffers) -> Memory:
  """``memory(md, engine, {values, offsets})`` (no engine: JAX places arrays itself).

  Raises:
    ValueError: buffers that do not match the descriptor, or the zero descriptor (it
      describes no grouped memory; oneDNN makes an empty memory of it).
  """
  return Memory(desc, buffers)


# ------------------------------------------------------------------------------ post-ops

ELTWISE = {
    "relu": lambda x, a, b: jnp.where(x > 0, x, a * x),
    "swish": lambda x, a, b: x * jax.nn.sigmoid(a * x),
    "gelu_tanh": lambda x, a, b: jax.nn.gelu(x, approximate=True),
    "gelu_erf": lambda x, a, b: jax.nn.gelu(x, approximate=False),
    "tanh": lambda x, a, b: jnp.tanh(x),
    "logistic": lambda x, a, b: jax.nn.sigmoid(x),
    "elu": lambda x, a, b: jnp.where(x > 0, x, a * (jnp.exp(x) - 1)),
    "linear": lambda x, a, b: a * x + b,
    "square": lambda x, a, b: x * x,
    "abs": lambda x, a, b: jnp.abs(x),
    "exp": lambda x, a, b: jnp.exp(x),
    "clip": lambda x, a, b: jnp.clip(x, a, b),
}


def eltwise(algorithm: str, alpha: float = 0.0, beta: float = 0.0):
  """``post_ops.append_eltwise(algorithm, alpha, beta)`` (names without ``"eltwise_"``)."""
  name = algorithm.removeprefix("eltwise_")
  if name not in ELTWISE:
    raise ValueError(f"unsupported eltwise algorithm {algorithm!r}; supported: "
                     f"{sorted(ELTWISE)}")
  if name == "swish" and alpha == 0.0:
    alpha = 1.0  # the usual SiLU; oneDNN's docs pass 1.f
  return ("eltwise", name, float(alpha), float(beta))


def binary_mul(src1):
  """``post_ops.append_binary(algorithm::binary_mul, src1)``: src1 a grouped memory
  ``[total_M, N]``, or dense ``[total_M, N]``, ``[total_M, 1]`` or ``[G, 1]``."""
  return ("binary_mul", src1)


# -------------------------------------------------------------------------------- matmul


def _scale_operand(values, scales, zero_points, name):
  """A QArray from oneDNN's dense scale / zero-point tensors (already in gmm's ranks)."""
  if scales is None:
    if zero_points is not None:
      raise ValueError(f"{name} zero points need {name} scales (oneDNN: the masks match)")
    return values
  scales = jnp.asarray(scales)
  zero = None if zero_points is None else jnp.asarray(zero_points)
  if zero is not None and zero.shape != scales.shape:
    raise ValueError(f"{name} zero points {zero.shape} must match the scales {scales.shape}")
  try:
    return QArray(values, scales, zero)
  except ValueError as err:
    raise ValueError(f"{name} scales {scales.shape} do not fit {name} {values.shape}: "
                     f"{err}") from None


def matmul(src: Memory, weights, bias=None, *, src_scales=None, wei_scales=None,
           src_zero_points=None, wei_zero_points=None, dst_dtype=None,
           post_ops: Sequence[Any] = (), weights_format: str = "abc"):
  """A oneDNN grouped matmul primitive, executed.

  Args:
    src: a grouped `Memory` (idx 0: var-M; idx 1: var-K).
    weights: var-M: ``[G, K, N]`` (``weights_format="acb"``: an array ``[G, N, K]``);
      var-K: a grouped `Memory` ``[total_K, N]`` (idx 0, same offsets as src).
    bias: var-M only, ``[G, N]``.
    src_scales: var-M: ``[total_M]`` (per row) or ``[total_M, K/gK]`` (per row x K block).
    wei_scales: var-M: ``[G, N]`` (per expert x column) or ``[G, K/gK, N]``.
    src_zero_points, wei_zero_points: the scales' shapes (integer tensors only).
    dst_dtype: f32, bf16 or f16 (default: src's type if floating, else f32).
    post_ops: var-M only: `eltwise(...)` and `binary_mul(...)` items, applied in order.
    weights_format: "abc" or "acb" (var-M).

  Returns:
    var-M: a grouped `Memory` ``[total_M, N]`` with src's offsets (rows past the last offset
    are 0); var-K: ``[G, M, N]``.

  Raises:
    ValueError: a combination oneDNN rejects (shapes, types, scales on f32/bf16/f16
      tensors, var-K with attributes, ...), naming the rule.
  """
  if not isinstance(src, Memory):
    raise ValueError("src must be a grouped memory (gmm_jax.compat.onednn.memory)")
  md = src.desc
  num_groups, offsets = md.num_groups, src.offsets
  dst_dtype = (data_type(dst_dtype) if dst_dtype is not None else
               md.data_type if md.data_type in _FLOATS else np.dtype(jnp.float32))
  if dst_dtype not in _FLOATS:
    raise ValueError(f"dst must be f32, bf16 or f16 (no s32/s8 destinations), got {dst_dtype}")
  if md.variable_dim_idx == 1:  # var-K
    attributes = bool(bias is not None or post_ops or src_scales is not None
                      or wei_scales is not None or src_zero_points is not None
                      or wei_zero_points is not None)
    return _var_k(src, weights, dst_dtype, attributes)
  weights, transposed = _var_m_weights(md, weights, weights_format)
  n = weights.shape[1] if transposed else weights.shape[2]
  _check_var_m_types(md.data_type, np.dtype(weights.dtype), src_scales, wei_scales, bias)
  lhs, rhs = _var_m_operands(src, weights, transposed, (src_scales, src_zero_points),
                             (wei_scales, wei_zero_points))
  eltwise_first = bool(post_ops) and post_ops[0][0] == "eltwise"
  activation = None
  if eltwise_first:
    _, name, alpha, beta = post_ops[0]
    fn = ELTWISE[name]
    activation = lambda x, fn=fn, alpha=alpha, beta=beta: fn(x, alpha, beta)  # noqa: E731
  rest = post_ops[1:] if eltwise_first else post_ops
  out = gmm(lhs, rhs, offsets, group_list_type="cumsum", bias=bias, activation=activation,
            transpose_rhs=transposed,
            preferred_element_type=jnp.float32 if rest else dst_dtype)
  if rest:
    out = _after_gmm(out, rest, offsets, num_groups, (md.dims[0], n), dst_dtype)
  dst_md = memory_desc_grouped((md.dims[0], n), dst_dtype, 0, num_groups)
  return Memory(dst_md, (out, offsets))


def _var_k(src: Memory, weights, dst_dtype, attributes: bool):
  """var-K: src ``[M, total_K]`` x grouped weights ``[total_K, N]`` -> ``[G, M, N]``, after
  oneDNN's checks (`attributes`: a bias, scales, zero points or post-ops were given)."""
  md, num_groups, offsets = src.desc, src.desc.num_groups, src.offsets
  if not isinstance(weights, Memory) or weights.desc.variable_dim_idx != 0:
    raise ValueError("var-K needs grouped weights [total_K, N] with variable_dim_idx 0")
  if weights.desc.num_groups != num_groups:
    raise ValueError(f"group counts differ: src {num_groups}, weights "
                     f"{weights.desc.num_groups}")
  if weights.desc.dims[0] != md.dims[1]:
    raise ValueError(f"src {md.dims} and weights {weights.desc.dims} disagree on total_K")
  if attributes:
    raise ValueError("var-K takes default attributes only: no bias, scales, zero points "
                     "or post-ops")
  types = {md.data_type, weights.desc.data_type, dst_dtype}
  if len(types) != 1 or md.data_type not in _FLOATS:
    raise ValueError(f"var-K needs one type among f32/bf16/f16 for src, weights and dst, "
                     f"got {sorted(str(t) for t in types)}")
  # (weights' offsets must equal src's: checked when concrete, as oneDNN's execute does)
  if not isinstance(offsets, jax.core.Tracer) and not isinstance(weights.offsets,
                                                                 jax.core.Tracer):
    if not np.array_equal(np.asarray(offsets), np.asarray(weights.offsets)):
      raise ValueError("var-K weights offsets must equal src offsets")
  return gmm(src.values, weights.values, offsets, group_type="k",
             group_list_type="cumsum", preferred_element_type=dst_dtype)


def _var_m_weights(md: MemoryDesc, weights, weights_format: str):
  """var-M's dense weights, checked against src's descriptor: (weights, transposed)."""
  if isinstance(weights, Memory):
    raise ValueError("var-M weights are dense [G, K, N]")
  weights = jnp.asarray(weights)
  if weights_format not in ("abc", "acb"):
    raise ValueError(f"var-M weights format must be 'abc' or 'acb', got {weights_format!r}")
  transposed = weights_format == "acb"
  if weights.ndim != 3 or weights.shape[0] != md.num_groups:
    raise ValueError(f"var-M weights must be [G={md.num_groups}, K, N], got {weights.shape}")
  k = weights.shape[2] if transposed else weights.shape[1]
  if md.dims[1] != k:
    raise ValueError(f"src {md.dims} has K={md.dims[1]}, weights {weights.shape} K={k}")
  return weights, transposed


def _check_var_m_types(src_type, wei_type, src_scales, wei_scales, bias):
  """oneDNN's data-type rules of a var-M matmul: integer pairs, scales on 8/4-bit tensors
  only, weight-only quantization with weight scales, no bias with f8/f4 src."""
  if src_type in _INTS and wei_type not in _INTS:
    raise ValueError(f"an integer src needs integer weights, got {src_type} x {wei_type}")
  for scales, type_, name in ((src_scales, src_type, "src"), (wei_scales, wei_type, "wei")):
    if scales is not None and type_ in _FLOATS:
      raise ValueError(f"no {name} scales on a {type_} tensor (oneDNN allows them on "
                       "8/4-bit tensors only)")
  if wei_type in _INTS and src_type in _FLOATS and wei_scales is None:
    raise ValueError("weight-only quantization needs weight scales")
  if bias is not None and (src_type in _FP_LOW):
    raise ValueError("no bias with f8/f4 src (oneDNN's data-type table)")


def _var_m_operands(src: Memory, weights, transposed: bool, src_quant, wei_quant):
  """gmm's lhs and rhs of a var-M matmul: QArrays where (scales, zero points) are given or
  src is low-precision (a missing scale is 1), else the arrays."""
  # src scales [total_M] / [total_M, K/gK] -> [M, 1] / [M, Kb]; wei [G, N] / [G, Kb, N].
  def as_rows(x):
    if x is None:
      return None
    x = jnp.asarray(x)
    return x[:, None] if x.ndim == 1 else x

  def as_wei(x):
    if x is None:
      return None
    x = jnp.asarray(x)
    x = x[:, None, :] if x.ndim == 2 else x
    return jnp.swapaxes(x, 1, 2) if transposed else x

  lhs = _scale_operand(src.values, *map(as_rows, src_quant), "src")
  rhs = _scale_operand(weights, *map(as_wei, wei_quant), "wei")
  if src.desc.data_type in _INTS + _FP_LOW:
    # Low-precision src: both sides are quantized operands; a missing scale is 1 (the
    # stored values are the numbers).
    if not isinstance(lhs, QArray):
      lhs = QArray(src.values, jnp.ones((1, 1), jnp.float32))
    if not isinstance(rhs, QArray):
      rhs = QArray(weights, jnp.ones((1, 1, 1), jnp.float32))
  return lhs, rhs


def _after_gmm(out, post_ops, offsets, num_groups: int, dst_dims, dst_dtype):
  """The post-ops after gmm's epilogue, in order, on its f32 ``[total_M, N]`` result; rows
  past the last offset set to 0, then cast to `dst_dtype`."""
  total_m, n = dst_dims
  group_of_row = metadata.row_group_ids(group_list.to_counts(offsets, "cumsum", num_groups),
                                        total_m)
  for op in post_ops:
    if op[0] == "eltwise":
      out = ELTWISE[op[1]](out, op[2], op[3])
    elif op[0] == "binary_mul":
      other = op[1]
      if isinstance(other, Memory):
        if other.desc.dims != (total_m, n):
          raise ValueError(f"a grouped binary src1 must be [total_M, N]={[total_m, n]}, "
                           f"got {list(other.desc.dims)}")
        other = other.values
      other = jnp.asarray(other)
      if other.shape in ((total_m, n), (total_m, 1)):
        out = out * other
      elif other.shape == (num_groups, 1):
        out = out * other[jnp.maximum(group_of_row, 0)]
      else:
        raise ValueError(f"binary mul src1 must be [total_M, N], [total_M, 1] or [G, 1]; "
                         f"got {list(other.shape)} (no [1, 1] scalar)")
    else:
      raise ValueError(f"unsupported post-op {op[0]!r}: eltwise and binary_mul only")
  return jnp.where((group_of_row >= 0)[:, None], out, 0.0).astype(dst_dtype)
