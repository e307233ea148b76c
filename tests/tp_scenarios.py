"""Tensor-parallel scenarios run by every rank of a real 2-process gloo group.

:func:`run` is the body each rank executes (spawned by ``tests/test_parallel_loading.py`` with
``torch.multiprocessing.spawn``, or launched by ``torchrun`` through ``python tests/tp_scenarios.py``);
it records facts per rank in ``<workdir>/rank<r>.json``, and the tests assert on them. The
checkpoints are written by the test process beforehand (:func:`write_checkpoints`).
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from fp8_reference import quantize_state
from packed_scenarios import run_packed, write_packed_checkpoints
from torch import nn

import surgery
from surgery import WeightConverter, ops
from surgery.checkpoint import open_checkpoint, write_checkpoint
from surgery.examples import dense, moe
from surgery.quantization import FP8BlockQuantizer, quantizer_by_name
from surgery.record import record_of

DENSE = dense.ExampleDenseConfig()
MOE = moe.ExampleMoEConfig(num_attention_heads=4, num_key_value_heads=2)
INPUT_IDS = torch.tensor([[1, 5, 9, 3, 7], [2, 4, 6, 8, 10]])
FP8_BLOCK = (6, 10)  # blocks that straddle every rank boundary, edge blocks in both dims
NAN_SCALE = "model.layers.0.self_attn.q_proj.weight_scale_inv"
CT_SCHEMES = ("w4", "w4asym", "w8", "fp8", "g16")
"""The compressed-tensors schemes written by :func:`write_checkpoints` (see :func:`_ct_schemes`)."""


def _ct_schemes() -> dict[str, Any]:
    """The schemes by name; o_proj and down_proj (16 and 32 columns) split by columns into halves
    of 8 and 16. compressed-tensors is imported here, in the process that writes the checkpoints
    only: importing it costs each rank seconds it does not need."""
    from ct_reference import scheme

    return {
        "w4": scheme(num_bits=4, strategy="group", group_size=8),
        "w4asym": scheme(num_bits=4, strategy="group", group_size=8, symmetric=False),
        "w8": scheme(num_bits=8, strategy="channel"),
        "fp8": scheme("FP8"),
        "g16": scheme(num_bits=4, strategy="group", group_size=16),  # o_proj's halves split its one group
    }


class Doubled(ops.ConversionOp):
    """A custom op without a slice rule (its inverse halves): forces the tensor-parallel fallback."""

    def __init__(self, factor: float = 2.0) -> None:
        self.factor = factor

    def convert(self, slots, ctx):
        return [s * self.factor for s in slots]

    @property
    def reverse_op(self) -> ops.ConversionOp:
        return Doubled(1 / self.factor)

    def __repr__(self) -> str:
        return f"Doubled({self.factor})"


class FallbackModel(nn.Module):
    """One Linear whose checkpoint weight is stored halved (undone by :class:`Doubled`)."""

    tp_plan = {"proj": "colwise"}

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 6, bias=False)


def register_fallback_mapping() -> None:
    surgery.register_checkpoint_conversion_mapping(
        "FallbackModel",
        [WeightConverter("proj.weight", "proj.weight", [Doubled()])],
        overwrite=True,
    )


class PaddedHeadModel(nn.Module):
    """A colwise-sharded unembedding loaded without the checkpoint's two padding rows."""

    tp_plan = {"lm_head": "colwise"}

    def __init__(self) -> None:
        super().__init__()
        self.lm_head = nn.Linear(8, 6, bias=False)


def register_padded_head_mapping() -> None:
    from specs.inkling2 import Inkling2UnpadVocab

    surgery.register_checkpoint_conversion_mapping(
        "PaddedHeadModel",
        [WeightConverter(r"^unembed\.weight$", "lm_head.weight", [Inkling2UnpadVocab()])],
        overwrite=True,
    )


