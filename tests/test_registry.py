"""Specification of the checkpoint conversion registry: keys, aliases, collisions, catalogs."""

from __future__ import annotations

import sys
import textwrap
import threading
import uuid
from pathlib import Path

import pytest

from surgery import ops
from surgery.converter import WeightConverter
from surgery.errors import ImmutableError, RegistryError
from surgery.registry import (
    catalog_modules,
    checkpoint_conversion_entry,
    find_checkpoint_conversion_mapping,
    get_checkpoint_conversion_mapping,
    is_known_to_catalog,
    list_checkpoint_conversion_keys,
    register_catalog_modules,
    register_checkpoint_conversion_mapping,
    registering_catalog,
    registry_snapshot,
)
from surgery.transforms import PrefixChange, WeightRenaming


def _renaming(src: str = r"\.gamma$", tgt: str = ".weight") -> WeightRenaming:
    return WeightRenaming(src, tgt)


def _moe_converter() -> WeightConverter:
    return WeightConverter(r"\.experts\.*\.w2\.weight", ".experts.down_proj", [ops.MergeModulelist(dim=0)])


@pytest.fixture
def registry():
    """An empty registry for the test; whatever was registered before comes back afterwards."""
    with registry_snapshot(clear=True):
        yield


# ---------------------------------------------------------------------- register / get
def test_get_returns_the_registered_transforms_as_equal_fresh_copies(registry):
    proto = _renaming()
    register_checkpoint_conversion_mapping("toy", [proto])
    (got,) = get_checkpoint_conversion_mapping("toy")
    assert got is not proto
    assert type(got) is WeightRenaming
    assert (got.source_patterns, got.target_patterns) == (proto.source_patterns, proto.target_patterns)


def test_each_get_hands_out_new_objects(registry):
    register_checkpoint_conversion_mapping("toy", [_moe_converter()])
    first = get_checkpoint_conversion_mapping("toy")
    second = get_checkpoint_conversion_mapping("toy")
    assert first[0] is not second[0]


def test_a_copy_is_an_equal_immutable_value_apart_from_the_prototype(registry):
    register_checkpoint_conversion_mapping("toy", [_moe_converter()])
    (conv,) = get_checkpoint_conversion_mapping("toy")
    with pytest.raises(ImmutableError):
        conv.scope_prefix = "elsewhere"
    (proto,) = checkpoint_conversion_entry("toy").transforms
    assert conv == proto and conv is not proto and proto.scope_prefix is None


def test_mapping_keeps_the_registered_order(registry):
    transforms = [_renaming(), PrefixChange(prefix_to_add="model"), _moe_converter()]
    register_checkpoint_conversion_mapping("toy", transforms)
    assert [type(t) for t in get_checkpoint_conversion_mapping("toy")] == [type(t) for t in transforms]


def test_changing_the_registered_list_afterwards_does_not_change_the_entry(registry):
    transforms = [_renaming()]
    register_checkpoint_conversion_mapping("toy", transforms)
    transforms.append(_moe_converter())
    assert len(get_checkpoint_conversion_mapping("toy")) == 1


def test_an_empty_mapping_is_a_valid_entry(registry):
    register_checkpoint_conversion_mapping("plain", [])
    assert get_checkpoint_conversion_mapping("plain") == []


def test_list_keys_is_sorted_and_includes_aliases(registry):
    register_checkpoint_conversion_mapping("b", [_renaming()])
    register_checkpoint_conversion_mapping("a", "b")
    assert list_checkpoint_conversion_keys() == ["a", "b"]


# ---------------------------------------------------------------------- aliases
def test_model_type_alias_resolves_to_the_target_mapping(registry):
    register_checkpoint_conversion_mapping("qwen2_moe", [_moe_converter()])
    register_checkpoint_conversion_mapping("qwen3_moe", "qwen2_moe")
    (conv,) = get_checkpoint_conversion_mapping("qwen3_moe")
    assert conv.target_patterns == (".experts.down_proj",)


