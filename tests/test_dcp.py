"""Resharding through ``torch.distributed.checkpoint``: ``save_dcp`` on one mesh, ``load_dcp`` on
another (or in one process), bit-equal, and the load record carried so the hub layout saves back
byte for byte. The 4-rank part is the ``dcp`` suite of the one session spawn
(``tests/dcp_scenarios.py``); the one-process reload of what it saved runs here.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dcp_scenarios import FAMILIES, MESH_A, MESH_B
from nd_scenarios import MODELS
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.examples import dense
from surgery.parallel import LocalShards, dcp_state_dict, load_dcp, save_dcp
from surgery.record import LoadRecord, record_of, update_record

ROUND_TRIPS = [f"{MESH_A}->{MESH_B}/{f}" for f in FAMILIES]


def _same_files(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir() if p.suffix in (".safetensors", ".json"))
    assert names and names == sorted(p.name for p in b.iterdir() if p.suffix in (".safetensors", ".json"))
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


# --------------------------------------------------------------------------- one process


def test_a_box_of_local_shards_is_a_view_so_dcp_reads_land_in_the_local_tensor():
    local = torch.zeros(2, 4)
    shards = LocalShards(local, (2, 8), [((0, 0), (0, 0), (2, 2)), ((0, 4), (0, 2), (2, 2))])
    shards.view((0, 4)).fill_(1.0)  # the second box: the whole tensor's columns 4..5
    assert torch.equal(local, torch.tensor([[0.0, 0, 1, 1], [0, 0, 1, 1]]))
    assert [tuple(c.offsets) for c in shards.__create_chunk_list__()] == [(0, 0), (0, 4)]
    with pytest.raises(surgery.CheckpointError, match=r"No local box starts at \(1, 0\)"):
        shards.view((1, 0))


@pytest.mark.parametrize("storage", ["dcp", "safetensors"])
def test_a_one_process_model_round_trips_through_dcp_and_saves_the_hub_layout(tmp_path, storage):
    config = dense.ExampleDenseConfig()
    write_checkpoint(dense.original_state_dict(dense.build_dense_model(config, seed=3)), tmp_path / "hub")
    loaded = dense.build_dense_model(config, device="meta")
    assert surgery.load_checkpoint(loaded, tmp_path / "hub").ok
    save_dcp(loaded, tmp_path / "dcp", storage=storage)
    again = dense.build_dense_model(config, device="meta")
    load_dcp(again, tmp_path / "dcp")
    for key, value in loaded.state_dict().items():
        assert torch.equal(again.state_dict()[key], value), key
    assert record_of(again).load.transforms == record_of(loaded).load.transforms  # type: ignore[union-attr]
    surgery.save_checkpoint(again, tmp_path / "out")
    _same_files(tmp_path / "hub", tmp_path / "out")


def test_a_base_prefix_added_at_load_is_carried_and_stripped_again_at_save(tmp_path):
    from safetensors.torch import load_file

    from surgery.examples import moe
    from surgery.record import Origin

    config = moe.ExampleMoEConfig()
    full = moe.original_state_dict(moe.build_moe_model(config, seed=5))
    bare = {k.removeprefix("model."): v for k, v in full.items() if k != "lm_head.weight"}
    write_checkpoint(bare, tmp_path / "hub")  # saved from the base model: no "model." prefix
    loaded = moe.build_moe_model(config, seed=1)
    surgery.load_checkpoint(loaded, tmp_path / "hub")
    assert record_of(loaded).load.of(Origin.BASE_PREFIX_BEFORE, Origin.BASE_PREFIX_AFTER)  # type: ignore[union-attr]
    save_dcp(loaded, tmp_path / "dcp")
    again = moe.build_moe_model(config, device="meta")
    load_dcp(again, tmp_path / "dcp")
    surgery.save_checkpoint(again, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    assert sorted(saved) == sorted([*bare, "lm_head.weight"])  # the prefix stripped again, as loaded
    assert all(torch.equal(saved[k], v) for k, v in bare.items())


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_record_naming_a_transform_the_model_lacks_is_refused_before_the_model_changes(tmp_path):
    import json

    import torch.distributed.checkpoint as dcp

    from surgery.parallel.dcp import RECORD_KEY

    config = dense.ExampleDenseConfig()
    state = dcp_state_dict(dense.build_dense_model(config, seed=0))
    record = {
        "version": 1,
        "checkpoint": "elsewhere",
        "fired": [
            {"origin": "mapping", "index": 999, "type": "WeightConverter", "source": ["a"], "target": ["b"]}
        ],
        "source_dtypes": {},
        "source_shapes": {},
        "source_shards": {},
        "loaded_keys": [],
    }
    state[RECORD_KEY] = torch.frombuffer(bytearray(json.dumps(record).encode()), dtype=torch.uint8)
    dcp.save(state, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    target = dense.build_dense_model(config, device="meta")
    with pytest.raises(
        surgery.LoadError, match=r"names transform #999 \(WeightConverter \['a'\] -> \['b'\]\)"
    ):
        load_dcp(target, tmp_path / "dcp")
    assert all(p.is_meta for p in target.parameters())  # nothing allocated, nothing read


def test_a_model_never_loaded_saves_its_state_without_a_record(tmp_path):
    model = nn.Linear(3, 2)
    save_dcp(model, tmp_path / "dcp")
    again = nn.Linear(3, 2)
    load_dcp(again, tmp_path / "dcp")
    assert torch.equal(again.weight, model.weight) and torch.equal(again.bias, model.bias)
    assert record_of(again).load is None
    assert sorted(dcp_state_dict(model)) == ["bias", "weight"]


def test_a_quantized_load_record_is_refused_before_anything_is_written(tmp_path):
    model = nn.Linear(3, 2)
    update_record(model, load=LoadRecord(quantizer=object()))
    with pytest.raises(surgery.ConfigurationError, match="unquantized load only"):
        save_dcp(model, tmp_path / "dcp")
    assert not (tmp_path / "dcp").exists()


def test_an_unknown_storage_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(surgery.ConfigurationError, match=r"choose one of \['dcp', 'safetensors'\]"):
        save_dcp(nn.Linear(3, 2), tmp_path / "dcp", storage="hf")


def test_a_folder_without_dcp_metadata_is_refused_with_the_fix(tmp_path):
    with pytest.raises(
        surgery.CheckpointError,
        match=r"not a DCP checkpoint \(no \.metadata, no safetensors files\): write one with save_dcp",
    ):
        load_dcp(nn.Linear(3, 2), tmp_path)


# --------------------------------------------------------------------------- 4 spawned ranks


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    return [r["dcp"] for r in mesh4_ranks]


def _facts(ranks: list[dict], case: str) -> list[dict]:
    out = [r[case] for r in ranks]
    for f in out:
        assert "error" not in f, f["error"]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_fsdp_over_tp_reshards_to_tp4_equal_to_torchs_own_split(ranks, case):
    for f in _facts(ranks, case):
        assert f["loaded_on_a"]
        assert f["strided_on_a"]  # placements DCP's own chunks cannot describe were saved
        assert f["unequal_on_b"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_the_dcp_checkpoint_stores_every_byte_of_the_model_once(ranks, case):
    f = _facts(ranks, case)[0]
    stored = f["stored"]
    assert stored["chunk_bytes"] == f["model_bytes"] + stored["record_bytes"]  # replicas written once
    assert stored["file_bytes"] > stored["chunk_bytes"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_tp4_reshards_back_to_fsdp_over_tp_equal_to_torchs_own_split(ranks, case):
    for f in _facts(ranks, case):
        assert f["unequal_back_on_a"] == []


@pytest.mark.distributed
def test_fsdp_over_packed_colwise_is_the_case_torchs_plain_dcp_save_refuses(ranks):
    for f in _facts(ranks, f"{MESH_A}->{MESH_B}/dense"):
        assert any("gate_up_proj" in k for k in f["strided_on_a"])
        assert f["torch_dcp_misread"] == ["raised: overlapping chunks"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_hub_loaded_on_mesh_a_saved_with_dcp_reloaded_on_tp4_saves_the_hub_file_byte_for_byte(ranks, case):
    f = _facts(ranks, case)[0]
    _same_files(Path(f["hub"]), Path(f["hub_again"]))


@pytest.mark.distributed
@pytest.mark.parametrize("case", ROUND_TRIPS)
def test_the_4_rank_dcp_checkpoint_reloads_in_one_process_bit_equal_and_saves_the_hub_file(
    ranks, case, tmp_path
):
    f = _facts(ranks, case)[0]
    build = MODELS[case.rsplit("/", 1)[1]]
    ref = build(device="meta")
    assert surgery.load_checkpoint(ref, f["hub"]).ok
    model = build(device="meta")
    load_dcp(model, f["dcp"])
    for key, value in ref.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    surgery.save_checkpoint(model, tmp_path / "out")
    _same_files(Path(f["hub"]), tmp_path / "out")


@pytest.mark.distributed
def test_fsdp_on_dp_shard4_saved_as_safetensors_reshards_to_tp4_and_saves_the_hub_file(ranks):
    facts = _facts(ranks, "safetensors")
    for f in facts:
        assert f["unequal_on_b"] == []
    assert len([n for n in facts[0]["files"] if n.endswith(".safetensors")]) == 4  # one file per rank
    _same_files(Path(facts[0]["hub"]), Path(facts[0]["hub_again"]))


@pytest.mark.distributed
def test_a_dcp_checkpoint_of_another_model_is_refused_on_every_rank_naming_the_keys(ranks):
    facts = _facts(ranks, "bad_inputs")
    for case, named in (
        ("another_model", "missing ['model.layers.0.mlp.experts.down_proj'"),
        ("other_shapes", "'model.layers.0.mlp.gate_up_proj.weight' is stored in"),
        ("not_dcp", "not a DCP checkpoint"),
        ("packed_as_safetensors", "cannot store 'model.layers.0.mlp.gate_up_proj.weight'"),
    ):
        refusals = [f[case] for f in facts]
        assert refusals[0]["raised"] in ("LoadError", "CheckpointError", "ConfigurationError")
        assert named in refusals[0]["message"]
        assert all(r == refusals[0] for r in refusals)  # the same error on every rank


@pytest.mark.distributed
def test_the_moe_resharded_from_fsdp_over_tp_to_whole_experts_per_rank_saves_the_hub_file(ranks):
    """(dp_shard=2, tp=2) -> expert_parallel over ep=4: each rank holds exactly its experts."""
    facts = _facts(ranks, "to_ep")
    for f in facts:
        assert f["unequal_on_ep"] == []
        assert f["experts_sharded"] == sorted(
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")
        )
    _same_files(Path(facts[0]["hub"]), Path(facts[0]["hub_again"]))
