"""Block-wise FP8 checkpoints (the DeepSeek-V3 / Qwen3-FP8 layout): decoded on read, re-encoded on save.

Layout: ``X.weight`` is ``float8_e4m3fn`` of shape ``(..., N, K)`` and ``X.weight_scale_inv`` holds
one float scale per ``B0 x B1`` block (``(..., ceil(N/B0), ceil(K/B1))``, partial edge blocks
included; default ``128 x 128``). The stored value times its block's scale is the weight.
Power-of-two scales (``ue8m0``) are accepted stored as ``float8_e8m0fnu`` or as ``float32``.

What a file controls is checked before the model changes: the scales' dtype (``float32``,
``bfloat16`` or ``float8_e8m0fnu``; ``float16`` flushes the small scales FP8 weights need),
shape (the error says which block size the stored one fits) and values (finite, positive, and
small enough that no decoded weight overflows float32; planning reads the scales, 1/16,384 of
the weights, to check them), a scale whose weight is not stored in FP8, and every field of a
``quantization_config`` that :meth:`FP8BlockQuantizer.from_config` reads.

Decoding is one elementwise pass per tensor, ``q.float() * scale`` with the scale expanded to the
weight's shape, and it works on any part of a weight (a tensor-parallel slice reads only the
scale rows it covers). A load keeps the scale tensors (1/16,384 of the weight), so a save with
``quantization="as_loaded"`` re-encodes every weight with the scales it was loaded with and
writes the FP8 files back bit for bit; recomputing the scales would not reproduce them after a
bf16 or fp16 round trip. A block whose values no longer fit its recorded scale (the model was
trained after loading) gets a fresh scale instead of being clipped: float → ``e4m3fn``
saturates at ±448 without a NaN, so an overflow would otherwise go unnoticed.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from .. import meta
from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError
from ..parallel.regions import Region
from ..persist import read_json_file
from .protocol import bounded_repr, first_bad_scale

__all__ = ["FP8BlockQuantizer", "blockwise_dequantize", "blockwise_quantize", "expand_block_scales"]

_STORED = tuple(
    getattr(torch, name)
    for name in (
        "float8_e4m3fn",
        "float8_e4m3fnuz",
        "float8_e5m2",
        "float8_e5m2fnuz",
        "float8_e8m0fnu",
        "float4_e2m1fn_x2",
    )
    if hasattr(torch, name)
)
"""Low-precision dtypes a stored weight may have: such a weight needs its scales (or is an error)."""

_E8M0 = getattr(torch, "float8_e8m0fnu", None)  # torch >= 2.7
_SCALE_DTYPES = tuple(d for d in (torch.float32, torch.bfloat16, _E8M0) if d is not None)
"""float16 is not among them: its smallest normal is 6e-5, and FP8 scales (amax / 448) go far below."""
_FORMATS = {"e4m3": torch.float8_e4m3fn, "float8_e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_SCALE_FORMATS = (None, "ue8m0")
_MAX_BLOCK = 2**31
"""No weight dimension is larger; a bigger block size in a config is an error, not an int64 overflow."""


def expand_block_scales(
    scale: torch.Tensor,
    shape: Sequence[int],
    block_size: tuple[int, int],
    region: Region | None = None,
) -> torch.Tensor:
    """``scale`` (one per block) expanded to one per element of ``shape`` (or of its ``region``), as float32.

    ``region`` selects a part of the weight along one dim (the part a tensor-parallel rank
    reads); the result then has the part's shape.
    """
    s = scale.to(torch.float32)
    nd = len(shape)
    for d in range(nd):
        in_region = region is not None and d == region.dim % nd
        block = block_size[d - (nd - 2)] if d >= nd - 2 else 1
        if not in_region and block == 1:
            continue  # a leading (expert) dim: one scale slab per index already
        if in_region:
            assert region is not None
            pieces = [torch.arange(a, b, device=s.device) for a, b in region.intervals]
            idx = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long, device=s.device)
        else:
            idx = torch.arange(shape[d], device=s.device)
        s = s.index_select(d, idx // block if block > 1 else idx)
    return s


def _block_amax(x: torch.Tensor, block_size: tuple[int, int]) -> torch.Tensor:
    """Per ``B0 x B1`` block of the last two dims, the maximum of ``x`` (edge blocks padded with 0)."""
    b0, b1 = block_size
    n, k = x.shape[-2:]
    nb, kb = math.ceil(n / b0), math.ceil(k / b1)
    padded = F.pad(x, (0, kb * b1 - k, 0, nb * b0 - n))
    return padded.reshape(*x.shape[:-2], nb, b0, kb, b1).amax(dim=(-3, -1))


def blockwise_dequantize(
    q: torch.Tensor,
    scale: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    region: Region | None = None,
) -> torch.Tensor:
    """``q * scale`` per block, in float32 (``region``: ``q`` is that part of the weight)."""
    if meta.is_meta(q):  # planning: shapes only (see surgery.meta)
        return meta.empty(q.shape, torch.float32)
    out = q.to(torch.float32, copy=True)  # the region's dim is indexed by its intervals, the others are whole
    b0, b1 = block_size
    *lead, n, k = q.shape
    if region is None and n % b0 == 0 and k % b1 == 0:
        # Whole blocks: broadcast each scale over its block instead of expanding it (same values).
        blocks = out.view(*lead, n // b0, b0, k // b1, b1)
        blocks.mul_(scale.to(torch.float32).view(*lead, n // b0, 1, k // b1, 1))
        return out
    return out.mul_(expand_block_scales(scale, tuple(q.shape), block_size, region))


def blockwise_quantize(
    w: torch.Tensor,
    block_size: tuple[int, int] = (128, 128),
    *,
    dtype: torch.dtype = torch.float8_e4m3fn,
    power_of_two: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fresh block scales for ``w`` (``amax / max(dtype)``, rounded up to a power of two if asked) and the values.

    Returns ``(q, scale)`` with ``scale`` float32 of shape ``(..., ceil(N/B0), ceil(K/B1))``; an
    all-zero block gets scale 1.
    """
    x = w.to(torch.float32)
    scale = _fresh_scales(_block_amax(x.abs(), block_size), dtype, power_of_two)
    return (x / expand_block_scales(scale, x.shape, block_size)).to(dtype), scale


