r"""Vision-language (and omni) models: towers, projectors and the language model moved under ``model.``.

The common shape (as in :mod:`specs.llava`): hub checkpoints keep ``language_model``,
``vision_tower``/``visual``, the projector and the audio tower at the top level, or under a
family prefix (``llm.``, ``vit.``, ``sam_model.``, ``mlp1.``); the runtime layout of
``*ForConditionalGeneration`` holds them under ``model.`` with ``lm_head`` at the top. Per family
the towers also rename their blocks into the modular names, fused ``qkv``/``in_proj`` weights are
chunked into q/k/v (Kimi-K2.5, Step3.5 vision, Unlimited-OCR; q and k permuted from interleaved
RoPE pairs where the tower uses it, with ``PermuteForRope(config_attribute="vision_config.num_attention_heads", slots=(0, 1))``),
and MoE experts merge as in the decoder families. Notable:

* ``qwen3_vl_moe``: hub files hold the fused experts as ``[E, H, 2I]`` under the runtime name;
  ``Transpose(1, 2, when_shape_differs=True)`` transposes only a tensor whose shape differs from
  the parameter's (a runtime-layout file passes through; square experts are refused).
* ``kimi_k25``: ``norm0``/``norm1`` → ``norm1``/``norm2`` (and ``fc0``/``fc1``) as one paired
  renaming, so ``norm1`` is renamed once.
* ``Dots3Note*``, ``Molmo2*``, ``Emu3*``, ``UnlimitedOcr*``: class entries for the base model
  and the towers besides the model-type entry.
* ``pi0``: the whole checkpoint sits under ``model.``; the PaliGemma and Gemma-expert halves move
  to ``model.vlm``/``model.dit``.
* ``colqwen2``, ``shieldgemma2``, ``hyperclovax_vision_v2``: a prefix moved between the wrapper
  and the VLM inside it.

**Adapted** (``ADAPTED_PATTERNS``): ``inkling_mm_model``'s shared-expert targets say they start
a name (saving reversed ``up_proj`` into a pattern that also matched the experts'
``gate_up_proj``); ``deepseek_ocr2``/``unlimited_ocr`` and ``pi0`` renames skip
names already in the runtime layout.
"""

from __future__ import annotations

from surgery import PrefixChange, WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ADAPTED_PATTERNS", "ALIASES", "ENTRIES", "EXTENDED"]

