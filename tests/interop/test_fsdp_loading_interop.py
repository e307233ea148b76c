"""The convenient path on transformers models: ``load_checkpoint(..., device_mesh=mesh,
tp_plan="auto", fsdp=True)`` on (dp_shard=2, tp=2) finds their decoder layers through
``_no_split_modules``, shards as ``parallelize_module`` + ``fully_shard`` by hand, holds torch's
own shards and matches the single-process logits (the session's one 4-rank spawn, ``tests/mesh_scenarios.py``; scenarios in ``tests/fsdp_scenarios.py``). The
plan is ``tp_plan="auto"``: the model's own plan in transformers' style names, translated
(:mod:`surgery.parallel.hf_plan`), laid out as the hand-written plan of ``tests/nd_scenarios.py``
is by hand.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.interop, pytest.mark.distributed]

TESTS = Path(__file__).resolve().parents[1]
FAMILIES = ("llama", "mixtral")


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    pytest.importorskip("transformers")
    return [r["fsdp-interop"] for r in mesh4_ranks]


@pytest.mark.parametrize("family", FAMILIES)
def test_fsdp_true_on_a_transformers_model_shards_as_by_hand_and_loads_exactly(ranks, family):
    for f in (r[f"dp_shard2_tp2/{family}"] for r in ranks):
        assert "error" not in f, f["error"]
        assert f["ok"] and f["same_layout_as_by_hand"]
        assert f["fsdp_modules"].count(f"FSDP{'Llama' if family == 'llama' else 'Mixtral'}DecoderLayer") == 2
        assert f["unequal"] == [] and f["fallbacks"] == 0
        assert f["forward_max_diff"] < 1e-5
