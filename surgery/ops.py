"""Conversion ops: tensor operations with exact inverses.

A :class:`~surgery.WeightConverter` runs a chain of ops over *slots*. A slot is one tensor, or a
list of tensors gathered by an index wildcard (``experts.*.w1.weight`` gives one list of experts
ordered by index). The chain starts with one slot per source pattern and must end with one slot
per target pattern.

Every op is a frozen dataclass with a ``reverse_op`` such that
``op.reverse_op.convert(op.convert(x)) == x`` bit for bit; saving in the original format runs the
reversed chain. Custom ops subclass :class:`ConversionOp`, implement :meth:`~ConversionOp.convert`
and ``reverse_op``, and are used exactly like the built-ins.

An op that drops data (keeps the first rows of a padded tensor) stays exact by keeping what it
drops: it hands that *residue* to :attr:`OpContext.keep_residue` on load, the load records it,
and its ``reverse_op`` gets it back as :attr:`OpContext.residue` on save (``None`` for a model
never loaded: the op then fills in what it must, e.g. zero rows).

Example:
    >>> import torch
    >>> from surgery import ops
    >>> w1, w3 = [torch.randn(4, 3) for _ in range(2)], [torch.randn(4, 3) for _ in range(2)]
    >>> chain = [ops.MergeModulelist(dim=0), ops.Concatenate(dim=1)]
    >>> (fused,) = ops.run_chain(chain, [w1, w3], ops.OpContext(n_targets=1))
    >>> fused.shape
    torch.Size([2, 8, 3])
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, TypeAlias

import torch

from . import meta
from .errors import ConversionError
from .parallel.regions import NOT_NEEDED, Region, SlotRegion, intersect

__all__ = [
    "Chunk",
    "Concatenate",
    "Conv3dToLinear",
    "ConversionOp",
    "Interleave",
    "LinearToConv3d",
    "MergeModulelist",
    "OpContext",
    "PermuteForRope",
    "SliceRule",
    "Slot",
    "Split",
    "SplitModulelist",
    "Transpose",
    "reverse_chain",
    "run_chain",
    "stage_contexts",
]

Slot: TypeAlias = "torch.Tensor | list[torch.Tensor]"
SliceRule: TypeAlias = "tuple[list[SlotRegion], ConversionOp] | None"
"""What :meth:`ConversionOp.slice_rule` returns: the inputs' regions and the op to run on them."""


@dataclass(frozen=True)
class OpContext:
    """What an op may know besides its tensors.

    Attributes:
        n_targets: number of target patterns of the converter (how many slots the chain must end with).
        target_shapes: shape of each target tensor where known (the model's parameter when loading,
            the recorded checkpoint tensor when saving; for a ``*`` target, the shape of one of its
            tensors); ``Split(sizes=None)`` reads it. :func:`run_chain` hands each op these shapes
            as they look at that op's stage of the chain (see :meth:`ConversionOp.input_shape`).
        config: the sub-model's ``config`` object, if any (``PermuteForRope(config_attribute=...)``).
        source_keys / target_keys: for error messages.
        transform: a short description of the transform, for error messages.
        keep_residue: on load, where an op that drops data hands what it drops (one tensor per
            converter group, only what is dropped: ``t[rows:].clone()``, never a view of all of
            ``t``); the loader records it. ``None`` where nothing records (planning, a dry run).
        residue: on save, what the forward op handed to ``keep_residue`` at load, for its
            ``reverse_op`` to put back; ``None`` when the model was never loaded (or nothing was
            dropped).
    """

    n_targets: int = 1
    target_shapes: tuple[tuple[int, ...] | None, ...] | None = None
    config: Any = None
    source_keys: tuple[str, ...] = ()
    target_keys: tuple[str, ...] = ()
    transform: str = ""
    keep_residue: Callable[[torch.Tensor], None] | None = None
    residue: torch.Tensor | None = None

    def where(self) -> str:
        parts = []
        if self.transform:
            parts.append(f"in {self.transform}")
        if self.target_keys:
            parts.append(
                f"for target {', '.join(self.target_keys[:3])}{' ...' if len(self.target_keys) > 3 else ''}"
            )
        if self.source_keys:
            parts.append(
                f"from {', '.join(self.source_keys[:3])}{' ...' if len(self.source_keys) > 3 else ''}"
            )
        return " ".join(parts)


