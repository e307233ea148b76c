"""Resharding through ``torch.distributed.checkpoint`` (DCP): a parallelized model's runtime state
saved with ``dcp.save`` and loaded with ``dcp.load`` into a model parallelized on another mesh.

DCP stores each tensor as chunks (an offset and a size in the whole tensor) and reads any chunk
a rank of the target mesh needs by overlap: resharding is its job. What it cannot do alone is
describe every placement a load here leaves: the chunk DCP computes for a DTensor is one box, and
a ``_StridedShard`` (a ``packed_colwise`` weight: each of its packed halves sharded) fills several;
under FSDP2 over such a weight torch declares placements its data does not follow (the dp chunk
of each TP shard, see :func:`~surgery.parallel.assemble.local_indices`), and a plain ``dcp.save``
of it fails ("overlapping chunks", torch 2.13). So :func:`dcp_state_dict` hands DCP each
DTensor as a :class:`LocalShards`: the rank's own local tensor and the boxes it fills in the whole
tensor, each box one DCP chunk. Nothing moves between ranks and nothing is gathered: every rank
writes, and later reads, only the boxes it holds (replicas write one copy, DCP deduplicates them).

:func:`save_dcp` also stores the model's load record (:mod:`surgery.record`: which transforms
fired, the checkpoint dtypes, shapes and shards) as JSON in one more DCP tensor,
:data:`RECORD_KEY` (``uint8``, committed with the rest by DCP's own metadata), so that after
:func:`load_dcp` on another mesh :func:`surgery.save_checkpoint` writes the original hub layout.
Nothing pickled is written or read beyond DCP's own ``.metadata``. ``storage="safetensors"``
writes through DCP's ``HuggingFaceStorageWriter`` instead, where every DTensor is one box per rank.

Example (shape only; see docs/parallel.md, "Resharding with DCP")::

    surgery.load_checkpoint(model_a, "hub/", device_mesh=mesh_a, tp_plan="auto", fsdp=True)
    save_dcp(model_a, "ckpt-dcp/")                       # every rank of mesh A
    parallelize(model_b, "auto", mesh_b["tp"])             # or shard_model(..., fsdp=True)
    load_dcp(model_b, "ckpt-dcp/")                        # every rank of mesh B
    surgery.save_checkpoint(model_b, "hub-again/")        # byte-identical to hub/
"""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..errors import CheckpointError, ConfigurationError, LoadError
from ..fusion import fusion_transforms
from ..record import Fired, LoadRecord, Origin, record_of, update_record
from ..resolution import get_model_conversion_mapping
from ..transforms import PrefixChange, WeightTransform
from .assemble import boxes, local_indices

__all__ = ["RECORD_KEY", "STORAGES", "LocalShards", "dcp_state_dict", "load_dcp", "save_dcp"]

RECORD_KEY = "_surgery.load_record"
"""The DCP key of the load record: its JSON as a 1-D ``uint8`` tensor."""

_RECORD_VERSION = 1


