"""Loading a checkpoint into a (possibly rewritten) module tree.

The pipeline has two phases. Phase 1 (:func:`plan_load`) reads only headers: it resolves the
model's transforms, routes every checkpoint key once, infers every converter's output shapes by
running its op chain on ``meta`` tensors, and decides for each target how it will be filled:

* ``mmap``: a runtime-layout tensor of matching dtype going into a ``meta`` model on CPU is
  memory-mapped from the file and assigned without a copy;
* ``direct``: bytes are read straight into the destination parameter; for a converter the
  destination is cut into views by the *inverse* op chain (``MergeModulelist`` + ``Concatenate``
  become contiguous slices of the fused parameter), so every expert is read once into its place;
* ``convert``: read, run the op chain, cast, set.

Phase 2 (:func:`load_checkpoint`) executes exactly that plan on a thread pool (4 workers by
default; ``SURGERY_SYNC_LOAD=1`` or ``sync=True`` for sequential loading) with bounded read-ahead,
sets each parameter as soon as its tensors are ready and frees the temporaries at once.
"""

from __future__ import annotations

import contextlib
import copy
import os
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .checkpoint import CheckpointReader, open_checkpoint
from .errors import ConfigurationError, ConversionError, LoadError, SurgeryError
from .ops import Chunk, Concatenate, OpContext, Split, SplitModulelist
from .plan import LoadPlan, PlanEntry
from .report import ConversionFailure, LoadReport, Mismatch
from .routing import Routing, route_keys
from .transforms import PrefixChange, WeightConverter, WeightTransform

__all__ = ["load_checkpoint", "plan_load", "LoadRecord", "load_record", "DEFAULT_WORKERS", "SYNC_ENV"]

DEFAULT_WORKERS = 4
SYNC_ENV = "SURGERY_SYNC_LOAD"
FUSION_METADATA_KEY = "surgery.fusion_config"
_RECORD_ATTR = "_surgery_load_record"
FUSION_TAG = "_surgery_from_fusion"
_READ_AHEAD_BYTES = 512 * 2**20


@dataclass
class LoadRecord:
    """What a load leaves on the model so that saving can invert exactly what happened.

    Attributes:
        transforms: the transforms whose output was loaded, in mapping order.
        source_dtypes: checkpoint dtype of every checkpoint key that was loaded.
        source_shapes: checkpoint shape of every checkpoint key that was loaded.
        loaded_keys: runtime keys that were loaded.
        checkpoint: the path loaded.
    """

    transforms: list[WeightTransform] = field(default_factory=list)
    source_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    source_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    loaded_keys: set[str] = field(default_factory=set)
    checkpoint: str = ""


def load_record(model: nn.Module) -> LoadRecord | None:
    """The :class:`LoadRecord` of the last successful load into ``model``, if any."""
    return model.__dict__.get(_RECORD_ATTR)


# --------------------------------------------------------------------------- helpers


def _sync_requested(sync: bool | None) -> bool:
    if sync is not None:
        return sync
    return os.environ.get(SYNC_ENV, "").strip().lower() in ("1", "true", "yes", "on")