class ConversionOp:
    """Base of all conversion ops.

    Subclasses implement :meth:`convert` and the ``reverse_op`` property. Set
    ``supports_many_to_many = True`` on an op that maps several sources to several targets.
    """

    supports_many_to_many: ClassVar[bool] = False

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        """Transform the slots; raise :class:`ConversionError` on bad input."""
        raise NotImplementedError(f"{type(self).__name__} must implement convert()")

    @property
    def reverse_op(self) -> ConversionOp:
        """The op that undoes this one exactly."""
        raise NotImplementedError(f"{type(self).__name__} must implement reverse_op")

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        """The shape of one input tensor that this op turns into a tensor of ``shape``.

        Optional. :func:`run_chain` uses it to tell an earlier op (a ``Split`` without sizes) what
        the targets look like at its stage. ``-1`` marks a size the op cannot know; ``None`` (the
        default) means the op does not say, and earlier ops then see the final target shapes.
        """
        return None

    def slice_rule(
        self,
        regions: list[SlotRegion],
        in_shapes: list[Any],
        out_shapes: list[Any],
        ctx: OpContext,
    ) -> SliceRule:
        """Which regions of the inputs make the given regions of the outputs (tensor parallelism).

        Optional (the default has no rule). ``regions`` holds, per output slot, the part a rank
        needs (:data:`surgery.parallel.regions.SlotRegion`, dims non-negative, ``None`` for all of it);
        ``in_shapes``/``out_shapes`` are the slots' global shapes. Return the inputs' regions and
        the op that turns the local input pieces into exactly the local output pieces, or
        ``None`` when no such rule exists: the loader then reads the sources whole and keeps the
        rank's part of the result (a reported fallback), so a missing rule costs bytes, never
        correctness.
        """
        return None

    def _fail(self, ctx: OpContext, message: str) -> ConversionError:
        return ConversionError(f"{self!r}{_at(ctx)}: {message}")


def _at(ctx: OpContext) -> str:
    """`` in <transform> for target <keys> from <keys>`` (empty when the context names nothing)."""
    where = ctx.where()
    return f" {where}" if where else ""


def _one_tensor(op: ConversionOp, slots: list[Slot], ctx: OpContext) -> torch.Tensor:
    if len(slots) != 1:
        raise op._fail(ctx, f"expects exactly one input tensor, got {len(slots)} slots.")
    (slot,) = slots
    if isinstance(slot, list):
        if len(slot) != 1:
            raise op._fail(
                ctx,
                f"got a list of {len(slot)} tensors gathered by '*'; merge them first with MergeModulelist.",
            )
        return slot[0]
    return slot


def _config_value(config: Any, path: str) -> Any:
    """``config.a.b`` for ``path="a.b"``; ``None`` where a step is missing.

    A config that lacks the leading steps is taken to be that sub-config itself (an entry for a
    vision tower, resolved at the tower, sees the tower's config): ``b`` is read from it directly.
    """
    names = path.split(".")
    for start in range(len(names)):
        value = config
        for name in names[start:]:
            value = getattr(value, name, None) if value is not None else None
        if value is not None:
            return value
        if start + 1 < len(names) and hasattr(config, names[start]):
            return None  # the sub-config is there but lacks the attribute: no fallback
    return None


def _per_tensor(slots: list[Slot], fn) -> list[Slot]:
    return [[fn(t) for t in s] if isinstance(s, list) else fn(s) for s in slots]


def _check_dim(op: ConversionOp, ctx: OpContext, t: torch.Tensor, dim: int) -> None:
    if not -t.ndim <= dim < t.ndim:
        raise op._fail(ctx, f"dim={dim} is out of range for a tensor of shape {tuple(t.shape)}.")


class _NoRule(Exception):
    """Raised inside a slice rule: these regions have no exact rule."""


def _per_tensor_rule(regions: list[SlotRegion], in_shapes: list[Any], fn) -> list[SlotRegion] | None:
    """Apply ``fn(region, input_shape) -> Region`` to every sharded tensor of every slot."""
    out: list[SlotRegion] = []
    try:
        for r, s in zip(regions, in_shapes):
            if isinstance(s, list):
                items = r if isinstance(r, list) else [r] * len(s)
                out.append(
                    [x if x is None or x is NOT_NEEDED else fn(x, tuple(sh)) for x, sh in zip(items, s)]
                )
            else:
                out.append(None if r is None else fn(r, tuple(s)))
    except _NoRule:
        return None
    return out


