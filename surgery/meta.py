"""Results on ``meta`` by shape arithmetic, so that planning never imports ``torch._dynamo``.

Planning a load runs every op chain, quantizer hook and fusion rewrite on ``meta`` tensors, so
that shapes, dtypes and key names are checked before a byte is read. torch computes many ``meta``
results (``cat``, ``stack``, arithmetic, the random fills of ``torch.nn.init``) with Python
references whose first call imports ``torch._dynamo`` and sympy, once per process: a first load
would pay that start-up cost for tensors that hold no data. The helpers here answer a ``meta``
input with an empty ``meta`` tensor of the result's shape and dtype instead; on any other device
:func:`cat` and :func:`stack` are the torch calls. ``tests/test_empty.py`` checks that a planned
load (plain, FP8 and int8) leaves ``torch._dynamo`` unimported.

A quantizer answers a planning call the same way (``docs/quantization.md``):

Example:
    >>> import torch
    >>> from surgery import meta
    >>> def decode(key, tensor, companions, region=None):
    ...     if meta.is_meta(tensor):  # planning: shapes only
    ...         return meta.empty(tensor.shape, torch.float32)
    ...     return tensor.to(torch.float32) * companions[key + "_scale"]
    >>> decode("w", torch.empty(2, 3, dtype=torch.int8, device="meta"), {}).dtype
    torch.float32
    >>> meta.cat([torch.empty(2, 3, device="meta"), torch.empty(4, 3, device="meta")], dim=0).shape
    torch.Size([6, 3])
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["cat", "empty", "is_meta", "stack"]


def is_meta(*tensors: torch.Tensor) -> bool:
    """Whether every tensor given is on ``meta`` (and at least one is given).

    Args:
        *tensors: the inputs of the computation about to run.

    Returns:
        ``True`` when the computation has shapes only, and should answer with :func:`empty`.
    """
    return bool(tensors) and all(t.device.type == "meta" for t in tensors)


def empty(shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """An empty ``meta`` tensor: the answer of a computation on ``meta`` inputs.

    Args:
        shape: the result's shape.
        dtype: the result's dtype.

    Returns:
        A tensor on ``meta`` (no storage, no kernel run).
    """
    return torch.empty(tuple(shape), dtype=dtype, device="meta")


def cat(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.cat``; on ``meta`` inputs, the result's shape by arithmetic.

    The inputs are trusted to agree in every dim but ``dim`` and in dtype (a caller that has not
    checked that should call ``torch.cat`` on real tensors).

    Args:
        tensors: the tensors to concatenate, all on ``meta`` or none.
        dim: the dimension to concatenate along (negative counts from the end).

    Returns:
        The concatenation (on ``meta``: empty, the first input's dtype).
    """
    if not is_meta(*tensors):
        return torch.cat(list(tensors), dim=dim)
    first = tensors[0]
    shape = list(first.shape)
    d = dim % first.ndim
    shape[d] = sum(t.shape[d] for t in tensors)
    return empty(shape, first.dtype)


def stack(tensors: Sequence[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """``torch.stack``; on ``meta`` inputs, the result's shape by arithmetic (see :func:`cat`).

    Args:
        tensors: tensors of one shape and dtype, all on ``meta`` or none.
        dim: where the new dimension goes (negative counts from the end of the result).

    Returns:
        The stacked tensor (on ``meta``: empty, the first input's dtype).
    """
    if not is_meta(*tensors):
        return torch.stack(list(tensors), dim=dim)
    shape = list(tensors[0].shape)
    shape.insert(dim % (len(shape) + 1), len(tensors))
    return empty(shape, tensors[0].dtype)
