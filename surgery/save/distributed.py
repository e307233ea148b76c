"""A tensor-parallel save: every DTensor gathered whole, rank 0 writes, the other ranks follow.

What a save does across ranks: :func:`write_on_rank_zero` (rank 0 writes the files while the
others compute the same groups with it, each DTensor gathered with
:func:`surgery.parallel.full_tensor`, collective: every rank asks in the same order; a failure on
any rank is raised on every rank).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..casting import SavedFiles
from ..collective import Collective

__all__ = ["write_on_rank_zero"]


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
        return SavedFiles(casts=state.casts, requantized=state.requantized)
    with collective.step():
        files = write()
    collective.agree()
    return SavedFiles(files, casts=state.casts, requantized=state.requantized)
