"""Weights in and out of Hugging Face transformers MoE blocks: `from_transformers` builds the
`MoE` of a transformers MoE block (its config and its weights), `to_transformers` writes an
`MoE`'s weights back in transformers' layout.

Neither torch nor transformers is imported here: a block's tensors are read through its
``state_dict()`` (``.detach().cpu()`` then numpy), and a config may be the transformers
object or its ``to_dict()``, so that weights saved as numpy arrays load without torch.

The architectures, by the ``model_type`` of their config (`ARCHITECTURES`): mixtral,
qwen2_moe, qwen3_moe, qwen3_next, deepseek_v3, olmoe, gpt_oss, granitemoe, dbrx, glm4_moe,
llama4 (``llama4_text``), switch_transformers, cohere2_moe, deepseek_v2, dots1, ernie4_5_moe,
ernie4_5_vl_moe (one modality's experts: ``ernie4_5_vl_moe_text``), exaone_moe,
granitemoehybrid and granitemoeshared (their decoder layer: the routed block and the shared
MLP beside it), hunyuan_v1_moe, jamba, jetmoe (its MLP experts), kimi_linear, lfm2_moe,
longcat_flash, minimax_m2, mistral4, phimoe, qwen3_omni_moe_text and
qwen3_omni_moe_talker_text (Qwen3-Omni's thinker and talker) and solar_open; Gemma 4,
NLLB-MoE, Ernie 4.5 VL's modality-isolated block and JetMoE's attention experts are
refused, saying why (`_REFUSED`). Expert layouts read: transformers 5.x's
fused ``experts.gate_up_proj`` ``[E, 2F, D]`` (gate rows first) and ``experts.down_proj``
``[E, D, F]``; gpt-oss's ``[E, D, 2F]`` with gate and up columns interleaved (and their
biases); Llama 4's ``[E, D, 2F]`` (gate columns first); DBRX's ``w1``/``v1``/``w2``
``[E * F, D]``; Switch's per-expert ``wi``/``wo``; and transformers 4.x's per-expert
``experts.{e}.{gate,up,down}_proj`` (Mixtral: ``w1``/``w3``/``w2``) and GraniteMoE's
``input_linear``/``output_linear``. `to_transformers` writes the 5.x layout.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from typing import Any, Callable, Mapping

import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

from gmm_jax.nn.moe import MoE

# --------------------------------------------------------------------------- config


_REQUIRED = object()


def _field(config, *names, default: Any = _REQUIRED):
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


def _as_dict(config) -> dict:
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
  return dict(num_experts=int(_field(config, *experts.split("|"))),
              embed=int(_field(config, "hidden_size", "d_model")),
              mlp=int(_field(config, *mlp.split("|"))),
              top_k=int(_field(config, "num_experts_per_tok")),
              activation=_activation(_field(config, "hidden_act", default="silu")),
              score="softmax", normalize_top_k=bool(normalize))


def _mixtral(config):
  return _softmax_top_k(config, "num_local_experts|num_experts", "intermediate_size", True)


def _qwen_shared(norm_default: bool):
  def options(config):
    kwargs = _softmax_top_k(config, "num_experts|num_local_experts", "moe_intermediate_size",
                            _field(config, "norm_topk_prob", default=norm_default))
    kwargs.update(num_shared_experts=1, shared_gate=True,
                  shared_mlp=int(_field(config, "shared_expert_intermediate_size")))
    return kwargs
  return options


def _qwen3_moe(config):
  return _softmax_top_k(config, "num_experts|num_local_experts", "moe_intermediate_size",
                        _field(config, "norm_topk_prob", default=False))


def _qwen3_omni_moe_thinker(config):
  config = _field(config, "text_config", default=config)
  return _softmax_top_k(config, "num_experts|num_local_experts", "moe_intermediate_size",
                        _field(config, "norm_topk_prob", default=True))


def _olmoe(config):
  return _softmax_top_k(config, "num_experts|num_local_experts", "intermediate_size",
                        _field(config, "norm_topk_prob", default=False))


def _granitemoe(config):
  # A softmax over the top-k logits: the renormalized top-k of the softmax.
  return _softmax_top_k(config, "num_local_experts|num_experts", "intermediate_size", True)


def _jamba(config):
  return _softmax_top_k(config, "num_experts|num_local_experts", "intermediate_size", False)


def _granite_shared_mlp(config):
  # GraniteMoE's routing; the decoder layer's shared MLP (none when its width is 0) added.
  kwargs = _granitemoe(config)
  if not kwargs["num_experts"]:
    raise NotImplementedError(f"{_field(config, 'model_type')} with num_local_experts=0: a "
                              f"dense layer (its shared MLP only), no experts to route to")
  shared = int(_field(config, "shared_intermediate_size", default=0))
  if shared:
    kwargs.update(num_shared_experts=1, shared_mlp=shared)
  return kwargs


def _gpt_oss(config):
  kwargs = _softmax_top_k(config, "num_local_experts|num_experts", "intermediate_size", True)
  kwargs.update(activation="swiglu_clamped", router_bias=True, use_bias=True,
                swiglu_limit=float(_field(config, "swiglu_limit", default=7.0)),
                swiglu_alpha=float(_field(config, "swiglu_alpha", default=1.702)))
  return kwargs


def _cohere2_moe(config):
  # The top-k logits, their softmax (the renormalized top-k of the softmax) or their sigmoid
  # (renormalized with norm_topk_prob); shared experts added ("sum") or averaged with the
  # routed output ("average": both halved).
  selection = _field(config, "expert_selection_fn", default="softmax")
  if selection not in ("softmax", "sigmoid"):
    raise NotImplementedError(f"cohere2_moe expert_selection_fn={selection!r}: supported "
                              f"are 'softmax' and 'sigmoid'")
  mlp = int(_field(config, "intermediate_size"))
  kwargs = dict(num_experts=int(_field(config, "num_experts", "num_local_experts")),
                embed=int(_field(config, "hidden_size")), mlp=mlp,
                top_k=int(_field(config, "num_experts_per_tok")),
                activation=_activation(_field(config, "hidden_act", default="silu")),
                score=selection,
                normalize_top_k=(selection == "softmax"
                                 or bool(_field(config, "norm_topk_prob", default=True))))
  shared = int(_field(config, "num_shared_experts", default=0))
  if shared:
    strategy = _field(config, "shared_expert_combination_strategy", default="average")
    if strategy not in ("sum", "average"):
      raise NotImplementedError(f"cohere2_moe shared_expert_combination_strategy="
                                f"{strategy!r}: supported are 'sum' and 'average'")
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
    if strategy == "average":
      kwargs.update(routed_scaling_factor=0.5, shared_scale=0.5)
  return kwargs


def _deepseek(config):
  experts = int(_field(config, "n_routed_experts", "num_local_experts"))
  mlp = int(_field(config, "moe_intermediate_size"))
  groups = int(_field(config, "n_group", default=1) or 1)
  top_groups = int(_field(config, "topk_group", default=1) or 1)
  shared = int(_field(config, "n_shared_experts", default=0) or 0)
  kwargs = dict(num_experts=experts, embed=int(_field(config, "hidden_size")), mlp=mlp,
                top_k=int(_field(config, "num_experts_per_tok")),
                activation=_activation(_field(config, "hidden_act", default="silu")),
                score="sigmoid", routing_bias=True,
                normalize_top_k=bool(_field(config, "norm_topk_prob", default=True)),
                routed_scaling_factor=float(_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  if groups > 1:  # one group: no limit
    kwargs.update(num_expert_groups=groups, top_k_groups=top_groups)
  if shared:
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
  return kwargs


def _lfm2_moe(config):
  # Sigmoid scores, the block's expert_bias selecting (use_expert_bias), renormalized with
  # 1e-6 added to the sum; the experts' activation is SiLU whatever hidden_act says.
  normalize = bool(_field(config, "norm_topk_prob", default=True))
  kwargs = dict(num_experts=int(_field(config, "num_experts", "num_local_experts")),
                embed=int(_field(config, "hidden_size")),
                mlp=int(_field(config, "moe_intermediate_size")),
                top_k=int(_field(config, "num_experts_per_tok")), activation="silu",
                score="sigmoid", normalize_top_k=normalize,
                routing_bias=bool(_field(config, "use_expert_bias", default=True)),
                routed_scaling_factor=float(_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  if normalize:
    kwargs["normalize_epsilon"] = 1e-6
  return kwargs


def _exaone_moe(config):
  # DeepSeek-V3's routing and shared experts under other config names.
  config = _as_dict(config)
  return _deepseek({**config, "n_routed_experts": _field(config, "num_experts"),
                    "n_shared_experts": _field(config, "num_shared_experts", default=0)})


def _plain_shared_expert(config, field: str, name: str):
  """Refuses a config whose shared expert has biases (`SharedExperts` has none)."""
  if _field(config, field, default=False):
    raise NotImplementedError(f"{name} with {field}=True: the shared expert's biases "
                              f"(nn.MoE's shared experts have none)")


def _deepseek_v2(config):
  method = _field(config, "topk_method", default="greedy")
  if method not in ("greedy", "group_limited_greedy"):
    raise NotImplementedError(f"deepseek_v2 topk_method={method!r}: transformers' "
                              f"DeepseekV2TopkRouter has 'greedy' and 'group_limited_greedy'")
  _plain_shared_expert(config, "mlp_bias", "deepseek_v2")
  experts = int(_field(config, "n_routed_experts", "num_experts"))
  mlp = int(_field(config, "moe_intermediate_size"))
  shared = int(_field(config, "n_shared_experts", default=0) or 0)
  # softmax top-k, never renormalized (the router ignores norm_topk_prob), then scaled.
  kwargs = dict(num_experts=experts, embed=int(_field(config, "hidden_size")), mlp=mlp,
                top_k=int(_field(config, "num_experts_per_tok")),
                activation=_activation(_field(config, "hidden_act", default="silu")),
                score="softmax", normalize_top_k=False,
                routed_scaling_factor=float(_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  groups = int(_field(config, "n_group", default=1) or 1)
  if method == "group_limited_greedy" and groups > 1:  # one group: no limit
    kwargs.update(num_expert_groups=groups,
                  top_k_groups=int(_field(config, "topk_group")), group_score="max")
  if shared:
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
  return kwargs


def _ernie4_5_moe(config):
  kwargs = dict(num_experts=int(_field(config, "moe_num_experts", "num_experts")),
                embed=int(_field(config, "hidden_size")),
                mlp=int(_field(config, "moe_intermediate_size")),
                top_k=int(_field(config, "moe_k", "num_experts_per_tok")),
                activation=_activation(_field(config, "hidden_act", default="silu")),
                score="softmax", normalize_top_k=True)
  # The weights are divided by max(sum, moe_norm_min): the sum of a softmax's top k is at
  # least k / E, so a moe_norm_min up to that never binds (the default is 1e-12).
  norm_min = float(_field(config, "moe_norm_min", default=1e-12))
  if norm_min > kwargs["top_k"] / kwargs["num_experts"]:
    raise NotImplementedError(
        f"ernie4_5_moe moe_norm_min={norm_min} > top_k / num_experts: the chosen weights "
        f"divided by max(their sum, moe_norm_min); nn.MoE divides by their sum")
  kwargs["routing_bias"] = True
  shared = int(_field(config, "moe_num_shared_experts", default=0) or 0)
  if shared:
    _plain_shared_expert(config, "use_bias", "ernie4_5_moe")
    kwargs.update(num_shared_experts=shared, shared_mlp=kwargs["mlp"] * shared)
  return kwargs


def _ernie4_5_vl_moe(config):
  """One modality's experts of Ernie 4.5 VL (``mlp.text_moe`` / ``mlp.vision_moe``): Ernie
  4.5 MoE's routing, no shared expert (the parent block's); ``moe_intermediate_size`` is
  ``[text, vision]``: the text experts' width unless the config holds one number (the
  block's own, read from it)."""
  config = _field(config, "text_config", default=config)
  widths = _field(config, "moe_intermediate_size")
  width = widths[0] if isinstance(widths, (list, tuple)) else widths
  kwargs = _ernie4_5_moe({**_as_dict(config), "moe_intermediate_size": width,
                          "moe_num_shared_experts": 0})
  return kwargs


