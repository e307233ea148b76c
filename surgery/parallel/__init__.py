"""Tensor parallelism (and FSDP2 meshes) on ``torch.distributed``: plans, styles, regions, DTensors.

* :mod:`~surgery.parallel.plan`: :func:`resolve_tp_plan` (a ``tp_plan`` validated against a
  model) and placement arithmetic (:func:`param_placements`, :func:`local_region`,
  :func:`local_split_sizes`).
* :mod:`~surgery.parallel.hf_plan`: :func:`~surgery.parallel.hf_plan.translate_hf_plan`,
  transformers' ``tp_plan`` style names turned into this package's (what ``tp_plan="auto"``
  applies to a transformers model's own plan), or refused by name.
* :mod:`~surgery.parallel.styles`: :class:`PackedColwiseParallel`, :class:`ExpertsParallel`, :class:`ExpertParallel` and
  :class:`PackedLinearParallel`,
  ``ParallelStyle`` subclasses (importing it imports ``torch.distributed.tensor``).
* :mod:`~surgery.parallel.experts`: :func:`~surgery.parallel.experts.check_experts_module`, what
  a module must hold for ``expert_parallel`` (a leaf module).
* :mod:`~surgery.parallel.apply`: :func:`parallelize`, a plan applied to a model.
* :mod:`~surgery.parallel.fsdp`: :func:`shard_model` (TP on ``mesh["tp"]``, then FSDP2 per
  decoder layer and at the root, validated first: what ``load_checkpoint(..., fsdp=True)``
  runs) and :class:`FSDPOptions`.
* :mod:`~surgery.parallel.regions`: :class:`Region` (a rank's part of a tensor on one dim),
  :class:`~surgery.parallel.regions.Box` (on several dims, from an n-D mesh) and :class:`TPSlice`
  (what a load plan records of it); a leaf module.
* :mod:`~surgery.parallel.mesh_shape`: :class:`~surgery.parallel.mesh_shape.MeshShape`, a named
  n-D mesh as plain numbers, and the placements FSDP2 over TP gives a parameter (dry runs).
* :mod:`~surgery.parallel.dtensors`: DTensors recognized, gathered and built at run time.
* :mod:`~surgery.parallel.dcp`: resharding through ``torch.distributed.checkpoint``:
  :func:`save_dcp` / :func:`load_dcp` (a model's runtime state, any placements, and its load
  record) and :func:`dcp_state_dict` (each DTensor as :class:`LocalShards`, DCP chunks).
* :mod:`~surgery.parallel.assemble`: where each rank's shard of a DTensor lies in the whole
  tensor (:func:`~surgery.parallel.assemble.local_indices`, any placements on an n-D mesh), and
  a DTensor assembled whole on one rank (:func:`~surgery.parallel.assemble.assemble_on`).

What one rank reads of a checkpoint is planned in :mod:`surgery.load.sharding`. Every name is
imported on first use, so ``import surgery.parallel`` imports no ``torch.distributed.tensor``.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .apply import parallelize
    from .dcp import LocalShards, dcp_state_dict, load_dcp, save_dcp
    from .dtensors import dtensor_type, dtensors_of, from_local, full_tensor, has_dtensors, is_dtensor
    from .fsdp import FSDPOptions, shard_model
    from .plan import (
        STYLE_NAMES,
        ResolvedStyle,
        check_mesh,
        local_region,
        local_split_sizes,
        param_placements,
        resolve_tp_plan,
    )
    from .regions import Region, TPSlice
    from .styles import (
        ExpertParallel,
        ExpertsParallel,
        PackedColwiseParallel,
        PackedLinearParallel,
        strided_shard,
    )

_LAZY = {
    "parallelize": ".apply",
    "FSDPOptions": ".fsdp",
    "shard_model": ".fsdp",
    "LocalShards": ".dcp",
    "dcp_state_dict": ".dcp",
    "load_dcp": ".dcp",
    "save_dcp": ".dcp",
    "dtensor_type": ".dtensors",
    "dtensors_of": ".dtensors",
    "from_local": ".dtensors",
    "full_tensor": ".dtensors",
    "has_dtensors": ".dtensors",
    "is_dtensor": ".dtensors",
    "STYLE_NAMES": ".plan",
    "ResolvedStyle": ".plan",
    "check_mesh": ".plan",
    "local_region": ".plan",
    "local_split_sizes": ".plan",
    "param_placements": ".plan",
    "resolve_tp_plan": ".plan",
    "strided_shard": ".styles",
    "Region": ".regions",
    "TPSlice": ".regions",
    "ExpertParallel": ".styles",
    "ExpertsParallel": ".styles",
    "PackedColwiseParallel": ".styles",
    "PackedLinearParallel": ".styles",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'surgery.parallel' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "STYLE_NAMES",
    "ExpertParallel",
    "ExpertsParallel",
    "FSDPOptions",
    "LocalShards",
    "PackedColwiseParallel",
    "PackedLinearParallel",
    "Region",
    "ResolvedStyle",
    "TPSlice",
    "check_mesh",
    "dcp_state_dict",
    "dtensor_type",
    "dtensors_of",
    "from_local",
    "full_tensor",
    "has_dtensors",
    "is_dtensor",
    "load_dcp",
    "local_region",
    "local_split_sizes",
    "parallelize",
    "param_placements",
    "resolve_tp_plan",
    "save_dcp",
    "shard_model",
    "strided_shard",
]