def _runtime_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runtime keys → the tensor object behind them (parameters and persistent buffers)."""
    return dict(model.state_dict(keep_vars=True))


def _tied_groups(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for k, t in tensors.items():
        by_id.setdefault(id(t), []).append(k)
    return {k: keys for keys in by_id.values() if len(keys) > 1 for k in keys}


def _config_lookup(model: nn.Module):
    cache: dict[str, Any] = {}

    def config_for(key: str) -> Any:
        parts = key.split(".")[:-1]
        while True:
            path = ".".join(parts)
            if path in cache:
                return cache[path]
            try:
                mod = model.get_submodule(path) if path else model
            except AttributeError:
                mod = None
            cfg = getattr(mod, "config", None) if mod is not None else None
            if cfg is not None or not parts:
                cache[path] = cfg
                return cfg
            parts.pop()

    return config_for


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _meta_clone(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose tensors live on ``meta`` (no data is copied)."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        meta = t.detach().to("meta")
        memo[id(t)] = nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
    return copy.deepcopy(model, memo)


def _resolve_transforms(model: nn.Module) -> list[WeightTransform]:
    from .resolution import get_model_conversion_mapping

    transforms = list(get_model_conversion_mapping(model))
    for t in _fusion_transforms(model):
        t.__dict__[FUSION_TAG] = True  # saving reverses fusions whether or not they fired
        transforms.append(t)
    return transforms


def _fusion_transforms(model: nn.Module) -> list[WeightTransform]:
    try:
        from .fusion import fusion_transforms
    except ImportError:
        return []
    return list(fusion_transforms(model))


def _fusion_config_of(model: nn.Module) -> dict[str, Any] | None:
    try:
        from .fusion import fusion_config_of
    except ImportError:
        return None
    return fusion_config_of(model)


def _persisted_fusion_config(reader: CheckpointReader) -> dict[str, Any] | None:
    import json

    raw = reader.metadata.get(FUSION_METADATA_KEY)
    if raw is None:
        cfg_path = reader.path / "config.json" if reader.path.is_dir() else reader.path.parent / "config.json"
        if cfg_path.is_file():
            try:
                data = json.loads(cfg_path.read_text())
            except (OSError, ValueError):
                return None
            value = data.get("fusion_config") if isinstance(data, dict) else None
            return value if isinstance(value, dict) and value else None
        return None
    try:
        value = json.loads(raw)
    except ValueError as exc:
        raise LoadError(
            f"{reader.path}: metadata {FUSION_METADATA_KEY!r} is not valid JSON ({exc}); "
            "re-save the checkpoint or pass fusion_config= explicitly."
        ) from exc
    return value if isinstance(value, dict) else None


def _apply_fusions(model: nn.Module, fusion_config: dict[str, Any] | None, reader: CheckpointReader) -> dict | None:
    """Apply the requested (or persisted) fusions; return the config in force."""
    current = _fusion_config_of(model)
    wanted = fusion_config if fusion_config is not None else (None if current else _persisted_fusion_config(reader))
    if wanted is None:
        return current
    from .fusion import apply_fusions

    if current is not None:
        if current == wanted or not any(v is not False for v in wanted.values()):
            return current
    apply_fusions(model, wanted)
    return _fusion_config_of(model)


# --------------------------------------------------------------------------- planning


@dataclass
class _Work:
    """An executable plan entry."""

    entry: PlanEntry
    converter: WeightConverter | None
    group_key: str
    pattern_of: dict[str, tuple[int, tuple[int, ...]]]
    dest_keys: tuple[str, ...]  # runtime keys to set (same order as entry.target_keys)
    cast: bool
    config: Any = None


@dataclass
class _Prepared:
    plan: LoadPlan
    work: list[_Work]
    routing: Routing
    transforms: list[WeightTransform]
    reader: CheckpointReader
    runtime: dict[str, torch.Tensor]
    tied: dict[str, list[str]]
    mismatches: list[Mismatch]
    failures: list[ConversionFailure]
    conflicts: list[ConversionFailure]
    target_dtype: dict[str, torch.dtype]
    device: torch.device


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


def _prepare(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None,
    dtype: torch.dtype | str | None,
    fusion_config: dict[str, Any] | None,
    allow_pickle: bool,
    reader: CheckpointReader,
) -> _Prepared:
    dtype = _normalize_dtype(dtype)
    fusions = _apply_fusions(model, fusion_config, reader)
    transforms = _resolve_transforms(model)
    runtime = _runtime_tensors(model)
    tied = _tied_groups(runtime)
    base_prefix = getattr(model, "base_model_prefix", None) or None
    keys = reader.keys()
    routing = route_keys(keys, transforms, runtime_keys=runtime.keys(), base_model_prefix=base_prefix)
    config_for = _config_lookup(model)
    plan = LoadPlan(str(path), fusions=fusions)
    plan.transforms = [repr(t) for t in transforms]
    work: list[_Work] = []
    mismatches: list[Mismatch] = []
    failures: list[ConversionFailure] = []
    conflicts = [
        ConversionFailure("routing", (c.first, c.second), (c.target_key,), "two checkpoint keys land on one target")
        for c in routing.conflicts
    ]
    target_dtype: dict[str, torch.dtype] = {}
    covered: set[str] = set()
    dev = torch.device(device) if device is not None else None

    def dest_dtype(key: str, ckpt_dtype: torch.dtype) -> torch.dtype:
        param = runtime[key]
        if dtype == "checkpoint":
            return ckpt_dtype
        if isinstance(dtype, torch.dtype) and param.is_floating_point():
            return dtype
        return param.dtype

    for group in routing.groups.values():
        src_keys = tuple(group.source_keys)
        infos = [reader.info(k) for k in src_keys]
        renamings = tuple(
            dict.fromkeys(repr(transforms[i]) for k in src_keys for i in routing.routes[k].renamings)
        )
        entry = PlanEntry(
            target_keys=group.target_keys,
            source_keys=src_keys,
            renamings=renamings,
            nbytes=sum(i.nbytes for i in infos),
            source_shapes=tuple(tuple(i.shape) for i in infos),
            source_dtypes=tuple(_dtype_name(i.dtype) for i in infos),
        )
        converter = _converter_at(transforms, group.converter)
        pattern_of = {k: (routing.routes[k].pattern_index or 0, routing.routes[k].index) for k in src_keys}
        config = None
        if converter is not None:
            entry.transform = repr(converter)
            entry.operations = tuple(repr(op) for op in converter.operations)
            config = config_for(group.target_keys[0])
            try:
                outputs = _infer_outputs(converter, group.key, infos, pattern_of, runtime, config)
            except SurgeryError as exc:
                entry.status, entry.message = "error", str(exc)
                failures.append(ConversionFailure(repr(converter), src_keys, group.target_keys, str(exc)))
                plan.entries.append(entry)
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
            entry.status = "unexpected"
            entry.message = f"{', '.join(unknown[:3])} not in the model"
            entry.mode = "skip"
            plan.unexpected_keys.extend(src_keys)
            plan.entries.append(entry)
            continue
        params = [runtime[k] for k in out_keys]
        entry.target_shapes = tuple(tuple(p.shape) for p in params)
        bad_shape = [(k, s, tuple(p.shape)) for k, s, p in zip(out_keys, out_shapes, params) if s != tuple(p.shape)]
        if bad_shape:
            entry.status, entry.mode = "mismatch", "skip"
            entry.message = "; ".join(f"{k}: checkpoint {s} vs model {m}" for k, s, m in bad_shape)
            for k, s, m in bad_shape:
                mismatches.append(Mismatch(k, "shape", str(s), str(m), src_keys, loaded=False))
            plan.entries.append(entry)
            covered.update(out_keys)
            continue
        dts = [dest_dtype(k, d) for k, d in zip(out_keys, out_dtypes)]
        for k, d in zip(out_keys, dts):
            target_dtype[k] = d
        entry.target_dtype = _dtype_name(dts[0])
        cast = any(d != od for d, od in zip(dts, out_dtypes))
        if cast and dtype is None:
            for k, od, d in zip(out_keys, out_dtypes, dts):
                if od != d:
                    mismatches.append(Mismatch(k, "dtype", _dtype_name(od), _dtype_name(d), src_keys, loaded=True))
        target_device = dev or (params[0].device if params[0].device.type != "meta" else torch.device("cpu"))
        entry.device = str(target_device)
        entry.mode = _choose_mode(converter, params, cast, target_device, src_keys)
        covered.update(out_keys)
        for k in out_keys:
            covered.update(tied.get(k, ()))
        work.append(_Work(entry, converter, group.key, pattern_of, out_keys, cast, config))
        plan.entries.append(entry)

    plan.missing_keys = [k for k in runtime if k not in covered]
    return _Prepared(
        plan, work, routing, transforms, reader, runtime, tied, mismatches, failures, conflicts,
        target_dtype, dev or torch.device("cpu"),
    )


def _converter_at(transforms: list[WeightTransform], index: int | None) -> WeightConverter | None:
    if index is None:
        return None
    t = transforms[index]
    if not isinstance(t, WeightConverter):
        raise ConfigurationError(f"routing filed a key under {t!r}, which is not a converter.")
    return t


def _infer_outputs(
    converter: WeightConverter,
    group_key: str,
    infos: list[Any],
    pattern_of: dict[str, tuple[int, tuple[int, ...]]],
    runtime: dict[str, torch.Tensor],
    config: Any,
) -> dict[str, torch.Tensor]:
    """Run the op chain on meta tensors: output names and shapes without reading data."""
    for info in infos:
        pat, idx = pattern_of[info.key]
        converter.add_tensor(group_key, info.key, pat, torch.empty(info.shape, dtype=info.dtype, device="meta"), index=idx)
    return converter.convert(group_key, _ctx(converter, group_key, runtime, config))


def _ctx(converter: WeightConverter, group_key: str, runtime: dict[str, torch.Tensor], config: Any) -> OpContext:
    targets = converter._expand_target_keys(group_key)
    shapes = tuple(tuple(runtime[k].shape) if k in runtime else None for k in targets)
    return OpContext(n_targets=len(targets), target_shapes=shapes, config=config)


def _choose_mode(
    converter: WeightConverter | None,
    params: list[torch.Tensor],
    cast: bool,
    device: torch.device,
    src_keys: tuple[str, ...],
) -> str:
    on_meta = all(p.device.type == "meta" for p in params)
    if converter is None:
        if on_meta and not cast and device.type == "cpu":
            return "mmap"
        if not cast and device.type == "cpu" and (on_meta or params[0].is_contiguous()):
            return "direct"
        return "convert"
    if not cast and device.type == "cpu" and len(params) == 1 and (on_meta or params[0].is_contiguous()):
        if _placement_ops(converter) is not None:
            return "direct"
    return "convert"


# --------------------------------------------------------------------------- direct placement


def _placement_ops(converter: WeightConverter) -> list[Any] | None:
    """The inverse chain, if every inverse op can be taken as views (split/unbind)."""
    inverse = [op.reverse_op for op in reversed(converter.operations)]
    if all(isinstance(op, (Split, Chunk, SplitModulelist)) for op in inverse):
        return inverse
    return None


def _stage_shapes(converter: WeightConverter, slots_shapes: list[Any], ctx: OpContext) -> list[list[Any]]:
    """Shapes of the slots before each op (meta run)."""
    def meta(s: Any) -> Any:
        return [torch.empty(x, device="meta") for x in s] if isinstance(s, list) else torch.empty(s, device="meta")

    def shape(s: Any) -> Any:
        return [tuple(x.shape) for x in s] if isinstance(s, list) else tuple(s.shape)

    slots = [meta(s) for s in slots_shapes]
    stages = [[shape(s) for s in slots]]
    for op in converter.operations:
        slots = op.convert(slots, ctx)
        stages.append([shape(s) for s in slots])
    return stages


def _placement_views(
    converter: WeightConverter,
    dest: torch.Tensor,
    slot_shapes: list[Any],
    ctx: OpContext,
) -> list[Any] | None:
    """Cut ``dest`` into one view per source tensor by walking the op chain backwards."""
    inverse = _placement_ops(converter)
    if inverse is None:
        return None
    stages = _stage_shapes(converter, slot_shapes, ctx)
    slots: list[Any] = [dest]
    for back, op in enumerate(inverse):
        before = stages[len(stages) - 2 - back]  # shapes of the forward op's inputs
        if isinstance(op, (Split, Chunk)):
            if len(slots) != 1 or isinstance(slots[0], list):
                return None
            dim = op.dim
            sizes = [s[dim] for s in before]
            slots = list(torch.split(slots[0], sizes, dim=dim))
        else:  # SplitModulelist
            slots = [list(torch.unbind(s, dim=op.dim)) if not isinstance(s, list) else None for s in slots]
            if any(s is None for s in slots):
                return None
        if [_shape_of(s) for s in slots] != before:
            return None
    return slots


def _shape_of(s: Any) -> Any:
    return [tuple(x.shape) for x in s] if isinstance(s, list) else tuple(s.shape)


# --------------------------------------------------------------------------- execution


class _Progress:
    """A one-line progress bar on a terminal, silent otherwise."""

    def __init__(self, total: int, enabled: bool | None) -> None:
        self.total = max(total, 1)
        self.done = 0
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self._last = 0.0
        self._lock = threading.Lock()

    def advance(self, nbytes: int) -> None:
        if not self.enabled:
            return
        with self._lock:
            self.done += nbytes
            now = time.monotonic()
            if now - self._last < 0.1 and self.done < self.total:
                return
            self._last = now
            frac = self.done / self.total
            bar = "#" * int(frac * 30)
            sys.stderr.write(f"\rloading [{bar:<30}] {frac:6.1%}")
            if self.done >= self.total:
                sys.stderr.write("\n")
            sys.stderr.flush()


def _alloc(param: torch.Tensor, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The destination for a parameter: its own storage when usable, else a fresh tensor."""
    if param.device.type != "meta" and param.device == device and param.dtype == dtype and param.is_contiguous():
        return param.data, False
    return torch.empty(param.shape, dtype=dtype, device=device), True