def _hunyuan_v1_moe(config):
  experts, top_k = _field(config, "num_experts"), _field(config, "moe_topk")
  if isinstance(experts, (list, tuple)) or isinstance(top_k, (list, tuple)):
    raise ValueError(f"hunyuan_v1_moe: num_experts={experts} and moe_topk={top_k} per "
                     f"layer; pass a config with this layer's numbers (or the block, whose "
                     f"gate keeps them)")
  mlp = int(_field(config, "intermediate_size"))
  # softmax top-k, always renormalized (even top-1); a shared MLP of the experts' width.
  return dict(num_experts=int(experts), embed=int(_field(config, "hidden_size")), mlp=mlp,
              top_k=int(top_k),
              activation=_activation(_field(config, "hidden_act", default="silu")),
              score="softmax", normalize_top_k=True, num_shared_experts=1, shared_mlp=mlp)


def _dots1(config):
  # DeepSeek-V3's router (norm_topk_prob's default False), its group limit always applied.
  return _deepseek({"norm_topk_prob": False, **_as_dict(config)})


def _kimi_linear(config):
  # DeepSeek-V3's router (its group limit always applied), under other config names.
  return _deepseek({
      "n_routed_experts": _field(config, "num_experts", "num_local_experts"),
      "hidden_size": _field(config, "hidden_size"),
      "moe_intermediate_size": _field(config, "moe_intermediate_size"),
      "num_experts_per_tok": _field(config, "num_experts_per_token", "num_experts_per_tok"),
      "hidden_act": _field(config, "hidden_act", default="silu"),
      "norm_topk_prob": _field(config, "moe_renormalize", "norm_topk_prob", default=True),
      "routed_scaling_factor": _field(config, "routed_scaling_factor", default=1.0),
      "n_group": _field(config, "num_expert_group", "n_group", default=1),
      "topk_group": _field(config, "topk_group", default=1),
      "n_shared_experts": _field(config, "num_shared_experts", "n_shared_experts",
                                 default=0)})


