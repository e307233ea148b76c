"""A tensor-parallel save: every DTensor gathered whole, rank 0 writes, the other ranks follow.

Everything a save does across ranks is here, so that the tensor-parallel package can take it
over as one piece: :func:`gathered` (a DTensor's ``full_tensor()``, collective: every rank asks in
the same order) and :func:`write_on_rank_zero` (rank 0 writes the files while the others compute
the same groups with it, for the gathers; a failure on any rank is raised on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..casting import SavedFiles
from ..collective import Collective
from ..parallel import dtensor_type

__all__ = [
    "gathered",
    "is_dtensor",
    "write_on_rank_zero",
]


def is_dtensor(t: torch.Tensor) -> bool:
    dtensor = dtensor_type()
    return dtensor is not None and isinstance(t, dtensor)


def gathered(t: Any) -> Any:
    """A DTensor gathered whole (collective: every rank asks, in the same order); anything else as is."""
    return t.full_tensor() if is_dtensor(t) else t


def write_on_rank_zero(collective: Collective, state: Any, write: Callable[[], list[Path]]) -> SavedFiles:
    """Rank 0 runs ``write`` (which looks every key of ``state`` up); every other rank looks up the same keys.

    Each rank computes the groups rank 0's writes compute, in its order, so the DTensors of each
    group are gathered together; once rank 0 has written (or failed) every rank returns (or
    raises the same error). One process: ``write`` runs, as a single step.

    Returns:
        The files written (rank 0; ``[]`` on the other ranks), with the casts made.
    """
    collective.agree()
    if collective.rank != 0:
        with collective.step():
            for key in state.specs:
                state[key]
        collective.agree()  # rank 0 has written (or failed): the files are there when this returns
        return SavedFiles(casts=state.casts)
    with collective.step():
        files = write()
    collective.agree()
    return SavedFiles(files, casts=state.casts)
