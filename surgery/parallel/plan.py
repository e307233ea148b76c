"""Tensor-parallel plans: validation against a model, and placement arithmetic.

A *tensor-parallel plan* maps module paths to styles. Paths are dotted from the root, and ``*``
matches exactly one path component (the rule :func:`torch.distributed.tensor.parallel.parallelize_module`
uses, so one plan works in both). A style is a name or a torch ``ParallelStyle`` instance:

===================  ==================================================================================
``colwise``          ``ColwiseParallel``: Linear weight and bias ``Shard(0)``; Embedding ``Shard(1)``
``rowwise``          ``RowwiseParallel``: Linear weight ``Shard(1)``, bias replicated; Embedding ``Shard(0)``
``colwise_gather``   ``ColwiseParallel(output_layouts=Replicate())``: an ``lm_head`` with whole logits
``replicate``        parameters stay plain tensors; every rank reads them whole
``packed_colwise``   a fused ``gate_up_proj`` (or ``qkv`` of equal parts): ``_StridedShard(0, 2)``, so
                     rank r holds ``[G_r | U_r]`` (:class:`~surgery.parallel.styles.PackedColwiseParallel`)
``experts``          3-D expert tensors: ``gate_up_proj (E, 2I, H)`` ``_StridedShard(1, 2)``,
                     ``down_proj (E, H, I)`` ``Shard(2)`` (:class:`~surgery.parallel.styles.ExpertsParallel`)
``expert_parallel``  whole experts per rank: every expert tensor ``Shard(0)``
                     (:class:`~surgery.parallel.styles.ExpertParallel`); ``tp_plan="auto"`` on a mesh
                     named ``"ep"`` applies the model's ``ep_plan``
===================  ==================================================================================

:func:`resolve_tp_plan` validates a plan against a model before anything is read: unknown styles,
patterns that match nothing, unsupported module types, dims the world size does not divide,
head counts, grouped-query q/k/v under ``packed_colwise`` and tied parameters with different
placements are each a :class:`~surgery.ConfigurationError` naming the fix. Which Linears carry
attention heads is read from the nearest ``config`` (``num_attention_heads``,
``num_key_value_heads``, ``head_dim``) and the Linear's output width, never from its name.

:func:`param_placements` gives each parameter's placements by arithmetic, without a process
group, and :func:`local_region` the part of a tensor a rank holds under them (the reads of a
rank are planned from these). ``torch.distributed.tensor`` is imported only when a placement is
built (about a second); ``_StridedShard`` is private torch API (documented for FSDP2 + TP) and
this package is the only place that uses it.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigurationError
from ..graph import match_modules
from .dtensors import dtensor_type
from .experts import check_experts_module
from .hf_plan import HF_STYLES, translate_hf_plan
from .regions import Box, Region, intersect

__all__ = [
    "STYLE_NAMES",
    "ResolvedStyle",
    "check_mesh",
    "is_expert_mesh",
    "local_region",
    "local_split_sizes",
    "param_placements",
    "resolve_tp_plan",
    "sharded_dim",
    "tied_names",
]

STYLE_NAMES = (
    "colwise",
    "rowwise",
    "colwise_gather",
    "replicate",
    "packed_colwise",
    "experts",
    "expert_parallel",
)


# --------------------------------------------------------------------------- resolving a plan


@dataclass(frozen=True)
class ResolvedStyle:
    """One module of a validated plan.

    Attributes:
        path: the module's dotted path.
        pattern: the plan key that matched it.
        kind: the style name (``"custom"`` for a ``ParallelStyle`` this package does not know).
        style: what was given (a name or a ``ParallelStyle``).
        split_factor: parts of a packed style (1 otherwise).
    """

    path: str
    pattern: str
    kind: str
    style: Any
    split_factor: int = 1


def _kind_of(style: Any, key: str) -> tuple[str, int]:
    if isinstance(style, str):
        if style not in STYLE_NAMES:
            hint = (
                f" ({style!r} is transformers' name for {HF_STYLES[style]!r}; tp_plan='auto' translates a "
                "transformers model's own plan)"
                if style in HF_STYLES
                else ""
            )
            raise ConfigurationError(
                f"tp_plan[{key!r}] = {style!r} is not a style; use one of {', '.join(STYLE_NAMES)} "
                f"or a torch.distributed.tensor.parallel.ParallelStyle instance{hint}."
            )
        return style, 2 if style in ("packed_colwise", "experts") else 1
    try:
        from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

        from .styles import ExpertsParallel, PackedColwiseParallel
    except ImportError:  # pragma: no cover - torch without distributed
        raise ConfigurationError("tensor parallelism needs torch.distributed") from None
    if isinstance(style, PackedColwiseParallel):  # before ColwiseParallel: it is one
        return "packed_colwise", style.split_factor
    if isinstance(style, ExpertsParallel):
        return "experts", style.split_factor
    if isinstance(style, ColwiseParallel):
        return "colwise", 1
    if isinstance(style, RowwiseParallel):
        return "rowwise", 1
    if isinstance(style, ParallelStyle):
        return "custom", 1
    raise ConfigurationError(
        f"tp_plan[{key!r}] = {style!r} is neither a style name ({', '.join(STYLE_NAMES)}) nor a ParallelStyle."
    )


def _plan_of(
    model: nn.Module, tp_plan: Mapping[str, Any] | str, *, expert: bool = False
) -> Mapping[str, Any]:
    """The plan as a non-empty mapping (``"auto"``: the model's ``tp_plan`` attribute, or its
    ``ep_plan`` when ``expert``, with transformers' style names translated by
    :func:`~surgery.parallel.hf_plan.translate_hf_plan`)."""
    if isinstance(tp_plan, str):
        if tp_plan != "auto":
            raise ConfigurationError(
                f"tp_plan={tp_plan!r}: pass a dict of module patterns to styles, or 'auto'."
            )
        attribute = "ep_plan" if expert else "tp_plan"
        declared = getattr(model, attribute, None)
        if not isinstance(declared, Mapping) or not declared:
            where = (
                " (the mesh's dim is named 'ep', so 'auto' takes the expert-parallel plan)" if expert else ""
            )
            raise ConfigurationError(
                f"tp_plan='auto': {type(model).__name__} declares no {attribute} attribute{where}; pass the plan "
                "as a dict of module patterns to styles."
            )
        tp_plan = translate_hf_plan(declared)
    if not isinstance(tp_plan, Mapping):
        raise ConfigurationError(
            f"tp_plan must be a dict of module patterns to styles, got {type(tp_plan).__name__}."
        )
    if not tp_plan:
        raise ConfigurationError("tp_plan is empty: give at least one module pattern, or pass tp_plan=None.")
    return tp_plan


def resolve_tp_plan(
    model: nn.Module,
    tp_plan: Mapping[str, Any] | str,
    *,
    world_size: int,
    expert: bool = False,
) -> list[ResolvedStyle]:
    """Validate ``tp_plan`` against ``model`` for ``world_size`` ranks; nothing is changed or read.

    ``tp_plan="auto"`` takes the model's ``tp_plan`` attribute, or with ``expert`` its
    ``ep_plan`` (transformers' ``base_model_ep_plan``; :func:`~surgery.parallel.parallelize` asks
    for it on a mesh whose one dim is named ``"ep"``), transformers' style names translated (see
    :mod:`surgery.parallel.hf_plan`); its patterns that match no module are skipped, as a model's
    own plan covers layer layouts the model may not have.

    Example:
        >>> from surgery.examples import build_dense_model
        >>> plan = resolve_tp_plan(build_dense_model(device="meta"), "auto", world_size=2)
        >>> [(r.path, r.kind) for r in plan if "layers.0.mlp" in r.path]
        [('model.layers.0.mlp.gate_up_proj', 'packed_colwise'), ('model.layers.0.mlp.down_proj', 'rowwise')]

    Raises:
        ConfigurationError: see the module docstring; the message names the plan key, module,
            parameter or dim and what to change.
    """
    declared = isinstance(tp_plan, str)  # the model's own plan: generic over layer layouts
    tp_plan = _plan_of(model, tp_plan, expert=expert)
    if type(world_size) is not int or world_size < 1:
        raise ConfigurationError(f"world_size={world_size!r} must be a positive int.")
    resolved: dict[str, ResolvedStyle] = {}
    for pattern, style in tp_plan.items():
        if not isinstance(pattern, str):
            raise ConfigurationError(f"tp_plan key {pattern!r} is not a module path pattern (a str).")
        kind, split = _kind_of(style, pattern)
        paths = match_modules(model, pattern)
        if not paths and declared:
            continue  # e.g. Qwen2-MoE's dense-MLP patterns on a model whose layers are all sparse
        if not paths:
            raise ConfigurationError(
                f"tp_plan pattern {pattern!r} matches no module of {type(model).__name__} (parallelize_module "
                "would only warn and skip it). Patterns are dotted paths from the root and '*' stands for one "
                f"component, e.g. 'model.layers.*.self_attn.q_proj'; top-level modules: "
                f"{[n for n, _ in model.named_children()]}."
            )
        for path in paths:
            if path in resolved:
                raise ConfigurationError(
                    f"module {path!r} is matched by tp_plan keys {resolved[path].pattern!r} and {pattern!r}; "
                    "give each module one style."
                )
            resolved[path] = ResolvedStyle(path, pattern, kind, style, split)
    if not resolved:
        raise ConfigurationError(
            f"tp_plan='auto': no pattern of {type(model).__name__}'s own tp_plan matches a module; pass the plan "
            "as a dict of module patterns to styles."
        )
    for r in resolved.values():
        _check_module(model, r, world_size)
    _check_tied(model, list(resolved.values()))
    return list(resolved.values())


# --------------------------------------------------------------------------- checks per module


def _check_module(model: nn.Module, r: ResolvedStyle, world: int) -> None:
    module = model.get_submodule(r.path)
    where = f"tp_plan[{r.pattern!r}] on {r.path!r} ({type(module).__name__})"
    _check_module_type(model, module, r, where)
    for pname, placements in param_placements(module, r).items():
        param = getattr(module, pname)
        for p in placements:
            sharded = sharded_dim(p)
            if sharded is None:
                continue
            dim, split = sharded
            size = param.shape[dim]
            if size % (world * split):
                factor = f" x split factor {split}" if split > 1 else ""
                raise ConfigurationError(
                    f"{where}: parameter {r.path + '.' + pname!r} of shape {tuple(param.shape)} is sharded on "
                    f"dim {dim} of size {size}, which world size {world}{factor} does not divide. Use a "
                    "world size that divides it, or keep this module replicated."
                )
    if r.kind in ("colwise", "packed_colwise") and _attention_heads(model, r.path, module) is not None:
        cfg = _config_near(model, r.path)
        for attr in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(cfg, attr, None)
            if isinstance(heads, int) and heads % world:
                raise ConfigurationError(
                    f"{where}: {attr}={heads} is not divisible by world size {world}, so the heads cannot be "
                    "split evenly across ranks; use a world size that divides it."
                )


def _check_module_type(model: nn.Module, module: nn.Module, r: ResolvedStyle, where: str) -> None:
    """The style applies to this kind of module (and a packed one to parts of equal size)."""
    packed = callable(getattr(module, "tp_placements", None))  # a PackedLinear: colwise or rowwise
    if not packed and getattr(module, "packed_names", None) is not None:  # a PackedModule: no style yet
        raise ConfigurationError(
            f"{where}: this module keeps its weights packed and takes no parallel style; load it decoded "
            "(without KeepPacked, or leave it out of KeepPacked's targets) to parallelize it."
        )
    if r.kind in ("colwise", "rowwise", "colwise_gather") and not (
        isinstance(module, (nn.Linear, nn.Embedding)) or (packed and r.kind != "colwise_gather")
    ):
        raise ConfigurationError(
            f"{where}: {r.kind} applies to nn.Linear and nn.Embedding only"
            + (" (a linear kept packed takes colwise or rowwise)." if packed else ".")
        )
    if r.kind == "packed_colwise":
        if not isinstance(module, nn.Linear):
            raise ConfigurationError(f"{where}: packed_colwise applies to nn.Linear only.")
        _check_packed_parts(model, r, module, where)
    if r.kind == "expert_parallel":
        check_experts_module(module, where)
    if r.kind == "experts":
        names = sorted(n for n, _ in module.named_parameters(recurse=False))
        if (
            names != ["down_proj", "gate_up_proj"]
            or module.gate_up_proj.ndim != 3
            or module.down_proj.ndim != 3
        ):
            raise ConfigurationError(
                f"{where}: the experts style needs 3-D 'gate_up_proj' (E, 2I, H) and 'down_proj' (E, H, I) "
                f"parameters and no others; this module has {names}."
            )


def _config_near(model: nn.Module, path: str) -> Any:
    """The ``config`` of the module at ``path`` or of its nearest ancestor that has one."""
    parts = path.split(".")
    while True:
        mod = model.get_submodule(".".join(parts)) if parts else model
        cfg = getattr(mod, "config", None)
        if cfg is not None or not parts:
            return cfg
        parts.pop()


def _attention_heads(model: nn.Module, path: str, module: nn.Module) -> str | None:
    """Which attention heads the Linear at ``path`` projects to, read from its config and width.

    ``"q"`` (``num_attention_heads x head_dim`` outputs), ``"kv"`` (``num_key_value_heads x
    head_dim``), ``"qkv"`` (the three fused: ``(heads + 2 x kv_heads) x head_dim``), or ``None``
    when the nearest config declares no heads or the width is none of these. ``head_dim`` is the
    config's, else ``hidden_size // num_attention_heads`` (transformers' convention).
    """
    if not isinstance(module, nn.Linear):
        return None
    cfg = _config_near(model, path)
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if not isinstance(heads, int) or heads < 1:
        return None
    kv = kv if isinstance(kv, int) and kv >= 1 else heads
    size = getattr(cfg, "head_dim", None)
    if not isinstance(size, int) or size < 1:
        hidden = getattr(cfg, "hidden_size", None)
        size = hidden // heads if isinstance(hidden, int) else 0
    if size < 1:
        return None
    widths = {(heads + 2 * kv) * size: "qkv", kv * size: "kv", heads * size: "q"}
    return widths.get(module.out_features)


def _check_packed_parts(model: nn.Module, r: ResolvedStyle, module: nn.Linear, where: str) -> None:
    """``packed_colwise`` cuts its Linear into equal parts: a fused grouped-query q/k/v has none."""
    if _attention_heads(model, r.path, module) != "qkv":
        return
    cfg = _config_near(model, r.path)
    heads, kv = getattr(cfg, "num_attention_heads", None), getattr(cfg, "num_key_value_heads", None)
    if isinstance(heads, int) and isinstance(kv, int) and heads != kv:
        raise ConfigurationError(
            f"{where}: a fused q/k/v with grouped-query attention ({heads} query heads, {kv} key/value heads) "
            "has parts of unequal size, which no DTensor placement describes. Keep q/k/v unfused under tensor "
            "parallelism (colwise q_proj, k_proj, v_proj)."
        )


# --------------------------------------------------------------------------- placements


def param_placements(module: nn.Module, r: ResolvedStyle) -> dict[str, tuple[Any, ...]]:
    """Per direct parameter of ``module``, the placements style ``r`` gives it (one per mesh dim).

    Replicated parameters are left out. A ``custom`` style has no arithmetic: its placements
    are read from the DTensors after :func:`~surgery.parallel.parallelize`.
    """
    if r.kind in ("replicate", "custom"):
        return {}
    from torch.distributed.tensor import Shard

    from .styles import expert_placements, strided_shard

    out: dict[str, tuple[Any, ...]] = {}
    embedding = isinstance(module, nn.Embedding)
    for n, _ in module.named_parameters(recurse=False):
        if r.kind in ("colwise", "colwise_gather"):
            out[n] = (Shard(1 if embedding else 0),)
        elif r.kind == "rowwise":
            if embedding:
                out[n] = (Shard(0),)
            elif n == "weight":
                out[n] = (Shard(1),)
        elif r.kind == "packed_colwise":
            out[n] = (strided_shard(0, r.split_factor),)
        elif r.kind == "experts":
            out[n] = tuple(expert_placements(n, r.split_factor))
        elif r.kind == "expert_parallel":
            out[n] = (Shard(0),)
    return out


def sharded_dim(placement: Any) -> tuple[int, int] | None:
    """``(dim, split_factor)`` of a ``Shard``/``_StridedShard`` (``None`` for anything else)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    if isinstance(placement, _StridedShard):
        return placement.dim, int(placement.split_factor)
    if placement.is_shard():
        return placement.dim, 1
    return None


