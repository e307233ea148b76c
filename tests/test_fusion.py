"""The patch_embeddings fusion: equivalence, weights, isolation, skips, atomicity, transforms."""

from __future__ import annotations

import copy
import re

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import specs.patch_embeddings
from surgery import WeightConverter
from surgery.converter import Collector
from surgery.errors import FusionError
from surgery.examples import build_vision_tower, example_pixel_values
from surgery.examples.vision import ExamplePatchEmbed
from surgery.fusion import (
    EXCLUDED,
    FUSED,
    SKIPPED,
    FusedModule,
    FusionSpec,
    apply_fusions,
    check_fusion_conflicts,
    fusion_config_of,
    fusion_transforms,
    preview_fusions,
    register_fusion,
)
from surgery.record import record_of
from surgery.routing import route_keys
from surgery.transforms import WeightTransform

ON = {"patch_embeddings": True}


pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")


# --------------------------------------------------------------------------- helpers
def convert_state_dict(
    sd: dict[str, torch.Tensor], transforms: list[WeightTransform]
) -> dict[str, torch.Tensor]:
    """Route every key through ``transforms`` and run the converters: the loader's seam, in small."""
    routing = route_keys(list(sd), transforms)
    assert not routing.conflicts
    out: dict[str, torch.Tensor] = {}
    for group in routing.groups.values():
        if group.converter is None:
            (source,) = group.source_keys
            out[group.target_keys[0]] = sd[source]
            continue
        conv = routing.transforms[group.converter]
        assert isinstance(conv, WeightConverter)
        collector = Collector(conv)
        for pattern, by_index in group.sources.items():
            for index, key in by_index.items():
                collector.add_tensor(group.key, key, pattern, sd[key], index=index)
        out.update(collector.convert(group.key))
    return out


def max_rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-12)).item()


class ConvPatch(nn.Module):
    """A configurable patch embedding for the non-fusable cases."""

    def __init__(
        self,
        *,
        kernel=(2, 4, 4),
        stride=None,
        padding=0,
        dilation=1,
        groups=1,
        out=12,
        view_shape=None,
        reshape=True,
        flatten=True,
    ):
        super().__init__()
        self.view_shape = view_shape or (3, *kernel)
        self.reshape, self.flatten, self.out = reshape, flatten, out
        self.proj = nn.Conv3d(
            3, out, kernel, stride=stride or kernel, padding=padding, dilation=dilation, groups=groups
        )

    def forward(self, x):
        if self.reshape:
            x = x.view(-1, *self.view_shape)
        y = self.proj(x)
        return y.view(-1, self.out) if self.flatten else y


class Holder(nn.Module):
    def __init__(self, patch_embed: nn.Module):
        super().__init__()
        self.patch_embed = patch_embed

    def forward(self, x):
        return self.patch_embed(x)


def snapshot(model: nn.Module):
    return (
        [(n, id(m), type(m)) for n, m in model.named_modules()],
        [(k, id(v)) for k, v in model.state_dict(keep_vars=True).items()],
    )


# --------------------------------------------------------------------------- equivalence
SHAPES = [
    pytest.param(
        dict(embed_dim=32, patch_size=14, temporal_patch_size=2, in_channels=3, bias=True),
        16,
        id="qwen2vl-like",
    ),
    pytest.param(
        dict(embed_dim=48, patch_size=16, temporal_patch_size=2, in_channels=3, bias=False),
        7,
        id="qwen3vl-like-nobias",
    ),
    pytest.param(
        dict(embed_dim=8, patch_size=3, temporal_patch_size=1, in_channels=1, bias=True), 33, id="tiny-mono"
    ),
]


@pytest.mark.parametrize(("shape", "n"), SHAPES)
def test_fused_float32_output_equals_unfused(shape, n):
    ref = build_vision_tower(depth=1, num_heads=4 if shape["embed_dim"] % 4 == 0 else 1, **shape)
    fused = copy.deepcopy(ref)
    apply_fusions(fused, ON)
    x = example_pixel_values(ref.config, num_patches=n, seed=3)
    with torch.no_grad():
        assert max_rel(fused.patch_embed(x), ref.patch_embed(x)) <= 1e-5
        assert max_rel(fused(x), ref(x)) <= 1e-5


