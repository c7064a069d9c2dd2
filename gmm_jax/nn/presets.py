"""Layer shapes and routing of public MoE models: one MoE layer each (`MoE.from_preset`)."""

from __future__ import annotations

from typing import Any

MOE_PRESETS: dict[str, dict[str, Any]] = {
    # Mixtral-8x7B: softmax top-2 of 8, renormalized, SwiGLU experts.
    "mixtral-8x7b": dict(num_experts=8, embed=4096, mlp=14336, top_k=2, score="softmax",
                         activation="silu"),
    # DeepSeek-V3: sigmoid scores, bias-corrected selection (aux-loss-free balancing),
    # top-4 of 8 groups, top-8 of 256 experts, weights renormalized and scaled by 2.5, one
    # shared expert.
    "deepseek-v3": dict(num_experts=256, embed=7168, mlp=2048, top_k=8, score="sigmoid",
                        routing_bias=True, num_expert_groups=8, top_k_groups=4,
                        normalize_top_k=True, routed_scaling_factor=2.5,
                        num_shared_experts=1, activation="silu"),
    # Qwen3-30B-A3B: softmax top-8 of 128, renormalized (norm_topk_prob), no shared expert.
    "qwen3-moe-30b-a3b": dict(num_experts=128, embed=2048, mlp=768, top_k=8, score="softmax",
                              normalize_top_k=True, activation="silu"),
    # gpt-oss-120b: router with a bias, softmax over the top-4 of 128 (= renormalized),
    # clamped SwiGLU, expert biases.
    "gpt-oss-120b": dict(num_experts=128, embed=2880, mlp=2880, top_k=4, score="softmax",
                         normalize_top_k=True, router_bias=True, use_bias=True,
                         activation="swiglu_clamped"),
}


def scaled(name: str, scale: float = 1.0) -> dict[str, Any]:
  """The arguments of preset `name` with the widths (embed, mlp, shared_mlp) multiplied by
  `scale` (multiples of 8, at least 8)."""
  if name not in MOE_PRESETS:
    raise ValueError(f"unknown preset {name!r}; one of {sorted(MOE_PRESETS)}")
  kwargs = dict(MOE_PRESETS[name])
  if scale != 1.0:
    for key in ("embed", "mlp", "shared_mlp"):
      if kwargs.get(key):
        kwargs[key] = max(8, int(round(kwargs[key] * scale / 8)) * 8)
  return kwargs