def _longcat_flash(config):
  if _field(config, "router_bias", default=False):
    raise NotImplementedError("longcat_flash router_bias=True: transformers' "
                              "LongcatFlashTopkRouter keeps a classifier bias its logits "
                              "leave out")
  # softmax over the routed and the zero (identity) experts, chosen with the correction
  # bias, not renormalized, scaled.
  return dict(num_experts=int(_field(config, "n_routed_experts", "num_local_experts")),
              num_identity_experts=int(_field(config, "zero_expert_num", default=0) or 0),
              embed=int(_field(config, "hidden_size")),
              mlp=int(_field(config, "expert_ffn_hidden_size", "moe_intermediate_size")),
              top_k=int(_field(config, "moe_topk", "num_experts_per_tok")),
              activation=_activation(_field(config, "hidden_act", default="silu")),
              score="softmax", routing_bias=True, normalize_top_k=False,
              routed_scaling_factor=float(_field(config, "routed_scaling_factor",
                                                 default=1.0)))


def _phimoe(config):
  # SparseMixer at inference: its sparsemixer() picks two experts whatever
  # num_experts_per_tok says.
  return dict(num_experts=int(_field(config, "num_local_experts", "num_experts")),
              embed=int(_field(config, "hidden_size")),
              mlp=int(_field(config, "intermediate_size")), top_k=2,
              activation=_activation(_field(config, "hidden_act", default="silu")),
              score="sparsemixer", normalize_top_k=False,
              sparsemixer_eps=float(_field(config, "router_jitter_noise", default=0.01)))


def _jetmoe(config):
  # A softmax over the top-k logits (= renormalized), and a bias [D] on the output.
  return dict(num_experts=int(_field(config, "num_local_experts", "num_experts")),
              embed=int(_field(config, "hidden_size")),
              mlp=int(_field(config, "intermediate_size")),
              top_k=int(_field(config, "num_experts_per_tok")),
              activation=_activation(_field(config, "activation_function", "hidden_act",
                                            default="silu")),
              score="softmax", normalize_top_k=True, output_bias=True)


def _dbrx(config):
  ffn = _field(config, "ffn_config")
  top_k = int(_field(ffn, "moe_top_k"))
  power = _field(ffn, "moe_normalize_expert_weights", default=None)
  if power is not None and float(power) != 1.0 and top_k > 1:
    raise NotImplementedError(
        f"DBRX's moe_normalize_expert_weights={power}: the chosen weights divided by their "
        f"{power}-norm; supported are None (no normalization) and 1 (their sum), or top_k=1")
  act = _field(ffn, "ffn_act_fn", default=None) or {"name": "silu"}
  return dict(num_experts=int(_field(ffn, "moe_num_experts")),
              embed=int(_field(config, "d_model", "hidden_size")),
              mlp=int(_field(ffn, "ffn_hidden_size")), top_k=top_k,
              activation=_activation(act.get("name", "silu")), score="softmax",
              normalize_top_k=power is not None)


def _minimax_m2(config):
  # Sigmoid scores, the block's correction bias only selecting, the chosen weights always
  # renormalized.
  return dict(num_experts=int(_field(config, "num_local_experts", "num_experts")),
              embed=int(_field(config, "hidden_size")),
              mlp=int(_field(config, "intermediate_size")),
              top_k=int(_field(config, "num_experts_per_tok")),
              activation=_activation(_field(config, "hidden_act", default="silu")),
              score="sigmoid", routing_bias=True, normalize_top_k=True)


def _mistral4(config):
  # DeepSeek-V3's group-limited routing on softmax scores, without a correction bias.
  mlp = int(_field(config, "moe_intermediate_size"))
  groups = int(_field(config, "n_group", default=1) or 1)
  shared = int(_field(config, "n_shared_experts", default=1))
  kwargs = dict(num_experts=int(_field(config, "n_routed_experts", "num_local_experts")),
                embed=int(_field(config, "hidden_size")), mlp=mlp,
                top_k=int(_field(config, "num_experts_per_tok")),
                activation=_activation(_field(config, "hidden_act", default="silu")),
                score="softmax",
                normalize_top_k=bool(_field(config, "norm_topk_prob", default=True)),
                routed_scaling_factor=float(_field(config, "routed_scaling_factor",
                                                   default=1.0)))
  if groups > 1:  # one group: no limit
    kwargs.update(num_expert_groups=groups,
                  top_k_groups=int(_field(config, "topk_group", default=1) or 1))
  if shared:
    kwargs.update(num_shared_experts=shared, shared_mlp=mlp * shared)
  return kwargs


def _llama4(config):
  config = _field(config, "text_config", default=config)
  mlp = int(_field(config, "intermediate_size"))
  return dict(num_experts=int(_field(config, "num_local_experts")),
              embed=int(_field(config, "hidden_size")), mlp=mlp,
              top_k=int(_field(config, "num_experts_per_tok")),
              activation=_activation(_field(config, "hidden_act", default="silu")),
              score="sigmoid", normalize_top_k=False, router_weight_on="input",
              num_shared_experts=1, shared_mlp=mlp)


def _switch(config):
  return dict(num_experts=int(_field(config, "num_experts")),
              embed=int(_field(config, "d_model", "hidden_size")),
              mlp=int(_field(config, "d_ff")), top_k=1, gated=False,
              activation=_activation(_field(config, "dense_act_fn", default="relu"),
                                     gated=False),
              score="softmax", normalize_top_k=False,
              router_bias=bool(_field(config, "router_bias", default=False)),
              expert_capacity=int(_field(config, "expert_capacity")))


# --------------------------------------------------------------------------- layouts


