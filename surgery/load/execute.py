"""Executing one entry of a load plan: read its sources, decode, convert, quantize, place.

:func:`execute` runs one :class:`~surgery.load.planner.Work` in the mode the plan chose
(``mmap``: map the file; ``direct``: read straight into the destination, cut into views by the
inverse op chain, with one ``preadv`` per run of adjacent sources; ``convert``: read, run the
chain, cast or quantize) and returns what to set; under tensor parallelism it reads only this
rank's regions. It runs on the loader's worker threads and never touches the model itself.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

import torch

from ..checkpoint import CheckpointReader
from ..checkpoint.format import SafetensorsFile
from ..converter import Collector, WeightConverter, expand_outputs
from ..errors import ConversionError, SurgeryError
from ..ops import OpContext, run_chain
from ..parallel import is_dtensor
from ..parallel.regions import NOT_NEEDED, Box, Region, local_shape
from ..placement import all_contiguous, flatten_slots, placement_views
from .plan import Mode
from .planner import Prepared, Work
from .quantized import read_companion
from .shapes import op_context
from .sharding import Sharding, local_context
from .staging import StagedReader

__all__ = ["execute"]


def _usable_in_place(param: torch.Tensor, dtype: torch.dtype, device: torch.device) -> bool:
    return (
        not is_dtensor(param)
        and param.device.type != "meta"
        and param.device == device
        and param.dtype == dtype
        and param.is_contiguous()
    )


def _alloc(param: torch.Tensor, dtype: torch.dtype, device: torch.device) -> tuple[torch.Tensor, bool]:
    """The destination for a parameter: its own storage when usable, else a fresh tensor."""
    if _usable_in_place(param, dtype, device):
        return param.data, False
    return torch.empty(param.shape, dtype=dtype, device=device), True


def _place(param: torch.Tensor, t: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, bool]:
    """Put ``t`` into ``param``'s storage when it can take it; else move ``t`` to ``device``."""
    if _usable_in_place(param, t.dtype, device):
        with torch.no_grad():
            param.data.copy_(t)
        return param.data, False
    return t.to(device), True


def execute(prep: Prepared, w: Work) -> list[tuple[str, torch.Tensor, bool]]:
    """Run one plan entry; return (runtime key, tensor, fresh) to set in the main thread."""
    reader = _reader(prep, w)
    entry = w.entry
    if w.sharding is not None and w.sharding.sharded:
        return _execute_shard(prep, w, w.sharding)
    if entry.mode == Mode.MMAP:
        (src,) = entry.source_keys
        return [(w.dest_keys[0], prep.reader.get_tensor(src, copy=False), True)]  # a CPU target
    chain = w.chain
    if chain is None:
        (src,) = entry.source_keys
        key = w.dest_keys[0]
        param = prep.runtime[key]
        dtype = prep.target_dtype[key]
        if entry.mode == Mode.DIRECT:
            dest, fresh = _alloc(param, dtype, w.device)
            reader.read_into(src, dest)
            return [(key, dest, fresh)]
        return _targets(prep, w, key, _source(prep, w, src))
    conv = chain.converter
    ctx = _keeping(prep, w, conv, op_context(conv, chain.group_key, prep.runtime, chain.config))
    if entry.mode == Mode.DIRECT:
        key = w.dest_keys[0]
        dest, fresh = _alloc(prep.runtime[key], prep.target_dtype[key], w.device)
        views = placement_views(conv, dest, chain.slot_shapes or [], ctx)
        if views is None or not all_contiguous(views):
            raise ConversionError(
                f"{conv!r}: the planned direct placement of {key!r} is not possible; this is a bug, "
                "please report it (loading with the default plan of another version avoids it)."
            )
        _read_placed(reader, list(zip(_ordered_sources(conv, w), flatten_slots(views))), dest)
        return [(key, dest, fresh)]
    collector = Collector(conv)
    for src in entry.source_keys:
        pat, idx = w.pattern_of[src]
        collector.add_tensor(chain.group_key, src, pat, _source(prep, w, src), index=idx)
    outputs = collector.convert(chain.group_key, ctx)
    result = []
    for key in w.dest_keys:
        result.extend(_targets(prep, w, key, outputs.pop(key)))
    return result


def _keeping(prep: Prepared, w: Work, conv: WeightConverter, ctx: OpContext) -> OpContext:
    """``ctx`` with a ``keep_residue`` that files what an op drops under the group's first runtime key.

    The key is the smallest runtime key of the group, the one a save finds it under. Under tensor
    parallelism an op without a slice rule (``Inkling2UnpadVocab``) runs on whole tensors, so every
    rank keeps the whole residue: an op that keeps a residue must not define a slice rule.
    """
    key = min(w.dest_keys)

    def keep(residue: torch.Tensor) -> None:
        if key in prep.residues:
            raise ConversionError(
                f"{conv!r}: two ops of its chain dropped data for {key!r}; one op per chain may "
                "keep a residue. Split the chain into two converters."
            )
        prep.residues[key] = residue

    return replace(ctx, keep_residue=keep)


