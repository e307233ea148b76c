"""The catalog across transformers releases: per-release lists, and the transforms 5.24/5.25 added.

No transformers needed: the release lists are data (``specs.releases``), the new transforms are
checked on their own (hypothesis over shapes and values) and on a synthetic checkpoint.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import specs
from specs import inkling2
from specs.inkling2 import Inkling2LoopDequantizeExperts, Inkling2LoopMergeMessageQueries, Inkling2UnpadVocab
from specs.releases import NEWEST, PINNED, Before, entries_for, release_tuple
from surgery import ConversionError, WeightRenaming
from surgery.errors import ConfigurationError
from surgery.ops import OpContext
from surgery.routing import route_keys
from surgery.transforms import LayerPairCollapse

# --------------------------------------------------------------------------- release lists


def test_release_numbers_compare_as_numbers() -> None:
    assert release_tuple("5.9.0") < release_tuple("5.24.0") < release_tuple("5.25.0")
    assert release_tuple("5.26.0.dev0") == (5, 26, 0)
    assert release_tuple("6") == (6, 0, 0)
    with pytest.raises(ConfigurationError, match="not a transformers release"):
        release_tuple("main")


@pytest.mark.parametrize("family", specs.FAMILIES, ids=lambda f: f.__name__)
def test_before_lists_name_entries_and_a_release_after_the_oldest(family) -> None:
    for key, before in getattr(family, "BEFORE", {}).items():
        assert key in family.ENTRIES, key
        assert release_tuple(PINNED) < release_tuple(before.release) <= release_tuple(NEWEST), key


def test_an_earlier_release_gets_the_before_list_and_a_later_one_the_entry() -> None:
    old = entries_for(inkling2, "5.23.0")
    new = entries_for(inkling2, "5.24.0")
    assert old["inkling2_text"] is inkling2.BEFORE["inkling2_text"].transforms
    assert new["inkling2_text"] is inkling2.ENTRIES["inkling2_text"]
    assert entries_for(inkling2, None) == dict(inkling2.ENTRIES)  # no transformers: the newest lists
    assert (
        old["inkling2_loop_text"] is inkling2.ENTRIES["inkling2_loop_text"]
    )  # a key only the new release has


def test_both_releases_route_the_same_hub_keys_to_their_own_classes() -> None:
    """The hub layout is one; the runtime names differ by release (the attention became modules)."""
    hub = ["model.llm.layers.0.attn.wq_du.weight", "model.llm.layers.0.attn.k_sconv.weight"]
    old = route_keys(hub, entries_for(inkling2, "5.23.0")["inkling2_text"]).routes
    new = route_keys(hub, entries_for(inkling2, "5.25.0")["inkling2_text"]).routes
    assert [old[k].target_key for k in hub] == [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.0.self_attn.k_sconv.conv1d.weight",
    ]
    assert [new[k].target_key for k in hub] == [
        "model.layers.0.self_attn.q_proj.linear.weight",
        "model.layers.0.self_attn.k_proj.sconv.conv1d.weight",
    ]


def test_a_before_list_needs_transforms_and_a_release_number() -> None:
    with pytest.raises(ConfigurationError, match="no transforms"):
        Before("5.24.0", [])
    with pytest.raises(ConfigurationError, match="not a transformers release"):
        Before("next", [WeightRenaming("a", "b")])


# --------------------------------------------------------------------------- LayerPairCollapse


@settings(max_examples=60, deadline=None)
@given(
    layer=st.integers(0, 200),
    part=st.sampled_from(["self_attn.q_proj.weight", "mlp.up_proj.weight", "lambda_1", "lambda_2"]),
    prefix=st.sampled_from(["", "model.", "backbone."]),
)
def test_layer_pair_collapse_reverses_every_one_layer_key(layer: int, part: str, prefix: str) -> None:
    key = f"{prefix}layers.{layer}.{part}"
    expand = LayerPairCollapse(inverse=True)
    two_blocks, _ = expand.rename_source_key(key)
    assert two_blocks != key
    back, pattern = LayerPairCollapse().rename_source_key(two_blocks)
    assert pattern is not None and back == key


def test_layer_pair_collapse_puts_attention_on_even_and_mlp_on_odd_blocks() -> None:
    collapse = LayerPairCollapse()
    assert collapse.rename_source_key("layers.4.mixer.q_proj.weight")[0] == "layers.2.self_attn.q_proj.weight"
    assert collapse.rename_source_key("layers.5.mixer.up_proj.weight")[0] == "layers.2.mlp.up_proj.weight"
    assert collapse.rename_source_key("layers.4.attn_alpha")[0] == "layers.2.lambda_1"
    assert collapse.rename_source_key("layers.5.mlp_alpha")[0] == "layers.2.lambda_2"


@pytest.mark.parametrize(
    "key", ["layers.5.attn_alpha", "layers.4.mlp_alpha", "layers.04.mixer.w", "layers.1.mixers.w"]
)
def test_layer_pair_collapse_leaves_keys_with_no_exact_inverse_unmatched(key: str) -> None:
    """An alpha on the other parity's block, or a non-canonical index, would not come back as written."""
    assert LayerPairCollapse().rename_source_key(key) == (key, None)


def test_layer_pair_collapse_reverse_is_an_involution_and_keeps_the_scope() -> None:
    t = LayerPairCollapse().scoped("model")
    back = t.reverse_transform()
    assert back.inverse and back.scope_prefix == "model"
    assert repr(back.reverse_transform()) == repr(t)
    assert back.rename_source_key("layers.0.mlp.w")[0] == "layers.0.mlp.w"  # outside the scope