def tied_names(model: nn.Module) -> list[list[str]]:
    """The names of each parameter ``model`` holds under more than one name."""
    by_id: dict[int, list[str]] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        by_id.setdefault(id(t), []).append(name)
    return [names for names in by_id.values() if len(names) > 1]


def _check_tied(model: nn.Module, resolved: list[ResolvedStyle]) -> None:
    by_module = {r.path: r for r in resolved}
    placements: dict[str, tuple[Any, ...]] = {}
    for path, r in by_module.items():
        for n, p in param_placements(model.get_submodule(path), r).items():
            placements[f"{path}.{n}" if path else n] = p
    for names in tied_names(model):
        seen = {tuple(map(repr, placements.get(n, ()))) for n in names}
        if len(seen) > 1:
            shown = ", ".join(
                f"{n}: {[repr(p) for p in placements.get(n, ())] or 'replicated'}" for n in names
            )
            raise ConfigurationError(
                f"tied parameters get different placements under tp_plan ({shown}); a tied parameter is one "
                "tensor. Give both modules styles with the same placement (e.g. embedding rowwise with "
                "lm_head colwise, both Shard(0)), or untie them."
            )


def is_expert_mesh(device_mesh: Any) -> bool:
    """Whether ``device_mesh`` is a 1-D mesh named ``"ep"`` (``tp_plan="auto"`` then means ``ep_plan``)."""
    return tuple(getattr(device_mesh, "mesh_dim_names", None) or ()) == ("ep",)


