"""Benchmark G: the convenient path, ``fsdp=True`` on (dp_shard=2, tp=2), against one process.

Part of ``surgery bench load`` (``--only G``). Checkpoint A (the ~1 GB Mixtral-style per-expert
checkpoint) is loaded into a ``meta``-built model, each way in fresh processes:

* ``single``: one process, no process group;
* ``fsdp2xtp2``: four ranks of a gloo group (``torch.multiprocessing.spawn``) with
  ``load_checkpoint(..., device_mesh=mesh, tp_plan="auto", fsdp=True)``: TP on ``mesh["tp"]``,
  ``fully_shard`` per layer and at the root on ``mesh["dp_shard"]``, then each rank reads its
  shards. The time includes applying TP and FSDP2 (on ``meta``, no data moves), also shown on
  its own (``apply s``: :func:`~surgery.parallel.shard_model`, what ``fsdp=True`` runs first,
  called before the load, which then finds the model parallelized).

Reported per rank: wall time of the load (the slowest rank counts; process start-up and
``init_process_group`` are outside it), ``LoadReport.bytes_read`` and peak RSS growth (``VmHWM``
reset before the load). Ranks run one intra-op thread each (``OMP_NUM_THREADS=1``, as torchrun
sets) and the loader's default 4 reader threads; the single process keeps torch's default.
* ``transformers``: the same four ranks load the same files with transformers' own distributed
  loading, ``from_pretrained(path, distributed_config=DistributedConfig(tp_size=2, fsdp_size=2))``
  (its n-D mesh: FSDP2 over TP), where transformers and accelerate are installed (transformers
  refuses ``tp_size`` without accelerate); it has no bytes-read counter, so that column is empty.
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

from .checkpoints import config_for_size, prepare
from .harness import end_rank, peak_rss, reset_peak_rss, warm

__all__ = ["bench"]

_MB = 2**20


def _rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    """One rank's load (``world == 1``: the single-process load, no process group)."""
    import torch.distributed as dist

    import surgery
    from surgery.examples.moe import ExampleMoEConfig, build_moe_model

    torch.set_num_threads(spec["threads"])
    if spec.get("variant") == "transformers":
        _transformers_rank(rank, world, spec)
        return
    kwargs: dict[str, Any] = {}
    if world > 1:
        dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp_shard", "tp"))
        kwargs = {"tp_plan": "auto", "device_mesh": mesh, "fsdp": True}
        dist.barrier()
    model = build_moe_model(
        ExampleMoEConfig(**spec["config"]), seed=None, device="meta", dtype=torch.bfloat16
    )
    base = reset_peak_rss()
    start = time.perf_counter()
    if kwargs:  # what fsdp=True runs first, timed on its own
        from surgery.parallel import shard_model

        shard_model(model, kwargs.pop("device_mesh"), tp_plan=kwargs.pop("tp_plan"), fsdp=kwargs.pop("fsdp"))
    applied = time.perf_counter() - start
    report = surgery.load_checkpoint(model, spec["path"], progress=False, **kwargs)
    seconds = time.perf_counter() - start
    result = {
        "rank": rank,
        "apply": applied,
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


def _transformers_rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    """One rank of transformers' own n-D load of the same files (FSDP2 over TP)."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed.configuration_utils import DistributedConfig

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    dist.barrier()
    base = reset_peak_rss()
    start = time.perf_counter()
    config = DistributedConfig(tp_size=2, fsdp_size=world // 2)
    AutoModelForCausalLM.from_pretrained(spec["path"], distributed_config=config, dtype=torch.bfloat16)
    seconds = time.perf_counter() - start
    result = {
        "rank": rank,
        "apply": float("nan"),
        "ok": True,
        "seconds": seconds,
        "bytes_read": None,
        "delta": peak_rss() - base,
        "fallbacks": 0,
    }
    Path(spec["out"], f"rank{rank}-{world}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    end_rank()


def _has_transformers_tp() -> bool:
    """Whether transformers' distributed loading can run here (it needs accelerate)."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("transformers", "accelerate"))


def _launch(world: int, spec: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="surgery-bench-fsdp-") as tmp:
        run = {**spec, "store": f"{tmp}/store", "out": tmp}
        mp.spawn(_rank, args=(world, run), nprocs=world, join=True)
        return [json.loads(Path(tmp, f"rank{r}-{world}.json").read_text()) for r in range(world)]


def bench(workdir: Path, size_gb: float, repeat: int) -> tuple[str, list[str], dict[str, Any]]:
    """Run variant G; return its table, notes and raw results (best of ``repeat`` per variant)."""
    cfg = config_for_size(size_gb)
    info = prepare(workdir, "A", cfg, runtime_file=True)
    original = workdir / "A" / "original"
    warm([original])
    file_bytes = sum(f.stat().st_size for f in original.glob("*.safetensors"))
    model_bytes = info["model_bytes"]
    spec = {"config": asdict(cfg), "path": str(original)}
    results: dict[str, list[dict[str, Any]]] = {}
    variants = [("single", 1, torch.get_num_threads()), ("fsdp2xtp2", 4, 1)]
    if _has_transformers_tp():
        variants.append(("transformers", 4, 1))
    for name, world, threads in variants:
        runs = [_launch(world, {**spec, "threads": threads, "variant": name}) for _ in range(max(1, repeat))]
        best = min(runs, key=lambda ranks: max(r["seconds"] for r in ranks))
        for r in best:
            r["threads"] = threads
            r["delta"] = max(run[r["rank"]]["delta"] for run in runs)
        results[name] = best
    head = f"  {'variant':<40} {'rank':>4} {'load s':>7} {'apply s':>7} {'read MiB':>9} {'read/file':>9} {'+RSS MiB':>9} {'+/model':>7}"
    lines = [head, "  " + "-" * len(head)]
    labels = {
        "single": "single process (meta model)",
        "fsdp2xtp2": "dp_shard=2 x tp=2 gloo, fsdp=True",
        "transformers": "transformers 2x2 DistributedConfig",
    }
    for name, ranks in results.items():
        for r in ranks:
            read = (
                f"{'':>9} {'':>9}"
                if r["bytes_read"] is None
                else f"{r['bytes_read'] / _MB:>9.0f} {r['bytes_read'] / file_bytes:>9.2f}"
            )
            lines.append(
                f"  {labels[name]:<40} {r['rank']:>4} {r['seconds']:>7.3f} {r['apply']:>7.3f} {read} "
                f"{r['delta'] / _MB:>9.0f} {r['delta'] / model_bytes:>7.2f}"
            )
    single, ranks = results["single"][0], results["fsdp2xtp2"]
    slowest = max(r["seconds"] for r in ranks)
    notes = [
        f"  [info] G wall time, slowest rank vs single process: {slowest:.3f} s vs {single['seconds']:.3f} s "
        f"(4 ranks share {os.cpu_count()} cores)",
        f"  [info] G bytes read per rank vs single process: "
        f"{max(r['bytes_read'] for r in ranks) / single['bytes_read']:.2f}x; peak RSS growth per rank: "
        f"{max(r['delta'] for r in ranks) / max(single['delta'], 1):.2f}x",
        f"  [info] G all loads ok: {all(r['ok'] for rs in results.values() for r in rs)}; fallbacks per rank: "
        f"{[r['fallbacks'] for r in ranks]}; threads: single {single['threads']} intra-op, ranks 1 intra-op each; "
        "4 reader threads everywhere",
    ]
    if "transformers" in results:
        hf = results["transformers"]
        notes.append(
            f"  [info] G transformers' own n-D load (DistributedConfig(tp_size=2, fsdp_size=2)), slowest rank: "
            f"{max(r['seconds'] for r in hf):.3f} s (surgery {slowest:.3f} s); peak RSS growth per rank "
            f"{max(r['delta'] for r in hf) / _MB:.0f} MiB (surgery {max(r['delta'] for r in ranks) / _MB:.0f} MiB)"
        )
    else:
        notes.append("  [info] G transformers' own n-D load not run: it needs transformers and accelerate")
    title = (
        f"G: checkpoint A ({model_bytes / 2**30:.2f} GiB bf16) into FSDP2 x TP (dp_shard=2, tp=2) on 4 gloo ranks "
        f"with fsdp=True vs one process; best of {repeat} runs"
    )
    return f"{title}\n" + "\n".join(lines), notes, results