def write_checkpoints(work: Path) -> None:
    """The checkpoints every scenario reads (original layouts, written by hand)."""
    write_checkpoint(dense.original_state_dict(dense.build_dense_model(DENSE, seed=1)), work / "dense")
    write_checkpoint(moe.original_state_dict(moe.build_moe_model(MOE, seed=2)), work / "moe")
    torch.manual_seed(3)
    write_checkpoint({"proj.weight": torch.randn(6, 8) / 2}, work / "fallback")
    write_checkpoint({"unembed.weight": torch.randn(8, 8)}, work / "padded")  # rows 6, 7: padding
    fp8 = quantize_state(dense.original_state_dict(dense.build_dense_model(DENSE, seed=4)), FP8_BLOCK)
    write_checkpoint(fp8, work / "dense-fp8")
    nan = dict(fp8)  # a NaN in the scale block of rows 12-16 of one q_proj: rows only rank 1 reads
    nan[NAN_SCALE] = nan[NAN_SCALE].clone()
    nan[NAN_SCALE][2, 0] = float("nan")
    write_checkpoint(nan, work / "dense-fp8-nan")
    write_packed_checkpoints(work, dense.original_state_dict(dense.build_dense_model(DENSE, seed=8)))
    from ct_reference import compress_state

    schemes = _ct_schemes()
    assert tuple(schemes) == CT_SCHEMES
    for name, quant in schemes.items():  # compressed-tensors, written by its own compressors
        original = dense.original_state_dict(dense.build_dense_model(DENSE, seed=6))
        compress_state(original, quant, work / f"dense-ct-{name}", quantized=lambda k: "_proj." in k)
    experts = moe.original_state_dict(moe.build_moe_model(MOE, seed=7))  # per-expert packed weights, merged
    compress_state(
        experts, schemes["w4"], work / "moe-ct-w4", quantized=lambda k: "_proj." in k or ".experts." in k
    )


def _single(build, path: Path) -> nn.Module:
    model = build(device="meta")
    report = surgery.load_checkpoint(model, path)
    assert report.ok, report
    return model


def _compare(tp_model: nn.Module, ref: nn.Module) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    ref_state = ref.state_dict()
    unequal, kinds = [], {}
    for key, value in tp_model.state_dict().items():
        full = value.full_tensor() if isinstance(value, DTensor) else value
        kinds[key] = [repr(p) for p in value.placements] if isinstance(value, DTensor) else None
        if full.shape != ref_state[key].shape or not torch.equal(full, ref_state[key]):
            unequal.append(key)
    with torch.no_grad():
        out, expected = tp_model(INPUT_IDS), ref(INPUT_IDS)
    return {
        "unequal": unequal,
        "placements": kinds,
        "max_abs_diff": float((out - expected).abs().max()),
        "output_shape": list(out.shape),
    }


def _files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


