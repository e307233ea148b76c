"""Command line: ``surgery demo | preview | inspect | convert | bench`` (also ``python -m surgery``).

* ``demo``: the main job end to end on the built-in example models.
* ``preview``: show what a fusion would change on a built-in example (or your own model).
* ``inspect PATH``: summarize a checkpoint; with ``--model``, show the load plan (``--tp N``:
  what each of N tensor-parallel ranks reads, planned without a process group).
* ``convert SRC DST --model M``: load a checkpoint into a model and save it in another layout.
* ``bench {route,load,fusion,graph,quantization}``: benchmarks that print ratios against a floor.

``--model`` takes a built-in example name (``example-dense``, ``example-moe``, ``example-vision``) or
``package.module:factory``, a zero-argument callable returning an ``nn.Module``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable, Sequence

from torch import nn

from .checkpoint import open_checkpoint
from .demo import run_demo
from .errors import SurgeryError
from .examples.dense import build_dense_model
from .examples.moe import build_moe_model
from .examples.vision import build_vision_tower
from .fusion import preview_fusions
from .load.loader import load_checkpoint, plan_load
from .load.plan import fold_indices
from .save import save_checkpoint

__all__ = ["build_model", "main"]

_BENCHES = ("route", "load", "fusion", "graph", "quantization")


def _example_moe() -> nn.Module:
    return build_moe_model()


def _example_vision() -> nn.Module:
    return build_vision_tower()


def _example_dense() -> nn.Module:
    return build_dense_model()


_EXAMPLES: dict[str, Callable[[], nn.Module]] = {
    "example-dense": _example_dense,
    "example-moe": _example_moe,
    "example-vision": _example_vision,
}


def build_model(spec: str) -> nn.Module:
    """Build a model from a built-in example name or ``package.module:factory``."""
    if spec in _EXAMPLES:
        return _EXAMPLES[spec]()
    if ":" not in spec:
        import difflib

        close = difflib.get_close_matches(spec, list(_EXAMPLES), n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise SurgeryError(
            f"--model {spec!r} is neither a built-in example ({', '.join(_EXAMPLES)}) nor "
            f"'package.module:factory'.{hint}"
        )
    module_name, _, attr = spec.partition(":")
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise SurgeryError(f"--model {spec!r}: cannot import {attr!r} from {module_name!r} ({exc}).") from exc
    model = factory()
    if not isinstance(model, nn.Module):
        raise SurgeryError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module.")
    return model


def _fusion_arg(values: Sequence[str] | None) -> dict[str, object] | None:
    if not values:
        return None
    return {name: True for name in values}


def _cmd_demo(args: argparse.Namespace) -> int:
    return run_demo(workdir=args.workdir, quick=args.quick)


def _cmd_preview(args: argparse.Namespace) -> int:

    model = build_model(args.model)
    plan = preview_fusions(model, _fusion_arg(args.fusion) or {"patch_embeddings": True})
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    elif args.mermaid:
        print(plan.to_mermaid())
    else:
        print(plan.render())
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    if args.model:
        if args.tp is None:
            plan = plan_load(build_model(args.model), args.path, fusion_config=_fusion_arg(args.fusion))
            print(plan.to_json(indent=2) if args.json else plan.render())
            return 0
        tp_plan = json.loads(args.tp_plan) if args.tp_plan else "auto"
        ranks = range(args.tp) if args.tp_rank is None else [args.tp_rank]
        plans = [
            plan_load(
                build_model(args.model),
                args.path,
                fusion_config=_fusion_arg(args.fusion),
                tp_plan=tp_plan,
                tp_size=args.tp,
                tp_rank=r,
            )
            for r in ranks
        ]
        if args.json:
            print(json.dumps([p.to_dict() for p in plans], indent=2))
        else:
            print("\n\n".join(p.render() for p in plans))
        return 0
    with open_checkpoint(args.path) as reader:
        keys = reader.keys()
        by_sig: dict[tuple[str, str], list[str]] = {}
        total = 0
        for k in keys:
            info = reader.info(k)
            total += info.nbytes
            sig = (str(info.dtype).removeprefix("torch."), str(tuple(info.shape)))
            by_sig.setdefault(sig, []).append(k)
        print(f"{args.path}: {len(keys)} tensors in {len(reader.files)} file(s), {total / 2**20:.1f} MiB")
        if reader.metadata:
            print(f"metadata: {dict(reader.metadata)}")
        for (dtype, shape), ks in by_sig.items():
            print(f"  {dtype:<9} {shape:<22} {fold_indices(ks)}")
    return 0


def _cmd_convert(args: argparse.Namespace) -> int:
    model = build_model(args.model)
    report = load_checkpoint(model, args.src, fusion_config=_fusion_arg(args.fusion), strict=not args.lenient)
    print(report)
    files = save_checkpoint(
        model, args.dst, original_format=not args.runtime_layout, max_shard_size=args.max_shard_size
    )
    print(f"wrote {len(files)} file(s) to {args.dst}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"surgery.bench.{args.which}")
    return int(module.main(args.rest) or 0)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="surgery", description="PyTorch-native model surgery.")
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="run the main job on the built-in example models")
    d.add_argument("--workdir", default=None, help="where to write checkpoints (default: a temp dir)")
    d.add_argument("--quick", action="store_true", help="smaller models")
    d.set_defaults(func=_cmd_demo)

    pv = sub.add_parser("preview", help="preview a fusion on a model")
    pv.add_argument("--model", default="example-vision")
    pv.add_argument("--fusion", action="append", help="fusion name (repeatable); default patch_embeddings")
    pv.add_argument("--json", action="store_true")
    pv.add_argument("--mermaid", action="store_true")
    pv.set_defaults(func=_cmd_preview)

    i = sub.add_parser("inspect", help="summarize a checkpoint, or plan a load with --model")
    i.add_argument("path")
    i.add_argument("--model", default=None)
    i.add_argument("--fusion", action="append")
    i.add_argument("--json", action="store_true")
    i.add_argument("--tp", type=int, default=None, help="plan a tensor-parallel load for this many ranks")
    i.add_argument("--tp-rank", type=int, default=None, help="only this rank (default: every rank)")
    i.add_argument("--tp-plan", default=None, help="a JSON tp_plan (default: the model's own, 'auto')")
    i.set_defaults(func=_cmd_inspect)

    c = sub.add_parser("convert", help="load a checkpoint into a model and save it again")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--model", required=True)
    c.add_argument("--fusion", action="append")
    c.add_argument("--runtime-layout", action="store_true", help="save the runtime layout")
    c.add_argument("--max-shard-size", default="5GB")
    c.add_argument("--lenient", action="store_true", help="do not fail on report problems")
    c.set_defaults(func=_cmd_convert)

    b = sub.add_parser("bench", help="benchmarks (print ratios against a floor)")
    b.add_argument("which", choices=_BENCHES)
    b.add_argument("rest", nargs=argparse.REMAINDER)
    b.set_defaults(func=_cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``surgery`` command."""
    args = _parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except SurgeryError as exc:
        print(f"surgery: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
