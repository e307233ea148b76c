"""A pre-quantized FP8 checkpoint is never cast silently (there is no FP8 quantizer yet).

A float8 weight stored with its ``<key>_scale_inv`` block scales holds quantized values; a
plain cast to the parameter's dtype ignores the scales and loads wrong weights. Until a
quantizer decodes the layout, such a weight is a conversion error naming both keys, and the
parameter keeps its value.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint


def fp8_checkpoint(path: Path, *, with_scales: bool = True) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    weight = torch.randn(130, 256)
    sd = {"weight": weight.to(torch.float8_e4m3fn), "bias": torch.randn(130).to(torch.bfloat16)}
    if with_scales:
        sd["weight_scale_inv"] = torch.rand(2, 2) + 0.5  # one scale per 128x128 block, edges included
    write_checkpoint(sd, path)
    return sd


def bf16_linear(device: str = "cpu") -> nn.Linear:
    with torch.device(device):
        return nn.Linear(256, 130, dtype=torch.bfloat16)


def test_a_float8_weight_with_block_scales_is_a_conversion_error_naming_both_keys(tmp_path: Path) -> None:
    fp8_checkpoint(tmp_path)
    model = bf16_linear()
    before = model.weight.detach().clone()
    report = surgery.load_checkpoint(model, tmp_path)
    assert not report.ok
    (failure,) = report.conversion_errors
    assert failure.source_keys == ("weight",) and failure.target_keys == ("weight",)
    assert "'weight'" in failure.message and "'weight_scale_inv'" in failure.message
    assert torch.equal(model.weight, before)  # not overwritten with cast garbage


def test_the_plan_marks_the_float8_weight_as_an_error_before_reading(tmp_path: Path) -> None:
    sd = fp8_checkpoint(tmp_path)
    plan = surgery.plan_load(bf16_linear("meta"), tmp_path)
    (entry,) = [e for e in plan.entries if e.source_keys == ("weight",)]
    assert (entry.status, entry.mode) == ("error", "skip")
    assert "pre-quantized" in entry.message
    bias = next(e for e in plan.entries if e.source_keys == ("bias",))
    assert bias.status == "ok" and sd["bias"].dtype == torch.bfloat16


def test_the_other_tensors_still_load(tmp_path: Path) -> None:
    sd = fp8_checkpoint(tmp_path)
    model = bf16_linear()
    surgery.load_checkpoint(model, tmp_path)
    assert torch.equal(model.bias, sd["bias"])


def test_a_strict_load_of_a_float8_checkpoint_raises(tmp_path: Path) -> None:
    fp8_checkpoint(tmp_path)
    with pytest.raises(surgery.LoadError, match="weight_scale_inv"):
        surgery.load_checkpoint(bf16_linear(), tmp_path, strict=True)


def test_a_float8_weight_without_scales_is_cast_and_reported(tmp_path: Path) -> None:
    sd = fp8_checkpoint(tmp_path, with_scales=False)
    model = bf16_linear()
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.conversion_errors == []
    assert [(m.key, m.kind) for m in report.mismatched] == [("weight", "dtype")]
    assert torch.equal(model.weight, sd["weight"].to(torch.bfloat16))
