"""compressed-tensors ``nvfp4-pack-quantized`` and ``mxfp4-pack-quantized`` checkpoints: decoded exactly, saved back byte for byte.

The checkpoints are written by compressed-tensors itself with its ``NVFP4`` and ``MXFP4`` presets
(``tests/ct_fp4_reference.py``), and every decoded weight is compared with the package's own
unpack and ``dequantize`` in float32, bit for bit.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from ct_fp4_reference import SHAPES, reference_weights, write_fp4
from ct_reference import Net
from safetensors.torch import load_file

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.parallel.regions import Region
from surgery.quantization import CompressedFp4Quantizer, quantizer_by_name

PRESETS = list(SHAPES)


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    root = tmp_path_factory.mktemp("ct-fp4")
    return {p: (root / p, write_fp4(root / p, p)) for p in PRESETS}


def _load(path: Path, preset: str, dtype=torch.float32, **kwargs) -> tuple[Net, surgery.LoadReport]:
    model = Net(SHAPES[preset], dtype=dtype)
    return model, surgery.load_checkpoint(model, path, quantizer=quantizer_by_name("auto", path), **kwargs)


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {
        k: (str(v.dtype), tuple(v.shape), v.contiguous().view(torch.uint8).numpy().tobytes())
        for k, v in load_file(str(path / "model.safetensors")).items()
    }


def _qconfig(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("preset", PRESETS)
def test_auto_picks_the_fp4_quantizer_from_the_config_groups_format(written, preset):
    path, _ = written[preset]
    q = quantizer_by_name("auto", path)
    assert isinstance(q, CompressedFp4Quantizer)
    assert q.quantization_config() == _qconfig(path)


@pytest.mark.parametrize("preset", PRESETS)
def test_every_packed_weight_decodes_to_compressed_tensors_own_dequantize_bit_for_bit(written, preset):
    path, state = written[preset]
    model, report = _load(path, preset)
    assert report.ok, report
    assert sorted(report.decoded_keys) == ["a.weight_packed", "b.weight_packed"]
    for key, expected in reference_weights(path, state).items():
        assert torch.equal(model.get_parameter(key).view(torch.int32), expected.view(torch.int32)), key
    assert torch.equal(model.head.weight, state["head.weight"].float())  # ignored: stored in float


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_as_loaded_save_writes_every_tensor_and_the_quantization_config_back_byte_for_byte(
    written, preset, dtype, tmp_path
):
    path, _ = written[preset]
    model, report = _load(path, preset, dtype=dtype)
    assert report.ok, report
    files = surgery.save_checkpoint(model, tmp_path)
    assert _tensors(tmp_path) == _tensors(path)
    assert files.requantized == ()
    assert _qconfig(tmp_path) == _qconfig(path)


def _grow_group(model: Net, preset: str) -> float:
    """NVFP4: row 5's second group of 16 grows to 95% of the tensor's largest value (its global scale still
    holds it); MXFP4: row 5's first group of 32 grows 4x."""
    with torch.no_grad():
        w = model.a.weight
        part = w[5, 16:32] if preset == "NVFP4" else w[5, :32]
        factor = 0.95 * float(w.abs().max()) / float(part.abs().max()) if preset == "NVFP4" else 4.0
        part *= factor
    return factor


def _reencoded_close(tmp_path: Path, preset: str, config: dict, model: Net) -> None:
    reloaded = Net(SHAPES[preset], dtype=torch.float32)
    assert surgery.load_checkpoint(reloaded, tmp_path, quantizer=CompressedFp4Quantizer(config)).ok
    diff = (reloaded.a.weight - model.a.weight).abs().detach()
    # E2M1 keeps each value within a quarter of its group's largest (steps of at most 2 in 6)
    amax = model.a.weight.detach().abs().view(model.a.weight.shape[0], -1, 16).amax(-1, keepdim=True)
    assert bool((diff.view(amax.shape[0], -1, 16) <= amax / 4 + 1e-6).all())


