"""transformers' Llama (grouped-query attention), Mixtral and Qwen2-MoE, built tiny with
``init_empty``, parallelized the torchtitan way on a ``dp_shard=2 x tp=2`` mesh of 4 gloo ranks
with a hand-written tp plan, and loaded from their own ``save_pretrained`` checkpoints with no
``tp_plan``: every local tensor is what torch's own flow holds, the logits match the
single-process model's, each rank reads only its shards, nothing is gathered during the load,
and DCP's ``HuggingFaceStorageReader`` reads the same slices (the session's one 4-rank spawn, ``tests/mesh_scenarios.py``; scenarios in ``tests/nd_scenarios.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.interop, pytest.mark.distributed]

TESTS = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "mixtral", "qwen2_moe")


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    pytest.importorskip("transformers")
    return [r["nd-interop"] for r in mesh4_ranks]


def _facts(ranks: list[dict], case: str) -> list[dict]:
    out = [r[case] for r in ranks]
    for f in out:
        assert "error" not in f, f["error"]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_over_tp_loads_every_local_tensor_exactly_and_the_logits_match(ranks, family):
    for f in _facts(ranks, f"dp_shard2_tp2/{family}"):
        assert f["ok"] and f["unequal"] == [] and f["fallbacks"] == []
        assert f["forward_max_diff"] <= 1e-5
        assert f["dry_run_differs"] == []


@pytest.mark.parametrize("family", FAMILIES)
def test_each_rank_reads_its_shards_and_nothing_is_gathered(ranks, family):
    for f in _facts(ranks, f"dp_shard2_tp2/{family}"):
        assert f["bytes_read"] <= 1.05 * (f["local_bytes"] + f["replicated_bytes"])
        # only the load's agreement flags (a failure on one rank fails every rank): one int each
        assert set(f["collectives"]) <= {"all_reduce"} and f["collectives"].get("all_reduce", 0) <= 4


def test_dcp_reads_the_same_slices_of_llama(ranks):
    for f in _facts(ranks, "oracle"):
        assert f["unequal"] == []
        assert "(Shard(dim=0), Shard(dim=1))" in f["placements"]