@pytest.mark.parametrize(("shape", "n"), SHAPES)
def test_fused_bfloat16_output_equals_unfused_within_bf16_tolerance(shape, n):
    ref = build_vision_tower(depth=1, num_heads=1, dtype=torch.bfloat16, **shape)
    fused = copy.deepcopy(ref)
    apply_fusions(fused, ON)
    x = example_pixel_values(ref.config, num_patches=n, seed=4, dtype=torch.bfloat16)
    with torch.no_grad():
        out = fused.patch_embed(x)
        assert out.dtype == torch.bfloat16
        assert max_rel(out, ref.patch_embed(x)) <= 2e-2


@settings(max_examples=25, deadline=None)
@given(
    c=st.integers(1, 4),
    t=st.integers(1, 3),
    p=st.integers(1, 5),
    d=st.integers(1, 16),
    n=st.integers(1, 9),
    bias=st.booleans(),
)
def test_fusion_is_exact_for_any_patch_geometry(c, t, p, d, n, bias):
    ref = build_vision_tower(
        depth=0, embed_dim=d, num_heads=1, patch_size=p, temporal_patch_size=t, in_channels=c, bias=bias
    )
    fused = copy.deepcopy(ref)
    apply_fusions(fused, ON, strict=True)
    w = ref.patch_embed.proj.weight
    assert torch.equal(fused.patch_embed.linear_proj.weight, w.reshape(d, -1))
    x = example_pixel_values(ref.config, num_patches=n)
    with torch.no_grad():
        torch.testing.assert_close(fused.patch_embed(x), ref.patch_embed(x), rtol=1e-5, atol=1e-5)
    converted = convert_state_dict(ref.state_dict(), fusion_transforms(fused))
    assert converted.keys() == fused.state_dict().keys()
    assert all(torch.equal(converted[k], v) for k, v in fused.state_dict().items())


def test_parameter_count_is_unchanged():
    ref = build_vision_tower(depth=2)
    fused = copy.deepcopy(ref)
    apply_fusions(fused, ON)
    assert sum(p.numel() for p in fused.parameters()) == sum(p.numel() for p in ref.parameters())


def test_fused_weight_is_exactly_the_reshaped_conv_weight_and_bias():
    ref = build_vision_tower(depth=1, embed_dim=32)
    fused = copy.deepcopy(ref)
    apply_fusions(fused, ON)
    conv, lin = ref.patch_embed.proj, fused.patch_embed.linear_proj
    assert torch.equal(lin.weight, conv.weight.reshape(32, -1))
    assert torch.equal(lin.bias, conv.bias)
    assert lin.weight.data_ptr() != conv.weight.data_ptr()  # never aliases the original


def test_fused_module_keeps_name_attributes_device_dtype_and_mode():
    tower = build_vision_tower(depth=1, dtype=torch.bfloat16)
    tower.patch_embed.train()
    apply_fusions(tower, ON)
    pe = tower.patch_embed
    assert type(pe).__name__ == "FusedExamplePatchEmbed"
    assert (
        isinstance(pe, FusedModule)
        and pe.original_class is ExamplePatchEmbed
        and pe.fusion_name == "patch_embeddings"
    )
    assert (pe.embed_dim, pe.in_channels, pe.patch_size, pe.temporal_patch_size) == (32, 3, 14, 2)
    assert not hasattr(pe, "proj")
    assert pe.linear_proj.weight.dtype == torch.bfloat16 and pe.linear_proj.weight.device.type == "cpu"
    assert pe.training


def test_fusion_on_meta_device_keeps_meta_parameters():
    tower = build_vision_tower(depth=1, device="meta")
    apply_fusions(tower, ON)
    assert tower.patch_embed.linear_proj.weight.device.type == "meta"
    assert tuple(tower.patch_embed.linear_proj.weight.shape) == (32, 1176)


def test_state_dict_keeps_its_order_with_proj_renamed_in_place():
    ref = build_vision_tower(depth=1)
    fused = copy.deepcopy(ref)
    apply_fusions(fused, ON)
    expected = [k.replace("patch_embed.proj.", "patch_embed.linear_proj.") for k in ref.state_dict()]
    assert list(fused.state_dict()) == expected


