"""``surgery verify`` from a tensor-parallel launch: each rank audits its share, all get one card.

One spawn of 2 gloo ranks runs every scenario of ``tests/verify_tp_scenarios.py`` (a spawn costs
seconds, so they share it); one ``torchrun`` launch covers ``surgery verify --tp 2`` with the
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
import time
from pathlib import Path

import pytest

import surgery
from surgery.examples import dense

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
SPAWN_DEADLINE_S = 600


def _scenarios_module():
    sys.path.insert(0, str(HERE))
    try:
        import verify_tp_scenarios
    finally:
        sys.path.remove(str(HERE))
    return verify_tp_scenarios


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("verify-tp")
    _scenarios_module().write_inputs(work)
    return work


@pytest.fixture(scope="module")
def ranks(work: Path) -> list[dict]:
    import torch.multiprocessing as mp

    scenarios = _scenarios_module()
    context = mp.spawn(scenarios.run, args=(2, str(work)), nprocs=2, join=False)
    deadline = time.monotonic() + SPAWN_DEADLINE_S
    while not context.join(timeout=max(deadline - time.monotonic(), 0)):  # True once every rank exited
        if time.monotonic() >= deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the ranks did not finish within {SPAWN_DEADLINE_S} s")
    facts = [json.loads((work / f"rank{r}.json").read_text()) for r in range(2)]
    for f in facts:
        assert "crash" not in f, f["crash"]
    return facts


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
    scenarios = _scenarios_module()
    first, second = (r["cli_perturbed"] for r in ranks)
    assert first["rc"] == second["rc"] == 1
    lines = first["out"].splitlines()
    assert "DIFFERENT (1 changed, 20 identical)" in lines[0]
    assert lines[1].startswith(f"  changed     {scenarios.PERTURBED}  float32")


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
