"""Reading checkpoints: single files, sharded checkpoints, and pickle files only on request.

:func:`open_checkpoint` accepts a ``.safetensors`` file, a directory holding ``model.safetensors``,
or a sharded checkpoint described by ``model.safetensors.index.json``. Every header (and the
index) is parsed and validated up front, before a single tensor byte is read; tensors are then
read on demand, one key at a time, with our own reader over the file
(:mod:`surgery.checkpoint.format`):

* ``get_tensor(key, copy=False)``: a zero-copy view over a private copy-on-write ``mmap`` of the
  file (writing to it never touches the file);
* ``get_tensor(key)`` / ``read_into(key, out)``: an owned copy, read with ``os.preadv`` straight
  into the destination tensor's memory (no intermediate buffer, no shared file position, so any
  number of threads may read at once);
* ``get_slice(key, dim, start, stop)``: only the bytes of one slice, for tensor parallelism.

Pickle checkpoints (``.bin``, ``.pt``, ...) are refused unless the caller opts in with
``allow_pickle=True``; they are then loaded with ``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import contextlib
import difflib
import json
import math
import os
import re
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import torch

from ..errors import CheckpointError
from .commit import LEFTOVER_NAME, Interrupted, interrupted_save, save_in_progress
from .format import SafetensorsFile, StoredTensor, unique_pairs
from .writer import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

__all__ = ["CheckpointReader", "open_checkpoint"]

_PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
_PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt"})
_MAX_INDEX_BYTES = 100_000_000  # like the safetensors header: read whole, so bounded
_OPEN_ATTEMPTS = 20  # while a save into the directory is in progress, opening is retried
_RETRY_SECONDS = 0.05  # the longest wait between two attempts; the first ones wait 1, 2, 4 ... ms


class _IndexChanged(Exception):
    """The index was replaced while its shards were being opened (a save committed meanwhile)."""


_NUMBERED = re.compile(r"(.+)-\d{5}-of-(\d{5})(\.\w+)")
_ENTRY_POINTS = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME)  # the same precedence as transformers


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


class _PickleFile:
    """A pickle checkpoint loaded with ``torch.load(weights_only=True, mmap=True)``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            loaded = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as exc:
            raise CheckpointError(
                f"Cannot load pickle checkpoint '{path}' safely: {_unpickling_reason(exc)}. Only plain "
                "tensor state dicts saved by torch.save (zip format) load with weights_only=True; convert "
                "the file to safetensors."
            ) from None
        if not isinstance(loaded, Mapping):
            raise CheckpointError(
                f"Pickle checkpoint '{path}' holds a {type(loaded).__name__}, not a state dict; save "
                "model.state_dict() instead."
            )
        self.tensors: dict[str, torch.Tensor] = {}
        for key, value in loaded.items():
            if not isinstance(key, str) or not isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"Pickle checkpoint '{path}' maps {key!r} to a {type(value).__name__}; only a flat "
                    "{str: Tensor} state dict can be read. Flatten it before saving."
                )
            self.tensors[key] = value
        self.metadata: dict[str, str] = {}
        self.infos = {
            k: StoredTensor(k, t.dtype, tuple(t.shape), path, -1, t.numel() * t.element_size())
            for k, t in self.tensors.items()
        }

    def close(self) -> None:
        self.tensors = {}


_File = SafetensorsFile | _PickleFile


def _unpickling_reason(exc: Exception) -> str:
    """What ``torch.load(weights_only=True)`` refused, without its advice to lift the check.

    torch's message suggests retrying with ``weights_only=False`` or allow-listing the global,
    both of which run code from the file; for a file that just tried to smuggle a callable in,
    that advice must not be relayed. Only the name of what was refused is kept.
    """
    refused = _REFUSED_GLOBAL.search(str(exc))
    if refused:
        return f"it references {refused.group(1).rstrip('.')!r}, which weights_only=True does not run"
    return f"it holds objects other than tensors and plain containers ({type(exc).__name__})"


