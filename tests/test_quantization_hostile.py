"""Hostile quantized checkpoints: every input a file controls is an error naming the key, raised
before the model changes (or a documented behaviour with exact data).

The inputs: FP8 block scales (values, dtype, shape, a scale no FP8 weight claims), the
``quantization_config`` that :meth:`FP8BlockQuantizer.from_config` reads, and runtime-layout
int8 files (scale values and shapes, the persisted quantizer metadata). A strict load raises a
:class:`~surgery.LoadError` before any tensor is set; a non-strict load reports the key as a
conversion error and leaves its parameter untouched.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fp8_reference import dequantize, quantize
from torch import nn

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.quantization import (
    QUANTIZATION_METADATA_KEY,
    FP8BlockQuantizer,
    Int8WeightOnlyLinear,
    Int8WeightOnlyQuantizer,
    QuantizerHooks,
)

B128 = (128, 128)


class TwoLayers(nn.Module):
    """``first`` is always intact in the files below, ``second`` carries the hostile input."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(256, 256, bias=False)
        self.second = nn.Linear(256, 256, bias=False)


def snapshot(model: nn.Module) -> dict[str, object]:
    """Everything a load could change: module types and every tensor's values."""
    return {
        "types": [(p, type(m).__name__) for p, m in model.named_modules()],
        **{k: v.detach().clone() for k, v in model.state_dict().items()},
    }


def same(a: dict[str, object], b: dict[str, object]) -> bool:
    return a.keys() == b.keys() and all(
        torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in ((a[k], b[k]) for k in a)
    )


def fp8_layers(seed: int = 0) -> dict[str, torch.Tensor]:
    torch.manual_seed(seed)
    sd: dict[str, torch.Tensor] = {}
    for name in ("first", "second"):
        q, scale = quantize(torch.randn(256, 256) * 0.05, B128)
        sd[f"{name}.weight"], sd[f"{name}.weight_scale_inv"] = q, scale
    return sd


def assert_refused(path: Path, needles: list[str], quantizer: object | None = None) -> None:
    """A strict load raises naming ``needles`` and changes nothing; a plain one reports them the same way."""
    model = TwoLayers()
    before = snapshot(model)
    with pytest.raises(surgery.LoadError) as caught:
        surgery.load_checkpoint(model, path, quantizer=quantizer, strict=True)
    for needle in needles:
        assert needle in str(caught.value)
    assert same(snapshot(model), before)
    report = surgery.load_checkpoint(model, path, quantizer=quantizer)
    assert not report.ok
    assert any(all(needle in f.message for needle in needles) for f in report.conversion_errors)
    assert all(k.startswith("second.") for f in report.conversion_errors for k in f.target_keys)
    assert "first.weight" in report.loaded_keys and "second.weight" not in report.loaded_keys


# --------------------------------------------------------------------------- FP8 scale values


@pytest.mark.parametrize(
    ("value", "why"),
    [
        (float("nan"), "not finite"),
        (float("inf"), "not finite"),
        (float("-inf"), "not finite"),
        (0.0, "not positive"),
        (-0.01, "not positive"),
        (1e36, "too large"),  # 448 * 1e36 overflows float32: the decoded weight would be inf
    ],
    ids=["nan", "inf", "-inf", "zero", "negative", "overflowing"],
)
def test_an_fp8_scale_that_is_not_finite_and_positive_is_refused_naming_the_key_and_block(
    tmp_path: Path, value: float, why: str
) -> None:
    sd = fp8_layers()
    sd["second.weight_scale_inv"][1, 0] = value
    write_checkpoint(sd, tmp_path)
    assert_refused(tmp_path, ["'second.weight_scale_inv'", "block (1, 0)", why], FP8BlockQuantizer())


