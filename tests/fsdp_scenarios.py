"""``load_checkpoint(..., device_mesh=mesh, tp_plan=..., fsdp=...)`` on 4 gloo ranks.

:func:`scenarios` lists what each rank executes (the one 4-rank spawn of ``tests/mesh_scenarios.py``). For each
mesh and example model it builds the model on meta twice: once parallelized by hand the
torchtitan way (``nd_scenarios.torchtitan_parallelize``: ``parallelize_module`` on ``mesh["tp"]``,
``fully_shard`` per layer and at the root), once left to the convenient path. It records whether
both have the same parameters as DTensors with the same placements and meshes, whether the
convenient load's local tensors equal torch's own flow (the single-process model copied,
parallelized and sharded by torch) and its forward the single-process forward; then the bad
inputs, each refused before anything changes; then the docs recipe end to end.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path
from typing import Any

import torch
from nd_scenarios import (
    MESHES,
    MODELS,
    _logits,
    _torch_flow,
    torchtitan_parallelize,
)
from torch import nn

import surgery
from surgery.examples import dense
from surgery.parallel.fsdp import FSDPOptions

WORLD = 4
ROOT = Path(__file__).resolve().parents[1]


def _layout(model: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    return {
        k: (repr(v.placements), v.device_mesh.mesh_dim_names, v.device_mesh.mesh.tolist())
        if isinstance(v, DTensor)
        else "plain"
        for k, v in model.named_parameters()
    }


def _convenient(work: Path, mesh: Any, family: str) -> dict[str, Any]:
    """The convenient path against parallelize_module + fully_shard by hand."""
    from torch.distributed.tensor import DTensor

    build = MODELS[family]
    by_hand = build(device="meta")
    torchtitan_parallelize(by_hand, mesh, family)
    model = build(device="meta")
    tp_plan: Any = None
    if "tp" in mesh.mesh_dim_names:  # the model's own plan; a transformers model's in transformers' names
        tp_plan = "auto"
    fsdp = True if mesh.mesh_dim_names != ("tp",) else None
    report = surgery.load_checkpoint(model, work / family, device_mesh=mesh, tp_plan=tp_plan, fsdp=fsdp)
    ref = build(device="meta")
    assert surgery.load_checkpoint(ref, work / family).ok
    flow = _torch_flow(ref, family, mesh).state_dict()
    unequal = []
    for key, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        want = flow[key].to_local() if isinstance(value, DTensor) else flow[key]
        if local.is_meta or not torch.equal(local, want):
            unequal.append(key)
    with torch.no_grad():
        diff = float((_logits(model) - _logits(ref)).abs().max())
    return {
        "ok": report.ok,
        "same_layout_as_by_hand": _layout(model) == _layout(by_hand),
        "dtensors": sum(isinstance(p, DTensor) for p in model.parameters()),
        "fsdp_modules": sorted(
            type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP")
        ),
        "unequal": unequal,
        "forward_max_diff": diff,
        "fallbacks": len(report.tp_fallbacks),
    }


class Blocks(nn.Module):
    """Two linear blocks in a ModuleList: the smallest model a bad-input case needs."""

    def __init__(self, rows: int = 6) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, rows, bias=False) for _ in range(2)])


def _refused(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except surgery.ConfigurationError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def _bad_inputs(work: Path, mesh: Any) -> dict[str, Any]:
    """Each refused before a byte is read, the model left as it was."""
    from torch.distributed.device_mesh import init_device_mesh

    from surgery.parallel import has_dtensors

    path = work / "blocks"
    odd = Blocks(5).to("meta")
    tied = Blocks(8).to("meta")
    tied.layers[1].weight = tied.layers[0].weight
    flat = nn.Linear(4, 8).to("meta")
    badly_named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_local_odd = Blocks().to("meta")
    out = {
        "unknown_dim": _refused(
            lambda: surgery.load_checkpoint(Blocks(8), path, device_mesh=badly_named, fsdp=True)
        ),
        "plan_without_tp_dim": _refused(
            lambda: surgery.load_checkpoint(
                Blocks(8), path, device_mesh=mesh["dp_shard"], tp_plan="auto", fsdp=True
            )
        ),
        "mesh_dp_without_fsdp": _refused(
            lambda: surgery.load_checkpoint(
                Blocks(8), path, device_mesh=mesh, tp_plan={"layers.*": "colwise"}
            )
        ),
        "does_not_divide": _refused(
            lambda: surgery.load_checkpoint(odd, path, device_mesh=mesh["dp_shard"], fsdp=True)
        ),
        "tp_shard_does_not_divide": _refused(
            lambda: surgery.load_checkpoint(
                tp_local_odd, path, device_mesh=mesh, tp_plan={"layers.*": "colwise"}, fsdp=True
            )
        ),
        "shared_between_layers": _refused(
            lambda: surgery.load_checkpoint(tied, path, device_mesh=mesh["dp_shard"], fsdp=True)
        ),
        "no_layers": _refused(
            lambda: surgery.load_checkpoint(flat, path, device_mesh=mesh["dp_shard"], fsdp=True)
        ),
        "layers_not_a_list": _refused(
            lambda: surgery.load_checkpoint(
                Blocks(8), path, device_mesh=mesh["dp_shard"], fsdp=FSDPOptions(layers="layers.0")
            )
        ),
    }
    out["unchanged_after_tp_then_refusal"] = not has_dtensors(tp_local_odd) and all(
        type(m) in (Blocks, nn.ModuleList, nn.Linear) for m in tp_local_odd.modules()
    )
    return out


def _recipe(work: Path) -> dict[str, Any]:
    """The docs recipe end to end; its save reloaded the same way gives back the trained shards."""
    sys.path.insert(0, str(ROOT / "docs" / "examples"))
    try:
        import fsdp_tp_recipe
    finally:
        sys.path.remove(str(ROOT / "docs" / "examples"))
    facts = fsdp_tp_recipe.recipe(str(work / "dense"), str(work / "recipe_out"))
    build = functools.partial(dense.build_dense_model, fsdp_tp_recipe.CONFIG)
    return {**facts, **_after_the_step(facts.pop("model"), build, work / "dense", work / "recipe_out")}


def _moe_step(work: Path) -> dict[str, Any]:
    """The recipe's step on the MoE example (the router and its norm feed the experts' style)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    model = MODELS["moe"](device="meta")
    surgery.load_checkpoint(model, work / "moe", device_mesh=mesh, tp_plan="auto", fsdp=True, strict=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    _local(model(torch.randint(0, 64, (2, 6)))).float().pow(2).mean().backward()
    optimizer.step()
    surgery.save_checkpoint(model, work / "moe_out")
    return _after_the_step(model, MODELS["moe"], work / "moe", work / "moe_out")


def _after_the_step(trained: nn.Module, build: Any, original: Path, saved: Path) -> dict[str, Any]:
    """Which local shards a reload of the save does not give back; how many the step changed."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "tp"))
    before = trained.state_dict()
    out: dict[str, Any] = {}
    for name, path in (("differs_after_reload", saved), ("unchanged_by_the_step", original)):
        again = build(device="meta")
        surgery.load_checkpoint(again, path, device_mesh=mesh, tp_plan="auto", fsdp=True, strict=True)
        out[name] = [
            k for k, v in again.state_dict().items() if not torch.equal(_local(v), _local(before[k]))
        ]
    out["changed_by_the_step"] = len(out.pop("unchanged_by_the_step"))
    return out


def _local(t: Any) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _guarded(fn: Any, *args: Any) -> Any:
    import traceback

    try:
        return fn(*args)
    except Exception:
        return {"error": traceback.format_exc()}


CASES = (
    ("dp_shard2_tp2", "dense"),
    ("dp_shard2_tp2", "moe"),
    ("tp4", "dense"),
    ("dp_shard4", "moe"),
    ("hsdp2x2", "dense"),
)


def scenarios(work: Path, _mesh: Any, families: tuple[str, ...] = ()) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        name: init_device_mesh("cpu", shape, mesh_dim_names=names) for name, (names, shape) in MESHES.items()
    }
    if families:  # interop: transformers models on the FSDP2 x TP mesh
        return {
            f"dp_shard2_tp2/{f}": functools.partial(_guarded, _convenient, work, meshes["dp_shard2_tp2"], f)
            for f in families
        }
    out: dict[str, Any] = {
        f"{m}/{f}": functools.partial(_guarded, _convenient, work, meshes[m], f) for m, f in CASES
    }
    out["bad_inputs"] = functools.partial(_guarded, _bad_inputs, work, meshes["dp_shard2_tp2"])
    out["recipe"] = functools.partial(_guarded, _recipe, work)
    out["moe_step"] = functools.partial(_guarded, _moe_step, work)
    return out
