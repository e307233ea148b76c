"""Bit-level packing of small integers into ``int32`` words, as compressed-tensors ``pack-quantized`` stores them.

``num_bits``-bit signed values (``-2**(b-1) .. 2**(b-1)-1``) are offset by ``2**(b-1)`` to be
unsigned, then laid out densely along one dim, least significant bits first: value ``i`` of a
row occupies bits ``i*b .. i*b+b-1`` of the row's bit string, and word ``j`` holds bits
``32*j .. 32*j+31`` (a value may straddle two words when ``b`` does not divide 32). A row of
``n`` values takes ``ceil(n*b/32)`` words; the bits past the last value are zero.

Whole words hold whole values every :func:`pack_unit` values (8 for int4, 4 for int8, 32 for
int3), so a part of a packed row starting and ending at multiples of it is a part of the
packed tensor: that is how a tensor-parallel rank reads only its share.

Example:
    >>> q = torch.tensor([[-8, -1, 0, 7, 3, 2, 1, 0, 5]], dtype=torch.int8)
    >>> packed = pack_int32(q, 4)
    >>> packed.shape
    torch.Size([1, 2])
    >>> torch.equal(unpack_int32(packed, 4, 9), q)
    True
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..errors import ConversionError

__all__ = ["pack_int32", "pack_unit", "packed_length", "unpack_int32"]


def _check_bits(num_bits: int) -> None:
    if not isinstance(num_bits, int) or isinstance(num_bits, bool) or not 1 <= num_bits <= 8:
        raise ConversionError(f"num_bits={num_bits!r}; packing into int32 takes 1 to 8 bits per value.")


def packed_length(n: int, num_bits: int) -> int:
    """Words a row of ``n`` values of ``num_bits`` bits packs into: ``ceil(n * num_bits / 32)``."""
    _check_bits(num_bits)
    return math.ceil(n * num_bits / 32)


def pack_unit(num_bits: int) -> int:
    """The smallest number of values that fills whole words (8 for int4, 4 for int8, 32 for int3)."""
    _check_bits(num_bits)
    return 32 // math.gcd(32, num_bits)


def _layout(n: int, num_bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per value of a row of ``n``: its first word and its bit offset there."""
    start = torch.arange(n, dtype=torch.int64) * num_bits
    return start // 32, start % 32


def pack_int32(values: torch.Tensor, num_bits: int, *, dim: int = -1) -> torch.Tensor:
    """Signed ``num_bits``-bit ``values`` (any integer dtype) packed densely into ``int32`` along ``dim``.

    Raises:
        ConversionError: ``num_bits`` outside 1..8, or a value outside the signed range.
    """
    _check_bits(num_bits)
    if values.dtype.is_floating_point or values.dtype == torch.bool:
        raise ConversionError(f"pack_int32 takes integer values, got {values.dtype}.")
    offset = 1 << (num_bits - 1)
    if values.numel():
        lo, hi = torch.aminmax(values)
        if int(lo) < -offset or int(hi) >= offset:
            raise ConversionError(
                f"values outside the signed {num_bits}-bit range [{-offset}, {offset - 1}]."
            )
    moved = values.movedim(dim, -1)
    n = moved.shape[-1]
    words = packed_length(n, num_bits)
    if 32 % num_bits == 0:  # whole values per word (int1, 2, 4, 8): shift and add, in int32
        per = 32 // num_bits
        v32 = F.pad(moved.to(torch.int32) + offset, (0, words * per - n)).reshape(
            *moved.shape[:-1], words, per
        )
        shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=moved.device)
        return (v32 << shifts).sum(dim=-1, dtype=torch.int32).movedim(-1, dim).contiguous()
    v = moved.to(torch.int64) + offset
    word, shift = _layout(n, num_bits)
    out = torch.zeros((*v.shape[:-1], words + 1), dtype=torch.int64, device=v.device)
    low = (v << shift.to(v.device)) & 0xFFFFFFFF
    out.index_add_(-1, word.to(v.device), low)
    spill = shift + num_bits > 32
    if bool(spill.any()):
        idx = spill.nonzero().flatten()
        high = v[..., idx.to(v.device)] >> (32 - shift[idx]).to(v.device)
        out.index_add_(-1, (word[idx] + 1).to(v.device), high)
    out = out[..., :words]
    out = torch.where(out >= 1 << 31, out - (1 << 32), out).to(torch.int32)
    return out.movedim(-1, dim).contiguous()


def unpack_int32(packed: torch.Tensor, num_bits: int, n: int, *, dim: int = -1) -> torch.Tensor:
    """The ``n`` signed values per row that :func:`pack_int32` packed into ``packed`` along ``dim``, as int8.

    Raises:
        ConversionError: ``packed`` is not ``int32``, or has fewer words than ``n`` values need.
    """
    _check_bits(num_bits)
    if packed.dtype != torch.int32:
        raise ConversionError(f"packed values are {packed.dtype}; pack-quantized words are int32.")
    if packed.shape[dim] < packed_length(n, num_bits):
        raise ConversionError(
            f"{packed.shape[dim]} int32 words hold fewer than the {n} values of {num_bits} bits asked for "
            f"({packed_length(n, num_bits)} words)."
        )
    mask = (1 << num_bits) - 1
    offset = 1 << (num_bits - 1)
    if 32 % num_bits == 0:  # whole values per word: shift and mask, in int32
        w = packed.movedim(dim, -1)[..., : packed_length(n, num_bits)]
        shifts = torch.arange(0, 32, num_bits, dtype=torch.int32, device=w.device)
        v = ((w.unsqueeze(-1) >> shifts) & mask).reshape(*w.shape[:-1], -1)[..., :n]
        return (v - offset).to(torch.int8).movedim(-1, dim).contiguous()
    p = packed.movedim(dim, -1).to(torch.int64) & 0xFFFFFFFF
    word, shift = _layout(n, num_bits)
    word, shift = word.to(p.device), shift.to(p.device)
    p = torch.cat([p, torch.zeros_like(p[..., :1])], dim=-1)  # the word after the last, for spills
    low = p.index_select(-1, word) >> shift
    high = p.index_select(-1, word + 1) << (32 - shift)
    v = torch.where(shift + num_bits > 32, low | high, low) & mask
    return (v - offset).to(torch.int8).movedim(-1, dim).contiguous()