def _split_rule(
    op: ConversionOp, dim: int, regions: list[SlotRegion], in_shapes: list[Any], out_shapes: list[Any]
):
    """The rule of Chunk/Split: one input cut into consecutive parts along ``dim``."""
    if len(in_shapes) != 1 or isinstance(in_shapes[0], list) or any(isinstance(s, list) for s in out_shapes):
        return None
    shape = tuple(in_shapes[0])
    c = dim % len(shape)
    sizes = [s[c] for s in out_shapes]
    if any(r is not None and not isinstance(r, Region) for r in regions):
        return None
    sharded = [r for r in regions if isinstance(r, Region)]
    if all(r.dim != c for r in sharded):  # across the split: every part needs the same region
        if len(sharded) != len(regions) or len(set(sharded)) != 1:
            return None
        return [sharded[0]], Split(sizes=tuple(sizes), dim=c)
    if any(r.dim != c for r in sharded):
        return None
    intervals: list[tuple[int, int]] = []
    local_sizes: list[int] = []
    offset = 0
    for r, size in zip(regions, sizes):
        part = r if isinstance(r, Region) else Region(c, ((0, size),))
        intervals.extend((a + offset, b + offset) for a, b in part.intervals)
        local_sizes.append(part.size)
        offset += size
    return [Region.of(c, intervals)], Split(sizes=tuple(local_sizes), dim=c)


@dataclass(frozen=True)
class Chunk(ConversionOp):
    """Split one tensor into equal parts along ``dim`` (``chunks`` parts, default: one per target).

    Refuses a dimension it cannot divide evenly; use :class:`Split` for unequal parts.
    """

    dim: int = 0
    chunks: int | None = None

    def __post_init__(self) -> None:
        if self.chunks is not None and self.chunks < 1:
            raise ConversionError(f"Chunk(chunks={self.chunks}): chunks must be a positive integer.")

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        t = _one_tensor(self, slots, ctx)
        _check_dim(self, ctx, t, self.dim)
        n = self.chunks or ctx.n_targets
        size = t.shape[self.dim]
        if size % n:
            raise self._fail(
                ctx,
                f"cannot split dim {self.dim} of size {size} (shape {tuple(t.shape)}) into {n} equal parts; "
                "use Split(sizes=...) for unequal parts (e.g. grouped-query q/k/v).",
            )
        return [c.contiguous() for c in torch.tensor_split(t, n, dim=self.dim)]

    @property
    def reverse_op(self) -> ConversionOp:
        return Concatenate(dim=self.dim)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Each output's region, shifted by its offset: q/k/v from a fused ``qkv`` read three row ranges."""
        return _split_rule(self, self.dim, regions, in_shapes, out_shapes)


