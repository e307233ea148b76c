"""Specification of resolution: which mappings apply where, walked through small pure-torch trees.

The catalog entries below are registered as a catalog named ``tests`` that knows this module, so
the classes here behave like library classes; a class moved to another module is custom code.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from torch import nn

from surgery import ops
from surgery.converter import WeightConverter
from surgery.errors import ConfigurationError, RegistryError
from surgery.graph import ModuleGraph
from surgery.registry import (
    register_catalog_modules,
    register_checkpoint_conversion_mapping,
    registering_catalog,
    registry_snapshot,
)
from surgery.resolution import explain_model_conversion_mapping, get_model_conversion_mapping
from surgery.transforms import WeightRenaming, WeightTransform


def _r(src: str, tgt: str) -> WeightRenaming:
    return WeightRenaming(src, tgt)


def _catalog() -> dict[str, list[WeightTransform] | str]:
    """A miniature catalog shaped like the reference one."""
    return {
        "llava": [_r(r"^language_model\.model", "model.language_model")],
        "gemma3": "llava",
        "LlavaModel": [_r(r"^multi_modal_projector\.linear_1", "multi_modal_projector.fc1")],
        "Gemma3Model": "LlavaModel",
        "DetrForSegmentation": [_r(r"bbox_attention\.q_linear", "bbox_attention.q_proj")],
        "DetrModel": [_r(r"out_proj", "o_proj"), _r(r"backbone\.conv_encoder", "backbone")],
        "TowerModel": [_r(r"\.attn\.", ".self_attn.")],
        "mixtral": [
            _r(r"\.block_sparse_moe\.", ".mlp."),
            WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)]),
        ],
    }


@pytest.fixture(autouse=True)
def catalog():
    """An empty registry holding only :func:`_catalog`, registered as catalog ``tests``."""
    with registry_snapshot(clear=True):
        with registering_catalog("tests"):
            register_catalog_modules(__name__)
            for key, value in _catalog().items():
                register_checkpoint_conversion_mapping(key, value)
        yield


def _config(model_type: str | None) -> SimpleNamespace:
    return SimpleNamespace(model_type=model_type)


def _scopes(transforms: list[WeightTransform]) -> list[tuple[str | None, str]]:
    return [(t.scope_prefix, t.source_patterns[0]) for t in transforms]


def _resolve(model: nn.Module) -> list[tuple[str | None, str]]:
    return _scopes(get_model_conversion_mapping(model, include_legacy=False))


# ---------------------------------------------------------------------- Gemma3 walk-through
class SiglipVisionModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("siglip_vision_model")
        self.patch_embedding = nn.Linear(4, 4)


class Gemma3TextModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("gemma3_text")
        self.embed_tokens = nn.Embedding(8, 4)


class Gemma3Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("gemma3")
        self.vision_tower = SiglipVisionModel()
        self.multi_modal_projector = nn.Linear(4, 4)
        self.language_model = Gemma3TextModel()


class Gemma3ForConditionalGeneration(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("gemma3")
        self.model = Gemma3Model()
        self.lm_head = nn.Linear(4, 8, bias=False)


def test_gemma3_root_is_hit_by_model_type_and_inner_model_by_class_name():
    assert _resolve(Gemma3ForConditionalGeneration()) == [
        ("", r"^language_model\.model"),
        ("model", r"^multi_modal_projector\.linear_1"),
    ]


def test_gemma3_walk_explains_every_sub_model():
    records = explain_model_conversion_mapping(Gemma3ForConditionalGeneration())
    assert [(r.path, r.outcome, r.key) for r in records] == [
        ("", "model_type", "gemma3"),
        ("model", "class_name", "Gemma3Model"),
        ("model.vision_tower", "no_mapping", None),
        ("model.language_model", "no_mapping", None),
    ]


def test_a_scoped_mapping_fires_only_under_its_sub_model():
    (inner,) = [t for t in get_model_conversion_mapping(Gemma3ForConditionalGeneration()) if t.scope_prefix]
    assert inner.rename_source_key("model.multi_modal_projector.linear_1.weight")[0] == (
        "model.multi_modal_projector.fc1.weight"
    )
    assert inner.rename_source_key("multi_modal_projector.linear_1.weight")[1] is None


# ---------------------------------------------------------------------- DETR walk-through
class DetrConvEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)


class DetrModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("detr")
        self.backbone = DetrConvEncoder()
        self.out_proj = nn.Linear(4, 4)


class DetrForObjectDetection(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("detr")
        self.model = DetrModel()
        self.class_labels_classifier = nn.Linear(4, 2)


class DetrForSegmentation(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("detr")
        self.detr = DetrForObjectDetection()
        self.bbox_attention = nn.Module()
        self.bbox_attention.q_linear = nn.Linear(4, 4)


def test_detr_root_by_class_then_inner_detr_model_scoped_to_its_full_path():
    assert _resolve(DetrForSegmentation()) == [
        ("", r"bbox_attention\.q_linear"),
        ("detr.model", "out_proj"),
        ("detr.model", r"backbone\.conv_encoder"),
    ]


def test_detr_object_detection_is_walked_through_without_a_mapping():
    records = explain_model_conversion_mapping(DetrForSegmentation())
    assert [(r.path, r.outcome, r.key) for r in records] == [
        ("", "class_name", "DetrForSegmentation"),
        ("detr", "no_mapping", None),
        ("detr.model", "class_name", "DetrModel"),
    ]


def test_a_class_name_hit_does_not_claim_the_model_type():
    register_checkpoint_conversion_mapping("detr", [_r(r"class_labels_classifier", "class_head")])
    records = explain_model_conversion_mapping(DetrForSegmentation())
    assert [(r.path, r.outcome, r.key) for r in records] == [
        ("", "class_name", "DetrForSegmentation"),
        ("detr", "model_type", "detr"),
        ("detr.model", "class_name", "DetrModel"),
    ]


def test_a_model_type_hit_claims_the_model_type_for_descendants_without_a_class_mapping():
    register_checkpoint_conversion_mapping("detr", [_r(r"class_labels_classifier", "class_head")])
    model = DetrForObjectDetection()
    model.model.config = _config("detr")
    records = explain_model_conversion_mapping(model)
    assert [(r.path, r.outcome) for r in records] == [("", "model_type"), ("model", "class_name")]
    model.model.__class__ = type("PlainDetrModel", (DetrModel,), {"__module__": __name__})
    records = explain_model_conversion_mapping(model)
    assert [(r.path, r.outcome, r.claimed_by) for r in records] == [
        ("", "model_type", None),
        ("model", "ancestor_claimed", ""),
    ]


# ---------------------------------------------------------------------- siblings and ancestors
class TowerModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("tower")
        self.attn = nn.Linear(2, 2)


class DualEncoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("dual")
        self.encoder = TowerModel()
        self.encoder_extra = TowerModel()


def test_siblings_of_one_class_each_get_their_own_scoped_copy():
    transforms = get_model_conversion_mapping(DualEncoder(), include_legacy=False)
    assert _scopes(transforms) == [("encoder", r"\.attn\."), ("encoder_extra", r"\.attn\.")]
    assert transforms[0] is not transforms[1]


def test_a_sibling_whose_name_extends_a_claimed_path_is_not_its_descendant():
    records = explain_model_conversion_mapping(DualEncoder())
    assert [r.outcome for r in records if r.path.startswith("encoder")] == ["class_name", "class_name"]


def test_a_descendant_is_skipped_when_an_ancestor_claimed_its_class_name():
    model = TowerModel()
    model.nested = TowerModel()
    records = explain_model_conversion_mapping(model)
    assert [(r.path, r.outcome, r.key, r.claimed_by) for r in records] == [
        ("", "class_name", "TowerModel", None),
        ("nested", "ancestor_claimed", "TowerModel", ""),
    ]
    assert _resolve(model) == [("", r"\.attn\.")]


class MixtralModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("mixtral")
        self.layer = nn.Linear(2, 2)


class MixtralForCausalLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = _config("mixtral")
        self.model = MixtralModel()


def test_a_descendant_is_skipped_when_an_ancestor_claimed_its_model_type():
    records = explain_model_conversion_mapping(MixtralForCausalLM())
    assert [(r.path, r.outcome, r.key, r.claimed_by) for r in records] == [
        ("", "model_type", "mixtral", None),
        ("model", "ancestor_claimed", "mixtral", ""),
    ]


def test_a_claim_covers_only_the_subtree_of_the_claiming_path():
    root = nn.Module()
    root.left = TowerModel()
    root.left.inner = TowerModel()
    root.right = TowerModel()
    records = explain_model_conversion_mapping(root)
    assert [(r.path, r.outcome) for r in records] == [
        ("left", "class_name"),
        ("left.inner", "ancestor_claimed"),
        ("right", "class_name"),
    ]


def test_a_shared_sub_model_is_resolved_once_at_its_canonical_path():
    root = DualEncoder()
    root.encoder_extra = root.encoder
    assert _resolve(root) == [("encoder", r"\.attn\.")]


# ---------------------------------------------------------------------- custom-code filter
class CustomMixtralForCausalLM(nn.Module):
    """Custom modeling code that reuses a library model_type."""

    def __init__(self) -> None:
        super().__init__()
        self.config = _config("mixtral")
        self.layer = nn.Linear(2, 2)


CustomMixtralForCausalLM.__module__ = "acme_remote_code.modeling_mixtral"


def test_catalog_entries_do_not_apply_to_a_custom_class_sharing_a_model_type():
    records = explain_model_conversion_mapping(CustomMixtralForCausalLM())
    assert [(r.outcome, r.filtered) for r in records] == [("custom_code", ("mixtral",))]
    assert _resolve(CustomMixtralForCausalLM()) == []


def test_a_user_registration_of_the_custom_class_name_applies():
    register_checkpoint_conversion_mapping("CustomMixtralForCausalLM", "mixtral")
    records = explain_model_conversion_mapping(CustomMixtralForCausalLM())
    assert [(r.outcome, r.key, r.provenance) for r in records] == [
        ("class_name", "CustomMixtralForCausalLM", "user")
    ]
    assert _resolve(CustomMixtralForCausalLM())[0] == ("", r"\.block_sparse_moe\.")


def test_a_user_registration_of_the_model_type_applies_to_custom_classes():
    register_checkpoint_conversion_mapping("mixtral", [_r(r"\.w1\.", ".gate_proj.")], overwrite=True)
    assert _resolve(CustomMixtralForCausalLM()) == [("", r"\.w1\.")]


def test_a_custom_class_that_shadows_a_catalog_class_name_gets_nothing_from_it():
    custom = type("TowerModel", (TowerModel,), {"__module__": "acme_remote_code.modeling_tower"})
    records = explain_model_conversion_mapping(custom())
    assert [(r.outcome, r.filtered) for r in records] == [("custom_code", ("TowerModel",))]


def test_library_sub_models_inside_a_custom_root_still_resolve():
    root = CustomMixtralForCausalLM()
    root.tower = TowerModel()
    assert _resolve(root) == [("tower", r"\.attn\.")]


# ---------------------------------------------------------------------- aliases, legacy, fresh copies
def test_an_alias_hit_reports_the_key_that_matched():
    (record,) = [
        r for r in explain_model_conversion_mapping(Gemma3ForConditionalGeneration()) if r.path == ""
    ]
    assert (record.key, record.provenance) == ("gemma3", "catalog:tests")


def test_a_broken_alias_met_during_resolution_is_an_error():
    register_checkpoint_conversion_mapping("tower", "no_such_key")
    model = DualEncoder()
    model.encoder.__class__ = type("OtherTower", (TowerModel,), {"__module__": __name__})
    with pytest.raises(RegistryError, match="'no_such_key', which is not registered"):
        get_model_conversion_mapping(model)


def test_legacy_renames_come_first_and_apply_to_every_model():
    transforms = get_model_conversion_mapping(nn.Linear(1, 1))
    assert [t.source_patterns[0] for t in transforms] == [r"LayerNorm\.gamma", r"LayerNorm\.beta"]
    assert get_model_conversion_mapping(DetrForSegmentation())[0].source_patterns == (r"LayerNorm\.gamma",)


def test_legacy_renames_can_be_left_out():
    assert get_model_conversion_mapping(nn.Linear(1, 1), include_legacy=False) == []


def test_resolving_twice_gives_equal_values_never_shared_objects():
    model = nn.Module()
    model.mixtral = MixtralModel()
    first = get_model_conversion_mapping(model)
    second = get_model_conversion_mapping(model)
    assert not any(a is b for a in first for b in second)
    assert first == second  # equal values, never shared objects
    again = next(t for t in second if isinstance(t, WeightConverter))
    assert again.scope_prefix == "mixtral"


def test_a_prebuilt_graph_gives_the_same_result():
    model = DetrForSegmentation()
    assert _scopes(get_model_conversion_mapping(model, graph=ModuleGraph(model))) == _scopes(
        get_model_conversion_mapping(model)
    )


def test_explanations_read_as_one_line_per_sub_model():
    lines = [str(r) for r in explain_model_conversion_mapping(DetrForSegmentation())]
    assert lines == [
        "<root> DetrForSegmentation [detr]: 1 transform(s) via class_name 'DetrForSegmentation' (catalog:tests)",
        "'detr' DetrForObjectDetection [detr]: no mapping",
        "'detr.model' DetrModel [detr]: 2 transform(s) via class_name 'DetrModel' (catalog:tests)",
    ]


# ---------------------------------------------------------------------- quantizer hook
class AppendingQuantizer:
    """Adds one converter, the way a pre-quantized format adds its scale tensors."""

    def update_weight_conversions(self, transforms: list[WeightTransform]) -> list[WeightTransform]:
        return [*transforms, _r(r"\.qscale_weight$", ".weight_scale_inv")]


class ModelAwareQuantizer:
    """The transformers signature: the hook also receives the model."""

    def __init__(self) -> None:
        self.seen: list[nn.Module] = []

    def update_weight_conversions(
        self, transforms: list[WeightTransform], model: nn.Module
    ) -> list[WeightTransform]:
        self.seen.append(model)
        return transforms[:1]


def test_the_quantizer_hook_runs_last_on_the_full_list():
    transforms = get_model_conversion_mapping(DetrForSegmentation(), quantizer=AppendingQuantizer())
    assert len(transforms) == 2 + 3 + 1
    assert transforms[-1].source_patterns == (r"\.qscale_weight$",)


def test_a_quantizer_hook_taking_the_model_receives_it():
    model = DetrForSegmentation()
    quantizer = ModelAwareQuantizer()
    assert len(get_model_conversion_mapping(model, quantizer=quantizer)) == 1
    assert quantizer.seen == [model]


def test_a_quantizer_without_the_hook_changes_nothing():
    model = DetrForSegmentation()
    assert _scopes(get_model_conversion_mapping(model, quantizer=object())) == _scopes(
        get_model_conversion_mapping(model)
    )


def test_a_quantizer_hook_returning_something_else_is_an_error():
    class Broken:
        def update_weight_conversions(self, transforms):
            return [*transforms, "not a transform"]

    with pytest.raises(
        ConfigurationError, match=r"Broken\.update_weight_conversions returned 'not a transform'"
    ):
        get_model_conversion_mapping(nn.Linear(1, 1), quantizer=Broken())


def test_include_legacy_must_be_a_bool():
    with pytest.raises(ConfigurationError, match="include_legacy"):
        get_model_conversion_mapping(nn.Linear(1, 1), include_legacy="yes")


def test_resolution_without_a_graph_does_not_import_networkx(fresh_python):
    # The first load of a process resolves the mapping; building a ModuleGraph would import
    # networkx (~0.2 s) for nothing, so resolution walks the modules itself.
    code = (
        "import sys, torch\n"
        "from surgery.resolution import get_model_conversion_mapping\n"
        "get_model_conversion_mapping(torch.nn.Sequential(torch.nn.Linear(2, 2)))\n"
        "print('networkx' in sys.modules)\n"
    )
    assert fresh_python(code) == "False"


def test_explanations_with_and_without_a_prebuilt_graph_agree():
    shared = nn.Linear(2, 2)
    model = nn.ModuleDict({"seg": DetrForSegmentation(), "a": shared, "b": nn.Sequential(shared)})

    def described(records):
        return [
            (r.path, r.class_name, r.model_type, r.outcome, r.key, r.claimed_by, r.filtered) for r in records
        ]

    assert described(explain_model_conversion_mapping(model)) == described(
        explain_model_conversion_mapping(model, graph=ModuleGraph(model))
    )


def test_the_explanation_prints_as_a_table() -> None:
    class Toy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.config = SimpleNamespace(model_type="toy_table")
            self.proj = nn.Linear(2, 2)

    with registry_snapshot(clear=True):
        register_checkpoint_conversion_mapping("toy_table", [WeightRenaming(r"\.gamma$", ".weight")])
        text = str(explain_model_conversion_mapping(Toy()))
    header, _rule, root, *_ = text.splitlines()
    assert header.split() == ["sub-model", "class", "model_type", "outcome", "key", "transforms"]
    assert root.split() == ["<root>", "Toy", "toy_table", "model_type", "toy_table", "1"]
    plain = str(explain_model_conversion_mapping(nn.Linear(2, 2)))
    assert plain.splitlines()[-1].startswith("no conversion mapping applies")
