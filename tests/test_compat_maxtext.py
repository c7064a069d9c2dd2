"""gmm_jax.compat as MaxText's grouped matmuls: MaxText 0.2.5's MoE layer with
``maxtext.kernels.megablox`` replaced by `gmm_jax.compat.megablox` and ``tokamax`` by
`gmm_jax.compat.tokamax` must give MaxText's results.

* Replay (needs only jax and gmm_jax): every call MaxText's ``RoutedMoE`` made in the cases
  of tests/maxtext_calls.py, recorded by tests/fixtures/maxtext/make_fixtures.py (MaxText's
  own modules, 8 CPU devices), is made again with exactly the recorded arguments (MaxText's
  keyword names and values, its 9-tuple tiling, group_offset, the mesh axes the call ran
  under by hand) through the compat counterpart, on one device's arrays; the result and,
  for the calls moe.py makes itself, the vjp for the recorded cotangent must equal
  MaxText's.
* Live (skipped unless maxtext imports): the layer itself, forward and gradients, with
  ``maxtext.layers.moe.mblx`` / ``.tokamax`` swapped for the compat modules (and,
  separately, megablox's kernels ``backend.gmm`` / ``backend.tgmm`` swapped for
  compat.megablox's gmm / tgmm), against the unpatched layer. The tokamax case runs
  tokamax's XLA implementation where MaxText asks for Mosaic (TPU only), on both sides
  (``SUBSTITUTE`` in tests/maxtext_calls.py). All slow (seconds to a minute each on a
  CPU). Run them where maxtext is installed:
  ``pytest tests/test_compat_maxtext.py -n 0 -m slow -k "live or reproduces"``.

Tolerances are MaxText's own, from its tests/unit/moe_test.py: ``assert_moe_close`` for
results (float32 on the CPU: rtol 1e-5, atol 1e-6; bfloat16: rtol 2e-2, atol 1e-2) and
``compare_tree`` for gradients (relative norm difference below 1e-2); the layer output of
the quantized cases by ``compare_tree``'s criterion too (see `_compare_layer`). Rows
megablox leaves undefined (those outside the local groups) are not compared. A quantized
call or layer is also held, tensor by tensor, to 3x MaxText's own spread on it (its result
with the tiles halved or its other kernels: f32 rounding of the same quantized math),
which compare_tree's 1e-2 is too coarse for: gradients taken at the float operands instead
of the quantized ones are 0.5-1% off. gmm_jax's quantizer must give qwix's (MaxText's)
qvalues and scales bit for bit, on every jax version.
"""

from __future__ import annotations

import functools
import os
import types

import jax
import jax.numpy as jnp
import maxtext_calls as mc
import numpy as np
import pytest

import gmm_jax
from gmm_jax.compat import megablox as compat_megablox
from gmm_jax.compat import tokamax as compat_tokamax

SPECS, ARRAYS = mc.load_fixture() if os.path.exists(mc.FIXTURE) else ({}, None)
RECORDS = [(case, index) for case, spec in sorted(SPECS.items())
           for index in range(len(spec.get("calls", ())))]

COMPAT = {
    "mblx.gmm": compat_megablox.gmm,
    "backend.gmm": compat_megablox.gmm,
    "backend.tgmm": compat_megablox.tgmm,
    "tokamax.ragged_dot": compat_tokamax.ragged_dot,
    "tokamax.ragged_dot_general": compat_tokamax.ragged_dot_general,
}


def _qarray(qvalue, scale, zero_point, qtype):
  """A recorded qwix QArray as gmm_jax's (the same qvalue, scale and zero point)."""
  del qtype  # the qvalue's dtype
  return gmm_jax.QArray(qvalue, scale, zero_point)


def _group_sizes(value, repr_value_or_total_size):
  return compat_tokamax.RaggedDotGroupSizes(value, repr_value_or_total_size)


def _record_id(record):
  case, index = record
  call = SPECS[case]["calls"][index]
  return f"{case}-{index}-{call['api']}-shard{call['shard']}"


def _params():
  return [pytest.param(*record, id=_record_id(record)) for record in RECORDS]


