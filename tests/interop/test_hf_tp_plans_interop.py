"""``tp_plan="auto"`` on transformers models as they come: their own plan vocabulary is
translated (:mod:`surgery.parallel.hf_plan`), no hand-written plan. Every name of the installed
release's registry maps or is refused by name; six families load exactly at TP=2 (the session's one 2-rank spawn,
``tests/hfplan_scenarios.py``), with the single-process logits and ``generate()`` tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from surgery import ConfigurationError
from surgery.parallel.hf_plan import HF_STYLES, REFUSED, translate_hf_plan
from surgery.parallel.plan import STYLE_NAMES

pytestmark = pytest.mark.interop

TESTS = Path(__file__).resolve().parents[1]


def _registry() -> list[str]:
    pytest.importorskip("transformers")
    from transformers.distributed import expert_parallel, tensor_parallel  # noqa: F401  (they register)
    from transformers.distributed.parallel_utils import ALL_PARALLEL_STYLES

    return sorted(ALL_PARALLEL_STYLES._global_mapping)


def test_every_name_of_transformers_registry_maps_or_is_refused():
    names = _registry()
    assert len(names) >= 15
    unknown = [n for n in names if n not in HF_STYLES and n not in REFUSED]
    assert unknown == [], f"transformers style names neither mapped nor refused in hf_plan: {unknown}"
    assert all(v in STYLE_NAMES for v in HF_STYLES.values())


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_a_refused_name_raises_naming_the_key_the_style_and_the_alternative(name):
    with pytest.raises(
        ConfigurationError, match=rf"tp_plan\['model.x'\] = '{name}'.*refused: .*use|keep|load"
    ):
        translate_hf_plan({"model.x": name})


def test_moe_tp_experts_folds_its_parameter_entries_into_the_experts_style():
    plan = {"e.gate_up_proj": "packed_colwise", "e.down_proj": "rowwise", "e": "moe_tp_experts"}
    assert translate_hf_plan(plan) == {"e": "experts"}
    with pytest.raises(ConfigurationError, match=r"'e.down_proj'.*'rowwise'"):
        translate_hf_plan({**plan, "e.down_proj": "colwise"})


def test_an_ep_plan_folds_its_grouped_gemm_entries_into_expert_parallel():
    plan = {"e.gate_up_proj": "grouped_gemm", "e.down_proj": "grouped_gemm", "e": "ep_dispatch_experts"}
    assert translate_hf_plan(plan) == {"e": "expert_parallel"}


TP2 = ("hfplan", ())  # every family, in the session's one 2-rank spawn (tests/tp2_scenarios.py)


@pytest.fixture(scope="module")
def ranks(tp2_ranks: list[dict[str, dict]]) -> list[dict]:
    pytest.importorskip("transformers")
    return [r["hfplan"] for r in tp2_ranks]


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe"])
def test_tp_plan_auto_loads_a_transformers_model_exactly_at_tp2(ranks, family):
    for f in (r[family] for r in ranks):
        assert "error" not in f, f["error"]
        assert f["ok"] and f["unequal"] == [] and f["sharded"] > 0
        assert f["logits_max_diff"] < 1e-5
        assert f["tokens"] == f["expected_tokens"]
        assert f["read_fraction"] < 0.75


def test_a_transformers_name_in_a_plan_of_your_own_is_refused_with_our_name_for_it():
    from surgery.examples import build_dense_model
    from surgery.parallel import resolve_tp_plan

    with pytest.raises(
        ConfigurationError, match=r"'colwise_gather_output' is transformers' name for 'colwise_gather'"
    ):
        resolve_tp_plan(build_dense_model(device="meta"), {"lm_head": "colwise_gather_output"}, world_size=2)


def test_a_declared_plan_that_matches_no_module_at_all_is_refused():
    from surgery.examples import build_dense_model
    from surgery.parallel import resolve_tp_plan

    model = build_dense_model(device="meta")
    model.tp_plan = {"model.nothing.*": "colwise"}
    with pytest.raises(ConfigurationError, match=r"no pattern of .* own tp_plan matches a module"):
        resolve_tp_plan(model, "auto", world_size=2)