class LocalShards:
    """One rank's part of a tensor, as DCP chunks: its local tensor and the boxes it fills.

    DCP's checkpointable protocol (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``): a write item per box on save; on load, a destination chunk per
    box, whose tensor is a view of the local tensor, so DCP's reads land in place.

    Args:
        local: the rank's local tensor (a DTensor's ``to_local()``).
        shape: the shape of the whole tensor.
        placed: per box, ``(start in the whole tensor, start in local, size)`` per dim.

    Example:
        >>> s = LocalShards(torch.arange(4.0).reshape(2, 2), (4, 2), [((2, 0), (0, 0), (2, 2))])
        >>> s.size(), [tuple(c.offsets) for c in s.__create_chunk_list__()]
        (torch.Size([4, 2]), [(2, 0)])
    """

    def __init__(
        self, local: torch.Tensor, shape: Sequence[int], placed: Sequence[tuple[tuple[int, ...], ...]]
    ) -> None:
        self.local = local
        self.shape = torch.Size(shape)
        self.placed = [tuple(tuple(int(x) for x in part) for part in box) for box in placed]

    def size(self) -> torch.Size:
        """The whole tensor's size (what DCP checks against the stored one)."""
        return self.shape

    def view(self, offset: Sequence[int]) -> torch.Tensor:
        """The local view of the box that starts at ``offset`` in the whole tensor."""
        for start, at, size in self.placed:
            if tuple(start) == tuple(offset):
                t = self.local
                for d, (a, n) in enumerate(zip(at, size)):
                    t = t.narrow(d, a, n)
                return t
        raise CheckpointError(f"No local box starts at {tuple(offset)} (boxes: {self.placed}).")

    def __create_chunk_list__(self) -> list[Any]:
        return [ChunkStorageMetadata(offsets=torch.Size(s), sizes=torch.Size(n)) for s, _, n in self.placed]

    def __create_write_items__(self, fqn: str, _obj: Any) -> list[Any]:
        properties = TensorProperties.create_from_tensor(self.local)
        return [
            WriteItem(
                index=MetadataIndex(fqn, chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(chunk=chunk, properties=properties, size=self.shape),
            )
            for chunk in self.__create_chunk_list__()
        ]

    def __get_tensor_shard__(self, index: Any) -> torch.Tensor:
        return self.view(index.offset)

    def __repr__(self) -> str:
        return f"LocalShards(shape={tuple(self.shape)}, boxes={len(self.placed)})"


def _shards_of(t: Any) -> LocalShards | None:
    """A DTensor as :class:`LocalShards` (``None`` on a rank outside its mesh)."""
    mesh = t.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        return None
    indices = local_indices(tuple(t.shape), tuple(mesh.mesh.shape), coordinate, tuple(t.placements))
    return LocalShards(t.to_local(), tuple(t.shape), boxes(indices))


def dcp_state_dict(model: nn.Module) -> dict[str, Any]:
    """``model.state_dict()`` as DCP stores it exactly: each DTensor as :class:`LocalShards`.

    Plain tensors stay as they are (DCP keeps one copy of a tensor every rank holds). The
    values share storage with the model: ``dcp.load`` into this dict fills the model in place.

    Raises:
        ConfigurationError: a DTensor whose placements are not ``Shard``, ``_StridedShard`` or
            ``Replicate`` (``Partial``), naming the key.

    Example:
        >>> sorted(dcp_state_dict(nn.Linear(2, 2)))
        ['bias', 'weight']
    """
    from .dtensors import is_dtensor

    out: dict[str, Any] = {}
    for key, value in model.state_dict().items():
        if not is_dtensor(value):
            out[key] = value.detach()
            continue
        try:
            shards = _shards_of(value)
        except ConfigurationError as exc:
            raise ConfigurationError(f"{key}: {exc}") from None
        if shards is not None:
            out[key] = shards
    return out


class _SavePlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds a :class:`LocalShards` box by its offset."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        value = self.state_dict[index.fqn]
        if isinstance(value, LocalShards):
            return value.view(index.offset or ()).clone()  # the box alone, not the local storage
        return super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, which reads into the view of a :class:`LocalShards` box."""

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        # DCP's set-up allocates meta tensors in place and leaves None for a type it does not
        # know: put the boxes back (they are allocated already)
        shards = {k: v for k, v in state_dict.items() if isinstance(v, LocalShards)}
        super().set_up_planner(state_dict, metadata, is_coordinator)
        state_dict.update(shards)
        self.state_dict.update(shards)

    def lookup_tensor(self, index: MetadataIndex) -> torch.Tensor:
        value = self.state_dict[index.fqn]
        if isinstance(value, LocalShards):
            return value.view(index.offset or ())
        return super().lookup_tensor(index)


# --------------------------------------------------------------------------- the load record as JSON


def _candidates(model: nn.Module) -> list[WeightTransform]:
    """The transforms a load of ``model`` without a quantizer routes through (mapping, then fusions)."""
    return [*get_model_conversion_mapping(model), *fusion_transforms(model)]


def _described(t: WeightTransform) -> dict[str, Any]:
    return {
        "type": type(t).__name__,
        "source": list(t.source_patterns),
        "target": list(t.target_patterns),
        "scope": t.scope_prefix,
    }


def _encode_fired(model: nn.Module, fired: Sequence[Fired]) -> list[dict[str, Any]]:
    """Each fired transform as data: a base-prefix change as itself, any other as its place in
    :func:`_candidates` (a transform is code; the target rebuilds it from the same mapping)."""
    candidates = _candidates(model)
    out: list[dict[str, Any]] = []
    for f in fired:
        entry: dict[str, Any] = {"origin": f.origin.value}
        if f.origin in (Origin.BASE_PREFIX_BEFORE, Origin.BASE_PREFIX_AFTER):
            change = f.transform
            if not isinstance(change, PrefixChange):
                raise ConfigurationError(
                    f"save_dcp: a {f.origin.value} transform must be a PrefixChange, got {change!r}."
                )
            entry["add"], entry["remove"] = change.prefix_to_add, change.prefix_to_remove
        else:
            index = next((i for i, c in enumerate(candidates) if c == f.transform), None)
            if index is None:
                raise ConfigurationError(
                    f"save_dcp cannot carry the load record: transform {f.transform!r} fired at load but "
                    "is no longer in the model's conversion mapping. Load the checkpoint again, then save."
                )
            entry.update(index=index, **_described(f.transform))
        out.append(entry)
    return out


def _encode_record(model: nn.Module) -> torch.Tensor | None:
    """The model's load record as JSON bytes in a ``uint8`` tensor (``None``: never loaded).

    Raises:
        ConfigurationError: a record this cannot carry (a quantized load, or one that kept residues).
    """
    record = record_of(model).load
    if record is None:
        return None
    if record.quantizer is not None or record.companions or record.residues:
        raise ConfigurationError(
            "save_dcp carries the load record of an unquantized load only, and this model was loaded with "
            f"{'a quantizer' if record.quantizer is not None else 'residues kept for the save'}. Save the "
            "hub layout with surgery.save_checkpoint instead, or load the checkpoint without a quantizer."
        )
    data = {
        "version": _RECORD_VERSION,
        "checkpoint": record.checkpoint,
        "fired": _encode_fired(model, record.fired),
        "source_dtypes": {k: str(v).removeprefix("torch.") for k, v in record.source_dtypes.items()},
        "source_shapes": {k: list(v) for k, v in record.source_shapes.items()},
        "source_shards": dict(record.source_shards),
        "loaded_keys": sorted(record.loaded_keys),
    }
    return torch.frombuffer(bytearray(json.dumps(data).encode()), dtype=torch.uint8)


def _decode_fired(model: nn.Module, entries: Sequence[Mapping[str, Any]], path: str) -> list[Fired]:
    candidates = _candidates(model)
    fired: list[Fired] = []
    for e in entries:
        origin = Origin(e["origin"])
        if origin in (Origin.BASE_PREFIX_BEFORE, Origin.BASE_PREFIX_AFTER):
            fired.append(Fired(PrefixChange(prefix_to_add=e["add"], prefix_to_remove=e["remove"]), origin))
            continue
        i = int(e["index"])
        if i >= len(candidates) or _described(candidates[i]) != {
            k: e[k] for k in ("type", "source", "target", "scope")
        }:
            raise LoadError(
                f"The load record in {path!r} names transform #{i} ({e['type']} {e['source']} -> {e['target']}), "
                f"which this model's conversion mapping does not have there: it was saved from another model or "
                "another catalog. Build the model the DCP checkpoint was saved from, with the same fusions."
            )
        fired.append(Fired(candidates[i], origin))
    return fired


def _decode_record(model: nn.Module, raw: torch.Tensor, path: str) -> LoadRecord:
    data = json.loads(bytes(raw.tolist()).decode())
    if data.get("version") != _RECORD_VERSION:
        raise LoadError(
            f"The load record in {path!r} has version {data.get('version')!r}; this reads {_RECORD_VERSION}."
        )
    return LoadRecord(
        fired=_decode_fired(model, data["fired"], path),
        source_dtypes={k: getattr(torch, v) for k, v in data["source_dtypes"].items()},
        source_shapes={k: tuple(v) for k, v in data["source_shapes"].items()},
        source_shards={k: int(v) for k, v in data["source_shards"].items()},
        loaded_keys=set(data["loaded_keys"]),
        checkpoint=data["checkpoint"],
    )


# --------------------------------------------------------------------------- save and load


STORAGES = ("dcp", "safetensors")
"""What :func:`save_dcp` writes: DCP's default files (``FileSystemWriter``) or safetensors
(DCP's ``HuggingFaceStorageWriter``, one file per rank, each chunk's offset in its metadata)."""


def save_dcp(model: nn.Module, path: str | os.PathLike[str], *, storage: str = "dcp") -> None:
    """Save ``model``'s runtime state with ``dcp.save``, and its load record.

    Collective: every rank of the model's mesh calls it. Each rank writes the boxes it holds of
    every DTensor (:func:`dcp_state_dict`; nothing is gathered). With ``storage="dcp"`` DCP
    commits by writing its ``.metadata`` last, so a failed save is no checkpoint; the
    ``"safetensors"`` storage writes no commit marker (DCP's own limit) and stores one chunk per
    key per rank, so a DTensor with several boxes on a rank (a ``packed_colwise`` weight under
    plain TP) is refused there.

    Args:
        model: a model loaded (or built) on any mesh, or in one process.
        path: the checkpoint directory.
        storage: one of :data:`STORAGES`.

    Raises:
        ConfigurationError: an unknown ``storage``, a placement DCP cannot store (``Partial``), a
            tensor the safetensors storage cannot hold, or a load record this cannot carry (a
            quantized load), before anything is written, on every rank.
        CheckpointError: DCP failed (on every rank: DCP shares the failure).
    """
    import torch.distributed.checkpoint as dcp

    if storage not in STORAGES:
        raise ConfigurationError(f"save_dcp(storage={storage!r}): choose one of {list(STORAGES)}.")
    state = dcp_state_dict(model)
    record = _encode_record(model)
    if record is not None:
        state[RECORD_KEY] = record
    where = os.fspath(path)
    if storage == "safetensors":
        _check_one_box_per_rank(model)
        writer: Any = dcp.HuggingFaceStorageWriter(where, save_distributed=_distributed())
    else:
        writer = dcp.FileSystemWriter(where)
    with _failures_raised(f"dcp.save to {where!r}"):
        dcp.save(state, storage_writer=writer, planner=_SavePlanner(), no_dist=not _distributed())


def _check_one_box_per_rank(model: nn.Module) -> None:
    """Every DTensor one box on every rank (the same answer on every rank: all coordinates are
    checked, only for DTensors with a ``_StridedShard``, the one placement that makes several)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    from .dtensors import is_dtensor

    for key, t in model.state_dict().items():
        if not is_dtensor(t) or not any(isinstance(p, _StridedShard) for p in t.placements):
            continue
        mesh_shape = tuple(t.device_mesh.mesh.shape)
        for coordinate in itertools.product(*(range(n) for n in mesh_shape)):
            placed = boxes(local_indices(tuple(t.shape), mesh_shape, coordinate, tuple(t.placements)))
            if len(placed) > 1:
                raise ConfigurationError(
                    f"save_dcp(storage='safetensors') cannot store {key!r}: with placements "
                    f"{tuple(t.placements)} the rank at {coordinate} holds {len(placed)} separate boxes of it, "
                    "and DCP's safetensors storage keeps one chunk per key per rank. Use storage='dcp'."
                )


def load_dcp(model: nn.Module, path: str | os.PathLike[str], *, device: str | torch.device = "cpu") -> None:
    """Fill ``model`` (parallelized on any mesh, or in one process) from a DCP checkpoint.

    Collective: every rank of the model's mesh calls it. Each rank reads only the parts of the
    stored chunks that overlap its own boxes. A model on ``meta`` is allocated on ``device``
    first (its real buffers kept). The load record saved with the checkpoint becomes the
    model's, so :func:`surgery.save_checkpoint` writes the layout the model was first loaded from.

    Args:
        model: the target model, its parameters placed on the target mesh.
        path: a directory :func:`save_dcp` wrote (``dcp.save`` of :func:`dcp_state_dict`), in
            either storage (DCP's ``.metadata`` says which).
        device: where a model on ``meta`` is allocated.

    Raises:
        CheckpointError: ``path`` is not a DCP checkpoint.
        LoadError: a key the model has is not stored, a stored key the model does not have, or
            a key stored with another shape or dtype, naming it. Every rank decides from the
            same metadata and the same model, so every rank raises it, before any collective.
            Also a stored load record naming a transform this model's mapping does not have
            (checked before the model's tensors are read into).
    """
    import torch.distributed.checkpoint as dcp

    where = os.fspath(path)
    reader = _reader(where)
    stored = reader.read_metadata().state_dict_metadata
    _check_matches(model, stored, where)  # before the model changes
    record = _read_record(model, stored, where)  # checked before the model changes, too
    _allocate(model, device)
    with _failures_raised(f"dcp.load from {where!r}"):
        dcp.load(
            dcp_state_dict(model), storage_reader=reader, planner=_LoadPlanner(), no_dist=not _distributed()
        )
    update_record(model, load=record)


def _read_record(model: nn.Module, stored: Mapping[str, Any], where: str) -> LoadRecord | None:
    """The load record stored there (``None`` if none), rebuilt for ``model``: a DCP load of its one key."""
    import torch.distributed.checkpoint as dcp

    md = stored.get(RECORD_KEY)
    if not isinstance(md, TensorStorageMetadata):
        return None
    raw = {RECORD_KEY: torch.empty(tuple(md.size), dtype=torch.uint8)}
    with _failures_raised(f"dcp.load of the load record from {where!r}"):
        dcp.load(raw, storage_reader=_reader(where), no_dist=not _distributed())
    return _decode_record(model, raw[RECORD_KEY], where)


def _reader(where: str) -> Any:
    """DCP's reader for what :func:`save_dcp` wrote there: its ``.metadata``, else safetensors."""
    import torch.distributed.checkpoint as dcp

    if (Path(where) / ".metadata").is_file():
        return dcp.FileSystemReader(where)
    if Path(where).is_dir() and any(Path(where).glob("*.safetensors")):
        return dcp.HuggingFaceStorageReader(where)
    raise CheckpointError(
        f"{where!r} is not a DCP checkpoint (no .metadata, no safetensors files): write one with save_dcp."
    )


def _distributed() -> bool:
    """Whether a process group is up (without one, DCP reads and writes in this process alone)."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


@contextlib.contextmanager
def _failures_raised(what: str) -> Iterator[None]:
    """DCP's own error (raised on every rank, a ``BaseException``) as a :class:`CheckpointError`."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process is what we asked for, not DCP's guess
            warnings.filterwarnings(
                "ignore", message="torch.distributed is disabled, unavailable or uninitialized"
            )
            yield
    except CheckpointException as exc:
        rank, cause = next(iter(exc.failures.items()), (None, exc))
        raise CheckpointError(
            f"{what} failed on rank(s) {sorted(exc.failures)}; rank {rank}: {type(cause).__name__}: {cause}"
        ) from exc


def _check_matches(model: nn.Module, stored: Mapping[str, Any], where: str) -> None:
    """Every key of the model stored with its shape and dtype, and nothing else stored."""
    ours = model.state_dict()
    missing = sorted(set(ours) - set(stored))
    unexpected = sorted(set(stored) - set(ours) - {RECORD_KEY})
    if missing or unexpected:
        raise LoadError(
            f"The DCP checkpoint {where!r} does not match the model: "
            + "; ".join(
                part
                for part in (
                    f"missing {missing[:5]}{' ...' if len(missing) > 5 else ''}" if missing else "",
                    f"unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}"
                    if unexpected
                    else "",
                )
                if part
            )
            + ". Load it into the model class (and fusions) it was saved from."
        )
    for key, value in ours.items():
        md = stored[key]
        if not isinstance(md, TensorStorageMetadata):
            raise LoadError(f"{key!r} is stored in {where!r} as bytes, not as a tensor.")
        if tuple(md.size) != tuple(value.shape) or md.properties.dtype != value.dtype:
            raise LoadError(
                f"{key!r} is stored in {where!r} as {tuple(md.size)} {md.properties.dtype}, but the model "
                f"has {tuple(value.shape)} {value.dtype}. Build the model with the config (and dtype) it was "
                "saved from."
            )


def _allocate(model: nn.Module, device: str | torch.device) -> None:
    """Give a model on ``meta`` storage on ``device``; buffers that had values keep them."""
    if not any(t.is_meta for t in (*model.parameters(), *model.buffers())):
        return
    kept = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    model.to_empty(device=device)
    with torch.no_grad():
        for name, value in kept.items():
            model.get_buffer(name).copy_(value)