def replay(case: str, index: int, fn=None):
  """(got, want, record) of one recorded call made again through `fn` (default: its
  compat counterpart); got and want are {"out": ..., "dlhs": ..., "drhs": ...} (the
  gradients where the record has MaxText's)."""
  spec = SPECS[case]
  record = spec["calls"][index]
  fn = fn or COMPAT[record["api"]]
  args, kwargs = mc.call_arguments(record, ARRAYS, qarray=_qarray, group_sizes=_group_sizes)
  values = dict(zip(record["positional"], args)) | kwargs
  grads = record.get("grads", {})
  cot = mc.get_array(ARRAYS, record["cot"]) if "cot" in record else None
  out, got_grads = mc.run_recorded(fn, record, values, list(grads), cot,
                                   spec.get("check_vma", False))
  want = {"out": mc.get_array(ARRAYS, record["out"])}
  want.update({f"d{k}": mc.get_array(ARRAYS, v) for k, v in grads.items()})
  got = {"out": np.asarray(out)}
  got.update({f"d{k}": np.asarray(v) for k, v in got_grads.items()})
  return got, want, record


def check(got, want, record, what=""):
  """MaxText's tolerances; a call MaxText quantizes itself also within 3x MaxText's own
  spread on it (`mc.NOISE_FACTOR`; the record's "maxtext_noise", written by
  make_fixtures.py: the largest over its variants and tensors, all of them f32 rounding of
  the same quantized operands; a tensor two variants compute alike has no spread of its
  own)."""
  rows = mc.get_array(ARRAYS, record["rows"]) if "rows" in record else None
  noise = record.get("maxtext_noise")
  noise = max(v for variant in noise.values() for v in variant.values()) if noise else None
  for key, value in want.items():
    assert got[key].shape == value.shape, (key, got[key].shape, value.shape)
    assert got[key].dtype == value.dtype, (key, got[key].dtype, value.dtype)
    selected = slice(None) if rows is None or key not in ("out", "dlhs") else rows
    if key == "out":
      mc.assert_moe_close(got[key][selected], value[selected], value.dtype, f"{what} {key}")
    else:
      mc.assert_grads_close(got[key][selected], value[selected], f"{what} {key}")
    if noise is not None:
      mc.assert_within_noise(got[key][selected], value[selected], noise, f"{what} {key}")


@pytest.mark.skipif(not RECORDS, reason="no MaxText fixture")
@pytest.mark.parametrize("case,index", _params())
def test_equals_maxtext_recorded_call(case, index):
  got, want, record = replay(case, index)
  check(got, want, record, f"{case} {record['api']}")


@pytest.mark.parametrize("case", sorted(SPECS))
def test_fixture_cases_ran_in_maxtext(case):
  """A case MaxText itself cannot run on the CPU has no calls: skipped with its error."""
  spec = SPECS[case]
  if "maxtext_error" in spec:
    pytest.skip(f"MaxText {spec['versions']['maxtext']} on the CPU: {spec['maxtext_error']}")
  assert spec["calls"] and spec["versions"]["maxtext"] and spec["versions"]["jax"]
  assert {c["api"] for c in spec["calls"]} & set(mc.TOP_LEVEL)
  for call in spec["calls"]:
    if mc.is_top_level(call):
      assert "vjp_error" not in call, call["vjp_error"]


def _first(api, predicate=lambda record, spec: True):
  for case, index in RECORDS:
    record = SPECS[case]["calls"][index]
    if record["api"] == api and predicate(record, SPECS[case]):
      return case, index
  pytest.skip(f"no recorded {api} call of that kind")


def _fake_quant(x, bound, axis):
  """x rounded to int8 with absmax / bound scales reduced over `axis` (clipped to
  [-128, 127]), as XLA compiled qwix's for the fixture (`_qwix_int8`); the gradient is the
  straight-through estimator's, as MaxText's."""
  x = x.astype(jnp.float32)
  scale = jnp.max(jnp.abs(x), axis=axis, keepdims=True) * (np.float32(1) / np.float32(bound))
  scale = jnp.where(scale == 0, 1.0, scale)
  rounded = jnp.clip(jnp.round(x * (1 / scale)), -128, 127) * scale
  return x + jax.lax.stop_gradient(rounded - x)