def _execute(prep: _Prepared, w: _Work) -> list[tuple[str, torch.Tensor, bool]]:
    """Run one plan entry; return (runtime key, tensor, fresh) to set in the main thread."""
    reader = prep.reader
    entry = w.entry
    if entry.mode == "mmap":
        (src,) = entry.source_keys
        return [(w.dest_keys[0], reader.get_tensor(src, copy=False), True)]
    if w.converter is None:
        (src,) = entry.source_keys
        key = w.dest_keys[0]
        param = prep.runtime[key]
        dtype = prep.target_dtype[key]
        if entry.mode == "direct":
            dest, fresh = _alloc(param, dtype, prep.device)
            reader.read_into(src, dest)
            return [(key, dest, fresh)]
        t = reader.get_tensor(src).to(dtype)
        return [(key, _place(param, t, prep.device), param.device.type == "meta" or param.device != prep.device)]
    conv = w.converter
    ctx = _ctx(conv, w.group_key, prep.runtime, w.config)
    if entry.mode == "direct":
        key = w.dest_keys[0]
        param = prep.runtime[key]
        dest, fresh = _alloc(param, prep.target_dtype[key], prep.device)
        views = _placement_views(conv, dest, _slot_shapes(conv, w, prep), ctx)
        if views is not None and _all_contiguous(views):
            for src, view in zip(_ordered_sources(conv, w), _flatten(views)):
                reader.read_into(src, view)
            return [(key, dest, fresh)]
    for src in entry.source_keys:
        pat, idx = w.pattern_of[src]
        conv.add_tensor(w.group_key, src, pat, reader.get_tensor(src), index=idx)
    outputs = conv.convert(w.group_key, ctx)
    result = []
    for key in w.dest_keys:
        param = prep.runtime[key]
        t = outputs.pop(key).to(prep.target_dtype[key])
        result.append((key, _place(param, t, prep.device), param.device.type == "meta" or param.device != prep.device))
    return result