def test_class_name_alias_resolves_to_the_target_mapping(registry):
    register_checkpoint_conversion_mapping(
        "LlavaModel", [_renaming("^language_model.model", "language_model")]
    )
    register_checkpoint_conversion_mapping("PaliGemmaModel", "LlavaModel")
    (r,) = get_checkpoint_conversion_mapping("PaliGemmaModel")
    assert r.target_patterns == ("language_model",)


def test_alias_chains_are_followed_to_the_end(registry):
    register_checkpoint_conversion_mapping("c", [_renaming()])
    register_checkpoint_conversion_mapping("b", "c")
    register_checkpoint_conversion_mapping("a", "b")
    assert len(get_checkpoint_conversion_mapping("a")) == 1


def test_alias_may_be_registered_before_its_target(registry):
    register_checkpoint_conversion_mapping("qwen3_moe", "qwen2_moe")
    register_checkpoint_conversion_mapping("qwen2_moe", [_moe_converter()])
    assert len(get_checkpoint_conversion_mapping("qwen3_moe")) == 1


def test_alias_entry_records_its_target(registry):
    register_checkpoint_conversion_mapping("qwen2_moe", [_moe_converter()])
    register_checkpoint_conversion_mapping("qwen3_moe", "qwen2_moe")
    entry = checkpoint_conversion_entry("qwen3_moe")
    assert entry.alias == "qwen2_moe" and entry.transforms == ()


def test_alias_cycle_is_an_error_at_lookup_naming_the_cycle(registry):
    register_checkpoint_conversion_mapping("a", "b")
    register_checkpoint_conversion_mapping("b", "a")
    with pytest.raises(RegistryError, match=r"Alias cycle.*'a' -> 'b' -> 'a'"):
        get_checkpoint_conversion_mapping("a")


def test_alias_to_an_unknown_key_is_an_error_at_lookup_naming_both(registry):
    register_checkpoint_conversion_mapping("qwen2_moe", [_moe_converter()])
    register_checkpoint_conversion_mapping("qwen3_moe", "qwen2_mo")
    with pytest.raises(RegistryError, match=r"'qwen3_moe'.*'qwen2_mo', which is not registered.*'qwen2_moe'"):
        get_checkpoint_conversion_mapping("qwen3_moe")


def test_find_raises_for_a_broken_alias_instead_of_returning_none(registry):
    register_checkpoint_conversion_mapping("a", "missing")
    with pytest.raises(RegistryError, match="not registered"):
        find_checkpoint_conversion_mapping("a")


def test_alias_of_itself_is_rejected_at_registration(registry):
    with pytest.raises(RegistryError, match="alias of itself"):
        register_checkpoint_conversion_mapping("a", "a")


# ---------------------------------------------------------------------- collisions
def test_registering_a_taken_key_fails_naming_old_and_new_entries(registry):
    register_checkpoint_conversion_mapping("mixtral", [_renaming()])
    with pytest.raises(
        RegistryError, match=r"'mixtral' \(1 transform.*'mixtral' \(alias of 'qwen2_moe'.*overwrite=True"
    ):
        register_checkpoint_conversion_mapping("mixtral", "qwen2_moe")


def test_overwrite_replaces_the_entry(registry):
    register_checkpoint_conversion_mapping("mixtral", [_renaming()])
    register_checkpoint_conversion_mapping("mixtral", [_renaming(), _moe_converter()], overwrite=True)
    assert len(get_checkpoint_conversion_mapping("mixtral")) == 2


def test_collision_message_names_the_catalog_that_owns_the_old_entry(registry):
    with registering_catalog("acme"):
        register_catalog_modules("acme")
        register_checkpoint_conversion_mapping("mixtral", [_renaming()])
    with pytest.raises(RegistryError, match="registered by catalog:acme"):
        register_checkpoint_conversion_mapping("mixtral", [_renaming()])