def _source(prep: Prepared, w: Work, key: str, region: Any = None) -> torch.Tensor:
    """``key`` (its ``region``) as the op chain takes it: read, and decoded if stored quantized.

    A format whose decoded shape differs from the stored one (packed values) reads the stored
    part that holds ``region`` (``stored_region``) and decodes it to ``region``.
    """
    q = w.quantizing
    names = None if q is None else q.companions.get(key)
    reader = _reader(prep, w)
    if q is None or not names:
        return _read(reader, key, region)
    if isinstance(region, Box):  # scales are cut by one dim: decode whole, keep the box
        return region.take(_source(prep, w, key)).contiguous()
    stored = region
    if isinstance(region, Region) and q.hooks.reshapes:
        stored = q.hooks.stored_region(key, region, prep.reader.info(key))
    t = _read(reader, key, stored)
    companions: dict[str, torch.Tensor] = {}
    for c in names:
        if c in prep.checked and (c not in prep.partial_companions or isinstance(region, Region)):
            companions[c] = prep.checked[c]
            continue
        companions[c], part = read_companion(q.hooks, prep.reader, key, c, region)
        if part is not None:
            prep.partial_companions.add(c)
    prep.companion_values[key] = companions  # as read (host): what a save re-encodes with
    if t.device.type != "cpu":  # staged to a device: decode there, with the (small) companions moved along
        companions = {c: v.to(t.device) for c, v in companions.items()}
    return q.hooks.decode(key, t, companions, region if isinstance(region, Region) else None)


def _targets(prep: Prepared, w: Work, key: str, t: torch.Tensor) -> list[tuple[str, torch.Tensor, bool]]:
    """What to set for the chain output ``t`` of ``key``: cast, or quantized into its runtime keys."""
    q = w.quantizing
    produced = None if q is None else q.produced.get(key)
    if q is None or produced is None:
        return [(key, *_place(prep.runtime[key], t.to(prep.target_dtype[key]), w.device))]
    out = q.hooks.quantize(key, t)
    missing = [k for k in produced if k not in out]
    if missing:
        raise ConversionError(
            f"{q.hooks.name}.quantize({key!r}) returned {sorted(out)}; planning on meta tensors gave "
            f"{list(produced)} (missing {missing})."
        )
    return [(k, *_place(prep.runtime[k], out[k].to(prep.target_dtype[k]), w.device)) for k in produced]


def _reader(prep: Prepared, w: Work) -> CheckpointReader | StagedReader:
    """Where ``w`` reads from: the checkpoint, or the staging ring that brings it to ``w``'s device."""
    if prep.staging is None:
        return prep.reader
    return StagedReader(prep.reader, prep.staging, w.device)


