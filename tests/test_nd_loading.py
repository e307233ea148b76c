"""Loading into models parallelized on n-D device meshes, the torchtitan way, on 4 gloo ranks (CPU).

The session's one 4-rank spawn (``tests/mesh_scenarios.py``) runs every scenario of ``tests/nd_scenarios.py``:
meshes ``dp_shard=2 x tp=2``, ``tp=4``, ``dp_shard=4`` and ``dp_replicate=2 x dp_shard=2`` (HSDP),
the dense and Mixtral-style examples built on meta, ``parallelize_module`` on ``mesh["tp"]`` then
``fully_shard`` per decoder layer and at the root, then ``load_checkpoint`` with no ``tp_plan``.
Every rank's local tensors equal what torch's own flow holds (the single-process load copied,
parallelized and sharded by torch), the forward matches the single-process forward, each rank
reads only its own bytes, and no data collective runs during the load (only the
ranks' agreement flags). DCP's
``HuggingFaceStorageReader`` reads the same 1:1 keys into the same placements.

The placement arithmetic itself (:func:`surgery.parallel.local_region`) is checked without
processes against torch's own split functions over random shapes, meshes and placements.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from surgery.errors import ConfigurationError
from surgery.parallel import local_region
from surgery.parallel.regions import Box, Region

HERE = Path(__file__).parent
CASES = [
    f"{mesh}/{family}"
    for mesh in ("dp_shard2_tp2", "tp4", "dp_shard4", "hsdp2x2")
    for family in ("dense", "moe")
]
DATA_COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "broadcast",
    "scatter",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
}


# --------------------------------------------------------------------------- placement arithmetic


def _torch_local(full: torch.Tensor, placements, mesh_shape, coord) -> torch.Tensor:
    """What ``distribute_tensor`` gives a rank: each mesh dim's split, left to right (torch's own)."""
    t = full
    for p, n, c in zip(placements, mesh_shape, coord):
        if hasattr(p, "dim"):  # Shard or _StridedShard
            t = p._split_tensor(t, n, with_padding=False)[0][c]
    return t


@st.composite
def _layouts(draw):
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    ndim = draw(st.integers(1, 3))
    mesh_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=1, max_size=3)))
    placements = []
    for _ in mesh_shape:
        kind = draw(st.sampled_from(["replicate", "shard", "strided"]))
        dim = draw(st.integers(0, ndim - 1))
        if kind == "replicate":
            placements.append(Replicate())
        elif kind == "shard":
            placements.append(Shard(dim))
        else:
            placements.append(_StridedShard(dim, split_factor=draw(st.integers(1, 3))))
    shape = []
    for d in range(ndim):  # divisible by everything that cuts it, times a little slack for uneven Shard
        factor = 1
        for p, n in zip(placements, mesh_shape):
            if hasattr(p, "dim") and p.dim == d:
                factor *= n * getattr(p, "split_factor", 1)
        shape.append(factor * draw(st.integers(1, 3)))
    coord = tuple(draw(st.integers(0, n - 1)) for n in mesh_shape)
    return tuple(shape), mesh_shape, tuple(placements), coord


@settings(max_examples=300, deadline=None)
@given(_layouts())
def test_local_region_is_torchs_split_over_any_mesh_and_placements(layout):
    from torch.distributed.tensor.placement_types import _StridedShard

    shape, mesh_shape, placements, coord = layout
    full = torch.arange(int(torch.tensor(shape).prod())).reshape(shape)
    region = local_region(placements, shape, mesh_shape, coord)
    ours = full if region is None else region.take(full)
    strided_over_strided = any(
        isinstance(p, _StridedShard)
        and any(isinstance(q, _StridedShard) and q.dim == p.dim for q in placements[i + 1 :])
        for i, p in enumerate(placements)
    )
    if not strided_over_strided:  # FSDP2 over a packed shard follows FSDP2's data (next test)
        assert torch.equal(ours, _torch_local(full, placements, mesh_shape, coord))
    assert isinstance(region, (Region, Box, type(None)))


def test_fsdp_over_a_packed_shard_is_the_dp_chunk_of_the_tp_shard():
    """FSDP2 over ``packed_colwise`` declares ``(_StridedShard(0, 2), _StridedShard(0, 2))``; it
    holds the dp chunk of each TP rank's ``[G_r | U_r]``, and that is what a rank reads."""
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = (_StridedShard(0, split_factor=2), _StridedShard(0, split_factor=2))
    rows = {c: local_region(placements, (64, 16), (2, 2), c) for c in [(0, 0), (0, 1), (1, 0), (1, 1)]}
    assert rows[(0, 0)] == Region(0, ((0, 16),))  # G_0
    assert rows[(1, 0)] == Region(0, ((32, 48),))  # U_0
    assert rows[(0, 1)] == Region(0, ((16, 32),))  # G_1
    assert rows[(1, 1)] == Region(0, ((48, 64),))  # U_1


