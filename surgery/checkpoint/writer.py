"""Writing checkpoints: sharded, streaming and atomic.

:func:`write_checkpoint` writes safetensors files one tensor at a time (optionally from a lazy
mapping described by ``specs``, so at most one value is alive at once), shards them by
``max_shard_size`` with a ``model.safetensors.index.json``, and commits atomically: every file
goes to a temporary name in the target directory, is fsynced and renamed into place, and files
of a previous checkpoint are removed only once the new one is complete. A failed save (an
exception, Ctrl-C) undoes its renames and removes its temporary files before it raises.

:func:`write_checkpoint` is :func:`plan_files` (every file planned from the keys and specs),
:func:`stage_file` per file (under a temporary name) and :func:`commit_files`, inside
:func:`staging` (which removes the staged files on failure); a distributed save runs the same
steps with the files staged by different ranks (:mod:`surgery.save.distributed`).

The files keep the names transformers gives them; one rename is the commit point, and a save
killed at any moment (SIGKILL, OOM) leaves the previous checkpoint or the new one: the protocol,
and the rule by which readers find the previous checkpoint before the commit, are in
:mod:`surgery.checkpoint.commit`. The next save puts back what a killed save moved away and
removes its files. Reading lives in :mod:`surgery.checkpoint.reader`.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
import re
import struct
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..errors import CheckpointError, ConfigurationError
from .commit import commit, recover, save_token, staged_name
from .format import DTYPE_NAMES, PACKED, tensor_memory

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "SHARD_NAME",
    "FilePlan",
    "check_write_arguments",
    "commit_files",
    "create_directory",
    "parse_size",
    "plan_files",
    "remove_directories",
    "stage_file",
    "staging",
    "write_checkpoint",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def parse_size(size: int | str) -> int:
    """Turn ``5GB`` (``5 * 10**9``), ``500MiB`` (``500 * 2**20``) or a positive int into bytes.

    Raises:
        ConfigurationError: anything else (a :class:`~surgery.errors.SurgeryError`).

    Example:
        >>> parse_size("1.5KiB")
        1536
    """
    if isinstance(size, int) and not isinstance(size, bool):
        value = size
    elif isinstance(size, str):
        match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", size)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _SIZE_UNITS:
            raise ConfigurationError(
                f"Cannot parse size {size!r}; write a number of bytes or e.g. '5GB', '500MB', '2GiB'."
            )
        value = int(Decimal(match.group(1)) * _SIZE_UNITS[unit])
    else:
        raise ConfigurationError(f"Size must be an int or a string like '5GB', got {type(size).__name__}.")
    if value <= 0:
        raise ConfigurationError(f"Size {size!r} must be positive.")
    return value


@dataclass(frozen=True, slots=True)
class _Pending:
    """One tensor to write: what its header entry says, and its value when already in hand."""

    key: str
    tensor: torch.Tensor | None  # None: looked up in the state dict while writing (specs)
    dtype: torch.dtype
    dtype_name: str
    shape: tuple[int, ...]  # torch's shape
    header_shape: tuple[int, ...]  # as written in the header (F4 counts values, not bytes)
    nbytes: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


def _check_key(key: object, seen: set[str]) -> None:
    if not isinstance(key, str) or key == "__metadata__":
        raise CheckpointError(f"Cannot save key {key!r}: keys must be strings other than '__metadata__'.")
    if key in seen:
        raise CheckpointError(f"Key {key!r} appears twice in the state dict; every key must be unique.")
    seen.add(key)


def _pending(key: str, tensor: torch.Tensor | None, dtype: torch.dtype, shape: tuple[int, ...]) -> _Pending:
    """The header entry of ``key``; refuses dtypes and shapes safetensors cannot hold."""
    name = DTYPE_NAMES.get(dtype)
    if name is None:
        raise CheckpointError(
            f"Cannot save {key!r}: dtype {dtype} has no safetensors equivalent; convert it to one "
            f"of {', '.join(str(d) for d in DTYPE_NAMES)}."
        )
    header_shape = shape
    pack = PACKED.get(name, 1)
    if pack > 1:
        if not shape:
            raise CheckpointError(f"Cannot save 0-dim {dtype} tensor {key!r}; give it one dimension.")
        header_shape = (*shape[:-1], shape[-1] * pack)
    return _Pending(key, tensor, dtype, name, shape, header_shape, math.prod(shape) * dtype.itemsize)


def _refuse_non_mapping(state_dict: object) -> None:
    if not isinstance(state_dict, Mapping):
        raise CheckpointError(
            f"write_checkpoint expects a Mapping[str, Tensor], got {type(state_dict).__name__}."
        )


def _check_tensor(key: str, tensor: object) -> torch.Tensor:
    """``tensor`` if it is a tensor whose bytes can be saved, else a :class:`CheckpointError`."""
    if not isinstance(tensor, torch.Tensor):
        raise CheckpointError(f"Cannot save {key!r}: expected a torch.Tensor, got {type(tensor).__name__}.")
    if tensor.layout != torch.strided:
        raise CheckpointError(f"Cannot save {key!r}: it is a {tensor.layout} tensor; call .to_dense() first.")
    if tensor.device.type == "meta":
        raise CheckpointError(
            f"Cannot save {key!r}: it is on the meta device and has no data; materialize it."
        )
    return tensor


def _collect(state_dict: Mapping[str, torch.Tensor]) -> list[_Pending]:
    """Validate every key and tensor before a byte is written."""
    _refuse_non_mapping(state_dict)
    pending: list[_Pending] = []
    seen: set[str] = set()
    for key in state_dict:
        _check_key(key, seen)
        tensor = _check_tensor(key, state_dict[key])
        pending.append(_pending(key, tensor, tensor.dtype, tuple(tensor.shape)))
    _check_aliasing(pending)
    return pending


def _collect_specs(
    state_dict: Mapping[str, torch.Tensor], specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]]
) -> list[_Pending]:
    """Validate every key and spec before a byte is written, without looking up a single value."""
    _refuse_non_mapping(state_dict)
    if not isinstance(specs, Mapping):
        raise CheckpointError(
            f"write_checkpoint(specs=...) expects a Mapping[str, (shape, dtype)], got {type(specs).__name__}."
        )
    pending: list[_Pending] = []
    seen: set[str] = set()
    for key, spec in specs.items():
        _check_key(key, seen)
        shape, dtype = spec if isinstance(spec, tuple) and len(spec) == 2 else (None, None)
        valid_shape = isinstance(shape, (tuple, list, torch.Size)) and all(
            isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape
        )
        if not valid_shape or not isinstance(dtype, torch.dtype):
            raise CheckpointError(
                f"specs[{key!r}] is {spec!r}; expected (shape, dtype), e.g. ((4, 2), torch.float32)."
            )
        pending.append(_pending(key, None, dtype, tuple(shape)))
    unspecified = [k for k in state_dict if k not in seen]
    if unspecified or len(seen) != len(state_dict):
        missing = sorted(seen.difference(state_dict))
        raise CheckpointError(
            f"specs and the state dict disagree on the keys: no spec for {unspecified[:5]}, no value for "
            f"{missing[:5]}. Pass one (shape, dtype) per key of the state dict, and nothing else."
        )
    return pending


def _fetch(state_dict: Mapping[str, torch.Tensor], p: _Pending) -> torch.Tensor:
    """Look up ``p``'s value and check it against its spec."""
    tensor = _check_tensor(p.key, state_dict[p.key])
    if tensor.dtype != p.dtype or tuple(tensor.shape) != p.shape:
        raise CheckpointError(
            f"Cannot save {p.key!r}: its value has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, but "
            f"specs promised shape {p.shape} and dtype {p.dtype}. Make the specs describe the values exactly; "
            "the previous checkpoint (if any) is unchanged."
        )
    return tensor


