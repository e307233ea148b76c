"""The safetensors file format: dtype table, validated headers, and a zero-copy file reader.

A safetensors file is an 8-byte little-endian header length, a JSON header mapping each key to
``{"dtype", "shape", "data_offsets"}`` (plus an optional ``__metadata__`` of strings), then the
raw tensor bytes. :func:`parse_header` validates every entry (dtype, shape, byte count, bounds,
overlaps) before a single tensor byte is read; :class:`SafetensorsFile` then serves tensors from
one open file:

* :meth:`SafetensorsFile.view`: a zero-copy view over a private copy-on-write ``mmap``;
* :meth:`SafetensorsFile.read_into`: an owned copy, read with ``os.preadv`` straight into the
  destination tensor's memory (no shared file position, so any number of threads may read).

Checkpoint-level concerns (directories, indexes, pickle files, atomic writing) live in
:mod:`surgery.checkpoint.reader` and :mod:`surgery.checkpoint.writer`.
"""

from __future__ import annotations

import ctypes
import json
import math
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError

__all__ = [
    "DTYPES",
    "DTYPE_NAMES",
    "PACKED",
    "SafetensorsFile",
    "StoredTensor",
    "parse_header",
    "tensor_memory",
    "unique_pairs",
]

_MAX_HEADER = 100_000_000  # the safetensors format's own limit

# safetensors dtype name -> torch dtype name; entries this torch lacks are left out of DTYPES.
_TORCH_NAMES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U64": "uint64",
    "U32": "uint32",
    "U16": "uint16",
    "U8": "uint8",
    "BOOL": "bool",
    "C64": "complex64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
    "F4": "float4_e2m1fn_x2",
}
DTYPES: dict[str, torch.dtype] = {
    name: getattr(torch, tname) for name, tname in _TORCH_NAMES.items() if hasattr(torch, tname)
}
"""safetensors dtype name (``"BF16"``) -> the torch dtype it is read as."""
DTYPE_NAMES: dict[torch.dtype, str] = {dtype: name for name, dtype in DTYPES.items()}
"""torch dtype -> safetensors dtype name: the dtypes a file can hold."""
PACKED: dict[str, int] = {"F4": 2}
"""Values per stored element of packed dtypes: the file's shape counts values, torch's counts bytes."""

_PyMemoryView_FromMemory = ctypes.pythonapi.PyMemoryView_FromMemory
_PyMemoryView_FromMemory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PyMemoryView_FromMemory.restype = ctypes.py_object
_PYBUF_READ, _PYBUF_WRITE = 0x100, 0x200


def tensor_memory(tensor: torch.Tensor, *, writable: bool) -> memoryview:
    """A byte view of a contiguous CPU tensor's memory; the caller keeps ``tensor`` alive."""
    flag = _PYBUF_WRITE if writable else _PYBUF_READ
    return _PyMemoryView_FromMemory(tensor.data_ptr(), tensor.nbytes, flag)


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """Where one stored tensor lives; known from the header alone.

    Attributes:
        key: the checkpoint key.
        dtype: the torch dtype it is read as.
        shape: its torch shape.
        file: the file that holds it.
        offset: absolute byte offset of its data in ``file`` (``-1`` in a pickle file).
        nbytes: size of its data in bytes.
    """

    key: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    file: Path
    offset: int
    nbytes: int

    @property
    def numel(self) -> int:
        """Number of elements (of ``dtype``)."""
        return math.prod(self.shape)


def _corrupt(path: Path, problem: str) -> CheckpointError:
    return CheckpointError(
        f"Corrupt safetensors file '{path}': {problem}. The file is truncated, damaged or was not "
        "written by a safetensors writer; re-download or re-export it."
    )