# ---------------------------------------------------------------------- misses
def test_missing_key_raises_registry_error_with_known_keys_and_closest_match(registry):
    register_checkpoint_conversion_mapping("qwen2_moe", [_moe_converter()])
    register_checkpoint_conversion_mapping("mixtral", [_renaming()])
    with pytest.raises(RegistryError) as info:
        get_checkpoint_conversion_mapping("qwen2moe")
    message = str(info.value)
    assert "'qwen2moe'" in message
    assert "closest: 'qwen2_moe'" in message
    assert "Known keys: 'mixtral', 'qwen2_moe'" in message


def test_missing_key_error_is_also_a_key_error(registry):
    with pytest.raises(KeyError):
        get_checkpoint_conversion_mapping("nothing")


def test_missing_key_error_lists_a_bounded_number_of_keys(registry):
    for i in range(40):
        register_checkpoint_conversion_mapping(f"family_{i:02d}", [])
    with pytest.raises(RegistryError, match=r"and 15 more"):
        get_checkpoint_conversion_mapping("nothing")


def test_find_returns_none_for_a_missing_key(registry):
    assert find_checkpoint_conversion_mapping("nothing") is None


# ---------------------------------------------------------------------- validation
@pytest.mark.parametrize("key", ["", 3, None, " padded "], ids=["empty", "int", "none", "spaces"])
def test_invalid_keys_are_rejected(registry, key):
    with pytest.raises(RegistryError, match="non-empty class name or model_type"):
        register_checkpoint_conversion_mapping(key, [])


def test_a_single_transform_must_be_wrapped_in_a_list(registry):
    with pytest.raises(RegistryError, match="wrap it in a list"):
        register_checkpoint_conversion_mapping("toy", _renaming())


def test_a_non_list_value_is_rejected(registry):
    with pytest.raises(RegistryError, match="needs a list of WeightTransform or an alias string, got dict"):
        register_checkpoint_conversion_mapping("toy", {"a": "b"})


def test_an_item_that_is_not_a_transform_is_named_with_its_position(registry):
    with pytest.raises(RegistryError, match=r"item 1 is \('a', 'b'\) \(tuple\), not a WeightTransform"):
        register_checkpoint_conversion_mapping("toy", [_renaming(), ("a", "b")])


def test_a_prescoped_prototype_is_rejected(registry):
    with pytest.raises(RegistryError, match=r"item 0 .* already has a scope_prefix"):
        register_checkpoint_conversion_mapping("toy", [_renaming().scoped("model")])


def test_an_empty_alias_target_is_rejected(registry):
    with pytest.raises(RegistryError, match="alias target"):
        register_checkpoint_conversion_mapping("toy", "")


# ---------------------------------------------------------------------- provenance and known modules
def test_registrations_outside_a_catalog_are_user_entries(registry):
    register_checkpoint_conversion_mapping("toy", [])
    entry = checkpoint_conversion_entry("toy")
    assert entry.provenance == "user" and entry.catalog is None


def test_registrations_inside_a_catalog_are_catalog_entries(registry):
    with registering_catalog("acme"):
        register_catalog_modules("acme")
        register_checkpoint_conversion_mapping("toy", [])
    entry = checkpoint_conversion_entry("toy")
    assert entry.provenance == "catalog:acme" and entry.catalog == "acme"


def test_registrations_from_another_thread_during_a_catalog_stay_user_entries(registry):
    with registering_catalog("acme"):
        register_catalog_modules("acme")
        worker = threading.Thread(target=register_checkpoint_conversion_mapping, args=("from_thread", []))
        worker.start()
        worker.join()
    assert checkpoint_conversion_entry("from_thread").provenance == "user"


def test_declaring_catalog_modules_outside_a_catalog_is_an_error(registry):
    with pytest.raises(RegistryError, match="outside a catalog"):
        register_catalog_modules("acme")


@pytest.mark.parametrize(
    "prefix", ["", ".acme", "acme.", "ac me"], ids=["empty", "lead-dot", "trail-dot", "space"]
)
def test_declaring_a_malformed_module_prefix_is_an_error(registry, prefix):
    with pytest.raises(RegistryError, match="not a dotted module name"), registering_catalog("acme"):
        register_catalog_modules(prefix)