def _check_aliasing(pending: list[_Pending]) -> None:
    """Refuse two keys whose tensors share bytes (tied weights): they would be saved twice."""
    spans = []
    for p in pending:
        t = p.tensor
        if t is None or t.numel() == 0:
            continue
        extent = 1 + sum((size - 1) * step for size, step in zip(t.shape, t.stride()))
        start = t.data_ptr()
        spans.append((str(t.device), start, start + extent * t.element_size(), p.key))
    spans.sort()
    for (dev_a, _, end_a, key_a), (dev_b, start_b, _, key_b) in itertools.pairwise(spans):
        if dev_a == dev_b and start_b < end_a:
            raise CheckpointError(
                f"Tensors {key_a!r} and {key_b!r} share memory (tied or aliased weights). Saving both would "
                "duplicate them on disk and untie them on load; drop one of the keys before saving (or .clone() "
                "one, if they are distinct views of one buffer)."
            )


def _header(pending: list[_Pending], metadata: dict[str, str]) -> tuple[bytes, dict[str, int]]:
    """The encoded header, and each key's data offset from the start of the file, in data order."""
    # Largest elements first, so every tensor starts at a multiple of its element size
    # (the header is padded to 8): zero-copy views are then always aligned.
    ordered = sorted(pending, key=lambda p: (-p.dtype.itemsize, p.key))
    header: dict[str, Any] = {"__metadata__": metadata}
    offsets: dict[str, int] = {}
    offset = 0
    for p in ordered:
        header[p.key] = {
            "dtype": p.dtype_name,
            "shape": list(p.header_shape),
            "data_offsets": [offset, offset + p.nbytes],
        }
        offsets[p.key] = offset
        offset += p.nbytes
    blob = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    blob += b" " * (-len(blob) % 8)
    head = struct.pack("<Q", len(blob)) + blob
    return head, {key: len(head) + begin for key, begin in offsets.items()}


