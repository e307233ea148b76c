"""``surgery verify`` / :func:`surgery.verify`: the audit of a load -> save round trip.

Specification: a round trip that keeps every bit exits 0 with every tensor ``identical``; a
conversion that changed anything (a tensor modified between load and save, a dropped tensor, a
lossy dtype) exits 1 and names the tensor; errors exit 2; the JSON card validates against the
schema the docs publish (``docs/verify-card.schema.json``).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from fp8_reference import quantize
from json_schema_subset import schema_errors
from torch import nn

import surgery
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.cli import _parser, main
from surgery.examples import decoder, dense, moe, vision
from surgery.quantization import FP8BlockQuantizer

SCHEMA = json.loads((Path(__file__).parents[1] / "docs" / "verify-card.schema.json").read_text())

# name -> (factory, --model, the original checkpoint's state dict, fusion config)
EXAMPLES: dict[
    str, tuple[Callable[[], nn.Module], str, Callable[[], dict[str, torch.Tensor]], dict | None]
] = {
    "moe": (
        moe.build_moe_model,
        "example-moe",
        lambda: moe.original_state_dict(moe.build_moe_model(seed=3)),
        None,
    ),
    "dense": (
        dense.build_dense_model,
        "example-dense",
        lambda: dense.original_state_dict(dense.build_dense_model(seed=3)),
        None,
    ),
    "decoder": (
        decoder.build_decoder_model,
        "example-decoder",
        lambda: dict(decoder.build_decoder_model(seed=3).state_dict()),
        None,
    ),
    "vision-fused": (
        vision.build_vision_tower,
        "example-vision",
        lambda: {k: v.clone() for k, v in vision.build_vision_tower(seed=3).state_dict().items()},
        {"patch_embeddings": True},
    ),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One original-layout checkpoint per example model, written once for the module."""
    root = tmp_path_factory.mktemp("verify-sources")
    out = {}
    for name, (_, _, state, _) in EXAMPLES.items():
        write_checkpoint(state(), root / name)
        out[name] = root / name
    return out


def tensors(path: Path) -> dict[str, torch.Tensor]:
    with open_checkpoint(path) as reader:
        return {k: reader.get_tensor(k) for k in reader.keys()}  # noqa: SIM118 (the reader is not a dict)


