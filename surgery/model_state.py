"""What loading and saving need to know about a module tree and its dtypes.

The runtime tensors behind the state dict and which names share one tensor (tied weights), the
config of the sub-model that owns a key, the device a model lives on, a ``meta`` copy for dry
runs, and whether a dtype cast can change a value.
"""

from __future__ import annotations

import copy
import itertools
from typing import Any

import torch
from torch import nn

__all__ = [
    "config_lookup",
    "dtype_name",
    "lossy_cast",
    "meta_clone",
    "model_device",
    "runtime_tensors",
    "tied_groups",
]


def runtime_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """Runtime keys → the tensor object behind them (parameters and persistent buffers)."""
    return dict(model.state_dict(keep_vars=True))


def tied_groups(tensors: dict[str, torch.Tensor]) -> dict[str, list[str]]:
    by_id: dict[int, list[str]] = {}
    for k, t in tensors.items():
        by_id.setdefault(id(t), []).append(k)
    return {k: keys for keys in by_id.values() if len(keys) > 1 for k in keys}


def config_lookup(model: nn.Module):
    """``key -> config``: the ``config`` of the nearest module above ``key`` that has one (cached)."""
    cache: dict[str, Any] = {}

    def config_for(key: str) -> Any:
        parts = key.split(".")[:-1]
        while True:
            path = ".".join(parts)
            if path in cache:
                return cache[path]
            try:
                mod = model.get_submodule(path) if path else model
            except AttributeError:
                mod = None
            cfg = getattr(mod, "config", None) if mod is not None else None
            if cfg is not None or not parts:
                cache[path] = cfg
                return cfg
            parts.pop()

    return config_for


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def meta_clone(model: nn.Module) -> nn.Module:
    """A structural copy of ``model`` whose tensors live on ``meta`` (no data is copied)."""
    memo: dict[int, Any] = {}
    for t in list(model.parameters()) + list(model.buffers()):
        if id(t) in memo:
            continue
        meta = t.detach().to("meta")
        memo[id(t)] = (
            nn.Parameter(meta, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else meta
        )
    return copy.deepcopy(model, memo)


def model_device(model: nn.Module) -> torch.device | None:
    """The device of the model's first tensor that is not on ``meta`` (``None`` if all are)."""
    for t in itertools.chain(model.parameters(), model.buffers()):
        if t.device.type != "meta":
            return t.device
    return None


def lossy_cast(source: torch.dtype, target: torch.dtype) -> bool:
    """Whether casting ``source`` to ``target`` can change a value (every value must be representable).

    Example:
        >>> lossy_cast(torch.bfloat16, torch.float32), lossy_cast(torch.float32, torch.bfloat16)
        (False, True)
    """
    if source == target or source == torch.bool:
        return False
    if source.is_complex or target.is_complex or target == torch.bool:
        return True
    if source.is_floating_point:
        if not target.is_floating_point:
            return True
        a, b = torch.finfo(source), torch.finfo(target)
        smallest_a, smallest_b = a.smallest_normal * a.eps, b.smallest_normal * b.eps  # subnormals
        return not (b.eps <= a.eps and b.max >= a.max and smallest_b <= smallest_a)
    ia = torch.iinfo(source)
    if target.is_floating_point:
        fb = torch.finfo(target)
        return max(abs(ia.min), ia.max) > 2 / fb.eps  # integers above 2**(mantissa + 1) round
    ib = torch.iinfo(target)
    return ia.min < ib.min or ia.max > ib.max
