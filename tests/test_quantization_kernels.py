"""The FP8 block-scaled matmul (``surgery.quantization.kernels``) and which kernel a load reports.

On the CPU the block-scaled matmul does not exist (torch 2.13 scales tensor- or row-wise only), so
kept FP8 weights decode there; what is checked here is the arithmetic (activation quantization,
the float32 reference the GPU probe compares against), the operand layout torch's own shape and
stride checks accept (on meta tensors), and the choice. The kernel itself runs in
``benchmarks/device.sh`` on an H200, and in the CUDA-only test at the end.
"""

from __future__ import annotations

import json

import fp8_reference
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.quantization import (
    FP8BlockQuantizer,
    Int8WeightOnlyQuantizer,
    KeepPacked,
    blockwise_dequantize,
)
from surgery.quantization.kernels import (
    fp8_block_kernel_usable,
    fp8_block_linear,
    fp8_block_matmul,
    kernel_summary,
    quantize_activations,
    reference_block_matmul,
    weight_scale_operand,
)

K, N = 512, 256


@settings(max_examples=60, deadline=None)
@given(
    rows=st.integers(1, 5),
    groups=st.integers(1, 3),
    seed=st.integers(0, 2**16),
    magnitude=st.sampled_from([1e-6, 1.0, 1e4]),
)
def test_activations_quantize_per_row_and_128_columns_to_e4m3_precision(rows, groups, seed, magnitude):
    x = torch.randn(rows, groups * 128, generator=torch.Generator().manual_seed(seed)) * magnitude
    q, scale = quantize_activations(x)
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (rows, groups) and scale.dtype == torch.float32
    back = q.float() * scale.repeat_interleave(128, 1)
    each = scale.repeat_interleave(128, 1)
    # e4m3: 3 mantissa bits (relative error 2**-4), subnormals below 2**-6 in steps of 2**-9
    assert bool(((back - x).abs() <= x.abs() * 2**-4 + each * 2**-9).all())
    assert float(q.float().abs().max()) == 448.0  # each group's largest value lands on e4m3's max


def _weight(n: int = N, k: int = K) -> tuple[torch.Tensor, torch.Tensor]:
    return fp8_reference.quantize(torch.randn(n, k, generator=torch.Generator().manual_seed(1)), (128, 128))


