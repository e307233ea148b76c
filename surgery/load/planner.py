"""Planning a load: from checkpoint headers to the exact list of work the loader executes.

:func:`prepare` resolves the model's transforms (and fusions), routes every checkpoint key once,
infers every converter's output shapes (arithmetic shape rules for built-in chains, a ``meta`` run
otherwise), settles conflicts, checks everything against the model, and chooses per target how
it is filled:

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
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import CheckpointReader, StoredTensor
from ..converter import WeightConverter
from ..errors import ConfigurationError, ConversionError, SurgeryError
from ..fusion import (
    apply_fusions,
    check_fusion_conflicts,
    fusion_config_of,
    fusion_transforms,
)
from ..model_state import (
    config_lookup,
    dtype_name,
    lossy_cast,
    runtime_tensors,
    tied_groups,
)
from ..ops import OpContext
from ..parallel.regions import local_shape
from ..persist import persisted_fusion_config, trusted_fusion_config
from ..placement import all_contiguous, placement_views, source_slot_shapes
from ..quantization import QuantizerHooks, quantizer_from_metadata
from ..record import Origin
from ..resolution import get_model_conversion_mapping
from ..routing import Routing, route_keys
from ..transforms import WeightTransform, legacy_renamings
from .inference import BUILTIN_OPS, infer_outputs, op_context
from .plan import LoadPlan, PlanEntry
from .quantized import (
    broken_units,
    check_stored,
    claim_companions,
    decoded_info,
    plan_quantize,
    prequantized_sources,
    quantized_cast_problem,
)
from .report import ConversionFailure, Mismatch
from .sharding import (
    Sharding,
    TensorParallel,
    apply_tp_plan,
    direct_possible,
    shard_work,
    target_placements,
)

__all__ = ["Prepared", "Work", "ordered_sources", "prepare"]


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


@dataclass
class Work:
    """An executable plan entry."""

    entry: PlanEntry
    converter: WeightConverter | None
    group_key: str
    pattern_of: dict[str, tuple[int, tuple[int, ...]]]
    dest_keys: tuple[str, ...]  # runtime keys to set (same order as entry.target_keys)
    device: torch.device
    config: Any = None
    slot_shapes: list[Any] | None = None  # per source pattern, for direct placement
    index: int = 0  # position in the plan
    sharding: Sharding | None = None  # under tensor parallelism: what this rank reads
    companions: dict[str, tuple[str, ...]] = dataclasses.field(
        default_factory=dict
    )  # source -> keys to decode it
    quantized: dict[str, tuple[str, ...]] = dataclasses.field(
        default_factory=dict
    )  # target -> keys quantize makes


@dataclass
class Prepared:
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
    tp: TensorParallel | None = None
    placements: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    quantizer: QuantizerHooks | None = None
    companion_values: dict[str, dict[str, torch.Tensor]] = dataclasses.field(default_factory=dict)
    checked: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # companions read by planning
    # what ops dropped (padding rows), by the group's smallest runtime key: the load record keeps it
    residues: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    origins: list[Origin] = dataclasses.field(default_factory=list)  # aligned with transforms


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

    ``stand_in``: plan as if tensors on ``meta`` lived on this device (the dry run of a fused
    model works on a meta copy of a model that really lives there). ``tp``: plan this rank's
    part of a tensor-parallel load (the plan is applied right after fusions). ``mmap=False``:
    never memory-map, read into owned memory instead. ``quantizer``: see
    :mod:`surgery.quantization` (``None``: the one a runtime-layout save persisted, if any).
    """
    want_dtype = _normalize_dtype(dtype)
    dev = _normalize_device(device)
    if quantizer is None:
        quantizer = quantizer_from_metadata(reader.metadata, source=str(path))
    hooks = QuantizerHooks(quantizer) if quantizer is not None else None
    notes: list[str] = []
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
    config_for = config_lookup(model)
    plan = LoadPlan(str(path), fusions=fusions, notes=notes)
    if tp is not None:
        plan.tp_world_size, plan.tp_rank = tp.world_size, tp.rank
    plan.transforms = transform_repr = [repr(t) for t in transforms]
    mismatches: list[Mismatch] = []
    failures: list[tuple[int, ConversionFailure]] = []
    conflicts = [
        ConversionFailure(
            "routing",
            (c.first, c.second),
            (c.target_key,),
            f"checkpoint keys {c.first!r} and {c.second!r} both land on {c.target_key!r}; neither is "
            "loaded. Remove one of them from the checkpoint, or fix the mapping that renames them together.",
        )
        for c in routing.conflicts
    ]
    conflicted_groups = {c.target_key for c in routing.conflicts}
    target_dtype: dict[str, torch.dtype] = {}
    covered: set[str] = set()
    infer_cache: dict[Any, list[Any]] = {}
    mode_cache: dict[Any, bool] = {}
    decode_cache: dict[Any, torch.dtype] = {}
    checked: dict[str, torch.Tensor] = {}
    quantize_cache: dict[Any, dict[str, torch.Tensor]] = {}

    def where(t: torch.Tensor) -> torch.device:
        return stand_in if stand_in is not None and t.device.type == "meta" else t.device

    def dest_dtype(key: str, ckpt_dtype: torch.dtype) -> torch.dtype:
        param = runtime[key]
        if want_dtype == "checkpoint":
            return ckpt_dtype
        if isinstance(want_dtype, torch.dtype) and param.is_floating_point() and ckpt_dtype.is_floating_point:
            return want_dtype
        return param.dtype

    def fail(entry: PlanEntry, index: int, transform: str, message: str) -> None:
        """Skip an entry that cannot be converted; its targets are reported, not missing."""
        entry.status, entry.mode, entry.message = "error", "skip", message
        failures.append((index, ConversionFailure(transform, entry.source_keys, entry.target_keys, message)))
        covered.update(k for k in entry.target_keys if k in runtime)

    candidates: list[Work] = []
    for group in routing.groups.values():
        src_keys = tuple(group.source_keys)
        infos = [reader.info(k) for k in src_keys]
        routes = [routing.routes[k] for k in src_keys]
        fired = dict.fromkeys(i for r in routes for i in r.renamings)
        renamings = tuple(dict.fromkeys(transform_repr[i] for i in fired))
        entry = PlanEntry(
            target_keys=group.target_keys,
            source_keys=src_keys,
            renamings=renamings,
            nbytes=sum(i.nbytes for i in infos),
            source_shapes=tuple(tuple(i.shape) for i in infos),
            source_dtypes=tuple(dtype_name(i.dtype) for i in infos),
        )
        index = len(plan.entries)
        plan.entries.append(entry)
        bad_keys = [key_errors[k] for k in src_keys if k in key_errors]
        if bad_keys:
            fail(entry, index, "dequantize", bad_keys[0])
            continue
        decoded = {k: companions_of[k] for k in src_keys if k in companions_of}
        stored = {i.key: i for i in infos}  # as on disk (what a rank's bytes are counted from)
        if decoded:
            assert hooks is not None
            entry.companions = tuple(c for k in src_keys for c in decoded.get(k, ()))
            entry.nbytes += sum(reader.info(c).nbytes for c in entry.companions)
            try:
                infos = [decoded_info(hooks, i, decoded, reader, decode_cache) for i in infos]
            except ConversionError as exc:
                fail(entry, index, f"{hooks.name}.decode", str(exc))
                continue
        quantized = prequantized_sources([i for i in infos if i.key not in decoded], reader, hooks)
        if quantized:
            fail(entry, index, "dequantize", quantized)
            continue
        converter = _converter_at(transforms, group.converter)
        pattern_of = {k: (r.pattern_index or 0, r.index) for k, r in zip(src_keys, routes)}
        config = None
        slot_shapes = None
        if converter is not None:
            entry.transform = transform_repr[group.converter]  # type: ignore[index]
            entry.operations = tuple(repr(op) for op in converter.operations)
            config = config_for(group.target_keys[0])
            slot_shapes = source_slot_shapes(converter, src_keys, pattern_of, {i.key: i for i in infos})
            try:
                outputs = infer_outputs(converter, group.key, infos, pattern_of, runtime, config, infer_cache)
            except SurgeryError as exc:
                fail(entry, index, repr(converter), str(exc))
                continue
            out_keys = tuple(outputs)
            out_shapes = [tuple(outputs[k].shape) for k in out_keys]
            out_dtypes = [outputs[k].dtype for k in out_keys]
        else:
            out_keys = group.target_keys
            out_shapes = [tuple(infos[0].shape)]
            out_dtypes = [infos[0].dtype]
        entry.target_keys = out_keys
        unknown = [k for k in out_keys if k not in runtime]
        if unknown:
            entry.status, entry.mode = "unexpected", "skip"
            entry.message = f"{', '.join(unknown[:3])} not in the model"
            plan.unexpected_keys.extend(src_keys)
            continue
        params = [runtime[k] for k in out_keys]
        entry.target_shapes = tuple(tuple(p.shape) for p in params)
        target_device = dev or where(params[0])
        if target_device.type == "meta":
            target_device = torch.device("cpu")
        entry.device = str(target_device)
        work = Work(
            entry, converter, group.key, pattern_of, out_keys, target_device, config, slot_shapes, index
        )
        candidates.append(work)
        covered.update(out_keys)
        bad_shape = [
            (k, s, tuple(p.shape)) for k, s, p in zip(out_keys, out_shapes, params) if s != tuple(p.shape)
        ]
        if bad_shape:
            entry.status, entry.mode = "mismatch", "skip"
            entry.message = "; ".join(f"{k}: checkpoint {s} vs model {m}" for k, s, m in bad_shape)
            for k, s, m in bad_shape:
                mismatches.append(Mismatch(k, "shape", str(s), str(m), src_keys, loaded=False))
            continue
        if hooks is not None and hooks.quantizes_on_the_fly:
            try:
                work.quantized = plan_quantize(
                    hooks, model, out_keys, out_shapes, out_dtypes, runtime, quantize_cache
                )
            except ConversionError as exc:  # a ConfigurationError (a broken quantizer) fails the load
                fail(entry, index, f"{hooks.name}.quantize", str(exc))
                continue
            entry.quantized = tuple(k for ks in work.quantized.values() for k in ks)
            covered.update(entry.quantized)
        work.companions = decoded
        problem = next(
            (
                p
                for k, d in zip(out_keys, out_dtypes)
                if k not in work.quantized and not decoded
                if (p := quantized_cast_problem(model, reader, k, src_keys[0], d, runtime))
            ),
            "",
        )
        if problem:
            fail(entry, index, "dequantize", problem)
            continue
        if hooks is not None and hooks.has("check"):
            problem = check_stored(hooks, reader, src_keys, decoded, checked)
            if problem:
                fail(entry, index, f"{hooks.name}.check", problem)
                continue
        dts = [
            runtime[k].dtype if k in work.quantized else dest_dtype(k, d)
            for k, d in zip(out_keys, out_dtypes)
        ]
        entry.target_dtype = dtype_name(dts[0])
        cast = any(d != od for d, od in zip(dts, out_dtypes))
        for k, od, d in zip(out_keys, out_dtypes, dts):
            target_dtype[k] = d
            for produced in work.quantized.get(k, ()):
                target_dtype[produced] = runtime[produced].dtype
            if od != d and d != want_dtype and not decoded and k not in work.quantized:
                # a cast nobody asked for: report it (saving undoes it)
                mismatches.append(
                    Mismatch(
                        k,
                        "dtype",
                        dtype_name(od),
                        dtype_name(d),
                        src_keys,
                        loaded=True,
                        lossy=lossy_cast(od, d),
                    )
                )
        entry.mode = _choose_mode(work, [where(p) for p in params], params, cast, runtime, mode_cache)
        if entry.mode == "mmap" and not mmap:
            entry.mode = "direct"
        if tp is not None:
            _plan_shard(work, tp, runtime, placements_of, stored, cast)
        if decoded or work.quantized:
            entry.mode = "convert"  # decoding and quantizing compute new tensors: never in place

    work_list = _settle_conflicts(candidates, conflicted_groups, tied, conflicts)
    if hooks is not None:
        broken = broken_units(model, {k for w in work_list for k in (*w.dest_keys, *w.entry.quantized)})
        if broken:
            for w in work_list:
                why = next((broken[k] for k in w.dest_keys if k in broken), None)
                if why is not None:
                    fail(w.entry, w.index, "quantized module", why)
            work_list = [w for w in work_list if w.entry.status == "ok"]
    for k in list(covered):
        covered.update(tied.get(k, ()))
    plan.missing_keys = [k for k in runtime if k not in covered]
    if (plan.missing_keys or plan.unexpected_keys) and all(o is Origin.LEGACY for o in origins):
        notes.append(
            f"no conversion mapping applied to {type(model).__name__}: no registered class name or model_type "
            "matched it (surgery.explain_model_conversion_mapping(model) shows the lookup), so checkpoint keys "
            "were matched by name only; register a mapping if the checkpoint has another layout."
        )
    return Prepared(
        plan,
        work_list,
        routing,
        transforms,
        reader,
        runtime,
        tied,
        mismatches,
        failures,
        conflicts,
        target_dtype,
        tp,
        placements_of,
        hooks,
        checked=checked,
        origins=origins,
    )


