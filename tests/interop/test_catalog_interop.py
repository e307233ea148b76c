"""Interop: the built-in catalog loads what transformers' own loader loads, and saves it back.

For every catalog family transformers ships, a tiny random model is saved by transformers in the
original (hub) layout. Then:

* ``surgery.load_checkpoint`` into a fresh model gives exactly transformers' ``from_pretrained``
  state dict (keys, values, dtypes) with a clean report;
* ``surgery.save_checkpoint`` writes exactly the original file's tensors back;
* a checkpoint already in runtime layout loads with no transform firing and saves unchanged.

Where transformers' fresh ``save_pretrained`` leaves out a :class:`PrefixChange` (CLIP/SigLIP
towers, the tower inside Llava-style models), the hub layout is forced the way transformers
itself does after loading a hub checkpoint: ``model._weight_conversions`` set to the model's
full mapping before saving.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from surgery.patterns import escape_dots

transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402
from transformers.conversion_mapping import get_model_conversion_mapping as hf_conversion_mapping  # noqa: E402

from specs import (  # noqa: E402
    FAMILIES,
)
from specs.releases import entries_for, installed_release, release_tuple  # noqa: E402
from surgery.load.loader import load_checkpoint  # noqa: E402
from surgery.registry import checkpoint_conversion_entry, load_catalogs, registry_snapshot  # noqa: E402
from surgery.save import save_checkpoint  # noqa: E402

pytestmark = pytest.mark.interop

T = transformers


@pytest.fixture(scope="module", autouse=True)
def catalog() -> Iterator[None]:
    """The installed catalog (loaded through its entry point), restored afterwards."""
    T.logging.set_verbosity_error()
    T.utils.logging.disable_progress_bar()
    with registry_snapshot():
        load_catalogs()
        missing = [
            k
            for fam in FAMILIES
            for k in (*fam.ENTRIES, *fam.ALIASES)
            if checkpoint_conversion_entry(k) is None
        ]
        assert not missing, f"the installed catalog lacks {missing[:5]}"
        yield


# --------------------------------------------------------------------------- tiny models

_LM = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=1,
    max_position_embeddings=64,
)
_TXT = dict(_LM, vocab_size=128)
_MOE = dict(_LM, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
_MLA = dict(kv_lora_rank=8, q_lora_rank=8, qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=4)
_VISION = dict(
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
_TEXT_TOWER = dict(
    vocab_size=64,
    hidden_size=16,
    intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=2,
    max_position_embeddings=32,
)
_MROPE = {"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}


def _clip_vision() -> Any:
    return T.CLIPVisionConfig(**_VISION)


def _siglip_vision() -> Any:
    return T.SiglipVisionConfig(**_VISION)


def _qwen2_vl_config() -> Any:
    return T.Qwen2VLConfig(
        text_config=dict(model_type="qwen2_vl_text", **_TXT, rope_parameters=_MROPE),
        vision_config=dict(
            depth=2,
            embed_dim=16,
            hidden_size=16,
            num_heads=2,
            mlp_ratio=2,
            in_channels=3,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
    )


def _qwen2_5_vl_config() -> Any:
    return T.Qwen2_5_VLConfig(
        text_config=dict(model_type="qwen2_5_vl_text", **_TXT, rope_parameters=_MROPE),
        vision_config=dict(
            depth=2,
            hidden_size=16,
            out_hidden_size=16,
            intermediate_size=32,
            num_heads=2,
            in_channels=3,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            fullatt_block_indexes=[1],
            window_size=16,
        ),
        image_token_id=100,
        video_token_id=101,
        vision_start_token_id=102,
    )


def _llava_config() -> Any:
    return T.LlavaConfig(vision_config=_clip_vision(), text_config=T.LlamaConfig(**_TXT), image_token_id=100)


def _dinov2_config(**kw: Any) -> Any:
    return T.Dinov2Config(**_VISION, use_swiglu_ffn=True, **kw)


def _detr_config() -> Any:
    backbone = T.ResNetConfig(
        num_channels=3,
        embedding_size=8,
        hidden_sizes=[8, 8, 16, 16],
        depths=[1, 1, 1, 1],
        layer_type="basic",
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    return T.DetrConfig(
        backbone_config=backbone,
        d_model=16,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=8,
        decoder_attention_heads=8,
        num_queries=5,
    )


def _maskformer_config() -> Any:
    swin = T.SwinConfig(
        image_size=32,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 2, 2],
        window_size=2,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    decoder = T.DetrConfig(
        d_model=32,
        encoder_layers=1,
        decoder_layers=1,
        encoder_ffn_dim=32,
        decoder_ffn_dim=32,
        encoder_attention_heads=2,
        decoder_attention_heads=2,
        num_queries=5,
        use_timm_backbone=False,
        backbone_config=T.ResNetConfig(
            hidden_sizes=[8, 8, 8, 8], depths=[1, 1, 1, 1], embedding_size=8, layer_type="basic"
        ),
    )
    return T.MaskFormerConfig(
        backbone_config=swin, decoder_config=decoder, fpn_feature_size=32, mask_feature_size=32, num_labels=3
    )


def _ernie_config() -> Any:
    text = dict(
        _TXT,
        moe_num_experts=4,
        moe_k=2,
        moe_num_shared_experts=1,
        moe_intermediate_size=[8, 4],
        rope_parameters={"rope_type": "default", "rope_theta": 500000.0, "mrope_section": [1, 1, 2]},
    )
    vision = dict(
        depth=1,
        hidden_size=16,
        num_heads=2,
        intermediate_size=32,
        patch_size=4,
        spatial_merge_size=2,
        temporal_merge_size=2,
    )
    return T.Ernie4_5_VLMoeConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=100,
        video_token_id=101,
        image_start_token_id=102,
        image_end_token_id=103,
        video_start_token_id=104,
        video_end_token_id=105,
    )


@dataclass(frozen=True)
class Spec:
    """A tiny model and how transformers writes its original checkpoint.

    Attributes:
        id: test id.
        build: builds a fresh random model.
        hub_layout: force transformers to write the full hub layout (see the module docstring).
    """

    id: str
    build: Callable[[], Any]
    hub_layout: bool = False


SPECS: tuple[Spec, ...] = (
    # Mixtral
    Spec(
        "mixtral",
        lambda: T.MixtralForCausalLM(T.MixtralConfig(**_LM, num_local_experts=4, num_experts_per_tok=2)),
    ),
    Spec(
        "minimax",
        lambda: T.MiniMaxForCausalLM(
            T.MiniMaxConfig(
                **_LM,
                num_local_experts=4,
                num_experts_per_tok=2,
                head_dim=8,
                layer_types=["full_attention", "full_attention"],
            )
        ),
    ),
    Spec(
        "minimax_m2",
        lambda: T.MiniMaxM2ForCausalLM(
            T.MiniMaxM2Config(**_LM, num_local_experts=4, num_experts_per_tok=2, head_dim=8)
        ),
    ),
    # Qwen2-MoE layout
    Spec(
        "qwen2_moe",
        lambda: T.Qwen2MoeForCausalLM(T.Qwen2MoeConfig(**_MOE, shared_expert_intermediate_size=16)),
    ),
    Spec("qwen3_moe", lambda: T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(**_MOE, head_dim=8))),
    Spec("olmoe", lambda: T.OlmoeForCausalLM(T.OlmoeConfig(**_MOE, eos_token_id=None))),
    Spec(
        "deepseek_v3",
        lambda: T.DeepseekV3ForCausalLM(
            T.DeepseekV3Config(
                **dict(_LM, num_key_value_heads=2),
                moe_intermediate_size=8,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_shared_experts=1,
                n_group=1,
                topk_group=1,
                first_k_dense_replace=1,
                **_MLA,
            )
        ),
    ),
    Spec(
        "deepseek_v2",
        lambda: T.DeepseekV2ForCausalLM(
            T.DeepseekV2Config(
                **dict(_LM, num_key_value_heads=2),
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                **_MLA,
            )
        ),
    ),
    Spec(
        "glm4_moe",
        lambda: T.Glm4MoeForCausalLM(
            T.Glm4MoeConfig(
                **dict(_LM, num_key_value_heads=2),
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                n_shared_experts=1,
                first_k_dense_replace=1,
                n_group=1,
                topk_group=1,
                head_dim=8,
            )
        ),
    ),
    Spec(
        "hunyuan_v1_moe",
        lambda: T.HunYuanMoEV1ForCausalLM(T.HunYuanMoEV1Config(**_LM, num_experts=4, moe_topk=2, head_dim=8)),
    ),
    Spec(
        "qwen3_next",
        lambda: T.Qwen3NextForCausalLM(
            T.Qwen3NextConfig(**_MOE, head_dim=8, layer_types=["full_attention", "full_attention"])
        ),
    ),
    Spec("cohere2_moe", lambda: T.Cohere2MoeForCausalLM(T.Cohere2MoeConfig(**_MOE))),
    Spec(
        "ernie4_5_moe",
        lambda: T.Ernie4_5_MoeForCausalLM(
            T.Ernie4_5_MoeConfig(
                **_LM, moe_num_experts=4, moe_k=2, moe_intermediate_size=8, moe_num_shared_experts=1
            )
        ),
    ),
    Spec("exaone_moe", lambda: T.ExaoneMoeForCausalLM(T.ExaoneMoeConfig(**_MOE))),
    Spec("kolibri1", lambda: T.Kolibri1ForCausalLM(T.Kolibri1Config(**_MOE))),
    Spec(
        "mimo_v2_flash",
        lambda: T.MiMoV2FlashForCausalLM(
            T.MiMoV2FlashConfig(**_LM, n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=8)
        ),
    ),
    Spec("flint", lambda: T.FlintForCausalLM(T.FlintConfig(**_MOE, mlp_only_layers=[0]))),
    Spec("hy_v3", lambda: T.HYV3ForCausalLM(T.HYV3Config(**_MOE))),
    Spec("laguna", lambda: T.LagunaForCausalLM(T.LagunaConfig(**_MOE))),
    Spec(
        "axk1",
        lambda: T.AXK1ForCausalLM(
            T.AXK1Config(
                **_LM,
                n_routed_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=8,
                bos_token_id=None,
                eos_token_id=None,
            )
        ),
    ),
    # Llava-style VLMs
    Spec("llava", lambda: T.LlavaForConditionalGeneration(_llava_config()), hub_layout=True),
    Spec("llava-partial-tower-layout", lambda: T.LlavaForConditionalGeneration(_llava_config())),
    Spec("LlavaModel", lambda: T.LlavaModel(_llava_config()), hub_layout=True),
    Spec(
        "gemma3",
        lambda: T.Gemma3ForConditionalGeneration(
            T.Gemma3Config(
                vision_config=_siglip_vision(),
                text_config=T.Gemma3TextConfig(**_TXT, head_dim=8, sliding_window=16),
                mm_tokens_per_image=4,
                image_token_index=100,
                boi_token_index=101,
                eoi_token_index=102,
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "mistral3",
        lambda: T.Mistral3ForConditionalGeneration(
            T.Mistral3Config(
                vision_config=T.PixtralVisionConfig(**_VISION, head_dim=8),
                text_config=T.MistralConfig(**_TXT, head_dim=8),
                image_token_index=100,
                spatial_merge_size=2,
            )
        ),
    ),
    Spec(
        "paligemma",
        lambda: T.PaliGemmaForConditionalGeneration(
            T.PaliGemmaConfig(
                vision_config=_siglip_vision(),
                text_config=T.GemmaConfig(**_TXT, head_dim=8),
                image_token_index=100,
                projection_dim=16,
                hidden_size=16,
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "internvl",
        lambda: T.InternVLForConditionalGeneration(
            T.InternVLConfig(
                vision_config=T.InternVLVisionConfig(**dict(_VISION, image_size=[32, 32], patch_size=[8, 8])),
                text_config=T.Qwen2Config(**_TXT),
                image_token_id=100,
            )
        ),
    ),
    Spec(
        "vipllava",
        lambda: T.VipLlavaForConditionalGeneration(
            T.VipLlavaConfig(
                vision_config=_clip_vision(),
                text_config=T.LlamaConfig(**_TXT),
                image_token_index=100,
                vision_feature_layers=[-2, -1],
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "aya_vision",
        lambda: T.AyaVisionForConditionalGeneration(
            T.AyaVisionConfig(
                vision_config=_siglip_vision(),
                text_config=T.Cohere2Config(**_TXT),
                image_token_index=100,
                downsample_factor=2,
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "got_ocr2",
        lambda: T.GotOcr2ForConditionalGeneration(
            T.GotOcr2Config(
                vision_config=dict(
                    hidden_size=16,
                    output_channels=16,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    image_size=32,
                    patch_size=8,
                    mlp_dim=32,
                    global_attn_indexes=[1],
                ),
                text_config=T.Qwen2Config(**_TXT),
                image_token_index=100,
            )
        ),
    ),
    Spec(
        "llava_next",
        lambda: T.LlavaNextForConditionalGeneration(
            T.LlavaNextConfig(
                vision_config=_clip_vision(),
                text_config=T.LlamaConfig(**_TXT),
                image_token_index=100,
                image_grid_pinpoints=[[32, 32]],
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "llava_onevision",
        lambda: T.LlavaOnevisionForConditionalGeneration(
            T.LlavaOnevisionConfig(
                vision_config=_siglip_vision(),
                text_config=T.Qwen2Config(**_TXT),
                image_token_index=100,
                video_token_index=101,
                image_grid_pinpoints=[[32, 32]],
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "video_llava",
        lambda: T.VideoLlavaForConditionalGeneration(
            T.VideoLlavaConfig(
                vision_config=_clip_vision(),
                text_config=T.LlamaConfig(**_TXT),
                image_token_index=100,
                video_token_index=101,
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "fuyu",
        lambda: T.FuyuForCausalLM(
            T.FuyuConfig(
                vocab_size=128,
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                patch_size=4,
                max_position_embeddings=64,
                text_config=dict(
                    model_type="persimmon",
                    vocab_size=128,
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    max_position_embeddings=64,
                ),
            )
        ),
    ),
    Spec(
        "mllama",
        lambda: T.MllamaForConditionalGeneration(
            T.MllamaConfig(
                vision_config=dict(
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=2,
                    num_global_layers=1,
                    num_attention_heads=2,
                    image_size=16,
                    patch_size=8,
                    max_num_tiles=2,
                    intermediate_layers_indices=[0],
                    vision_output_dim=32,
                    supported_aspect_ratios=[[1, 1], [1, 2]],
                ),
                text_config=dict(
                    vocab_size=128,
                    hidden_size=16,
                    intermediate_size=32,
                    num_hidden_layers=2,
                    num_attention_heads=2,
                    num_key_value_heads=1,
                    cross_attention_layers=[1],
                    max_position_embeddings=64,
                    pad_token_id=0,
                ),
                image_token_index=100,
            )
        ),
    ),
    # Qwen2-VL
    Spec("qwen2_vl", lambda: T.Qwen2VLForConditionalGeneration(_qwen2_vl_config())),
    Spec("qwen2_5_vl", lambda: T.Qwen2_5_VLForConditionalGeneration(_qwen2_5_vl_config())),
    # CLIP / SigLIP towers
    Spec("CLIPVisionModel", lambda: T.CLIPVisionModel(_clip_vision()), hub_layout=True),
    Spec("CLIPTextModel", lambda: T.CLIPTextModel(T.CLIPTextConfig(**_TEXT_TOWER)), hub_layout=True),
    Spec("SiglipVisionModel", lambda: T.SiglipVisionModel(_siglip_vision()), hub_layout=True),
    Spec("SiglipTextModel", lambda: T.SiglipTextModel(T.SiglipTextConfig(**_TEXT_TOWER)), hub_layout=True),
    Spec(
        "Siglip2VisionModel",
        lambda: T.Siglip2VisionModel(
            T.Siglip2VisionConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                patch_size=8,
                num_patches=16,
            )
        ),
        hub_layout=True,
    ),
    Spec(
        "ChineseCLIPVisionModel",
        lambda: T.ChineseCLIPVisionModel(T.ChineseCLIPVisionConfig(**_VISION)),
        hub_layout=True,
    ),
    Spec(
        "MetaClip2TextModel",
        lambda: T.MetaClip2TextModel(T.MetaClip2TextConfig(**_TEXT_TOWER)),
        hub_layout=True,
    ),
    # ViT family
    Spec("ViTModel", lambda: T.ViTModel(T.ViTConfig(**_VISION))),
    Spec(
        "ViTForImageClassification", lambda: T.ViTForImageClassification(T.ViTConfig(**_VISION, num_labels=3))
    ),
    Spec("BeitModel", lambda: T.BeitModel(T.BeitConfig(**_VISION, use_relative_position_bias=True))),
    Spec(
        "BeitModel-shared-bias",
        lambda: T.BeitModel(T.BeitConfig(**_VISION, use_shared_relative_position_bias=True)),
    ),
    Spec("DeiTModel", lambda: T.DeiTModel(T.DeiTConfig(**_VISION))),
    Spec("IJepaModel", lambda: T.IJepaModel(T.IJepaConfig(**_VISION))),
    Spec("ViTMAEModel", lambda: T.ViTMAEModel(T.ViTMAEConfig(**_VISION))),
    Spec(
        "VivitModel",
        lambda: T.VivitModel(
            T.VivitConfig(
                hidden_size=16,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                image_size=16,
                num_frames=4,
                tubelet_size=[2, 8, 8],
            )
        ),
    ),
    # DINOv2
    Spec("Dinov2Model", lambda: T.Dinov2Model(_dinov2_config())),
    Spec("Dinov2Backbone", lambda: T.Dinov2Backbone(_dinov2_config(out_features=["stage2"]))),
    Spec(
        "Dinov2ForImageClassification", lambda: T.Dinov2ForImageClassification(_dinov2_config(num_labels=3))
    ),
    Spec(
        "Dinov2WithRegistersModel",
        lambda: T.Dinov2WithRegistersModel(T.Dinov2WithRegistersConfig(**_VISION, use_swiglu_ffn=True)),
    ),
    # DETR
    Spec("DetrModel", lambda: T.DetrModel(_detr_config())),
    Spec("DetrForObjectDetection", lambda: T.DetrForObjectDetection(_detr_config())),
    Spec("DetrForSegmentation", lambda: T.DetrForSegmentation(_detr_config())),
    Spec("MaskFormerModel", lambda: T.MaskFormerModel(_maskformer_config())),
    # Ernie 4.5 VL MoE
    Spec("ernie4_5_vl_moe", lambda: T.Ernie4_5_VLMoeForConditionalGeneration(_ernie_config())),
)


# --------------------------------------------------------------------------- helpers


def _read(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want), (sorted(set(got) - set(want))[:5], sorted(set(want) - set(got))[:5])
    for k, t in want.items():
        assert got[k].dtype == t.dtype, (k, got[k].dtype, t.dtype)
        assert torch.equal(got[k], t), k


def _fresh(spec: Spec) -> Any:
    torch.manual_seed(1)  # different values from the saved model: a skipped tensor shows
    return spec.build().eval()


@dataclass
class Saved:
    spec: Spec
    original: Path
    runtime: Path
    reference: dict[str, torch.Tensor]


@pytest.fixture(scope="module", params=SPECS, ids=[s.id for s in SPECS])
def saved(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Saved:
    """A transformers-written original checkpoint, its runtime-layout twin, and the reference state."""
    spec: Spec = request.param
    torch.manual_seed(0)
    model = spec.build().eval()
    if spec.hub_layout:
        model._weight_conversions = hf_conversion_mapping(model, add_legacy=False)
    root = tmp_path_factory.mktemp(spec.id)
    model.save_pretrained(root / "original")
    reference, info = type(model).from_pretrained(root / "original", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference.save_pretrained(root / "runtime", save_original_format=False)
    return Saved(spec, root / "original", root / "runtime", reference.state_dict())


# --------------------------------------------------------------------------- tests


def test_load_gives_the_state_dict_transformers_loads(saved: Saved) -> None:
    model = _fresh(saved.spec)
    report = load_checkpoint(model, saved.original)
    assert report.ok, str(report)
    _assert_same_tensors(model.state_dict(), saved.reference)


def _family_layout(saved: Saved) -> dict[str, torch.Tensor]:
    """The checkpoint in the family's hub layout: a variant layout has its tower prefix put back."""
    original = _read(saved.original)
    if saved.spec.id != "llava-partial-tower-layout":
        return original
    return {
        (
            k.replace("vision_tower.", "vision_tower.vision_model.", 1)
            if k.startswith("vision_tower.")
            else k
        ): v
        for k, v in original.items()
    }


