"""Benchmark B (per-key cost), part of ``surgery bench load``: ~100,000 tiny per-expert tensors.

The floor is ``load_file(backend="pread")`` of the same file, which touches every key once (its
``mmap`` backend is shown for reference); the floor and surgery's two loads take turns, so each
round is compared on its own. Routing alone is timed too: its share of a load is a target.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from .checkpoints import per_key_config, prepare
from .harness import MB, Row, Servers, interleaved, measure, result_of, table, verdict, warm

__all__ = ["bench"]

TARGET_B = 1.5
TARGET_ROUTING_SHARE = 0.20


def bench(
    workdir: Path, repeat: int, hf: bool, hf_repeat: int, *, servers: Servers
) -> tuple[str, list[str], dict[str, Any]]:
    cfg = per_key_config()
    info = prepare(workdir, "B", cfg, runtime_file=False)
    original = workdir / "B" / "original"
    warm([original])
    single = original / "model.safetensors"
    spec = {"config": asdict(cfg), "original": str(original)}
    rows: list[Row] = []
    raw = {**spec, "original": str(single)}
    interleaved(
        servers,
        rows,
        [
            ("raw_pread", "floor: load_file(pread), every key", raw),
            ("ours_alloc", "(a) surgery per-expert -> allocated model", spec),
            ("ours_meta", "(b) surgery per-expert -> meta model", spec),
        ],
        repeat,
    )
    measure(servers, rows, "raw_mmap", "  info: load_file(mmap), every key", raw, repeat)
    measure(servers, rows, "routing", "  info: routing alone (route_keys + read every route)", spec, repeat)
    measure(servers, rows, "raw_pread_cold", "cold cache: load_file(pread), every key", raw, repeat)
    measure(servers, rows, "ours_meta_cold", "cold cache: (b) surgery per-expert -> meta model", spec, repeat)
    warm([original, single])
    if hf and info["hf_config"] and hf_repeat > 0:
        measure(
            servers,
            rows,
            "hf",
            f"transformers from_pretrained (best of {hf_repeat})",
            spec,
            hf_repeat,
        )
    floor_name = "raw_pread"
    mb = info["model_bytes"]
    title = (
        f"B: per-key cost, {info['keys']:,} tensors ({cfg.num_hidden_layers} layers x {cfg.num_local_experts} experts "
        f"x 3 + rest), {mb / MB:.0f} MiB, one file; best of {repeat} runs (the floor, (a) and (b) take turns)"
    )
    floor, a, b = result_of(rows, floor_name), result_of(rows, "ours_alloc"), result_of(rows, "ours_meta")
    verdicts = []
    for tag, r in (("(a)", a), ("(b)", b)):
        what = f"B{tag} within {TARGET_B}x of floor"
        if r is None or floor is None:
            verdicts.append(verdict(None, f"{what}: not measured"))
        else:
            ratio = r["total_s"] / floor["total_s"]
            rounds = [o / f for o, f in zip(r["runs"], floor["runs"])]
            text = (
                f"{what}: {ratio:.2f}x best ({info['keys'] / r['total_s']:,.0f} keys/s); per round "
                + "/".join(f"{x:.2f}" for x in rounds)
                + f", {sum(x <= TARGET_B for x in rounds)} of {len(rounds)} within"
            )
            verdicts.append(verdict(max(rounds) <= TARGET_B, text))
    routing = result_of(rows, "routing")
    for tag, r in (("(a)", a), ("(b)", b)):
        what = f"routing at most {TARGET_ROUTING_SHARE:.0%} of B{tag}"
        if r is None or routing is None:
            verdicts.append(verdict(None, f"{what}: not measured"))
        else:
            share = routing["total_s"] / r["total_s"]
            verdicts.append(verdict(share <= TARGET_ROUTING_SHARE, f"{what}: {share:.0%}"))
    return "\n".join([title, table(rows, floor_name, mb)]), verdicts, {"rows": rows, "info": info}
