"""Benchmark D: a tensor-parallel (TP=2) and an expert-parallel (EP=4) load, gloo on CPU, against
the single-process load.

Part of ``surgery bench load`` (``--only D``). Checkpoint A (the ~1 GB Mixtral-style per-expert
checkpoint) is loaded into a ``meta``-built model, each way in fresh processes:

* ``single``: one process, no process group (the floor of this variant);
* ``tp2``: two ranks of a gloo group (``torch.multiprocessing.spawn``), ``tp_plan="auto"``;
  each rank reads its slice only.

The EP row loads a per-expert checkpoint with 64 experts per layer (:func:`ep_config`) the same
two ways: ``single``, and ``ep4``, four ranks on a mesh named ``ep`` with ``tp_plan="auto"`` (the
model's ``ep_plan``: 16 whole experts per rank).

Reported per rank: wall time of the load (the slowest rank counts; process start-up and
``init_process_group`` are outside it), ``LoadReport.bytes_read`` and the peak RSS growth
(``VmHWM`` reset before the load). On the 2-core machine both ranks share the cores, so the win
to expect is bytes and memory per rank, not wall time; ranks run with one intra-op thread each
(what ``torchrun`` sets through ``OMP_NUM_THREADS=1``) and the loader's default 4 reader threads.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from ..examples.moe import ExampleMoEConfig
from .checkpoints import config_for_size, prepare
from .harness import end_rank, peak_rss, reset_peak_rss, warm

__all__ = ["bench", "ep_config", "run_tp_benchmark"]

_MB = 2**20


def _rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    """One rank's load (``world == 1``: the single-process load, no process group)."""
    import torch.distributed as dist

    import surgery
    from surgery.examples.moe import ExampleMoEConfig, build_moe_model

    torch.set_num_threads(spec["threads"])
    cfg = ExampleMoEConfig(**spec["config"])
    kwargs: dict[str, Any] = {}
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        names = (spec["dim"],) if spec.get("dim") else None
        kwargs = {"tp_plan": "auto", "device_mesh": init_device_mesh("cpu", (world,), mesh_dim_names=names)}
        dist.barrier()
    model = build_moe_model(cfg, seed=None, device="meta", dtype=torch.bfloat16)
    base = reset_peak_rss()
    start, cpu = time.perf_counter(), time.process_time()
    report = surgery.load_checkpoint(model, spec["path"], progress=False, **kwargs)
    seconds, cpu = time.perf_counter() - start, time.process_time() - cpu
    result = {
        "cpu": cpu,
        "rank": rank,
        "ok": report.ok,
        "seconds": seconds,
        "bytes_read": report.bytes_read,
        "delta": peak_rss() - base,
        "fallbacks": len(report.tp_fallbacks),
    }
    Path(spec["out"], f"rank{rank}-{world}.json").write_text(json.dumps(result))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
        end_rank()


def _launch(world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="surgery-bench-tp-") as tmp:
        run = {**spec, "store": f"{tmp}/store", "out": tmp}
        mp.spawn(_rank, args=(world, run), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"rank{r}-{world}.json").read_text()) for r in range(world)]


def ep_config() -> ExampleMoEConfig:
    """The EP row's model: 64 experts in each of 4 layers, ~0.4 GiB in bf16 (experts ~0.37 GiB)."""
    return ExampleMoEConfig(
        vocab_size=8000,
        hidden_size=1024,
        intermediate_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        num_local_experts=64,
        num_experts_per_tok=2,
    )


