"""Placement views: cut a destination tensor into the pieces a converter's sources fill.

When a converter's inverse op chain only splits and unbinds (``Concatenate`` and
``MergeModulelist`` forward, e.g. per-expert weights fused into one parameter), walking that
inverse chain over the fused parameter yields one *view* per source tensor. Loading reads each
source straight into its view (one copy, no intermediate tensor); saving slices the parameter
into its per-source checkpoint tensors without a copy. Shapes come from a ``meta`` run of the
forward chain, so no data is touched while deciding.

Example:
    >>> import torch
    >>> from surgery import WeightConverter, ops
    >>> conv = WeightConverter(["a", "b"], "ab", [ops.Concatenate(dim=0)])
    >>> fused = torch.arange(6.0)
    >>> views = placement_views(conv, fused, [(2,), (4,)], ops.OpContext(n_targets=1))
    >>> [v.tolist() for v in views]
    [[0.0, 1.0], [2.0, 3.0, 4.0, 5.0]]
"""

from __future__ import annotations

from typing import Any

import torch

from .converter import WeightConverter
from .errors import SurgeryError
from .ops import Chunk, Concatenate, MergeModulelist, OpContext, Split, SplitModulelist

__all__ = [
    "all_contiguous",
    "flatten_slots",
    "placement_views",
    "shape_of",
    "source_slot_shapes",
    "stage_shapes",
]


def _placement_ops(operations: Any) -> list[Any] | None:
    """The inverse chain, if every inverse op can be taken as views (split/unbind)."""
    inverse = [op.reverse_op for op in reversed(operations)]
    if all(isinstance(op, (Split, Chunk, SplitModulelist)) for op in inverse):
        return inverse
    return None


def stage_shapes(
    converter: WeightConverter, slots_shapes: list[Any], ctx: OpContext, *, operations: Any = None
) -> list[list[Any]]:
    """Shapes of the slots before each op of the chain (and after the last one).

    ``operations`` replaces the converter's chain (a rank's local chain under tensor parallelism).
    """
    chain = tuple(converter.operations if operations is None else operations)
    stages = _rule_stage_shapes(chain, slots_shapes)
    return stages if stages is not None else _meta_stage_shapes(chain, slots_shapes, ctx)


def _plain_shape(s: Any) -> bool:
    return isinstance(s, tuple) and all(type(d) is int and d >= 0 for d in s)


def _rule_stage_shapes(operations: tuple[Any, ...], slots_shapes: list[Any]) -> list[list[Any]] | None:
    """:func:`_meta_stage_shapes` by shape arithmetic, for the common chains of built-in ops.

    Covers chains of ``MergeModulelist`` and ``Concatenate`` on well-formed inputs only; anything
    else (custom ops, a check that would fail) returns ``None`` and takes the meta run, so errors
    and edge cases behave exactly as there. Stacking a thousand experts on ``meta`` tensors goes
    through torch's Python reference kernels, which costs milliseconds per call.
    """
    if not all(type(op) in (Concatenate, MergeModulelist) for op in operations):
        return None
    slots: list[Any] = []
    for s in slots_shapes:
        if isinstance(s, list):
            try:
                kinds = set(s)  # a thousand experts share a handful of shapes: check those
            except TypeError:
                return None
            if not all(_plain_shape(x) for x in kinds):
                return None
            slots.append(s if all(type(x) is tuple for x in kinds) else [tuple(x) for x in s])
        elif _plain_shape(s):
            slots.append(tuple(s))
        else:
            return None
    stages = [slots]
    for op in operations:
        out: list[Any] = []
        if type(op) is MergeModulelist:
            for s in slots:
                items = s if isinstance(s, list) else [s]
                if not items:
                    return None
                first = items[0]
                if len(set(items)) != 1:
                    return None
                nd = len(first) + 1
                if not -nd <= op.dim < nd:
                    return None
                d = op.dim % nd
                out.append((*first[:d], len(items), *first[d:]))
        else:  # Concatenate
            if not slots or any(isinstance(s, list) for s in slots):
                return None
            first = slots[0]
            nd = len(first)
            if not -nd <= op.dim < nd:
                return None
            d = op.dim % nd
            for t in slots[1:]:
                if len(t) != nd or t[:d] != first[:d] or t[d + 1 :] != first[d + 1 :]:
                    return None
            out.append((*first[:d], sum(t[d] for t in slots), *first[d + 1 :]))
        slots = out
        stages.append(slots)
    return stages