def test_save_writes_the_original_checkpoint_back(saved: Saved, tmp_path: Path) -> None:
    """Bit for bit for a hub-layout checkpoint; a variant layout comes back in the hub layout."""
    model = _fresh(saved.spec)
    load_checkpoint(model, saved.original, strict=True)
    save_checkpoint(model, tmp_path / "out")
    _assert_same_tensors(_read(tmp_path / "out"), _family_layout(saved))


def test_runtime_layout_checkpoint_loads_with_nothing_converted(saved: Saved) -> None:
    model = _fresh(saved.spec)
    report = load_checkpoint(model, saved.runtime)
    assert report.ok, str(report)
    assert not report.transforms_used, report.transforms_used
    _assert_same_tensors(model.state_dict(), saved.reference)


def test_every_way_in_saves_the_same_original_layout(saved: Saved, tmp_path: Path) -> None:
    """Original format is the family's layout: from the hub file, the runtime file, or load_state_dict."""
    want = _family_layout(saved)
    from_runtime = _fresh(saved.spec)
    load_checkpoint(from_runtime, saved.runtime, strict=True)
    save_checkpoint(from_runtime, tmp_path / "from-runtime")
    _assert_same_tensors(_read(tmp_path / "from-runtime"), want)
    by_state_dict = _fresh(saved.spec)
    by_state_dict.load_state_dict(saved.reference, strict=False)
    save_checkpoint(by_state_dict, tmp_path / "from-state-dict")
    _assert_same_tensors(_read(tmp_path / "from-state-dict"), want)


