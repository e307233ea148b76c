r"""Specification of weight transforms: renamings, prefix changes, converters, scoping and reversal.

Loading and saving are exercised the way the loader does it: :func:`surgery.routing.route_keys` decides
where each checkpoint key goes, converters collect tensors (or futures) with ``add_tensor`` and
``convert`` runs the op chain. Saving inverts in two stages: reversed converters first, then the
reversed renamings in reverse order.
"""

from __future__ import annotations

import random
import string
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from surgery import ops
from surgery.converter import Collector, WeightConverter, split_transforms
from surgery.errors import ConfigurationError, ConversionError, ImmutableError, PatternError, SurgeryError
from surgery.ops import OpContext
from surgery.routing import route_keys
from surgery.transforms import PrefixChange, WeightRenaming, WeightTransform, legacy_renamings

# --------------------------------------------------------------------------- helpers: load and save


def _apply(
    keys: Sequence[str],
    fetch: Callable[[str], Any],
    transforms: Sequence[WeightTransform],
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    """Route ``keys`` through ``transforms`` and build the resulting state dict.

    ``fetch(key)`` gives a tensor, a future or a zero-argument callable; ``shapes`` are the known
    shapes of target keys (a ``*`` target is looked up with index 0).
    """
    routing = route_keys(keys, transforms)
    assert not routing.conflicts, routing.conflicts
    out: dict[str, torch.Tensor] = {}
    for group in routing.groups.values():
        if group.converter is None:
            (key,) = group.source_keys
            value = fetch(key)
            out[group.key] = value.result() if hasattr(value, "result") else value
            continue
        converter = routing.transforms[group.converter]
        assert isinstance(converter, WeightConverter)
        collector = Collector(converter)
        for pattern, by_index in group.sources.items():
            for index, key in by_index.items():
                collector.add_tensor(group.key, key, pattern, fetch(key), index=index)
        known = shapes or {}
        target_shapes = tuple(known.get(k.replace("*", "0")) for k in group.target_keys)
        ctx = OpContext(target_shapes=target_shapes if any(target_shapes) else None)
        out.update(collector.convert(group.key, ctx, target_keys=group.target_keys))
    return out


def _load(path: Path, transforms: Sequence[WeightTransform]) -> dict[str, torch.Tensor]:
    """Load a safetensors file through ``transforms``, materializing tensors in worker threads."""
    with safe_open(str(path), "pt") as f, ThreadPoolExecutor(max_workers=2) as pool:
        return _apply(list(f.keys()), lambda k: pool.submit(f.get_tensor, k), transforms)


def _save_order(transforms: Sequence[WeightTransform]) -> tuple[list[WeightTransform], list[WeightTransform]]:
    """Stage 1: every converter reversed. Stage 2: the renamings reversed, last one first."""
    renamings, converters = split_transforms(transforms)
    return [c.reverse_transform() for c in converters], [r.reverse_transform() for r in reversed(renamings)]


def _revert(
    state: dict[str, torch.Tensor],
    transforms: Sequence[WeightTransform],
    shapes: dict[str, tuple[int, ...]] | None = None,
) -> dict[str, torch.Tensor]:
    stage1, stage2 = _save_order(transforms)
    state = _apply(list(state), state.__getitem__, stage1, shapes)
    return _apply(list(state), state.__getitem__, stage2)


def _assert_same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _renamed(keys: Sequence[str], transforms: Sequence[WeightTransform]) -> dict[str, str]:
    routing = route_keys(keys, transforms)
    return {k: r.target_key for k, r in routing.routes.items()}


# --------------------------------------------------------------------------- renamings


def test_legacy_renamings_turn_layernorm_gamma_and_beta_into_weight_and_bias():
    keys = ["bert.embeddings.LayerNorm.gamma", "bert.embeddings.LayerNorm.beta", "bert.pooler.dense.weight"]
    assert _renamed(keys, legacy_renamings()) == {
        "bert.embeddings.LayerNorm.gamma": "bert.embeddings.LayerNorm.weight",
        "bert.embeddings.LayerNorm.beta": "bert.embeddings.LayerNorm.bias",
        "bert.pooler.dense.weight": "bert.pooler.dense.weight",
    }


def test_legacy_renamings_leave_a_longer_name_alone():
    assert _renamed(["enc.LayerNorm.gamma_1"], legacy_renamings()) == {
        "enc.LayerNorm.gamma_1": "enc.LayerNorm.gamma_1"
    }


def test_block_sparse_moe_becomes_mlp():
    r = WeightRenaming(r"\.block_sparse_moe\.", ".mlp.")
    assert r.rename_source_key("model.layers.0.block_sparse_moe.gate.weight") == (
        "model.layers.0.mlp.gate.weight",
        r"\.block_sparse_moe\.",
    )


def test_rename_source_key_leaves_an_unmatched_key_and_says_so():
    assert WeightRenaming(r"\.block_sparse_moe\.", ".mlp.").rename_source_key("lm_head.weight") == (
        "lm_head.weight",
        None,
    )


def test_every_back_reference_one_to_nine_works_in_a_target():
    r = WeightRenaming(r"(a)(b)(c)(d)(e)(f)(g)(h)(i)\.x", r"\9\8\7\6\5\4\3\2\1.y")
    assert r.rename_source_key("m.abcdefghi.x.weight")[0] == "m.ihgfedcba.y.weight"


def test_back_references_pick_their_own_groups():
    r = WeightRenaming(r"layers\.(\d+)\.self_attn\.(q|k|v)_proj", r"blocks.\1.attn.\2")
    assert (
        r.rename_source_key("model.layers.12.self_attn.v_proj.weight")[0] == "model.blocks.12.attn.v.weight"
    )


def test_substitution_replaces_the_matched_span_not_an_earlier_copy_of_its_text():
    # The first 'norm' is not after 'mlp.', so only the second one is the match.
    r = WeightRenaming(r"(?<=mlp\.)norm", "post_norm")
    assert r.rename_source_key("model.norm.mlp.norm.weight")[0] == "model.norm.mlp.post_norm.weight"


def test_renamings_chain_in_list_order():
    transforms = [
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
        WeightRenaming(r"\.mlp\.gate\.", ".mlp.router."),
    ]
    assert _renamed(["m.layers.0.block_sparse_moe.gate.weight"], transforms) == {
        "m.layers.0.block_sparse_moe.gate.weight": "m.layers.0.mlp.router.weight"
    }


def test_paired_sources_and_targets_check_references_pair_by_pair():
    r = WeightRenaming([r"a\.(\d)\.x", r"b\.(\d)\.(\d)\.x"], [r"p.\1.x", r"q.\1.\2.x"])
    assert r.rename_source_key("m.b.1.2.x")[0] == "m.q.1.2.x"
    assert r.rename_source_key("m.a.7.x")[0] == "m.p.7.x"


def test_a_target_reference_without_a_source_group_is_a_pattern_error_naming_both():
    target, source = r"blocks.\1.\2.mlp", r"layers\.(\d+)\.mlp"
    with pytest.raises(PatternError) as info:
        WeightRenaming(source, target)
    message = str(info.value)
    assert repr(target) in message and repr(source) in message and "refers to \\2" in message


def test_an_invalid_regex_is_a_pattern_error_naming_it():
    source = r"layers\.(\d+"
    with pytest.raises(PatternError) as info:
        WeightRenaming(source, "x")
    assert repr(source) in str(info.value) and "not a valid regex" in str(info.value)


def test_several_sources_to_one_target_cannot_be_reversed():
    with pytest.raises(PatternError, match="cannot be reversed"):
        WeightRenaming([r"\.gamma$", r"\.scale$"], ".weight").reverse_transform()


# --------------------------------------------------------------------------- prefix changes


def test_prefix_change_removes_a_component_under_the_model_prefix():
    p = PrefixChange(prefix_to_remove="bad_prefix", model_prefix="model.layers")
    assert p.rename_source_key("model.layers.bad_prefix.weight")[0] == "model.layers.weight"


def test_prefix_change_adds_a_prefix():
    assert (
        PrefixChange(prefix_to_add="model").rename_source_key("layers.0.weight")[0] == "model.layers.0.weight"
    )


def test_prefix_change_adding_a_prefix_that_is_there_does_nothing():
    assert PrefixChange(prefix_to_add="model").rename_source_key("model.layers.0.weight") == (
        "model.layers.0.weight",
        None,
    )


def test_prefix_change_only_touches_a_whole_component():
    p = PrefixChange(prefix_to_remove="bad_prefix", model_prefix="model.layers")
    assert p.rename_source_key("model.layers.bad_prefix_2.weight")[1] is None
    assert (
        PrefixChange(prefix_to_add="model").rename_source_key("model_x.weight")[0] == "model.model_x.weight"
    )


def test_prefix_change_reverses_into_the_opposite_change():
    p = PrefixChange(prefix_to_remove="bad_prefix", model_prefix="model.layers", scope_prefix="text")
    back = p.reverse_transform()
    assert isinstance(back, PrefixChange)
    assert (back.prefix_to_add, back.prefix_to_remove, back.model_prefix, back.scope_prefix) == (
        "bad_prefix",
        None,
        "model.layers",
        "text",
    )
    assert back.rename_source_key("text.model.layers.weight")[0] == "text.model.layers.bad_prefix.weight"


@pytest.mark.parametrize(
    "kwargs",
    [{}, {"prefix_to_add": "a", "prefix_to_remove": "b"}, {"prefix_to_add": "a."}, {"prefix_to_add": ""}],
    ids=["neither", "both", "trailing-dot", "empty"],
)
def test_prefix_change_needs_exactly_one_clean_prefix(kwargs):
    with pytest.raises(ConfigurationError):
        PrefixChange(**kwargs)


# --------------------------------------------------------------------------- converters


def _mixtral_checkpoint(layers: int, experts: int, inter: int, hidden: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    state: dict[str, torch.Tensor] = {}
    for layer in range(layers):
        pre = f"model.layers.{layer}.block_sparse_moe"
        state[f"{pre}.gate.weight"] = torch.randn(experts, hidden, generator=gen)
        for e in range(experts):
            state[f"{pre}.experts.{e}.w1.weight"] = torch.randn(inter, hidden, generator=gen)
            state[f"{pre}.experts.{e}.w2.weight"] = torch.randn(hidden, inter, generator=gen)
            state[f"{pre}.experts.{e}.w3.weight"] = torch.randn(inter, hidden, generator=gen)
    return state


def _mixtral_mapping() -> list[WeightTransform]:
    return [
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
        WeightConverter(
            ["mlp.experts.*.w1.weight", "mlp.experts.*.w3.weight"],
            "mlp.experts.gate_up_proj",
            operations=[ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)],
        ),
        WeightConverter(
            "mlp.experts.*.w2.weight", "mlp.experts.down_proj", operations=[ops.MergeModulelist(dim=0)]
        ),
    ]


def test_mixtral_experts_merge_into_gate_up_and_down_projections(tmp_path):
    experts, inter, hidden = 8, 6, 4
    state = _mixtral_checkpoint(2, experts, inter, hidden)
    save_file(state, tmp_path / "model.safetensors")
    loaded = _load(tmp_path / "model.safetensors", _mixtral_mapping())
    assert sorted(loaded) == sorted(
        f"model.layers.{i}.mlp.{name}"
        for i in range(2)
        for name in ("gate.weight", "experts.gate_up_proj", "experts.down_proj")
    )
    gate_up = loaded["model.layers.1.mlp.experts.gate_up_proj"]
    down = loaded["model.layers.1.mlp.experts.down_proj"]
    assert gate_up.shape == (experts, 2 * inter, hidden)
    assert down.shape == (experts, hidden, inter)
    pre = "model.layers.1.block_sparse_moe.experts"
    for e in range(experts):
        assert torch.equal(gate_up[e, :inter], state[f"{pre}.{e}.w1.weight"])
        assert torch.equal(gate_up[e, inter:], state[f"{pre}.{e}.w3.weight"])
        assert torch.equal(down[e], state[f"{pre}.{e}.w2.weight"])


def test_mixtral_experts_save_back_to_the_original_keys_and_tensors(tmp_path):
    state = _mixtral_checkpoint(2, 8, 6, 4)
    save_file(state, tmp_path / "model.safetensors")
    mapping = _mixtral_mapping()
    reverted = _revert(_load(tmp_path / "model.safetensors", mapping), mapping)
    save_file(reverted, tmp_path / "saved.safetensors")
    with safe_open(str(tmp_path / "saved.safetensors"), "pt") as f:
        _assert_same_state({k: f.get_tensor(k) for k in f.keys()}, state)  # noqa: SIM118


def _collect(collector: Collector, target: str, indices: Sequence[int], make: Callable[[int], Any]) -> None:
    pattern = collector.converter.source_patterns[0]
    for i in indices:
        collector.add_tensor(target, f"m.experts.{i}.w1.weight", pattern, make(i), index=(i,))


def test_expert_position_is_the_index_the_star_captured_not_arrival_or_string_order():
    c = WeightConverter("experts.*.w1.weight", "experts.w1", operations=[ops.MergeModulelist(0)])
    col = Collector(c)
    order = list(range(12))
    random.Random(1).shuffle(order)
    _collect(col, "m.experts.w1", order, lambda i: torch.full((2,), float(i)))
    (stacked,) = col.convert("m.experts.w1").values()
    assert stacked[:, 0].tolist() == [float(i) for i in range(12)]  # 2 before 10, whatever the arrival order


def test_collected_futures_and_callables_are_resolved_at_convert():
    c = WeightConverter("experts.*.w1.weight", "experts.w1", operations=[ops.MergeModulelist(0)])
    col = Collector(c)
    with ThreadPoolExecutor(max_workers=2) as pool:
        _collect(col, "m.experts.w1", [1, 0], lambda i: pool.submit(torch.full, (2,), float(i)))
        _collect(col, "m.experts.w1", [2], lambda i: lambda: torch.full((2,), float(i)))
        (stacked,) = col.convert("m.experts.w1").values()
    assert stacked[:, 0].tolist() == [0.0, 1.0, 2.0]


def test_a_missing_expert_is_an_error_naming_its_index():
    c = WeightConverter("experts.*.w1.weight", "experts.w1", operations=[ops.MergeModulelist(0)])
    col = Collector(c)
    _collect(col, "m.experts.w1", [0, 1, 2, 4, 5, 6, 7], lambda i: torch.zeros(2))
    with pytest.raises(
        ConversionError, match=r"index 3 of 'experts\.\*\.w1\.weight' is missing for 'm\.experts\.w1'"
    ):
        col.convert("m.experts.w1")


def test_one_stray_huge_index_is_a_quick_error_listing_the_first_gaps():
    c = WeightConverter("experts.*.w1.weight", "experts.w1", operations=[ops.MergeModulelist(0)])
    col = Collector(c)
    _collect(col, "m.experts.w1", [0, 1, 10**15], lambda i: torch.zeros(2))
    with pytest.raises(
        ConversionError, match=r"index 2, 3, 4, 5, 6, 7, 8, 9 \.\.\. of .* up to 1000000000000000"
    ):
        col.convert("m.experts.w1")


def test_a_merge_keeps_the_layer_wildcard_and_gathers_the_expert_one():
    c = WeightConverter(
        "layers.*.experts.*.w1.weight", "layers.*.experts.gate_proj", operations=[ops.MergeModulelist(0)]
    )
    state = {
        f"m.layers.{layer}.experts.{e}.w1.weight": torch.full((2,), 10.0 * layer + e)
        for layer in (0, 1)
        for e in range(3)
    }
    loaded = _apply(list(state), state.__getitem__, [c])
    assert sorted(loaded) == ["m.layers.0.experts.gate_proj", "m.layers.1.experts.gate_proj"]
    assert loaded["m.layers.1.experts.gate_proj"][:, 0].tolist() == [10.0, 11.0, 12.0]
    assert c.gather_index(c.match("m.layers.1.experts.2.w1.weight")) == (2,)
    _assert_same_state(_revert(loaded, [c]), state)


def test_fused_qkv_is_chunked_into_one_part_per_target():
    c = WeightConverter(
        "qkv_proj.weight", ["q_proj.weight", "k_proj.weight", "v_proj.weight"], [ops.Chunk(dim=0)]
    )
    qkv = torch.arange(12.0).reshape(6, 2)
    out = _apply(["l.0.attn.qkv_proj.weight"], {"l.0.attn.qkv_proj.weight": qkv}.__getitem__, [c])
    assert [out[f"l.0.attn.{n}_proj.weight"].tolist() for n in "qkv"] == [
        qkv[0:2].tolist(),
        qkv[2:4].tolist(),
        qkv[4:6].tolist(),
    ]


def test_separate_q_k_v_are_concatenated_in_pattern_order():
    c = WeightConverter(
        ["q_proj.weight", "k_proj.weight", "v_proj.weight"], "qkv_proj.weight", [ops.Concatenate(dim=0)]
    )
    state = {f"l.0.attn.{n}_proj.weight": torch.full((1, 2), float(i)) for i, n in enumerate("vkq")}
    out = _apply(list(state), state.__getitem__, [c])
    assert out["l.0.attn.qkv_proj.weight"][:, 0].tolist() == [2.0, 1.0, 0.0]  # q, k, v whatever the key order


def test_grouped_query_qkv_splits_by_the_target_shapes_and_chunk_refuses_it():
    hidden, head_dim = 4, 2
    sizes = (4 * head_dim, 2 * head_dim, 2 * head_dim)  # 4 query heads, 2 key/value heads
    qkv = torch.randn(sum(sizes), hidden)
    key = "l.0.attn.qkv_proj.weight"
    shapes = {f"l.0.attn.{n}_proj.weight": (s, hidden) for n, s in zip("qkv", sizes)}
    split = WeightConverter(
        "qkv_proj.weight", ["q_proj.weight", "k_proj.weight", "v_proj.weight"], [ops.Split(dim=0)]
    )
    out = _apply([key], {key: qkv}.__getitem__, [split], shapes)
    assert [tuple(out[k].shape) for k in shapes] == list(shapes.values())
    chunk = WeightConverter(
        "qkv_proj.weight", ["q_proj.weight", "k_proj.weight", "v_proj.weight"], [ops.Chunk(dim=0)]
    )
    with pytest.raises(
        ConversionError, match=r"Chunk\(dim=0, chunks=None\) in WeightConverter.*size 16.*3 equal"
    ):
        _apply([key], {key: qkv}.__getitem__, [chunk], shapes)


def test_grouped_query_qkv_concat_saves_back_split_by_checkpoint_shapes():
    hidden = 3
    state = {f"l.0.attn.{n}_proj.weight": torch.randn(rows, hidden) for n, rows in zip("qkv", (8, 4, 4))}
    mapping = [
        WeightConverter(
            ["q_proj.weight", "k_proj.weight", "v_proj.weight"], "qkv_proj.weight", [ops.Concatenate(0)]
        )
    ]
    loaded = _apply(list(state), state.__getitem__, mapping)
    assert loaded["l.0.attn.qkv_proj.weight"].shape == (16, hidden)
    shapes = {k: tuple(v.shape) for k, v in state.items()}
    _assert_same_state(_revert(loaded, mapping, shapes), state)


def test_a_split_to_a_star_target_numbers_the_parts():
    c = WeightConverter("experts.gate_proj", "experts.*.w1.weight", [ops.SplitModulelist(0)])
    out = _apply(
        ["m.experts.gate_proj"], {"m.experts.gate_proj": torch.arange(6.0).reshape(3, 2)}.__getitem__, [c]
    )
    assert {k: v.tolist() for k, v in out.items()} == {
        f"m.experts.{i}.w1.weight": [2.0 * i, 2.0 * i + 1] for i in range(3)
    }


def test_convert_without_target_keys_rebuilds_them_from_the_first():
    c = WeightConverter("qkv_proj.weight", ["q_proj.weight", "k_proj.weight"], [ops.Chunk(dim=0)])
    col = Collector(c)
    col.add_tensor("l.0.q_proj.weight", "l.0.qkv_proj.weight", 0, torch.zeros(4, 2))
    assert sorted(col.convert("l.0.q_proj.weight")) == ["l.0.k_proj.weight", "l.0.q_proj.weight"]


def test_convert_of_an_uncollected_target_names_it():
    c = WeightConverter("a.weight", "b.weight", [ops.Transpose()])
    col = Collector(c)
    with pytest.raises(ConversionError, match=r"nothing was collected for 'm\.b\.weight'"):
        col.convert("m.b.weight")


def test_convert_names_the_transform_and_keys_when_an_op_fails():
    c = WeightConverter(["q_proj.weight", "k_proj.weight"], "qk_proj.weight", [ops.Concatenate(dim=0)])
    col = Collector(c)
    col.add_tensor("l.qk_proj.weight", "l.q_proj.weight", "q_proj.weight", torch.zeros(2, 3))
    col.add_tensor("l.qk_proj.weight", "l.k_proj.weight", "k_proj.weight", torch.zeros(2, 4))
    with pytest.raises(ConversionError) as info:
        col.convert("l.qk_proj.weight")
    message = str(info.value)
    assert "'q_proj.weight'" in message and "l.k_proj.weight" in message and "l.qk_proj.weight" in message


def test_add_tensor_needs_the_gathered_index():
    c = WeightConverter("experts.*.w1.weight", "experts.w1", operations=[ops.MergeModulelist(0)])
    col = Collector(c)
    with pytest.raises(ConversionError, match=r"'m\.experts\.3\.w1\.weight' matched .* got index=\(\)"):
        col.add_tensor("m.experts.w1", "m.experts.3.w1.weight", 0, torch.zeros(1))


def test_add_tensor_refuses_an_unknown_source_pattern():
    c = WeightConverter("a.weight", "b.weight", [ops.Transpose()])
    col = Collector(c)
    with pytest.raises(ConversionError, match=r"'c\.weight' is not one of its source patterns"):
        col.add_tensor("m.b.weight", "m.c.weight", "c.weight", torch.zeros(1))


def test_two_keys_on_one_target_are_a_conflict_in_routing():
    keys = ["enc.LayerNorm.gamma", "enc.LayerNorm.weight"]
    routing = route_keys(keys, legacy_renamings())
    assert [(c.target_key, c.first, c.second) for c in routing.conflicts] == [
        ("enc.LayerNorm.weight", "enc.LayerNorm.gamma", "enc.LayerNorm.weight")
    ]


def test_two_keys_on_one_target_make_add_tensor_raise():
    c = WeightConverter(r"(?:a|b)\.weight", "c.weight", [ops.Transpose()])
    col = Collector(c)
    col.add_tensor("m.c.weight", "m.a.weight", 0, torch.zeros(1, 1))
    with pytest.raises(
        ConversionError, match=r"'m\.a\.weight' and 'm\.b\.weight' both land on 'm\.c\.weight'"
    ):
        col.add_tensor("m.c.weight", "m.b.weight", 0, torch.zeros(1, 1))


def test_overlapping_converters_are_a_configuration_error_naming_both():
    first = WeightConverter("mlp.experts.*.w1.weight", "mlp.experts.gate", [ops.MergeModulelist(0)])
    second = WeightConverter(r"experts\.(\d+)\.w1", r"experts.\1.gate", [ops.Transpose()])
    with pytest.raises(ConfigurationError) as info:
        route_keys(["m.mlp.experts.0.w1.weight"], [first, second])
    message = str(info.value)
    assert "mlp.experts.*.w1.weight" in message and r"experts\\.(\\d+)\\.w1" in message


def test_the_first_converter_claims_after_every_renaming_fired():
    mapping = [
        WeightRenaming(r"\.block_sparse_moe\.", ".mlp."),
        WeightConverter("mlp.gate.weight", "mlp.router.weight", [ops.Transpose()]),
    ]
    route = route_keys(["m.block_sparse_moe.gate.weight"], mapping).routes["m.block_sparse_moe.gate.weight"]
    assert (route.target_key, route.renamings, route.converter) == ("m.mlp.router.weight", (0,), 1)


def test_many_to_many_without_a_supporting_op_is_refused_naming_the_patterns():
    with pytest.raises(
        ConfigurationError, match=r"'a\.weight', 'b\.weight'.*N→M needs an op with supports_many_to_many"
    ):
        WeightConverter(["a.weight", "b.weight"], ["c.weight", "d.weight"], [ops.Concatenate(0)])


@dataclass(frozen=True)
class Swap(ops.ConversionOp):
    """A custom many-to-many op: exchange two tensors."""

    supports_many_to_many = True

    def convert(self, slots, ctx):
        return [slots[1], slots[0]]

    @property
    def reverse_op(self):
        return self


def test_many_to_many_with_a_supporting_op_runs():
    c = WeightConverter(["a.weight", "b.weight"], ["c.weight", "d.weight"], [Swap()])
    state = {"m.a.weight": torch.zeros(1), "m.b.weight": torch.ones(1)}
    out = _apply(list(state), state.__getitem__, [c])
    assert out == {"m.c.weight": state["m.b.weight"], "m.d.weight": state["m.a.weight"]}


def test_a_converter_without_operations_only_renames_one_to_one():
    with pytest.raises(ConfigurationError, match="no operations"):
        WeightConverter("experts.*.w1", "experts.w1")
    assert WeightConverter("a.weight", "b.weight").rename_source_key("m.a.weight")[0] == "m.b.weight"


def test_non_ops_in_operations_are_refused():
    with pytest.raises(ConfigurationError, match="ConversionOp instances"):
        WeightConverter("a.weight", "b.weight", [lambda t: t])


# --------------------------------------------------------------------------- save order


def test_rename_then_converter_saves_back_in_two_stages():
    mapping = [
        WeightRenaming(r"^old_prefix\.", "model."),
        WeightConverter(
            ["attn.q.weight", "attn.k.weight", "attn.v.weight"], "attn.qkv.weight", [ops.Concatenate(dim=0)]
        ),
    ]
    state = {f"old_prefix.layers.0.attn.{n}.weight": torch.randn(2, 3) for n in "qkv"}
    state["old_prefix.layers.0.mlp.weight"] = torch.randn(3, 3)
    loaded = _apply(list(state), state.__getitem__, mapping)
    assert sorted(loaded) == ["model.layers.0.attn.qkv.weight", "model.layers.0.mlp.weight"]

    stage1, stage2 = _save_order(mapping)
    assert [type(t) for t in stage1] == [WeightConverter] and [type(t) for t in stage2] == [WeightRenaming]
    after_converters = _apply(list(loaded), loaded.__getitem__, stage1)
    # Stage 1 works in the runtime namespace: it splits qkv but does not touch the prefix yet.
    assert sorted(after_converters) == [f"model.layers.0.attn.{n}.weight" for n in "kqv"] + [
        "model.layers.0.mlp.weight"
    ]
    restored = _apply(list(after_converters), after_converters.__getitem__, stage2)
    _assert_same_state(restored, state)


def test_chained_renamings_are_undone_last_first():
    mapping = [WeightRenaming(r"\.attention\.", ".attn."), WeightRenaming(r"\.attn\.", ".self_attn.")]
    state = {"m.attention.q.weight": torch.zeros(1), "m.mlp.weight": torch.ones(1)}
    loaded = _apply(list(state), state.__getitem__, mapping)
    assert sorted(loaded) == ["m.mlp.weight", "m.self_attn.q.weight"]
    _assert_same_state(_revert(loaded, mapping), state)


# --------------------------------------------------------------------------- scoping


def _multimodal_mapping() -> list[WeightTransform]:
    return [
        WeightRenaming(r"^encoder\.layers\.", "blocks.").scoped("vision_model"),
        WeightConverter(
            "patch_embed.proj.weight", "patch_embed.proj.weight", [ops.Conv3dToLinear(3, (2, 2, 2))]
        ).scoped("vision_model"),
        WeightRenaming(
            r"^layers\.(\d+)\.self_attn\.", r"layers.\1.attn.", scope_prefix="language_model.model"
        ),
    ]


def test_scoped_transforms_fire_only_inside_their_sub_model():
    keys = [
        "vision_model.encoder.layers.0.mlp.weight",
        "vision_model.patch_embed.proj.weight",
        "language_model.model.layers.3.self_attn.q_proj.weight",
        "encoder.layers.0.mlp.weight",
        "language_model.lm_head.weight",
        "vision_model_extra.encoder.layers.0.weight",
    ]
    assert _renamed(keys, _multimodal_mapping()) == {
        "vision_model.encoder.layers.0.mlp.weight": "vision_model.blocks.0.mlp.weight",
        "vision_model.patch_embed.proj.weight": "vision_model.patch_embed.proj.weight",
        "language_model.model.layers.3.self_attn.q_proj.weight": "language_model.model.layers.3.attn.q_proj.weight",
        "encoder.layers.0.mlp.weight": "encoder.layers.0.mlp.weight",
        "language_model.lm_head.weight": "language_model.lm_head.weight",
        "vision_model_extra.encoder.layers.0.weight": "vision_model_extra.encoder.layers.0.weight",
    }


def test_caret_anchors_at_the_scoped_key():
    r = WeightRenaming(r"^encoder\.", "enc.", scope_prefix="vision_model")
    assert r.rename_source_key("vision_model.encoder.x")[0] == "vision_model.enc.x"
    assert r.rename_source_key("vision_model.tower.encoder.x")[1] is None


def test_scoped_mapping_loads_and_saves_back(tmp_path):
    state = {
        "vision_model.encoder.layers.0.mlp.weight": torch.randn(2, 2),
        "vision_model.patch_embed.proj.weight": torch.randn(4, 3, 2, 2, 2),
        "language_model.model.layers.3.self_attn.q_proj.weight": torch.randn(2, 2),
        "language_model.lm_head.weight": torch.randn(2, 2),
    }
    save_file(state, tmp_path / "model.safetensors")
    mapping = _multimodal_mapping()
    loaded = _load(tmp_path / "model.safetensors", mapping)
    assert loaded["vision_model.patch_embed.proj.weight"].shape == (4, 24)
    _assert_same_state(_revert(loaded, mapping), state)


def test_scoped_gives_a_new_value_and_reverse_keeps_the_scope():
    c = WeightConverter("a.weight", "b.weight", [ops.Transpose()])
    scoped = c.scoped("text_model")
    assert scoped.scope_prefix == "text_model" and c.scope_prefix is None and scoped != c
    assert scoped.reverse_transform().scope_prefix == "text_model"
    assert c.copy() == c and c.copy() is not c


def test_transforms_are_values_equal_by_type_patterns_scope_and_options():
    c = WeightConverter("a.weight", "b.weight", [ops.Transpose()])
    assert c == WeightConverter("a.weight", "b.weight", [ops.Transpose()])
    assert hash(c) == hash(WeightConverter("a.weight", "b.weight", [ops.Transpose()]))
    assert c != WeightConverter("a.weight", "b.weight", [ops.Transpose(0, 2)])
    assert c != WeightRenaming("a.weight", "b.weight")
    assert PrefixChange(prefix_to_add="model") == PrefixChange(prefix_to_add="model")
    assert PrefixChange(prefix_to_add="model") != PrefixChange(prefix_to_remove="model")
    assert len({c, c.copy(), c.scoped("x")}) == 2


def test_a_transform_cannot_be_changed_after_construction():
    r = WeightRenaming(r"\.gamma$", ".weight")
    with pytest.raises(ImmutableError, match=r"cannot set 'scope_prefix'.*scoped"):
        r.scope_prefix = "vision_model"
    assert r.scope_prefix is None


def test_a_collector_keeps_its_tensors_apart_from_the_converter_and_other_collectors():
    c = WeightConverter("a.weight", "b.weight", [ops.Transpose()])
    first, second = Collector(c), Collector(c)
    first.add_tensor("m.b.weight", "m.a.weight", 0, torch.zeros(1, 2))
    assert first.pending_targets() == ["m.b.weight"] and second.pending_targets() == []
    assert first.convert("m.b.weight")["m.b.weight"].shape == (2, 1)
    assert not first.is_pending("m.b.weight")


def test_a_scope_prefix_with_a_trailing_dot_is_refused():
    with pytest.raises(ConfigurationError, match=r"'vision_model\.'"):
        WeightRenaming("a", "b", scope_prefix="vision_model.")
    with pytest.raises(ConfigurationError, match=r"'vision_model\.'"):
        WeightRenaming("a", "b").scoped("vision_model.")


# --------------------------------------------------------------------------- usage and errors


def test_every_configuration_error_is_a_surgery_error():
    for error in (ConfigurationError, PatternError, ConversionError):
        assert issubclass(error, SurgeryError)


# --------------------------------------------------------------------------- property: renaming round trip

_ROOTS = ["model", "encoder", "vision_model"]
_MODULES = ["attn", "mlp", "experts", "norm"]
_LEAVES = ["q_proj", "k_proj", "up", "w1"]
_WORDS = ["layers", "layers", *_ROOTS, *_MODULES, *_LEAVES]


@st.composite
def _key(draw):
    """A checkpoint-like key: root.layers.N.module[.N].leaf.weight|bias."""
    parts = [draw(st.sampled_from(_ROOTS)), "layers", draw(st.sampled_from(["0", "1", "12"]))]
    parts.append(draw(st.sampled_from(_MODULES)))
    if draw(st.booleans()):
        parts.append(draw(st.sampled_from(["0", "3", "10"])))
    parts += [draw(st.sampled_from(_LEAVES)), draw(st.sampled_from(["weight", "bias"]))]
    return ".".join(parts)


def _fresh(draw) -> str:
    return "z" + draw(st.text(string.ascii_lowercase, min_size=2, max_size=5))


@st.composite
def _renaming(draw, index: int) -> WeightTransform:
    kind = draw(st.sampled_from(["word", "groups", "add_prefix", "star"]))
    fresh = f"{_fresh(draw)}{index}"  # never in a generated key, and unique per renaming
    word = draw(st.sampled_from(_WORDS))
    if kind == "word":
        transform: WeightTransform = WeightRenaming(rf"\.{word}\.", f".{fresh}.")
    elif kind == "groups":
        transform = WeightRenaming(rf"\.{word}\.(\d+)\.(\w+)", rf".{fresh}.\2.\1")
    elif kind == "star":
        transform = WeightRenaming(f"{word}.*.", f"{fresh}.*.")
    else:
        transform = PrefixChange(prefix_to_add=fresh)
    if draw(st.booleans()):
        transform = transform.scoped(draw(st.sampled_from(_ROOTS)))
    return transform


@st.composite
def _renamings(draw):
    return [draw(_renaming(i)) for i in range(draw(st.integers(1, 4)))]


@settings(max_examples=100, deadline=None)
@given(keys=st.sets(_key(), min_size=1, max_size=12), renamings=_renamings())
def test_renaming_then_reverse_renaming_restores_the_key_set(keys, renamings):
    forward = route_keys(sorted(keys), renamings)
    assert not forward.conflicts
    renamed = {r.target_key for r in forward.routes.values()}
    assert len(renamed) == len(keys)
    backward = route_keys(sorted(renamed), [r.reverse_transform() for r in reversed(renamings)])
    assert {r.target_key for r in backward.routes.values()} == keys
    assert all(backward.routes[forward.routes[k].target_key].target_key == k for k in keys)
