"""Transformers configs -> `MoE` arguments: one options function per architecture (its
config's ``model_type``; `hf_architectures.ARCHITECTURES` names the one of each), and the
readers they share (`config_field`, `config_dict`, the activations).

A config may be the transformers object, its ``to_dict()`` or that as JSON; each function
returns the `MoE` arguments (``num_experts``, ``embed``, ``mlp`` and the options) of a block
of that config, or raises NotImplementedError for an option the layer cannot express.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

_REQUIRED = object()


def config_field(config, *names, default: Any = _REQUIRED):
  """The first of `names` that `config` (a transformers config or a dict) has."""
  for name in names:
    if isinstance(config, Mapping):
      if name in config and config[name] is not None:
        return config[name]
    elif getattr(config, name, None) is not None:
      return getattr(config, name)
  if default is _REQUIRED:
    raise ValueError(f"the config has none of {names}")
  return default


def config_dict(config) -> dict:
  """A config as a dict (a transformers config's ``to_dict()``; a JSON string parsed)."""
  if isinstance(config, str):
    config = json.loads(config)
  if isinstance(config, Mapping):
    return dict(config)
  if hasattr(config, "to_dict"):
    return config.to_dict()
  raise TypeError(f"a config must be a transformers config or a dict, got {type(config)}")


_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_new": "gelu_tanh",
                "gelu_pytorch_tanh": "gelu_tanh", "gelu_fast": "gelu_tanh",
                "gelu_tanh": "gelu_tanh", "relu": "relu"}
_GATED = ("silu", "gelu", "gelu_tanh")


def _activation(name: str, gated: bool = True) -> str:
  """A transformers ``hidden_act`` -> the nn.MoE activation name."""
  ours = _ACTIVATIONS.get(str(name))
  if ours is None or (gated and ours not in _GATED):
    supported = sorted(k for k, v in _ACTIVATIONS.items() if not gated or v in _GATED)
    raise NotImplementedError(f"activation {name!r}: supported here are {supported}")
  return ours


def _softmax_top_k(config, experts: str, mlp: str, normalize) -> dict:
  return dict(num_experts=int(config_field(config, *experts.split("|"))),
              embed=int(config_field(config, "hidden_size", "d_model")),
              mlp=int(config_field(config, *mlp.split("|"))),
              top_k=int(config_field(config, "num_experts_per_tok")),
              activation=_activation(config_field(config, "hidden_act", default="silu")),
              score="softmax", normalize_top_k=bool(normalize))


def mixtral(config):
  return _softmax_top_k(config, "num_local_experts|num_experts", "intermediate_size", True)


def qwen_shared(norm_default: bool):
  def options(config):
    kwargs = _softmax_top_k(config, "num_experts|num_local_experts", "moe_intermediate_size",
                            config_field(config, "norm_topk_prob", default=norm_default))
    kwargs.update(num_shared_experts=1, shared_gate=True,
                  shared_mlp=int(config_field(config, "shared_expert_intermediate_size")))
    return kwargs
  return options


def qwen3_moe(config):
  return _softmax_top_k(config, "num_experts|num_local_experts", "moe_intermediate_size",
                        config_field(config, "norm_topk_prob", default=False))


def _text_config(config):
  """A vision-language model's text config (``text_config``), or the config itself."""
  return config_field(config, "text_config", default=config)


def qwen3_vl_moe(config):
  # Its block renormalizes the top-k always: the config has no norm_topk_prob.
  return _softmax_top_k(_text_config(config), "num_experts|num_local_experts",
                        "moe_intermediate_size", True)


def qwen3_5_moe(config):
  kwargs = qwen_shared(True)(_text_config(config))
  kwargs["normalize_top_k"] = True  # its block renormalizes whatever the config says
  return kwargs


def glm4v_moe(config):
  return deepseek(_text_config(config))


def qwen4_exp(config):
  return qwen_shared(True)(_text_config(config))


def _renamed(config, **fields) -> dict:
  """A config as a dict with `fields` (ours: theirs) named as `deepseek` & co. read them."""
  config = config_dict(config)
  for ours, theirs in fields.items():
    if config.get(ours) is None and config.get(theirs) is not None:
      config[ours] = config[theirs]
  return config


def mellum(config):
  return _softmax_top_k(config, "num_local_experts|num_experts", "moe_intermediate_size",
                        config_field(config, "norm_topk_prob", default=True))


