"""Staging: how a load reaches a device through a small ring of host buffers.

Reading a checkpoint straight into GPU memory is slow done naively: copying out of a file
mapping (pageable memory) into device memory makes the driver stage every page itself, one
synchronous copy at a time. :class:`Staging` does what the fast loaders do instead:

* the bytes of every read (a whole tensor, a tensor-parallel region, an FSDP box) are cut into
  pieces no larger than one buffer of a fixed ring (``staging_bytes`` in all, default 256 MiB in
  two buffers per reading thread, at least :data:`BUFFERS`: pinned host memory when the
  destination is a CUDA device);
* a worker fills a free buffer from the file (``preadv`` for a contiguous piece, a short-lived
  mapping of the piece's pages otherwise) and hands it to the copy engine, which copies it to
  the destination asynchronously; the worker goes on to read the next piece into another buffer
  while that copy runs;
* a buffer is reused only once its copy has finished (a CUDA event, or the copy thread's future),
  and a read is handed back only once all its pieces have landed.

Peak host memory is the ring, whatever the size of the model or of its largest tensor (a tensor
larger than a buffer is streamed in pieces). Decoding (FP8 block scales, packed integers) then
runs on the device, on the stored values the ring brought there.

With ``device="cpu"`` and ``staging_bytes=`` given, the same ring runs with ordinary host buffers
and a copy *thread* in the role of the CUDA copy stream, so the overlap and the buffer reuse rule
are exercised (and tested) on machines without an accelerator. Without ``staging_bytes`` a CPU
load reads straight into its destinations, which is faster there.

Example:
    >>> surgery.load_checkpoint(model, "ckpt/", device="cuda", staging_bytes="512MiB")  # doctest: +SKIP
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..checkpoint import CheckpointReader
from ..checkpoint.format import SafetensorsFile, StoredTensor
from ..checkpoint.reader import PickleFile
from ..checkpoint.writer import parse_size
from ..errors import CheckpointError, ConfigurationError

__all__ = ["BUFFERS", "DEFAULT_STAGING_BYTES", "StagedReader", "Staging", "pieces_of", "staging_budget"]

DEFAULT_STAGING_BYTES = 256 * 2**20
"""The ring's size when a load to an accelerator names none."""
BUFFERS = 4
"""The fewest buffers a ring has: the loader asks for two per reading thread (one being filled,
one in flight to the device), as many as fit in the budget at one page each."""
_ALIGN = 4096


def staging_budget(staging_bytes: int | str | None, devices: Sequence[torch.device]) -> int | None:
    """The ring size of a load to ``devices``: ``staging_bytes`` parsed, else the default for an
    accelerator, else ``None`` (a CPU load reads straight into its destinations).

    Raises:
        ConfigurationError: ``staging_bytes`` is not a size, or is smaller than one page per buffer.
    """
    if staging_bytes is None:
        return DEFAULT_STAGING_BYTES if any(d.type not in ("cpu", "meta") for d in devices) else None
    total = parse_size(staging_bytes)
    if total < BUFFERS * _ALIGN:
        raise ConfigurationError(
            f"staging_bytes={staging_bytes!r} is too small: the ring needs at least {BUFFERS * _ALIGN} bytes "
            f"({BUFFERS} buffers of one page); pass e.g. staging_bytes='64MiB'."
        )
    return total


@dataclass(slots=True)
class _Slot:
    buffer: torch.Tensor  # uint8, host
    pending: Any = None  # a CUDA event or a Future: the copy out of this buffer still running


@dataclass(frozen=True, slots=True)
class _Piece:
    """One part of a read, contiguous in the destination: ``nbytes`` at the destination's
    ``start``, filled from the sub-tensor at file ``offset`` of ``shape`` cut by ``cuts``
    (none: a contiguous byte range)."""

    start: int
    nbytes: int
    offset: int
    shape: tuple[int, ...]
    cuts: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]