def unique_pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``object_pairs_hook`` for :func:`json.loads` that refuses a key repeated in one object.

    Raises:
        ValueError: a duplicate key (callers turn it into a :class:`CheckpointError`).
    """
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise ValueError(f"duplicate key {key!r}")
        result[key] = value
    return result


def _pread_exact(fd: int, nbytes: int, offset: int) -> bytes:
    data = os.pread(fd, nbytes, offset)
    while len(data) < nbytes:
        more = os.pread(fd, nbytes - len(data), offset + len(data))
        if not more:
            break
        data += more
    return data


def _parse_entry(path: Path, key: str, entry: object, data_start: int, size: int) -> StoredTensor:
    """Validate one header entry and turn it into a :class:`StoredTensor`."""
    if not isinstance(entry, dict):
        raise _corrupt(path, f"the header entry of tensor {key!r} is not an object")
    name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if not isinstance(name, str):
        raise _corrupt(path, f"tensor {key!r} has no dtype string")
    if name not in DTYPES:
        why = (
            f"this torch ({torch.__version__}) has no dtype for it"
            if name in _TORCH_NAMES
            else "it is not a safetensors dtype"
        )
        raise CheckpointError(
            f"Tensor {key!r} in '{path}' has dtype {name!r}, which cannot be read: {why}. Supported "
            f"dtypes: {', '.join(DTYPES)}. Convert the tensor to one of them, or upgrade torch."
        )
    if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
        raise _corrupt(path, f"tensor {key!r} has shape {shape!r}; expected a list of non-negative ints")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise _corrupt(path, f"tensor {key!r} has data_offsets {offsets!r}; expected [begin, end]")
    begin, end = offsets
    if not 0 <= begin <= end:
        raise _corrupt(path, f"tensor {key!r} has data_offsets [{begin}, {end}]; need 0 <= begin <= end")
    dtype = DTYPES[name]
    pack = PACKED.get(name, 1)
    numel = math.prod(shape)
    if math.prod(max(d, 1) for d in shape) * dtype.itemsize >= 2**63:
        # torch computes byte strides in int64, zero-sized dims included.
        raise _corrupt(path, f"tensor {key!r} has shape {shape}, whose strides overflow 64-bit integers")
    if pack > 1 and (not shape or shape[-1] % pack):
        raise _corrupt(
            path, f"{name} tensor {key!r} has shape {shape}; its last dim must be a multiple of {pack}"
        )
    expected = numel // pack * dtype.itemsize
    if end - begin != expected:
        raise _corrupt(
            path,
            f"tensor {key!r} ({name}, shape {shape}) needs {expected} bytes but its data_offsets "
            f"[{begin}, {end}] span {end - begin}",
        )
    if data_start + end > size:
        raise _corrupt(
            path,
            f"tensor {key!r} ends at byte {data_start + end} but the file has only {size} bytes",
        )
    torch_shape = (*shape[:-1], shape[-1] // pack) if pack > 1 else tuple(shape)
    return StoredTensor(key, dtype, torch_shape, path, data_start + begin, end - begin)


def _loads_plain(raw: bytes) -> dict[str, Any] | None:
    """The header parsed without a duplicate-key hook, when that provably lost no key.

    Every key-value pair of JSON text has exactly one ``:`` outside strings, so when the text's
    ``:`` count equals the pairs found in the top-level object and in the objects directly inside
    it, no pair was dropped as a duplicate (and none sits deeper). Otherwise (a ``:`` inside a
    string, deeper objects, invalid JSON) returns ``None`` and the caller parses with the hook.
    """
    try:
        header = json.loads(raw.decode("utf-8"))
    except (ValueError, RecursionError):  # JSONDecodeError, UnicodeDecodeError, nesting
        return None
    if type(header) is not dict:
        return None
    pairs = len(header)
    for value in header.values():
        if type(value) is dict:
            pairs += len(value)
    return header if raw.count(b":") == pairs else None


def _parse_entries(path: Path, header: dict[str, Any], data_start: int, size: int) -> list[StoredTensor]:
    """:func:`_parse_entry` over every entry, with a lean path for well-formed unpacked entries.

    An entry that fails any check of the lean path goes through :func:`_parse_entry`, which
    raises the precise error (or accepts it exactly as it always did).
    """
    infos: list[StoredTensor] = []
    append = infos.append
    dtypes, packed = DTYPES, PACKED
    prod = math.prod
    for key, entry in header.items():
        if type(entry) is dict:
            name, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
            dtype = dtypes.get(name) if type(name) is str and name not in packed else None
            if (
                dtype is not None
                and type(shape) is list
                and type(offsets) is list
                and len(offsets) == 2
                and all(type(d) is int and d >= 0 for d in shape)
            ):
                begin, end = offsets
                if (
                    type(begin) is int
                    and type(end) is int
                    and 0 <= begin < end  # empty tensors take the careful path (stride check)
                    and end - begin == prod(shape) * dtype.itemsize
                    and data_start + end <= size
                ):
                    append(StoredTensor(key, dtype, tuple(shape), path, data_start + begin, end - begin))
                    continue
        append(_parse_entry(path, key, entry, data_start, size))
    return infos


def parse_header(path: Path, fd: int, size: int) -> tuple[dict[str, str], dict[str, StoredTensor]]:
    """Read and validate the header of the open file ``fd`` (``size`` bytes long).

    Returns:
        ``(metadata, infos)``: the ``__metadata__`` strings, and every tensor's
        :class:`StoredTensor` keyed by name, in data-offset order.

    Raises:
        CheckpointError: the header is truncated, not JSON, repeats a key, names an unknown
            dtype, or describes data that is out of bounds, mis-sized or overlapping.
    """
    if size < 8:
        raise _corrupt(path, f"it has {size} bytes, fewer than the 8-byte header length")
    (length,) = struct.unpack("<Q", _pread_exact(fd, 8, 0))
    if length > size - 8:
        raise _corrupt(path, f"the header claims {length} bytes but the file has only {size - 8} after it")
    if length > _MAX_HEADER:
        raise _corrupt(path, f"the header claims {length} bytes, more than the format's {_MAX_HEADER}")
    raw = _pread_exact(fd, length, 8)
    return _parse_header_text(path, raw, 8 + length, size)


def _parse_header_text(
    path: Path, raw: bytes, data_start: int, size: int
) -> tuple[dict[str, str], dict[str, StoredTensor]]:
    header = _loads_plain(raw)
    if header is None:  # the careful parse: it names the duplicate key or the JSON error
        try:
            header = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_pairs)
        except ValueError as exc:  # JSONDecodeError, UnicodeDecodeError, duplicate keys
            raise _corrupt(path, f"the header is not valid JSON ({exc})") from None
        except RecursionError:
            raise _corrupt(path, "the header nests JSON too deeply to parse") from None
    if not isinstance(header, dict):
        raise _corrupt(path, "the header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata  # an empty list or string is not a mapping
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise _corrupt(path, "__metadata__ must map strings to strings")
    infos = _parse_entries(path, header, data_start, size)
    infos.sort(key=lambda i: (i.offset, i.nbytes))
    # As strict as the safetensors package: the tensors tile the data section exactly, in offset
    # order, with no hole, no overlap and nothing after the last one (a zero-size tensor sits where
    # the previous one ended). A file surgery opens then opens everywhere else too.
    cursor, previous = data_start, None
    for info in infos:
        if info.offset < cursor:
            other = f"tensors {previous.key!r} and {info.key!r}" if previous is not None else repr(info.key)
            raise _corrupt(path, f"the data of {other} overlap")
        if info.offset > cursor:
            after = f"after tensor {previous.key!r}" if previous is not None else "at the start of the data"
            raise _corrupt(
                path,
                f"{info.offset - cursor} unused byte(s) {after}, before {info.key!r} (the safetensors format "
                "requires tensors to follow each other without holes)",
            )
        cursor, previous = info.offset + info.nbytes, info
    if cursor != size:
        raise _corrupt(
            path,
            f"{size - cursor} byte(s) after the last tensor's data (the safetensors format requires the data to "
            "end with the last tensor)",
        )
    return metadata, {info.key: info for info in infos}


class SafetensorsFile:
    """One open ``.safetensors`` file: validated header, a handle, and a lazy private mapping.

    Attributes:
        path: the file.
        metadata: its ``__metadata__`` strings.
        infos: every tensor's :class:`StoredTensor`, in data-offset order.

    Raises:
        CheckpointError: the path is not a regular file, cannot be opened, or its header is corrupt.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        if not path.is_file():  # before open(): opening a FIFO would block
            raise CheckpointError(f"'{path}' is not a regular file; point at a .safetensors file.")
        try:
            self._handle = open(path, "rb", buffering=0)  # noqa: SIM115 - lives until close()
        except OSError as exc:
            raise CheckpointError(
                f"Cannot open checkpoint file '{path}': {exc.strerror or exc}. Check the path and permissions."
            ) from None
        try:
            st = os.fstat(self._handle.fileno())
            if not stat.S_ISREG(st.st_mode):
                raise CheckpointError(f"'{path}' is not a regular file; point at a .safetensors file.")
            self.metadata, self.infos = parse_header(path, self._handle.fileno(), st.st_size)
        except BaseException:
            self._handle.close()
            raise
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None

    def view(self, offset: int, nbytes: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
        """A zero-copy tensor over the private (copy-on-write) mapping."""
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            if self._map is None:
                if self._handle.closed:
                    raise CheckpointError(f"'{self.path}' is closed; open the checkpoint again.")
                self._map = mmap.mmap(self._handle.fileno(), 0, access=mmap.ACCESS_COPY)
            region = self._map
        flat = torch.frombuffer(region, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset)
        return flat.view(shape)

    def gather_into(
        self,
        offset: int,
        shape: tuple[int, ...],
        dtype: torch.dtype,
        dim: int,
        spans: list[tuple[int, int]],
        out: torch.Tensor,
    ) -> None:
        """Copy the ``spans`` of ``dim`` of the stored tensor at ``offset`` into ``out``.

        Maps only the tensor's pages (privately) for the duration of the copy: the touched pages
        leave the process with the mapping (the shared mapping behind :meth:`view` would keep
        them resident as long as any zero-copy tensor lives).
        """
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        try:
            fd = self._handle.fileno()
        except ValueError:
            raise CheckpointError(f"'{self.path}' is closed; open the checkpoint again.") from None
        region = mmap.mmap(fd, offset + nbytes - start, access=mmap.ACCESS_COPY, offset=start)
        try:
            whole = torch.frombuffer(
                region, dtype=dtype, count=nbytes // dtype.itemsize, offset=offset - start
            )
            whole = whole.view(shape)
            pos = 0
            for a, b in spans:
                out.narrow(dim, pos, b - a).copy_(whole.narrow(dim, a, b - a))
                pos += b - a
            del whole
        finally:
            region.close()

    def read_into(self, offset: int, out: torch.Tensor, key: str) -> None:
        """Fill the contiguous CPU tensor ``out`` with the ``out.nbytes`` bytes at ``offset``."""
        nbytes = out.nbytes
        if nbytes == 0:
            return
        if not hasattr(os, "preadv"):  # e.g. Windows: copy out of the mapping instead
            out.copy_(self.view(offset, nbytes, out.dtype, tuple(out.shape)))
            return
        self._read_memory(offset, tensor_memory(out, writable=True), key)

    def read_spans(self, spans: list[tuple[int, int, int, str]]) -> None:
        """Per ``(offset, address, nbytes, key)``: fill ``nbytes`` of CPU memory at ``address``
        with the bytes at ``offset`` (needs ``os.preadv``; the caller keeps the memory alive).

        The loader reads the thousands of experts of one fused parameter with one call (and one
        ``preadv`` per run of tensors that sit back to back in the file and in memory); ``key``
        names the span in errors.
        """
        try:
            fd = self._handle.fileno()
        except ValueError:
            raise CheckpointError(f"'{self.path}' is closed; open the checkpoint again.") from None
        preadv, memory = os.preadv, _PyMemoryView_FromMemory
        for offset, address, nbytes, key in spans:
            if nbytes:
                target = memory(address, nbytes, _PYBUF_WRITE)
                got = preadv(fd, [target], offset)
                if got != nbytes:
                    self._read_memory(offset + got, target[got:], key)

    def _read_memory(self, offset: int, target: memoryview, key: str) -> None:
        nbytes = len(target)
        done = 0
        try:
            fd = self._handle.fileno()
        except ValueError:
            raise CheckpointError(f"'{self.path}' is closed; open the checkpoint again.") from None
        while done < nbytes:
            got = os.preadv(fd, [target[done:]], offset + done)
            if got == 0:
                raise CheckpointError(
                    f"'{self.path}' ended while reading tensor {key!r}: the file was truncated after it "
                    "was opened. Restore the file and open the checkpoint again."
                )
            done += got

    def close(self) -> None:
        with self._lock:
            # Never mmap.close(): torch.frombuffer keeps a reference to the mapping object but not
            # a buffer export, so closing would unmap memory under live views. Dropping our reference
            # unmaps it once the last view is gone.
            self._map = None
            self._handle.close()
