"""A named n-D device mesh as plain numbers, for planning every rank's reads without processes.

A dry run (``plan_load(..., device_mesh={"dp_shard": 2, "tp": 2}, rank=r)``, ``surgery inspect
--mesh dp_shard=2,tp=2``) has no process group and so no ``DeviceMesh``. :class:`MeshShape`
holds what the arithmetic needs: the dim names and sizes, and a rank's coordinate on them (ranks
numbered row-major, as ``init_device_mesh`` numbers them). The names are torchtitan's:
``dp_replicate`` (HSDP's replicas), ``dp_shard`` (FSDP2's shards) and one model-parallel dim,
``ep`` (whole experts per rank) or ``tp``, in that order.

:func:`fsdp_placements` gives the placements a parameter ends up with once the model is
parallelized the torchtitan way: its plan's placement on the model-parallel dim, then FSDP2's
``Shard(0)`` on ``dp_shard`` (a ``_StridedShard(0, n)`` when the plan's placement already cuts
dim 0 over ``n`` ranks, as FSDP2 declares it) and ``Replicate()`` on ``dp_replicate``.

This module imports ``torch.distributed.tensor`` only when a placement is built.

Example:
    >>> mesh = MeshShape.of({"dp_shard": 2, "tp": 2})
    >>> mesh.coordinate(3), mesh.size
    ((1, 1), 4)
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigurationError

__all__ = ["MESH_DIM_NAMES", "PARALLEL_DIMS", "MeshShape", "fsdp_placements", "parallel_dim"]

MESH_DIM_NAMES = ("dp_replicate", "dp_shard", "ep", "tp")
"""The mesh dim names a dry run understands, in the order their dims must come (torchtitan's)."""

PARALLEL_DIMS = ("ep", "tp")
"""The model-parallel dims: a plan's styles shard on the one a mesh has (``ep``: its ``ep_plan``)."""


def parallel_dim(names: tuple[str, ...]) -> str | None:
    """The model-parallel dim of a mesh with these dim names (``None``: data-parallel only).

    Raises:
        ConfigurationError: both ``ep`` and ``tp``: expert-TP takes two plans, one per dim;
            parallelize such a model yourself (``docs/parallel.md``) and load it by its placements.
    """
    found = [n for n in PARALLEL_DIMS if n in names]
    if len(found) > 1:
        raise ConfigurationError(
            f"device mesh dims {list(names)}: one tp_plan shards on one model-parallel dim ('ep' or 'tp'). For experts "
            "split over 'tp' inside an 'ep' group, parallelize the model yourself (parallelize_module(experts, "
            "mesh['ep', 'tp'], ExpertParallel()), docs/parallel.md) and load it without tp_plan."
        )
    return found[0] if found else None


@dataclass(frozen=True)
class MeshShape:
    """Dim names and sizes of a device mesh (no processes).

    Attributes:
        names: the dim names, a subsequence of :data:`MESH_DIM_NAMES`.
        sizes: the size of each dim.
    """

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def of(cls, dims: Mapping[str, int]) -> MeshShape:
        """Validate ``{name: size}`` (names known and in torchtitan's order, sizes positive ints)."""
        if not isinstance(dims, Mapping) or not dims:
            raise ConfigurationError(
                f"a planned device mesh is a dict of dim name to size, e.g. {{'dp_shard': 2, 'tp': 2}}; got {dims!r}."
            )
        names = tuple(dims)
        unknown = [n for n in names if n not in MESH_DIM_NAMES]
        if unknown:
            raise ConfigurationError(
                f"device mesh dims {unknown} are not ones a dry run plans; name the dims {', '.join(MESH_DIM_NAMES)} "
                "(torchtitan's names)."
            )
        if list(names) != sorted(names, key=MESH_DIM_NAMES.index):
            raise ConfigurationError(
                f"device mesh dims {list(names)}: put them in the order {', '.join(MESH_DIM_NAMES)} (data-parallel "
                "dims outermost, ep or tp innermost, as torchtitan builds its mesh)."
            )
        sizes = tuple(dims.values())
        if any(type(n) is not int or n < 1 for n in sizes):
            raise ConfigurationError(f"device mesh sizes {dict(dims)}: each must be a positive int.")
        parallel_dim(names)
        return cls(names, sizes)

    @property
    def parallel_dim(self) -> str | None:
        """``"tp"``, ``"ep"`` or ``None``: the dim a plan shards on."""
        return parallel_dim(self.names)

    @property
    def size(self) -> int:
        """The number of ranks."""
        return math.prod(self.sizes)

    def dim_size(self, name: str) -> int:
        """The size of dim ``name`` (1 when the mesh has no such dim)."""
        return self.sizes[self.names.index(name)] if name in self.names else 1

    def coordinate(self, rank: int) -> tuple[int, ...]:
        """``rank``'s coordinate (row-major, as ``init_device_mesh`` lays ranks out)."""
        if type(rank) is not int or not 0 <= rank < self.size:
            raise ConfigurationError(f"rank={rank!r}: the ranks of a {self} mesh are 0..{self.size - 1}.")
        out = []
        for n in reversed(self.sizes):
            out.append(rank % n)
            rank //= n
        return tuple(reversed(out))

    def __str__(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))


def fsdp_placements(mesh: MeshShape, tp: tuple[Any, ...] | None) -> tuple[tuple[Any, ...], tuple[int, ...]]:
    """A parameter's placements after its plan (``tp``: its placement on the model-parallel dim,
    ``tp`` or ``ep``; ``None`` when the plan leaves it whole) and FSDP2 over the data-parallel
    dims, and the mesh dims they are on.

    As FSDP2 leaves them: a parameter TP sharded lives on the whole mesh, one TP left whole on
    the data-parallel dims only (``()`` when there are none: a plain tensor).

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> fsdp_placements(MeshShape.of({"dp_shard": 2, "tp": 2}), (Shard(0),))
        ((_StridedShard(dim=0, sf=2), Shard(dim=0)), (0, 1))
        >>> fsdp_placements(MeshShape.of({"dp_shard": 2, "tp": 2}), None)
        ((Shard(dim=0),), (0,))
        >>> fsdp_placements(MeshShape.of({"dp_replicate": 2, "dp_shard": 2}), None)
        ((Replicate(), Shard(dim=0)), (0, 1))
        >>> fsdp_placements(MeshShape.of({"dp_shard": 2, "ep": 2}), (Shard(0),))
        ((_StridedShard(dim=0, sf=2), Shard(dim=0)), (0, 1))
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    cuts_rows = tp is not None and not isinstance(tp[0], Replicate) and tp[0].dim == 0
    out: list[Any] = []
    dims: list[int] = []
    for i, name in enumerate(mesh.names):
        if name == "dp_replicate":
            out.append(Replicate())
        elif name == "dp_shard":
            tp_size = mesh.dim_size(mesh.parallel_dim or "tp")
            out.append(_StridedShard(0, split_factor=tp_size) if cuts_rows and tp_size > 1 else Shard(0))
        elif tp is not None:
            out.append(tp[0])
        else:
            continue
        dims.append(i)
    return tuple(out), tuple(dims)
