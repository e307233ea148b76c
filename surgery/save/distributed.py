"""A distributed save: the files are shared out among the ranks, and no rank gathers the model.

:func:`write_distributed` is what :func:`~surgery.save.save_checkpoint` does across ranks:

1. Every rank plans the same files from metadata alone (:func:`~surgery.checkpoint.writer.plan_files`)
   and the same owner for each (:func:`assign_files`: the largest file first, to the rank with
   the fewest bytes so far).
2. Each rank writes its own files under temporary names. A file's values are computed one
   converter group at a time, as a single-process save computes them; the DTensors of a group
   are assembled whole only on the rank that owns it (:func:`~surgery.parallel.assemble.assemble_on`,
   point-to-point from the ranks that hold its parts). The ranks advance in *rounds*: in round
   ``i`` every owner's ``i``-th group is assembled, one owner after the other, then each rank
   computes its own; so the ranks compute and write in parallel and a rank holds, beyond its
   local shards, one group at a time.
3. After an agreement point (every file is on disk), rank 0 writes the index and commits with
   the same protocol as a single-process save (:mod:`surgery.checkpoint.commit`: the index, or
   the one file, is the commit point), then copies the configs.

Files and index are byte-identical to a single-process save's. A failure on any rank is raised
on every rank (:mod:`surgery.collective`): each round starts with an agreement point, and a round's
transfers come before anything that can fail, so no rank waits on a collective a failed rank
never enters. After a failure each rank removes the files it staged.
"""

from __future__ import annotations

import contextlib
import heapq
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch

from ..casting import Cast, SavedFiles
from ..checkpoint import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME
from ..checkpoint.commit import recover, save_token
from ..checkpoint.writer import (
    FilePlan,
    commit_files,
    create_directory,
    remove_directories,
    stage_file,
    staging,
)
from ..collective import Collective
from ..parallel import is_dtensor
from .reverted import RevertedState

__all__ = ["Run", "assign_files", "schedule", "write_distributed"]


def assign_files(nbytes: tuple[int, ...], ranks: int) -> tuple[int, ...]:
    """The rank that writes each file: largest file first, to the rank with the fewest bytes so far
    (ties: the lower rank, then the earlier file). Pure arithmetic: every rank computes the same.

    Example:
        >>> assign_files((10, 40, 30, 20), 2)
        (0, 0, 1, 1)
        >>> assign_files((5,), 4)
        (0,)
    """
    owners = [0] * len(nbytes)
    loads = [(0, r) for r in range(ranks)]
    for i in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        load, r = heapq.heappop(loads)
        owners[i] = r
        heapq.heappush(loads, (load + nbytes[i], r))
    return tuple(owners)


class Run(NamedTuple):
    """One computation of a group while a file is written: the group, and the file's keys it serves."""

    file: int
    group: int
    keys: tuple[str, ...]


def schedule(plan: FilePlan, state: RevertedState, owners: tuple[int, ...], ranks: int) -> list[list[Run]]:
    """Each rank's runs, in the order its writes look the values up (a group spanning two files
    is computed once for each)."""
    runs: list[list[Run]] = [[] for _ in range(ranks)]
    for i, keys in enumerate(plan.keys):
        mine = runs[owners[i]]
        for key in keys:
            g = state.group_index(key)
            if mine and mine[-1].file == i and mine[-1].group == g:
                mine[-1] = mine[-1]._replace(keys=(*mine[-1].keys, key))
            else:
                mine.append(Run(i, g, (key,)))
    return runs


