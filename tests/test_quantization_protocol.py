"""The quantizer protocol: every hook optional, every result checked, errors naming the method and key."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.errors import ConfigurationError
from surgery.quantization import QuantizerHooks


class Halves:
    """Stores weights as half their value in int8-free float16: decode doubles (a toy disk format)."""

    def companions(self, key, info):
        return (key + "_marker",) if key.endswith("weight") else ()

    def decode(self, key, tensor, companions, region=None):
        return tensor.float() * 2


def checkpoint(path: Path) -> None:
    write_checkpoint(
        {
            "weight": torch.full((4, 4), 0.5, dtype=torch.float16),
            "weight_marker": torch.ones(1),
            "bias": torch.ones(4),
        },
        path,
    )


def test_a_quantizer_with_only_decode_hooks_loads_and_consumes_its_companions(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    model = nn.Linear(4, 4)
    report = surgery.load_checkpoint(model, tmp_path, quantizer=Halves())
    assert report.ok, report
    assert report.unexpected_keys == []
    assert torch.equal(model.weight, torch.ones(4, 4))


def test_an_object_without_any_hook_changes_nothing(tmp_path: Path) -> None:
    write_checkpoint({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, tmp_path)
    assert surgery.load_checkpoint(nn.Linear(4, 4), tmp_path, quantizer=object()).ok


class Broken(Halves):
    def __init__(self, **overrides) -> None:
        for name, value in overrides.items():
            setattr(self, name, value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        ({"companions": lambda key, info: "weight_marker"}, "returned 'weight_marker'; return a tuple"),
        ({"companions": lambda key, info: (key,)}, "every companion is another checkpoint key"),
        ({"decode": lambda key, t, c, region=None: t.float().sum()}, "Broken.decode('weight') turned shape"),
        ({"decode": lambda key, t, c, region=None: [t]}, "Broken.decode('weight') returned list"),
        (
            {"decode": lambda key, t, c, region=None: 1 / 0},
            "Broken.decode('weight') failed: ZeroDivisionError",
        ),
    ],
)
def test_a_hook_that_breaks_its_contract_is_reported_naming_the_method(
    tmp_path: Path, overrides, needle
) -> None:
    checkpoint(tmp_path)
    model = nn.Linear(4, 4)
    before = model.weight.detach().clone()
    try:
        report = surgery.load_checkpoint(model, tmp_path, quantizer=Broken(**overrides))
    except surgery.SurgeryError as exc:
        message = str(exc)
    else:
        message = " ".join(f.message for f in report.conversion_errors)
    assert needle in message
    assert torch.equal(model.weight, before)


def test_a_hook_attribute_that_is_not_callable_is_a_configuration_error() -> None:
    with pytest.raises(surgery.ConfigurationError, match=r"Broken\.decode is 3, not a method"):
        QuantizerHooks(Broken(decode=3))


def test_half_a_pair_of_hooks_is_a_configuration_error() -> None:
    class OnlyQuantize:
        def quantize(self, key, tensor):
            return {key: tensor}

    with pytest.raises(surgery.ConfigurationError, match="only one of quantizes/quantize"):
        QuantizerHooks(OnlyQuantize())


def test_a_quantize_result_that_does_not_fit_the_model_fails_before_reading(tmp_path: Path) -> None:
    class Wrong:
        def quantizes(self, key, module):
            return key == "weight"

        def quantize(self, key, tensor):
            return {key: tensor.to(torch.int8), "weight_scale": torch.ones(1)}

    write_checkpoint({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, tmp_path)
    plan = surgery.plan_load(nn.Linear(4, 4), tmp_path, quantizer=Wrong())
    (entry,) = [e for e in plan.entries if e.target_keys == ("weight",)]
    assert (
        entry.status == "error"
        and "Wrong.quantize('weight') produced 'weight' as (4, 4) int8" in entry.message
    )


def test_quantizes_must_answer_true_or_false(tmp_path: Path) -> None:
    class Vague:
        def quantizes(self, key, module):
            return "yes"

        def quantize(self, key, tensor):
            return {key: tensor}

    write_checkpoint({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, tmp_path)
    with pytest.raises(surgery.ConfigurationError, match=r"Vague\.quantizes\('bias'\) returned 'yes'"):
        surgery.load_checkpoint(nn.Linear(4, 4), tmp_path, quantizer=Vague())


def test_prepare_must_change_the_model_in_place(tmp_path: Path) -> None:
    class Returns:
        def prepare(self, model):
            return nn.Linear(4, 4)

    write_checkpoint({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, tmp_path)
    with pytest.raises(surgery.ConfigurationError, match="in place"):
        surgery.load_checkpoint(nn.Linear(4, 4), tmp_path, quantizer=Returns())


def test_update_weight_conversions_is_reached_from_the_loader(tmp_path: Path) -> None:
    class Renames:
        def update_weight_conversions(self, transforms):
            return [*transforms, surgery.WeightRenaming("^w$", "weight")]

    write_checkpoint({"w": torch.ones(4, 4), "bias": torch.ones(4)}, tmp_path)
    model = nn.Linear(4, 4)
    assert surgery.load_checkpoint(model, tmp_path, quantizer=Renames()).ok
    assert torch.equal(model.weight, torch.ones(4, 4))


def test_tensor_parallelism_and_quantizing_on_the_fly_do_not_combine(tmp_path: Path) -> None:
    from surgery.quantization import Int8WeightOnlyQuantizer

    write_checkpoint({"weight": torch.ones(4, 4), "bias": torch.ones(4)}, tmp_path)
    with pytest.raises(surgery.ConfigurationError, match="tensor parallelism"):
        surgery.plan_load(
            nn.Linear(4, 4),
            tmp_path,
            quantizer=Int8WeightOnlyQuantizer(),
            tp_plan={"": "colwise"},
            tp_size=2,
            tp_rank=0,
        )


def test_get_weight_conversions_adds_converters_for_an_n_to_1_format(tmp_path: Path) -> None:
    """A format that stores a weight as two halves: the quantizer's converter joins them."""

    class Halved:
        def get_weight_conversions(self):
            return [
                surgery.WeightConverter(
                    ["^weight_top$", "^weight_bottom$"], "weight", [surgery.ops.Concatenate(dim=0)]
                )
            ]

    write_checkpoint(
        {"weight_top": torch.ones(2, 4), "weight_bottom": torch.zeros(2, 4), "bias": torch.ones(4)}, tmp_path
    )
    model = nn.Linear(4, 4)
    report = surgery.load_checkpoint(model, tmp_path, quantizer=Halved())
    assert report.ok, report
    assert torch.equal(model.weight, torch.cat([torch.ones(2, 4), torch.zeros(2, 4)]))
    assert sorted(surgery.revert_state_dict(model)) == ["bias", "weight_bottom", "weight_top"]


