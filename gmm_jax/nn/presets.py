"""Layer shapes and routing of public MoE models: one `MoEConfig` of an MoE layer each
(`MoE.from_preset`, `preset`)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gmm_jax.nn.config import MoEConfig

PRESET_CONFIGS: dict[str, MoEConfig] = {
    # Mixtral-8x7B: softmax top-2 of 8, renormalized, SwiGLU experts.
    "mixtral-8x7b": MoEConfig(num_experts=8, embed=4096, mlp=14336, top_k=2, score="softmax",
                              activation="silu"),
    # Phi-3.5-MoE: SparseMixer's top-2 of 16 (router_jitter_noise 0.01), SwiGLU experts.
    "phi-3.5-moe": MoEConfig(num_experts=16, embed=4096, mlp=6400, top_k=2,
                             score="sparsemixer", normalize_top_k=False, sparsemixer_eps=0.01,
                             activation="silu"),
    # Qwen1.5-MoE-A2.7B (Qwen2-MoE): softmax top-4 of 60, not renormalized
    # (norm_topk_prob=False), a shared expert of width 5632 scaled by sigmoid(x @ w).
    "qwen1.5-moe-a2.7b": MoEConfig(num_experts=60, embed=2048, mlp=1408, top_k=4,
                                   score="softmax", normalize_top_k=False,
                                   num_shared_experts=1, shared_mlp=5632, shared_gate=True,
                                   activation="silu"),
    # Qwen3-30B-A3B: softmax top-8 of 128, renormalized (norm_topk_prob), no shared expert.
    "qwen3-moe-30b-a3b": MoEConfig(num_experts=128, embed=2048, mlp=768, top_k=8,
                                   score="softmax", normalize_top_k=True, activation="silu"),
    # Qwen3-Next-80B-A3B: softmax top-10 of 512, renormalized, a gated shared expert of
    # width 512.
    "qwen3-next-80b-a3b": MoEConfig(num_experts=512, embed=2048, mlp=512, top_k=10,
                                    score="softmax", normalize_top_k=True,
                                    num_shared_experts=1, shared_mlp=512, shared_gate=True,
                                    activation="silu"),
    # DeepSeek-V2: softmax top-6 of 160, experts only in the best 3 of 8 groups (ranked by
    # their best score, group_limited_greedy), not renormalized, scaled by 16, two shared
    # experts.
    "deepseek-v2": MoEConfig(num_experts=160, embed=5120, mlp=1536, top_k=6, score="softmax",
                             normalize_top_k=False, num_expert_groups=8, top_k_groups=3,
                             group_score="max", routed_scaling_factor=16.0,
                             num_shared_experts=2, activation="silu"),
    # DeepSeek-V3: sigmoid scores, bias-corrected selection (aux-loss-free balancing),
    # top-4 of 8 groups, top-8 of 256 experts, weights renormalized and scaled by 2.5, one
    # shared expert.
    "deepseek-v3": MoEConfig(num_experts=256, embed=7168, mlp=2048, top_k=8, score="sigmoid",
                             routing_bias=True, num_expert_groups=8, top_k_groups=4,
                             normalize_top_k=True, routed_scaling_factor=2.5,
                             num_shared_experts=1, activation="silu"),
    # dots.llm1: DeepSeek-V3's routing (sigmoid, bias-corrected selection, one group), top-6
    # of 128, renormalized, scaled by 2.5, two shared experts.
    "dots.llm1": MoEConfig(num_experts=128, embed=4096, mlp=1408, top_k=6, score="sigmoid",
                           routing_bias=True, normalize_top_k=True, routed_scaling_factor=2.5,
                           num_shared_experts=2, activation="silu"),
    # ERNIE-4.5-21B-A3B: softmax top-6 of 64 chosen by the softmax plus a correction bias,
    # renormalized, two shared experts.
    "ernie-4.5-21b-a3b": MoEConfig(num_experts=64, embed=2560, mlp=1536, top_k=6,
                                   score="softmax", routing_bias=True, normalize_top_k=True,
                                   num_shared_experts=2, activation="silu"),
    # ERNIE-4.5-VL-28B-A3B's text experts (its MoE block's text_moe: the shared experts are
    # the parent block's): as ERNIE-4.5-21B-A3B's routing, no shared expert.
    "ernie-4.5-vl-28b-a3b-text": MoEConfig(num_experts=64, embed=2560, mlp=1536, top_k=6,
                                           score="softmax", routing_bias=True,
                                           normalize_top_k=True, activation="silu"),
    # Hunyuan-A13B: softmax top-8 of 64, renormalized, a shared MLP of the experts' width.
    "hunyuan-a13b": MoEConfig(num_experts=64, embed=4096, mlp=3072, top_k=8, score="softmax",
                              normalize_top_k=True, num_shared_experts=1, activation="silu"),
    # JetMoE-8B (its MLP experts): softmax over the top-2 logits of 8 (= renormalized), a
    # bias on the layer's output.
    "jetmoe-8b": MoEConfig(num_experts=8, embed=2048, mlp=5632, top_k=2, score="softmax",
                           normalize_top_k=True, output_bias=True, activation="silu"),
    # Kimi-Linear-48B-A3B (its MoE layers): DeepSeek-V3's routing (sigmoid, bias-corrected
    # selection, one group), top-8 of 256, renormalized, scaled by 2.446, one shared expert.
    "kimi-linear-48b-a3b": MoEConfig(num_experts=256, embed=2304, mlp=1024, top_k=8,
                                     score="sigmoid", routing_bias=True, normalize_top_k=True,
                                     routed_scaling_factor=2.446, num_shared_experts=1,
                                     activation="silu"),
    # LongCat-Flash: softmax over 512 experts and 256 zero (identity) experts, top-12 chosen
    # with a correction bias, not renormalized, scaled by 6.
    "longcat-flash": MoEConfig(num_experts=512, num_identity_experts=256, embed=6144,
                               mlp=2048, top_k=12, score="softmax", routing_bias=True,
                               normalize_top_k=False, routed_scaling_factor=6.0,
                               activation="silu"),
    # OLMoE-1B-7B: softmax top-8 of 64, not renormalized (norm_topk_prob=False).
    "olmoe-1b-7b": MoEConfig(num_experts=64, embed=2048, mlp=1024, top_k=8, score="softmax",
                             normalize_top_k=False, activation="silu"),
    # gpt-oss-120b: router with a bias, softmax over the top-4 of 128 (= renormalized),
    # clamped SwiGLU (swiglu_limit 7.0, alpha 1.702), expert biases.
    "gpt-oss-120b": MoEConfig(num_experts=128, embed=2880, mlp=2880, top_k=4, score="softmax",
                              normalize_top_k=True, router_bias=True, use_bias=True,
                              activation="swiglu_clamped", swiglu_limit=7.0,
                              swiglu_alpha=1.702),
    # Granite-3.0-3B-A800M (GraniteMoE): softmax over the top-8 logits of 40 (=
    # renormalized), SwiGLU experts.
    "granite-3.0-3b-a800m": MoEConfig(num_experts=40, embed=1536, mlp=512, top_k=8,
                                      score="softmax", normalize_top_k=True,
                                      activation="silu"),
    # DBRX: softmax top-4 of 16, divided by their L1 norm (moe_normalize_expert_weights=1:
    # renormalized), SwiGLU experts.
    "dbrx": MoEConfig(num_experts=16, embed=6144, mlp=10752, top_k=4, score="softmax",
                      normalize_top_k=True, activation="silu"),
    # GLM-4.5-Air (GLM4-MoE): sigmoid scores with a bias-corrected selection, top-8 of 128
    # (one group: no group limit), renormalized, scaling 1.0, one shared expert.
    "glm-4.5-air": MoEConfig(num_experts=128, embed=4096, mlp=1408, top_k=8, score="sigmoid",
                             routing_bias=True, normalize_top_k=True,
                             routed_scaling_factor=1.0, num_shared_experts=1,
                             activation="silu"),
    # Llama 4 Scout (17B-16E): top-1 of 16, the weight sigmoid(top logit) multiplying the
    # expert's input, a shared expert of the experts' width.
    "llama-4-scout": MoEConfig(num_experts=16, embed=5120, mlp=8192, top_k=1, score="sigmoid",
                               normalize_top_k=False, router_weight_on="input",
                               num_shared_experts=1, activation="silu"),
    # Granite-4.0-H-Tiny (GraniteMoeHybrid): softmax over the top-6 logits of 64 (=
    # renormalized), the decoder layer's shared MLP of width 1024 added.
    "granite-4.0-h-tiny": MoEConfig(num_experts=64, embed=1536, mlp=512, top_k=6,
                                    score="softmax", normalize_top_k=True,
                                    num_shared_experts=1, shared_mlp=1024, activation="silu"),
    # Jamba-v0.1: softmax top-2 of 16, not renormalized, SwiGLU experts.
    "jamba-v0.1": MoEConfig(num_experts=16, embed=4096, mlp=14336, top_k=2, score="softmax",
                            normalize_top_k=False, activation="silu"),
    # LFM2-8B-A1B (LFM2-MoE): sigmoid scores with a bias-corrected selection (expert_bias),
    # top-4 of 32, renormalized with 1e-6 added to the sum.
    "lfm2-8b-a1b": MoEConfig(num_experts=32, embed=2048, mlp=1792, top_k=4, score="sigmoid",
                             routing_bias=True, normalize_top_k=True, normalize_epsilon=1e-6,
                             activation="silu"),
    # MiniMax-M2: sigmoid scores with a bias-corrected selection, top-8 of 256,
    # renormalized, no shared expert.
    "minimax-m2": MoEConfig(num_experts=256, embed=3072, mlp=1536, top_k=8, score="sigmoid",
                            routing_bias=True, normalize_top_k=True, activation="silu"),
    # Mistral-Small-4-119B (Mistral 4): softmax scores, top-4 of 128 (one group: no group
    # limit), renormalized, one shared expert of the experts' width.
    "mistral-small-4": MoEConfig(num_experts=128, embed=4096, mlp=2048, top_k=4,
                                 score="softmax", normalize_top_k=True, num_shared_experts=1,
                                 activation="silu"),
    # Solar-Open-100B: DeepSeek-V3's routing (sigmoid, bias-corrected selection; one group:
    # no group limit), top-8 of 128, renormalized, scaling 1.0, one shared expert.
    "solar-open-100b": MoEConfig(num_experts=128, embed=4096, mlp=1280, top_k=8,
                                 score="sigmoid", routing_bias=True, normalize_top_k=True,
                                 num_shared_experts=1, activation="silu"),
    # Switch-Base-8: softmax top-1 of 8, not renormalized, ReLU FFN (not gated), capacity
    # per sequence (expert_capacity 64 at 512 tokens: capacity_factor 1.0).
    "switch-base-8": MoEConfig(num_experts=8, embed=768, mlp=3072, top_k=1, score="softmax",
                               normalize_top_k=False, gated=False, activation="relu",
                               capacity_factor=1.0, capacity_per="sequence"),
}

# The presets as `MoE`'s keyword arguments (every field), read from the configs above.
MOE_PRESETS: dict[str, dict[str, Any]] = {
    name: config.keywords() for name, config in PRESET_CONFIGS.items()}


def preset(name: str, scale: float = 1.0, **changes) -> MoEConfig:
  """The config of preset `name` with the widths (embed, mlp, shared_mlp) multiplied by
  `scale` (multiples of 8, at least 8), then `changes` (any fields) applied.

  Raises:
    ValueError: an unknown name, or (from `MoEConfig`) changes it cannot take.
  """
  if name not in PRESET_CONFIGS:
    raise ValueError(f"unknown preset {name!r}; one of {sorted(PRESET_CONFIGS)}")
  config = PRESET_CONFIGS[name]
  widths = {}
  if scale != 1.0:
    for key in ("embed", "mlp", "shared_mlp"):
      if getattr(config, key):
        widths[key] = max(8, int(round(getattr(config, key) * scale / 8)) * 8)
  return dataclasses.replace(config, **{**widths, **changes})


def scaled(name: str, scale: float = 1.0) -> dict[str, Any]:
  """The arguments of preset `name` with the widths (embed, mlp, shared_mlp) multiplied by
  `scale` (multiples of 8, at least 8): `preset`'s config as `MoE`'s keywords."""
  return preset(name, scale).keywords()