def _place(param: torch.Tensor, t: torch.Tensor, device: torch.device) -> torch.Tensor:
    if param.device.type != "meta" and param.device == device:
        with torch.no_grad():
            param.data.copy_(t)
        return param.data
    return t.to(device)


def _slot_shapes(conv: WeightConverter, w: _Work, prep: _Prepared) -> list[Any]:
    by_pattern: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for src in w.entry.source_keys:
        pat, idx = w.pattern_of[src]
        by_pattern.setdefault(pat, {})[idx] = tuple(prep.reader.info(src).shape)
    out: list[Any] = []
    for i, sp in enumerate(conv._sources):
        got = by_pattern.get(i, {})
        if sp.has_star and conv.gathers:
            out.append([got[ix] for ix in sorted(got)])
        else:
            out.append(next(iter(got.values())))
    return out


def _ordered_sources(conv: WeightConverter, w: _Work) -> list[str]:
    by_pattern: dict[int, dict[tuple[int, ...], str]] = {}
    for src in w.entry.source_keys:
        pat, idx = w.pattern_of[src]
        by_pattern.setdefault(pat, {})[idx] = src
    return [by_pattern[i][ix] for i in range(len(conv._sources)) for ix in sorted(by_pattern.get(i, {}))]


def _flatten(slots: list[Any]) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for s in slots:
        out.extend(s if isinstance(s, list) else [s])
    return out


