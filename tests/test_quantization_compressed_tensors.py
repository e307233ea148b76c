"""compressed-tensors ``pack-quantized`` and ``float-quantized`` checkpoints: decoded exactly, saved back bit for bit.

The checkpoints are written by compressed-tensors itself (``tests/ct_reference.py``: its preset
schemes, its ``apply_quantization_config``, its compressors and its ``update_config``), and every
decoded weight is compared with the package's own ``decompress`` in float32, bit for bit. The
package no longer writes act-order ``weight_g_idx``; that layout is built here from its
documented rule with an independent decode.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32, unpack_from_int32
from ct_reference import Net, reference_weights, scheme, write_compressed
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.parallel.regions import Region
from surgery.quantization import (
    CompressedTensorsQuantizer,
    FP8BlockQuantizer,
    config_formats,
    quantizer_by_name,
    quantizer_from_config,
    register_format,
    registered_formats,
)
from surgery.quantization.packing import pack_int32, pack_unit, packed_length, unpack_int32

EDGE = {"a": (96, 256), "b": (40, 100), "head": (16, 40)}  # b: 100 columns, a partial int32 word per row
GROUPED = {"a": (96, 256), "b": (40, 384), "head": (16, 40)}  # compressed-tensors needs whole groups

SCHEMES = {
    "W4A16": (scheme("W4A16"), GROUPED),  # int4, groups of 128, symmetric
    "W4A16_ASYM": (scheme("W4A16_ASYM"), GROUPED),  # zero points packed along dim 0
    "W8A16": (scheme("W8A16"), GROUPED),  # int8, four to a word
    "int4-group32": (scheme(num_bits=4, strategy="group", group_size=32), GROUPED),
    "int4-channel": (scheme(num_bits=4, strategy="channel"), EDGE),
    "int4-channel-asym": (scheme(num_bits=4, strategy="channel", symmetric=False), EDGE),
    "int3-channel": (scheme(num_bits=3, strategy="channel"), EDGE),  # values straddle words
    "FP8": (scheme("FP8"), EDGE),  # per-tensor weight scale, static input scale
    "FP8_DYNAMIC": (scheme("FP8_DYNAMIC"), EDGE),  # per-channel weight scale
    "FP8_BLOCK": (scheme("FP8_BLOCK"), EDGE),  # 128x128 blocks, edge blocks in both dims
}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor], dict[str, tuple[int, int]]]]:
    root = tmp_path_factory.mktemp("ct")
    return {
        name: (root / name, write_compressed(root / name, shapes, quant), shapes)
        for name, (quant, shapes) in SCHEMES.items()
    }


def _load(path: Path, shapes, dtype=torch.float32, **kwargs) -> tuple[Net, surgery.LoadReport]:
    model = Net(shapes, dtype=dtype)
    report = surgery.load_checkpoint(model, path, quantizer=quantizer_by_name("auto", path), **kwargs)
    return model, report


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """Every tensor of ``path`` as (dtype, shape, raw bytes)."""
    return {
        k: (str(v.dtype), tuple(v.shape), v.contiguous().view(torch.uint8).numpy().tobytes())
        for k, v in load_file(str(path / "model.safetensors")).items()
    }


def _qconfig(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


# --------------------------------------------------------------------------- decode and save


@pytest.mark.parametrize("name", list(SCHEMES))
def test_every_quantized_weight_decodes_to_compressed_tensors_own_decompression_bit_for_bit(written, name):
    path, state, shapes = written[name]
    model, report = _load(path, shapes, strict=True)
    assert report.ok
    stored = {k.removesuffix("_packed") for k in state if k.endswith("weight_packed")}
    stored |= {k for k, v in state.items() if v.dtype == torch.float8_e4m3fn}
    assert (
        sorted(k.removesuffix("_packed") for k in report.decoded_keys)
        == sorted(stored)
        == ["a.weight", "b.weight"]
    )
    assert "decoded (stored quantized, dequantized on read) (2)" in str(report)
    for key, expected in reference_weights(path, state).items():
        assert torch.equal(model.get_parameter(key), expected.to(torch.float32)), key
    assert torch.equal(model.head.weight, state["head.weight"].float())  # ignored: stored in float


@pytest.mark.parametrize("name", list(SCHEMES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_as_loaded_save_writes_every_tensor_and_the_quantization_config_back_byte_for_byte(
    written, name, dtype, tmp_path
):
    path, _, shapes = written[name]
    model, _ = _load(path, shapes, dtype=dtype, strict=True)
    files = surgery.save_checkpoint(model, tmp_path)
    assert _tensors(tmp_path) == _tensors(path)
    assert files.requantized == ()
    assert _qconfig(tmp_path) == _qconfig(path)


def test_the_load_plan_says_each_packed_weight_is_dequantized_from_its_companions(written):
    path, _, shapes = written["W4A16_ASYM"]
    model = Net(shapes)
    plan = surgery.plan_load(model, path, quantizer=quantizer_by_name("auto", path))
    (entry,) = [e for e in plan.entries if e.target_keys == ("a.weight",)]
    assert entry.source_keys == ("a.weight_packed",)
    assert set(entry.companions) == {"a.weight_scale", "a.weight_shape", "a.weight_zero_point"}
    assert "+dequantize" in str(plan)


def test_weights_changed_after_the_load_are_saved_with_fresh_scales_where_they_outgrew_theirs(
    written, tmp_path
):
    path, state, shapes = written["W4A16"]
    model, _ = _load(path, shapes)
    with torch.no_grad():
        model.a.weight[3] *= 4  # row 3 no longer fits its scales; every other row does
    files = surgery.save_checkpoint(model, tmp_path)
    assert files.requantized == ("a.weight_packed",)  # the report says which; b is written as loaded
    assert "re-quantized 1 tensor(s)" in files.summary()
    saved = load_file(str(tmp_path / "model.safetensors"))
    old, new = state["a.weight_scale"], saved["a.weight_scale"]
    assert torch.equal(torch.cat([old[:3], old[4:]]), torch.cat([new[:3], new[4:]]))
    assert (new[3].float() > old[3].float()).all()
    reloaded, _ = _load(tmp_path, shapes)
    assert torch.allclose(
        reloaded.a.weight, model.a.weight, rtol=0, atol=float(new[3].float().max()) / 2 + 1e-6
    )
    assert torch.equal(saved["b.weight_packed"], state["b.weight_packed"])


def test_a_saved_fp8_weight_that_outgrew_its_per_tensor_scale_gets_a_fresh_one(written, tmp_path):
    path, state, shapes = written["FP8"]
    model, _ = _load(path, shapes)
    with torch.no_grad():
        model.a.weight.mul_(3)
        model.b.weight[0, 0] += 0.01  # fits its scale: same scales, changed codes
    files = surgery.save_checkpoint(model, tmp_path)
    assert files.requantized == ("a.weight", "b.weight")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert saved["a.weight_scale"].float() > state["a.weight_scale"].float()
    assert torch.equal(saved["a.input_scale"], state["a.input_scale"])  # kept as loaded
    reloaded, _ = _load(tmp_path, shapes)
    assert torch.allclose(reloaded.a.weight, model.a.weight, rtol=2**-3, atol=0)


# --------------------------------------------------------------------------- act-order g_idx


def _g_idx_checkpoint(path: Path, n: int = 24, k: int = 64, group: int = 16) -> tuple[dict, torch.Tensor]:
    """An int4 act-order checkpoint built from the documented layout: column c uses the scale of group g_idx[c]."""
    torch.manual_seed(7)
    w = torch.randn(n, k) * 0.05
    g_idx = torch.randperm(k) // group  # each group's columns scattered over the row
    scale = torch.stack([w[:, g_idx == g].abs().amax(dim=1) / 7.5 for g in range(k // group)], dim=1)
    scale = scale.to(torch.bfloat16)
    q = torch.round(w / scale.float()[:, g_idx]).clamp(-8, 7).to(torch.int8)
    state = {
        "a.weight_packed": pack_to_int32(q, 4),
        "a.weight_scale": scale,
        "a.weight_shape": torch.tensor([n, k]),
        "a.weight_g_idx": g_idx.to(torch.int32),
    }
    write_checkpoint(state, path)
    config = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "strategy": "group",
                    "group_size": group,
                    "actorder": "group",
                },
            }
        },
    }
    (path / "config.json").write_text(json.dumps({"quantization_config": config}))
    expected = (
        unpack_from_int32(state["a.weight_packed"], 4, torch.Size([n, k])).float() * scale.float()[:, g_idx]
    )
    return state, expected


def test_an_act_order_checkpoint_decodes_each_column_with_its_g_idx_group_and_saves_back(tmp_path):
    src = tmp_path / "src"
    _, expected = _g_idx_checkpoint(src)
    model, report = _load(src, {"a": (24, 64)}, strict=True)
    assert report.ok
    assert torch.equal(model.a.weight, expected)
    surgery.save_checkpoint(model, tmp_path / "out")
    assert _tensors(tmp_path / "out") == _tensors(src)


def test_decode_of_a_region_equals_the_slice_of_the_whole_decode(written):
    path, state, _ = written["W4A16_ASYM"]
    q = quantizer_by_name("auto", path)
    names = ("a.weight_scale", "a.weight_shape", "a.weight_zero_point")
    comp = {k: state[k] for k in names}
    whole = q.decode("a.weight_packed", state["a.weight_packed"], comp)
    region = Region(1, ((128, 256),))  # the second group of columns: words 16..32
    info = surgery.open_checkpoint(path).info("a.weight_packed")
    stored = q.stored_region("a.weight_packed", region, info)
    assert stored == Region(1, ((16, 32),))
    part = q.decode("a.weight_packed", stored.take(state["a.weight_packed"]), comp, region)
    assert torch.equal(part, whole[:, 128:])
    rows = Region(0, ((8, 40),))
    assert torch.equal(
        q.decode("a.weight_packed", rows.take(state["a.weight_packed"]), comp, rows), whole[8:40]
    )


def test_a_column_split_inside_a_group_is_a_configuration_error_naming_key_dim_and_group_size(written):
    path, _, _ = written["W4A16"]
    q = quantizer_by_name("auto", path)
    info = surgery.open_checkpoint(path).info("a.weight_packed")
    with pytest.raises(surgery.ConfigurationError, match=r"'a\.weight_packed'.*dim 1.*group size 128"):
        q.stored_region("a.weight_packed", Region(1, ((0, 64),)), info)


# --------------------------------------------------------------------------- bad checkpoints


def _broken(src: Path, dst: Path, change) -> Path:
    state = load_file(str(src / "model.safetensors"))
    change(state)
    write_checkpoint(state, dst)
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


@pytest.mark.parametrize(
    ("name", "change", "message"),
    [
        ("W4A16", lambda s: s.pop("a.weight_scale"), r"needs 'a\.weight_scale'"),
        (
            "FP8",
            lambda s: s.update({"a.weight_scale_inv": s.pop("a.weight_scale")}),
            r"needs 'a\.weight_scale'",
        ),
        (
            "W4A16",
            lambda s: s.update({"a.weight_scale": s["a.weight_scale"].to(torch.float8_e4m3fn)}),
            r"'a\.weight_scale' is torch\.float8_e4m3fn",
        ),
        (
            "W4A16",
            lambda s: s.update({"a.weight_scale": -s["a.weight_scale"]}),
            r"'a\.weight_scale': the scale .* finite and positive",
        ),
        ("W4A16_ASYM", lambda s: s.pop("a.weight_zero_point"), r"needs 'a\.weight_zero_point'"),
        (
            "W4A16",
            lambda s: s.update({"a.weight_shape": torch.tensor([96, 300])}),
            r"'a\.weight_packed' has shape \(96, 32\); a \[96, 300\]",
        ),
        (
            "W4A16",
            lambda s: s.update({"a.weight_packed": s["a.weight_packed"].to(torch.int64)}),
            r"'a\.weight_packed' is torch\.int64",
        ),
        (
            "FP8",
            lambda s: s.update({"a.weight_scale": s["a.weight_scale"].float().expand(96, 2).contiguous()}),
            r"a\.weight_scale has shape \(96, 2\)",
        ),
    ],
    ids=[
        "missing-scale",
        "misnamed-scale",
        "fp8-scale",
        "negative-scale",
        "missing-zero-point",
        "wrong-shape",
        "int64-words",
        "scale-shape",
    ],
)
def test_a_checkpoint_with_missing_misnamed_or_wrong_companions_is_an_error_naming_the_key(
    written, tmp_path, name, change, message
):
    src, _, shapes = written[name]
    path = _broken(src, tmp_path, change)
    model = Net(shapes, dtype=torch.float32)
    before = model.a.weight.detach().clone()
    report = surgery.load_checkpoint(model, path, quantizer=quantizer_by_name("auto", path))
    assert not report.ok
    assert any(__import__("re").search(message, f.message) for f in report.conversion_errors), report
    assert torch.equal(model.a.weight, before)  # never loaded as raw codes


def test_a_stray_companion_whose_weight_is_not_quantized_is_an_error_naming_it(written, tmp_path):
    src, _, shapes = written["W4A16"]
    path = _broken(src, tmp_path, lambda s: s.update({"head.weight_scale": torch.ones(16, 1)}))
    report = surgery.load_checkpoint(Net(shapes), path, quantizer=quantizer_by_name("auto", path))
    assert any(
        "'head.weight_scale' belongs with 'head.weight'" in f.message for f in report.conversion_errors
    )


def test_packed_words_of_a_module_the_config_ignores_are_an_error_never_a_cast(written, tmp_path):
    src, _, shapes = written["W4A16"]
    path = _broken(src, tmp_path, lambda s: None)
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"]["ignore"].append("a")
    (path / "config.json").write_text(json.dumps(config))
    model = Net(shapes)
    before = model.a.weight.detach().clone()
    report = surgery.load_checkpoint(model, path, quantizer=quantizer_by_name("auto", path))
    assert any("'a.weight_packed' holds packed values" in f.message for f in report.conversion_errors), report
    assert torch.equal(model.a.weight, before)


def test_a_module_the_model_renames_takes_the_scheme_its_class_targeting_groups_share(written):
    config = _qconfig(written["W4A16"][0])
    q = CompressedTensorsQuantizer.from_config(config)
    q.prepare(Net({"a": (4, 8)}))
    assert q.scheme_of("fused.gate_proj") == q.schemes["group_0"]  # not a module of the model
    assert q.scheme_of("a") == q.schemes["group_0"] and q.scheme_of("head") is None

    class FSDPLinear(torch.nn.Linear):  # fully_shard's class swap keeps Linear among the bases
        pass

    wrapped = Net({"a": (4, 8)})
    wrapped.a.__class__ = FSDPLinear
    q.prepare(wrapped)
    assert q.scheme_of("a") == q.schemes["group_0"]
    other = {**config["config_groups"]["group_0"], "targets": ["Embedding"]}
    other["weights"] = {**other["weights"], "num_bits": 8}
    q2 = CompressedTensorsQuantizer.from_config(
        {**config, "config_groups": {**config["config_groups"], "g1": other}}
    )
    q2.prepare(Net({"a": (4, 8)}))
    with pytest.raises(surgery.ConversionError, match=r"'fused\.gate_proj' is not a module of the model"):
        q2.scheme_of("fused.gate_proj")


# --------------------------------------------------------------------------- choosing the quantizer


def test_auto_chooses_from_quant_method_and_the_formats_of_the_config_groups(written):
    assert isinstance(quantizer_by_name("auto", written["W4A16"][0]), CompressedTensorsQuantizer)
    assert isinstance(
        quantizer_from_config({"quant_method": "fp8", "weight_block_size": [64, 64]}), FP8BlockQuantizer
    )
    config = _qconfig(written["FP8"][0])
    assert config_formats(config) == ("float-quantized",)
    assert quantizer_from_config({"quantization_config": config}).quantization_config() == config
    assert registered_formats()["compressed-tensors"] == (
        "pack-quantized",
        "float-quantized",
        "nvfp4-pack-quantized",  # CompressedFp4Quantizer
        "mxfp4-pack-quantized",
    )


def test_a_format_no_registered_quantizer_reads_is_an_error_listing_those_that_are(written):
    config = {**_qconfig(written["W4A16"][0]), "format": "marlin-24"}
    config["config_groups"] = {"g": {**config["config_groups"]["group_0"], "format": "marlin-24"}}
    with pytest.raises(
        surgery.ConfigurationError,
        match=r"\['marlin-24'\].*'float-quantized', 'mxfp4-pack-quantized', 'nvfp4-pack-quantized', 'pack-quantized'",
    ):
        quantizer_from_config(config)
    with pytest.raises(
        surgery.ConfigurationError, match="quant_method='gguf', which no registered quantizer"
    ):
        quantizer_from_config({"quant_method": "gguf"})


def test_registering_a_format_twice_fails_loudly():
    with pytest.raises(surgery.RegistryError, match="pack-quantized"):
        register_format(
            "compressed-tensors", CompressedTensorsQuantizer.from_config, formats=("pack-quantized",)
        )
    with pytest.raises(surgery.RegistryError, match="every format"):
        register_format("fp8", FP8BlockQuantizer.from_config)


def test_a_config_that_is_not_stored_compressed_is_refused_naming_the_field(written):
    config = {**_qconfig(written["W4A16"][0]), "quantization_status": "frozen"}
    with pytest.raises(surgery.ConfigurationError, match="quantization_status='frozen'"):
        CompressedTensorsQuantizer.from_config(config)


# --------------------------------------------------------------------------- packing


@settings(max_examples=60, deadline=None)
@given(
    bits=st.integers(1, 8),
    rows=st.integers(1, 4),
    n=st.integers(1, 70),
    seed=st.integers(0, 2**16),
    dim=st.sampled_from([0, 1]),
)
def test_packing_round_trips_and_matches_compressed_tensors_words(bits, rows, n, seed, dim):
    g = torch.Generator().manual_seed(seed)
    lo = -(1 << (bits - 1))
    q = torch.randint(lo, -lo, (rows, n) if dim == 1 else (n, rows), generator=g, dtype=torch.int8)
    packed = pack_int32(q, bits, dim=dim)
    assert packed.shape[dim] == packed_length(n, bits)
    assert torch.equal(unpack_int32(packed, bits, n, dim=dim), q)
    assert torch.equal(packed, pack_to_int32(q, bits, packed_dim=dim))


@settings(max_examples=30, deadline=None)
@given(bits=st.integers(1, 8), units=st.integers(0, 3), extra=st.integers(1, 40), seed=st.integers(0, 2**16))
def test_a_run_of_whole_pack_units_is_a_run_of_whole_words(bits, units, extra, seed):
    g = torch.Generator().manual_seed(seed)
    start = units * pack_unit(bits)
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (2, start + extra), generator=g, dtype=torch.int8)
    packed = pack_int32(q, bits)
    first = start * bits // 32
    assert torch.equal(unpack_int32(packed[:, first:], bits, extra), q[:, start:])


def test_packing_refuses_values_outside_the_signed_range():
    with pytest.raises(surgery.ConversionError, match=r"signed 4-bit range \[-8, 7\]"):
        pack_int32(torch.tensor([[8]], dtype=torch.int8), 4)


def test_a_dequantized_save_writes_packed_weights_as_floats_under_their_weight_names(written, tmp_path):
    path, _, shapes = written["W4A16_ASYM"]
    model, _ = _load(path, shapes)
    surgery.save_checkpoint(model, tmp_path, quantization="dequantized")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == ["a.weight", "b.weight", "head.bias", "head.weight"]
    assert saved["a.weight"].dtype == torch.float32
    again = Net(shapes, dtype=torch.float32)
    surgery.load_checkpoint(again, tmp_path)
    assert torch.equal(again.a.weight, model.a.weight)
