"""Command line: ``surgery demo | preview | inspect | convert | verify | catalog | bench`` (also ``python -m surgery``).

* ``demo``: the main job end to end on the built-in example models.
* ``preview``: show what a fusion would change on a built-in example (or your own model).
* ``inspect PATH``: summarize a checkpoint; with ``--model``, show the load plan (``--tp N``:
  what each of N tensor-parallel ranks reads, planned without a process group; ``--mesh
  dp_shard=2,tp=2``: the same for every rank of an n-D mesh, FSDP2 over the dp dims).
* ``convert SRC DST --model M``: load a checkpoint into a model and save it in another layout.
* ``verify CKPT --model M``: audit a load → save round trip tensor by tensor (exit 0 identical,
  1 different, 2 error); ``--json FILE`` writes the card (``docs/verify.md``); ``--tp N`` under
  ``torchrun``: every rank loads its shards and audits its share.
* ``catalog``: the registered conversion mappings (families and aliases).
* ``bench {route,load,fusion,graph,quantization}``: benchmarks that print ratios against a floor.

``--model`` takes a built-in example name (``example-decoder``, ``example-dense``, ``example-moe``,
``example-vision``), ``package.module:factory`` (a zero-argument callable returning an
``nn.Module``), or ``transformers:auto``: the transformers model the checkpoint's ``config.json``
describes, built on ``meta`` (:mod:`surgery.auto_model`).

Errors are one line on stderr and exit code 2 (:class:`_Parser` for arguments, :func:`main` for
the rest, an unexpected exception included: a longer message is cut to its first line,
``--verbose`` prints it whole with the traceback). Output into a pipe closed early (``surgery inspect X | head``) ends quietly, as a
process killed by SIGPIPE does (exit code 141).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from .bench import positive_int
from .errors import SurgeryError

if TYPE_CHECKING:
    from torch import nn

    from .load import LoadReport
# Everything that imports torch is imported by the command that needs it: ``surgery --help``
# and argument errors answer at once.

__all__ = ["build_model", "main"]

_TRANSFORMERS_AUTO = "transformers:auto"  # surgery.auto_model.TRANSFORMERS_AUTO, without importing torch
_QUANTIZATIONS = ("fp8", "int8", "auto")  # surgery.quantization.QUANTIZATION_CHOICES
_DTYPES = ("float16", "bfloat16", "float32", "float64")  # surgery.casting.SAVE_DTYPES

_TP_LAUNCH = "torchrun --nproc-per-node N -m surgery verify CKPT --model M --tp N"
_BENCHES = (
    "route",
    "load",
    "planning",
    "moe_dispatch",
    "fusion",
    "graph",
    "io",
    "quantization",
    "verify",
    "gpu",
)


def _example_moe() -> nn.Module:
    from .examples.moe import build_moe_model

    return build_moe_model()


def _example_vision() -> nn.Module:
    from .examples.vision import build_vision_tower

    return build_vision_tower()


def _example_dense() -> nn.Module:
    from .examples.dense import build_dense_model

    return build_dense_model()


def _example_decoder() -> nn.Module:
    from .examples.decoder import build_decoder_model

    return build_decoder_model()


_EXAMPLES: dict[str, Callable[[], nn.Module]] = {
    "example-decoder": _example_decoder,
    "example-dense": _example_dense,
    "example-moe": _example_moe,
    "example-vision": _example_vision,
}


def build_model(spec: str, *, checkpoint: str | os.PathLike[str] | None = None) -> nn.Module:
    """Build a model from a built-in example name, ``package.module:factory`` or ``transformers:auto``.

    ``transformers:auto`` reads the ``config.json`` beside ``checkpoint``.
    """
    from torch import nn

    if spec == _TRANSFORMERS_AUTO:
        from .auto_model import transformers_model

        if checkpoint is None:
            raise SurgeryError(f"--model {spec} builds the model of a checkpoint; this command reads none.")
        return transformers_model(checkpoint)
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
    if "" not in sys.path and os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())  # modules in the current directory, as ``python -m`` finds them
    try:
        factory = getattr(importlib.import_module(module_name), attr)
    except Exception as exc:  # ImportError, AttributeError, or whatever the module raised on import
        raise SurgeryError(
            f"--model {spec!r}: cannot import {attr!r} from {module_name!r} ({type(exc).__name__}: {exc})."
        ) from exc
    if not callable(factory):
        raise SurgeryError(
            f"--model {spec!r}: {attr!r} is a {type(factory).__name__}, not a factory function."
        )
    try:
        model = factory()
    except TypeError as exc:
        raise SurgeryError(
            f"--model {spec!r}: calling {attr}() failed ({exc}); the factory must take no arguments."
        ) from exc
    except Exception as exc:
        raise SurgeryError(f"--model {spec!r}: {attr}() raised {type(exc).__name__}: {exc}") from exc
    if not isinstance(model, nn.Module):
        raise SurgeryError(f"--model {spec!r} returned {type(model).__name__}, not an nn.Module.")
    return model


def _quantizer(args: argparse.Namespace, checkpoint: str) -> object | None:
    """The quantizer ``--quantization`` names (``None``: no option, or ``auto`` over a float checkpoint)."""
    if args.quantization is None:
        return None
    from .quantization import quantizer_by_name

    return quantizer_by_name(args.quantization, checkpoint)


def _tp_plan(text: str | None) -> dict[str, Any] | str:
    """``--tp-plan``: a JSON object (module pattern → style name); absent: the model's own (``auto``)."""
    if text is None:
        return "auto"
    try:
        plan = json.loads(text)
    except ValueError as exc:
        raise SurgeryError(
            f'--tp-plan is not JSON ({exc}); give an object, e.g. \'{{"model.layers.*.mlp.up_proj": "colwise"}}\'.'
        ) from None
    if not isinstance(plan, dict):
        raise SurgeryError(f"--tp-plan is a JSON {type(plan).__name__}; give an object of pattern to style.")
    return plan


