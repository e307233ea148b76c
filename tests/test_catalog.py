"""The built-in catalog (``specs/``): every entry constructs, reverses and converts exactly.

No transformers needed: each family is exercised on a synthetic checkpoint in its original
layout (key names and shapes as transformers' hub checkpoints have them), with transform lists
scoped the way resolution scopes them for the model class named in the case.
"""

from __future__ import annotations

import functools
import gzip
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specs
from specs import (
    audio,
    clip,
    decoders,
    dense_vision,
    detection,
    detr,
    dinov2,
    encoders,
    ernie4_5_vl_moe,
    inkling2,
    llava,
    mixtral,
    qwen2_moe,
    qwen2_vl,
    qwen_omni,
    register_family,
    vision_language,
    vit,
    vit_heads,
)
from specs.releases import NEWEST, PINNED, entries_for
from surgery import ConversionError, WeightConverter
from surgery.converter import Collector
from surgery.ops import OpContext, Slot
from surgery.registry import (
    checkpoint_conversion_entry,
    get_checkpoint_conversion_mapping,
    list_checkpoint_conversion_keys,
    register_catalog_modules,
    registering_catalog,
    registry_snapshot,
)
from surgery.routing import route_keys
from surgery.transforms import WeightTransform

FAMILIES = (
    mixtral,
    qwen2_moe,
    llava,
    qwen2_vl,
    qwen_omni,
    clip,
    vit,
    dinov2,
    detr,
    ernie4_5_vl_moe,
    decoders,
    vision_language,
    audio,
    detection,
    dense_vision,
    vit_heads,
    encoders,
    inkling2,
)
CATALOG_MODULES = ("transformers", "surgery.examples")


@pytest.fixture(scope="module", autouse=True)
def catalog() -> Iterator[None]:
    """A registry holding exactly the catalog families, registered as the built-in catalog."""
    with registry_snapshot(clear=True):
        with registering_catalog("builtin"):
            register_catalog_modules(*CATALOG_MODULES)
            for family in FAMILIES:
                register_family(family, release=PINNED)  # the release the layouts were recorded under
        yield


def _all_entries() -> list[tuple[str, str]]:
    return [(fam.__name__.split(".")[-1], key) for fam in FAMILIES for key in fam.ENTRIES]


def _all_aliases() -> list[tuple[str, str]]:
    return [(alias, target) for fam in FAMILIES for alias, target in fam.ALIASES.items()]


# --------------------------------------------------------------------------- synthetic checkpoints


@dataclass(frozen=True)
class Case:
    """A model class's resolved mapping and a checkpoint in its original layout.

    Attributes:
        id: test id.
        resolved: ``(registry key, scope)`` per sub-model, in resolution order.
        original: original checkpoint key → shape.
        runtime: the runtime key → shape the original layout must become.
    """

    id: str
    resolved: tuple[tuple[str, str], ...]
    original: dict[str, tuple[int, ...]]
    runtime: dict[str, tuple[int, ...]]
    extra_original: dict[str, tuple[int, ...]] = field(default_factory=dict)
    release: str = PINNED

    def transforms(self) -> list[WeightTransform]:
        out: list[WeightTransform] = []
        for key, scope in self.resolved:
            out.extend(t.scoped(scope) for t in _mapping(key, self.release))
        return out


def _mapping(key: str, release: str) -> list[WeightTransform]:
    """The key's list for ``release`` (the registry holds the pinned release's lists)."""
    entry = checkpoint_conversion_entry(key)
    target = entry.alias if entry is not None and entry.alias is not None else key
    for fam in FAMILIES:
        if target in getattr(fam, "BEFORE", {}):
            return [t.copy() for t in entries_for(fam, release)[target]]
    return get_checkpoint_conversion_mapping(key)


H = 4  # hidden size of every synthetic model


def _experts(prefix: str, names: dict[str, tuple[int, ...]], n: int) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}.{e}.{name}": shape for e in range(n) for name, shape in names.items()}


def _mixtral_case(
    id_: str,
    key: str,
    extra: dict[str, tuple[int, ...]] | None = None,
    extra_runtime: dict[str, tuple[int, ...]] | None = None,
) -> Case:
    e, i = 4, 6
    original = {
        "model.embed_tokens.weight": (10, H),
        "model.layers.0.self_attn.q_proj.weight": (H, H),
        "model.layers.0.block_sparse_moe.gate.weight": (e, H),
        **_experts(
            "model.layers.0.block_sparse_moe.experts",
            {"w1.weight": (i, H), "w3.weight": (i, H), "w2.weight": (H, i)},
            e,
        ),
        "lm_head.weight": (10, H),
        **(extra or {}),
    }
    runtime = {
        "model.embed_tokens.weight": (10, H),
        "model.layers.0.self_attn.q_proj.weight": (H, H),
        "model.layers.0.mlp.gate.weight": (e, H),
        "model.layers.0.mlp.experts.gate_up_proj": (e, 2 * i, H),
        "model.layers.0.mlp.experts.down_proj": (e, H, i),
        "lm_head.weight": (10, H),
        **(extra_runtime or {}),
    }
    return Case(id_, ((key, ""),), original, runtime)


def _qwen2_moe_case(
    id_: str,
    key: str,
    *,
    n_experts: int = 4,
    extra: dict[str, tuple[int, ...]] | None = None,
    extra_runtime: dict[str, tuple[int, ...]] | None = None,
    router: str = "mlp.gate",
) -> Case:
    i = 2
    original = {
        "model.layers.0.mlp.gate_proj.weight": (8, H),  # a dense layer: untouched
        f"model.layers.1.{router}.weight": (n_experts, H),
        **_experts(
            "model.layers.1.mlp.experts",
            {"gate_proj.weight": (i, H), "up_proj.weight": (i, H), "down_proj.weight": (H, i)},
            n_experts,
        ),
        **(extra or {}),
    }
    runtime = {
        "model.layers.0.mlp.gate_proj.weight": (8, H),
        "model.layers.1.mlp.gate.weight": (n_experts, H),
        "model.layers.1.mlp.experts.gate_up_proj": (n_experts, 2 * i, H),
        "model.layers.1.mlp.experts.down_proj": (n_experts, H, i),
        **(extra_runtime or {}),
    }
    return Case(id_, ((key, ""),), original, runtime)