def run_tp_benchmark(
    config: dict[str, Any],
    path: Path,
    model_bytes: int,
    file_bytes: int,
    repeat: int,
    *,
    parallel: tuple[str, int, str | None] = ("tp2", 2, None),
) -> tuple[str, list[str], dict[str, Any]]:
    """Run variant D (``parallel``: its name, world size and mesh dim name); return its table,
    notes and raw results (best of ``repeat`` per variant)."""
    spec = {"config": config, "path": str(path)}
    results: dict[str, list[dict[str, Any]]] = {}
    name_p, world_p, dim = parallel
    for name, world, threads in (("single", 1, torch.get_num_threads()), (name_p, world_p, 1)):
        runs = [_launch(world, {**spec, "threads": threads, "dim": dim}) for _ in range(max(1, repeat))]
        best = min(runs, key=lambda ranks: max(r["seconds"] for r in ranks))
        for r in best:
            r["threads"] = threads
            r["delta"] = max(run[r["rank"]]["delta"] for run in runs)
        results[name] = best
    head = (
        f"  {'variant':<36} {'rank':>4} {'load s':>7} {'CPU s':>6} {'read MiB':>9} {'read/file':>9} "
        f"{'+RSS MiB':>9} {'+/model':>7}"
    )
    lines = [head, "  " + "-" * len(head)]
    labels = {
        "single": "single process (meta model)",
        "tp2": "TP=2 gloo, tp_plan='auto'",
        "ep4": "EP=4 gloo, mesh 'ep', tp_plan='auto'",
    }
    for name, ranks in results.items():
        for r in ranks:
            lines.append(
                f"  {labels[name]:<36} {r['rank']:>4} {r['seconds']:>7.3f} {r['cpu']:>6.2f} {r['bytes_read'] / _MB:>9.0f} "
                f"{r['bytes_read'] / file_bytes:>9.2f} {r['delta'] / _MB:>9.0f} {r['delta'] / model_bytes:>7.2f}"
            )
    single, tp = results["single"][0], results[name_p]
    slowest = max(r["seconds"] for r in tp)
    notes = [
        f"  [info] D {name_p} wall time, slowest rank vs single process: {slowest:.3f} s vs {single['seconds']:.3f} s "
        f"({slowest / single['seconds']:.2f}x; {world_p} ranks share {os.cpu_count()} cores)",
        f"  [info] D {name_p} bytes read per rank vs single process: "
        f"{max(r['bytes_read'] for r in tp) / single['bytes_read']:.2f}x; peak RSS growth per rank: "
        f"{max(r['delta'] for r in tp) / max(single['delta'], 1):.2f}x",
        f"  [info] D {name_p} all loads ok: {all(r['ok'] for rs in results.values() for r in rs)}; "
        f"fallbacks per rank: {[r['fallbacks'] for r in tp]}; threads: single {single['threads']} intra-op, "
        "ranks 1 intra-op each (OMP_NUM_THREADS=1, as torchrun sets); 4 reader threads everywhere",
    ]
    return "\n".join(lines), notes, results


def bench(workdir: Path, size_gb: float, repeat: int) -> tuple[str, list[str], dict[str, Any]]:
    cfg = config_for_size(size_gb)
    info = prepare(workdir, "A", cfg, runtime_file=True)
    original = workdir / "A" / "original"
    warm([original])
    file_bytes = sum(f.stat().st_size for f in original.glob("*.safetensors"))
    table, notes, data = run_tp_benchmark(asdict(cfg), original, info["model_bytes"], file_bytes, repeat)
    title = (
        f"D: tensor-parallel load of checkpoint A ({info['model_bytes'] / 2**30:.2f} GiB bf16), TP=2 on gloo "
        f"vs one process; best of {repeat} runs"
    )
    ep = ep_config()
    ep_info = prepare(workdir, "D-EP", ep, runtime_file=False)
    ep_original = workdir / "D-EP" / "original"
    warm([ep_original])
    ep_bytes = sum(f.stat().st_size for f in ep_original.glob("*.safetensors"))
    ep_table, ep_notes, ep_data = run_tp_benchmark(
        asdict(ep), ep_original, ep_info["model_bytes"], ep_bytes, repeat, parallel=("ep4", 4, "ep")
    )
    ep_title = (
        f"D (EP): expert-parallel load of a {ep.num_local_experts}-expert per-expert checkpoint "
        f"({ep_info['model_bytes'] / 2**30:.2f} GiB bf16), EP=4 on gloo vs one process; best of {repeat} runs"
    )
    return (
        f"{title}\n{table}\n\n{ep_title}\n{ep_table}",
        [*notes, *ep_notes],
        {"tp": data, "ep": ep_data},
    )