def _fusion_arg(values: Sequence[str] | None) -> dict[str, object] | None:
    if not values:
        return None
    return {name: True for name in values}


def _cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    return run_demo(workdir=args.workdir, quick=args.quick)


def _cmd_preview(args: argparse.Namespace) -> int:
    from .fusion import preview_fusions

    if args.full and not args.mermaid:
        raise SurgeryError("preview --full draws every node of a --mermaid diagram: give --mermaid too.")
    model = build_model(args.model)
    plan = preview_fusions(model, _fusion_arg(args.fusion) or {"patch_embeddings": True})
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2, default=str))
    elif args.mermaid:
        print(plan.to_mermaid(full=args.full))
    else:
        print(plan.render())
    return 0


def _mesh_arg(text: str) -> dict[str, int]:
    """``--mesh dp_shard=2,tp=2``: dim name to size, in the order given."""
    out: dict[str, int] = {}
    for part in text.split(","):
        name, eq, size = part.partition("=")
        if not eq or not size.strip().isdigit() or int(size) < 1 or name.strip() in out:
            raise SurgeryError(
                f"--mesh {text!r}: give each dim once as name=size, comma-separated, e.g. --mesh dp_shard=2,tp=2."
            )
        out[name.strip()] = int(size)
    return out


def _mesh_plans(args: argparse.Namespace, quantizer: Any) -> int:
    """``inspect --mesh``: every rank's plan of an n-D mesh (tp_plan on ``tp`` or ``ep``, FSDP2 on the dp dims)."""
    from .load.loader import plan_load
    from .parallel.mesh_shape import parallel_dim

    if args.tp is not None or args.tp_rank is not None:
        raise SurgeryError("--mesh plans every rank of its mesh; leave out --tp and --tp-rank.")
    dims = _mesh_arg(args.mesh)
    parallel = parallel_dim(tuple(dims)) is not None
    tp_plan = _tp_plan(args.tp_plan) if parallel else None
    if args.tp_plan is not None and not parallel:
        raise SurgeryError(
            f"--tp-plan shards the 'tp' (or 'ep') dim, which --mesh {args.mesh} lacks; add tp=N (or ep=N) to --mesh."
        )
    plans = [
        plan_load(
            build_model(args.model, checkpoint=args.path),
            args.path,
            fusion_config=_fusion_arg(args.fusion),
            tp_plan=tp_plan,
            device_mesh=dims,
            rank=r,
            allow_pickle=args.allow_pickle,
            quantizer=quantizer,
        )
        for r in range(math.prod(dims.values()))
    ]
    if args.json:
        print(json.dumps([p.to_dict() for p in plans], indent=2))
    else:
        print("\n\n".join(p.render() for p in plans))
    return 0


