"""Benchmark A (throughput), part of ``surgery bench load``: a ~1 GB checkpoint with large tensors.

A bfloat16 checkpoint with per-expert keys, in 500 MB shards, loaded by
:func:`surgery.load_checkpoint` into the fused-experts runtime model (a) allocated, (b) built on
``meta``, and (c) the runtime-layout file memory-mapped into a ``meta`` model (zero copy). The
floor is ``safetensors.torch.load_file(backend="pread")`` of the already-converted file plus
``model.load_state_dict``; transformers' ``MixtralForCausalLM.from_pretrained`` of the same
per-expert checkpoint runs when it is installed. Info rows bound what a load can reach (``preadv``
into touched or fresh memory), and two cold-cache rows read from disk.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from .checkpoints import config_for_size, prepare
from .harness import MB, Row, Servers, measure, result_of, table, verdict, warm

__all__ = ["bench"]

TARGET_A = 1.15
TARGET_VS_HF = 1.5
TARGET_RSS = 1.2
TARGET_ZERO_COPY_S_PER_GB = 0.04


def bench(
    workdir: Path, size_gb: float, repeat: int, hf: bool, *, servers: Servers
) -> tuple[str, list[str], dict[str, Any]]:
    cfg = config_for_size(size_gb)
    info = prepare(workdir, "A", cfg, runtime_file=True)
    original, runtime = workdir / "A" / "original", workdir / "A" / "runtime.safetensors"
    warm([original, runtime])
    spec = {"config": asdict(cfg), "original": str(original), "runtime": str(runtime)}
    mb = info["model_bytes"]
    rows: list[Row] = []
    plan = [
        ("floor", "floor: load_file(pread) + load_state_dict (runtime)"),
        ("floor_assign", "  info: load_file(pread) + load_state_dict(assign)"),
        ("floor_touched", "  info: preadv into touched memory (bandwidth limit)"),
        ("floor_fresh", "  info: preadv into a fresh torch.empty (page faults)"),
        ("floor_fresh_threads", "  info: the same, one thread per core (faults in parallel)"),
        ("floor_fresh_huge", "  info: the same, advised MADV_HUGEPAGE"),
        ("floor_fresh_populate", "  info: the same, MADV_POPULATE_WRITE per core first"),
        ("ours_alloc", "(a) surgery per-expert -> allocated model"),
        ("ours_meta", "(b) surgery per-expert -> meta model"),
        ("ours_mmap", "(c) surgery runtime file -> meta model (zero copy)"),
        ("ours_runtime_alloc", "  info: surgery runtime file -> allocated model"),
    ]
    if hf and info["hf_config"]:
        plan.append(("hf", "transformers MixtralForCausalLM.from_pretrained"))
    plan += [
        ("floor_touched_cold", "cold cache: preadv into touched memory (disk read)"),
        ("ours_meta_cold", "cold cache: (b) surgery per-expert -> meta model"),
    ]
    for name, label in plan:
        measure(servers, rows, name, label, spec, repeat)
    warm([original, runtime])
    title = (
        f"A: Mixtral-style bf16, {mb / 2**30:.2f} GiB, {cfg.num_hidden_layers} layers x "
        f"{cfg.num_local_experts} experts (H={cfg.hidden_size}, I={cfg.intermediate_size}), "
        f"{info['keys']} per-expert keys in {info['shards']} shards; best of {repeat} runs"
    )
    out = [title, table(rows, "floor", mb)]
    floor, a, b, c, h = (result_of(rows, n) for n in ("floor", "ours_alloc", "ours_meta", "ours_mmap", "hf"))
    verdicts: list[str] = []
    for tag, r in (("(a)", a), ("(b)", b)):
        what = f"A{tag} time within {TARGET_A}x of floor"
        if r is None or floor is None:
            verdicts.append(verdict(None, f"{what}: not measured"))
        else:
            ratio = r["total_s"] / floor["total_s"]
            verdicts.append(verdict(ratio <= TARGET_A, f"{what}: {ratio:.2f}x"))
    for tag, r in (("(a)", a), ("(b)", b)):
        what = f"A{tag} peak RSS growth under {TARGET_RSS}x model size"
        if r is None:
            verdicts.append(verdict(None, f"{what}: not measured"))
        else:
            rel = r["delta"] / mb
            text = f"{what}: {rel:.2f}x ({r['delta'] / MB:.0f} MiB for {mb / MB:.0f} MiB)"
            verdicts.append(verdict(rel < TARGET_RSS, text))
    if h is None:
        verdicts.append(verdict(None, "A vs transformers: skipped or failed"))
    else:
        for tag, r in (("(b) meta model", b), ("(a) allocated model", a)):
            what = f"A{tag} at least {TARGET_VS_HF}x faster than transformers"
            if r is None:
                verdicts.append(verdict(None, f"{what}: not measured"))
            else:
                speed = h["total_s"] / r["total_s"]
                text = f"{what}: {speed:.2f}x ({h['total_s']:.3f} s vs {r['total_s']:.3f} s)"
                verdicts.append(verdict(speed >= TARGET_VS_HF, text))
        verdicts.append(verdict(h.get("missing", 1) == 0, f"transformers reports: {h['notes']}"))
    limit, fresh, single = (result_of(rows, n) for n in ("floor_touched", "floor_fresh", "floor_assign"))
    if limit is not None and fresh is not None and single is not None:
        for tag, r in (("(a)", a), ("(b)", b)):
            if r is not None:
                verdicts.append(
                    f"  [info] A{tag} vs the bandwidth limit {r['total_s'] / limit['total_s']:.2f}x, vs preadv into "
                    f"fresh memory {r['total_s'] / fresh['total_s']:.2f}x, vs the best single-copy path "
                    f"(load_file + assign) {r['total_s'] / single['total_s']:.2f}x"
                )
    if c is not None:
        target = TARGET_ZERO_COPY_S_PER_GB * mb / 1e9
        ok = c["load_s"] <= 1.25 * target and c.get("mapped") == c.get("params")
        text = (
            f"A(c) zero-copy about {target:.3f} s: {c['load_s']:.3f} s, "
            f"{c.get('mapped')}/{c.get('params')} params in LoadReport.mapped_keys"
        )
        verdicts.append(verdict(ok, text))
    return "\n".join(out), verdicts, {"rows": rows, "info": info}