def test_an_e8m0_scale_holding_nan_is_refused(tmp_path: Path) -> None:
    sd = fp8_layers()
    bits = torch.full((2, 2), 120, dtype=torch.uint8)  # 2**-7
    bits[0, 1] = 0xFF  # e8m0's only NaN
    sd["second.weight_scale_inv"] = bits.view(torch.float8_e8m0fnu)
    write_checkpoint(sd, tmp_path)
    assert_refused(tmp_path, ["'second.weight_scale_inv'", "block (0, 1)", "not finite"], FP8BlockQuantizer())


def test_the_plan_shows_a_bad_scale_before_anything_is_loaded(tmp_path: Path) -> None:
    sd = fp8_layers()
    sd["second.weight_scale_inv"][0, 0] = float("nan")
    write_checkpoint(sd, tmp_path)
    plan = surgery.plan_load(TwoLayers(), tmp_path, quantizer=FP8BlockQuantizer())
    statuses = {e.target_keys: (e.status, e.message) for e in plan.entries}
    assert statuses[("first.weight",)][0] == "ok"
    status, message = statuses[("second.weight",)]
    assert status == "error" and "'second.weight_scale_inv'" in message


def test_decoding_directly_with_a_bad_scale_is_a_conversion_error() -> None:
    q, scale = quantize(torch.randn(8, 8), (4, 4))
    scale[1, 1] = -scale[1, 1]
    with pytest.raises(surgery.ConversionError, match=r"'w_scale_inv'.*block \(1, 1\)"):
        FP8BlockQuantizer(block_size=(4, 4)).decode("w", q, {"w_scale_inv": scale})


# --------------------------------------------------------------------------- FP8 scale dtype and shape


@pytest.mark.parametrize("dtype", [torch.float16, torch.int32], ids=["float16", "int32"])
def test_a_scale_of_a_wrong_dtype_is_refused_naming_the_key_and_dtype(tmp_path: Path, dtype) -> None:
    sd = fp8_layers()
    sd["second.weight_scale_inv"] = sd["second.weight_scale_inv"].to(dtype)
    write_checkpoint(sd, tmp_path)
    assert_refused(tmp_path, ["'second.weight_scale_inv'", str(dtype)], FP8BlockQuantizer())


def test_a_scale_shape_that_fits_another_block_size_names_that_block_size(tmp_path: Path) -> None:
    sd = fp8_layers()
    q, scale = quantize(torch.randn(256, 256) * 0.05, (64, 32))
    sd["second.weight"], sd["second.weight_scale_inv"] = q, scale
    write_checkpoint(sd, tmp_path)
    assert_refused(
        tmp_path,
        [
            "'second.weight_scale_inv' has shape (4, 8)",
            "needs (2, 2)",
            "fit 64x32 blocks",
            "block_size=(64, 32)",
        ],
        FP8BlockQuantizer(),
    )
    model = (
        TwoLayers()
    )  # with the block size the message names, the second layer loads (the first is 128x128)
    report = surgery.load_checkpoint(model, tmp_path, quantizer=FP8BlockQuantizer(block_size=(64, 32)))
    assert torch.equal(model.second.weight, dequantize(q, scale, (64, 32)))
    assert [f.target_keys for f in report.conversion_errors] == [("first.weight",)]


def test_a_scale_shape_no_block_size_fits_says_so(tmp_path: Path) -> None:
    sd = fp8_layers()
    sd["second.weight_scale_inv"] = torch.ones(2, 300)  # 300 column blocks for 256 columns
    write_checkpoint(sd, tmp_path)
    assert_refused(
        tmp_path, ["'second.weight_scale_inv' has shape (2, 300)", "fit no block size"], FP8BlockQuantizer()
    )


# --------------------------------------------------------------------------- scales nothing claims


def test_a_scale_next_to_a_float_weight_is_refused_naming_both(tmp_path: Path) -> None:
    sd = fp8_layers()
    sd["second.weight"] = torch.randn(256, 256)  # not quantized, yet with scales
    write_checkpoint(sd, tmp_path)
    assert_refused(
        tmp_path,
        ["'second.weight_scale_inv' belongs with 'second.weight'", "stored as float32"],
        FP8BlockQuantizer(),
    )