@dataclasses.dataclass(frozen=True)
class Architecture:
  """How one transformers architecture's MoE block maps to `MoE`.

  Attributes:
    name: the key of `ARCHITECTURES` (the config's ``model_type``).
    block_classes: the transformers classes of its MoE block.
    options: config -> the `MoE` arguments.
    experts: the expert layout: "fused" (``gate_up_proj [E, 2F, D]``, ``down_proj
      [E, D, F]``), "fused_in_out" (``[E, D, 2F]`` gate first, ``[E, F, D]``: Llama 4),
      "interleaved" (gpt-oss: ``[E, D, 2F]`` gate and up columns alternating, biases
      too), "dbrx" (``w1``, ``v1``, ``w2`` ``[E * F, D]``), "per_expert" (Switch),
      "input_output_linear" (JetMoE: ``input_linear.weight [E, 2F, D]`` gate rows first,
      ``output_linear.weight [E, D, F]``).
    router: the router's weight ``[E, D]`` (its bias: the same name, ``bias``).
    shared: the shared expert's module, or None.
    shared_layout: its tensors: "gate_up_down" (``gate_proj``, ``up_proj``, ``down_proj``
      weights) or "input_output" (Granite's ``input_linear [2F_s, D]``, gate rows first, and
      ``output_linear [D, F_s]``).
    optional: the parts ("shared", "routing_bias") the block has only when its config asks
      for them (the options' ``num_shared_experts``, ``routing_bias``).
    experts_at: the prefix of the router's and experts' module (Granite's decoder layer:
      ``block_sparse_moe.``) before the experts' tensor names.
    reads: where the block is a decoder layer, the prefixes of the tensors of its FFN; the
      layer's others (attention, norms) are ignored.
    shared_gate: the shared expert's gate weight ``[1, D]``, or None.
    routing_bias: the selection-only bias ``[E]`` (``[1, E]`` with `routing_bias_2d`), or
      None.
    routing_bias_2d: the routing bias is stored as ``[1, E]`` (Ernie 4.5).
    output_bias: the bias ``[D]`` added to the block's output, or None.
    model_types: the config ``model_type`` values it answers to.
  """
  name: str
  block_classes: tuple[str, ...]
  options: Callable[[Any], dict]
  experts: str = "fused"
  router: str = "gate.weight"
  shared: str | None = None
  shared_gate: str | None = None
  routing_bias: str | None = None
  routing_bias_2d: bool = False
  output_bias: str | None = None
  model_types: tuple[str, ...] = ()
  shared_layout: str = "gate_up_down"
  optional: tuple[str, ...] = ()
  experts_at: str = ""
  reads: tuple[str, ...] = ()


# GraniteMoeShared / GraniteMoeHybrid: the routed block and the shared MLP are siblings in
# the decoder layer, which adds their outputs: the layer's FFN is the block.
_GRANITE_SHARED = dict(router="block_sparse_moe.router.weight", experts_at="block_sparse_moe.",
                       shared="shared_mlp", shared_layout="input_output", optional=("shared",),
                       reads=("block_sparse_moe.", "shared_mlp."))

# Blocks that are only part of their layer's FFN -> the module to pass instead.
_PART_OF = {"GraniteMoeSharedMoE": "GraniteMoeSharedDecoderLayer",
            "GraniteMoeHybridMoE": "GraniteMoeHybridDecoderLayer"}

# Architectures whose MoE nn.MoE does not express, by model_type and block class: why.
_GEMMA4 = (
    "Gemma 4 has no MoE block: its decoder layer routes the residual through the router's "
    "own RMSNorm and learned `scale` while the experts read `pre_feedforward_layernorm_2`'s "
    "output (nn.MoE routes the tokens its experts compute on), multiplies the renormalized "
    "weights by a learned `per_expert_scale`, and passes the experts' sum through "
    "`post_feedforward_layernorm_2` (an RMSNorm of the MoE output) before adding it to the "
    "dense MLP's")
_NLLB_MOE = (
    "NLLB-MoE: transformers' NllbMoeSparseMLP hands NllbMoeExperts the router's top-1 mask "
    "([T, E] of 0/1) where expert ids belong, so expert_1 computes every token with its "
    "top-1 weight and expert_0 with its other weights, whatever experts were chosen: not a "
    "routed FFN of its experts. The routing it intends differs from nn.MoE's too: the "
    "capacity (expert_capacity; ceil(moe_eval_capacity_token_fraction * T) in eval) counts "
    "the call's tokens with every top-1 assignment ranked before any top-2 one (nn.MoE ranks "
    "assignments token by token), the weights are renormalized after the drops "
    "(normalize_router_prob_before_dropping=False), batch_prioritized_routing orders the "
    "tokens by their top probability, and second_expert_policy 'sampling'/'random' draws at "
    "random")
_ERNIE4_5_VL_MOE = (
    "Ernie 4.5 VL's MoE block runs text and vision tokens through two sets of experts picked "
    "by moe_mm_token_type_ids (modality-isolated experts); load its text_moe or vision_moe "
    "sub-block (each an nn.MoE, model_type ernie4_5_vl_moe) and its shared_experts apart")
_JETMOE_MOA = (
    "JetMoE's mixture of attention experts routes tokens to per-expert query and output "
    "projections around attention, not to FFNs; its JetMoeMoE (the MLP experts) loads")