def test_deepcopy_of_a_fused_model_keeps_the_fused_module():
    tower = build_vision_tower(depth=1)
    apply_fusions(tower, ON)
    clone = copy.deepcopy(tower)
    pe = clone.patch_embed
    assert type(pe).__name__ == "FusedExamplePatchEmbed" and pe.embed_dim == 32
    x = example_pixel_values(tower.config, num_patches=4)
    with torch.no_grad():
        assert torch.equal(clone(x), tower(x))


def test_tensor_constants_stay_off_the_original_and_out_of_the_state_dict():
    class WithConstant(ConvPatch):
        def forward(self, x):
            return super().forward(x) * torch.tensor(2.0)

    model = Holder(WithConstant())
    before = set(model.patch_embed.__dict__)
    ref = copy.deepcopy(model)
    preview_fusions(model, ON)
    assert set(model.patch_embed.__dict__) == before
    apply_fusions(model, ON, strict=True)
    assert list(model.state_dict()) == ["patch_embed.linear_proj.weight", "patch_embed.linear_proj.bias"]
    x = torch.randn(5, 3 * 2 * 4 * 4)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


# --------------------------------------------------------------------------- no global state
def test_other_instances_and_later_models_are_untouched():
    forward_before = ExamplePatchEmbed.forward
    class_attrs_before = set(vars(ExamplePatchEmbed))
    a, b = build_vision_tower(depth=1), build_vision_tower(depth=1)
    apply_fusions(a, ON)
    later = build_vision_tower(depth=1)
    assert type(a.patch_embed).__name__ == "FusedExamplePatchEmbed"
    assert type(b.patch_embed) is ExamplePatchEmbed and type(later.patch_embed) is ExamplePatchEmbed
    assert ExamplePatchEmbed.forward is forward_before and set(vars(ExamplePatchEmbed)) == class_attrs_before
    assert record_of(b).fusions is None and record_of(later).fusions is None


def test_disabled_fusion_fuses_nothing_and_records_nothing():
    tower = build_vision_tower(depth=1)
    before = snapshot(tower)
    plan = apply_fusions(tower, {"patch_embeddings": False})
    assert plan.candidates == [] and plan.fusions == ()
    assert snapshot(tower) == before and fusion_config_of(tower) is None and fusion_transforms(tower) == []


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.towers = nn.ModuleList(
            [build_vision_tower(depth=1, seed=0), build_vision_tower(depth=1, seed=1)]
        )


@pytest.mark.parametrize(
    "options",
    [{"exclude": [r"^towers\.1\."]}, {"modules": [r"^towers\.0\.patch_embed$"]}],
    ids=["exclude", "modules"],
)
def test_two_instances_of_one_class_one_fused_one_not(options):
    model = TwoTowers()
    plan = apply_fusions(model, {"patch_embeddings": options})
    assert type(model.towers[0].patch_embed).__name__ == "FusedExamplePatchEmbed"
    assert type(model.towers[1].patch_embed) is ExamplePatchEmbed
    assert [c.path for c in plan.matched] == ["towers.0.patch_embed"]
    assert [t.scope_prefix for t in fusion_transforms(model)] == ["towers.0.patch_embed"] * 2
    if "exclude" in options:
        assert [(c.path, c.status) for c in plan.skipped] == [("towers.1.patch_embed", EXCLUDED)]


# --------------------------------------------------------------------------- not fusable
NOT_FUSABLE = [
    pytest.param(dict(stride=(2, 2, 2)), "kernel_size (2, 4, 4) != stride (2, 2, 2)", id="kernel-ne-stride"),
    pytest.param(dict(padding=1), "padding", id="padding"),
    pytest.param(dict(groups=3), "groups is 3", id="groups"),
    pytest.param(dict(dilation=2), "dilation", id="dilation"),
    pytest.param(dict(reshape=False), "not fed by a reshape", id="no-reshape"),
    pytest.param(dict(view_shape=(3, 2, 2, 8)), "not a reshape to (-1, 3, 2, 4, 4)", id="wrong-reshape"),
    pytest.param(dict(flatten=False), "not flattened to (-1, 12)", id="no-flatten"),
]


