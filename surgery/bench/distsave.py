"""Benchmark F: the distributed save against a save that gathers every group and writes on rank 0.

Part of ``surgery bench load`` (``--only F``). Checkpoint A (the ~1 GB Mixtral-style per-expert
checkpoint) is loaded on 4 gloo ranks into a (dp_shard=2, tp=2) mesh the torchtitan way: TP on
``mesh["tp"]`` at load (``tp_plan="auto"``, each rank reading its slice), then FSDP2
``fully_shard`` per decoder layer and at the root on ``mesh["dp_shard"]``. The model is then saved
in its original layout twice per run, into fresh directories:

* ``distributed``: :func:`surgery.save_checkpoint` (each rank assembles and writes its own files,
  rank 0 commits);
* ``rank 0``: what the save did before: every rank gathers each group's DTensors whole
  (``full_tensor()``) in write order and rank 0 writes every file (:class:`~surgery.save.RevertedState`
  looked up by every rank, rank 0 through :func:`~surgery.checkpoint.write_checkpoint`).

Reported per rank: wall time of the save (the slowest rank counts), the bytes of files it wrote
and its peak RSS growth during the save (``VmHWM`` reset before it). The 4 ranks share the
machine's cores; each runs with one intra-op thread (what ``torchrun`` sets).
"""

from __future__ import annotations

import json
import os
import shutil
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
_SHARD = "100MB"


def _save_on_rank_zero(model: Any, path: Path, rank: int) -> None:
    """Every rank gathers each group whole, in write order; rank 0 writes (the former collective save)."""
    from ..checkpoint import write_checkpoint
    from ..save import RevertedState

    state = RevertedState(model)
    if rank == 0:
        write_checkpoint(state, path, max_shard_size=_SHARD, specs=state.specs)
    else:
        for key in state.specs:
            state[key]


def _rank(rank: int, world: int, spec: dict[str, Any]) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    import surgery
    from surgery.examples.moe import ExampleMoEConfig, build_moe_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{spec['store']}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp_shard", "tp"))
    model = build_moe_model(
        ExampleMoEConfig(**spec["config"]), seed=None, device="meta", dtype=torch.bfloat16
    )
    report = surgery.load_checkpoint(
        model, spec["path"], progress=False, tp_plan="auto", device_mesh=mesh["tp"]
    )
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    result: dict[str, Any] = {"rank": rank, "ok": report.ok}
    for name in ("distributed", "rank 0"):
        target = Path(spec["out"], name.replace(" ", ""))
        dist.barrier()
        base = reset_peak_rss()
        start = time.perf_counter()
        if name == "distributed":
            files = surgery.save_checkpoint(model, target, max_shard_size=_SHARD)
            written = sum(f.stat().st_size for f in files)
        else:
            _save_on_rank_zero(model, target, rank)
            written = sum(f.stat().st_size for f in target.iterdir()) if rank == 0 else 0
        seconds = time.perf_counter() - start
        result[name] = {"seconds": seconds, "delta": peak_rss() - base, "written": written}
        dist.barrier()
        if rank == 0:
            result[name]["files"] = {p.name: p.stat().st_size for p in sorted(target.iterdir())}
    dist.barrier()
    if rank == 0:
        names = result["rank 0"]["files"]  # the tensor files and the index (no config.json)
        result["identical"] = all(
            Path(spec["out"], "distributed", n).read_bytes() == Path(spec["out"], "rank0", n).read_bytes()
            for n in names
        ) and set(names) <= set(result["distributed"]["files"])
    Path(spec["out"], f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()
    dist.destroy_process_group()
    end_rank()


def _launch(spec: dict[str, Any]) -> list[dict[str, Any]]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix="surgery-bench-distsave-", dir=spec["tmp_root"]) as tmp:
        run = {**spec, "store": f"{tmp}/store", "out": tmp}
        mp.spawn(_rank, args=(4, run), nprocs=4, join=True)
        out = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(4)]
        shutil.rmtree(tmp, ignore_errors=True)
        return out


def bench(workdir: Path, size_gb: float, repeat: int) -> tuple[str, list[str], dict[str, Any]]:
    """Run case F; return its table, notes and raw results (the best run by slowest distributed rank)."""
    cfg = config_for_size(size_gb)
    info = prepare(workdir, "A", cfg, runtime_file=True)
    original = workdir / "A" / "original"
    warm([original])
    spec = {"config": asdict(cfg), "path": str(original), "tmp_root": str(workdir)}
    runs = [_launch(spec) for _ in range(max(1, repeat))]
    best = min(runs, key=lambda ranks: max(r["distributed"]["seconds"] for r in ranks))
    head = f"  {'save':<12} {'rank':>4} {'wall s':>7} {'written MiB':>11} {'+RSS MiB':>9} {'+/model':>7}"
    lines = [head, "  " + "-" * len(head)]
    model_bytes = info["model_bytes"]
    for name in ("distributed", "rank 0"):
        for r in best:
            v = r[name]
            delta = max(run[r["rank"]][name]["delta"] for run in runs)
            lines.append(
                f"  {name:<12} {r['rank']:>4} {v['seconds']:>7.3f} {v['written'] / _MB:>11.0f} "
                f"{delta / _MB:>9.0f} {delta / model_bytes:>7.2f}"
            )
    slowest = {n: max(r[n]["seconds"] for r in best) for n in ("distributed", "rank 0")}
    notes = [
        f"  [info] F slowest rank: distributed {slowest['distributed']:.3f} s vs rank 0 {slowest['rank 0']:.3f} s "
        f"({slowest['rank 0'] / slowest['distributed']:.2f}x); 4 ranks share {os.cpu_count()} cores, 1 intra-op "
        "thread each",
        f"  [info] F loads ok: {all(r['ok'] for r in best)}; the two saves wrote the same files: "
        f"{best[0].get('identical')}",
    ]
    title = (
        f"F: saving checkpoint A ({model_bytes / 2**30:.2f} GiB bf16) from FSDP2 over TP, (dp_shard=2, tp=2) "
        f"on 4 gloo ranks, max_shard_size={_SHARD}; best of {repeat} runs"
    )
    return f"{title}\n" + "\n".join(lines), notes, {"runs": runs}
