"""Fuzzing the quantized layout: FP8 weights, their block scales and the ``quantization_config``.

A seeded mutation loop (reproducible in CI) edits a real FP8 checkpoint and its ``config.json``:
scale values (NaN, ±Inf, zero, negative, overflowing, subnormal), scale and weight dtypes and
shapes, raw FP8 bytes, keys (missing, orphaned, renamed, a static activation scale) and every
field of the config (types, block sizes, formats, nesting). The quantizer is built from the
mutated ``config.json`` and the checkpoint loaded with it. Every outcome is one of two:

* the load succeeds, and every parameter equals the reference dequantization of the file
  (``tests/fp8_reference.py``, written independently of the library), bit for bit;
* a :class:`~surgery.SurgeryError`, and the model is exactly as it was (strict load).

A non-strict load of the same files must load exact data or leave a parameter untouched: every
loaded key equals the reference, every other one is unchanged. Runtime-layout int8 files (codes,
per-channel scales, the persisted quantizer metadata) are mutated the same way.
"""

from __future__ import annotations

import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch
from fp8_reference import dequantize, quantize
from torch import nn

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.examples import moe
from surgery.quantization import (
    QUANTIZATION_METADATA_KEY,
    FP8BlockQuantizer,
    Int8WeightOnlyLinear,
    Int8WeightOnlyQuantizer,
)

SEED = 20261204
CASES = 240
BLOCK = (16, 16)
FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


class Net(nn.Module):
    """Two linears with edge blocks in both dimensions (48x40 and 40x48 in 16x16 blocks) and a norm."""

    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        self.a = nn.Linear(40, 48, dtype=dtype)
        self.b = nn.Linear(48, 40, bias=False, dtype=dtype)
        self.norm = nn.LayerNorm(40, dtype=dtype)


def source() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    sd: dict[str, torch.Tensor] = {}
    for key, shape in (("a.weight", (48, 40)), ("b.weight", (40, 48))):
        sd[key], sd[key + "_scale_inv"] = quantize(torch.randn(*shape) * 0.05, BLOCK)
    sd["a.bias"] = torch.randn(48)
    sd["norm.weight"], sd["norm.bias"] = torch.rand(40) + 0.5, torch.randn(40) * 0.1
    return sd


CONFIG: dict[str, Any] = {
    "quant_method": "fp8",
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "weight_block_size": list(BLOCK),
}

_SCALES = [
    math.nan,
    math.inf,
    -math.inf,
    0.0,
    -0.0,
    -1e-3,
    1e36,
    3e38,
    1e-45,
    1e-30,
    1e30,
    2.0,
]
_SCALE_DTYPES = [
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.int32,
    torch.uint8,
    torch.float8_e8m0fnu,
    torch.float8_e4m3fn,
]
_CONFIG_VALUES: list[Any] = [
    None,
    0,
    -1,
    16,
    2**40,
    1.5,
    True,
    "fp8",
    "FP8",
    "e4m3",
    "e5m2",
    "float8_e4m3fn",
    "e3m4",
    "ue8m0",
    "dynamic",
    "static",
    [16, 16],
    [32, 16],
    [8, 8],
    [64, 64],
    [4096, 4096],
    [16],
    [0, 16],
    [-16, 16],
    [16.0, 16],
    [True, 16],
    [[16], [16]],
    {},
    {"quant_method": "fp8"},
    "x" * 100_000,
]


def _scale_keys(sd: dict[str, torch.Tensor]) -> list[str]:
    return sorted(k for k in sd if k.endswith("_scale_inv"))


