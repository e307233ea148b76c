"""Keep quantized weights packed at runtime: :class:`PackedLinear` holds the stored tensors, decodes per forward.

A checkpoint stored quantized (FP8 block scales, GPTQ, AWQ, ...) normally decodes to floats at
load. :class:`KeepPacked` wraps such a quantizer so that the linears whose weight is stored
quantized become :class:`PackedLinear` modules holding the stored tensors **as stored**: same
local names (``qweight``, ``qzeros``, ``scales``, ``g_idx``; ``weight``, ``weight_scale_inv``),
shapes and dtypes, read from the checkpoint's headers. The load is then 1:1 (nothing decoded,
nothing cast), memory is the packed size (a 4-bit weight: about a quarter of bfloat16), and a
save writes the same bytes back without decoding.

The forward decodes the weight with the wrapped quantizer's own ``decode`` hook and calls
``F.linear`` in the activations' dtype: any format with a ``decode`` runs, on any device, and
the product equals a float model loaded with the decoded weights, bit for bit.

With ``kernel=True``, a 4-bit format whose quantizer offers ``int4_operands`` (GPTQ without
act-order, AWQ, compressed-tensors int4 groups without act-order) runs PyTorch's own CPU kernel ``aten._weight_int4pack_mm_for_cpu`` instead:

* it computes ``x @ ((q - 8) * scale + zero).T`` in bfloat16 with scales and zeros rounded to
  bfloat16 (not exact: about bfloat16 precision, ``rtol`` 1e-2 against the decoded product);
* its group size must be 32, 64, 128 or 256 and divide ``in_features``, and ``out_features``
  must be a multiple of 16 (torch 2.13's rules, measured); anything else (and a
  device other than CPU, or a probe that finds the kernel wrong) takes the decode path, decided
  once per module and device (:func:`int4_kernel_usable`);
* its weight operand is a second copy of the codes in the kernel's own layout
  (``aten._convert_weight_to_int4pack_for_cpu``), made on the first forward and kept beside the
  stored tensors (those stay for the save): the weight then takes twice its packed size, still
  half of bfloat16.

Only linears whose checkpoint keys are the module's own (``<path>.qweight``: no renaming) are
kept packed; the others load as the wrapped quantizer loads them (decoded).

Example:
    >>> q = KeepPacked(GPTQQuantizer.from_config(cfg), checkpoint="llama-gptq/")  # doctest: +SKIP
    >>> surgery.load_checkpoint(model, "llama-gptq/", quantizer=q)  # doctest: +SKIP
"""

from __future__ import annotations

import os
import threading
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import StoredTensor, open_checkpoint
from ..errors import ConfigurationError, ConversionError, SurgeryError
from ..graph import match_modules, swap_module
from ..parallel.regions import Region
from ..record import update_record
from .int8 import kernel_operand
from .protocol import SMALL_COMPANION_BYTES

__all__ = ["INT4_GROUP_SIZES", "KeepPacked", "PackedLinear", "int4_kernel_usable"]

INT4_GROUP_SIZES = (32, 64, 128, 256)
"""The group sizes ``aten._weight_int4pack_mm_for_cpu`` takes (torch 2.13)."""
_INNER_K_TILES = 2
_N_MULTIPLE = 16
_probed: dict[str, bool] = {}
_probe_lock = threading.Lock()


def int4_kernel_usable(
    device: torch.device | str, *, in_features: int, out_features: int, group_size: int
) -> bool:
    """Whether the int4 CPU kernel computes a correct product for this shape on ``device``.

    ``False`` off CPU, for a group size it does not take or one that does not divide
    ``in_features``, and for ``out_features`` not a multiple of 16 (its weight layout's rule),
    without calling it; otherwise one probe per device type, cached.
    """
    device = torch.device(device)
    if (
        device.type != "cpu"
        or group_size not in INT4_GROUP_SIZES
        or in_features % group_size
        or out_features % _N_MULTIPLE
    ):
        return False
    with _probe_lock:
        if device.type not in _probed:
            _probed[device.type] = _probe()
        return _probed[device.type]


