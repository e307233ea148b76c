"""Block-wise FP8 checkpoints: decoded per source on read, re-encoded with the recorded scales on save.

The checkpoints are quantized by ``tests/fp8_reference.py`` (written for the tests, independently
of the library), and every loaded weight is compared with that reference's dequantization, bit
for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_reference import dequantize, dequantize_state, quantize, quantize_state
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.examples import moe
from surgery.parallel.regions import Region
from surgery.quantization import FP8BlockQuantizer, blockwise_dequantize, blockwise_quantize

B128 = (128, 128)


def linear_checkpoint(path: Path, n: int, k: int, *, seed: int = 0, **kwargs) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    q, scale = quantize(torch.randn(n, k) * 0.05, B128, **kwargs)
    sd = {"weight": q, "weight_scale_inv": scale, "bias": torch.randn(n).to(torch.bfloat16)}
    write_checkpoint(sd, path)
    return sd


def linear(n: int, k: int, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> nn.Linear:
    with torch.device(device):
        return nn.Linear(k, n, dtype=dtype)


def file_bytes(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.suffix in (".safetensors", ".json")}


# --------------------------------------------------------------------------- without a quantizer


def test_without_a_quantizer_a_float8_weight_with_scales_is_an_error_naming_both_keys(tmp_path: Path) -> None:
    linear_checkpoint(tmp_path, 130, 256)
    model = linear(130, 256)
    before = model.weight.detach().clone()
    report = surgery.load_checkpoint(model, tmp_path)
    assert not report.ok
    (failure,) = report.conversion_errors
    assert failure.source_keys == ("weight",) and failure.target_keys == ("weight",)
    assert "'weight_scale_inv'" in failure.message and "FP8BlockQuantizer" in failure.message
    assert torch.equal(model.weight, before)  # not overwritten with cast garbage


def test_without_a_quantizer_a_strict_load_raises_before_reading(tmp_path: Path) -> None:
    linear_checkpoint(tmp_path, 130, 256)
    with pytest.raises(surgery.LoadError, match="weight_scale_inv"):
        surgery.load_checkpoint(linear(130, 256), tmp_path, strict=True)


def test_a_float8_weight_without_scales_is_cast_and_reported(tmp_path: Path) -> None:
    w = torch.randn(4, 8).to(torch.float8_e4m3fn)
    write_checkpoint({"weight": w, "bias": torch.zeros(4)}, tmp_path)
    model = nn.Linear(8, 4)
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.conversion_errors == []
    assert [(m.key, m.kind) for m in report.mismatched] == [("weight", "dtype")]
    assert torch.equal(model.weight, w.float())


# --------------------------------------------------------------------------- loading


@pytest.mark.parametrize("shape", [(300, 130), (4000, 4100), (128, 256), (256, 384)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_weight_loads_as_the_reference_dequantization_edge_blocks_included(tmp_path, shape, dtype) -> None:
    sd = linear_checkpoint(tmp_path, *shape)
    model = linear(*shape, dtype=dtype, device="meta")
    report = surgery.load_checkpoint(model, tmp_path, quantizer=FP8BlockQuantizer())
    assert report.ok, report
    assert "weight" not in [m.key for m in report.mismatched]  # decoding is not an unrequested cast
    assert torch.equal(model.weight, dequantize(sd["weight"], sd["weight_scale_inv"], B128).to(dtype))
    assert model.weight.dtype == dtype


def test_the_plan_reads_the_scales_with_their_weight_and_reports_nothing_unexpected(tmp_path: Path) -> None:
    linear_checkpoint(tmp_path, 300, 130)
    plan = surgery.plan_load(linear(300, 130, device="meta"), tmp_path, quantizer=FP8BlockQuantizer())
    (entry,) = [e for e in plan.entries if e.target_keys == ("weight",)]
    assert entry.companions == ("weight_scale_inv",)
    assert (entry.mode, entry.status) == ("convert", "ok")
    assert entry.nbytes == 300 * 130 + 3 * 2 * 4  # the FP8 values and the float32 scales
    assert plan.unexpected_keys == [] and plan.missing_keys == []
    assert "+dequantize" in plan.render()
    again = surgery.LoadPlan.from_json(plan.to_json())
    assert again.entries == plan.entries


def test_power_of_two_scales_stored_as_e8m0_load_exactly_and_save_back_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(1)
    q, scale = quantize(torch.randn(200, 300), B128, power_of_two=True)
    write_checkpoint({"weight": q, "weight_scale_inv": scale.to(torch.float8_e8m0fnu)}, tmp_path / "in")
    model = nn.Linear(300, 200, bias=False, dtype=torch.bfloat16)
    assert surgery.load_checkpoint(model, tmp_path / "in", quantizer=FP8BlockQuantizer()).ok
    assert torch.equal(model.weight, dequantize(q, scale, B128).to(torch.bfloat16))
    surgery.save_checkpoint(model, tmp_path / "out")
    assert file_bytes(tmp_path / "out") == file_bytes(tmp_path / "in")


# --------------------------------------------------------------------------- saving


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_saving_as_loaded_reproduces_the_fp8_files_bit_for_bit(tmp_path: Path, dtype) -> None:
    linear_checkpoint(tmp_path / "in", 300, 130)
    model = linear(300, 130, dtype=dtype)
    surgery.load_checkpoint(model, tmp_path / "in", quantizer=FP8BlockQuantizer())
    surgery.save_checkpoint(model, tmp_path / "out")  # quantization="as_loaded" is the default
    assert file_bytes(tmp_path / "out") == file_bytes(tmp_path / "in")


def test_recomputing_the_scales_would_not_reproduce_them(tmp_path: Path) -> None:
    """Why the load keeps the scales: fresh ones from the bf16 weights differ from the stored ones."""
    sd = linear_checkpoint(tmp_path, 300, 130)
    model = linear(300, 130)
    surgery.load_checkpoint(model, tmp_path, quantizer=FP8BlockQuantizer())
    _, fresh = quantize(model.weight.detach().float(), B128)
    assert not torch.equal(fresh, sd["weight_scale_inv"])


def test_saving_dequantized_writes_the_float_layout(tmp_path: Path) -> None:
    sd = linear_checkpoint(tmp_path / "in", 300, 130)
    model = linear(300, 130)
    surgery.load_checkpoint(model, tmp_path / "in", quantizer=FP8BlockQuantizer())
    surgery.save_checkpoint(model, tmp_path / "out", quantization="dequantized")
    with surgery.open_checkpoint(tmp_path / "out") as reader:
        assert sorted(reader.keys()) == ["bias", "weight"]
        weight = reader.get_tensor("weight")
    assert weight.dtype == torch.bfloat16
    assert torch.equal(weight, dequantize(sd["weight"], sd["weight_scale_inv"], B128).to(torch.bfloat16))


def test_a_runtime_layout_save_writes_the_decoded_floats(tmp_path: Path) -> None:
    sd = linear_checkpoint(tmp_path / "in", 300, 130)
    model = linear(300, 130)
    surgery.load_checkpoint(model, tmp_path / "in", quantizer=FP8BlockQuantizer())
    surgery.save_checkpoint(model, tmp_path / "out", original_format=False)
    with surgery.open_checkpoint(tmp_path / "out") as reader:
        assert sorted(reader.keys()) == ["bias", "weight"]
        assert torch.equal(
            reader.get_tensor("weight"), dequantize(sd["weight"], sd["weight_scale_inv"], B128).bfloat16()
        )


def test_an_unknown_quantization_mode_is_an_error_naming_the_choices(tmp_path: Path) -> None:
    with pytest.raises(surgery.ConfigurationError, match="as_loaded, dequantized"):
        surgery.save_checkpoint(nn.Linear(2, 2), tmp_path, quantization="fp8")


def test_a_block_that_outgrew_its_recorded_scale_gets_a_fresh_one_instead_of_saturating(
    tmp_path: Path,
) -> None:
    sd = linear_checkpoint(tmp_path / "in", 300, 130)
    model = linear(300, 130, dtype=torch.float32)
    surgery.load_checkpoint(model, tmp_path / "in", quantizer=FP8BlockQuantizer())
    with torch.no_grad():
        model.weight[:128, :128] *= 4  # "training" pushed block (0, 0) past its scale
    files = surgery.save_checkpoint(model, tmp_path / "out")
    assert files.requantized == ("weight",)  # never a silent lossy write
    with surgery.open_checkpoint(tmp_path / "out") as reader:
        q, scale = reader.get_tensor("weight"), reader.get_tensor("weight_scale_inv")
    recorded = sd["weight_scale_inv"]
    assert scale[0, 0] > recorded[0, 0] * 3.9  # fresh: amax / 448 of the new values
    assert torch.equal(scale.flatten()[1:], recorded.flatten()[1:])  # the other blocks keep theirs
    back = dequantize(q, scale, B128)
    big = model.weight.detach()[:128, :128]
    assert float(back[:128, :128].abs().max()) == pytest.approx(float(big.abs().max()), rel=0.07)


# --------------------------------------------------------------------------- experts


def moe_fp8_checkpoint(path: Path, block: tuple[int, int]) -> dict[str, torch.Tensor]:
    cfg = moe.ExampleMoEConfig()
    sd = quantize_state(moe.original_state_dict(moe.build_moe_model(cfg, seed=0)), block)
    write_checkpoint(sd, path)
    return sd


def test_per_expert_scales_are_applied_before_the_expert_merge(tmp_path: Path) -> None:
    block = (12, 10)  # 32x16 and 16x32 expert weights: edge blocks in both dims
    sd = moe_fp8_checkpoint(tmp_path, block)
    model = moe.build_moe_model(moe.ExampleMoEConfig(), seed=None, device="meta")
    report = surgery.load_checkpoint(model, tmp_path, quantizer=FP8BlockQuantizer(block_size=block))
    assert report.ok, report
    expected = moe.build_moe_model(moe.ExampleMoEConfig(), seed=None, device="meta")
    write_checkpoint(dequantize_state(sd, block), tmp_path / "float")
    assert surgery.load_checkpoint(expected, tmp_path / "float").ok
    state, want = model.state_dict(), expected.state_dict()
    assert sorted(state) == sorted(want)
    for key in want:
        assert torch.equal(state[key], want[key]), key
    fused = next(e for e in report.plan.entries if e.target_keys[0].endswith("experts.gate_up_proj"))
    assert len(fused.companions) == len(fused.source_keys)  # one scale tensor per expert weight


def test_a_merged_expert_model_saves_its_fp8_files_back_bit_for_bit(tmp_path: Path) -> None:
    block = (12, 10)
    moe_fp8_checkpoint(tmp_path / "in", block)
    model = moe.build_moe_model(moe.ExampleMoEConfig(), seed=None, device="meta")
    surgery.load_checkpoint(model, tmp_path / "in", quantizer=FP8BlockQuantizer(block_size=block))
    surgery.save_checkpoint(model, tmp_path / "out")
    assert file_bytes(tmp_path / "out") == file_bytes(tmp_path / "in")


# --------------------------------------------------------------------------- bad input


def test_a_missing_scale_tensor_is_an_error_naming_it(tmp_path: Path) -> None:
    write_checkpoint({"weight": torch.randn(8, 8).to(torch.float8_e4m3fn)}, tmp_path)
    report = surgery.load_checkpoint(nn.Linear(8, 8, bias=False), tmp_path, quantizer=FP8BlockQuantizer())
    (failure,) = report.conversion_errors
    assert "'weight_scale_inv'" in failure.message and "lacks" in failure.message
    assert report.missing_keys == []  # reported as a failure, not as missing


def test_a_scale_of_the_wrong_shape_is_an_error_before_reading(tmp_path: Path) -> None:
    q, _ = quantize(torch.randn(300, 130), B128)
    write_checkpoint({"weight": q, "weight_scale_inv": torch.ones(2, 2)}, tmp_path)
    plan = surgery.plan_load(nn.Linear(130, 300, bias=False), tmp_path, quantizer=FP8BlockQuantizer())
    (entry,) = plan.entries
    assert entry.status == "error"
    assert "(2, 2)" in entry.message and "(3, 2)" in entry.message and "weight_scale_inv" in entry.message


def test_a_weight_dtype_the_quantizer_does_not_decode_is_an_error_naming_the_key(tmp_path: Path) -> None:
    w = torch.randn(8, 8).to(torch.float8_e5m2)
    write_checkpoint({"proj.weight": w, "proj.weight_scale_inv": torch.ones(1, 1)}, tmp_path)
    model = nn.Module()
    model.proj = nn.Linear(8, 8, bias=False)
    report = surgery.load_checkpoint(model, tmp_path, quantizer=FP8BlockQuantizer())
    (failure,) = report.conversion_errors
    assert "'proj.weight'" in failure.message and "float8_e5m2" in failure.message
    ok = surgery.load_checkpoint(model, tmp_path, quantizer=FP8BlockQuantizer(weight_format="e5m2"))
    assert ok.ok and torch.equal(model.proj.weight, w.float())


def test_a_static_activation_scale_is_an_error_naming_the_key(tmp_path: Path) -> None:
    q, scale = quantize(torch.randn(8, 8), B128)
    write_checkpoint({"weight": q, "weight_scale_inv": scale, "activation_scale": torch.ones(())}, tmp_path)
    report = surgery.load_checkpoint(nn.Linear(8, 8, bias=False), tmp_path, quantizer=FP8BlockQuantizer())
    (failure,) = report.conversion_errors
    assert failure.source_keys == ("activation_scale",) and "static activation" in failure.message


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        ({"block_size": (128,)}, "two positive ints"),
        ({"block_size": (0, 128)}, "two positive ints"),
        ({"weight_format": "int8"}, "valid"),
        ({"scale_suffix": ""}, "non-empty"),
    ],
)
def test_bad_options_are_errors_naming_the_fix(kwargs, needle) -> None:
    with pytest.raises(surgery.ConfigurationError, match=needle):
        FP8BlockQuantizer(**kwargs)


# --------------------------------------------------------------------------- config


def test_a_quantizer_is_built_from_a_transformers_config_json(tmp_path: Path) -> None:
    cfg = {
        "model_type": "deepseek_v3",
        "quantization_config": {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "weight_block_size": [64, 32],
            "scale_fmt": "ue8m0",
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    for source in (tmp_path, tmp_path / "config.json", cfg, cfg["quantization_config"]):
        q = FP8BlockQuantizer.from_config(source)
        assert q.block_size == (64, 32) and q.power_of_two is True and q.weight_dtype == torch.float8_e4m3fn


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"quant_method": "awq"}, "'awq'"),
        ({"activation_scheme": "static"}, "static"),
        ({"weight_block_size": None}, "per-tensor"),
    ],
)
def test_a_config_this_quantizer_cannot_read_is_an_error_naming_the_field(edit, needle) -> None:
    cfg = {"quant_method": "fp8", "weight_block_size": [128, 128], **edit}
    with pytest.raises(surgery.ConfigurationError, match=needle):
        FP8BlockQuantizer.from_config(cfg)


# --------------------------------------------------------------------------- properties


@settings(max_examples=40, deadline=None)
@given(
    n=st.integers(1, 70),
    k=st.integers(1, 40),
    b0=st.integers(1, 16),
    b1=st.integers(1, 16),
    cut=st.data(),
)
def test_a_decoded_row_slice_equals_the_slice_of_the_decoded_tensor(n, k, b0, b1, cut) -> None:
    """What a tensor-parallel rank reads: any set of row intervals, aligned to blocks or not."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 100 + k))
    q, scale = blockwise_quantize(w, (b0, b1))
    full = blockwise_dequantize(q, scale, (b0, b1))
    assert torch.equal(full, dequantize(q, scale, (b0, b1)))
    dim = cut.draw(st.sampled_from([0, 1]))
    size = (n, k)[dim]
    a = cut.draw(st.integers(0, size - 1))
    b = cut.draw(st.integers(a + 1, size))
    region = Region.of(dim, [(a, b)])
    part = blockwise_dequantize(region.take(q), scale, (b0, b1), region)
    assert torch.equal(part, region.take(full))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 50), k=st.integers(1, 50), b0=st.integers(1, 20), b1=st.integers(1, 20))