def test_the_reference_product_is_the_dequantized_operands_multiplied():
    w_q, w_s = _weight()
    x_q, x_s = quantize_activations(torch.randn(6, K, generator=torch.Generator().manual_seed(2)))
    x = x_q.float() * x_s.repeat_interleave(128, 1)
    want = x @ blockwise_dequantize(w_q, w_s, (128, 128)).T
    assert torch.allclose(reference_block_matmul(x_q, x_s, w_q, w_s), want, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("k", [512, 384, 128])  # K / 128 = 4, 3 (scales padded to 4), 1
def test_the_operands_are_laid_out_as_torchs_scaled_mm_checks_them(k):
    """torch's meta function for the block-scaled matmul checks every shape and stride the CUDA
    kernel needs; on meta tensors it runs here, without a GPU."""
    m = 8
    x_q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device="meta")
    x_s = torch.empty(m, k // 128, device="meta")
    w_q = torch.empty(N, k, dtype=torch.float8_e4m3fn, device="meta")
    w_s = torch.empty(N // 128, k // 128, device="meta")
    out = fp8_block_matmul(x_q, x_s, w_q, weight_scale_operand(w_s))
    assert out.shape == (m, N) and out.dtype == torch.bfloat16
    with pytest.raises(RuntimeError, match="stride"):  # the check is real: a row-major x scale fails it
        F.scaled_mm(
            x_q,
            w_q.t(),
            x_s.contiguous(),
            F.ScalingType.BlockWise1x128,
            w_s.t(),
            F.ScalingType.BlockWise128x128,
        )


def test_the_kernel_is_chosen_only_where_it_can_run():
    usable = {"in_features": K, "out_features": N, "block": (128, 128), "dtype": torch.float8_e4m3fn}
    assert not fp8_block_kernel_usable("cpu", **usable)  # no block scaling on the CPU
    assert not fp8_block_kernel_usable("meta", **usable)
    for change in (
        {"block": (64, 64)},
        {"dtype": torch.float8_e5m2},
        {"in_features": 320},
        {"out_features": 200},
    ):
        assert not fp8_block_kernel_usable("cuda", **{**usable, **change}), change


class Pair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(K, N)
        self.down = nn.Linear(N, 96, bias=False)


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("fp8")
    up_q, up_s = _weight()
    down_q, down_s = _weight(96, N)
    stored = {
        "up.weight": up_q,
        "up.weight_scale_inv": up_s,
        "up.bias": torch.randn(N),
        "down.weight": down_q,
        "down.weight_scale_inv": down_s,
    }
    config = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    write_checkpoint(stored, path)
    (path / "config.json").write_text(json.dumps({"quantization_config": config}))
    return path, stored, FP8BlockQuantizer.from_config(config)


def test_kept_fp8_weights_decode_on_the_cpu_and_the_report_says_so(fp8_checkpoint, tmp_path):
    path, stored, quantizer = fp8_checkpoint
    model = Pair()
    report = surgery.load_checkpoint(
        model, path, quantizer=KeepPacked(quantizer, checkpoint=path, kernel=True)
    )
    assert report.kernels == {"PackedLinear on cpu: decode + F.linear": 2}
    assert "quantized forwards: 2 x PackedLinear on cpu: decode + F.linear" in report.notes
    assert model.up.fp8_operands() is None
    x = torch.randn(3, K)
    want = F.linear(
        x,
        blockwise_dequantize(stored["up.weight"], stored["up.weight_scale_inv"], (128, 128)),
        stored["up.bias"],
    )
    assert torch.equal(model.up(x), want)
    surgery.save_checkpoint(model, tmp_path / "out")
    from safetensors.torch import load_file

    back = load_file(tmp_path / "out" / "model.safetensors")
    assert back.keys() == stored.keys()
    for k, t in stored.items():
        assert torch.equal(back[k].view(torch.uint8), t.view(torch.uint8)), k


def test_the_fp8_operands_are_the_stored_weight_and_float32_scales(fp8_checkpoint):
    _, stored, quantizer = fp8_checkpoint
    w, s, block = quantizer.fp8_block_operands(
        "up.weight",
        stored["up.weight"],
        {"up.weight_scale_inv": stored["up.weight_scale_inv"].to(torch.bfloat16)},
    )
    assert w is stored["up.weight"] and block == (128, 128)
    assert s.dtype == torch.float32 and torch.equal(
        s, stored["up.weight_scale_inv"].to(torch.bfloat16).float()
    )
    assert quantizer.fp8_block_operands("e", torch.zeros(2, 3, 4, dtype=torch.float8_e4m3fn), {}) is None


def test_an_int8_load_reports_the_kernel_its_forward_runs(tmp_path):
    torch.manual_seed(0)
    src = Pair()
    write_checkpoint(src.state_dict(), tmp_path)
    model = Pair()
    report = surgery.load_checkpoint(model, tmp_path, quantizer=Int8WeightOnlyQuantizer())
    name = "aten._weight_int8pack_mm" if model.up.uses_kernel else "dequantize + F.linear"
    assert report.kernels == {f"Int8WeightOnlyLinear on cpu: {name}": 2} == kernel_summary(model)


def test_a_load_without_quantized_modules_reports_no_kernels(tmp_path):
    write_checkpoint(Pair().state_dict(), tmp_path)
    assert surgery.load_checkpoint(Pair(), tmp_path).kernels == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_kept_fp8_weights_multiply_in_fp8_where_the_device_has_block_scaling(fp8_checkpoint):
    path, stored, quantizer = fp8_checkpoint
    with torch.device("meta"):
        model = Pair()
    surgery.load_checkpoint(
        model, path, device="cuda", quantizer=KeepPacked(quantizer, checkpoint=path, kernel=True)
    )
    x = torch.randn(5, K, device="cuda", dtype=torch.bfloat16)
    w = blockwise_dequantize(stored["up.weight"], stored["up.weight_scale_inv"], (128, 128)).cuda()
    want = F.linear(x.float(), w, stored["up.bias"].cuda()).to(torch.bfloat16)
    got = model.up(x)
    if torch.cuda.get_device_capability() == (9, 0):
        assert model.up.kernel_name().startswith("fp8 block-scaled matmul")
        direct = fp8_block_linear(x, *model.up.fp8_operands(), model.up.bias)
        assert torch.equal(got, direct)
    rel = float((got.float() - want.float()).norm() / want.float().norm())
    assert rel < 0.05, rel


def test_an_all_zero_group_gets_a_normal_scale_and_zero_values():
    x = torch.zeros(2, 256)
    x[1, 128:] = 3.0
    q, scale = quantize_activations(x)
    tiny = torch.finfo(torch.float32).tiny
    assert scale[0].tolist() == [tiny, tiny] and scale[1, 0] == tiny  # the smallest normal, not a subnormal
    assert bool((q[0].float() == 0).all()) and bool((q[1, 128:].float() * scale[1, 1] == 3.0).all())