# --------------------------------------------------------------------------- across classes


@dataclass(frozen=True)
class Cross:
    """A checkpoint written by one class, loaded into another (base model ↔ model with a head)."""

    id: str
    source: Callable[[], Any]
    target: Callable[[], Any]
    hub_layout: bool = False


CROSS: tuple[Any, ...] = (
    Cross(
        "MixtralModel<-MixtralForCausalLM",
        lambda: T.MixtralForCausalLM(T.MixtralConfig(**_LM, num_local_experts=4, num_experts_per_tok=2)),
        lambda: T.MixtralModel(T.MixtralConfig(**_LM, num_local_experts=4, num_experts_per_tok=2)),
    ),
    Cross(
        "MixtralForCausalLM<-MixtralModel",
        lambda: T.MixtralModel(T.MixtralConfig(**_LM, num_local_experts=4, num_experts_per_tok=2)),
        lambda: T.MixtralForCausalLM(T.MixtralConfig(**_LM, num_local_experts=4, num_experts_per_tok=2)),
    ),
    Cross(
        "ViTForImageClassification<-ViTModel",
        lambda: T.ViTModel(T.ViTConfig(**_VISION)),
        lambda: T.ViTForImageClassification(T.ViTConfig(**_VISION, num_labels=3)),
    ),
    Cross(
        "Dinov2ForImageClassification<-Dinov2Model",
        lambda: T.Dinov2Model(_dinov2_config()),
        lambda: T.Dinov2ForImageClassification(_dinov2_config(num_labels=3)),
    ),
    Cross(
        "LlavaModel<-LlavaForConditionalGeneration",
        lambda: T.LlavaForConditionalGeneration(_llava_config()),
        lambda: T.LlavaModel(_llava_config()),
        hub_layout=True,
    ),
    Cross(
        "CLIPVisionModel<-CLIPModel",
        lambda: T.CLIPModel(T.CLIPConfig(vision_config=_VISION, text_config=_TEXT_TOWER, projection_dim=16)),
        lambda: T.CLIPVisionModel(T.CLIPVisionConfig(**_VISION)),
    ),
    pytest.param(
        Cross(
            "Qwen2VLModel<-Qwen2VLForConditionalGeneration",
            lambda: T.Qwen2VLForConditionalGeneration(_qwen2_vl_config()),
            lambda: T.Qwen2VLModel(_qwen2_vl_config()),
        ),
    ),
)


