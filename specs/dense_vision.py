r"""Dense-prediction and other vision models: Sapiens2, TIPSv2 (+ DPT heads), Segformer, Swin, RADIO, DINOv3, timm, SAM3 tracker.

* Sapiens2: the backbone's ``blocks.N``/``attn.wq|wk|wv|proj`` → ``model.layer.N``/
  ``attention.q|k|v|o_proj``; each head (segmentation, pose, normal, pointmap, matting) renames
  its ``nn.Sequential`` indices into named conv layers (``deconv_layers.3`` →
  ``upsample_layers.1.convolution``).
* TIPSv2: ``text_encoder``/``vision_encoder`` → ``text_model``/``vision_model``; the towers
  rename OpenCLIP-style names (``transformer.resblocks`` → ``encoder.layers``, fused
  ``in_proj_weight`` chunked into q/k/v). The DPT heads (depth, normals, segmentation) rename
  ``reassemble``/``fusion_blocks`` into the DPT neck. **Adapted**: the tower renames skip names
  already under ``embeddings.`` (a runtime-layout file passes through).
* Segformer: ``encoder.block.N`` → ``stages.N.blocks``, attention and MLP renames.
* Swin: attention/MLP renames as ViT. **Registered by class** (``SwinModel``,
  ``SwinForImageClassification``, ``SwinForMaskedImageModeling``) instead of the ``swin`` model
  type: MaskFormer's Swin backbone has a SwinConfig but keeps ``attention.self.query``; the
  renames only work there in transformers because its loader falls back to the original key.
  ``SwinBackbone`` adds the ``swin.`` prefix of a classification checkpoint.
* RADIO: ``radio_model.model.*`` → the modular names, fused ``attn.qkv`` chunked.
* DINOv3 (ViT, ConvNeXt): the backbone moves under ``model.``; timm models: ``timm_model.``
  prefix; SAM3 tracker: the detector's backbone and the tracker neck move into
  ``vision_encoder``.
"""

from __future__ import annotations

from surgery import PrefixChange, WeightConverter, WeightRenaming, ops
from surgery.transforms import WeightTransform

__all__ = ["ADAPTED_PATTERNS", "ALIASES", "ENTRIES", "REKEYED"]


def _swin() -> list[WeightTransform]:
    return [
        WeightRenaming(r"attention\.self\.query", "attention.q_proj"),
        WeightRenaming(r"attention\.self\.key", "attention.k_proj"),
        WeightRenaming(r"attention\.self\.value", "attention.v_proj"),
        WeightRenaming(
            r"attention\.self\.relative_position_bias_table",
            "attention.relative_position_bias.relative_position_bias_table",
        ),
        WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
        WeightRenaming(r"intermediate\.dense", "mlp.fc1"),
        WeightRenaming(r"output\.dense", "mlp.fc2"),
    ]


def _tipsv2_dpt(head: str) -> list[WeightTransform]:
    """A TIPSv2 DPT head's ``reassemble``/``fusion_blocks``/``convs``/``project`` → the DPT neck and decoder."""
    return [
        WeightRenaming("vision_encoder", "backbone"),
        WeightRenaming(
            rf"{head}\.reassemble\.readout_projects\.(\d+)",
            r"neck.reassemble_stage.readout_projects.\1.layers.0",
        ),
        WeightRenaming(
            rf"{head}\.reassemble\.out_projections\.(\d+)\.", r"neck.reassemble_stage.layers.\1.projection."
        ),
        WeightRenaming(
            rf"{head}\.reassemble\.resize_layers\.(\d+)\.", r"neck.reassemble_stage.layers.\1.resize."
        ),
        WeightRenaming(
            rf"{head}\.fusion_blocks\.(\d+)\.out_conv\.", r"neck.fusion_stage.layers.\1.projection."
        ),
        *(
            WeightRenaming(
                rf"{head}\.fusion_blocks\.(\d+)\.{unit}\.conv{n}\.",
                rf"neck.fusion_stage.layers.\1.residual_layer{layer}.convolution{n}.",
            )
            for unit, layer in (("main_unit", 2), ("residual_unit", 1))
            for n in (1, 2)
        ),
        WeightRenaming(rf"{head}\.convs", "neck.convs"),
        WeightRenaming(rf"{head}\.project", "decoder.project"),
    ]


