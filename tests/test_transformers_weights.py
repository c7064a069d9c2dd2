"""nn.from_transformers / nn.to_transformers against Hugging Face transformers' own MoE blocks.

The reference is transformers itself: tests/fixtures/hf/<arch>.npz hold, for each
architecture of ARCHS (DeepSeek-V3 and GLM4-MoE also without shared experts), a tiny block's
config, weights, input, output, gradients (of ``sum(y * cotangent)``), chosen experts and
auxiliary losses, written by tests/fixtures/hf/make_fixtures.py with torch (CPU) and
transformers 5.x (5.24.0 the first twelve architectures', 5.25.0 the others'). The default run
needs neither: it builds the layer from each fixture's config and state dict. The live test
(skipped unless torch and transformers import) draws fresh random blocks, builds the layer
from the block object itself and runs transformers next to it.
"""

from __future__ import annotations

import importlib.util
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

nnx = pytest.importorskip("flax.nnx")

from gmm_jax import nn  # noqa: E402

FIXTURES = pathlib.Path(__file__).resolve().parent / "fixtures" / "hf"
ARCHS = ("aria", "beam", "cohere2_moe", "dbrx", "deepseek_v2", "deepseek_v3",
         "deepseek_v3_no_shared", "deepseek_v32", "dots1", "ernie4_5_moe", "ernie4_5_vl_moe",
         "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm4_moe_no_shared",
         "glm4v_moe", "glm_moe_dsa", "gpt_oss", "granitemoe", "granitemoe_swa",
         "granitemoehybrid", "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "jamba", "jetmoe",
         "kimi_linear", "lara_mini", "lfm2_moe", "llama4", "longcat_flash", "mellum",
         "mimo_v2_flash", "minicpm5_moe", "minimax", "minimax_m2", "mistral4",
         "mistral_large4", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe",
         "qwen3_moe", "qwen3_next", "qwen3_omni_moe_talker_text", "qwen3_omni_moe_text",
         "qwen3_vl_moe", "qwen4_exp", "solar_open", "switch_transformers")
# The config's model_type of a fixture whose name is not it.
MODEL_TYPES = {"aria": "aria_text", "mistral_large4": "mistral_large4_text",
               "deepseek_v3_no_shared": "deepseek_v3", "glm4_moe_no_shared": "glm4_moe",
               "ernie4_5_vl_moe": "ernie4_5_vl_moe_text",
               "glm4v_moe": "glm4v_moe_text", "llama4": "llama4_text",
               "qwen3_5_moe": "qwen3_5_moe_text", "qwen3_vl_moe": "qwen3_vl_moe_text",
               "qwen4_exp": "qwen4_exp_text"}
RTOL = ATOL = 1e-5

# A compiled forward + backward of the layer costs seconds of XLA:CPU compile (~4 s of CPU
# each, with jax_disable_most_optimizations). By default: the architectures whose options
# only they use (a gated shared expert; gpt-oss's interleave, biases and clamp; router
# weights on the input; Switch's plain FFN and per-sequence capacity; LFM2-MoE's epsilon in
# the renormalization; Cohere2-MoE's halved shared output); the others with -m slow. Every
# architecture's layout, options and round trip are checked by default without compiling
# the layer (test_layout_computes_the_blocks_ffn, test_options_from_config, test_round_trip).
DEFAULT_RUN = {"qwen2_moe", "gpt_oss", "llama4", "switch_transformers", "lfm2_moe",
               "cohere2_moe"}


def _by_arch(names, slow=False):
  return pytest.mark.parametrize("arch", [
      pytest.param(a, marks=[pytest.mark.slow] if slow and a not in DEFAULT_RUN else [])
      for a in names])


def _load(arch):
  with np.load(FIXTURES / f"{arch}.npz") as data:
    return {name: data[name] for name in data.files}


def _state_dict(fixture, kind="param"):
  return {name[len(kind) + 1:]: value for name, value in fixture.items()
          if name.startswith(kind + "/")}


def _config(fixture):
  return json.loads(str(fixture["config"]))




def _run(moe, x, cotangent):
  """One compiled program: (y, aux, dx, the parameter gradients as a layer of the same
  structure, the chosen experts [T, k])."""
  graphdef, params, rest = nnx.split(moe, nnx.Param, ...)

  @jax.jit
  def run(params, rest, x):
    def loss(params, x):
      layer = nnx.merge(graphdef, params, rest)
      y, aux = layer(x)
      experts = layer.route_tokens(x.reshape(-1, x.shape[-1]))[3]
      return jnp.sum(y * cotangent), (y, aux, experts)
    (_, out), grads = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(params, x)
    return out, grads

  (y, aux, experts), (dparams, dx) = run(params, rest, x)
  return y, aux, dx, nnx.merge(graphdef, dparams, rest), experts


def _check(arch, moe, fixture, float64=None):
  """The layer reproduces the fixture's transformers block. `float64`: a float64 run of the
  same block ({"y", "dx", "grad/<name>"}), the reference where the layer and the block's
  float32 run differ: then the layer must match it, and the block's float32 value be
  further from it (transformers' own rounding, not the layer's)."""
  reference = {}

  def assert_close(ours, key):
    theirs = fixture[key]
    try:
      np.testing.assert_allclose(ours, theirs, rtol=RTOL, atol=ATOL, err_msg=key)
    except AssertionError:
      if float64 is None:
        raise
      reference.update(reference or float64())
      exact = reference[key]
      np.testing.assert_allclose(ours, exact, rtol=RTOL, atol=ATOL, err_msg=f"{key} (float64)")
      assert np.max(np.abs(theirs - exact)) > np.max(np.abs(ours - exact)), key

  x = jnp.asarray(fixture["x"])
  # Llama 4's block returns [T, D]; the layer keeps x's shape.
  y, aux, dx, grads, experts = _run(moe, x, jnp.asarray(fixture["cotangent"]).reshape(x.shape))
  np.testing.assert_array_equal(np.sort(np.asarray(experts), -1),
                                np.sort(fixture["experts"], -1))
  assert_close(np.reshape(y, fixture["y"].shape), "y")
  assert_close(np.asarray(dx), "dx")
  # The gradients in transformers' names and layout (the layouts permute entries).
  expected = _state_dict(fixture, "grad")
  got = nn.to_transformers(grads, _config(fixture))
  assert set(expected) <= set(got), sorted(set(expected) - set(got))
  for name in expected:
    assert_close(got[name], f"grad/{name}")
  if "aux/router_z_loss" in fixture:
    np.testing.assert_allclose(aux["router_z_loss"], fixture["aux/router_z_loss"],
                               rtol=RTOL)
  # Switch's own balance loss averages per sequence (the others' over all tokens).
  if "aux/load_balancing_loss" in fixture and arch != "switch_transformers":
    np.testing.assert_allclose(aux["load_balancing_loss"], fixture["aux/load_balancing_loss"],
                               rtol=RTOL)


