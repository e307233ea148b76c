"""A collective save is distributed, exact, and fails on every rank together; it never hangs.

One spawn of 2 gloo ranks runs every scenario of ``tests/distsave_scenarios.py`` in one process
group whose timeout is 60 s. A rank left waiting on a collective that a failed rank never
enters would wait that long and then raise the timeout instead of the cause; here every rank
raises the failed rank's error (same class, same message, naming the rank and the cause) in a
few seconds. A successful save after all the failures shows that no failure left a collective
half-entered: the ranks are still in step.

One spawn of 4 gloo ranks on a (dp_shard=2, tp=2) mesh saves models parallelized the torchtitan
way (TP, then FSDP2 per layer and at the root; and HSDP): the files equal a single-process save's
byte for byte, each rank writes only the files assigned to it (seen by an audit hook on ``open``),
and no rank allocates more than its local shards plus one group (storages counted by a
``TorchDispatchMode``). The last scenario of each spawn is a save killed before its commit.
"""

from __future__ import annotations

import json
import os
import sys
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


def spawn(run, world: int, work: Path) -> list[dict]:
    """Every rank's facts from ``run`` on ``world`` gloo ranks. The last scenario kills rank 0 in a
    save (see ``killed_save``); the ranks still alive then are waiting for it, and are killed."""
    import signal

    import torch.multiprocessing as mp

    context = mp.spawn(run, args=(world, str(work)), nprocs=world, join=False)
    rank0 = context.processes[0]
    rank0.join(SPAWN_DEADLINE_S)
    for process in context.processes:
        if process.exitcode is None:
            process.kill()
        process.join()
    assert rank0.exitcode == -signal.SIGKILL, f"rank 0 was not killed in its last save: {rank0.exitcode}"
    facts = [json.loads((work / f"rank{r}.json").read_text()) for r in range(world)]
    for f in facts:
        assert "crash" not in f, f["crash"]
    return facts


@pytest.fixture(scope="module")
def spawned(tmp_path_factory) -> tuple[list[dict], Path]:
    work = tmp_path_factory.mktemp("distsave")
    scenarios = _scenarios_module()
    scenarios.write_inputs(work)
    assert scenarios.PG_TIMEOUT_S > 5 * WITHIN_S
    return spawn(scenarios.run, 2, work), work


@pytest.fixture(scope="module")
def ranks(spawned) -> list[dict]:
    return spawned[0]


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


@pytest.mark.skipif(
    not os.access("/proc", os.W_OK), reason="needs a /proc this process may try to write into"
)
def test_a_directory_rank_0_cannot_create_fails_the_save_on_every_rank_without_a_hang(ranks):
    message = _raised_alike(ranks, "directory_cannot_be_created_on_rank_0", "CheckpointError")
    assert "failed on rank 0 of 2" in message and "Cannot create '/proc/surgery-save'" in message


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


# ------------------------------------------------------------------ 4 ranks: FSDP2 over TP, distributed


@pytest.fixture(scope="module")
def mesh_spawned(tmp_path_factory) -> tuple[list[dict], Path]:
    """Every rank's facts from one spawn of 4 gloo ranks on a (dp_shard=2, tp=2) mesh."""
    work = tmp_path_factory.mktemp("distsave-mesh")
    scenarios = _scenarios_module()
    scenarios.write_mesh_inputs(work)
    return spawn(scenarios.run_mesh, 4, work), work


@pytest.fixture(scope="module")
def mesh_ranks(mesh_spawned) -> list[dict]:
    return mesh_spawned[0]


@pytest.mark.parametrize("family", ["dense", "moe", "dense-hsdp"])
def test_a_save_from_fsdp2_over_tp_or_hsdp_writes_the_single_process_files_byte_for_byte(mesh_ranks, family):
    for facts in (r[family] for r in mesh_ranks):
        assert "returned" in facts, facts
        assert facts["identical_to_single"], facts["files"]
        assert len(facts["files"]) > 4  # several tensor files, an index


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_fsdp2_over_tp_gives_strided_shards_whose_local_indices_are_computed_exactly(mesh_ranks, family):
    placements = set(mesh_ranks[0][family]["placements"])
    assert any("_StridedShard" in p for p in placements), placements  # FSDP's dim 0 over TP's
    assert any(p.count("Shard") == 1 and "Replicate" not in p for p in placements)  # the dp_shard sub-mesh
    assert all(r[family]["locals_match"] for r in mesh_ranks)


