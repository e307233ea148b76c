"""Resharding through DCP on a transformers model: Mixtral's ``save_pretrained`` checkpoint loaded
on (dp_shard=2, tp=2) with ``tp_plan="auto"``, saved with ``save_dcp``, reloaded on (dp_shard=4)
(its two kv heads do not split four ways) and back, bit-equal to torch's own shards, and saved
back to the hub layout byte for byte (the ``dcp-interop`` suite of the session's one 4-rank spawn,
``tests/dcp_scenarios.py``).
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.interop, pytest.mark.distributed]

FAMILIES = ("mixtral",)


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    pytest.importorskip("transformers")
    return [r["dcp-interop"] for r in mesh4_ranks]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_transformers_moe_reshards_through_dcp_bit_equal_and_saves_its_hub_file(ranks, family):
    facts = [r[f"dp_shard2_tp2->dp_shard4/{family}"] for r in ranks]
    for f in facts:
        assert "error" not in f, f["error"]
        assert f["loaded_on_a"] and f["strided_on_a"]
        assert f["unequal_on_b"] == [] and f["unequal_back_on_a"] == []
    hub, again = Path(facts[0]["hub"]), Path(facts[0]["hub_again"])
    for name in ("model.safetensors", "config.json"):
        assert (hub / name).read_bytes() == (again / name).read_bytes(), name