def _cross_id(c: Any) -> str:
    return c.id


@pytest.mark.parametrize("case", CROSS, ids=_cross_id)
def test_cross_class_load_matches_transformers(case: Cross, tmp_path: Path) -> None:
    torch.manual_seed(0)
    source = case.source().eval()
    if case.hub_layout:
        source._weight_conversions = hf_conversion_mapping(source, add_legacy=False)
    source.save_pretrained(tmp_path)
    target = case.target().eval()
    reference, info = type(target).from_pretrained(tmp_path, output_loading_info=True)
    report = load_checkpoint(target, tmp_path)
    assert sorted(report.unexpected_keys) == sorted(info["unexpected_keys"])
    assert sorted(report.missing_keys) == sorted(info["missing_keys"])
    assert not report.mismatched and not report.conversion_errors, str(report)
    want = reference.state_dict()
    got = target.state_dict()
    for k in report.loaded_keys:
        assert torch.equal(got[k], want[k]), k


# --------------------------------------------------------------------------- the entries themselves

# Where a catalog entry deliberately differs from transformers' list (the family module and
# docs/catalog.md say why): key -> {transformers' source or target pattern: ours}.
ADAPTED_PATTERNS: dict[str, dict[str, str]] = {
    key: adapted for fam in FAMILIES for key, adapted in getattr(fam, "ADAPTED_PATTERNS", {}).items()
}
# transformers' names for the same thing.
_RENAMED_OPS = {"ErnieFuseAndSplitTextVisionExperts": "FuseAndSplitTextVisionExperts"}
_RENAMED_TRANSFORMS = {
    "GroupWeightRename": "WeightRenaming",
    "Inkling2IndexOffsetWeightRename": "IndexOffsetRenaming",
}