def _cmd_inspect(args: argparse.Namespace) -> int:
    from .checkpoint import open_checkpoint
    from .load.loader import plan_load
    from .load.plan import fold_indices

    if args.model:
        quantizer = _quantizer(args, args.path)
        if args.mesh is not None:
            return _mesh_plans(args, quantizer)
        if args.tp is None:
            plan = plan_load(
                build_model(args.model, checkpoint=args.path),
                args.path,
                fusion_config=_fusion_arg(args.fusion),
                allow_pickle=args.allow_pickle,
                quantizer=quantizer,
            )
            print(plan.to_json(indent=2) if args.json else plan.render())
            _unmatched_fusions(args, plan.fusions)
            return 0
        tp_plan = _tp_plan(args.tp_plan)
        if args.tp_rank is not None and not 0 <= args.tp_rank < args.tp:
            raise SurgeryError(f"--tp-rank {args.tp_rank}: the ranks of --tp {args.tp} are 0..{args.tp - 1}.")
        ranks = range(args.tp) if args.tp_rank is None else [args.tp_rank]
        plans = [
            plan_load(
                build_model(args.model, checkpoint=args.path),
                args.path,
                fusion_config=_fusion_arg(args.fusion),
                tp_plan=tp_plan,
                tp_size=args.tp,
                tp_rank=r,
                allow_pickle=args.allow_pickle,
                quantizer=quantizer,
            )
            for r in ranks
        ]
        if args.json:
            print(json.dumps([p.to_dict() for p in plans], indent=2))
        else:
            print("\n\n".join(p.render() for p in plans))
        return 0
    if (
        args.tp is not None
        or args.tp_plan is not None
        or args.quantization is not None
        or args.mesh is not None
    ):
        raise SurgeryError("--tp, --mesh, --tp-plan and --quantization plan a load: give --model too.")
    with open_checkpoint(args.path, allow_pickle=args.allow_pickle) as reader:
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
    from .casting import check_save_dtype
    from .checkpoint import parse_size
    from .errors import LoadError
    from .load import LoadReport
    from .load.loader import load_checkpoint
    from .save import save_checkpoint

    parse_size(args.max_shard_size)  # a bad size fails before anything is loaded
    src, dst = Path(args.src).resolve(), Path(args.dst).resolve()
    if src == dst or (src.is_file() and src.parent == dst):
        raise SurgeryError(
            f"convert {args.src} {args.dst}: the output would replace the checkpoint being read; pick another DST."
        )
    model = build_model(args.model, checkpoint=args.src)
    try:
        report = load_checkpoint(
            model,
            args.src,
            fusion_config=_fusion_arg(args.fusion),
            strict=not args.lenient,
            allow_pickle=args.allow_pickle,
            quantizer=_quantizer(args, args.src),
        )
    except LoadError as exc:
        if not isinstance(exc.report, LoadReport):
            raise
        where = _write_report(exc.report)
        raise SurgeryError(
            f"convert: strict load failed, nothing written: {exc.report.summary()} (full report: {where}; "
            "--lenient saves anyway)"
        ) from exc
    print(report)
    _unmatched_fusions(args, report.fusions)
    replaced = (
        sorted(p.name for p in dst.iterdir() if p.suffix in (".safetensors", ".json")) if dst.is_dir() else []
    )
    if replaced:
        print(f"replacing in {args.dst}: {', '.join(replaced[:6])}{' ...' if len(replaced) > 6 else ''}")
    files = save_checkpoint(
        model,
        args.dst,
        original_format=not args.runtime_layout,
        max_shard_size=args.max_shard_size,
        dtype=check_save_dtype(args.dtype),
    )
    if files.casts:
        print(files.summary())
    print(f"wrote {len(files)} file(s) to {args.dst}")
    return 0


def _write_report(report: LoadReport) -> str:
    """Write a failed load's full report to a new file in the temp directory; its path."""
    fd, name = tempfile.mkstemp(prefix="surgery-convert-", suffix=".report.txt")
    with os.fdopen(fd, "w") as f:
        f.write(f"{report}\n")
    return name


