"""The planning passes: the named steps :func:`~surgery.load.planner.prepare` runs on every entry.

A load plan is decided one checkpoint group (the keys that produce one set of runtime keys) at a
time. :func:`prepare` wraps each group in a :class:`Candidate` and runs :data:`PASSES` over it, in
order, until one of them settles the entry (``unexpected``, ``mismatch`` or ``error``: it is
reported, not loaded):

1. :func:`decode`: the sources a quantizer decodes, and what the op chain sees after decoding;
2. :func:`infer_shapes`: the converter's outputs from headers (a ``meta`` run, cached);
3. :func:`check_targets`: the outputs against the model (names, shapes, device);
4. :func:`plan_quantization`: the runtime keys an on-the-fly quantizer makes of each target;
5. :func:`check_quantized`: casts across a quantization boundary;
6. :func:`choose_dtypes`: the dtype of every runtime key, and the casts nobody asked for;
7. :func:`choose_mode`: ``mmap``, ``direct`` or ``convert`` (see :mod:`surgery.load.planner`);
8. :func:`shard`: under tensor parallelism, what this rank reads (:mod:`surgery.load.sharding`);
9. :func:`check_values`: the stored values a quantizer asks to check (its scales), read now
   (under tensor parallelism, only the part covering this rank's region).

Every pass reads and writes a :class:`Planning` context, built once per load: the model's runtime
tensors, the routing, the quantizer and the rank, and what the passes find (mismatches, failures,
covered keys, dtypes). Each pass is a plain function of the context and one candidate, so it can
be run and tested alone; the entries go one at a time through all the passes, so everything a
load reports comes out in checkpoint order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointReader, StoredTensor
from ..converter import WeightConverter
from ..errors import ConfigurationError, ConversionError, SurgeryError
from ..model_state import dtype_name, lossy_cast
from ..ops import OpContext
from ..parallel.regions import NOT_NEEDED, Box, Region, local_shape
from ..placement import all_contiguous, placement_views, source_slot_shapes
from ..quantization import QuantizerHooks
from ..record import Origin
from ..routing import Routing
from ..transforms import WeightTransform
from .plan import LoadPlan, Mode, PlanEntry, Status
from .quantized import (
    check_stored,
    companion_bytes,
    decoded_info,
    plan_quantize,
    prequantized_sources,
    quantized_cast_problem,
)
from .report import ConversionFailure, Mismatch
from .shapes import BUILTIN_OPS, infer_outputs, op_context
from .sharding import Sharding, TensorParallel, direct_possible, shard_work

__all__ = [
    "PASSES",
    "Candidate",
    "Chain",
    "Memo",
    "Planning",
    "check_quantized",
    "check_targets",
    "check_values",
    "choose_dtypes",
    "choose_mode",
    "decode",
    "fail",
    "infer_shapes",
    "plan_quantization",
    "shard",
]


@dataclass(frozen=True)
class Memo:
    """What passes remember within one load, so that 32 alike layers are decided once.

    Attributes:
        shapes: a converter's output slots per look of its sources (:func:`infer_shapes`).
        views: whether a destination's placement views are contiguous (:func:`choose_mode`).
        decoded: the dtype a quantizer decodes a stored look to (:func:`decode`).
        quantized: a quantizer's outputs per module type, name, shape and dtype (:func:`plan_quantization`).
    """

    shapes: dict[Any, list[Any]] = field(default_factory=dict)
    views: dict[Any, bool] = field(default_factory=dict)
    decoded: dict[Any, tuple[tuple[int, ...], torch.dtype]] = field(default_factory=dict)
    quantized: dict[Any, dict[str, torch.Tensor]] = field(default_factory=dict)


@dataclass
class Planning:
    """What the passes share over one load: its inputs, and what they find.

    Attributes:
        model: the model planned for (fused, quantizer modules swapped, parallelized).
        reader: the open checkpoint.
        plan: the plan being built (its entries are appended as candidates are made).
        transforms: the model's transforms, in the order routing indexes them.
        transform_names: each transform as the plan shows it.
        origins: why each transform is in the list (aligned with ``transforms``).
        routing: where every checkpoint key goes.
        runtime: the model's tensors by runtime key.
        tied: per tied runtime key, every name of its tensor.
        config_for: ``runtime key -> config`` of the nearest sub-model (what ops read).
        dtype: the ``dtype=`` asked for (``None``, a dtype, or ``"checkpoint"``).
        device: the ``device=`` asked for (``None``: each parameter's own).
        stand_in: plan tensors on ``meta`` as if they lived on this device (a dry run on a copy).
        mmap: whether the ``mmap`` mode may be chosen.
        hooks: the quantizer, or ``None``.
        companions_of: per checkpoint key a quantizer decodes, its companion keys.
        key_errors: per checkpoint key that cannot be decoded, why.
        tp: this rank's tensor-parallel view, or ``None``.
        placements: under tensor parallelism, each runtime key's placements.
        mismatches / failures / covered / target_dtype / checked: what the passes found: shape
            and dtype mismatches, failed entries (with their plan index), the runtime keys some
            entry fills or reports, every target's dtype, and the companions read and checked.
        targeted: the candidates whose targets the model has (conflicts are settled among them).
        memo: what the passes remember within one load (see :class:`Memo`).
    """

    model: nn.Module
    reader: CheckpointReader
    plan: LoadPlan
    transforms: list[WeightTransform]
    transform_names: list[str]
    origins: list[Origin]
    routing: Routing
    runtime: dict[str, torch.Tensor]
    tied: dict[str, list[str]]
    config_for: Callable[[str], Any]
    dtype: torch.dtype | str | None = None
    device: torch.device | None = None
    stand_in: torch.device | None = None
    mmap: bool = True
    hooks: QuantizerHooks | None = None
    companions_of: dict[str, tuple[str, ...]] = field(default_factory=dict)
    key_errors: dict[str, str] = field(default_factory=dict)
    tp: TensorParallel | None = None
    placements: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    mismatches: list[Mismatch] = field(default_factory=list)
    failures: list[tuple[int, ConversionFailure]] = field(default_factory=list)
    covered: set[str] = field(default_factory=set)
    target_dtype: dict[str, torch.dtype] = field(default_factory=dict)
    checked: dict[str, torch.Tensor] = field(default_factory=dict)
    partial: set[str] = field(default_factory=set)  # companions in ``checked`` read in part
    values: dict[str, torch.Tensor] = field(default_factory=dict)  # small companions read whole to plan
    targeted: list[Candidate] = field(default_factory=list)
    memo: Memo = field(default_factory=Memo)

    def device_of(self, t: torch.Tensor) -> torch.device:
        """Where ``t`` lives, for planning (the stand-in device for a ``meta`` tensor of a dry run)."""
        return self.stand_in if self.stand_in is not None and t.device.type == "meta" else t.device


@dataclass(frozen=True)
class Chain:
    """A converter's op chain as one group runs it.

    Attributes:
        converter: the converter that claimed the group's keys.
        group_key: the group's identity (its first target key), which the converter collects under.
        config: the sub-model's config the ops read.
        slot_shapes: per source pattern, the source shape or index-ordered shapes (``None`` when
            unknown), which direct placement cuts the destination into.
    """

    converter: WeightConverter
    group_key: str
    config: Any
    slot_shapes: list[Any] | None


_UNDECIDED = torch.device("meta")


@dataclass(eq=False)
class Candidate:
    """One plan entry while the passes decide it (the ones left ``ok`` become the loader's work).

    Attributes:
        index: the entry's position in the plan.
        entry: the plan entry the passes fill in.
        group_key: the routing group's identity.
        converter: index of the group's converter in the transforms (``None``: a plain tensor).
        infos: per source key, its header (after :func:`decode`: as the chain sees it).
        pattern_of: per source key, ``(source pattern index, wildcard index)``.
        decoded: per source key a quantizer decodes, the companion keys it decodes with.
        chain: the converter's chain (after :func:`infer_shapes`; ``None`` for a plain tensor).
        out_shapes / out_dtypes: per target, the shape and dtype the chain produces.
        device: where the targets go (after :func:`check_targets`).
        produced: per target an on-the-fly quantizer takes, the runtime keys it makes.
        cast: whether some target is cast from the dtype the chain produces.
        sharding: under tensor parallelism, what this rank reads (after :func:`shard`).
    """

    index: int
    entry: PlanEntry
    group_key: str
    converter: int | None
    infos: list[StoredTensor]
    pattern_of: dict[str, tuple[int, tuple[int, ...]]]
    decoded: dict[str, tuple[str, ...]] = field(default_factory=dict)
    chain: Chain | None = None
    out_shapes: list[tuple[int, ...]] = field(default_factory=list)
    out_dtypes: list[torch.dtype] = field(default_factory=list)
    device: torch.device = _UNDECIDED
    produced: dict[str, tuple[str, ...]] = field(default_factory=dict)
    cast: bool = False
    sharding: Sharding | None = None

    @property
    def ok(self) -> bool:
        return self.entry.status == Status.OK


def fail(ctx: Planning, c: Candidate, transform: str, message: str) -> None:
    """Settle ``c`` as an error: it is skipped, and its targets are reported, not missing."""
    entry = c.entry
    entry.status, entry.mode, entry.message = Status.ERROR, Mode.SKIP, message
    ctx.failures.append(
        (c.index, ConversionFailure(transform, entry.source_keys, entry.target_keys, message))
    )
    ctx.covered.update(k for k in entry.target_keys if k in ctx.runtime)


# --------------------------------------------------------------------------- the passes


def decode(ctx: Planning, c: Candidate) -> None:
    """Which sources a quantizer decodes (their companions join the bytes), and their decoded headers.

    Fails the entry when a source cannot be decoded (a companion is missing, the quantizer refuses
    it) or is stored quantized (FP8 with block scales) and nothing decodes it.
    """
    entry = c.entry
    if ctx.key_errors:
        bad = [ctx.key_errors[k] for k in entry.source_keys if k in ctx.key_errors]
        if bad:
            fail(ctx, c, "dequantize", bad[0])
            return
    hooks = ctx.hooks
    if hooks is not None and ctx.companions_of:
        decoded = {k: ctx.companions_of[k] for k in entry.source_keys if k in ctx.companions_of}
        if decoded:
            c.decoded = decoded
            entry.companions = tuple(x for k in entry.source_keys for x in decoded.get(k, ()))
            entry.nbytes += sum(ctx.reader.info(x).nbytes for x in entry.companions)
            try:
                c.infos = [
                    decoded_info(hooks, i, decoded, ctx.reader, ctx.memo.decoded, ctx.values) for i in c.infos
                ]
            except ConversionError as exc:
                fail(ctx, c, f"{hooks.name}.decode", str(exc))
                return
    stored_quantized = prequantized_sources([i for i in c.infos if i.key not in c.decoded], ctx.reader, hooks)
    if stored_quantized:
        fail(ctx, c, "dequantize", stored_quantized)


def infer_shapes(ctx: Planning, c: Candidate) -> None:
    """The runtime keys, shapes and dtypes the entry produces, from headers alone.

    A plain tensor produces its one (possibly renamed) target as stored. A converter's chain runs
    on ``meta`` tensors (:func:`~surgery.load.shapes.infer_outputs`); a chain that cannot run on
    these sources (a missing expert, an op that refuses the shapes) fails the entry.
    """
    entry = c.entry
    if c.converter is None:
        c.out_shapes = [tuple(c.infos[0].shape)]
        c.out_dtypes = [c.infos[0].dtype]
        return
    converter = ctx.transforms[c.converter]
    if not isinstance(converter, WeightConverter):
        raise ConfigurationError(f"routing filed a key under {converter!r}, which is not a converter.")
    entry.transform = ctx.transform_names[c.converter]
    entry.operations = tuple(repr(op) for op in converter.operations)
    config = ctx.config_for(entry.target_keys[0])
    slot_shapes = source_slot_shapes(converter, entry.source_keys, c.pattern_of, {i.key: i for i in c.infos})
    c.chain = Chain(converter, c.group_key, config, slot_shapes)
    try:
        outputs = infer_outputs(
            converter, c.group_key, c.infos, c.pattern_of, ctx.runtime, config, ctx.memo.shapes
        )
    except SurgeryError as exc:
        fail(ctx, c, repr(converter), str(exc))
        return
    entry.target_keys = tuple(outputs)
    c.out_shapes = [tuple(t.shape) for t in outputs.values()]
    c.out_dtypes = [t.dtype for t in outputs.values()]


def check_targets(ctx: Planning, c: Candidate) -> None:
    """Check the outputs against the model: every target exists and has the checkpoint's shape.

    A target the model lacks makes the entry ``unexpected`` (its sources are reported); a shape
    that differs makes it a ``mismatch``. Either way its targets count as covered (reported, not
    missing), and the entry joins the ones conflicts are settled among. Also picks the device.
    """
    entry = c.entry
    out_keys = entry.target_keys
    unknown = [k for k in out_keys if k not in ctx.runtime]
    if unknown:
        entry.status, entry.mode = Status.UNEXPECTED, Mode.SKIP
        entry.message = f"{', '.join(unknown[:3])} not in the model"
        ctx.plan.unexpected_keys.extend(entry.source_keys)
        return
    params = [ctx.runtime[k] for k in out_keys]
    entry.target_shapes = tuple(tuple(p.shape) for p in params)
    device = ctx.device or ctx.device_of(params[0])
    c.device = torch.device("cpu") if device.type == "meta" else device
    entry.device = str(c.device)
    ctx.targeted.append(c)
    ctx.covered.update(out_keys)
    bad_shape = [(k, s, m) for k, s, m in zip(out_keys, c.out_shapes, entry.target_shapes) if s != m]
    if bad_shape:
        entry.status, entry.mode = Status.MISMATCH, Mode.SKIP
        entry.message = "; ".join(f"{k}: checkpoint {s} vs model {m}" for k, s, m in bad_shape)
        for k, s, m in bad_shape:
            ctx.mismatches.append(Mismatch(k, "shape", str(s), str(m), entry.source_keys, loaded=False))


def plan_quantization(ctx: Planning, c: Candidate) -> None:
    """Per target an on-the-fly quantizer takes, the runtime keys it makes (checked on ``meta``)."""
    hooks = ctx.hooks
    if hooks is None or not hooks.quantizes_on_the_fly:
        return
    entry = c.entry
    try:
        c.produced = plan_quantize(
            hooks,
            ctx.model,
            entry.target_keys,
            c.out_shapes,
            c.out_dtypes,
            ctx.runtime,
            ctx.memo.quantized,
        )
    except ConversionError as exc:  # a ConfigurationError (a broken quantizer) fails the load
        fail(ctx, c, f"{hooks.name}.quantize", str(exc))
        return
    entry.quantized = tuple(k for ks in c.produced.values() for k in ks)
    ctx.covered.update(entry.quantized)


def check_quantized(ctx: Planning, c: Candidate) -> None:
    """Refuse a cast across a quantization boundary; read and check what the quantizer names.

    Floats cast into a quantized module's integers, or int8 codes stored with their scales cast
    into floats, would load garbage: the entry fails, naming the quantizer it needs.
    """
    entry = c.entry
    if not c.decoded:
        for k, d in zip(entry.target_keys, c.out_dtypes):
            if k in c.produced:
                continue
            problem = quantized_cast_problem(ctx.model, ctx.reader, k, entry.source_keys[0], d, ctx.runtime)
            if problem:
                fail(ctx, c, "dequantize", problem)
                return


def choose_dtypes(ctx: Planning, c: Candidate) -> None:
    """The dtype of every runtime key the entry sets; a cast nobody asked for is reported.

    ``dtype="checkpoint"`` keeps the chain's dtype, a torch dtype casts floats to it, and by
    default each parameter keeps its own; a quantizer's keys keep the model's. A cast to a dtype
    nobody asked for (the model's own) is a ``dtype`` mismatch, loaded, and undone on save.
    """
    entry, runtime, want = c.entry, ctx.runtime, ctx.dtype
    dtypes = [
        runtime[k].dtype if k in c.produced else _dest_dtype(runtime[k], d, want)
        for k, d in zip(entry.target_keys, c.out_dtypes)
    ]
    entry.target_dtype = dtype_name(dtypes[0])
    c.cast = any(d != od for d, od in zip(dtypes, c.out_dtypes))
    for k, od, d in zip(entry.target_keys, c.out_dtypes, dtypes):
        ctx.target_dtype[k] = d
        for produced in c.produced.get(k, ()):
            ctx.target_dtype[produced] = runtime[produced].dtype
        if od != d and d != want and not c.decoded and k not in c.produced:
            ctx.mismatches.append(
                Mismatch(
                    k,
                    "dtype",
                    dtype_name(od),
                    dtype_name(d),
                    entry.source_keys,
                    loaded=True,
                    lossy=lossy_cast(od, d),
                )
            )


def choose_mode(ctx: Planning, c: Candidate) -> None:
    """``mmap``, ``direct`` or ``convert`` (see :mod:`surgery.load.planner`).

    Decoding and quantizing compute new tensors, so they always ``convert``; so does a cast, a
    target off the CPU, or a destination that is not contiguous. A plain tensor into a ``meta``
    model is memory-mapped (``direct`` with ``mmap=False``); a converter goes ``direct`` when the
    inverse chain cuts its one destination into contiguous views, one per source.
    """
    entry = c.entry
    if c.decoded or c.produced:
        entry.mode = Mode.CONVERT
        return
    params = [ctx.runtime[k] for k in entry.target_keys]
    on_meta = all(ctx.device_of(p).type == "meta" for p in params)
    usable = on_meta or all(p.is_contiguous() for p in params)
    if c.cast or c.device.type != "cpu" or not usable:
        entry.mode = Mode.CONVERT
    elif c.chain is None:
        entry.mode = Mode.MMAP if on_meta and ctx.mmap else Mode.DIRECT
    elif len(params) != 1 or c.chain.slot_shapes is None:
        entry.mode = Mode.CONVERT
    else:
        fits = _views_fit(ctx, c.chain, c.chain.slot_shapes, params[0])
        entry.mode = Mode.DIRECT if fits else Mode.CONVERT


def shard(ctx: Planning, c: Candidate) -> None:
    """Under tensor parallelism: this rank's regions, the bytes it reads, and the mode of a sharded target.

    The tracing is :func:`~surgery.load.sharding.shard_work`'s; a sharded target is read
    ``direct`` only on CPU, uncast, and when this rank's part is a run of whole rows (a plain
    tensor) or the local chain cuts the local destination into contiguous views.
    """
    tp = ctx.tp
    if tp is None:
        return
    entry, chain = c.entry, c.chain
    sh, nbytes = shard_work(
        converter=None if chain is None else chain.converter,
        group_key=c.group_key,
        out_keys=entry.target_keys,
        runtime=ctx.runtime,
        placements_of=ctx.placements,
        tp=tp,
        source_keys=entry.source_keys,
        infos={k: ctx.reader.info(k) for k in entry.source_keys},  # as stored: a rank's bytes count from them
        pattern_of=c.pattern_of,
        slot_shapes=None if chain is None else chain.slot_shapes,
        ctx=None if chain is None else op_context(chain.converter, c.group_key, ctx.runtime, chain.config),
    )
    c.sharding = sh
    entry.nbytes = nbytes
    entry.tp = sh.slices
    if ctx.hooks is not None and c.decoded:  # the companions this rank reads with its sources
        hook = "stored_region"
        try:
            if sh.sharded and ctx.hooks.reshapes:
                entry.nbytes = _stored_bytes(ctx, sh.sources, nbytes, c.decoded)
            hook = "companion_region"
            entry.nbytes += sum(
                companion_bytes(ctx.hooks, ctx.reader, k, names, sh.sources.get(k))
                for k, names in c.decoded.items()
                if sh.sources.get(k) is not NOT_NEEDED
            )
        except ConfigurationError as exc:
            fail(ctx, c, f"{ctx.hooks.name}.{hook}", str(exc))
            return
    if not sh.sharded:
        return
    in_place = c.device.type == "cpu" and not (c.cast or c.decoded or c.produced)
    if chain is None:
        region = sh.regions[0]
        whole_rows = isinstance(region, Box) or (region is not None and region.dim == 0)
        entry.mode = Mode.DIRECT if in_place and whole_rows else Mode.CONVERT
        return
    param = ctx.runtime[entry.target_keys[0]]
    local = local_shape(tuple(param.shape), sh.regions[0])
    local_ctx = OpContext(n_targets=1, target_shapes=(local,))
    direct = (
        in_place
        and len(entry.target_keys) == 1
        and direct_possible(chain.converter, sh, local, param.dtype, local_ctx)
    )
    entry.mode = Mode.DIRECT if direct else Mode.CONVERT


def _stored_bytes(ctx: Planning, sources: dict[str, Any], nbytes: int, decoded: dict[str, Any]) -> int:
    """``nbytes`` with each decoded source's share counted as stored (packed values: fewer bytes).

    Raises:
        ConfigurationError: the quantizer cannot read a source's region without the rest
            (a split not aligned to its packing or groups).
    """
    assert ctx.hooks is not None
    for key, region in sources.items():
        if key not in decoded or not isinstance(region, Region):
            continue
        info = ctx.reader.info(key)
        stored = ctx.hooks.stored_region(key, region, info)
        itemsize = info.dtype.itemsize
        nbytes += itemsize * (
            math.prod(local_shape(tuple(info.shape), stored))
            - math.prod(local_shape(tuple(info.shape), region))
        )
    return nbytes


def check_values(ctx: Planning, c: Candidate) -> None:
    """Read and check the small stored tensors a quantizer checks (scales: NaN, zero, negative).

    Under tensor parallelism a companion is read (and checked) only where it covers this rank's
    region of its weight (the quantizer's ``companion_region``): each rank checks what it uses.
    """
    hooks = ctx.hooks
    if hooks is None or not hooks.has("check"):
        return
    sh = c.sharding
    parts = sh is not None and sh.sharded and (sh.fallback is None or sh.operations is not None)
    regions = sh.sources if sh is not None and parts else {}
    problem = check_stored(
        hooks, ctx.reader, c.entry.source_keys, c.decoded, ctx.checked, regions, ctx.partial, ctx.values
    )
    if problem:
        fail(ctx, c, f"{hooks.name}.check", problem)


PASSES: tuple[Callable[[Planning, Candidate], None], ...] = (
    decode,
    infer_shapes,
    check_targets,
    plan_quantization,
    check_quantized,
    choose_dtypes,
    choose_mode,
    shard,
    check_values,
)
"""The passes in the order :func:`~surgery.load.planner.prepare` runs them on every candidate."""


# --------------------------------------------------------------------------- helpers


def _dest_dtype(param: torch.Tensor, stored: torch.dtype, want: torch.dtype | str | None) -> torch.dtype:
    if want == "checkpoint":
        return stored
    if isinstance(want, torch.dtype) and param.is_floating_point() and stored.is_floating_point:
        return want
    return param.dtype


def _views_fit(ctx: Planning, chain: Chain, slot_shapes: list[Any], param: torch.Tensor) -> bool:
    """Whether the inverse chain cuts ``param`` into contiguous views, one per source.

    Remembered per converter of built-in ops, destination shape and dtype, and source shapes:
    the 32 layers of a model decide once.
    """
    op_ctx = op_context(chain.converter, chain.group_key, ctx.runtime, chain.config)
    cache = ctx.memo.views
    key = None
    if all(type(op) in BUILTIN_OPS for op in chain.converter.operations):
        try:
            key = (
                id(chain.converter),
                tuple(param.shape),
                param.dtype,
                tuple(tuple(s) if isinstance(s, list) else s for s in slot_shapes),
                op_ctx.n_targets,
                op_ctx.target_shapes,
                id(op_ctx.config),
            )
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in cache:
            return cache[key]
    dest = torch.empty(param.shape, dtype=param.dtype, device="meta")
    views = placement_views(chain.converter, dest, slot_shapes, op_ctx)
    fits = views is not None and all_contiguous(views)
    if key is not None:
        cache[key] = fits
    return fits