@dataclass(frozen=True)
class Split(ConversionOp):
    """Split one tensor along ``dim`` into parts of the given ``sizes``.

    With ``sizes=None`` each part takes the size of its target (the model parameter when loading,
    the recorded checkpoint tensor when saving); with no known target shapes the split is equal.
    """

    sizes: tuple[int, ...] | None = None
    dim: int = 0

    def __post_init__(self) -> None:
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
            if not self.sizes or any(s < 0 for s in self.sizes):
                raise ConversionError(f"Split(sizes={self.sizes}): sizes must be non-negative and non-empty.")

    def _sizes(self, t: torch.Tensor, ctx: OpContext) -> list[int]:
        if self.sizes is not None:
            return list(self.sizes)
        shapes = ctx.target_shapes
        if shapes and all(s is not None and len(s) == t.ndim and s[self.dim] >= 0 for s in shapes):
            return [s[self.dim] for s in shapes]  # type: ignore[index]
        n = ctx.n_targets
        size = t.shape[self.dim]
        if size % n:
            raise self._fail(
                ctx,
                f"no target shapes are known and dim {self.dim} of size {size} does not split into {n} "
                "equal parts; pass Split(sizes=...).",
            )
        return [size // n] * n

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        t = _one_tensor(self, slots, ctx)
        _check_dim(self, ctx, t, self.dim)
        sizes = self._sizes(t, ctx)
        if sum(sizes) != t.shape[self.dim]:
            raise self._fail(
                ctx,
                f"sizes {sizes} add up to {sum(sizes)} but dim {self.dim} of shape {tuple(t.shape)} "
                f"has {t.shape[self.dim]}.",
            )
        return [c.contiguous() for c in torch.split(t, sizes, dim=self.dim)]

    @property
    def reverse_op(self) -> ConversionOp:
        return Concatenate(dim=self.dim, sizes=self.sizes)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Each output's region, shifted by its offset: q/k/v from a fused ``qkv`` read three row ranges."""
        return _split_rule(self, self.dim, regions, in_shapes, out_shapes)


@dataclass(frozen=True)
class Concatenate(ConversionOp):
    """Concatenate every slot, in source-pattern order, along ``dim`` into one tensor.

    With ``sizes`` (one per slot, along ``dim``) the inputs must have exactly those sizes, and the
    reverse is ``Split(sizes=sizes)``, which needs no recorded shapes; without it the reverse takes
    each part's size from its target.
    """

    dim: int = 0
    sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.sizes is not None:
            object.__setattr__(self, "sizes", tuple(int(s) for s in self.sizes))
            if not self.sizes or any(s < 0 for s in self.sizes):
                raise ConversionError(
                    f"Concatenate(sizes={self.sizes}): sizes must be non-negative and non-empty."
                )

    def __repr__(self) -> str:
        sizes = "" if self.sizes is None else f", sizes={self.sizes}"
        return f"Concatenate(dim={self.dim}{sizes})"

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        if not slots:
            raise self._fail(ctx, "got no tensors to concatenate.")
        tensors: list[torch.Tensor] = []
        for s in slots:
            if isinstance(s, list):
                raise self._fail(ctx, "got a list gathered by '*'; merge it first with MergeModulelist.")
            tensors.append(s)
        first = tensors[0]
        _check_dim(self, ctx, first, self.dim)
        for t in tensors[1:]:
            same_rest = t.ndim == first.ndim and all(
                a == b for i, (a, b) in enumerate(zip(t.shape, first.shape)) if i != self.dim % first.ndim
            )
            if not same_rest or t.dtype != first.dtype:
                raise self._fail(
                    ctx,
                    "inputs must agree in every dim but "
                    f"{self.dim} and in dtype; got {[tuple(x.shape) for x in tensors]} "
                    f"with dtypes {sorted({str(x.dtype) for x in tensors})}.",
                )
        if self.sizes is not None:
            got = tuple(t.shape[self.dim] for t in tensors)
            if got != self.sizes:
                raise self._fail(
                    ctx, f"expected inputs of sizes {self.sizes} along dim {self.dim}, got {got}."
                )
        return [meta.cat(tensors, self.dim)]

    @property
    def reverse_op(self) -> ConversionOp:
        return Split(sizes=self.sizes, dim=self.dim)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Across ``dim`` every input gets the output's region; along it, each input its share."""
        (region,) = regions
        if not isinstance(region, Region) or any(isinstance(s, list) for s in in_shapes):
            return None
        c = self.dim % len(in_shapes[0])
        if region.dim != c:
            return [region] * len(in_shapes), self
        out: list[SlotRegion] = []
        offset = 0
        for shape in in_shapes:
            out.append(intersect(region, offset, offset + shape[c]))
            offset += shape[c]
        return out, self


@dataclass(frozen=True)
class MergeModulelist(ConversionOp):
    """Stack each gathered list (``experts.*``) into one tensor along a new ``dim``."""

    dim: int = 0

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        out: list[Slot] = []
        for s in slots:
            items = s if isinstance(s, list) else [s]
            if not items:
                raise self._fail(ctx, "got an empty list of tensors.")
            shapes = {tuple(t.shape) for t in items}
            if len(shapes) != 1 or len({t.dtype for t in items}) != 1:
                raise self._fail(ctx, f"cannot stack tensors of different shapes/dtypes: {sorted(shapes)}.")
            ndim = items[0].ndim
            if not -(ndim + 1) <= self.dim <= ndim:
                raise self._fail(ctx, f"dim {self.dim} is out of range for stacking {ndim}-d tensors.")
            out.append(meta.stack(items, self.dim))
        return out

    @property
    def reverse_op(self) -> ConversionOp:
        return SplitModulelist(dim=self.dim)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """On the stacked dim only the items in the region are read; on others every item gets it."""
        out: list[SlotRegion] = []
        for region, items, stacked in zip(regions, in_shapes, out_shapes):
            if region is None:
                out.append(None)
                continue
            if not isinstance(region, Region) or not isinstance(items, list):
                return None
            m = self.dim % len(stacked)
            if region.dim == m:
                keep = {i for a, b in region.intervals for i in range(a, b)}
                if not keep:
                    return None  # stacking nothing has no local op; the fallback handles it
                out.append([None if i in keep else NOT_NEEDED for i in range(len(items))])
            else:
                out.append([region.on(region.dim if region.dim < m else region.dim - 1)] * len(items))
        return out, self

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        if not -len(shape) <= self.dim < len(shape):
            return None
        d = self.dim % len(shape)
        return shape[:d] + shape[d + 1 :]


@dataclass(frozen=True)
class SplitModulelist(ConversionOp):
    """Unstack each tensor along ``dim`` into a list (one entry per index of the target's ``*``)."""

    dim: int = 0

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        out: list[Slot] = []
        for s in slots:
            if isinstance(s, list):
                raise self._fail(ctx, "expects tensors, got a list; it splits stacked tensors.")
            _check_dim(self, ctx, s, self.dim)
            if s.shape[self.dim] == 0:
                raise self._fail(
                    ctx, f"dim {self.dim} of shape {tuple(s.shape)} is empty: there is nothing to unstack."
                )
            out.append([t.contiguous() for t in torch.unbind(s, dim=self.dim)])
        return out

    @property
    def reverse_op(self) -> ConversionOp:
        return MergeModulelist(dim=self.dim)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Every item sharded alike: the stacked input gets that region (one dim further past ``dim``)."""
        out: list[SlotRegion] = []
        for region, shape in zip(regions, in_shapes):
            if region is None:
                out.append(None)
                continue
            if not isinstance(region, list) or len(set(region)) != 1 or not isinstance(region[0], Region):
                return None
            m = self.dim % len(shape)
            r = region[0]
            out.append(r.on(r.dim if r.dim < m else r.dim + 1))
        return out, self

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        n = len(shape) + 1  # the stacked tensor has one more dim, of unknown size
        if not -n <= self.dim < n:
            return None
        d = self.dim % n
        return (*shape[:d], -1, *shape[d:])


@dataclass(frozen=True)
class Transpose(ConversionOp):
    """Swap ``dim0`` and ``dim1`` of every tensor.

    With ``when_shape_differs=True`` a tensor that already has its target's shape passes through
    (a checkpoint saved in the runtime layout under the same key name); a target square in the
    two dims cannot tell the layouts apart and is refused. With no known target shape (saving a
    model that was never loaded) the tensor is transposed.
    """

    dim0: int = 0
    dim1: int = 1
    when_shape_differs: bool = False

    def __post_init__(self) -> None:
        if self.when_shape_differs and self.dim0 == self.dim1:
            raise ConversionError(
                f"Transpose({self.dim0}, {self.dim1}, when_shape_differs=True) swaps a dim with itself: "
                "give two different dims."
            )

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        targets = ctx.target_shapes or ()

        def fn(t: torch.Tensor, target: tuple[int, ...] | None) -> torch.Tensor:
            _check_dim(self, ctx, t, self.dim0)
            _check_dim(self, ctx, t, self.dim1)
            if self.when_shape_differs and target is not None:
                if len(target) != t.ndim or sorted(target) != sorted(t.shape):
                    raise self._fail(
                        ctx,
                        f"the target shape {tuple(target)} is neither {tuple(t.shape)} nor its transpose: "
                        "use Transpose(when_shape_differs=True) alone or as the last op of a chain.",
                    )
                if t.shape[self.dim0] == t.shape[self.dim1]:
                    raise self._fail(
                        ctx,
                        f"dims {self.dim0} and {self.dim1} of shape {tuple(t.shape)} are equal, so the "
                        "checkpoint's layout cannot be told from the runtime layout; register a "
                        "mapping for this model with a plain Transpose() (hub layout) or none "
                        "(runtime layout) under its class name, with overwrite=True.",
                    )
                if tuple(t.shape) == tuple(target):
                    return t
            return t.transpose(self.dim0, self.dim1).contiguous()

        out: list[Slot] = []
        for n, s in enumerate(slots):
            target = targets[n] if n < len(targets) else None
            out.append([fn(t, target) for t in s] if isinstance(s, list) else fn(s, target))
        return out

    @property
    def reverse_op(self) -> ConversionOp:
        return Transpose(dim0=self.dim1, dim1=self.dim0, when_shape_differs=self.when_shape_differs)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """The region moves to the swapped dim (a shape-dependent transpose has no rule)."""
        if self.when_shape_differs:
            return None

        def fn(r: Region, shape: tuple[int, ...]) -> Region:
            a, b = self.dim0 % len(shape), self.dim1 % len(shape)
            return r.on(b if r.dim == a else a if r.dim == b else r.dim)

        got = _per_tensor_rule(regions, in_shapes, fn)
        return None if got is None else (got, self)

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        n = len(shape)
        if self.when_shape_differs or not (-n <= self.dim0 < n and -n <= self.dim1 < n):
            return None
        out = list(shape)
        a, b = self.dim0 % n, self.dim1 % n
        out[a], out[b] = out[b], out[a]
        return tuple(out)


@dataclass(frozen=True)
class PermuteForRope(ConversionOp):
    """Permute q/k projection rows from interleaved (complex) RoPE pairs to the split-half layout.

    The head count is explicit per target: give ``num_heads`` directly, or ``config_attribute``
    (e.g. ``"num_key_value_heads"`` for a grouped-query ``k_proj``, or a dotted path such as
    ``"vision_config.num_attention_heads"``) to read it from the sub-model's config.
    ``inverse=True`` is the reverse permutation. After a ``Chunk`` of a fused ``qkv``, ``slots``
    names the tensors to permute (``(0, 1)``: q and k, not v); by default every tensor is.
    """

    num_heads: int | None = None
    config_attribute: str | None = None
    inverse: bool = False
    slots: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if (self.num_heads is None) == (self.config_attribute is None):
            raise ConversionError(
                "PermuteForRope needs exactly one of num_heads=... or config_attribute=... "
                "(the head count of *this* target: use the key/value head count for k_proj)."
            )
        if self.num_heads is not None and self.num_heads < 1:
            raise ConversionError(f"PermuteForRope(num_heads={self.num_heads}): must be positive.")
        if self.slots is not None:
            slots = tuple(self.slots) if isinstance(self.slots, (tuple, list)) else None
            if not slots or any(isinstance(i, bool) or not isinstance(i, int) for i in slots):
                raise ConversionError(
                    f"PermuteForRope(slots={self.slots!r}): give a non-empty tuple of tensor positions, "
                    "e.g. slots=(0, 1) for q and k after a Chunk of a fused qkv."
                )
            object.__setattr__(self, "slots", slots)

    def _heads(self, ctx: OpContext) -> int:
        if self.num_heads is not None:
            return self.num_heads
        cfg = ctx.config
        value = _config_value(cfg, self.config_attribute)  # type: ignore[arg-type]
        dotted = "." in (self.config_attribute or "")  # names its sub-config: never the text one
        if value is None and not dotted and cfg is not None and hasattr(cfg, "get_text_config"):
            value = _config_value(cfg.get_text_config(), self.config_attribute)  # type: ignore[arg-type]
        if not isinstance(value, int) or value < 1:
            raise self._fail(
                ctx,
                f"the model config has no positive integer {self.config_attribute!r}; pass num_heads=... instead.",
            )
        return value

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        heads = self._heads(ctx)

        def fn(t: torch.Tensor) -> torch.Tensor:
            if t.ndim not in (1, 2):
                raise self._fail(ctx, f"expects a 1-D bias or a 2-D weight, got shape {tuple(t.shape)}.")
            rows = t.shape[0]
            if rows % (2 * heads):
                raise self._fail(
                    ctx,
                    f"shape {tuple(t.shape)} does not hold {heads} heads of even size along dim 0.",
                )
            half = rows // heads // 2
            inner = (2, half) if self.inverse else (half, 2)
            rest = tuple(t.shape[1:])
            return t.reshape(heads, *inner, *rest).transpose(1, 2).reshape(rows, *rest).contiguous()

        if self.slots is None:
            return _per_tensor(slots, fn)
        if any(not -len(slots) <= i < len(slots) for i in self.slots):
            raise self._fail(ctx, f"slots={self.slots} is out of range for {len(slots)} tensors.")
        chosen = {i % len(slots) for i in self.slots}
        return [_per_tensor([s], fn)[0] if i in chosen else s for i, s in enumerate(slots)]

    @property
    def reverse_op(self) -> ConversionOp:
        return PermuteForRope(
            self.num_heads, self.config_attribute, inverse=not self.inverse, slots=self.slots
        )

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Whole heads on dim 0 keep their rows (local op: the local head count); dim 1 passes."""
        if self.slots is not None:
            return None  # a partial permutation: sharded reads take the whole tensors
        try:
            heads = self._heads(ctx)
        except ConversionError:
            return None
        local: set[int] = set()

        def fn(r: Region, shape: tuple[int, ...]) -> Region:
            if r.dim != 0:
                return r
            per_head = shape[0] // heads
            if not per_head or any(a % per_head or b % per_head for a, b in r.intervals):
                raise _NoRule
            local.add(r.size // per_head)
            return r

        got = _per_tensor_rule(regions, in_shapes, fn)
        if got is None or len(local) > 1:
            return None
        if not local:
            return got, self
        return got, PermuteForRope(num_heads=local.pop(), inverse=self.inverse)

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        return shape


@dataclass(frozen=True)
class Interleave(ConversionOp):
    """De-interleave ``dim``: ``[a0, b0, a1, b1, ...]`` becomes ``[a0, a1, ..., b0, b1, ...]``.

    ``inverse=True`` interleaves the two halves again.
    """

    dim: int = 0
    inverse: bool = False

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        def fn(t: torch.Tensor) -> torch.Tensor:
            _check_dim(self, ctx, t, self.dim)
            d = self.dim % t.ndim
            size = t.shape[d]
            if size % 2:
                raise self._fail(ctx, f"dim {self.dim} of shape {tuple(t.shape)} has odd size {size}.")
            shape = list(t.shape)
            shape[d : d + 1] = [2, size // 2] if self.inverse else [size // 2, 2]
            return t.reshape(shape).transpose(d, d + 1).reshape(t.shape).contiguous()

        return _per_tensor(slots, fn)

    @property
    def reverse_op(self) -> ConversionOp:
        return Interleave(dim=self.dim, inverse=not self.inverse)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Other dims pass; on ``dim`` a packed region (the same rows of both halves) is one
        contiguous input range, and the reverse for ``inverse=True``."""

        def fn(r: Region, shape: tuple[int, ...]) -> Region:
            d = self.dim % len(shape)
            if r.dim != d:
                return r
            half = shape[d] // 2
            if self.inverse:  # output pairs [a_i, b_i]: even-aligned rows come from both halves
                if any(a % 2 or b % 2 for a, b in r.intervals):
                    raise _NoRule
                firsts = [(a // 2, b // 2) for a, b in r.intervals]
                return Region.of(d, firsts + [(a + half, b + half) for a, b in firsts])
            low = intersect(r, 0, half)
            high = intersect(r, half, 2 * half)
            if low.intervals != high.intervals:
                raise _NoRule
            return Region.of(d, [(2 * a, 2 * b) for a, b in low.intervals])

        got = _per_tensor_rule(regions, in_shapes, fn)
        return None if got is None else (got, self)

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        return shape


def _kernel(kernel_size: Sequence[int]) -> tuple[int, int, int]:
    k = tuple(int(x) for x in kernel_size)
    if len(k) != 3 or any(x < 1 for x in k):
        raise ConversionError(f"kernel_size must be three positive integers, got {kernel_size!r}.")
    return k  # type: ignore[return-value]


@dataclass(frozen=True)
class Conv3dToLinear(ConversionOp):
    """Conv3d weight ``(out, C, T, P, P)`` → flattened Linear weight ``(out, C*T*P*P)``."""

    in_channels: int
    kernel_size: tuple[int, int, int] = field(default=(1, 1, 1))

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_size", _kernel(self.kernel_size))

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        t = _one_tensor(self, slots, ctx)
        expected = (self.in_channels, *self.kernel_size)
        if t.ndim != 5 or tuple(t.shape[1:]) != expected:
            raise self._fail(
                ctx,
                f"expects a Conv3d weight of shape (out, {', '.join(map(str, expected))}), got {tuple(t.shape)}.",
            )
        return [t.reshape(t.shape[0], math.prod(expected)).contiguous()]

    @property
    def reverse_op(self) -> ConversionOp:
        return LinearToConv3d(self.in_channels, self.kernel_size)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Dim 0 passes; dim 1 only in whole input channels (local op: the local channel count)."""
        ((region,), (shape,)) = regions, in_shapes
        if not isinstance(region, Region) or isinstance(shape, list):
            return None
        if region.dim == 0:
            return [region], self
        per_channel = math.prod(self.kernel_size)
        if any(a % per_channel or b % per_channel for a, b in region.intervals):
            return None
        channels = Region(1, tuple((a // per_channel, b // per_channel) for a, b in region.intervals))
        return [channels], Conv3dToLinear(channels.size, self.kernel_size)

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        return (shape[0], self.in_channels, *self.kernel_size) if len(shape) == 2 else None


@dataclass(frozen=True)
class LinearToConv3d(ConversionOp):
    """Flattened Linear weight ``(out, C*T*P*P)`` → Conv3d weight ``(out, C, T, P, P)``."""

    in_channels: int
    kernel_size: tuple[int, int, int] = field(default=(1, 1, 1))

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernel_size", _kernel(self.kernel_size))

    def convert(self, slots: list[Slot], ctx: OpContext) -> list[Slot]:
        t = _one_tensor(self, slots, ctx)
        fan_in = self.in_channels * math.prod(self.kernel_size)
        if t.ndim != 2 or t.shape[1] != fan_in:
            raise self._fail(ctx, f"expects a Linear weight of shape (out, {fan_in}), got {tuple(t.shape)}.")
        return [t.reshape(t.shape[0], self.in_channels, *self.kernel_size).contiguous()]

    @property
    def reverse_op(self) -> ConversionOp:
        return Conv3dToLinear(self.in_channels, self.kernel_size)

    def slice_rule(self, regions, in_shapes, out_shapes, ctx) -> SliceRule:
        """Dim 0 passes; a region of input channels reads those channels' columns."""
        ((region,), (shape,)) = regions, in_shapes
        if not isinstance(region, Region) or isinstance(shape, list) or region.dim not in (0, 1):
            return None
        if region.dim == 0:
            return [region], self
        per_channel = math.prod(self.kernel_size)
        columns = Region(1, tuple((a * per_channel, b * per_channel) for a, b in region.intervals))
        return [columns], LinearToConv3d(region.size, self.kernel_size)

    def input_shape(self, shape: tuple[int, ...]) -> tuple[int, ...] | None:
        return (shape[0], self.in_channels * math.prod(self.kernel_size)) if len(shape) == 5 else None


def run_chain(operations: Sequence[ConversionOp], slots: list[Slot], ctx: OpContext) -> list[Slot]:
    """Run ``operations`` in order over ``slots`` and check the chain ends with one slot per target.

    Each op sees ``ctx.target_shapes`` as they look right after it: the final shapes are carried
    back through the later ops with :meth:`ConversionOp.input_shape`, so the ``Split`` that undoes
    ``[MergeModulelist(0), Concatenate(1)]`` splits the stacked tensor by the per-expert sizes.

    Raises:
        ConversionError: from any op, or when the slot count does not match ``ctx.n_targets``.
    """
    stage_ctx = stage_contexts(operations, ctx)
    for op, op_ctx in zip(operations, stage_ctx):
        try:
            slots = op.convert(slots, op_ctx)
        except ConversionError:
            raise
        except Exception as exc:  # a custom op's own error: name the op and keys
            raise ConversionError(f"{op!r}{_at(ctx)} raised {type(exc).__name__}: {exc}") from exc
        if not isinstance(slots, list):
            raise ConversionError(
                f"{op!r}{_at(ctx)} returned {type(slots).__name__}; convert() must return a list of slots."
            )
    if len(slots) != ctx.n_targets:
        raise ConversionError(
            f"the op chain {list(operations)!r}{_at(ctx)} produced {len(slots)} tensors for "
            f"{ctx.n_targets} target pattern(s); add a Chunk/Split or Concatenate so the counts agree."
        )
    return slots


def stage_contexts(operations: Sequence[ConversionOp], ctx: OpContext) -> list[OpContext]:
    """One context per op, whose ``target_shapes`` are the final ones carried back to that op.

    Use it when running ops one by one instead of through :func:`run_chain`.
    """
    contexts = [ctx] * len(operations)
    shapes = ctx.target_shapes
    if shapes is None:
        return contexts
    for k in range(len(operations) - 1, -1, -1):
        if shapes is not ctx.target_shapes:
            contexts[k] = replace(ctx, target_shapes=shapes)
        earlier = tuple(None if s is None else operations[k].input_shape(tuple(s)) for s in shapes)
        if any(e is None and s is not None for e, s in zip(earlier, shapes)):
            break  # this op does not say; earlier ops see the final shapes
        shapes = earlier
    return contexts


def reverse_chain(operations: Sequence[ConversionOp]) -> list[ConversionOp]:
    """The inverse chain: each op's ``reverse_op``, in reverse order."""
    return [op.reverse_op for op in reversed(operations)]