def mutate(rng: random.Random, sd: dict[str, torch.Tensor], config: dict[str, Any]) -> tuple[dict, Any]:
    """One mutation of the files: returns the state dict and the config.json content (or raw text)."""
    sd = {k: v.clone() for k, v in sd.items()}
    config = json.loads(json.dumps(config))
    kind = rng.randrange(8)
    scale_key = rng.choice(_scale_keys(sd))
    weight_key = scale_key.removesuffix("_scale_inv")
    if kind == 0:  # scale values
        s = sd[scale_key]
        s.view(-1)[rng.randrange(s.numel())] = rng.choice(_SCALES)
    elif kind == 1:  # scale dtype
        sd[scale_key] = sd[scale_key].to(rng.choice(_SCALE_DTYPES))
    elif kind == 2:  # scale shape
        s = sd[scale_key]
        sd[scale_key] = rng.choice(
            [s[:-1], torch.cat([s, s[:, :1]], 1), s.T.contiguous(), s.flatten(), s[None], s[0, 0], s[:0]]
        )
    elif kind == 3:  # weight dtype
        w = sd[weight_key]
        sd[weight_key] = rng.choice(
            [
                w.float().to(torch.float8_e5m2),
                w.float(),
                w.to(torch.bfloat16),
                w.view(torch.int8),
                w.view(torch.uint8),
            ]
        )
    elif kind == 4:  # raw FP8 bytes, NaN patterns included
        bits = sd[weight_key].view(torch.uint8)
        for _ in range(rng.randint(1, 8)):
            bits.view(-1)[rng.randrange(bits.numel())] = rng.choice([0x7F, 0xFF, 0x80, rng.randrange(256)])
    elif kind == 5:  # weight shape
        w = sd[weight_key]
        sd[weight_key] = rng.choice([w[:-1].contiguous(), w.T.contiguous(), w[:, :16].contiguous()])
    elif kind == 6:  # keys
        edit = rng.randrange(6)
        if edit == 0:
            del sd[scale_key]
        elif edit == 1:
            del sd[weight_key]
        elif edit == 2:
            sd["ghost.weight_scale_inv"] = torch.ones(1, 1)
        elif edit == 3:
            sd["a.activation_scale"] = torch.ones(())
        elif edit == 4:
            sd[weight_key + "_scale"] = sd.pop(scale_key)
        else:
            sd["norm.weight_scale_inv"] = torch.ones(1)
    else:  # config.json
        edit = rng.randrange(5)
        if edit == 0:
            config[rng.choice([*CONFIG, "scale_fmt"])] = rng.choice(_CONFIG_VALUES)
        elif edit == 1:
            del config[rng.choice(list(CONFIG))]
        elif edit == 2:
            return sd, rng.choice([[], "fp8", 3, None])
        elif edit == 3:
            return sd, '{"quantization_config": ' + "[" * 100_000 + "]" * 100_000 + "}"
        else:
            config = {"quantization_config": config}  # nested one level too deep
    return sd, {"model_type": "net", "quantization_config": config}


def write(path: Path, sd: dict[str, torch.Tensor], config: Any) -> None:
    write_checkpoint(sd, path)
    (path / "config.json").write_text(config if isinstance(config, str) else json.dumps(config))


