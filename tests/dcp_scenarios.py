"""Resharding through DCP on 4 gloo ranks: the ``dcp`` suite of the one 4-rank spawn
(``tests/mesh_scenarios.py``), checked by ``tests/test_dcp.py``.

Per example model (dense: its ``packed_colwise`` MLP under FSDP2 is the case torch misplaces;
MoE: experts), each rank: loads the hub checkpoint through the transforms on mesh A
(``dp_shard=2 x tp=2``, ``tp_plan="auto"``, ``fsdp=True``), saves it with
:func:`~surgery.parallel.save_dcp` into ``<work>/dcp/<family>``, then builds the model on mesh B
(``tp=4``), loads it with :func:`~surgery.parallel.load_dcp` and records whether every local
tensor equals torch's own split of the single-process load on mesh B (``parallelize_module``
with real weights), then saves mesh B's model back to the hub layout (``<work>/dcp/<family>-hub``)
for the test to compare with the hub file byte for byte, and saves mesh B's model with DCP again
and loads that back on mesh A (``shard_model``, FSDP2 over TP), equal to torch's split there.
Under the interop marker the same round trip runs for transformers' Mixtral (its hub layout from
``save_pretrained``; mesh B is ``dp_shard=4``: its two kv heads do not split four ways). Torch's plain ``dcp.save`` of the same
state dict is read back in one process, and the keys it got wrong are recorded (the defect
:class:`~surgery.parallel.LocalShards` avoids). Last, bad inputs: a DCP checkpoint of another
model, one whose shapes differ, and a ``packed_colwise`` weight for the safetensors storage, each
refused on every rank. The safetensors storage (DCP's ``HuggingFaceStorageWriter``) is checked
from (dp_shard=4) to (tp=4) with the MoE.
"""

from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Any

import torch
from nd_scenarios import MESHES, MODELS, _torch_flow
from torch import nn

import surgery
from surgery.examples import dense
from surgery.parallel import load_dcp, parallelize, save_dcp, shard_model
from surgery.parallel.dcp import RECORD_KEY

__all__ = ["FAMILIES", "scenarios"]

FAMILIES = ("dense", "moe")
MESH_A = "dp_shard2_tp2"
MESH_B = "tp4"
TARGETS = {"mixtral": "dp_shard4"}  # its 2 kv heads do not split 4 ways: FSDP2 alone instead


def _strided(model: nn.Module) -> list[str]:
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor.placement_types import _StridedShard

    return sorted(
        k
        for k, v in model.state_dict().items()
        if isinstance(v, DTensor) and any(isinstance(p, _StridedShard) for p in v.placements)
    )


def _unequal_to(model: nn.Module, want: dict[str, Any]) -> list[str]:
    """Keys whose local tensor differs from ``want``'s (torch's own split on the same mesh)."""
    from torch.distributed.tensor import DTensor

    out = []
    for key, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        other = want[key].to_local() if isinstance(want[key], DTensor) else want[key]
        if local.is_meta or local.dtype != other.dtype or not torch.equal(local, other):
            out.append(key)
    return out


def _torch_dcp_misread(model: nn.Module, ref: nn.Module, path: Path) -> list[str]:
    """Torch's own ``dcp.save`` of ``model.state_dict()``, read back whole in one process: the
    keys whose value is not the single-process load's (or ``["raised: ..."]``)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException

    try:
        dcp.save(model.state_dict(), checkpoint_id=str(path))
    except (Exception, CheckpointException) as exc:  # recorded: what torch does with these placements
        return [f"raised: {'overlapping chunks' if 'overlapping chunks' in str(exc) else type(exc).__name__}"]
    dist.barrier()
    whole = {k: torch.empty_like(v) for k, v in ref.state_dict().items()}
    dcp.load(whole, checkpoint_id=str(path), no_dist=True)
    return sorted(k for k, v in ref.state_dict().items() if not torch.equal(whole[k], v))


def _stored(path: Path) -> dict[str, int]:
    """What DCP's metadata says was stored: chunks, their bytes, and the bytes of the files."""
    import torch.distributed.checkpoint as dcp

    stored = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    return {
        "chunks": sum(len(m.chunks) for m in stored.values()),
        "chunk_bytes": sum(
            math.prod(c.sizes) * m.properties.dtype.itemsize for m in stored.values() for c in m.chunks
        ),
        "record_bytes": math.prod(stored[RECORD_KEY].size),
        "file_bytes": sum(p.stat().st_size for p in path.glob("*.distcp")),
    }


def _round_trip(work: Path, meshes: dict[str, Any], family: str) -> dict[str, Any]:
    import torch.distributed as dist

    build = MODELS[family]
    ref = build(device="meta")
    assert surgery.load_checkpoint(ref, work / family).ok
    a = build(device="meta")
    report = surgery.load_checkpoint(a, work / family, device_mesh=meshes[MESH_A], tp_plan="auto", fsdp=True)
    out = work / "dcp" / family
    save_dcp(a, out)
    misread = _torch_dcp_misread(a, ref, work / "dcp" / f"{family}-torch")
    b = build(device="meta")
    target = TARGETS.get(family, MESH_B)
    if target == MESH_B:
        parallelize(b, "auto", meshes[MESH_B]["tp"])
    else:
        shard_model(b, meshes[target], tp_plan=None, fsdp=True)
    load_dcp(b, out)
    unequal_b = _unequal_to(b, _torch_flow(ref, family, meshes[target]).state_dict())
    surgery.save_checkpoint(b, work / "dcp" / f"{family}-hub")
    save_dcp(b, work / "dcp" / f"{family}-tp4")  # and back: into FSDP2 over TP, strided boxes read in place
    back = build(device="meta")
    shard_model(back, meshes[MESH_A], tp_plan="auto", fsdp=True)
    load_dcp(back, work / "dcp" / f"{family}-tp4")
    unequal_back = _unequal_to(back, _torch_flow(ref, family, meshes[MESH_A]).state_dict())
    dist.barrier()
    return {
        "stored": _stored(out),
        "model_bytes": sum(v.numel() * v.element_size() for v in ref.state_dict().values()),
        "unequal_back_on_a": unequal_back,
        "loaded_on_a": report.ok,
        "strided_on_a": _strided(a),
        "strided_on_b": _strided(b),
        "unequal_on_b": unequal_b,
        "torch_dcp_misread": misread,
        "dcp": str(out),
        "hub": str(work / family),
        "hub_again": str(work / "dcp" / f"{family}-hub"),
    }


