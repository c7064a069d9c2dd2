"""gmm_jax.compat.tokamax against tokamax's own results (fixtures written by
tests/fixtures/make_tokamax_fixtures.py with tokamax's XLA implementation on the CPU; live
when tokamax is installed), jax.lax.ragged_dot and float64 numpy oracles."""

from __future__ import annotations

import inspect
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from oracle import dequantize, f64, gmm_oracle, tolerances

import gmm_jax
from gmm_jax.compat import tokamax as tk

FIXTURES = np.load(pathlib.Path(__file__).resolve().parent / "fixtures" /
                   "tokamax_ragged_dot.npz")
CASES = sorted({key.split("/")[0] for key in FIXTURES.files if "/" in key})
# Variants of cases the default run has (bf16 is there, the array form of group sizes, a
# fused gated activation): run with -m slow.
SLOW_CASES = {"bf16_out_f32", "fuse_gateup_gelu", "group_sizes_object"}

DIMS = {
    "default": jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [1]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0]),
    "trans_rhs": jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([1], [2]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[0]),
    "ragged_contracting": jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])), lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[]),
}
ACTIVATIONS = {None: None, "silu": jax.nn.silu, "tanh": jnp.tanh}


class GroupSizes:
  """tokamax's GroupSizes as a caller holds it: the sizes and representative values."""

  def __init__(self, value, repr_value_or_total_size):
    self.value = value
    self.repr_value_or_total_size = repr_value_or_total_size


def _case(name):
  spec = json.loads(str(FIXTURES[f"{name}/spec"]))
  arrays = {key.split("/")[1]: FIXTURES[key] for key in FIXTURES.files
            if key.startswith(name + "/") and not key.endswith("/spec")}
  for key in ("lhs", "rhs"):
    arrays[key] = jnp.asarray(arrays[key], spec["dtype"])
  arrays["cot"] = jnp.asarray(arrays["cot"], spec["out_dtype"])
  return spec, arrays


def _call(module, lhs, rhs, sizes, spec, group_sizes_type=GroupSizes):
  """The call a fixture's spec describes, through `module` (ours or tokamax)."""
  group_sizes = (group_sizes_type(sizes, lhs.shape[0]) if spec.get("group_sizes_object")
                 else sizes)
  kwargs = dict(preferred_element_type=spec.get("preferred_element_type"),
                activation=ACTIVATIONS[spec.get("activation")],
                implementation=spec.get("implementation"))
  if spec.get("fuse_gateup_activation"):
    kwargs["fuse_gateup_activation"] = spec["fuse_gateup_activation"]
  if spec["api"] == "ragged_dot":
    return module.ragged_dot(lhs, rhs, group_sizes, **kwargs)
  return module.ragged_dot_general(lhs, rhs, group_sizes, DIMS[spec["dims"]], **kwargs)


def _jit(thunk):
  """Runs a call compiled as one program (much faster on the CPU than op by op)."""
  return jax.jit(thunk)()


def _tol(spec, arrays, scale=1.0):
  k = max(arrays["lhs"].shape)
  return tolerances(spec["dtype"], spec["out_dtype"], k=k, scale=scale)


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=pytest.mark.slow) if name in SLOW_CASES else name
    for name in CASES])
def test_equals_tokamax_fixture(name):
  spec, a = _case(name)
  sizes = jnp.asarray(a["group_sizes"])
  grads = spec.get("grads", True)

  @jax.jit
  def run(lhs, rhs, cot):
    out, vjp = jax.vjp(lambda x, w: _call(tk, x, w, sizes, spec), lhs, rhs)
    return out, vjp(cot) if grads else ()

  out, cts = run(a["lhs"], a["rhs"], a["cot"])
  assert out.dtype == jnp.dtype(spec["out_dtype"]) and out.shape == a["out"].shape
  np.testing.assert_allclose(f64(out), f64(a["out"]), **_tol(spec, a, scale=16.0))
  if grads:
    for got, key in zip(cts, ("dlhs", "drhs")):
      np.testing.assert_allclose(f64(got), f64(a[key]), **_tol(spec, a, scale=64.0))


def test_fixtures_record_the_tokamax_version():
  versions = json.loads(str(FIXTURES["versions"]))
  assert versions["tokamax"] and versions["jax"]


