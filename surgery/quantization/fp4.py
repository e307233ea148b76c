"""FP4 bit-level helpers: E2M1 values, E8M0 power-of-two scales, two 4-bit codes per ``uint8``.

* E2M1 (OCP microscaling FP4): a 4-bit code is sign (bit 3), two exponent bits and one mantissa
  bit; the 16 codes decode to ``±{0, 0.5, 1, 1.5, 2, 3, 4, 6}`` (:data:`E2M1_VALUES`, code 8 is -0).
* E8M0: an 8-bit biased exponent, the scale ``2 ** (byte - 127)``; byte 255 is NaN.
* Packing: two codes per byte, the **low nibble first** (element ``2i`` in bits 0-3, ``2i+1`` in
  bits 4-7), the layout of gpt-oss MXFP4 blocks and of compressed-tensors FP4 ``weight_packed``.

Every function is exact: :func:`e2m1_encode` of a decoded code gives the code back (``-0`` too),
and :func:`pack_nibbles` inverts :func:`unpack_nibbles`.

Example:
    >>> codes = torch.tensor([[1, 15, 8, 0]], dtype=torch.uint8)
    >>> pack_nibbles(codes)
    tensor([[241,   8]], dtype=torch.uint8)
    >>> e2m1_decode(unpack_nibbles(pack_nibbles(codes)))
    tensor([[ 0.5000, -6.0000, -0.0000,  0.0000]])
"""

from __future__ import annotations

import torch

__all__ = [
    "E2M1_MAX",
    "E2M1_VALUES",
    "E8M0_BIAS",
    "e2m1_decode",
    "e2m1_encode",
    "e8m0_exponent",
    "pack_nibbles",
    "unpack_nibbles",
]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
"""The value of each E2M1 code 0..15 (bit 3 is the sign)."""
E2M1_MAX = 6.0
"""The largest E2M1 magnitude."""
E8M0_BIAS = 127
"""An E8M0 byte ``b`` is the scale ``2 ** (b - 127)``."""

# Magnitude thresholds between neighbouring codes 0..7, and whether a value exactly on one rounds
# up: ties go to the code with an even mantissa bit (round half to even, as float casts do).
_THRESHOLDS = (
    (0.25, False),
    (0.75, True),
    (1.25, False),
    (1.75, True),
    (2.5, False),
    (3.5, True),
    (5.0, False),
)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``uint8`` ``[..., B]`` → codes ``uint8`` ``[..., 2B]``, the low nibble of each byte first."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"packed FP4 codes are uint8, not {packed.dtype}")
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """Codes ``[..., 2B]`` (values 0..15) → ``uint8`` ``[..., B]``, element ``2i`` in the low nibble."""
    if codes.shape[-1] % 2:
        raise ValueError(f"packing two codes per byte needs an even last dim, not {codes.shape[-1]}")
    pairs = codes.to(torch.uint8).reshape(*codes.shape[:-1], -1, 2)
    return pairs[..., 0] | (pairs[..., 1] << 4)


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """E2M1 codes (integers 0..15) → float32 values."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=codes.device)
    return lut[codes.to(torch.long)]


def e2m1_encode(x: torch.Tensor) -> torch.Tensor:
    """float values → the nearest E2M1 code (``uint8``), ties to even, magnitudes past 6 saturating.

    The sign comes from the sign bit, so ``-0.0`` encodes as code 8 and decodes back to ``-0.0``.
    NaN encodes as 0 (callers check for it first).
    """
    mag = x.to(torch.float32).abs()
    code = torch.zeros(x.shape, dtype=torch.uint8, device=x.device)
    for t, up in _THRESHOLDS:
        code += (mag >= t if up else mag > t).to(torch.uint8)
    return code | (torch.signbit(x).to(torch.uint8) << 3)


def e8m0_exponent(scale: torch.Tensor) -> torch.Tensor:
    """E8M0 bytes (``uint8``) → the ``int32`` power of two each stands for (``byte - 127``)."""
    return scale.to(torch.int32) - E8M0_BIAS