def test_fixtures_are_whole():
  """One fixture per entry of ARCHS, each written by transformers >= 5, small in all."""
  assert sorted(p.stem for p in FIXTURES.glob("*.npz")) == sorted(ARCHS)
  total = sum(p.stat().st_size for p in FIXTURES.glob("*.npz"))
  # A fixture of ~46 KB per entry of ARCHS: each block at the smallest shapes its checks
  # need (D=16, F=12, 8 experts for 4 groups of top-2 sums), its float32 weights and their
  # gradients, which do not compress.
  assert total < 2.5 * 1024 * 1024, total
  for arch in ARCHS:
    fixture = _load(arch)
    versions = json.loads(str(fixture["versions"]))
    assert int(versions["transformers"].split(".")[0]) >= 5, (arch, versions)
    assert _config(fixture)["model_type"] == MODEL_TYPES.get(arch, arch), arch


@pytest.fixture
def fast_compile():
  """XLA's optimizations off for the test (the compile is most of its time)."""
  previous = jax.config.read("jax_disable_most_optimizations")
  jax.config.update("jax_disable_most_optimizations", True)
  yield
  jax.config.update("jax_disable_most_optimizations", previous)


@_by_arch(ARCHS, slow=True)
def test_matches_transformers(arch, fast_compile):
  """Forward, input and parameter gradients, chosen experts and auxiliary losses equal
  transformers' for the fixture's block, built from its config and state dict."""
  fixture = _load(arch)
  moe = nn.from_transformers(_config(fixture), _state_dict(fixture))
  _check(arch, moe, fixture)


@_by_arch(ARCHS)
def test_round_trip(arch):
  """to_transformers(from_transformers(config, state_dict)) is the state dict, bit for bit,
  under the same names; a prefix goes both ways."""
  fixture = _load(arch)
  config, state_dict = _config(fixture), _state_dict(fixture)
  moe = nn.from_transformers(config, state_dict)
  out = nn.to_transformers(moe, config)
  assert sorted(out) == sorted(state_dict)
  for name, value in state_dict.items():
    assert out[name].dtype == value.dtype and out[name].shape == value.shape, name
    np.testing.assert_array_equal(out[name], value, err_msg=name)
  prefix = "model.layers.3.mlp."
  by_name = nn.to_transformers(moe, MODEL_TYPES.get(arch, arch), prefix=prefix)
  assert sorted(by_name) == sorted(prefix + k for k in state_dict)
  whole_model = {**by_name, "model.layers.3.input_layernorm.weight": np.ones(4)}
  again = nn.from_transformers(json.dumps(config), whole_model, prefix=prefix)
  for name, value in nn.to_transformers(again, config).items():
    np.testing.assert_array_equal(value, state_dict[name], err_msg=name)


def test_bfloat16_weights_stay_bfloat16():
  """A bfloat16 checkpoint gives bfloat16 parameters (no param_dtype given) and comes back
  bit for bit (the routing bias as float32); param_dtype= casts."""
  import ml_dtypes
  fixture = _load("deepseek_v3")
  config = _config(fixture)
  state = {k: v.astype(ml_dtypes.bfloat16) for k, v in _state_dict(fixture).items()}
  moe = nn.from_transformers(config, state)
  assert moe.gate_up.kernel[...].dtype == jnp.bfloat16
  for name, value in nn.to_transformers(moe, config).items():
    if name == "gate.e_score_correction_bias":  # nn.MoE's routing bias is float32
      np.testing.assert_array_equal(value, state[name].astype(np.float32))
      continue
    assert value.dtype == ml_dtypes.bfloat16, name
    np.testing.assert_array_equal(value.view(np.uint16), state[name].view(np.uint16))
  wide = nn.from_transformers(config, state, param_dtype=jnp.float32)
  assert wide.router.kernel[...].dtype == jnp.float32