def _all_contiguous(slots: list[Any]) -> bool:
    return all(t.is_contiguous() for t in _flatten(slots))


def _set_tensor(model: nn.Module, key: str, tensor: torch.Tensor, old: torch.Tensor) -> None:
    module_path, _, name = key.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    if name in module._parameters:
        module._parameters[name] = nn.Parameter(tensor, requires_grad=old.requires_grad)
    elif name in module._buffers:
        module._buffers[name] = tensor
    else:
        raise LoadError(f"{key!r} is neither a parameter nor a buffer of {type(module).__name__}.")


def _retie(model: nn.Module, key: str, tied: dict[str, list[str]]) -> None:
    aliases = tied.get(key)
    if not aliases:
        return
    module_path, _, name = key.rpartition(".")
    module = model.get_submodule(module_path) if module_path else model
    value = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
    for alias in aliases:
        if alias == key:
            continue
        mp, _, n = alias.rpartition(".")
        m = model.get_submodule(mp) if mp else model
        if n in m._parameters:
            m._parameters[n] = value  # type: ignore[assignment]
        else:
            m._buffers[n] = value  # type: ignore[assignment]


@contextlib.contextmanager
def _opened(path: str | os.PathLike[str], allow_pickle: bool) -> Iterator[CheckpointReader]:
    reader = open_checkpoint(path, allow_pickle=allow_pickle)
    try:
        yield reader
    finally:
        reader.close()