def check_mesh(device_mesh: Any) -> Any:
    """A 1-D ``DeviceMesh`` to apply a ``tp_plan`` on (a 2-D mesh is an error naming the dim to
    slice); a model the user parallelized on an n-D mesh loads by its placements without one."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh):
        raise ConfigurationError(
            f"device_mesh must be a torch.distributed.device_mesh.DeviceMesh, got {type(device_mesh).__name__}; "
            "build one with init_device_mesh(device_type, (world_size,))."
        )
    if device_mesh.ndim != 1:
        names = device_mesh.mesh_dim_names or ()
        hint = f'mesh["{names[0]}"]' if "tp" not in names and names else 'mesh["tp"]'
        raise ConfigurationError(
            f"device_mesh has {device_mesh.ndim} dims {tuple(names) or ''}; tensor parallelism here takes the 1-D "
            f"mesh of its dim: pass {hint}."
        )
    return device_mesh


def local_region(
    placements: tuple[Any, ...],
    shape: tuple[int, ...],
    world_size: int | Sequence[int],
    rank: int | Sequence[int],
    *,
    name: str = "a tensor",
) -> Region | Box | None:
    """The part of a tensor of global ``shape`` that a rank holds (``None``: all of it).

    ``placements`` has one entry per mesh dim; ``world_size`` is the mesh's shape (an int for a
    1-D mesh) and ``rank`` the rank's coordinate on it. Sharding is applied mesh dim by mesh dim,
    left to right, each ``Shard``/``_StridedShard`` cutting what the dims before it left on its
    tensor dim, exactly as torch's ``compute_local_shape_and_global_offset`` does (torch's chunk
    rules, ``_StridedShard``'s interleaved offsets). The result is a :class:`Region` when one
    tensor dim is cut, a :class:`Box` when several are.

    Example:
        >>> from torch.distributed.tensor import Shard
        >>> from torch.distributed.tensor.placement_types import _StridedShard
        >>> local_region((Shard(0),), (8, 4), 2, 1)
        Region(dim=0, intervals=((4, 8),))
        >>> local_region((_StridedShard(0, split_factor=2), Shard(0)), (8, 4), (2, 2), (0, 1))
        Region(dim=0, intervals=((4, 6),))
        >>> local_region((Shard(0), Shard(1)), (8, 4), (2, 2), (1, 0)).dims
        (0, 1)

    Raises:
        ConfigurationError: a placement that is neither a shard nor ``Replicate`` (``Partial``),
            placements that do not match the mesh's dims, or an uneven ``_StridedShard`` on a
            multi-dim mesh (naming ``name``, the dim, its size and the mesh dim).
    """
    from torch.distributed.tensor import Replicate

    sizes = (world_size,) if isinstance(world_size, int) else tuple(int(n) for n in world_size)
    coords = (rank,) if isinstance(rank, int) else tuple(int(r) for r in rank)
    if len(sizes) != len(placements) or len(coords) != len(placements):
        raise ConfigurationError(
            f"{name}: placements {tuple(placements)} do not fit a mesh of shape {sizes} at coordinate {coords}; "
            "give one placement per mesh dim."
        )
    ndim = len(shape)
    for mesh_dim, p in enumerate(placements):
        if not isinstance(p, Replicate) and sharded_dim(p) is None:
            raise ConfigurationError(
                f"{name}: placement {p!r} on mesh dim {mesh_dim} cannot be read shard by shard; a loaded "
                "parameter must be Shard, _StridedShard or Replicate on every mesh dim."
            )
    deferred = _chunked_after(placements, sizes, ndim)
    order = [i for i in range(len(placements)) if i not in deferred] + sorted(deferred, reverse=True)
    index: dict[int, torch.Tensor] = {}  # tensor dim -> global indices held, in local order
    for mesh_dim in order:
        p, n, c = placements[mesh_dim], sizes[mesh_dim], coords[mesh_dim]
        if isinstance(p, Replicate):
            continue
        dim = p.dim % ndim
        held = index.get(dim)
        current = int(shape[dim]) if held is None else int(held.numel())
        if mesh_dim in deferred:
            from torch.distributed.tensor import Shard

            p = Shard(dim)
        local = _chunk_indices(
            p, current, n, c, strided=len(sizes) > 1, name=name, dim=dim, mesh_dim=mesh_dim
        )
        index[dim] = local if held is None else held[local]
    parts = [_as_region(d, idx, name) for d, idx in index.items()]
    return Box.of(parts, shape)


def _chunked_after(placements: Sequence[Any], sizes: Sequence[int], ndim: int) -> set[int]:
    """Mesh dims whose ``_StridedShard`` chunks what a later ``_StridedShard`` left (FSDP2 over packed TP).

    FSDP2 over a tensor-parallel ``Shard(d)`` declares ``_StridedShard(d, sf=tp)`` on its dp dim:
    torch's left-to-right arithmetic then gives each rank the dp chunk of its TP shard, which is
    what FSDP2 holds. Over a packed ``_StridedShard(d, 2)`` (``packed_colwise``) it declares the
    same, but the arithmetic no longer describes FSDP2's data: FSDP2 cut each rank's TP shard
    (``[G_r | U_r]``) into contiguous dp chunks, and its all-gather in the forward puts them back
    together. For that case (a ``_StridedShard`` whose factor is the number of later shards on
    its dim, at least one of them strided) the dp dim is applied after the later dims, as a plain
    chunk of what they leave: the layout FSDP2 builds from real weights and computes with.
    """
    from torch.distributed.tensor.placement_types import _StridedShard

    out: set[int] = set()
    for i, p in enumerate(placements):
        if not isinstance(p, _StridedShard):
            continue
        later = [j for j in range(i + 1, len(placements)) if sharded_dim(placements[j]) is not None]
        later = [j for j in later if placements[j].dim % ndim == p.dim % ndim]
        if not any(isinstance(placements[j], _StridedShard) for j in later):
            continue
        if int(p.split_factor) == math.prod(sizes[j] for j in later):
            out.add(i)
    return out


def _chunk_indices(
    p: Any, size: int, chunks: int, coord: int, *, strided: bool, name: str, dim: int, mesh_dim: int
) -> torch.Tensor:
    """The indices (into a dim of ``size``) that ``p`` gives coordinate ``coord`` of ``chunks``."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.placement_types import _StridedShard, _StridedShardOffsetMode

    if isinstance(p, _StridedShard):
        if strided and size % (chunks * int(p.split_factor)):
            raise ConfigurationError(
                f"{name}: dim {dim} of size {size} is placed {p!r} on mesh dim {mesh_dim} of size {chunks}, "
                f"which does not divide it into {chunks} x {p.split_factor} equal parts; use mesh and model sizes "
                "that divide it."
            )
        _, offsets = p.local_shard_size_and_offset(size, chunks, coord, _StridedShardOffsetMode.ALL)
        return torch.tensor(list(offsets or ()), dtype=torch.long)  # type: ignore[arg-type]
    length, offset = Shard.local_shard_size_and_offset(size, chunks, coord)
    return torch.arange(int(offset), int(offset) + int(length))