@pytest.mark.parametrize(("kwargs", "why"), NOT_FUSABLE)
def test_non_fusable_candidates_are_left_alone_with_the_reason(kwargs, why):
    model = Holder(ConvPatch(**kwargs))
    before = snapshot(model)
    plan = apply_fusions(model, ON)
    (candidate,) = plan.candidates
    assert candidate.status == SKIPPED and why in candidate.reason
    assert snapshot(model) == before and record_of(model).fusions is None
    assert "Nothing compatible found" in plan.messages["patch_embeddings"]


@pytest.mark.parametrize(("kwargs", "why"), NOT_FUSABLE[:2])
def test_strict_turns_a_skip_into_an_error_naming_path_and_reason(kwargs, why):
    model = Holder(ConvPatch(**kwargs))
    with pytest.raises(FusionError, match=re.escape("'patch_embed' (ConvPatch)")) as info:
        apply_fusions(model, ON, strict=True)
    assert why in str(info.value)


class Untraceable(ExamplePatchEmbed):
    def forward(self, hidden_states):
        if hidden_states.sum() > 0:  # data-dependent control flow
            return super().forward(hidden_states)
        return super().forward(-hidden_states)


def test_untraceable_module_is_skipped_and_strict_raises():
    model = Holder(Untraceable())
    plan = apply_fusions(model, ON)
    assert plan.candidates[0].status == SKIPPED and plan.candidates[0].reason.startswith("untraceable")
    assert type(model.patch_embed) is Untraceable
    with pytest.raises(FusionError, match="untraceable"):
        apply_fusions(model, ON, strict=True)


def test_module_with_hooks_is_skipped():
    tower = build_vision_tower(depth=1)
    tower.patch_embed.register_forward_hook(lambda m, i, o: o)
    plan = apply_fusions(tower, ON)
    assert "forward_hooks" in plan.candidates[0].reason and type(tower.patch_embed) is ExamplePatchEmbed


def test_fusion_is_chosen_by_graph_not_by_class_name():
    class Stem(nn.Module):  # no "PatchEmbed" in the name, custom attribute names
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv3d(2, 6, (1, 3, 3), stride=(1, 3, 3), bias=False)

        def forward(self, x):
            return self.conv(x.reshape(-1, 2, 1, 3, 3).contiguous()).flatten(1)

    model = Holder(Stem())
    ref = copy.deepcopy(model)
    plan = apply_fusions(model, ON, strict=True)
    assert plan.matched[0].fused_class_name == "FusedStem" and hasattr(model.patch_embed, "linear_conv")
    x = torch.randn(4, 18)
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref(x))


# --------------------------------------------------------------------------- atomicity
def test_strict_failure_after_a_successful_swap_restores_the_model():
    model = nn.Module()
    model.a = Holder(build_vision_tower(depth=0).patch_embed)
    model.b = Holder(ConvPatch(padding=1))
    before = snapshot(model)
    with pytest.raises(FusionError, match=r"a\.patch_embed|b\.patch_embed"):
        apply_fusions(model, ON, strict=True)
    assert snapshot(model) == before and record_of(model).fusions is None


def test_a_rewrite_that_raises_leaves_the_model_unchanged():
    class Broken(specs.patch_embeddings.PatchEmbeddingsFusion):
        def rewrite(self, module, graph, matches, *, materialize):
            raise RuntimeError("boom")

    register_fusion("broken", Broken())
    model = TwoTowers()
    before = snapshot(model)
    config = {"patch_embeddings": {"exclude": ["towers.1"]}, "broken": True}  # swaps towers.0, then fails
    with pytest.raises(FusionError, match="rewrite failed: RuntimeError: boom"):
        apply_fusions(model, config)
    assert snapshot(model) == before and record_of(model).fusions is None


def test_applying_twice_is_idempotent():
    tower = build_vision_tower(depth=1)
    apply_fusions(tower, ON)
    pe = tower.patch_embed
    plan = apply_fusions(tower, ON)
    assert tower.patch_embed is pe and plan.matched == []
    assert fusion_config_of(tower) == ON and len(fusion_transforms(tower)) == 2


def test_two_applications_with_different_options_persist_the_exact_modules():
    model = TwoTowers()
    apply_fusions(model, {"patch_embeddings": {"exclude": ["towers.1"]}})
    apply_fusions(model, ON)
    cfg = fusion_config_of(model)
    assert cfg == {
        "patch_embeddings": {"modules": [r"^towers\.0\.patch_embed$", r"^towers\.1\.patch_embed$"]}
    }
    fresh = TwoTowers()
    apply_fusions(fresh, cfg)
    assert [type(t.patch_embed).__name__ for t in fresh.towers] == ["FusedExamplePatchEmbed"] * 2