ENTRIES: dict[str, list[WeightTransform]] = {
    "sapiens2": [
        WeightRenaming("^cls_token", "embeddings.cls_token"),
        WeightRenaming("^storage_tokens", "embeddings.register_tokens"),
        WeightRenaming(r"^patch_embed\.projection\.", "embeddings.patch_embeddings."),
        WeightRenaming(r"blocks\.(\d+)\.", r"model.layer.\1."),
        WeightRenaming(r"attn\.proj\.", "attention.o_proj."),
        WeightRenaming(r"attn\.wq\.", "attention.q_proj."),
        WeightRenaming(r"attn\.wk\.", "attention.k_proj."),
        WeightRenaming(r"attn\.wv\.", "attention.v_proj."),
        WeightRenaming(r"attn\.q_norm\.", "attention.q_norm."),
        WeightRenaming(r"attn\.k_norm\.", "attention.k_norm."),
        WeightRenaming(r"attn\.gamma\.weight", "layer_scale1.lambda1"),
        WeightRenaming(r"ffn\.w3\.", "mlp.down_proj."),
        WeightRenaming(r"\.ln1\.", ".norm1."),
        WeightRenaming(r"\.ln2\.", ".norm2."),
        WeightRenaming(r"^ln1\.", "norm."),
        WeightConverter(
            r"ffn\.w12\.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"], [ops.Chunk(dim=0)]
        ),
        WeightConverter(r"ffn\.w12\.bias", ["mlp.gate_proj.bias", "mlp.up_proj.bias"], [ops.Chunk(dim=0)]),
    ],
    "Sapiens2ForSemanticSegmentation": [
        WeightRenaming(r"^backbone\.", "model."),
        WeightRenaming(
            r"decode_head\.deconv_layers\.0\.weight", "decode_head.upsample_layers.0.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.deconv_layers\.3\.weight", "decode_head.upsample_layers.1.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.deconv_layers\.6\.weight", "decode_head.upsample_layers.2.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.deconv_layers\.9\.weight", "decode_head.upsample_layers.3.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.0\.(weight|bias)", r"decode_head.conv_layers.0.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.3\.(weight|bias)", r"decode_head.conv_layers.1.convolution.\1"
        ),
        WeightRenaming(r"decode_head\.conv_seg\.", "decode_head.predictor."),
    ],
    "Sapiens2ForPoseEstimation": [
        WeightRenaming(r"^backbone\.", "model."),
        WeightRenaming(
            r"decode_head\.deconv_layers\.0\.weight", "decode_head.upsample_layers.0.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.deconv_layers\.3\.weight", "decode_head.upsample_layers.1.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.0\.(weight|bias)", r"decode_head.conv_layers.0.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.3\.(weight|bias)", r"decode_head.conv_layers.1.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.6\.(weight|bias)", r"decode_head.conv_layers.2.convolution.\1"
        ),
        WeightRenaming(r"decode_head\.conv_pose\.", "decode_head.predictor."),
    ],
    "Sapiens2ForNormalEstimation": [
        WeightRenaming(r"^backbone\.", "model."),
        WeightRenaming(
            r"decode_head\.input_conv\.0\.(weight|bias)", r"decode_head.input_conv.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.upsample_blocks\.(\d+)\.0\.weight",
            r"decode_head.upsample_layers.\1.convolution.weight",
        ),
        WeightRenaming(
            r"decode_head\.upsample_blocks\.(\d+)\.0\.bias",
            r"decode_head.upsample_layers.\1.convolution.bias",
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.0\.(weight|bias)", r"decode_head.conv_layers.0.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.3\.(weight|bias)", r"decode_head.conv_layers.1.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.6\.(weight|bias)", r"decode_head.conv_layers.2.convolution.\1"
        ),
        WeightRenaming(r"decode_head\.conv_normal\.", "decode_head.predictor."),
    ],
    "Sapiens2ForPointmapEstimation": [
        WeightRenaming(r"^backbone\.", "model."),
        WeightRenaming(
            r"decode_head\.input_conv\.0\.(weight|bias)", r"decode_head.input_conv.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.upsample_blocks\.(\d+)\.0\.weight",
            r"decode_head.upsample_layers.\1.convolution.weight",
        ),
        WeightRenaming(
            r"decode_head\.upsample_blocks\.(\d+)\.0\.bias",
            r"decode_head.upsample_layers.\1.convolution.bias",
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.0\.(weight|bias)", r"decode_head.conv_layers.0.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.3\.(weight|bias)", r"decode_head.conv_layers.1.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.6\.(weight|bias)", r"decode_head.conv_layers.2.convolution.\1"
        ),
        WeightRenaming(r"decode_head\.conv_pointmap\.", "decode_head.predictor."),
        WeightRenaming(
            r"decode_head\.scale_conv_layers\.0\.weight", "scale_head.conv_layers.0.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.scale_conv_layers\.0\.bias", "scale_head.conv_layers.0.convolution.bias"
        ),
        WeightRenaming(
            r"decode_head\.scale_conv_layers\.3\.weight", "scale_head.conv_layers.1.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.scale_conv_layers\.3\.bias", "scale_head.conv_layers.1.convolution.bias"
        ),
        WeightRenaming(
            r"decode_head\.scale_conv_layers\.6\.weight", "scale_head.conv_layers.2.convolution.weight"
        ),
        WeightRenaming(
            r"decode_head\.scale_conv_layers\.6\.bias", "scale_head.conv_layers.2.convolution.bias"
        ),
        WeightRenaming(r"decode_head\.scale_final_layer\.1\.", "scale_head.predictor.block1.layers.0."),
        WeightRenaming(r"decode_head\.scale_final_layer\.3\.", "scale_head.predictor.block2.layers.0."),
        WeightRenaming(r"decode_head\.scale_final_layer\.5\.", "scale_head.predictor.proj."),
    ],
    "Sapiens2ForImageMatting": [
        WeightRenaming(r"^backbone\.", "model."),
        WeightRenaming(
            r"decode_head\.input_conv\.0\.(weight|bias)", r"decode_head.input_conv.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.upsample_blocks\.(\d+)\.0\.weight",
            r"decode_head.upsample_layers.\1.convolution.weight",
        ),
        WeightRenaming(
            r"decode_head\.upsample_blocks\.(\d+)\.0\.bias",
            r"decode_head.upsample_layers.\1.convolution.bias",
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.0\.(weight|bias)", r"decode_head.conv_layers.0.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.3\.(weight|bias)", r"decode_head.conv_layers.1.convolution.\1"
        ),
        WeightRenaming(
            r"decode_head\.conv_layers\.6\.(weight|bias)", r"decode_head.conv_layers.2.convolution.\1"
        ),
        WeightRenaming(r"decode_head\.conv_matting\.", "decode_head.predictor."),
    ],
    "tipsv2": [
        WeightRenaming("text_encoder", "text_model"),
        WeightRenaming("vision_encoder", "vision_model"),
    ],
    "Tipsv2TextModel": [
        PrefixChange(prefix_to_remove="text_encoder"),
        WeightRenaming(r"ln_final\.", "final_layer_norm."),
        WeightRenaming(r"(?<!embeddings\.)token_embedding\.", "embeddings.token_embedding."),
        WeightRenaming(r"transformer\.resblocks\.", "encoder.layers."),
        WeightRenaming(r"\.ln_1\.", ".layer_norm1."),
        WeightRenaming(r"\.ln_2\.", ".layer_norm2."),
        WeightRenaming(r"\.attn\.", ".self_attn."),
        WeightRenaming(r"\.mlp\.c_fc\.", ".mlp.fc1."),
        WeightRenaming(r"\.mlp\.c_proj\.", ".mlp.fc2."),
        WeightConverter(
            r"\.in_proj_weight", [".q_proj.weight", ".k_proj.weight", ".v_proj.weight"], [ops.Chunk(dim=0)]
        ),
        WeightConverter(
            r"\.in_proj_bias", [".q_proj.bias", ".k_proj.bias", ".v_proj.bias"], [ops.Chunk(dim=0)]
        ),
    ],
    "Tipsv2VisionModel": [
        PrefixChange(prefix_to_remove="vision_encoder"),
        WeightRenaming(r"patch_embed\.proj\.", "embeddings.patch_embeddings.projection."),
        WeightRenaming(r"(?<!embeddings\.)cls_token", "embeddings.cls_token"),
        WeightRenaming(r"(?<!embeddings\.)mask_token", "embeddings.mask_token"),
        WeightRenaming(r"(?<!embeddings\.)register_tokens", "embeddings.register_tokens"),
        WeightRenaming("pos_embed", "embeddings.position_embeddings"),
        WeightRenaming(r"(?<!layer)norm\.", "layernorm."),
        WeightRenaming(r"blocks\.", "encoder.layer."),
        WeightRenaming(r"\.attn\.proj\.", ".attention.o_proj."),
        WeightRenaming(r"\.ls1\.gamma", ".layer_scale1.lambda1"),
        WeightRenaming(r"\.ls2\.gamma", ".layer_scale2.lambda1"),
        WeightRenaming(r"\.mlp\.c_fc\.", ".mlp.fc1."),
        WeightRenaming(r"\.mlp\.c_proj\.", ".mlp.fc2."),
        WeightRenaming(r"\.mlp\.w3\.", ".mlp.down_proj."),
        WeightConverter(
            r"\.mlp\.w12\.weight", [".mlp.gate_proj.weight", ".mlp.up_proj.weight"], [ops.Chunk(dim=0)]
        ),
        WeightConverter(
            r"\.mlp\.w12\.bias", [".mlp.gate_proj.bias", ".mlp.up_proj.bias"], [ops.Chunk(dim=0)]
        ),
        WeightConverter(
            r"\.attn\.qkv\.weight",
            [".attention.q_proj.weight", ".attention.k_proj.weight", ".attention.v_proj.weight"],
            [ops.Chunk(dim=0)],
        ),
        WeightConverter(
            r"\.attn\.qkv\.bias",
            [".attention.q_proj.bias", ".attention.k_proj.bias", ".attention.v_proj.bias"],
            [ops.Chunk(dim=0)],
        ),
    ],
    "tipsv2_dpt": [
        *_tipsv2_dpt("head"),
        WeightRenaming(r"depth_head\.depth_head\.", "depth_decoder.head."),
        WeightRenaming(r"normals_head\.normals_head\.", "normals_decoder.head."),
        WeightRenaming(r"segmentation_head\.segmentation_head\.", "segmentation_decoder.head."),
    ],
    "Tipsv2DptForDepthEstimation": [
        *_tipsv2_dpt("depth_head"),
        WeightRenaming(r"depth_head\.depth_head\.", "decoder.head."),
    ],
    "Tipsv2DptForNormalEstimation": [
        *_tipsv2_dpt("normals_head"),
        WeightRenaming(r"normals_head\.normals_head\.", "decoder.head."),
    ],
    "Tipsv2DptForSemanticSegmentation": [
        *_tipsv2_dpt("segmentation_head"),
        WeightRenaming(r"segmentation_head\.segmentation_head\.", "decoder.head."),
    ],
    "SegformerModel": [
        WeightRenaming(r"encoder\.patch_embeddings\.(\d+)\.", r"stages.\1.patch_embeddings."),
        WeightRenaming(r"encoder\.block\.(\d+)\.", r"stages.\1.blocks."),
        WeightRenaming(r"encoder\.layer_norm\.(\d+)", r"stages.\1.layer_norm"),
        WeightRenaming(r"attention\.self\.query", "attention.q_proj"),
        WeightRenaming(r"attention\.self\.key", "attention.k_proj"),
        WeightRenaming(r"attention\.self\.value", "attention.v_proj"),
        WeightRenaming(r"attention\.self\.sr", "attention.sequence_reduction.sequence_reduction"),
        WeightRenaming(r"attention\.self\.layer_norm", "attention.sequence_reduction.layer_norm"),
        WeightRenaming(r"attention\.output\.dense", "attention.o_proj"),
        WeightRenaming(r"mlp\.dense1", "mlp.fc1"),
        WeightRenaming(r"mlp\.dense2", "mlp.fc2"),
        WeightRenaming("layer_norm_1", "layernorm_before"),
        WeightRenaming("layer_norm_2", "layernorm_after"),
    ],
    "SegformerForSemanticSegmentation": [
        WeightRenaming(r"decode_head\.linear_c", "decode_head.linear_projections"),
    ],
    # Registered by class, not by the ``swin`` model type: MaskFormer's Swin backbone has a
    # SwinConfig but keeps the old attention names (see ``REKEYED``).
    "SwinModel": _swin(),
    "SwinForImageClassification": _swin(),
    "SwinForMaskedImageModeling": _swin(),
    "SwinBackbone": [
        WeightRenaming(r"^encoder\.", "swin.encoder."),
        WeightRenaming(r"^embeddings\.", "swin.embeddings."),
    ],
    "radio": [
        WeightRenaming(
            r"radio_model\.model\.patch_generator\.video_embedder", "embeddings.video_patch_projection"
        ),
        WeightRenaming(r"radio_model\.model\.patch_generator\.embedder", "embeddings.patch_projection"),
        WeightRenaming(r"radio_model\.model\.patch_generator\.pos_embed", "embeddings.position_embedding"),
        WeightRenaming(
            r"radio_model\.model\.patch_generator\.cls_token\.token", "embeddings.cls_register_token"
        ),
        WeightRenaming(r"radio_model\.model\.blocks", "encoder.layer"),
        WeightRenaming(r"attn\.proj", "attention.o_proj"),
        WeightRenaming(r"radio_model\.input_conditioner", "input_conditioner"),
        WeightRenaming(r"radio_model\.summary_idxs", "summary_idxs"),
        WeightConverter(
            r"attn\.qkv", ["attention.q_proj", "attention.k_proj", "attention.v_proj"], [ops.Chunk(dim=0)]
        ),
    ],
    "dinov3_convnext": [
        WeightRenaming(r"(?<!model\.)stages", "model.stages"),
    ],
    "dinov3_vit": [
        WeightRenaming(r"(?<!model\.)layer\.", "model.layer."),
    ],
    "timm_wrapper": [
        PrefixChange(prefix_to_add="timm_model"),
    ],
    "sam3_tracker": [
        WeightRenaming(r"detector_model\.vision_encoder\.backbone\.", "vision_encoder.backbone."),
        WeightRenaming(r"tracker_neck\.", "vision_encoder.neck."),
        WeightRenaming(r"tracker_model\.(.+)", r"\1"),
    ],
}