ENTRIES: dict[str, list[WeightTransform]] = {
    "cosmos3_edge": [
        WeightRenaming(r"^embed_tokens\.", "model.language_model.embed_tokens."),
        WeightRenaming(r"^norm\.", "model.language_model.norm."),
        WeightRenaming(r"^layers\.", "model.language_model.layers."),
        WeightRenaming(r"\.self_attn\.to_q\.", ".self_attn.q_proj."),
        WeightRenaming(r"\.self_attn\.to_k\.", ".self_attn.k_proj."),
        WeightRenaming(r"\.self_attn\.to_v\.", ".self_attn.v_proj."),
        WeightRenaming(r"\.self_attn\.to_out\.", ".self_attn.o_proj."),
        WeightRenaming(r"\.mlp\.up_proj\.", ".mlp.fc1."),
        WeightRenaming(r"\.mlp\.down_proj\.", ".mlp.fc2."),
    ],
    "cosmos3_omni": [
        WeightRenaming(r"^(layers\.|embed_tokens\.|norm\.)", r"model.language_model.\1"),
        WeightRenaming(
            r"^(blocks\.|merger\.|patch_embed\.|pos_embed\.|deepstack_merger_list\.)", r"model.visual.\1"
        ),
        WeightRenaming(r"\.self_attn\.to_q\.", ".self_attn.q_proj."),
        WeightRenaming(r"\.self_attn\.to_k\.", ".self_attn.k_proj."),
        WeightRenaming(r"\.self_attn\.to_v\.", ".self_attn.v_proj."),
        WeightRenaming(r"\.self_attn\.to_out\.", ".self_attn.o_proj."),
        WeightRenaming(r"\.self_attn\.norm_q\.", ".self_attn.q_norm."),
        WeightRenaming(r"\.self_attn\.norm_k\.", ".self_attn.k_norm."),
    ],
    "inkling_mm_model": [
        WeightRenaming(r"model\.llm\.layers", "model.language_model.layers"),
        WeightRenaming(
            r"model\.llm\.embed_norm\.weight", "model.language_model.embed_tokens.embed_norm.weight"
        ),
        WeightRenaming(r"model\.llm\.embed\.weight", "model.language_model.embed_tokens.weight"),
        WeightRenaming(r"model\.llm\.norm\.weight", "model.language_model.norm.weight"),
        WeightRenaming(r"model\.llm\.unembed\.weight", "lm_head.weight"),
        WeightRenaming(r"model\.audio\.", "model.audio_tower."),
        WeightRenaming(r"model\.visual", "model.vision_tower"),
        WeightRenaming(r"vision_tower\.layers\.linear_(\d+)", r"vision_tower.encoder_layers.\1.projection"),
        WeightRenaming(r"vision_tower\.layers\.norm_(\d+)", r"vision_tower.encoder_layers.\1.layer_norm"),
        WeightRenaming(
            r"audio_tower\.encoder\.weight", "audio_tower.embed_audio_tokens.embed_audio_tokens.weight"
        ),
        WeightRenaming(r"audio_tower\.final_norm\.weight", "audio_tower.norm.weight"),
        WeightConverter(
            "shared_w13_weight",
            [r"(?<!_)gate_proj", r"(?<!_)up_proj"],
            [ops.Interleave(dim=1), ops.Chunk(dim=1)],
        ),
        WeightRenaming("shared_w2_weight", "down_proj"),
        WeightConverter(r"mlp\.experts\.w13_weight", "mlp.experts.gate_up_proj", [ops.Interleave(dim=1)]),
        WeightRenaming(r"mlp\.experts\.w2_weight", "mlp.experts.down_proj"),
        WeightConverter(
            r"mlp\.w13_dn\.weight",
            ["mlp.gate_proj.weight", "mlp.up_proj.weight"],
            [ops.Interleave(dim=0), ops.Chunk(dim=0)],
        ),
        WeightRenaming(r"mlp\.w2_md\.weight", "mlp.down_proj.weight"),
        WeightRenaming(r"mlp\.gate\.bias", "mlp.gate.e_score_correction_bias"),
        WeightRenaming(r"attn\.wq_du", "self_attn.q_proj"),
        WeightRenaming(r"attn\.wk_dv", "self_attn.k_proj"),
        WeightRenaming(r"attn\.wv_dv", "self_attn.v_proj"),
        WeightRenaming(r"attn\.wr_du", "self_attn.r_proj"),
        WeightRenaming(r"attn\.wo_ud", "self_attn.o_proj"),
        WeightRenaming(r"\.attn\.q_norm", ".self_attn.q_norm"),
        WeightRenaming(r"\.attn\.k_norm", ".self_attn.k_norm"),
        WeightRenaming(r"\.attn\.k_sconv", ".self_attn.k_sconv.conv1d"),
        WeightRenaming(r"\.attn\.v_sconv", ".self_attn.v_sconv.conv1d"),
        WeightRenaming(r"\.attn\.rel_logits_proj", ".self_attn.rel_logits_proj"),
        WeightRenaming(r"attn_sconv\.weight", "attn_sconv.conv1d.weight"),
        WeightRenaming(r"mlp_sconv\.weight", "mlp_sconv.conv1d.weight"),
        WeightRenaming("mlp_norm", "post_attention_layernorm"),
        WeightRenaming("attn_norm", "input_layernorm"),
    ],
    "gemma4_unified": [
        WeightRenaming(r"vision_embedder\.patch_ln1", "embed_vision.patch_ln1"),
        WeightRenaming(r"vision_embedder\.patch_dense", "embed_vision.patch_dense"),
        WeightRenaming(r"vision_embedder\.patch_ln2", "embed_vision.patch_ln2"),
        WeightRenaming(r"vision_embedder\.pos_embedding", "embed_vision.pos_embedding"),
        WeightRenaming(r"vision_embedder\.pos_norm", "embed_vision.pos_norm"),
        WeightRenaming(
            r"embed_vision\.embedding_projection", "embed_vision.multimodal_embedder.embedding_projection"
        ),
    ],
    "NemotronH_Omni_Reasoning_V3": [
        WeightRenaming(r"^mlp1\.0\.", "multi_modal_projector.layer_norm."),
        WeightRenaming(r"^mlp1\.1\.", "multi_modal_projector.linear_1."),
        WeightRenaming(r"^mlp1\.3\.", "multi_modal_projector.linear_2."),
        WeightRenaming(r"^vision_projector\.vision_final_layernorm\.", "vision_final_layernorm."),
        WeightRenaming(r"^sound_encoder\.encoder\.", "audio_tower."),
        WeightRenaming(r"^sound_projection\.norm\.", "embed_audio.layer_norm."),
        WeightRenaming(r"^sound_projection\.linear1\.", "embed_audio.linear_1."),
        WeightRenaming(r"^sound_projection\.linear2\.", "embed_audio.linear_2."),
    ],
    "hunyuan_vl": [
        WeightRenaming(r"mlp\.dense_h_to_4h", "mlp.fc1"),
        WeightRenaming(r"mlp\.dense_4h_to_h", "mlp.fc2"),
        WeightRenaming(r"^vit\.layers\.(\d+)\.input_layernorm\.", r"vit.layers.\1.layer_norm1."),
        WeightRenaming(r"^vit\.layers\.(\d+)\.post_attention_layernorm\.", r"vit.layers.\1.layer_norm2."),
        WeightRenaming(r"perceive\.proj\.0\.", "perceive.proj_conv."),
        WeightRenaming(r"perceive\.proj\.2\.", "perceive.proj_out."),
        WeightRenaming(r"perceive\.", "patch_merger."),
        WeightRenaming(r"^model(?!\.(language_model|vit|vision_tower))", "model.language_model"),
        WeightRenaming(r"^model\.vit", "model.vision_tower"),
        WeightRenaming("^vit", "model.vision_tower"),
    ],
    "kimi_k25": [
        WeightRenaming(r"language_model\.model", "model.language_model"),
        WeightRenaming(r"language_model\.lm_head", "lm_head"),
        WeightRenaming(
            [r"vision_tower\.encoder\.blocks\.(\d+)\.norm0", r"vision_tower\.encoder\.blocks\.(\d+)\.norm1"],
            [r"vision_tower.encoder.blocks.\1.norm1", r"vision_tower.encoder.blocks.\1.norm2"],
        ),
        WeightRenaming(
            [
                r"vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc0",
                r"vision_tower\.encoder\.blocks\.(\d+)\.mlp\.fc1",
            ],
            [r"vision_tower.encoder.blocks.\1.mlp.fc1", r"vision_tower.encoder.blocks.\1.mlp.fc2"],
        ),
        WeightRenaming(
            r"vision_tower\.encoder\.blocks\.(\d+)\.wo", r"vision_tower.encoder.blocks.\1.attn.proj"
        ),
        WeightRenaming(r"vision_tower\.encoder", "model.vision_tower"),
        WeightRenaming(r"mm_projector\.proj\.0", "model.mm_projector.in_proj"),
        WeightRenaming(r"mm_projector\.proj\.2", "model.mm_projector.out_proj"),
        WeightRenaming("blocks", "layers"),
        WeightRenaming(
            r"vision_tower\.patch_embed\.pos_emb\.weight",
            "model.vision_tower.patch_embed.pos_emb.position_embeddings",
        ),
        WeightConverter(
            "wqkv",
            ["attn.q_proj", "attn.k_proj", "attn.v_proj"],
            [
                ops.Chunk(dim=0),
                ops.PermuteForRope(config_attribute="vision_config.num_attention_heads", slots=(0, 1)),
            ],
        ),
        WeightConverter(
            [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
    ],
    "minimax_m3_vl": [
        WeightRenaming(r"^language_model\.lm_head", "lm_head"),
        WeightRenaming(r"^language_model\.model\.", "model.language_model."),
        WeightRenaming(
            r"^vision_tower\.vision_model\.embeddings\.patch_embedding\.",
            "model.vision_tower.embeddings.proj.",
        ),
        WeightRenaming(r"^vision_tower\.vision_model\.encoder\.layers\.", "model.vision_tower.layers."),
        WeightRenaming(r"^vision_tower\.vision_model\.pre_layrnorm\.", "model.vision_tower.pre_layrnorm."),
        WeightRenaming(r"^multi_modal_projector\.linear_1\.", "model.multi_modal_projector.linear_1."),
        WeightRenaming(r"^multi_modal_projector\.linear_2\.", "model.multi_modal_projector.linear_2."),
        WeightRenaming(r"^patch_merge_mlp\.linear_1\.", "model.multi_modal_projector.merge_linear_1."),
        WeightRenaming(r"^patch_merge_mlp\.linear_2\.", "model.multi_modal_projector.merge_linear_2."),
        WeightRenaming(r"\.block_sparse_moe\.(experts|gate|shared_experts)\.", r".mlp.\1."),
        WeightRenaming(r"\.block_sparse_moe\.e_score_correction_bias", ".mlp.gate.e_score_correction_bias"),
        WeightRenaming(r"\.self_attn\.index_q_proj\.", ".self_attn.indexer.q_proj."),
        WeightRenaming(r"\.self_attn\.index_k_proj\.", ".self_attn.indexer.k_proj."),
        WeightRenaming(r"\.self_attn\.index_q_norm\.", ".self_attn.indexer.q_norm."),
        WeightRenaming(r"\.self_attn\.index_k_norm\.", ".self_attn.indexer.k_norm."),
        WeightConverter(
            [r"\.experts\.*\.w1\.weight", r"\.experts\.*\.w3\.weight"],
            ".experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)]),
        WeightConverter(
            [r"\.gate_proj\.weight", r"\.up_proj\.weight"], ".gate_up_proj.weight", [ops.Concatenate(dim=0)]
        ),
    ],
    "molmo2": [
        WeightRenaming(r"(?<!image_vit\.)transformer\.(?!ln_f\.|blocks\.)", "language_model."),
        WeightRenaming(r"(?<!image_vit\.)transformer\.ln_f\.", "language_model.norm."),
        WeightRenaming(r"(?<!image_vit\.)transformer\.blocks\.", "language_model.layers."),
        WeightRenaming(r"vision_backbone\.image_vit\.(?!transformer\.resblocks\.)", "vision_tower."),
        WeightRenaming(r"vision_backbone\.image_vit\.transformer\.resblocks\.", "vision_tower.layers."),
        WeightRenaming(r"vision_backbone\.image_pooling_2d\.", "multi_modal_projector.image_pooling_2d."),
        WeightRenaming(r"vision_backbone\.image_projector\.", "multi_modal_projector.image_projector."),
        WeightRenaming(r"\.attention\.wq", ".self_attn.q_proj"),
        WeightRenaming(r"\.attention\.wk", ".self_attn.k_proj"),
        WeightRenaming(r"\.attention\.wv", ".self_attn.v_proj"),
        WeightRenaming(r"\.attention\.wo", ".self_attn.o_proj"),
        WeightRenaming(r"\.feed_forward\.w1", ".mlp.fc1"),
        WeightRenaming(r"\.feed_forward\.w2", ".mlp.fc2"),
        WeightRenaming(r"\.attention_norm", ".layer_norm1"),
        WeightRenaming(r"\.ffn_norm", ".layer_norm2"),
        WeightRenaming(r"image_pooling_2d\.wq", "image_pooling_2d.q_proj"),
        WeightRenaming(r"image_pooling_2d\.wk", "image_pooling_2d.k_proj"),
        WeightRenaming(r"image_pooling_2d\.wv", "image_pooling_2d.v_proj"),
        WeightRenaming(r"image_pooling_2d\.wo", "image_pooling_2d.o_proj"),
        WeightRenaming(r"image_projector\.w1", "image_projector.gate_proj"),
        WeightRenaming(r"image_projector\.w2", "image_projector.down_proj"),
        WeightRenaming(r"image_projector\.w3", "image_projector.up_proj"),
    ],
    "Molmo2TextModel": [
        WeightRenaming(r"\.attn_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.ff_norm\.", ".post_attention_layernorm."),
        WeightConverter(
            r"self_attn\.att_proj",
            ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            [ops.Split(dim=0)],
        ),
        WeightRenaming(r"self_attn\.attn_out", "self_attn.o_proj"),
        WeightRenaming(r"mlp\.ff_out", "mlp.down_proj"),
        WeightConverter(
            r"mlp\.ff_proj\.weight", ["mlp.up_proj.weight", "mlp.gate_proj.weight"], [ops.Chunk(dim=0)]
        ),
        WeightConverter(
            [r"wte\.embedding", r"wte\.new_embedding"], "embed_tokens.weight", [ops.Concatenate(dim=0)]
        ),
    ],
    "Emu3Model": [
        WeightRenaming(r"^text_model\.model", "text_model"),
    ],
    "emu3": [
        WeightRenaming(r"^text_model\.lm_head", "lm_head"),
        WeightRenaming("^text_model", "model.text_model"),
        WeightRenaming("^vqmodel", "model.vqmodel"),
    ],
    "paddleocr_vl": [
        WeightRenaming("^mlp_AR", "model.projector"),
        WeightRenaming("^visual", "model.visual"),
        WeightRenaming(r"^model(?!(\.visual|\.projector|\.language_model))", "model.language_model"),
    ],
    "deepseek_ocr2": [
        WeightRenaming(
            r"sam_model\.blocks\.(\d+)\.norm1\.", r"vision_tower.sam_encoder.layers.\1.layer_norm1."
        ),
        WeightRenaming(
            r"sam_model\.blocks\.(\d+)\.norm2\.", r"vision_tower.sam_encoder.layers.\1.layer_norm2."
        ),
        WeightRenaming(r"sam_model\.blocks\.(\d+)\.attn\.", r"vision_tower.sam_encoder.layers.\1.attn."),
        WeightRenaming(r"sam_model\.blocks\.(\d+)\.mlp\.", r"vision_tower.sam_encoder.layers.\1.mlp."),
        WeightRenaming(r"sam_model\.patch_embed\.proj\.", "vision_tower.sam_encoder.patch_embed.projection."),
        WeightRenaming(r"sam_model\.pos_embed", "vision_tower.sam_encoder.pos_embed"),
        WeightRenaming(r"sam_model\.neck\.0\.", "vision_tower.sam_encoder.neck.conv1."),
        WeightRenaming(r"sam_model\.neck\.1\.", "vision_tower.sam_encoder.neck.layer_norm1."),
        WeightRenaming(r"sam_model\.neck\.2\.", "vision_tower.sam_encoder.neck.conv2."),
        WeightRenaming(r"sam_model\.neck\.3\.", "vision_tower.sam_encoder.neck.layer_norm2."),
        WeightRenaming(r"sam_model\.net_2\.", "vision_tower.sam_encoder.proj.conv1."),
        WeightRenaming(r"sam_model\.net_3\.", "vision_tower.sam_encoder.proj.conv2."),
        WeightRenaming(r"qwen2_model\.model\.model\.layers\.", "vision_tower.vision_encoder.layers."),
        WeightRenaming(r"qwen2_model\.model\.model\.norm\.", "vision_tower.vision_encoder.norm."),
        WeightRenaming(r"qwen2_model\.query_768\.", "vision_tower.query_768_resolution."),
        WeightRenaming(r"qwen2_model\.query_1024\.", "vision_tower.query_1024_resolution."),
        WeightRenaming(r"projector\.layers\.", "multi_modal_projector."),
        WeightRenaming("view_seperator", "view_separator"),
        WeightRenaming(r"(^|(?<!_)model\.)embed_tokens\.", r"\1language_model.embed_tokens."),
        WeightRenaming(r"(^|(?<!_)model\.)layers\.", r"\1language_model.layers."),
        WeightRenaming(r"(^|(?<!_)model\.)norm\.", r"\1language_model.norm."),
        WeightConverter(
            [r"mlp\.experts\.*\.gate_proj\.weight", r"mlp\.experts\.*\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"mlp\.experts\.*\.down_proj\.weight", "mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
    ],
    "step3p7": [
        WeightRenaming(r"^vision_model\.", "model.vision_model."),
        WeightRenaming(r"^vit_large_projector\.", "model.multi_modal_projector."),
        WeightRenaming(r"^model\.embed_tokens\.", "model.language_model.embed_tokens."),
        WeightRenaming(r"^model\.layers\.", "model.language_model.layers."),
        WeightRenaming(r"^model\.norm\.", "model.language_model.norm."),
        WeightRenaming(r"\.moe\.gate\.weight", ".mlp.gate.weight"),
        WeightRenaming(r"\.moe\.router_bias", ".mlp.gate.e_score_correction_bias"),
        WeightRenaming(r"\.moe\.down_proj\.weight", ".mlp.experts.down_proj"),
        WeightRenaming(r"\.moe\.down_proj\.weight_scale_inv", ".mlp.experts.down_proj_scale_inv"),
        WeightRenaming(r"\.share_expert\.", ".mlp.shared_experts."),
        WeightConverter(
            [r"moe\.gate_proj\.weight", r"moe\.up_proj\.weight"],
            "mlp.experts.gate_up_proj",
            [ops.Concatenate(dim=1)],
        ),
    ],
    "step3p5_vision": [
        WeightRenaming(r"^conv1\.weight", "embeddings.patch_embedding.weight"),
        WeightRenaming("^positional_embedding", "embeddings.position_embedding.weight"),
        WeightRenaming(r"^transformer\.resblocks\.", "layers."),
        WeightRenaming(r"^ln_pre\.", "pre_layernorm."),
        WeightRenaming(r"^vit_downsampler1\.", "downsampler1."),
        WeightRenaming(r"^vit_downsampler2\.", "downsampler2."),
        WeightRenaming(r"\.ls_1\.gamma", ".lambda_1"),
        WeightRenaming(r"\.ls_2\.gamma", ".lambda_2"),
        WeightRenaming(r"\.mlp\.c_fc\.", ".mlp.fc1."),
        WeightRenaming(r"\.mlp\.c_proj\.", ".mlp.fc2."),
        WeightRenaming(r"\.attn\.", ".self_attn."),
        WeightRenaming(r"\.ln_1\.", ".layernorm_before."),
        WeightRenaming(r"\.ln_2\.", ".layernorm_after."),
        WeightConverter(
            r"attn\.in_proj_weight",
            ["attn.q_proj.weight", "attn.k_proj.weight", "attn.v_proj.weight"],
            [
                ops.Chunk(dim=0),
                ops.PermuteForRope(config_attribute="vision_config.num_attention_heads", slots=(0, 1)),
            ],
        ),
        WeightConverter(
            r"attn\.in_proj_bias",
            ["attn.q_proj.bias", "attn.k_proj.bias", "attn.v_proj.bias"],
            [
                ops.Chunk(dim=0),
                ops.PermuteForRope(config_attribute="vision_config.num_attention_heads", slots=(0, 1)),
            ],
        ),
    ],
    "colqwen2": [
        PrefixChange(prefix_to_remove="model", model_prefix="vlm"),
    ],
    "shieldgemma2": [
        PrefixChange(prefix_to_add="model", model_prefix="model"),
    ],
    "pi0": [
        PrefixChange(prefix_to_remove="model"),
        WeightRenaming(r"(?<!embed_action_time\.)state_proj", "embed_action_time.state_proj"),
        WeightRenaming(r"(?<!embed_action_time\.)action_in_proj", "embed_action_time.action_in_proj"),
        WeightRenaming(r"(?<!embed_action_time\.)action_time_mlp_in", "embed_action_time.action_time_mlp_in"),
        WeightRenaming(
            r"(?<!embed_action_time\.)action_time_mlp_out", "embed_action_time.action_time_mlp_out"
        ),
        WeightRenaming(r"^time_mlp_(in|out)", r"embed_action_time.time_mlp_\1"),
        WeightRenaming(r"^paligemma_with_expert\.paligemma\.model", "model.vlm"),
        WeightRenaming(r"^paligemma_with_expert\.gemma_expert\.model", "model.dit"),
        WeightRenaming(r"^paligemma_with_expert\.gemma_expert\.lm_head", "model.dit.embed_tokens"),
        WeightRenaming(
            r"^paligemma_with_expert\.paligemma\.lm_head", "model.vlm.language_model.embed_tokens"
        ),
    ],
    "dots3_note_audio_encoder": [
        WeightRenaming(r"^audio_adapter\.", "adapter."),
        WeightRenaming(r"^adapter\.proj\.0\.", "adapter.norm."),
        WeightRenaming(r"^adapter\.proj\.1\.", "adapter.fc1."),
        WeightRenaming(r"^adapter\.proj\.3\.", "adapter.fc2."),
        WeightRenaming(r"dots_encoder\.speech_encoder\.", "speech_encoder."),
        WeightRenaming(r"speech_encoder\.(conv2d[123]|conv_out)\.", r"speech_encoder.conv_stem.\1."),
        WeightRenaming(r"conv_stem\.conv2d1\.", "conv_stem.convs.0."),
        WeightRenaming(r"conv_stem\.conv2d2\.", "conv_stem.convs.1."),
        WeightRenaming(r"conv_stem\.conv2d3\.", "conv_stem.convs.2."),
        WeightRenaming(r"(speech_encoder\.layers\.\d+\.self_attn)\.out_proj\.", r"\1.o_proj."),
        WeightRenaming(r"\.self_attn_layer_norm\.", ".input_layernorm."),
        WeightRenaming(r"\.final_layer_norm\.", ".post_attention_layernorm."),
        WeightRenaming(r"(speech_encoder\.layers\.\d+)\.fc1\.", r"\1.mlp.gate_up_proj."),
        WeightRenaming(r"(speech_encoder\.layers\.\d+)\.fc2\.", r"\1.mlp.down_proj."),
        WeightRenaming(r"^speech_encoder\.(conv_stem|layers|layer_norm)\.", r"\1."),
    ],
    "dots3_note_vision_encoder": [
        WeightRenaming(r"^post_trunk_norm\.", "norm."),
        WeightRenaming(r"^adapter\.", "merger."),
        WeightRenaming(r"(blocks\.\d+)\.norm_1\.", r"\1.norm1."),
        WeightRenaming(r"(blocks\.\d+)\.norm_2\.", r"\1.norm2."),
        WeightRenaming(r"(blocks\.\d+\.mlp)\.fc1\.", r"\1.gate_proj."),
        WeightRenaming(r"(blocks\.\d+\.mlp)\.fc2\.", r"\1.down_proj."),
        WeightRenaming(r"(blocks\.\d+\.mlp)\.fc3\.", r"\1.up_proj."),
        WeightRenaming(r"\.mlp\.gate_weight", ".mlp.gate.weight"),
        WeightRenaming(r"\.mlp\.router_bias", ".mlp.e_score_correction_bias"),
        WeightConverter(
            [r"\.mlp\.experts\.*\.fc1\.weight", r"\.mlp\.experts\.*\.fc3\.weight"],
            ".mlp.experts.gate_up_proj",
            [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            r"\.mlp\.experts\.*\.fc2\.weight", ".mlp.experts.down_proj", [ops.MergeModulelist(dim=0)]
        ),
    ],
    "Dots3NoteForConditionalGeneration": [
        WeightRenaming(r"^audio_encoder\.audio_adapter\.", "audio_adapter."),
        WeightRenaming(r"^(vision_encoder|audio_encoder|audio_adapter)\.", r"model.\1."),
    ],
    "Dots3NoteModel": [
        PrefixChange(prefix_to_remove="model"),
        WeightRenaming(r"^(embed_tokens|layers|norm)\.", r"language_model.\1."),
        WeightRenaming(r"^vision_encoder\.", "vision_tower."),
        WeightRenaming(r"^audio_encoder\.", "audio_tower."),
        WeightRenaming(r"^audio_adapter\.", "audio_tower.audio_adapter."),
    ],
    "qwen3_vl_moe": [
        WeightConverter(
            r"mlp\.experts\.gate_up_proj",
            "mlp.experts.gate_up_proj",
            [ops.Transpose(dim0=1, dim1=2, when_shape_differs=True)],
        ),
        WeightConverter(
            r"mlp\.experts\.down_proj",
            "mlp.experts.down_proj",
            [ops.Transpose(dim0=1, dim1=2, when_shape_differs=True)],
        ),
    ],
    "lfm3_vl_vision": [
        WeightRenaming("patchifier", "patch_embed"),
        WeightRenaming("q_layernorm", "q_norm"),
        WeightRenaming("k_layernorm", "k_norm"),
    ],
    "hyperclovax_vision_v2": [
        WeightRenaming(r"^model\.language_model\.lm_head", "lm_head"),
        WeightRenaming(r"^model\.vision_projector", "model.projector"),
        PrefixChange(prefix_to_remove="model", model_prefix="model.language_model"),
    ],
    "qianfan_ocr": [
        WeightRenaming(r"^vision_model\.", "model.vision_tower."),
        WeightRenaming(r"encoder\.layers\.", "layers."),
        WeightRenaming(r"\.ls1", ".lambda_1"),
        WeightRenaming(r"\.ls2", ".lambda_2"),
        WeightRenaming(r"(layers\.\d+)\.attn\.proj\.", r"\1.attention.projection_layer."),
        WeightRenaming(r"\.norm1\.", ".layernorm_before."),
        WeightRenaming(r"\.norm2\.", ".layernorm_after."),
        WeightRenaming(r"\.embeddings\.class_embedding", ".embeddings.cls_token"),
        WeightRenaming(r"\.embeddings\.position_embedding", ".embeddings.position_embeddings"),
        WeightRenaming(r"\.embeddings\.patch_embedding\.", ".embeddings.patch_embeddings.projection."),
        WeightRenaming(r"^language_model\.model\.", "model.language_model."),
        WeightRenaming(r"^language_model\.lm_head\.", "lm_head."),
        WeightRenaming(r"^mlp1\.0\.", "model.multi_modal_projector.layer_norm."),
        WeightRenaming(r"^mlp1\.1\.", "model.multi_modal_projector.linear_1."),
        WeightRenaming(r"^mlp1\.3\.", "model.multi_modal_projector.linear_2."),
        WeightConverter(
            r"attn\.qkv\.weight",
            ["attention.q_proj.weight", "attention.k_proj.weight", "attention.v_proj.weight"],
            [ops.Chunk(dim=0)],
        ),
        WeightConverter(
            r"attn\.qkv\.bias",
            ["attention.q_proj.bias", "attention.k_proj.bias", "attention.v_proj.bias"],
            [ops.Chunk(dim=0)],
        ),
    ],
    "unlimited_ocr": [
        WeightRenaming(r"(^|model\.)sam_model", r"\1vision_tower.sam_encoder"),
        WeightRenaming(r"(^|model\.)vision_model", r"\1vision_tower.vision_encoder"),
        WeightRenaming(r"(^|model\.)view_seperator", r"\1view_separator"),
        WeightRenaming(r"(^|model\.)projector\.layers\.weight", r"\1multi_modal_projector.weight"),
        WeightRenaming(r"(^|model\.)projector\.layers\.bias", r"\1multi_modal_projector.bias"),
        WeightRenaming(r"(^|(?<!_)model\.)embed_tokens\.", r"\1language_model.embed_tokens."),
        WeightRenaming(r"(^|(?<!_)model\.)layers\.", r"\1language_model.layers."),
        WeightRenaming(r"(^|(?<!_)model\.)norm\.", r"\1language_model.norm."),
    ],
    "UnlimitedOcrSamVisionEncoder": [
        WeightRenaming(r"blocks\.(\d+)\.norm1\.", r"layers.\1.layer_norm1."),
        WeightRenaming(r"blocks\.(\d+)\.norm2\.", r"layers.\1.layer_norm2."),
        WeightRenaming(r"blocks\.(\d+)\.attn\.", r"layers.\1.attn."),
        WeightRenaming(r"blocks\.(\d+)\.mlp\.", r"layers.\1.mlp."),
        WeightRenaming(r"patch_embed\.proj\.", "patch_embed.projection."),
        WeightRenaming(r"neck\.0\.", "neck.conv1."),
        WeightRenaming(r"neck\.1\.", "neck.layer_norm1."),
        WeightRenaming(r"neck\.2\.", "neck.conv2."),
        WeightRenaming(r"neck\.3\.", "neck.layer_norm2."),
        WeightRenaming(r"net_2\.", "proj.conv1."),
        WeightRenaming(r"net_3\.", "proj.conv2."),
    ],
    "UnlimitedOcrVisionEncoder": [
        WeightRenaming("transformer", "encoder"),
        WeightConverter(
            r"qkv_proj\.weight", ["q_proj.weight", "k_proj.weight", "v_proj.weight"], [ops.Chunk(dim=0)]
        ),
        WeightConverter(r"qkv_proj\.bias", ["q_proj.bias", "k_proj.bias", "v_proj.bias"], [ops.Chunk(dim=0)]),
    ],
    "mistral_large4": [
        WeightRenaming(r"^vision_encoder\.", "model.vision_tower."),
        WeightRenaming(r"^tok_embeddings\.", "model.language_model.embed_tokens."),
        WeightRenaming(r"^lerope\.alpha", "model.language_model.rotary_emb.alpha"),
        WeightRenaming(r"^layers\.", "model.language_model.layers."),
        WeightRenaming(r"^norm\.", "model.language_model.norm."),
        WeightRenaming(r"^output\.", "lm_head."),
        WeightRenaming(r"^pre_mm_projector_norm\.", "model.multi_modal_projector.norm."),
        WeightRenaming(r"^patch_merger\.", "model.multi_modal_projector.patch_merger."),
        WeightRenaming(r"^vision_language_adapter\.w_in\.", "model.multi_modal_projector.linear_1."),
        WeightRenaming(r"^vision_language_adapter\.w_out\.", "model.multi_modal_projector.linear_2."),
        WeightRenaming(r"\.wv\.", ".v_proj."),
        WeightRenaming(r"\.wo\.", ".o_proj."),
        WeightRenaming(r"\.(feed_forward|shared_experts)\.w1\.", r".\1.gate_proj."),
        WeightRenaming(r"\.(feed_forward|shared_experts)\.w2\.", r".\1.down_proj."),
        WeightRenaming(r"\.(feed_forward|shared_experts)\.w3\.", r".\1.up_proj."),
        WeightConverter(
            r"attention\.wq\.",
            "attention.q_proj.",
            [ops.PermuteForRope(config_attribute="vision_config.num_attention_heads")],
        ),
        WeightConverter(
            r"attention\.wk\.",
            "attention.k_proj.",
            [ops.PermuteForRope(config_attribute="vision_config.num_attention_heads")],
        ),
    ],
    "hy_v4_vl": [
        # vision tower: Megatron-style MLP and norm names, as in hunyuan_vl
        WeightRenaming(r"mlp\.dense_h_to_4h", "mlp.fc1"),
        WeightRenaming(r"mlp\.dense_4h_to_h", "mlp.fc2"),
        WeightRenaming(r"^vit\.layers\.(\d+)\.input_layernorm\.", r"vit.layers.\1.layer_norm1."),
        WeightRenaming(r"^vit\.layers\.(\d+)\.post_attention_layernorm\.", r"vit.layers.\1.layer_norm2."),
        # projector
        WeightRenaming(r"(perceive|patch_merger)\.norm\.", r"\1.before_rms."),
        WeightRenaming(r"perceive\.proj\.0\.", "perceive.proj_conv."),
        WeightRenaming(r"perceive\.proj\.2\.", "perceive.proj_out."),
        WeightRenaming(r"perceive\.", "patch_merger."),
        # text under model.language_model, the tower under model.vision_tower
        WeightRenaming(r"^model(?!\.(language_model|vit|vision_tower))", "model.language_model"),
        WeightRenaming("^vit", "model.vision_tower"),
    ],
    "LlavaOnevision15Model": [
        WeightRenaming(r"^model\.(?!language_model\.|visual\.)", "language_model."),
    ],
    "llava_onevision1_5_vision": [
        PrefixChange(prefix_to_remove="visual"),
        WeightRenaming("^class_embedding", "cls_embeddings.class_embedding"),
        WeightRenaming("^class_pos_emb", "cls_embeddings.class_pos_emb"),
        WeightRenaming(r"merger\.fc1\.", "merger.linear_fc1."),
        WeightRenaming(r"merger\.fc2\.", "merger.linear_fc2."),
        WeightRenaming(r"merger\.mlp\.0\.", "merger.linear_fc1."),
        WeightRenaming(r"merger\.mlp\.2\.", "merger.linear_fc2."),
        WeightRenaming(r"merger\.ln_q\.", "merger.norm."),
    ],
    "ovis2_5": [
        WeightRenaming(r"^llm\.model\.", "model.language_model."),
        WeightRenaming(r"^llm\.lm_head\.", "lm_head."),
        WeightRenaming(
            r"^visual_tokenizer\.vit\.vision_model\.embeddings\.", "model.vision_tower.embeddings."
        ),
        WeightRenaming(
            r"^visual_tokenizer\.vit\.vision_model\.encoder\.layers\.", "model.vision_tower.layers."
        ),
        WeightRenaming(
            r"^visual_tokenizer\.vit\.vision_model\.post_layernorm\.", "model.vision_tower.post_layernorm."
        ),
        WeightRenaming(
            r"^visual_tokenizer\.head\.0\.", "model.multi_modal_projector.visual_tokenizer.linear."
        ),
        WeightRenaming(r"^visual_tokenizer\.head\.1\.", "model.multi_modal_projector.visual_tokenizer.norm."),
        WeightRenaming(r"^vte\.", "model.vte."),
        WeightConverter(
            r"vte\.weight", "multi_modal_projector.visual_embeddings_table.weight", [ops.Transpose()]
        ),
    ],
}

ALIASES: dict[str, str] = {
    "pi05": "pi0",
}

_OCR_LANGUAGE_MODEL = {  # deepseek_ocr2, unlimited_ocr
    rf"(^|model\.){name}\.": rf"(^|(?<!_)model\.){name}\." for name in ("embed_tokens", "layers", "norm")
}

ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    # The patterns below also match runtime keys, where transformers falls back to the original
    # key and surgery never does; each skips the names it has already renamed.
    # ``model.`` must not be the end of ``language_model.``.
    "deepseek_ocr2": _OCR_LANGUAGE_MODEL,
    "unlimited_ocr": _OCR_LANGUAGE_MODEL,
    # The targets contain the sources.
    "pi0": {
        name: rf"(?<!embed_action_time\.){name}"
        for name in ("state_proj", "action_in_proj", "action_time_mlp_in", "action_time_mlp_out")
    },
    # Saving reverses ``up_proj`` into a source pattern, which also matched the experts' fused
    # ``gate_up_proj``: the targets say they start a name.
    "inkling_mm_model": {"gate_proj": r"(?<!_)gate_proj", "up_proj": r"(?<!_)up_proj"},
}
"""Key -> {transformers' source or target pattern: ours}, where ours deliberately differs."""

EXTENDED: dict[str, str] = {
    "NemotronH_Omni_Reasoning_V3": "5.24.0",  # + the vision projector's final layer norm
    "pi0": "5.24.0",  # + pi05's ``time_mlp_{in,out}``
}
"""Key -> the release whose (longer) list ``ENTRIES`` holds; it loads the earlier layouts too."""
