"""Expert parallelism on 4 ranks: the ``ep`` suite of the one 4-rank spawn (``tests/mesh_scenarios.py``).

The example MoE with 16 experts: ``expert_parallel`` over a 1-D mesh of 4 (from a per-expert, a
fused ``[E, ...]`` and a block-FP8 per-expert checkpoint, and through ``tp_plan="auto"``), over
``(ep=2, tp=2)`` (expert-TP) and over ``(dp_shard=2, ep=2)`` (FSDP2 on top); the facts say what
each rank holds, what it read, what its forward gives and what a save writes. With families
(the ``ep-interop`` suite), transformers' Mixtral, Qwen2-MoE and Qwen3-MoE with 16 experts, each
from its own ``save_pretrained`` files, through their ``base_model_ep_plan`` (``tp_plan="auto"``
on a mesh named ``ep``).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch
from fp8_reference import quantize_state
from nd_scenarios import _guarded, _torch_split
from torch import nn

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.examples import moe

__all__ = ["EP_MOE", "EP_PLAN", "scenarios", "write_inputs"]

EP_MOE = moe.ExampleMoEConfig(num_local_experts=16, num_attention_heads=4, num_key_value_heads=2)
EP_PLAN = {"model.layers.*.mlp.experts": "expert_parallel"}
FP8_BLOCK = (12, 8)  # blocks that straddle the halves of gate_up and the tp cut of every expert
INPUT_IDS = torch.tensor([[1, 5, 9, 3, 7, 11, 2, 40], [2, 4, 6, 8, 10, 12, 14, 16]])


FAMILY_SIZES = {  # interop: (class, config class, sizes) of a transformers MoE with 16 experts
    "mixtral": ("MixtralForCausalLM", "MixtralConfig", {"num_local_experts": 16, "intermediate_size": 32}),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {"num_experts": 16, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 32},
    ),
    "qwen3_moe": ("Qwen3MoeForCausalLM", "Qwen3MoeConfig", {"num_experts": 16, "moe_intermediate_size": 16}),
}


def _build(config: moe.ExampleMoEConfig = EP_MOE, **kwargs: Any) -> nn.Module:
    return moe.build_moe_model(config, seed=None, **kwargs)


def _transformers_build(family: str, *, device: str = "cpu", seed: int = 0) -> nn.Module:
    import transformers

    cls_name, config_name, sizes = FAMILY_SIZES[family]
    config = getattr(transformers, config_name)(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=128,
        num_experts_per_tok=2,
        attn_implementation="sdpa",
        **sizes,
    )
    cls = getattr(transformers, cls_name)
    if device == "meta":
        with surgery.init_empty():
            return cls(config).eval()
    torch.manual_seed(seed)
    return cls(config).eval()


def _logits(model: nn.Module) -> torch.Tensor:
    out = model(INPUT_IDS)
    return out if isinstance(out, torch.Tensor) else out.logits


def write_inputs(work: Path, families: tuple[str, ...] = ()) -> None:
    """The per-expert checkpoint (the original layout), a fused one (the runtime layout), the
    per-expert one in block FP8 (DeepSeek-V3's layout) and one that lacks an expert; each
    family's ``save_pretrained`` files."""
    for family in families:
        _transformers_build(family, seed=3).save_pretrained(work / f"ep-{family}")
    model = moe.build_moe_model(EP_MOE, seed=5)
    original = moe.original_state_dict(model)
    write_checkpoint(original, work / "ep-per-expert")
    write_checkpoint({k: v.contiguous() for k, v in model.state_dict().items()}, work / "ep-fused")
    write_checkpoint(quantize_state(original, FP8_BLOCK), work / "ep-per-expert-fp8")
    lacking = {k: v for k, v in original.items() if ".layers.1.block_sparse_moe.experts.5." not in k}
    write_checkpoint(lacking, work / "ep-missing-expert")


def _expert_index(key: str) -> int | None:
    """The expert a per-expert checkpoint key belongs to (``None``: a dense key)."""
    parts = key.split(".")
    return (
        int(parts[parts.index("experts") + 1]) if "experts" in parts and parts[-2].startswith("w") else None
    )


def _owned_stored_bytes(path: Path, owned: range) -> int:
    """Bytes of a per-expert checkpoint a rank owning ``owned`` must read: its experts' tensors
    (with their scales) and every dense tensor, from the header alone."""
    from surgery.checkpoint import open_checkpoint

    with open_checkpoint(path) as reader:
        return sum(
            reader.info(k).nbytes for k in reader if _expert_index(k) is None or _expert_index(k) in owned
        )


def _ep_tp(model: nn.Module, mesh: Any) -> None:
    """(ep=2, tp=2): attention heads over ``tp``, each layer's experts over both (expert-TP)."""
    from torch.distributed.tensor.parallel import parallelize_module

    from surgery.examples.layers import ATTENTION_TP_PLAN
    from surgery.parallel import ExpertParallel, parallelize

    parallelize(model, ATTENTION_TP_PLAN, mesh["tp"])
    for layer in model.model.layers:
        parallelize_module(layer.mlp.experts, mesh, ExpertParallel())


def _dp_ep(model: nn.Module, mesh: Any) -> None:
    """(dp_shard=2, ep=2): experts over ``ep``, then FSDP2 per layer and at the root over ``dp_shard``."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    from surgery.parallel import ExpertParallel

    for layer in model.model.layers:
        parallelize_module(layer.mlp.experts, mesh["ep"], ExpertParallel())
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])


def _load(
    work: Path,
    mesh: Any,
    checkpoint: str,
    *,
    plan: Any = None,
    parallelize: Any = None,
    quantizer: Any = None,
    owned: range | None = None,
    build: Any = _build,
    original: str = "ep-per-expert",
    runtime: bool = False,
    dry: dict[str, int] | None = None,
    fsdp: bool = False,
) -> dict[str, Any]:
    """Load ``checkpoint`` into the MoE parallelized by ``plan`` (on ``mesh``) or by ``parallelize``
    (torchtitan's way; then a plain load), and compare with a single-process load."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor, Replicate

    options = {"quantizer": quantizer} if quantizer is not None else {}
    ref = build(device="meta")
    single = surgery.load_checkpoint(ref, work / checkpoint, **options)
    model = build(device="meta")
    if parallelize is not None:
        parallelize(model, mesh)
        report = surgery.load_checkpoint(model, work / checkpoint, **options)
    else:
        if fsdp:
            options["fsdp"] = True
        report = surgery.load_checkpoint(model, work / checkpoint, tp_plan=plan, device_mesh=mesh, **options)
        options.pop("fsdp", None)
    planned = None
    if dry is not None:  # the dry run of this rank on the mesh given by its dim sizes, no process group
        rank = dist.get_rank()
        planned = surgery.plan_load(
            build(device="meta"),
            work / checkpoint,
            tp_plan=plan or EP_PLAN,
            device_mesh=dry,
            rank=rank,
            **options,
        ).total_bytes
    elif parallelize is None and plan != "auto":  # the same through tp_size / tp_rank
        planned = surgery.plan_load(
            build(device="meta"),
            work / checkpoint,
            tp_plan=plan,
            tp_size=mesh.size(),
            tp_rank=mesh.get_local_rank(),
            **options,
        ).total_bytes
    ref_state = ref.state_dict()
    unequal, sharded_bytes, other_bytes, placements = [], 0, 0, {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            local, want = value.to_local(), _torch_split(ref_state[key], value)
            if ".experts." in key:
                placements[key] = [repr(p) for p in value.placements]
            if all(isinstance(p, Replicate) for p in value.placements):
                other_bytes += local.nbytes
            else:
                sharded_bytes += local.nbytes
        else:
            local, want = value, ref_state[key]
            other_bytes += local.nbytes
        if not torch.equal(local, want):
            unequal.append(key)
    with torch.no_grad():
        diff = float((_logits(model) - _logits(ref)).abs().max())
    out = work / f"{checkpoint}-saved-{'-'.join(mesh.mesh_dim_names or ('ep',))}"
    files = surgery.save_checkpoint(model, out)
    dist.barrier()
    weights = "model.safetensors"
    runtime_identical = None
    if runtime:  # the fused (runtime) layout too: against a single-process save of the same weights
        surgery.save_checkpoint(model, out.with_name(out.name + "-runtime"), original_format=False)
        dist.barrier()
        if dist.get_rank() == 0:
            single_out = out.with_name(out.name + "-runtime-single")
            surgery.save_checkpoint(ref, single_out, original_format=False)
            runtime_identical = (single_out / weights).read_bytes() == (
                out.with_name(out.name + "-runtime") / weights
            ).read_bytes()
    return {
        "ok": report.ok and single.ok,
        "report": str(report),
        "unequal": unequal,
        "sharded": sorted(placements),
        "placements": placements,
        "forward_max_diff": diff,
        "bytes_read": report.bytes_read,
        "planned_bytes": planned,
        "single_bytes": single.bytes_read,
        "experts_bytes": sharded_bytes,
        "other_bytes": other_bytes,
        "owned_stored_bytes": _owned_stored_bytes(work / checkpoint, owned) if owned is not None else None,
        "wrote": sorted(Path(p).name for p in files),
        # the original (per-expert) layout, whichever layout was loaded
        "saved_identical": (out / weights).read_bytes() == (work / original / weights).read_bytes()
        if dist.get_rank() == 0
        else None,
        "runtime_identical": runtime_identical,
    }


def _gradients(
    work: Path, mesh: Any, parallelize: Any, build: Any = _build, checkpoint: str = "ep-per-expert"
) -> dict[str, Any]:
    """One backward through the expert-parallel model: every rank's gradient of each parameter is
    its slice of the single-process gradient (the experts' own, and the router's and attention's
    that every rank holds whole or in part)."""
    from torch.distributed.tensor import DTensor

    ref = build(device="meta")
    surgery.load_checkpoint(ref, work / checkpoint)
    model = build(device="meta")
    parallelize(model, mesh)
    surgery.load_checkpoint(model, work / checkpoint)
    for m in (ref, model):
        _logits(m).pow(2).mean().backward()
    want = {k: p.grad for k, p in ref.named_parameters()}
    missing, diffs = [], {}
    for key, p in model.named_parameters():
        if p.grad is None:
            missing.append(key)
            continue
        grad = p.grad
        if isinstance(grad, DTensor):  # its local part as the parameter is split (a grad may be Partial)
            grad = grad.redistribute(p.device_mesh, p.placements).to_local()
        expected = _torch_split(want[key], p) if isinstance(p, DTensor) else want[key]
        diffs[key] = float((grad - expected).abs().max())
    worst = max(diffs, key=lambda k: diffs[k]) if diffs else None
    return {"max_grad_diff": diffs.get(worst, 0.0), "worst": worst, "no_grad": missing}


def _ep(model: nn.Module, mesh: Any) -> None:
    from surgery.parallel import parallelize

    parallelize(model, EP_PLAN, mesh)


def _ep_auto(model: nn.Module, mesh: Any) -> None:
    from surgery.parallel import parallelize

    parallelize(model, "auto", mesh)  # a mesh named "ep": the model's ep_plan


def _missing_expert(work: Path, mesh: Any) -> dict[str, Any]:
    """Expert 5 of layer 1 (rank 1's) is absent: every rank's load fails, naming it."""
    try:
        report = surgery.load_checkpoint(
            _build(device="meta"), work / "ep-missing-expert", tp_plan=EP_PLAN, device_mesh=mesh
        )
    except surgery.SurgeryError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None, "ok": report.ok, "report": str(report)}


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

    from surgery.quantization import FP8BlockQuantizer

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("ep",))
    ep_tp = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("ep", "tp"))
    dp_ep = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "ep"))
    if families:
        out: dict[str, Any] = {}
        for f in families:
            load = functools.partial(
                _guarded, _load, build=functools.partial(_transformers_build, f), original=f"ep-{f}"
            )
            out[f] = functools.partial(load, work, mesh, f"ep-{f}", plan="auto", dry={"ep": world})
            out[f"{f}/ep_tp"] = functools.partial(load, work, ep_tp, f"ep-{f}", parallelize=_ep_tp)
            out[f"{f}/dp_ep"] = functools.partial(load, work, dp_ep, f"ep-{f}", parallelize=_dp_ep)
            out[f"{f}/gradients"] = functools.partial(
                _guarded,
                _gradients,
                work,
                mesh,
                _ep_auto,
                functools.partial(_transformers_build, f),
                f"ep-{f}",
            )
        return out
    per = EP_MOE.num_local_experts // world
    owned = range(rank * per, (rank + 1) * per)
    six = moe.ExampleMoEConfig(num_local_experts=6, num_attention_heads=4, num_key_value_heads=2)
    load = functools.partial(_guarded, _load, work)
    fp8 = {"quantizer": FP8BlockQuantizer(block_size=FP8_BLOCK), "original": "ep-per-expert-fp8"}
    dp_ep_dims = {"dp_shard": 2, "ep": world // 2}
    return {
        "per_expert": functools.partial(load, mesh, "ep-per-expert", plan=EP_PLAN, owned=owned, runtime=True),
        "fused": functools.partial(load, mesh, "ep-fused", plan=EP_PLAN, runtime=True),
        "auto": functools.partial(load, mesh, "ep-per-expert", plan="auto", owned=owned, dry={"ep": world}),
        "fp8": functools.partial(load, mesh, "ep-per-expert-fp8", plan=EP_PLAN, owned=owned, **fp8),
        "ep_tp": functools.partial(load, ep_tp, "ep-per-expert", parallelize=_ep_tp, runtime=True),
        "ep_tp_fused": functools.partial(load, ep_tp, "ep-fused", parallelize=_ep_tp),
        "ep_tp_fp8": functools.partial(load, ep_tp, "ep-per-expert-fp8", parallelize=_ep_tp, **fp8),
        "dp_ep_fused": functools.partial(load, dp_ep, "ep-fused", parallelize=_dp_ep, dry=dp_ep_dims),
        "dp_ep_fp8": functools.partial(
            load, dp_ep, "ep-per-expert-fp8", parallelize=_dp_ep, dry=dp_ep_dims, **fp8
        ),
        "dp_ep": functools.partial(
            load, dp_ep, "ep-per-expert", parallelize=_dp_ep, runtime=True, dry=dp_ep_dims
        ),
        "dp_ep_fsdp": functools.partial(  # the convenient path: the ep_plan and FSDP2 in one call
            load, dp_ep, "ep-per-expert", plan="auto", fsdp=True, dry=dp_ep_dims
        ),
        "gradients": functools.partial(_guarded, _gradients, work, mesh, _ep),
        "gradients_ep_tp": functools.partial(_guarded, _gradients, work, ep_tp, _ep_tp),
        "missing_expert": functools.partial(_guarded, _missing_expert, work, mesh),
        "six_experts": functools.partial(_guarded, _refused, work, mesh, six, EP_PLAN),
        "not_experts": functools.partial(
            _guarded, _refused, work, mesh, EP_MOE, {"model.layers.*.mlp.gate": "expert_parallel"}
        ),
    }
