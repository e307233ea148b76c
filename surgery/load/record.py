"""What a load leaves on the model: its :class:`~surgery.record.LoadRecord`, built from the executed work.

:func:`record_load` builds the record from the executed work list (which transforms fired, each
with its :class:`~surgery.record.Origin`, the checkpoint dtypes, shapes, shards and order of every
key read, the companion tensors a quantizer decoded with) and stores it in the model's record
(:func:`~surgery.record.record_of`); :func:`clear_record` drops it.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from torch import nn

from ..record import Fired, LoadRecord, Origin, update_record
from ..routing import BasePrefix
from ..transforms import PrefixChange
from .planner import Prepared, Work
from .quantized import CompanionsOnDisk, CompanionsRead

__all__ = ["clear_record", "record_load"]


def clear_record(model: nn.Module) -> None:
    """Drop the model's load record (a load that fails or is interrupted leaves none behind)."""
    update_record(model, load=None)


def record_load(
    model: nn.Module, prep: Prepared, done: list[Work], path: str | os.PathLike[str]
) -> list[str]:
    """Leave the :class:`~surgery.record.LoadRecord` of the executed work on the model.

    Returns:
        The transforms that fired, as text (for the load report).
    """
    used: set[int] = set()
    base_changes: set[BasePrefix] = set()
    sources: set[str] = set()
    for w in done:
        sources.update(w.entry.companions)
        for src in w.entry.source_keys:
            sources.add(src)
            r = prep.routing.routes[src]
            used.update(r.renamings)
            if r.converter is not None:
                used.add(r.converter)
            if r.base_prefix is not BasePrefix.UNUSED:
                base_changes.add(r.base_prefix)
    fired = [Fired(t, prep.origins[i]) for i, t in enumerate(prep.transforms) if i in used]
    prefix = getattr(model, "base_model_prefix", None)
    if prefix and len(base_changes) == 1:
        (how,) = base_changes
        change = PrefixChange(prefix_to_add=prefix) if how.added else PrefixChange(prefix_to_remove=prefix)
        if how.after:  # applied to the renamed keys: the last renaming
            fired.append(Fired(change, Origin.BASE_PREFIX_AFTER))
        else:  # applied to the checkpoint keys: the first renaming
            fired.insert(0, Fired(change, Origin.BASE_PREFIX_BEFORE))
    reader = prep.reader
    in_order = [k for k in reader if k in sources]  # checkpoint order, not completion order
    infos = [reader.info(k) for k in in_order]
    file_index = {f: i for i, f in enumerate(reader.files)}
    loaded = {k for w in done for k in (*w.dest_keys, *w.entry.quantized)}
    unread = {  # sources another rank reads (its experts): their companions, for a save that writes them
        k: names
        for w in done
        if w.quantizing is not None
        for k, names in w.quantizing.companions.items()
        if names and k not in prep.companion_values
    }
    on_disk = CompanionsOnDisk(str(reader.path))
    companions: dict[str, Mapping[str, torch.Tensor]] = {
        k: CompanionsRead(v, prep.partial_companions, on_disk) if prep.partial_companions & set(v) else v
        for k, v in prep.companion_values.items()
        if k in sources
    }
    companions.update((k, CompanionsRead.unread(names, on_disk)) for k, names in unread.items())
    update_record(
        model,
        load=LoadRecord(
            fired=fired,
            source_dtypes={k: i.dtype for k, i in zip(in_order, infos)},
            source_shapes={k: tuple(i.shape) for k, i in zip(in_order, infos)},
            source_shards={k: file_index.get(i.file, 0) for k, i in zip(in_order, infos)},
            loaded_keys=loaded,
            checkpoint=str(path),
            companions=companions,
            quantizer=None if prep.quantizer is None else prep.quantizer.quantizer,
            residues={k: v for k, v in prep.residues.items() if k in loaded},
        ),
    )
    return [repr(f.transform) for f in fired]