@pytest.mark.parametrize("family", ["dense", "moe"])
def test_revert_state_dict_from_fsdp2_over_tp_gives_every_rank_the_single_process_tensors(mesh_ranks, family):
    assert all(
        r[family]["reverted_equal"] for r in mesh_ranks
    )  # dense: torch's full_tensor() misplaces gate_up


@pytest.mark.parametrize("family", ["dense", "moe", "dense-hsdp"])
def test_each_rank_writes_exactly_its_assigned_files_and_every_file_is_written_once(mesh_ranks, family):
    from surgery.checkpoint import SAFE_WEIGHTS_INDEX_NAME

    returned = [r[family]["returned"] for r in mesh_ranks]
    staged = [r[family]["staged"] for r in mesh_ranks]
    tensor_files = [f for f in mesh_ranks[0][family]["files"] if f.endswith(".safetensors")]
    for rank, (files, opened) in enumerate(zip(returned, staged)):
        assert files, f"rank {rank} wrote nothing"
        assert sorted(f for f in files if f != SAFE_WEIGHTS_INDEX_NAME) == [
            f for f in opened if f != SAFE_WEIGHTS_INDEX_NAME
        ]
    assert SAFE_WEIGHTS_INDEX_NAME in returned[0] and SAFE_WEIGHTS_INDEX_NAME in staged[0]  # rank 0 commits
    written = sorted(f for files in returned for f in files if f != SAFE_WEIGHTS_INDEX_NAME)
    assert written == sorted(tensor_files)  # disjoint, and together every file


@pytest.mark.parametrize("family", ["dense", "moe", "dense-hsdp"])
def test_no_rank_allocates_more_than_its_local_shards_plus_one_group(mesh_ranks, family):
    for facts in (r[family] for r in mesh_ranks):
        bound = facts["local_bytes"] + facts["largest_group_bytes"]
        assert bound < facts["model_bytes"], facts  # the bound excludes a gather of the model
        assert 0 < facts["peak_bytes"] <= bound, facts


def test_a_conversion_error_on_one_of_4_ranks_is_raised_on_every_rank_and_nothing_is_committed(mesh_ranks):
    facts = [r["conversion_error_on_rank_1_only"] for r in mesh_ranks]
    for f in facts:
        assert f.get("raised") == "ConversionError" and f["elapsed"] < WITHIN_S, f
        assert f["message"] == facts[0]["message"]
        assert not f["target_exists"]
    assert (
        "failed on rank 1 of 4" in facts[0]["message"]
        and "RankRefusal: rank 1 refuses" in facts[0]["message"]
    )


def test_a_write_failing_on_one_of_4_ranks_is_raised_everywhere_and_keeps_the_previous_checkpoint(mesh_ranks):
    facts = [r["write_fails_on_rank_2_only"] for r in mesh_ranks]
    for f in facts:
        assert f.get("raised") == "CheckpointError" and f["elapsed"] < WITHIN_S, f
        assert f["message"] == facts[0]["message"]
        assert f["previous_unchanged"] and f["hidden"] == [], f
    assert "failed on rank 2 of 4" in facts[0]["message"] and "File too large" in facts[0]["message"]


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements"),
    [
        ((8, 6), (2, 2), "S0 S0"),
        ((8, 6), (2, 2), "SS0/2 S0"),
        ((7, 5), (2, 2), "SS0/2 S0"),
        ((9, 5), (3, 2), "SS0/2 S1"),
        ((6, 10), (2, 2), "S1 S1"),
        ((5, 3), (2, 2), "R S0"),
        ((12, 4), (2, 3), "SS0/3 S0"),
        ((3, 4), (2, 2), "SS0/2 S0"),
        ((10, 4, 6), (2, 2, 2), "S2 SS0/2 S0"),
    ],
)
def test_local_indices_agree_with_torchs_own_shard_arithmetic(shape, mesh_shape, placements):
    import itertools

    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    from surgery.parallel.assemble import local_indices

    def parse(p: str):
        if p == "R":
            return Replicate()
        if p.startswith("SS"):
            dim, sf = p[2:].split("/")
            return _StridedShard(int(dim), split_factor=int(sf))
        return Shard(int(p[1:]))

    parsed = [parse(p) for p in placements.split()]
    seen: list[list[tuple[int, ...]]] = []
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        indices = local_indices(shape, mesh_shape, coordinate, parsed)
        local_shape, offset = _compute_local_shape_and_global_offset(
            shape, mesh_shape, list(coordinate), parsed
        )
        assert tuple(len(ix) for ix in indices) == tuple(local_shape), coordinate
        assert tuple(ix[0] if ix else offset[d] for d, ix in enumerate(indices)) == tuple(offset), coordinate
        seen.append(list(itertools.product(*indices)))
    # the shards of the ranks that differ on the sharded mesh dims tile the tensor exactly once
    replicated = [m for m, p in enumerate(parsed) if isinstance(p, Replicate)]
    coords = list(itertools.product(*(range(n) for n in mesh_shape)))
    tiles = [cells for c, cells in zip(coords, seen) if all(c[m] == 0 for m in replicated)]
    cells = sorted(cell for tile in tiles for cell in tile)
    assert cells == sorted(itertools.product(*(range(n) for n in shape)))