@pytest.mark.parametrize("preset", PRESETS)
def test_weights_changed_after_the_load_get_fresh_scales_only_where_they_outgrew_theirs(
    written, preset, tmp_path
):
    path, state = written[preset]
    model, _ = _load(path, preset)
    assert _grow_group(model, preset) > 1.25
    files = surgery.save_checkpoint(model, tmp_path)
    assert files.requantized == ("a.weight_packed",)
    saved = load_file(str(tmp_path / "model.safetensors"))
    old, new = state["a.weight_scale"].view(torch.uint8), saved["a.weight_scale"].view(torch.uint8)
    group = 1 if preset == "NVFP4" else 0
    assert (old != new).nonzero().tolist() == [[5, group]]
    assert torch.equal(saved["b.weight_packed"], state["b.weight_packed"])
    if preset == "NVFP4":
        assert torch.equal(saved["a.weight_global_scale"], state["a.weight_global_scale"])
    _reencoded_close(tmp_path, preset, _qconfig(path), model)


def test_an_nvfp4_weight_that_outgrew_its_global_scale_gets_a_fresh_global_scale_and_group_scales(
    written, tmp_path
):
    path, state = written["NVFP4"]
    model, _ = _load(path, "NVFP4")
    with torch.no_grad():
        model.a.weight[5, 16:32] *= 16  # past 448 x the global scale's unit: no group scale can hold it
    files = surgery.save_checkpoint(model, tmp_path)
    assert files.requantized == ("a.weight_packed",)
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert float(saved["a.weight_global_scale"]) < float(state["a.weight_global_scale"])
    assert torch.equal(saved["b.weight_global_scale"], state["b.weight_global_scale"])
    _reencoded_close(tmp_path, "NVFP4", _qconfig(path), model)


@pytest.mark.parametrize("preset", PRESETS)
def test_decode_of_a_region_equals_the_slice_of_the_whole_decode_and_reads_only_its_share(written, preset):
    path, state = written[preset]
    q = quantizer_by_name("auto", path)
    q.prepare(Net(SHAPES[preset]))
    comps = {k: v for k, v in state.items() if k.startswith("a.") and k != "a.weight_packed"}
    whole = q.decode("a.weight_packed", state["a.weight_packed"], comps)
    info = surgery.open_checkpoint(path).info("a.weight_packed")
    g = 16 if preset == "NVFP4" else 32
    for region in (Region.of(0, [(16, 32)]), Region.of(1, [(32, 64)]), Region.of(1, [(0, g)])):
        stored = q.stored_region("a.weight_packed", region, info)
        idx = torch.cat([torch.arange(a, b) for a, b in stored.intervals])
        part = state["a.weight_packed"].index_select(stored.dim, idx)
        got = q.decode("a.weight_packed", part, comps, region)
        want = whole.index_select(region.dim, torch.cat([torch.arange(a, b) for a, b in region.intervals]))
        assert torch.equal(got, want), region
        assert part.numel() * 2 == want.numel()


@pytest.mark.parametrize("preset", PRESETS)
def test_a_column_split_inside_a_group_is_a_configuration_error_naming_key_dim_and_group_size(
    written, preset
):
    path, _ = written[preset]
    q = quantizer_by_name("auto", path)
    q.prepare(Net(SHAPES[preset]))
    info = surgery.open_checkpoint(path).info("a.weight_packed")
    g = 16 if preset == "NVFP4" else 32
    with pytest.raises(
        surgery.ConfigurationError, match=rf"a\.weight_packed.*dim 1.*\[0, 8\).*group size {g}"
    ):
        q.stored_region("a.weight_packed", Region.of(1, [(0, 8)]), info)


def _broken(src: Path, dst: Path, change) -> Path:
    state = load_file(str(src / "model.safetensors"))
    change(state)
    write_checkpoint(state, dst)
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


def _nan_byte(s: dict) -> None:
    s["a.weight_scale"][1, 1] = 255


