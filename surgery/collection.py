"""Collection: a converter's gathered tensors become op slots, and its outputs get their names.

:func:`gather_slots` orders what :meth:`~surgery.transforms.WeightConverter.add_tensor`
collected into the slots an op chain takes (one per source pattern; a gathering pattern's
tensors in wildcard-index order, after checking that no index is missing), and
:func:`expand_outputs` names the chain's output slots after the target keys.
"""

from __future__ import annotations

import itertools
import math
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from .errors import ConversionError
from .ops import Slot

if TYPE_CHECKING:
    from .transforms import WeightConverter

__all__ = ["expand_outputs", "gather_slots"]


def gather_slots(
    transform: WeightConverter,
    collected: dict[int, dict[tuple[int, ...], Any]],
    names: dict[int, dict[tuple[int, ...], str]],
    target_key: str,
) -> list[Slot]:
    """Order collected tensors into slots: one per source pattern, lists ordered by wildcard index.

    Raises:
        ConversionError: a source pattern has no tensor, or the indices have a gap.
    """
    slots: list[Slot] = []
    for i, sp in enumerate(transform._sources):
        got = collected.get(i)
        if not got:
            raise ConversionError(
                f"{transform!r}: no checkpoint key matched source pattern {sp.text!r} for target "
                f"{target_key!r}; the checkpoint is incomplete or the pattern is wrong."
            )
        if transform.gathers_from(i):
            indices = sorted(got)
            _check_complete(transform, sp.text, indices, names.get(i, {}), target_key)
            slots.append([_resolve(got[ix]) for ix in indices])
        else:
            if len(got) != 1:
                raise ConversionError(
                    f"{transform!r}: {len(got)} keys matched {sp.text!r} for {target_key!r}, expected one."
                )
            (value,) = got.values()
            slots.append(_resolve(value))
    return slots


def _check_complete(
    transform: WeightConverter,
    pattern: str,
    indices: list[tuple[int, ...]],
    names: dict[tuple[int, ...], str],
    target_key: str,
) -> None:
    """Gathered indices must run from 0 without a gap (and form a full grid for several wildcards)."""
    dims = len(indices[0])
    for d in range(dims):
        values = sorted({ix[d] for ix in indices})
        missing = sorted(set(range(values[-1] + 1)) - set(values))
        if missing:
            shown = ", ".join(map(str, missing[:8])) + (" ..." if len(missing) > 8 else "")
            example = names.get(indices[0], "")
            raise ConversionError(
                f"{transform!r}: index {shown} of {pattern!r} is missing for {target_key!r} "
                f"(found {len(values)} indices up to {values[-1]}, e.g. {example!r}). "
                "Every index from 0 must be present; the checkpoint is incomplete."
            )
    expected_count = math.prod(len({ix[d] for ix in indices}) for d in range(dims))
    if len(indices) != expected_count:
        present = set(indices)
        grid = itertools.product(*(sorted({ix[d] for ix in indices}) for d in range(dims)))
        absent = next(ix for ix in grid if ix not in present)
        raise ConversionError(
            f"{transform!r}: index {absent} of {pattern!r} is missing for {target_key!r}; the gathered "
            "indices must form a full grid. The checkpoint is incomplete."
        )


def _resolve(value: Any) -> Any:
    if isinstance(value, Future):
        return value.result()
    if callable(value) and not isinstance(value, torch.Tensor):
        return value()
    return value


def expand_outputs(
    targets: tuple[str, ...], out: list[Slot], transform: WeightConverter
) -> dict[str, torch.Tensor]:
    """Name the chain's output slots: a list output fills the target's ``*`` with its position."""
    result: dict[str, torch.Tensor] = {}
    for key, slot in zip(targets, out):
        if isinstance(slot, list):
            if "*" not in key:
                raise ConversionError(
                    f"{transform!r} produced {len(slot)} tensors for {key!r}, which has no '*' to number them; "
                    "add MergeModulelist or a '*' in the target."
                )
            for i, t in enumerate(slot):
                result[key.replace("*", str(i), 1)] = t
        else:
            if "*" in key:
                raise ConversionError(
                    f"{transform!r} produced one tensor for {key!r}, whose '*' needs a list; add SplitModulelist."
                )
            result[key] = slot
    return result