ALIASES: dict[str, str] = {
    "Tipsv2VisionBackbone": "Tipsv2VisionModel",
    "sam3_tracker_video": "sam3_tracker",
}

ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    # The targets contain the sources, so the renamings fire again on runtime keys (transformers
    # then falls back to the original key, surgery never does): they skip names already renamed.
    "Tipsv2TextModel": {r"token_embedding\.": r"(?<!embeddings\.)token_embedding\."},
    "Tipsv2VisionModel": {
        "cls_token": r"(?<!embeddings\.)cls_token",
        "mask_token": r"(?<!embeddings\.)mask_token",
        "register_tokens": r"(?<!embeddings\.)register_tokens",
        r"norm\.": r"(?<!layer)norm\.",
    },
}
"""Key -> {transformers' source or target pattern: ours}, where ours deliberately differs."""

REKEYED: dict[str, str] = {
    "SwinModel": "swin",
    "SwinForImageClassification": "swin",
    "SwinForMaskedImageModeling": "swin",
}
"""Our key -> the transformers key whose list it holds, where ours is registered more narrowly.

transformers registers the Swin renamings for the ``swin`` model type, which MaskFormer's Swin
backbone shares (its config is a SwinConfig) while keeping ``attention.self.query``; there they
only work because transformers falls back to the original key when a renamed one is unknown,
which surgery's loader never does.
"""