# --------------------------------------------------------------------------- public API


def plan_load(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    fusion_config: dict[str, Any] | None = None,
    allow_pickle: bool = False,
) -> LoadPlan:
    """Plan a load without reading tensor data (headers only) and without changing ``model``.

    Args:
        model: the module tree to load into (any device, ``meta`` included).
        path: a ``.safetensors`` file, a directory with ``model.safetensors``, or a sharded
            checkpoint directory with ``model.safetensors.index.json``.
        device: where loaded tensors go (default: each parameter's device; CPU for ``meta``).
        dtype: cast floating tensors to this dtype; ``"checkpoint"`` keeps each checkpoint dtype;
            default: the model parameter's dtype.
        fusion_config: fusions to apply first (on a meta copy of the model for the dry run).
        allow_pickle: accept ``.bin``/``.pt`` files (loaded with ``weights_only=True``).

    Returns:
        The :class:`~surgery.LoadPlan`: per runtime target its checkpoint keys, transform and op
        chain, bytes, target shape/dtype/device, mode, and every problem the report would flag.

    Example:
        >>> plan = surgery.plan_load(model, "ckpt/")  # doctest: +SKIP
        >>> print(plan.render())  # doctest: +SKIP
    """
    with _opened(path, allow_pickle) as reader:
        needs_fusion = fusion_config is not None or (
            _fusion_config_of(model) is None and _persisted_fusion_config(reader) is not None
        )
        target = _meta_clone(model) if needs_fusion else model
        if needs_fusion:
            # the clone's fusion state must start from the model's own
            if model.__dict__.get("_surgery_fusions") is not None:
                target.__dict__["_surgery_fusions"] = model.__dict__["_surgery_fusions"]
        prep = _prepare(
            target, path, device=device, dtype=dtype, fusion_config=fusion_config,
            allow_pickle=allow_pickle, reader=reader,
        )
        return prep.plan


