"""Keep quantized weights packed at runtime: :class:`PackedLinear` holds the stored tensors, decodes per forward.

A checkpoint stored quantized (FP8 block scales, GPTQ, AWQ, ...) normally decodes to floats at
load. :class:`KeepPacked` wraps such a quantizer so that the linears whose weight is stored
quantized become :class:`PackedLinear` modules holding the stored tensors **as stored**: same
local names (``qweight``, ``qzeros``, ``scales``, ``g_idx``; ``weight``, ``weight_scale_inv``),
shapes and dtypes, read from the checkpoint's headers. The load is then 1:1 (nothing decoded,
nothing cast), memory is the packed size (a 4-bit weight: about a quarter of bfloat16), and a
save writes the same bytes back without decoding.

The forward decodes the weight with the wrapped quantizer's own ``decode`` hook and calls
``F.linear`` in the activations' dtype: any format with a ``decode`` runs, on any device. There
is no fused kernel on this path yet; :func:`surgery.quantization.int8_kernel_usable` is the int8
one. Decoding per forward costs time, not accuracy: the product equals a float model loaded
with the decoded weights.

Only linears whose checkpoint keys are the module's own (``<path>.qweight``: no renaming) are
kept packed; the others load as the wrapped quantizer loads them (decoded).

Example:
    >>> q = KeepPacked(GPTQQuantizer.from_config(cfg), checkpoint="llama-gptq/")  # doctest: +SKIP
    >>> surgery.load_checkpoint(model, "llama-gptq/", quantizer=q)  # doctest: +SKIP
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import StoredTensor, open_checkpoint
from ..errors import ConfigurationError
from ..graph import match_modules, swap_module
from ..parallel.regions import Region
from ..record import update_record

__all__ = ["KeepPacked", "PackedLinear"]


class PackedLinear(nn.Module):
    """A linear layer holding its weight as stored quantized tensors; decodes it per forward.

    Args:
        decoder: the quantizer whose ``decode(key, tensor, companions)`` turns the stored tensors
            into the ``(out_features, in_features)`` float weight.
        key: the checkpoint key of the packed weight (``"model.layers.0.q_proj.qweight"``).
        stored: local name → stored tensor info (shape and dtype) of the packed weight and its
            companions; the module allocates empty buffers of exactly those.
        in_features / out_features / bias: as for ``nn.Linear``; ``bias`` is a parameter.
        device / dtype: where the buffers live; the bias dtype.
    """

    def __init__(
        self,
        decoder: Any,
        key: str,
        stored: dict[str, StoredTensor],
        *,
        in_features: int,
        out_features: int,
        bias: bool,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        self.decoder, self.key = decoder, key
        self.prefix, _, self.packed_name = key.rpartition(".")
        self.in_features, self.out_features = in_features, out_features
        self.packed_names = tuple(stored)
        for name, info in stored.items():
            self.register_buffer(name, torch.empty(tuple(info.shape), dtype=info.dtype, device=device))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)

    def _full(self, name: str) -> str:
        return f"{self.prefix}.{name}" if self.prefix else name

    def decoded_weight(self) -> torch.Tensor:
        """The float weight the stored tensors stand for (the wrapped quantizer's ``decode``)."""
        companions = {self._full(n): getattr(self, n) for n in self.packed_names if n != self.packed_name}
        w = self.decoder.decode(self.key, getattr(self, self.packed_name), companions, None)
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ConfigurationError(
                f"{self.key!r} decodes to shape {tuple(w.shape)}; the linear it stands for is "
                f"({self.out_features}, {self.in_features})."
            )
        return w

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.decoded_weight().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"packed={self.packed_names}"
        )


class KeepPacked:
    """Wrap a quantizer so the linears it would decode keep their stored tensors (:class:`PackedLinear`).

    Args:
        quantizer: the format's quantizer (``companions``/``decode`` hooks, e.g.
            :class:`~surgery.quantization.GPTQQuantizer`, :class:`~surgery.quantization.FP8BlockQuantizer`).
        checkpoint: the checkpoint to be loaded: its headers give the stored shapes and dtypes.
        targets: module path patterns (as a ``tp_plan``'s) to keep packed; default every linear.

    Every other hook is the wrapped quantizer's: keys of linears not kept packed decode as usual,
    scales are checked the same way, and ``quantization_config()`` is the format's, so a save
    writes the packed tensors and the config back unchanged.
    """

    def __init__(
        self, quantizer: Any, *, checkpoint: str | os.PathLike[str], targets: tuple[str, ...] | None = None
    ) -> None:
        if not callable(getattr(quantizer, "decode", None)) or not callable(
            getattr(quantizer, "companions", None)
        ):
            raise ConfigurationError(
                f"KeepPacked wraps a quantizer of a format stored quantized (companions and decode); "
                f"{type(quantizer).__name__} has no such hooks."
            )
        self.quantizer, self.checkpoint, self.targets = quantizer, checkpoint, targets
        self._kept: set[str] = set()  # checkpoint keys held packed (primary and companions)

    def __repr__(self) -> str:
        return f"KeepPacked({self.quantizer!r})"

    def __getattr__(self, name: str) -> Any:
        if name in ("quantization_config", "metadata", "loads_in_transformers", "encode"):
            return getattr(self.quantizer, name)
        raise AttributeError(name)

    def prepare(self, model: nn.Module) -> None:
        """Swap every target ``nn.Linear`` whose weight the checkpoint stores quantized for a :class:`PackedLinear`."""
        paths = (
            {p for pattern in self.targets for p in match_modules(model, pattern)}
            if self.targets is not None
            else None
        )
        with open_checkpoint(self.checkpoint) as reader:
            infos = {k: reader.info(k) for k in reader}
        for path, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear) or (paths is not None and path not in paths):
                continue
            prefix = f"{path}." if path else ""
            own = [k for k, info in infos.items() if k.startswith(prefix) and "." not in k[len(prefix) :]]
            packed = [(k, self.quantizer.companions(k, infos[k])) for k in own]
            packed = [(k, c) for k, c in packed if c]
            if len(packed) != 1:
                continue
            key, companions = packed[0]
            stored = {k[len(prefix) :]: infos[k] for k in (key, *companions) if k in infos}
            swap_module(
                model,
                path,
                PackedLinear(
                    self.quantizer,
                    key,
                    stored,
                    in_features=module.in_features,
                    out_features=module.out_features,
                    bias=module.bias is not None,
                    device=module.weight.device,
                    dtype=module.weight.dtype,
                ),
            )
            self._kept.update(prefix + n for n in stored)
        update_record(model, quantizer=self)

    # ------------------------------------------------------------------ hooks: the wrapped quantizer's, minus the kept keys
    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        return () if key in self._kept else tuple(self.quantizer.companions(key, info))

    def keeps_packed(self, key: str) -> bool:
        """A key of a :class:`PackedLinear` loads as stored."""
        return key in self._kept

    def companion_of(self, key: str) -> str | None:
        if key in self._kept or not callable(getattr(self.quantizer, "companion_of", None)):
            return None
        return self.quantizer.companion_of(key)

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        return self.quantizer.decode(key, tensor, companions, region)

    def checks(self, key: str, info: StoredTensor) -> bool:
        checks = getattr(self.quantizer, "checks", None)
        return bool(checks(key, info)) if callable(checks) else False

    def check(self, key: str, tensor: torch.Tensor) -> None:
        self.quantizer.check(key, tensor)
