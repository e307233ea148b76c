"""Regions: which part of a tensor a tensor-parallel rank holds, as plain values.

A :class:`Region` is one dim and a sorted list of disjoint half-open intervals on it; the *local*
part of a tensor for a region is the concatenation of those intervals along the dim (a plain
``Shard`` has one interval, a packed ``_StridedShard(dim, 2)`` has two). A rank's region of a
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


SlotRegion: TypeAlias = "Region | list[Region | _NotNeeded | None] | None"
"""What a rank needs of one slot: ``None`` (all of it), a :class:`Region`, or, for a list slot,
one entry per item (:data:`NOT_NEEDED` for items it skips)."""


def intersect(region: Region, start: int, stop: int) -> Region:
    """The part of ``region`` inside ``[start, stop)``, shifted so that ``start`` is 0."""
    out = [(max(a, start) - start, min(b, stop) - start) for a, b in region.intervals]
    return Region.of(region.dim, out)


def local_shape(shape: tuple[int, ...], region: Region | None) -> tuple[int, ...]:
    """The shape of the local part of a tensor of ``shape``."""
    if region is None:
        return tuple(shape)
    out = list(shape)
    out[region.dim] = region.size
    return tuple(out)


def take_slot(slot: Any, region: SlotRegion) -> Any:
    """The local part of a slot (a list slot drops its :data:`NOT_NEEDED` items)."""
    if region is None:
        return slot
    if isinstance(slot, list):
        assert isinstance(region, list)
        return [
            r.take(t) if isinstance(r, Region) else t for t, r in zip(slot, region) if r is not NOT_NEEDED
        ]
    assert isinstance(region, Region)
    return region.take(slot)


@dataclass(frozen=True)
class TPSlice:
    """One target of a plan entry under tensor parallelism: its placements and this rank's part.

    Attributes:
        placements: per mesh dim, the placement as text (``"Shard(dim=0)"``,
            ``"_StridedShard(dim=0, sf=2)"``); one entry on today's 1-D meshes.
        dim: the tensor dim of this rank's part, ``None`` when the rank holds all of it.
        intervals: the half-open intervals on ``dim`` this rank holds, in order (a packed
            ``_StridedShard`` has one per part); ``()`` when ``dim`` is ``None``.

    Example:
        >>> s = TPSlice(("_StridedShard(dim=0, sf=2)",), 0, ((0, 16), (32, 48)))
        >>> s.to_json()
        ['_StridedShard(dim=0, sf=2)', 0, [[0, 16], [32, 48]]]
        >>> TPSlice.from_json(s.to_json()) == s
        True
    """

    placements: tuple[str, ...]
    dim: int | None = None
    intervals: tuple[tuple[int, int], ...] = ()

    @classmethod
    def of(cls, placements: Sequence[Any], region: Region | None) -> TPSlice:
        """The slice of a target with ``placements`` (torch placement objects) and rank ``region``."""
        text = tuple(repr(p) for p in placements)
        return cls(text) if region is None else cls(text, region.dim, region.intervals)

    @property
    def region(self) -> Region | None:
        """This rank's part as a :class:`Region` (``None``: all of it)."""
        return None if self.dim is None else Region(self.dim, self.intervals)

    def to_json(self) -> list[Any]:
        """``[placements, dim, intervals]``; on a 1-D mesh ``placements`` is the one placement's text."""
        placements: Any = self.placements[0] if len(self.placements) == 1 else list(self.placements)
        return [placements, self.dim, [list(i) for i in self.intervals]]

    @classmethod
    def from_json(cls, value: Any) -> TPSlice:
        """The inverse of :meth:`to_json` (a JSON list or the tuple it was made from)."""
        placements, dim, intervals = value
        text = (placements,) if isinstance(placements, str) else tuple(placements)
        return cls(text, dim, tuple((int(a), int(b)) for a, b in intervals))