# The routing options each config maps to (the models' own defaults where a config leaves
# them out).
EXPECTED_OPTIONS = {
    "mixtral": dict(score="softmax", normalize_top_k=True, top_k=2),
    "phimoe": dict(score="sparsemixer", normalize_top_k=False, top_k=2),
    "qwen2_moe": dict(score="softmax", normalize_top_k=False, top_k=3),
    "qwen3_moe": dict(score="softmax", normalize_top_k=True, top_k=3),
    "qwen3_next": dict(score="softmax", normalize_top_k=True, top_k=3),
    "qwen3_omni_moe_talker_text": dict(score="softmax", normalize_top_k=False, top_k=3),
    "qwen3_omni_moe_text": dict(score="softmax", normalize_top_k=True, top_k=3),
    "deepseek_v2": dict(score="softmax", normalize_top_k=False, routed_scaling_factor=1.5,
                        num_expert_groups=4, top_k_groups=2, group_score="max", top_k=3),
    "deepseek_v3": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.5,
                        num_expert_groups=4, top_k_groups=2, top_k=3),
    "dots1": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.5,
                  num_expert_groups=4, top_k_groups=2, group_score="sum_top2", top_k=3),
    "ernie4_5_moe": dict(score="softmax", normalize_top_k=True, top_k=3),
    "ernie4_5_vl_moe": dict(score="softmax", normalize_top_k=True, top_k=2, mlp=12),
    "olmoe": dict(score="softmax", normalize_top_k=False, top_k=2),
    "exaone_moe": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.5,
                       num_expert_groups=2, top_k_groups=1, top_k=3),
    "jamba": dict(score="softmax", normalize_top_k=False, top_k=2),
    "cohere2_moe": dict(score="softmax", normalize_top_k=True, routed_scaling_factor=0.5,
                        shared_scale=0.5, top_k=3),
    "lfm2_moe": dict(score="sigmoid", normalize_top_k=True, normalize_epsilon=1e-6,
                     routed_scaling_factor=1.5, top_k=3),
    "solar_open": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=1.0,
                       num_expert_groups=None, top_k=2),
    "gpt_oss": dict(score="softmax", normalize_top_k=True, top_k=2),
    "granitemoe": dict(score="softmax", normalize_top_k=True, top_k=2),
    "granitemoehybrid": dict(score="softmax", normalize_top_k=True, top_k=3),
    "granitemoeshared": dict(score="softmax", normalize_top_k=True, top_k=2),
    "hunyuan_v1_moe": dict(score="softmax", normalize_top_k=True, top_k=2),
    "jetmoe": dict(score="softmax", normalize_top_k=True, top_k=2),
    "kimi_linear": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.0,
                        num_expert_groups=4, top_k_groups=2, group_score="sum_top2", top_k=3),
    "dbrx": dict(score="softmax", normalize_top_k=True, top_k=2),
    "deepseek_v3_no_shared": dict(score="sigmoid", normalize_top_k=True,
                                  routed_scaling_factor=2.5, num_expert_groups=4,
                                  top_k_groups=2, top_k=3),
    "deepseek_v32": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.0,
                         num_expert_groups=2, top_k_groups=1, top_k=2),
    "flex_olmo": dict(score="softmax", normalize_top_k=False, top_k=3),
    "glm4_moe": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=1.5,
                     num_expert_groups=None, top_k=2),
    "glm4_moe_no_shared": dict(score="sigmoid", normalize_top_k=False,
                               routed_scaling_factor=1.5, num_expert_groups=None, top_k=2),
    "glm4_moe_lite": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=1.8,
                          num_expert_groups=2, top_k_groups=1, top_k=2),
    "glm_moe_dsa": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.5,
                        num_expert_groups=None, top_k=3),
    "granitemoe_swa": dict(score="softmax", normalize_top_k=True, top_k=3),
    "glm4v_moe": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=1.5,
                      num_expert_groups=None, top_k=3),
    "minimax": dict(score="softmax", normalize_top_k=True, top_k=2),
    "qwen3_5_moe": dict(score="softmax", normalize_top_k=True, top_k=3),
    # No norm_topk_prob in its config: the block always renormalizes.
    "qwen3_vl_moe": dict(score="softmax", normalize_top_k=True, top_k=3),
    "qwen4_exp": dict(score="softmax", normalize_top_k=True, top_k=2),
    "aria": dict(score="softmax", normalize_top_k=True, top_k=2),
    "beam": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.5,
                 num_expert_groups=4, top_k_groups=2, top_k=3),
    "flint": dict(score="sigmoid", normalize_top_k=False, top_k=3),
    "hy_v3": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=2.826,
                  num_expert_groups=None, top_k=2),
    "lara_mini": dict(score="softmax", normalize_top_k=True, top_k=3),
    "mellum": dict(score="softmax", normalize_top_k=False, top_k=2),
    "mimo_v2_flash": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=1.5,
                          num_expert_groups=4, top_k_groups=2, top_k=2),
    "minicpm5_moe": dict(score="sigmoid", normalize_top_k=True, routed_scaling_factor=3.66,
                         num_expert_groups=2, top_k_groups=1, top_k=3),
    "mistral_large4": dict(score="softmax", normalize_top_k=True, routed_scaling_factor=1.5,
                           num_expert_groups=4, top_k_groups=2, top_k=3),
    "llama4": dict(score="sigmoid", normalize_top_k=False, top_k=1),
    "longcat_flash": dict(score="softmax", normalize_top_k=False, routed_scaling_factor=1.5,
                          top_k=3, num_experts=8, num_identity_experts=4),
    "minimax_m2": dict(score="sigmoid", normalize_top_k=True, top_k=3),
    "mistral4": dict(score="softmax", normalize_top_k=True, routed_scaling_factor=1.5,
                     num_expert_groups=4, top_k_groups=2, top_k=3),
    "switch_transformers": dict(score="softmax", normalize_top_k=False, top_k=1,
                                gated=False),
}


@_by_arch(ARCHS)
def test_options_from_config(arch):
  fixture = _load(arch)
  moe = nn.from_transformers(_config(fixture), _state_dict(fixture))
  for name, value in EXPECTED_OPTIONS[arch].items():
    assert getattr(moe, name) == value, (arch, name, getattr(moe, name))
  assert (moe.routing_bias is not None) == (arch in ROUTING_BIAS), arch
  assert (moe.shared is not None) == (arch in SHARED), arch


# The nn.MoE preset of each architecture (docs/transformers.md's table): its model's, or
# for a copy of another architecture's block, that one's (same routing and computation);
# Qwen3-Omni's talker has none (its shared expert's width is not in transformers' config
# defaults).
PRESETS = {"mixtral": "mixtral-8x7b", "qwen2_moe": "qwen1.5-moe-a2.7b",
           "qwen3_moe": "qwen3-moe-30b-a3b", "qwen3_next": "qwen3-next-80b-a3b",
           "qwen3_omni_moe_text": "qwen3-moe-30b-a3b",
           "deepseek_v2": "deepseek-v2", "deepseek_v3": "deepseek-v3", "dots1": "dots.llm1",
           "ernie4_5_moe": "ernie-4.5-21b-a3b",
           "ernie4_5_vl_moe": "ernie-4.5-vl-28b-a3b-text", "hunyuan_v1_moe": "hunyuan-a13b",
           "jetmoe": "jetmoe-8b", "kimi_linear": "kimi-linear-48b-a3b",
           "longcat_flash": "longcat-flash", "phimoe": "phi-3.5-moe", "olmoe": "olmoe-1b-7b",
           "gpt_oss": "gpt-oss-120b",
           "granitemoe": "granite-3.0-3b-a800m", "dbrx": "dbrx", "glm4_moe": "glm-4.5-air",
           "llama4": "llama-4-scout", "minimax_m2": "minimax-m2",
           "granitemoehybrid": "granite-4.0-h-tiny", "jamba": "jamba-v0.1",
           "lfm2_moe": "lfm2-8b-a1b",
           "solar_open": "solar-open-100b", "mistral4": "mistral-small-4",
           "switch_transformers": "switch-base-8",
           "deepseek_v32": "deepseek-v3", "flex_olmo": "olmoe-1b-7b",
           "glm4v_moe": "glm-4.5-air", "minimax": "mixtral-8x7b",
           "qwen3_5_moe": "qwen3-next-80b-a3b", "qwen3_vl_moe": "qwen3-moe-30b-a3b",
           "glm4_moe_lite": "glm-4.5-air", "glm_moe_dsa": "glm-4.5-air",
           "granitemoe_swa": "granite-3.0-3b-a800m", "qwen4_exp": "qwen3-next-80b-a3b",
           "hy_v3": "deepseek-v3", "minicpm5_moe": "deepseek-v3"}