class _Rounds(Mapping[str, torch.Tensor]):
    """This rank's values, looked up in its runs' order; each new run advances every rank one round."""

    def __init__(self, collective: Collective, state: RevertedState, runs: list[list[Run]]) -> None:
        self._collective, self._state, self._runs = collective, state, runs
        self._me = collective.rank
        self._round = 0
        self._rounds = max((len(r) for r in runs), default=0)
        self._cache: dict[str, torch.Tensor] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        mine = self._runs[self._me]
        if self._round == 0 or key not in mine[self._round - 1].keys:  # the next run: one round
            self._cache = {}  # the previous group's outputs go before the next group is assembled
            self._cache = self.advance()
            if key not in mine[self._round - 1].keys:
                raise KeyError(key)  # looked up out of the planned order: a bug, never a wrong value
        return self._cache[key]

    def __iter__(self) -> Iterator[str]:
        return (k for run in self._runs[self._me] for k in run.keys)

    def __len__(self) -> int:
        return sum(len(run.keys) for run in self._runs[self._me])

    def advance(self) -> dict[str, torch.Tensor]:
        """Run the next round: an agreement point, every owner's group assembled, this rank's computed."""
        i = self._round
        self._round += 1
        self._collective.agree()
        mine: tuple[int, dict[str, Any]] | None = None
        for owner, runs in enumerate(self._runs):
            if i < len(runs):
                sources = self._assemble(runs[i].group, owner)
                if owner == self._me:
                    mine = (runs[i].group, sources)
        if mine is None:
            return {}
        with self._collective.step():
            return self._state.compute_group(*mine)

    def drain(self) -> None:
        """The rounds left once this rank's files are written (it still sends its shards)."""
        while self._round < self._rounds:
            self.advance()

    def _assemble(self, group: int, owner: int) -> dict[str, Any]:
        """Group ``group``'s sources, whole, on ``owner`` (``{}`` elsewhere); a collective step."""
        from ..parallel.assemble import assemble_on

        out: dict[str, Any] = {}
        dst = self._collective.global_rank(owner)
        for key in self._state.group_sources(group):
            t = self._state.source(key)
            if is_dtensor(t):
                whole = assemble_on(t, dst, self._collective.group)
                if whole is not None:
                    out[key] = whole
            elif owner == self._me:
                out[key] = t
        return out if owner == self._me else {}


def write_distributed(
    collective: Collective, state: RevertedState, plan: FilePlan, finish: Callable[[], None]
) -> SavedFiles:
    """Every rank writes the files :func:`assign_files` gives it; rank 0 commits, then runs ``finish``.

    Every rank calls it with the same ``plan`` (see the module docstring).

    Returns:
        The files this rank wrote (rank 0 also the index), with every rank's dtype casts.
    """
    owners = assign_files(plan.nbytes, collective.size)
    runs = schedule(plan, state, owners, collective.size)
    rounds = _Rounds(collective, state, runs)
    me = collective.rank
    created: list[Path] = []  # rank 0 creates the directory, in the first step
    try:
        with save_token() as token, staging(plan, create=False) as staged:
            try:
                with collective.step():
                    if me == 0:
                        created = create_directory(plan)
                        recover(plan.directory, (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME))
                    _check_assemblable(state, runs[me])
                collective.agree()  # the directory is there, and every rank can assemble its groups
                with collective.step():
                    for i in (i for i, owner in enumerate(owners) if owner == me):
                        stage_file(plan, i, token, staged, rounds)
                    rounds.drain()
                collective.agree()  # every file is on disk
                everyone = collective.gather((list(staged), state.casts, state.requantized))
                with collective.step():
                    if me == 0:
                        by_name = {name: temp for part, _, _ in everyone for temp, name in part}
                        commit_files(plan, [(by_name[n], n) for n in plan.names], token)
                        finish()
                collective.agree()  # committed
            except BaseException:  # every rank raises here, after the same agreement point
                for temp, _ in staged:
                    with contextlib.suppress(OSError):
                        temp.unlink()
                with contextlib.suppress(Exception):
                    collective.agree()  # every rank's files are gone before rank 0 removes the directory
                raise
    except BaseException:
        remove_directories(created)
        with contextlib.suppress(Exception):
            collective.agree()  # no rank returns before the directory is gone: each sees nothing there
        raise
    mine = [plan.directory / name for i, name in enumerate(plan.names) if owners[i] == me]
    if me == 0 and plan.indexed:
        mine.append(plan.directory / SAFE_WEIGHTS_INDEX_NAME)
    requantized = {key for _, _, part in everyone for key in part}
    return SavedFiles(
        mine,
        casts=_merged_casts(state, [casts for _, casts, _ in everyone]),
        requantized=tuple(k for k in state.specs if k in requantized),
    )


def _check_assemblable(state: RevertedState, runs: list[Run]) -> None:
    """Refuse, before any transfer, a DTensor this rank's groups cannot be assembled from."""
    from ..parallel.assemble import local_indices

    for run in runs:
        for key in state.group_sources(run.group):
            t = state.source(key)
            if is_dtensor(t):
                mesh = t.device_mesh
                local_indices(tuple(t.shape), tuple(mesh.mesh.shape), (0,) * mesh.ndim, t.placements)


def _merged_casts(state: RevertedState, parts: list[tuple[Cast, ...]]) -> tuple[Cast, ...]:
    """Every rank's casts, in write order."""
    by_key = {c.key: c for part in parts for c in part}
    return tuple(by_key[k] for k in state.specs if k in by_key)
