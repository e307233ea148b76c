"""Loads into models parallelized on n-D device meshes, run by every rank of a 4-process gloo group.

:func:`scenarios` lists what each rank executes (the one 4-rank spawn of ``tests/mesh_scenarios.py``). Each mesh
(``dp_shard=2 x tp=2``, ``tp=4``, ``dp_shard=4``, ``dp_replicate=2 x dp_shard=2``) is built once;
for each example model the scenario builds it on meta, parallelizes it the torchtitan way
(``parallelize_module`` on ``mesh["tp"]``, then ``fully_shard`` per decoder layer and at the root
over the data-parallel dims) and calls ``load_checkpoint`` with no ``tp_plan``. It records per
rank, in ``<workdir>/rank<r>.json``: whether every local tensor equals torch's own split
(``distribute_tensor(..., src_data_rank=None)``) of the single-process load, the forward's
agreement with the single-process forward, bytes read against the rank's local and replicated
bytes, and the collectives called during the load.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from fp8_reference import quantize_state
from torch import nn

import surgery
from surgery import WeightConverter, ops
from surgery.checkpoint import write_checkpoint
from surgery.examples import dense, moe
from surgery.parallel import parallelize
from surgery.parallel.regions import Region

DENSE = dense.ExampleDenseConfig(num_attention_heads=4, num_key_value_heads=4)
MOE = moe.ExampleMoEConfig(num_attention_heads=4, num_key_value_heads=4)
WORLD = 4
FP8_BLOCK = (6, 10)  # blocks that straddle every rank boundary, on both dims of a box
STAGING = 4 * 4096  # the smallest staging ring: most tensors cross it in pieces
INPUT_IDS = torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 10]])
MESHES = {
    "dp_shard2_tp2": (("dp_shard", "tp"), (2, 2)),
    "tp4": (("tp",), (4,)),
    "dp_shard4": (("dp_shard",), (4,)),
    "hsdp2x2": (("dp_replicate", "dp_shard"), (2, 2)),
}
ATTENTION_PLAN = {
    "model.embed_tokens": "rowwise",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "lm_head": "colwise_gather",
}
MLP_PLAN = {
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
}
SHARED_EXPERT_PLAN = {
    f"model.layers.*.mlp.shared_expert.{k.rsplit('.', 1)[1]}": v for k, v in MLP_PLAN.items()
}
TRANSFORMERS = {  # interop: (class, config class, config sizes, hand-written tp plan)
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        {"num_key_value_heads": 2},  # grouped-query attention
        {**ATTENTION_PLAN, **MLP_PLAN},
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        {"num_key_value_heads": 2, "num_local_experts": 4, "num_experts_per_tok": 2},
        {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "experts"},
    ),
    "qwen2_moe": (
        "Qwen2MoeForCausalLM",
        "Qwen2MoeConfig",
        {
            "num_key_value_heads": 2,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 32,
            "shared_expert_intermediate_size": 32,
            "decoder_sparse_step": 1,
        },
        {**ATTENTION_PLAN, "model.layers.*.mlp.experts": "experts", **SHARED_EXPERT_PLAN},
    ),
}
SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=128)


def _transformers_model(family: str, *, seed: int | None = 0, device: str = "cpu") -> nn.Module:
    """A tiny transformers model (on meta under ``init_empty``)."""
    import transformers

    cls_name, config_name, sizes, _ = TRANSFORMERS[family]
    config = getattr(transformers, config_name)(**SIZES, **sizes, attn_implementation="sdpa")
    cls = getattr(transformers, cls_name)
    if device == "meta":
        with surgery.init_empty():
            model = cls(config)
    else:
        torch.manual_seed(seed or 0)
        model = cls(config)
    return model.eval()


MODELS = {
    "dense": functools.partial(dense.build_dense_model, DENSE),
    "moe": functools.partial(moe.build_moe_model, MOE),
    **{f: functools.partial(_transformers_model, f) for f in TRANSFORMERS},
}
COUNTED = (
    "all_gather",
    "all_gather_object",
    "all_gather_into_tensor",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "scatter",
    "scatter_object_list",
    "reduce_scatter_tensor",
    "all_to_all",
    "all_to_all_single",
    "send",
    "recv",
    "barrier",
)


def write_inputs(work: Path, families: tuple[str, ...] = ()) -> None:
    """The checkpoints every scenario reads: original layouts written by hand; a transformers
    family's by its own ``save_pretrained``."""
    for family in families:
        MODELS[family](seed=1).save_pretrained(work / family)
    write_checkpoint(dense.original_state_dict(MODELS["dense"](seed=1)), work / "dense")
    write_checkpoint(moe.original_state_dict(MODELS["moe"](seed=2)), work / "moe")
    write_checkpoint({"proj.weight": torch.arange(64.0).reshape(8, 8)}, work / "square")
    fp8 = quantize_state(dense.original_state_dict(MODELS["dense"](seed=4)), FP8_BLOCK)
    write_checkpoint(fp8, work / "dense-fp8")
    write_checkpoint({"proj.weight": torch.arange(48.0).reshape(6, 8) / 2}, work / "fallback")


