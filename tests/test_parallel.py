"""Tensor-parallel plans without a process group: validation, placements by arithmetic, dry runs.

Every bad plan is a ``ConfigurationError`` before any tensor byte is read; ``plan_load(...,
tp_size=N, tp_rank=r)`` plans a rank's reads by arithmetic, so ``surgery inspect --tp N`` can
show them. The multi-process behaviour is in ``test_parallel_loading.py``.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import surgery
from surgery import ConfigurationError
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.examples import dense, moe
from surgery.parallel import TPSlice, local_region, resolve_tp_plan, strided_shard
from surgery.parallel.regions import Region


@pytest.fixture
def dense_ckpt(tmp_path):
    write_checkpoint(dense.original_state_dict(dense.build_dense_model()), tmp_path)
    return tmp_path


def _dry(model, path, plan="auto", rank=0, size=2):
    return surgery.plan_load(model, path, tp_plan=plan, tp_size=size, tp_rank=rank)


def test_strided_shard_still_exists_and_gives_each_rank_its_share_of_every_part():
    placement = strided_shard(0, 2)
    assert type(placement).__name__ == "_StridedShard"
    assert local_region((placement,), (8, 3), 2, 0) == Region(0, ((0, 2), (4, 6)))
    assert local_region((placement,), (8, 3), 2, 1) == Region(0, ((2, 4), (6, 8)))


def test_shard_regions_follow_torch_chunk_rules():
    from torch.distributed.tensor import Replicate, Shard

    assert local_region((Shard(1),), (4, 7), 2, 0) == Region(1, ((0, 4),))
    assert local_region((Shard(1),), (4, 7), 2, 1) == Region(1, ((4, 7),))
    assert local_region((Replicate(),), (4, 7), 2, 1) is None


def test_a_dry_run_plans_each_ranks_part_and_bytes(dense_ckpt):
    plans = [_dry(dense.build_dense_model(device="meta"), dense_ckpt, rank=r) for r in range(2)]
    whole = surgery.plan_load(dense.build_dense_model(device="meta"), dense_ckpt)
    for r, plan in enumerate(plans):
        assert (plan.tp_world_size, plan.tp_rank) == (2, r)
        by_key = {e.target_keys[0]: e for e in plan.entries}
        gate_up = by_key["model.layers.0.mlp.gate_up_proj.weight"]
        assert gate_up.tp == (
            TPSlice(("_StridedShard(dim=0, sf=2)",), 0, ((16 * r, 16 * r + 16), (32 + 16 * r, 48 + 16 * r))),
        )
        assert gate_up.tp[0].region == Region(0, ((16 * r, 16 * r + 16), (32 + 16 * r, 48 + 16 * r)))
        assert gate_up.nbytes == 64 * 16 * 4 // 2  # half of each of gate_proj and up_proj
        assert by_key["model.norm.weight"].tp == (None,)
        assert f"rank {r} of 2" in plan.render()
    assert plans[0].total_bytes == plans[1].total_bytes < 0.55 * whole.total_bytes


def test_a_parallel_plan_round_trips_through_json(dense_ckpt):
    plan = _dry(dense.build_dense_model(device="meta"), dense_ckpt, rank=1)
    again = surgery.LoadPlan.from_json(plan.to_json())
    assert again == plan


def test_a_slice_in_the_plan_json_is_placement_dim_and_intervals(dense_ckpt):
    """The JSON of a rank's part: ``[placement, dim, intervals]`` (``[placement, null, []]`` when whole)."""
    plan = _dry(dense.build_dense_model(device="meta"), dense_ckpt, rank=1)
    by_key = {e["target_keys"][0]: e for e in plan.to_dict()["entries"]}
    assert by_key["model.layers.0.mlp.gate_up_proj.weight"]["tp"] == [
        ["_StridedShard(dim=0, sf=2)", 0, [[16, 32], [48, 64]]]
    ]
    assert by_key["model.layers.0.mlp.down_proj.weight"]["tp"] == [["Shard(dim=1)", 1, [[16, 32]]]]
    assert by_key["model.norm.weight"]["tp"] == [None]