def test_a_127_int8_bound_is_caught():
  """The replay tells qwix's int8 bound (127.5, which MaxText's quantized gmm uses) from
  127: a compat that quantizes with 127 fails, one with 127.5 passes."""
  case, index = _first("mblx.gmm", lambda r, s: s["config"].get("quantization") == "int8"
                       and r["args"].get("lhs_quantize_dtype") is not None)

  def with_bound(bound):
    def gmm(lhs, rhs, group_sizes, **kwargs):
      transpose = kwargs.get("transpose_rhs", False)
      lhs = _fake_quant(lhs, bound, axis=1)
      # qwix's scales of rhs: per output column, over all groups
      rhs = _fake_quant(rhs, bound, axis=(0, 2) if transpose else (0, 1))
      kwargs = {k: v for k, v in kwargs.items() if k in (
          "preferred_element_type", "tiling", "group_offset", "interpret")}
      return compat_megablox.gmm(lhs, rhs, group_sizes, **kwargs)
    return gmm

  got, want, record = replay(case, index, with_bound(127.5))
  check(got, want, record, "bound 127.5")
  got, want, record = replay(case, index, with_bound(127.0))
  with pytest.raises(AssertionError):
    check(got, want, record, "bound 127")


def test_an_ignored_group_offset_is_caught():
  """The device whose experts start past 0 (a traced group_offset) fails when the offset
  is dropped."""
  case, index = _first("mblx.gmm", lambda r, s: isinstance(r["args"].get("group_offset"), dict)
                       and r["shard"] != 0)

  def without_offset(*args, **kwargs):
    kwargs["group_offset"] = None
    return COMPAT["mblx.gmm"](*args, **kwargs)

  got, want, record = replay(case, index, without_offset)
  with pytest.raises(AssertionError):
    check(got, want, record, "no group_offset")


# MaxText's quantization of each operand (maxtext/kernels/megablox/ops.py, its hand-made
# qwix rule): the activations per row, the weights per output column (shared by experts).
CHANNEL_AXES = {"lhs": (0,), "rhs": (2,)}


def _quantized_operands():
  """(id, float operand, qwix's qvalue, qwix's scale, channelwise axes) of every QArray a
  recorded kernel call got (MaxText quantized it with qwix), with the float array the
  mblx.gmm call of the same device and shapes got (the first of the alike calls, as the
  kernel call)."""
  found = []
  for case, index in RECORDS:
    record = SPECS[case]["calls"][index]
    quantized = {k: v["__qarray__"] for k, v in record["args"].items()
                 if k in CHANNEL_AXES and isinstance(v, dict) and "__qarray__" in v}
    values = {k: mc.get_array(ARRAYS, q["qvalue"]) for k, q in quantized.items()}
    for top in SPECS[case]["calls"]:
      floats = {k: mc.get_array(ARRAYS, top["args"][k]) for k in quantized
                if top["api"] == "mblx.gmm" and top["shard"] == record["shard"]}
      if floats and all(floats[k].shape == values[k].shape for k in quantized):
        found += [(f"{_record_id((case, index))}-{k}", floats[k], values[k],
                   mc.get_array(ARRAYS, quantized[k]["scale"]), CHANNEL_AXES[k])
                  for k in sorted(quantized)]
        break
  return found


QUANTIZED_OPERANDS = _quantized_operands()


@pytest.mark.parametrize("operand", [pytest.param(o, id=o[0]) for o in QUANTIZED_OPERANDS])
def test_the_quantizer_gives_maxtexts_qwix_bits(operand):
  """gmm_jax's quantizer with qwix's rule (absmax, bound qmax + 0.5 for integers, the
  type's largest value for floats, the operand's dtype for the scale) gives the qvalues
  and scales MaxText's qwix gave, bit for bit, on every jax version."""
  _, x, qvalue, scale, axes = operand
  assert tuple(i for i, size in enumerate(scale.shape) if size > 1) == axes, scale.shape
  integer = np.issubdtype(qvalue.dtype, np.integer)
  q = jax.jit(lambda x: gmm_jax.quantize(
      x, qvalue.dtype, channelwise_axes=axes, scale_dtype=x.dtype,
      bound=float(np.iinfo(qvalue.dtype).max) + 0.5 if integer else None))(x)
  np.testing.assert_array_equal(np.asarray(q.scale).reshape(scale.shape), scale)
  np.testing.assert_array_equal(np.asarray(q.qvalue), qvalue)


