"""Benchmark: loading and saving Mixtral-style checkpoints against plain safetensors (not a test).

Run ``python -m surgery bench load`` (or ``python -m surgery.bench.load``) with
``--size-gb``, ``--repeat``, ``--only {A,B,C,D,E,F,G}``, ``--skip-transformers``, ``--workdir``,
``--profile``.

* **A** (throughput): a ~1 GB bfloat16 checkpoint with per-expert keys, in 500 MB shards, loaded
  by :func:`surgery.load_checkpoint` into the fused-experts runtime model (a) allocated, (b) built
  on ``meta``, and (c) the runtime-layout file memory-mapped into a ``meta`` model (zero copy).
  The floor is ``safetensors.torch.load_file(backend="pread")`` of the already-converted file plus
  ``model.load_state_dict``; transformers' ``MixtralForCausalLM.from_pretrained`` of the same
  per-expert checkpoint runs when it is installed.
* **B** (per-key cost): ~100,000 tiny per-expert tensors; the floor is ``load_file(backend="pread")``
  of the same file, which touches every key once (its ``mmap`` backend is shown for reference).
* **C** (saving): :func:`surgery.save_checkpoint` in the original layout against ``save_file`` of
  the runtime tensors; time and peak memory on top of the loaded model.
* **D** (tensor parallelism): checkpoint A loaded by two gloo ranks with ``tp_plan="auto"``
  against the single-process load: wall time (slowest rank), bytes read and peak RSS growth per
  rank (:mod:`surgery.bench.parallel`; not run by default: ``--only D``).
* **E** (many-key save): the B model (~100,000 keys) saved in its original layout against
  ``save_file`` + fsync of the same original-layout tensors (``--only E``).
* **F** (distributed save): checkpoint A on 4 gloo ranks, FSDP2 over TP on (dp_shard=2, tp=2),
  saved by :func:`surgery.save_checkpoint` (each rank writes its own files) against the former
  gather-and-write-on-rank-0 save: wall time, bytes written and peak RSS growth per rank
  (:mod:`surgery.bench.distsave`; ``--only F``).
* **G** (the convenient path): checkpoint A on 4 gloo ranks with ``load_checkpoint(...,
  device_mesh=mesh, tp_plan="auto", fsdp=True)`` on (dp_shard=2, tp=2) against the
  single-process load (:mod:`surgery.bench.fsdp_load`; ``--only G``).

Every run is a fresh process forked from a server that has only imported the modules (so start-up
and imports stay out of the time, while the loader's own one-time work such as catalog discovery
stays in); model construction is included. Each variant is the best of ``--repeat`` warm-page-cache
runs (a variant whose runs already took 8 s stops early). Peak RSS is the high-water mark
``VmHWM`` (``ru_maxrss`` would carry the server's peak across ``fork``), reset at the start of the
run; ``+MiB`` is its growth during the run (the worst run's), the number compared with the model size.

This module is the command: each case is a module of its own (:mod:`~surgery.bench.load_throughput`,
:mod:`~surgery.bench.load_per_key`, :mod:`~surgery.bench.save_time`, :mod:`~surgery.bench.parallel`,
:mod:`~surgery.bench.save_many_keys`, :mod:`~surgery.bench.distsave`, :mod:`~surgery.bench.fsdp_load`), and the fork server, memory and page-cache tools and tables
are :mod:`~surgery.bench.harness`'s.
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..examples.moe import ExampleMoEConfig, build_moe_model
from . import (
    distsave,
    fsdp_load,
    load_per_key,
    load_throughput,
    load_variants,
    parallel,
    save_many_keys,
    save_time,
)
from .checkpoints import config_for_size, empty_model, per_key_config, prepare
from .harness import Servers, parser, positive_int, serve

__all__ = ["main", "run"]

_CHILDREN = {"save": save_time.child, "save_many": save_many_keys.child}
"""The variants a case runs in one forked process of its own; every other variant is one load."""


def _child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run of ``spec["variant"]`` in a process the fork server just forked."""
    return _CHILDREN.get(spec["variant"], load_variants.child)(spec)


def _server_command(spec: dict[str, Any]) -> list[str]:
    """The fork server a spec runs in: transformers is imported only for its own variant."""
    hf = ["--with-transformers"] if spec["variant"] == "hf" else []
    return [sys.executable, "-m", "surgery.bench.load", "--serve", *hf]


def _serve(with_transformers: bool) -> None:
    """Import once, then serve forked runs (:func:`~surgery.bench.harness.serve`).

    Each fork starts from a process that has only imported modules (and built one tiny ``meta``
    model, which imports ``torch._dynamo``), so every run pays the loader's own one-time work but
    not the interpreter start-up.
    """
    from safetensors.torch import load_file, save_file  # noqa: F401

    from .. import save  # noqa: F401
    from ..load import loader  # noqa: F401

    if with_transformers:
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import MixtralForCausalLM  # noqa: F401
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    build_moe_model(ExampleMoEConfig(), seed=None, device="meta")
    gc.collect()
    serve(_child)


