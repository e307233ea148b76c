"""FP4 checkpoints under expert and tensor parallelism: the session's one 2-rank spawn (``tests/tp2_scenarios.py``; scenarios in ``tests/fp4_scenarios.py``).

Each rank reads only its share of the packed codes (and the scales, which are small, whole),
decodes exactly its slice of the reference decode (transformers' for gpt-oss MXFP4,
compressed-tensors' for NVFP4/MXFP4) and the parallel save writes the files back byte for byte;
a split inside a block or group fails on every rank naming the key, the dim and the size.
"""

from __future__ import annotations

import re

import pytest

pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from fp4_scenarios import QCONFIG

pytestmark = pytest.mark.distributed

# --------------------------------------------------------------------------- gpt-oss MXFP4 experts

TP2 = ("fp4", ())  # every scenario, in the session's one 2-rank spawn (tests/tp2_scenarios.py)


@pytest.fixture(scope="module")
def ranks(tp2_ranks: list[dict[str, dict]]) -> list[dict]:
    return [r["fp4"] for r in tp2_ranks]


@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_each_rank_decodes_exactly_its_slice_of_the_full_decode(ranks, layout):
    for rank in ranks:
        facts = rank[layout]
        assert facts["ok"], facts["errors"]
        assert facts["local_equals_slice_of_full_decode"] and all(
            facts["local_equals_slice_of_full_decode"].values()
        )
        assert len(facts["decoded_keys"]) == 4


@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_each_rank_reads_only_its_share_of_the_sharded_blocks_and_their_scales(ranks, layout):
    for rank in ranks:
        facts = rank[layout]
        # half of each sharded weight's blocks, of the scales covering them, and of its bias
        saved = (
            facts["sharded_blocks_bytes"] + facts["sharded_scales_bytes"] + facts["sharded_bias_bytes"]
        ) // 2
        assert facts["bytes_read"] == facts["single_bytes"] - saved, facts


@pytest.mark.parametrize("layout", ["ep", "tp"])
def test_the_parallel_model_saves_back_byte_for_byte(ranks, layout):
    assert ranks[0][layout]["saved_identical"]
    assert ranks[0][layout]["saved_quantization_config"] == QCONFIG
    assert all(rank[layout]["requantized"] == [] for rank in ranks)


def test_a_split_inside_a_block_fails_on_every_rank_naming_key_dim_and_block_size(ranks):
    for rank in ranks:
        facts = rank["misaligned"]
        assert not facts["ok"]
        assert any(
            re.search(r"down_proj_blocks.*dim 1.*\[\d+, \d+\).*block size 32", m) for m in facts["errors"]
        ), facts["errors"]


# --------------------------------------------------------------------------- compressed-tensors NVFP4 / MXFP4

CT = [f"ct-{preset}-{plan}" for preset in ("NVFP4", "MXFP4") for plan in ("rows", "columns")]


@pytest.mark.parametrize("scenario", CT)
def test_a_compressed_fp4_checkpoint_decodes_each_ranks_slice_reading_only_its_packed_share(ranks, scenario):
    for rank in ranks:
        facts = rank[scenario]
        assert facts["ok"], facts["errors"]
        assert facts["local_equals_slice_of_full_decode"]
        # half of the packed codes and of the group scales covering them; the global scales whole
        saved = facts["half_packed_bytes"] + facts["half_scale_bytes"]
        assert facts["bytes_read"] == facts["single_bytes"] - saved, facts


@pytest.mark.parametrize("scenario", CT)
def test_a_parallel_compressed_fp4_model_saves_back_byte_for_byte(ranks, scenario):
    assert ranks[0][scenario]["saved_identical"]
    assert ranks[0][scenario]["saved_config_equal"]
    assert all(rank[scenario]["requantized"] == [] for rank in ranks)


@pytest.mark.parametrize("preset, group", [("NVFP4", 16), ("MXFP4", 32)])
def test_a_column_split_inside_a_group_fails_on_every_rank_naming_key_dim_and_group_size(
    ranks, preset, group
):
    for rank in ranks:
        facts = rank[f"ct-{preset}-misaligned"]
        assert not facts["ok"]
        assert any(
            re.search(rf"b\.weight_packed.*dim 1.*\[\d+, \d+\).*group size {group}", m)
            for m in facts["errors"]
        ), facts["errors"]