def _their_target(pattern: str) -> str:
    """transformers inserts a target as literal text, so ``\\.`` or a leading ``^`` there is a slip of
    the pen for ``.`` (keys never hold either); ours are written as plain key text."""
    return pattern.replace("\\.", ".").removeprefix("^")


def _signature(kind: str, sources: Any, targets: Any, ops: Any) -> tuple[Any, ...]:
    return (kind, tuple(sources), tuple(targets), tuple(_RENAMED_OPS.get(o, o) for o in ops))


OMITTED: dict[str, list[str]] = {
    key: srcs for fam in FAMILIES for key, srcs in getattr(fam, "OMITTED", {}).items()
}
RENAMED_PREFIXES: dict[str, dict[str, str]] = {
    key: renamed for fam in FAMILIES for key, renamed in getattr(fam, "RENAMED_PREFIXES", {}).items()
}
QUANTIZED_COMPANIONS: dict[str, list[str]] = {
    key: srcs for fam in FAMILIES for key, srcs in getattr(fam, "QUANTIZED_COMPANIONS", {}).items()
}
EXTENDED: dict[str, str] = {
    key: release for fam in FAMILIES for key, release in getattr(fam, "EXTENDED", {}).items()
}
REKEYED: dict[str, str] = {
    key: theirs for fam in FAMILIES for key, theirs in getattr(fam, "REKEYED", {}).items()
}


