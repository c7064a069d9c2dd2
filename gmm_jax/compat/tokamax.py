"""tokamax's ``ragged_dot`` / ``ragged_dot_general`` call signatures on gmm_jax.

Replacing the import is the whole migration::

    from gmm_jax.compat import tokamax              # was: import tokamax
    out = tokamax.ragged_dot(x, w, tokamax.RaggedDotGroupSizes(sizes, len(x)),
                             preferred_element_type=jnp.bfloat16, implementation="mosaic")

The arguments are those of tokamax's public ``ragged_dot`` (the open-source repository at
commit ``783ea95`` and the 0.0.17 release, whose extra keywords ``bypass_device_check``,
``zero_initialize`` and ``fuse_gateup_activation`` are accepted too). Group sizes may be an
integer array, a sequence of ints, or a tokamax ``GroupSizes`` (``RaggedDotGroupSizes``) or any
object with its ``.value``; the representative sizes it carries are for tokamax's autotuner
(gmm_jax's is `gmm_jax.autotune(..., group_sizes=...)`) and do not change the result.

Implementation names map to gmm_jax's (`IMPLEMENTATION_NAMES`); a sequence is tried in
order, as in tokamax, with gmm_jax's own chain doing the falling through (so the backward
pass's gmms fall through the same way). Callables in the sequence are called as tokamax
calls them. Where the two differ, by design:

* ``group_offset`` raises NotImplementedError in every tokamax implementation; here it is
  gmm_jax's (rhs holds groups ``[group_offset, group_offset + G_local)``), in the ragged
  non-contracting mode.
* ``activation`` runs in the f32 accumulator before the cast (tokamax's documented
  semantics and its kernels'; its XLA implementation applies it after the cast).
* Rows past ``sum(group_sizes)`` are always 0 (``zero_initialize`` is accepted; unvisited
  rows of tokamax's kernels are unspecified without it).
* ``manual_axis_type`` is accepted and not needed: inside ``jax.shard_map`` the result's
  varying manual axes follow from the operands.
* When every implementation of a sequence fails, one NotImplementedError lists each reason
  (tokamax raises an ExceptionGroup); a name whose gmm_jax backends are not registered in
  this installation falls through like an implementation that cannot serve the call
  (tokamax raises ValueError for it).

Quantized operands (qwix ``QArray``s, as MaxText's quantized tokamax path passes them, or
gmm_jax's) with ``implementation="xla"`` are multiplied as tokamax's XLA implementation
multiplies them: dequantized first, in their scale's dtype, and an rhs ``[G, N, K]``
contracted as ``[G, K, N]`` (as ``jax.lax.ragged_dot_general`` contracts it), so that
MaxText's calls give tokamax's bits (`_as_tokamax_xla`). Other implementations take them as
`gmm_jax.gmm` does.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import gmm_jax

__all__ = ["GroupSizes", "IMPLEMENTATION_NAMES", "RaggedDotGroupSizes", "ragged_dot",
           "ragged_dot_general"]

#: tokamax's implementation names -> gmm_jax's, tried in order. "mosaic" is tokamax's TPU or
#: GPU Mosaic kernel, whichever the device is: gmm_jax's dispatcher keeps the one that runs
#: on the platform the call is lowered for.
IMPLEMENTATION_NAMES: dict[str, tuple[str, ...]] = {
    "xla": ("xla",),
    "triton": ("pallas_triton",),
    "mosaic": ("pallas_tpu", "pallas_mosaic_gpu"),
    "mosaic_tpu": ("pallas_tpu",),
    "mosaic_tpu_v2": ("pallas_tpu",),
    "mosaic_gpu": ("pallas_mosaic_gpu",),
}

# tokamax's fused gated activations (``act(z[:, :n]) * z[:, n:]``, the gate half first) as
# gmm_jax's. tokamax's "gelu" is jax.nn.gelu's default, the tanh approximation; "swigluoai"
# is gpt-oss's clamped SwiGLU (alpha 1.702, limit 7).
GATEUP_ACTIVATIONS = {
    "silu": "swiglu",
    "gelu": "geglu_tanh",
    "gelu_tanh": "geglu_tanh",
    "swigluoai": "swiglu_clamped",
}

# tokamax's "silu_and_mul_with_clamp" (its gmm v2 kernels'; DeepSeek-V4's MLP): the gate
# clamped from above and the up half to [-limit, limit] before ``silu(gate) * up``.
SILU_AND_MUL_CLAMP_LIMIT = 10.0


def silu_and_mul_with_clamp(z: jax.Array, limit: float = SILU_AND_MUL_CLAMP_LIMIT) -> jax.Array:
  """``silu(min(gate, limit)) * clip(up, -limit, limit)`` of ``z [..., 2N]`` (gate half
  first) -> ``[..., N]``."""
  gate, up = jnp.split(z, 2, axis=-1)
  return jax.nn.silu(jnp.minimum(gate, limit)) * jnp.clip(up, -limit, limit)


# Gated activations gmm_jax has no epilogue of its own for: formed on the f32 product.
GATEUP_FUNCTIONS: dict[str, Callable[[jax.Array], jax.Array]] = {
    "silu_and_mul_with_clamp": silu_and_mul_with_clamp,
}


@jax.tree_util.register_pytree_node_class
class GroupSizes:
  """tokamax's ``GroupSizes`` (``tokamax.RaggedDotGroupSizes``): a group sizes array with
  representative values for autotuning.

  Args:
    value: the integer group sizes ``[G]`` (an array, or a ``jax.ShapeDtypeStruct`` when
      only the representative sizes matter).
    repr_value_or_total_size: representative sizes (G ints), or the total size M; with an
      int, the representative sizes are the concrete value when there is one, else M split
      as evenly as possible (tokamax draws a random split there; they serve autotuning only,
      never the result).
  """

  def __init__(self, value, repr_value_or_total_size):
    if not np.issubdtype(np.dtype(value.dtype), np.integer):
      raise ValueError(f"Group sizes must be integers, got {np.dtype(value.dtype)}")
    if len(np.shape(value)) != 1:
      raise ValueError(f"Group sizes must be 1-D, got shape {np.shape(value)}")
    num_groups = np.shape(value)[0]
    if isinstance(repr_value_or_total_size, (int, np.integer)):
      repr_value_or_total_size = int(repr_value_or_total_size)
    else:
      repr_value_or_total_size = tuple(int(v) for v in repr_value_or_total_size)
      if len(repr_value_or_total_size) != num_groups:
        raise ValueError(f"Representative value must have same length as the group sizes "
                         f"({num_groups}), got {len(repr_value_or_total_size)}")
    if isinstance(value, jax.ShapeDtypeStruct):
      value = np.asarray(self._split(repr_value_or_total_size, num_groups), value.dtype)
    self.value = value
    self.repr_value_or_total_size = repr_value_or_total_size

  @staticmethod
  def _split(repr_value_or_total_size, num_groups: int) -> tuple[int, ...]:
    if not isinstance(repr_value_or_total_size, int):
      return repr_value_or_total_size
    base, extra = divmod(repr_value_or_total_size, max(num_groups, 1))
    return tuple(base + (g < extra) for g in range(num_groups))

  @property
  def representative_value(self) -> tuple[int, ...]:
    if isinstance(self.repr_value_or_total_size, int) and isinstance(self.value, np.ndarray):
      return tuple(int(v) for v in self.value)
    return self._split(self.repr_value_or_total_size, np.shape(self.value)[0])

  def __jax_array__(self) -> jax.Array:
    return jnp.asarray(self.value)

  def tree_flatten(self):
    return (self.value,), self.repr_value_or_total_size

  @classmethod
  def tree_unflatten(cls, repr_value_or_total_size, children):
    obj = object.__new__(cls)
    obj.value, obj.repr_value_or_total_size = children[0], repr_value_or_total_size
    return obj

  def __repr__(self):
    return (f"GroupSizes(value={np.dtype(self.value.dtype).name}{list(np.shape(self.value))}, "
            f"repr_value_or_total_size={self.repr_value_or_total_size!r})")


RaggedDotGroupSizes = GroupSizes

_DEFAULT_DIMS = ((((1,), (1,)), ((), ())), (0,), (0,))  # lhs [M, K], rhs [G, K, N]
_TRANS_RHS_DIMS = ((((1,), (2,)), ((), ())), (0,), (0,))  # rhs [G, N, K]


def _sizes(group_sizes) -> jax.Array:
  """The group sizes array of an array, a sequence of ints or a GroupSizes-like object."""
  value = getattr(group_sizes, "value", group_sizes)
  if isinstance(value, (list, tuple)):
    value = np.asarray(value, np.int32)
  if not jnp.issubdtype(jnp.result_type(value), jnp.integer):
    raise ValueError(f"group sizes must be integers, got {jax.typeof(jnp.asarray(value))}")
  return value


def _names(implementation) -> list[tuple[str, ...] | Callable]:
  """tokamax's `implementation` as a list of steps: a tuple of gmm_jax names (one gmm call
  whose chain falls through) or a tokamax-style callable."""
  if implementation is None:
    return [None]
  if isinstance(implementation, str):
    implementation = (implementation,)
  if not implementation:
    raise ValueError("`implementation` must not be an empty sequence.")
  steps: list = []
  registered = gmm_jax.implementations()
  for impl in implementation:
    if callable(impl):
      steps.append(impl)
      continue
    if impl in IMPLEMENTATION_NAMES:
      # Only the backends this installation registered (a Pallas backend registers when
      # its imports succeed); a name with none left falls through like an unsupported one.
      names = tuple(n for n in IMPLEMENTATION_NAMES[impl] if n in registered)
    elif impl in registered or impl == "auto":
      names = (impl,)
    else:
      raise ValueError(f"Unknown implementation: {impl}; tokamax's names are "
                       f"{sorted(IMPLEMENTATION_NAMES)} and gmm_jax's {list(registered)}")
    if steps and isinstance(steps[-1], tuple):
      steps[-1] = steps[-1] + tuple(n for n in names if n not in steps[-1])
    else:
      steps.append(names)
  return steps


def _canonical_dims(dims) -> tuple:
  try:
    (lc, rc), (lb, rb) = dims.dot_dimension_numbers
    return ((tuple(lc), tuple(rc)), (tuple(lb), tuple(rb))), tuple(
        dims.lhs_ragged_dimensions), tuple(dims.rhs_group_dimensions)
  except (AttributeError, TypeError, ValueError):
    raise ValueError(f"ragged_dot_dimension_numbers must be a jax.lax."
                     f"RaggedDotDimensionNumbers, got {dims!r}") from None


def _check_reduction_dims(lhs, rhs, dims) -> None:
  (lhs_contract, rhs_contract), _ = dims[0]
  for dim1, dim2 in zip(lhs_contract, rhs_contract):
    if (dim1 >= np.ndim(lhs) or dim2 >= np.ndim(rhs)
        or np.shape(lhs)[dim1] != np.shape(rhs)[dim2]):
      raise ValueError(f"The reduction dimension {dim1} of lhs {np.shape(lhs)} does not match "
                       f"the reduction dimension {dim2} of rhs {np.shape(rhs)}")


def _dequantized(x):
  """A QArray (qwix's or gmm_jax's) as tokamax's ``quantization.as_array`` makes it: qwix's
  ``dequantize``, the values times the scale in the scale's dtype; an array as it is."""
  if hasattr(x, "qvalue") and hasattr(x, "scale"):
    return gmm_jax.dequantize(x, x.scale.dtype)
  return x


