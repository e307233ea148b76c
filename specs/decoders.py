r"""Text decoders: hybrid (linear attention, Mamba), MoE and multi-token-prediction families.

Most entries are renamings of a family's module names onto transformers' modular decoder
(``attn`` → ``self_attn``, ``ffn``/``feed_forward`` → ``mlp``, norms to
``input_layernorm``/``post_attention_layernorm``) plus the expert merges of
:mod:`specs.mixtral` (``w1``/``w3``/``w2``: ``phimoe``, ``kimi_linear``, ``lfm2_moe``,
``deepseek_v4``) and :mod:`specs.qwen2_moe` (``gate_proj``/``up_proj``/``down_proj``: ``axk2``,
``jamba``, ``glm5_next``, ``bailing_hybrid``, ``qwen3_5_moe_text``, ``qwen4_exp_text``). Others:

* ``granitemoe`` (+ shared, hybrid) and ``aria_text``: the experts are already fused and only
  renamed (``input_linear`` → ``gate_up_proj``, ``fc1`` → ``gate_up_proj``).
* ``nemotron_h``: ``backbone.`` → ``model.``; up/down experts stacked (no gate).
* ``hrm_text``: fused ``gate_up_proj`` and ``gqkv_proj`` chunked; ``olmo_hybrid``,
  ``kimi_linear``, ``bailing_hybrid``: q/k/v short convolutions concatenated into one ``conv1d``.
* ``qwen3_5_text`` / ``qwen3_5_moe_text``: the text model of a VL checkpoint drops
  ``language_model``. ``GPTNeoXForCausalLM``: ``embed_out`` → ``lm_head``.
* ``MtpModel``: multi-token-prediction heads (a remote-code class).

**Adapted** (``ADAPTED_PATTERNS``): ``deepseek_v4``'s unanchored ``.norm.`` skips the final
``model.norm``; ``mistral_large4_text`` renames skip names already in the
runtime layout. **Left out** (``OMITTED``): ``qwen4_exp_text``'s concatenation of
``ngram_embedding.shard_*``, whose wildcard is not a whole key component.
"""

from __future__ import annotations

from surgery import PrefixChange, WeightConverter, WeightRenaming, ops
from surgery.transforms import LayerPairCollapse, WeightTransform