def test_a_catalog_with_mappings_but_no_declared_modules_is_an_error(registry):
    with pytest.raises(RegistryError, match="declared no module prefixes"), registering_catalog("acme"):
        register_checkpoint_conversion_mapping("toy", [])


class _Known:
    pass


class _Sibling:
    pass


class _Unknown:
    pass


_Known.__module__ = "acme"
_Sibling.__module__ = "acme_extra.models"
_Unknown.__module__ = "elsewhere.acme"


def test_a_class_is_known_when_its_module_equals_or_lies_under_a_declared_prefix(registry):
    class Deep:
        pass

    Deep.__module__ = "acme.models.toy"
    with registering_catalog("acme"):
        register_catalog_modules("acme")
    assert is_known_to_catalog(_Known) and is_known_to_catalog(Deep)
    assert is_known_to_catalog(Deep, "acme")


def test_a_prefix_does_not_match_a_longer_module_name_or_a_nested_mention(registry):
    with registering_catalog("acme"):
        register_catalog_modules("acme")
    assert not is_known_to_catalog(_Sibling)
    assert not is_known_to_catalog(_Unknown)


def test_known_modules_are_per_catalog(registry):
    with registering_catalog("acme"):
        register_catalog_modules("acme")
    with registering_catalog("other"):
        register_catalog_modules("elsewhere")
    assert is_known_to_catalog(_Known, "acme") and not is_known_to_catalog(_Known, "other")


# ---------------------------------------------------------------------- snapshots
def test_snapshot_removes_what_was_registered_inside_it(registry):
    with registry_snapshot():
        register_checkpoint_conversion_mapping("temporary", [])
    assert find_checkpoint_conversion_mapping("temporary") is None


def test_snapshot_restores_an_entry_that_was_overwritten_inside_it(registry):
    register_checkpoint_conversion_mapping("toy", [_renaming()])
    with registry_snapshot():
        register_checkpoint_conversion_mapping("toy", [], overwrite=True)
    assert len(get_checkpoint_conversion_mapping("toy")) == 1


def test_cleared_snapshot_starts_empty(registry):
    register_checkpoint_conversion_mapping("toy", [])
    with registry_snapshot(clear=True):
        assert list_checkpoint_conversion_keys() == []
    assert list_checkpoint_conversion_keys() == ["toy"]


def test_reload_catalogs_needs_clear():
    with pytest.raises(RegistryError, match="needs clear=True"), registry_snapshot(reload_catalogs=True):
        pass


# ---------------------------------------------------------------------- entry-point catalogs
def _install_catalog(root: Path, body: str, *, name: str | None = None) -> tuple[str, str]:
    """Write a real distribution (module + dist-info with a surgery.catalogs entry point) under ``root``."""
    module = f"surgery_test_catalog_{uuid.uuid4().hex[:10]}"
    ep_name = name or module
    (root / f"{module}.py").write_text(textwrap.dedent(body))
    info = root / f"{module}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(f"[surgery.catalogs]\n{ep_name} = {module}:register_catalog\n")
    return module, ep_name


_GOOD_CATALOG = """
    import time
    from surgery.registry import register_catalog_modules, register_checkpoint_conversion_mapping
    from surgery.transforms import WeightRenaming

    CALLS = []

    def register_catalog():
        CALLS.append(1)
        time.sleep(0.05)  # widen the window in which concurrent first lookups could race
        register_catalog_modules("acme_models")
        register_checkpoint_conversion_mapping("{key}", [WeightRenaming("a", "b")])
"""


def test_first_lookup_loads_installed_catalogs_as_catalog_entries(tmp_path, monkeypatch):
    key = f"acme_{uuid.uuid4().hex[:8]}"
    _, ep_name = _install_catalog(tmp_path, _GOOD_CATALOG.replace("{key}", key))
    monkeypatch.syspath_prepend(str(tmp_path))
    with registry_snapshot(clear=True, reload_catalogs=True):
        entry = checkpoint_conversion_entry(key)
        assert entry is not None and entry.provenance == f"catalog:{ep_name}"
        assert catalog_modules(ep_name) == ("acme_models",)