def _routing_kind(moe):
  return dict(score=moe.score, normalize_top_k=moe.normalize_top_k, gated=moe.gated,
              activation=moe.activation, router_weight_on=moe.router_weight_on,
              routing_bias=moe.routing_bias is not None,
              router_bias=moe.router.bias is not None, expert_bias=moe.down.bias is not None,
              shared=moe.shared is not None,
              shared_gate=moe.shared is not None and moe.shared.gate is not None)


@pytest.mark.parametrize("arch", sorted(PRESETS))
def test_preset_routes_as_the_block(arch):
  """Each architecture's preset (its real model's shapes) routes and computes as the layer
  from_transformers builds from the tiny config (built abstractly: no weights drawn)."""
  fixture = _load(arch)
  moe = nn.from_transformers(_config(fixture), _state_dict(fixture))
  preset = nnx.eval_shape(lambda: nn.MoE.from_preset(PRESETS[arch], rngs=nnx.Rngs(0)))
  assert _routing_kind(preset) == _routing_kind(moe)


def _silu(z):
  return z / (1 + np.exp(-z))


def _hf_expert(arch, p, config, e, x):
  """Expert e of the fixture's block on token x ``[D]``, as transformers' modeling code
  computes it from its own tensors (float64)."""
  if arch == "gpt_oss":
    gate_up = x @ p["experts.gate_up_proj"][e] + p["experts.gate_up_proj_bias"][e]
    gate, up = gate_up[0::2], gate_up[1::2]  # interleaved columns
    limit, alpha = config["swiglu_limit"], config["swiglu_alpha"]
    gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    hidden = (up + 1) * gate / (1 + np.exp(-alpha * gate))
    return hidden @ p["experts.down_proj"][e] + p["experts.down_proj_bias"][e]
  if arch in ("llama4", "aria"):  # [E, D, 2F]
    gate, up = np.split(x @ p["experts.gate_up_proj"][e], 2)
    return (up * _silu(gate)) @ p["experts.down_proj"][e]
  if arch == "dbrx":
    experts = config["ffn_config"]["moe_num_experts"]
    w1, v1, w2 = (p[f"experts.mlp.{n}"].reshape(experts, -1, x.shape[0])[e]
                  for n in ("w1", "v1", "w2"))
    return (_silu(x @ w1.T) * (x @ v1.T)) @ w2
  if arch == "jetmoe":
    gate, up = np.split(p["input_linear.weight"][e] @ x, 2)
    return p["output_linear.weight"][e] @ (_silu(gate) * up)
  if arch == "switch_transformers":
    hidden = np.maximum(p[f"experts.expert_{e}.wi.weight"] @ x, 0)
    return p[f"experts.expert_{e}.wo.weight"] @ hidden
  gate, up = np.split(p["experts.gate_up_proj"][e] @ x, 2)
  return p["experts.down_proj"][e] @ (_silu(gate) * up)


def _hf_shared(p, prefix, x):
  if f"{prefix}.input_linear.weight" in p:  # Granite: gate rows first
    gate, up = np.split(p[f"{prefix}.input_linear.weight"] @ x, 2)
    return p[f"{prefix}.output_linear.weight"] @ (_silu(gate) * up)
  gate, up = p[f"{prefix}.gate_proj.weight"] @ x, p[f"{prefix}.up_proj.weight"] @ x
  return p[f"{prefix}.down_proj.weight"] @ (_silu(gate) * up)


def _f64(variable):
  return np.asarray(variable[...], np.float64)


def _our_expert(moe, e, x):
  """Expert e of the layer on token x, from its parameters as nn.MoE defines them (the
  gate half of ``gate_up.kernel [E, D, 2F]`` first)."""
  layer = moe.gate_up if moe.gated else moe.up
  z = x @ _f64(layer.kernel)[e]
  if layer.bias is not None:
    z = z + _f64(layer.bias)[e]
  if not moe.gated:
    hidden = np.maximum(z, 0)
  elif moe.activation == "swiglu_clamped":
    gate, up = np.split(z, 2)
    limit, alpha = moe.swiglu_limit, moe.swiglu_alpha
    gate, up = np.minimum(gate, limit), np.clip(up, -limit, limit)
    hidden = (up + 1) * gate / (1 + np.exp(-alpha * gate))
  else:
    gate, up = np.split(z, 2)
    hidden = _silu(gate) * up
  out = hidden @ _f64(moe.down.kernel)[e]
  return out if moe.down.bias is None else out + _f64(moe.down.bias)[e]


ROUTERS = {"gpt_oss": "router", "granitemoe": "router", "granitemoe_swa": "router",
           "granitemoehybrid": "router", "granitemoeshared": "router", "aria": "router",
           "hunyuan_v1_moe": "gate.wg", "jamba": "router", "jetmoe": "router.layer",
           "llama4": "router", "longcat_flash": "router.classifier", "phimoe": "router",
           "dbrx": "router.layer", "switch_transformers": "router.classifier"}
SHARED = {"qwen2_moe": "shared_expert", "qwen3_next": "shared_expert",
          "llama4": "shared_expert", "deepseek_v3": "shared_experts",
          "glm4_moe": "shared_experts", "deepseek_v32": "shared_experts",
          "glm4v_moe": "shared_experts", "qwen3_5_moe": "shared_expert",
          "glm4_moe_lite": "shared_experts", "glm_moe_dsa": "shared_experts",
          "qwen4_exp": "shared_expert", "aria": "shared_experts", "flint": "shared_expert",
          "hy_v3": "shared_experts", "lara_mini": "shared_expert",
          "minicpm5_moe": "shared_experts", "mistral_large4": "shared_experts",
          "mistral4": "shared_experts",
          "granitemoehybrid": "shared_mlp", "granitemoeshared": "shared_mlp",
          "exaone_moe": "shared_experts", "solar_open": "shared_experts",
          "cohere2_moe": "shared_experts", "deepseek_v2": "shared_experts",
          "dots1": "shared_experts", "ernie4_5_moe": "shared_experts",
          "hunyuan_v1_moe": "shared_mlp", "kimi_linear": "shared_experts",
          "qwen3_omni_moe_talker_text": "shared_expert"}
