"""Tiny transformers models for any model type or class, built from the config class's defaults.

The interop tests need a small random model of every family the catalog maps. Writing one config
per family by hand does not scale to hundreds of families, so :func:`tiny_config` shrinks a config
generically: it takes the config class's defaults (``to_dict()``, sub-configs included), replaces
the sizes that make a model large (widths, depths, heads, experts, vocabulary, ...) by small
consistent values, truncates per-layer lists to the new depth, and builds the config again from
that dict. ``OVERRIDES`` holds what a family needs on top (keyed by model type), each with the
reason. :func:`build` instantiates the model on ``meta`` first and refuses one that is still not
tiny, so a shrink that missed a size fails with the largest parameters named instead of
allocating gigabytes.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["MAX_PARAMETERS", "OVERRIDES", "Candidate", "build", "candidates", "reseeded", "tiny_config"]

MAX_PARAMETERS = 8_000_000
"""A model with more parameters than this after shrinking is refused as not tiny."""

WIDTH = 32
HEADS = 2
HEAD_DIM = WIDTH // HEADS
LAYERS = 2
VOCAB = 128

_WIDTHS = (
    "hidden_size",
    "d_model",
    "embed_dim",
    "n_embd",
    "hidden_dim",
    "dim",
    "projection_dim",
    "text_embed_dim",
    "vision_embed_dim",
    "out_hidden_size",
    "d_embed",
    "word_embed_proj_dim",
    "encoder_hidden_size",
    "decoder_hidden_size",
    "text_hidden_size",
    "vision_hidden_size",
    "audio_hidden_size",
    "projector_hidden_size",
    "hidden_channels",
    "embedding_size",
    "embed_size",
    "proj_dim",
    "output_dim",
    "latent_dim",
    "d_latent",
    "mm_hidden_size",
)
_FFN = {
    "intermediate_size": 2 * WIDTH,
    "ffn_dim": 2 * WIDTH,
    "encoder_ffn_dim": 2 * WIDTH,
    "decoder_ffn_dim": 2 * WIDTH,
    "d_ff": 2 * WIDTH,
    "n_inner": 2 * WIDTH,
    "mlp_dim": 2 * WIDTH,
    "dim_feedforward": 2 * WIDTH,
    "encoder_intermediate_size": 2 * WIDTH,
    "decoder_intermediate_size": 2 * WIDTH,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "expert_intermediate_size": 16,
    "moe_ffn_hidden_size": 16,
    "dense_intermediate_size": 2 * WIDTH,
}
_DEPTHS = (
    "num_hidden_layers",
    "num_layers",
    "n_layer",
    "n_layers",
    "encoder_layers",
    "decoder_layers",
    "num_encoder_layers",
    "num_decoder_layers",
    "depth",
    "encoder_num_hidden_layers",
    "decoder_num_hidden_layers",
    "text_num_hidden_layers",
    "vision_num_hidden_layers",
)
_HEADS = (
    "num_attention_heads",
    "n_head",
    "n_heads",
    "encoder_attention_heads",
    "decoder_attention_heads",
    "num_heads",
    "encoder_num_attention_heads",
    "decoder_num_attention_heads",
)
_KV_HEADS = (
    "num_key_value_heads",
    "n_kv_heads",
    "num_kv_heads",
    "multi_query_group_num",
)
_HEAD_DIMS = (
    "head_dim",
    "attention_head_dim",
    "kv_channels",
    "d_kv",
    "v_head_dim",
)
_EXPERTS = (
    "num_experts",
    "num_local_experts",
    "n_routed_experts",
    "moe_num_experts",
    "num_routed_experts",
)
_TOP_K = (
    "num_experts_per_tok",
    "top_k",
    "moe_topk",
    "num_experts_per_token",
    "moe_k",
    "num_selected_experts",
)
_SMALL = {
    "kv_lora_rank": 8,
    "q_lora_rank": 8,
    "qk_rope_head_dim": 4,
    "qk_nope_head_dim": 12,
    "n_group": 1,
    "topk_group": 1,
    "n_shared_experts": 1,
    "num_shared_experts": 1,
    "first_k_dense_replace": 1,
    "max_position_embeddings": 256,
    "max_window_layers": LAYERS,
}
_VOCABS = (
    "vocab_size",
    "text_vocab_size",
    "codebook_size",
)


def _is_config_dict(d: dict[str, Any]) -> bool:
    return "model_type" in d or "architectures" in d


def _shrink_lists(d: dict[str, Any], old_depth: int, new_depth: int) -> None:
    """Per-layer lists (``layer_types``, ``mlp_only_layers`` of that length...) follow the new depth."""
    if old_depth <= new_depth:
        return
    for k, v in list(d.items()):
        if isinstance(v, list) and len(v) == old_depth and k not in ("depths",):
            d[k] = _keep_variety(v, new_depth)


def _keep_variety(values: list[Any], n: int) -> list[Any]:
    """The first ``n`` entries, swapping in one of each kind the prefix misses (hybrid layer types)."""
    out = list(values[:n])
    kinds = []
    for v in values:
        if isinstance(v, (str, int, bool)) and v not in kinds:
            kinds.append(v)
    if len(kinds) > n:  # layer indices or sizes, not a few layer kinds
        return out
    missing = [v for v in kinds if v not in out]
    for i, v in enumerate(missing[: n - 1]):
        out[-1 - i] = v
    return out


VISION_HEADS = 4
"""Vision towers get other head counts than the text model: an op reading the wrong one shows."""


def _shrink(d: dict[str, Any], heads: int = HEADS) -> dict[str, Any]:
    """A shrunken copy of one (sub-)config dict."""
    d = dict(d)
    old_heads = next((d[k] for k in _HEADS if isinstance(d.get(k), int)), None)
    old_depth = next((d[k] for k in _DEPTHS if isinstance(d.get(k), int)), None)
    stages = isinstance(d.get("depths"), list)  # Swin-like: ``num_layers`` counts stages, not layers
    for k, v in list(d.items()):
        if isinstance(v, dict):
            sub_heads = VISION_HEADS if "vision" in k else heads
            d[k] = (
                _shrink(v, sub_heads) if (_is_config_dict(v) or k.endswith("_config")) else _shrink_params(v)
            )
        elif isinstance(v, bool) or not isinstance(v, (int, list)):
            continue
        elif isinstance(v, list):
            if k == "depths" and all(isinstance(x, int) for x in v):
                d[k] = [1] * len(v)
            elif k in ("hidden_sizes", "embed_dims", "dims", "neck_hidden_sizes") and all(
                isinstance(x, int) for x in v
            ):
                d[k] = [WIDTH // 2 * 2**i if i < 3 else WIDTH * 4 for i in range(len(v))]
            elif k in ("num_heads", "num_attention_heads") and all(isinstance(x, int) for x in v):
                d[k] = [1] * len(v)
        elif k in _WIDTHS and v > WIDTH:
            d[k] = WIDTH
        elif k in _FFN and v > _FFN[k]:
            d[k] = _FFN[k]
        elif k in _DEPTHS and v > LAYERS and not (stages and k == "num_layers"):
            d[k] = LAYERS
        elif k in _HEADS and v > heads:
            d[k] = heads
        elif k in _KV_HEADS and v > 1:
            d[k] = heads if old_heads is not None and v >= old_heads else 1
        elif k in _HEAD_DIMS and v > HEAD_DIM:
            d[k] = HEAD_DIM
        elif k in _EXPERTS and v > 4:
            d[k] = 4
        elif k in _TOP_K and v > 2:
            d[k] = 2
        elif k in _SMALL and v > _SMALL[k]:
            d[k] = _SMALL[k]
        elif k in _VOCABS and v > VOCAB:
            d[k] = VOCAB
    if isinstance(old_depth, int) and not stages:
        _shrink_lists(d, old_depth, LAYERS)
        _shrink_stages(d, old_depth)
        _shrink_layer_dicts(d)
    _fix_token_ids(d)
    return d


def _depth_key(d: dict[str, Any]) -> str | None:
    return next((k for k in _DEPTHS if isinstance(d.get(k), int) and not isinstance(d.get(k), bool)), None)


def _shrink_stages(d: dict[str, Any], old_depth: int) -> None:
    """A backbone's outputs named by layer (``stage12``) become the first stages of the new depth."""
    names = d.get("stage_names")
    if not (isinstance(names, list) and len(names) == old_depth + 1):
        return
    indices = d.get("out_indices") or d.get("_out_indices") or []
    wanted = [i for i in indices if isinstance(i, int) and i > 0]
    key = _depth_key(d)
    if key is not None and len(wanted) > d[key]:
        d[key] = len(wanted)
    for k in ("stage_names", "out_features", "_out_features", "_out_indices"):
        d.pop(k, None)
    if wanted:
        d["out_indices"] = list(range(1, len(wanted) + 1))
    else:
        d.pop("out_indices", None)