def _qwix_int8(x, axes, reciprocal=True):
  """qwix's int8 quantization of f32 `x` in numpy, as XLA compiles it: the scale is the
  absmax times the f32 reciprocal of 127.5 (a division by a constant), and x is rounded
  (half to even) either times the scale's f32 reciprocal (what XLA makes of a division by
  a broadcast scale on jax <= 0.12.0.1, where the fixture was recorded) or divided by it."""
  reduce = tuple(i for i in range(x.ndim) if i not in axes)
  scale = np.max(np.abs(x), axis=reduce, keepdims=True) * (np.float32(1) / np.float32(127.5))
  scale = np.where(scale > 0, scale, np.float32(1)).astype(np.float32)
  scaled = x * (np.float32(1) / scale) if reciprocal else x / scale
  return np.clip(np.rint(scaled), -128, 127).astype(np.int8)


def test_maxtexts_int8_values_sit_on_rounding_ties():
  """The recorded int8 values are the numpy oracle's (x times the scale's reciprocal), and
  on some of them that rounding and a division differ: the bit check above tells them
  apart (a quantizer dividing, as XLA compiles qwix's on jax 0.12.1, fails it)."""
  operands = [o for o in QUANTIZED_OPERANDS if o[2].dtype == np.int8]
  assert operands, "no int8 operand recorded"
  differ = 0
  for name, x, qvalue, _, axes in operands:
    x = np.asarray(x, np.float32)
    np.testing.assert_array_equal(_qwix_int8(x, axes), qvalue, err_msg=name)
    differ += int(np.sum(_qwix_int8(x, axes, reciprocal=False) != qvalue))
  assert differ > 0


def float_operand_gradients(lhs, rhs, group_sizes, **kwargs):
  """compat.megablox's gmm, with the gradients of the unquantized gmm (at the float
  operands) instead of MaxText's (at the quantized ones)."""
  out = compat_megablox.gmm(lhs, rhs, group_sizes, **kwargs)
  kwargs = {k: v for k, v in kwargs.items() if k in (
      "preferred_element_type", "tiling", "group_offset", "transpose_rhs", "interpret")}
  unquantized = compat_megablox.gmm(lhs, rhs, group_sizes, **kwargs)
  return unquantized + jax.lax.stop_gradient(out - unquantized)


def test_float_operand_gradients_are_caught():
  """MaxText takes the gradients of a quantized gmm at the quantized operands (its
  weight gradient multiplies the lhs's int8 values by the cotangent times the lhs scales):
  a compat taking them at the float operands (0.5-1% off at int8) fails the replay."""
  case, index = _first("mblx.gmm", lambda r, s: s["config"].get("use_tokamax_gmm")
                       and "maxtext_noise" in r)
  got, want, record = replay(case, index)
  check(got, want, record, "compat")
  got, want, record = replay(case, index, float_operand_gradients)
  with pytest.raises(AssertionError, match="MaxText's own"):
    check(got, want, record, "float operand gradients")


# --- live: MaxText's layer with the compat modules in it -----------------------------------

def _maxtext():
  return pytest.importorskip("maxtext", reason="maxtext is not installed")


def _maxtext_layer(overrides, case=None):
  """MaxText's own layer of a config: (cfg, model, x, cot, (out, dx, grads)), tokamax's
  XLA implementation standing in for its Mosaic kernel (`mc.substituted`)."""
  import tokamax  # pylint: disable=import-outside-toplevel
  with mc.maxtext_tokamax(tokamax, tokamax, case):
    cfg, model = mc.build_layer(overrides)
    x, cot = mc.layer_inputs(cfg)
    return cfg, model, x, cot, mc.layer_vjp(cfg, model, x, cot)