@pytest.fixture(scope="module")
def their_mapping() -> dict[str, Any]:
    """transformers' conversion mapping of the installed release, built once for the module (each
    build makes every transform object afresh; the tests only read them)."""
    from transformers import conversion_mapping

    build = getattr(conversion_mapping, "_build_checkpoint_conversion_mapping", None)
    if build is None:
        pytest.skip("this transformers version has no _build_checkpoint_conversion_mapping")
    return build()


def _theirs(key: str, theirs: dict[str, Any]) -> list[tuple[Any, ...]]:
    if REKEYED.get(key, key) not in theirs:
        pytest.skip(f"transformers {transformers.__version__} has no {key!r} (a later release added it)")
    out = []
    omitted = OMITTED.get(key, [])
    for t in theirs[REKEYED.get(key, key)]:
        if any(p in omitted for p in getattr(t, "_original_source_patterns", ())):
            continue
        renamed = RENAMED_PREFIXES.get(key, {})
        if type(t).__name__ == "PrefixChange" and not t.model_prefix and t.prefix_to_remove in renamed:
            # The hub's name of the base model: renamed to ours, not stripped (the family module says why).
            prefix = t.prefix_to_remove
            out.append(
                _signature("WeightRenaming", [f"^{escape_dots(prefix)}\\."], [f"{renamed[prefix]}."], [])
            )
            continue
        if type(t).__name__ == "PrefixChange":  # compare by what it adds/removes, not its generated regex
            out.append(("PrefixChange", t.prefix_to_add, t.prefix_to_remove, t.model_prefix or None))
            continue
        adapted = ADAPTED_PATTERNS.get(key, {})
        # Ours escape the dots between key components (only canonical spellings load).
        companions = QUANTIZED_COMPANIONS.get(key, [])
        sources = [escape_dots(adapted.get(s, s)) for s in t._original_source_patterns if s not in companions]
        targets = [adapted.get(p, _their_target(p)) for p in t._original_target_patterns]
        ops = [type(o).__name__ for o in (getattr(t, "operations", None) or [])]
        kind = _RENAMED_TRANSFORMS.get(type(t).__name__, type(t).__name__)
        out.append(_signature(kind, sources, targets, ops))
    return out