def _shrink_layer_dicts(d: dict[str, Any]) -> None:
    """Dicts keyed by layer index (``per_layer_config``) keep the layers that still exist."""
    key = _depth_key(d)
    if key is None:
        return
    depth = d[key]
    for k, v in list(d.items()):
        if k in ("id2label", "label2id"):
            continue
        if isinstance(v, dict) and v and all(str(x).isdigit() for x in v):
            d[k] = {x: y for x, y in v.items() if int(x) < depth}


def _shrink_params(d: dict[str, Any]) -> dict[str, Any]:
    """Rope parameters: an M-RoPE section splits the new head dim in the old proportions."""
    d = dict(d)
    section = d.get("mrope_section")
    if isinstance(section, list) and section and all(isinstance(x, int) for x in section):
        half = HEAD_DIM // 2
        total = sum(section)
        new = [max(1, round(x * half / total)) for x in section]
        new[-1] += half - sum(new)
        d["mrope_section"] = new
    return d


def _fix_token_ids(d: dict[str, Any]) -> None:
    """Special token ids beyond the shrunken vocabulary get small ids (an embedding's padding_idx must fit)."""
    vocab = d.get("vocab_size")
    if not isinstance(vocab, int):
        return
    taken = 0
    for k, v in list(d.items()):
        if not (
            k.endswith("_token_id") or k.endswith("_token_index") or (k.endswith("_id") and "token" in k)
        ):
            continue
        if isinstance(v, int) and not isinstance(v, bool) and v >= vocab:
            d[k] = vocab - 1 - taken
            taken += 1
        elif isinstance(v, list) and any(isinstance(x, int) and x >= vocab for x in v):
            d[k] = [x if x < vocab else vocab - 1 - (taken := taken + 1) for x in v]