def test_get_weight_conversions_must_return_transforms() -> None:
    class Bad:
        def get_weight_conversions(self):
            return ["weight"]

    with pytest.raises(surgery.ConfigurationError, match="list of WeightTransform"):
        QuantizerHooks(Bad()).weight_conversions()


# ------------------------------------------------------------------ quantization_config (config.json)


class Described:
    def __init__(self, config: object) -> None:
        self.config = config

    def quantization_config(self) -> object:
        return self.config


class WithMetadata:
    def metadata(self) -> dict[str, str]:
        return {"surgery.quantization": '{"quant_method": "per_tensor_int8", "bits": 8}'}


@pytest.mark.parametrize(
    ("quantizer", "expected"),
    [
        (Described({"quant_method": "mine", "group": 64}), {"quant_method": "mine", "group": 64}),
        (WithMetadata(), {"quant_method": "per_tensor_int8", "bits": 8}),
        (Halves(), {"quant_method": "Halves"}),
    ],
    ids=["hook", "metadata-without-hook", "neither"],
)
def test_a_quantizers_quantization_config_always_names_how_its_tensors_are_stored(
    quantizer: object, expected: dict
) -> None:
    hooks = QuantizerHooks(quantizer)
    assert hooks.quantization_config() == expected
    assert hooks.loads_in_transformers is False  # only a quantizer that says so