def test_concurrent_first_lookups_load_each_catalog_once(tmp_path, monkeypatch):
    key = f"acme_{uuid.uuid4().hex[:8]}"
    module, _ = _install_catalog(tmp_path, _GOOD_CATALOG.replace("{key}", key))
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[bool] = []
    with registry_snapshot(clear=True, reload_catalogs=True):
        threads = [
            threading.Thread(target=lambda: seen.append(find_checkpoint_conversion_mapping(key) is not None))
            for _ in range(8)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert seen == [True] * 8
        assert sys.modules[module].CALLS == [1]


def test_a_catalog_that_raises_is_reported_by_entry_point_name_and_leaves_nothing_behind(
    tmp_path, monkeypatch
):
    body = """
        from surgery.registry import register_catalog_modules, register_checkpoint_conversion_mapping

        def register_catalog():
            register_catalog_modules("acme_models")
            register_checkpoint_conversion_mapping("half_registered", [])
            raise RuntimeError("boom")
    """
    _, ep_name = _install_catalog(tmp_path, body, name="broken_catalog")
    monkeypatch.syspath_prepend(str(tmp_path))
    with registry_snapshot(clear=True, reload_catalogs=True):
        with pytest.raises(RegistryError, match=rf"'{ep_name}'.*RuntimeError: boom"):
            list_checkpoint_conversion_keys()
        with pytest.raises(RegistryError, match="boom"):  # still unloaded: the next access fails again
            find_checkpoint_conversion_mapping("half_registered")


def test_a_catalog_that_cannot_be_imported_is_reported_by_entry_point_name(tmp_path, monkeypatch):
    _install_catalog(tmp_path, "import surgery_no_such_module_anywhere\n", name="unimportable")
    monkeypatch.syspath_prepend(str(tmp_path))
    with (
        registry_snapshot(clear=True, reload_catalogs=True),
        pytest.raises(RegistryError, match=r"'unimportable'.*could not be imported.*ModuleNotFoundError"),
    ):
        list_checkpoint_conversion_keys()


def test_a_catalog_may_look_up_entries_while_it_registers(tmp_path, monkeypatch):
    body = """
        from surgery.registry import (
            get_checkpoint_conversion_mapping, register_catalog_modules, register_checkpoint_conversion_mapping,
        )
        from surgery.transforms import WeightRenaming

        def register_catalog():
            register_catalog_modules("acme_models")
            register_checkpoint_conversion_mapping("acme_base", [WeightRenaming("a", "b")])
            derived = [t for t in get_checkpoint_conversion_mapping("acme_base")] + [WeightRenaming("c", "d")]
            register_checkpoint_conversion_mapping("acme_derived", derived)
    """
    _install_catalog(tmp_path, body)
    monkeypatch.syspath_prepend(str(tmp_path))
    with registry_snapshot(clear=True, reload_catalogs=True):
        assert len(get_checkpoint_conversion_mapping("acme_derived")) == 2


def test_importing_surgery_does_not_load_catalogs_until_the_first_lookup(tmp_path, fresh_python):
    body = """
        import os
        from surgery.registry import register_catalog_modules

        def register_catalog():
            with open(os.environ["SURGERY_TEST_MARKER"], "a") as f:
                f.write("loaded\\n")
            register_catalog_modules("acme_models")
    """
    _module, _ = _install_catalog(tmp_path, body)
    marker = tmp_path / "marker.txt"
    # the fresh interpreter finds the test catalog's entry point on its path, as PYTHONPATH would put it
    script = textwrap.dedent(
        f"""
        import os, sys
        sys.path.insert(0, {str(tmp_path)!r})
        os.environ["SURGERY_TEST_MARKER"] = marker = {str(marker)!r}
        import surgery, surgery.graph, surgery.resolution
        from surgery.registry import list_checkpoint_conversion_keys
        assert not os.path.exists(marker), "catalog loaded at import"
        list_checkpoint_conversion_keys()
        list_checkpoint_conversion_keys()
        print(open(marker).read().count("loaded"))
        """
    )
    assert fresh_python(script) == "1"