def test_a_scale_whose_weight_is_absent_is_refused_even_where_the_model_has_such_a_parameter(
    tmp_path: Path,
) -> None:
    """A model with a ``weight_scale_inv`` parameter would otherwise load the orphan silently."""

    class WithScale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lone = nn.Module()
            self.lone.weight_scale_inv = nn.Parameter(torch.ones(2, 2))

    write_checkpoint({"lone.weight_scale_inv": torch.full((2, 2), 3.0)}, tmp_path)
    model = WithScale()
    with pytest.raises(surgery.LoadError, match=r"the checkpoint has no 'lone\.weight'"):
        surgery.load_checkpoint(model, tmp_path, quantizer=FP8BlockQuantizer(), strict=True)
    assert torch.equal(model.lone.weight_scale_inv, torch.ones(2, 2))


# --------------------------------------------------------------------------- documented: a block larger than the weight


def test_a_block_larger_than_the_weight_means_one_scale_covers_it_and_loads_exactly(tmp_path: Path) -> None:
    q, scale = quantize(torch.randn(48, 40) * 0.05, (4096, 4096))
    assert scale.shape == (1, 1)
    write_checkpoint({"weight": q, "weight_scale_inv": scale}, tmp_path)
    quantizer = FP8BlockQuantizer.from_config({"quant_method": "fp8", "weight_block_size": [4096, 4096]})
    model = nn.Linear(40, 48, bias=False)
    assert surgery.load_checkpoint(model, tmp_path, quantizer=quantizer).ok
    assert torch.equal(model.weight, dequantize(q, scale, (4096, 4096)))


# --------------------------------------------------------------------------- quantization_config


def fp8_config(**edit: object) -> dict[str, object]:
    return {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "weight_block_size": [128, 128],
        **edit,
    }


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        ({"quant_method": "awq"}, "quantization_config.quant_method='awq'"),
        ({"quant_method": ["fp8"]}, "quantization_config.quant_method=['fp8']"),
        ({"quant_method": None}, "quantization_config.quant_method=None"),
        ({"weight_block_size": [0, 128]}, "quantization_config.weight_block_size=[0, 128]"),
        ({"weight_block_size": [-128, 128]}, "quantization_config.weight_block_size=[-128, 128]"),
        ({"weight_block_size": [2**40, 128]}, "up to 2**31"),
        ({"weight_block_size": [128]}, "quantization_config.weight_block_size=[128]"),
        ({"weight_block_size": [128, 128, 128]}, "two positive ints"),
        ({"weight_block_size": "128x128"}, "quantization_config.weight_block_size='128x128'"),
        ({"weight_block_size": 128}, "quantization_config.weight_block_size=128"),
        ({"weight_block_size": [128.0, 128]}, "quantization_config.weight_block_size=[128.0, 128]"),
        ({"weight_block_size": [True, 128]}, "quantization_config.weight_block_size=[True, 128]"),
        ({"weight_block_size": {"rows": 128}}, "quantization_config.weight_block_size={'rows': 128}"),
        ({"weight_block_size": None}, "per-tensor"),
        ({"fmt": "e3m4"}, "quantization_config.fmt='e3m4' is not a weight format"),
        ({"fmt": 8}, "quantization_config.fmt=8"),
        ({"scale_fmt": "ue4m3"}, "quantization_config.scale_fmt='ue4m3'"),
        ({"activation_scheme": "static"}, "static activation scales are not supported"),
        ({"activation_scheme": ["dynamic"]}, "quantization_config.activation_scheme=['dynamic']"),
    ],
)
def test_a_malformed_quantization_config_is_an_error_naming_the_field(edit, needle) -> None:
    for source in (fp8_config(**edit), {"model_type": "x", "quantization_config": fp8_config(**edit)}):
        with pytest.raises(surgery.ConfigurationError) as caught:
            FP8BlockQuantizer.from_config(source)
        assert needle in str(caught.value)


