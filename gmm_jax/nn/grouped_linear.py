"""`GroupedLinear`: per-group (per-expert) linear layers on group-contiguous rows, one gmm."""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from gmm_jax import GmmSharding, QuantSpec, gmm
from gmm_jax._src.core.qarray import Fp8Training, as_quantization
from gmm_jax.nn.params import auto_mesh, mesh_axes, param

Array = jax.Array


def grouped_kernel_init(key, shape, dtype=jnp.float32):
  """nnx.Linear's default (LeCun normal, fan-in = K) for each group's ``[K, N]`` matrix."""
  init = nnx.initializers.variance_scaling(1.0, "fan_in", "truncated_normal", in_axis=-2,
                                           out_axis=-1, batch_axis=(0,))
  return init(key, shape, dtype)


class GroupedLinear(nnx.Module):
  """Per-group (per-expert) linear layers applied to group-contiguous rows with one gmm.

  ``y[rows of g] = x[rows of g] @ kernel[g] + bias[g]``; kernel ``[G, K, N]`` with axes
  ("expert", "embed", "mlp") by default, bias ``[G, N]`` with ("expert", "mlp").

  Args:
    num_groups, in_features, out_features: G, K, N.
    use_bias, dtype, param_dtype, precision, kernel_init, bias_init: as in nnx.Linear
      (kernel_init receives the ``[G, K, N]`` shape).
    kernel_axes, bias_axes: logical axis names of the parameters.
    kernel_metadata, bias_metadata: more metadata of the parameters (as nnx.Linear's; an
      ``out_sharding`` there replaces the axes).
    weight_quant: a `QuantSpec` to quantize the kernel on the fly (weight-only int8/int4/
      fp8; straight-through gradients for training).
    input_quant: a `QuantSpec` for the inputs (dynamic quantization, e.g. per-token int8).
    quantization: None, "fp8", "fp8_e5m2_grads" or a `gmm_jax.Fp8Training`: fp8 training
      (forward and both backward gmms in fp8 with blockwise scales; see `gmm_jax.gmm`).
      Not with weight_quant/input_quant.
    implementation: gmm implementation (None: the platform's chain).
    rngs: nnx.Rngs.
  """

  def __init__(self, num_groups: int, in_features: int, out_features: int, *,
               use_bias: bool = True, dtype: Any = None, param_dtype: Any = jnp.float32,
               precision: Any = None, kernel_init=grouped_kernel_init,
               bias_init=nnx.initializers.zeros_init(),
               kernel_axes: tuple[str, ...] = ("expert", "embed", "mlp"),
               bias_axes: tuple[str, ...] = ("expert", "mlp"),
               kernel_metadata: Mapping[str, Any] | None = None,
               bias_metadata: Mapping[str, Any] | None = None,
               weight_quant: QuantSpec | None = None, input_quant: QuantSpec | None = None,
               quantization: str | Fp8Training | None = None,
               implementation: str | None = None, rngs: nnx.Rngs):
    quantization = as_quantization(quantization)
    if quantization is not None and (weight_quant is not None or input_quant is not None):
      raise ValueError("quantization= (fp8 training) quantizes the inputs and the kernel "
                       "itself; it does not take weight_quant or input_quant")
    self.num_groups, self.in_features, self.out_features = num_groups, in_features, out_features
    self.dtype, self.precision, self.implementation = dtype, precision, implementation
    self.weight_quant, self.input_quant = weight_quant, input_quant
    self.quantization = quantization
    shape = (num_groups, in_features, out_features)
    self.kernel = param(kernel_init(rngs.params(), shape, param_dtype), tuple(kernel_axes),
                        kernel_metadata)
    self.bias = (param(bias_init(rngs.params(), (num_groups, out_features), param_dtype),
                       tuple(bias_axes), bias_metadata) if use_bias else None)

  def weights(self, dtype=None):
    """(kernel, bias) as the gmm takes them: the kernel cast to the compute dtype unless it
    is quantized on the fly."""
    kernel = self.kernel[...]
    if self.weight_quant is None and dtype is not None:
      kernel = kernel.astype(dtype)
    return kernel, None if self.bias is None else self.bias[...]

  def gmm_options(self, dtype):
    options = dict(precision=self.precision, quantize_lhs=self.input_quant,
                   quantize_rhs=self.weight_quant, preferred_element_type=dtype,
                   implementation=self.implementation)
    if self.quantization is not None:
      options["quantization"] = self.quantization
    return options

  def __call__(self, x: Array, group_sizes: Array, *, activation=None,
               group_offset=None) -> Array:
    """x ``[M, K]`` rows sorted by group; group_sizes ``[G]`` -> ``[M, N]``."""
    dtype = self.dtype or jnp.result_type(x, self.kernel[...])
    kernel, bias = self.weights(dtype)
    options = self.gmm_options(dtype)
    if self.input_quant is None and self.weight_quant is None and self.quantization is None:
      options["sharding"] = self.sharding(x)
    return gmm(x.astype(dtype), kernel, group_sizes, bias=bias, activation=activation,
               group_offset=group_offset, **options)

  def sharding(self, x: Array) -> GmmSharding | None:
    """The layout this layer pins its gmm to on a mesh whose axes are Auto (the context
    mesh of `jax.set_mesh`, or the one x is placed on), where the types carry none: the
    kernel as its logical axes name (`params.mesh_axes`), the rows over the other axes
    that divide them. None elsewhere (one device's view; on Explicit axes the gmm splits
    itself by the types). A layer with input_quant, weight_quant or quantization does not
    pin one: its gmm quantizes with whole-operand statistics, which a split would make
    per-shard (it is then split as a plain gmm on Auto axes is)."""
    mesh = auto_mesh(x)
    if mesh is None:
      return None
    kernel_axes = mesh_axes(self.kernel, mesh)
    used = {a for a in kernel_axes if a is not None}
    rows = tuple(a for a, size in zip(mesh.axis_names, mesh.axis_sizes)
                 if size > 1 and a not in used)
    if not rows or x.shape[0] % math.prod(mesh.shape[a] for a in rows):
      rows = ()
    return GmmSharding(mesh, P(rows or None, kernel_axes[1]), P(*kernel_axes))
