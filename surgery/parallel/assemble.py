"""A DTensor assembled whole on one rank, from the local shards of the ranks that hold its parts.

A rank's local shard of a DTensor is the whole tensor indexed, on each tensor dim, by a list of
global indices (:func:`local_indices`): every ``Shard(d)`` and ``_StridedShard(d, sf)`` placement
narrows the list of dim ``d`` in mesh-dim order (torch's left-to-right convention), ``Replicate``
leaves it. So the shard is a product of per-dim index lists, and its place in the whole tensor
is a few boxes (:func:`boxes`: one per combination of contiguous runs; one box for ``Shard``,
``split_factor`` runs on a dim for ``_StridedShard``).

:func:`assemble_on` moves one DTensor to an ``owner`` rank with point-to-point messages: the
ranks of the owner's mesh whose shards are distinct (one rank per region: the replicas on a
``Replicate`` mesh dim are skipped) send theirs, the owner writes each into place, and every
other rank does nothing. No rank ever holds the whole tensor but the owner, who holds it once.

Example:
    >>> from torch.distributed.tensor import Shard, Replicate
    >>> local_indices((4, 6), (2, 2), (1, 0), [Shard(0), Shard(1)])
    ([2, 3], [0, 1, 2])
    >>> boxes(([2, 3], [0, 1, 2]))
    [((2, 0), (0, 0), (2, 3))]
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

import torch

from ..errors import ConfigurationError

__all__ = ["assemble_on", "boxes", "local_indices", "torch_misreads", "whole_on_every_rank"]

Box = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]
"""``(start in the whole tensor, start in the local shard, size)``, per tensor dim."""


def _chunk(indices: Sequence[int], chunks: int, i: int) -> list[int]:
    """Chunk ``i`` of ``chunks`` of ``indices``, as ``torch.chunk`` cuts (the last ones may be short or empty)."""
    size = -(-len(indices) // chunks)
    return list(indices[min(i * size, len(indices)) : min((i + 1) * size, len(indices))])


def local_indices(
    shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int], placements: Sequence[Any]
) -> tuple[list[int], ...]:
    """The global indices, per tensor dim, of the local shard at mesh ``coordinate``.

    Mesh dims apply in order, each narrowing the indices of the dim it shards; ``_StridedShard(d,
    split_factor=sf)`` cuts the current indices of ``d`` into ``sf`` pieces and keeps chunk
    ``coordinate`` of each (a packed weight's halves, each sharded). One exception, for what
    FSDP2 builds: a ``_StridedShard`` whose ``sf`` is the product of the sizes of the later mesh
    dims that shard the same tensor dim marks a shard taken *after* them ("right to left": FSDP2
    chunks dim 0 of the tensor TP left); it applies once they have, as a plain chunk. Where the
    later dims are plain ``Shard`` both readings give the same indices (torch's arithmetic); where
    one is itself a ``_StridedShard`` (FSDP2 over a packed TP placement) only this one matches
    the data FSDP2 holds.

    Raises:
        ConfigurationError: a placement that is neither ``Replicate``, ``Shard`` nor
            ``_StridedShard`` (``Partial``: the values are not known until they are reduced).
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    indices = [list(range(n)) for n in shape]
    after: list[tuple[int, int, int]] = []  # (dim, chunks, coordinate) of right-to-left shards
    for mesh_dim, p in enumerate(placements):
        chunks, i = int(mesh_shape[mesh_dim]), int(coordinate[mesh_dim])
        if isinstance(p, _StridedShard):
            sf = int(p.split_factor)
            later = math.prod(
                int(mesh_shape[j])
                for j in range(mesh_dim + 1, len(placements))
                if isinstance(placements[j], (Shard, _StridedShard)) and placements[j].dim == p.dim
            )
            if later == sf:
                after.append((p.dim, chunks, i))
                continue
            pieces = [_chunk(indices[p.dim], sf, j) for j in range(sf)]
            indices[p.dim] = [k for piece in pieces for k in _chunk(piece, chunks, i)]
        elif isinstance(p, Shard):
            indices[p.dim] = _chunk(indices[p.dim], chunks, i)
        elif not isinstance(p, Replicate):
            raise ConfigurationError(
                f"Cannot assemble a DTensor with placement {p!r} on mesh dim {mesh_dim}: only Replicate, "
                "Shard and _StridedShard are known. Redistribute it (e.g. to Replicate()) before saving."
            )
    for dim, chunks, i in reversed(after):
        indices[dim] = _chunk(indices[dim], chunks, i)
    return tuple(indices)


def _runs(indices: Sequence[int]) -> list[tuple[int, int, int]]:
    """``indices`` as contiguous runs: ``(global start, local start, length)``."""
    runs: list[tuple[int, int, int]] = []
    for local, g in enumerate(indices):
        if runs and runs[-1][0] + runs[-1][2] == g:
            start, at, n = runs[-1]
            runs[-1] = (start, at, n + 1)
        else:
            runs.append((g, local, 1))
    return runs


def boxes(indices: Sequence[Sequence[int]]) -> list[Box]:
    """The boxes a local shard with per-dim ``indices`` fills in the whole tensor (none if it is empty)."""
    per_dim = [_runs(ix) for ix in indices]
    return [
        (tuple(r[0] for r in combo), tuple(r[1] for r in combo), tuple(r[2] for r in combo))
        for combo in itertools.product(*per_dim)
    ]


def _narrow(t: torch.Tensor, start: Sequence[int], size: Sequence[int]) -> torch.Tensor:
    for d, (a, n) in enumerate(zip(start, size)):
        t = t.narrow(d, a, n)
    return t


def _coordinates(mesh_ranks: torch.Tensor) -> dict[int, tuple[int, ...]]:
    """Each global rank of a mesh's rank tensor, with its coordinate."""
    flat = mesh_ranks.flatten().tolist()
    return dict(zip(flat, itertools.product(*(range(n) for n in mesh_ranks.shape))))


def _senders(mesh: Any, placements: Sequence[Any], owner: int) -> list[tuple[int, tuple[int, ...]]]:
    """``(global rank, coordinate)`` of the ranks whose shards make up the tensor, seen from ``owner``:
    on every mesh dim that does not shard, the owner's own coordinate (no replica is sent twice)."""
    from torch.distributed.tensor import Replicate

    coordinates = _coordinates(mesh.mesh)
    at = coordinates[owner]
    keep = [d for d, p in enumerate(placements) if isinstance(p, Replicate)]
    return sorted((r, c) for r, c in coordinates.items() if all(c[d] == at[d] for d in keep))


def assemble_on(t: Any, owner: int, group: Any) -> torch.Tensor | None:
    """The whole value of DTensor ``t`` on global rank ``owner``; ``None`` on every other rank.

    Collective over the ranks of ``owner``'s mesh (point-to-point on ``group``, which holds them):
    every rank of ``group`` calls it with the same ``owner``, in the same order as the others;
    a rank outside the owner's mesh (another sub-mesh of the same root) returns at once.
    The bytes travel as ``uint8`` (any dtype, float8 included, over any backend).
    """
    import torch.distributed as dist

    mesh, placements, shape = t.device_mesh, tuple(t.placements), tuple(t.shape)
    me = dist.get_rank()
    if owner not in {int(x) for x in mesh.mesh.flatten()}:
        return None
    senders = _senders(mesh, placements, owner)
    if me != owner:
        if any(r == me for r, _ in senders):
            local = t.to_local().contiguous()
            if local.numel():
                dist.send(local.reshape(-1).view(torch.uint8), dst=owner, group=group)
        return None
    if [r for r, _ in senders] == [me]:
        return t.to_local()  # replicated on every mesh dim: the owner holds it whole already
    whole = torch.empty(shape, dtype=t.dtype, device=t.to_local().device)
    for r, coordinate in senders:
        indices = local_indices(shape, tuple(mesh.mesh.shape), coordinate, placements)
        local_shape = tuple(len(ix) for ix in indices)
        if r == me:
            local = t.to_local()
        else:
            buffer = torch.empty(
                math.prod(local_shape) * t.dtype.itemsize, dtype=torch.uint8, device=whole.device
            )
            if buffer.numel():  # an empty shard (uneven sharding) is not sent
                dist.recv(buffer, src=r, group=group)
            local = buffer.view(t.dtype).view(local_shape)
        for start, at, size in boxes(indices):
            _narrow(whole, start, size).copy_(_narrow(local, at, size))
        del local
    return whole


def torch_misreads(placements: Sequence[Any]) -> bool:
    """Whether torch's own ``full_tensor()`` misplaces the parts of a DTensor with ``placements``:
    a ``_StridedShard`` read right to left (see :func:`local_indices`) over a later
    ``_StridedShard`` of the same dim, as FSDP2 over a packed TP placement makes (torch 2.13)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    strided = [(m, p) for m, p in enumerate(placements) if isinstance(p, _StridedShard)]
    return any(a.dim == b.dim for i, (_, a) in enumerate(strided) for _, b in strided[i + 1 :])


def whole_on_every_rank(t: Any, group: Any) -> torch.Tensor:
    """The whole value of DTensor ``t`` on every rank of its mesh: assembled on the mesh's lowest
    rank (:func:`assemble_on`), then sent to the others. Collective over ``t``'s mesh (several
    sub-meshes of one root each work on their own)."""
    import torch.distributed as dist

    ranks = sorted(int(x) for x in t.device_mesh.mesh.flatten())
    owner = ranks[0]
    whole = assemble_on(t, owner, group)
    if whole is not None:  # this rank is the owner
        data = whole.reshape(-1).view(torch.uint8)
        for r in ranks[1:]:
            if data.numel():
                dist.send(data, dst=r, group=group)
        return whole
    local = t.to_local()
    out = torch.empty(tuple(t.shape), dtype=t.dtype, device=local.device)
    if out.numel():
        dist.recv(out.reshape(-1).view(torch.uint8), src=owner, group=group)
    return out
