"""Regions: which part of a tensor a tensor-parallel rank holds, as plain values.

A :class:`Region` is one dim and a sorted list of disjoint half-open intervals on it; the *local*
part of a tensor for a region is the concatenation of those intervals along the dim (a plain
``Shard`` has one interval, a packed ``_StridedShard(dim, 2)`` has two). On an n-D device mesh a
tensor can be sharded on several of its dims at once (FSDP2's ``Shard(0)`` with a row-wise
``Shard(1)``): a :class:`Box` is one :class:`Region` per sharded dim, and its local part is the
product of theirs. A rank's region of a
parameter comes from its placements (:func:`surgery.parallel.local_region`); the slice rules of
:mod:`surgery.ops` map regions of an op's outputs to regions of its inputs, and
:func:`surgery.load.sharding.trace_regions` walks a converter's chain with them.

:class:`TPSlice` is what a :class:`~surgery.load.plan.PlanEntry` records of one target: its
placements, one per mesh dim, and the rank's part.

This module is a leaf: it imports torch and nothing of ``surgery``.

Example:
    >>> import torch
    >>> r = Region(0, ((1, 3),))
    >>> r.take(torch.arange(6)).tolist()
    [1, 2]
    >>> intersect(Region(0, ((2, 6),)), 4, 8)
    Region(dim=0, intervals=((0, 2),))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import torch

__all__ = [
    "NOT_NEEDED",
    "Box",
    "Region",
    "SlotRegion",
    "TPSlice",
    "intersect",
    "local_shape",
    "take_slot",
]


class _NotNeeded:
    """An item of a gathered (``*``) slot that this rank does not read at all."""

    _instance: _NotNeeded | None = None

    def __new__(cls) -> _NotNeeded:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NOT_NEEDED"


NOT_NEEDED = _NotNeeded()
"""Marks an item of a list slot that the rank skips (an expert another rank owns)."""


@dataclass(frozen=True)
class Region:
    """Half-open ``intervals`` on ``dim``; the local part is their concatenation along ``dim``.

    Intervals are kept sorted, disjoint and non-empty (:meth:`of` normalizes); an empty tuple is
    a region of size zero (a concatenated input this rank needs nothing of).
    """

    dim: int
    intervals: tuple[tuple[int, int], ...]

    @classmethod
    def of(cls, dim: int, intervals: Sequence[tuple[int, int]]) -> Region:
        """A region with its intervals sorted, merged where they touch, and empty ones dropped."""
        merged: list[list[int]] = []
        for a, b in sorted((int(a), int(b)) for a, b in intervals if b > a):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        return cls(int(dim), tuple((a, b) for a, b in merged))

    @classmethod
    def indices(cls, dim: int, indices: Sequence[int]) -> Region:
        """The region holding exactly ``indices`` (sorted) of ``dim``."""
        return cls.of(dim, [(i, i + 1) for i in indices])

    @property
    def size(self) -> int:
        """Length of the local part along :attr:`dim`."""
        return sum(b - a for a, b in self.intervals)

    def shifted(self, by: int) -> Region:
        return Region(self.dim, tuple((a + by, b + by) for a, b in self.intervals))

    def on(self, dim: int) -> Region:
        return Region(dim, self.intervals)

    def covers(self, size: int) -> bool:
        """Whether the region is the whole of a dim of ``size``."""
        return self.intervals == ((0, size),) or (size == 0 and not self.intervals)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The local part of ``t`` (a view for one interval, a new tensor for several)."""
        pieces = [t.narrow(self.dim, a, b - a) for a, b in self.intervals]
        if len(pieces) == 1:
            return pieces[0]
        if not pieces:
            return t.narrow(self.dim, 0, 0)
        return torch.cat(pieces, dim=self.dim)