def _llava_case(
    id_: str,
    resolved: tuple[tuple[str, str], ...],
    tower: str = "vision_tower",
    extra: dict[str, str] | None = None,
) -> Case:
    names = {
        "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
        "language_model.model.layers.0.self_attn.q_proj.weight": "model.language_model.layers.0.self_attn.q_proj.weight",
        "language_model.model.norm.weight": "model.language_model.norm.weight",
        "language_model.lm_head.weight": "lm_head.weight",
        f"{tower}.vision_model.embeddings.patch_embedding.weight": f"model.{tower}.embeddings.patch_embedding.weight",
        f"{tower}.vision_model.post_layernorm.weight": f"model.{tower}.post_layernorm.weight",
        "multi_modal_projector.linear_1.weight": "model.multi_modal_projector.linear_1.weight",
        **(extra or {}),
    }
    return Case(id_, resolved, dict.fromkeys(names, (H, H)), dict.fromkeys(names.values(), (H, H)))


def _renames(id_: str, resolved: tuple[tuple[str, str], ...], names: dict[str, str]) -> Case:
    return Case(id_, resolved, dict.fromkeys(names, (H, H)), dict.fromkeys(names.values(), (H, H)))


_E_TXT, _I_TXT, _I_VIS = 4, 4, 2
_ERNIE_ORIGINAL = {
    "model.embed_tokens.weight": (10, H),
    "model.norm.weight": (H,),
    "model.layers.0.mlp.gate_proj.weight": (8, H),
    "model.layers.1.self_attn.q_proj.weight": (H, H),
    "model.layers.1.mlp.gate.weight": (H, _E_TXT),
    "model.layers.1.mlp.gate.weight_1": (H, _E_TXT),
    "model.layers.1.mlp.moe_statics.e_score_correction_bias": (2, _E_TXT),
    "model.layers.1.mlp.shared_experts.gate_proj.weight": (8, H),
    **_experts(
        "model.layers.1.mlp.experts",
        {"gate_proj.weight": (_I_TXT, H), "up_proj.weight": (_I_TXT, H), "down_proj.weight": (H, _I_TXT)},
        _E_TXT,
    ),
    **{
        f"model.layers.1.mlp.experts.{e}.{name}": shape
        for e in range(_E_TXT, 2 * _E_TXT)
        for name, shape in {
            "gate_proj.weight": (_I_VIS, H),
            "up_proj.weight": (_I_VIS, H),
            "down_proj.weight": (H, _I_VIS),
        }.items()
    },
    "model.vision_model.blocks.0.norm1.weight": (H,),
    "model.vision_model.ln.weight": (H,),
    "model.resampler_model.spatial_linear.0.weight": (H, H),
    "model.resampler_model.spatial_linear.3.weight": (H,),
    "model.resampler_model.temporal_linear.2.weight": (H, H),
    "model.resampler_model.after_norm.weight": (H,),
    "lm_head.weight": (10, H),
}
_ERNIE_RUNTIME = {
    "model.language_model.embed_tokens.weight": (10, H),
    "model.language_model.norm.weight": (H,),
    "model.language_model.layers.0.mlp.gate_proj.weight": (8, H),
    "model.language_model.layers.1.self_attn.q_proj.weight": (H, H),
    "model.language_model.layers.1.mlp.text_moe.gate.weight": (_E_TXT, H),
    "model.language_model.layers.1.mlp.vision_moe.gate.weight": (_E_TXT, H),
    "model.language_model.layers.1.mlp.text_moe.gate.moe_statics.e_score_correction_bias": (1, _E_TXT),
    "model.language_model.layers.1.mlp.vision_moe.gate.moe_statics.e_score_correction_bias": (1, _E_TXT),
    "model.language_model.layers.1.mlp.shared_experts.gate_proj.weight": (8, H),
    "model.language_model.layers.1.mlp.text_moe.experts.gate_up_proj": (_E_TXT, 2 * _I_TXT, H),
    "model.language_model.layers.1.mlp.text_moe.experts.down_proj": (_E_TXT, H, _I_TXT),
    "model.language_model.layers.1.mlp.vision_moe.experts.gate_up_proj": (_E_TXT, 2 * _I_VIS, H),
    "model.language_model.layers.1.mlp.vision_moe.experts.down_proj": (_E_TXT, H, _I_VIS),
    "model.vision_tower.blocks.0.norm1.weight": (H,),
    "model.vision_tower.ln.weight": (H,),
    "model.resampler_model.spatial_linear.fc1.weight": (H, H),
    "model.resampler_model.spatial_linear.ln.weight": (H,),
    "model.resampler_model.temporal_linear.fc2.weight": (H, H),
    "model.resampler_model.after_norm.weight": (H,),
    "lm_head.weight": (10, H),
}

_VIT_NAMES = {
    "embeddings.cls_token": "embeddings.cls_token",
    "encoder.layer.0.attention.attention.query.weight": "layers.0.attention.q_proj.weight",
    "encoder.layer.0.attention.attention.key.bias": "layers.0.attention.k_proj.bias",
    "encoder.layer.0.attention.attention.value.weight": "layers.0.attention.v_proj.weight",
    "encoder.layer.0.attention.output.dense.weight": "layers.0.attention.o_proj.weight",
    "encoder.layer.0.intermediate.dense.weight": "layers.0.mlp.fc1.weight",
    "encoder.layer.0.output.dense.bias": "layers.0.mlp.fc2.bias",
    "encoder.layer.11.layernorm_before.weight": "layers.11.layernorm_before.weight",
    "layernorm.weight": "layernorm.weight",
}

_F = 6  # DINOv2 SwiGLU hidden size
_DINOV2_ORIGINAL = {
    "embeddings.register_tokens": (1, 2, H),
    "encoder.layer.0.attention.attention.query.weight": (H, H),
    "encoder.layer.0.attention.attention.value.bias": (H,),
    "encoder.layer.0.attention.output.dense.weight": (H, H),
    "encoder.layer.0.mlp.weights_in.weight": (2 * _F, H),
    "encoder.layer.0.mlp.weights_in.bias": (2 * _F,),
    "encoder.layer.0.mlp.weights_out.weight": (H, _F),
    "encoder.layer.0.layer_scale1.lambda1": (H,),
}
_DINOV2_RUNTIME = {
    "embeddings.register_tokens": (1, 2, H),
    "encoder.layer.0.attention.q_proj.weight": (H, H),
    "encoder.layer.0.attention.v_proj.bias": (H,),
    "encoder.layer.0.attention.o_proj.weight": (H, H),
    "encoder.layer.0.mlp.gate_proj.weight": (_F, H),
    "encoder.layer.0.mlp.up_proj.weight": (_F, H),
    "encoder.layer.0.mlp.gate_proj.bias": (_F,),
    "encoder.layer.0.mlp.up_proj.bias": (_F,),
    "encoder.layer.0.mlp.down_proj.weight": (H, _F),
    "encoder.layer.0.layer_scale1.lambda1": (H,),
}


