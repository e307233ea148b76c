"""GPTQ checkpoints (``quant_method: "gptq"``): integer codes packed in int32 words along the in-features.

The layout (AutoGPTQ / GPTQModel ``checkpoint_format: "gptq"``, the v1 convention), for a linear
``X`` with ``K`` in-features, ``N`` out-features, ``bits`` in (2, 4, 8) and ``f = 32 // bits`` codes
per word:

* ``X.qweight``: int32 ``(K / f, N)``; code ``(k, n)`` is bits ``bits * (k % f)`` up of word
  ``(k // f, n)`` (the lowest bits hold the first row);
* ``X.qzeros``: int32 ``(G, N / f)``, ``G = ceil(K / group_size)``; zero ``(g, n)`` is bits
  ``bits * (n % f)`` up of word ``(g, n // f)``, stored **minus one** (v1): the zero used is the
  stored one plus one (``checkpoint_format: "gptq_v2"`` stores the zero itself);
* ``X.scales``: float16 ``(G, N)``;
* ``X.g_idx``: int32 ``(K,)``, the group of each in-feature (``k // group_size`` unless act-order,
  ``desc_act``, permuted them).

The weight is ``W[n, k] = scales[g_idx[k], n] * (q[k, n] - zero[g_idx[k], n])`` (shape ``(N, K)``,
``nn.Linear``'s), computed in float32, where every product of a small integer and a float16 scale
is exact. Verified against GPTQModel's and AutoGPTQ's ``pack``/``dequantize`` (the shift order and
``zeros + 1``); :func:`unpack_words` / :func:`pack_words` are the word packing both directions.

Example:
    >>> q = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10], [11, 12], [13, 14], [15, 0]])
    >>> torch.equal(unpack_words(pack_words(q, bits=4, dim=0), bits=4, dim=0), q)
    True
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import torch

from .. import meta
from ..checkpoint import StoredTensor
from ..errors import ConfigurationError, ConversionError
from ..parallel.regions import Region
from ..transforms import WeightRenaming, WeightTransform
from .protocol import bounded_repr, first_bad_scale

__all__ = [
    "GPTQ_BITS",
    "GPTQQuantizer",
    "QWeightHooks",
    "gptq_dequantize",
    "gptq_quantize",
    "interval_index",
    "pack_words",
    "packed_region",
    "unpack_words",
]

GPTQ_BITS = (2, 4, 8)
"""Code widths that divide a 32-bit word (3-bit GPTQ packs across words and is not read)."""

_COMPANIONS = ("qzeros", "scales", "g_idx")


def unpack_words(
    words: torch.Tensor, *, bits: int, dim: int, order: Sequence[int] | None = None
) -> torch.Tensor:
    """The ``bits``-wide codes of int32 ``words``, ``32 // bits`` per word along ``dim``, as int32.

    Code ``j`` of a word is bits ``bits * j`` up; ``order`` (a permutation of ``range(32 // bits)``)
    says which code lands at position ``i`` of the word's run of outputs: ``out[i] = code[order[i]]``
    (AWQ's interleave), in order by default.
    """
    f = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    if order is not None:
        shifts = shifts[torch.tensor(list(order), device=words.device)]
    w = words.movedim(dim, -1).to(torch.int32)
    codes = torch.bitwise_and(torch.bitwise_right_shift(w[..., None], shifts), (1 << bits) - 1)
    return codes.reshape(*w.shape[:-1], w.shape[-1] * f).movedim(-1, dim)


def pack_words(
    codes: torch.Tensor, *, bits: int, dim: int, order: Sequence[int] | None = None
) -> torch.Tensor:
    """The inverse of :func:`unpack_words`: codes in ``[0, 2**bits)`` packed into int32 words along ``dim``.

    Raises:
        ConversionError: ``codes.shape[dim]`` is not a multiple of ``32 // bits``.
    """
    f = 32 // bits
    c = codes.movedim(dim, -1).to(torch.int64)
    if c.shape[-1] % f:
        raise ConversionError(
            f"{c.shape[-1]} codes do not fill {bits}-bit words of {f}; pad to a multiple of {f}."
        )
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=codes.device)
    if order is not None:
        shifts = shifts[torch.tensor(list(order), device=codes.device)]
    c = c.reshape(*c.shape[:-1], c.shape[-1] // f, f) << shifts
    words = c.sum(-1)  # disjoint bit ranges: the sum is the OR
    words = torch.where(words >= 2**31, words - 2**32, words)  # the int32 with those bits
    return words.to(torch.int32).movedim(-1, dim).contiguous()


def interval_index(region: Region) -> torch.Tensor:
    """The indices ``region`` covers on its dim, in order (int64)."""
    return torch.cat([torch.arange(a, b) for a, b in region.intervals] or [torch.empty(0, dtype=torch.int64)])


def packed_region(key: str, region: Region, *, pack_dim: int, factor: int) -> Region:
    """The part of a stored ``(.., ..)`` word tensor holding ``region`` of the decoded ``(N, K)`` weight.

    The words are stored transposed (``(K, N)`` order, GPTQ's and AWQ's ``qweight``) and pack
    ``factor`` codes each along stored dim ``pack_dim``; a split of the packed dim must fall on
    word boundaries.

    Raises:
        ConfigurationError: naming ``key``, the decoded dim, the interval and the factor.

    Example:
        >>> packed_region("x.qweight", Region.of(1, [(16, 32)]), pack_dim=0, factor=8)
        Region(dim=0, intervals=((2, 4),))
    """
    stored_dim = 1 - region.dim  # decoded (N, K) is stored (K, N)
    if stored_dim != pack_dim:
        return Region.of(stored_dim, region.intervals)
    for a, b in region.intervals:
        if a % factor or b % factor:
            what = "in" if region.dim == 1 else "out"
            raise ConfigurationError(
                f"{key!r}: this rank's share of the {what}-features (dim {region.dim}) is [{a}, {b}), not aligned "
                f"to the {factor} codes per int32 word; split it at multiples of {factor}, or leave it unsplit."
            )
    return Region.of(stored_dim, [(a // factor, b // factor) for a, b in region.intervals])


def gptq_dequantize(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    bits: int,
    zero_offset: int = 1,
) -> torch.Tensor:
    """The float32 ``(N, K)`` weight of a GPTQ ``qweight``/``qzeros``/``scales``/``g_idx`` (module docstring).

    ``zero_offset`` is 1 for the v1 convention (stored zero minus one), 0 for v2.
    """
    f = 32 // bits
    k, n = qweight.shape[0] * f, qweight.shape[1]
    if meta.is_meta(qweight):
        return meta.empty((n, k), torch.float32)
    q = unpack_words(qweight, bits=bits, dim=0)  # (K, N)
    z = unpack_words(qzeros, bits=bits, dim=1)[:, :n] + zero_offset  # (G, N)
    g = g_idx.to(torch.int64)
    w = (q - z[g]).to(torch.float32) * scales.to(torch.float32)[g]
    return w.T.contiguous()


def gptq_quantize(
    weight: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    *,
    bits: int,
) -> torch.Tensor:
    """The GPTQ ``qweight`` of an ``(N, K)`` float ``weight`` with given per-group ``zeros`` (as used,
    ``(G, N)`` ints) and ``scales``: ``round(W / s) + z`` clamped to ``[0, 2**bits)``.

    A weight :func:`gptq_dequantize` produced comes back to its codes exactly (``W / s`` is then
    the integer ``q - z``).
    """
    g = g_idx.to(torch.int64)
    s = scales.to(torch.float32)[g]  # (K, N)
    q = torch.round(weight.to(torch.float32).T / s) + zeros.to(torch.float32)[g]
    q = q.clamp_(0, (1 << bits) - 1).to(torch.int32)
    return pack_words(q, bits=bits, dim=0)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


class QWeightHooks:
    """The hooks GPTQ and AWQ share: ``X.qweight`` stored with its companions (``companion_names``)
    next to it, scales checked for values a file controls, the config written back as read.

    A subclass sets ``companion_names``, ``format_name`` (for messages), ``_config``,
    ``group_size``, ``zero_codes_per_word`` and ``groups_in_order``.
    """

    companion_names: ClassVar[tuple[str, ...]]
    format_name: ClassVar[str]
    _config: dict[str, Any]
    group_size: int
    zero_codes_per_word: int  # zero points per qzeros int32 word
    groups_in_order: bool  # in-feature k is in group k // group_size (no act-order)

    def quantization_config(self) -> dict[str, Any]:
        """The ``quantization_config`` as read (or as built): a save writes it back unchanged."""
        return dict(self._config)

    def dequantized_name(self, key: str) -> str:
        """A dequantized save writes the floats of ``X.qweight`` as ``X.weight``."""
        return key.removesuffix("qweight") + "weight" if key.rpartition(".")[2] == "qweight" else key

    def companions(self, key: str, info: StoredTensor) -> tuple[str, ...]:
        prefix, _, name = key.rpartition(".")
        if name != "qweight":
            return ()
        return tuple(f"{prefix}.{c}" if prefix else c for c in self.companion_names)

    def companion_of(self, key: str) -> str | None:
        prefix, _, name = key.rpartition(".")
        return (f"{prefix}.qweight" if prefix else "qweight") if name in self.companion_names else None

    def checks(self, key: str, info: StoredTensor) -> bool:
        return key.rpartition(".")[2] == "scales"

    def check(self, key: str, tensor: torch.Tensor) -> None:
        """Scales are floats, finite and not negative.

        Raises:
            ConversionError: naming ``key``, the first bad scale and its value.
        """
        what = self.format_name
        if not tensor.is_floating_point():
            raise ConversionError(
                f"{key!r} is {tensor.dtype}; {what} scales are floats (float16 as written)."
            )
        bad = first_bad_scale(tensor, zero_allowed=True, limit=torch.finfo(torch.float32).max)
        if bad is not None:
            raise ConversionError(
                f"{key!r}: the scale at {bad[0]} is {bad[1]}; {what} scales are finite and >= 0."
            )

    def companion_region(self, key: str, companion: str, region: Region, info: StoredTensor) -> Region | None:
        """The columns of ``scales`` and words of ``qzeros`` covering a split of the out-features;
        for a split of the in-features, their rows (``g_idx``) and the groups those fall in, or
        every group where groups are not in order (GPTQ's act-order)."""
        name = companion.rpartition(".")[2]
        if region.dim % 2 == 0:  # out-features: every group, some columns
            if name == "scales":
                return Region.of(1, region.intervals)
            if name == "qzeros":
                f = self.zero_codes_per_word
                return Region.of(1, [(a // f, -(-b // f)) for a, b in region.intervals])
            return None
        if name == "g_idx":
            return Region.of(0, region.intervals)
        if name not in ("scales", "qzeros") or not self.groups_in_order or self.group_size <= 0:
            return None
        g = self.group_size
        return Region.of(0, [(a // g, -(-b // g)) for a, b in region.intervals])


class GPTQQuantizer(QWeightHooks):
    """Decode GPTQ checkpoints; re-encode them with the recorded zeros and scales on save.

    Build it with :meth:`from_config` from the checkpoint's ``quantization_config``, which it keeps
    exactly as read, so a save writes it back unchanged. :class:`~surgery.quantization.packed.KeepPacked`
    over it loads the packed tensors 1:1 into :class:`~surgery.quantization.packed.PackedLinear`
    modules instead of decoding them.

    Args:
        bits: code width (2, 4 or 8).
        group_size: in-features per scale group; ``-1``: one group per column.
        checkpoint_format: ``"gptq"`` (v1: zeros stored minus one) or ``"gptq_v2"``.
        config: the ``quantization_config`` to write back (default: built from the arguments).

    Example:
        >>> q = GPTQQuantizer.from_config({"quant_method": "gptq", "bits": 4, "group_size": 128})
        >>> q.bits, q.group_size, q.zero_offset
        (4, 128, 1)
    """

    method = "gptq"
    loads_in_transformers = True
    companion_names = _COMPANIONS
    format_name = "GPTQ"
    """The config is written back as read: transformers reads the copy as it read the source."""

    def __init__(
        self,
        *,
        bits: int = 4,
        group_size: int = 128,
        checkpoint_format: str = "gptq",
        config: Mapping[str, Any] | None = None,
    ) -> None:
        if bits not in GPTQ_BITS or isinstance(bits, bool):
            raise ConfigurationError(
                f"bits={bounded_repr(bits)}; GPTQ codes read here are {GPTQ_BITS} bits wide."
            )
        if not (_positive_int(group_size) or group_size == -1):
            raise ConfigurationError(f"group_size={bounded_repr(group_size)}; give a positive int or -1.")
        if checkpoint_format not in ("gptq", "gptq_v2"):
            raise ConfigurationError(
                f"checkpoint_format={bounded_repr(checkpoint_format)}; valid: 'gptq' (v1), 'gptq_v2'."
            )
        self.bits, self.group_size = bits, group_size
        self.zero_offset = 1 if checkpoint_format == "gptq" else 0
        self.zero_codes_per_word = 32 // bits
        self._config = dict(
            config
            if config is not None
            else {
                "quant_method": "gptq",
                "bits": bits,
                "group_size": group_size,
                "checkpoint_format": checkpoint_format,
            }
        )
        self.groups_in_order = not self._config.get("desc_act", False)  # act-order scatters the groups

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> GPTQQuantizer:
        """From a transformers ``GPTQConfig`` dict (``bits``, ``group_size``, ``checkpoint_format``; the rest kept).

        Raises:
            ConfigurationError: not a ``gptq`` config, or a field this reader does not support.
        """
        if not isinstance(config, Mapping) or config.get("quant_method") != "gptq":
            raise ConfigurationError(
                f"quantization_config={bounded_repr(config)}: GPTQQuantizer reads quant_method 'gptq' configs."
            )
        fmt = config.get("checkpoint_format", "gptq")
        return cls(
            bits=config.get("bits", 4),
            group_size=config.get("group_size", 128),
            checkpoint_format=fmt,
            config=config,
        )

    def __repr__(self) -> str:
        return (
            f"GPTQQuantizer(bits={self.bits}, group_size={self.group_size}, zero_offset={self.zero_offset})"
        )

    def _parts(self, key: str, companions: Mapping[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        prefix = key.rpartition(".")[0]
        out = []
        for c in _COMPANIONS:
            name = f"{prefix}.{c}" if prefix else c
            t = companions.get(name)
            if t is None:
                raise ConversionError(f"{key!r}: its {c} {name!r} is missing from the checkpoint.")
            out.append(t)
        return tuple(out)

    def check_layout(self, key: str, qweight: torch.Tensor, companions: Mapping[str, torch.Tensor]) -> None:
        """Shapes and dtypes of a ``qweight`` and its companions agree with the config.

        Raises:
            ConversionError: naming the key whose shape or dtype is wrong and the expected one.
        """
        qzeros, scales, g_idx = self._parts(key, companions)
        f = 32 // self.bits
        prefix = key.rpartition(".")[0] + "."
        for name, t in (("qweight", qweight), ("qzeros", qzeros), ("g_idx", g_idx)):
            if t.dtype != torch.int32:
                raise ConversionError(f"{prefix + name!r} is {t.dtype}; GPTQ stores it as int32.")
        if qweight.dim() != 2:
            raise ConversionError(
                f"{key!r} has shape {tuple(qweight.shape)}; GPTQ qweight is 2-D (K / {f}, N)."
            )
        k, n = qweight.shape[0] * f, qweight.shape[1]
        groups = 1 if self.group_size == -1 else math.ceil(k / self.group_size)
        expected = {"qzeros": (groups, math.ceil(n / f)), "scales": (groups, n), "g_idx": (k,)}
        for name, t in (("qzeros", qzeros), ("scales", scales), ("g_idx", g_idx)):
            if tuple(t.shape) != expected[name]:
                raise ConversionError(
                    f"{prefix + name!r} has shape {tuple(t.shape)}; a {self.bits}-bit GPTQ weight of "
                    f"{k} in- and {n} out-features in groups of {self.group_size} needs {expected[name]}."
                )

    def update_weight_conversions(self, transforms: list[WeightTransform]) -> list[WeightTransform]:
        """``X.qweight`` loads into ``X.weight`` (the model's parameter) once decoded."""
        return [*transforms, WeightRenaming(r"\.qweight$", ".weight")]

    def stored_region(self, key: str, region: Region, info: StoredTensor) -> Region:
        """The part of ``qweight`` (``(K / f, N)``) holding ``region`` of the decoded ``(N, K)`` weight.

        Raises:
            ConfigurationError: a split of the in-features not aligned to the codes per word.
        """
        return packed_region(key, region, pack_dim=0, factor=32 // self.bits)

    def decode(
        self,
        key: str,
        tensor: torch.Tensor,
        companions: dict[str, torch.Tensor],
        region: Region | None = None,
    ) -> torch.Tensor:
        """The float32 ``(N, K)`` weight of ``key`` (a ``qweight``), or its ``region`` given that part
        of the words (:meth:`stored_region`) and the whole companions."""
        qzeros, scales, g_idx = self._parts(key, companions)
        if region is None:
            self.check_layout(key, tensor, companions)
            return gptq_dequantize(
                tensor, qzeros, scales, g_idx, bits=self.bits, zero_offset=self.zero_offset
            )
        f = 32 // self.bits
        n = scales.shape[1]
        local = (tensor.shape[1], tensor.shape[0] * f)
        if meta.is_meta(tensor):
            return meta.empty(local, torch.float32)
        q = unpack_words(tensor, bits=self.bits, dim=0)  # (k_local, n_local)
        z = unpack_words(qzeros, bits=self.bits, dim=1)[:, :n] + self.zero_offset
        s = scales.to(torch.float32)
        g = g_idx.to(torch.int64)
        if region.dim == 0:  # out-features: every in-feature, some columns
            cols = interval_index(region)
            z, s = z[:, cols], s[:, cols]
        else:  # in-features: some rows, every column
            rows = interval_index(region)
            g = g[rows]
            if self.groups_in_order and self.group_size > 0 and not torch.equal(g, rows // self.group_size):
                raise ConversionError(
                    f"{key.removesuffix('qweight')}g_idx is not k // {self.group_size} although the config has no "
                    "act-order (desc_act): the file is inconsistent; set desc_act: true in its quantization_config."
                )
        return ((q - z[g]).to(torch.float32) * s[g]).T.contiguous()

    def int4_operands(
        self, key: str, qweight: torch.Tensor, companions: Mapping[str, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None:
        """``(codes (N, K) int32, scale (G, N), zero (G, N), group_size)`` for the int4 kernel, which
        computes ``(q - 8) * scale + zero``; ``None`` unless 4-bit in plain group order (no act-order).
        """
        if self.bits != 4 or self.group_size == -1:
            return None
        self.check_layout(key, qweight, companions)
        qzeros, scales, g_idx = self._parts(key, companions)
        k = qweight.shape[0] * 8
        if not torch.equal(g_idx.to(torch.int64), torch.arange(k, device=g_idx.device) // self.group_size):
            return None
        codes = unpack_words(qweight, bits=4, dim=0).T.contiguous()
        zeros = unpack_words(qzeros, bits=4, dim=1)[:, : qweight.shape[1]] + self.zero_offset
        s = scales.to(torch.float32)
        return codes, s, (8 - zeros).to(torch.float32) * s, self.group_size

    def encode(
        self, key: str, tensor: torch.Tensor, recorded: dict[str, torch.Tensor]
    ) -> dict[str, torch.Tensor]:
        """``tensor`` (``(N, K)`` floats) as ``qweight`` with the recorded zeros, scales and ``g_idx``."""
        qzeros, scales, g_idx = self._parts(key, recorded)
        zeros = unpack_words(qzeros, bits=self.bits, dim=1)[:, : tensor.shape[0]] + self.zero_offset
        prefix = key.rpartition(".")[0]
        out = {key: gptq_quantize(tensor, zeros, scales, g_idx, bits=self.bits)}
        out.update(
            {(f"{prefix}.{c}" if prefix else c): t for c, t in zip(_COMPANIONS, (qzeros, scales, g_idx))}
        )
        return out