_REFUSED_GLOBAL = re.compile(r"(?i)unsupported global:?\s*(?:GLOBAL\s+)?(\S+)")


class CheckpointReader:
    """Lazy, thread-safe access to the tensors of one checkpoint (see :func:`open_checkpoint`).

    Attributes:
        path: the path the checkpoint was opened from (as given).
        index: the index file of a sharded checkpoint, else ``None``.
        files: the tensor files, in shard order.
        metadata: merged string metadata: every file's ``__metadata__`` (the first file wins on
            conflicts), then the index's ``metadata`` (values turned into strings) for keys not yet set.
        index_metadata: the index's ``metadata`` object as stored (empty without an index).
    """

    def __init__(
        self,
        path: Path,
        files: list[_File],
        *,
        index: Path | None = None,
        index_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.index = index
        self._files = files
        self.files = [f.path for f in files]
        self.index_metadata = dict(index_metadata or {})
        self._where: dict[str, tuple[StoredTensor, _File]] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            for info in f.infos.values():
                self._where[info.key] = (info, f)
            for k, v in f.metadata.items():
                self.metadata.setdefault(k, v)
        for k, v in self.index_metadata.items():
            self.metadata.setdefault(k, v if isinstance(v, str) else json.dumps(v))
        self._closed = False
        self._bytes_read = 0
        self._count_lock = threading.Lock()

    @property
    def bytes_read(self) -> int:
        """Bytes of tensor data this reader has handed out (read, or mapped), from every thread."""
        return self._bytes_read

    def record_read(self, nbytes: int) -> None:
        """Add ``nbytes`` to :attr:`bytes_read` (for callers that read through :meth:`locate`)."""
        self._count(nbytes)

    def _count(self, nbytes: int) -> None:
        with self._count_lock:
            self._bytes_read += nbytes

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} tensors in {len(self.files)} file(s)"
        return f"CheckpointReader('{self.path}', {state})"

    def keys(self) -> list[str]:
        """Checkpoint keys in file order: shard order, then data offset within each shard."""
        return list(self._where)

    def __iter__(self) -> Iterator[str]:
        return iter(self._where)

    def __contains__(self, key: object) -> bool:
        return key in self._where

    def __len__(self) -> int:
        return len(self._where)

    def locate(self, key: str) -> tuple[StoredTensor, _File]:
        """The header entry of ``key`` and the open file that holds it.

        Raises:
            CheckpointError: the key is not stored (the message lists close matches), or the
                reader is closed.
        """
        if self._closed:
            raise CheckpointError(f"The checkpoint reader for '{self.path}' is closed; open it again.")
        try:
            return self._where[key]
        except (KeyError, TypeError):
            close = difflib.get_close_matches(str(key), list(self._where), n=3)
            hint = f" Close matches: {close}." if close else ""
            raise CheckpointError(
                f"Key {key!r} is not in checkpoint '{self.path}' ({len(self)} tensors).{hint} Check the "
                "spelling, or list the stored keys with reader.keys()."
            ) from None

    def info(self, key: str) -> StoredTensor:
        """Where ``key`` is stored, its dtype and shape; reads no tensor data.

        Raises:
            CheckpointError: ``key`` is not in the checkpoint (the message lists close matches).
        """
        return self.locate(key)[0]

    def get_tensor(self, key: str, *, copy: bool = True) -> torch.Tensor:
        """Read one tensor.

        Args:
            key: the checkpoint key.
            copy: ``True`` (default) returns a fresh tensor that owns its memory. ``False`` returns a
                zero-copy view over a private copy-on-write mapping of the file: pages are read on
                first touch, and writing to the view never changes the file (the view is an owned
                copy only if the stored data is misaligned for its dtype, which safetensors writers
                never produce).

        Returns:
            A CPU tensor with the stored dtype and shape.

        Example:
            >>> with open_checkpoint("ckpt/") as reader:  # doctest: +SKIP
            ...     w = reader.get_tensor("lm_head.weight", copy=False)
        """
        info, source = self.locate(key)
        self._count(info.nbytes)
        if isinstance(source, _PickleFile):
            tensor = source.tensors[key]
            return tensor.clone(memory_format=torch.contiguous_format) if copy else tensor
        if not copy and info.offset % info.dtype.itemsize == 0:
            return source.view(info.offset, info.nbytes, info.dtype, info.shape)
        out = torch.empty(info.shape, dtype=info.dtype)
        source.read_into(info.offset, out, key)
        return out

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        """Read ``key`` into the existing tensor ``out`` and return ``out``.

        ``out`` must have the stored dtype and shape. A contiguous CPU ``out`` is filled straight
        from the file (``os.preadv`` into its memory: one copy, no intermediate buffer, safe from
        any number of threads); any other ``out`` (strided, or on an accelerator) is filled with
        one ``copy_`` from the zero-copy file mapping.

        Raises:
            CheckpointError: ``out`` has another dtype or shape, or cannot hold data (meta, sparse).

        Example:
            >>> reader.read_into("lm_head.weight", model.lm_head.weight.data)  # doctest: +SKIP
        """
        info, source = self.locate(key)
        if not isinstance(out, torch.Tensor):
            raise CheckpointError(
                f"read_into({key!r}, out): out must be a torch.Tensor, got {type(out).__name__}."
            )
        problems = []
        if out.device.type == "meta" or out.layout != torch.strided:
            problems.append(f"it is a {out.layout} tensor on {out.device}, which holds no dense data")
        if out.dtype != info.dtype:
            problems.append(f"its dtype is {out.dtype}, the stored one is {info.dtype}")
        if tuple(out.shape) != info.shape:
            problems.append(f"its shape is {tuple(out.shape)}, the stored one is {info.shape}")
        if problems:
            raise CheckpointError(
                f"Cannot read {key!r} from '{info.file}' into the given tensor: {'; '.join(problems)}. "
                f"Pass torch.empty({info.shape}, dtype={info.dtype}), or use get_tensor() and convert."
            )
        if isinstance(source, _PickleFile):
            self._count(info.nbytes)
            out.copy_(source.tensors[key])
        elif out.device.type == "cpu" and out.is_contiguous():
            self._count(info.nbytes)
            source.read_into(info.offset, out, key)
        else:
            out.copy_(self.get_tensor(key, copy=False))
        return out

    def get_slice(self, key: str, dim: int, start: int, stop: int, *, copy: bool = True) -> torch.Tensor:
        """Read ``tensor[..., start:stop, ...]`` along ``dim`` without reading the rest.

        When every dimension before ``dim`` has size 1 (always true for ``dim=0``) the slice is one
        contiguous byte range and only those bytes are read. Otherwise the slice is gathered from
        the file mapping, which touches only the pages that hold it.

        Args:
            key: the checkpoint key.
            dim: the dimension to slice (negative counts from the end).
            start: first index, ``0 <= start <= stop``.
            stop: one past the last index, ``stop <= size of dim``.
            copy: ``False`` returns a (possibly non-contiguous) view over the private mapping.

        Raises:
            CheckpointError: the key is missing, the tensor is 0-dim, or the range is out of bounds.
        """
        info, source = self.locate(key)
        ndim = len(info.shape)
        valid_dim = type(dim) is int and -ndim <= dim < ndim
        if not valid_dim or type(start) is not int or type(stop) is not int:
            raise CheckpointError(
                f"get_slice({key!r}, dim={dim!r}, start={start!r}, stop={stop!r}): tensor of shape "
                f"{info.shape} has no such dimension or the bounds are not ints; use -{ndim} <= dim < {ndim}."
            )
        dim %= ndim
        if not 0 <= start <= stop <= info.shape[dim]:
            raise CheckpointError(
                f"get_slice({key!r}, dim={dim}, start={start}, stop={stop}) is out of bounds for shape "
                f"{info.shape}; need 0 <= start <= stop <= {info.shape[dim]}."
            )
        shape = (*info.shape[:dim], stop - start, *info.shape[dim + 1 :])
        self._count(math.prod(shape) * info.dtype.itemsize)
        if isinstance(source, _PickleFile):
            part = source.tensors[key].narrow(dim, start, stop - start)
            return part.clone(memory_format=torch.contiguous_format) if copy else part
        if all(size == 1 for size in info.shape[:dim]):
            row = math.prod(info.shape[dim + 1 :]) * info.dtype.itemsize
            offset = info.offset + start * row
            if not copy and offset % info.dtype.itemsize == 0:
                return source.view(offset, (stop - start) * row, info.dtype, shape)
            out = torch.empty(shape, dtype=info.dtype)
            source.read_into(offset, out, key)
            return out
        whole = source.view(info.offset, info.nbytes, info.dtype, info.shape).narrow(dim, start, stop - start)
        return whole.clone(memory_format=torch.contiguous_format) if copy else whole

    def read_region(
        self,
        key: str,
        dim: int,
        intervals: Sequence[tuple[int, int]],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Read the half-open ``intervals`` of ``dim``, concatenated along ``dim``, and nothing else.

        Generalizes :meth:`get_slice` to several intervals (a packed tensor-parallel shard holds
        one per part) and to reading straight into ``out``. When every dim before ``dim`` has size
        1 (always for ``dim=0``) each interval is one contiguous byte range, read with one
        ``preadv``; on a later dim the region is copied out of a mapping of that tensor's pages
        that lives only for the copy (faster than one ``preadv`` per row run, see
        docs/benchmarks.md; and the touched pages leave the process with the mapping).

        Args:
            key: the checkpoint key.
            dim: the dimension (negative counts from the end).
            intervals: sorted, disjoint ``(start, stop)`` pairs within the dim.
            out: a tensor of the stored dtype and the region's shape to fill (default: a new one).

        Raises:
            CheckpointError: the key is missing, the dim or intervals are out of bounds or
                unsorted, or ``out`` does not fit.
        """
        info, source = self.locate(key)
        ndim = len(info.shape)
        spans: list[tuple[int, int]] = [tuple(iv) for iv in intervals]  # type: ignore[misc]
        if not (type(dim) is int and -ndim <= dim < ndim):
            raise CheckpointError(
                f"read_region({key!r}, dim={dim!r}): tensor of shape {info.shape} has no such dim; use -{ndim} <= dim < {ndim}."
            )
        dim %= ndim
        size = info.shape[dim]
        previous = 0
        for iv in spans:
            if len(iv) != 2 or not all(type(x) is int for x in iv) or not previous <= iv[0] <= iv[1] <= size:
                raise CheckpointError(
                    f"read_region({key!r}, dim={dim}, intervals={list(intervals)}): intervals must be sorted, "
                    f"disjoint (start, stop) int pairs within 0..{size} (shape {info.shape})."
                )
            previous = iv[1]
        local = sum(b - a for a, b in spans)
        shape = (*info.shape[:dim], local, *info.shape[dim + 1 :])
        if out is None:
            out = torch.empty(shape, dtype=info.dtype)
        elif tuple(out.shape) != shape or out.dtype != info.dtype or out.device.type == "meta":
            raise CheckpointError(
                f"read_region({key!r}): out is {tuple(out.shape)} {out.dtype} on {out.device}; the region needs "
                f"torch.empty({shape}, dtype={info.dtype})."
            )
        self._count(math.prod(shape) * info.dtype.itemsize)
        leading = all(n == 1 for n in info.shape[:dim])
        if (
            isinstance(source, SafetensorsFile)
            and not leading
            and out.is_contiguous()
            and out.device.type == "cpu"
        ):
            source.gather_into(info.offset, info.shape, info.dtype, dim, spans, out)
            return out
        if (
            isinstance(source, _PickleFile)
            or not leading
            or out.device.type != "cpu"
            or not out.is_contiguous()
        ):
            whole = (
                source.tensors[key]
                if isinstance(source, _PickleFile)
                else source.view(info.offset, info.nbytes, info.dtype, info.shape)
            )
            pos = 0
            for a, b in spans:
                out.narrow(dim, pos, b - a).copy_(whole.narrow(dim, a, b - a))
                pos += b - a
            return out
        row = math.prod(info.shape[dim + 1 :]) * info.dtype.itemsize
        pos = 0
        for a, b in spans:
            source.read_into(info.offset + a * row, out.narrow(dim, pos, b - a), key)
            pos += b - a
        return out

    def close(self) -> None:
        """Release file handles and mappings. Zero-copy views already returned stay valid."""
        self._closed = True
        for f in self._files:
            f.close()


def _refuse_pickle(path: Path) -> CheckpointError:
    return CheckpointError(
        f"'{path}' is a pickle checkpoint; unpickling can run arbitrary code, so it is refused by "
        "default. Convert it to safetensors, or, if you trust its source, pass allow_pickle=True (on the "
        "command line: --allow-pickle); it is then loaded with torch.load(weights_only=True, mmap=True)."
    )


def _open_file(path: Path, *, allow_pickle: bool) -> _File:
    if path.suffix in _PICKLE_SUFFIXES:
        if not allow_pickle:
            raise _refuse_pickle(path)
        return _PickleFile(path)
    return SafetensorsFile(path)


def _index_error(index: Path, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"Invalid checkpoint index '{index}': {problem}. {fix}")


def _shard_path(index: Path, name: object, key: str, interrupted: Interrupted | None = None) -> Path:
    """Resolve one weight_map entry, refusing anything that leaves the index's directory.

    With ``interrupted``, the index is the previous one of a save that has not committed: a shard
    that save replaced is read from its backup.
    """
    directory = index.parent
    if not isinstance(name, str) or not name:
        raise _index_error(
            index, f"key {key!r} maps to {name!r}, not a file name", "Fix the weight_map entry."
        )
    relative = Path(name)
    if relative.is_absolute() or ".." in relative.parts:
        raise _index_error(
            index,
            f"key {key!r} maps to shard {name!r}, which escapes the checkpoint directory",
            "Shard paths must be relative to the index's directory without '..'; fix the weight_map.",
        )
    candidate = directory / relative
    if interrupted is not None and interrupted.backup(candidate).is_file():
        candidate = interrupted.backup(candidate)
    try:
        real = candidate.resolve(strict=True)
    except (OSError, RuntimeError):
        raise _index_error(
            index,
            f"shard '{candidate}' (holding key {key!r}) does not exist",
            "Download or copy the missing shard, or regenerate the index.",
        ) from None
    if not real.is_relative_to(directory.resolve()):
        raise _index_error(
            index,
            f"shard {name!r} (holding key {key!r}) is a symlink to '{real}', outside the checkpoint directory",
            "Copy the shard into the directory instead of linking outside it.",
        )
    if not real.is_file():
        raise _index_error(
            index, f"shard '{candidate}' is not a regular file", "Point the weight_map at files."
        )
    return candidate


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _open_index(
    given: Path, index: Path, *, allow_pickle: bool, interrupted: Interrupted | None = None
) -> CheckpointReader:
    try:
        f = open(index, "rb")  # noqa: SIM115 - held open until the shards are checked against it
    except OSError as exc:
        raise CheckpointError(f"Cannot read checkpoint index '{index}': {exc.strerror or exc}.") from None
    # While the index is open its inode cannot be reused by a later save's index, so an index
    # with the identity of the one read is the one read.
    with f:
        return _open_pinned_index(given, index, f, allow_pickle=allow_pickle, interrupted=interrupted)


def _open_pinned_index(
    given: Path, index: Path, f: BinaryIO, *, allow_pickle: bool, interrupted: Interrupted | None
) -> CheckpointReader:
    try:
        seen = _identity(os.fstat(f.fileno()))
        size = seen[2]
        if size > _MAX_INDEX_BYTES:
            raise _index_error(
                index,
                f"it is {size} bytes, more than the {_MAX_INDEX_BYTES} an index may hold (the safetensors "
                "header limit)",
                "Restore or regenerate the index file.",
            )
        text = f.read().decode("utf-8")
        raw = json.loads(text, object_pairs_hook=unique_pairs)
    except OSError as exc:
        raise CheckpointError(f"Cannot read checkpoint index '{index}': {exc.strerror or exc}.") from None
    except ValueError as exc:
        raise _index_error(
            index, f"not valid JSON ({exc})", "Restore or regenerate the index file."
        ) from None
    except RecursionError:
        raise _index_error(
            index, "JSON nested too deeply to parse", "Restore or regenerate the index file."
        ) from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict):
        raise _index_error(
            index,
            "no 'weight_map' object",
            'It must look like {"metadata": {...}, "weight_map": {key: file}}.',
        )
    index_metadata = raw.get("metadata") or {}
    if not isinstance(index_metadata, dict):
        raise _index_error(index, "'metadata' is not an object", "Fix or remove the 'metadata' entry.")
    by_name: dict[str, list[str]] = {}
    for key, name in weight_map.items():
        if not isinstance(name, str):
            _shard_path(index, name, key)  # raises, naming the key
        by_name.setdefault(str(Path(name)), []).append(key)  # "./a" and "a" are one shard
    paths = {name: _shard_path(index, name, keys[0], interrupted) for name, keys in by_name.items()}
    _check_no_orphan_shards(index, {name: index.parent / name for name in paths})
    pickled = sorted(n for n, p in paths.items() if p.suffix in _PICKLE_SUFFIXES)
    if pickled and not allow_pickle:
        raise _refuse_pickle(paths[pickled[0]])
    files: list[_File] = []
    try:
        try:
            for name in sorted(paths):
                shard = _open_file(paths[name], allow_pickle=allow_pickle)
                files.append(shard)
                _check_shard_against_index(index, shard, name, by_name[name])
        except CheckpointError:
            if _changed(index, seen, paths, interrupted):
                raise _IndexChanged from None  # a save replaced shards under us: open again
            raise
        if _changed(index, seen, paths, interrupted):  # the shards held may be from two saves
            raise _IndexChanged
    except BaseException:
        for shard in files:
            shard.close()
        raise
    return CheckpointReader(given, files, index=index, index_metadata=index_metadata)


def _changed(
    index: Path, seen: tuple[int, int, int, int], paths: Mapping[str, Path], interrupted: Interrupted | None
) -> bool:
    """Whether the shards opened may not be the ones ``index`` names: open again.

    A committed index: it is no longer the file read (a sharded save moves it away before any
    shard). The previous index of an interrupted save: a shard read under its own name has a
    backup now (the save replaced it), or the index is gone; checked in this order, because a save
    removes its backups only after its moved-away index (:mod:`surgery.checkpoint.commit`).
    """
    if interrupted is not None:
        for name, path in paths.items():
            own = index.parent / name
            if path == own and interrupted.backup(own).exists():
                return True
    try:
        return _identity(os.stat(index)) != seen
    except OSError:
        return True


def _check_no_orphan_shards(index: Path, paths: Mapping[str, Path]) -> None:
    """A file named like the index's shards (``<stem>-0000i-of-0000N``) must be in the index."""
    series = {
        (p.parent, m.group(1), m.group(2), m.group(3))
        for p in paths.values()
        if (m := _NUMBERED.fullmatch(p.name))
    }
    referenced = {p.name for p in paths.values()}
    for parent, stem, total, suffix in sorted(series):
        for i in range(1, int(total) + 1):
            name = f"{stem}-{i:05d}-of-{total}{suffix}"
            if name not in referenced and (parent / name).exists():
                raise _index_error(
                    index,
                    f"shard '{parent / name}' belongs to the same series but no key is mapped to it, so "
                    "its tensors would be dropped",
                    "Regenerate the index from all shards, or delete the stray shard.",
                )


def _check_shard_against_index(index: Path, shard: _File, name: str, indexed: list[str]) -> None:
    missing = [k for k in indexed if k not in shard.infos]
    if missing:
        raise _index_error(
            index,
            f"{len(missing)} key(s) mapped to shard {name!r} are not in it, e.g. {missing[:5]}",
            "The shard and index are from different saves; re-download the shard or regenerate the index.",
        )
    listed = set(indexed)
    extra = [k for k in shard.infos if k not in listed]
    if extra:
        raise _index_error(
            index,
            f"shard {name!r} holds {len(extra)} key(s) the index does not map to it, e.g. {extra[:5]}",
            "Add them to the weight_map (or remove them from the shard); they are never dropped silently.",
        )


def _directory_entry(directory: Path, *, allow_pickle: bool) -> Path | Interrupted:
    """The directory's entry point, or the previous checkpoint of a save that has not committed."""
    for name in _ENTRY_POINTS:
        if (directory / name).is_file():
            return directory / name
    for name in (_PICKLE_WEIGHTS_NAME, _PICKLE_WEIGHTS_INDEX_NAME):
        if (directory / name).is_file():
            if not allow_pickle:
                raise _refuse_pickle(directory / name)
            return directory / name
    interrupted = interrupted_save(directory, _ENTRY_POINTS)
    if interrupted is not None:
        return interrupted
    names = [p.name for p in directory.iterdir()]
    if any((directory / name).is_file() for name in _ENTRY_POINTS):
        raise _IndexChanged  # a save committed while the directory was listed: open again
    leftovers = sorted(n for n in names if LEFTOVER_NAME.fullmatch(n))
    if leftovers:
        raise CheckpointError(
            f"Directory '{directory}' holds no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME}, only files of "
            f"saves that did not commit (left: {', '.join(leftovers[:4])}), and none of them moved a previous "
            "checkpoint away alone. Save the checkpoint again (that also removes these files)."
        )
    found = sorted(n for n in names if Path(n).suffix in {".safetensors", ".json"})
    raise CheckpointError(
        f"Directory '{directory}' holds no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} (found: "
        f"{found or 'nothing relevant'}). Pass the path of the checkpoint file itself."
    )


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> CheckpointReader:
    """Open a checkpoint lazily: headers (and the index) are read and validated, no tensor data.

    A directory that a save is writing into (or that a save killed midway left) opens as the
    previous checkpoint until the save commits, and as the new one after: never a mix. Before the
    commit the previous checkpoint is read, read-only, from the files the save moved away
    (``.model.safetensors.index.json.<token>.old``, ``.<shard>.<token>.bak``); the rule is in
    :mod:`surgery.checkpoint.commit`.

    Args:
        path: a ``.safetensors`` file, an index ``*.index.json``, or a directory holding
            ``model.safetensors`` or ``model.safetensors.index.json`` (the single file wins if both
            exist, as in transformers).
        allow_pickle: read ``.bin`` / ``.pt`` / ``.pth`` / ``.ckpt`` files, with
            ``torch.load(weights_only=True, mmap=True)``. Refused by default.

    Returns:
        A :class:`CheckpointReader`; use it as a context manager.

    Raises:
        CheckpointError: missing or unsafe shard paths, a corrupt header, an index that disagrees
            with its shards, or a pickle file without ``allow_pickle``.

    Example:
        >>> with open_checkpoint("ckpt/") as reader:  # doctest: +SKIP
        ...     rows = reader.get_slice("lm_head.weight", 0, 0, 1024)
    """
    given = Path(path)
    directory = given if given.is_dir() else given.parent
    for attempt in range(_OPEN_ATTEMPTS):
        with _pinned_entry_points(directory) as entry_points:
            # No committed entry point: the previous checkpoint may be read from a dead save's
            # moved-away files, which the next save's recovery renames back while we read them.
            staged = None if any(entry_points) else _leftover_names(directory)
            try:
                return _open(given, allow_pickle=allow_pickle)
            except _IndexChanged:
                pass  # a save committed while the shards were opened: open again, after a short wait
            except CheckpointError:
                # Opening raced a save into the directory (an entry point or a shard replaced or
                # removed, or a killed save's files put back, while it was opened): open again.
                # Otherwise the error stands.
                raced = (
                    _identities(directory) != entry_points
                    or save_in_progress(directory)
                    or (staged is not None and _leftover_names(directory) != staged)
                )
                if attempt + 1 == _OPEN_ATTEMPTS or not raced:
                    raise
        time.sleep(min(_RETRY_SECONDS, 0.001 * 2**attempt))
    raise CheckpointError(
        f"'{given}' kept changing while it was opened ({_OPEN_ATTEMPTS} attempts): another process is saving "
        "into it. Open it once that save has finished."
    )


def _leftover_names(directory: Path) -> frozenset[str]:
    """The names of the save files (``.tmp``, ``.bak``, ``.old``) in ``directory``."""
    try:
        return frozenset(n for n in os.listdir(directory) if LEFTOVER_NAME.fullmatch(n))
    except OSError:
        return frozenset()


def _identities(directory: Path) -> list[tuple[int, int, int, int] | None]:
    """Which files the directory's entry points are now (a save replaces or moves them)."""
    found: list[tuple[int, int, int, int] | None] = []
    for name in _ENTRY_POINTS:
        try:
            found.append(_identity(os.stat(directory / name)))
        except OSError:
            found.append(None)
    return found


@contextlib.contextmanager
def _pinned_entry_points(directory: Path) -> Iterator[list[tuple[int, int, int, int] | None]]:
    """The entry points' identities, held open so that no later file can take their inodes."""
    held: list[int] = []
    found: list[tuple[int, int, int, int] | None] = []
    try:
        for name in _ENTRY_POINTS:
            try:  # O_NONBLOCK: a FIFO in the way must not block
                held.append(os.open(directory / name, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0)))
                found.append(_identity(os.fstat(held[-1])))
            except OSError:
                found.append(None)
        yield found
    finally:
        for fd in held:
            os.close(fd)