def _cmd_verify(args: argparse.Namespace) -> int:
    """``surgery verify``: 0 when every tensor is identical (or an allowed difference), else 1."""
    from .verification import verify

    if args.tp_plan is not None and args.tp is None:
        raise SurgeryError("--tp-plan is the plan of a tensor-parallel audit: give --tp N too.")
    with _tp_mesh(args.tp) as mesh:
        card = verify(
            lambda: build_model(args.model),
            args.checkpoint,
            fusion_config=_fusion_arg(args.fusion),
            quantizer=_quantizer(args, args.checkpoint),
            tp_plan=_tp_plan(args.tp_plan) if mesh is not None else None,
            device_mesh=mesh,
            dtype=args.dtype,
            allow=args.allow or (),
            output=args.output,
            workdir=args.workdir,
            max_shard_size=args.max_shard_size,
        )
        rank = mesh.get_rank() if mesh is not None else 0
    if rank == 0:  # every rank holds the same card: one prints it
        if args.json:
            Path(args.json).write_text(json.dumps(card.to_dict(), indent=2) + "\n")
        print(card.render(limit=args.limit))
    return 0 if card.ok else 1


@contextlib.contextmanager
def _tp_mesh(tp: int | None) -> Any:
    """``--tp N``: the 1-D mesh of the N ranks torchrun launched (``None`` without ``--tp``).

    The process group is the one already initialized, else one from torchrun's environment
    (gloo on CPU, NCCL on this rank's GPU when there are GPUs), destroyed on the way out.
    """
    if tp is None:
        yield None
        return
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    launch = f"torchrun --nproc-per-node {tp} -m surgery verify ... --tp {tp}"
    started = not dist.is_initialized()
    if started:
        if "WORLD_SIZE" not in os.environ:
            raise SurgeryError(
                f"--tp {tp} audits from a tensor-parallel launch of {tp} processes: run `{launch}`."
            )
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if cuda else "gloo")
    try:
        if dist.get_world_size() != tp:
            raise SurgeryError(
                f"--tp {tp} but {dist.get_world_size()} processes were launched: run `{launch}`."
            )
        yield init_device_mesh("cuda" if torch.cuda.is_available() else "cpu", (tp,))
    except BaseException:
        if started:  # no barrier: a rank that failed alone must not wait for the others
            dist.destroy_process_group()
        raise
    if started:
        # Every rank is done before any tears down: a rank whose peer closed the connections
        # under it while it still shut down its own gloo threads was seen aborting at exit.
        dist.barrier()
        dist.destroy_process_group()


def _unmatched_fusions(args: argparse.Namespace, applied: dict[str, object] | None) -> None:
    """Say which requested ``--fusion`` fused nothing in the model (as ``preview`` does)."""
    for name in args.fusion or ():
        if name not in (applied or {}):
            print(
                f"surgery: note: fusion {name!r} fused nothing in {args.model}; `surgery preview --model "
                f"{args.model} --fusion {name}` shows why",
                file=sys.stderr,
            )


def _cmd_catalog(args: argparse.Namespace) -> int:
    from .registry import checkpoint_conversion_entry, list_checkpoint_conversion_keys

    keys = list_checkpoint_conversion_keys()
    if args.json:
        out = {}
        for key in keys:
            entry = checkpoint_conversion_entry(key)
            assert entry is not None  # listed, so registered
            out[key] = (
                {"alias_of": entry.alias}
                if entry.alias
                else {"transforms": [repr(t) for t in entry.transforms]}
            )
        print(json.dumps(out, indent=2))
        return 0
    print(f"{len(keys)} registered keys (class names and model types):")
    for key in keys:
        entry = checkpoint_conversion_entry(key)
        assert entry is not None
        what = f"-> {entry.alias}" if entry.alias else f"{len(entry.transforms)} transform(s)"
        print(f"  {key:<44} {what}")
    return 0


def _cmd_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(f"surgery.bench.{args.which}")
    return int(module.main(args.rest) or 0)


_MODEL_HELP = (
    "the model: a built-in example (" + ", ".join(_EXAMPLES) + "), package.module:factory, a "
    "zero-argument callable returning an nn.Module (modules in the current directory are found), or "
    f"{_TRANSFORMERS_AUTO}, the transformers model of the checkpoint's config.json (built on meta)"
)
_QUANTIZATION_HELP = (
    "decode or quantize with a built-in quantizer: fp8 (block-wise FP8, as config.json's quantization_config "
    "says), int8 (int8 weight-only, on the fly), auto (the quantizer registered for config.json's quantization_config: "
    "fp8, int8_weight_only, mxfp4 (gpt-oss), compressed-tensors pack-quantized/float-quantized/nvfp4-pack-quantized/"
    "mxfp4-pack-quantized, ...)"
)