def _as_tokamax_xla(lhs, rhs, dims):
  """The operands of tokamax's XLA implementation as it multiplies them: quantized ones
  dequantized first (it multiplies floats, where gmm_jax's quantized modes multiply the
  quantized values and scale the product: the same up to f32 rounding, which a quantized
  gmm that follows can turn into a different rounding of its input), and an rhs
  ``[G, N, K]`` as ``[G, K, N]`` (jax.lax.ragged_dot_general contracts it so; gmm's
  transposed-rhs path sums in another order). Returns (lhs, rhs, dims)."""
  lhs, rhs = _dequantized(lhs), _dequantized(rhs)
  if dims == _TRANS_RHS_DIMS and np.ndim(lhs) == 2 and np.ndim(rhs) == 3:
    rhs, dims = jnp.swapaxes(rhs, 1, 2), _DEFAULT_DIMS
  return lhs, rhs, dims


def _gmm_step(lhs, rhs, sizes, dims, names, precision, preferred_element_type, group_offset,
              activation, fuse_gateup_activation):
  """One gmm_jax call: the gmm itself for an lhs ``[M, K]`` with ragged rows (the activation
  fused in the f32 accumulator), else gmm_jax.ragged_dot_general."""
  if names == ("xla",):
    lhs, rhs, dims = _as_tokamax_xla(lhs, rhs, dims)
  gated = None
  if fuse_gateup_activation is not None:
    ragged_rows = (np.ndim(lhs) == 2 and np.ndim(rhs) == 3
                   and dims in (_DEFAULT_DIMS, _TRANS_RHS_DIMS))
    if fuse_gateup_activation in GATEUP_FUNCTIONS and ragged_rows:
      # No epilogue of gmm_jax's computes it: the f32 product, then the activation(s).
      out = GATEUP_FUNCTIONS[fuse_gateup_activation](_gmm_step(
          lhs, rhs, sizes, dims, names, precision, jnp.float32, group_offset, None, None))
      out = out if activation is None else activation(out)
      return out.astype(preferred_element_type if preferred_element_type is not None
                        else jnp.result_type(lhs, rhs))
    if fuse_gateup_activation not in GATEUP_ACTIVATIONS:
      raise NotImplementedError(
          f"Unsupported fused activation: {fuse_gateup_activation}; supported: "
          f"{sorted(GATEUP_ACTIVATIONS) + sorted(GATEUP_FUNCTIONS)}")
    gated = GATEUP_ACTIVATIONS[fuse_gateup_activation]
  if np.ndim(lhs) == 2 and np.ndim(rhs) == 3 and dims in (_DEFAULT_DIMS, _TRANS_RHS_DIMS):
    # A callable after a gated activation runs on the gated f32 result, then one cast.
    both = gated is not None and activation is not None
    out = gmm_jax.gmm(lhs, rhs, sizes, transpose_rhs=dims == _TRANS_RHS_DIMS,
                      precision=precision,
                      preferred_element_type=jnp.float32 if both else preferred_element_type,
                      group_offset=group_offset, activation=activation if gated is None else gated,
                      implementation=names)
    if not both:
      return out
  else:
    if gated is not None:
      raise NotImplementedError("fuse_gateup_activation is supported for an lhs [M, K] with "
                                "ragged rows and rhs [G, K, N] or [G, N, K]")
    out = gmm_jax.ragged_dot_general(
        lhs, rhs, sizes, jax.lax.RaggedDotDimensionNumbers(
            dot_dimension_numbers=dims[0], lhs_ragged_dimensions=list(dims[1]),
            rhs_group_dimensions=list(dims[2])),
        precision=precision,
        preferred_element_type=preferred_element_type if activation is None else jnp.float32,
        group_offset=group_offset, implementation=names)
    if activation is None:
      return out
  out_dtype = (jnp.dtype(preferred_element_type) if preferred_element_type is not None
               else jnp.result_type(lhs, rhs))
  return activation(out).astype(out_dtype)