def _as_region(dim: int, index: torch.Tensor, name: str) -> Region:
    """The sorted global ``index`` of one dim as runs of consecutive indices."""
    if index.numel() == 0:
        return Region(dim, ())
    if index.numel() > 1 and not bool((index[1:] > index[:-1]).all()):
        raise ConfigurationError(
            f"{name}: its placements give this rank the rows {index.tolist()[:8]}... of dim {dim} out of order, "
            "which no region read describes; use placements whose shards keep the global order."
        )
    breaks = torch.nonzero(index[1:] != index[:-1] + 1).flatten().tolist()
    starts = [0, *(b + 1 for b in breaks)]
    stops = [*(b + 1 for b in breaks), int(index.numel())]
    return Region.of(dim, [(int(index[a]), int(index[b - 1]) + 1) for a, b in zip(starts, stops)])


def local_split_sizes(param: torch.Tensor, sizes: Sequence[int], *, dim: int = 0) -> list[int]:
    """Per part of ``param``'s ``dim`` (consecutive parts of global ``sizes``), how much this rank holds.

    A fused projection (``qkv_proj``, ``gate_up_proj``) splits its output by its parts' widths.
    Under tensor parallelism its weight is a DTensor and the output holds only this rank's rows,
    in order: ``packed_colwise`` gives rank r ``[G_r | U_r]``, so the split takes ``[I/w, I/w]``,
    not the global ``[I, I]``. A plain tensor (no tensor parallelism) gets ``sizes`` back as they
    are. Computed once per placement, shape and rank (cached): a forward calls it on every step.

    Every rank must hold the same share of every part (what a fused module's parts need to
    stay aligned: ``silu(gate) * up``, heads of q, k and v); a placement that gives a rank whole
    parts instead (plain ``colwise``: ``[I, 0]`` on rank 0) is refused.

    Example:
        >>> import torch
        >>> local_split_sizes(torch.zeros(96, 32), [48, 48])
        [48, 48]

    Raises:
        ConfigurationError: ``sizes`` do not add up to the DTensor's ``dim``, the rank holds a
            different share of each part, or its placements are not ones a rank's rows can be
            named for (see :func:`local_region`).
    """
    dtensor = dtensor_type()
    if dtensor is None or not isinstance(param, dtensor):
        return list(sizes)
    shape, parts = tuple(param.shape), tuple(int(n) for n in sizes)
    if sum(parts) != shape[dim]:
        raise ConfigurationError(
            f"a fused parameter of global shape {shape} is split into parts {list(parts)} on dim {dim}, which "
            f"add up to {sum(parts)}, not {shape[dim]}; the fusion's sizes must add up to the fused dim."
        )
    mesh = param.device_mesh  # type: ignore[attr-defined]
    placements = tuple(param.placements)  # type: ignore[attr-defined]
    coordinate = mesh.get_coordinate()
    return list(
        _local_parts(placements, shape, tuple(mesh.shape), tuple(coordinate), parts, dim % len(shape))
    )