@contextlib.contextmanager
def counting_collectives() -> Iterator[dict[str, int]]:
    """Count calls of torch.distributed's collectives (each call goes through to torch)."""
    import torch.distributed as dist

    counts: dict[str, int] = {}
    saved = {name: getattr(dist, name) for name in COUNTED}

    def wrap(name: str, fn: Any) -> Any:
        def counted(*args: Any, **kwargs: Any) -> Any:
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)

        return counted

    for name, fn in saved.items():
        setattr(dist, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)


def tp_plan_of(family: str) -> dict[str, Any]:
    """The hand-written tp plan: the example's own, or a transformers family's from :data:`TRANSFORMERS`."""
    if family in TRANSFORMERS:
        return TRANSFORMERS[family][3]
    return dict(MODELS[family](device="meta").tp_plan)


def torchtitan_parallelize(model: nn.Module, mesh: Any, family: str) -> None:
    """TP on ``mesh["tp"]``, then FSDP2 per decoder layer and at the root on the dp dims."""
    from torch.distributed.fsdp import fully_shard

    names = mesh.mesh_dim_names
    if "tp" in names:
        parallelize(model, tp_plan_of(family), mesh["tp"])
    dp = tuple(n for n in names if n.startswith("dp"))
    if dp:
        dp_mesh = mesh[dp] if len(dp) > 1 else mesh[dp[0]]
        for layer in model.model.layers:
            fully_shard(layer, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)


def _local_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes of this rank's shards, bytes of tensors every rank holds whole)."""
    from torch.distributed.tensor import DTensor, Replicate

    local = replicated = 0
    for t in model.state_dict().values():
        if isinstance(t, DTensor) and not all(isinstance(p, Replicate) for p in t.placements):
            local += t.to_local().numel() * t.element_size()
        else:
            replicated += t.numel() * t.element_size()
    return local, replicated


def _torch_split(full: torch.Tensor, like: Any) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None).to_local()


def _torch_flow(ref: nn.Module, family: str, mesh: Any) -> nn.Module:
    """torch's own flow from real weights: the single-process model copied, parallelized and sharded."""
    model = MODELS[family](device="cpu")
    model.load_state_dict(ref.state_dict())
    torchtitan_parallelize(model, mesh, family)
    return model


def _load_scenario(work: Path, mesh: Any, family: str, *, staging_bytes: int | None = None) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    build = MODELS[family]
    ref = build(device="meta")
    assert surgery.load_checkpoint(ref, work / family).ok
    model = build(device="meta")
    torchtitan_parallelize(model, mesh, family)
    planned = _plans_agree(model, work / family, mesh, family)
    with counting_collectives() as counts:
        report = surgery.load_checkpoint(model, work / family, staging_bytes=staging_bytes)
    ref_state, flow_state = ref.state_dict(), _torch_flow(ref, family, mesh).state_dict()
    flow_full_tensor_wrong = [  # torch's own flow, gathered by its declared placements
        k
        for k, v in flow_state.items()
        if isinstance(v, DTensor) and not torch.equal(v.full_tensor(), ref_state[k])
    ]
    unequal, unlike_placements, placements = [], [], {}
    for key, value in model.state_dict().items():
        local = value.to_local() if isinstance(value, DTensor) else value
        flow = flow_state[key].to_local() if isinstance(value, DTensor) else flow_state[key]
        if local.is_meta or not torch.equal(local, flow):
            unequal.append(key)
        if isinstance(value, DTensor):
            placements[key] = [repr(p) for p in value.placements]
            if not torch.equal(local, _torch_split(ref_state[key], value)):
                unlike_placements.append(key)
    local_bytes, replicated = _local_bytes(model)
    with torch.no_grad():
        out, want = _logits(model), _logits(ref)
    return {
        "ok": report.ok,
        "unequal": unequal,
        "unlike_placements": unlike_placements,
        "placements": placements,
        "bytes_read": report.bytes_read,
        "staged_bytes": report.staged_bytes,
        "local_bytes": local_bytes,
        "replicated_bytes": replicated,
        "collectives": counts,
        "forward_max_diff": float((out - want).abs().max()),
        "fallbacks": [list(f.target_keys) for f in report.tp_fallbacks],
        "dry_run_differs": planned,
        "flow_full_tensor_wrong": flow_full_tensor_wrong,
    }