def _prefixed(prefix: str, d: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    return {f"{prefix}{k}": v for k, v in d.items()}


_DETR_NAMES = {
    "backbone.conv_encoder.model.embedder.embedder.convolution.weight": "backbone.model.embedder.embedder.convolution.weight",
    "input_projection.weight": "input_projection.weight",
    "encoder.layers.0.self_attn.out_proj.weight": "encoder.layers.0.self_attn.o_proj.weight",
    "encoder.layers.0.self_attn.q_proj.weight": "encoder.layers.0.self_attn.q_proj.weight",
    "encoder.layers.0.fc1.weight": "encoder.layers.0.mlp.fc1.weight",
    "decoder.layers.0.encoder_attn.out_proj.bias": "decoder.layers.0.encoder_attn.o_proj.bias",
    "decoder.layers.10.fc2.weight": "decoder.layers.10.mlp.fc2.weight",
    "query_position_embeddings.weight": "query_position_embeddings.weight",
}

CASES: tuple[Case, ...] = (
    _mixtral_case("mixtral", "mixtral"),
    _mixtral_case("minimax", "minimax"),
    _mixtral_case(
        "minimax_m2",
        "minimax_m2",
        extra={"model.layers.0.block_sparse_moe.e_score_correction_bias": (4,)},
        extra_runtime={"model.layers.0.mlp.e_score_correction_bias": (4,)},
    ),
    _qwen2_moe_case(
        "qwen2_moe-12-experts",
        "qwen2_moe",
        n_experts=12,
        extra={
            "model.layers.1.mlp.shared_expert.gate_proj.weight": (8, H),
            "model.layers.1.mlp.shared_expert_gate.weight": (1, H),
        },
        extra_runtime={
            "model.layers.1.mlp.shared_expert.gate_proj.weight": (8, H),
            "model.layers.1.mlp.shared_expert_gate.weight": (1, H),
        },
    ),
    _qwen2_moe_case("qwen3_moe", "qwen3_moe"),
    _qwen2_moe_case("olmoe", "olmoe"),
    _qwen2_moe_case(
        "deepseek_v3",
        "deepseek_v3",
        extra={
            "model.layers.1.mlp.gate.e_score_correction_bias": (4,),
            "model.layers.1.mlp.shared_experts.up_proj.weight": (8, H),
        },
        extra_runtime={
            "model.layers.1.mlp.gate.e_score_correction_bias": (4,),
            "model.layers.1.mlp.shared_experts.up_proj.weight": (8, H),
        },
    ),
    _qwen2_moe_case(
        "ernie4_5_moe",
        "ernie4_5_moe",
        extra={"model.layers.1.mlp.moe_statics.e_score_correction_bias": (1, 4)},
        extra_runtime={"model.layers.1.mlp.gate.moe_statics.e_score_correction_bias": (1, 4)},
    ),
    _qwen2_moe_case(
        "exaone_moe",
        "exaone_moe",
        extra={"model.layers.1.mlp.e_score_correction_bias": (4,)},
        extra_runtime={"model.layers.1.mlp.gate.e_score_correction_bias": (4,)},
    ),
    _qwen2_moe_case(
        "kolibri1",
        "kolibri1",
        extra={
            "model.layers.1.moe.router.expert_bias": (4,),
            "model.layers.1.post_attn_norm.weight": (H,),
            "model.layers.1.post_ffn_norm.weight": (H,),
        },
        extra_runtime={
            "model.layers.1.mlp.gate.e_score_correction_bias": (4,),
            "model.layers.1.post_self_attn_layernorm.weight": (H,),
            "model.layers.1.post_mlp_layernorm.weight": (H,),
        },
    ),
    _qwen2_moe_case(
        "mimo_v2_flash",
        "mimo_v2_flash",
        extra={"model.layers.1.self_attn.attention_sink_bias": (2,)},
        extra_runtime={"model.layers.1.self_attn.sinks": (2,)},
    ),
    _qwen2_moe_case(
        "flint",
        "flint",
        extra={"model.layers.1.self_attn.softmax_offset": (2,)},
        extra_runtime={"model.layers.1.self_attn.sinks": (2,)},
    ),
    _qwen2_moe_case(
        "hy_v3",
        "hy_v3",
        router="mlp.router.gate",
        extra={
            "model.layers.1.mlp.expert_bias": (4,),
            "model.layers.1.mlp.shared_mlp.down_proj.weight": (H, 8),
        },
        extra_runtime={
            "model.layers.1.mlp.e_score_correction_bias": (4,),
            "model.layers.1.mlp.shared_experts.down_proj.weight": (H, 8),
        },
    ),
    _qwen2_moe_case(
        "laguna",
        "laguna",
        extra={
            "model.layers.1.mlp.experts.e_score_correction_bias": (4,),
            "model.layers.1.mlp.shared_expert.gate_proj.weight": (8, H),
        },
        extra_runtime={
            "model.layers.1.mlp.gate.e_score_correction_bias": (4,),
            "model.layers.1.mlp.shared_experts.gate_proj.weight": (8, H),
        },
    ),
    _qwen2_moe_case(
        "axk1",
        "axk1",
        extra={"model.layers.1.post_mlp_layernorm.weight": (H,)},
        extra_runtime={"model.layers.1.mlp.post_mlp_layernorm.weight": (H,)},
    ),
    _llava_case(
        "llava-ForConditionalGeneration",
        (("llava", ""), ("LlavaModel", "model"), ("CLIPVisionModel", "model.vision_tower")),
    ),
    _llava_case(
        "gemma3-ForConditionalGeneration",
        (("gemma3", ""), ("Gemma3Model", "model"), ("SiglipVisionModel", "model.vision_tower")),
        extra={
            "multi_modal_projector.mm_input_projection_weight": "model.multi_modal_projector.mm_input_projection_weight"
        },
    ),
    _llava_case(
        "llava_onevision-ForConditionalGeneration",
        (
            ("llava_onevision", ""),
            ("LlavaOnevisionModel", "model"),
            ("SiglipVisionModel", "model.vision_tower"),
        ),
        extra={"image_newline": "model.image_newline"},
    ),
    _renames(
        "qwen3-omni-thinker-alone",  # a thinker loaded from the whole omni checkpoint
        (("Qwen3OmniMoeThinkerForConditionalGeneration", ""),),
        {
            "thinker.audio_tower.conv2d1.weight": "model.audio_tower.conv2d1.weight",
            "thinker.visual.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
            "thinker.model.layers.0.self_attn.q_proj.weight": "model.language_model.layers.0.self_attn.q_proj.weight",
            "thinker.lm_head.weight": "lm_head.weight",
        },
    ),
    _renames(
        "qwen2_5-omni-thinker-in-omni",  # scoped inside the omni model: nothing to strip
        (("qwen2_5_omni_thinker", "thinker"),),
        {
            "thinker.audio_tower.conv1.weight": "thinker.model.audio_tower.conv1.weight",
            "thinker.visual.blocks.0.attn.qkv.weight": "thinker.model.visual.blocks.0.attn.qkv.weight",
            "thinker.model.norm.weight": "thinker.model.language_model.norm.weight",
            "thinker.lm_head.weight": "thinker.lm_head.weight",
        },
    ),
    _renames(
        "llava-partial-tower-layout",  # what transformers' own save_pretrained writes by default
        (("llava", ""), ("LlavaModel", "model"), ("CLIPVisionModel", "model.vision_tower")),
        {
            "vision_tower.embeddings.patch_embedding.weight": "model.vision_tower.embeddings.patch_embedding.weight",
            "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
        },
    ),
    _renames(
        "LlavaModel",
        (("LlavaModel", ""), ("CLIPVisionModel", "vision_tower")),
        {
            "language_model.model.layers.0.mlp.up_proj.weight": "language_model.layers.0.mlp.up_proj.weight",
            "vision_tower.vision_model.embeddings.patch_embedding.weight": "vision_tower.embeddings.patch_embedding.weight",
            "multi_modal_projector.linear_2.bias": "multi_modal_projector.linear_2.bias",
        },
    ),
    _renames(
        "video_llava-ForConditionalGeneration",
        (
            ("video_llava", ""),
            ("VideoLlavaModel", "model"),
            ("CLIPVisionModel", "model.image_tower"),
            ("CLIPVisionModel", "model.video_tower"),
        ),
        {
            "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
            "language_model.lm_head.weight": "lm_head.weight",
            "image_tower.vision_model.post_layernorm.weight": "model.image_tower.post_layernorm.weight",
            "video_tower.vision_model.post_layernorm.weight": "model.video_tower.post_layernorm.weight",
            "multi_modal_projector.linear_1.weight": "model.multi_modal_projector.linear_1.weight",
        },
    ),
    _renames(
        "fuyu-ForCausalLM",
        (("fuyu", ""), ("FuyuModel", "model")),
        {
            "language_model.model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
            "language_model.lm_head.weight": "lm_head.weight",
            "vision_embed_tokens.weight": "model.vision_embed_tokens.weight",
        },
    ),
    _renames(
        "mllama-ForConditionalGeneration",
        (("mllama", ""), ("MllamaModel", "model")),
        {
            "language_model.model.layers.1.cross_attn.q_proj.weight": "model.language_model.layers.1.cross_attn.q_proj.weight",
            "language_model.lm_head.weight": "lm_head.weight",
            "vision_model.patch_embedding.weight": "model.vision_model.patch_embedding.weight",
            "multi_modal_projector.weight": "model.multi_modal_projector.weight",
        },
    ),
    _renames(
        "qwen2_vl-ForConditionalGeneration",
        (("Qwen2VLForConditionalGeneration", ""), ("Qwen2VLModel", "model")),
        {
            "model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
            "model.layers.1.input_layernorm.weight": "model.language_model.layers.1.input_layernorm.weight",
            "model.norm.weight": "model.language_model.norm.weight",
            "visual.patch_embed.proj.weight": "model.visual.patch_embed.proj.weight",
            "visual.merger.mlp.0.weight": "model.visual.merger.mlp.0.weight",
            "lm_head.weight": "lm_head.weight",
        },
    ),
    _renames(
        "qwen2_5_vl-ForConditionalGeneration",
        (("Qwen2_5_VLForConditionalGeneration", ""), ("Qwen2_5_VLModel", "model")),
        {
            "model.layers.0.self_attn.q_proj.bias": "model.language_model.layers.0.self_attn.q_proj.bias",
            "visual.blocks.0.attn.qkv.weight": "model.visual.blocks.0.attn.qkv.weight",
        },
    ),
    _renames(
        "Qwen2VLModel-before-base-prefix",
        (("Qwen2VLModel", ""),),
        {
            "model.embed_tokens.weight": "model.language_model.embed_tokens.weight",
            "visual.patch_embed.proj.weight": "visual.patch_embed.proj.weight",
        },
    ),
    _renames(
        "CLIPVisionModel",
        (("CLIPVisionModel", ""),),
        {
            "vision_model.embeddings.patch_embedding.weight": "embeddings.patch_embedding.weight",
            "vision_model.encoder.layers.0.self_attn.out_proj.weight": "encoder.layers.0.self_attn.out_proj.weight",
            "vision_model.post_layernorm.weight": "post_layernorm.weight",
        },
    ),
    _renames(
        "SiglipTextModel",
        (("SiglipTextModel", ""),),
        {
            "text_model.embeddings.token_embedding.weight": "embeddings.token_embedding.weight",
            "text_model.head.weight": "head.weight",
        },
    ),
    _renames(
        "CLIPModel-towers",
        (("CLIPTextModel", "text_model"), ("CLIPVisionModel", "vision_model")),
        {
            "text_model.final_layer_norm.weight": "text_model.final_layer_norm.weight",
            "vision_model.pre_layrnorm.weight": "vision_model.pre_layrnorm.weight",
            "logit_scale": "logit_scale",
        },
    ),
    _renames("ViTModel", (("ViTModel", ""),), _VIT_NAMES),
    _renames(
        "ViTForImageClassification",
        (("ViTModel", "vit"),),
        {**{f"vit.{k}": f"vit.{v}" for k, v in _VIT_NAMES.items()}, "classifier.weight": "classifier.weight"},
    ),
    _renames("DeiTModel", (("DeiTModel", ""),), _VIT_NAMES),
    _renames(
        "BeitModel",
        (("BeitModel", ""),),
        {
            **_VIT_NAMES,
            "encoder.layer.0.attention.attention.relative_position_bias.relative_position_bias_table": "layers.0.relative_position_bias.relative_position_bias_table",
            "encoder.relative_position_bias.relative_position_bias_table": "shared_position_bias.relative_position_bias_table",
        },
    ),
    Case("Dinov2Model", (("Dinov2Model", ""),), _DINOV2_ORIGINAL, _DINOV2_RUNTIME),
    Case("Dinov2Backbone", (("Dinov2Backbone", ""),), _DINOV2_ORIGINAL, _DINOV2_RUNTIME),
    Case("Dinov2WithRegistersModel", (("Dinov2WithRegistersModel", ""),), _DINOV2_ORIGINAL, _DINOV2_RUNTIME),
    Case(
        "Dinov2ForImageClassification",
        (("Dinov2Model", "dinov2"),),
        {**_prefixed("dinov2.", _DINOV2_ORIGINAL), "classifier.weight": (3, 2 * H)},
        {**_prefixed("dinov2.", _DINOV2_RUNTIME), "classifier.weight": (3, 2 * H)},
    ),
    _renames("DetrModel", (("DetrModel", ""),), _DETR_NAMES),
    _renames(
        "DetrForObjectDetection",
        (("DetrModel", "model"),),
        {
            **{f"model.{k}": f"model.{v}" for k, v in _DETR_NAMES.items()},
            "class_labels_classifier.weight": "class_labels_classifier.weight",
        },
    ),
    _renames(
        "DetrForSegmentation",
        (("DetrForSegmentation", ""), ("DetrModel", "detr.model")),
        {
            **{f"detr.model.{k}": f"detr.model.{v}" for k, v in _DETR_NAMES.items()},
            "detr.bbox_predictor.layers.0.weight": "detr.bbox_predictor.layers.0.weight",
            "bbox_attention.q_linear.weight": "bbox_attention.q_proj.weight",
            "bbox_attention.k_linear.bias": "bbox_attention.k_proj.bias",
            "mask_head.lay1.weight": "mask_head.conv1.conv.weight",
            "mask_head.gn2.bias": "mask_head.conv2.norm.bias",
            "mask_head.adapter1.weight": "mask_head.fpn_stages.0.fpn_adapter.weight",
            "mask_head.lay4.weight": "mask_head.fpn_stages.1.refine.conv.weight",
            "mask_head.gn5.weight": "mask_head.fpn_stages.2.refine.norm.weight",
            "mask_head.out_lay.weight": "mask_head.output_conv.weight",
        },
    ),
    _renames(
        "ConditionalDetrForSegmentation-head",
        (("ConditionalDetrForSegmentation", ""),),
        {
            "bbox_attention.k_linear.weight": "bbox_attention.k_proj.weight",
            "mask_head.gn1.weight": "mask_head.conv1.norm.weight",
            "mask_head.adapter3.bias": "mask_head.fpn_stages.2.fpn_adapter.bias",
            "mask_head.lay3.weight": "mask_head.fpn_stages.0.refine.conv.weight",
        },
    ),
    _renames(
        "MaskFormerModel",
        (("maskformer", ""), ("MaskFormerDetrDecoder", "transformer_module.decoder")),
        {
            "transformer_module.decoder.layers.0.fc1.weight": "transformer_module.decoder.layers.0.mlp.fc1.weight",
            "transformer_module.decoder.layers.0.self_attn.out_proj.weight": "transformer_module.decoder.layers.0.self_attn.o_proj.weight",
            "pixel_level_module.encoder.model.encoder.layers.0.blocks.0.attention.self.query.weight": "pixel_level_module.encoder.model.encoder.layers.0.blocks.0.attention.self.query.weight",
        },
    ),
    Case(
        "Ernie4_5_VLMoeForConditionalGeneration", (("ernie4_5_vl_moe", ""),), _ERNIE_ORIGINAL, _ERNIE_RUNTIME
    ),
)


def _recorded() -> tuple[Case, ...]:
    """Every family's layout as transformers writes it, recorded by tests/interop/record_layouts.py:
    all of them under the pinned release, and under the newest the families it added or changed.

    The hub file's keys and shapes, the runtime keys and shapes the file fills, and the registry
    key each sub-model resolved to: the layouts as transformers writes them (put into the hub layout
    where its save is known to be wrong), checked against transformers' own loader by the generated
    interop test when they were recorded.
    """
    data = Path(__file__).resolve().parent / "data"
    cases: list[Case] = []
    for file, release, tag in (
        ("catalog_layouts.json.gz", PINNED, ""),
        ("catalog_layouts_newest.json.gz", NEWEST, f"@{NEWEST}"),
    ):
        layouts = json.loads(gzip.decompress((data / file).read_bytes()))
        cases.extend(
            Case(
                f"recorded-{name}{tag}",
                tuple((key, scope) for key, scope in layout["resolved"]),
                {k: tuple(v) for k, v in layout["original"].items()},
                {k: tuple(v) for k, v in layout["runtime"].items()},
                release=release,
            )
            for name, layout in sorted(layouts.items())
        )
    return tuple(cases)


RECORDED = _recorded()
ALL_CASES = CASES + RECORDED


def _ids(cases: tuple[Case, ...]) -> list[str]:
    return [c.id for c in cases]


# --------------------------------------------------------------------------- engine helpers


def _random(shapes: dict[str, tuple[int, ...]], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {k: torch.randn(shape, generator=g) for k, shape in shapes.items()}


class _OneHeadConfig:
    """A stand-in for the model config the loader hands the ops: every head count is 1.

    ``PermuteForRope(config_attribute=...)`` needs one; the head count changes neither the shapes
    nor the exactness of the round trip (the reverse reads the same count), and the interop tests
    check the real permutation against transformers. ``*_config`` steps lead back here.
    """

    def __getattr__(self, name: str) -> object:
        if name.startswith("_"):
            raise AttributeError(name)
        return self if name.endswith("_config") else 1


_CONFIG = _OneHeadConfig()


def _to_runtime(
    tensors: dict[str, torch.Tensor],
    transforms: list[WeightTransform],
    shapes: dict[str, tuple[int, ...]] | None = None,
    residues: dict[str, torch.Tensor] | None = None,
) -> tuple[dict[str, torch.Tensor], list[WeightTransform]]:
    """Route and convert an original-layout checkpoint; also return the transforms that fired.

    ``shapes`` (the runtime shapes) stand in for the model's parameters, as the target shapes
    the loader gives the ops (``Split(sizes=None)`` reads them). What an op drops goes into
    ``residues`` under the group's smallest runtime key, as a load records it.
    """
    shapes = shapes or {}
    routing = route_keys(list(tensors), transforms)
    assert not routing.conflicts, routing.conflicts
    out: dict[str, torch.Tensor] = {}
    for group in routing.groups.values():
        if group.converter is None:
            (src,) = group.source_keys
            out[group.key] = tensors[src]
            continue
        conv = transforms[group.converter]
        assert isinstance(conv, WeightConverter)
        collector = Collector(conv)
        for pattern, by_index in group.sources.items():
            for index, src in by_index.items():
                collector.add_tensor(group.key, src, pattern, tensors[src], index=index)
        targets = conv.expand_target_keys(group.key)
        keep = None if residues is None else functools.partial(residues.__setitem__, min(targets))
        ctx = OpContext(
            target_shapes=tuple(shapes.get(k) for k in targets), config=_CONFIG, keep_residue=keep
        )
        out.update(collector.convert(group.key, ctx))
    return out, [transforms[i] for i in routing.fired()]


def _to_original(
    tensors: dict[str, torch.Tensor],
    fired: list[WeightTransform],
    shapes: dict[str, tuple[int, ...]] | None = None,
    residues: dict[str, torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Invert like a save: reversed converters on runtime keys, then reversed renamings in reverse order.

    ``shapes`` (the checkpoint's shapes) stand in for the shapes a save recorded at load, as the
    target shapes the reversed ops get (``Inkling2UnpadVocab`` pads back to them); ``residues``
    for what the load recorded as dropped (its padding rows).
    """
    converters = [t.reverse_transform() for t in fired if isinstance(t, WeightConverter)]
    renamings = [t.reverse_transform() for t in reversed(fired) if not isinstance(t, WeightConverter)]
    routing = route_keys(list(tensors), converters)
    assert not routing.conflicts, routing.conflicts
    produced: dict[str, torch.Tensor] = {}
    for group in routing.groups.values():
        if group.converter is None:
            (src,) = group.source_keys
            produced[src] = tensors[src]
            continue
        conv = converters[group.converter]
        assert isinstance(conv, WeightConverter)
        collector = Collector(conv)
        for pattern, by_index in group.sources.items():
            for index, src in by_index.items():
                collector.add_tensor(group.key, src, pattern, tensors[src], index=index)
        names = [_renamed(k, renamings) for k in conv.expand_target_keys(group.key)]
        target_shapes = tuple((shapes or {}).get(k) for k in names)
        residue = (residues or {}).get(min(group.source_keys))
        ctx = OpContext(config=_CONFIG, target_shapes=target_shapes, residue=residue)
        produced.update(collector.convert(group.key, ctx))
    out: dict[str, torch.Tensor] = {}
    for key, t in produced.items():
        key = _renamed(key, renamings)
        assert key not in out, f"two tensors reverted to {key!r}"
        out[key] = t
    return out


def _renamed(key: str, renamings: list[WeightTransform]) -> str:
    for r in renamings:
        key, _ = r.rename_source_key(key)
    return key


# --------------------------------------------------------------------------- structure


def test_every_family_module_declares_entries_and_aliases() -> None:
    for fam in FAMILIES:
        assert isinstance(fam.ENTRIES, dict) and fam.ENTRIES, fam.__name__
        assert isinstance(fam.ALIASES, dict), fam.__name__
        assert set(fam.__all__) >= {"ENTRIES", "ALIASES"}, fam.__name__


def test_no_key_is_declared_by_two_families() -> None:
    keys = [k for fam in FAMILIES for k in (*fam.ENTRIES, *fam.ALIASES)]
    assert len(keys) == len(set(keys)), sorted(k for k in keys if keys.count(k) > 1)


def test_registering_the_families_registers_exactly_their_keys() -> None:
    declared = {k for fam in FAMILIES for k in (*fam.ENTRIES, *fam.ALIASES)}
    assert set(list_checkpoint_conversion_keys()) == declared


def test_catalog_entries_belong_to_the_builtin_catalog() -> None:
    for fam in FAMILIES:
        for key in (*fam.ENTRIES, *fam.ALIASES):
            entry = checkpoint_conversion_entry(key)
            assert entry is not None and entry.catalog == "builtin", key


def test_the_installed_builtin_catalog_registers_every_family() -> None:
    """``specs.register_catalog`` (the entry point) registers every family, the examples' included."""
    with registry_snapshot(clear=True):
        with registering_catalog("builtin"):
            specs.register_catalog()
        registered = set(list_checkpoint_conversion_keys())
    families = (*FAMILIES, *specs.EXAMPLE_FAMILIES)
    assert registered == {k for fam in families for k in (*fam.ENTRIES, *fam.ALIASES)}
    assert specs.FAMILIES == FAMILIES


def test_registered_prototypes_are_unscoped_and_handed_out_as_copies() -> None:
    for _, key in _all_entries():
        first, second = get_checkpoint_conversion_mapping(key), get_checkpoint_conversion_mapping(key)
        assert all(t.scope_prefix is None for t in first), key
        assert all(a is not b for a, b in zip(first, second)), key


# --------------------------------------------------------------------------- reversal


@pytest.mark.parametrize(("family", "key"), _all_entries(), ids=[k for _, k in _all_entries()])
def test_every_transform_of_an_entry_reverses(family: str, key: str) -> None:
    for t in get_checkpoint_conversion_mapping(key):
        back = t.reverse_transform()
        assert type(back) is type(t)
        assert len(back.source_patterns) == len(t.target_patterns)
        assert len(back.target_patterns) == len(t.source_patterns)


def _original_keys_for(key: str) -> list[str]:
    keys: set[str] = set()
    for case in ALL_CASES:
        if any(k == key or _alias_target(k) == key for k, _ in case.resolved):
            keys.update(case.original)
    return sorted(keys)


def _alias_target(key: str) -> str | None:
    entry = checkpoint_conversion_entry(key)
    return entry.alias if entry is not None else None


UNEXERCISED: dict[str, str] = {
    "MtpModel": "names no class transformers 5.23 ships (hub remote code): no layout to record",
    "timm_wrapper": "transformers needs timm and PIL to build it",
    "tipsv2_dpt": "every class of the model type has a class entry of its own, which wins over it",
}
"""Entries no hand-written case or recorded layout resolves, and why."""


@pytest.mark.parametrize(("family", "key"), _all_entries(), ids=[k for _, k in _all_entries()])
def test_reversing_twice_routes_original_keys_like_the_entry(family: str, key: str) -> None:
    keys = _original_keys_for(key)
    if key in UNEXERCISED:
        assert not keys, f"{key!r} is exercised now: remove it from UNEXERCISED"
        return
    assert keys, f"no synthetic checkpoint exercises {key!r}; add a Case"
    forward = get_checkpoint_conversion_mapping(key)
    twice = [t.reverse_transform().reverse_transform() for t in forward]
    once_routes = route_keys(keys, forward).routes
    twice_routes = route_keys(keys, twice).routes
    for k in keys:
        assert once_routes[k].target_key == twice_routes[k].target_key, k


# --------------------------------------------------------------------------- aliases


@pytest.mark.parametrize(("alias", "target"), _all_aliases(), ids=[a for a, _ in _all_aliases()])
def test_alias_resolves_to_the_mapping_of_a_registered_key(alias: str, target: str) -> None:
    entry = checkpoint_conversion_entry(target)
    assert entry is not None and entry.alias is None  # one hop: aliases point at real mappings
    got = get_checkpoint_conversion_mapping(alias)
    want = get_checkpoint_conversion_mapping(target)
    assert [repr(t) for t in got] == [repr(t) for t in want]


# --------------------------------------------------------------------------- routing and ops


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_original_keys_route_to_the_runtime_keys(case: Case) -> None:
    routing = route_keys(list(case.original), case.transforms())
    assert not routing.conflicts, routing.conflicts
    produced = {k for g in routing.groups.values() for k in g.target_keys}
    assert produced == set(case.runtime)


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_conversion_produces_the_runtime_shapes(case: Case) -> None:
    runtime, _ = _to_runtime(_random(case.original), case.transforms(), case.runtime)
    assert {k: tuple(t.shape) for k, t in runtime.items()} == case.runtime


PADDED_VOCAB = tuple(
    f"{key}@{NEWEST}" for key in ("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text")
)
"""Families whose unembedding is loaded without its padding rows (past ``unpadded_vocab_size``)."""


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_convert_then_revert_reproduces_the_checkpoint_bit_for_bit(case: Case) -> None:
    original = _random(case.original, seed=1)
    family = case.id.removeprefix("recorded-").split("/")[0] + (
        "" if case.release == PINNED else f"@{case.release}"
    )
    residues: dict[str, torch.Tensor] = {}
    runtime, fired = _to_runtime(original, case.transforms(), case.runtime, residues)
    if family in PADDED_VOCAB:  # random, so non-zero, padding rows: only the residue brings them back
        rows = case.runtime["lm_head.weight"][0]
        assert set(residues) == {"lm_head.weight"}
        assert torch.equal(residues["lm_head.weight"], original["model.llm.unembed.weight"][rows:])
    else:
        assert residues == {}, f"{family!r}: an op dropped data for {sorted(residues)}"
    back = _to_original(runtime, fired, case.original, residues)
    assert set(back) == set(original)
    for k, t in original.items():
        assert torch.equal(back[k], t), k


_UNEMBEDDING = (
    r"^lm_head\.weight$",
    "hub and runtime name the unembedding alike (5.24 on); the converter keeps the padded one's first "
    "rows, the target's row count, so a runtime-layout one passes through it unchanged",
)

RUNTIME_LAYOUT_ROUTED: dict[str, tuple[str, str]] = {
    **dict.fromkeys(
        (f"{key}@{NEWEST}" for key in ("inkling2", "inkling2_text", "inkling2_loop", "inkling2_loop_text")),
        _UNEMBEDDING,
    ),
    f"pi05@{NEWEST}": (
        r"^model\.",
        "an alias of pi0, whose entry strips `model.` from every key: save pi05 in original format",
    ),
    "pi0": (
        r"^model\.",
        "the entry strips `model.` from every key (hub files nest the whole model under it), so a "
        "runtime-layout file's `model.vlm.*` is stripped too: save pi0 in original format",
    ),
    "qwen3_vl_moe": (
        r"mlp\.experts\.(gate_up|down)_proj$",
        "hub and runtime name the fused experts alike; the converter claims both and transposes only "
        "a tensor whose shape differs from the parameter's (Transpose(when_shape_differs=True))",
    ),
}
"""Families whose runtime-layout keys (those matching the pattern) still route through a transform,
and why (docs/catalog.md lists them); every other runtime key of theirs passes through."""


@pytest.mark.parametrize("case", ALL_CASES, ids=_ids(ALL_CASES))
def test_runtime_layout_keys_pass_through_untouched(case: Case) -> None:
    routing = route_keys(list(case.runtime), case.transforms())
    family = case.id.removeprefix("recorded-").split("/")[0] + (
        "" if case.release == PINNED else f"@{case.release}"
    )
    routed = None
    if case.id.startswith("recorded-") and family in RUNTIME_LAYOUT_ROUTED:
        routed = RUNTIME_LAYOUT_ROUTED[family][0]
        touched = [
            k
            for k, r in routing.routes.items()
            if r.target_key != k or r.renamings or r.converter is not None
        ]
        assert touched, f"{family!r} passes runtime keys through now: remove it from RUNTIME_LAYOUT_ROUTED"
    for key, route in routing.routes.items():
        if routed is not None and re.search(routed, key):
            continue
        assert route.target_key == key and not route.renamings and route.converter is None, (key, route)


def test_experts_merge_in_index_order_not_string_order() -> None:
    case = next(c for c in CASES if c.id == "qwen2_moe-12-experts")
    original = _random(case.original)
    runtime, _ = _to_runtime(original, case.transforms())
    fused = runtime["model.layers.1.mlp.experts.gate_up_proj"]
    for e in range(12):
        assert torch.equal(fused[e, :2], original[f"model.layers.1.mlp.experts.{e}.gate_proj.weight"])
        assert torch.equal(fused[e, 2:], original[f"model.layers.1.mlp.experts.{e}.up_proj.weight"])


def test_dinov2_swiglu_split_puts_the_first_half_in_gate_proj() -> None:
    case = next(c for c in CASES if c.id == "Dinov2Model")
    original = _random(case.original)
    runtime, _ = _to_runtime(original, case.transforms())
    w = original["encoder.layer.0.mlp.weights_in.weight"]
    assert torch.equal(runtime["encoder.layer.0.mlp.gate_proj.weight"], w[:_F])
    assert torch.equal(runtime["encoder.layer.0.mlp.up_proj.weight"], w[_F:])


# --------------------------------------------------------------------------- ernie 4.5 VL experts


def test_ernie_split_sends_the_first_half_of_the_experts_to_text() -> None:
    case = next(c for c in CASES if c.id.startswith("Ernie"))
    original = _random(case.original)
    runtime, _ = _to_runtime(original, case.transforms())
    pre = "model.language_model.layers.1.mlp."
    src = "model.layers.1.mlp."
    for e in range(_E_TXT):
        text, vision = e, _E_TXT + e
        assert torch.equal(
            runtime[pre + "text_moe.experts.gate_up_proj"][e, :_I_TXT],
            original[f"{src}experts.{text}.gate_proj.weight"],
        )
        assert torch.equal(
            runtime[pre + "text_moe.experts.gate_up_proj"][e, _I_TXT:],
            original[f"{src}experts.{text}.up_proj.weight"],
        )
        assert torch.equal(
            runtime[pre + "vision_moe.experts.down_proj"][e],
            original[f"{src}experts.{vision}.down_proj.weight"],
        )
    assert torch.equal(runtime[pre + "text_moe.gate.weight"], original[src + "gate.weight"].T)
    assert torch.equal(runtime[pre + "vision_moe.gate.weight"], original[src + "gate.weight_1"].T)
    bias = original[src + "moe_statics.e_score_correction_bias"]
    assert torch.equal(runtime[pre + "vision_moe.gate.moe_statics.e_score_correction_bias"], bias[1:])


@settings(max_examples=40, deadline=None)
@given(
    n_per_part=st.integers(1, 4),
    parts=st.integers(1, 3),
    sources=st.integers(1, 3),
    rows=st.integers(1, 3),
    cols=st.integers(1, 3),
    dims=st.sampled_from([(0, 1), (0, 2), (1, 0), (2, 1)]),
)
def test_ernie_expert_ops_are_exact_inverses(
    n_per_part: int, parts: int, sources: int, rows: int, cols: int, dims: tuple[int, int]
) -> None:
    stack_dim, concat_dim = dims
    op = ernie4_5_vl_moe.FuseAndSplitTextVisionExperts(stack_dim=stack_dim, concat_dim=concat_dim)
    g = torch.Generator().manual_seed(n_per_part * 100 + parts * 10 + sources)
    slots: list[Slot] = [
        [torch.randn(rows, cols, generator=g) for _ in range(n_per_part * parts)] for _ in range(sources)
    ]
    fused = op.convert(slots, OpContext(n_targets=parts))
    assert len(fused) == parts
    back = op.reverse_op.convert(fused, OpContext(n_targets=sources))
    assert len(back) == sources
    for got, want in zip(back, slots):
        assert isinstance(got, list) and isinstance(want, list)
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want))
    assert op.reverse_op.reverse_op == op


def test_ernie_split_refuses_an_expert_count_it_cannot_halve() -> None:
    op = ernie4_5_vl_moe.FuseAndSplitTextVisionExperts()
    with pytest.raises(ConversionError, match="equal groups"):
        op.convert([[torch.zeros(2, 2)] * 3], OpContext(n_targets=2))


def test_ernie_split_needs_expert_lists() -> None:
    op = ernie4_5_vl_moe.FuseAndSplitTextVisionExperts()
    with pytest.raises(ConversionError, match="gathered by"):
        op.convert([torch.zeros(2, 2)], OpContext(n_targets=2))


def test_ernie_decouple_refuses_lists_and_uneven_pieces() -> None:
    op = ernie4_5_vl_moe.SplitAndDecoupleTextVisionExperts()
    with pytest.raises(ConversionError, match="got a list"):
        op.convert([[torch.zeros(2, 2)]], OpContext(n_targets=1))
    with pytest.raises(ConversionError, match="equal pieces"):
        op.convert([torch.zeros(2, 3, 2)], OpContext(n_targets=2))


def test_ernie_expert_ops_support_many_to_many() -> None:
    assert ernie4_5_vl_moe.FuseAndSplitTextVisionExperts.supports_many_to_many
    assert ernie4_5_vl_moe.SplitAndDecoupleTextVisionExperts.supports_many_to_many


def test_catalog_patterns_need_no_target_regex() -> None:
    """Targets are templates: no capture groups or regex syntax beyond ``\\N``, ``*`` and ``\\.``."""
    for _, key in _all_entries():
        for t in get_checkpoint_conversion_mapping(key):
            for target in t.target_patterns:
                plain = re.sub(r"\(\?<?[!=][^)]*\)", "", target)  # look-arounds guard the reversed source
                assert not re.search(r"[()\[\]|+?{}$]", plain), (key, target)


def test_docs_catalog_is_generated_and_states_its_coverage() -> None:
    text = (Path(__file__).resolve().parents[1] / "docs" / "catalog.md").read_text()
    assert "Generated by `python docs/make_catalog.py`" in text
    m = re.search(r"Coverage \(transformers [\d.]+\): (\d+) of (\d+) entries, (\d+) of (\d+) aliases", text)
    assert m is not None, "docs/catalog.md lost its coverage line"
    covered_entries, entries, covered_aliases, aliases = map(int, m.groups())
    assert covered_entries <= entries and covered_aliases <= aliases
    registered = sum(len(f.ENTRIES) + len(f.ALIASES) for f in FAMILIES)
    assert registered >= covered_entries + covered_aliases  # every covered key is registered here
    for family in (*RUNTIME_LAYOUT_ROUTED, *UNEXERCISED):
        assert f"`{family}`" in text, f"docs/catalog.md does not mention {family!r}"


# --------------------------------------------------------------------------- canonical spellings


def _all_source_patterns() -> list[tuple[str, str]]:
    out = []
    for fam in specs.FAMILIES:
        for key, transforms in fam.ENTRIES.items():
            for t in transforms:
                out.extend((key, p) for p in getattr(t, "source_patterns", ()))
    return out


def test_catalog_source_patterns_escape_the_dots_between_key_components() -> None:
    from surgery.patterns import escape_dots

    patterns = _all_source_patterns()
    assert len(patterns) > 1000  # every family's patterns are looked at, not an empty list
    offenders = [f"{key}: {pattern!r}" for key, pattern in patterns if escape_dots(pattern) != pattern]
    assert not offenders, "unescaped '.' between key components:\n" + "\n".join(offenders)


@pytest.mark.parametrize(
    "spelling",
    [
        "model.layers.0.block_sparse_moe.experts.3Xw2Xweight",
        "model.layers.0.block_sparse_moe.experts.3/w2.weight",
        "model.layers.0.block_sparse_moe.experts.03.w2.weight",
        "model.layers.0.block_sparse_moeXexperts.3.w2.weight",
    ],
)
def test_only_the_canonical_spelling_of_a_key_loads(tmp_path, spelling: str) -> None:
    import surgery
    from surgery.checkpoint import write_checkpoint
    from surgery.examples.moe import ExampleMoEConfig, build_moe_model, original_state_dict

    cfg = ExampleMoEConfig()
    sd = original_state_dict(build_moe_model(cfg, seed=0))
    canonical = "model.layers.0.block_sparse_moe.experts.3.w2.weight"
    sd[spelling] = sd.pop(canonical)
    write_checkpoint(sd, tmp_path)
    report = surgery.load_checkpoint(build_moe_model(cfg, seed=1), tmp_path)
    assert spelling in report.unexpected_keys
    assert not report.ok
    fused = next(e for e in report.plan.entries if e.target_keys == ("model.layers.0.mlp.experts.down_proj",))
    assert spelling not in fused.source_keys
