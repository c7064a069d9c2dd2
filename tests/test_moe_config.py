"""`nn.MoEConfig`: each check of its `__post_init__` (the config, a `dataclasses.replace`
variant and the keyword form all raise it, with its message), the layer built from a
config against the one built from the same keywords (parameters, static attributes, output
and aux), a variant of a layer's config, the presets as configs, and frozen-ness."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

flax = pytest.importorskip("flax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from gmm_jax import nn  # noqa: E402
from gmm_jax.nn import presets  # noqa: E402

E, D, F = 8, 16, 12

# Options the config refuses: (options, exception, the start of its message).
BAD = [
    (dict(top_k=0), ValueError, "top_k must be in [1, 8], got 0"),
    (dict(top_k=9), ValueError, "top_k must be in [1, 8], got 9"),
    (dict(capacity_factor=0.0), ValueError, "capacity_factor must be positive, got 0.0"),
    (dict(expert_capacity=True), ValueError, "expert_capacity must be a positive int, got True"),
    (dict(expert_capacity=2.0), ValueError, "expert_capacity must be a positive int, got 2.0"),
    (dict(expert_capacity=0), ValueError, "expert_capacity must be a positive int, got 0"),
    (dict(expert_capacity=4, capacity_factor=1.0), ValueError,
     "expert_capacity=4 and capacity_factor=1.0 both bound the experts' load: give one"),
    (dict(gated_prologue="yes"), ValueError,
     "gated_prologue must be None (the platform's choice), True or False, got 'yes'"),
    (dict(activation="relu"), ValueError, "gated activation must be one of"),
    (dict(gated=False, activation="no-such"), ValueError, "unknown activation 'no-such'"),
    (dict(router_weight_on="both"), ValueError, "router_weight_on must be one of"),
    (dict(activation="swiglu_clamped", swiglu_alpha=0.0), ValueError,
     "swiglu_alpha must be a positive number, got 0.0"),
    (dict(swiglu_limit=5.0), ValueError, "swiglu_limit=5.0 and swiglu_alpha=1.702 are the "
     "constants of the gated activation 'swiglu_clamped', not of 'silu' (gated=True)"),
    (dict(capacity_per="batch"), ValueError, "capacity_per must be one of ('call', "
     "'sequence'), got 'batch'"),
    (dict(shared_gate=True), ValueError,
     "shared_gate=True gates the shared experts: it needs num_shared_experts >= 1"),
    (dict(shared_scale=0.5), ValueError,
     "shared_scale=0.5 scales the shared experts: it needs num_shared_experts >= 1"),
    (dict(layout="dense"), ValueError,
     "layout must be one of ('ragged', 'masked'), got 'dense'"),
    (dict(max_rows=4), ValueError,
     "max_rows is a positive int for layout='masked', got 4 with layout='ragged'"),
    (dict(layout="masked", max_rows=0), ValueError,
     "max_rows is a positive int for layout='masked', got 0 with layout='masked'"),
    (dict(layout="masked", partitionable=True), NotImplementedError,
     "layout='masked' runs on one device's view"),
    (dict(buffer_factor=0.0), ValueError, "buffer_factor must be positive, got 0.0"),
    (dict(num_identity_experts=-1), ValueError,
     "num_identity_experts must be an int >= 0, got -1"),
    (dict(num_identity_experts=2, capacity_factor=1.0), NotImplementedError,
     "num_identity_experts with capacity_factor, expert_capacity or a replacement router"),
    (dict(num_identity_experts=2, expert_capacity=3), NotImplementedError,
     "num_identity_experts with capacity_factor"),
    (dict(transport="nccl"), ValueError, "transport must be one of"),
    # The built-in router's options, checked by the config too.
    (dict(score="relu"), ValueError,
     "score must be one of ('softmax', 'sigmoid', 'sparsemixer'), got 'relu'"),
    (dict(score="sparsemixer", routing_bias=True), NotImplementedError,
     "score='sparsemixer' with normalize_top_k, routing_bias or group-limited routing"),
    (dict(score="sparsemixer", sparsemixer_eps=-0.1), ValueError,
     "sparsemixer_eps must be >= 0, got -0.1"),
    (dict(load_balancing_convention="hf"), ValueError,
     "load_balancing_convention must be one of"),
    (dict(normalize_epsilon=-1e-6), ValueError, "normalize_epsilon must be >= 0"),
    (dict(num_expert_groups=4), ValueError, "num_expert_groups and top_k_groups go together"),
    (dict(num_expert_groups=4, top_k_groups=2, group_score="min"), ValueError,
     "group_score must be one of ('sum_top2', 'max'), got 'min'"),
    (dict(num_expert_groups=3, top_k_groups=1), ValueError,
     "8 experts in 3 groups, choosing 1 of them: the groups must split the experts"),
    (dict(num_expert_groups=4, top_k_groups=1, top_k=3), ValueError,
     "top_k=3 is more than the experts of 1 groups"),
    (dict(normalize_top_k=False, normalize_epsilon=1e-6), ValueError,
     "normalize_epsilon=1e-06 is for the renormalization: it needs normalize_top_k"),
    # top_k=1 does not renormalize by default.
    (dict(top_k=1, normalize_epsilon=1e-6), ValueError,
     "normalize_epsilon=1e-06 is for the renormalization: it needs normalize_top_k"),
]


@pytest.mark.parametrize("options, error, message", BAD,
                         ids=[",".join(sorted(o)) + f"-{i}" for i, (o, _, _) in enumerate(BAD)])
def test_each_bad_option_is_refused_by_the_config(options, error, message):
  pattern = "^" + re.escape(message)
  with pytest.raises(error, match=pattern):
    nn.MoEConfig(E, D, F, **options)
  with pytest.raises(error, match=pattern):  # a variant is checked again
    dataclasses.replace(nn.MoEConfig(E, D, F), **options)
  with pytest.raises(error, match=pattern):  # the keyword form builds the config
    nn.MoE(E, D, F, rngs=nnx.Rngs(0), **options)


def test_the_router_options_count_the_identity_experts():
  """The built-in router scores E + Z experts: its groups split E + Z, as `Router`'s do."""
  options = dict(num_identity_experts=4, num_expert_groups=3, top_k_groups=1)
  config = nn.MoEConfig(E, D, F, **options)  # 12 experts in 3 groups
  layer = nnx.eval_shape(lambda: nn.MoE(config=config, rngs=nnx.Rngs(0)))
  assert layer.router.kernel.shape == (D, E + 4) and layer.router.num_expert_groups == 3
  with pytest.raises(ValueError, match="8 experts in 3 groups"):
    dataclasses.replace(config, num_identity_experts=0)


