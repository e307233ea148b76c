"""One timed load of checkpoint A or B, run in a freshly forked process (the child side of ``surgery bench load``).

:func:`child` runs the variant a spec names: surgery's own loads (``ours_*``), the floors they are
compared with (``floor*``, ``raw_*``: safetensors reads and plain ``preadv``), transformers'
``from_pretrained`` (``hf``) and routing alone (``routing``); a ``_cold`` suffix drops the page
cache first. It returns the seconds (with and without model construction), the growth of peak RSS
during the run and notes.
"""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from ..examples.moe import ExampleMoEConfig, ExampleMoEForCausalLM, build_moe_model
from .checkpoints import empty_model
from .harness import MADV_HUGEPAGE, MADV_POPULATE_WRITE, drop_page_cache, madvise, peak_rss, reset_peak_rss

__all__ = ["child"]


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """One run of ``spec["variant"]`` in this (just forked) process (``*_cold``: page cache dropped first)."""
    cfg = ExampleMoEConfig(**spec["config"])
    cold = spec["variant"].endswith("_cold")
    dropped = ""
    if cold:
        spec = {**spec, "variant": spec["variant"].removesuffix("_cold")}
        dropped = drop_page_cache([spec["original"], spec.get("runtime", "")])
    run_once = _runner(spec, cfg)
    gc.collect()
    base = reset_peak_rss()
    res = run_once()
    res["delta"], res["peak"] = peak_rss() - base, peak_rss()
    if cold:
        res["notes"] = "; ".join(x for x in (res.get("notes", ""), dropped) if x)
    return res


def _runner(spec: dict[str, Any], cfg: ExampleMoEConfig) -> Callable[[], dict[str, Any]]:
    """One timed run of ``spec["variant"]``: total (construction + load) and load-only seconds."""
    variant, original, runtime = spec["variant"], spec["original"], spec.get("runtime", "")
    from safetensors.torch import load_file

    from ..load.loader import load_checkpoint

    def meta_model() -> ExampleMoEForCausalLM:
        return build_moe_model(cfg, seed=None, device="meta", dtype=torch.bfloat16)

    def floor() -> dict[str, Any]:
        t0 = time.perf_counter()
        model = empty_model(cfg) if variant == "floor" else meta_model()
        t1 = time.perf_counter()
        result = model.load_state_dict(load_file(runtime, backend="pread"), assign=variant != "floor")
        t2 = time.perf_counter()
        notes = f"{len(result.missing_keys)} missing" if result.missing_keys else ""
        return {"total_s": t2 - t0, "load_s": t2 - t1, "notes": notes}

    def ours() -> dict[str, Any]:
        t0 = time.perf_counter()
        model = meta_model() if variant in ("ours_meta", "ours_mmap") else empty_model(cfg)
        path = runtime if variant in ("ours_mmap", "ours_runtime_alloc") else original
        t1 = time.perf_counter()
        report = load_checkpoint(model, path, progress=False)
        t2 = time.perf_counter()
        mapped, params = len(report.mapped_keys), len(model.state_dict())
        notes = f"{mapped}/{params} params mapped " if variant == "ours_mmap" else ""
        notes += "" if report.ok else f"NOT OK: {str(report).splitlines()[0]}"
        return {"total_s": t2 - t0, "load_s": t2 - t1, "mapped": mapped, "params": params, "notes": notes}

    def hf() -> dict[str, Any]:
        t0 = time.perf_counter()
        _, info = hf_cls.from_pretrained(original, dtype=torch.bfloat16, output_loading_info=True)
        t1 = time.perf_counter()
        problems = {k: len(v) for k, v in info.items() if v}
        notes = "nothing missing" if not problems else f"PROBLEMS {problems}"
        return {"total_s": t1 - t0, "load_s": t1 - t0, "missing": len(info["missing_keys"]), "notes": notes}

    def routing() -> dict[str, Any]:
        # The planner's routing call on the same checkpoint and model, alone, collector paused
        # as in a load: its time over a whole load is routing's share of that load.
        from ..checkpoint import open_checkpoint
        from ..resolution import get_model_conversion_mapping
        from ..routing import route_keys

        model = meta_model()
        transforms = get_model_conversion_mapping(model)
        runtime = model.state_dict().keys()
        with open_checkpoint(original) as reader:
            keys = reader.keys()
            gc.disable()
            try:
                t0 = time.perf_counter()
                prefix = getattr(model, "base_model_prefix", None) or None
                r = route_keys(keys, transforms, runtime_keys=runtime, base_model_prefix=prefix)
                for k in keys:
                    r.routes[k]
                t1 = time.perf_counter()
            finally:
                gc.enable()
        return {"total_s": t1 - t0, "load_s": t1 - t0, "notes": f"{len(keys)} keys, {len(r.groups)} groups"}

    def bandwidth() -> dict[str, Any]:
        # The runtime file's data section read with preadv, into memory touched beforehand (the
        # bandwidth limit) or into a fresh torch.empty (what page faults on new memory cost).
        import mmap
        import struct

        with open(runtime, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            start, size = 8 + n, os.fstat(f.fileno()).st_size - 8 - n
            touched = variant == "floor_touched"
            if touched:
                buf = torch.empty(size, dtype=torch.uint8)
                buf.fill_(0)
            t0 = time.perf_counter()
            notes = f"{size / 2**30:.2f} GiB"
            if not touched:
                buf = torch.empty(size, dtype=torch.uint8)
            if variant == "floor_fresh_huge":
                notes += f", madvise(MADV_HUGEPAGE): {madvise(buf, 0, size, MADV_HUGEPAGE, inward=2 << 20)}"
            view = memoryview(buf.numpy())  # type: ignore[arg-type]
            parallel = variant in ("floor_fresh_threads", "floor_fresh_populate")
            threads = (os.cpu_count() or 1) if parallel else 1
            step = -(-size // threads)
            populated: list[str] = []

            def read(lo: int) -> None:
                hi, done = min(size, lo + step), lo
                if variant == "floor_fresh_populate":
                    # fault the pages in with one call, no trap per page
                    populated.append(madvise(buf, lo, hi, MADV_POPULATE_WRITE, inward=mmap.PAGESIZE))
                while done < hi:
                    done += os.preadv(f.fileno(), [view[done : min(hi, done + (1 << 30))]], start + done)

            if threads == 1:
                read(0)
            else:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(read, range(0, size, step)))
                notes += f", {threads} threads"
            if populated:
                notes += f", madvise(MADV_POPULATE_WRITE): {populated[0]}"
            t1 = time.perf_counter()
        return {"total_s": t1 - t0, "load_s": t1 - t0, "notes": notes}

    def raw() -> dict[str, Any]:
        t0 = time.perf_counter()
        state = load_file(original, backend=variant.removeprefix("raw_"))
        n = sum(1 for _ in state.values())
        t1 = time.perf_counter()
        return {"total_s": t1 - t0, "load_s": t1 - t0, "notes": f"{n} keys"}

    if variant == "hf":
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import MixtralForCausalLM
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
        hf_cls: Any = MixtralForCausalLM
        return hf
    if variant in ("floor", "floor_assign"):
        return floor
    if variant in ("ours_alloc", "ours_meta", "ours_mmap", "ours_runtime_alloc"):
        return ours
    if variant in ("raw_pread", "raw_mmap"):
        return raw
    if variant in (
        "floor_touched",
        "floor_fresh",
        "floor_fresh_huge",
        "floor_fresh_threads",
        "floor_fresh_populate",
    ):
        return bandwidth
    if variant == "routing":
        return routing
    raise SystemExit(f"unknown variant {variant!r}")