def tiny_config(config_class: type, **overrides: Any) -> Any:
    """A small config of ``config_class``: its defaults shrunk, then ``overrides`` on top."""
    default = config_class()
    shrunk = _shrink(default.to_dict())
    for key in ("transformers_version", "architectures", "_name_or_path"):
        shrunk.pop(key, None)
    _merge(shrunk, overrides)
    return config_class.from_dict(shrunk)


def _merge(d: dict[str, Any], overrides: dict[str, Any]) -> None:
    for k, v in overrides.items():
        if isinstance(v, dict) and isinstance(d.get(k), dict):
            _merge(d[k], v)
        else:
            d[k] = v


OVERRIDES: dict[str, dict[str, Any]] = {
    # transformers 5.24+: the padded unembedding keeps its first unpadded_vocab_size rows, which
    # must be fewer than vocab_size (the default 200058 is the real vocabulary)
    **{
        model_type: {"text_config": {"unpadded_vocab_size": 120}}
        for model_type in ("inkling2", "inkling2_loop")
    },
    **{model_type: {"unpadded_vocab_size": 120} for model_type in ("inkling2_text", "inkling2_loop_text")},
    # index_layers must name the shrunk layer_types' indexed-attention layers
    "kolibri1_1": {"index_layers": [1], "index_num_heads": 1},
    # counted in blocks (an attention and an mlp block per layer): two layers, one input, one output
    "dory": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "mlp", "full_attention", "mlp"],
        "n_input_layers": 2,
        "n_recurrent_layers": 0,
        "n_output_layers": 2,
    },
    # the M-RoPE sections must sum to qk_rope_head_dim // 2 (shrunk to 4)
    "hy_v4_vl": {"text_config": {"rope_parameters": {"mrope_section": [1, 0, 1]}}},
    "hy_v4_vl_text": {"rope_parameters": {"mrope_section": [1, 0, 1]}},
    # The experts' transpose is told apart by shape: gate_up [E, 2I, H] must not be square (2I != H).
    "qwen3_vl_moe": {"text_config": {"moe_intermediate_size": 8}},
    # num_layers is the stage count (len(depths)), so the generic shrink cut the 4-stage num_heads list to 2
    "swin": {"num_heads": [1, 1, 1, 1]},
    # same Swin backbone quirk: num_heads must have one entry per stage
    # (fpn/mask feature sizes, 256, are not generic widths)
    "maskformer": {
        "backbone_config": {"num_heads": [1, 1, 1, 1], "out_indices": [1, 2, 3, 4]},
        "fpn_feature_size": 32,
        "mask_feature_size": 32,
    },
    # default backbone is timm resnet50 (timm not installed): a tiny transformers ResNet instead;
    # the segmentation mask head needs d_model + encoder heads divisible by 8 (GroupNorm)
    "detr": {
        "use_timm_backbone": False,
        "backbone_config": {
            "model_type": "resnet",
            "depths": [1, 1, 1, 1],
            "hidden_sizes": [16, 32, 64, 128],
            "embedding_size": 16,
            "out_features": ["stage1", "stage2", "stage3", "stage4"],
            "out_indices": [1, 2, 3, 4],
        },
        "encoder_attention_heads": 8,
    },
    "conditional_detr": {
        "use_timm_backbone": False,
        "backbone_config": {
            "model_type": "resnet",
            "depths": [1, 1, 1, 1],
            "hidden_sizes": [16, 32, 64, 128],
            "embedding_size": 16,
            "out_features": ["stage1", "stage2", "stage3", "stage4"],
            "out_indices": [1, 2, 3, 4],
        },
        "encoder_attention_heads": 8,
    },
    # timm resnet50 default; tiny ResNet giving the 3 feature levels (stages 2-4) the default expects
    "deformable_detr": {
        "use_timm_backbone": False,
        "backbone_config": {
            "model_type": "resnet",
            "depths": [1, 1, 1, 1],
            "hidden_sizes": [16, 32, 64, 128],
            "embedding_size": 16,
            "out_features": ["stage2", "stage3", "stage4"],
            "out_indices": [2, 3, 4],
        },
    },
    # hybrid encoder widths (encoder_hidden_dim 256, in-channels 512..2048) are not shrunk generically;
    # encoder_in_channels must equal the ResNet stage 2-4 widths
    "rt_detr": {
        "encoder_hidden_dim": 32,
        "encoder_in_channels": [32, 64, 128],
        "decoder_in_channels": [32, 32, 32],
    },
    "rt_detr_v2": {
        "encoder_hidden_dim": 32,
        "encoder_in_channels": [32, 64, 128],
        "decoder_in_channels": [32, 32, 32],
    },
    # HGNetV2 backbone stage_* channel lists are not shrunk generically (hidden_sizes must equal stage_out_channels),
    # plus the hybrid encoder widths (encoder_hidden_dim, encoder_in_channels = backbone stages 2-4, decoder_in_channels)
    "d_fine": {
        "backbone_config": {
            "embedding_size": 16,
            "stem_channels": [3, 16, 16],
            "stage_in_channels": [16, 32, 64, 64],
            "stage_mid_channels": [16, 16, 32, 32],
            "stage_out_channels": [32, 64, 64, 128],
            "hidden_sizes": [32, 64, 64, 128],
            "stage_num_blocks": [1, 1, 1, 1],
            "stage_numb_of_layers": [2, 2, 2, 2],
        },
        "encoder_hidden_dim": 32,
        "encoder_in_channels": [64, 64, 128],
        "decoder_in_channels": [32, 32, 32],
    },
    "pp_doclayout_v2": {
        "backbone_config": {
            "embedding_size": 16,
            "stem_channels": [3, 16, 16],
            "stage_in_channels": [16, 32, 64, 64],
            "stage_mid_channels": [16, 16, 32, 32],
            "stage_out_channels": [32, 64, 64, 128],
            "hidden_sizes": [32, 64, 64, 128],
            "stage_num_blocks": [1, 1, 1, 1],
            "stage_numb_of_layers": [2, 2, 2, 2],
        },
        "encoder_hidden_dim": 32,
        "encoder_in_channels": [64, 64, 128],
        "decoder_in_channels": [32, 32, 32],
    },
    "pp_doclayout_v3": {
        "backbone_config": {
            "embedding_size": 16,
            "stem_channels": [3, 16, 16],
            "stage_in_channels": [16, 32, 64, 64],
            "stage_mid_channels": [16, 16, 32, 32],
            "stage_out_channels": [32, 64, 64, 128],
            "hidden_sizes": [32, 64, 64, 128],
            "stage_num_blocks": [1, 1, 1, 1],
            "stage_numb_of_layers": [2, 2, 2, 2],
        },
        "encoder_hidden_dim": 32,
        "encoder_in_channels": [64, 64, 128],
        "decoder_in_channels": [32, 32, 32],
    },
    "pp_doclayout_v4": {
        "backbone_config": {
            "embedding_size": 16,
            "stem_channels": [3, 16, 16],
            "stage_in_channels": [16, 32, 64, 64],
            "stage_mid_channels": [16, 16, 32, 32],
            "stage_out_channels": [32, 64, 64, 128],
            "hidden_sizes": [32, 64, 64, 128],
            "stage_num_blocks": [1, 1, 1, 1],
            "stage_numb_of_layers": [2, 2, 2, 2],
        },
        "encoder_hidden_dim": 32,
        "encoder_in_channels": [64, 64, 128],
        "decoder_in_channels": [32, 32, 32],
    },
    # per-layer kv-head list kept its old 16/8 values; head_config channel lists default to None (the model needs them)
    "sapiens2": {
        "num_key_value_heads_per_layer": [2, 1],
        "head_config": {
            "upsample_out_channels": [16],
            "conv_out_channels": [16],
            "use_pixel_shuffle": False,
            "scale_conv_out_channels": [16],
            "scale_final_hidden_sizes": [16, 16],
        },
    },
    # the semantic-segmentation head needs 4 backbone features (out_indices of length 4)
    "beit": {"num_hidden_layers": 4, "out_indices": [1, 2, 3, 4], "auxiliary_channels": 16},
    # DPT neck fusion width (fusion_hidden_size 256) is not a generic width key
    "tipsv2_dpt": {"fusion_hidden_size": 32},
    # SAM2-style video memory modules: widths named memory_*/mask_downsampler_*/fpn_* are not generic keys
    # (they must all equal the 32-wide prompt encoder / mask decoder); global_attn_indexes must index the 2 layers
    "sam3_tracker_video": {
        "vision_config": {"fpn_hidden_size": 32, "backbone_config": {"global_attn_indexes": [1]}},
        "mask_decoder_config": {"iou_head_hidden_dim": 32},
        "memory_attention_hidden_size": 32,
        "memory_attention_num_layers": 2,
        "memory_attention_feed_forward_hidden_size": 64,
        "memory_encoder_hidden_size": 32,
        "memory_encoder_output_channels": 16,
        "mask_downsampler_embed_dim": 32,
        "memory_fuser_embed_dim": 32,
        "memory_fuser_intermediate_dim": 64,
    },
    # text head_dim defaults to None and the attention does head_dim**-0.5
    "hunyuan_vl": {"text_config": {"head_dim": 16}},
    # VQGAN convs (GroupNorm 32) are 256 channels wide and not generic widths; the model needs a vocabulary_map (<image>, <|extra_200|> and one "<|visual token NNNNNN|>" per VQ code)
    "emu3": {
        "vq_config": {
            "codebook_size": 16,
            "base_channels": 32,
            "channel_multiplier": [1, 1, 1, 1],
            "num_res_blocks": 1,
        },
        "vocabulary_map": {
            "<image>": 120,
            "<|extra_200|>": 121,
            "<|visual token 000000|>": 100,
            "<|visual token 000001|>": 101,
            "<|visual token 000002|>": 102,
            "<|visual token 000003|>": 103,
            "<|visual token 000004|>": 104,
            "<|visual token 000005|>": 105,
            "<|visual token 000006|>": 106,
            "<|visual token 000007|>": 107,
            "<|visual token 000008|>": 108,
            "<|visual token 000009|>": 109,
            "<|visual token 000010|>": 110,
            "<|visual token 000011|>": 111,
            "<|visual token 000012|>": 112,
            "<|visual token 000013|>": 113,
            "<|visual token 000014|>": 114,
            "<|visual token 000015|>": 115,
        },
    },
    # text mlp_layer_types defaults to None but the decoder indexes it; SAM neck channels (256 -> 512 -> 896) are
    # not generic widths; global_attn_indexes must index the 2 layers; image_token_id must fit the 128 vocab
    "deepseek_ocr2": {
        "text_config": {"mlp_layer_types": ["dense", "sparse"]},
        "vision_config": {
            "sam_config": {"output_channels": 32, "downsample_channels": [32, 32], "global_attn_indexes": [1]}
        },
        "image_token_id": 100,
    },
    # M-RoPE section (default [22, 22, 20]) must sum to head_dim/2; moe_intermediate_size is a per-modality list;
    # multimodal token ids (top level, no vocab_size there) must fit the 128 vocab
    "ernie4_5_vl_moe": {
        "text_config": {"rope_parameters": {"mrope_section": [3, 3, 2]}, "moe_intermediate_size": [16, 16]},
        "image_start_token_id": 100,
        "image_end_token_id": 101,
        "image_token_id": 102,
        "video_start_token_id": 103,
        "video_end_token_id": 104,
        "video_token_id": 105,
    },
    # vision_feature_layer [24, 18] must index the 2 ViT layers; special ids sit in the additional vocab (128 + 128)
    "molmo2": {
        "adapter_config": {"vision_feature_layer": [-1, -2]},
        "image_start_token_id": 200,
        "low_res_image_start_token_id": 201,
        "image_end_token_id": 202,
        "image_patch_id": 203,
        "frame_start_token_id": 204,
        "frame_end_token_id": 205,
    },
    # adapter dims must match the shrunk encoder / text widths; indexer and audio-conv widths are not generic keys;
    # multimodal token ids must fit the 128 vocab
    "dots3_note": {
        "vision_config": {"adapter_in_dim": 32, "adapter_out_dim": 32},
        "audio_config": {"adapter_input_size": 32, "adapter_out_dim": 32, "downsample_hidden_size": 16},
        "text_config": {
            "index_topk": 16,
            "index_head_dim": 16,
            "index_n_heads": 2,
            "shared_experts_intermediate_size": 16,
        },
        "image_token_id": 120,
        "video_token_id": 121,
        "audio_token_id": 122,
    },
    # SEANet channels double per ratio from num_filters (64 -> 1024); upsample_groups must divide hidden_size (depthwise)
    "mimi": {
        "num_filters": 8,
        "upsample_groups": 32,
        "codebook_dim": 32,
        "vector_quantization_hidden_dimension": 32,
        "num_quantizers": 4,
    },
    "mimi_encoder": {
        "num_filters": 8,
        "upsample_groups": 32,
        "codebook_dim": 32,
        "vector_quantization_hidden_dimension": 32,
        "num_quantizers": 4,
    },
    "mimi_decoder": {
        "num_filters": 8,
        "upsample_groups": 32,
        "codebook_dim": 32,
        "vector_quantization_hidden_dimension": 32,
        "num_quantizers": 4,
    },
    # tokenizer encoders double channels over 6 downsampling stages from num_filters (32 -> 2048)
    "vibevoice_asr": {
        "acoustic_tokenizer_encoder_config": {"num_filters": 2, "ffn_expansion": 2},
        "semantic_tokenizer_encoder_config": {"num_filters": 2, "ffn_expansion": 2},
    },
    # vocab_size/pad/mask default to None (set by every checkpoint); ESM-2 vocab is 33 tokens, pad 1, mask 32
    "esm": {"vocab_size": 33, "pad_token_id": 1, "mask_token_id": 32},
    # the encoder's text config gets dropout_rate only from the full T5Gemma2Config; a standalone encoder needs it set
    "t5gemma2_encoder": {"text_config": {"dropout_rate": 0.0}},
    # layer_types defaults to None (checkpoints list it); 2 dense layers by default would leave no MoE layer
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
    # indexed_attention layers need the QSA indexer fields (all None by default); linear-attention heads are 128 wide
    "qwen4_exp_text": {
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": 16,
        "indexer_budget": 8,
        "indexer_compress_ratio": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "hc_lowrank": 8,
    },
    # expert counts default to None (checkpoints set them); first_k_dense_replace 1 keeps one dense and one MoE layer
    "dots1": {
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
    },
    # head_dim defaults to None and the attention uses it directly (checkpoints set 128)
    "hunyuan_v1_moe": {"head_dim": 16, "num_experts": 4, "moe_topk": 2},
    # the flow head's condition_dim must equal the backbone hidden_size (not a shrunk width name)
    "gradium_phonon_tts": {
        "flow_head_config": {"condition_dim": 32, "frequency_embedding_size": 32},
        "audio_prompt_dim": 32,
        "duration_delta_embedding_dim": 16,
    },
    # nemotron_h text model: depth is len(layers_block_type) (52 by default, no num_hidden_layers key);
    # mamba width is mamba_num_heads * mamba_head_dim (64 * 64), shared expert has its own size key
    "nemo_speechlm": {
        "text_config": {
            "layers_block_type": ["linear_attention", "moe", "full_attention", "moe"],
            "mamba_num_heads": 4,
            "mamba_head_dim": 16,
            "n_groups": 1,
            "ssm_state_size": 16,
            "moe_shared_expert_intermediate_size": 16,
        },
    },
    # kv_source_layers is range(depth) (layer indices): the generic variety swap turns [0, 1] into [0, 2];
    # the indexer sizes (index_head_dim, index_n_heads) are not generic width/head names
    "mistral_large4_text": {
        "kv_source_layers": [0, 1],
        "index_head_dim": 16,
        "index_n_heads": 2,
        "index_topk": 8,
    },
    "mistral_large4": {
        "text_config": {"kv_source_layers": [0, 1], "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8}
    },
    # FFN widths are named ffn_hidden_size / expert_ffn_hidden_size (not in the generic FFN names); 256 zero experts
    "longcat_flash": {"ffn_hidden_size": 64, "expert_ffn_hidden_size": 16, "zero_expert_num": 2},
    # mamba_d_head is derived ("auto" -> 64) but saved, so it no longer matches the shrunk width: set heads and head
    # dim consistently (4 * 16 == mamba_expand * hidden_size); one attention layer keeps the hybrid; shared MLP is 1024
    "granitemoehybrid": {
        "mamba_n_heads": 4,
        "mamba_d_head": 16,
        "mamba_d_state": 16,
        "shared_intermediate_size": 16,
        "layer_types": ["linear_attention", "full_attention"],
    },
    # intermediate_size is a per-layer list (16384 each, not shrunk); the last num_kv_shared_layers (15) reuse KV of
    # earlier layers of each type, so 4 layers with 2 shared keep both producers; per-layer input embeddings are
    # vocab_size_per_layer_input x (depth * hidden_size_per_layer_input)
    "gemma3n_text": {
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        "intermediate_size": [64, 64, 64, 64],
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
        "num_kv_shared_layers": 2,
        "vocab_size_per_layer_input": 128,
        "hidden_size_per_layer_input": 8,
        "laurel_rank": 8,
    },
    # the talker's MoE reads shared_expert_intermediate_size, which its text config does not define (checkpoints set
    # it), nor spatial_merge_size for its rope index (checkpoints: 2); thinker_hidden_size must follow the shrunk thinker width; accept_hidden_layer must exist in the thinker;
    # code2wav decoder_dim (1536) and 32 code groups are not generic size names
    "qwen3_omni_moe": {
        "talker_config": {
            "text_config": {"shared_expert_intermediate_size": 16},
            "thinker_hidden_size": 32,
            "accept_hidden_layer": 1,
            "num_code_groups": 4,
            "spatial_merge_size": 2,
        },
        "code2wav_config": {"decoder_dim": 32, "num_quantizers": 4},
        "thinker_config": {"audio_config": {"downsample_hidden_size": 16}},  # audio conv stem width (480)
    },
    # the vision tower plans one scale per layer: with fewer layers (n_layers) than scales
    # (1 + prime factors of patch_size + of temporal_patch_size) it imports scipy's linear_sum_assignment;
    # patch 2 / temporal 2 give 3 scales, so 3 layers take the scipy-free argmin path (and small channel counts).
    # SWA attention sizes are swa_* names the generic shrink does not know; the audio token embedding is
    # n_mel_bins x mel_vocab_size rows
    "inkling_mm_model": {
        "vision_config": {"patch_size": 2, "temporal_patch_size": 2, "n_layers": 3},
        "audio_config": {"n_mel_bins": 8, "mel_vocab_size": 16},
        "text_config": {"swa_num_attention_heads": 2, "swa_num_key_value_heads": 1, "swa_head_dim": 16},
    },
}
"""Per model type, what the generic shrink gets wrong (the comment says why)."""