def load_checkpoint(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    fusion_config: dict[str, Any] | None = None,
    strict: bool = False,
    allow_pickle: bool = False,
    num_workers: int | None = None,
    sync: bool | None = None,
    progress: bool | None = None,
) -> LoadReport:
    """Load a checkpoint into ``model`` through its conversion mapping (and fusions).

    Args:
        model: the module tree; a model built on ``meta`` is materialized straight from the file.
        path: a ``.safetensors`` file, a directory with ``model.safetensors``, or a sharded
            checkpoint directory with ``model.safetensors.index.json``.
        device: where loaded tensors go (default: each parameter's device; CPU for ``meta``).
        dtype: cast floating tensors to this dtype; ``"checkpoint"`` keeps the checkpoint dtypes;
            default: the parameter's dtype (differences are reported and undone on save).
        fusion_config: fusions to apply before loading, e.g. ``{"patch_embeddings": True}``; by
            default, the fusions persisted with a runtime-layout checkpoint are re-applied.
        strict: raise :class:`~surgery.LoadError` (carrying the report) when the report is not ok.
        allow_pickle: accept ``.bin``/``.pt`` files (loaded with ``weights_only=True``).
        num_workers: reader threads (default 4).
        sync: load sequentially (also ``SURGERY_SYNC_LOAD=1``).
        progress: show a progress bar (default: when stderr is a terminal).

    Returns:
        A :class:`~surgery.LoadReport`.

    Raises:
        LoadError: ``strict=True`` and the report lists problems.
        CheckpointError: the checkpoint is missing, corrupt or unsafe.
        ConfigurationError: the mapping is inconsistent (e.g. two converters claim one key).

    Example:
        >>> report = surgery.load_checkpoint(model, "ckpt/")  # doctest: +SKIP
        >>> report.ok  # doctest: +SKIP
        True
    """
    start = time.perf_counter()
    with _opened(path, allow_pickle) as reader:
        prep = _prepare(
            model, path, device=device, dtype=dtype, fusion_config=fusion_config,
            allow_pickle=allow_pickle, reader=reader,
        )
        report = LoadReport(checkpoint=str(path), fusions=prep.plan.fusions)
        report.unexpected_keys = list(prep.plan.unexpected_keys)
        report.mismatched = list(prep.mismatches)
        report.conversion_errors = list(prep.failures)
        report.conflicts = list(prep.conflicts)
        loaded_sources: list[str] = []
        done_entries: list[_Work] = []
        progress_bar = _Progress(sum(w.entry.nbytes for w in prep.work), progress)

        def finish(w: _Work, results: list[tuple[str, torch.Tensor, bool]]) -> None:
            for key, tensor, fresh in results:
                old = prep.runtime[key]
                if fresh:
                    _set_tensor(model, key, tensor, old)
                    _retie(model, key, prep.tied)
                report.loaded_keys.append(key)
                if w.entry.mode == "mmap":
                    report.mapped_keys.append(key)
            loaded_sources.extend(w.entry.source_keys)
            done_entries.append(w)
            progress_bar.advance(w.entry.nbytes)

        def fail(w: _Work, exc: BaseException) -> None:
            report.conversion_errors.append(
                ConversionFailure(w.entry.transform or "read", w.entry.source_keys, w.entry.target_keys, str(exc))
            )

        if _sync_requested(sync):
            for w in prep.work:
                try:
                    finish(w, _execute(prep, w))
                except SurgeryError as exc:
                    fail(w, exc)
        else:
            _run_pool(prep, num_workers or DEFAULT_WORKERS, finish, fail)

        loaded = set(report.loaded_keys)
        for k in list(loaded):
            loaded.update(prep.tied.get(k, ()))
        report.missing_keys = [k for k in prep.runtime if k not in loaded and not _mismatched(report, k)]
        report.transforms_used = _record(model, prep, loaded_sources, set(report.loaded_keys), path)
        report.seconds = time.perf_counter() - start
    if strict and not report.ok:
        raise LoadError(f"strict load of {path} failed:\n{report}", report)
    return report