@pytest.mark.parametrize(
    "preset, change, message",
    [
        ("NVFP4", lambda s: s.pop("a.weight_global_scale"), r"a\.weight_packed.*a\.weight_global_scale"),
        ("NVFP4", lambda s: s.__setitem__("a.weight_scale_inv", s.pop("a.weight_scale")), r"a\.weight_scale"),
        (
            "NVFP4",
            lambda s: s.__setitem__("a.weight_scale", s["a.weight_scale"].float()),
            r"a\.weight_scale.*float8",
        ),
        (
            "MXFP4",
            lambda s: s.__setitem__("a.weight_scale", s["a.weight_scale"].float()),
            r"a\.weight_scale.*uint8",
        ),
        ("MXFP4", _nan_byte, r"a\.weight_scale.*\(1, 1\).*byte 255"),
        (
            "MXFP4",
            lambda s: s.__setitem__("a.weight_scale", s["a.weight_scale"][:, :1].clone()),
            r"weight_scale.*shape",
        ),
    ],
    ids=[
        "missing-global",
        "misnamed-scale",
        "nvfp4-float-scale",
        "mxfp4-float-scale",
        "nan-byte",
        "scale-shape",
    ],
)
def test_missing_misnamed_or_wrong_scales_are_an_error_naming_the_key_never_raw_codes(
    written, tmp_path, preset, change, message
):
    src, _ = written[preset]
    path = _broken(src, tmp_path, change)
    model = Net(SHAPES[preset], dtype=torch.float32)
    before = model.a.weight.detach().clone()
    report = surgery.load_checkpoint(model, path, quantizer=quantizer_by_name("auto", path))
    assert not report.ok
    assert re.search(message, str(report), re.S), report
    assert torch.equal(model.a.weight, before)


def test_a_config_group_of_another_scheme_is_refused_naming_the_field(written):
    config = _qconfig(written["NVFP4"][0])
    config["config_groups"]["group_0"]["weights"]["group_size"] = 32
    with pytest.raises(surgery.ConfigurationError, match=r"group_0\.weights\.group_size=32.*16"):
        CompressedFp4Quantizer(config)


@pytest.mark.parametrize("preset", PRESETS)
def test_a_dequantized_save_writes_floats_under_the_weight_names(written, preset, tmp_path):
    path, _ = written[preset]
    model, _ = _load(path, preset)
    surgery.save_checkpoint(model, tmp_path, quantization="dequantized")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert sorted(saved) == ["a.weight", "b.weight", "head.bias", "head.weight"]
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = Net(SHAPES[preset], dtype=torch.float32)
    surgery.load_checkpoint(again, tmp_path)
    assert torch.equal(again.a.weight, model.a.weight) and torch.equal(again.b.weight, model.b.weight)


@pytest.mark.parametrize("preset", PRESETS)
def test_keep_packed_holds_the_fp4_codes_forwards_as_their_decode_and_saves_the_same_bytes(
    written, preset, tmp_path
):
    import torch.nn.functional as F

    from surgery.quantization import KeepPacked, PackedLinear

    path, state = written[preset]
    refs = reference_weights(path, state)
    model = Net(SHAPES[preset])
    quantizer = KeepPacked(quantizer_by_name("auto", path), checkpoint=path)
    report = surgery.load_checkpoint(model, path, quantizer=quantizer)
    assert report.ok, report
    assert isinstance(model.a, PackedLinear) and isinstance(model.b, PackedLinear)
    held = dict(model.a.named_buffers()) | dict(model.a.named_parameters())
    assert held["weight_packed"].dtype == torch.uint8  # codes, not floats: about a quarter of bf16
    x = torch.randn(3, SHAPES[preset]["a"][1], generator=torch.Generator().manual_seed(1))
    assert torch.equal(model.a(x), F.linear(x, refs["a.weight"]))
    surgery.save_checkpoint(model, tmp_path / "out")
    assert _tensors(tmp_path / "out") == _tensors(path)
    assert _qconfig(tmp_path / "out") == _qconfig(path)