def test_what_only_the_layer_can_check():
  """The layer's arguments outside the config: a replacement router, the mesh arguments,
  and the config given beside options (or neither)."""
  config = nn.MoEConfig(E, D, F)
  router = nn.Router(D, E, rngs=nnx.Rngs(1))
  with pytest.raises(ValueError, match=re.escape(
      "router= replaces the built-in router: its options ['routing_bias', 'score'] do not "
      "apply")):
    nn.MoE(config=dataclasses.replace(config, score="sigmoid", routing_bias=True),
           router=router, rngs=nnx.Rngs(0))
  with pytest.raises(NotImplementedError, match="num_identity_experts with capacity_factor"):
    nn.MoE(config=dataclasses.replace(config, num_identity_experts=2), router=router,
           rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="router must have a route"):
    nn.MoE(config=config, router=nnx.Linear(D, E, rngs=nnx.Rngs(0)), rngs=nnx.Rngs(0))
  mesh = jax.make_mesh((1,), ("expert",))
  masked = dataclasses.replace(config, layout="masked")
  for mesh_argument in (dict(expert_parallel=(mesh, "expert")),
                        dict(data_parallel=(mesh, ("expert",)))):
    with pytest.raises(NotImplementedError, match="layout='masked' runs on one device"):
      nn.MoE(config=masked, rngs=nnx.Rngs(0), **mesh_argument)
  with pytest.raises(TypeError, match=re.escape("['top_k'] beside it would be ignored")):
    nn.MoE(config=config, top_k=1, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match=re.escape("['num_experts'] beside it")):
    nn.MoE(E, config=config, rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="MoE takes num_experts, embed and mlp"):
    nn.MoE(rngs=nnx.Rngs(0))
  with pytest.raises(TypeError, match="config must be a MoEConfig, got dict"):
    nn.MoE(config=config.keywords(), rngs=nnx.Rngs(0))


def _same_layer(a: nn.MoE, b: nn.MoE, x):
  """The two layers have the same structure and static attributes, the same parameters,
  and give the same output and aux on x."""
  assert nnx.graphdef(a) == nnx.graphdef(b)
  state_a, state_b = nnx.state(a), nnx.state(b)
  assert (jax.tree.structure(state_a) == jax.tree.structure(state_b))
  for leaf_a, leaf_b in zip(jax.tree.leaves(state_a), jax.tree.leaves(state_b)):
    np.testing.assert_array_equal(leaf_a, leaf_b)
  (y_a, aux_a), (y_b, aux_b) = a(x), b(x)
  np.testing.assert_array_equal(y_a, y_b)
  assert set(aux_a) == set(aux_b)
  for key in aux_a:
    np.testing.assert_array_equal(aux_a[key], aux_b[key], err_msg=key)


ROUND_TRIPS = {
    "defaults": dict(),
    "shared_gated_sigmoid_groups": dict(
        top_k=3, score="sigmoid", routing_bias=True, num_expert_groups=4, top_k_groups=2,
        routed_scaling_factor=2.0, num_shared_experts=1, shared_mlp=8, shared_gate=True),
    "clamped_biases_input_weights": dict(
        activation="swiglu_clamped", swiglu_limit=5.0, use_bias=True, router_bias=True,
        output_bias=True, router_weight_on="input", fused=False),
    "plain_relu_capacity": dict(top_k=1, gated=False, activation="relu",
                                capacity_factor=1.0, capacity_per="sequence"),
}


