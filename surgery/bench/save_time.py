"""Benchmark C (saving), part of ``surgery bench load``: saving the A model.

:func:`surgery.save_checkpoint` in the original layout against ``save_file`` of the runtime
tensors; time and peak memory on top of the loaded model, all variants in one forked process
(:func:`child`) that loaded the model once.
"""

from __future__ import annotations

import gc
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..examples.moe import ExampleMoEConfig
from .checkpoints import config_for_size, empty_model, prepare
from .harness import (
    MB,
    Row,
    Servers,
    fsynced_save_file,
    peak_rss,
    reset_peak_rss,
    result_of,
    table,
    verdict,
    warm,
)

__all__ = ["bench", "child"]

_SAVES = {
    "save_floor": "floor: save_file(state_dict) (runtime layout)",
    "save_floor_fsync": "  info: save_file + fsync (runtime layout)",
    "save_ours_runtime": "  info: surgery.save_checkpoint(original_format=False)",
    "save_ours": "surgery.save_checkpoint (original layout, 500MB shards)",
}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the A model once, then time every save variant ``repeat`` times (peak reset each time)."""
    from safetensors.torch import save_file

    from ..load.loader import load_checkpoint
    from ..save import save_checkpoint

    model = empty_model(ExampleMoEConfig(**spec["config"]))
    load_checkpoint(model, spec["original"], progress=False)
    target = Path(spec["out"])

    savers: dict[str, Callable[[Path], object]] = {
        "save_floor": lambda path: save_file(model.state_dict(), path / "model.safetensors"),
        "save_floor_fsync": lambda path: fsynced_save_file(model.state_dict(), path / "model.safetensors"),
        "save_ours_runtime": lambda path: save_checkpoint(
            model, path, original_format=False, max_shard_size="500MB"
        ),
        "save_ours": lambda path: save_checkpoint(model, path, max_shard_size="500MB"),
    }
    results: dict[str, Any] = {}
    for name, save in savers.items():
        runs, extras = [], []
        for _ in range(1 if "info:" in _SAVES[name] else spec["repeat"]):
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            gc.collect()
            before = reset_peak_rss()
            start = time.perf_counter()
            save(target)
            runs.append(time.perf_counter() - start)
            extras.append(peak_rss() - before)
        results[name] = {
            "load_s": min(runs),
            "total_s": min(runs),
            "extra": min(extras),
            "peak": peak_rss(),
            "runs": [round(r, 3) for r in runs],
            "notes": "",
        }
    shutil.rmtree(target, ignore_errors=True)
    return results


def bench(
    workdir: Path, size_gb: float, repeat: int, *, servers: Servers
) -> tuple[str, list[str], dict[str, Any]]:
    cfg = config_for_size(size_gb)
    info = prepare(workdir, "A", cfg, runtime_file=True)
    original = workdir / "A" / "original"
    warm([original])
    spec = {"config": asdict(cfg), "original": str(original), "repeat": repeat}
    rows: list[Row] = []
    print("  running C (save) ...", file=sys.stderr, flush=True)
    try:
        saved = servers.run({**spec, "variant": "save", "out": str(workdir / "C_out")})
        rows.extend(Row(name, label, saved.get(name)) for name, label in _SAVES.items())
    except RuntimeError as exc:
        rows.extend(Row(name, label, None, str(exc)[:200]) for name, label in _SAVES.items())
    mb = info["model_bytes"]
    title = (
        f"C: saving the A model ({mb / 2**30:.2f} GiB); best of {repeat} in one process (info rows: 1); "
        f"+MiB = peak RSS over the loaded model; largest merge group {info['largest_group'] / MB:.0f} MiB"
    )
    ours, group = result_of(rows, "save_ours"), info["largest_group"]
    what = "C extra peak memory at most the largest merge group"
    if ours is None:
        verdicts = [verdict(None, f"{what}: not measured")]
    else:
        text = f"{what}: {ours['extra'] / MB:.0f} MiB vs {group / MB:.0f} MiB"
        verdicts = [verdict(ours["extra"] <= group, text)]
    return "\n".join([title, table(rows, "save_floor", mb)]), verdicts, {"rows": rows, "info": info}
