"""Saving in another dtype: ``save_checkpoint(dtype=...)``, what is cast, what is not, and what it says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fp8_reference import quantize_state
from torch import nn

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.errors import ConfigurationError
from surgery.examples.decoder import build_decoder_model
from surgery.quantization import FP8BlockQuantizer, Int8WeightOnlyQuantizer

CONFIG = {"model_type": "example_decoder", "dtype": "float32", "tie_word_embeddings": False}
FP8_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 16]}


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as reader:
        return {k: reader.get_tensor(k) for k in reader}


def config_json(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def source(tmp_path: Path, *, fp8: bool = False) -> Path:
    """The example decoder's float32 checkpoint with a config.json (``fp8``: weights stored FP8)."""
    src = tmp_path / "src"
    state = build_decoder_model(seed=0).state_dict()
    write_checkpoint(quantize_state(state, (16, 16)) if fp8 else state, src)
    (src / "config.json").write_text(
        json.dumps({**CONFIG, **({"quantization_config": FP8_CONFIG} if fp8 else {})})
    )
    return src


def loaded(src: Path, **kwargs) -> nn.Module:
    model = build_decoder_model(seed=1)
    assert surgery.load_checkpoint(model, src, **kwargs).ok
    return model


def test_without_dtype_a_model_cast_after_loading_is_written_in_the_checkpoints_dtype(tmp_path: Path) -> None:
    src = source(tmp_path)
    model = loaded(src).to(torch.bfloat16)
    files = surgery.save_checkpoint(model, tmp_path / "out")
    assert {t.dtype for t in tensors(tmp_path / "out").values()} == {torch.float32}
    assert files.casts and not files.lossy_keys  # bfloat16 → float32 changes no value
    assert config_json(tmp_path / "out")["dtype"] == "float32"


def test_dtype_writes_every_float_in_that_dtype_and_names_the_lossy_cast(tmp_path: Path) -> None:
    src = source(tmp_path)
    model = loaded(src)
    files = surgery.save_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16)

    written = tensors(tmp_path / "out")
    state = model.state_dict()
    assert sorted(written) == sorted(state)
    for k, t in written.items():
        assert t.dtype == torch.bfloat16, k
        assert torch.equal(t, state[k].to(torch.bfloat16)), k
    assert {c.key for c in files.casts} == set(written)
    assert "model.layers.0.mlp.up_proj.weight" in files.lossy_keys  # random float32 values round
    assert "model.norm.weight" not in files.lossy_keys  # ones: exact in bfloat16
    assert "float32 → bfloat16 (lossy:" in files.summary()
    assert config_json(tmp_path / "out")["dtype"] == "bfloat16"


def test_a_cast_that_changes_no_value_is_reported_exact(tmp_path: Path) -> None:
    model = build_decoder_model(seed=1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16))  # float32 holding values bfloat16 represents
    files = surgery.save_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16)
    assert files.casts and not files.lossy_keys
    assert "(exact: no value changed)" in files.summary()


def test_integer_and_bool_tensors_are_never_cast(tmp_path: Path) -> None:
    model = nn.Linear(4, 4)
    model.register_buffer("positions", torch.arange(4))
    model.register_buffer("mask", torch.tensor([True, False]))
    surgery.save_checkpoint(model, tmp_path / "out", dtype=torch.float16)
    written = tensors(tmp_path / "out")
    assert written["weight"].dtype == torch.float16
    assert (written["positions"].dtype, written["mask"].dtype) == (torch.int64, torch.bool)


def test_fp8_codes_and_their_scales_keep_their_stored_dtypes(tmp_path: Path) -> None:
    src = source(tmp_path, fp8=True)
    stored = tensors(src)
    model = loaded(src, quantizer=FP8BlockQuantizer.from_config(src), strict=True)
    surgery.save_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16)

    written = tensors(tmp_path / "out")
    for k, t in stored.items():
        want = t.dtype if t.dtype == torch.float8_e4m3fn or k.endswith("_scale_inv") else torch.bfloat16
        assert written[k].dtype == want, k
        if want != torch.bfloat16:  # codes and scales come back bit for bit
            assert torch.equal(written[k].view(torch.uint8), t.view(torch.uint8)), k
    assert config_json(tmp_path / "out")["quantization_config"] == FP8_CONFIG


def test_fp8_weights_written_dequantized_are_floats_in_that_dtype(tmp_path: Path) -> None:
    src = source(tmp_path, fp8=True)
    model = loaded(src, quantizer=FP8BlockQuantizer.from_config(src), strict=True)
    surgery.save_checkpoint(model, tmp_path / "out", dtype=torch.bfloat16, quantization="dequantized")
    assert {t.dtype for t in tensors(tmp_path / "out").values()} == {torch.bfloat16}
    assert "quantization_config" not in config_json(tmp_path / "out")


def test_int8_codes_and_scales_of_a_runtime_layout_are_not_cast(tmp_path: Path) -> None:
    src = source(tmp_path)
    model = loaded(src, quantizer=Int8WeightOnlyQuantizer(exclude=["lm_head"]))
    runtime = {k: t.dtype for k, t in model.state_dict().items()}
    surgery.save_checkpoint(model, tmp_path / "out", original_format=False, dtype=torch.bfloat16)
    written = tensors(tmp_path / "out")
    up = "model.layers.0.mlp.up_proj."
    quantized = {k for k in written if k.startswith(up)}
    assert quantized and all(written[k].dtype == runtime[k] for k in quantized)
    assert written[up + "weight"].dtype == torch.int8
    assert written["lm_head.weight"].dtype == torch.bfloat16  # excluded: a plain float


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn, "half"], ids=str)
def test_a_dtype_that_is_not_a_float_to_cast_to_is_refused_before_writing(tmp_path: Path, dtype) -> None:
    with pytest.raises(ConfigurationError, match=r"bfloat16.*docs/quantization\.md"):
        surgery.save_checkpoint(nn.Linear(2, 2), tmp_path / "out", dtype=dtype)
    assert not (tmp_path / "out").exists()


def test_a_change_anywhere_is_found_and_a_nan_kept_is_no_change() -> None:
    from surgery.casting import cast_checked

    exact = torch.zeros(3_000_000)
    exact[-1] = float("nan")  # past the first chunks of the comparison
    assert cast_checked("a", exact, torch.bfloat16)[1].lossy is False
    changed = exact.clone()
    changed[-2] = 1.0001
    assert cast_checked("b", changed, torch.bfloat16)[1].lossy is True
    assert cast_checked("c", torch.arange(5), torch.float16)[1].lossy is False  # ints below 2048: exact


def test_config_dtype_fields_name_the_dtype_written_at_the_top_and_in_sub_configs() -> None:
    from surgery.saved_config import SavedConfig, rewrite_config

    source = {"torch_dtype": "float32", "text_config": {"dtype": "float32", "hidden_size": 8}}
    written = rewrite_config(source, SavedConfig(dtype="bfloat16"))
    assert written == {"torch_dtype": "bfloat16", "text_config": {"dtype": "bfloat16", "hidden_size": 8}}
    assert rewrite_config({}, SavedConfig(dtype="bfloat16")) == {}  # not asked for: nothing added
    assert rewrite_config({}, SavedConfig(dtype="bfloat16", dtype_requested=True)) == {"dtype": "bfloat16"}
