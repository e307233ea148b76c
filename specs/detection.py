r"""Object detection: RT-DETR (+ v2, PP-DocLayout v2-v4), D-FINE, Deformable/Conditional DETR, LW-DETR, RF-DETR, YOLOS.

The DETR descendants share the renames of :mod:`specs.detr`: attention ``out_proj`` →
``o_proj``, decoder-layer ``fc1``/``fc2`` → ``mlp.fc1``/``mlp.fc2`` (D-FINE:
``mlp.layers.0/1``), the backbone wrapper ``backbone.conv_encoder`` → ``backbone``, and for
RT-DETR/D-FINE the AIFI encoder layers ``encoder.encoder.N.layers`` → ``encoder.aifi.N.layers``.
``ConditionalDetrModel`` also renames its decoder's content/position projections into
``self_attn``/``encoder_attn`` sub-modules. PP-DocLayout v4 renames its reading-order heads.
RF-DETR's hub files hold the detector at the top level (``backbone.0.encoder.encoder`` →
``backbone.backbone``, the projector's C2f stages renamed); ``RfDetrForObjectDetection`` moves
everything under ``model.``, except what already sits there or stays at the top (the
``bbox_embed``/``class_embed`` heads; **adapted** so a runtime-layout file passes through).
LW-DETR: ``attention.attention.query`` → ``attention.q_proj`` etc.; YOLOS:
``encoder.mid_position_embeddings`` → ``encoder.interpolation.mid_position_embeddings``.
"""

from __future__ import annotations

from surgery import WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ADAPTED_PATTERNS", "ALIASES", "ENTRIES"]

# RF-DETR segmentation: every top-level module but the head (renamed below) and those already in place.
_RF_DETR_SEGMENTATION_PREFIX = (
    r"^(?!segmentation_head|model\.|blocks\.|query_features_|segmentation_bias|spatial_features_proj)"
)

