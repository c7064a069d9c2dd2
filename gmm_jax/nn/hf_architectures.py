"""The transformers MoE architectures `from_transformers` and `to_transformers` know: one
`Architecture` per block (its options function, expert layout and tensor names) in
`ARCHITECTURES`, and the lookup of a model_type or block class.

The architectures, by the ``model_type`` of their config: mixtral, qwen2_moe, qwen3_moe,
qwen3_next, deepseek_v3, olmoe, gpt_oss, granitemoe, dbrx, glm4_moe, llama4
(``llama4_text``), switch_transformers; cohere2_moe, deepseek_v2, dots1, ernie4_5_moe,
ernie4_5_vl_moe (one modality's experts: ``ernie4_5_vl_moe_text``), exaone_moe,
granitemoehybrid and granitemoeshared (their decoder layer: the routed block and the shared
MLP beside it), hunyuan_v1_moe, jamba, jetmoe (its MLP experts), kimi_linear, lfm2_moe,
longcat_flash, minimax_m2, mistral4, phimoe, qwen3_omni_moe_text and
qwen3_omni_moe_talker_text (Qwen3-Omni's thinker and talker) and solar_open; the copies of
their blocks in transformers 5.25: deepseek_v32, flex_olmo, glm4_moe_lite, glm4v_moe,
glm_moe_dsa, granitemoe_swa, minimax, qwen3_5_moe, qwen3_vl_moe and qwen4_exp; and the blocks
of the same options: aria, beam, flint, hy_v3, lara_mini, mellum, mimo_v2_flash,
minicpm5_moe and mistral_large4. The MoE blocks it cannot express (Gemma 4, NLLB-MoE, Ernie
4.5 VL's modality-isolated block, JetMoE's attention experts and others), and why:
`gmm_jax.nn.hf_unsupported`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from gmm_jax.nn import hf_options
from gmm_jax.nn.hf_unsupported import unsupported


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
    zero_width_shared: with "shared" `optional`, a config without shared experts still
      builds the shared expert, zero wide (DeepSeek-V3's ``n_shared_experts=0``:
      ``moe_intermediate_size * 0``): its ``[0, D]`` / ``[D, 0]`` tensors are read (where
      a state dict has them) and written; otherwise the block has no such module.
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
  zero_width_shared: bool = False
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

# Blocks that keep a zero-width shared expert when the config gives none.
_ZERO_WIDTH_SHARED = dict(optional=("shared",), zero_width_shared=True)

# DeepSeek-V3's block and its copies: shared experts (zero wide when the config has none)
# and the router's correction bias.
_DEEPSEEK_V3 = dict(shared="shared_experts", routing_bias="gate.e_score_correction_bias",
                    **_ZERO_WIDTH_SHARED)

ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in [
    Architecture("mixtral", ("MixtralSparseMoeBlock",), hf_options.mixtral),
    Architecture("qwen2_moe", ("Qwen2MoeSparseMoeBlock",), hf_options.qwen_shared(False),
                 shared="shared_expert", shared_gate="shared_expert_gate.weight"),
    Architecture("qwen3_moe", ("Qwen3MoeSparseMoeBlock",), hf_options.qwen3_moe),
    Architecture("qwen3_next", ("Qwen3NextSparseMoeBlock",), hf_options.qwen_shared(True),
                 shared="shared_expert", shared_gate="shared_expert_gate.weight"),
    Architecture("qwen3_5_moe", ("Qwen3_5MoeSparseMoeBlock",), hf_options.qwen3_5_moe,
                 shared="shared_expert", shared_gate="shared_expert_gate.weight",
                 model_types=("qwen3_5_moe_text",)),
    Architecture("qwen3_vl_moe", ("Qwen3VLMoeTextSparseMoeBlock",), hf_options.qwen3_vl_moe,
                 model_types=("qwen3_vl_moe_text",)),
    Architecture("qwen4_exp", ("Qwen4ExpTextSparseMoeBlock",), hf_options.qwen4_exp,
                 shared="shared_expert", shared_gate="shared_expert_gate.weight",
                 model_types=("qwen4_exp_text",)),
    Architecture("deepseek_v3", ("DeepseekV3MoE",), hf_options.deepseek, **_DEEPSEEK_V3),
    Architecture("deepseek_v32", ("DeepseekV32MoE",), hf_options.deepseek, **_DEEPSEEK_V3),
    Architecture("flex_olmo", ("FlexOlmoSparseMoeBlock",), hf_options.olmoe),
    Architecture("olmoe", ("OlmoeSparseMoeBlock",), hf_options.olmoe),
    Architecture("gpt_oss", ("GptOssMLP",), hf_options.gpt_oss, experts="interleaved",
                 router="router.weight"),
    Architecture("granitemoe", ("GraniteMoeMoE",), hf_options.granitemoe, router="router.weight"),
    Architecture("granitemoe_swa", ("GraniteMoeSWAMoE",), hf_options.granitemoe,
                 router="router.weight"),
    Architecture("dbrx", ("DbrxFFN",), hf_options.dbrx, experts="dbrx",
                 router="router.layer.weight"),
    Architecture("glm4_moe", ("Glm4MoeMoE",), hf_options.deepseek, **_DEEPSEEK_V3),
    Architecture("glm4_moe_lite", ("Glm4MoeLiteMoE",), hf_options.deepseek, **_DEEPSEEK_V3),
    Architecture("glm4v_moe", ("Glm4vMoeTextMoE",), hf_options.glm4v_moe, **_DEEPSEEK_V3,
                 model_types=("glm4v_moe_text",)),
    Architecture("glm_moe_dsa", ("GlmMoeDsaMoE",), hf_options.deepseek, **_DEEPSEEK_V3),
    Architecture("aria", ("AriaTextMoELayer",), hf_options.aria, experts="fused_in_out",
                 router="router.weight", shared="shared_experts", model_types=("aria_text",)),
    Architecture("beam", ("BeamMoE",), hf_options.beam,
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("flint", ("FlintSparseMoeBlock",), hf_options.ungated_shared("sigmoid"),
                 shared="shared_expert"),
    Architecture("hy_v3", ("HYV3MoE",), hf_options.hy_v3, shared="shared_experts",
                 routing_bias="e_score_correction_bias", **_ZERO_WIDTH_SHARED),
    Architecture("lara_mini", ("LaraMiniSparseMoeBlock",), hf_options.ungated_shared("softmax"),
                 shared="shared_expert"),
    Architecture("llama4", ("Llama4TextMoe",), hf_options.llama4, experts="fused_in_out",
                 router="router.weight", shared="shared_expert",
                 model_types=("llama4_text",)),
    Architecture("mellum", ("MellumSparseMoeBlock",), hf_options.mellum),
    Architecture("mimo_v2_flash", ("MiMoV2FlashMoE",), hf_options.mimo_v2_flash,
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("minicpm5_moe", ("MiniCPM5MoeMoE",), hf_options.deepseek, **_DEEPSEEK_V3),
    Architecture("minimax", ("MiniMaxSparseMoeBlock",), hf_options.mixtral),
    Architecture("mistral_large4", ("MistralLarge4TextMoE",), hf_options.mistral_large4,
                 shared="shared_experts", **_ZERO_WIDTH_SHARED,
                 model_types=("mistral_large4_text",)),
    Architecture("cohere2_moe", ("Cohere2MoeSparseMoeBlock",), hf_options.cohere2_moe,
                 shared="shared_experts", optional=("shared",)),
    Architecture("deepseek_v2", ("DeepseekV2Moe",), hf_options.deepseek_v2,
                 shared="shared_experts"),
    Architecture("dots1", ("Dots1MoE",), hf_options.dots1, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("ernie4_5_moe", ("Ernie4_5_MoeSparseMoeBlock",), hf_options.ernie4_5_moe,
                 shared="shared_experts",
                 routing_bias="gate.moe_statics.e_score_correction_bias",
                 routing_bias_2d=True, optional=("shared",)),
    Architecture("ernie4_5_vl_moe", ("Ernie4_5_VLMoeSparseMoeBlock",), hf_options.ernie4_5_vl_moe,
                 routing_bias="gate.moe_statics.e_score_correction_bias",
                 routing_bias_2d=True, model_types=("ernie4_5_vl_moe_text",)),
    Architecture("exaone_moe", ("ExaoneMoeSparseMoEBlock",), hf_options.exaone_moe,
                 shared="shared_experts", routing_bias="gate.e_score_correction_bias"),
    Architecture("granitemoehybrid", ("GraniteMoeHybridDecoderLayer",),
                 hf_options.granite_shared_mlp, **_GRANITE_SHARED),
    Architecture("granitemoeshared", ("GraniteMoeSharedDecoderLayer",),
                 hf_options.granite_shared_mlp, **_GRANITE_SHARED),
    Architecture("hunyuan_v1_moe", ("HunYuanMoEV1Moe",), hf_options.hunyuan_v1_moe,
                 router="gate.wg.weight", shared="shared_mlp"),
    Architecture("jamba", ("JambaSparseMoeBlock",), hf_options.jamba, router="router.weight"),
    Architecture("jetmoe", ("JetMoeMoE",), hf_options.jetmoe, experts="input_output_linear",
                 router="router.layer.weight", output_bias="bias"),
    Architecture("kimi_linear", ("KimiLinearMoE",), hf_options.kimi_linear, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("lfm2_moe", ("Lfm2MoeSparseMoeBlock",), hf_options.lfm2_moe,
                 routing_bias="expert_bias", optional=("routing_bias",)),
    Architecture("longcat_flash", ("LongcatFlashMoE",), hf_options.longcat_flash,
                 router="router.classifier.weight",
                 routing_bias="router.e_score_correction_bias"),
    Architecture("minimax_m2", ("MiniMaxM2SparseMoeBlock",), hf_options.minimax_m2,
                 routing_bias="e_score_correction_bias"),
    Architecture("mistral4", ("Mistral4MoE",), hf_options.mistral4, shared="shared_experts"),
    Architecture("phimoe", ("PhimoeSparseMoeBlock",), hf_options.phimoe, router="router.weight"),
    Architecture("qwen3_omni_moe_talker_text", ("Qwen3OmniMoeTalkerTextSparseMoeBlock",),
                 hf_options.qwen_shared(False), shared="shared_expert",
                 shared_gate="shared_expert_gate.weight"),
    Architecture("qwen3_omni_moe_text", ("Qwen3OmniMoeThinkerTextSparseMoeBlock",),
                 hf_options.qwen3_omni_moe_thinker, model_types=("qwen3_omni_moe_thinker",)),
    Architecture("solar_open", ("SolarOpenMoE",), hf_options.deepseek, shared="shared_experts",
                 routing_bias="gate.e_score_correction_bias"),
    Architecture("switch_transformers", ("SwitchTransformersSparseMLP",), hf_options.switch,
                 experts="per_expert", router="router.classifier.weight"),
]}


def _find(name) -> Architecture | None:
  for arch in ARCHITECTURES.values():
    if name == arch.name or name in arch.model_types or name in arch.block_classes:
      return arch
  return None


def architecture_of(name, model_type=None) -> Architecture:
  """The entry of a model_type, block class or entry name (`model_type`: that of the block's
  config, where `name` is a block class); else NotImplementedError naming the model_type,
  the block class and what the layer lacks for it (`hf_unsupported.UNSUPPORTED`)."""
  if name in _PART_OF:
    raise ValueError(f"{name} is the routed half of its layer's FFN: the shared MLP "
                     f"(shared_mlp) is its sibling in the {_PART_OF[name]}, which adds them; "
                     f"pass the decoder layer (or its config and state dict)")
  arch = _find(name)
  if arch is not None:
    return arch
  # A block class not known here: its config's model_type, unless that one loads (a model
  # type whose other block is refused, e.g. JetMoE's attention experts).
  known = unsupported(name) or (model_type and _find(model_type) is None
                                and unsupported(model_type))
  supported = f"from_transformers supports {sorted(ARCHITECTURES)}"
  if known:
    model_type, classes, reason = known
    raise NotImplementedError(f"transformers {model_type} ({' / '.join(classes)}): "
                              f"{reason}. {supported}")
  what = f"{name!r}" + (f" (model_type {model_type!r})" if model_type else "")
  raise NotImplementedError(f"transformers architecture {what}: not a MoE block known "
                            f"here; {supported}")
