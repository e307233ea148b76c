"""Reading a checkpoint's tensors: :class:`CheckpointReader`, over files already found and validated.

:func:`~surgery.checkpoint.layout.open_checkpoint` finds the files of a checkpoint and checks them
(:mod:`surgery.checkpoint.layout`); every header has been parsed and validated before a single
tensor byte is read. Tensors are then read on demand, one key at a time, with our own reader over
the file (:mod:`surgery.checkpoint.format`):

* ``get_tensor(key, copy=False)``: a zero-copy view over a private copy-on-write ``mmap`` of the
  file (writing to it never touches the file);
* ``get_tensor(key)`` / ``read_into(key, out)``: an owned copy, read with ``os.preadv`` straight
  into the destination tensor's memory (no intermediate buffer, no shared file position, so any
  number of threads may read at once);
* ``get_slice(key, dim, start, stop)`` and ``read_region``: only the bytes of a slice, for tensor
  parallelism.

A pickle file (:class:`PickleFile`, opened only on request) is loaded with
``torch.load(weights_only=True, mmap=True)``.
"""

from __future__ import annotations

import difflib
import itertools
import json
import math
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError
from .format import SafetensorsFile, StoredTensor

__all__ = ["CheckpointReader", "PickleFile", "TensorFile"]


class PickleFile:
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


TensorFile = SafetensorsFile | PickleFile
"""One open tensor file of a checkpoint: safetensors, or pickle where the caller allowed it."""


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
        files: list[TensorFile],
        *,
        index: Path | None = None,
        index_metadata: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = path
        self.index = index
        self._files = files
        self.files = [f.path for f in files]
        self.index_metadata = dict(index_metadata or {})
        self._where: dict[str, tuple[StoredTensor, TensorFile]] = {}
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

    def locate(self, key: str) -> tuple[StoredTensor, TensorFile]:
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
            CheckpointError: ``key`` is not in the checkpoint (the message lists close matches),
                or the reader is closed.
        """
        if not self._closed:  # the hot path of planning (millions of calls at 500k keys): one lookup
            found = self._where.get(key) if isinstance(key, str) else None
            if found is not None:
                return found[0]
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
        if isinstance(source, PickleFile):
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
        if isinstance(source, PickleFile):
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
        if isinstance(source, PickleFile):
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
            isinstance(source, PickleFile)
            or not leading
            or out.device.type != "cpu"
            or not out.is_contiguous()
        ):
            whole = (
                source.tensors[key]
                if isinstance(source, PickleFile)
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

    def read_box(
        self,
        key: str,
        parts: Sequence[tuple[int, Sequence[tuple[int, int]]]],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Read the part of ``key`` cut on several dims: per ``(dim, intervals)``, those intervals.

        What a rank of an n-D device mesh holds of a tensor sharded on two dims (FSDP2's rows of
        a row-wise tensor-parallel weight). The box is copied out of a mapping of the tensor's
        pages, so only the pages it touches are read. Counts the box's bytes.

        Raises:
            CheckpointError: as :meth:`read_region`, or two cuts on one dim.
        """
        info, source = self.locate(key)
        ndim = len(info.shape)
        dims = [d % ndim if type(d) is int and -ndim <= d < ndim else None for d, _ in parts]
        if None in dims or len(set(dims)) != len(dims):
            raise CheckpointError(
                f"read_box({key!r}, {list(parts)}): need distinct dims within -{ndim}..{ndim - 1} (shape {info.shape})."
            )
        shape = list(info.shape)
        cuts: list[tuple[int, list[tuple[int, int]]]] = []
        for d, (_, intervals) in zip(dims, parts):
            assert d is not None
            spans = [(int(x), int(y)) for x, y in intervals]
            if any(not 0 <= x <= y <= info.shape[d] for x, y in spans) or any(
                y > x2 for (_, y), (x2, _) in itertools.pairwise(spans)
            ):
                raise CheckpointError(
                    f"read_box({key!r}): intervals {spans} on dim {d} must be sorted, disjoint and within "
                    f"0..{info.shape[d]} (shape {info.shape})."
                )
            shape[d] = sum(y - x for x, y in spans)
            cuts.append((d, spans))
        if out is not None and (tuple(out.shape) != tuple(shape) or out.dtype != info.dtype):
            raise CheckpointError(
                f"read_box({key!r}): out is {tuple(out.shape)} {out.dtype}; the box needs torch.empty({tuple(shape)}, "
                f"dtype={info.dtype})."
            )
        t = (
            source.tensors[key]
            if isinstance(source, PickleFile)
            else source.view(info.offset, info.nbytes, info.dtype, info.shape)
        )
        for d, spans in cuts:
            pieces = [t.narrow(d, x, y - x) for x, y in spans]
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=d)
        self._count(math.prod(shape) * info.dtype.itemsize)
        if out is None:
            out = torch.empty(shape, dtype=info.dtype)
        out.copy_(t)
        return out

    def close(self) -> None:
        """Release file handles and mappings. Zero-copy views already returned stay valid."""
        self._closed = True
        for f in self._files:
            f.close()