def test_a_tensor_cut_on_two_dims_is_a_box_and_a_mismatched_mesh_is_refused():
    from torch.distributed.tensor import Partial, Shard

    box = local_region((Shard(0), Shard(1)), (4, 8), (2, 2), (1, 0), name="w")
    assert box == Box((Region(0, ((2, 4),)), Region(1, ((0, 4),))))
    with pytest.raises(ConfigurationError, match="do not fit a mesh of shape"):
        local_region((Shard(0),), (4, 8), (2, 2), (1, 0), name="w")
    with pytest.raises(ConfigurationError, match="'w': placement Partial"):
        local_region((Partial(), Shard(0)), (4, 8), (2, 2), (0, 0), name="'w'")


# --------------------------------------------------------------------------- 4 spawned ranks


@pytest.fixture(scope="module")
def ranks(mesh4_ranks) -> list[dict]:
    return [r["nd"] for r in mesh4_ranks]


def _facts(ranks: list[dict], case: str) -> list[dict]:
    out = [r[case] for r in ranks]
    for f in out:
        assert "error" not in f, f["error"]
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_every_local_tensor_is_what_torchs_own_flow_holds(ranks, case):
    for f in _facts(ranks, case):
        assert f["ok"]
        assert f["unequal"] == []
        assert f["fallbacks"] == []


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_the_forward_matches_the_single_process_forward(ranks, case):
    for f in _facts(ranks, case):
        assert f["forward_max_diff"] <= 1e-5


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_each_rank_reads_only_its_shards_and_the_replicated_tensors(ranks, case):
    for f in _facts(ranks, case):
        assert f["bytes_read"] <= 1.05 * (f["local_bytes"] + f["replicated_bytes"])
        assert f["bytes_read"] >= f["local_bytes"]


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_no_data_collective_runs_during_the_load(ranks, case):
    counts = [f["collectives"] for f in _facts(ranks, case)]
    for c in counts:
        assert not DATA_COLLECTIVES & set(c), c
        assert sum(c.values()) <= 4, c
    same_mesh = [
        f["collectives"] for r in ranks for k, f in r.items() if k.split("/")[0] == case.split("/")[0]
    ]
    assert all(c == same_mesh[0] for c in same_mesh)  # the same for the small and the larger model


@pytest.mark.distributed
@pytest.mark.parametrize("family", ["dense", "moe"])
def test_a_load_through_the_staging_ring_reads_each_ranks_boxes_in_pieces(ranks, family):
    for f, base in zip(_facts(ranks, f"staged/{family}"), _facts(ranks, f"dp_shard2_tp2/{family}")):
        assert f["ok"] and f["unequal"] == [] and f["unlike_placements"] == base["unlike_placements"]
        assert f["forward_max_diff"] <= 1e-5
        assert f["bytes_read"] == base["bytes_read"] == f["staged_bytes"]
        assert not DATA_COLLECTIVES & set(f["collectives"])


@pytest.mark.distributed
def test_a_staged_block_fp8_load_decodes_each_ranks_box_after_the_copy(ranks):
    for f in _facts(ranks, "staged/fp8"):
        assert f["ok"] and f["unequal"] == [] and f["staged_bytes"] > 0
        assert f["forward_max_diff"] <= 1e-5


@pytest.mark.distributed
def test_fsdp_over_tp_nests_shards_on_one_dim_and_cuts_rowwise_weights_on_two(ranks):
    placements = _facts(ranks, "dp_shard2_tp2/dense")[0]["placements"]
    assert placements["model.layers.0.self_attn.q_proj.weight"] == [
        "_StridedShard(dim=0, sf=2)",
        "Shard(dim=0)",
    ]
    assert placements["model.layers.0.mlp.down_proj.weight"] == ["Shard(dim=0)", "Shard(dim=1)"]
    assert placements["model.layers.0.input_layernorm.weight"] == ["Shard(dim=0)"]  # on the 1-D dp_shard mesh
    moe = _facts(ranks, "dp_shard2_tp2/moe")[0]["placements"]
    assert moe["model.layers.0.mlp.experts.down_proj"] == ["Shard(dim=0)", "Shard(dim=2)"]


