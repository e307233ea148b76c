"""Benchmark: the ``patch_embeddings`` fusion (not a test).

Part 1 times the patch-embedding forward on ``--patches`` flattened patches (default 4096, the
Qwen2-VL geometry ``C=3, T=2, P=14`` and ``--embed-dim`` 1280) in float32 and bfloat16:
the original ``view -> Conv3d -> view`` module, the fused ``view -> Linear -> view`` module, and
a bare ``F.linear`` of the same shapes (the floor). Ratios are against the floor, measured in the
same run.

Part 2 times :func:`~surgery.preview_fusions` and :func:`~surgery.apply_fusions` on a
``--depth`` (default 32) block example tower.

Run it with ``python -m surgery.bench.fusion`` (``--device cuda`` on a GPU machine).
"""

from __future__ import annotations

import copy
import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from ..examples.vision import build_vision_tower, example_pixel_values
from ..fusion import apply_fusions, preview_fusions
from . import parser, positive_int

__all__ = ["main", "run"]

_CONFIG = {"patch_embeddings": True}


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _time_interleaved(
    fns: dict[str, Callable[[], Any]], *, device: str, rounds: int, min_run_time: float
) -> dict[str, float]:
    """Median seconds per call of each function, measured in interleaved rounds.

    Each round runs every function for about ``min_run_time / rounds`` seconds, in turn, so load
    drift on a shared machine hits all of them alike.
    """
    per_call: dict[str, list[float]] = {name: [] for name in fns}
    numbers: dict[str, int] = {}
    for name, fn in fns.items():  # warm up and size the inner loop
        fn()
        _sync(device)
        start = time.perf_counter()
        fn()
        _sync(device)
        once = max(time.perf_counter() - start, 1e-7)
        numbers[name] = max(1, int(min_run_time / rounds / once))
    for _ in range(rounds):
        for name, fn in fns.items():
            n = numbers[name]
            _sync(device)
            start = time.perf_counter()
            for _ in range(n):
                fn()
            _sync(device)
            per_call[name].append((time.perf_counter() - start) / n)
    return {name: statistics.median(times) for name, times in per_call.items()}


def _forward(
    dtype: torch.dtype, *, patches: int, embed_dim: int, device: str, min_run_time: float, rounds: int
) -> dict[str, float]:
    tower = build_vision_tower(depth=0, embed_dim=embed_dim, num_heads=1, dtype=dtype, device=device)
    unfused = tower.patch_embed
    apply_fusions(tower, _CONFIG, strict=True)
    fused = tower.patch_embed
    x = example_pixel_values(tower.config, num_patches=patches, dtype=dtype, device=device)
    linear = fused.get_submodule("linear_proj")
    weight, bias = linear.weight, linear.bias
    with torch.inference_mode():
        torch.testing.assert_close(fused(x), unfused(x), rtol=2e-2, atol=2e-2 * unfused(x).abs().max().item())
        return _time_interleaved(
            {
                "unfused": lambda: unfused(x),
                "fused": lambda: fused(x),
                "floor": lambda: F.linear(x, weight, bias),  # type: ignore[arg-type]
            },
            device=device,
            rounds=rounds,
            min_run_time=min_run_time,
        )


def _surgery_times(*, depth: int, embed_dim: int, repeat: int) -> dict[str, float]:
    base = build_vision_tower(depth=depth, embed_dim=embed_dim, num_heads=max(1, embed_dim // 64))
    preview, apply = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        preview_fusions(base, _CONFIG, strict=True)
        preview.append(time.perf_counter() - start)
        model = copy.deepcopy(base)
        start = time.perf_counter()
        apply_fusions(model, _CONFIG, strict=True)
        apply.append(time.perf_counter() - start)
    return {
        "preview": statistics.median(preview),
        "apply": statistics.median(apply),
        "modules": float(sum(1 for _ in base.modules())),
    }


def run(
    *,
    patches: int = 4096,
    embed_dim: int = 1280,
    depth: int = 32,
    tower_dim: int = 256,
    device: str = "cpu",
    min_run_time: float = 3.0,
    repeat: int = 7,
) -> dict[str, Any]:
    """Run both parts and print a table; return the raw numbers (seconds)."""
    print(
        f"patch_embeddings fusion; device={device}, torch {torch.__version__}, threads={torch.get_num_threads()}"
    )
    print(
        f"forward: {patches} patches of 3x2x14x14 -> {embed_dim}; median per call over interleaved rounds; ratios vs the F.linear floor"
    )
    print(
        f"{'dtype':>9} {'unfused':>11} {'fused':>11} {'floor':>11} {'unfused/fl':>10} {'fused/fl':>9} {'speedup':>8}"
    )
    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.bfloat16):
        t = _forward(
            dtype,
            patches=patches,
            embed_dim=embed_dim,
            device=device,
            min_run_time=min_run_time,
            rounds=repeat,
        )
        name = str(dtype).removeprefix("torch.")
        results[name] = t
        print(
            f"{name:>9} {t['unfused'] * 1e3:9.3f}ms {t['fused'] * 1e3:9.3f}ms {t['floor'] * 1e3:9.3f}ms "
            f"{t['unfused'] / t['floor']:10.2f} {t['fused'] / t['floor']:9.2f} {t['unfused'] / t['fused']:7.2f}x"
        )
    s = _surgery_times(depth=depth, embed_dim=tower_dim, repeat=repeat)
    results["surgery"] = s
    print(
        f"{depth}-block tower (D={tower_dim}, {int(s['modules'])} modules, CPU): "
        f"preview_fusions {s['preview'] * 1e3:.2f} ms, apply_fusions {s['apply'] * 1e3:.2f} ms (median of {repeat})"
    )
    return results


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point."""
    p = parser("fusion", __doc__)
    p.add_argument("--patches", type=positive_int, default=4096, help="patches per forward (default 4096)")
    p.add_argument("--embed-dim", type=positive_int, default=1280, help="output width of the patch embedding")
    p.add_argument(
        "--depth", type=positive_int, default=32, help="blocks of the tower for the preview/apply timing"
    )
    p.add_argument("--tower-dim", type=positive_int, default=256, help="embed_dim of that tower")
    p.add_argument("--device", default="cpu", help="where the forward runs (default cpu)")
    p.add_argument(
        "--min-run-time", type=float, default=3.0, help="seconds per forward measurement, over all rounds"
    )
    p.add_argument(
        "--repeat", type=positive_int, default=7, help="interleaved rounds / preview-apply repeats"
    )
    args = p.parse_args(argv)
    run(
        patches=args.patches,
        embed_dim=args.embed_dim,
        depth=args.depth,
        tower_dim=args.tower_dim,
        device=args.device,
        min_run_time=args.min_run_time,
        repeat=args.repeat,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