# Where the block is a decoder layer: the prefix of its routed block's tensors.
EXPERTS_AT = {"granitemoehybrid": "block_sparse_moe.", "granitemoeshared": "block_sparse_moe."}
# Where the block keeps the correction bias that only selects.
ROUTING_BIAS = {"deepseek_v3": "gate.e_score_correction_bias",
                "deepseek_v3_no_shared": "gate.e_score_correction_bias",
                "deepseek_v32": "gate.e_score_correction_bias",
                "glm4_moe": "gate.e_score_correction_bias",
                "glm4_moe_no_shared": "gate.e_score_correction_bias",
                "glm4_moe_lite": "gate.e_score_correction_bias",
                "glm4v_moe": "gate.e_score_correction_bias",
                "glm_moe_dsa": "gate.e_score_correction_bias",
                "beam": "gate.e_score_correction_bias", "hy_v3": "e_score_correction_bias",
                "mimo_v2_flash": "gate.e_score_correction_bias",
                "minicpm5_moe": "gate.e_score_correction_bias",
                "minimax_m2": "e_score_correction_bias",
                "exaone_moe": "gate.e_score_correction_bias",
                "solar_open": "gate.e_score_correction_bias", "lfm2_moe": "expert_bias",
                "dots1": "gate.e_score_correction_bias",
                "ernie4_5_moe": "gate.moe_statics.e_score_correction_bias",
                "ernie4_5_vl_moe": "gate.moe_statics.e_score_correction_bias",
                "kimi_linear": "gate.e_score_correction_bias",
                "longcat_flash": "router.e_score_correction_bias"}


@_by_arch(ARCHS)
def test_layout_computes_the_blocks_ffn(arch):
  """Each expert, the shared expert, its gate and the router of the layer compute, in
  numpy, what transformers' modeling code computes from the block's own tensors: the
  layout is read right (a transposed or swapped half gives other numbers), without
  compiling the layer."""
  fixture = _load(arch)
  config, p = _config(fixture), {k: v.astype(np.float64) for k, v in _state_dict(fixture).items()}
  at = EXPERTS_AT.get(arch, "")
  p = {k[len(at):] if k.startswith(at) else k: v for k, v in p.items()}
  moe = nn.from_transformers(config, _state_dict(fixture))
  tokens = fixture["x"].reshape(-1, fixture["x"].shape[-1]).astype(np.float64)[:3]
  for x in tokens:
    for e in range(moe.num_experts):
      np.testing.assert_allclose(_our_expert(moe, e, x), _hf_expert(arch, p, config, e, x),
                                 rtol=1e-6, atol=1e-9, err_msg=f"expert {e}")
    router = ROUTERS.get(arch, "gate")
    logits = p[f"{router}.weight"] @ x + p.get(f"{router}.bias", 0)
    ours = x @ _f64(moe.router.kernel)
    if moe.router.bias is not None:
      ours = ours + _f64(moe.router.bias)
    np.testing.assert_allclose(ours, logits, rtol=1e-6, atol=1e-9)
    if arch in SHARED:
      up, down = _f64(moe.shared.up.kernel), _f64(moe.shared.down.kernel)
      gate, value = np.split(x @ up, 2)
      np.testing.assert_allclose((_silu(gate) * value) @ down, _hf_shared(p, SHARED[arch], x),
                                 rtol=1e-6, atol=1e-9)
    if "shared_expert_gate.weight" in p:
      np.testing.assert_allclose(x @ _f64(moe.shared.gate.kernel),
                                 p["shared_expert_gate.weight"] @ x, rtol=1e-6, atol=1e-9)
  if arch == "jetmoe":
    np.testing.assert_array_equal(_f64(moe.output_bias), p["bias"])
  if arch in ROUTING_BIAS:  # Ernie 4.5's is [1, E]
    np.testing.assert_array_equal(_f64(moe.routing_bias), p[ROUTING_BIAS[arch]].reshape(-1))


def _per_expert(fixture, names):
  """The fixture's fused experts in transformers 4.x's layout: one module per expert."""
  state = _state_dict(fixture)
  gate_up, down = state.pop("experts.gate_up_proj"), state.pop("experts.down_proj")
  mlp = gate_up.shape[1] // 2
  for e in range(gate_up.shape[0]):
    state[f"experts.{e}.{names[0]}.weight"] = gate_up[e, :mlp]
    state[f"experts.{e}.{names[1]}.weight"] = gate_up[e, mlp:]
    state[f"experts.{e}.{names[2]}.weight"] = down[e]
  return state


@pytest.mark.parametrize("arch,legacy", [
    ("mixtral", lambda f: _per_expert(f, ("w1", "w3", "w2"))),
    ("qwen2_moe", lambda f: _per_expert(f, ("gate_proj", "up_proj", "down_proj"))),
    ("deepseek_v3", lambda f: _per_expert(f, ("gate_proj", "up_proj", "down_proj"))),
    ("granitemoe", lambda f: {
        "router.layer.weight": f["param/router.weight"],
        "input_linear.weight": f["param/experts.gate_up_proj"],
        "output_linear.weight": f["param/experts.down_proj"]}),
], ids=["mixtral", "qwen2_moe", "deepseek_v3", "granitemoe"])
def test_transformers_4_layouts(arch, legacy):
  """transformers 4.x's per-expert modules (and GraniteMoE's input/output_linear) load as
  the same layer as 5.x's fused tensors."""
  fixture = _load(arch)
  moe = nn.from_transformers(_config(fixture), legacy(fixture))
  for name, value in nn.to_transformers(moe, arch).items():
    np.testing.assert_array_equal(value, fixture[f"param/{name}"], err_msg=name)