def _safetensors(work: Path, meshes: dict[str, Any]) -> dict[str, Any]:
    """The MoE on (dp_shard=4) (FSDP2: one box per rank) saved with DCP's safetensors storage,
    reloaded on (tp=4) and saved back to the hub layout."""
    import torch.distributed as dist

    build = MODELS["moe"]
    ref = build(device="meta")
    assert surgery.load_checkpoint(ref, work / "moe").ok
    a = build(device="meta")
    assert surgery.load_checkpoint(a, work / "moe", device_mesh=meshes["dp_shard4"], fsdp=True).ok
    out = work / "dcp" / "moe-safetensors"
    save_dcp(a, out, storage="safetensors")
    b = build(device="meta")
    parallelize(b, "auto", meshes[MESH_B]["tp"])
    load_dcp(b, out)
    unequal = _unequal_to(b, _torch_flow(ref, "moe", meshes[MESH_B]).state_dict())
    surgery.save_checkpoint(b, work / "dcp" / "moe-safetensors-hub")
    dist.barrier()
    return {
        "files": sorted(p.name for p in out.iterdir()),
        "unequal_on_b": unequal,
        "hub": str(work / "moe"),
        "hub_again": str(work / "dcp" / "moe-safetensors-hub"),
    }


def _to_ep(work: Path, meshes: dict[str, Any]) -> dict[str, Any]:
    """The MoE's DCP checkpoint from (dp_shard=2, tp=2) reloaded with whole experts per rank
    (``expert_parallel`` on a 1-D ``ep`` mesh of 4) and saved back to the hub layout."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    build = MODELS["moe"]
    ref = build(device="meta")
    assert surgery.load_checkpoint(ref, work / "moe").ok
    model = build(device="meta")
    parallelize(model, {"model.layers.*.mlp.experts": "expert_parallel"}, meshes["ep4"])
    load_dcp(model, work / "dcp" / "moe")  # written by the round trip from MESH_A
    rank, ref_state = dist.get_rank(), ref.state_dict()
    unequal = [
        k
        for k, v in model.state_dict().items()
        if not torch.equal(
            v.to_local() if isinstance(v, DTensor) else v,
            ref_state[k].chunk(4, 0)[rank] if isinstance(v, DTensor) else ref_state[k],
        )
    ]
    surgery.save_checkpoint(model, work / "dcp" / "moe-ep-hub")
    dist.barrier()
    return {
        "unequal_on_ep": unequal,
        "experts_sharded": sorted(k for k, v in model.state_dict().items() if isinstance(v, DTensor)),
        "hub": str(work / "moe"),
        "hub_again": str(work / "dcp" / "moe-ep-hub"),
    }


def _refused(fn: Any) -> dict[str, Any]:
    try:
        fn()
    except surgery.SurgeryError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def _bad_inputs(work: Path, meshes: dict[str, Any]) -> dict[str, Any]:
    """A DCP checkpoint of another model, and of the same model with other shapes: refused on every rank."""
    other_shapes = dense.ExampleDenseConfig(
        num_attention_heads=4, num_key_value_heads=4, intermediate_size=128
    )

    def into(build: Any) -> None:
        model = build(device="meta")
        parallelize(model, "auto", meshes[MESH_B]["tp"])
        load_dcp(model, work / "dcp" / "dense")

    def packed_as_safetensors() -> None:
        model = MODELS["dense"](device="meta")
        parallelize(model, "auto", meshes[MESH_B]["tp"])
        save_dcp(model, work / "dcp" / "refused", storage="safetensors")

    return {
        "packed_as_safetensors": _refused(packed_as_safetensors),
        "another_model": _refused(lambda: into(MODELS["moe"])),
        "other_shapes": _refused(lambda: into(functools.partial(dense.build_dense_model, other_shapes))),
        "not_dcp": _refused(lambda: load_dcp(MODELS["dense"](device="meta"), work / "dcp" / "nothing")),
    }


def scenarios(work: Path, _mesh: Any, families: tuple[str, ...] = ()) -> dict[str, Any]:
    from nd_scenarios import _guarded
    from torch.distributed.device_mesh import init_device_mesh

    meshes = {
        m: init_device_mesh("cpu", MESHES[m][1], mesh_dim_names=MESHES[m][0])
        for m in (MESH_A, MESH_B, "dp_shard4")
    }
    meshes["ep4"] = init_device_mesh("cpu", (4,), mesh_dim_names=("ep",))
    out: dict[str, Any] = {
        f"{MESH_A}->{TARGETS.get(f, MESH_B)}/{f}": functools.partial(_guarded, _round_trip, work, meshes, f)
        for f in families or FAMILIES
    }
    if families:  # interop: the transformers families' round trips only
        return out
    out["safetensors"] = functools.partial(_guarded, _safetensors, work, meshes)
    out["to_ep"] = functools.partial(_guarded, _to_ep, work, meshes)  # after the MoE's round trip
    out["bad_inputs"] = functools.partial(_guarded, _bad_inputs, work, meshes)
    return out