def _plan_shard(
    w: Work,
    tp: TensorParallel,
    runtime: dict[str, torch.Tensor],
    placements_of: dict[str, tuple[Any, ...]],
    infos: dict[str, StoredTensor],
    cast: bool,
) -> None:
    """Fill ``w``'s sharding, ``entry.tp`` and this rank's bytes; pick the mode for a sharded target."""
    entry = w.entry
    ctx = op_context(w.converter, w.group_key, runtime, w.config) if w.converter is not None else None
    sh, nbytes = shard_work(
        converter=w.converter,
        group_key=w.group_key,
        out_keys=w.dest_keys,
        runtime=runtime,
        placements_of=placements_of,
        tp=tp,
        source_keys=entry.source_keys,
        infos=infos,
        pattern_of=w.pattern_of,
        slot_shapes=w.slot_shapes,
        ctx=ctx,
    )
    w.sharding = sh
    entry.nbytes = nbytes
    entry.tp = sh.slices
    if not sh.sharded:
        return
    on_cpu = w.device.type == "cpu"
    if w.converter is None:
        region = sh.regions[0]
        entry.mode = "direct" if on_cpu and not cast and region is not None and region.dim == 0 else "convert"
        return
    param = runtime[w.dest_keys[0]]
    local = local_shape(tuple(param.shape), sh.regions[0])
    assert ctx is not None
    direct = (
        on_cpu
        and not cast
        and len(w.dest_keys) == 1
        and direct_possible(
            w.converter, sh, local, param.dtype, OpContext(n_targets=1, target_shapes=(local,))
        )
    )
    entry.mode = "direct" if direct else "convert"