def test_bad_inputs():
  fixture = _load("mixtral")
  config, state = _config(fixture), _state_dict(fixture)
  with pytest.raises(NotImplementedError, match="'llama': not a MoE block known here"):
    nn.from_transformers({**config, "model_type": "llama"}, state)
  with pytest.raises(ValueError, match="no 'gate.weight'"):
    nn.from_transformers(config, {k: v for k, v in state.items() if k != "gate.weight"})
  with pytest.raises(ValueError, match="does not read.*extra"):
    nn.from_transformers(config, {**state, "extra": np.zeros(3)})
  with pytest.raises(ValueError, match=r"\(8, 24, 16\).*\(8, 26, 16\)"):
    nn.from_transformers({**config, "intermediate_size": 13}, state)
  with pytest.raises(ValueError, match="needs the state_dict"):
    nn.from_transformers(config)
  with pytest.raises(NotImplementedError, match="activation 'relu'"):
    nn.from_transformers({**config, "hidden_act": "relu"}, state)
  dbrx = _load("dbrx")
  dbrx_config = _config(dbrx)
  dbrx_config["ffn_config"] = {**dbrx_config["ffn_config"], "moe_normalize_expert_weights": 2}
  with pytest.raises(NotImplementedError, match="2-norm"):
    nn.from_transformers(dbrx_config, _state_dict(dbrx))
  v2 = _load("deepseek_v2")
  with pytest.raises(NotImplementedError, match="topk_method='noaux_tc'"):
    nn.from_transformers({**_config(v2), "topk_method": "noaux_tc"}, _state_dict(v2))
  with pytest.raises(NotImplementedError, match="mlp_bias"):
    nn.from_transformers({**_config(v2), "mlp_bias": True}, _state_dict(v2))
  ernie = _load("ernie4_5_moe")
  with pytest.raises(NotImplementedError, match="max\\(their sum, moe_norm_min\\)"):
    nn.from_transformers({**_config(ernie), "moe_norm_min": 0.5}, _state_dict(ernie))
  with pytest.raises(NotImplementedError, match="use_bias"):
    nn.from_transformers({**_config(ernie), "use_bias": True}, _state_dict(ernie))
  with pytest.raises(NotImplementedError, match="modality-isolated"):
    nn.from_transformers(type("Ernie4_5_VLMoeMoeBlock", (), {"state_dict": dict})())
  hunyuan = _load("hunyuan_v1_moe")
  with pytest.raises(ValueError, match="per layer"):
    nn.from_transformers({**_config(hunyuan), "moe_topk": [2, 2]}, _state_dict(hunyuan))
  with pytest.raises(NotImplementedError, match="attention experts"):
    nn.from_transformers(type("JetMoeMoA", (), {"state_dict": dict})())
  longcat = _load("longcat_flash")
  with pytest.raises(NotImplementedError, match="leave out"):
    nn.from_transformers({**_config(longcat), "router_bias": True}, _state_dict(longcat))
  switch = _load("switch_transformers")
  # Switch's expert_capacity counts each sequence's assignments per expert, whatever S is.
  capped = nn.from_transformers(_config(switch), _state_dict(switch))
  assert capped.expert_capacity == _config(switch)["expert_capacity"]
  assert capped.capacity_per == "sequence" and capped.capacity_factor is None
  dropless = nn.from_transformers(_config(switch), _state_dict(switch), capacity_factor=None)
  assert dropless.capacity_factor is None and dropless.expert_capacity is None
  # A layer without the shared expert a Qwen2-MoE block has cannot be written as one.
  moe = nn.from_transformers(config, state)
  with pytest.raises(ValueError, match="lacks"):
    nn.to_transformers(moe, "qwen2_moe")
  with pytest.raises(ValueError, match="top_k"):
    nn.to_transformers(moe, {**config, "num_experts_per_tok": 3})


def test_no_shared_experts():
  """n_shared_experts=0: transformers keeps a zero-width shared expert; the layer has none,
  loads without it too, and writes it back (by config or by name); a wider one is an
  error, and so is a layer with a shared expert written for such a config."""
  for arch in ("deepseek_v3_no_shared", "glm4_moe_no_shared"):
    fixture = _load(arch)
    config, state = _config(fixture), _state_dict(fixture)
    assert state["shared_experts.gate_proj.weight"].shape == (0, 16)
    moe = nn.from_transformers(config, state)
    assert moe.shared is None
    stripped = {k: v for k, v in state.items() if not k.startswith("shared_experts.")}
    again = nn.from_transformers(config, stripped)
    for name, value in nn.to_transformers(again, MODEL_TYPES[arch]).items():
      np.testing.assert_array_equal(value, state[name], err_msg=name)
  wide = _state_dict(_load("deepseek_v3"))
  no_shared = _config(_load("deepseek_v3_no_shared"))
  with pytest.raises(ValueError, match=r"shared_experts.gate_proj.weight has shape \(12, 16\)"):
    nn.from_transformers(no_shared, wide)
  with_shared = nn.from_transformers(_config(_load("deepseek_v3")), wide)
  with pytest.raises(ValueError, match="which it would lose"):
    nn.to_transformers(with_shared, no_shared)


# An architecture of each kind of reason: not a routed FFN, an option missing, not yet.
@pytest.mark.parametrize("model_type,block_class,reason", [
    ("doge", "DogeCDMoE", "not a routed FFN: product-key routing"),
    ("laguna", "LagunaSparseMoeBlock", "needs router logit soft-capping"),
    ("hy_v4", "HYV4MoE", "needs a clamped SwiGLU"),
    ("afmoe", "AfmoeSparseMoeBlock", "not yet: the layer expresses it"),
])
def test_refuses_what_it_cannot_express(model_type, block_class, reason):
  """A config or a block of an architecture the layer cannot express raises
  NotImplementedError naming its model_type and block class and what is missing."""
  state = _state_dict(_load("mixtral"))
  message = f"transformers {model_type} \\({block_class}\\): {reason}"
  with pytest.raises(NotImplementedError, match=message):
    nn.from_transformers({"model_type": model_type}, state)
  block = type(block_class, (), {"state_dict": lambda self: state})()  # a block's duck type
  with pytest.raises(NotImplementedError, match=message):
    nn.from_transformers(block)
  with pytest.raises(NotImplementedError, match=message):
    nn.to_transformers(nn.from_transformers(_config(_load("mixtral")), state), model_type)
  # A block of a class not known here: named with its config's model_type.
  other = type("SomeMoE", (), {"state_dict": lambda self: state,
                               "config": {"model_type": model_type}})()
  with pytest.raises(NotImplementedError, match=message):
    nn.from_transformers(other)


