"""GPTQ and AWQ under tensor parallelism: scenarios :mod:`tp_scenarios` runs in its one spawn.

Each rank reads only its share of the packed words (``stored_region``) plus the whole (small)
zeros, scales and ``g_idx``, decodes it, and must hold exactly the slice of the single-process
decode; a save from the parallel model writes the original files back. The dense example splits
``k_proj``/``v_proj`` (8 out-features) into halves of 4: inside an AWQ word (8 out-features), so
that checkpoint fails on exactly those keys, naming them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from packed_reference import awq_state, gptq_state

import surgery
from surgery.checkpoint import write_checkpoint
from surgery.quantization import AWQQuantizer, GPTQQuantizer

__all__ = ["run_packed", "write_packed_checkpoints"]

GROUP = 8


def _quantizers() -> dict[str, Any]:
    return {
        "gptq": GPTQQuantizer.from_config(
            {"quant_method": "gptq", "bits": 4, "group_size": GROUP, "desc_act": True}
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
