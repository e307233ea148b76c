"""The planning passes one at a time: each decides one thing about a plan entry, from headers alone.

Every test writes a real checkpoint of the example MoE model, opens it, builds the planning
context the way a load does (:func:`~surgery.load.planner.plan_context`) and runs the passes up to
the one under test on the entry of one runtime key.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import torch

from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.examples.layers import ATTENTION_TP_PLAN
from surgery.examples.moe import ExampleMoEConfig, build_moe_model, original_state_dict
from surgery.load.passes import (
    PASSES,
    Candidate,
    Planning,
    check_targets,
    choose_mode,
    shard,
)
from surgery.load.plan import Mode, Status
from surgery.load.planner import candidates, plan_context
from surgery.load.sharding import tensor_parallel
from surgery.parallel import TPSlice

if TYPE_CHECKING:
    from conftest import WriteOriginal

CFG = ExampleMoEConfig()
FUSED = "model.layers.0.mlp.experts.gate_up_proj"
NORM = "model.norm.weight"
Q = "model.layers.0.self_attn.q_proj.weight"


@contextmanager
def planning(path: Path, model: torch.nn.Module | None = None, **options: Any) -> Iterator[Planning]:
    """The planning context of a load of ``path`` into ``model`` (a fresh example MoE by default)."""
    model = build_moe_model(CFG, seed=0) if model is None else model
    with open_checkpoint(path) as reader:
        yield plan_context(model, path, reader, **options)


def entry_of(ctx: Planning, key: str, *, until: Any = None) -> Candidate:
    """The candidate whose group starts at ``key``, after the passes before ``until`` (all: None)."""
    (c,) = [c for c in candidates(ctx) if c.group_key == key]
    for step in PASSES:
        if step is until:
            break
        step(ctx, c)
        if c.entry.status != Status.OK:
            break
    return c


def test_the_passes_run_in_the_documented_order() -> None:
    names = [step.__name__ for step in PASSES]
    assert names == [
        "decode",
        "infer_shapes",
        "check_targets",
        "plan_quantization",
        "check_quantized",
        "choose_dtypes",
        "choose_mode",
        "shard",
        "check_values",
    ]


def test_infer_shapes_gives_the_fused_experts_shape_without_reading_data(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path / "model.safetensors")
    with planning(tmp_path) as ctx:
        c = entry_of(ctx, FUSED, until=check_targets)
        assert c.entry.status == Status.OK
        assert c.out_shapes == [(CFG.num_local_experts, 2 * CFG.intermediate_size, CFG.hidden_size)]
        assert c.entry.transform is not None and c.entry.transform.startswith("WeightConverter(")
        assert len(c.entry.source_keys) == 2 * CFG.num_local_experts
        assert ctx.reader.bytes_read == 0


def test_infer_shapes_fails_an_entry_with_a_missing_expert_and_names_the_converter(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(
        tmp_path / "model.safetensors", **{"model.layers.0.block_sparse_moe.experts.2.w1.weight": None}
    )
    with planning(tmp_path) as ctx:
        c = entry_of(ctx, FUSED)
        assert (c.entry.status, c.entry.mode) == (Status.ERROR, Mode.SKIP)
        ((index, failure),) = ctx.failures
        assert index == c.index and failure.transform.startswith("WeightConverter(")
        assert c not in ctx.targeted  # never checked against the model: no conflict can involve it
        assert FUSED in ctx.covered  # reported as failed, not as missing


def test_check_targets_files_a_key_the_model_lacks_as_unexpected(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path / "model.safetensors", **{"model.extra.weight": torch.zeros(3)})
    with planning(tmp_path) as ctx:
        c = entry_of(ctx, "model.extra.weight")
        assert (c.entry.status, c.entry.mode) == (Status.UNEXPECTED, Mode.SKIP)
        assert ctx.plan.unexpected_keys == ["model.extra.weight"]
        assert "model.extra.weight" not in ctx.covered
        assert c.entry.target_dtype is None  # the passes after check_targets never ran


def test_check_targets_reports_a_shape_mismatch_and_counts_the_target_as_covered(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path / "model.safetensors", **{NORM: torch.ones(CFG.hidden_size + 1)})
    with planning(tmp_path) as ctx:
        c = entry_of(ctx, NORM)
        assert (c.entry.status, c.entry.mode) == (Status.MISMATCH, Mode.SKIP)
        ((m,),) = [ctx.mismatches]
        assert (m.key, m.kind, m.checkpoint, m.model, m.loaded) == (
            NORM,
            "shape",
            str((CFG.hidden_size + 1,)),
            str((CFG.hidden_size,)),
            False,
        )
        assert NORM in ctx.covered and c in ctx.targeted


def test_choose_dtypes_casts_to_the_model_and_reports_it_unless_the_checkpoint_dtype_is_asked(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path / "model.safetensors", dtype=torch.bfloat16)
    with planning(tmp_path) as ctx:
        c = entry_of(ctx, NORM, until=choose_mode)
        assert ctx.target_dtype[NORM] == torch.float32 and c.cast
        (m,) = [m for m in ctx.mismatches if m.key == NORM]
        assert (m.kind, m.checkpoint, m.model, m.loaded, m.lossy) == (
            "dtype",
            "bfloat16",
            "float32",
            True,
            False,
        )
    with planning(tmp_path, dtype="checkpoint") as ctx:
        c = entry_of(ctx, NORM, until=choose_mode)
        assert ctx.target_dtype[NORM] == torch.bfloat16 and not c.cast
        assert ctx.mismatches == []


@pytest.mark.parametrize(
    ("on_meta", "options", "mode"),
    [
        (True, {}, Mode.MMAP),
        (True, {"mmap": False}, Mode.DIRECT),
        (False, {}, Mode.DIRECT),
        (False, {"dtype": torch.float16}, Mode.CONVERT),
    ],
    ids=["meta-model-maps", "mmap-off-reads-direct", "allocated-reads-direct", "a-cast-converts"],
)
def test_choose_mode_of_a_plain_tensor(
    tmp_path: Path, write_original: WriteOriginal, on_meta: bool, options: dict, mode: Mode
) -> None:
    write_original(tmp_path / "model.safetensors")
    model = build_moe_model(CFG, seed=0, device="meta" if on_meta else None)
    with planning(tmp_path, model, **options) as ctx:
        assert entry_of(ctx, NORM).entry.mode == mode


def test_choose_mode_reads_every_expert_straight_into_its_slice_of_the_fused_parameter(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path / "model.safetensors")
    with planning(tmp_path) as ctx:
        c = entry_of(ctx, FUSED)
        assert (c.entry.status, c.entry.mode) == (Status.OK, Mode.DIRECT)


def test_shard_reads_only_this_ranks_rows_of_a_colwise_weight(tmp_path: Path) -> None:
    cfg = ExampleMoEConfig(num_key_value_heads=2)  # two ranks split the heads evenly
    model = build_moe_model(cfg, seed=0)
    write_checkpoint(original_state_dict(model), tmp_path / "model.safetensors")
    tp = tensor_parallel(model, tp_plan=ATTENTION_TP_PLAN, device_mesh=None, tp_size=2, tp_rank=1)
    with planning(tmp_path, model, tp=tp) as ctx:
        c = entry_of(ctx, Q, until=shard)
        whole = c.entry.nbytes
        shard(ctx, c)
        rows = cfg.num_attention_heads * cfg.head_dim
        assert c.entry.nbytes == whole // 2
        (only,) = c.entry.tp
        assert only == TPSlice(("Shard(dim=0)",), 0, ((rows // 2, rows),))
        assert c.sharding is not None and c.sharding.sharded
        assert c.entry.mode == Mode.DIRECT  # a run of whole rows, read in place


def test_without_tensor_parallelism_shard_changes_nothing(
    tmp_path: Path, write_original: WriteOriginal
) -> None:
    write_original(tmp_path / "model.safetensors")
    with planning(tmp_path) as ctx:
        c = entry_of(ctx, Q, until=shard)
        before = (c.entry.nbytes, c.entry.mode, c.entry.tp)
        shard(ctx, c)
        assert (c.entry.nbytes, c.entry.mode, c.entry.tp) == before and c.sharding is None
