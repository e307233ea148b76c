"""Shape inference for a load plan: every converter's outputs, from headers, without data.

:func:`infer_outputs` runs a converter's op chain on ``meta`` tensors of the checkpoint shapes
(built-in ``cat``/``stack`` compute their meta shapes arithmetically, see :mod:`surgery.ops`), and
reuses the result for every later group of the same converter whose sources look the same: 32
layers of 1,024 experts stack their meta tensors once. :func:`op_context` is the context a chain
runs in (target count and shapes, the sub-model's config).
"""

from __future__ import annotations

from typing import Any

import torch

from .. import ops
from ..converter import Collector, WeightConverter, expand_outputs
from ..errors import SurgeryError
from ..ops import OpContext

__all__ = ["BUILTIN_OPS", "infer_outputs", "op_context"]


BUILTIN_OPS = frozenset(
    {
        ops.Chunk,
        ops.Concatenate,
        ops.Conv3dToLinear,
        ops.Interleave,
        ops.LinearToConv3d,
        ops.MergeModulelist,
        ops.PermuteForRope,
        ops.Split,
        ops.SplitModulelist,
        ops.Transpose,
    }
)
"""Op types whose output shapes depend only on input shapes/dtypes, ``n_targets``,
``target_shapes`` and ``config`` (never on key names), so a meta run can be reused."""


def infer_outputs(
    converter: WeightConverter,
    group_key: str,
    infos: list[Any],
    pattern_of: dict[str, tuple[int, tuple[int, ...]]],
    runtime: dict[str, torch.Tensor],
    config: Any,
    cache: dict[Any, list[Any]] | None = None,
) -> dict[str, torch.Tensor]:
    """Run the op chain on meta tensors: output names and shapes without reading data.

    ``cache`` (one per planning pass) reuses the outputs of an earlier group of the same
    converter whose sources had the same patterns, indices, shapes and dtypes and whose targets
    the same shapes: 32 layers of 1,024 experts then stack their meta tensors once, not 32 times.
    Only successful runs of built-in op chains are reused; anything else runs as before.
    """
    key = None
    if cache is not None and all(type(op) in BUILTIN_OPS for op in converter.operations):
        try:
            targets = converter.expand_target_keys(group_key)
            ctx = op_context(converter, group_key, runtime, config)
        except SurgeryError:
            targets = ()  # the uncached run below raises it, after the same steps as always
        else:
            key = (
                id(converter),
                ctx.n_targets,
                ctx.target_shapes,
                id(config),
                tuple((pattern_of[i.key], i.shape, i.dtype) for i in infos),
            )
            slots = cache.get(key)
            if slots is not None:
                return expand_outputs(targets, slots, converter)
    collector = Collector(converter)
    for info in infos:
        pat, idx = pattern_of[info.key]
        collector.add_tensor(
            group_key, info.key, pat, torch.empty(info.shape, dtype=info.dtype, device="meta"), index=idx
        )
    outputs = collector.convert(group_key, op_context(converter, group_key, runtime, config))
    if key is not None and cache is not None:
        slots = _output_slots(targets, outputs, converter)
        if slots is not None:
            cache[key] = slots
    return outputs


def _output_slots(
    targets: tuple[str, ...], outputs: dict[str, torch.Tensor], converter: WeightConverter
) -> list[Any] | None:
    """The chain's output slots behind ``outputs`` (undoing ``expand_outputs``), or ``None`` if unsure."""
    slots: list[Any] = []
    for t in targets:
        if "*" in t:
            items: list[torch.Tensor] = []
            while (name := t.replace("*", str(len(items)), 1)) in outputs:
                items.append(outputs[name])
            slots.append(items)
        elif t in outputs:
            slots.append(outputs[t])
        else:
            return None
    try:
        again = expand_outputs(targets, slots, converter)
    except SurgeryError:
        return None
    if list(again) != list(outputs) or any(again[k] is not outputs[k] for k in outputs):
        return None
    return slots


def op_context(
    converter: WeightConverter, group_key: str, runtime: dict[str, torch.Tensor], config: Any
) -> OpContext:
    targets = converter.expand_target_keys(group_key)
    shapes = tuple(tuple(runtime[k].shape) if k in runtime else None for k in targets)
    return OpContext(n_targets=len(targets), target_shapes=shapes, config=config)