def _mismatched(report: LoadReport, key: str) -> bool:
    return any(m.key == key and not m.loaded for m in report.mismatched)


def _run_pool(prep: _Prepared, workers: int, finish, fail) -> None:
    """Execute the work list with bounded read-ahead; Ctrl-C cancels what has not started."""
    pending: dict[Future, _Work] = {}
    in_flight = 0
    with ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="surgery-load") as pool:
        try:
            for w in prep.work:
                cost = w.entry.nbytes if w.entry.mode == "convert" else 0
                while pending and (len(pending) >= 2 * workers or in_flight + cost > max(_READ_AHEAD_BYTES, cost)):
                    done, _ = wait(pending, return_when=FIRST_COMPLETED)
                    for f in done:
                        fw = pending.pop(f)
                        in_flight -= fw.entry.nbytes if fw.entry.mode == "convert" else 0
                        _collect(f, fw, finish, fail)
                pending[pool.submit(_execute, prep, w)] = w
                in_flight += cost
            while pending:
                done, _ = wait(pending, return_when=FIRST_COMPLETED)
                for f in done:
                    _collect(f, pending.pop(f), finish, fail)
        except BaseException:
            for f in pending:
                f.cancel()
            pool.shutdown(wait=True, cancel_futures=True)
            raise


def _collect(f: Future, w: _Work, finish, fail) -> None:
    try:
        results = f.result()
    except SurgeryError as exc:
        fail(w, exc)
        return
    finish(w, results)


def _record(
    model: nn.Module, prep: _Prepared, loaded_sources: list[str], loaded: set[str], path: str | os.PathLike[str]
) -> list[str]:
    """Mark the transforms whose output was loaded and leave a LoadRecord on the model."""
    used: set[int] = set()
    base_changes: set[str] = set()
    for src in loaded_sources:
        r = prep.routing.routes[src]
        used.update(r.renamings)
        if r.converter is not None:
            used.add(r.converter)
        if r.base_prefix:
            base_changes.add(r.base_prefix)
    transforms = [t for i, t in enumerate(prep.transforms) if i in used]
    for t in transforms:
        t.mark_used()
    prefix = getattr(model, "base_model_prefix", None)
    if prefix and len(base_changes) == 1:
        change = PrefixChange(prefix_to_add=prefix) if "+" in base_changes else PrefixChange(prefix_to_remove=prefix)
        change.mark_used()
        transforms.insert(0, change)
    record = LoadRecord(
        transforms=transforms,
        source_dtypes={k: prep.reader.info(k).dtype for k in loaded_sources},
        source_shapes={k: tuple(prep.reader.info(k).shape) for k in loaded_sources},
        loaded_keys=loaded,
        checkpoint=str(path),
    )
    model.__dict__[_RECORD_ATTR] = record
    return [repr(t) for t in transforms]

