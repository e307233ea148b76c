"""An FP8 block-wise quantizer written for the tests, independently of ``surgery.quantization``.

It turns float state dicts into the DeepSeek-V3 layout (``X.weight`` in ``float8_e4m3fn``,
``X.weight_scale_inv`` one float32 scale per block, edge blocks included) and dequantizes with
the ``repeat_interleave`` formula, so the loader is compared against an independent truth.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

E4M3_MAX = 448.0


def quantize(
    w: torch.Tensor, block: tuple[int, int], *, power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` for a 2-D ``w``: per block ``scale = amax / 448``, ``q = w / scale``."""
    n, k = w.shape
    b0, b1 = block
    nb, kb = math.ceil(n / b0), math.ceil(k / b1)
    scale = torch.ones(nb, kb)
    for i in range(nb):
        for j in range(kb):
            amax = w[i * b0 : (i + 1) * b0, j * b1 : (j + 1) * b1].abs().max().float()
            if amax > 0:
                s = amax / E4M3_MAX
                scale[i, j] = 2.0 ** math.ceil(math.log2(s)) if power_of_two else s
    full = scale.repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]
    return (w.float() / full).to(torch.float8_e4m3fn), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """The issue's formula: ``q.float() * scale`` expanded with ``repeat_interleave``, cropped."""
    n, k = q.shape
    b0, b1 = block
    return q.to(torch.float32) * scale.float().repeat_interleave(b0, 0)[:n].repeat_interleave(b1, 1)[:, :k]


def quantize_state(
    sd: dict[str, torch.Tensor],
    block: tuple[int, int],
    *,
    select: Callable[[str], bool] = lambda key: (
        key.endswith("_proj.weight")
        or key.endswith(".w1.weight")
        or key.endswith(".w2.weight")
        or key.endswith(".w3.weight")
    ),
    power_of_two: bool = False,
    scale_dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """``sd`` with every selected 2-D weight replaced by its FP8 values and ``<key>_scale_inv``."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if value.dim() == 2 and select(key):
            q, scale = quantize(value, block, power_of_two=power_of_two)
            out[key] = q
            out[key + "_scale_inv"] = scale.to(scale_dtype)
        else:
            out[key] = value
    return out


def dequantize_state(sd: dict[str, torch.Tensor], block: tuple[int, int]) -> dict[str, torch.Tensor]:
    """Every FP8 weight of ``sd`` dequantized (float32); scale keys dropped."""
    out: dict[str, torch.Tensor] = {}
    for key, value in sd.items():
        if key.endswith("_scale_inv"):
            continue
        if value.dtype == torch.float8_e4m3fn:
            out[key] = dequantize(value, sd[key + "_scale_inv"], block)
        else:
            out[key] = value
    return out
