"""Quantized weights on save: what a quantized module stands for, and the quantizer a model holds.

An original-layout save turns every quantized module (:class:`~surgery.quantization.QuantizedModule`,
e.g. an int8 linear quantized on the fly) back into floats, one group at a time
(:func:`dequantize_stage`), and writes them in the checkpoint's dtypes (lossy: the quantization
error stays). A runtime-layout save writes the codes and scales as they are, with the metadata of
the quantizer that made them (:func:`quantized_on_the_fly`). Weights *stored* quantized and decoded
at load (FP8 block scales) are re-encoded by :class:`~surgery.save.reverted.RevertedState` with
the scales the load recorded.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..quantization import QuantizerHooks
from ..record import record_of

__all__ = [
    "Dequantized",
    "dequantize_stage",
    "kept_packed",
    "model_quantizer",
    "quantized_keys",
    "quantized_on_the_fly",
    "value_of",
]


class Dequantized:
    """A float tensor an original-layout save computes from a quantized module, when its group is computed."""

    def __init__(self, module: nn.Module, name: str, meta: torch.Tensor, device: torch.device) -> None:
        self.module, self.name = module, name
        self.shape, self.dtype, self.device = meta.shape, meta.dtype, device

    def compute(self) -> torch.Tensor:
        return self.module.dequantized()[self.name]  # type: ignore[operator]

    def is_contiguous(self) -> bool:
        return True  # computed fresh


def dequantize_stage(
    model: nn.Module, state: dict[str, Any], *, names_attribute: str = "quantized_names"
) -> dict[str, Any]:
    """``state`` with every quantized module's tensors replaced by the float ones it stands for.

    ``names_attribute``: the attribute naming a module's quantized tensors (``"packed_names"``:
    the stored tensors a :class:`~surgery.quantization.PackedLinear` keeps, dequantized only when asked).
    """
    replaced: dict[str, list[tuple[str, Any]]] = {}
    dropped: set[str] = set()
    for path, module in model.named_modules():
        names = getattr(module, names_attribute, None)
        dequantized = getattr(module, "dequantized", None)
        if names is None or not callable(dequantized):
            continue
        prefix = f"{path}." if path else ""
        keys = [prefix + n for n in names if prefix + n in state]
        if not keys:
            continue
        device = state[keys[0]].device
        floats = [(prefix + n, Dequantized(module, n, m, device)) for n, m in dequantized(meta=True).items()]
        replaced[keys[0]] = floats
        dropped.update(keys)
    if not replaced:
        return state
    out: dict[str, Any] = {}
    for k, t in state.items():
        if k in replaced:
            out.update(replaced[k])
        elif k not in dropped:
            out[k] = t
    return out


def value_of(t: Any) -> torch.Tensor:
    """The whole tensor of a gathered source (a quantized module's floats are computed here)."""
    return t.compute() if isinstance(t, Dequantized) else t


def model_quantizer(model: nn.Module) -> Any:
    """The quantizer of the model's last load, else the one that prepared it, else ``None``."""
    record = record_of(model).load
    if record is not None and record.quantizer is not None:
        return record.quantizer
    return record_of(model).quantizer


def quantized_keys(model: nn.Module) -> set[str]:
    """The runtime keys of quantized modules' stored tensors (codes and scales)."""
    keys: set[str] = set()
    for path, module in model.named_modules():
        for name in getattr(module, "quantized_names", None) or ():
            keys.add(f"{path}.{name}" if path else name)
    return keys


def quantized_on_the_fly(model: nn.Module) -> QuantizerHooks | None:
    """The hooks of the quantizer whose modules the model holds (a runtime-layout save writes their codes)."""
    quantizer = model_quantizer(model)
    if quantizer is None or not any(getattr(m, "quantized_names", None) is not None for m in model.modules()):
        return None
    return QuantizerHooks(quantizer)


def kept_packed(model: nn.Module) -> QuantizerHooks | None:
    """The hooks of the quantizer whose stored tensors the model holds packed (a save writes them as they are)."""
    quantizer = model_quantizer(model)
    if quantizer is None or not any(getattr(m, "packed_names", None) is not None for m in model.modules()):
        return None
    return QuantizerHooks(quantizer)