def _inputs(seed=0, m=24, k=16, n=8, sizes=(5, 0, 9, 6)):
  rng = np.random.default_rng(seed)
  return (jnp.asarray(rng.standard_normal((m, k)), jnp.float32),
          jnp.asarray(rng.standard_normal((len(sizes), k, n)), jnp.float32),
          jnp.asarray(sizes, jnp.int32))


def test_group_sizes_forms_and_jax_lax_ragged_dot():
  lhs, rhs, sizes = _inputs()
  want = jax.lax.ragged_dot(lhs, rhs, sizes)
  tol = tolerances(jnp.float32, k=16, scale=16.0)
  for group_sizes in ([5, 0, 9, 6], GroupSizes(sizes, (6, 6, 6, 6))):
    np.testing.assert_allclose(_jit(lambda: tk.ragged_dot(lhs, rhs, group_sizes)), want,
                               **tol)
  with pytest.raises(ValueError, match="integers"):
    tk.ragged_dot(lhs, rhs, GroupSizes(sizes.astype(jnp.float32), 24))


def test_implementation_names_map_to_gmm_jax(monkeypatch):
  lhs, rhs, sizes = _inputs()
  # tokamax's "mosaic" -> "xla" fallback runs on the CPU, as tokamax's does.
  np.testing.assert_allclose(_jit(lambda: tk.ragged_dot(lhs, rhs, sizes,
                                                        implementation=("mosaic", "xla"))),
                             jax.lax.ragged_dot(lhs, rhs, sizes),
                             **tolerances(jnp.float32, k=16, scale=16.0))
  with pytest.raises(NotImplementedError):
    tk.ragged_dot(lhs, rhs, sizes, implementation="mosaic")  # no Mosaic on the CPU
  calls = []
  monkeypatch.setattr(gmm_jax, "gmm", lambda *args, **kwargs: calls.append(kwargs))
  registered = gmm_jax.implementations()  # a Pallas backend registers if its imports work
  for implementation, names in (
      (None, None), ("xla", ("xla",)), (["xla"], ("xla",)),
      (("triton", "mosaic", "xla"), ("pallas_triton", "pallas_tpu", "pallas_mosaic_gpu", "xla")),
      ("mosaic_tpu_v2", ("pallas_tpu",)), ("mosaic_gpu", ("pallas_mosaic_gpu",)),
      ("lax_ragged_dot", ("lax_ragged_dot",))):
    names = names and tuple(name for name in names if name in registered)
    if names == ():
      with pytest.raises(NotImplementedError, match="registered"):
        tk.ragged_dot(lhs, rhs, sizes, implementation=implementation)
      continue
    tk.ragged_dot(lhs, rhs, sizes, implementation=implementation)
    assert calls.pop()["implementation"] == names, implementation
  with pytest.raises(ValueError, match="Unknown implementation: foo"):
    tk.ragged_dot(lhs, rhs, sizes, implementation="foo")
  with pytest.raises(ValueError, match="empty"):
    tk.ragged_dot(lhs, rhs, sizes, implementation=())


def test_callables_in_the_sequence_are_called_as_tokamax_calls_them():
  lhs, rhs, sizes = _inputs()
  seen = []

  def unsupported(lhs, rhs, **kwargs):
    seen.append(sorted(kwargs))
    raise NotImplementedError("not this one")

  def custom(lhs, rhs, *, group_sizes, ragged_dot_dimension_numbers, precision,
             preferred_element_type, activation):
    return jax.lax.ragged_dot_general(lhs, rhs, group_sizes.value,
                                      ragged_dot_dimension_numbers)

  group_sizes = GroupSizes(sizes, 24)
  out = tk.ragged_dot(lhs, rhs, group_sizes, implementation=(unsupported, "mosaic", custom))
  assert seen == [["activation", "group_sizes", "precision", "preferred_element_type",
                   "ragged_dot_dimension_numbers"]]
  np.testing.assert_array_equal(out, jax.lax.ragged_dot(lhs, rhs, sizes))
  with pytest.raises(NotImplementedError, match="not this one"):
    tk.ragged_dot(lhs, rhs, sizes, implementation=(unsupported,))
  with pytest.raises(NotImplementedError, match="all implementations failed"):
    tk.ragged_dot(lhs, rhs, sizes, implementation=(unsupported, "mosaic"))


