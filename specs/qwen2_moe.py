r"""Qwen2-MoE-style experts: per-expert ``gate_proj``/``up_proj``/``down_proj`` ↔ fused tensors.

Original layout (hub checkpoints)::

    model.layers.N.mlp.experts.{e}.gate_proj.weight   [I, H]
    model.layers.N.mlp.experts.{e}.up_proj.weight     [I, H]
    model.layers.N.mlp.experts.{e}.down_proj.weight   [H, I]

Runtime layout::

    model.layers.N.mlp.experts.gate_up_proj           [E, 2I, H]  (gate_up[e] = cat(gate_e, up_e))
    model.layers.N.mlp.experts.down_proj              [E, H, I]   (down[e] = down_e)

Router (``mlp.gate.weight``) and shared-expert keys are untouched. Many model types share the
layout exactly (``ALIASES``); a few add renames of their own on top of the two converters.

Adapted from the reference (runtime-layout checkpoints must pass through unchanged, and our
loader does not fall back to the original key when a rename produces an unknown one):

* ``laguna``: ``mlp.shared_expert\.`` ends in an escaped dot, so it no longer matches the runtime
  ``mlp.shared_experts.`` (an unescaped ``.`` matched its ``s``).
* ``axk1``: ``(?<!mlp\.)post_mlp_layernorm`` skips keys that already sit under ``mlp.``.
"""

from __future__ import annotations

from surgery import WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ADAPTED_PATTERNS", "ALIASES", "ENTRIES"]

_EXPERTS: list[WeightTransform] = [
    WeightConverter(
        [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
        "mlp.experts.gate_up_proj",
        [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
    ),
    WeightConverter(
        r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
    ),
]

_KOLIBRI1: list[WeightTransform] = [
    WeightRenaming(r"moe\.router\.expert_bias", "mlp.gate.e_score_correction_bias"),
    WeightRenaming("post_attn_norm", "post_self_attn_layernorm"),
    WeightRenaming("post_ffn_norm", "post_mlp_layernorm"),
    *_EXPERTS,
]

_SARVAM_MOE: list[WeightTransform] = [
    WeightRenaming(r"^model\.word_embeddings\.", "model.embed_tokens."),
    WeightRenaming(r"\.attention\.", ".self_attn."),
    WeightRenaming(r"\.self_attn\.dense\.", ".self_attn.o_proj."),
    WeightRenaming(r"\.self_attn\.query_layernorm\.", ".self_attn.q_norm."),
    WeightRenaming(r"\.self_attn\.key_layernorm\.", ".self_attn.k_norm."),
    WeightRenaming(r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias"),
    *_EXPERTS,
    # Grouped-query attention: the fused [q|k|v] rows are split by each target's size.
    WeightConverter(r"query_key_value", ["q_proj", "k_proj", "v_proj"], [ops.Split(dim=0)]),
]

ENTRIES: dict[str, list[WeightTransform]] = {
    "qwen2_moe": [*_EXPERTS],
    "ernie4_5_moe": [
        WeightRenaming(
            r"mlp\.moe_statics\.e_score_correction_bias", "mlp.gate.moe_statics.e_score_correction_bias"
        ),
        *_EXPERTS,
    ],
    "exaone_moe": [
        WeightRenaming(r"mlp\.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
        *_EXPERTS,
    ],
    "kolibri1": list(_KOLIBRI1),
    "kolibri1_1": list(_KOLIBRI1),
    "minicpm5_moe": [
        WeightRenaming(r"self_attn\.q_proj", "self_attn.q_gate_proj"),
        *_EXPERTS,
    ],
    "sarvam_moe": list(_SARVAM_MOE),
    "param2moe": list(_SARVAM_MOE),
    "mimo_v2_flash": [
        WeightRenaming(r"self_attn\.attention_sink_bias", "self_attn.sinks"),
        *_EXPERTS,
    ],
    "flint": [
        WeightRenaming(r"self_attn\.softmax_offset", "self_attn.sinks"),
        *_EXPERTS,
    ],
    "hy_v3": [
        WeightRenaming(r"mlp\.router\.gate\.weight", "mlp.gate.weight"),
        WeightRenaming(r"mlp\.expert_bias", "mlp.e_score_correction_bias"),
        WeightRenaming(r"mlp\.shared_mlp\.", "mlp.shared_experts."),
        *_EXPERTS,
    ],
    "laguna": [
        WeightRenaming(r"mlp\.experts\.e_score_correction_bias", "mlp.gate.e_score_correction_bias"),
        WeightRenaming(r"mlp\.shared_expert\.", "mlp.shared_experts."),
        *_EXPERTS,
    ],
    "axk1": [
        WeightRenaming(r"(?<!mlp\.)post_mlp_layernorm", "mlp.post_mlp_layernorm"),
        *_EXPERTS,
    ],
}
"""Registry key → transform list (unscoped prototypes; the registry hands out copies)."""

ALIASES: dict[str, str] = {
    # model_type keys
    "afmoe": "qwen2_moe",
    "beam": "qwen2_moe",
    "cohere2_moe": "qwen2_moe",
    "deepseek_v2": "qwen2_moe",
    "deepseek_v3": "qwen2_moe",
    "deepseek_v32": "qwen2_moe",
    "dots1": "qwen2_moe",
    "flex_olmo": "qwen2_moe",
    "glm4_moe": "qwen2_moe",
    "glm4_moe_lite": "qwen2_moe",
    "glm4v_moe": "qwen2_moe",
    "glm_moe_dsa": "qwen2_moe",
    "hunyuan_v1_moe": "qwen2_moe",
    "longcat_flash": "qwen2_moe",
    "mellum": "qwen2_moe",
    "olmoe": "qwen2_moe",
    "qwen3_moe": "qwen2_moe",
    "qwen3_next": "qwen2_moe",
    "qwen3_omni_moe": "qwen2_moe",
    "qwen3_omni_moe_text": "qwen2_moe",
    "qwen3_omni_moe_thinker": "qwen2_moe",
    "sarvam_mla": "qwen2_moe",
    "solar_open": "qwen2_moe",
    # class-name keys
    "Dots3NoteTextModel": "qwen2_moe",
    "UnlimitedOcrTextModel": "qwen2_moe",
}
"""Registry key → the key whose mapping it shares."""


ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    "laguna": {"mlp.shared_expert.": r"mlp.shared_expert\."},
    "axk1": {"post_mlp_layernorm": r"(?<!mlp\.)post_mlp_layernorm"},
}
"""Key -> {transformers' source pattern: ours}, where ours deliberately differs (see the module docstring)."""
