"""GPTQ and AWQ under tensor parallelism: scenarios :mod:`tp_scenarios` runs in its one spawn.

Each rank reads only its share of the packed words (``stored_region``) plus the parts of the
zeros, scales and ``g_idx`` that cover it (``companion_region``; every group under act-order),
exactly the bytes :func:`expected_bytes` counts from the layouts, decodes it, and must hold
exactly the slice of the single-process decode; a save from the parallel model writes the original files back. The dense example splits
``k_proj``/``v_proj`` (8 out-features) into halves of 4: inside an AWQ word (8 out-features), so
that checkpoint fails on exactly those keys, naming them.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from packed_reference import awq_state, gptq_state

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.quantization import AWQQuantizer, GPTQQuantizer

__all__ = ["expected_bytes", "run_packed", "write_packed_checkpoints"]

GROUP = 8


def _quantizers() -> dict[str, Any]:
    return {
        "gptq": GPTQQuantizer.from_config(
            {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True}
        ),
        "gptq-ordered": GPTQQuantizer.from_config(
            {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": False}
        ),
        "awq": AWQQuantizer.from_config(
            {"quant_method": "awq", "bits": 4, "group_size": GROUP, "version": "gemm"}
        ),
        "awq-kv": AWQQuantizer.from_config({"quant_method": "awq", "bits": 4, "group_size": GROUP}),
    }


def write_packed_checkpoints(work: Path, original: dict[str, Any]) -> None:
    """GPTQ (act-order) and AWQ versions of the dense example's projections (``original``: its state)."""
    # gate_proj/up_proj are fused into gate_up_proj: the save splits it by their decoded shapes
    proj = lambda k: "_proj." in k  # noqa: E731
    unsplit_kv = lambda k: proj(k) and "k_proj" not in k and "v_proj" not in k  # noqa: E731
    write_checkpoint(gptq_state(original, GROUP, proj), work / "dense-gptq")
    write_checkpoint(gptq_state(original, GROUP, proj, act_order=False), work / "dense-gptq-ordered")
    write_checkpoint(awq_state(original, GROUP, unsplit_kv), work / "dense-awq")
    write_checkpoint(awq_state(original, GROUP, proj), work / "dense-awq-kv")


def run_packed(work: Path, rank: int, mesh: Any, *, build, compare, files) -> dict[str, Any]:
    """Facts per checkpoint: equality with the single-process load, bytes read, the save, errors."""
    import torch.distributed as dist

    facts: dict[str, Any] = {}
    for name, quantizer in _quantizers().items():
        ckpt = work / f"dense-{name}"
        model = build(device="meta")
        report = surgery.load_checkpoint(model, ckpt, tp_plan="auto", device_mesh=mesh, quantizer=quantizer)
        if name == "awq-kv":
            facts[name] = {"errors": [f.message for f in report.conversion_errors]}
            continue
        ref = build(device="meta")
        single = surgery.load_checkpoint(ref, ckpt, quantizer=quantizer)
        facts[name] = {
            "ok": report.ok and single.ok,
            "report": str(report),
            "bytes_read": report.bytes_read,
            "single_bytes": single.bytes_read,
            "fallbacks": [str(f) for f in report.tp_fallbacks],
            "expected_bytes": expected_bytes(ckpt, rank, mesh.size(), act_order=name == "gptq"),
        }
        if not facts[name]["ok"]:  # a parameter left on meta cannot be compared
            continue
        facts[name].update(compare(model, ref))
        out = work / f"dense-{name}-saved"
        surgery.save_checkpoint(model, out)
        dist.barrier()
        if rank == 0:
            facts[name]["saved_identical"] = files(out) == files(ckpt)
    return facts


def _share(interval: tuple[int, int], unit: int) -> int:
    """How many units of ``unit`` the ``interval`` touches."""
    return -(-interval[1] // unit) - interval[0] // unit


def expected_bytes(ckpt: Path, rank: int, world: int, *, act_order: bool) -> int:
    """The bytes rank ``rank`` must read of the dense example's GPTQ or AWQ checkpoint at TP=``world``.

    The dense example's plan splits q/k/v and gate/up by out-features, o/down by in-features, the
    embedding and the head by vocabulary rows, and replicates the norms. A rank reads its share of
    every split float, its share of each ``qweight``'s words, the ``scales`` columns and ``qzeros``
    words of its out-features, or the ``scales``/``qzeros`` rows of the groups its in-features
    fall in (every group under act-order) and its rows of ``g_idx`` (all of them for an
    out-feature split).
    """
    from safetensors import safe_open

    total = 0
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        for key in sorted(keys):
            module, _, name = key.rpartition(".")
            t = f.get_slice(key)
            shape = t.get_shape()
            nbytes = math.prod(shape) * (2 if t.get_dtype() in ("F16", "BF16") else 4)
            if name == "weight":  # floats: the split ones by half, norms whole
                split = "_proj" in module or "embed_tokens" in module or module == "lm_head"
                total += nbytes // world if split else nbytes
                continue
            out_split = module.rpartition(".")[2] not in ("o_proj", "down_proj")
            gptq = f"{module}.g_idx" in keys
            qweight = f.get_slice(f"{module}.qweight").get_shape()
            k, n = (qweight[0] * 8, qweight[1]) if gptq else (qweight[0], qweight[1] * 8)
            size = n if out_split else k
            mine = (rank * size // world, (rank + 1) * size // world)
            if name == "qweight":
                total += nbytes // world
            elif name == "g_idx":
                total += nbytes if out_split else nbytes // world
            elif out_split:  # every group; the columns or zero words of these out-features
                unit = 1 if name == "scales" else 8
                total += shape[0] * _share(mine, unit) * (nbytes // (shape[0] * shape[1]))
            elif act_order and gptq:
                total += nbytes
            else:  # the groups these in-features fall in
                total += _share(mine, GROUP) * shape[1] * (nbytes // (shape[0] * shape[1]))
    return total