def test_every_unsupported_entry_names_itself():
  """Each refusal of the registry, by config (its model_type and other model_types), by
  block and by name, says which model_type and block classes and why; a model_type that
  loads (its other block does) refuses only the classes listed."""
  from gmm_jax.nn.hf_architectures import ARCHITECTURES
  from gmm_jax.nn.hf_unsupported import UNSUPPORTED
  known = {name for arch in ARCHITECTURES.values() for name in (arch.name, *arch.model_types)}
  state = _state_dict(_load("mixtral"))
  moe = nn.from_transformers(_config(_load("mixtral")), state)
  for model_type, entry in UNSUPPORTED.items():
    message = f"transformers {model_type} ({' / '.join(entry.blocks)}): {entry.reason}"
    names = list(entry.blocks)
    if model_type in known:
      assert not entry.aliases, model_type
    else:
      names += [model_type, *entry.aliases]
      for name in (model_type, *entry.aliases):
        with pytest.raises(NotImplementedError) as raised:
          nn.from_transformers({"model_type": name}, state)
        assert message in str(raised.value), name
    for block_class in entry.blocks:
      block = type(block_class, (), {"state_dict": lambda self: state})()
      with pytest.raises(NotImplementedError) as raised:
        nn.from_transformers(block)
      assert message in str(raised.value), block_class
    for name in names:
      with pytest.raises(NotImplementedError) as raised:
        nn.to_transformers(moe, name)
      assert message in str(raised.value), name


def _docs_table():
  """docs/transformers.md's table of every MoE block: each model_type of a row's first cell
  -> the row's status cell."""
  docs = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "transformers.md").read_text()
  section = docs.split("## Every MoE block of transformers")[1].split("\n## ")[0]
  rows = {}
  for line in section.splitlines():
    cells = [c.strip() for c in line.strip().strip("|").split("|")]
    if line.startswith("| `") and len(cells) >= 4:
      row = cells[2], cells[1] + " " + cells[3]
      for name in cells[0].split("`")[1::2]:
        assert name not in rows, name  # one row per model type
        rows[name] = row
  return rows


def test_docs_list_every_block():
  """Each architecture here and each one refused has its row, with its status (a model type
  whose block loads and another is refused: supported, naming the refused block)."""
  from gmm_jax.nn.hf_architectures import ARCHITECTURES
  from gmm_jax.nn.hf_unsupported import UNSUPPORTED
  rows = _docs_table()
  for arch in ARCHITECTURES.values():
    status = [rows[n][0] for n in (arch.name, *arch.model_types) if n in rows]
    assert status and all(s.startswith("supported") for s in status), arch.name
  for model_type, entry in UNSUPPORTED.items():
    status, text = rows[model_type]
    if any(model_type in (a.name, *a.model_types) for a in ARCHITECTURES.values()):
      assert status.startswith("supported"), model_type
      assert all(f"`{block}`" in text for block in entry.blocks), model_type
    else:
      assert status.startswith("not"), model_type
    for alias in entry.aliases:
      assert rows.get(alias, (status,))[0] == status, alias


def test_imports_neither_torch_nor_transformers():
  """gmm_jax.nn's converter (its hf* modules) reads tensors by duck typing: no import of
  torch or transformers (module or function level)."""
  import ast
  imported = set()
  sources = sorted(pathlib.Path(nn.__file__).parent.glob("hf*.py"))
  assert len(sources) > 1, sources
  for node in (n for p in sources for n in ast.walk(ast.parse(p.read_text()))):
    if isinstance(node, ast.Import):
      imported |= {alias.name.split(".")[0] for alias in node.names}
    elif isinstance(node, ast.ImportFrom) and node.module:
      imported.add(node.module.split(".")[0])
  assert not imported & {"torch", "transformers"}, imported


def _make_fixtures():
  pytest.importorskip("torch")
  pytest.importorskip("transformers")
  spec = importlib.util.spec_from_file_location("make_fixtures", FIXTURES / "make_fixtures.py")
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  return module


def _float64_run(make_fixtures, arch, block, fixture):
  """A float64 copy of the block run on the fixture's input and cotangent: its output, input
  gradient and weight gradients, as the fixture names them."""
  import copy

  import torch
  block = copy.deepcopy(block).double()
  for param in block.parameters():
    param.grad = None
  x = torch.from_numpy(fixture["x"]).double().requires_grad_(True)
  y = make_fixtures.run_block(arch, block, x)
  torch.sum(y * torch.from_numpy(fixture["cotangent"]).double()).backward()
  out = {"y": y.detach().numpy(), "dx": x.grad.numpy()}
  for name, param in block.named_parameters():
    if f"grad/{name}" in fixture:
      grad = param.grad if param.grad is not None else torch.zeros_like(param)
      out[f"grad/{name}"] = grad.numpy()
  return out


@_by_arch(ARCHS)
def test_live_transformers(arch, fast_compile):
  """With torch and transformers installed: a freshly drawn block (another seed than the
  fixture's), the layer built from the block object itself; the same checks (where the
  layer and the block's float32 run differ, both against a float64 run of the block); and
  to_transformers' state dict loaded into the block (strict) gives the same output."""
  make_fixtures = _make_fixtures()
  import torch
  fixture, block = make_fixtures.make(arch, seed=20261202)
  moe = nn.from_transformers(block)
  _check(arch, moe, fixture, float64=lambda: _float64_run(make_fixtures, arch, block, fixture))
  state = nn.to_transformers(moe, _config(fixture))
  ffn = make_fixtures.LAYER_FFN.get(arch)  # a decoder layer: its FFN's tensors only
  result = block.load_state_dict({k: torch.from_numpy(np.array(v)) for k, v in state.items()},
                                 strict=ffn is None)
  if ffn is not None:
    assert not result.unexpected_keys, result.unexpected_keys
    assert not [k for k in result.missing_keys if k.startswith(ffn)], result.missing_keys
  with torch.no_grad():
    out = make_fixtures.run_block(arch, block, torch.from_numpy(fixture["x"]))
  np.testing.assert_array_equal(out.numpy(), fixture["y"])


