"""Benchmark E (many-key save), part of ``surgery bench load`` (``--only E``): saving the B model.

The B model (~100,000 keys) saved in its original layout against ``save_file`` + fsync of the same
original-layout tensors; the two alternate in one forked process (:func:`child`).
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
from .checkpoints import empty_model, per_key_config, prepare
from .harness import Row, Servers, fsynced_save_file, peak_rss, result_of, table, verdict, warm

__all__ = ["bench", "child"]

TARGET = 1.5
"""Within this factor of ``save_file`` + fsync in every pair of runs (B's per-key target)."""

_SAVES_MANY = {
    "save_many_floor": "floor: save_file + fsync of the original-layout tensors",
    "save_many_ours": "surgery.save_checkpoint (original layout, atomic, fsync)",
}


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Load the B model once, then alternate ``repeat`` times: ``save_file`` + fsync of its
    original-layout tensors (computed beforehand, not timed) and ``save_checkpoint`` in the
    original layout (which computes them)."""
    from ..load.loader import load_checkpoint
    from ..save import revert_state_dict, save_checkpoint

    model = empty_model(ExampleMoEConfig(**spec["config"]))
    load_checkpoint(model, spec["original"], progress=False)
    original = {k: v.contiguous() for k, v in revert_state_dict(model).items()}
    target = Path(spec["out"])
    savers: dict[str, Callable[[Path], object]] = {
        "save_many_floor": lambda path: fsynced_save_file(original, path / "model.safetensors"),
        "save_many_ours": lambda path: save_checkpoint(model, path),
    }
    runs: dict[str, list[float]] = {name: [] for name in savers}
    for _ in range(spec["repeat"]):
        for name, save in savers.items():
            shutil.rmtree(target, ignore_errors=True)
            target.mkdir(parents=True)
            gc.collect()
            start = time.perf_counter()
            save(target)
            runs[name].append(time.perf_counter() - start)
    shutil.rmtree(target, ignore_errors=True)
    return {
        name: {
            "load_s": min(r),
            "total_s": min(r),
            "runs": [round(x, 3) for x in r],
            "delta": 0,
            "peak": peak_rss(),
            "notes": f"{len(original)} keys",
        }
        for name, r in runs.items()
    }


def bench(workdir: Path, repeat: int, *, servers: Servers) -> tuple[str, list[str], dict[str, Any]]:
    cfg = per_key_config()
    info = prepare(workdir, "B", cfg, runtime_file=False)
    original = workdir / "B" / "original"
    warm([original])
    spec = {"config": asdict(cfg), "original": str(original), "repeat": repeat, "variant": "save_many"}
    print("  running E (many-key save) ...", file=sys.stderr, flush=True)
    rows: list[Row] = []
    try:
        saved = servers.run({**spec, "out": str(workdir / "E_out")})
        rows.extend(Row(name, label, saved.get(name)) for name, label in _SAVES_MANY.items())
    except RuntimeError as exc:
        rows.extend(Row(name, label, None, str(exc)[:200]) for name, label in _SAVES_MANY.items())
    title = (
        f"E: saving the B model ({info['keys']} keys) in its original layout; the runs alternate, "
        f"{repeat} of each in one process"
    )
    floor, ours = result_of(rows, "save_many_floor"), result_of(rows, "save_many_ours")
    what = f"E within {TARGET}x of save_file + fsync"
    if floor is None or ours is None:
        verdicts = [verdict(None, f"{what}: not measured")]
    else:
        pairs = [o / f for o, f in zip(ours["runs"], floor["runs"])]
        worst = max(pairs)
        text = f"{what}: best {ours['total_s'] / floor['total_s']:.2f}x, per pair " + "/".join(
            f"{x:.2f}" for x in pairs
        )
        verdicts = [verdict(worst <= TARGET, text)]
    return "\n".join([title, table(rows, "save_many_floor", info["model_bytes"])]), verdicts, {"rows": rows}
