"""Expert parallelism on transformers MoEs: Mixtral, Qwen2-MoE and Qwen3-MoE with 16 experts, each
from its own ``save_pretrained`` files: over ``ep=4`` with ``tp_plan="auto"`` on a mesh named
``ep`` (the model's ``base_model_ep_plan``: ``ep_dispatch_experts`` with ``grouped_gemm``
parameters, translated to ``expert_parallel``), over ``(ep=2, tp=2)`` (heads over ``tp``, each
expert over ``tp`` inside its ``ep`` group) and over ``(dp_shard=2, ep=2)`` (FSDP2 on top). The
``ep-interop`` suite of the session's one 4-rank spawn (``tests/ep_scenarios.py``).

Specification: each rank holds its experts of every layer, equal bit for bit to torch's slice
of a single-process load, reads only them and the replicated tensors, computes the
single-process logits, and a save from the 4 ranks writes ``save_pretrained``'s weights file.
"""

from __future__ import annotations

import pytest

pytestmark = [pytest.mark.interop, pytest.mark.distributed]

FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe")
MESHES = {"ep4": ["Shard(dim=0)"], "ep_tp": None, "dp_ep": ["_StridedShard(dim=0, sf=2)", "Shard(dim=0)"]}


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    pytest.importorskip("transformers")
    return [r["ep-interop"] for r in mesh4_ranks]


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_moe_loads_its_experts_per_rank(ranks, family, mesh):
    facts = [r[family if mesh == "ep4" else f"{family}/{mesh}"] for r in ranks]
    for f in facts:
        assert "error" not in f, f["error"]
        assert f["ok"], f["report"]
        assert f["unequal"] == []
        assert f["sharded"] == sorted(
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")
        )
        if MESHES[mesh] is not None:
            assert all(p == MESHES[mesh] for p in f["placements"].values())
        assert f["bytes_read"] <= 1.05 * (f["experts_bytes"] + f["other_bytes"]), f
        if mesh == "ep4":  # the dry run with device_mesh={"ep": 4} plans what the load reads
            assert f["planned_bytes"] == f["bytes_read"]
        assert f["forward_max_diff"] < 1e-5
    assert facts[0]["saved_identical"]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_backward_through_a_transformers_moe_gives_each_rank_its_slice_of_the_gradients(ranks, family):
    """transformers' experts implementation (``grouped_mm`` on CPU) with the expert-parallel
    sentinel: each rank's gradients are its slices of the single-process ones."""
    for r in ranks:
        f = r[f"{family}/gradients"]
        assert "error" not in f, f["error"]
        assert f["no_grad"] == []
        assert f["max_grad_diff"] < 1e-5, f