def _open(given: Path, *, allow_pickle: bool) -> CheckpointReader:
    path = given
    if path.is_dir():
        entry = _directory_entry(path, allow_pickle=allow_pickle)
        if isinstance(entry, Interrupted):
            return _open_interrupted(given, entry, allow_pickle=allow_pickle)
        path = entry
    elif not path.exists():
        interrupted = interrupted_save(path.parent, _ENTRY_POINTS)
        if interrupted is not None and interrupted.name == path.name:
            return _open_interrupted(given, interrupted, allow_pickle=allow_pickle)
        raise CheckpointError(f"Checkpoint '{path}' does not exist; check the path.")
    if path.name.endswith(".index.json"):
        return _open_index(given, path, allow_pickle=allow_pickle)
    if path.suffix != ".safetensors" and path.suffix not in _PICKLE_SUFFIXES:
        raise CheckpointError(
            f"'{path}' is not a known checkpoint format; expected .safetensors, an .index.json, or (with "
            "allow_pickle=True) .bin/.pt/.pth/.ckpt."
        )
    return CheckpointReader(given, [_open_file(path, allow_pickle=allow_pickle)])


def _open_interrupted(given: Path, interrupted: Interrupted, *, allow_pickle: bool) -> CheckpointReader:
    """The previous checkpoint of a save that moved the entry point away and has not committed."""
    if interrupted.name.endswith(".index.json"):
        return _open_index(given, interrupted.entry_point, allow_pickle=allow_pickle, interrupted=interrupted)
    return CheckpointReader(given, [SafetensorsFile(interrupted.entry_point)])