def test_granite_shared_mlp_beside_the_block():
  """GraniteMoeShared's FFN is its decoder layer's routed block plus the shared MLP beside
  it: the layer's other tensors are ignored; without a shared MLP
  (shared_intermediate_size=0, the config's default) the layer has none and exports none;
  the routed block alone is refused with what to pass instead."""
  fixture = _load("granitemoeshared")
  config, state = _config(fixture), _state_dict(fixture)
  layer = {**state, "self_attn.q_proj.weight": np.zeros((4, 4)),
           "input_layernorm.weight": np.ones(4)}
  moe = nn.from_transformers(config, layer)
  assert moe.shared is not None and moe.shared.gate is None
  routed_only = {k: v for k, v in state.items() if not k.startswith("shared_mlp.")}
  plain = nn.from_transformers({**config, "shared_intermediate_size": 0}, routed_only)
  assert plain.shared is None
  for target in ({**config, "shared_intermediate_size": 0}, "granitemoeshared"):
    out = nn.to_transformers(plain, target)
    assert sorted(out) == sorted(routed_only)
  with pytest.raises(ValueError, match="lacks"):
    nn.to_transformers(plain, config)
  with pytest.raises(ValueError, match="pass the decoder layer"):
    nn.to_transformers(plain, "GraniteMoeSharedMoE")


def test_lfm2_moe_without_expert_bias():
  """LFM2-MoE's expert_bias exists only with use_expert_bias: without it the layer has no
  routing bias and exports none (by config or by name)."""
  fixture = _load("lfm2_moe")
  config = {**_config(fixture), "use_expert_bias": False}
  state = {k: v for k, v in _state_dict(fixture).items() if k != "expert_bias"}
  moe = nn.from_transformers(config, state)
  assert moe.routing_bias is None and moe.normalize_epsilon == 1e-6
  for target in (config, "lfm2_moe"):
    assert sorted(nn.to_transformers(moe, target)) == sorted(state)
  with pytest.raises(ValueError, match="lacks"):
    nn.to_transformers(moe, _config(fixture))


@pytest.mark.parametrize("selection,strategy,norm,expected", [
    ("sigmoid", "sum", True, dict(score="sigmoid", normalize_top_k=True,
                                  routed_scaling_factor=1.0, shared_scale=1.0)),
    ("sigmoid", "average", False, dict(score="sigmoid", normalize_top_k=False,
                                       routed_scaling_factor=0.5, shared_scale=0.5)),
    ("softmax", "sum", False, dict(score="softmax", normalize_top_k=True,
                                   routed_scaling_factor=1.0, shared_scale=1.0)),
])
def test_cohere2_moe_options(selection, strategy, norm, expected):
  """Cohere2-MoE's expert_selection_fn (the softmax of the top-k logits is always
  renormalized; their sigmoid by norm_topk_prob) and shared_expert_combination_strategy;
  no shared experts: neither read nor written; an unknown strategy is refused."""
  fixture = _load("cohere2_moe")
  config = {**_config(fixture), "expert_selection_fn": selection,
            "shared_expert_combination_strategy": strategy, "norm_topk_prob": norm}
  moe = nn.from_transformers(config, _state_dict(fixture))
  for name, value in expected.items():
    assert getattr(moe, name) == value, name
  routed = {k: v for k, v in _state_dict(fixture).items() if not k.startswith("shared_")}
  alone = nn.from_transformers({**config, "num_shared_experts": 0}, routed)
  assert alone.shared is None and alone.routed_scaling_factor == 1.0
  assert sorted(nn.to_transformers(alone, "cohere2_moe")) == sorted(routed)
  with pytest.raises(NotImplementedError, match="'sum' and 'average'"):
    nn.from_transformers({**config, "shared_expert_combination_strategy": "max"},
                         _state_dict(fixture))


@pytest.mark.parametrize("name,reason", [
    ("gemma4_text", "pre_feedforward_layernorm_2"), ("gemma4", "per_expert_scale"),
    ("Gemma4TextDecoderLayer", "routes the residual"),
    ("nllb-moe", "top-1 mask"), ("NllbMoeSparseMLP", "top-1 assignment ranked before"),
])
def test_refused_architectures(name, reason):
  """Gemma 4's MoE (router and experts on different inputs, a norm after the experts) and
  NLLB-MoE (transformers' block routes by its top-1 mask's values; capacity ranking and
  renormalization after drops) are refused, saying why, by model_type, block or name."""
  with pytest.raises(NotImplementedError, match=reason):
    if name[0].isupper():
      block = type(name, (), {"state_dict": lambda self: {}})()
      nn.from_transformers(block)
    else:
      nn.from_transformers({"model_type": name}, {"router.weight": np.zeros((2, 2))})
  with pytest.raises(NotImplementedError, match=reason):
    nn.to_transformers(nn.from_transformers(_config(_load("mixtral")),
                                            _state_dict(_load("mixtral"))), name)


def test_nllb_moe_block_is_not_a_top2_moe_of_its_experts():
  """With torch and transformers: the reason NLLB-MoE is refused still holds. The block's
  output is expert_1 on every token times its top-1 weight plus expert_0 times its other
  weights, not the top-2 mixture of the chosen experts (if transformers changes this, the
  refusal's first reason is to be revisited)."""
  pytest.importorskip("torch")
  transformers = pytest.importorskip("transformers")
  import torch
  from transformers.models.nllb_moe import modeling_nllb_moe
  config = transformers.NllbMoeConfig(
      d_model=16, encoder_ffn_dim=12, decoder_ffn_dim=12, num_experts=4, expert_capacity=64,
      encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
      decoder_attention_heads=2, vocab_size=32, moe_token_dropout=0.0)
  generator = torch.Generator().manual_seed(0)
  block = modeling_nllb_moe.NllbMoeSparseMLP(config, 12).eval()
  with torch.no_grad():
    for tensor in block.parameters():
      tensor.copy_(torch.randn(tensor.shape, generator=generator))
    x = torch.randn(1, 6, 16, generator=generator)
    y = block(x).reshape(6, 16).numpy()
    tokens = x.reshape(6, 16)
    top1, weights, _ = block.router(tokens)
    expert = lambda e, t: block.experts[f"expert_{e}"](tokens[t]).numpy()  # noqa: E731
    mixture = np.stack([sum(float(weights[t, e]) * expert(e, t) for e in range(4))
                        for t in range(6)])
    by_mask = np.stack([sum(float(weights[t, e]) * expert(int(top1[t, e]), t)
                            for e in range(4)) for t in range(6)])
  np.testing.assert_allclose(y, by_mask, rtol=1e-5, atol=1e-5)
  assert np.max(np.abs(y - mixture)) > 1e-2
