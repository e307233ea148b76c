"""``surgery bench planning``'s synthetic many-key index and its measurements, on a tiny index.

The benchmark's numbers are not checked here (machines are shared and noisy): the index it
writes and what it measures are.
"""

from __future__ import annotations

import surgery
from surgery.bench.planning import _EP_PLAN, _measure, _tiny_config, write_fp8_index
from surgery.checkpoint import open_checkpoint
from surgery.examples.moe import build_moe_model
from surgery.quantization import FP8BlockQuantizer


def test_the_index_holds_every_expert_weight_with_its_scale_and_is_reused(tmp_path):
    keys = write_fp8_index(tmp_path, 2, 8)
    with open_checkpoint(tmp_path) as reader:
        stored = reader.keys()
        assert len(stored) == keys
        weights = [k for k in stored if ".experts." in k and k.endswith(".weight")]
        assert len(weights) == 2 * 8 * 3
        assert all(f"{k}_scale_inv" in reader for k in weights)
    stamp = (tmp_path / "model.safetensors").stat().st_mtime_ns
    assert write_fp8_index(tmp_path, 2, 8) == keys
    assert (tmp_path / "model.safetensors").stat().st_mtime_ns == stamp


def test_one_expert_parallel_rank_plans_reads_of_its_experts_only(tmp_path):
    keys = write_fp8_index(tmp_path, 2, 8)
    model = build_moe_model(_tiny_config(2, 8), seed=None, device="meta")
    quantizer = FP8BlockQuantizer(block_size=(4, 4))
    whole = surgery.plan_load(model, tmp_path, quantizer=quantizer)
    rank = surgery.plan_load(model, tmp_path, quantizer=quantizer, tp_plan=_EP_PLAN, tp_size=4, tp_rank=1)
    assert not whole.problems and not rank.problems
    experts = {e.target_keys[0]: e.nbytes for e in rank.entries if ".experts." in e.target_keys[0]}
    # 2 of the 8 experts: 16 bytes of FP8 per weight and its 4-byte scale (gate_up: w1 and w3)
    assert len(experts) == 4 and all(
        n == 2 * (16 + 4) * (2 if k.endswith("gate_up_proj") else 1) for k, n in experts.items()
    )
    facts = _measure(tmp_path, model, quantizer, 4, 1)
    assert facts["keys"] == keys
    assert all(facts[f"{n}_s"] > 0 for n in ("header", "routing", "single", "rank"))