def test_files_go_to_ranks_largest_first_to_the_least_loaded_rank():
    from surgery.save.distributed import assign_files

    assert assign_files((10, 40, 30, 20), 2) == (0, 0, 1, 1)  # 40 and 10 on rank 0, 30 and 20 on rank 1
    assert assign_files((5, 5, 5), 4) == (0, 1, 2)
    assert assign_files((), 3) == ()
    owners = assign_files(tuple(range(1, 30)), 4)
    loads = [sum(n for n, o in zip(range(1, 30), owners) if o == r) for r in range(4)]
    assert max(loads) - min(loads) <= 29  # never worse than one file apart


def test_fsdp2_over_a_packed_tp_shard_is_read_as_fsdp2_holds_it_a_chunk_of_what_tp_left():
    from torch.distributed.tensor.placement_types import _StridedShard

    from surgery.parallel.assemble import local_indices

    # TP packed_colwise: each half of 8 rows split over tp=2; FSDP2 then chunks each rank's rows over dp=2
    placements = [_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)]
    got = {(dp, tp): local_indices((8,), (2, 2), (dp, tp), placements)[0] for dp in (0, 1) for tp in (0, 1)}
    assert got == {(0, 0): [0, 1], (1, 0): [4, 5], (0, 1): [2, 3], (1, 1): [6, 7]}


# ------------------------------------------------------------------ killed midway


@pytest.mark.parametrize(
    "fixture",
    ["spawned", "mesh_spawned"],
    ids=["2 ranks, rank 0 killed in its commit", "4 ranks, every rank killed between its file writes"],
)
def test_a_distributed_save_killed_before_its_commit_leaves_the_previous_checkpoint(request, fixture):
    """The spawns' last save is killed: the directory still loads as exactly the previous
    checkpoint, and the next save removes what the killed one left."""
    import torch

    from surgery.checkpoint import LEFTOVER_NAME, open_checkpoint, write_checkpoint

    _, work = request.getfixturevalue(fixture)
    target = work / "killed"
    previous = {k: v for k, v in _scenarios_module().write_killed_inputs(work / "expected").items()}
    left = [p.name for p in target.iterdir() if LEFTOVER_NAME.fullmatch(p.name)]
    assert left, "the kill came after the save had cleaned up"
    with open_checkpoint(target) as reader:
        assert sorted(reader.keys()) == sorted(previous)
        assert all(torch.equal(reader.get_tensor(k), v) for k, v in previous.items())
    write_checkpoint({"w": torch.ones(2)}, target)  # the next save recovers and removes the leftovers
    assert sorted(p.name for p in target.iterdir()) == ["model.safetensors"]


def test_a_dtensor_sharded_by_torch_is_assembled_exactly_on_any_owner_and_nowhere_else(mesh_ranks):
    for rank, facts in enumerate(mesh_ranks):
        cases = facts["assembled_on_every_owner"]
        assert len(cases) == 6 * 4
        assert all(cases.values()), (rank, [k for k, ok in cases.items() if not ok])