def test_a_quantization_config_that_is_not_a_dict_is_an_error() -> None:
    with pytest.raises(surgery.ConfigurationError, match=r"quantization_config is \[1, 2\], not a dict"):
        FP8BlockQuantizer.from_config({"quantization_config": [1, 2]})


def test_a_quantization_config_nested_in_another_is_an_error_saying_so() -> None:
    with pytest.raises(surgery.ConfigurationError, match="holds another quantization_config"):
        FP8BlockQuantizer.from_config({"quantization_config": {"quantization_config": fp8_config()}})


def test_a_deeply_nested_config_json_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text('{"quantization_config": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(surgery.ConfigurationError, match=r"config\.json: cannot read a JSON config"):
        FP8BlockQuantizer.from_config(tmp_path)


def test_a_deeply_nested_or_huge_value_is_quoted_briefly() -> None:
    nested: list[object] = []
    for _ in range(50_000):
        nested = [nested]
    for value in (nested, "x" * 1_000_000, {str(i): i for i in range(100_000)}):
        with pytest.raises(surgery.ConfigurationError, match="weight_block_size") as caught:
            FP8BlockQuantizer.from_config(fp8_config(weight_block_size=value))
        assert len(str(caught.value)) < 400


def test_a_config_json_that_is_not_json_is_an_error_naming_the_file(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{quantization_config: fp8")
    with pytest.raises(surgery.ConfigurationError, match=r"config\.json: cannot read"):
        FP8BlockQuantizer.from_config(tmp_path)


# --------------------------------------------------------------------------- int8 runtime layout


def int8_runtime_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A runtime-layout save of an int8-quantized ``TwoLayers`` (codes, scales, metadata)."""
    torch.manual_seed(0)
    model = TwoLayers()
    Int8WeightOnlyQuantizer().prepare(model)
    surgery.save_checkpoint(model, path, original_format=False)
    with open_checkpoint(path) as reader:
        return {k: reader.get_tensor(k) for k in reader}


def rewrite(path: Path, sd: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> None:
    meta = {QUANTIZATION_METADATA_KEY: Int8WeightOnlyQuantizer().metadata()[QUANTIZATION_METADATA_KEY]}
    write_checkpoint(sd, path, metadata=meta if metadata is None else metadata)


def test_an_intact_int8_runtime_checkpoint_loads_exactly(tmp_path: Path) -> None:
    sd = int8_runtime_checkpoint(tmp_path)
    model = TwoLayers()
    assert surgery.load_checkpoint(model, tmp_path, strict=True).ok
    assert isinstance(model.second, Int8WeightOnlyLinear)
    for key, value in sd.items():
        assert torch.equal(model.state_dict()[key], value), key


@pytest.mark.parametrize(
    ("value", "needle"),
    [(float("nan"), "is nan"), (float("inf"), "is inf"), (-0.5, "is -0.5")],
    ids=["nan", "inf", "negative"],
)
def test_an_int8_scale_that_is_not_finite_or_is_negative_is_refused(tmp_path: Path, value, needle) -> None:
    sd = int8_runtime_checkpoint(tmp_path / "good")
    sd["second.weight_scale"][7] = value
    rewrite(tmp_path / "bad", sd)
    assert_refused(tmp_path / "bad", ["'second.weight_scale'", f"row (7,) {needle}"])


def test_an_int8_scale_of_an_integer_dtype_is_refused(tmp_path: Path) -> None:
    sd = int8_runtime_checkpoint(tmp_path / "good")
    sd["second.weight_scale"] = torch.ones(256, dtype=torch.int32)
    rewrite(tmp_path / "bad", sd)
    assert_refused(tmp_path / "bad", ["'second.weight_scale' is torch.int32"])


def test_a_zero_int8_scale_is_an_all_zero_row_and_loads(tmp_path: Path) -> None:
    """Documented: quantizing an all-zero row gives scale 0, so 0 is a legitimate stored scale."""
    sd = int8_runtime_checkpoint(tmp_path / "good")
    sd["second.weight_scale"][3] = 0.0
    rewrite(tmp_path / "zero", sd)
    model = TwoLayers()
    assert surgery.load_checkpoint(model, tmp_path / "zero", strict=True).ok
    assert float(model.second.weight_scale[3]) == 0.0


@pytest.mark.parametrize(
    ("scale", "needle"),
    [(torch.ones(255), "(255,)"), (torch.ones(256, 1), "(256, 1)")],
    ids=["short", "two-dims"],
)
def test_an_int8_scale_of_the_wrong_shape_is_refused_and_its_codes_with_it(
    tmp_path: Path, scale, needle
) -> None:
    sd = int8_runtime_checkpoint(tmp_path / "good")
    sd["second.weight_scale"] = scale
    rewrite(tmp_path / "bad", sd)
    model = TwoLayers()
    before = snapshot(model)
    with pytest.raises(surgery.LoadError, match=r"second\.weight_scale") as caught:
        surgery.load_checkpoint(model, tmp_path / "bad", strict=True)
    assert needle in str(caught.value)
    assert same(snapshot(model), before)
    report = surgery.load_checkpoint(model, tmp_path / "bad")
    assert [m.key for m in report.mismatched] == ["second.weight_scale"]
    (failure,) = report.conversion_errors
    assert failure.target_keys == ("second.weight",) and "load together or not at all" in failure.message
    assert "second.weight" not in report.loaded_keys and "first.weight" in report.loaded_keys


def test_int8_codes_without_their_scale_are_not_loaded(tmp_path: Path) -> None:
    sd = int8_runtime_checkpoint(tmp_path / "good")
    del sd["second.weight_scale"]
    rewrite(tmp_path / "bad", sd)
    model = TwoLayers()
    report = surgery.load_checkpoint(model, tmp_path / "bad")
    assert report.missing_keys == ["second.weight_scale"]
    assert "second.weight" not in report.loaded_keys
    assert "'second.weight_scale'" in report.conversion_errors[0].message


def test_int8_codes_stored_as_another_integer_dtype_are_refused_not_quantized_again(tmp_path: Path) -> None:
    """Found by the fuzz: uint8 codes were quantized as if they were float weights (halved), silently."""
    sd = int8_runtime_checkpoint(tmp_path / "good")
    sd["second.weight"] = sd["second.weight"].view(torch.uint8)
    rewrite(tmp_path / "bad", sd)
    assert_refused(tmp_path / "bad", ["'second.weight' is stored as uint8", "quantizes floats"])


def test_a_stored_scale_next_to_a_weight_the_quantizer_quantizes_is_a_conflict(tmp_path: Path) -> None:
    """Codes stored as floats would be quantized again, and the new scale collide with the stored one."""
    sd = int8_runtime_checkpoint(tmp_path / "good")
    sd["second.weight"] = sd["second.weight"].float()
    rewrite(tmp_path / "bad", sd)
    model = TwoLayers()
    before = snapshot(model)
    with pytest.raises(surgery.LoadError, match=r"land on second\.weight_scale"):
        surgery.load_checkpoint(model, tmp_path / "bad", strict=True)
    assert same(snapshot(model), before)


@pytest.mark.parametrize(
    ("raw", "needle"),
    [
        ('{"quant_method": "ghost_int3"}', "quant_method='ghost_int3'"),
        ('{"quant_method": ["int8_weight_only"]}', "quant_method=['int8_weight_only']"),
        ('"int8_weight_only"', "quant_method=None"),
        ('{"quant_method": "int8_weight_only", "targets": "second"}', "targets='second'"),
        ('{"quant_method": "int8_weight_only", "exclude": [1]}', "exclude=[1]"),
        ("{not json", "not valid JSON"),
        ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ],
    ids=["unknown", "list", "string", "targets-str", "exclude-int", "not-json", "nested"],
)
def test_metadata_claiming_a_quantizer_that_does_not_exist_or_cannot_be_built_is_refused(
    tmp_path: Path, raw: str, needle: str
) -> None:
    sd = int8_runtime_checkpoint(tmp_path / "good")
    rewrite(tmp_path / "bad", sd, {QUANTIZATION_METADATA_KEY: raw})
    model = TwoLayers()
    before = snapshot(model)
    for call in (surgery.plan_load, surgery.load_checkpoint):
        with pytest.raises(surgery.LoadError) as caught:
            call(model, tmp_path / "bad")
        assert needle in str(caught.value) and QUANTIZATION_METADATA_KEY in str(caught.value)
        assert "quantizer=" in str(caught.value)
        assert same(snapshot(model), before)


# --------------------------------------------------------------------------- the hooks behind it


class Checked:
    """A toy format: weights stored halved with a ``_marker`` companion that must be exactly 1."""

    def __init__(self, **overrides: object) -> None:
        self.seen: list[str] = []
        for name, value in overrides.items():
            setattr(self, name, value)

    def companions(self, key, info):
        return (key + "_marker",) if key.endswith("weight") else ()

    def companion_of(self, key):
        return key.removesuffix("_marker") if key.endswith("_marker") else None

    def checks(self, key, info):
        return key.endswith("_marker")

    def check(self, key, tensor):
        self.seen.append(key)
        if not torch.equal(tensor, torch.ones(1)):
            raise surgery.ConversionError(f"{key!r} is not 1")

    def decode(self, key, tensor, companions, region=None):
        return tensor.float() * 2


def test_planning_reads_what_checks_names_and_decode_reuses_it(tmp_path: Path) -> None:
    write_checkpoint({"weight": torch.full((4, 4), 0.5), "weight_marker": torch.ones(1)}, tmp_path)
    quantizer = Checked()
    model = nn.Linear(4, 4, bias=False)
    report = surgery.load_checkpoint(model, tmp_path, quantizer=quantizer)
    assert report.ok and torch.equal(model.weight, torch.ones(4, 4))
    assert quantizer.seen == ["weight_marker"]  # checked once, at planning
    assert report.bytes_read == 4 * 4 * 4 + 4  # and read once


def test_a_check_that_fails_is_reported_at_planning_naming_the_key(tmp_path: Path) -> None:
    write_checkpoint({"weight": torch.full((4, 4), 0.5), "weight_marker": torch.zeros(1)}, tmp_path)
    plan = surgery.plan_load(nn.Linear(4, 4, bias=False), tmp_path, quantizer=Checked())
    (entry,) = plan.entries
    assert entry.status == "error" and entry.message == "'weight_marker' is not 1"


def test_half_of_the_checks_check_pair_is_a_configuration_error() -> None:
    class OnlyCheck:
        def check(self, key, tensor):
            return None

    with pytest.raises(surgery.ConfigurationError, match="only one of checks/check"):
        QuantizerHooks(OnlyCheck())


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"companion_of": lambda key: key}, "companion_of('weight') returned 'weight'; return another"),
        ({"checks": lambda key, info: 1}, "checks('weight_marker') returned 1, not True or False"),
        ({"check": lambda key, tensor: False}, "check('weight_marker') returned False; it returns None"),
    ],
    ids=["companion-of-itself", "checks-not-bool", "check-returns"],
)
def test_the_new_hooks_are_checked_naming_the_method(tmp_path: Path, overrides, needle) -> None:
    write_checkpoint({"weight": torch.full((4, 4), 0.5), "weight_marker": torch.ones(1)}, tmp_path)
    with pytest.raises(surgery.ConfigurationError) as caught:
        surgery.load_checkpoint(nn.Linear(4, 4, bias=False), tmp_path, quantizer=Checked(**overrides))
    assert needle in str(caught.value)
