"""Planning a load: from checkpoint headers to the exact list of work the loader executes.

:func:`prepare` is three steps, the shape of DCP's planner and of fx passes:
:func:`plan_context` makes the model ready (fusions, a quantizer's module swaps, the tp plan),
resolves its transforms and routes every checkpoint key once; the named passes of
:mod:`surgery.load.passes` then decide each entry (decode, infer shapes, check targets, plan
quantization, check quantized values, choose dtypes, choose mode, shard); a finish step settles
what only the whole plan shows (conflicts, quantized modules loaded in part, missing keys, notes).
Per target the plan chooses how it is filled (a :class:`~surgery.load.plan.Mode`):

* ``mmap``: a runtime-layout tensor of matching dtype going into a ``meta`` model on CPU is
  memory-mapped from the file and assigned without a copy;
* ``direct``: bytes are read straight into the destination; for a converter the destination is
  cut into views by the *inverse* op chain (``MergeModulelist`` + ``Concatenate`` become
  contiguous slices of the fused parameter), so every expert is read once into its place;
* ``convert``: read, run the op chain, cast, set;
* ``skip``: unexpected, mismatched in shape, conflicting or failing (all reported).

The result is a :class:`~surgery.load.plan.LoadPlan` plus the executable work list that
:func:`surgery.load_checkpoint` runs. Nothing here reads tensor data, except the small tensors a
quantizer checks the values of (FP8 block scales, int8 scales; :func:`~surgery.load.quantized.check_stored`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointReader
from ..errors import ConfigurationError
from ..fusion import (
    apply_fusions,
    check_fusion_conflicts,
    fusion_config_of,
    fusion_transforms,
)
from ..model_state import config_lookup, dtype_name, runtime_tensors, tied_groups
from ..persist import persisted_fusion_config, trusted_fusion_config
from ..quantization import QuantizerHooks, quantizer_from_metadata
from ..record import Origin
from ..resolution import get_model_conversion_mapping
from ..routing import Routing, TargetGroup, route_keys
from ..transforms import WeightTransform, legacy_renamings
from .passes import PASSES, Candidate, Chain, Planning, fail
from .plan import LoadPlan, Mode, PlanEntry, Status
from .quantized import broken_units, claim_companions
from .report import ConversionFailure, Mismatch
from .sharding import Sharding, TensorParallel, apply_tp_plan, target_placements
from .staging import Staging

__all__ = [
    "Prepared",
    "Quantizing",
    "Work",
    "candidates",
    "plan_context",
    "prepare",
]


# --------------------------------------------------------------------------- model helpers


def _resolve_transforms(
    model: nn.Module, hooks: QuantizerHooks | None = None
) -> tuple[list[WeightTransform], list[Origin]]:
    """The transforms a load routes through, and the origin of each (what the load record keeps)."""
    quantizer = None if hooks is None else hooks.quantizer
    transforms = list(get_model_conversion_mapping(model, quantizer=quantizer))
    legacy = legacy_renamings()
    origins = [Origin.LEGACY if t in legacy else Origin.MAPPING for t in transforms]
    if hooks is not None:
        added = hooks.weight_conversions()
        transforms.extend(added)
        origins.extend(Origin.LEGACY if t in legacy else Origin.QUANTIZER for t in added)
    check_fusion_conflicts(model, transforms)  # before any byte is read, naming the fusion and the key
    fused = fusion_transforms(model)  # saving reverses fusions whether or not they fired
    transforms.extend(fused)
    origins.extend(Origin.FUSION for _ in fused)
    return transforms, origins


def _apply_fusions(
    model: nn.Module,
    fusion_config: dict[str, Any] | None,
    reader: CheckpointReader,
    *,
    notes: list[str],
    parallel: bool = False,
) -> dict | None:
    """Apply the requested (or persisted) fusions; return the config in force.

    ``parallel``: the model is already parallelized, and fusions cannot rewrite DTensor modules. A
    config persisted with the checkpoint is applied only in the exact-path form a save writes
    (:func:`~surgery.persist.trusted_fusion_config`); otherwise ``notes`` says why it was not.
    """
    current = fusion_config_of(model)
    if fusion_config is not None:
        wanted: dict[str, Any] | None = fusion_config
    elif current:
        return current
    else:
        persisted = persisted_fusion_config(reader)
        if persisted is None:
            return current
        wanted, why = trusted_fusion_config(model, persisted)
        if wanted is None:
            notes.append(
                f"the fusion config persisted with the checkpoint was not applied: {why}. Pass fusion_config= "
                "to choose the fusions yourself."
            )
            return current
    assert wanted is not None
    if current is not None and (current == wanted or not any(v is not False for v in wanted.values())):
        return current
    if parallel and any(v is not False for v in wanted.values()):
        raise ConfigurationError(
            f"fusions {wanted} would rewrite a model whose parameters are already DTensors; apply the fusions "
            "first (surgery.apply_fusions), then parallelize, or load with tp_plan= and let surgery do both."
        )
    apply_fusions(model, wanted)
    return fusion_config_of(model)


# --------------------------------------------------------------------------- planning


@dataclass(frozen=True)
class Quantizing:
    """What a quantizer does to one entry of the work list (an entry it leaves alone has none).

    Attributes:
        hooks: the quantizer.
        companions: per source key it decodes, the companion keys it decodes with.
        produced: per target it quantizes after the chain, the runtime keys it makes.
    """

    hooks: QuantizerHooks
    companions: dict[str, tuple[str, ...]]
    produced: dict[str, tuple[str, ...]]


@dataclass(frozen=True)
class Work:
    """An executable plan entry: what :func:`~surgery.load.execute.execute` reads, runs and sets.

    Attributes:
        index: the entry's position in the plan.
        entry: the plan entry (its ``mode`` says how it runs).
        dest_keys: the runtime keys to set, in the order of ``entry.target_keys``.
        device: where the tensors go.
        pattern_of: per source key, ``(source pattern index, wildcard index)``.
        chain: the converter's chain, or ``None`` for a plain (possibly renamed) tensor.
        sharding: under tensor parallelism, what this rank reads (``None`` otherwise).
        quantizing: what a quantizer decodes or makes, or ``None``.
    """

    index: int
    entry: PlanEntry
    dest_keys: tuple[str, ...]
    device: torch.device
    pattern_of: dict[str, tuple[int, tuple[int, ...]]]
    chain: Chain | None
    sharding: Sharding | None
    quantizing: Quantizing | None


@dataclass
class Prepared:
    """A planned load: the plan, the work list, and what executing it needs.

    ``companion_values`` and ``residues`` are filled while the work list runs (what decoding
    read, and what ops dropped, by the group's smallest runtime key); the load record keeps them.
    """

    plan: LoadPlan
    work: list[Work]
    routing: Routing
    transforms: list[WeightTransform]
    reader: CheckpointReader
    runtime: dict[str, torch.Tensor]
    tied: dict[str, list[str]]
    mismatches: list[Mismatch]
    failures: list[tuple[int, ConversionFailure]]
    conflicts: list[ConversionFailure]
    target_dtype: dict[str, torch.dtype]
    tp: TensorParallel | None
    placements: dict[str, tuple[Any, ...]]
    quantizer: QuantizerHooks | None
    checked: dict[str, torch.Tensor]  # companions read by planning
    partial_companions: set[str]  # companions read only where they cover this rank's region
    companion_values: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    residues: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    origins: list[Origin] = dataclasses.field(default_factory=list)  # aligned with transforms
    staging: Staging | None = None  # the ring reads go through to reach their devices, if any


def _normalize_dtype(dtype: torch.dtype | str | None) -> torch.dtype | str | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "checkpoint":
        return dtype
    if isinstance(dtype, str) and isinstance(getattr(torch, dtype, None), torch.dtype):
        return getattr(torch, dtype)
    raise ConfigurationError(
        f"dtype={dtype!r} is not a torch dtype; pass e.g. torch.bfloat16, 'bfloat16', or 'checkpoint' "
        "to keep each tensor's checkpoint dtype."
    )


def _normalize_device(device: torch.device | str | None) -> torch.device | None:
    if device is None:
        return None
    try:
        return torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ConfigurationError(
            f"device={device!r} is not a torch device ({exc}); pass e.g. 'cpu' or 'cuda:0'."
        ) from None


def prepare(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None,
    dtype: torch.dtype | str | None,
    fusion_config: dict[str, Any] | None,
    reader: CheckpointReader,
    stand_in: torch.device | None = None,
    tp: TensorParallel | None = None,
    mmap: bool = True,
    quantizer: object | None = None,
) -> Prepared:
    """Route every key and decide, from headers alone, how each target will be filled.

    Builds the planning context (:func:`plan_context`: fusions, the quantizer's module swaps, the
    tp plan, transforms, runtime tensors, routing), runs the :data:`~surgery.load.passes.PASSES`
    on every routed group until one settles it, then settles what only the whole plan shows:
    conflicts, quantized modules loaded in part, missing keys, notes.

    ``stand_in``: plan as if tensors on ``meta`` lived on this device (the dry run of a fused
    model works on a meta copy of a model that really lives there). ``tp``: plan this rank's
    part of a tensor-parallel load (the plan is applied right after fusions). ``mmap=False``:
    never memory-map, read into owned memory instead. ``quantizer``: see
    :mod:`surgery.quantization` (``None``: the one a runtime-layout save persisted, if any).
    """
    ctx = plan_context(
        model,
        path,
        reader,
        dtype=dtype,
        device=device,
        fusion_config=fusion_config,
        stand_in=stand_in,
        tp=tp,
        mmap=mmap,
        quantizer=quantizer,
    )
    for c in candidates(ctx):
        for step in PASSES:
            step(ctx, c)
            if not c.ok:
                break  # settled: reported, not loaded
    return _finish(ctx)


def plan_context(
    model: nn.Module,
    path: str | os.PathLike[str],
    reader: CheckpointReader,
    *,
    dtype: torch.dtype | str | None = None,
    device: torch.device | str | None = None,
    fusion_config: dict[str, Any] | None = None,
    stand_in: torch.device | None = None,
    tp: TensorParallel | None = None,
    mmap: bool = True,
    quantizer: object | None = None,
) -> Planning:
    """Everything the passes share: ``model`` made ready (fusions, quantizer, tp plan), and routed.

    This is where a load changes the model before any tensor is read (:func:`_make_ready`). The
    options are :func:`prepare`'s.
    """
    want_dtype = _normalize_dtype(dtype)
    dev = _normalize_device(device)
    notes: list[str] = []
    fusions, hooks = _make_ready(
        model, path, reader, fusion_config=fusion_config, tp=tp, quantizer=quantizer, notes=notes
    )
    transforms, origins = _resolve_transforms(model, hooks)
    runtime = runtime_tensors(model)
    tied = tied_groups(runtime)
    placements_of = target_placements(model, runtime, tp, tied) if tp is not None else {}
    base_prefix = getattr(model, "base_model_prefix", None) or None
    keys = reader.keys()
    companions_of: dict[str, tuple[str, ...]] = {}
    key_errors: dict[str, str] = {}
    if hooks is not None and hooks.decodes:
        keys, companions_of, key_errors = claim_companions(keys, reader, hooks)
    routing = route_keys(keys, transforms, runtime_keys=runtime.keys(), base_model_prefix=base_prefix)
    oversized = routing.oversized_note()
    if oversized is not None:
        notes.append(oversized)
    plan = LoadPlan(str(path), fusions=fusions, notes=notes)
    if tp is not None:
        plan.tp_world_size, plan.tp_rank = tp.world_size, tp.rank
    plan.transforms = transform_repr = [repr(t) for t in transforms]
    return Planning(
        model,
        reader,
        plan,
        transforms,
        transform_repr,
        origins,
        routing,
        runtime,
        tied,
        config_lookup(model),
        dtype=want_dtype,
        device=dev,
        stand_in=stand_in,
        mmap=mmap,
        hooks=hooks,
        companions_of=companions_of,
        key_errors=key_errors,
        tp=tp,
        placements=placements_of,
    )


def _make_ready(
    model: nn.Module,
    path: str | os.PathLike[str],
    reader: CheckpointReader,
    *,
    fusion_config: dict[str, Any] | None,
    tp: TensorParallel | None,
    quantizer: object | None,
    notes: list[str],
) -> tuple[dict | None, QuantizerHooks | None]:
    """Apply the fusions, let the quantizer swap its modules, parallelize: return the fusions and the quantizer."""
    if quantizer is None:
        quantizer = quantizer_from_metadata(reader.metadata, source=str(path))
    hooks = QuantizerHooks(quantizer) if quantizer is not None else None
    fusions = _apply_fusions(
        model, fusion_config, reader, notes=notes, parallel=tp is not None and tp.spec is None
    )
    if hooks is not None:
        if tp is not None and hooks.quantizes_on_the_fly:
            raise ConfigurationError(
                f"{hooks.name} quantizes on the fly, which tensor parallelism does not support: the parallel "
                "styles shard float weights. Load with tp_plan or with the quantizer, not both."
            )
        hooks.prepare(model)
    if tp is not None:
        apply_tp_plan(model, tp)
    return fusions, hooks


def candidates(ctx: Planning) -> Iterator[Candidate]:
    """A new plan entry per routed group, in routing order, each appended to ``ctx.plan`` as it comes."""
    for group in ctx.routing.groups.values():
        yield _candidate(ctx, group)


def _candidate(ctx: Planning, group: TargetGroup) -> Candidate:
    """A new plan entry for one routed group: its sources as the headers describe them."""
    src_keys = tuple(group.source_keys)
    infos = [ctx.reader.info(k) for k in src_keys]
    routes = [ctx.routing.routes[k] for k in src_keys]
    fired = dict.fromkeys(i for r in routes for i in r.renamings)
    renamings = tuple(dict.fromkeys(ctx.transform_names[i] for i in fired))
    entry = PlanEntry(
        target_keys=group.target_keys,
        source_keys=src_keys,
        renamings=renamings,
        nbytes=sum(i.nbytes for i in infos),
        source_shapes=tuple(tuple(i.shape) for i in infos),
        source_dtypes=tuple(dtype_name(i.dtype) for i in infos),
    )
    index = len(ctx.plan.entries)
    ctx.plan.entries.append(entry)
    pattern_of = {k: (r.pattern_index or 0, r.index) for k, r in zip(src_keys, routes)}
    return Candidate(index, entry, group.key, group.converter, infos, pattern_of)


def _finish(ctx: Planning) -> Prepared:
    """What only the whole plan shows: conflicts, broken quantized modules, missing keys, notes."""
    model, runtime, tied, plan, transforms = ctx.model, ctx.runtime, ctx.tied, ctx.plan, ctx.transforms
    conflicts = _routing_conflicts(ctx.routing)
    kept = _settle_conflicts(ctx.targeted, {c.target_key for c in ctx.routing.conflicts}, tied, conflicts)
    if ctx.hooks is not None:
        broken = broken_units(model, {k for c in kept for k in (*c.entry.target_keys, *c.entry.quantized)})
        if broken:
            for c in kept:
                why = next((broken[k] for k in c.entry.target_keys if k in broken), None)
                if why is not None:
                    fail(ctx, c, "quantized module", why)
            kept = [c for c in kept if c.entry.status == Status.OK]
    covered = ctx.covered
    for k in list(covered):
        covered.update(tied.get(k, ()))
    plan.missing_keys = [k for k in runtime if k not in covered]
    if (plan.missing_keys or plan.unexpected_keys) and all(o is Origin.LEGACY for o in ctx.origins):
        plan.notes.append(
            f"no conversion mapping applied to {type(model).__name__}: no registered class name or model_type "
            "matched it (surgery.explain_model_conversion_mapping(model) shows the lookup), so checkpoint keys "
            "were matched by name only; register a mapping if the checkpoint has another layout."
        )
    return Prepared(
        plan,
        [_work(ctx, c) for c in kept],
        ctx.routing,
        transforms,
        ctx.reader,
        runtime,
        tied,
        ctx.mismatches,
        ctx.failures,
        conflicts,
        ctx.target_dtype,
        ctx.tp,
        ctx.placements,
        ctx.hooks,
        ctx.checked,
        ctx.partial,
        origins=ctx.origins,
    )


def _work(ctx: Planning, c: Candidate) -> Work:
    """The executable form of a candidate the passes left ``ok``."""
    quantizing = None
    if ctx.hooks is not None and (c.decoded or c.produced):
        quantizing = Quantizing(ctx.hooks, c.decoded, c.produced)
    dest = c.entry.target_keys
    return Work(c.index, c.entry, dest, c.device, c.pattern_of, c.chain, c.sharding, quantizing)


def _routing_conflicts(routing: Routing) -> list[ConversionFailure]:
    return [
        ConversionFailure(
            "routing",
            (c.first, c.second),
            (c.target_key,),
            f"checkpoint keys {c.first!r} and {c.second!r} both land on {c.target_key!r}; neither is "
            "loaded. Remove one of them from the checkpoint, or fix the mapping that renames them together.",
        )
        for c in routing.conflicts
    ]


def _settle_conflicts(
    candidates: list[Candidate],
    conflicted_groups: set[str],
    tied: dict[str, list[str]],
    conflicts: list[ConversionFailure],
) -> list[Candidate]:
    """Drop every entry that shares a target with another one; return the ``ok`` ones left.

    Two routes to one parameter (two checkpoint keys renamed alike, or two names of one tied
    parameter) are a conflict: neither is loaded, and the report names both.
    """
    producers: dict[str, list[Candidate]] = {}
    for c in candidates:
        targets = c.entry.target_keys
        made = [k for k in c.entry.quantized if k not in targets]  # a scale quantize makes vs one stored
        for k in (*targets, *made):
            producers.setdefault(tied.get(k, [k])[0], []).append(c)
    bad: set[int] = {id(c) for c in candidates if c.group_key in conflicted_groups}
    for key, cs in producers.items():
        if len(cs) < 2:
            continue
        bad.update(id(c) for c in cs)
        sources = tuple(k for c in cs for k in c.entry.source_keys)
        names = sorted({k for c in cs for k in c.entry.target_keys if tied.get(k, [k])[0] == key})
        conflicts.append(
            ConversionFailure(
                "routing",
                sources,
                tuple(names),
                f"{len(cs)} checkpoint entries ({', '.join(c.entry.source_keys[0] for c in cs)}) land on "
                f"{' = '.join(names)}; neither is loaded. Keep one of them in the checkpoint.",
            )
        )
    out: list[Candidate] = []
    for c in candidates:
        if id(c) in bad:
            c.entry.status, c.entry.mode = Status.CONFLICT, Mode.SKIP
            c.entry.message = "another checkpoint entry lands on the same parameter"
        elif c.entry.status == Status.OK:
            out.append(c)
    return out
