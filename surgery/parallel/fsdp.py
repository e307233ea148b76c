"""FSDP2 over tensor parallelism on a named mesh, applied the torchtitan way, validated first.

:func:`shard_model` is what ``load_checkpoint(model, ckpt, device_mesh=mesh, tp_plan="auto",
fsdp=True)`` runs before reading: ``tp_plan`` on ``mesh["tp"]`` (:func:`~surgery.parallel.parallelize`;
on ``mesh["ep"]`` for a mesh with an ``ep`` dim, where ``"auto"`` is the model's ``ep_plan``),
then torch's ``fully_shard`` on each decoder layer and at the root over the data-parallel dims
(``mesh["dp_shard"]``, or ``mesh["dp_replicate", "dp_shard"]`` for HSDP). The mesh dims are named
as torchtitan names them (:data:`~surgery.parallel.mesh_shape.MESH_DIM_NAMES`).

``fsdp`` is ``True`` or an :class:`FSDPOptions`: the two ``fully_shard`` options that change what
a training run does (``reshard_after_forward``, ``mp_policy``), under torch's own names, plus
``layers``, where the decoder layers are. :func:`decoder_layers` finds them by default: the
``ModuleList`` whose blocks are of a class in transformers' ``_no_split_modules``, else the one
outermost ``ModuleList`` of repeated blocks.

Everything that can be checked is checked before the model changes: dim names, a plan without a
``tp`` (or ``ep``) dim, layers that cannot be wrapped (not found, or a parameter shared between a layer and
anything else), and every parameter's dim 0 dividing evenly over ``dp_shard`` after TP (the error
names the parameter, its size, the mesh dim and its size).

Example:
    >>> FSDPOptions(reshard_after_forward=False).layers is None
    True
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..errors import ConfigurationError
from .mesh_shape import MESH_DIM_NAMES, PARALLEL_DIMS, parallel_dim

__all__ = ["FSDPOptions", "decoder_layers", "fsdp_options", "shard_model"]


@dataclass(frozen=True, kw_only=True)
class FSDPOptions:
    """How :func:`shard_model` calls ``fully_shard`` (``fsdp=True`` is ``FSDPOptions()``).

    Attributes:
        reshard_after_forward: torch's ``fully_shard`` option of that name (free the gathered
            parameters after the forward; ``False`` keeps them until the backward).
        mp_policy: a ``torch.distributed.fsdp.MixedPrecisionPolicy`` (default: none).
        layers: the dotted path of the ``ModuleList`` of decoder layers (default: found by
            :func:`decoder_layers`).
    """

    reshard_after_forward: bool | int = True
    mp_policy: Any = None
    layers: str | None = None


def fsdp_options(fsdp: Any) -> FSDPOptions | None:
    """``fsdp=`` as given to a load: ``None``/``False`` (no FSDP), ``True`` or :class:`FSDPOptions`."""
    if fsdp is None or fsdp is False:
        return None
    if fsdp is True:
        return FSDPOptions()
    if isinstance(fsdp, FSDPOptions):
        return fsdp
    raise ConfigurationError(
        f"fsdp={fsdp!r}: pass True or surgery.parallel.fsdp.FSDPOptions(reshard_after_forward=..., mp_policy=...)."
    )


def decoder_layers(model: nn.Module, layers: str | None = None) -> tuple[str, nn.ModuleList]:
    """The decoder layers FSDP2 wraps one by one: ``(path, module list)``.

    ``layers`` names the ``ModuleList``; by default, the one whose blocks are of a class named in
    the model's ``_no_split_modules`` (transformers), else the one outermost ``ModuleList`` of
    blocks of one class.

    Example:
        >>> from surgery.examples.dense import build_dense_model
        >>> decoder_layers(build_dense_model(device="meta"))[0]
        'model.layers'
    """
    if layers is not None:
        try:
            found = model.get_submodule(layers)
        except AttributeError:
            found = None
        if not isinstance(found, nn.ModuleList) or not len(found):
            raise ConfigurationError(
                f"FSDPOptions(layers={layers!r}) is not a non-empty nn.ModuleList of the model; name the list of "
                "decoder layers (e.g. 'model.layers')."
            )
        return layers, found
    lists = {p: m for p, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)}
    no_split = set(getattr(model, "_no_split_modules", None) or ())
    named = [p for p, m in lists.items() if no_split and all(type(b).__name__ in no_split for b in m)]
    repeated = [p for p, m in lists.items() if len({type(b) for b in m}) == 1]
    for candidates in (named, repeated):
        outer = [p for p in candidates if not any(p.startswith(q + ".") for q in candidates if q != p)]
        if len(outer) == 1:
            return outer[0], lists[outer[0]]
    raise ConfigurationError(
        f"cannot tell the decoder layers of {type(model).__name__} for FSDP2 (ModuleLists of repeated blocks: "
        f"{repeated or 'none'}); pass fsdp=FSDPOptions(layers='<path of the ModuleList>')."
    )


def shard_model(
    model: nn.Module, device_mesh: Any, *, tp_plan: Mapping[str, Any] | str | None, fsdp: Any
) -> None:
    """TP on ``device_mesh["tp"]`` (or the plan on ``device_mesh["ep"]``), then ``fully_shard`` per
    decoder layer and at the root.

    Parameters become DTensors with their placements; no data moves (a model on ``meta`` stays
    there). Every check runs before ``fully_shard``; a failure after TP leaves TP applied, which
    :func:`~surgery.load_checkpoint` undoes.

    Raises:
        ConfigurationError: the mesh, the plan or the layers do not fit, naming the fix.
    """
    options = fsdp_options(fsdp)
    names = _mesh_names(device_mesh)
    _check_dims(names, tp_plan, options)
    layers = decoder_layers(model, options.layers)[1] if options is not None else None
    if layers is not None:
        _check_wrappable(model, layers)
    dim = parallel_dim(names)
    if tp_plan is not None and dim is not None:
        from .apply import parallelize

        parallelize(model, tp_plan, device_mesh[dim])
    if options is None or layers is None:
        return
    dp = tuple(n for n in names if n not in PARALLEL_DIMS)
    dp_mesh = device_mesh[dp] if len(dp) > 1 else device_mesh[dp[0]]
    _check_divides(model, device_mesh.size(names.index("dp_shard")))
    from torch.distributed.fsdp import fully_shard

    kwargs: dict[str, Any] = {"reshard_after_forward": options.reshard_after_forward}
    if options.mp_policy is not None:
        kwargs["mp_policy"] = options.mp_policy
    for layer in layers:
        fully_shard(layer, mesh=dp_mesh, **kwargs)
    fully_shard(model, mesh=dp_mesh, **kwargs)


def _mesh_names(device_mesh: Any) -> tuple[str, ...]:
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(device_mesh, DeviceMesh) or not device_mesh.mesh_dim_names:
        raise ConfigurationError(
            f"fsdp= needs a DeviceMesh with named dims, got {device_mesh!r}; build one with init_device_mesh("
            "'cuda', (dp, tp), mesh_dim_names=('dp_shard', 'tp'))."
        )
    return tuple(device_mesh.mesh_dim_names)


def _check_dims(names: tuple[str, ...], tp_plan: Any, options: FSDPOptions | None) -> None:
    if options is None:
        dim = parallel_dim(names)
        tp = f'mesh["{dim}"]' if dim else "the 1-D mesh of its dim"
        raise ConfigurationError(
            f"device_mesh has {len(names)} dims {list(names)}: for tensor parallelism alone pass {tp}; for FSDP2 "
            f"over TP name the dims from {', '.join(MESH_DIM_NAMES)} and pass fsdp=True."
        )
    unknown = [n for n in names if n not in MESH_DIM_NAMES]
    if unknown or list(names) != sorted(names, key=MESH_DIM_NAMES.index):
        raise ConfigurationError(
            f"device mesh dims {list(names)}: name them from {', '.join(MESH_DIM_NAMES)}, in that order "
            f"(torchtitan's names){f'; {unknown} are unknown' if unknown else ''}."
        )
    dim = parallel_dim(names)
    if tp_plan is not None and dim is None:
        raise ConfigurationError(
            f"tp_plan= shards on the mesh dim 'tp' (or 'ep'), which the mesh {list(names)} lacks: add one or leave "
            "tp_plan out."
        )
    if tp_plan is None and dim is not None:
        raise ConfigurationError(
            f"the mesh {list(names)} has a {dim!r} dim but no tp_plan= says what to shard on it."
        )
    if not any(n not in PARALLEL_DIMS for n in names):
        raise ConfigurationError(
            f"fsdp= shards over 'dp_shard', which the mesh {list(names)} lacks: add the dim or leave fsdp out."
        )
    if "dp_replicate" in names and "dp_shard" not in names:
        raise ConfigurationError(
            f"the mesh {list(names)} replicates without sharding; HSDP takes ('dp_replicate', 'dp_shard', ...)."
        )


def _check_wrappable(model: nn.Module, layers: nn.ModuleList) -> None:
    """Each layer's parameters are its own: FSDP2 shards each layer's as one group."""
    owner: dict[int, str] = {}
    for i, layer in enumerate(layers):
        for name, p in layer.named_parameters(remove_duplicate=False):
            if owner.setdefault(id(p), f"layer {i}") != f"layer {i}":
                raise ConfigurationError(
                    f"decoder layer {i} cannot be wrapped by fully_shard: its parameter {name!r} is shared with "
                    f"{owner[id(p)]}; untie it or pass fsdp=FSDPOptions(layers=...) naming other layers."
                )
    in_layers = {id(p) for layer in layers for p in layer.parameters()}
    inside = {id(m) for m in layers.modules()}
    for name, p in model.named_parameters(remove_duplicate=False):
        path = name.rpartition(".")[0]
        if id(p) in in_layers and id(model.get_submodule(path) if path else model) not in inside:
            raise ConfigurationError(
                f"a decoder layer cannot be wrapped by fully_shard: {name!r}, outside the layers, shares its "
                "parameter with a layer; untie it or pass fsdp=FSDPOptions(layers=...) naming other layers."
            )


def _check_divides(model: nn.Module, dp: int) -> None:
    """FSDP2's ``Shard(0)`` over ``dp`` ranks, after TP: dim 0 of each local tensor divides evenly."""
    from .dtensors import is_dtensor

    for name, p in model.named_parameters():
        local = p.to_local() if is_dtensor(p) else p  # type: ignore[attr-defined]
        if local.ndim and local.shape[0] % dp:
            where = " (its tensor-parallel shard)" if is_dtensor(p) else ""
            raise ConfigurationError(
                f"parameter {name!r}: dim 0 has size {local.shape[0]}{where}, which the mesh dim 'dp_shard' of size "
                f"{dp} does not divide; pick a dp_shard size that divides it."
            )