def ungated_shared(score):
  """Softmax or sigmoid top-k (norm_topk_prob) and one shared expert without a gate."""
  def options(config):
    kwargs = _softmax_top_k(config, "num_experts|num_local_experts", "moe_intermediate_size",
                            config_field(config, "norm_topk_prob", default=True))
    kwargs.update(score=score, num_shared_experts=1,
                  shared_mlp=int(config_field(config, "shared_expert_intermediate_size")))
    return kwargs
  return options


def _without_shared(options):
  """A DeepSeek-V3-style router whose block has no shared experts."""
  def without(config):
    kwargs = options(config)
    kwargs.pop("num_shared_experts", None), kwargs.pop("shared_mlp", None)
    return kwargs
  return without


def mimo_v2_flash(config):
  return _without_shared(deepseek)(config)


def beam(config):
  return _without_shared(deepseek)(_renamed(config, n_routed_experts="num_experts"))


def hy_v3(config):
  # Always renormalized; the shared experts' count is num_shared_experts.
  config = _renamed(config, n_routed_experts="num_experts",
                    n_shared_experts="num_shared_experts",
                    routed_scaling_factor="router_scaling_factor")
  return deepseek({**config, "norm_topk_prob": True, "n_group": 1})


def mistral_large4(config):
  # Mistral 4's routing (group-limited softmax scores, no bias; its mask of 0 for the other
  # groups' experts is -inf's for positive scores), always renormalized.
  return {**mistral4(_text_config(config)), "normalize_top_k": True}


def aria(config):
  config = _text_config(config)
  act = config_field(config, "hidden_act", default="silu")
  if _activation(act) != "silu":  # the routed experts are SiLU-gated whatever hidden_act says
    raise NotImplementedError(f"aria: hidden_act={act!r} for the shared experts and SiLU for "
                              f"the routed ones; nn.MoE has one activation for both")
  mlp = int(config_field(config, "intermediate_size"))
  return dict(num_experts=int(config_field(config, "moe_num_experts")),
              embed=int(config_field(config, "hidden_size")), mlp=mlp,
              top_k=int(config_field(config, "moe_topk")), activation="silu", score="softmax",
              normalize_top_k=True, num_shared_experts=1,
              shared_mlp=mlp * int(config_field(config, "moe_num_shared_experts")))


def qwen3_omni_moe_thinker(config):
  config = _text_config(config)
  return _softmax_top_k(config, "num_experts|num_local_experts", "moe_intermediate_size",
                        config_field(config, "norm_topk_prob", default=True))


def olmoe(config):
  return _softmax_top_k(config, "num_experts|num_local_experts", "intermediate_size",
                        config_field(config, "norm_topk_prob", default=False))


def granitemoe(config):
  # A softmax over the top-k logits: the renormalized top-k of the softmax.
  return _softmax_top_k(config, "num_local_experts|num_experts", "intermediate_size", True)


def jamba(config):
  return _softmax_top_k(config, "num_experts|num_local_experts", "intermediate_size", False)


def granite_shared_mlp(config):
  # GraniteMoE's routing; the decoder layer's shared MLP (none when its width is 0) added.
  kwargs = granitemoe(config)
  if not kwargs["num_experts"]:
    raise NotImplementedError(f"{config_field(config, 'model_type')} with num_local_experts=0: a "
                              f"dense layer (its shared MLP only), no experts to route to")
  shared = int(config_field(config, "shared_intermediate_size", default=0))
  if shared:
    kwargs.update(num_shared_experts=1, shared_mlp=shared)
  return kwargs


def gpt_oss(config):
  kwargs = _softmax_top_k(config, "num_local_experts|num_experts", "intermediate_size", True)
  kwargs.update(activation="swiglu_clamped", router_bias=True, use_bias=True,
                swiglu_limit=float(config_field(config, "swiglu_limit", default=7.0)),
                swiglu_alpha=float(config_field(config, "swiglu_alpha", default=1.702)))
  return kwargs


