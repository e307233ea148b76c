"""LoadReport: what counts as a problem, JSON round trip, readable text."""

from __future__ import annotations

import json

import pytest

from surgery.errors import ConfigurationError
from surgery.load.report import ConversionFailure, LoadReport, Mismatch

SHAPE = Mismatch("a.weight", "shape", "(3,)", "(4,)", ("a.weight",), loaded=False)
DTYPE = Mismatch("b.weight", "dtype", "bfloat16", "float32", ("b.weight",), loaded=True)
FAILURE = ConversionFailure("WeightConverter(...)", ("x.0", "x.1"), ("x",), "boom")
CONFLICT = ConversionFailure("routing", ("p", "q"), ("r",), "both land on 'r'")


def full_report() -> LoadReport:
    return LoadReport(
        checkpoint="ckpt/",
        loaded_keys=["b.weight", "c"],
        missing_keys=["d"],
        unexpected_keys=["e"],
        mismatched=[SHAPE, DTYPE],
        conflicts=[CONFLICT],
        conversion_errors=[FAILURE],
        mapped_keys=["c"],
        transforms_used=["WeightRenaming('a' -> 'b', scope_prefix='')"],
        fusions={"patch_embeddings": True},
        seconds=0.25,
    )


def test_an_empty_report_is_ok() -> None:
    assert LoadReport().ok


def test_a_dtype_cast_alone_is_ok() -> None:
    assert LoadReport(mismatched=[DTYPE]).ok


@pytest.mark.parametrize(
    "problem",
    [
        {"missing_keys": ["k"]},
        {"unexpected_keys": ["k"]},
        {"mismatched": [SHAPE]},
        {"conflicts": [CONFLICT]},
        {"conversion_errors": [FAILURE]},
    ],
    ids=["missing", "unexpected", "shape", "conflict", "conversion-error"],
)
def test_every_kind_of_problem_makes_the_report_not_ok(problem: dict) -> None:
    assert not LoadReport(**problem).ok


def test_to_dict_is_plain_json() -> None:
    d = full_report().to_dict()
    assert json.loads(json.dumps(d)) == d
    assert d["ok"] is False
    assert d["mismatched"][0] == {
        "key": "a.weight",
        "kind": "shape",
        "checkpoint": "(3,)",
        "model": "(4,)",
        "source_keys": ["a.weight"],
        "loaded": False,
        "lossy": False,
    }
    assert "plan" not in d


def test_report_round_trips_through_json() -> None:
    report = full_report()
    assert LoadReport.from_json(report.to_json(indent=2)) == report
    assert LoadReport.from_dict(report.to_dict()) == report


def test_from_dict_names_an_unknown_field() -> None:
    with pytest.raises(ConfigurationError, match="surprise"):
        LoadReport.from_dict({"surprise": 1})
    with pytest.raises(ConfigurationError, match="Mismatch"):
        LoadReport.from_dict({"mismatched": ["not a dict"]})


def test_text_form_names_every_problem_and_the_fix_direction() -> None:
    text = str(full_report())
    assert text.splitlines()[0] == "LoadReport(ckpt/): PROBLEMS; 2 loaded (1 memory-mapped) in 0.250s"
    for fragment in (
        "fusions applied: {'patch_embeddings': True}",
        "missing keys (not in the checkpoint, left as they were) (1):",
        "    - d",
        "unexpected keys (in the checkpoint, not in the model) (1):",
        "a.weight: checkpoint shape (3,) vs model (4,) (from a.weight); not loaded",
        "b.weight: checkpoint dtype bfloat16 vs model float32 (from b.weight); loaded with a cast",
        "conflicts (not loaded) (1):",
        "routing: r from p, q: both land on 'r'",
        "WeightConverter(...): x from x.0, x.1: boom",
        "transforms used (1):",
    ):
        assert fragment in text, fragment


def test_long_sections_are_cut_with_a_count() -> None:
    text = str(LoadReport(missing_keys=[f"k{i}" for i in range(25)]))
    assert "    ... 5 more" in text and "k19" in text and "k20" not in text


def test_ok_report_says_ok() -> None:
    assert str(LoadReport(checkpoint="c", loaded_keys=["a"])).startswith("LoadReport(c): OK; 1 loaded")


def test_a_model_no_mapping_applies_to_says_so_next_to_its_missing_keys(tmp_path) -> None:
    import torch
    from torch import nn

    import surgery
    from surgery.checkpoint import write_checkpoint

    write_checkpoint({"w": torch.ones(2, 2), "bias": torch.ones(2)}, tmp_path)
    report = surgery.load_checkpoint(nn.Linear(2, 2), tmp_path)
    (note,) = report.notes
    assert "no conversion mapping applied to Linear" in note and "explain_model_conversion_mapping" in note
    assert "no conversion mapping" in str(report)