def _write_tensor(f: BinaryIO, offset: int, tensor: torch.Tensor) -> None:
    """Write ``tensor``'s bytes at ``offset`` (a CPU copy and a contiguous copy only when needed)."""
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.to("cpu")
    data = data.contiguous()  # a copy only for strided views: one tensor at a time
    if f.tell() != offset:
        f.seek(offset)
    f.write(tensor_memory(data, writable=False))


def _write_file(
    target: Path,
    pending: list[_Pending],
    metadata: dict[str, str],
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write one safetensors file, one tensor at a time, and fsync it.

    Tensors in hand are written in data order. Without them (``state_dict`` given), each value
    is looked up in ``pending`` order, checked, written at its offset and dropped before the
    next lookup, so only one value is ever alive.
    """
    head, offsets = _header(pending, metadata)
    with open(target, "xb") as f:
        f.write(head)
        if state_dict is None:
            for p in sorted(pending, key=lambda p: offsets[p.key]):
                if p.tensor is not None and p.nbytes:
                    _write_tensor(f, offsets[p.key], p.tensor)
        else:
            for p in pending:
                value = _fetch(state_dict, p)
                if p.nbytes:
                    _write_tensor(f, offsets[p.key], value)
                del value  # before the next lookup computes the next value
        f.flush()
        os.fsync(f.fileno())


def _previous_shards(directory: Path) -> set[str]:
    """Shard files of a previous save in ``directory``: only names this writer gives its shards.

    The previous index is not consulted: it may name any file (``tokenizer.json``), and a save
    never deletes a file it would not have written. Shards a previous index named otherwise stay
    on disk, unreferenced by the new index.
    """
    return {p.name for p in directory.iterdir() if SHARD_NAME.fullmatch(p.name)}


def _plan_shards(pending: list[_Pending], limit: int) -> list[list[_Pending]]:
    shards: list[list[_Pending]] = [[]]
    size = 0
    for p in pending:
        if shards[-1] and size + p.nbytes > limit:
            shards.append([])
            size = 0
        shards[-1].append(p)
        size += p.nbytes
    return shards


def _write_index(target: Path, shards: list[list[_Pending]], names: list[str]) -> None:
    pending = [p for shard in shards for p in shard]
    weight_map = {p.key: name for shard, name in zip(shards, names) for p in shard}
    index = {
        "metadata": {
            "total_size": sum(p.nbytes for p in pending),
            "total_parameters": sum(p.numel for p in pending),
        },
        "weight_map": dict(sorted(weight_map.items())),
    }
    with open(target, "x", encoding="utf-8") as f:
        json.dump(index, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _file_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """The metadata every file gets: ``{"format": "pt"}`` and ``metadata``, checked str -> str."""
    meta = {"format": "pt"}
    for k, v in (metadata or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise CheckpointError(
                f"Metadata entry {k!r}: {v!r} is not str -> str; convert it (e.g. json.dumps)."
            )
        if k == "format" and v != "pt":
            raise CheckpointError(
                f"Metadata 'format' is always 'pt' for torch checkpoints, not {v!r}; drop it."
            )
        meta[k] = v
    return meta


def _check_target(target: Path) -> None:
    """Refuse a path that cannot become a checkpoint: a file where a directory goes, or the reverse,
    an ancestor that is a file, or a directory this process may not write into."""
    single_file = target.suffix == ".safetensors"
    if single_file and target.is_dir():
        raise CheckpointError(
            f"'{target}' is a directory; pass the directory without the .safetensors suffix."
        )
    if not single_file and target.exists() and not target.is_dir():
        raise CheckpointError(
            f"'{target}' exists and is not a directory; pass a directory or a .safetensors path."
        )
    directory = target.parent if single_file else target
    existing = next((d for d in (directory, *directory.parents) if d.exists()), None)
    if existing is None:  # pragma: no cover - the root exists
        return
    if not existing.is_dir():
        raise CheckpointError(
            f"Cannot save to '{target}': '{existing}' is a file, so '{directory}' cannot be created; pass a "
            "path under a directory."
        )
    if not os.access(existing, os.W_OK | os.X_OK):
        raise CheckpointError(
            f"Cannot save to '{target}': this process may not write into '{existing}'; pass a writable "
            "directory or fix its permissions."
        )


def check_write_arguments(
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Check what :func:`write_checkpoint` checks of its arguments, without touching the disk.

    For a caller that must know before it starts (every rank of a collective save checks its
    arguments before the first collective, so none of them waits on a rank that refused them).

    Raises:
        CheckpointError: ``path`` is a file where a directory goes (or the reverse), lies under a
            file, or is not writable; or ``metadata`` is not ``str -> str``.
        ConfigurationError: ``max_shard_size`` is not a size.

    Example:
        >>> check_write_arguments("out/", max_shard_size="2GB")
    """
    parse_size(max_shard_size)
    _file_metadata(metadata)
    _check_target(Path(path))


def write_checkpoint(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> list[Path]:
    """Save tensors as safetensors, atomically, streaming one tensor at a time.

    A path ending in ``.safetensors`` gets one file (never sharded). Any other path is a
    directory: ``model.safetensors`` when everything fits in ``max_shard_size``, else shards
    ``model-00001-of-0000N.safetensors`` (in state-dict order) plus
    ``model.safetensors.index.json``. Every file is written to a temporary name, fsynced and
    renamed into place; files of a previous checkpoint that the new one does not use (other
    shards, a single file replaced by shards, or the reverse) are removed only once the new
    checkpoint is complete. If anything fails (or Ctrl-C arrives) before that, every rename is
    undone and every temporary and backup file removed, so the directory is as it was. A process
    killed at any moment leaves the previous checkpoint or the new one loadable
    (:mod:`surgery.checkpoint.commit`); the next save removes what it left.

    With ``specs``, ``state_dict`` may compute its values lazily (like
    :class:`~surgery.save.RevertedState`): shards, headers and the index are planned from
    ``specs`` alone, then each value is looked up once, in ``specs`` order, checked against its
    spec, written and dropped before the next lookup, so at most one value is alive at a time.
    The files are byte-identical to a save of the same tensors without ``specs``.

    Args:
        state_dict: checkpoint key -> tensor. Tensors on other devices are copied to CPU and
            strided views made contiguous, one tensor at a time; tensors that share memory are
            refused (drop the tied duplicate first).
        path: a directory, or a file path ending in ``.safetensors``.
        max_shard_size: bytes of tensor data per shard (``"5GB"``, ``"500MiB"``, an int).
        metadata: extra string metadata stored in every file next to ``{"format": "pt"}``.
        specs: checkpoint key -> ``(shape, dtype)`` of its value, for exactly the keys of
            ``state_dict``; its order is the write (and sharding) order. Values are then not
            checked for shared memory (they are never held together).

    Returns:
        The files written: tensor files in order, then the index if there is one.

    Raises:
        CheckpointError: a bad key, tensor, spec or metadata (raised before anything is written),
            a value that does not match its spec (the previous checkpoint is then unchanged), or an
            I/O failure. If the failure also prevents undoing the commit (the file system refuses
            renames), the previous checkpoint stays in the hidden ``.old``/``.bak`` files the
            message names: it still loads, and the next save puts it back.

    Example:
        >>> write_checkpoint({"w": torch.ones(2)}, tmp_dir, max_shard_size="1GB")  # doctest: +SKIP
    """
    plan = plan_files(state_dict, path, max_shard_size=max_shard_size, metadata=metadata, specs=specs)
    lazy = None if specs is None else state_dict
    with save_token() as token, staging(plan) as staged:
        recover(plan.directory, (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME))
        for i in range(len(plan.names)):
            stage_file(plan, i, token, staged, lazy)
        commit_files(plan, staged, token)
    return plan.written()


@dataclass(frozen=True)
class FilePlan:
    """What a save writes, planned before a byte is: each file's name and keys, the index, the stale files.

    Made by :func:`plan_files` from the keys and specs alone, so every rank of a collective save
    plans the same files; :func:`stage_file` writes one of them under a temporary name and
    :func:`commit_files` puts every staged file in place (the index last: the commit point).
    """

    target: Path
    directory: Path
    names: tuple[str, ...]  # the tensor files, in order
    single_file: bool  # a ``.safetensors`` path: one file, never sharded
    metadata: dict[str, str]
    shards: tuple[tuple[_Pending, ...], ...]

    @property
    def keys(self) -> tuple[tuple[str, ...], ...]:
        """The keys of each file, in the order their values are looked up."""
        return tuple(tuple(p.key for p in shard) for shard in self.shards)

    @property
    def nbytes(self) -> tuple[int, ...]:
        """The tensor bytes of each file."""
        return tuple(sum(p.nbytes for p in shard) for shard in self.shards)

    @property
    def indexed(self) -> bool:
        """Whether an index commits the files (a directory with more than one shard)."""
        return not self.single_file and len(self.shards) > 1

    def written(self) -> list[Path]:
        """The files a committed save wrote: tensor files in order, then the index if there is one."""
        extra = [SAFE_WEIGHTS_INDEX_NAME] if self.indexed else []
        return [self.directory / name for name in [*self.names, *extra]]


def plan_files(
    state_dict: Mapping[str, torch.Tensor],
    path: str | os.PathLike[str],
    *,
    max_shard_size: int | str = "5GB",
    metadata: Mapping[str, str] | None = None,
    specs: Mapping[str, tuple[tuple[int, ...], torch.dtype]] | None = None,
) -> FilePlan:
    """Validate the arguments of :func:`write_checkpoint` and plan its files, without touching the disk.

    Raises:
        CheckpointError, ConfigurationError: what :func:`write_checkpoint` raises before it writes.
    """
    limit = parse_size(max_shard_size)
    meta = _file_metadata(metadata)
    pending = _collect(state_dict) if specs is None else _collect_specs(state_dict, specs)
    target = Path(path)
    single_file = target.suffix == ".safetensors"
    _check_target(target)
    directory = target.parent if single_file else target
    shards = [pending] if single_file else _plan_shards(pending, limit)
    if single_file:
        names = [target.name]
    elif len(shards) == 1:
        names = [SAFE_WEIGHTS_NAME]
    else:
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    return FilePlan(target, directory, tuple(names), single_file, meta, tuple(tuple(s) for s in shards))


def create_directory(plan: FilePlan) -> list[Path]:
    """Create ``plan``'s directory; return the directories this created, innermost first.

    Raises:
        CheckpointError: the directory cannot be created.
    """
    created = [d for d in (plan.directory, *plan.directory.parents) if not d.exists()]
    try:
        plan.directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"Cannot create '{plan.directory}': {exc.strerror or exc}.") from None
    return created


def remove_directories(created: Sequence[Path]) -> None:
    """Remove the directories :func:`create_directory` created, innermost first, each only while empty."""
    for directory in created:
        with contextlib.suppress(OSError):
            directory.rmdir()


@contextlib.contextmanager
def staging(plan: FilePlan, *, create: bool = True) -> Iterator[list[tuple[Path, str]]]:
    """Create the directory (``create``), and on any failure remove every staged file listed and the
    directories created, then raise (an ``OSError`` as a :class:`CheckpointError`).

    Yields the list the caller appends each ``(temporary file, name)`` it stages to.
    """
    created = create_directory(plan) if create else []
    staged: list[tuple[Path, str]] = []
    try:
        yield staged
    except BaseException as exc:
        for temp, _ in staged:
            with contextlib.suppress(OSError):
                temp.unlink()
        remove_directories(created)
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise CheckpointError(
                f"Saving to '{plan.target}' failed: {exc}. The previous checkpoint there (if any) is unchanged; "
                "fix the cause (e.g. free disk space) and save again."
            ) from exc
        raise


def stage_file(
    plan: FilePlan,
    i: int,
    token: str,
    staged: list[tuple[Path, str]],
    state_dict: Mapping[str, torch.Tensor] | None = None,
) -> None:
    """Write file ``i`` of ``plan`` under its temporary name (fsynced), listed in ``staged`` first.

    ``staged`` gets ``(temporary file, name)`` before a byte is written, so a failure midway
    leaves nothing :func:`staging` does not remove. ``state_dict``: where values are looked up,
    one at a time in the plan's order (a lazy mapping); ``None`` when the plan holds the tensors
    (planned without ``specs``).
    """
    name = plan.names[i]
    temp = plan.directory / staged_name(name, token, "tmp")
    staged.append((temp, name))
    _write_file(temp, list(plan.shards[i]), plan.metadata, state_dict)


def commit_files(plan: FilePlan, staged: list[tuple[Path, str]], token: str) -> None:
    """Write the index (if any) and commit every staged tensor file of ``plan``, in order.

    ``staged``: the ``(temporary file, name)`` of every file of ``plan``, in the plan's order
    (they may have been written by other processes); the index's is appended to it.
    """
    stale: list[str] = []
    hide: tuple[str, ...] = ()
    if not plan.single_file:
        old = _previous_shards(plan.directory) - set(plan.names)
        if plan.indexed:
            temp = plan.directory / staged_name(SAFE_WEIGHTS_INDEX_NAME, token, "tmp")
            staged.append((temp, SAFE_WEIGHTS_INDEX_NAME))
            _write_index(temp, list(map(list, plan.shards)), list(plan.names))
            # The index is renamed last: the commit point. Until then the previous entry
            # points are moved away (a single file would win over the index).
            hide = (SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME)
            stale = sorted(old)
        else:
            stale = [SAFE_WEIGHTS_INDEX_NAME, *sorted(old)]
    commit(plan.directory, staged, stale, token=token, hide=hide)