def test_encode_with_the_recorded_scales_inverts_decode_through_bf16(n, k, b0, b1) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * 1000 + k)) * 0.1
    q, scale = quantize(w, (b0, b1))
    quantizer = FP8BlockQuantizer(block_size=(b0, b1))
    decoded = quantizer.decode("w", q, {"w_scale_inv": scale}).to(torch.bfloat16)
    encoded = quantizer.encode("w", decoded, {"w_scale_inv": scale})
    assert torch.equal(encoded["w"].view(torch.uint8), q.view(torch.uint8))
    assert encoded["w_scale_inv"] is scale


@pytest.mark.parametrize("shape", [(6, 20), (2, 12, 10), (7, 20), (6, 21)])
def test_whole_block_and_edge_block_decodes_agree_with_the_reference(shape) -> None:
    """Whole blocks broadcast each scale, edge blocks expand it: the same bits either way."""
    w = torch.randn(*shape, generator=torch.Generator().manual_seed(3))
    q, scale = blockwise_quantize(w, (3, 5))
    got = blockwise_dequantize(q, scale, (3, 5))
    if q.dim() == 2:
        assert torch.equal(got, dequantize(q, scale, (3, 5)))
    else:
        for e in range(shape[0]):
            assert torch.equal(got[e], dequantize(q[e], scale[e], (3, 5)))