def _ours(transforms: list[Any]) -> list[tuple[Any, ...]]:
    out = []
    for t in transforms:
        if type(t).__name__ == "PrefixChange":
            out.append(("PrefixChange", t.prefix_to_add, t.prefix_to_remove, t.model_prefix))
            continue
        ops = [type(o).__name__ for o in getattr(t, "operations", ())]
        out.append(_signature(type(t).__name__, t.source_patterns, t.target_patterns, ops))
    return out


_ENTRIES = [
    (key, transforms)
    for fam in FAMILIES
    for key, transforms in entries_for(fam, installed_release()).items()  # the installed release's lists
]
_ALIASES = [(alias, target) for fam in FAMILIES for alias, target in fam.ALIASES.items()]


@pytest.mark.parametrize(("key", "transforms"), _ENTRIES, ids=[k for k, _ in _ENTRIES])
def test_entry_holds_the_transforms_transformers_registers(
    key: str, transforms: list[Any], their_mapping: dict[str, Any]
) -> None:
    # Same transforms in the same order, renamings and converters each (renamings always run
    # before converters, and our lists put them first).
    def split(sigs: list[tuple[Any, ...]]) -> tuple[list[str], list[str]]:
        converters = [repr(x) for x in sigs if x[0] == "WeightConverter"]
        return [repr(x) for x in sigs if x[0] != "WeightConverter"], converters

    ours, theirs = split(_ours(transforms)), split(_theirs(key, their_mapping))
    extended_in = EXTENDED.get(key)
    if extended_in is not None and release_tuple(transformers.__version__) < release_tuple(extended_in):
        # Ours is a later release's longer list: this release's transforms appear in it, in order.
        for mine, its in zip(ours, theirs):
            rest = iter(mine)
            assert all(x in rest for x in its), (key, [x for x in its if x not in mine])
        return
    assert ours == theirs


