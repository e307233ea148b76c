"""Checkpoint I/O: lazy, validated safetensors reading and atomic writing.

:func:`open_checkpoint` accepts a ``.safetensors`` file, a directory holding ``model.safetensors``,
or a sharded checkpoint described by ``model.safetensors.index.json``. Every header (and the
index) is parsed and validated up front, before a single tensor byte is read; tensors are then
read on demand, one key at a time, with our own reader over the file
(:mod:`surgery.safetensors_format`):

* ``get_tensor(key, copy=False)``: a zero-copy view over a private copy-on-write ``mmap`` of the
  file (writing to it never touches the file);
* ``get_tensor(key)`` / ``read_into(key, out)``: an owned copy, read with ``os.preadv`` straight
  into the destination tensor's memory (no intermediate buffer, no shared file position, so any
  number of threads may read at once);
* ``get_slice(key, dim, start, stop)``: only the bytes of one slice, for tensor parallelism.

Pickle checkpoints (``.bin``, ``.pt``, ...) are refused unless the caller opts in with
``allow_pickle=True``; they are then loaded with ``torch.load(weights_only=True, mmap=True)``.

:func:`write_checkpoint` streams tensors one at a time into temporary files in the target
directory, fsyncs them and renames them into place, so a failed or interrupted save leaves the
previous checkpoint loadable. Given the ``specs`` (shape and dtype) of every key, it plans the
files from them alone and looks up each value only when writing it, so a lazily computed state
dict never has more than one value alive.
"""

from __future__ import annotations

import contextlib
import difflib
import itertools
import json
import math
import os
import re
import signal
import struct
import threading
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path
from typing import Any, BinaryIO

import torch

from .errors import CheckpointError, ConfigurationError
from .safetensors_format import (
    DTYPE_NAMES,
    PACKED,
    SafetensorsFile,
    TensorInfo,
    tensor_memory,
    unique_pairs,
)

__all__ = [
    "SAFE_WEIGHTS_INDEX_NAME",
    "SAFE_WEIGHTS_NAME",
    "CheckpointReader",
    "TensorInfo",
    "open_checkpoint",
    "parse_size",
    "write_checkpoint",
]

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
_PICKLE_WEIGHTS_NAME = "pytorch_model.bin"
_PICKLE_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
_PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt"})
_SHARD_NAME = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_NUMBERED = re.compile(r"(.+)-\d{5}-of-(\d{5})(\.\w+)")


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
                f"Cannot load pickle checkpoint '{path}' safely: {exc}. Only plain tensor state dicts saved "
                "by torch.save (zip format) load with weights_only=True; convert the file to safetensors."
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
            k: TensorInfo(k, t.dtype, tuple(t.shape), path, -1, t.numel() * t.element_size())
            for k, t in self.tensors.items()
        }

    def close(self) -> None:
        self.tensors = {}


_File = SafetensorsFile | _PickleFile


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
        self._where: dict[str, tuple[TensorInfo, _File]] = {}
        self.metadata: dict[str, str] = {}
        for f in files:
            for info in f.infos.values():
                self._where[info.key] = (info, f)
            for k, v in f.metadata.items():
                self.metadata.setdefault(k, v)
        for k, v in self.index_metadata.items():
            self.metadata.setdefault(k, v if isinstance(v, str) else json.dumps(v))
        self._closed = False

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

    def _lookup(self, key: str) -> tuple[TensorInfo, _File]:
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

    def info(self, key: str) -> TensorInfo:
        """Where ``key`` is stored, its dtype and shape; reads no tensor data.

        Raises:
            CheckpointError: ``key`` is not in the checkpoint (the message lists close matches).
        """
        return self._lookup(key)[0]

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
        info, source = self._lookup(key)
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
        info, source = self._lookup(key)
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
            out.copy_(source.tensors[key])
        elif out.device.type == "cpu" and out.is_contiguous():
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
        info, source = self._lookup(key)
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
        whole = self.get_tensor(key, copy=False).narrow(dim, start, stop - start)
        return whole.clone(memory_format=torch.contiguous_format) if copy else whole

    def close(self) -> None:
        """Release file handles and mappings. Zero-copy views already returned stay valid."""
        self._closed = True
        for f in self._files:
            f.close()