def test_encode_works_where_the_weights_live_not_where_the_scales_were_read() -> None:
    """The recorded scales are CPU tensors; a model moved to another device still saves."""
    q, scale = blockwise_quantize(torch.randn(256, 256) * 0.05)
    w = FP8BlockQuantizer().decode("w", q, {"w_scale_inv": scale})
    out = FP8BlockQuantizer().encode("w", w.to("meta"), {"w_scale_inv": scale})
    assert out["w"].device.type == "meta" and out["w"].dtype == torch.float8_e4m3fn


def test_a_fresh_scale_is_rounded_to_its_stored_dtype_before_encoding() -> None:
    """With e8m0 scales and power_of_two=False, the values are encoded with the scale as stored."""
    stored = torch.tensor([[2.0**-10]]).to(torch.float8_e8m0fnu)
    w = torch.full((4, 4), 448 * 1.1 * 2**-10)
    out = FP8BlockQuantizer(block_size=(4, 4), power_of_two=False).encode("w", w, {"w_scale_inv": stored})
    back = dequantize(out["w"], out["w_scale_inv"].float(), (4, 4))
    assert torch.allclose(back, w, rtol=0.07)  # within e4m3 precision, not clipped at the old scale


def test_blockwise_dequantize_leaves_a_float32_input_alone() -> None:
    q = torch.ones(4, 4)
    blockwise_dequantize(q, torch.full((1, 1), 2.0), (4, 4))
    assert torch.equal(q, torch.ones(4, 4))