class Staging:
    """A ring of host buffers and the copy engine that moves them to devices.

    Thread-safe: the loader's workers share one ring. Each holds at most one buffer at a time,
    so no worker waits on another's buffer while holding its own.

    Args:
        total_bytes: the ring's size, shared out evenly (page-aligned) among the buffers.
        buffers: how many (at least 2, and at most one per page of ``total_bytes``).
        pinned: allocate page-locked buffers (needed for asynchronous copies to CUDA).
    """

    def __init__(self, total_bytes: int, *, buffers: int = BUFFERS, pinned: bool = False) -> None:
        self.count = max(2, min(buffers, total_bytes // _ALIGN))
        self.buffer_bytes = max(_ALIGN, total_bytes // self.count // _ALIGN * _ALIGN)
        self.total_bytes = self.buffer_bytes * self.count
        self.pinned = pinned
        self._free: queue.SimpleQueue[_Slot] = queue.SimpleQueue()
        for _ in range(self.count):
            buf = torch.empty(self.buffer_bytes, dtype=torch.uint8, pin_memory=pinned)
            self._free.put(_Slot(buf))
        self._copier: ThreadPoolExecutor | None = None  # the CPU stand-in for a copy stream
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        self.pieces = 0
        self.staged_bytes = 0

    def __repr__(self) -> str:
        return f"Staging({self.count} x {self.buffer_bytes} bytes{', pinned' if self.pinned else ''})"

    def close(self) -> None:
        """Wait for every copy in flight and for the devices' work, then stop the copy thread.

        The loader's workers decode on their threads' streams; waiting for the devices here means
        a caller on another stream finds every loaded tensor complete.
        """
        slots = []
        for _ in range(self.count):
            try:  # a worker interrupted while holding a buffer never gives it back: do not wait forever
                slots.append(self._free.get(timeout=60))
            except queue.Empty:
                break
        for slot in slots:
            _settle(slot.pending)
            slot.pending = None
            self._free.put(slot)
        for device in self._streams:
            torch.cuda.synchronize(device)
        if self._copier is not None:
            self._copier.shutdown(wait=True)

    def _stream(self, device: torch.device) -> Any:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            stream = self._streams.get(device)
            if stream is None:
                stream = self._streams[device] = torch.cuda.Stream(device=device)
            return stream

    def _copy_thread(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._copier is None:
                self._copier = ThreadPoolExecutor(max_workers=1, thread_name_prefix="surgery-copy")
            return self._copier

    def transfer(
        self, pieces: Iterator[_Piece], fill: Callable[[_Piece, torch.Tensor], None], dest: torch.Tensor
    ) -> None:
        """Fill ``dest`` (contiguous, any device) piece by piece through the ring.

        ``fill(piece, host)`` reads a piece into the host buffer view ``host`` (uint8). Returns
        once every piece has landed (for CUDA: once the caller's stream waits for the copies).
        """
        flat = dest.view(-1).view(torch.uint8) if dest.numel() else dest.new_empty(0, dtype=torch.uint8)
        stream = self._stream(flat.device) if flat.device.type == "cuda" else None
        if stream is not None:  # the copies write memory the caller's stream allocated: order them after it
            stream.wait_stream(torch.cuda.current_stream(flat.device))
        last: Any = None  # the newest CUDA event of this read
        mine: list[Future[Any]] = []  # this read's copies on the CPU copy thread
        try:
            for piece in pieces:
                slot = None
                try:
                    slot = self._free.get()
                    _settle(slot.pending)  # the previous copy out of this buffer (any read's) has ended
                    slot.pending = None
                    host = slot.buffer[: piece.nbytes]
                    fill(piece, host)
                    target = flat[piece.start : piece.start + piece.nbytes]
                    if stream is not None:
                        with torch.cuda.stream(stream):
                            target.copy_(host, non_blocking=True)
                            event = torch.cuda.Event()
                            event.record(stream)
                        slot.pending = last = event
                    elif flat.device.type == "cpu":
                        slot.pending = self._copy_thread().submit(target.copy_, host)
                        mine.append(slot.pending)
                    else:  # another accelerator: a copy waited for, the ring still bounds host memory
                        target.copy_(host)
                        synchronize = getattr(getattr(torch, flat.device.type, None), "synchronize", None)
                        if callable(synchronize):
                            synchronize()
                    with self._lock:
                        self.pieces += 1
                        self.staged_bytes += piece.nbytes
                finally:
                    if slot is not None:
                        self._free.put(slot)
        finally:  # also when a read fails half way: no copy may still write memory handed back
            if stream is not None and last is not None:  # the caller's stream (which frees ``dest``) waits
                torch.cuda.current_stream(flat.device).wait_event(last)
            else:
                futures.wait(mine)
        for done in mine:
            done.result()  # a copy that failed fails this read


def _settle(pending: Any) -> None:
    """Wait for a copy to end; its failure is its own read's to report."""
    if isinstance(pending, Future):
        futures.wait([pending])
    elif pending is not None:
        pending.synchronize()


def pieces_of(
    info: StoredTensor, cuts: Sequence[tuple[int, Sequence[tuple[int, int]]]], max_bytes: int
) -> Iterator[_Piece]:
    """The pieces, each at most ``max_bytes``, of the part of ``info`` that ``cuts`` keep.

    ``cuts`` maps dims to sorted half-open intervals (none: the whole tensor). Pieces follow the
    part's row-major order, so each is one contiguous run of the destination. A part with no cut
    past dim 0 is a list of byte ranges, cut anywhere; otherwise the part is split along its
    leading dims until a piece fits (one row of a row that is still too big, and so on).
    """
    item = info.dtype.itemsize
    spans = {d: tuple((int(a), int(b)) for a, b in iv) for d, iv in cuts}
    yield from _split(0, info.offset, tuple(info.shape), spans, item, max(item, max_bytes // item * item))


def _split(
    start: int,
    offset: int,
    shape: tuple[int, ...],
    cuts: dict[int, tuple[tuple[int, int], ...]],
    item: int,
    max_bytes: int,
) -> Iterator[_Piece]:
    if not shape:
        if item:
            yield _Piece(start, item, offset, (), ())
        return
    row = math.prod(shape[1:]) * item  # stored bytes of one index of dim 0
    rows = cuts.get(0, ((0, shape[0]),))
    if all(d == 0 for d in cuts):  # byte ranges, one per interval: cut them anywhere
        for a, b in rows:
            lo, hi = offset + a * row, offset + b * row
            while lo < hi:
                n = min(max_bytes, hi - lo)
                yield _Piece(start, n, lo, (), ())
                start, lo = start + n, lo + n
        return
    rest = {d - 1: iv for d, iv in cuts.items() if d != 0}
    out_row = math.prod(
        sum(b - a for a, b in rest[d - 1]) if d - 1 in rest else shape[d] for d in range(1, len(shape))
    )
    out_row *= item
    if out_row == 0:
        return
    if out_row > max_bytes:  # one index of dim 0 at a time, split further inside it
        for a, b in rows:
            for i in range(a, b):
                yield from _split(start, offset + i * row, shape[1:], rest, item, max_bytes)
                start += out_row
        return
    per = max(1, max_bytes // out_row)
    sub = tuple(sorted(rest.items()))
    for a, b in rows:
        for lo in range(a, b, per):
            hi = min(b, lo + per)
            yield _Piece(
                start,
                (hi - lo) * out_row,
                offset + lo * row,
                (hi - lo, *shape[1:]),
                tuple((d + 1, iv) for d, iv in sub),
            )
            start += (hi - lo) * out_row


class StagedReader:
    """The reads a load's workers make, brought to their destination devices through a :class:`Staging` ring.

    Offers the reading methods of :class:`~surgery.checkpoint.CheckpointReader` that the loader
    uses, with results on ``device`` (or in ``out``, on any device). Bytes are counted in the
    underlying reader's :attr:`~surgery.checkpoint.CheckpointReader.bytes_read`, as before.
    """

    def __init__(self, reader: CheckpointReader, staging: Staging, device: torch.device) -> None:
        self.reader = reader
        self.staging = staging
        self.device = device

    def info(self, key: str) -> StoredTensor:
        return self.reader.info(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        info = self.reader.info(key)
        return self._read(key, (), torch.empty(info.shape, dtype=info.dtype, device=self.device))

    def read_into(self, key: str, out: torch.Tensor) -> torch.Tensor:
        info = self.reader.info(key)
        if out.dtype != info.dtype or tuple(out.shape) != info.shape or out.device.type == "meta":
            return self.reader.read_into(key, out)  # raises with the reader's message
        return self._read(key, (), out)

    def read_region(
        self, key: str, dim: int, intervals: Sequence[tuple[int, int]], *, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        info = self.reader.info(key)
        ndim = len(info.shape)
        if not (type(dim) is int and -ndim <= dim < ndim):
            return self.reader.read_region(key, dim, intervals, out=out)  # raises
        dim %= ndim
        shape = list(info.shape)
        shape[dim] = sum(b - a for a, b in intervals)
        return self._read(key, ((dim, tuple(intervals)),), self._out(key, info, tuple(shape), out))

    def read_box(
        self,
        key: str,
        parts: Sequence[tuple[int, Sequence[tuple[int, int]]]],
        *,
        out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        info = self.reader.info(key)
        ndim = len(info.shape)
        shape = list(info.shape)
        cuts = []
        for d, iv in parts:
            if not (type(d) is int and -ndim <= d < ndim):
                return self.reader.read_box(key, parts, out=out)  # raises
            shape[d % ndim] = sum(b - a for a, b in iv)
            cuts.append((d % ndim, tuple(iv)))
        if len({d for d, _ in cuts}) != len(cuts):
            return self.reader.read_box(key, parts, out=out)  # raises
        return self._read(key, tuple(sorted(cuts)), self._out(key, info, tuple(shape), out))

    def _out(
        self, key: str, info: StoredTensor, shape: tuple[int, ...], out: torch.Tensor | None
    ) -> torch.Tensor:
        if out is None:
            return torch.empty(shape, dtype=info.dtype, device=self.device)
        if tuple(out.shape) != shape or out.dtype != info.dtype or out.device.type == "meta":
            raise CheckpointError(
                f"Reading part of {key!r} through the staging ring: out is {tuple(out.shape)} {out.dtype} on "
                f"{out.device}; the part needs torch.empty({shape}, dtype={info.dtype})."
            )
        return out

    def _read(
        self, key: str, cuts: tuple[tuple[int, tuple[tuple[int, int], ...]], ...], out: torch.Tensor
    ) -> torch.Tensor:
        info, source = self.reader.locate(key)
        if not isinstance(source, SafetensorsFile):  # a pickle file (opt-in) is already in memory
            assert isinstance(source, PickleFile)
            part = source.tensors[key]
            for d, iv in cuts:
                part = torch.cat([part.narrow(d, a, b - a) for a, b in iv], dim=d)
            out.copy_(part)
            self.reader.record_read(out.nbytes)
            return out
        for d, iv in cuts:
            if not all(0 <= a <= b <= info.shape[d] for a, b in iv) or any(
                b > a2 for (_, b), (a2, _) in itertools.pairwise(iv)
            ):
                raise CheckpointError(
                    f"Reading part of {key!r}: intervals {list(iv)} on dim {d} must be sorted, disjoint and within "
                    f"0..{info.shape[d]} (shape {info.shape})."
                )
        dest = out if out.is_contiguous() else torch.empty(out.shape, dtype=out.dtype, device=out.device)

        def fill(piece: _Piece, host: torch.Tensor) -> None:
            if not piece.cuts:
                source.read_into(piece.offset, host, key)
                return
            typed = host.view(info.dtype).view(_cut_shape(piece.shape, piece.cuts))
            if len(piece.cuts) == 1:
                ((d, iv),) = piece.cuts
                source.gather_into(piece.offset, piece.shape, info.dtype, d, list(iv), typed)
                return
            part = source.view(
                piece.offset, math.prod(piece.shape) * info.dtype.itemsize, info.dtype, piece.shape
            )
            for d, iv in piece.cuts:
                part = torch.cat([part.narrow(d, a, b - a) for a, b in iv], dim=d)
            typed.copy_(part)

        self.staging.transfer(pieces_of(info, cuts, self.staging.buffer_bytes), fill, dest)
        self.reader.record_read(dest.nbytes)
        if dest is not out:
            out.copy_(dest)
        return out


def _cut_shape(
    shape: tuple[int, ...], cuts: Sequence[tuple[int, Sequence[tuple[int, int]]]]
) -> tuple[int, ...]:
    s = list(shape)
    for d, iv in cuts:
        s[d] = sum(b - a for a, b in iv)
    return tuple(s)