def test_a_slice_has_one_placement_per_mesh_dim_and_round_trips_through_json():
    one_d = TPSlice(("Shard(dim=0)",), 0, ((0, 4),))
    two_d = TPSlice(("Shard(dim=0)", "Shard(dim=1)"), 0, ((0, 4),))
    assert one_d.to_json() == ["Shard(dim=0)", 0, [[0, 4]]]
    assert two_d.to_json() == [["Shard(dim=0)", "Shard(dim=1)"], 0, [[0, 4]]]
    assert [TPSlice.from_json(s.to_json()) for s in (one_d, two_d)] == [one_d, two_d]
    assert TPSlice(("Replicate()",)).region is None


def test_the_dry_run_never_changes_the_model(dense_ckpt):
    model = dense.build_dense_model()
    before = {k: (type(v), v.clone()) for k, v in model.state_dict().items()}
    _dry(model, dense_ckpt)
    after = model.state_dict()
    assert all(type(after[k]) is t and torch.equal(after[k], v) for k, (t, v) in before.items())


def test_inspect_shows_what_each_rank_reads(dense_ckpt, capsys):
    from surgery.cli import main  # in this process; tests/test_cli.py launches the entry point itself

    assert main(["inspect", str(dense_ckpt), "--model", "example-dense", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "rank 0 of 2" in out and "rank 1 of 2" in out
    assert "StridedShard(0) 0:16,32:48" in out and "StridedShard(0) 16:32,48:64" in out


# --------------------------------------------------------------------------- bad plans


def _error(model, path, plan, **kwargs) -> str:
    with pytest.raises(ConfigurationError) as info:
        surgery.plan_load(model, path, tp_plan=plan, **({"tp_size": 2, "tp_rank": 0} | kwargs))
    return str(info.value)


def test_an_unknown_style_lists_the_valid_ones(dense_ckpt):
    message = _error(dense.build_dense_model(device="meta"), dense_ckpt, {"lm_head": "diagonal"})
    assert "'diagonal' is not a style" in message and "packed_colwise" in message


def test_a_pattern_that_matches_nothing_is_an_error_not_a_warning(dense_ckpt):
    message = _error(
        dense.build_dense_model(device="meta"), dense_ckpt, {"model.layer.*.mlp.down_proj": "rowwise"}
    )
    assert "'model.layer.*.mlp.down_proj' matches no module" in message


def test_auto_on_an_expert_mesh_applies_the_models_expert_parallel_plan():
    """``tp_plan="auto"`` on a mesh named ``ep`` (``parallelize`` passes ``expert=True``): ``ep_plan``."""
    model = moe.build_moe_model(
        moe.ExampleMoEConfig(num_local_experts=8, num_key_value_heads=2), device="meta"
    )
    resolved = resolve_tp_plan(model, "auto", world_size=4, expert=True)
    assert [(r.path, r.kind) for r in resolved] == [
        ("model.layers.0.mlp.experts", "expert_parallel"),
        ("model.layers.1.mlp.experts", "expert_parallel"),
    ]
    assert {r.kind for r in resolve_tp_plan(model, "auto", world_size=2)} >= {"experts", "colwise"}
    with pytest.raises(ConfigurationError, match=r"declares no ep_plan attribute.*named 'ep'"):
        resolve_tp_plan(dense.build_dense_model(device="meta"), "auto", world_size=2, expert=True)


def test_expert_parallel_takes_only_a_module_of_3d_experts_whatever_applies_it():
    """The check ``resolve_tp_plan`` and ``ExpertParallel._apply`` (``parallelize_module``) share."""
    from surgery.parallel.experts import check_experts_module
    from surgery.parallel.styles import ExpertParallel

    experts = (
        moe.build_moe_model(moe.ExampleMoEConfig(num_local_experts=8), device="meta")
        .model.layers[0]
        .mlp.experts
    )
    check_experts_module(experts, "experts")  # E = 8 rows in every parameter
    with pytest.raises(
        ConfigurationError, match=r"ExpertParallel on Linear: .* num_experts=None .*'weight': \(4, 2\)"
    ):
        ExpertParallel()._apply(nn.Linear(2, 4), None)  # refused before the mesh is looked at


def test_star_matches_exactly_one_component():
    model = dense.build_dense_model(device="meta")
    resolved = resolve_tp_plan(model, {"model.layers.*.mlp.down_proj": "rowwise"}, world_size=2)
    assert [r.path for r in resolved] == ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    with pytest.raises(ConfigurationError, match="matches no module"):
        resolve_tp_plan(model, {"model.*.mlp.down_proj": "rowwise"}, world_size=2)


def test_a_dim_the_world_size_does_not_divide_names_parameter_dim_and_sizes(tmp_path):
    model = nn.Sequential(nn.Linear(4, 5))
    write_checkpoint(model.state_dict(), tmp_path)
    message = _error(model, tmp_path, {"0": "colwise"})
    assert "'0.weight'" in message and "dim 0 of size 5" in message and "world size 2" in message


def test_packed_shards_must_divide_by_world_size_times_parts(tmp_path):
    model = nn.Sequential(nn.Linear(4, 6))
    write_checkpoint(model.state_dict(), tmp_path)
    message = _error(model, tmp_path, {"0": "packed_colwise"})
    assert "size 6" in message and "split factor 2" in message


def test_head_counts_must_divide_by_the_world_size(tmp_path):
    model = moe.build_moe_model()  # one key/value head
    write_checkpoint(moe.original_state_dict(model), tmp_path)
    message = _error(moe.build_moe_model(device="meta"), tmp_path, "auto")
    assert "num_key_value_heads=1" in message and "world size 2" in message


class _FusedQKV(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.config = dense.ExampleDenseConfig()  # 4 query heads, 2 key/value heads
        self.qkv_proj = nn.Linear(16, 32)


def test_fused_grouped_query_qkv_under_packed_colwise_says_keep_them_unfused(tmp_path):
    model = _FusedQKV()
    write_checkpoint(model.state_dict(), tmp_path)
    message = _error(model, tmp_path, {"qkv_proj": "packed_colwise"})
    assert "grouped-query" in message and "Keep q/k/v unfused" in message


class _Heads(nn.Module):
    """A config with 4 query heads and 2 key/value heads of size 4, and one Linear of ``width`` outputs."""

    def __init__(self, name: str, width: int, **config) -> None:
        super().__init__()
        self.config = dense.ExampleDenseConfig(**config)
        self.add_module(name, nn.Linear(16, width))


@pytest.mark.parametrize(
    ("name", "width", "refused"),
    [("fused", 32, True), ("qkv_proj", 64, False), ("qkv_proj", 32, True)],
    ids=["qkv-width-any-name", "gate-up-width-named-qkv", "qkv-width-named-qkv"],
)
def test_a_fused_grouped_query_qkv_is_told_by_its_width_not_its_name(tmp_path, name, width, refused):
    """(4 + 2 x 2) heads of 4 = 32 outputs is a fused q/k/v whatever it is called; 64 is not one."""
    model = _Heads(name, width)
    write_checkpoint(model.state_dict(), tmp_path)
    if refused:
        assert "grouped-query" in _error(model, tmp_path, {name: "packed_colwise"})
    else:
        assert not _dry(model, tmp_path, {name: "packed_colwise"}).problems


def test_head_counts_are_checked_on_every_linear_whose_width_is_heads(tmp_path):
    """3 query heads do not split over 2 ranks: q (12 outputs) is refused under any name, an MLP of 24 is not."""
    model = _Heads("proj", 12, hidden_size=12, num_attention_heads=3, num_key_value_heads=3)
    write_checkpoint(model.state_dict(), tmp_path)
    assert "num_attention_heads=3" in _error(model, tmp_path, {"proj": "colwise"})
    model = _Heads("proj", 24, hidden_size=12, num_attention_heads=3, num_key_value_heads=3)
    write_checkpoint(model.state_dict(), tmp_path)
    assert not _dry(model, tmp_path, {"proj": "colwise"}).problems


def test_the_styles_are_parallel_style_classes_a_plan_recognizes_by_type():
    from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

    from surgery.parallel import ExpertsParallel, PackedColwiseParallel

    class Packed3(PackedColwiseParallel):
        def __init__(self) -> None:
            super().__init__(split_factor=3)

    assert isinstance(PackedColwiseParallel(), ColwiseParallel) and issubclass(ExpertsParallel, ParallelStyle)
    model = nn.Sequential(nn.Linear(4, 12))
    (resolved,) = resolve_tp_plan(model, {"0": Packed3()}, world_size=2)
    assert (resolved.kind, resolved.split_factor) == ("packed_colwise", 3)
    (resolved,) = resolve_tp_plan(model, {"0": ColwiseParallel()}, world_size=2)
    assert (resolved.kind, resolved.split_factor) == ("colwise", 1)


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.head = nn.Linear(4, 8, bias=False)
        self.head.weight = self.embed.weight


def test_tied_parameters_with_different_placements_are_refused(tmp_path):
    model = _Tied()
    write_checkpoint({"embed.weight": model.embed.weight.detach().clone()}, tmp_path)
    message = _error(model, tmp_path, {"embed": "colwise", "head": "colwise"})
    assert "tied parameters" in message and "Shard(dim=1)" in message
    # rowwise embedding + colwise head share Shard(0): fine
    plan = _dry(_Tied(), tmp_path, {"embed": "rowwise", "head": "colwise"})
    assert not plan.problems


def test_a_style_on_a_module_it_does_not_support(dense_ckpt):
    message = _error(dense.build_dense_model(device="meta"), dense_ckpt, {"model.norm": "colwise"})
    assert "RMSNorm" in message and "nn.Linear and nn.Embedding" in message
    message = _error(dense.build_dense_model(device="meta"), dense_ckpt, {"model.layers.0.mlp": "experts"})
    assert "gate_up_proj" in message


def test_plan_options_that_contradict_each_other(dense_ckpt):
    model = dense.build_dense_model(device="meta")
    with pytest.raises(ConfigurationError, match="needs device_mesh"):
        surgery.load_checkpoint(model, dense_ckpt, tp_plan="auto")
    with pytest.raises(ConfigurationError, match="pass tp_plan"):
        surgery.plan_load(model, dense_ckpt, tp_size=2)
    with pytest.raises(ConfigurationError, match="0 <= tp_rank < tp_size"):
        surgery.plan_load(model, dense_ckpt, tp_plan="auto", tp_size=2, tp_rank=2)
    with pytest.raises(ConfigurationError, match="is empty"):
        surgery.plan_load(model, dense_ckpt, tp_plan={}, tp_size=2, tp_rank=0)
    with pytest.raises(ConfigurationError, match="declares no tp_plan"):
        surgery.plan_load(nn.Sequential(nn.Linear(2, 2)), dense_ckpt, tp_plan="auto", tp_size=2, tp_rank=0)
    assert isinstance(model.lm_head.weight, nn.Parameter) and model.lm_head.weight.is_meta


def test_a_custom_parallel_style_needs_a_mesh_to_be_planned(dense_ckpt):
    from torch.distributed.tensor.parallel import SequenceParallel

    message = _error(dense.build_dense_model(device="meta"), dense_ckpt, {"model.norm": SequenceParallel()})
    assert "device_mesh" in message


def test_read_region_reads_exactly_the_intervals(tmp_path):
    t = torch.arange(4 * 6 * 2, dtype=torch.float32).reshape(4, 6, 2)
    write_checkpoint({"t": t}, tmp_path)
    with open_checkpoint(tmp_path) as reader:
        got = reader.read_region("t", 1, [(0, 2), (4, 6)])
        assert torch.equal(got, torch.cat([t[:, 0:2], t[:, 4:6]], dim=1))
        assert reader.bytes_read == got.nbytes
        out = torch.empty(2, 6, 2)
        reader.read_region("t", 0, [(1, 2), (3, 4)], out=out)
        assert torch.equal(out, t[[1, 3]])
        assert reader.bytes_read == got.nbytes + out.nbytes
        with pytest.raises(surgery.CheckpointError, match="sorted"):
            reader.read_region("t", 1, [(4, 6), (0, 2)])
        with pytest.raises(surgery.CheckpointError, match="needs"):
            reader.read_region("t", 0, [(0, 1)], out=torch.empty(2, 6, 2))