@pytest.mark.parametrize("name", ["dense", "dense-fp8"])
def test_a_tp_save_in_several_files_is_shared_by_the_ranks_and_equals_a_single_process_save(ranks, name):
    facts = [r["sharded_saves_are_shared_and_identical"][name] for r in ranks]
    for f in facts:
        assert f["identical_to_single"] and f["files"] > 3, f
        assert f["returned"], f  # every rank wrote files
    written = sorted(n for f in facts for n in f["returned"])
    assert (
        len(written) == len(set(written)) == facts[0]["files"]
    )  # each file once (the source has no config.json to carry)


def test_torch_misreads_only_a_strided_shard_over_a_later_strided_shard_of_the_same_dim():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from surgery.parallel.assemble import torch_misreads

    assert torch_misreads([_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2)])
    assert not torch_misreads([_StridedShard(0, split_factor=2), Shard(0)])  # FSDP2 over plain TP
    assert not torch_misreads([Shard(0), _StridedShard(1, split_factor=2)])
    assert not torch_misreads([Replicate(), _StridedShard(0, split_factor=2)])


def test_the_schedule_computes_a_group_once_per_file_it_spans_in_each_owners_write_order(tmp_path):
    from surgery.checkpoint import write_checkpoint
    from surgery.checkpoint.writer import plan_files
    from surgery.examples import moe
    from surgery.save import RevertedState
    from surgery.save.distributed import assign_files, schedule

    write_checkpoint(moe.original_state_dict(moe.build_moe_model(seed=2)), tmp_path / "ckpt")
    model = moe.build_moe_model(seed=None, device="meta")
    assert surgery.load_checkpoint(model, tmp_path / "ckpt").ok
    state = RevertedState(model)
    plan = plan_files(state, tmp_path / "out", max_shard_size=5000, specs=state.specs)
    owners = assign_files(plan.nbytes, 3)
    runs = schedule(plan, state, owners, 3)
    every = [run for mine in runs for run in mine]
    for rank, mine in enumerate(runs):
        assert [r.file for r in mine] == sorted(r.file for r in mine)  # file by file
        assert all(owners[r.file] == rank for r in mine)
    for run in every:  # one group per run
        assert {state.group_index(k) for k in run.keys} == {run.group}
    for i, keys in enumerate(plan.keys):  # every key once, in its file's write order
        assert [k for run in every if run.file == i for k in run.keys] == list(keys)
    files_of: dict[int, set[int]] = {}
    for run in every:
        assert (run.file, run.group) not in {(r.file, r.group) for r in every if r is not run}
        files_of.setdefault(run.group, set()).add(run.file)
    assert any(len(files) > 1 for files in files_of.values())  # a layer's experts straddle two files


@pytest.mark.parametrize(
    ("shape", "mesh_shape", "placements"),
    [
        ((8, 6), (2, 2), "SS0/2 S0"),
        ((8, 6), (2, 2), "SS0/2 SS0/2"),  # FSDP2 over packed TP
        ((16, 4), (2, 2), "SS0/2 SS0/2"),
        ((8, 6), (2, 2), "S0 S1"),
        ((6, 10), (2, 2), "S1 S1"),
        ((5, 3), (2, 2), "R S0"),
        ((8, 4, 6), (2, 2, 2), "S2 SS0/2 S0"),
    ],
)
def test_the_save_and_the_load_read_placements_alike(shape, mesh_shape, placements):
    """assemble.local_indices (what a save puts where) and plan.local_region (what a load reads)
    are the same arithmetic wherever the load accepts the placements."""
    import itertools
    import math

    import torch
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    from surgery.parallel import local_region
    from surgery.parallel.assemble import local_indices

    def parse(p: str):
        if p == "R":
            return Replicate()
        if p.startswith("SS"):
            dim, sf = p[2:].split("/")
            return _StridedShard(int(dim), split_factor=int(sf))
        return Shard(int(p[1:]))

    parsed = tuple(parse(p) for p in placements.split())
    whole = torch.arange(math.prod(shape)).reshape(shape)
    for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
        region = local_region(parsed, shape, mesh_shape, coordinate)
        loaded = whole if region is None else region.take(whole)
        saved = whole
        for d, ix in enumerate(local_indices(shape, mesh_shape, coordinate, parsed)):
            saved = saved.index_select(d, torch.tensor(ix, dtype=torch.long))
        assert torch.equal(loaded, saved), coordinate