@dataclass(frozen=True)
class Candidate:
    """One model class to build for a catalog key."""

    key: str
    class_name: str
    model_type: str


def _head_classes(model_type: str) -> list[str]:
    from transformers.models.auto import modeling_auto

    preferred = (
        "MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES",
        "MODEL_FOR_MULTIMODAL_LM_MAPPING_NAMES",
        "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES",
        "MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES",
        "MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES",
        "MODEL_FOR_MASKED_LM_MAPPING_NAMES",
        "MODEL_FOR_OBJECT_DETECTION_MAPPING_NAMES",
        "MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING_NAMES",
    )
    names = [n for n in dir(modeling_auto) if n.startswith("MODEL_FOR_") and n.endswith("_MAPPING_NAMES")]
    ordered = [*preferred, "MODEL_MAPPING_NAMES", *sorted(set(names) - set(preferred))]
    out: list[str] = []
    for name in ordered:
        value = getattr(modeling_auto, name, {}).get(model_type)
        for cls in [value] if isinstance(value, str) else list(value or ()):
            if cls not in out:
                out.append(cls)
    return out


def candidates(key: str) -> Iterator[Candidate]:
    """The class built for one catalog key: the class itself, or a model type's head model.

    A model type's entry is written for the layout of its head model (``...ForConditionalGeneration``,
    ``...ForCausalLM``, ...), the class hub checkpoints are saved from; the base model of the
    same type loads those checkpoints through the cross-class rules tested elsewhere.
    """
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if key in CONFIG_MAPPING_NAMES:
        classes = _head_classes(key)
        # A class of this model type's own config first (shieldgemma2 also maps Gemma3's classes).
        own = [
            c
            for c in classes
            if getattr(getattr(getattr(transformers, c, None), "config_class", None), "model_type", None)
            == key
        ]
        for cls in (own or classes)[:1]:
            yield Candidate(key, cls, key)
        return
    cls = getattr(transformers, key, None)
    if cls is None:
        return
    yield Candidate(key, key, getattr(cls.config_class, "model_type", ""))


