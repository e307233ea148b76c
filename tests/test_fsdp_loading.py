"""The convenient path: ``load_checkpoint(model, ckpt, device_mesh=mesh, tp_plan="auto", fsdp=True)``.

TP on ``mesh["tp"]``, then FSDP2's ``fully_shard`` per decoder layer and at the root on the
data-parallel dims, validated before anything changes, then the n-D load. The session's one 4-rank spawn
ranks runs every scenario of ``tests/fsdp_scenarios.py``; the rest runs in this process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import surgery
from surgery.examples import dense, moe
from surgery.parallel.fsdp import FSDPOptions, decoder_layers, fsdp_options

HERE = Path(__file__).resolve().parent


def test_decoder_layers_are_the_outermost_list_of_repeated_blocks():
    assert decoder_layers(dense.build_dense_model(device="meta"))[0] == "model.layers"
    assert decoder_layers(moe.build_moe_model(device="meta"))[0] == "model.layers"  # not the experts


@pytest.mark.interop
def test_decoder_layers_of_a_transformers_model_follow_its_no_split_modules():
    import transformers

    config = transformers.MixtralConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128
    )
    with surgery.init_empty():
        model = transformers.MixtralForCausalLM(config)
    path, layers = decoder_layers(model)
    assert path == "model.layers" and type(layers[0]).__name__ in model._no_split_modules


def test_fsdp_options_are_true_or_the_options_object_and_anything_else_is_refused():
    assert fsdp_options(True) == FSDPOptions() and fsdp_options(None) is None and fsdp_options(False) is None
    mine = FSDPOptions(reshard_after_forward=False, layers="model.layers")
    assert fsdp_options(mine) is mine
    with pytest.raises(surgery.ConfigurationError, match="FSDPOptions"):
        fsdp_options({"reshard_after_forward": False})


# --------------------------------------------------------------------------- 4 spawned ranks


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    return [r["fsdp"] for r in mesh4_ranks]


def _facts(ranks: list[dict], case: str) -> list[dict]:
    out = [r[case] for r in ranks]
    for f in out:
        assert "error" not in f, f["error"]
    return out


CASES = ["dp_shard2_tp2/dense", "dp_shard2_tp2/moe", "tp4/dense", "dp_shard4/moe", "hsdp2x2/dense"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_the_convenient_path_shards_as_parallelize_module_and_fully_shard_by_hand(ranks, case):
    for f in _facts(ranks, case):
        assert f["same_layout_as_by_hand"]
        assert f["dtensors"] > 0
        wants_fsdp = not case.startswith("tp4")
        assert bool(f["fsdp_modules"]) == wants_fsdp


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_the_convenient_load_holds_torchs_own_shards_and_forwards_as_one_process(ranks, case):
    for f in _facts(ranks, case):
        assert f["ok"]
        assert f["unequal"] == []
        assert f["fallbacks"] == 0
        assert f["forward_max_diff"] < 1e-5


BAD = {
    "unknown_dim": ["'dp'", "dp_replicate, dp_shard, ep, tp"],
    "plan_without_tp_dim": ["'tp'", "lacks"],
    "mesh_dp_without_fsdp": ["fsdp=True"],
    "does_not_divide": ["'layers.0.weight'", "size 5", "'dp_shard' of size 2"],
    "tp_shard_does_not_divide": [
        "'layers.0.weight'",
        "size 3",
        "tensor-parallel shard",
        "'dp_shard' of size 2",
    ],
    "shared_between_layers": ["decoder layer 1 cannot be wrapped", "'weight'", "layer 0"],
    "no_layers": ["cannot tell the decoder layers", "FSDPOptions(layers="],
    "layers_not_a_list": ["'layers.0'", "nn.ModuleList"],
}


@pytest.mark.distributed
@pytest.mark.parametrize("case", sorted(BAD))
def test_a_plan_that_does_not_fit_is_refused_before_reading_naming_the_fix(ranks, case):
    for f in _facts(ranks, "bad_inputs"):
        assert f[case]["raised"] == "ConfigurationError", f[case]
        for part in BAD[case]:
            assert part in f[case]["message"]


@pytest.mark.distributed
def test_a_refusal_after_tp_was_applied_leaves_the_model_as_it_was(ranks):
    for f in _facts(ranks, "bad_inputs"):
        assert f["unchanged_after_tp_then_refusal"]


@pytest.mark.distributed
def test_the_docs_recipe_loads_trains_one_step_and_saves_what_it_trained(ranks):
    facts = _facts(ranks, "recipe")
    assert len({f["loss"] for f in facts}) == 1  # one loss, every rank
    assert sum(f["files"] for f in facts) >= 1
    for f in facts:
        assert f["differs_after_reload"] == []
        assert f["changed_by_the_step"] > 0


@pytest.mark.distributed
def test_one_training_step_on_the_moe_example_keeps_its_tp_replicas_equal(ranks):
    # The experts' style sums the gradients of its inputs over tp, so the router and the norms
    # around it take the same step on every rank and a save of any replica reloads them all.
    for f in _facts(ranks, "moe_step"):
        assert f["changed_by_the_step"] > 0
        assert f["differs_after_reload"] == []