def ragged_dot_general(lhs: jax.Array, rhs: jax.Array, group_sizes: Any,
                       ragged_dot_dimension_numbers: jax.lax.RaggedDotDimensionNumbers,
                       precision: jax.lax.PrecisionLike = None,
                       preferred_element_type: jax.typing.DTypeLike | None = None,
                       group_offset: jax.Array | None = None,
                       activation: Callable[[jax.Array], jax.Array] | None = None,
                       manual_axis_type: Any = None, *,
                       implementation: str | Sequence[str | Callable] | None = None,
                       bypass_device_check: bool | None = None, zero_initialize: bool = False,
                       fuse_gateup_activation: str | None = None) -> jax.Array:
  """tokamax's ``ragged_dot_general``: `jax.lax.ragged_dot_general`'s arguments, with an
  activation, a GroupSizes object and tokamax's implementation names.

  Args:
    lhs, rhs, ragged_dot_dimension_numbers, precision, preferred_element_type: as in
      `jax.lax.ragged_dot_general` (three modes, batch dimensions).
    group_sizes: an integer array, a sequence of ints, or a tokamax ``GroupSizes`` (its
      ``.value`` is used).
    group_offset: int32 ``[1]`` (or scalar): rhs holds groups ``[group_offset,
      group_offset + G_local)`` (ragged non-contracting mode only).
    activation: a callable applied to the result in f32 before the cast.
    manual_axis_type, bypass_device_check, zero_initialize: accepted, not needed (see the
      module docs).
    implementation: None (gmm_jax's chain for the platform), a name or a sequence of names
      (`IMPLEMENTATION_NAMES`, or gmm_jax's own) and tokamax-style callables, tried in
      order until one does not raise NotImplementedError.
    fuse_gateup_activation: "silu", "gelu", "gelu_tanh", "swigluoai" or
      "silu_and_mul_with_clamp": rhs gives 2N columns, the gate half then the up half, and
      the result ``act(gate) * up`` has N. The first four are gmm_jax's fused gated
      epilogues; "silu_and_mul_with_clamp" is applied to the f32 product (in the ragged
      non-contracting mode only, like the others).

  Returns:
    The ragged product, of `preferred_element_type` (default: the promoted input dtype).

  Raises:
    ValueError: reduction dimensions that differ, non-integer group sizes, an unknown
      implementation name or an empty sequence.
    NotImplementedError: when no implementation serves the call.
  """
  del manual_axis_type, bypass_device_check, zero_initialize
  dims = _canonical_dims(ragged_dot_dimension_numbers)
  _check_reduction_dims(lhs, rhs, dims)
  sizes = _sizes(group_sizes)
  steps = _names(implementation)
  errors = []
  for step in steps:
    try:
      if callable(step):
        kwargs = dict(group_sizes=group_sizes,
                      ragged_dot_dimension_numbers=ragged_dot_dimension_numbers,
                      precision=precision, preferred_element_type=preferred_element_type,
                      activation=activation)
        return step(lhs, rhs, **kwargs)
      if step is not None and not step:
        raise NotImplementedError(f"none of gmm_jax's implementations for {implementation!r} "
                                  f"is registered here ({gmm_jax.implementations()})")
      return _gmm_step(lhs, rhs, sizes, dims, step, precision, preferred_element_type,
                       group_offset, activation, fuse_gateup_activation)
    except NotImplementedError as err:
      if len(steps) == 1:
        raise
      errors.append(f"{getattr(step, '__name__', step)}: {err}")
  raise NotImplementedError("all implementations failed: " + "; ".join(errors))


# ``ragged_dot``'s dimension numbers: lhs [M, K] with ragged rows, rhs [G, K, N].
_RAGGED_DOT_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
    rhs_group_dimensions=[0])


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: Any, *args, **kwargs) -> jax.Array:
  """tokamax's ``ragged_dot``: lhs ``[M, K]``, rhs ``[G, K, N]`` -> ``[M, N]``, the rows of
  group g times ``rhs[g]``; `ragged_dot_general`'s other arguments, in its order and with
  its defaults (the signature below is ragged_dot_general's without the dimension numbers)."""
  return ragged_dot_general(lhs, rhs, group_sizes, _RAGGED_DOT_DIMS, *args, **kwargs)


ragged_dot.__signature__ = inspect.signature(ragged_dot_general).replace(parameters=[
    p for p in inspect.signature(ragged_dot_general).parameters.values()
    if p.name != "ragged_dot_dimension_numbers"])