def expected(
    sd: dict[str, torch.Tensor], key: str, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The reference value of ``key``: FP8 values times their block scales, else the stored values."""
    value = sd[key]
    if value.dtype in FP8:
        return dequantize(value, sd[key + "_scale_inv"].float(), block).to(dtype)
    return value.to(dtype)


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def exact(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (
        got.dtype == want.dtype
        and got.shape == want.shape
        and bool(torch.all((got == want) | (got.isnan() & want.isnan())))
    )


def run_case(path: Path, sd: dict[str, torch.Tensor], dtype: torch.dtype) -> str:
    """Strict, then plain load of ``path``; assert the contract; return ``"loaded"`` or ``"refused"``."""
    model = Net(dtype)
    before = snapshot(model)
    try:
        quantizer = FP8BlockQuantizer.from_config(path)
        surgery.load_checkpoint(model, path, quantizer=quantizer, strict=True, dtype=dtype)
    except surgery.SurgeryError:
        after = snapshot(model)
        assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
        outcome = "refused"
    else:
        for key, value in model.state_dict().items():
            assert exact(value, expected(sd, key, quantizer.block_size, dtype)), key
        for key in _scale_keys(sd):  # a scale that is not finite and positive never loads
            assert bool(torch.all(torch.isfinite(sd[key].float()) & (sd[key].float() > 0))), key
        return "loaded"
    try:
        quantizer = FP8BlockQuantizer.from_config(path)
    except surgery.SurgeryError:
        return outcome
    plain = Net(dtype)
    untouched = snapshot(plain)
    report = surgery.load_checkpoint(plain, path, quantizer=quantizer, dtype=dtype)
    assert not report.ok
    for key, value in plain.state_dict().items():
        if key in report.loaded_keys:
            assert exact(value, expected(sd, key, quantizer.block_size, dtype)), key
        else:
            assert torch.equal(value, untouched[key]), key
    return outcome


def test_mutated_fp8_checkpoints_load_exactly_or_are_refused_leaving_the_model_unchanged(
    tmp_path: Path,
) -> None:
    base = source()
    rng = random.Random(SEED)
    outcomes: dict[str, int] = {}
    for case in range(CASES):
        sd, config = mutate(rng, base, CONFIG)
        path = tmp_path / f"case{case}"
        write(path, sd, config)
        dtype = torch.bfloat16 if case % 3 == 0 else torch.float32
        try:
            outcome = run_case(path, sd, dtype)
        except AssertionError:
            raise
        except Exception as exc:  # anything but a SurgeryError is a bug
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert outcomes.get("refused", 0) > CASES // 2  # most mutations break the files ...
    assert outcomes.get("loaded", 0) > CASES // 20  # ... and some leave valid ones, loaded exactly


def test_the_unmutated_files_load_exactly(tmp_path: Path) -> None:
    """The baseline the mutations start from is itself a valid checkpoint."""
    write(tmp_path, source(), {"quantization_config": CONFIG})
    assert run_case(tmp_path, source(), torch.float32) == "loaded"


# --------------------------------------------------------------------------- merged experts


MOE_BLOCK = (12, 10)  # 32x16 and 16x32 expert weights: edge blocks in both dims


def moe_source() -> dict[str, torch.Tensor]:
    model = moe.build_moe_model(moe.ExampleMoEConfig(), seed=0)
    out: dict[str, torch.Tensor] = {}
    for key, value in moe.original_state_dict(model).items():
        if ".experts." in key and value.dim() == 2:
            out[key], out[key + "_scale_inv"] = quantize(value, MOE_BLOCK)
        else:
            out[key] = value
    return out


def test_mutated_fp8_expert_checkpoints_load_exactly_or_are_refused_leaving_the_model_unchanged(
    tmp_path: Path,
) -> None:
    """Per-expert scales decode before the expert merge: a bad one fails its merged parameter only."""
    base = moe_source()
    config = {**CONFIG, "weight_block_size": list(MOE_BLOCK)}
    rng = random.Random(SEED + 1)
    outcomes: dict[str, int] = {}
    for case in range(40):
        sd, cfg = mutate(rng, base, config)
        if rng.random() < 0.3:
            sd = {k: v for k, v in sd.items() if not k.endswith(".experts.3.w2.weight_scale_inv")}
        path = tmp_path / f"case{case}"
        write(path, sd, cfg)
        model = moe.build_moe_model(moe.ExampleMoEConfig(), seed=1)
        before = snapshot(model)
        try:
            surgery.load_checkpoint(model, path, quantizer=FP8BlockQuantizer.from_config(path), strict=True)
        except surgery.SurgeryError:
            after = snapshot(model)
            assert all(torch.equal(after[k], before[k]) for k in before), case
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            continue
        except Exception as exc:
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        floats = {
            k: expected(sd, k, MOE_BLOCK, torch.float32) if v.dtype in FP8 else v
            for k, v in sd.items()
            if not k.endswith("_scale_inv")
        }
        write_checkpoint(floats, tmp_path / f"float{case}")
        want = moe.build_moe_model(moe.ExampleMoEConfig(), seed=1)
        assert surgery.load_checkpoint(want, tmp_path / f"float{case}", strict=True).ok
        got = model.state_dict()
        for key, value in want.state_dict().items():
            assert exact(got[key], value), (case, key)
        outcomes["loaded"] = outcomes.get("loaded", 0) + 1
    assert outcomes.get("refused", 0) > 10 and outcomes.get("loaded", 0) > 0


# --------------------------------------------------------------------------- int8 runtime layout


def int8_source(path: Path) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = Net()
    surgery.load_checkpoint(model, _float_checkpoint(path / "float"), quantizer=Int8WeightOnlyQuantizer())
    surgery.save_checkpoint(model, path / "int8", original_format=False)
    with open_checkpoint(path / "int8") as reader:
        return {k: reader.get_tensor(k) for k in reader}


def _float_checkpoint(path: Path) -> Path:
    torch.manual_seed(1)
    surgery.save_checkpoint(Net(), path)
    return path


def mutate_int8(rng: random.Random, sd: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], str]:
    """One mutation of a runtime-layout int8 file: returns the state dict and the metadata JSON."""
    sd = {k: v.clone() for k, v in sd.items()}
    meta = Int8WeightOnlyQuantizer().metadata()[QUANTIZATION_METADATA_KEY]
    scale_key = rng.choice(["a.weight_scale", "b.weight_scale"])
    weight_key = scale_key.removesuffix("_scale")
    kind = rng.randrange(5)
    if kind == 0:
        sd[scale_key][rng.randrange(sd[scale_key].numel())] = rng.choice(_SCALES)
    elif kind == 1:
        sd[scale_key] = rng.choice(
            [
                sd[scale_key][:-1],
                sd[scale_key][:, None],
                sd[scale_key].to(rng.choice(_SCALE_DTYPES)),
                torch.ones(()),
            ]
        )
    elif kind == 2:
        w = sd[weight_key]
        sd[weight_key] = rng.choice(
            [w.view(torch.uint8), w.float(), w.to(torch.int32), w[:-1], w.T.contiguous()]
        )
    elif kind == 3:
        del sd[rng.choice([scale_key, weight_key])]
    else:
        meta = rng.choice(
            [
                '{"quant_method": "int4_awq"}',
                '{"quant_method": null}',
                '{"quant_method": "int8_weight_only", "targets": ["nothing.here"]}',
                '{"quant_method": "int8_weight_only", "targets": "a"}',
                '{"quant_method": "int8_weight_only", "exclude": ["a"]}',
                '{"quant_method": "int8_weight_only", "targets": ["a"]}',
                "[" * 50_000 + "]" * 50_000,
                "{",
            ]
        )
    return sd, meta


def test_mutated_int8_runtime_checkpoints_load_exactly_or_are_refused_leaving_the_model_unchanged(
    tmp_path: Path,
) -> None:
    """Exact means: every tensor of the model equals the file's tensor of that name, cast losslessly."""
    base = int8_source(tmp_path)
    rng = random.Random(SEED + 2)
    outcomes: dict[str, int] = {}
    for case in range(80):
        sd, meta = mutate_int8(rng, base)
        path = tmp_path / f"case{case}"
        write_checkpoint(sd, path, metadata={QUANTIZATION_METADATA_KEY: meta})
        model = Net()
        before = {"types": [type(m).__name__ for m in model.modules()], **snapshot(model)}
        try:
            surgery.load_checkpoint(model, path, strict=True)
        except surgery.SurgeryError:
            after = {"types": [type(m).__name__ for m in model.modules()], **snapshot(model)}
            assert after["types"] == before["types"], case
            assert all(torch.equal(after[k], before[k]) for k in before if k != "types"), case
            outcomes["refused"] = outcomes.get("refused", 0) + 1
            continue
        except Exception as exc:
            pytest.fail(f"case {case}: {type(exc).__name__}: {exc}")
        state = model.state_dict()
        assert sorted(state) == sorted(sd), case
        for key, value in state.items():
            assert exact(value, sd[key].to(value.dtype)) and torch.equal(value.to(sd[key].dtype), sd[key]), (
                key
            )
        for key in ("a.weight_scale", "b.weight_scale"):
            if isinstance(getattr(model, key[0]), Int8WeightOnlyLinear):
                assert bool(torch.all(torch.isfinite(state[key]) & (state[key] >= 0))), key
        outcomes["loaded"] = outcomes.get("loaded", 0) + 1
    assert outcomes.get("refused", 0) > 30 and outcomes.get("loaded", 0) > 5