@pytest.mark.distributed
def test_only_fsdp_over_a_packed_shard_departs_from_torchs_declared_placements(ranks):
    """torch 2.13's FSDP2 declares placements for a packed TP shard that its data does not follow
    (its own ``full_tensor()`` of the model it sharded from real weights is wrong there); the load
    follows the data (the forward is exact), and nothing else departs."""
    packed = ["model.layers.0.mlp.gate_up_proj.weight", "model.layers.1.mlp.gate_up_proj.weight"]
    for case in CASES:
        for f in _facts(ranks, case):
            expected = packed if case == "dp_shard2_tp2/dense" else []
            assert f["unlike_placements"] == expected, case
            assert f["flow_full_tensor_wrong"] == expected, case


@pytest.mark.distributed
def test_dcp_huggingface_reader_reads_the_same_slices_into_the_same_placements(ranks):
    for f in _facts(ranks, "oracle"):
        assert f["unequal"] == []
        assert "(Shard(dim=0), Shard(dim=1))" in f["placements"]


@pytest.mark.distributed
def test_an_uneven_strided_shard_on_a_2d_mesh_is_refused_naming_parameter_dim_size_and_mesh_dim(ranks):
    for f in _facts(ranks, "bad_input"):
        assert f["raised"] == "ConfigurationError"
        assert "'proj.weight'" in f["message"]
        assert "dim 0 of size 8" in f["message"] and "mesh dim 0 of size 2" in f["message"]


@pytest.mark.distributed
def test_a_box_behind_an_op_without_a_slice_rule_is_read_whole_reported_and_exact(ranks):
    for f in _facts(ranks, "box_without_rule"):
        assert f["ok"] and f["equal"]
        assert f["fallbacks"] == [[["proj.weight"], "Doubled(2.0)"]]
        assert f["bytes_read"] == 6 * 8 * 4


# --------------------------------------------------------------------------- reading and tracing a box


def test_read_box_reads_the_product_of_the_cuts_and_counts_only_its_bytes(tmp_path):
    from surgery.checkpoint import open_checkpoint, write_checkpoint
    from surgery.errors import CheckpointError

    full = torch.arange(6 * 8 * 2, dtype=torch.float32).reshape(6, 8, 2)
    write_checkpoint({"w": full}, tmp_path / "ckpt")
    with open_checkpoint(tmp_path / "ckpt") as reader:
        got = reader.read_box("w", [(0, [(1, 3), (4, 5)]), (1, [(2, 6)])])
        assert torch.equal(got, full[[1, 2, 4]][:, 2:6])
        assert reader.bytes_read == got.numel() * 4
        out = torch.empty(3, 4, 2)
        assert reader.read_box("w", [(0, [(0, 3)]), (-2, [(4, 8)])], out=out) is out
        assert torch.equal(out, full[0:3, 4:8])
        with pytest.raises(CheckpointError, match=r"must be sorted, disjoint and within 0\.\.8"):
            reader.read_box("w", [(0, [(0, 3)]), (1, [(4, 9)])])
        with pytest.raises(CheckpointError, match="need distinct dims"):
            reader.read_box("w", [(0, [(0, 3)]), (0, [(4, 5)])])


def test_a_box_traces_through_an_op_chain_dim_by_dim_or_is_blocked():
    from surgery import ops
    from surgery.load.sharding import trace_boxes

    box = Box((Region(0, ((1, 3),)), Region(1, ((4, 8),))))
    traced = trace_boxes([ops.Concatenate(dim=0)], [[(2, 8), (2, 8)], [(4, 8)]], [box])
    assert traced.blocked_by is None
    assert traced.sources == [
        Box((Region(0, ((1, 2),)), Region(1, ((4, 8),)))),
        Box((Region(0, ((0, 1),)), Region(1, ((4, 8),)))),
    ]
    full = [torch.arange(16.0).reshape(2, 8), 100 + torch.arange(16.0).reshape(2, 8)]
    local = traced.operations[0].convert([s.take(t) for s, t in zip(traced.sources, full)], None)
    assert torch.equal(local[0], box.take(torch.cat(full)))
    # a transpose moves each cut to the other dim of its source
    flat = trace_boxes([ops.Transpose(0, 1)], [[(8, 4)], [(4, 8)]], [box])
    assert flat.sources == [Box((Region(0, ((4, 8),)), Region(1, ((1, 3),))))]
    # a chunk runs as a local Split for the row cut but as itself for the column cut: no one local
    # chain serves both, so the walk names it and the load takes a (covering) fallback
    blocked = trace_boxes([ops.Chunk(chunks=2, dim=0)], [[(8, 8)], [(4, 8), (4, 8)]], [box, box])
    assert blocked.blocked_by == ops.Chunk(chunks=2, dim=0) and blocked.sources == []


