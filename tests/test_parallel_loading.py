"""Tensor-parallel loading and saving on a real 2-process gloo group (CPU).

One ``torch.multiprocessing.spawn`` runs every scenario of ``tests/tp_scenarios.py`` on both
ranks (a spawn costs seconds, so they share it); one ``torchrun`` launch covers the
env-initialized mesh. For the dense example (packed ``gate_up_proj`` traced through a
``Concatenate``, q/k through ``PermuteForRope``) and the Mixtral-style example (merged experts,
packed ``gate_up_proj``): every parameter's ``full_tensor()`` equals the single-process load bit
for bit, the forward output matches, each rank reads about half the bytes, and
``save_checkpoint`` from the parallel model writes exactly the original files.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent


def _spawn(work: Path) -> list[dict]:
    import torch.multiprocessing as mp

    sys.path.insert(0, str(HERE))
    try:
        import tp_scenarios
    finally:
        sys.path.remove(str(HERE))
    tp_scenarios.write_checkpoints(work)
    mp.spawn(tp_scenarios.run, args=(2, str(work)), nprocs=2, join=True)
    facts = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    for f in facts:
        assert "crash" not in f, f["crash"]
    return facts


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    return _spawn(tmp_path_factory.mktemp("tp"))


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_every_parameter_equals_the_single_process_load_bit_for_bit(ranks, family):
    for rank in ranks:
        facts = rank[family]
        assert facts["ok"], facts["report"]
        assert facts["unequal"] == []


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_parameters_are_dtensors_with_the_plans_placements(ranks, family):
    placements = ranks[0][family]["placements"]
    if family == "dense":
        assert placements["model.layers.0.mlp.gate_up_proj.weight"] == ["_StridedShard(dim=0, sf=2)"]
        assert placements["model.layers.0.self_attn.q_proj.weight"] == ["Shard(dim=0)"]
        assert placements["model.layers.0.self_attn.o_proj.weight"] == ["Shard(dim=1)"]
    else:
        assert placements["model.layers.0.mlp.experts.gate_up_proj"] == ["_StridedShard(dim=1, sf=2)"]
        assert placements["model.layers.0.mlp.experts.down_proj"] == ["Shard(dim=2)"]
    assert placements["model.embed_tokens.weight"] == ["Shard(dim=0)"]
    assert placements["model.norm.weight"] is None  # replicated: a plain tensor


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_the_forward_output_matches_the_single_process_model(ranks, family):
    for rank in ranks:
        assert rank[family]["output_shape"] == [2, 5, 64]
        assert rank[family]["max_abs_diff"] < 1e-5


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_each_rank_reads_about_half_the_bytes(ranks, family):
    for r, rank in enumerate(ranks):
        facts = rank[family]
        assert facts["tp"] == [2, r]
        assert facts["bytes_read"] == facts["plan_bytes"]  # the plan counts this rank's bytes
        assert facts["fallbacks"] == []
        # everything but the replicated norms and router is split in two
        assert 0.45 * facts["single_bytes"] < facts["bytes_read"] < 0.55 * facts["single_bytes"]


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_packed_and_merged_targets_are_read_straight_into_place(ranks, family):
    facts = ranks[1][family]
    key = (
        "model.layers.0.mlp.gate_up_proj.weight"
        if family == "dense"
        else "model.layers.0.mlp.experts.gate_up_proj"
    )
    assert facts["modes"][key] == "direct"
    placement, _dim, intervals = facts["entry_tp"][key][0]
    assert placement.startswith("_StridedShard") and len(intervals) == 2  # [G_1 | U_1]


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_a_dry_run_by_arithmetic_plans_what_the_rank_reads(ranks, family):
    for rank in ranks:
        assert rank[family]["dry_run_matches"]


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_saving_the_parallel_model_writes_exactly_the_original_files(ranks, family):
    assert ranks[0][family]["saved_identical"] is True
    assert ranks[0][family]["saved_files"] == ["model.safetensors"]
    assert ranks[1][family]["saved_files"] == []  # rank 0 writes
    for rank in ranks:
        assert rank[family]["reverted_equal"]  # revert_state_dict: whole tensors on every rank


def test_dcp_huggingface_reader_reads_the_same_slices_of_one_to_one_keys(ranks):
    for rank in ranks:
        oracle = rank["oracle"]
        assert len(oracle["keys"]) == 7
        assert "(Shard(dim=0),)" in oracle["placements"] and "(Shard(dim=1),)" in oracle["placements"]
        assert oracle["equal"]


def test_an_op_without_a_slice_rule_reads_whole_and_is_reported(ranks):
    for rank in ranks:
        facts = rank["fallback"]
        assert facts["ok"] and facts["equal"]
        assert facts["local_rows"] == [3, 8]
        assert facts["fallbacks"] == [[["proj.weight"], "Doubled(2.0)", 96]]
        assert facts["bytes_read"] == 6 * 8 * 4  # the whole source, counted


def test_a_sharded_unembedding_keeps_the_whole_padding_rows_on_every_rank_and_saves_them_back(ranks):
    for rank in ranks:
        facts = rank["padded_head"]
        assert facts["ok"] and facts["local_rows"] == [3, 8]
        assert facts["residue_rows"] == ["lm_head.weight"] and facts["residue_equal"]
        assert facts["saved_identical"]


def test_an_already_parallelized_model_loads_by_its_placements(ranks):
    for rank in ranks:
        facts = rank["already_parallel"]
        assert facts["ok"] and facts["unequal"] == []
        assert facts["max_abs_diff"] < 1e-5
        assert "already DTensors" in facts["with_plan"] and "tp_plan=None" in facts["with_plan"]


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        ("two_d_mesh", 'mesh["tp"]'),
        ("unknown_style", "colwise, rowwise"),
        ("no_match", "matches no module"),
        ("mesh_without_plan", "without tp_plan"),
    ],
)
def test_bad_parallel_options_fail_before_reading_and_leave_the_model_unchanged(ranks, case, needle):
    for rank in ranks:
        message = rank["errors"][case]
        assert message.startswith("ConfigurationError unchanged=True"), message
        assert needle in message


def test_a_strict_load_refused_after_parallelizing_leaves_the_model_as_it_was(ranks):
    for rank in ranks:
        assert rank["errors"]["strict"] == "LoadError unchanged=True hooks=0"


def test_a_model_built_on_cpu_is_parallelized_and_loaded(ranks):
    for rank in ranks:
        facts = rank["cpu_model"]
        assert facts["ok"] and facts["unequal"] == [] and facts["max_abs_diff"] < 1e-5


def test_packed_colwise_forward_keeps_each_ranks_gate_and_up_share(ranks):
    for rank in ranks:
        assert rank["packed"] == {"type": "Tensor", "max_abs_diff": 0.0}


def test_an_fp8_checkpoint_decodes_each_ranks_slices_and_saves_back_bit_for_bit(ranks):
    for rank in ranks:
        facts = rank["fp8"]
        assert facts["ok"], facts["report"]
        assert facts["unequal"] == [] and facts["fallbacks"] == []
        assert facts["max_abs_diff"] < 1e-5  # parameters equal bit for bit; the reductions differ
        assert facts["bytes_read"] < 0.75 * facts["single_bytes"]
        # its share of the codes, the scale blocks covering that share, replicated tensors whole
        assert facts["bytes_read"] == facts["share_bytes"]
    assert ranks[0]["fp8"]["saved_identical"]


def test_a_nan_scale_only_one_rank_reads_fails_the_load_on_every_rank_with_one_error(ranks):
    facts = [rank["nan_scale"] for rank in ranks]
    assert facts[0]["raised"] == "ConversionError" and facts[0]["message"] == facts[1]["message"], facts
    message = facts[0]["message"]
    assert "planning failed on rank 1 of 2 only" in message and "model.layers.0.self_attn.q_proj" in message
    assert "nan" in message.lower(), message
    assert all(f["unchanged"] for f in facts)  # refused before any parameter was set


def test_a_checkpoint_one_rank_cannot_open_fails_the_load_on_every_rank(ranks):
    facts = [rank["missing_on_one_rank"] for rank in ranks]
    assert facts[0]["raised"] == "CheckpointError" and facts[0]["message"] == facts[1]["message"], facts
    assert "failed on rank 1 of 2" in facts[0]["message"] and "nowhere" in facts[0]["message"]


@pytest.mark.parametrize("name", ["w4", "w4asym", "w8", "fp8", "moe-w4"])
def test_a_compressed_tensors_checkpoint_reads_each_ranks_packed_share_and_saves_back_bit_for_bit(
    ranks, name
):
    for rank in ranks:
        facts = rank["compressed_tensors"][name]
        assert facts["ok"], facts["report"]
        assert facts["unequal"] == [] and facts["fallbacks"] == []
        assert facts["max_abs_diff"] < 1e-5  # parameters equal bit for bit; the reductions differ
        assert facts["bytes_read"] < 0.75 * facts["single_bytes"]
        # its share of the codes, the scale and zero rows or groups covering it, the rest whole
        assert facts["bytes_read"] == facts["expected_bytes"], facts
    assert ranks[0]["compressed_tensors"][name]["saved_identical"]


def test_a_split_of_packed_columns_that_cuts_a_group_is_an_error_naming_key_dim_and_group_size(ranks):
    for rank in ranks:
        errors = rank["compressed_tensors"]["g16"]["errors"]
        o_proj = [e for e in errors if "o_proj.weight_packed" in e]
        assert len(o_proj) == 2, errors  # both layers; down_proj's halves (16 columns) hold whole groups
        assert "dim 1" in o_proj[0] and "group size 16" in o_proj[0]
        assert not any("down_proj" in e for e in errors)


@pytest.mark.parametrize("name", ["gptq", "gptq-ordered", "awq"])
def test_a_gptq_or_awq_checkpoint_reads_each_ranks_packed_share_and_saves_back_bit_for_bit(ranks, name):
    for rank in ranks:
        facts = rank["gptq_awq"][name]
        assert facts["ok"], facts["report"]
        assert facts["unequal"] == [] and facts["fallbacks"] == []
        assert facts["bytes_read"] < 0.75 * facts["single_bytes"]
        # its share of the words, the scale/zero columns or groups covering it (packed_scenarios)
        assert facts["bytes_read"] == facts["expected_bytes"], facts
    assert ranks[0]["gptq_awq"][name]["saved_identical"]


def test_an_awq_split_inside_a_packed_word_is_an_error_naming_key_dim_and_factor(ranks):
    for rank in ranks:
        errors = rank["gptq_awq"]["awq-kv"]["errors"]
        assert len(errors) == 4, errors  # k_proj and v_proj of both layers: 4 of 8 out-features per rank
        assert all(
            ("k_proj.qweight" in e or "v_proj.qweight" in e) and "dim 0" in e and "8 codes" in e
            for e in errors
        )


def test_torchrun_launch_with_an_env_initialized_mesh(tmp_path):
    sys.path.insert(0, str(HERE))
    try:
        import tp_scenarios
    finally:
        sys.path.remove(str(HERE))
    tp_scenarios.write_checkpoints(tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        str(HERE / "tp_scenarios.py"),
        str(tmp_path),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    for r in range(2):
        facts = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert "crash" not in facts, facts["crash"]
        assert facts["dense"]["ok"] and facts["dense"]["unequal"] == []
        assert facts["dense"]["tp"] == [2, r]
    assert facts["dense"]["max_abs_diff"] < 1e-5