def _logits(model: nn.Module) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    out = model(INPUT_IDS, use_cache=False) if hasattr(model, "generation_config") else model(INPUT_IDS)
    out = getattr(out, "logits", out)
    return out.full_tensor() if isinstance(out, DTensor) else out


def _plans_agree(model: nn.Module, path: Path, mesh: Any, family: str) -> list[str]:
    """The dry run by arithmetic on the mesh's dim sizes plans what this rank's real load plans."""
    import torch.distributed as dist

    names = mesh.mesh_dim_names
    real = surgery.plan_load(model, path)
    dry = surgery.plan_load(
        MODELS[family](device="meta"),
        path,
        tp_plan=tp_plan_of(family) if "tp" in names else None,
        device_mesh=dict(zip(names, mesh.shape)),
        rank=dist.get_rank(),
    )
    want = {e.target_keys: (e.tp, e.nbytes, e.source_keys) for e in real.entries}
    got = {e.target_keys: (e.tp, e.nbytes, e.source_keys) for e in dry.entries}
    return sorted(str(k) for k in set(want) | set(got) if want.get(k) != got.get(k))


def _oracle(work: Path, mesh: Any, family: str = "dense") -> dict[str, Any]:
    """DCP's HuggingFaceStorageReader reads the 1:1 keys into the same placements (a transformers
    family's checkpoint is all 1:1 keys; the dense example's are the ones without a converter)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.tensor import DTensor, distribute_tensor
    from torch.distributed.tensor.placement_types import _StridedShard

    model = MODELS[family](device="meta")
    torchtitan_parallelize(model, mesh, family)
    surgery.load_checkpoint(model, work / family)
    ours = model.state_dict()
    one_to_one = ("o_proj", "down_proj", "v_proj", "embed") if family == "dense" else ("",)
    state = {
        k: distribute_tensor(torch.zeros(v.shape), v.device_mesh, v.placements, src_data_rank=None)
        for k, v in ours.items()
        if isinstance(v, DTensor)
        and any(part in k for part in one_to_one)
        and not any(isinstance(p, _StridedShard) for p in v.placements)
    }
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(work / family)))
    return {
        "placements": sorted({repr(v.placements) for v in state.values()}),
        "unequal": [k for k in state if not torch.equal(state[k].to_local(), ours[k].to_local())],
    }


class Square(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=False)


def _bad_input(work: Path, mesh: Any) -> dict[str, Any]:
    """An uneven strided shard on a 2-D mesh is refused, naming the parameter, dim, size, mesh dim."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    model = Square().to("meta")
    w = DTensor.from_local(
        torch.empty(1, 8, device="meta"),
        mesh,
        (_StridedShard(0, split_factor=3), Shard(0)),
        run_check=False,
        shape=torch.Size((8, 8)),
        stride=(8, 1),
    )
    model.proj.weight = nn.Parameter(w)
    try:
        surgery.load_checkpoint(model, work / "square")
    except surgery.SurgeryError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def _box_without_rule(work: Path, mesh: Any) -> dict[str, Any]:
    """A target cut on two dims behind an op without a slice rule: read whole, reported, exact."""
    from torch.distributed.tensor import DTensor, Shard
    from tp_scenarios import FallbackModel, register_fallback_mapping

    register_fallback_mapping()
    model = FallbackModel().to("meta")
    model.proj.weight = nn.Parameter(
        DTensor.from_local(
            torch.empty(3, 4, device="meta"),
            mesh,
            (Shard(0), Shard(1)),
            run_check=False,
            shape=torch.Size((6, 8)),
            stride=(8, 1),
        )
    )
    report = surgery.load_checkpoint(model, work / "fallback")
    coord = mesh.get_coordinate()
    want = torch.arange(48.0).reshape(6, 8)[3 * coord[0] : 3 * coord[0] + 3, 4 * coord[1] : 4 * coord[1] + 4]
    return {
        "ok": report.ok,
        "fallbacks": [[list(f.target_keys), f.op] for f in report.tp_fallbacks],
        "equal": torch.equal(model.proj.weight.to_local(), want),
        "bytes_read": report.bytes_read,
    }


