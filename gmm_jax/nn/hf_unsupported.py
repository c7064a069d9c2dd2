"""The transformers MoE blocks `from_transformers` does not load, and why.

``UNSUPPORTED[model_type] = (block classes, what is missing)``: the reason
`from_transformers` gives in its ``NotImplementedError`` for such a block or config, and
docs/transformers.md's table. Two kinds of reason: the block is not a routed FFN that
`nn.MoE` computes (it names the part out of scope), or it is one but needs what the layer
lacks (an option, a weight layout), or only an entry and a fixture of its own ("not yet").
The list was made from transformers 5.25's modeling code.
"""

from __future__ import annotations

_NOT_YET = ("not yet: the layer expresses it ({}), it lacks an entry and a fixture of its "
            "own here")
_COPY = ("not yet: its block is a copy of {}'s (an alias of that entry, once it is supported, "
         "and a fixture)")
_CLAMPED_SILU = ("needs a clamped SwiGLU without gpt-oss's alpha and +1: silu(min(gate, "
                 "limit)) * clip(up, -limit, limit) (nn.MoE's swiglu_clamped is gpt-oss's)")
_ACT_THEN_CLAMP = ("needs the activation clamped after it is applied, min(act(gate), limit) "
                   "* clip(up, -limit, limit), with one limit per layer (swiglu_limits"
                   "[layer_idx]: the block is built for a layer)")

UNSUPPORTED: dict[str, tuple[tuple[str, ...], str]] = {
    "afmoe": (("AfmoeSparseMoeBlock",), _NOT_YET.format(
        "sigmoid, routing bias expert_bias, renormalized, routed_scaling_factor=route_scale, "
        "shared experts")),
    "axk1": (("AXK1MoE",), "not a routed FFN alone: the block ends with an RMSNorm "
             "(post_mlp_layernorm) of the routed plus shared output"),
    "axk2": (("AXK2MoE",), "needs group-limited routing that masks the other groups' "
             "experts to 0 rather than -inf (with bias-corrected sigmoid scores, which can be "
             "negative, a masked expert can be chosen)"),
    "bailing_hybrid": (("BailingHybridMoE",), _ACT_THEN_CLAMP),
    "deepseek_ocr2": (("DeepseekOcr2TextMoe",), _COPY.format("deepseek_v2")),
    "deepseek_v4": (("DeepseekV4SparseMoeBlock",), "not only top-k routing: its hash layers "
                    "choose experts by token id (tid2eid[input_ids], the block needs the "
                    "input ids); and " + _CLAMPED_SILU),
    "diffusion_gemma": (("DiffusionGemmaTextRouter", "DiffusionGemmaTextExperts"),
                        "no MoE block: the decoder layer holds router and experts next to a "
                        "dense MLP; the router RMS-normalizes its input with a learned scale "
                        "and multiplies the weights by a per-expert scale"),
    "doge": (("DogeCDMoE",), "not a routed FFN: product-key routing over sqrt(E) x sqrt(E) "
             "keys, each expert a pair of embedding vectors (one hidden unit), added to a "
             "dense MLP"),
    "dots3_note": (("Dots3NoteTextMoE", "Dots3NoteVisionMoE"), _NOT_YET.format(
        "sigmoid, routing bias, renormalized, scaling, shared experts of "
        "shared_experts_intermediate_size; the vision MoE's options per layer")),
    "ergo": (("ErgoMoE",), "needs a norm of each expert's output (per-expert RMSNorm, "
             "post_expert_norm) and a squared-ReLU shared expert followed by an RMSNorm"),
    "glm5_next": (("Glm5NextTextMoE",), _CLAMPED_SILU),
    "hy_v4": (("HYV4MoE",), _CLAMPED_SILU),
    "hy_v4_vl": (("HYV4VLMoE",), _CLAMPED_SILU),
    "inkling": (("InklingMoE",), "needs shared experts weighted by the router: the router "
                "scores routed and shared experts together (softmax over the log-sigmoids "
                "of the top-k and the shared logits) times a learned global scale"),
    "inkling2": (("Inkling2SparseMoeBlock",), "needs a soft-capped SwiGLU: "
                 "c_g tanh(gate / c_g) * sigmoid(gate) * c_u tanh(up / c_u) "
                 "(mlp_gate_softcap, mlp_up_softcap)"),
    "inkling2_loop": (("Inkling2LoopSparseMoeBlock",), "needs a soft-capped SwiGLU: "
                      "c_g tanh(gate / c_g) * sigmoid(gate) * c_u tanh(up / c_u) "
                      "(mlp_gate_softcap, mlp_up_softcap)"),
    "kolibri1": (("Kolibri1SparseMoeBlock",), "needs the selection by the logits plus the "
                 "correction bias (nn.MoE's routing bias adds to the scores), weights the "
                 "sigmoid of the chosen logits"),
    "kolibri1_1": (("Kolibri1_1SparseMoeBlock",), "needs the selection by the logits plus "
                   "the correction bias (nn.MoE's routing bias adds to the scores), weights "
                   "the sigmoid of the chosen logits"),
    "laguna": (("LagunaSparseMoeBlock",), "needs router logit soft-capping "
               "(tanh(logits / c) * c, moe_router_logit_softcapping)"),
    "minimax_m3_vl": (("MiniMaxM3VLSparseMoeBlock",), _NOT_YET.format(
        "sigmoid, routing bias, renormalized, scaling, gpt-oss's clamped SwiGLU with the "
        "halves not interleaved, a shared expert; the reader lacks the shared expert's fused "
        "gate_up_proj layout")),
    "muse_spark": (("MuseSparkMoE",), "not a routed FFN alone: the experts run in a projected "
                   "space (pre_expert_proj and a centered RMSNorm before them, "
                   "post_expert_proj after)"),
    "nemotron_h": (("NemotronHMoE",), "needs a squared-ReLU (relu2) activation of ungated "
                   "experts, and, with moe_latent_size, projections into and out of a latent "
                   "space around the experts"),
    "openai_privacy_filter": (("OpenAIPrivacyFilterMLP",), _NOT_YET.format(
        "gpt-oss's routing and clamped SwiGLU; needs the expert layout [E, D, 2F] with the "
        "halves not interleaved and with biases")),
    "step3p7": (("Step3p7SparseMoeBlock",), _ACT_THEN_CLAMP),
    "unlimited_ocr": (("UnlimitedOcrTextMoe",), _COPY.format("deepseek_v2")),
    "vitpose_backbone": (("VitPoseNaiveMoe",), "not a routed FFN: each expert is a linear "
                         "head chosen by the dataset index given with the input, no router"),
    "zaya": (("ZayaSparseMoeBlock",), "needs a router that is an MLP fed by the previous "
             "layer's router state, with a skip (no-expert) class and balancing biases on "
             "the probabilities"),
}


def unsupported(name: str) -> tuple[str, tuple[str, ...], str] | None:
  """(model_type, block classes, reason) of a model_type or block class of `UNSUPPORTED`."""
  for model_type, (classes, reason) in UNSUPPORTED.items():
    if name == model_type or name in classes:
      return model_type, classes, reason
  return None
