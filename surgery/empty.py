"""Building a model without allocating its weights: parameters on ``meta``, buffers real.

``with torch.device("meta"): model = Model(config)`` puts *everything* on ``meta``, including the
non-persistent buffers a model computes in ``__init__`` (rotary ``inv_freq``, position ids).
Those are not in any checkpoint, so after a load they still hold no data and the first forward
fails with "Cannot copy out of meta tensor". :func:`init_empty` builds the parameters on
``meta`` (no memory, no initialization cost: ``reset_parameters`` runs on ``meta``) and leaves
buffers where they are computed, so a model built under it and then loaded can run.

Example:
    >>> import torch, surgery
    >>> with surgery.init_empty():
    ...     layer = torch.nn.BatchNorm1d(4)
    >>> layer.weight.device.type, layer.running_mean.device.type
    ('meta', 'cpu')
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from . import meta

__all__ = ["init_empty"]

_lock = threading.Lock()
_INITS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)
"""``torch.nn.init`` functions that do nothing on a ``meta`` parameter while :func:`init_empty` is open.

A first random init of a meta tensor runs torch's Python meta reference, which imports
``torch._dynamo`` (see :mod:`surgery.meta`); with nothing to fill there is no reason to pay it."""


@contextlib.contextmanager
def init_empty(*, include_buffers: bool = False) -> Iterator[None]:
    """Build modules with their parameters on ``meta`` (and buffers too with ``include_buffers``).

    While the context is active, every parameter a module registers is replaced by a ``meta``
    parameter of the same shape, dtype, class and ``requires_grad``, and ``torch.nn.init``
    functions skip ``meta`` tensors; buffers stay real unless ``include_buffers=True`` (then this
    is ``torch.device("meta")``). The patch of
    ``nn.Module.register_parameter`` is process-wide while the context is open: build one model
    at a time (contexts do not nest across threads).

    Args:
        include_buffers: put buffers on ``meta`` as well.
    """
    with _lock:
        original = nn.Module.register_parameter
        inits = {name: getattr(nn.init, name) for name in _INITS if hasattr(nn.init, name)}

        def register_parameter(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
            original(self, name, param)
            if param is not None and param.device.type != "meta":
                kwargs = dict(param.__dict__)  # subclasses keep their attributes
                on_meta = param.detach().to("meta")
                try:
                    new = type(param)(on_meta, requires_grad=param.requires_grad)
                except TypeError:  # a Parameter subclass with another constructor
                    new = nn.Parameter(on_meta, requires_grad=param.requires_grad)
                new.__dict__.update(kwargs)
                self._parameters[name] = new

        def skipping(init: Callable[..., Any]) -> Callable[..., Any]:
            def run(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if isinstance(tensor, torch.Tensor) and meta.is_meta(tensor):
                    return tensor  # nothing to fill, and no meta reference to import (surgery.meta)
                return init(tensor, *args, **kwargs)

            return run

        for name, init in inits.items():
            setattr(nn.init, name, skipping(init))
        try:
            if include_buffers:  # everything on meta: factories too, so nothing is computed
                with torch.device("meta"):
                    yield
            else:
                nn.Module.register_parameter = register_parameter  # type: ignore[method-assign]
                yield
        finally:
            nn.Module.register_parameter = original  # type: ignore[method-assign]
            for name, init in inits.items():
                setattr(nn.init, name, init)