# --------------------------------------------------------------------------- Inkling2 ops


@settings(max_examples=60, deadline=None)
@given(
    kept=st.integers(1, 6),
    padding=st.integers(0, 4),
    cols=st.integers(1, 3),
    seed=st.integers(0, 2**31 - 1),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_unpad_vocab_then_pad_with_its_residue_is_bit_exact_for_any_padding(
    kept: int, padding: int, cols: int, seed: int, dtype: torch.dtype
) -> None:
    # Random bit patterns: NaN payloads, infinities, -0.0 and subnormals among the padding rows.
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2**15), 2**15, (kept + padding, cols), generator=g, dtype=torch.int16)
    padded = (
        bits.view(torch.bfloat16) if dtype == torch.bfloat16 else bits.to(torch.int32).mul(65599).view(dtype)
    )
    unpad = Inkling2UnpadVocab()
    kept_residues: list[torch.Tensor] = []
    (runtime,) = unpad.convert(
        [padded], OpContext(target_shapes=((kept, cols),), keep_residue=kept_residues.append)
    )
    # Only what is dropped is kept, and nothing when nothing is dropped.
    assert [tuple(r.shape) for r in kept_residues] == ([(padding, cols)] if padding else [])
    residue = kept_residues[0] if padding else None
    assert runtime.shape == (kept, cols)
    ctx = OpContext(target_shapes=((kept + padding, cols),), residue=residue)
    (back,) = unpad.reverse_op.convert([runtime], ctx)
    assert back.dtype == padded.dtype and torch.equal(back.view(torch.int16), padded.view(torch.int16))
    assert unpad.reverse_op.reverse_op == unpad


@settings(max_examples=30, deadline=None)
@given(kept=st.integers(1, 6), padding=st.integers(0, 4), cols=st.integers(1, 3), seed=st.integers(0, 99))
def test_unpad_vocab_pads_with_zero_rows_without_a_residue(
    kept: int, padding: int, cols: int, seed: int
) -> None:
    runtime = torch.randn(kept, cols, generator=torch.Generator().manual_seed(seed))
    pad = Inkling2UnpadVocab(inverse=True)
    (padded,) = pad.convert([runtime], OpContext(target_shapes=((kept + padding, cols),)))
    assert padded.shape == (kept + padding, cols) and not padded[kept:].any()
    assert torch.equal(padded[:kept], runtime)


def test_unpad_vocab_reads_the_row_counts_from_the_config_without_target_shapes() -> None:
    class Text:
        vocab_size, unpadded_vocab_size = 5, 3

    class Config:
        def get_text_config(self) -> Text:
            return Text()

    w = torch.cat([torch.randn(3, 2), torch.zeros(2, 2)])
    (kept,) = Inkling2UnpadVocab().convert([w], OpContext(config=Config()))
    (back,) = Inkling2UnpadVocab(inverse=True).convert([kept], OpContext(config=Config()))
    assert kept.shape == (3, 2) and torch.equal(back, w)


def test_unpad_vocab_refuses_a_checkpoint_shorter_than_the_model() -> None:
    with pytest.raises(ConversionError, match="fewer than the 4 kept"):
        Inkling2UnpadVocab().convert([torch.zeros(3, 2)], OpContext(target_shapes=((4, 2),)))


@settings(max_examples=60, deadline=None)
@given(loops=st.integers(1, 5), hidden=st.integers(1, 4), seed=st.integers(0, 99))
def test_merge_message_queries_is_an_exact_inverse_pair(loops: int, hidden: int, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    queries, kv = torch.randn(2 * loops, hidden, generator=g), torch.randn(2 * loops, hidden, generator=g)
    op = Inkling2LoopMergeMessageQueries()
    (merged,) = op.convert([queries, kv], OpContext())
    assert merged.shape == (loops, 4, hidden)
    for i in range(loops):  # query, key, value, mlp per loop layer
        assert torch.equal(merged[i, 0], queries[2 * i]) and torch.equal(merged[i, 3], queries[2 * i + 1])
        assert torch.equal(merged[i, 1], kv[2 * i]) and torch.equal(merged[i, 2], kv[2 * i + 1])
    back = op.reverse_op.convert([merged], OpContext(n_targets=2))
    assert torch.equal(back[0], queries) and torch.equal(back[1], kv)
    (again,) = op.convert(back, OpContext())
    assert torch.equal(again, merged)


def test_merge_message_queries_refuses_tables_of_two_shapes() -> None:
    with pytest.raises(ConversionError, match="one shape with an even row count"):
        Inkling2LoopMergeMessageQueries().convert([torch.zeros(4, 2), torch.zeros(2, 2)], OpContext())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_floating_experts_pass_through_both_ways(dtype: torch.dtype) -> None:
    w = torch.randn(2, 4, 3).to(dtype)
    op = Inkling2LoopDequantizeExperts()
    (loaded,) = op.convert([w], OpContext())
    (saved,) = op.reverse_op.convert([loaded], OpContext())
    assert saved is w


@pytest.mark.parametrize("dtype", [torch.uint8, torch.float8_e4m3fn])
def test_quantized_experts_are_refused_by_name_not_dequantized(dtype: torch.dtype) -> None:
    codes = torch.zeros(2, 4, 3).to(dtype)
    with pytest.raises(ConversionError, match=r"NVFP4 or MXFP8.*issue 29"):
        Inkling2LoopDequantizeExperts().convert([codes], OpContext())