def _refuse_pickle(path: Path) -> CheckpointError:
    return CheckpointError(
        f"'{path}' is a pickle checkpoint; unpickling can run arbitrary code, so it is refused by "
        "default. Convert it to safetensors, or, if you trust its source, pass allow_pickle=True (it is "
        "then loaded with torch.load(weights_only=True, mmap=True))."
    )


def _open_file(path: Path, *, allow_pickle: bool) -> _File:
    if path.suffix in _PICKLE_SUFFIXES:
        if not allow_pickle:
            raise _refuse_pickle(path)
        return _PickleFile(path)
    return SafetensorsFile(path)


def _index_error(index: Path, problem: str, fix: str) -> CheckpointError:
    return CheckpointError(f"Invalid checkpoint index '{index}': {problem}. {fix}")


def _shard_path(index: Path, name: object, key: str) -> Path:
    """Resolve one weight_map entry, refusing anything that leaves the index's directory."""
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


def _open_index(given: Path, index: Path, *, allow_pickle: bool) -> CheckpointReader:
    try:
        raw = json.loads(index.read_text(encoding="utf-8"), object_pairs_hook=unique_pairs)
    except OSError as exc:
        raise CheckpointError(f"Cannot read checkpoint index '{index}': {exc.strerror or exc}.") from None
    except ValueError as exc:
        raise _index_error(
            index, f"not valid JSON ({exc})", "Restore or regenerate the index file."
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
    paths = {name: _shard_path(index, name, keys[0]) for name, keys in by_name.items()}
    _check_no_orphan_shards(index, paths)
    pickled = sorted(n for n, p in paths.items() if p.suffix in _PICKLE_SUFFIXES)
    if pickled and not allow_pickle:
        raise _refuse_pickle(paths[pickled[0]])
    files: list[_File] = []
    try:
        for name in sorted(paths):
            shard = _open_file(paths[name], allow_pickle=allow_pickle)
            files.append(shard)
            _check_shard_against_index(index, shard, name, by_name[name])
    except BaseException:
        for shard in files:
            shard.close()
        raise
    return CheckpointReader(given, files, index=index, index_metadata=index_metadata)


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


def _directory_entry(directory: Path, *, allow_pickle: bool) -> Path:
    # The same precedence as transformers: a single file wins over an index.
    for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME):
        if (directory / name).is_file():
            return directory / name
    for name in (_PICKLE_WEIGHTS_NAME, _PICKLE_WEIGHTS_INDEX_NAME):
        if (directory / name).is_file():
            if not allow_pickle:
                raise _refuse_pickle(directory / name)
            return directory / name
    found = sorted(p.name for p in directory.iterdir() if p.suffix in {".safetensors", ".json"})
    raise CheckpointError(
        f"Directory '{directory}' holds no {SAFE_WEIGHTS_NAME} or {SAFE_WEIGHTS_INDEX_NAME} (found: "
        f"{found or 'nothing relevant'}). Pass the path of the checkpoint file itself."
    )