class _Parser(argparse.ArgumentParser):
    """An argument parser whose errors are one line (``surgery convert: error: ...``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="surgery",
        description="PyTorch-native model surgery: fusions, checkpoint conversion, tensor parallelism.",
        epilog="--model takes " + _MODEL_HELP.removeprefix("the model: ") + ".",
    )
    p.add_argument("--version", action="version", version=f"surgery {_version()}")
    p.add_argument("--verbose", action="store_true", help="print the traceback of an error")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    d = sub.add_parser("demo", help="run the main job on the built-in example models")
    d.add_argument(
        "--workdir", default=None, help="where to write checkpoints (default: a temp dir, deleted)"
    )
    d.add_argument("--quick", action="store_true", help="smaller models")
    d.set_defaults(func=_cmd_demo)

    pv = sub.add_parser("preview", help="preview a fusion on a model")
    pv.add_argument("--model", default="example-vision", help=_MODEL_HELP + "; default example-vision")
    pv.add_argument("--fusion", action="append", help="fusion name (repeatable); default patch_embeddings")
    out = pv.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print the plan as JSON")
    out.add_argument("--mermaid", action="store_true", help="print the graphs as a mermaid diagram")
    pv.add_argument(
        "--full",
        action="store_true",
        help="with --mermaid: every node of each graph (default: the rewritten nodes and their neighbours)",
    )
    pv.set_defaults(func=_cmd_preview)

    i = sub.add_parser("inspect", help="summarize a checkpoint, or plan a load with --model")
    i.add_argument("path", help="a .safetensors file, a checkpoint directory, or an index .json")
    i.add_argument("--model", default=None, help=_MODEL_HELP)
    i.add_argument("--fusion", action="append", help="fusion name to apply first (repeatable)")
    i.add_argument("--json", action="store_true", help="print the plan as JSON")
    i.add_argument(
        "--allow-pickle", action="store_true", help="accept .bin/.pt files (read with weights_only=True)"
    )
    i.add_argument("--quantization", choices=_QUANTIZATIONS, default=None, help=_QUANTIZATION_HELP)
    i.add_argument(
        "--tp", type=positive_int, default=None, help="plan a tensor-parallel load for this many ranks"
    )
    i.add_argument("--tp-rank", type=int, default=None, help="only this rank (default: every rank)")
    i.add_argument("--tp-plan", default=None, help="a JSON tp_plan (default: the model's own, 'auto')")
    i.add_argument(
        "--mesh",
        default=None,
        help="plan every rank of an n-D mesh, e.g. dp_shard=2,tp=2 or ep=8 (dims dp_replicate, dp_shard, ep or tp: "
        "tp_plan on tp, the model's ep_plan on ep, FSDP2 on the dp dims)",
    )
    i.set_defaults(func=_cmd_inspect)

    c = sub.add_parser("convert", help="load a checkpoint into a model and save it again")
    c.add_argument("src", help="the checkpoint to read")
    c.add_argument("dst", help="the directory (or .safetensors file) to write; not SRC")
    c.add_argument("--model", required=True, help=_MODEL_HELP)
    c.add_argument("--fusion", action="append", help="fusion name to apply first (repeatable)")
    c.add_argument("--runtime-layout", action="store_true", help="save the runtime layout")
    c.add_argument("--quantization", choices=_QUANTIZATIONS, default=None, help=_QUANTIZATION_HELP)
    c.add_argument(
        "--dtype",
        choices=_DTYPES,
        default=None,
        help="write every floating tensor in this dtype (default: the dtype each had in SRC); quantized "
        "codes and their scales keep theirs",
    )
    c.add_argument(
        "--max-shard-size",
        default="5GB",
        help="bytes per shard: an int, or e.g. 5GB, 500MB, 2GiB (default 5GB)",
    )
    c.add_argument("--lenient", action="store_true", help="do not fail on report problems")
    c.add_argument(
        "--allow-pickle", action="store_true", help="accept .bin/.pt files (read with weights_only=True)"
    )
    c.set_defaults(func=_cmd_convert)

    v = sub.add_parser(
        "verify",
        help="audit a load -> save round trip tensor by tensor (exit 0 identical, 1 different, 2 error)",
        description="Load CKPT into the model, save it in the original layout, load that back and save "
        "again; compare names, dtypes, shapes and SHA-256 of every tensor with CKPT. Exit status: 0 when "
        "every tensor is identical (or a difference --allow accepts), 1 when anything differs, 2 on an "
        "error. docs/verify.md shows its use in a conversion pipeline.",
    )
    v.add_argument("checkpoint", help="the checkpoint to audit (file, directory or index .json)")
    v.add_argument("--model", required=True, help=_MODEL_HELP)
    v.add_argument("--fusion", action="append", help="fusion name to apply first (repeatable)")
    v.add_argument(
        "--quantization",
        choices=_QUANTIZATIONS,
        default=None,
        help=_QUANTIZATION_HELP + "; default: what CKPT persisted, as a load does",
    )
    v.add_argument(
        "--dtype", default=None, help="load dtype (e.g. bfloat16, or 'checkpoint'); default: the model's"
    )
    v.add_argument(
        "--allow",
        action="append",
        choices=("cast", "requantize"),
        help="accept this difference (repeatable): cast (other dtype), requantize (quantized codes changed)",
    )
    v.add_argument(
        "--output", default=None, help="audit this converted checkpoint against CKPT instead of a fresh save"
    )
    v.add_argument(
        "--tp",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"audit from a tensor-parallel launch of N ranks ({_TP_LAUNCH}): each rank loads its shards "
        "and audits its share of the tensors; rank 0 prints the card",
    )
    v.add_argument(
        "--tp-plan", default=None, help="with --tp: a JSON tp_plan (default: the model's own, 'auto')"
    )
    v.add_argument("--json", default=None, metavar="FILE", help="write the verification card as JSON to FILE")
    v.add_argument("--workdir", default=None, help="where the two saves go (default: a temp dir, deleted)")
    v.add_argument("--max-shard-size", default="5GB", help="bytes per shard of the two saves (default 5GB)")
    v.add_argument(
        "--limit", type=int, default=20, help="non-identical tensors listed on stdout (default 20)"
    )
    v.set_defaults(func=_cmd_verify)

    cat = sub.add_parser("catalog", help="list the registered conversion mappings (families and aliases)")
    cat.add_argument("--json", action="store_true", help="print them as JSON, with their transforms")
    cat.set_defaults(func=_cmd_catalog)

    b = sub.add_parser("bench", help="benchmarks (print ratios against a floor)")
    b.add_argument("which", choices=_BENCHES, help="which benchmark: " + ", ".join(_BENCHES))
    b.add_argument("rest", nargs=argparse.REMAINDER, help="its own options (surgery bench WHICH --help)")
    b.set_defaults(func=_cmd_bench)
    return p


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("torch-surgery")
    except PackageNotFoundError:
        return "unknown (not installed)"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``surgery`` command."""
    args = _parser().parse_args(argv)
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
        return code
    except SurgeryError as exc:
        if args.verbose:
            traceback.print_exc()
        print(f"surgery: error: {_one_line(str(exc), verbose=args.verbose)}", file=sys.stderr)
        return 2
    except BrokenPipeError:  # ``surgery inspect X | head``: the reader went away, as it may
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to write at exit
        return 128 + signal.SIGPIPE  # the status of a process SIGPIPE ended, silently
    except Exception as exc:  # not one of ours: a bug here, or torch/safetensors refusing something
        if args.verbose:
            traceback.print_exc()
        where = "" if args.verbose else "; surgery --verbose ... prints the traceback"
        print(
            f"surgery: error: unexpected {type(exc).__name__}: {_one_line(str(exc), verbose=False)}{where}",
            file=sys.stderr,
        )
        return 2


def _one_line(message: str, *, verbose: bool) -> str:
    """The first line of ``message``, saying how many more ``--verbose`` prints."""
    first, *rest = message.strip().splitlines() or [""]
    if verbose or not rest:
        return message if verbose else first
    return f"{first} [{len(rest)} more line(s): surgery --verbose ...]"


if __name__ == "__main__":
    raise SystemExit(main())