def _overflow_threshold(dtype: torch.dtype) -> float:
    """The magnitude above which a value no longer rounds to the dtype's largest finite value.

    The largest value plus half a step there: a value that decoded from ``max`` and was rounded
    to bf16 on the way (448 * (1 + 2**-8) for e4m3) still encodes as ``max``.
    """
    info = torch.finfo(dtype)
    return info.max + 2.0 ** math.floor(math.log2(info.max)) * info.eps / 2


def _fresh_scales(amax: torch.Tensor, dtype: torch.dtype, power_of_two: bool) -> torch.Tensor:
    scale = amax / torch.finfo(dtype).max
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    return torch.where(amax > 0, scale, torch.ones_like(scale))


def _is_block_size(block: object) -> bool:
    """Two positive ints up to :data:`_MAX_BLOCK` (rows, columns), as a list or a tuple."""
    return (
        isinstance(block, (list, tuple))
        and len(block) == 2
        and all(isinstance(b, int) and not isinstance(b, bool) and 0 < b <= _MAX_BLOCK for b in block)
    )


def _check_scale_dtype(key: str, dtype: torch.dtype) -> None:
    if dtype not in _SCALE_DTYPES:
        raise ConversionError(
            f"{key!r} is {dtype}; block scales must be float32, bfloat16 or float8_e8m0fnu "
            "(float16 flushes the small scales FP8 weights need)."
        )


def _fitting_block(shape: tuple[int, ...], scale: tuple[int, ...]) -> tuple[int, int] | None:
    """The smallest block size for which a ``shape`` weight has ``scale``-shaped scales, if one does."""
    if scale[:-2] != shape[:-2]:
        return None
    block = []
    for n, s in zip(shape[-2:], scale[-2:]):
        if s <= 0 or n <= 0:
            return None
        b = math.ceil(n / s)
        if math.ceil(n / b) != s:
            return None
        block.append(b)
    return block[0], block[1]