def _meta_stage_shapes(
    operations: tuple[Any, ...], slots_shapes: list[Any], ctx: OpContext
) -> list[list[Any]]:
    """Shapes of the slots before each op (meta run)."""

    def meta(s: Any) -> Any:
        return (
            [torch.empty(x, device="meta") for x in s]
            if isinstance(s, list)
            else torch.empty(s, device="meta")
        )

    slots = [meta(s) for s in slots_shapes]
    stages = [[shape_of(s) for s in slots]]
    for op in operations:
        slots = op.convert(slots, ctx)
        stages.append([shape_of(s) for s in slots])
    return stages


def placement_views(
    converter: WeightConverter,
    dest: torch.Tensor,
    slot_shapes: list[Any],
    ctx: OpContext,
    *,
    operations: Any = None,
) -> list[Any] | None:
    """Cut ``dest`` into one view per source tensor by walking the op chain backwards.

    ``slot_shapes`` holds, per source pattern, the source's shape (or the list of shapes of a
    gathered ``*`` source). Returns the slots of views (``None`` when the chain cannot be taken
    as views): reading each source into its view fills ``dest``, and slicing ``dest`` into them
    undoes the converter without a copy. ``operations`` replaces the converter's chain.
    """
    inverse = _placement_ops(converter.operations if operations is None else operations)
    if inverse is None:
        return None
    try:
        stages = stage_shapes(converter, slot_shapes, ctx, operations=operations)
    except (SurgeryError, RuntimeError):
        return None
    slots: list[Any] = [dest]
    for back, op in enumerate(inverse):
        before = stages[len(stages) - 2 - back]  # shapes of the forward op's inputs
        if isinstance(op, (Split, Chunk)):
            if len(slots) != 1 or isinstance(slots[0], list) or any(isinstance(s, list) for s in before):
                return None
            sizes = [s[op.dim] for s in before]
            slots = list(torch.split(slots[0], sizes, dim=op.dim))
        else:  # SplitModulelist
            if any(isinstance(s, list) for s in slots):
                return None
            slots = [list(torch.unbind(s, dim=op.dim)) for s in slots]
        if [shape_of(s) for s in slots] != before:
            return None
    return slots


def shape_of(s: Any) -> Any:
    """The shape of a slot: a tuple, or a list of tuples for a gathered (list) slot."""
    return [tuple(x.shape) for x in s] if isinstance(s, list) else tuple(s.shape)


def source_slot_shapes(
    conv: WeightConverter,
    src_keys: tuple[str, ...],
    pattern_of: dict[str, tuple[int, tuple[int, ...]]],
    infos: dict[str, Any],
) -> list[Any] | None:
    """Per source pattern of ``conv``: the source's shape, or the index-ordered list of shapes."""
    by_pattern: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}
    for src in src_keys:
        pat, idx = pattern_of[src]
        by_pattern.setdefault(pat, {})[idx] = tuple(infos[src].shape)
    out: list[Any] = []
    for i in range(len(conv.source_patterns)):
        got = by_pattern.get(i)
        if not got:
            return None
        if conv.gathers_from(i):
            out.append([got[ix] for ix in sorted(got)])
        else:
            out.append(next(iter(got.values())))
    return out


def flatten_slots(slots: list[Any]) -> list[torch.Tensor]:
    """The tensors of ``slots`` in order, list slots expanded in place."""
    out: list[torch.Tensor] = []
    for s in slots:
        out.extend(s if isinstance(s, list) else [s])
    return out


def all_contiguous(slots: list[Any]) -> bool:
    """Whether every tensor in ``slots`` is contiguous (so it can be read into or written as is)."""
    return all(t.is_contiguous() for t in flatten_slots(slots))