def cohere2_moe(config):
  # The top-k logits, their softmax (the renormalized top-k of the softmax) or their sigmoid
  # (renormalized with norm_topk_prob); shared experts added ("sum") or averaged with the
  # routed output ("average": both halved).
  selection = config_field(config, "expert_selection_fn", default="softmax")
  if selection not in ("softmax", "sigmoid"):
    raise NotImplementedError(f"cohere2_moe expert_selection_fn={selection!r}: supported "
                              f"are 'softmax' and 'sigmoid'")
  mlp = int(config_field(config, "intermediate_size"))
  kwargs = dict(num_experts=int(config_field(config, "num_experts", "num_local_experts")),
                embed=int(config_field(config, "hidden_size")), mlp=mlp,
                top_k=int(config_field(config, "num_experts_per_tok")),
                activation=_activation(config_field(config, "hidden_act", default="silu")),
                score=selection,
                normalize_top_k=(selection == "softmax"
                                 or bool(config_field(config, "norm_topk_prob", default=True))))
  shared = int(config_field(config, "num_shared_experts", default=0))
  if shared:
    strategy = config_field(config, "shared_expert_combination_strategy", default="average")
    if strategy not in ("sum", "average"):
      raise NotImplementedError(f"cohere2_moe shared_expert_combination_strategy="
                                f"{strategy!r}: supported are 'sum' and 'average'")
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
    if strategy == "average":
      kwargs.update(routed_scaling_factor=0.5, shared_scale=0.5)
  return kwargs


