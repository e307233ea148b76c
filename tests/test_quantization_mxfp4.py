"""gpt-oss MXFP4 experts: decoded exactly as transformers decodes them, saved back byte for byte.

The fixture is a tiny transformers ``GptOssForCausalLM`` whose expert weights are written in the
layout gpt-oss ships (``*_blocks`` uint8 ``[E, R, G, 16]``, ``*_scales`` E8M0 ``[E, R, G]``) from
random codes and exponents; the oracle is transformers' own ``integrations/mxfp4.py``
dequantize, run in float32. Expert- and tensor-parallel loads: ``tests/test_quantization_fp4_parallel.py``.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

# the model and the oracle; compressed-tensors, a test dependency, pulls transformers in
pytest.importorskip("transformers")

from fp4_scenarios import QCONFIG, tiny_model, write_mxfp4
from transformers import GptOssForCausalLM
from transformers.integrations.mxfp4 import FP4_VALUES, convert_moe_packed_tensors

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.parallel.regions import Region
from surgery.quantization import Mxfp4Quantizer, mxfp4_dequantize, quantizer_by_name, quantizer_from_config
from surgery.quantization.fp4 import E2M1_VALUES, e2m1_decode, e2m1_encode, pack_nibbles, unpack_nibbles


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    path = tmp_path_factory.mktemp("gptoss-mxfp4")
    return path, write_mxfp4(path)


def _tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {
        k: (str(v.dtype), tuple(v.shape), v.contiguous().view(torch.uint8).numpy().tobytes())
        for k, v in load_file(str(path / "model.safetensors")).items()
    }


def _load(path: Path, dtype: torch.dtype = torch.float32) -> tuple[GptOssForCausalLM, surgery.LoadReport]:
    model = tiny_model(dtype)
    report = surgery.load_checkpoint(model, path, quantizer=quantizer_by_name("auto", path), strict=True)
    return model, report


# --------------------------------------------------------------------------- decode and save


def test_auto_picks_the_mxfp4_quantizer_from_quant_method():
    q = quantizer_from_config(QCONFIG)
    assert isinstance(q, Mxfp4Quantizer)
    assert q.quantization_config() == QCONFIG


def test_every_expert_weight_decodes_to_transformers_own_dequantize_bit_for_bit(written):
    path, state = written
    model, report = _load(path)
    assert report.ok, report
    blocks = sorted(k for k in state if k.endswith("_blocks"))
    assert sorted(report.decoded_keys) == blocks and len(blocks) == 4
    for key in blocks:
        name = key.removesuffix("_blocks")
        expected = convert_moe_packed_tensors(state[key], state[name + "_scales"], dtype=torch.float32)
        got = model.get_parameter(name)
        assert got.shape == expected.shape, name
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), name  # -0.0 included
    bias = "model.layers.0.mlp.experts.gate_up_proj_bias"
    assert torch.equal(model.get_parameter(bias), state[bias].float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_as_loaded_save_writes_every_tensor_and_the_quantization_config_back_byte_for_byte(
    written, dtype, tmp_path
):
    path, _ = written
    model, _ = _load(path, dtype)
    files = surgery.save_checkpoint(model, tmp_path)
    assert _tensors(tmp_path) == _tensors(path)
    assert files.requantized == ()
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] == QCONFIG


def test_the_loaded_model_runs_like_transformers_dequantized_experts(written):
    path, state = written
    model, _ = _load(path)
    reference = tiny_model()
    floats = {
        k.removesuffix("_blocks"): convert_moe_packed_tensors(
            v, state[k.replace("_blocks", "_scales")], dtype=torch.float32
        )
        for k, v in state.items()
        if k.endswith("_blocks")
    }
    floats |= {k: v.float() for k, v in state.items() if not k.endswith(("_blocks", "_scales"))}
    reference.load_state_dict(floats)
    ids = torch.tensor([[1, 5, 9, 2, 33, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, reference(ids).logits)


def test_expert_weights_changed_after_the_load_get_fresh_scales_only_where_they_outgrew_theirs(
    written, tmp_path
):
    path, state = written
    model, _ = _load(path)
    experts = model.model.layers[1].mlp.experts
    with torch.no_grad():
        experts.down_proj[2, :32, 5] *= 64  # one block (expert 2, row 5, block 0) outgrows its scale
    files = surgery.save_checkpoint(model, tmp_path)
    assert files.requantized == ("model.layers.1.mlp.experts.down_proj_blocks",)
    saved = load_file(str(tmp_path / "model.safetensors"))
    old, new = (
        state["model.layers.1.mlp.experts.down_proj_scales"],
        saved["model.layers.1.mlp.experts.down_proj_scales"],
    )
    changed = (old != new).nonzero().tolist()
    assert changed == [[2, 5, 0]] and int(new[2, 5, 0]) == int(old[2, 5, 0]) + 6
    decoded = mxfp4_dequantize(saved["model.layers.1.mlp.experts.down_proj_blocks"], new)
    assert torch.equal(decoded, experts.down_proj.detach())  # x64 of E2M1 values is exact: nothing clipped
    for key in (
        "model.layers.0.mlp.experts.down_proj_blocks",
        "model.layers.1.mlp.experts.gate_up_proj_blocks",
    ):
        assert torch.equal(saved[key], state[key])


def test_decode_of_a_parallel_region_equals_the_slice_of_the_whole_decode(written):
    path, state = written
    q = Mxfp4Quantizer(QCONFIG)
    key = "model.layers.0.mlp.experts.down_proj_blocks"
    blocks, scales = state[key], state[key.replace("_blocks", "_scales")]
    whole = q.decode(key, blocks, {key.replace("_blocks", "_scales"): scales})  # [E, I, H] = [4, 96, 64]
    info = surgery.open_checkpoint(path).info(key)
    for region in (
        Region.of(0, [(2, 4)]),
        Region.of(1, [(32, 96)]),
        Region.of(2, [(16, 48)]),
        Region.of(0, [(0, 1), (3, 4)]),
    ):
        stored = q.stored_region(key, region, info)
        idx = torch.cat([torch.arange(a, b) for a, b in stored.intervals])
        part = blocks.index_select(stored.dim, idx)
        got = q.decode(key, part, {key.replace("_blocks", "_scales"): scales}, region)
        want = whole.index_select(region.dim, torch.cat([torch.arange(a, b) for a, b in region.intervals]))
        assert torch.equal(got, want), region
        assert part.numel() * 2 == want.numel()  # only the packed share is read


def test_a_split_inside_a_32_value_block_is_a_configuration_error_naming_key_dim_and_block_size(written):
    path, _ = written
    key = "model.layers.0.mlp.experts.down_proj_blocks"
    info = surgery.open_checkpoint(path).info(key)
    with pytest.raises(
        surgery.ConfigurationError, match=r"down_proj_blocks.*dim 1.*\[0, 48\).*block size 32"
    ):
        Mxfp4Quantizer().stored_region(key, Region.of(1, [(0, 48)]), info)


def _broken(src: Path, dst: Path, change) -> Path:
    state = load_file(str(src / "model.safetensors"))
    change(state)
    write_checkpoint(state, dst)
    (dst / "config.json").write_text((src / "config.json").read_text())
    return dst


K = "model.layers.0.mlp.experts.gate_up_proj"


def _float_with_stray_scales(s: dict) -> None:
    """The experts stored in float (dequantized), their scales left behind."""
    s[K] = mxfp4_dequantize(s.pop(K + "_blocks"), s[K + "_scales"])


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda s: s.pop(K + "_scales"), rf"{re.escape(K)}_blocks.*needs.*{re.escape(K)}_scales"),
        (lambda s: s.__setitem__(K + "_scale", s.pop(K + "_scales")), rf"{re.escape(K)}_scales"),
        (
            lambda s: s.__setitem__(K + "_scales", s[K + "_scales"].float()),
            r"_scales.*torch.float32.*uint8 E8M0",
        ),
        (lambda s: s[K + "_scales"].__setitem__((1, 3, 0), 255), r"_scales.*\(1, 3, 0\).*byte 255.*NaN"),
        (lambda s: s.__setitem__(K + "_scales", s[K + "_scales"][:, :, :1].clone()), r"_scales.*shape"),
        (
            lambda s: s.__setitem__(K + "_blocks", s[K + "_blocks"].to(torch.int8)),
            r"_blocks.*torch.int8.*uint8",
        ),
    ],
    ids=[
        "missing-scales",
        "misnamed-scales",
        "float-scales",
        "nan-scale",
        "scale-shape",
        "int8-blocks",
    ],
)
def test_missing_misnamed_or_wrong_scales_are_an_error_naming_the_key_never_raw_codes(
    written, tmp_path, change, message
):
    src, _ = written
    path = _broken(src, tmp_path, change)
    model = tiny_model()
    before = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    report = surgery.load_checkpoint(model, path, quantizer=quantizer_by_name("auto", path))
    assert not report.ok
    messages = [f.message for f in report.conversion_errors] + [str(report)]
    assert any(re.search(message, m, re.S) for m in messages), report
    assert torch.equal(model.model.layers[0].mlp.experts.gate_up_proj, before)


def test_scales_whose_blocks_are_stored_in_float_are_an_error_naming_them(written, tmp_path):
    src, _ = written
    path = _broken(src, tmp_path, _float_with_stray_scales)
    report = surgery.load_checkpoint(tiny_model(), path, quantizer=quantizer_by_name("auto", path))
    assert not report.ok
    assert re.search(rf"{re.escape(K)}_scales", str(report)), report


def test_a_config_that_is_not_mxfp4_is_refused_naming_the_field():
    with pytest.raises(surgery.ConfigurationError, match="modules_to_not_convert"):
        Mxfp4Quantizer({"quant_method": "mxfp4", "modules_to_not_convert": "router"})
    with pytest.raises(surgery.ConfigurationError, match="mxfp4"):
        Mxfp4Quantizer({"quant_method": "fp8"})


# --------------------------------------------------------------------------- bit-level properties


def test_the_e2m1_table_is_the_ocp_one_transformers_uses():
    assert list(E2M1_VALUES) == FP4_VALUES
    assert [torch.signbit(torch.tensor(v)).item() for v in E2M1_VALUES] == [c >= 8 for c in range(16)]


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 255), min_size=1, max_size=64), st.integers(1, 3))
def test_unpacking_then_packing_gives_the_bytes_back_and_encoding_decoded_codes_gives_the_codes(raw, rows):
    packed = torch.tensor(raw * rows, dtype=torch.uint8).reshape(rows, -1)
    codes = unpack_nibbles(packed)
    assert torch.equal(codes[..., 0::2], packed & 15) and torch.equal(codes[..., 1::2], packed >> 4)
    assert torch.equal(pack_nibbles(codes), packed)
    assert torch.equal(e2m1_encode(e2m1_decode(codes)), codes)  # -0.0 is code 8 again


@settings(max_examples=40, deadline=None)
@given(st.lists(st.floats(-8, 8, allow_nan=False, width=32), min_size=1, max_size=64))
def test_encoding_rounds_to_the_nearest_e2m1_value_ties_to_even(values):
    x = torch.tensor(values, dtype=torch.float32)
    got = e2m1_decode(e2m1_encode(x))
    grid = torch.tensor(E2M1_VALUES[:8])
    dist = (x.abs().clamp(max=6).unsqueeze(-1) - grid).abs()
    best = dist.min(dim=-1).values
    assert torch.equal((got.abs() - x.abs().clamp(max=6)).abs(), best)  # nearest
    ties = (dist == best.unsqueeze(-1)).sum(-1) > 1
    even = (e2m1_encode(x) & 1) == 0
    assert bool(even[ties].all())  # a value halfway goes to the even mantissa


def test_the_command_line_converts_a_gpt_oss_checkpoint_back_byte_for_byte(written, tmp_path, capsys):
    import filecmp

    from surgery.cli import main

    path, _ = written
    out = tmp_path / "out"
    args = ["convert", str(path), str(out), "--model", "transformers:auto", "--quantization", "auto"]
    assert main(args) == 0, capsys.readouterr()
    assert filecmp.cmp(path / "model.safetensors", out / "model.safetensors", shallow=False)
    assert json.loads((out / "config.json").read_text())["quantization_config"] == QCONFIG


def test_a_dequantized_save_writes_the_experts_as_floats_under_the_models_names(written, tmp_path):
    path, _ = written
    model, _ = _load(path)
    surgery.save_checkpoint(model, tmp_path, quantization="dequantized")
    saved = load_file(str(tmp_path / "model.safetensors"))
    assert not any(k.endswith(("_blocks", "_scales")) for k in saved)
    assert saved[K].dtype == torch.float32 and tuple(saved[K].shape) == (4, 64, 192)
    assert "quantization_config" not in json.loads((tmp_path / "config.json").read_text())
    again = tiny_model()
    assert surgery.load_checkpoint(again, tmp_path, strict=True).ok  # floats: no quantizer
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values()))


# --------------------------------------------------------------------------- kept packed at runtime
def test_experts_kept_packed_run_like_the_decoded_model_and_save_the_same_bytes(written, tmp_path):
    from surgery.quantization import KeepPacked, PackedModule

    path, state = written
    model = tiny_model()
    report = surgery.load_checkpoint(
        model, path, quantizer=KeepPacked(quantizer_by_name("auto", path), checkpoint=path), strict=True
    )
    assert not report.decoded_keys  # nothing decoded: the blocks and scales load as stored
    packed = {p: m for p, m in model.named_modules() if isinstance(m, PackedModule)}
    assert sorted(packed) == [f"model.layers.{i}.mlp.experts" for i in range(2)]
    experts = packed["model.layers.0.mlp.experts"]
    assert experts.num_experts == tiny_model().model.layers[0].mlp.experts.num_experts  # reads through
    assert all(p.is_meta for p in experts._wrapped[0].parameters() if p.dim() == 3)  # no float copies
    blocks = experts.get_buffer("gate_up_proj_blocks")
    assert blocks.dtype == torch.uint8 and torch.equal(
        blocks, state["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    )
    decoded, _ = _load(path)
    ids = torch.tensor([[1, 5, 9, 2, 33, 7]])
    with torch.no_grad():
        assert torch.equal(model(ids).logits, decoded(ids).logits)
    # the experts take the packed size: 4 bits and a scale byte per 32 values, about 1/7 of float32
    packed_bytes = sum(b.nbytes for m in packed.values() for b in m.buffers())
    float_bytes = sum(p.nbytes for m in packed for p in decoded.get_submodule(m).parameters() if p.dim() == 3)
    assert packed_bytes * 7 < float_bytes
    surgery.save_checkpoint(model, tmp_path / "saved")
    assert _tensors(tmp_path / "saved") == _tensors(path)
    config = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert config["quantization_config"] == QCONFIG
    # floats on request: the same file a dequantized save of the decoded model writes
    surgery.save_checkpoint(model, tmp_path / "floats", quantization="dequantized")
    surgery.save_checkpoint(decoded, tmp_path / "floats-decoded", quantization="dequantized")
    assert _tensors(tmp_path / "floats") == _tensors(tmp_path / "floats-decoded")


def test_experts_kept_packed_take_no_parallel_style_yet(written):
    from surgery.parallel import resolve_tp_plan
    from surgery.quantization import KeepPacked

    path, _ = written
    model = tiny_model()
    KeepPacked(quantizer_by_name("auto", path), checkpoint=path).prepare(model)
    with pytest.raises(surgery.ConfigurationError, match=r"mlp\.experts.*keeps its weights packed.*decoded"):
        resolve_tp_plan(model, {"model.layers.*.mlp.experts": "expert_parallel"}, world_size=2)