def _settle_conflicts(
    candidates: list[Work],
    conflicted_groups: set[str],
    tied: dict[str, list[str]],
    conflicts: list[ConversionFailure],
) -> list[Work]:
    """Drop every entry that shares a target with another one; return what is left to execute.

    Two routes to one parameter (two checkpoint keys renamed alike, or two names of one tied
    parameter) are a conflict: neither is loaded, and the report names both.
    """
    producers: dict[str, list[Work]] = {}
    for w in candidates:
        made = [k for k in w.entry.quantized if k not in w.dest_keys]  # a scale quantize makes vs one stored
        for k in (*w.dest_keys, *made):
            producers.setdefault(tied.get(k, [k])[0], []).append(w)
    bad: set[int] = set()
    for w in candidates:
        if w.group_key in conflicted_groups:
            bad.add(id(w))
    for key, ws in producers.items():
        if len(ws) < 2:
            continue
        bad.update(id(w) for w in ws)
        sources = tuple(k for w in ws for k in w.entry.source_keys)
        names = sorted({k for w in ws for k in w.dest_keys if tied.get(k, [k])[0] == key})
        conflicts.append(
            ConversionFailure(
                "routing",
                sources,
                tuple(names),
                f"{len(ws)} checkpoint entries ({', '.join(w.entry.source_keys[0] for w in ws)}) land on "
                f"{' = '.join(names)}; neither is loaded. Keep one of them in the checkpoint.",
            )
        )
    out: list[Work] = []
    for w in candidates:
        if id(w) in bad:
            w.entry.status, w.entry.mode = "conflict", "skip"
            w.entry.message = "another checkpoint entry lands on the same parameter"
        elif w.entry.status == "ok":
            out.append(w)
    return out


