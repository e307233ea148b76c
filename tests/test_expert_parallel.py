"""Expert parallelism (``expert_parallel``): whole experts per rank, read, run and saved.

The scenarios run in the session's one 4-rank spawn (``tests/ep_scenarios.py``, suite ``ep``):
the example MoE with 16 experts over ``ep=4``, from a per-expert and from a fused checkpoint.
Specification: each rank holds exactly its experts (``Shard(0)``), equal bit for bit to the
same slice of a single-process load, reads only their bytes plus the replicated ones, runs the
single-process forward, and a save from the 4 ranks writes the single-process file.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.distributed

LAYOUTS = ["per_expert", "fused"]


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    return [r["ep"] for r in mesh4_ranks]


def _facts(ranks: list[dict], name: str) -> list[dict]:
    facts = [r[name] for r in ranks]
    for f in facts:
        assert "error" not in f, f["error"]
    return facts


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_holds_exactly_its_experts_equal_to_the_single_process_load(ranks, layout):
    for f in _facts(ranks, layout):
        assert f["ok"], f["report"]
        assert f["unequal"] == []
        assert f["sharded"] == sorted(
            f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("down_proj", "gate_up_proj")
        )


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_rank_reads_only_its_experts_and_the_replicated_tensors(ranks, layout):
    for f in _facts(ranks, layout):
        assert f["bytes_read"] <= 1.05 * (f["experts_bytes"] + f["other_bytes"]), f
        assert f["bytes_read"] >= f["experts_bytes"] + f["other_bytes"]
        assert f["bytes_read"] < 0.5 * f["single_bytes"]  # 4 of 16 experts: the experts dominate


@pytest.mark.parametrize("layout", LAYOUTS)
def test_the_forward_equals_the_single_process_forward(ranks, layout):
    for f in _facts(ranks, layout):
        assert f["forward_max_diff"] < 1e-5, f["forward_max_diff"]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_save_from_the_expert_parallel_model_writes_the_single_process_file(ranks, layout):
    facts = _facts(ranks, layout)
    assert facts[0]["saved_identical"]
    assert sum(len(f["wrote"]) for f in facts) >= 1


def test_an_expert_count_the_ranks_do_not_divide_is_refused_on_every_rank(ranks):
    facts = _facts(ranks, "six_experts")
    assert all(f["raised"] == "ConfigurationError" for f in facts), facts
    assert "size 6" in facts[0]["message"] and "world size 4" in facts[0]["message"]


def test_expert_parallel_on_a_module_without_3d_experts_is_refused_naming_it(ranks):
    facts = _facts(ranks, "not_experts")
    assert all(f["raised"] == "ConfigurationError" for f in facts), facts
    assert "mlp.gate" in facts[0]["message"] and "expert_parallel" in facts[0]["message"]