@pytest.mark.distributed
@pytest.mark.parametrize("case", CASES)
def test_a_dry_run_on_the_meshs_dim_sizes_plans_what_each_ranks_load_plans(ranks, case):
    """``plan_load(..., device_mesh={"dp_shard": 2, "tp": 2}, rank=r)``: no process group, the
    same parts, bytes and sources per target as the real load of rank r."""
    for f in _facts(ranks, case):
        assert f["dry_run_differs"] == []


@pytest.mark.distributed
def test_a_box_that_one_of_its_dims_can_trace_reads_the_covering_region_and_cuts_the_rest(ranks):
    """Rows no rule serves, columns one does: each rank reads its columns of every row (half the
    tensor, not all of it), runs the chain on them, cuts its rows; reported, exact."""
    for f in _facts(ranks, "box_with_a_cover"):
        assert f["ok"] and f["equal"]
        ((keys, op, extra),) = f["fallbacks"]
        assert keys == ["proj.weight"] and op.startswith("ColumnsOnlyDoubled(2.0) (read cut on dim 1 only")
        assert f["bytes_read"] == 6 * 4 * 4 and extra == 3 * 4 * 4


# --------------------------------------------------------------------------- dry runs on an n-D mesh


@pytest.fixture(scope="module")
def dense_ckpt(tmp_path_factory) -> Path:
    from surgery.checkpoint import write_checkpoint
    from surgery.examples import build_dense_model
    from surgery.examples.dense import original_state_dict

    path = tmp_path_factory.mktemp("nd-dense")
    write_checkpoint(original_state_dict(build_dense_model()), path)
    return path


@pytest.mark.parametrize(
    ("options", "says"),
    [
        ({"device_mesh": {"dp_shard": 2, "tp": 3}, "tp_plan": "auto"}, "which world size 3 does not divide"),
        ({"device_mesh": {"dp_shard": 2, "cp": 2}}, "are not ones a dry run plans"),
        ({"device_mesh": {"dp_shard": 2, "tp": 2}}, "a 'tp' (or 'ep') dim and a tp_plan go together"),
        (
            {"device_mesh": {"dp_shard": 2}, "tp_plan": "auto"},
            "a 'tp' (or 'ep') dim and a tp_plan go together",
        ),
        (
            {"device_mesh": {"ep": 2, "tp": 2}, "tp_plan": "auto"},
            "one tp_plan shards on one model-parallel dim",
        ),
        ({"device_mesh": {"ep": 2}, "tp_plan": "auto"}, "declares no ep_plan attribute"),
        ({"device_mesh": {"dp_shard": 2, "tp": 2}, "tp_plan": "auto", "rank": 4}, "are 0..3"),
        ({"rank": 1}, "pass device_mesh={'dp_shard': 2, 'tp': 2} too"),
    ],
)
def test_a_bad_planned_mesh_is_refused_before_reading(dense_ckpt, options, says):
    import surgery
    from surgery.examples import build_dense_model

    with pytest.raises(ConfigurationError, match=re.escape(says)):
        surgery.plan_load(build_dense_model(device="meta"), dense_ckpt, **options)


def test_a_load_needs_a_real_mesh_not_dim_sizes(dense_ckpt):
    import surgery
    from surgery.examples import build_dense_model

    model = build_dense_model(device="meta")
    with pytest.raises(ConfigurationError, match="needs the DeviceMesh of the launched ranks"):
        surgery.load_checkpoint(model, dense_ckpt, tp_plan="auto", device_mesh={"dp_shard": 2, "tp": 2})
    assert model.lm_head.weight.is_meta


def test_a_dry_run_of_hsdp_plans_the_same_reads_on_both_replicas(dense_ckpt):
    import surgery
    from surgery.examples import build_dense_model

    mesh = {"dp_replicate": 2, "dp_shard": 2}

    def parts(rank: int) -> dict:
        plan = surgery.plan_load(build_dense_model(device="meta"), dense_ckpt, device_mesh=mesh, rank=rank)
        return {e.target_keys: (e.tp, e.nbytes) for e in plan.entries}

    assert parts(0) == parts(2) and parts(1) == parts(3) and parts(0) != parts(1)
    total = sum(n for _, n in parts(0).values()) + sum(n for _, n in parts(1).values())
    assert total == sum(f.stat().st_size for f in dense_ckpt.glob("*.safetensors")) - _headers(dense_ckpt)


def _headers(path: Path) -> int:
    import struct

    out = 0
    for f in path.glob("*.safetensors"):
        with f.open("rb") as fh:
            out += 8 + struct.unpack("<Q", fh.read(8))[0]
    return out


@pytest.mark.distributed
def test_a_block_fp8_checkpoint_decodes_each_ranks_box_exactly(ranks):
    for f in _facts(ranks, "fp8"):
        assert f["ok"] and f["unequal"] == []
        assert f["forward_max_diff"] <= 1e-5
