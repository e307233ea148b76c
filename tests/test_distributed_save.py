"""A collective save fails on every rank, with the same error, within seconds; it never hangs.

One spawn of 2 gloo ranks runs every scenario of ``tests/distsave_scenarios.py`` in one process
group whose timeout is 60 s. A rank left waiting on a collective that a failed rank never
enters would wait that long and then raise the timeout instead of the cause; here every rank
raises the failed rank's error (same class, same message, naming the rank and the cause) in a
few seconds. The last scenario, a successful save after all the failures, shows that no failure
left a collective half-entered: the ranks are still in step.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

import surgery
from surgery.checkpoint import check_write_arguments
from surgery.collective import Collective
from surgery.errors import CheckpointError, ConfigurationError, ConversionError
from surgery.examples import dense

pytestmark = pytest.mark.distributed

HERE = Path(__file__).parent
WITHIN_S = 10.0  # "within seconds": a hang lasts the process group's 60 s timeout, then fails differently
SPAWN_DEADLINE_S = 600


def _scenarios_module():
    sys.path.insert(0, str(HERE))
    try:
        import distsave_scenarios
    finally:
        sys.path.remove(str(HERE))
    return distsave_scenarios


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    import torch.multiprocessing as mp

    work = tmp_path_factory.mktemp("distsave")
    scenarios = _scenarios_module()
    scenarios.write_inputs(work)
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
    assert scenarios.PG_TIMEOUT_S > 5 * WITHIN_S
    return facts


def _raised_alike(ranks: list[dict], scenario: str, error: str) -> str:
    """Both ranks raised ``error`` (a SurgeryError) with one message, within seconds; the message."""
    facts = [r[scenario] for r in ranks]
    for f in facts:
        assert f.get("raised") == error, f
        assert f["surgery_error"]
        assert f["elapsed"] < WITHIN_S, f
    assert facts[0]["message"] == facts[1]["message"]
    return facts[0]["message"]


def test_a_path_that_is_a_file_is_refused_by_every_rank_before_any_collective(ranks):
    message = _raised_alike(ranks, "path_is_a_file", "CheckpointError")
    assert "failed on ranks 0, 1 of 2" in message
    assert "a-file' exists and is not a directory" in message
    assert all(r["path_is_a_file"]["file_unchanged"] for r in ranks)


def test_a_path_under_a_file_is_refused_by_every_rank(ranks):
    message = _raised_alike(ranks, "path_under_a_file", "CheckpointError")
    assert "a-file' is a file" in message


def test_a_path_refused_on_rank_1_only_is_raised_on_rank_0_too_before_it_writes(ranks):
    message = _raised_alike(ranks, "path_is_a_file_on_rank_1_only", "CheckpointError")
    assert "failed on rank 1 of 2" in message and "exists and is not a directory" in message
    assert not ranks[0]["path_is_a_file_on_rank_1_only"]["rank0_path_exists"]


def test_a_bad_shard_size_on_one_rank_is_raised_on_every_rank(ranks):
    message = _raised_alike(ranks, "bad_shard_size_on_rank_1_only", "ConfigurationError")
    assert "failed on rank 1 of 2" in message and "Cannot parse size '5 parsecs'" in message
    assert not ranks[0]["bad_shard_size_on_rank_1_only"]["out_exists"]


def test_different_failures_on_two_ranks_raise_the_lowest_ranks_class_and_name_both(ranks):
    message = _raised_alike(ranks, "different_failures_on_both_ranks", "ConfigurationError")
    assert "/out' failed on rank 0 of 2" in message and "Cannot parse size '5 parsecs'" in message
    assert "; rank 1 failed too: " in message and "exists and is not a directory" in message
    assert not ranks[0]["different_failures_on_both_ranks"]["out_exists"]


def test_a_tensor_on_meta_on_one_rank_is_raised_on_every_rank(ranks):
    message = _raised_alike(ranks, "meta_tensor_on_rank_1_only", "CheckpointError")
    assert "failed on rank 1 of 2" in message and "model.norm.weight" in message and "meta" in message
    assert not ranks[0]["meta_tensor_on_rank_1_only"]["out_exists"]


def test_a_failing_write_on_rank_0_is_raised_on_every_rank_and_keeps_the_previous_checkpoint(ranks):
    message = _raised_alike(ranks, "rank_0_write_fails", "CheckpointError")
    assert "failed on rank 0 of 2" in message and "File too large" in message
    facts = ranks[0]["rank_0_write_fails"]
    assert facts["previous_size"] > 16 * 1024  # the limit cut the file in the middle
    assert all(r["rank_0_write_fails"]["previous_unchanged"] for r in ranks)


def test_a_conversion_error_on_rank_1_only_is_raised_on_every_rank_and_nothing_is_committed(ranks):
    message = _raised_alike(ranks, "conversion_error_on_rank_1_only", "ConversionError")
    assert "failed on rank 1 of 2" in message and "RankRefusal: rank 1 refuses" in message
    assert "ab.weight" in message
    assert not ranks[0]["conversion_error_on_rank_1_only"]["target_exists"]


def test_a_conversion_error_on_rank_1_in_the_last_group_stops_rank_0_before_it_commits(ranks):
    message = _raised_alike(ranks, "conversion_error_on_rank_1_only_in_the_last_group", "ConversionError")
    assert "failed on rank 1 of 2" in message and "RankRefusal: rank 1 refuses" in message
    assert not ranks[0]["conversion_error_on_rank_1_only_in_the_last_group"]["target_exists"]


def test_an_error_outside_surgery_on_one_rank_is_a_surgery_error_on_every_rank(ranks):
    message = _raised_alike(ranks, "foreign_error_in_a_step_on_rank_1_only", "SurgeryError")
    assert (
        message
        == "a step failed on rank 1 of 2 (every rank raises this): RuntimeError: rank 1 ran out of luck"
    )
    assert ranks[1]["foreign_error_in_a_step_on_rank_1_only"]["cause"] == ["RuntimeError"]  # chained


def test_ctrl_c_on_one_rank_stays_ctrl_c_there_and_is_a_surgery_error_elsewhere(ranks):
    assert ranks[1]["ctrl_c_in_a_step_on_rank_1_only"] == {"raised": "KeyboardInterrupt"}
    facts = ranks[0]["ctrl_c_in_a_step_on_rank_1_only"]
    assert facts["raised"] == "SurgeryError" and facts["elapsed"] < WITHIN_S
    assert facts["message"] == "a step failed on rank 1 of 2 (every rank raises this): KeyboardInterrupt"


def test_revert_state_dict_failing_on_one_rank_is_raised_on_every_rank(ranks):
    message = _raised_alike(ranks, "revert_fails_on_rank_1_only", "ConversionError")
    assert message.startswith("revert_state_dict failed on rank 1 of 2")


def test_after_every_failure_the_ranks_are_still_in_step_and_a_save_writes_the_original(ranks):
    rank0, rank1 = (r["then_a_save_succeeds"] for r in ranks)
    assert rank0["returned"] == ["model.safetensors"] and rank1["returned"] == []
    assert rank0["identical_to_the_original"]
    assert rank1["identical_to_the_original"]  # rank 1 returns once rank 0's files are in place


@pytest.mark.parametrize(
    ("path", "kwargs", "error", "needle"),
    [
        ("a-file", {}, CheckpointError, "exists and is not a directory"),
        ("a-file/out", {}, CheckpointError, "is a file, so"),
        ("dir/model.safetensors", {}, CheckpointError, "is a directory; pass the directory"),
        ("out", {"max_shard_size": 0}, ConfigurationError, "must be positive"),
        ("out", {"metadata": {"format": "np"}}, CheckpointError, "always 'pt'"),
    ],
    ids=["file", "under-a-file", "directory-as-file", "shard-size", "metadata"],
)
def test_write_arguments_are_checked_without_touching_the_disk(tmp_path, path, kwargs, error, needle):
    (tmp_path / "a-file").write_text("x")
    (tmp_path / "dir" / "model.safetensors").mkdir(parents=True)
    before = sorted(p.name for p in tmp_path.rglob("*"))
    with pytest.raises(error, match=needle.replace(".", r"\.")):
        check_write_arguments(tmp_path / path, **kwargs)
    assert sorted(p.name for p in tmp_path.rglob("*")) == before


def test_in_one_process_a_step_lets_an_error_through_unchanged_and_the_next_step_runs():
    collective = Collective(None, what="a step")
    error = ConversionError("the original")
    with pytest.raises(ConversionError) as raised, collective.step():
        raise error
    assert raised.value is error
    with collective.step():
        pass
    collective.agree()


def test_a_single_process_save_raises_the_writers_own_error_before_computing_anything(tmp_path):
    (tmp_path / "a-file").write_text("x")
    model = dense.build_dense_model(device="meta")  # nothing to compute: every tensor is on meta
    with pytest.raises(CheckpointError) as raised:
        surgery.save_checkpoint(model, tmp_path / "a-file")
    assert (
        str(raised.value)
        == f"'{tmp_path / 'a-file'}' exists and is not a directory; pass a directory or a .safetensors path."
    )
