"""Shard on read: which part of each checkpoint tensor a tensor-parallel rank needs.

A :class:`Region` is one dim and a sorted list of disjoint half-open intervals on it; the *local*
part of a tensor for a region is the concatenation of those intervals along the dim (a plain
``Shard`` has one interval, a packed ``_StridedShard(dim, 2)`` has two). A rank's target region
comes from its parameter's placements (:func:`surgery.parallel.local_region`).

Each :class:`~surgery.ops.ConversionOp` may carry a slice rule (:meth:`ConversionOp.slice_rule`)
that maps regions of its outputs to regions of its inputs and returns the op to run on the
local pieces. :func:`trace_regions` walks a converter's chain backwards with those rules and the
chain's stage shapes; the result says, per source slot, what to read. Where an op has no rule
(custom ops, a RoPE permute cut across heads), the walk stops and names the op: the loader then
reads the sources whole, runs the global chain and keeps the rank's region of the output (the
*fallback*, which the load report lists).

Example:
    >>> import torch
    >>> from surgery import ops
    >>> r = Region(0, ((1, 3),))
    >>> r.take(torch.arange(6)).tolist()
    [1, 2]
    >>> traced = trace_regions([ops.Concatenate(dim=0)], [[(4,), (4,)], [(8,)]], [Region(0, ((2, 6),))])
    >>> traced.sources
    [Region(dim=0, intervals=((2, 4),)), Region(dim=0, intervals=((0, 2),))]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeAlias

import torch

from .errors import ConfigurationError

if TYPE_CHECKING:
    from .ops import ConversionOp, OpContext

__all__ = [
    "NOT_NEEDED",
    "Region",
    "SlotRegion",
    "Traced",
    "intersect",
    "local_shape",
    "take_slot",
    "trace_regions",
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


@dataclass
class Traced:
    """The result of :func:`trace_regions`.

    Attributes:
        sources: per source slot, what the rank reads (see :data:`SlotRegion`).
        operations: the chain to run on the local pieces.
        blocked_by: when the walk stopped, the op without a rule for its regions (then
            ``sources`` and ``operations`` are empty and the caller takes the fallback).
    """

    sources: list[SlotRegion]
    operations: list[ConversionOp]
    blocked_by: ConversionOp | None = None


def trace_regions(
    operations: Sequence[ConversionOp],
    stages: list[list[Any]],
    targets: list[SlotRegion],
    ctx: OpContext | None = None,
) -> Traced:
    """Walk ``operations`` backwards from the target slots' regions to the source slots' regions.

    Args:
        operations: the converter's op chain.
        stages: slot shapes before each op and after the last (``len(operations) + 1`` stages;
            :func:`surgery.placement.stage_shapes`).
        targets: per output slot of the chain, the rank's region.
        ctx: the global op context (``PermuteForRope`` reads its head count from it).

    Raises:
        ConfigurationError: ``stages`` or ``targets`` do not fit the chain (a bug in the caller).
    """
    from .ops import OpContext, stage_contexts

    if len(stages) != len(operations) + 1 or len(targets) != len(stages[-1]):
        raise ConfigurationError(
            f"trace_regions: {len(operations)} ops need {len(operations) + 1} stages and one region per "
            f"output slot; got {len(stages)} stages and {len(targets)} regions for {len(stages[-1])} slots."
        )
    contexts = stage_contexts(operations, ctx or OpContext(n_targets=len(targets)))
    regions = [_normalized(r, s) for r, s in zip(targets, stages[-1])]
    local: list[ConversionOp] = []
    for k in range(len(operations) - 1, -1, -1):
        op = operations[k]
        if all(r is None for r in regions):
            local.append(op)  # nothing sharded from here back: the op runs as it is
            regions = [None] * len(stages[k])
            continue
        rule = op.slice_rule(regions, stages[k], stages[k + 1], contexts[k])
        if rule is None:
            return Traced([], [], blocked_by=op)
        regions, local_op = rule
        regions = [_normalized(r, s) for r, s in zip(regions, stages[k])]
        local.append(local_op)
    return Traced(regions, local[::-1])


def _normalized(region: Any, shape: Any) -> Any:
    """Non-negative dims; a region that is the whole tensor becomes ``None``."""
    if region is None or region is NOT_NEEDED:
        return region
    if isinstance(region, list):
        items = shape if isinstance(shape, list) else [shape] * len(region)
        out = [_normalized(r, s) for r, s in zip(region, items)]
        return None if all(r is None for r in out) else out
    ndim = len(shape)
    dim = region.dim % ndim if ndim else 0
    region = Region(dim, region.intervals)
    return None if region.covers(shape[dim]) else region