def _fp8(work: Path, mesh: Any, *, staging_bytes: int | None = None) -> dict[str, Any]:
    """A block-FP8 checkpoint into FSDP2 x TP: each part decoded with the scales it needs, exact."""
    from torch.distributed.tensor import DTensor

    from surgery.quantization import FP8BlockQuantizer

    ref = MODELS["dense"](device="meta")
    assert surgery.load_checkpoint(
        ref, work / "dense-fp8", quantizer=FP8BlockQuantizer(block_size=FP8_BLOCK)
    ).ok
    model = MODELS["dense"](device="meta")
    torchtitan_parallelize(model, mesh, "dense")
    report = surgery.load_checkpoint(
        model,
        work / "dense-fp8",
        quantizer=FP8BlockQuantizer(block_size=FP8_BLOCK),
        staging_bytes=staging_bytes,
    )
    flow = _torch_flow(ref, "dense", mesh).state_dict()
    unequal = [
        k
        for k, v in model.state_dict().items()
        if not torch.equal(v.to_local() if isinstance(v, DTensor) else v, flow[k].to_local())
    ]
    with torch.no_grad():
        diff = float((_logits(model) - _logits(ref)).abs().max())
    return {
        "ok": report.ok,
        "unequal": unequal,
        "forward_max_diff": diff,
        "staged_bytes": report.staged_bytes,
    }


class ColumnsOnlyDoubled(ops.ConversionOp):
    """Doubles; its slice rule serves a cut on dim 1 (columns) only, so a box needs a cover."""

    def __init__(self, factor: float = 2.0) -> None:
        self.factor = factor

    def convert(self, slots, ctx):
        return [t * self.factor for t in slots]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return ColumnsOnlyDoubled(1 / self.factor)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx):
        if all(r is None or (isinstance(r, Region) and r.dim == 1) for r in regions):
            return regions, self
        return None

    def __repr__(self) -> str:
        return f"ColumnsOnlyDoubled({self.factor})"


class CoverModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6, bias=False)


def _box_with_a_cover(work: Path, mesh: Any) -> dict[str, Any]:
    """A box whose rows no rule serves but whose columns one does: read the columns, cut the rows after."""
    from torch.distributed.tensor import DTensor, Shard

    surgery.register_checkpoint_conversion_mapping(
        "CoverModel", [WeightConverter("proj.weight", "proj.weight", [ColumnsOnlyDoubled()])], overwrite=True
    )
    model = CoverModel().to("meta")
    model.proj.weight = nn.Parameter(
        DTensor.from_local(
            torch.empty(3, 4, device="meta"),
            mesh,
            (Shard(0), Shard(1)),
            run_check=False,
            shape=torch.Size((6, 8)),
            stride=(8, 1),
        )
    )
    report = surgery.load_checkpoint(model, work / "fallback")
    coord = mesh.get_coordinate()
    want = torch.arange(48.0).reshape(6, 8)[3 * coord[0] : 3 * coord[0] + 3, 4 * coord[1] : 4 * coord[1] + 4]
    return {
        "ok": report.ok,
        "fallbacks": [[list(f.target_keys), f.op, f.extra_bytes] for f in report.tp_fallbacks],
        "equal": torch.equal(model.proj.weight.to_local(), want),
        "bytes_read": report.bytes_read,
    }


def scenarios(work: Path, _mesh: Any, families: tuple[str, ...]) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {}
    if families:  # interop: the transformers families on the FSDP2 x TP mesh
        names, shape = MESHES["dp_shard2_tp2"]
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for family in families:
            out[f"dp_shard2_tp2/{family}"] = functools.partial(_guarded, _load_scenario, work, mesh, family)
        out["oracle"] = functools.partial(_guarded, _oracle, work, mesh, families[0])
        return out
    for mesh_name, (names, shape) in MESHES.items():
        mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
        for family in ("dense", "moe"):
            out[f"{mesh_name}/{family}"] = functools.partial(_guarded, _load_scenario, work, mesh, family)
        if mesh_name == "dp_shard2_tp2":
            out["oracle"] = functools.partial(_guarded, _oracle, work, mesh)
            out["bad_input"] = functools.partial(_guarded, _bad_input, work, mesh)
            out["box_without_rule"] = functools.partial(_guarded, _box_without_rule, work, mesh)
            out["box_with_a_cover"] = functools.partial(_guarded, _box_with_a_cover, work, mesh)
            out["fp8"] = functools.partial(_guarded, _fp8, work, mesh)
            for family in ("dense", "moe"):  # each rank's boxes through a ring of 4 x 4 KiB
                out[f"staged/{family}"] = functools.partial(
                    _guarded, _load_scenario, work, mesh, family, staging_bytes=STAGING
                )
            out["staged/fp8"] = functools.partial(_guarded, _fp8, work, mesh, staging_bytes=STAGING)
    return out


def _guarded(fn: Any, *args: Any, **kwargs: Any) -> Any:
    import traceback

    try:
        return fn(*args, **kwargs)
    except Exception:
        return {"error": traceback.format_exc()}