def run(
    *,
    size_gb: float = 1.0,
    repeat: int = 3,
    transformers: bool = True,
    transformers_b_repeat: int = 1,
    only: Sequence[str] = ("A", "B", "C"),
    workdir: str | os.PathLike[str] | None = None,
) -> dict[str, Any]:
    """Run the selected benchmarks; return their rendered tables, verdicts and raw rows."""
    if transformers:
        try:
            import transformers as _  # noqa: F401
        except ImportError:
            transformers = False
    tmp = None
    if workdir is None:
        tmp = tempfile.mkdtemp(prefix="surgery-bench-load-")
        work = Path(tmp)
    else:
        work = Path(workdir)
        work.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {}
    servers = Servers(_server_command)
    try:
        if "A" in only:
            results["A"] = load_throughput.bench(work, size_gb, repeat, transformers, servers=servers)
        if "B" in only:
            results["B"] = load_per_key.bench(
                work, repeat, transformers, transformers_b_repeat, servers=servers
            )
        if "C" in only:
            results["C"] = save_time.bench(work, size_gb, repeat, servers=servers)
        if "D" in only:
            results["D"] = parallel.bench(work, size_gb, repeat)
        if "E" in only:
            results["E"] = save_many_keys.bench(work, repeat, servers=servers)
        if "F" in only:
            results["F"] = distsave.bench(work, size_gb, repeat)
        if "G" in only:
            results["G"] = fsdp_load.bench(work, size_gb, repeat)
    finally:
        servers.close()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def _profile(workdir: Path, size_gb: float, which: Sequence[str], top: int) -> None:
    """cProfile one sequential load per benchmark (``sync=True``: the workers' time shows up)."""
    import cProfile
    import io
    import pstats

    from ..load.loader import load_checkpoint

    for name in which:
        cfg = config_for_size(size_gb) if name == "A" else per_key_config()
        prepare(workdir, name, cfg, runtime_file=name == "A")
        model = empty_model(cfg)
        prof = cProfile.Profile()
        start = time.perf_counter()
        prof.enable()
        report = load_checkpoint(model, workdir / name / "original", progress=False, sync=True)
        prof.disable()
        print(
            f"\n== profile {name}: sequential load into an allocated model, "
            f"{time.perf_counter() - start:.3f} s under cProfile, ok={report.ok}"
        )
        for order in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).strip_dirs().sort_stats(order).print_stats(top)
            text = buf.getvalue()
            print(text[text.find("   ncalls") :].rstrip())
        del model
        gc.collect()


def main(argv: Sequence[str] | None = None) -> int:
    """Command line (see the module docstring)."""
    p = parser("load", __doc__)
    p.add_argument(
        "--size-gb", type=float, default=1.0, help="size of checkpoint A (and C) in GiB (default 1.0)"
    )
    p.add_argument(
        "--repeat", type=positive_int, default=3, help="fresh-process runs per variant; the best counts"
    )
    p.add_argument("--skip-transformers", action="store_true", help="do not time transformers")
    p.add_argument(
        "--transformers-b-repeat",
        type=int,
        default=1,
        help="runs of transformers on B (slow; default 1, 0 skips it)",
    )
    p.add_argument(
        "--only",
        choices=("A", "B", "C", "D", "E", "F", "G"),
        action="append",
        help="run only these (repeatable; D, E, F and G only on request)",
    )
    p.add_argument("--workdir", default=None, help="keep and reuse checkpoints here (default: a temp dir)")
    p.add_argument("--profile", action="store_true", help="instead: cProfile one sequential load for A and B")
    p.add_argument("--top", type=int, default=25, help="rows per profile listing")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--with-transformers", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve:
        _serve(args.with_transformers)
        return 0
    if args.repeat < 1:
        p.error("--repeat must be at least 1")
    only = args.only or ["A", "B", "C"]
    if args.profile:
        work = Path(args.workdir or tempfile.mkdtemp(prefix="surgery-bench-load-"))
        try:
            _profile(work, args.size_gb, [w for w in only if w in ("A", "B")], args.top)
        finally:
            if args.workdir is None:
                shutil.rmtree(work, ignore_errors=True)
        return 0
    start = time.perf_counter()
    results = run(
        size_gb=args.size_gb,
        repeat=args.repeat,
        transformers=not args.skip_transformers,
        transformers_b_repeat=args.transformers_b_repeat,
        only=only,
        workdir=args.workdir,
    )
    verdicts: list[str] = []
    for key in ("A", "B", "C", "D", "E", "F", "G"):
        if key in results:
            table, v, _ = results[key]
            print(table)
            print()
            verdicts.extend(v)
    print("targets:")
    print("\n".join(verdicts))
    print(f"(torch {torch.__version__}, {os.cpu_count()} CPUs, {time.perf_counter() - start:.0f} s in all)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