def test_group_offset_activation_and_manual_axis_type():
  lhs, rhs, sizes = _inputs(1)
  local = rhs[1:3]
  full = jnp.zeros_like(rhs).at[1:3].set(local)
  out = _jit(lambda: tk.ragged_dot(lhs, local, sizes, None, None, jnp.array([1], jnp.int32),
                                   jnp.tanh, manual_axis_type=object()))
  want = jnp.tanh(jax.lax.ragged_dot(lhs, full, sizes))
  np.testing.assert_allclose(out, want, **tolerances(jnp.float32, k=16, scale=16.0))


def test_ragged_dot_has_tokamax_signature():
  # ragged_dot_general's parameters without the dimension numbers, in tokamax's order: the
  # first five after group_sizes positional, the rest keyword-only.
  params = inspect.signature(tk.ragged_dot).parameters.values()
  assert [(p.name, p.kind == p.KEYWORD_ONLY) for p in params] == [
      ("lhs", False), ("rhs", False), ("group_sizes", False), ("precision", False),
      ("preferred_element_type", False), ("group_offset", False), ("activation", False),
      ("manual_axis_type", False), ("implementation", True), ("bypass_device_check", True),
      ("zero_initialize", True), ("fuse_gateup_activation", True)]
  lhs, rhs, sizes = _inputs(1)
  with pytest.raises(TypeError):
    tk.ragged_dot(lhs, rhs, sizes, None, None, None, None, None, "xla")


def test_activation_runs_in_f32_before_the_cast():
  lhs, rhs, sizes = _inputs(2)
  lhs, rhs = lhs.astype(jnp.bfloat16), rhs.astype(jnp.bfloat16)
  out = _jit(lambda: tk.ragged_dot(lhs, rhs, sizes, activation=jax.nn.silu))
  assert out.dtype == jnp.bfloat16
  z = gmm_oracle(lhs, rhs, np.asarray(sizes), "m")
  want = z / (1 + np.exp(-z))
  np.testing.assert_allclose(f64(out), want, **tolerances(jnp.bfloat16, k=16, scale=16.0))


@pytest.mark.parametrize("fuse", ["silu", "gelu_tanh", "swigluoai", "silu_and_mul_with_clamp"])
def test_fuse_gateup_activation(fuse):
  lhs, rhs, sizes = _inputs(3, n=16)
  z = gmm_oracle(lhs, rhs, np.asarray(sizes), "m")
  gate, up = z[:, :8], z[:, 8:]
  if fuse == "silu":
    want = gate / (1 + np.exp(-gate)) * up
  elif fuse == "gelu_tanh":
    want = 0.5 * gate * (1 + np.tanh(np.sqrt(2 / np.pi) * (gate + 0.044715 * gate**3))) * up
  elif fuse == "swigluoai":  # gpt-oss: gate clamped above at 7, up to [-7, 7], 1.702, up + 1
    gate, up = np.minimum(gate, 7.0), np.clip(up, -7.0, 7.0)
    want = gate / (1 + np.exp(-1.702 * gate)) * (up + 1)
  else:  # DeepSeek-V4's: gate clamped above at 10, up to [-10, 10], plain silu
    gate, up = np.minimum(gate, 10.0), np.clip(up, -10.0, 10.0)
    want = gate / (1 + np.exp(-gate)) * up
  out = _jit(lambda: tk.ragged_dot(lhs, rhs, sizes, fuse_gateup_activation=fuse))
  assert out.shape == (24, 8)
  np.testing.assert_allclose(f64(out), want, **tolerances(jnp.float32, k=16, scale=64.0))
  with pytest.raises(NotImplementedError, match="Unsupported fused activation"):
    tk.ragged_dot(lhs, rhs, sizes, fuse_gateup_activation="relu_and_mul")


def test_quantized_rhs_as_tokamax_takes_it():
  """tokamax takes qwix QArrays; gmm_jax's own QArray runs the weight-only mode."""
  lhs, rhs, sizes = _inputs(4)
  weights = gmm_jax.quantize(rhs, jnp.int8, channelwise_axes=(0, 2))
  out = _jit(lambda: tk.ragged_dot(lhs, weights, sizes))
  want = gmm_oracle(lhs, dequantize(weights), np.asarray(sizes), "m")
  np.testing.assert_allclose(f64(out), want, **tolerances(jnp.float32, k=16, scale=16.0))