def cli(*argv: str | Path, capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    rc = main(["verify", *map(str, argv)])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


# --------------------------------------------------------------------------- identical round trips


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_an_exact_round_trip_of_each_example_model_is_identical_tensor_by_tensor(
    name: str, sources: dict[str, Path]
) -> None:
    factory, _, state, fusion = EXAMPLES[name]
    card = surgery.verify(factory, sources[name], fusion_config=fusion)
    assert card.ok, card.render()
    assert {t.verdict for t in card.tensors} == {"identical"}
    assert [t.name for t in card.tensors] == sorted(state())
    assert all(t.sha256 == t.output_sha256 and t.sha256 is not None for t in card.tensors)
    assert card.idempotent and card.runtime_identical and not card.load_problems
    assert set(card.seconds) == {"load", "save", "reload", "resave", "compare"}


def test_the_fused_model_reports_its_converted_keys_and_a_model_instance_is_loaded_twice(
    sources: dict[str, Path],
) -> None:
    card = surgery.verify(
        vision.build_vision_tower(), sources["vision-fused"], fusion_config={"patch_embeddings": True}
    )
    assert card.ok, card.render()
    assert "converted" in card.load_modes.values()  # the Conv3d -> Linear weight
    assert "direct" in card.load_modes.values()


def test_the_cli_exits_0_and_writes_a_card_that_validates_against_the_published_schema(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(
        sources["moe"], "--model", "example-moe", "--json", tmp_path / "card.json", capsys=capsys
    )
    assert rc == 0, out
    assert out.splitlines()[0].endswith("OK (41 identical)")
    card = json.loads((tmp_path / "card.json").read_text())
    assert schema_errors(card, SCHEMA) == []
    assert card["ok"] is True and card["counts"] == {"identical": 41}
    assert card["versions"]["torch"] == torch.__version__
    assert set(card["load_modes"].values()) <= {"direct", "converted", "decoded"}


def test_the_schema_validator_rejects_a_card_that_breaks_the_schema(sources: dict[str, Path]) -> None:
    card = surgery.verify(moe.build_moe_model, sources["moe"]).to_dict()
    assert schema_errors(card, SCHEMA) == []
    card["tensors"][0]["verdict"] = "similar"
    card["tensors"][1]["sha256"] = "not-a-hash"
    del card["idempotent"]
    card["surprise"] = 1
    errors = schema_errors(card, SCHEMA)
    assert "$.tensors[0].verdict: 'similar' is not one of" in "\n".join(errors)
    assert any(e.startswith("$.tensors[1].sha256:") for e in errors)
    assert "$: required 'idempotent' is missing" in errors
    assert "$: property 'surprise' is not allowed" in errors


def test_an_fp8_checkpoint_is_decoded_and_re_encoded_bit_for_bit(tmp_path: Path) -> None:
    torch.manual_seed(0)
    q, scale = quantize(torch.randn(256, 384) * 0.05, (128, 128))
    write_checkpoint(
        {"weight": q, "weight_scale_inv": scale, "bias": torch.randn(256).bfloat16()}, tmp_path / "fp8"
    )

    def linear() -> nn.Module:
        return nn.Linear(384, 256, dtype=torch.bfloat16)

    card = surgery.verify(linear, tmp_path / "fp8", quantizer=FP8BlockQuantizer())
    assert card.ok, card.render()
    assert {t.name: t.dtype for t in card.tensors} == {
        "bias": "bfloat16",
        "weight": "float8_e4m3fn",
        "weight_scale_inv": "float32",
    }
    assert card.load_modes["weight"] == "decoded"


def test_changed_fp8_codes_are_requantized_which_only_allow_requantize_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    torch.manual_seed(0)
    q, scale = quantize(torch.randn(128, 128) * 0.05, (128, 128))
    write_checkpoint({"weight": q, "weight_scale_inv": scale}, tmp_path / "fp8")
    codes = q.view(torch.uint8).clone()
    codes[0, 0] ^= 1  # one code one step away
    write_checkpoint({"weight": codes.view(q.dtype), "weight_scale_inv": scale}, tmp_path / "requantized")
    (tmp_path / "model.py").write_text(
        "import torch\nfrom torch import nn\n\ndef build():\n    return nn.Linear(128, 128, bias=False, dtype=torch.bfloat16)\n"
    )
    args = (
        tmp_path / "fp8",
        "--model",
        "model:build",
        "--quantization",
        "fp8",
        "--output",
        tmp_path / "requantized",
    )
    import sys

    sys.path.insert(0, str(tmp_path))
    try:
        rc, out, _ = cli(*args, capsys=capsys)
        assert rc == 1
        assert "  requantized weight  float8_e4m3fn(128, 128)" in out
        rc, out, _ = cli(*args, "--allow", "requantize", capsys=capsys)
        assert rc == 0, out
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("model", None)


# --------------------------------------------------------------------------- differences exit 1


def test_a_tensor_modified_between_load_and_save_exits_1_and_is_named(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = moe.build_moe_model()
    surgery.load_checkpoint(model, sources["moe"])
    with torch.no_grad():
        model.model.layers[1].self_attn.o_proj.weight[0, 0] += 1e-3
    surgery.save_checkpoint(model, tmp_path / "converted")

    rc, out, _ = cli(
        sources["moe"], "--model", "example-moe", "--output", tmp_path / "converted", capsys=capsys
    )
    assert rc == 1
    odd = out.splitlines()[1:-1]
    assert odd == ["  changed     model.layers.1.self_attn.o_proj.weight  float32(16, 16) -> float32(16, 16)"]
    assert "DIFFERENT (1 changed, 40 identical)" in out


def test_a_dropped_tensor_exits_1_and_is_named_missing(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tensors(sources["dense"])
    dropped = sorted(state)[3]
    write_checkpoint({k: v for k, v in state.items() if k != dropped}, tmp_path / "dropped")

    rc, out, _ = cli(
        sources["dense"],
        "--model",
        "example-dense",
        "--output",
        tmp_path / "dropped",
        "--json",
        tmp_path / "c.json",
        capsys=capsys,
    )
    assert rc == 1
    assert f"  missing     {dropped}" in out
    card = json.loads((tmp_path / "c.json").read_text())
    assert schema_errors(card, SCHEMA) == []
    (missing,) = [t for t in card["tensors"] if t["verdict"] != "identical"]
    assert missing["name"] == dropped and missing["output_sha256"] is None


def test_a_model_that_drops_a_tensor_at_load_exits_1_naming_it(sources: dict[str, Path]) -> None:
    def without_lm_head() -> nn.Module:
        model = moe.build_moe_model()
        del model.lm_head
        model.lm_head = nn.Identity()
        return model

    card = surgery.verify(without_lm_head, sources["moe"])
    assert not card.ok
    assert [(t.name, t.verdict) for t in card.tensors if t.verdict != "identical"] == [
        ("lm_head.weight", "missing")
    ]
    assert "unexpected: lm_head.weight" in card.load_problems


def test_a_lossy_load_dtype_exits_1_naming_every_tensor_it_changed(
    sources: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    rc, out, _ = cli(
        sources["moe"], "--model", "example-moe", "--dtype", "float16", "--limit", "3", capsys=capsys
    )
    assert rc == 1
    lines = out.splitlines()
    assert lines[1].startswith("  changed     lm_head.weight  float32(64, 16)")
    assert len([ln for ln in lines if ln.startswith("  changed ")]) == 3  # capped by --limit ...
    assert "... and 33 more non-identical tensor(s)" in out  # ... with the count of the rest


def test_an_output_in_another_dtype_is_a_cast_that_only_allow_cast_accepts(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = tensors(sources["dense"])
    write_checkpoint({k: v.bfloat16() for k, v in state.items()}, tmp_path / "bf16")
    args = (sources["dense"], "--model", "example-dense", "--output", tmp_path / "bf16")

    rc, out, _ = cli(*args, capsys=capsys)
    assert rc == 1
    assert f"DIFFERENT ({len(state)} cast)" in out
    assert f"  cast        {sorted(state)[0]}  float32" in out and "-> bfloat16" in out

    rc, out, _ = cli(*args, "--allow", "cast", capsys=capsys)
    assert rc == 0, out
    assert "(allowed)" in out


# --------------------------------------------------------------------------- errors exit 2, options


def test_errors_exit_2_with_one_line_naming_the_problem(
    sources: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rc, _, err = cli(tmp_path / "nowhere", "--model", "example-moe", capsys=capsys)
    assert rc == 2 and "nowhere" in err
    with pytest.raises(surgery.ConfigurationError, match="'bits' is not one of cast, requantize"):
        surgery.verify(moe.build_moe_model, sources["moe"], allow=["bits"])


def test_the_help_lists_every_option() -> None:
    parser = _parser()
    verify_parser = next(
        a
        for a in parser._subparsers._group_actions[0].choices.items()
        if a[0] == "verify"  # type: ignore[union-attr]
    )[1]
    text = verify_parser.format_help()
    options = [s for a in verify_parser._actions for s in a.option_strings]
    for wanted in (
        "--model",
        "--fusion",
        "--quantization",
        "--allow",
        "--json",
        "--output",
        "--dtype",
    ):
        assert wanted in options
    assert [o for o in options if o not in text] == []
    assert "exit 0 identical, 1 different, 2 error" in " ".join(parser.format_help().split())
    assert "Exit status: 0 when every tensor is identical" in " ".join(text.split())