@pytest.mark.parametrize(
    "kwargs", [{"block_size": None}, {"weight_format": ["e4m3"]}], ids=["block-None", "format-list"]
)
def test_bad_constructor_arguments_are_configuration_errors(kwargs) -> None:
    with pytest.raises(surgery.ConfigurationError):
        FP8BlockQuantizer(**kwargs)


def test_a_scalar_weight_block_size_in_a_config_is_a_configuration_error() -> None:
    with pytest.raises(surgery.ConfigurationError, match="weight_block_size=128"):
        FP8BlockQuantizer.from_config({"quant_method": "fp8", "weight_block_size": 128})


@pytest.mark.parametrize("weight_format", ["e4m3", "e5m2"])
def test_the_quantization_config_a_save_writes_reads_back_to_the_same_quantizer(weight_format: str) -> None:
    q = FP8BlockQuantizer(block_size=(64, 32), weight_format=weight_format)
    again = FP8BlockQuantizer.from_config({"quantization_config": q.quantization_config()})
    assert (again.block_size, again.weight_dtype) == ((64, 32), q.weight_dtype)
    assert q.quantization_config()["quant_method"] == "fp8"
    # transformers' fp8 method decodes e4m3 only: an e5m2 save makes it refuse the checkpoint.
    assert q.loads_in_transformers is (weight_format == "e4m3")


def test_companions_a_rank_did_not_read_come_from_one_pass_over_the_checkpoint(tmp_path):
    """A save asks for the scales a rank read in part or not at all; the first one asked for reads
    every such scale of the load in one opening of the checkpoint, each equal to the stored one."""
    from surgery.load.quantized import CompanionsOnDisk, CompanionsRead

    scales = {f"e{i}.weight_scale_inv": torch.rand(2, 3) + 0.5 for i in range(3)}
    write_checkpoint(scales, tmp_path)
    on_disk = CompanionsOnDisk(str(tmp_path))
    part = torch.ones(2, 3)
    partly = CompanionsRead({"e0.weight_scale_inv": part}, {"e0.weight_scale_inv"}, on_disk)
    unread = [CompanionsRead.unread((f"e{i}.weight_scale_inv",), on_disk) for i in (1, 2)]
    assert on_disk.values == {}
    assert torch.equal(unread[1]["e2.weight_scale_inv"], scales["e2.weight_scale_inv"])
    assert set(on_disk.values) == set(scales)  # all three, in the one pass
    assert torch.equal(partly["e0.weight_scale_inv"], scales["e0.weight_scale_inv"])
    assert list(unread[0]) == ["e1.weight_scale_inv"] and len(unread[0]) == 1
