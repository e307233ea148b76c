"""What a load leaves on the model: the record a save reads to invert exactly what happened.

:func:`record_load` builds the :class:`LoadRecord` from the executed work list (which transforms
fired, the checkpoint dtypes, shapes, shards and order of every key read, the companion tensors a
quantizer decoded with) and stores it on the model; :func:`load_record` reads it back.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..transforms import PrefixChange, WeightTransform
from .planner import Prepared, Work

__all__ = ["BASE_PREFIX_TAG", "LoadRecord", "clear_record", "load_record", "record_load"]

_RECORD_ATTR = "_surgery_load_record"
BASE_PREFIX_TAG = "_surgery_base_prefix"
"""Marks the base-model prefix change a load recorded (``"first"`` or ``"last"`` renaming)."""


@dataclass
class LoadRecord:
    """What a load leaves on the model so that saving can invert exactly what happened.

    Attributes:
        transforms: the transforms whose output was loaded, in mapping order.
        source_dtypes: checkpoint dtype of every checkpoint key that was loaded (checkpoint order:
            shard order, then position in the shard).
        source_shapes: checkpoint shape of every checkpoint key that was loaded (same order).
        source_shards: per loaded checkpoint key, the index of the file that held it, so a save
            with the same ``max_shard_size`` puts every key back into the same shard.
        loaded_keys: runtime keys that were loaded.
        checkpoint: the path loaded.
        companions: per checkpoint key decoded by a quantizer, the companion tensors read with
            it (FP8 block scales), kept so that a save re-encodes with exactly these.
        quantizer: the quantizer of the load (``None`` without one).
        residues: per converter group (its smallest runtime key), what an op of its chain dropped
            at load (:attr:`surgery.ops.OpContext.keep_residue`: the padding rows of an unpadded
            vocabulary), for the reversed op to put back on save. Only the dropped data.
    """

    transforms: list[WeightTransform] = field(default_factory=list)
    source_dtypes: dict[str, torch.dtype] = field(default_factory=dict)
    source_shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    source_shards: dict[str, int] = field(default_factory=dict)
    loaded_keys: set[str] = field(default_factory=set)
    checkpoint: str = ""
    companions: dict[str, dict[str, torch.Tensor]] = field(default_factory=dict)
    quantizer: Any = None
    residues: dict[str, torch.Tensor] = field(default_factory=dict)


def load_record(model: nn.Module) -> LoadRecord | None:
    """The :class:`LoadRecord` of the last successful load into ``model``, if any."""
    return model.__dict__.get(_RECORD_ATTR)


def clear_record(model: nn.Module) -> None:
    """Drop the model's record (a load that fails or is interrupted leaves none behind)."""
    model.__dict__.pop(_RECORD_ATTR, None)


def record_load(
    model: nn.Module, prep: Prepared, done: list[Work], path: str | os.PathLike[str]
) -> list[str]:
    """Mark the transforms whose output was loaded and leave a LoadRecord on the model."""
    used: set[int] = set()
    base_changes: set[str] = set()
    sources: set[str] = set()
    for w in done:
        sources.update(w.entry.companions)
        for src in w.entry.source_keys:
            sources.add(src)
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
        (mark,) = base_changes
        change = (
            PrefixChange(prefix_to_add=prefix)
            if mark.startswith("+")
            else PrefixChange(prefix_to_remove=prefix)
        )
        change.mark_used()
        change.__dict__[BASE_PREFIX_TAG] = "last" if mark.endswith("after") else "first"
        if mark.endswith("after"):
            transforms.append(change)  # applied to the renamed keys: the last renaming
        else:
            transforms.insert(0, change)  # applied to the checkpoint keys: the first renaming
    reader = prep.reader
    in_order = [k for k in reader if k in sources]  # checkpoint order, not completion order
    infos = [reader.info(k) for k in in_order]
    file_index = {f: i for i, f in enumerate(reader.files)}
    loaded = {k for w in done for k in (*w.dest_keys, *w.entry.quantized)}
    record = LoadRecord(
        transforms=transforms,
        source_dtypes={k: i.dtype for k, i in zip(in_order, infos)},
        source_shapes={k: tuple(i.shape) for k, i in zip(in_order, infos)},
        source_shards={k: file_index.get(i.file, 0) for k, i in zip(in_order, infos)},
        loaded_keys=loaded,
        checkpoint=str(path),
        companions={k: v for k, v in prep.companion_values.items() if k in sources},
        quantizer=None if prep.quantizer is None else prep.quantizer.quantizer,
        residues={k: v for k, v in prep.residues.items() if k in loaded},
    )
    model.__dict__[_RECORD_ATTR] = record
    return [repr(t) for t in transforms]
