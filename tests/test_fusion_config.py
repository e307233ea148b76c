"""Fusion configs and the fusion registry: validation, order, errors that name the fix."""

from __future__ import annotations

import json

import pytest

import specs.patch_embeddings
from specs.patch_embeddings import PatchEmbeddingsFusion
from surgery.errors import FusionError, RegistryError
from surgery.examples import build_vision_tower
from surgery.fusion import (
    FusionSpec,
    apply_fusions,
    fusion_registry_snapshot,
    get_fusion,
    list_fusions,
    register_fusion,
    validate_fusion_config,
)

pytestmark = pytest.mark.usefixtures("isolated_fusion_registry")


# --------------------------------------------------------------------------- accepted forms
@pytest.mark.parametrize(
    ("config", "canonical"),
    [
        ({"patch_embeddings": True}, {"patch_embeddings": True}),
        ({"patch_embeddings": {}}, {"patch_embeddings": {}}),
        ({"patch_embeddings": {"exclude": ("a",)}}, {"patch_embeddings": {"exclude": ["a"]}}),
        ({"patch_embeddings": False}, {}),
        ({}, {}),
        (None, {}),
    ],
    ids=["true", "empty-options", "options", "false", "empty", "none"],
)
def test_valid_configs_validate_to_their_canonical_form(config, canonical):
    cfg = validate_fusion_config(config)
    assert cfg.to_dict() == canonical
    assert json.loads(json.dumps(cfg.to_dict())) == canonical


def test_options_get_their_defaults():
    (fusion,) = validate_fusion_config({"patch_embeddings": True}).fusions
    assert fusion.options == {"modules": None, "exclude": ()}
    assert isinstance(fusion.spec, PatchEmbeddingsFusion)


def test_enabled_fusions_run_in_the_users_order():
    register_fusion("pe_copy", PatchEmbeddingsFusion())
    assert validate_fusion_config({"pe_copy": True, "patch_embeddings": True}).names == (
        "pe_copy",
        "patch_embeddings",
    )
    tower = build_vision_tower(depth=0)
    plan = apply_fusions(tower, {"pe_copy": True, "patch_embeddings": True})
    assert plan.fusions == ("pe_copy", "patch_embeddings")
    assert tower.patch_embed.fusion_name == "pe_copy"  # the first fusion took it; the second found nothing
    assert "patch_embeddings" in plan.messages


# --------------------------------------------------------------------------- errors
def test_unknown_name_lists_valid_names_and_the_closest():
    with pytest.raises(
        FusionError,
        match=r"Unknown fusion 'patch_embedding'.*Did you mean 'patch_embeddings'\?.*Valid names: .*'patch_embeddings'",
    ):
        validate_fusion_config({"patch_embedding": True})


@pytest.mark.parametrize(
    "value", [1, 0, "yes", None, ["exclude"]], ids=["one", "zero", "str", "none", "list"]
)
def test_values_other_than_true_false_or_a_mapping_are_errors(value):
    with pytest.raises(FusionError, match=r"expected True, False or a mapping of options"):
        validate_fusion_config({"patch_embeddings": value})


@pytest.mark.parametrize(
    "config", [["patch_embeddings"], "patch_embeddings", True], ids=["list", "str", "bool"]
)
def test_a_config_that_is_not_a_mapping_is_an_error(config):
    with pytest.raises(FusionError, match="fusion_config must be a mapping"):
        validate_fusion_config(config)


def test_non_string_key_is_an_error():
    with pytest.raises(FusionError, match="keys must be fusion names"):
        validate_fusion_config({1: True})


def test_unknown_option_lists_the_valid_options():
    with pytest.raises(FusionError, match=r"no option 'exlude'.*Did you mean 'exclude'\?.*'modules'"):
        validate_fusion_config({"patch_embeddings": {"exlude": []}})


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"exclude": "towers.1"}, "must be list or tuple"),
        ({"exclude": [3]}, "must be a regex string"),
        ({"modules": ["("]}, "not a valid regex"),
        ({"modules": []}, "at least one regex"),
        ({"exclude": True}, "must be list or tuple"),
    ],
    ids=["str-not-list", "non-str-item", "bad-regex", "empty-modules", "bool"],
)
def test_malformed_options_are_errors_naming_the_option(options, message):
    with pytest.raises(FusionError, match=message) as info:
        validate_fusion_config({"patch_embeddings": options})
    assert repr(next(iter(options))) in str(info.value)


def test_invalid_config_changes_nothing():
    tower = build_vision_tower(depth=0)
    pe = tower.patch_embed
    with pytest.raises(FusionError):
        apply_fusions(tower, {"patch_embeddings": True, "nope": True})
    assert tower.patch_embed is pe


# --------------------------------------------------------------------------- registry
def test_registering_a_taken_name_fails_unless_overwrite():
    first = get_fusion("patch_embeddings")
    with pytest.raises(RegistryError, match=r"already registered .*overwrite=True"):
        register_fusion("patch_embeddings", PatchEmbeddingsFusion())
    replacement = PatchEmbeddingsFusion()
    register_fusion("patch_embeddings", replacement, overwrite=True)
    assert get_fusion("patch_embeddings") is replacement is not first


def test_registry_miss_names_the_closest_and_valid_names():
    with pytest.raises(RegistryError, match=r"'patch_embed'.*did you mean 'patch_embeddings'\?.*Valid names"):
        get_fusion("patch_embed")


@pytest.mark.parametrize(
    ("name", "spec"),
    [("bad name", PatchEmbeddingsFusion()), ("ok", PatchEmbeddingsFusion), ("ok", object())],
    ids=["name", "class-not-instance", "not-a-spec"],
)
def test_registering_invalid_entries_is_an_error(name, spec):
    with pytest.raises(RegistryError):
        register_fusion(name, spec)


def test_snapshot_restores_the_registry():
    before = list_fusions()
    with fusion_registry_snapshot(clear=True):
        assert list_fusions() == []
        register_fusion("tmp", FusionSpec())
    assert list_fusions() == before


def test_catalog_register_function_registers_patch_embeddings():
    with fusion_registry_snapshot(clear=True):
        specs.patch_embeddings.register()
        assert isinstance(get_fusion("patch_embeddings"), PatchEmbeddingsFusion)


# --------------------------------------------------------------------------- catalog loading
def test_importing_the_fusion_engine_loads_no_catalog(fresh_python):
    out = fresh_python("import sys, surgery.fusion; print('specs.patch_embeddings' in sys.modules)")
    assert out == "False"


def test_the_builtin_catalog_provides_patch_embeddings_lazily(fresh_python):
    out = fresh_python("from surgery.fusion import list_fusions; print(list_fusions())")
    assert "'patch_embeddings'" in out


def test_a_catalog_that_runs_again_replaces_its_own_fusion_but_not_a_users():
    from surgery.registry import registering_catalog

    with registering_catalog("tests"):
        register_fusion("from_catalog", PatchEmbeddingsFusion())
    with registering_catalog("tests"):  # the same catalog after a registry reset
        register_fusion("from_catalog", PatchEmbeddingsFusion())
    register_fusion("from_user", PatchEmbeddingsFusion())
    with pytest.raises(RegistryError, match=r"by user.*by catalog:tests"), registering_catalog("tests"):
        register_fusion("from_user", PatchEmbeddingsFusion())