def deepseek(config):
  experts = int(config_field(config, "n_routed_experts", "num_local_experts"))
  mlp = int(config_field(config, "moe_intermediate_size"))
  groups = int(config_field(config, "n_group", default=1) or 1)
  top_groups = int(config_field(config, "topk_group", default=1) or 1)
  shared = int(config_field(config, "n_shared_experts", default=0) or 0)
  kwargs = dict(num_experts=experts, embed=int(config_field(config, "hidden_size")), mlp=mlp,
                top_k=int(config_field(config, "num_experts_per_tok")),
                activation=_activation(config_field(config, "hidden_act", default="silu")),
                score="sigmoid", routing_bias=True,
                normalize_top_k=bool(config_field(config, "norm_topk_prob", default=True)),
                routed_scaling_factor=float(config_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  if groups > 1:  # one group: no limit
    kwargs.update(num_expert_groups=groups, top_k_groups=top_groups)
  if shared:
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
  return kwargs


def lfm2_moe(config):
  # Sigmoid scores, the block's expert_bias selecting (use_expert_bias), renormalized with
  # 1e-6 added to the sum; the experts' activation is SiLU whatever hidden_act says.
  normalize = bool(config_field(config, "norm_topk_prob", default=True))
  kwargs = dict(num_experts=int(config_field(config, "num_experts", "num_local_experts")),
                embed=int(config_field(config, "hidden_size")),
                mlp=int(config_field(config, "moe_intermediate_size")),
                top_k=int(config_field(config, "num_experts_per_tok")), activation="silu",
                score="sigmoid", normalize_top_k=normalize,
                routing_bias=bool(config_field(config, "use_expert_bias", default=True)),
                routed_scaling_factor=float(config_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  if normalize:
    kwargs["normalize_epsilon"] = 1e-6
  return kwargs


def exaone_moe(config):
  # DeepSeek-V3's routing and shared experts under other config names.
  return deepseek(_renamed(config, n_routed_experts="num_experts",
                            n_shared_experts="num_shared_experts"))


def _plain_shared_expert(config, field: str, name: str):
  """Refuses a config whose shared expert has biases (`SharedExperts` has none)."""
  if config_field(config, field, default=False):
    raise NotImplementedError(f"{name} with {field}=True: the shared expert's biases "
                              f"(nn.MoE's shared experts have none)")


def deepseek_v2(config):
  method = config_field(config, "topk_method", default="greedy")
  if method not in ("greedy", "group_limited_greedy"):
    raise NotImplementedError(f"deepseek_v2 topk_method={method!r}: transformers' "
                              f"DeepseekV2TopkRouter has 'greedy' and 'group_limited_greedy'")
  _plain_shared_expert(config, "mlp_bias", "deepseek_v2")
  experts = int(config_field(config, "n_routed_experts", "num_experts"))
  mlp = int(config_field(config, "moe_intermediate_size"))
  shared = int(config_field(config, "n_shared_experts", default=0) or 0)
  # softmax top-k, never renormalized (the router ignores norm_topk_prob), then scaled.
  kwargs = dict(num_experts=experts, embed=int(config_field(config, "hidden_size")), mlp=mlp,
                top_k=int(config_field(config, "num_experts_per_tok")),
                activation=_activation(config_field(config, "hidden_act", default="silu")),
                score="softmax", normalize_top_k=False,
                routed_scaling_factor=float(config_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  groups = int(config_field(config, "n_group", default=1) or 1)
  if method == "group_limited_greedy" and groups > 1:  # one group: no limit
    kwargs.update(num_expert_groups=groups,
                  top_k_groups=int(config_field(config, "topk_group")), group_score="max")
  if shared:
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
  return kwargs


def ernie4_5_moe(config):
  kwargs = dict(num_experts=int(config_field(config, "moe_num_experts", "num_experts")),
                embed=int(config_field(config, "hidden_size")),
                mlp=int(config_field(config, "moe_intermediate_size")),
                top_k=int(config_field(config, "moe_k", "num_experts_per_tok")),
                activation=_activation(config_field(config, "hidden_act", default="silu")),
                score="softmax", normalize_top_k=True)
  # The weights are divided by max(sum, moe_norm_min): the sum of a softmax's top k is at
  # least k / E, so a moe_norm_min up to that never binds (the default is 1e-12).
  norm_min = float(config_field(config, "moe_norm_min", default=1e-12))
  if norm_min > kwargs["top_k"] / kwargs["num_experts"]:
    raise NotImplementedError(
        f"ernie4_5_moe moe_norm_min={norm_min} > top_k / num_experts: the chosen weights "
        f"divided by max(their sum, moe_norm_min); nn.MoE divides by their sum")
  kwargs["routing_bias"] = True
  shared = int(config_field(config, "moe_num_shared_experts", default=0) or 0)
  if shared:
    _plain_shared_expert(config, "use_bias", "ernie4_5_moe")
    kwargs.update(num_shared_experts=shared, shared_mlp=kwargs["mlp"] * shared)
  return kwargs


def ernie4_5_vl_moe(config):
  """One modality's experts of Ernie 4.5 VL (``mlp.text_moe`` / ``mlp.vision_moe``): Ernie
  4.5 MoE's routing, no shared expert (the parent block's); ``moe_intermediate_size`` is
  ``[text, vision]``: the text experts' width unless the config holds one number (the
  block's own, read from it)."""
  config = _text_config(config)
  widths = config_field(config, "moe_intermediate_size")
  width = widths[0] if isinstance(widths, (list, tuple)) else widths
  kwargs = ernie4_5_moe({**config_dict(config), "moe_intermediate_size": width,
                          "moe_num_shared_experts": 0})
  return kwargs


def hunyuan_v1_moe(config):
  experts, top_k = config_field(config, "num_experts"), config_field(config, "moe_topk")
  if isinstance(experts, (list, tuple)) or isinstance(top_k, (list, tuple)):
    raise ValueError(f"hunyuan_v1_moe: num_experts={experts} and moe_topk={top_k} per "
                     f"layer; pass a config with this layer's numbers (or the block, whose "
                     f"gate keeps them)")
  mlp = int(config_field(config, "intermediate_size"))
  # softmax top-k, always renormalized (even top-1); a shared MLP of the experts' width.
  return dict(num_experts=int(experts), embed=int(config_field(config, "hidden_size")), mlp=mlp,
              top_k=int(top_k),
              activation=_activation(config_field(config, "hidden_act", default="silu")),
              score="softmax", normalize_top_k=True, num_shared_experts=1, shared_mlp=mlp)


def dots1(config):
  # DeepSeek-V3's router (norm_topk_prob's default False), its group limit always applied.
  return deepseek({"norm_topk_prob": False, **config_dict(config)})


def kimi_linear(config):
  # DeepSeek-V3's router (its group limit always applied), under other config names.
  return deepseek(_renamed(config, n_routed_experts="num_experts",
                            num_experts_per_tok="num_experts_per_token",
                            norm_topk_prob="moe_renormalize", n_group="num_expert_group",
                            n_shared_experts="num_shared_experts"))


def longcat_flash(config):
  if config_field(config, "router_bias", default=False):
    raise NotImplementedError("longcat_flash router_bias=True: transformers' "
                              "LongcatFlashTopkRouter keeps a classifier bias its logits "
                              "leave out")
  # softmax over the routed and the zero (identity) experts, chosen with the correction
  # bias, not renormalized, scaled.
  return dict(num_experts=int(config_field(config, "n_routed_experts", "num_local_experts")),
              num_identity_experts=int(config_field(config, "zero_expert_num", default=0) or 0),
              embed=int(config_field(config, "hidden_size")),
              mlp=int(config_field(config, "expert_ffn_hidden_size", "moe_intermediate_size")),
              top_k=int(config_field(config, "moe_topk", "num_experts_per_tok")),
              activation=_activation(config_field(config, "hidden_act", default="silu")),
              score="softmax", routing_bias=True, normalize_top_k=False,
              routed_scaling_factor=float(config_field(config, "routed_scaling_factor",
                                                 default=1.0)))


def phimoe(config):
  # SparseMixer at inference: its sparsemixer() picks two experts whatever
  # num_experts_per_tok says.
  return dict(num_experts=int(config_field(config, "num_local_experts", "num_experts")),
              embed=int(config_field(config, "hidden_size")),
              mlp=int(config_field(config, "intermediate_size")), top_k=2,
              activation=_activation(config_field(config, "hidden_act", default="silu")),
              score="sparsemixer", normalize_top_k=False,
              sparsemixer_eps=float(config_field(config, "router_jitter_noise", default=0.01)))


def jetmoe(config):
  # A softmax over the top-k logits (= renormalized), and a bias [D] on the output.
  return dict(num_experts=int(config_field(config, "num_local_experts", "num_experts")),
              embed=int(config_field(config, "hidden_size")),
              mlp=int(config_field(config, "intermediate_size")),
              top_k=int(config_field(config, "num_experts_per_tok")),
              activation=_activation(config_field(config, "activation_function", "hidden_act",
                                            default="silu")),
              score="softmax", normalize_top_k=True, output_bias=True)


def dbrx(config):
  ffn = config_field(config, "ffn_config")
  top_k = int(config_field(ffn, "moe_top_k"))
  power = config_field(ffn, "moe_normalize_expert_weights", default=None)
  if power is not None and float(power) != 1.0 and top_k > 1:
    raise NotImplementedError(
        f"DBRX's moe_normalize_expert_weights={power}: the chosen weights divided by their "
        f"{power}-norm; supported are None (no normalization) and 1 (their sum), or top_k=1")
  act = config_field(ffn, "ffn_act_fn", default=None) or {"name": "silu"}
  return dict(num_experts=int(config_field(ffn, "moe_num_experts")),
              embed=int(config_field(config, "d_model", "hidden_size")),
              mlp=int(config_field(ffn, "ffn_hidden_size")), top_k=top_k,
              activation=_activation(act.get("name", "silu")), score="softmax",
              normalize_top_k=power is not None)


def minimax_m2(config):
  # Sigmoid scores, the block's correction bias only selecting, the chosen weights always
  # renormalized.
  return dict(num_experts=int(config_field(config, "num_local_experts", "num_experts")),
              embed=int(config_field(config, "hidden_size")),
              mlp=int(config_field(config, "intermediate_size")),
              top_k=int(config_field(config, "num_experts_per_tok")),
              activation=_activation(config_field(config, "hidden_act", default="silu")),
              score="sigmoid", routing_bias=True, normalize_top_k=True)


def mistral4(config):
  # DeepSeek-V3's group-limited routing on softmax scores, without a correction bias.
  mlp = int(config_field(config, "moe_intermediate_size"))
  groups = int(config_field(config, "n_group", default=1) or 1)
  shared = int(config_field(config, "n_shared_experts", default=1))
  kwargs = dict(num_experts=int(config_field(config, "n_routed_experts", "num_local_experts")),
                embed=int(config_field(config, "hidden_size")), mlp=mlp,
                top_k=int(config_field(config, "num_experts_per_tok")),
                activation=_activation(config_field(config, "hidden_act", default="silu")),
                score="softmax",
                normalize_top_k=bool(config_field(config, "norm_topk_prob", default=True)),
                routed_scaling_factor=float(config_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  if groups > 1:  # one group: no limit
    kwargs.update(num_expert_groups=groups,
                  top_k_groups=int(config_field(config, "topk_group", default=1) or 1))
  if shared:
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
  return kwargs


def llama4(config):
  config = _text_config(config)
  mlp = int(config_field(config, "intermediate_size"))
  return dict(num_experts=int(config_field(config, "num_local_experts")),
              embed=int(config_field(config, "hidden_size")), mlp=mlp,
              top_k=int(config_field(config, "num_experts_per_tok")),
              activation=_activation(config_field(config, "hidden_act", default="silu")),
              score="sigmoid", normalize_top_k=False, router_weight_on="input",
              num_shared_experts=1, shared_mlp=mlp)


def switch(config):
  return dict(num_experts=int(config_field(config, "num_experts")),
              embed=int(config_field(config, "d_model", "hidden_size")),
              mlp=int(config_field(config, "d_ff")), top_k=1, gated=False,
              activation=_activation(config_field(config, "dense_act_fn", default="relu"),
                                     gated=False),
              score="softmax", normalize_top_k=False,
              router_bias=bool(config_field(config, "router_bias", default=False)),
              expert_capacity=int(config_field(config, "expert_capacity")))
