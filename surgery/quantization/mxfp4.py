"""gpt-oss MXFP4 experts: decoded on read into transformers' ``[E, H, 2I]`` layout, re-encoded on save.

Layout (``quant_method: "mxfp4"``, as gpt-oss ships it): each expert weight ``X`` of the model
(``mlp.experts.gate_up_proj`` ``[E, H, 2I]``, ``mlp.experts.down_proj`` ``[E, I, H]``) is stored
as two ``uint8`` tensors:

* ``X_blocks`` ``[E, R, G, 16]``: E2M1 codes two per byte, low nibble first, 32 values per block
  (:mod:`surgery.quantization.fp4`); ``R`` is the model's last dim (``2I`` for ``gate_up_proj``,
  gate and up interleaved as the model's ``[..., ::2]``/``[..., 1::2]`` read them) and ``G * 32``
  its middle one;
* ``X_scales`` ``[E, R, G]``: one E8M0 exponent per block of 32 (``2 ** (byte - 127)``).

Decoded value = E2M1 value * ``2 ** (scale - 127)``, then the last two dims swapped: the stored
``[E, R, G*32]`` is the transpose of the model's ``[E, G*32, R]``. Decoding (float32) equals
transformers' ``integrations/mxfp4.py`` dequantize bit for bit. A load keeps the scales, so a
save with ``quantization="as_loaded"`` writes every block and scale byte back as it was; a block
whose values outgrew its recorded scale (the weights changed) gets a fresh power-of-two scale,
never a clipped value, and the save lists that weight as re-quantized.

Under expert or tensor parallelism a rank reads only its experts' blocks (dim 0), its rows
(the model's last dim) or its whole 32-value blocks (the model's middle dim; a split there
must fall on a multiple of 32, else a :class:`~surgery.ConfigurationError` names the key).

Example:
    >>> q = Mxfp4Quantizer.from_config({"quant_method": "mxfp4", "modules_to_not_convert": ["router"]})
    >>> report = surgery.load_checkpoint(model, "gpt-oss-20b/", quantizer=q)  # doctest: +SKIP
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import torch

from .. import meta
from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError
from ..parallel.regions import Region
from ..transforms import WeightRenaming, WeightTransform
from .fp4 import E2M1_MAX, E8M0_BIAS, e2m1_decode, e2m1_encode, e8m0_exponent, pack_nibbles, unpack_nibbles
from .protocol import bounded_repr

__all__ = ["Mxfp4Quantizer", "mxfp4_dequantize"]

_BLOCKS, _SCALES = "_blocks", "_scales"
_BLOCK = 32  # values per scale
_OVERFLOW = E2M1_MAX * (1 + 2**-8)
"""Above this a value outgrew its scale; below it, it rounds to 6 (a decoded 6 rounded up by a last bit)."""
_MAX_SCALE = 252
"""The largest E8M0 byte whose blocks decode finite in float32 (6 * 2**125 < float32 max)."""


def _index(intervals: tuple[tuple[int, int], ...] | list[tuple[int, int]]) -> torch.Tensor:
    pieces = [torch.arange(a, b) for a, b in intervals]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def mxfp4_dequantize(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``X_blocks`` ``[E, R, G, 16]`` and ``X_scales`` ``[E, R, G]`` → the model's ``[E, G*32, R]``, float32."""
    *lead, rows, groups, _ = blocks.shape
    values = e2m1_decode(unpack_nibbles(blocks))  # [E, R, G, 32]
    values = torch.ldexp(values, e8m0_exponent(scales).unsqueeze(-1))
    return values.reshape(*lead, rows, groups * _BLOCK).transpose(-1, -2).contiguous()