@functools.lru_cache(maxsize=None)
def _reference(case):
  """MaxText's own layer: (cfg, model, x, cot, (out, dx, grads)) or the error it raised."""
  overrides = dict(mc.CASES[case])
  if case == "check_vma":
    # megablox's kernel interpreted under check_vma fails in MaxText itself (the Pallas
    # interpreter's dynamic_slice mixes varying and invariant operands); its results are
    # those of the same layer without the check.
    overrides["check_vma"] = False
  try:
    return _maxtext_layer(overrides, case)
  except Exception as err:  # pylint: disable=broad-exception-caught
    return f"{type(err).__name__}: {str(err)[:500]}"


@functools.lru_cache(maxsize=None)
def _maxtext_noise(case):
  """MaxText's own spread on a case's layer, {"out", "dx", each parameter: the largest
  relative norm difference of its variants (`mc.layer_variants`: the tiles halved, its
  other kernels) from its result}: what the f32 rounding of the same quantized math moves
  (a last-bit change of the up gmm's result can flip a rounding of the down gmm's
  quantized input, one quantization step in its result)."""
  _, _, _, _, (out, dx, grads) = _reference(case)
  variants = {}
  for name, overrides in mc.layer_variants(mc.CASES[case]).items():
    _, _, _, _, (v_out, v_dx, v_grads) = _maxtext_layer(overrides)
    variants[name] = dict(v_grads, out=v_out, dx=v_dx)
  return mc.spread(variants, dict(grads, out=out, dx=dx))


def _compare_layer(got, want, dtype, what, noise=None):
  """MaxText's tolerances (the output of a quantized layer by compare_tree's criterion,
  each call alone being held to assert_moe_close by the replay) and, with `noise` (a
  quantized case, `_maxtext_noise`), every tensor within 3x MaxText's own spread on it."""
  out, dx, grads = got
  want_out, want_dx, want_grads = want
  if noise is not None:
    mc.assert_grads_close(out, want_out, f"{what} out")
  else:
    mc.assert_moe_close(out, want_out, dtype, f"{what} out")
  mc.assert_grads_close(dx, want_dx, f"{what} dx")
  assert grads.keys() == want_grads.keys()
  for key in grads:
    mc.assert_grads_close(grads[key], want_grads[key], f"{what} d{key}")
  if noise is not None:
    for key, value, expected in [("out", out, want_out), ("dx", dx, want_dx)] + [
        (key, grads[key], want_grads[key]) for key in grads]:
      mc.assert_within_noise(value, expected, noise[key], f"{what} {key}")


# Not yet served (docs/migration.md): with only megablox's kernels swapped, MaxText casts
# the forward result to varying itself, which fails on a gmm_jax result (already varying).
# Strict: a fix makes it fail loudly.
NOT_YET = {("check_vma", "kernels")}


def _live_params():
  return [pytest.param(case, swap, id=f"{case}-{swap}", marks=[pytest.mark.xfail(
              strict=True, reason="MaxText pcasts a result that already varies")]
          if (case, swap) in NOT_YET else [])
          for case in sorted(mc.CASES) for swap in ("modules", "kernels")]


