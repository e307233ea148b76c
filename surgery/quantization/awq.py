"""AWQ GEMM checkpoints (``quant_method: "awq"``, ``version: "gemm"``): 4-bit codes packed along the out-features.

The layout (AutoAWQ ``WQLinear_GEMM``), for a linear ``X`` with ``K`` in-features and ``N``
out-features, 8 codes per int32 word:

* ``X.qweight``: int32 ``(K, N / 8)``; the 8 codes of a word are out-features ``8 j .. 8 j + 7``
  in the interleaved order :data:`AWQ_ORDER` (bits ``4 i`` up hold out-feature ``8 j + AWQ_ORDER[i]``),
  so out-feature ``8 j + c`` is code :data:`AWQ_REVERSE_ORDER` ``[c]`` of word ``j``;
* ``X.qzeros``: int32 ``(G, N / 8)``, ``G = K / group_size``, packed the same way, the zero itself;
* ``X.scales``: float16 ``(G, N)``.

The weight is ``W[n, k] = scales[k // group_size, n] * (q[k, n] - zero[k // group_size, n])``,
shape ``(N, K)``, in float32 (exact). Verified against AutoAWQ's and GPTQModel's
``pack``/``unpack_awq``/``reverse_awq_order``.

Example:
    >>> q = torch.arange(8, dtype=torch.int32)[None]
    >>> hex(int(pack_words(q, bits=4, dim=1, order=AWQ_REVERSE_ORDER)))
    '0x75316420'
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from .. import meta
from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError
from ..parallel.regions import Region
from ..transforms import WeightRenaming, WeightTransform
from .gptq import QWeightHooks, interval_index, pack_words, packed_region, unpack_words
from .protocol import bounded_repr

__all__ = ["AWQ_ORDER", "AWQ_REVERSE_ORDER", "AWQQuantizer", "awq_dequantize", "awq_quantize"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
"""The out-feature (within its run of 8) that code ``i`` of a word holds."""
AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)
"""The code of a word that holds out-feature ``c`` of its run of 8 (the inverse of :data:`AWQ_ORDER`)."""

_COMPANIONS = ("qzeros", "scales")


def awq_dequantize(
    qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """The float32 ``(N, K)`` weight of an AWQ GEMM ``qweight``/``qzeros``/``scales`` (module docstring)."""
    k, n = qweight.shape[0], qweight.shape[1] * 8
    if meta.is_meta(qweight):
        return meta.empty((n, k), torch.float32)
    q = unpack_words(qweight, bits=4, dim=1, order=AWQ_REVERSE_ORDER)  # (K, N)
    z = unpack_words(qzeros, bits=4, dim=1, order=AWQ_REVERSE_ORDER)  # (G, N)
    g = torch.arange(k, device=qweight.device) // group_size
    return ((q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]).T.contiguous()


def awq_quantize(
    weight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """The AWQ ``qweight`` of an ``(N, K)`` float ``weight`` with given ``(G, N)`` zeros and scales."""
    k = weight.shape[1]
    g = torch.arange(k, device=weight.device) // group_size
    q = torch.round(weight.to(torch.float32).T / scales.to(torch.float32)[g]) + zeros.to(torch.float32)[g]
    return pack_words(q.clamp_(0, 15).to(torch.int32), bits=4, dim=1, order=AWQ_REVERSE_ORDER)


class AWQQuantizer(QWeightHooks):
    """Decode AWQ GEMM checkpoints; re-encode them with the recorded zeros and scales on save.

    :meth:`from_config` keeps the ``quantization_config`` exactly as read, so a save writes it
    back unchanged; :class:`~surgery.quantization.packed.KeepPacked` over it keeps the packed
    tensors at runtime.

    Args:
        group_size: in-features per scale group.
        config: the ``quantization_config`` to write back (default: built from the arguments).

    Example:
        >>> AWQQuantizer.from_config({"quant_method": "awq", "bits": 4, "group_size": 64, "version": "gemm"})
        AWQQuantizer(group_size=64)
    """

    method = "awq"
    loads_in_transformers = True
    companion_names = _COMPANIONS
    format_name = "AWQ"
    """The config is written back as read: transformers reads the copy as it read the source."""

    def __init__(self, *, group_size: int = 128, config: Mapping[str, Any] | None = None) -> None:
        if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size <= 0:
            raise ConfigurationError(f"group_size={bounded_repr(group_size)}; AWQ groups are a positive int.")
        self.group_size = group_size
        self.zero_codes_per_word, self.groups_in_order = 8, True
        self._config = dict(
            config
            if config is not None
            else {
                "quant_method": "awq",
                "bits": 4,
                "group_size": group_size,
                "version": "gemm",
                "zero_point": True,
            }
        )

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> AWQQuantizer:
        """From a transformers ``AwqConfig`` dict: 4 bits, ``version`` ``"gemm"``, zero point on.

        Raises:
            ConfigurationError: another method, width, version, or ``zero_point: false``.
        """
        if not isinstance(config, Mapping) or config.get("quant_method") != "awq":
            raise ConfigurationError(
                f"quantization_config={bounded_repr(config)}: AWQQuantizer reads quant_method 'awq' configs."
            )
        for field, want in (("bits", 4), ("version", "gemm"), ("zero_point", True)):
            value = config.get(field, want)
            if (value.lower() if isinstance(value, str) else value) != want:
                raise ConfigurationError(
                    f"quantization_config.{field}={bounded_repr(value)}; AWQQuantizer reads {field}={want!r} only."
                )
        return cls(group_size=config.get("group_size", 128), config=config)

    def __repr__(self) -> str:
        return f"AWQQuantizer(group_size={self.group_size})"

    def _parts(self, key: str, companions: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        prefix = key.rpartition(".")[0]
        out = []
        for c in _COMPANIONS:
            name = f"{prefix}.{c}" if prefix else c
            t = companions.get(name)
            if t is None:
                raise ConversionError(f"{key!r}: its {c} {name!r} is missing from the checkpoint.")
            out.append(t)
        return out[0], out[1]

    def check_layout(self, key: str, qweight: torch.Tensor, companions: Mapping[str, torch.Tensor]) -> None:
        """Shapes and dtypes of a ``qweight`` and its companions agree with the config.

        Raises:
            ConversionError: naming the key whose shape or dtype is wrong and the expected one.
        """
        qzeros, scales = self._parts(key, companions)
        prefix = key.rpartition(".")[0] + "."
        for name, t in (("qweight", qweight), ("qzeros", qzeros)):
            if t.dtype != torch.int32:
                raise ConversionError(f"{prefix + name!r} is {t.dtype}; AWQ stores it as int32.")
        if qweight.dim() != 2:
            raise ConversionError(f"{key!r} has shape {tuple(qweight.shape)}; AWQ qweight is 2-D (K, N / 8).")
        k, n = qweight.shape[0], qweight.shape[1] * 8
        groups = math.ceil(k / self.group_size)
        for name, t, want in (("qzeros", qzeros, (groups, n // 8)), ("scales", scales, (groups, n))):
            if tuple(t.shape) != want:
                raise ConversionError(
                    f"{prefix + name!r} has shape {tuple(t.shape)}; an AWQ weight of {k} in- and {n} out-features "
                    f"in groups of {self.group_size} needs {want}."
                )

    def update_weight_conversions(self, transforms: list[WeightTransform]) -> list[WeightTransform]:
        """``X.qweight`` loads into ``X.weight`` (the model's parameter) once decoded."""
        return [*transforms, WeightRenaming(r"\.qweight$", ".weight")]

    def stored_region(self, key: str, region: Region, info: StoredTensor) -> Region:
        """The part of ``qweight`` (``(K, N / 8)``) holding ``region`` of the decoded ``(N, K)`` weight.

        Raises:
            ConfigurationError: a split of the out-features not aligned to 8.
        """
        return packed_region(key, region, pack_dim=1, factor=8)

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        """The float32 ``(N, K)`` weight of ``key`` (a ``qweight``), or its ``region`` given that part
        of the words (:meth:`stored_region`) and the whole companions."""
        qzeros, scales = self._parts(key, companions)
        if region is None:
            self.check_layout(key, tensor, companions)
            return awq_dequantize(tensor, qzeros, scales, group_size=self.group_size)
        local = (tensor.shape[1] * 8, tensor.shape[0])
        if meta.is_meta(tensor):
            return meta.empty(local, torch.float32)
        q = unpack_words(tensor, bits=4, dim=1, order=AWQ_REVERSE_ORDER)  # (k_local, n_local)
        z = unpack_words(qzeros, bits=4, dim=1, order=AWQ_REVERSE_ORDER)
        s = scales.to(torch.float32)
        rows = torch.arange(scales.shape[0] * self.group_size)
        if region.dim == 0:  # out-features: some columns
            cols = interval_index(region)
            z, s = z[:, cols], s[:, cols]
        else:  # in-features: some rows
            rows = interval_index(region)
        g = rows[: q.shape[0]] // self.group_size
        return ((q - z[g]).to(torch.float32) * s[g]).T.contiguous()

    def int4_operands(
        self, key: str, qweight: torch.Tensor, companions: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """``(codes (N, K) int32, scale (G, N), zero (G, N), group_size)`` for the int4 kernel, which
        computes ``(q - 8) * scale + zero``."""
        self.check_layout(key, qweight, companions)
        qzeros, scales = self._parts(key, companions)
        codes = unpack_words(qweight, bits=4, dim=1, order=AWQ_REVERSE_ORDER).T.contiguous()
        zeros = unpack_words(qzeros, bits=4, dim=1, order=AWQ_REVERSE_ORDER)
        s = scales.to(torch.float32)
        return codes, s, (8 - zeros).to(torch.float32) * s, self.group_size

    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``tensor`` (``(N, K)`` floats) as ``qweight`` with the recorded zeros and scales."""
        qzeros, scales = self._parts(key, recorded)
        zeros = unpack_words(qzeros, bits=4, dim=1, order=AWQ_REVERSE_ORDER)
        prefix = key.rpartition(".")[0]
        out = {key: awq_quantize(tensor, zeros, scales, group_size=self.group_size)}
        out.update({(f"{prefix}.{c}" if prefix else c): t for c, t in zip(_COMPANIONS, (qzeros, scales))})
        return out