# Fused forwards call it from their fx graphs, whose code names a function by its module: the
# public path keeps that code (and a preview showing it) the same wherever the function lives.
local_split_sizes.__module__ = "surgery.parallel"
__test__ = {"local_split_sizes": local_split_sizes}  # its example runs as this module's doctest too


@functools.lru_cache(maxsize=256)
def _local_parts(
    placements: tuple[Any, ...],
    shape: tuple[int, ...],
    world: tuple[int, ...],
    rank: tuple[int, ...],
    parts: tuple[int, ...],
    dim: int,
) -> tuple[int, ...]:
    region = local_region(placements, shape, world, rank)
    if isinstance(region, Box):
        region = next((r for r in region.parts if r.dim == dim), None)
    if region is None or region.dim != dim:  # replicated, or sharded on another dim: every row is here
        return parts
    out, start = [], 0
    for n in parts:
        out.append(intersect(region, start, start + n).size)
        start += n
    held, total = sum(out), sum(parts)
    if any(o * total != held * n for o, n in zip(out, parts)):
        raise ConfigurationError(
            f"a fused parameter of global shape {shape} split into parts {list(parts)} on dim {dim} is placed "
            f"{tuple(placements)}, which gives rank {rank[0] if len(rank) == 1 else rank} of "
            f"{world[0] if len(world) == 1 else world} the rows {out} of those parts: not the same "
            "share of each, so its output cannot be split into aligned parts. Shard it with packed_colwise "
            f"(PackedColwiseParallel(split_factor={len(parts)})), which gives every rank its share of every part."
        )
    return tuple(out)
