"""The patch_embeddings fusion on transformers' own Qwen2-VL and Qwen3-VL vision towers.

Fused class names, child names and runtime keys match transformers' fusion (``FusedPatchEmbed``,
``FusedQwen3VLVisionPatchEmbed``, ``patch_embed.linear_proj.*``), so runtime-layout checkpoints
interoperate; outputs equal the unfused towers. No global transformers state is touched.
"""

from __future__ import annotations

import copy

import pytest
import torch

from surgery.fusion import apply_fusions, fusion_transforms

transformers = pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.usefixtures("isolated_fusion_registry")]

TEXT = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=99,
    max_position_embeddings=64,
)


def qwen2_vl():
    config = transformers.Qwen2VLConfig(
        text_config={
            **TEXT,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4},
        },
        vision_config=dict(
            depth=1, embed_dim=32, hidden_size=32, num_heads=4, patch_size=14, spatial_merge_size=2
        ),
    )
    return transformers.Qwen2VLForConditionalGeneration(config)


def qwen3_vl():
    config = transformers.Qwen3VLConfig(
        text_config={
            **TEXT,
            "head_dim": 8,
            "rope_parameters": {"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4},
        },
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=32,
            out_hidden_size=32,
            num_heads=4,
            patch_size=16,
            spatial_merge_size=1,
            num_position_embeddings=16,
            deepstack_visual_indexes=[0],
        ),
    )
    return transformers.Qwen3VLForConditionalGeneration(config)


@pytest.mark.parametrize(
    ("build", "fused_name", "weight_shape", "has_bias"),
    [
        (qwen2_vl, "FusedPatchEmbed", (32, 1176), False),
        (qwen3_vl, "FusedQwen3VLVisionPatchEmbed", (32, 1536), True),
    ],
    ids=["qwen2_vl", "qwen3_vl"],
)
def test_transformers_vision_tower_fuses_like_transformers_and_keeps_its_output(
    build, fused_name, weight_shape, has_bias
):
    torch.manual_seed(0)
    ref = build().eval()
    model = copy.deepcopy(ref)
    apply_fusions(model, {"patch_embeddings": True}, strict=True)
    pe = model.model.visual.patch_embed
    assert type(pe).__name__ == fused_name
    keys = {k: tuple(v.shape) for k, v in model.state_dict().items() if ".patch_embed." in k}
    expected = {"model.visual.patch_embed.linear_proj.weight": weight_shape}
    if has_bias:
        expected["model.visual.patch_embed.linear_proj.bias"] = (32,)
    assert keys == expected
    assert {t.scope_prefix for t in fusion_transforms(model)} == {"model.visual.patch_embed"}
    vc = ref.config.vision_config
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, vc.in_channels * vc.temporal_patch_size * vc.patch_size**2)
    with torch.no_grad():
        want = ref.model.visual(pixels, grid_thw=grid).last_hidden_state
        got = model.model.visual(pixels, grid_thw=grid).last_hidden_state
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert type(build().model.visual.patch_embed).__name__ != fused_name  # no global patching