@pytest.mark.parametrize(
    ("config", "needle"),
    [
        ({"group": 64}, "string 'quant_method'"),
        ([("quant_method", "mine")], "string 'quant_method'"),
        ({"quant_method": "mine", "scale": torch.ones(1)}, "not JSON"),
    ],
    ids=["no-method", "not-a-dict", "a-tensor-inside"],
)
def test_a_quantization_config_that_config_json_cannot_hold_is_a_configuration_error(
    config: object, needle: str
) -> None:
    with pytest.raises(ConfigurationError, match=rf"Described\.quantization_config\(\).*{needle}"):
        QuantizerHooks(Described(config)).quantization_config()


class Pairs:
    """Stores an ``[N, K]`` weight as ``[N, K/2, 2]`` (a toy packed format): decoding changes the shape."""

    def companions(self, key, info):
        return (key + "_marker",) if key.endswith("weight") else ()

    def stored_region(self, key, region, info):
        return surgery.parallel.Region(region.dim, tuple((a // 2, b // 2) for a, b in region.intervals))

    def decode(self, key, tensor, companions, region=None):
        return tensor.reshape(tensor.shape[0], -1).float()


def test_a_quantizer_with_stored_region_may_decode_to_another_shape(tmp_path: Path) -> None:
    w = torch.arange(16.0).reshape(4, 4)
    write_checkpoint(
        {"weight": w.reshape(4, 2, 2), "weight_marker": torch.ones(1), "bias": torch.ones(4)}, tmp_path
    )
    model = nn.Linear(4, 4)
    report = surgery.load_checkpoint(model, tmp_path, quantizer=Pairs(), strict=True)
    assert report.ok and report.decoded_keys == ["weight"]
    assert torch.equal(model.weight, w)
    with pytest.raises(surgery.ConversionError, match=r"Broken\.decode\('weight'\) turned shape \(4, 2, 2\)"):
        QuantizerHooks(Broken(decode=Pairs().decode)).decode(
            "weight", w.reshape(4, 2, 2), {}, None
        )  # without stored_region: refused


def test_stored_region_must_return_a_region_of_the_same_dim() -> None:
    class Bad(Pairs):
        def stored_region(self, key, region, info):
            return (0, 2)

    hooks = QuantizerHooks(Bad())
    info = surgery.checkpoint.StoredTensor("weight", torch.float32, (4, 2, 2), Path("x"), 0, 64)
    with pytest.raises(surgery.ConfigurationError, match=r"Bad\.stored_region\('weight'\) returned \(0, 2\)"):
        hooks.stored_region("weight", surgery.parallel.Region(1, ((0, 2),)), info)


def test_stored_region_may_name_another_dim_of_the_stored_tensor_but_not_one_it_lacks() -> None:
    """A decode that transposes (gpt-oss MXFP4 blocks) reads its part on another stored dim."""

    class Transposed(Pairs):
        def __init__(self, dim: int) -> None:
            self.dim = dim

        def stored_region(self, key, region, info):
            return surgery.parallel.Region(self.dim, region.intervals)

    info = surgery.checkpoint.StoredTensor("weight", torch.float32, (4, 2, 2), Path("x"), 0, 64)
    region = surgery.parallel.Region(1, ((0, 1),))
    assert QuantizerHooks(Transposed(2)).stored_region("weight", region, info).dim == 2
    with pytest.raises(
        surgery.ConfigurationError, match=r"stored_region\('weight'\) returned .*dim of the stored"
    ):
        QuantizerHooks(Transposed(3)).stored_region("weight", region, info)
