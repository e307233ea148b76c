"""Models built without their weights, loaded, and run: nothing is left on ``meta`` unnoticed."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch
from torch import nn

import surgery

if TYPE_CHECKING:
    from conftest import FreshPython


class Rotary(nn.Module):
    """A layer with a non-persistent buffer computed in ``__init__`` (like rotary ``inv_freq``)."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)
        self.register_buffer(
            "inv_freq", 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8)), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(x) * self.inv_freq.repeat(2)


def checkpoint(path: Path) -> Rotary:
    torch.manual_seed(0)
    ref = Rotary()
    surgery.save_checkpoint(ref, path)
    return ref


def test_init_empty_puts_parameters_on_meta_and_keeps_buffers() -> None:
    with surgery.init_empty():
        model = Rotary()
    assert model.proj.weight.device.type == "meta" and isinstance(model.proj.weight, nn.Parameter)
    assert model.proj.weight.requires_grad
    assert model.inv_freq.device.type == "cpu" and torch.equal(model.inv_freq, Rotary().inv_freq)
    assert nn.Linear(2, 2).weight.device.type == "cpu"  # the patch is gone after the context


def test_init_empty_with_buffers_is_all_meta() -> None:
    with surgery.init_empty(include_buffers=True):
        model = Rotary()
    assert model.inv_freq.device.type == "meta"


def test_a_model_built_with_init_empty_loads_and_runs(tmp_path: Path) -> None:
    ref = checkpoint(tmp_path)
    with surgery.init_empty():
        model = Rotary()
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.ok and report.left_on_meta == []
    x = torch.randn(3, 8)
    assert torch.equal(model(x), ref(x))


def test_a_buffer_left_on_meta_makes_the_report_not_ok_and_says_how_to_fix_it(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    with torch.device("meta"):
        model = Rotary()
    report = surgery.load_checkpoint(model, tmp_path)
    assert report.missing_keys == []  # nothing the checkpoint could have had ...
    assert report.left_on_meta == ["inv_freq"]  # ... yet the model cannot run
    assert not report.ok
    assert "left on meta" in str(report) and "init_empty" in str(report)


def test_a_strict_load_refuses_before_reading_when_a_tensor_would_stay_on_meta(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    with torch.device("meta"):
        model = Rotary()
    with pytest.raises(surgery.LoadError, match="inv_freq"):
        surgery.load_checkpoint(model, tmp_path, strict=True)
    assert model.proj.weight.device.type == "meta"  # nothing was read


@pytest.mark.parametrize(
    "quantizer", ["None", "FP8BlockQuantizer(block_size=(8, 8))", "Int8WeightOnlyQuantizer()"]
)
def test_planning_a_load_does_not_import_torch_dynamo(quantizer: str, fresh_python: FreshPython) -> None:
    """Meta shape inference is arithmetic or CPU work: torch's Python meta refs import dynamo (~1 s)."""
    code = (
        "import sys, tempfile, surgery\n"
        "from surgery.checkpoint import write_checkpoint\n"
        "from surgery.examples.moe import build_moe_model, original_state_dict\n"
        "from surgery.quantization import FP8BlockQuantizer, Int8WeightOnlyQuantizer, blockwise_quantize\n"
        "state = original_state_dict(build_moe_model())\n"
        f"quantizer = {quantizer}\n"
        "if isinstance(quantizer, FP8BlockQuantizer):  # store the experts as block-wise FP8\n"
        "    for k in [k for k in state if '.experts.' in k]:\n"
        "        state[k], state[k + '_scale_inv'] = blockwise_quantize(state[k], (8, 8))\n"
        "d = tempfile.mkdtemp(); write_checkpoint(state, d)\n"
        "m = build_moe_model(device='meta')\n"
        "assert surgery.load_checkpoint(m, d, quantizer=quantizer).ok\n"
        "print('torch._dynamo' in sys.modules)\n"
    )
    assert fresh_python(code) == "False"