def _read(
    reader: CheckpointReader | StagedReader, key: str, region: Any, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``key``'s region (all of it for ``None``), into ``out`` when given."""
    if isinstance(region, Region):
        return reader.read_region(key, region.dim, region.intervals, out=out)
    if isinstance(region, Box):
        return reader.read_box(key, [(p.dim, p.intervals) for p in region.parts], out=out)
    if out is not None:
        return reader.read_into(key, out)
    return reader.get_tensor(key)


def _execute_shard(prep: Prepared, w: Work, sh: Sharding) -> list[tuple[str, torch.Tensor, bool]]:
    """Run one entry of a tensor-parallel load: read this rank's regions, build the local tensors."""
    reader, entry = _reader(prep, w), w.entry
    local_shapes = [local_shape(tuple(prep.runtime[k].shape), r) for k, r in zip(w.dest_keys, sh.regions)]
    chain = w.chain
    if chain is None:
        (src,) = entry.source_keys
        key = w.dest_keys[0]
        dtype = prep.target_dtype[key]
        if entry.mode == Mode.DIRECT:
            dest = torch.empty(local_shapes[0], dtype=dtype, device=w.device)
            return [(key, _read(reader, src, sh.sources[src], dest), True)]
        return [(key, _source(prep, w, src, sh.sources[src]).to(dtype).to(w.device), True)]
    conv = chain.converter
    ctx = _keeping(prep, w, conv, op_context(conv, chain.group_key, prep.runtime, chain.config))
    targets = conv.expand_target_keys(chain.group_key)
    if sh.fallback is not None and sh.operations is None:  # read whole, run the global chain, keep the part
        collector = Collector(conv)
        for src in entry.source_keys:
            pat, idx = w.pattern_of[src]
            collector.add_tensor(chain.group_key, src, pat, _source(prep, w, src), index=idx)
        outputs = collector.convert(chain.group_key, ctx)
        result = []
        for key, region in zip(w.dest_keys, sh.regions):
            t = outputs.pop(key)
            t = t if region is None else region.take(t).contiguous()
            result.append((key, t.to(prep.target_dtype[key]).to(w.device), True))
        return result
    chain_regions = sh.regions if sh.chain_regions is None else sh.chain_regions
    local_ctx = local_context(ctx, chain_regions, w.dest_keys)
    keys = [k for k in _ordered_sources(conv, w) if sh.sources.get(k) is not NOT_NEEDED]
    if entry.mode == Mode.DIRECT:
        key = w.dest_keys[0]
        dest = torch.empty(local_shapes[0], dtype=prep.target_dtype[key], device=w.device)
        views = placement_views(conv, dest, sh.local_slot_shapes or [], local_ctx, operations=sh.operations)
        if views is None or not all_contiguous(views):
            raise ConversionError(
                f"{conv!r}: the planned direct placement of this rank's part of {key!r} failed; this is a bug."
            )
        for src, view in zip(keys, flatten_slots(views)):
            _read(reader, src, sh.sources[src], view)
        return [(key, dest, True)]
    tensors = {k: _source(prep, w, k, sh.sources[k]) for k in keys}
    slots: list[Any] = []
    by_pattern: dict[int, list[str]] = {}
    for k in keys:
        by_pattern.setdefault(w.pattern_of[k][0], []).append(k)
    for i in range(len(conv.source_patterns)):
        got = [tensors[k] for k in by_pattern.get(i, [])]
        slots.append(got if conv.gathers_from(i) else got[0])
    try:
        out = run_chain(sh.operations or [], slots, local_ctx)
    except ConversionError as exc:
        raise ConversionError(f"{conv!r} on this rank's part of {w.dest_keys[0]!r}: {exc}") from exc
    outputs = expand_outputs(targets, out, conv)
    if sh.chain_regions is not None:  # a covering fallback: cut the other dims of each box now
        for key, full, part in zip(w.dest_keys, sh.regions, sh.chain_regions):
            outputs[key] = _rest_of(full, part).take(outputs[key]).contiguous()
    return [(key, outputs.pop(key).to(prep.target_dtype[key]).to(w.device), True) for key in w.dest_keys]


def _rest_of(full: Region | Box | None, part: Region | Box | None) -> Box:
    """The cuts of ``full`` that ``part`` (cut on one of its dims) did not make."""
    done = set(part.dims) if isinstance(part, Box) else ({part.dim} if part is not None else set())
    cuts = full.parts if isinstance(full, Box) else (() if full is None else (full,))
    return Box(tuple(c for c in cuts if c.dim not in done))


def _ordered_sources(conv: WeightConverter, w: Work) -> list[str]:
    """``w``'s source keys in the order of :func:`~surgery.placement.flatten_slots` of its views."""
    by_pattern: dict[int, dict[tuple[int, ...], str]] = {}
    for src in w.entry.source_keys:
        pat, idx = w.pattern_of[src]
        by_pattern.setdefault(pat, {})[idx] = src
    return [
        by_pattern[i][ix] for i in range(len(conv.source_patterns)) for ix in sorted(by_pattern.get(i, {}))
    ]


def _read_placed(
    reader: CheckpointReader | StagedReader, pairs: list[tuple[str, torch.Tensor]], dest: torch.Tensor
) -> None:
    """``reader.read_into(src, view)`` for every pair of views cut from ``dest``, minus the overhead.

    The placement already made every view a contiguous slice of ``dest``; what is left to check
    per tensor (its file, dtype and shape) is checked here, and the views that pass are read
    straight from their file in one call per file (one ``preadv`` per run of sources that sit
    back to back in the file and in ``dest``). Anything unusual goes through ``read_into``, and
    a batch that fails is read again key by key, so errors name the tensor as they always did.
    """
    if (
        not isinstance(reader, CheckpointReader)
        or not hasattr(os, "preadv")
        or dest.device.type != "cpu"
        or dest.layout != torch.strided
    ):
        for src, view in pairs:
            reader.read_into(src, view)
        return
    lookup = reader.locate
    source: Any = None
    batch: list[tuple[str, torch.Tensor]] = []
    spans: list[list[Any]] = []  # [offset, address, nbytes, key]
    end_offset = end_address = -1

    def flush() -> None:
        if not batch:
            return
        try:
            source.read_spans(spans)
            reader.record_read(sum(span[2] for span in spans))
        except SurgeryError:
            for src, view in batch:
                reader.read_into(src, view)
        batch.clear()
        spans.clear()

    for src, view in pairs:
        info, file = lookup(src)
        if file.__class__ is not SafetensorsFile or view.dtype != info.dtype or view.shape != info.shape:
            flush()
            reader.read_into(src, view)
            continue
        if file is not source:
            flush()
            source = file
        batch.append((src, view))
        address = view.data_ptr()
        if spans and info.offset == end_offset and address == end_address:
            spans[-1][2] += info.nbytes
        else:
            spans.append([info.offset, address, info.nbytes, src])
        end_offset, end_address = info.offset + info.nbytes, address + info.nbytes
    flush()