@pytest.mark.slow
@pytest.mark.parametrize("case, swap", _live_params())
def test_maxtext_layer_live(case, swap, monkeypatch):
  """MaxText's layer with its modules (moe.py's mblx and tokamax) or its kernels
  (megablox's backend.gmm / tgmm, and the tokamax calls of its megablox ops.gmm: its
  quantized tokamax path) swapped for the compat ones, against the unpatched layer."""
  _maxtext()
  import tokamax  # pylint: disable=import-outside-toplevel
  from maxtext.kernels.megablox import backend, ops  # pylint: disable=import-outside-toplevel
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  config = mc.CASES[case]
  if swap == "kernels" and config.get("use_tokamax_gmm") and not config.get("quantization"):
    pytest.skip("MaxText's unquantized tokamax path calls tokamax from the layer itself")
  reference = _reference(case)
  if isinstance(reference, str):
    pytest.skip(f"MaxText itself on the CPU: {reference}")
  _, _, x, cot, want = reference
  # MaxText's own spread first: the swaps below would be in its variants' layers too.
  noise = _maxtext_noise(case) if config.get("quantization") else None
  if swap == "modules":
    monkeypatch.setattr(moe, "mblx", compat_megablox)
    monkeypatch.setattr(moe, "tokamax", mc.substituted(compat_tokamax, case))
  else:
    monkeypatch.setattr(moe, "tokamax", mc.substituted(tokamax, case))
    monkeypatch.setattr(ops, "tokamax", mc.substituted(compat_tokamax, case))
    monkeypatch.setattr(backend, "gmm", compat_megablox.gmm)
    monkeypatch.setattr(backend, "tgmm", compat_megablox.tgmm)
  cfg, model = mc.build_layer(config)
  got = mc.layer_vjp(cfg, model, x, cot)
  _compare_layer(got, want, cfg.dtype, f"{case} ({swap} swapped)", noise)


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(set(SPECS) & set(mc.CASES)))
def test_installed_maxtext_reproduces_the_fixture(case):
  """The installed MaxText's layer gives what the fixture recorded (else the fixture is
  stale: rerun make_fixtures.py)."""
  _maxtext()
  spec = SPECS[case]
  reference = _reference(case)
  if isinstance(reference, str) or "layer" not in spec:
    pytest.skip(f"MaxText itself on the CPU: {spec.get('maxtext_error', reference)}")
  cfg, _, x, _, (out, dx, _) = reference
  np.testing.assert_array_equal(np.asarray(x), mc.get_array(ARRAYS, spec["layer"]["x"]))
  mc.assert_moe_close(out, mc.get_array(ARRAYS, spec["layer"]["out"]), cfg.dtype, "out")
  np.testing.assert_allclose(np.linalg.norm(np.asarray(dx, np.float32), axis=-1),
                             mc.get_array(ARRAYS, spec["layer"]["dx_norms"]),
                             **mc.moe_tolerance(cfg.dtype))


@pytest.mark.slow
def test_maxtext_layer_live_catches_a_wrong_kernel(monkeypatch):
  """The live comparison fails when the swapped kernel is off by a little (its result
  scaled by 1 + 1e-3)."""
  _maxtext()
  from maxtext.kernels.megablox import backend  # pylint: disable=import-outside-toplevel

  reference = _reference("fsdp")
  if isinstance(reference, str):
    pytest.skip(f"MaxText itself on the CPU: {reference}")
  _, _, x, cot, want = reference
  original = backend.gmm

  def off(*args, **kwargs):
    return original(*args, **kwargs) * (1 + 1e-3)

  monkeypatch.setattr(backend, "gmm", off)
  cfg, model = mc.build_layer(mc.CASES["fsdp"])
  got = mc.layer_vjp(cfg, model, x, cot)
  with pytest.raises(AssertionError):
    _compare_layer(got, want, cfg.dtype, "fsdp, off by 1e-3")


@pytest.mark.slow
def test_maxtext_layer_live_catches_float_operand_gradients(monkeypatch):
  """The live comparison of a quantized layer fails when the gradients are the float
  gmm's (`float_operand_gradients`, 0.5-1% off: compare_tree's 1e-2 alone cannot tell)."""
  _maxtext()
  from maxtext.layers import moe  # pylint: disable=import-outside-toplevel

  case = "tokamax_int8"
  reference = _reference(case)
  if isinstance(reference, str):
    pytest.skip(f"MaxText itself on the CPU: {reference}")
  _, _, x, cot, want = reference
  noise = _maxtext_noise(case)
  monkeypatch.setattr(moe, "mblx", types.SimpleNamespace(gmm=float_operand_gradients))
  cfg, model = mc.build_layer(mc.CASES[case])
  got = mc.layer_vjp(cfg, model, x, cot)
  with pytest.raises(AssertionError, match="MaxText's own"):
    _compare_layer(got, want, cfg.dtype, "float operand gradients", noise)