def _probe() -> bool:
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (16, 64), generator=gen, dtype=torch.int32)
    scale = (torch.rand(2, 16, generator=gen) + 0.5).to(torch.bfloat16)
    zero = torch.randn(2, 16, generator=gen).to(torch.bfloat16)
    x = torch.randn(3, 64, generator=gen).to(torch.bfloat16)
    w = (q.float() - 8) * scale.float().T.repeat_interleave(32, 1) + zero.float().T.repeat_interleave(32, 1)
    try:
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, _INNER_K_TILES)
        got = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, packed, 32, torch.stack([scale, zero], -1)
        ).float()
    except (RuntimeError, NotImplementedError, AttributeError):
        return False
    return bool(torch.allclose(got, x.float() @ w.T, rtol=2e-2, atol=0.5))


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
        kernel: bool = False,
    ) -> None:
        super().__init__()
        self.decoder, self.key, self.kernel = decoder, key, kernel
        self._int4: tuple[Any, ...] | None = None  # (stamp, device, operands or None)
        self.prefix, _, self.packed_name = key.rpartition(".")
        self.in_features, self.out_features = in_features, out_features
        self.float_dtype = dtype if dtype is not None and dtype.is_floating_point else torch.float32
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
        w = self.decoder.decode(self.key, getattr(self, self.packed_name), self._companions(), None)
        if tuple(w.shape) != (self.out_features, self.in_features):
            raise ConfigurationError(
                f"{self.key!r} decodes to shape {tuple(w.shape)}; the linear it stands for is "
                f"({self.out_features}, {self.in_features})."
            )
        return w

    def dequantized(self, *, meta: bool = False) -> dict[str, torch.Tensor]:
        """``{"weight": ...}`` in the dtype of the linear it stands for: what a
        ``quantization="dequantized"`` save writes instead of the stored tensors."""
        if meta:
            return {
                "weight": torch.empty(
                    (self.out_features, self.in_features), dtype=self.float_dtype, device="meta"
                )
            }
        return {"weight": self.decoded_weight().to(self.float_dtype)}

    def _companions(self) -> dict[str, torch.Tensor]:
        return {self._full(n): getattr(self, n) for n in self.packed_names if n != self.packed_name}

    def int4_operands(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """The int4 kernel's weight and scale/zero operands and group size, or ``None``: decode instead.

        Built on the first call and kept while the stored tensors are unchanged (same storage,
        no in-place write since); ``None`` without ``kernel=True``, for a quantizer without
        ``int4_operands``, or where :func:`int4_kernel_usable` says no.
        """
        if not self.kernel or not callable(getattr(self.decoder, "int4_operands", None)):
            return None
        tensors = [getattr(self, n) for n in self.packed_names]
        stamp = tuple((t.data_ptr(), t._version) for t in tensors)
        device = tensors[0].device
        if self._int4 is None or self._int4[0] != stamp or self._int4[1] != device:
            self._int4 = (stamp, device, self._build_int4(device))
        return self._int4[2]

    def _build_int4(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        found = self.decoder.int4_operands(self.key, getattr(self, self.packed_name), self._companions())
        if found is None:
            return None
        codes, scale, zero, group = found
        if not int4_kernel_usable(
            device, in_features=self.in_features, out_features=self.out_features, group_size=group
        ):
            return None
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.contiguous(), _INNER_K_TILES)
        return packed, torch.stack([scale, zero], -1).to(torch.bfloat16).contiguous(), group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ops = self.int4_operands()
        if ops is None:
            return F.linear(x, self.decoded_weight().to(x.dtype), self.bias)
        packed, scale_zero, group = ops
        flat = kernel_operand(x.reshape(-1, self.in_features).to(torch.bfloat16))
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, packed, group, scale_zero)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"packed={self.packed_names}"
        )


def _check_decodes(
    quantizer: Any,
    key: str,
    stored: dict[str, StoredTensor],
    prefix: str,
    shape: tuple[int, int],
    small: dict[str, torch.Tensor],
) -> None:
    """Run ``decode`` on ``meta`` tensors of the stored shapes and dtypes (``small`` companions, a
    stored ``weight_shape``, with their values): it must give the linear's weight shape.

    Raises:
        ConversionError: naming the key whose layout the quantizer refuses, or the shape mismatch.
    """
    metas = {
        prefix + n: small.get(prefix + n, torch.empty(tuple(i.shape), dtype=i.dtype, device="meta"))
        for n, i in stored.items()
    }
    main = metas.pop(key)
    try:
        decoded = quantizer.decode(key, main, metas, None)
    except SurgeryError:
        raise
    except Exception as exc:
        raise ConversionError(
            f"{type(quantizer).__name__}.decode({key!r}) failed: {type(exc).__name__}: {exc}"
        ) from exc
    if tuple(decoded.shape) != shape:
        raise ConversionError(
            f"{key!r} decodes to shape {tuple(decoded.shape)}; the model's linear there is {shape} (out, in)."
        )


class KeepPacked:
    """Wrap a quantizer so the linears it would decode keep their stored tensors (:class:`PackedLinear`).

    Args:
        quantizer: the format's quantizer (``companions``/``decode`` hooks, e.g.
            :class:`~surgery.quantization.GPTQQuantizer`, :class:`~surgery.quantization.FP8BlockQuantizer`).
        checkpoint: the checkpoint to be loaded: its headers give the stored shapes and dtypes.
        targets: module path patterns (as a ``tp_plan``'s) to keep packed; default every linear.
        kernel: run the int4 CPU kernel where the format and shape allow (module docstring).

    Every other hook is the wrapped quantizer's: keys of linears not kept packed decode as usual,
    scales are checked the same way, and ``quantization_config()`` is the format's, so a save
    writes the packed tensors and the config back unchanged.
    """

    def __init__(
        self,
        quantizer: Any,
        *,
        checkpoint: str | os.PathLike[str],
        targets: tuple[str, ...] | None = None,
        kernel: bool = False,
    ) -> None:
        if not callable(getattr(quantizer, "decode", None)) or not callable(
            getattr(quantizer, "companions", None)
        ):
            raise ConfigurationError(
                f"KeepPacked wraps a quantizer of a format stored quantized (companions and decode); "
                f"{type(quantizer).__name__} has no such hooks."
            )
        self.quantizer, self.checkpoint, self.targets, self.kernel = quantizer, checkpoint, targets, kernel
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
            small = {k: reader.get_tensor(k) for k, i in infos.items() if i.nbytes <= SMALL_COMPANION_BYTES}
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
            missing = [c for c in companions if c not in infos]
            if missing:
                raise ConversionError(
                    f"{key!r} is stored quantized, but its {', '.join(map(repr, missing))} "
                    f"{'is' if len(missing) == 1 else 'are'} missing from the checkpoint; it cannot be decoded, "
                    "so it is not loaded as raw codes."
                )
            stored = {k[len(prefix) :]: infos[k] for k in (key, *companions)}
            shape = (module.out_features, module.in_features)
            _check_decodes(self.quantizer, key, stored, prefix, shape, small)
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
                    kernel=self.kernel,
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