class Mxfp4Quantizer:
    """Decode gpt-oss MXFP4 expert weights (``*_blocks`` / ``*_scales``); save them back byte for byte.

    Args:
        config: the checkpoint's ``quantization_config`` (``quant_method: "mxfp4"``), written back
            unchanged by a save (``modules_to_not_convert`` included).

    Raises:
        ConfigurationError: ``config`` is not an ``mxfp4`` config, or ``modules_to_not_convert``
            is not a list of strings.
    """

    method = "mxfp4"
    loads_in_transformers = True

    def __init__(self, config: Mapping[str, Any] | None = None) -> None:
        config = {"quant_method": self.method} if config is None else config
        if not isinstance(config, Mapping) or config.get("quant_method") != self.method:
            raise ConfigurationError(
                f"quantization_config={bounded_repr(config)}; Mxfp4Quantizer reads quant_method 'mxfp4' configs."
            )
        skip = config.get("modules_to_not_convert")
        if skip is not None and (not isinstance(skip, list) or not all(isinstance(s, str) for s in skip)):
            raise ConfigurationError(
                f"quantization_config.modules_to_not_convert={bounded_repr(skip)}; give a list of module names."
            )
        self._config = copy.deepcopy(dict(config))

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> Mxfp4Quantizer:
        """Build from a ``quantization_config`` dict (or a whole ``config.json`` dict holding one)."""
        inner = config.get("quantization_config") if isinstance(config, Mapping) else None
        return cls(inner if isinstance(inner, Mapping) and "quant_method" not in config else config)

    def __repr__(self) -> str:
        return f"Mxfp4Quantizer(modules_to_not_convert={self._config.get('modules_to_not_convert')!r})"

    def quantization_config(self) -> dict[str, Any]:
        """The source ``quantization_config``, unchanged: an ``as_loaded`` save writes the same tensors."""
        return copy.deepcopy(self._config)

    # ------------------------------------------------------------------ hooks
    def update_weight_conversions(self, transforms: list[WeightTransform]) -> list[WeightTransform]:
        """``X_blocks`` loads into the model's ``X``."""
        return [*transforms, WeightRenaming(r"_proj_blocks$", "_proj")]

    def dequantized_name(self, key: str) -> str:
        """A dequantized save writes the floats of ``X_blocks`` as the model's ``X`` (transformers' layout)."""
        return key.removesuffix(_BLOCKS)

    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        if not key.endswith(_BLOCKS):
            return ()
        if info.dtype != torch.uint8:
            raise ConversionError(
                f"{key!r} is stored as {info.dtype}; MXFP4 blocks are uint8 (two E2M1 codes per byte)."
            )
        return (key.removesuffix(_BLOCKS) + _SCALES,)

    def companion_of(self, key: str) -> str | None:
        """``X_blocks`` for ``X_scales``: scales no blocks claim are an error naming them."""
        return key.removesuffix(_SCALES) + _BLOCKS if key.endswith(_SCALES) else None

    def checks(self, key: str, info: StoredTensor) -> bool:
        return key.endswith(_SCALES)

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """E8M0 scales: ``uint8``, none NaN (255) or so large that a block overflows float32.

        Raises:
            ConversionError: naming ``key``, the first bad block and its byte.
        """
        if tensor.dtype != torch.uint8:
            raise ConversionError(
                f"{key!r} is {tensor.dtype}; MXFP4 scales are uint8 E8M0 exponents (2 ** (byte - 127))."
            )
        if tensor.device.type == "meta" or tensor.numel() == 0:
            return
        if int(tensor.max()) > _MAX_SCALE:
            index = tuple(int(i) for i in (tensor > _MAX_SCALE).nonzero()[0])
            value = int(tensor[index])
            why = "NaN in E8M0" if value == 255 else "its blocks overflow float32"
            raise ConversionError(
                f"{key!r}: the scale of block {index} is byte {value} ({why}); the file is corrupt or not MXFP4."
            )

    def _scales(self, key: str, companions: Mapping[str, torch.Tensor]) -> torch.Tensor:
        name = key.removesuffix(_BLOCKS) + _SCALES
        scales = companions.get(name)
        if scales is None:
            raise ConversionError(f"{key!r}: its scales {name!r} are missing from the checkpoint.")
        self.check(name, scales)
        return scales

    def _check_shapes(self, key: str, blocks: tuple[int, ...], scales: torch.Tensor) -> None:
        if len(blocks) != 4 or blocks[-1] != _BLOCK // 2:
            raise ConversionError(
                f"{key!r} has shape {blocks}; gpt-oss MXFP4 blocks are [experts, rows, blocks, 16] uint8."
            )
        if tuple(scales.shape) != blocks[:-1]:
            raise ConversionError(
                f"{key.removesuffix(_BLOCKS) + _SCALES!r} has shape {tuple(scales.shape)}; blocks of shape "
                f"{blocks} need one scale per 32 values: {list(blocks[:-1])}."
            )

    def companion_region(self, key: str, companion: str, region: Region, info: StoredTensor) -> Region | None:
        """The scales of the blocks holding ``region``: ``X_scales`` ``[E, R, G]`` is ``X_blocks``
        without its last dim, so the same experts, rows or blocks."""
        return self._stored(key, region) if companion.endswith(_SCALES) else None

    def stored_region(self, key: str, region: Region, info: StoredTensor) -> Region:
        """The part of ``X_blocks`` holding ``region`` of the decoded ``[E, G*32, R]`` weight.

        Raises:
            ConfigurationError: a split of the decoded middle dim not on whole 32-value blocks.
        """
        return self._stored(key, region)

    def _stored(self, key: str, region: Region) -> Region:
        dim = region.dim % 3
        if dim == 0:
            return region.on(0)
        if dim == 2:
            return region.on(1)
        for a, b in region.intervals:
            if a % _BLOCK or b % _BLOCK:
                raise ConfigurationError(
                    f"{key!r}: a split of dim 1 of {key.removesuffix(_BLOCKS)!r} at [{a}, {b}) is not aligned to "
                    f"the MXFP4 block size {_BLOCK}; choose a parallel size that splits it into whole blocks."
                )
        return Region.of(2, [(a // _BLOCK, b // _BLOCK) for a, b in region.intervals])

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        if tensor.dtype != torch.uint8:
            raise ConversionError(f"{key!r} is stored as {tensor.dtype}; MXFP4 blocks are uint8.")
        scales = self._scales(key, companions)
        if region is None:
            self._check_shapes(key, tuple(tensor.shape), scales)
        elif tensor.dim() != 4 or scales.dim() != 3:
            raise ConversionError(f"{key!r}: MXFP4 blocks are 4-d and their scales 3-d.")
        e, r, g, _ = tensor.shape
        if meta.is_meta(tensor):
            return meta.empty((e, g * _BLOCK, r), torch.float32)
        if region is not None:  # the scales at their full shape, read where they cover: take those
            stored = self._stored(key, region)
            scales = scales.index_select(stored.dim, _index(stored.intervals))
            if tuple(scales.shape) != tuple(tensor.shape[:-1]):
                raise ConversionError(
                    f"{key!r}: the part read has shape {tuple(tensor.shape)}, its scales {tuple(scales.shape)}."
                )
        return mxfp4_dequantize(tensor, scales)

    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``tensor`` (``[E, G*32, R]``) as blocks with the recorded scales; blocks that outgrew theirs get fresh ones."""
        name = key.removesuffix(_BLOCKS) + _SCALES
        scales = self._scales(key, recorded)
        if tensor.dim() != 3 or tensor.shape[1] % _BLOCK:
            raise ConversionError(
                f"{key.removesuffix(_BLOCKS)!r} has shape {tuple(tensor.shape)}; MXFP4 experts are [E, K, R] with "
                f"K a multiple of {_BLOCK}."
            )
        e, k, r = tensor.shape
        self._check_shapes(key, (e, r, k // _BLOCK, _BLOCK // 2), scales)
        if meta.is_meta(tensor):
            return {
                key: torch.empty((e, r, k // _BLOCK, _BLOCK // 2), dtype=torch.uint8, device="meta"),
                name: scales,
            }
        w = tensor.to(torch.float32).transpose(1, 2).reshape(e, r, k // _BLOCK, _BLOCK)
        if not bool(torch.isfinite(w).all()):
            raise ConversionError(
                f"{key.removesuffix(_BLOCKS)!r} holds non-finite values; MXFP4 cannot store them."
            )
        exp = e8m0_exponent(scales.to(w.device))
        q = torch.ldexp(w, -exp.unsqueeze(-1))
        over = q.abs().amax(dim=-1) > _OVERFLOW
        if bool(over.any()):
            amax = w.abs().amax(dim=-1)
            fresh = torch.ceil(torch.log2(amax / E2M1_MAX)).clamp(-E8M0_BIAS, _MAX_SCALE - E8M0_BIAS)
            exp = torch.where(over, fresh.to(torch.int32), exp)
            scales = (exp + E8M0_BIAS).to(torch.uint8)
            q = torch.ldexp(w, -exp.unsqueeze(-1))
        return {key: pack_nibbles(e2m1_encode(q)), name: scales}