# --------------------------------------------------------------------------- weight transforms
def test_transforms_are_scoped_anchored_and_derived_from_the_module():
    tower = build_vision_tower(depth=1, patch_size=16, in_channels=2, bias=True)
    apply_fusions(tower, ON)
    renaming, converter = fusion_transforms(tower)
    assert renaming.source_patterns == (r"^proj\.bias$",) and renaming.scope_prefix == "patch_embed"
    assert converter.source_patterns == (r"^proj\.weight$",) and converter.scope_prefix == "patch_embed"
    (op,) = converter.operations
    assert (op.in_channels, op.kernel_size) == (2, (2, 16, 16))
    assert converter.match("blocks.0.attn.proj.weight") is None


def test_fusion_transforms_are_equal_values_in_distinct_objects():
    tower = build_vision_tower(depth=1)
    apply_fusions(tower, ON)
    first, second = fusion_transforms(tower), fusion_transforms(tower)
    assert all(a is not b and a == b for a, b in zip(first, second))


@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_transforms_map_the_original_state_dict_to_the_fused_one_and_back_bit_identically(bias):
    ref = build_vision_tower(depth=2, bias=bias)
    fused = copy.deepcopy(ref)
    apply_fusions(fused, ON)
    original = ref.state_dict()
    transforms = fusion_transforms(fused)
    converted = convert_state_dict(original, transforms)
    runtime = fused.state_dict()
    assert converted.keys() == runtime.keys()
    for k, v in runtime.items():
        assert converted[k].dtype == v.dtype and torch.equal(converted[k], v), k
    back = convert_state_dict(converted, [t.reverse_transform() for t in transforms])
    assert back.keys() == original.keys()
    for k, v in original.items():
        assert back[k].shape == v.shape and back[k].dtype == v.dtype and torch.equal(back[k], v), k


def test_conflicting_converter_in_the_model_mapping_fails_fast():
    tower = build_vision_tower(depth=1)
    apply_fusions(tower, ON)
    check_fusion_conflicts(tower, [WeightConverter(r"attn\.qkv\.weight", "attn.qkv_fused.weight", [])])
    other = WeightConverter(r"patch_embed\.proj\.weight", "patch_embed.w", [])
    with pytest.raises(FusionError, match=r"also claims it .*exclude"):
        check_fusion_conflicts(tower, [other])


def test_a_spec_without_rewrite_raises_not_implemented_cleanly():
    class Lazy(FusionSpec):
        target_modules_patterns = (r"patch_embed$",)

    register_fusion("lazy", Lazy())
    with pytest.raises(NotImplementedError, match="find_matches"):
        preview_fusions(build_vision_tower(depth=0), {"lazy": True})


def test_applied_candidates_have_status_fused():
    tower = build_vision_tower(depth=1)
    plan = apply_fusions(tower, ON)
    assert plan.applied and [c.status for c in plan.candidates] == [FUSED]


def test_an_instance_registered_at_two_paths_is_skipped():
    model = nn.Module()
    shared = build_vision_tower(depth=0).patch_embed
    model.a, model.b = Holder(shared), Holder(shared)
    plan = apply_fusions(model, ON)
    (candidate,) = plan.candidates
    assert "registered at ['a.patch_embed', 'b.patch_embed']" in candidate.reason
    assert model.a.patch_embed is shared and model.b.patch_embed is shared


def test_the_root_module_is_never_replaced():
    root = build_vision_tower(depth=0).patch_embed
    plan = apply_fusions(root, {"patch_embeddings": {"modules": ["^$"]}})
    assert "root module cannot be replaced" in plan.candidates[0].reason
    assert type(root) is ExamplePatchEmbed


def test_a_pickled_fused_model_computes_the_same_output():
    import pickle

    tower = build_vision_tower(depth=1)
    apply_fusions(tower, ON)
    clone = pickle.loads(pickle.dumps(tower))
    x = example_pixel_values(tower.config, num_patches=4)
    with torch.no_grad():
        assert torch.equal(clone(x), tower(x))
    assert list(clone.state_dict()) == list(tower.state_dict())
