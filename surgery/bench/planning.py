r"""Benchmark: reading the header, routing and planning a many-key per-expert index (not a test).

Two checkpoints of tiny tensors, so that only the per-key work shows: case B's (98,531 keys: 32
layers x 1,024 experts x 3 weights in bfloat16, plus the dense keys) and a Kimi-K3-like one
(``--layers`` x ``--experts`` x 3 weights in block FP8, each with its ``weight_scale_inv``,
plus the dense keys: 495,783 keys by default). Each is timed on one core (the process is pinned
to one CPU where the OS allows it), with the cycle collector paused as a load pauses it, best of
``--repeat``:

* ``header``: :func:`surgery.checkpoint.open_checkpoint` (parse and validate the header);
* ``routing``: :func:`surgery.routing.route_keys` of the keys the planner routes (scales are
  claimed by the quantizer first), every route read back;
* ``plan (1 process)``: :func:`surgery.plan_load` of the whole model, header included;
* ``plan (rank 0 of N)``: the same for one rank of an expert-parallel load over ``--world``
  ranks (``expert_parallel`` on every experts module; a dry run, no process group): the rank
  reads only its experts and their scales.

The planning columns subtract the header. Run it with ``python -m surgery bench planning``.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from .harness import parser as bench_parser
from .harness import positive_int

__all__ = ["main", "run", "write_fp8_index"]

_EP_PLAN = {"model.layers.*.mlp.experts": "expert_parallel"}
_BLOCK = (4, 4)


def _tiny_config(layers: int, experts: int) -> Any:
    from .checkpoints import per_key_config

    return per_key_config(layers, experts, width=4, vocab=8)


def write_fp8_index(directory: Path, layers: int, experts: int) -> int:
    """A per-expert checkpoint of ``layers * experts * 3`` FP8 weights (4 x 4) with their scales
    (1 x 1 float32, one block), plus the dense keys; reused when its stamp matches. Returns the
    number of keys."""
    from safetensors.torch import save_file

    from ..examples.moe import build_moe_model

    stamp = {"layers": layers, "experts": experts, "version": 1}
    stamp_path = directory / "stamp.json"
    if stamp_path.is_file() and json.loads(stamp_path.read_text()).get("config") == stamp:
        return int(json.loads(stamp_path.read_text())["keys"])
    directory.mkdir(parents=True, exist_ok=True)
    model = build_moe_model(_tiny_config(layers, experts), seed=None, device="meta")
    state: dict[str, torch.Tensor] = {}
    for key, value in model.state_dict().items():
        if ".mlp.experts." not in key:
            state[key.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = torch.zeros(value.shape)
            continue
        base = key.rsplit(".mlp.experts.", 1)[0] + ".block_sparse_moe.experts"
        for e in range(experts):
            for w in ("w1", "w3") if key.endswith("gate_up_proj") else ("w2",):
                state[f"{base}.{e}.{w}.weight"] = torch.zeros(4, 4, dtype=torch.float8_e4m3fn)
                state[f"{base}.{e}.{w}.weight_scale_inv"] = torch.ones(1, 1)
    save_file(state, str(directory / "model.safetensors"))
    stamp_path.write_text(json.dumps({"config": stamp, "keys": len(state)}))
    return len(state)


@contextlib.contextmanager
def _one_core() -> Iterator[str]:
    """Pin the process to one CPU while timing (Linux); say which, or why not."""
    getter = getattr(os, "sched_getaffinity", None)
    setter = getattr(os, "sched_setaffinity", None)
    if getter is None or setter is None:
        yield "not pinned (no sched_setaffinity here)"
        return
    before = getter(0)
    cpu = min(before)
    setter(0, {cpu})
    try:
        yield f"pinned to CPU {cpu}"
    finally:
        setter(0, before)


def _best(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        gc.collect()
        gc.disable()
        try:
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        finally:
            gc.enable()
    return min(times)


def _measure(path: Path, model: torch.nn.Module, quantizer: Any, world: int, repeat: int) -> dict[str, Any]:
    import surgery

    from ..checkpoint import open_checkpoint
    from ..resolution import get_model_conversion_mapping
    from ..routing import route_keys

    options = {"quantizer": quantizer} if quantizer is not None else {}
    with open_checkpoint(path) as reader:
        keys = reader.keys()
        routed = [k for k in keys if not k.endswith("_scale_inv")] if quantizer is not None else keys
    transforms = get_model_conversion_mapping(model)
    runtime = model.state_dict().keys()

    def header() -> None:
        open_checkpoint(path).close()

    def routing() -> None:
        r = route_keys(routed, transforms, runtime_keys=runtime, base_model_prefix="model")
        for k in routed:
            r.routes[k]

    def plan_single() -> None:
        surgery.plan_load(model, path, **options)

    def plan_rank() -> None:
        surgery.plan_load(model, path, tp_plan=_EP_PLAN, tp_size=world, tp_rank=0, **options)

    out: dict[str, Any] = {"keys": len(keys)}
    for name, fn in (("header", header), ("routing", routing), ("single", plan_single), ("rank", plan_rank)):
        out[f"{name}_s"] = _best(fn, repeat)
    return out


def run(workdir: Path, *, layers: int, experts: int, world: int, repeat: int) -> dict[str, Any]:
    """Measure both indexes; returns ``{"B": ..., "K": ..., "pinned": ...}``."""
    from ..examples.moe import build_moe_model
    from ..quantization import FP8BlockQuantizer
    from .checkpoints import per_key_config, prepare

    prepare(workdir, "B", per_key_config(), runtime_file=False)
    b_model = build_moe_model(per_key_config(), seed=None, device="meta", dtype=torch.bfloat16)
    k_path = workdir / f"K-{layers}x{experts}"
    write_fp8_index(k_path, layers, experts)
    k_model = build_moe_model(_tiny_config(layers, experts), seed=None, device="meta")
    with _one_core() as pinned:
        b = _measure(workdir / "B" / "original", b_model, None, world, repeat)
        k = _measure(k_path, k_model, FP8BlockQuantizer(block_size=_BLOCK), world, repeat)
    return {"B": b, "K": k, "pinned": pinned}


def main(argv: Sequence[str] | None = None) -> None:
    """Command line: print the table of :func:`run`."""
    parser = bench_parser("planning", __doc__)
    parser.add_argument("--layers", type=positive_int, default=60, help="layers of the many-key index (60)")
    parser.add_argument("--experts", type=positive_int, default=1376, help="experts per layer (1376)")
    parser.add_argument(
        "--world", type=positive_int, default=8, help="expert-parallel ranks of the rank row (8)"
    )
    parser.add_argument("--repeat", type=positive_int, default=3, help="timed runs; the best counts (3)")
    parser.add_argument(
        "--workdir", type=Path, default=Path("/tmp/surgery-bench"), help="checkpoints go here"
    )
    args = parser.parse_args(argv)
    r = run(args.workdir, layers=args.layers, experts=args.experts, world=args.world, repeat=args.repeat)
    print(f"Header, routing and planning, best of {args.repeat}, one core ({r['pinned']}), collector paused")
    head = (
        f"{'index':<34}{'keys':>9}{'header s':>10}{'routing s':>11}{'plan 1p s':>11}"
        f"{'plan r0/' + str(args.world) + ' s':>13}{'us/key 1p':>11}{'us/key r0':>11}"
    )
    print(head)
    print("-" * len(head))
    labels = {
        "B": "B: 32 x 1024 x 3 bf16",
        "K": f"{args.layers} x {args.experts} x 3 FP8 + scales",
    }
    for name in ("B", "K"):
        x = r[name]
        single, rank = x["single_s"] - x["header_s"], x["rank_s"] - x["header_s"]
        print(
            f"{labels[name]:<34}{x['keys']:>9,}{x['header_s']:>10.3f}{x['routing_s']:>11.3f}{single:>11.3f}"
            f"{rank:>13.3f}{1e6 * single / x['keys']:>11.2f}{1e6 * rank / x['keys']:>11.2f}"
        )
    b, k = r["B"], r["K"]
    grow = (k["rank_s"] - k["header_s"]) / (b["rank_s"] - b["header_s"])
    print(
        f"[info] planning one EP rank: {k['rank_s'] - k['header_s']:.2f} s at {k['keys']:,} keys vs "
        f"{b['rank_s'] - b['header_s']:.2f} s at {b['keys']:,} ({grow:.1f}x for {k['keys'] / b['keys']:.1f}x the keys); "
        f"header {k['header_s']:.2f} s vs {b['header_s']:.2f} s"
    )
    rank_s = k["rank_s"] - k["header_s"]
    print(
        "[target] routing and planning of the many-key index on one rank within 2 s: "
        f"{'met' if rank_s <= 2.0 else 'not met'} ({rank_s:.2f} s)"
    )


if __name__ == "__main__":
    main()