def open_checkpoint(path: str | os.PathLike[str], *, allow_pickle: bool = False) -> CheckpointReader:
    """Open a checkpoint lazily: headers (and the index) are read and validated, no tensor data.

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
    given = path = Path(path)
    if path.is_dir():
        path = _directory_entry(path, allow_pickle=allow_pickle)
    elif not path.exists():
        raise CheckpointError(f"Checkpoint '{path}' does not exist; check the path.")
    if path.name.endswith(".index.json"):
        return _open_index(given, path, allow_pickle=allow_pickle)
    if path.suffix != ".safetensors" and path.suffix not in _PICKLE_SUFFIXES:
        raise CheckpointError(
            f"'{path}' is not a known checkpoint format; expected .safetensors, an .index.json, or (with "
            "allow_pickle=True) .bin/.pt/.pth/.ckpt."
        )
    return CheckpointReader(given, [_open_file(path, allow_pickle=allow_pickle)])


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


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold back Ctrl-C while files are renamed, so a commit is not cut in half."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except (ValueError, OSError):  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if received and callable(previous):
            previous(signal.SIGINT, None)
        elif received and previous == signal.SIG_DFL:
            raise KeyboardInterrupt


def _previous_shards(directory: Path) -> set[str]:
    """Names of the shard files of whatever checkpoint is in ``directory`` now (best effort)."""
    names = {p.name for p in directory.iterdir() if _SHARD_NAME.fullmatch(p.name)}
    with contextlib.suppress(OSError, ValueError, AttributeError):
        weight_map = json.loads((directory / SAFE_WEIGHTS_INDEX_NAME).read_text("utf-8"))["weight_map"]
        names.update(n for n in weight_map.values() if isinstance(n, str) and Path(n).name == n)
    return names


def _fsync_directory(directory: Path) -> None:
    with contextlib.suppress(OSError, AttributeError):
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _commit(directory: Path, staged: list[tuple[Path, str]], stale: list[str]) -> None:
    """Rename staged temp files into place, then delete ``stale`` names; roll back on failure.

    Old files that are replaced are hard-linked to a backup first, so an error in the middle of
    the renames restores the previous checkpoint exactly.
    """
    token = uuid.uuid4().hex[:12]
    backups: list[tuple[Path, Path]] = []
    created: list[Path] = []
    with _sigint_deferred():
        try:
            for temp, name in staged:
                final = directory / name
                if final.exists():
                    backup = directory / f".{name}.{token}.bak"
                    try:
                        os.link(final, backup)
                        backups.append((backup, final))
                    except OSError:
                        pass  # no hard links here: the signal deferral still covers Ctrl-C
                else:
                    created.append(final)
                os.replace(temp, final)
        except BaseException:
            for backup, final in reversed(backups):
                os.replace(backup, final)
            for final in created:
                with contextlib.suppress(OSError):
                    final.unlink()
            raise
        try:
            for name in stale:
                with contextlib.suppress(FileNotFoundError):
                    (directory / name).unlink()
        finally:
            for backup, _ in backups:
                with contextlib.suppress(OSError):
                    backup.unlink()
    _fsync_directory(directory)


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
    checkpoint is complete. If anything fails (or Ctrl-C arrives) before that, the previous
    checkpoint is left loadable and no temporary file remains.

    With ``specs``, ``state_dict`` may compute its values lazily (like
    :class:`~surgery.saving.RevertedState`): shards, headers and the index are planned from
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
            I/O failure.

    Example:
        >>> write_checkpoint({"w": torch.ones(2)}, tmp_dir, max_shard_size="1GB")  # doctest: +SKIP
    """
    limit = parse_size(max_shard_size)
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
    pending = _collect(state_dict) if specs is None else _collect_specs(state_dict, specs)
    target = Path(path)
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
    new_directories = [d for d in (directory, *directory.parents) if not d.exists()]
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CheckpointError(f"Cannot create '{directory}': {exc.strerror or exc}.") from None
    shards = [pending] if single_file else _plan_shards(pending, limit)
    if single_file:
        names = [target.name]
    elif len(shards) == 1:
        names = [SAFE_WEIGHTS_NAME]
    else:
        names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    token = uuid.uuid4().hex[:12]
    staged: list[tuple[Path, str]] = []
    try:
        for shard, name in zip(shards, names):
            temp = directory / f".{name}.{token}.tmp"
            staged.append((temp, name))
            _write_file(temp, shard, meta, None if specs is None else state_dict)
        stale: list[str] = []
        if not single_file:
            old = _previous_shards(directory) - set(names)
            if len(shards) > 1:
                temp = directory / f".{SAFE_WEIGHTS_INDEX_NAME}.{token}.tmp"
                staged.append((temp, SAFE_WEIGHTS_INDEX_NAME))
                _write_index(temp, shards, names)
                # A single file wins over an index when loading, so removing it is the switch.
                stale = [SAFE_WEIGHTS_NAME, *sorted(old)]
            else:
                stale = [SAFE_WEIGHTS_INDEX_NAME, *sorted(old)]
        _commit(directory, staged, stale)
    except BaseException as exc:
        for temp, _ in staged:
            with contextlib.suppress(OSError):
                temp.unlink()
        for created in new_directories:  # innermost first; only while empty
            with contextlib.suppress(OSError):
                created.rmdir()
        if isinstance(exc, OSError) and not isinstance(exc, CheckpointError):
            raise CheckpointError(
                f"Saving to '{target}' failed: {exc}. The previous checkpoint there (if any) is unchanged; "
                "fix the cause (e.g. free disk space) and save again."
            ) from exc
        raise
    return [directory / name for _, name in staged]
