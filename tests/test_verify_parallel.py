"""``surgery verify`` from a tensor-parallel launch: each rank audits its share, all get one card.

The session's one 2-rank spawn (``tests/tp2_scenarios.py``) runs every scenario of
``tests/verify_tp_scenarios.py`` (a spawn costs seconds, so they share it); one ``torchrun`` launch covers ``surgery verify --tp 2`` with the
process group initialized from torchrun's environment. Specification: an exact round trip is
identical on every rank, with the same card as an audit in one process; a perturbed tensor
makes every rank exit 1 and the card name it; a failure on one rank is raised on every rank,
naming that rank and its cause, and leaves the ranks in step for the next audit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from verify_tp_scenarios import PERTURBED

import surgery
from surgery.examples import dense

pytestmark = pytest.mark.distributed

TP2 = ("verify", ())  # every scenario, in the session's one 2-rank spawn (tests/tp2_scenarios.py)


@pytest.fixture(scope="module")
def ranks(tp2_ranks: list[dict[str, dict]]) -> list[dict]:
    return [r["verify"] for r in tp2_ranks]


@pytest.fixture(scope="module")
def work(ranks: list[dict], tp2_work: Path) -> Path:
    """The folder the spawn's verify scenarios read (``tests/verify_tp_scenarios.write_inputs``)."""
    return tp2_work / "verify"


def _verdicts(card: dict) -> dict:
    """The card without what a parallel audit may say otherwise: times, ranks, how each key loaded."""
    return {k: v for k, v in card.items() if k not in ("seconds", "ranks", "load_modes")}


def test_an_exact_round_trip_is_identical_and_every_rank_holds_the_same_card(ranks: list[dict]) -> None:
    card, other = (r["identical"]["card"] for r in ranks)
    assert card["ok"] and card["ranks"] == 2
    assert card["counts"] == {"identical": len(card["tensors"])}
    assert card["idempotent"] and card["runtime_identical"]
    assert card == other


def test_the_parallel_card_equals_the_card_of_an_audit_in_one_process(ranks: list[dict], work: Path) -> None:
    alone = surgery.verify(lambda: dense.build_dense_model(seed=None), work / "dense").to_dict()
    assert alone["ranks"] == 1
    parallel = ranks[0]["identical"]["card"]
    assert _verdicts(parallel) == _verdicts(alone)  # every tensor, hash and verdict
    assert parallel["load_modes"].keys() == alone["load_modes"].keys()


def test_the_cli_under_tp_exits_0_on_every_rank_and_rank_0_prints_and_writes_the_card(
    ranks: list[dict], work: Path
) -> None:
    first, second = (r["cli_identical"] for r in ranks)
    assert first["rc"] == second["rc"] == 0, first
    assert first["out"].splitlines()[0].endswith("OK (21 identical)")
    assert second["out"] == "" and second["err"] == ""
    assert json.loads((work / "card.json").read_text())["ranks"] == 2


def test_a_perturbed_tensor_exits_1_on_every_rank_and_is_named(ranks: list[dict]) -> None:
    first, second = (r["cli_perturbed"] for r in ranks)
    assert first["rc"] == second["rc"] == 1
    lines = first["out"].splitlines()
    assert "DIFFERENT (1 changed, 20 identical)" in lines[0]
    assert lines[1].startswith(f"  changed     {PERTURBED}  float32")


def test_a_failure_on_one_rank_is_raised_on_every_rank_naming_the_rank_and_the_cause(
    ranks: list[dict],
) -> None:
    facts = [r["build_fails_on_rank_1_only"] for r in ranks]
    assert [f["raised"] for f in facts] == ["ConfigurationError", "ConfigurationError"]
    assert facts[0]["message"] == facts[1]["message"]
    assert "failed on rank 1 of 2" in facts[0]["message"]
    assert "rank 1 cannot build the model" in facts[0]["message"]


def test_a_failure_in_one_ranks_share_of_the_audit_is_raised_on_every_rank(ranks: list[dict]) -> None:
    facts = [r["output_missing_on_rank_1_only"] for r in ranks]
    assert [f["raised"] for f in facts] == ["CheckpointError", "CheckpointError"]
    assert facts[0]["message"] == facts[1]["message"]
    assert "failed on rank 1 of 2" in facts[0]["message"] and "nowhere" in facts[0]["message"]


def test_after_the_failures_the_ranks_are_in_step_and_a_sharded_audit_passes(ranks: list[dict]) -> None:
    card, other = (r["then_an_audit_passes"]["card"] for r in ranks)
    assert card["ok"], card
    assert card == other


def test_surgery_verify_tp_under_torchrun(work: Path, tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
        "-m",
        "surgery",
        "verify",
        str(work / "dense"),
        "--model",
        "example-dense",
        "--tp",
        "2",
        "--json",
        str(tmp_path / "card.json"),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("OK (21 identical)") == 1  # rank 0 prints the card, rank 1 nothing
    card = json.loads((tmp_path / "card.json").read_text())
    assert card["ok"] and card["ranks"] == 2


def test_tp_outside_a_parallel_launch_exits_2_saying_how_to_launch(
    work: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from surgery.cli import main

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["verify", str(work / "dense"), "--model", "example-dense", "--tp", "2"]) == 2
    err = capsys.readouterr().err
    assert "torchrun --nproc-per-node 2 -m surgery verify ... --tp 2" in err