@dataclass(frozen=True)
class Box:
    """A part of a tensor sharded on several dims: one :class:`Region` per dim, sorted by dim.

    The local part is every element whose index lies in each region on its dim (:meth:`take`
    applies them one after the other; takes on different dims commute). Build it with
    :meth:`of`, which gives a plain :class:`Region` (or ``None``) when fewer than two dims are cut.

    Example:
        >>> import torch
        >>> b = Box.of([Region(0, ((0, 1),)), Region(1, ((1, 3),))], (2, 4))
        >>> b.take(torch.arange(8).reshape(2, 4)).tolist()
        [[1, 2]]
        >>> Box.of([Region(1, ((0, 4),))], (2, 4)) is None
        True
    """

    parts: tuple[Region, ...]

    @classmethod
    def of(cls, parts: Sequence[Region | None], shape: Sequence[int]) -> Box | Region | None:
        """The box of ``parts`` (one per dim at most) on a tensor of ``shape``, dropping whole dims."""
        kept = sorted(
            (p for p in parts if p is not None and not p.covers(int(shape[p.dim]))), key=lambda p: p.dim
        )
        if len({p.dim for p in kept}) != len(kept):
            raise ValueError(f"Box.of: two regions on one dim in {kept}")
        if not kept:
            return None
        return kept[0] if len(kept) == 1 else cls(tuple(kept))

    @property
    def dims(self) -> tuple[int, ...]:
        return tuple(p.dim for p in self.parts)

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The local part of ``t``."""
        for p in self.parts:
            t = p.take(t)
        return t


SlotRegion: TypeAlias = "Region | Box | list[Region | Box | _NotNeeded | None] | None"
"""What a rank needs of one slot: ``None`` (all of it), a :class:`Region`, or, for a list slot,
one entry per item (:data:`NOT_NEEDED` for items it skips)."""


def intersect(region: Region, start: int, stop: int) -> Region:
    """The part of ``region`` inside ``[start, stop)``, shifted so that ``start`` is 0."""
    out = [(max(a, start) - start, min(b, stop) - start) for a, b in region.intervals]
    return Region.of(region.dim, out)


def local_shape(shape: tuple[int, ...], region: Region | Box | None) -> tuple[int, ...]:
    """The shape of the local part of a tensor of ``shape``."""
    if region is None:
        return tuple(shape)
    out = list(shape)
    for part in region.parts if isinstance(region, Box) else (region,):
        out[part.dim] = part.size
    return tuple(out)


def take_slot(slot: Any, region: SlotRegion) -> Any:
    """The local part of a slot (a list slot drops its :data:`NOT_NEEDED` items)."""
    if region is None:
        return slot
    if isinstance(slot, list):
        assert isinstance(region, list)
        return [
            r.take(t) if isinstance(r, (Region, Box)) else t
            for t, r in zip(slot, region)
            if r is not NOT_NEEDED
        ]
    assert isinstance(region, (Region, Box))
    return region.take(slot)


@dataclass(frozen=True)
class TPSlice:
    """One target of a plan entry under tensor parallelism: its placements and this rank's part.

    Attributes:
        placements: per mesh dim, the placement as text (``"Shard(dim=0)"``,
            ``"_StridedShard(dim=0, sf=2)"``); one entry on a 1-D mesh.
        dim: the (first) tensor dim of this rank's part, ``None`` when the rank holds all of it.
        intervals: the half-open intervals on ``dim`` this rank holds, in order (a packed
            ``_StridedShard`` has one per part); ``()`` when ``dim`` is ``None``.
        more: on an n-D mesh, ``(dim, intervals)`` of each further tensor dim the rank's part is
            cut on (a :class:`Box`); ``()`` otherwise.

    Example:
        >>> s = TPSlice(("_StridedShard(dim=0, sf=2)",), 0, ((0, 16), (32, 48)))
        >>> s.to_json()
        ['_StridedShard(dim=0, sf=2)', 0, [[0, 16], [32, 48]]]
        >>> TPSlice.from_json(s.to_json()) == s
        True
        >>> b = TPSlice(("Shard(dim=0)", "Shard(dim=1)"), 0, ((0, 4),), ((1, ((8, 16),)),))
        >>> TPSlice.from_json(b.to_json()) == b, b.region.dims
        (True, (0, 1))
    """

    placements: tuple[str, ...]
    dim: int | None = None
    intervals: tuple[tuple[int, int], ...] = ()
    more: tuple[tuple[int, tuple[tuple[int, int], ...]], ...] = ()

    @classmethod
    def of(cls, placements: Sequence[Any], region: Region | Box | None) -> TPSlice:
        """The slice of a target with ``placements`` (torch placement objects) and rank ``region``."""
        text = tuple(repr(p) for p in placements)
        if region is None:
            return cls(text)
        if isinstance(region, Box):
            first, *rest = region.parts
            return cls(text, first.dim, first.intervals, tuple((r.dim, r.intervals) for r in rest))
        return cls(text, region.dim, region.intervals)

    @property
    def region(self) -> Region | Box | None:
        """This rank's part as a :class:`Region` or :class:`Box` (``None``: all of it)."""
        if self.dim is None:
            return None
        first = Region(self.dim, self.intervals)
        return Box((first, *(Region(d, iv) for d, iv in self.more))) if self.more else first

    def to_json(self) -> list[Any]:
        """``[placements, dim, intervals]`` (and ``more`` as ``[[dim, intervals], ...]`` when cut on
        several dims); on a 1-D mesh ``placements`` is the one placement's text."""
        placements: Any = self.placements[0] if len(self.placements) == 1 else list(self.placements)
        out = [placements, self.dim, [list(i) for i in self.intervals]]
        if self.more:
            out.append([[d, [list(i) for i in iv]] for d, iv in self.more])
        return out

    @classmethod
    def from_json(cls, value: Any) -> TPSlice:
        """The inverse of :meth:`to_json` (a JSON list or the tuple it was made from)."""
        placements, dim, intervals, *more = value
        text = (placements,) if isinstance(placements, str) else tuple(placements)
        extra = tuple((int(d), tuple((int(a), int(b)) for a, b in iv)) for d, iv in (more[0] if more else ()))
        return cls(text, dim, tuple((int(a), int(b)) for a, b in intervals), extra)