def _converter_at(transforms: list[WeightTransform], index: int | None) -> WeightConverter | None:
    if index is None:
        return None
    t = transforms[index]
    if not isinstance(t, WeightConverter):
        raise ConfigurationError(f"routing filed a key under {t!r}, which is not a converter.")
    return t


def _choose_mode(
    w: Work,
    devices: list[torch.device],
    params: list[torch.Tensor],
    cast: bool,
    runtime: dict[str, torch.Tensor],
    cache: dict[Any, bool] | None = None,
) -> str:
    """``mmap``, ``direct`` or ``convert`` (see the module docstring).

    ``cache`` (one per planning pass) remembers, per converter of built-in ops, destination shape
    and source shapes, whether the placement views work out: the 32 layers of a model decide once.
    """
    on_meta = all(d.type == "meta" for d in devices)
    on_cpu = w.device.type == "cpu"
    usable = on_meta or all(p.is_contiguous() for p in params)
    if cast or not on_cpu or not usable:
        return "convert"
    if w.converter is None:
        return "mmap" if on_meta else "direct"
    if len(params) != 1 or w.slot_shapes is None:
        return "convert"
    ctx = op_context(w.converter, w.group_key, runtime, w.config)
    key = None
    if cache is not None and all(type(op) in BUILTIN_OPS for op in w.converter.operations):
        try:
            key = (
                id(w.converter),
                tuple(params[0].shape),
                params[0].dtype,
                tuple(tuple(s) if isinstance(s, list) else s for s in w.slot_shapes),
                ctx.n_targets,
                ctx.target_shapes,
                id(ctx.config),
            )
            hash(key)
        except TypeError:
            key = None
        if key is not None and key in cache:
            return "direct" if cache[key] else "convert"
    dest = torch.empty(params[0].shape, dtype=params[0].dtype, device="meta")
    views = placement_views(w.converter, dest, w.slot_shapes, ctx)
    direct = views is not None and all_contiguous(views)
    if key is not None and cache is not None:
        cache[key] = direct
    return "direct" if direct else "convert"


# --------------------------------------------------------------------------- direct placement


def ordered_sources(conv: WeightConverter, w: Work) -> list[str]:
    """``w``'s source keys in the order of :func:`~surgery.placement.flatten_slots` of its views."""
    by_pattern: dict[int, dict[tuple[int, ...], str]] = {}
    for src in w.entry.source_keys:
        pat, idx = w.pattern_of[src]
        by_pattern.setdefault(pat, {})[idx] = src
    return [
        by_pattern[i][ix] for i in range(len(conv.source_patterns)) for ix in sorted(by_pattern.get(i, {}))
    ]
