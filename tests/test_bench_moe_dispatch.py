"""``surgery bench moe_dispatch``: the all-reduce of ``expert_parallel`` and an all-to-all dispatch
compute the same MoE layer (2 gloo ranks, a tiny layer; the timings are not checked)."""

from __future__ import annotations

import pytest

from surgery.bench.moe_dispatch import run

pytestmark = pytest.mark.distributed


def test_the_expert_parallel_style_and_an_all_to_all_dispatch_give_the_same_outputs():
    r = run(ranks=2, tokens=16, experts=4, hidden=8, intermediate=8, top_k=2, repeat=1)
    assert r["max_diff"] < 1e-6
    assert set(r["best"]) == {"all_reduce", "all_to_all"} and all(t > 0 for t in r["best"].values())
