r"""Routing checkpoint keys through a transform list (:mod:`surgery.routing`).

The spec tests pin down what :func:`route_keys` means. The template cache must be invisible:
the property tests compare ``route_keys`` with ``route_keys(..., cache=False)`` (every key routed
on its own) on random transform lists and keys, including patterns the cache must refuse.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from surgery import CheckpointError, ConfigurationError, PrefixChange, WeightConverter, WeightRenaming, ops
from surgery.bench.route import mixtral_mapping
from surgery.checkpoint import write_checkpoint
from surgery.routing import BasePrefix, KeyLimits, KeyRoute, RouteConflict, Routing, route_key, route_keys
from surgery.transforms import WeightTransform, legacy_renamings

# --------------------------------------------------------------------------- fixtures


def mixtral_keys(layers: int = 12, experts: int = 12) -> list[str]:
    keys = ["model.embed_tokens.weight", "lm_head.weight"]
    for layer in range(layers):
        p = f"model.layers.{layer}."
        keys += [f"{p}self_attn.{x}_proj.weight" for x in "qkvo"]
        keys += [f"{p}input_layernorm.weight", f"{p}block_sparse_moe.gate.weight"]
        keys += [f"{p}block_sparse_moe.experts.{e}.w{w}.weight" for e in range(experts) for w in (1, 2, 3)]
    return keys


def assert_same_routing(fast: Routing, exact: Routing) -> None:
    """Equal, and equal in every order a caller could observe."""
    assert fast == exact
    assert list(fast.routes) == list(exact.routes)
    assert [fast.routes[k] for k in fast.routes] == [exact.routes[k] for k in exact.routes]
    assert list(fast.groups) == list(exact.groups)
    for key, group in fast.groups.items():
        other = exact.groups[key]
        assert list(group.sources) == list(other.sources)
        assert group.source_keys == other.source_keys  # each slot is a mapping: its order is not promised
    assert fast.conflicts == exact.conflicts
    assert fast.fired() == exact.fired()


def assert_same_outcome(fast: Routing | tuple[str, str], exact: Routing | tuple[str, str]) -> None:
    """Both paths raised the same error, or both routed alike (see :func:`outcome`)."""
    if isinstance(exact, tuple):
        assert fast == exact
    else:
        assert isinstance(fast, Routing)
        assert_same_routing(fast, exact)


def outcome(fn, *args, **kwargs):  # type: ignore[no-untyped-def]
    try:
        return fn(*args, **kwargs)
    except ConfigurationError as exc:
        return ("ConfigurationError", str(exc))


def uncached(keys: list[str], transforms: list[WeightTransform], **kwargs: object) -> Routing:
    return route_keys(keys, transforms, cache=False, **kwargs)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- spec: route_keys


def test_renamings_chain_in_list_order() -> None:
    transforms = [WeightRenaming(r"\.a\.", ".b."), WeightRenaming(r"\.b\.", ".c.")]
    route = route_keys(["x.a.weight"], transforms).routes["x.a.weight"]
    assert route.target_key == "x.c.weight"
    assert route.renamings == (0, 1)


def test_renamings_fire_before_a_converter_listed_earlier() -> None:
    transforms = [
        WeightConverter("mlp.experts.*.w2.weight", "mlp.experts.down_proj", [ops.MergeModulelist(0)]),
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
    ]
    route = route_keys(["m.block_sparse_moe.experts.0.w2.weight"], transforms).routes[
        "m.block_sparse_moe.experts.0.w2.weight"
    ]
    assert (route.target_key, route.renamings, route.converter) == ("m.mlp.experts.down_proj", (1,), 0)


def test_a_converter_claims_only_the_keys_it_matches() -> None:
    routing = route_keys(
        ["a.qkv.weight", "a.o.weight"],
        [WeightConverter("qkv.weight", ["q.weight", "k.weight"], [ops.Chunk(0)])],
    )
    assert routing.routes["a.qkv.weight"].converter == 0
    assert routing.groups["a.q.weight"].target_keys == ("a.q.weight", "a.k.weight")
    assert routing.routes["a.o.weight"].converter is None
    assert routing.groups["a.o.weight"].target_keys == ("a.o.weight",)


def test_two_converters_claiming_one_key_raise_with_both_patterns() -> None:
    transforms = [
        WeightConverter("experts.*.w1.weight", "experts.gate", [ops.MergeModulelist(0)]),
        WeightConverter(r"w1\.weight", "w1_renamed.weight", []),
    ]
    with pytest.raises(ConfigurationError, match=r"experts\.\*\.w1\.weight.*w1\\\\\.weight"):
        route_keys([f"l.{i}.experts.{e}.w1.weight" for i in range(3) for e in range(3)], transforms)


def test_two_keys_landing_on_one_target_conflict_and_the_first_is_kept() -> None:
    routing = route_keys(["a.gamma", "a.weight"], [WeightRenaming(r"\.gamma$", ".weight")])
    assert routing.conflicts == [RouteConflict("a.weight", "a.gamma", "a.weight")]
    assert routing.groups["a.weight"].source_keys == ["a.gamma"]
    assert routing.routes["a.weight"].target_key == "a.weight"  # still routed, just not filed


def test_a_plain_key_landing_on_a_converter_target_conflicts() -> None:
    transforms = [WeightConverter("experts.*.w2.weight", "experts.down", [ops.MergeModulelist(0)])]
    keys = ["m.experts.0.w2.weight", "m.experts.1.w2.weight", "m.experts.down"]
    routing = route_keys(keys, transforms)
    assert routing.conflicts == [RouteConflict("m.experts.down", "m.experts.0.w2.weight", "m.experts.down")]


def test_base_model_prefix_is_added_when_that_names_a_runtime_key() -> None:
    routing = route_keys(["layers.0.w"], [], runtime_keys={"model.layers.0.w"}, base_model_prefix="model")
    route = routing.routes["layers.0.w"]
    assert (route.target_key, route.base_prefix) == ("model.layers.0.w", BasePrefix.ADDED_AFTER)


def test_base_model_prefix_is_stripped_when_that_names_a_runtime_key() -> None:
    routing = route_keys(["model.layers.0.w"], [], runtime_keys={"layers.0.w"}, base_model_prefix="model")
    route = routing.routes["model.layers.0.w"]
    assert (route.target_key, route.base_prefix) == ("layers.0.w", BasePrefix.STRIPPED_AFTER)


def test_base_model_prefix_is_stripped_from_the_renamed_key_like_transformers() -> None:
    # A checkpoint of the model with a head, loaded into the bare base model: rename first
    # (model.X -> model.language_model.X), then strip the prefix (language_model.X).
    renaming = WeightRenaming(r"^model\.(?!language_model)", "model.language_model.")
    routing = route_keys(
        ["model.layers.0.w"],
        [renaming],
        runtime_keys={"language_model.layers.0.w"},
        base_model_prefix="model",
    )
    route = routing.routes["model.layers.0.w"]
    assert (route.target_key, route.base_prefix) == ("language_model.layers.0.w", BasePrefix.STRIPPED_AFTER)


def test_base_model_prefix_is_added_to_the_checkpoint_key_when_a_scoped_transform_needs_it() -> None:
    scoped = WeightRenaming(r"^old\.", "new.", scope_prefix="model")
    routing = route_keys(["old.w"], [scoped], runtime_keys={"model.new.w"}, base_model_prefix="model")
    route = routing.routes["old.w"]
    assert (route.target_key, route.base_prefix) == ("model.new.w", BasePrefix.ADDED_BEFORE)


def test_base_model_prefix_is_left_alone_when_neither_form_is_a_runtime_key() -> None:
    routing = route_keys(["layers.0.w"], [], runtime_keys={"other.w"}, base_model_prefix="model")
    route = routing.routes["layers.0.w"]
    assert (route.target_key, route.base_prefix) == ("layers.0.w", BasePrefix.UNUSED)


def test_base_model_prefix_is_left_alone_when_the_key_already_names_a_runtime_key() -> None:
    runtime = {"layers.0.w", "model.layers.0.w"}
    routing = route_keys(["layers.0.w"], [], runtime_keys=runtime, base_model_prefix="model")
    assert routing.routes["layers.0.w"].base_prefix == ""


def test_wildcard_indices_are_recorded_per_key() -> None:
    routing = route_keys(mixtral_keys(2, 12), mixtral_mapping())
    route = routing.routes["model.layers.1.block_sparse_moe.experts.11.w3.weight"]
    assert route.index == (11,)
    assert route.pattern_index == 1
    assert route.target_key == "model.layers.1.mlp.experts.gate_up_proj"


def test_group_sources_are_ordered_by_numeric_index() -> None:
    keys = [f"m.experts.{e}.w2.weight" for e in (10, 2, 1, 0, 11, 3, 4, 5, 6, 7, 8, 9)]
    transforms = [WeightConverter("experts.*.w2.weight", "experts.down", [ops.MergeModulelist(0)])]
    group = route_keys(keys, transforms).groups["m.experts.down"]
    assert group.source_keys == [f"m.experts.{e}.w2.weight" for e in range(12)]


def test_group_sources_follow_pattern_order_then_index() -> None:
    group = route_keys(mixtral_keys(1, 3), mixtral_mapping()).groups[
        "model.layers.0.mlp.experts.gate_up_proj"
    ]
    expected = [f"model.layers.0.block_sparse_moe.experts.{e}.w{w}.weight" for w in (1, 3) for e in range(3)]
    assert group.source_keys == expected


def test_fired_lists_the_transforms_that_fired() -> None:
    mapping = mixtral_mapping()  # legacy gamma, legacy beta, block rename, two converters
    routing = route_keys(mixtral_keys(2, 2), mapping)
    assert [mapping[i] for i in routing.fired()] == [mapping[2], mapping[3], mapping[4]]
    assert routing.fired(["model.layers.0.self_attn.q_proj.weight"]) == []


def test_routes_hold_one_record_per_key_in_key_order() -> None:
    keys = mixtral_keys(3, 3)
    routes = route_keys(keys, mixtral_mapping()).routes
    assert list(routes) == keys and len(routes) == len(keys)
    assert all(isinstance(routes[k], KeyRoute) and routes[k].source_key == k for k in keys)


def test_route_key_matches_route_keys() -> None:
    keys = mixtral_keys(2, 3)
    routing = route_keys(keys, mixtral_mapping())
    assert all(route_key(k, mixtral_mapping()) == routing.routes[k] for k in keys)


def test_a_key_that_is_not_a_string_is_a_configuration_error() -> None:
    with pytest.raises(ConfigurationError, match="must be strings"):
        route_keys(["a.weight", 3], [])  # type: ignore[list-item]


# --------------------------------------------------------------------------- the cache is invisible


def test_mixtral_routing_equals_uncached_routing() -> None:
    keys, transforms = mixtral_keys(14, 12), mixtral_mapping()
    assert_same_routing(route_keys(keys, transforms), uncached(keys, transforms))


def test_expert_indices_of_every_width_route_like_uncached_routing() -> None:
    keys, transforms = mixtral_keys(6, 128), mixtral_mapping()  # experts 0-9, 10-99, 100-127
    assert_same_routing(route_keys(keys, transforms), uncached(keys, transforms))


def test_a_digit_literal_in_a_pattern_fires_only_on_its_index() -> None:
    transforms = [WeightRenaming(r"layers\.0\.", "first."), *mixtral_mapping()]
    keys = mixtral_keys(12, 3)
    routing = route_keys(keys, transforms)
    assert (
        routing.routes["model.layers.0.input_layernorm.weight"].target_key
        == "model.first.input_layernorm.weight"
    )
    assert (
        routing.routes["model.layers.10.input_layernorm.weight"].target_key
        == "model.layers.10.input_layernorm.weight"
    )
    assert_same_routing(routing, uncached(keys, transforms))


def test_a_scope_with_digits_fires_only_under_its_index() -> None:
    transforms = [
        WeightRenaming(r"^self_attn\.", "attention.", scope_prefix="model.layers.1"),
        *mixtral_mapping(),
    ]
    keys = mixtral_keys(14, 2)
    routing = route_keys(keys, transforms)
    assert (
        routing.routes["model.layers.1.self_attn.q_proj.weight"].target_key
        == "model.layers.1.attention.q_proj.weight"
    )
    assert (
        routing.routes["model.layers.11.self_attn.q_proj.weight"].target_key
        == "model.layers.11.self_attn.q_proj.weight"
    )
    assert_same_routing(routing, uncached(keys, transforms))


@pytest.mark.parametrize("first", [1, 2], ids=["matching-key-first", "other-key-first"])
def test_a_renaming_that_glues_an_index_to_a_name_still_routes_exactly(first: int) -> None:
    # After ``layer\1_x.`` the index sits next to letters, where the ``r1_x`` literal sees it.
    transforms = [WeightRenaming(r"layers\.(\d+)\.", r"layer\1_x."), WeightConverter(r"r1_x\.w", "hit", [])]
    keys = [f"layers.{i}.w" for i in (first, 3 - first, 5, 11, 12, 21)] + [f"layer{i}.w" for i in (1, 2, 11)]
    routing = route_keys(keys, transforms)
    assert routing.routes["layers.1.w"].target_key == "layehit"  # the match "r1_x.w" is replaced
    assert routing.routes["layers.2.w"].target_key == "layer2_x.w"
    assert_same_routing(routing, uncached(keys, transforms))


def test_a_renaming_that_reorders_digits_routes_exactly() -> None:
    transforms = [WeightRenaming(r"experts\.(\d)(\d)\.", r"experts.\2\1."), *mixtral_mapping()]
    keys = mixtral_keys(2, 30)
    routing = route_keys(keys, transforms)
    assert routing.routes["model.layers.0.block_sparse_moe.experts.12.w1.weight"].index == (21,)
    assert_same_routing(routing, uncached(keys, transforms))


def test_two_wildcards_keep_their_order_in_the_index() -> None:
    transforms = [
        WeightConverter("layers.*.blocks.*.fc2.weight", "layers.*.blocks.fc2", [ops.MergeModulelist(0)])
    ]
    keys = [f"m.layers.{layer}.blocks.{block}.fc2.weight" for layer in (0, 1, 2, 10) for block in (0, 1, 2)]
    routing = route_keys(keys, transforms)
    assert routing.routes["m.layers.1.blocks.2.fc2.weight"].index == (1, 2)
    assert routing.groups["m.layers.10.blocks.fc2"].source_keys == [
        f"m.layers.10.blocks.{b}.fc2.weight" for b in range(3)
    ]
    assert_same_routing(routing, uncached(keys, transforms))


def test_duplicate_keys_route_like_uncached_routing() -> None:
    keys, transforms = mixtral_keys(2, 2), mixtral_mapping()
    keys += keys[3:9]
    assert_same_routing(route_keys(keys, transforms), uncached(keys, transforms))


def test_a_key_with_a_newline_routes_like_uncached_routing() -> None:
    keys = ["a.\n1.weight", "a.2.weight", "a.3.weight", "a.4\n.weight"]
    transforms = [WeightRenaming(r"^a\.", "b.")]
    assert_same_routing(route_keys(keys, transforms), uncached(keys, transforms))


def test_keys_with_lone_surrogates_and_non_ascii_text_route_like_uncached_routing() -> None:
    keys = ["m.\ud800.1.w", "m.\ud800.2.w", "m.é.3.w", "m.é.4.w", "m.\ud800.12.w"]
    transforms = [WeightConverter(r"\.*\.w$", ".stacked", [ops.MergeModulelist(dim=0)])]
    assert_same_routing(route_keys(keys, transforms), uncached(keys, transforms))


def test_a_conflict_far_from_the_first_key_is_reported_in_key_order() -> None:
    keys = mixtral_keys(30, 12)
    keys.insert(600, "model.layers.2.block_sparse_moe.experts.3.w2.weight")  # index 3 again
    keys.append("model.layers.0.block_sparse_moe.experts.0.w1.weight")  # a duplicate
    transforms = mixtral_mapping()
    routing = route_keys(keys, transforms)
    assert [(c.first, c.second) for c in routing.conflicts] == [
        ("model.layers.2.block_sparse_moe.experts.3.w2.weight", keys[600]),
        ("model.layers.0.block_sparse_moe.experts.0.w1.weight", keys[-1]),
    ]
    assert_same_routing(routing, uncached(keys, transforms))


def test_an_index_with_a_leading_zero_is_not_an_index() -> None:
    """``experts.03`` is not expert 3: the wildcard matches canonical indices only."""
    keys = [*mixtral_keys(2, 4), "model.layers.1.block_sparse_moe.experts.03.w2.weight"]
    transforms = mixtral_mapping()
    routing = route_keys(keys, transforms)
    assert routing.conflicts == []
    odd = routing.routes["model.layers.1.block_sparse_moe.experts.03.w2.weight"]
    assert odd.converter is None
    assert_same_routing(routing, uncached(keys, transforms))


def test_the_first_key_two_converters_claim_is_the_one_named() -> None:
    transforms = [
        WeightConverter("experts.*.w1.weight", "experts.gate", [ops.MergeModulelist(0)]),
        WeightConverter(r"s\.7\.w1\.weight", "seven.weight", []),
    ]
    keys = [f"l.experts.{e}.w1.weight" for e in range(12)]
    with pytest.raises(ConfigurationError, match=r"'l\.experts\.7\.w1\.weight'"):
        route_keys(keys, transforms)


# --------------------------------------------------------------------------- property: random lists

_SCOPES = [None, None, None, "model", "model.layers.1", "model.layers.10", "encoder.0", "layers"]
_RENAMINGS = [
    lambda s: WeightRenaming(r"\.block_sparse_moe\.", ".mlp.", scope_prefix=s),
    lambda s: WeightRenaming(r"LayerNorm\.gamma", "LayerNorm.weight", scope_prefix=s),
    lambda s: WeightRenaming(r"layers\.(\d+)\.self_attn", r"blocks.\1.attention", scope_prefix=s),
    lambda s: WeightRenaming(r"layers\.(\d+)\.", r"layer\1_x.", scope_prefix=s),
    lambda s: WeightRenaming(r"\.fc1\.", ".up.", scope_prefix=s),
    lambda s: WeightRenaming(r"(\d+)\.w(\d)\.", r"\1.w\2x.", scope_prefix=s),
    lambda s: WeightRenaming(r"^model\.", "", scope_prefix=s),
    lambda s: PrefixChange(prefix_to_add="model", scope_prefix=s),
    lambda s: PrefixChange(prefix_to_remove="model", scope_prefix=s),
    lambda s: WeightRenaming(r"experts\.(\d)(\d)\.", r"experts.\2\1.", scope_prefix=s),
    lambda s: WeightRenaming(r"\.(\d+)\.(\d+)\.", r".\2.\1.", scope_prefix=s),
    lambda s: WeightRenaming(r"w1", "wA", scope_prefix=s),
    lambda s: WeightRenaming(r"layers\.0\.", "first.", scope_prefix=s),  # unsafe: a digit literal
    lambda s: WeightRenaming(r"experts\.[0-3]\.", "low.", scope_prefix=s),  # unsafe: a digit subset
]
_CONVERTERS = [
    lambda s: WeightConverter(
        ["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],
        "mlp.experts.gate_up_proj",
        [ops.MergeModulelist(0), ops.Concatenate(1)],
        scope_prefix=s,
    ),
    lambda s: WeightConverter(
        "experts.*.w2.weight", "experts.down_proj", [ops.MergeModulelist(0)], scope_prefix=s
    ),
    lambda s: WeightConverter(
        "qkv.weight", ["q.weight", "k.weight", "v.weight"], [ops.Chunk(0)], scope_prefix=s
    ),
    lambda s: WeightConverter(
        r"layers\.(\d+)\.mlp\.gate\.weight", r"layers.\1.router.weight", [], scope_prefix=s
    ),
    lambda s: WeightConverter("blocks.*.fc2.weight", "blocks.fc2", [ops.MergeModulelist(0)], scope_prefix=s),
    lambda s: WeightConverter(r"r1_x\.w", "glued.w", [], scope_prefix=s),  # sees an index a renaming glued
    lambda s: WeightConverter(  # two wildcards: the layer is kept, the block gathered
        "layers.*.blocks.*.fc2.weight", "layers.*.blocks.fc2", [ops.MergeModulelist(0)], scope_prefix=s
    ),
]
_MODULES = [
    "block_sparse_moe.experts.{E}.w{w}.weight",
    "mlp.experts.{E}.w{w}.weight",
    "self_attn.q_proj.weight",
    "mlp.fc1.weight",
    "LayerNorm.gamma",
    "conv2d_3x3.weight",
    "blocks.{E}.fc2.weight",
    "qkv.weight",
    "mlp.gate.weight",
    "{E}.{L}.weight",
    "experts.{E}.w2.weight",
    "w{w}.{E}",
]
_INDICES = ["0", "1", "2", "3", "7", "9", "10", "11", "12", "99", "100", "101", "05", "1000"]


@st.composite
def transform_lists(draw: st.DrawFn) -> list[WeightTransform]:
    makers = draw(st.lists(st.sampled_from(_RENAMINGS), max_size=4))
    makers += draw(st.lists(st.sampled_from(_CONVERTERS), max_size=3))
    transforms = [make(draw(st.sampled_from(_SCOPES))) for make in makers]
    if draw(st.booleans()):
        transforms += legacy_renamings()
    return draw(st.permutations(transforms))


@st.composite
def key_lists(draw: st.DrawFn) -> list[str]:
    heads = draw(
        st.lists(st.sampled_from(["", "model.", "encoder.0.", "x."]), min_size=1, max_size=2, unique=True)
    )
    modules = draw(st.lists(st.sampled_from(_MODULES), min_size=1, max_size=3, unique=True))
    layers = draw(st.lists(st.sampled_from(_INDICES), min_size=1, max_size=5, unique=True))
    experts = draw(st.lists(st.sampled_from(_INDICES), min_size=1, max_size=5, unique=True))
    keys = [
        f"{h}layers.{layer}." + m.format(E=e, w=w, L=layer)
        for h in heads
        for m in modules
        for layer in layers
        for e in experts
        for w in (1, 2, 3)
    ]
    keys = list(dict.fromkeys(keys))
    if draw(st.booleans()):
        keys = draw(st.permutations(keys))
    extra = draw(st.lists(st.sampled_from(keys), max_size=2))
    return keys + extra


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(transforms=transform_lists(), keys=key_lists())
def test_cached_routing_equals_uncached_routing(transforms: list[WeightTransform], keys: list[str]) -> None:
    assert_same_outcome(outcome(route_keys, keys, transforms), outcome(uncached, keys, transforms))


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(transforms=transform_lists(), keys=key_lists(), data=st.data())
def test_cached_routing_equals_uncached_routing_with_base_model_prefix(
    transforms: list[WeightTransform], keys: list[str], data: st.DataObject
) -> None:
    runtime = set(data.draw(st.lists(st.sampled_from(keys), max_size=len(keys) // 2)))
    runtime |= {"model." + k for k in data.draw(st.lists(st.sampled_from(keys), max_size=5))}
    runtime |= {k.removeprefix("model.") for k in data.draw(st.lists(st.sampled_from(keys), max_size=5))}
    kwargs = {"runtime_keys": runtime, "base_model_prefix": "model"}
    assert_same_outcome(
        outcome(route_keys, keys, transforms, **kwargs), outcome(uncached, keys, transforms, **kwargs)
    )


# --------------------------------------------------------------------------- property: experts of several widths

_MOE_MODULES = [
    "mlp.experts.{E}.w{w}.weight",
    "block_sparse_moe.experts.{E}.w{w}.weight",
    "blocks.{E}.fc2.weight",
    "experts.{E}.w2.weight",
    "self_attn.q_proj.weight",
]


@st.composite
def moe_transform_lists(draw: st.DrawFn) -> list[WeightTransform]:
    """Both expert converters and the blocks converter (so families can share), plus a random rest."""
    makers = [*_CONVERTERS[:2], _CONVERTERS[4], *draw(st.lists(st.sampled_from(_RENAMINGS), max_size=3))]
    makers += draw(st.lists(st.sampled_from(_CONVERTERS[2:4]), max_size=1))
    scopes = draw(st.sampled_from([[None], _SCOPES]))
    return draw(st.permutations([make(draw(st.sampled_from(scopes))) for make in makers]))


@st.composite
def moe_key_lists(draw: st.DrawFn) -> list[str]:
    """Expert keys whose indices come in several widths, sometimes with a fourth projection last."""
    heads = draw(st.lists(st.sampled_from(["", "model.", "x."]), min_size=1, max_size=2, unique=True))
    modules = draw(st.lists(st.sampled_from(_MOE_MODULES), min_size=1, max_size=3, unique=True))
    layers = draw(
        st.lists(
            st.sampled_from(["0", "1", "7", "10", "12", "100", "05"]), min_size=1, max_size=3, unique=True
        )
    )
    experts = draw(st.lists(st.sampled_from(_INDICES), min_size=2, max_size=8, unique=True))
    projections = (1, 2, 3, 4) if draw(st.booleans()) else (1, 2, 3)
    keys = [
        f"{h}layers.{layer}." + m.format(E=e, w=w)
        for w in projections
        for h in heads
        for m in modules
        for layer in layers
        for e in experts
    ]
    keys = list(dict.fromkeys(keys))
    if draw(st.booleans()):
        keys = draw(st.permutations(keys))
    return keys + draw(st.lists(st.sampled_from(keys), max_size=1))


@settings(
    max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(transforms=moe_transform_lists(), keys=moe_key_lists(), with_prefix=st.booleans(), data=st.data())
def test_cached_routing_equals_uncached_routing_for_experts_of_several_widths(
    transforms: list[WeightTransform], keys: list[str], with_prefix: bool, data: st.DataObject
) -> None:
    kwargs: dict[str, object] = {}
    if with_prefix:
        runtime = set(data.draw(st.lists(st.sampled_from(keys), max_size=len(keys) // 2)))
        runtime |= {"model." + k for k in data.draw(st.lists(st.sampled_from(keys), max_size=5))}
        kwargs = {"runtime_keys": runtime, "base_model_prefix": "model"}
    assert_same_outcome(
        outcome(route_keys, keys, transforms, **kwargs), outcome(uncached, keys, transforms, **kwargs)
    )


def test_an_index_with_more_digits_than_python_converts_is_a_checkpoint_error() -> None:
    transforms = [WeightConverter("experts.*.w1.weight", "experts.gate", [ops.MergeModulelist(0)])]
    key = "m.experts." + "9" * 5_000 + ".w1.weight"
    for cache in (True, False):
        with pytest.raises(CheckpointError, match="index too long"):
            route_keys([key], transforms, cache=cache)


def test_copies_of_one_converter_at_nested_scopes_do_not_conflict_and_the_innermost_claims() -> None:
    """One mapping resolved for a sub-model and for its ancestor gives the same conversion."""
    copies = [
        WeightConverter(
            r"mlp\.experts\.*\.w\.weight", "mlp.experts.w", [ops.MergeModulelist(0)], scope_prefix=s
        )
        for s in ("", "thinker", "thinker.model")
    ]
    keys = [f"thinker.model.layers.0.mlp.experts.{e}.w.weight" for e in range(2)]
    routing = route_keys(keys, copies)
    assert not routing.conflicts
    assert {routing.routes[k].converter for k in keys} == {2}


def test_two_different_converters_on_one_key_still_conflict() -> None:
    a = WeightConverter(r"mlp\.experts\.*\.w\.weight", "mlp.experts.w", [ops.MergeModulelist(0)])
    b = WeightConverter(
        r"mlp\.experts\.*\.w\.weight", "mlp.experts.w", [ops.MergeModulelist(1)], scope_prefix="m"
    )
    with pytest.raises(ConfigurationError, match="Two converters claim"):
        route_keys(["m.mlp.experts.0.w.weight"], [a, b])


def test_index_offset_renaming_moves_the_index_and_its_reverse_moves_it_back() -> None:
    from surgery.transforms import IndexOffsetRenaming

    forward = IndexOffsetRenaming(r"attn_queries\.(\d+)", r"layers.\1.query", offset=1)
    routes = route_keys(["model.attn_queries.0.weight", "model.attn_queries.11.weight"], [forward]).routes
    assert routes["model.attn_queries.0.weight"].target_key == "model.layers.1.query.weight"
    assert routes["model.attn_queries.11.weight"].target_key == "model.layers.12.query.weight"
    back = forward.reverse_transform()
    assert back.rename_source_key("model.layers.12.query.weight")[0] == "model.attn_queries.11.weight"
    assert back.rename_source_key("model.layers.0.query.weight")[1] is None  # would be index -1: no match
    assert not forward.digit_blind  # keys differing in digits route differently


def test_index_offset_renaming_needs_a_group_holding_the_index() -> None:
    from surgery.errors import PatternError
    from surgery.transforms import IndexOffsetRenaming

    with pytest.raises(PatternError, match="capture group"):
        IndexOffsetRenaming(r"attn_queries\.0", "layers.1.query", offset=1)


def test_two_converters_of_different_recipes_claiming_one_key_are_refused_naming_both() -> None:
    outer = WeightConverter(r"mixer\.experts\.up_proj", r"mixer.experts.fused", [ops.Transpose(1, 2)])
    inner = WeightConverter(
        r"mixer\.experts\.up_proj",
        "mixer.experts.*.up_proj.weight",
        [ops.SplitModulelist(0)],
        scope_prefix="lm",
    )
    key = "lm.layers.0.mixer.experts.up_proj"
    with pytest.raises(ConfigurationError, match=r"Two converters claim .*fused.*\*\.up_proj"):
        route_keys([key], [outer, inner])


def test_index_offset_renaming_refuses_bad_options_naming_the_fix() -> None:
    from surgery.errors import PatternError
    from surgery.transforms import IndexOffsetRenaming

    with pytest.raises(ConfigurationError, match="must be an int"):
        IndexOffsetRenaming(r"q\.(\d+)", r"layers.\1.q", offset=1.5)  # type: ignore[arg-type]
    with pytest.raises(PatternError, match=r"place the index with \\1"):
        IndexOffsetRenaming(r"q\.(\d+)", "layers.q", offset=1)
    padded = IndexOffsetRenaming(r"q\.(\d+)", r"layers.\1.q", offset=1)
    assert padded.rename_source_key("q.09.w")[1] is None  # would not come back as "09"


# --------------------------------------------------------------------------- keys a file makes hostile


@dataclass
class _Count:
    calls: int = 0
    characters: int = 0


class CountingRenaming(WeightRenaming):
    """A renaming that counts the keys matched against it and their characters (a real transform).

    The counts live in a mutable tally the renaming holds: the transform itself is immutable.
    """

    def __init__(self, *args: object, **kwargs: object) -> None:
        self._count = _Count()
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    @property
    def calls(self) -> int:
        return self._count.calls

    @property
    def characters(self) -> int:
        return self._count.characters

    def match(self, key: str):  # type: ignore[no-untyped-def]
        self._count.calls += 1
        self._count.characters += len(key)
        return super().match(key)


def test_a_key_beyond_the_limits_that_names_no_runtime_key_is_oversized_and_no_transform_runs() -> None:
    gamma = CountingRenaming(r"\.gamma$", ".weight")
    deep = "model." + "0." * 100 + "gamma"  # 102 components: the default floor is 64
    routing = route_keys([deep, "model.norm.gamma"], [gamma], runtime_keys={"model.norm.weight"})
    assert routing.oversized == [deep]
    assert routing.routes[deep] == KeyRoute(deep, deep)  # to itself: reported unexpected
    assert routing.routes["model.norm.gamma"].target_key == "model.norm.weight"
    assert gamma.calls == 1  # the other key only
    assert routing.limits == KeyLimits(max_length=4096, max_components=64)


def test_a_key_beyond_the_limits_that_names_a_runtime_key_is_routed_exactly() -> None:
    long_name = "model." + "block." * 20 + "weight"
    runtime = {long_name, "model.norm.weight"}
    limits = KeyLimits(max_length=40, max_components=4)
    keys = [long_name, long_name.removeprefix("model."), "x." * 30 + "weight"]
    routing = route_keys(keys, [], runtime_keys=runtime, base_model_prefix="model", limits=limits)
    assert routing.routes[keys[0]] == KeyRoute(keys[0], long_name)
    assert routing.routes[keys[1]] == KeyRoute(keys[1], long_name, base_prefix=BasePrefix.ADDED_AFTER)
    assert routing.oversized == [keys[2]]


def test_keys_are_held_to_limits_only_when_the_runtime_keys_are_known() -> None:
    deep = "a." * 100 + "gamma"
    routing = route_keys([deep], [WeightRenaming(r"\.gamma$", ".weight")])
    assert routing.oversized == [] and routing.limits is None
    assert routing.routes[deep].target_key == "a." * 100 + "weight"


def test_default_limits_stay_twice_above_the_models_own_longest_and_deepest_key() -> None:
    assert KeyLimits.for_runtime_keys(["a.b"]) == KeyLimits()
    deep = "m." * 99 + "weight"  # 100 components, 204 characters
    assert KeyLimits.for_runtime_keys([deep, "x" * 3000]) == KeyLimits(max_length=6000, max_components=200)
    routing = route_keys([deep], [], runtime_keys={deep})
    assert routing.oversized == [] and routing.routes[deep].target_key == deep


@pytest.mark.parametrize(
    "value", [0, -1, 1.5, True, "64", None], ids=["zero", "negative", "float", "bool", "str", "none"]
)
def test_key_limits_refuse_anything_but_a_positive_int_naming_the_field(value: object) -> None:
    with pytest.raises(ConfigurationError, match=r"KeyLimits\.max_components must be a positive int"):
        KeyLimits(max_components=value)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="limits must be a KeyLimits"):
        route_keys([], [], runtime_keys=set(), limits={"max_length": 1})  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "key",
    [
        "model.layers." + "0." * 17 + "w1.weight",  # one numeric component more than a template holds
        "model.layers.0." + "w" * 1100 + ".weight",  # longer than a template may be
    ],
    ids=["17-numeric-components", "1100-characters"],
)
def test_a_key_that_cannot_be_a_template_is_routed_exactly_once_and_never_probed(key: str) -> None:
    counter = CountingRenaming(r"\.gamma$", ".weight")
    twins = [key.replace("0", "1", 1), key.replace("0", "2", 1), key]
    routing = route_keys(twins, [counter])
    assert counter.calls == len(twins)
    assert_same_routing(routing, uncached(twins, [counter]))


def test_probing_templates_costs_at_most_about_as_much_as_routing_every_key_once() -> None:
    """Keys a file invents, each of its own template of 16 numeric components: learning every one
    would route 32 probe keys per key; learning is paid from the characters routed exactly."""
    keys = [f"k{i}" + ".1" * 16 + ".w.gamma" for i in range(2000)]
    counter = CountingRenaming(r"\.gamma$", ".weight")
    routing = route_keys(keys, [counter])
    total = sum(map(len, keys))
    assert counter.characters <= 3 * total  # was 33 times
    assert_same_routing(routing, uncached(keys, [counter]))


def test_a_template_is_still_learned_once_and_shared_by_keys_of_many_components() -> None:
    keys = ["m" + "".join(f".{(i * 7 + j) % 10}" for j in range(16)) + ".gamma" for i in range(200)]
    counter = CountingRenaming(r"\.gamma$", ".weight")
    route_keys(keys, [counter])
    assert counter.calls <= 1 + 2 * 16  # the first key and its probes; 199 replays


@st.composite
def deep_key_lists(draw: st.DrawFn) -> list[str]:
    """Keys of 12 to 20 numeric components (a template holds 16), in a few families."""
    lists = []
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(12, 20))
        head = draw(st.sampled_from(["model.layers", "x.blocks", "experts"]))
        tail = draw(st.sampled_from(["w1.weight", "gamma", "fc2.weight", "experts.3.w2.weight"]))
        for _ in range(draw(st.integers(1, 4))):
            digits = draw(
                st.lists(st.sampled_from(["0", "1", "7", "10", "12", "99", "05"]), min_size=n, max_size=n)
            )
            lists.append(".".join([head, *digits, tail]))
    return lists


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
@given(transforms=transform_lists(), keys=deep_key_lists())
def test_cached_routing_equals_uncached_routing_around_the_template_component_limit(
    transforms: list[WeightTransform], keys: list[str]
) -> None:
    assert_same_outcome(outcome(route_keys, keys, transforms), outcome(uncached, keys, transforms))


def test_every_catalog_mapping_routes_a_long_key_in_time_linear_in_its_length() -> None:
    """A key within the limits still runs every pattern: none may backtrack quadratically.

    A pattern like ``([a-z_]+)\\.nothing`` takes 0.08 s / 0.32 s / 2.0 s on keys of 4 / 8 / 16 KiB
    (about 30 s at 64 KiB); the catalog's slowest mapping takes about 0.1 s at 64 KiB.
    """
    import time

    from surgery.registry import get_checkpoint_conversion_mapping, list_checkpoint_conversion_keys

    n = 1 << 16
    keys = ["x" * n, "0." * (n // 2) + "weight", "model.layers." + "1" * n + ".mlp", "a_" * (n // 2)]
    distinct: dict[tuple[str, ...], tuple[str, list[WeightTransform]]] = {}
    for name in list_checkpoint_conversion_keys():
        mapping = get_checkpoint_conversion_mapping(name)
        distinct.setdefault(tuple(map(repr, mapping)), (name, mapping))
    slow = []
    for name, mapping in distinct.values():
        cpu = time.process_time()
        route_keys(keys, [*legacy_renamings(), *mapping], cache=False)
        cpu = time.process_time() - cpu
        if cpu > 0.5:
            slow.append(f"{name}: {cpu:.2f} s")
    assert not slow, f"mappings whose patterns backtrack on a 64 KiB key: {slow}"


# --------------------------------------------------------------------------- loads a file cannot stall

_HOSTILE = {
    "layers-then-100000-zeros": lambda: ["model.layers." + "0." * 100_000 + "w1.weight"],
    "expert-then-100000-zeros": lambda: [
        "model.layers.0.block_sparse_moe.experts.0" + ".0" * 100_000 + ".w1.weight"
    ],
    "a-1-MiB-expert-index": lambda: [
        "model.layers.0.block_sparse_moe.experts." + "1" * (1 << 20) + ".w1.weight"
    ],
    "10000-keys-of-1000-components": lambda: [
        f"model.layers.{i}." + "0." * 998 + "w1.weight" for i in range(10_000)
    ],
}


def _load_timed(path: str, hostile: list[str], queue) -> None:  # type: ignore[no-untyped-def]
    import time

    import torch

    import surgery
    from surgery.examples.moe import build_moe_model

    model = build_moe_model(seed=1)
    surgery.get_model_conversion_mapping(model)  # the catalog's first import is not the load's cost
    wall, cpu = time.perf_counter(), time.process_time()
    report = surgery.load_checkpoint(model, path)
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    truth = build_moe_model(seed=0).state_dict()
    exact = all(torch.equal(v, truth[k]) for k, v in model.state_dict().items())
    queue.put(
        (
            cpu,
            wall,
            sorted(report.unexpected_keys) == sorted(hostile),
            exact and report.missing_keys == [] and len(report.loaded_keys) == len(truth),
            [n for n in report.notes if "without being routed" in n],
        )
    )


@pytest.mark.parametrize("case", sorted(_HOSTILE))
def test_a_key_no_model_can_have_is_reported_unexpected_and_the_load_returns_within_2_seconds(
    tmp_path, case: str
) -> None:
    """A file must not be able to stall the process that loads it.

    Measured on main at 790be25, one key added to the example MoE checkpoint, load time:
    ``model.layers.`` + ``0.`` x N + ``w1.weight`` with N = 1,000 / 2,000 / 4,000 components:
    1.1 s / 6.8 s / 32 s; ``model.layers.0.block_sparse_moe.experts.0`` + ``.0`` x N +
    ``.w1.weight``: 1.7 s / 5.2 s / 23 s; N = 100,000 never returned (the template cache probed
    every numeric component, each probe joining the whole key). The load runs in a child process
    that is killed if it has not returned after a minute; the bound is on the child's CPU time,
    which other work on a shared machine does not inflate.
    """
    import multiprocessing as mp

    from surgery.examples.moe import build_moe_model, original_state_dict

    hostile = _HOSTILE[case]()
    state = original_state_dict(build_moe_model(seed=0))
    write_checkpoint({**state, **{k: torch.zeros(1) for k in hostile}}, tmp_path / "ckpt")
    ctx = mp.get_context("fork")
    queue = ctx.Queue()
    child = ctx.Process(target=_load_timed, args=(str(tmp_path / "ckpt"), hostile, queue))
    child.start()
    child.join(60)
    if child.is_alive():
        child.kill()
        pytest.fail(f"loading a checkpoint with {case} did not return within a minute")
    cpu, wall, all_unexpected, rest_exact, notes = queue.get(timeout=5)
    assert all_unexpected, "every hostile key, and only those, is reported unexpected"
    assert rest_exact, "every real weight still loads exactly"
    assert len(notes) == 1 and f"{len(hostile)} checkpoint key(s)" in notes[0]
    assert cpu < 2.0, f"the load took {cpu:.2f} s of CPU ({wall:.2f} s wall)"


def test_a_parameter_as_deep_as_a_hostile_key_still_loads_routed_exactly(tmp_path) -> None:
    """Limits scale with the model: a key with 80 numeric components that names a parameter loads."""
    from torch import nn

    import surgery

    class Deep(nn.Module):
        def __init__(self, depth: int) -> None:
            super().__init__()
            inner: nn.Module = nn.Linear(2, 2)
            for _ in range(depth):
                inner = nn.Sequential(inner)
            self.model = inner

    torch.manual_seed(0)
    source = Deep(80)
    deeper = "model." + "0." * 200 + "weight"
    write_checkpoint({**source.state_dict(), deeper: torch.zeros(1)}, tmp_path / "ckpt")
    torch.manual_seed(1)
    target = Deep(80)
    report = surgery.load_checkpoint(target, tmp_path / "ckpt")
    assert sorted(report.loaded_keys) == sorted(source.state_dict())
    assert report.unexpected_keys == [deeper] and report.missing_keys == []
    assert all(torch.equal(v, source.state_dict()[k]) for k, v in target.state_dict().items())