@pytest.mark.parametrize("name", sorted(ROUND_TRIPS))
def test_the_config_form_builds_the_keyword_layer(name):
  options = ROUND_TRIPS[name]
  x = jax.random.normal(jax.random.key(3), (2, 5, D))
  by_keywords = nn.MoE(E, D, F, rngs=nnx.Rngs(0), **options)
  config = nn.MoEConfig(E, D, F, **options)
  assert by_keywords.config == config
  by_config = nn.MoE(config=config, rngs=nnx.Rngs(0))
  assert by_config.config is config
  _same_layer(by_keywords, by_config, x)
  # And back: the config's keywords build it again.
  _same_layer(by_keywords, nn.MoE(**config.keywords(), rngs=nnx.Rngs(0)), x)


def test_a_variant_of_a_layers_config():
  layer = nn.MoE(E, D, F, top_k=2, rngs=nnx.Rngs(0))
  variant_config = dataclasses.replace(layer.config, top_k=1, num_shared_experts=1)
  assert layer.config.top_k == 2 and layer.config.num_shared_experts == 0  # untouched
  variant = nn.MoE(config=variant_config, rngs=nnx.Rngs(0))
  assert variant.top_k == 1 and variant.shared is not None and variant.config != layer.config
  x = jax.random.normal(jax.random.key(4), (6, D))
  _same_layer(variant, nn.MoE(E, D, F, top_k=1, num_shared_experts=1, rngs=nnx.Rngs(0)), x)
  y, aux = variant(x)
  assert y.shape == x.shape and aux["expert_load"].shape == (E,)


def test_the_presets_are_configs():
  assert set(presets.PRESET_CONFIGS) == set(nn.MOE_PRESETS)
  for name, config in presets.PRESET_CONFIGS.items():
    assert isinstance(config, nn.MoEConfig)
    # MOE_PRESETS is the configs' keyword form: every field, building the same config.
    assert nn.MOE_PRESETS[name] == config.keywords()
    assert nn.MoEConfig(**nn.MOE_PRESETS[name]) == config
  assert presets.PRESET_CONFIGS["deepseek-v3"].num_expert_groups == 8
  # Scaled widths: multiples of 8 (Qwen1.5-MoE: 2048, 1408, 5632 over 64).
  small = presets.preset("qwen1.5-moe-a2.7b", 1 / 64)
  assert (small.embed, small.mlp, small.shared_mlp) == (32, 24, 88)
  assert small.top_k == 4 and small.shared_gate
  assert presets.scaled("qwen1.5-moe-a2.7b", 1 / 64) == small.keywords()
  assert presets.preset("mixtral-8x7b", top_k=1).top_k == 1
  with pytest.raises(ValueError, match="256 experts in 3 groups"):
    presets.preset("deepseek-v3", num_expert_groups=3)
  with pytest.raises(ValueError, match="unknown preset 'mixtral'"):
    presets.preset("mixtral")
  # from_preset: the preset's config with the field overrides; the layer's own arguments
  # (kernel_metadata) beside it.
  layer = nnx.eval_shape(lambda: nn.MoE.from_preset(
      "deepseek-v3", scale=1 / 448, num_experts=16, kernel_metadata={"tag": "experts"},
      rngs=nnx.Rngs(0)))
  assert layer.config == presets.preset("deepseek-v3", 1 / 448, num_experts=16)
  assert layer.config.embed == 16 and layer.gate_up.kernel.shape == (16, 16, 2 * 8)
  assert layer.gate_up.kernel.get_metadata()["tag"] == "experts"


def test_a_config_is_frozen_and_hashable():
  config = nn.MoEConfig(E, D, F, top_k=3)
  with pytest.raises(dataclasses.FrozenInstanceError):
    config.top_k = 1
  assert config.top_k == 3
  same = nn.MoEConfig(E, D, F, top_k=3)
  assert config == same and hash(config) == hash(same)
  assert config != dataclasses.replace(config, top_k=2)
  with pytest.raises(TypeError):  # the options after the sizes are keywords
    nn.MoEConfig(E, D, F, 3)


def test_the_layer_under_nnx_jit_keeps_its_config():
  """The config is the layer's static data: the graph splits, merges and jits with it."""
  layer = nn.MoE(config=nn.MoEConfig(E, D, F, top_k=2), rngs=nnx.Rngs(0))
  x = jax.random.normal(jax.random.key(5), (6, D))
  graphdef, state = nnx.split(layer)
  assert nnx.merge(graphdef, state).config == layer.config
  y = nnx.jit(lambda model, x: model(x)[0])(layer, x)
  np.testing.assert_allclose(y, layer(x)[0], rtol=1e-5, atol=1e-6)
  assert jnp.isfinite(y).all()