def build(candidate: Candidate, *, seed: int = 0) -> Any:
    """A random tiny model of the candidate's class, in eval mode."""
    import transformers
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = getattr(transformers, candidate.class_name)
    config_class = cls.config_class if cls.config_class is not None else CONFIG_MAPPING[candidate.model_type]
    if (
        getattr(config_class, "model_type", None) != candidate.model_type
        and candidate.model_type in CONFIG_MAPPING
    ):
        # A model type served by another family's classes (exaone by Llama's, sarvam_moe by
        # GLM-4-MoE's): its own config, so that the model carries its model_type and mapping.
        config_class = CONFIG_MAPPING[candidate.model_type]
    config = tiny_config(config_class, **OVERRIDES.get(candidate.model_type, {}))
    with torch.device("meta"):
        probe = cls(config)
    count = sum(p.numel() for p in probe.parameters())
    if count > MAX_PARAMETERS:
        largest = sorted(((p.numel(), n) for n, p in probe.named_parameters()), reverse=True)[:4]
        raise ValueError(f"{candidate.class_name} is not tiny: {count:,} parameters, largest {largest}")
    torch.manual_seed(seed)
    model = cls(config).eval()
    _randomize(model, seed)
    return model


def reseeded(model: torch.nn.Module, seed: int) -> Any:
    """A copy of a model :func:`build` made, holding what ``build(candidate, seed=seed)`` holds.

    ``build`` constructs twice (a ``meta`` probe, then the model) and every floating parameter and
    persistent buffer is then drawn from the seed; the rest (integer buffers, non-persistent
    buffers such as rotary frequencies) does not depend on it. Copying and drawing again gives the
    same tensors without constructing the model a third and fourth time.
    """
    import copy

    twin = copy.deepcopy(model)
    _randomize(twin, seed)
    return twin


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Every floating parameter and persistent buffer drawn from ``seed``.

    Init leaves norms at 1, biases and layer scales at 0: identical in every model, so a mapping
    that swapped two of them would still compare equal.
    """
    g = torch.Generator().manual_seed(seed)
    tensors = list(model.parameters())
    for module in model.modules():
        tensors += [
            b
            for name, b in module._buffers.items()
            if b is not None and name not in module._non_persistent_buffers_set and b.is_floating_point()
        ]
    seen: set[int] = set()
    with torch.no_grad():
        for t in tensors:
            if id(t) in seen or not t.is_floating_point():
                continue
            seen.add(id(t))
            t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
