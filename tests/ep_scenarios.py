"""Expert parallelism on 4 ranks: the ``ep`` suite of the one 4-rank spawn (``tests/mesh_scenarios.py``).

The example MoE with 16 experts, ``expert_parallel`` on its experts over a 1-D mesh of 4: each
rank loads its 4 experts from the per-expert checkpoint and from a fused ``[E, ...]`` one, and
the facts say what it holds, what it read, what its forward gives and what a save writes.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from nd_scenarios import _guarded
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.examples import moe

__all__ = ["EP_MOE", "EP_PLAN", "scenarios", "write_inputs"]

EP_MOE = moe.ExampleMoEConfig(num_local_experts=16, num_attention_heads=4, num_key_value_heads=2)
EP_PLAN = {"model.layers.*.mlp.experts": "expert_parallel"}
INPUT_IDS = torch.tensor([[1, 5, 9, 3, 7, 11, 2, 40], [2, 4, 6, 8, 10, 12, 14, 16]])


def _build(config: moe.ExampleMoEConfig = EP_MOE, **kwargs: Any) -> nn.Module:
    return moe.build_moe_model(config, seed=None, **kwargs)


def write_inputs(work: Path) -> None:
    """The per-expert checkpoint (the original layout) and a fused one (the runtime layout)."""
    model = moe.build_moe_model(EP_MOE, seed=5)
    write_checkpoint(moe.original_state_dict(model), work / "ep-per-expert")
    write_checkpoint({k: v.contiguous() for k, v in model.state_dict().items()}, work / "ep-fused")


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _load(work: Path, mesh: Any, rank: int, checkpoint: str) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    ref = _build(device="meta")
    single = surgery.load_checkpoint(ref, work / checkpoint)
    model = _build(device="meta")
    report = surgery.load_checkpoint(model, work / checkpoint, tp_plan=EP_PLAN, device_mesh=mesh)
    ref_state = ref.state_dict()
    unequal, experts_bytes, other_bytes, sharded = [], 0, 0, []
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            sharded.append(key)
            local, want = value.to_local(), ref_state[key].chunk(mesh.size(), 0)[rank]
            experts_bytes += local.nbytes
        else:
            local, want = value, ref_state[key]
            other_bytes += local.nbytes
        if not torch.equal(local, want):
            unequal.append(key)
    with torch.no_grad():
        diff = float((model(INPUT_IDS) - ref(INPUT_IDS)).abs().max())
    out = work / f"{checkpoint}-saved-ep"
    files = surgery.save_checkpoint(model, out)
    dist.barrier()
    return {
        "ok": report.ok and single.ok,
        "report": str(report),
        "unequal": unequal,
        "sharded": sorted(sharded),
        "forward_max_diff": diff,
        "bytes_read": report.bytes_read,
        "single_bytes": single.bytes_read,
        "experts_bytes": experts_bytes,
        "other_bytes": other_bytes,
        "wrote": sorted(Path(p).name for p in files),
        # the original (per-expert) layout, whichever layout was loaded
        "saved_identical": _files(out) == _files(work / "ep-per-expert") if rank == 0 else None,
    }


def _refused(work: Path, mesh: Any, config: moe.ExampleMoEConfig, plan: dict[str, str]) -> dict[str, Any]:
    try:
        surgery.load_checkpoint(
            _build(config, device="meta"), work / "ep-per-expert", tp_plan=plan, device_mesh=mesh
        )
    except surgery.SurgeryError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def scenarios(work: Path, _mesh: Any, families: tuple[str, ...]) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    if families:
        return {}
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("ep",))
    rank = dist.get_rank()
    six = moe.ExampleMoEConfig(num_local_experts=6, num_attention_heads=4, num_key_value_heads=2)
    return {
        "per_expert": functools.partial(_guarded, _load, work, mesh, rank, "ep-per-expert"),
        "fused": functools.partial(_guarded, _load, work, mesh, rank, "ep-fused"),
        "six_experts": functools.partial(_guarded, _refused, work, mesh, six, EP_PLAN),
        "not_experts": functools.partial(
            _guarded, _refused, work, mesh, EP_MOE, {"model.layers.*.mlp.gate": "expert_parallel"}
        ),
    }