_REFUSED = {"gemma4": _GEMMA4, "gemma4_text": _GEMMA4, "Gemma4TextDecoderLayer": _GEMMA4,
            "Gemma4TextExperts": _GEMMA4, "Gemma4TextRouter": _GEMMA4,
            "nllb-moe": _NLLB_MOE, "nllb_moe": _NLLB_MOE, "NllbMoeSparseMLP": _NLLB_MOE,
            "Ernie4_5_VLMoeMoeBlock": _ERNIE4_5_VL_MOE, "JetMoeMoA": _JETMOE_MOA}

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in [
    Architecture("mixtral", ("MixtralSparseMoeBlock",), _mixtral),
    Architecture("qwen2_moe", ("Qwen2MoeSparseMoeBlock",), _qwen_shared(False),
                 shared="shared_expert", shared_gate="shared_expert_gate.weight"),
    Architecture("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), _qwen3_moe),
    Architecture("qwen3_next", ("Qwen3NextSparseMoeBlock",), _qwen_shared(True),
                 shared="shared_expert", shared_gate="shared_expert_gate.weight"),
    Architecture("deepseek_v3", ("DeepseekV3MoE",), _deepseek, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("olmoe", ("OlmoeSparseMoeBlock",), _olmoe),
    Architecture("gpt_oss", ("GptOssMLP",), _gpt_oss, experts="interleaved",
                 router="router.weight"),
    Architecture("granitemoe", ("GraniteMoeMoE",), _granitemoe, router="router.weight"),
    Architecture("dbrx", ("DbrxFFN",), _dbrx, experts="dbrx", router="router.layer.weight"),
    Architecture("glm4_moe", ("Glm4MoeMoE",), _deepseek, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("llama4", ("Llama4TextMoe",), _llama4, experts="fused_in_out",
                 router="router.weight", shared="shared_expert",
                 model_types=("llama4_text",)),
    Architecture("cohere2_moe", ("Cohere2MoeSparseMoeBlock",), _cohere2_moe,
                 shared="shared_experts", optional=("shared",)),
    Architecture("deepseek_v2", ("DeepseekV2Moe",), _deepseek_v2, shared="shared_experts"),
    Architecture("dots1", ("Dots1MoE",), _dots1, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("ernie4_5_moe", ("Ernie4_5_MoeSparseMoeBlock",), _ernie4_5_moe,
                 shared="shared_experts",
                 routing_bias="gate.moe_statics.e_score_correction_bias",
                 routing_bias_2d=True, optional=("shared",)),
    Architecture("ernie4_5_vl_moe", ("Ernie4_5_VLMoeSparseMoeBlock",), _ernie4_5_vl_moe,
                 routing_bias="gate.moe_statics.e_score_correction_bias",
                 routing_bias_2d=True, model_types=("ernie4_5_vl_moe_text",)),
    Architecture("exaone_moe", ("ExaoneMoeSparseMoEBlock",), _exaone_moe,
                 shared="shared_experts", routing_bias="gate.e_score_correction_bias"),
    Architecture("granitemoehybrid", ("GraniteMoeHybridDecoderLayer",), _granite_shared_mlp,
                 **_GRANITE_SHARED),
    Architecture("granitemoeshared", ("GraniteMoeSharedDecoderLayer",), _granite_shared_mlp,
                 **_GRANITE_SHARED),
    Architecture("hunyuan_v1_moe", ("HunYuanMoEV1Moe",), _hunyuan_v1_moe,
                 router="gate.wg.weight", shared="shared_mlp"),
    Architecture("jamba", ("JambaSparseMoeBlock",), _jamba, router="router.weight"),
    Architecture("jetmoe", ("JetMoeMoE",), _jetmoe, experts="input_output_linear",
                 router="router.layer.weight", output_bias="bias"),
    Architecture("kimi_linear", ("KimiLinearMoE",), _kimi_linear, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("lfm2_moe", ("Lfm2MoeSparseMoeBlock",), _lfm2_moe,
                 routing_bias="expert_bias", optional=("routing_bias",)),
    Architecture("longcat_flash", ("LongcatFlashMoE",), _longcat_flash,
                 router="router.classifier.weight",
                 routing_bias="router.e_score_correction_bias"),
    Architecture("minimax_m2", ("MiniMaxM2SparseMoeBlock",), _minimax_m2,
                 routing_bias="e_score_correction_bias"),
    Architecture("mistral4", ("Mistral4MoE",), _mistral4, shared="shared_experts"),
    Architecture("phimoe", ("PhimoeSparseMoeBlock",), _phimoe, router="router.weight"),
    Architecture("qwen3_omni_moe_talker_text", ("Qwen3OmniMoeTalkerTextSparseMoeBlock",),
                 _qwen_shared(False), shared="shared_expert",
                 shared_gate="shared_expert_gate.weight"),
    Architecture("qwen3_omni_moe_text", ("Qwen3OmniMoeThinkerTextSparseMoeBlock",),
                 _qwen3_omni_moe_thinker, model_types=("qwen3_omni_moe_thinker",)),
    Architecture("solar_open", ("SolarOpenMoE",), _deepseek, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("switch_transformers", ("SwitchTransformersSparseMLP",), _switch,
                 experts="per_expert", router="router.classifier.weight"),
]}


def _architecture(name) -> Architecture:
  if name in _REFUSED:
    raise NotImplementedError(f"transformers architecture {name!r} is not supported: "
                              f"{_REFUSED[name]}")
  if name in _PART_OF:
    raise ValueError(f"{name} is the routed half of its layer's FFN: the shared MLP "
                     f"(shared_mlp) is its sibling in the {_PART_OF[name]}, which adds them; "
                     f"pass the decoder layer (or its config and state dict)")
  for arch in ARCHITECTURES.values():
    if name == arch.name or name in arch.model_types or name in arch.block_classes:
      return arch
  raise NotImplementedError(f"transformers architecture {name!r}: supported are "
                            f"{sorted(ARCHITECTURES)}")


class _Tensors:
  """A state dict's arrays by name; `take` marks a name used, so that tensors of a layout
  not read are an error rather than silently dropped."""

  def __init__(self, state_dict: Mapping[str, Any], prefix: str, reads: tuple[str, ...] = ()):
    self.arrays = {name[len(prefix):]: _to_numpy(value) for name, value in state_dict.items()
                   if name.startswith(prefix)
                   and (not reads or name[len(prefix):].startswith(reads))}
    if not self.arrays:
      raise ValueError(f"no tensors named {prefix!r}... in the state dict "
                       f"(first names: {sorted(state_dict)[:5]})")
    self.used: set[str] = set()

  def has(self, name):
    return name in self.arrays

  def take(self, name, shape=None):
    if name not in self.arrays:
      raise ValueError(f"the state dict has no {name!r}; it has {sorted(self.arrays)}")
    value = self.arrays[name]
    if shape is not None and tuple(value.shape) != tuple(shape):
      raise ValueError(f"{name} has shape {tuple(value.shape)}, the config says "
                       f"{tuple(shape)}")
    self.used.add(name)
    return value

  def check_all_used(self, arch):
    unused = sorted(set(self.arrays) - self.used)
    if unused:
      raise ValueError(f"{arch}: tensors of the state dict that this layout does not read: "
                       f"{unused}")


class _Scoped:
  """The tensors under a prefix of a `_Tensors` (names without it)."""

  def __init__(self, tensors: _Tensors, prefix: str):
    self.tensors, self.prefix = tensors, prefix

  def has(self, name):
    return self.tensors.has(self.prefix + name)

  def take(self, name, shape=None):
    return self.tensors.take(self.prefix + name, shape)


def _to_numpy(value) -> np.ndarray:
  """A torch tensor (``.detach().cpu()``; bfloat16 kept as ml_dtypes' bfloat16), a jax or
  numpy array -> numpy."""
  if hasattr(value, "detach"):
    value = value.detach().cpu()
    if str(value.dtype) == "torch.bfloat16":
      torch = sys.modules["torch"]  # a tensor exists: torch is imported
      return value.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return value.numpy()
  return np.asarray(value)


def _stack_per_expert(tensors, names, num_experts):
  return np.stack([tensors.take(names.format(e=e)) for e in range(num_experts)])


def _read_experts(arch: Architecture, tensors: _Tensors, o: dict) -> dict:
  """The experts' weights in nn.MoE's layout: w_in ``[E, D, 2F]`` (gate half first) or
  ``[E, D, F]``, w_down ``[E, F, D]``, biases b_in, b_down."""
  num_experts, embed, mlp = o["num_experts"], o["embed"], o["mlp"]
  out = {}
  if arch.experts == "fused" and tensors.has("experts.gate_up_proj"):
    out["w_in"] = tensors.take("experts.gate_up_proj",
                               (num_experts, 2 * mlp, embed)).transpose(0, 2, 1)
    out["w_down"] = tensors.take("experts.down_proj",
                                 (num_experts, embed, mlp)).transpose(0, 2, 1)
  elif arch.experts == "input_output_linear" or (  # JetMoE; GraniteMoE 4.x
      arch.experts == "fused" and tensors.has("input_linear.weight")):
    out["w_in"] = tensors.take("input_linear.weight",
                               (num_experts, 2 * mlp, embed)).transpose(0, 2, 1)
    out["w_down"] = tensors.take("output_linear.weight",
                                 (num_experts, embed, mlp)).transpose(0, 2, 1)
  elif arch.experts == "fused":  # transformers 4.x: one module per expert
    names = (("w1", "w3", "w2") if tensors.has("experts.0.w1.weight")
             else ("gate_proj", "up_proj", "down_proj"))
    gate, up, down = (_stack_per_expert(tensors, f"experts.{{e}}.{n}.weight", num_experts)
                      for n in names)
    for name, value, shape in (("gate", gate, (mlp, embed)), ("up", up, (mlp, embed)),
                               ("down", down, (embed, mlp))):
      if value.shape[1:] != shape:
        raise ValueError(f"experts' {name} weights are {value.shape[1:]}, the config says "
                         f"{shape}")
    out["w_in"] = np.concatenate([gate, up], axis=1).transpose(0, 2, 1)
    out["w_down"] = down.transpose(0, 2, 1)
  elif arch.experts == "fused_in_out":
    out["w_in"] = tensors.take("experts.gate_up_proj", (num_experts, embed, 2 * mlp))
    out["w_down"] = tensors.take("experts.down_proj", (num_experts, mlp, embed))
  elif arch.experts == "interleaved":
    w = tensors.take("experts.gate_up_proj", (num_experts, embed, 2 * mlp))
    b = tensors.take("experts.gate_up_proj_bias", (num_experts, 2 * mlp))
    out["w_in"] = np.concatenate([w[..., 0::2], w[..., 1::2]], axis=-1)
    out["b_in"] = np.concatenate([b[..., 0::2], b[..., 1::2]], axis=-1)
    out["w_down"] = tensors.take("experts.down_proj", (num_experts, mlp, embed))
    out["b_down"] = tensors.take("experts.down_proj_bias", (num_experts, embed))
  elif arch.experts == "dbrx":
    gate, up, down = (tensors.take(f"experts.mlp.{n}", (num_experts * mlp, embed)).reshape(
        num_experts, mlp, embed) for n in ("w1", "v1", "w2"))
    out["w_in"] = np.concatenate([gate, up], axis=1).transpose(0, 2, 1)
    out["w_down"] = down
  elif arch.experts == "per_expert":
    wi = _stack_per_expert(tensors, "experts.expert_{e}.wi.weight", num_experts)
    wo = _stack_per_expert(tensors, "experts.expert_{e}.wo.weight", num_experts)
    if wi.shape[1:] != (mlp, embed) or wo.shape[1:] != (embed, mlp):
      raise ValueError(f"experts' wi/wo are {wi.shape[1:]}/{wo.shape[1:]}, the config says "
                       f"{(mlp, embed)}/{(embed, mlp)}")
    out["w_in"], out["w_down"] = wi.transpose(0, 2, 1), wo.transpose(0, 2, 1)
  else:
    raise AssertionError(arch.experts)
  return out


def _write_experts(arch: Architecture, w: dict, o: dict) -> dict:
  """The inverse of `_read_experts`, to transformers 5.x's layout."""
  num_experts, mlp = o["num_experts"], o["mlp"]
  if arch.experts == "fused":
    return {"experts.gate_up_proj": w["w_in"].transpose(0, 2, 1),
            "experts.down_proj": w["w_down"].transpose(0, 2, 1)}
  if arch.experts == "fused_in_out":
    return {"experts.gate_up_proj": w["w_in"], "experts.down_proj": w["w_down"]}
  if arch.experts == "input_output_linear":
    return {"input_linear.weight": w["w_in"].transpose(0, 2, 1),
            "output_linear.weight": w["w_down"].transpose(0, 2, 1)}
  if arch.experts == "interleaved":
    def interleave(a):
      out = np.empty_like(a)
      out[..., 0::2], out[..., 1::2] = a[..., :mlp], a[..., mlp:]
      return out
    return {"experts.gate_up_proj": interleave(w["w_in"]),
            "experts.gate_up_proj_bias": interleave(w["b_in"]),
            "experts.down_proj": w["w_down"], "experts.down_proj_bias": w["b_down"]}
  if arch.experts == "dbrx":
    gate_up = w["w_in"].transpose(0, 2, 1)  # [E, 2F, D]
    flat = lambda a: a.reshape(num_experts * mlp, -1)  # noqa: E731
    return {"experts.mlp.w1": flat(gate_up[:, :mlp]), "experts.mlp.v1": flat(gate_up[:, mlp:]),
            "experts.mlp.w2": flat(w["w_down"])}
  if arch.experts == "per_expert":
    out = {}
    for e in range(num_experts):
      out[f"experts.expert_{e}.wi.weight"] = w["w_in"][e].T
      out[f"experts.expert_{e}.wo.weight"] = w["w_down"][e].T
    return out
  raise AssertionError(arch.experts)


def _read(arch: Architecture, tensors: _Tensors, o: dict) -> dict:
  """The state dict -> the canonical arrays (`_PARAMS` names, nn.MoE's layout)."""
  embed = o["embed"]
  num_experts = o["num_experts"] + o.get("num_identity_experts", 0)  # the router's
  router = arch.router
  if arch.name == "granitemoe" and not tensors.has(router):  # transformers 4.x
    router = "router.layer.weight"
  canonical = {"router_kernel": tensors.take(router, (num_experts, embed)).T}
  if o.get("router_bias"):
    canonical["router_bias"] = tensors.take(router.rsplit(".", 1)[0] + ".bias",
                                            (num_experts,))
  if arch.routing_bias and o.get("routing_bias"):
    shape = (1, num_experts) if arch.routing_bias_2d else (num_experts,)
    canonical["routing_bias"] = tensors.take(arch.routing_bias, shape).reshape(num_experts)
  experts = _read_experts(arch, _Scoped(tensors, arch.experts_at), o)
  canonical.update({f"experts_{k}": v for k, v in experts.items()})
  if arch.shared and o.get("num_shared_experts"):
    shared_mlp = o["shared_mlp"]
    if arch.shared_layout == "input_output":
      canonical["shared_w_in"] = tensors.take(f"{arch.shared}.input_linear.weight",
                                              (2 * shared_mlp, embed)).T
      canonical["shared_w_down"] = tensors.take(f"{arch.shared}.output_linear.weight",
                                                (embed, shared_mlp)).T
    else:
      gate, up = (tensors.take(f"{arch.shared}.{n}_proj.weight", (shared_mlp, embed))
                  for n in ("gate", "up"))
      canonical["shared_w_in"] = np.concatenate([gate, up], axis=0).T
      canonical["shared_w_down"] = tensors.take(f"{arch.shared}.down_proj.weight",
                                                (embed, shared_mlp)).T
  if arch.shared_gate:
    canonical["shared_gate"] = tensors.take(arch.shared_gate, (1, embed)).T
  if arch.output_bias:
    canonical["output_bias"] = tensors.take(arch.output_bias, (embed,))
  tensors.check_all_used(arch.name)
  return canonical


def _write(arch: Architecture, canonical: dict, o: dict) -> dict:
  out = {arch.router: canonical["router_kernel"].T}
  if "router_bias" in canonical:
    out[arch.router.rsplit(".", 1)[0] + ".bias"] = canonical["router_bias"]
  if arch.routing_bias and "routing_bias" in canonical:
    out[arch.routing_bias] = (canonical["routing_bias"][None] if arch.routing_bias_2d
                              else canonical["routing_bias"])
  experts = _write_experts(arch, {k[len("experts_"):]: v for k, v in canonical.items()
                                  if k.startswith("experts_")}, o)
  out.update({arch.experts_at + name: value for name, value in experts.items()})
  if arch.shared and arch.shared_layout == "input_output" and "shared_w_in" in canonical:
    out[f"{arch.shared}.input_linear.weight"] = canonical["shared_w_in"].T
    out[f"{arch.shared}.output_linear.weight"] = canonical["shared_w_down"].T
  elif arch.shared and "shared_w_in" in canonical:
    w_in = canonical["shared_w_in"].T  # [2Fs, D]
    half = w_in.shape[0] // 2
    out[f"{arch.shared}.gate_proj.weight"] = w_in[:half]
    out[f"{arch.shared}.up_proj.weight"] = w_in[half:]
    out[f"{arch.shared}.down_proj.weight"] = canonical["shared_w_down"].T
  if arch.shared_gate:
    out[arch.shared_gate] = canonical["shared_gate"].T
  if arch.output_bias:
    out[arch.output_bias] = canonical["output_bias"]
  return {name: np.ascontiguousarray(value) for name, value in out.items()}


# --------------------------------------------------------------------------- nn.MoE side

# Canonical name -> the attribute path of the parameter in nn.MoE.
_PARAMS = {
    "router_kernel": ("router", "kernel"),
    "router_bias": ("router", "bias"),
    "routing_bias": ("routing_bias",),
    "experts_w_in": ("gate_up|up", "kernel"),
    "experts_b_in": ("gate_up|up", "bias"),
    "experts_w_down": ("down", "kernel"),
    "experts_b_down": ("down", "bias"),
    "shared_w_in": ("shared", "up", "kernel"),
    "shared_w_down": ("shared", "down", "kernel"),
    "shared_gate": ("shared", "gate", "kernel"),
    "output_bias": ("output_bias",),
}


def _variable(moe, path):
  node = moe
  for part in path:
    for name in part.split("|"):
      found = getattr(node, name, None)
      if found is not None:
        break
    node = found
    if node is None:
      return None
  return node


def _assign(variable, value):
  if hasattr(variable, "set_value"):
    variable.set_value(value)
  else:
    variable.value = value


def _moe_arrays(moe) -> dict:
  out = {}
  for name, path in _PARAMS.items():
    variable = _variable(moe, path)
    if variable is not None:
      out[name] = np.asarray(variable[...])
  return out


def _moe_arguments(arch: Architecture, options: dict, seq_len, overrides) -> dict:
  del seq_len  # Switch's per-sequence capacity is nn.MoE's expert_capacity: no length needed
  kwargs = dict(options)
  if "expert_capacity" in kwargs:
    kwargs["capacity_per"] = "sequence"
    if "capacity_factor" in overrides:  # a factor (or None: dropless) replaces it
      del kwargs["expert_capacity"]
  kwargs["load_balancing_convention"] = "transformers"
  kwargs.update(overrides)
  return kwargs


def from_transformers(block_or_config, state_dict: Mapping[str, Any] | None = None, *,
                      rngs: nnx.Rngs | None = None, config=None, prefix: str = "",
                      seq_len: int | None = None, **overrides) -> MoE:
  """The `MoE` of a Hugging Face transformers MoE block, with its weights.

  Args:
    block_or_config: a transformers MoE block (``model.model.layers[i].mlp``; for
      GraniteMoeShared and GraniteMoeHybrid the decoder layer ``model.model.layers[i]``,
      whose routed block and shared MLP make its FFN: its config is found on it or its
      submodules, its weights are its ``state_dict()``), or a config
      (a transformers config, its ``to_dict()`` or that as JSON) with `state_dict`.
    state_dict: the block's tensors by name (numpy, torch or jax arrays), as its
      ``state_dict()`` names them (after `prefix`); with a block: instead of its own.
    rngs: for the layer's construction (the weights are then replaced); default
      ``nnx.Rngs(0)``.
    config: with a block: its config, where the block does not keep one.
    prefix: only the tensors whose names start with it, the prefix removed (e.g.
      ``"model.layers.3.mlp."`` of a whole model's state dict).
    seq_len: accepted for compatibility and not needed: Switch's per-sequence
      ``expert_capacity`` becomes nn.MoE's ``expert_capacity`` with
      ``capacity_per="sequence"``, whatever the sequences' length.
    **overrides: more `MoE` arguments (``dtype``, ``param_dtype``, ``fused``,
      ``implementation``, ...); they replace the ones the config gives.

  Returns:
    an `MoE` computing what the block computes (forward, gradients, expert choice); its
    ``aux["load_balancing_loss"]`` is transformers' ``load_balancing_loss_func`` value
    (``load_balancing_convention="transformers"``).

  Raises:
    NotImplementedError: an architecture, activation or option nn.MoE cannot express.
    ValueError: tensors missing, left over or of the wrong shape for the config.
  """
  if hasattr(block_or_config, "state_dict") and callable(block_or_config.state_dict):
    block = block_or_config
    arch = _architecture(type(block).__name__)
    config = _block_config(arch, block) if config is None else config
    state_dict = block.state_dict() if state_dict is None else state_dict
  else:
    config = block_or_config
    if state_dict is None:
      raise ValueError("from_transformers(config) needs the state_dict of the block")
    if isinstance(config, str):
      config = _as_dict(config)
    model_type = _field(config, "model_type", default=None)
    if model_type is None:
      raise ValueError("the config has no model_type: cannot tell its architecture")
    arch = _architecture(model_type)
  options = arch.options(config)
  tensors = _Tensors(state_dict, prefix, arch.reads)
  canonical = _read(arch, tensors, options)
  kwargs = _moe_arguments(arch, options, seq_len, overrides)
  kwargs.setdefault("param_dtype", canonical["experts_w_in"].dtype)
  sizes = kwargs.pop("num_experts"), kwargs.pop("embed"), kwargs.pop("mlp")
  if rngs is None:  # every weight comes from the state dict: no random draws
    moe = nnx.eval_shape(lambda: MoE(*sizes, rngs=nnx.Rngs(0), **kwargs))
  else:
    moe = MoE(*sizes, rngs=rngs, **kwargs)
  unset = {id(v) for _, v in nnx.iter_graph(moe) if isinstance(v, nnx.Variable)}
  for name, value in canonical.items():
    variable = _variable(moe, _PARAMS[name])
    if variable is None:
      raise ValueError(f"{arch.name}: the layer built has no parameter for {name}")
    current = variable.get_value() if hasattr(variable, "get_value") else variable.value
    if tuple(current.shape) != tuple(value.shape):
      raise ValueError(f"{arch.name}: {name} is {tuple(value.shape)}, the layer's "
                       f"{'.'.join(_PARAMS[name])} is {tuple(current.shape)}")
    _assign(variable, jnp.asarray(np.asarray(value), dtype=current.dtype))
    unset.discard(id(variable))
  if rngs is None and unset:
    names = [".".join(map(str, path)) for path, v in nnx.iter_graph(moe)
             if isinstance(v, nnx.Variable) and id(v) in unset]
    raise ValueError(f"{arch.name}: no weights in the state dict for {names}")
  return moe


def to_transformers(moe: MoE, config_or_arch, *, prefix: str = "") -> dict[str, np.ndarray]:
  """The weights of `moe` as a transformers 5.x block of that architecture stores them.

  Args:
    moe: an `MoE` (e.g. from `from_transformers`, trained).
    config_or_arch: the transformers config (object, dict or JSON) of the block, or an
      architecture name of `ARCHITECTURES` / a ``model_type`` / a block class name.
    prefix: put before every name (e.g. ``"model.layers.3.mlp."``).

  Returns:
    ``{name: numpy array}``, as the block's ``state_dict()`` names them (load with
    ``block.load_state_dict({k: torch.from_numpy(v) for k, v in ...})``).

  Raises:
    ValueError: `moe` has weights the architecture does not store (they would be lost),
      lacks ones it needs, or its shapes differ from the config's.
  """
  if isinstance(config_or_arch, str) and not config_or_arch.lstrip().startswith("{"):
    arch = _architecture(config_or_arch)
    options = dict(num_experts=moe.num_experts, embed=moe.embed, mlp=moe.mlp)
    if arch.shared and (moe.shared is not None or "shared" not in arch.optional):
      options["num_shared_experts"] = 1
    if arch.routing_bias and (moe.routing_bias is not None
                              or "routing_bias" not in arch.optional):
      options["routing_bias"] = True
  else:
    config = _as_dict(config_or_arch)
    arch = _architecture(_field(config, "model_type"))
    options = arch.options(config)
    for name in ("num_experts", "embed", "mlp", "top_k"):
      if getattr(moe, name) != options[name]:
        raise ValueError(f"{arch.name}: the layer's {name} is {getattr(moe, name)}, the "
                         f"config's {options[name]}")
  canonical = _moe_arrays(moe)
  wanted = {"router_kernel", "experts_w_in", "experts_w_down"}
  if arch.experts == "interleaved":
    wanted |= {"experts_b_in", "experts_b_down", "router_bias"}
  if arch.name == "switch_transformers" and "router_bias" in canonical:
    wanted.add("router_bias")
  if arch.routing_bias and options.get("routing_bias"):
    wanted.add("routing_bias")
  if arch.shared and options.get("num_shared_experts"):
    wanted |= {"shared_w_in", "shared_w_down"}
  if arch.shared_gate:
    wanted.add("shared_gate")
  if arch.output_bias:
    wanted.add("output_bias")
  missing = sorted(wanted - set(canonical))
  extra = sorted(set(canonical) - wanted)
  if missing or extra:
    raise ValueError(f"{arch.name} stores {sorted(wanted)}; the layer "
                     + (f"lacks {missing}" if missing else "")
                     + (" and " if missing and extra else "")
                     + (f"has {extra}, which it would lose" if extra else ""))
  out = _write(arch, canonical, options)
  return {prefix + name: value for name, value in out.items()}


# --------------------------------------------------------------------------- blocks

_MODULE_ACTIVATIONS = {"SiLU": "silu", "SiLUActivation": "silu", "ReLU": "relu",
                       "GELUActivation": "gelu", "NewGELUActivation": "gelu_new",
                       "PytorchGELUTanh": "gelu_new", "GELUTanh": "gelu_new",
                       "FastGELUActivation": "gelu_fast"}


def _module_activation(module) -> str:
  name = type(module).__name__
  if name == "GELU":
    return "gelu_new" if getattr(module, "approximate", "none") == "tanh" else "gelu"
  if name not in _MODULE_ACTIVATIONS:
    raise NotImplementedError(f"activation module {name}: supported are "
                              f"{sorted(_MODULE_ACTIVATIONS)}")
  return _MODULE_ACTIVATIONS[name]


def _block_config(arch: Architecture, block):
  """The config of a block: its own or a submodule's (transformers 5.x's experts keep it);
  DBRX, JetMoE and Switch blocks keep none, their options are read from the modules."""
  for module in [block, *block.modules()]:
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_dict"):
      if arch.name == "hunyuan_v1_moe":  # per-layer lists: this layer's, from its gate
        return {**config.to_dict(), "num_experts": block.gate.num_experts,
                "moe_topk": block.gate.top_k}
      if arch.name == "ernie4_5_vl_moe":  # text or vision experts: their own width
        return {**config.to_dict(), "moe_intermediate_size": block.experts.intermediate_dim}
      return config
  if arch.name == "dbrx":
    mlp = block.experts.mlp
    return {"model_type": "dbrx", "d_model": block.experts.hidden_size,
            "ffn_config": {"moe_num_experts": block.experts.num_experts,
                           "ffn_hidden_size": block.experts.ffn_hidden_size,
                           "moe_top_k": block.top_k,
                           "moe_normalize_expert_weights": block.moe_normalize_expert_weights,
                           "ffn_act_fn": {"name": _module_activation(mlp.activation_fn)}}}
  if arch.name == "jetmoe":
    return {"model_type": "jetmoe", "hidden_size": block.input_size,
            "intermediate_size": block.hidden_size,
            "num_local_experts": block.router.num_experts,
            "num_experts_per_tok": block.router.top_k,
            "activation_function": _module_activation(block.activation)}
  if arch.name == "switch_transformers":
    first = block.experts["expert_0"]
    return {"model_type": "switch_transformers", "num_experts": block.router.num_experts,
            "d_model": first.wi.in_features, "d_ff": first.wi.out_features,
            "expert_capacity": block.router.expert_capacity,
            "router_bias": block.router.classifier.bias is not None,
            "dense_act_fn": _module_activation(first.act)}
  raise ValueError(f"{type(block).__name__} keeps no config: pass config=")