@pytest.mark.parametrize("api", ["ragged_dot", "trans_rhs"])
def test_quantized_operands_on_xla_are_dequantized_first(api):
  """With implementation="xla", QArrays are dequantized in their scale's dtype before the
  product, as tokamax's XLA implementation does (its ``quantization.as_array``, qwix's
  ``dequantize``): with bf16 scales each value is rounded to bf16, which the product of
  the quantized values times the scales (gmm's scaled mode) is not, by far more than the
  f32 tolerance. MaxText's quantized tokamax path makes these calls."""
  lhs, rhs, sizes = _inputs(5)
  x = gmm_jax.quantize(lhs, jnp.int8, channelwise_axes=(0,), scale_dtype=jnp.bfloat16)
  if api == "trans_rhs":
    rhs = jnp.swapaxes(rhs, 1, 2)  # [G, N, K]
  w = gmm_jax.quantize(rhs, jnp.int8, channelwise_axes=(0, 1 if api == "trans_rhs" else 2),
                       scale_dtype=jnp.bfloat16)
  kwargs = dict(preferred_element_type=jnp.float32, implementation="xla")
  got = _jit(lambda: tk.ragged_dot(x, w, sizes, **kwargs) if api == "ragged_dot" else
             tk.ragged_dot_general(x, w, sizes, DIMS["trans_rhs"], **kwargs))

  def oracle(q, in_bf16):
    exact = dequantize(q)  # q * scale, exact in f32 for int8 values and bf16 scales
    return f64(jnp.asarray(exact, jnp.float32).astype(jnp.bfloat16)) if in_bf16 else exact

  def want(in_bf16):
    weights = oracle(w, in_bf16)
    weights = np.swapaxes(weights, 1, 2) if api == "trans_rhs" else weights
    return gmm_oracle(oracle(x, in_bf16), weights, np.asarray(sizes), "m")

  tol = tolerances(jnp.float32, k=16, scale=16.0)
  np.testing.assert_allclose(f64(got), want(True), **tol)
  assert not np.allclose(f64(got), want(False), **tol)


def test_mismatched_reduction_dimensions_raise_value_error():
  lhs, rhs, sizes = _inputs()
  with pytest.raises(ValueError, match="reduction dimension"):
    tk.ragged_dot(lhs[:, :8], rhs, sizes)
  with pytest.raises(ValueError, match="RaggedDotDimensionNumbers"):
    tk.ragged_dot_general(lhs, rhs, sizes, ((1,), (1,)))


def test_equals_tokamax_live():
  tokamax = pytest.importorskip("tokamax")
  for name in CASES:
    spec, a = _case(name)
    sizes = jnp.asarray(a["group_sizes"])
    want = _call(tokamax, a["lhs"], a["rhs"], sizes, spec, tokamax.RaggedDotGroupSizes)
    got = _call(tk, a["lhs"], a["rhs"], sizes, spec, tokamax.RaggedDotGroupSizes)
    np.testing.assert_allclose(f64(got), f64(want), **_tol(spec, a, scale=16.0))


def test_group_sizes_object_as_maxtext_builds_it():
  """MaxText builds tokamax.RaggedDotGroupSizes(group_sizes, num_rows); it travels through
  jit as a pytree and gives the sizes its value holds."""
  lhs, rhs, sizes = _inputs(9)
  group_sizes = tk.RaggedDotGroupSizes(sizes, lhs.shape[0])
  assert tk.GroupSizes is tk.RaggedDotGroupSizes
  got = jax.jit(lambda l, r, gs: tk.ragged_dot(l, r, gs, implementation="xla"))(
      lhs, rhs, group_sizes)
  np.testing.assert_allclose(f64(got), gmm_oracle(lhs, rhs, np.asarray(sizes), "m"),
                             **tolerances(jnp.float32, k=16, scale=16.0))
  assert tk.GroupSizes(np.asarray([3, 0, 5], np.int32), 8).representative_value == (3, 0, 5)
  assert tk.GroupSizes(jax.ShapeDtypeStruct((3,), jnp.int32), 8).representative_value == (
      3, 3, 2)
  assert tk.GroupSizes(sizes, (1, 2, 3, 4)[:len(sizes)]).repr_value_or_total_size == (
      1, 2, 3, 4)[:len(sizes)]
  with pytest.raises(ValueError, match="integers"):
    tk.GroupSizes(jnp.zeros(3, jnp.float32), 3)
  with pytest.raises(ValueError, match="same length"):
    tk.GroupSizes(sizes, (1,) * (len(sizes) + 1))
