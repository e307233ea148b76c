"""Expert parallelism (``expert_parallel``): whole experts per rank, read, run and saved.

The scenarios run in the session's one 4-rank spawn (``tests/ep_scenarios.py``, suite ``ep``):
the example MoE with 16 experts over ``ep=4`` from a per-expert, a fused and a block-FP8
per-expert checkpoint (and through ``tp_plan="auto"`` on a mesh named ``ep``); over
``(ep=2, tp=2)`` with each expert split over ``tp`` (expert-TP); and over ``(dp_shard=2, ep=2)``
with FSDP2 on top. Specification: each rank holds exactly its experts, equal bit for bit to the
same slice of a single-process load, reads only their bytes plus the replicated ones, runs the
single-process forward, and a save from the 4 ranks writes the single-process file.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

LAYOUTS = ["per_expert", "fused", "auto", "fp8"]
MESHES = ["ep_tp", "dp_ep", "dp_ep_fsdp"]
OTHER_LAYOUTS = [
    "ep_tp_fused",
    "ep_tp_fp8",
    "dp_ep_fused",
    "dp_ep_fp8",
]  # on (ep=2, tp=2) and (dp_shard=2, ep=2)
EVERY = LAYOUTS + MESHES + OTHER_LAYOUTS
EXPERT_KEYS = sorted(
    f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")
)


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    return [r["ep"] for r in mesh4_ranks]


def _facts(ranks: list[dict], name: str) -> list[dict]:
    facts = [r[name] for r in ranks]
    for f in facts:
        assert "error" not in f, f["error"]
    return facts


@pytest.mark.parametrize("scenario", EVERY)
def test_each_rank_holds_exactly_its_experts_equal_to_the_single_process_load(ranks, scenario):
    for f in _facts(ranks, scenario):
        assert f["ok"], f["report"]
        assert f["unequal"] == []  # every local tensor is torch's own slice of the single-process load
        assert f["sharded"] == EXPERT_KEYS


@pytest.mark.parametrize(
    ("scenario", "gate_up", "down"),
    [
        ("per_expert", ["Shard(dim=0)"], ["Shard(dim=0)"]),
        ("ep_tp", ["Shard(dim=0)", "_StridedShard(dim=1, sf=2)"], ["Shard(dim=0)", "Shard(dim=2)"]),
        (
            "dp_ep",
            ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
            ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"],
        ),
    ],
)
def test_the_experts_placements_on_each_mesh(ranks, scenario, gate_up, down):
    for f in _facts(ranks, scenario):
        for layer in range(2):
            assert f["placements"][f"model.layers.{layer}.mlp.experts.gate_up_proj"] == gate_up
            assert f["placements"][f"model.layers.{layer}.mlp.experts.down_proj"] == down


@pytest.mark.parametrize("scenario", ["per_expert", "fused", "auto", *MESHES, "ep_tp_fused", "dp_ep_fused"])
def test_each_rank_reads_only_its_experts_and_the_replicated_tensors(ranks, scenario):
    for f in _facts(ranks, scenario):
        assert f["bytes_read"] <= 1.05 * (f["experts_bytes"] + f["other_bytes"]), f
        assert f["bytes_read"] >= f["experts_bytes"] + f["other_bytes"]
        assert f["bytes_read"] < 0.5 * f["single_bytes"]  # a quarter of the experts: the experts dominate


@pytest.mark.parametrize("scenario", ["per_expert", "auto", "fp8"])
def test_a_per_expert_checkpoint_is_read_exactly_for_the_owned_experts(ranks, scenario):
    """Counted from the header: the owned experts' tensors (FP8: with their scales) and the dense ones."""
    for f in _facts(ranks, scenario):
        assert f["bytes_read"] == f["owned_stored_bytes"], f


def test_expert_tp_on_fp8_experts_reads_half_of_each_expert_with_its_scales(ranks):
    """(ep=2, tp=2) holds as many expert bytes per rank as ep=4 (half of 8 experts against 4 whole
    ones) and splits attention too: every rank reads less than an ep=4 rank of the same FP8 file."""
    ep4 = min(f["bytes_read"] for f in _facts(ranks, "fp8"))
    for f in _facts(ranks, "ep_tp_fp8"):
        assert f["bytes_read"] < ep4, (f["bytes_read"], ep4)


@pytest.mark.parametrize(
    "scenario", ["per_expert", "fused", "fp8", "auto", "dp_ep", "dp_ep_fsdp", "dp_ep_fused", "dp_ep_fp8"]
)
def test_the_dry_run_of_a_rank_plans_the_bytes_it_reads(ranks, scenario):
    """``plan_load(..., tp_size=4, tp_rank=r)``, or ``device_mesh={"ep": 4}`` / ``{"dp_shard": 2, "ep": 2}``
    with ``rank=r``, counts what rank ``r``'s load reads (FP8: with its scales)."""
    for f in _facts(ranks, scenario):
        assert f["planned_bytes"] == f["bytes_read"], f


@pytest.mark.parametrize("scenario", EVERY)
def test_the_forward_equals_the_single_process_forward(ranks, scenario):
    for f in _facts(ranks, scenario):
        assert f["forward_max_diff"] < 1e-5, f["forward_max_diff"]


@pytest.mark.parametrize("scenario", EVERY)
def test_a_save_from_the_expert_parallel_model_writes_the_single_process_file(ranks, scenario):
    """In the original per-expert layout (FP8: re-encoded with the scales of every expert, each
    written by the rank that writes its file)."""
    facts = _facts(ranks, scenario)
    assert facts[0]["saved_identical"]
    assert sum(len(f["wrote"]) for f in facts) >= 1


@pytest.mark.parametrize("scenario", ["per_expert", "fused", "ep_tp", "dp_ep"])
def test_a_save_in_the_fused_runtime_layout_writes_the_single_process_file(ranks, scenario):
    assert _facts(ranks, scenario)[0]["runtime_identical"]


@pytest.mark.parametrize("scenario", ["gradients", "gradients_ep_tp"])
def test_a_backward_gives_each_rank_its_slice_of_the_single_process_gradients(ranks, scenario):
    """Training through ``expert_parallel`` (on ep=4, and expert-TP on (ep=2, tp=2)): the experts'
    gradients and those of the modules around them (router, attention, norms) are exact up to
    float32 rounding on every rank."""
    for f in _facts(ranks, scenario):
        assert f["no_grad"] == []
        assert f["max_grad_diff"] < 1e-6, f["max_grad_diff"]


def test_a_missing_expert_fails_its_layer_on_every_rank_naming_the_index(ranks):
    """Expert 5 of layer 1 belongs to rank 1; every rank sees the gap from the headers."""
    for f in _facts(ranks, "missing_expert"):
        assert f["raised"] is None and not f["ok"]
        assert "index 5 of" in f["report"] and "model.layers.1.mlp.experts.gate_up_proj" in f["report"]
        assert "model.layers.1.mlp.experts.down_proj" in f["report"]


def test_an_expert_count_the_ranks_do_not_divide_is_refused_on_every_rank(ranks):
    facts = _facts(ranks, "six_experts")
    assert all(f["raised"] == "ConfigurationError" for f in facts), facts
    assert "size 6" in facts[0]["message"] and "world size 4" in facts[0]["message"]


def test_expert_parallel_on_a_module_without_3d_experts_is_refused_naming_it(ranks):
    facts = _facts(ranks, "not_experts")
    assert all(f["raised"] == "ConfigurationError" for f in facts), facts
    assert "mlp.gate" in facts[0]["message"] and "expert_parallel" in facts[0]["message"]
