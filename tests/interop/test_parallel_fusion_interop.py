"""Fusion x tensor parallelism on transformers' Llama, 2 gloo ranks (scenarios in ``tests/tp_fusion_scenarios.py``).

Llama (sdpa, equal q/k/v heads) saved by ``save_pretrained``, loaded with ``qkv`` and ``gate_up``
fused and ``packed_colwise`` (``qkv_proj`` in three parts): every parameter equals the
single-process fused load, the logits equal transformers' unfused model on one process, and the
save writes back ``save_pretrained``'s file byte for byte.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytestmark = [pytest.mark.interop, pytest.mark.distributed]

TP2 = ("fusion", ["llama"])  # in the session's one 2-rank spawn (tests/tp2_scenarios.py)


@pytest.fixture(scope="module")
def llama(tp2_ranks: list[dict[str, dict]]) -> list[dict]:
    out = [r["fusion"]["llama"] for r in tp2_ranks]
    for f in out:
        assert "crash" not in f, f["crash"]
    return out


def test_a_fused_sharded_llama_loads_every_parameter_equal_to_the_single_process_fused_load(llama):
    for rank in llama:
        assert rank["ok"], rank["report"]
        assert rank["unequal"] == []
        assert rank["fused"]["model.layers.0.self_attn.qkv_proj"]["placements"] == [
            "_StridedShard(dim=0, sf=3)"
        ]
        assert rank["fused"]["model.layers.0.mlp.gate_up_proj"]["local_rows"] == 96  # 2 x 96 / 2


def test_the_fused_sharded_llama_runs_the_logits_of_transformers_on_one_process(llama):
    for rank in llama:
        assert rank["output_shape"] == [2, 5, 128]
        assert rank["max_abs_diff"] < 1e-5


def test_saving_the_fused_sharded_llama_writes_save_pretrained_s_file_byte_for_byte(llama):
    assert llama[0]["saved_identical"]