class FP8BlockQuantizer:
    """Decode block-wise FP8 checkpoints on read; re-encode them with their recorded scales on save.

    Args:
        block_size: rows and columns of one scale block (``weight_block_size``).
        weight_format: the stored weight dtype, ``"e4m3"`` (default) or ``"e5m2"``.
        scale_suffix: the companion key of ``X.weight`` is ``X.weight`` + this.
        power_of_two: give blocks that need a fresh scale on save a power-of-two one (``ue8m0``);
            by default, whenever the recorded scales all are powers of two.

    Example:
        >>> q = FP8BlockQuantizer(block_size=(128, 128))
        >>> report = surgery.load_checkpoint(model, "deepseek-fp8/", quantizer=q)  # doctest: +SKIP
    """

    def __init__(
        self,
        *,
        block_size: Sequence[int] = (128, 128),
        weight_format: str = "e4m3",
        scale_suffix: str = "_scale_inv",
        power_of_two: bool | None = None,
    ) -> None:
        if not _is_block_size(block_size):
            raise ConfigurationError(
                f"block_size={bounded_repr(block_size)}: give two positive ints (rows, columns) up to 2**31, "
                "e.g. (128, 128)."
            )
        if not isinstance(weight_format, str) or weight_format not in _FORMATS:
            raise ConfigurationError(
                f"weight_format={bounded_repr(weight_format)}; valid: {sorted(_FORMATS)}."
            )
        if not isinstance(scale_suffix, str) or not scale_suffix:
            raise ConfigurationError("scale_suffix must be a non-empty string such as '_scale_inv'.")
        self.block_size: tuple[int, int] = (block_size[0], block_size[1])
        self.weight_dtype = _FORMATS[weight_format]
        self.scale_suffix = scale_suffix
        self.power_of_two = power_of_two

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | str | os.PathLike[str]) -> FP8BlockQuantizer:
        """Build from a transformers ``quantization_config`` (a dict, a full config dict, or a ``config.json`` path).

        Reads ``quant_method`` (must be ``"fp8"``), ``weight_block_size`` (two ints in
        ``[1, 2**31]``), ``activation_scheme`` (``"dynamic"`` only), ``fmt`` (``"e4m3"``,
        ``"float8_e4m3fn"`` or ``"e5m2"``) and ``scale_fmt`` (``"ue8m0"``: power-of-two scales);
        other fields are ignored. A block size larger than a weight is accepted: one block
        then covers that dimension, and the weight's scale shape must say so.

        Raises:
            ConfigurationError: the file cannot be read as JSON, a field has the wrong type or
                an unknown value (the message names it), or the config is not a block-wise FP8 one.
        """
        if isinstance(config, (str, os.PathLike)):
            path = Path(config)
            path = path / "config.json" if path.is_dir() else path
            config = read_json_file(path, what="a JSON config")
            where = f"{path}: quantization_config"
        else:
            where = "quantization_config"
        if not isinstance(config, Mapping):
            raise ConfigurationError(f"expected a quantization_config dict, got {type(config).__name__}.")
        cfg = config.get("quantization_config", config)
        if not isinstance(cfg, Mapping):
            raise ConfigurationError(f"{where} is {bounded_repr(cfg)}, not a dict.")

        def field(name: str) -> str:
            return f"{where}.{name}={bounded_repr(cfg.get(name))}"

        method = cfg.get("quant_method")
        if method is None and isinstance(cfg.get("quantization_config"), Mapping):
            raise ConfigurationError(
                f"{where} holds another quantization_config; give the fields (quant_method, weight_block_size, "
                "...) one level up."
            )
        if method != "fp8":
            raise ConfigurationError(f"{field('quant_method')}: FP8BlockQuantizer reads 'fp8' configs only.")
        block = cfg.get("weight_block_size")
        if block is None:
            raise ConfigurationError(
                f"{where}.weight_block_size is missing or null (per-tensor FP8); FP8BlockQuantizer decodes "
                "block-wise scales only."
            )
        if not _is_block_size(block):
            raise ConfigurationError(
                f"{field('weight_block_size')}; give two positive ints (rows, columns) up to 2**31, e.g. [128, 128]."
            )
        scheme = cfg.get("activation_scheme", "dynamic")
        if scheme != "dynamic":
            raise ConfigurationError(
                f"{field('activation_scheme')}: static activation scales are not supported; only 'dynamic'."
            )
        fmt = cfg.get("fmt", "e4m3")
        if not isinstance(fmt, str) or fmt not in _FORMATS:
            raise ConfigurationError(f"{field('fmt')} is not a weight format; valid: {sorted(_FORMATS)}.")
        scale_fmt = cfg.get("scale_fmt")
        if scale_fmt not in _SCALE_FORMATS:
            raise ConfigurationError(
                f"{field('scale_fmt')} is not a scale format this quantizer knows; valid: 'ue8m0' or none."
            )
        return cls(
            block_size=(block[0], block[1]),
            weight_format=fmt,
            power_of_two=True if scale_fmt == "ue8m0" else None,
        )

    def __repr__(self) -> str:
        return f"FP8BlockQuantizer(block_size={self.block_size}, weight_format={self.weight_dtype})"

    # ------------------------------------------------------------------ config.json
    @property
    def loads_in_transformers(self) -> bool:
        """transformers' ``fp8`` method (FineGrainedFP8) decodes e4m3 weights with block scales, not e5m2."""
        return self.weight_dtype == torch.float8_e4m3fn

    def quantization_config(self) -> dict[str, Any]:
        """The transformers ``quantization_config`` of the tensors :meth:`encode` writes.

        :meth:`from_config` reads it back to an equal quantizer. A save keeps the other fields
        of the source checkpoint's own ``fp8`` config (``modules_to_not_convert``, ``scale_fmt``).

        Example:
            >>> FP8BlockQuantizer(block_size=(64, 64)).quantization_config()
            {'quant_method': 'fp8', 'activation_scheme': 'dynamic', 'weight_block_size': [64, 64]}
        """
        config: dict[str, Any] = {
            "quant_method": "fp8",
            "activation_scheme": "dynamic",
            "weight_block_size": list(self.block_size),
        }
        if self.weight_dtype != torch.float8_e4m3fn:
            config["fmt"] = next(name for name, d in _FORMATS.items() if d == self.weight_dtype)
        return config

    # ------------------------------------------------------------------ hooks
    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        if key.endswith(self.scale_suffix):
            return ()
        if key.rpartition(".")[2] == "activation_scale":
            raise ConversionError(
                f"{key!r} is a static activation scale; FP8BlockQuantizer supports dynamic activation "
                "quantization only (activation_scheme='dynamic'), so this checkpoint cannot be loaded with it."
            )
        return (key + self.scale_suffix,) if info.dtype in _STORED else ()

    def companion_of(self, key: str) -> str | None:
        """``X.weight`` for ``X.weight_scale_inv``: a scale no FP8 weight claims is an error naming it."""
        return key.removesuffix(self.scale_suffix) if key.endswith(self.scale_suffix) else None

    def checks(self, key: str, info: StoredTensor) -> bool:
        return key.endswith(self.scale_suffix)

    def companion_region(self, key: str, companion: str, region: Region, info: StoredTensor) -> Region | None:
        """The scale blocks covering ``region`` of the weight: a rank reads the scales it decodes with.

        >>> q = FP8BlockQuantizer(block_size=(128, 128))
        >>> w = StoredTensor("w", torch.float8_e4m3fn, (300, 256), "f", 0, 0)
        >>> q.companion_region("w", "w_scale_inv", Region(0, ((128, 300),)), w)
        Region(dim=0, intervals=((1, 3),))
        """
        nd = len(info.shape)
        d = region.dim % nd
        if d < nd - 2:  # a leading (expert) dim: one scale slab per index
            return Region.of(d, region.intervals)
        b = self.block_size[d - (nd - 2)]
        return Region.of(d, [(a // b, -(-e // b)) for a, e in region.intervals])

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """Every scale finite, positive, and small enough that ``max(fmt) * scale`` is a finite float32.

        Raises:
            ConversionError: naming ``key``, the first bad block and its value.
        """
        _check_scale_dtype(key, tensor.dtype)
        limit = torch.finfo(torch.float32).max / torch.finfo(self.weight_dtype).max
        bad = first_bad_scale(tensor, zero_allowed=False, limit=limit)
        if bad is not None:
            index, value = bad
            why = "not finite" if not math.isfinite(value) else "not positive" if value <= 0 else "too large"
            raise ConversionError(
                f"{key!r}: the scale of block {index} is {value} ({why}); FP8 block scales are finite, positive "
                f"and at most {limit:.3g} (float32 max / {torch.finfo(self.weight_dtype).max:g}). The file is "
                "corrupt or was not written by a block-wise FP8 quantizer."
            )

    def _scale(self, key: str, companions: Mapping[str, torch.Tensor]) -> torch.Tensor:
        name = key + self.scale_suffix
        scale = companions.get(name)
        if scale is None:
            raise ConversionError(f"{key!r}: its block scales {name!r} are missing from the checkpoint.")
        _check_scale_dtype(name, scale.dtype)
        return scale

    def _check(self, key: str, shape: tuple[int, ...], scale: torch.Tensor, region: Region | None) -> None:
        if len(shape) < 2:
            raise ConversionError(f"{key!r} has shape {shape}; block scales need a weight of 2 or more dims.")
        if scale.dim() != len(shape):
            raise ConversionError(
                f"{key + self.scale_suffix!r} has shape {tuple(scale.shape)} for a weight of shape {shape}; "
                f"expected {len(shape)} dims."
            )
        if region is not None:
            return  # the part's shape says nothing about the whole; planning checked the whole
        b0, b1 = self.block_size
        expected = (*shape[:-2], math.ceil(shape[-2] / b0), math.ceil(shape[-1] / b1))
        if tuple(scale.shape) != expected:
            fits = _fitting_block(shape, tuple(scale.shape))
            hint = (
                f"these scales fit {fits[0]}x{fits[1]} blocks: pass block_size={fits} (weight_block_size in the "
                "config)"
                if fits is not None
                else "they fit no block size"
            )
            raise ConversionError(
                f"{key + self.scale_suffix!r} has shape {tuple(scale.shape)}; a {shape} weight in "
                f"{b0}x{b1} blocks needs {expected}; {hint}."
            )

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        if tensor.dtype != self.weight_dtype:
            raise ConversionError(
                f"{key!r} is stored as {tensor.dtype}; this FP8BlockQuantizer decodes {self.weight_dtype} "
                "(weight_format='e4m3' or 'e5m2')."
            )
        scale = self._scale(key, companions)
        self._check(key, tuple(tensor.shape), scale, region)
        if scale.device.type != "meta":  # planning checked them too; a direct call is checked here
            self.check(key + self.scale_suffix, scale)
        return blockwise_dequantize(tensor, scale, self.block_size, region)

    def fp8_block_operands(
        self, key: str, tensor: torch.Tensor, companions: dict[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None:
        """The stored 2-D weight, its scales as float32 (exact from every scale dtype) and the block
        size, for an FP8 matmul with block scales; ``None`` for a weight that is not 2-D."""
        if tensor.dim() != 2 or tensor.dtype != self.weight_dtype:
            return None
        scale = self._scale(key, companions)
        self._check(key, tuple(tensor.shape), scale, None)
        return tensor, scale.to(torch.float32), self.block_size

    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``tensor`` as stored values with the recorded scales; blocks that outgrew theirs get fresh ones."""
        scale = self._scale(key, recorded)
        self._check(key, tuple(tensor.shape), scale, None)
        w = tensor.to(torch.float32)
        s = scale.to(device=w.device, dtype=torch.float32)  # the recorded scales live on CPU
        q = w / expand_block_scales(s, w.shape, self.block_size)
        over = _block_amax(q.abs(), self.block_size) > _overflow_threshold(self.weight_dtype)
        if w.device.type != "meta" and bool(over.any()):
            pow2 = self.power_of_two
            if pow2 is None:
                pow2 = bool((torch.frexp(s)[0].abs() == 0.5).all())
            pow2 = pow2 or scale.dtype == _E8M0  # e8m0 holds powers of two only: round those up
            fresh = _fresh_scales(_block_amax(w.abs(), self.block_size), self.weight_dtype, pow2)
            stored = fresh.to(scale.dtype)
            if scale.dtype.is_floating_point and scale.dtype != _E8M0:  # never round a scale down
                bumped = (fresh * (1 + torch.finfo(scale.dtype).eps)).to(scale.dtype)
                stored = torch.where(stored.to(torch.float32) < fresh, bumped, stored)
            scale = torch.where(over, stored, scale.to(w.device))  # the scale as stored, then encode with it
            q = w / expand_block_scales(scale.to(torch.float32), w.shape, self.block_size)
        return {key: q.to(self.weight_dtype), key + self.scale_suffix: scale}