@pytest.mark.parametrize(("alias", "target"), _ALIASES, ids=[a for a, _ in _ALIASES])
def test_alias_points_where_transformers_points(alias: str, target: str) -> None:
    from transformers import conversion_mapping

    aliases = getattr(conversion_mapping, "_MODEL_TO_CONVERSION_PATTERN", None)
    if aliases is None:
        pytest.skip("this transformers version has no _MODEL_TO_CONVERSION_PATTERN")
    if alias not in aliases and alias not in conversion_mapping._build_checkpoint_conversion_mapping():
        pytest.skip(f"transformers {transformers.__version__} has no {alias!r} (a later release added it)")
    assert aliases.get(alias) == target


# --------------------------------------------------------------------------- the release guard

NOT_CARRIED: dict[str, str] = {}
"""Keys of transformers' conversion mapping the catalog deliberately leaves out, and why."""


def test_the_catalog_has_every_key_of_the_installed_release() -> None:
    """Run under a new transformers release, this names every key it added that the catalog lacks.

    With the entry and alias tests above (every entry holds transformers' transforms for the key,
    every alias points where transformers points, except the listed deliberate differences), this
    is the release guard: a release passes when the catalog maps all of it.
    """
    from transformers import conversion_mapping

    theirs = set(conversion_mapping._build_checkpoint_conversion_mapping())
    theirs |= set(getattr(conversion_mapping, "_MODEL_TO_CONVERSION_PATTERN", {}))
    theirs.discard("legacy")  # surgery.transforms.legacy_renamings applies to every model
    ours = {REKEYED.get(k, k) for fam in FAMILIES for k in (*fam.ENTRIES, *fam.ALIASES)}
    missing = sorted(theirs - ours - set(NOT_CARRIED))
    assert not missing, (
        f"transformers {transformers.__version__} registers {len(missing)} key(s) the catalog lacks: "
        f"{', '.join(missing)}. Map each in its family module under specs/ (tests/interop/"
        "test_every_family_interop.py then round-trips it), or list it in NOT_CARRIED with the reason."
    )


def test_not_carried_keys_are_absent_from_the_catalog() -> None:
    ours = {k for fam in FAMILIES for k in (*fam.ENTRIES, *fam.ALIASES)}
    assert not set(NOT_CARRIED) & ours, sorted(set(NOT_CARRIED) & ours)