ENTRIES: dict[str, list[WeightTransform]] = {
    "rt_detr": [
        WeightRenaming("out_proj", "o_proj"),
        WeightRenaming(r"layers\.(\d+)\.fc1", r"layers.\1.mlp.fc1"),
        WeightRenaming(r"layers\.(\d+)\.fc2", r"layers.\1.mlp.fc2"),
        WeightRenaming(r"encoder\.encoder\.(\d+)\.layers", r"encoder.aifi.\1.layers"),
    ],
    "pp_doclayout_v4": [
        WeightRenaming(r"decoder_roor_order_head\.", "decoder.successor_order_head.proj."),
        WeightRenaming(r"decoder_roor_global_pointer\.", "decoder.successor_order_head.global_pointer."),
        WeightRenaming(r"decoder_order_head\.", "decoder.relative_order_head.proj."),
        WeightRenaming(r"decoder_global_pointer\.", "decoder.relative_order_head.global_pointer."),
        WeightRenaming(r"s2r_fusion\.a", "decoder.relative_order_head.s2r_fusion.closure_weight"),
        WeightRenaming("out_proj", "o_proj"),
        WeightRenaming(r"layers\.(\d+)\.fc1", r"layers.\1.mlp.fc1"),
        WeightRenaming(r"layers\.(\d+)\.fc2", r"layers.\1.mlp.fc2"),
        WeightRenaming(r"encoder\.encoder\.(\d+)\.layers", r"encoder.aifi.\1.layers"),
    ],
    "d_fine": [
        WeightRenaming("out_proj", "o_proj"),
        WeightRenaming(r"layers\.(\d+)\.fc1", r"layers.\1.mlp.layers.0"),
        WeightRenaming(r"layers\.(\d+)\.fc2", r"layers.\1.mlp.layers.1"),
        WeightRenaming(r"encoder\.encoder\.(\d+)\.layers", r"encoder.aifi.\1.layers"),
    ],
    "deformable_detr": [
        WeightRenaming(r"backbone\.conv_encoder", "backbone"),
        WeightRenaming(r"self_attn\.out_proj", "self_attn.o_proj"),
        WeightRenaming(r"layers\.(\d+)\.fc1", r"layers.\1.mlp.fc1"),
        WeightRenaming(r"layers\.(\d+)\.fc2", r"layers.\1.mlp.fc2"),
    ],
    "ConditionalDetrModel": [
        WeightRenaming(r"backbone\.conv_encoder", "backbone"),
        WeightRenaming(r"self_attn\.out_proj", "self_attn.o_proj"),
        WeightRenaming(r"encoder_attn\.out_proj", "encoder_attn.o_proj"),
        WeightRenaming(r"layers\.(\d+)\.fc1", r"layers.\1.mlp.fc1"),
        WeightRenaming(r"layers\.(\d+)\.fc2", r"layers.\1.mlp.fc2"),
        WeightRenaming(
            r"decoder\.layers\.(\d+)\.sa_qcontent_proj", r"decoder.layers.\1.self_attn.q_content_proj"
        ),
        WeightRenaming(r"decoder\.layers\.(\d+)\.sa_qpos_proj", r"decoder.layers.\1.self_attn.q_pos_proj"),
        WeightRenaming(
            r"decoder\.layers\.(\d+)\.sa_kcontent_proj", r"decoder.layers.\1.self_attn.k_content_proj"
        ),
        WeightRenaming(r"decoder\.layers\.(\d+)\.sa_kpos_proj", r"decoder.layers.\1.self_attn.k_pos_proj"),
        WeightRenaming(r"decoder\.layers\.(\d+)\.sa_v_proj", r"decoder.layers.\1.self_attn.v_proj"),
        WeightRenaming(
            r"decoder\.layers\.(\d+)\.ca_qcontent_proj", r"decoder.layers.\1.encoder_attn.q_content_proj"
        ),
        WeightRenaming(r"decoder\.layers\.(\d+)\.ca_qpos_proj", r"decoder.layers.\1.encoder_attn.q_pos_proj"),
        WeightRenaming(
            r"decoder\.layers\.(\d+)\.ca_kcontent_proj", r"decoder.layers.\1.encoder_attn.k_content_proj"
        ),
        WeightRenaming(r"decoder\.layers\.(\d+)\.ca_kpos_proj", r"decoder.layers.\1.encoder_attn.k_pos_proj"),
        WeightRenaming(r"decoder\.layers\.(\d+)\.ca_v_proj", r"decoder.layers.\1.encoder_attn.v_proj"),
        WeightRenaming(
            r"decoder\.layers\.(\d+)\.ca_qpos_sine_proj", r"decoder.layers.\1.encoder_attn.q_pos_sine_proj"
        ),
    ],
    "lw_detr": [
        WeightRenaming(r"attention\.attention\.query", "attention.q_proj"),
        WeightRenaming(r"attention\.attention\.key", "attention.k_proj"),
        WeightRenaming(r"attention\.attention\.value", "attention.v_proj"),
        WeightRenaming(r"attention\.output", "attention.o_proj"),
    ],
    "RfDetrModel": [
        WeightRenaming(r"backbone\.0\.encoder\.encoder", "backbone.backbone"),
        WeightRenaming(r"backbone\.0\.projector", "backbone.projector"),
        WeightRenaming(r"projector\.stages\.0\.0\.cv1\.conv", "projector.projector_layer.conv1.conv"),
        WeightRenaming(r"projector\.stages\.0\.0\.cv1\.bn", "projector.projector_layer.conv1.norm"),
        WeightRenaming(r"projector\.stages\.0\.0\.cv2\.conv", "projector.projector_layer.conv2.conv"),
        WeightRenaming(r"projector\.stages\.0\.0\.cv2\.bn", "projector.projector_layer.conv2.norm"),
        WeightRenaming(r"projector\.stages\.0\.1", "projector.layer_norm"),
        WeightRenaming(
            r"projector\.stages\.0\.0\.m\.(\d+)\.cv1\.conv",
            r"projector.projector_layer.bottlenecks.\1.conv1.conv",
        ),
        WeightRenaming(
            r"projector\.stages\.0\.0\.m\.(\d+)\.cv1\.bn",
            r"projector.projector_layer.bottlenecks.\1.conv1.norm",
        ),
        WeightRenaming(
            r"projector\.stages\.0\.0\.m\.(\d+)\.cv2\.conv",
            r"projector.projector_layer.bottlenecks.\1.conv2.conv",
        ),
        WeightRenaming(
            r"projector\.stages\.0\.0\.m\.(\d+)\.cv2\.bn",
            r"projector.projector_layer.bottlenecks.\1.conv2.norm",
        ),
        WeightRenaming(r"transformer\.decoder", "decoder"),
        WeightRenaming(r"decoder\.layers\.(\d+)\.norm1", r"decoder.layers.\1.self_attn_layer_norm"),
        WeightRenaming(r"decoder\.layers\.(\d+)\.norm2", r"decoder.layers.\1.cross_attn_layer_norm"),
        WeightRenaming(r"decoder\.layers\.(\d+)\.linear1", r"decoder.layers.\1.mlp.fc1"),
        WeightRenaming(r"decoder\.layers\.(\d+)\.linear2", r"decoder.layers.\1.mlp.fc2"),
        WeightRenaming(r"decoder\.layers\.(\d+)\.norm3", r"decoder.layers.\1.layer_norm"),
        WeightRenaming(r"decoder\.norm", "decoder.layernorm"),
        WeightRenaming(r"^transformer\.enc_output_norm", "enc_output_norm"),
        WeightRenaming(r"^transformer\.enc_output", "enc_output"),
        WeightRenaming(r"transformer\.enc_out_class_embed", "enc_out_class_embed"),
        WeightRenaming(r"transformer\.enc_out_bbox_embed", "enc_out_bbox_embed"),
        WeightRenaming(r"refpoint_embed\.weight", "reference_point_embed.weight"),
        WeightRenaming(r"attention\.attention\.query", "attention.q_proj"),
        WeightRenaming(r"attention\.attention\.key", "attention.k_proj"),
        WeightRenaming(r"attention\.attention\.value", "attention.v_proj"),
        WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
        WeightRenaming(r"self_attn\.out_proj", "self_attn.o_proj"),
        WeightConverter(
            r"self_attn\.in_proj_bias",
            ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"],
            [ops.Chunk(dim=0)],
        ),
        WeightConverter(
            r"self_attn\.in_proj_weight",
            ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"],
            [ops.Chunk(dim=0)],
        ),
    ],
    "RfDetrForObjectDetection": [
        WeightRenaming(r"^(?!model\.|bbox_embed\.|class_embed\.)", "model."),
    ],
    "RfDetrForInstanceSegmentation": [
        WeightRenaming(_RF_DETR_SEGMENTATION_PREFIX, "model."),
        WeightRenaming(r"segmentation_head\.query_features_block\.layers\.0", "query_features_block.mlp.fc1"),
        WeightRenaming(r"segmentation_head\.query_features_block\.layers\.2", "query_features_block.mlp.fc2"),
        WeightRenaming(r"segmentation_head\.query_features_block\.norm_in", "query_features_block.norm"),
        WeightRenaming(r"segmentation_head\.blocks\.(\d+)\.norm", r"blocks.\1.layernorm"),
        WeightRenaming(r"segmentation_head\.blocks\.(\d+)\.dwconv", r"blocks.\1.depthwise_conv"),
        WeightRenaming(r"segmentation_head\.blocks\.(\d+)\.pwconv1", r"blocks.\1.pointwise_conv"),
        WeightRenaming(r"segmentation_head\.spatial_features_proj", "spatial_features_proj"),
        WeightRenaming(r"segmentation_head\.query_features_proj", "query_features_proj"),
        WeightRenaming(r"segmentation_head\.bias", "segmentation_bias"),
    ],
    "yolos": [
        WeightRenaming(r"encoder\.mid_position_embeddings", "encoder.interpolation.mid_position_embeddings"),
    ],
}

ALIASES: dict[str, str] = {
    "rt_detr_v2": "rt_detr",
    "pp_doclayout_v2": "rt_detr",
    "pp_doclayout_v3": "rt_detr",
}

ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    # transformers' ``^`` prefixes every key, the runtime ones included, and falls back to the
    # original key when the prefixed one is unknown; surgery never does, so skip what is in place.
    "RfDetrForObjectDetection": {"^": r"^(?!model\.|bbox_embed\.|class_embed\.)"},
    "RfDetrForInstanceSegmentation": {"^(?!segmentation_head)": _RF_DETR_SEGMENTATION_PREFIX},
}
"""Key -> {transformers' source or target pattern: ours}, where ours deliberately differs."""