def _family(name: str, build, original_state_dict, work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    import torch.distributed as dist

    ckpt = work / name
    ref = _single(build, ckpt)
    model = build(device="meta")
    report = surgery.load_checkpoint(model, ckpt, tp_plan="auto", device_mesh=mesh)
    facts: dict[str, Any] = {
        "ok": report.ok,
        "report": str(report),
        "bytes_read": report.bytes_read,
        "tp": [report.tp_world_size, report.tp_rank],
        "fallbacks": [str(f) for f in report.tp_fallbacks],
        "modes": {e.target_keys[0]: e.mode for e in report.plan.entries},
        "entry_tp": {e["target_keys"][0]: e["tp"] for e in report.plan.to_dict()["entries"]},
        "single_bytes": sum(p.stat().st_size for p in ckpt.iterdir()),
        "plan_bytes": report.plan.total_bytes,
    }
    dry = surgery.plan_load(build(device="meta"), ckpt, tp_plan="auto", tp_size=2, tp_rank=rank)
    facts["dry_run_matches"] = [(e.target_keys, e.tp, e.nbytes) for e in dry.entries] == [
        (e.target_keys, e.tp, e.nbytes) for e in report.plan.entries
    ]
    facts.update(_compare(model, ref))
    reverted = surgery.revert_state_dict(model)
    original = original_state_dict(ref)
    facts["reverted_equal"] = sorted(reverted) == sorted(original) and all(
        torch.equal(reverted[k], original[k]) for k in original
    )
    out = work / f"{name}-saved"
    files = surgery.save_checkpoint(model, out)
    dist.barrier()
    facts["saved_files"] = [Path(f).name for f in files]
    if rank == 0:
        facts["saved_identical"] = _files(out) == _files(ckpt)
    return facts


def dense_build(**kwargs: Any) -> nn.Module:
    return dense.build_dense_model(DENSE, seed=None, **kwargs)


def moe_build(**kwargs: Any) -> nn.Module:
    return moe.build_moe_model(MOE, seed=None, **kwargs)


def _share_bytes(model: nn.Module, ckpt: Path, rank: int, world: int, companions: Any, covering: Any) -> int:
    """The bytes a rank must read of ``ckpt``: its share of each weight and, of each of its
    ``companions(key) -> names``, the part covering that share (``covering(name, tensor, dim,
    interval) -> bytes``, ``None``: all of it); replicated tensors whole. Shares come from the
    loaded model's placements: a source of a sharded parameter is split evenly on the sharded dim."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    dims: dict[str, int] = {}
    for key, value in model.state_dict().items():
        shard = (
            [p for p in value.placements if hasattr(p, "dim")] if isinstance(value, DTensor) else []
        )  # strided too
        if shard:
            dims[key.rpartition(".")[0]] = shard[0].dim
    total = 0
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        claimed = {c for k in keys for c in companions(k) if c in keys}
        for key in keys - claimed:
            t = f.get_tensor(key)
            module = key.rpartition(".")[0]
            for part in (".gate_proj", ".up_proj"):  # fused into gate_up_proj at load
                module = module.removesuffix(part) + ".gate_up_proj" if module.endswith(part) else module
            dim, mine = dims.get(module), [c for c in companions(key) if c in keys]
            if dim is None or t.dim() == 0:
                total += t.nbytes + sum(f.get_tensor(c).nbytes for c in mine)
                continue
            per = t.shape[dim] // world
            total += t.nbytes // world
            for c in mine:
                scale = f.get_tensor(c)
                part = covering(c.rpartition(".")[2], scale, dim, (rank * per, (rank + 1) * per))
                total += scale.nbytes if part is None else part
    return total


def _covered(interval: tuple[int, int], unit: int) -> int:
    """How many units of ``unit`` elements the ``interval`` touches."""
    return -(-interval[1] // unit) - interval[0] // unit


def _fp8_companions(key: str) -> list[str]:
    return [key + "_scale_inv"]


def _fp8_covering(name: str, scale: torch.Tensor, dim: int, interval: tuple[int, int]) -> int:
    """Block scales covering ``interval`` of ``dim``: the blocks it touches, all blocks of the other dim."""
    return _covered(interval, FP8_BLOCK[dim]) * scale.shape[1 - dim] * scale.element_size()


def _fp8(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """An FP8 checkpoint: each rank decodes only its slices, with the scale rows they cover."""
    import torch.distributed as dist

    ckpt = work / "dense-fp8"
    ref = dense_build(device="meta")
    single = surgery.load_checkpoint(ref, ckpt, quantizer=FP8BlockQuantizer(block_size=FP8_BLOCK))
    model = dense_build(device="meta")
    report = surgery.load_checkpoint(
        model, ckpt, tp_plan="auto", device_mesh=mesh, quantizer=FP8BlockQuantizer(block_size=FP8_BLOCK)
    )
    facts: dict[str, Any] = {
        "ok": report.ok and single.ok,
        "report": str(report),
        "bytes_read": report.bytes_read,
        "single_bytes": single.bytes_read,
        "fallbacks": [str(f) for f in report.tp_fallbacks],
        "share_bytes": _share_bytes(model, ckpt, rank, mesh.size(), _fp8_companions, _fp8_covering),
    }
    facts.update(_compare(model, ref))
    out = work / "dense-fp8-saved"
    surgery.save_checkpoint(model, out)
    dist.barrier()
    if rank == 0:
        facts["saved_identical"] = _files(out) == _files(ckpt)
    return facts


def _nan_scale_one_rank_reads(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """A NaN scale only rank 1 reads: the load fails on both ranks with one error."""
    model = dense_build(device="meta")
    try:
        surgery.load_checkpoint(
            model,
            work / "dense-fp8-nan",
            tp_plan="auto",
            device_mesh=mesh,
            quantizer=FP8BlockQuantizer(block_size=FP8_BLOCK),
        )
    except surgery.SurgeryError as exc:
        return {
            "raised": type(exc).__name__,
            "message": str(exc),
            "unchanged": all(p.device.type == "meta" for p in model.parameters()),
        }
    return {"raised": None}


def _missing_on_one_rank(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """Rank 1 is given a checkpoint path that does not exist: both ranks raise its error."""
    try:
        surgery.load_checkpoint(
            dense_build(device="meta"),
            work / ("nowhere" if rank == 1 else "dense"),
            tp_plan="auto",
            device_mesh=mesh,
        )
    except surgery.SurgeryError as exc:
        return {"raised": type(exc).__name__, "message": str(exc)}
    return {"raised": None}


def _ct_expected_bytes(ckpt: Path, rank: int, world: int) -> int:
    """The bytes a rank must read of a compressed-tensors dense checkpoint at TP=``world``.

    The dense plan splits q/k/v and gate/up by out-features (rows), o/down by in-features
    (columns), the embedding and head by vocabulary rows, and replicates the norms. A rank reads
    its share of every split float and of each packed or FP8 weight; of ``weight_scale`` its rows
    (an out-feature split) or its groups (an in-feature split; a per-channel ``[N, 1]`` scale
    whole); of ``weight_zero_point`` (rows packed 8 to an int32 word) the words holding its rows,
    or its groups; ``weight_shape`` and other per-tensor values whole, once.
    """
    from safetensors import safe_open

    total = 0
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        for key in sorted(f.keys()):
            module, _, name = key.rpartition(".")
            t = f.get_tensor(key)
            shape, nbytes = tuple(t.shape), t.nbytes
            out_split = module.rpartition(".")[2] not in ("o_proj", "down_proj")
            if name == "weight" and "_proj" not in module:
                split = "embed_tokens" in module or module == "lm_head"
                total += nbytes // world if split else nbytes
            elif name in ("weight", "weight_packed"):
                total += nbytes // world
            elif len(shape) < 2:  # weight_shape, per-tensor scales
                total += nbytes
            elif name == "weight_scale":
                total += nbytes if not out_split and shape[1] == 1 else nbytes // world
            elif name == "weight_zero_point" and out_split:
                per = int(f.get_tensor(f"{module}.weight_shape")[0]) // world
                words = _covered((rank * per * 4, (rank + 1) * per * 4), 32)
                total += words * shape[1] * t.element_size()
            elif name == "weight_zero_point":
                total += nbytes if shape[1] == 1 else nbytes // world
            else:
                raise AssertionError(f"{key}: not in the compressed-tensors layout this counts")
    return total


def _compressed_tensors(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """compressed-tensors checkpoints: each rank reads its share of the packed words and decodes it."""
    import torch.distributed as dist

    facts: dict[str, Any] = {}
    for name in [*CT_SCHEMES, "moe-w4"]:
        build = moe_build if name.startswith("moe") else dense_build
        ckpt = work / (f"moe-ct-{name[4:]}" if name.startswith("moe") else f"dense-ct-{name}")
        quantizer = quantizer_by_name("auto", ckpt)
        model = build(device="meta")
        report = surgery.load_checkpoint(model, ckpt, tp_plan="auto", device_mesh=mesh, quantizer=quantizer)
        if name == "g16":
            facts[name] = {"errors": [f.message for f in report.conversion_errors]}
            continue
        ref = build(device="meta")
        single = surgery.load_checkpoint(ref, ckpt, quantizer=quantizer_by_name("auto", ckpt))
        facts[name] = {
            "ok": report.ok and single.ok,
            "report": str(report),
            "bytes_read": report.bytes_read,
            "single_bytes": single.bytes_read,
            "expected_bytes": _ct_expected_bytes(ckpt, rank, mesh.size()),
            "fallbacks": [str(f) for f in report.tp_fallbacks],
            **_compare(model, ref),
        }
        out = work / f"{ckpt.name}-saved"
        surgery.save_checkpoint(model, out)
        dist.barrier()
        if rank == 0:
            facts[name]["saved_identical"] = _files(out) == _files(ckpt)
    return facts


def _oracle(work: Path, mesh: Any) -> dict[str, Any]:
    """torch.distributed.checkpoint's HuggingFaceStorageReader reads the same slices of 1:1 keys."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.tensor import DTensor, distribute_tensor

    ckpt = work / "dense"
    model = dense_build(device="meta")
    surgery.load_checkpoint(model, ckpt, tp_plan="auto", device_mesh=mesh)
    state = {}
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor) and (
            "v_proj" in key or "o_proj" in key or "down_proj" in key or "embed" in key
        ):
            state[key] = distribute_tensor(
                torch.zeros(value.shape), mesh, value.placements, src_data_rank=None
            )
    dcp.load(state, storage_reader=HuggingFaceStorageReader(str(ckpt)))
    ours = model.state_dict()
    return {
        "keys": sorted(state),
        "placements": sorted({repr(v.placements) for v in state.values()}),
        "equal": all(torch.equal(state[k].to_local(), ours[k].to_local()) for k in state),
    }


