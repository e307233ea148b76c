"""What one tensor-parallel rank reads: target placements, source regions, local chains.

Planning under tensor parallelism (:func:`surgery.load_checkpoint` with ``tp_plan``/
``device_mesh``, or a model whose parameters are already DTensors) adds three steps to a load:

1. :func:`tensor_parallel` checks the options and :func:`apply_tp_plan` parallelizes the model
   right after fusions (or, for a dry run without a process group, validates the plan for a
   given ``tp_size``/``tp_rank``, or an n-D mesh given by dim sizes and a ``rank``);
2. :func:`target_placements` gives every runtime key its placements (and, on an n-D mesh, its
   mesh's shape and this rank's coordinate on it) and :func:`local_region` the part this rank
   holds: a :class:`~surgery.parallel.regions.Region` on one dim, or a
   :class:`~surgery.parallel.regions.Box` when several dims are cut (FSDP2 rows of a row-wise
   TP weight), which :func:`trace_boxes` walks one dim at a time;
3. :func:`shard_work` traces each target's region back through the converter's op chain
   (:func:`trace_regions`) to a region per checkpoint key, or marks the target as a
   *fallback* (read whole, convert, keep the rank's part) naming the op that forced it.

Each :class:`~surgery.ops.ConversionOp` may carry a slice rule (:meth:`ConversionOp.slice_rule`)
that maps regions of its outputs to regions of its inputs (:mod:`surgery.parallel.regions`) and
returns the op to run on the local pieces. :func:`trace_regions` walks a converter's chain
backwards with those rules and the chain's stage shapes; the result says, per source slot, what
to read. Where an op has no rule (custom ops, a RoPE permute cut across heads), the walk stops and
names the op: the loader then reads the sources whole, runs the global chain and keeps the rank's
region of the output (the *fallback*, which the load report lists).

Every shape check stays on global shapes; only the bytes read and the tensors built are local.

Example:
    >>> from surgery import ops
    >>> traced = trace_regions([ops.Concatenate(dim=0)], [[(4,), (4,)], [(8,)]], [Region(0, ((2, 6),))])
    >>> traced.sources
    [Region(dim=0, intervals=((2, 4),)), Region(dim=0, intervals=((0, 2),))]
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..converter import WeightConverter
from ..errors import ConfigurationError, SurgeryError
from ..ops import ConversionOp, OpContext, stage_contexts
from ..parallel import (
    ResolvedStyle,
    check_mesh,
    dtensors_of,
    has_dtensors,
    is_dtensor,
    local_region,
    parallelize,
    param_placements,
    resolve_tp_plan,
)
from ..parallel.mesh_shape import MeshShape, fsdp_placements
from ..parallel.regions import NOT_NEEDED, Box, Region, SlotRegion, TPSlice, local_shape
from ..placement import all_contiguous, placement_views, stage_shapes

__all__ = [
    "Sharding",
    "TensorParallel",
    "Traced",
    "apply_tp_plan",
    "direct_possible",
    "local_context",
    "shard_work",
    "target_placements",
    "tensor_parallel",
    "trace_boxes",
    "trace_regions",
]


@dataclass
class TensorParallel:
    """This rank's view of the tensor-parallel load.

    Attributes:
        world_size / rank: the mesh's size and this rank's place on it (on an n-D mesh: the
            root mesh's size and this rank's index in it).
        mesh: the ``DeviceMesh`` (``None`` for a dry run planned by arithmetic); when the model's
            DTensors live on several meshes of one root mesh (FSDP2 over TP), the root mesh.
        spec: the ``tp_plan`` to apply, or ``None`` when the model's DTensors already say.
        resolved: the validated plan, once :func:`apply_tp_plan` ran.
        coords: per runtime key whose mesh is not ``(world_size,)`` at ``(rank,)``, the shape of
            its mesh and this rank's coordinate on it (filled by :func:`target_placements`).
    """

    world_size: int
    rank: int
    mesh: Any = None
    spec: Any = None
    resolved: list[ResolvedStyle] = field(default_factory=list)
    coords: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = field(default_factory=dict)
    planned: MeshShape | None = None

    @property
    def tp_size(self) -> int:
        """The size of the model-parallel dim (the whole 1-D mesh, or an n-D plan's ``tp`` or ``ep`` dim)."""
        if self.planned is None:
            return self.world_size
        dim = self.planned.parallel_dim
        return 1 if dim is None else self.planned.dim_size(dim)

    def layout(self, key: str) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The mesh shape and this rank's coordinate for the target ``key``."""
        return self.coords.get(key, ((self.world_size,), (self.rank,)))


def tensor_parallel(
    model: nn.Module,
    *,
    tp_plan: Any,
    device_mesh: Any,
    tp_size: int | None = None,
    tp_rank: int | None = None,
    rank: int | None = None,
) -> TensorParallel | None:
    """Check the tensor-parallel options of a load; ``None`` when the load is not parallel.

    ``device_mesh`` may be a ``DeviceMesh`` or, for a dry run without processes, a dict of
    dim name to size (:class:`~surgery.parallel.mesh_shape.MeshShape`) with ``rank`` the rank
    to plan.

    Raises:
        ConfigurationError: contradictory options (a ``tp_plan`` for a model that is already
            parallelized, a plan without a mesh, a 2-D mesh with a plan, DTensors on meshes of
            different roots, ...), before anything is read.
    """
    parallel_model = has_dtensors(model)
    if isinstance(device_mesh, Mapping) or rank is not None:
        return _planned_mesh(tp_plan, device_mesh, tp_size, tp_rank, rank, parallel_model)
    if tp_size is not None or tp_rank is not None:
        if device_mesh is not None:
            raise ConfigurationError(
                "pass device_mesh= or tp_size=/tp_rank=, not both (tp_size plans without a mesh)."
            )
        if tp_plan is None:
            raise ConfigurationError("tp_size=/tp_rank= plan a tp_plan's reads; pass tp_plan= too.")
        size, rank = tp_size if tp_size is not None else 1, tp_rank if tp_rank is not None else 0
        if type(size) is not int or type(rank) is not int or size < 1 or not 0 <= rank < size:
            raise ConfigurationError(
                f"tp_size={tp_size!r}, tp_rank={tp_rank!r}: need ints with 0 <= tp_rank < tp_size."
            )
        if parallel_model:
            raise ConfigurationError(_ALREADY)
        return TensorParallel(size, rank, None, tp_plan)
    if parallel_model:
        if tp_plan is not None:
            raise ConfigurationError(_ALREADY)
        return _parallel_model(model, device_mesh)
    if tp_plan is None and device_mesh is None:
        return None
    if device_mesh is None:
        raise ConfigurationError(
            "tp_plan= needs device_mesh= (e.g. init_device_mesh('cuda', (world_size,))); for a dry run "
            "without a process group, plan_load(..., tp_size=N, tp_rank=r)."
        )
    if tp_plan is None:
        raise ConfigurationError(
            "device_mesh= without tp_plan=: nothing says what to shard. Pass tp_plan (or 'auto'), or "
            "parallelize the model first and leave both out."
        )
    mesh = check_mesh(device_mesh)
    return TensorParallel(mesh.size(), mesh.get_local_rank(), mesh, tp_plan)


def _planned_mesh(
    tp_plan: Any, device_mesh: Any, tp_size: Any, tp_rank: Any, rank: Any, parallel_model: bool
) -> TensorParallel:
    """A dry run on a named n-D mesh: ``tp_plan`` on ``tp`` (or ``ep``), FSDP2's placements on the dp dims."""
    if not isinstance(device_mesh, Mapping):
        raise ConfigurationError(
            "rank= plans one rank of a mesh given by dim sizes: pass device_mesh={'dp_shard': 2, 'tp': 2} too."
        )
    if tp_size is not None or tp_rank is not None:
        raise ConfigurationError("with device_mesh={...} give rank=, not tp_size=/tp_rank=.")
    if parallel_model:
        raise ConfigurationError(_ALREADY)
    mesh = MeshShape.of(device_mesh)
    if (mesh.parallel_dim is not None) != (tp_plan is not None):
        raise ConfigurationError(
            f"device_mesh {dict(device_mesh)} with tp_plan={'None' if tp_plan is None else '...'}: a 'tp' (or 'ep') "
            "dim and a tp_plan go together (the plan says what that dim shards); give both or neither."
        )
    rank = 0 if rank is None else rank
    mesh.coordinate(rank)  # validates rank
    return TensorParallel(mesh.size, rank, None, tp_plan, planned=mesh)


def _parallel_model(model: nn.Module, device_mesh: Any) -> TensorParallel:
    """The view of a model whose DTensors say how it is split, on one mesh or several of one root."""
    meshes = {id(t.device_mesh): t.device_mesh for t in dtensors_of(model)}
    if len(meshes) == 1:
        mesh = next(iter(meshes.values()))
        if device_mesh is not None and device_mesh is not mesh:
            raise ConfigurationError(
                "device_mesh= is not the mesh the model's DTensors live on; leave it out."
            )
        if mesh.ndim == 1:
            return TensorParallel(mesh.size(), mesh.get_local_rank(), mesh, None)
    # roots by value: torch may hand out a mesh equal to the one a style was given whose root is
    # another root over the same ranks (its caches compare meshes by value); the arithmetic here
    # needs only the ranks, in order
    roots = {_ranks_of(m._get_root_mesh()): m._get_root_mesh() for m in meshes.values()}
    if len(roots) != 1:
        seen = sorted(
            {f"{m.mesh_dim_names} of root {m._get_root_mesh().mesh_dim_names}" for m in meshes.values()}
        )
        raise ConfigurationError(
            f"the model's DTensors live on {len(meshes)} device meshes that are not sub-meshes of one root mesh "
            f"({'; '.join(seen)}); build every mesh by slicing one init_device_mesh(...) (mesh['tp'], "
            "mesh['dp_shard'], ...)."
        )
    root = next(iter(roots.values()))
    if device_mesh is not None and _ranks_of(device_mesh._get_root_mesh()) != _ranks_of(root):
        raise ConfigurationError("device_mesh= is not the mesh the model's DTensors live on; leave it out.")
    for m in meshes.values():
        if m.get_coordinate() is None:
            raise ConfigurationError(
                f"this rank is not on the device mesh {m} that some of the model's DTensors live on; every "
                "rank of the root mesh must hold a part of every DTensor."
            )
    rank = int((root.mesh.flatten() == torch.distributed.get_rank()).nonzero()[0])
    return TensorParallel(root.size(), rank, root, None)


def _ranks_of(mesh: Any) -> tuple[Any, ...]:
    """A mesh by value: its device type and its ranks in row-major order."""
    return (mesh.device_type, *mesh.mesh.flatten().tolist())


_ALREADY = (
    "the model's parameters are already DTensors (it was parallelized); it loads according to their "
    "placements, so pass tp_plan=None (and no tp_size)."
)


def apply_tp_plan(model: nn.Module, tp: TensorParallel) -> None:
    """Parallelize ``model`` per ``tp.spec`` (on a mesh), or only validate it (a dry run)."""
    if tp.spec is None:
        return
    if tp.mesh is not None:
        tp.resolved = parallelize(model, tp.spec, tp.mesh)
    else:
        expert = tp.planned is not None and tp.planned.parallel_dim == "ep"
        tp.resolved = resolve_tp_plan(model, tp.spec, world_size=tp.tp_size, expert=expert)
        custom = [r.path for r in tp.resolved if r.kind == "custom"]
        if custom:
            raise ConfigurationError(
                f"tp_plan gives {custom[:3]} ParallelStyle instances whose placements are only known once "
                "applied; a dry run with tp_size= needs style names. Plan with a device_mesh instead."
            )


def target_placements(
    model: nn.Module, runtime: dict[str, torch.Tensor], tp: TensorParallel, tied: dict[str, list[str]]
) -> dict[str, tuple[Any, ...]]:
    """Per runtime key that is a DTensor (or would be, in a dry run), its placements."""
    out: dict[str, tuple[Any, ...]] = {}
    if tp.mesh is not None:
        for k, t in runtime.items():
            if is_dtensor(t):
                out[k] = tuple(t.placements)  # type: ignore[attr-defined]
                mesh = t.device_mesh  # type: ignore[attr-defined]
                if mesh is not tp.mesh or mesh.ndim != 1:
                    tp.coords[k] = (tuple(mesh.shape), tuple(mesh.get_coordinate()))
        return out
    for r in tp.resolved:
        module = model.get_submodule(r.path) if r.path else model
        for name, placements in param_placements(module, r).items():
            key = f"{r.path}.{name}" if r.path else name
            for alias in tied.get(key, [key]):
                out[alias] = placements
    if tp.planned is not None:  # FSDP2 shards every parameter over the dp dims
        sizes, coordinate = tp.planned.sizes, tp.planned.coordinate(tp.rank)
        for key, _ in model.named_parameters(remove_duplicate=False):
            placements, dims = fsdp_placements(tp.planned, out.get(key))
            if key in runtime and dims:
                out[key] = placements
                tp.coords[key] = (tuple(sizes[i] for i in dims), tuple(coordinate[i] for i in dims))
    return out


def local_context(
    ctx: OpContext, regions: tuple[Region | Box | None, ...], targets: tuple[str, ...]
) -> OpContext:
    """``ctx`` with the local target shapes (what a rank's ops see)."""
    if ctx.target_shapes is None:
        return ctx
    shapes = tuple(s if s is None else local_shape(tuple(s), r) for s, r in zip(ctx.target_shapes, regions))
    return OpContext(n_targets=ctx.n_targets, target_shapes=shapes, config=ctx.config)


@dataclass
class Sharding:
    """How one plan entry is read on this rank.

    Attributes:
        placements: per runtime key of the entry, its placements (``None``: a plain tensor).
        regions: per runtime key, the rank's region (``None``: all of it).
        sources: per checkpoint key, the region to read (``None``: all; ``NOT_NEEDED``: skip).
        operations: the chain to run on the local pieces (``None``: the converter's own).
        fallback: the op without a slice rule that forced a whole read, or ``None``.
        local_slot_shapes: per source slot, the local shapes (direct placement on the local chain).
        chain_regions: when a box could be traced on one of its dims only (a *covering* fallback),
            per runtime key the part the local chain builds; the rest of :attr:`regions` is cut
            from its output. ``None`` otherwise.
    """

    placements: tuple[tuple[Any, ...] | None, ...]
    regions: tuple[Region | Box | None, ...]
    sources: dict[str, Any] = field(default_factory=dict)  # Region | None | NOT_NEEDED
    operations: list[ConversionOp] | None = None
    fallback: str | None = None
    local_slot_shapes: list[Any] | None = None
    chain_regions: tuple[Region | Box | None, ...] | None = None

    @property
    def sharded(self) -> bool:
        return any(r is not None for r in self.regions)

    @property
    def slices(self) -> tuple[TPSlice | None, ...]:
        """Per runtime key, what the plan entry records (``None``: a plain tensor)."""
        return tuple(None if p is None else TPSlice.of(p, r) for p, r in zip(self.placements, self.regions))


def _region_bytes(shape: tuple[int, ...], itemsize: int, region: SlotRegion) -> int:
    if region is NOT_NEEDED:
        return 0
    return math.prod(local_shape(shape, region if isinstance(region, (Region, Box)) else None)) * itemsize


def shard_work(
    *,
    converter: WeightConverter | None,
    group_key: str,
    out_keys: tuple[str, ...],
    runtime: dict[str, torch.Tensor],
    placements_of: dict[str, tuple[Any, ...]],
    tp: TensorParallel,
    source_keys: tuple[str, ...],
    infos: dict[str, Any],
    pattern_of: dict[str, tuple[int, tuple[int, ...]]],
    slot_shapes: list[Any] | None,
    ctx: OpContext | None,
) -> tuple[Sharding, int]:
    """Trace one entry's target regions back to its sources; return the sharding and its bytes."""
    placements = tuple(placements_of.get(k) for k in out_keys)
    regions = tuple(
        None if p is None else local_region(p, tuple(runtime[k].shape), *tp.layout(k), name=repr(k))
        for k, p in zip(out_keys, placements)
    )
    sh = Sharding(placements, regions)
    whole = sum(infos[k].nbytes for k in source_keys)
    if not sh.sharded:
        return sh, whole
    if converter is None:
        (src,) = source_keys
        sh.sources = {src: regions[0]}
        return sh, _region_bytes(tuple(infos[src].shape), infos[src].dtype.itemsize, regions[0])
    assert ctx is not None
    blocked: str | None = None
    traced = None
    stages: list[list[Any]] | None = None
    if slot_shapes is None:
        blocked = "(source shapes unknown)"
    else:
        try:
            stages = stage_shapes(converter, slot_shapes, ctx)
            targets = _target_slot_regions(converter, group_key, stages[-1], dict(zip(out_keys, regions)))
            traced = trace_boxes(converter.operations, stages, targets, ctx)
        except (SurgeryError, RuntimeError, KeyError) as exc:
            blocked = f"(tracing failed: {exc})"
        else:
            if traced.blocked_by is not None:
                blocked = repr(traced.blocked_by)
    if blocked is not None or traced is None:
        sh.fallback = blocked
        cover = None if stages is None else _covering(converter, group_key, out_keys, regions, stages, ctx)
        if cover is None:
            sh.sources = dict.fromkeys(source_keys)
            return sh, whole
        dim, traced, partial = cover
        sh.fallback = f"{blocked} (read cut on dim {dim} only, the other dims cut after the chain)"
        sh.chain_regions = partial
    _fill_sources(sh, traced, converter, source_keys, infos, pattern_of)
    nbytes = sum(
        _region_bytes(tuple(infos[k].shape), infos[k].dtype.itemsize, r) for k, r in sh.sources.items()
    )
    if sh.chain_regions is not None and nbytes >= whole:  # the cover saves nothing: read whole
        sh.chain_regions, sh.operations, sh.local_slot_shapes = None, None, None
        sh.fallback = blocked
        sh.sources = dict.fromkeys(source_keys)
        return sh, whole
    return sh, nbytes


def _fill_sources(
    sh: Sharding,
    traced: Traced,
    converter: WeightConverter,
    source_keys: tuple[str, ...],
    infos: dict[str, Any],
    pattern_of: dict[str, tuple[int, tuple[int, ...]]],
) -> None:
    """Record per checkpoint key what ``traced`` reads of it, and the local chain and slot shapes."""
    by_pattern: dict[int, list[str]] = {}
    for src in source_keys:
        by_pattern.setdefault(pattern_of[src][0], []).append(src)
    local_slots: list[Any] = []
    for i, slot_region in enumerate(traced.sources):
        keys = sorted(by_pattern.get(i, []), key=lambda k: pattern_of[k][1])
        if converter.gathers_from(i):
            items = slot_region if isinstance(slot_region, list) else [slot_region] * len(keys)
            shapes = []
            for k, r in zip(keys, items):
                sh.sources[k] = r
                if r is not NOT_NEEDED:
                    shapes.append(
                        local_shape(tuple(infos[k].shape), r if isinstance(r, (Region, Box)) else None)
                    )
            local_slots.append(shapes)
        else:
            (k,) = keys
            sh.sources[k] = slot_region
            local_slots.append(
                local_shape(
                    tuple(infos[k].shape), slot_region if isinstance(slot_region, (Region, Box)) else None
                )
            )
    sh.operations = list(traced.operations)
    sh.local_slot_shapes = local_slots


def _covering(
    converter: WeightConverter,
    group_key: str,
    out_keys: tuple[str, ...],
    regions: tuple[Region | Box | None, ...],
    stages: list[list[Any]],
    ctx: OpContext,
) -> tuple[int, Traced, tuple[Region | Box | None, ...]] | None:
    """When a box cannot be traced whole: the one output dim whose cut traces, reading least.

    Returns ``(dim, traced, per target the part traced)``; the rest of each target's box is cut
    from the local chain's output. ``None`` when no target is a box or no single dim traces.
    """
    if not any(isinstance(r, Box) for r in regions):
        return None
    best: tuple[int, int, Traced, tuple[Region | Box | None, ...]] | None = None
    for dim in sorted({d for r in regions for d in _dims_of(r)}):
        partial = tuple(_on_dim(r, dim) for r in regions)
        try:
            targets = _target_slot_regions(converter, group_key, stages[-1], dict(zip(out_keys, partial)))
            traced = trace_regions(converter.operations, stages, targets, ctx)
        except (SurgeryError, RuntimeError, KeyError):
            continue
        if traced.blocked_by is not None:
            continue
        kept = sum(_slot_size(r, s) for r, s in zip(traced.sources, stages[0]))
        if best is None or kept < best[0]:
            best = (kept, dim, traced, partial)
    return None if best is None else (best[1], best[2], best[3])


def _slot_size(region: Any, shape: Any) -> int:
    """Elements a slot's region covers (a list slot: summed over its items)."""
    if isinstance(shape, list):
        items = region if isinstance(region, list) else [region] * len(shape)
        return sum(_slot_size(r, s) for r, s in zip(items, shape))
    if region is NOT_NEEDED:
        return 0
    return math.prod(local_shape(tuple(shape), region if isinstance(region, (Region, Box)) else None))


def _target_slot_regions(
    converter: WeightConverter,
    group_key: str,
    last_stage: list[Any],
    region_of: dict[str, Region | Box | None],
) -> list[SlotRegion]:
    """Per output slot of the chain, the rank's region (a list slot: one per ``*`` index)."""
    out: list[SlotRegion] = []
    for target, shape in zip(converter.expand_target_keys(group_key), last_stage):
        if isinstance(shape, list):
            out.append([region_of[target.replace("*", str(i), 1)] for i in range(len(shape))])
        else:
            out.append(region_of[target])
    return out


def direct_possible(
    converter: WeightConverter, sh: Sharding, dest_shape: tuple[int, ...], dtype: torch.dtype, ctx: OpContext
) -> bool:
    """Whether the local chain can be read straight into views of the local destination."""
    if sh.fallback is not None or sh.local_slot_shapes is None:
        return False
    if any(isinstance(r, Box) or (isinstance(r, Region) and r.dim != 0) for r in sh.sources.values()):
        return False
    dest = torch.empty(dest_shape, dtype=dtype, device="meta")
    views = placement_views(converter, dest, sh.local_slot_shapes, ctx, operations=sh.operations)
    return views is not None and all_contiguous(views)


@dataclass
class Traced:
    """The result of :func:`trace_regions`.

    Attributes:
        sources: per source slot, what the rank reads (see :data:`SlotRegion`).
        operations: the chain to run on the local pieces.
        blocked_by: when the walk stopped, the op without a rule for its regions (then
            ``sources`` and ``operations`` are empty and the caller takes the fallback).
    """

    sources: list[SlotRegion]
    operations: list[ConversionOp]
    blocked_by: ConversionOp | None = None


def trace_regions(
    operations: Sequence[ConversionOp],
    stages: list[list[Any]],
    targets: list[SlotRegion],
    ctx: OpContext | None = None,
) -> Traced:
    """Walk ``operations`` backwards from the target slots' regions to the source slots' regions.

    Args:
        operations: the converter's op chain.
        stages: slot shapes before each op and after the last (``len(operations) + 1`` stages;
            :func:`surgery.placement.stage_shapes`).
        targets: per output slot of the chain, the rank's region.
        ctx: the global op context (``PermuteForRope`` reads its head count from it).

    Raises:
        ConfigurationError: ``stages`` or ``targets`` do not fit the chain (a bug in the caller).
    """
    if len(stages) != len(operations) + 1 or len(targets) != len(stages[-1]):
        raise ConfigurationError(
            f"trace_regions: {len(operations)} ops need {len(operations) + 1} stages and one region per "
            f"output slot; got {len(stages)} stages and {len(targets)} regions for {len(stages[-1])} slots."
        )
    contexts = stage_contexts(operations, ctx or OpContext(n_targets=len(targets)))
    regions = [_normalized(r, s) for r, s in zip(targets, stages[-1])]
    local: list[ConversionOp] = []
    for k in range(len(operations) - 1, -1, -1):
        op = operations[k]
        if all(r is None for r in regions):
            local.append(op)  # nothing sharded from here back: the op runs as it is
            regions = [None] * len(stages[k])
            continue
        rule = op.slice_rule(regions, stages[k], stages[k + 1], contexts[k])
        if rule is None:
            return Traced([], [], blocked_by=op)
        regions, local_op = rule
        regions = [_normalized(r, s) for r, s in zip(regions, stages[k])]
        local.append(local_op)
    return Traced(regions, local[::-1])


def trace_boxes(
    operations: Sequence[ConversionOp],
    stages: list[list[Any]],
    targets: list[SlotRegion],
    ctx: OpContext | None = None,
) -> Traced:
    """:func:`trace_regions` for targets cut on several dims (:class:`Box`, from an n-D mesh).

    Each output dim's cut is traced on its own; the walks combine when they run the same local
    ops and cut each source on different dims (the slice rules move whole index ranges of one dim,
    so cuts on different dims commute). Otherwise the walk is blocked by the first op of the
    chain and the caller takes the fallback. Targets without a :class:`Box` trace as they are.

    Example:
        >>> from surgery import ops
        >>> box = Box((Region(0, ((1, 3),)), Region(1, ((4, 8),))))
        >>> first, second = trace_boxes([ops.Concatenate(dim=0)], [[(2, 8), (2, 8)], [(4, 8)]], [box]).sources
        >>> first.parts, second.parts
        ((Region(dim=0, intervals=((1, 2),)), Region(dim=1, intervals=((4, 8),))), (Region(dim=0, intervals=((0, 1),)), Region(dim=1, intervals=((4, 8),))))
    """
    dims = sorted({d for t in targets for d in _dims_of(t)})
    if not any(_has_box(t) for t in targets):
        return trace_regions(operations, stages, targets, ctx)
    walks = [trace_regions(operations, stages, [_on_dim(t, d) for t in targets], ctx) for d in dims]
    blocked = next((w.blocked_by for w in walks if w.blocked_by is not None), None)
    if blocked is not None:
        return Traced([], [], blocked_by=blocked)
    differ = [
        k for k in range(len(operations)) if any(w.operations[k] != walks[0].operations[k] for w in walks)
    ]
    if differ:  # the op runs differently for each dim's cut: no one local chain serves the box
        return Traced([], [], blocked_by=operations[differ[0]])
    try:
        sources = [functools.reduce(_combined, slot) for slot in zip(*(w.sources for w in walks))]
    except _Conflict:
        return Traced([], [], blocked_by=operations[0])
    return Traced(sources, walks[0].operations)


class _Conflict(Exception):
    """Two output dims cut one source dim: the walks do not combine."""


def _has_box(region: Any) -> bool:
    return isinstance(region, Box) or (isinstance(region, list) and any(isinstance(r, Box) for r in region))


def _dims_of(region: Any) -> set[int]:
    if isinstance(region, list):
        return {d for r in region for d in _dims_of(r)}
    if isinstance(region, Box):
        return set(region.dims)
    return {region.dim} if isinstance(region, Region) else set()


def _on_dim(region: Any, dim: int) -> Any:
    """The part of a target region on output ``dim`` (``None``: not cut there)."""
    if isinstance(region, list):
        return [_on_dim(r, dim) for r in region]
    if isinstance(region, Box):
        return next((p for p in region.parts if p.dim == dim), None)
    if isinstance(region, Region):
        return region if region.dim == dim else None
    return region


def _combined(a: Any, b: Any) -> Any:
    """One source's regions from two walks as one (cuts on different dims multiply)."""
    if a is None:
        return b
    if b is None:
        return a
    if a is NOT_NEEDED or b is NOT_NEEDED:
        return NOT_NEEDED
    if isinstance(a, list) or isinstance(b, list):
        items_a = a if isinstance(a, list) else [a] * len(b)
        items_b = b if isinstance(b, list) else [b] * len(a)
        return [_combined(x, y) for x, y in zip(items_a, items_b)]
    parts = [*(a.parts if isinstance(a, Box) else (a,)), *(b.parts if isinstance(b, Box) else (b,))]
    if len({p.dim for p in parts}) != len(parts):
        raise _Conflict
    return Box(tuple(sorted(parts, key=lambda p: p.dim)))


def _normalized(region: Any, shape: Any) -> Any:
    """Non-negative dims; a region that is the whole tensor becomes ``None``."""
    if region is None or region is NOT_NEEDED:
        return region
    if isinstance(region, list):
        items = shape if isinstance(shape, list) else [shape] * len(region)
        out = [_normalized(r, s) for r, s in zip(region, items)]
        return None if all(r is None for r in out) else out
    ndim = len(shape)
    if isinstance(region, Box):
        return Box.of([_normalized(p, shape) for p in region.parts], shape)
    dim = region.dim % ndim if ndim else 0
    region = Region(dim, region.intervals)
    return None if region.covers(shape[dim]) else region