__all__ = ["ADAPTED_PATTERNS", "ALIASES", "ENTRIES", "EXTENDED", "OMITTED"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "hy_v4": [
        WeightRenaming(r"\.hc_pre\.hc_", ".hc_"),
        WeightRenaming(r"\.learnable_sink_param", ".sinks"),
        WeightRenaming(r"\.linear_gate", ".gate_proj"),
        WeightRenaming(r"\.hc_attn_layer\.hc_fn", ".attn_hc.fn"),
        WeightRenaming(r"\.hc_attn_layer\.hc_base", ".attn_hc.base"),
        WeightRenaming(r"\.hc_attn_layer\.hc_scale", ".attn_hc.scale"),
        WeightRenaming(r"\.hc_mlp_layer\.hc_fn", ".ffn_hc.fn"),
        WeightRenaming(r"\.hc_mlp_layer\.hc_base", ".ffn_hc.base"),
        WeightRenaming(r"\.hc_mlp_layer\.hc_scale", ".ffn_hc.scale"),
        WeightRenaming(r"\.hc_head_fn", ".hc_fn"),
        WeightRenaming(r"\.hc_head_base", ".hc_base"),
        WeightRenaming(r"\.hc_head_scale", ".hc_scale"),
    ],
    "GPTNeoXForCausalLM": [
        WeightRenaming(r"^embed_out\.", "lm_head."),
    ],
    "axk2": [
        WeightConverter(
            [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
        WeightRenaming("W_down", "mlp.fc1"),
        WeightRenaming("W_up", "mlp.fc2"),
        WeightRenaming(r"self_attn\.q_b_proj\.", "self_attn.q_gate_proj."),
    ],
    "hrm_text": [
        WeightConverter(
            r"mlp\.gate_up_proj\.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [ops.Chunk(dim=0)]
        ),
        WeightConverter(
            r"attn\.gqkv_proj\.weight",
            [
                "self_attn.gate_proj.weight",
                "self_attn.q_proj.weight",
                "self_attn.k_proj.weight",
                "self_attn.v_proj.weight",
            ],
            [ops.Chunk(dim=0)],
        ),
        WeightRenaming(r"\.attn\.o_proj\.", ".self_attn.o_proj."),
    ],
    "deepseek_v4": [
        WeightRenaming(r"\.attn\.", ".self_attn."),
        WeightRenaming(r"\.ffn\.", ".mlp."),
        WeightRenaming(r"\.indexer\.compressor\.", ".compressor.indexer."),
        WeightRenaming(r"^embed\.weight", "embed_tokens.weight"),
        WeightRenaming(r"^head\.weight", "lm_head.weight"),
        WeightRenaming("^hc_head_fn", "hc_head.hc_fn"),
        WeightRenaming("^hc_head_base", "hc_head.hc_base"),
        WeightRenaming("^hc_head_scale", "hc_head.hc_scale"),
        WeightRenaming(r"\.attn_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.ffn_norm\.", ".post_attention_layernorm."),
        WeightRenaming(r"\.hc_attn_fn", ".attn_hc.fn"),
        WeightRenaming(r"\.hc_attn_base", ".attn_hc.base"),
        WeightRenaming(r"\.hc_attn_scale", ".attn_hc.scale"),
        WeightRenaming(r"\.hc_ffn_fn", ".ffn_hc.fn"),
        WeightRenaming(r"\.hc_ffn_base", ".ffn_hc.base"),
        WeightRenaming(r"\.hc_ffn_scale", ".ffn_hc.scale"),
        WeightRenaming(r"\.attn_sink", ".sinks"),
        WeightRenaming(r"\.indexer\.weights_proj\.", ".compressor.indexer.scorer.weights_proj."),
        WeightRenaming(r"\.indexer\.wq_b\.", ".compressor.indexer.q_b_proj."),
        WeightRenaming(r"(?<!^model)\.norm\.", ".kv_norm."),
        WeightRenaming(r"\.ape", ".position_bias"),
        WeightRenaming(r"\.wq_a\.", ".q_a_proj."),
        WeightRenaming(r"\.self_attn\.wq_b\.", ".self_attn.q_b_proj."),
        WeightRenaming(r"\.wkv\.", ".kv_proj."),
        WeightRenaming(r"\.wgate\.", ".gate_proj."),
        WeightRenaming(r"\.wo_a\.", ".o_a_proj."),
        WeightRenaming(r"\.wo_b\.", ".o_b_proj."),
        WeightRenaming(r"\.q_norm\.", ".q_a_norm."),
        WeightRenaming(r"\.gate\.bias", ".gate.e_score_correction_bias"),
        WeightRenaming(r"\.shared_experts\.w1\.", ".shared_experts.gate_proj."),
        WeightRenaming(r"\.shared_experts\.w2\.", ".shared_experts.down_proj."),
        WeightRenaming(r"\.shared_experts\.w3\.", ".shared_experts.up_proj."),
        WeightConverter(
            [r"\.experts\.*\.w1\.weight", r"\.experts\.*\.w3\.weight"],
            ".experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)]),
    ],
    "glm5_next": [
        WeightRenaming(r"self_attn\.f_a_proj\.", "self_attn.forget_gate.f_a_proj."),
        WeightRenaming(r"self_attn\.f_b_proj\.", "self_attn.forget_gate.f_b_proj."),
        WeightRenaming(r"self_attn\.dt_bias", "self_attn.forget_gate.dt_bias"),
        WeightRenaming(r"self_attn\.A_log", "self_attn.forget_gate.A_log"),
        WeightRenaming("hc_attn_fn", "attn_hc.fn"),
        WeightRenaming("hc_attn_base", "attn_hc.base"),
        WeightRenaming("hc_attn_scale", "attn_hc.scale"),
        WeightRenaming("hc_ffn_fn", "ffn_hc.fn"),
        WeightRenaming("hc_ffn_base", "ffn_hc.base"),
        WeightRenaming("hc_ffn_scale", "ffn_hc.scale"),
        WeightConverter(
            [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
        WeightConverter(
            [r"self_attn\.q_conv1d\.weight", r"self_attn\.k_conv1d\.weight", r"self_attn\.v_conv1d\.weight"],
            "self_attn.conv1d.weight",
            [ops.Concatenate(dim=0)],
        ),
    ],
    "aria_text": [
        WeightRenaming(r"mlp\.experts\.fc1\.weight", "mlp.experts.gate_up_proj"),
        WeightRenaming(r"mlp\.experts\.fc2\.weight", "mlp.experts.down_proj"),
    ],
    "granitemoe": [
        WeightRenaming(r"block_sparse_moe\.input_linear\.weight", "block_sparse_moe.experts.gate_up_proj"),
        WeightRenaming(r"block_sparse_moe\.output_linear\.weight", "block_sparse_moe.experts.down_proj"),
        WeightRenaming(r"block_sparse_moe\.router\.layer\.weight", "block_sparse_moe.router.weight"),
    ],
    "olmo_hybrid": [
        WeightRenaming("attention_layer_norm", "input_layernorm"),
        WeightRenaming("feedforward_layer_norm", "post_attention_layernorm"),
        WeightConverter(
            [
                r"linear_attn\.q_conv1d\.weight",
                r"linear_attn\.k_conv1d\.weight",
                r"linear_attn\.v_conv1d\.weight",
            ],
            "linear_attn.conv1d.weight",
            [ops.Concatenate(dim=0)],
        ),
    ],
    "qwen3_5_text": [
        PrefixChange(prefix_to_remove="language_model", model_prefix="model"),
    ],
    # The MoE text model is the dense one plus the Qwen2-MoE expert merge (transformers also lists
    # it as an alias of qwen3_5_text, but its own entry wins).
    "qwen3_5_moe_text": [
        PrefixChange(prefix_to_remove="language_model", model_prefix="model"),
        WeightConverter(
            [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
    ],
    "phimoe": [
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
        WeightRenaming(r"\.gate\.weight", ".router.weight"),
        WeightConverter(
            [r"\.experts\.*\.w1\.weight", r"\.experts\.*\.w3\.weight"],
            ".experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)]),
    ],
    "lfm3": [
        WeightRenaming(r"\.self_attn\.gate_proj\.", ".self_attn.g_proj."),
    ],
    "lfm2_moe": [
        WeightConverter(
            [r"feed_forward\.experts\.*\.w1\.weight", r"feed_forward\.experts\.*\.w3\.weight"],
            "feed_forward.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"feed_forward\.experts\.*\.w2\.weight",
            "feed_forward.experts.down_proj",
            [ops.MergeModulelist(dim=0)],
        ),
    ],
    "nemotron_h": [
        WeightRenaming(r"backbone\.", "model."),
        WeightConverter(
            r"mixer\.experts\.*\.up_proj\.weight", "mixer.experts.up_proj", [ops.MergeModulelist(dim=0)]
        ),
        WeightConverter(
            r"mixer\.experts\.*\.down_proj\.weight", "mixer.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
    ],
    "jamba": [
        WeightConverter(
            [r"feed_forward\.experts\.*\.gate_proj\.weight", r"feed_forward\.experts\.*\.up_proj\.weight"],
            "feed_forward.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"feed_forward\.experts\.*\.down_proj\.weight",
            "feed_forward.experts.down_proj",
            [ops.MergeModulelist(dim=0)],
        ),
    ],
    "bailing_hybrid": [
        WeightConverter(
            [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
        WeightRenaming(r"^model\.word_embeddings\.", "model.embed_tokens."),
        WeightRenaming(r"\.attention\.", ".self_attn."),
        WeightRenaming(r"self_attn\.f_proj\.", "self_attn.forget_gate.f_proj."),
        WeightRenaming(r"self_attn\.dt_bias", "self_attn.forget_gate.dt_bias"),
        WeightRenaming(r"self_attn\.A_log", "self_attn.forget_gate.A_log"),
        WeightConverter(
            [r"q_conv1d\.weight", r"k_conv1d\.weight", r"v_conv1d\.weight"],
            "conv1d.weight",
            [ops.Concatenate(dim=0)],
        ),
        WeightRenaming(r"\.self_attn\.dense\.", ".self_attn.o_proj."),
        WeightRenaming(r"\.mlp\.gate\.expert_bias", ".mlp.gate.e_score_correction_bias"),
    ],
    "qwen4_exp_text": [
        PrefixChange(prefix_to_remove="language_model", model_prefix="model"),
        WeightConverter(
            [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
        # Not carried over: transformers also concatenates ``ngram_embedding.shard_*.weight`` into
        # ``ngram_embedding.weight``; surgery's index wildcard is a whole dotted component
        # (``shard_*`` is not one), so sharded n-gram embeddings are reported unexpected.
    ],
    "MtpModel": [
        PrefixChange(prefix_to_remove="model"),
        PrefixChange(prefix_to_remove="mtp"),
        WeightRenaming(r"\.shared_head\.norm\.", ".post_norm."),
        WeightRenaming(r"\.mtp_block\.enorm\.", ".enorm."),
        WeightRenaming(r"\.mtp_block\.hnorm\.", ".hnorm."),
        WeightRenaming(r"\.mtp_block\.eh_proj\.", ".eh_proj."),
        WeightRenaming(r"\.mtp_block\.post_norm\.", ".post_norm."),
        WeightRenaming(r"\.hidden_norm\.", ".hnorm."),
        WeightRenaming(r"\.embed_norm\.", ".enorm."),
        WeightRenaming(r"\.input_proj\.", ".eh_proj."),
        WeightRenaming(r"^chain_norm\.", "shared_post_norm."),
        WeightRenaming(r"layers\.(\d+)\.transformer_block\.", r"layers.\1.mtp_block."),
        WeightRenaming(r"^mtp_block\.(\d+)\.", r"layers.\1.mtp_block."),
        WeightRenaming(r"^mtp_emb_norm\.(\d+)\.", r"layers.\1.enorm."),
        WeightRenaming(r"^mtp_hidden_norm\.(\d+)\.", r"layers.\1.hnorm."),
        WeightRenaming(r"^mtp_linear_proj\.(\d+)\.", r"layers.\1.eh_proj."),
        WeightRenaming(
            r"^layers\.(\d+)\.(?!(?:mtp_block|enorm|hnorm|eh_proj|post_norm)\.)", r"layers.\1.mtp_block."
        ),
        WeightRenaming(r"^fc\.", "layers.0.eh_proj."),
        WeightRenaming(r"^pre_fc_norm_embedding\.", "layers.0.enorm."),
        WeightRenaming(r"^pre_fc_norm_hidden\.", "layers.0.hnorm."),
        WeightRenaming(r"^norm\.", "layers.0.post_norm."),
    ],
    "kimi_linear": [
        WeightRenaming(r"self_attn\.f_a_proj\.", "self_attn.forget_gate.f_a_proj."),
        WeightRenaming(r"self_attn\.f_b_proj\.", "self_attn.forget_gate.f_b_proj."),
        WeightRenaming(r"self_attn\.dt_bias", "self_attn.forget_gate.dt_bias"),
        WeightRenaming(r"self_attn\.A_log", "self_attn.forget_gate.A_log"),
        WeightConverter(
            [r"self_attn\.q_conv1d\.weight", r"self_attn\.k_conv1d\.weight", r"self_attn\.v_conv1d\.weight"],
            "self_attn.conv1d.weight",
            [ops.Concatenate(dim=0)],
        ),
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
        WeightConverter(
            [r"\.experts\.*\.w1\.weight", r"\.experts\.*\.w3\.weight"],
            ".experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)]),
    ],
    "mistral_large4_text": [
        WeightRenaming(r"\.attention\.", ".self_attn."),
        WeightRenaming(r"\.wq\.", ".q_proj."),
        WeightRenaming(r"\.wkv_a_with_mqa\.", ".kv_a_proj_with_mqa."),
        WeightRenaming(r"\.wkv_b\.", ".kv_b_proj."),
        WeightRenaming(r"\.attention_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.ffn_norm\.", ".post_attention_layernorm."),
        WeightRenaming(r"\.kv_a_norm\.", ".kv_a_layernorm."),
        WeightRenaming(r"\.feed_forward\.", ".mlp."),
        WeightRenaming(r"(?<!\.mlp)\.gate\.", ".mlp.gate."),
        WeightRenaming(r"(?<!\.mlp)\.experts\.", ".mlp.experts."),
        WeightRenaming(r"(?<!\.mlp)\.shared_experts\.", ".mlp.shared_experts."),
        WeightRenaming(r"\.ssmax_scaling\.s", ".softmax_scaling.scale"),
        WeightRenaming(r"\.ssmax_scaling\.b", ".softmax_scaling.bias"),
        WeightConverter(
            [r"\.experts\.*\.w1\.weight", r"\.experts\.*\.w3\.weight"],
            ".experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)]),
    ],
    "dory": [
        LayerPairCollapse(),
        WeightRenaming(r"\.self_attn\.g_proj\.", ".self_attn.gate_proj."),
        WeightRenaming(r"^backbone\.", "model."),
        WeightRenaming(r"\.embeddings\.", ".embed_tokens."),
    ],
    "ergo": [
        WeightRenaming(r"^tok_embeddings\.", "model.embed_tokens."),
        WeightRenaming(r"^norm\.", "model.norm."),
        WeightRenaming(r"^output\.", "lm_head."),
        WeightRenaming(r"^layers\.", "model.layers."),
        WeightRenaming(r"\.attention_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.post_attention_norm\.", ".post_attention_layernorm."),
        WeightRenaming(r"\.ffn_norm\.", ".pre_feedforward_layernorm."),
        WeightRenaming(r"\.post_ffn_norm\.", ".post_feedforward_layernorm."),
        WeightRenaming(r"\.post_attention_residual\.scale", ".attention_residual_gate.weight"),
        WeightRenaming(r"\.post_ffn_residual\.scale", ".feedforward_residual_gate.weight"),
        WeightRenaming(r"\.attention\.wqkv\.", ".self_attn.qkv_proj."),
        WeightRenaming(r"\.attention\.wo\.", ".self_attn.o_proj."),
        WeightRenaming(r"\.attention\.q_norm\.", ".self_attn.q_norm."),
        WeightRenaming(r"\.attention\.k_norm\.", ".self_attn.k_norm."),
        WeightRenaming(r"\.feed_forward\.up\.", ".mlp.up_proj."),
        WeightRenaming(r"\.feed_forward\.down\.", ".mlp.down_proj."),
        WeightRenaming(r"\.feed_forward\.router_bias", ".mlp.gate.e_score_correction_bias"),
        WeightRenaming(r"\.feed_forward\.up_proj", ".mlp.experts.up_proj"),
        WeightRenaming(r"\.feed_forward\.down_proj", ".mlp.experts.down_proj"),
        WeightRenaming(r"\.feed_forward\.expert_output_norm\.scale", ".mlp.experts.post_expert_norm.weight"),
        WeightRenaming(
            r"\.feed_forward\.shared_expert_output_norm\.scale", ".mlp.shared_experts.norm.weight"
        ),
        # Stored as (hidden, experts) and (in, out): transposed into nn.Linear's (out, in).
        WeightConverter(
            r"feed_forward\.gate_kernel", "mlp.gate.linear.weight", [ops.Transpose(dim0=0, dim1=1)]
        ),
        WeightConverter(
            r"feed_forward\.shared_up_proj",
            "mlp.shared_experts.up_proj.weight",
            [ops.Transpose(dim0=0, dim1=1)],
        ),
        WeightConverter(
            r"feed_forward\.shared_down_proj",
            "mlp.shared_experts.down_proj.weight",
            [ops.Transpose(dim0=0, dim1=1)],
        ),
    ],
    "exaone": [
        WeightRenaming(r"^transformer\.wte\.", "model.embed_tokens."),
        WeightRenaming(r"^transformer\.h\.", "model.layers."),
        WeightRenaming(r"^transformer\.ln_f\.", "model.norm."),
        WeightRenaming(r"\.attn\.attention\.", ".self_attn."),
        WeightRenaming(r"\.self_attn\.out_proj\.", ".self_attn.o_proj."),
        WeightRenaming(r"\.ln_1\.", ".input_layernorm."),
        WeightRenaming(r"\.ln_2\.", ".post_attention_layernorm."),
        WeightRenaming(r"\.mlp\.c_fc_0\.", ".mlp.gate_proj."),
        WeightRenaming(r"\.mlp\.c_fc_1\.", ".mlp.up_proj."),
        WeightRenaming(r"\.mlp\.c_proj\.", ".mlp.down_proj."),
    ],
    "lara_mini": [
        WeightRenaming(r"linear_attn\.out_norm\.", "linear_attn.norm."),
        # One fused input projection, rows [q|k|v|z|b|a]: split by each target's size.
        WeightConverter(
            r"linear_attn\.in_proj",
            [
                "linear_attn.in_proj_qkv",
                "linear_attn.in_proj_z",
                "linear_attn.in_proj_b",
                "linear_attn.in_proj_a",
            ],
            [ops.Split(dim=0)],
        ),
    ],
    "apertus1p5_text": [
        PrefixChange(prefix_to_remove="language_model", model_prefix="model"),
    ],
}

ALIASES: dict[str, str] = {
    "hy_v4_vl_text": "hy_v4",
    "glm5_next_text": "glm5_next",
    "granitemoeshared": "granitemoe",
    "granitemoehybrid": "granitemoe",
    "gemma3n_text": "qwen3_5_text",
}


ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    # transformers' LayerPairCollapse matches any ``layers.N`` and decides in code; ours names the
    # block names it renames, so the pattern says which keys it claims.
    "dory": {
        r"layers\.(\d+)": r"layers\.(\d+)\.(mixer|attn_alpha|mlp_alpha)(?=\.|$)",
        r"layers.\1": r"layers.\1.\2",
    },
    # transformers' unanchored ``.norm.`` also renames the final ``model.norm``; it then falls
    # back to the original key, which surgery's loader never does.
    "deepseek_v4": {r"\.norm\.": r"(?<!^model)\.norm\."},
    # The targets contain the sources, so these fire again on runtime keys (transformers then
    # falls back to the original key, surgery never does): they skip names already renamed.
    "mistral_large4_text": {
        r"\.gate\.": r"(?<!\.mlp)\.gate\.",
        r"\.experts\.": r"(?<!\.mlp)\.experts\.",
        r"\.shared_experts\.": r"(?<!\.mlp)\.shared_experts\.",
    },
}
"""Key -> {transformers' source pattern: ours}, where ours deliberately differs."""

OMITTED: dict[str, list[str]] = {
    "qwen4_exp_text": [r"ngram_embedding.shard_*.weight"],
}
"""Key -> source patterns of transformers' list left out here (the entry's comment says why)."""

EXTENDED: dict[str, str] = {
    "MtpModel": "5.24.0",  # + Ernie 4.5 MoE's ``mtp_{part}.{k}`` layout
}
"""Key -> the release whose (longer) list ``ENTRIES`` holds; it loads the earlier layouts too."""
