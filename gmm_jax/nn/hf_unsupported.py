"""The transformers MoE blocks `from_transformers` does not load, and why.

``UNSUPPORTED[model_type] = Unsupported(block classes, what is missing, other model_types)``:
the reason `from_transformers` and `to_transformers` give in their ``NotImplementedError``
for such a block, config or name, and docs/transformers.md's table. Where `ARCHITECTURES`
holds the model_type as well (Ernie 4.5 VL, JetMoE), only the block classes listed are
refused: that model type's other MoE block loads. Two kinds of reason: the block is not a
routed FFN that `nn.MoE` computes (it names the part out of scope), or it is one but needs
what the layer lacks (an option, a weight layout), or only an entry and a fixture of its own
("not yet"). The list was made from transformers 5.25's modeling code.
"""

from __future__ import annotations

from typing import NamedTuple


class Unsupported(NamedTuple):
  """A refused MoE block: its classes, why, and the other model_types refused alike."""
  blocks: tuple[str, ...]
  reason: str
  aliases: tuple[str, ...] = ()


_NOT_YET = ("not yet: the layer expresses it ({}), it lacks an entry and a fixture of its "
            "own here")
_COPY = "not yet: its block is a copy of {}'s (it needs an alias of that entry and a fixture)"
_CLAMPED_SILU = ("needs a clamped SwiGLU without gpt-oss's alpha and +1: silu(min(gate, "
                 "limit)) * clip(up, -limit, limit) (nn.MoE's swiglu_clamped is gpt-oss's)")
_ACT_THEN_CLAMP = ("needs the activation clamped after it is applied, min(act(gate), limit) "
                   "* clip(up, -limit, limit), with one limit per layer (swiglu_limits"
                   "[layer_idx]: the block is built for a layer)")
_SOFT_CAPPED_SWIGLU = ("needs a soft-capped SwiGLU: c_g tanh(gate / c_g) * sigmoid(gate) * "
                       "c_u tanh(up / c_u) (mlp_gate_softcap, mlp_up_softcap)")
_LOGIT_SELECTION = ("needs the selection by the logits plus the correction bias (nn.MoE's "
                    "routing bias adds to the scores), weights the sigmoid of the chosen "
                    "logits")

UNSUPPORTED: dict[str, Unsupported] = {k: Unsupported(*v) for k, v in {
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
    "ernie4_5_vl_moe": (("Ernie4_5_VLMoeMoeBlock",), "not a routed FFN of one set of "
                        "experts: text and vision tokens go to two sets of experts picked by "
                        "moe_mm_token_type_ids (modality-isolated experts); load its text_moe "
                        "or vision_moe sub-block (each an nn.MoE, model_type "
                        "ernie4_5_vl_moe_text) and its shared_experts apart"),
    "gemma4": (("Gemma4TextDecoderLayer", "Gemma4TextExperts", "Gemma4TextRouter"),
               "no MoE block: the decoder layer routes the residual through the router's own "
               "RMSNorm and learned `scale` while the experts read "
               "`pre_feedforward_layernorm_2`'s output (nn.MoE routes the tokens its experts "
               "compute on), multiplies the renormalized weights by a learned "
               "`per_expert_scale`, and passes the experts' sum through "
               "`post_feedforward_layernorm_2` (an RMSNorm of the MoE output) before adding it "
               "to the dense MLP's", ("gemma4_text",)),
    "glm5_next": (("Glm5NextTextMoE",), _CLAMPED_SILU),
    "hy_v4": (("HYV4MoE",), _CLAMPED_SILU),
    "hy_v4_vl": (("HYV4VLMoE",), _CLAMPED_SILU),
    "inkling": (("InklingMoE",), "needs shared experts weighted by the router: the router "
                "scores routed and shared experts together (softmax over the log-sigmoids "
                "of the top-k and the shared logits) times a learned global scale"),
    "inkling2": (("Inkling2SparseMoeBlock",), _SOFT_CAPPED_SWIGLU),
    "inkling2_loop": (("Inkling2LoopSparseMoeBlock",), _SOFT_CAPPED_SWIGLU),
    "jetmoe": (("JetMoeMoA",), "not a routed FFN: JetMoE's mixture of attention experts "
               "routes tokens to per-expert query and output projections around attention; "
               "its JetMoeMoE (the MLP experts) loads"),
    "kolibri1": (("Kolibri1SparseMoeBlock",), _LOGIT_SELECTION),
    "kolibri1_1": (("Kolibri1_1SparseMoeBlock",), _LOGIT_SELECTION),
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
    "nllb-moe": (("NllbMoeSparseMLP",), "not a routed FFN of its experts: transformers' "
                 "NllbMoeSparseMLP hands NllbMoeExperts the router's top-1 mask ([T, E] of "
                 "0/1) where expert ids belong, so expert_1 computes every token with its "
                 "top-1 weight and expert_0 with its other weights, whatever experts were "
                 "chosen. The routing it intends differs from nn.MoE's too: the capacity "
                 "(expert_capacity; ceil(moe_eval_capacity_token_fraction * T) in eval) "
                 "counts the call's tokens with every top-1 assignment ranked before any "
                 "top-2 one (nn.MoE ranks assignments token by token), the weights are "
                 "renormalized after the drops (normalize_router_prob_before_dropping=False), "
                 "batch_prioritized_routing orders the tokens by their top probability, and "
                 "second_expert_policy 'sampling'/'random' draws at random", ("nllb_moe",)),
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
}.items()}


def unsupported(name: str) -> tuple[str, tuple[str, ...], str] | None:
  """(model_type, block classes, reason) of a model_type, alias or block class of
  `UNSUPPORTED`."""
  for model_type, entry in UNSUPPORTED.items():
    if name == model_type or name in entry.aliases or name in entry.blocks:
      return model_type, entry.blocks, entry.reason
  return None