def _fallback(work: Path, mesh: Any) -> dict[str, Any]:
    from torch.distributed.tensor import DTensor

    register_fallback_mapping()
    ref = FallbackModel().to("meta")
    surgery.load_checkpoint(ref, work / "fallback")
    model = FallbackModel().to("meta")
    report = surgery.load_checkpoint(model, work / "fallback", tp_plan="auto", device_mesh=mesh)
    w = model.proj.weight
    return {
        "ok": report.ok,
        "fallbacks": [[list(f.target_keys), f.op, f.extra_bytes] for f in report.tp_fallbacks],
        "bytes_read": report.bytes_read,
        "equal": isinstance(w, DTensor) and torch.equal(w.full_tensor(), ref.proj.weight),
        "local_rows": list(w.to_local().shape) if isinstance(w, DTensor) else None,
    }


def _padded_head(work: Path, rank: int, mesh: Any) -> dict[str, Any]:
    """Every rank records the whole padding rows (the op runs on whole tensors); the save puts them back."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    register_padded_head_mapping()
    model = PaddedHeadModel().to("meta")
    report = surgery.load_checkpoint(model, work / "padded", tp_plan="auto", device_mesh=mesh)
    record = record_of(model).load
    with open_checkpoint(work / "padded") as reader:
        hub = reader.get_tensor("unembed.weight")
    w = model.lm_head.weight
    files = surgery.save_checkpoint(model, work / "padded-saved")
    dist.barrier()
    return {
        "ok": report.ok,
        "local_rows": list(w.to_local().shape) if isinstance(w, DTensor) else None,
        "residue_rows": list(record.residues) if record is not None else None,
        "residue_equal": record is not None and torch.equal(record.residues["lm_head.weight"], hub[6:]),
        "saved_files": [Path(f).name for f in files],
        "saved_identical": rank != 0 or _files(work / "padded-saved") == _files(work / "padded"),
    }


def _cpu_model(work: Path, mesh: Any) -> dict[str, Any]:
    """A model built on CPU (random weights) is parallelized without communication, then loaded."""
    ref = _single(dense_build, work / "dense")
    model = dense_build()
    report = surgery.load_checkpoint(model, work / "dense", tp_plan="auto", device_mesh=mesh)
    facts = _compare(model, ref)
    facts["ok"] = report.ok
    return facts


def _already_parallel(work: Path, mesh: Any) -> dict[str, Any]:
    from surgery.parallel import parallelize

    ref = _single(dense_build, work / "dense")
    model = dense_build(device="meta")
    parallelize(model, "auto", mesh)
    report = surgery.load_checkpoint(model, work / "dense")
    facts = _compare(model, ref)
    facts["ok"] = report.ok
    try:
        surgery.load_checkpoint(model, work / "dense", tp_plan="auto", device_mesh=mesh)
        facts["with_plan"] = "returned"
    except surgery.ConfigurationError as exc:
        facts["with_plan"] = str(exc)
    return facts


def _errors(work: Path, mesh: Any) -> dict[str, str]:
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, str] = {}
    two_d = init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))
    cases = {
        "two_d_mesh": dict(tp_plan="auto", device_mesh=two_d),
        "unknown_style": dict(tp_plan={"lm_head": "diagonal"}, device_mesh=mesh),
        "no_match": dict(tp_plan={"model.layer.*.mlp": "colwise"}, device_mesh=mesh),
        "mesh_without_plan": dict(device_mesh=mesh),
    }
    for name, kwargs in cases.items():
        model = dense_build(device="meta")
        before = {k: type(v).__name__ for k, v in model.state_dict().items()}
        try:
            surgery.load_checkpoint(model, work / "dense", **kwargs)
            out[name] = "returned"
        except surgery.ConfigurationError as exc:
            unchanged = before == {k: type(v).__name__ for k, v in model.state_dict().items()}
            out[name] = f"ConfigurationError unchanged={unchanged}: {exc}"
    # strict refuses what the headers show after parallelizing: the parallelization is undone
    model = dense_build()
    before = {k: (type(v).__name__, v.clone()) for k, v in model.state_dict().items()}
    try:
        surgery.load_checkpoint(model, work / "moe", tp_plan="auto", device_mesh=mesh, strict=True)
        out["strict"] = "returned"
    except surgery.LoadError:
        after = model.state_dict()
        same = all(type(after[k]).__name__ == t and torch.equal(after[k], v) for k, (t, v) in before.items())
        out["strict"] = (
            f"LoadError unchanged={same} hooks={sum(len(m._forward_hooks) for m in model.modules())}"
        )
    return out


def _packed_guard(mesh: Any) -> dict[str, Any]:
    """``_StridedShard`` still exists, and packed_colwise keeps [G_r | U_r] per rank in forward."""
    from torch.distributed.tensor.parallel import parallelize_module

    from surgery.parallel import PackedColwiseParallel

    torch.manual_seed(0)
    full = nn.Linear(4, 8)
    x = torch.randn(3, 4)
    expected = full(x)
    local = nn.Linear(4, 8)
    local.load_state_dict(full.state_dict())
    parallelize_module(local, mesh, PackedColwiseParallel(), src_data_rank=None)
    out = local(x)
    rank = mesh.get_local_rank()
    gate, up = expected.chunk(2, dim=-1)
    want = torch.cat([gate.chunk(2, dim=-1)[rank], up.chunk(2, dim=-1)[rank]], dim=-1)
    return {"type": type(out).__name__, "max_abs_diff": float((out - want).abs().max())}


def run(rank: int, world: int, workdir: str, torchrun: bool = False) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    work = Path(workdir)
    torch.set_num_threads(1)
    if torchrun:
        mesh = init_device_mesh("cpu", (int(os.environ["WORLD_SIZE"]),))
        rank = dist.get_rank()
    else:
        dist.init_process_group("gloo", init_method=f"file://{work}/pg", rank=rank, world_size=world)
        mesh = init_device_mesh("cpu", (world,))
    facts: dict[str, Any] = {}
    try:
        facts["dense"] = _family("dense", dense_build, dense.original_state_dict, work, rank, mesh)
        if not torchrun:
            facts["moe"] = _family("moe", moe_build, moe.original_state_dict, work, rank, mesh)
            facts["oracle"] = _oracle(work, mesh)
            facts["fp8"] = _fp8(work, rank, mesh)
            facts["nan_scale"] = _nan_scale_one_rank_reads(work, rank, mesh)
            facts["missing_on_one_rank"] = _missing_on_one_rank(work, rank, mesh)
            facts["compressed_tensors"] = _compressed_tensors(work, rank, mesh)
            facts["fallback"] = _fallback(work, mesh)
            facts["padded_head"] = _padded_head(work, rank, mesh)
            facts["already_parallel"] = _already_parallel(work, mesh)
            facts["cpu_model"] = _cpu_model(work, mesh)
            facts["errors"] = _errors(work, mesh)
            facts["packed"] = _packed_guard(mesh)
            facts["gptq_awq"] = run_packed(
                work, rank, mesh, build=dense_build, compare=_compare, files=_files
            )
    except Exception:
        facts["crash"] = traceback.format_exc()
    (work / f"rank{rank}.json").write_text(json.dumps(facts, default=str))
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # no interpreter teardown with a live gloo group: see tests/distsave_scenarios.py


if (
    __name__ == "__main__"
):  # torchrun entry: python -m torch.distributed.run ... tests/tp_scenarios.py WORKDIR
    run(-1, -1, sys.argv[1], torchrun=True)
