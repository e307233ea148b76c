"""Benchmark: our safetensors reader/writer against the ``safetensors`` package.

Run ``python -m surgery.bench.io [--mib 512] [--tensors 64] [--repeat 3]``. It writes a
bf16 checkpoint of the given size into a temporary directory, then times (best of ``repeat``,
warm page cache) reading every tensor several ways and writing it again. On Linux it also
prints the peak resident-memory growth of one ``write_checkpoint`` call (the writer streams
tensor by tensor, so this should stay near zero for contiguous CPU tensors).
"""

from __future__ import annotations

import collections
import mmap
import os
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from surgery.checkpoint import open_checkpoint, write_checkpoint

from .harness import best_time, positive_int
from .harness import parser as bench_parser

__all__ = ["main"]


def _touch(t: torch.Tensor) -> None:
    t.reshape(-1).view(torch.uint8)[:: mmap.PAGESIZE].sum()


def _peak_rss_growth(fn: Callable[[], object]) -> int | None:
    """Bytes the process's peak RSS grew by while ``fn`` ran (Linux only)."""

    def rss(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field):
                return int(line.split()[1]) * 1024
        raise OSError(field)

    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
        before = rss("VmRSS:")
        fn()
        return rss("VmHWM:") - before
    except OSError:
        return None


def main(argv: list[str] | None = None) -> None:
    parser = bench_parser("io", __doc__)
    parser.add_argument("--mib", type=positive_int, default=512, help="checkpoint size in MiB")
    parser.add_argument("--tensors", type=positive_int, default=64, help="tensors in the checkpoint")
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed runs; the best counts")
    args = parser.parse_args(argv)

    from safetensors import safe_open
    from safetensors.torch import save_file

    numel = args.mib * 2**20 // 2 // args.tensors
    state = {f"layers.{i}.weight": torch.randn(numel // 1024, 1024).bfloat16() for i in range(args.tensors)}
    mib = sum(t.nbytes for t in state.values()) / 2**20
    with tempfile.TemporaryDirectory() as tmp:
        ours, theirs = Path(tmp, "ours"), Path(tmp, "theirs.safetensors")
        write_checkpoint(state, ours)
        save_file(state, theirs)
        keys = list(state)
        rows = max(1, numel // 1024 // 4)

        with open_checkpoint(ours) as reader:
            outs = {k: torch.empty_like(v) for k, v in state.items()}

            def _each(fn: Callable[[str], object]) -> None:
                for k in keys:
                    fn(k)  # dropped at once, like the reference loops: measures reading, not RAM

            def threaded(fn: Callable[[str], object]) -> Callable[[], object]:
                def run() -> None:
                    with ThreadPoolExecutor(4) as pool:
                        collections.deque(pool.map(fn, keys), maxlen=0)  # drain, keep nothing

                return run

            def theirs_all(owned: bool) -> Callable[[], object]:
                def run() -> None:
                    with safe_open(theirs, framework="pt") as f:
                        for k in keys:
                            t = f.get_tensor(k)
                            t.clone() if owned else _touch(t)

                return run

            def ours_views() -> None:
                with open_checkpoint(ours) as fresh:
                    for k in keys:
                        _touch(fresh.get_tensor(k, copy=False))

            results = {
                "safetensors get_tensor + clone (owned)": theirs_all(owned=True),
                "ours get_tensor (owned)": lambda: _each(reader.get_tensor),
                "ours get_tensor (owned, 4 threads)": threaded(reader.get_tensor),
                "ours read_into (preallocated)": lambda: _each(lambda k: reader.read_into(k, outs[k])),
                "ours read_into (preallocated, 4 threads)": threaded(lambda k: reader.read_into(k, outs[k])),
                "safetensors get_tensor + touch": theirs_all(owned=False),
                "ours get_tensor(copy=False) + touch": ours_views,
                "ours get_slice rows 1/4 (owned)": lambda: _each(lambda k: reader.get_slice(k, 0, 0, rows)),
            }
            print("(touch: read one byte per page of a zero-copy view; owned: a tensor with its own memory)")
            print(
                f"checkpoint: {len(keys)} bf16 tensors, {mib:.0f} MiB, warm page cache, best of {args.repeat}"
            )
            for name, fn in results.items():
                seconds = best_time(fn, args.repeat)
                print(f"  {name:40s} {seconds * 1e3:8.1f} ms  {mib / 1024 / seconds:6.2f} GiB/s")

        out_ours, out_theirs = Path(tmp, "w_ours"), Path(tmp, "w_theirs.safetensors")
        write = best_time(lambda: write_checkpoint(state, out_ours), args.repeat)
        ref = best_time(lambda: save_file(state, out_theirs), args.repeat)
        print(f"  {'write_checkpoint (atomic, fsync)':40s} {write * 1e3:8.1f} ms")
        print(f"  {'safetensors save_file':40s} {ref * 1e3:8.1f} ms")
        growth = _peak_rss_growth(lambda: write_checkpoint(state, out_ours))
        if growth is not None:
            print(
                f"  peak RSS growth during write_checkpoint: {growth / 2**20:.1f} MiB (of {mib:.0f} MiB data)"
            )
        os.sync()


if __name__ == "__main__":
    main()
