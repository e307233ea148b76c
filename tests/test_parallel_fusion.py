"""Fusion x tensor parallelism on a real 2-process gloo group (CPU): the example decoder.

A fused ``gate_up_proj`` (and ``qkv_proj`` of equal parts) loaded with ``packed_colwise``, as
``docs/parallel.md`` advises, loads every parameter equal to the single-process fused load, runs
a forward equal to the single-process (unfused) model, and saves back exactly the source file.
The scenarios are in ``tests/tp_fusion_scenarios.py``; transformers' Llama runs them under the
interop marker (``tests/interop/test_parallel_fusion_interop.py``).
"""

from __future__ import annotations

import pytest
import torch

from surgery.parallel import local_split_sizes

SCENARIOS = ["decoder_gate_up", "decoder_qkv_gate_up"]
ALL = ["split_sizes", *SCENARIOS]


TP2 = ("fusion", ALL)  # this module's scenarios in the session's one 2-rank spawn (tests/tp2_scenarios.py)


@pytest.fixture(scope="module")
def ranks(tp2_ranks: list[dict[str, dict]]) -> list[dict[str, dict]]:
    ranks = [{s: r["fusion"][s] for s in ALL} for r in tp2_ranks]
    for facts in ranks:
        for name, f in facts.items():
            assert "crash" not in f, f"{name}: {f['crash']}"
    return ranks


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_a_fused_sharded_model_loads_every_parameter_equal_to_the_single_process_fused_load(ranks, scenario):
    for rank in ranks:
        assert rank[scenario]["ok"], rank[scenario]["report"]
        assert rank[scenario]["unequal"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_the_fused_module_splits_its_local_output_and_the_forward_matches_one_process(ranks, scenario):
    """Issue 25: the first forward raised ``split_with_sizes ... got split_sizes=[48, 48]``."""
    for rank in ranks:
        assert rank[scenario]["output_shape"] == [2, 5, 64]
        assert rank[scenario]["max_abs_diff"] < 1e-5


@pytest.mark.distributed
def test_each_rank_holds_its_share_of_every_part_of_the_fused_weights(ranks):
    gate_up = ranks[0]["decoder_gate_up"]["fused"]["model.layers.0.mlp.gate_up_proj"]
    assert gate_up == {"placements": ["_StridedShard(dim=0, sf=2)"], "local_rows": 48}  # 2 x 48 / 2
    qkv = ranks[1]["decoder_qkv_gate_up"]["fused"]["model.layers.0.self_attn.qkv_proj"]
    assert qkv == {"placements": ["_StridedShard(dim=0, sf=3)"], "local_rows": 48}  # 3 x 32 / 2


@pytest.mark.distributed
@pytest.mark.parametrize("scenario", SCENARIOS)
def test_saving_the_fused_sharded_model_writes_exactly_the_source_file(ranks, scenario):
    assert ranks[0][scenario]["saved_identical"]


@pytest.mark.distributed
def test_the_local_split_sizes_are_each_parts_rows_on_this_rank(ranks):
    """Packed: a share of each part; sharded on another dim or replicated: all of each."""
    for rank in ranks:
        facts = rank["split_sizes"]
        assert facts["packed"] == [24, 24]
        assert facts["rowwise"] == facts["replicate"] == [48, 48]


@pytest.mark.distributed
def test_a_placement_that_gives_a_rank_whole_parts_is_refused_naming_packed_colwise(ranks):
    """Plain colwise on a fused gate_up gives rank 0 the gate rows only: the split would pair the
    wrong rows (or fail on the shapes); it is a ConfigurationError saying what to use instead."""
    for r, rank in enumerate(ranks):
        facts = rank["split_sizes"]
        held = "[48, 0]" if r == 0 else "[0, 48]"
        assert f"gives rank {r} of 2 the rows {held} of those parts" in facts["colwise"]
        assert "Shard it with packed_colwise (PackedColwiseParallel(split_factor=2))" in facts["colwise"]
        assert "PackedColwiseParallel(split_factor=3)" in facts["packed_in_two_of_three"]
        assert "parts [48, 40] on dim 0, which add up to 88, not 96" in facts["wrong_sum"]


def test_a_plain_weight_splits_by_the_global_sizes() -> None:
    assert local_split_sizes(torch.zeros(96, 32), [32, 64]) == [32, 64]
    assert local_split_sizes(torch.zeros(0, 32, device="meta"), [0, 0]) == [0, 0]
