"""Applying a tensor-parallel plan: parameters become DTensors with their placements.

:func:`parallelize` validates the plan (:func:`~surgery.parallel.resolve_tp_plan`) and hands each
module's style (:mod:`surgery.parallel.styles`) to torch's ``parallelize_module``; every rank of
the mesh calls it (``tests/test_parallel_loading.py`` runs it on two gloo ranks).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from torch import nn

from .plan import ResolvedStyle, check_mesh, is_expert_mesh, resolve_tp_plan, tied_names

__all__ = ["parallelize"]


def parallelize(model: nn.Module, tp_plan: Mapping[str, Any] | str, device_mesh: Any) -> list[ResolvedStyle]:
    """Validate ``tp_plan`` and apply it: parameters become DTensors, no data moves.

    Calls ``parallelize_module(..., src_data_rank=None)`` per module of the plan: works on a
    model built on ``meta`` (nothing to move) or on any device. Tied parameters stay tied.
    ``tp_plan="auto"`` is the model's ``tp_plan``, or its ``ep_plan`` on a 1-D mesh named
    ``"ep"`` (``init_device_mesh("cuda", (n,), mesh_dim_names=("ep",))``). Returns the resolved plan.

    Raises:
        ConfigurationError: the plan does not fit the model (before anything changes).
    """
    from torch.distributed.tensor.parallel import parallelize_module

    from .styles import style_for

    mesh = check_mesh(device_mesh)
    resolved = resolve_tp_plan(model, tp_plan, world_size=mesh.size(), expert=is_expert_mesh(mesh))
    tied = tied_names(model)
    plan = {
        r.path: (style_for(r.kind, model.get_submodule(r.path)) if isinstance(r.style, str) else r.style)
        for r in resolved
        if r.kind != "replicate"
    }
    for path, style in plan.items():
        parallelize_module(model.get_submodule(path) if path else model, mesh, style, src_data_rank=None)
    for names in tied:
        first = model.get_parameter(names[0])
        for alias in names[1:]:
            mp, _, n = alias.rpartition(".")
            (model.get_submodule(mp) if mp else model)._parameters[n] = first
    return resolved
