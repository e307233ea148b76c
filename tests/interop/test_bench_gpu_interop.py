"""Interop: ``surgery bench gpu``, the prepared GPU run, checked end to end on the CPU at tiny scale.

The script runs on a GPU machine in a short window, so every part of it runs here first: the
checkpoints it builds (transformers' Llama and Qwen3-MoE hub layouts, a block-FP8 copy), loads
in fresh processes through the staging ring (forced on the CPU), the exactness checks, the FP8
runtime (which decodes on the CPU) and the fusion timings. What is asserted is what the GPU run
must show too; timings are only checked to be there.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from surgery.bench.gpu import run

pytestmark = pytest.mark.interop


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run(workdir=tmp_path_factory.mktemp("gpu-bench"), device="cpu", compile_too=False)


def test_every_part_ran_without_an_error(results):
    for part in (
        "checkpoints",
        "pinned_bandwidth_GB/s",
        "loads",
        "ring_sweep",
        "exactness",
        "fp8_runtime",
        "fp8_matmul",
        "fusions",
    ):
        assert part in results and not (isinstance(results[part], dict) and "error" in results[part]), (
            results[part]
        )
    assert results["scale"] == "tiny" and results["staging_bytes"] == "1MiB"


def test_each_loader_ran_warm_and_surgery_read_through_the_ring(results):
    loads = results["loads"]
    assert set(loads) == {
        f"{family} {cache} {how}"
        for family in ("llama", "moe")
        for cache, hows in (
            ("warm", ("surgery", "safetensors", "transformers")),
            ("cold", ("surgery", "safetensors")),
        )
        for how in hows
    }
    for name, row in loads.items():
        assert "error" not in row, (name, row["error"])
        assert row["seconds"] > 0 and row["rss_growth"] >= 0 and row["GB/s"] > 0
        if name.endswith("surgery"):
            assert row["ok"] and row["staged_bytes"] == row["bytes_read"] > 0


def test_the_sweep_times_each_count_of_threads_and_ring_size(results):
    assert set(results["ring_sweep"]) == {"2 workers, 1MiB", "4 workers, 4MiB"}
    assert all(row["seconds"] > 0 and row["GB/s"] > 0 for row in results["ring_sweep"].values())


def test_a_device_load_is_bit_equal_to_a_cpu_load_and_saves_back_identical(results):
    for family in ("llama", "moe"):
        facts = results["exactness"][family]
        assert facts["tensors"] > 0 and facts["unequal_to_cpu_load"] == []
        assert facts["save_from_device_identical"] is True


def test_the_kept_fp8_model_matches_the_decoded_one_and_saves_back_identical(results):
    fp8 = results["fp8_runtime"]
    assert fp8["load_ok"] and fp8["within_bound"] and fp8["save_from_device_identical"] is True
    assert fp8["logits_rel_l2"] == 0.0  # on the CPU the kept weights decode: the same product
    assert fp8["kernels"] == {"PackedLinear on cpu: decode + F.linear": 14}  # 7 projections x 2 layers


def test_fused_and_unfused_forwards_are_timed(results):
    assert set(results["fusions"]) == {
        "decoder layer decode 1x1 eager",
        "decoder layer prefill 1x512 eager",
        "patch embedding eager",
    }
    for row in results["fusions"].values():
        assert row["unfused_s"] > 0 and row["fused_s"] > 0
    assert all(row["kernel"] is False for row in results["fp8_matmul"].values())  # no block scaling on CPU
