"""DTensors at run time: recognizing, gathering and building them.

Loading and saving a model work on plain tensors and DTensors alike. The helpers here answer
"is this a DTensor?" without importing ``torch.distributed.tensor`` (about a second): a DTensor
cannot exist before that module is imported, so until then the answer is no.

Example:
    >>> import torch
    >>> is_dtensor(torch.zeros(2)), full_tensor(torch.ones(1)).tolist()
    (False, [1.0])
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

__all__ = ["dtensor_type", "dtensors_of", "from_local", "full_tensor", "has_dtensors", "is_dtensor"]


def dtensor_type() -> type | None:
    """``DTensor`` when ``torch.distributed.tensor`` is already imported, else ``None`` (no import)."""
    module = sys.modules.get("torch.distributed.tensor")
    return None if module is None else module.DTensor


def is_dtensor(t: Any) -> bool:
    """Whether ``t`` is a DTensor (never imports ``torch.distributed.tensor``)."""
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def dtensors_of(model: nn.Module) -> list[Any]:
    """The parameters and buffers of ``model`` that are DTensors, in ``parameters()`` then ``buffers()`` order."""
    if dtensor_type() is None:
        return []
    return [t for t in itertools.chain(model.parameters(), model.buffers()) if is_dtensor(t)]


def has_dtensors(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is a DTensor."""
    if dtensor_type() is None:
        return False
    return any(is_dtensor(t) for t in itertools.chain(model.parameters(), model.buffers()))


def full_tensor(t: Any) -> Any:
    """A DTensor gathered whole (a collective: every rank of its mesh must ask, in the same order);
    anything else as it is."""
    return t.full_tensor() if is_dtensor(t) else t


def from_local(local: torch.Tensor, mesh: Any, placements: Sequence[Any], shape: Sequence[int]) -> Any:
    """The DTensor of global ``shape`` (contiguous strides) whose shard on this rank is ``local``.

    No data moves and nothing is checked across ranks: the caller built ``local`` as this rank's
    part under ``placements`` (one per mesh dim).
    """
    from torch.distributed.tensor import DTensor

    size = torch.Size(tuple(shape))
    stride = torch.empty(size, device="meta").stride()
    return DTensor.from_local(local, mesh, tuple(placements), run_check=False, shape=size, stride=stride)
